//! A header map as the host serializes it for `proxy_get_header_map_pairs` (Proxy-Wasm ABI
//! 0.2.1), read in place: a little-endian `u32` count, then a `u32` name length and a `u32`
//! value length per pair, then each name and each value followed by a NUL byte.
//!
//! The SDK's reader copies every name and value into an allocation of its own (two per
//! header, about two dozen per request) before the filter keeps the few it needs
//! (`core::inbound`); these borrowed pairs cost none. For any buffer the SDK reads, they are
//! its pairs in its order, with one difference: a name that is not UTF-8 (which Envoy, whose
//! header names are RFC 9110 tokens, never passes) is skipped, where the SDK's reader panics.
//! A buffer the SDK would index out of bounds is refused whole, never read halfway.

/// The buffer is not a serialized header map: too short for its count, or for the names and
/// values its lengths announce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

/// The pairs of serialized header map `buf`, borrowed from it, once every name and value is
/// known to lie inside it. An empty buffer is an empty map, as with the SDK. The NUL after
/// each name and value is skipped, not checked, as the SDK does (so the last one may be
/// missing), and bytes past the last value are ignored.
pub fn pairs(buf: &[u8]) -> Result<Pairs<'_>, Malformed> {
    if buf.is_empty() {
        return Ok(Pairs {
            sizes: buf.chunks_exact(8),
            data: buf,
            at: 0,
        });
    }
    let (count, rest) = buf.split_first_chunk::<4>().ok_or(Malformed)?;
    let table = (u32::from_le_bytes(*count) as usize)
        .checked_mul(8)
        .filter(|&len| len <= rest.len())
        .ok_or(Malformed)?;
    let (table, data) = rest.split_at(table);
    // Every name and value and the byte after each, but the last one's, within `data`.
    let needed = table.chunks_exact(8).fold(0u64, |sum, s| {
        sum.saturating_add(u64::from(le_u32(s, 0)) + u64::from(le_u32(s, 4)) + 2)
    });
    if needed.saturating_sub(1) > data.len() as u64 {
        return Err(Malformed);
    }
    Ok(Pairs {
        sizes: table.chunks_exact(8),
        data,
        at: 0,
    })
}

/// The pairs of a checked buffer (see [`pairs`]), in the host's order.
#[derive(Debug, Clone)]
pub struct Pairs<'a> {
    /// (name length, value length) per pair still to read.
    sizes: std::slice::ChunksExact<'a, u8>,
    /// The names and values, each followed by its NUL.
    data: &'a [u8],
    /// Where the next name starts in `data`.
    at: usize,
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (&'a str, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let sizes = self.sizes.next()?;
            // `pairs` checked the lengths; `take` checks again rather than index.
            let name = self.take(le_u32(sizes, 0))?;
            let value = self.take(le_u32(sizes, 4))?;
            if let Ok(name) = std::str::from_utf8(name) {
                return Some((name, value));
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.sizes.len()))
    }
}

impl<'a> Pairs<'a> {
    /// The next `len` bytes, and the NUL after them skipped.
    fn take(&mut self, len: u32) -> Option<&'a [u8]> {
        let end = self.at.checked_add(len as usize)?;
        let bytes = self.data.get(self.at..end)?;
        self.at = end.saturating_add(1);
        Some(bytes)
    }
}

