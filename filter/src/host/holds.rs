//! The charges every in-flight request of this VM holds on the shared ledger, kept per VM
//! (not in the HTTP context) so the janitor can force-release a charge whose release never
//! arrives: after its TTL (`AIBRIX_TOKEN_LOAD_TTL_SECONDS`) it is released with a warning,
//! and a leaked entry cannot pin load on a pod for ever.

use crate::core::charges::HeldCharges;
use crate::core::ledger::{self, Ledger, PodId, Row, StoreError};
use crate::host::metrics::Metrics;
use crate::host::store::SharedData;
use crate::host::SharedVm;

/// One request's charges.
#[derive(Debug, Clone)]
pub struct Hold {
    pub charges: HeldCharges,
    /// When it was made, on this VM's monotonic clock (`host::steady_ms`): a step of the wall
    /// clock must not force-release every request's charges at once.
    pub since_ms: u64,
    /// 0 = never force-released.
    pub ttl_ms: u64,
    pub request_id: String,
    /// The charges' journal record (`crate::core::journal::record`), kept current with them.
    pub record: Vec<u8>,
    /// The sequence of the VM's last journal when the hold was made: every journal written
    /// with a greater sequence has it, so a reclaim of journal `s` released it iff this < `s`.
    pub journaled_after: u64,
}

impl Hold {
    pub fn new(
        charges: HeldCharges,
        since_ms: u64,
        ttl_ms: u64,
        request_id: String,
        journaled_after: u64,
    ) -> Hold {
        Hold {
            record: crate::core::journal::record(&charges),
            charges,
            since_ms,
            ttl_ms,
            request_id,
            journaled_after,
        }
    }
}

/// The pods a request holds charges on (keys `namespace/name`, possibly repeated).
pub fn charged_pods(held: &HeldCharges) -> impl Iterator<Item = &str> {
    held.counters
        .iter()
        .map(|(k, _)| k.as_str())
        .chain(held.prefill_tokens.as_ref().map(|c| c.pod.as_str()))
        .chain(held.decode_tokens.as_ref().map(|c| c.pod.as_str()))
}

/// The ledger rows of the pods a request was just charged on, read in the charging CAS round.
/// One row per pod, in key order.
pub fn charged_rows(ledger: &Ledger, held: &HeldCharges) -> Vec<(String, Row)> {
    let mut rows: Vec<(String, Row)> = Vec::new();
    for key in charged_pods(held) {
        if !rows.iter().any(|(k, _)| k == key) {
            rows.push((key.to_string(), ledger.row(PodId::of(key))));
        }
    }
    rows.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    rows
}

/// Runs one release stage for request `id` in a CAS round, and keeps the result only once
/// the write landed (a failed round leaves the charges held for a later attempt); false when
/// it did not land.
pub fn release(
    vm: &SharedVm,
    id: u32,
    now: u64,
    stage: fn(&HeldCharges, &mut Ledger, u64) -> HeldCharges,
) -> bool {
    update(vm, id, |held, l| stage(held, l, now))
}

/// Runs `change` on request `id`'s charges in a CAS round (a release stage, a moved decode
/// charge), keeping the result only once the write landed; false when a round failed (a hold
/// with nothing left, or none, needs no round and is true).
pub fn update(
    vm: &SharedVm,
    id: u32,
    change: impl Fn(&HeldCharges, &mut Ledger) -> HeldCharges,
) -> bool {
    // Moved out of the hold for the round rather than copied (nothing reads the hold's
    // charges meanwhile; its journal record stays), and put back unless a new state lands.
    let held = {
        let mut vm = vm.borrow_mut();
        match vm.holds.get_mut(&id) {
            None => return true,
            Some(h) if !h.charges.is_empty() => std::mem::take(&mut h.charges),
            Some(_) => {
                vm.holds.remove(&id);
                return true;
            }
        }
    };
    let result = ledger::update(&SharedData, |l| Ok::<_, StoreError>(change(&held, l)));
    let mut vm = vm.borrow_mut();
    match result {
        Ok(next) => {
            if next.is_empty() {
                vm.holds.remove(&id);
            } else if let Some(h) = vm.holds.get_mut(&id) {
                h.record = crate::core::journal::record(&next);
                h.charges = next;
            }
            crate::host::journal::write(&vm);
            true
        }
        Err(e) => {
            if let Some(h) = vm.holds.get_mut(&id) {
                h.charges = held;
            }
            Metrics::inc(vm.metrics.charge_release_errors);
            log::error!("cannot release the charges of context {id}: {e}");
            false
        }
    }
}

/// Force-releases every hold older than its TTL (`steady`: this VM's monotonic clock; `now`:
/// the wall clock the ledger keeps); returns how many.
pub fn expire(vm: &SharedVm, now: u64, steady: u64) -> usize {
    let expired: Vec<(u32, String, u64)> = vm
        .borrow()
        .holds
        .iter()
        .filter(|(_, h)| h.ttl_ms > 0 && steady.saturating_sub(h.since_ms) > h.ttl_ms)
        .map(|(id, h)| (*id, h.request_id.clone(), h.since_ms))
        .collect();
    let mut released = 0;
    for (id, request_id, since) in &expired {
        log::warn!(
            "request {request_id}: charges held for {} s without a release; force-releasing (AIBRIX_TOKEN_LOAD_TTL_SECONDS)",
            steady.saturating_sub(*since) / 1000
        );
        // Counted once it landed: a failed round keeps the hold, retried on the next tick.
        released += u64::from(release(vm, *id, now, HeldCharges::release_rest));
    }
    if released > 0 {
        Metrics::add(vm.borrow().metrics.force_released[0], released);
    }
    expired.len()
}
