//! The protobuf snapshot the filter decodes from pd-control (a hostile or broken control
//! service must not take the gateway down), alone and after a previous snapshot: the input
//! is split in two, the first half decoded as the view in hand and the second adopted after
//! it, so the metrics-only path (`FleetView::decode_after`) sees arbitrary bytes too and must
//! agree with a full decode on whether they are a snapshot at all.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::fleet::FleetView;

fuzz_target!(|data: &[u8]| {
    let full = FleetView::decode(data);
    let (first, second) = data.split_at(data.len() / 2);
    if let Ok(previous) = FleetView::decode(first) {
        let after = FleetView::decode_after(second, Some(&previous));
        assert_eq!(after.is_ok(), FleetView::decode(second).is_ok());
        // The same bytes again: the same topology, so the metrics-only path is taken.
        let again = FleetView::decode_after(first, Some(&previous));
        assert_eq!(again.map(|v| v.version).ok(), Some(previous.version));
    }
    drop(full);
});
