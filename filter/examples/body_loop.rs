//! The body work of one vLLM PD request (`cargo bench --bench body`'s parse, prefill leg and
//! decode body, on the same bodies) in a hot loop, for timing it as wasm under Node's V8
//! without Envoy: `cargo build --release --target wasm32-wasip1 --example body_loop -p
//! pd-router-filter`, then `node --no-liftoff wasm-tests/run-wasi
//! target/wasm32-wasip1/release/examples/body_loop.wasm [BYTES...]` (default 2048 32768).
//! Against the same steps' wall time in Envoy (`make profile-sections`) it shows how much of
//! a callback's time there is the cold start of code and data that a loop keeps warm.
use pd_router_filter::core::config::KvConnector;
use pd_router_filter::core::engine::vllm;
use pd_router_filter::core::request::{Endpoint, RoutingRequest};
use std::hint::black_box;
use std::time::Instant;
#[allow(dead_code)] // the TRT-LLM answer is the bench's
#[path = "../benches/support/bodies.rs"]
mod bodies;

/// Mean µs per call of `f` over `n` calls, after `n / 10` unmeasured ones.
fn mean_us(n: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..n / 10 {
        f();
    }
    let started = Instant::now();
    for _ in 0..n {
        f();
    }
    started.elapsed().as_secs_f64() * 1e6 / n as f64
}

fn main() {
    let mut sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if sizes.is_empty() {
        sizes = vec![2048, 32768];
    }
    for bytes in sizes {
        let raw = bodies::chat(bytes);
        let answer = bodies::prefill_answer(bytes);
        let req =
            RoutingRequest::parse(Endpoint::ChatCompletions, &raw).expect("the bench body parses");
        let n = (4_000_000 / bytes).clamp(200, 20_000);
        let parse = mean_us(n, || {
            black_box(RoutingRequest::parse(Endpoint::ChatCompletions, black_box(&raw)).ok());
        });
        let prefill = mean_us(n, || {
            black_box(vllm::prefill_body(
                black_box(&raw),
                &req.members,
                KvConnector::Shfs,
            ));
        });
        let decode = mean_us(n, || {
            black_box(
                vllm::decode_body(
                    &raw,
                    &req.members,
                    black_box(&answer),
                    "10.0.0.2",
                    KvConnector::Shfs,
                )
                .ok(),
            );
        });
        println!("{bytes} B: parse {parse:.2} µs, prefill_body {prefill:.2} µs, decode_body {decode:.2} µs ({n} calls each)");
    }
}
