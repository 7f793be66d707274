//! OpenAI request body → the fields routing needs.
//!
//! Only the members routing reads are parsed (see `core::json_object`); the engine adapters
//! splice the raw body, so members the router never reads reach the engine byte for byte.

use std::fmt;

use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::errors::RouteError;
use super::json_object::{Key, Members, MembersError, Spans, MAX_BODY_MEMBERS};

mod one_pass;

/// The endpoints the router understands. Matched on the exact path, as AIBrix does, so a
/// query string makes a path unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
    /// Anthropic's Messages API, which vLLM serves with the same `kv_transfer_params` as chat.
    /// Parsed as chat (AIBrix reads `messages[].content` alike).
    Messages,
    /// Anthropic's token count for a Messages body: parsed as chat, served by any one pod of
    /// the model (it computes nothing on the engine).
    MessagesCountTokens,
    /// OpenAI's Responses API: routed to one pod only, since vLLM's answer carries no
    /// `kv_transfer_params` for a decode leg (`Engine::serves_pd`).
    Responses,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Result<Endpoint, RouteError> {
        match path {
            "/v1/chat/completions" => Ok(Endpoint::ChatCompletions),
            "/v1/completions" => Ok(Endpoint::Completions),
            "/v1/messages" => Ok(Endpoint::Messages),
            "/v1/messages/count_tokens" => Ok(Endpoint::MessagesCountTokens),
            "/v1/responses" => Ok(Endpoint::Responses),
            _ => Err(RouteError::UnknownPath),
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::MessagesCountTokens => "/v1/messages/count_tokens",
            Endpoint::Responses => "/v1/responses",
        }
    }

    /// Whether the prompt is a `messages` list (chat and Messages) rather than a `prompt`.
    pub fn has_messages(self) -> bool {
        matches!(
            self,
            Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::MessagesCountTokens
        )
    }

    /// The key of the generated-token count in the engine's streamed usage: OpenAI's
    /// `usage.completion_tokens`, Anthropic's `usage.output_tokens` (`message_delta`).
    pub fn usage_output_key(self) -> &'static [u8] {
        match self {
            Endpoint::Messages => b"\"output_tokens\"",
            _ => b"\"completion_tokens\"",
        }
    }
}

/// What routing reads from a request body.
#[derive(Debug, Clone, PartialEq)]
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
    /// `stream_options.include_usage`: the stream ends with a usage chunk worth scanning.
    pub include_usage: bool,
    /// Where the body's members lie, for splicing the engine legs from the raw body.
    pub members: Spans,
}

impl RoutingRequest {
    pub fn parse(endpoint: Endpoint, raw: &[u8]) -> Result<RoutingRequest, RouteError> {
        match one_pass::parse(endpoint, raw) {
            Some(request) => Ok(request),
            None => RoutingRequest::parse_two_pass(endpoint, raw),
        }
    }

    /// The reference parse, which [`RoutingRequest::parse`] falls back to for the bodies its
    /// one pass leaves alone (see `one_pass`): every member validated as a borrowed
    /// `RawValue`, then the prompt member parsed again. Public for the fuzz target, which
    /// checks that both give the same answer.
    #[doc(hidden)]
    pub fn parse_two_pass(endpoint: Endpoint, raw: &[u8]) -> Result<RoutingRequest, RouteError> {
        let body = Members::parse_capped(raw, MAX_BODY_MEMBERS).map_err(|e| match e {
            MembersError::TooMany { limit } => RouteError::TooManyMembers { limit },
            MembersError::Json(_) => RouteError::BadBody,
        })?;
        let scalars = Scalars::read(|k| body.get(k))?;
        let prompt_text = if endpoint.has_messages() {
            chat_prompt_text(body.get("messages"))?
        } else if endpoint == Endpoint::Responses {
            if body.get("model").is_none() {
                return Err(RouteError::MissingField {
                    message: "'model' is a required property",
                    param: "model",
                });
            }
            responses_input_text(body.get("input"))?
        } else {
            match body.get("prompt") {
                Some(v) => field::<String>(v)?,
                None => return Err(RouteError::BadBody),
            }
        };
        Ok(RoutingRequest::assemble(
            endpoint,
            raw,
            scalars,
            prompt_text,
            body.spans(raw),
        ))
    }

