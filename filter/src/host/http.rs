//! One HTTP stream: buffer the body, decide with the core, run the prefill leg, hand the
//! request to the decode (or combined) pod, and release every charge exactly once.

use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType};
use serde_json::{Map, Value};

use crate::core::charges::HeldCharges;
use crate::core::config::KvConnector;
use crate::core::engine::vllm;
use crate::core::errors::RouteError;
use crate::core::fleet::{FleetView, ModelView};
use crate::core::ledger::{self, Ledger};
use crate::core::pd::{self, candidates, PairInput, PdSettings, Step0Input, Target};
use crate::core::prefix::{self, PrefixEvent};
use crate::core::profile::Strategy;
use crate::core::request::{self, Endpoint, RoutingRequest};
use crate::core::route::{self, Decision};
use crate::core::tokenize;
use crate::core::tokens;
use crate::host::holds::{self, pod_tokens, Hold};
use crate::host::metrics::Metrics;
use crate::host::snapshot;
use crate::host::store::SharedData;
use crate::host::{now_ms, now_ns, SharedVm, VmState};

/// Request headers forwarded on the prefill leg, as AIBrix does.
const FORWARDED: [&str; 6] = [
    "authorization",
    "external-filter",
    "routing-strategy",
    "x-session-id",
    "x-aibrix-session-key",
    "traceparent",
];
/// ORIGINAL_DST's default header; removed even when the cluster reads another one, so a
/// client can never pick an upstream through either.
const ENVOY_DST_HEADER: &str = "x-envoy-original-dst-host";

/// Where the routed request went, for the response headers.
struct Routed {
    strategy: String,
    pod_name: String,
    pod_address: String,
    prefill: Option<(String, String)>,
}

/// A prefill leg in flight and what the decode request needs once it answers.
struct PendingDecode {
    token: u32,
    body: Map<String, Value>,
    prefill_ip: String,
    decode_address: String,
    connector: KvConnector,
}

pub struct PdHttp {
    id: u32,
    vm: SharedVm,
    request_id: String,
    endpoint: Option<Endpoint>,
    forwarded: Vec<(&'static str, String)>,
    strategy_header: Option<String>,
    profile_header: Option<String>,
    /// The profile `config-profile: auto` picked, echoed as `x-aibrix-config-profile`.
    auto_profile: Option<String>,
    session_key: Option<String>,
    /// Prefill leg timeout of the request's profile.
    prefill_timeout_s: f64,
    pending: Option<PendingDecode>,
    routed: Option<Routed>,
}

impl PdHttp {
    pub fn new(id: u32, vm: SharedVm) -> PdHttp {
        PdHttp {
            id,
            vm,
            request_id: String::new(),
            endpoint: None,
            forwarded: Vec::new(),
            strategy_header: None,
            profile_header: None,
            auto_profile: None,
            session_key: None,
            prefill_timeout_s: 30.0,
            pending: None,
            routed: None,
        }
    }

    fn reject(&mut self, error: RouteError) -> Action {
        self.release_all();
        self.vm.borrow().metrics.rejected(&error);
        if !matches!(
            error,
            RouteError::UnknownPath | RouteError::BadBody | RouteError::NoMessages
        ) {
            log::info!("request {} refused: {error}", self.request_id);
        }
        let (name, value) = error.header();
        let headers = vec![
            (name, value.as_str()),
            ("content-type", "application/json"),
            ("request-id", self.request_id.as_str()),
        ];
        let body = error.body();
        if let Err(e) = hostcalls::send_http_response(error.status(), headers, Some(&body)) {
            log::error!("context {}: cannot send local reply: {e:?}", self.id);
        }
        Action::Pause
    }

    /// Runs one release stage of this request's charges (see `holds::release`).
    fn release_stage(&mut self, stage: fn(&HeldCharges, &mut Ledger, u64) -> HeldCharges) {
        holds::release(&self.vm, self.id, now_ms(), stage);
    }

    /// Records what the request now holds, with its force-release deadline.
    fn hold(&self, vm: &mut VmState, charges: HeldCharges, now: u64, ttl_s: u64) {
        let hold = Hold {
            charges,
            since_ms: now,
            ttl_ms: ttl_s.saturating_mul(1000),
            request_id: self.request_id.clone(),
        };
        vm.holds.insert(self.id, hold);
    }