/// The little-endian `u32` at `at` in an 8-byte size entry.
fn le_u32(entry: &[u8], at: usize) -> u32 {
    let mut word = [0; 4];
    if let Some(bytes) = entry.get(at..at + 4) {
        word.copy_from_slice(bytes);
    }
    u32::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The host's serialization (Envoy's, and the SDK's `serialize_map_bytes`).
    fn serialize(map: &[(&[u8], &[u8])]) -> Vec<u8> {
        let mut out = (map.len() as u32).to_le_bytes().to_vec();
        for (name, value) in map {
            out.extend_from_slice(&(name.len() as u32).to_le_bytes());
            out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        }
        for (name, value) in map {
            out.extend_from_slice(name);
            out.push(0);
            out.extend_from_slice(value);
            out.push(0);
        }
        out
    }

    /// The SDK's reader (proxy-wasm 0.2.5 `deserialize_map_bytes`), line for line, as the
    /// reference for the buffers it reads: `None` where it panics (an index out of bounds, a
    /// name that is not UTF-8, a count past what it can allocate), so that the comparison also
    /// runs where a panic aborts (wasm). Its sums are checked: where they would wrap (32-bit
    /// `usize`), the SDK's allocation or indexing panics.
    fn sdk(bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
        if bytes.is_empty() {
            return Some(Vec::new());
        }
        let size = u32::from_le_bytes(<[u8; 4]>::try_from(bytes.get(0..4)?).ok()?) as usize;
        let mut map = Vec::new();
        let mut p = size.checked_mul(8)?.checked_add(4)?;
        for n in 0..size {
            let s = 4 + n * 8;
            let size = u32::from_le_bytes(<[u8; 4]>::try_from(bytes.get(s..s + 4)?).ok()?) as usize;
            let key = bytes.get(p..p.checked_add(size)?)?.to_vec();
            p += size + 1;
            let size =
                u32::from_le_bytes(<[u8; 4]>::try_from(bytes.get(s + 4..s + 8)?).ok()?) as usize;
            let value = bytes.get(p..p.checked_add(size)?)?.to_vec();
            p += size + 1;
            map.push((String::from_utf8(key).ok()?, value));
        }
        Some(map)
    }

    fn read(buf: &[u8]) -> Result<Vec<(String, Vec<u8>)>, Malformed> {
        Ok(pairs(buf)?
            .map(|(n, v)| (n.to_string(), v.to_vec()))
            .collect())
    }

    const HEADERS: &[(&[u8], &[u8])] = &[
        (b":method", b"POST"),
        (b":path", b"/v1/chat/completions"),
        (b":authority", b"gateway"),
        (b"content-length", b""),
        (b"x-empty", b""),
        (b"routing-strategy", b"pd\xff"),
        (b"user", b"alice"),
    ];

    #[test]
    fn pairs_round_trip_in_the_hosts_order() {
        let buf = serialize(HEADERS);
        let got = read(&buf).unwrap();
        let want: Vec<(String, Vec<u8>)> = HEADERS
            .iter()
            .map(|(n, v)| (String::from_utf8(n.to_vec()).unwrap(), v.to_vec()))
            .collect();
        assert_eq!(got, want);
        assert_eq!(Some(got), sdk(&buf));
    }

    #[test]
    fn an_empty_buffer_or_count_is_an_empty_map() {
        assert_eq!(read(&[]), Ok(vec![]));
        assert_eq!(read(&[0, 0, 0, 0]), Ok(vec![]));
        assert_eq!(
            read(&[0, 0, 0, 0, 7, 7]),
            Ok(vec![]),
            "trailing bytes ignored"
        );
    }

    #[test]
    fn a_truncated_buffer_is_refused_never_read_halfway() {
        let buf = serialize(HEADERS);
        for len in 1..buf.len() - 1 {
            assert_eq!(read(&buf[..len]), Err(Malformed), "cut at {len}");
        }
        // Only the last NUL missing: the SDK reads it, and so does this.
        let short = &buf[..buf.len() - 1];
        assert_eq!(Some(read(short).unwrap()), sdk(short));
    }

    #[test]
    fn garbled_lengths_are_refused() {
        let mut buf = serialize(HEADERS);
        buf[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(read(&buf), Err(Malformed), "count past the buffer");
        let mut buf = serialize(HEADERS);
        buf[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(read(&buf), Err(Malformed), "value length past the buffer");
        let mut buf = serialize(HEADERS);
        let len = buf.len() as u32;
        buf[4..8].copy_from_slice(&len.to_le_bytes());
        assert_eq!(read(&buf), Err(Malformed), "name length past the buffer");
    }

    #[test]
    fn a_name_that_is_not_utf8_is_skipped() {
        let buf = serialize(&[(b"a\xffb", b"x"), (b":path", b"/v1/completions")]);
        assert_eq!(
            read(&buf).unwrap(),
            vec![(":path".to_string(), b"/v1/completions".to_vec())]
        );
    }

    proptest! {
        #[test]
        fn any_map_round_trips(
            map in proptest::collection::vec(
                ("[a-z:-]{0,12}", proptest::collection::vec(any::<u8>(), 0..20)),
                0..12,
            )
        ) {
            let map: Vec<(&[u8], &[u8])> =
                map.iter().map(|(n, v)| (n.as_bytes(), v.as_slice())).collect();
            let buf = serialize(&map);
            prop_assert_eq!(Some(read(&buf).unwrap()), sdk(&buf));
        }

        #[test]
        fn any_bytes_read_as_the_sdk_or_are_refused(
            bytes in proptest::collection::vec(any::<u8>(), 0..64),
            small in proptest::collection::vec((0u32..6, 0u32..6), 0..4),
            tail in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            // Random bytes, and a plausible table over random data.
            let mut plausible = (small.len() as u32).to_le_bytes().to_vec();
            for (n, v) in &small {
                plausible.extend_from_slice(&n.to_le_bytes());
                plausible.extend_from_slice(&v.to_le_bytes());
            }
            plausible.extend_from_slice(&tail);
            for buf in [&bytes, &plausible] {
                match (read(buf), sdk(buf)) {
                    (Ok(got), Some(want)) => prop_assert_eq!(got, want),
                    (Err(Malformed), None) => {}
                    // Names that are not UTF-8: the SDK panics, these are skipped.
                    (Ok(got), None) => prop_assert!(
                        pairs(buf).unwrap().sizes.len() > got.len(),
                        "read what the SDK refused: {:?}", buf
                    ),
                    (Err(Malformed), Some(want)) => {
                        prop_assert!(false, "refused what the SDK reads: {:?} {:?}", buf, want)
                    }
                }
            }
        }
    }
}
