//! A VM's journal: the charges its in-flight requests still hold, written to shared data on
//! every tick with a heartbeat, so that when a VM traps (its hold registry dies with it) a
//! live VM can release what the dead one held instead of leaving it on the ledger for good.
//!
//! The heartbeat is a sequence number, not a time: a live VM is one whose sequence moves, as
//! another VM sees it over its own scans ([`Liveness`]). A time written by the VM and compared
//! with the reader's clock made every other VM look dead after a pause of the whole process
//! (a frozen container, a VM resumed after migration) or a forward step of the wall clock:
//! the first VM to tick afterwards released every other VM's in-flight charges.
//!
//! The journal is rewritten whenever the VM's holds change (right after the ledger write that
//! changed them), so it matches the ledger except inside that one step; each hold keeps its
//! encoded record, so a rewrite copies records rather than re-encoding every hold. The tick
//! rewrites it too, as the VM's heartbeat. Binary and compact, like the ledger.

use crate::core::charges::HeldCharges;
use crate::core::ledger::{Counter, Ledger};
use crate::core::tokens::{Charge, DecodeCharge};

const MAGIC: [u8; 4] = *b"PDJ\x02";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JournalError {
    #[error("journal is truncated or not a journal")]
    Malformed,
}

/// A decoded journal.
#[derive(Debug, Clone, PartialEq)]
pub struct Journal {
    /// Its VM's write sequence: it changes on every write (see [`Liveness`]), and a reclaim
    /// names it so the VM can tell which of its holds the reclaim released.
    pub seq: u64,
    /// The VM counts itself in `pd_router_fleet_loaded_vms` (it loaded a snapshot and has not
    /// ended): a dead one cannot take itself out, so its reclaimer does.
    pub loaded: bool,
    pub holds: Vec<HeldCharges>,
}

impl Journal {
    /// Prefill legs the VM had in flight: each raised `gateway_prefill_outstanding_requests`
    /// on that VM, which a dead VM can no longer lower, so its reclaimer lowers it instead.
    pub fn prefill_legs_in_flight(&self) -> usize {
        self.holds
            .iter()
            .flat_map(|h| &h.counters)
            .filter(|(_, c)| *c == crate::core::ledger::Counter::PrefillInflight)
            .count()
    }
}

/// Encodes the holds of one VM with its write sequence.
pub fn encode<'a>(seq: u64, loaded: bool, holds: impl Iterator<Item = &'a HeldCharges>) -> Vec<u8> {
    let records: Vec<Vec<u8>> = holds.map(record).collect();
    assemble(seq, loaded, records.iter().map(Vec::as_slice))
}

/// A journal from per-hold records (see [`record`]); empty records are skipped. Holds keep
/// their record and only re-encode it when their charges change, so writing the journal on
/// every change costs a copy of the records, not a re-encoding of every hold.
pub fn assemble<'a>(seq: u64, loaded: bool, records: impl Iterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&seq.to_le_bytes());
    out.push(u8::from(loaded));
    let count_at = out.len();
    out.extend_from_slice(&0u32.to_le_bytes());
    let mut count = 0u32;
    for r in records.filter(|r| !r.is_empty()) {
        count += 1;
        out.extend_from_slice(r);
    }
    out[count_at..count_at + 4].copy_from_slice(&count.to_le_bytes());
    out
}

/// One hold's record; empty when it holds nothing any more.
pub fn record(held: &HeldCharges) -> Vec<u8> {
    let mut out = Vec::new();
    if held.is_empty() {
        return out;
    }
    out.extend_from_slice(&(held.counters.len() as u16).to_le_bytes());
    for (key, counter) in &held.counters {
        put_str(&mut out, key);
        out.push(match counter {
            Counter::PrefillInflight => 0,
            Counter::Running => 1,
        });
    }
    match &held.prefill_tokens {
        Some(c) if !c.is_settled() => {
            out.push(1);
            put_str(&mut out, &c.pod);
            out.extend_from_slice(&c.cost.to_le_bytes());
            out.extend_from_slice(&c.charged_at_ms.to_le_bytes());
            out.push(u8::from(c.tokens_released) | (u8::from(c.kv_released) << 1));
        }
        _ => out.push(0),
    }
    match &held.decode_tokens {
        Some(d) if !d.released => {
            out.push(1);
            put_str(&mut out, &d.pod);
            out.extend_from_slice(&d.prompt_tokens.to_le_bytes());
            out.extend_from_slice(&d.routed_at_ms.to_le_bytes());
        }
        _ => out.push(0),
    }
    out
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let bytes = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    out.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// A cursor over journal bytes; every read is bounds-checked.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], JournalError> {
        let end = self.at.checked_add(n).ok_or(JournalError::Malformed)?;
        let s = self.b.get(self.at..end).ok_or(JournalError::Malformed)?;
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, JournalError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, JournalError> {
        let mut x = [0u8; 2];
        x.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(x))
    }
    fn u32(&mut self) -> Result<u32, JournalError> {
        let mut x = [0u8; 4];
        x.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(x))
    }
    fn u64(&mut self) -> Result<u64, JournalError> {
        let mut x = [0u8; 8];
        x.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(x))
    }
    fn f64(&mut self) -> Result<f64, JournalError> {
        Ok(f64::from_bits(self.u64()?))
    }
    fn string(&mut self) -> Result<String, JournalError> {
        let n = self.u16()? as usize;
        std::str::from_utf8(self.take(n)?)
            .map(str::to_string)
            .map_err(|_| JournalError::Malformed)
    }
}

