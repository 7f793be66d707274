//! The prefix index of spec §4.1: which pods recently prefilled which prompt prefixes.
//!
//! A prompt's token stream is cut into fixed-size blocks and hashed as a chain, so one hash
//! names a whole prefix. The index maps each hash to the (model, pod) pairs that served it and
//! answers "how much of this prompt does each candidate pod already have", which the
//! `prefix_cache`, `conductor` and `hybrid_cache_load` prefill policies turn into scores.
//!
//! Each Envoy worker holds its own index. The worker that routed a request learns the prefix,
//! applies it locally and broadcasts a [`PrefixEvent`] to the other workers, which apply it too.

use hashbrown::HashMap;
use xxhash_rust::xxh64::Xxh64;

/// `AIBRIX_PREFIX_CACHE_BLOCK_SIZE` default, in bytes of the token stream.
pub const DEFAULT_BLOCK_SIZE: usize = 4;
/// `AIBRIX_PREFIX_CACHE_BLOCK_NUMBER` default: the LRU capacity in blocks.
pub const DEFAULT_BLOCK_NUMBER: usize = 200_000;
/// `AIBRIX_PREFIX_CACHE_EVICTION_INTERVAL_SECONDS` default: how often to sweep by age.
pub const DEFAULT_EVICTION_INTERVAL_MS: u64 = 1_000;
/// `AIBRIX_PREFIX_CACHE_EVICTION_DURATION_MINS` default (20 min): idle age that evicts a block.
pub const DEFAULT_EVICTION_AGE_MS: u64 = 20 * 60 * 1_000;
/// At most this many (model, pod) holders are kept per block; a new one replaces the least
/// recently seen. AIBrix has no cap, but then a block that stays hot forever would collect
/// every pod name that ever served it, and pods get new names on every rollout. Below the cap
/// the behaviour is AIBrix's.
pub const MAX_HOLDERS_PER_BLOCK: usize = 64;

/// The prefix hash chain of a token stream: `h_0 = seed`,
/// `h_{i+1} = XXH64(seed, LE64(h_i) ‖ block_i)`, returning `[h_1 … h_n]`.
///
/// A trailing partial block is ignored, so a stream shorter than one block has no hashes.
/// `block_size` 0 also gives none (the env loader never yields 0; this avoids a panic).
pub fn block_hashes(stream: &[u8], block_size: usize, seed: u64) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(stream.len() / block_size);
    let mut parent = seed;
    let mut digest = Xxh64::new(seed);
    for block in stream.chunks_exact(block_size) {
        digest.reset(seed);
        digest.update(&parent.to_le_bytes());
        digest.update(block);
        parent = digest.digest();
        out.push(parent);
    }
    out
}

/// The hash seed from `AIBRIX_PREFIX_CACHE_HASH_SEED` (`value`, `None` when unset): a valid
/// decimal `u64` is used as is. Unset, empty or invalid gives 0 when state sync is on (so
/// replicas agree) and `random` otherwise (a per-process seed, as in AIBrix).
///
/// "Valid" follows Go's `strconv.ParseUint(v, 10, 64)`: ASCII digits only, no sign, no
/// spaces, no overflow.
pub fn hash_seed_from_env(value: Option<&str>, statesync: bool, random: u64) -> u64 {
    let parsed = value
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse::<u64>().ok());
    match parsed {
        Some(seed) => seed,
        None if statesync => 0,
        None => random,
    }
}

/// The prefix-index settings of the gateway environment (`AIBRIX_PREFIX_CACHE_*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixSettings {
    pub tokenizer: crate::core::tokenize::TokenizerKind,
    pub block_size: usize,
    pub capacity: usize,
    pub eviction_interval_ms: u64,
    pub eviction_age_ms: u64,
    /// `AIBRIX_PREFIX_CACHE_HASH_SEED` when set and valid.
    pub seed: Option<u64>,
    /// `AIBRIX_STATESYNC_ENABLED`: an unset seed is then 0, not random.
    pub statesync: bool,
}

impl Default for PrefixSettings {
    fn default() -> Self {
        PrefixSettings {
            tokenizer: crate::core::tokenize::TokenizerKind::Character,
            block_size: DEFAULT_BLOCK_SIZE,
            capacity: DEFAULT_BLOCK_NUMBER,
            eviction_interval_ms: DEFAULT_EVICTION_INTERVAL_MS,
            eviction_age_ms: DEFAULT_EVICTION_AGE_MS,
            seed: None,
            statesync: false,
        }
    }
}

