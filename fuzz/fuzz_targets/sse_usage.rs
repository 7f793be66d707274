//! The SSE chunk scan that finds a stream's final usage, for each endpoint's key, and the
//! per-user token scan of an answer (`UsageScan`), fed the input cut in two at its first byte's
//! position, as a body arrives in chunks; and pd-control's admission answer as the filter reads
//! it (`judge`): neither may panic on whatever an engine or a proxy sends.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::obs::usage::generated_tokens;
use pd_router_filter::core::request::Endpoint;
use pd_router_filter::core::user_limits::{judge, Ask, UsageScan};

fuzz_target!(|data: &[u8]| {
    for endpoint in [Endpoint::ChatCompletions, Endpoint::Messages] {
        let _ = generated_tokens(data, endpoint.usage_output_key());
    }
    let cut = data.first().map_or(0, |b| usize::from(*b)).min(data.len());
    let mut scan = UsageScan::default();
    scan.feed(&data[..cut]);
    scan.feed(&data[cut..]);
    let _ = scan.tokens();
    let ask = Ask {
        user: Some("fuzz".into()),
        model: "m".into(),
        rps: Some(0.5),
    };
    let _ = judge(&ask, "200", data);
});