pub fn decode(bytes: &[u8]) -> Result<Journal, JournalError> {
    let mut r = Reader { b: bytes, at: 0 };
    if r.take(4)? != MAGIC {
        return Err(JournalError::Malformed);
    }
    let seq = r.u64()?;
    let loaded = match r.u8()? {
        0 => false,
        1 => true,
        _ => return Err(JournalError::Malformed),
    };
    let count = r.u32()?;
    let mut holds = Vec::with_capacity((count as usize).min(4096));
    for _ in 0..count {
        let mut held = HeldCharges::default();
        for _ in 0..r.u16()? {
            let key = r.string()?;
            let counter = match r.u8()? {
                0 => Counter::PrefillInflight,
                1 => Counter::Running,
                _ => return Err(JournalError::Malformed),
            };
            held.counters.push((key, counter));
        }
        if r.u8()? == 1 {
            let pod = r.string()?;
            let cost = r.f64()?;
            let charged_at_ms = r.u64()?;
            let flags = r.u8()?;
            held.prefill_tokens = Some(Charge {
                pod,
                cost,
                charged_at_ms,
                tokens_released: flags & 1 != 0,
                kv_released: flags & 2 != 0,
            });
        }
        if r.u8()? == 1 {
            let pod = r.string()?;
            let prompt_tokens = r.f64()?;
            let routed_at_ms = r.u64()?;
            held.decode_tokens = Some(DecodeCharge {
                pod,
                prompt_tokens,
                routed_at_ms,
                released: false,
            });
        }
        holds.push(held);
    }
    Ok(Journal { seq, loaded, holds })
}

/// Releases everything a dead VM's journal says it held; returns how many requests' charges.
pub fn reclaim(journal: &Journal, ledger: &mut Ledger, now_ms: u64) -> usize {
    for held in &journal.holds {
        held.release_rest(ledger, now_ms);
    }
    journal.holds.len()
}

/// A journal whose sequence stood still this long on the watcher's own clock…
pub const DEAD_AFTER_MS: u64 = 10_000;
/// …and over this many of the watcher's own scans is its VM's last word. The scans are what
/// a pause of the whole process cannot fake: the watcher wakes with every other VM, and the
/// VMs that are alive write within a tick (at most a second), long before these scans pass.
pub const DEAD_AFTER_SCANS: u32 = 5;

/// One VM's view of which other VMs' journals went silent. Judged only by whether a journal's
/// sequence changes between this VM's own scans, timed on this VM's own monotonic clock: no
/// clock of another VM, and no wall clock, is read.
#[derive(Debug, Default)]
pub struct Liveness {
    watched: hashbrown::HashMap<u64, Watch>,
}

#[derive(Debug, Clone, Copy)]
struct Watch {
    seq: u64,
    since_ms: u64,
    scans: u32,
}

impl Liveness {
    /// Records that journal `token` reads `seq` at `now_ms` (the watcher's monotonic clock);
    /// when it has read the same for [`DEAD_AFTER_MS`] and [`DEAD_AFTER_SCANS`] scans, returns
    /// for how long (ms).
    pub fn observe(&mut self, token: u64, seq: u64, now_ms: u64) -> Option<u64> {
        let w = self.watched.entry(token).or_insert(Watch {
            seq,
            since_ms: now_ms,
            scans: 0,
        });
        if w.seq != seq {
            *w = Watch {
                seq,
                since_ms: now_ms,
                scans: 0,
            };
            return None;
        }
        w.scans = w.scans.saturating_add(1);
        let silent = now_ms.saturating_sub(w.since_ms);
        (silent >= DEAD_AFTER_MS && w.scans >= DEAD_AFTER_SCANS).then_some(silent)
    }