    fn assemble(
        endpoint: Endpoint,
        raw: &[u8],
        scalars: Scalars,
        prompt_text: String,
        members: Spans,
    ) -> RoutingRequest {
        let Scalars {
            model,
            stream,
            max_tokens,
            include_usage,
        } = scalars;
        RoutingRequest {
            endpoint,
            model,
            stream,
            prompt_bytes: prompt_text.len(),
            prompt_text,
            max_tokens,
            body_len: raw.len(),
            include_usage,
            members,
        }
    }
}

/// The members routing reads besides the prompt.
struct Scalars {
    model: String,
    stream: bool,
    max_tokens: Option<i64>,
    include_usage: bool,
}

impl Scalars {
    /// From `get`, a member's value by name (the last one, if repeated). A `model` or `stream`
    /// of the wrong type refuses the body; the token fields count only when well typed.
    fn read<'a>(get: impl Fn(&str) -> Option<&'a RawValue>) -> Result<Scalars, RouteError> {
        let model = match get("model") {
            None => String::new(),
            Some(v) => field::<Option<String>>(v)?.unwrap_or_default(),
        };
        let stream = match get("stream") {
            None => false,
            Some(v) => field::<Option<bool>>(v)?.unwrap_or(false),
        };
        let max_tokens = ["max_tokens", "max_completion_tokens"]
            .iter()
            .find_map(|k| get(k).and_then(|v| serde_json::from_str::<i64>(v.get()).ok()));
        let include_usage = get("stream_options")
            .and_then(|v| Members::of(v).ok())
            .and_then(|o| o.get("include_usage"))
            .and_then(|v| serde_json::from_str::<bool>(v.get()).ok())
            .unwrap_or(false);
        Ok(Scalars {
            model,
            stream,
            max_tokens,
            include_usage,
        })
    }
}

/// One member the router reads, of the type it must have.
fn field<'a, T: Deserialize<'a>>(value: &'a RawValue) -> Result<T, RouteError> {
    serde_json::from_str(value.get()).map_err(|_| RouteError::BadBody)
}

/// The message contents joined by one space: strings unescaped, anything else (content
/// parts, null) as its compact JSON text, which is what AIBrix feeds its tokenizer. Parsed in
/// one pass over the messages; other members of a message are skipped unparsed.
fn chat_prompt_text(messages: Option<&RawValue>) -> Result<String, RouteError> {
    let Some(messages) = messages else {
        return Err(RouteError::NoMessages);
    };
    let mut de = serde_json::Deserializer::from_str(messages.get());
    let joined = JoinedSeed {
        capacity: messages.get().len(),
        source: None,
    }
    .deserialize(&mut de)
    .map_err(|_| RouteError::BadBody)?;
    joined_text(joined)
}

/// A Responses request's `input`: the string itself, or its items' contents joined as chat
/// messages are, with AIBrix's messages for a missing, mistyped or empty input.
fn responses_input_text(input: Option<&RawValue>) -> Result<String, RouteError> {
    let missing = |message| RouteError::MissingField {
        message,
        param: "input",
    };
    let input = input.ok_or(missing("'input' is a required property"))?;
    match input.get().as_bytes().first() {
        Some(b'"') => field::<String>(input),
        Some(b'[') => chat_prompt_text(Some(input)).map_err(|e| match e {
            RouteError::NoMessages => missing("'input' array cannot be empty"),
            other => other,
        }),
        _ => Err(missing(
            "'input' must be a string or an array of input items",
        )),
    }
}

/// The prompt of a `messages` value read by [`JoinedSeed`]: `null`, or no message, has none.
fn joined_text(joined: Option<Joined>) -> Result<String, RouteError> {
    match joined {
        Some(Joined { text, count }) if count > 0 => Ok(text),
        _ => Err(RouteError::NoMessages),
    }
}

