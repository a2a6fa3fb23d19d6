//! Workers join and leave under load: one worker serves 16 streams; a second joins and
//! takes the new requests; the first is drained, hands its streams over and leaves; no
//! stream fails, loses or repeats a token.

use std::time::Duration;

use baton_integration_tests::{summarize, Cluster, ClusterOptions, SseEvent};
use serde_json::json;

const STREAMS: usize = 16;
const MAX_TOKENS: u64 = 80;

fn prompt(i: usize) -> String {
    format!("stream {i} started on the first worker")
}

#[test]
fn a_second_worker_joins_and_the_first_drains_without_failing_a_stream() {
    // 40 ms a token: each stream runs for about 3 s.
    let Some(mut cluster) = Cluster::start(ClusterOptions::simulated(1).step_ms(40)) else {
        return;
    };
    let model = cluster.model.clone();

    // 16 streams on the only worker.
    let mut readers = Vec::new();
    let mut seen: Vec<Vec<SseEvent>> = Vec::new();
    for i in 0..STREAMS {
        let body = json!({"model": model, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": true});
        let mut reader = cluster.api.stream("/v1/completions", &body);
        let first = reader
            .next_event()
            .unwrap_or_else(|| panic!("stream {i} sent nothing\n{}", cluster.logs()));
        readers.push(reader);
        seen.push(vec![first]);
    }
    let ids: Vec<String> = seen
        .iter()
        .map(|e| e[0].stream_id().expect("a stream id").to_string())
        .collect();
    for id in &ids {
        assert_eq!(cluster.worker_of(id), Some(0), "{id}\n{}", cluster.logs());
    }

    // A second worker joins; new requests go to it (the first one is busy).
    let second = cluster.add_worker();
    cluster.wait_ready(2);
    for i in 0..4 {
        let body = json!({"model": model, "prompt": format!("new request {i}"), "max_tokens": 4, "stream": true});
        let events = cluster.api.stream("/v1/completions", &body).collect_all();
        let summary = summarize(&events);
        assert!(summary.done && summary.errors.is_empty(), "{summary:?}");
        let id = summary.stream_id.expect("a stream id");
        assert_eq!(
            cluster.worker_of(&id),
            Some(second),
            "new request {i} did not reach the new worker\n{}",
            cluster.logs()
        );
    }

    // Drain the first: its streams run 300 ms more, then move to the second.
    let first_id = cluster.worker_id(0).expect("worker-0's id");
    let reply = cluster
        .api
        .post_json(
            &format!("/admin/workers/{first_id}/drain"),
            &json!({"handover_after_ms": 300}),
        )
        .expect("POST drain");
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.body["running"], STREAMS as u64, "{}", reply.body);

    for (i, reader) in readers.iter_mut().enumerate() {
        seen[i].extend(reader.collect_all());
    }
    let status = cluster.workers[0].wait_timeout(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "worker-0 did not leave cleanly: {status:?}\n{}",
        cluster.logs()
    );

    // Every stream completed, its positions without a gap or a repeat, its text equal
    // to an uninterrupted run of the same request (now on the second worker alone; the
    // 16 references run at once).
    let references: Vec<String> = std::thread::scope(|scope| {
        let api = &cluster.api;
        let model = &model;
        let runs: Vec<_> = (0..STREAMS)
            .map(|i| {
                scope.spawn(move || {
                    let body = json!({"model": model, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0});
                    let reply = api.post_json("/v1/completions", &body).expect("POST");
                    assert_eq!(reply.status, 200, "{}", reply.body);
                    reply.body["choices"][0]["text"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string()
                })
            })
            .collect();
        runs.into_iter()
            .map(|r| r.join().expect("reference run"))
            .collect()
    });
    for (i, events) in seen.iter().enumerate() {
        let summary = summarize(events);
        assert!(
            summary.done && summary.errors.is_empty(),
            "stream {i}: {summary:?}\n{}",
            cluster.logs()
        );
        assert_eq!(summary.text_chunks as u64, MAX_TOKENS, "stream {i}");
        let positions: Vec<u64> = events.iter().filter_map(|e| e.position()).collect();
        assert!(
            positions.first() == Some(&0) && positions.windows(2).all(|w| w[1] == w[0] + 1),
            "stream {i} positions: {positions:?}"
        );
        assert_eq!(
            summary.text, references[i],
            "stream {i} differs from an uninterrupted run"
        );
    }
    // They moved (the drain handed them over) rather than all finishing in place.
    let log = cluster.coordinator.log();
    let handed = log
        .lines()
        .filter(|l| l.contains("handed the stream over"))
        .count();
    assert!(handed > 0, "no stream was handed over\n{}", cluster.logs());
}
