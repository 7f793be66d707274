//! Generated tokens of a streamed response, from its usage event (OpenAI's
//! `stream_options.include_usage` chunk, Anthropic's `message_delta`), found without parsing
//! every event as JSON: the request path only looks for one key in each chunk.

/// The last `"<key>": N` in `chunk`, if any, where `key` is the quoted name the endpoint's
/// usage gives the generated tokens (`Endpoint::usage_output_key`). A key or number cut
/// between two chunks is read by [`Seam`], which a body scanned chunk by chunk goes through.
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

/// Bytes kept from the end of the last chunk: enough for a quoted key, its colon and a
/// 20-digit number that started there.
const TAIL: usize = 48;
/// Bytes of the next chunk read together with the tail: where such a key or number ends.
const HEAD: usize = 64;

/// Where one response chunk meets the next. The engine writes its usage event in one
/// piece, but Envoy hands the body on as its reads return it, so the event can arrive cut
/// in two. Each chunk is scanned as it stands and, only when it holds no value of its own,
/// so is the seam (the last chunk's tail and this chunk's head) in a fixed buffer: no copy
/// of the chunk and no allocation per chunk, on a path every streamed chunk takes.
#[derive(Debug)]
pub struct Seam {
    tail: [u8; TAIL],
    len: usize,
}

impl Default for Seam {
    fn default() -> Self {
        Seam {
            tail: [0; TAIL],
            len: 0,
        }
    }
}

impl Seam {
    /// The last value of `key` in `chunk` or, failing that, one cut between the previous
    /// chunk and this one. Call [`Seam::keep`] after every key of the chunk is read.
    pub fn read(&self, chunk: &[u8], key: &[u8]) -> Option<u64> {
        generated_tokens(chunk, key).or_else(|| {
            if self.len == 0 {
                return None;
            }
            let mut seam = [0u8; TAIL + HEAD];
            let head = chunk.len().min(HEAD);
            seam[..self.len].copy_from_slice(&self.tail[..self.len]);
            seam[self.len..self.len + head].copy_from_slice(&chunk[..head]);
            generated_tokens(&seam[..self.len + head], key)
        })
    }

    /// Keeps the end of what has been read so far, for the next chunk's seam.
    pub fn keep(&mut self, chunk: &[u8]) {
        if chunk.len() >= TAIL {
            self.tail.copy_from_slice(&chunk[chunk.len() - TAIL..]);
            self.len = TAIL;
            return;
        }
        let old = (TAIL - chunk.len()).min(self.len);
        self.tail.copy_within(self.len - old..self.len, 0);
        self.tail[old..old + chunk.len()].copy_from_slice(chunk);
        self.len = old + chunk.len();
    }
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

    /// A stream read chunk by chunk through a seam; the last value found wins.
    fn streamed(chunks: &[&[u8]], key: &[u8]) -> Option<u64> {
        let mut seam = Seam::default();
        let mut found = None;
        for chunk in chunks {
            found = seam.read(chunk, key).or(found);
            seam.keep(chunk);
        }
        found
    }

    #[test]
    fn a_usage_event_cut_anywhere_is_read_whole() {
        let stream: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\": 12345678901234,\"total_tokens\":12345678901246}}\n\ndata: [DONE]\n\n";
        assert_eq!(completion_tokens(stream), Some(12_345_678_901_234));
        for cut in 1..stream.len() {
            let (a, b) = stream.split_at(cut);
            assert_eq!(
                streamed(&[a, b], KEY),
                Some(12_345_678_901_234),
                "cut at {cut}"
            );
        }
        // Cut into many small pieces, so the seam's tail is built from several chunks.
        for size in 1..24 {
            let pieces: Vec<&[u8]> = stream.chunks(size).collect();
            assert_eq!(
                streamed(&pieces, KEY),
                Some(12_345_678_901_234),
                "pieces of {size}"
            );
        }
    }

    #[test]
    fn a_later_value_supersedes_one_read_at_the_seam() {
        let first: &[u8] = b"{\"usage\":{\"completion_tokens\":4";
        let second: &[u8] = b"2}} {\"usage\":{\"completion_tokens\":50}}";
        assert_eq!(streamed(&[first, second], KEY), Some(50));
        assert_eq!(streamed(&[first, b"2}}"], KEY), Some(42));
        assert_eq!(streamed(&[first, b"", b"7}}"], KEY), Some(47));
        assert_eq!(streamed(&[b"no usage here", b" nor here"], KEY), None);
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
