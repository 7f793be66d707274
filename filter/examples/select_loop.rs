//! The default-policy selection on an idle, never-scraped fleet (what `make bench-v8` times in
//! Envoy), in a loop, for timing the routing core as wasm under Node's V8 without Envoy:
//! `cargo build --release --target wasm32-wasip1 --example select_loop -p pd-router-filter`,
//! then `node --no-liftoff wasm-tests/run-wasi target/wasm32-wasip1/release/examples/select_loop.wasm 1024 3000`.
//! Prints the median and p90 of per-selection times over batches of 100.

use pd_router_filter::core::fleet::{FleetView, ModelView};
use pd_router_filter::core::ledger::{Counter, Ledger};
use pd_router_filter::core::pd::{self, PairInput, PdDefaults, PdSettings, Step0Input};
use pd_router_filter::proto;

fn fleet_with(pods: usize, scraped: bool) -> (ModelView, Ledger) {
    let mut rng = fastrand::Rng::with_seed(1);
    let mut list = Vec::with_capacity(pods);
    for i in 0..pods {
        let role = if i % 2 == 0 { "prefill" } else { "decode" };
        list.push(proto::Pod {
            namespace: "bench".into(),
            name: format!("pod-{i}"),
            ip: format!("10.0.{}.{}", i / 250, i % 250),
            port: 8000,
            engine: "vllm".into(),
            role: role.into(),
            roleset: format!("rs-{}", i / 2),
            ready: true,
            serves_http: true,
            metrics: scraped.then(|| proto::PodMetrics {
                present: true,
                running: rng.f64() * 20.0,
                kv_cache_usage: rng.f64(),
                generation_throughput: 500.0 + rng.f64() * 1000.0,
                drain_rate: 1.0 + rng.f64() * 5.0,
                ttft_avg_seconds: 0.05,
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    let snapshot = proto::Snapshot {
        version: 1,
        generated_unix_ms: 0,
        models: vec![proto::Model {
            name: "m".into(),
            pods: list,
        }],
    };
    let model = FleetView::from_snapshot(&snapshot).models["m"].clone();
    let mut ledger = Ledger::default();
    if !scraped {
        return (model, ledger);
    }
    for p in &model.pods {
        for _ in 0..rng.usize(0..4) {
            let counter = if p.name.ends_with(['0', '2', '4', '6', '8']) {
                Counter::PrefillInflight
            } else {
                Counter::Running
            };
            ledger.add(&p.key, counter, 0);
        }
        ledger.charge_prefill(&p.key, rng.f64() * 10_000.0, 0);
    }
    (model, ledger)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let pods: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(1024);
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(3000);
    let (unscraped, empty) = fleet_with(pods, false);
    let settings = PdSettings::resolve(&PdDefaults::default(), None).expect("defaults");
    let input = PairInput {
        settings: &settings,
        match_pct: &[],
        token_bytes: 64,
        banded_roleset: None,
        prompt_tokens: 16,
        session_delta: None,
        now_ms: 1_000,
    };
    let mut rng = fastrand::Rng::with_seed(7);
    let mut scratch = pd::Scratch::default();
    let step0 = Step0Input {
        profile: None,
        bucketing: false,
        prompt_len: 0,
    };
    let mut batches = Vec::new();
    let mut picked = 0usize;
    for _ in 0..n / 100 {
        let t = std::time::Instant::now();
        for _ in 0..100 {
            let s = pd::select_pd_with(&unscraped, step0, &empty, input, &mut rng, &mut scratch)
                .expect("a pair");
            picked ^= s.target.pod();
        }
        batches.push(t.elapsed().as_nanos() as f64 / 100_000.0);
    }
    // The first third warms the JIT up.
    let mut timed = batches.split_off(batches.len() / 3);
    timed.sort_by(f64::total_cmp);
    let at = |q: f64| timed[((timed.len() - 1) as f64 * q) as usize];
    println!(
        "pods={pods} selections={} per selection: p50 {:.1} us, p90 {:.1} us ({picked})",
        timed.len() * 100,
        at(0.5),
        at(0.9)
    );
}
