//! Charges of VMs that trapped: every VM writes its journal (see `crate::core::journal`) to
//! shared data on each tick; about once a second each VM looks for journals whose heartbeat
//! stopped more than [`DEAD_AFTER_MS`] ago, and the one that wins the registry CAS releases
//! what they held. Envoy's FAIL_RELOAD replaces a trapped VM with a fresh one, whose new
//! token starts a new journal; the old one would otherwise pin load on its pods for ever.

use crate::core::journal::{self, Journal};
use crate::core::ledger::{self, Store, StoreError};
use crate::host::holds::charged_pods;
use crate::host::metrics::Metrics;
use crate::host::store::SharedData;
use crate::host::{SharedVm, VmState};

const REGISTRY_KEY: &str = "pd/journals";
/// A VM silent this long is dead: workers tick every refresh interval (50 ms by default),
/// so ten seconds is far beyond any pause of a live one.
pub const DEAD_AFTER_MS: u64 = 10_000;
const SCAN_EVERY_MS: u64 = 1_000;
/// What a reclaimed journal is overwritten with, followed by the heartbeat it had: a VM that
/// was only stalled finds it and forgets the holds the reclaim released.
const RECLAIMED: &[u8; 4] = b"PDJR";

pub struct JournalWriter {
    token: u64,
    key: String,
    registered: bool,
    next_scan: u64,
}

pub fn key_of(token: u64) -> String {
    format!("pd/journal/{token:016x}")
}

impl JournalWriter {
    pub fn new(token: u64) -> JournalWriter {
        JournalWriter {
            token,
            key: key_of(token),
            registered: false,
            next_scan: 0,
        }
    }

    /// Writes this VM's journal and, about once a second, reclaims dead VMs' charges.
    pub fn tick(&mut self, vm: &SharedVm, now: u64) {
        self.forget_reclaimed(vm);
        if !write(&vm.borrow(), now) {
            return;
        }
        if !self.registered {
            self.registered = register(self.token).is_ok();
        }
        if now >= self.next_scan {
            self.next_scan = now + SCAN_EVERY_MS;
            if let Err(e) = reclaim_dead(self.token, vm, now) {
                log::warn!("hold journal scan: {e}");
            }
        }
    }

    /// A stalled VM declared dead finds its journal replaced by the marker: the holds it had
    /// then were released by the reclaim, so it drops them (releasing them again would
    /// subtract other requests' load) and registers anew.
    fn forget_reclaimed(&mut self, vm: &SharedVm) {
        let Ok((Some(bytes), _)) = SharedData.get(&self.key) else {
            return;
        };
        let Some(rest) = bytes.strip_prefix(RECLAIMED.as_slice()) else {
            return;
        };
        let heartbeat = rest
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .unwrap_or(u64::MAX);
        let mut vm = vm.borrow_mut();
        let before = vm.holds.len();
        vm.holds.retain(|_, h| h.since_ms >= heartbeat);
        log::error!(
            "this VM was silent past {} s and declared dead: {} requests' charges were released by another VM",
            DEAD_AFTER_MS / 1000,
            before - vm.holds.len()
        );
        self.registered = false;
    }
}

/// Rewrites the VM's journal from its holds' records; false when shared data refused it.
pub fn write(vm: &VmState, now: u64) -> bool {
    let bytes = journal::assemble(now, vm.holds.values().map(|h| h.record.as_slice()));
    match SharedData.set(&vm.journal_key, &bytes, None) {
        Ok(_) => true,
        Err(e) => {
            log::warn!("cannot write the hold journal: {e}");
            false
        }
    }
}

fn parse(value: Option<&[u8]>) -> Vec<u64> {
    value
        .and_then(|v| std::str::from_utf8(v).ok())
        .unwrap_or("")
        .lines()
        .filter_map(|l| u64::from_str_radix(l.trim(), 16).ok())
        .collect()
}

fn render(tokens: &[u64]) -> String {
    tokens.iter().map(|t| format!("{t:016x}\n")).collect()
}

fn register(token: u64) -> Result<(), StoreError> {
    for _ in 0..16 {
        let (value, cas) = SharedData.get(REGISTRY_KEY)?;
        let mut tokens = parse(value.as_deref());
        if tokens.contains(&token) {
            return Ok(());
        }
        tokens.push(token);
        if SharedData.set(REGISTRY_KEY, render(&tokens).as_bytes(), cas)? {
            return Ok(());
        }
    }
    Err(StoreError::Contention(16))
}

/// Finds journals silent past [`DEAD_AFTER_MS`], takes them off the registry (one CAS: only
/// one VM wins and reclaims) and releases their charges.
fn reclaim_dead(own: u64, vm: &SharedVm, now: u64) -> Result<(), StoreError> {
    let (value, cas) = SharedData.get(REGISTRY_KEY)?;
    let tokens = parse(value.as_deref());
    let mut dead: Vec<(u64, Option<Journal>)> = Vec::new();
    for &t in tokens.iter().filter(|t| **t != own) {
        match SharedData.get(&key_of(t))? {
            (Some(bytes), _) => match journal::decode(&bytes) {
                Ok(j) if now.saturating_sub(j.heartbeat_ms) > DEAD_AFTER_MS => {
                    dead.push((t, Some(j)))
                }
                Ok(_) => {}
                Err(_) => dead.push((t, None)),
            },
            (None, _) => dead.push((t, None)),
        }
    }
    if dead.is_empty() {
        return Ok(());
    }
    let alive: Vec<u64> = tokens
        .iter()
        .copied()
        .filter(|t| !dead.iter().any(|(d, _)| d == t))
        .collect();
    if !SharedData.set(REGISTRY_KEY, render(&alive).as_bytes(), cas)? {
        return Ok(()); // another VM won this round; it reclaims
    }
    for (token, journal) in dead {
        crate::host::prefix_sharing::forget(token);
        let Some(journal) = journal else { continue };
        let reclaimed = ledger::update(&SharedData, |l| {
            Ok::<_, StoreError>(journal::reclaim(&journal, l, now))
        });
        match reclaimed {
            Ok(n) => {
                if n > 0 {
                    log::warn!(
                        "released the charges of {n} requests held by a VM silent for {} s (it trapped or stopped)",
                        now.saturating_sub(journal.heartbeat_ms) / 1000
                    );
                }
                let mut state = vm.borrow_mut();
                // The dead VM's pods may be new to this one: the next sync shows them at 0.
                state
                    .metrics
                    .track_pods(journal.holds.iter().flat_map(charged_pods));
                let legs = journal.prefill_legs_in_flight() as i64;
                Metrics::gauge_add(state.metrics.prefill_outstanding, -legs);
                drop(state);
                let mut marker = RECLAIMED.to_vec();
                marker.extend_from_slice(&journal.heartbeat_ms.to_le_bytes());
                let _ = SharedData.set(&key_of(token), &marker, None);
            }
            Err(e) => log::error!("cannot release a dead VM's charges: {e}"),
        }
    }
    Ok(())
}
