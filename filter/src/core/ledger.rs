//! Per-pod request counters and token ledgers shared by every Envoy worker, updated with
//! compare-and-swap.
//!
//! One shared-data key holds the whole [`Ledger`], so "select, then charge" is one CAS round:
//! a selection that raced with another worker's charge fails its write, re-reads and selects
//! again, and concurrent selections always see each other's charges.
//!
//! The ledger is a sorted array of fixed-size rows keyed by a 64-bit hash of the pod's
//! `namespace/name`. Reading it needs no parsing or allocation (the bytes from shared data
//! are the table), and a lookup is a binary search, so a selection over 1024 pods pays
//! neither a per-row decode nor a string hash per candidate: pod ids are computed once per
//! snapshot.

use crate::core::remote::RemoteLoad;
use crate::core::tokens::{amount, Charge, DecodeCharge, PodTokens, IDLE_PRUNE_MS};

/// Generation of the formats of the shared load state (ledger rows, hold journals): part of
/// each of its keys. An ECDS code push keeps shared data for the VM id, so two builds run side
/// by side on it; with a format changed under one key the new build read the old one's ledger
/// as corrupt and failed every selection until Envoy restarted. Bump it with any change of
/// those formats: each generation then keeps its own ledger while both run.
pub const GENERATION: u8 = 2;
/// The shared-data key of the ledger (of [`GENERATION`]).
pub const LOAD_KEY: &str = "pd/g2/load";
/// A CAS loop that keeps losing means something is badly wrong; give up instead of spinning.
const MAX_CAS_ATTEMPTS: usize = 256;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StoreError {
    #[error("shared data store failed: {0}")]
    Host(String),
    #[error("load table was corrupt and is reset to empty")]
    Corrupt,
    #[error("gave up after {0} conflicting updates")]
    Contention(usize),
}

/// Key-value store with compare-and-swap: Envoy shared data in wasm, memory in tests.
pub trait Store {
    /// The value and its CAS token, `(None, None)` when absent.
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError>;
    /// Writes when `cas` still matches; `Ok(false)` on a CAS mismatch.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, StoreError>;
}

/// A pod's ledger identity: FNV-1a 64 of `namespace/name`, so pods of the same name in two
/// namespaces are different pods. A collision between two live pods is a 2^-64 event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PodId(pub u64);

impl PodId {
    pub fn of(key: &str) -> PodId {
        let mut h = fnv::FnvHasher::default();
        std::hash::Hasher::write(&mut h, key.as_bytes());
        PodId(std::hash::Hasher::finish(&h))
    }
}

/// Request counters of one pod.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Prefill legs sent to the pod and not yet answered.
    pub prefill_inflight: u32,
    /// Requests whose decode (or whole request, for combined pods) the pod owes.
    pub running: u32,
}

/// Which counter a charge went to, so it can be released exactly once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    PrefillInflight,
    Running,
}

/// Everything the ledger holds about one pod.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Row {
    pub counts: Counts,
    pub tokens: PodTokens,
}

impl Row {
    fn is_zero(&self) -> bool {
        self.counts == Counts::default() && self.tokens.is_zero()
    }
}

/// Row layout, little-endian: id u64 | prefill_inflight u32 | running u32 | active f64 |
/// kv f64 | decode f64 | decode_requests u32 | reserved u32 | decode_routed_at_sum_ms f64 |
/// touched_ms u64.
const ROW: usize = 64;
/// Header: magic "PDL" and a format version byte.
const MAGIC: [u8; 4] = [b'P', b'D', b'L', GENERATION];

/// The shared ledger: a sorted array of fixed-size rows behind a 4-byte header.
#[derive(Debug, Clone, PartialEq)]
pub struct Ledger {
    bytes: Vec<u8>,
    /// Other gateway replicas' decode load: added where selection reads rows, never part of
    /// the bytes written back (see [`crate::core::remote`]).
    remote: Option<std::sync::Arc<RemoteLoad>>,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger {
            bytes: MAGIC.to_vec(),
            remote: None,
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn f64_at(b: &[u8], at: usize) -> f64 {
    f64::from_bits(u64_at(b, at))
}

impl Ledger {
    /// Takes ownership of shared-data bytes; only the shape is checked (O(1)), rows are read
    /// where they are used. Empty bytes are an empty ledger.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Ledger, StoreError> {
        if bytes.is_empty() {
            return Ok(Ledger::default());
        }
        if bytes.len() < MAGIC.len()
            || bytes[..MAGIC.len()] != MAGIC
            || !(bytes.len() - MAGIC.len()).is_multiple_of(ROW)
        {
            return Err(StoreError::Corrupt);
        }
        Ok(Ledger {
            bytes,
            remote: None,
        })
    }

    /// Lets selection see the other replicas' decode load (or stop seeing it).
    pub fn set_remote(&mut self, remote: Option<std::sync::Arc<RemoteLoad>>) {
        self.remote = remote;
    }

    /// The other replicas' load selection adds to this ledger's rows, if any.
    pub fn remote(&self) -> Option<&RemoteLoad> {
        self.remote.as_deref()
    }

    /// Every row with its pod id, in id order (this replica's own load only).
    pub fn iter(&self) -> impl Iterator<Item = (PodId, Row)> + '_ {
        (0..self.len()).map(|i| (PodId(self.id_at(i)), self.read(i)))
    }

