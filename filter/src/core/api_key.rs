//! The gateway's optional shared API key (`AIBRIX_AUTH_BEARER_TOKEN`), checked as AIBrix
//! checks it: when set, every request must carry `authorization: Bearer <key>` or is refused
//! with 401 before anything else about it is looked at.

use std::fmt;

use subtle::ConstantTimeEq;

/// The configured key. Its `Debug` never shows the value, so settings can be logged.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl ApiKey {
    /// The key from the variable's value: trimmed; unset or blank means no check.
    pub fn from_env(value: Option<&str>) -> Option<ApiKey> {
        let key = value?.trim();
        (!key.is_empty()).then(|| ApiKey(key.to_string()))
    }

    /// Whether a request with this `authorization` value may pass. The comparison takes the
    /// same time wherever the presented key first differs, so response timing does not
    /// reveal a key byte by byte (only whether its length matches).
    pub fn admits(&self, authorization: Option<&str>) -> bool {
        authorization
            .and_then(bearer_token)
            .is_some_and(|token| bool::from(token.as_bytes().ct_eq(self.0.as_bytes())))
    }
}

/// The token of `Bearer <token>`: the scheme in any case, one space after it, surrounding
/// whitespace ignored, an empty token refused (AIBrix's reading).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unset_or_blank_variable_turns_the_check_off() {
        assert_eq!(ApiKey::from_env(None), None);
        assert_eq!(ApiKey::from_env(Some("  ")), None);
        assert_eq!(
            ApiKey::from_env(Some(" s3cret \n")),
            Some(ApiKey("s3cret".into()))
        );
    }

    #[test]
    fn only_the_bearer_key_itself_passes() {
        let key = ApiKey::from_env(Some("s3cret")).unwrap();
        for ok in [
            "Bearer s3cret",
            "bearer s3cret",
            "BEARER  s3cret ",
            "  Bearer s3cret",
        ] {
            assert!(key.admits(Some(ok)), "{ok:?}");
        }
        for bad in [
            None,
            Some(""),
            Some("s3cret"),
            Some("Bearer"),
            Some("Bearer "),
            Some("Bearer s3cre"),
            Some("Bearer s3cret2"),
            Some("Bearer S3CRET"),
            Some("Basic s3cret"),
            Some("Bearer\ts3cret"),
            Some("Bearer s3 cret"),
        ] {
            assert!(!key.admits(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_key_never_shows_in_debug_output() {
        let key = ApiKey::from_env(Some("s3cret")).unwrap();
        assert!(!format!("{key:?}").contains("s3cret"));
    }
}
