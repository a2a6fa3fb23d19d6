//! The tokenizer against llama.cpp's own vocabulary tests: `ggml-vocab-<name>.gguf` files
//! (vocabulary only) with `.inp` texts and `.out` expected ids, from the llama.cpp sources
//! that `scripts/setup` extracts from the llama-cpp-python source package into
//! `$BATON_CACHE/llamacpp/vocab`. llama.cpp's `test-tokenizer-0` encodes each text without
//! BOS/EOS and without parsing special tokens; none of these texts spells one.
//! A SentencePiece vocabulary puts `▁` in front of the text (`add_space_prefix`).

use std::path::PathBuf;

use baton_common::env;
use baton_worker::engine::gguf::GgufFile;
use baton_worker::engine::tokenizer::Tokenizer;

/// The byte-level BPE vocabularies of the families the worker runs: GPT-2 (SmolLM2's
/// family), Llama 3, Qwen2 (Qwen2.5, Qwen3).
const BPE_VOCABS: &[&str] = &["gpt-2", "llama-bpe", "qwen2"];

/// The SentencePiece vocabularies: Llama 2 / Mistral's, and Phi-3's (the same vocabulary
/// with more control tokens).
const SPM_VOCABS: &[&str] = &["llama-spm", "phi-3"];

fn vocab_dir() -> Option<PathBuf> {
    let cache = std::env::var_os(env::CACHE)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/baton"));
    let dir = cache.join("llamacpp/vocab");
    if dir.join("ggml-vocab-qwen2.gguf").exists() {
        return Some(dir);
    }
    if std::env::var_os(env::REQUIRE_DOWNLOADS).is_some() {
        panic!(
            "{} holds no llama.cpp vocabulary tests (scripts/setup extracts them)",
            dir.display()
        );
    }
    eprintln!("skipping: {} is absent (run scripts/setup)", dir.display());
    None
}

/// The texts and expected ids of one vocabulary's test.
fn cases(dir: &std::path::Path, name: &str) -> Vec<(String, Vec<u32>)> {
    let read = |ext: &str| {
        let p = dir.join(format!("ggml-vocab-{name}.gguf.{ext}"));
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let inp = read("inp");
    let mut texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    // The file ends with a separator.
    assert_eq!(texts.pop(), Some(""), "{name}.inp ends with a separator");
    let out = read("out");
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|x| x.parse().expect("an id"))
                .collect()
        })
        .collect();
    assert_eq!(texts.len(), ids.len(), "{name}: as many texts as id lines");
    texts.into_iter().map(str::to_owned).zip(ids).collect()
}

#[test]
fn bpe_vocabularies_give_llama_cpp_ids() {
    check(BPE_VOCABS);
}

#[test]
fn sentencepiece_vocabularies_give_llama_cpp_ids() {
    check(SPM_VOCABS);
}

fn check(vocabs: &[&str]) {
    let Some(dir) = vocab_dir() else { return };
    for name in vocabs {
        let gguf = GgufFile::open(&dir.join(format!("ggml-vocab-{name}.gguf"))).expect("opens");
        let tok = Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{name}: {e}"));
        let cases = cases(&dir, name);
        assert!(cases.len() > 30, "{name}: {} cases", cases.len());
        let mut failed = Vec::new();
        for (text, want) in &cases {
            let got = tok.encode(text, false).expect("encodes");
            if &got != want {
                failed.push(format!("{text:?}: got {got:?}, want {want:?}"));
            }
        }
        assert!(
            failed.is_empty(),
            "{name}: {} of {} cases differ:\n{}",
            failed.len(),
            cases.len(),
            failed.join("\n")
        );
    }
}
