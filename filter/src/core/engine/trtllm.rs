//! TensorRT-LLM disaggregation over the OpenAI API.
//!
//! - `context_first` (default): the context (prefill) leg carries
//!   `disaggregated_params = {request_type: "context_only", disagg_request_id}`; its answer's
//!   `disaggregated_params` (with `ctx_request_id`, `encoded_opaque_state`,
//!   `first_gen_tokens`) and `prompt_token_ids` go into the generation (decode) leg.
//! - `generation_first`: both legs share a Snowflake `disagg_request_id` and
//!   `schedule_style = 1`; the generation leg names the context worker's transceiver from its
//!   `/server_info`, and is forwarded without waiting for the context leg.
//!
//! Ids are 63-bit integers: they are built and written as `i64`/`u64` JSON numbers and
//! never pass through an `f64`. Both legs are spliced from the client's bytes with the
//! request's [`Spans`], and the context answer's `disaggregated_params` and
//! `prompt_token_ids` are copied as the engine wrote them, so no value is re-encoded.

use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::core::errors::RouteError;
use crate::core::json_object::{with_member, BodyEdit, Members, Spans};
use crate::core::json_scan;
use crate::core::request::Endpoint;

/// 2023-01-01T00:00:00Z, the epoch of the id's timestamp.
pub const SNOWFLAKE_EPOCH_MS: u64 = 1_672_531_200_000;

/// Snapshot-poll header naming the polling gateway process and its `AIBRIX_TRT_MACHINE_ID`
/// (`<replica id, 16 hex digits>/<machine id>`): pd-control, which every gateway polls, is
/// where two processes on one machine id can be seen (see [`machine_header`]).
pub const MACHINE_HEADER: &str = "x-pd-trt-machine";

/// The [`MACHINE_HEADER`] value of a gateway process.
pub fn machine_header(replica: u64, machine_id: u16) -> String {
    format!("{replica:016x}/{machine_id}")
}

/// Reads a [`MACHINE_HEADER`] value: `(replica, machine id)`, `None` when malformed or the
/// machine id is outside [0, 1024).
pub fn parse_machine_header(value: &str) -> Option<(u64, u16)> {
    let (replica, machine) = value.trim().split_once('/')?;
    let replica = u64::from_str_radix(replica, 16).ok()?;
    let machine = machine.parse::<u16>().ok().filter(|m| *m < 1024)?;
    Some((replica, machine))
}
/// Ids below this are treated as local ids by TRT-LLM; generated ids are always above.
const LOCAL_ID_LIMIT: u64 = 1 << 42;

/// `AIBRIX_TRT_SCHEDULE_STYLE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScheduleStyle {
    #[default]
    ContextFirst,
    GenerationFirst,
}

impl ScheduleStyle {
    pub fn parse(raw: &str) -> Option<ScheduleStyle> {
        match raw.trim().to_ascii_lowercase().as_str() {
            "context_first" => Some(ScheduleStyle::ContextFirst),
            "generation_first" => Some(ScheduleStyle::GenerationFirst),
            _ => None,
        }
    }
}

/// A Snowflake-style `disagg_request_id`: 41 bits of milliseconds since 2023, 10 bits of
/// machine id (`AIBRIX_TRT_MACHINE_ID`), 12 bits of a counter shared by the gateway
/// process's workers, folded into [2^42, 2^63 - 1).
pub fn snowflake(now_ms: u64, machine_id: u16, counter: u64) -> i64 {
    let ts = now_ms.saturating_sub(SNOWFLAKE_EPOCH_MS).min((1 << 41) - 1);
    let raw = (ts << 22) | (u64::from(machine_id & 0x3ff) << 12) | (counter & 0xfff);
    let span = (i64::MAX as u64) - LOCAL_ID_LIMIT;
    ((raw % span) + LOCAL_ID_LIMIT) as i64
}

