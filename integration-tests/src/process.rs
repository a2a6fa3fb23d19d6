//! Child processes that die with their owner, and the `nats-server` they talk through.

use std::{
    ffi::OsString,
    fs::File,
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant, SystemTime},
};

use baton_common::config::NatsConfig;
use tempfile::TempDir;

use crate::netns::{self, Host};

/// Where the workspace's binaries (`baton-worker`, `baton-coordinator`) are.
///
/// `BATON_BIN_DIR` wins when set. Otherwise they sit beside this test's own executable:
/// cargo puts a test at `<target>/<profile>/deps/<test>-<hash>` and binaries at
/// `<target>/<profile>/<name>`, so the parent of `deps` is the place, whatever
/// `CARGO_TARGET_DIR` says. `cargo test --workspace` builds them with the tests; when
/// only this package is selected (`-p baton-integration-tests`), build them first with
/// `cargo build --release --workspace --bins`.
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("BATON_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("the test knows its own path");
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    dir
}

/// The path of one of the workspace's binaries; panics with a hint when it is missing,
/// or older than a source file of the crates it is built from (cargo builds a package's
/// binaries for `cargo test` only when that package has integration tests of its own,
/// and never for `-p baton-integration-tests` alone). With `BATON_BIN_DIR` set, the
/// binaries there are taken as they are.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    let hint = "run `cargo build --release --workspace --bins` (or set BATON_BIN_DIR)";
    let built = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("{} is missing: {hint}", path.display()));
    if std::env::var_os("BATON_BIN_DIR").is_none() {
        let root = crate::workspace_root();
        // The workspace crates each binary is built from.
        let crates: &[&str] = match name {
            "baton-worker" => &["common", "worker"],
            "baton-coordinator" => &["common", "coordinator"],
            "baton" => &["common", "client"],
            _ => &["common", "worker", "coordinator"],
        };
        let newest = crates
            .iter()
            .filter_map(|krate| newest_file(&root.join(krate)))
            .max();
        if let Some((changed, file)) = newest {
            assert!(
                changed <= built,
                "{} is older than {}: {hint}",
                path.display(),
                file.display()
            );
        }
    }
    path
}

/// The most recently modified file among a crate's `Cargo.toml`, `build.rs` and `src/`.
fn newest_file(krate: &Path) -> Option<(SystemTime, PathBuf)> {
    let mut newest: Option<(SystemTime, PathBuf)> = None;
    let mut pending = vec![krate.join("src")];
    let mut consider = |path: PathBuf| {
        if let Ok(modified) = std::fs::metadata(&path).and_then(|m| m.modified()) {
            if newest.as_ref().is_none_or(|(t, _)| modified > *t) {
                newest = Some((modified, path));
            }
        }
    };
    consider(krate.join("Cargo.toml"));
    consider(krate.join("build.rs"));
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                consider(path);
            }
        }
    }
    newest
}

/// The `nats-server` executable: on `PATH`, or where Debian installs it.
pub fn nats_server_path() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain(["/usr/sbin", "/usr/bin", "/usr/local/bin"].map(PathBuf::from))
        .map(|dir| dir.join("nats-server"))
        .find(|p| p.is_file())
}

/// A TCP port that was free a moment ago (bound on 127.0.0.1:0, then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0")
}

/// A child process, killed (`SIGKILL`) and reaped when dropped. Its stdout and stderr go
/// to one log file, read back for assertions and diagnostics.
pub struct Process {
    /// Short name for messages ("worker-0").
    pub name: String,
    child: Child,
    log: PathBuf,
    /// Set once the process has been reaped.
    status: Option<ExitStatus>,
}

