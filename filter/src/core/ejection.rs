//! Passive outlier ejection: a pod that fails several requests in a row (connection refused,
//! 5xx, a stream it dropped, a decode leg the watchdog gave up on) leaves the routing view
//! for a while, so a crashed pod that pd-control still lists (readiness probes lag by
//! seconds) does not keep taking a share of the traffic. The cascade itself is untouched:
//! the routing view is rebuilt without the ejected pods, so a roleset that loses its decode
//! pod is simply incomplete, exactly as if Kubernetes had marked the pod unready.
//!
//! Each VM counts the failures it sees itself: no shared-data round trip on the request path.
//! A VM that ejects a pod tells the others (an [`EjectNotice`] on their queues), and they take
//! the pod out too ([`Ejections::adopt`]): a pod failing everyone costs about
//! `after_failures` requests in all, not that many per worker.

use hashbrown::HashMap;

/// How ejection behaves (plugin configuration `eject_after_failures`, `eject_base_ms`,
/// `eject_max_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EjectionPolicy {
    /// Consecutive failures that eject a pod; 0 turns ejection off.
    pub after_failures: u32,
    /// First ejection period; each further ejection of the same pod (without a success in
    /// between) doubles it, up to `max_ms`.
    pub base_ms: u64,
    pub max_ms: u64,
}

impl Default for EjectionPolicy {
    fn default() -> Self {
        EjectionPolicy {
            after_failures: 3,
            base_ms: 5_000,
            max_ms: 60_000,
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct PodHealth {
    consecutive_failures: u32,
    /// Ejections since the pod's last success: the backoff exponent.
    ejections: u32,
    /// 0 when the pod is in the routing view.
    ejected_until_ms: u64,
}

/// What a failure did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Counted,
    /// The pod leaves the routing view for `for_ms`.
    Ejected {
        for_ms: u64,
    },
}

/// Per-pod health of one VM, keyed by pod key (`namespace/name`).
#[derive(Debug, Default)]
pub struct Ejections {
    policy: EjectionPolicy,
    pods: HashMap<String, PodHealth>,
    /// The set of ejected pods changed since [`Ejections::take_changed`] last ran.
    changed: bool,
}

impl Ejections {
    pub fn new(policy: EjectionPolicy) -> Ejections {
        Ejections {
            policy,
            ..Ejections::default()
        }
    }

    /// A request the pod failed (transport failure, 5xx, dropped stream, silent decode).
    pub fn failure(&mut self, pod: &str, now_ms: u64) -> Verdict {
        if self.policy.after_failures == 0 {
            return Verdict::Counted;
        }
        let policy = self.policy;
        let health = self.pods.entry_ref(pod).or_default();
        if health.ejected_until_ms > now_ms {
            // Requests routed before the ejection still finish; they do not extend it.
            return Verdict::Counted;
        }
        health.consecutive_failures += 1;
        if health.consecutive_failures < policy.after_failures {
            return Verdict::Counted;
        }
        let shift = health.ejections.min(16);
        let for_ms = policy
            .base_ms
            .saturating_mul(1u64 << shift)
            .min(policy.max_ms.max(policy.base_ms));
        health.ejections += 1;
        health.consecutive_failures = 0;
        health.ejected_until_ms = now_ms.saturating_add(for_ms.max(1));
        self.changed = true;
        Verdict::Ejected { for_ms }
    }

    /// Another VM ejected `notice.pod`: out of this VM's view until the same time, with its
    /// backoff. Returns whether the pod left the view here (false when ejection is off, the
    /// notice is over, or this VM already holds the pod out as long).
    pub fn adopt(&mut self, notice: &EjectNotice<'_>, now_ms: u64) -> bool {
        if self.policy.after_failures == 0 || notice.until_ms <= now_ms {
            return false;
        }
        let health = self.pods.entry_ref(notice.pod).or_default();
        health.ejections = health.ejections.max(notice.ejections);
        if health.ejected_until_ms >= notice.until_ms {
            return false;
        }
        let was_routed = health.ejected_until_ms == 0;
        health.ejected_until_ms = notice.until_ms;
        health.consecutive_failures = 0;
        self.changed |= was_routed;
        was_routed
    }

    /// What to tell the other VMs about `pod`, just ejected here.
    pub fn notice<'a>(&self, pod: &'a str) -> Option<EjectNotice<'a>> {
        let health = self.pods.get(pod).filter(|h| h.ejected_until_ms != 0)?;
        Some(EjectNotice {
            pod,
            until_ms: health.ejected_until_ms,
            ejections: health.ejections,
        })
    }

