//! The prefix index as the spec words it, one entry per block keyed by its chained hash: slow
//! and simple, kept only as the oracle the radix tree is tested against.
//!
//! Semantics pinned here (and matched by [`super::PrefixIndex`]): an add touches every block of
//! the prompt deepest-first (so block 0 ends up most recent), creating missing ones, and only
//! then evicts the least recently touched blocks beyond capacity; lookups touch nothing; a
//! block keeps at most [`super::MAX_HOLDERS_PER_BLOCK`] holders, replacing the first one with
//! the oldest time.

use std::collections::HashMap;

use xxhash_rust::xxh64::xxh64;

use super::MAX_HOLDERS_PER_BLOCK;

/// `h_{i+1} = XXH64(seed, LE64(h_i) ‖ block_i)`, `h_0 = seed` (spec §4.1).
pub fn block_hashes(stream: &[u8], block_size: usize, seed: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut parent = seed;
    for block in stream.chunks_exact(block_size.max(1)) {
        let mut buf = parent.to_le_bytes().to_vec();
        buf.extend_from_slice(block);
        parent = xxh64(&buf, seed);
        out.push(parent);
    }
    out
}

struct Block {
    touched_ms: u64,
    recency: u64,
    /// (model, pod, at_ms) in insertion order.
    holders: Vec<(String, String, u64)>,
}

pub struct ReferenceIndex {
    capacity: usize,
    block_size: usize,
    clock: u64,
    blocks: HashMap<u64, Block>,
}

impl ReferenceIndex {
    pub fn new(capacity: usize, block_size: usize) -> ReferenceIndex {
        ReferenceIndex {
            capacity,
            block_size,
            clock: 0,
            blocks: HashMap::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    fn hashes(&self, stream: &[u8]) -> Vec<u64> {
        block_hashes(stream, self.block_size, 0)
    }

    pub fn add_prefix(&mut self, stream: &[u8], model: &str, pod: &str, now_ms: u64) {
        for hash in self.hashes(stream).into_iter().rev() {
            self.clock += 1;
            let block = self.blocks.entry(hash).or_insert(Block {
                touched_ms: now_ms,
                recency: 0,
                holders: Vec::new(),
            });
            block.touched_ms = now_ms;
            block.recency = self.clock;
            if let Some(h) = block
                .holders
                .iter_mut()
                .find(|h| h.0 == model && h.1 == pod)
            {
                h.2 = now_ms;
            } else if block.holders.len() < MAX_HOLDERS_PER_BLOCK {
                block.holders.push((model.into(), pod.into(), now_ms));
            } else if let Some(oldest) = block.holders.iter_mut().min_by_key(|h| h.2) {
                *oldest = (model.into(), pod.into(), now_ms);
            }
        }
        while self.blocks.len() > self.capacity {
            self.evict_least_recent();
        }
    }

    fn least_recent(&self) -> Option<(u64, &Block)> {
        self.blocks
            .iter()
            .min_by_key(|(_, b)| b.recency)
            .map(|(h, b)| (*h, b))
    }

    fn evict_least_recent(&mut self) {
        if let Some((hash, _)) = self.least_recent() {
            self.blocks.remove(&hash);
        }
    }

    pub fn match_prefix(&self, stream: &[u8], model: &str, candidates: &[&str]) -> Vec<u32> {
        let hashes = self.hashes(stream);
        let n = hashes.len() as u64;
        let mut pct = vec![0u32; candidates.len()];
        let mut walking: Vec<bool> = vec![true; candidates.len()];
        for (i, hash) in hashes.iter().enumerate() {
            let Some(block) = self.blocks.get(hash) else {
                break;
            };
            if !block.holders.iter().any(|h| h.0 == model) {
                break;
            }
            let mut any = false;
            for (slot, cand) in candidates.iter().enumerate() {
                if !walking[slot] {
                    continue;
                }
                if block.holders.iter().any(|h| h.0 == model && h.1 == *cand) {
                    pct[slot] = ((i as u64 + 1) * 100 / n) as u32;
                    any = true;
                } else {
                    walking[slot] = false;
                }
            }
            if !any {
                break;
            }
        }
        pct
    }

    pub fn evict_older_than(&mut self, now_ms: u64, max_age_ms: u64) -> usize {
        let mut evicted = 0;
        while let Some((hash, block)) = self.least_recent() {
            if now_ms.saturating_sub(block.touched_ms) <= max_age_ms {
                break;
            }
            self.blocks.remove(&hash);
            evicted += 1;
        }
        evicted
    }

    pub fn last_access(&self, stream: &[u8], model: &str, pod: &str) -> Option<u64> {
        let hash = *self.hashes(stream).last()?;
        self.blocks
            .get(&hash)?
            .holders
            .iter()
            .find(|h| h.0 == model && h.1 == pod)
            .map(|h| h.2)
    }
}
