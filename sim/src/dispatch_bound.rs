//! What a prefill dispatcher could reach on a trace at best: the policy-quality runs' arrivals
//! replayed into idealised prefill pods under a few dispatch rules.
//!
//! The token_load target compares two real policies in a real router, where each run's tail
//! also carries decode steps, KV pulls, the box's noise and the luck of the trace. Whether a
//! ratio is out of reach for *any* rule that spreads prefill work needs a yardstick that has
//! none of that: each pod here is one FIFO lane (pd-sim's `--prefill-concurrency 1`), a
//! request's prefill takes pd-sim's time for its uncached tokens, and the measured hit rate is
//! spread evenly over all requests. Against it, "least work left", an oracle that knows every
//! queued prefill's duration and sends each request where it starts soonest, is the best any
//! better load estimate could give; fewest outstanding is least_request; the token charge is
//! token_load's active ledger (`request_cost + tokens`). Only the ratios between rules mean
//! anything: the absolute times leave out all the rest. Rules of another kind, such as pods
//! kept for a band of prompt lengths (Step 0's bucketing), are not modelled and can beat the
//! oracle's tail.

use crate::engine::TimingModel;

/// One request of a trace, as the load generator sent it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    /// Send time from the start of the run.
    pub at_ms: f64,
    pub prompt_tokens: u64,
}

/// How the idealised router picks a pod.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// least_request: the pod with the fewest prefills queued or running.
    FewestOutstanding,
    /// The oracle: the pod whose lane frees up first.
    LeastWorkLeft,
    /// token_load's active ledger: `request_cost + prompt tokens` summed over the pod's
    /// queued and running prefills (the whole prompt, as token_load charges without a session
    /// key).
    TokenCharge { request_cost: f64 },
}

/// The idealised prefill side.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    pub pods: usize,
    pub timing: TimingModel,
    /// Share of prompt tokens served from the prefix cache, applied to every request alike.
    pub hit_rate: f64,
}

/// One pod's lane: when it frees up, and what it still holds (finish time, charge).
#[derive(Default)]
struct Lane {
    free_at_ms: f64,
    outstanding: Vec<(f64, f64)>,
}

/// Each request's time from arrival to the end of its prefill (queue wait plus its own
/// prefill) under `rule`, in arrival order. Ties go to the lowest-numbered pod, as a fleet
/// order would break them.
pub fn prefill_times_ms(arrivals: &[Arrival], model: &Model, rule: Rule) -> Vec<f64> {
    let mut order: Vec<&Arrival> = arrivals.iter().filter(|a| a.at_ms.is_finite()).collect();
    order.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    let mut lanes: Vec<Lane> = (0..model.pods.max(1)).map(|_| Lane::default()).collect();
    let uncached = (1.0 - model.hit_rate.clamp(0.0, 1.0)).max(0.0);
    let mut out = Vec::with_capacity(order.len());
    for a in order {
        let now = a.at_ms;
        for lane in &mut lanes {
            lane.outstanding.retain(|(finish, _)| *finish > now);
        }
        let load = |lane: &Lane| match rule {
            Rule::FewestOutstanding => lane.outstanding.len() as f64,
            Rule::LeastWorkLeft => (lane.free_at_ms - now).max(0.0),
            Rule::TokenCharge { .. } => lane.outstanding.iter().map(|(_, c)| c).sum(),
        };
        let mut pick = 0;
        let mut best = f64::INFINITY;
        for (i, lane) in lanes.iter().enumerate() {
            let l = load(lane);
            if l < best {
                best = l;
                pick = i;
            }
        }
        let new_tokens = (a.prompt_tokens as f64 * uncached).round() as u64;
        let service_ms = model.timing.prefill_time(new_tokens).as_secs_f64() * 1000.0;
        let charge = match rule {
            Rule::TokenCharge { request_cost } => request_cost + a.prompt_tokens as f64,
            _ => 0.0,
        };
        let lane = &mut lanes[pick];
        let finish = lane.free_at_ms.max(now) + service_ms;
        lane.free_at_ms = finish;
        lane.outstanding.push((finish, charge));
        out.push(finish - now);
    }
    out
}

