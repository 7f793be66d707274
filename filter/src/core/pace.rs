//! How often a VM's timer fires. Every tick is a timer event Envoy dispatches into the VM,
//! and that dispatch alone costs tens of µs of Envoy CPU, whatever the tick then does: three
//! VMs ticking every 50 ms kept an idle gateway at ≈ 10 ms of CPU a second. A VM with nothing
//! outstanding therefore ticks at a slow period, and the first request (or any other sign of
//! work) brings the fast period back at once.
//!
//! Pure: the host reports work and ticks, and sets the period this returns.

/// After this long without work a VM's timer slows down.
pub const IDLE_AFTER_MS: u64 = 2_000;
/// The slowest a VM ever ticks. Every period the tick upholds (heartbeats, queue and journal
/// liveness, replica reports) is a second or more and its bound several seconds, so none of
/// them ages out at this pace.
pub const MAX_IDLE_TICK_MS: u64 = 1_000;

/// One VM's tick pacing.
#[derive(Debug, Clone)]
pub struct TickPace {
    fast_ms: u64,
    idle_ms: u64,
    slow: bool,
    /// Work was seen since the last tick.
    woken: bool,
    last_work_ms: u64,
}

impl TickPace {
    /// `fast_ms` is the configured period (`refresh_ms`). The idle period is at most
    /// [`MAX_IDLE_TICK_MS`] and at most a third of `stale_after_ms`, so a snapshot poll still
    /// confirms the snapshot (wait + one tick) well inside the stale bound; never below
    /// `fast_ms`.
    pub fn new(fast_ms: u64, stale_after_ms: u64) -> TickPace {
        let idle_ms = MAX_IDLE_TICK_MS.min(stale_after_ms / 3).max(fast_ms);
        TickPace {
            fast_ms,
            idle_ms,
            slow: false,
            woken: false,
            last_work_ms: 0,
        }
    }

    pub fn fast_ms(&self) -> u64 {
        self.fast_ms
    }

    pub fn is_slow(&self) -> bool {
        self.slow
    }

    /// Work arrived (a request, a changed ledger, a new snapshot). Returns the period to set
    /// now when the timer was slow; cheap otherwise, so every request may call it.
    pub fn wake(&mut self) -> Option<u64> {
        self.woken = true;
        if self.slow {
            self.slow = false;
            return Some(self.fast_ms);
        }
        None
    }

    /// One tick; `busy` says whether work is outstanding (requests in flight, queued aborts,
    /// unsent events). Returns the period to set when it changes.
    pub fn tick(&mut self, now_ms: u64, busy: bool) -> Option<u64> {
        // The first tick counts as work: a VM starts at the fast period.
        if busy || std::mem::take(&mut self.woken) || self.last_work_ms == 0 {
            self.last_work_ms = now_ms;
            if self.slow {
                self.slow = false;
                return Some(self.fast_ms);
            }
            return None;
        }
        let idle_for = now_ms.saturating_sub(self.last_work_ms);
        if !self.slow && self.idle_ms > self.fast_ms && idle_for >= IDLE_AFTER_MS {
            self.slow = true;
            return Some(self.idle_ms);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ticks every `period` ms from `from` to `to` with nothing to do; returns the periods set.
    fn idle(pace: &mut TickPace, from: u64, to: u64) -> Vec<(u64, u64)> {
        let mut set = Vec::new();
        let mut now = from;
        let mut period = pace.fast_ms;
        while now <= to {
            if let Some(p) = pace.tick(now, false) {
                set.push((now, p));
                period = p;
            }
            now += period;
        }
        set
    }

    #[test]
    fn an_idle_vm_slows_down_after_two_seconds_and_a_request_speeds_it_up_at_once() {
        let mut pace = TickPace::new(50, 10_000);
        let set = idle(&mut pace, 1_000, 10_000);
        assert_eq!(set, vec![(1_000 + IDLE_AFTER_MS, 1_000)]);
        assert!(pace.is_slow());
        assert_eq!(
            pace.wake(),
            Some(50),
            "the first request sets the fast period"
        );
        assert_eq!(pace.wake(), None, "later requests cost nothing");
        assert!(!pace.is_slow());
        // The request counts as work: two more seconds before slowing down again.
        assert_eq!(pace.tick(20_000, false), None);
        assert_eq!(pace.tick(21_950, false), None);
        assert_eq!(pace.tick(22_000, false), Some(1_000));
    }

    #[test]
    fn work_noticed_at_a_slow_tick_restores_the_fast_period() {
        let mut pace = TickPace::new(50, 10_000);
        idle(&mut pace, 1, 5_000);
        assert!(pace.is_slow());
        assert_eq!(pace.tick(6_000, true), Some(50));
        assert_eq!(pace.tick(6_050, true), None);
    }

    #[test]
    fn outstanding_work_keeps_the_fast_period() {
        let mut pace = TickPace::new(100, 10_000);
        for now in (0..10_000).step_by(100) {
            assert_eq!(pace.tick(1_000 + now, true), None);
        }
        assert!(!pace.is_slow());
    }

    #[test]
    fn the_idle_period_respects_the_stale_bound_and_the_configured_period() {
        let mut short = TickPace::new(50, 900);
        assert_eq!(idle(&mut short, 1, 5_000), vec![(1 + IDLE_AFTER_MS, 300)]);
        let mut slow_config = TickPace::new(2_000, 60_000);
        assert!(
            idle(&mut slow_config, 1, 60_000).is_empty(),
            "a period of a second or more is never changed"
        );
        let mut tight = TickPace::new(50, 100);
        assert!(idle(&mut tight, 1, 5_000).is_empty());
    }
}
