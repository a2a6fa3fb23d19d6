//! The prefix cache: keys and values of prompt blocks, kept across requests.
//!
//! Requests often share the start of their prompt (a long system prompt, earlier turns
//! of a chat). The chain's block hash after every [`BLOCK_TOKENS`] tokens names the KV
//! state up to it ([`baton_common::chain`]), so the cache maps a block hash to the keys
//! and values of that block's positions, every layer. A sequence that starts copies the
//! cached blocks of its longest cached leading run into its own KV cache and runs only
//! the rest of its prompt through the model.
//!
//! Memory is bounded by a byte budget; when a new block does not fit, the least recently
//! used blocks go first. A sequence touches its blocks last to first, so that within one
//! prefix the later blocks are evicted before the earlier ones: a run is only usable from
//! its first block, and evicting its first block would strand the rest.
//!
//! The cache does not know the layout of a block's values; [`super::llama::KvCache`]
//! packs and unpacks them.

use std::collections::{BTreeMap, HashMap};

pub use baton_common::chain::BLOCK_TOKENS;

/// What the prefix cache did since the engine started, and what it holds now.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PrefixStats {
    /// Sequences that started from at least one cached block.
    pub hits: u64,
    /// Sequences with at least one full block before their last prompt token that
    /// found none cached.
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

/// One block's keys and values.
struct Entry {
    /// Keys and values of the block's positions, every layer, in the cache's layout.
    kv: Box<[f32]>,
    /// Last use, on the cache's clock; the key of this block in [`PrefixCache::lru`].
    tick: u64,
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

    /// How many leading blocks of `hashes` are cached; marks them used and counts a hit
    /// or a miss (nothing when `hashes` is empty).
    pub fn lookup(&mut self, hashes: &[u64]) -> usize {
        if hashes.is_empty() || !self.enabled() {
            return 0;
        }
        let n = hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        for &h in hashes[..n].iter().rev() {
            self.touch(h);
        }
        if n > 0 {
            self.stats.hits += 1;
            self.stats.reused_tokens += (n * BLOCK_TOKENS) as u64;
        } else {
            self.stats.misses += 1;
        }
        n
    }

    /// The values of a cached block.
    pub fn get(&self, hash: u64) -> Option<&[f32]> {
        self.blocks.get(&hash).map(|e| &*e.kv)
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

    /// Stores a block (as the most recently used), evicting the least recently used
    /// blocks until it fits. A block larger than the whole budget is not stored.
    pub fn insert(&mut self, hash: u64, kv: Box<[f32]>) {
        if self.touch(hash) {
            return;
        }
        let size = std::mem::size_of_val(&*kv);
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
        self.blocks.insert(hash, Entry { kv, tick });
        self.stats.stored_blocks += 1;
    }

    fn evict_oldest(&mut self) -> bool {
        let Some((_, hash)) = self.lru.pop_first() else {
            return false;
        };
        if let Some(e) = self.blocks.remove(&hash) {
            self.bytes -= std::mem::size_of_val(&*e.kv);
            self.stats.evicted_blocks += 1;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(v: f32) -> Box<[f32]> {
        vec![v; 4].into_boxed_slice() // 16 bytes
    }

    #[test]
    fn lookup_finds_the_leading_run_only() {
        let mut c = PrefixCache::new(1 << 20);
        c.insert(1, block(1.0));
        c.insert(2, block(2.0));
        c.insert(4, block(4.0));
        assert_eq!(c.lookup(&[1, 2, 3, 4]), 2);
        assert_eq!(c.lookup(&[3, 4]), 0);
        assert_eq!(c.lookup(&[]), 0);
        assert_eq!(c.get(2).map(|v| v[0]), Some(2.0));
        let s = c.stats();
        assert_eq!((s.hits, s.misses), (1, 1));
        assert_eq!(s.reused_tokens, 2 * BLOCK_TOKENS as u64);
        assert_eq!((s.blocks, s.bytes, s.stored_blocks), (3, 48, 3));
    }

    #[test]
    fn the_budget_evicts_the_least_recently_used() {
        let mut c = PrefixCache::new(48);
        for h in 1..=3 {
            c.insert(h, block(h as f32));
        }
        // A lookup of 2 then 1 leaves 3 the oldest, then 2: 1 was touched last.
        assert_eq!(c.lookup(&[1, 2]), 2);
        c.insert(4, block(4.0));
        assert_eq!(c.get(3), None);
        assert!(c.get(1).is_some() && c.get(2).is_some() && c.get(4).is_some());
        c.insert(5, block(5.0));
        assert_eq!(
            c.get(2),
            None,
            "the later block of a run goes before the first"
        );
        assert!(c.get(1).is_some());
        assert_eq!(c.stats().evicted_blocks, 2);
        assert_eq!(c.stats().bytes, 48);
        // Too big for the budget: not stored, nothing evicted.
        c.insert(6, vec![0.0; 100].into_boxed_slice());
        assert_eq!(c.get(6), None);
        assert_eq!(c.stats().blocks, 3);
    }

    #[test]
    fn a_zero_budget_disables_and_shrinking_evicts() {
        let mut c = PrefixCache::new(0);
        assert!(!c.enabled());
        c.insert(1, block(1.0));
        assert_eq!(c.lookup(&[1]), 0);
        assert_eq!(c.stats(), PrefixStats::default());
        let mut c = PrefixCache::new(64);
        for h in 1..=4 {
            c.insert(h, block(0.0));
        }
        c.set_budget(32);
        assert_eq!(c.stats().blocks, 2);
        assert!(c.get(3).is_some() && c.get(4).is_some());
        c.set_budget(0);
        assert_eq!((c.stats().blocks, c.stats().bytes), (0, 0));
    }
}
