//! One full PD selection (Steps 0–5, no charge) at 16 / 256 / 1024 pods, per policy pair, with
//! the scratch buffers a VM keeps between requests; and the default policies on a fleet that
//! was never scraped and carries no load (what `envoy/bench-v8.sh` measures inside Envoy);
//! and what an `external-filter` header adds before the selection; and the single-pod
//! strategies (one strategy, session-affinity, vtc-basic, a blend of three) over standard
//! pods.
//! Run with `cargo bench -p pd-router-filter --bench select`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pd_router_filter::core::ledger::Ledger;
use pd_router_filter::core::pd::vtc::{TokenTracker, VtcAsk, VtcSettings};
use pd_router_filter::core::pd::{self, PdDefaults, PdSettings};
use pd_router_filter::core::score::{DecodePolicy, PrefillPolicy};

#[path = "support/fleet.rs"]
mod fleet;
use fleet::{fleet_with, match_pcts, request, standard_fleet, STEP0};

fn selection(c: &mut Criterion) {
    let mut group = c.benchmark_group("select_pd");
    for pods in [16usize, 256, 1024] {
        let (model, ledger) = fleet_with(pods, true);
        let match_pct = match_pcts(&model);
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
            let input = request(&settings, &match_pct, true);
            let mut rng = fastrand::Rng::with_seed(7);
            let mut scratch = pd::Scratch::default();
            group.bench_function(
                BenchmarkId::new(format!("{}+{}", p.name(), d.name()), pods),
                |b| {
                    b.iter(|| {
                        pd::select_pd_with(&model, STEP0, &ledger, input, &mut rng, &mut scratch)
                            .expect("a pair")
                    })
                },
            );
        }
        let (unscraped, empty) = fleet_with(pods, false);
        let settings = PdSettings::resolve(&PdDefaults::default(), None).expect("defaults");
        let input = request(&settings, &[], false);
        let mut rng = fastrand::Rng::with_seed(7);
        let mut scratch = pd::Scratch::default();
        group.bench_function(BenchmarkId::new("unscraped_idle", pods), |b| {
            b.iter(|| {
                pd::select_pd_with(&unscraped, STEP0, &empty, input, &mut rng, &mut scratch)
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

/// What a request carrying `external-filter` adds before its selection: the selector parsed
/// and the model narrowed to a fresh view, here one that keeps every pod (the most work).
fn external_filter(c: &mut Criterion) {
    use pd_router_filter::core::label_selector::Selector;
    let mut group = c.benchmark_group("external_filter");
    for pods in [16usize, 256, 1024] {
        let (model, _) = fleet_with(pods, true);
        group.bench_function(BenchmarkId::new("narrow", pods), |b| {
            b.iter(|| {
                let selector = Selector::parse("!draining").expect("a selector");
                model.only(|p| selector.matches(&p.labels)).pods.len()
            })
        });
    }
    group.finish();
}

/// A single-pod pick over `pods` standard pods: least-request, session-affinity by key (the
/// rendezvous hash of every pod), a blend of three strategies, power-of-two, load-balance and
/// least-request-top-k (AIBrix's defaults, its ramp checked for every pod).
fn single_pod(c: &mut Criterion) {
    use pd_router_filter::core::config::SingleEnv;
    use pd_router_filter::core::pd::session_affinity::{self, SessionHint};
    use pd_router_filter::core::pd::top_k::TopK;
    use pd_router_filter::core::profile::{Strategy, StrategySpec};
    let Ok(StrategySpec::Blend(blend)) =
        Strategy::parse("least-request:2,throughput,least-kv-cache")
    else {
        panic!("a blend")
    };
    let hint = SessionHint {
        session_id: None,
        session_key: Some("conversation-1234"),
    };
    let top_k = TopK::new(&SingleEnv::default(), 1_800_000_000_000);
    let mut group = c.benchmark_group("select_single");
    for pods in [16usize, 256, 1024] {
        let (model, ledger) = standard_fleet(pods);
        let mut rng = fastrand::Rng::with_seed(7);
        for (name, strategy) in [
            ("least_request", Strategy::LeastRequest),
            ("power_of_two", Strategy::PowerOfTwo),
            ("load_balance", Strategy::LoadBalance),
            ("least_request_top_k", Strategy::LeastRequestTopK),
        ] {
            group.bench_function(BenchmarkId::new(name, pods), |b| {
                b.iter(|| {
                    pd::select_single(&model, strategy, &ledger, &[], &top_k, &mut rng)
                        .expect("a pod")
                })
            });
        }
        group.bench_function(BenchmarkId::new("session_affinity", pods), |b| {
            b.iter(|| session_affinity::select(&model, hint, &mut rng).expect("a pod"))
        });
        // vtc-basic as the host runs it: the user's place (among 1000 users), the running
        // counts, the pick, the charge.
        let vtc = VtcSettings::default();
        let now = 1_800_000_000_000;
        let mut tracker = TokenTracker::default();
        for u in 0..1000u32 {
            tracker.charge(&format!("user{u}"), 100.0 * f64::from(u + 1), now, &vtc);
        }
        group.bench_function(BenchmarkId::new("vtc_basic", pods), |b| {
            b.iter(|| {
                let ask = VtcAsk {
                    user: Some("user500"),
                    prompt_bytes: 2000,
                    now_ms: now,
                };
                let place = ask.place(&model, &mut tracker, &vtc);
                let running = pd::single::running_by_slot(&model, &ledger, true);
                let pod = pd::vtc::select_vtc(&model, place, &running, &vtc, &mut rng);
                ask.charge(&mut tracker, &vtc);
                pod.expect("a pod")
            })
        });
        group.bench_function(BenchmarkId::new("blend3", pods), |b| {
            b.iter(|| {
                pd::blend::select_blend(&model, &blend, hint, &ledger, &[], None, &top_k, &mut rng)
                    .expect("a pod")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, selection, external_filter, single_pod);
criterion_main!(benches);
