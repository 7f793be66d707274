//! A pod's error answer, rewritten the way AIBrix's gateway rewrites it, so clients moving
//! from AIBrix keep the bodies and the `x-error-response-unknown` header they know. Only
//! answers outside 2xx are touched: the success path never buffers or parses a response.
//!
//! - 500: the pod's body gives way to a fixed `Internal server error` (`api_error`); an
//!   engine's 500 text is internal detail (a traceback, a CUDA error) clients should not see.
//! - 401: `Incorrect API key provided`, code `invalid_api_key`.
//! - Any other status: an OpenAI-style error the pod sent, nested (`{"error":{...}}`) or flat
//!   (vLLM's and SGLang's `{"object":"error","message":...}`), or a bare message (TRT-LLM's
//!   request validation: `{"error":"<text>"}`, typed by the status), becomes
//!   `{"error":{"message","type","param","code"}}` marked `x-error-response-unknown: true`;
//!   any other body (Envoy's own text for a pod it could not reach, a proxy's HTML page)
//!   becomes a generated error whose message is that text.
//!
//! The status always stays the pod's, so metrics, passive ejection and clients' retry rules
//! see what the pod answered.

use serde_json::{json, Value};

use crate::core::errors::error_type;

/// Marks a pod's own OpenAI-style error, normalised (AIBrix's header).
pub const RESPONSE_UNKNOWN_HEADER: &str = "x-error-response-unknown";

/// AIBrix's message for a normalised error that carried none.
const UNKNOWN_RESPONSE: &str = "unknown response";

/// What an error answer of a given status gets, decided from its status line alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rewrite {
    InternalError,
    Unauthorized,
    FromBody,
}

impl Rewrite {
    /// `None` for a 2xx, which passes untouched.
    pub fn for_status(status: u32) -> Option<Rewrite> {
        match status {
            200..=299 => None,
            500 => Some(Rewrite::InternalError),
            401 => Some(Rewrite::Unauthorized),
            _ => Some(Rewrite::FromBody),
        }
    }

    /// Whether the pod's body is needed; the fixed answers never read it.
    pub fn reads_body(self) -> bool {
        self == Rewrite::FromBody
    }
}

/// How a rewritten answer came out: the `kind` label of
/// `pd_router_upstream_errors_rewritten_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    InternalError,
    Unauthorized,
    /// The pod's OpenAI-style error, normalised and marked.
    Normalized,
    /// Anything else, wrapped as a message.
    Generated,
}

impl Kind {
    /// Every kind, in declaration order, so `kind as usize` indexes it.
    pub const ALL: [Kind; 4] = [
        Kind::InternalError,
        Kind::Unauthorized,
        Kind::Normalized,
        Kind::Generated,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Kind::InternalError => "internal_error",
            Kind::Unauthorized => "unauthorized",
            Kind::Normalized => "normalized",
            Kind::Generated => "generated",
        }
    }
}

/// The body the client gets instead of the pod's.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorAnswer {
    pub body: Vec<u8>,
    pub kind: Kind,
}

impl ErrorAnswer {
    /// Whether the answer carries [`RESPONSE_UNKNOWN_HEADER`].
    pub fn marked(&self) -> bool {
        self.kind == Kind::Normalized
    }
}

/// The answer for a pod's `status` and `body` (the whole body: AIBrix reads only its first
/// chunk, which for the small bodies engines send is the same).
pub fn rewrite(rewrite: Rewrite, status: u32, body: &[u8]) -> ErrorAnswer {
    match rewrite {
        Rewrite::InternalError => {
            generated(status, "Internal server error", None, Kind::InternalError)
        }
        Rewrite::Unauthorized => generated(
            status,
            "Incorrect API key provided",
            Some("invalid_api_key"),
            Kind::Unauthorized,
        ),
        Rewrite::FromBody => match normalized(body, status) {
            Some(body) => ErrorAnswer {
                body,
                kind: Kind::Normalized,
            },
            None => {
                let code = (status == 503).then_some("service_unavailable");
                let text = String::from_utf8_lossy(body);
                let message = if text.trim().is_empty() {
                    // An empty message tells the client nothing.
                    format!("upstream answered {status} without a body")
                } else {
                    text.into_owned()
                };
                generated(status, &message, code, Kind::Generated)
            }
        },
    }
}

