//! The prefix-cache work of one request with the default `character` tokenizer and 4-byte
//! blocks: hashing the prompt, the lookup, the local insert, and the broadcast event that
//! the other workers decode and insert again. Run: `cargo bench -p pd-router-filter --bench prefix`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pd_router_filter::core::prefix::{block_hashes, PrefixEvent, PrefixIndex};

fn prompt(bytes: usize, salt: usize) -> Vec<u8> {
    let mut s = format!("request {salt}: ").into_bytes();
    while s.len() < bytes {
        s.extend_from_slice(b"the quick brown fox jumps over the lazy dog. ");
    }
    s.truncate(bytes);
    s
}

fn prefix(c: &mut Criterion) {
    let mut group = c.benchmark_group("prefix");
    for bytes in [2_048usize, 32_768] {
        let stream = prompt(bytes, 0);
        group.bench_function(BenchmarkId::new("block_hashes", bytes), |b| {
            b.iter(|| block_hashes(&stream, 4, 7))
        });
        // A full index (the default 200 000 blocks), as after some traffic: every new block
        // evicts the least recent one, the steady state.
        let mut index = PrefixIndex::new(200_000);
        for salt in 1..(200_000 / (bytes / 4) + 2) {
            index.add_prefix(&block_hashes(&prompt(bytes, salt), 4, 7), "m", "ns/p0", 0);
        }
        let pods = ["ns/p0", "ns/p1"];
        let mut salt = 1_000;
        group.bench_function(BenchmarkId::new("match_then_add_new_prompt", bytes), |b| {
            b.iter(|| {
                salt += 1;
                let hashes = block_hashes(&prompt(bytes, salt), 4, 7);
                let found = index.match_prefix(&hashes, "m", &pods);
                index.add_prefix(&hashes, "m", "ns/p1", salt as u64);
                found
            })
        });
        let hashes = block_hashes(&stream, 4, 7);
        let event = PrefixEvent {
            model: "m".into(),
            pod: "ns/p1".into(),
            hashes,
            at_ms: 1,
        };
        group.bench_function(BenchmarkId::new("event_encode_decode", bytes), |b| {
            b.iter(|| PrefixEvent::decode(&event.encode()))
        });
    }
    group.finish();
}

criterion_group!(benches, prefix);
criterion_main!(benches);
