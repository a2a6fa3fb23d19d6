//! Routing: concurrent streams are spread over the workers that serve the model.

use std::collections::HashMap;

use baton_integration_tests::{cluster::field, summarize, Cluster, ClusterOptions};
use serde_json::json;

const STREAMS: usize = 8;
const MAX_TOKENS: u32 = 20;

#[test]
fn concurrent_streams_are_spread_over_two_workers() {
    // 30 ms a token: every stream is still running when the last one is routed.
    let Some(cluster) = Cluster::start(ClusterOptions::simulated(2).step_ms(30)) else {
        return;
    };
    let summaries: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..STREAMS)
            .map(|i| {
                let api = cluster.api.clone();
                let model = cluster.model.clone();
                scope.spawn(move || {
                    let body = json!({
                        "model": model,
                        "messages": [{"role": "user", "content": format!("request number {i}")}],
                        "max_tokens": MAX_TOKENS,
                        "stream": true,
                    });
                    summarize(&api.stream("/v1/chat/completions", &body).collect_all())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a stream thread panicked"))
            .collect()
    });
    for s in &summaries {
        assert!(s.done && s.errors.is_empty(), "{s:?}");
        assert_eq!(s.text_chunks, MAX_TOKENS as usize, "{s:?}");
        assert_eq!(s.finish_reason.as_deref(), Some("length"));
    }

    // Which worker served which stream: the coordinator logs
    // "stream accepted stream=<id> worker=<id>"; each worker logs its id when ready.
    let served_by: HashMap<String, String> = cluster
        .coordinator
        .log()
        .lines()
        .filter(|l| l.contains("stream accepted"))
        .filter_map(|l| Some((field(l, "stream")?, field(l, "worker")?)))
        .collect();
    let workers: Vec<String> = (0..2)
        .map(|i| {
            cluster
                .worker_id(i)
                .unwrap_or_else(|| panic!("worker-{i} logged no id\n{}", cluster.logs()))
        })
        .collect();
    let mut counts = vec![0usize; workers.len()];
    for s in &summaries {
        let stream = s.stream_id.as_deref().expect("events carry the stream id");
        let worker = served_by.get(stream).unwrap_or_else(|| {
            panic!(
                "the coordinator logged no worker for stream {stream}\n{}",
                cluster.logs()
            )
        });
        let index = workers
            .iter()
            .position(|w| w == worker)
            .unwrap_or_else(|| panic!("stream {stream} went to unknown worker {worker}"));
        counts[index] += 1;
    }
    eprintln!("streams per worker: {counts:?}");
    assert_eq!(counts.iter().sum::<usize>(), STREAMS);
    assert!(
        counts.iter().all(|&c| c > 0),
        "streams per worker: {counts:?} (both workers should get some)"
    );
}
