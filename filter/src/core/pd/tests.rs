//! Scenario tests of the whole cascade (Step 0 to Step 5 and the charges), after
//! aibrix-pd-spec §9, on small fleets built from snapshot protos.

use super::*;
use crate::core::fleet::tests::{pod, snapshot};
use crate::core::fleet::FleetView;
use crate::core::score::{DecodePolicy, PrefillPolicy};
use crate::proto;

const STEP0: Step0Input<'static> = Step0Input {
    profile: None,
    bucketing: false,
    prompt_len: 0,
};

fn model(pods: Vec<proto::Pod>) -> ModelView {
    FleetView::from_snapshot(&snapshot(pods)).models["m"].clone()
}

fn rolesets(n: usize) -> ModelView {
    let mut pods = Vec::new();
    for r in 0..n {
        pods.push(pod(&format!("p{r}"), "prefill", &format!("g{r}"), true));
        pods.push(pod(&format!("d{r}"), "decode", &format!("g{r}"), true));
    }
    model(pods)
}

fn settings(prefill: PrefillPolicy, decode: DecodePolicy) -> PdSettings {
    let mut s = PdSettings::resolve(&PdDefaults::default(), None).unwrap();
    s.prefill_policy = prefill;
    s.decode_policy = decode;
    s
}

fn input<'a>(s: &'a PdSettings, match_pct: &'a [f64], prompt_tokens: u64) -> PairInput<'a> {
    PairInput {
        settings: s,
        match_pct,
        token_bytes: 0,
        banded_roleset: None,
        prompt_tokens,
        session_delta: None,
        now_ms: 1_000,
    }
}

fn pick(m: &ModelView, ledger: &Ledger, input: PairInput<'_>, seed: u64) -> Selected {
    let mut rng = fastrand::Rng::with_seed(seed);
    select_pd(m, STEP0, ledger, input, &mut rng).unwrap()
}

fn names(m: &ModelView, t: Target) -> (String, String) {
    match t {
        Target::Pair { prefill, decode } => {
            (m.pods[prefill].name.clone(), m.pods[decode].name.clone())
        }
        Target::Single { pod } => (String::new(), m.pods[pod].name.clone()),
    }
}

#[test]
fn every_policy_pair_comes_from_one_complete_roleset() {
    let m = rolesets(3);
    let ledger = Ledger::default();
    for p in PrefillPolicy::ALL {
        for d in DecodePolicy::ALL {
            let s = settings(p, d);
            for seed in 0..20 {
                let sel = pick(&m, &ledger, input(&s, &[], 100), seed);
                let (pn, dn) = names(&m, sel.target);
                assert_eq!(pn[1..], dn[1..], "{p:?}/{d:?}: {pn} with {dn}");
                assert_eq!(
                    sel.prefill_cost.is_some(),
                    p.uses_token_ledger(),
                    "charges only under token policies"
                );
                assert_eq!(sel.decode_tokens.is_some(), d == DecodePolicy::TokenLoad);
            }
        }
    }
}

#[test]
fn a_burst_of_charged_selections_spreads_evenly() {
    // ConcurrentBurstSeesPriorSelections: each selection sees the charges of the earlier ones.
    let m = rolesets(4);
    let mut ledger = Ledger::default();
    let s = settings(PrefillPolicy::LeastRequest, DecodePolicy::LeastRequest);
    let mut rng = fastrand::Rng::with_seed(9);
    let mut per_decode = std::collections::BTreeMap::new();
    for _ in 0..256 {
        let sel = select_pd(&m, STEP0, &ledger, input(&s, &[], 100), &mut rng).unwrap();
        sel.charge(&m, &mut ledger, 0);
        *per_decode.entry(names(&m, sel.target).1).or_insert(0) += 1;
    }
    assert!(per_decode.values().all(|&n| n == 64), "{per_decode:?}");
}

