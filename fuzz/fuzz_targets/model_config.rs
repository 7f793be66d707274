//! The `model.aibrix.ai/config` annotation and the `routing-strategy` header value: neither
//! panics, and a parsed strategy list keeps the shape selection relies on.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::profile::{ModelConfig, Strategy, StrategySpec};

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = ModelConfig::parse(text);
        match Strategy::parse(text) {
            Ok(StrategySpec::Blend(blend)) => {
                // Two or more distinct single-pod strategies, each weighted above 0; pd is
                // never blended.
                assert!(blend.items.len() >= 2, "{text:?}");
                for (i, (s, w)) in blend.items.iter().enumerate() {
                    assert!(*w > 0, "{text:?}");
                    assert_ne!(*s, Strategy::Pd, "{text:?}");
                    assert!(
                        blend.items[..i].iter().all(|(t, _)| t != s),
                        "{text:?}: {s:?} twice"
                    );
                }
                assert_eq!(blend.label, text.trim());
            }
            Ok(StrategySpec::One(_)) | Err(_) => {}
        }
    }
});
