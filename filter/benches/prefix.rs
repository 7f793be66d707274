//! The prefix-cache work of one request with the default `character` tokenizer and 4-byte
//! blocks: the lookup, the local insert, and the broadcast event that the other workers
//! decode and insert again. Run: `cargo bench -p pd-router-filter --bench prefix`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pd_router_filter::core::prefix::{EventBatch, PrefixEvent, PrefixIndex};

/// `bytes` of text; prompts with different salts differ from their 9th byte on.
fn prompt(bytes: usize, salt: usize) -> Vec<u8> {
    let mut s = format!("request {salt}: ").into_bytes();
    while s.len() < bytes {
        s.extend_from_slice(b"the quick brown fox jumps over the lazy dog. ");
    }
    s.truncate(bytes);
    s
}

/// A shared document of `bytes` followed by a question of its own: a RAG prompt.
fn rag(bytes: usize, salt: usize) -> Vec<u8> {
    let mut s = prompt(bytes, 0);
    s.extend_from_slice(format!("question {salt}: what does it say?").as_bytes());
    s
}

fn prefix(c: &mut Criterion) {
    let mut group = c.benchmark_group("prefix");
    for bytes in [2_048usize, 32_768, 262_144] {
        // A full index (the default 200 000 blocks), as after some traffic: every new block
        // evicts the least recent one, the steady state.
        let mut index = PrefixIndex::new(200_000, 4);
        for salt in 1..(200_000 / (bytes / 4) + 2) {
            index.add_prefix(&prompt(bytes, salt), "m", "ns/p0", 0);
        }
        let pods = ["ns/p0", "ns/p1"];
        let mut salt = 1_000_000;
        group.bench_function(BenchmarkId::new("match_then_add_new_prompt", bytes), |b| {
            b.iter(|| {
                salt += 1;
                let stream = prompt(bytes, salt);
                let found = index.match_prefix(&stream, "m", &pods);
                index.add_prefix(&stream, "m", "ns/p1", salt as u64);
                found
            })
        });
        group.bench_function(BenchmarkId::new("match_then_add_rag_prompt", bytes), |b| {
            b.iter(|| {
                salt += 1;
                let stream = rag(bytes, salt);
                let found = index.match_prefix(&stream, "m", &pods);
                index.add_prefix(&stream, "m", "ns/p1", salt as u64);
                found
            })
        });
        let event = PrefixEvent {
            model: "m".into(),
            pod: "ns/p1".into(),
            stream: prompt(bytes, 0),
            at_ms: 1,
        };
        // What a selection and a receiving worker do with an event: push it into the batch,
        // read it back from the message (borrowed).
        group.bench_function(BenchmarkId::new("event_batch_round_trip", bytes), |b| {
            b.iter(|| {
                let mut batch = EventBatch::default();
                batch.push(event.as_ref());
                let message = batch.take();
                EventBatch::events(&message)
                    .map(|e| e.map(|e| e.stream.len()).unwrap_or(0))
                    .sum::<usize>()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, prefix);
criterion_main!(benches);
