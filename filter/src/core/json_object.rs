//! A JSON object's top-level members as slices of the original bytes.
//!
//! The engine legs are the client's body with a few members replaced or added. Parsing the
//! whole body into a `serde_json::Value`, cloning it per leg and printing it again cost about
//! 20 µs per 2 KB request natively and 165 µs at 32 KB (`cargo bench --bench body`), most of
//! it copying and escaping the prompt text. Here each member's value stays a borrowed
//! [`RawValue`] (validated, never copied), and a leg's body is written by splicing slices:
//! the prompt is copied once with `memcpy`, and every value the client sent (63-bit ids,
//! floats, unicode escapes) reaches the engine byte for byte.

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;

use serde::de::{Deserializer, Error as _, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// The most top-level members a request body may have ([`Members::parse_capped`]). Each
/// member costs an index entry with its own copy of the name, and a PD request keeps that
/// index next to its body until the prefill answers: an 8 MiB body of ~700 000 members like
/// `"k1":0,` held about 30 MB more than its bytes. Real OpenAI and Anthropic request bodies
/// have fewer than 60 members, so 1024 refuses none of them.
pub const MAX_BODY_MEMBERS: usize = 1024;

/// Why [`Members::parse_capped`] refused a body.
#[derive(Debug, thiserror::Error)]
pub enum MembersError {
    #[error("not one JSON object: {0}")]
    Json(#[from] serde_json::Error),
    /// The object has more than `limit` members; parsing stopped at the first one past it.
    #[error("more than {limit} members")]
    TooMany { limit: usize },
}

/// A member name, borrowed from the input unless it contains escapes (the visitors that read
/// an object's members one by one share it).
#[derive(Deserialize)]
pub(crate) struct Key<'a>(#[serde(borrow)] pub(crate) Cow<'a, str>);

/// The members of one JSON object, in input order, duplicates included.
#[derive(Debug, Default)]
pub struct Members<'a> {
    entries: Vec<(Cow<'a, str>, &'a RawValue)>,
}

/// Reads an object's members, at most `max` of them: `over` is set when the object has more
/// (serde's error type cannot say why it failed, and a failure past the cap is not a
/// malformed body).
struct MembersVisitor<'c> {
    max: usize,
    over: Option<&'c Cell<bool>>,
}

impl<'de> Visitor<'de> for MembersVisitor<'_> {
    type Value = Members<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
        let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(8).min(self.max));
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            // Checked before the member is stored, so the index never outgrows the cap.
            if entries.len() == self.max {
                if let Some(over) = self.over {
                    over.set(true);
                }
                return Err(A::Error::custom("too many members"));
            }
            let value = map.next_value::<&'de RawValue>()?;
            entries.push((key, value));
        }
        Ok(Members { entries })
    }
}

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Members<'de>, D::Error> {
        d.deserialize_map(MembersVisitor {
            max: usize::MAX,
            over: None,
        })
    }
}

