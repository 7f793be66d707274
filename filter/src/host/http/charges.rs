//! The request's charges on the shared ledger: recorded in the VM's holds and journal when a
//! selection takes them, so a release that never comes (or a VM that traps) cannot leave load
//! on a pod for ever, and released stage by stage as the request's legs end.

use super::PdHttp;
use crate::core::charges::HeldCharges;
use crate::core::ledger::Ledger;
use crate::host::holds::{self, Hold};
use crate::host::{Clock, VmState};

impl PdHttp {
    /// Runs one release stage of this request's charges (see `holds::release`).
    pub(super) fn release_stage(
        &mut self,
        stage: fn(&HeldCharges, &mut Ledger, u64) -> HeldCharges,
        clock: &mut Clock,
    ) {
        holds::release(&self.vm, self.id, clock.ms(), stage);
    }

    /// Records what the request now holds, with its force-release deadline.
    pub(super) fn hold(&self, vm: &mut VmState, charges: HeldCharges, ttl_s: u64) {
        let hold = Hold::new(
            charges,
            crate::host::steady_ms(),
            ttl_s.saturating_mul(1000),
            self.request_id.clone(),
            vm.journal_seq.get(),
        );
        vm.holds.insert(self.id, hold);
        crate::host::journal::write(vm);
    }

    pub(super) fn release_all(&mut self, clock: &mut Clock) {
        self.release_stage(HeldCharges::release_rest, clock);
    }
}
