//! A pair's decode pod that left the routing view while the prefill ran.
//!
//! vLLM and TRT-LLM `context_first` send the decode leg only once the prefill answered, and
//! whichever decode pod gets it pulls the KV from the prefill pod the answer names: nothing in
//! the prefill was made for one decode pod. So when the chosen decode pod has left this VM's
//! view by then (pd-control found its engine unreachable or stalled, a worker ejected it, it
//! left the fleet), another decode pod of the same roleset takes the leg instead of the
//! request failing on a dead pod.

use std::cell::Cell;
use std::rc::Rc;

use super::PdHttp;
use crate::host::holds;
use crate::host::metrics::Metrics;
use crate::host::now_ms;

/// The decode pod a pair was routed with, as its decode leg needs it.
pub(super) struct ChosenDecode {
    pub key: String,
    pub roleset: String,
    pub address: String,
    /// The decode pod named second for Envoy's retry of a refused connection.
    pub stand_in: Option<super::stand_in::StandIn>,
}

impl PdHttp {
    /// Where the decode leg goes: the pod chosen with the prefill while it is still in this
    /// VM's routing view (the usual case: the view it was chosen in, or two hash lookups in a
    /// newer one), else the decode pod of the same
    /// roleset with the fewest running requests, the request's decode charges moved to it.
    /// With no decode pod of the roleset left, or for a request an `external-filter`
    /// narrowed, the chosen one keeps the leg.
    pub(super) fn decode_destination(&mut self, chosen: &ChosenDecode) -> String {
        let candidates: Vec<(String, String, String)> = {
            let vm = self.vm.borrow();
            if let (Some(now), Some(then)) = (&vm.fleet, &self.routed_on) {
                if Rc::ptr_eq(now, then) {
                    return chosen.address.clone(); // the view the pair was chosen in
                }
            }
            let model = vm
                .fleet
                .as_ref()
                .zip(self.obs.model.as_ref())
                .and_then(|(fleet, name)| fleet.models.get(name));
            let Some(model) = model.filter(|_| !self.narrowed) else {
                return chosen.address.clone();
            };
            if model.decode_slot(&chosen.key).is_some() {
                return chosen.address.clone();
            }
            model
                .decode_pods_of(&chosen.roleset)
                .iter()
                .map(|&i| {
                    let p = &model.pods[i];
                    (p.key.clone(), p.name.clone(), p.address.clone())
                })
                .collect()
        };
        if candidates.is_empty() {
            return chosen.address.clone();
        }
        // The least-loaded candidate is picked in the same CAS round that moves the charges.
        let picked = Cell::new(0);
        let now = now_ms();
        holds::update(&self.vm, self.id, |held, ledger| {
            let best = (0..candidates.len())
                .min_by_key(|&i| ledger.counts_of(&candidates[i].0).running)
                .unwrap_or(0);
            picked.set(best);
            held.move_decode(ledger, &candidates[best].0, now)
        });
        let (key, name, address) = &candidates[picked.get()];
        log::info!(
            "request {}: decode pod {} left the routing view during the prefill; decoding on {key} instead",
            self.request_id,
            chosen.key
        );
        self.answered_by(key, name, address);
        if let Some(header) = self.obs.explain_header.as_mut() {
            header.push_str("; decode_moved=");
            header.push_str(name);
        }
        let vm = self.vm.borrow();
        Metrics::inc(vm.metrics.decode_rerouted);
        // The new pod is in the current view; later checks of this request's destinations
        // go against that view.
        self.routed_on = vm.fleet.clone();
        address.clone()
    }
}
