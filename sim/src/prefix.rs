//! A per-pod prefix cache over KV blocks, so that prefill cost depends on what the pod has
//! already seen. Without it a prefix-affinity routing policy could not be told apart from a
//! random one on simulated pods.
//!
//! Blocks are runs of [`BLOCK_SIZE_TOKENS`] × [`CHARS_PER_TOKEN`] characters of prompt text,
//! hashed as a chain (each hash covers the whole prefix up to its block), like vLLM's
//! block hashes. Only full blocks are cached. Eviction is least-recently-used.

use std::collections::{BTreeMap, HashMap};

use crate::engine::{fnv1a, BLOCK_SIZE_TOKENS, CHARS_PER_TOKEN};

/// Characters per cached block.
const BLOCK_CHARS: usize = (BLOCK_SIZE_TOKENS * CHARS_PER_TOKEN) as usize;
const CHAIN_SEED: u64 = 0x6a09_e667_f3bc_c908;

/// Chained hashes of the full blocks of `text`.
pub fn block_hashes(text: &str) -> Vec<u64> {
    let chars: Vec<char> = text.chars().collect();
    let mut parent = CHAIN_SEED;
    let mut buf = [0u8; 4];
    chars
        .chunks_exact(BLOCK_CHARS)
        .map(|block| {
            let mut h = fnv1a(parent, &parent.to_le_bytes());
            for c in block {
                h = fnv1a(h, c.encode_utf8(&mut buf).as_bytes());
            }
            parent = h;
            h
        })
        .collect()
}

/// LRU set of block hashes with a fixed capacity in blocks.
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    tick: u64,
    /// hash → last use tick.
    last_use: HashMap<u64, u64>,
    /// last use tick → hash; the first entry is the eviction victim.
    by_age: BTreeMap<u64, u64>,
}

impl PrefixCache {
    /// A cache holding at most `capacity` blocks; 0 disables caching.
    pub fn new(capacity: usize) -> Self {
        PrefixCache {
            capacity,
            tick: 0,
            last_use: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    /// Number of leading blocks of `hashes` present in the cache.
    pub fn matched_blocks(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.last_use.contains_key(h))
            .count()
    }

    /// Looks `hashes` up (leading blocks hit), then records all of them as most recently used.
    /// Returns the number of hit blocks.
    pub fn lookup_and_insert(&mut self, hashes: &[u64]) -> usize {
        let hit = self.matched_blocks(hashes);
        self.insert(hashes);
        hit
    }

    /// Records `hashes` as most recently used, evicting the oldest blocks beyond capacity.
    pub fn insert(&mut self, hashes: &[u64]) {
        if self.capacity == 0 {
            return;
        }
        for h in hashes {
            self.tick += 1;
            if let Some(old) = self.last_use.insert(*h, self.tick) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(self.tick, *h);
        }
        while self.last_use.len() > self.capacity {
            let Some((_, victim)) = self.by_age.pop_first() else {
                break;
            };
            self.last_use.remove(&victim);
        }
    }

    /// Blocks currently cached.
    pub fn len(&self) -> usize {
        self.last_use.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.last_use.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_over_full_blocks_only() {
        let a = "a".repeat(BLOCK_CHARS * 2 + 10);
        assert_eq!(
            block_hashes(&a).len(),
            2,
            "the trailing partial block is not hashed"
        );
        assert!(block_hashes(&"a".repeat(BLOCK_CHARS - 1)).is_empty());
        let mut b = "a".repeat(BLOCK_CHARS);
        b.push_str(&"b".repeat(BLOCK_CHARS));
        let mut c = "c".repeat(BLOCK_CHARS);
        c.push_str(&"b".repeat(BLOCK_CHARS));
        let (hb, hc) = (block_hashes(&b), block_hashes(&c));
        assert_ne!(
            hb[1], hc[1],
            "same block after a different prefix hashes differently"
        );
        assert_eq!(block_hashes(&a)[0], hb[0]);
    }

    #[test]
    fn leading_hits_then_lru_eviction() {
        let mut cache = PrefixCache::new(3);
        assert_eq!(cache.lookup_and_insert(&[1, 2]), 0);
        assert_eq!(cache.lookup_and_insert(&[1, 2, 3]), 2);
        assert_eq!(cache.matched_blocks(&[2, 3]), 2);
        assert_eq!(
            cache.matched_blocks(&[9, 1]),
            0,
            "only a leading run counts"
        );
        cache.insert(&[4]); // evicts 1, the oldest
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.matched_blocks(&[1]), 0);
        assert_eq!(cache.matched_blocks(&[2, 3, 4]), 3);
    }

    #[test]
    fn zero_capacity_disables() {
        let mut cache = PrefixCache::new(0);
        cache.insert(&[1]);
        assert!(cache.is_empty());
        assert_eq!(cache.lookup_and_insert(&[1]), 0);
    }
}
