//! vLLM's OpenAI-compatible wire shapes: request parsing and validation, the prefill/decode
//! (`kv_transfer_params`) protocol, response and SSE chunk bodies, and error bodies.
//!
//! The shapes follow vLLM ~0.10/0.11 with the NixlConnector, because that is what the
//! router's vLLM path must interoperate with; see `engine-protocols.md` §1 and §6.

use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::engine;

/// Which OpenAI endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Endpoint {
    Completions,
    Chat,
    /// Anthropic's Messages API (`crate::anthropic`), served as chat inside vLLM.
    Messages,
    /// OpenAI's Responses API (`crate::responses`).
    Responses,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::Responses => "/v1/responses",
        }
    }

    /// The response id vLLM derives from `X-Request-Id` (`cmpl-<id>-0`, `chatcmpl-<id>`),
    /// or from a fresh random id when the header is absent.
    pub fn response_id(self, x_request_id: Option<&str>) -> String {
        let id = match x_request_id.filter(|s| !s.is_empty()) {
            Some(id) => id.to_string(),
            None => random_hex(32),
        };
        match self {
            Endpoint::Completions => format!("cmpl-{id}-0"),
            // vLLM answers a Messages request with its chat completion's id.
            Endpoint::Chat | Endpoint::Messages => format!("chatcmpl-{id}"),
            Endpoint::Responses => format!("resp_{id}"),
        }
    }
}

/// Which part of a disaggregated exchange a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Leg {
    /// `kv_transfer_params.do_remote_decode == true`: compute the KV cache and one token.
    Prefill,
    /// `kv_transfer_params.do_remote_prefill == true` with usable params: pull KV, decode.
    Decode,
    /// An ordinary request: prefill and decode on this pod.
    Full,
}

impl Leg {
    pub fn as_str(self) -> &'static str {
        match self {
            Leg::Prefill => "prefill",
            Leg::Decode => "decode",
            Leg::Full => "full",
        }
    }
}

/// What a pod is in the disaggregated deployment, from its `role-name` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodRole {
    Prefill,
    Decode,
    /// Anything else (`combined`, `all`, empty): a standard pod that serves whole requests.
    Combined,
}

impl PodRole {
    pub fn from_label(label: &str) -> Self {
        match label.trim().to_ascii_lowercase().as_str() {
            "prefill" => PodRole::Prefill,
            "decode" => PodRole::Decode,
            _ => PodRole::Combined,
        }
    }
}

/// An error answered in vLLM's (≥0.10.2) body shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
}

/// The message a decode pod answers when it is sent a request it cannot decode.
pub const DECODE_NEEDS_PARAMS: &str = "decode pod requires kv_transfer_params from a prefill pod";
/// The message for a prefill leg that asks to stream.
pub const PREFILL_MUST_NOT_STREAM: &str = "prefill leg must not stream";

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            kind: "BadRequestError",
            message: message.into(),
        }
    }

    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: 404,
            kind: "NotFoundError",
            message: format!("The model `{model}` does not exist."),
        }
    }

    pub fn not_found_path() -> Self {
        ApiError {
            status: 404,
            kind: "NotFoundError",
            message: "Not Found".into(),
        }
    }

    /// The error a `status` fault answers (`/sim/faults`).
    pub fn injected(status: u16) -> Self {
        ApiError {
            status,
            kind: if status >= 500 {
                "InternalServerError"
            } else {
                "BadRequestError"
            },
            message: format!("injected fault: status {status}"),
        }
    }

    /// An engine-side failure (a KV transfer that did not happen, an aborted request).
    pub fn server_error(message: impl Into<String>) -> Self {
        ApiError {
            status: 500,
            kind: "InternalServerError",
            message: message.into(),
        }
    }

    /// SGLang's and TRT-LLM's handler errors:
    /// `{"object":"error","message","type","param":null,"code":<status>}`.
    pub fn flat_body(&self) -> Value {
        json!({"object": "error", "message": self.message, "type": self.kind, "param": null, "code": self.status})
    }

    /// `{"error":{"message","type","param":null,"code":<status>}}`.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": self.status}})
    }
}

