//! `n` choices through the official `openai` Python client against a cluster running the
//! real model: a seeded request gives the same choices every time, streamed or whole;
//! its choices differ from each other (each draws from its own seed), and the first is
//! the answer `n: 1` gives with that seed; greedy choices are all the engine's greedy
//! answer; text completions take `n` too; usage counts the prompt once and every
//! choice's tokens.

use baton_integration_tests::{generate, python_has, python_json, Cluster, ClusterOptions};
use serde_json::{json, Value};

const PROMPT: &str = "Write one sentence about the sea.";
const MAX_TOKENS: u32 = 16;
const N: usize = 3;

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("{v} is not a list"))
        .iter()
        .map(|t| {
            t.as_str()
                .unwrap_or_else(|| panic!("{t} is not text"))
                .to_string()
        })
        .collect()
}

#[test]
fn n_choices_are_reproducible_and_each_its_own() {
    if !python_has("openai", "openai") {
        return;
    }
    let Some(cluster) = Cluster::start(ClusterOptions::real(2)) else {
        return;
    };
    let cases = json!({"prompt": PROMPT, "completion_prompt": "The sea is",
                       "max_tokens": MAX_TOKENS, "n": N, "seed": 7});
    let r = python_json(
        "choices.py",
        &[&cluster.api.base, &cluster.model, &cases.to_string()],
        &cluster,
    );
    let first = strings(&r["seeded"][0]);
    assert_eq!(first.len(), N, "{r}");
    assert_eq!(
        first,
        strings(&r["seeded"][1]),
        "a seed gives the same choices"
    );
    assert_eq!(first, strings(&r["streamed"]["texts"]), "streamed as whole");
    let distinct: std::collections::HashSet<&String> = first.iter().collect();
    assert!(
        distinct.len() > 1,
        "each choice draws from its own seed: {first:?}"
    );
    assert_eq!(
        strings(&r["one"]),
        vec![first[0].clone()],
        "choice 0 is n = 1's answer"
    );
    let greedy = generate(PROMPT, true, MAX_TOKENS);
    assert_eq!(strings(&r["greedy"]), vec![greedy; N]);
    assert_eq!(strings(&r["completion"]).len(), 2, "{r}");
    let usage = &r["usage"];
    assert!(usage["prompt"].as_u64() > Some(0), "{usage}");
    assert!(
        usage["completion"].as_u64() > Some(MAX_TOKENS as u64),
        "every choice's tokens: {usage}"
    );
}
