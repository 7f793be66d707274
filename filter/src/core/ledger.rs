//! Per-pod load counters and token ledgers shared by every Envoy worker, updated with
//! compare-and-swap.
//!
//! One shared-data key holds the whole [`Ledger`], so "select, then charge" is one CAS round:
//! a selection that raced with another worker's charge fails its write, re-reads and selects
//! again, and concurrent selections always see each other's charges.

use hashbrown::HashMap;

/// The shared-data key of the load table.
pub const LOAD_KEY: &str = "pd/load";
/// A CAS loop that keeps losing means something is badly wrong; give up instead of spinning.
const MAX_CAS_ATTEMPTS: usize = 256;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StoreError {
    #[error("shared data store failed: {0}")]
    Host(String),
    #[error("load table is corrupt")]
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

/// Counters of one pod.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Prefill legs sent to the pod and not yet answered.
    pub prefill_inflight: u32,
    /// Requests whose decode (or whole request, for combined pods) the pod owes.
    pub running: u32,
}

impl Counts {
    fn is_zero(&self) -> bool {
        self.prefill_inflight == 0 && self.running == 0
    }
}

/// Which counter a charge went to, so it can be released exactly once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    PrefillInflight,
    Running,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadTable {
    pods: HashMap<String, Counts>,
}

impl LoadTable {
    pub fn counts(&self, pod_key: &str) -> Counts {
        self.pods.get(pod_key).copied().unwrap_or_default()
    }

    pub fn add(&mut self, pod_key: &str, counter: Counter) {
        let c = self.pods.entry_ref(pod_key).or_default();
        match counter {
            Counter::PrefillInflight => c.prefill_inflight = c.prefill_inflight.saturating_add(1),
            Counter::Running => c.running = c.running.saturating_add(1),
        }
    }

