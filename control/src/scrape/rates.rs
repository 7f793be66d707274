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

/// Per-second rate of a counter between two readings, if both exist and time has passed.
pub fn rate(previous: Option<f64>, current: Option<f64>, elapsed: Duration) -> Option<f64> {
    let (previous, current) = (previous?, current?);
    let seconds = elapsed.as_secs_f64();
    (seconds > 0.0).then(|| counter_delta(previous, current) / seconds)
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
/// `carried` the metrics derived from it, whose latency averages persist through quiet windows.
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

    let generation_rate = counter_rate(|r| r.generation_tokens);
    let generation_throughput = if engine.generation_prefers_gauge() {
        current.generation_gauge.or(generation_rate)
    } else {
        generation_rate.or(current.generation_gauge)
    };
    let prompt_throughput = counter_rate(|r| r.prompt_tokens).or(current.prompt_gauge);

    // New observations first, then the last known average, then the lifetime mean: the
    // freshest figure that actually describes this pod.
    let latency = |pick: fn(&Reading) -> Option<Histo>, carried: Option<f64>| {
        let now = pick(current)?;
        histogram_mean(prev.and_then(pick), Some(now))
            .or(carried.filter(|v| *v > 0.0))
            .or_else(|| histogram_mean(None, Some(now)))
    };
    let ttft = latency(|r| r.ttft, carried.map(|m| m.ttft_avg_seconds));
    let tpot = latency(|r| r.tpot, carried.map(|m| m.tpot_avg_seconds));

    PodMetrics {
        present: true,
        running: non_negative(current.running),
        waiting: non_negative(current.waiting),
        kv_cache_usage: non_negative(current.kv_cache_usage).min(1.0),
        prompt_throughput: non_negative(prompt_throughput),
        generation_throughput: non_negative(generation_throughput),
        // Over a minute, not between two scrapes: the caller's `drain::DrainWindow`.
        drain_rate: 0.0,
        ttft_avg_seconds: non_negative(ttft),
        tpot_avg_seconds: non_negative(tpot),
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
pub fn is_stale(
    last_success: Option<Instant>,
    last_failed: bool,
    now: Instant,
    bound: Duration,
) -> bool {
    match last_success {
        _ if last_failed => true,
        None => true,
        Some(at) => now.saturating_duration_since(at) > bound,
    }
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
        assert_eq!(rate(Some(100.0), Some(30.0), SECOND), Some(30.0));
        assert_eq!(rate(None, Some(30.0), SECOND), None);
        assert_eq!(rate(Some(1.0), Some(2.0), Duration::ZERO), None);
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
        assert!((m1.ttft_avg_seconds - 0.2).abs() < 1e-12);

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
        assert!((m2.ttft_avg_seconds - 0.5).abs() < 1e-12, "(3-2)/(12-10)");

        let quiet = vllm(1400.0, 700.0, 12.0, (3.0, 12.0));
        let m3 = derive(Engine::Vllm, &quiet, Some((&second, half)), Some(&m2));
        assert_eq!(m3.prompt_throughput, 0.0);
        assert_eq!(
            m3.ttft_avg_seconds, m2.ttft_avg_seconds,
            "carried through a quiet window"
        );

        let restarted = vllm(100.0, 50.0, 1.0, (0.1, 1.0));
        let m4 = derive(Engine::Vllm, &restarted, Some((&quiet, SECOND)), Some(&m3));
        assert_eq!(
            (m4.prompt_throughput, m4.generation_throughput),
            (100.0, 50.0)
        );
        assert!((m4.ttft_avg_seconds - 0.1).abs() < 1e-12);
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
        assert!(
            (m.ttft_avg_seconds - 0.24).abs() < 1e-12,
            "lifetime mean carried: {m:?}"
        );
        assert!((m.tpot_avg_seconds - 0.02).abs() < 1e-12);
    }

    #[test]
    fn trtllm_and_old_vllm_readings_derive() {
        let t = parse_reading(fixtures::TRTLLM, Engine::Trtllm, "Qwen3-8B");
        let m = derive(Engine::Trtllm, &t, None, None);
        assert_eq!((m.running, m.waiting), (6.0, 2.0));
        assert!((m.kv_cache_usage - 0.23).abs() < 1e-12);
        assert!((m.ttft_avg_seconds - 0.1).abs() < 1e-12);
        assert!((m.tpot_avg_seconds - 0.015).abs() < 1e-12);

        let old = parse_reading(fixtures::VLLM_OLD_DP2, Engine::Vllm, "m");
        let m = derive(Engine::Vllm, &old, None, None);
        assert!((m.kv_cache_usage - 0.4).abs() < 1e-12);
        assert!((m.tpot_avg_seconds - 0.04).abs() < 1e-12);
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
        let bound = Duration::from_millis(150);
        assert!(is_stale(None, false, t0, bound), "never scraped");
        assert!(!is_stale(
            Some(t0),
            false,
            t0 + Duration::from_millis(150),
            bound
        ));
        assert!(
            is_stale(Some(t0), false, t0 + Duration::from_millis(151), bound),
            "too old"
        );
        assert!(is_stale(Some(t0), true, t0, bound), "last scrape failed");
    }
}
