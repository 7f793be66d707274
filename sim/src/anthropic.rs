//! vLLM's Anthropic Messages API (`POST /v1/messages`) wire shapes: the response body, the
//! stream's named events and the error body.
//!
//! vLLM serves the endpoint by turning the request into a chat completion (the request's
//! `kv_transfer_params` carried along), so a Messages request is a prefill or decode leg by
//! the same rules as chat, and its answer carries the prefill's `kv_transfer_params` at the top
//! level. What differs is only the outside: `type: "message"` bodies with content blocks and
//! `usage.input_tokens` / `output_tokens`, a stream of `event:`-named SSE events ending in
//! `message_stop` (no `[DONE]`), usage always in the stream's `message_delta`, and errors as
//! `{"type":"error","error":{"type","message"}}`. Fields that are `None` are left out, as vLLM
//! serialises the response with `exclude_none`.

use serde_json::{json, Value};

/// One named SSE event, as vLLM writes it.
pub fn event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// The unstreamed answer. Every simulated answer stops at `max_tokens`.
pub fn full_body(
    id: &str,
    model: &str,
    text: &str,
    input_tokens: u64,
    output_tokens: u64,
    kv_out: Option<&Value>,
) -> Value {
    let mut body = json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": "max_tokens",
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    });
    if let (Some(kv), Some(map)) = (kv_out, body.as_object_mut()) {
        map.insert("kv_transfer_params".into(), kv.clone());
    }
    body
}

/// The events before the first token's text: `message_start` (no output yet) and the text
/// block's `content_block_start`.
pub fn opening(id: &str, model: &str, input_tokens: u64) -> String {
    let start = json!({
        "type": "message_start",
        "message": {
            "id": id, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        },
    });
    let block = json!({
        "type": "content_block_start", "index": 0,
        "content_block": {"type": "text", "text": ""},
    });
    event("message_start", &start) + &event("content_block_start", &block)
}

/// One token's text.
pub fn text_delta(text: &str) -> String {
    event(
        "content_block_delta",
        &json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": text}}),
    )
}

/// The events after the last token: the block closes, then `message_delta` with the stop
/// reason and the usage.
pub fn closing(input_tokens: u64, output_tokens: u64) -> String {
    let stop = json!({"type": "content_block_stop", "index": 0});
    let delta = json!({
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens"},
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    });
    event("content_block_stop", &stop) + &event("message_delta", &delta)
}

/// The stream's last event.
pub fn message_stop() -> String {
    event("message_stop", &json!({"type": "message_stop"}))
}

/// An error answer's body.
pub fn error_body(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_is_named_events_whose_type_matches_their_name() {
        let text = opening("chatcmpl-1", "m", 12)
            + &text_delta(" tok0")
            + &closing(12, 1)
            + &message_stop();
        let events = crate::vllm::named_events(&text).unwrap();
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        for (name, data) in &events {
            assert_eq!(data["type"], name.as_str());
        }
        assert_eq!(events[0].1["message"]["usage"]["output_tokens"], 0);
        assert_eq!(events[2].1["delta"]["text"], " tok0");
        assert_eq!(events[4].1["usage"]["output_tokens"], 1);
        assert_eq!(events[4].1["usage"]["input_tokens"], 12);
    }

    #[test]
    fn kv_transfer_params_appear_only_when_there_are_some() {
        let kv = json!({"do_remote_prefill": true});
        let with = full_body("chatcmpl-1", "m", "x", 3, 1, Some(&kv));
        assert_eq!(with["kv_transfer_params"], kv);
        assert_eq!(with["usage"]["output_tokens"], 1);
        let without = full_body("chatcmpl-1", "m", "x", 3, 1, None);
        assert!(without.get("kv_transfer_params").is_none());
        assert_eq!(without["content"][0]["text"], "x");
    }
}
