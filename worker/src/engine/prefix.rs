//! The prefix cache: keys and values of prompt blocks, kept across requests.
//!
//! Requests often share the start of their prompt (a long system prompt, earlier turns
//! of a chat). The chain's block hash after every [`BLOCK_TOKENS`] tokens names the KV
//! state up to it ([`baton_common::chain`]), so the cache maps a block hash to the keys
//! and values of that block's positions, every layer. A sequence that starts copies the
//! cached blocks of its longest cached leading run into its own KV cache and runs only
//! the rest of its prompt through the model.
//!
//! The run need not end on a block boundary. Each block also records the chain value
//! before it (its parent) and its tokens, so after the last whole block found, the
//! cached blocks that follow it are compared token by token with what comes next, and
//! the leading positions of the longest match are copied too: the keys and values of a
//! position depend only on the tokens up to it, so the first *j* positions of any block
//! that follows the same parent with the same *j* tokens are the ones a cold prefill
//! computes. Prompts that share a prefix ending mid-block (a system prompt, then a user
//! message) reuse all of it, not only its whole blocks.
//!
//! Memory is bounded by a byte budget; when a new block does not fit, the least recently
//! used blocks go first. A sequence touches its blocks last to first, so that within one
//! prefix the later blocks are evicted before the earlier ones: a run is only usable from
//! its first block, and evicting its first block would strand the rest.
//!
//! The cache does not know the layout of a block's values; [`super::llama::KvCache`]
//! packs and unpacks them.

use std::collections::{BTreeMap, HashMap};

use crate::engine::llama::cache::KvBlock;

pub use baton_common::chain::BLOCK_TOKENS;

/// What the prefix cache did since the engine started, and what it holds now.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PrefixStats {
    /// Sequences that started from at least one cached position.
    pub hits: u64,
    /// Sequences with at least one token before their last prompt token that found
    /// none of them cached.
    pub misses: u64,
    /// Prompt tokens not run through the model because their KV was cached.
    pub reused_tokens: u64,
    /// Blocks stored.
    pub stored_blocks: u64,
    /// Blocks evicted to make room.
    pub evicted_blocks: u64,
    /// Blocks held now.
    pub blocks: u64,
    /// Bytes held now.
    pub bytes: u64,
}

impl PrefixStats {
    /// Both caches' counters together (a worker serving two models).
    pub fn plus(self, o: PrefixStats) -> PrefixStats {
        PrefixStats {
            hits: self.hits + o.hits,
            misses: self.misses + o.misses,
            reused_tokens: self.reused_tokens + o.reused_tokens,
            stored_blocks: self.stored_blocks + o.stored_blocks,
            evicted_blocks: self.evicted_blocks + o.evicted_blocks,
            blocks: self.blocks + o.blocks,
            bytes: self.bytes + o.bytes,
        }
    }
}

/// One block's keys and values.
struct Entry {
    /// Keys and values of the block's positions, every layer, in the cache's layout.
    kv: KvBlock,
    /// Last use, on the cache's clock; the key of this block in [`PrefixCache::lru`].
    tick: u64,
    /// The chain's value before the block's first token.
    parent: u64,
    /// The block's tokens.
    tokens: [u32; BLOCK_TOKENS],
}

/// Keys and values of prompt blocks by block hash, within a byte budget.
#[derive(Default)]
pub struct PrefixCache {
    /// Most bytes of values held; 0 disables the cache.
    budget: usize,
    /// Bytes of values held now.
    bytes: usize,
    /// A counter that orders uses.
    clock: u64,
    blocks: HashMap<u64, Entry>,
    /// Hashes of the blocks held, by the chain value before them.
    children: HashMap<u64, Vec<u64>>,
    /// Block hashes by last use, oldest first: the eviction order.
    lru: BTreeMap<u64, u64>,
    stats: PrefixStats,
}

