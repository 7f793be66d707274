//! A pod's mean time to first token (and per output token) over about the last minute, from
//! the engine's cumulative histogram (`_sum` and `_count`).
//!
//! Why a window: between two 50 ms scrapes a histogram gains one observation or none, so the
//! mean of one scrape's delta is one request's latency, and it was carried through every quiet
//! scrape for as long as the pod lived. Under `least-latency` (and conductor's prefill score)
//! a pod whose last request happened to be slow then never got another request, and so never
//! a new figure: it starved while a sibling took everything. Over a minute the figure follows
//! the pod's recent requests, and a pod that served none in the last minute has none (0, which
//! the strategies take as no known delay), so it gets a request and a fresh figure.
//!
//! Until the window has seen a minute (pd-control or the pod just started), the lifetime mean
//! stands in while no observation has come: it describes the pod, where nothing else does.
//!
//! Reads are taken as `drain::DrainWindow` takes the finished-request counter: a count that
//! falls to at most [`super::rates::RESTART_SHARE`] of the last is a restart; one that falls less (a sum
//! missing one DP rank's series) counts nothing until it is back, or is believed after
//! [`super::window::FALL_TRUSTED_AFTER`]; after a scrape gap longer than the window it starts afresh.

use std::time::Instant;

use super::engine::Histo;
use super::rates::histogram_mean;
use super::window::{FallGuard, Move, Samples, WINDOW};

/// The observations of one latency histogram over the last [`WINDOW`].
#[derive(Debug, Default)]
pub struct LatencyWindow {
    /// (sum, count) of everything observed since tracking began, a sample a second.
    samples: Samples<(f64, f64)>,
    /// Sum and count since tracking began, engine restarts folded in.
    total: (f64, f64),
    /// The last histogram read: the base of the next read's growth.
    last: Option<Histo>,
    /// When tracking began.
    since: Option<Instant>,
    /// When the last read was taken.
    last_at: Option<Instant>,
    falls: FallGuard,
}

impl LatencyWindow {
    /// Takes a scrape's histogram (`None` when the engine does not export it) and returns the
    /// mean of what it observed in the last [`WINDOW`], if anything.
    pub fn observe(&mut self, at: Instant, histo: Option<Histo>) -> Option<f64> {
        let histo = histo.filter(|h| {
            h.sum.is_finite() && h.count.is_finite() && h.sum >= 0.0 && h.count >= 0.0
        })?;
        if self
            .last_at
            .is_some_and(|then| at.saturating_duration_since(then) > WINDOW)
        {
            // Back after a gap: what it observed meanwhile is not this minute's.
            self.samples.clear();
            self.since = None;
        }
        self.last_at = Some(at);
        let since = *self.since.get_or_insert(at);
        match self
            .last
            .map(|last| (last, self.falls.judge(at, last.count, histo.count)))
        {
            Some((last, Move::Rose)) => {
                self.total.0 += (histo.sum - last.sum).max(0.0);
                self.total.1 += histo.count - last.count;
                self.last = Some(histo);
            }
            // A restarted engine: what it counts now is all new.
            Some((_, Move::Restarted)) => {
                self.total.0 += histo.sum;
                self.total.1 += histo.count;
                self.last = Some(histo);
            }
            // A series missing from the sum, most often: nothing counted until it is back,
            // believed only if it lasts.
            Some((_, Move::Held)) => {}
            Some((_, Move::Rebased)) | None => self.last = Some(histo),
        }
        let (base_sum, base_count) = self.samples.record(at, self.total)?;
        let count = self.total.1 - base_count;
        if count > 0.0 {
            return Some((self.total.0 - base_sum) / count);
        }
        let young = at.saturating_duration_since(since) < WINDOW;
        young.then(|| histogram_mean(None, Some(histo))).flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn h(sum: f64, count: f64) -> Option<Histo> {
        Some(Histo { sum, count })
    }

    #[test]
    fn the_mean_covers_the_last_minute_not_the_last_scrape() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut w = LatencyWindow::default();
        assert_eq!(
            w.observe(t0, h(10.0, 100.0)),
            Some(0.1),
            "lifetime mean at first"
        );
        // Two requests: 0.3 s, then 0.1 s, seconds apart; quiet scrapes in between keep the
        // minute's mean, not the last request's.
        let near = |v: Option<f64>, want: f64| v.is_some_and(|v| (v - want).abs() < 1e-9);
        let one = w.observe(t0 + s, h(10.3, 101.0));
        assert!(near(one, 0.3), "{one:?}");
        let quiet = w.observe(t0 + 2 * s, h(10.3, 101.0));
        assert!(near(quiet, 0.3), "{quiet:?}");
        let both = w.observe(t0 + 3 * s, h(10.4, 102.0)).unwrap();
        assert!((both - 0.2).abs() < 1e-9, "{both}");
        assert_eq!(w.observe(t0, None), None, "not exported");
    }

    #[test]
    fn one_slow_request_does_not_describe_the_pod_for_ever() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut w = LatencyWindow::default();
        w.observe(t0, h(0.0, 0.0));
        assert_eq!(
            w.observe(t0 + s, h(2.0, 1.0)),
            Some(2.0),
            "one slow request"
        );
        let mut last = None;
        for i in 2..=70 {
            last = w.observe(t0 + i * s, h(2.0, 1.0));
        }
        assert_eq!(
            last, None,
            "a minute without a request: no figure, so it gets one"
        );
    }

    #[test]
    fn a_sum_missing_a_rank_or_a_scrape_gap_does_not_mix_old_observations_in() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut w = LatencyWindow::default();
        // Two DP ranks, 1000 observations each at 0.1 s; then requests at 0.5 s.
        w.observe(t0, h(200.0, 2000.0));
        w.observe(t0 + s, h(200.5, 2001.0));
        let missing = w.observe(t0 + 2 * s, h(100.5, 1001.0));
        let back = w.observe(t0 + 3 * s, h(201.0, 2002.0)).unwrap();
        assert!(
            missing.is_some_and(|m| (m - 0.5).abs() < 1e-9),
            "{missing:?}"
        );
        assert!(
            (back - 0.5).abs() < 1e-9,
            "the rank's return adds its lifetime: {back}"
        );

        // Five minutes without an answered scrape, then one slow request: the gap's are not
        // this minute's.
        let mut w = LatencyWindow::default();
        for i in 0..70 {
            w.observe(t0 + i * s, h(0.1 * i as f64, i as f64));
        }
        let after = w.observe(t0 + 400 * s, h(7.0 + 20.0, 70.0 + 100.0 + 1.0));
        assert!(
            after.is_some_and(|m| (m - 27.0 / 171.0).abs() < 1e-9),
            "starts afresh (lifetime mean while young): {after:?}"
        );
    }

    #[test]
    fn a_restarted_engine_counts_from_zero() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut w = LatencyWindow::default();
        w.observe(t0, h(50.0, 100.0));
        w.observe(t0 + s, h(50.5, 101.0));
        let mean = w.observe(t0 + 2 * s, h(0.7, 1.0)).unwrap();
        assert!(
            (mean - 0.6).abs() < 1e-9,
            "0.5 then 0.7 after the restart: {mean}"
        );
    }
}