/// The parts of a completion request the simulator acts on.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRequest {
    pub endpoint: Endpoint,
    pub model: String,
    /// The prompt text used for token counting and prefix-cache hashing.
    pub prompt_text: String,
    pub prompt_tokens: u64,
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: u64,
    pub kv_transfer_params: Option<Value>,
    pub leg: Leg,
}

/// Parses a request body as JSON, answering vLLM's 400 on failure.
pub fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("JSON decode error: {e}")))
}

impl SimRequest {
    /// Validates a parsed body in vLLM's order (field validation, then the model, then the
    /// disaggregation rules of this pod's role) and classifies its leg.
    pub fn from_json(
        endpoint: Endpoint,
        body: &Value,
        served_model: &str,
        role: PodRole,
        default_max_tokens: u64,
    ) -> Result<SimRequest, ApiError> {
        let mut req = SimRequest::parse_fields(endpoint, body, served_model, default_max_tokens)?;
        req.leg = classify_leg(req.kv_transfer_params.as_ref(), role, req.stream, false)?;
        Ok(req)
    }

    /// The engine-independent validation (fields, then the model); the leg is left `Full`
    /// for the engine's own disaggregation rules to classify.
    pub fn parse_fields(
        endpoint: Endpoint,
        body: &Value,
        served_model: &str,
        default_max_tokens: u64,
    ) -> Result<SimRequest, ApiError> {
        let obj = body
            .as_object()
            .ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
        let (prompt_text, prompt_tokens) = match endpoint {
            Endpoint::Completions => completion_prompt(obj.get("prompt"))?,
            Endpoint::Chat => chat_prompt(obj.get("messages"))?,
            Endpoint::Messages => messages_prompt(obj)?,
            Endpoint::Responses => responses_prompt(obj.get("input"))?,
        };
        let stream = match obj.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::bad_request(
                    "stream: Input should be a valid boolean",
                ))
            }
        };
        let include_usage = match obj.get("stream_options") {
            // The Messages request has no stream_options (an unknown field, ignored); its
            // stream always ends with the usage.
            _ if matches!(endpoint, Endpoint::Messages | Endpoint::Responses) => stream,
            None | Some(Value::Null) => false,
            Some(_) if !stream => {
                return Err(ApiError::bad_request(
                    "Stream options can only be defined when stream=True.",
                ))
            }
            Some(Value::Object(opts)) => opts
                .get("include_usage")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "stream_options: Input should be an object",
                ))
            }
        };
        let max_tokens = max_tokens(endpoint, obj, default_max_tokens)?;
        let kv_transfer_params = match obj.get("kv_transfer_params") {
            None | Some(Value::Null) => None,
            Some(v @ Value::Object(_)) => Some(v.clone()),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "kv_transfer_params: Input should be a valid dictionary",
                ))
            }
        };
        let model = match obj.get("model").and_then(Value::as_str) {
            // The Responses API's model is optional: the served one.
            None if endpoint == Endpoint::Responses => served_model,
            m => m.unwrap_or_default(),
        }
        .to_string();
        if model != served_model {
            return Err(ApiError::model_not_found(&model));
        }
        Ok(SimRequest {
            endpoint,
            model,
            prompt_text,
            prompt_tokens,
            stream,
            include_usage,
            max_tokens,
            kv_transfer_params,
            leg: Leg::Full,
        })
    }

    /// Tokens this request will generate: one for a prefill leg, `max_tokens` otherwise.
    pub fn output_tokens(&self) -> u64 {
        match self.leg {
            Leg::Prefill => 1,
            _ => self.max_tokens,
        }
    }
}

