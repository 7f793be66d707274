//! The bench fleet and request shared by `benches/select.rs` and `examples/select_loop.rs`.

use pd_router_filter::core::fleet::{FleetView, ModelView};
use pd_router_filter::core::ledger::{Counter, Ledger};
use pd_router_filter::core::pd::{PairInput, PdSettings, Step0Input};
use pd_router_filter::proto;

/// Step 0 without a profile or bucketing.
pub const STEP0: Step0Input<'static> = Step0Input {
    profile: None,
    bucketing: false,
    prompt_len: 0,
};

/// Prefix matches of 0–60 % spread over the pods, for the loaded fleet.
pub fn match_pcts(model: &ModelView) -> Vec<f64> {
    (0..model.pods.len())
        .map(|i| (i % 7) as f64 * 10.0)
        .collect()
}

/// The benched request: a 1024-token prompt against the loaded fleet (`match_pct` from
/// [`match_pcts`]), or a 16-token one against the idle fleet (`match_pct` empty).
pub fn request<'a>(settings: &'a PdSettings, match_pct: &'a [f64], loaded: bool) -> PairInput<'a> {
    PairInput {
        settings,
        match_pct,
        token_bytes: if loaded { 4096 } else { 64 },
        banded_roleset: None,
        prompt_tokens: if loaded { 1024 } else { 16 },
        session_delta: None,
        now_ms: 1_000,
    }
}

/// Pod `i` of a bench fleet: even ones prefill, odd ones decode, two per roleset, ready,
/// without config or metrics.
pub fn pd_pod(i: usize, name: &str) -> proto::Pod {
    let role = if i.is_multiple_of(2) {
        "prefill"
    } else {
        "decode"
    };
    proto::Pod {
        namespace: "bench".into(),
        name: format!("{name}-{i}"),
        ip: format!("10.0.{}.{}", i / 250, i % 250),
        port: 8000,
        engine: "vllm".into(),
        role: role.into(),
        roleset: format!("rs-{}", i / 2),
        ready: true,
        serves_http: true,
        ..Default::default()
    }
}

/// `pods` pods in rolesets of one prefill and one decode pod, with engine metrics and a
/// ledger that has load on every pod, so no branch is skipped for lack of data; unscraped and
/// idle when `scraped` is false.
pub fn fleet_with(pods: usize, scraped: bool) -> (ModelView, Ledger) {
    build(pods, scraped, false)
}

/// As [`fleet_with`] (scraped, loaded), every pod a standard pod: what single-pod strategies
/// choose among.
#[allow(dead_code)]
pub fn standard_fleet(pods: usize) -> (ModelView, Ledger) {
    build(pods, true, true)
}

fn build(pods: usize, scraped: bool, standard: bool) -> (ModelView, Ledger) {
    let mut rng = fastrand::Rng::with_seed(1);
    let mut list = Vec::with_capacity(pods);
    for i in 0..pods {
        let mut pod = pd_pod(i, "pod");
        if standard {
            pod.role.clear();
            pod.roleset.clear();
        }
        list.push(proto::Pod {
            metrics: scraped.then(|| proto::PodMetrics {
                present: true,
                running: rng.f64() * 20.0,
                kv_cache_usage: rng.f64(),
                generation_throughput: 500.0 + rng.f64() * 1000.0,
                drain_rate: 1.0 + rng.f64() * 5.0,
                ttft_avg_seconds: 0.05,
                ..Default::default()
            }),
            ..pod
        });
    }
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
