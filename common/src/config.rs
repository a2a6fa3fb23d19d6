//! `cluster.toml`: one file describes a cluster. Every field has a default; each binary's
//! flags and environment variables (see [`crate::env`]) override what the file says.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::secret::Secret;

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// How to reach NATS.
    pub nats: NatsConfig,
    /// The coordinator.
    pub coordinator: CoordinatorConfig,
    /// The workers (every worker of this file gets the same settings; flags differ).
    pub worker: WorkerConfig,
    /// Who may call the coordinator's HTTP API.
    pub auth: AuthConfig,
}

/// API keys of the coordinator's HTTP API. With no key at all the API is open to anyone
/// who reaches its port; with any key, every request but `/health` and the status page
/// needs one (`Authorization: Bearer <key>`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Keys that may generate, list models and reattach to their own streams.
    pub api_keys: Vec<Secret>,
    /// Keys that may do all that an API key may, and also call the admin routes
    /// (`/admin/*`, `/metrics`, `/v1/status`) and reattach to any stream.
    pub admin_keys: Vec<Secret>,
    /// Keys (each also in `api_keys` or `admin_keys`) whose chat messages may spell the
    /// model's special tokens and have them read as such, for clients that write turns of
    /// their own. Any other client's `<|im_start|>` in a message is plain text.
    pub special_token_keys: Vec<Secret>,
}

impl AuthConfig {
    /// Whether any key is configured (then the API needs one).
    pub fn enabled(&self) -> bool {
        !self.api_keys.is_empty() || !self.admin_keys.is_empty()
    }
}

/// NATS connection: where, as whom, and over what.
///
/// At most one way to authenticate may be set (`user` with `password`, `token`, `nkey`,
/// `nkey_file` or `creds`); [`crate::nats::connect_options`] refuses anything else.
/// Relative paths are relative to the process's working directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URL(s), comma-separated.
    pub url: String,
    /// Prefix of every subject.
    pub subject_prefix: String,
    /// User name, with `password`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Password of `user`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password: Option<Secret>,
    /// Authentication token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<Secret>,
    /// NKey seed of a user (`SU…`); the server knows its public key (`U…`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nkey: Option<Secret>,
    /// File holding the NKey seed, instead of `nkey`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nkey_file: Option<PathBuf>,
    /// Credentials file (`.creds`: a user JWT and its NKey seed) for servers run with
    /// operator JWTs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub creds: Option<PathBuf>,
    /// CA certificate(s) (PEM) that signed the server's certificate; replaces the
    /// system's roots. Implies TLS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for servers that verify clients (mutual TLS), with
    /// `tls_key`. Implies TLS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of `tls_cert`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// Refuse a connection that is not TLS (also implied by `tls_ca`, `tls_cert` and a
    /// `tls://` URL).
    pub tls_required: bool,
    /// First token of this process's reply subjects (`<inbox_prefix>.<random>`); a NATS
    /// user allowed to subscribe only to `<inbox_prefix>.>` cannot read others' replies.
    pub inbox_prefix: String,
    /// How often the connection pings its server, in milliseconds; after three pings
    /// without an answer the server counts as gone and the client moves to another URL.
    /// A server cut off (not closed) is found in about three of these.
    pub ping_interval_ms: u64,
}

/// NATS's own inbox prefix, the default of [`NatsConfig::inbox_prefix`].
pub const DEFAULT_INBOX_PREFIX: &str = "_INBOX";

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            subject_prefix: crate::subjects::DEFAULT_PREFIX.into(),
            user: None,
            password: None,
            token: None,
            nkey: None,
            nkey_file: None,
            creds: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_required: false,
            inbox_prefix: DEFAULT_INBOX_PREFIX.into(),
            ping_interval_ms: 2_000,
        }
    }
}

