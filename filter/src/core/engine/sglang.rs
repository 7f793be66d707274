//! SGLang disaggregation: both legs carry the same `bootstrap_host` (the prefill pod's IP),
//! `bootstrap_port` and `bootstrap_room`, and the same `rid` so the decode request can be
//! aborted. The legs are sent concurrently; SGLang's prefill answers only once the decode
//! pod has taken the KV. Both legs are spliced from the client's bytes with the request's
//! [`Spans`] (one parse per request, shared with the routing), so everything the client sent
//! reaches the engine unchanged.

use crate::core::errors::RouteError;
use crate::core::json_object::{BodyEdit, Spans};

/// `model.aibrix.ai/sglang-bootstrap-port` when the annotation is absent.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Top-level keys the router writes; a client body holding one of them twice is ambiguous
/// (which one would the engine read?) and is refused. The first four are the decode leg's.
const CONTROLLED: [&str; 9] = [
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "rid",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "min_tokens",
];

/// What pairs the two legs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    pub host: String,
    pub port: u16,
    pub room: u64,
    pub rid: String,
}

/// The `bootstrap_host` naming a prefill pod at `ip`: SGLang's decode worker reaches
/// `http://{bootstrap_host}:{bootstrap_port}`, so an IPv6 address goes in brackets (bare,
/// it makes no URL and the KV transfer fails).
pub fn bootstrap_host(ip: &str) -> String {
    if ip.contains(':') && !ip.starts_with('[') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    }
}

/// Checks the body before any selection, so a refused request changes no load counter.
/// `members` are the body's, from the request's parse (which refused anything but one
/// JSON object).
pub fn validate(raw: &[u8], members: &Spans) -> Result<(), RouteError> {
    if let Some(key) = CONTROLLED.iter().find(|k| members.repeated(k)) {
        return Err(RouteError::InvalidRequest(format!(
            "duplicate top-level key {key:?} in SGLang request body"
        )));
    }
    if members.value(raw, "rid") == Some(b"\"\"") {
        return Err(RouteError::InvalidRequest(
            "rid must not be empty in SGLang request body".into(),
        ));
    }
    Ok(())
}

/// The request id both legs carry: the gateway request id plus 8 hex digits of per-process
/// randomness and 8 of a counter, so ids stay unique across gateway processes that share
/// the engines. It replaces any client `rid`.
pub fn rid(request_id: &str, process_random: u32, counter: u32) -> String {
    format!("{request_id}-{process_random:08x}{counter:08x}")
}

/// A bootstrap room from 64 random bits: SGLang takes rooms in [0, 2^63 - 2]. `None` for
/// the one draw out of range (the caller draws again).
pub fn room(random: u64) -> Option<u64> {
    let r = random & (i64::MAX as u64);
    (r < i64::MAX as u64).then_some(r)
}

/// The prefill and decode bodies. The decode body is the client's with the bootstrap fields
/// and `rid` set; the prefill body additionally asks for one unstreamed token. Both written
/// whole: the reference for [`legs_edited`], which the filter uses.
pub fn legs(raw: &[u8], members: &Spans, b: &Bootstrap) -> (Vec<u8>, Vec<u8>) {
    with_fields(b, |set| {
        (
            members.write(raw, &CONTROLLED, set),
            members.write(raw, &CONTROLLED[..4], &set[..4]),
        )
    })
}

/// [`legs`] with the decode leg as an edit of the client's body, which Envoy still holds: the
/// bootstrap fields go in front unless the client sent one of them, so a long prompt is not
/// copied into the VM and back for the leg that keeps it.
pub fn legs_edited(raw: &[u8], members: &Spans, b: &Bootstrap) -> (Vec<u8>, BodyEdit) {
    with_fields(b, |set| {
        (
            members.write(raw, &CONTROLLED, set),
            members.edit(raw, &CONTROLLED[..4], &set[..4]),
        )
    })
}

