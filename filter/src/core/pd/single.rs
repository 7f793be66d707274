//! Single-pod strategies (`random`, `least-request`, ...) that the `routing-strategy` header
//! can name instead of `pd`. They consider the pods that run whole requests (any role but
//! prefill/decode): a prefill or decode pod expects the PD protocol, not a plain request.

use crate::core::errors::RouteError;
use crate::core::fleet::{ModelView, PodView};
use crate::core::ledger::Ledger;
use crate::core::pd::preble;
use crate::core::pd::top_k::TopK;
use crate::core::pd::{MinPicker, Target};
use crate::core::profile::Strategy;

/// A strategy's raw score for one pod, lower is better; `None` when the pod has no metrics
/// to score it by. `running` is the pod's running requests (see [`running_by_slot`]),
/// `match_pct` the share of the prompt the prefix index says it holds (0..=100).
/// prefix-cache scores the cache alone (`100 − match`); alone, it also weighs the load (see
/// [`select_single`]). session-affinity, random and power-of-two score every pod alike
/// (session-affinity's choice is made by `session_affinity::resolve`; power-of-two is a draw,
/// which AIBrix leaves out of a blend); least-request-top-k's blend score adds a jitter (see
/// `TopK::scores`).
pub fn score(strategy: Strategy, pod: &PodView, running: u32, match_pct: f64) -> Option<f64> {
    let metric = |f: fn(&crate::proto::PodMetrics) -> f64| pod.metrics.as_ref().map(f);
    match strategy {
        Strategy::Random | Strategy::SessionAffinity | Strategy::PowerOfTwo => Some(0.0),
        Strategy::LeastRequest
        | Strategy::LeastRequestTopK
        | Strategy::LoraAffinity
        | Strategy::Pd => Some(f64::from(running)),
        Strategy::LoadBalance => Some(f64::from(running) / capacity(pod)),
        Strategy::PrefixCache => Some(100.0 - match_pct),
        // A prompt token costs the engine about twice a generated one (AIBrix's weighting).
        Strategy::Throughput => metric(|m| 2.0 * m.prompt_throughput + m.generation_throughput),
        Strategy::LeastKvCache | Strategy::LeastGpuCache => metric(|m| m.kv_cache_usage),
        Strategy::LeastLatency => metric(|m| m.ttft_avg_seconds),
        // Absent on pods whose engine does not export it: those are passed over (AIBrix's rule).
        Strategy::LeastUtilization => pod.metrics.as_ref().and_then(|m| m.engine_utilization),
        Strategy::LeastBusyTime => pod.metrics.as_ref().and_then(|m| m.gpu_busy_time_ratio),
        // Its score needs the user's place (see `vtc::scores`), which a pod alone cannot give.
        Strategy::VtcBasic => None,
        // Its score needs the longest match over all pods (see `preble::score`).
        Strategy::PrefixCachePreble => None,
        // The service's choice is not a score (and `external` never blends).
        Strategy::External => None,
    }
}

/// Requests a pod clears per second, for `load-balance`: the engine's finished-request rate
/// (pd-control's one-minute drain rate), or 1 while it has none (no fresh metrics, or no
/// request finished yet), so such pods compare by running requests alone.
fn capacity(pod: &PodView) -> f64 {
    pod.metrics
        .as_ref()
        .filter(|m| m.present && !m.stale && m.drain_rate > 0.0 && m.drain_rate.is_finite())
        .map_or(1.0, |m| m.drain_rate)
}

/// Whether [`score`] (or prefix-cache's load term) reads the running requests.
pub fn reads_load(strategy: Strategy) -> bool {
    matches!(
        strategy,
        Strategy::LeastRequest
            | Strategy::PrefixCache
            | Strategy::Pd
            | Strategy::PowerOfTwo
            | Strategy::LoadBalance
            | Strategy::LeastRequestTopK
            | Strategy::LoraAffinity
            | Strategy::VtcBasic
            | Strategy::PrefixCachePreble
    )
}