    /// Releases one unit; counters never go below zero.
    pub fn release(&mut self, pod_key: &str, counter: Counter) {
        if let Some(c) = self.pods.get_mut(pod_key) {
            match counter {
                Counter::PrefillInflight => {
                    c.prefill_inflight = c.prefill_inflight.saturating_sub(1)
                }
                Counter::Running => c.running = c.running.saturating_sub(1),
            }
            if c.is_zero() {
                self.pods.remove(pod_key);
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Format: per pod `u16 key length, key bytes, u32 prefill_inflight, u32 running`,
    /// little-endian. Zero rows are never stored, so the table stays as small as the load.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.pods.len() * 40);
        for (key, c) in &self.pods {
            let len = key.len().min(u16::MAX as usize);
            out.extend_from_slice(&(len as u16).to_le_bytes());
            out.extend_from_slice(&key.as_bytes()[..len]);
            out.extend_from_slice(&c.prefill_inflight.to_le_bytes());
            out.extend_from_slice(&c.running.to_le_bytes());
        }
        out
    }

    pub fn decode(mut bytes: &[u8]) -> Result<LoadTable, StoreError> {
        let mut table = LoadTable::default();
        while !bytes.is_empty() {
            let (len, rest) = split_u16(bytes)?;
            let len = len as usize;
            if rest.len() < len + 8 {
                return Err(StoreError::Corrupt);
            }
            let key = std::str::from_utf8(&rest[..len]).map_err(|_| StoreError::Corrupt)?;
            let (prefill_inflight, rest) = split_u32(&rest[len..])?;
            let (running, rest) = split_u32(rest)?;
            table.pods.insert(
                key.to_string(),
                Counts {
                    prefill_inflight,
                    running,
                },
            );
            bytes = rest;
        }
        Ok(table)
    }
}

fn split_u16(b: &[u8]) -> Result<(u16, &[u8]), StoreError> {
    let (head, rest) = b.split_first_chunk::<2>().ok_or(StoreError::Corrupt)?;
    Ok((u16::from_le_bytes(*head), rest))
}

fn split_u32(b: &[u8]) -> Result<(u32, &[u8]), StoreError> {
    let (head, rest) = b.split_first_chunk::<4>().ok_or(StoreError::Corrupt)?;
    Ok((u32::from_le_bytes(*head), rest))
}

/// Everything charged to pods: request counters and the token ledgers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ledger {
    pub loads: LoadTable,
    pub tokens: crate::core::tokens::TokenTable,
}

impl Ledger {
    /// `u32` length of the counters, the counters, then the token table.
    pub fn encode(&self) -> Vec<u8> {
        let loads = self.loads.encode();
        let tokens = self.tokens.encode();
        let mut out = Vec::with_capacity(4 + loads.len() + tokens.len());
        out.extend_from_slice(&(loads.len() as u32).to_le_bytes());
        out.extend_from_slice(&loads);
        out.extend_from_slice(&tokens);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Ledger, StoreError> {
        if bytes.is_empty() {
            return Ok(Ledger::default());
        }
        let (len, rest) = split_u32(bytes)?;
        let len = len as usize;
        if rest.len() < len {
            return Err(StoreError::Corrupt);
        }
        Ok(Ledger {
            loads: LoadTable::decode(&rest[..len])?,
            tokens: crate::core::tokens::TokenTable::decode(&rest[len..])?,
        })
    }
}

/// Creates the table key if absent. Must run before concurrent use: Envoy ignores the CAS
/// token on a missing key, so two first writers would otherwise overwrite each other.
pub fn ensure_table(store: &dyn Store) -> Result<(), StoreError> {
    if store.get(LOAD_KEY)?.0.is_none() {
        store.set(LOAD_KEY, &[], None)?;
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
        let mut ledger = match bytes {
            Some(b) => Ledger::decode(&b)?,
            None => Ledger::default(),
        };
        let result = f(&mut ledger)?;
        if store.set(LOAD_KEY, &ledger.encode(), cas)? {
            return Ok(result);
        }
    }
    Err(StoreError::Contention(MAX_CAS_ATTEMPTS).into())
}

/// Reads the ledger without changing it.
pub fn read(store: &dyn Store) -> Result<Ledger, StoreError> {
    match store.get(LOAD_KEY)?.0 {
        Some(b) => Ledger::decode(&b),
        None => Ok(Ledger::default()),
    }
}

/// Releases one counter (idempotence is the caller's: it releases each charge it holds once).
pub fn release(store: &dyn Store, pod_key: &str, counter: Counter) -> Result<(), StoreError> {
    update(store, |l| {
        l.loads.release(pod_key, counter);
        Ok::<(), StoreError>(())
    })
}

/// In-memory store for native tests and benchmarks.
#[derive(Default)]
pub struct MemoryStore {
    data: std::cell::RefCell<HashMap<String, (Vec<u8>, u32)>>,
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
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn encode_decode_round_trip_drops_zero_rows() {
        let mut t = LoadTable::default();
        t.add("ns/a", Counter::Running);
        t.add("ns/a", Counter::PrefillInflight);
        t.add("ns/b", Counter::Running);
        t.release("ns/b", Counter::Running);
        t.release("ns/b", Counter::Running);
        let back = LoadTable::decode(&t.encode()).unwrap();
        assert_eq!(back, t);
        assert_eq!(
            back.counts("ns/a"),
            Counts {
                prefill_inflight: 1,
                running: 1
            }
        );
        assert_eq!(back.counts("ns/b"), Counts::default());
        assert_eq!(LoadTable::decode(&[3, 0, b'a']), Err(StoreError::Corrupt));
    }

    /// A store whose first write loses to another worker's charge, as under real contention.
    struct RacingStore {
        inner: MemoryStore,
        raced: Cell<bool>,
    }

    impl Store for RacingStore {
        fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, StoreError> {
            if !self.raced.replace(true) {
                let mut other = Ledger::default();
                other.loads.add("ns/a", Counter::Running);
                let (_, c) = self.inner.get(key)?;
                self.inner.set(key, &other.encode(), c)?;
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn a_conflicting_write_reruns_the_selection_on_fresh_data() {
        let store = RacingStore {
            inner: MemoryStore::default(),
            raced: Cell::new(false),
        };
        ensure_table(&store.inner).unwrap();
        let mut runs = 0;
        // "Select" the least-running of a and b, then charge it.
        let chosen = update(&store, |l| {
            let t = &mut l.loads;
            runs += 1;
            let pick = if t.counts("ns/a").running <= t.counts("ns/b").running {
                "ns/a"
            } else {
                "ns/b"
            };
            t.add(pick, Counter::Running);
            Ok::<_, StoreError>(pick)
        })
        .unwrap();
        assert_eq!(runs, 2, "the first attempt lost the race");
        assert_eq!(
            chosen, "ns/b",
            "the retry saw the other worker's charge on a"
        );
        let t = read(&store).unwrap().loads;
        assert_eq!((t.counts("ns/a").running, t.counts("ns/b").running), (1, 1));
        release(&store, "ns/a", Counter::Running).unwrap();
        release(&store, "ns/b", Counter::Running).unwrap();
        release(&store, "ns/b", Counter::Running).unwrap();
        assert!(read(&store).unwrap().loads.is_empty(), "never below zero");
    }
}
