//! Charges of VMs that trapped: every VM writes its journal (see `crate::core::journal`) to
//! shared data on each tick; about once a second each VM reads the others' journals, and one
//! whose sequence stood still over its reader's scans ([`Liveness`]) is dead: the VM that wins
//! the registry CAS releases what it held. Envoy's FAIL_RELOAD replaces a trapped VM with a
//! fresh one, whose new token starts a new journal; the old one would otherwise pin load on
//! its pods for ever.

use crate::core::journal::{self, Journal, Liveness, DEAD_AFTER_MS};
use crate::core::ledger::{self, Store, StoreError};
use crate::host::holds::charged_pods;
use crate::host::metrics::Metrics;
use crate::host::store::SharedData;
use crate::host::{SharedVm, VmState};

/// Journals are of the ledger's format generation (see [`ledger::GENERATION`]): a dead VM of
/// another generation charged another ledger, so its journal must not be reclaimed from ours.
const REGISTRY_KEY: &str = "pd/g2/journals";
const _: () = assert!(
    ledger::GENERATION == 2,
    "the journal keys name the generation"
);
const SCAN_EVERY_MS: u64 = 1_000;

pub struct JournalWriter {
    token: u64,
    /// Where a reclaim of this VM's journal is recorded (see [`reclaimed_key`]).
    reclaimed_key: String,
    /// On this VM's monotonic clock (`host::steady_ms`).
    next_scan: u64,
    liveness: Liveness,
}

pub fn key_of(token: u64) -> String {
    format!("pd/g2/journal/{token:016x}")
}

/// A key of its own, not the journal's: the VM rewrites its journal whenever its holds
/// change, which would erase a marker left there before the VM's next tick could read it
/// (and the VM would then release the reclaimed charges a second time).
fn reclaimed_key(token: u64) -> String {
    format!("pd/g2/journal-reclaimed/{token:016x}")
}

impl JournalWriter {
    pub fn new(token: u64) -> JournalWriter {
        JournalWriter {
            token,
            reclaimed_key: reclaimed_key(token),
            next_scan: 0,
            liveness: Liveness::default(),
        }
    }

    /// Writes this VM's journal and, about once a second, reclaims dead VMs' charges.
    pub fn tick(&mut self, vm: &SharedVm) {
        self.forget_reclaimed(vm);
        if !write(&vm.borrow()) {
            return;
        }
        let now = crate::host::steady_ms();
        if now >= self.next_scan {
            self.next_scan = now + SCAN_EVERY_MS;
            if let Err(e) = self.reclaim_dead(vm, now) {
                log::warn!("hold journal scan: {e}");
            }
        }
    }

    /// A VM that was declared dead (it stopped writing for a long time while the others
    /// scanned) finds the reclaim's marker: the holds its reclaimed journal had were released,
    /// so it drops them (releasing them again would subtract other requests' load) and
    /// registers anew. Holds made after that journal are kept.
    fn forget_reclaimed(&mut self, vm: &SharedVm) {
        let Ok((Some(bytes), _)) = SharedData.get(&self.reclaimed_key) else {
            return;
        };
        let Some(seq) = bytes
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
        else {
            return;
        };
        let mut vm = vm.borrow_mut();
        // The reclaim took this VM out of `pd_router_fleet_loaded_vms` when its journal said
        // it counted itself; alive after all, it still does.
        if bytes.get(8) == Some(&1) && vm.fleet_counted.get() {
            Metrics::gauge_add(vm.metrics.fleet_loaded_vms, 1);
        }
        let before = vm.holds.len();
        vm.holds.retain(|_, h| h.journaled_after >= seq);
        log::error!(
            "this VM was silent past {} s and declared dead: {} requests' charges were released by another VM",
            DEAD_AFTER_MS / 1000,
            before - vm.holds.len()
        );
        vm.journal_registered.set(false);
        drop(vm);
        let _ = SharedData.set(&self.reclaimed_key, &[], None);
    }

