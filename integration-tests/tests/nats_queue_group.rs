//! Two coordinators in the public API's queue group share NATS requests; when one
//! stops, the other serves every request.

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use baton_common::public::headers;
use baton_common::subjects::Subjects;
use baton_integration_tests::process::{bin, free_port};
use baton_integration_tests::{workspace_root, Api, Cluster, ClusterOptions, Process};
use serde_json::{json, Value};

/// A second coordinator with the cluster's configuration, its own port and store.
fn second_coordinator(cluster: &Cluster, dir: &std::path::Path) -> Process {
    let port = free_port();
    let mut cmd = Command::new(bin("baton-coordinator"));
    cmd.arg("--config")
        .arg(&cluster.config)
        .env("BATON_LISTEN", format!("127.0.0.1:{port}"))
        .env("BATON_STORE", dir.join("store-2"))
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .current_dir(workspace_root());
    let mut process = Process::spawn("coordinator-2", cmd, dir);
    let api = Api::new(&format!("http://127.0.0.1:{port}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(
            process.try_status().is_none(),
            "the second coordinator exited:\n{}",
            process.log()
        );
        let workers = api
            .get("/health")
            .ok()
            .filter(|r| r.status == 200)
            .and_then(|r| r.body["workers"].as_u64());
        if workers.is_some_and(|n| n >= 1) {
            return process;
        }
        assert!(
            Instant::now() < deadline,
            "the second coordinator did not see the worker:\n{}",
            process.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends `n` whole completions over NATS; counts answers per coordinator.
async fn spread(client: &async_nats::Client, model: &str, n: usize) -> HashMap<String, usize> {
    let subject = Subjects::default().completions();
    let body = json!({"model": model, "prompt": "share me", "max_tokens": 3}).to_string();
    let mut by_coordinator = HashMap::new();
    for _ in 0..n {
        let reply = tokio::time::timeout(
            Duration::from_secs(20),
            client.request(subject.clone(), body.clone().into()),
        )
        .await
        .expect("an answer in time")
        .expect("a reply");
        let h = reply.headers.expect("headers");
        assert!(h.get(headers::ERROR).is_none(), "{:?}", reply.payload);
        assert_eq!(h.get(headers::FINAL).map(|v| v.as_str()), Some("true"));
        let answer: Value = serde_json::from_slice(&reply.payload).expect("JSON");
        assert_eq!(answer["usage"]["completion_tokens"], 3);
        let coordinator = h
            .get(headers::COORDINATOR)
            .expect("Baton-Coordinator")
            .as_str()
            .to_string();
        *by_coordinator.entry(coordinator).or_insert(0) += 1;
    }
    by_coordinator
}

#[test]
fn two_coordinators_share_requests_and_one_serves_alone() {
    let Some(mut cluster) = Cluster::start(ClusterOptions::simulated(1).step_ms(2)) else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut second = second_coordinator(&cluster, dir.path());
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let model = cluster.model.clone();
    let client = runtime
        .block_on(baton_common::nats::connect(
            &cluster.nats.config(),
            "queue-group-test",
        ))
        .expect("connect");

    let shared = runtime.block_on(spread(&client, &model, 30));
    assert_eq!(shared.len(), 2, "both coordinators answer: {shared:?}");

    second.kill();
    let alone = runtime.block_on(spread(&client, &model, 10));
    assert_eq!(alone.len(), 1, "one coordinator is left: {alone:?}");
    assert_eq!(alone.values().sum::<usize>(), 10);
    assert!(shared.contains_key(alone.keys().next().expect("one")));
    cluster.assert_alive();
}
