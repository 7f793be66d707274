//! A pod's drain rate: requests it finished per second over about the last minute, the window
//! AIBrix reads (`realtime_running_requests_drain_rate_1m`, and `rate(...[1m])` for the
//! standard pods' queue score). Between two 50 ms scrapes the rate is 0 in most windows and a
//! spike of 20/s in the next: Step 2's drain-ratio check would fire at random and the standard
//! pods' queue score (waiting / drain) would jump a hundredfold from one scrape to the next.
//!
//! The rate is the requests finished in the last minute over a fixed minute, so it changes only
//! when a request finishes or one leaves the window (at most once a second): a rate over the
//! elapsed time would change with every scrape, and every change is a new snapshot every VM
//! adopts, which would keep an idle gateway from ever going quiet. A pod younger than the
//! window (or a pd-control younger than it) reads low for its first minute.
//!
//! A counter that falls restarted from zero (the AIBrix rule, `rates::counter_delta`). One
//! that rises further than any engine finishes requests in a second is a glitched read (one
//! sample of 1e12 between values near 1000 would read as ~1.7e10 requests a second for a whole
//! minute): it is not counted, and becomes the base only if the next read stays up there.
//! A fall to at most [`super::rates::RESTART_SHARE`] of the previous read is a restart, counted as before;
//! a smaller fall is most often a sum missing one DP rank's series for a scrape (counted as a
//! restart, it added the other ranks' whole count, and the rank's return its own, to one
//! minute): nothing is counted until the counter is back above the base, or, if it stays
//! lower for [`super::window::FALL_TRUSTED_AFTER`], its read becomes the base uncounted.
//!
//! A pod scraped again after a gap longer than the window (its scrapes failed, its target
//! the same) starts the window afresh, as a new pod does: what it finished during the gap
//! finished over more than a minute and would read as this minute's.

use std::time::Instant;

use super::rates::counter_delta;
use super::window::WINDOW;
use super::window::{FallGuard, Move, Samples};

/// More requests than one engine finishes in a second (vLLM's largest batches finish some
/// thousands): growth beyond this per second, and beyond this within any second, is a
/// glitched read, not requests.
pub const IMPOSSIBLE_PER_SECOND: f64 = 1e6;

/// The finished-request counter of one pod over the last [`WINDOW`].
#[derive(Debug, Default)]
pub struct DrainWindow {
    /// Requests finished since tracking began, a sample a second.
    samples: Samples<f64>,
    /// Requests finished since tracking began, engine restarts folded in.
    total: f64,
    /// The last counter read taken, and when: the base of the next read's growth.
    last_raw: Option<(Instant, f64)>,
    /// A read that rose impossibly far above `last_raw`: not counted, and taken as the base
    /// only if the next read is at least as high.
    suspect: Option<f64>,
    falls: FallGuard,
}

impl DrainWindow {
    /// Takes a scrape's cumulative counter (`None` when the engine does not export it) and
    /// returns the requests finished in the last [`WINDOW`], per second.
    pub fn observe(&mut self, at: Instant, completed: Option<f64>) -> Option<f64> {
        let raw = completed.filter(|v| v.is_finite() && *v >= 0.0)?;
        let gap = self
            .last_raw
            .map(|(then, _)| at.saturating_duration_since(then));
        self.take(at, raw);
        if gap.is_some_and(|gap| gap > WINDOW) {
            self.samples.clear();
        }
        let base = self.samples.record(at, self.total)?;
        Some((self.total - base) / WINDOW.as_secs_f64())
    }

