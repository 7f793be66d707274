//! vLLM's OpenAI Responses API (`POST /v1/responses`) wire shapes: the response object, the
//! stream's named events and their sequence numbers.
//!
//! vLLM accepts `kv_transfer_params` on a Responses request (a prefill marker makes the
//! request a prefill leg, as on chat) but its response object has no such member, so a
//! decode leg has nothing to pull with: the router sends these requests to one pod. The
//! generated-token count is `usage.output_tokens`, in the body and in `response.completed`.
//! Every simulated answer stops at `max_output_tokens`, so its status is `incomplete`.

use serde_json::{json, Value};

/// Identity of one response, repeated in its events.
#[derive(Debug, Clone)]
pub struct Meta<'a> {
    pub id: &'a str,
    pub model: &'a str,
    pub created: u64,
    pub max_output_tokens: u64,
}

/// One named SSE event carrying its sequence number.
fn event(name: &str, seq: u64, mut data: Value) -> String {
    if let Some(map) = data.as_object_mut() {
        map.insert("type".into(), json!(name));
        map.insert("sequence_number".into(), json!(seq));
    }
    format!("event: {name}\ndata: {data}\n\n")
}

fn item_id(meta: &Meta<'_>) -> String {
    format!("msg_{}", meta.id.trim_start_matches("resp_"))
}

fn output_item(meta: &Meta<'_>, text: &str, status: &str) -> Value {
    json!({
        "id": item_id(meta), "type": "message", "role": "assistant", "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    })
}

/// The response object; `usage` is `None` while the stream is still going.
pub fn response(meta: &Meta<'_>, text: &str, status: &str, usage: Option<(u64, u64)>) -> Value {
    let output = if status == "in_progress" {
        json!([])
    } else {
        json!([output_item(meta, text, "completed")])
    };
    let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
    json!({
        "id": meta.id, "object": "response", "created_at": meta.created, "model": meta.model,
        "status": status, "incomplete_details": incomplete, "output": output,
        "max_output_tokens": meta.max_output_tokens, "parallel_tool_calls": true,
        "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "tools": [],
        "background": false, "service_tier": "auto", "truncation": "disabled",
        "usage": usage.map(|(input, output)| json!({
            "input_tokens": input, "output_tokens": output, "total_tokens": input + output,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        })),
    })
}

/// The unstreamed answer.
pub fn full_body(meta: &Meta<'_>, text: &str, input_tokens: u64, output_tokens: u64) -> Value {
    response(
        meta,
        text,
        "incomplete",
        Some((input_tokens, output_tokens)),
    )
}

/// Events before the first token's text (sequence numbers 0–3).
pub fn opening(meta: &Meta<'_>) -> String {
    let pending = response(meta, "", "in_progress", None);
    let item = json!({"id": item_id(meta), "type": "message", "role": "assistant",
                      "status": "in_progress", "content": []});
    event("response.created", 0, json!({"response": pending}))
        + &event("response.in_progress", 1, json!({"response": pending}))
        + &event(
            "response.output_item.added",
            2,
            json!({"output_index": 0, "item": item}),
        )
        + &event(
            "response.content_part.added",
            3,
            json!({"output_index": 0, "content_index": 0, "item_id": item_id(meta),
                   "part": {"type": "output_text", "text": "", "annotations": []}}),
        )
}

/// Token `index`'s text.
pub fn text_delta(meta: &Meta<'_>, index: u64, text: &str) -> String {
    event(
        "response.output_text.delta",
        4 + index,
        json!({"output_index": 0, "content_index": 0, "item_id": item_id(meta),
               "delta": text, "logprobs": []}),
    )
}

/// Events after the last of `produced` tokens, ending with `response.completed` and the usage.
pub fn closing(meta: &Meta<'_>, text: &str, input_tokens: u64, produced: u64) -> String {
    let seq = 4 + produced;
    let part = json!({"type": "output_text", "text": text, "annotations": []});
    event(
        "response.output_text.done",
        seq,
        json!({"output_index": 0, "content_index": 0, "item_id": item_id(meta),
               "text": text, "logprobs": []}),
    ) + &event(
        "response.content_part.done",
        seq + 1,
        json!({"output_index": 0, "content_index": 0, "item_id": item_id(meta), "part": part}),
    ) + &event(
        "response.output_item.done",
        seq + 2,
        json!({"output_index": 0, "item": output_item(meta, text, "completed")}),
    ) + &event(
        "response.completed",
        seq + 3,
        json!({"response": response(meta, text, "incomplete", Some((input_tokens, produced)))}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const META: Meta<'static> = Meta {
        id: "resp_abc",
        model: "m",
        created: 1,
        max_output_tokens: 2,
    };

    #[test]
    fn a_stream_numbers_its_events_in_order_and_ends_with_the_usage() {
        let text = opening(&META)
            + &text_delta(&META, 0, " a")
            + &text_delta(&META, 1, " b")
            + &closing(&META, " a b", 7, 2);
        let events = crate::vllm::named_events(&text).unwrap();
        for (i, (name, data)) in events.iter().enumerate() {
            assert_eq!(data["sequence_number"], i as u64, "{name}");
            assert_eq!(data["type"], name.as_str());
        }
        let (last, done) = events.last().expect("events");
        assert_eq!(last, "response.completed");
        assert_eq!(done["response"]["usage"]["output_tokens"], 2);
        assert_eq!(done["response"]["output"][0]["content"][0]["text"], " a b");
        assert!(events[0].1["response"]["usage"].is_null());
    }

    #[test]
    fn the_body_stops_at_max_output_tokens_and_has_no_kv_transfer_params() {
        let body = full_body(&META, " a b", 7, 2);
        assert_eq!(body["status"], "incomplete");
        assert_eq!(body["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(body["usage"]["total_tokens"], 9);
        assert!(body.get("kv_transfer_params").is_none());
    }
}
