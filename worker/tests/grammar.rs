//! Structured output on both engines: a grammar holds a random-weight model (whose
//! free output is noise) to outputs that parse and validate, greedy and sampled; a
//! constrained stream resumed mid-way goes on exactly as the original; a resume whose
//! tokens the grammar does not allow is refused; a grammar that does not compile is
//! refused at start; constrained and free sequences share a batch unchanged.
//!
//! Runs on the host engine (the file's blocks), the device engine on `flex`, and with
//! the `wgpu` feature on a wgpu adapter (CI: llvmpipe).

use std::path::{Path, PathBuf};

use baton_common::protocol::Grammar;
use baton_worker::engine::{
    llama::{
        synthetic::{write_synthetic_llama, SyntheticSpec},
        WeightDtype,
    },
    Engine, EngineError, FinishReason, GenerateParams, Prompt, TokenEvent,
};
use burn_tensor::backend::Backend;
use serde_json::{json, Value};
use tempfile::TempDir;

fn tiny(dir: &TempDir, seed: u64) -> PathBuf {
    let path = dir.path().join("tiny.gguf");
    let mut spec = SyntheticSpec::tiny(seed);
    spec.config.context_length = 512;
    write_synthetic_llama(&path, &spec).expect("write tiny model");
    path
}

fn load<B: Backend>(path: &Path, dtype: WeightDtype) -> Engine<B> {
    Engine::<B>::load(path, dtype, &Default::default()).expect("load")
}

/// A schema whose every valid instance is short: bounded strings, ranges, enums and
/// arrays, no other keys.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": {"enum": ["Paris", "Tokyo", "Lima"]},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
            "level": {"type": "integer", "minimum": -5, "maximum": 5}
        },
        "required": ["name", "age", "city", "tags"],
        "additionalProperties": false
    })
}

fn params(grammar: Grammar, temperature: f32, seed: u64) -> GenerateParams {
    let mut p = GenerateParams {
        max_tokens: 300,
        grammar: Some(grammar),
        ..Default::default()
    };
    p.sampling.temperature = temperature;
    p.sampling.seed = seed;
    p
}

fn events<B: Backend>(engine: &Engine<B>, ids: &[u32], params: &GenerateParams) -> Vec<TokenEvent> {
    let mut out = Vec::new();
    let done = engine
        .generate(ids.to_vec(), params.clone(), &mut |ev| out.push(ev.clone()))
        .expect("generate");
    assert_eq!(
        done.finish,
        FinishReason::Eos,
        "the grammar ends the output: {:?}",
        done.text
    );
    out
}

fn text(events: &[TokenEvent]) -> String {
    events.iter().map(|e| e.text.as_str()).collect()
}