/// Applies the vLLM PD rules for a pod of `role` to a request's `kv_transfer_params`.
///
/// A decode pod refuses a request without them unless `plain_ok`: a real vLLM decode pod
/// would compute such a request itself, but here that is a router's bug (the KV it was sent
/// never used) which tests must see, except after a prefill leg that ended at its first token
/// and so returned no parameters to pass on (vLLM's proxies then send the plain body).
pub fn classify_leg(
    kv: Option<&Value>,
    role: PodRole,
    stream: bool,
    plain_ok: bool,
) -> Result<Leg, ApiError> {
    let flag = |key: &str| kv.and_then(|k| k.get(key)).and_then(Value::as_bool) == Some(true);
    if flag("do_remote_decode") {
        if role == PodRole::Decode {
            return Err(ApiError::bad_request(DECODE_NEEDS_PARAMS));
        }
        if stream {
            return Err(ApiError::bad_request(PREFILL_MUST_NOT_STREAM));
        }
        return Ok(Leg::Prefill);
    }
    if flag("do_remote_prefill") && kv.is_some_and(decode_params_complete) {
        return Ok(Leg::Decode);
    }
    if role == PodRole::Decode && !(plain_ok && kv.is_none()) {
        return Err(ApiError::bad_request(DECODE_NEEDS_PARAMS));
    }
    // vLLM logs "Got invalid KVTransferParams" and prefills locally.
    Ok(Leg::Full)
}

/// The fields a NIXL decode needs to find the prefill pod's blocks, all non-null.
fn decode_params_complete(kv: &Value) -> bool {
    [
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
    ]
    .iter()
    .all(|k| kv.get(*k).is_some_and(|v| !v.is_null()))
}

fn completion_prompt(prompt: Option<&Value>) -> Result<(String, u64), ApiError> {
    match prompt {
        Some(Value::String(s)) => Ok((s.clone(), engine::prompt_tokens(s))),
        Some(Value::Array(items)) if !items.is_empty() => {
            if items.iter().all(Value::is_string) {
                let text: String = items
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join("\n");
                let tokens = engine::prompt_tokens(&text);
                Ok((text, tokens))
            } else if items.iter().all(|v| v.as_u64().is_some()) {
                // Token ids: count them as they are; hash their decimal text for the cache.
                let text = items
                    .iter()
                    .map(|v| v.to_string())
                    .collect::<Vec<_>>()
                    .join(" ");
                Ok((text, items.len() as u64))
            } else {
                Err(ApiError::bad_request(
                    "prompt must be a string, a list of strings or a list of token ids",
                ))
            }
        }
        None | Some(Value::Null) => Err(ApiError::bad_request("prompt: Field required")),
        Some(_) => Err(ApiError::bad_request(
            "prompt must be a string, a list of strings or a list of token ids",
        )),
    }
}

fn chat_prompt(messages: Option<&Value>) -> Result<(String, u64), ApiError> {
    let list = match messages {
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_request(
                "messages: List should have at least 1 item",
            ))
        }
        None | Some(Value::Null) => return Err(ApiError::bad_request("messages: Field required")),
        Some(_) => {
            return Err(ApiError::bad_request(
                "messages: Input should be a valid list",
            ))
        }
    };
    let mut parts = Vec::with_capacity(list.len());
    for message in list {
        match message.get("content") {
            Some(Value::String(s)) => parts.push(s.clone()),
            Some(Value::Array(chunks)) => {
                for chunk in chunks {
                    if let Some(text) = chunk.get("text").and_then(Value::as_str) {
                        parts.push(text.to_string());
                    }
                }
            }
            None | Some(Value::Null) => {}
            Some(_) => {
                return Err(ApiError::bad_request(
                    "messages: content must be a string or a list of parts",
                ))
            }
        }
    }
    let text = parts.join("\n");
    let tokens = engine::prompt_tokens(&text);
    Ok((text, tokens))
}

/// A Responses request's prompt: `input` as a string, or its items' text (a string
/// `content`, or the `text` of its content parts).
fn responses_prompt(input: Option<&Value>) -> Result<(String, u64), ApiError> {
    let text = match input {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) if !items.is_empty() => {
            let mut parts = Vec::new();
            for item in items {
                match item.get("content") {
                    Some(Value::String(s)) => parts.push(s.clone()),
                    Some(Value::Array(blocks)) => parts.extend(
                        blocks
                            .iter()
                            .filter_map(|b| b.get("text").and_then(Value::as_str))
                            .map(str::to_string),
                    ),
                    _ => {}
                }
            }
            parts.join("\n")
        }
        None | Some(Value::Null) => return Err(ApiError::bad_request("input: Field required")),
        Some(_) => {
            return Err(ApiError::bad_request(
                "input: Input should be a valid string or a non-empty list of items",
            ))
        }
    };
    let tokens = engine::prompt_tokens(&text);
    Ok((text, tokens))
}

