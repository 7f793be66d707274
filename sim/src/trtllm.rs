//! TensorRT-LLM's disaggregated serving over the OpenAI API (`trtllm-serve`): a context
//! (prefill) request marked `disaggregated_params.request_type = "context_only"` answers
//! with per-choice `disaggregated_params` and top-level `prompt_token_ids`; a generation
//! request (`"generation_only"`) names the context result it continues. In the
//! generation-first schedule (`schedule_style = 1`) both legs meet by `disagg_request_id`
//! at the context worker's `ctx_info_endpoint`, which `/server_info` publishes.
//! See `engine-protocols.md` §3.

use base64::Engine as _;
use serde_json::{json, Map, Value};

use crate::engine;
use crate::vllm::{ApiError, Leg, PodRole};

/// `DisaggScheduleStyle`.
pub const CONTEXT_FIRST: u64 = 0;
pub const GENERATION_FIRST: u64 = 1;

/// The disaggregation fields of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrtLeg {
    pub leg: Leg,
    pub schedule_style: u64,
    pub disagg_request_id: Option<i64>,
    pub ctx_request_id: Option<i64>,
    pub encoded_opaque_state: Option<String>,
    pub ctx_info_endpoint: Option<String>,
    pub ctx_dp_rank: Option<i64>,
}

impl TrtLeg {
    pub fn log_value(&self) -> Value {
        json!({
            "request_type": match self.leg { Leg::Prefill => "context_only", _ => "generation_only" },
            "schedule_style": self.schedule_style,
            "disagg_request_id": self.disagg_request_id,
            "ctx_request_id": self.ctx_request_id,
            "encoded_opaque_state": self.encoded_opaque_state,
            "ctx_info_endpoint": self.ctx_info_endpoint,
            "ctx_dp_rank": self.ctx_dp_rank,
        })
    }
}

/// An int64 field: TRT-LLM's pydantic model refuses floats, so an id that went through an
/// f64 (and lost its low digits or became `4.3e15`) is a 400, not a silent mismatch.
fn int64(params: &Map<String, Value>, key: &str) -> Result<Option<i64>, ApiError> {
    match params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_i64().map(Some).ok_or_else(|| {
            ApiError::bad_request(format!(
                "disaggregated_params.{key}: Input should be a valid integer, got {v}"
            ))
        }),
    }
}

/// Classifies a request on a pod of `role`; `None` for an ordinary request on a worker
/// that is not a generation worker.
pub fn classify(obj: &Map<String, Value>, role: PodRole) -> Result<Option<TrtLeg>, ApiError> {
    let params = match obj.get("disaggregated_params") {
        None | Some(Value::Null) => {
            if role == PodRole::Decode {
                return Err(ApiError::bad_request(
                    "generation worker requires disaggregated_params from a context worker",
                ));
            }
            return Ok(None);
        }
        Some(Value::Object(p)) => p,
        Some(_) => {
            return Err(ApiError::bad_request(
                "disaggregated_params: Input should be a valid dictionary",
            ))
        }
    };
    let leg = match params.get("request_type").and_then(Value::as_str) {
        Some("context_only") => Leg::Prefill,
        Some("generation_only") => Leg::Decode,
        Some("context_and_generation") | None => Leg::Full,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "disaggregated_params.request_type: unknown value {other:?}"
            )))
        }
    };
    let schedule_style = match params.get("schedule_style") {
        None | Some(Value::Null) => CONTEXT_FIRST,
        Some(v) => v
            .as_u64()
            .filter(|s| *s <= GENERATION_FIRST)
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "disaggregated_params.schedule_style: expected 0 or 1, got {v}"
                ))
            })?,
    };
    let t = TrtLeg {
        leg,
        schedule_style,
        disagg_request_id: int64(params, "disagg_request_id")?,
        ctx_request_id: int64(params, "ctx_request_id")?,
        encoded_opaque_state: params
            .get("encoded_opaque_state")
            .and_then(Value::as_str)
            .map(str::to_string),
        ctx_info_endpoint: params
            .get("ctx_info_endpoint")
            .and_then(Value::as_str)
            .map(str::to_string),
        ctx_dp_rank: int64(params, "ctx_dp_rank")?,
    };
    if t.leg == Leg::Decode {
        if t.ctx_request_id.is_none() {
            return Err(ApiError::bad_request(
                "generation_only request without ctx_request_id",
            ));
        }
        if t.schedule_style == GENERATION_FIRST
            && (t.ctx_info_endpoint.is_none() || t.disagg_request_id.is_none())
        {
            return Err(ApiError::bad_request(
                "generation-first request without ctx_info_endpoint or disagg_request_id",
            ));
        }
    }
    if t.leg == Leg::Prefill
        && t.schedule_style == GENERATION_FIRST
        && t.disagg_request_id.is_none()
    {
        return Err(ApiError::bad_request(
            "generation-first context request without disagg_request_id",
        ));
    }
    Ok(Some(t))
}

/// The KV-transceiver endpoint a context worker at `ip` publishes.
pub fn ctx_info_endpoint(ip: &str) -> String {
    format!("tcp://{ip}:5555")
}