/// The members the legs set, in [`CONTROLLED`]'s order: the bootstrap fields and `rid` (both
/// legs), then one unstreamed token (the prefill leg).
fn with_fields<T>(b: &Bootstrap, f: impl FnOnce(&[(&str, &str); 7]) -> T) -> T {
    let host = serde_json::Value::String(b.host.clone()).to_string();
    let port = b.port.to_string();
    let room = b.room.to_string();
    let rid = serde_json::Value::String(b.rid.clone()).to_string();
    f(&[
        ("bootstrap_host", &host),
        ("bootstrap_port", &port),
        ("bootstrap_room", &room),
        ("rid", &rid),
        ("max_tokens", "1"),
        ("max_completion_tokens", "1"),
        ("stream", "false"),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::json_object::Members;
    use serde_json::Value;

    fn spans(raw: &[u8]) -> Spans {
        Members::parse(raw).expect("one JSON object").spans(raw)
    }

    #[test]
    fn an_ipv6_bootstrap_host_is_bracketed() {
        assert_eq!(bootstrap_host("10.0.0.7"), "10.0.0.7");
        assert_eq!(bootstrap_host("fd00::7"), "[fd00::7]");
        assert_eq!(bootstrap_host("[fd00::7]"), "[fd00::7]");
    }

    fn boot() -> Bootstrap {
        Bootstrap {
            host: "10.0.0.7".into(),
            port: 8998,
            room: 9_223_372_036_854_775_806,
            rid: "req-1-0000abcd00000001".into(),
        }
    }

    /// The filter's decode leg is an edit of the body Envoy holds; the engine reads it as the
    /// written one, and a client that sent a bootstrap field gets the body written whole.
    #[test]
    fn edited_decode_leg_reads_as_the_written_one() {
        let plain: &[u8] = br#"{"model":"m","messages":[{"content":"hi"}],"stream":true}"#;
        let own_room: &[u8] = br#"{"model":"m","bootstrap_room":1,"messages":[]}"#;
        for (raw, in_front) in [(plain, true), (own_room, false)] {
            let (prefill, decode) = legs(raw, &spans(raw), &boot());
            let (edited_prefill, edit) = legs_edited(raw, &spans(raw), &boot());
            assert_eq!(edited_prefill, prefill);
            assert_eq!(matches!(edit, BodyEdit::Prefix { .. }), in_front);
            let edited: Value = serde_json::from_slice(&edit.apply(raw)).unwrap();
            assert_eq!(edited, serde_json::from_slice::<Value>(&decode).unwrap());
        }
    }

    #[test]
    fn both_legs_share_the_bootstrap_and_keep_the_client_bytes() {
        let raw = br#"{"model":"m","tools":[{"schema":{"x":1.50}}],"stream":true,"stream_options":{"include_usage":true},"min_tokens":3,"bootstrap_room":1,"seed":18446744073709551615}"#;
        let (prefill, decode) = legs(raw, &spans(raw), &boot());
        let d = String::from_utf8(decode.clone()).unwrap();
        let p = String::from_utf8(prefill.clone()).unwrap();
        // The client's own room and stream are replaced, not left beside the router's.
        for (leg, key, n) in [
            (&d, "bootstrap_room", 1),
            (&p, "bootstrap_room", 1),
            (&p, "stream", 1),
        ] {
            assert_eq!(
                leg.matches(&format!("\"{key}\"")).count(),
                n,
                "{key}: {leg}"
            );
        }
        assert!(d.contains(r#""tools":[{"schema":{"x":1.50}}]"#), "{d}");
        assert!(
            d.contains(r#""bootstrap_room":9223372036854775806"#),
            "exact room: {d}"
        );
        assert!(d.contains(r#""seed":18446744073709551615"#));
        let dv: Value = serde_json::from_slice(&decode).unwrap();
        assert_eq!(dv["stream"], true);
        assert_eq!(dv["bootstrap_host"], "10.0.0.7");
        assert_eq!(dv["bootstrap_port"], 8998);
        assert_eq!(dv["rid"], "req-1-0000abcd00000001");
        let pv: Value = serde_json::from_slice(&prefill).unwrap();
        assert_eq!(
            (
                &pv["max_tokens"],
                &pv["max_completion_tokens"],
                &pv["stream"]
            ),
            (&Value::from(1), &Value::from(1), &Value::from(false))
        );
        assert!(pv.get("stream_options").is_none() && pv.get("min_tokens").is_none());
        assert_eq!(
            pv["bootstrap_room"].as_u64(),
            Some(9_223_372_036_854_775_806)
        );
        assert_eq!(pv["rid"], dv["rid"]);
    }

    #[test]
    fn validation_table() {
        let cases: [(&[u8], Option<&str>); 6] = [
            (
                br#"{"model":"m","stream":true,"stream":false}"#,
                Some("duplicate top-level key \"stream\""),
            ),
            (
                br#"{"rid":"a","rid":"b"}"#,
                Some("duplicate top-level key \"rid\""),
            ),
            (
                br#"{"bootstrap_room":1,"x":0,"bootstrap_room":2,"bootstrap_room":3}"#,
                Some("duplicate top-level key \"bootstrap_room\""),
            ),
            (br#"{"tools":1,"tools":2}"#, None),
            (br#"{"rid":""}"#, Some("rid must not be empty")),
            (br#"{"rid":"","rid":"x"}"#, Some("duplicate top-level key")),
        ];
        for (raw, want) in cases {
            match (validate(raw, &spans(raw)), want) {
                (Ok(()), None) => {}
                (Err(RouteError::InvalidRequest(m)), Some(w)) => assert!(m.contains(w), "{m}"),
                (got, _) => panic!("{}: {got:?}", String::from_utf8_lossy(raw)),
            }
        }
    }

    #[test]
    fn rooms_and_rids() {
        assert_eq!(room(u64::MAX), None, "2^63-1 is out of range");
        assert_eq!(room(u64::MAX - 1), Some(i64::MAX as u64 - 1));
        assert_eq!(room(1 << 63), Some(0));
        assert_eq!(rid("abc", 0xdead_beef, 7), "abc-deadbeef00000007");
    }
}
