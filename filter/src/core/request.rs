//! OpenAI request body → the fields routing needs, parsed once.
//!
//! The parsed object is kept (`body`) so the engine adapters edit it instead of parsing again;
//! `serde_json` runs with `preserve_order` and `arbitrary_precision`, so key order and numbers
//! such as 63-bit ids survive the round trip unchanged.

use serde_json::{Map, Value};

use super::errors::RouteError;

/// The OpenAI endpoints the router understands. Matched on the exact path, as AIBrix does,
/// so a query string makes a path unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Result<Endpoint, RouteError> {
        match path {
            "/v1/chat/completions" => Ok(Endpoint::ChatCompletions),
            "/v1/completions" => Ok(Endpoint::Completions),
            _ => Err(RouteError::UnknownPath),
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// What routing reads from a request body.
#[derive(Debug, Clone)]
pub struct RoutingRequest {
    pub endpoint: Endpoint,
    /// Empty when the body names none; the model lookup then fails with "model  does not exist".
    pub model: String,
    pub stream: bool,
    /// Bytes of prompt text (joined message contents), the input of prompt-length estimates.
    pub prompt_bytes: usize,
    /// The prompt text: the completion prompt, or the message contents joined by one space
    /// (strings unescaped, other content as JSON), which is what AIBrix tokenizes and hashes.
    pub prompt_text: String,
    /// `max_tokens`, else `max_completion_tokens`, when an integer.
    pub max_tokens: Option<i64>,
    /// Raw body length; token-load charges estimate tokens from it.
    pub body_len: usize,
    /// The parsed body, edited by the engine adapters.
    pub body: Map<String, Value>,
}

impl RoutingRequest {
    pub fn parse(endpoint: Endpoint, raw: &[u8]) -> Result<RoutingRequest, RouteError> {
        let body = match serde_json::from_slice::<Value>(raw) {
            Ok(Value::Object(map)) => map,
            _ => return Err(RouteError::BadBody),
        };
        let model = match body.get("model") {
            Some(Value::String(m)) => m.clone(),
            None | Some(Value::Null) => String::new(),
            Some(_) => return Err(RouteError::BadBody),
        };
        let stream = match body.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(RouteError::BadBody),
        };
        let prompt_text = match endpoint {
            Endpoint::Completions => match body.get("prompt") {
                Some(Value::String(p)) => p.clone(),
                _ => return Err(RouteError::BadBody),
            },
            Endpoint::ChatCompletions => chat_prompt_text(&body)?,
        };
        let max_tokens = ["max_tokens", "max_completion_tokens"]
            .iter()
            .find_map(|k| body.get(*k).and_then(Value::as_i64));
        Ok(RoutingRequest {
            endpoint,
            model,
            stream,
            prompt_bytes: prompt_text.len(),
            prompt_text,
            max_tokens,
            body_len: raw.len(),
            body,
        })
    }
}

/// The message contents joined by one space: strings unescaped, anything else (content
/// parts, null) as its JSON text, which is what AIBrix feeds its tokenizer.
fn chat_prompt_text(body: &Map<String, Value>) -> Result<String, RouteError> {
    let messages = match body.get("messages") {
        Some(Value::Array(messages)) if !messages.is_empty() => messages,
        Some(Value::Array(_)) | None | Some(Value::Null) => return Err(RouteError::NoMessages),
        Some(_) => return Err(RouteError::BadBody),
    };
    let mut text = String::new();
    for (i, message) in messages.iter().enumerate() {
        let Value::Object(message) = message else {
            return Err(RouteError::BadBody);
        };
        if i > 0 {
            text.push(' ');
        }
        match message.get("content") {
            Some(Value::String(s)) => text.push_str(s),
            Some(other) => text.push_str(&other.to_string()),
            None => text.push_str("null"),
        }
    }
    Ok(text)
}

