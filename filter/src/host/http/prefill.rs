//! The prefill leg that a pair's decode leg waits for: sent as a side call, its answer made
//! into the decode leg (or, from TRT-LLM's context leg, into the client's whole answer), and
//! how the prefill pod answered kept for passive ejection.

use proxy_wasm::hostcalls;

use super::{pair, PdHttp};
use crate::core::call_timeout::call_timeout;
use crate::core::engine::{trtllm, vllm};
use crate::core::errors::RouteError;
use crate::core::inbound::ENVOY_DST_HEADER;
use crate::core::obs::outcome;
use crate::core::request::Endpoint;
use crate::host::metrics::Metrics;
use crate::host::Clock;

impl PdHttp {
    pub(super) fn dispatch_prefill(
        &self,
        endpoint: Endpoint,
        address: &str,
        body: &[u8],
    ) -> Result<u32, RouteError> {
        self.guard_target(address)?;
        let (dst_header, cluster, timeout_s) = {
            let vm = self.vm.borrow();
            (
                vm.plugin.dst_header.clone(),
                vm.plugin.pods_cluster.clone(),
                self.prefill_timeout_s,
            )
        };
        let mut headers: Vec<(&str, &str)> = vec![
            (":method", "POST"),
            (":path", endpoint.path()),
            (":authority", address),
            ("content-type", "application/json"),
            ("x-request-id", &self.request_id),
            (dst_header.as_str(), address),
        ];
        if dst_header != ENVOY_DST_HEADER {
            headers.push((ENVOY_DST_HEADER, address));
        }
        for (name, value) in &self.forwarded {
            headers.push((name, value));
        }
        crate::section!(
            "request_body.prefill_callout",
            hostcalls::dispatch_http_call(
                &cluster,
                headers,
                Some(body),
                vec![],
                call_timeout(timeout_s),
            )
        )
        .map_err(|e| RouteError::Prefill {
            status: 503,
            class: "dispatch",
            detail: format!("cannot send the prefill request to {address}: {e:?}"),
        })
    }

    /// Records how the prefill pod answered its leg, for passive ejection.
    pub(super) fn prefill_served(&self, status: &str, clock: &mut Clock) {
        if let (Some(pod), Some(ok)) = (&self.served.prefill, outcome::prefill_served(status)) {
            self.vm.borrow_mut().pod_outcome(pod, ok, clock.ms());
        }
    }

    /// Lowers `gateway_prefill_outstanding_requests` once the leg is over (answered, or the
    /// stream ended first).
    pub(super) fn prefill_returned(&mut self) {
        if std::mem::take(&mut self.obs.prefill_outstanding) {
            Metrics::gauge_add(self.vm.borrow().metrics.prefill_outstanding, -1);
        }
    }

    /// Makes the decode leg from the prefill's answer; `Ok(Some(answer))` when the context
    /// leg finished the request itself (TRT-LLM) and `answer` is the client's.
    pub(super) fn finish_prefill(
        &mut self,
        status: &str,
        response: &[u8],
    ) -> Result<Option<trtllm::FinalAnswer>, RouteError> {
        let Some(pending) = self.pending.take() else {
            return Err(RouteError::Internal(
                "prefill answer without a pending decode".into(),
            ));
        };
        if status != "200" {
            return Err(RouteError::prefill_answer(status, response, "http_error"));
        }
        crate::section_scope!("prefill_answer.decode_leg");
        let edit = match pending.merge {
            pair::Merge::Vllm(connector) => crate::section!(
                "decode_leg.body",
                vllm::decode_edit(
                    &pending.body,
                    &pending.members,
                    response,
                    &pending.prefill_ip,
                    connector,
                )
            )?,
            pair::Merge::Trtllm {
                endpoint,
                stream,
                include_usage,
            } => {
                if let Some(answer) =
                    trtllm::final_context_answer(response, endpoint, stream, include_usage)
                {
                    return Ok(Some(answer));
                }
                trtllm::generation_edit(&pending.body, &pending.members, endpoint, response)?
            }
            pair::Merge::Unchanged => None,
        };
        if let Some(edit) = edit {
            crate::section!(
                "decode_leg.replace_body",
                self.edit_body(&edit, pending.body.len())
            )?;
        }
        let strategy = self
            .routed
            .as_ref()
            .map(|r| r.strategy.clone())
            .unwrap_or_default();
        let address = crate::section!(
            "decode_leg.recheck",
            self.decode_destination(&pending.decode)
        );
        crate::section!(
            "decode_leg.destination",
            self.set_destination(&address, &strategy)
        )?;
        // A decode pod moved off the chosen one has no stand-in named for it.
        let stand_in = pending
            .decode
            .stand_in
            .filter(|_| address == pending.decode.address);
        self.name_destinations(&pending.decode.key, &address, stand_in, false);
        Ok(None)
    }

    /// Answers the client with the context leg's whole answer: no generation leg is sent. The
    /// decode pod's charge goes with the request's others when it ends.
    pub(super) fn answer_from_context(&mut self, answer: trtllm::FinalAnswer) {
        log::debug!(
            "request {}: the context leg finished the answer; no generation leg",
            self.request_id
        );
        self.answered_by_context();
        self.local_reply = true;
        self.vm.borrow_mut().watched.remove(&self.id);
        let headers = vec![
            ("content-type", answer.content_type),
            ("request-id", self.request_id.as_str()),
        ];
        if let Err(e) = hostcalls::send_http_response(200, headers, Some(&answer.body))
            .or_else(|_| hostcalls::reset_http_response())
        {
            log::warn!("request {}: cannot answer: {e:?}", self.request_id);
        }
    }
}
