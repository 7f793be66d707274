//! What a routing explanation costs: the same PD selection without an explanation (the normal
//! path), with one recorded, and recorded plus formatted into the header line.
//! Run with `cargo bench -p pd-router-filter --bench explain`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pd_router_filter::core::fleet::{FleetView, ModelView};
use pd_router_filter::core::ledger::Ledger;
use pd_router_filter::core::obs::Explain;
use pd_router_filter::core::pd::{self, PairInput, PdDefaults, PdSettings, Step0Input};
use pd_router_filter::proto;

/// `pods` pods in rolesets of one prefill and one decode pod, with engine metrics.
fn fleet(pods: usize) -> ModelView {
    let mut rng = fastrand::Rng::with_seed(1);
    let list = (0..pods)
        .map(|i| proto::Pod {
            namespace: "bench".into(),
            name: format!("pod-{i}"),
            ip: format!("10.0.{}.{}", i / 250, i % 250),
            port: 8000,
            engine: "vllm".into(),
            role: if i % 2 == 0 { "prefill" } else { "decode" }.into(),
            roleset: format!("rs-{}", i / 2),
            ready: true,
            serves_http: true,
            metrics: Some(proto::PodMetrics {
                present: true,
                running: rng.f64() * 20.0,
                kv_cache_usage: rng.f64(),
                generation_throughput: 500.0 + rng.f64() * 1000.0,
                drain_rate: 1.0 + rng.f64() * 5.0,
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    let snapshot = proto::Snapshot {
        version: 1,
        generated_unix_ms: 0,
        user_limits: false,
        eds: false,
        external_router: None,
        models: vec![proto::Model {
            name: "m".into(),
            pods: list,
            labels: None,
        }],
    };
    FleetView::from_snapshot(&snapshot).models["m"].clone()
}

fn explain(c: &mut Criterion) {
    let mut group = c.benchmark_group("explain");
    let settings = PdSettings::resolve(&PdDefaults::default(), None).expect("defaults");
    let step0 = Step0Input {
        profile: None,
        bucketing: false,
        prompt_len: 0,
    };
    let ledger = Ledger::default();
    for pods in [16usize, 256] {
        let model = fleet(pods);
        let match_pct = vec![0.0; model.pods.len()];
        let input = PairInput {
            settings: &settings,
            match_pct: &match_pct,
            token_bytes: 4096,
            banded_roleset: None,
            prompt_tokens: 1024,
            session_delta: None,
            now_ms: 1_000,
        };
        let mut rng = fastrand::Rng::with_seed(7);
        group.bench_function(BenchmarkId::new("off", pods), |b| {
            b.iter(|| pd::select_pd(&model, step0, &ledger, input, &mut rng).expect("a pair"))
        });
        group.bench_function(BenchmarkId::new("recorded", pods), |b| {
            b.iter(|| {
                let mut x = Explain::default();
                pd::select_pd_explained(&model, step0, &ledger, input, &mut rng, Some(&mut x))
                    .expect("a pair");
                x
            })
        });
        group.bench_function(BenchmarkId::new("recorded_and_formatted", pods), |b| {
            b.iter(|| {
                let mut x = Explain::default();
                pd::select_pd_explained(&model, step0, &ledger, input, &mut rng, Some(&mut x))
                    .expect("a pair");
                x.header(&model)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, explain);
criterion_main!(benches);