impl<'a> Members<'a> {
    /// The members of `raw`, which must be exactly one JSON object (surrounding whitespace
    /// allowed). Nested values are validated as JSON without recursion, so any depth is
    /// accepted; values that are parsed further get serde_json's nesting limit there.
    pub fn parse(raw: &'a [u8]) -> Result<Members<'a>, serde_json::Error> {
        serde_json::from_slice(raw)
    }

    /// Like [`Members::parse`], for a client's body: more than `max` members is
    /// [`MembersError::TooMany`], found without indexing more than `max` of them.
    pub fn parse_capped(raw: &'a [u8], max: usize) -> Result<Members<'a>, MembersError> {
        let over = Cell::new(false);
        let mut de = serde_json::Deserializer::from_slice(raw);
        let parsed = de
            .deserialize_map(MembersVisitor {
                max,
                over: Some(&over),
            })
            .and_then(|members| de.end().map(|()| members));
        match parsed {
            Ok(members) => Ok(members),
            Err(_) if over.get() => Err(MembersError::TooMany { limit: max }),
            Err(e) => Err(MembersError::Json(e)),
        }
    }

    /// Like [`Members::parse`] for a nested value already validated.
    pub fn of(value: &'a RawValue) -> Result<Members<'a>, serde_json::Error> {
        serde_json::from_str(value.get())
    }

    /// The members in input order, duplicates included.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &'a RawValue)> + '_ {
        self.entries.iter().map(|(k, v)| (k.as_ref(), *v))
    }

    /// The value of `key`; with duplicated keys the last one wins, as in the engines.
    pub fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.entries
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
    }

    /// Where each member's value lies in `raw`, the bytes these members were parsed from:
    /// owned, so a request can keep it next to its body and splice legs later. A member that
    /// a later duplicate overrides is left out (see [`Spans::from_ranges`]).
    pub fn spans(&self, raw: &[u8]) -> Spans {
        let base = raw.as_ptr() as usize;
        let ranges: Vec<(&str, std::ops::Range<usize>)> = self
            .entries
            .iter()
            .filter_map(|(k, v)| {
                let start = (v.get().as_ptr() as usize).checked_sub(base)?;
                let end = start + v.get().len();
                (end <= raw.len()).then_some((k.as_ref(), start..end))
            })
            .collect();
        Spans::from_ranges(&ranges)
    }
}

/// The members of a JSON object as byte ranges of its raw text (see [`Members::spans`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Spans {
    entries: Vec<(Box<str>, std::ops::Range<usize>)>,
    /// Names the object holds more than once (only the last of each is in `entries`): an
    /// adapter that must refuse ambiguous members asks [`Spans::repeated`]. Empty, and
    /// unallocated, for an ordinary body.
    overridden: Vec<Box<str>>,
}

impl Spans {
    /// The spans of an object's members given in input order, duplicates included, as
    /// `(name, value range)`. A member that a later duplicate overrides is left out (the
    /// engines keep the last one), found with one map pass so a body of a million keys costs
    /// linear time, not quadratic.
    pub fn from_ranges(members: &[(&str, std::ops::Range<usize>)]) -> Spans {
        let mut last: hashbrown::HashMap<&str, usize> =
            hashbrown::HashMap::with_capacity(members.len());
        for (i, (k, _)) in members.iter().enumerate() {
            last.insert(k, i);
        }
        let mut overridden: Vec<Box<str>> = Vec::new();
        let mut entries = Vec::with_capacity(last.len());
        for (i, (k, range)) in members.iter().enumerate() {
            if last.get(k) != Some(&i) {
                // Once per overridden occurrence, not deduplicated: a body of many repeated
                // keys stays linear.
                overridden.push((*k).into());
                continue;
            }
            entries.push(((*k).into(), range.clone()));
        }
        Spans {
            entries,
            overridden,
        }
    }

