//! Structured output on the worker: a grammar's llguidance matcher per sequence, and
//! the token mask it gives each draw.
//!
//! The vocabulary llguidance sees is the model's: every token's bytes, special tokens
//! under llguidance's marker byte (so no grammar ever spells one), the end tokens as its
//! end-of-sequence set (allowed exactly where the grammar may end), and rows the
//! tokenizer does not fill (a padded embedding) as empty tokens, never allowed.
//!
//! A matcher's state is a function of the tokens it consumed, so a resumed sequence
//! replays its tokens through a fresh one and is where the first worker's was; a token
//! the grammar does not allow on replay is a refused resume, never a silent divergence.

use std::sync::Arc;

use baton_common::{grammar, protocol::Grammar};
use llguidance::{Matcher, ParserFactory};
use toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenizerEnv};

use super::tokenizer::Tokenizer;

/// The tokenizer as llguidance asks for it.
struct ModelTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for ModelTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // llguidance asks for text the grammar forces; bytes that are not UTF-8 (a cut
        // character) are split along the vocabulary instead.
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tokenizer
                .encode(text, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// What compiles grammars for one model.
pub struct Guides {
    factory: ParserFactory,
}

impl Guides {
    /// The vocabulary of `tokenizer`, `vocab` rows wide (the model's logits), with
    /// `end_tokens` as the tokens that end a sequence.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        end_tokens: &[u32],
        vocab: usize,
    ) -> Result<Self, String> {
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                if tokenizer.is_special(id) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.token(id).unwrap_or_default().as_bytes());
                    w
                } else {
                    tokenizer
                        .token_bytes(id)
                        .map(<[u8]>::to_vec)
                        .unwrap_or_default()
                }
            })
            .collect();
        let eos = end_tokens.first().copied().unwrap_or(0);
        let mut info = TokRxInfo::new(vocab as u32, eos);
        info.tok_bos = tokenizer.bos_id();
        let trie = TokTrie::from(&info, &words).with_eos_tokens(end_tokens);
        let env = Arc::new(ModelTokEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&(env as toktrie::TokEnv))
            .map_err(|e| grammar::first_line(&e.to_string()))?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// A sequence's guide for `grammar`.
    pub fn start(&self, g: &Grammar) -> Result<Guide, String> {
        let top = grammar::top_level(g).map_err(|e| e.to_string())?;
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| grammar::first_line(&e.to_string()))?;
        Ok(Guide {
            matcher: Matcher::new(Ok(parser)),
        })
    }
}

/// One sequence's grammar state.
pub struct Guide {
    matcher: Matcher,
}

impl Guide {
    /// The tokens the grammar allows next (the end tokens where it may end).
    pub fn mask(&mut self) -> Result<SimpleVob, String> {
        self.matcher
            .compute_mask()
            .map_err(|e| grammar::first_line(&e.to_string()))
    }

    /// Moves past `id`; an error when the grammar does not allow it.
    pub fn consume(&mut self, id: u32) -> Result<(), String> {
        self.matcher
            .consume_token(id)
            .map_err(|e| grammar::first_line(&e.to_string()))
    }

    /// Whether the grammar is complete and allows nothing more.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// Sets every logit the mask forbids to −∞ (the sampler never draws one).
/// Rows past the mask's vocabulary are forbidden too.
pub fn apply_mask(mask: &SimpleVob, row: &mut [f32]) {
    let words = mask.as_slice();
    for (w, chunk) in row.chunks_mut(32).enumerate() {
        let valid = mask.len().saturating_sub(w * 32);
        let bits = match words.get(w) {
            Some(&bits) if valid >= 32 => bits,
            Some(&bits) => bits & ((1u32 << valid) - 1),
            None => 0,
        };
        if bits == u32::MAX {
            continue;
        }
        for (b, logit) in chunk.iter_mut().enumerate() {
            if bits >> b & 1 == 0 {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_forbids_what_it_does_not_allow_and_rows_past_it() {
        let mut mask = SimpleVob::alloc(40);
        for id in [0, 5, 31, 32, 39] {
            mask.allow_token(id);
        }
        let mut row = vec![1.0f32; 70];
        apply_mask(&mask, &mut row);
        let allowed: Vec<usize> = (0..70).filter(|&i| row[i] == 1.0).collect();
        assert_eq!(allowed, [0, 5, 31, 32, 39]);
        assert!(row.iter().all(|&l| l == 1.0 || l == f32::NEG_INFINITY));
    }
}
