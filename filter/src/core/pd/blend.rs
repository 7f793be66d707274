//! Several single-pod strategies at once (`routing-strategy: least-request:10,throughput:1`),
//! scored the way AIBrix's multi-strategy router does, so a configured blend behaves alike:
//!
//! 1. each strategy scores every standard pod (a pod without the metrics it needs is left
//!    unscored);
//! 2. its scores are clipped to 3 median absolute deviations of their median (three pods or
//!    more), so one extreme pod cannot squash the gaps between the others, then scaled to
//!    0..1 with 1 the best; a strategy that sees no difference gives every scored pod 1, an
//!    unscored pod gets 0;
//! 3. the scaled scores are summed, each weighted by its share of the total weight;
//! 4. the highest sum wins (within 1e-9), ties broken uniformly.
//!
//! A pod neither best at least-request nor at throughput, but close to the best at both,
//! wins over a pod that is best at one and worst at the other: a weighted draw of one
//! strategy per request could never pick it.

use crate::core::errors::RouteError;
use crate::core::fleet::ModelView;
use crate::core::ledger::Ledger;
use crate::core::pd::preble;
use crate::core::pd::session_affinity::{self, SessionHint, Via};
use crate::core::pd::single::{no_standard_pod, reads_load, running_by_slot, score};
use crate::core::pd::top_k::TopK;
use crate::core::pd::vtc::{self, VtcSettings};
use crate::core::pd::{MinPicker, Target};
use crate::core::profile::{Blend, Strategy};

/// How far from the median, in median absolute deviations, a score counts as an outlier.
const OUTLIER_MADS: f64 = 3.0;

/// Picks the pod for a blend. `match_pct` is the prefix index's match by slot (empty when
/// the blend has no prefix-cache). `vtc` is the user's place on the pod line and the knobs,
/// for vtc-basic (`None` without a user: vtc-basic then scores no pod, so it sways nothing).
/// With session-affinity in the blend, the second value says how the session's pod was found
/// (`Random` when no header named one).
#[allow(clippy::too_many_arguments)]
pub fn select_blend(
    model: &ModelView,
    blend: &Blend,
    hint: SessionHint<'_>,
    ledger: &Ledger,
    match_pct: &[f64],
    vtc: Option<(f64, &VtcSettings)>,
    top_k: &TopK,
    rng: &mut fastrand::Rng,
) -> Result<(Target, Option<Via>), RouteError> {
    let pods = model.others.as_slice();
    if pods.is_empty() {
        return Err(no_standard_pod(&blend.label));
    }
    let load_needed = blend
        .items
        .iter()
        .any(|(s, _)| reads_load(*s) && *s != Strategy::PrefixCache);
    let running = running_by_slot(model, ledger, load_needed);
    let mut via = None;
    let total_weight: f64 = blend.items.iter().map(|(_, w)| f64::from(*w)).sum();
    let mut sums = vec![0.0; pods.len()];
    let mut raw: Vec<Option<f64>> = Vec::with_capacity(pods.len());
    for &(strategy, weight) in &blend.items {
        raw.clear();
        if strategy == Strategy::SessionAffinity {
            let sticky = session_affinity::resolve(model, hint);
            via = Some(sticky.map_or(Via::Random, |(_, v)| v));
            // Lower is better throughout: the session's pod scores 0, every other pod 1.
            raw.extend(pods.iter().map(|&i| {
                Some(if sticky.is_some_and(|(s, _)| s == i) {
                    0.0
                } else {
                    1.0
                })
            }));
        } else if strategy == Strategy::LeastRequestTopK {
            raw.extend(top_k.scores(model, &running, rng).into_iter().map(Some));
        } else if strategy == Strategy::PrefixCachePreble {
            let longest = preble::longest_match(pods, match_pct);
            raw.extend(pods.iter().map(|&i| {
                let load = running.get(i).copied().unwrap_or(0);
                preble::score(load, match_pct.get(i).copied().unwrap_or(0.0), longest)
            }));
        } else if strategy == Strategy::VtcBasic {
            let scores = vtc.map(|(place, s)| vtc::scores(model, place, &running, s));
            raw.extend(pods.iter().map(|&i| {
                scores
                    .as_ref()
                    .and_then(|v| v.get(i).copied())
                    .filter(|s| s.is_finite())
            }));
        } else {
            raw.extend(pods.iter().map(|&i| {
                let load = running.get(i).copied().unwrap_or(0);
                let pct = match_pct.get(i).copied().unwrap_or(0.0);
                score(strategy, &model.pods[i], load, pct).filter(|s| s.is_finite())
            }));
        }
        let share = f64::from(weight) / total_weight;
        for (sum, scaled) in sums.iter_mut().zip(scaled(&raw)) {
            *sum += scaled * share;
        }
    }
    let best = sums.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut pick = MinPicker::new();
    for (&i, &sum) in pods.iter().zip(&sums) {
        if (best - sum).abs() < 1e-9 {
            pick.offer(0.0, i, rng);
        }
    }
    pick.item()
        .map(|pod| (Target::Single { pod }, via))
        .ok_or_else(|| no_standard_pod(&blend.label))
}

