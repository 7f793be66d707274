//! The SSE chunk scan that finds a stream's final usage, for each endpoint's key; the per-user
//! token scan of an answer (`UsageScan`), fed the input cut in two at its first byte's
//! position, as a body arrives in chunks; the streamed scan's seam over small chunks; and
//! pd-control's admission answer as the filter reads it (`judge`): none may panic on
//! whatever an engine or a proxy sends.
//!
//! And what the seam promises (`core::obs::usage`: a key or number cut between two chunks is
//! read): a stream whose one usage value (`"<key>"`, up to 9 bytes of ` `, tab and `:`, the
//! number, at most 48 bytes: the seam's tail) sits among bytes holding no quote, read in
//! chunks of any size, yields the value the whole stream does: the number itself. Not for
//! any input: a value spread over more than the seam's window (a long run of separators, a
//! number past a `u64`'s 20 digits) and cut between chunks is missed, or read as its first
//! digits.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pd_router_filter::core::obs::usage::{generated_tokens, Seam};
use pd_router_filter::core::request::Endpoint;
use pd_router_filter::core::user_limits::{judge, Ask, UsageScan};

fuzz_target!(|data: &[u8]| {
    for endpoint in [Endpoint::ChatCompletions, Endpoint::Messages] {
        let _ = generated_tokens(data, endpoint.usage_output_key());
    }
    let cut = data.first().map_or(0, |b| usize::from(*b)).min(data.len());
    let mut scan = UsageScan::default();
    scan.feed(&data[..cut]);
    scan.feed(&data[cut..]);
    let _ = scan.tokens();
    // The same input as a stream of small chunks of every size the first byte names, through
    // the seam the response path reads each chunk with.
    let size = cut % 61 + 1;
    let mut seam = Seam::default();
    for chunk in data.chunks(size) {
        let _ = seam.read(chunk, Endpoint::ChatCompletions.usage_output_key());
        seam.keep(chunk);
    }
    seam_reads_a_cut_value_whole(data, size);
    let ask = Ask {
        user: Some("fuzz".into()),
        model: "m".into(),
        rps: Some(0.5),
        id: "0123456789abcdef0123456789abcdef".into(),
    };
    let _ = judge(&ask, "200", data);
});

/// Builds, from `data`, a stream holding one usage value among bytes without a quote (so no
/// other key), reads it whole and in chunks of `size`, and checks both give the value.
fn seam_reads_a_cut_value_whole(data: &[u8], size: usize) {
    let Some((&[seps, at, n0, n1, n2, n3, n4, n5, n6, n7], rest)) = data.split_first_chunk()
    else {
        return;
    };
    let n = u64::from_le_bytes([n0, n1, n2, n3, n4, n5, n6, n7]);
    // Up to 9 separator bytes, each one of the three the scan skips, from the bits of `seps`.
    let separators: Vec<u8> = (0..usize::from(seps) % 10)
        .map(|i| [b' ', b'\t', b':'][usize::from(seps.rotate_left(i as u32)) % 3])
        .collect();
    let noise: Vec<u8> = rest.iter().copied().filter(|b| *b != b'"').collect();
    let split = usize::from(at).min(noise.len());
    for endpoint in [Endpoint::ChatCompletions, Endpoint::Messages] {
        let key = endpoint.usage_output_key();
        let mut stream = noise[..split].to_vec();
        stream.extend_from_slice(key);
        stream.extend_from_slice(&separators);
        stream.extend_from_slice(n.to_string().as_bytes());
        // A byte that is not a digit ends the number (the event's closing brace).
        stream.push(b'}');
        stream.extend_from_slice(&noise[split..]);
        assert_eq!(generated_tokens(&stream, key), Some(n), "whole");
        let mut seam = Seam::default();
        let mut found = None;
        for chunk in stream.chunks(size) {
            found = seam.read(chunk, key).or(found);
            seam.keep(chunk);
        }
        assert_eq!(found, Some(n), "in chunks of {size}: {stream:?}");
    }
}