    /// Bytes this index takes on the heap (its entries and the names it copied): what a
    /// request keeping it next to its body adds to the bodies a VM holds (`core::held_body`).
    pub fn heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(Box<str>, std::ops::Range<usize>)>();
        let name = std::mem::size_of::<Box<str>>();
        self.entries.capacity() * entry
            + self.entries.iter().map(|(k, _)| k.len()).sum::<usize>()
            + self.overridden.capacity() * name
            + self.overridden.iter().map(|k| k.len()).sum::<usize>()
    }

    /// Whether the object held `key` more than once.
    pub fn repeated(&self, key: &str) -> bool {
        self.overridden.iter().any(|k| k.as_ref() == key)
    }

    /// The raw value of `key` (the last one, if repeated) within `raw`.
    pub fn value<'r>(&self, raw: &'r [u8], key: &str) -> Option<&'r [u8]> {
        self.entries
            .iter()
            .find(|(k, _)| k.as_ref() == key)
            .and_then(|(_, range)| raw.get(range.clone()))
    }

    /// The object again from `raw`, without the members named in `drop` (a handful), followed
    /// by `extra` (`(name, raw JSON value)`).
    pub fn write(&self, raw: &[u8], drop: &[&str], extra: &[(&str, &str)]) -> Vec<u8> {
        let size: usize = self
            .entries
            .iter()
            .map(|(k, v)| k.len() + v.len() + 4)
            .chain(extra.iter().map(|(k, v)| k.len() + v.len() + 4))
            .sum();
        let mut out = Vec::with_capacity(size + 2);
        out.push(b'{');
        let mut first = true;
        let mut member = |out: &mut Vec<u8>, key: &str, value: &[u8]| {
            if !std::mem::take(&mut first) {
                out.push(b',');
            }
            write_member(out, key, value);
        };
        for (key, range) in &self.entries {
            if !drop.contains(&key.as_ref()) {
                member(&mut out, key, raw.get(range.clone()).unwrap_or(b"null"));
            }
        }
        for (key, value) in extra {
            member(&mut out, key, value.as_bytes());
        }
        out.push(b'}');
        out
    }

    /// [`Spans::write`] as an edit of `raw`: when the object holds none of the members named
    /// in `drop` (nor any earlier duplicate of one) and at least one member, `extra` goes in
    /// front of its first member and the rest of `raw` stays as written. The engines read
    /// either body alike: JSON members are unordered, and a duplicate the client sent keeps
    /// its last value in both. Anything else is written whole.
    pub fn edit(&self, raw: &[u8], drop: &[&str], extra: &[(&str, &str)]) -> BodyEdit {
        let clashes = self
            .entries
            .iter()
            .map(|(k, _)| k)
            .chain(&self.overridden)
            .any(|k| drop.contains(&k.as_ref()));
        let brace = raw
            .iter()
            .position(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
        match brace {
            Some(at) if !clashes && !self.entries.is_empty() && raw.get(at) == Some(&b'{') => {
                let size: usize = extra.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
                let mut with = Vec::with_capacity(size + 1);
                with.push(b'{');
                for (key, value) in extra {
                    write_member(&mut with, key, value.as_bytes());
                    with.push(b',');
                }
                BodyEdit::Prefix {
                    replace: at + 1,
                    with,
                }
            }
            _ => BodyEdit::Whole(self.write(raw, drop, extra)),
        }
    }
}

/// How a leg's body is made from the client's, which Envoy still holds: Envoy can replace the
/// first bytes of a request body in place (`set_buffer` at offset 0 drains that many bytes and
/// prepends the new ones), so a leg that only adds members need not copy a large body into
/// the VM's memory and hand it back whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyEdit {
    /// The first `replace` bytes (whitespace and the opening brace) give way to `with` (the
    /// brace, the members set, a comma); the client's members follow as it wrote them.
    Prefix { replace: usize, with: Vec<u8> },
    /// A body written whole, by [`Spans::write`].
    Whole(Vec<u8>),
}

impl BodyEdit {
    /// The body the edit makes of `raw`, the client's body (what the engine receives).
    pub fn apply(&self, raw: &[u8]) -> Vec<u8> {
        match self {
            BodyEdit::Prefix { replace, with } => {
                let rest = raw.get(*replace..).unwrap_or_default();
                let mut out = Vec::with_capacity(with.len() + rest.len());
                out.extend_from_slice(with);
                out.extend_from_slice(rest);
                out
            }
            BodyEdit::Whole(body) => body.clone(),
        }
    }

    /// The length of the body the edit makes of a client body of `raw_len` bytes.
    pub fn len_from(&self, raw_len: usize) -> usize {
        match self {
            BodyEdit::Prefix { replace, with } => raw_len.saturating_sub(*replace) + with.len(),
            BodyEdit::Whole(body) => body.len(),
        }
    }
}

/// `object` (one JSON object's text, as a [`RawValue`] holds it) with member `key` set to the
/// raw JSON `value` and every other member as written; `None` when `object` is not an object.
/// For the engine answers whose nested parameters a leg forwards with one member changed.
pub fn with_member(object: &str, key: &str, value: &str) -> Option<String> {
    let raw = object.as_bytes();
    let members = Members::parse(raw).ok()?;
    String::from_utf8(members.spans(raw).write(raw, &[key], &[(key, value)])).ok()
}

/// `"key":value`, `value` being raw JSON.
fn write_member(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    write_key(out, key);
    out.push(b':');
    out.extend_from_slice(value);
}

