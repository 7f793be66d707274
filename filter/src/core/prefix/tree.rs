//! The prefix index as a radix tree over the prompts' token streams.
//!
//! The spec names each block by a chained hash, so a block's hash stands for the whole prefix
//! ending with it, and keeps one LRU entry per block. Every prompt is added whole, though, so
//! the blocks of one prompt are always touched together: a run of blocks that the same adds
//! touched has one holder set and one time. This index stores such runs as tree edges (the
//! stream bytes themselves, a multiple of the block size) instead of one hashed entry per
//! block, and keeps the LRU over edges. A lookup compares bytes along one path and an add
//! splits at most one edge and appends at most one, so a 2 KB prompt costs a few map
//! lookups and a memcmp instead of hashing, looking up and relinking 512 blocks (in every
//! worker). Matches, evictions and holder sets are those of the per-block index
//! (`reference.rs`, checked against it by a property test); bytes compared where hashes were
//! means no collisions and no seed.

use hashbrown::HashMap;

use super::names::Names;
use super::MAX_HOLDERS_PER_BLOCK;

/// End of a list, and the parent of top-level edges.
pub(super) const NIL: u32 = u32::MAX;
/// A freed or trimmed edge keeps at most this much buffer capacity for reuse: one huge
/// prompt must not leave megabytes pinned in a slot that later holds a short run.
const KEPT_EDGE_CAPACITY: usize = 16 * 1024;

#[derive(Debug, Clone, Copy)]
struct Holder {
    model: u32,
    pod: u32,
    at_ms: u64,
}

/// One edge: a run of whole blocks below `parent`, found under `(parent, key)`.
#[derive(Debug)]
struct Node {
    parent: u32,
    /// [`block_key`] of the edge's first block.
    key: u64,
    /// The run's stream bytes: at least one block, always whole blocks.
    edge: Vec<u8>,
    /// Edges directly below this one; only an edge without any can be trimmed or dropped.
    children: u32,
    /// Neighbours in the LRU list, most recent first.
    prev: u32,
    next: u32,
    /// Time of the last add that touched the run (the age sweep reads it).
    touched_ms: u64,
    holders: Vec<Holder>,
}

/// LRU map from prompt prefixes to the (model, pod) pairs that recently served them, with
/// AIBrix's `AddPrefix`/`MatchPrefix` semantics at block granularity.
///
/// Invariant: an edge is always more recent in the LRU list than every edge below it (an add
/// touches its path deepest-first, a split puts the new upper edge just ahead of the lower
/// one), so the least recent edge is a leaf and eviction only ever trims or drops leaves.
/// Memory is bounded by the capacity in blocks: at most one edge per block plus the stream
/// bytes themselves (`block_size` bytes per block).
#[derive(Debug)]
pub struct PrefixIndex {
    capacity: usize,
    block_size: usize,
    /// Blocks held (the sum of every edge's blocks).
    blocks: usize,
    nodes: Vec<Node>,
    free: Vec<u32>,
    edges: HashMap<(u32, u64), u32>,
    head: u32,
    tail: u32,
    names: Names,
    /// The path of the add in progress, kept to reuse its allocation.
    path: Vec<u32>,
}

impl PrefixIndex {
    /// An empty index holding at most `capacity` blocks of `block_size` stream bytes (AIBrix
    /// keeps none at capacity 0; a block size of 0 is taken as 1).
    pub fn new(capacity: usize, block_size: usize) -> PrefixIndex {
        PrefixIndex {
            // Node ids are u32 with one value reserved for NIL.
            capacity: capacity.min(NIL as usize - 1),
            block_size: block_size.max(1),
            blocks: 0,
            nodes: Vec::new(),
            free: Vec::new(),
            edges: HashMap::new(),
            head: NIL,
            tail: NIL,
            names: Names::default(),
            path: Vec::new(),
        }
    }

    /// Number of blocks held.
    pub fn len(&self) -> usize {
        self.blocks
    }