/// Lower-is-better raw scores to 0..1, higher better: unscored pods 0, outliers clipped.
fn scaled(raw: &[Option<f64>]) -> impl Iterator<Item = f64> + '_ {
    let (low, high) = clip_bounds(raw);
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in raw.iter().flatten() {
        let v = v.clamp(low, high);
        min = min.min(v);
        max = max.max(v);
    }
    raw.iter().map(move |v| match v {
        None => 0.0,
        Some(_) if max <= min => 1.0,
        Some(v) => (max - v.clamp(low, high)) / (max - min),
    })
}

/// The bounds outliers are clipped to: the median ± 3 median absolute deviations, with at
/// least three scored values and some spread; unbounded otherwise.
fn clip_bounds(raw: &[Option<f64>]) -> (f64, f64) {
    let mut values: Vec<f64> = raw.iter().flatten().copied().collect();
    if values.len() < 3 {
        return (f64::NEG_INFINITY, f64::INFINITY);
    }
    let median = median_of(&mut values);
    for v in values.iter_mut() {
        *v = (*v - median).abs();
    }
    let mad = median_of(&mut values);
    if mad == 0.0 {
        return (f64::NEG_INFINITY, f64::INFINITY);
    }
    (median - OUTLIER_MADS * mad, median + OUTLIER_MADS * mad)
}

