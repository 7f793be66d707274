//! Generated tokens of a streamed response, from its usage event (OpenAI's
//! `stream_options.include_usage` chunk, Anthropic's `message_delta`), found without parsing
//! every event as JSON: the request path only looks for one key in each chunk.

/// The last `"<key>": N` in `chunk`, if any, where `key` is the quoted name the endpoint's
/// usage gives the generated tokens (`Endpoint::usage_output_key`). A key split across two
/// chunks is missed; the usage event is one small event, which engines write in one piece.
pub fn generated_tokens(chunk: &[u8], key: &[u8]) -> Option<u64> {
    let mut found = None;
    let mut rest = chunk;
    while let Some(at) = find(rest, key) {
        let after = &rest[at + key.len()..];
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

    const KEY: &[u8] = b"\"completion_tokens\"";

    fn completion_tokens(chunk: &[u8]) -> Option<u64> {
        generated_tokens(chunk, KEY)
    }

    #[test]
    fn reads_anthropic_message_delta_after_message_start() {
        let key = crate::core::request::Endpoint::Messages.usage_output_key();
        let start = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":9,\"output_tokens\":0}}}\n\n";
        assert_eq!(generated_tokens(start, key), Some(0));
        let end = b"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"input_tokens\":9,\"output_tokens\":16}}\n\n";
        assert_eq!(generated_tokens(end, key), Some(16));
        // OpenAI's key is not Anthropic's.
        assert_eq!(completion_tokens(end), None);
    }

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