/// Twelve prompts, greedy and at temperature 1 with three seeds: each output parses and
/// validates against the schema; a regex, a choice and a Lark grammar hold too.
fn every_output_follows_its_grammar<B: Backend>(dtype: WeightDtype) {
    let dir = TempDir::new().expect("tempdir");
    let engine = load::<B>(&tiny(&dir, 21), dtype);
    let schema = person_schema();
    let validator = jsonschema::validator_for(&schema).expect("a valid schema");
    let grammar = Grammar::JsonSchema(schema.to_string());
    let mut outputs = Vec::new();
    for i in 0..12u64 {
        let ids = engine
            .encode_prompt(&Prompt::Text(format!("record number {i}: ")))
            .expect("encode");
        for (temperature, seed) in [(0.0, 0), (1.0, i), (1.0, i + 100), (1.0, i + 200)] {
            let out = text(&events(
                &engine,
                &ids,
                &params(grammar.clone(), temperature, seed),
            ));
            let value: Value = serde_json::from_str(&out).unwrap_or_else(|e| {
                panic!("prompt {i}, t={temperature}: {out:?} is not JSON: {e}")
            });
            let errors: Vec<String> = validator
                .iter_errors(&value)
                .map(|e| e.to_string())
                .collect();
            assert!(errors.is_empty(), "{out}: {errors:?}");
            outputs.push(out);
        }
    }
    outputs.sort();
    outputs.dedup();
    assert!(
        outputs.len() > 12,
        "sampling under a grammar still draws: {} distinct outputs",
        outputs.len()
    );

    let ids = engine
        .encode_prompt(&Prompt::Text("code: ".into()))
        .expect("encode");
    for seed in 0..6 {
        let out = text(&events(
            &engine,
            &ids,
            &params(Grammar::Regex(r"[A-Z]{3}-[0-9]{2,4}".into()), 1.0, seed),
        ));
        assert!(is_code(&out), "{out:?} does not match");
    }
    let choice = baton_common::grammar::choice_regex(&["red".into(), "green".into(), "a.b".into()]);
    for seed in 0..6 {
        let out = text(&events(
            &engine,
            &ids,
            &params(Grammar::Regex(choice.clone()), 1.0, seed),
        ));
        assert!(["red", "green", "a.b"].contains(&out.as_str()), "{out:?}");
    }
    let lark = r#"start: "(" num ("+" num)* ")"
num: /[1-9][0-9]?/"#;
    for seed in 0..6 {
        let mut p = params(Grammar::Lark(lark.into()), 1.0, seed);
        p.max_tokens = 400;
        let out = text(&events(&engine, &ids, &p));
        let inner = out
            .strip_prefix('(')
            .and_then(|s| s.strip_suffix(')'))
            .unwrap_or_else(|| panic!("{out:?}"));
        assert!(
            inner
                .split('+')
                .all(|n| (1..100).contains(&n.parse::<u32>().unwrap_or(0))),
            "{out:?}"
        );
    }
}

/// Whether `s` matches `^[A-Z]{3}-[0-9]{2,4}$`.
fn is_code(s: &str) -> bool {
    let (head, tail) = s.split_at(s.find('-').unwrap_or(0));
    head.len() == 3
        && head.chars().all(|c| c.is_ascii_uppercase())
        && (3..=5).contains(&tail.len())
        && tail[1..].chars().all(|c| c.is_ascii_digit())
}

/// A constrained stream resumed after 1, 6 and 15 tokens (the matcher rebuilt by
/// replaying them) goes on to the same tokens, greedy and sampled.
fn a_constrained_resume_goes_on_identically<B: Backend>(dtype: WeightDtype) {
    let dir = TempDir::new().expect("tempdir");
    let engine = load::<B>(&tiny(&dir, 22), dtype);
    let ids = engine
        .encode_prompt(&Prompt::Text("the record: ".into()))
        .expect("encode");
    let grammar = Grammar::JsonSchema(person_schema().to_string());
    for p in [params(grammar.clone(), 0.0, 0), params(grammar, 0.9, 41)] {
        let original = events(&engine, &ids, &p);
        assert!(original.len() > 16, "{}", text(&original));
        for cut in [1, 6, 15] {
            let done: Vec<u32> = original[..cut].iter().map(|e| e.id).collect();
            let mut seq = engine
                .resume(ids.clone(), &done, p.clone())
                .expect("resume");
            let mut rest = Vec::new();
            engine
                .run(&mut seq, &mut |ev| rest.push(ev.clone()))
                .expect("run");
            assert_eq!(rest, original[cut..], "resumed at {cut}");
            assert_eq!(seq.finish_reason(), Some(FinishReason::Eos));
        }
    }
}