impl PrefixCache {
    /// A cache holding at most `budget` bytes of keys and values (0: disabled).
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            ..Self::default()
        }
    }

    /// Whether the cache may hold anything.
    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// The byte budget.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Changes the budget, evicting what no longer fits (0 empties and disables it).
    pub fn set_budget(&mut self, budget: usize) {
        self.budget = budget;
        while self.bytes > self.budget {
            if !self.evict_oldest() {
                break;
            }
        }
    }

    /// Counters and current size.
    pub fn stats(&self) -> PrefixStats {
        PrefixStats {
            blocks: self.blocks.len() as u64,
            bytes: self.bytes as u64,
            ..self.stats
        }
    }

    /// How many leading blocks of `hashes` are cached; marks them used. Counts nothing:
    /// [`Self::record`] does, once the sequence's whole reuse is known.
    pub fn lookup(&mut self, hashes: &[u64]) -> usize {
        if !self.enabled() {
            return 0;
        }
        let n = hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        for &h in hashes[..n].iter().rev() {
            self.touch(h);
        }
        n
    }

    /// The cached block after chain value `parent` whose tokens begin with the longest
    /// run of `next` (at most a block's worth is compared), and that run's length; marks
    /// it used. `None` when no block after `parent` begins with `next[0]`.
    pub fn partial(&mut self, parent: u64, next: &[u32]) -> Option<(u64, usize)> {
        let next = &next[..next.len().min(BLOCK_TOKENS)];
        let (hash, len) = self
            .children
            .get(&parent)?
            .iter()
            .map(|h| {
                let tokens = &self.blocks[h].tokens;
                let len = tokens.iter().zip(next).take_while(|(a, b)| a == b).count();
                (*h, len)
            })
            .max_by_key(|&(_, len)| len)?;
        if len == 0 {
            return None;
        }
        self.touch(hash);
        Some((hash, len))
    }

    /// Counts one sequence's start: a hit when it reused `reused` > 0 positions, a miss
    /// when it reused none of the `candidates` (tokens before its last prompt token) it
    /// had; nothing when it had none.
    pub fn record(&mut self, reused: usize, candidates: usize) {
        if !self.enabled() {
            return;
        }
        if reused > 0 {
            self.stats.hits += 1;
            self.stats.reused_tokens += reused as u64;
        } else if candidates > 0 {
            self.stats.misses += 1;
        }
    }

    /// The values of a cached block.
    pub fn get(&self, hash: u64) -> Option<&KvBlock> {
        self.blocks.get(&hash).map(|e| &e.kv)
    }

    /// Whether a block is cached; marks it used if so.
    pub fn touch(&mut self, hash: u64) -> bool {
        let tick = self.clock;
        match self.blocks.get_mut(&hash) {
            Some(e) => {
                self.lru.remove(&e.tick);
                e.tick = tick;
                self.lru.insert(tick, hash);
                self.clock += 1;
                true
            }
            None => false,
        }
    }

    /// Stores block `hash` (as the most recently used): the chain value before it, its
    /// tokens and their keys and values. Evicts the least recently used blocks until it
    /// fits; a block larger than the whole budget is not stored.
    pub fn insert(&mut self, hash: u64, parent: u64, tokens: [u32; BLOCK_TOKENS], kv: KvBlock) {
        if self.touch(hash) {
            return;
        }
        let size = kv.bytes();
        if size > self.budget {
            return;
        }
        while self.bytes + size > self.budget {
            if !self.evict_oldest() {
                return;
            }
        }
        let tick = self.clock;
        self.clock += 1;
        self.bytes += size;
        self.lru.insert(tick, hash);
        self.children.entry(parent).or_default().push(hash);
        self.blocks.insert(
            hash,
            Entry {
                kv,
                tick,
                parent,
                tokens,
            },
        );
        self.stats.stored_blocks += 1;
    }

    fn evict_oldest(&mut self) -> bool {
        let Some((_, hash)) = self.lru.pop_first() else {
            return false;
        };
        if let Some(e) = self.blocks.remove(&hash) {
            self.bytes -= e.kv.bytes();
            self.stats.evicted_blocks += 1;
            if let Some(siblings) = self.children.get_mut(&e.parent) {
                siblings.retain(|&h| h != hash);
                if siblings.is_empty() {
                    self.children.remove(&e.parent);
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(v: f32) -> KvBlock {
        KvBlock::F32(vec![v; 4].into_boxed_slice()) // 16 bytes
    }

    /// Block `h` after `parent`, its tokens all `h` as u32.
    fn put(c: &mut PrefixCache, h: u64, parent: u64) {
        c.insert(h, parent, [h as u32; BLOCK_TOKENS], block(h as f32));
    }

    #[test]
    fn lookup_finds_the_leading_run_only() {
        let mut c = PrefixCache::new(1 << 20);
        put(&mut c, 1, 0);
        put(&mut c, 2, 1);
        put(&mut c, 4, 3);
        assert_eq!(c.lookup(&[1, 2, 3, 4]), 2);
        assert_eq!(c.lookup(&[3, 4]), 0);
        assert_eq!(c.lookup(&[]), 0);
        assert!(matches!(c.get(2), Some(KvBlock::F32(v)) if v[0] == 2.0));
        c.record(2 * BLOCK_TOKENS, 40);
        c.record(0, 40);
        c.record(0, 0);
        let s = c.stats();
        assert_eq!((s.hits, s.misses), (1, 1));
        assert_eq!(s.reused_tokens, 2 * BLOCK_TOKENS as u64);
        assert_eq!((s.blocks, s.bytes, s.stored_blocks), (3, 48, 3));
    }

    #[test]
    fn a_partial_block_is_found_by_its_parent_and_leading_tokens() {
        let mut c = PrefixCache::new(1 << 20);
        let mut tokens = [0u32; BLOCK_TOKENS];
        for (i, t) in tokens.iter_mut().enumerate() {
            *t = 100 + i as u32;
        }
        c.insert(10, 7, tokens, block(1.0));
        let mut other = tokens;
        other[3] = 999;
        c.insert(11, 7, other, block(2.0));
        c.insert(12, 8, tokens, block(3.0));
        // After parent 7: block 10 matches 5 tokens, block 11 only 3.
        assert_eq!(
            c.partial(7, &[100, 101, 102, 103, 104, 1, 2]),
            Some((10, 5))
        );
        assert_eq!(c.partial(7, &[100, 101, 102, 999, 104]), Some((11, 5)));
        let (h, len) = c.partial(7, &[100, 101]).expect("both begin so");
        assert!(len == 2 && (h == 10 || h == 11));
        // Another parent, no match on the first token, nothing after it.
        assert_eq!(c.partial(8, &[100]), Some((12, 1)));
        assert_eq!(c.partial(7, &[5, 100]), None);
        assert_eq!(c.partial(9, &[100]), None);
        assert_eq!(c.partial(7, &[]), None);
        // At most a block's worth is compared.
        let long: Vec<u32> = tokens.iter().copied().chain([1, 2, 3]).collect();
        assert_eq!(c.partial(8, &long), Some((12, BLOCK_TOKENS)));
    }

    #[test]
    fn the_budget_evicts_the_least_recently_used() {
        let mut c = PrefixCache::new(48);
        for h in 1..=3 {
            put(&mut c, h, h - 1);
        }
        // A lookup of 2 then 1 leaves 3 the oldest, then 2: 1 was touched last.
        assert_eq!(c.lookup(&[1, 2]), 2);
        put(&mut c, 4, 3);
        assert!(c.get(3).is_none());
        assert!(c.get(1).is_some() && c.get(2).is_some() && c.get(4).is_some());
        put(&mut c, 5, 4);
        assert!(
            c.get(2).is_none(),
            "the later block of a run goes before the first"
        );
        assert!(c.get(1).is_some());
        assert_eq!(c.stats().evicted_blocks, 2);
        assert_eq!(c.stats().bytes, 48);
        // Too big for the budget: not stored, nothing evicted.
        c.insert(
            6,
            5,
            [6; BLOCK_TOKENS],
            KvBlock::F32(vec![0.0; 100].into_boxed_slice()),
        );
        assert!(c.get(6).is_none());
        assert_eq!(c.stats().blocks, 3);
    }

    #[test]
    fn a_zero_budget_disables_and_shrinking_evicts() {
        let mut c = PrefixCache::new(0);
        assert!(!c.enabled());
        put(&mut c, 1, 0);
        assert_eq!(c.lookup(&[1]), 0);
        c.record(16, 16);
        assert_eq!(c.stats(), PrefixStats::default());
        let mut c = PrefixCache::new(64);
        for h in 1..=4 {
            put(&mut c, h, 0);
        }
        c.set_budget(32);
        assert_eq!(c.stats().blocks, 2);
        assert!(c.get(3).is_some() && c.get(4).is_some());
        assert_eq!(c.partial(0, &[1]), None, "evicted blocks leave the index");
        assert_eq!(c.partial(0, &[3]), Some((3, 1)));
        c.set_budget(0);
        assert_eq!((c.stats().blocks, c.stats().bytes), (0, 0));
        assert_eq!(c.partial(0, &[3]), None);
    }
}
