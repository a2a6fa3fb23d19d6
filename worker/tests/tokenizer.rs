//! Tokenizer and chat template against reference fixtures.
//!
//! The fixtures in `tests/fixtures/tokenizer/` come from `scripts/tokenizer_fixtures.py`
//! (Hugging Face `tokenizers` and `transformers` on the default model's GGUF). The tests that
//! need the model read `models/SmolLM2-135M-Instruct.Q4_1.gguf` under the workspace root and
//! are skipped, with a note, when it is absent. The last test builds a tiny GGUF itself.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use baton_worker::engine::chat::{ChatMessage, ChatTemplate};
use baton_worker::engine::gguf::{GgufFile, GgufWriter, MetaValue};
use baton_worker::engine::tokenizer::{StreamDecoder, Tokenizer};
use serde::Deserialize;

#[derive(Deserialize)]
struct Cases {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

#[derive(Deserialize)]
struct ChatCases {
    bos_token: String,
    eos_token: String,
    cases: Vec<ChatCase>,
}

#[derive(Deserialize)]
struct ChatCase {
    name: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    prompt: String,
    ids: Vec<u32>,
}

fn fixture<T: for<'de> Deserialize<'de>>(name: &str) -> T {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("bad fixture {}: {e}", path.display()))
}

fn model_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

struct Loaded {
    tokenizer: Arc<Tokenizer>,
    chat: ChatTemplate,
}

/// The default model's tokenizer and chat template, or `None` (with a note) without it.
fn model() -> Option<&'static Loaded> {
    static LOADED: OnceLock<Option<Loaded>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        let path = model_path();
        if !path.exists() {
            return None;
        }
        let gguf = GgufFile::open(&path).expect("the default model opens");
        let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf).expect("tokenizer builds"));
        let chat = ChatTemplate::from_gguf(&gguf)
            .expect("chat template compiles")
            .expect("the default model has a chat template");
        Some(Loaded { tokenizer, chat })
    });
    if loaded.is_none() {
        eprintln!("skipped: {} is absent", model_path().display());
    }
    loaded.as_ref()
}

#[test]
fn default_model_facts() {
    let Some(m) = model() else { return };
    let tok = &m.tokenizer;
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(1), Some(2)));
    assert_eq!(tok.token_id("<|endoftext|>"), Some(0));
    assert_eq!(tok.token_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert!((0..=16).all(|id| tok.is_special(id)));
    assert!(!tok.is_special(17));
    // add_bos_token is false: `add_special` adds nothing.
    assert_eq!(
        tok.encode("In 1969, the first humans", true)
            .expect("encodes"),
        [788, 216, 33, 41, 38, 41, 28, 260, 808, 2973]
    );
    let fingerprint = tok.fingerprint_bytes();
    assert!(fingerprint.starts_with(b"baton-tokenizer/1\n"));
    let again =
        Tokenizer::from_gguf(&GgufFile::open(&model_path()).expect("opens")).expect("builds");
    assert_eq!(again.fingerprint_bytes(), fingerprint);
}

#[test]
fn encode_matches_reference_ids() {
    let Some(m) = model() else { return };
    let cases: Cases = fixture("cases.json");
    assert!(cases.cases.len() >= 40);
    let mut failures = Vec::new();
    for case in &cases.cases {
        let ids = m.tokenizer.encode(&case.text, false).expect("encodes");
        if ids != case.ids {
            failures.push(format!("{}: got {ids:?}, want {:?}", case.name, case.ids));
        }
    }
    assert!(
        failures.is_empty(),
        "encode mismatches:\n{}",
        failures.join("\n")
    );
}

#[test]
fn decode_round_trips() {
    let Some(m) = model() else { return };
    let cases: Cases = fixture("cases.json");
    for case in &cases.cases {
        let text = m.tokenizer.decode(&case.ids, false).expect("decodes");
        assert_eq!(text, case.decoded, "{}", case.name);
        // Only texts with bytes missing from the vocabulary lose anything.
        if case.name != "missing_bytes" {
            assert_eq!(text, case.text, "{}", case.name);
        }
        let skipped = m.tokenizer.decode(&case.ids, true).expect("decodes");
        assert!(!skipped.contains("<|im_start|>"), "{}", case.name);
    }
}