impl Process {
    /// Starts `cmd` with its output captured in `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Process {
        let log = log_dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("creating a log file");
        let err = out.try_clone().expect("cloning a log file handle");
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        Process {
            name: name.to_string(),
            child,
            log,
            status: None,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its resident set size in KiB (`VmRSS` of `/proc/<pid>/status`); `None` once it
    /// has ended, or where there is no `/proc`.
    pub fn rss_kib(&mut self) -> Option<u64> {
        self.status_kib("VmRSS")
    }

    /// The anonymous part of its resident set in KiB (`RssAnon`: heap, stacks, what the
    /// allocator mapped), without the pages of its binary and libraries (`RssFile`),
    /// which grow as code runs for the first time and can be dropped and read back.
    pub fn anon_kib(&mut self) -> Option<u64> {
        self.status_kib("RssAnon")
    }

    /// A `kB` field of `/proc/<pid>/status`.
    fn status_kib(&mut self, field: &str) -> Option<u64> {
        if self.try_status().is_some() {
            return None;
        }
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// Everything the process wrote so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The log's last `max` bytes (roughly), for panic messages.
    pub fn log_tail(&self, max: usize) -> String {
        let log = self.log();
        let mut start = log.len().saturating_sub(max);
        while !log.is_char_boundary(start) {
            start += 1;
        }
        log[start..].to_string()
    }

    /// The exit status if the process has ended.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// Sends `SIGTERM` (through `kill`, which every Unix has).
    pub fn terminate(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -TERM {} ({}) failed", self.pid(), self.name);
    }

    /// Waits up to `timeout` for the process to end.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the process (`SIGKILL`) and reaps it.
    pub fn kill(&mut self) {
        if self.try_status().is_none() {
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A private `nats-server` on a free port of 127.0.0.1, killed when dropped; alone, or one
/// member of a cluster of them joined by routes ([`Nats::start_cluster`]).
pub struct Nats {
    /// `nats://127.0.0.1:<port>`.
    pub url: String,
    /// The server process.
    pub process: Process,
    /// Its port.
    port: u16,
    /// Its monitoring port (`/connz`, `/routez`), for members of a cluster.
    monitor: Option<u16>,
    /// How many other servers it routes to when the cluster is whole.
    peers: usize,
    /// Its name in logs (`nats`, `nats-1`, …).
    name: String,
    /// Its network namespace, in a partition drill.
    host: Option<Host>,
    /// Restarts so far (names their logs).
    restarts: usize,
    /// Holds the log (and nothing else): removed after the process is gone.
    _dir: TempDir,
    /// Arguments beyond address and port (`-c <file>`, the cluster's routes), kept for
    /// restarts.
    args: Vec<OsString>,
    /// Environment of the server (the secrets its configuration reads), kept for
    /// restarts.
    env: Vec<(OsString, OsString)>,
}

/// The ports of one server of a cluster: clients, routes, monitoring.
struct MemberPorts {
    client: u16,
    route: u16,
    monitor: u16,
}

impl Nats {
    /// Starts a server, or `None` (after printing why) when `nats-server` is not installed.
    pub fn start() -> Option<Nats> {
        Nats::start_with(Vec::new(), Vec::new())
    }

    /// Starts a server with more arguments (`-c <configuration file>`) and environment;
    /// the address and port are still chosen here (on the command line, they win over
    /// the file's). `None`, after a note, when `nats-server` is not installed.
    pub fn start_with(args: Vec<OsString>, env: Vec<(OsString, OsString)>) -> Option<Nats> {
        Nats::start_single(args, env, false)
    }

    /// A server with JetStream (its store in the server's own temporary directory).
    pub fn start_jetstream() -> Option<Nats> {
        Nats::start_single(Vec::new(), Vec::new(), true)
    }

    fn start_single(
        mut args: Vec<OsString>,
        env: Vec<(OsString, OsString)>,
        jetstream: bool,
    ) -> Option<Nats> {
        let exe = nats_server_or_note()?;
        let dir = tempfile::tempdir().expect("creating a temporary directory");
        if jetstream {
            args.extend(jetstream_args(dir.path()));
        }
        let mut last_log = String::new();
        // The free port may be taken between our check and the server's bind: retry.
        for attempt in 0..5 {
            let port = free_port();
            let name = format!("nats-{attempt}");
            let mut process = spawn_server(&exe, &args, &env, None, port, &name, dir.path());
            if wait_serving(&mut process, None, port) {
                return Some(Nats {
                    url: format!("nats://127.0.0.1:{port}"),
                    process,
                    port,
                    monitor: None,
                    peers: 0,
                    name: "nats".into(),
                    host: None,
                    restarts: 0,
                    _dir: dir,
                    args,
                    env,
                });
            }
            process.kill();
            last_log = process.log();
        }
        panic!("nats-server did not start after 5 attempts; its last log:\n{last_log}");
    }

    /// Starts `n` servers that form one NATS cluster (`--cluster_name baton`, each
    /// routing to every other), each with its own client, route and monitoring port;
    /// returns once every route is up. `None`, after a note, when `nats-server` is not
    /// installed.
    pub fn start_cluster(n: usize, jetstream: bool) -> Option<Vec<Nats>> {
        Nats::start_cluster_in(vec![None; n], jetstream)
    }

    /// [`Nats::start_cluster`] with one server in each of `hosts` (network namespaces of
    /// a partition drill; `None`: here, on 127.0.0.1). Servers in namespaces ping their
    /// routes every second, so that a server cut off is found in seconds.
    pub fn start_cluster_in(hosts: Vec<Option<Host>>, jetstream: bool) -> Option<Vec<Nats>> {
        let n = hosts.len();
        assert!(n >= 1, "a cluster has at least one server");
        let exe = nats_server_or_note()?;
        let mut last_log = String::new();
        // Ports picked free may be taken before the servers bind them: retry the lot.
        for _attempt in 0..5 {
            let ports: Vec<MemberPorts> = (0..n)
                .map(|_| MemberPorts {
                    client: free_port(),
                    route: free_port(),
                    monitor: free_port(),
                })
                .collect();
            let mut all: Vec<u16> = ports
                .iter()
                .flat_map(|p| [p.client, p.route, p.monitor])
                .collect();
            all.sort_unstable();
            all.dedup();
            if all.len() != 3 * n {
                continue;
            }
            let routes = ports
                .iter()
                .zip(&hosts)
                .map(|(p, h)| format!("nats://{}:{}", netns::address(h.as_ref()), p.route))
                .collect::<Vec<_>>()
                .join(",");
            let mut servers: Vec<Nats> = Vec::new();
            let mut failed = false;
            for (i, (p, host)) in ports.iter().zip(&hosts).enumerate() {
                let name = format!("nats-{i}");
                let at = netns::address(host.as_ref());
                let dir = tempfile::tempdir().expect("creating a temporary directory");
                let mut args: Vec<OsString> = [
                    "-n".to_string(),
                    name.clone(),
                    "--cluster_name".into(),
                    "baton".into(),
                    "--cluster".into(),
                    format!("nats://{at}:{}", p.route),
                    "--routes".into(),
                    routes.clone(),
                    "-m".into(),
                    p.monitor.to_string(),
                ]
                .into_iter()
                .map(OsString::from)
                .collect();
                if jetstream {
                    args.extend(jetstream_args(dir.path()));
                }
                if host.is_some() {
                    let conf = dir.path().join("pings.conf");
                    std::fs::write(&conf, "ping_interval: \"1s\"\nping_max: 3\n")
                        .expect("writing a server configuration");
                    args.push("-c".into());
                    args.push(conf.into_os_string());
                }
                let mut process =
                    spawn_server(&exe, &args, &[], host.as_ref(), p.client, &name, dir.path());
                if !wait_serving(&mut process, host.as_ref(), p.client) {
                    process.kill();
                    last_log = process.log();
                    failed = true;
                    break;
                }
                servers.push(Nats {
                    url: format!("nats://{at}:{}", p.client),
                    process,
                    port: p.client,
                    monitor: Some(p.monitor),
                    peers: n - 1,
                    name,
                    host: host.clone(),
                    restarts: 0,
                    _dir: dir,
                    args,
                    env: Vec::new(),
                });
            }
            if failed {
                continue;
            }
            for server in &servers {
                if !server.wait_routes(Duration::from_secs(20)) {
                    panic!(
                        "{} did not route to its {} peers within 20 s:\n{}",
                        server.name,
                        n - 1,
                        server.process.log()
                    );
                }
            }
            return Some(servers);
        }
        panic!(
            "a cluster of {n} nats-servers did not start after 5 attempts; last log:\n{last_log}"
        );
    }
}

/// JetStream on, its store in `dir`.
fn jetstream_args(dir: &Path) -> [OsString; 3] {
    [
        "-js".into(),
        "-sd".into(),
        dir.join("jetstream").into_os_string(),
    ]
}

/// The `nats-server` executable, or `None` after a note saying it is missing.
fn nats_server_or_note() -> Option<PathBuf> {
    let exe = nats_server_path();
    if exe.is_none() {
        eprintln!("note: skipped: nats-server is not installed (scripts/setup installs it)");
    }
    exe
}

/// Starts `nats-server` on `port` of 127.0.0.1 (or of `host`) with `args` and `env`.
fn spawn_server(
    exe: &Path,
    args: &[OsString],
    env: &[(OsString, OsString)],
    host: Option<&Host>,
    port: u16,
    name: &str,
    dir: &Path,
) -> Process {
    let mut cmd = netns::command(host, exe);
    cmd.args(args).envs(env.iter().cloned());
    cmd.args(["-a", netns::address(host), "-p", &port.to_string()]);
    Process::spawn(name, cmd, dir)
}

/// Waits until a server just started accepts connections on `port`; false when it
/// exited first or did not listen within 10 s.
fn wait_serving(process: &mut Process, host: Option<&Host>, port: u16) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && process.try_status().is_none() {
        if TcpStream::connect((netns::address(host), port)).is_ok() {
            // Another test's server may have taken the port (and answered this
            // connection): ours then exits as it binds. Give it that moment.
            std::thread::sleep(Duration::from_millis(150));
            return process.try_status().is_none();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

impl Nats {
    /// The settings of a connection without credentials to this server, for
    /// `baton_common::nats::connect` (a secured server wants
    /// [`crate::secure::NatsSecurity::nats_config`] instead).
    pub fn config(&self) -> NatsConfig {
        NatsConfig {
            url: self.url.clone(),
            ..NatsConfig::default()
        }
    }

    /// Its name in logs and verdicts (`nats`, `nats-1`, …).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its network namespace, in a partition drill.
    pub fn host(&self) -> Option<&Host> {
        self.host.as_ref()
    }

    /// Kills the server (`SIGKILL`), waits `down`, and starts it again on the same port.
    pub fn restart(&mut self, down: Duration) {
        self.kill();
        std::thread::sleep(down);
        self.start_again();
    }

    /// Kills the server (`SIGKILL`).
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Starts the server again on its ports (after [`Nats::kill`]); a member of a
    /// cluster rejoins it through the same routes.
    pub fn start_again(&mut self) {
        let exe = nats_server_path().expect("nats-server was there a moment ago");
        self.restarts += 1;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let name = format!("{}-restart-{}", self.name, self.restarts);
            self.process = spawn_server(
                &exe,
                &self.args,
                &self.env,
                self.host.as_ref(),
                self.port,
                &name,
                self._dir.path(),
            );
            let up = Instant::now() + Duration::from_secs(5);
            while Instant::now() < up && self.process.try_status().is_none() {
                if TcpStream::connect((netns::address(self.host.as_ref()), self.port)).is_ok() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            // The port may still be held for a moment: try again.
            self.process.kill();
            assert!(
                Instant::now() < deadline,
                "nats-server did not come back on port {}:\n{}",
                self.port,
                self.process.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// One of the server's monitoring pages as JSON (`connz`, `routez`); `None` for a
    /// server without monitoring, or one that does not answer.
    fn monitor(&self, page: &str) -> Option<serde_json::Value> {
        let port = self.monitor?;
        reqwest::blocking::Client::new()
            .get(format!(
                "http://{}:{port}/{page}",
                netns::address(self.host.as_ref())
            ))
            .timeout(Duration::from_secs(2))
            .send()
            .ok()?
            .json()
            .ok()
    }

    /// The names of the clients connected to this server now (each Baton process names
    /// its connection: `baton-coordinator-…`, `baton-worker-…`). Empty for a server
    /// without monitoring.
    pub fn connection_names(&self) -> Vec<String> {
        self.monitor("connz")
            .and_then(|v| {
                v["connections"].as_array().map(|conns| {
                    conns
                        .iter()
                        .filter_map(|c| c["name"].as_str().map(str::to_string))
                        .collect()
                })
            })
            .unwrap_or_default()
    }

    /// How many other servers this one has routes to now (a server may hold a pool of
    /// routes to each); `None` without monitoring.
    pub fn routes(&self) -> Option<usize> {
        let page = self.monitor("routez")?;
        let mut peers: Vec<&str> = page["routes"]
            .as_array()?
            .iter()
            .filter_map(|r| r["remote_id"].as_str())
            .collect();
        peers.sort_unstable();
        peers.dedup();
        Some(peers.len())
    }

    /// Whether the server calls itself healthy (`/healthz`: with JetStream, that it is
    /// current with its cluster's leaders, streams and consumers); `None` without
    /// monitoring or an answer.
    pub fn healthy(&self) -> Option<bool> {
        Some(self.monitor("healthz")?["status"] == "ok")
    }

    /// Waits until the server calls itself healthy (at once for a server without
    /// monitoring); false after `timeout`.
    pub fn wait_healthy(&self, timeout: Duration) -> bool {
        if self.monitor.is_none() {
            return true;
        }
        let deadline = Instant::now() + timeout;
        loop {
            if self.healthy() == Some(true) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until this member routes to every other server of its cluster (at once
    /// for a server alone); false after `timeout`.
    pub fn wait_routes(&self, timeout: Duration) -> bool {
        if self.peers == 0 {
            return true;
        }
        let deadline = Instant::now() + timeout;
        loop {
            if self.routes().is_some_and(|r| r >= self.peers) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