impl PrefixSettings {
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> (PrefixSettings, Vec<String>) {
        let d = PrefixSettings::default();
        let mut r = crate::core::env::EnvReader::new(get);
        let tokenizer = crate::core::tokenize::TokenizerKind::from_env(
            r.string("AIBRIX_PREFIX_CACHE_TOKENIZER_TYPE").as_deref(),
        );
        let block_size = r.count("AIBRIX_PREFIX_CACHE_BLOCK_SIZE", d.block_size as u64) as usize;
        let capacity = r.count("AIBRIX_PREFIX_CACHE_BLOCK_NUMBER", d.capacity as u64) as usize;
        let interval_s = r.count(
            "AIBRIX_PREFIX_CACHE_EVICTION_INTERVAL_SECONDS",
            d.eviction_interval_ms / 1000,
        );
        let age_min = r.count(
            "AIBRIX_PREFIX_CACHE_EVICTION_DURATION_MINS",
            d.eviction_age_ms / 60_000,
        );
        let statesync = r.bool("AIBRIX_STATESYNC_ENABLED", false);
        let raw_seed = r.string("AIBRIX_PREFIX_CACHE_HASH_SEED");
        let seed = raw_seed
            .as_deref()
            .map(|v| hash_seed_from_env(Some(v), true, 0));
        if raw_seed.is_some() && seed == Some(0) && raw_seed.as_deref() != Some("0") {
            r.warnings.push(format!("AIBRIX_PREFIX_CACHE_HASH_SEED={raw_seed:?} is not a u64; using a shared random seed"));
        }
        let seed = seed.filter(|s| *s != 0 || raw_seed.as_deref() == Some("0"));
        let settings = PrefixSettings {
            tokenizer,
            block_size,
            capacity,
            eviction_interval_ms: interval_s * 1000,
            eviction_age_ms: age_min * 60_000,
            seed,
            statesync,
        };
        (settings, r.warnings)
    }
}

/// `AIBRIX_MIN_MATCH_PCT`: a match below the threshold counts as no match. A threshold of 0
/// turns the rule off (no percentage is below 0).
pub fn apply_min_match(pct: u32, min_match_pct: u32) -> u32 {
    if pct < min_match_pct {
        0
    } else {
        pct
    }
}

/// End of a slab list.
const NIL: u32 = u32::MAX;

/// Hashes the index's keys, which are XXH64 outputs already: one multiply spreads them over
/// the table's bucket and tag bits (a general-purpose hasher would hash a hash again, and the
/// index does three map operations per block of every prompt).
#[derive(Debug, Clone, Copy, Default)]
struct BlockKeyHasher(u64);

