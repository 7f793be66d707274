//! The `external` strategy in the request path: ask pd-control which standard pod the
//! operator's service chooses (the request waits, as for an admission), then route to it, to
//! the configured fallback, or refuse (403 / 503), as `core::external::plan` says.

use std::time::Duration;

use super::PdHttp;
use crate::core::errors::RouteError;
use crate::core::external::{self, Answer, Outcome, Plan};
use crate::core::fleet::{FleetView, ModelView};
use crate::core::ledger;
use crate::core::pd::single::{no_standard_pod, running_by_slot};
use crate::core::profile::{Strategy, StrategySpec};
use crate::core::request::RoutingRequest;
use crate::host::metrics::Metrics;
use crate::host::store::SharedData;

/// A request waiting for pd-control's decision.
pub(super) struct ExternalCall {
    pub token: u32,
    /// The whole request body, routed again once decided (held in the VM's budget).
    pub raw: crate::core::held_body::HeldBody,
}

/// How an external request is routed once decided.
pub(super) enum ExternalPick {
    /// The standard pod in this slot of the model view.
    Pod(usize),
    /// The local fallback strategy.
    Fallback(StrategySpec),
}

impl PdHttp {
    /// The decision for an `external` request: `Ok(None)` while pd-control is being asked
    /// (the request waits; `raw` moved into the call), else how to route it.
    pub(super) fn external_pick(
        &mut self,
        fleet: &FleetView,
        model: &ModelView,
        req: &RoutingRequest,
        raw: &mut Vec<u8>,
    ) -> Result<Option<ExternalPick>, RouteError> {
        let name = Strategy::External.name();
        let config = fleet
            .external_router
            .clone()
            .ok_or_else(|| RouteError::BadStrategy(name.into()))?;
        if model.others.is_empty() {
            return Err(no_standard_pod(name));
        }
        let (plan, outcome) = match self.external_answer.take() {
            Some(answer) => external::plan(answer, &config),
            // AIBrix's local fast path: nothing to advise on.
            None if config.advisory && model.others.len() == 1 => (
                Plan::Pod(model.pods[model.others[0]].key.clone()),
                Outcome::Bypassed,
            ),
            None => {
                // The body waits with the request: refused before the ask when the VM holds
                // its budget of bodies already (the hold after the check cannot fail: nothing
                // else runs in between).
                self.body_fits(raw.len())?;
                match self.ask_external(&config, model, req) {
                    Ok(token) => {
                        let raw = self.hold_body(std::mem::take(raw), 0)?;
                        self.external_call = Some(ExternalCall { token, raw });
                        return Ok(None);
                    }
                    Err(why) => external::plan(Err(why), &config),
                }
            }
        };
        Metrics::inc(self.vm.borrow().metrics.external_decisions[outcome as usize]);
        self.obs.external = Some(outcome);
        match plan {
            Plan::Pod(key) => match model.others.iter().find(|&&i| model.pods[i].key == key) {
                Some(&slot) => Ok(Some(ExternalPick::Pod(slot))),
                // The service chose a pod this worker no longer routes to.
                None => external::failed(&config, format!("the chosen pod {key} is not routable"))
                    .map(|spec| Some(ExternalPick::Fallback(spec))),
            },
            Plan::Fallback(spec) => Ok(Some(ExternalPick::Fallback(spec))),
            Plan::Refuse(error) => Err(error),
        }
    }

    /// Sends the ask: every standard pod with its running requests (all workers and
    /// replicas). Returns the call's token.
    fn ask_external(
        &self,
        config: &crate::proto::ExternalRouter,
        model: &ModelView,
        req: &RoutingRequest,
    ) -> Result<u32, String> {
        let vm = self.vm.borrow();
        let mut ledger = ledger::read(&SharedData).map_err(|e| e.to_string())?;
        ledger.set_remote(vm.remote.clone());
        let running = running_by_slot(model, &ledger, true);
        let traceparent = self
            .forwarded
            .iter()
            .find(|(k, _)| *k == "traceparent")
            .map(|(_, v)| v.as_str());
        let candidates = model.others.iter().map(|&i| {
            (
                model.pods[i].key.as_str(),
                running.get(i).copied().unwrap_or(0),
            )
        });
        let body = external::ask_body(&self.request_id, &req.model, traceparent, candidates);
        let timeout = Duration::from_millis(u64::from(config.timeout_ms) + external::MARGIN_MS);
        crate::host::user_limits::post(&vm.plugin, external::ROUTE_PATH, None, &body, timeout)
    }

    /// pd-control answered (or the call failed): route the request again with the answer.
    pub(super) fn on_external(&mut self, call: ExternalCall, body_size: usize) {
        let (status, body) = self.call_answer(body_size);
        self.external_answer = Some(external::parse_answer(&status, &body));
        let routed = self.route(call.raw.into_body());
        self.resume_routed(routed);
    }
}

/// pd-control's answer, or why there is none (the call failed, not 200, not an answer).
pub(super) type Pending = Result<Answer, String>;
