//! vLLM disaggregated prefill over the OpenAI API.
//!
//! The prefill leg is the client's request capped at one token and marked
//! `kv_transfer_params.do_remote_decode`; the decode leg is the client's request plus the
//! `kv_transfer_params` the prefill returned, with `remote_host` set to the prefill pod's IP
//! (vLLM reports its side-channel host, which defaults to `localhost`).

use std::borrow::Cow;

use crate::core::config::KvConnector;
use crate::core::errors::RouteError;
use crate::core::json_object::{with_member, BodyEdit, Members, Spans};
use crate::core::json_scan;

/// Members the prefill leg replaces: one token, no streaming (vLLM rejects `stream_options`
/// without `stream`), and no `min_tokens` a one-token leg cannot honour.
const PREFILL_REPLACED: [&str; 6] = [
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "min_tokens",
    "kv_transfer_params",
];
const ONE_TOKEN: [(&str, &str); 3] = [
    ("max_tokens", "1"),
    ("max_completion_tokens", "1"),
    ("stream", "false"),
];
/// What marks a prefill leg for the `shfs` connector.
const REMOTE_DECODE: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The prefill request body, spliced from the client's raw body and its member spans (see
/// `core::json_object`). Only `shfs` marks the leg (its marker replaces any
/// `kv_transfer_params` of the client).
pub fn prefill_body(client: &[u8], members: &Spans, connector: KvConnector) -> Vec<u8> {
    if connector == KvConnector::Shfs {
        let mut extra = ONE_TOKEN.to_vec();
        extra.push(("kv_transfer_params", REMOTE_DECODE));
        members.write(client, &PREFILL_REPLACED, &extra)
    } else {
        members.write(client, &PREFILL_REPLACED[..5], &ONE_TOKEN)
    }
}

/// The decode request body from the client's raw body and the prefill's response bytes.
/// `None` means "forward the client's body unchanged". Written whole: the reference for
/// [`decode_edit`], which the filter uses.
pub fn decode_body(
    client: &[u8],
    members: &Spans,
    prefill_response: &[u8],
    prefill_ip: &str,
    connector: KvConnector,
) -> Result<Option<Vec<u8>>, RouteError> {
    Ok(decode_member(prefill_response, prefill_ip, connector)?
        .map(|(key, value)| members.write(client, &[key], &[(key, &value)])))
}

/// [`decode_body`] as an edit of the client's body, which Envoy still holds: the member the
/// decode leg adds goes in front unless the client sent one of that name, so a long prompt is
/// not copied into the VM and back (≈ 100 µs of a 256 KB request in Envoy).
pub fn decode_edit(
    client: &[u8],
    members: &Spans,
    prefill_response: &[u8],
    prefill_ip: &str,
    connector: KvConnector,
) -> Result<Option<BodyEdit>, RouteError> {
    Ok(decode_member(prefill_response, prefill_ip, connector)?
        .map(|(key, value)| members.edit(client, &[key], &[(key, &value)])))
}

/// The member the decode leg sets, `(name, raw JSON value)`, from the prefill's answer;
/// `None` when the leg is the client's body unchanged.
fn decode_member<'a>(
    prefill_response: &'a [u8],
    prefill_ip: &str,
    connector: KvConnector,
) -> Result<Option<(&'static str, Cow<'a, str>)>, RouteError> {
    match connector {
        KvConnector::Mooncake => Ok(None),
        KvConnector::Nixl => {
            let raw = std::str::from_utf8(prefill_response).map_err(|_| not_object())?;
            if json_scan::object(raw).is_none() {
                Members::parse(prefill_response).map_err(|_| not_object())?;
            }
            Ok(Some(("disagg_prefill_resp", Cow::Borrowed(raw.trim()))))
        }
        KvConnector::Shfs => {
            let host = serde_json::to_string(prefill_ip)
                .map_err(|_| bad_response("the prefill pod's address is not text"))?;
            let params = answer_params(prefill_response, &host)?;
            Ok(params.map(|params| ("kv_transfer_params", Cow::Owned(params))))
        }
    }
}

