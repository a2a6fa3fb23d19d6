//! Bad requests get a clear 4xx (or 503) in OpenAI's error shape:
//! `{"error": {"message", "type", "param", "code"}}`.

use baton_integration_tests::{assert_error, Cluster, ClusterOptions, Reply};
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// A cluster with one simulated worker.
fn cluster() -> Option<Cluster> {
    Cluster::start(ClusterOptions::simulated(1))
}

fn chat(cluster: &Cluster, extra: Value) -> Reply {
    let mut body = json!({
        "model": cluster.model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    });
    merge(&mut body, extra);
    cluster.api.post_json(CHAT, &body).expect("POST")
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
}

#[test]
fn a_good_request_is_answered() {
    let Some(cluster) = cluster() else { return };
    let reply = chat(&cluster, json!({}));
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.body["usage"]["completion_tokens"], 4);
}

#[test]
fn malformed_json_is_400() {
    let Some(cluster) = cluster() else { return };
    let reply = cluster
        .api
        .post_raw(CHAT, "{\"model\": \"x\", \"messages\": [")
        .expect("POST");
    assert_error(&reply, 400);
}

#[test]
fn missing_messages_is_400() {
    let Some(cluster) = cluster() else { return };
    let body = json!({"model": cluster.model, "max_tokens": 4});
    assert_error(&cluster.api.post_json(CHAT, &body).expect("POST"), 400);
}

#[test]
fn missing_prompt_is_400() {
    let Some(cluster) = cluster() else { return };
    let body = json!({"model": cluster.model, "max_tokens": 4});
    assert_error(
        &cluster.api.post_json(COMPLETIONS, &body).expect("POST"),
        400,
    );
}

#[test]
fn missing_model_is_400() {
    let Some(cluster) = cluster() else { return };
    let body = json!({"prompt": "hello", "max_tokens": 4});
    assert_error(
        &cluster.api.post_json(COMPLETIONS, &body).expect("POST"),
        400,
    );
}

#[test]
fn unknown_model_is_404() {
    let Some(cluster) = cluster() else { return };
    let error = assert_error(&chat(&cluster, json!({"model": "no-such-model"})), 404);
    assert_eq!(error["code"], "model_not_found", "{error}");
}

#[test]
fn max_tokens_of_zero_or_less_is_400() {
    let Some(cluster) = cluster() else { return };
    for n in [0, -1] {
        assert_error(&chat(&cluster, json!({ "max_tokens": n })), 400);
    }
}

#[test]
fn max_tokens_over_the_limit_is_400() {
    let Some(cluster) = cluster() else { return };
    // cluster.toml's coordinator.max_tokens_limit defaults to 4096.
    assert_error(&chat(&cluster, json!({"max_tokens": 4097})), 400);
}

#[test]
fn negative_temperature_is_400() {
    let Some(cluster) = cluster() else { return };
    assert_error(&chat(&cluster, json!({"temperature": -0.5})), 400);
}

#[test]
fn prompt_over_the_context_is_400() {
    let Some(cluster) = cluster() else { return };
    // The simulated engine counts a word as a token and holds 8192.
    let prompt = "word ".repeat(9000);
    let body = json!({"model": cluster.model, "prompt": prompt, "max_tokens": 4});
    let reply = cluster.api.post_json(COMPLETIONS, &body).expect("POST");
    let error = assert_error(&reply, 400);
    assert_eq!(error["code"], "context_length_exceeded", "{error}");
}

#[test]
fn a_body_over_the_limit_is_413() {
    let mut options = ClusterOptions::simulated(1);
    options
        .extra
        .push(("coordinator", "max_body_bytes = 4096".to_string()));
    let Some(cluster) = Cluster::start(options) else {
        return;
    };
    let body = json!({"model": cluster.model, "prompt": "x".repeat(8192), "max_tokens": 4});
    assert_error(
        &cluster.api.post_json(COMPLETIONS, &body).expect("POST"),
        413,
    );
}

#[test]
fn no_live_worker_is_503() {
    let Some(cluster) = Cluster::start(ClusterOptions::simulated(0)) else {
        return;
    };
    assert_eq!(cluster.api.get("/health").expect("GET").status, 503);
    assert_error(&chat(&cluster, json!({})), 503);
    let body = json!({"model": cluster.model, "prompt": "hi", "max_tokens": 4, "stream": true});
    assert_error(
        &cluster.api.post_json(COMPLETIONS, &body).expect("POST"),
        503,
    );
}

