//! What the one-minute figures (`drain::DrainWindow`, `latency::LatencyWindow`) share: the
//! per-second history of a running total, and the judgement of a cumulative counter that reads
//! lower than before.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::rates::RESTART_SHARE;

/// How far back the one-minute figures look.
pub const WINDOW: Duration = Duration::from_secs(60);
/// One kept sample a second bounds a pod's history at about 61 entries, at any scrape rate.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// How long a counter may read lower than its base, by less than a restart would, before
/// the lower read is believed (a DP rank's engine restarted, its count from zero).
pub const FALL_TRUSTED_AFTER: Duration = Duration::from_secs(5);

/// A running total's values, at most one a second, back to the newest one at least
/// [`WINDOW`] old.
#[derive(Debug)]
pub struct Samples<T> {
    ring: VecDeque<(Instant, T)>,
}

impl<T> Default for Samples<T> {
    fn default() -> Self {
        Samples {
            ring: VecDeque::new(),
        }
    }
}

impl<T: Copy> Samples<T> {
    /// Keeps `total` as of `at` (unless a sample was kept less than a second ago) and returns
    /// the base the window's growth is measured from.
    pub fn record(&mut self, at: Instant, total: T) -> Option<T> {
        let due = self
            .ring
            .back()
            .is_none_or(|(t, _)| at.saturating_duration_since(*t) >= SAMPLE_EVERY);
        if due {
            self.ring.push_back((at, total));
        }
        // Keep the newest sample at least WINDOW old as the base, drop the ones before it.
        while self.ring.len() > 1 && at.saturating_duration_since(self.ring[1].0) >= WINDOW {
            self.ring.pop_front();
        }
        self.ring.front().map(|(_, base)| *base)
    }

    /// Forgets the history (a pod back after a gap longer than the window).
    pub fn clear(&mut self) {
        self.ring.clear();
    }

    /// Samples kept (the tests bound the history with it).
    #[cfg(test)]
    pub fn kept(&self) -> usize {
        self.ring.len()
    }
}

/// How a cumulative counter's read compares with the last one taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Move {
    /// As high or higher.
    Rose,
    /// Down to at most [`RESTART_SHARE`] of it: the engine restarted and counts from zero.
    Restarted,
    /// Lower, by less than a restart: most often a sum missing one DP rank's series for a
    /// scrape. Nothing is counted; the last read stays the base.
    Held,
    /// Lower like that for [`FALL_TRUSTED_AFTER`]: believed, the new base, nothing counted.
    Rebased,
}

/// Judges reads that fall, remembering since when they have.
#[derive(Debug, Default)]
pub struct FallGuard {
    fallen_since: Option<Instant>,
}

impl FallGuard {
    pub fn judge(&mut self, at: Instant, previous: f64, current: f64) -> Move {
        if current >= previous || current <= previous * RESTART_SHARE {
            self.fallen_since = None;
            return if current >= previous {
                Move::Rose
            } else {
                Move::Restarted
            };
        }
        let since = *self.fallen_since.get_or_insert(at);
        if at.saturating_duration_since(since) >= FALL_TRUSTED_AFTER {
            self.fallen_since = None;
            Move::Rebased
        } else {
            Move::Held
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn falls_are_restarts_held_reads_or_after_a_while_the_new_base() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut g = FallGuard::default();
        assert_eq!(g.judge(t0, 100.0, 100.0), Move::Rose);
        assert_eq!(g.judge(t0, 100.0, 5.0), Move::Restarted);
        assert_eq!(g.judge(t0, 100.0, 60.0), Move::Held);
        assert_eq!(g.judge(t0 + 4 * s, 100.0, 60.0), Move::Held);
        assert_eq!(g.judge(t0 + 5 * s, 100.0, 61.0), Move::Rebased);
        assert_eq!(g.judge(t0 + 6 * s, 100.0, 60.0), Move::Held, "a new fall");
    }
}
