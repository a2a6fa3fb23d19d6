//! The HTTP API end to end: a real `nats-server` on a free port, the coordinator, and
//! fake workers speaking the wire protocol. Skipped (with a note) without `nats-server`.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use baton_common::subjects::Subjects;
use serde_json::{json, Value};
use support::{
    chat, coordinator, coordinator_with, eventually, open_stream, post, request, sse_events,
    wait_healthy, FakeWorker, NatsServer, MAX_BODY, MODEL,
};

#[actix_web::test]
async fn the_openai_api_end_to_end() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (running, addr) = coordinator(&nats, "e2e").await;

    // Nobody has spoken yet: not synced.
    let r = request(addr, "GET", "/health", None).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["status"], "not synced");
    let r = post(addr, "/v1/chat/completions", chat("hi", json!({}))).await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (503, json!("not_synced"))
    );

    let _worker = FakeWorker::start(&nats.url, Subjects::new("e2e")).await;
    wait_healthy(addr).await;
    let r = request(addr, "GET", "/v1/models", None).await;
    assert_eq!(r.status, 200);
    let models = r.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["owned_by"], "baton");

    // A whole chat answer.
    let r = post(
        addr,
        "/v1/chat/completions",
        chat("hi", json!({"max_tokens": 3})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().expect("id").starts_with("chatcmpl-"));
    assert_eq!(v["model"], MODEL);
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": "Hello world!"})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );

    // A streamed chat answer with usage.
    let body = chat(
        "hi",
        json!({"max_tokens": 2, "stream": true, "stream_options": {"include_usage": true}}),
    );
    let r = post(addr, "/v1/chat/completions", body.clone()).await;
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .expect("content type")
        .starts_with("text/event-stream"));
    let events = sse_events(&r.body);
    assert_eq!(events.len(), 5, "{}", r.body);
    let chunks: Vec<Value> = events[..4]
        .iter()
        .map(|(_, _, d)| serde_json::from_str(d).expect("json"))
        .collect();
    let stream_id = events[0]
        .1
        .as_deref()
        .expect("id")
        .split(':')
        .next()
        .expect("stream")
        .to_string();
    // Token events: position and chain hash (the fake worker's hashes are 0).
    assert_eq!(
        events[0].1.as_deref(),
        Some(format!("{stream_id}:0:0000000000000000").as_str())
    );
    assert_eq!(
        events[1].1.as_deref(),
        Some(format!("{stream_id}:1:0000000000000000").as_str())
    );
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": "Hello"})
    );
    assert_eq!(
        chunks[1]["choices"][0]["delta"],
        json!({"content": " world"})
    );
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[3]["choices"], json!([]));
    assert_eq!(chunks[3]["usage"]["total_tokens"], 5);
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
    assert_eq!(events[4].2, "[DONE]");

    // Reconnecting after position 0: with the stream's chain hash there the rest comes;
    // with another hash (the client holds another text) the answer is 409.
    let text = body.to_string();
    let again = |last: String| {
        let text = text.clone();
        async move {
            support::request_with(
                addr,
                "POST",
                "/v1/chat/completions",
                Some(&text),
                &[("Last-Event-ID", &last)],
            )
            .await
        }
    };
    let r = again(format!("{stream_id}:0:0000000000000000")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let rest = sse_events(&r.body);
    assert_eq!(
        rest[0].1.as_deref(),
        Some(format!("{stream_id}:1:0000000000000000").as_str()),
        "{}",
        r.body
    );
    let r = again(format!("{stream_id}:0:00000000000000ff")).await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "stream_diverged");

    // Completions, whole and streamed (token id prompt).
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "x", "max_tokens": 1}),
    )
    .await;
    let v = r.json();
    assert_eq!(
        (v["object"].clone(), v["choices"][0]["text"].clone()),
        (json!("text_completion"), json!("Hello"))
    );
    assert_eq!(v["usage"]["completion_tokens"], 1);
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": [1, 2], "max_tokens": 2, "stream": true}),
    )
    .await;
    let events = sse_events(&r.body);
    let texts: Vec<Value> = events[..2]
        .iter()
        .map(|(_, _, d)| {
            serde_json::from_str::<Value>(d).expect("json")["choices"][0]["text"].clone()
        })
        .collect();
    assert_eq!(texts, vec![json!("Hello"), json!(" world")]);
    assert_eq!(events.last().expect("done").2, "[DONE]");

    // Errors, before and after the headers.
    let err = |r: &support::Response| {
        (
            r.status,
            r.json()["error"]["code"].as_str().unwrap_or("").to_string(),
        )
    };
    let r = post(
        addr,
        "/v1/chat/completions",
        json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(err(&r), (404, "model_not_found".into()));
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let r = post(addr, "/v1/chat/completions", chat("TOO_LONG", json!({}))).await;
    assert_eq!(err(&r), (400, "context_length_exceeded".into()));
    let r = post(addr, "/v1/chat/completions", chat("BUSY", json!({}))).await;
    assert_eq!(err(&r), (429, "overloaded".into()));
    assert_eq!(r.header("retry-after"), Some("1"));
    let r = request(addr, "POST", "/v1/chat/completions", Some("{\"model\": ")).await;
    assert_eq!(err(&r), (400, "invalid_json".into()));
    let r = post(addr, "/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(err(&r), (400, "missing_required_parameter".into()));
    assert_eq!(r.json()["error"]["param"], "model");
    let r = post(addr, "/v1/chat/completions", chat("hi", json!({"n": 17}))).await;
    assert_eq!(err(&r), (400, "invalid_value".into()));
    let r = post(
        addr,
        "/v1/chat/completions",
        chat("hi", json!({"max_tokens": 100_000})),
    )
    .await;
    assert_eq!(err(&r), (400, "invalid_value".into()));
    let r = post(
        addr,
        "/v1/chat/completions",
        chat(&"x".repeat(MAX_BODY), json!({})),
    )
    .await;
    assert_eq!(err(&r), (413, "request_too_large".into()));
    let r = request(addr, "GET", "/v2/nothing", None).await;
    assert_eq!(err(&r), (404, "unknown_url".into()));
    let r = post(
        addr,
        "/v1/chat/completions",
        chat("BROKEN", json!({"stream": true})),
    )
    .await;
    assert_eq!(r.status, 200);
    let events = sse_events(&r.body);
    let (event, _, data) = events.last().expect("an error frame");
    assert_eq!(event.as_deref(), Some("error"), "{}", r.body);
    assert_eq!(
        serde_json::from_str::<Value>(data).expect("json")["error"]["code"],
        "worker_error"
    );
    assert!(!r.body.contains("[DONE]"));
    let r = post(addr, "/v1/chat/completions", chat("BROKEN", json!({}))).await;
    assert_eq!(err(&r), (502, "worker_error".into()));

    // Garbage on the wire is counted and dropped; the coordinator keeps serving.
    let client = async_nats::connect(&nats.url).await.expect("connect");
    let subjects = Subjects::new("e2e");
    client
        .publish(subjects.heartbeat(), "garbage".into())
        .await
        .expect("publish");
    client
        .publish(subjects.tokens(running.id), vec![0u8; 3].into())
        .await
        .expect("publish");
    client.flush().await.expect("flush");
    assert!(eventually(5, || running.counters.garbage() >= 2).await);
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "x", "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 200);

    running.handle.stop(false).await;
}

#[actix_web::test]
async fn requests_spread_over_workers_and_disconnects_cancel() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (running, addr) = coordinator(&nats, "spread").await;
    let a = FakeWorker::start(&nats.url, Subjects::new("spread")).await;
    let b = FakeWorker::start(&nats.url, Subjects::new("spread")).await;
    // Both workers must be known before routing is judged.
    let mut workers = 0;
    for _ in 0..250 {
        workers = request(addr, "GET", "/health", None).await.json()["workers"]
            .as_u64()
            .unwrap_or(0);
        if workers == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(workers, 2);
    let body = chat("SLOW", json!({"stream": true})).to_string();
    let (first, seen) = open_stream(addr, "/v1/chat/completions", &body, "data: ").await;
    assert!(seen.contains("\"role\":\"assistant\""));
    let (second, _) = open_stream(addr, "/v1/chat/completions", &body, "data: ").await;
    // Heartbeats say both are idle: only the in-flight count can tell them apart.
    assert_eq!(a.log.submits.load(Ordering::SeqCst), 1);
    assert_eq!(b.log.submits.load(Ordering::SeqCst), 1);

    // The clients go away: each worker is told to stop its stream.
    drop(first);
    drop(second);
    let cancelled = |w: &FakeWorker| w.log.cancelled.lock().expect("lock").len();
    // (A token already on its way when the first cancel went out draws another one.)
    assert!(
        eventually(5, || cancelled(&a) >= 1 && cancelled(&b) >= 1).await,
        "cancels sent"
    );

    running.handle.stop(false).await;
}

#[actix_web::test]
async fn silent_workers_leave_the_registry() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (running, addr) = coordinator(&nats, "silent").await;
    let worker = FakeWorker::start(&nats.url, Subjects::new("silent")).await;
    wait_healthy(addr).await;
    worker.silent.store(true, Ordering::SeqCst);
    let mut status = Value::Null;
    for _ in 0..100 {
        let r = request(addr, "GET", "/health", None).await;
        if r.status == 503 {
            status = r.json()["status"].clone();
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status, "no live workers");
    let r = request(addr, "GET", "/v1/models", None).await;
    assert_eq!(r.json()["data"], json!([]));
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "x"}),
    )
    .await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (503, json!("no_live_workers"))
    );
    running.handle.stop(false).await;
}

