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

/// A new timer period to set, and whether the VM went idle or woke with it (the
/// `pd_router_idle_vms` gauge counts VMs at the idle period).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retick {
    pub period_ms: u64,
    pub slow_changed: bool,
}

/// One VM's tick pacing.
#[derive(Debug, Clone)]
pub struct TickPace {
    fast_ms: u64,
    idle_ms: u64,
    slow: bool,
    /// Work was seen since the last tick.
    woken: bool,
    last_work_ms: u64,
    /// The longest period that lets this VM read the other workers' prefix rings before they
    /// lap it (see `core::prefix::follow`), whether it is idle or not.
    follow_ms: Option<u64>,
    /// The period last handed out.
    set_ms: u64,
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
            follow_ms: None,
            set_ms: fast_ms,
        }
    }

    pub fn fast_ms(&self) -> u64 {
        self.fast_ms
    }

    pub fn is_slow(&self) -> bool {
        self.slow
    }

    /// The period the state asks for, against the one last handed out.
    fn retick(&mut self, was_slow: bool) -> Option<Retick> {
        let base = if self.slow {
            self.idle_ms
        } else {
            self.fast_ms
        };
        let period = self.follow_ms.map_or(base, |f| f.min(base));
        if period == self.set_ms && was_slow == self.slow {
            return None;
        }
        self.set_ms = period;
        Some(Retick {
            period_ms: period,
            slow_changed: was_slow != self.slow,
        })
    }

    /// Work arrived (a request, a changed ledger, a new snapshot). Returns the period to set
    /// now when the timer was slow; cheap otherwise, so every request may call it.
    pub fn wake(&mut self) -> Option<Retick> {
        self.woken = true;
        if self.slow {
            self.slow = false;
            return self.retick(true);
        }
        None
    }

    /// One tick; `busy` says whether work is outstanding (requests in flight, queued aborts,
    /// unsent events). Returns the period to set when it changes.
    pub fn tick(&mut self, now_ms: u64, busy: bool) -> Option<Retick> {
        let was_slow = self.slow;
        // The first tick counts as work: a VM starts at the fast period.
        if busy || std::mem::take(&mut self.woken) || self.last_work_ms == 0 {
            self.last_work_ms = now_ms;
            self.slow = false;
            return self.retick(was_slow);
        }
        let idle_for = now_ms.saturating_sub(self.last_work_ms);
        if !self.slow && self.idle_ms > self.fast_ms && idle_for >= IDLE_AFTER_MS {
            self.slow = true;
        }
        self.retick(was_slow)
    }

    /// The period reading the other workers' prefix rings needs now (`None`: any will do).
    /// An idle VM that follows a busy one ticks at that period without counting as busy.
    pub fn follow(&mut self, need_ms: Option<u64>) -> Option<Retick> {
        if need_ms == self.follow_ms {
            return None;
        }
        self.follow_ms = need_ms;
        let slow = self.slow;
        self.retick(slow)
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
            if let Some(r) = pace.tick(now, false) {
                set.push((now, r.period_ms));
                period = r.period_ms;
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
            Some(Retick {
                period_ms: 50,
                slow_changed: true
            }),
            "the first request sets the fast period"
        );
        assert_eq!(pace.wake(), None, "later requests cost nothing");
        assert!(!pace.is_slow());
        // The request counts as work: two more seconds before slowing down again.
        assert_eq!(pace.tick(20_000, false), None);
        assert_eq!(pace.tick(21_950, false), None);
        assert_eq!(pace.tick(22_000, false).map(|r| r.period_ms), Some(1_000));
    }

    #[test]
    fn work_noticed_at_a_slow_tick_restores_the_fast_period() {
        let mut pace = TickPace::new(50, 10_000);
        idle(&mut pace, 1, 5_000);
        assert!(pace.is_slow());
        assert_eq!(
            pace.tick(6_000, true),
            Some(Retick {
                period_ms: 50,
                slow_changed: true
            })
        );
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

    #[test]
    fn following_a_busy_writer_shortens_the_period_without_waking_the_vm() {
        let mut pace = TickPace::new(100, 10_000);
        idle(&mut pace, 1, 5_000);
        assert!(pace.is_slow());
        // The others publish fast: an idle VM ticks at what reading needs, still idle.
        assert_eq!(
            pace.follow(Some(32)),
            Some(Retick {
                period_ms: 32,
                slow_changed: false
            })
        );
        assert!(pace.is_slow());
        assert_eq!(pace.follow(Some(32)), None, "the same need sets nothing");
        assert_eq!(pace.tick(6_000, false), None);
        // A request wakes it: the fast period is longer than the need, which still rules.
        assert_eq!(
            pace.wake(),
            Some(Retick {
                period_ms: 32,
                slow_changed: true
            })
        );
        // A need longer than the period in force changes nothing.
        assert_eq!(
            pace.follow(Some(512)),
            Some(Retick {
                period_ms: 100,
                slow_changed: false
            })
        );
        assert_eq!(pace.follow(None), None, "already at the fast period");
        // Idle again, the writers quiet: back to the idle period.
        let set = idle(&mut pace, 10_000, 20_000);
        assert_eq!(set, vec![(10_000 + IDLE_AFTER_MS, 1_000)]);
        assert_eq!(pace.follow(Some(64)).map(|r| r.period_ms), Some(64));
        assert_eq!(pace.follow(None).map(|r| r.period_ms), Some(1_000));
    }
}
