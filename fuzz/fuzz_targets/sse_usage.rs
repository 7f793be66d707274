//! The SSE chunk scan that finds a stream's final usage, for each endpoint's key.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::obs::usage::generated_tokens;
use pd_router_filter::core::request::Endpoint;

fuzz_target!(|data: &[u8]| {
    for endpoint in [Endpoint::ChatCompletions, Endpoint::Messages] {
        let _ = generated_tokens(data, endpoint.usage_output_key());
    }
});
