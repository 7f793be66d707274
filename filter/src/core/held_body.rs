//! The request bodies a VM keeps while their requests wait on a callout, and their budget.
//!
//! A request is routed from a copy of its body in the VM's linear memory. Most requests drop
//! that copy when the body callback returns, but some keep it until a callout answers: a vLLM
//! or TRT-LLM `context_first` pair splices its decode leg from it once the prefill answered
//! (up to `AIBRIX_PREFILL_REQUEST_TIMEOUT`, 30 s), TRT-LLM `generation_first` waits for
//! `/server_info`, an admission waits for pd-control, an `external` request for its service.
//! The VM's memory is the sum of those bodies, and it never shrinks. Envoy's overload manager
//! does not see it (it reads Envoy's allocator, not the wasm VM's memory), so without a bound a
//! client holding many large prompts in slow prefills could grow every worker's VM to
//! gigabytes and have the gateway killed with every live stream. Each VM therefore admits held
//! bodies against a budget (the plugin's `max_held_body_bytes`); a request that would go past
//! it is refused (`RouteError::HeldBodiesOverBudget`) before its callout is sent.
//!
//! The bytes go back when the [`HeldBody`] is dropped or unwrapped, and only then: whichever
//! way the request ends (the callout's answer, a refusal, the client leaving, the stream's
//! end), they are returned exactly once, by construction.

use std::cell::Cell;
use std::ops::Deref;
use std::rc::Rc;

/// Plugin default of `max_held_body_bytes`: 256 MiB per VM. It holds 32 bodies of the
/// largest size the filter takes (`max_request_body_bytes`, 8 MiB) or about 8000 prompts of
/// 32 KB waiting at once on one worker, far beyond what engines prefill concurrently, while
/// two workers' VMs stay within half a GiB next to Envoy's own 2 GiB heap bound.
pub const DEFAULT_MAX_HELD_BODY_BYTES: usize = 256 * 1024 * 1024;

/// A request that would have pushed the held bodies past the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("holding {needed} more bytes would exceed the budget ({held} of {limit} held)")]
pub struct OverBudget {
    pub needed: usize,
    pub held: usize,
    pub limit: usize,
}

/// One VM's account of the body bytes its waiting requests hold. Cloning it shares the
/// account (a VM has one; the wasm VM is single-threaded, so a `Cell` is enough).
#[derive(Debug, Clone, Default)]
pub struct BodyBudget {
    held: Rc<Cell<usize>>,
}

impl BodyBudget {
    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.get()
    }

    /// Whether `bytes` more would stay within `limit`. For a check before work that a
    /// refusal would waste (a selection and its charges): the caller then holds the body in
    /// the same callback, where nothing else can take the room meanwhile.
    pub fn fits(&self, bytes: usize, limit: usize) -> Result<(), OverBudget> {
        let held = self.held.get();
        match held.checked_add(bytes) {
            Some(total) if total <= limit => Ok(()),
            _ => Err(OverBudget {
                needed: bytes,
                held,
                limit,
            }),
        }
    }

    /// Takes `body` into the account, with `extra` bytes the request keeps beside it (its
    /// member index), if they fit within `limit`; otherwise nothing is held and the body is
    /// dropped (its request is refused).
    pub fn hold(&self, body: Vec<u8>, extra: usize, limit: usize) -> Result<HeldBody, OverBudget> {
        let bytes = body.len().saturating_add(extra);
        self.fits(bytes, limit)?;
        self.held.set(self.held.get() + bytes);
        Ok(HeldBody {
            body,
            bytes,
            held: self.held.clone(),
        })
    }
}

/// A body counted in its VM's [`BodyBudget`] for as long as it lives.
#[derive(Debug)]
pub struct HeldBody {
    body: Vec<u8>,
    /// What was added to the account (the body and its `extra`), returned on drop.
    bytes: usize,
    held: Rc<Cell<usize>>,
}

impl HeldBody {
    /// The body again, its bytes returned to the budget: for a request that goes on routing
    /// it within the current callback (and holds it anew if it waits again).
    pub fn into_body(mut self) -> Vec<u8> {
        std::mem::take(&mut self.body)
    }

    /// The bytes this body counts for.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Deref for HeldBody {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.body
    }
}

impl Drop for HeldBody {
    fn drop(&mut self) {
        // Never below zero: the account only ever held what its bodies added.
        self.held.set(self.held.get().saturating_sub(self.bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_admitted_up_to_the_limit_and_no_further() {
        let budget = BodyBudget::default();
        let a = budget.hold(vec![b'a'; 600], 40, 1000).unwrap();
        assert_eq!((a.bytes(), budget.held()), (640, 640));
        assert_eq!(&a[..3], b"aaa");
        // 640 + 400 > 1000: refused, and nothing held for it.
        let refused = budget.hold(vec![0; 400], 0, 1000).unwrap_err();
        assert_eq!(
            refused,
            OverBudget {
                needed: 400,
                held: 640,
                limit: 1000
            }
        );
        assert_eq!(budget.held(), 640);
        // Exactly at the limit is admitted.
        let b = budget.hold(vec![0; 350], 10, 1000).unwrap();
        assert_eq!(budget.held(), 1000);
        assert!(budget.fits(1, 1000).is_err());
        assert!(budget.fits(0, 1000).is_ok());
        drop(a);
        assert_eq!(budget.held(), 360);
        drop(b);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn every_end_returns_the_bytes_exactly_once() {
        let budget = BodyBudget::default();
        let limit = 10_000;
        // Unwrapped to be routed again: returned then, not again when the Vec goes.
        let held = budget.hold(vec![1; 100], 20, limit).unwrap();
        let body = held.into_body();
        assert_eq!((body.len(), budget.held()), (100, 0));
        // Routed again and held anew (a failover's second prefill): one count, not two.
        let again = budget.hold(body, 20, limit).unwrap();
        assert_eq!(budget.held(), 120);
        // Several requests, ending in any order, each by drop (answer, refusal, reset).
        let others: Vec<HeldBody> = (0..5)
            .map(|i| budget.hold(vec![0; 100 * (i + 1)], 0, limit).unwrap())
            .collect();
        assert_eq!(budget.held(), 120 + 1500);
        let mut others = others;
        others.swap_remove(1);
        assert_eq!(budget.held(), 120 + 1300);
        drop(again);
        drop(others);
        assert_eq!(budget.held(), 0);
        // A refused hold takes nothing, so it gives nothing back either.
        let big = budget.hold(vec![0; 6000], 0, limit).unwrap();
        assert!(budget.hold(vec![0; 5000], 0, limit).is_err());
        drop(big);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn clones_share_one_account_and_sizes_cannot_overflow_it() {
        let budget = BodyBudget::default();
        let view = budget.clone();
        let held = budget.hold(vec![0; 10], 0, 100).unwrap();
        assert_eq!(view.held(), 10);
        assert!(view.fits(usize::MAX, usize::MAX).is_err());
        assert!(view.hold(Vec::new(), usize::MAX, usize::MAX).is_err());
        drop(held);
        assert_eq!(view.held(), 0);
    }
}