    pub fn is_empty(&self) -> bool {
        self.blocks == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Number of distinct model and pod names referenced (a memory check for tests and stats).
    pub fn name_count(&self) -> usize {
        self.names.len()
    }

    /// Number of edges (runs of blocks) held.
    pub fn edge_count(&self) -> usize {
        self.edges.len()
    }

    /// The whole blocks of `stream`: a trailing partial block is ignored, as by the spec.
    fn whole_blocks<'s>(&self, stream: &'s [u8]) -> &'s [u8] {
        &stream[..stream.len() - stream.len() % self.block_size]
    }

    /// The key of the block starting `bytes`: blocks of up to 8 bytes are packed as they are
    /// (exact); longer ones are hashed, and [`common_blocks`] then confirms the bytes.
    fn block_key(&self, bytes: &[u8]) -> u64 {
        let block = &bytes[..self.block_size.min(bytes.len())];
        if block.len() <= 8 {
            let mut packed = [0u8; 8];
            packed[..block.len()].copy_from_slice(block);
            u64::from_le_bytes(packed)
        } else {
            xxhash_rust::xxh64::xxh64(block, 0)
        }
    }

    /// Records that `pod` served the prompt `stream` for `model` at `now_ms`: every block
    /// gets the pod with that time and becomes most recently used (the first block most of
    /// all), missing blocks are created, and then the least recently used blocks beyond
    /// capacity are evicted.
    pub fn add_prefix(&mut self, stream: &[u8], model: &str, pod: &str, now_ms: u64) {
        let stream = self.whole_blocks(stream);
        if stream.is_empty() {
            return;
        }
        let bs = self.block_size;
        // Held for the whole call so evictions below cannot free the ids in use.
        let model_id = self.names.acquire(model);
        let pod_id = self.names.acquire(pod);
        let mut path = std::mem::take(&mut self.path);
        path.clear();
        let (mut parent, mut pos) = (NIL, 0);
        while pos < stream.len() {
            let rest = &stream[pos..];
            let key = self.block_key(rest);
            let Some(&child) = self.edges.get(&(parent, key)) else {
                let leaf = self.new_leaf(parent, key, rest, now_ms);
                self.blocks += rest.len() / bs;
                path.push(leaf);
                break;
            };
            let edge_len = self.nodes[child as usize].edge.len();
            let common = common_blocks(&self.nodes[child as usize].edge, rest, bs);
            if common == 0 {
                // Two different first blocks with one key (only possible above 8 bytes per
                // block): the rest of this prompt stays unindexed, as a dropped add would.
                break;
            }
            let node = if common < edge_len {
                self.split(child, common)
            } else {
                child
            };
            path.push(node);
            pos += common;
            parent = node;
        }
        // Deepest first, so the path's upper edges end up ahead of the lower ones.
        for &idx in path.iter().rev() {
            self.touch(idx, model_id, pod_id, now_ms);
            self.unlink(idx);
            self.push_front(idx);
        }
        self.path = path;
        self.evict_beyond_capacity();
        self.names.release(model_id);
        self.names.release(pod_id);
    }

    /// Consecutive-prefix match percentage of each candidate, in the order given (0 for a pod
    /// that holds no prefix): [`PrefixIndex::match_candidates`] with the candidates named by
    /// position (a name listed twice gets the same value at both places).
    pub fn match_prefix(&self, stream: &[u8], model: &str, candidates: &[&str]) -> Vec<u32> {
        let mut pct = vec![0u32; candidates.len()];
        let mut first: HashMap<&str, usize> = HashMap::with_capacity(candidates.len());
        for (i, c) in candidates.iter().enumerate() {
            first.entry(*c).or_insert(i);
        }
        self.match_candidates(
            stream,
            model,
            |name| first.get(name).copied(),
            |slot, p| pct[slot] = p,
        );
        for (i, c) in candidates.iter().enumerate() {
            if let Some(&j) = first.get(c) {
                pct[i] = pct[j];
            }
        }
        pct
    }

    /// The candidates that hold a prefix of `stream` for `model`, each reported once as
    /// `found(slot, pct)`; `slot_of` says which pod names are candidates (and where).
    ///
    /// Walks the blocks from the start and stops at the first block that is missing, has no
    /// holder for `model`, or is held by none of the candidates still in the walk. At block
    /// `i` (0-based) of `n`, each remaining candidate holding it gets `(i+1)·100/n` (integer
    /// division); one that does not hold it leaves the walk for good, keeping its last value.
    /// Lookups do not refresh blocks. All blocks of an edge share their holders, so the walk
    /// decides once per edge. The candidates come from the first edge's holders, so the cost
    /// is the path and its holders, not the number of candidates: on a 1000-pod fleet a
    /// lookup touches the few pods that served the prefix, not every prefill pod.
    pub fn match_candidates(
        &self,
        stream: &[u8],
        model: &str,
        slot_of: impl Fn(&str) -> Option<usize>,
        mut found: impl FnMut(usize, u32),
    ) {
        let stream = self.whole_blocks(stream);
        let bs = self.block_size;
        let n = (stream.len() / bs) as u64;
        if n == 0 {
            return;
        }
        let Some(model_id) = self.names.get(model) else {
            return;
        };
        // Candidates that held the first edge: (pod id, slot, pct, still walking).
        let mut walking: Vec<(u32, usize, u32, bool)> = Vec::new();
        let (mut parent, mut pos) = (NIL, 0);
        while pos < stream.len() {
            let rest = &stream[pos..];
            let Some(&idx) = self.edges.get(&(parent, self.block_key(rest))) else {
                break;
            };
            let node = &self.nodes[idx as usize];
            let common = common_blocks(&node.edge, rest, bs);
            if common == 0 || !node.holders.iter().any(|h| h.model == model_id) {
                break;
            }
            let edge_pct = (((pos + common) / bs) as u64 * 100 / n) as u32;
            let mut any = false;
            if parent == NIL {
                for h in node.holders.iter().filter(|h| h.model == model_id) {
                    if walking.iter().any(|w| w.0 == h.pod) {
                        continue;
                    }
                    if let Some(slot) = self.names.name(h.pod).and_then(&slot_of) {
                        walking.push((h.pod, slot, edge_pct, true));
                        any = true;
                    }
                }
            } else {
                for w in walking.iter_mut().filter(|w| w.3) {
                    if node
                        .holders
                        .iter()
                        .any(|h| h.model == model_id && h.pod == w.0)
                    {
                        w.2 = edge_pct;
                        any = true;
                    } else {
                        w.3 = false;
                    }
                }
            }
            if !any || common < node.edge.len() {
                break;
            }
            pos += common;
            parent = idx;
        }
        for (_, slot, pct, _) in walking {
            found(slot, pct);
        }
    }

    /// Removes blocks not touched by an add for more than `max_age_ms` (strictly, as AIBrix)
    /// and returns how many went.
    ///
    /// The sweep walks from the least recent edge and stops at the first young one, so it
    /// costs only what it removes. Edges are ordered by when they were added; an event from
    /// another worker that arrives late carries an older time and sits ahead of younger
    /// edges, so it may outlive its age by at most the age of the edges behind it.
    pub fn evict_older_than(&mut self, now_ms: u64, max_age_ms: u64) -> usize {
        let mut evicted = 0;
        while self.tail != NIL {
            let node = &self.nodes[self.tail as usize];
            if now_ms.saturating_sub(node.touched_ms) <= max_age_ms || node.children > 0 {
                break;
            }
            evicted += node.edge.len() / self.block_size;
            self.drop_leaf(self.tail);
        }
        evicted
    }

    /// When `pod` last served the prompt `stream` for `model` (the time on its last whole
    /// block), if the index holds all of it for that pod.
    pub fn last_access(&self, stream: &[u8], model: &str, pod: &str) -> Option<u64> {
        let stream = self.whole_blocks(stream);
        let (model, pod) = (self.names.get(model)?, self.names.get(pod)?);
        let (mut parent, mut pos, mut last) = (NIL, 0, None);
        while pos < stream.len() {
            let rest = &stream[pos..];
            let idx = *self.edges.get(&(parent, self.block_key(rest)))?;
            let node = &self.nodes[idx as usize];
            let common = common_blocks(&node.edge, rest, self.block_size);
            if common == 0 {
                return None;
            }
            last = Some(idx);
            pos += common;
            parent = idx;
        }
        self.nodes[last? as usize]
            .holders
            .iter()
            .find(|h| h.model == model && h.pod == pod)
            .map(|h| h.at_ms)
    }

    /// A new edge holding `bytes` below `parent`, not yet in the LRU list (the add's touch
    /// links it).
    fn new_leaf(&mut self, parent: u32, key: u64, bytes: &[u8], now_ms: u64) -> u32 {
        let idx = self.alloc();
        let node = &mut self.nodes[idx as usize];
        node.parent = parent;
        node.key = key;
        node.edge.extend_from_slice(bytes);
        node.touched_ms = now_ms;
        self.edges.insert((parent, key), idx);
        if parent != NIL {
            self.nodes[parent as usize].children += 1;
        }
        idx
    }

    /// Cuts edge `idx` after `at` bytes (whole blocks, `0 < at < len`): a new upper edge takes
    /// the first part, the node's place under its parent and a copy of its holders, and sits
    /// just ahead of it in the LRU list; `idx` keeps the rest and its children. Returns the
    /// upper edge.
    fn split(&mut self, idx: u32, at: usize) -> u32 {
        let upper = self.alloc();
        let mut edge = std::mem::take(&mut self.nodes[upper as usize].edge);
        let mut holders = std::mem::take(&mut self.nodes[upper as usize].holders);
        let lower = &mut self.nodes[idx as usize];
        edge.extend_from_slice(&lower.edge[..at]);
        lower.edge.drain(..at);
        holders.extend_from_slice(&lower.holders);
        let (parent, key, touched_ms) = (lower.parent, lower.key, lower.touched_ms);
        for h in &holders {
            self.names.add_ref(h.model);
            self.names.add_ref(h.pod);
        }
        let lower_key = self.block_key(&self.nodes[idx as usize].edge);
        let lower = &mut self.nodes[idx as usize];
        lower.parent = upper;
        lower.key = lower_key;
        let node = &mut self.nodes[upper as usize];
        node.parent = parent;
        node.key = key;
        node.edge = edge;
        node.holders = holders;
        node.children = 1;
        node.touched_ms = touched_ms;
        self.edges.insert((parent, key), upper);
        self.edges.insert((upper, lower_key), idx);
        self.insert_before(upper, idx);
        upper
    }

    fn touch(&mut self, idx: u32, model: u32, pod: u32, now_ms: u64) {
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

    /// Trims the least recent leaves, deepest blocks first, until the capacity holds.
    fn evict_beyond_capacity(&mut self) {
        while self.blocks > self.capacity && self.tail != NIL {
            let idx = self.tail;
            let node = &mut self.nodes[idx as usize];
            if node.children > 0 {
                // Cannot happen (see the invariant); never cut an edge others hang from.
                debug_assert!(false, "the least recent edge has children");
                return;
            }
            let edge_blocks = node.edge.len() / self.block_size;
            let excess = self.blocks - self.capacity;
            if excess < edge_blocks {
                node.edge.truncate((edge_blocks - excess) * self.block_size);
                if node.edge.capacity() > node.edge.len() + KEPT_EDGE_CAPACITY {
                    node.edge.shrink_to_fit();
                }
                self.blocks -= excess;
            } else {
                self.drop_leaf(idx);
            }
        }
    }

    /// Removes a leaf edge entirely, releasing its names.
    fn drop_leaf(&mut self, idx: u32) {
        self.unlink(idx);
        let node = &mut self.nodes[idx as usize];
        let (parent, key) = (node.parent, node.key);
        self.blocks -= node.edge.len() / self.block_size;
        node.edge.clear();
        if node.edge.capacity() > KEPT_EDGE_CAPACITY {
            node.edge = Vec::new();
        }
        // Drained in place: the slot's buffers keep their capacity for the next edge.
        for h in node.holders.drain(..) {
            self.names.release(h.model);
            self.names.release(h.pod);
        }
        self.edges.remove(&(parent, key));
        if parent != NIL {
            let p = &mut self.nodes[parent as usize];
            p.children = p.children.saturating_sub(1);
        }
        self.free.push(idx);
    }

    /// An unlinked edge slot with empty buffers: a freed one (its buffers keep their
    /// capacity, so a full index in steady state allocates little) or a new one.
    fn alloc(&mut self) -> u32 {
        if let Some(idx) = self.free.pop() {
            let node = &mut self.nodes[idx as usize];
            node.children = 0;
            node.prev = NIL;
            node.next = NIL;
            return idx;
        }
        // Below NIL: there are never more edges than blocks, and capacity < NIL - 1.
        let idx = self.nodes.len() as u32;
        self.nodes.push(Node {
            parent: NIL,
            key: 0,
            edge: Vec::new(),
            children: 0,
            prev: NIL,
            next: NIL,
            touched_ms: 0,
            holders: Vec::new(),
        });
        idx
    }

    fn unlink(&mut self, idx: u32) {
        let (prev, next) = {
            let n = &self.nodes[idx as usize];
            (n.prev, n.next)
        };
        if prev == NIL {
            if self.head == idx {
                self.head = next;
            }
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            if self.tail == idx {
                self.tail = prev;
            }
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

    /// Links `idx` (unlinked) just ahead of `before` (linked), i.e. one step more recent.
    fn insert_before(&mut self, idx: u32, before: u32) {
        let prev = self.nodes[before as usize].prev;
        {
            let n = &mut self.nodes[idx as usize];
            n.prev = prev;
            n.next = before;
        }
        self.nodes[before as usize].prev = idx;
        if prev == NIL {
            self.head = idx;
        } else {
            self.nodes[prev as usize].next = idx;
        }
    }

    /// Edge slots allocated, free ones included (a memory check for tests).
    #[cfg(test)]
    pub(super) fn nodes_allocated(&self) -> usize {
        self.nodes.len()
    }

    /// Bytes of edge buffers held, free slots included (a memory check for tests).
    #[cfg(test)]
    pub(super) fn edge_capacity(&self) -> usize {
        self.nodes.iter().map(|n| n.edge.capacity()).sum()
    }

    /// Checks every structural invariant; tests call it after each operation.
    #[cfg(test)]
    pub(super) fn check(&self) {
        let mut seen = 0;
        let mut blocks = 0;
        let mut at = self.head;
        let mut prev = NIL;
        let mut position = HashMap::new();
        while at != NIL {
            let n = &self.nodes[at as usize];
            assert_eq!(n.prev, prev, "list links");
            assert!(!n.edge.is_empty() && n.edge.len().is_multiple_of(self.block_size));
            assert_eq!(self.edges.get(&(n.parent, n.key)), Some(&at), "edge map");
            assert_eq!(n.key, self.block_key(&n.edge));
            position.insert(at, seen);
            blocks += n.edge.len() / self.block_size;
            seen += 1;
            prev = at;
            at = n.next;
        }
        assert_eq!(self.tail, prev);
        assert_eq!(seen, self.edges.len());
        assert_eq!(blocks, self.blocks);
        assert!(self.blocks <= self.capacity);
        for (&(parent, _), &idx) in &self.edges {
            let children = self.edges.keys().filter(|(p, _)| *p == idx).count();
            assert_eq!(self.nodes[idx as usize].children as usize, children);
            if parent != NIL {
                assert!(
                    position[&parent] < position[&idx],
                    "an edge is more recent than the edges below it"
                );
            }
        }
    }
}

/// Whole blocks shared at the start of `a` and `b`, in bytes: the first differing byte,
/// compared eight bytes at a time, rounded down to a block.
fn common_blocks(a: &[u8], b: &[u8], block_size: usize) -> usize {
    let len = a.len().min(b.len());
    let (a, b) = (&a[..len], &b[..len]);
    let (wa, _) = a.as_chunks::<8>();
    let (wb, _) = b.as_chunks::<8>();
    let mut same = 0;
    let mut differs = false;
    for (x, y) in wa.iter().zip(wb) {
        let diff = u64::from_le_bytes(*x) ^ u64::from_le_bytes(*y);
        if diff != 0 {
            same += (diff.trailing_zeros() / 8) as usize;
            differs = true;
            break;
        }
        same += 8;
    }
    if !differs {
        same += a[same..]
            .iter()
            .zip(&b[same..])
            .take_while(|(x, y)| x == y)
            .count();
    }
    same - same % block_size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_blocks_rounds_down_to_whole_blocks() {
        let cases: &[(&[u8], &[u8], usize, usize)] = &[
            (b"", b"", 4, 0),
            (b"abcd", b"abcd", 4, 4),
            (b"abcdefgh", b"abcdefgX", 4, 4),
            (b"abcdefghijklmnopq", b"abcdefghijklmnopq", 1, 17),
            (b"abcdefghijklmnopq", b"abcdefghijklmnopZ", 4, 16),
            (b"abcdefghijklmnopq", b"abcdefghiXklmnopq", 4, 8),
            (b"abcdefghijklmnopq", b"abcdefghiXklmnopq", 3, 9),
            (b"Xbcdefgh", b"abcdefgh", 1, 0),
            (b"abcdefgh", b"abcd", 4, 4),
            (b"abcdefgh", b"abcdef", 4, 4),
            (b"abcdefghijkl", b"abcdefghijkl", 5, 10),
        ];
        for (a, b, bs, want) in cases {
            assert_eq!(common_blocks(a, b, *bs), *want, "{a:?} {b:?} {bs}");
            assert_eq!(common_blocks(b, a, *bs), *want, "{b:?} {a:?} {bs}");
        }
    }
}
