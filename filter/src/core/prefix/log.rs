//! How the workers' prefix indexes learn from each other: each VM appends its batches of
//! prefix events to a ring of its own in shared data, and a VM reads the others' rings just
//! before a selection that consults its index (and on its ticks once it has).
//!
//! Why pull rather than push: a message on another VM's queue is a cross-thread post that
//! wakes that thread, once per batch and per VM. At a low rate that was ≈ 100 µs of CPU per
//! request in the threads that did not serve it, the main thread included, which never routes
//! and so never needed the events. Pulled, the events cost nothing in VMs that do not route,
//! a VM that starts routing late still finds the recent history in the rings, and a reader is
//! as fresh as it can be at the moment it selects: it reads what was published up to then.
//!
//! Layout in shared data:
//! - [`HEADS_KEY`]: for every writer, its token, its last sequence number and when it wrote
//!   (one 24-byte record each, behind a version byte). One small read tells a reader whether
//!   anything is new, from whom; writers update their record by compare-and-swap.
//! - `pd/prefix/<token>/<slot>`: sequence number `seq` sits in slot `seq % RING`, stored as
//!   `seq (u64 le) ‖ batch`. A writer stores the entry before it advances its head, so every
//!   entry a head promises exists; a reader that fell more than [`RING`] batches behind finds
//!   a slot holding a later number and counts the batch as missed.

use crate::core::ledger::{Store, StoreError};

use super::{EventBatch, EventError, EventRef, RingEntry, ENTRY_HEADER};

/// Key of the writers' heads.
pub const HEADS_KEY: &str = "pd/prefix/heads";
/// Batches each writer keeps at most. A batch is one or more selections' events (a request
/// publishes what gathered until its response starts), so at 2 000 requests a second a reader
/// that looks every 50 ms needs well under a hundred. The bytes kept are bounded too (see
/// [`PrefixLog::publish`]).
pub const RING: u64 = 128;
/// A batch this large is published at once instead of waiting for a response to start.
pub const MAX_BATCH_BYTES: usize = 64 << 10;
/// A writer silent this long drops out of the heads (whoever publishes next prunes it), so
/// readers stop looking at its ring: readers that follow have its events already, and a
/// worker that starts routing this much later does without them.
pub const FORGET_AFTER_MS: u64 = 10 * 60 * 1000;

const HEADS_VERSION: u8 = 1;
const RECORD: usize = 24;
const MAX_CAS_ATTEMPTS: usize = 16;

/// One writer's entry in [`HEADS_KEY`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub writer: u64,
    /// Sequence number of its newest batch (the first is 1).
    pub seq: u64,
    /// When it published that batch, ms since the epoch.
    pub at_ms: u64,
}

/// The records of a heads value; an unknown version reads as no writers and a torn last
/// record is left out (the next publish rewrites the value whole).
pub fn heads(bytes: &[u8]) -> impl Iterator<Item = Head> + '_ {
    let records = match bytes.split_first() {
        Some((&HEADS_VERSION, rest)) => rest,
        _ => &[],
    };
    records.chunks_exact(RECORD).map(|r| {
        let u = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&r[i..i + 8]);
            u64::from_le_bytes(b)
        };
        Head {
            writer: u(0),
            seq: u(8),
            at_ms: u(16),
        }
    })
}

/// A heads value holding `records`, in order.
fn encode_heads(records: impl Iterator<Item = Head>) -> Vec<u8> {
    let mut out = vec![HEADS_VERSION];
    for h in records {
        out.extend_from_slice(&h.writer.to_le_bytes());
        out.extend_from_slice(&h.seq.to_le_bytes());
        out.extend_from_slice(&h.at_ms.to_le_bytes());
    }
    out
}

/// `current` with `head` in place of its writer's record, and writers silent since before
/// `forget_before` (other than `head`'s) left out.
pub fn with_head(current: &[u8], head: Head, forget_before: u64) -> Vec<u8> {
    let others = heads(current).filter(|h| h.writer != head.writer && h.at_ms >= forget_before);
    encode_heads(others.chain(std::iter::once(head)))
}

/// `current` without `writer`'s record.
pub fn without(current: &[u8], writer: u64) -> Vec<u8> {
    encode_heads(heads(current).filter(|h| h.writer != writer))
}

