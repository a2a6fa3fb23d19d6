//! What careless and hostile clients can do to the coordinator, each answered without a
//! 5xx and without harm to other clients: a real `nats-server` (its default
//! `max_payload`, 1 MiB), the coordinator and fake workers. Skipped (with a note) without
//! `nats-server`.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use baton_common::subjects::Subjects;
use futures::future::join_all;
use serde_json::{json, Value};
use support::{
    chat, coordinator_with, eventually, open_stream, post, request, wait_healthy, FakeWorker,
    NatsServer, MODEL,
};

/// Status and `error.code` of an answer.
fn refusal(r: &support::Response) -> (u16, String) {
    let code = r.json()["error"]["code"].as_str().unwrap_or("").to_string();
    (r.status, code)
}

#[actix_web::test]
async fn a_batch_never_outgrows_a_nats_message() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (_running, addr) = coordinator_with(&nats, "batch", |c| {
        c.coordinator.max_body_bytes = 1 << 20;
        // Everything that arrives within the window shares a submit.
        c.coordinator.max_wait_ms = 300;
    })
    .await;
    let worker = FakeWorker::start(&nats.url, Subjects::new("batch")).await;
    wait_healthy(addr).await;
    // A first request opens the batching window for those after it.
    let r = post(
        addr,
        "/v1/chat/completions",
        chat("hi", json!({"max_tokens": 2})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);

    // Two prompts of ~600 KB beside ten small chats: together over 1 MiB, each alone
    // within it.
    let big = "a ".repeat(300_000);
    let mut bodies: Vec<Value> = vec![
        chat(&big, json!({"max_tokens": 3})),
        chat(&big, json!({"max_tokens": 3})),
    ];
    bodies.extend((0..10).map(|i| chat(&format!("small {i}"), json!({"max_tokens": 3}))));
    let answers = join_all(
        bodies
            .into_iter()
            .map(|b| async move { post(addr, "/v1/chat/completions", b).await }),
    )
    .await;
    for r in &answers {
        assert_eq!(r.status, 200, "{}", &r.body[..r.body.len().min(300)]);
        assert_eq!(r.json()["choices"][0]["message"]["content"], "Hello world!");
    }
    // Still batched: the small chats shared submits.
    assert!(worker.log.largest_submit.load(Ordering::SeqCst) > 1);
}

#[actix_web::test]
async fn requests_that_cannot_fit_the_wire_are_refused_up_front() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (_running, addr) = coordinator_with(&nats, "wire", |c| {
        // Bodies larger than a NATS message pass the body limit.
        c.coordinator.max_body_bytes = 4 << 20;
        c.coordinator.max_tokens_limit = 200_000;
    })
    .await;
    let worker = FakeWorker::start(&nats.url, Subjects::new("wire")).await;
    wait_healthy(addr).await;

    // A text prompt of 1.5 MB.
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "b".repeat(1_500_000), "max_tokens": 4}),
    )
    .await;
    assert_eq!(refusal(&r), (413, "request_too_large".into()), "{}", r.body);
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(message.contains("max_payload"), "{message}");

    // 300,000 token ids: a 600 KB body, 1.2 MB as ids.
    let ids: Vec<u32> = (0..300_000).map(|i| i % 1000).collect();
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": ids, "max_tokens": 4}),
    )
    .await;
    assert_eq!(refusal(&r), (413, "request_too_large".into()), "{}", r.body);

    // A prompt that fits, but not with the room to resume it after 200,000 tokens
    // (a resume carries every token so far).
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "c".repeat(400_000), "max_tokens": 200_000}),
    )
    .await;
    assert_eq!(refusal(&r), (413, "request_too_large".into()), "{}", r.body);

    // None of them reached a worker; a request that fits still runs.
    assert_eq!(worker.log.submits.load(Ordering::SeqCst), 0);
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "d".repeat(400_000), "max_tokens": 3}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A long prompt on a slow worker: its chunks' progress keeps the stream where it is,
/// past both the stall timeout and the client's idle timeout.
#[actix_web::test]
async fn a_long_prompt_is_progress_not_a_stall() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (_running, addr) = coordinator_with(&nats, "prefill", |c| {
        c.coordinator.stall_timeout_ms = 500;
        c.coordinator.stream_timeout_ms = 700;
    })
    .await;
    let workers = [
        FakeWorker::start(&nats.url, Subjects::new("prefill")).await,
        FakeWorker::start(&nats.url, Subjects::new("prefill")).await,
    ];
    let submits = || -> u32 {
        workers
            .iter()
            .map(|w| w.log.submits.load(Ordering::SeqCst))
            .sum()
    };
    wait_healthy(addr).await;
    for stream in [false, true] {
        let before = submits();
        let r = post(
            addr,
            "/v1/chat/completions",
            chat("PREFILL", json!({"max_tokens": 3, "stream": stream})),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(!r.body.contains("stream_timeout"), "{}", r.body);
        assert!(r.body.contains("Hello"), "{}", r.body);
        // One submit: the stream never moved.
        assert_eq!(submits(), before + 1);
    }
}

/// Clients that open streams and go away do not hold the coordinator's places: only
/// live streams count against `max_streams`, and the abandoned ones kept for a
/// reattach are bounded.
#[actix_web::test]
async fn abandoned_streams_give_their_places_back() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (_running, addr) = coordinator_with(&nats, "dropped", |c| {
        c.coordinator.max_streams = 40;
        c.coordinator.max_detached_streams = 100;
        c.coordinator.max_batch = 1;
    })
    .await;
    let worker = FakeWorker::start(&nats.url, Subjects::new("dropped")).await;
    wait_healthy(addr).await;
    let body = chat("SLOW", json!({"stream": true})).to_string();
    for round in 0..10 {
        let opened =
            join_all((0..25).map(|_| open_stream(addr, "/v1/chat/completions", &body, "data: ")))
                .await;
        drop(opened);
        // Each round's streams stop on the worker once their clients are gone.
        let cancelled = || worker.log.cancelled.lock().expect("lock").len();
        assert!(
            eventually(10, || cancelled() >= 25 * (round + 1)).await,
            "round {round}: {} cancelled",
            cancelled()
        );
    }
    // 250 streams were opened and dropped, more than six times max_streams: a request
    // is served.
    let r = post(
        addr,
        "/v1/chat/completions",
        chat("hi", json!({"max_tokens": 3})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // At most max_detached_streams are kept for a reattach (trimmed on the sessions'
    // next tick).
    let mut held = f64::MAX;
    for _ in 0..50 {
        let metrics = request(addr, "GET", "/metrics", None).await;
        held = metrics
            .body
            .lines()
            .find(|l| l.starts_with("baton_streams_held "))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::MAX);
        if held <= 100.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(held <= 100.0, "{held} streams held");
}
