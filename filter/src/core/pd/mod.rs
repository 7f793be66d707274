//! PD target selection: Step 0 (`candidates`), Steps 1–5 (`select`), single-pod strategies
//! (`single`), the adaptive bucket plan (`bucket_serve`), and the charges a selection makes.

pub mod blend;
pub mod bucket_serve;
pub mod candidates;
pub mod columns;
pub mod explained;
pub mod fallback;
pub mod pick;
pub mod preble;
pub mod select;
pub mod session_affinity;
pub mod settings;
pub mod single;
pub mod stand_in_breaker;
pub mod top_k;
pub mod vtc;

pub use candidates::{Step0, Step0Input};
pub use pick::MinPicker;
pub use select::{Candidates, FastPaths, PairInput, Scratch};
pub use settings::{PdDefaults, PdSettings};
pub use single::select_single;

use crate::core::charges::HeldCharges;
use crate::core::errors::RouteError;
use crate::core::fleet::ModelView;
use crate::core::ledger::{Counter, Ledger};
use crate::core::obs::Explain;

/// The detail of a selection error, for the explanation.
fn explain_error(e: &RouteError) -> String {
    match e {
        RouteError::Selection { detail } => detail.clone(),
        other => other.to_string(),
    }
}

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Prefill on one pod, decode on another of the same roleset. Indexes into `ModelView::pods`.
    Pair { prefill: usize, decode: usize },
    /// One pod runs the whole request (a combined pod, or a non-PD strategy).
    Single { pod: usize },
}

impl Target {
    /// The pod that answers the client: the decode pod of a pair, or the single pod.
    pub fn pod(self) -> usize {
        match self {
            Target::Pair { decode, .. } => decode,
            Target::Single { pod } => pod,
        }
    }
}

/// A selection and the charges it makes.
#[derive(Debug, Clone, PartialEq)]
pub struct Selected {
    pub target: Target,
    pub prefill_cost: Option<f64>,
    pub decode_tokens: Option<u64>,
    pub fast_paths: FastPaths,
}

impl From<select::PairChoice> for Selected {
    fn from(c: select::PairChoice) -> Selected {
        Selected {
            target: Target::Pair {
                prefill: c.prefill,
                decode: c.decode,
            },
            prefill_cost: c.prefill_cost,
            decode_tokens: c.decode_tokens,
            fast_paths: c.fast_paths,
        }
    }
}

impl Selected {
    pub fn single(pod: usize) -> Selected {
        Selected {
            target: Target::Single { pod },
            prefill_cost: None,
            decode_tokens: None,
            fast_paths: FastPaths::default(),
        }
    }

    /// Charges the ledger (inside the CAS round of the selection) and returns what the
    /// request now holds.
    pub fn charge(&self, model: &ModelView, ledger: &mut Ledger, now_ms: u64) -> HeldCharges {
        let mut held = HeldCharges::default();
        let mut add = |pod: usize, counter: Counter, ledger: &mut Ledger| {
            let key = &model.pods[pod].key;
            ledger.add(key, counter, now_ms);
            held.counters.push((key.clone(), counter));
        };
        match self.target {
            Target::Pair { prefill, decode } => {
                add(prefill, Counter::PrefillInflight, ledger);
                add(decode, Counter::Running, ledger);
                if let Some(cost) = self.prefill_cost {
                    held.prefill_tokens =
                        Some(ledger.charge_prefill(&model.pods[prefill].key, cost, now_ms));
                }
                if let Some(tokens) = self.decode_tokens {
                    held.decode_tokens =
                        Some(ledger.charge_decode(&model.pods[decode].key, tokens, now_ms));
                }
            }
            Target::Single { pod } => add(pod, Counter::Running, ledger),
        }
        held
    }
}

/// PD selection: Step 0, then Steps 1–5 over the candidates it keeps.
pub fn select_pd(
    model: &ModelView,
    step0: Step0Input<'_>,
    ledger: &Ledger,
    pair: PairInput<'_>,
    rng: &mut fastrand::Rng,
) -> Result<Selected, RouteError> {
    select_pd_with(model, step0, ledger, pair, rng, &mut Scratch::default())
}

/// [`select_pd`] with buffers (and ledger row hints) kept from earlier selections.
pub fn select_pd_with(
    model: &ModelView,
    step0: Step0Input<'_>,
    ledger: &Ledger,
    pair: PairInput<'_>,
    rng: &mut fastrand::Rng,
    scratch: &mut Scratch,
) -> Result<Selected, RouteError> {
    let cols = &model.columns;
    // Without bucketing, Step 0 keeps every pod of every complete roleset (when there is at
    // least one): the snapshot already has them as candidate sets.
    let c = if !step0.bucketing && !cols.all_prefill.is_empty() && !cols.all_decode.is_empty() {
        select::select_pair(model, Candidates::All, ledger, pair, rng, scratch)?
    } else {
        match candidates::collect(model, step0, &mut |n| rng.usize(0..n))? {
            Step0::Combined(pod) => return Ok(Selected::single(pod)),
            Step0::Pairs { prefill, decode } => {
                let listed = Candidates::Listed {
                    prefill: &prefill,
                    decode: &decode,
                };
                select::select_pair(model, listed, ledger, pair, rng, scratch)?
            }
        }
    };
    Ok(Selected::from(c))
}

/// [`select_pd`] that also records its reasoning into `explain`. Explaining is opt-in and
/// rare, so it runs the cascade as first written (`explained`, step by step, with hooks),
/// which the tests hold to the same choices as the optimised path; the normal path pays
/// nothing for it.
pub fn select_pd_explained(
    model: &ModelView,
    step0: Step0Input<'_>,
    ledger: &Ledger,
    pair: PairInput<'_>,
    rng: &mut fastrand::Rng,
    mut explain: Option<&mut Explain>,
) -> Result<Selected, RouteError> {
    if let Some(x) = explain.as_deref_mut() {
        x.bucket_len = step0.bucketing.then_some(step0.prompt_len);
        x.band = pair.banded_roleset.map(str::to_string);
    }
    let collected = candidates::collect(model, step0, &mut |n| rng.usize(0..n));
    if let (Some(x), Err(e)) = (explain.as_deref_mut(), &collected) {
        x.error = Some(explain_error(e));
    }
    match collected? {
        Step0::Combined(pod) => {
            if let Some(x) = explain {
                x.combined = Some(pod);
            }
            Ok(Selected::single(pod))
        }
        Step0::Pairs { prefill, decode } => {
            if let Some(x) = explain.as_deref_mut() {
                x.kept("s0", &prefill, &decode);
            }
            let rows = ledger.rows_for(&model.id_order, model.pods.len());
            let c = explained::select_pair_explained(
                model, prefill, decode, &rows, pair, rng, explain,
            )?;
            Ok(Selected::from(c))
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod proptests;