/// `POST /v1/messages/count_tokens`: the prompt tokens of a Messages body (its `system` and
/// messages), after the model check.
pub fn count_tokens(body: &Value, served_model: &str) -> Result<u64, ApiError> {
    let obj = body
        .as_object()
        .ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    let (_, tokens) = messages_prompt(obj)?;
    let model = obj.get("model").and_then(Value::as_str).unwrap_or_default();
    if model != served_model {
        return Err(ApiError::model_not_found(model));
    }
    Ok(tokens)
}

/// A Messages request's prompt: the top-level `system` (a string or text blocks), then the
/// messages as chat reads them.
fn messages_prompt(obj: &Map<String, Value>) -> Result<(String, u64), ApiError> {
    let (chat, _) = chat_prompt(obj.get("messages"))?;
    let system = match obj.get("system") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect(),
        Some(_) => {
            return Err(ApiError::bad_request(
                "system: Input should be a valid string or a list of blocks",
            ))
        }
    };
    let text = if system.is_empty() {
        chat
    } else {
        format!("{system}\n{chat}")
    };
    let tokens = engine::prompt_tokens(&text);
    Ok((text, tokens))
}

/// `max_completion_tokens` wins over `max_tokens` on chat (as in vLLM); absent or null means
/// the simulator's default. vLLM rejects values below 1.
fn max_tokens(endpoint: Endpoint, obj: &Map<String, Value>, default: u64) -> Result<u64, ApiError> {
    let keys: &[&str] = match endpoint {
        Endpoint::Chat => &["max_completion_tokens", "max_tokens"],
        Endpoint::Completions => &["max_tokens", "max_completion_tokens"],
        // Anthropic's `max_tokens` is required and the only limit.
        Endpoint::Messages if matches!(obj.get("max_tokens"), None | Some(Value::Null)) => {
            return Err(ApiError::bad_request("max_tokens: Field required"))
        }
        Endpoint::Messages => &["max_tokens"],
        Endpoint::Responses => &["max_output_tokens"],
    };
    for key in keys {
        match obj.get(*key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                return match v.as_u64() {
                    Some(n) if n >= 1 => Ok(n),
                    _ => Err(ApiError::bad_request(format!(
                        "{key} must be at least 1, got {v}"
                    ))),
                }
            }
        }
    }
    Ok(default.max(1))
}

/// The `kv_transfer_params` a vLLM NixlConnector prefill returns (v0.11 shape, list of ints
/// for block ids). `remote_host` is `localhost` on purpose: that is vLLM's default side-channel
/// host, and the router must overwrite it with the prefill pod's IP.
pub fn prefill_kv_params(engine_id: &str, request_id: &str, block_ids: &[u64]) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": "localhost",
        "remote_port": 5600,
        "tp_size": 1,
    })
}

/// `usage` object of a response or final chunk.
pub fn usage(prompt_tokens: u64, completion_tokens: u64) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": null,
    })
}

