//! The request body parser and the legs spliced from it: any bytes, either endpoint, never a
//! panic, the one-pass parse answers exactly as the two-pass reference (request or error),
//! and so does the read of the bytes as a vLLM prefill answer; whatever object `json_scan`
//! accepts, serde_json accepts with the same members; and a body that parses always yields legs (vLLM, SGLang, TRT-LLM) that are valid
//! JSON objects with the prefill leg's one-token cap and the protocol's fields.
//!
//! JSON's grammar allows an escaped lone surrogate (`"\uD937"`), which serde_json accepts in
//! a value it only validates but not in a string it decodes. Such a body is routed and its
//! bytes reach the engine as the client wrote them (vLLM's Python parser takes them too), so
//! its legs are held to what the router accepts (a JSON object read member by member), not
//! to a full `serde_json::Value` parse.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::config::KvConnector;
use pd_router_filter::core::engine::trtllm::{self, ScheduleStyle};
use pd_router_filter::core::engine::{sglang, vllm};
use pd_router_filter::core::json_object::Members;
use pd_router_filter::core::json_scan;
use pd_router_filter::core::request::{Endpoint, RoutingRequest};

const ANSWER: &[u8] = br#"{"kv_transfer_params":{"remote_block_ids":[1],"remote_host":"x"}}"#;
const TRT_ANSWER: &[u8] =
    br#"{"choices":[{"disaggregated_params":{"ctx_request_id":7}}],"prompt_token_ids":[1,2]}"#;

/// The leg as a map when the client's body decodes fully (`strict`), else checked to be an
/// object the router accepts and `None`.
fn object(
    leg: &[u8],
    what: &str,
    strict: bool,
) -> Option<serde_json::Map<String, serde_json::Value>> {
    if !strict {
        assert!(
            Members::parse(leg).is_ok(),
            "the {what} is not a JSON object"
        );
        return None;
    }
    match serde_json::from_slice(leg) {
        Ok(serde_json::Value::Object(map)) => Some(map),
        _ => panic!("the {what} is not a JSON object"),
    }
}

fuzz_target!(|data: &[u8]| {
    // The fast scan of the answers never accepts what serde refuses, and finds its members.
    if let Some(scanned) = std::str::from_utf8(data)
        .ok()
        .and_then(json_scan::object)
    {
        let members = Members::parse(data).expect("json_scan accepted what serde refuses");
        let base = data.as_ptr() as usize;
        let reference: Vec<(&str, std::ops::Range<usize>)> = members
            .iter()
            .map(|(k, v)| {
                let start = v.get().as_ptr() as usize - base;
                (k, start..start + v.get().len())
            })
            .collect();
        assert_eq!(scanned, reference, "json_scan and serde read different members");
    }
    // The bytes as a vLLM prefill answer: its kv_transfer_params read by the scan are the
    // two-scan reference's (or both refuse it alike).
    let host = "\"10.0.0.1\"";
    match (
        vllm::answer_params(data, host),
        vllm::params_two_scan(data, host),
    ) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "the two answer reads disagree"),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        (a, b) => panic!("one answer read failed, the other did not: {a:?} / {b:?}"),
    }
    let strict = serde_json::from_slice::<serde_json::Value>(data).is_ok();
    // A Responses body: any answer, no panic.
    let _ = RoutingRequest::parse(Endpoint::Responses, data);
    // A Messages body is read exactly as a chat body.
    match (
        RoutingRequest::parse(Endpoint::Messages, data),
        RoutingRequest::parse(Endpoint::ChatCompletions, data),
    ) {
        (Ok(m), Ok(c)) => assert_eq!(
            m,
            RoutingRequest {
                endpoint: Endpoint::Messages,
                ..c
            }
        ),
        (Err(a), Err(b)) => assert_eq!(a, b),
        (a, b) => panic!("Messages and chat parses differ: {a:?} / {b:?}"),
    }
    for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
        let parsed = RoutingRequest::parse(endpoint, data);
        match (&parsed, &RoutingRequest::parse_two_pass(endpoint, data)) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "the two parses disagree"),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
            (a, b) => panic!("one parse failed, the other did not: {a:?} / {b:?}"),
        }
        if let Ok(req) = parsed {
            assert_eq!(req.body_len, data.len());
            assert_eq!(req.prompt_bytes, req.prompt_text.len());
            for connector in [KvConnector::Shfs, KvConnector::Nixl] {
                let prefill = vllm::prefill_body(data, &req.members, connector);
                if let Some(leg) = object(&prefill, "prefill leg", strict) {
                    assert_eq!(leg["max_tokens"], 1);
                }
                if let Ok(Some(decode)) =
                    vllm::decode_body(data, &req.members, ANSWER, "10.0.0.1", connector)
                {
                    let written = object(&decode, "decode leg", strict);
                    // The edit the filter applies to the body Envoy holds reads the same.
                    let edit = vllm::decode_edit(data, &req.members, ANSWER, "10.0.0.1", connector)
                        .expect("decode_edit agrees with decode_body")
                        .expect("decode_edit agrees with decode_body");
                    let edited = object(&edit.apply(data), "edited decode leg", strict);
                    assert_eq!(edited, written, "the edited decode leg differs");
                }
            }
            if sglang::validate(data, &req.members).is_ok() {
                let boot = sglang::Bootstrap {
                    host: "10.0.0.1".into(),
                    port: 8998,
                    room: 7,
                    rid: "r".into(),
                };
                let (prefill, decode) = sglang::legs(data, &req.members, &boot);
                let (edited_prefill, edit) = sglang::legs_edited(data, &req.members, &boot);
                assert_eq!(edited_prefill, prefill);
                assert_eq!(
                    object(&edit.apply(data), "edited decode leg", strict),
                    object(&decode, "decode leg", strict),
                    "the edited decode leg differs"
                );
                let (prefill, decode) = (
                    object(&prefill, "prefill leg", strict),
                    object(&decode, "decode leg", strict),
                );
                if let (Some(prefill), Some(decode)) = (prefill, decode) {
                    assert_eq!(prefill["max_tokens"], 1);
                    assert_eq!(
                        (&prefill["bootstrap_room"], &decode["bootstrap_room"]),
                        (&7.into(), &7.into())
                    );
                }
            }
            let ctx = trtllm::context_body(data, &req.members, 9, ScheduleStyle::ContextFirst);
            if let Some(leg) = object(&ctx, "context leg", strict) {
                assert_eq!(leg["max_tokens"], 1);
            }
            if let Ok(Some(generation)) =
                trtllm::generation_body(data, &req.members, endpoint, TRT_ANSWER)
            {
                let written = object(&generation, "generation leg", strict);
                if let Some(leg) = &written {
                    assert_eq!(
                        leg["disaggregated_params"]["request_type"],
                        "generation_only"
                    );
                }
                // The edit the filter applies to the body Envoy holds reads the same.
                let edit = trtllm::generation_edit(data, &req.members, endpoint, TRT_ANSWER)
                    .expect("generation_edit agrees with generation_body")
                    .expect("generation_edit agrees with generation_body");
                let edited = object(&edit.apply(data), "edited generation leg", strict);
                assert_eq!(edited, written, "the edited generation leg differs");
            }
        }
    }
});
