//! Real models beyond the default one (fetched by `scripts/models`) against Hugging Face
//! `transformers` running the same GGUF file dequantized to f32
//! (`scripts/real_reference.py` wrote `tests/fixtures/real/<name>.json`): the prompts'
//! ids (raw, and through the chat template), then 32 greedy tokens on 8 prompts.
//!
//! - The burn engine holds the file's values exactly (f32 tensors): its greedy tokens must
//!   be the reference's, decoding from its own choices.
//! - The host engine (the default: the file's blocks, 16-bit integer activations for
//!   generated tokens, an f16 cache) rounds more. Decoding the reference's tokens, it must
//!   choose as the reference does at every step that is not a close call; decoding its
//!   own choices, it gives the reference's 32 tokens on Qwen's prompts too (a change of
//!   rounding that flips a close call there shows here first).
//!
//! Without the model file the test skips, unless `BATON_REQUIRE_DOWNLOADS` is set (as
//! `scripts/test` sets it), when it fails.

use std::path::{Path, PathBuf};

use baton_common::env;
use baton_worker::{
    backend::CpuBackend as B,
    engine::{
        chat::{ChatMessage, ChatTemplate},
        gguf::GgufFile,
        llama::{load::load_llama, KvDtype, Llama, SeqInput, WeightDtype},
        tokenizer::Tokenizer,
    },
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    model: ModelFile,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct ModelFile {
    file: String,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    kind: String,
    prompt: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    margins: Vec<f32>,
}

/// A step decided by less than this may go either way under the host engine's rounding.
const ROUNDED_MARGIN: f32 = 0.25;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the worker crate sits in the workspace")
        .to_path_buf()
}

fn fixture(name: &str) -> Option<(Fixture, PathBuf)> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/real/{name}.json"));
    let text = std::fs::read_to_string(&path).expect("fixture");
    let f: Fixture = serde_json::from_str(&text).expect("fixture parses");
    let model = root().join("models").join(&f.model.file);
    if model.exists() {
        return Some((f, model));
    }
    if std::env::var_os(env::REQUIRE_DOWNLOADS).is_some() {
        panic!(
            "{} is absent (scripts/models fetch {name})",
            model.display()
        );
    }
    eprintln!(
        "skipping: {} is absent (scripts/models fetch {name})",
        model.display()
    );
    None
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}

/// The tokens chosen after the prompt and after each token fed: the reference's when
/// `forced`, else our own.
fn decode(model: &Llama<B>, prompt: &[u32], n: usize, forced: Option<&[u32]>) -> Vec<u32> {
    let mut cache = model.new_cache();
    let mut step = |tokens: &[u32]| {
        let (logits, argmax_found) = model
            .forward_greedy(&mut [SeqInput {
                tokens,
                cache: &mut cache,
            }])
            .expect("forward");
        argmax_found
            .map(|a| a[0])
            .unwrap_or_else(|| argmax(&logits))
    };
    let mut out = vec![step(prompt)];
    while out.len() < n {
        let next = forced
            .map(|f| f[out.len() - 1])
            .unwrap_or(out[out.len() - 1]);
        out.push(step(&[next]));
    }
    out
}

/// `host_free_run_exact`: whether the host engine, decoding its own choices, is expected
/// to give the reference's tokens too. It converts K-quant and Q5_0 blocks to Q8_0 for
/// now, a second rounding under which a close call may go the other way and the texts
/// part: on Qwen's prompts none does, on Gemma's some do.
fn check_model(name: &str, host_free_run_exact: bool) {
    let Some((fixture, path)) = fixture(name) else {
        return;
    };
    let gguf = GgufFile::open(&path).expect("opens");
    let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
    // A base model's file may have no chat template (Gemma-3-270M's); its cases are raw.
    let chat = ChatTemplate::from_gguf(&gguf).expect("template");
    for c in &fixture.cases {
        let ids = if c.kind == "chat" {
            let text = c.prompt.clone();
            let user = text_of_user(&fixture, c);
            let chat = chat
                .as_ref()
                .expect("a chat case comes from a file with a template");
            let rendered = chat
                .render(&[ChatMessage::new("user", user)], true)
                .expect("renders");
            assert_eq!(
                rendered, text,
                "{name} {}: the chat template renders as transformers'",
                c.name
            );
            tok.encode(&rendered, false).expect("encodes")
        } else {
            tok.encode(&c.prompt, true).expect("encodes")
        };
        assert_eq!(ids, c.prompt_ids, "{name} {}: prompt ids", c.name);
    }
    for (dtype, kv) in [
        (WeightDtype::F32, KvDtype::F32),
        (WeightDtype::NativeI16, KvDtype::F16),
    ] {
        let mut model =
            load_llama::<B>(&gguf, dtype, &Default::default(), &mut |_, _| {}).expect("loads");
        model.set_kv_dtype(kv);
        for c in &fixture.cases {
            let n = c.greedy_ids.len();
            let what = format!("{name} {} as {dtype}", c.name);
            if dtype == WeightDtype::F32 {
                let ours = decode(&model, &c.prompt_ids, n, None);
                assert_eq!(ours, c.greedy_ids, "{what}: greedy tokens differ");
            } else {
                let ours = decode(&model, &c.prompt_ids, n, Some(&c.greedy_ids));
                let clear: Vec<usize> =
                    (0..n).filter(|&i| c.margins[i] >= ROUNDED_MARGIN).collect();
                let same = clear
                    .iter()
                    .filter(|&&i| ours[i] == c.greedy_ids[i])
                    .count();
                let free = decode(&model, &c.prompt_ids, n, None);
                let run = free
                    .iter()
                    .zip(&c.greedy_ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                eprintln!(
                    "{what}: {same} of {} clear steps agree ({n} steps); decoding its own \
                     choices, the first {run} tokens are the reference's",
                    clear.len()
                );
                assert_eq!(
                    same,
                    clear.len(),
                    "{what}: ours {ours:?}, reference {:?}",
                    c.greedy_ids
                );
                if host_free_run_exact {
                    assert_eq!(free, c.greedy_ids, "{what}: greedy tokens differ");
                }
            }
        }
    }
}

/// The user message of a chat case: the raw case of the same prompt holds it.
fn text_of_user<'a>(fixture: &'a Fixture, chat: &Case) -> &'a str {
    let label = chat.name.trim_start_matches("chat_");
    let raw = fixture
        .cases
        .iter()
        .find(|c| c.name == format!("raw_{label}"))
        .expect("each chat case has a raw twin");
    &raw.prompt
}

#[test]
fn qwen2_5_coder_matches_transformers() {
    check_model("qwen2.5-coder-0.5b", true);
}

#[test]
fn gemma_3_matches_transformers() {
    check_model("gemma-3-270m", false);
}
