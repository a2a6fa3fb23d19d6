//! Prefix affinity: which workers most likely hold the start of a prompt in their prefix
//! cache, so that the router can send a request where its shared prefix (a common system
//! prompt, an earlier turn of the same chat) is already computed.
//!
//! Workers tokenize; the coordinator does not. It therefore keys prompts by their
//! *text*: the prompt is laid out as bytes (chat turns in order, as the template renders
//! them), cut into [`CHUNK_BYTES`]-byte chunks, and each chunk gets a chained hash
//! `kᵢ = xxh3(kᵢ₋₁ ‖ chunkᵢ)` seeded by the model name, so that `kᵢ` names the whole
//! prefix up to chunk *i*. Only whole chunks count: a prompt shorter than one chunk has
//! no keys and is routed by load alone.
//!
//! The [`PrefixIndex`] remembers, for each key, the last few workers a prompt with that
//! prefix was sent to (least recently used keys are evicted past a bound). It is an
//! estimate of the workers' caches — a worker may have evicted a block since — as in
//! routers that keep an approximate radix tree of past requests; a wrong guess costs a
//! prefill, never a wrong answer. Workers that leave are dropped from it.

use std::num::NonZeroUsize;

use baton_common::ids::WorkerId;
use baton_common::protocol::PromptSpec;
use lru::LruCache;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Bytes of prompt text per key.
pub const CHUNK_BYTES: usize = 128;

/// Most keys taken from one prompt (the first 64 KiB of it).
pub const MAX_CHUNKS: usize = 512;

/// Most workers remembered per key.
const HOLDERS: usize = 4;

/// The chained chunk keys of `prompt` for `model`.
pub fn prefix_keys(model: &str, prompt: &PromptSpec) -> Vec<u64> {
    let mut bytes = Vec::new();
    match prompt {
        PromptSpec::Text(text) => {
            bytes.push(b't');
            bytes.extend_from_slice(text.as_bytes());
        }
        PromptSpec::Chat(turns) => {
            bytes.push(b'c');
            for turn in turns {
                bytes.extend_from_slice(turn.role.as_bytes());
                bytes.push(0);
                bytes.extend_from_slice(turn.content.as_bytes());
                bytes.push(0);
                if bytes.len() >= CHUNK_BYTES * MAX_CHUNKS {
                    break;
                }
            }
        }
        PromptSpec::Tokens(ids) => {
            bytes.push(b'k');
            for id in ids.iter().take(CHUNK_BYTES * MAX_CHUNKS / 4) {
                bytes.extend_from_slice(&id.to_le_bytes());
            }
        }
    }
    let mut key = xxh3_64_with_seed(model.as_bytes(), 0);
    let mut buf = Vec::with_capacity(8 + CHUNK_BYTES);
    bytes
        .chunks_exact(CHUNK_BYTES)
        .take(MAX_CHUNKS)
        .map(|chunk| {
            buf.clear();
            buf.extend_from_slice(&key.to_le_bytes());
            buf.extend_from_slice(chunk);
            key = xxh3_64_with_seed(&buf, 0);
            key
        })
        .collect()
}

/// Workers a key was last sent to, most recent first.
#[derive(Debug, Clone, Default)]
struct Holders(Vec<WorkerId>);

impl Holders {
    fn touch(&mut self, worker: WorkerId) {
        self.0.retain(|w| *w != worker);
        self.0.insert(0, worker);
        self.0.truncate(HOLDERS);
    }
}

/// Which workers were sent which prompt prefixes, bounded.
#[derive(Debug)]
pub struct PrefixIndex {
    /// Key → its holders, least recently used evicted first.
    keys: LruCache<u64, Holders>,
}