    fn release_all(&mut self) {
        self.release_stage(HeldCharges::release_rest);
    }

    fn route(&mut self, raw: &[u8]) -> Result<Action, RouteError> {
        let endpoint = self.endpoint.ok_or(RouteError::UnknownPath)?;
        let fleet: Rc<FleetView> = self
            .vm
            .borrow()
            .fleet
            .clone()
            .ok_or(RouteError::NoSnapshot)?;
        let req = RoutingRequest::parse(endpoint, raw)?;
        let model = fleet
            .models
            .get(&req.model)
            .ok_or_else(|| RouteError::UnknownModel(req.model.clone()))?;
        if model.pods.is_empty() {
            return Err(RouteError::NoRoutablePods(req.model.clone()));
        }
        let now = now_ms();
        let decision = {
            let mut vm = self.vm.borrow_mut();
            let vm = &mut *vm;
            let rng = &mut vm.rng;
            let text = &req.prompt_text;
            route::decide(
                model,
                &req,
                self.strategy_header.as_deref(),
                self.profile_header.as_deref(),
                &vm.defaults.env,
                &|boundaries| tokenize::prompt_tokens_if_needed(text, boundaries) as i64,
                &mut |n| rng.u64(0..n.max(1)),
            )?
        };
        self.auto_profile = decision.auto_profile.clone();
        let target = if decision.strategy == Strategy::Pd {
            let settings =
                PdSettings::resolve(&self.vm.borrow().defaults, decision.routing_config.as_ref())?;
            self.prefill_timeout_s = settings.prefill_timeout_s;
            self.select_pair(model, &req, &decision, &settings, now)?
        } else {
            self.select_one(model, decision.strategy, now)?
        };
        let strategy = decision.strategy.name().to_string();
        match target {
            Target::Single { pod } => {
                let pod = &model.pods[pod];
                self.set_destination(&pod.address, &strategy);
                self.routed = Some(Routed {
                    strategy,
                    pod_name: pod.name.clone(),
                    pod_address: pod.address.clone(),
                    prefill: None,
                });
                Metrics::inc(self.vm.borrow().metrics.routed_single);
                Ok(Action::Continue)
            }
            Target::Pair { prefill, decode } => {
                let (prefill, decode) = (&model.pods[prefill], &model.pods[decode]);
                let connector = prefill
                    .kv_connector
                    .unwrap_or(self.vm.borrow().defaults.env.kv_connector);
                let body = vllm::prefill_body(&req.body, connector);
                let token = self.dispatch_prefill(endpoint, &prefill.address, &body)?;
                self.pending = Some(PendingDecode {
                    token,
                    body: req.body,
                    prefill_ip: prefill.ip.clone(),
                    decode_address: decode.address.clone(),
                    connector,
                });
                self.routed = Some(Routed {
                    strategy,
                    pod_name: decode.name.clone(),
                    pod_address: decode.address.clone(),
                    prefill: Some((prefill.name.clone(), prefill.ip.clone())),
                });
                Metrics::inc(self.vm.borrow().metrics.routed_pair);
                Ok(Action::Pause)
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
            (Some(key), true) => vm.sessions.new_tokens(&req.model, key, prompt_tokens, now),
            _ => None,
        };
        let profile = decision.profile.as_deref();
        let banded = if decision.bucketing && settings.bucket_serve {
            vm.planner.record(&req.model, decision.prompt_len, now);
            let groups = candidates::bucket_groups(model, profile);
            vm.planner
                .plan_for(&req.model, &groups, settings.bucket_serve_mode, now)
                .and_then(|plan| plan.lookup(decision.prompt_len))
                .map(str::to_string)
        } else {
            None
        };
        let step0 = Step0Input {
            profile,
            bucketing: decision.bucketing,
            prompt_len: decision.prompt_len,
        };
        // Prefix lookup (local to this worker; other workers' insertions arrive as events).
        let (hashes, match_pct, token_bytes) = if settings.prefill_policy.uses_prefix_index() {
            let p = vm.prefix_settings;
            let stream = tokenize::token_stream(p.tokenizer, &req.prompt_text);
            let hashes = prefix::block_hashes(&stream, p.block_size, vm.prefix_seed);
            let prefill_pods: Vec<usize> = model
                .rolesets
                .iter()
                .flat_map(|r| r.prefill.iter().copied())
                .collect();
            let keys: Vec<&str> = prefill_pods
                .iter()
                .map(|&i| model.pods[i].key.as_str())
                .collect();
            let found = vm.prefix.match_prefix(&hashes, &req.model, &keys);
            let mut pct = vec![0.0; model.pods.len()];
            for (&i, &m) in prefill_pods.iter().zip(&found) {
                pct[i] = f64::from(m);
            }
            (hashes, pct, stream.len())
        } else {
            (Vec::new(), Vec::new(), req.prompt_bytes)
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
        let rng = &mut vm.rng;
        let scratch = &mut vm.select_scratch;
        let started = now_ns();
        let mut core_ns = 0u128;
        let (selected, held, tokens) = ledger::update(&SharedData, |l| {
            let t0 = now_ns();
            let selected = pd::select_pd_with(model, step0, l, pair, rng, scratch)?;
            core_ns = now_ns().saturating_sub(t0);
            let held = selected.charge(model, l, now);
            let tokens = pod_tokens(l, &held);
            Ok::<_, RouteError>((selected, held, tokens))
        })?;
        let elapsed_us = (now_ns().saturating_sub(started) / 1_000) as u64;
        if let Some(id) = vm.metrics.selection_us {
            let _ = hostcalls::record_metric(id, elapsed_us);
        }
        if let Some(id) = vm.metrics.selection_core_us {
            let _ = hostcalls::record_metric(id, (core_ns / 1_000) as u64);
        }
        vm.metrics.token_gauges(&tokens);
        self.hold(vm, held, now, settings.tokens.ttl_s);
        if let (Target::Pair { prefill, .. }, false) = (selected.target, hashes.is_empty()) {
            // Warm the index with the chosen prefill pod, here and on every other worker.
            let event = PrefixEvent {
                model: req.model.clone(),
                pod: model.pods[prefill].key.clone(),
                hashes,
                at_ms: now,
            };
            vm.prefix
                .add_prefix(&event.hashes, &event.model, &event.pod, now);
            snapshot::broadcast(&vm.peers, snapshot::MSG_PREFIX, &event.encode());
        }
        Ok(selected.target)
    }

    /// Single-pod strategies: select and charge the running count in one CAS round.
    fn select_one(
        &mut self,
        model: &ModelView,
        strategy: Strategy,
        now: u64,
    ) -> Result<Target, RouteError> {
        let vm = self.vm.clone();
        let mut vm = vm.borrow_mut();
        let rng = &mut vm.rng;
        let (target, held) = ledger::update(&SharedData, |l| {
            let target = pd::select_single(model, strategy, l, rng)?;
            let held = pd::Selected::single(target.pod()).charge(model, l, now);
            Ok::<_, RouteError>((target, held))
        })?;
        let ttl_s = vm.defaults.tokens.ttl_s;
        self.hold(&mut vm, held, now, ttl_s);
        Ok(target)
    }

    fn dispatch_prefill(
        &self,
        endpoint: Endpoint,
        address: &str,
        body: &[u8],
    ) -> Result<u32, RouteError> {
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
        hostcalls::dispatch_http_call(
            &cluster,
            headers,
            Some(body),
            vec![],
            Duration::from_secs_f64(timeout_s),
        )
        .map_err(|e| RouteError::Prefill {
            status: 503,
            class: "dispatch",
            detail: format!("cannot send the prefill request to {address}: {e:?}"),
        })
    }

    /// Points the ORIGINAL_DST cluster at the pod and stamps the upstream request.
    fn set_destination(&self, address: &str, strategy: &str) {
        let dst_header = self.vm.borrow().plugin.dst_header.clone();
        self.set_http_request_header(&dst_header, Some(address));
        self.set_http_request_header("x-request-id", Some(&self.request_id));
        if !strategy.is_empty() {
            self.set_http_request_header("routing-strategy", Some(strategy));
        }
    }

    fn finish_prefill(&mut self, status: &str, response: &[u8]) -> Result<(), RouteError> {
        let Some(pending) = self.pending.take() else {
            return Err(RouteError::Internal(
                "prefill answer without a pending decode".into(),
            ));
        };
        if status != "200" {
            let code = status
                .parse::<u32>()
                .ok()
                .filter(|c| (400..=599).contains(c))
                .unwrap_or(502);
            let detail: String = String::from_utf8_lossy(response)
                .chars()
                .take(256)
                .collect();
            return Err(RouteError::Prefill {
                status: code,
                class: "http_error",
                detail,
            });
        }
        if let Some(body) = vllm::decode_body(
            &pending.body,
            response,
            &pending.prefill_ip,
            pending.connector,
        )? {
            hostcalls::set_buffer(BufferType::HttpRequestBody, 0, usize::MAX >> 1, &body).map_err(
                |e| RouteError::Internal(format!("cannot replace the request body: {e:?}")),
            )?;
            self.set_http_request_header("content-length", Some(&body.len().to_string()));
        }
        let strategy = self
            .routed
            .as_ref()
            .map(|r| r.strategy.clone())
            .unwrap_or_default();
        self.set_destination(&pending.decode_address, &strategy);
        Ok(())
    }
}

impl Context for PdHttp {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        if self.pending.as_ref().map(|p| p.token) != Some(token) {
            return;
        }
        self.release_stage(HeldCharges::release_prefill_leg);
        let status = self
            .get_http_call_response_header(":status")
            .unwrap_or_default();
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        let (success, fail) = {
            let vm = self.vm.borrow();
            (vm.metrics.prefill_success, vm.metrics.prefill_fail)
        };
        match self.finish_prefill(&status, &body) {
            Ok(()) => {
                Metrics::inc(success);
                self.resume_http_request();
            }
            Err(e) => {
                if matches!(e, RouteError::Prefill { .. }) {
                    Metrics::inc(fail);
                }
                self.routed = None;
                self.reject(e);
            }
        }
    }
}

impl HttpContext for PdHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let dst_header = self.vm.borrow().plugin.dst_header.clone();
        self.set_http_request_header(ENVOY_DST_HEADER, None);
        self.set_http_request_header(&dst_header, None);
        Metrics::inc(self.vm.borrow().metrics.requests);

