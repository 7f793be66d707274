//! From readings to the normalised [`PodMetrics`] the snapshot carries.
//!
//! Counters only mean something as a difference between two scrapes of the same pod, so every
//! rate here is a function of (previous reading, current reading, time between them).

use std::time::{Duration, Instant};

use super::engine::{Engine, Histo, Reading};
use crate::proto::PodMetrics;

/// Growth of a cumulative counter. A decrease means the engine restarted and counted from zero
/// since, so the current value is the growth (the AIBrix rule).
pub fn counter_delta(previous: f64, current: f64) -> f64 {
    if current >= previous {
        current - previous
    } else {
        current
    }
}

/// A token counter that falls to at most this share of its previous value restarted: the
/// engine counts again from zero, and has had little time to count since. One that falls less
/// is a bad read, most often a sum missing one DP rank's series for a scrape (8e9 read as 7e9):
/// taken for a restart, it would be 7e9 tokens in 50 ms, then the rank's return another 1e9.
pub const RESTART_SHARE: f64 = 0.1;

/// More tokens than any pod processes in a second (the largest multi-GPU pods count a few
/// million, prefix-cache hits included): growth beyond this per second, and beyond this within
/// any second (as `drain::IMPOSSIBLE_PER_SECOND`, so that one scheduler step landing in a short
/// window is not judged on its own), is a bad read, not tokens.
pub const IMPOSSIBLE_TOKENS_PER_SECOND: f64 = 1e8;

/// Whether a token counter's move from `previous` to `current` over `elapsed` cannot be the
/// engine's: a fall that is no restart ([`RESTART_SHARE`]) or an impossible rise
/// ([`IMPOSSIBLE_TOKENS_PER_SECOND`]). Such a read gives no rate.
pub fn implausible(previous: f64, current: f64, elapsed: Duration) -> bool {
    if current < previous {
        current > previous * RESTART_SHARE
    } else {
        current - previous > IMPOSSIBLE_TOKENS_PER_SECOND * elapsed.as_secs_f64().max(1.0)
    }
}

/// Per-second rate of a token counter between two readings, if both exist, time has passed
/// and the move is not [`implausible`].
pub fn rate(previous: Option<f64>, current: Option<f64>, elapsed: Duration) -> Option<f64> {
    let (previous, current) = (previous?, current?);
    let seconds = elapsed.as_secs_f64();
    (seconds > 0.0 && !implausible(previous, current, elapsed))
        .then(|| counter_delta(previous, current) / seconds)
}

/// The token counters the throughput rates are taken from.
const TOKEN_COUNTERS: [fn(&Reading) -> Option<f64>; 2] =
    [|r| r.prompt_tokens, |r| r.generation_tokens];

/// Whether a token counter moved [`implausible`]ly from `previous` to `current`: the caller
/// keeps `previous` as the base of the next rates (see `ScrapeBook::apply`), so that a read
/// missing a DP rank for one scrape costs that scrape's rates and nothing after.
pub fn glitched(previous: &Reading, current: &Reading, elapsed: Duration) -> bool {
    TOKEN_COUNTERS
        .iter()
        .any(|pick| match (pick(previous), pick(current)) {
            (Some(before), Some(now)) => implausible(before, now, elapsed),
            _ => false,
        })
}

/// Mean of the observations a histogram gained between two readings.
///
/// `None` when nothing new was observed: at a 50 ms interval most windows see no finished
/// request, and reporting zero latency for them would make an idle-looking pod out of a busy
/// one. The caller carries the previous average instead. Without a previous reading the
/// lifetime mean is the best first estimate.
pub fn histogram_mean(previous: Option<Histo>, current: Option<Histo>) -> Option<f64> {
    let current = current?;
    let (sum, count) = match previous {
        Some(p) if current.count >= p.count => (current.sum - p.sum, current.count - p.count),
        _ => (current.sum, current.count), // first reading, or the engine restarted
    };
    (count > 0.0 && sum >= 0.0).then(|| sum / count)
}