    /// Reads the other registered journals; those [`Liveness`] finds dead are taken off the
    /// registry (one CAS: only one VM wins and reclaims) and their charges released.
    fn reclaim_dead(&mut self, vm: &SharedVm, now: u64) -> Result<(), StoreError> {
        let (value, cas) = SharedData.get(REGISTRY_KEY)?;
        let tokens = parse(value.as_deref());
        self.liveness.retain(&tokens);
        // (token, its journal when readable, how long it has been silent)
        let mut dead: Vec<(u64, Option<Journal>, u64)> = Vec::new();
        for &t in tokens.iter().filter(|t| **t != self.token) {
            let journal = match SharedData.get(&key_of(t))? {
                (Some(bytes), _) => journal::decode(&bytes).ok(),
                (None, _) => None,
            };
            // An unreadable journal watches as a sequence that never moves: its VM, if alive,
            // rewrites it within a tick.
            let seq = journal.as_ref().map_or(u64::MAX, |j| j.seq);
            if let Some(silent) = self.liveness.observe(t, seq, now) {
                dead.push((t, journal, silent));
            }
        }
        if dead.is_empty() {
            return Ok(());
        }
        let alive: Vec<u64> = tokens
            .iter()
            .copied()
            .filter(|t| !dead.iter().any(|(d, _, _)| d == t))
            .collect();
        if !SharedData.set(REGISTRY_KEY, render(&alive).as_bytes(), cas)? {
            return Ok(()); // another VM won this round; it reclaims
        }
        let reclaimed_vm = vm.borrow().metrics.vms_reclaimed;
        for (token, journal, silent) in dead {
            crate::host::prefix_sharing::forget(token);
            let Some(journal) = journal else {
                // Nothing to release; a VM alive after all re-registers on the marker.
                let _ = SharedData.set(&key_of(token), &[], None);
                let _ = SharedData.set(&reclaimed_key(token), &0u64.to_le_bytes(), None);
                Metrics::inc(reclaimed_vm);
                continue;
            };
            let reclaimed = ledger::update(&SharedData, |l| {
                Ok::<_, StoreError>(journal::reclaim(&journal, l, crate::host::now_ms()))
            });
            match reclaimed {
                Ok(n) => {
                    // Its journal goes (the VM rewrites it if it was alive after all).
                    let _ = SharedData.set(&key_of(token), &[], None);
                    if n > 0 {
                        log::warn!(
                            "released the charges of {n} requests held by a VM silent for {} s (it trapped or stopped)",
                            silent / 1000
                        );
                    }
                    let mut state = vm.borrow_mut();
                    // Counted once the release landed: a failed one is registered again and
                    // retried, and must not count twice.
                    Metrics::inc(reclaimed_vm);
                    Metrics::add(state.metrics.force_released[1], n as u64);
                    // The dead VM's pods may be new to this one: the next sync shows them at 0.
                    state
                        .metrics
                        .track_pods(journal.holds.iter().flat_map(charged_pods));
                    let legs = journal.prefill_legs_in_flight() as i64;
                    Metrics::gauge_add(state.metrics.prefill_outstanding, -legs);
                    if journal.loaded {
                        Metrics::gauge_add(state.metrics.fleet_loaded_vms, -1);
                    }
                    drop(state);
                    // The marker: the journal's sequence, and whether the reclaim took the VM
                    // out of the loaded count (a VM alive after all puts itself back).
                    let mut marker = journal.seq.to_le_bytes().to_vec();
                    marker.push(u8::from(journal.loaded));
                    let _ = SharedData.set(&reclaimed_key(token), &marker, None);
                }
                Err(e) => {
                    // Back on the registry with its journal kept: the next scan retries
                    // (taken off for good, its charges would stay for ever).
                    log::error!("cannot release a dead VM's charges (retried): {e}");
                    if let Err(e) = register(token) {
                        log::error!("cannot keep a dead VM's journal for a retry: {e}");
                    }
                }
            }
        }
        Ok(())
    }
}

/// Rewrites the VM's journal from its holds' records under the next sequence, and puts it on
/// the registry the first time (so also before a VM's first tick: one that trapped on its
/// first request, a poison request right after a reload, held charges no VM watched);
/// false when shared data refused the journal.
pub fn write(vm: &VmState) -> bool {
    let seq = vm.journal_seq.get().wrapping_add(1);
    let bytes = journal::assemble(
        seq,
        vm.fleet_counted.get(),
        vm.holds.values().map(|h| h.record.as_slice()),
    );
    match SharedData.set(&vm.journal_key, &bytes, None) {
        Ok(_) => {
            vm.journal_seq.set(seq);
            if !vm.journal_registered.get() {
                vm.journal_registered
                    .set(register(vm.journal_token).is_ok());
            }
            true
        }
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

/// Never empty (an empty line for no token): an empty value may read as an absent key.
fn render(tokens: &[u64]) -> String {
    if tokens.is_empty() {
        return "\n".into();
    }
    tokens.iter().map(|t| format!("{t:016x}\n")).collect()
}

/// Creates the registry key if absent. Must run before concurrent use: Envoy ignores the CAS
/// token on a missing key, so two VMs registering first would overwrite each other (one VM
/// then believed itself registered and was never watched).
pub fn ensure_registry() -> Result<(), StoreError> {
    if SharedData.get(REGISTRY_KEY)?.0.is_none() {
        SharedData.set(REGISTRY_KEY, b"\n", None)?;
    }
    Ok(())
}

/// Rewrites an ending VM's journal (it no longer counts itself loaded: a later reclaim must
/// not take it out of the count again), then takes it off the registry when it holds nothing.
pub fn leave(vm: &VmState) {
    if !vm.journal_registered.get() {
        return;
    }
    write(vm);
    if !vm.holds.is_empty() {
        return;
    }
    let token = vm.journal_token;
    let off = edit_registry(|tokens| {
        let before = tokens.len();
        tokens.retain(|t| *t != token);
        tokens.len() != before
    });
    if let Err(e) = off {
        log::warn!("cannot take the journal off the registry: {e}");
        return;
    }
    vm.journal_registered.set(false);
    let _ = SharedData.set(&vm.journal_key, &[], None);
}

fn register(token: u64) -> Result<(), StoreError> {
    edit_registry(|tokens| {
        let absent = !tokens.contains(&token);
        if absent {
            tokens.push(token);
        }
        absent
    })
}

/// Changes the registry's token list with one CAS write; `edit` says whether it changed
/// anything (nothing to write otherwise). Retried on a lost CAS, 16 times at most.
fn edit_registry(mut edit: impl FnMut(&mut Vec<u64>) -> bool) -> Result<(), StoreError> {
    for _ in 0..16 {
        let (value, cas) = SharedData.get(REGISTRY_KEY)?;
        let mut tokens = parse(value.as_deref());
        if !edit(&mut tokens) {
            return Ok(());
        }
        if SharedData.set(REGISTRY_KEY, render(&tokens).as_bytes(), cas)? {
            return Ok(());
        }
    }
    Err(StoreError::Contention(16))
}