#[test]
fn a_dead_worker_leaves_503() {
    let mut options = ClusterOptions::simulated(1);
    options
        .extra
        .push(("coordinator", "worker_timeout_ms = 600".to_string()));
    let Some(mut cluster) = Cluster::start(options) else {
        return;
    };
    cluster.workers[0].kill();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while cluster.api.get("/health").expect("GET").status != 503 {
        assert!(
            std::time::Instant::now() < deadline,
            "/health still 200 after the only worker was killed\n{}",
            cluster.logs()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_error(&chat(&cluster, json!({})), 503);
}

/// Structured output that cannot be used — a schema llguidance cannot compile, a schema
/// that is not JSON, a bad regex or grammar, an unknown `response_format` type, two
/// asks at once — and sampling fields out of range (penalties, `min_p`, `logit_bias`,
/// `min_tokens`, `stop_token_ids`, `top_logprobs`), and tools with malformed
/// `parameters`, are each a 400 naming the field, on
/// both endpoints; none reaches a worker (its count of submitted sequences holds only
/// the good request sent after them).
#[test]
fn structured_output_that_cannot_be_used_is_400_and_never_dispatched() {
    let Some(mut cluster) = cluster() else { return };
    let schema = |s: Value| {
        json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "x", "schema": s}}})
    };
    let cases = [
        (
            schema(json!({"type": "objekt"})),
            "response_format.json_schema.schema",
            "objekt",
        ),
        (
            schema(json!({"type": "string", "pattern": "(("})),
            "response_format.json_schema.schema",
            "unclosed",
        ),
        (
            schema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
            "response_format.json_schema.schema",
            "",
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format",
            "json_schema",
        ),
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format",
            "xml",
        ),
        (json!({"guided_json": "{not json"}), "guided_json", "JSON"),
        (json!({"guided_regex": "[a-"}), "guided_regex", ""),
        (json!({"guided_choice": []}), "guided_choice", "non-empty"),
        (
            json!({"guided_grammar": "start: missing_rule"}),
            "guided_grammar",
            "missing_rule",
        ),
        (
            json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
            "structured_outputs.choice",
            "both",
        ),
        // Sampling fields out of their ranges.
        (
            json!({"presence_penalty": 3}),
            "presence_penalty",
            "[-2, 2]",
        ),
        (
            json!({"frequency_penalty": -2.5}),
            "frequency_penalty",
            "[-2, 2]",
        ),
        (json!({"min_p": 2}), "min_p", "[0, 1]"),
        (json!({"n": 17}), "n", "1..=16"),
        (json!({"logit_bias": {"x": 1}}), "logit_bias", "token id"),
        (
            json!({"logit_bias": {"5": 500}}),
            "logit_bias",
            "[-100, 100]",
        ),
        (json!({"min_tokens": 100_000}), "min_tokens", "max_tokens"),
        (json!({"stop_token_ids": "7"}), "stop_token_ids", "array"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
            "",
        ),
        // Tools whose parameters are no usable schema (completions take no tools at all).
        (
            json!({"tools": [{"type": "function", "function": {"name": "f",
                    "parameters": {"type": "objekt"}}}]}),
            "tools",
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f",
                    "parameters": "none"}}]}),
            "tools",
            "tools",
        ),
    ];
    for (extra, param, needle) in &cases {
        let mut completion = json!({"model": cluster.model, "prompt": "x", "max_tokens": 4});
        merge(&mut completion, extra.clone());
        for reply in [
            chat(&cluster, extra.clone()),
            cluster
                .api
                .post_json(COMPLETIONS, &completion)
                .expect("POST"),
        ] {
            let error = assert_error(&reply, 400);
            assert_eq!(error["param"], *param, "{extra}: {error}");
            assert_eq!(error["code"], "invalid_value", "{extra}: {error}");
            let message = error["message"].as_str().unwrap_or_default();
            assert!(message.contains(needle), "{extra}: {message}");
        }
    }
    let reply = chat(&cluster, json!({}));
    assert_eq!(reply.status, 200, "{}", reply.body);
    let text = cluster.worker_metrics(0);
    let accepted = r#"baton_worker_sequences_submitted_total{outcome="accepted"} 1"#;
    assert!(text.lines().any(|l| l == accepted), "{text}");
    cluster.assert_alive();
}
