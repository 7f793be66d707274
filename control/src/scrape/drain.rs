//! A pod's drain rate: requests it finished per second over about the last minute, the window
//! AIBrix reads (`realtime_running_requests_drain_rate_1m`, and `rate(...[1m])` for the
//! standard pods' queue score). Between two 50 ms scrapes the rate is 0 in most windows and a
//! spike of 20/s in the next: Step 2's drain-ratio check would fire at random and the standard
//! pods' queue score (waiting / drain) would jump a hundredfold from one scrape to the next.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::rates::counter_delta;

/// How far back the rate looks.
pub const WINDOW: Duration = Duration::from_secs(60);
/// One kept sample a second bounds a pod's history at about 61 entries, at any scrape rate.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// The finished-request counter of one pod over the last [`WINDOW`].
#[derive(Debug, Default)]
pub struct DrainWindow {
    /// (when, requests finished since tracking began) at most one per [`SAMPLE_EVERY`].
    samples: VecDeque<(Instant, f64)>,
    /// Requests finished since tracking began, engine restarts folded in.
    total: f64,
    last_raw: Option<f64>,
}

impl DrainWindow {
    /// Takes a scrape's cumulative counter (`None` when the engine does not export it) and
    /// returns the rate over the history kept, up to [`WINDOW`]; `None` until a second of
    /// history exists, since a shorter base is the noise this window is for.
    pub fn observe(&mut self, at: Instant, completed: Option<f64>) -> Option<f64> {
        let raw = completed.filter(|v| v.is_finite() && *v >= 0.0)?;
        if let Some(previous) = self.last_raw {
            self.total += counter_delta(previous, raw);
        }
        self.last_raw = Some(raw);
        let due = self
            .samples
            .back()
            .is_none_or(|(t, _)| at.saturating_duration_since(*t) >= SAMPLE_EVERY);
        if due {
            self.samples.push_back((at, self.total));
        }
        // Keep the newest sample at least WINDOW old as the base, drop the ones before it.
        while self.samples.len() > 1 && at.saturating_duration_since(self.samples[1].0) >= WINDOW {
            self.samples.pop_front();
        }
        let (since, base) = *self.samples.front()?;
        let seconds = at.saturating_duration_since(since).as_secs_f64();
        (seconds >= SAMPLE_EVERY.as_secs_f64()).then(|| (self.total - base) / seconds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `per_scrape` finished requests every `step` for `scrapes` scrapes.
    fn feed(
        w: &mut DrainWindow,
        t0: Instant,
        from: usize,
        scrapes: usize,
        step: Duration,
        counts: &dyn Fn(usize) -> f64,
    ) -> Option<f64> {
        let mut rate = None;
        for i in from..from + scrapes {
            rate = w.observe(t0 + step * i as u32, Some(counts(i)));
        }
        rate
    }

    #[test]
    fn a_steady_pod_reads_its_rate_not_the_noise_of_one_scrape() {
        let t0 = Instant::now();
        let mut w = DrainWindow::default();
        let step = Duration::from_millis(50);
        // One request finishes every 4th scrape (5/s), in bursts a 50 ms delta would read as
        // 20/s or 0/s.
        let counts = |i: usize| (i / 4) as f64;
        assert_eq!(w.observe(t0, Some(0.0)), None, "no history yet");
        assert_eq!(
            feed(&mut w, t0, 1, 10, step, &counts),
            None,
            "under a second of history"
        );
        let rate = feed(&mut w, t0, 11, 2400 - 11, step, &counts).unwrap();
        assert!((rate - 5.0).abs() < 0.2, "{rate}");
        assert!(
            w.samples.len() <= 62,
            "history bounded: {}",
            w.samples.len()
        );
    }

    #[test]
    fn the_rate_follows_the_last_minute_only() {
        let t0 = Instant::now();
        let mut w = DrainWindow::default();
        let step = Duration::from_millis(100);
        // 10/s for two minutes, then nothing for a minute and a half.
        let busy = |i: usize| i as f64;
        let rate = feed(&mut w, t0, 0, 1200, step, &busy).unwrap();
        assert!((rate - 10.0).abs() < 0.1, "{rate}");
        let quiet = |_: usize| 1199.0;
        let rate = feed(&mut w, t0, 1200, 300, step, &quiet).unwrap();
        assert!(rate > 0.0 && rate < 10.0, "half the window quiet: {rate}");
        let rate = feed(&mut w, t0, 1500, 600, step, &quiet).unwrap();
        assert_eq!(rate, 0.0, "a minute without a finished request");
    }

    #[test]
    fn a_restarted_engine_counts_from_zero_and_a_missing_counter_reads_none() {
        let t0 = Instant::now();
        let mut w = DrainWindow::default();
        let s = Duration::from_secs(1);
        w.observe(t0, Some(500.0));
        w.observe(t0 + s, Some(510.0));
        let rate = w.observe(t0 + 2 * s, Some(4.0)).unwrap();
        assert!((rate - 7.0).abs() < 1e-9, "(10 + 4) / 2 s: {rate}");
        assert_eq!(w.observe(t0 + 3 * s, None), None);
        assert_eq!(DrainWindow::default().observe(t0, Some(f64::NAN)), None);
    }
}
