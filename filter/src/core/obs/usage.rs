//! Completion tokens of a streamed response, from its `usage` chunk
//! (`stream_options.include_usage`), found without parsing every event as JSON: the request
//! path only looks for one key in each chunk.

const KEY: &[u8] = b"\"completion_tokens\"";

/// The last `"completion_tokens": N` in `chunk`, if any. A key split across two chunks is
/// missed; the usage chunk is one small event, which engines write in one piece.
pub fn completion_tokens(chunk: &[u8]) -> Option<u64> {
    let mut found = None;
    let mut rest = chunk;
    while let Some(at) = find(rest, KEY) {
        let after = &rest[at + KEY.len()..];
        let value = after
            .iter()
            .position(|b| !matches!(b, b' ' | b'\t' | b':'))
            .map(|start| &after[start..])
            .unwrap_or(&[]);
        let digits = value.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits > 0 {
            found = std::str::from_utf8(&value[..digits])
                .ok()
                .and_then(|s| s.parse().ok())
                .or(found);
        }
        rest = after;
    }
    found
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_usage_chunk() {
        let chunk = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\": 7,\"total_tokens\":19}}\n\ndata: [DONE]\n\n";
        assert_eq!(completion_tokens(chunk), Some(7));
        assert_eq!(
            completion_tokens(b"data: {\"choices\":[{\"delta\":{}}]}\n\n"),
            None
        );
        assert_eq!(completion_tokens(b"\"completion_tokens\":null"), None);
        assert_eq!(
            completion_tokens(b"\"completion_tokens\":1 ... \"completion_tokens\":3"),
            Some(3)
        );
    }
}
