//! A pod's error answer rewritten for the client: whatever the status and body, the answer is
//! an OpenAI error envelope with a string message, and only an OpenAI-style body is marked.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::upstream_error::{rewrite, Kind, Rewrite};
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let (status, body) = match data {
        [a, b, rest @ ..] => (u32::from(u16::from_le_bytes([*a, *b])) % 600, rest),
        _ => return,
    };
    let Some(how) = Rewrite::for_status(status) else {
        assert!((200..300).contains(&status));
        return;
    };
    let answer = rewrite(how, status, body);
    let parsed: Value = serde_json::from_slice(&answer.body).expect("the answer is JSON");
    assert!(parsed["error"]["message"].is_string(), "{parsed}");
    if answer.kind == Kind::Normalized {
        assert!(serde_json::from_slice::<Value>(body).is_ok());
    }
});