/// Identity of one response: every body and chunk of it repeats these.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    /// The non-streaming response body.
    pub fn full_body(
        &self,
        text: &str,
        prompt_tokens: u64,
        completion_tokens: u64,
        kv_out: Option<&Value>,
    ) -> Value {
        if self.endpoint == Endpoint::Responses {
            // No `kv_transfer_params`: vLLM's response object has no such member.
            return crate::responses::full_body(
                &self.responses_meta(completion_tokens),
                text,
                prompt_tokens,
                completion_tokens,
            );
        }
        if self.endpoint == Endpoint::Messages {
            return crate::anthropic::full_body(
                &self.id,
                &self.model,
                text,
                prompt_tokens,
                completion_tokens,
                kv_out,
            );
        }
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": null,
                "finish_reason": "length", "stop_reason": null, "prompt_logprobs": null,
            }),
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": null, "finish_reason": "length", "stop_reason": null,
            }),
        };
        let mut body = json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens),
        });
        if let Some(map) = body.as_object_mut() {
            if self.endpoint == Endpoint::Chat {
                map.insert("prompt_logprobs".into(), Value::Null);
            }
            map.insert(
                "kv_transfer_params".into(),
                kv_out.cloned().unwrap_or(Value::Null),
            );
        }
        body
    }

    /// This response's identity in the Responses API's shapes.
    pub fn responses_meta(&self, max_output_tokens: u64) -> crate::responses::Meta<'_> {
        crate::responses::Meta {
            id: &self.id,
            model: &self.model,
            created: self.created,
            max_output_tokens,
        }
    }

    /// The chat stream's opening chunk, which carries only the assistant role.
    pub fn role_chunk(&self) -> Value {
        self.chunk(json!([{
            "index": 0, "delta": {"role": "assistant", "content": ""},
            "logprobs": null, "finish_reason": null,
        }]))
    }

    /// One token's chunk; the last one carries `finish_reason: "length"`.
    pub fn token_chunk(&self, text: &str, last: bool) -> Value {
        let finish = if last { json!("length") } else { Value::Null };
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": null,
                "finish_reason": finish, "stop_reason": null,
            }),
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => json!({
                "index": 0, "delta": {"content": text},
                "logprobs": null, "finish_reason": finish, "stop_reason": null,
            }),
        };
        self.chunk(json!([choice]))
    }

    /// The `stream_options.include_usage` chunk: no choices, just usage.
    pub fn usage_chunk(&self, prompt_tokens: u64, completion_tokens: u64) -> Value {
        let mut chunk = self.chunk(json!([]));
        if let Some(map) = chunk.as_object_mut() {
            map.insert("usage".into(), usage(prompt_tokens, completion_tokens));
        }
        chunk
    }

    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat | Endpoint::Messages | Endpoint::Responses, false) => "chat.completion",
            (Endpoint::Chat | Endpoint::Messages | Endpoint::Responses, true) => {
                "chat.completion.chunk"
            }
        }
    }
}

/// One SSE event: `data: <json>\n\n`.
pub fn sse_event(data: &Value) -> String {
    format!("data: {data}\n\n")
}

/// A stream of named SSE events (`event: <name>\ndata: <json>\n\n`, as the Messages and
/// Responses APIs write them) as `(name, data)`, in order.
pub fn named_events(text: &str) -> Result<Vec<(String, Value)>, String> {
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e
                .split_once('\n')
                .ok_or_else(|| format!("not an event and a data line: {e:?}"))?;
            let name = name
                .strip_prefix("event: ")
                .ok_or_else(|| format!("no event line: {e:?}"))?;
            let data = data
                .strip_prefix("data: ")
                .ok_or_else(|| format!("no data line: {e:?}"))?;
            let data = serde_json::from_str(data).map_err(|err| format!("{err}: {data}"))?;
            Ok((name.to_string(), data))
        })
        .collect()
}

/// The SSE terminator.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

/// `GET /v1/models` for a pod serving `model` and the LoRA `adapters` it has loaded (vLLM
/// lists each adapter with `parent` the base model).
pub fn models_body(model: &str, adapters: &[String], created: u64) -> Value {
    let entry = |id: &str, parent: Option<&str>| {
        json!({
            "id": id, "object": "model", "created": created, "owned_by": "vllm",
            "root": id, "parent": parent, "max_model_len": 131072,
            "permission": [{
                "id": format!("modelperm-{}", random_hex(16)), "object": "model_permission",
                "created": created, "allow_create_engine": false, "allow_sampling": true,
                "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                "allow_fine_tuning": false, "organization": "*", "group": null,
                "is_blocking": false,
            }],
        })
    };
    let mut data = vec![entry(model, None)];
    data.extend(adapters.iter().map(|a| entry(a, Some(model))));
    json!({"object": "list", "data": data})
}

