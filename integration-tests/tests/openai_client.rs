//! The official `openai` Python client against a cluster running the real model, with
//! an API key: chat and text completions, streamed and not, must give the same greedy
//! text as `baton-worker generate` for the same request, and another key is refused as
//! OpenAI refuses it.

use baton_integration_tests::{generate, python_has, python_json, Cluster, ClusterOptions};

/// The user message of the chat requests.
const CHAT_PROMPT: &str = "Tell me a short story about a robot.";
/// The prompt of the text completions (one the model continues rather than ends).
const TEXT_PROMPT: &str = "Once upon a time, there was a little robot who";
const MAX_TOKENS: u32 = 24;
/// The coordinator's API key, which the client passes as `api_key`.
const API_KEY: &str = "sk-openai-client-test-4e1d";

#[test]
fn openai_client_gets_the_reference_greedy_text() {
    if !python_has("openai", "openai") {
        return;
    }
    let Some(cluster) = Cluster::start(ClusterOptions::real(1).keys(&[API_KEY], &[])) else {
        return;
    };
    let max_tokens = MAX_TOKENS.to_string();
    let results = python_json(
        "openai_client.py",
        &[
            &cluster.api.base,
            &cluster.model,
            CHAT_PROMPT,
            TEXT_PROMPT,
            &max_tokens,
            API_KEY,
        ],
        &cluster,
    );

    let chat_reference = generate(CHAT_PROMPT, true, MAX_TOKENS);
    let text_reference = generate(TEXT_PROMPT, false, MAX_TOKENS);
    assert!(!chat_reference.is_empty() && !text_reference.is_empty());

    for (key, reference) in [
        ("chat", &chat_reference),
        ("chat_stream", &chat_reference),
        ("completion", &text_reference),
        ("completion_stream", &text_reference),
    ] {
        let r = &results[key];
        assert_eq!(
            r["text"].as_str(),
            Some(reference.as_str()),
            "{key}: the cluster's greedy text differs from baton-worker generate"
        );
        let reason = r["finish_reason"].as_str().unwrap_or_default();
        assert!(
            ["length", "stop"].contains(&reason),
            "{key}: finish_reason {reason:?}"
        );
    }
    assert_eq!(results["chat"]["object"], "chat.completion");
    assert_eq!(results["chat"]["role"], "assistant");
    assert_eq!(results["completion"]["object"], "text_completion");
    for key in ["chat", "completion"] {
        let usage = &results[key]["usage"];
        let prompt = usage["prompt_tokens"].as_u64().unwrap_or(0);
        let completion = usage["completion_tokens"].as_u64().unwrap_or(0);
        assert!(prompt > 0, "{key}: usage {usage}");
        assert!(
            (1..=u64::from(MAX_TOKENS)).contains(&completion),
            "{key}: usage {usage}"
        );
        assert_eq!(usage["total_tokens"].as_u64(), Some(prompt + completion));
    }
    assert!(
        results["models"]
            .as_array()
            .is_some_and(|m| m.iter().any(|id| id == cluster.model.as_str())),
        "models: {}",
        results["models"]
    );
    assert_eq!(
        results["unknown_model"],
        serde_json::json!({"status": 404, "code": "model_not_found"})
    );
    assert_eq!(
        results["wrong_key"],
        serde_json::json!({"status": 401, "code": "invalid_api_key"})
    );
}

/// A stream quieter than `sse_keepalive_ms` between its tokens gets keep-alive
/// comments; the official client must read through them (it keeps the last event id,
/// so a comment closed by a blank line would reach it as an event with no data).
#[test]
fn openai_client_reads_through_keep_alives() {
    if !python_has("openai", "openai") {
        return;
    }
    let mut options = ClusterOptions::simulated(1).step_ms(150);
    options
        .extra
        .push(("coordinator", "sse_keepalive_ms = 40".into()));
    let Some(cluster) = Cluster::start(options) else {
        return;
    };
    let r = python_json(
        "keepalive.py",
        &[&cluster.api.base, &cluster.model, "6"],
        &cluster,
    );
    assert_eq!(r["chunks"], 6, "{r}");
    assert_eq!(r["finish"], "length", "{r}");
    assert!(!r["text"].as_str().unwrap_or_default().is_empty(), "{r}");
}