/// Builds the metrics for a successful scrape.
///
/// `previous` is the last successful reading and how long before this one it was taken;
/// `carried` the metrics derived from it, whose rates stand in for a bad read's.
/// `present`, `stale` and `last_scrape_unix_ms` are the caller's, who knows the scrape history.
pub fn derive(
    engine: Engine,
    current: &Reading,
    previous: Option<(&Reading, Duration)>,
    carried: Option<&PodMetrics>,
) -> PodMetrics {
    let (prev, elapsed) = match previous {
        Some((reading, elapsed)) => (Some(reading), elapsed),
        None => (None, Duration::ZERO),
    };
    let counter_rate =
        |pick: fn(&Reading) -> Option<f64>| rate(prev.and_then(pick), pick(current), elapsed);
    // A bad read gives no rate; the last one stands in for it rather than a zero, which would
    // show a busy pod as idle for a scrape.
    let bad_read = |pick: fn(&Reading) -> Option<f64>, last: fn(&PodMetrics) -> f64| match (
        prev.and_then(pick),
        pick(current),
    ) {
        (Some(before), Some(now)) if implausible(before, now, elapsed) => carried.map(last),
        _ => None,
    };

    let generation_rate = counter_rate(|r| r.generation_tokens);
    let generation_throughput = if engine.generation_prefers_gauge() {
        current.generation_gauge.or(generation_rate)
    } else {
        generation_rate.or(current.generation_gauge)
    }
    .or_else(|| bad_read(|r| r.generation_tokens, |m| m.generation_throughput));
    let prompt_throughput = counter_rate(|r| r.prompt_tokens)
        .or(current.prompt_gauge)
        .or_else(|| bad_read(|r| r.prompt_tokens, |m| m.prompt_throughput));

    PodMetrics {
        present: true,
        running: non_negative(current.running),
        waiting: non_negative(current.waiting),
        kv_cache_usage: non_negative(current.kv_cache_usage).min(1.0),
        prompt_throughput: non_negative(prompt_throughput),
        generation_throughput: non_negative(generation_throughput),
        // Over a minute, not between two scrapes: the caller's `drain::DrainWindow`.
        drain_rate: 0.0,
        // Over a minute, not between two scrapes: the caller's `latency::LatencyWindow`.
        ttft_avg_seconds: 0.0,
        tpot_avg_seconds: 0.0,
        last_scrape_unix_ms: 0,
        stale: false,
        engine_utilization: fraction(current.utilization),
        gpu_busy_time_ratio: fraction(current.busy_time),
    }
}

/// A 0..1 gauge that strategies skip pods without: absent stays absent (unlike
/// [`non_negative`]'s zero, which would make a pod that does not report look idle), a finite
/// value is clamped into range, and a non-finite one counts as not reported.
pub fn fraction(value: Option<f64>) -> Option<f64> {
    value.filter(|v| v.is_finite()).map(|v| v.clamp(0.0, 1.0))
}

/// Proto fields have no "absent": an unexported metric reads as zero, and nothing non-finite or
/// negative may reach the filter's arithmetic.
pub fn non_negative(value: Option<f64>) -> f64 {
    match value {
        Some(v) if v.is_finite() && v > 0.0 => v,
        _ => 0.0,
    }
}