#[actix_web::test]
async fn requests_arriving_during_a_submit_share_the_next_one_and_max_streams_is_429() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (running, addr) = coordinator_with(&nats, "batch", |c| {
        c.coordinator.max_wait_ms = 2_000;
        c.coordinator.max_batch = 8;
        c.coordinator.max_streams = 6;
    })
    .await;
    let worker = FakeWorker::start(&nats.url, Subjects::new("batch")).await;
    wait_healthy(addr).await;
    // The first submit stays in flight for 300 ms; four requests arrive meanwhile.
    let first = actix_rt::spawn(post(
        addr,
        "/v1/chat/completions",
        chat("LATE_REPLY", json!({"max_tokens": 2})),
    ));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let rest: Vec<_> = (0..4)
        .map(|i| {
            actix_rt::spawn(post(
                addr,
                "/v1/chat/completions",
                chat(&format!("next {i}"), json!({"max_tokens": 2})),
            ))
        })
        .collect();
    assert_eq!(first.await.expect("join").status, 200);
    for r in rest {
        let r = r.await.expect("join");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(
        worker.log.submits.load(Ordering::SeqCst),
        2,
        "one submit, then one batch"
    );
    assert_eq!(worker.log.largest_submit.load(Ordering::SeqCst), 4);

    // Six slow streams fill max_streams: the seventh request gets 429.
    let body = chat("SLOW", json!({"stream": true})).to_string();
    let mut open = Vec::new();
    for _ in 0..6 {
        open.push(open_stream(addr, "/v1/chat/completions", &body, "data: ").await);
    }
    let r = post(addr, "/v1/chat/completions", chat("hi", json!({}))).await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "overloaded");
    assert_eq!(r.header("retry-after"), Some("1"));
    drop(open);
    let cancelled = || worker.log.cancelled.lock().expect("lock").len();
    // The six streams, and the four of the batch (their events beat the submit reply).
    assert!(
        eventually(5, || cancelled() >= 6).await,
        "cancelled {}",
        cancelled()
    );
    running.handle.stop(false).await;
}