/// The nearest-rank `q` quantile (0–1) of `values`; NaN when empty. Nearest rank rather than
/// pd-load's interpolated [`crate::stats::percentile`], so each rule's p99 is one request's
/// actual time.
fn quantile(values: &[f64], q: f64) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// `rule`'s p99 over least_request's (fewest outstanding) on the same trace and model.
pub fn p99_ratio_to_fewest(arrivals: &[Arrival], model: &Model, rule: Rule) -> f64 {
    let p99 = |r| quantile(&prefill_times_ms(arrivals, model, r), 0.99);
    p99(rule) / p99(Rule::FewestOutstanding)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(pods: usize) -> Model {
        Model {
            pods,
            timing: TimingModel::default(),
            hit_rate: 0.0,
        }
    }

    fn at(at_ms: f64, prompt_tokens: u64) -> Arrival {
        Arrival {
            at_ms,
            prompt_tokens,
        }
    }

    #[test]
    fn a_short_prompt_waits_behind_a_long_one_only_under_request_counting() {
        // Pod 0 takes a 10 000-token prompt (202 ms), pod 1 a short one (4 ms); the third
        // request sees one outstanding on each, so counting sends it behind the long prompt.
        let trace = [at(0.0, 10_000), at(0.1, 100), at(0.2, 100)];
        let fewest = prefill_times_ms(&trace, &model(2), Rule::FewestOutstanding);
        let oracle = prefill_times_ms(&trace, &model(2), Rule::LeastWorkLeft);
        let charge = prefill_times_ms(
            &trace,
            &model(2),
            Rule::TokenCharge {
                request_cost: 100.0,
            },
        );
        assert!(fewest[2] > 200.0, "{fewest:?}");
        assert!(oracle[2] < 10.0, "{oracle:?}");
        assert!(charge[2] < 10.0, "{charge:?}");
        // A request cost far above the prompt sizes makes the charge count requests again:
        // a fourth request finds two on the short-prompt pod and one on the long one.
        let trace = [at(0.0, 10_000), at(0.1, 100), at(0.15, 100), at(0.2, 100)];
        let heavy = prefill_times_ms(&trace, &model(2), Rule::TokenCharge { request_cost: 1e9 });
        assert!(heavy[3] > 200.0, "{heavy:?}");
    }

    #[test]
    fn an_idle_fleet_gives_every_rule_the_bare_prefill_time() {
        let trace: Vec<Arrival> = (0..50).map(|i| at(i as f64 * 1000.0, 500)).collect();
        let bare = TimingModel::default().prefill_time(500).as_secs_f64() * 1000.0;
        for rule in [
            Rule::FewestOutstanding,
            Rule::LeastWorkLeft,
            Rule::TokenCharge {
                request_cost: 3500.0,
            },
        ] {
            let times = prefill_times_ms(&trace, &model(4), rule);
            assert!(times.iter().all(|t| (t - bare).abs() < 1e-9), "{rule:?}");
        }
        assert!((p99_ratio_to_fewest(&trace, &model(4), Rule::LeastWorkLeft) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn the_hit_rate_shortens_prefills_and_arrivals_are_taken_in_time_order() {
        let trace = [at(5.0, 1000), at(0.0, 1000)];
        let cold = prefill_times_ms(&trace, &model(1), Rule::LeastWorkLeft);
        // One lane: the request sent at 0 runs first (22 ms), the one sent at 5 waits 17 ms.
        assert!(
            (cold[0] - 22.0).abs() < 1e-9 && (cold[1] - 39.0).abs() < 1e-9,
            "{cold:?}"
        );
        let warm = prefill_times_ms(
            &trace,
            &Model {
                hit_rate: 0.5,
                ..model(1)
            },
            Rule::LeastWorkLeft,
        );
        assert!((warm[0] - 12.0).abs() < 1e-9, "{warm:?}");
    }

    #[test]
    fn quantile_is_nearest_rank_and_empty_is_nan() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert!(quantile(&[], 0.99).is_nan());
    }
}