        let traceparent = self.get_http_request_header("traceparent");
        let random = self.vm.borrow_mut().rng.u128(..);
        self.request_id = request::request_id(traceparent.as_deref(), random);
        for name in FORWARDED {
            if let Some(value) = self.get_http_request_header(name) {
                self.forwarded.push((name, value));
            }
        }
        self.strategy_header = self.get_http_request_header("routing-strategy");
        self.profile_header = self.get_http_request_header("config-profile");
        self.session_key = self
            .get_http_request_header("x-aibrix-session-key")
            .filter(|k| !k.is_empty() && k.len() <= tokens::MAX_SESSION_KEY_BYTES);

        let path = self.get_http_request_header(":path").unwrap_or_default();
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
        if !end_of_stream {
            return Action::Pause;
        }
        let raw = self.get_http_request_body(0, body_size).unwrap_or_default();
        match self.route(&raw) {
            Ok(action) => action,
            Err(e) => self.reject(e),
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.set_http_response_header("request-id", Some(&self.request_id));
        if let Some(profile) = &self.auto_profile {
            self.set_http_response_header("x-aibrix-config-profile", Some(profile));
        }
        if let Some(r) = &self.routed {
            if !r.strategy.is_empty() {
                self.set_http_response_header("routing-strategy", Some(&r.strategy));
            }
            self.set_http_response_header("target-pod", Some(&r.pod_name));
            self.set_http_response_header("target-pod-ip", Some(&r.pod_address));
            if let Some((name, ip)) = &r.prefill {
                self.set_http_response_header("prefill-target-pod", Some(name));
                self.set_http_response_header("prefill-target-pod-ip", Some(ip));
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.release_all();
    }
}
