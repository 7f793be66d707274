//! The body work of one PD request outside selection: parsing the client's JSON, vLLM's
//! prefill leg's body and decode body merged with the prefill's `kv_transfer_params`, and
//! SGLang's check and two legs, TRT-LLM's context leg and generation leg (from a context
//! answer carrying the prompt's token ids), all spliced from the raw body
//! (`core::json_object`).
//! Run: `cargo bench -p pd-router-filter --bench body`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pd_router_filter::core::config::KvConnector;
use pd_router_filter::core::engine::trtllm::{self, ScheduleStyle};
use pd_router_filter::core::engine::{sglang, vllm};
use pd_router_filter::core::request::{Endpoint, RoutingRequest};
#[path = "support/bodies.rs"]
mod bodies;
use bodies::{chat, prefill_answer, trt_context_answer};

fn body(c: &mut Criterion) {
    let mut group = c.benchmark_group("body");
    for bytes in [2_048usize, 32_768, 262_144] {
        let raw = chat(bytes);
        let answer = prefill_answer(bytes);
        group.bench_function(BenchmarkId::new("parse", bytes), |b| {
            b.iter(|| RoutingRequest::parse(Endpoint::ChatCompletions, &raw))
        });
        // The reference parse the one pass falls back to (what `parse` cost before it).
        group.bench_function(BenchmarkId::new("parse_two_pass", bytes), |b| {
            b.iter(|| RoutingRequest::parse_two_pass(Endpoint::ChatCompletions, &raw))
        });
        let req = RoutingRequest::parse(Endpoint::ChatCompletions, &raw).expect("valid body");
        group.bench_function(BenchmarkId::new("members", bytes), |b| {
            b.iter(|| {
                pd_router_filter::core::json_object::Members::parse(&raw)
                    .map(|m| m.get("model").is_some())
            })
        });
        group.bench_function(BenchmarkId::new("value", bytes), |b| {
            b.iter(|| serde_json::from_slice::<serde_json::Value>(&raw).map(|v| v.is_object()))
        });
        group.bench_function(BenchmarkId::new("answer_members", bytes), |b| {
            b.iter(|| {
                pd_router_filter::core::json_object::Members::parse(&answer)
                    .map(|m| m.get("model").is_some())
            })
        });
        group.bench_function(BenchmarkId::new("prefill_body", bytes), |b| {
            b.iter(|| vllm::prefill_body(&raw, &req.members, KvConnector::Shfs))
        });
        group.bench_function(BenchmarkId::new("decode_body", bytes), |b| {
            b.iter(|| vllm::decode_body(&raw, &req.members, &answer, "10.0.0.1", KvConnector::Shfs))
        });
        group.bench_function(BenchmarkId::new("decode_edit", bytes), |b| {
            b.iter(|| vllm::decode_edit(&raw, &req.members, &answer, "10.0.0.1", KvConnector::Shfs))
        });
        let bootstrap = sglang::Bootstrap {
            host: "10.0.0.7".into(),
            port: 8998,
            room: 4_611_686_018_427_387_904,
            rid: "req-1-0000abcd00000001".into(),
        };
        group.bench_function(BenchmarkId::new("sglang_legs", bytes), |b| {
            b.iter(|| {
                sglang::validate(&raw, &req.members)
                    .map(|()| sglang::legs(&raw, &req.members, &bootstrap))
            })
        });
        group.bench_function(BenchmarkId::new("sglang_legs_edited", bytes), |b| {
            b.iter(|| {
                sglang::validate(&raw, &req.members)
                    .map(|()| sglang::legs_edited(&raw, &req.members, &bootstrap))
            })
        });
        let ctx_answer = trt_context_answer(bytes / 4);
        group.bench_function(BenchmarkId::new("trtllm_legs", bytes), |b| {
            b.iter(|| {
                let id = 4_611_686_018_427_387_905;
                let ctx = trtllm::context_body(&raw, &req.members, id, ScheduleStyle::ContextFirst);
                let generation = trtllm::generation_body(
                    &raw,
                    &req.members,
                    Endpoint::ChatCompletions,
                    &ctx_answer,
                );
                (ctx, generation)
            })
        });
        group.bench_function(BenchmarkId::new("trtllm_generation_edit", bytes), |b| {
            b.iter(|| {
                trtllm::generation_edit(&raw, &req.members, Endpoint::ChatCompletions, &ctx_answer)
            })
        });
        group.bench_function(BenchmarkId::new("trtllm_generation_body", bytes), |b| {
            b.iter(|| {
                trtllm::generation_body(&raw, &req.members, Endpoint::ChatCompletions, &ctx_answer)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, body);
criterion_main!(benches);
