//! A whole cluster on one machine: NATS, a coordinator and workers as real processes.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use tempfile::TempDir;

use crate::{
    http::Api,
    netns::{self, Host, Lab},
    process::{bin, free_port, Nats, Process},
    secure::{NatsSecurity, Role},
    workspace_root,
};

/// The default model, relative to the repository root (installed by `scripts/setup`).
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Its name on the API: the file name without `.gguf`.
pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct.Q4_1";

/// How long a cluster may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The absolute path of the default model.
pub fn default_model_path() -> PathBuf {
    workspace_root().join(DEFAULT_MODEL)
}

/// The engine behind every worker of a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// The real default model.
    Real,
    /// The simulated engine (no model), one token per `step_ms` milliseconds.
    Simulated {
        /// Milliseconds per decode step.
        step_ms: u64,
    },
}

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// How many workers (0: a coordinator alone).
    pub workers: usize,
    /// Their engine.
    pub engine: Engine,
    /// Extra `cluster.toml` text appended to the generated file's sections, as
    /// `(section, lines)`, e.g. `("coordinator", "max_body_bytes = 4096")`.
    pub extra: Vec<(&'static str, String)>,
    /// A NATS server with accounts, permissions (and TLS), and each process's
    /// credentials; `None`: an open server.
    pub security: Option<Arc<NatsSecurity>>,
    /// API keys of the coordinator (none: its API is open).
    pub keys: ApiKeys,
    /// The GGUF files real workers serve, worker `k` the `k % len`-th (empty: the
    /// default model).
    pub models: Vec<PathBuf>,
    /// How many `nats-server`s, joined as one NATS cluster (1: a server alone). Every
    /// process is given all of their URLs.
    pub nats_servers: usize,
    /// Every process in a network namespace of its own ([`crate::netns`]), so that a
    /// drill can cut one off.
    pub partitioned: bool,
    /// The `nats-server`s run JetStream, so coordinators keep checkpoints there too.
    pub jetstream: bool,
}

/// API keys a test cluster's coordinator takes from its environment (`BATON_API_KEYS`,
/// `BATON_ADMIN_KEYS`), as an operator would give them.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    /// API keys.
    pub api: Vec<String>,
    /// Admin keys.
    pub admin: Vec<String>,
}

impl ApiKeys {
    /// The key the cluster's own [`Api`] sends: the first admin key, else the first API
    /// key, else none.
    fn harness_key(&self) -> Option<&str> {
        self.admin.first().or(self.api.first()).map(String::as_str)
    }

    /// Puts the keys in a coordinator's environment.
    fn apply(&self, cmd: &mut Command) {
        for (name, keys) in [
            ("BATON_API_KEYS", &self.api),
            ("BATON_ADMIN_KEYS", &self.admin),
        ] {
            if !keys.is_empty() {
                cmd.env(name, keys.join(","));
            }
        }
    }
}

impl ClusterOptions {
    /// `workers` simulated workers, 20 ms a token.
    pub fn simulated(workers: usize) -> ClusterOptions {
        ClusterOptions {
            workers,
            engine: Engine::Simulated { step_ms: 20 },
            extra: Vec::new(),
            security: None,
            keys: ApiKeys::default(),
            models: Vec::new(),
            nats_servers: 1,
            partitioned: false,
            jetstream: false,
        }
    }

    /// `workers` workers running the default model.
    pub fn real(workers: usize) -> ClusterOptions {
        ClusterOptions {
            workers,
            engine: Engine::Real,
            extra: Vec::new(),
            security: None,
            keys: ApiKeys::default(),
            models: Vec::new(),
            nats_servers: 1,
            partitioned: false,
            jetstream: false,
        }
    }

    /// Gives the coordinator these API and admin keys; the cluster's [`Api`] then sends
    /// the first admin key (or, without one, the first API key).
    pub fn keys(mut self, api: &[&str], admin: &[&str]) -> ClusterOptions {
        self.keys = ApiKeys {
            api: api.iter().map(|k| k.to_string()).collect(),
            admin: admin.iter().map(|k| k.to_string()).collect(),
        };
        self
    }