/// Key of the slot `seq` goes to in `writer`'s ring, written into `out` (reused by the caller:
/// a catch-up reads many).
pub fn slot_key(out: &mut String, writer: u64, seq: u64) {
    use std::fmt::Write;
    out.clear();
    let _ = write!(out, "pd/prefix/{writer:016x}/{}", seq % RING);
}

/// The sequence numbers a reader that has read up to `read` (0: nothing) should now read from
/// a writer whose head is `head`, and how many it can no longer read because the ring has
/// moved past them.
pub fn to_read(read: u64, head: u64) -> (std::ops::RangeInclusive<u64>, u64) {
    let oldest_kept = head.saturating_sub(RING - 1).max(1);
    let from = (read + 1).max(oldest_kept);
    (from..=head, from - (read + 1).min(from))
}

/// What a catch-up did: batches applied and their size as stored, batches lost to the ring,
/// and the first event that did not decode (a peer's bug; the rest of its batch is skipped).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CatchUp {
    pub batches: u64,
    pub bytes: u64,
    pub missed: u64,
    pub malformed: Option<EventError>,
}

/// One VM's side of the exchange: its own ring and how far it has read every other writer's.
#[derive(Debug)]
pub struct PrefixLog {
    writer: u64,
    /// Sequence number of the last batch this VM published.
    seq: u64,
    /// Per other writer, the last sequence number read.
    read: Vec<(u64, u64)>,
    /// Whether this VM reads the others' rings on its ticks: from its first catch-up on (a VM
    /// that never selects with a prefix policy never reads).
    following: bool,
    key: String,
    /// Bytes in each slot of this VM's ring, their sum, and the oldest sequence number whose
    /// slot may still hold its batch.
    sizes: Vec<usize>,
    stored: usize,
    oldest: u64,
    /// The heads as this VM last read them, with their CAS: the next publish writes over them
    /// without reading them again while no other VM has written them since (a selection's
    /// catch-up reads them moments before its request's batch is published; a read that
    /// returns bytes costs a VM ≈ 9 500 instructions).
    heads_seen: Option<(Vec<u8>, u32)>,
}

impl PrefixLog {
    /// `writer`: this VM's token, unique in the process.
    pub fn new(writer: u64) -> PrefixLog {
        PrefixLog {
            writer,
            seq: 0,
            read: Vec::new(),
            following: false,
            key: String::with_capacity(40),
            sizes: vec![0; RING as usize],
            stored: 0,
            oldest: 1,
            heads_seen: None,
        }
    }

    pub fn is_following(&self) -> bool {
        self.following
    }

