//! Test support: a real `nats-server` on a free port, a fake worker speaking the wire
//! protocol, and a minimal HTTP/1.1 client (enough for JSON bodies and SSE).

#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_common::config::ClusterConfig;
use baton_common::ids::{CoordinatorId, StreamId, WorkerId};
use baton_common::protocol::{
    decode, Accepted, Body, ErrorKind, EventKind, FinishReason, Finished, Heartbeat, ModelInfo,
    PromptSpec, Refused, Sequencer, StreamEvent, SubmitOutcome, SubmitReply, TokenBatch,
    TokenEvent, ToolCall, WireError,
};
use baton_common::subjects::Subjects;
use baton_coordinator::nats::Counters;
use baton_coordinator::Running;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Logs to the test output when `RUST_LOG` is set.
pub fn init_logs() {
    if std::env::var("RUST_LOG").is_ok() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// A `nats-server` process, killed on drop.
pub struct NatsServer {
    child: Child,
    pub url: String,
}

impl NatsServer {
    /// Starts one on a free port, or `None` when `nats-server` is not installed. Waits
    /// until it accepts connections (up to 10 s: tests start many at once on a loaded
    /// machine), and starts again on another port if it exits first or just after
    /// (another process took the port between picking it and binding it).
    pub fn start() -> Option<Self> {
        init_logs();
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0")
                .ok()?
                .local_addr()
                .ok()?
                .port();
            let child = Command::new("nats-server")
                .args(["-a", "127.0.0.1", "-p", &port.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let mut child = match child {
                Ok(c) => c,
                Err(_) => {
                    eprintln!("nats-server is not on PATH: skipping this test");
                    return None;
                }
            };
            for _ in 0..500 {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    // Another test's server may have taken the port we picked (and
                    // answered this connection): ours then exits as it binds. Give it
                    // that moment before trusting the port.
                    std::thread::sleep(Duration::from_millis(150));
                    if matches!(child.try_wait(), Ok(Some(_))) {
                        break;
                    }
                    return Some(Self {
                        child,
                        url: format!("nats://127.0.0.1:{port}"),
                    });
                }
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("nats-server did not start accepting connections in five tries");
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a fake worker saw.
#[derive(Default)]
pub struct FakeLog {
    pub submits: AtomicU32,
    /// Most sequences one submit carried.
    pub largest_submit: AtomicU32,
    pub cancelled: Mutex<Vec<StreamId>>,
}

/// A worker that serves model `fake`. Its answer to any prompt is the words "Hello",
/// " world", "!" repeated up to `max_tokens`. A prompt of token ids counts its ids, any
/// other [`PROMPT_TOKENS`], against a request's `max_prompt_tokens` (over it: refused,
/// context length). Prompts
/// containing `TOO_LONG`, `BUSY` or `BROKEN` are refused (context length) or
/// overloaded, or fail after one token; `SLOW` prompts produce a token every 20 ms until
/// cancelled; `PAUSE` prompts wait 300 ms before each token; `LATE_REPLY` prompts
/// answer their submit after 300 ms; `PREFILL` prompts report prompt progress every
/// 100 ms for 1.5 s before their first token (a long prompt in chunks).
pub struct FakeWorker {
    pub id: WorkerId,
    pub log: Arc<FakeLog>,
    /// Stops the heartbeats (the worker goes silent).
    pub silent: Arc<AtomicBool>,
    /// Submits are counted but neither answered nor run (a worker killed with them in
    /// flight).
    pub mute: Arc<AtomicBool>,
}

pub const MODEL: &str = "fake";
pub const PROMPT_TOKENS: u32 = 3;
const WORDS: [&str; 3] = ["Hello", " world", "!"];

impl FakeWorker {
    pub async fn start(url: &str, subjects: Subjects) -> Self {
        let id = WorkerId::random();
        let client = async_nats::connect(url)
            .await
            .expect("fake worker connects");
        let log = Arc::new(FakeLog::default());
        let silent = Arc::new(AtomicBool::new(false));
        let mute = Arc::new(AtomicBool::new(false));
        let seq = Arc::new(Sequencer::new(id.0));
        let mut submits = client
            .subscribe(subjects.submit(id))
            .await
            .expect("subscribe");
        let mut cancels = client
            .subscribe(subjects.cancel(id))
            .await
            .expect("subscribe");
        client.flush().await.expect("flush");

        let (c, s, q, quiet) = (
            client.clone(),
            subjects.clone(),
            seq.clone(),
            silent.clone(),
        );
        tokio::spawn(async move {
            while !quiet.load(Ordering::SeqCst) {
                let hb = Heartbeat {
                    worker: id,
                    models: vec![ModelInfo {
                        name: MODEL.into(),
                        context_length: 2048,
                        fingerprint: 1,
                    }],
                    capacity: 8,
                    running: 0,
                    queued: 0,
                    kv_used_bytes: 0,
                    kv_budget_bytes: 1 << 20,
                    draining: false,
                    version: "fake".into(),
                };
                let _ = c
                    .publish(s.heartbeat(), q.encode(Body::Heartbeat(hb)).into())
                    .await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });

        let l = log.clone();
        tokio::spawn(async move {
            while let Some(msg) = cancels.next().await {
                if let Ok(wire) = decode(&msg.payload) {
                    if let Body::Cancel(c) = wire.body {
                        l.cancelled
                            .lock()
                            .expect("lock")
                            .extend(c.streams.iter().map(|s| s.stream));
                    }
                }
            }
        });

        let (c, l, muted) = (client.clone(), log.clone(), mute.clone());
        tokio::spawn(async move {
            while let Some(msg) = submits.next().await {
                let Ok(wire) = decode(&msg.payload) else {
                    continue;
                };
                let Body::Submit(submit) = wire.body else {
                    continue;
                };
                l.submits.fetch_add(1, Ordering::SeqCst);
                l.largest_submit
                    .fetch_max(submit.sequences.len() as u32, Ordering::SeqCst);
                if muted.load(Ordering::SeqCst) {
                    continue;
                }
                // `LATE_REPLY` prompts keep the submit in flight for 300 ms.
                let slow_reply = submit.sequences.iter().any(|sr| match &sr.prompt {
                    PromptSpec::Chat(turns) => {
                        turns.iter().any(|t| t.content.contains("LATE_REPLY"))
                    }
                    PromptSpec::Text(t) => t.contains("LATE_REPLY"),
                    PromptSpec::Tokens(_) => false,
                });
                let mut outcomes = Vec::new();
                let mut runs = Vec::new();
                for sr in submit.sequences {
                    let text = match &sr.prompt {
                        PromptSpec::Text(t) => t.clone(),
                        PromptSpec::Chat(turns) => {
                            turns.iter().map(|t| t.content.clone()).collect()
                        }
                        PromptSpec::Tokens(_) => String::new(),
                    };
                    let refuse = |kind| {
                        SubmitOutcome::Refused(Refused {
                            stream: sr.stream,
                            error: WireError {
                                kind,
                                message: format!("fake refusal {kind:?}"),
                            },
                        })
                    };
                    let counted = match &sr.prompt {
                        PromptSpec::Tokens(ids) => ids.len() as u32,
                        _ => PROMPT_TOKENS,
                    };
                    let over_limit = sr.max_prompt_tokens > 0 && counted > sr.max_prompt_tokens;
                    if text.contains("TOO_LONG") || over_limit {
                        outcomes.push(refuse(ErrorKind::PromptTooLong));
                    } else if text.contains("BUSY") {
                        outcomes.push(refuse(ErrorKind::Overloaded));
                    } else {
                        outcomes.push(SubmitOutcome::Accepted(Accepted {
                            stream: sr.stream,
                            prompt_tokens: PROMPT_TOKENS,
                        }));
                        runs.push((sr.stream, sr.attempt, sr.params.max_tokens, text));
                    }
                }
                let reply = seq.encode(Body::SubmitReply(SubmitReply { outcomes }));
                // Tokens first, reply second: the coordinator must cope with either order.
                for (stream, attempt, max_tokens, text) in runs {
                    let (c, s, q, l) = (c.clone(), subjects.clone(), seq.clone(), l.clone());
                    let coordinator = submit.coordinator;
                    tokio::spawn(async move {
                        let send = |kind| {
                            let batch = TokenBatch {
                                worker: id,
                                events: vec![StreamEvent {
                                    stream,
                                    attempt,
                                    kind,
                                }],
                            };
                            let bytes = q.encode(Body::Tokens(batch));
                            let c = c.clone();
                            let subject = s.tokens(coordinator);
                            async move { c.publish(subject, bytes.into()).await.expect("publish") }
                        };
                        if text.contains("PREFILL") {
                            for chunk in 1..=15 {
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                send(EventKind::Progress(chunk * 256)).await;
                            }
                        }
                        let slow = text.contains("SLOW");
                        let pause = text.contains("PAUSE");
                        let limit = if slow { 10_000 } else { max_tokens };
                        for i in 0..limit {
                            if pause {
                                tokio::time::sleep(Duration::from_millis(300)).await;
                            }
                            if l.cancelled.lock().expect("lock").contains(&stream) {
                                return;
                            }
                            let mut word = WORDS[i as usize % WORDS.len()].to_string();
                            // `TOOLCALL`: the second token completes a call, unnamed
                            // (the coordinator names it).
                            let mut tool_calls = Vec::new();
                            if text.contains("TOOLCALL") && i == 1 {
                                word.clear();
                                tool_calls.push(ToolCall {
                                    index: 0,
                                    id: String::new(),
                                    name: "get_weather".into(),
                                    arguments: r#"{"city":"Oslo"}"#.into(),
                                });
                            }
                            send(EventKind::Token(TokenEvent {
                                index: i,
                                id: i,
                                hash: 0,
                                text: word,
                                logprobs: None,
                                tool_calls,
                            }))
                            .await;
                            if text.contains("BROKEN") {
                                let e = WireError {
                                    kind: ErrorKind::Internal,
                                    message: "fake crash".into(),
                                };
                                send(EventKind::Failed(e)).await;
                                return;
                            }
                            if slow {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                        }
                        let finished = Finished {
                            reason: if text.contains("TOOLCALL") {
                                FinishReason::ToolCalls
                            } else {
                                FinishReason::Length
                            },
                            prompt_tokens: PROMPT_TOKENS,
                            completion_tokens: limit,
                            cached_tokens: 0,
                        };
                        send(EventKind::Finished(finished)).await;
                    });
                }
                if let Some(reply_to) = msg.reply {
                    // Answered beside the next submits, as a worker's actor does.
                    let c = c.clone();
                    tokio::spawn(async move {
                        let pause = if slow_reply { 300 } else { 5 };
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                        let _ = c.publish(reply_to, reply.into()).await;
                    });
                }
            }
        });
        Self {
            id,
            log,
            silent,
            mute,
        }
    }
}

/// An HTTP response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// Sends one request (`Connection: close`) and reads the whole response.
pub async fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Response {
    request_with(addr, method, path, body, &[]).await
}

/// Header lines (`Name: value\r\n`) of `headers`.
fn header_lines(headers: &[(&str, &str)]) -> String {
    headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect()
}

/// [`request`] with extra headers.
pub async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Response {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let body = body.unwrap_or("");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\n{}Content-Length: {}\r\n\r\n",
        header_lines(headers),
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    stream.write_all(body.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> Response {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("a response head");
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Response {
        status,
        headers,
        body,
    }
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

/// Opens a streaming request and returns the connection once `until` appears in what
/// was read (the caller may then drop it, as a client that goes away).
pub async fn open_stream(
    addr: SocketAddr,
    path: &str,
    body: &str,
    until: &str,
) -> (TcpStream, String) {
    open_stream_with(addr, "POST", path, body, &[], until).await
}

/// [`open_stream`] with another method and extra headers.
pub async fn open_stream_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
    until: &str,
) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         {}Content-Length: {}\r\n\r\n{body}",
        header_lines(headers),
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains(until) {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("data in time")
            .expect("read");
        assert!(
            n > 0,
            "connection closed early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    (stream, String::from_utf8_lossy(&seen).into_owned())
}

/// The `data:` payloads and ids of an SSE body, in order: `(event, id, data)`.
pub fn sse_events(body: &str) -> Vec<(Option<String>, Option<String>, String)> {
    body.split("\n\n")
        .filter(|f| !f.trim().is_empty())
        .map(|frame| {
            let (mut event, mut id, mut data) = (None, None, String::new());
            for line in frame.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    event = Some(v.to_string());
                } else if let Some(v) = line.strip_prefix("id: ") {
                    id = Some(v.to_string());
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data.push_str(v);
                }
            }
            (event, id, data)
        })
        .collect()
}

/// Polls `f` every 20 ms for up to `secs` seconds.
pub async fn eventually<F: FnMut() -> bool>(secs: u64, mut f: F) -> bool {
    for _ in 0..secs * 50 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

/// The coordinator's `max_body_bytes` in these tests.
pub const MAX_BODY: usize = 4096;

/// A coordinator started for a test.
pub struct Started {
    /// The checkpoint store's directory, removed on drop.
    pub _store: tempfile::TempDir,
    pub id: CoordinatorId,
    pub counters: Arc<Counters>,
    pub handle: actix_web::dev::ServerHandle,
}

/// A coordinator (its server spawned on this test's system) and its address.
pub async fn coordinator(nats: &NatsServer, prefix: &str) -> (Started, SocketAddr) {
    coordinator_with(nats, prefix, |_| {}).await
}

pub async fn coordinator_with(
    nats: &NatsServer,
    prefix: &str,
    tweak: impl FnOnce(&mut ClusterConfig),
) -> (Started, SocketAddr) {
    let mut cluster = ClusterConfig::default();
    cluster.nats.url = nats.url.clone();
    cluster.nats.subject_prefix = prefix.into();
    cluster.coordinator.listen = "127.0.0.1:0".into();
    cluster.coordinator.max_body_bytes = MAX_BODY;
    cluster.coordinator.worker_timeout_ms = 600;
    // A stream whose only worker fails it has nowhere to go: fail fast.
    cluster.coordinator.resume_deadline_ms = 300;
    let store = tempfile::tempdir().expect("tempdir");
    cluster.coordinator.store_path = store.path().display().to_string();
    tweak(&mut cluster);
    let running = baton_coordinator::start(cluster)
        .await
        .expect("coordinator starts");
    let addr = running.addrs[0];
    let Running {
        id,
        counters,
        handle,
        server,
        ..
    } = running;
    actix_rt::spawn(server);
    (
        Started {
            _store: store,
            id,
            counters,
            handle,
        },
        addr,
    )
}

pub async fn post(addr: SocketAddr, path: &str, body: Value) -> Response {
    request(addr, "POST", path, Some(&body.to_string())).await
}

pub async fn wait_healthy(addr: SocketAddr) {
    for _ in 0..250 {
        if request(addr, "GET", "/health", None).await.status == 200 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the coordinator never saw the worker");
}

pub fn chat(content: &str, extra: Value) -> Value {
    let mut v = json!({"model": MODEL, "messages": [{"role": "user", "content": content}]});
    for (k, x) in extra.as_object().expect("object") {
        v[k] = x.clone();
    }
    v
}
