//! The optional shared token on the snapshot API. The snapshot names every pod, its address
//! and its load, and the replica report feeds routing decisions, so an operator who cannot
//! keep the listener on loopback or behind a NetworkPolicy can require a bearer token that
//! only the gateways hold.

use std::path::{Path, PathBuf};

use axum::http::HeaderValue;
use subtle::ConstantTimeEq;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TokenError {
    #[error("cannot read the snapshot token file {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("the snapshot token file {0} is empty")]
    Empty(PathBuf),
    #[error(
        "the snapshot token in {0} must be visible ASCII without spaces (it travels in a header)"
    )]
    Charset(PathBuf),
}

/// The expected `authorization` header value, `Bearer <token>`.
#[derive(Clone)]
pub struct SnapshotToken {
    expected: Vec<u8>,
}

impl std::fmt::Debug for SnapshotToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SnapshotToken(..)")
    }
}

impl SnapshotToken {
    /// Reads the token from `path`; surrounding whitespace (a trailing newline from `echo`,
    /// a Secret mounted as a file) is ignored.
    pub fn from_file(path: &Path) -> Result<SnapshotToken, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|e| TokenError::Read {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        SnapshotToken::parse(&text).map_err(|e| match e {
            ParseError::Empty => TokenError::Empty(path.to_path_buf()),
            ParseError::Charset => TokenError::Charset(path.to_path_buf()),
        })
    }

    fn parse(text: &str) -> Result<SnapshotToken, ParseError> {
        let token = text.trim();
        if token.is_empty() {
            return Err(ParseError::Empty);
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ParseError::Charset);
        }
        Ok(SnapshotToken {
            expected: format!("Bearer {token}").into_bytes(),
        })
    }

    /// Whether the request's `authorization` header carries the token. The comparison takes
    /// the same time wherever the first differing byte is, so response times do not reveal
    /// how much of a guess was right (only a length mismatch returns early, and the length
    /// is no secret worth guarding).
    pub fn authorizes(&self, header: Option<&HeaderValue>) -> bool {
        header.is_some_and(|value| bool::from(value.as_bytes().ct_eq(&self.expected)))
    }
}

#[derive(Debug)]
enum ParseError {
    Empty,
    Charset,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(text: &str) -> SnapshotToken {
        SnapshotToken::parse(text).unwrap()
    }

    fn header(value: &str) -> HeaderValue {
        HeaderValue::from_str(value).unwrap()
    }

    #[test]
    fn only_the_exact_bearer_value_is_accepted() {
        let t = token("s3cr3t\n");
        assert!(t.authorizes(Some(&header("Bearer s3cr3t"))));
        for wrong in [
            "Bearer s3cr3",
            "Bearer s3cr3t ",
            "Bearer s3cr3T",
            "bearer s3cr3t",
            "s3cr3t",
            "Basic s3cr3t",
            "Bearer",
            "",
        ] {
            assert!(!t.authorizes(Some(&header(wrong))), "{wrong:?}");
        }
        assert!(!t.authorizes(None));
    }

    #[test]
    fn empty_and_unprintable_tokens_are_refused() {
        assert!(matches!(
            SnapshotToken::parse(" \n"),
            Err(ParseError::Empty)
        ));
        assert!(matches!(
            SnapshotToken::parse("a b"),
            Err(ParseError::Charset)
        ));
        assert!(matches!(
            SnapshotToken::parse("caf\u{e9}"),
            Err(ParseError::Charset)
        ));
    }

    #[test]
    fn the_file_is_read_and_errors_name_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "abc\n").unwrap();
        assert!(SnapshotToken::from_file(&path)
            .unwrap()
            .authorizes(Some(&header("Bearer abc"))));
        std::fs::write(&path, "\n").unwrap();
        assert_eq!(
            SnapshotToken::from_file(&path).unwrap_err(),
            TokenError::Empty(path.clone())
        );
        let missing = dir.path().join("missing");
        assert!(matches!(
            SnapshotToken::from_file(&missing),
            Err(TokenError::Read { path, .. }) if path == missing
        ));
        assert!(
            !format!("{:?}", token("abc")).contains("abc"),
            "Debug must not print the token"
        );
    }
}