struct Joined {
    text: String,
    count: usize,
}

/// `null` or an array of message objects, joined into one text of at most about `capacity`
/// bytes (the raw value's length: unescaping and compact JSON only shrink it), reserved once.
#[derive(Clone, Copy)]
struct JoinedSeed<'s> {
    capacity: usize,
    /// The whole text being deserialized, when it holds no byte below 0x20 (see
    /// [`ContentSeed`]); `None` reads contents the reference way.
    source: Option<&'s str>,
}

impl<'de> DeserializeSeed<'de> for JoinedSeed<'_> {
    type Value = Option<Joined>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for JoinedSeed<'_> {
    type Value = Option<Joined>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of messages")
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut joined = Joined {
            text: String::with_capacity(self.capacity),
            count: 0,
        };
        loop {
            if joined.count > 0 {
                joined.text.push(' ');
            }
            let mark = joined.text.len();
            let seed = MessageSeed {
                text: &mut joined.text,
                mark,
                source: self.source,
            };
            if seq.next_element_seed(seed)?.is_none() {
                if joined.count > 0 {
                    joined.text.pop(); // the separator pushed for a message that never came
                }
                return Ok(Some(joined));
            }
            joined.count += 1;
        }
    }
}

/// One message: only its `content` is read, written into the joined text from `mark` (the
/// last one, if duplicated, as the engines read it; `null` when absent).
struct MessageSeed<'t, 's> {
    text: &'t mut String,
    mark: usize,
    source: Option<&'s str>,
}

impl<'de> DeserializeSeed<'de> for MessageSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MessageSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = false;
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            if key == "content" {
                self.text.truncate(self.mark);
                map.next_value_seed(ContentSeed {
                    text: self.text,
                    source: self.source,
                })?;
                seen = true;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        if !seen {
            self.text.push_str("null");
        }
        Ok(())
    }
}

/// A message's content appended to the joined text: a string unescaped (straight from the
/// body, or from serde_json's scratch when escaped: one copy either way), any other JSON value
/// as its compact text.
///
/// With a `source` (a text without a byte below 0x20, so no string in it can hold a raw
/// control character) a string is read as bytes: serde_json then finds its end with
/// `memchr2` on `"` and `\`, SIMD in our wasm build, instead of its own scan for those and
/// for control characters, four bytes a step on wasm32 (≈ half of a long prompt's parse).
/// Contents other than strings, arrays and `null` then fail, and the caller's two-pass
/// parse decides the body.
struct ContentSeed<'t, 's> {
    text: &'t mut String,
    source: Option<&'s str>,
}

impl<'de> DeserializeSeed<'de> for ContentSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        if self.source.is_some() {
            d.deserialize_option(self)
        } else {
            d.deserialize_any(self)
        }
    }
}

impl ContentSeed<'_, '_> {
    fn json(self, v: Value) {
        self.text.push_str(&v.to_string());
    }
}