/// Metrics stop describing the pod once a scrape fails or the last success is older than
/// `bound`; a pod never scraped successfully has nothing current to offer either.
///
/// Except while a scrape is on its way: `in_flight` is when the pending scrape was planned.
/// `bound` is a few refresh intervals (150 ms by default) while a scrape may take up to
/// `scrape_timeout` (1 s), so a pod whose `/metrics` answers in 200 ms would otherwise flip
/// between stale and fresh every cycle: half the time the gateway would hold a healthy
/// pod's metrics as missing. A scrape planned while the metrics were fresh and not yet past its timeout
/// is the pod being slow to answer, not failing: its metrics are at most `bound` +
/// `scrape_timeout` old. One past its timeout (queued for a slot, or lost) no longer counts,
/// and a scrape that fails marks the pod stale when it does.
pub fn is_stale(
    last_success: Option<Instant>,
    last_failed: bool,
    in_flight: Option<Instant>,
    now: Instant,
    bound: Duration,
    scrape_timeout: Duration,
) -> bool {
    let Some(at) = last_success.filter(|_| !last_failed) else {
        return true;
    };
    let fresh_at = |t: Instant| t.saturating_duration_since(at) <= bound;
    let answering = in_flight.is_some_and(|planned| {
        fresh_at(planned) && now.saturating_duration_since(planned) <= scrape_timeout
    });
    !fresh_at(now) && !answering
}

#[cfg(test)]
mod tests {
    use super::super::engine::{fixtures, parse_reading};
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn counter_reset_counts_from_zero() {
        assert_eq!(counter_delta(100.0, 150.0), 50.0);
        assert_eq!(counter_delta(100.0, 30.0), 30.0);
        assert_eq!(
            rate(Some(100.0), Some(150.0), Duration::from_millis(500)),
            Some(100.0)
        );
        assert_eq!(rate(Some(100.0), Some(7.0), SECOND), Some(7.0));
        assert_eq!(rate(None, Some(30.0), SECOND), None);
        assert_eq!(rate(Some(1.0), Some(2.0), Duration::ZERO), None);
    }

    #[test]
    fn a_counter_read_short_of_a_dp_rank_is_no_restart_and_its_return_no_burst() {
        let scrape = Duration::from_millis(50);
        assert_eq!(
            rate(Some(8e9), Some(7e9), scrape),
            None,
            "a rank's series missing: not 7e9 tokens in 50 ms"
        );
        assert_eq!(
            rate(Some(7e9), Some(8e9), scrape),
            None,
            "the rank back: not 2e10 tokens a second"
        );
        assert_eq!(
            rate(Some(8e9), Some(1000.0), scrape),
            Some(20_000.0),
            "a restart counts from zero, as before"
        );
        assert_eq!(rate(Some(8e9), Some(8e8), SECOND), Some(8e8), "a tenth");
        assert_eq!(
            rate(Some(1e9), Some(1e9 + 5e6), scrape),
            Some(1e8),
            "a scheduler step's worth in a short window is growth"
        );
        assert_eq!(rate(Some(0.0), Some(2e8), 2 * SECOND), Some(1e8));
        assert_eq!(rate(Some(0.0), Some(2e8), SECOND), None);
    }

    #[test]
    fn a_bad_read_keeps_the_last_throughput_and_only_the_bad_counter_is_judged() {
        let at = |prompt: f64, generation: f64| Reading {
            prompt_tokens: Some(prompt),
            generation_tokens: Some(generation),
            ..Reading::default()
        };
        let scrape = Duration::from_millis(50);
        let first = at(8e9, 4e9);
        let second = at(8e9 + 5000.0, 4e9 + 500.0);
        let m2 = derive(Engine::Vllm, &second, Some((&first, scrape)), None);
        assert_eq!(
            (m2.prompt_throughput, m2.generation_throughput),
            (100_000.0, 10_000.0)
        );
        assert!(!glitched(&first, &second, scrape));

        let short = at(7e9, 4e9 + 1000.0);
        assert!(glitched(&second, &short, scrape));
        let m3 = derive(Engine::Vllm, &short, Some((&second, scrape)), Some(&m2));
        assert_eq!(
            (m3.prompt_throughput, m3.generation_throughput),
            (100_000.0, 10_000.0),
            "the bad prompt counter keeps its last rate; generation is read as usual"
        );
        let m3 = derive(Engine::Vllm, &short, Some((&second, scrape)), None);
        assert_eq!(m3.prompt_throughput, 0.0, "nothing to keep");

        let restarted = at(3000.0, 100.0);
        assert!(!glitched(&second, &restarted, scrape));
    }