impl PrefixIndex {
    /// An index of at most `capacity` keys (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            keys: LruCache::new(NonZeroUsize::new(capacity.max(1)).expect("at least one")),
        }
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// For each worker that holds the first key of `keys`: how many leading keys it
    /// holds in a row.
    pub fn matches(&self, keys: &[u64]) -> Vec<(WorkerId, usize)> {
        let Some(first) = keys.first().and_then(|k| self.keys.peek(k)) else {
            return Vec::new();
        };
        // (worker, keys held in a row, still in the run)
        let mut runs: Vec<(WorkerId, usize, bool)> =
            first.0.iter().map(|w| (*w, 1, true)).collect();
        for key in &keys[1..] {
            let Some(holders) = self.keys.peek(key) else {
                break;
            };
            let mut any = false;
            for (worker, n, alive) in runs.iter_mut().filter(|r| r.2) {
                if holders.0.contains(worker) {
                    *n += 1;
                    any = true;
                } else {
                    *alive = false;
                }
            }
            if !any {
                break;
            }
        }
        runs.into_iter().map(|(w, n, _)| (w, n)).collect()
    }

    /// Records that `keys` went to `worker`.
    pub fn record(&mut self, keys: &[u64], worker: WorkerId) {
        for key in keys {
            match self.keys.get_mut(key) {
                Some(holders) => holders.touch(worker),
                None => {
                    let mut holders = Holders::default();
                    holders.touch(worker);
                    self.keys.put(*key, holders);
                }
            }
        }
    }

    /// Drops `worker` from every key (it left; its cache is gone).
    pub fn forget(&mut self, worker: WorkerId) {
        let mut empty = Vec::new();
        for (key, holders) in self.keys.iter_mut() {
            holders.0.retain(|w| *w != worker);
            if holders.0.is_empty() {
                empty.push(*key);
            }
        }
        for key in empty {
            self.keys.pop(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_common::protocol::ChatTurn;

    fn text(n: usize, fill: char) -> String {
        std::iter::repeat_n(fill, n).collect()
    }

    fn chat(system: &str, user: &str) -> PromptSpec {
        PromptSpec::Chat(vec![
            ChatTurn::new("system", system),
            ChatTurn::new("user", user),
        ])
    }

    #[test]
    fn keys_name_whole_prefixes() {
        let a = prefix_keys("m", &PromptSpec::Text(text(1000, 'a')));
        let mut other = text(1000, 'a');
        other.push_str(&text(300, 'b'));
        let b = prefix_keys("m", &PromptSpec::Text(other));
        // 1001 bytes ("t" + text) make 7 whole chunks; the longer prompt shares them.
        assert_eq!(a.len(), 7);
        assert_eq!(b.len(), 10);
        assert_eq!(a[..], b[..7]);
        // A different start changes every key after it; a different model every key.
        let c = prefix_keys("m", &PromptSpec::Text(format!("x{}", text(999, 'a'))));
        assert!(a.iter().zip(&c).all(|(x, y)| x != y));
        let d = prefix_keys("other", &PromptSpec::Text(text(1000, 'a')));
        assert!(a.iter().zip(&d).all(|(x, y)| x != y));
        // Short prompts have no keys.
        assert!(prefix_keys("m", &PromptSpec::Text("hello".into())).is_empty());
        // The cap holds.
        let long = prefix_keys("m", &PromptSpec::Text(text(CHUNK_BYTES * 600, 'z')));
        assert_eq!(long.len(), MAX_CHUNKS);
    }

    #[test]
    fn chats_with_one_system_prompt_share_its_keys() {
        let system = text(600, 's');
        let a = prefix_keys("m", &chat(&system, "first question"));
        let b = prefix_keys("m", &chat(&system, "a quite different second question"));
        // The system prompt alone fills 4 whole chunks ("c" + "system\0" + 600 bytes).
        assert!(a.len() >= 4 && b.len() >= 4);
        assert_eq!(a[..4], b[..4]);
        // Text and chat prompts never share keys.
        let t = prefix_keys("m", &PromptSpec::Text(format!("system\0{system}")));
        assert_ne!(a[0], t[0]);
    }

    #[test]
    fn matches_count_leading_keys_per_worker() {
        let mut index = PrefixIndex::new(1000);
        let keys: Vec<u64> = (1..=6).collect();
        index.record(&keys[..2], WorkerId(1));
        index.record(&keys[..5], WorkerId(2));
        // Worker 3 holds keys 1 and 3 but not 2: only its first counts.
        index.record(&[1, 3], WorkerId(3));
        let mut m = index.matches(&keys);
        m.sort();
        assert_eq!(
            m,
            vec![(WorkerId(1), 2), (WorkerId(2), 5), (WorkerId(3), 1)]
        );
        // Nobody holds the first key: no match at all.
        assert!(index.matches(&[99, 1, 2]).is_empty());
        assert!(index.matches(&[]).is_empty());
    }

    #[test]
    fn forgotten_workers_and_evicted_keys_match_nothing() {
        let mut index = PrefixIndex::new(4);
        index.record(&[1, 2], WorkerId(1));
        index.record(&[1, 2], WorkerId(2));
        index.forget(WorkerId(1));
        assert_eq!(index.matches(&[1, 2]), vec![(WorkerId(2), 2)]);
        index.forget(WorkerId(2));
        assert!(index.is_empty());
        // Capacity 4: the oldest keys go first.
        index.record(&[1, 2, 3, 4, 5, 6], WorkerId(7));
        assert_eq!(index.len(), 4);
        assert!(index.matches(&[1, 2]).is_empty());
        assert_eq!(index.matches(&[3, 4, 5]), vec![(WorkerId(7), 3)]);
    }

    #[test]
    fn a_key_remembers_its_last_few_workers() {
        let mut index = PrefixIndex::new(10);
        for w in 1..=6 {
            index.record(&[42], WorkerId(w));
        }
        let mut m = index.matches(&[42]);
        m.sort();
        let workers: Vec<u128> = m.iter().map(|(w, _)| w.0).collect();
        assert_eq!(workers, vec![3, 4, 5, 6]);
    }
}
