//! pd-control's reading of an external replica router's answer: bytes from a service outside
//! the gateway, so anything may arrive. Whatever it is, the reading must not panic, and what it
//! accepts must hold to the protocol: a chosen pod is one the request offered, and a decision is
//! one legal in the mode asked.
#![no_main]
use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use pd_control::external::protocol::{is_protocol_media_type, validate, Decision};

/// The answer's envelope around the fuzzer's bytes as its `status`, so that mutations reach
/// the decision rules rather than dying at the envelope every time.
fn enveloped(status: &[u8]) -> Vec<u8> {
    let mut out = br#"{"apiVersion":"routing.aibrix.ai/v1alpha1","kind":"ReplicaSelectionResponse","metadata":{"requestId":"r1"},"status":"#.to_vec();
    out.extend_from_slice(status);
    out.push(b'}');
    out
}

fuzz_target!(|input: &[u8]| {
    let Some((&mode, rest)) = input.split_first() else {
        return;
    };
    let wrapped;
    let data = if mode & 1 == 1 {
        wrapped = enveloped(rest);
        &wrapped[..]
    } else {
        rest
    };
    let ports: BTreeMap<String, u32> =
        [("ns/a".to_string(), 8000), ("ns/b".to_string(), 8001)].into();
    for advisory in [true, false] {
        match validate(data, "r1", advisory, &ports) {
            Ok(Decision::Selected { id }) => assert!(ports.contains_key(&id), "chose {id:?}"),
            Ok(Decision::NoDecision) => assert!(advisory, "NoDecision accepted when authoritative"),
            Ok(Decision::Denied) => assert!(!advisory, "Denied accepted when advisory"),
            Err(_) => continue,
        }
        let v: serde_json::Value = serde_json::from_slice(data).expect("accepted, so JSON");
        assert_eq!(
            v.pointer("/metadata/requestId").and_then(|r| r.as_str()),
            Some("r1"),
            "accepted another request's answer"
        );
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = is_protocol_media_type(text);
    }
});
