//! Routing a request whose body is in: parsed, admitted, decided, selected, and sent to its
//! pod or started on its pair.

use std::rc::Rc;

use proxy_wasm::traits::HttpContext;
use proxy_wasm::types::Action;

use super::select::OnePod;
use super::stand_in::StandIn;
use super::{PdHttp, Routed, Served};
use crate::core::engine::{self, Engine};
use crate::core::errors::RouteError;
use crate::core::fleet::{FleetView, ModelView, PodView};
use crate::core::pd::{session_affinity, PdSettings, Step0Input, Target};
use crate::core::profile::Strategy;
use crate::core::request::{Endpoint, RoutingRequest};
use crate::core::route::{self, Decision};
use crate::core::tokenize;
use crate::host::metrics::Metrics;
use crate::host::{now_ms, now_us};

impl PdHttp {
    /// Reads the whole buffered request body and routes on it, or answers why not.
    pub(super) fn route_body(&mut self) -> Action {
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
    pub(super) fn route(&mut self, mut raw: Vec<u8>) -> Result<Action, RouteError> {
        let endpoint = self.endpoint.ok_or(RouteError::UnknownPath)?;
        let fleet: Rc<FleetView> = self
            .vm
            .borrow()
            .fleet
            .clone()
            .ok_or(RouteError::NoSnapshot)?;
        self.routed_on = Some(fleet.clone());
        let req = self.parse_request(endpoint, &mut raw)?;
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
        let narrowed = self.narrowed_view(model, &req.model)?;
        let model = narrowed.as_deref().unwrap_or(model);
        let kept = self.failover.without_failed(model)?;
        let model = kept.as_ref().unwrap_or(model);
        let now = now_ms();
        let decision = self.decide(model, &req)?;
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
        let pick = OnePod::for_request(count_only, external.as_ref(), &decision);
        let mut via = None;
        let target = if count_only {
            self.select_one(model, &req, pick, now)?.0
        } else if decision.strategy == Strategy::Pd {
            let settings;
            (settings, engine) = self.prepare_pair(model, endpoint, &req, &raw, &decision)?;
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
        self.explain_one_pod(model, target, &strategy, via);
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
        let stand_in = self.stand_in_for(model, target, step0);
        match target {
            Target::Single { pod } => self.route_to_pod(&model.pods[pod], strategy, via, stand_in),
            Target::Pair { prefill, decode } => {
                let pair = (&model.pods[prefill], &model.pods[decode]);
                self.route_to_pair(pair, strategy, stand_in, engine, req, raw)
            }
        }
    }

    fn parse_request(
        &mut self,
        endpoint: Endpoint,
        raw: &mut Vec<u8>,
    ) -> Result<RoutingRequest, RouteError> {
        let mut req = crate::section!("request_body.parse", RoutingRequest::parse(endpoint, raw))?;
        if let Some(clean) = crate::core::engine::without_gateway_members(&req.members, raw) {
            // Rare (no client sends them): the body Envoy holds and the one kept for the legs
            // lose them, and the request is read again from the clean one.
            log::info!(
                "request {}: dropped the client's KV-transfer members (the gateway's to set)",
                self.request_id
            );
            self.replace_body(&clean)?;
            *raw = clean;
            req = RoutingRequest::parse(endpoint, raw)?;
        }
        Ok(req)
    }

    fn decide(&mut self, model: &ModelView, req: &RoutingRequest) -> Result<Decision, RouteError> {
        let length = tokenize::PromptLength::new(&req.prompt_text);
        let decision = {
            let vm = self.vm.borrow();
            crate::section!(
                "request_body.decide",
                route::decide(
                    model,
                    req,
                    self.strategy_header.as_deref(),
                    self.profile_header.as_deref(),
                    &vm.defaults.env,
                    &|boundaries| length.for_boundaries(boundaries) as i64,
                )
            )?
        };
        self.prompt_counted = length.taken();
        Ok(decision)
    }

    /// A PD request's settings and its pair's engine, settled (or the request refused) before
    /// `select_pair`.
    fn prepare_pair(
        &mut self,
        model: &ModelView,
        endpoint: Endpoint,
        req: &RoutingRequest,
        raw: &[u8],
        decision: &Decision,
    ) -> Result<(PdSettings, Engine), RouteError> {
        let resolved =
            PdSettings::resolve(&self.vm.borrow().defaults, decision.routing_config.as_ref());
        let settings = resolved.map_err(|e| self.selection_failed(e))?;
        self.prefill_timeout_s = settings.prefill_timeout_s;
        // The engine check and SGLang's body validation come before any selection, so
        // a refused request changes no load counter.
        let engine = engine::agreed_engine(model).map_err(|e| self.selection_failed(e))?;
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
            engine::sglang::validate(raw, &req.members)?;
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
        Ok((settings, engine))
    }

    /// The explanation of a single-pod pick; a PD selection wrote its own.
    fn explain_one_pod(
        &mut self,
        model: &ModelView,
        target: Target,
        strategy: &str,
        via: Option<session_affinity::Via>,
    ) {
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
    }

    fn route_to_pod(
        &mut self,
        pod: &PodView,
        strategy: String,
        via: Option<session_affinity::Via>,
        stand_in: Option<StandIn>,
    ) -> Result<Action, RouteError> {
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

    fn route_to_pair(
        &mut self,
        (prefill, decode): (&PodView, &PodView),
        strategy: String,
        stand_in: Option<StandIn>,
        engine: Engine,
        req: RoutingRequest,
        raw: Vec<u8>,
    ) -> Result<Action, RouteError> {
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
