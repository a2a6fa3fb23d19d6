//! Structured output through the official `openai` Python client against a cluster
//! running the real model: every answer held to a JSON schema parses and validates
//! (twelve prompts, greedy and sampled, whole and streamed, chat and text completions),
//! greedy answers equal `baton-worker generate --json-schema`, a seed reproduces its
//! answer, `guided_choice` answers one of its choices, and a schema that cannot be used
//! is a 400 naming the field.

use baton_integration_tests::{generate_with, python_has, python_json, Cluster, ClusterOptions};
use serde_json::{json, Value};

const MAX_TOKENS: u32 = 120;

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "job": {"type": "string", "maxLength": 24},
            "city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo"]},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}
        },
        "required": ["name", "age", "job", "city", "hobbies"],
        "additionalProperties": false
    })
}

#[test]
fn answers_held_to_a_schema_validate_through_the_openai_client() {
    if !python_has("openai", "openai") {
        return;
    }
    let Some(mut cluster) = Cluster::start(ClusterOptions::real(1)) else {
        return;
    };
    let schema = person_schema();
    let schema_text = schema.to_string();
    let max_tokens = MAX_TOKENS.to_string();
    let results = python_json(
        "structured_output.py",
        &[&cluster.api.base, &cluster.model, &schema_text, &max_tokens],
        &cluster,
    );
    let validator = jsonschema::validator_for(&schema).expect("a valid schema");
    let check = |label: &str, r: &Value| {
        let text = r["text"].as_str().unwrap_or_default();
        assert_eq!(r["finish_reason"], "stop", "{label}: {text:?}");
        let value: Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("{label}: {text:?} is not JSON: {e}"));
        let errors: Vec<String> = validator
            .iter_errors(&value)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{label}: {text}: {errors:?}");
    };
    let mut checked = 0;
    for kind in ["greedy", "sampled"] {
        let answers = results[kind].as_array().expect("answers");
        assert_eq!(answers.len(), 12, "{kind}");
        for (i, r) in answers.iter().enumerate() {
            check(&format!("{kind} {i}"), r);
            checked += 1;
        }
    }
    for key in ["sampled_again", "completion", "completion_stream"] {
        check(key, &results[key]);
        checked += 1;
    }
    assert_eq!(checked, 27);
    // A seed gives its answer again; greedy answers are the engine's own.
    assert_eq!(
        results["sampled_again"]["text"],
        results["sampled"][0]["text"]
    );
    assert_eq!(
        results["completion"]["text"],
        results["completion_stream"]["text"]
    );
    let reference = generate_with(
        "Describe a sailor as JSON.",
        true,
        MAX_TOKENS,
        &["--json-schema", &schema.to_string()],
    );
    assert_eq!(
        results["greedy"][0]["text"].as_str(),
        Some(reference.as_str())
    );

    let choice = results["choice"]["text"].as_str().unwrap_or_default();
    assert!(["yes", "no", "maybe"].contains(&choice), "{choice:?}");
    assert_eq!(results["choice"]["finish_reason"], "stop");

    let bad = &results["bad_schema"];
    assert_eq!(bad["status"], 400, "{bad}");
    assert_eq!(bad["code"], "invalid_value", "{bad}");
    assert_eq!(bad["param"], "response_format.json_schema.schema", "{bad}");
    assert!(
        bad["message"]
            .as_str()
            .is_some_and(|m| m.contains("objekt")),
        "{bad}"
    );
    cluster.assert_alive();
}