/// Every pod's running requests (this replica's and the others'), by slot, read in one merge
/// pass over the model's sorted ids: a binary search per pod costs three times as much at
/// 1024 pods. Empty when `needed` is false, and then every pod reads 0.
pub fn running_by_slot(model: &ModelView, ledger: &Ledger, needed: bool) -> Vec<u32> {
    if !needed {
        return Vec::new();
    }
    ledger
        .rows_for(&model.id_order, model.pods.len())
        .iter()
        .map(|r| r.counts.running)
        .collect()
}

/// Picks one pod for a non-PD strategy: the lowest score, ties (and `random`) broken
/// uniformly. Pods without metrics are passed over while another has them; with none, any
/// pod is taken uniformly, as AIBrix falls back to a random pod. `match_pct` is by slot
/// (empty when the strategy needs none); prefix-cache scores each pod as the prefill policy
/// of the same name does, `(100 − match) × 0.1 + running / max running`, so a pod holding the
/// prompt wins until it is busier than the rest by about one tenth of the busiest pod's load
/// per point of match. power-of-two and least-request-top-k pick by their own rules
/// ([`power_of_two`], [`TopK`]).
pub fn select_single(
    model: &ModelView,
    strategy: Strategy,
    ledger: &Ledger,
    match_pct: &[f64],
    top_k: &TopK,
    rng: &mut fastrand::Rng,
) -> Result<Target, RouteError> {
    if strategy == Strategy::PowerOfTwo {
        // Two pods' counts: two ledger lookups, not a pass over the fleet.
        let load = |slot: usize| ledger.counts(model.pods[slot].id).running;
        return power_of_two(model, load, rng)
            .map(|pod| Target::Single { pod })
            .ok_or_else(|| no_standard_pod(strategy.name()));
    }
    let running = running_by_slot(model, ledger, reads_load(strategy));
    if strategy == Strategy::LeastRequestTopK {
        return top_k
            .pick(model, &running, rng)
            .map(|pod| Target::Single { pod })
            .ok_or_else(|| no_standard_pod(strategy.name()));
    }
    let inv_max_req = if strategy == Strategy::PrefixCache {
        let max_req = model
            .others
            .iter()
            .map(|&i| running.get(i).copied().unwrap_or(0))
            .max()
            .unwrap_or(0);
        crate::core::score::prefill::reciprocal(max_req)
    } else {
        0.0
    };
    let longest = if strategy == Strategy::PrefixCachePreble {
        preble::longest_match(&model.others, match_pct)
    } else {
        0.0
    };
    let mut best = MinPicker::new();
    let mut any = MinPicker::new();
    for &i in &model.others {
        let pod = &model.pods[i];
        let load = running.get(i).copied().unwrap_or(0);
        let pct = match_pct.get(i).copied().unwrap_or(0.0);
        let score = match strategy {
            Strategy::PrefixCache => Some(crate::core::score::prefill::prefix_cache_with(
                crate::core::score::prefill::prefix_cache_miss(pct),
                load,
                inv_max_req,
            )),
            Strategy::PrefixCachePreble => preble::score(load, pct, longest),
            _ => score(strategy, pod, load, pct),
        };
        match score {
            Some(score) => best.offer(score, i, rng),
            None => any.offer(0.0, i, rng),
        }
    }
    best.item()
        .or_else(|| any.item())
        .map(|pod| Target::Single { pod })
        .ok_or_else(|| no_standard_pod(strategy.name()))
}

/// Two distinct standard pods drawn uniformly; the one with fewer running requests wins, the
/// first drawn on a tie. Cheap at any fleet size, and never herds: the most loaded pod only
/// loses, and a burst spreads over the less loaded half instead of one pod.
fn power_of_two(
    model: &ModelView,
    load: impl Fn(usize) -> u32,
    rng: &mut fastrand::Rng,
) -> Option<usize> {
    let pods = &model.others;
    match pods.len() {
        0 => None,
        1 => Some(pods[0]),
        n => {
            let first = rng.usize(..n);
            let mut second = rng.usize(..n - 1);
            if second >= first {
                second += 1;
            }
            let (a, b) = (pods[first], pods[second]);
            Some(if load(a) <= load(b) { a } else { b })
        }
    }
}

