//! What careless and hostile clients can do to the coordinator, each answered without a
//! 5xx and without harm to other clients: a real `nats-server` (its default
//! `max_payload`, 1 MiB), the coordinator and fake workers. Skipped (with a note) without
//! `nats-server`.

mod support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use baton_common::subjects::Subjects;
use futures::future::join_all;
use serde_json::{json, Value};
use support::{
    chat, coordinator_with, eventually, open_stream, post, request, wait_healthy, FakeWorker,
    NatsServer, MODEL,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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
        // Each round's streams stop on the worker once their clients are gone (a stream
        // may draw more than one cancel: count streams).
        let cancelled = || {
            let log = worker.log.cancelled.lock().expect("lock");
            log.iter().collect::<std::collections::HashSet<_>>().len()
        };
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

/// Bodies that dribble in are cut at `body_timeout_ms` (408); one address holds at most
/// `max_connections_per_client` connections (429 on the others, which are closed), and
/// its places come back as its connections close.
#[actix_web::test]
async fn slow_bodies_time_out_and_one_address_holds_a_bounded_number_of_connections() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (_running, addr) = coordinator_with(&nats, "slow", |c| {
        c.coordinator.body_timeout_ms = 600;
        c.coordinator.max_connections_per_client = 20;
    })
    .await;
    let _worker = FakeWorker::start(&nats.url, Subjects::new("slow")).await;
    wait_healthy(addr).await;

    // A body of 100 bytes sent a byte every 100 ms.
    let head = |len: usize| {
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {len}\r\n\r\n"
        )
    };
    let mut slow = TcpStream::connect(addr).await.expect("connect");
    slow.write_all(head(100).as_bytes()).await.expect("head");
    let started = Instant::now();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&answer).contains("request_timeout") {
        assert!(started.elapsed() < Duration::from_secs(5), "no 408 in time");
        let _ = slow.write_all(b" ").await;
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(100), slow.read(&mut buf)).await
        {
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
        }
    }
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");

    // Twenty connections each sending half a body hold every place of this address.
    let mut held = Vec::new();
    for _ in 0..20 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(head(100).as_bytes()).await.expect("head");
        held.push(s);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r = post(
        addr,
        "/v1/chat/completions",
        chat("hi", json!({"max_tokens": 2})),
    )
    .await;
    assert_eq!(
        refusal(&r),
        (429, "too_many_connections".into()),
        "{}",
        r.body
    );
    drop(held);
    // The places come back with the connections.
    let mut served = false;
    for _ in 0..50 {
        let r = post(
            addr,
            "/v1/chat/completions",
            chat("hi", json!({"max_tokens": 2})),
        )
        .await;
        if r.status == 200 {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served, "the address's places never came back");
}

/// The web server's own refusals have OpenAI's error shape, a client's long model name
/// is not echoed whole, and a failed whole answer is counted once.
#[actix_web::test]
async fn rough_edges_answer_in_shape() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (_running, addr) = coordinator_with(&nats, "edges", |c| {
        c.coordinator.max_body_bytes = 1 << 20;
    })
    .await;
    let _worker = FakeWorker::start(&nats.url, Subjects::new("edges")).await;
    wait_healthy(addr).await;

    let r = request(addr, "GET", "/v1/chat/completions", None).await;
    assert_eq!(
        refusal(&r),
        (405, "method_not_allowed".into()),
        "{}",
        r.body
    );
    let r = request(addr, "DELETE", "/v1/models", None).await;
    assert_eq!(
        refusal(&r),
        (405, "method_not_allowed".into()),
        "{}",
        r.body
    );

    let name = "m".repeat(100_000);
    let r = post(
        addr,
        "/v1/chat/completions",
        json!({"model": name, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(refusal(&r), (404, "model_not_found".into()));
    assert!(r.body.len() < 1000, "{} bytes", r.body.len());
    assert!(r.body.contains("100000 bytes"), "{}", r.body);

    // A whole answer whose stream fails (its only worker fails it) is one request.
    let r = post(
        addr,
        "/v1/chat/completions",
        chat("BROKEN", json!({"max_tokens": 4})),
    )
    .await;
    let (status, code) = refusal(&r);
    assert!(status >= 400, "{}", r.body);
    let metrics = request(addr, "GET", "/metrics", None).await;
    let counted: f64 = metrics
        .body
        .lines()
        .filter(|l| l.starts_with("baton_requests_total{") && l.contains(&format!("\"{code}\"")))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum();
    assert_eq!(counted, 1.0, "{code}: {}", metrics.body);
}
