//! One HTTP stream: buffer the body, decide with the core, run the prefill leg, hand the
//! request to the decode (or combined) pod, and release every charge exactly once.

use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

mod admission;
mod charges;
mod destination;
mod error_rewrite;
mod external;
mod failover;
mod held_body;
mod narrow;
mod outcome;
mod pair;
mod prefill;
mod prefix;
mod redecode;
mod refusal;
mod route;
mod select;
mod stand_in;

use crate::core::charges::HeldCharges;
use crate::core::errors::RouteError;
use crate::core::fleet::FleetView;
use crate::core::held_body::HeldBody;
// Envoy's ORIGINAL_DST header is removed even when the cluster reads another one, so a
// client can never pick an upstream through either.
use crate::core::inbound::{DESTINATIONS_HEADER, ENVOY_DST_HEADER};
use crate::core::obs::outcome::Outcome;
use crate::core::obs::timing::Instants;
use crate::core::obs::{usage, Explain};
use crate::core::pd::session_affinity;
use crate::core::readiness;
use crate::core::request::{self, Endpoint};
use crate::core::tokens;
use crate::core::upstream_error::Rewrite;
use crate::core::user_limits::{Ask, Charge, UsageScan};
use crate::host::metrics::Metrics;
use crate::host::{header_map, now_us, Clock, SharedVm};

/// Request header asking for a routing explanation (honoured when the plugin enables it).
const EXPLAIN_HEADER: &str = "x-pd-explain";
/// Filter-state keys (Envoy prefixes `wasm.`), printable with `%FILTER_STATE(wasm.<key>:PLAIN)%`.
const STATE_PREFILL_POD: &str = "pd_prefill_pod";
const STATE_DECODE_POD: &str = "pd_decode_pod";
const STATE_TARGET_POD: &str = "pd_target_pod";
const STATE_STRATEGY: &str = "pd_strategy";
const STATE_PROFILE: &str = "pd_profile";
const STATE_SELECTION_US: &str = "pd_selection_us";
const STATE_EXPLAIN: &str = "pd_explain";
/// The prefill pods a failed-over request left behind (`namespace/name`, comma-separated).
const STATE_FAILED_PREFILL: &str = "pd_failed_prefill";

/// Where the routed request went, for the response headers.
struct Routed {
    strategy: String,
    pod_name: String,
    pod_address: String,
    prefill: Option<(String, String)>,
    /// `x-session-id` for the answer: session-affinity hands the pod's address back.
    session_id: Option<String>,
}

/// The pods a request was routed to, by key, for passive ejection (`core::ejection`): kept
/// apart from [`Routed`], which a failed prefill clears before the outcome is known.
#[derive(Default)]
struct Served {
    target: Option<String>,
    prefill: Option<String>,
}

/// A prefill leg in flight and what the decode request needs once it answers.
struct PendingDecode {
    token: u32,
    /// The client's raw body and its members, which the decode leg is spliced from: held in
    /// the VM's budget, with the members' index, until the prefill answers or the request ends.
    body: HeldBody,
    members: crate::core::json_object::Spans,
    prefill_ip: String,
    decode: redecode::ChosenDecode,
    merge: pair::Merge,
}

/// What the request contributes to metrics, the access log and its explanation.
#[derive(Default)]
struct Observed {
    times: Instants,
    /// The request's model, once the fleet knows it.
    model: Option<String>,
    /// Set by a local reply; otherwise the outcome comes from the response status.
    outcome: Option<Outcome>,
    response_status: Option<u32>,
    /// Streams that asked for a usage chunk: their chunks are scanned for completion tokens.
    scan_usage: bool,
    /// Where the last scanned chunk ended: a usage event cut in two is still read.
    usage_seam: usage::Seam,
    /// `gateway_prefill_outstanding_requests` was raised for this request's prefill leg.
    prefill_outstanding: bool,
    /// Envoy answered on one of its stream timeouts while the request waited on its prefill
    /// leg (seen at the answer's headers: its body then passes the filter like a decode's).
    timed_out_on_prefill: bool,
    /// Selection plus charge, microseconds (PD pairs).
    selection_us: Option<u64>,
    /// Filled by the selection only when the client asked and the plugin allows it.
    explain: Option<Box<Explain>>,
    explain_header: Option<String>,
    /// vtc-basic's place for the user on the pod line, for the explanation.
    vtc_place: Option<f64>,
    /// How an `external` request was decided, for the explanation.
    external: Option<crate::core::external::Outcome>,
}

