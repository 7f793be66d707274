//! pd-control's engine metrics parser, for each engine's names.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_control::scrape::engine::{parse_reading, Engine};

// Raw bytes, as a scrape hands them over: the parser filters lines before any UTF-8 check.
fuzz_target!(|data: &[u8]| {
    for engine in [Engine::Vllm, Engine::Sglang, Engine::Trtllm] {
        let _ = parse_reading(data, engine, "m");
    }
});