    /// Appends `entry` (an [`EventBatch::take_entry`], stored as it is with its sequence
    /// number filled in) to this VM's ring, then advances its head.
    ///
    /// The ring keeps at most [`RING`] batches and, besides the newest one, at most
    /// `budget_bytes`: older slots are emptied to make room. Give it what a reader's index can
    /// hold (its capacity in blocks times the block size): prompts older than that would be
    /// evicted from a reader's index as they were applied, and with long prompts [`RING`]
    /// batches alone could pin tens of megabytes per worker.
    pub fn publish(
        &mut self,
        store: &dyn Store,
        mut entry: RingEntry,
        now_ms: u64,
        budget_bytes: usize,
    ) -> Result<(), StoreError> {
        let seq = self.seq + 1;
        slot_key(&mut self.key, self.writer, seq);
        store.set(&self.key, entry.stamped(seq), None)?;
        // The slot is written even if the head update fails below; the next publish takes
        // the next number, and readers never look past a head.
        self.seq = seq;
        self.account(store, seq, entry.len(), budget_bytes)?;
        let head = Head {
            writer: self.writer,
            seq,
            at_ms: now_ms,
        };
        let forget_before = now_ms.saturating_sub(FORGET_AFTER_MS);
        // The heads last read go first: a CAS that still matches means they are the current
        // ones. On a mismatch they cost one refused write, and the loop reads them.
        let mut seen = self.heads_seen.take();
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (current, cas) = match seen.take() {
                Some((bytes, cas)) => (Some(bytes), Some(cas)),
                None => store.get(HEADS_KEY)?,
            };
            let Some(current) = current else {
                // Envoy checks no CAS on a key it does not have: create the key empty and
                // go round, so the record itself is always written under a CAS.
                store.set(HEADS_KEY, &[HEADS_VERSION], None)?;
                continue;
            };
            if store.set(HEADS_KEY, &with_head(&current, head, forget_before), cas)? {
                return Ok(());
            }
        }
        Err(StoreError::Contention(MAX_CAS_ATTEMPTS))
    }

    /// Books `len` bytes into `seq`'s slot (forgetting the lap it replaced) and empties the
    /// oldest slots while those before `seq` hold more than `budget_bytes`.
    fn account(
        &mut self,
        store: &dyn Store,
        seq: u64,
        len: usize,
        budget_bytes: usize,
    ) -> Result<(), StoreError> {
        let slot = (seq % RING) as usize;
        self.stored = self.stored - self.sizes[slot] + len;
        self.sizes[slot] = len;
        self.oldest = self.oldest.max(seq.saturating_sub(RING - 1));
        while self.oldest < seq && self.stored - len > budget_bytes {
            let old = (self.oldest % RING) as usize;
            if self.sizes[old] > 0 {
                slot_key(&mut self.key, self.writer, self.oldest);
                store.set(&self.key, &[], None)?;
                self.stored -= self.sizes[old];
                self.sizes[old] = 0;
            }
            self.oldest += 1;
        }
        Ok(())
    }

    /// Applies, in order, every batch the other writers published since this VM last looked.
    /// A writer seen for the first time is read from the oldest batch its ring still holds, so
    /// a VM that starts routing late learns the recent history.
    pub fn catch_up(
        &mut self,
        store: &dyn Store,
        mut apply: impl FnMut(EventRef<'_>),
    ) -> Result<CatchUp, StoreError> {
        self.following = true;
        let mut done = CatchUp::default();
        let (Some(bytes), cas) = store.get(HEADS_KEY)? else {
            return Ok(done);
        };
        let mut seen = 0usize;
        for head in heads(&bytes).filter(|h| h.writer != self.writer) {
            seen += 1;
            let at = match self.read.iter().position(|(w, _)| *w == head.writer) {
                Some(i) => i,
                None => {
                    self.read.push((head.writer, 0));
                    self.read.len() - 1
                }
            };
            let read = self.read[at].1;
            if head.seq <= read {
                continue;
            }
            let (range, lost) = to_read(read, head.seq);
            // A writer new to this VM: what its ring no longer holds was never this VM's to miss.
            let counts = read > 0;
            if counts {
                done.missed = done.missed.saturating_add(lost);
            }
            for seq in range {
                slot_key(&mut self.key, head.writer, seq);
                let entry = store.get(&self.key)?.0.unwrap_or_default();
                match entry.split_at_checked(ENTRY_HEADER) {
                    Some((n, batch)) if n == seq.to_le_bytes() => {
                        done.batches += 1;
                        done.bytes += entry.len() as u64;
                        for event in EventBatch::events(batch) {
                            match event {
                                Ok(e) => apply(e),
                                Err(e) => done.malformed = Some(e),
                            }
                        }
                    }
                    // Emptied for room, or overwritten by a later lap while this VM read
                    // the earlier slots.
                    _ => done.missed = done.missed.saturating_add(u64::from(counts)),
                }
            }
            self.read[at].1 = head.seq;
        }
        // Writers gone from the heads (reclaimed or forgotten) are not read again.
        if seen < self.read.len() {
            self.read
                .retain(|(w, _)| heads(&bytes).any(|h| h.writer == *w));
        }
        self.heads_seen = cas.map(|cas| (bytes, cas));
        Ok(done)
    }
}

