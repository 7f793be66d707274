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
//! never pass through an `f64`.

use serde_json::{json, Map, Value};

use crate::core::errors::RouteError;
use crate::core::request::Endpoint;

/// 2023-01-01T00:00:00Z, the epoch of the id's timestamp.
pub const SNOWFLAKE_EPOCH_MS: u64 = 1_672_531_200_000;
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

/// The context (prefill) leg: one unstreamed token; TRT-LLM aliases
/// `max_completion_tokens` to `max_tokens`, so the former is dropped rather than capped.
pub fn context_body(
    client: &Map<String, Value>,
    disagg_request_id: i64,
    style: ScheduleStyle,
) -> Vec<u8> {
    let mut body = client.clone();
    let mut params =
        json!({"request_type": "context_only", "disagg_request_id": disagg_request_id});
    if style == ScheduleStyle::GenerationFirst {
        params["schedule_style"] = json!(1);
    }
    body.insert("disaggregated_params".into(), params);
    body.insert("max_tokens".into(), json!(1));
    body.remove("max_completion_tokens");
    body.insert("stream".into(), json!(false));
    body.remove("stream_options");
    body.remove("min_tokens");
    Value::Object(body).to_string().into_bytes()
}

fn bad_response(detail: &str) -> RouteError {
    RouteError::Prefill {
        status: 502,
        class: "invalid_response",
        detail: detail.into(),
    }
}

/// The generation (decode) leg of `context_first`, from the context answer. `None` means
/// "forward the client's body unchanged" (the answer carried no `disaggregated_params`).
pub fn generation_body(
    client: &Map<String, Value>,
    endpoint: Endpoint,
    ctx_response: &[u8],
) -> Result<Option<Vec<u8>>, RouteError> {
    let response = match serde_json::from_slice::<Value>(ctx_response) {
        Ok(Value::Object(map)) => map,
        _ => return Err(bad_response("the context response is not a JSON object")),
    };
    let params = response
        .get("disaggregated_params")
        .filter(|v| !v.is_null())
        .or_else(|| {
            response
                .get("choices")
                .and_then(|c| c.get(0))
                .and_then(|c| c.get("disaggregated_params"))
                .filter(|v| !v.is_null())
        });
    let mut params = match params {
        None => return Ok(None),
        Some(Value::Object(p)) => p.clone(),
        Some(_) => {
            return Err(bad_response(
                "disaggregated_params in the context response is not an object",
            ))
        }
    };
    params.insert("request_type".into(), json!("generation_only"));
    let mut body = client.clone();
    body.insert("disaggregated_params".into(), Value::Object(params));
    if let Some(ids @ Value::Array(_)) = response.get("prompt_token_ids") {
        match endpoint {
            Endpoint::Completions => {
                body.insert("prompt".into(), ids.clone());
            }
            Endpoint::ChatCompletions => {
                body.insert("prompt_token_ids".into(), ids.clone());
            }
        }
    }
    Ok(Some(Value::Object(body).to_string().into_bytes()))
}

/// The generation (decode) leg of `generation_first`, sent without waiting for the context.
pub fn generation_first_body(
    client: &Map<String, Value>,
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
    let mut body = client.clone();
    body.insert("disaggregated_params".into(), params);
    Value::Object(body).to_string().into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> Map<String, Value> {
        match serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
                "stream_options":{"include_usage":true},"max_completion_tokens":9,"min_tokens":2}"#,
        )
        .unwrap()
        {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
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
        let raw = context_body(&client(), id, ScheduleStyle::ContextFirst);
        let text = String::from_utf8(raw.clone()).unwrap();
        assert!(text.contains("4611686018427387905"), "exact id: {text}");
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
            serde_json::from_slice(&context_body(&client(), id, ScheduleStyle::GenerationFirst))
                .unwrap();
        assert_eq!(gf["disaggregated_params"]["schedule_style"], 1);
    }

    #[test]
    fn generation_leg_from_the_context_answer() {
        let answer = br#"{"choices":[{"index":0,"disaggregated_params":{"request_type":"context_only",
            "first_gen_tokens":[12366],"ctx_request_id":4611686018427387903,"encoded_opaque_state":"AAAA",
            "disagg_request_id":4611686018427387905}}],"prompt_token_ids":[1,2,3]}"#;
        let chat = generation_body(&client(), Endpoint::ChatCompletions, answer)
            .unwrap()
            .unwrap();
        let text = String::from_utf8(chat.clone()).unwrap();
        assert!(
            text.contains("4611686018427387903") && text.contains("4611686018427387905"),
            "{text}"
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
        let mut completion = client();
        completion.insert("prompt".into(), json!("hello"));
        let c = generation_body(&completion, Endpoint::Completions, answer)
            .unwrap()
            .unwrap();
        let v: Value = serde_json::from_slice(&c).unwrap();
        assert_eq!(v["prompt"], json!([1, 2, 3]));

        let top = br#"{"disaggregated_params":{"ctx_request_id":7},"choices":[]}"#;
        let v: Value = serde_json::from_slice(
            &generation_body(&client(), Endpoint::ChatCompletions, top)
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            v["disaggregated_params"]["ctx_request_id"], 7,
            "top level wins"
        );
        assert_eq!(
            generation_body(&client(), Endpoint::ChatCompletions, b"{}").unwrap(),
            None
        );
        assert!(generation_body(&client(), Endpoint::ChatCompletions, b"nope").is_err());
        assert!(generation_body(
            &client(),
            Endpoint::ChatCompletions,
            br#"{"disaggregated_params":3}"#
        )
        .is_err());
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
            serde_json::from_slice(&generation_first_body(&client(), id, &info)).unwrap();
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
}