/// What the chosen context worker's `/server_info` says, needed by `generation_first`.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerInfo {
    pub ctx_dp_rank: i64,
    pub ctx_info_endpoint: String,
    pub encoded_opaque_state: Option<String>,
}

/// How long a context worker's `/server_info` is reused (AIBrix: one minute).
pub const SERVER_INFO_TTL_MS: u64 = 60_000;

/// Context workers' `/server_info` answers, per address, each for the pod incarnation it came
/// from: a worker restarted on the same IP (its container, or a new pod given the address)
/// reports a new `ctx_info_endpoint`, and generation legs sent with the old one fail until the
/// entry expires. The pod's ready time tells incarnations apart (it changes when Ready turns
/// true again), as AIBrix's key of pod UID and restart counts does.
#[derive(Debug, Default)]
pub struct ServerInfoCache {
    entries: hashbrown::HashMap<String, CachedServerInfo>,
}

#[derive(Debug)]
struct CachedServerInfo {
    info: ServerInfo,
    ready_since_ms: u64,
    expires_ms: u64,
}

impl ServerInfoCache {
    /// The answer of the worker at `address` that became ready at `ready_since_ms`, while fresh.
    pub fn get(&self, address: &str, ready_since_ms: u64, now_ms: u64) -> Option<&ServerInfo> {
        self.entries
            .get(address)
            .filter(|c| c.ready_since_ms == ready_since_ms && c.expires_ms > now_ms)
            .map(|c| &c.info)
    }

    pub fn put(&mut self, address: &str, ready_since_ms: u64, info: ServerInfo, now_ms: u64) {
        self.entries.retain(|_, c| c.expires_ms > now_ms);
        let entry = CachedServerInfo {
            info,
            ready_since_ms,
            expires_ms: now_ms.saturating_add(SERVER_INFO_TTL_MS),
        };
        self.entries.insert(address.to_string(), entry);
    }
}

/// Parses `/server_info`. Missing or invalid metadata (the C++ transceiver answers an empty
/// `disaggregated_params`) is an error: routing fails before either leg is sent.
pub fn parse_server_info(body: &[u8]) -> Result<ServerInfo, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|_| "server_info is not valid JSON".to_string())?;
    let params = v
        .get("disaggregated_params")
        .and_then(Value::as_object)
        .ok_or("server_info has no disaggregated_params object")?;
    let ctx_dp_rank = params
        .get("ctx_dp_rank")
        .and_then(Value::as_i64)
        .ok_or("server_info has no integer disaggregated_params.ctx_dp_rank (generation_first needs the Python KV-cache transceiver)")?;
    let endpoint = match params.get("ctx_info_endpoint") {
        Some(Value::Array(list)) => list.first().and_then(Value::as_str),
        Some(Value::String(s)) => Some(s.as_str()),
        _ => None,
    }
    .filter(|s| !s.is_empty())
    .ok_or("server_info has no ctx_info_endpoint")?;
    Ok(ServerInfo {
        ctx_dp_rank,
        ctx_info_endpoint: endpoint.to_string(),
        encoded_opaque_state: params
            .get("encoded_opaque_state")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
}

/// Members of the client's body the context leg replaces or drops.
const CONTEXT_REPLACED: [&str; 6] = [
    "disaggregated_params",
    "max_tokens",
    "stream",
    "max_completion_tokens",
    "stream_options",
    "min_tokens",
];

/// The context (prefill) leg: one unstreamed token; TRT-LLM aliases
/// `max_completion_tokens` to `max_tokens`, so the former is dropped rather than capped.
pub fn context_body(
    raw: &[u8],
    members: &Spans,
    disagg_request_id: i64,
    style: ScheduleStyle,
) -> Vec<u8> {
    let mut params =
        json!({"request_type": "context_only", "disagg_request_id": disagg_request_id});
    if style == ScheduleStyle::GenerationFirst {
        params["schedule_style"] = json!(1);
    }
    let params = params.to_string();
    members.write(
        raw,
        &CONTEXT_REPLACED,
        &[
            ("disaggregated_params", &params),
            ("max_tokens", "1"),
            ("stream", "false"),
        ],
    )
}

fn bad_response(detail: &str) -> RouteError {
    RouteError::Prefill {
        status: 502,
        class: "invalid_response",
        detail: detail.into(),
    }
}

/// A member that is present and not `null`.
fn present(value: Option<&str>) -> Option<&str> {
    value.filter(|v| *v != "null")
}

/// The generation (decode) leg of `context_first`, from the context answer. `None` means
/// "forward the client's body unchanged" (the answer carried no `disaggregated_params`).
/// Written whole: the reference for [`generation_edit`], which the filter uses.
pub fn generation_body(
    raw: &[u8],
    members: &Spans,
    endpoint: Endpoint,
    ctx_response: &[u8],
) -> Result<Option<Vec<u8>>, RouteError> {
    Ok(generation_members(endpoint, ctx_response)?
        .map(|g| members.write(raw, g.replaced(), &g.added())))
}

/// [`generation_body`] as an edit of the client's body, which Envoy still holds: a chat
/// request's leg only adds members, which go in front, so its prompt is not copied into the
/// VM and back; a completion's leg replaces `prompt` with the engine's token ids and is
/// written whole.
pub fn generation_edit(
    raw: &[u8],
    members: &Spans,
    endpoint: Endpoint,
    ctx_response: &[u8],
) -> Result<Option<BodyEdit>, RouteError> {
    Ok(generation_members(endpoint, ctx_response)?
        .map(|g| members.edit(raw, g.replaced(), &g.added())))
}

/// What the generation leg sets, read from the context answer.
struct GenerationMembers<'a> {
    /// The answer's `disaggregated_params` with `request_type` set to `generation_only`.
    params: String,
    /// The prompt's member and the answer's `prompt_token_ids`, when it carried them.
    ids: Option<(&'static str, &'a str)>,
}