pub struct PdHttp {
    id: u32,
    vm: SharedVm,
    request_id: String,
    endpoint: Option<Endpoint>,
    forwarded: Vec<(&'static str, String)>,
    /// A forwarded header that is not UTF-8 (see `Inbound::unforwardable`).
    unforwardable: Option<&'static str>,
    /// The prefix-event batch this request's event joined, until it is sent.
    prefix_batch: Option<u64>,
    strategy_header: Option<String>,
    /// The client sent `routing-strategy` more than once.
    strategy_repeated: bool,
    profile_header: Option<String>,
    /// The profile `config-profile: auto` picked, echoed as `x-aibrix-config-profile`.
    auto_profile: Option<String>,
    session_key: Option<String>,
    /// The prompt's cl100k count, when routing took it (see `tokenize::PromptLength`).
    prompt_counted: Option<usize>,
    /// Testing only: trap when the prefill leg answers (see `VmState::debug_trap_header`).
    trap_at_prefill_answer: bool,
    /// The snapshot this request was routed on. Its later legs (the decode destination set
    /// once the prefill answered) are checked against it, not against a newer snapshot: a pod
    /// that leaves the fleet while a prefill is in flight still gets the decode leg the KV
    /// cache is being prepared for, as it would have without the check.
    routed_on: Option<Rc<FleetView>>,
    /// Prefill leg timeout of the request's profile.
    prefill_timeout_s: f64,
    pending: Option<PendingDecode>,
    routed: Option<Routed>,
    served: Served,
    /// Engine legs beyond the synchronous prefill (see `pair`).
    legs: pair::Legs,
    obs: Observed,
    /// The filter answered this request itself: its own error bodies are never rewritten.
    local_reply: bool,
    /// A readiness probe (`PluginConfig::ready_path`), answered at its headers: nothing else
    /// of the request path runs for it, and it is counted nowhere.
    probe: bool,
    /// The body was refused as too large: the answer is this filter's 413 or, when Envoy's
    /// buffer limit fired in the same moment, Envoy's; only the latter is rewritten.
    body_refused: bool,
    /// The request body buffered so far: routed on when trailers, not a body chunk, end the
    /// request.
    request_body_bytes: usize,
    /// An `external-filter` selector narrowed the pods this request may go to: a decode pod
    /// that leaves is not replaced by one the selector did not choose.
    narrowed: bool,
    /// The pod answered an error whose body is being buffered to be rewritten.
    error_rewrite: Option<Rewrite>,
    /// Prefill failover (`PluginConfig::prefill_failover`): the pods whose prefill leg never
    /// reached them, left out of this request's next selection, and the failure the client
    /// gets if no other pod can take it.
    failover: Failover,
    /// The `user` header (AIBrix's per-user limits).
    user: Option<String>,
    /// The request waits for pd-control's admission.
    admission: Option<Admission>,
    /// An `external` request waiting for pd-control's decision.
    external_call: Option<external::ExternalCall>,
    /// pd-control's decision for this `external` request, consumed by the next `route`.
    external_answer: Option<external::Pending>,
    /// pd-control admitted the request (or could not be asked, and the plugin fails open):
    /// routing it again does not ask again.
    limits_checked: bool,
    /// The user an admitted request counts against.
    limited: Option<Limited>,
    /// The model rate this request was counted against, given back if the filter refuses it
    /// after all (`RefundBook`).
    charge: Option<Charge>,
    /// The stand-in pod named for Envoy's retry of a refused connection, until the response
    /// says which pod served.
    named: Option<stand_in::Named>,
}

/// A request waiting for pd-control to admit it under its user's and its model's limits.
struct Admission {
    token: u32,
    ask: Ask,
    /// The whole request body, routed again once admitted (held in the VM's budget).
    raw: HeldBody,
}

/// An admitted request of a limited user: its answer's tokens go to the user's TPM.
struct Limited {
    user: String,
    /// The user's requests in the current window, as pd-control counted them.
    rpm: Option<i64>,
    scan: UsageScan,
}

/// A PD request routed again after its prefill pod could not be reached.
#[derive(Default)]
struct Failover {
    /// Keys of the pods that failed this request's prefill leg.
    excluded: Vec<String>,
    /// The last prefill failure, answered when the re-route finds no other pod.
    failure: Option<RouteError>,
}

impl PdHttp {
    pub fn new(id: u32, vm: SharedVm) -> PdHttp {
        PdHttp {
            id,
            vm,
            request_id: String::new(),
            endpoint: None,
            forwarded: Vec::new(),
            unforwardable: None,
            prefix_batch: None,
            strategy_header: None,
            strategy_repeated: false,
            profile_header: None,
            auto_profile: None,
            session_key: None,
            prompt_counted: None,
            trap_at_prefill_answer: false,
            routed_on: None,
            prefill_timeout_s: 30.0,
            pending: None,
            routed: None,
            served: Served::default(),
            legs: pair::Legs::default(),
            obs: Observed::default(),
            local_reply: false,
            probe: false,
            body_refused: false,
            request_body_bytes: 0,
            narrowed: false,
            error_rewrite: None,
            failover: Failover::default(),
            user: None,
            admission: None,
            external_call: None,
            external_answer: None,
            limits_checked: false,
            limited: None,
            charge: None,
            named: None,
        }
    }

