//! Tool calling through the official `openai` Python client against a cluster running a
//! real model: `tool_choice: "required"` and a named function give one valid call, whole
//! and streamed alike, equal to the engine's own answer (`baton-worker generate --tools
//! … --json`), with `finish_reason: "tool_calls"` and a `call_…` id; a seeded sampled
//! call is reproducible and valid; a second turn that carries the call and the tool's
//! result (`role: "tool"`) is answered; `/tokenize` with `tools` gives the prompt the
//! engine renders with them. On the default model (SmolLM2, whose template
//! takes no tools: Baton's generic tool prompt) and on Qwen2.5-Coder (its own template's
//! Hermes format) when its file is there.

use std::path::{Path, PathBuf};

use baton_integration_tests::{generate_on, python_has, python_json, Cluster, ClusterOptions};
use serde_json::{json, Value};

const PROMPT: &str = "What is the weather in Oslo right now?";
const MAX_TOKENS: u32 = 80;

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40},
                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "get_time",
            "description": "The local time in a city.",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40}},
                "required": ["city"], "additionalProperties": false}}}
    ])
}

/// Why `call` is not a valid call of one of [`tools`], if it is not.
fn fault(call: &Value) -> Option<String> {
    let args: Value = match serde_json::from_str(call["arguments"].as_str().unwrap_or("")) {
        Ok(v) => v,
        Err(e) => return Some(format!("arguments are not JSON ({e}): {call}")),
    };
    let city_ok = args["city"]
        .as_str()
        .is_some_and(|c| c.chars().count() <= 40);
    let ok = match call["name"].as_str() {
        Some("get_weather") => {
            city_ok
                && args.as_object().is_some_and(|o| {
                    o.keys().all(|k| k == "city" || k == "unit")
                        && o.get("unit")
                            .is_none_or(|u| u == "celsius" || u == "fahrenheit")
                })
        }
        Some("get_time") => city_ok && args.as_object().is_some_and(|o| o.len() == 1),
        _ => false,
    };
    (!ok).then(|| format!("not a valid call: {call}"))
}

/// The engine's own answer for `choice`: its one call, and its prompt's ids.
fn engine_call(model: &Path, choice: &str) -> (Value, Value) {
    let tools = tools().to_string();
    let out = generate_on(
        model,
        PROMPT,
        true,
        MAX_TOKENS,
        &[
            "--json",
            "--tools",
            &tools,
            "--tool-choice",
            choice,
            "--no-parallel-tool-calls",
        ],
    );
    let v: Value = serde_json::from_str(&out).expect("generate --json");
    assert_eq!(v["finish"], "stop", "{v}");
    let calls = v["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{v}");
    (calls[0].clone(), v["prompt_ids"].clone())
}

fn check_model(model_path: PathBuf) {
    let Some(cluster) = Cluster::start(ClusterOptions::real(1).models(vec![model_path.clone()]))
    else {
        return;
    };
    let cases = json!({"prompt": PROMPT, "tools": tools(), "max_tokens": MAX_TOKENS,
                       "named": "get_time", "result": "12 degrees and sunny"});
    let r = python_json(
        "tools.py",
        &[&cluster.api.base, &cluster.model, &cases.to_string()],
        &cluster,
    );
    for (case, choice) in [("required", "required"), ("named", "get_time")] {
        let (engine, prompt_ids) = engine_call(&model_path, choice);
        // `/tokenize` renders the tools as a chat request offering them does.
        let tokenized = cluster
            .api
            .post_json(
                "/tokenize",
                &json!({"model": cluster.model, "tools": tools(),
                        "messages": [{"role": "user", "content": PROMPT}]}),
            )
            .expect("POST /tokenize");
        assert_eq!(tokenized.status, 200, "{}", tokenized.body);
        assert_eq!(tokenized.body["tokens"], prompt_ids);
        assert!(fault(&engine).is_none(), "{:?}", fault(&engine));
        for shape in ["whole", "stream"] {
            let got = &r[format!("{case}_{shape}")];
            assert_eq!(got["finish_reason"], "tool_calls", "{case} {shape}: {got}");
            assert_eq!(got["content"], Value::Null, "{case} {shape}: {got}");
            let calls = got["tool_calls"].as_array().expect("calls");
            assert_eq!(calls.len(), 1, "{case} {shape}: {got}");
            let call = &calls[0];
            assert!(
                call["id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with("call_")),
                "{call}"
            );
            assert_eq!(call["type"], "function");
            assert_eq!(call["name"], engine["name"], "{case} {shape}");
            assert_eq!(call["arguments"], engine["arguments"], "{case} {shape}");
            assert!(fault(call).is_none(), "{:?}", fault(call));
        }
        if case == "named" {
            assert_eq!(engine["name"], "get_time");
        }
    }
    let seeded = r["seeded"].as_array().expect("two runs");
    assert_eq!(
        seeded[0]["tool_calls"][0]["arguments"],
        seeded[1]["tool_calls"][0]["arguments"]
    );
    for run in seeded {
        assert_eq!(run["finish_reason"], "tool_calls", "{run}");
        assert!(fault(&run["tool_calls"][0]).is_none(), "{run}");
    }
    // The second turn renders the call and its result, and is answered.
    let answer = &r["answer"];
    let first = &r["required_whole"];
    assert!(
        answer["prompt_tokens"].as_u64() > first["prompt_tokens"].as_u64(),
        "the history's call and result are in the prompt: {answer} after {first}"
    );
    let said = answer["content"]
        .as_str()
        .is_some_and(|c| !c.trim().is_empty());
    let called = answer["tool_calls"]
        .as_array()
        .is_some_and(|c| !c.is_empty());
    assert!(said || called, "{answer}");
    if called {
        assert_eq!(answer["finish_reason"], "tool_calls", "{answer}");
    }
}

#[test]
fn required_and_named_tool_calls_are_valid_and_match_the_engine() {
    if !python_has("openai", "openai") {
        return;
    }
    check_model(baton_integration_tests::cluster::default_model_path());
}

#[test]
fn qwen_calls_tools_in_its_own_format() {
    if !python_has("openai", "openai") {
        return;
    }
    if let Some(path) = baton_integration_tests::qwen_model() {
        check_model(path);
    }
}
