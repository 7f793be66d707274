//! What one election round decides from the Lease it read, apart from the API calls.
//!
//! Expiry is judged on this process's monotonic clock, from when it first saw the Lease's
//! current version, not from the `renewTime` the holder wrote: replicas on nodes whose wall
//! clocks disagree by seconds must still agree that a silent holder has lost the lease one
//! lease duration after its last write was seen.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;

/// What the round does with the Lease it read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// This replica holds it: write a new renew time.
    Renew,
    /// Nobody holds it, or the holder let it run out: take it (one more transition).
    TakeOver,
    /// Another replica holds it and renews it in time.
    Follow(String),
}

/// The Lease's holder, if one is named (an empty name is the released Lease).
pub fn holder(spec: Option<&LeaseSpec>) -> Option<&str> {
    spec.and_then(|s| s.holder_identity.as_deref())
        .filter(|h| !h.is_empty())
}

/// How long the holder promised to stay: the Lease's own duration, else `fallback` (ours).
pub fn promised(spec: Option<&LeaseSpec>, fallback: Duration) -> Duration {
    spec.and_then(|s| s.lease_duration_seconds)
        .and_then(|s| u64::try_from(s).ok())
        .filter(|s| *s > 0)
        .map_or(fallback, Duration::from_secs)
}

/// When this process first saw each version of the Lease.
#[derive(Debug, Default)]
pub struct Observer {
    seen: Option<(String, Instant)>,
}

impl Observer {
    /// Notes that the Lease reads at `version` at `now`; returns when that version was first
    /// seen (`now` for a new one).
    pub fn observe(&mut self, version: &str, now: Instant) -> Instant {
        match &self.seen {
            Some((v, at)) if v == version => *at,
            _ => {
                self.seen = Some((version.to_string(), now));
                now
            }
        }
    }
}

/// The round's plan for `me`, given the Lease's spec and when its version was first seen.
pub fn plan(
    spec: Option<&LeaseSpec>,
    me: &str,
    first_seen: Instant,
    fallback: Duration,
    now: Instant,
) -> Plan {
    match holder(spec) {
        Some(h) if h == me => Plan::Renew,
        None => Plan::TakeOver,
        Some(h) => {
            let expired = now.saturating_duration_since(first_seen) >= promised(spec, fallback);
            if expired {
                Plan::TakeOver
            } else {
                Plan::Follow(h.to_string())
            }
        }
    }
}

/// Whole seconds, at least one: the Lease's duration field.
fn seconds(d: Duration) -> i32 {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(s.max(1)).unwrap_or(i32::MAX)
}

/// The spec of a Lease `me` creates.
pub fn created(me: &str, duration: Duration, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        holder_identity: Some(me.to_string()),
        lease_duration_seconds: Some(seconds(duration)),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(0),
        ..LeaseSpec::default()
    }
}

/// The spec after `me` renewed the Lease it holds.
pub fn renewed(spec: &LeaseSpec, me: &str, duration: Duration, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        holder_identity: Some(me.to_string()),
        lease_duration_seconds: Some(seconds(duration)),
        renew_time: Some(MicroTime(now)),
        ..spec.clone()
    }
}

/// The spec after `me` took the Lease over from a holder that let it run out (or released it).
pub fn taken_over(spec: &LeaseSpec, me: &str, duration: Duration, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        holder_identity: Some(me.to_string()),
        lease_duration_seconds: Some(seconds(duration)),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(spec.lease_transitions.unwrap_or(0).saturating_add(1)),
        ..spec.clone()
    }
}

/// The spec after its holder let it go on shutdown: no holder, so a standby takes it at its
/// next round instead of waiting out the duration.
pub fn released(spec: &LeaseSpec, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        holder_identity: None,
        lease_duration_seconds: Some(1),
        renew_time: Some(MicroTime(now)),
        ..spec.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(15);

    fn held_by(h: &str, secs: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(h.into()),
            lease_duration_seconds: Some(secs),
            lease_transitions: Some(4),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn a_lease_held_by_another_is_followed_until_its_own_duration_passes_unrenewed() {
        let t0 = Instant::now();
        let spec = held_by("b", 3);
        let mut seen = Observer::default();
        let first = seen.observe("10", t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(
            plan(Some(&spec), "a", first, D, at(2)),
            Plan::Follow("b".into())
        );
        // Judged by the Lease's 3 s, not our 15 s.
        let same = seen.observe("10", at(3));
        assert_eq!(same, t0, "an unchanged version keeps its first sighting");
        assert_eq!(plan(Some(&spec), "a", same, D, at(3)), Plan::TakeOver);
        // A renewal (new version) restarts the count.
        let renewed_at = seen.observe("11", at(3));
        assert_eq!(
            plan(Some(&spec), "a", renewed_at, D, at(5)),
            Plan::Follow("b".into())
        );
    }

    #[test]
    fn own_released_and_missing_holders() {
        let now = Instant::now();
        assert_eq!(plan(Some(&held_by("a", 15)), "a", now, D, now), Plan::Renew);
        let mut empty = held_by("", 15);
        assert_eq!(plan(Some(&empty), "a", now, D, now), Plan::TakeOver);
        empty.holder_identity = None;
        assert_eq!(plan(Some(&empty), "a", now, D, now), Plan::TakeOver);
        assert_eq!(plan(None, "a", now, D, now), Plan::TakeOver);
        // No duration written: ours applies.
        let mut bare = held_by("b", 0);
        bare.lease_duration_seconds = None;
        assert_eq!(
            plan(Some(&bare), "a", now, D, now + Duration::from_secs(14)),
            Plan::Follow("b".into())
        );
    }

    #[test]
    fn writes_count_transitions_and_round_durations_up() {
        let now = Timestamp::now();
        let c = created("a", Duration::from_millis(1500), now);
        assert_eq!(c.lease_duration_seconds, Some(2));
        assert_eq!(c.lease_transitions, Some(0));
        let prior = held_by("b", 15);
        let t = taken_over(&prior, "a", D, now);
        assert_eq!(t.holder_identity.as_deref(), Some("a"));
        assert_eq!(t.lease_transitions, Some(5));
        let r = renewed(&t, "a", D, now);
        assert_eq!(r.lease_transitions, Some(5), "a renewal is no transition");
        assert_eq!(r.acquire_time, t.acquire_time);
        let gone = released(&r, now);
        assert_eq!(holder(Some(&gone)), None);
        assert_eq!(gone.lease_transitions, Some(5));
        assert_eq!(gone.lease_duration_seconds, Some(1));
    }
}
