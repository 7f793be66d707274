//! Several routers measured in one run, request by request: arrivals are dealt to the
//! targets in a fresh random order every round, so each target sees the same stretch of the
//! machine's time.
//!
//! Why: on a shared 2-core box the latency of one request in flight moves by a factor of two
//! from one few-second run to the next (the same target's p50 0.88 ms in one run, 2.24 ms two
//! minutes later), far more than the difference between two routers. Runs alternated target
//! by target (A B A B) only average that drift out over many rounds; dealt request by request,
//! every target's distribution is drawn from the same moments, and their difference is the
//! routers'. Every target receives the same requests: round `n` plans one request and sends
//! it to each target in turn (one request in flight at a time when `--concurrency-limit 1`).
//!
//! What it does not measure: CPU per request (each target idles while the others are served,
//! so its background work would be divided by a fraction of the run's requests) and prefix
//! hit rates (the targets share pods). Run targets one at a time for those.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::client::Sender;
use crate::load::{host_port, Arrival, LoadConfig, RequestResult, RunReport};
use crate::probe;
use crate::stats::summarize;
use crate::workload::plan;

/// One router (or pod) of an interleaved run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The name its results are filed under (`<name>.<rep>.json`).
    pub name: String,
    /// Base URL, as `--url`.
    pub url: String,
}

impl Target {
    /// `NAME=URL`.
    pub fn parse(s: &str) -> Result<Target, String> {
        let (name, url) = s
            .split_once('=')
            .ok_or_else(|| format!("--target {s:?}: expected NAME=URL"))?;
        let valid = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'+'));
        if !valid {
            return Err(format!(
                "--target {s:?}: the name must be letters, digits, '-', '_' or '+'"
            ));
        }
        if url.is_empty() {
            return Err(format!("--target {s:?}: no URL"));
        }
        Ok(Target {
            name: name.to_string(),
            url: url.to_string(),
        })
    }
}

/// The order in which round `round`'s request visits the targets: a permutation drawn
/// from `rng`, so no target always follows the same one.
fn round_order(rng: &mut fastrand::Rng, targets: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..targets).collect();
    rng.shuffle(&mut order);
    order
}

/// Runs `cfg`'s open-loop arrivals (`rps` > 0) dealt over `targets`; one report per target,
/// in the order given. `cfg.url`, `cpu_pids` and `sim_admin` are ignored; with `side_pids`
/// (every process of the sitting, the targets' too) each report carries what the rest of the
/// box took during the whole run.
pub async fn run(cfg: LoadConfig, targets: &[Target]) -> Result<Vec<(String, RunReport)>, String> {
    if targets.len() < 2 {
        return Err("an interleaved run needs two --target or more".into());
    }
    if !(cfg.rps.is_finite() && cfg.rps > 0.0) || cfg.trace_timing {
        return Err("an interleaved run needs --rps > 0 (open loop)".into());
    }
    let senders = targets
        .iter()
        .map(|t| {
            let mut c = cfg.clone();
            c.url = t.url.clone();
            Sender::new(c).map(Arc::new)
        })
        .collect::<Result<Vec<_>, String>>()?;
    let box_before = if cfg.side_pids.is_empty() {
        None
    } else {
        probe::read_cpu(&[], &cfg.side_pids)
    };
    let mut plans = fastrand::Rng::with_seed(cfg.seed);
    let mut gaps = fastrand::Rng::with_seed(cfg.seed ^ 0x5eed_0f0a_da7a);
    let slots = Arc::new(Semaphore::new(cfg.concurrency_limit.max(1)));
    let mut tasks = JoinSet::new();
    let run_start = std::time::Instant::now();
    let start = tokio::time::Instant::from_std(run_start);
    let mut next = start;
    let mut delayed = vec![0u64; targets.len()];
    let mut sent = 0u64;
    let mut round = 0u64;
    'rounds: loop {
        let planned = plan(&cfg, &mut plans, round);
        for target in round_order(&mut gaps, targets.len()) {
            if cfg.requests.is_some_and(|n| sent >= n) || next - start >= cfg.duration {
                break 'rounds;
            }
            tokio::time::sleep_until(next).await;
            let permit = match slots.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    delayed[target] += 1;
                    match slots.clone().acquire_owned().await {
                        Ok(p) => p,
                        Err(_) => break 'rounds,
                    }
                }
            };
            let (sender, planned) = (senders[target].clone(), planned.clone());
            tasks.spawn(async move {
                let result = sender.send(planned).await;
                drop(permit);
                (target, result)
            });
            sent += 1;
            let gap = match cfg.arrival {
                Arrival::Fixed => 1.0 / cfg.rps,
                Arrival::Poisson => -(1.0 - gaps.f64()).ln() / cfg.rps,
            };
            next += Duration::from_secs_f64(gap.clamp(0.0, 3600.0));
        }
        round += 1;
    }
    let window = (next - start).min(cfg.duration).as_secs_f64().max(1e-9);
    let mut results: Vec<Vec<RequestResult>> = vec![Vec::new(); targets.len()];
    while let Some(joined) = tasks.join_next().await {
        if let Ok((target, r)) = joined {
            results[target].push(r);
        }
    }
    let elapsed = run_start.elapsed().as_secs_f64();
    let others = box_before.and_then(|b| {
        let a = probe::read_cpu(&[], &cfg.side_pids)?;
        probe::others_report(&b, &a)
    });
    Ok(targets
        .iter()
        .zip(results)
        .enumerate()
        .map(|(i, (t, mut results))| {
            results.sort_by_key(|r| r.seq);
            let gaps = senders[i].chunk_gaps.snapshot();
            let summary = summarize(
                &results,
                window,
                elapsed,
                delayed[i],
                &host_port(&t.url),
                &gaps,
            );
            let mut config = cfg.clone();
            config.url = t.url.clone();
            config.rps = cfg.rps / targets.len() as f64;
            config.cpu_pids = Vec::new();
            config.sim_admin = None;
            let report = RunReport {
                config,
                summary,
                prefix: None,
                cpu: None,
                others: others.clone(),
                results,
            };
            (t.name.clone(), report)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_name_and_url() {
        assert_eq!(
            Target::parse("pd-router-1p1d=http://127.0.0.1:1").unwrap(),
            Target {
                name: "pd-router-1p1d".into(),
                url: "http://127.0.0.1:1".into()
            }
        );
        for bad in [
            "http://127.0.0.1:1",
            "=http://x",
            "a b=http://x",
            "a/b=http://x",
            "a=",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_round_visits_every_target_once_in_varying_order() {
        let mut rng = fastrand::Rng::with_seed(7);
        let orders: Vec<Vec<usize>> = (0..50).map(|_| round_order(&mut rng, 4)).collect();
        for o in &orders {
            let mut sorted = o.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, vec![0, 1, 2, 3]);
        }
        // Each target leads some rounds: no fixed order.
        for t in 0..4 {
            assert!(orders.iter().any(|o| o[0] == t), "target {t} never first");
        }
    }
}
