//! pd-control's admission: a request of a limited user, or of a model with a rate, waits for
//! pd-control to count it against those limits (AIBrix's per-user RPM/TPM and
//! `requestsPerSecond`) before it is routed, and goes on or is refused when pd-control cannot
//! say, as the plugin's fail-open knobs decide.

use super::{Admission, Limited, PdHttp};
use crate::core::errors::RouteError;
use crate::core::fleet::FleetView;
use crate::core::request::Endpoint;
use crate::core::user_limits::{self, Ask, Charge, ModelRps, UsageScan, Verdict};
use crate::host::metrics::Metrics;

impl PdHttp {
    /// The user a request's limits are checked for, when pd-control checks limits.
    pub(super) fn limited_user(&self, fleet: &FleetView) -> Result<Option<String>, RouteError> {
        if fleet.user_limits {
            user_limits::user_of(self.user.clone())
        } else {
            Ok(None)
        }
    }

    /// What pd-control must admit before the request is routed: its user's limits, its
    /// model's rate (`requestsPerSecond`), both, or nothing (`None`, also once admitted).
    pub(super) fn admission_ask(
        &self,
        user: Option<String>,
        model: &str,
        rps: Option<f64>,
    ) -> Option<Ask> {
        if self.limits_checked {
            return None;
        }
        let rps = rps.filter(|r| ModelRps::of(*r).is_some());
        (user.is_some() || rps.is_some()).then(|| Ask {
            user,
            model: model.to_string(),
            rps,
            id: user_limits::admission_id(self.vm.borrow_mut().rng.u128(..)),
        })
    }

    /// Sends the admission; `Ok(true)` while its answer is awaited (the request waits with
    /// it), `Ok(false)` when it could not be sent and the plugin fails open.
    pub(super) fn start_admission(
        &mut self,
        ask: Ask,
        raw: &mut Vec<u8>,
    ) -> Result<bool, RouteError> {
        // The body waits with the request: refused before pd-control is asked (and counts the
        // request against its limits) when the VM holds its budget of bodies already.
        let held = self.hold_body(std::mem::take(raw), 0)?;
        let model = ask
            .rps
            .and_then(ModelRps::of)
            .map(|rps| (ask.model.as_str(), rps));
        let body = user_limits::admission_body(&ask.id, ask.user.as_deref(), model);
        let sent = {
            let vm = self.vm.borrow();
            Metrics::inc(vm.metrics.rate_limit_checks);
            crate::host::user_limits::send_admission(&vm.plugin, &body)
        };
        match sent {
            Ok(token) => {
                self.admission = Some(Admission {
                    token,
                    ask,
                    raw: held,
                });
                Ok(true)
            }
            Err(e) => {
                // Routed on at once if the plugin fails open: the body is the caller's again.
                *raw = held.into_body();
                let error = RouteError::UserLimitsUnavailable {
                    header: "x-error-user",
                    detail: format!("cannot call pd-control: {e}"),
                };
                // Not sent at all: a configuration error (no such cluster), not pd-control
                // being away; `rate_limits_fail_open` decides.
                self.unchecked(ask.user, error, false)?;
                Ok(false)
            }
        }
    }

    /// An admission that could not be decided: admitted (and counted) when the plugin fails
    /// open (`rate_limits_fail_open_unreachable` when pd-control was not `reached`), else the
    /// refusal.
    fn unchecked(
        &mut self,
        user: Option<String>,
        error: RouteError,
        unreached: bool,
    ) -> Result<(), RouteError> {
        let (fail_open, knob) = {
            let vm = self.vm.borrow();
            Metrics::inc(vm.metrics.rate_limit_unchecked);
            if unreached && vm.plugin.rate_limits_fail_open_unreachable {
                (true, "rate_limits_fail_open_unreachable")
            } else {
                (vm.plugin.rate_limits_fail_open, "rate_limits_fail_open")
            }
        };
        if !fail_open {
            return Err(error);
        }
        log::debug!(
            "request {} admitted unchecked ({knob}): {error}",
            self.request_id
        );
        self.admitted(user, None);
        Ok(())
    }

    fn admitted(&mut self, user: Option<String>, rpm: Option<i64>) {
        self.limits_checked = true;
        self.limited = user.map(|user| Limited {
            user,
            rpm,
            scan: UsageScan::of(self.endpoint.unwrap_or(Endpoint::ChatCompletions)),
        });
    }

    /// pd-control answered the admission of this request: route it, or refuse it.
    pub(super) fn on_admission(&mut self, admission: Admission, body_size: usize) {
        let (status, body) = self.call_answer(body_size);
        let Admission { ask, raw, .. } = admission;
        let withdraw = user_limits::needs_withdrawal(&status, &body);
        let admitted = match user_limits::judge(&ask, &status, &body) {
            Verdict::Admitted { rpm, charged } => {
                self.charge = charged.map(|rps| Charge {
                    model: ask.model.clone(),
                    rps,
                    // An age, taken by this VM: its monotonic clock (a wall-clock step back
                    // read as age 0 and could give the request back to a newer window).
                    answered_ms: crate::host::steady_ms(),
                });
                self.admitted(ask.user.clone(), rpm);
                Ok(())
            }
            Verdict::Refused(error) => Err(error),
            Verdict::Unchecked(error) => self.unchecked(ask.user.clone(), error, false),
            Verdict::Unreachable(error) => self.unchecked(ask.user.clone(), error, true),
        };
        let raw = match admitted {
            Err(refusal) => {
                if withdraw {
                    self.withdraw(&ask);
                }
                return self.resume_routed(Err(refusal));
            }
            // Routed now: out of the budget (a wait for a prefill leg holds it anew).
            Ok(()) => raw.into_body(),
        };
        let routed = self.route(raw);
        self.resume_routed(routed);
    }

    /// Withdraws the admission of a request refused without pd-control's answer
    /// (`user_limits::cancel_body` on `CANCEL_PATH`): sent and left, the refusal going out
    /// at once. Envoy keeps a side call running after the stream that made it ended (its
    /// answer then reaches no one), and pd-control retries Redis on its own; waiting for the
    /// answer would hold the client and the request's body for nothing. A request let
    /// through unchecked is not withdrawn: it runs, so a count that lands late is its own.
    fn withdraw(&mut self, ask: &Ask) {
        let body = user_limits::cancel_body(ask);
        let vm = self.vm.borrow();
        match crate::host::user_limits::send_withdrawal(&vm.plugin, &body) {
            Ok(_) => Metrics::inc(vm.metrics.withdrawals[0]),
            Err(e) => {
                Metrics::inc(vm.metrics.withdrawals[1]);
                log::warn!(
                    "request {}: cannot withdraw admission {}: {e}",
                    self.request_id,
                    ask.id
                );
            }
        }
    }
}
