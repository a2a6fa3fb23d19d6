//! The token hash chain: a name for the KV state of a sequence.
//!
//! The KV state after position *p* is a pure function of the model, the prompt and the
//! tokens so far, so a 64-bit chain of hashes names it:
//!
//! ```text
//! root      = xxh3_64_with_seed("baton.chain.v1" ‖ fingerprint as u64 LE, SEED)
//! link(h,t) = xxh3_64_with_seed(h as u64 LE ‖ t as u32 LE, SEED)
//! h₀        = link(… link(link(root, prompt₀), prompt₁) …, promptₙ₋₁)
//! hₚ        = link(hₚ₋₁, tokenₚ)                       for every generated token
//! ```
//!
//! with [`SEED`] fixed forever, so every process on every machine computes the same
//! values. The chain runs over the prompt token by token, so the hash after every 16th
//! token of prompt and output alike ([`BLOCK_TOKENS`]) names a block of KV state: the
//! prefix cache and the router's prefix-aware choice share these block hashes.
//!
//! A worker that resumes a stream re-runs the chain over the prompt and the tokens so
//! far; it continues only when its chain ends at the hash the coordinator checkpointed
//! (another model, another tokenizer or another prompt give another hash).

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of every chain hash ("baton_h1" in ASCII).
pub const SEED: u64 = 0x6261_746f_6e5f_6831;

/// Tokens per block: the chain's value after every multiple of this many tokens is a
/// block hash.
pub const BLOCK_TOKENS: usize = 16;

/// Domain tag of the root.
const ROOT_TAG: &[u8] = b"baton.chain.v1";

/// The chain's value before any token: a function of the model fingerprint only.
pub fn root(fingerprint: u64) -> u64 {
    let mut bytes = [0u8; ROOT_TAG.len() + 8];
    bytes[..ROOT_TAG.len()].copy_from_slice(ROOT_TAG);
    bytes[ROOT_TAG.len()..].copy_from_slice(&fingerprint.to_le_bytes());
    xxh3_64_with_seed(&bytes, SEED)
}

/// The chain's value after `token`, when it was `prev` before.
pub fn link(prev: u64, token: u32) -> u64 {
    let mut bytes = [0u8; 12];
    bytes[..8].copy_from_slice(&prev.to_le_bytes());
    bytes[8..].copy_from_slice(&token.to_le_bytes());
    xxh3_64_with_seed(&bytes, SEED)
}

/// The chain's value after `tokens`, starting from `from`.
pub fn extend(from: u64, tokens: &[u32]) -> u64 {
    tokens.iter().fold(from, |h, &t| link(h, t))
}

/// `h₀` of a prompt: the chain from the model's root over the prompt's token ids.
pub fn prompt_hash(fingerprint: u64, prompt: &[u32]) -> u64 {
    extend(root(fingerprint), prompt)
}

/// The block hashes of `tokens` (prompt, then output): the chain's value after each
/// full block of [`BLOCK_TOKENS`] tokens. A trailing partial block has none.
pub fn block_hashes(fingerprint: u64, tokens: &[u32]) -> Vec<u64> {
    let mut h = root(fingerprint);
    let mut out = Vec::with_capacity(tokens.len() / BLOCK_TOKENS);
    for (i, &t) in tokens.iter().enumerate() {
        h = link(h, t);
        if (i + 1).is_multiple_of(BLOCK_TOKENS) {
            out.push(h);
        }
    }
    out
}

/// A running chain: its value and how many tokens it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chain {
    hash: u64,
    len: usize,
}

impl Chain {
    /// The chain of `prompt` under the model `fingerprint` (its value is `h₀`).
    pub fn new(fingerprint: u64, prompt: &[u32]) -> Self {
        Self {
            hash: prompt_hash(fingerprint, prompt),
            len: prompt.len(),
        }
    }

    /// Extends the chain by one token; returns the new value.
    pub fn push(&mut self, token: u32) -> u64 {
        self.hash = link(self.hash, token);
        self.len += 1;
        self.hash
    }

