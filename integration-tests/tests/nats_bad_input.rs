//! Malformed requests on the public NATS subjects — random bytes, wrong JSON, bad
//! values, unknown model, stream or worker, no reply inbox — each get an error reply (or
//! nothing, without an inbox), are counted, and crash nothing; unknown fields are
//! ignored as HTTP ignores them.

use std::time::{Duration, Instant};

use async_nats::Client;
use baton_common::public::headers;
use baton_common::subjects::Subjects;
use baton_integration_tests::{summarize, Cluster, ClusterOptions};
use futures::StreamExt;
use serde_json::{json, Value};

/// The coordinator's `max_body_bytes` in this test.
const MAX_BODY: usize = 8192;

/// Sends `body` on `subject`; returns the error code of the (single) reply.
async fn error_code(client: &Client, subject: &str, body: Vec<u8>) -> String {
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        client.request(subject.to_string(), body.into()),
    )
    .await
    .expect("an answer in time")
    .expect("a reply");
    let h = reply.headers.expect("headers");
    let code = h
        .get(headers::ERROR)
        .unwrap_or_else(|| panic!("no Baton-Error on {subject}: {:?}", reply.payload))
        .as_str()
        .to_string();
    assert_eq!(h.get(headers::SEQ).map(|v| v.as_str()), Some("0"));
    let body: Value = serde_json::from_slice(&reply.payload).expect("an OpenAI error body");
    assert_eq!(body["error"]["code"], code.as_str());
    assert!(body["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
    code
}

async fn status(client: &Client) -> Value {
    let reply = client
        .request(Subjects::default().admin_status(), "{}".into())
        .await
        .expect("status");
    serde_json::from_slice(&reply.payload).expect("status JSON")
}

#[test]
fn malformed_public_requests_get_errors_and_are_counted() {
    let mut options = ClusterOptions::simulated(1).step_ms(2);
    options
        .extra
        .push(("coordinator", format!("max_body_bytes = {MAX_BODY}")));
    let Some(mut cluster) = Cluster::start(options) else {
        return;
    };
    let s = Subjects::default();
    let model = cluster.model.clone();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let client = runtime
        .block_on(baton_common::nats::connect(
            &cluster.nats.config(),
            "bad-input-test",
        ))
        .expect("connect");
    let malformed = runtime.block_on(async {
        let mut malformed = 0u64;
        // Without a reply inbox: nothing to answer, but counted.
        for i in 0..20u8 {
            client
                .publish(s.completions(), vec![i; usize::from(i)].into())
                .await
                .expect("publish");
            malformed += 1;
        }
        // Random bytes on every subject that takes a body.
        let subjects = [
            s.completions(),
            s.chat_completions(),
            s.replay(),
            s.admin_drain(),
        ];
        let mut state = 0x2545_f491u32;
        for i in 0..400usize {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let len = (state % 300) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|j| (state.rotate_left(j as u32 % 32) >> 5) as u8)
                .collect();
            let code = error_code(&client, &subjects[i % subjects.len()], bytes).await;
            assert!(
                [
                    "invalid_json",
                    "missing_required_parameter",
                    "invalid_value"
                ]
                .contains(&code.as_str()),
                "{code}"
            );
            malformed += 1;
        }
        // Wrong JSON and bad values, each with the code HTTP gives.
        let unknown = "0123456789abcdef0123456789abcdef";
        let cases: Vec<(String, Value, &str)> = vec![
            (
                s.completions(),
                json!({"model": 1, "prompt": "x"}),
                "invalid_json",
            ),
            (s.completions(), json!([1, 2]), "invalid_json"),
            (
                s.completions(),
                json!({"model": model}),
                "missing_required_parameter",
            ),
            (
                s.completions(),
                json!({"prompt": "x"}),
                "missing_required_parameter",
            ),
            (
                s.completions(),
                json!({"model": model, "prompt": "x", "max_tokens": -1}),
                "invalid_value",
            ),
            (
                s.completions(),
                json!({"model": model, "prompt": "x", "top_p": 7}),
                "invalid_value",
            ),
            (
                s.completions(),
                json!({"model": "no-such-model", "prompt": "x"}),
                "model_not_found",
            ),
            (
                s.chat_completions(),
                json!({"model": model, "messages": "hi"}),
                "invalid_json",
            ),
            (
                s.chat_completions(),
                json!({"model": model, "messages": []}),
                "invalid_value",
            ),
            // Structured output that cannot be used, as over HTTP.
            (
                s.chat_completions(),
                json!({"model": model, "messages": [{"role": "user", "content": "x"}],
                       "response_format": {"type": "json_schema",
                           "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}),
                "invalid_value",
            ),
            (
                s.completions(),
                json!({"model": model, "prompt": "x", "guided_regex": "(("}),
                "invalid_value",
            ),
            (
                s.completions(),
                json!({"model": model, "prompt": "x", "response_format": {"type": "xml"}}),
                "invalid_value",
            ),
            (
                s.tokenize(),
                json!({"prompt": "x"}),
                "missing_required_parameter",
            ),
            (
                s.detokenize(),
                json!({"model": model, "tokens": "x"}),
                "invalid_value",
            ),
            // Sampling fields out of range, as over HTTP.
            (
                s.chat_completions(),
                json!({"model": model, "messages": [{"role": "user", "content": "x"}],
                       "logprobs": true, "top_logprobs": 21}),
                "invalid_value",
            ),
            (
                s.completions(),
                json!({"model": model, "prompt": "x", "logit_bias": {"1": "much"}}),
                "invalid_value",
            ),
            (
                s.completions(),
                json!({"model": model, "prompt": "x", "presence_penalty": 9}),
                "invalid_value",
            ),
            (
                s.completions(),
                json!({"model": model, "prompt": "x", "n": 17}),
                "invalid_value",
            ),
            (
                s.chat_completions(),
                json!({"model": model, "messages": [{"role": "user", "content": "x"}],
                       "tools": [{"type": "function", "function": {"name": "f",
                                  "parameters": {"type": "objekt"}}}]}),
                "invalid_value",
            ),
            (s.replay(), json!({"stream": "not-an-id"}), "invalid_json"),
            (
                s.replay(),
                json!({"stream": unknown, "after": 3}),
                "stream_not_found",
            ),
            // A coordinator that is not running: answered, not left unanswered.
            (
                s.replay(),
                json!({"stream": unknown, "after": 3, "coordinator": unknown}),
                "stream_not_found",
            ),
            (s.admin_drain(), json!({}), "missing_required_parameter"),
            (s.admin_drain(), json!({"worker": "nope"}), "invalid_value"),
            (
                s.admin_drain(),
                json!({"worker": unknown}),
                "worker_not_found",
            ),
        ];
        for (subject, body, expected) in &cases {
            let code = error_code(&client, subject, body.to_string().into_bytes()).await;
            assert_eq!(&code, expected, "{subject} {body}");
            malformed += 1;
        }
        // Too large.
        let big = format!(
            r#"{{"model": "{model}", "prompt": "{}"}}"#,
            "x".repeat(MAX_BODY)
        );
        assert_eq!(
            error_code(&client, &s.completions(), big.into_bytes()).await,
            "request_too_large"
        );
        malformed += 1;

        // Unknown fields are ignored: a stream in full.
        let body = json!({"model": model, "prompt": "hello there", "max_tokens": 5,
                          "stream": true, "frobnicate": {"deep": [1, 2]}, "user": "x"});
        let inbox = client.new_inbox();
        let mut sub = client.subscribe(inbox.clone()).await.expect("subscribe");
        client
            .publish_with_reply(s.completions(), inbox, body.to_string().into())
            .await
            .expect("publish");
        let mut seqs = Vec::new();
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(10), sub.next())
                .await
                .expect("a message in time")
                .expect("a message");
            let h = msg.headers.expect("headers");
            assert!(h.get(headers::ERROR).is_none(), "{:?}", msg.payload);
            seqs.push(
                h.get(headers::SEQ)
                    .expect("seq")
                    .as_str()
                    .parse::<u64>()
                    .expect("n"),
            );
            if h.get(headers::FINAL).is_some() {
                let last: Value = serde_json::from_slice(&msg.payload).expect("JSON");
                assert_eq!(last["usage"]["completion_tokens"], 5);
                break;
            }
        }
        assert_eq!(seqs, (0..6).collect::<Vec<u64>>());

        // Every malformed request was counted (the ones without an inbox may still be
        // on their way).
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let status = status(&client).await;
            let counted = status["coordinator"]["malformed_requests"].as_u64();
            if counted == Some(malformed) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "counted {counted:?}, sent {malformed}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        malformed
    });
    cluster.assert_alive();
    // The same count in Prometheus' metrics.
    let metrics = cluster.api.get("/metrics").expect("GET /metrics");
    let text = metrics.body.as_str().expect("text").to_string();
    assert!(
        text.lines()
            .any(|l| l == format!("baton_public_malformed_requests_total {malformed}")),
        "{text}"
    );
    // HTTP still serves.
    let body = json!({"model": model, "prompt": "still there?", "max_tokens": 4, "stream": true});
    let summary = summarize(&cluster.api.stream("/v1/completions", &body).collect_all());
    assert!(summary.done && summary.errors.is_empty(), "{summary:?}");
}
