//! The protobuf snapshot the filter decodes from pd-control (a hostile or broken control
//! service must not take the gateway down).
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::fleet::FleetView;

fuzz_target!(|data: &[u8]| {
    let _ = FleetView::decode(data);
});