/// The request id: the trace id of a W3C `traceparent` when one is present (so gateway logs
/// join the caller's trace), else a fresh UUID-shaped id from `random`.
pub fn request_id(traceparent: Option<&str>, random: u128) -> String {
    if let Some(trace_id) = traceparent.and_then(trace_id_of) {
        return trace_id.to_string();
    }
    let hex = format!("{random:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

fn trace_id_of(traceparent: &str) -> Option<&str> {
    let mut parts = traceparent.trim().split('-');
    let _version = parts.next()?;
    let trace_id = parts.next()?;
    let valid = trace_id.len() == 32
        && trace_id.bytes().all(|b| b.is_ascii_hexdigit())
        && trace_id.bytes().any(|b| b != b'0');
    valid.then_some(trace_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(raw: &str) -> Result<RoutingRequest, RouteError> {
        RoutingRequest::parse(Endpoint::ChatCompletions, raw.as_bytes())
    }

    #[test]
    fn chat_fields_and_prompt_length() {
        let r = chat(r#"{"model":"m","stream":true,"messages":[{"role":"system","content":"ab"},{"role":"user","content":[{"type":"text","text":"x"}]}]}"#).unwrap();
        assert_eq!(r.model, "m");
        assert!(r.stream);
        let parts = r#"[{"type":"text","text":"x"}]"#;
        assert_eq!(r.prompt_text, format!("ab {parts}"));
        assert_eq!(r.prompt_bytes, 2 + 1 + parts.len());
        assert_eq!(r.max_tokens, None);
        let r = chat(r#"{"model":"m","max_completion_tokens":9,"messages":[{"content":"a"}]}"#)
            .unwrap();
        assert_eq!(r.max_tokens, Some(9));
    }

    #[test]
    fn completions_need_a_string_prompt() {
        let ok = RoutingRequest::parse(Endpoint::Completions, br#"{"model":"m","prompt":"hello"}"#)
            .unwrap();
        assert_eq!((ok.prompt_bytes, ok.stream), (5, false));
        for bad in [
            r#"{"model":"m","prompt":["a"]}"#,
            r#"{"model":"m","prompt":[1,2]}"#,
            r#"{"model":"m"}"#,
        ] {
            assert_eq!(
                RoutingRequest::parse(Endpoint::Completions, bad.as_bytes()).unwrap_err(),
                RouteError::BadBody,
                "{bad}"
            );
        }
    }

    #[test]
    fn malformed_bodies() {
        assert_eq!(chat("{not json").unwrap_err(), RouteError::BadBody);
        assert_eq!(chat("[1]").unwrap_err(), RouteError::BadBody);
        assert_eq!(
            chat(r#"{"model":"m","messages":[]}"#).unwrap_err(),
            RouteError::NoMessages
        );
        assert_eq!(
            chat(r#"{"model":"m"}"#).unwrap_err(),
            RouteError::NoMessages
        );
        assert_eq!(
            chat(r#"{"model":"m","stream":"yes","messages":[{"content":"a"}]}"#).unwrap_err(),
            RouteError::BadBody
        );
        assert_eq!(
            chat(r#"{"model":7,"messages":[{"content":"a"}]}"#).unwrap_err(),
            RouteError::BadBody
        );
        assert_eq!(chat(r#"{"messages":[{"content":"a"}]}"#).unwrap().model, "");
    }

    #[test]
    fn paths_match_exactly() {
        assert_eq!(
            Endpoint::from_path("/v1/completions"),
            Ok(Endpoint::Completions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/completions?x=1"),
            Err(RouteError::UnknownPath)
        );
        assert_eq!(
            Endpoint::from_path("/v1/embeddings"),
            Err(RouteError::UnknownPath)
        );
    }

    #[test]
    fn request_id_prefers_traceparent() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(request_id(Some(tp), 1), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(
            request_id(Some("00-0000-bad"), 0xabc),
            "00000000-0000-0000-0000-000000000abc"
        );
        assert_eq!(request_id(None, u128::MAX).len(), 36);
    }
}
