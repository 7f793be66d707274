//! Prefill failover (`PluginConfig::prefill_failover`): a PD request whose prefill pod failed
//! its leg before the client was sent anything is routed again without that pod.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::HttpContext;
use proxy_wasm::types::Action;

use super::{Failover, PdHttp, STATE_FAILED_PREFILL};
use crate::core::errors::RouteError;
use crate::core::fleet::ModelView;
use crate::host::metrics::Metrics;
use crate::host::Clock;

impl Failover {
    /// `model` without the pods that failed this request's prefill: `Ok(None)` when none of
    /// them is in it, `Err` with the last failure when leaving them out leaves no route.
    pub(super) fn without_failed(
        &mut self,
        model: &ModelView,
    ) -> Result<Option<ModelView>, RouteError> {
        if self.excluded.is_empty() {
            return Ok(None);
        }
        let failed = |key: &str| self.excluded.iter().any(|k| k == key);
        if !model.pods.iter().any(|p| failed(&p.key)) {
            return Ok(None);
        }
        let failed = |key: &str| failed(key).then_some(crate::core::fleet::LeftOut::FailedPrefill);
        match model.without_because(failed) {
            Some(view) => Ok(Some(view)),
            None => Err(self.failure.take().unwrap_or(RouteError::Selection {
                detail: "no pod left after the failed prefill pods".into(),
            })),
        }
    }
}

impl PdHttp {
    /// Routes the request again when its prefill leg never reached the pod (refused, reset
    /// before any answer) or the pod answered one of `prefill_failover_statuses`, leaving
    /// that pod out, while `prefill_failover` allows: the client has been sent nothing, so
    /// another pair can serve it whole. Returns whether the request was taken over (routed
    /// again, or answered with the failure because no other pod can take it); false leaves
    /// the failure to the caller.
    pub(super) fn fail_over(&mut self, status: &str, body: &[u8], clock: &mut Clock) -> bool {
        let due = {
            let vm = self.vm.borrow();
            self.failover.excluded.len() < vm.plugin.prefill_failover as usize
                && RouteError::prefill_fails_over(
                    status,
                    body,
                    &vm.plugin.prefill_failover_statuses,
                )
        };
        if !due || self.served.prefill.is_none() {
            return false;
        }
        let (Some(pending), Some(failed)) = (self.pending.take(), self.served.prefill.take())
        else {
            return false;
        };
        // The failed pair's decode charge and watchdog: the next selection brings its own.
        self.release_all(clock);
        if self.vm.borrow().holds.contains_key(&self.id) {
            // The ledger did not take the release: a new selection's hold would replace this
            // one and its charges would stay on the pods for good. The failure goes to the
            // client instead, and the request's end (or the TTL janitor) releases them.
            self.pending = Some(pending);
            self.served.prefill = Some(failed);
            return false;
        }
        self.vm.borrow_mut().watched.remove(&self.id);
        let what = match RouteError::prefill_failure_class(status, body) {
            "transport" => "unreachable".to_string(),
            _ => format!("answered {status}"),
        };
        log::info!(
            "request {}: prefill pod {failed} {what} ({}); routing again without it",
            self.request_id,
            crate::core::errors::loggable(&String::from_utf8_lossy(&body[..body.len().min(120)]))
        );
        self.failover.excluded.push(failed);
        let failed_pods = self.failover.excluded.join(",");
        if let Err(e) =
            hostcalls::set_property(vec![STATE_FAILED_PREFILL], Some(failed_pods.as_bytes()))
        {
            log::debug!("context {}: cannot set filter state: {e:?}", self.id);
        }
        self.failover.failure = Some(RouteError::prefill_answer(status, body, "http_error"));
        self.obs.explain_header = None;
        let result = self.route(pending.body.into_body());
        let [rerouted_id, failed_id] = self.vm.borrow().metrics.prefill_failover;
        match result {
            Ok(action) => {
                Metrics::inc(rerouted_id);
                if let Some(failure) = &self.failover.failure {
                    self.vm.borrow_mut().metrics.prefill_call_failed(failure);
                }
                if action == Action::Continue {
                    self.resume_http_request();
                }
            }
            Err(e) => {
                Metrics::inc(failed_id);
                self.routed = None;
                // The client gets the prefill's failure, as without failover: why no other
                // pair could take the request is the gateway's business (and logged).
                let failure = match self.failover.failure.take() {
                    Some(failure) => {
                        log::info!("request {}: no other pair: {e}", self.request_id);
                        failure
                    }
                    None => e,
                };
                self.reject(failure);
            }
        }
        true
    }
}
