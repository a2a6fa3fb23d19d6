//! The README's "Using the cluster" commands, run as written against a fresh `scripts/up`
//! (its first code block; the drills and the soak, which start clusters of their own, are
//! in another). Skipped, with a note, when port 8000 or 4222 is taken: the commands name
//! them, and `scripts/up` falls back to other ports.

use std::fs::File;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use baton_integration_tests::cluster::default_model_path;
use baton_integration_tests::process::bin_dir;
use baton_integration_tests::workspace_root;

/// The shell commands of the README's "Using the cluster" section (its first `sh` block),
/// continuation lines (a trailing `\`, or a quote still open) joined.
fn readme_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).expect("README");
    let section = readme
        .split("## Using the cluster")
        .nth(1)
        .expect("a 'Using the cluster' section");
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a shell block");
    let mut commands = Vec::new();
    let mut current = String::new();
    for line in block.lines() {
        current.push_str(line);
        current.push('\n');
        let open_quote = current.matches('\'').count() % 2 == 1;
        if !line.ends_with('\\') && !open_quote && !current.trim().is_empty() {
            commands.push(std::mem::take(&mut current));
        }
    }
    commands
}

/// `scripts/up`, stopped (and waited for) on drop.
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        // SIGTERM (SIGINT may be ignored by a test run in the background, and then by
        // the script): it stops what it started, workers first.
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn taken(port: u16) -> bool {
    TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// The cargo target directory holding this build's binaries.
fn target_dir() -> PathBuf {
    bin_dir()
        .parent()
        .expect("the binaries sit in <target>/release")
        .to_path_buf()
}

/// Starts `scripts/up ARGS` on this build's binaries (HTTP on `listen` when given) and
/// waits until it wrote its endpoints; its log and endpoints file sit in the directory
/// returned.
fn start_up(args: &[&str], listen: Option<&str>) -> (Up, tempfile::TempDir) {
    let state = tempfile::tempdir().expect("tempdir");
    let endpoints = state.path().join("endpoints");
    let root = workspace_root();
    // The binaries of this build, as they are (a build inside a test would wait on
    // cargo's lock).
    let log = File::create(state.path().join("up.log")).expect("a log file");
    let mut up = Command::new(root.join("scripts/up"));
    up.args(args)
        .current_dir(&root)
        .env("BATON_BIN_DIR", bin_dir())
        .env("BATON_ENDPOINTS", &endpoints)
        .env("CARGO_TARGET_DIR", target_dir())
        .env_remove("BATON_LISTEN")
        .env_remove("BATON_CONFIG")
        .env_remove("BATON_UP_MODELS")
        // A file, not a pipe: the script must outlive a reader that is gone (it logs
        // while it stops what it started).
        .stdout(log.try_clone().expect("the log file again"))
        .stderr(log);
    if let Some(listen) = listen {
        up.env("BATON_LISTEN", listen);
    }
    let mut up = Up(up.spawn().expect("scripts/up starts"));
    let deadline = Instant::now() + Duration::from_secs(300);
    while !endpoints.exists() {
        let log = std::fs::read_to_string(state.path().join("up.log")).unwrap_or_default();
        if let Ok(Some(status)) = up.0.try_wait() {
            panic!("scripts/up exited ({status}) before it was ready:\n{log}");
        }
        assert!(
            Instant::now() < deadline,
            "scripts/up was not ready in 300 s:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    (up, state)
}

/// One `scripts/up` at a time: each takes the configured ports when they are free.
static UP_ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn the_readme_commands_work_after_scripts_up() {
    let _one = UP_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !default_model_path().exists() {
        eprintln!("skipping: the default model is absent (scripts/setup fetches it)");
        return;
    }
    if taken(8000) || taken(4222) {
        eprintln!("skipping: port 8000 or 4222 is taken on this machine");
        return;
    }
    let (up, state) = start_up(&[], None);
    let endpoints = state.path().join("endpoints");
    let target = target_dir();
    let written = std::fs::read_to_string(&endpoints).expect("endpoints");
    assert!(
        written.contains("url=http://127.0.0.1:8000")
            && written.contains("nats=nats://127.0.0.1:4222"),
        "{written}"
    );

    let commands = readme_commands();
    assert!(commands.len() >= 6, "{commands:?}");
    let mut script = String::from("set -e\n");
    for (i, command) in commands.iter().enumerate() {
        let body = command.trim_end();
        if body.starts_with("target=") {
            script.push_str(body);
            script.push('\n');
            continue;
        }
        // Each command's output goes to a file of its own, checked below.
        script.push_str(&format!("( {body}\n) > out.{i} 2>&1\n"));
    }
    let work = tempfile::tempdir().expect("tempdir");
    let status = Command::new("bash")
        .args(["-c", &script])
        .current_dir(work.path())
        .env("BATON_ENDPOINTS", &endpoints)
        .env("CARGO_TARGET_DIR", &target)
        .env_remove("BATON_URL")
        .env_remove("BATON_NATS_URL")
        .env("RUST_BACKTRACE", "1")
        .status()
        .expect("bash runs");
    let out = |i: usize| {
        std::fs::read_to_string(work.path().join(format!("out.{i}"))).unwrap_or_default()
    };
    let report: Vec<String> = (0..commands.len())
        .map(|i| format!("$ {}{}", commands[i], out(i)))
        .collect();
    assert!(
        status.success(),
        "a README command failed:\n{}",
        report.join("\n")
    );
    for (i, command) in commands.iter().enumerate() {
        let text = out(i);
        if command.starts_with("target=") {
            continue;
        }
        assert!(!text.trim().is_empty(), "no output:\n$ {command}");
        if command.starts_with("curl -N") {
            assert!(text.contains("data: [DONE]"), "$ {command}{text}");
        }
        if command.contains(" status") {
            let status: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("not JSON ({e}):\n$ {command}{text}"));
            assert_eq!(
                status["workers"].as_array().map(Vec::len),
                Some(2),
                "{status}"
            );
        }
    }
    // Without --url or --nats the CLI goes where the endpoints file says: the HTTP URL
    // first (a NATS URL that leads nowhere is not tried), else its NATS URL.
    let baton = |endpoints_text: &str| {
        let file = work.path().join("endpoints.test");
        std::fs::write(&file, endpoints_text).expect("write");
        Command::new(bin_dir().join("baton"))
            .arg("status")
            .env("BATON_ENDPOINTS", &file)
            .env_remove("BATON_URL")
            .env_remove("BATON_NATS_URL")
            .output()
            .expect("baton runs")
    };
    let out = baton("url=http://127.0.0.1:8000\nnats=nats://127.0.0.1:1\n");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(status["coordinator"].is_string(), "over HTTP: {status}");
    let out = baton("url=http://127.0.0.1:1\n");
    assert!(!out.status.success(), "nothing listens there");
    let out = baton("nats=nats://127.0.0.1:4222\n");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    drop(up);
    // The endpoints name the cluster only while it runs.
    assert!(
        !Path::new(&endpoints).exists(),
        "the endpoints outlived scripts/up"
    );
}

/// `scripts/up --nats-cluster 3`: three nats-servers (the script checks each routes to
/// both others before anything connects), every process given all three URLs, and the
/// CLI reaching the cluster through them.
#[test]
fn scripts_up_runs_nats_as_a_cluster_of_three() {
    let _one = UP_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !default_model_path().exists() {
        eprintln!("skipping: the default model is absent (scripts/setup fetches it)");
        return;
    }
    let listen = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("its address").to_string()
    };
    let (up, state) = start_up(&["--nats-cluster", "3"], Some(&listen));
    let written = std::fs::read_to_string(state.path().join("endpoints")).expect("endpoints");
    let nats = written
        .lines()
        .find_map(|l| l.strip_prefix("nats="))
        .unwrap_or_else(|| panic!("no NATS URL in the endpoints:\n{written}"));
    assert_eq!(nats.split(',').count(), 3, "{written}");
    let log = std::fs::read_to_string(state.path().join("up.log")).unwrap_or_default();
    assert!(
        log.contains("NATS cluster of 3 servers, each routing to every other"),
        "{log}"
    );
    // The CLI over NATS alone, given the three URLs.
    let file = state.path().join("endpoints.nats");
    std::fs::write(&file, format!("nats={nats}\n")).expect("write");
    let out = Command::new(bin_dir().join("baton"))
        .arg("status")
        .env("BATON_ENDPOINTS", &file)
        .env_remove("BATON_URL")
        .env_remove("BATON_NATS_URL")
        .output()
        .expect("baton runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        status["workers"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );
    drop(up);
}