    pub fn decode(bytes: &[u8]) -> Result<Ledger, StoreError> {
        Ledger::from_bytes(bytes.to_vec())
    }

    pub fn encode(&self) -> Vec<u8> {
        self.bytes.clone()
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Number of pod rows.
    pub fn len(&self) -> usize {
        (self.bytes.len() - MAGIC.len()) / ROW
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when no pod holds any charge (rows at zero may remain until pruned).
    pub fn all_zero(&self) -> bool {
        (0..self.len()).all(|i| self.read(i).is_zero())
    }

    fn row_offset(i: usize) -> usize {
        MAGIC.len() + i * ROW
    }

    fn id_at(&self, i: usize) -> u64 {
        u64_at(&self.bytes, Ledger::row_offset(i))
    }

    /// The sequence of row ids folded into one number: equal layouts mean every row sits
    /// where it sat (an accidental match of two different sequences is a 2^-64 event; pod
    /// names come from the operator, not from clients). Rows only move when a pod gets its
    /// first charge or is pruned, so under load the layout stays put for long stretches and
    /// one pass over the ids replaces a check per hint.
    fn layout(&self) -> u64 {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let rows = self.bytes.get(MAGIC.len()..).unwrap_or_default();
        let mut h = (rows.len() as u64).wrapping_mul(K);
        for row in rows.chunks_exact(ROW) {
            h = (h ^ u64_at(row, 0)).wrapping_mul(K);
            h ^= h >> 29;
        }
        h
    }

    /// Binary search by id: `Ok(index)` when present, `Err(insertion point)` otherwise.
    fn find(&self, id: PodId) -> Result<usize, usize> {
        let (mut lo, mut hi) = (0usize, self.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            match self.id_at(mid).cmp(&id.0) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Ok(mid),
            }
        }
        Err(lo)
    }

    fn read(&self, i: usize) -> Row {
        let b = &self.bytes[Ledger::row_offset(i)..Ledger::row_offset(i) + ROW];
        Row {
            counts: Counts {
                prefill_inflight: u32_at(b, 8),
                running: u32_at(b, 12),
            },
            tokens: PodTokens {
                active: f64_at(b, 16),
                kv: f64_at(b, 24),
                decode: f64_at(b, 32),
                decode_requests: u32_at(b, 40),
                decode_routed_at_sum_ms: f64_at(b, 48),
                touched_ms: u64_at(b, 56),
            },
        }
    }

    fn write(&mut self, i: usize, id: PodId, row: &Row) {
        let at = Ledger::row_offset(i);
        let b = &mut self.bytes[at..at + ROW];
        b[0..8].copy_from_slice(&id.0.to_le_bytes());
        b[8..12].copy_from_slice(&row.counts.prefill_inflight.to_le_bytes());
        b[12..16].copy_from_slice(&row.counts.running.to_le_bytes());
        b[16..24].copy_from_slice(&row.tokens.active.to_le_bytes());
        b[24..32].copy_from_slice(&row.tokens.kv.to_le_bytes());
        b[32..40].copy_from_slice(&row.tokens.decode.to_le_bytes());
        b[40..44].copy_from_slice(&row.tokens.decode_requests.to_le_bytes());
        b[44..48].fill(0);
        b[48..56].copy_from_slice(&row.tokens.decode_routed_at_sum_ms.to_le_bytes());
        b[56..64].copy_from_slice(&row.tokens.touched_ms.to_le_bytes());
    }

    /// The pod's row, zero when absent.
    pub fn row(&self, id: PodId) -> Row {
        self.find(id).map(|i| self.read(i)).unwrap_or_default()
    }

    /// Applies `f` to the pod's row, creating it (at zero) when absent.
    fn modify(&mut self, id: PodId, f: impl FnOnce(&mut Row)) {
        let i = match self.find(id) {
            Ok(i) => i,
            Err(i) => {
                let at = Ledger::row_offset(i);
                self.bytes.splice(at..at, [0u8; ROW]);
                i
            }
        };
        let mut row = self.read(i);
        f(&mut row);
        self.write(i, id, &row);
    }

    /// Applies `f` only when the pod has a row: a release never re-creates a pruned pod.
    fn modify_existing(&mut self, id: PodId, f: impl FnOnce(&mut Row)) {
        if let Ok(i) = self.find(id) {
            let mut row = self.read(i);
            f(&mut row);
            self.write(i, id, &row);
        }
    }

    /// The pod's counters as selection sees them: local plus the other replicas' running.
    pub fn counts(&self, id: PodId) -> Counts {
        let mut counts = self.row(id).counts;
        if let Some((_, running)) = self.remote.as_ref().and_then(|r| r.get(id)) {
            counts.running = counts.running.saturating_add(running);
        }
        counts
    }

    pub fn tokens(&self, id: PodId) -> PodTokens {
        self.row(id).tokens
    }

    /// The rows of many pods in one merge pass: `order` lists `(id, slot)` sorted by id (a
    /// model precomputes it once per snapshot); the result holds each slot's row (zero when
    /// absent). One walk over both sorted sequences, no per-pod search.
    pub fn rows_for(&self, order: &[(PodId, usize)], slots: usize) -> Vec<Row> {
        let mut out = vec![Row::default(); slots];
        let (n, mut i) = (self.len(), 0usize);
        for &(id, slot) in order {
            while i < n && self.id_at(i) < id.0 {
                i += 1;
            }
            if i < n && self.id_at(i) == id.0 {
                if let Some(r) = out.get_mut(slot) {
                    *r = self.read(i);
                }
            }
        }
        if let Some(remote) = &self.remote {
            remote.add_to_rows(order, &mut out);
        }
        out
    }

    /// Row hints for the pods of one model, in one merge pass: `order` lists `(id, slot)`
    /// sorted by id, `out` gets one hint per slot (see [`RowHints`]).
    fn locate(&self, order: &[(PodId, usize)], out: &mut Vec<u32>) {
        out.clear();
        out.resize(order.len(), ABSENT);
        let (n, mut i) = (self.len(), 0usize);
        for &(id, slot) in order {
            while i < n && self.id_at(i) < id.0 {
                i += 1;
            }
            let hint = if i < n && self.id_at(i) == id.0 {
                i as u32
            } else {
                ABSENT | i as u32
            };
            if let Some(h) = out.get_mut(slot) {
                *h = hint;
            }
        }
    }

    /// In-flight prefill calls of the row at `i` (an index [`PreparedRows::row`] gave).
    pub fn prefill_inflight_at(&self, i: usize) -> u32 {
        u32_at(&self.bytes, Ledger::row_offset(i) + 8)
    }

    /// Running requests of the row at `i`.
    pub fn running_at(&self, i: usize) -> u32 {
        u32_at(&self.bytes, Ledger::row_offset(i) + 12)
    }

    /// The token ledger of the row at `i`.
    pub fn tokens_at(&self, i: usize) -> PodTokens {
        self.read(i).tokens
    }

    /// The token row of a pod by key (tests, gauges).
    pub fn pod(&self, key: &str) -> PodTokens {
        self.tokens(PodId::of(key))
    }

    pub fn counts_of(&self, key: &str) -> Counts {
        self.counts(PodId::of(key))
    }

    pub fn add(&mut self, key: &str, counter: Counter, now_ms: u64) {
        self.modify(PodId::of(key), |r| {
            let c = &mut r.counts;
            match counter {
                Counter::PrefillInflight => {
                    c.prefill_inflight = c.prefill_inflight.saturating_add(1)
                }
                Counter::Running => c.running = c.running.saturating_add(1),
            }
            r.tokens.touched_ms = now_ms;
        });
    }

    /// Releases one unit; counters never go below zero.
    pub fn release(&mut self, key: &str, counter: Counter, now_ms: u64) {
        self.modify_existing(PodId::of(key), |r| {
            let c = &mut r.counts;
            match counter {
                Counter::PrefillInflight => {
                    c.prefill_inflight = c.prefill_inflight.saturating_sub(1)
                }
                Counter::Running => c.running = c.running.saturating_sub(1),
            }
            r.tokens.touched_ms = now_ms;
        });
    }

    /// Charges a prefill selection and returns the request's handle.
    pub fn charge_prefill(&mut self, key: &str, cost: f64, now_ms: u64) -> Charge {
        self.modify(PodId::of(key), |r| r.tokens.charge_prefill(cost, now_ms));
        Charge {
            pod: key.to_string(),
            cost: amount(cost),
            charged_at_ms: now_ms,
            tokens_released: false,
            kv_released: false,
        }
    }

    /// Releases the active part once; `false` when it already was.
    pub fn release_tokens(&mut self, charge: &mut Charge, now_ms: u64) -> bool {
        if charge.tokens_released {
            return false;
        }
        charge.tokens_released = true;
        let cost = charge.cost;
        self.modify_existing(PodId::of(&charge.pod), |r| {
            r.tokens.release_tokens(cost, now_ms)
        });
        true
    }

    /// Releases the KV part once (it may come before the token release).
    pub fn release_kv(&mut self, charge: &mut Charge, now_ms: u64) -> bool {
        if charge.kv_released {
            return false;
        }
        charge.kv_released = true;
        let cost = charge.cost;
        self.modify_existing(PodId::of(&charge.pod), |r| {
            r.tokens.release_kv(cost, now_ms)
        });
        true
    }

    /// Releases whatever the charge still holds (prefill failure, completion, TTL).
    pub fn release_all(&mut self, charge: &mut Charge, now_ms: u64) {
        self.release_tokens(charge, now_ms);
        self.release_kv(charge, now_ms);
    }

    /// Charges a decode selection with the whole prompt (no request cost: the decode pod
    /// receives all of the prompt's KV, whatever the prefill pod had cached).
    pub fn charge_decode(&mut self, key: &str, prompt_tokens: u64, now_ms: u64) -> DecodeCharge {
        let tokens = prompt_tokens as f64;
        self.modify(PodId::of(key), |r| {
            r.tokens.charge_decode(tokens, now_ms, now_ms)
        });
        DecodeCharge {
            pod: key.to_string(),
            prompt_tokens: tokens,
            routed_at_ms: now_ms,
            released: false,
        }
    }

    /// Releases a decode charge once; `false` when it already was.
    pub fn release_decode(&mut self, charge: &mut DecodeCharge, now_ms: u64) -> bool {
        if charge.released {
            return false;
        }
        charge.released = true;
        let (tokens, at) = (charge.prompt_tokens, charge.routed_at_ms);
        self.modify_existing(PodId::of(&charge.pod), |r| {
            r.tokens.release_decode(tokens, at, now_ms)
        });
        true
    }

    /// Janitor: drops rows at zero load untouched for [`IDLE_PRUNE_MS`] (pods come and go
    /// under autoscaling; the next charge re-creates a pruned pod from zero). Returns how
    /// many were dropped.
    pub fn prune_idle(&mut self, now_ms: u64) -> usize {
        let before = self.len();
        let mut kept = MAGIC.to_vec();
        for i in 0..before {
            let row = self.read(i);
            if !(row.is_zero() && now_ms.saturating_sub(row.tokens.touched_ms) >= IDLE_PRUNE_MS) {
                kept.extend_from_slice(
                    &self.bytes[Ledger::row_offset(i)..Ledger::row_offset(i) + ROW],
                );
            }
        }
        self.bytes = kept;
        before - self.len()
    }
}

/// Marks a hint of a pod without a row; the low bits keep its insertion point.
const ABSENT: u32 = 1 << 31;
/// [`PreparedRows::read_counts`]'s row index of a pod without a row.
pub const NO_ROW: u32 = u32::MAX;

/// Where each pod of one model has its ledger row, so a selection reads rows by index
/// instead of merging the model's ids against the ledger every time.
///
/// Rows move when another pod's row is inserted or pruned. [`RowHints::prepare`] compares
/// the ledger's layout (its id sequence folded into one number, one pass over the ids) with
/// the one the hints were built for and rebuilds them in one merge pass when it changed; the
/// [`PreparedRows`] it returns then reads any pod's row without a per-pod check.
#[derive(Debug, Clone, Default)]
pub struct RowHints {
    /// `ModelView::uid` the hints were built for (0: none yet).
    model: u64,
    /// [`Ledger::layout`] of the ledger they were built from.
    layout: u64,
    hints: Vec<u32>,
    /// How many times the hints were rebuilt (for tests and the curious).
    rebuilds: u64,
}

/// Hints checked against one ledger: reads rows of that ledger by index.
#[derive(Debug, Clone, Copy)]
pub struct PreparedRows<'a> {
    hints: &'a [u32],
    ledger: &'a Ledger,
}

