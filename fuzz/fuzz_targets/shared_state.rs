//! Everything the filter reads back from shared data another VM (or a crashed one) wrote:
//! the ledger, hold journals, other replicas' shares and the prefix-event rings. Corrupt bytes
//! are refused, never trusted into a panic. The same bytes also go through the reader of the
//! host's serialized request headers (`core::header_map`), held to the same rule.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::header_map;
use pd_router_filter::core::journal;
use pd_router_filter::core::ledger::{Ledger, MemoryStore, PodId, Store};
use pd_router_filter::core::prefix::log::{self, PrefixLog};
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
    if let Ok(pairs) = header_map::pairs(data) {
        let bytes: usize = pairs.map(|(name, value)| name.len() + value.len()).sum();
        assert!(bytes <= data.len(), "header pairs read past the buffer");
    }

    // The bytes as the heads, and after its number as the newest batch of each writer named.
    let store = MemoryStore::default();
    let _ = store.set(log::HEADS_KEY, data, None);
    let mut key = String::new();
    for head in log::heads(data).take(4) {
        log::slot_key(&mut key, head.writer, head.seq);
        let mut entry = head.seq.to_le_bytes().to_vec();
        entry.extend_from_slice(data);
        let _ = store.set(&key, &entry, None);
    }
    let _ = PrefixLog::new(0).catch_up(&store, |_| {});
});