/// The `kv_transfer_params` the decode leg carries (`None`: the answer has none), with
/// `remote_host` set to `host` (JSON text). Public for the fuzz target, which holds it to
/// [`params_two_scan`].
#[doc(hidden)]
pub fn answer_params(answer: &[u8], host: &str) -> Result<Option<String>, RouteError> {
    match kv_params_scanned(answer) {
        Some(params) => params_with_host(answer, params, host),
        None => params_two_scan(answer, host),
    }
}

/// The `kv_transfer_params` the decode leg carries, from the member spans
/// [`kv_params_scanned`] found. Spliced like the body: the engine's own bytes, only
/// `remote_host` replaced (a serde map round trip cost 5 µs natively, 25 µs in V8, per
/// request).
fn params_with_host(
    answer: &[u8],
    params: Option<Spans>,
    host: &str,
) -> Result<Option<String>, RouteError> {
    let Some(params) = params else {
        return Ok(None);
    };
    let written = params.write(answer, &["remote_host"], &[("remote_host", host)]);
    String::from_utf8(written)
        .map(Some)
        .map_err(|_| not_object())
}

/// The reference for [`params_with_host`]: the answer's members, then the parameters' own.
#[doc(hidden)]
pub fn params_two_scan(answer: &[u8], host: &str) -> Result<Option<String>, RouteError> {
    let response = Members::parse(answer).map_err(|_| not_object())?;
    match response.get("kv_transfer_params") {
        None => Ok(None),
        Some(v) if v.get() == "null" => Ok(None),
        Some(v) => with_member(v.get(), "remote_host", host)
            .map(Some)
            .ok_or_else(|| {
                bad_response("kv_transfer_params in the prefill response is not an object")
            }),
    }
}

/// The spans (in `answer`) of the members of the answer's `kv_transfer_params`
/// (`Some(None)`: absent or `null`), from `core::json_scan`: its remote block ids (one per 16
/// prompt tokens) are validated without serde's per-element cost (4 096 ids of a 256 KB
/// prompt: ≈ 25 µs natively through serde). `None` for anything the scan leaves to serde (an
/// error, a `kv_transfer_params` that is not an object), which the two-scan reference decides
/// with its exact error.
fn kv_params_scanned(answer: &[u8]) -> Option<Option<Spans>> {
    let text = std::str::from_utf8(answer).ok()?;
    let members = json_scan::object(text)?;
    let Some(at) = json_scan::last(&members, "kv_transfer_params") else {
        return Some(None);
    };
    let value = &text[at.clone()];
    if value == "null" {
        return Some(None);
    }
    let inner: Vec<(&str, std::ops::Range<usize>)> = json_scan::object(value)?
        .into_iter()
        .map(|(key, r)| (key, r.start + at.start..r.end + at.start))
        .collect();
    Some(Some(Spans::from_ranges(&inner)))
}

fn not_object() -> RouteError {
    bad_response("the prefill response is not a JSON object")
}

