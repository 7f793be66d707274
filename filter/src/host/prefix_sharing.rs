//! Host side of `core::prefix::log`: this VM publishes its prefix-event batches to its ring
//! in shared data and reads the other VMs' rings before it consults its index.

use crate::core::prefix::follow;
use crate::core::prefix::log as ring;
use crate::host::metrics::Metrics;
use crate::host::store::SharedData;
use crate::host::VmState;

/// Publishes the events this VM gathered since its last batch, if any.
pub fn publish(vm: &mut VmState, now_ms: u64) {
    if vm.prefix_outbox.is_empty() {
        return;
    }
    let entry = vm.prefix_outbox.take_entry();
    if let Err(e) = vm
        .prefix_log
        .publish(&SharedData, entry, now_ms, ring_budget(vm))
    {
        log::warn!("cannot publish prefix events to the other workers: {e}");
    }
    vm.prefix_batches_sent += 1;
}

/// Bytes a ring keeps: what a reader's index can hold, since older prompts would be evicted
/// as they were applied.
fn ring_budget(vm: &VmState) -> usize {
    let p = vm.prefix_settings;
    p.capacity.saturating_mul(p.block_size)
}

/// Applies what the other VMs published since this one last looked (`before_selection`: as
/// a selection's first step, not on a tick), and sets the timer to read again before their
/// rings lap this VM.
pub fn catch_up(vm: &mut VmState, now_ms: u64, before_selection: bool) {
    let VmState {
        prefix_log,
        prefix,
        metrics,
        ..
    } = vm;
    match prefix_log.catch_up(&SharedData, |e| {
        prefix.add_prefix(e.stream, e.model, e.pod, e.at_ms)
    }) {
        Ok(done) => {
            if done.missed > 0 {
                Metrics::add(metrics.prefix_batches_missed, done.missed);
            }
            if let Some(err) = &done.malformed {
                log::warn!("skipped the rest of a malformed prefix event batch: {err}");
            }
            let fill = follow::fill(&done, ring_budget(vm));
            let need = vm.prefix_follow.read(now_ms, fill, before_selection);
            ask_timer(vm, need);
        }
        Err(e) => log::warn!("cannot read the other workers' prefix events: {e}"),
    }
}

/// Another VM woke with a request: a VM that follows the rings reads them at the shortest
/// period until it has measured how fast they fill.
pub fn expect_burst(vm: &mut VmState, now_ms: u64) {
    if !vm.prefix_log.is_following() {
        return;
    }
    let need = vm.prefix_follow.expect_burst(now_ms);
    ask_timer(vm, need);
}

/// Sets the timer to the period following the rings needs, when that changes it.
fn ask_timer(vm: &mut VmState, need_ms: Option<u64>) {
    if let Some(r) = vm.pace.follow(need_ms) {
        vm.set_pace(r);
    }
}

/// A dead VM's ring is no longer read and its memory is returned.
pub fn forget(writer: u64) {
    if let Err(e) = ring::forget_writer(&SharedData, writer) {
        log::warn!("cannot drop a dead VM's prefix events: {e}");
    }
}
