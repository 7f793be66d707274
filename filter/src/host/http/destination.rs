//! Where the request goes, as Envoy and the access log see it: an address checked against the
//! fleet the request was routed on, the ORIGINAL_DST header, and the `wasm.pd_*` filter state.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::HttpContext;

use super::{
    PdHttp, STATE_DECODE_POD, STATE_EXPLAIN, STATE_PREFILL_POD, STATE_PROFILE, STATE_SELECTION_US,
    STATE_STRATEGY, STATE_TARGET_POD,
};
use crate::core::errors::RouteError;
use crate::core::fleet::ModelView;
use crate::core::pd::Target;

impl PdHttp {
    /// Refuses any upstream address that is not a pod of the snapshot the request was routed
    /// on (see `core::guard`); logged with the address, which the client's reply leaves out.
    pub(super) fn guard_target(&self, address: &str) -> Result<(), RouteError> {
        let checked = match &self.routed_on {
            Some(fleet) => crate::core::guard::check_target(Some(fleet), address),
            None => crate::core::guard::check_target(self.vm.borrow().fleet.as_deref(), address),
        };
        if checked.is_err() {
            log::warn!(
                "context {}: refusing to send request {} to {address:?}: not a pod of the current fleet",
                self.id, self.request_id
            );
        }
        checked
    }

    /// Points the ORIGINAL_DST cluster at the pod and stamps the upstream request.
    pub(super) fn set_destination(&self, address: &str, strategy: &str) -> Result<(), RouteError> {
        self.guard_target(address)?;
        let dst_header = self.vm.borrow().plugin.dst_header.clone();
        self.set_http_request_header(&dst_header, Some(address));
        self.set_http_request_header("x-request-id", Some(&self.request_id));
        // The pod sees the strategy that routed it; a client header that says exactly that,
        // once, stays as it is (a header write is ≈ 3 400 instructions).
        let as_sent = !self.strategy_repeated && self.strategy_header.as_deref() == Some(strategy);
        if !strategy.is_empty() && !as_sent {
            self.set_http_request_header("routing-strategy", Some(strategy));
        }
        Ok(())
    }

    /// The request is answered by pod `key` (`name`, `address`) rather than the one it was
    /// routed to (a decode leg moved, a stand-in retried on): passive ejection's outcome, the
    /// response headers, the watchdog and the access log's filter state follow it. Charges
    /// are the caller's to move.
    pub(super) fn answered_by(&mut self, key: &str, name: &str, address: &str) {
        self.served.target = Some(key.to_string());
        if let Some(routed) = self.routed.as_mut() {
            routed.pod_name = name.to_string();
            routed.pod_address = address.to_string();
        }
        if let Some(w) = self.vm.borrow_mut().watched.get_mut(&self.id) {
            w.decode_pod = name.to_string();
            w.decode_address = address.to_string();
        }
        let states: &[&str] = if self.served.prefill.is_some() {
            &[STATE_DECODE_POD, STATE_TARGET_POD]
        } else {
            &[STATE_TARGET_POD]
        };
        for state in states {
            if let Err(e) = hostcalls::set_property(vec![state], Some(name.as_bytes())) {
                log::debug!(
                    "context {}: cannot set filter state {state}: {e:?}",
                    self.id
                );
            }
        }
    }

    /// The context pod answered the request itself (TRT-LLM's first token ended it): the
    /// decode pod never saw it, so it takes no outcome (a success would clear the failure
    /// streak of a decode pod failing every generation leg, and ejection would never come),
    /// and the response headers and the access log's target name the context pod (its
    /// `pd_decode_pod` stays the pair's, as selected).
    pub(super) fn answered_by_context(&mut self) {
        self.served.target = None;
        let Some(routed) = self.routed.as_mut() else {
            return;
        };
        let Some((name, address)) = routed.prefill.clone() else {
            return;
        };
        if let Err(e) = hostcalls::set_property(vec![STATE_TARGET_POD], Some(name.as_bytes())) {
            log::debug!(
                "context {}: cannot set filter state {STATE_TARGET_POD}: {e:?}",
                self.id
            );
        }
        routed.pod_name = name;
        routed.pod_address = address;
    }

    /// Exposes the routing decision as filter state (`wasm.pd_*`) for access-log formats.
    pub(super) fn log_state(
        &self,
        model: &ModelView,
        target: Target,
        strategy: &str,
        profile: Option<&str>,
    ) {
        let set = |key: &str, value: &str| {
            if let Err(e) = hostcalls::set_property(vec![key], Some(value.as_bytes())) {
                log::debug!("context {}: cannot set filter state {key}: {e:?}", self.id);
            }
        };
        if let Target::Pair { prefill, decode } = target {
            set(STATE_PREFILL_POD, &model.pods[prefill].name);
            set(STATE_DECODE_POD, &model.pods[decode].name);
        }
        set(STATE_TARGET_POD, &model.pods[target.pod()].name);
        set(STATE_STRATEGY, strategy);
        if let Some(profile) = profile {
            set(STATE_PROFILE, profile);
        }
        if let Some(us) = self.obs.selection_us {
            set(STATE_SELECTION_US, &us.to_string());
        }
        if let Some(explain) = &self.obs.explain_header {
            set(STATE_EXPLAIN, explain);
        }
    }
}
