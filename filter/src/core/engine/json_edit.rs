//! Byte-preserving edits of a JSON object's top-level members, for engines whose legs must
//! forward the client's body as sent (SGLang: tool schemas, number formatting and key order
//! stay exactly as the client wrote them). Only the edited members change; every other
//! member's bytes are copied.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum JsonEditError {
    #[error("request body is not valid JSON")]
    Invalid,
    #[error("request body is not a JSON object")]
    NotObject,
}

/// One top-level member: its unescaped key and the raw bytes of the whole member
/// (`"key": value`, from the key's opening quote to the value's last byte).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member<'a> {
    pub key: String,
    pub raw: &'a [u8],
    /// The raw bytes of the value alone.
    pub value: &'a [u8],
    key_raw: &'a [u8],
}

/// The top-level members of `raw`, in order, duplicates included.
pub fn members(raw: &[u8]) -> Result<Vec<Member<'_>>, JsonEditError> {
    let value: serde_json::Value =
        serde_json::from_slice(raw).map_err(|_| JsonEditError::Invalid)?;
    if !value.is_object() {
        return Err(JsonEditError::NotObject);
    }
    let mut s = Scanner { b: raw, i: 0 };
    let mut out = Vec::new();
    s.ws();
    s.expect(b'{')?;
    loop {
        s.ws();
        if s.peek() == Some(b'}') {
            break;
        }
        let key_start = s.i;
        s.string()?;
        let key_raw = &raw[key_start..s.i];
        let key: String = serde_json::from_slice(key_raw).map_err(|_| JsonEditError::Invalid)?;
        s.ws();
        s.expect(b':')?;
        s.ws();
        let value_start = s.i;
        s.value()?;
        out.push(Member {
            key,
            raw: &raw[key_start..s.i],
            value: &raw[value_start..s.i],
            key_raw,
        });
        s.ws();
        match s.peek() {
            Some(b',') => s.i += 1,
            Some(b'}') => break,
            _ => return Err(JsonEditError::Invalid),
        }
    }
    Ok(out)
}

/// Rebuilds the object: members named in `remove` are dropped, members named in `set` get
/// the new raw value (the first occurrence; the caller refuses duplicates of the keys it
/// edits), keys of `set` that were absent are appended in order, everything else is copied.
pub fn rewrite(members: &[Member<'_>], set: &[(&str, &[u8])], remove: &[&str]) -> Vec<u8> {
    let len: usize = members.iter().map(|m| m.raw.len() + 1).sum::<usize>()
        + set
            .iter()
            .map(|(k, v)| k.len() + v.len() + 4)
            .sum::<usize>()
        + 2;
    let mut out = Vec::with_capacity(len);
    out.push(b'{');
    let mut first = true;
    let mut done: Vec<&str> = Vec::with_capacity(set.len());
    let mut sep = |out: &mut Vec<u8>| {
        if !first {
            out.push(b',');
        }
        first = false;
    };
    for m in members {
        if remove.contains(&m.key.as_str()) {
            continue;
        }
        match set.iter().find(|(k, _)| *k == m.key) {
            Some((k, v)) if !done.contains(k) => {
                sep(&mut out);
                out.extend_from_slice(m.key_raw);
                out.push(b':');
                out.extend_from_slice(v);
                done.push(k);
            }
            Some(_) => {} // a duplicate of an edited key: the edited value stands alone
            None => {
                sep(&mut out);
                out.extend_from_slice(m.raw);
            }
        }
    }
    for (k, v) in set {
        if done.contains(k) {
            continue;
        }
        sep(&mut out);
        out.extend_from_slice(
            serde_json::Value::String((*k).to_string())
                .to_string()
                .as_bytes(),
        );
        out.push(b':');
        out.extend_from_slice(v);
    }
    out.push(b'}');
    out
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scanner<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), JsonEditError> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            Err(JsonEditError::Invalid)
        }
    }

    fn string(&mut self) -> Result<(), JsonEditError> {
        self.expect(b'"')?;
        loop {
            match self.peek() {
                Some(b'"') => {
                    self.i += 1;
                    return Ok(());
                }
                Some(b'\\') => self.i += 2,
                Some(_) => self.i += 1,
                None => return Err(JsonEditError::Invalid),
            }
        }
    }

    fn value(&mut self) -> Result<(), JsonEditError> {
        match self.peek() {
            Some(b'"') => self.string(),
            Some(b'{' | b'[') => {
                let mut depth = 0usize;
                loop {
                    match self.peek() {
                        Some(b'"') => self.string()?,
                        Some(b'{' | b'[') => {
                            depth += 1;
                            self.i += 1;
                        }
                        Some(b'}' | b']') => {
                            depth = depth.saturating_sub(1);
                            self.i += 1;
                            if depth == 0 {
                                return Ok(());
                            }
                        }
                        Some(_) => self.i += 1,
                        None => return Err(JsonEditError::Invalid),
                    }
                }
            }
            Some(_) => {
                while !matches!(
                    self.peek(),
                    None | Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
                ) {
                    self.i += 1;
                }
                Ok(())
            }
            None => Err(JsonEditError::Invalid),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_keep_their_bytes_and_duplicates() {
        let raw = br#" { "a" : 1.50 , "t\"k":{"x":[1,"]}"]}, "a":true,"s":"v,}" } "#;
        let m = members(raw).unwrap();
        let keys: Vec<&str> = m.iter().map(|m| m.key.as_str()).collect();
        assert_eq!(keys, ["a", "t\"k", "a", "s"]);
        assert_eq!(m[0].value, b"1.50");
        assert_eq!(m[1].value, br#"{"x":[1,"]}"]}"#);
        assert_eq!(m[3].raw, br#""s":"v,}""#);
    }

    #[test]
    fn rewrite_sets_appends_and_removes() {
        let raw = br#"{"model":"m","stream":true,"tools":[{"f":1.0e3}],"min_tokens":2}"#;
        let m = members(raw).unwrap();
        let out = rewrite(
            &m,
            &[("stream", b"false"), ("room", b"9223372036854775806")],
            &["min_tokens"],
        );
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"model":"m","stream":false,"tools":[{"f":1.0e3}],"room":9223372036854775806}"#
        );
        assert_eq!(rewrite(&members(b"{}").unwrap(), &[], &[]), b"{}");
    }

    #[test]
    fn refuses_what_is_not_an_object() {
        assert_eq!(members(b"[1]").unwrap_err(), JsonEditError::NotObject);
        assert_eq!(members(b"{\"a\":").unwrap_err(), JsonEditError::Invalid);
    }
}