impl RowHints {
    /// Hints valid for `ledger`, rebuilt when they were made for another model or another
    /// layout of the ledger. `order` is the model's `(id, slot)` list sorted by id.
    pub fn prepare<'a>(
        &'a mut self,
        model: u64,
        ledger: &'a Ledger,
        order: &[(PodId, usize)],
    ) -> PreparedRows<'a> {
        let layout = ledger.layout();
        if self.model != model || self.layout != layout || self.hints.len() != order.len() {
            ledger.locate(order, &mut self.hints);
            self.model = model;
            self.layout = layout;
            self.rebuilds += 1;
        }
        PreparedRows {
            hints: &self.hints,
            ledger,
        }
    }

    pub fn rebuilds(&self) -> u64 {
        self.rebuilds
    }
}

impl PreparedRows<'_> {
    /// One counter of many pods: for the pod in `slots[k]`, `counts[k]` gets its `counter`
    /// (0 without a row) and `rows[k]` its row index ([`NO_ROW`] without one). The three
    /// slices are as long as `slots`; a slot outside the model reads as a pod without a row.
    pub fn read_counts(
        &self,
        counter: Counter,
        slots: &[usize],
        counts: &mut [u32],
        rows: &mut [u32],
    ) {
        let field = match counter {
            Counter::PrefillInflight => 8,
            Counter::Running => 12,
        };
        let bytes = self.ledger.bytes.as_slice();
        for (&slot, (count, row)) in slots.iter().zip(counts.iter_mut().zip(rows.iter_mut())) {
            let hint = self.hints.get(slot).copied().unwrap_or(ABSENT);
            let value = if hint & ABSENT == 0 {
                let at = Ledger::row_offset(hint as usize) + field;
                bytes.get(at..at + 4)
            } else {
                None
            };
            (*count, *row) = match value {
                Some(b) => (u32_at(b, 0), hint),
                None => (0, NO_ROW),
            };
        }
    }

    /// The row index of the pod in `slot`, if it has a row.
    pub fn row(&self, slot: usize) -> Option<usize> {
        let hint = self.hints.get(slot).copied()?;
        (hint & ABSENT == 0 && (hint as usize) < self.ledger.len()).then_some(hint as usize)
    }
}

