//! Environment variable names, in one place.

/// Path of `cluster.toml`.
pub const CONFIG: &str = "BATON_CONFIG";
/// NATS server URL (overrides `nats.url`).
pub const NATS_URL: &str = "BATON_NATS_URL";
/// NATS user name (overrides `nats.user`).
pub const NATS_USER: &str = "BATON_NATS_USER";
/// NATS password (overrides `nats.password`).
pub const NATS_PASSWORD: &str = "BATON_NATS_PASSWORD";
/// NATS authentication token (overrides `nats.token`).
pub const NATS_TOKEN: &str = "BATON_NATS_TOKEN";
/// NATS user NKey seed (overrides `nats.nkey`).
pub const NATS_NKEY: &str = "BATON_NATS_NKEY";
/// File holding a NATS user NKey seed (overrides `nats.nkey_file`).
pub const NATS_NKEY_FILE: &str = "BATON_NATS_NKEY_FILE";
/// NATS credentials file, `.creds` (overrides `nats.creds`).
pub const NATS_CREDS: &str = "BATON_NATS_CREDS";
/// CA certificate that signed the NATS server's certificate (overrides `nats.tls_ca`).
pub const NATS_TLS_CA: &str = "BATON_NATS_TLS_CA";
/// Client certificate for mutual TLS with NATS (overrides `nats.tls_cert`).
pub const NATS_TLS_CERT: &str = "BATON_NATS_TLS_CERT";
/// Private key of the client certificate (overrides `nats.tls_key`).
pub const NATS_TLS_KEY: &str = "BATON_NATS_TLS_KEY";
/// `true` to refuse a NATS connection without TLS (overrides `nats.tls_required`).
pub const NATS_TLS_REQUIRED: &str = "BATON_NATS_TLS_REQUIRED";
/// First token of reply subjects (overrides `nats.inbox_prefix`).
pub const NATS_INBOX_PREFIX: &str = "BATON_NATS_INBOX_PREFIX";
/// Coordinator HTTP base URL the `baton` client uses (`http://host:port`).
pub const URL: &str = "BATON_URL";

/// The file where `scripts/up` writes the endpoints of the cluster it runs (`url=…` and
/// `nats=…` lines), read by the `baton` CLI when given neither `--url` nor `--nats`;
/// default `$XDG_STATE_HOME/baton/endpoints` (`~/.local/state/baton/endpoints`).
pub const ENDPOINTS: &str = "BATON_ENDPOINTS";
/// Subject prefix (overrides `nats.subject_prefix`).
pub const SUBJECT_PREFIX: &str = "BATON_SUBJECT_PREFIX";
/// Coordinator HTTP listen address (overrides `coordinator.listen`).
pub const LISTEN: &str = "BATON_LISTEN";
/// Directory of the coordinator's checkpoint store (overrides `coordinator.store_path`).
pub const STORE: &str = "BATON_STORE";
/// Checkpoint mode: `sync`, `async` or `off` (overrides `coordinator.checkpoint`).
pub const CHECKPOINT: &str = "BATON_CHECKPOINT";
/// Path of the GGUF model file a worker serves (overrides `worker.model`).
pub const MODEL: &str = "BATON_MODEL";
/// Public model name (overrides `worker.model_name`).
pub const MODEL_NAME: &str = "BATON_MODEL_NAME";
/// Backend a worker runs on: `cpu` or `cuda` (overrides `worker.backend`).
pub const BACKEND: &str = "BATON_BACKEND";
/// Weight format: `native`, `f16`, `f32` (overrides `worker.weights`).
pub const WEIGHTS: &str = "BATON_WEIGHTS";
/// API keys of the coordinator's HTTP API, comma-separated (replace `auth.api_keys`
/// when they hold at least one key).
pub const API_KEYS: &str = "BATON_API_KEYS";
/// Admin keys of the coordinator's HTTP API, comma-separated (replace
/// `auth.admin_keys` when they hold at least one key).
pub const ADMIN_KEYS: &str = "BATON_ADMIN_KEYS";
/// The key the `baton` client sends (`Authorization: Bearer <key>`).
pub const API_KEY: &str = "BATON_API_KEY";
/// Log filter, in `tracing_subscriber::EnvFilter` syntax.
pub const LOG: &str = "RUST_LOG";
/// Log format: `text` (default) or `json`.
pub const LOG_FORMAT: &str = "BATON_LOG_FORMAT";
/// Where the scripts keep what they download (wheels, llama.cpp's sources and its
/// vocabulary tests); `/var/tmp/baton` when unset.
pub const CACHE: &str = "BATON_CACHE";
/// When set (as `scripts/test` does), tests that need downloaded files (real models,
/// llama.cpp's vocabulary tests) fail when the files are absent instead of skipping.
pub const REQUIRE_DOWNLOADS: &str = "BATON_REQUIRE_DOWNLOADS";
