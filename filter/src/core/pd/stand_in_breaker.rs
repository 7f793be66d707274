//! Whether this worker may name stand-ins now: off for a while after its gateway's retrying
//! cluster showed it does not know the pods.
//!
//! Stand-ins work only where the retrying cluster lists the pods the filter names. Where it
//! does not (the endpoint file is written somewhere Envoy does not read, the EDS stream of
//! this gateway never connected), every named request fails at once with Envoy's
//! `no_healthy_upstream`: no host was even tried. pd-control cannot see that from its side
//! for every gateway, so each worker watches its own requests: such a failure turns naming
//! off, and the request routes as it would without stand-ins. After a cool-down one named
//! request tries again; the cool-down doubles while the cluster stays empty, and a named
//! request that reached any pod brings it back to the start.

/// The first cool-down.
pub const BASE_COOL_MS: u64 = 10_000;
/// The longest cool-down.
pub const MAX_COOL_MS: u64 = 600_000;

#[derive(Debug, Clone)]
pub struct StandInBreaker {
    /// Naming is off until then.
    off_until_ms: u64,
    /// The cool-down the next trip sets.
    cool_ms: u64,
}

impl Default for StandInBreaker {
    fn default() -> Self {
        StandInBreaker {
            off_until_ms: 0,
            cool_ms: BASE_COOL_MS,
        }
    }
}

impl StandInBreaker {
    /// Whether naming is on; reads the clock (`now_ms`) only once it has been turned off.
    pub fn allows(&self, now_ms: impl FnOnce() -> u64) -> bool {
        self.off_until_ms == 0 || now_ms() >= self.off_until_ms
    }

    /// A named request found no host in the retrying cluster: naming goes off. Returns the
    /// cool-down set.
    pub fn no_host(&mut self, now_ms: u64) -> u64 {
        let cool = self.cool_ms;
        self.off_until_ms = now_ms.saturating_add(cool);
        self.cool_ms = cool.saturating_mul(2).min(MAX_COOL_MS);
        cool
    }

    /// A named request reached a pod: the cluster knows the pods.
    pub fn reached(&mut self) {
        self.cool_ms = BASE_COOL_MS;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_cluster_turns_naming_off_for_a_growing_while() {
        let mut b = StandInBreaker::default();
        assert!(b.allows(|| 0));
        assert_eq!(b.no_host(1_000), BASE_COOL_MS);
        assert!(!b.allows(|| 1_000 + BASE_COOL_MS - 1));
        assert!(b.allows(|| 1_000 + BASE_COOL_MS));
        assert_eq!(b.no_host(20_000), 2 * BASE_COOL_MS, "still empty: longer");
        let mut last = 0;
        for i in 0..10 {
            last = b.no_host(100_000 * i);
        }
        assert_eq!(last, MAX_COOL_MS);
        b.reached();
        assert_eq!(b.no_host(5_000_000), BASE_COOL_MS, "back to the start");
    }
}
