//! pd-control's engine metrics parser, for each engine's names.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_control::scrape::engine::{parse_reading, Engine};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for engine in [Engine::Vllm, Engine::Sglang, Engine::Trtllm] {
        let _ = parse_reading(&text, engine, "m");
    }
});