    /// Adds a counter read's growth to `total`, unless it is an impossible rise.
    fn take(&mut self, at: Instant, raw: f64) {
        let Some((then, previous)) = self.last_raw else {
            self.last_raw = Some((at, raw));
            return;
        };
        match self.falls.judge(at, previous, raw) {
            // Not a restart: a series missing from the sum, most often. Counted from the base
            // once back above it; believed only if it lasts.
            Move::Held => return,
            Move::Rebased => {
                self.suspect = None;
                self.last_raw = Some((at, raw));
                return;
            }
            Move::Rose | Move::Restarted => {}
        }
        let seconds = at.saturating_duration_since(then).as_secs_f64().max(1.0);
        if raw - previous > IMPOSSIBLE_PER_SECOND * seconds {
            if self.suspect.is_some_and(|suspect| raw >= suspect) {
                // Read twice up there: the counter did move. Growth counts from here on; the
                // jump itself, which no engine could make, does not.
                self.suspect = None;
                self.last_raw = Some((at, raw));
            } else {
                self.suspect = Some(raw);
            }
            return;
        }
        self.suspect = None;
        self.total += counter_delta(previous, raw);
        self.last_raw = Some((at, raw));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
        assert_eq!(w.observe(t0, Some(0.0)), Some(0.0), "no history yet");
        let rate = feed(&mut w, t0, 1, 199, step, &counts).unwrap();
        assert!(
            (rate - 49.0 / 60.0).abs() < 1e-9,
            "10 s in: 49 requests over the minute, {rate}"
        );
        let rate = feed(&mut w, t0, 200, 2400 - 200, step, &counts).unwrap();
        assert!((rate - 5.0).abs() < 0.2, "{rate}");
        assert!(
            w.samples.kept() <= 62,
            "history bounded: {}",
            w.samples.kept()
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
        assert!(
            (10.0..10.2).contains(&rate),
            "the base is 60-61 s old: {rate}"
        );
        let quiet = |_: usize| 1199.0;
        let rate = feed(&mut w, t0, 1200, 300, step, &quiet).unwrap();
        assert!(rate > 0.0 && rate < 10.0, "half the window quiet: {rate}");
        let rate = feed(&mut w, t0, 1500, 600, step, &quiet).unwrap();
        assert_eq!(rate, 0.0, "a minute without a finished request");
    }

    #[test]
    fn a_quiet_pod_keeps_one_value_from_scrape_to_scrape() {
        let t0 = Instant::now();
        let mut w = DrainWindow::default();
        let step = Duration::from_millis(50);
        let counts = |i: usize| if i < 100 { i as f64 } else { 99.0 };
        feed(&mut w, t0, 0, 100, step, &counts);
        let after: Vec<f64> = (100..2000)
            .filter_map(|i| w.observe(t0 + step * i as u32, Some(counts(i))))
            .collect();
        let changes = after.windows(2).filter(|p| p[0] != p[1]).count();
        assert!(
            changes <= 6,
            "changes only as finished requests leave: {changes}"
        );
        assert_eq!(after.last(), Some(&0.0));
    }

    #[test]
    fn a_restarted_engine_counts_from_zero_and_a_missing_counter_reads_none() {
        let t0 = Instant::now();
        let mut w = DrainWindow::default();
        let s = Duration::from_secs(1);
        w.observe(t0, Some(500.0));
        w.observe(t0 + s, Some(510.0));
        let rate = w.observe(t0 + 2 * s, Some(4.0)).unwrap();
        assert!((rate - 14.0 / 60.0).abs() < 1e-9, "10 + 4 finished: {rate}");
        assert_eq!(w.observe(t0 + 3 * s, None), None);
        assert_eq!(DrainWindow::default().observe(t0, Some(f64::NAN)), None);
    }

    #[test]
    fn a_sum_missing_a_rank_for_a_while_counts_no_phantom_requests() {
        let t0 = Instant::now();
        let step = Duration::from_millis(50);
        let mut w = DrainWindow::default();
        // Two DP ranks at 5e5 each, 10/s in all; one scrape in 1 s misses a rank.
        let counts = |i: usize| {
            let total = 1e6 + (i / 2) as f64;
            if (40..60).contains(&i) {
                total - 5e5
            } else {
                total
            }
        };
        feed(&mut w, t0, 0, 1200, step, &counts);
        let rate = w.observe(t0 + step * 1200, Some(counts(1200))).unwrap();
        assert!((rate - 10.0).abs() < 0.2, "{rate}");
        let rate_then = {
            let mut w = DrainWindow::default();
            feed(&mut w, t0, 0, 100, step, &counts).unwrap()
        };
        assert!(rate_then < 1.0, "5 s in: {rate_then}");

        // A rank whose engine restarted: the sum stays lower, and is believed after a while.
        let mut w = DrainWindow::default();
        let restarted = |i: usize| {
            let total = 1e6 + (i / 2) as f64;
            if i >= 100 {
                total - 5e5
            } else {
                total
            }
        };
        feed(&mut w, t0, 0, 2400, step, &restarted);
        let rate = w.observe(t0 + step * 2400, Some(restarted(2400))).unwrap();
        assert!(
            (rate - 10.0).abs() < 0.2,
            "counted again from the lower base: {rate}"
        );
    }

    #[test]
    fn a_pod_back_after_a_gap_longer_than_the_window_starts_afresh() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut w = DrainWindow::default();
        let busy = |i: usize| (10 * i) as f64;
        feed(&mut w, t0, 0, 60, s, &busy);
        // Five minutes of failed scrapes; it finished 3000 meanwhile.
        let rate = w.observe(t0 + 360 * s, Some(590.0 + 3000.0)).unwrap();
        assert_eq!(rate, 0.0, "the gap's requests are not this minute's");
        let rate = feed(&mut w, t0, 361, 60, s, &|i| {
            3590.0 + (10 * (i - 360)) as f64
        })
        .unwrap();
        assert!((rate - 10.0).abs() < 0.2, "a minute later: {rate}");
    }

    #[test]
    fn one_glitched_read_does_not_inflate_the_minute() {
        let t0 = Instant::now();
        let mut w = DrainWindow::default();
        let step = Duration::from_millis(50);
        // 10/s around 1000, one read of 1e12 in the middle.
        let counts = |i: usize| {
            if i == 300 {
                1e12
            } else {
                1000.0 + (i / 2) as f64
            }
        };
        feed(&mut w, t0, 0, 600, step, &counts);
        let rate = w.observe(t0 + step * 600, Some(counts(600))).unwrap();
        assert!(
            (rate - 5.0).abs() < 0.1,
            "30 s of 10/s over the minute: {rate}"
        );
    }

    #[test]
    fn a_restart_after_a_glitch_counts_from_zero_and_a_lasting_jump_becomes_the_base() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut w = DrainWindow::default();
        w.observe(t0, Some(1000.0));
        w.observe(t0 + s, Some(1e12));
        let rate = w.observe(t0 + 2 * s, Some(6.0)).unwrap();
        assert!(
            (rate - 6.0 / 60.0).abs() < 1e-9,
            "restarted: 6 finished, {rate}"
        );

        let mut w = DrainWindow::default();
        w.observe(t0, Some(1000.0));
        w.observe(t0 + s, Some(5e9));
        w.observe(t0 + 2 * s, Some(5e9 + 3.0));
        let rate = w.observe(t0 + 3 * s, Some(5e9 + 9.0)).unwrap();
        assert!(
            (rate - 6.0 / 60.0).abs() < 1e-9,
            "counted from the new base: {rate}"
        );
        // Plain growth, however fast an engine could go, is counted.
        let rate = w.observe(t0 + 13 * s, Some(5e9 + 9.0 + 600.0)).unwrap();
        assert!((rate - 606.0 / 60.0).abs() < 1e-9, "{rate}");
    }
}