    /// Forgets journals no longer registered (reclaimed, or taken off by another VM).
    pub fn retain(&mut self, registered: &[u64]) {
        self.watched.retain(|t, _| registered.contains(t));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charge(ledger: &mut Ledger, p: &str, d: &str, tokens: u64) -> HeldCharges {
        ledger.add(p, Counter::PrefillInflight, 0);
        ledger.add(d, Counter::Running, 0);
        HeldCharges {
            counters: vec![
                (p.to_string(), Counter::PrefillInflight),
                (d.to_string(), Counter::Running),
            ],
            prefill_tokens: Some(ledger.charge_prefill(p, 3500.0 + tokens as f64, 0)),
            decode_tokens: Some(ledger.charge_decode(d, tokens, 0)),
        }
    }

    #[test]
    fn round_trips_what_is_still_held() {
        let mut ledger = Ledger::default();
        let a = charge(&mut ledger, "ns/p0", "ns/d0", 100);
        let b = charge(&mut ledger, "ns/p1", "ns/d1", 7).release_prefill_leg(&mut ledger, 1);
        let done = HeldCharges::default();
        let bytes = encode(42, true, [&a, &b, &done].into_iter());
        let j = decode(&bytes).unwrap();
        assert_eq!((j.seq, j.loaded), (42, true));
        assert!(
            !decode(&encode(43, false, std::iter::empty()))
                .unwrap()
                .loaded
        );
        assert_eq!(j.holds, vec![a, b], "empty holds are left out");
    }

    #[test]
    fn reclaiming_a_dead_vm_leaves_exactly_the_live_vms_charges() {
        let mut ledger = Ledger::default();
        let live = charge(&mut ledger, "ns/p0", "ns/d0", 300);
        let dead: Vec<HeldCharges> = (0..3)
            .map(|i| charge(&mut ledger, "ns/p0", "ns/d1", 50 * i + 1))
            .collect();
        // One of the dead VM's requests had its prefill leg answered before the trap.
        let dead = [
            dead[0].clone(),
            dead[1].release_prefill_leg(&mut ledger, 2),
            dead[2].clone(),
        ];
        let journal = decode(&encode(9, true, dead.iter())).unwrap();
        assert_eq!(journal.prefill_legs_in_flight(), 2, "one leg had answered");
        assert_eq!(reclaim(&journal, &mut ledger, 10), 3);
        live.release_rest(&mut ledger, 11);
        assert!(ledger.all_zero(), "{:?}", ledger.pod("ns/d1"));
    }

    #[test]
    fn garbage_is_refused_not_trusted() {
        assert_eq!(decode(b""), Err(JournalError::Malformed));
        assert_eq!(decode(b"PDJ\x02\x00"), Err(JournalError::Malformed));
        let mut ok = encode(1, false, std::iter::empty());
        ok[13] = 5; // claims five holds, has none
        assert_eq!(decode(&ok), Err(JournalError::Malformed));
        let mut flag = encode(1, false, std::iter::empty());
        flag[12] = 2;
        assert_eq!(
            decode(&flag),
            Err(JournalError::Malformed),
            "a flag is 0 or 1"
        );
        let mut older = encode(1, false, std::iter::empty());
        older[3] = 1;
        assert_eq!(
            decode(&older),
            Err(JournalError::Malformed),
            "another format"
        );
    }

    #[test]
    fn a_journal_is_dead_only_when_it_stood_still_over_time_and_scans() {
        let mut l = Liveness::default();
        // First read: the watch starts.
        assert_eq!(l.observe(7, 3, 1_000), None);
        // The whole process paused 15 s: the first scan after it reads the same sequence, but
        // one scan is no evidence (the VM had no chance to write yet).
        assert_eq!(l.observe(7, 3, 16_000), None);
        // The VM writes at its first tick: the watch starts over.
        assert_eq!(l.observe(7, 4, 16_050), None);
        for i in 1..=DEAD_AFTER_SCANS as u64 {
            assert_eq!(l.observe(7, 4, 16_050 + i * 1_000), None, "scan {i}");
        }
        // Enough scans, not enough time.
        assert_eq!(l.observe(7, 4, 16_050 + 9_000), None);
        // Both.
        assert_eq!(l.observe(7, 4, 16_050 + 10_000), Some(10_000));
        // Another journal is watched on its own.
        assert_eq!(l.observe(8, 1, 26_050), None);
    }

    #[test]
    fn many_scans_in_a_short_time_are_not_silence() {
        let mut l = Liveness::default();
        for i in 0..100 {
            assert_eq!(l.observe(1, 9, i * 10), None, "scan at {} ms", i * 10);
        }
    }

    #[test]
    fn forgotten_journals_start_a_new_watch() {
        let mut l = Liveness::default();
        l.observe(5, 1, 0);
        for i in 1..=10 {
            l.observe(5, 1, i * 1_000);
        }
        l.retain(&[]);
        assert_eq!(l.observe(5, 1, 11_000), None, "a new watch starts");
    }
}