fn generated(status: u32, message: &str, code: Option<&str>, kind: Kind) -> ErrorAnswer {
    let body = json!({"error": {
        "message": message, "type": error_type(status), "code": code, "param": null,
    }});
    ErrorAnswer {
        body: body.to_string().into_bytes(),
        kind,
    }
}

/// The pod's error object, nested, flat or a bare `error` string, in the OpenAI envelope;
/// `None` when the body is not one (invalid JSON, not an object, an `error` that is neither
/// an object nor a string and no flat `message`).
fn normalized(body: &[u8], status: u32) -> Option<Vec<u8>> {
    let Ok(Value::Object(top)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    let error = match top.get("error") {
        Some(Value::Object(nested)) => nested,
        Some(Value::String(message)) if !message.trim().is_empty() => {
            let body = json!({"error": {
                "message": message, "type": error_type(status), "param": null, "code": null,
            }});
            return Some(body.to_string().into_bytes());
        }
        _ if top.contains_key("message") => &top,
        _ => return None,
    };
    let present = |key: &str| error.get(key).filter(|v| !v.is_null());
    let message = present("message").map_or_else(|| UNKNOWN_RESPONSE.to_string(), as_text);
    let body = json!({"error": {
        "message": message,
        "type": present("type").map(as_text),
        "param": present("param"),
        "code": present("code"),
    }});
    Some(body.to_string().into_bytes())
}

/// A JSON value as text: a string as itself, anything else as its JSON.
fn as_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u32, body: &[u8]) -> (Value, Kind) {
        let rewrite = Rewrite::for_status(status).expect("an error status");
        let a = super::rewrite(rewrite, status, body);
        let parsed: Value = serde_json::from_slice(&a.body).expect("valid JSON");
        assert!(parsed["error"]["message"].is_string(), "{parsed}");
        (parsed, a.kind)
    }

    #[test]
    fn kinds_index_their_own_place() {
        for (i, kind) in Kind::ALL.iter().enumerate() {
            assert_eq!(*kind as usize, i, "{kind:?}");
        }
    }

    #[test]
    fn successes_pass_and_errors_are_rewritten_by_status() {
        for status in [200, 201, 204, 299] {
            assert_eq!(Rewrite::for_status(status), None, "{status}");
        }
        assert_eq!(Rewrite::for_status(500), Some(Rewrite::InternalError));
        assert_eq!(Rewrite::for_status(401), Some(Rewrite::Unauthorized));
        for status in [199, 302, 400, 404, 429, 502, 503, 504] {
            assert_eq!(
                Rewrite::for_status(status),
                Some(Rewrite::FromBody),
                "{status}"
            );
        }
        assert!(!Rewrite::InternalError.reads_body() && !Rewrite::Unauthorized.reads_body());
    }

    #[test]
    fn a_500_hides_the_pods_body() {
        let (v, kind) = answer(500, b"Traceback (most recent call last): CUDA error");
        assert_eq!(
            v,
            json!({"error": {"message": "Internal server error", "type": "api_error",
                              "code": null, "param": null}})
        );
        assert_eq!(kind, Kind::InternalError);
        let (again, _) = answer(500, br#"{"error":{"message":"secret detail"}}"#);
        assert_eq!(again, v, "even an OpenAI-style 500 gets the fixed answer");
    }

    #[test]
    fn a_401_is_an_invalid_api_key() {
        let (v, kind) = answer(401, b"nope");
        assert_eq!(
            v,
            json!({"error": {"message": "Incorrect API key provided",
                              "type": "authentication_error", "code": "invalid_api_key",
                              "param": null}})
        );
        assert_eq!(kind, Kind::Unauthorized);
    }

    #[test]
    fn openai_style_errors_nested_or_flat_are_normalised_and_marked() {
        let nested = br#"{"error":{"message":"max_tokens is too large","type":"BadRequestError","param":"max_tokens","code":400,"extra":1}}"#;
        let (v, kind) = answer(400, nested);
        assert_eq!(
            v,
            json!({"error": {"message": "max_tokens is too large", "type": "BadRequestError",
                              "param": "max_tokens", "code": 400}})
        );
        assert_eq!(kind, Kind::Normalized);
        let flat = br#"{"object":"error","message":"engine overloaded","type":"ServiceUnavailableError","param":null,"code":503}"#;
        let (v, kind) = answer(503, flat);
        assert_eq!(
            v,
            json!({"error": {"message": "engine overloaded", "type": "ServiceUnavailableError",
                              "param": null, "code": 503}})
        );
        assert_eq!(kind, Kind::Normalized);
        let a = rewrite(Rewrite::FromBody, 503, flat);
        assert!(a.marked());
    }

    #[test]
    fn a_bare_error_string_is_the_message() {
        // TRT-LLM's answer to a request its validation refused.
        let trt = br#"{"error":"1 validation error for ChatCompletionRequest: max_tokens"}"#;
        let (v, kind) = answer(400, trt);
        assert_eq!(
            v,
            json!({"error": {"message": "1 validation error for ChatCompletionRequest: max_tokens",
                              "type": error_type(400), "param": null, "code": null}})
        );
        assert_eq!(kind, Kind::Normalized);
        // An empty one says nothing: the body is quoted as it came.
        let (v, kind) = answer(400, br#"{"error":""}"#);
        assert_eq!(v["error"]["message"], r#"{"error":""}"#);
        assert_eq!(kind, Kind::Generated);
    }

    #[test]
    fn missing_or_odd_fields_follow_aibrix() {
        let (v, _) = answer(422, br#"{"error":{"type":"x"}}"#);
        assert_eq!(v["error"]["message"], "unknown response");
        assert_eq!(v["error"]["code"], Value::Null);
        let (v, _) = answer(400, br#"{"message":42,"type":7,"code":"bad_thing"}"#);
        assert_eq!(
            v["error"]["message"], "42",
            "a non-string message as its JSON"
        );
        assert_eq!(v["error"]["type"], "7");
        assert_eq!(
            v["error"]["code"], "bad_thing",
            "a string code kept as given"
        );
        let (v, kind) = answer(400, br#"{"message":null}"#);
        assert_eq!(
            (v["error"]["message"].as_str(), kind),
            (Some("unknown response"), Kind::Normalized)
        );
    }

    #[test]
    fn anything_else_becomes_a_generated_error_with_the_text() {
        let envoy = b"upstream connect error or disconnect/reset before headers. reset reason: connection failure";
        let (v, kind) = answer(503, envoy);
        assert_eq!(
            v,
            json!({"error": {"message": String::from_utf8_lossy(envoy), "type": "overloaded_error",
                              "code": "service_unavailable", "param": null}})
        );
        assert_eq!(kind, Kind::Generated);
        let (v, _) = answer(504, b"upstream request timeout");
        assert_eq!(v["error"]["type"], "api_error");
        assert_eq!(v["error"]["code"], Value::Null);
        for body in [
            &br#"{"error":["not", "a", "message"]}"#[..],
            b"[1,2]",
            b"{not json",
            b"<html>502</html>",
            b"\xff\xfe bytes",
        ] {
            let (v, kind) = answer(502, body);
            assert_eq!(kind, Kind::Generated, "{body:?}");
            assert_eq!(
                v["error"]["message"],
                String::from_utf8_lossy(body).as_ref()
            );
        }
        assert!(!rewrite(Rewrite::FromBody, 502, b"x").marked());
        for body in [&b""[..], b" \r\n"] {
            let (v, kind) = answer(429, body);
            assert_eq!(kind, Kind::Generated);
            assert_eq!(
                v["error"]["message"], "upstream answered 429 without a body",
                "an empty message says nothing"
            );
        }
    }
}