impl<'de> Visitor<'de> for ContentSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("message content")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        self.text.push_str(v);
        Ok(())
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.text.push_str("null");
        Ok(())
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<(), E> {
        self.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_bytes(self)
    }

    /// A string without escapes, as it stands in `source`: a slice between two ASCII quotes
    /// of a `str` is itself one, found without a second pass over its bytes.
    fn visit_borrowed_bytes<E: serde::de::Error>(self, v: &'de [u8]) -> Result<(), E> {
        let s = self
            .source
            .and_then(|src| {
                let start = (v.as_ptr() as usize).checked_sub(src.as_ptr() as usize)?;
                src.get(start..start.checked_add(v.len())?)
            })
            .ok_or_else(|| E::custom("content outside the text"))?;
        self.text.push_str(s);
        Ok(())
    }

    /// A string with escapes, unescaped without validation: a lone surrogate comes out as
    /// bytes that are not UTF-8, and the two-pass parse decides the body.
    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<(), E> {
        let s = std::str::from_utf8(v).map_err(|_| E::custom("content is not UTF-8"))?;
        self.text.push_str(s);
        Ok(())
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<(), E> {
        self.json(Value::Bool(v));
        Ok(())
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<(), E> {
        self.json(Value::from(v));
        Ok(())
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<(), E> {
        self.json(Value::from(v));
        Ok(())
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<(), E> {
        self.json(Value::from(v));
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        self.json(Value::deserialize(SeqAccessDeserializer::new(seq))?);
        Ok(())
    }

    // Objects, and numbers under `arbitrary_precision` (which arrive as a one-entry map).
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        self.json(Value::deserialize(MapAccessDeserializer::new(map))?);
        Ok(())
    }
}

/// The request id: the trace id of a W3C `traceparent` when one is present (so gateway logs
/// join the caller's trace) followed by `-` and 16 hex digits of `random`, else a fresh
/// UUID-shaped id from `random`. A trace holds many requests (an agent's parallel calls
/// share one trace id): the id names one, and vLLM refuses a second request of an id still
/// in flight (or, with its ids left unrandomised, mixes the two up).
pub fn request_id(traceparent: Option<&str>, random: u128) -> String {
    if let Some(trace_id) = traceparent.and_then(trace_id_of) {
        let mut out = String::with_capacity(trace_id.len() + 17);
        out.push_str(trace_id);
        out.push('-');
        push_hex(&mut out, random, 16);
        return out;
    }
    uuid_shaped(random)
}

/// Appends the low `digits` hex digits of `value`, most significant first.
fn push_hex(out: &mut String, value: u128, digits: u32) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for i in (0..digits).rev() {
        out.push(char::from(DIGITS[((value >> (4 * i)) & 0xf) as usize]));
    }
}

/// `random` as 32 lowercase hex digits grouped 8-4-4-4-12. Written digit by digit: every
/// request pays for it before anything else, and `format!` over a `u128` cost ≈ 5 µs of a
/// cold request's path in Envoy (sections build, one in flight).
fn uuid_shaped(random: u128) -> String {
    let mut out = String::with_capacity(36);
    // Groups of 8-4-4-4-12 digits: (shift of the group's lowest digit, digits).
    for (n, (shift, digits)) in [(96, 8), (80, 4), (64, 4), (48, 4), (0, 12)]
        .into_iter()
        .enumerate()
    {
        if n > 0 {
            out.push('-');
        }
        push_hex(&mut out, random >> shift, digits);
    }
    out
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

    /// A body of more top-level members than the cap is refused as such on every endpoint,
    /// whichever parse reads it; one at the cap is routed. The one-pass parse must leave such
    /// a body to the two-pass one, not route it.
    #[test]
    fn bodies_over_the_member_cap_are_refused_naming_it() {
        let with_members = |n: usize, prompt: &str| {
            let mut raw = String::from(r#"{"model":"m","#);
            raw.push_str(prompt);
            for i in 0..n.saturating_sub(2) {
                raw.push_str(&format!(r#","k{i}":0"#));
            }
            raw.push('}');
            raw
        };
        let chat_prompt = r#""messages":[{"role":"user","content":"hi"}]"#;
        let cases = [
            (Endpoint::ChatCompletions, chat_prompt),
            (Endpoint::Messages, chat_prompt),
            (Endpoint::Completions, r#""prompt":"hi""#),
            (Endpoint::Responses, r#""input":"hi""#),
        ];
        let too_many = RouteError::TooManyMembers {
            limit: MAX_BODY_MEMBERS,
        };
        for (endpoint, prompt) in cases {
            let at_cap = with_members(MAX_BODY_MEMBERS, prompt);
            let r = RoutingRequest::parse(endpoint, at_cap.as_bytes());
            assert!(r.is_ok(), "{endpoint:?}: {r:?}");
            let over = with_members(MAX_BODY_MEMBERS + 1, prompt);
            assert_eq!(
                RoutingRequest::parse(endpoint, over.as_bytes()).unwrap_err(),
                too_many,
                "{endpoint:?}"
            );
            assert_eq!(
                RoutingRequest::parse_two_pass(endpoint, over.as_bytes()).unwrap_err(),
                too_many,
                "{endpoint:?}"
            );
        }
        // ~700 000 tiny members (the 8 MiB body of the review) end at the cap too.
        let huge = with_members(700_000, r#""prompt":"hi""#);
        assert_eq!(
            RoutingRequest::parse(Endpoint::Completions, huge.as_bytes()).unwrap_err(),
            too_many
        );
    }

    #[test]
    fn message_contents_join_as_aibrix_tokenizes_them() {
        let cases = [
            (
                r#"[{"content":"a"},{"role":"x","content":"b\"c"}]"#,
                r#"a b"c"#,
            ),
            (
                r#"[{"content":null},{"content":5},{"content":1.5e3}]"#,
                "null 5 1.5e+3",
            ),
            (r#"[{"role":"user"}]"#, "null"),
            (r#"[{"content":"x","content":"last wins"}]"#, "last wins"),
            (
                r#"[{"content":[ {"type":"text", "text":"x"} ],"name":{"deep":[[1]]}}]"#,
                r#"[{"type":"text","text":"x"}]"#,
            ),
            (r#"[{"content":"\u00e9t\u00e9"}]"#, "été"),
        ];
        for (messages, want) in cases {
            let raw = format!(r#"{{"model":"m","messages":{messages}}}"#);
            assert_eq!(chat(&raw).unwrap().prompt_text, want, "{messages}");
        }
        for (messages, err) in [
            ("null", RouteError::NoMessages),
            ("[]", RouteError::NoMessages),
            (r#""hi""#, RouteError::BadBody),
            (r#"["hi"]"#, RouteError::BadBody),
            (r#"[{"content":"a"},7]"#, RouteError::BadBody),
            (r#"{"content":"a"}"#, RouteError::BadBody),
        ] {
            let raw = format!(r#"{{"model":"m","messages":{messages}}}"#);
            assert_eq!(chat(&raw).unwrap_err(), err, "{messages}");
        }
        // Content nested past serde_json's limit is refused; elsewhere it is the engine's call.
        let deep = format!(r#"[{{"content":{}{}}}]"#, "[".repeat(200), "]".repeat(200));
        let raw = format!(r#"{{"model":"m","messages":{deep}}}"#);
        assert_eq!(chat(&raw).unwrap_err(), RouteError::BadBody);
    }

    #[test]
    fn usage_and_token_fields() {
        let r = chat(r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":"ten","max_completion_tokens":7,"messages":[{"content":"a"}]}"#).unwrap();
        assert!(r.include_usage);
        assert_eq!(r.max_tokens, Some(7));
        let r = chat(r#"{"model":"m","stream_options":{"include_usage":"yes"},"max_tokens":1e30,"messages":[{"content":"a"}]}"#).unwrap();
        assert!(!r.include_usage);
        assert_eq!(r.max_tokens, None);
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
    fn messages_read_like_chat_with_anthropic_blocks_kept_as_json() {
        assert_eq!(Endpoint::from_path("/v1/messages"), Ok(Endpoint::Messages));
        assert_eq!(Endpoint::Messages.path(), "/v1/messages");
        assert_eq!(
            Endpoint::from_path("/v1/messages/count_tokens"),
            Ok(Endpoint::MessagesCountTokens)
        );
        // Anthropic's shape: a top-level `system` (not routing text, as in AIBrix), block
        // content as raw JSON, `max_tokens` required by the engine.
        for raw in [
            r#"{"model":"m","system":"be brief","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"hi there"},{"role":"assistant","content":[{"type":"text","text":"yo"}]}]}"#,
            "{\n  \"model\": \"m\",\n  \"system\": \"be brief\",\n  \"max_tokens\": 64,\n  \"stream\": true,\n  \"messages\": [{\"role\": \"user\", \"content\": \"hi there\"}, {\"role\": \"assistant\", \"content\": [{\"type\":\"text\",\"text\":\"yo\"}]}]\n}",
        ] {
            let m = RoutingRequest::parse(Endpoint::Messages, raw.as_bytes()).unwrap();
            let c = RoutingRequest::parse(Endpoint::ChatCompletions, raw.as_bytes()).unwrap();
            assert_eq!(m.endpoint, Endpoint::Messages);
            assert_eq!(RoutingRequest { endpoint: Endpoint::Messages, ..c }, m);
            assert_eq!(m.prompt_text, r#"hi there [{"type":"text","text":"yo"}]"#);
            assert_eq!((m.model.as_str(), m.stream, m.max_tokens), ("m", true, Some(64)));
        }
        assert_eq!(
            RoutingRequest::parse(
                Endpoint::Messages,
                br#"{"model":"m","max_tokens":8,"messages":[]}"#
            ),
            Err(RouteError::NoMessages)
        );
        assert_eq!(
            RoutingRequest::parse(Endpoint::Messages, br#"{"model":"m","prompt":"x"}"#),
            Err(RouteError::NoMessages)
        );
    }

    #[test]
    fn responses_input_is_a_string_or_items_with_aibrix_refusals() {
        let parse = |raw: &str| RoutingRequest::parse(Endpoint::Responses, raw.as_bytes());
        assert_eq!(
            Endpoint::from_path("/v1/responses"),
            Ok(Endpoint::Responses)
        );
        let r = parse(r#"{"model":"m","input":"hello there","stream":true}"#).unwrap();
        assert_eq!(
            (r.prompt_text.as_str(), r.model.as_str(), r.stream),
            ("hello there", "m", true)
        );
        let r = parse(
            r#"{"model":"m","input":[{"role":"user","content":"a"},{"type":"function_call","name":"f"},{"role":"user","content":[{"type":"input_text","text":"b"}]}]}"#,
        )
        .unwrap();
        assert_eq!(
            r.prompt_text,
            r#"a null [{"type":"input_text","text":"b"}]"#
        );
        for (raw, message, param) in [
            (
                r#"{"input":"x"}"#,
                "'model' is a required property",
                "model",
            ),
            (
                r#"{"model":"m"}"#,
                "'input' is a required property",
                "input",
            ),
            (
                r#"{"model":"m","input":7}"#,
                "'input' must be a string or an array of input items",
                "input",
            ),
            (
                r#"{"model":"m","input":[]}"#,
                "'input' array cannot be empty",
                "input",
            ),
        ] {
            let e = parse(raw).unwrap_err();
            assert_eq!(e, RouteError::MissingField { message, param }, "{raw}");
            assert_eq!(e.status(), 400);
            let body: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
            assert_eq!(body["error"]["param"], param);
            assert_eq!(body["error"]["message"], message);
        }
        assert_eq!(
            parse(r#"{"model":"m","input":"x""#),
            Err(RouteError::BadBody)
        );
    }

    #[test]
    fn request_id_prefers_traceparent() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            request_id(Some(tp), 0x1234_5678_9abc_def0),
            "4bf92f3577b34da6a3ce929d0e0e4736-123456789abcdef0"
        );
        assert_ne!(
            request_id(Some(tp), 1),
            request_id(Some(tp), 2),
            "two requests of one trace"
        );
        assert_eq!(
            request_id(Some("00-0000-bad"), 0xabc),
            "00000000-0000-0000-0000-000000000abc"
        );
        assert_eq!(request_id(None, u128::MAX).len(), 36);
    }

    #[test]
    fn uuid_shaped_ids_group_every_hex_digit_in_order() {
        let mut x: u128 = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210;
        for _ in 0..200 {
            let hex = format!("{x:032x}");
            let want = format!(
                "{}-{}-{}-{}-{}",
                &hex[0..8],
                &hex[8..12],
                &hex[12..16],
                &hex[16..20],
                &hex[20..32]
            );
            assert_eq!(request_id(None, x), want);
            x = x
                .wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)
                .rotate_left(17);
        }
        assert_eq!(request_id(None, 0), "00000000-0000-0000-0000-000000000000");
    }
}
