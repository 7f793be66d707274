//! Everything the filter reads back from shared data another VM (or a crashed one) wrote:
//! the ledger, hold journals and other replicas' shares. Corrupt bytes are refused, never
//! trusted into a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::journal;
use pd_router_filter::core::ledger::{Ledger, PodId};
use pd_router_filter::core::remote::RemoteLoad;

fuzz_target!(|data: &[u8]| {
    if let Ok(mut ledger) = Ledger::from_bytes(data.to_vec()) {
        let ids: Vec<(PodId, usize)> = ledger.iter().map(|(id, _)| id).zip(0..).collect();
        let _ = ledger.rows_for(&ids, ids.len());
        let _ = ledger.all_zero();
        if let Ok(j) = journal::decode(data) {
            journal::reclaim(&j, &mut ledger, 1);
        }
        ledger.prune_idle(u64::MAX);
    }
    if let Ok(j) = journal::decode(data) {
        let mut ledger = Ledger::default();
        journal::reclaim(&j, &mut ledger, 1);
        assert!(ledger.all_zero(), "releases never charge");
    }
    let _ = RemoteLoad::decode(data);
});