    /// The current value.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// Tokens covered (prompt and output).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the chain covers no token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the value after the last token is a block hash.
    pub fn at_block_boundary(&self) -> bool {
        self.len > 0 && self.len.is_multiple_of(BLOCK_TOKENS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Known vectors: these values are the protocol. A change here breaks resuming
    // streams across versions and must come with a new protocol version. They were
    // checked against Python's `xxhash` package (`xxh3_64_intdigest` with the seed).
    #[test]
    fn known_vectors() {
        assert_eq!(root(0), 0xabf0_d208_0ff8_cf2f);
        assert_eq!(root(0x0123_4567_89ab_cdef), 0xb6ee_0b1a_1111_0027);
        assert_eq!(link(0, 0), 0x6a6b_66a4_fc90_df75);
        assert_eq!(link(root(0), 1), 0x05f3_34b3_56eb_061d);
        assert_eq!(prompt_hash(7, &[1, 2, 3]), 0x0269_90d1_e3e6_185e);
    }

    #[test]
    fn the_formula_is_the_documented_one() {
        let mut bytes = b"baton.chain.v1".to_vec();
        bytes.extend_from_slice(&42u64.to_le_bytes());
        assert_eq!(root(42), xxh3_64_with_seed(&bytes, SEED));
        let mut bytes = 99u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(&5u32.to_le_bytes());
        assert_eq!(link(99, 5), xxh3_64_with_seed(&bytes, SEED));
        assert_eq!(SEED.to_be_bytes(), *b"baton_h1");
    }

    #[test]
    fn chains_compose() {
        let tokens: Vec<u32> = (0..50).map(|i| i * 7 + 3).collect();
        let whole = prompt_hash(1, &tokens);
        for cut in 0..=tokens.len() {
            let head = prompt_hash(1, &tokens[..cut]);
            assert_eq!(extend(head, &tokens[cut..]), whole, "cut at {cut}");
            let mut c = Chain::new(1, &tokens[..cut]);
            for &t in &tokens[cut..] {
                c.push(t);
            }
            assert_eq!(c.hash(), whole);
            assert_eq!(c.len(), tokens.len());
        }
    }

    #[test]
    fn different_models_prompts_or_tokens_differ() {
        assert_ne!(prompt_hash(1, &[1, 2]), prompt_hash(2, &[1, 2]));
        assert_ne!(prompt_hash(1, &[1, 2]), prompt_hash(1, &[2, 1]));
        assert_ne!(prompt_hash(1, &[1]), prompt_hash(1, &[1, 0]));
    }

    proptest::proptest! {
        // Any tokens, cut anywhere: the chain over the whole equals the chain over the
        // head continued over the tail, by `extend` and by `Chain::push` alike.
        #[test]
        fn chains_compose_at_any_cut(
            fingerprint: u64,
            tokens in proptest::collection::vec(proptest::num::u32::ANY, 0..80),
            cut: proptest::sample::Index,
        ) {
            let cut = cut.index(tokens.len() + 1);
            let (head, tail) = tokens.split_at(cut);
            let whole = prompt_hash(fingerprint, &tokens);
            proptest::prop_assert_eq!(extend(prompt_hash(fingerprint, head), tail), whole);
            let mut chain = Chain::new(fingerprint, head);
            for (i, &t) in tail.iter().enumerate() {
                let value = chain.push(t);
                proptest::prop_assert_eq!(value, prompt_hash(fingerprint, &tokens[..cut + i + 1]));
            }
            proptest::prop_assert_eq!(chain.hash(), whole);
            proptest::prop_assert_eq!(chain.len(), tokens.len());
        }

        // Block hashes are the chain's values at block ends, so those of a head are the
        // first ones of the whole, and a chain grown token by token meets each of them
        // exactly where it says it is at a block boundary.
        #[test]
        fn block_hashes_agree_with_the_chain(
            fingerprint: u64,
            tokens in proptest::collection::vec(proptest::num::u32::ANY, 0..80),
            cut: proptest::sample::Index,
        ) {
            let blocks = block_hashes(fingerprint, &tokens);
            proptest::prop_assert_eq!(blocks.len(), tokens.len() / BLOCK_TOKENS);
            let cut = cut.index(tokens.len() + 1);
            let head = block_hashes(fingerprint, &tokens[..cut]);
            proptest::prop_assert_eq!(&blocks[..head.len()], &head[..]);
            let mut chain = Chain::new(fingerprint, &[]);
            let mut seen = Vec::new();
            for &t in &tokens {
                let value = chain.push(t);
                if chain.at_block_boundary() {
                    seen.push(value);
                }
            }
            proptest::prop_assert_eq!(seen, blocks);
        }
    }

    #[test]
    fn block_hashes_are_chain_values_at_block_ends() {
        let tokens: Vec<u32> = (0..40).collect();
        let blocks = block_hashes(9, &tokens);
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[0], prompt_hash(9, &tokens[..16]));
        assert_eq!(blocks[1], prompt_hash(9, &tokens[..32]));
        let mut c = Chain::new(9, &tokens[..15]);
        assert!(!c.at_block_boundary());
        assert_eq!(c.push(15), blocks[0]);
        assert!(c.at_block_boundary());
    }
}
