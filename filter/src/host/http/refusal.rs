//! The filter's refusal of a request: the error catalogue's status, `x-error-*` header and
//! body as a local reply, with what a refusal gives back (charges, the model rate) and how it
//! is counted and logged.

use proxy_wasm::hostcalls;
use proxy_wasm::types::Action;

use super::{PdHttp, EXPLAIN_HEADER};
use crate::core::errors::RouteError;
use crate::core::obs::outcome::Outcome;
use crate::host::Clock;

impl PdHttp {
    pub(super) fn reject(&mut self, error: RouteError) -> Action {
        self.local_reply = true;
        self.release_all(&mut Clock::default());
        if let Some(charge) = self.charge.take() {
            // Counted against the model's rate, never served: AIBrix does not charge it.
            let mut vm = self.vm.borrow_mut();
            vm.model_refunds.add(charge);
            vm.wake();
        }
        self.obs.outcome.get_or_insert(Outcome::rejected(&error));
        {
            let mut vm = self.vm.borrow_mut();
            vm.metrics.rejected(&error);
            if matches!(error, RouteError::Prefill { .. }) {
                vm.metrics.prefill_failed(&error);
            }
        }
        // Client mistakes (and a scanner's wrong keys) are counted, not logged line by line.
        if !matches!(
            error,
            RouteError::UnknownPath
                | RouteError::BadBody
                | RouteError::BodyTooLarge { .. }
                | RouteError::TooManyMembers { .. }
                | RouteError::NoMessages
                | RouteError::Unauthorized
                // Gateway load, not a fault: a flood of these is counted, not logged.
                | RouteError::HeldBodiesOverBudget { .. }
        ) {
            let admitted = self
                .vm
                .borrow_mut()
                .refusal_log
                .admit(error.reason(), crate::host::steady_ms());
            if let Some(left_out) = admitted {
                self.log_refusal(&error, left_out);
            }
        }
        let header = error.header();
        let mut headers = crate::core::errors::reply_headers(&header, &self.request_id);
        if let Some(explain) = &self.obs.explain_header {
            headers.push((EXPLAIN_HEADER, explain.as_str()));
        }
        let body = error.body();
        if let Err(e) = hostcalls::send_http_response(error.status(), headers, Some(&body)) {
            // Paused with no answer coming, the client would wait for Envoy's idle timeout.
            log::error!(
                "context {}: cannot send local reply: {e:?}; resetting the stream",
                self.id
            );
            let _ = hostcalls::reset_http_response();
        }
        Action::Pause
    }

    /// Answers a readiness probe (`core::readiness`) from this worker's routing view, before
    /// anything else of the request path runs: no API key, no counter, no log line.
    pub(super) fn answer_readiness(&mut self, snapshot_version: Option<u64>) -> Action {
        self.probe = true;
        self.local_reply = true;
        let (status, body) = crate::core::readiness::answer(snapshot_version);
        let headers = vec![
            ("content-type", "application/json"),
            ("cache-control", "no-store"),
        ];
        if let Err(e) = hostcalls::send_http_response(status, headers, Some(body.as_bytes())) {
            log::error!(
                "context {}: cannot answer a readiness probe: {e:?}; resetting the stream",
                self.id
            );
            let _ = hostcalls::reset_http_response();
        }
        Action::Pause
    }

    /// One refusal's log line, with the refusals of its reason the pace left out before it.
    fn log_refusal(&self, error: &RouteError, left_out: u64) {
        use crate::core::errors::loggable;
        let mut what = loggable(&error.to_string());
        if let (RouteError::Prefill { .. }, Some(pod)) = (error, &self.served.prefill) {
            // Which pod failed is what the operator looks for first.
            what.push_str(&format!(" (prefill pod {pod})"));
        }
        if let Some(detail) = error.detail() {
            what.push_str(": ");
            what.push_str(&loggable(detail));
        }
        if left_out > 0 {
            what.push_str(&format!(
                " (and {left_out} more {} refusals since the last such line, not logged)",
                error.reason()
            ));
        }
        log::info!("request {} refused: {what}", self.request_id);
    }

    /// Counts a PD selection that failed before any pod was scored (an unknown
    /// `decodeScorePolicy`, pods of mixed engines) as AIBrix does, with the failures of the
    /// selection itself.
    pub(super) fn selection_failed(&self, error: RouteError) -> RouteError {
        if matches!(error, RouteError::Selection { .. }) {
            self.vm.borrow_mut().metrics.prefill_failed(&error);
        }
        error
    }
}