#[test]
fn stream_decoder_adds_up_to_decode() {
    let Some(m) = model() else { return };
    let cases: Cases = fixture("cases.json");
    for case in &cases.cases {
        let mut stream = StreamDecoder::new(m.tokenizer.clone());
        let mut text = String::new();
        for &id in &case.ids {
            let piece = stream.push(id).expect("pushes");
            assert!(
                !piece.contains('\u{FFFD}'),
                "{}: partial character emitted",
                case.name
            );
            text.push_str(&piece);
        }
        text.push_str(&stream.finish());
        assert_eq!(text, case.decoded, "{}", case.name);
    }
}

#[test]
fn chat_prompts_match_transformers() {
    let Some(m) = model() else { return };
    let chats: ChatCases = fixture("chat_cases.json");
    assert_eq!(
        (chats.bos_token.as_str(), chats.eos_token.as_str()),
        ("<|im_start|>", "<|im_end|>")
    );
    for case in &chats.cases {
        let prompt = m
            .chat
            .render(&case.messages, case.add_generation_prompt)
            .expect("renders");
        assert_eq!(prompt, case.prompt, "{}", case.name);
        let ids = m.tokenizer.encode(&prompt, true).expect("encodes");
        assert_eq!(ids, case.ids, "{}", case.name);
    }
}

/// A GGUF holding only tokenizer metadata, written here, read back through `from_gguf`.
#[test]
fn tiny_gguf_round_trip() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("tiny.gguf");
    let bytes: Vec<String> = (0u8..=255).map(byte_symbol).collect();
    let mut tokens = vec!["<|end|>".to_owned()];
    tokens.extend(bytes);
    tokens.extend(["he".to_owned(), "Ġhe".to_owned()]);
    let mut types = vec![3i32];
    types.resize(tokens.len(), 1);
    let strings =
        |v: &[String]| MetaValue::Array(v.iter().cloned().map(MetaValue::String).collect());

    let mut w = GgufWriter::new();
    let mut put = |key: &str, value: MetaValue| w.add_metadata(key, value).expect("metadata");
    put("general.architecture", MetaValue::String("llama".into()));
    put("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
    put("tokenizer.ggml.pre", MetaValue::String("smollm".into()));
    put("tokenizer.ggml.tokens", strings(&tokens));
    put(
        "tokenizer.ggml.token_type",
        MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
    );
    put(
        "tokenizer.ggml.merges",
        strings(&["h e".to_owned(), "Ġ he".to_owned()]),
    );
    put("tokenizer.ggml.eos_token_id", MetaValue::U32(0));
    put("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
    put(
        "tokenizer.chat_template",
        MetaValue::String(
            "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}".into(),
        ),
    );
    w.write_to(&path).expect("writes");

    let gguf = GgufFile::open(&path).expect("opens");
    let tok = Tokenizer::from_gguf(&gguf).expect("builds");
    assert_eq!(tok.vocab_size(), 259);
    assert_eq!((tok.bos_id(), tok.eos_id()), (None, Some(0)));
    let ids = tok.encode("he he7<|end|>", true).expect("encodes");
    let seven = tok.token_id("7").expect("byte");
    assert_eq!(ids, [257, 258, seven, 0]);
    assert_eq!(tok.decode(&ids, true).expect("decodes"), "he he7");

    let chat = ChatTemplate::from_gguf(&gguf)
        .expect("compiles")
        .expect("present");
    let prompt = chat
        .render(&[ChatMessage::new("user", "hi")], true)
        .expect("renders");
    assert_eq!(prompt, "hi<|end|>");
}

/// GPT-2's printable stand-in for a byte.
fn byte_symbol(b: u8) -> String {
    let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable {
        return char::from(b).to_string();
    }
    let rank = (0..b)
        .filter(|&x| !matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF))
        .count();
    char::from_u32(0x100 + rank as u32)
        .expect("below U+0144")
        .to_string()
}
