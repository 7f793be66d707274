//! One HTTP stream: buffer the body, decide with the core, run the prefill leg, hand the
//! request to the decode (or combined) pod, and release every charge exactly once.

use std::borrow::Cow;
use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

mod external;
mod pair;
mod redecode;
mod stand_in;

use crate::core::call_timeout::call_timeout;
use crate::core::charges::HeldCharges;
use crate::core::engine::{self, trtllm, vllm, Engine};
use crate::core::errors::RouteError;
use crate::core::fleet::{FleetView, ModelView};
use crate::core::held_body::HeldBody;
// Envoy's ORIGINAL_DST header is removed even when the cluster reads another one, so a
// client can never pick an upstream through either.
use crate::core::inbound::{Inbound, DESTINATIONS_HEADER, ENVOY_DST_HEADER};
use crate::core::ledger::{self, Ledger};
use crate::core::obs::outcome::{self, CutBy, Outcome};
use crate::core::obs::timing::Instants;
use crate::core::obs::{usage, Explain};
use crate::core::pd::{
    self, candidates, session_affinity, PairInput, PdSettings, Step0Input, Target,
};
use crate::core::prefix::EventRef;
use crate::core::profile::{Blend, Strategy, StrategySpec};
use crate::core::request::{self, Endpoint, RoutingRequest};
use crate::core::route::{self, Decision};
use crate::core::tokenize;
use crate::core::tokens;
use crate::core::upstream_error::{self, Rewrite, RESPONSE_UNKNOWN_HEADER};
use crate::core::user_limits::{self, Ask, Charge, ModelRps, UsageScan, Verdict};
use crate::host::holds::{self, Hold};
use crate::host::metrics::Metrics;
use crate::host::store::SharedData;
use crate::host::{now_ms, now_ns, now_us, Clock, SharedVm, VmState};

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
/// Model label of requests whose model the fleet does not know: client-chosen names never
/// become labels, so a client cannot grow Envoy's stats without bound.
const UNKNOWN_MODEL: &str = "unknown";

/// How one pod is picked for a request that is not a PD pair (`Strategy(Pd)` only names the
/// strategy of a pair for the response header).
#[derive(Clone, Copy)]
enum OnePod<'a> {
    /// Any role, the least busy: a request that computes nothing (a token count).
    Any,
    Strategy(Strategy),
    Blend(&'a Blend),
    /// The pod in this slot, chosen already (by the `external` strategy's service).
    Fixed(usize),
}

impl OnePod<'_> {
    /// Whether the pick scores the prefix index (`prefix-cache` or `prefix-cache-preble`,
    /// alone or in a blend).
    fn uses_prefix_index(&self) -> bool {
        match self {
            OnePod::Any | OnePod::Fixed(_) => false,
            OnePod::Strategy(s) => s.reads_prefix_index(),
            OnePod::Blend(b) => b.items.iter().any(|(s, _)| s.reads_prefix_index()),
        }
    }

    /// Whether the pick places the user by its tokens (`vtc-basic`, alone or in a blend).
    fn uses_vtc(&self) -> bool {
        match self {
            OnePod::Any | OnePod::Fixed(_) => false,
            OnePod::Strategy(s) => *s == Strategy::VtcBasic,
            OnePod::Blend(b) => b.items.iter().any(|(s, _)| *s == Strategy::VtcBasic),
        }
    }

    fn name(&self) -> &str {
        match self {
            OnePod::Any => Strategy::LeastRequest.name(),
            OnePod::Fixed(_) => Strategy::External.name(),
            OnePod::Strategy(s) => s.name(),
            OnePod::Blend(b) => &b.label,
        }
    }
}

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