fn bad_response(detail: &str) -> RouteError {
    RouteError::Prefill {
        status: 502,
        class: "invalid_response",
        detail: detail.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn spans() -> Spans {
        Members::parse(client()).unwrap().spans(client())
    }

    fn client() -> &'static [u8] {
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
            "stream_options":{"include_usage":true},"min_tokens":3,"max_tokens":64,
            "seed":9007199254740993}"#
    }

    #[test]
    fn prefill_leg_is_capped_and_marked() {
        let body: Value =
            serde_json::from_slice(&prefill_body(client(), &spans(), KvConnector::Shfs)).unwrap();
        assert_eq!(body["max_tokens"], 1);
        assert_eq!(body["max_completion_tokens"], 1);
        assert_eq!(body["stream"], false);
        assert!(body.get("stream_options").is_none() && body.get("min_tokens").is_none());
        assert_eq!(body["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(body["kv_transfer_params"]["do_remote_prefill"], false);
        let raw = String::from_utf8(prefill_body(client(), &spans(), KvConnector::Nixl)).unwrap();
        assert!(!raw.contains("kv_transfer_params"));
        let body: Value = serde_json::from_str(&raw).unwrap();
        assert_eq!(
            (&body["max_tokens"], &body["stream"]),
            (&json!(1), &json!(false))
        );
        assert!(
            raw.contains("9007199254740993"),
            "large integers keep their exact digits"
        );
    }

    #[test]
    fn decode_leg_carries_params_with_prefill_ip() {
        let resp = br#"{"id":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"localhost","remote_port":5600,"remote_block_ids":[1,2]}}"#;
        let out = decode_body(client(), &spans(), resp, "10.0.0.7", KvConnector::Shfs)
            .unwrap()
            .unwrap();
        let body: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(body["kv_transfer_params"]["remote_host"], "10.0.0.7");
        assert_eq!(body["kv_transfer_params"]["remote_port"], 5600);
        assert_eq!(
            body["stream"], true,
            "the decode leg keeps the client's parameters"
        );
        assert_eq!(body["max_tokens"], 64);
        let raw = String::from_utf8(out).unwrap();
        assert!(
            raw.starts_with(r#"{"model":"m","messages""#),
            "key order is kept: {raw}"
        );
    }

    /// The engine's parameters reach the decode pod as it wrote them (an opaque engine id,
    /// exact float and integer digits, its key order); only `remote_host` is replaced, also
    /// when the engine sent it twice.
    #[test]
    fn decode_leg_keeps_the_engines_params_byte_for_byte() {
        let resp = br#"{"kv_transfer_params":{"remote_engine_id":"e\u00e9","remote_host":"a","remote_block_ids":[18446744073709551615,2],"tp":1.50,"remote_host":"b"}}"#;
        let out = decode_body(client(), &spans(), resp, "10.0.0.7", KvConnector::Shfs)
            .unwrap()
            .unwrap();
        let raw = String::from_utf8(out).unwrap();
        assert!(
            raw.contains(r#""kv_transfer_params":{"remote_engine_id":"e\u00e9","remote_block_ids":[18446744073709551615,2],"tp":1.50,"remote_host":"10.0.0.7"}"#),
            "{raw}"
        );
        let body: Value = serde_json::from_str(&raw).unwrap();
        assert_eq!(body["kv_transfer_params"]["remote_host"], "10.0.0.7");
    }

    /// Wherever the scan of the answer decides, it gives the two-scan reference's
    /// parameters; errors and odd shapes are left to the reference.
    #[test]
    fn answer_params_scanned_matches_the_reference() {
        let answers: [&[u8]; 14] = [
            br#"{"id":"x","kv_transfer_params":{"remote_host":"localhost","remote_port":5600}}"#,
            br#"{"kv_transfer_params":{"remote_block_ids":[1,2,3],"tp":1.50,"e":"\u00e9"},"usage":{"n":1}}"#,
            br#" { "kv_transfer_params" : { "remote_host" : "a" , "remote_host" : "b" } } "#,
            br#"{"kv_transfer_params":null}"#,
            br#"{"id":"x"}"#,
            br#"{"kv_transfer_params":{"a":1},"kv_transfer_params":null}"#,
            br#"{"kv_transfer_params":null,"kv_transfer_params":{"a":1}}"#,
            br#"{"kv_transfer_params":{}}"#,
            br#"{"choices":[{"x":[{"y":null}]}],"kv_transfer_params":{"a":[{"b":{}}]}}"#,
            // Left to the reference: not objects, malformed, not UTF-8.
            br#"{"kv_transfer_params":3}"#,
            br#"{"kv_transfer_params":{"a":1},"kv_transfer_params":"s"}"#,
            br#"{"kv_transfer_params":"s","kv_transfer_params":{"a":1}}"#,
            b"{\"id\":\"\xff\",\"kv_transfer_params\":{\"a\":1}}",
            b"[1]",
        ];
        let mut decided = 0;
        for answer in answers {
            let reference = params_two_scan(answer, "\"10.0.0.7\"");
            if let Some(params) = kv_params_scanned(answer) {
                decided += 1;
                let fast = params_with_host(answer, params, "\"10.0.0.7\"");
                assert_eq!(
                    fast.ok(),
                    reference.ok(),
                    "{}",
                    String::from_utf8_lossy(answer)
                );
            } else {
                assert!(reference.is_err(), "{}", String::from_utf8_lossy(answer));
            }
        }
        assert_eq!(decided, 10, "answers the scan read");
    }

    /// JSON's grammar allows an escaped lone surrogate; a body holding one in a member routing
    /// never decodes is routed, and the legs carry it as the client wrote it.
    #[test]
    fn lone_surrogate_escapes_reach_the_engine_as_written() {
        let raw = br#"{"model":"m","user":"\uD937","messages":[{"content":"hi"}]}"#;
        let req = crate::core::request::RoutingRequest::parse(
            crate::core::request::Endpoint::ChatCompletions,
            raw,
        )
        .unwrap();
        let leg = prefill_body(raw, &req.members, KvConnector::Shfs);
        assert!(String::from_utf8(leg)
            .unwrap()
            .contains(r#""user":"\uD937""#));
    }

    /// The filter edits the body Envoy holds instead of writing it anew: the engine gets the
    /// same object as from `decode_body`, the client's bytes untouched after the new member;
    /// a client that sent the member itself gets the body written whole.
    #[test]
    fn decode_edit_reads_as_decode_body() {
        let resp =
            br#"{"kv_transfer_params":{"remote_host":"localhost","remote_block_ids":[1,2]}}"#;
        let own: &[u8] = br#"{"model":"m","kv_transfer_params":{"do_remote_prefill":true}}"#;
        for (client, connector, in_front) in [
            (client(), KvConnector::Shfs, true),
            (client(), KvConnector::Nixl, true),
            (own, KvConnector::Shfs, false),
        ] {
            let spans = Members::parse(client).unwrap().spans(client);
            let edit = decode_edit(client, &spans, resp, "10.0.0.7", connector)
                .unwrap()
                .unwrap();
            let whole = decode_body(client, &spans, resp, "10.0.0.7", connector)
                .unwrap()
                .unwrap();
            let edited = edit.apply(client);
            assert_eq!(
                serde_json::from_slice::<Value>(&edited).unwrap(),
                serde_json::from_slice::<Value>(&whole).unwrap()
            );
            match edit {
                BodyEdit::Prefix { replace, .. } => {
                    assert!(in_front);
                    assert!(edited.ends_with(&client[replace..]));
                }
                BodyEdit::Whole(body) => {
                    assert!(!in_front);
                    assert_eq!(body, whole);
                }
            }
        }
        assert_eq!(
            decode_edit(client(), &spans(), resp, "ip", KvConnector::Mooncake).unwrap(),
            None
        );
        assert!(decode_edit(client(), &spans(), b"oops", "ip", KvConnector::Shfs).is_err());
    }

    #[test]
    fn decode_leg_edge_cases() {
        assert_eq!(
            decode_body(
                client(),
                &spans(),
                br#"{"id":"x"}"#,
                "ip",
                KvConnector::Shfs
            )
            .unwrap(),
            None
        );
        assert!(decode_body(client(), &spans(), b"oops", "ip", KvConnector::Shfs).is_err());
        assert!(decode_body(
            client(),
            &spans(),
            br#"{"kv_transfer_params":3}"#,
            "ip",
            KvConnector::Shfs
        )
        .is_err());
        let nixl = decode_body(
            client(),
            &spans(),
            br#"{"id":"x"}"#,
            "ip",
            KvConnector::Nixl,
        )
        .unwrap()
        .unwrap();
        let body: Value = serde_json::from_slice(&nixl).unwrap();
        assert_eq!(body["disagg_prefill_resp"]["id"], "x");
        assert_eq!(
            decode_body(client(), &spans(), b"{}", "ip", KvConnector::Mooncake).unwrap(),
            None
        );
    }
}