impl std::hash::Hasher for BlockKeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed; keep any other input well defined all the same.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, key: u64) {
        self.0 = (key ^ (key >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type BlockKeys = std::hash::BuildHasherDefault<BlockKeyHasher>;

#[derive(Debug, Clone, Copy)]
struct Holder {
    model: u32,
    pod: u32,
    at_ms: u64,
}

/// One block in the LRU: a slab entry linked most-recent-first.
#[derive(Debug)]
struct Node {
    hash: u64,
    prev: u32,
    next: u32,
    /// Time of the last `add_prefix` that touched the block; the age sweep reads it.
    touched_ms: u64,
    holders: Vec<Holder>,
}

/// Model and pod names, interned so a block stores two `u32`s per holder. Reference-counted
/// by holders, so names of pods that left the fleet are freed with their last block.
#[derive(Debug, Default)]
struct Names {
    ids: HashMap<Box<str>, u32>,
    slots: Vec<(Box<str>, usize)>,
    free: Vec<u32>,
}

impl Names {
    fn get(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// The id of `name`, with one more reference.
    fn acquire(&mut self, name: &str) -> u32 {
        if let Some(id) = self.get(name) {
            self.add_ref(id);
            return id;
        }
        let id = match self.free.pop() {
            Some(id) => {
                self.slots[id as usize] = (name.into(), 1);
                id
            }
            None => {
                // Fewer names than blocks ever exist, and the block count fits in u32.
                let id = u32::try_from(self.slots.len()).unwrap_or(NIL);
                self.slots.push((name.into(), 1));
                id
            }
        };
        self.ids.insert(name.into(), id);
        id
    }

    fn add_ref(&mut self, id: u32) {
        if let Some(slot) = self.slots.get_mut(id as usize) {
            slot.1 += 1;
        }
    }

    fn release(&mut self, id: u32) {
        let Some(slot) = self.slots.get_mut(id as usize) else {
            return;
        };
        slot.1 = slot.1.saturating_sub(1);
        if slot.1 == 0 {
            let name = std::mem::take(&mut slot.0);
            self.ids.remove(&name);
            self.free.push(id);
        }
    }

    fn len(&self) -> usize {
        self.ids.len()
    }
}

/// LRU map `hash → {model → {pod → last access ms}}` with AIBrix's `AddPrefix`/`MatchPrefix`
/// semantics.
///
/// Blocks live in a slab (`Vec`) linked most-recent-first, found through a `hash → slot` map,
/// so capacity eviction is O(1) and the age sweep only visits the blocks it removes. Memory is
/// bounded by the capacity: on wasm32 a block with one holder costs about 90 bytes, so the
/// default 200 000 blocks is roughly 18 MB per index when full.
#[derive(Debug)]
pub struct PrefixIndex {
    capacity: usize,
    slots: HashMap<u64, u32, BlockKeys>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Most recently added block.
    head: u32,
    /// Least recently added block: evicted first.
    tail: u32,
    names: Names,
}

impl PrefixIndex {
    /// An empty index holding at most `capacity` blocks (AIBrix keeps none at capacity 0).
    pub fn new(capacity: usize) -> PrefixIndex {
        PrefixIndex {
            // Slab indices are u32 with one value reserved for NIL.
            capacity: capacity.min(NIL as usize - 1),
            slots: HashMap::default(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            names: Names::default(),
        }
    }

    /// Number of blocks held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Records that `pod` served `hashes` for `model` at `now_ms`: every block gets the pod
    /// with that time, and becomes most recently used (created if missing, evicting the least
    /// recently used block beyond capacity).
    ///
    /// Blocks are touched last-to-first, so a prompt's first block ends up the most recent.
    /// AIBrix touches them first-to-last; this order differs only in which blocks of one
    /// prompt go first under capacity pressure, and losing the tail keeps a partial match
    /// where losing block 0 would lose all of it.
    pub fn add_prefix(&mut self, hashes: &[u64], model: &str, pod: &str, now_ms: u64) {
        if hashes.is_empty() {
            return;
        }
        // Held for the whole call so evictions below cannot free the ids in use.
        let model_id = self.names.acquire(model);
        let pod_id = self.names.acquire(pod);
        for &hash in hashes.iter().rev() {
            match self.slots.get(&hash) {
                Some(&idx) => {
                    self.refresh(idx, model_id, pod_id, now_ms);
                    self.unlink(idx);
                    self.push_front(idx);
                }
                None => {
                    self.names.add_ref(model_id);
                    self.names.add_ref(pod_id);
                    let holder = Holder {
                        model: model_id,
                        pod: pod_id,
                        at_ms: now_ms,
                    };
                    let idx = self.alloc(hash, now_ms, holder);
                    self.slots.insert(hash, idx);
                    self.push_front(idx);
                    while self.slots.len() > self.capacity {
                        self.evict_tail();
                    }
                }
            }
        }
        self.names.release(model_id);
        self.names.release(pod_id);
    }

    /// Consecutive-prefix match percentage of each candidate, in the order given (0 for a pod
    /// that holds no prefix).
    ///
    /// Walks the blocks from the start and stops at the first block that is missing, has no
    /// holder for `model`, or is held by none of the candidates still in the walk. At block
    /// `i` (0-based) of `n`, each remaining candidate holding it gets `(i+1)·100/n` (integer
    /// division); one that does not hold it leaves the walk for good, keeping its last value.
    /// Lookups do not refresh blocks.
    pub fn match_prefix(&self, hashes: &[u64], model: &str, candidates: &[&str]) -> Vec<u32> {
        let mut pct = vec![0u32; candidates.len()];
        let n = hashes.len() as u64;
        if n == 0 || candidates.is_empty() {
            return pct;
        }
        let Some(model_id) = self.names.get(model) else {
            return pct;
        };
        // Candidates still in the walk; NIL once dropped (or never indexed).
        let mut walking: Vec<u32> = candidates
            .iter()
            .map(|c| self.names.get(c).unwrap_or(NIL))
            .collect();
        for (i, hash) in hashes.iter().enumerate() {
            let Some(&idx) = self.slots.get(hash) else {
                break;
            };
            let holders = &self.nodes[idx as usize].holders;
            if !holders.iter().any(|h| h.model == model_id) {
                break;
            }
            let block_pct = ((i as u64 + 1) * 100 / n) as u32;
            let mut any = false;
            for (slot, pod) in walking.iter_mut().enumerate() {
                if *pod == NIL {
                    continue;
                }
                if holders.iter().any(|h| h.model == model_id && h.pod == *pod) {
                    pct[slot] = block_pct;
                    any = true;
                } else {
                    *pod = NIL;
                }
            }
            if !any {
                break;
            }
        }
        pct
    }

    /// Removes blocks not touched by `add_prefix` for more than `max_age_ms` (strictly, as
    /// AIBrix) and returns how many went.
    ///
    /// The sweep walks from the least recent block and stops at the first young one, so it
    /// costs only what it removes. Blocks are ordered by when they were added; an event from
    /// another worker that arrives late carries an older time and sits ahead of younger blocks,
    /// so it may outlive its age by at most the age of the blocks behind it.
    pub fn evict_older_than(&mut self, now_ms: u64, max_age_ms: u64) -> usize {
        let mut evicted = 0;
        while self.tail != NIL {
            let touched = self.nodes[self.tail as usize].touched_ms;
            if now_ms.saturating_sub(touched) <= max_age_ms {
                break;
            }
            self.evict_tail();
            evicted += 1;
        }
        evicted
    }

    /// When `pod` last served the block `hash` for `model`, if it holds it.
    pub fn last_access(&self, hash: u64, model: &str, pod: &str) -> Option<u64> {
        let idx = *self.slots.get(&hash)?;
        let (model, pod) = (self.names.get(model)?, self.names.get(pod)?);
        self.nodes[idx as usize]
            .holders
            .iter()
            .find(|h| h.model == model && h.pod == pod)
            .map(|h| h.at_ms)
    }

    /// Number of distinct model and pod names referenced (a memory check for tests and stats).
    pub fn name_count(&self) -> usize {
        self.names.len()
    }

    fn refresh(&mut self, idx: u32, model: u32, pod: u32, now_ms: u64) {
        let node = &mut self.nodes[idx as usize];
        node.touched_ms = now_ms;
        if let Some(h) = node
            .holders
            .iter_mut()
            .find(|h| h.model == model && h.pod == pod)
        {
            h.at_ms = now_ms;
            return;
        }
        let holder = Holder {
            model,
            pod,
            at_ms: now_ms,
        };
        if node.holders.len() < MAX_HOLDERS_PER_BLOCK {
            node.holders.push(holder);
            self.names.add_ref(model);
            self.names.add_ref(pod);
            return;
        }
        let oldest = node
            .holders
            .iter_mut()
            .min_by_key(|h| h.at_ms)
            .map(|h| std::mem::replace(h, holder));
        if let Some(old) = oldest {
            self.names.add_ref(model);
            self.names.add_ref(pod);
            self.names.release(old.model);
            self.names.release(old.pod);
        }
    }

    /// A node for a new block; a freed slot keeps its holder list's allocation, so a full
    /// index (the steady state: every new block evicts one) allocates nothing per block.
    fn alloc(&mut self, hash: u64, now_ms: u64, holder: Holder) -> u32 {
        match self.free.pop() {
            Some(idx) => {
                let node = &mut self.nodes[idx as usize];
                node.hash = hash;
                node.prev = NIL;
                node.next = NIL;
                node.touched_ms = now_ms;
                node.holders.clear();
                node.holders.push(holder);
                idx
            }
            None => {
                let node = Node {
                    hash,
                    prev: NIL,
                    next: NIL,
                    touched_ms: now_ms,
                    holders: vec![holder],
                };
                // Below NIL: the slab never exceeds capacity + 1 nodes, and capacity < NIL - 1.
                let idx = self.nodes.len() as u32;
                self.nodes.push(node);
                idx
            }
        }
    }

    fn evict_tail(&mut self) {
        let idx = self.tail;
        if idx == NIL {
            return;
        }
        self.unlink(idx);
        let node = &mut self.nodes[idx as usize];
        let hash = node.hash;
        // Drained in place: the slot's list keeps its capacity for the next block.
        for h in node.holders.drain(..) {
            self.names.release(h.model);
            self.names.release(h.pod);
        }
        self.slots.remove(&hash);
        self.free.push(idx);
    }

    fn unlink(&mut self, idx: u32) {
        let (prev, next) = {
            let n = &self.nodes[idx as usize];
            (n.prev, n.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
        let n = &mut self.nodes[idx as usize];
        n.prev = NIL;
        n.next = NIL;
    }

    fn push_front(&mut self, idx: u32) {
        let old = self.head;
        {
            let n = &mut self.nodes[idx as usize];
            n.prev = NIL;
            n.next = old;
        }
        if old == NIL {
            self.tail = idx;
        } else {
            self.nodes[old as usize].prev = idx;
        }
        self.head = idx;
    }
}

/// Why a [`PrefixEvent`] could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EventError {
    #[error("prefix event is truncated")]
    Truncated,
    #[error("prefix event has unknown version {0}")]
    Version(u8),
    #[error("prefix event has a malformed length")]
    Varint,
    #[error("prefix event names are not UTF-8")]
    Utf8,
    #[error("prefix event has {0} trailing bytes")]
    Trailing(usize),
}

/// "`pod` served `hashes` for `model` at `at_ms`": what a worker broadcasts to the others after
/// a selection, so every worker's index learns the prefix (applied with
/// [`PrefixIndex::add_prefix`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixEvent {
    pub model: String,
    pub pod: String,
    pub hashes: Vec<u64>,
    pub at_ms: u64,
}

/// Wire format version, the first byte of an encoded event.
const EVENT_VERSION: u8 = 1;

impl PrefixEvent {
    /// `version u8 ‖ varint at_ms ‖ varint len ‖ model ‖ varint len ‖ pod ‖ varint count ‖
    /// count × u64 LE`. Varints are LEB128; hashes are fixed-width because they are uniformly
    /// random.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            1 + 10 * 4 + self.model.len() + self.pod.len() + 8 * self.hashes.len(),
        );
        out.push(EVENT_VERSION);
        put_varint(&mut out, self.at_ms);
        put_varint(&mut out, self.model.len() as u64);
        out.extend_from_slice(self.model.as_bytes());
        put_varint(&mut out, self.pod.len() as u64);
        out.extend_from_slice(self.pod.as_bytes());
        put_varint(&mut out, self.hashes.len() as u64);
        for h in &self.hashes {
            out.extend_from_slice(&h.to_le_bytes());
        }
        out
    }

    /// Parses an encoded event; any corruption is an error, never a panic or a huge allocation
    /// (lengths are checked against the remaining bytes before anything is allocated).
    pub fn decode(bytes: &[u8]) -> Result<PrefixEvent, EventError> {
        let mut r = Reader { bytes, pos: 0 };
        let version = r.take(1)?[0];
        if version != EVENT_VERSION {
            return Err(EventError::Version(version));
        }
        let at_ms = r.varint()?;
        let model = r.string()?;
        let pod = r.string()?;
        let count = r.len()?;
        let raw = r.take(count.checked_mul(8).ok_or(EventError::Truncated)?)?;
        let hashes = raw
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                u64::from_le_bytes(b)
            })
            .collect();
        let rest = bytes.len() - r.pos;
        if rest != 0 {
            return Err(EventError::Trailing(rest));
        }
        Ok(PrefixEvent {
            model,
            pod,
            hashes,
            at_ms,
        })
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EventError> {
        let end = self.pos.checked_add(n).ok_or(EventError::Truncated)?;
        let s = self.bytes.get(self.pos..end).ok_or(EventError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    fn varint(&mut self) -> Result<u64, EventError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(EventError::Varint);
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(EventError::Varint)
    }

    /// A length, which must fit in what is left of the input.
    fn len(&mut self) -> Result<usize, EventError> {
        let v = self.varint()?;
        let n = usize::try_from(v).map_err(|_| EventError::Truncated)?;
        if n > self.bytes.len() - self.pos {
            return Err(EventError::Truncated);
        }
        Ok(n)
    }

    fn string(&mut self) -> Result<String, EventError> {
        let n = self.len()?;
        let raw = self.take(n)?;
        std::str::from_utf8(raw)
            .map(str::to_owned)
            .map_err(|_| EventError::Utf8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh64::xxh64;

    /// The chain computed the long way: one-shot XXH64 over `LE64(parent) ‖ block`.
    fn reference_chain(stream: &[u8], block_size: usize, seed: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let mut parent = seed;
        let mut i = 0;
        while i + block_size <= stream.len() {
            let mut buf = parent.to_le_bytes().to_vec();
            buf.extend_from_slice(&stream[i..i + block_size]);
            parent = xxh64(&buf, seed);
            out.push(parent);
            i += block_size;
        }
        out
    }

    #[test]
    fn hash_chain_matches_one_shot_xxh64() {
        let streams: [&[u8]; 5] = [
            b"",
            b"abc",
            b"hello world!",
            "数据分析显示增长 🚀 and some ASCII".as_bytes(),
            &[0u8; 1000],
        ];
        for stream in streams {
            for block_size in [1, 2, 3, 4, 7, 16, 128] {
                for seed in [0, 1, 42, u64::MAX] {
                    assert_eq!(
                        block_hashes(stream, block_size, seed),
                        reference_chain(stream, block_size, seed),
                        "{stream:?} {block_size} {seed}"
                    );
                }
            }
        }
    }

    #[test]
    fn hash_chain_pinned_vectors() {
        // Computed with Python's `xxhash` package (the C reference implementation).
        let cases: &[(&[u8], usize, u64, &[u64])] = &[
            (
                b"hello world!",
                4,
                0,
                &[0x7994d67195b55e07, 0xcce9e2c8a4d4cb6b, 0xfc99f3565554cb1c],
            ),
            (
                b"hello world!",
                4,
                42,
                &[0x4fa1534a808a9d24, 0x3964bc2155b5ff89, 0x156839096e62c63a],
            ),
            (b"abcdefgh", 8, u64::MAX, &[0x829275eb0d538d06]),
            (
                "数据分析".as_bytes(),
                3,
                7,
                &[
                    0x4704eba656e65176,
                    0x3ceccaca1dfa0aaf,
                    0x999d105415d07fe5,
                    0xbf7f00ef6d8d58a9,
                ],
            ),
        ];
        for (stream, block_size, seed, want) in cases {
            assert_eq!(block_hashes(stream, *block_size, *seed), *want);
        }
        assert_eq!(xxh64(b"", 0), 0xef46db3751d8e999);
    }

    #[test]
    fn partial_blocks_are_ignored() {
        let cases: &[(&[u8], usize, usize)] = &[
            (b"", 4, 0),
            (b"abc", 4, 0),
            (b"abcd", 4, 1),
            (b"abcdefg", 4, 1),
            (b"abcdefgh", 4, 2),
            (b"abcdefgh", 0, 0),
            (b"abcdefgh", 9, 0),
        ];
        for (stream, block_size, n) in cases {
            assert_eq!(block_hashes(stream, *block_size, 5).len(), *n, "{stream:?}");
        }
        // A chain is a prefix of any longer stream's chain, and a trailing partial block
        // changes nothing.
        let short = block_hashes(b"abcdefgh", 4, 9);
        assert_eq!(block_hashes(b"abcdefghXY", 4, 9), short);
        assert_eq!(block_hashes(b"abcdefghijkl", 4, 9)[..2], short[..]);
        // Same block content at a different position hashes differently (it is chained).
        let h = block_hashes(b"abcdabcd", 4, 0);
        assert_ne!(h[0], h[1]);
        // The seed changes every hash.
        assert_ne!(block_hashes(b"abcd", 4, 0), block_hashes(b"abcd", 4, 1));
    }

    #[test]
    fn seed_rules() {
        let r = 0xdead_beef;
        let cases = [
            (None, false, r),
            (None, true, 0),
            (Some("123"), false, 123),
            (Some("123"), true, 123),
            (Some("0"), false, 0),
            (Some("18446744073709551615"), false, u64::MAX),
            (Some("18446744073709551616"), false, r),
            (Some("18446744073709551616"), true, 0),
            (Some(""), false, r),
            (Some(""), true, 0),
            (Some("-1"), false, r),
            (Some("+1"), false, r),
            (Some(" 1"), true, 0),
            (Some("0x10"), false, r),
            (Some("1_000"), false, r),
        ];
        for (value, statesync, want) in cases {
            assert_eq!(
                hash_seed_from_env(value, statesync, r),
                want,
                "{value:?} {statesync}"
            );
        }
    }

    #[test]
    fn min_match() {
        let cases = [
            (0, 0, 0),
            (50, 0, 50),
            (100, 0, 100),
            (49, 50, 0),
            (50, 50, 50),
            (51, 50, 51),
            (100, 100, 100),
            (99, 100, 0),
        ];
        for (pct, min, want) in cases {
            assert_eq!(apply_min_match(pct, min), want, "{pct} {min}");
        }
    }

    /// Hashes 1..=n stand in for a chain; what matters to the index is only their identity.
    fn chain(n: u64) -> Vec<u64> {
        (1..=n).collect()
    }

    #[test]
    fn match_walks() {
        struct Case {
            name: &'static str,
            /// (hashes, model, pod) added in order.
            adds: Vec<(Vec<u64>, &'static str, &'static str)>,
            query: Vec<u64>,
            model: &'static str,
            candidates: Vec<&'static str>,
            want: Vec<u32>,
        }
        let cases = vec![
            Case {
                name: "empty index",
                adds: vec![],
                query: chain(4),
                model: "m",
                candidates: vec!["a", "b"],
                want: vec![0, 0],
            },
            Case {
                name: "no hashes",
                adds: vec![(chain(4), "m", "a")],
                query: vec![],
                model: "m",
                candidates: vec!["a"],
                want: vec![0],
            },
            Case {
                name: "full match",
                adds: vec![(chain(4), "m", "a")],
                query: chain(4),
                model: "m",
                candidates: vec!["a", "b"],
                want: vec![100, 0],
            },
            Case {
                name: "partial prefix, integer division",
                adds: vec![(chain(1), "m", "a"), (chain(2), "m", "b")],
                query: chain(3),
                model: "m",
                candidates: vec!["a", "b", "c"],
                // 1·100/3 = 33, 2·100/3 = 66.
                want: vec![33, 66, 0],
            },
            Case {
                name: "seven blocks",
                adds: vec![(chain(5), "m", "a")],
                query: chain(7),
                model: "m",
                candidates: vec!["a"],
                want: vec![71],
            },
            Case {
                name: "a pod that misses a block leaves the walk for good",
                adds: vec![
                    (chain(4), "m", "a"),
                    (vec![1, 3, 4], "m", "b"),
                    (vec![2], "m", "c"),
                ],
                query: chain(4),
                model: "m",
                candidates: vec!["b", "a"],
                want: vec![25, 100],
            },
            Case {
                name: "a pod dropped early keeps its last percentage",
                adds: vec![
                    (vec![1, 2], "m", "a"),
                    (vec![3, 4], "m", "a"),
                    (vec![1], "m", "b"),
                ],
                // After block 1 only "a" remains; it holds 2, 3 and 4 too.
                query: chain(4),
                model: "m",
                candidates: vec!["a", "b"],
                want: vec![100, 25],
            },
            Case {
                name: "walk stops at a block only non-candidates hold",
                adds: vec![(chain(3), "m", "z"), (chain(1), "m", "a")],
                query: chain(3),
                model: "m",
                candidates: vec!["a"],
                want: vec![33],
            },
            Case {
                name: "a missing block stops the walk even if later blocks match",
                adds: vec![(vec![1, 3, 4], "m", "a")],
                query: chain(4),
                model: "m",
                candidates: vec!["a"],
                want: vec![25],
            },
            Case {
                name: "candidate not holding block 0 gets nothing",
                adds: vec![(vec![2, 3], "m", "a"), (chain(1), "m", "b")],
                query: chain(3),
                model: "m",
                candidates: vec!["a", "b"],
                want: vec![0, 33],
            },
            Case {
                name: "block 0 held only by a non-candidate",
                adds: vec![(chain(3), "m", "z")],
                query: chain(3),
                model: "m",
                candidates: vec!["a", "b"],
                want: vec![0, 0],
            },
            Case {
                name: "models are separate",
                adds: vec![(chain(4), "m1", "a"), (chain(2), "m2", "b")],
                query: chain(4),
                model: "m2",
                candidates: vec!["a", "b"],
                want: vec![0, 50],
            },
            Case {
                name: "unknown model",
                adds: vec![(chain(4), "m1", "a")],
                query: chain(4),
                model: "m9",
                candidates: vec!["a"],
                want: vec![0],
            },
            Case {
                name: "block held only under another model stops the walk",
                adds: vec![
                    (chain(1), "m", "a"),
                    (vec![2], "other", "a"),
                    (vec![3], "m", "a"),
                ],
                query: chain(3),
                model: "m",
                candidates: vec!["a"],
                want: vec![33],
            },
            Case {
                name: "duplicate and empty candidate lists",
                adds: vec![(chain(2), "m", "a")],
                query: chain(2),
                model: "m",
                candidates: vec!["a", "a"],
                want: vec![100, 100],
            },
            Case {
                name: "no candidates",
                adds: vec![(chain(2), "m", "a")],
                query: chain(2),
                model: "m",
                candidates: vec![],
                want: vec![],
            },
            Case {
                name: "model names and pod names do not collide",
                adds: vec![(chain(2), "a", "m")],
                query: chain(2),
                model: "m",
                candidates: vec!["a"],
                want: vec![0],
            },
        ];
        for c in cases {
            let mut index = PrefixIndex::new(100);
            for (i, (hashes, model, pod)) in c.adds.iter().enumerate() {
                index.add_prefix(hashes, model, pod, i as u64);
            }
            assert_eq!(
                index.match_prefix(&c.query, c.model, &c.candidates),
                c.want,
                "{}",
                c.name
            );
        }
    }

    #[test]
    fn real_chains_match_by_shared_prefix() {
        let seed = 11;
        let a = block_hashes(b"system prompt: be brief. question one", 4, seed);
        let b = block_hashes(b"system prompt: be brief. question two", 4, seed);
        let mut index = PrefixIndex::new(1000);
        index.add_prefix(&a, "m", "pod-a", 0);
        // 36 bytes → 9 blocks; "system prompt: be brief. question " is 33 bytes → 8 shared.
        assert_eq!(a.len(), 9);
        assert_eq!(index.match_prefix(&b, "m", &["pod-a"]), vec![88]);
        assert_eq!(index.match_prefix(&a, "m", &["pod-a"]), vec![100]);
    }

    #[test]
    fn capacity_evicts_least_recently_added() {
        let mut index = PrefixIndex::new(3);
        index.add_prefix(&[1], "m", "a", 0);
        index.add_prefix(&[2], "m", "a", 1);
        index.add_prefix(&[3], "m", "a", 2);
        assert_eq!(index.len(), 3);
        // Refreshing 1 makes 2 the least recent.
        index.add_prefix(&[1], "m", "b", 3);
        index.add_prefix(&[4], "m", "a", 4);
        assert_eq!(index.len(), 3);
        let held = |index: &PrefixIndex, h| index.match_prefix(&[h], "m", &["a"])[0] == 100;
        assert!(held(&index, 1) && !held(&index, 2) && held(&index, 3) && held(&index, 4));
        // Lookups do not refresh: 3 is still the least recent and goes next.
        assert!(held(&index, 3));
        index.add_prefix(&[5], "m", "a", 5);
        assert!(!held(&index, 3) && held(&index, 1));
        // One prompt longer than the capacity keeps its first blocks.
        let mut small = PrefixIndex::new(2);
        small.add_prefix(&chain(5), "m", "a", 0);
        assert_eq!(small.len(), 2);
        assert_eq!(small.match_prefix(&chain(5), "m", &["a"]), vec![40]);
        // Capacity 0 keeps nothing, and leaks no names.
        let mut none = PrefixIndex::new(0);
        none.add_prefix(&chain(3), "m", "a", 0);
        assert!(none.is_empty());
        assert_eq!(none.name_count(), 0);
    }

    #[test]
    fn slots_are_reused_under_churn() {
        let mut index = PrefixIndex::new(50);
        for i in 0..10_000u64 {
            let pod = format!("pod-{}", i % 7);
            index.add_prefix(&[i * 3, i * 3 + 1, i * 3 + 2], "m", &pod, i);
        }
        assert_eq!(index.len(), 50);
        assert!(index.nodes.len() <= 51);
        // Only the pods still holding a block keep their names.
        assert!(index.name_count() <= 8);
        let last = 9_999u64;
        assert_eq!(
            index.match_prefix(&[last * 3, last * 3 + 1, last * 3 + 2], "m", &["pod-3"]),
            vec![100]
        );
    }

    #[test]
    fn add_refreshes_times() {
        let mut index = PrefixIndex::new(10);
        index.add_prefix(&[1, 2], "m", "a", 100);
        index.add_prefix(&[1], "m", "b", 200);
        assert_eq!(index.last_access(1, "m", "a"), Some(100));
        assert_eq!(index.last_access(1, "m", "b"), Some(200));
        assert_eq!(index.last_access(2, "m", "b"), None);
        index.add_prefix(&[1, 2], "m", "a", 300);
        assert_eq!(index.last_access(1, "m", "a"), Some(300));
        assert_eq!(index.last_access(2, "m", "a"), Some(300));
        assert_eq!(index.last_access(9, "m", "a"), None);
        assert_eq!(index.last_access(1, "x", "a"), None);
    }

    #[test]
    fn age_eviction() {
        let mut index = PrefixIndex::new(100);
        index.add_prefix(&[1], "m", "a", 1_000);
        index.add_prefix(&[2], "m", "a", 2_000);
        index.add_prefix(&[3], "m", "a", 3_000);
        // Strictly older than the age goes: 1 is exactly 1000 ms old and stays.
        assert_eq!(index.evict_older_than(2_000, 1_000), 0);
        assert_eq!(index.evict_older_than(2_001, 1_000), 1);
        assert_eq!(index.len(), 2);
        // Refreshing 2 keeps it past 3.
        index.add_prefix(&[2], "m", "b", 5_000);
        assert_eq!(index.evict_older_than(5_500, 1_000), 1);
        assert_eq!(index.match_prefix(&[2], "m", &["a", "b"]), vec![100, 100]);
        assert_eq!(index.match_prefix(&[3], "m", &["a"]), vec![0]);
        assert_eq!(index.evict_older_than(100_000, 1_000), 1);
        assert!(index.is_empty());
        assert_eq!(index.name_count(), 0);
        // A clock that went backwards evicts nothing.
        index.add_prefix(&[7], "m", "a", 10_000);
        assert_eq!(index.evict_older_than(0, 0), 0);
        // Late events (older times ahead of younger blocks) wait for the blocks behind them.
        let mut index = PrefixIndex::new(100);
        index.add_prefix(&[1], "m", "a", 5_000);
        index.add_prefix(&[2], "m", "a", 1_000);
        assert_eq!(index.evict_older_than(5_500, 1_000), 0);
        assert_eq!(index.evict_older_than(6_001, 1_000), 2);
    }

    #[test]
    fn holders_per_block_are_capped() {
        let mut index = PrefixIndex::new(10);
        let extra = 5;
        for i in 0..(MAX_HOLDERS_PER_BLOCK + extra) {
            index.add_prefix(&[1], "m", &format!("p{i}"), i as u64);
        }
        // The least recently seen holders were replaced.
        for i in 0..extra {
            assert_eq!(index.last_access(1, "m", &format!("p{i}")), None);
        }
        let last = format!("p{}", MAX_HOLDERS_PER_BLOCK + extra - 1);
        assert_eq!(index.match_prefix(&[1], "m", &[&last, "p0"]), vec![100, 0]);
        // Names of replaced holders are freed: the model plus the kept pods.
        assert_eq!(index.name_count(), 1 + MAX_HOLDERS_PER_BLOCK);
    }

    #[test]
    fn event_round_trip() {
        let events = [
            PrefixEvent {
                model: "llama-3-8b".into(),
                pod: "default/prefill-0".into(),
                hashes: vec![0, 1, u64::MAX, 0x0123_4567_89ab_cdef],
                at_ms: 1_767_225_600_123,
            },
            PrefixEvent {
                model: String::new(),
                pod: "数据🚀".into(),
                hashes: vec![],
                at_ms: 0,
            },
            PrefixEvent {
                model: "m".repeat(300),
                pod: "p".into(),
                hashes: (0..1000).collect(),
                at_ms: u64::MAX,
            },
        ];
        for e in events {
            let bytes = e.encode();
            assert_eq!(PrefixEvent::decode(&bytes), Ok(e.clone()));
            // Applying a decoded event is the same as adding the prefix directly.
            let mut index = PrefixIndex::new(10_000);
            let back = PrefixEvent::decode(&bytes).unwrap();
            index.add_prefix(&back.hashes, &back.model, &back.pod, back.at_ms);
            if !e.hashes.is_empty() {
                assert_eq!(
                    index.match_prefix(&e.hashes, &e.model, &[&e.pod]),
                    vec![100]
                );
            }
        }
        // Compact: one 4-block event is about 8 bytes per hash plus the names.
        let small = PrefixEvent {
            model: "m".into(),
            pod: "p".into(),
            hashes: chain(4),
            at_ms: 1_767_225_600_123,
        };
        assert_eq!(small.encode().len(), 1 + 6 + 2 + 2 + 1 + 32);
    }

    #[test]
    fn corrupt_events_are_errors() {
        let good = PrefixEvent {
            model: "m".into(),
            pod: "pod".into(),
            hashes: vec![1, 2],
            at_ms: 300,
        }
        .encode();
        // Every truncation fails cleanly.
        for cut in 0..good.len() {
            assert_eq!(
                PrefixEvent::decode(&good[..cut]),
                Err(EventError::Truncated),
                "cut at {cut}"
            );
        }
        let mut trailing = good.clone();
        trailing.push(0);
        let mut version = good.clone();
        version[0] = 9;
        let cases: Vec<(Vec<u8>, EventError)> = vec![
            (trailing, EventError::Trailing(1)),
            (version, EventError::Version(9)),
            // Model length 1, then an invalid UTF-8 byte.
            (vec![1, 0, 1, 0xff, 0, 0], EventError::Utf8),
            // An 11-byte varint.
            (
                vec![
                    1, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01,
                ],
                EventError::Varint,
            ),
            // A tenth varint byte that overflows 64 bits.
            (
                vec![
                    1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
                ],
                EventError::Varint,
            ),
            // A string length far beyond the input.
            (
                vec![1, 0, 0xff, 0xff, 0xff, 0xff, 0x0f, b'm'],
                EventError::Truncated,
            ),
            // A hash count whose byte size overflows: must not allocate.
            (
                vec![
                    1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
                ],
                EventError::Truncated,
            ),
            (vec![1, 0, 0, 0, 2, 1, 2, 3], EventError::Truncated),
        ];
        for (bytes, want) in cases {
            assert_eq!(PrefixEvent::decode(&bytes), Err(want), "{bytes:?}");
        }
        // A maximal u64 varint still decodes.
        let e = PrefixEvent {
            model: String::new(),
            pod: String::new(),
            hashes: vec![],
            at_ms: u64::MAX,
        };
        assert_eq!(PrefixEvent::decode(&e.encode()), Ok(e));
    }
}
