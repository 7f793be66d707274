//! The request body parser and the legs spliced from it: any bytes, either endpoint, never a
//! panic, and a body that parses always yields legs that are valid JSON objects with the
//! prefill leg's one-token cap.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::config::KvConnector;
use pd_router_filter::core::engine::vllm;
use pd_router_filter::core::request::{Endpoint, RoutingRequest};

const ANSWER: &[u8] = br#"{"kv_transfer_params":{"remote_block_ids":[1],"remote_host":"x"}}"#;

fuzz_target!(|data: &[u8]| {
    for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
        if let Ok(req) = RoutingRequest::parse(endpoint, data) {
            assert_eq!(req.body_len, data.len());
            assert_eq!(req.prompt_bytes, req.prompt_text.len());
            for connector in [KvConnector::Shfs, KvConnector::Nixl] {
                let prefill = vllm::prefill_body(data, &req.members, connector);
                let leg: serde_json::Value =
                    serde_json::from_slice(&prefill).expect("the prefill leg is JSON");
                assert_eq!(leg["max_tokens"], 1);
                if let Ok(Some(decode)) =
                    vllm::decode_body(data, &req.members, ANSWER, "10.0.0.1", connector)
                {
                    let leg: serde_json::Value =
                        serde_json::from_slice(&decode).expect("the decode leg is JSON");
                    assert!(leg.is_object());
                }
            }
        }
    }
});