#[actix_web::test]
async fn a_submit_lost_with_its_worker_goes_to_another_worker() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (running, addr) = coordinator_with(&nats, "lost", |c| {
        c.coordinator.submit_timeout_ms = 1_000;
    })
    .await;
    // The only worker takes submits and never answers (killed with them in flight).
    let dead = FakeWorker::start(&nats.url, Subjects::new("lost")).await;
    dead.mute.store(true, Ordering::SeqCst);
    wait_healthy(addr).await;
    let request = actix_rt::spawn(post(
        addr,
        "/v1/chat/completions",
        chat("hello", json!({"max_tokens": 2})),
    ));
    // Another worker joins while the submit waits for its answer.
    let alive = FakeWorker::start(&nats.url, Subjects::new("lost")).await;
    let r = request.await.expect("join");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(dead.log.submits.load(Ordering::SeqCst), 1);
    assert_eq!(alive.log.submits.load(Ordering::SeqCst), 1);
    running.handle.stop(false).await;
}

#[actix_web::test]
async fn a_stream_does_not_wait_behind_a_submit_older_than_max_wait() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (running, addr) = coordinator_with(&nats, "nowait", |c| {
        c.coordinator.max_wait_ms = 140;
        c.coordinator.max_batch = 8;
    })
    .await;
    let worker = FakeWorker::start(&nats.url, Subjects::new("nowait")).await;
    wait_healthy(addr).await;
    // The first submit stays in flight for 300 ms. A request 150 ms later, past
    // max_wait, goes out at once in a submit of its own: it does not wait for the
    // first one's reply (at 300 ms), nor for a window of its own (until 290 ms).
    let first = actix_rt::spawn(post(
        addr,
        "/v1/chat/completions",
        chat("LATE_REPLY", json!({"max_tokens": 2})),
    ));
    tokio::time::sleep(Duration::from_millis(150)).await;
    let second = actix_rt::spawn(post(
        addr,
        "/v1/chat/completions",
        chat("next", json!({"max_tokens": 2})),
    ));
    tokio::time::sleep(Duration::from_millis(80)).await;
    assert_eq!(
        worker.log.submits.load(Ordering::SeqCst),
        2,
        "the second request was submitted while the first submit was in flight"
    );
    assert_eq!(first.await.expect("join").status, 200);
    assert_eq!(second.await.expect("join").status, 200);
    assert_eq!(worker.log.largest_submit.load(Ordering::SeqCst), 1);
    running.handle.stop(false).await;
}

