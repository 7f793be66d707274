//! The request body parser: any bytes, either endpoint, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::request::{Endpoint, RoutingRequest};

fuzz_target!(|data: &[u8]| {
    for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
        if let Ok(req) = RoutingRequest::parse(endpoint, data) {
            assert_eq!(req.body_len, data.len());
            assert_eq!(req.prompt_bytes, req.prompt_text.len());
        }
    }
});
