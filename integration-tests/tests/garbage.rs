//! Garbage on the internal NATS subjects is dropped: nothing crashes, nothing is lost.

use baton_common::{ids::WorkerId, subjects::Subjects};
use baton_integration_tests::{summarize, Cluster, ClusterOptions};
use serde_json::json;

#[test]
fn workers_and_coordinator_survive_garbage_on_internal_subjects() {
    let Some(mut cluster) = Cluster::start(ClusterOptions::simulated(1).step_ms(5)) else {
        return;
    };
    let worker: WorkerId = cluster
        .worker_id(0)
        .expect("worker id in its log")
        .parse()
        .expect("a worker id");
    let subjects = Subjects::default();
    let nats = cluster.nats.config();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let client = baton_common::nats::connect(&nats, "garbage-test")
            .await
            .expect("connect");
        let mut state = 0x9e37_79b9u32;
        for i in 0..300u32 {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let len = (state % 512) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|j| (state.rotate_left(j as u32 % 32) >> 3) as u8)
                .collect();
            let subject = match i % 3 {
                0 => subjects.submit(worker),
                1 => subjects.cancel(worker),
                _ => subjects.heartbeat(),
            };
            client
                .publish(subject, bytes.into())
                .await
                .expect("publish");
        }
        // Wrong JSON where rkyv is expected, and an empty message.
        client
            .publish(subjects.submit(worker), b"{\"model\":1}".to_vec().into())
            .await
            .expect("publish");
        client
            .publish(subjects.heartbeat(), Vec::new().into())
            .await
            .expect("publish");
        client.flush().await.expect("flush");
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    cluster.assert_alive();
    // Both still serve a stream in full.
    let body = json!({
        "model": cluster.model,
        "messages": [{"role": "user", "content": "still there?"}],
        "max_tokens": 12,
        "stream": true,
    });
    let summary = summarize(
        &cluster
            .api
            .stream("/v1/chat/completions", &body)
            .collect_all(),
    );
    assert!(summary.done && summary.errors.is_empty(), "{summary:?}");
    assert_eq!(summary.text_chunks, 12, "{summary:?}");
    let log = cluster.workers[0].log();
    assert!(
        log.contains("malformed message on the submit subject"),
        "the worker did not report the garbage:\n{log}"
    );
}