/// `GET /server_info`. With the C++ KV transceiver TRT-LLM reports no generation-first
/// metadata: an empty `disaggregated_params`.
pub fn server_info(ip: &str, python_transceiver: bool) -> Value {
    if python_transceiver {
        json!({"disaggregated_params": {"ctx_dp_rank": 0, "ctx_info_endpoint": [ctx_info_endpoint(ip)]}})
    } else {
        json!({"disaggregated_params": {}})
    }
}

/// The rendezvous key of a generation-first exchange.
pub fn room_key(endpoint: &str, disagg_request_id: i64) -> String {
    format!("trtllm/{endpoint}/{disagg_request_id}")
}

/// A fresh context request id: large (above 2^53, so that an f64 round trip is visible) and
/// positive int64.
pub fn new_ctx_request_id() -> i64 {
    fastrand::i64((1i64 << 60)..(1i64 << 62))
}

/// The opaque KV-transceiver state: which engine holds the KV of which context request.
pub fn opaque_state(engine_id: &str, ctx_request_id: i64) -> String {
    base64::engine::general_purpose::STANDARD.encode(format!("{engine_id}/{ctx_request_id}"))
}

/// The `(engine id, ctx_request_id)` an opaque state names, if it is one of ours.
pub fn parse_opaque_state(state: &str) -> Option<(String, i64)> {
    let raw = base64::engine::general_purpose::STANDARD
        .decode(state)
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (engine, id) = text.rsplit_once('/')?;
    Some((engine.to_string(), id.parse().ok()?))
}

/// Deterministic token ids of a prompt (one per simulated token).
pub fn prompt_token_ids(text: &str) -> Vec<u64> {
    let chars: Vec<char> = text.chars().collect();
    chars
        .chunks(4)
        .map(|c| {
            let s: String = c.iter().collect();
            1000 + engine::fnv1a(0xcbf2_9ce4_8422_2325, s.as_bytes()) % 120_000
        })
        .collect()
}

/// The context response's per-choice `disaggregated_params`.
pub fn ctx_params(t: &TrtLeg, ctx_request_id: i64, opaque: &str, first_gen_token: u64) -> Value {
    json!({
        "request_type": "context_only",
        "first_gen_tokens": [first_gen_token],
        "ctx_request_id": ctx_request_id,
        "encoded_opaque_state": opaque,
        "draft_tokens": null,
        "disagg_request_id": t.disagg_request_id,
        "ctx_dp_rank": 0,
        "ctx_info_endpoint": null,
        "schedule_style": t.schedule_style,
    })
}

/// Adds the context result to a response body: `choices[0].disaggregated_params` and the
/// top-level `prompt_token_ids`.
pub fn decorate_ctx_response(body: &mut Value, params: Value, prompt_ids: &[u64]) {
    if let Some(choice) = body
        .get_mut("choices")
        .and_then(|c| c.get_mut(0))
        .and_then(Value::as_object_mut)
    {
        choice.insert("disaggregated_params".into(), params);
    }
    if let Some(map) = body.as_object_mut() {
        map.insert("prompt_token_ids".into(), json!(prompt_ids));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn legs_and_exact_ids() {
        let ctx = obj(
            json!({"disaggregated_params": {"request_type": "context_only",
            "disagg_request_id": 4_611_686_018_427_387_905i64}}),
        );
        let t = classify(&ctx, PodRole::Prefill).unwrap().unwrap();
        assert_eq!((t.leg, t.schedule_style), (Leg::Prefill, CONTEXT_FIRST));
        assert_eq!(t.disagg_request_id, Some(4_611_686_018_427_387_905));
        let lossy = obj(
            json!({"disaggregated_params": {"request_type": "context_only",
            "disagg_request_id": 4.611686018427388e18}}),
        );
        assert_eq!(classify(&lossy, PodRole::Prefill).unwrap_err().status, 400);

        let gen = obj(
            json!({"disaggregated_params": {"request_type": "generation_only",
            "ctx_request_id": 7, "encoded_opaque_state": "eA=="}}),
        );
        assert_eq!(
            classify(&gen, PodRole::Decode).unwrap().unwrap().leg,
            Leg::Decode
        );
        let gen_first = obj(
            json!({"disaggregated_params": {"request_type": "generation_only",
            "ctx_request_id": 7, "schedule_style": 1}}),
        );
        assert_eq!(
            classify(&gen_first, PodRole::Decode).unwrap_err().status,
            400
        );
        assert_eq!(
            classify(&obj(json!({})), PodRole::Decode)
                .unwrap_err()
                .status,
            400
        );
        assert!(classify(&obj(json!({})), PodRole::Combined)
            .unwrap()
            .is_none());
    }

    #[test]
    fn opaque_state_round_trips() {
        let s = opaque_state("e-1", 1 << 61);
        assert_eq!(parse_opaque_state(&s), Some(("e-1".to_string(), 1 << 61)));
        assert_eq!(parse_opaque_state("not base64!"), None);
        assert_eq!(prompt_token_ids("abcdefghi").len(), 3);
        assert_eq!(
            server_info("127.0.0.5", true)["disaggregated_params"]["ctx_info_endpoint"][0],
            "tcp://127.0.0.5:5555"
        );
        assert_eq!(server_info("x", false), json!({"disaggregated_params": {}}));
    }
}