/// The error of a single-pod strategy on a model whose pods are all prefill or decode pods.
pub fn no_standard_pod(strategy: &str) -> RouteError {
    RouteError::Selection {
        detail: format!(
            "strategy {strategy} needs a pod that serves whole requests; prefill/decode pods need routing-strategy: pd"
        ),
    }
}

/// Picks the pod for a request that computes nothing on the engine
/// (`/v1/messages/count_tokens`: the prompt rendered and counted). Every role serves it, so
/// the pod with the fewest running requests takes it, prefill and decode pods included: a
/// PD-only fleet has no other. Ties are broken uniformly.
pub fn select_any(
    model: &ModelView,
    ledger: &Ledger,
    rng: &mut fastrand::Rng,
) -> Result<Target, RouteError> {
    let mut best = MinPicker::new();
    for (i, pod) in model.pods.iter().enumerate() {
        best.offer(ledger.counts(pod.id).running as f64, i, rng);
    }
    best.item()
        .map(|pod| Target::Single { pod })
        .ok_or_else(|| RouteError::Selection {
            detail: "the model has no routable pod".into(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;
    use crate::core::ledger::Counter;
    use crate::core::pd::top_k::tests::TOP_K_DEFAULTS;
    use crate::proto;

    fn model() -> ModelView {
        let mut a = pod("a", "", "", true);
        a.metrics = Some(proto::PodMetrics {
            present: true,
            kv_cache_usage: 0.9,
            ttft_avg_seconds: 0.1,
            generation_throughput: 50.0,
            ..Default::default()
        });
        let mut b = pod("bb", "all", "", true);
        b.metrics = Some(proto::PodMetrics {
            present: true,
            kv_cache_usage: 0.2,
            ttft_avg_seconds: 0.5,
            generation_throughput: 500.0,
            ..Default::default()
        });
        FleetView::from_snapshot(&snapshot(vec![
            a,
            b,
            pod("d", "decode", "g", true),
            pod("p", "prefill", "g", true),
        ]))
        .models["m"]
            .clone()
    }

    /// `select_single` with AIBrix's top-K knobs, which must find a pod.
    fn one(
        m: &ModelView,
        strategy: Strategy,
        loads: &Ledger,
        match_pct: &[f64],
        rng: &mut fastrand::Rng,
    ) -> Target {
        select_single(m, strategy, loads, match_pct, &TOP_K_DEFAULTS, rng).unwrap()
    }

    fn pick(strategy: Strategy, loads: &Ledger) -> String {
        let m = model();
        let mut rng = fastrand::Rng::with_seed(2);
        let t = one(&m, strategy, loads, &[], &mut rng);
        m.pods[t.pod()].name.clone()
    }

    #[test]
    fn a_request_that_computes_nothing_takes_the_least_busy_pod_of_any_role() {
        let m = model();
        let mut loads = Ledger::default();
        for name in ["ns/a", "ns/bb", "ns/p"] {
            loads.add(name, Counter::Running, 0);
        }
        let mut rng = fastrand::Rng::with_seed(3);
        let t = select_any(&m, &loads, &mut rng).unwrap();
        assert_eq!(m.pods[t.pod()].name, "d");
        loads.add("ns/d", Counter::Running, 0);
        loads.add("ns/d", Counter::Running, 0);
        let t = select_any(&m, &loads, &mut rng).unwrap();
        assert_ne!(m.pods[t.pod()].name, "d");
    }

    #[test]
    fn pods_without_metrics_wait_until_no_pod_has_any() {
        let mut m = model();
        // "a" loses its metrics: a metric strategy takes "bb" even where "a" was better.
        m.pods[0].metrics = None;
        let loads = Ledger::default();
        let mut rng = fastrand::Rng::with_seed(5);
        for _ in 0..10 {
            let t = one(&m, Strategy::LeastLatency, &loads, &[], &mut rng);
            assert_eq!(m.pods[t.pod()].name, "bb");
        }
        m.pods[1].metrics = None;
        let mut seen = std::collections::HashSet::new();
        for _ in 0..40 {
            let t = one(&m, Strategy::LeastKvCache, &loads, &[], &mut rng);
            seen.insert(m.pods[t.pod()].name.clone());
        }
        assert_eq!(seen.len(), 2, "uniform over the standard pods: {seen:?}");
    }

    #[test]
    fn prefix_cache_follows_the_match_until_the_load_outweighs_it() {
        let m = model();
        let mut loads = Ledger::default();
        // "a" holds 60 % of the prompt: 4 points of miss less than "bb" (40 × 0.1).
        let mut pct = vec![0.0; m.pods.len()];
        pct[0] = 60.0;
        let mut rng = fastrand::Rng::with_seed(3);
        let mut pick = |loads: &Ledger| {
            let t = one(&m, Strategy::PrefixCache, loads, &pct, &mut rng);
            m.pods[t.pod()].name.clone()
        };
        assert_eq!(pick(&loads), "a");
        for _ in 0..5 {
            loads.add("ns/a", Counter::Running, 0);
        }
        // a: 4.0 + 5/5 = 5.0; bb: 10.0 + 0 — still a.
        assert_eq!(pick(&loads), "a");
        let none = vec![0.0; m.pods.len()];
        let t = one(&m, Strategy::PrefixCache, &loads, &none, &mut rng);
        assert_eq!(
            m.pods[t.pod()].name,
            "bb",
            "without a match, the least loaded"
        );
    }

    #[test]
    fn power_of_two_never_takes_the_busier_of_its_two_draws() {
        let m = FleetView::from_snapshot(&snapshot(
            ["s0", "s1", "s2"].map(|n| pod(n, "", "", true)).to_vec(),
        ))
        .models["m"]
            .clone();
        let mut loads = Ledger::default();
        for (key, n) in [("ns/s1", 1), ("ns/s2", 5)] {
            for _ in 0..n {
                loads.add(key, Counter::Running, 0);
            }
        }
        let mut rng = fastrand::Rng::with_seed(4);
        let mut seen = std::collections::BTreeMap::<String, u32>::new();
        for _ in 0..3000 {
            let t = one(&m, Strategy::PowerOfTwo, &loads, &[], &mut rng);
            *seen.entry(m.pods[t.pod()].name.clone()).or_default() += 1;
        }
        // s0 wins every draw it is in (2 of 3), s1 the one draw without s0, s2 none.
        assert_eq!(seen.get("s2"), None, "{seen:?}");
        assert!((1850..2150).contains(&seen["s0"]), "{seen:?}");
        assert!((850..1150).contains(&seen["s1"]), "{seen:?}");
    }

    #[test]
    fn load_balance_weighs_running_requests_by_drain_rate() {
        let mut m = model();
        let mut loads = Ledger::default();
        for _ in 0..4 {
            loads.add("ns/a", Counter::Running, 0);
        }
        loads.add("ns/bb", Counter::Running, 0);
        let mut rng = fastrand::Rng::with_seed(6);
        let mut pick = |m: &ModelView| {
            let t = one(m, Strategy::LoadBalance, &loads, &[], &mut rng);
            m.pods[t.pod()].name.clone()
        };
        // Neither drains yet: capacity 1, the fewer running requests win.
        assert_eq!(pick(&m), "bb");
        // a clears 8 requests/s (4 running: 0.5 s), bb 0.5/s (1 running: 2 s).
        m.pods[0].metrics.as_mut().unwrap().drain_rate = 8.0;
        m.pods[1].metrics.as_mut().unwrap().drain_rate = 0.5;
        assert_eq!(pick(&m), "a");
        // A stale drain rate is not trusted: a counts as capacity 1 again (4 s).
        m.pods[0].metrics.as_mut().unwrap().stale = true;
        assert_eq!(pick(&m), "bb");
    }

    #[test]
    fn least_request_top_k_spreads_over_the_least_loaded() {
        let m = model();
        let mut loads = Ledger::default();
        loads.add("ns/a", Counter::Running, 0);
        let mut rng = fastrand::Rng::with_seed(8);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..40 {
            let t = one(&m, Strategy::LeastRequestTopK, &loads, &[], &mut rng);
            seen.insert(m.pods[t.pod()].name.clone());
        }
        // a runs 1, bb 0: both within epsilon 4, PD pods never.
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), ["a", "bb"]);
    }

    #[test]
    fn throughput_weighs_a_prompt_token_twice() {
        let mut m = model();
        // a: 60 prompt + 50 generated tokens/s = 170; bb: 0 + 150 = 150.
        m.pods[0].metrics.as_mut().unwrap().prompt_throughput = 60.0;
        m.pods[1].metrics.as_mut().unwrap().generation_throughput = 150.0;
        let mut rng = fastrand::Rng::with_seed(2);
        let t = one(&m, Strategy::Throughput, &Ledger::default(), &[], &mut rng);
        assert_eq!(
            m.pods[t.pod()].name,
            "bb",
            "an unweighted sum would pick a (110)"
        );
    }

    #[test]
    fn each_strategy_minimises_its_signal() {
        let mut loads = Ledger::default();
        loads.add("ns/a", Counter::Running, 0);
        assert_eq!(pick(Strategy::LeastRequest, &loads), "bb");
        assert_eq!(pick(Strategy::LoraAffinity, &loads), "bb");
        assert_eq!(pick(Strategy::LeastKvCache, &loads), "bb");
        assert_eq!(pick(Strategy::LeastGpuCache, &loads), "bb");
        assert_eq!(pick(Strategy::LeastLatency, &loads), "a");
        assert_eq!(pick(Strategy::Throughput, &loads), "a");
        for _ in 0..20 {
            assert_ne!(
                pick(Strategy::Random, &loads),
                "d",
                "PD pods never take a plain request"
            );
        }
    }

    #[test]
    fn utilization_strategies_pass_over_pods_that_do_not_report_the_gauge() {
        let mut m = model();
        let loads = Ledger::default();
        let mut rng = fastrand::Rng::with_seed(9);
        let seen = |m: &ModelView, strategy, rng: &mut fastrand::Rng| {
            (0..40)
                .map(|_| {
                    m.pods[one(m, strategy, &loads, &[], rng).pod()]
                        .name
                        .clone()
                })
                .collect::<std::collections::BTreeSet<_>>()
        };
        // No engine exports either gauge: a draw over the standard pods, as AIBrix falls back.
        for strategy in [Strategy::LeastUtilization, Strategy::LeastBusyTime] {
            let names = seen(&m, strategy, &mut rng);
            assert_eq!(names, ["a", "bb"].map(String::from).into(), "{strategy:?}");
        }
        // "bb" reports a busier engine than "a": the lower gauge wins.
        m.pods[0].metrics.as_mut().unwrap().engine_utilization = Some(0.3);
        m.pods[1].metrics.as_mut().unwrap().engine_utilization = Some(0.8);
        m.pods[1].metrics.as_mut().unwrap().gpu_busy_time_ratio = Some(0.1);
        let names = seen(&m, Strategy::LeastUtilization, &mut rng);
        assert_eq!(names, ["a".to_string()].into());
        // Only "bb" reports a busy time: "a", which does not, is not taken for an idle pod.
        let names = seen(&m, Strategy::LeastBusyTime, &mut rng);
        assert_eq!(names, ["bb".to_string()].into());
    }

    #[test]
    fn preble_keeps_a_mostly_held_prompt_on_its_holder_however_busy() {
        let m = model();
        let mut loads = Ledger::default();
        for _ in 0..3 {
            loads.add("ns/a", Counter::Running, 0);
        }
        let mut rng = fastrand::Rng::with_seed(4);
        let mut pick = |held: f64| {
            let mut pct = vec![0.0; m.pods.len()];
            pct[0] = held;
            let t = one(&m, Strategy::PrefixCachePreble, &loads, &pct, &mut rng);
            m.pods[t.pod()].name.clone()
        };
        // The longest match decides once it covers over half the prompt, whatever a's load.
        assert_eq!(pick(60.0), "a");
        assert_eq!(
            pick(50.0),
            "bb",
            "half is not more than half: the load decides"
        );
        assert_eq!(pick(0.0), "bb");
    }
}