    /// A request the pod served: it is healthy again and its backoff starts over.
    pub fn success(&mut self, pod: &str) {
        if let Some(h) = self.pods.get_mut(pod) {
            if h.ejected_until_ms == 0 {
                self.pods.remove(pod);
            } else {
                h.consecutive_failures = 0;
                h.ejections = 0;
            }
        }
    }

    /// Returns pods whose period is over to the routing view; true when any did.
    ///
    /// Deadlines are wall-clock times (other VMs adopt them from notices), so a period is
    /// also never left longer than the longest one from now: a backward step of the clock
    /// would otherwise keep an ejected pod out for as long as the step.
    pub fn expire(&mut self, now_ms: u64) -> bool {
        let mut any = false;
        let latest = now_ms.saturating_add(self.policy.max_ms.max(self.policy.base_ms).max(1));
        for h in self.pods.values_mut() {
            if h.ejected_until_ms > latest {
                h.ejected_until_ms = latest;
            }
            if h.ejected_until_ms != 0 && h.ejected_until_ms <= now_ms {
                h.ejected_until_ms = 0;
                any = true;
            }
        }
        if any {
            self.changed = true;
            // Keep a pod's running failure count and backoff; only fully healthy rows go.
            self.pods.retain(|_, h| {
                h.ejected_until_ms != 0 || h.ejections > 0 || h.consecutive_failures > 0
            });
        }
        any
    }

    /// Whether the ejected set changed since the last call (the routing view needs a rebuild).
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    pub fn is_ejected(&self, pod: &str) -> bool {
        self.pods.get(pod).is_some_and(|h| h.ejected_until_ms != 0)
    }

    /// Keys of the pods currently out of the routing view.
    pub fn ejected(&self) -> impl Iterator<Item = &str> {
        self.pods
            .iter()
            .filter(|(_, h)| h.ejected_until_ms != 0)
            .map(|(k, _)| k.as_str())
    }
}

/// One VM's ejection of a pod, for the others: the pod, when it comes back (host clock, the
/// same for every VM of the process), and its ejections since its last success (the backoff).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EjectNotice<'a> {
    pub pod: &'a str,
    pub until_ms: u64,
    pub ejections: u32,
}

/// Why a queued notice could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NoticeError {
    #[error("ejection notice of {0} bytes, shorter than its 12-byte header")]
    Short(usize),
    #[error("ejection notice names a pod that is not UTF-8")]
    PodNotText,
}

