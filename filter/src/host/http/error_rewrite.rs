//! A pod's error answer put in the contract's shape (`core::upstream_error`): its body
//! rewritten once it is all in, or, when its headers ended it, replaced by a local reply.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::HttpContext;
use proxy_wasm::types::Action;

use super::PdHttp;
use crate::core::upstream_error::{self, Rewrite, RESPONSE_UNKNOWN_HEADER};

impl PdHttp {
    /// Whether the answer now in is a pod's error to rewrite (`core::upstream_error`). Not
    /// the filter's own local replies (refusals, the watchdog's 504), which are already in the
    /// contract's shape, and not an answer whose headers ended it (see
    /// [`PdHttp::answer_bodiless_error`]).
    pub(super) fn error_rewrite_for(&self, end_of_stream: bool) -> Option<Rewrite> {
        let rewrite = Rewrite::for_status(self.obs.response_status?)?;
        let own = self.local_reply || self.vm.borrow().watchdog_fired.contains(&self.id);
        (!end_of_stream && !own).then_some(rewrite)
    }

    /// A pod's error answer that has no body (its headers ended the stream): there is no body
    /// to put the contract's JSON error in, so the answer is replaced by a local reply with
    /// that body, the pod's status and its headers (Envoy sends it straight to the client:
    /// no response header has gone out yet).
    pub(super) fn answer_bodiless_error(&mut self, rewrite: Rewrite) -> Action {
        let status = self.obs.response_status.unwrap_or(500);
        let answer = upstream_error::rewrite(rewrite, status, &[]);
        // As bytes: a value that is not UTF-8 (obs-text, RFC 9110) panics the SDK's text getter,
        // which traps the VM; such a header is left out of the reply.
        let pod_headers: Vec<(String, String)> = self
            .get_http_response_headers_bytes()
            .into_iter()
            .filter_map(|(name, value)| Some((name, String::from_utf8(value).ok()?)))
            .collect();
        let mut headers: Vec<(&str, &str)> = pod_headers
            .iter()
            .filter(|(name, _)| {
                !name.starts_with(':')
                    && !matches!(
                        name.as_str(),
                        "content-length"
                            | "content-type"
                            | "content-encoding"
                            | "transfer-encoding"
                            | "connection"
                            | "date"
                            | "server"
                    )
            })
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        headers.push(("content-type", "application/json"));
        if answer.marked() {
            headers.push((RESPONSE_UNKNOWN_HEADER, "true"));
        }
        self.local_reply = true;
        self.vm
            .borrow()
            .metrics
            .upstream_error_rewritten(answer.kind);
        if let Err(e) = hostcalls::send_http_response(status, headers, Some(&answer.body)) {
            log::warn!(
                "request {}: cannot answer the pod's bodiless {status}: {e:?}",
                self.request_id
            );
            return Action::Continue;
        }
        Action::Pause
    }

    /// Puts the rewritten error in place of the pod's buffered body (`body_size` bytes) and
    /// releases the held headers. An upstream that ended the body with trailers instead
    /// (not HTTP/1.1 engines) keeps its own body.
    pub(super) fn answer_error(&mut self, rewrite: Rewrite, body_size: usize) {
        let status = self.obs.response_status.unwrap_or(500);
        let body = if rewrite.reads_body() {
            self.get_http_response_body(0, body_size)
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let answer = upstream_error::rewrite(rewrite, status, &body);
        self.set_http_response_body(0, body_size, &answer.body);
        self.set_http_response_header("content-type", Some("application/json"));
        self.set_http_response_header("content-length", Some(&answer.body.len().to_string()));
        self.set_http_response_header("content-encoding", None);
        if answer.marked() {
            self.set_http_response_header(RESPONSE_UNKNOWN_HEADER, Some("true"));
        }
        self.vm
            .borrow()
            .metrics
            .upstream_error_rewritten(answer.kind);
    }
}
