//! A worker told to stop (SIGTERM) drains: streams it accepted finish, then it exits 0.

use std::time::Duration;

use baton_integration_tests::{summarize, Cluster, ClusterOptions};
use serde_json::json;

const MAX_TOKENS: u32 = 40;

#[test]
fn sigterm_mid_stream_drains_then_exits_0() {
    // 50 ms a token: the stream lasts about two seconds.
    let Some(mut cluster) = Cluster::start(ClusterOptions::simulated(1).step_ms(50)) else {
        return;
    };
    let body = json!({
        "model": cluster.model,
        "prompt": "count slowly",
        "max_tokens": MAX_TOKENS,
        "stream": true,
    });
    let mut reader = cluster.api.stream("/v1/completions", &body);
    let mut events = Vec::new();
    // Wait for a few tokens, so the stream is surely running on the worker.
    while summarize(&events).text_chunks < 3 {
        let event = reader
            .next_event()
            .unwrap_or_else(|| panic!("the stream ended early\n{}", cluster.logs()));
        events.push(event);
    }
    cluster.workers[0].terminate();
    events.extend(reader.collect_all());

    let summary = summarize(&events);
    assert!(
        summary.errors.is_empty(),
        "error frames: {:?}",
        summary.errors
    );
    assert!(summary.done, "no [DONE]: {events:?}");
    assert_eq!(summary.text_chunks, MAX_TOKENS as usize, "{summary:?}");
    assert_eq!(summary.finish_reason.as_deref(), Some("length"));
    // Positions count up from 0 without a gap or a repeat.
    let positions: Vec<u64> = events.iter().filter_map(|e| e.position()).collect();
    assert!(
        positions.windows(2).all(|w| w[1] == w[0] + 1) && positions.first() == Some(&0),
        "positions: {positions:?}"
    );

    let status = cluster.workers[0].wait_timeout(Duration::from_secs(20));
    match status {
        Some(status) => assert!(
            status.success(),
            "the worker exited with {status}\n{}",
            cluster.logs()
        ),
        None => panic!(
            "the worker did not exit within 20 s of SIGTERM\n{}",
            cluster.logs()
        ),
    }
    let log = cluster.workers[0].log();
    assert!(
        log.contains("draining"),
        "no drain in the worker's log:\n{log}"
    );
}

#[test]
fn requests_during_a_drain_are_served_by_another_worker() {
    // Two workers; while one drains, new requests still succeed (on the other one).
    let Some(mut cluster) = Cluster::start(ClusterOptions::simulated(2).step_ms(50)) else {
        return;
    };
    let body = json!({
        "model": cluster.model,
        "prompt": "keep worker zero busy",
        "max_tokens": MAX_TOKENS,
        "stream": true,
    });
    // Start a stream and make sure worker-0 is busy with something, then stop it.
    let mut reader = cluster.api.stream("/v1/completions", &body);
    let first = reader.next_event().expect("a first event");
    assert!(first.stream_id().is_some());
    cluster.workers[0].terminate();
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..4 {
        let body = json!({"model": cluster.model, "prompt": format!("after {i}"), "max_tokens": 2});
        let reply = cluster
            .api
            .post_json("/v1/completions", &body)
            .expect("POST");
        assert_eq!(reply.status, 200, "{}\n{}", reply.body, cluster.logs());
    }
    let rest = summarize(&reader.collect_all());
    assert!(rest.done && rest.errors.is_empty(), "{rest:?}");
    let status = cluster.workers[0].wait_timeout(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "worker-0: {status:?}\n{}",
        cluster.logs()
    );
}

#[test]
fn drain_over_http_lets_a_worker_finish_and_leave() {
    let Some(mut cluster) = Cluster::start(ClusterOptions::simulated(2).step_ms(20)) else {
        return;
    };
    let body =
        json!({"model": cluster.model, "prompt": "drain me", "max_tokens": 30, "stream": true});
    let mut reader = cluster.api.stream("/v1/completions", &body);
    let first = reader.next_event().expect("a first event");
    let stream = first.stream_id().expect("a stream id").to_string();
    let mut w = None;
    for _ in 0..100 {
        w = cluster.worker_of(&stream);
        if w.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let w = w.expect("the serving worker");
    let id = cluster.worker_id(w).expect("its id");
    let reply = cluster
        .api
        .post_json(&format!("/admin/workers/{id}/drain"), &json!({}))
        .expect("POST drain");
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.body["draining"], true);
    // Its stream finishes; new requests go to the other worker; then it leaves.
    let mut events = vec![first];
    events.extend(reader.collect_all());
    let summary = summarize(&events);
    assert!(summary.done && summary.errors.is_empty(), "{summary:?}");
    assert_eq!(summary.text_chunks, 30);
    let after = json!({"model": cluster.model, "prompt": "after", "max_tokens": 2});
    assert_eq!(
        cluster
            .api
            .post_json("/v1/completions", &after)
            .expect("POST")
            .status,
        200
    );
    let status = cluster.workers[w].wait_timeout(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        cluster.logs()
    );
    // An unknown worker is a 404 in OpenAI's shape.
    let gone = cluster
        .api
        .post_json(&format!("/admin/workers/{id}/drain"), &json!({}))
        .expect("POST drain");
    assert_eq!(gone.status, 404);
    assert_eq!(gone.body["error"]["code"], "worker_not_found");
}

/// A worker's compute threads run under `SCHED_IDLE` unless configured otherwise, so that
/// its network threads (and a coordinator or nats-server on the same host) preempt them.
#[cfg(target_os = "linux")]
#[test]
fn compute_threads_run_in_the_idle_class_by_default() {
    const SCHED_IDLE: u32 = 5;
    let Some(cluster) = Cluster::start(ClusterOptions::simulated(1)) else {
        return;
    };
    let pid = cluster.workers[0].pid();
    let mut compute = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("the worker's threads") {
        let dir = task.expect("a thread").path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("baton-compute-") {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).expect("the thread's stat");
        // Fields after the parenthesized name start at field 3; the policy is field 41.
        let after = &stat[stat.rfind(')').expect("a name in parentheses") + 1..];
        let policy: u32 = after
            .split_whitespace()
            .nth(41 - 3)
            .and_then(|f| f.parse().ok())
            .expect("a policy field");
        compute.push((comm.trim().to_string(), policy));
    }
    assert!(
        !compute.is_empty(),
        "no baton-compute threads in the worker\n{}",
        cluster.logs()
    );
    for (name, policy) in &compute {
        assert_eq!(*policy, SCHED_IDLE, "thread {name} runs in class {policy}");
    }
}