impl Failover {
    /// `model` without the pods that failed this request's prefill: `Ok(None)` when none of
    /// them is in it, `Err` with the last failure when leaving them out leaves no route.
    fn without_failed(&mut self, model: &ModelView) -> Result<Option<ModelView>, RouteError> {
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

    /// The user a request's limits are checked for, when pd-control checks limits.
    fn limited_user(&self, fleet: &FleetView) -> Result<Option<String>, RouteError> {
        if fleet.user_limits {
            user_limits::user_of(self.user.clone())
        } else {
            Ok(None)
        }
    }

    /// What pd-control must admit before the request is routed: its user's limits, its
    /// model's rate (`requestsPerSecond`), both, or nothing (`None`, also once admitted).
    fn admission_ask(&self, user: Option<String>, model: &str, rps: Option<f64>) -> Option<Ask> {
        if self.limits_checked {
            return None;
        }
        let rps = rps.filter(|r| ModelRps::of(*r).is_some());
        (user.is_some() || rps.is_some()).then(|| Ask {
            user,
            model: model.to_string(),
            rps,
        })
    }

    /// Sends the admission; `Ok(true)` while its answer is awaited (the request waits with
    /// it), `Ok(false)` when it could not be sent and the plugin fails open.
    fn start_admission(&mut self, ask: Ask, raw: &mut Vec<u8>) -> Result<bool, RouteError> {
        // The body waits with the request: refused before pd-control is asked (and counts the
        // request against its limits) when the VM holds its budget of bodies already.
        let held = self.hold_body(std::mem::take(raw), 0)?;
        let model = ask
            .rps
            .and_then(ModelRps::of)
            .map(|rps| (ask.model.as_str(), rps));
        let body = user_limits::admission_body(ask.user.as_deref(), model);
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
    fn on_admission(&mut self, admission: Admission, body_size: usize) {
        let (status, body) = self.call_answer(body_size);
        let Admission { ask, raw, .. } = admission;
        // Routed now: out of the budget (a wait for a prefill leg holds it anew).
        let raw = raw.into_body();
        let admitted = match user_limits::judge(&ask, &status, &body) {
            Verdict::Admitted { rpm, charged } => {
                self.charge = charged.map(|rps| Charge {
                    model: ask.model,
                    rps,
                    // An age, taken by this VM: its monotonic clock (a wall-clock step back
                    // read as age 0 and could give the request back to a newer window).
                    answered_ms: crate::host::steady_ms(),
                });
                self.admitted(ask.user, rpm);
                Ok(())
            }
            Verdict::Refused(error) => Err(error),
            Verdict::Unchecked(error) => self.unchecked(ask.user, error, false),
            Verdict::Unreachable(error) => self.unchecked(ask.user, error, true),
        };
        let routed = admitted.and_then(|()| self.route(raw));
        self.resume_routed(routed);
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

    fn reject(&mut self, error: RouteError) -> Action {
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
            use crate::core::errors::loggable;
            let what = loggable(&error.to_string());
            match error.detail() {
                Some(detail) => log::info!(
                    "request {} refused: {what}: {}",
                    self.request_id,
                    loggable(detail)
                ),
                None => log::info!("request {} refused: {what}", self.request_id),
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

    /// Whether the answer now in is a pod's error to rewrite (`core::upstream_error`). Not
    /// the filter's own local replies (refusals, the watchdog's 504), which are already in the
    /// contract's shape, and not an answer whose headers ended it (see
    /// [`PdHttp::answer_bodiless_error`]).
    fn error_rewrite_for(&self, end_of_stream: bool) -> Option<Rewrite> {
        let rewrite = Rewrite::for_status(self.obs.response_status?)?;
        let own = self.local_reply || self.vm.borrow().watchdog_fired.contains(&self.id);
        (!end_of_stream && !own).then_some(rewrite)
    }

    /// A pod's error answer that has no body (its headers ended the stream): there is no body
    /// to put the contract's JSON error in, so the answer is replaced by a local reply with
    /// that body, the pod's status and its headers (Envoy sends it straight to the client:
    /// no response header has gone out yet).
    fn answer_bodiless_error(&mut self, rewrite: Rewrite) -> Action {
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
    fn answer_error(&mut self, rewrite: Rewrite, body_size: usize) {
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

    /// The value of a forwarded request header (`core::inbound::FORWARDED`).
    fn forwarded_value(&self, name: &str) -> Option<&str> {
        self.forwarded
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The `external-filter` header's label selector, when the request carries a non-empty
    /// one (one that does not parse is a selection failure, 503, as in AIBrix).
    fn external_filter(&self) -> Option<String> {
        self.forwarded_value("external-filter")
            .map(|text| text.trim().to_string())
            .filter(|text| !text.is_empty())
    }

    /// Counts a PD selection that failed before any pod was scored (an unknown
    /// `decodeScorePolicy`, pods of mixed engines) as AIBrix does, with the failures of the
    /// selection itself.
    fn selection_failed(&self, error: RouteError) -> RouteError {
        if matches!(error, RouteError::Selection { .. }) {
            self.vm.borrow_mut().metrics.prefill_failed(&error);
        }
        error
    }

    /// Runs one release stage of this request's charges (see `holds::release`).
    fn release_stage(
        &mut self,
        stage: fn(&HeldCharges, &mut Ledger, u64) -> HeldCharges,
        clock: &mut Clock,
    ) {
        holds::release(&self.vm, self.id, clock.ms(), stage);
    }

    /// Records what the request now holds, with its force-release deadline.
    fn hold(&self, vm: &mut VmState, charges: HeldCharges, ttl_s: u64) {
        let hold = Hold::new(
            charges,
            crate::host::steady_ms(),
            ttl_s.saturating_mul(1000),
            self.request_id.clone(),
            vm.journal_seq.get(),
        );
        vm.holds.insert(self.id, hold);
        crate::host::journal::write(vm);
    }

    /// Publishes the prefix-event batch this request's event joined, unless another request
    /// already did. Called when the response starts (and at the end, for requests whose
    /// response never started), so a client that has this request's answer finds its prefix
    /// known to every worker's next selection.
    fn send_prefix_batch(&mut self, clock: &mut Clock) {
        if let Some(batch) = self.prefix_batch.take() {
            let mut vm = self.vm.borrow_mut();
            if vm.prefix_batches_sent == batch {
                crate::section!(
                    "prefix_batch.send",
                    crate::host::prefix_sharing::publish(&mut vm, clock.ms())
                );
            }
        }
    }

    fn release_all(&mut self, clock: &mut Clock) {
        self.release_stage(HeldCharges::release_rest, clock);
    }

    /// Keeps `body`, and `index` bytes of its member index, in this VM's account of held
    /// bodies while the request waits on a callout; refused (503) when that would take the
    /// account past `max_held_body_bytes` (see `core::held_body`). The bytes go back when
    /// the returned body is dropped or unwrapped, however the request ends.
    fn hold_body(&self, body: Vec<u8>, index: usize) -> Result<HeldBody, RouteError> {
        let vm = self.vm.borrow();
        vm.held_bodies
            .hold(body, index, vm.plugin.max_held_body_bytes)
            .map_err(|e| self.over_budget(e))
    }

    /// Whether `bytes` more would fit in this VM's account of held bodies (see
    /// [`PdHttp::hold_body`]), for a refusal before work it would waste.
    fn body_fits(&self, bytes: usize) -> Result<(), RouteError> {
        let vm = self.vm.borrow();
        vm.held_bodies
            .fits(bytes, vm.plugin.max_held_body_bytes)
            .map_err(|e| self.over_budget(e))
    }

    fn over_budget(&self, e: crate::core::held_body::OverBudget) -> RouteError {
        log::debug!("request {}: {e}", self.request_id);
        RouteError::HeldBodiesOverBudget { limit: e.limit }
    }

    /// Reads the whole buffered request body and routes on it, or answers why not.
    fn route_body(&mut self) -> Action {
        let raw = crate::section!(
            "request_body.read",
            self.get_http_request_body(0, self.request_body_bytes)
                .unwrap_or_default()
        );
        match self.route(raw) {
            Ok(action) => action,
            Err(e) => self.reject(e),
        }
    }

    /// Routes the request whose whole body is `raw`, kept by a PD request for its decode leg.
    fn route(&mut self, mut raw: Vec<u8>) -> Result<Action, RouteError> {
        let endpoint = self.endpoint.ok_or(RouteError::UnknownPath)?;
        let fleet: Rc<FleetView> = self
            .vm
            .borrow()
            .fleet
            .clone()
            .ok_or(RouteError::NoSnapshot)?;
        self.routed_on = Some(fleet.clone());
        let mut req = crate::section!("request_body.parse", RoutingRequest::parse(endpoint, &raw))?;
        if let Some(clean) = crate::core::engine::without_gateway_members(&req.members, &raw) {
            // Rare (no client sends them): the body Envoy holds and the one kept for the legs
            // lose them, and the request is read again from the clean one.
            log::info!(
                "request {}: dropped the client's KV-transfer members (the gateway's to set)",
                self.request_id
            );
            self.replace_body(&clean)?;
            raw = clean;
            req = RoutingRequest::parse(endpoint, &raw)?;
        }
        self.obs.times.stream = req.stream;
        let user = self.limited_user(&fleet)?;
        // A limited user's stream must end with its usage, or its tokens could not be counted.
        if user.is_some()
            && req.stream
            && endpoint == Endpoint::ChatCompletions
            && !req.include_usage
        {
            return Err(RouteError::StreamUsageRequired);
        }
        // vLLM's Messages stream always ends with its usage (`message_delta`). Responses
        // streams are not scanned: they only go to one pod, and TPOT is a PD measure.
        self.obs.scan_usage =
            req.stream && (req.include_usage || req.endpoint == Endpoint::Messages);
        let model = fleet
            .models
            .get(&req.model)
            .ok_or_else(|| RouteError::UnknownModel(req.model.clone()))?;
        self.obs.model = Some(req.model.clone());
        if model.pods.is_empty() {
            return Err(RouteError::NoRoutablePods(req.model.clone()));
        }
        let narrowed;
        let model = match self.external_filter() {
            Some(text) => {
                self.narrowed = true;
                narrowed = self
                    .vm
                    .borrow_mut()
                    .narrowed
                    .narrow(model, &text)
                    .map_err(|e| RouteError::Selection {
                        detail: format!("external-filter {text:?}: {e}"),
                    })?;
                if narrowed.pods.is_empty() {
                    return Err(RouteError::Selection {
                        detail: format!(
                            "external-filter matched none of the {} routable pods of model {}",
                            model.pods.len(),
                            req.model
                        ),
                    });
                }
                &narrowed
            }
            None => model,
        };
        let kept;
        let model = match self.failover.without_failed(model) {
            Ok(Some(view)) => {
                kept = view;
                &kept
            }
            Ok(None) => model,
            Err(failure) => return Err(failure),
        };
        let now = now_ms();
        let length = tokenize::PromptLength::new(&req.prompt_text);
        let decision = {
            let vm = self.vm.borrow();
            crate::section!(
                "request_body.decide",
                route::decide(
                    model,
                    &req,
                    self.strategy_header.as_deref(),
                    self.profile_header.as_deref(),
                    &vm.defaults.env,
                    &|boundaries| length.for_boundaries(boundaries) as i64,
                )
            )?
        };
        self.prompt_counted = length.taken();
        // A token count computes nothing on the engine: any one pod serves it, whatever the
        // strategy, and a PD-only fleet has no pod but prefill and decode ones. It generates
        // nothing either, so it takes no request of a user's or model's limits, and the
        // `input_tokens` of its answer are no usage (clients that count before every message
        // were charged their prompts twice).
        let count_only = endpoint == Endpoint::MessagesCountTokens;
        // Without limits on pd-control (no Redis) a model's rate is not enforced either: no
        // call for it (it would only wait, and fail the request while pd-control restarts).
        let rps = decision.requests_per_second.filter(|_| fleet.user_limits);
        let ask = self.admission_ask(user, &req.model, rps);
        if let Some(ask) = ask.filter(|_| !count_only) {
            if self.start_admission(ask, &mut raw)? {
                // pd-control's answer routes the request again (`on_admission`).
                return Ok(Action::Pause);
            }
        }
        self.auto_profile = decision.auto_profile.clone();
        let mut engine = Engine::Vllm;
        let external = if decision.strategy == Strategy::External && !count_only {
            match self.external_pick(&fleet, model, &req, &mut raw)? {
                // pd-control's answer routes the request again (`on_external`).
                None => return Ok(Action::Pause),
                pick => pick,
            }
        } else {
            None
        };
        let pick = match (&external, &decision.blend) {
            _ if count_only => OnePod::Any,
            (Some(external::ExternalPick::Pod(slot)), _) => OnePod::Fixed(*slot),
            (Some(external::ExternalPick::Fallback(StrategySpec::Blend(b))), _) => OnePod::Blend(b),
            (Some(external::ExternalPick::Fallback(StrategySpec::One(s))), _) => {
                OnePod::Strategy(*s)
            }
            (None, Some(blend)) => OnePod::Blend(blend),
            (None, None) => OnePod::Strategy(decision.strategy),
        };
        let mut via = None;
        let target = if count_only {
            self.select_one(model, &req, pick, now)?.0
        } else if decision.strategy == Strategy::Pd {
            let resolved =
                PdSettings::resolve(&self.vm.borrow().defaults, decision.routing_config.as_ref());
            let settings = resolved.map_err(|e| self.selection_failed(e))?;
            self.prefill_timeout_s = settings.prefill_timeout_s;
            // The engine check and SGLang's body validation come before any selection, so
            // a refused request changes no load counter.
            engine = engine::agreed_engine(model).map_err(|e| self.selection_failed(e))?;
            if !engine.serves_pd(endpoint) {
                return Err(RouteError::PathNotForEngine {
                    path: endpoint.path(),
                    engine: engine.name(),
                });
            }
            if let Some(name) = self.unforwardable {
                return Err(RouteError::InvalidRequest(format!(
                    "the {name} header is not UTF-8 text, and a PD request must forward it to the prefill pod"
                )));
            }
            if engine == Engine::Sglang {
                engine::sglang::validate(&raw, &req.members)?;
            }
            if self.decode_waits(engine) {
                // Refused before the selection charges any pod: the body would be held until
                // the prefill answers (`start_pair` holds it in this same callback).
                self.body_fits(raw.len().saturating_add(req.members.heap_bytes()))?;
            }
            self.legs.watch_settings = self.vm.borrow().engines.defaults.watchdog.with_knobs(
                &decision
                    .routing_config
                    .as_ref()
                    .map(|rc| rc.knobs)
                    .unwrap_or_default(),
            );
            self.select_pair(model, &req, &decision, &settings, now)?
        } else {
            let (target, found) = self.select_one(model, &req, pick, now)?;
            via = found;
            target
        };
        // An external request answers as `external`, whichever way it was decided.
        let strategy = if external.is_some() {
            Strategy::External.name().to_string()
        } else {
            pick.name().to_string()
        };
        self.obs.times.routed_us = Some(now_us());
        if self.obs.explain.is_some() && self.obs.explain_header.is_none() {
            // Non-PD strategies have no cascade to explain: name the strategy and the pick.
            let mut via = via
                .map(|v| format!("via={}; ", v.name()))
                .unwrap_or_default();
            if let Some(place) = self.obs.vtc_place {
                via.push_str(&format!("place={place:.2}; "));
            }
            if let Some(outcome) = self.obs.external {
                via.push_str(&format!("external={}; ", outcome.label()));
            }
            let mut line = format!(
                "strategy={strategy}; {via}pick={}",
                model.pods[target.pod()].name
            );
            crate::core::obs::explain::left_out(&mut line, model);
            self.obs.explain_header = Some(line);
        }
        crate::section!(
            "request_body.filter_state",
            self.log_state(model, target, &strategy, decision.logged_profile(model))
        );
        // The stand-in must fit Step 0's bucket as the chosen pod did (PD decisions only).
        let step0 = Step0Input {
            profile: decision.profile.as_deref(),
            bucketing: decision.bucketing && decision.strategy == Strategy::Pd,
            prompt_len: decision.prompt_len,
        };
        match target {
            Target::Single { pod } => {
                let stand_in = self.stand_in_for(model, target, step0);
                let pod = &model.pods[pod];
                self.set_destination(&pod.address, &strategy)?;
                self.name_destinations(&pod.key, &pod.address, stand_in, true);
                self.served.target = Some(pod.key.clone());
                self.routed = Some(Routed {
                    strategy,
                    pod_name: pod.name.clone(),
                    pod_address: pod.address.clone(),
                    prefill: None,
                    session_id: via.map(|_| session_affinity::session_id(&pod.address)),
                });
                let metrics = &self.vm.borrow().metrics;
                if self.failover.excluded.is_empty() {
                    // A failed-over request was counted when it was first routed.
                    Metrics::inc(metrics.routed_single);
                }
                if let Some(via) = via {
                    Metrics::inc(metrics.session_affinity[via as usize]);
                }
                Ok(Action::Continue)
            }
            Target::Pair { prefill, decode } => {
                let stand_in = self.stand_in_for(model, target, step0);
                let (prefill, decode) = (&model.pods[prefill], &model.pods[decode]);
                crate::section!("request_body.selected_metrics", {
                    let mut vm = self.vm.borrow_mut();
                    vm.metrics.selected(prefill, &req.model);
                    vm.metrics.selected(decode, &req.model);
                });
                self.served = Served {
                    target: Some(decode.key.clone()),
                    prefill: Some(prefill.key.clone()),
                };
                self.routed = Some(Routed {
                    strategy,
                    pod_name: decode.name.clone(),
                    pod_address: decode.address.clone(),
                    prefill: Some((prefill.name.clone(), prefill.ip.clone())),
                    session_id: None,
                });
                if self.failover.excluded.is_empty() {
                    Metrics::inc(self.vm.borrow().metrics.routed_pair);
                }
                let action = crate::section!(
                    "request_body.start_pair",
                    self.start_pair(engine, req, raw, prefill, decode, stand_in)
                )?;
                Metrics::gauge_add(self.vm.borrow().metrics.prefill_outstanding, 1);
                self.obs.prefill_outstanding = true;
                Ok(action)
            }
        }
    }

    /// PD selection and its charges in one CAS round over the shared ledger.
    fn select_pair(
        &mut self,
        model: &ModelView,
        req: &RoutingRequest,
        decision: &Decision,
        settings: &PdSettings,
        now: u64,
    ) -> Result<Target, RouteError> {
        let vm = self.vm.clone();
        let mut vm = vm.borrow_mut();
        let vm = &mut *vm;
        let prompt_tokens = tokens::prompt_tokens_estimate(req.body_len);
        let session_delta = match (
            &self.session_key,
            settings.prefill_policy.uses_token_ledger(),
        ) {
            (Some(key), true) => vm.sessions.new_tokens(
                &req.model,
                key,
                prompt_tokens,
                now,
                settings.tokens.session_ttl_s,
            ),
            _ => None,
        };
        let profile = decision.profile.as_deref();
        let banded = if decision.bucketing && settings.bucket_serve {
            // The traffic's picture needs every prompt's count (Step 0's length is a lower
            // bound unless an edge was near it, and bounds of prose and of CJK text differ
            // fourfold): counted here unless Step 0 counted it already.
            let len = self
                .prompt_counted
                .unwrap_or_else(|| tokenize::PromptLength::new(&req.prompt_text).counted());
            let len = i64::try_from(len).unwrap_or(i64::MAX);
            vm.planner.record(&req.model, len, now);
            let groups = candidates::bucket_groups(model, profile);
            vm.planner
                .plan_for(&req.model, &groups, settings.bucket_serve_mode, now)
                .and_then(|plan| plan.lookup(len))
                .map(str::to_string)
        } else {
            None
        };
        let step0 = Step0Input {
            profile,
            bucketing: decision.bucketing,
            prompt_len: decision.prompt_len,
        };
        let (stream, match_pct, token_bytes) = if settings.prefill_policy.uses_prefix_index() {
            Self::prefix_match(vm, model, req, now, |key| model.prefill_slot(key))
        } else {
            (Cow::Borrowed(&[][..]), Vec::new(), req.prompt_bytes)
        };
        let pair = PairInput {
            settings,
            match_pct: &match_pct,
            token_bytes,
            banded_roleset: banded.as_deref(),
            prompt_tokens,
            session_delta,
            now_ms: now,
        };
        let remote = vm.remote.clone();
        let rng = &mut vm.rng;
        let scratch = &mut vm.select_scratch;
        let started = now_ns();
        let mut core_ns = 0u128;
        let mut explain = self.obs.explain.take();
        crate::section_scope!("request_body.select_charge_hold");
        let result = crate::section!(
            "select.cas",
            ledger::update(&SharedData, |l| {
                l.set_remote(remote.clone());
                if let Some(x) = explain.as_deref_mut() {
                    // A CAS retry selects again: explain the attempt that lands.
                    *x = Explain::default();
                }
                let t0 = now_ns();
                let selected = match explain.as_deref_mut() {
                    Some(x) => pd::select_pd_explained(model, step0, l, pair, rng, Some(x))?,
                    None => pd::select_pd_with(model, step0, l, pair, rng, scratch)?,
                };
                core_ns = now_ns().saturating_sub(t0);
                let held = selected.charge(model, l, now);
                let rows = holds::charged_rows(l, &held);
                Ok::<_, RouteError>((selected, held, rows))
            })
        );
        if let Some(x) = &explain {
            self.obs.explain_header = Some(x.header(model));
        }
        self.obs.explain = explain;
        if let Err(e @ RouteError::Selection { .. }) = &result {
            vm.metrics.prefill_failed(e);
        }
        let (selected, held, rows) = result?;
        let elapsed_us = (now_ns().saturating_sub(started) / 1_000) as u64;
        self.obs.selection_us = Some(elapsed_us);
        if let Some(id) = vm.metrics.selection_us {
            let _ = hostcalls::record_metric(id, elapsed_us);
        }
        if let Some(id) = vm.metrics.selection_core_us {
            let _ = hostcalls::record_metric(id, (core_ns / 1_000) as u64);
        }
        crate::section!(
            "select.gauges",
            vm.metrics
                .charged_gauges(rows.iter().map(|(k, r)| (k.as_str(), *r)))
        );
        crate::section!("select.hold", self.hold(vm, held, settings.tokens.ttl_s));
        if let Target::Pair { prefill, .. } = selected.target {
            let pod = &model.pods[prefill].key;
            self.record_prefix(vm, &req.model, pod, &stream, now);
        }
        Ok(selected.target)
    }

    /// Warms the prefix index with the pod chosen for `stream`, here and on every other
    /// worker. Published with the events gathered until this request's response starts (see
    /// `send_prefix_batch`): one shared-data write for many selections. A VM alone in the
    /// process has nobody to tell.
    fn record_prefix(&mut self, vm: &mut VmState, model: &str, pod: &str, stream: &[u8], now: u64) {
        if stream.is_empty() {
            return;
        }
        let event = EventRef {
            model,
            pod,
            stream,
            at_ms: now,
        };
        crate::section!(
            "select.prefix_event",
            vm.prefix
                .add_prefix(event.stream, event.model, event.pod, now)
        );
        if !vm.peers.is_empty() {
            vm.prefix_outbox.push(event);
            self.prefix_batch = Some(vm.prefix_batches_sent);
            if vm.prefix_outbox.bytes() >= crate::core::prefix::log::MAX_BATCH_BYTES {
                crate::section!(
                    "select.publish",
                    crate::host::prefix_sharing::publish(vm, now)
                );
            }
        }
    }

    /// Looks the prompt up in this worker's prefix index, after reading what the others
    /// published: the prompt's whole blocks, by slot how much of them each pod `slot_of`
    /// names holds, and the token stream's length in bytes. Only the pods holding the
    /// prompt's prefix are touched, not every candidate.
    fn prefix_match<'r>(
        vm: &mut VmState,
        model: &ModelView,
        req: &'r RoutingRequest,
        now: u64,
        slot_of: impl Fn(&str) -> Option<usize>,
    ) -> (Cow<'r, [u8]>, Vec<f64>, usize) {
        crate::section!(
            "select.prefix_catch_up",
            crate::host::prefix_sharing::catch_up(vm, now, true)
        );
        crate::section_scope!("select.prefix_lookup");
        let p = vm.prefix_settings;
        let tokens = tokenize::token_stream(p.tokenizer, &req.prompt_text);
        let token_bytes = tokens.len();
        let stream = tokenize::whole_blocks(tokens, vm.prefix.block_size());
        let mut pct = vec![0.0; model.pods.len()];
        vm.prefix
            .match_candidates(&stream, &req.model, slot_of, |slot, m| {
                if let Some(p) = pct.get_mut(slot) {
                    *p = f64::from(m);
                }
            });
        (stream, pct, token_bytes)
    }

    /// Picks one pod (see [`OnePod`]) and charges its running count in the same CAS round.
    /// The second value says how session-affinity found the pod (`None` without it).
    fn select_one(
        &mut self,
        model: &ModelView,
        req: &RoutingRequest,
        pick: OnePod<'_>,
        now: u64,
    ) -> Result<(Target, Option<session_affinity::Via>), RouteError> {
        let vm = self.vm.clone();
        let mut vm = vm.borrow_mut();
        let vm = &mut *vm;
        // Single-pod prefix-cache scores the standard pods by the same index.
        let (stream, match_pct, _) = if pick.uses_prefix_index() {
            Self::prefix_match(vm, model, req, now, |key| model.standard_slot(key))
        } else {
            (Cow::Borrowed(&[][..]), Vec::new(), 0)
        };
        let remote = vm.remote.clone();
        let top_k = pd::top_k::TopK::new(&vm.defaults.env.single, now);
        // vtc-basic reads the user's window before the CAS round (which may run twice) and
        // charges it after.
        let vtc_settings = &vm.defaults.env.single.vtc;
        let vtc_ask = pick.uses_vtc().then_some(pd::vtc::VtcAsk {
            user: self.user.as_deref(),
            prompt_bytes: req.prompt_text.len(),
            now_ms: now,
        });
        let vtc_place = vtc_ask.and_then(|a| a.place(model, &mut vm.vtc, vtc_settings));
        if vtc_place.is_some() {
            let bucket = pd::vtc::bucket_size(vm.vtc.bounds(vtc_settings), vtc_settings);
            vm.metrics.vtc_bucket_size(&req.model, bucket);
        }
        if self.obs.explain.is_some() {
            self.obs.vtc_place = vtc_place;
        }
        let rng = &mut vm.rng;
        let hint = session_affinity::SessionHint {
            session_id: self
                .forwarded
                .iter()
                .find(|(k, _)| *k == session_affinity::SESSION_ID_HEADER)
                .map(|(_, v)| v.as_str()),
            session_key: self.session_key.as_deref(),
        };
        let result = ledger::update(&SharedData, |l| {
            l.set_remote(remote.clone());
            let (target, via) = match pick {
                OnePod::Any => (pd::single::select_any(model, l, rng)?, None),
                OnePod::Fixed(pod) => (Target::Single { pod }, None),
                OnePod::Strategy(Strategy::SessionAffinity) => {
                    let (target, via) = session_affinity::select(model, hint, rng)?;
                    (target, Some(via))
                }
                OnePod::Strategy(Strategy::VtcBasic) => {
                    let running = pd::single::running_by_slot(model, l, true);
                    let target =
                        pd::vtc::select_vtc(model, vtc_place, &running, vtc_settings, rng)?;
                    (target, None)
                }
                OnePod::Strategy(strategy) => (
                    pd::select_single(model, strategy, l, &match_pct, &top_k, rng)?,
                    None,
                ),
                OnePod::Blend(blend) => {
                    let vtc = vtc_place.map(|p| (p, vtc_settings));
                    pd::blend::select_blend(model, blend, hint, l, &match_pct, vtc, &top_k, rng)?
                }
            };
            let held = pd::Selected::single(target.pod()).charge(model, l, now);
            let rows = holds::charged_rows(l, &held);
            Ok::<_, RouteError>(((target, via), held, rows))
        });
        if let (Some(_), Err(e)) = (&self.obs.explain, &result) {
            let detail = match e {
                RouteError::Selection { detail } => detail.clone(),
                other => other.to_string(),
            };
            self.obs.explain_header = Some(crate::core::errors::sanitize_header_len(
                &format!("strategy={}; error={detail}", pick.name()),
                crate::core::obs::explain::MAX_LEN,
            ));
        }
        let (target, held, rows) = result?;
        if let Some(ask) = vtc_ask {
            ask.charge(&mut vm.vtc, &vm.defaults.env.single.vtc);
        }
        vm.metrics
            .charged_gauges(rows.iter().map(|(k, r)| (k.as_str(), *r)));
        let ttl_s = vm.defaults.tokens.ttl_s;
        self.hold(vm, held, ttl_s);
        let pod = &model.pods[target.0.pod()].key;
        self.record_prefix(vm, &req.model, pod, &stream, now);
        Ok(target)
    }

    fn dispatch_prefill(
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

    /// Refuses any upstream address that is not a pod of the snapshot the request was routed
    /// on (see `core::guard`); logged with the address, which the client's reply leaves out.
    fn guard_target(&self, address: &str) -> Result<(), RouteError> {
        let checked = match &self.routed_on {
            Some(fleet) => crate::core::guard::check_target(Some(fleet), address),
            None => crate::core::guard::check_target(self.vm.borrow().fleet.as_deref(), address),
        };
        if checked.is_err() {
            log::warn!(
                "context {}: refusing to send request {} to {address:?}: not a pod of the current fleet",
                self.id, self.request_id
            );
        }
        checked
    }

    /// Points the ORIGINAL_DST cluster at the pod and stamps the upstream request.
    fn set_destination(&self, address: &str, strategy: &str) -> Result<(), RouteError> {
        self.guard_target(address)?;
        let dst_header = self.vm.borrow().plugin.dst_header.clone();
        self.set_http_request_header(&dst_header, Some(address));
        self.set_http_request_header("x-request-id", Some(&self.request_id));
        if !strategy.is_empty() {
            self.set_http_request_header("routing-strategy", Some(strategy));
        }
        Ok(())
    }

    /// The request is answered by pod `key` (`name`, `address`) rather than the one it was
    /// routed to (a decode leg moved, a stand-in retried on): passive ejection's outcome, the
    /// response headers, the watchdog and the access log's filter state follow it. Charges
    /// are the caller's to move.
    fn answered_by(&mut self, key: &str, name: &str, address: &str) {
        self.served.target = Some(key.to_string());
        if let Some(routed) = self.routed.as_mut() {
            routed.pod_name = name.to_string();
            routed.pod_address = address.to_string();
        }
        if let Some(w) = self.vm.borrow_mut().watched.get_mut(&self.id) {
            w.decode_pod = name.to_string();
            w.decode_address = address.to_string();
        }
        let states: &[&str] = if self.served.prefill.is_some() {
            &[STATE_DECODE_POD, STATE_TARGET_POD]
        } else {
            &[STATE_TARGET_POD]
        };
        for state in states {
            if let Err(e) = hostcalls::set_property(vec![state], Some(name.as_bytes())) {
                log::debug!(
                    "context {}: cannot set filter state {state}: {e:?}",
                    self.id
                );
            }
        }
    }

    /// Records how the prefill pod answered its leg, for passive ejection.
    fn prefill_served(&self, status: &str, clock: &mut Clock) {
        if let (Some(pod), Some(ok)) = (&self.served.prefill, outcome::prefill_served(status)) {
            self.vm.borrow_mut().pod_outcome(pod, ok, clock.ms());
        }
    }

    /// Whether the request is waiting on its prefill leg with its decode leg not sent yet
    /// (vLLM's and TRT-LLM `context_first`'s order, or a `/server_info` lookup): nothing but
    /// the prefill can hold it then. SGLang's legs go at once, and its prefill cannot finish
    /// until the decode pod joins the bootstrap room: a hung decode pod holds the prefill leg
    /// out too, so a wait there is no evidence against the prefill pod.
    fn waits_on_prefill(&self) -> bool {
        (self.obs.prefill_outstanding && self.pending.is_some()) || self.legs.looks_up_server()
    }

    /// Whether Envoy ended the stream on one of its own stream timeouts (its
    /// `response.code_details`), not on anything the pods did: only then is a request
    /// waiting on its prefill leg the prefill's failure (an SGLang decode pod that answers
    /// 503 or resets while its prefill runs is the decode's).
    fn ended_by_envoy_timeout(&self) -> bool {
        const ENVOY_TIMEOUTS: [&str; 3] = [
            "stream_idle_timeout",
            "max_duration_timeout",
            "request_overall_timeout",
        ];
        self.get_property(vec!["response", "code_details"])
            .is_some_and(|d| ENVOY_TIMEOUTS.iter().any(|t| d == t.as_bytes()))
    }

    /// What a request that Envoy ended while its prefill leg was out counts as.
    fn ended_before_prefill(code: u32) -> RouteError {
        RouteError::Prefill {
            status: code,
            // As a prefill leg Envoy timed out is counted (`timeout`/504).
            class: "http_error",
            detail: "the stream ended (Envoy's stream_idle_timeout or max_stream_duration) before the prefill leg answered".into(),
        }
    }

    /// Lowers `gateway_prefill_outstanding_requests` once the leg is over (answered, or the
    /// stream ended first).
    fn prefill_returned(&mut self) {
        if std::mem::take(&mut self.obs.prefill_outstanding) {
            Metrics::gauge_add(self.vm.borrow().metrics.prefill_outstanding, -1);
        }
    }

    /// Exposes the routing decision as filter state (`wasm.pd_*`) for access-log formats.
    fn log_state(&self, model: &ModelView, target: Target, strategy: &str, profile: Option<&str>) {
        let set = |key: &str, value: &str| {
            if let Err(e) = hostcalls::set_property(vec![key], Some(value.as_bytes())) {
                log::debug!("context {}: cannot set filter state {key}: {e:?}", self.id);
            }
        };
        if let Target::Pair { prefill, decode } = target {
            set(STATE_PREFILL_POD, &model.pods[prefill].name);
            set(STATE_DECODE_POD, &model.pods[decode].name);
        }
        set(STATE_TARGET_POD, &model.pods[target.pod()].name);
        set(STATE_STRATEGY, strategy);
        if let Some(profile) = profile {
            set(STATE_PROFILE, profile);
        }
        if let Some(us) = self.obs.selection_us {
            set(STATE_SELECTION_US, &us.to_string());
        }
        if let Some(explain) = &self.obs.explain_header {
            set(STATE_EXPLAIN, explain);
        }
    }

    /// Counts the request's outcome and, when a pod answered, its durations. Runs once, at
    /// the end of the stream, whatever happened.
    fn observe_end(&mut self, clock: &mut Clock) {
        // Envoy's answer seen at its headers (its body then passes the filter), or ended
        // without one.
        let timed_out_on_prefill = self.obs.timed_out_on_prefill
            || (self.waits_on_prefill() && self.ended_by_envoy_timeout());
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

    /// Routes the request again when its prefill leg never reached the pod (refused, reset
    /// before any answer) or the pod answered one of `prefill_failover_statuses`, leaving
    /// that pod out, while `prefill_failover` allows: the client has been sent nothing, so
    /// another pair can serve it whole. Returns whether the request was taken over (routed
    /// again, or answered with the failure because no other pod can take it); false leaves
    /// the failure to the caller.
    fn fail_over(&mut self, status: &str, body: &[u8], clock: &mut Clock) -> bool {
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

    /// Makes the decode leg from the prefill's answer; `Ok(Some(answer))` when the context
    /// leg finished the request itself (TRT-LLM) and `answer` is the client's.
    fn finish_prefill(
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
    fn answer_from_context(&mut self, answer: trtllm::FinalAnswer) {
        log::debug!(
            "request {}: the context leg finished the answer; no generation leg",
            self.request_id
        );
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

impl Context for PdHttp {
    fn on_http_call_response(
        &mut self,
        token: u32,
        headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        crate::section_scope!("prefill_answer");
        let _answer = crate::host::answering_call(headers);
        if let Some(admission) = self.admission.take_if(|a| a.token == token) {
            return self.on_admission(admission, body_size);
        }
        if let Some(call) = self.external_call.take_if(|c| c.token == token) {
            return self.on_external(call, body_size);
        }
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
        crate::section!("headers.wake", {
            let mut vm = self.vm.borrow_mut();
            vm.wake_for_request();
            Metrics::inc(vm.metrics.requests);
        });
        self.obs.times.request_us = now_us();
        let (dst_header, explain_enabled, trap) = {
            let vm = self.vm.borrow();
            (
                vm.plugin.dst_header.clone(),
                vm.plugin.explain,
                vm.debug_trap_header.clone(),
            )
        };
        let pairs = crate::section!("headers.read", self.get_http_request_headers_bytes());
        let h = Inbound::read(
            pairs.iter().map(|(n, v)| (n.as_str(), v.as_slice())),
            &dst_header,
            EXPLAIN_HEADER,
            trap.as_deref(),
        );
        drop(pairs);
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
        let mut clock = Clock::default();
        self.send_prefix_batch(&mut clock);
        self.check_stand_in(clock.ms());
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
