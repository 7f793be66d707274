//! When the fleet snapshot counts as stale: pd-control has not confirmed it (a successful
//! poll, answered with a new snapshot or "not modified") for longer than the configured bound.
//! Pure, so the host only feeds it clock readings and acts on the transitions.

/// A change of state the host reports (a log line, the gauge) exactly once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    BecameStale { age_ms: u64 },
    BecameFresh { age_ms: u64 },
}

/// One VM's view of its snapshot's freshness.
#[derive(Debug, Clone, Default)]
pub struct Freshness {
    stale: bool,
}

impl Freshness {
    pub fn is_stale(&self) -> bool {
        self.stale
    }

    /// Age of the snapshot at `now_ms` given the last confirmation (0 when the clock reads
    /// earlier than the confirmation: clocks of different workers may disagree slightly).
    pub fn age_ms(now_ms: u64, confirmed_at_ms: u64) -> u64 {
        now_ms.saturating_sub(confirmed_at_ms)
    }

    /// Updates the state for the age at `now_ms`; returns the transition, if any. Stale
    /// means strictly older than `stale_after_ms`.
    pub fn observe(
        &mut self,
        now_ms: u64,
        confirmed_at_ms: u64,
        stale_after_ms: u64,
    ) -> Option<Transition> {
        self.observe_age(Self::age_ms(now_ms, confirmed_at_ms), stale_after_ms)
    }

    /// [`Freshness::observe`] for an age already known (see [`ConfirmationAge`]).
    pub fn observe_age(&mut self, age_ms: u64, stale_after_ms: u64) -> Option<Transition> {
        let stale = age_ms > stale_after_ms;
        if stale == self.stale {
            return None;
        }
        self.stale = stale;
        Some(if stale {
            Transition::BecameStale { age_ms }
        } else {
            Transition::BecameFresh { age_ms }
        })
    }
}

/// The age of the process's last confirmation, counted on one VM's monotonic clock from the
/// moment the VM first saw it. The confirmation is a wall-clock time (every VM of the process
/// reads it from shared data); aged on the wall clock, a step back of the clock while
/// pd-control is down kept the snapshot fresh for as long as the step, and a step forward
/// made it stale at once. Only the age at first sight is read from the wall clock (a VM
/// started while pd-control is down must find its inherited snapshot as old as it is).
#[derive(Debug, Clone, Default)]
pub struct ConfirmationAge {
    /// The confirmation seen last, its age then, and this VM's monotonic time then.
    seen: Option<(u64, u64, u64)>,
}

impl ConfirmationAge {
    pub fn age_ms(&mut self, wall_now_ms: u64, confirmed_at_ms: u64, steady_now_ms: u64) -> u64 {
        match self.seen {
            Some((confirmed, age, at)) if confirmed == confirmed_at_ms => {
                age.saturating_add(steady_now_ms.saturating_sub(at))
            }
            _ => {
                let age = Freshness::age_ms(wall_now_ms, confirmed_at_ms);
                self.seen = Some((confirmed_at_ms, age, steady_now_ms));
                age
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_confirmation_ages_on_the_monotonic_clock_whatever_the_wall_clock_does() {
        const HOUR: u64 = 3_600_000;
        let mut age = ConfirmationAge::default();
        let confirmed = 10 * HOUR;
        // First seen 50 ms after it was made (wall clock), at monotonic 1 000.
        assert_eq!(age.age_ms(confirmed + 50, confirmed, 1_000), 50);
        // The wall clock steps back an hour; 11 s pass: stale at a 10 s bound.
        let aged = age.age_ms(confirmed - HOUR, confirmed, 12_000);
        assert_eq!(aged, 11_050);
        let mut f = Freshness::default();
        assert_eq!(
            f.observe_age(aged, 10_000),
            Some(Transition::BecameStale { age_ms: 11_050 })
        );
        // A step forward makes no age either.
        assert_eq!(age.age_ms(confirmed + 2 * HOUR, confirmed, 12_100), 11_150);
        // A new confirmation starts afresh, its age at first sight from the wall clock.
        let next = confirmed + 2 * HOUR;
        assert_eq!(age.age_ms(next + 20, next, 12_200), 20);
        assert_eq!(age.age_ms(0, next, 12_300), 120);
    }

    #[test]
    fn stale_once_past_the_bound_and_fresh_again_on_confirmation() {
        let mut f = Freshness::default();
        assert_eq!(f.observe(1_000, 1_000, 500), None);
        assert_eq!(
            f.observe(1_500, 1_000, 500),
            None,
            "the bound itself is fresh"
        );
        assert_eq!(
            f.observe(1_501, 1_000, 500),
            Some(Transition::BecameStale { age_ms: 501 })
        );
        assert!(f.is_stale());
        assert_eq!(f.observe(9_000, 1_000, 500), None, "reported once");
        assert_eq!(
            f.observe(9_010, 9_000, 500),
            Some(Transition::BecameFresh { age_ms: 10 })
        );
        assert!(!f.is_stale());
        assert_eq!(f.observe(9_020, 9_000, 500), None);
    }

    #[test]
    fn a_confirmation_from_a_clock_ahead_reads_age_zero() {
        assert_eq!(Freshness::age_ms(100, 150), 0);
        let mut f = Freshness::default();
        assert_eq!(f.observe(100, 150, 10), None);
    }
}
