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
use crate::trace::MixedShape;

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

/// Poisson arrivals of `sizes`, in their order, at `load` times the idealised fleet's
/// capacity (pods over the mean prefill time at the model's hit rate). For traces no run has
/// sent: the question "could any dispatcher meet the target on a trace shaped like this?"
/// needs no router, only arrivals at a comparable load.
pub fn poisson_arrivals(sizes: &[u64], model: &Model, load: f64, seed: u64) -> Vec<Arrival> {
    let uncached = 1.0 - model.hit_rate.clamp(0.0, 1.0);
    let service_ms = |tokens: u64| {
        let new_tokens = (tokens as f64 * uncached).round() as u64;
        model.timing.prefill_time(new_tokens).as_secs_f64() * 1000.0
    };
    let mean_ms = sizes.iter().map(|&s| service_ms(s)).sum::<f64>() / sizes.len().max(1) as f64;
    let per_ms = load.max(0.0) * model.pods.max(1) as f64 / mean_ms.max(f64::MIN_POSITIVE);
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut at_ms = 0.0;
    sizes
        .iter()
        .map(|&prompt_tokens| {
            // Exponential gaps; 1 - f64() lies in (0, 1], so the logarithm is finite.
            at_ms += -(1.0 - rng.f64()).ln() / per_ms;
            Arrival {
                at_ms,
                prompt_tokens,
            }
        })
        .collect()
}

/// `pd-dispatch-bound`'s command line: the bound on synthetic mixed traces, so a trace shape
/// (longer RAG prompts, more of them) can be judged before any run.
#[derive(Debug, clap::Parser)]
#[command(
    name = "pd-dispatch-bound",
    about = "What any prefill dispatcher could reach against request counting on a mixed trace"
)]
pub struct BoundArgs {
    /// Offered load, as a fraction of the idealised fleet's prefill capacity.
    #[arg(long, default_value_t = 0.9)]
    pub load: f64,
    /// Prefill pods (one FIFO lane each).
    #[arg(long, default_value_t = 4)]
    pub pods: usize,
    /// Share of prompt tokens served from the prefix cache (least_request's runs: about 0.3).
    #[arg(long, default_value_t = 0.3)]
    pub hit_rate: f64,
    /// token_load's fixed charge per request (`AIBRIX_TOKEN_LOAD_REQUEST_COST`).
    #[arg(long, default_value_t = 3500.0)]
    pub request_cost: f64,
    /// Requests per trace.
    #[arg(long, default_value_t = 4000)]
    pub entries: usize,
    /// Traces (seeds 0..N), one line each.
    #[arg(long, default_value_t = 5)]
    pub seeds: u64,
    /// Share of short chats.
    #[arg(long, default_value_t = MixedShape::default().chat_share)]
    pub chat_share: f64,
    /// Share of RAG prompts.
    #[arg(long, default_value_t = MixedShape::default().rag_share)]
    pub rag_share: f64,
    /// RAG prompt sizes in tokens, `LOW-HIGH` (pd-load's mixed trace: 1500-4000).
    #[arg(long, value_parser = token_range, default_value = "1500-4000")]
    pub rag_tokens: (u64, u64),
}

fn token_range(s: &str) -> Result<(u64, u64), String> {
    let (lo, hi) = s
        .split_once('-')
        .ok_or_else(|| format!("{s}: want LOW-HIGH"))?;
    let parse = |v: &str| v.trim().parse::<u64>().map_err(|e| format!("{v}: {e}"));
    let (lo, hi) = (parse(lo)?, parse(hi)?);
    if lo == 0 || lo > hi {
        return Err(format!("{s}: want 1 <= LOW <= HIGH"));
    }
    Ok((lo, hi))
}

/// `pd-dispatch-bound`'s main: per trace, the oracle's and token_load's charge's p99 over
/// request counting's, then the medians.
pub fn bound_main() -> std::process::ExitCode {
    use clap::Parser as _;
    let args = BoundArgs::parse();
    if !(args.chat_share >= 0.0 && args.rag_share >= 0.0 && args.chat_share + args.rag_share <= 1.0)
    {
        eprintln!("pd-dispatch-bound: --chat-share and --rag-share must be >= 0 and sum to <= 1");
        return std::process::ExitCode::FAILURE;
    }
    let model = Model {
        pods: args.pods.max(1),
        timing: TimingModel::default(),
        hit_rate: args.hit_rate,
    };
    let shape = MixedShape {
        entries: args.entries.max(1),
        chat_share: args.chat_share,
        rag_share: args.rag_share,
        rag_tokens: args.rag_tokens,
        ..MixedShape::default()
    };
    println!(
        "{} pods, {:.0} % load, hit rate {:.2}, RAG {}-{} tokens at {:.0} %; p99 to the end of \
         the prefill over request counting's",
        model.pods,
        args.load * 100.0,
        args.hit_rate,
        args.rag_tokens.0,
        args.rag_tokens.1,
        args.rag_share * 100.0
    );
    let (mut oracle, mut charge) = (Vec::new(), Vec::new());
    for seed in 0..args.seeds.max(1) {
        let sizes: Vec<u64> = crate::trace::mixed(&shape, seed)
            .iter()
            .map(|e| e.size_tokens())
            .collect();
        let arrivals = poisson_arrivals(&sizes, &model, args.load, seed);
        let o = p99_ratio_to_fewest(&arrivals, &model, Rule::LeastWorkLeft);
        let c = p99_ratio_to_fewest(
            &arrivals,
            &model,
            Rule::TokenCharge {
                request_cost: args.request_cost,
            },
        );
        println!("trace {seed}: least work left {o:.2}, token charge {c:.2}");
        oracle.push(o);
        charge.push(c);
    }
    println!(
        "median: least work left {:.2}, token charge {:.2}",
        quantile(&oracle, 0.5),
        quantile(&charge, 0.5)
    );
    std::process::ExitCode::SUCCESS
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
    fn poisson_arrivals_keep_the_sizes_and_offer_the_asked_load() {
        let sizes: Vec<u64> = (0..20_000).map(|i| 100 + (i % 7) * 500).collect();
        let m = Model {
            hit_rate: 0.3,
            ..model(4)
        };
        let arrivals = poisson_arrivals(&sizes, &m, 0.9, 7);
        assert_eq!(
            arrivals.iter().map(|a| a.prompt_tokens).collect::<Vec<_>>(),
            sizes
        );
        assert!(arrivals.windows(2).all(|w| w[0].at_ms < w[1].at_ms));
        // Offered work over the span, per pod: the load asked for, within Poisson noise.
        let work_ms: f64 = sizes
            .iter()
            .map(|&s| {
                let new = (s as f64 * 0.7).round() as u64;
                m.timing.prefill_time(new).as_secs_f64() * 1000.0
            })
            .sum();
        let span_ms = arrivals.last().map(|a| a.at_ms).unwrap_or(0.0);
        let offered = work_ms / span_ms / 4.0;
        assert!((offered - 0.9).abs() < 0.03, "{offered}");
        // The same seed gives the same trace; another seed another one.
        assert_eq!(arrivals, poisson_arrivals(&sizes, &m, 0.9, 7));
        assert_ne!(arrivals, poisson_arrivals(&sizes, &m, 0.9, 8));
    }

    #[test]
    fn token_ranges_are_low_dash_high() {
        assert_eq!(token_range("1500-4000"), Ok((1500, 4000)));
        assert_eq!(token_range("7-7"), Ok((7, 7)));
        for bad in ["4000-1500", "0-10", "10", "a-b", "-5"] {
            assert!(token_range(bad).is_err(), "{bad}");
        }
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