    /// Real workers serve these files (each named by its file stem), in turn, instead
    /// of the default model.
    pub fn models(mut self, paths: Vec<PathBuf>) -> ClusterOptions {
        self.models = paths;
        self
    }

    /// The model file of the `k`-th worker started.
    fn model_path(&self, k: usize) -> PathBuf {
        match self.models.len() {
            0 => default_model_path(),
            n => self.models[k % n].clone(),
        }
    }

    /// The name requests use for the first worker's model.
    fn model_name(&self) -> String {
        match self.models.first() {
            Some(p) => p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
            None => DEFAULT_MODEL_NAME.to_string(),
        }
    }

    /// Sets the simulated engine's pace.
    pub fn step_ms(mut self, step_ms: u64) -> ClusterOptions {
        self.engine = Engine::Simulated { step_ms };
        self
    }

    /// Runs the cluster on `n` `nats-server`s joined as one NATS cluster.
    pub fn nats_servers(mut self, n: usize) -> ClusterOptions {
        self.nats_servers = n.max(1);
        self
    }

    /// Runs the `nats-server`s with JetStream: coordinators keep their checkpoints there
    /// too and take over each other's streams.
    pub fn jetstream(mut self) -> ClusterOptions {
        self.jetstream = true;
        self
    }

    /// Runs every process (`nats-server`s, coordinator, workers) in a network namespace
    /// of its own, joined by a bridge: [`Cluster::cut`] takes one off the network.
    /// Processes ping their NATS server every 500 ms, servers their routes every second.
    pub fn partitioned(mut self) -> ClusterOptions {
        self.partitioned = true;
        self.extra.push(("nats", "ping_interval_ms = 500".into()));
        self
    }

    /// Runs the cluster on a NATS server with `security`'s accounts, permissions and
    /// TLS: the coordinator and the workers connect with their roles' credentials.
    pub fn secured(mut self, security: Arc<NatsSecurity>) -> ClusterOptions {
        self.extra.push(("nats", security.cluster_toml_lines()));
        self.security = Some(security);
        self
    }
}

/// A coordinator started beside a cluster's first ([`Cluster::start_coordinator`]).
pub struct Coordinator {
    /// Its process (killed on drop).
    pub process: Process,
    /// Its API.
    pub api: Api,
}

/// A running cluster; everything stops when it is dropped.
///
/// Field order is drop order: workers and coordinator go before NATS, the directory
/// holding configuration and logs last.
pub struct Cluster {
    /// The workers, `worker-0` …
    pub workers: Vec<Process>,
    /// The coordinator.
    pub coordinator: Process,
    /// The NATS server (the first of them, with [`ClusterOptions::nats_servers`]).
    pub nats: Nats,
    /// The other servers of the NATS cluster.
    pub nats_peers: Vec<Nats>,
    /// The coordinator's API.
    pub api: Api,
    /// The model name requests use.
    pub model: String,
    /// The generated `cluster.toml`.
    pub config: PathBuf,
    options: ClusterOptions,
    /// Coordinator restarts so far (names their logs).
    restarts: usize,
    /// Coordinators started beside the first (names their logs and stores).
    coordinators: usize,
    /// Workers started so far, replacements included (names their logs).
    spawned: usize,
    /// The coordinator's network namespace, in a partitioned cluster.
    coordinator_host: Option<Host>,
    /// Each worker slot's network namespace, in a partitioned cluster.
    worker_hosts: Vec<Option<Host>>,
    /// The namespaces, deleted once every process is gone.
    lab: Option<Lab>,
    dir: TempDir,
}

