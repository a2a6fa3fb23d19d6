//! Garbage on the internal NATS subjects is counted and dropped: nothing crashes,
//! nothing is lost.

use std::time::{Duration, Instant};

use baton_common::{
    ids::{CoordinatorId, WorkerId},
    subjects::Subjects,
};
use baton_integration_tests::{cluster::field, summarize, Cluster, ClusterOptions};
use serde_json::json;

/// The sum of the samples of `metric` in a text exposition whose labels contain
/// `label` (`""`: every label set).
fn sum_metric(text: &str, metric: &str, label: &str) -> u64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
                && l.contains(label)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

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
    let coordinator: CoordinatorId = cluster
        .coordinator
        .log()
        .lines()
        .find(|l| l.contains("connected to NATS"))
        .and_then(|l| field(l, "coordinator"))
        .expect("coordinator id in its log")
        .parse()
        .expect("a coordinator id");
    let worker_metrics = cluster
        .worker_metrics_addr(0)
        .expect("the worker's metrics address in its log");
    let subjects = Subjects::default();
    // Messages sent per subject: the worker's submit and cancel subjects, and the
    // coordinator's heartbeat and token subjects.
    let mut sent = [0u64; 4];
    let nats = cluster.nats.config();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let client = baton_common::nats::connect(&nats, "garbage-test")
            .await
            .expect("connect");
        let mut state = 0x9e37_79b9u32;
        for i in 0..400u32 {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let len = (state % 512) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|j| (state.rotate_left(j as u32 % 32) >> 3) as u8)
                .collect();
            let which = (i % 4) as usize;
            sent[which] += 1;
            let subject = match which {
                0 => subjects.submit(worker),
                1 => subjects.cancel(worker),
                2 => subjects.heartbeat(),
                _ => subjects.tokens(coordinator),
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
        sent[0] += 1;
        client
            .publish(subjects.heartbeat(), Vec::new().into())
            .await
            .expect("publish");
        sent[2] += 1;
        client.flush().await.expect("flush");
    });
    // Every message is counted once: the worker's counter for its subjects, the
    // coordinator's for its own. Wait until the counts settle, then compare exactly.
    let worker_expected = sent[0] + sent[1];
    let coordinator_expected = sent[2] + sent[3];
    let scrape = |url: &str| -> String {
        reqwest::blocking::get(url)
            .and_then(|r| r.text())
            .unwrap_or_default()
    };
    let worker_url = format!("http://{worker_metrics}/metrics");
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut worker_text, mut coordinator_text);
    loop {
        worker_text = scrape(&worker_url);
        coordinator_text = cluster
            .api
            .get("/metrics")
            .ok()
            .and_then(|r| r.body.as_str().map(str::to_string))
            .unwrap_or_default();
        let settled = sum_metric(&worker_text, "baton_worker_dropped_messages_total", "")
            >= worker_expected
            && sum_metric(&coordinator_text, "baton_wire_malformed_messages_total", "")
                >= coordinator_expected;
        if settled || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    cluster.assert_alive();
    for (subject, n) in [("submit", sent[0]), ("cancel", sent[1])] {
        let counted = sum_metric(
            &worker_text,
            "baton_worker_dropped_messages_total",
            &format!("subject=\"{subject}\""),
        );
        assert_eq!(
            counted, n,
            "the worker's {subject} subject: {n} sent, {counted} counted\n{worker_text}"
        );
    }
    assert_eq!(
        sum_metric(&coordinator_text, "baton_wire_malformed_messages_total", ""),
        coordinator_expected,
        "the coordinator's subjects: {coordinator_expected} sent\n{coordinator_text}"
    );
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
