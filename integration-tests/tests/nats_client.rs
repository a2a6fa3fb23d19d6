//! A Python client of the public NATS API (`nats-py`, written from `docs/protocol.md`)
//! against a cluster running the real model: its streamed greedy text must equal the
//! HTTP API's answer to the same request, a replay must give the rest of a stream, `n: 2`
//! gives two such answers (each message naming its choice and the choice's stream), and
//! `tokenize`/`detokenize` answer as `/tokenize` and `/detokenize` do.

use baton_integration_tests::{python_has, python_json, Cluster, ClusterOptions};
use serde_json::{json, Value};

const CHAT_PROMPT: &str = "Tell me a short story about a robot.";
const TEXT_PROMPT: &str = "Once upon a time, there was a little robot who";
const MAX_TOKENS: u32 = 24;

/// The text of the HTTP API's whole answer to a greedy request.
fn http_text(cluster: &Cluster, path: &str, body: Value) -> String {
    let reply = cluster.api.post_json(path, &body).expect("HTTP request");
    assert_eq!(reply.status, 200, "{}", reply.body);
    let choice = &reply.body["choices"][0];
    choice["text"]
        .as_str()
        .or_else(|| choice["message"]["content"].as_str())
        .expect("a text")
        .to_string()
}

#[test]
fn python_nats_client_gets_the_http_greedy_text() {
    if !python_has("nats", "nats-py") {
        return;
    }
    let Some(cluster) = Cluster::start(ClusterOptions::real(1)) else {
        return;
    };
    let max_tokens = MAX_TOKENS.to_string();
    let r = python_json(
        "nats_client.py",
        &[
            &cluster.nats.url,
            &cluster.model,
            CHAT_PROMPT,
            TEXT_PROMPT,
            &max_tokens,
        ],
        &cluster,
    );

    let greedy = json!({"model": cluster.model, "max_tokens": MAX_TOKENS, "temperature": 0});
    let mut text_body = greedy.clone();
    text_body["prompt"] = json!(TEXT_PROMPT);
    let mut chat_body = greedy;
    chat_body["messages"] = json!([{"role": "user", "content": CHAT_PROMPT}]);
    let http_completion = http_text(&cluster, "/v1/completions", text_body);
    let http_chat = http_text(&cluster, "/v1/chat/completions", chat_body);
    assert!(!http_completion.is_empty() && !http_chat.is_empty());

    let streamed = &r["completion_stream"];
    assert_eq!(streamed["text"].as_str(), Some(http_completion.as_str()));
    assert_eq!(
        r["completion"]["text"].as_str(),
        Some(http_completion.as_str())
    );
    assert_eq!(r["chat_stream"]["text"].as_str(), Some(http_chat.as_str()));
    assert_eq!(r["completion"]["object"], "text_completion");
    assert_eq!(r["completion"]["final"], "true");
    for key in ["completion_stream", "chat_stream"] {
        let usage = &r[key]["usage"];
        let completion = usage["completion_tokens"].as_u64().unwrap_or(0);
        assert!(
            usage["prompt_tokens"].as_u64().unwrap_or(0) > 0,
            "{key}: {usage}"
        );
        assert!(
            (1..=u64::from(MAX_TOKENS)).contains(&completion),
            "{key}: {usage}"
        );
        let reason = r[key]["finish_reason"].as_str().unwrap_or_default();
        assert!(["length", "stop"].contains(&reason), "{key}: {reason:?}");
    }

    // The replay after the third chunk is the rest of the text, nothing repeated.
    let texts: Vec<&str> = streamed["texts"]
        .as_array()
        .expect("texts")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let prefix: String = texts[..3].concat();
    let replayed = r["replay"]["text"].as_str().expect("replay text");
    assert_eq!(format!("{prefix}{replayed}"), http_completion);
    let after = r["replay"]["after"].as_u64().expect("after");
    assert!(
        r["replay"]["positions"]
            .as_array()
            .expect("positions")
            .iter()
            .all(|p| p.as_u64().is_some_and(|p| p > after)),
        "{}",
        r["replay"]
    );

    // Two greedy choices: each the HTTP text, streamed (each on its own stream) and whole.
    let both = &r["choices_stream"];
    assert_eq!(
        both["texts"],
        json!([http_completion, http_completion]),
        "{both}"
    );
    let streams = both["streams"].as_array().expect("streams");
    assert_eq!(streams.len(), 2);
    assert!(
        streams
            .iter()
            .all(|s| s.as_array().map(Vec::len) == Some(1)),
        "{both}"
    );
    assert_ne!(streams[0], streams[1], "each choice is a stream of its own");
    assert_eq!(
        both["usage"]["completion_tokens"].as_u64(),
        r["completion"]["usage"]["completion_tokens"]
            .as_u64()
            .map(|n| 2 * n),
        "{both}"
    );
    assert_eq!(r["choices"], json!([http_completion, http_completion]));

    let tokenized = cluster
        .api
        .post_json(
            "/tokenize",
            &json!({"model": cluster.model, "prompt": TEXT_PROMPT}),
        )
        .expect("POST /tokenize");
    assert_eq!(tokenized.status, 200, "{}", tokenized.body);
    assert_eq!(r["tokenize"], tokenized.body);
    assert_eq!(r["detokenize"]["prompt"], TEXT_PROMPT);

    assert_eq!(r["status"]["health"], "ok");
    assert_eq!(r["status"]["workers"].as_array().map(Vec::len), Some(1));
    assert_eq!(r["status"]["models"][0]["name"], cluster.model.as_str());
    assert_eq!(
        r["unknown_model"],
        json!({"header": "model_not_found", "code": "model_not_found"})
    );
}
