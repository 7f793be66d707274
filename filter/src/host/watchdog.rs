//! The decode watchdog's host side: every request of this VM with a watchdog, checked on the
//! root context's tick. A fired watchdog answers 504 (`x-error-pd-decode`) when no response
//! header reached the client yet, otherwise resets the stream (the client sees a cut
//! chunked body); either way the decode pod is asked to drop the request.
//!
//! Context ids are per VM, so only the worker that owns a stream can act on it; each worker
//! runs its own check.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

use crate::core::errors::RouteError;
use crate::core::watchdog::{self, Fire, Watchdog, WatchdogSettings};
use crate::host::legs::{AbortCause, AbortOrder};
use crate::host::metrics::Metrics;
use crate::host::SharedVm;

/// One request's watchdog and what a fire needs.
#[derive(Clone)]
pub struct Watched {
    pub watchdog: Watchdog,
    pub settings: WatchdogSettings,
    pub request_id: String,
    pub decode_pod: String,
    pub decode_address: String,
    /// SGLang's request id; `None` for engines without `/abort_request`.
    pub rid: Option<String>,
    /// The client's `authorization`, for the abort (kept only with a `rid`).
    pub authorization: Option<String>,
}

/// Metric ids of the watchdog (per VM).
///
/// `gateway_request_model_fail_total{status="pd_decode_watchdog"}` is counted with the
/// request's other outcomes when it ends (`VmState::watchdog_fired` marks it), so each request
/// counts once, under its model.
#[derive(Default, Clone, Copy)]
pub struct WatchdogMetrics {
    first_response: Option<u32>,
    stream_idle: Option<u32>,
}

impl WatchdogMetrics {
    pub fn define() -> WatchdogMetrics {
        let c = |phase: &str| {
            let name = crate::core::obs::labels::tagged(
                "gateway_pd_decode_watchdog_total",
                &[("phase", phase)],
            );
            hostcalls::define_metric(MetricType::Counter, &name).ok()
        };
        WatchdogMetrics {
            first_response: c("first_response"),
            stream_idle: c("stream_idle"),
        }
    }
}

/// Checks every watched request of the VM; `root_id` is the calling root context, made
/// effective again afterwards.
pub fn tick(vm: &SharedVm, root_id: u32) {
    // Watchdogs are armed and fed on the monotonic clock (`host::steady_ms`).
    let steady = crate::host::steady_ms();
    // Context id, the fire, and the request's record (copied out: ending the stream re-enters
    // the VM's state).
    let fired: Vec<(u32, Fire, Watched)> = {
        let mut vm = vm.borrow_mut();
        vm.watched
            .iter_mut()
            .filter_map(|(id, w)| w.watchdog.poll(steady).map(|fire| (*id, fire, w.clone())))
            .collect()
    };
    if fired.is_empty() {
        return;
    }
    let metrics = vm.borrow().watchdog_metrics;
    for (id, fire, w) in fired {
        let request_id = &w.request_id;
        let pod = &w.decode_pod;
        Metrics::inc(match fire.phase {
            watchdog::Phase::FirstResponse => metrics.first_response,
            watchdog::Phase::StreamIdle => metrics.stream_idle,
        });
        vm.borrow_mut().watchdog_fired.insert(id);
        log::warn!(
            "request {request_id}: decode pod {pod} exceeded the {} bound ({} ms); {}",
            fire.phase.name(),
            fire.timeout_ms,
            if fire.headers_sent {
                "cutting the stream"
            } else {
                "answering 504"
            }
        );
        // Where the decode leg waits: the chosen pod, or the stand-in Envoy retried it on when
        // that pod refused the connection (then only the stream's upstream says so). The abort
        // must reach the engine holding the request; the refusing pod has none.
        let mut decode_address = None;
        if hostcalls::set_effective_context(id).is_ok() {
            decode_address = hostcalls::get_property(vec!["upstream", "address"])
                .ok()
                .flatten()
                .filter(|a| !a.is_empty())
                .and_then(|a| String::from_utf8(a).ok());
            let result = if fire.headers_sent {
                hostcalls::reset_http_response()
            } else {
                let error = RouteError::DecodeTimeout(watchdog::message(pod, &fire));
                // A local reply like any refusal (a cut stream is not one).
                vm.borrow().metrics.rejected(&error);
                let header = error.header();
                let headers = crate::core::errors::reply_headers(&header, request_id);
                hostcalls::send_http_response(504, headers, Some(&error.body()))
                    .or_else(|_| hostcalls::reset_http_response())
            };
            if let Err(e) = result {
                log::warn!("request {request_id}: cannot end the stream: {e:?}");
            }
        }
        let _ = hostcalls::set_effective_context(root_id);
        // One attempt, as AIBrix makes on a watchdog fire: the pod is already unresponsive.
        vm.borrow_mut().engines.queue_abort(AbortOrder {
            address: decode_address.as_deref().unwrap_or(&w.decode_address),
            rid: w.rid.as_deref(),
            timeout_s: w.settings.abort_timeout_s,
            retry_s: 0.0,
            cause: AbortCause::Watchdog(fire.phase),
            streaming: false,
            authorization: w.authorization.as_deref(),
        });
    }
}