/// The coordinator's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// HTTP listen address.
    pub listen: String,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_limit: u32,
    /// `max_tokens` when a request gives none (0: what the context leaves after the
    /// prompt, up to `max_tokens_limit`).
    pub default_max_tokens: u32,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Time a request's body has to arrive in full, in milliseconds; slower bodies get
    /// 408 (0: no limit).
    pub body_timeout_ms: u64,
    /// Most open HTTP connections from one client address (0: no limit); requests on
    /// connections past it get 429 and the connection is closed.
    pub max_connections_per_client: u32,
    /// How long to wait for a worker to accept a submit, in milliseconds.
    pub submit_timeout_ms: u64,
    /// A worker silent for this long is dropped from the registry, in milliseconds.
    pub worker_timeout_ms: u64,
    /// A stream with no event for this long fails, in milliseconds.
    pub stream_timeout_ms: u64,
    /// While an SSE answer has nothing to send (queued, a long prefill), a comment line
    /// goes out this often so that proxies and clients keep the connection, in
    /// milliseconds (0: never).
    pub sse_keepalive_ms: u64,
    /// Directory of the checkpoint store (sled).
    pub store_path: String,
    /// Size of the checkpoint store's page cache (sled's `cache_capacity`), in MiB, as
    /// sled counts it: pages at their size in the file, which in memory take several
    /// times that. Pages past it are read back from the file when needed.
    pub store_cache_mib: u64,
    /// When a step's tokens reach clients, relative to the checkpoint store.
    pub checkpoint: CheckpointMode,
    /// How long a finished stream stays in the store for reconnecting clients, in
    /// seconds.
    pub reconnect_window_s: u64,
    /// Whether checkpoints also go to NATS JetStream, where they outlive this host and
    /// another coordinator takes over this one's streams when it dies.
    pub jetstream: JetStreamMode,
    /// Copies JetStream keeps of each checkpoint (0: as many as the NATS cluster has
    /// servers, at most 3). A write counts once a majority of them holds it.
    pub jetstream_replicas: u32,
    /// A coordinator whose lease in JetStream has not been renewed for this long is
    /// dead to the others, which take its unfinished streams over, in milliseconds.
    pub lease_ms: u64,
    /// A stream without a token for this long gets its worker probed, in milliseconds;
    /// a worker that is gone is then replaced at once.
    pub stall_probe_ms: u64,
    /// A stream without a token for this long moves to another worker even when its
    /// worker still answers probes, in milliseconds.
    pub stall_timeout_ms: u64,
    /// How long a stream that lost its worker waits for another one before it ends with
    /// an error, in milliseconds.
    pub resume_deadline_ms: u64,
    /// Most times one stream is resumed before it fails.
    pub max_resumes: u32,
    /// Most new streams of one model sent to a worker in one submit message.
    pub max_batch: u32,
    /// How long a new stream may wait for others to share its submit, in milliseconds.
    /// A stream never waits when no submit for its model went out in the last
    /// `max_wait_ms`; then it waits for that submit's reply or the end of that window.
    pub max_wait_ms: u64,
    /// Most streams this coordinator runs at once (dispatching or on a worker); beyond,
    /// requests get 429. Streams whose clients left are not counted: see
    /// `max_detached_streams`.
    pub max_streams: u32,
    /// Most streams held for a client to reattach after it left (within
    /// `reconnect_window_s`); past it the oldest are forgotten.
    pub max_detached_streams: u32,
    /// The same bound for each API key (when keys are configured), so that one key's
    /// abandoned streams cannot push out everyone else's.
    pub max_detached_per_key: u32,
    /// Route a request to the worker that most likely holds the start of its prompt in
    /// its prefix cache (while that worker is not much busier than the least loaded).
    pub prefix_routing: bool,
    /// How many more streams than the least loaded worker a worker holding the prompt's
    /// prefix may have and still be preferred.
    pub prefix_routing_slack: u32,
    /// Most prompt tokens a request may have (0: only the model's context bounds it);
    /// beyond, 400 `context_length_exceeded`. Workers count text and chat prompts after
    /// tokenizing; token-id prompts are counted here.
    pub max_prompt_tokens: u32,
    /// Most streams one API key holds open at once (0: no limit); beyond, 429. Applies
    /// only when API keys are configured.
    pub max_streams_per_key: u32,
    /// Origins whose browser pages may call the HTTP API (CORS): exact origins
    /// (`https://app.example.com`) or `*` for any; empty (the default): no CORS headers,
    /// so browsers keep other origins' pages out. Preflight requests never need a key.
    pub cors_origins: Vec<String>,
}

/// Whether checkpoints also go to NATS JetStream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JetStreamMode {
    /// When the NATS server has JetStream (the default); else the checkpoints stay in
    /// the local store alone, and the log says so.
    Auto,
    /// Always: the coordinator does not start without JetStream.
    On,
    /// Never.
    Off,
}