impl GenerationMembers<'_> {
    fn replaced(&self) -> &'static [&'static str] {
        match self.ids {
            None => &["disaggregated_params"],
            Some(("prompt", _)) => &["disaggregated_params", "prompt"],
            Some(_) => &["disaggregated_params", "prompt_token_ids"],
        }
    }

    fn added(&self) -> Vec<(&str, &str)> {
        let mut added = vec![("disaggregated_params", self.params.as_str())];
        if let Some((prompt_key, ids)) = self.ids {
            added.push((prompt_key, ids));
        }
        added
    }
}

/// `None` when the answer carries no `disaggregated_params` (nor in its first choice). The
/// answer's members come from `core::json_scan` (its `prompt_token_ids`, one per prompt
/// token, cost serde ≈ 6 ns each: ≈ 380 µs for a 256 KB prompt), or from serde when the scan
/// leaves the answer to it.
fn generation_members(
    endpoint: Endpoint,
    ctx_response: &[u8],
) -> Result<Option<GenerationMembers<'_>>, RouteError> {
    let not_object = || bad_response("the context response is not a JSON object");
    let text = std::str::from_utf8(ctx_response).map_err(|_| not_object())?;
    // The members the leg needs, the last occurrence of each (as in the engines).
    const NEEDED: [&str; 3] = ["choices", "disaggregated_params", "prompt_token_ids"];
    let [choices, params, ids] = match json_scan::object(text) {
        Some(members) => NEEDED.map(|key| json_scan::last(&members, key).map(|at| &text[at])),
        None => {
            let members = Members::parse(ctx_response).map_err(|_| not_object())?;
            NEEDED.map(|key| members.get(key).map(RawValue::get))
        }
    };
    let first_choice = || {
        let list = serde_json::from_str::<Vec<&RawValue>>(present(choices)?).ok()?;
        let first = Members::of(list.first()?).ok()?;
        present(first.get("disaggregated_params").map(RawValue::get))
    };
    let Some(params) = present(params).or_else(first_choice) else {
        return Ok(None);
    };
    let params = with_member(params, "request_type", "\"generation_only\"").ok_or_else(|| {
        bad_response("disaggregated_params in the context response is not an object")
    })?;
    // Messages never reaches a TRT-LLM pair (`Engine::serves_pd`); it would be chat-shaped.
    let prompt_key = if endpoint.has_messages() {
        "prompt_token_ids"
    } else {
        "prompt"
    };
    let ids = ids
        .filter(|v| v.starts_with('['))
        .map(|ids| (prompt_key, ids));
    Ok(Some(GenerationMembers { params, ids }))
}