    /// The status and body of the side call whose answer is being handled.
    fn call_answer(&self, body_size: usize) -> (String, Vec<u8>) {
        let status = crate::host::call_header(":status").unwrap_or_default();
        if status.is_empty() {
            // Envoy failed the call: there is no answer to read (see `host::answering_call`).
            return (status, Vec::new());
        }
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        (status, body)
    }

    /// Lets a request that waited for a side call go on as `routed` says: upstream, on to a
    /// prefill leg (whose answer resumes it), or refused.
    fn resume_routed(&mut self, routed: Result<Action, RouteError>) {
        match routed {
            Ok(Action::Continue) => self.resume_http_request(),
            // Waiting again (a prefill leg, the external router's decision): that answer
            // resumes the request.
            Ok(_) => {}
            Err(e) => {
                self.reject(e);
            }
        }
    }

    /// The value of a forwarded request header (`core::inbound::FORWARDED`).
    fn forwarded_value(&self, name: &str) -> Option<&str> {
        self.forwarded
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

impl Context for PdHttp {
    fn on_http_call_response(
        &mut self,
        token: u32,
        headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let _answer = crate::host::answering_call(headers);
        if let Some(admission) = self.admission.take_if(|a| a.token == token) {
            crate::section_scope!("admission_answer");
            return self.on_admission(admission, body_size);
        }
        if let Some(call) = self.external_call.take_if(|c| c.token == token) {
            crate::section_scope!("external_answer");
            return self.on_external(call, body_size);
        }
        crate::section_scope!("prefill_answer");
        if self.pending.as_ref().map(|p| p.token) != Some(token) {
            self.on_leg_response(token, body_size);
            return;
        }
        // Testing only: trap while this request's charges are held, so tests see a VM die
        // with load on the ledger (PD_ROUTER_DEBUG_TRAP_HEADER).
        assert!(
            !self.trap_at_prefill_answer,
            "trap requested by PD_ROUTER_DEBUG_TRAP_HEADER"
        );
        let mut clock = Clock::default();
        crate::section!(
            "prefill_answer.release",
            self.release_stage(HeldCharges::release_prefill_leg, &mut clock)
        );
        crate::section!("prefill_answer.returned", self.prefill_returned());
        let status = crate::section!(
            "prefill_answer.status",
            crate::host::call_header(":status").unwrap_or_default()
        );
        if status.is_empty() {
            // No answer to read: Envoy failed the call after the pod began answering.
            self.prefill_served("502", &mut clock);
            self.routed = None;
            self.reject(RouteError::leg_call_failed("prefill"));
            return;
        }
        // A failure's body only explains it (its first bytes are logged and returned).
        let read = if status == "200" {
            body_size
        } else {
            body_size.min(crate::core::errors::ERROR_BODY_READ_BYTES)
        };
        let body = crate::section!(
            "prefill_answer.body",
            self.get_http_call_response_body(0, read)
                .unwrap_or_default()
        );
        crate::section!(
            "prefill_answer.served",
            self.prefill_served(&status, &mut clock)
        );
        if status != "200" && self.fail_over(&status, &body, &mut clock) {
            return;
        }
        let success = self.vm.borrow().metrics.prefill_success;
        match self.finish_prefill(&status, &body) {
            Ok(Some(answer)) => {
                Metrics::inc(success);
                self.obs.times.prefill_end_us = Some(clock.us());
                self.answer_from_context(answer);
            }
            Ok(None) => {
                Metrics::inc(success);
                crate::section!("prefill_answer.arm_watchdog", self.arm_watchdog());
                self.obs.times.prefill_end_us = Some(clock.us());
                self.resume_http_request();
            }
            Err(e) => {
                self.routed = None;
                self.reject(e);
            }
        }
    }
}

impl HttpContext for PdHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        crate::section_scope!("request_headers");
        self.obs.times.request_us = now_us();
        let (dst_header, explain_enabled, trap) = {
            let vm = self.vm.borrow();
            (
                vm.plugin.dst_header.clone(),
                vm.plugin.explain,
                vm.debug_trap_header.clone(),
            )
        };
        let h = crate::section!(
            "headers.read",
            header_map::read_request(&dst_header, EXPLAIN_HEADER, trap.as_deref())
        );
        let probe = {
            let vm = self.vm.borrow();
            readiness::is_probe(h.path.as_deref().unwrap_or_default(), &vm.plugin.ready_path)
                .then(|| vm.fleet.as_ref().map(|f| f.version))
        };
        if let Some(version) = probe {
            return self.answer_readiness(version);
        }
        crate::section!("headers.wake", {
            let mut vm = self.vm.borrow_mut();
            vm.wake_for_request();
            Metrics::inc(vm.metrics.requests);
        });
        if h.dst_present {
            self.set_http_request_header(ENVOY_DST_HEADER, None);
            self.set_http_request_header(&dst_header, None);
            // Left on a request the filter names no stand-in for, it would send the request
            // down the retrying route to the pods the client listed.
            self.set_http_request_header(DESTINATIONS_HEADER, None);
        }
        for control in h.envoy_controls() {
            self.set_http_request_header(control, None);
        }
        self.trap_at_prefill_answer = h.trap;
        if explain_enabled {
            if h.explain {
                self.obs.explain = Some(Box::default());
            }
            if h.explain_present {
                self.set_http_request_header(EXPLAIN_HEADER, None);
            }
        }
        let random = self.vm.borrow_mut().rng.u128(..);
        self.request_id = crate::section!(
            "headers.request_id",
            request::request_id(h.traceparent.as_deref(), random)
        );
        self.forwarded = h.forwarded;
        self.unforwardable = h.unforwardable;
        self.user = h.user;
        self.strategy_header = h.strategy;
        self.strategy_repeated = h.strategy_repeated;
        self.profile_header = h.profile;
        self.session_key = h
            .session_key
            .filter(|k| !k.is_empty() && k.len() <= tokens::MAX_SESSION_KEY_BYTES);

        let refused = self
            .vm
            .borrow()
            .defaults
            .env
            .api_key
            .as_ref()
            .is_some_and(|key| !key.admits(self.forwarded_value("authorization")));
        if refused {
            return self.reject(RouteError::Unauthorized);
        }
        let path = h.path.unwrap_or_default();
        match Endpoint::from_path(&path) {
            Ok(endpoint) => self.endpoint = Some(endpoint),
            Err(e) => return self.reject(e),
        }
        if end_of_stream {
            return self.reject(RouteError::BadBody);
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        crate::section_scope!("request_body");
        let limit = self.vm.borrow().plugin.max_request_body_bytes;
        if body_size > limit {
            // Refused before a byte of it is copied into the VM, and before the rest arrives.
            // Over HTTP/1.1 Envoy's own buffer limit may answer first, with its plain-text
            // 413: that one is rewritten like any error answer (see `on_http_response_headers`).
            self.body_refused = true;
            return self.reject(RouteError::BodyTooLarge { limit });
        }
        self.request_body_bytes = body_size;
        if !end_of_stream {
            return Action::Pause;
        }
        self.route_body()
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // Trailers end this request (HTTP/2 trailers, or chunked HTTP/1.1's): no body chunk
        // came with end_of_stream, and the body buffered so far is the whole body. Without
        // this the request went on unrouted. The trailers themselves are passed on.
        self.route_body()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        crate::section_scope!("response_headers");
        if self.probe {
            return Action::Continue;
        }
        let mut clock = Clock::default();
        self.send_prefix_batch(&mut clock);
        self.check_stand_in(&mut clock);
        self.obs.response_status = crate::section!(
            "response_headers.status",
            self.get_http_response_header_bytes(":status")
                .and_then(|s| std::str::from_utf8(&s).ok()?.parse().ok())
        );
        if end_of_stream {
            self.obs.times.end_us = Some(clock.us());
        }
        if let Some(explain) = &self.obs.explain_header {
            self.set_http_response_header(EXPLAIN_HEADER, Some(explain));
        }
        self.set_http_response_header("request-id", Some(&self.request_id));
        // AIBrix's mark of an answer that went through the gateway's request processing.
        self.set_http_response_header("x-went-into-req-headers", Some("true"));
        if let Some(profile) = &self.auto_profile {
            self.set_http_response_header("x-aibrix-config-profile", Some(profile));
        }
        if let Some(rpm) = self.limited.as_ref().and_then(|l| l.rpm) {
            self.set_http_response_header("x-update-rpm", Some(&rpm.to_string()));
        }
        if let Some(r) = &self.routed {
            if !r.strategy.is_empty() {
                self.set_http_response_header("routing-strategy", Some(&r.strategy));
            }
            self.set_http_response_header("target-pod", Some(&r.pod_name));
            self.set_http_response_header("target-pod-ip", Some(&r.pod_address));
            if let Some(id) = &r.session_id {
                self.set_http_response_header(session_affinity::SESSION_ID_HEADER, Some(id));
            }
            if let Some((name, ip)) = &r.prefill {
                self.set_http_response_header("prefill-target-pod", Some(name));
                self.set_http_response_header("prefill-target-pod-ip", Some(ip));
            }
        }
        if self.body_refused
            && self
                .get_http_response_header_bytes("x-error-request-body-processing")
                .is_none()
        {
            // Envoy's plain 413, not this filter's: an error answer like any other.
            self.local_reply = false;
        }
        if self.obs.response_status == Some(413) && self.routed.is_none() && !self.local_reply {
            // Envoy's own 413 (its HTTP/1.1 buffer limit took the body before the filter's
            // bound did): the same refusal as the filter's, with its header and its count.
            self.set_http_response_header("x-error-request-body-processing", Some("true"));
            if !self.body_refused {
                let limit = self.vm.borrow().plugin.max_request_body_bytes;
                let error = RouteError::BodyTooLarge { limit };
                self.vm.borrow().metrics.rejected(&error);
                self.obs.outcome.get_or_insert(Outcome::rejected(&error));
            }
        }
        if self.waits_on_prefill()
            && !self.local_reply
            && self.obs.response_status.is_some_and(|s| s >= 400)
            && self.ended_by_envoy_timeout()
        {
            // Envoy's own answer while the prefill leg is out and before the decode pod said
            // anything (its stream timeout fired first): a prefill failure.
            self.obs.timed_out_on_prefill = true;
            let code = self.obs.response_status.unwrap_or(504);
            if let Some((name, value)) = Self::ended_before_prefill(code).header() {
                self.set_http_response_header(name, Some(&value));
            }
        }
        if end_of_stream {
            if let Some(rewrite) = self.error_rewrite_for(false) {
                return self.answer_bodiless_error(rewrite);
            }
        }
        self.error_rewrite = self.error_rewrite_for(end_of_stream);
        if self.error_rewrite.is_some() {
            // Held until the body is in: its length and type change with it. The client has
            // no headers yet, so a watchdog firing meanwhile still answers 504.
            return Action::Pause;
        }
        crate::section!("response_headers.watch", self.watch_headers());
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        crate::section_scope!("response_body");
        if self.probe {
            return Action::Continue;
        }
        let mut clock = Clock::default();
        self.watch_chunk(body_size, end_of_stream);
        let t = &mut self.obs.times;
        if body_size > 0 && t.first_token_us.is_none() {
            t.first_token_us = Some(clock.us());
        }
        if let Some(rewrite) = self.error_rewrite {
            if !end_of_stream {
                return Action::Pause;
            }
            self.obs.times.end_us = Some(clock.us());
            self.watch_headers();
            self.answer_error(rewrite, body_size);
            return Action::Continue;
        }
        if (self.obs.scan_usage || self.limited.is_some()) && body_size > 0 {
            let chunk = self
                .get_http_response_body(0, body_size)
                .unwrap_or_default();
            if let Some(limited) = &mut self.limited {
                limited.scan.feed(&chunk);
            }
            let key = self
                .endpoint
                .unwrap_or(Endpoint::ChatCompletions)
                .usage_output_key();
            if self.obs.scan_usage {
                if let Some(n) = self.obs.usage_seam.read(&chunk, key) {
                    self.obs.times.completion_tokens = Some(n);
                }
                self.obs.usage_seam.keep(&chunk);
            }
        }
        if end_of_stream {
            self.obs.times.end_us = Some(clock.us());
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        // Trailers end the stream: without this a response with trailers would count as cut.
        self.obs.times.end_us = Some(now_us());
        Action::Continue
    }

    fn on_log(&mut self) {
        crate::section_scope!("log");
        if self.probe {
            return;
        }
        #[cfg(feature = "sections")]
        crate::host::sections::request_done();
        let fired = {
            let mut vm = self.vm.borrow_mut();
            vm.watched.remove(&self.id);
            vm.watchdog_fired.remove(&self.id)
        };
        if fired {
            self.obs.outcome = Some(Outcome::DecodeWatchdog);
        }
        let mut clock = Clock::default();
        self.send_prefix_batch(&mut clock);
        crate::section!("log.release", self.release_all(&mut clock));
        crate::section!("log.count", self.observe_end(&mut clock));
        if let Some(limited) = &self.limited {
            if let Some(tokens) = limited.scan.tokens() {
                let mut vm = self.vm.borrow_mut();
                vm.user_usage.add(&limited.user, tokens);
                // Reported on the next tick: this VM must not be on its idle period then.
                vm.wake();
            }
        }
        // A body still held for a callout (the client left, or the stream was reset, while
        // it waited) goes back to the VM's budget now rather than when the SDK deletes the
        // context; dropping it returns its bytes, once.
        self.pending = None;
        self.admission = None;
        self.external_call = None;
        self.legs.drop_held_body();
    }
}
