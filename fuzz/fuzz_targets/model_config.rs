//! The `model.aibrix.ai/config` annotation and the `routing-strategy` header value.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::profile::{ModelConfig, Strategy};

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = ModelConfig::parse(text);
        let _ = Strategy::parse(text);
    }
});