    #[test]
    fn histogram_means_use_deltas_and_skip_quiet_windows() {
        let h = |sum, count| Some(Histo { sum, count });
        assert_eq!(
            histogram_mean(None, h(6.0, 60.0)),
            Some(0.1),
            "lifetime mean first"
        );
        assert_eq!(histogram_mean(h(6.0, 60.0), h(8.0, 70.0)), Some(0.2));
        assert_eq!(
            histogram_mean(h(6.0, 60.0), h(6.0, 60.0)),
            None,
            "nothing new observed"
        );
        assert_eq!(
            histogram_mean(h(6.0, 60.0), h(1.5, 5.0)),
            Some(0.3),
            "restart"
        );
        assert_eq!(histogram_mean(None, h(0.0, 0.0)), None);
    }

    fn vllm(prompt: f64, generation: f64, done: f64, ttft: (f64, f64)) -> Reading {
        Reading {
            running: Some(4.0),
            waiting: Some(1.0),
            kv_cache_usage: Some(0.25),
            prompt_tokens: Some(prompt),
            generation_tokens: Some(generation),
            completed: Some(done),
            ttft: Some(Histo {
                sum: ttft.0,
                count: ttft.1,
            }),
            ..Reading::default()
        }
    }

    #[test]
    fn vllm_rates_between_two_scrapes() {
        let first = vllm(1000.0, 500.0, 10.0, (2.0, 10.0));
        let m1 = derive(Engine::Vllm, &first, None, None);
        assert!(m1.present);
        assert_eq!(
            (m1.running, m1.waiting, m1.kv_cache_usage),
            (4.0, 1.0, 0.25)
        );
        assert_eq!((m1.prompt_throughput, m1.generation_throughput), (0.0, 0.0));

        let second = vllm(1400.0, 700.0, 12.0, (3.0, 12.0));
        let half = Duration::from_millis(500);
        let m2 = derive(Engine::Vllm, &second, Some((&first, half)), Some(&m1));
        assert_eq!(
            (m2.prompt_throughput, m2.generation_throughput),
            (800.0, 400.0)
        );
        assert_eq!(
            m2.drain_rate, 0.0,
            "a minute's rate, the caller's (drain.rs)"
        );
        assert_eq!(
            m2.ttft_avg_seconds, 0.0,
            "a minute's mean, the caller's (latency.rs)"
        );

        let quiet = vllm(1400.0, 700.0, 12.0, (3.0, 12.0));
        let m3 = derive(Engine::Vllm, &quiet, Some((&second, half)), Some(&m2));
        assert_eq!(m3.prompt_throughput, 0.0);

        let restarted = vllm(100.0, 50.0, 1.0, (0.1, 1.0));
        let m4 = derive(Engine::Vllm, &restarted, Some((&quiet, SECOND)), Some(&m3));
        assert_eq!(
            (m4.prompt_throughput, m4.generation_throughput),
            (100.0, 50.0)
        );
    }

    #[test]
    fn sglang_generation_comes_from_its_gauge_and_prompt_from_the_counter() {
        let a = parse_reading(
            fixtures::SGLANG_DECODE,
            Engine::Sglang,
            "deepseek-ai/DeepSeek-V3",
        );
        let mut b = a.clone();
        b.prompt_tokens = a.prompt_tokens.map(|v| v + 5000.0);
        b.completed = a.completed.map(|v| v + 20.0);
        b.generation_tokens = Some(1e9); // must not override the gauge
        let m = derive(Engine::Sglang, &b, Some((&a, SECOND)), None);
        assert_eq!(m.generation_throughput, 2931.5);
        assert_eq!(m.prompt_throughput, 5000.0);
        let mean = |h| histogram_mean(None, h).unwrap_or_default();
        assert!((mean(b.ttft) - 0.24).abs() < 1e-12, "{b:?}");
        assert!((mean(b.tpot) - 0.02).abs() < 1e-12);
    }

