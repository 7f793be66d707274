//! One HTTP stream: buffer the body, decide with the core, run the prefill leg, hand the
//! request to the decode (or combined) pod, and release every charge exactly once.

use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType};
use serde_json::{Map, Value};

use crate::core::config::KvConnector;
use crate::core::engine::vllm;
use crate::core::errors::RouteError;
use crate::core::fleet::{FleetView, ModelView};
use crate::core::ledger::{self, Counter};
use crate::core::pd::Step0Input;
use crate::core::pd::{self, Target};
use crate::core::profile::Strategy;
use crate::core::request::{self, Endpoint, RoutingRequest};
use crate::core::route::{self, Decision};
use crate::host::metrics::Metrics;
use crate::host::store::SharedData;
use crate::host::SharedVm;

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
    /// Charges still held: (pod key, counter). Each is released once.
    charges: Vec<(String, Counter)>,
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
            charges: Vec::new(),
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

    fn release(&mut self, counter: Counter) {
        let mut i = 0;
        while i < self.charges.len() {
            if self.charges[i].1 == counter {
                let (key, counter) = self.charges.swap_remove(i);
                if let Err(e) = ledger::release(&SharedData, &key, counter) {
                    log::error!("cannot release {counter:?} on {key}: {e}");
                }
            } else {
                i += 1;
            }
        }
    }

    fn release_all(&mut self) {
        self.release(Counter::PrefillInflight);
        self.release(Counter::Running);
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
        let decision = {
            let mut vm = self.vm.borrow_mut();
            let vm = &mut *vm;
            let rng = &mut vm.rng;
            // Until the cl100k counter lands, lengths are estimated at 4 bytes per token.
            let estimate = (req.prompt_bytes / 4) as i64;
            route::decide(
                model,
                &req,
                self.strategy_header.as_deref(),
                self.profile_header.as_deref(),
                &vm.env,
                &|_| estimate,
                &mut |n| rng.u64(0..n.max(1)),
            )?
        };
        self.auto_profile = decision.auto_profile.clone();
        let target = self.select_and_charge(model, &decision)?;
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
                    .unwrap_or(self.vm.borrow().env.kv_connector);
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

    /// Selection and charges in one CAS round over the shared load table.
    fn select_and_charge(
        &mut self,
        model: &ModelView,
        decision: &Decision,
    ) -> Result<Target, RouteError> {
        let vm = self.vm.clone();
        let mut vm = vm.borrow_mut();
        let rng = &mut vm.rng;
        let step0 = Step0Input {
            profile: decision.profile.as_deref(),
            bucketing: decision.bucketing,
            prompt_len: decision.prompt_len,
        };
        let target = ledger::update(&SharedData, |table| {
            let target = match decision.strategy {
                Strategy::Pd => pd::select_pd(model, step0, table, rng)?,
                other => pd::select_single(model, other, table, rng)?,
            };
            target.charge(model, table);
            Ok::<Target, RouteError>(target)
        })?;
        for (pod, counter) in target.charges() {
            if let Some(pod) = pod {
                self.charges.push((model.pods[pod].key.clone(), counter));
            }
        }
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
                vm.env.prefill_request_timeout_s,
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
        self.release(Counter::PrefillInflight);
        let status = self
            .get_http_call_response_header(":status")
            .unwrap_or_default();
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        let metrics = self.vm.borrow().metrics.clone();
        match self.finish_prefill(&status, &body) {
            Ok(()) => {
                Metrics::inc(metrics.prefill_success);
                self.resume_http_request();
            }
            Err(e) => {
                if matches!(e, RouteError::Prefill { .. }) {
                    Metrics::inc(metrics.prefill_fail);
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
