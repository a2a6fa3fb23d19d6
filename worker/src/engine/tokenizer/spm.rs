//! SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, Gemma),
//! on the same `tokenizers` BPE model as byte-level vocabularies.
//!
//! llama.cpp's SentencePiece tokenizer starts from the text's characters (spaces written
//! `▁`, one `▁` put in front when `add_space_prefix` says so) and keeps joining the
//! neighbouring pair whose join is the vocabulary entry with the highest score; a character
//! no entry spells falls back to its bytes (`<0xE2>`). A BPE model does the same when its
//! merge list holds every pair whose join is in the vocabulary, ranked by the join's score:
//! the file lists no merges, so they are recovered from the vocabulary here, as
//! transformers recovers them (`generate_merges`).

use std::collections::HashMap;

use super::TokenType;

/// The SentencePiece half of a tokenizer's parts.
#[derive(Debug, Clone)]
pub struct SpmParts {
    /// `tokenizer.ggml.scores`: one per token; a pair whose join scores higher is joined
    /// first.
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.add_space_prefix` (true when absent, as in llama.cpp): a `▁` in
    /// front of the text and of every piece of text after a special token.
    pub add_space_prefix: bool,
}

/// The spelling BPE sees: Gemma stores tokens of several spaces as real spaces, while the
/// text reaches BPE with every space written `▁` (transformers respells them the same way).
pub(super) fn spelling(token: &str) -> String {
    if !token.is_empty() && token.chars().all(|c| c == ' ') {
        "▁".repeat(token.chars().count())
    } else {
        token.to_owned()
    }
}

/// The bytes a SentencePiece token stands for: a byte token (`<0x0A>`) its byte, any other
/// its text with `▁` read as a space.
pub(super) fn token_bytes(token: &str, ty: TokenType) -> Vec<u8> {
    if ty == TokenType::Byte {
        if let Some(b) = token
            .strip_prefix("<0x")
            .and_then(|t| t.strip_suffix('>'))
            .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            return vec![b];
        }
    }
    token.replace('▁', " ").into_bytes()
}

/// Every pair of vocabulary entries whose join is an entry that text can be built into
/// (ordinary and user-defined tokens), best first: by the join's score, then (as
/// transformers orders them) the longer left piece, then the longer right piece, then
/// the join's place in the vocabulary and the pieces' ids.
pub(super) fn merges(
    spellings: &[String],
    types: &[TokenType],
    scores: &[f32],
) -> Vec<(String, String)> {
    let mut ids: HashMap<&str, u32> = HashMap::with_capacity(spellings.len());
    for (id, s) in (0u32..).zip(spellings) {
        ids.insert(s.as_str(), id);
    }
    // (score, left length, right length, join id, left id, right id, split byte)
    let mut all = Vec::new();
    for (id, (s, ty)) in (0u32..).zip(spellings.iter().zip(types)) {
        if !matches!(ty, TokenType::Normal | TokenType::UserDefined) {
            continue;
        }
        // The last spelling wins a repeated entry, as in the BPE vocabulary.
        if ids.get(s.as_str()) != Some(&id) {
            continue;
        }
        let score = scores[id as usize];
        for (at, _) in s.char_indices().skip(1) {
            let (l, r) = s.split_at(at);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                all.push((score, l.chars().count(), r.chars().count(), id, li, ri, at));
            }
        }
    }
    all.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(b.1.cmp(&a.1))
            .then(b.2.cmp(&a.2))
            .then(a.3.cmp(&b.3))
            .then(a.4.cmp(&b.4))
            .then(a.5.cmp(&b.5))
    });
    all.into_iter()
        .map(|(_, _, _, id, _, _, at)| {
            let (l, r) = spellings[id as usize].split_at(at);
            (l.to_owned(), r.to_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn merges_follow_the_joins_scores() {
        let tokens = strings(&["▁", "a", "b", "ab", "▁a", "▁ab"]);
        let types = vec![TokenType::Normal; tokens.len()];
        let scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0];
        let m = merges(&tokens, &types, &scores);
        let pairs: Vec<(&str, &str)> = m.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        // "ab" scores best; "▁ab" can be built two ways, the longer left piece first.
        assert_eq!(pairs, [("a", "b"), ("▁", "a"), ("▁a", "b"), ("▁", "ab")]);
    }

    #[test]
    fn byte_tokens_stand_for_their_byte() {
        assert_eq!(token_bytes("<0x0A>", TokenType::Byte), b"\n");
        assert_eq!(token_bytes("▁the", TokenType::Normal), b" the");
        assert_eq!(token_bytes("<0x0A>", TokenType::Normal), b"<0x0A>");
        assert_eq!(spelling("   "), "▁▁▁");
        assert_eq!(spelling("a b"), "a b");
    }
}