/// `n` random lower-case hex digits.
pub fn random_hex(n: usize) -> String {
    (0..n)
        .map(|_| char::from_digit(fastrand::u32(0..16), 16).unwrap_or('0'))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(endpoint: Endpoint, body: Value, role: PodRole) -> Result<SimRequest, ApiError> {
        SimRequest::from_json(endpoint, &body, "m", role, 16)
    }

    fn prefill_marker() -> Value {
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null})
    }

    #[test]
    fn messages_need_max_tokens_ignore_openai_fields_and_always_stream_usage() {
        let body = |extra: Value| {
            let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "abcd"}]});
            if let (Some(b), Some(extra)) = (b.as_object_mut(), extra.as_object()) {
                b.extend(extra.clone());
            }
            b
        };
        let missing = req(Endpoint::Messages, body(json!({})), PodRole::Combined).unwrap_err();
        assert_eq!(missing.message, "max_tokens: Field required");
        for bad in [json!(0), json!("1")] {
            let b = body(json!({"max_tokens": bad}));
            assert!(req(Endpoint::Messages, b, PodRole::Combined).is_err());
        }
        // The prefill leg's OpenAI extras (stream_options off a stream, max_completion_tokens)
        // are unknown fields to the Messages model.
        let b = body(
            json!({"max_tokens": 5, "max_completion_tokens": 1, "stream": true,
                            "stream_options": "x", "system": [{"type": "text", "text": "ab"}]}),
        );
        let r = req(Endpoint::Messages, b, PodRole::Combined).unwrap();
        assert_eq!((r.max_tokens, r.stream, r.include_usage), (5, true, true));
        assert_eq!((r.prompt_text.as_str(), r.prompt_tokens), ("ab\nabcd", 2));
        let b = body(json!({"max_tokens": 5, "kv_transfer_params": prefill_marker()}));
        assert_eq!(
            req(Endpoint::Messages, b, PodRole::Prefill).unwrap().leg,
            Leg::Prefill
        );
    }

    #[test]
    fn ordinary_request_is_full_on_prefill_and_combined_pods() {
        for role in [PodRole::Prefill, PodRole::Combined] {
            let r = req(
                Endpoint::Completions,
                json!({"model": "m", "prompt": "abcdefgh"}),
                role,
            )
            .unwrap();
            assert_eq!(
                (r.leg, r.prompt_tokens, r.max_tokens, r.stream),
                (Leg::Full, 2, 16, false)
            );
        }
    }

    #[test]
    fn prefill_marker_makes_a_prefill_leg_that_must_not_stream() {
        let body = json!({"model": "m", "prompt": "x", "kv_transfer_params": prefill_marker(), "max_tokens": 1});
        let r = req(Endpoint::Completions, body.clone(), PodRole::Prefill).unwrap();
        assert_eq!((r.leg, r.output_tokens()), (Leg::Prefill, 1));
        let mut streaming = body;
        streaming["stream"] = json!(true);
        let err = req(Endpoint::Completions, streaming, PodRole::Prefill).unwrap_err();
        assert_eq!(
            (err.status, err.message.as_str()),
            (400, PREFILL_MUST_NOT_STREAM)
        );
    }

    #[test]
    fn decode_pod_requires_complete_params() {
        let ok = prefill_kv_params("eid", "cmpl-1-0", &[1, 2]);
        let r = req(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                           "kv_transfer_params": ok.clone()}),
            PodRole::Decode,
        )
        .unwrap();
        assert_eq!(r.leg, Leg::Decode);
        let missing = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let mut incomplete = ok.clone();
        incomplete["remote_block_ids"] = Value::Null;
        let with_incomplete = json!({"model": "m", "messages": [{"content": "hi"}], "kv_transfer_params": incomplete});
        let with_marker = json!({"model": "m", "messages": [{"content": "hi"}], "kv_transfer_params": prefill_marker()});
        for body in [missing, with_incomplete.clone(), with_marker] {
            let err = req(Endpoint::Chat, body, PodRole::Decode).unwrap_err();
            assert_eq!(
                (err.status, err.message.as_str()),
                (400, DECODE_NEEDS_PARAMS)
            );
            assert_eq!(err.body()["error"]["type"], "BadRequestError");
        }
        // A combined pod given unusable params prefills locally, as vLLM does.
        assert_eq!(
            req(Endpoint::Chat, with_incomplete, PodRole::Combined)
                .unwrap()
                .leg,
            Leg::Full
        );
    }

    #[test]
    fn wrong_model_is_vllm_404() {
        let err = req(
            Endpoint::Completions,
            json!({"model": "x", "prompt": "p"}),
            PodRole::Combined,
        )
        .unwrap_err();
        assert_eq!(
            err.body(),
            json!({"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": null, "code": 404}})
        );
    }

    #[test]
    fn malformed_and_invalid_bodies_are_400() {
        let err = parse_json(b"{not json").unwrap_err();
        assert_eq!((err.status, err.kind), (400, "BadRequestError"));
        let cases = [
            json!({"model": "m"}),
            json!({"model": "m", "prompt": 5}),
            json!({"model": "m", "prompt": "p", "max_tokens": 0}),
            json!({"model": "m", "prompt": "p", "stream": "yes"}),
            json!({"model": "m", "prompt": "p", "stream_options": {"include_usage": true}}),
            json!({"model": "m", "prompt": "p", "kv_transfer_params": [1]}),
        ];
        for body in cases {
            let err = req(Endpoint::Completions, body.clone(), PodRole::Combined).unwrap_err();
            assert_eq!(err.status, 400, "{body}");
        }
        let err = req(
            Endpoint::Chat,
            json!({"model": "m", "messages": []}),
            PodRole::Combined,
        )
        .unwrap_err();
        assert_eq!(err.status, 400);
    }

    #[test]
    fn chat_fields_and_stream_options() {
        let body = json!({"model": "m", "stream": true, "stream_options": {},
            "max_tokens": 3, "max_completion_tokens": 5,
            "messages": [{"role": "system", "content": "abcd"}, {"role": "user", "content": [{"type": "text", "text": "efg"}]}]});
        let r = req(Endpoint::Chat, body, PodRole::Combined).unwrap();
        assert_eq!(r.prompt_text, "abcd\nefg");
        assert_eq!(
            (r.prompt_tokens, r.max_tokens, r.include_usage),
            (2, 5, true),
            "8 characters"
        );
        let r = req(
            Endpoint::Completions,
            json!({"model": "m", "prompt": [1, 2, 3]}),
            PodRole::Combined,
        )
        .unwrap();
        assert_eq!(r.prompt_tokens, 3);
    }

    #[test]
    fn kv_params_shape() {
        let kv = prefill_kv_params("e-1", "cmpl-r-0", &[4, 5]);
        assert_eq!(
            kv,
            json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [4, 5],
                   "remote_engine_id": "e-1", "remote_request_id": "cmpl-r-0", "remote_host": "localhost",
                   "remote_port": 5600, "tp_size": 1})
        );
    }

    #[test]
    fn ids_follow_x_request_id() {
        assert_eq!(Endpoint::Completions.response_id(Some("abc")), "cmpl-abc-0");
        assert_eq!(Endpoint::Chat.response_id(Some("abc")), "chatcmpl-abc");
        let random = Endpoint::Chat.response_id(None);
        assert_eq!(random.len(), "chatcmpl-".len() + 32);
    }

    #[test]
    fn bodies_and_chunks() {
        let meta = ResponseMeta {
            endpoint: Endpoint::Chat,
            id: "chatcmpl-x".into(),
            created: 1,
            model: "m".into(),
        };
        let body = meta.full_body(" tok0", 10, 1, None);
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(body["choices"][0]["message"]["content"], " tok0");
        assert_eq!(body["usage"]["total_tokens"], 11);
        assert!(body["kv_transfer_params"].is_null());
        assert_eq!(
            meta.token_chunk(" tok1", true)["choices"][0]["finish_reason"],
            "length"
        );
        assert_eq!(meta.usage_chunk(10, 2)["choices"], json!([]));
        assert_eq!(sse_event(&json!({"a": 1})), "data: {\"a\":1}\n\n");
        let meta = ResponseMeta {
            endpoint: Endpoint::Completions,
            ..meta
        };
        assert_eq!(
            meta.token_chunk(" tok0", false)["object"],
            "text_completion"
        );
        assert_eq!(
            meta.token_chunk(" tok0", false)["choices"][0]["text"],
            " tok0"
        );
    }
}