/// A resume whose tokens the grammar does not allow is refused, naming the token;
/// constrained and free sequences share a batch, each as it runs alone.
fn off_grammar_resumes_are_refused_and_batches_mix<B: Backend>(dtype: WeightDtype) {
    let dir = TempDir::new().expect("tempdir");
    let engine = load::<B>(&tiny(&dir, 23), dtype);
    let ids = engine
        .encode_prompt(&Prompt::Text("x".into()))
        .expect("encode");
    let grammar = Grammar::JsonSchema(person_schema().to_string());
    let p = params(grammar.clone(), 0.0, 0);
    let not_json = engine
        .encode_prompt(&Prompt::Text("hello".into()))
        .expect("encode");
    match engine.resume(ids.clone(), &not_json, p.clone()) {
        Err(EngineError::ResumeOffGrammar { index: 0, message }) => {
            assert!(!message.is_empty())
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a resume off the grammar was accepted"),
    }

    let free = GenerateParams {
        max_tokens: 40,
        ignore_eos: true,
        ..Default::default()
    };
    let sampled = params(grammar, 1.0, 9);
    let alone: Vec<Vec<TokenEvent>> = [&p, &free, &sampled]
        .iter()
        .map(|q| {
            let mut out = Vec::new();
            engine
                .generate(ids.clone(), (*q).clone(), &mut |ev| out.push(ev.clone()))
                .expect("generate");
            out
        })
        .collect();
    let mut seqs =
        [&p, &free, &sampled].map(|q| engine.start(ids.clone(), q.clone()).expect("start"));
    let mut together: Vec<Vec<TokenEvent>> = vec![Vec::new(); 3];
    while seqs.iter().any(|s| s.finish_reason().is_none()) {
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        for (i, ev) in engine
            .step(&mut refs)
            .expect("step")
            .into_iter()
            .enumerate()
        {
            together[i].extend(ev);
        }
    }
    assert_eq!(together, alone);
}

/// A grammar that does not compile is refused when the sequence starts, naming why.
fn a_grammar_that_does_not_compile_is_refused_at_start<B: Backend>(dtype: WeightDtype) {
    let dir = TempDir::new().expect("tempdir");
    let engine = load::<B>(&tiny(&dir, 24), dtype);
    let ids = engine
        .encode_prompt(&Prompt::Text("x".into()))
        .expect("encode");
    let bad = params(Grammar::Lark("start: undefined_rule".into()), 0.0, 0);
    match engine.start(ids, bad) {
        Err(e @ EngineError::Grammar(_)) => {
            assert!(e.to_string().contains("undefined_rule"), "{e}")
        }
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("a grammar that does not compile was accepted"),
    }
}

/// `min_tokens` bans the end tokens, but where the grammar allows nothing else its end
/// wins: a choice ends after its word, not with a failure.
fn min_tokens_gives_way_to_a_grammars_end<B: Backend>(dtype: WeightDtype) {
    let dir = TempDir::new().expect("tempdir");
    let engine = load::<B>(&tiny(&dir, 25), dtype);
    let ids = engine
        .encode_prompt(&Prompt::Text("answer: ".into()))
        .expect("encode");
    for (temperature, seed) in [(0.0, 0), (1.0, 7)] {
        let mut p = params(Grammar::Regex("(yes|no)".into()), temperature, seed);
        p.min_tokens = 50;
        let out = text(&events(&engine, &ids, &p));
        assert!(out == "yes" || out == "no", "{out:?}");
    }
}

macro_rules! grammar_suite {
    ($name:ident, $backend:ty, $dtype:expr) => {
        mod $name {
            #[test]
            fn every_output_follows_its_grammar() {
                super::every_output_follows_its_grammar::<$backend>($dtype);
            }
            #[test]
            fn a_constrained_resume_goes_on_identically() {
                super::a_constrained_resume_goes_on_identically::<$backend>($dtype);
            }
            #[test]
            fn off_grammar_resumes_are_refused_and_batches_mix() {
                super::off_grammar_resumes_are_refused_and_batches_mix::<$backend>($dtype);
            }
            #[test]
            fn a_grammar_that_does_not_compile_is_refused_at_start() {
                super::a_grammar_that_does_not_compile_is_refused_at_start::<$backend>($dtype);
            }
            #[test]
            fn min_tokens_gives_way_to_a_grammars_end() {
                super::min_tokens_gives_way_to_a_grammars_end::<$backend>($dtype);
            }
        }
    };
}

grammar_suite!(
    host,
    baton_worker::backend::CpuBackend,
    baton_worker::engine::llama::WeightDtype::Native
);
grammar_suite!(
    flex,
    baton_worker::backend::CpuBackend,
    baton_worker::engine::llama::WeightDtype::F32
);
#[cfg(feature = "wgpu")]
grammar_suite!(
    wgpu,
    baton_worker::backend::WgpuBackend,
    baton_worker::engine::llama::WeightDtype::F32
);