#[test]
fn token_load_steers_away_from_a_long_prompt() {
    let m = rolesets(2);
    let s = settings(PrefillPolicy::TokenLoad, DecodePolicy::LeastRequest);
    let mut ledger = Ledger::default();
    let mut rng = fastrand::Rng::with_seed(4);
    let long = select_pd(&m, STEP0, &ledger, input(&s, &[], 30_000), &mut rng).unwrap();
    long.charge(&m, &mut ledger, 0);
    assert_eq!(long.prefill_cost, Some(3500.0 + 30_000.0));
    let long_pod = names(&m, long.target).0;
    // Short prompts that follow while the long one is in flight avoid its prefill pod, until
    // the decode side's balance (half of the pair score) outweighs the prefill difference:
    // with least_request decode that is the fourth short prompt.
    for _ in 0..3 {
        let short = select_pd(&m, STEP0, &ledger, input(&s, &[], 100), &mut rng).unwrap();
        assert_ne!(names(&m, short.target).0, long_pod);
        short.charge(&m, &mut ledger, 0);
    }
}

#[test]
fn prefix_cache_prefers_the_pod_holding_the_prefix_and_load_breaks_the_tie() {
    let m = rolesets(2);
    let s = settings(PrefillPolicy::PrefixCache, DecodePolicy::LeastRequest);
    let ledger = Ledger::default();
    let p1 = m.pods.iter().position(|p| p.name == "p1").unwrap();
    let mut pct = vec![0.0; m.pods.len()];
    pct[p1] = 100.0;
    for seed in 0..10 {
        assert_eq!(
            names(&m, pick(&m, &ledger, input(&s, &pct, 10), seed).target).0,
            "p1"
        );
    }
}

#[test]
fn prefill_fast_path_takes_the_least_loaded_prefill_pod_and_its_roleset() {
    let m = rolesets(2);
    let mut ledger = Ledger::default();
    for _ in 0..20 {
        ledger.add("ns/p0", crate::core::ledger::Counter::PrefillInflight, 0);
    }
    // Make g0's decode pod far more attractive, so only the fast path explains choosing g1.
    for _ in 0..5 {
        ledger.add("ns/d1", crate::core::ledger::Counter::Running, 0);
    }
    let s = settings(PrefillPolicy::PrefixCache, DecodePolicy::LeastRequest);
    let sel = pick(&m, &ledger, input(&s, &[], 10), 1);
    assert!(sel.fast_paths.prefill);
    assert_eq!(names(&m, sel.target), ("p1".to_string(), "d1".to_string()));
}

#[test]
fn decode_fast_path_on_request_count_spread_aligns_the_prefill_side() {
    let m = rolesets(2);
    let mut ledger = Ledger::default();
    for _ in 0..17 {
        ledger.add("ns/d0", crate::core::ledger::Counter::Running, 0);
    }
    ledger.add("ns/d1", crate::core::ledger::Counter::Running, 0);
    let s = settings(PrefillPolicy::LeastRequest, DecodePolicy::LoadBalancing);
    let sel = pick(&m, &ledger, input(&s, &[], 10), 3);
    assert_eq!(
        sel.fast_paths.decode,
        Some(crate::core::score::decode::FastPathCheck::CountSpread)
    );
    assert_eq!(names(&m, sel.target), ("p1".to_string(), "d1".to_string()));
    // Under decode token_load the fast path is skipped.
    let s = settings(PrefillPolicy::LeastRequest, DecodePolicy::TokenLoad);
    assert_eq!(
        pick(&m, &ledger, input(&s, &[], 10), 3).fast_paths.decode,
        None
    );
}

#[test]
fn cold_decode_pods_compete_with_a_cold_start_score() {
    // d0 has engine metrics (ready), d1 has none: d1 scores 1.0 + pending, not 0.
    let mut pods = vec![
        pod("p0", "prefill", "g0", true),
        pod("d0", "decode", "g0", true),
        pod("p1", "prefill", "g1", true),
        pod("d1", "decode", "g1", true),
    ];
    pods[1].metrics = Some(proto::PodMetrics {
        present: true,
        generation_throughput: 100.0,
        ..Default::default()
    });
    let m = model(pods);
    let s = settings(PrefillPolicy::LeastRequest, DecodePolicy::LeastRequest);
    let ledger = Ledger::default();
    for seed in 0..10 {
        assert_eq!(
            names(&m, pick(&m, &ledger, input(&s, &[], 10), seed).target).1,
            "d0"
        );
    }
}

