//! A validating scan of JSON text that lists one object's members as byte ranges, for the
//! engines' answers the decode legs are built from.
//!
//! serde_json spends ≈ 6 ns per element validating an array of integers it does not keep (its
//! generic `ignore_value` loop), and the answers carry big ones: a vLLM prefill answer one
//! KV block id per 16 prompt tokens, a TRT-LLM context answer one token id per prompt token
//! (65 536 ids, 420–760 µs natively, for a 256 KB prompt). Checked eight bytes at a time
//! ([`integer_list`]), the same list takes 30–80 µs natively and a third of serde's time as
//! wasm.
//!
//! It is a fast path, never the arbiter: it accepts only text serde_json accepts (JSON's
//! grammar, with serde's rules: no control characters in strings, any `\uXXXX` escape in a
//! value, any depth), and answers `None` for everything else and for what it leaves to serde
//! (a member name with escapes, nesting deeper than [`MAX_DEPTH`]), where the callers run the
//! serde parse, whose result or error stands. Unit tests and the fuzz target `request` hold
//! the two to the same members on arbitrary input.

use std::ops::Range;

/// Nesting the scan follows before it leaves the text to serde (its recursion is bounded).
pub const MAX_DEPTH: usize = 64;

/// The value range of `key` among `members` (an [`object`]'s); with duplicated keys the last
/// one wins, as in the engines.
pub fn last(members: &[(&str, Range<usize>)], key: &str) -> Option<Range<usize>> {
    members
        .iter()
        .rev()
        .find(|(name, _)| *name == key)
        .map(|(_, at)| at.clone())
}

/// The members of `text`, which must be exactly one JSON object (surrounding whitespace
/// allowed): `(name, value range)` in input order, duplicates included, or `None` (invalid,
/// or left to serde).
pub fn object(text: &str) -> Option<Vec<(&str, Range<usize>)>> {
    let b = text.as_bytes();
    let mut members = Vec::new();
    let end = object_at(b, space(b, 0), 0, &mut |key, value| {
        // Names are plain (escape-free) strings, so their bytes are their text.
        members.push((&text[key], value));
    })?;
    (space(b, end) == b.len()).then_some(members)
}

/// JSON's insignificant whitespace from `i` on; the index of the next other byte.
fn space(b: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\r' | b'\t') = b.get(i) {
        i += 1;
    }
    i
}

/// The value starting at `i` (no leading whitespace); the index just after it.
fn value(b: &[u8], i: usize, depth: usize) -> Option<usize> {
    match *b.get(i)? {
        b'{' => object_at(b, i, depth + 1, &mut |_, _| {}),
        b'[' => array(b, i, depth + 1),
        b'"' => string(b, i + 1).map(|(end, _)| end),
        b'-' | b'0'..=b'9' => number(b, i),
        b't' => literal(b, i, b"true"),
        b'f' => literal(b, i, b"false"),
        b'n' => literal(b, i, b"null"),
        _ => None,
    }
}

fn literal(b: &[u8], i: usize, word: &[u8]) -> Option<usize> {
    (b.get(i..i + word.len())? == word).then_some(i + word.len())
}

/// The object at `i` (its `{`), handing each member's name range (an escape-free string's
/// contents) and value range to `member`; the index after its `}`.
fn object_at(
    b: &[u8],
    i: usize,
    depth: usize,
    member: &mut dyn FnMut(Range<usize>, Range<usize>),
) -> Option<usize> {
    if depth > MAX_DEPTH || b.get(i) != Some(&b'{') {
        return None;
    }
    let mut i = space(b, i + 1);
    if b.get(i) == Some(&b'}') {
        return Some(i + 1);
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let (after, escaped) = string(b, i + 1)?;
        if escaped {
            return None;
        }
        let name = i + 1..after - 1;
        i = space(b, after);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i = space(b, i + 1);
        let end = value(b, i, depth)?;
        member(name, i..end);
        i = space(b, end);
        match b.get(i)? {
            b',' => i = space(b, i + 1),
            b'}' => return Some(i + 1),
            _ => return None,
        }
    }
}