impl<'a> EjectNotice<'a> {
    /// `until_ms` (u64 LE) ‖ `ejections` (u32 LE) ‖ pod key.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.until_ms.to_le_bytes());
        out.extend_from_slice(&self.ejections.to_le_bytes());
        out.extend_from_slice(self.pod.as_bytes());
    }

    pub fn decode(bytes: &'a [u8]) -> Result<EjectNotice<'a>, NoticeError> {
        let short = || NoticeError::Short(bytes.len());
        let (until, rest) = bytes.split_first_chunk::<8>().ok_or_else(short)?;
        let (ejections, pod) = rest.split_first_chunk::<4>().ok_or_else(short)?;
        Ok(EjectNotice {
            pod: std::str::from_utf8(pod).map_err(|_| NoticeError::PodNotText)?,
            until_ms: u64::from_le_bytes(*until),
            ejections: u32::from_le_bytes(*ejections),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> EjectionPolicy {
        EjectionPolicy {
            after_failures: 3,
            base_ms: 1_000,
            max_ms: 3_000,
        }
    }

    #[test]
    fn consecutive_failures_eject_and_a_success_resets_the_count() {
        let mut e = Ejections::new(policy());
        assert_eq!(e.failure("ns/a", 0), Verdict::Counted);
        assert_eq!(e.failure("ns/a", 1), Verdict::Counted);
        e.success("ns/a");
        assert_eq!(e.failure("ns/a", 2), Verdict::Counted);
        assert_eq!(e.failure("ns/a", 3), Verdict::Counted);
        assert!(!e.is_ejected("ns/a"));
        assert!(!e.take_changed());
        assert_eq!(e.failure("ns/a", 4), Verdict::Ejected { for_ms: 1_000 });
        assert!(e.is_ejected("ns/a") && e.take_changed());
        assert_eq!(e.ejected().collect::<Vec<_>>(), ["ns/a"]);
        // Late answers of requests routed before the ejection do not extend it.
        assert_eq!(e.failure("ns/a", 500), Verdict::Counted);
        assert!(!e.expire(1_003));
        assert!(e.expire(1_004) && e.take_changed());
        assert!(!e.is_ejected("ns/a"));
    }

    /// A backward step of the wall clock shortens what is left of a period to the longest
    /// period at most, rather than keeping the pod out for as long as the step.
    #[test]
    fn a_clock_stepped_back_keeps_a_pod_out_no_longer_than_the_longest_period() {
        let mut e = Ejections::new(policy());
        let hour = 3_600_000;
        for _ in 0..3 {
            e.failure("ns/a", hour);
        }
        assert!(e.is_ejected("ns/a"), "out until an hour and a second");
        assert!(!e.expire(10), "stepped back an hour: still out");
        assert!(!e.expire(3_009));
        assert!(
            e.expire(3_010),
            "out for the 3 s cap from the step, not for the hour"
        );
        assert!(!e.is_ejected("ns/a"));
    }

    #[test]
    fn repeated_ejections_back_off_up_to_the_cap_until_a_success() {
        let mut e = Ejections::new(policy());
        let mut now = 0;
        let mut periods = Vec::new();
        for _ in 0..4 {
            let mut v = Verdict::Counted;
            for _ in 0..3 {
                v = e.failure("ns/a", now);
            }
            let Verdict::Ejected { for_ms } = v else {
                panic!("not ejected: {v:?}")
            };
            periods.push(for_ms);
            now += for_ms;
            assert!(e.expire(now));
        }
        assert_eq!(periods, [1_000, 2_000, 3_000, 3_000]);
        e.success("ns/a");
        for _ in 0..2 {
            e.failure("ns/a", now);
        }
        assert_eq!(e.failure("ns/a", now), Verdict::Ejected { for_ms: 1_000 });
    }

    #[test]
    fn a_pod_another_vm_ejected_leaves_this_view_until_the_same_time() {
        let mut a = Ejections::new(policy());
        let mut b = Ejections::new(policy());
        for t in 0..3 {
            a.failure("ns/p", t);
        }
        let notice = a.notice("ns/p").expect("ejected");
        assert_eq!((notice.until_ms, notice.ejections), (1_002, 1));
        let mut bytes = Vec::new();
        notice.encode_into(&mut bytes);
        let read = EjectNotice::decode(&bytes).expect("decodes");
        assert_eq!(read, notice);

        b.failure("ns/p", 5);
        assert!(b.adopt(&read, 10) && b.take_changed());
        assert!(b.is_ejected("ns/p"));
        assert!(!b.adopt(&read, 10), "already out as long");
        assert!(!b.take_changed());
        assert!(!b.expire(1_001));
        assert!(b.expire(1_002) && !b.is_ejected("ns/p"));
        // The backoff came along: the next ejection here lasts twice as long, and the
        // failure counted before the notice did not survive it.
        assert_eq!(b.failure("ns/p", 2_000), Verdict::Counted);
        assert_eq!(b.failure("ns/p", 2_000), Verdict::Counted);
        assert_eq!(b.failure("ns/p", 2_000), Verdict::Ejected { for_ms: 2_000 });

        let late = EjectNotice {
            until_ms: 50,
            ..notice
        };
        let mut c = Ejections::new(policy());
        assert!(!c.adopt(&late, 50), "over before it arrived");
        let mut off = Ejections::new(EjectionPolicy {
            after_failures: 0,
            ..policy()
        });
        assert!(!off.adopt(&notice, 10) && !off.is_ejected("ns/p"));
        assert!(a.notice("ns/other").is_none());

        assert_eq!(
            EjectNotice::decode(&bytes[..11]),
            Err(NoticeError::Short(11))
        );
        let mut bad = bytes[..12].to_vec();
        bad.push(0xff);
        assert_eq!(EjectNotice::decode(&bad), Err(NoticeError::PodNotText));
    }

    #[test]
    fn zero_turns_it_off_and_pods_are_independent() {
        let mut off = Ejections::new(EjectionPolicy {
            after_failures: 0,
            ..policy()
        });
        for t in 0..10 {
            assert_eq!(off.failure("ns/a", t), Verdict::Counted);
        }
        assert!(!off.is_ejected("ns/a"));
        let mut e = Ejections::new(policy());
        for t in 0..3 {
            e.failure("ns/a", t);
            e.failure("ns/b", t);
            e.success("ns/b");
        }
        assert!(e.is_ejected("ns/a") && !e.is_ejected("ns/b"));
        // Another pod's ejection ending does not reset a pod's failures in a row.
        e.failure("ns/c", 3);
        e.failure("ns/c", 3);
        assert!(e.expire(10_000));
        assert_eq!(
            e.failure("ns/c", 10_001),
            Verdict::Ejected { for_ms: 1_000 }
        );
    }
}