#[test]
fn banded_roleset_narrows_only_when_it_keeps_both_sides() {
    let m = rolesets(2);
    let s = settings(PrefillPolicy::LeastRequest, DecodePolicy::LeastRequest);
    let ledger = Ledger::default();
    let mut i = input(&s, &[], 10);
    i.banded_roleset = Some("g1");
    for seed in 0..10 {
        let sel = pick(&m, &ledger, i, seed);
        assert!(sel.fast_paths.banded);
        assert_eq!(names(&m, sel.target).1, "d1");
    }
    i.banded_roleset = Some("gone");
    assert!(!pick(&m, &ledger, i, 0).fast_paths.banded);
}

#[test]
fn sigma_filter_skips_an_overloaded_prefill_pod() {
    let m = rolesets(3);
    let mut ledger = Ledger::default();
    for _ in 0..10 {
        ledger.add("ns/p2", crate::core::ledger::Counter::PrefillInflight, 0);
    }
    let mut pct = vec![0.0; m.pods.len()];
    pct[m.pods.iter().position(|p| p.name == "p2").unwrap()] = 100.0;
    let s = settings(PrefillPolicy::PrefixCache, DecodePolicy::LeastRequest);
    for seed in 0..10 {
        assert_ne!(
            names(&m, pick(&m, &ledger, input(&s, &pct, 10), seed).target).0,
            "p2",
            "a full match cannot save a pod the σ filter skips"
        );
    }
}

/// Three 1P1D rolesets whose decode pods report `(throughput, drain rate)` and hold
/// `running` requests in the ledger.
fn decode_fleet(signals: [(f64, f64); 3], running: [u32; 3]) -> (ModelView, Ledger) {
    let mut pods = Vec::new();
    let mut ledger = Ledger::default();
    for (r, ((throughput, drain_rate), running)) in signals.into_iter().zip(running).enumerate() {
        pods.push(pod(&format!("p{r}"), "prefill", &format!("g{r}"), true));
        let mut d = pod(&format!("d{r}"), "decode", &format!("g{r}"), true);
        d.metrics = Some(proto::PodMetrics {
            present: true,
            generation_throughput: throughput,
            drain_rate,
            ..Default::default()
        });
        pods.push(d);
        for _ in 0..running {
            ledger.add(
                &format!("ns/d{r}"),
                crate::core::ledger::Counter::Running,
                0,
            );
        }
    }
    (model(pods), ledger)
}

#[test]
fn decode_fast_path_ties_go_to_any_of_the_tied_pods() {
    use crate::core::score::decode::FastPathCheck::*;
    // d0 and d1 tie at the minimum, d2 is far off: a check fires on every request until the
    // next scrape, and must spread them over d0 and d1, never d2.
    let cases = [
        // 0 tok/s twice against 3000.
        (
            [(0.0, 0.0), (0.0, 0.0), (3000.0, 0.0)],
            [0, 0, 0],
            ThroughputSpread,
        ),
        // 0 running twice against 17.
        ([(0.0, 0.0); 3], [0, 0, 17], CountSpread),
        // Drain scores 1, 1, 8.
        ([(0.0, 1.0); 3], [1, 1, 8], DrainRatio),
    ];
    let s = settings(PrefillPolicy::LeastRequest, DecodePolicy::LoadBalancing);
    let bucketing = Step0Input {
        bucketing: true,
        ..STEP0
    };
    for (signals, running, check) in cases {
        let (m, ledger) = decode_fleet(signals, running);
        // The snapshot's candidate sets, per-request ones (bucketing), the plain cascade.
        for (how, step0) in [("all", STEP0), ("listed", bucketing), ("plain", STEP0)] {
            let mut seen = std::collections::BTreeSet::new();
            for seed in 0..64 {
                let mut rng = fastrand::Rng::with_seed(seed);
                let sel = if how == "plain" {
                    explained::select_pd(&m, step0, &ledger, input(&s, &[], 10), &mut rng)
                } else {
                    select_pd(&m, step0, &ledger, input(&s, &[], 10), &mut rng)
                }
                .unwrap();
                assert_eq!(sel.fast_paths.decode, Some(check), "{how}");
                seen.insert(names(&m, sel.target).1);
            }
            let want = ["d0".to_string(), "d1".to_string()].into();
            assert_eq!(seen, want, "{check:?} {how}");
        }
    }
}
