//! What one request holds on the ledger, and its release in stages: the prefill leg's part
//! when that leg answers, everything else when the request ends (or all of it on failure).
//!
//! Every operation leaves its input alone and returns the new state (copying only what stays
//! held), so the host can run it inside a CAS retry loop and keep the result only once the
//! write landed: a lost race then never leaves a charge marked released without its
//! subtraction.

use crate::core::ledger::{Counter, Ledger};
use crate::core::tokens::{Charge, DecodeCharge};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeldCharges {
    /// Request counters still held: (pod key, counter).
    pub counters: Vec<(String, Counter)>,
    pub prefill_tokens: Option<Charge>,
    pub decode_tokens: Option<DecodeCharge>,
}

impl HeldCharges {
    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
            && self.prefill_tokens.as_ref().is_none_or(Charge::is_settled)
            && self.decode_tokens.as_ref().is_none_or(|d| d.released)
    }

    /// The prefill leg answered: its in-flight count and the active-token part go.
    pub fn release_prefill_leg(&self, ledger: &mut Ledger, now_ms: u64) -> HeldCharges {
        let mut next = HeldCharges {
            counters: self.release_counters(ledger, &[Counter::PrefillInflight], now_ms),
            prefill_tokens: self.prefill_tokens.clone(),
            decode_tokens: self.decode_tokens.clone(),
        };
        if let Some(c) = next.prefill_tokens.as_mut() {
            ledger.release_tokens(c, now_ms);
        }
        next
    }

    /// The request ended (or failed): whatever is still held goes.
    pub fn release_rest(&self, ledger: &mut Ledger, now_ms: u64) -> HeldCharges {
        let released = [Counter::PrefillInflight, Counter::Running];
        let mut next = HeldCharges {
            counters: self.release_counters(ledger, &released, now_ms),
            prefill_tokens: self.prefill_tokens.clone(),
            decode_tokens: self.decode_tokens.clone(),
        };
        if let Some(c) = next.prefill_tokens.as_mut() {
            ledger.release_all(c, now_ms);
        }
        if let Some(c) = next.decode_tokens.as_mut() {
            ledger.release_decode(c, now_ms);
        }
        next
    }

    /// The pod the decode charges are on (`None` for a single-pod request).
    pub fn decode_pod(&self) -> Option<&str> {
        self.decode_tokens
            .as_ref()
            .map(|c| c.pod.as_str())
            .or_else(|| {
                self.counters
                    .iter()
                    .find(|(_, c)| *c == Counter::Running)
                    .map(|(k, _)| k.as_str())
            })
    }

    /// The decode leg goes to `to` instead of the pod it was charged on (that pod left the
    /// routing view while the prefill ran): its running count and decode tokens move along.
    pub fn move_decode(&self, ledger: &mut Ledger, to: &str, now_ms: u64) -> HeldCharges {
        let mut next = self.clone();
        for (key, counter) in next.counters.iter_mut() {
            if *counter == Counter::Running && key != to {
                ledger.release(key, Counter::Running, now_ms);
                ledger.add(to, Counter::Running, now_ms);
                *key = to.to_string();
            }
        }
        if let Some(c) = next.decode_tokens.as_mut().filter(|c| c.pod != to) {
            if ledger.release_decode(c, now_ms) {
                *c = ledger.charge_decode(to, c.prompt_tokens as u64, now_ms);
            }
        }
        next
    }

    /// Releases every held counter of the kinds `released` on `ledger` (kind by kind, each in
    /// the held order) and returns the others, the only ones copied.
    fn release_counters(
        &self,
        ledger: &mut Ledger,
        released: &[Counter],
        now_ms: u64,
    ) -> Vec<(String, Counter)> {
        for &counter in released {
            for (key, _) in self.counters.iter().filter(|(_, c)| *c == counter) {
                ledger.release(key, counter, now_ms);
            }
        }
        self.counters
            .iter()
            .filter(|(_, c)| !released.contains(c))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charged(ledger: &mut Ledger) -> HeldCharges {
        ledger.add("ns/p", Counter::PrefillInflight, 0);
        ledger.add("ns/d", Counter::Running, 0);
        HeldCharges {
            counters: vec![
                ("ns/p".into(), Counter::PrefillInflight),
                ("ns/d".into(), Counter::Running),
            ],
            prefill_tokens: Some(ledger.charge_prefill("ns/p", 3600.0, 0)),
            decode_tokens: Some(ledger.charge_decode("ns/d", 100, 0)),
        }
    }

    #[test]
    fn staged_release_returns_everything_to_zero() {
        let mut ledger = Ledger::default();
        let held = charged(&mut ledger);
        assert_eq!(ledger.pod("ns/p").active, 3600.0);
        let held = held.release_prefill_leg(&mut ledger, 5);
        assert_eq!(ledger.counts_of("ns/p").prefill_inflight, 0);
        assert_eq!(
            (ledger.pod("ns/p").active, ledger.pod("ns/p").kv),
            (0.0, 3600.0)
        );
        assert!(!held.is_empty());
        let held = held.release_rest(&mut ledger, 9);
        assert!(held.is_empty());
        assert!(ledger.all_zero());
        assert!(ledger.pod("ns/p").is_zero() && ledger.pod("ns/d").is_zero());
        // Releasing again changes nothing.
        let again = held.release_rest(&mut ledger, 10);
        assert_eq!(again, held);
        assert!(ledger.all_zero());
    }

    #[test]
    fn a_moved_decode_charge_leaves_the_old_pod_and_is_released_from_the_new_one() {
        let mut ledger = Ledger::default();
        let held = charged(&mut ledger).release_prefill_leg(&mut ledger, 5);
        assert_eq!(held.decode_pod(), Some("ns/d"));
        let moved = held.move_decode(&mut ledger, "ns/d2", 7);
        assert_eq!(moved.decode_pod(), Some("ns/d2"));
        assert_eq!(ledger.counts_of("ns/d").running, 0);
        assert!(ledger.pod("ns/d").is_zero(), "{:?}", ledger.pod("ns/d"));
        assert_eq!(ledger.counts_of("ns/d2").running, 1);
        assert!(!ledger.pod("ns/d2").is_zero());
        assert_eq!(
            moved.move_decode(&mut ledger, "ns/d2", 8),
            moved,
            "already there"
        );
        let done = moved.release_rest(&mut ledger, 9);
        assert!(done.is_empty() && ledger.all_zero());
    }

    #[test]
    fn a_stage_keeps_the_other_counters_in_order_and_leaves_its_input_alone() {
        let mut ledger = Ledger::default();
        let mut held = charged(&mut ledger);
        ledger.add("ns/d2", Counter::Running, 0);
        ledger.add("ns/p2", Counter::PrefillInflight, 0);
        held.counters.insert(0, ("ns/d2".into(), Counter::Running));
        held.counters
            .push(("ns/p2".into(), Counter::PrefillInflight));
        let before = held.clone();
        let next = held.release_prefill_leg(&mut ledger, 5);
        assert_eq!(held, before);
        assert_eq!(
            next.counters,
            vec![
                ("ns/d2".to_string(), Counter::Running),
                ("ns/d".to_string(), Counter::Running)
            ]
        );
        assert_eq!(next.decode_tokens, held.decode_tokens);
        let c = next.prefill_tokens.as_ref().unwrap();
        assert!(c.tokens_released && !c.kv_released);
        assert_eq!(ledger.counts_of("ns/p").prefill_inflight, 0);
        assert_eq!(ledger.counts_of("ns/p2").prefill_inflight, 0);
        assert_eq!(ledger.counts_of("ns/d2").running, 1);
        let rest = next.release_rest(&mut ledger, 9);
        assert!(rest.counters.is_empty() && rest.is_empty() && ledger.all_zero());
    }

    #[test]
    fn a_lost_cas_round_keeps_the_charge_held() {
        let mut ledger = Ledger::default();
        let held = charged(&mut ledger);
        let mut scratch = ledger.clone();
        let _discarded = held.release_rest(&mut scratch, 1); // the write lost; retry from `held`
        let next = held.release_rest(&mut ledger, 2);
        assert!(next.is_empty() && ledger.all_zero());
    }
}