/// The client's answer when the context leg finished the request itself.
#[derive(Debug, PartialEq)]
pub struct FinalAnswer {
    pub body: Vec<u8>,
    pub content_type: &'static str,
}

/// The context answer as the client's whole answer, when no generation leg is needed: TRT-LLM's
/// disagg server sends none when `choices[0].finish_reason` is anything but `length` or
/// `not_finished` (the first token ended the answer: an end-of-sequence or a stop string), and
/// answers the context response, without its `disaggregated_params`; a streaming client gets it
/// as one chunk (plus the usage chunk it asked for) and `[DONE]`. `None` when the generation
/// leg is needed, or the answer is not one this can read (the generation leg's merge then
/// reports it).
pub fn final_context_answer(
    ctx_response: &[u8],
    endpoint: Endpoint,
    stream: bool,
    include_usage: bool,
) -> Option<FinalAnswer> {
    let text = std::str::from_utf8(ctx_response).ok()?;
    // A cheap look at the first choice's `finish_reason` (the answer's `prompt_token_ids`, one
    // per prompt token, are not parsed on this path, which every context answer takes).
    let choices = match json_scan::object(text) {
        Some(members) => &text[json_scan::last(&members, "choices")?],
        None => Members::parse(ctx_response).ok()?.get("choices")?.get(),
    };
    let list = serde_json::from_str::<Vec<&RawValue>>(choices).ok()?;
    let first = Members::of(list.first()?).ok()?;
    let reason = first
        .get("finish_reason")
        .and_then(|r| serde_json::from_str::<Option<&str>>(r.get()).ok())
        .flatten()?;
    if matches!(reason, "length" | "not_finished") {
        return None;
    }
    let mut answer: Value = serde_json::from_slice(ctx_response).ok()?;
    let map = answer.as_object_mut()?;
    map.remove("prompt_token_ids");
    map.remove("prompt_token_ids_b64");
    for choice in map.get_mut("choices")?.as_array_mut()? {
        if let Some(choice) = choice.as_object_mut() {
            choice.remove("disaggregated_params");
        }
    }
    if !stream {
        return Some(FinalAnswer {
            body: answer.to_string().into_bytes(),
            content_type: "application/json",
        });
    }
    Some(FinalAnswer {
        body: as_stream(&answer, endpoint, include_usage).into_bytes(),
        content_type: "text/event-stream",
    })
}

/// A whole answer as the stream of it: one chunk with every choice's text and finish reason,
/// the usage chunk when asked for, `[DONE]`.
fn as_stream(answer: &Value, endpoint: Endpoint, include_usage: bool) -> String {
    let chat = endpoint.has_messages();
    let choices: Vec<Value> = answer["choices"]
        .as_array()
        .map(|choices| {
            choices
                .iter()
                .map(|c| {
                    let mut chunk = if chat {
                        json!({"index": c["index"], "delta": {"role": "assistant",
                            "content": c["message"]["content"]}})
                    } else {
                        json!({"index": c["index"], "text": c["text"]})
                    };
                    chunk["logprobs"] = Value::Null;
                    chunk["finish_reason"] = c["finish_reason"].clone();
                    chunk
                })
                .collect()
        })
        .unwrap_or_default();
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let chunk = |choices: Value| {
        json!({"id": answer["id"], "object": object, "created": answer["created"],
               "model": answer["model"], "choices": choices})
    };
    let mut out = format!("data: {}\n\n", chunk(Value::Array(choices)));
    if include_usage {
        let mut usage = chunk(json!([]));
        usage["usage"] = answer["usage"].clone();
        out.push_str(&format!("data: {usage}\n\n"));
    }
    out.push_str("data: [DONE]\n\n");
    out
}

