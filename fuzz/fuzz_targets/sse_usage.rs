//! The SSE chunk scan that finds a stream's final usage, for each endpoint's key; the per-user
//! token scan of an answer (`UsageScan`), fed the input cut in two at its first byte's
//! position, as a body arrives in chunks; the streamed scan's seam over small chunks; and
//! pd-control's admission answer as the filter reads it (`judge`): none may panic on
//! whatever an engine or a proxy sends.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::obs::usage::{generated_tokens, Seam};
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
    // The same input as a stream of small chunks of every size the first byte names, through
    // the seam the response path reads each chunk with.
    let size = cut % 61 + 1;
    let mut seam = Seam::default();
    for chunk in data.chunks(size) {
        let _ = seam.read(chunk, Endpoint::ChatCompletions.usage_output_key());
        seam.keep(chunk);
    }
    let ask = Ask {
        user: Some("fuzz".into()),
        model: "m".into(),
        rps: Some(0.5),
    };
    let _ = judge(&ask, "200", data);
});
