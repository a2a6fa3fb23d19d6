//! API keys and per-request limits through the HTTP API: a real `nats-server`, the
//! coordinator with keys configured, and a fake worker. Skipped (with a note) without
//! `nats-server`.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use baton_common::config::ClusterConfig;
use baton_common::secret::Secret;
use baton_common::subjects::Subjects;
use baton_coordinator::Running;
use serde_json::{json, Value};
use support::{
    chat, open_stream_with, request_with, sse_events, FakeWorker, NatsServer, Response, MODEL,
};

const USER_A: &str = "sk-user-a-0123456789";
const USER_B: &str = "sk-user-b-0123456789";
const ADMIN: &str = "sk-admin-0123456789";
const MAX_BODY: usize = 4096;

/// A coordinator on a free port, its server spawned on this test's system; stops on drop.
struct Coordinator {
    addr: SocketAddr,
    handle: actix_web::dev::ServerHandle,
    _store: tempfile::TempDir,
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        // Stops accepting at once; the system ends with the test.
        drop(self.handle.stop(false));
    }
}

/// A coordinator (keys and limits set by `tweak`) and a fake worker it has heard from.
async fn cluster(
    nats: &NatsServer,
    prefix: &str,
    tweak: impl FnOnce(&mut ClusterConfig),
) -> (Coordinator, FakeWorker) {
    let mut cluster = ClusterConfig::default();
    cluster.nats.url = nats.url.clone();
    cluster.nats.subject_prefix = prefix.into();
    cluster.coordinator.listen = "127.0.0.1:0".into();
    cluster.coordinator.max_body_bytes = MAX_BODY;
    let store = tempfile::tempdir().expect("tempdir");
    cluster.coordinator.store_path = store.path().display().to_string();
    tweak(&mut cluster);
    let running = baton_coordinator::start(cluster)
        .await
        .expect("coordinator starts");
    let Running {
        addrs,
        handle,
        server,
        ..
    } = running;
    actix_rt::spawn(server);
    let coordinator = Coordinator {
        addr: addrs[0],
        handle,
        _store: store,
    };
    let worker = FakeWorker::start(&nats.url, Subjects::new(prefix)).await;
    for _ in 0..250 {
        if call(&coordinator, "GET", "/health", None, None)
            .await
            .status
            == 200
        {
            return (coordinator, worker);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the coordinator never saw the worker");
}

fn keys(c: &mut ClusterConfig) {
    c.auth.api_keys = vec![Secret::new(USER_A), Secret::new(USER_B)];
    c.auth.admin_keys = vec![Secret::new(ADMIN)];
}

/// `method path` with `key` as a Bearer token, if any.
async fn call(
    c: &Coordinator,
    method: &str,
    path: &str,
    body: Option<&Value>,
    key: Option<&str>,
) -> Response {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    let body = body.map(Value::to_string);
    request_with(c.addr, method, path, body.as_deref(), &headers).await
}

/// Status and `error.code` of an answer.
fn refusal(r: &Response) -> (u16, String) {
    let code = r.json()["error"]["code"].as_str().unwrap_or("").to_string();
    (r.status, code)
}

/// The stream id of a finished SSE answer.
fn stream_id(r: &Response) -> String {
    let events = sse_events(&r.body);
    let id = events[0].1.as_deref().expect("an id");
    id.split(':').next().expect("stream").to_string()
}

#[actix_web::test]
async fn keys_guard_every_route_but_health_and_the_page() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (c, worker) = cluster(&nats, "keys", keys).await;
    let body = chat("hi", json!({"max_tokens": 2}));
    let completions = "/v1/chat/completions";

    // No key, a wrong key, another scheme: 401 with a Bearer challenge.
    let r = call(&c, "POST", completions, Some(&body), None).await;
    assert_eq!(refusal(&r), (401, "invalid_api_key".into()));
    assert_eq!(
        r.header("www-authenticate"),
        Some(r#"Bearer realm="baton""#)
    );
    let error = &r.json()["error"];
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(error["param"], Value::Null);
    assert!(error["message"]
        .as_str()
        .expect("message")
        .contains("Bearer"));
    let r = call(&c, "POST", completions, Some(&body), Some("sk-wrong")).await;
    assert_eq!(refusal(&r), (401, "invalid_api_key".into()));
    assert_eq!(
        r.header("www-authenticate"),
        Some(r#"Bearer realm="baton", error="invalid_token""#)
    );
    assert!(!r.body.contains("sk-wrong"), "the key is not echoed");
    let basic = [("Authorization", "Basic c2stdXNlci1h")];
    let r = request_with(c.addr, "POST", completions, Some(&body.to_string()), &basic).await;
    assert_eq!(refusal(&r), (401, "invalid_api_key".into()));
    for path in ["/v1/models", "/v1/streams/nothing", "/v2/nothing"] {
        let r = call(&c, "GET", path, None, None).await;
        assert_eq!(r.status, 401, "{path}: {}", r.body);
    }

    // An API key: generation and models, streamed and whole; unknown URLs are 404.
    let r = call(&c, "POST", completions, Some(&body), Some(USER_A)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["message"]["content"], "Hello world");
    let streamed = chat("hi", json!({"max_tokens": 2, "stream": true}));
    let r = call(&c, "POST", completions, Some(&streamed), Some(USER_B)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(sse_events(&r.body).last().expect("done").2, "[DONE]");
    let r = call(&c, "GET", "/v1/models", None, Some(USER_A)).await;
    assert_eq!(r.json()["data"][0]["id"], MODEL);
    let r = call(&c, "GET", "/v2/nothing", None, Some(USER_A)).await;
    assert_eq!(refusal(&r), (404, "unknown_url".into()));

    // Admin routes: 403 for an API key (whatever the path's spelling), 200 for an admin
    // key, which may also generate.
    let drain = format!(
        "/admin/workers/{}/drain",
        baton_common::ids::WorkerId::random()
    );
    for (method, path) in [
        ("GET", "/metrics"),
        ("GET", "/v1/status"),
        ("POST", drain.as_str()),
        ("POST", "/%61dmin/workers/x/drain"),
    ] {
        let r = call(&c, method, path, None, Some(USER_A)).await;
        assert_eq!(
            refusal(&r),
            (403, "insufficient_permissions".into()),
            "{path}"
        );
        assert!(r
            .header("www-authenticate")
            .is_some_and(|h| h.contains("insufficient_scope")));
        let r = call(&c, method, path, None, None).await;
        assert_eq!(r.status, 401, "{path}");
    }
    let r = call(&c, "GET", "/v1/status", None, Some(ADMIN)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["workers"][0]["id"], worker.id.to_string());
    let r = call(&c, "POST", &drain, None, Some(ADMIN)).await;
    assert_eq!(refusal(&r), (404, "worker_not_found".into()));
    let r = call(&c, "POST", completions, Some(&body), Some(ADMIN)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = call(&c, "GET", "/metrics", None, Some(ADMIN)).await;
    assert_eq!(r.status, 200);
    assert!(
        r.body
            .contains(r#"baton_http_auth_refusals_total{code="invalid_api_key"}"#),
        "{}",
        r.body
    );
    assert!(r
        .body
        .contains(r#"baton_http_auth_refusals_total{code="insufficient_permissions"}"#));

    // Open to anyone: /health (load balancers) and the status page's HTML, whatever key.
    for key in [None, Some("sk-wrong"), Some(USER_A)] {
        assert_eq!(call(&c, "GET", "/health", None, key).await.status, 200);
        let r = call(&c, "GET", "/", None, key).await;
        assert_eq!(r.status, 200);
        assert!(r.body.contains("<html"));
    }
}

#[actix_web::test]
async fn a_stream_is_read_again_only_with_the_key_that_opened_it() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (c, _worker) = cluster(&nats, "owners", keys).await;
    let streamed = chat("hi", json!({"max_tokens": 3, "stream": true}));
    let r = call(
        &c,
        "POST",
        "/v1/chat/completions",
        Some(&streamed),
        Some(USER_A),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let id = stream_id(&r);
    let path = format!("/v1/streams/{id}");

    // Ended (read back from the store): its key and admin keys only.
    let r = call(&c, "GET", &path, None, Some(USER_A)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(sse_events(&r.body).last().expect("done").2, "[DONE]");
    assert_eq!(call(&c, "GET", &path, None, Some(ADMIN)).await.status, 200);
    let foreign = call(&c, "GET", &path, None, Some(USER_B)).await;
    assert_eq!(refusal(&foreign), (404, "stream_not_found".into()));
    // Exactly what a stream that never existed gets.
    let other = baton_common::ids::StreamId::random().to_string();
    let unknown = call(
        &c,
        "GET",
        &format!("/v1/streams/{other}"),
        None,
        Some(USER_B),
    )
    .await;
    assert_eq!(
        foreign.json()["error"]["message"]
            .as_str()
            .map(|m| m.replace(&id, &other)),
        unknown.json()["error"]["message"]
            .as_str()
            .map(String::from)
    );
    let auth_b = format!("Bearer {USER_B}");
    let last = format!("{id}:0");
    let headers = [("Authorization", auth_b.as_str()), ("Last-Event-ID", &last)];
    let r = request_with(
        c.addr,
        "POST",
        "/v1/chat/completions",
        Some(&streamed.to_string()),
        &headers,
    )
    .await;
    assert_eq!(refusal(&r), (404, "stream_not_found".into()));

    // Running (in memory): the same.
    let slow = chat("SLOW", json!({"stream": true})).to_string();
    let auth_a = format!("Bearer {USER_A}");
    let (live, seen) = open_stream_with(
        c.addr,
        "POST",
        "/v1/chat/completions",
        &slow,
        &[("Authorization", &auth_a)],
        "data: ",
    )
    .await;
    let id = seen
        .lines()
        .find_map(|l| l.strip_prefix("id: "))
        .and_then(|l| l.split(':').next())
        .expect("a stream id")
        .to_string();
    let path = format!("/v1/streams/{id}");
    let r = call(&c, "GET", &path, None, Some(USER_B)).await;
    assert_eq!(refusal(&r), (404, "stream_not_found".into()));
    let (again, _) = open_stream_with(
        c.addr,
        "GET",
        &path,
        "",
        &[
            ("Authorization", &auth_a),
            ("Last-Event-ID", &format!("{id}:0")),
        ],
        "data: ",
    )
    .await;
    drop((live, again));
}

#[actix_web::test]
async fn a_key_over_max_streams_per_key_gets_429_until_one_of_its_streams_ends() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (c, worker) = cluster(&nats, "perkey", |c| {
        keys(c);
        c.coordinator.max_streams_per_key = 2;
    })
    .await;
    let slow = chat("SLOW", json!({"stream": true})).to_string();
    let auth_a = format!("Bearer {USER_A}");
    let open = |auth: String| {
        let slow = slow.clone();
        let addr = c.addr;
        async move {
            open_stream_with(
                addr,
                "POST",
                "/v1/chat/completions",
                &slow,
                &[("Authorization", &auth)],
                "data: ",
            )
            .await
        }
    };
    let first = open(auth_a.clone()).await;
    let _second = open(auth_a.clone()).await;
    let quick = chat("hi", json!({"max_tokens": 1}));
    let r = call(
        &c,
        "POST",
        "/v1/chat/completions",
        Some(&quick),
        Some(USER_A),
    )
    .await;
    assert_eq!(refusal(&r), (429, "rate_limit_exceeded".into()));
    assert_eq!(r.header("retry-after"), Some("1"));
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        message.contains("max_streams_per_key") && message.contains('2'),
        "{message}"
    );
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    // A reattach takes a slot too, even to one of the key's own streams.
    let id = first
        .1
        .lines()
        .find_map(|l| l.strip_prefix("id: "))
        .and_then(|l| l.split(':').next())
        .expect("a stream id")
        .to_string();
    let r = call(&c, "GET", &format!("/v1/streams/{id}"), None, Some(USER_A)).await;
    assert_eq!(refusal(&r), (429, "rate_limit_exceeded".into()));
    // Other keys have their own slots.
    let r = call(
        &c,
        "POST",
        "/v1/chat/completions",
        Some(&quick),
        Some(USER_B),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);

    // The client of one stream leaves: the stream stops and its slot is free again.
    drop(first);
    let mut freed = false;
    for _ in 0..250 {
        let r = call(
            &c,
            "POST",
            "/v1/chat/completions",
            Some(&quick),
            Some(USER_A),
        )
        .await;
        if r.status == 200 {
            freed = true;
            break;
        }
        assert_eq!(refusal(&r), (429, "rate_limit_exceeded".into()));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        freed,
        "the slot of the stream whose client left was not freed"
    );
    assert!(
        !worker.log.cancelled.lock().expect("lock").is_empty(),
        "the abandoned stream was stopped on its worker"
    );
}

#[actix_web::test]
async fn request_limits_have_their_openai_errors() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    // The fake worker counts text prompts as 3 tokens: over the limit of 2.
    let (c, _worker) = cluster(&nats, "limits", |c| {
        keys(c);
        c.coordinator.max_prompt_tokens = 2;
        c.coordinator.max_tokens_limit = 50;
    })
    .await;
    let key = Some(USER_A);
    let completions = "/v1/completions";

    // Text: counted by the worker, which refuses before running anything.
    let r = call(
        &c,
        "POST",
        "/v1/chat/completions",
        Some(&chat("hi", json!({}))),
        key,
    )
    .await;
    assert_eq!(refusal(&r), (400, "context_length_exceeded".into()));
    // Token ids: counted here.
    let ids = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1});
    let r = call(&c, "POST", completions, Some(&ids), key).await;
    assert_eq!(refusal(&r), (400, "context_length_exceeded".into()));
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("max_prompt_tokens")));

    // max_tokens over max_tokens_limit.
    let big = json!({"model": MODEL, "prompt": [1], "max_tokens": 51});
    let r = call(&c, "POST", completions, Some(&big), key).await;
    assert_eq!(refusal(&r), (400, "invalid_value".into()));
    assert_eq!(r.json()["error"]["param"], "max_tokens");
    let r = call(
        &c,
        "POST",
        completions,
        Some(&json!({"model": MODEL, "prompt": [1], "max_tokens": 50})),
        key,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);

    // A body over max_body_bytes: 413 with a key, 401 without one (the key comes first).
    let huge = json!({"model": MODEL, "prompt": "x".repeat(MAX_BODY)});
    let r = call(&c, "POST", completions, Some(&huge), key).await;
    assert_eq!(refusal(&r), (413, "request_too_large".into()));
    let r = call(&c, "POST", completions, Some(&huge), None).await;
    assert_eq!(refusal(&r), (401, "invalid_api_key".into()));
}

#[actix_web::test]
async fn without_keys_the_api_is_open_and_no_per_key_limit_applies() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    let (c, _worker) = cluster(&nats, "open", |c| c.coordinator.max_streams_per_key = 1).await;
    let slow = chat("SLOW", json!({"stream": true})).to_string();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            open_stream_with(c.addr, "POST", "/v1/chat/completions", &slow, &[], "data: ").await,
        );
    }
    let id = held[0]
        .1
        .lines()
        .find_map(|l| l.strip_prefix("id: "))
        .and_then(|l| l.split(':').next())
        .expect("a stream id")
        .to_string();
    // Anyone may reattach, and any Authorization header is ignored.
    let (again, _) = open_stream_with(
        c.addr,
        "GET",
        &format!("/v1/streams/{id}"),
        "",
        &[("Authorization", "Bearer whatever")],
        "data: ",
    )
    .await;
    for path in ["/metrics", "/v1/status"] {
        assert_eq!(
            call(&c, "GET", path, None, None).await.status,
            200,
            "{path}"
        );
    }
    drop((held, again));
}