/// A stream with nothing to send for a while sends keep-alive comments, which SSE
/// clients skip: its events are those of a stream without them.
#[actix_web::test]
async fn a_silent_stream_sends_keep_alive_comments() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (running, addr) = coordinator_with(&nats, "keepalive", |c| {
        c.coordinator.sse_keepalive_ms = 50;
    })
    .await;
    let _worker = FakeWorker::start(&nats.url, Subjects::new("keepalive")).await;
    wait_healthy(addr).await;
    let r = post(
        addr,
        "/v1/chat/completions",
        chat("PAUSE", json!({"max_tokens": 2, "stream": true})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Comment lines alone, no blank line after them (which would dispatch an event).
    assert!(!r.body.contains(": keep-alive\n\n"), "{:?}", r.body);
    let comments = r.body.matches(": keep-alive\n").count();
    // 600 ms of silence in 300 ms gaps: at least four comments at 50 ms.
    assert!(comments >= 4, "{comments} keep-alives in {:?}", r.body);
    // Every event has data: the comments made none of their own.
    let events = sse_events(&r.body);
    assert!(
        events.iter().all(|(_, _, data)| !data.is_empty()),
        "{}",
        r.body
    );
    assert_eq!(
        events.len(),
        4,
        "two tokens, the finish and [DONE]: {}",
        r.body
    );
    assert_eq!(events[3].2, "[DONE]");
    // Without keep-alives the same silence is quiet.
    let (quiet, quiet_addr) = coordinator_with(&nats, "keepalive", |c| {
        c.coordinator.sse_keepalive_ms = 0;
    })
    .await;
    wait_healthy(quiet_addr).await;
    let r = post(
        quiet_addr,
        "/v1/chat/completions",
        chat("PAUSE", json!({"max_tokens": 2, "stream": true})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(!r.body.contains("keep-alive"), "{}", r.body);
    quiet.handle.stop(false).await;
    running.handle.stop(false).await;
}

/// `baton_streams_held` once it is `want` (polled for up to 5 s), or its last value.
async fn streams_held(addr: SocketAddr, want: u64) -> Option<u64> {
    let mut held = None;
    for _ in 0..250 {
        let text = request(addr, "GET", "/metrics", None).await.body;
        held = text
            .lines()
            .find_map(|l| l.strip_prefix("baton_streams_held "))
            .and_then(|v| v.trim().parse().ok());
        if held == Some(want) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    held
}

#[actix_web::test]
async fn a_stream_its_client_left_is_dropped_after_the_reconnect_window() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (running, addr) = coordinator_with(&nats, "abandoned", |c| {
        c.coordinator.reconnect_window_s = 1;
    })
    .await;
    let worker = FakeWorker::start(&nats.url, Subjects::new("abandoned")).await;
    wait_healthy(addr).await;
    let body = chat("SLOW", json!({"stream": true})).to_string();
    let (client, seen) = open_stream(addr, "/v1/chat/completions", &body, "data: ").await;
    let id = seen
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("x-request-id")
                .then(|| value.trim().to_string())
        })
        .expect("a request id");
    assert_eq!(streams_held(addr, 1).await, Some(1));
    // The client goes away: the worker stops the stream, which waits for its client.
    drop(client);
    // (A token already on its way when the cancel went out draws another one.)
    let cancelled = || !worker.log.cancelled.lock().expect("lock").is_empty();
    assert!(eventually(5, cancelled).await, "the stream was stopped");
    // Nobody comes back within the window: the stream is dropped.
    assert_eq!(streams_held(addr, 0).await, Some(0), "after the window");
    let r = request(addr, "GET", &format!("/v1/streams/{id}"), None).await;
    assert_eq!(r.status, 404, "{}", r.body);
    running.handle.stop(false).await;
}

/// A worker's tool call reaches the client named after the stream (`call_…`, the same on
/// a replay), as one streamed delta with its index, and in a whole answer as the
/// message's `tool_calls` beside the text before it; `finish_reason` is `tool_calls`.
#[actix_web::test]
async fn tool_calls_are_named_streamed_whole_and_replayed() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (running, addr) = coordinator(&nats, "tools").await;
    let _worker = FakeWorker::start(&nats.url, Subjects::new("tools")).await;
    wait_healthy(addr).await;
    let tools = json!({"tools": [{"type": "function", "function": {"name": "get_weather"}}],
                       "tool_choice": "required", "max_tokens": 2});
    let mut streamed = tools.clone();
    streamed["stream"] = json!(true);
    let r = post(
        addr,
        "/v1/chat/completions",
        chat("TOOLCALL", streamed.clone()),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let events = sse_events(&r.body);
    let chunks: Vec<Value> = events
        .iter()
        .filter(|(_, _, d)| d.starts_with('{'))
        .map(|(_, _, d)| serde_json::from_str(d).expect("json"))
        .collect();
    let stream_id = events[0]
        .1
        .as_deref()
        .expect("id")
        .split(':')
        .next()
        .expect("stream");
    let want_id = format!("call_{}0000", &stream_id[..20]);
    let call_chunk = chunks
        .iter()
        .find(|c| !c["choices"][0]["delta"]["tool_calls"].is_null())
        .expect("a tool call chunk");
    assert_eq!(
        call_chunk["choices"][0]["delta"]["tool_calls"],
        json!([{"index": 0, "id": want_id, "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}])
    );
    assert_eq!(
        chunks.last().expect("finish")["choices"][0]["finish_reason"],
        "tool_calls"
    );
    // A replay from the start gives the same call, named the same.
    let r = support::request_with(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("TOOLCALL", streamed).to_string()),
        &[("Last-Event-ID", stream_id)],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.body.contains(&format!("\"id\":\"{want_id}\"")),
        "{}",
        r.body
    );
    // Whole.
    let r = post(addr, "/v1/chat/completions", chat("TOOLCALL", tools)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    let message = &body["choices"][0]["message"];
    // The fake's first token is text, its second the call.
    assert_eq!(message["content"], "Hello", "{body}");
    assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
    assert!(message["tool_calls"][0].get("index").is_none(), "{body}");
    assert!(message["tool_calls"][0]["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("call_")));
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    running.handle.stop(false).await;
}

/// `n` choices: each its own stream (the group's id counted up), whole and streamed; a
/// streamed group's event ids carry every choice's position, and a client that
/// reconnects with one gets each choice's rest.
#[actix_web::test]
async fn n_choices_are_streams_of_their_own() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (running, addr) = coordinator(&nats, "choices").await;
    let _worker = FakeWorker::start(&nats.url, Subjects::new("choices")).await;
    wait_healthy(addr).await;
    let r = post(
        addr,
        "/v1/chat/completions",
        chat("hi", json!({"n": 3, "max_tokens": 2})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    let choices = body["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{body}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], "Hello world");
        assert_eq!(c["finish_reason"], "length");
    }
    assert_eq!(body["usage"]["prompt_tokens"], 3, "the prompt once: {body}");
    assert_eq!(
        body["usage"]["completion_tokens"], 6,
        "every choice's tokens: {body}"
    );

    let streamed = chat(
        "hi",
        json!({"n": 3, "max_tokens": 2, "stream": true,
               "stream_options": {"include_usage": true}}),
    );
    let r = post(addr, "/v1/chat/completions", streamed.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let events = sse_events(&r.body);
    assert_eq!(events.last().map(|e| e.2.as_str()), Some("[DONE]"));
    assert_eq!(events.iter().filter(|e| e.2 == "[DONE]").count(), 1);
    let chunks: Vec<Value> = events
        .iter()
        .filter(|(_, _, d)| d.starts_with('{'))
        .map(|(_, _, d)| serde_json::from_str(d).expect("json"))
        .collect();
    let mut text = vec![String::new(); 3];
    let mut finished = 0;
    for c in &chunks {
        for ch in c["choices"].as_array().into_iter().flatten() {
            let i = ch["index"].as_u64().expect("index") as usize;
            text[i].push_str(ch["delta"]["content"].as_str().unwrap_or_default());
            finished += usize::from(ch["finish_reason"].is_string());
        }
    }
    assert_eq!(text, vec!["Hello world"; 3]);
    assert_eq!(finished, 3);
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage["completion_tokens"], 6, "{usage}");
    // Ids: `<group>:<p0>.<p1>.<p2>`, the group the response's id.
    let first_id = events[0].1.clone().expect("an id");
    let (group, positions) = first_id.split_once(':').expect("group id");
    assert_eq!(chunks[0]["id"], format!("chatcmpl-{group}"));
    assert_eq!(positions.split('.').count(), 3, "{first_id}");
    // Reconnecting after the first event: the rest of every choice.
    let r = support::request_with(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&streamed.to_string()),
        &[("Last-Event-ID", &first_id)],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let rest = sse_events(&r.body);
    let mut again = vec![String::new(); 3];
    for (_, _, d) in &rest {
        let Ok(c) = serde_json::from_str::<Value>(d) else {
            continue;
        };
        for ch in c["choices"].as_array().into_iter().flatten() {
            let i = ch["index"].as_u64().expect("index") as usize;
            again[i].push_str(ch["delta"]["content"].as_str().unwrap_or_default());
        }
    }
    // The choice whose first token the client had gets only its second.
    let had: Vec<&str> = positions.split('.').collect();
    for i in 0..3 {
        let want = if had[i] == "0" {
            " world"
        } else {
            "Hello world"
        };
        assert_eq!(again[i], want, "choice {i} after {first_id}: {}", r.body);
    }
    assert_eq!(rest.last().map(|e| e.2.as_str()), Some("[DONE]"));
    running.handle.stop(false).await;
}