/// The array at `i` (its `[`); the index after its `]`. A list of plain integers (the id
/// lists of the answers) takes [`integer_list`]; anything else goes element by element.
fn array(b: &[u8], i: usize, depth: usize) -> Option<usize> {
    if depth > MAX_DEPTH {
        return None;
    }
    let mut i = space(b, i + 1);
    if b.get(i) == Some(&b']') {
        return Some(i + 1);
    }
    if let Some(end) = integer_list(b, i) {
        return Some(end);
    }
    loop {
        i = space(b, value(b, i, depth)?);
        match b.get(i)? {
            b',' => i = space(b, i + 1),
            b']' => return Some(i + 1),
            _ => return None,
        }
    }
}

/// An array's elements from `start` to its `]` when they are plain integers and commas and
/// nothing else (`1000,1001,1002]`, how engines write id lists): the index after the `]`.
/// Checked eight bytes at a time without a branch per element (the generic loop mispredicts
/// on every number's length, ≈ 5 ns an element; a byte loop costs wasm ≈ 3 ns a byte); `None`
/// for anything else, which the generic loop decides.
fn integer_list(b: &[u8], start: usize) -> Option<usize> {
    // Arrays of anything else are not searched at all.
    if !is_digit(*b.get(start)?) {
        return None;
    }
    let end = start + memchr::memchr(b']', b.get(start..)?)?;
    let list = &b[start..end];
    let n = list.len();
    let (&first, &last) = (list.first()?, list.last()?);
    // A flaw: a byte that is neither a digit nor a comma, an empty element (two commas), or
    // a leading zero (a `0` after a comma, followed by a digit). The first and last bytes
    // must be digits; a `0` first must not be followed by a digit.
    let mut flaws = u64::from(!is_digit(first) || !is_digit(last));
    flaws |= u64::from(first == b'0' && list.get(1).copied().is_some_and(is_digit));
    // Bytes 1..n-1, each seen with its neighbours: eight at a time while the word after
    // them fits, then one by one.
    let mut p = 1;
    while p + 9 <= n {
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&list[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let (prev, cur, next) = (word(p - 1), word(p), word(p + 1));
        let comma = swar::eq(cur, b',');
        flaws |= cur & swar::HIGH
            | !(swar::digit(cur) | comma) & swar::HIGH
            | comma & swar::eq(prev, b',')
            | swar::eq(cur, b'0') & swar::eq(prev, b',') & swar::digit(next);
        p += 8;
    }
    while p + 1 < n {
        let (a, z, c) = (list[p - 1], list[p], list[p + 1]);
        flaws |= u64::from(!is_digit(z) & (z != b','))
            | u64::from((a == b',') & (z == b','))
            | u64::from((a == b',') & (z == b'0') & is_digit(c));
        p += 1;
    }
    (flaws == 0).then_some(end + 1)
}

fn is_digit(c: u8) -> bool {
    c.wrapping_sub(b'0') < 10
}

/// Byte tests on eight bytes at once: the high bit of each byte of the answer says whether
/// that byte passes. Exact for ASCII bytes; a byte with its high bit set is a flaw of its
/// own, which [`integer_list`] checks, so what the others then say does not matter.
mod swar {
    const ONES: u64 = 0x0101_0101_0101_0101;
    pub const HIGH: u64 = 0x8080_8080_8080_8080;
    const LOW: u64 = 0x7f7f_7f7f_7f7f_7f7f;

    /// Bytes equal to `c`.
    pub fn eq(x: u64, c: u8) -> u64 {
        let y = x ^ (ONES * u64::from(c));
        !(((y & LOW) + LOW) | y) & HIGH
    }

    /// Bytes in `'0'..='9'`.
    pub fn digit(x: u64) -> u64 {
        let at_least_0 = (x & LOW) + ONES * (0x80 - u64::from(b'0'));
        let above_9 = (x & LOW) + ONES * (0x80 - u64::from(b'9') - 1);
        at_least_0 & !above_9 & HIGH
    }
}

/// Past the digits from `i` on.
fn integer_digits(b: &[u8], mut i: usize) -> usize {
    while let Some(b'0'..=b'9') = b.get(i) {
        i += 1;
    }
    i
}

/// The number at `i`: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`; the index
/// after it. A digit right after a leading `0` is left for the caller to refuse.
fn number(b: &[u8], mut i: usize) -> Option<usize> {
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    i = match b.get(i)? {
        b'0' => i + 1,
        b'1'..=b'9' => integer_digits(b, i + 1),
        _ => return None,
    };
    if b.get(i) == Some(&b'.') {
        let digits = integer_digits(b, i + 1);
        if digits == i + 1 {
            return None;
        }
        i = digits;
    }
    if let Some(b'e' | b'E') = b.get(i) {
        i += 1;
        if let Some(b'+' | b'-') = b.get(i) {
            i += 1;
        }
        let digits = integer_digits(b, i);
        if digits == i {
            return None;
        }
        i = digits;
    }
    Some(i)
}

/// The string whose contents start at `i` (after its opening quote): the index after its
/// closing quote, and whether it held an escape.
fn string(b: &[u8], mut i: usize) -> Option<(usize, bool)> {
    let mut escaped = false;
    loop {
        match *b.get(i)? {
            b'"' => return Some((i + 1, escaped)),
            b'\\' => {
                escaped = true;
                i += match *b.get(i + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 2,
                    // Any four hex digits, as serde_json accepts in a value it skips.
                    b'u' if b.get(i + 2..i + 6)?.iter().all(u8::is_ascii_hexdigit) => 6,
                    _ => return None,
                };
            }
            0x00..=0x1f => return None,
            _ => i += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::json_object::Members;

    /// What serde_json makes of `text` as [`Members`]: names and value ranges.
    fn serde_members(text: &str) -> Option<Vec<(String, Range<usize>)>> {
        let members = Members::parse(text.as_bytes()).ok()?;
        let base = text.as_ptr() as usize;
        Some(
            members
                .iter()
                .map(|(k, v)| {
                    let start = v.get().as_ptr() as usize - base;
                    (k.to_string(), start..start + v.get().len())
                })
                .collect(),
        )
    }

    fn agree(text: &str) {
        let scanned = object(text);
        let reference = serde_members(text);
        if let Some(scanned) = scanned {
            let scanned: Vec<(String, Range<usize>)> = scanned
                .into_iter()
                .map(|(k, r)| (k.to_string(), r))
                .collect();
            assert_eq!(Some(scanned), reference, "{text:?}");
        }
    }

    #[test]
    fn accepts_what_serde_accepts_with_the_same_members() {
        let ok = [
            r#"{}"#,
            " \n{ } \t",
            r#"{"a":1}"#,
            r#"{"a":-0,"b":0.5,"c":1e9,"d":-2.5E-3,"e":12345678901234567890123}"#,
            r#"{"ids":[1,2,3,40,500],"e":[],"n":null,"t":true,"f":false}"#,
            r#"{ "ids" : [ 1 , 2 ,3 ] , "s" : "a \" \\ \/ \b \f \n \r \t \u00e9 \uD800 é" }"#,
            r#"{"o":{"p":{"q":[{"r":[[]]}]}},"a":"x","a":"y"}"#,
            r#"{"mixed":[0,-1,1.5,"s",{"k":[1]},null,true,[2,3]]}"#,
            r#"{"floats":[1.5,2e3,30E-1,4.0e+2],"last":7}"#,
        ];
        for text in ok {
            let scanned = object(text).unwrap_or_else(|| panic!("scan refused {text:?}"));
            let reference = serde_members(text).expect("serde accepts");
            let scanned: Vec<_> = scanned
                .into_iter()
                .map(|(k, r)| (k.to_string(), r))
                .collect();
            assert_eq!(scanned, reference, "{text}");
        }
    }

    #[test]
    fn refuses_what_serde_refuses() {
        let bad = [
            "",
            "[]",
            "1",
            "{",
            r#"{"a"}"#,
            r#"{"a":}"#,
            r#"{"a":1,}"#,
            r#"{"a":1}}"#,
            r#"{"a":1} x"#,
            r#"{"a":[1,]}"#,
            r#"{"a":[1 2]}"#,
            r#"{"a":01}"#,
            r#"{"a":[01]}"#,
            r#"{"a":-}"#,
            r#"{"a":1.}"#,
            r#"{"a":.5}"#,
            r#"{"a":1e}"#,
            r#"{"a":[1.]}"#,
            r#"{"a":[1e+]}"#,
            r#"{"a":+1}"#,
            r#"{"a":tru}"#,
            r#"{"a":nul}"#,
            r#"{"a":"\x"}"#,
            r#"{"a":"\u12G4"}"#,
            "{\"a\":\"tab\there\"}",
            r#"{"a":"open}"#,
            r#"{a:1}"#,
            r#"{"a":1 "b":2}"#,
            r#"{"a":[1],"b":{"c":[}]}"#,
        ];
        for text in bad {
            assert!(object(text).is_none(), "scan accepted {text:?}");
            if text.starts_with('{') {
                assert!(serde_members(text).is_none(), "serde accepts {text:?}");
            }
        }
    }

    #[test]
    fn leaves_escaped_names_and_deep_nesting_to_serde() {
        let escaped = r#"{"k\u0065y":1}"#;
        assert!(object(escaped).is_none() && serde_members(escaped).is_some());
        let deep = format!(
            r#"{{"a":{}{}}}"#,
            "[".repeat(MAX_DEPTH + 1),
            "]".repeat(MAX_DEPTH + 1)
        );
        assert!(object(&deep).is_none() && serde_members(&deep).is_some());
        let fits = format!(
            r#"{{"a":{}{}}}"#,
            "[".repeat(MAX_DEPTH - 1),
            "]".repeat(MAX_DEPTH - 1)
        );
        agree(&fits);
        assert!(object(&fits).is_some());
    }

    #[test]
    fn integer_lists_agree_with_serde_at_every_byte() {
        let ids: Vec<String> = (0..40)
            .map(|i| (1000 + i * 37 % 9000).to_string())
            .collect();
        let base = format!(r#"{{"ids":[{}],"n":1}}"#, ids.join(","));
        let (open, close) = (base.find('[').unwrap() + 1, base.find(']').unwrap());
        // The integers take the eight-byte path; with a space they are left to the loop.
        assert!(integer_list(base.as_bytes(), open).is_some());
        assert!(object(&base).is_some());
        agree(&base);
        for at in open..=close {
            for byte in [
                b',', b'0', b'9', b' ', b'-', b'.', b'e', b'a', b'"', b'[', b']', b'}',
            ] {
                let mut mutated = base.clone().into_bytes();
                mutated[at] = byte;
                agree(std::str::from_utf8(&mutated).unwrap());
            }
            for insert in ["0", ",0", "00", ",", "é", "\u{7f}", "1.5", "-0"] {
                let mut mutated = base.clone();
                mutated.insert_str(at, insert);
                agree(&mutated);
            }
        }
        // Short lists, one by one.
        for list in [
            "0",
            "7",
            "0,0",
            "10,0",
            "1,",
            ",1",
            "01",
            "1,01",
            "1,,2",
            "12,345,6789",
        ] {
            agree(&format!(r#"{{"ids":[{list}]}}"#));
        }
        assert!(object(r#"{"ids":[0,10,200]}"#).is_some());
    }

    #[test]
    fn every_cut_of_an_answer_agrees_with_serde() {
        let answer = r#"{"id":"cmpl-1","choices":[{"index":0,"text":"x\n","logprobs":null}],
            "usage":{"prompt_tokens":12,"total_tokens":13},"kv_transfer_params":{
            "do_remote_prefill":true,"remote_block_ids":[1000,1001,1002],"remote_port":5600,
            "x":-1.25e+2}}"#;
        for cut in 0..=answer.len() {
            if answer.is_char_boundary(cut) {
                agree(&answer[..cut]);
            }
        }
        for at in 0..answer.len() {
            for byte in [b'"', b',', b']', b'}', b'0', b' ', b'-', b'e', b'\\'] {
                let mut mutated = answer.as_bytes().to_vec();
                mutated[at] = byte;
                if let Ok(text) = std::str::from_utf8(&mutated) {
                    agree(text);
                }
            }
        }
    }
}