/// When tokens reach clients, relative to the checkpoint store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointMode {
    /// Each worker message's tokens are written and flushed (sled's flush: written to
    /// the file and synced) before any client sees them.
    Sync,
    /// Tokens are written to the store before any client sees them; sled flushes in the
    /// background every 500 ms. A stream's record is flushed once a worker takes it,
    /// and its tokens wait for that flush if they come first. A coordinator killed
    /// before a flush loses the last tokens; the resumed stream regenerates them (the
    /// sampler is counter-based) and a reconnecting client gets only what it lacks.
    /// The default.
    Async,
    /// No store: streams still survive a dead worker (resumed from the coordinator's
    /// memory) but not a coordinator restart.
    Off,
}

impl CheckpointMode {
    /// The name used in `cluster.toml`.
    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointMode::Sync => "sync",
            CheckpointMode::Async => "async",
            CheckpointMode::Off => "off",
        }
    }
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8000".into(),
            max_tokens_limit: 4096,
            default_max_tokens: 0,
            max_body_bytes: 1 << 20,
            body_timeout_ms: 30_000,
            max_connections_per_client: 1024,
            submit_timeout_ms: 5_000,
            worker_timeout_ms: 3_000,
            stream_timeout_ms: 60_000,
            sse_keepalive_ms: 15_000,
            store_path: "baton-data/coordinator".into(),
            store_cache_mib: 4,
            checkpoint: CheckpointMode::Async,
            reconnect_window_s: 600,
            jetstream: JetStreamMode::Auto,
            jetstream_replicas: 0,
            lease_ms: 3_000,
            stall_probe_ms: 200,
            stall_timeout_ms: 30_000,
            resume_deadline_ms: 30_000,
            max_resumes: 10,
            max_batch: 16,
            max_wait_ms: 5,
            max_streams: 4096,
            max_detached_streams: 4096,
            max_detached_per_key: 256,
            prefix_routing: true,
            prefix_routing_slack: 4,
            max_prompt_tokens: 0,
            max_streams_per_key: 0,
            cors_origins: Vec::new(),
        }
    }
}

/// A worker's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// GGUF model file.
    pub model: String,
    /// Name clients use for the model (default: the file name without `.gguf`).
    pub model_name: Option<String>,
    /// `cpu` or `cuda`.
    pub backend: String,
    /// Weight format in memory: `native-i16` (GGUF blocks, CPU, 16-bit integer inputs
    /// for generated tokens; the default), `native-i8` (the same, prompts on 8-bit
    /// inputs), `native` (the same, f32 inputs), `f16` or `f32`.
    pub weights: String,
    /// How the host store keeps keys and values: `f16` (the default; half the memory and
    /// half the bytes attention reads) or `f32`. Part of the model's fingerprint, as the
    /// weight format is: workers resume each other's streams only with the same one.
    pub kv_dtype: String,
    /// Most sequences running at once.
    pub max_running: u32,
    /// Most sequences waiting to run.
    pub max_queued: u32,
    /// KV cache budget, in MiB.
    pub kv_budget_mib: u64,
    /// Budget of the prefix cache (keys and values of prompt blocks kept across
    /// requests), in MiB; 0 disables it.
    pub prefix_cache_mib: u64,
    /// Most tokens one decode step runs through the model: each generating sequence's
    /// token, then prompts, a longer prompt in chunks over several steps (chunked
    /// prefill), so that a long prompt holds the running streams up for one bounded
    /// step at a time; 0: no limit (a prompt always runs whole).
    pub max_step_tokens: u32,
    /// Heartbeat period, in milliseconds.
    pub heartbeat_interval_ms: u64,
    /// Watch the model file: when it (or the `.sha256` beside it) changes and then
    /// holds still for one poll, load it beside the running model and switch to it, as
    /// an operator's load order would (its SHA-256 from the `.sha256` beside it).
    pub watch_model: bool,
    /// How often the watched model file is looked at, in milliseconds.
    pub watch_interval_ms: u64,
    /// A draining worker lets its streams run this long, then hands those still running
    /// over to other workers (they resume from their checkpoints) and leaves, in
    /// milliseconds.
    pub drain_handover_ms: u64,
    /// Address of the worker's Prometheus `/metrics` (port 0: any free port, logged at
    /// start; empty: none).
    pub metrics_listen: String,
    /// Threads running the model on CPU (0: `RAYON_NUM_THREADS`, else one per core).
    pub compute_threads: u32,
    /// Scheduling class of those threads: `idle` (Linux `SCHED_IDLE`: any other runnable
    /// thread of the host preempts them at once; the default) or `normal`.
    pub compute_priority: String,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            model: "models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            model_name: None,
            backend: "cpu".into(),
            weights: "native-i16".into(),
            kv_dtype: "f16".into(),
            max_running: 16,
            max_queued: 64,
            kv_budget_mib: 1024,
            prefix_cache_mib: 256,
            max_step_tokens: 256,
            heartbeat_interval_ms: 500,
            drain_handover_ms: 30_000,
            watch_model: false,
            watch_interval_ms: 2_000,
            metrics_listen: "127.0.0.1:0".into(),
            compute_threads: 0,
            compute_priority: "idle".into(),
        }
    }
}

