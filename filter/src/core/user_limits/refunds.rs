//! Requests counted against their model's rate and then not routed, on their way back.
//!
//! An admission counts the request against its model's window before a pod is chosen. When
//! the gateway then refuses it (no pod, a profile it cannot apply, the prefill leg failing),
//! AIBrix does not charge the model for it; so each such request is gathered here and the
//! VM's tick sends them to pd-control (`RELEASE_PATH`), which takes each off the window that
//! counted it. The request's own context cannot send it: its local reply ends the stream,
//! and the stream's end cancels its calls.
//!
//! A release is sent once. A copy sent after a call that got no answer could give a request
//! back twice, admitting one more than the limit; a request not given back only costs one
//! admission in a window that is over within `1/requestsPerSecond` seconds at most.

use serde::Serialize;

use super::ModelRps;

pub const RELEASE_PATH: &str = "/v1/limits/release";
/// Requests one VM holds for its next release (pd-control takes up to 1024 per body). The
/// rate limit bounds them anyway: only admitted requests are given back.
pub const MAX_PENDING_REFUNDS: usize = 1024;

/// One admitted request counted against its model's rate.
#[derive(Debug, Clone, PartialEq)]
pub struct Charge {
    pub model: String,
    pub rps: ModelRps,
    /// When the admission's answer arrived, on the VM's monotonic clock (only its age is
    /// sent): the count was made before, so the age sent with the refund errs short and a
    /// window that opened with this very request still holds it.
    pub answered_ms: u64,
}

/// One release to send: its JSON body and how many requests it gives back.
#[derive(Debug, PartialEq)]
pub struct Refunds {
    pub body: Vec<u8>,
    pub count: u64,
}

/// The requests waiting to be given back, one VM's worth.
#[derive(Debug, Default)]
pub struct RefundBook {
    pending: Vec<Charge>,
    /// Requests that will not be given back: no room left, or their window was over before
    /// the tick could send them. The tick moves them to a metric.
    pub lost: u64,
}

#[derive(Serialize)]
struct Body<'a> {
    refunds: Vec<Entry<'a>>,
}

#[derive(Serialize)]
struct Entry<'a> {
    model: &'a str,
    rps_window_ms: u64,
    age_ms: u64,
}

impl RefundBook {
    pub fn add(&mut self, charge: Charge) {
        if self.pending.len() < MAX_PENDING_REFUNDS {
            self.pending.push(charge);
        } else {
            self.lost += 1;
        }
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Every request still worth giving back, as one release; those whose window has surely
    /// ended count as lost (pd-control would skip them anyway).
    pub fn take(&mut self, now_ms: u64) -> Option<Refunds> {
        if self.pending.is_empty() {
            return None;
        }
        let pending = std::mem::take(&mut self.pending);
        let refunds: Vec<Entry> = pending
            .iter()
            .filter_map(|c| {
                let age_ms = now_ms.saturating_sub(c.answered_ms);
                (age_ms < c.rps.window_ms).then_some(Entry {
                    model: &c.model,
                    rps_window_ms: c.rps.window_ms,
                    age_ms,
                })
            })
            .collect();
        self.lost += (pending.len() - refunds.len()) as u64;
        if refunds.is_empty() {
            return None;
        }
        let count = refunds.len() as u64;
        let body = serde_json::to_vec(&Body { refunds }).ok()?;
        Some(Refunds { body, count })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn charge(model: &str, rps: f64, answered_ms: u64) -> Charge {
        Charge {
            model: model.into(),
            rps: ModelRps::of(rps).expect("a rate"),
            answered_ms,
        }
    }

    #[test]
    fn a_release_carries_each_request_with_its_age() {
        let mut book = RefundBook::default();
        assert!(book.take(0).is_none());
        book.add(charge("llama", 2.0, 1_000));
        book.add(charge("qwen", 0.01, 1_500));
        let refunds = book.take(1_600).expect("a release");
        assert_eq!(refunds.count, 2);
        let body: Value = serde_json::from_slice(&refunds.body).expect("json");
        assert_eq!(
            body,
            json!({"refunds": [
                {"model": "llama", "rps_window_ms": 1000, "age_ms": 600},
                {"model": "qwen", "rps_window_ms": 100_000, "age_ms": 100}]})
        );
        assert!(book.is_empty(), "taken once");
        assert!(book.take(1_700).is_none());
        assert_eq!(book.lost, 0);
    }

    #[test]
    fn requests_whose_window_is_over_or_beyond_the_room_are_lost() {
        let mut book = RefundBook::default();
        book.add(charge("llama", 1.0, 0));
        book.add(charge("llama", 1.0, 500));
        let refunds = book.take(1_000).expect("the younger one");
        assert_eq!(refunds.count, 1);
        assert_eq!(book.lost, 1);
        book.add(charge("llama", 1.0, 0));
        assert!(book.take(5_000).is_none(), "nothing left worth sending");
        assert_eq!(book.lost, 2);
        for _ in 0..MAX_PENDING_REFUNDS + 3 {
            book.add(charge("llama", 1.0, 5_000));
        }
        assert_eq!(book.lost, 5);
        let refunds = book.take(5_001).expect("a release");
        assert_eq!(refunds.count, MAX_PENDING_REFUNDS as u64);
    }
}
