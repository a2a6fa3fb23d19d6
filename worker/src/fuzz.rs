//! What the `gguf` fuzz target runs (`fuzz/fuzz_targets/gguf.rs`), here so that
//! `cargo test` replays the inputs in `fuzz/regressions/gguf/` through the very same code.
//!
//! [`gguf`] treats arbitrary bytes as a model file and takes them as far as loading goes:
//! the header, metadata and tensor table ([`GgufFile::from_bytes`]), every tensor's
//! data (dequantized), the tokenizer, the chat template and the Llama configuration read
//! from the metadata, and the model itself built on the CPU backend. Each step may refuse
//! the file with an error; none may panic.

use crate::backend::CpuBackend;
use crate::engine::chat::{ChatMessage, ChatTemplate};
use crate::engine::gguf::GgufFile;
use crate::engine::llama::load::{load_llama, WeightDtype};
use crate::engine::llama::preflight::preflight;
use crate::engine::tokenizer::{StreamDecoder, Tokenizer};

/// A text that touches every pre-tokenizer class: letters, digits, punctuation,
/// whitespace runs, multi-byte characters and a special token.
const SAMPLE_TEXT: &str = "Hello, world! 42 héllo\n\n  <|im_start|>x 日本";

/// Feeds `data` to the GGUF reader and everything a worker builds from a model file;
/// panics only on a bug.
pub fn gguf(data: &[u8]) {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    for info in file.tensors() {
        if let Ok(values) = file.dequantize_tensor(info) {
            assert_eq!(values.len() as u64, info.n_elements);
        }
    }
    if let Ok(tokenizer) = Tokenizer::from_gguf(&file) {
        tokenize(tokenizer);
    }
    if let Ok(Some(template)) = ChatTemplate::from_gguf(&file) {
        let messages = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
        ];
        let _ = template.render(&messages, true);
    }
    let _ = preflight(&file);
    for dtype in [WeightDtype::Native, WeightDtype::F32] {
        let _ = load_llama::<CpuBackend>(&file, dtype, &Default::default(), &mut |_, _| {});
    }
}

/// Encodes and decodes with a tokenizer built from untrusted metadata.
fn tokenize(tokenizer: Tokenizer) {
    let Ok(ids) = tokenizer.encode(SAMPLE_TEXT, true) else {
        return;
    };
    let vocab = tokenizer.vocab_size();
    assert!(
        ids.iter().all(|&id| (id as usize) < vocab),
        "an encoded id is outside the vocabulary"
    );
    let whole = tokenizer.decode(&ids, false).expect("ids in range decode");
    let mut stream = StreamDecoder::new(std::sync::Arc::new(tokenizer));
    let mut pieces = String::new();
    for &id in &ids {
        pieces.push_str(&stream.push(id).expect("ids in range decode"));
    }
    pieces.push_str(&stream.finish());
    assert_eq!(pieces, whole, "streamed text differs from the decoded text");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::llama::synthetic::{write_synthetic_llama, SyntheticSpec};

    #[test]
    fn a_valid_model_and_its_pieces_pass() {
        let dir = tempfile::TempDir::new().expect("temp dir");
        let path = dir.path().join("tiny.gguf");
        write_synthetic_llama(&path, &SyntheticSpec::tiny(1)).expect("write");
        let bytes = std::fs::read(&path).expect("read");
        gguf(&bytes);
        for cut in [0, 4, 24, 100, bytes.len() / 3, bytes.len() - 1] {
            gguf(&bytes[..cut]);
        }
    }
}
