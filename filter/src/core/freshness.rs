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
        let age_ms = Self::age_ms(now_ms, confirmed_at_ms);
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

#[cfg(test)]
mod tests {
    use super::*;

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