impl Cluster {
    /// Starts a cluster and waits until it serves: `/health` is 200 with every worker
    /// counted and `/v1/models` lists the model (with no workers: until `/health`
    /// answers at all). `None`, after a printed note, when `nats-server` or (for real
    /// workers) the model file is missing.
    pub fn start(options: ClusterOptions) -> Option<Cluster> {
        if options.engine == Engine::Real
            && !(0..options.models.len().max(1)).all(|k| model_available(&options.model_path(k)))
        {
            return None;
        }
        let mut lab = if options.partitioned {
            assert!(
                options.security.is_none(),
                "the harness secures NATS outside namespaces only"
            );
            Some(Lab::new()?)
        } else {
            None
        };
        let (nats, nats_peers) = match (&options.security, options.nats_servers) {
            _ if lab.is_some() => {
                let hosts = (0..options.nats_servers)
                    .map(|i| lab.as_mut().map(|l| l.host(&format!("nats-{i}"))))
                    .collect();
                let mut servers = Nats::start_cluster_in(hosts, options.jetstream)?;
                let first = servers.remove(0);
                (first, servers)
            }
            (Some(security), 1) => (security.start_nats()?, Vec::new()),
            (Some(_), n) => panic!("the harness runs a secured NATS as one server, not {n}"),
            (None, 1) if options.jetstream => (Nats::start_jetstream()?, Vec::new()),
            (None, 1) => (Nats::start()?, Vec::new()),
            (None, n) => {
                let mut servers = Nats::start_cluster(n, options.jetstream)?;
                let first = servers.remove(0);
                (first, servers)
            }
        };
        let nats_url = std::iter::once(&nats)
            .chain(&nats_peers)
            .map(|n| n.url.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let dir = tempfile::tempdir().expect("creating a temporary directory");
        let coordinator_host = lab.as_mut().map(|l| l.host("coordinator"));
        let at = netns::address(coordinator_host.as_ref()).to_string();
        let mut last = String::new();
        // The coordinator's port is picked free but may be taken before it binds: retry.
        for attempt in 0..3 {
            let port = free_port();
            let config = dir.path().join(format!("cluster-{attempt}.toml"));
            let store = dir.path().join("store");
            let listen = format!("{at}:{port}");
            std::fs::write(&config, config_text(&options, &nats_url, &listen, &store))
                .expect("writing cluster.toml");
            let mut cmd = with_credentials(
                command(
                    coordinator_host.as_ref(),
                    "baton-coordinator",
                    None,
                    &config,
                ),
                &options,
                Role::Coordinator,
            );
            options.keys.apply(&mut cmd);
            let mut coordinator =
                Process::spawn(&format!("coordinator-{attempt}"), cmd, dir.path());
            let mut api = Api::new(&format!("http://{listen}"));
            if let Some(key) = options.keys.harness_key() {
                api = api.with_key(key);
            }
            if !wait_listening(&mut coordinator, &api) {
                // Exited early (a taken port, most likely).
                last = coordinator.log();
                continue;
            }
            let mut cluster = Cluster {
                workers: Vec::new(),
                coordinator,
                nats,
                nats_peers,
                api,
                model: options.model_name(),
                config,
                options,
                restarts: 0,
                coordinators: 0,
                spawned: 0,
                coordinator_host,
                worker_hosts: Vec::new(),
                lab,
                dir,
            };
            for _ in 0..cluster.options.workers {
                cluster.add_worker();
            }
            cluster.wait_ready(cluster.options.workers);
            return Some(cluster);
        }
        panic!("the coordinator did not start after 3 attempts; its last log:\n{last}");
    }

    /// Kills the coordinator (`SIGKILL`) and starts it again with the same
    /// configuration, port and checkpoint store; waits until it answers HTTP.
    pub fn restart_coordinator(&mut self) {
        self.coordinator.kill();
        self.restarts += 1;
        let name = format!("coordinator-restart-{}", self.restarts);
        let mut cmd = with_credentials(
            command(
                self.coordinator_host.as_ref(),
                "baton-coordinator",
                None,
                &self.config,
            ),
            &self.options,
            Role::Coordinator,
        );
        self.options.keys.apply(&mut cmd);
        self.coordinator = Process::spawn(&name, cmd, self.dir.path());
        if !wait_listening(&mut self.coordinator, &self.api) {
            panic!(
                "the coordinator did not come back:
{}",
                self.coordinator.log()
            );
        }
    }

    /// Kills the coordinator (`SIGKILL`), deletes its checkpoint store, and starts a
    /// fresh one in its place (same configuration and port, so another id): what a
    /// coordinator host lost with its disk looks like.
    pub fn replace_coordinator(&mut self) {
        self.coordinator.kill();
        let store = self.dir.path().join("store");
        std::fs::remove_dir_all(&store).expect("deleting the coordinator's store");
        self.restart_coordinator();
    }

    /// Starts one more coordinator on this cluster's NATS (its own port and store), and
    /// waits until it counts every live worker.
    pub fn start_coordinator(&mut self) -> Coordinator {
        self.coordinators += 1;
        let n = self.coordinators;
        let at = netns::address(self.coordinator_host.as_ref()).to_string();
        for attempt in 0..3 {
            let listen = format!("{at}:{}", free_port());
            let config = self
                .dir
                .path()
                .join(format!("cluster-coordinator-{n}-{attempt}.toml"));
            let store = self.dir.path().join(format!("store-{n}"));
            std::fs::write(
                &config,
                config_text(&self.options, &self.nats_url(), &listen, &store),
            )
            .expect("writing cluster.toml");
            let mut cmd = with_credentials(
                command(
                    self.coordinator_host.as_ref(),
                    "baton-coordinator",
                    None,
                    &config,
                ),
                &self.options,
                Role::Coordinator,
            );
            self.options.keys.apply(&mut cmd);
            let mut process =
                Process::spawn(&format!("coordinator{n}-{attempt}"), cmd, self.dir.path());
            let mut api = Api::new(&format!("http://{listen}"));
            if let Some(key) = self.options.keys.harness_key() {
                api = api.with_key(key);
            }
            if wait_listening(&mut process, &api) {
                let workers = self.workers.len() as u64;
                let deadline = Instant::now() + START_TIMEOUT;
                while api
                    .get("/health")
                    .ok()
                    .filter(|r| r.status == 200)
                    .and_then(|r| r.body["workers"].as_u64())
                    .unwrap_or(0)
                    < workers
                {
                    assert!(
                        Instant::now() < deadline && process.try_status().is_none(),
                        "coordinator {n} did not count the workers:\n{}",
                        process.log()
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
                return Coordinator { process, api };
            }
        }
        panic!("coordinator {n} did not start after 3 attempts");
    }

    /// Every NATS URL of the cluster, comma-separated.
    pub fn nats_url(&self) -> String {
        std::iter::once(&self.nats)
            .chain(&self.nats_peers)
            .map(|n| n.url.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Kills `nats-server`, waits `down`, and starts it again on the same port.
    pub fn restart_nats(&mut self, down: Duration) {
        self.nats.restart(down);
    }

    /// How many `nats-server`s the cluster runs on.
    pub fn nats_count(&self) -> usize {
        1 + self.nats_peers.len()
    }

    /// The `i`-th `nats-server` (0 is [`Cluster::nats`]).
    pub fn nats_server(&mut self, i: usize) -> &mut Nats {
        match i {
            0 => &mut self.nats,
            _ => &mut self.nats_peers[i - 1],
        }
    }

    /// The `nats-server` that holds the connection named `name` (or starting with it)
    /// now, found through each server's monitoring; `None` when none does (a process
    /// between servers) or the servers have no monitoring (a server alone).
    pub fn nats_server_of(&self, name: &str) -> Option<usize> {
        std::iter::once(&self.nats)
            .chain(&self.nats_peers)
            .position(|n| n.connection_names().iter().any(|c| c.starts_with(name)))
    }

    /// The index of the worker running `stream` now, from the coordinator's log.
    pub fn worker_of(&self, stream: &str) -> Option<usize> {
        let log = self.coordinator.log();
        let worker = log
            .lines()
            .filter(|l| {
                l.contains("stream accepted") && field(l, "stream").as_deref() == Some(stream)
            })
            .filter_map(|l| field(l, "worker"))
            .next_back()?;
        (0..self.workers.len()).find(|&i| self.worker_id(i).as_deref() == Some(worker.as_str()))
    }

    /// Starts one more worker (not waiting for it to join); returns its index.
    pub fn add_worker(&mut self) -> usize {
        let slot = self.workers.len();
        let host = self
            .lab
            .as_mut()
            .map(|l| l.host(&format!("worker slot {slot}")));
        self.worker_hosts.push(host);
        let worker = self.spawn_worker(slot);
        self.workers.push(worker);
        slot
    }

    /// Starts a new worker process in slot `index` (not waiting for it to join), after
    /// killing (`SIGKILL`) the one there if it still runs. Its log is a new file; the
    /// old process's log is kept.
    pub fn restart_worker(&mut self, index: usize) {
        self.workers[index].kill();
        self.workers[index] = self.spawn_worker(index);
    }

    fn spawn_worker(&mut self, slot: usize) -> Process {
        let mut cmd = with_credentials(
            command(
                self.worker_hosts[slot].as_ref(),
                "baton-worker",
                Some("serve"),
                &self.config,
            ),
            &self.options,
            Role::Worker,
        );
        if let Engine::Simulated { step_ms } = self.options.engine {
            cmd.args(["--simulated", "--sim-step-ms", &step_ms.to_string()]);
        } else if !self.options.models.is_empty() {
            cmd.arg("--model")
                .arg(self.options.model_path(self.spawned));
        }
        // The first workers are `worker-0` …; a replacement of slot 1 started as the
        // fourth process is `worker-3`.
        let name = format!("worker-{}", self.spawned);
        self.spawned += 1;
        Process::spawn(&name, cmd, self.dir.path())
    }

    /// Waits until `/health` reports at least `workers` live workers and `/v1/models`
    /// lists the model; panics with every log after a minute.
    pub fn wait_ready(&mut self, workers: usize) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            self.assert_alive();
            if workers == 0 {
                return;
            }
            let health = self.api.get("/health").ok();
            let counted = health
                .as_ref()
                .filter(|r| r.status == 200)
                .and_then(|r| r.body["workers"].as_u64())
                .unwrap_or(0);
            if counted >= workers as u64 && self.lists_model() {
                return;
            }
            if Instant::now() >= deadline {
                panic!(
                    "the cluster was not ready after {START_TIMEOUT:?} (last /health: {:?})\n{}",
                    health.map(|r| (r.status, r.body)),
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether `/v1/models` lists the model.
    fn lists_model(&self) -> bool {
        self.api.get("/v1/models").ok().is_some_and(|r| {
            r.status == 200
                && r.body["data"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|m| m["id"] == self.model.as_str())
        })
    }

    /// Panics (with the logs) if the coordinator or a worker has exited.
    pub fn assert_alive(&mut self) {
        let mut dead = Vec::new();
        if let Some(status) = self.coordinator.try_status() {
            dead.push(format!("coordinator exited ({status})"));
        }
        for w in &mut self.workers {
            if let Some(status) = w.try_status() {
                dead.push(format!("{} exited ({status})", w.name));
            }
        }
        assert!(dead.is_empty(), "{}\n{}", dead.join("; "), self.logs());
    }

    /// The worker id `baton-worker` logged at start (`worker ready worker=<id>`).
    pub fn worker_id(&self, index: usize) -> Option<String> {
        self.workers[index]
            .log()
            .lines()
            .find(|l| l.contains("worker ready"))
            .and_then(|l| field(l, "worker"))
    }

    /// The address of worker `index`'s metrics endpoint, as it logged it at start
    /// (`metrics listening addr=<host:port>`).
    pub fn worker_metrics_addr(&self, index: usize) -> Option<String> {
        self.workers[index]
            .log()
            .lines()
            .find(|l| l.contains("metrics listening"))
            .and_then(|l| field(l, "addr"))
    }

    /// Worker `index`'s Prometheus text, scraped now.
    pub fn worker_metrics(&self, index: usize) -> String {
        let addr = self
            .worker_metrics_addr(index)
            .expect("the worker logs its metrics address");
        Api::new(&format!("http://{addr}"))
            .get("/metrics")
            .expect("GET the worker's /metrics")
            .body
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Cuts a process of a partitioned cluster off the network (see [`crate::netns`]).
    pub fn cut(&self, host: &Host) {
        self.lab
            .as_ref()
            .expect("a partitioned cluster (ClusterOptions::partitioned)")
            .cut(host);
    }

    /// Puts it back.
    pub fn heal(&self, host: &Host) {
        self.lab
            .as_ref()
            .expect("a partitioned cluster (ClusterOptions::partitioned)")
            .heal(host);
    }

    /// The coordinator's namespace, in a partitioned cluster.
    pub fn coordinator_host(&self) -> Option<&Host> {
        self.coordinator_host.as_ref()
    }

    /// Worker slot `index`'s namespace, in a partitioned cluster.
    pub fn worker_host(&self, index: usize) -> Option<&Host> {
        self.worker_hosts.get(index).and_then(Option::as_ref)
    }

    /// The tails of every process's log, for panic messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for p in std::iter::once(&self.coordinator)
            .chain(&self.workers)
            .chain(std::iter::once(&self.nats.process))
            .chain(self.nats_peers.iter().map(|n| &n.process))
        {
            out.push_str(&format!(
                "----- {} (pid {}) -----\n{}\n",
                p.name,
                p.pid(),
                p.log_tail(6000)
            ));
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
    }
}

/// The value of `key=value` in a plain (no colour) tracing line.
pub fn field(line: &str, key: &str) -> Option<String> {
    let pattern = format!("{key}=");
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(pattern.as_str()))
        .map(|v| v.trim_matches('"').to_string())
}

/// Whether the model file is there; prints a note when it is not.
pub fn model_available(path: &Path) -> bool {
    if path.is_file() {
        return true;
    }
    eprintln!(
        "note: skipped: {} is missing (scripts/setup installs it)",
        path.display()
    );
    false
}

/// Waits until the coordinator answers HTTP; false if it exited first.
fn wait_listening(coordinator: &mut Process, api: &Api) -> bool {
    let deadline = Instant::now() + START_TIMEOUT;
    while Instant::now() < deadline {
        if coordinator.try_status().is_some() {
            return false;
        }
        if api.get("/health").is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "the coordinator did not answer HTTP within {START_TIMEOUT:?}; its log:\n{}",
        coordinator.log()
    );
}

/// A binary's command (with its subcommand) and `--config`, plain logs at info level
/// and none of the caller's `BATON_*` settings.
fn command(
    host: Option<&Host>,
    binary: &str,
    subcommand: Option<&str>,
    config: &std::path::Path,
) -> Command {
    let mut cmd = netns::command(host, bin(binary));
    cmd.args(subcommand);
    cmd.arg("--config").arg(config);
    cmd.current_dir(workspace_root());
    set_env(&mut cmd);
    cmd
}

/// `cmd` with `role`'s NATS credentials in its environment, when the cluster has them.
fn with_credentials(mut cmd: Command, options: &ClusterOptions, role: Role) -> Command {
    if let Some(security) = &options.security {
        cmd.envs(security.env(role));
    }
    cmd
}

fn set_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("BATON_") && key != "BATON_BIN_DIR" {
            cmd.env_remove(key);
        }
    }
    cmd.env("RUST_LOG", "info").env("NO_COLOR", "1");
}

/// The `cluster.toml` of a test cluster.
fn config_text(
    options: &ClusterOptions,
    nats_url: &str,
    listen: &str,
    store: &std::path::Path,
) -> String {
    let mut sections = vec![
        ("nats", format!("url = \"{nats_url}\"")),
        (
            "coordinator",
            format!(
                "listen = \"{listen}\"\nstore_path = {:?}",
                store.display().to_string()
            ),
        ),
        (
            "worker",
            format!(
                "model = {:?}\nheartbeat_interval_ms = 200",
                options.model_path(0).display().to_string()
            ),
        ),
    ];
    for (section, lines) in &options.extra {
        match sections.iter_mut().find(|(s, _)| s == section) {
            Some((_, text)) => {
                text.push('\n');
                text.push_str(lines);
            }
            None => sections.push((section, lines.clone())),
        }
    }
    sections
        .into_iter()
        .map(|(s, t)| format!("[{s}]\n{t}\n"))
        .collect::<Vec<_>>()
        .join("\n")
}