    #[test]
    fn trtllm_and_old_vllm_readings_derive() {
        let t = parse_reading(fixtures::TRTLLM, Engine::Trtllm, "Qwen3-8B");
        let m = derive(Engine::Trtllm, &t, None, None);
        assert_eq!((m.running, m.waiting), (6.0, 2.0));
        assert!((m.kv_cache_usage - 0.23).abs() < 1e-12);
        let mean = |h| histogram_mean(None, h).unwrap_or_default();
        assert!((mean(t.ttft) - 0.1).abs() < 1e-12);
        assert!((mean(t.tpot) - 0.015).abs() < 1e-12);

        let old = parse_reading(fixtures::VLLM_OLD_DP2, Engine::Vllm, "m");
        let m = derive(Engine::Vllm, &old, None, None);
        assert!((m.kv_cache_usage - 0.4).abs() < 1e-12);
        assert!((mean(old.tpot) - 0.04).abs() < 1e-12);
    }

    #[test]
    fn utilization_gauges_stay_absent_when_not_exported_and_are_clamped_when_they_are() {
        let m = derive(Engine::Vllm, &Reading::default(), None, None);
        assert_eq!((m.engine_utilization, m.gpu_busy_time_ratio), (None, None));
        let r = Reading {
            utilization: Some(1.5),
            busy_time: Some(f64::NAN),
            ..Reading::default()
        };
        let m = derive(Engine::Vllm, &r, None, None);
        assert_eq!(
            (m.engine_utilization, m.gpu_busy_time_ratio),
            (Some(1.0), None)
        );
        assert_eq!(fraction(Some(-0.2)), Some(0.0));
    }

    #[test]
    fn v0_gauges_fill_in_when_counters_are_missing() {
        let r = Reading {
            generation_gauge: Some(120.0),
            prompt_gauge: Some(900.0),
            kv_cache_usage: Some(1.7),
            running: Some(-1.0),
            ..Reading::default()
        };
        let m = derive(Engine::Vllm, &r, Some((&r, SECOND)), None);
        assert_eq!(
            (m.generation_throughput, m.prompt_throughput),
            (120.0, 900.0)
        );
        assert_eq!((m.kv_cache_usage, m.running), (1.0, 0.0), "clamped");
    }

    #[test]
    fn staleness() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let bound = Duration::from_millis(150);
        let timeout = SECOND;
        let stale =
            |last, failed, in_flight, now| is_stale(last, failed, in_flight, now, bound, timeout);
        assert!(stale(None, false, None, t0), "never scraped");
        assert!(
            stale(None, false, Some(t0), ms(10)),
            "never scraped, one in flight"
        );
        assert!(!stale(Some(t0), false, None, ms(150)));
        assert!(stale(Some(t0), false, None, ms(151)), "too old");
        assert!(stale(Some(t0), true, None, t0), "last scrape failed");
        assert!(
            stale(Some(t0), true, Some(ms(50)), ms(60)),
            "last scrape failed, one in flight"
        );
    }

    #[test]
    fn a_slow_scrape_on_its_way_keeps_the_metrics_fresh_until_its_timeout() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let (bound, timeout) = (Duration::from_millis(150), SECOND);
        let stale = |in_flight, now| is_stale(Some(t0), false, in_flight, now, bound, timeout);
        assert!(
            !stale(Some(ms(50)), ms(200)),
            "a 200 ms answer on its way: not stale"
        );
        assert!(!stale(Some(ms(50)), ms(1_050)), "at its timeout");
        assert!(stale(Some(ms(50)), ms(1_051)), "past its timeout");
        assert!(
            stale(Some(ms(151)), ms(200)),
            "planned when the metrics were stale already"
        );
        assert!(stale(None, ms(200)), "nothing on its way");
    }
}