/// The generation (decode) leg of `generation_first`, sent without waiting for the context.
pub fn generation_first_body(
    raw: &[u8],
    members: &Spans,
    disagg_request_id: i64,
    info: &ServerInfo,
) -> Vec<u8> {
    let mut params = json!({
        "request_type": "generation_only",
        "disagg_request_id": disagg_request_id,
        "ctx_request_id": disagg_request_id,
        "schedule_style": 1,
        "ctx_info_endpoint": info.ctx_info_endpoint,
        "ctx_dp_rank": info.ctx_dp_rank,
    });
    if let Some(state) = &info.encoded_opaque_state {
        params["encoded_opaque_state"] = json!(state);
    }
    let params = params.to_string();
    members.write(
        raw,
        &["disaggregated_params"],
        &[("disaggregated_params", &params)],
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_machine_header_reads_back_what_it_wrote() {
        let value = machine_header(0xabc, 1023);
        assert_eq!(value, "0000000000000abc/1023");
        assert_eq!(parse_machine_header(&value), Some((0xabc, 1023)));
        for bad in ["", "abc", "zz/1", "1/1024", "1/-1", "1/x"] {
            assert_eq!(parse_machine_header(bad), None, "{bad}");
        }
    }

    use super::*;

    const CLIENT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
                "stream_options":{"include_usage":true},"max_completion_tokens":9,"min_tokens":2,"temperature":0.50}"#;

    fn spans(raw: &[u8]) -> Spans {
        Members::parse(raw).expect("one JSON object").spans(raw)
    }

    fn context(id: i64, style: ScheduleStyle) -> Vec<u8> {
        context_body(CLIENT, &spans(CLIENT), id, style)
    }

    fn generation(
        client: &[u8],
        endpoint: Endpoint,
        answer: &[u8],
    ) -> Result<Option<Vec<u8>>, RouteError> {
        generation_body(client, &spans(client), endpoint, answer)
    }

    #[test]
    fn snowflake_layout_and_range() {
        let now = SNOWFLAKE_EPOCH_MS + 1000;
        let id = snowflake(now, 5, 3) as u64;
        assert_eq!(id, (1000 << 22 | 5 << 12 | 3) + (1 << 42));
        assert_eq!(
            snowflake(now, 5, 4096 + 3),
            snowflake(now, 5, 3),
            "12-bit counter"
        );
        assert_ne!(snowflake(now, 6, 3), snowflake(now, 5, 3));
        let far = snowflake(u64::MAX, 1023, 4095);
        assert!((1 << 42..i64::MAX).contains(&far));
        assert!(
            snowflake(0, 0, 0) >= 1 << 42,
            "before the epoch still above the local range"
        );
    }

    #[test]
    fn context_leg_shape() {
        let id: i64 = 4_611_686_018_427_387_905;
        let raw = context(id, ScheduleStyle::ContextFirst);
        let text = String::from_utf8(raw.clone()).unwrap();
        assert!(text.contains("4611686018427387905"), "exact id: {text}");
        assert!(
            text.contains(r#""temperature":0.50"#),
            "client bytes kept: {text}"
        );
        assert_eq!(
            text.matches("\"stream\"").count(),
            1,
            "replaced, not added: {text}"
        );
        let v: Value = serde_json::from_slice(&raw).unwrap();
        assert_eq!(
            v["disaggregated_params"],
            json!({"request_type": "context_only", "disagg_request_id": id})
        );
        assert_eq!(
            (v["max_tokens"].as_i64(), &v["stream"]),
            (Some(1), &json!(false))
        );
        for gone in ["max_completion_tokens", "stream_options", "min_tokens"] {
            assert!(v.get(gone).is_none(), "{gone}");
        }
        let gf: Value =
            serde_json::from_slice(&context(id, ScheduleStyle::GenerationFirst)).unwrap();
        assert_eq!(gf["disaggregated_params"]["schedule_style"], 1);
    }

    #[test]
    fn an_answer_the_scan_leaves_to_serde_gives_the_same_leg() {
        let plain = br#"{"choices":[{"disaggregated_params":{"ctx_request_id":7}}],
            "prompt_token_ids":[1,2,30000]}"#;
        // An escaped member name: the scan leaves the answer to serde, which decodes it.
        let escaped = br#"{"\u0063hoices":[{"disaggregated_params":{"ctx_request_id":7}}],
            "prompt_token_ids":[1,2,30000]}"#;
        assert!(json_scan::object(std::str::from_utf8(escaped).unwrap()).is_none());
        assert!(json_scan::object(std::str::from_utf8(plain).unwrap()).is_some());
        for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions] {
            let leg = generation(CLIENT, endpoint, plain).unwrap();
            assert!(leg.is_some());
            assert_eq!(leg, generation(CLIENT, endpoint, escaped).unwrap());
        }
        for bad in [&b"{\"choices\":[}"[..], b"\xff", b"[1]"] {
            assert_eq!(
                generation(CLIENT, Endpoint::ChatCompletions, bad)
                    .unwrap_err()
                    .to_string(),
                generation(CLIENT, Endpoint::ChatCompletions, b"{")
                    .unwrap_err()
                    .to_string()
            );
        }
    }

    #[test]
    fn the_edited_generation_leg_reads_as_the_written_one() {
        let answers: [&[u8]; 3] = [
            br#"{"choices":[{"disaggregated_params":{"request_type":"context_only",
                "ctx_request_id":4611686018427387903}}],"prompt_token_ids":[1,2,3]}"#,
            br#"{"disaggregated_params":{"ctx_request_id":1},"prompt_token_ids":null}"#,
            br#"{"disaggregated_params":{"ctx_request_id":1,"request_type":"x"}}"#,
        ];
        let clients: [&[u8]; 5] = [
            CLIENT,
            b" \n {\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}\n",
            br#"{"model":"m","prompt_token_ids":[9],"messages":[]}"#,
            br#"{"model":"m","disaggregated_params":{"a":1},"prompt":"hi"}"#,
            br#"{"model":"m","prompt":"hi","max_tokens":5,"prompt":"again"}"#,
        ];
        let value = |b: &[u8]| serde_json::from_slice::<Value>(b).expect("JSON");
        for answer in answers {
            for client in clients {
                for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions] {
                    let written = generation_body(client, &spans(client), endpoint, answer)
                        .unwrap()
                        .unwrap();
                    let edit = generation_edit(client, &spans(client), endpoint, answer)
                        .unwrap()
                        .unwrap();
                    assert_eq!(value(&edit.apply(client)), value(&written));
                }
            }
        }
        // A chat leg only adds members: they go in front. A completion's replaces `prompt`.
        let edit = |endpoint| {
            generation_edit(CLIENT, &spans(CLIENT), endpoint, answers[0])
                .unwrap()
                .unwrap()
        };
        assert!(matches!(
            edit(Endpoint::ChatCompletions),
            BodyEdit::Prefix { replace: 1, .. }
        ));
        let completion = br#"{"model":"m","prompt":"hi"}"#;
        assert!(matches!(
            generation_edit(
                completion,
                &spans(completion),
                Endpoint::Completions,
                answers[0]
            ),
            Ok(Some(BodyEdit::Whole(_)))
        ));
        // No parameters in the answer: the client's body goes on unchanged, edited or not.
        let bare = br#"{"choices":[{"text":"x"}]}"#;
        assert_eq!(
            generation_edit(CLIENT, &spans(CLIENT), Endpoint::ChatCompletions, bare),
            Ok(None)
        );
    }

    #[test]
    fn generation_leg_from_the_context_answer() {
        let answer = br#"{"choices":[{"index":0,"disaggregated_params":{"request_type":"context_only",
            "first_gen_tokens":[12366],"ctx_request_id":4611686018427387903,"encoded_opaque_state":"AAAA",
            "disagg_request_id":4611686018427387905}}],"prompt_token_ids":[1,2,3]}"#;
        let chat = generation(CLIENT, Endpoint::ChatCompletions, answer)
            .unwrap()
            .unwrap();
        let text = String::from_utf8(chat.clone()).unwrap();
        assert!(
            text.contains("4611686018427387903") && text.contains("4611686018427387905"),
            "{text}"
        );
        assert!(
            text.contains(r#""temperature":0.50"#),
            "client bytes kept: {text}"
        );
        let v: Value = serde_json::from_slice(&chat).unwrap();
        let p = &v["disaggregated_params"];
        assert_eq!(p["request_type"], "generation_only");
        assert_eq!(p["first_gen_tokens"], json!([12366]));
        assert_eq!(p["encoded_opaque_state"], "AAAA");
        assert_eq!(v["prompt_token_ids"], json!([1, 2, 3]));
        assert_eq!(
            v["stream"], true,
            "the client's own parameters go to generation"
        );
        let completion = br#"{"model":"m","prompt":"hello","max_tokens":5}"#;
        let c = generation(completion, Endpoint::Completions, answer)
            .unwrap()
            .unwrap();
        let v: Value = serde_json::from_slice(&c).unwrap();
        assert_eq!(v["prompt"], json!([1, 2, 3]));
        assert_eq!(v["max_tokens"], 5);
        let dup = br#"{"model":"m","disaggregated_params":{"request_type":"x"},"disaggregated_params":null}"#;
        let v: Value = serde_json::from_slice(
            &generation(dup, Endpoint::ChatCompletions, answer)
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(v["disaggregated_params"]["request_type"], "generation_only");

        let top = br#"{"disaggregated_params":{"ctx_request_id":7},"choices":[]}"#;
        let v: Value = serde_json::from_slice(
            &generation(CLIENT, Endpoint::ChatCompletions, top)
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            v["disaggregated_params"]["ctx_request_id"], 7,
            "top level wins"
        );
        for none in [
            &b"{}"[..],
            br#"{"disaggregated_params":null,"choices":[{"disaggregated_params":null}]}"#,
            br#"{"choices":[]}"#,
        ] {
            assert_eq!(
                generation(CLIENT, Endpoint::ChatCompletions, none).unwrap(),
                None
            );
        }
        for bad in [
            &b"nope"[..],
            br#"{"disaggregated_params":3}"#,
            br#"{"choices":[{"disaggregated_params":[1]}]}"#,
        ] {
            assert!(
                generation(CLIENT, Endpoint::ChatCompletions, bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn server_info_and_generation_first_leg() {
        let ok = br#"{"disaggregated_params":{"ctx_dp_rank":0,"ctx_info_endpoint":["tcp://10.0.0.1:5555"]}}"#;
        let info = parse_server_info(ok).unwrap();
        assert_eq!(info.ctx_info_endpoint, "tcp://10.0.0.1:5555");
        for bad in [
            &br#"{"disaggregated_params":{}}"#[..],
            br#"{"disaggregated_params":{"ctx_dp_rank":null,"ctx_info_endpoint":["x"]}}"#,
            br#"{"disaggregated_params":{"ctx_dp_rank":0,"ctx_info_endpoint":[]}}"#,
            br#"{}"#,
            b"<html>",
        ] {
            assert!(
                parse_server_info(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let id: i64 = 4_398_046_511_105;
        let v: Value =
            serde_json::from_slice(&generation_first_body(CLIENT, &spans(CLIENT), id, &info))
                .unwrap();
        assert_eq!(
            v["disaggregated_params"],
            json!({"request_type": "generation_only", "disagg_request_id": id, "ctx_request_id": id,
                   "schedule_style": 1, "ctx_info_endpoint": "tcp://10.0.0.1:5555", "ctx_dp_rank": 0})
        );
        assert_eq!(
            ScheduleStyle::parse(" Generation_First"),
            Some(ScheduleStyle::GenerationFirst)
        );
        assert_eq!(ScheduleStyle::parse("parallel"), None);
    }

    #[test]
    fn server_info_is_reused_only_for_the_same_worker_incarnation() {
        let info = ServerInfo {
            ctx_dp_rank: 0,
            ctx_info_endpoint: "tcp://10.0.0.1:5555".into(),
            encoded_opaque_state: None,
        };
        let mut cache = ServerInfoCache::default();
        cache.put("10.0.0.1:8000", 1_000, info.clone(), 5_000);
        assert_eq!(cache.get("10.0.0.1:8000", 1_000, 6_000), Some(&info));
        assert_eq!(cache.get("10.0.0.1:8000", 9_000, 6_000), None, "restarted");
        assert_eq!(cache.get("10.0.0.2:8000", 1_000, 6_000), None);
        assert_eq!(
            cache.get("10.0.0.1:8000", 1_000, 5_000 + SERVER_INFO_TTL_MS),
            None,
            "expired"
        );
    }

    fn ctx_answer(finish: &str, chat: bool) -> Vec<u8> {
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": ""},
                   "finish_reason": finish,
                   "disaggregated_params": {"request_type": "context_only", "ctx_request_id": 7}})
        } else {
            json!({"index": 0, "text": "", "finish_reason": finish,
                   "disaggregated_params": {"request_type": "context_only", "ctx_request_id": 7}})
        };
        json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
               "choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": 1,
               "total_tokens": 6}, "prompt_token_ids": [1, 2, 3, 4, 5]})
        .to_string()
        .into_bytes()
    }

    /// A context leg that finished the answer (first token EOS) is the answer: no generation
    /// leg, the context answer without its disaggregation members, streamed when asked.
    #[test]
    fn a_context_answer_that_finished_is_the_clients_answer() {
        for finish in ["length", "not_finished"] {
            let answer = ctx_answer(finish, false);
            assert_eq!(
                final_context_answer(&answer, Endpoint::Completions, false, false),
                None
            );
        }
        let null = String::from_utf8(ctx_answer("x", false))
            .unwrap()
            .replace("\"x\"", "null");
        assert_eq!(
            final_context_answer(null.as_bytes(), Endpoint::Completions, false, false),
            None,
            "no reason given: the generation leg decides"
        );

        let whole = final_context_answer(
            &ctx_answer("stop", false),
            Endpoint::Completions,
            false,
            false,
        )
        .expect("final");
        assert_eq!(whole.content_type, "application/json");
        let v: Value = serde_json::from_slice(&whole.body).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert!(v["choices"][0].get("disaggregated_params").is_none());
        assert!(v.get("prompt_token_ids").is_none());
        assert_eq!(v["usage"]["total_tokens"], 6);

        let streamed = final_context_answer(
            &ctx_answer("stop", true),
            Endpoint::ChatCompletions,
            true,
            true,
        )
        .expect("final");
        assert_eq!(streamed.content_type, "text/event-stream");
        let text = String::from_utf8(streamed.body).unwrap();
        let events: Vec<&str> = text
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").expect("an SSE data event"))
            .collect();
        assert_eq!(events.len(), 3, "{text}");
        let first: Value = serde_json::from_str(events[0]).unwrap();
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["choices"][0]["finish_reason"], "stop");
        let usage: Value = serde_json::from_str(events[1]).unwrap();
        assert_eq!(usage["usage"]["total_tokens"], 6);
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(events[2], "[DONE]");
    }
}
