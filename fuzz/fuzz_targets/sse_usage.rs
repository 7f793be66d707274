//! The SSE chunk scan that finds a stream's final usage.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::obs::usage::completion_tokens;

fuzz_target!(|data: &[u8]| {
    let _ = completion_tokens(data);
});