impl WorkerConfig {
    /// The model's public name.
    pub fn model_name(&self) -> String {
        self.model_name.clone().unwrap_or_else(|| {
            Path::new(&self.model)
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| self.model.clone())
        })
    }
}

/// Why the configuration could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid for these types.
    #[error("invalid {path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// Why.
        source: Box<toml::de::Error>,
    },
}

impl ClusterConfig {
    /// Reads `path`; a missing file at the default location gives the defaults.
    pub fn load(path: &Path, must_exist: bool) -> Result<Self, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if !must_exist && e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self::default())
            }
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        Self::parse(&text).map_err(|source| ConfigError::Parse {
            path: path.display().to_string(),
            source: Box::new(source),
        })
    }

    /// Parses TOML text.
    pub fn parse(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults_and_fields_override() {
        assert_eq!(
            ClusterConfig::parse("").expect("empty"),
            ClusterConfig::default()
        );
        let c = ClusterConfig::parse(
            "[coordinator]\nlisten = \"0.0.0.0:9000\"\n[worker]\nmax_running = 4\n",
        )
        .expect("parse");
        assert_eq!(c.coordinator.listen, "0.0.0.0:9000");
        assert_eq!(
            c.coordinator.store_cache_mib, 4,
            "sled's page cache is bounded"
        );
        assert_eq!(c.worker.max_running, 4);
        assert_eq!(c.nats, NatsConfig::default());
    }

    #[test]
    fn nats_credentials_and_tls_parse_and_secrets_never_print() {
        let c = ClusterConfig::parse(
            "[nats]\nuser = \"coordinator\"\npassword = \"hunter2\"\n\
             tls_ca = \"certs/ca.pem\"\ntls_required = true\ninbox_prefix = \"_INBOX_c\"\n",
        )
        .expect("parse");
        assert_eq!(c.nats.user.as_deref(), Some("coordinator"));
        assert_eq!(
            c.nats.password.as_ref().map(Secret::expose),
            Some("hunter2")
        );
        assert_eq!(c.nats.tls_ca, Some(PathBuf::from("certs/ca.pem")));
        assert!(c.nats.tls_required);
        assert_eq!(c.nats.inbox_prefix, "_INBOX_c");
        assert!(!format!("{c:?}").contains("hunter2"));
        assert_eq!(NatsConfig::default().inbox_prefix, DEFAULT_INBOX_PREFIX);
    }

    #[test]
    fn unknown_fields_are_errors() {
        assert!(ClusterConfig::parse("[worker]\nmax_runing = 4\n").is_err());
    }

    #[test]
    fn keys_are_read_and_never_printed() {
        let c = ClusterConfig::parse(
            "[auth]\napi_keys = [\"sk-one\", \"sk-two\"]\nadmin_keys = [\"sk-admin\"]\n",
        )
        .expect("parse");
        assert!(c.auth.enabled());
        assert_eq!(c.auth.api_keys[1].expose(), "sk-two");
        assert_eq!(c.auth.admin_keys[0].expose(), "sk-admin");
        let shown = format!("{c:?}");
        assert!(!shown.contains("sk-"), "{shown}");
        assert!(!ClusterConfig::default().auth.enabled());
    }

    #[test]
    fn model_name_defaults_to_the_file_stem() {
        let w = WorkerConfig::default();
        assert_eq!(w.model_name(), "SmolLM2-135M-Instruct.Q4_1");
    }

    #[test]
    fn the_repository_cluster_toml_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster.toml");
        if path.exists() {
            ClusterConfig::load(&path, true).expect("cluster.toml");
        }
    }
}