/// The median of finite values, found by selection (linear time), reordering them.
fn median_of(values: &mut [f64]) -> f64 {
    let n = values.len();
    if n == 0 {
        return 0.0;
    }
    let (below, upper, _) = values.select_nth_unstable_by(n / 2, f64::total_cmp);
    let upper = *upper;
    if n % 2 == 1 {
        return upper;
    }
    // Even: the lower middle is the largest value left of the upper one.
    let lower = below.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lower + upper) / 2.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;
    use crate::core::ledger::Counter;
    use crate::core::pd::top_k::tests::TOP_K_DEFAULTS;
    use crate::core::profile::StrategySpec;
    use crate::proto;

    /// Standard pods with (running requests, throughput), plus a PD pair that never counts.
    fn fleet(pods: &[(&str, u32, f64)]) -> (ModelView, Ledger) {
        let mut ledger = Ledger::default();
        let mut list: Vec<proto::Pod> = pods
            .iter()
            .map(|(name, running, throughput)| {
                let mut p = pod(name, "", "", true);
                p.metrics = Some(proto::PodMetrics {
                    present: true,
                    generation_throughput: *throughput,
                    kv_cache_usage: 0.5,
                    ..Default::default()
                });
                for _ in 0..*running {
                    ledger.add(&format!("ns/{name}"), Counter::Running, 0);
                }
                p
            })
            .collect();
        list.push(pod("pre", "prefill", "g", true));
        list.push(pod("dec", "decode", "g", true));
        (
            FleetView::from_snapshot(&snapshot(list)).models["m"].clone(),
            ledger,
        )
    }

    fn blend(value: &str) -> Blend {
        match Strategy::parse(value) {
            Ok(StrategySpec::Blend(b)) => b,
            other => panic!("{value}: {other:?}"),
        }
    }

    /// `select_blend` with AIBrix's top-K knobs, which must find a pod.
    fn choose(
        m: &ModelView,
        b: &Blend,
        hint: SessionHint<'_>,
        ledger: &Ledger,
        match_pct: &[f64],
        rng: &mut fastrand::Rng,
    ) -> (Target, Option<Via>) {
        select_blend(m, b, hint, ledger, match_pct, None, &TOP_K_DEFAULTS, rng).unwrap()
    }

    fn pick(m: &ModelView, ledger: &Ledger, value: &str) -> String {
        let mut rng = fastrand::Rng::with_seed(9);
        let (t, _) = choose(
            m,
            &blend(value),
            SessionHint::default(),
            ledger,
            &[],
            &mut rng,
        );
        m.pods[t.pod()].name.clone()
    }

    #[test]
    fn the_weights_decide_between_two_signals() {
        // Pod a: 10 running, lightly loaded in tokens; pod b: 2 running, heavily.
        let (m, ledger) = fleet(&[("a", 10, 10.0), ("b", 2, 100.0)]);
        assert_eq!(pick(&m, &ledger, "least-request:10,throughput:1"), "b");
        assert_eq!(pick(&m, &ledger, "least-request:1,throughput:10"), "a");
    }

    #[test]
    fn a_pod_close_to_the_best_at_both_beats_one_best_at_either() {
        // AIBrix's "sweet spot": a exhausted in tokens, b slammed with requests, c between.
        let (m, ledger) = fleet(&[("a", 1, 1500.0), ("b", 50, 15.0), ("c", 10, 150.0)]);
        assert_eq!(pick(&m, &ledger, "least-request,throughput"), "c");
    }

    #[test]
    fn one_outlier_does_not_flatten_the_others() {
        // Without clipping, d's 10 000 tok/s would make b (100) and c (900) look alike to
        // throughput, and least-request (b 3, c 2) would take c.
        let (m, ledger) = fleet(&[
            ("a", 9, 100.0),
            ("b", 3, 100.0),
            ("c", 2, 900.0),
            ("d", 9, 10_000.0),
        ]);
        assert_eq!(pick(&m, &ledger, "least-request,throughput"), "b");
    }

    #[test]
    fn unscored_pods_score_zero_and_ties_are_uniform() {
        let (mut m, ledger) = fleet(&[("a", 0, 10.0), ("b", 0, 10.0), ("c", 0, 10.0)]);
        let mut rng = fastrand::Rng::with_seed(4);
        let b = blend("least-request,least-kv-cache");
        let mut seen = std::collections::HashSet::new();
        for _ in 0..60 {
            let (t, via) = choose(&m, &b, SessionHint::default(), &ledger, &[], &mut rng);
            assert_eq!(via, None);
            seen.insert(m.pods[t.pod()].name.clone());
        }
        assert_eq!(seen.len(), 3, "{seen:?}");
        m.pods[0].metrics = None;
        m.pods[1].metrics = None;
        for _ in 0..10 {
            let (t, _) = choose(&m, &b, SessionHint::default(), &ledger, &[], &mut rng);
            assert_eq!(m.pods[t.pod()].name, "c", "only c has a KV-cache figure");
        }
    }

    #[test]
    fn session_affinity_blends_with_load() {
        let (m, mut ledger) = fleet(&[("a", 0, 10.0), ("b", 0, 10.0), ("c", 0, 10.0)]);
        let hint = SessionHint {
            session_id: None,
            session_key: Some("chat-42"),
        };
        let sticky = session_affinity::resolve(&m, hint).unwrap().0;
        let name = format!("ns/{}", m.pods[sticky].name);
        let mut rng = fastrand::Rng::with_seed(4);
        let b = blend("session-affinity:2,least-request:1");
        let (t, via) = choose(&m, &b, hint, &ledger, &[], &mut rng);
        assert_eq!((t.pod(), via), (sticky, Some(Via::SessionKey)));
        // Busiest pod by far: affinity (2/3) still outweighs load (1/3).
        for _ in 0..20 {
            ledger.add(&name, Counter::Running, 0);
        }
        let (t, _) = choose(&m, &b, hint, &ledger, &[], &mut rng);
        assert_eq!(t.pod(), sticky);
        // With the weights turned round, load wins.
        let b = blend("session-affinity:1,least-request:2");
        let (t, _) = choose(&m, &b, hint, &ledger, &[], &mut rng);
        assert_ne!(t.pod(), sticky);
    }

    #[test]
    fn prefix_cache_in_a_blend_scores_the_match() {
        let (m, ledger) = fleet(&[("a", 3, 10.0), ("b", 0, 10.0), ("c", 0, 10.0)]);
        let mut pct = vec![0.0; m.pods.len()];
        pct[0] = 80.0;
        let mut rng = fastrand::Rng::with_seed(2);
        let mut pick = |value: &str| {
            let (t, _) = choose(
                &m,
                &blend(value),
                SessionHint::default(),
                &ledger,
                &pct,
                &mut rng,
            );
            m.pods[t.pod()].name.clone()
        };
        assert_eq!(pick("prefix-cache:2,least-request"), "a");
        assert_ne!(pick("prefix-cache,least-request:2"), "a");
    }

    #[test]
    fn a_model_without_standard_pods_is_a_selection_error() {
        let (m, ledger) = fleet(&[]);
        let mut rng = fastrand::Rng::with_seed(1);
        let r = select_blend(
            &m,
            &blend("least-request,throughput"),
            SessionHint::default(),
            &ledger,
            &[],
            None,
            &TOP_K_DEFAULTS,
            &mut rng,
        );
        assert!(matches!(r, Err(RouteError::Selection { .. })));
    }

    #[test]
    fn vtc_basic_in_a_blend_weighs_the_users_place_against_the_others() {
        let (m, ledger) = fleet(&[("a", 3, 10.0), ("b", 0, 10.0), ("c", 0, 10.0)]);
        let s = VtcSettings::default();
        let mut rng = fastrand::Rng::with_seed(4);
        let mut pick = |value: &str, place: Option<f64>| {
            let vtc = place.map(|p| (p, &s));
            let (t, _) = select_blend(
                &m,
                &blend(value),
                SessionHint::default(),
                &ledger,
                &[],
                vtc,
                &TOP_K_DEFAULTS,
                &mut rng,
            )
            .unwrap();
            m.pods[t.pod()].name.clone()
        };
        // A light user belongs on "a", the busiest pod: the heavier weight decides.
        assert_eq!(pick("vtc-basic:3,least-request", Some(0.0)), "a");
        assert_ne!(pick("vtc-basic,least-request:3", Some(0.0)), "a");
        // A heavy user belongs on "c", idle too: both agree.
        assert_eq!(pick("vtc-basic,least-request", Some(2.0)), "c");
        // No user: vtc-basic sways nothing, least-request keeps off "a".
        for _ in 0..10 {
            assert_ne!(pick("vtc-basic:10,least-request", None), "a");
        }
    }

    #[test]
    fn medians_by_selection() {
        assert_eq!(median_of(&mut []), 0.0);
        assert_eq!(median_of(&mut [4.0]), 4.0);
        assert_eq!(median_of(&mut [9.0, 1.0, 5.0]), 5.0);
        assert_eq!(median_of(&mut [100.0, 1.0, 3.0, 2.0]), 2.5);
        let mut many: Vec<f64> = (0..101).rev().map(f64::from).collect();
        assert_eq!(median_of(&mut many), 50.0);
    }

    #[test]
    fn clipping_needs_three_values_and_a_spread() {
        assert_eq!(
            clip_bounds(&[Some(1.0), Some(100.0)]),
            (f64::NEG_INFINITY, f64::INFINITY)
        );
        assert_eq!(
            clip_bounds(&[Some(5.0), Some(5.0), Some(5.0), Some(90.0)]),
            (f64::NEG_INFINITY, f64::INFINITY),
            "MAD 0"
        );
        // median 2.5, deviations [1.5, 0.5, 0.5, 97.5] → MAD 1, bounds 2.5 ± 3.
        let raw = [Some(1.0), Some(2.0), Some(3.0), None, Some(100.0)];
        assert_eq!(clip_bounds(&raw), (-0.5, 5.5));
        let s: Vec<f64> = scaled(&raw).collect();
        let expected = [1.0, 3.5 / 4.5, 2.5 / 4.5, 0.0, 0.0];
        for (got, want) in s.iter().zip(expected) {
            assert!((got - want).abs() < 1e-12, "{s:?}");
        }
    }
}
