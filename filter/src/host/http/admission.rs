//! pd-control's admission: a request of a limited user, or of a model with a rate, waits for
//! pd-control to count it against those limits (AIBrix's per-user RPM/TPM and
//! `requestsPerSecond`) before it is routed, and goes on or is refused when pd-control cannot
//! say, as the plugin's fail-open knobs decide.

use super::{Admission, Limited, PdHttp};
use crate::core::errors::RouteError;
use crate::core::fleet::FleetView;
use crate::core::held_body::HeldBody;
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
            withdrawing: None,
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

    /// pd-control answered the admission of this request: route it, or refuse it. Or
    /// answered its withdrawal: refuse it as decided before.
    pub(super) fn on_admission(&mut self, admission: Admission, body_size: usize) {
        let (status, body) = self.call_answer(body_size);
        let Admission { mut ask, raw, .. } = admission;
        if let Some(refusal) = ask.withdrawing.take() {
            // Whatever the withdrawal's fate: pd-control retries Redis on its own, and a
            // withdrawal that did not arrive cannot be helped from a stream that ends now.
            log::debug!(
                "request {}: admission {} withdrawn ({status})",
                self.request_id,
                ask.id
            );
            return self.resume_routed(Err(refusal));
        }
        let answered = user_limits::answered(&status, &body);
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
            Err(refusal) if !answered => return self.withdraw(ask, raw, refusal),
            Err(refusal) => return self.resume_routed(Err(refusal)),
            // Routed now: out of the budget (a wait for a prefill leg holds it anew).
            Ok(()) => raw.into_body(),
        };
        let routed = self.route(raw);
        self.resume_routed(routed);
    }

    /// Refuses a request whose admission got no answer from pd-control, after withdrawing
    /// the admission (`user_limits::cancel_body`): sent from this stream, which waits for
    /// the withdrawal's answer (at most `rate_limits_timeout_ms` more), because the stream's
    /// end would cancel a call still in flight. A request let through unchecked is not
    /// withdrawn: it runs, so a count that lands late is its own.
    fn withdraw(&mut self, mut ask: Ask, raw: HeldBody, refusal: RouteError) {
        let body = user_limits::cancel_body(&ask);
        let sent = {
            let vm = self.vm.borrow();
            crate::host::user_limits::send_admission(&vm.plugin, &body)
        };
        match sent {
            Ok(token) => {
                ask.withdrawing = Some(refusal);
                self.admission = Some(Admission { token, ask, raw });
            }
            Err(e) => {
                log::warn!(
                    "request {}: cannot withdraw admission {}: {e}",
                    self.request_id,
                    ask.id
                );
                self.resume_routed(Err(refusal));
            }
        }
    }
}