/// Takes a dead VM's ring out of the heads and empties its slots (shared data has no delete):
/// its events stop being read and its memory is returned.
pub fn forget_writer(store: &dyn Store, writer: u64) -> Result<(), StoreError> {
    let mut key = String::new();
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (current, cas) = store.get(HEADS_KEY)?;
        let Some(current) = current else {
            return Ok(());
        };
        if !heads(&current).any(|h| h.writer == writer) {
            return Ok(());
        }
        if store.set(HEADS_KEY, &without(&current, writer), cas)? {
            for slot in 0..RING {
                slot_key(&mut key, writer, slot);
                if store.get(&key)?.0.is_some() {
                    store.set(&key, &[], None)?;
                }
            }
            return Ok(());
        }
    }
    Err(StoreError::Contention(MAX_CAS_ATTEMPTS))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ledger::MemoryStore;

    fn batch_of(prompts: &[&str]) -> RingEntry {
        events_of(prompts).take_entry()
    }

    fn events_of(prompts: &[&str]) -> EventBatch {
        let mut b = EventBatch::default();
        for (i, p) in prompts.iter().enumerate() {
            b.push(EventRef {
                model: "m",
                pod: "ns/p",
                stream: p.as_bytes(),
                at_ms: i as u64,
            });
        }
        b
    }

    fn put(log: &mut PrefixLog, store: &MemoryStore, prompts: &[&str], now_ms: u64) {
        log.publish(store, batch_of(prompts), now_ms, usize::MAX)
            .expect("publish");
    }

    fn read_all(log: &mut PrefixLog, store: &MemoryStore) -> (Vec<String>, CatchUp) {
        let mut seen = Vec::new();
        let done = log
            .catch_up(store, |e| {
                seen.push(String::from_utf8(e.stream.to_vec()).unwrap_or_default())
            })
            .expect("catch up");
        (seen, done)
    }

    #[test]
    fn a_reader_gets_every_other_writers_batches_in_order_and_once() {
        let store = MemoryStore::default();
        let (mut a, mut b, mut r) = (PrefixLog::new(1), PrefixLog::new(2), PrefixLog::new(3));
        put(&mut a, &store, &["a1", "a2"], 10);
        put(&mut b, &store, &["b1"], 11);
        put(&mut a, &store, &["a3"], 12);
        let (seen, done) = read_all(&mut r, &store);
        let from = |w: char| -> Vec<&str> {
            seen.iter()
                .map(String::as_str)
                .filter(|s| s.starts_with(w))
                .collect()
        };
        assert_eq!((from('a'), from('b')), (vec!["a1", "a2", "a3"], vec!["b1"]));
        assert_eq!((done.batches, done.missed), (3, 0));
        assert_eq!(read_all(&mut r, &store).0, Vec::<String>::new());
        put(&mut b, &store, &["b2"], 13);
        assert_eq!(read_all(&mut r, &store).0, ["b2"]);
    }

    /// A store that counts reads of the heads.
    #[derive(Default)]
    struct CountingStore {
        inner: MemoryStore,
        heads_reads: std::cell::Cell<usize>,
    }

    impl Store for CountingStore {
        fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            if key == HEADS_KEY {
                self.heads_reads.set(self.heads_reads.get() + 1);
            }
            self.inner.get(key)
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, StoreError> {
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn a_publish_after_a_catch_up_writes_the_heads_it_read_unless_another_wrote_them_since() {
        let store = CountingStore::default();
        let (mut a, mut b, mut r) = (PrefixLog::new(1), PrefixLog::new(2), PrefixLog::new(3));
        let publish = |log: &mut PrefixLog, prompt: &str| {
            log.publish(&store, batch_of(&[prompt]), 10, usize::MAX)
                .expect("publish")
        };
        let catch_up = |log: &mut PrefixLog| {
            let mut seen = Vec::new();
            log.catch_up(&store, |e| seen.push(e.stream.to_vec()))
                .expect("catch up");
            seen
        };
        publish(&mut b, "b1");
        assert_eq!(catch_up(&mut a), [b"b1".to_vec()]);
        let reads = store.heads_reads.get();
        publish(&mut a, "a1");
        assert_eq!(
            store.heads_reads.get(),
            reads,
            "the heads just read were written"
        );
        // b publishes between a's read and a's publish: a's write is refused, read, redone.
        assert_eq!(catch_up(&mut a), Vec::<Vec<u8>>::new());
        publish(&mut b, "b2");
        let reads = store.heads_reads.get();
        publish(&mut a, "a2");
        assert_eq!(store.heads_reads.get(), reads + 1);
        // Every batch reached a reader, and both writers' heads survived.
        let mut seen = catch_up(&mut r);
        seen.sort();
        assert_eq!(
            seen,
            [
                b"a1".to_vec(),
                b"a2".to_vec(),
                b"b1".to_vec(),
                b"b2".to_vec()
            ]
        );
        assert_eq!(catch_up(&mut a), [b"b2".to_vec()]);
        publish(&mut a, "a3");
        assert_eq!(
            catch_up(&mut b),
            [b"a1".to_vec(), b"a2".to_vec(), b"a3".to_vec()]
        );
    }

    #[test]
    fn a_writer_never_reads_its_own_batches() {
        let store = MemoryStore::default();
        let (mut a, mut b) = (PrefixLog::new(1), PrefixLog::new(2));
        put(&mut a, &store, &["a1"], 10);
        put(&mut b, &store, &["b1"], 10);
        assert_eq!(read_all(&mut a, &store).0, ["b1"]);
        assert_eq!(read_all(&mut b, &store).0, ["a1"]);
    }

    #[test]
    fn a_reader_that_fell_a_lap_behind_reads_what_the_ring_holds_and_counts_the_rest() {
        let store = MemoryStore::default();
        let (mut a, mut r) = (PrefixLog::new(1), PrefixLog::new(2));
        put(&mut a, &store, &["first"], 1);
        assert_eq!(read_all(&mut r, &store).0, ["first"]);
        let extra = 10;
        for i in 0..RING + extra {
            put(&mut a, &store, &[&format!("e{i}")], 2);
        }
        let (seen, done) = read_all(&mut r, &store);
        assert_eq!(seen.len() as u64, RING);
        assert_eq!(
            seen.first().map(String::as_str),
            Some(&*format!("e{extra}"))
        );
        assert_eq!(done.missed, extra);
    }

    #[test]
    fn a_late_reader_learns_the_history_the_ring_still_holds_without_counting_a_loss() {
        let store = MemoryStore::default();
        let mut a = PrefixLog::new(1);
        for i in 0..RING + 5 {
            put(&mut a, &store, &[&format!("e{i}")], 2);
        }
        let (seen, done) = read_all(&mut PrefixLog::new(2), &store);
        assert_eq!(seen.len() as u64, RING);
        assert_eq!(
            seen.last().map(String::as_str),
            Some(&*format!("e{}", RING + 4))
        );
        assert_eq!(done.missed, 0);
    }

    #[test]
    fn the_ring_keeps_no_more_bytes_than_its_budget_beyond_the_newest_batch() {
        let store = MemoryStore::default();
        let (mut a, mut follower, mut laggard) =
            (PrefixLog::new(1), PrefixLog::new(2), PrefixLog::new(3));
        let big = "x".repeat(1000);
        let stored = |s: &MemoryStore| -> usize {
            let mut key = String::new();
            (0..RING)
                .map(|slot| {
                    slot_key(&mut key, 1, slot);
                    s.get(&key).unwrap().0.map_or(0, |v| v.len())
                })
                .sum()
        };
        a.publish(&store, batch_of(&[&big]), 1, 3_100).unwrap();
        assert_eq!(read_all(&mut laggard, &store).0.len(), 1);
        assert_eq!(read_all(&mut follower, &store).0.len(), 1);
        for _ in 0..10 {
            a.publish(&store, batch_of(&[&big]), 1, 3_100).unwrap();
            // A reader that keeps up reads every batch before it is dropped.
            let (seen, done) = read_all(&mut follower, &store);
            assert_eq!((seen.len(), done.missed), (1, 0));
            assert!(stored(&store) <= 3_100 + 1_100, "{}", stored(&store));
        }
        // Three older ones fit the budget besides the newest; the laggard missed the rest.
        let (seen, done) = read_all(&mut laggard, &store);
        assert_eq!((seen.len(), done.missed), (4, 6));
    }

    #[test]
    fn a_slot_overwritten_between_the_head_read_and_the_slot_read_counts_as_missed() {
        let store = MemoryStore::default();
        let (mut a, mut r) = (PrefixLog::new(1), PrefixLog::new(2));
        put(&mut a, &store, &["w"], 1);
        assert_eq!(read_all(&mut r, &store).0, ["w"]);
        put(&mut a, &store, &["x"], 1);
        // The slot of seq 2 now holds a later lap, as if the writer wrapped in between.
        let mut key = String::new();
        slot_key(&mut key, 1, 2);
        let mut lapped = (2 + RING).to_le_bytes().to_vec();
        lapped.extend_from_slice(&events_of(&["y"]).take());
        store.set(&key, &lapped, None).unwrap();
        let (seen, done) = read_all(&mut r, &store);
        assert!(seen.is_empty());
        assert_eq!((done.batches, done.missed), (0, 1));
    }

    #[test]
    fn a_malformed_event_ends_its_batch_and_is_reported() {
        let store = MemoryStore::default();
        let (mut a, mut r) = (PrefixLog::new(1), PrefixLog::new(2));
        let mut bad = batch_of(&["good"]);
        bad.append_raw(&[3, 9, 9, 9]);
        a.publish(&store, bad, 1, usize::MAX).unwrap();
        let (seen, done) = read_all(&mut r, &store);
        assert_eq!(seen, ["good"]);
        assert!(done.malformed.is_some());
    }

    #[test]
    fn silent_writers_are_pruned_by_the_next_publish_and_forgotten_ones_are_not_read() {
        let store = MemoryStore::default();
        let (mut a, mut b, mut r) = (PrefixLog::new(1), PrefixLog::new(2), PrefixLog::new(3));
        put(&mut a, &store, &["a"], 1_000);
        b.publish(
            &store,
            batch_of(&["b"]),
            1_000 + FORGET_AFTER_MS + 1,
            usize::MAX,
        )
        .unwrap();
        let writers = |s: &MemoryStore| -> Vec<u64> {
            heads(&s.get(HEADS_KEY).unwrap().0.unwrap())
                .map(|h| h.writer)
                .collect()
        };
        assert_eq!(writers(&store), [2]);
        forget_writer(&store, 2).unwrap();
        assert!(writers(&store).is_empty());
        let mut key = String::new();
        slot_key(&mut key, 2, 1);
        assert_eq!(store.get(&key).unwrap().0.as_deref(), Some(&[][..]));
        assert!(read_all(&mut r, &store).0.is_empty());
    }

    #[test]
    fn heads_survive_concurrent_writers() {
        // Two writers' CAS rounds interleave through a store that answers a stale token once.
        struct Racing<'a> {
            inner: &'a MemoryStore,
            other: std::cell::RefCell<Option<(PrefixLog, RingEntry)>>,
        }
        impl Store for Racing<'_> {
            fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
                let got = self.inner.get(key)?;
                if key == HEADS_KEY {
                    if let Some((mut log, batch)) = self.other.borrow_mut().take() {
                        log.publish(self.inner, batch, 5, usize::MAX)?;
                    }
                }
                Ok(got)
            }
            fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, StoreError> {
                self.inner.set(key, value, cas)
            }
        }
        let store = MemoryStore::default();
        // The key exists (an earlier publish made it), so both rounds are checked CAS.
        store.set(HEADS_KEY, &[HEADS_VERSION], None).unwrap();
        let racing = Racing {
            inner: &store,
            other: std::cell::RefCell::new(Some((PrefixLog::new(2), batch_of(&["b"])))),
        };
        PrefixLog::new(1)
            .publish(&racing, batch_of(&["a"]), 5, usize::MAX)
            .unwrap();
        let mut seen = read_all(&mut PrefixLog::new(3), &store).0;
        seen.sort();
        assert_eq!(seen, ["a", "b"]);
    }

    #[test]
    fn to_read_covers_the_window_the_ring_holds() {
        assert_eq!(to_read(0, 3), (1..=3, 0));
        assert_eq!(to_read(3, 5), (4..=5, 0));
        assert_eq!(to_read(0, RING + 2), (3..=RING + 2, 2));
        assert_eq!(to_read(1, RING + 2), (3..=RING + 2, 1));
        assert_eq!(to_read(2, RING + 2), (3..=RING + 2, 0));
    }

    #[test]
    fn heads_naming_a_writer_twice_or_at_the_last_number_do_not_overflow_the_count() {
        // Found by the shared_state fuzz target: corrupt heads, not something a writer makes.
        let store = MemoryStore::default();
        let mut bytes = vec![HEADS_VERSION];
        for (writer, seq) in [(7, 3), (7, u64::MAX), (7, u64::MAX), (8, 3), (8, u64::MAX)] {
            for field in [writer, seq, 0] {
                bytes.extend_from_slice(&field.to_le_bytes());
            }
        }
        store.set(HEADS_KEY, &bytes, None).unwrap();
        let done = PrefixLog::new(1).catch_up(&store, |_| {}).unwrap();
        assert_eq!(done.batches, 0);
        assert!(done.missed > 0);
    }

    #[test]
    fn garbage_heads_read_as_no_writers() {
        assert_eq!(heads(&[]).count(), 0);
        assert_eq!(heads(&[9, 1, 2, 3]).count(), 0);
        let one = with_head(
            &[],
            Head {
                writer: 7,
                seq: 1,
                at_ms: 2,
            },
            0,
        );
        let mut torn = one.clone();
        torn.pop();
        assert_eq!(heads(&one).count(), 1);
        assert_eq!(heads(&torn).count(), 0);
    }
}
