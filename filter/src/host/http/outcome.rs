//! What a request counts as once it ends (its outcome, the pod it holds to account for passive
//! ejection, its durations), and when an answer Envoy gave on its own stream timeout is the
//! prefill pod's failure rather than the decode pod's.

use proxy_wasm::traits::Context;

use super::PdHttp;
use crate::core::errors::RouteError;
use crate::core::obs::outcome::{CutBy, Outcome};
use crate::host::Clock;

/// Model label of requests whose model the fleet does not know: client-chosen names never
/// become labels, so a client cannot grow Envoy's stats without bound.
const UNKNOWN_MODEL: &str = "unknown";

impl PdHttp {
    /// Counts the request's outcome and, when a pod answered, its durations. Runs once, at
    /// the end of the stream, whatever happened.
    pub(super) fn observe_end(&mut self, clock: &mut Clock) {
        // Envoy's answer seen at its headers (its body then passes the filter), or ended
        // without one.
        let timed_out_on_prefill = self.obs.timed_out_on_prefill
            || (self.waits_on_prefill() && self.ended_by_envoy_timeout());
        self.abort_abandoned_prefill();
        self.prefill_returned();
        let mut outcome = self.obs.outcome.unwrap_or(match self.obs.response_status {
            Some(_) if self.obs.times.end_us.is_none() => {
                let details = self
                    .get_property(vec!["response", "code_details"])
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default();
                CutBy::from_code_details(&details).outcome()
            }
            Some(code) => Outcome::Response { code },
            None => Outcome::Aborted,
        });
        if timed_out_on_prefill && outcome.pod_served() == Some(false) {
            // Ended by Envoy (its `stream_idle_timeout` or `max_stream_duration`, shorter than
            // the prefill timeout an operator set) while the request waited on its prefill
            // leg: the prefill pod's failure. The decode pod, which vLLM's order had not even
            // asked, is not blamed (three such requests ejected a healthy decode pod).
            let code = match outcome {
                Outcome::Response { code } => code,
                _ => 502,
            };
            outcome = Outcome::PrefillFailure { code };
            self.prefill_served(&code.to_string(), clock);
            self.vm
                .borrow_mut()
                .metrics
                .prefill_failed(&Self::ended_before_prefill(code));
        }
        let model = self.obs.model.as_deref().unwrap_or(UNKNOWN_MODEL);
        let mut vm = self.vm.borrow_mut();
        vm.metrics.outcome(model, outcome);
        if let (Some(pod), Some(ok)) = (&self.served.target, outcome.pod_served()) {
            vm.pod_outcome(pod, ok, clock.ms());
        }
        // Latencies of answers only: a pod shedding load with fast 503s would otherwise make
        // the TTFT and total-time histograms look better the worse it gets.
        if matches!(outcome, Outcome::Response { code } if (200..300).contains(&code)) {
            let mut times = self.obs.times;
            times.end_us.get_or_insert_with(|| clock.us());
            let threshold_us = (vm.defaults.env.ttft_threshold_s * 1e6) as u64;
            vm.metrics.durations(&times.durations(), threshold_us);
        }
    }

    /// Whether the request is waiting on its prefill leg with its decode leg not sent yet
    /// (vLLM's and TRT-LLM `context_first`'s order, or a `/server_info` lookup): nothing but
    /// the prefill can hold it then. SGLang's legs go at once, and its prefill cannot finish
    /// until the decode pod joins the bootstrap room: a hung decode pod holds the prefill leg
    /// out too, so a wait there is no evidence against the prefill pod.
    pub(super) fn waits_on_prefill(&self) -> bool {
        (self.obs.prefill_outstanding && self.pending.is_some()) || self.legs.looks_up_server()
    }

    /// Whether Envoy ended the stream on one of its own stream timeouts (its
    /// `response.code_details`), not on anything the pods did: only then is a request
    /// waiting on its prefill leg the prefill's failure (an SGLang decode pod that answers
    /// 503 or resets while its prefill runs is the decode's).
    pub(super) fn ended_by_envoy_timeout(&self) -> bool {
        const ENVOY_TIMEOUTS: [&str; 3] = [
            "stream_idle_timeout",
            "max_duration_timeout",
            "request_overall_timeout",
        ];
        self.get_property(vec!["response", "code_details"])
            .is_some_and(|d| ENVOY_TIMEOUTS.iter().any(|t| d == t.as_bytes()))
    }

    /// What a request that Envoy ended while its prefill leg was out counts as.
    pub(super) fn ended_before_prefill(code: u32) -> RouteError {
        RouteError::Prefill {
            status: code,
            // As a prefill leg Envoy timed out is counted (`timeout`/504).
            class: "http_error",
            detail: "the stream ended (Envoy's stream_idle_timeout or max_stream_duration) before the prefill leg answered".into(),
        }
    }
}
