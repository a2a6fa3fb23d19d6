//! The `baton` command line against a simulated cluster: it streams a completion over
//! NATS (the same text HTTP gives), shows the status, and drains a worker, which leaves.

use std::process::{Command, Output};
use std::time::Duration;

use baton_integration_tests::process::bin;
use baton_integration_tests::{Cluster, ClusterOptions};
use serde_json::Value;

fn baton(args: &[&str]) -> Output {
    let out = Command::new(bin("baton"))
        .args(args)
        .env_remove("BATON_NATS_URL")
        .env_remove("BATON_URL")
        .output()
        .expect("running baton");
    assert!(
        out.status.success(),
        "baton {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).expect("UTF-8")
}

#[test]
fn the_cli_streams_shows_status_and_drains() {
    let Some(mut cluster) = Cluster::start(ClusterOptions::simulated(1).step_ms(5)) else {
        return;
    };
    let nats = cluster.nats.url.clone();
    let http = cluster.api.base.clone();
    let model = cluster.model.clone();
    let args = ["--model", &model, "--max-tokens", "8", "--temperature", "0"];

    let mut over_nats = vec!["--nats", &nats, "complete", "--verbose"];
    over_nats.extend(args);
    over_nats.push("Count to eight");
    let out = baton(&over_nats);
    let streamed = stdout(&out);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("8 generated tokens"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(streamed.split_whitespace().count(), 8, "{streamed:?}");

    let mut over_http = vec!["--url", &http, "complete", "--no-stream"];
    over_http.extend(args);
    over_http.push("Count to eight");
    assert_eq!(stdout(&baton(&over_http)), streamed);

    let mut json_chat = vec!["--nats", &nats, "--json", "chat"];
    json_chat.extend(args);
    json_chat.push("hi");
    assert_eq!(stdout(&baton(&json_chat)).split_whitespace().count(), 8);
    // JSON replies of a text completion: its final chunk and a whole answer share
    // `"object": "text_completion"`.
    let mut json_complete = vec!["--nats", &nats, "--json", "complete"];
    json_complete.extend(args);
    json_complete.push("Count to eight");
    assert_eq!(stdout(&baton(&json_complete)), streamed);

    let status: Value =
        serde_json::from_str(&stdout(&baton(&["--nats", &nats, "status"]))).expect("JSON");
    assert_eq!(status["health"], "ok");
    let worker = status["workers"][0]["id"]
        .as_str()
        .expect("a worker")
        .to_string();
    assert_eq!(Some(worker.clone()), cluster.worker_id(0));

    let drained: Value =
        serde_json::from_str(&stdout(&baton(&["--nats", &nats, "drain", &worker]))).expect("JSON");
    assert_eq!(drained["draining"], true);
    let status = cluster.workers[0].wait_timeout(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "the drained worker did not leave: {status:?}\n{}",
        cluster.workers[0].log()
    );
}

/// A failure is one line, `error: ` and its causes, with status 1: no stack backtrace
/// even with `RUST_BACKTRACE` set, for the `baton` command line and the worker alike.
#[test]
fn errors_are_one_line_without_a_backtrace() {
    // Nothing listens on port 1.
    let runs = [
        Command::new(bin("baton"))
            .args(["--nats", "nats://127.0.0.1:1", "status"])
            .env("RUST_BACKTRACE", "1")
            .env_remove("BATON_URL")
            .output()
            .expect("running baton"),
        Command::new(bin("baton-worker"))
            .args(["generate", "--model", "/nonexistent.gguf", "--prompt", "x"])
            .env("RUST_BACKTRACE", "1")
            .output()
            .expect("running baton-worker"),
    ];
    for out in runs {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        let errors: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("error: "))
            .collect();
        assert_eq!(errors.len(), 1, "{stderr}");
        assert!(!stderr.contains("backtrace"), "{stderr}");
        assert!(!stderr.contains("Caused by"), "{stderr}");
    }
}