/// `key` as a JSON string: quoted, escaped where JSON requires it.
fn write_key(out: &mut Vec<u8>, key: &str) {
    if key.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(key.as_bytes());
        out.push(b'"');
    } else if let Ok(quoted) = serde_json::to_string(key) {
        out.extend_from_slice(quoted.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// An edit gives the engine the object `write` gives it, and leaves the client's members
    /// as written when it only adds members; a body holding a member it sets is written whole.
    #[test]
    fn edits_read_as_the_written_body() {
        let drop = ["kv_transfer_params", "rid"];
        let extra = [
            ("kv_transfer_params", r#"{"remote_host":"10.0.0.7"}"#),
            ("rid", r#""r\"1""#),
        ];
        let prefix: [&[u8]; 5] = [
            br#"{"model":"m","messages":[{"content":"hi"}]}"#,
            b" \r\n\t{ \"a\" : 1 , \"a\" : [2, {\"b\":null}] }\n",
            br#"{"x\u0041":"\u00e9","y":1.50,"z":18446744073709551616}"#,
            br#"{"n":{"kv_transfer_params":1}}"#,
            br#"{"rid2":0}"#,
        ];
        let whole: [&[u8]; 4] = [
            br#"{"model":"m","kv_transfer_params":{"a":1}}"#,
            br#"{"rid":1,"model":"m","rid":2}"#,
            br#"{"kv_transfer_param\u0073":null,"m":1}"#,
            br#"{}"#,
        ];
        for (raw, want_prefix) in prefix
            .iter()
            .map(|r| (*r, true))
            .chain(whole.iter().map(|r| (*r, false)))
        {
            let spans = Members::parse(raw).unwrap().spans(raw);
            let edit = spans.edit(raw, &drop, &extra);
            let body = edit.apply(raw);
            let shown = String::from_utf8_lossy(raw);
            assert_eq!(
                matches!(edit, BodyEdit::Prefix { .. }),
                want_prefix,
                "{shown}"
            );
            assert_eq!(edit.len_from(raw.len()), body.len(), "{shown}");
            let written: Value = serde_json::from_slice(&spans.write(raw, &drop, &extra)).unwrap();
            let edited: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(edited, written, "{shown}");
            if let BodyEdit::Prefix { replace, .. } = edit {
                assert!(
                    body.ends_with(&raw[replace..]),
                    "the client's bytes follow: {shown}"
                );
            }
        }
    }

    #[test]
    fn members_keep_order_duplicates_and_exact_bytes() {
        let raw = br#" {"a":1, "b" : {"x": [1, 2]}, "a":9223372036854775807,"c\"d":"\u00e9"} "#;
        let m = Members::parse(raw).unwrap();
        assert_eq!(m.get("a").unwrap().get(), "9223372036854775807");
        assert_eq!(m.get("b").unwrap().get(), r#"{"x": [1, 2]}"#);
        assert_eq!(m.get("c\"d").unwrap().get(), r#""\u00e9""#);
        assert!(m.get("z").is_none());
        let spans = m.spans(raw);
        assert!(spans.repeated("a") && !spans.repeated("b") && !spans.repeated("z"));
        assert_eq!(spans.value(raw, "a"), Some(&b"9223372036854775807"[..]));
        assert_eq!(spans.value(raw, "z"), None);
        let out = spans.write(raw, &["b"], &[("e", "true")]);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"a":9223372036854775807,"c\"d":"\u00e9","e":true}"#
        );
        let value: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(value["c\"d"], "é");
    }

    #[test]
    fn many_duplicated_keys_cost_linear_time() {
        let mut raw = String::from("{");
        for i in 0..200_000 {
            raw.push_str(&format!("\"k{}\":{i},", i % 1000));
        }
        raw.push_str("\"model\":\"m\"}");
        let m = Members::parse(raw.as_bytes()).unwrap();
        let spans = m.spans(raw.as_bytes());
        let out = spans.write(raw.as_bytes(), &["model"], &[]);
        let value: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(value.as_object().map(|o| o.len()), Some(1000));
        assert_eq!(value["k7"], 199_007);
    }

    /// A body of more members than the cap is refused as such, not as malformed JSON, at
    /// the first member past the cap (what follows it is never read); one at the cap is read.
    #[test]
    fn members_past_the_cap_are_refused_before_they_are_indexed() {
        let object = |n: usize, tail: &str| {
            let members: Vec<String> = (0..n).map(|i| format!("\"k{i}\":0")).collect();
            format!("{{{}{tail}}}", members.join(","))
        };
        let at_cap = object(MAX_BODY_MEMBERS, "");
        let m = Members::parse_capped(at_cap.as_bytes(), MAX_BODY_MEMBERS).unwrap();
        assert_eq!(m.iter().count(), MAX_BODY_MEMBERS);
        let over = object(MAX_BODY_MEMBERS + 1, "");
        assert!(matches!(
            Members::parse_capped(over.as_bytes(), MAX_BODY_MEMBERS),
            Err(MembersError::TooMany {
                limit: MAX_BODY_MEMBERS
            })
        ));
        // Nothing past the cap is read: a body broken after it is still "too many".
        let broken_after = object(MAX_BODY_MEMBERS + 1, ",\"x\":}");
        assert!(matches!(
            Members::parse_capped(broken_after.as_bytes(), MAX_BODY_MEMBERS),
            Err(MembersError::TooMany { .. })
        ));
        // Duplicates count: each occurrence is an entry until the spans are made.
        let repeated = format!("{{{}}}", ["\"a\":1"; 5].join(","));
        assert!(matches!(
            Members::parse_capped(repeated.as_bytes(), 4),
            Err(MembersError::TooMany { limit: 4 })
        ));
        // Malformed bodies under the cap stay malformed, and the rest is read as `parse` does.
        for bad in [&b"{"[..], b"[]", b"{\"a\":1} {}", b"{\"a\":1,}"] {
            assert!(matches!(
                Members::parse_capped(bad, MAX_BODY_MEMBERS),
                Err(MembersError::Json(_))
            ));
        }
        let raw = br#" {"a":1,"b":[2],"a":3} "#;
        let capped = Members::parse_capped(raw, 3).unwrap();
        let plain = Members::parse(raw).unwrap();
        assert_eq!(capped.spans(raw), plain.spans(raw));
    }

    #[test]
    fn the_index_weighs_its_entries_and_copied_names() {
        let raw = br#"{"model":"m","a":1,"a":2}"#;
        let spans = Members::parse(raw).unwrap().spans(raw);
        let entry = std::mem::size_of::<(Box<str>, std::ops::Range<usize>)>();
        // Two entries ("model", the last "a"), one overridden "a".
        assert!(spans.heap_bytes() >= 2 * entry + "model".len() + 2 * "a".len());
        assert_eq!(Spans::default().heap_bytes(), 0);
    }

    #[test]
    fn anything_but_one_object_is_refused() {
        for bad in [
            &b""[..],
            b"{",
            b"[]",
            b"\"x\"",
            b"{} {}",
            b"{\"a\":}",
            b"{\"a\":1,}",
            b"{\"a\":\"\xff\"}",
            b"{\"a\":nul}",
        ] {
            assert!(
                Members::parse(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Values kept raw are checked without recursion, so depth is no risk here; how deep
        // a member the router never reads may nest is for the engine to judge.
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(Members::parse(deep.as_bytes()).is_ok());
        let unbalanced = format!("{{\"a\":{}{}}}", "[".repeat(100), "]".repeat(99));
        assert!(Members::parse(unbalanced.as_bytes()).is_err());
    }

    #[test]
    fn writing_everything_back_is_the_same_object() {
        let raw =
            br#"{"model":"m","messages":[{"role":"user","content":"a \"b\" \n"}],"seed":1e400}"#;
        let spans = Members::parse(raw).unwrap().spans(raw);
        assert_eq!(spans.write(raw, &[], &[]), raw.to_vec());
        let empty = Members::parse(b"{}").unwrap().spans(b"{}");
        assert_eq!(
            empty.write(b"{}", &[], &[("k", "1")]),
            b"{\"k\":1}".to_vec()
        );
        assert_eq!(empty.write(b"{}", &[], &[]), b"{}".to_vec());
    }

    #[test]
    fn one_member_replaced_in_a_nested_object() {
        assert_eq!(
            with_member(r#"{"a":1.50,"h":"x","h":"y"}"#, "h", r#""z""#).as_deref(),
            Some(r#"{"a":1.50,"h":"z"}"#)
        );
        assert_eq!(with_member("{}", "h", "1").as_deref(), Some(r#"{"h":1}"#));
        assert_eq!(with_member("[1]", "h", "1"), None);
    }
}
