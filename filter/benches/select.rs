//! One full PD selection (Steps 0–5, no charge) at 16 / 256 / 1024 pods, per policy pair, with
//! the scratch buffers a VM keeps between requests; and the default policies on a fleet that
//! was never scraped and carries no load (what `envoy/bench-v8.sh` measures inside Envoy).
//! Run with `cargo bench -p pd-router-filter --bench select`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pd_router_filter::core::fleet::{FleetView, ModelView};
use pd_router_filter::core::ledger::{Counter, Ledger};
use pd_router_filter::core::pd::{self, PairInput, PdDefaults, PdSettings, Step0Input};
use pd_router_filter::core::score::{DecodePolicy, PrefillPolicy};
use pd_router_filter::proto;

/// `pods` pods in rolesets of one prefill and one decode pod, with engine metrics and a
/// ledger that has load on every pod, so no branch is skipped for lack of data.
fn fleet(pods: usize) -> (ModelView, Ledger) {
    fleet_with(pods, true)
}

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

fn selection(c: &mut Criterion) {
    let mut group = c.benchmark_group("select_pd");
    for pods in [16usize, 256, 1024] {
        let (model, ledger) = fleet(pods);
        let match_pct: Vec<f64> = (0..model.pods.len())
            .map(|i| (i % 7) as f64 * 10.0)
            .collect();
        for (p, d) in [
            (PrefillPolicy::PrefixCache, DecodePolicy::LoadBalancing),
            (PrefillPolicy::LeastRequest, DecodePolicy::LeastRequest),
            (PrefillPolicy::Conductor, DecodePolicy::Conductor),
            (PrefillPolicy::TokenLoad, DecodePolicy::TokenLoad),
            (PrefillPolicy::HybridCacheLoad, DecodePolicy::LoadBalancing),
        ] {
            let mut settings = PdSettings::resolve(&PdDefaults::default(), None).expect("defaults");
            settings.prefill_policy = p;
            settings.decode_policy = d;
            let step0 = Step0Input {
                profile: None,
                bucketing: false,
                prompt_len: 0,
            };
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
            let mut scratch = pd::Scratch::default();
            group.bench_function(
                BenchmarkId::new(format!("{}+{}", p.name(), d.name()), pods),
                |b| {
                    b.iter(|| {
                        pd::select_pd_with(&model, step0, &ledger, input, &mut rng, &mut scratch)
                            .expect("a pair")
                    })
                },
            );
        }
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
        group.bench_function(BenchmarkId::new("unscraped_idle", pods), |b| {
            b.iter(|| {
                pd::select_pd_with(&unscraped, step0, &empty, input, &mut rng, &mut scratch)
                    .expect("a pair")
            })
        });
        // What a request pays on top: decoding the shared ledger it selects over.
        let bytes = ledger.encode();
        group.bench_function(BenchmarkId::new("ledger_decode", pods), |b| {
            b.iter(|| Ledger::decode(&bytes).expect("valid"))
        });
    }
    group.finish();
}

criterion_group!(benches, selection);
criterion_main!(benches);