/// Creates the ledger key if absent. Must run before concurrent use: Envoy ignores the CAS
/// token on a missing key, so two first writers would otherwise overwrite each other.
pub fn ensure_table(store: &dyn Store) -> Result<(), StoreError> {
    if store.get(LOAD_KEY)?.0.is_none() {
        store.set(LOAD_KEY, Ledger::default().as_bytes(), None)?;
    }
    Ok(())
}

/// Runs `f` on the current ledger and writes it back atomically; `f` is re-run on a
/// conflict, so it must be a pure function of the ledger (selection plus charges) and must
/// not commit side effects of its own before this returns.
pub fn update<R, E: From<StoreError>>(
    store: &dyn Store,
    mut f: impl FnMut(&mut Ledger) -> Result<R, E>,
) -> Result<R, E> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (bytes, cas) = store.get(LOAD_KEY)?;
        let mut ledger = match Ledger::from_bytes(bytes.unwrap_or_default()) {
            Ok(ledger) => ledger,
            Err(StoreError::Corrupt) => {
                // Unreadable for good (nothing here writes it so): start over empty rather
                // than fail every selection until a restart. The charges it held are lost;
                // their releases find nothing and stop at 0.
                store.set(LOAD_KEY, Ledger::default().as_bytes(), cas)?;
                return Err(StoreError::Corrupt.into());
            }
            Err(e) => return Err(e.into()),
        };
        let result = f(&mut ledger)?;
        if store.set(LOAD_KEY, ledger.as_bytes(), cas)? {
            return Ok(result);
        }
    }
    Err(StoreError::Contention(MAX_CAS_ATTEMPTS).into())
}

/// Reads the ledger without changing it.
pub fn read(store: &dyn Store) -> Result<Ledger, StoreError> {
    Ledger::from_bytes(store.get(LOAD_KEY)?.0.unwrap_or_default())
}

/// In-memory store for native tests and benchmarks.
#[derive(Default)]
pub struct MemoryStore {
    data: std::cell::RefCell<hashbrown::HashMap<String, (Vec<u8>, u32)>>,
}

impl Store for MemoryStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        Ok(match self.data.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, StoreError> {
        let mut data = self.data.borrow_mut();
        let current = data.get(key).map(|(_, c)| *c);
        if let (Some(current), Some(cas)) = (current, cas) {
            if current != cas {
                return Ok(false);
            }
        }
        let next = current.unwrap_or(0).wrapping_add(1);
        data.insert(key.to_string(), (value.to_vec(), next));
        Ok(true)
    }
}

#[cfg(test)]
mod tests;
