//! Two coordinators in the public API's queue group share NATS requests; when one
//! stops, the other serves every request.

use std::collections::HashMap;
use std::time::Duration;

use baton_common::public::headers;
use baton_common::subjects::Subjects;
use baton_integration_tests::{Cluster, ClusterOptions};
use serde_json::{json, Value};

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
    let mut second = cluster.start_coordinator();
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

    second.process.kill();
    let alone = runtime.block_on(spread(&client, &model, 10));
    assert_eq!(alone.len(), 1, "one coordinator is left: {alone:?}");
    assert_eq!(alone.values().sum::<usize>(), 10);
    assert!(shared.contains_key(alone.keys().next().expect("one")));
    cluster.assert_alive();
}
