//! The selection itself: the pod (or the PD pair) is picked and charged in one CAS round over
//! the shared ledger, so every worker's next pick scores the loads with this one's charge in.

use std::borrow::Cow;

use proxy_wasm::hostcalls;

use super::external;
use super::PdHttp;
use crate::core::errors::RouteError;
use crate::core::fleet::ModelView;
use crate::core::ledger;
use crate::core::obs::Explain;
use crate::core::pd::{
    self, candidates, session_affinity, PairInput, PdSettings, Step0Input, Target,
};
use crate::core::profile::{Blend, Strategy, StrategySpec};
use crate::core::request::RoutingRequest;
use crate::core::route::Decision;
use crate::core::tokenize;
use crate::core::tokens;
use crate::host::holds;
use crate::host::now_ns;
use crate::host::store::SharedData;

/// How one pod is picked for a request that is not a PD pair (`Strategy(Pd)` only names the
/// strategy of a pair for the response header).
#[derive(Clone, Copy)]
pub(super) enum OnePod<'a> {
    /// Any role, the least busy: a request that computes nothing (a token count).
    Any,
    Strategy(Strategy),
    Blend(&'a Blend),
    /// The pod in this slot, chosen already (by the `external` strategy's service).
    Fixed(usize),
}

impl<'a> OnePod<'a> {
    pub(super) fn for_request(
        count_only: bool,
        external: Option<&'a external::ExternalPick>,
        decision: &'a Decision,
    ) -> OnePod<'a> {
        match (external, &decision.blend) {
            _ if count_only => OnePod::Any,
            (Some(external::ExternalPick::Pod(slot)), _) => OnePod::Fixed(*slot),
            (Some(external::ExternalPick::Fallback(StrategySpec::Blend(b))), _) => OnePod::Blend(b),
            (Some(external::ExternalPick::Fallback(StrategySpec::One(s))), _) => {
                OnePod::Strategy(*s)
            }
            (None, Some(blend)) => OnePod::Blend(blend),
            (None, None) => OnePod::Strategy(decision.strategy),
        }
    }

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

    pub(super) fn name(&self) -> &str {
        match self {
            OnePod::Any => Strategy::LeastRequest.name(),
            OnePod::Fixed(_) => Strategy::External.name(),
            OnePod::Strategy(s) => s.name(),
            OnePod::Blend(b) => &b.label,
        }
    }
}

impl PdHttp {
    /// PD selection and its charges in one CAS round over the shared ledger.
    pub(super) fn select_pair(
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

    /// Picks one pod (see [`OnePod`]) and charges its running count in the same CAS round.
    /// The second value says how session-affinity found the pod (`None` without it).
    pub(super) fn select_one(
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
            session_id: self.forwarded_value(session_affinity::SESSION_ID_HEADER),
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
}