/// With origins configured, a browser's preflight is answered without a key (browsers
/// send none), for those origins only; the answer to the request itself names the
/// origin and exposes the request id. Without origins there is no CORS: the preflight
/// meets the key check. Every answer, refusals included, carries `X-Request-Id`.
#[actix_web::test]
async fn browsers_preflight_without_a_key_and_every_answer_has_a_request_id() {
    let Some(nats) = NatsServer::start() else {
        return;
    };
    const ORIGIN: &str = "https://app.example.com";
    let (c, _worker) = cluster(&nats, "cors", |c| {
        keys(c);
        c.coordinator.cors_origins = vec![ORIGIN.into()];
    })
    .await;
    let addr = c.addr;
    let preflight = |origin: &'static str| async move {
        request_with(
            addr,
            "OPTIONS",
            "/v1/chat/completions",
            None,
            &[
                ("Origin", origin),
                ("Access-Control-Request-Method", "POST"),
                (
                    "Access-Control-Request-Headers",
                    "authorization, content-type, x-stainless-os",
                ),
            ],
        )
        .await
    };
    let r = preflight(ORIGIN).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("access-control-allow-origin"), Some(ORIGIN));
    let allowed = r
        .header("access-control-allow-headers")
        .unwrap_or_default()
        .to_ascii_lowercase();
    assert!(allowed.contains("authorization"), "{allowed}");
    let r = preflight("https://evil.example.com").await;
    assert_ne!(r.status, 200, "another origin's preflight passed");
    assert_eq!(r.header("access-control-allow-origin"), None);

    // The request itself, with a key.
    let body = chat("hi", json!({"max_tokens": 2})).to_string();
    let auth = format!("Bearer {USER_A}");
    let r = request_with(
        c.addr,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        &[
            ("Origin", ORIGIN),
            ("Authorization", &auth),
            ("X-Request-Id", "req-7"),
        ],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("access-control-allow-origin"), Some(ORIGIN));
    assert_eq!(r.header("x-request-id"), Some("req-7"));
    assert!(r
        .header("access-control-expose-headers")
        .is_some_and(|h| h.to_ascii_lowercase().contains("x-request-id")));
    // A refusal by the key check carries the id too.
    let r = request_with(
        c.addr,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        &[("X-Request-Id", "req-8")],
    )
    .await;
    assert_eq!(refusal(&r), (401, "invalid_api_key".into()));
    assert_eq!(r.header("x-request-id"), Some("req-8"));

    // No origins configured: no CORS, and the preflight needs a key like anything else.
    let (plain, _w) = cluster(&nats, "nocors", keys).await;
    let r = request_with(
        plain.addr,
        "OPTIONS",
        "/v1/chat/completions",
        None,
        &[
            ("Origin", ORIGIN),
            ("Access-Control-Request-Method", "POST"),
        ],
    )
    .await;
    assert_eq!(r.status, 401);
    assert_eq!(r.header("access-control-allow-origin"), None);
    assert!(r.header("x-request-id").is_some_and(|id| !id.is_empty()));
}
