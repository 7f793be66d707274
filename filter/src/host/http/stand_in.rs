//! The stand-in pod named with a request (`PluginConfig::connect_retry`, `pd::fallback`), and
//! what changes when Envoy had to use it.
//!
//! The filter names the chosen pod and a stand-in in `x-pd-destinations`; the retrying
//! cluster's `override_host` load balancer tries them in that order, one per attempt, and
//! retries a refused (or reset-before-request) connection, and for a pod serving the request
//! alone its `stand_in_statuses` answers too. Which one served is known
//! only from the response: `upstream.address` names the host of the last attempt. When that
//! is the stand-in, the chosen pod failed the request (passive ejection hears of it), the
//! request's running charge and decode tokens move to the stand-in, and the response headers,
//! access-log state and watchdog name the pod that actually serves.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::HttpContext;

use super::PdHttp;
use crate::core::fleet::{ModelView, PodView};
use crate::core::inbound::DESTINATIONS_HEADER;
use crate::core::pd::{Step0Input, Target};
use crate::host::holds;
use crate::host::metrics::Metrics;

/// A pod named second in the destinations header.
#[derive(Debug, Clone)]
pub(super) struct StandIn {
    pub key: String,
    pub name: String,
    pub address: String,
}

impl StandIn {
    fn of(pod: &PodView) -> StandIn {
        StandIn {
            key: pod.key.clone(),
            name: pod.name.clone(),
            address: pod.address.clone(),
        }
    }
}

/// The stand-in named with a request, and the pod it stands in for.
pub(super) struct Named {
    chosen_key: String,
    stand_in: StandIn,
    /// Envoy was also asked to retry the chosen pod's own 5xx answers (`stand_in_statuses`).
    on_answers: bool,
}

/// Envoy's router reads these per request (once, then drops them from the upstream request);
/// the filter has already removed any a client sent (`core::inbound::ENVOY_CONTROLS`).
const RETRY_ON_HEADER: &str = "x-envoy-retry-on";
const RETRIABLE_STATUS_CODES_HEADER: &str = "x-envoy-retriable-status-codes";

impl PdHttp {
    /// A stand-in for `target`'s answering pod when the plugin retries refused connections
    /// and pd-control lists the pods for the retrying cluster; `request` is what Step 0 ran
    /// with (bucketing only for PD decisions: single-pod strategies do not bucket).
    pub(super) fn stand_in_for(
        &self,
        model: &ModelView,
        target: Target,
        request: Step0Input<'_>,
    ) -> Option<StandIn> {
        let mut vm = self.vm.borrow_mut();
        // The snapshot says the gateways' clusters may hold the pods, and pd-control has not
        // said this gateway's does not (its EDS stream never took a listing).
        let written =
            self.routed_on.as_ref().is_some_and(|fleet| fleet.eds) && vm.eds_here != Some(false);
        if !vm.plugin.connect_retry || !written || !vm.stand_in_breaker.allows(crate::host::now_ms)
        {
            return None;
        }
        crate::core::pd::fallback::stand_in_fitting(model, target, request, &mut vm.rng)
            .map(|i| StandIn::of(&model.pods[i]))
    }

    /// Names `chosen` and `stand_in` (when there is one, and it is a pod of the fleet) for the
    /// retrying cluster. Without one the header is left off, and the request takes the
    /// ORIGINAL_DST route to `chosen` alone. `whole_request`: the pod serves the request
    /// alone (a single-pod target), so its own 5xx answers in `stand_in_statuses` may be
    /// retried on the stand-in too; a PD decode leg's never are.
    pub(super) fn name_destinations(
        &mut self,
        chosen_key: &str,
        chosen_address: &str,
        stand_in: Option<StandIn>,
        whole_request: bool,
    ) {
        let stand_in = stand_in.filter(|s| self.guard_target(&s.address).is_ok());
        let previous = self.named.take();
        let had_named = previous.is_some();
        let had_answers = previous.is_some_and(|n| n.on_answers);
        let on_answers = match stand_in {
            Some(stand_in) => {
                let value = format!("{chosen_address},{}", stand_in.address);
                self.set_http_request_header(DESTINATIONS_HEADER, Some(&value));
                if let Some(header) = self.obs.explain_header.as_mut() {
                    header.push_str("; stand_in=");
                    header.push_str(&stand_in.name);
                }
                let codes = whole_request
                    .then(|| {
                        let vm = self.vm.borrow();
                        let list = &vm.plugin.stand_in_statuses;
                        (!list.is_empty()).then(|| {
                            list.iter()
                                .map(u16::to_string)
                                .collect::<Vec<_>>()
                                .join(",")
                        })
                    })
                    .flatten();
                let on_answers = codes.is_some();
                if let Some(codes) = codes {
                    self.set_http_request_header(RETRY_ON_HEADER, Some("retriable-status-codes"));
                    self.set_http_request_header(RETRIABLE_STATUS_CODES_HEADER, Some(&codes));
                }
                self.named = Some(Named {
                    chosen_key: chosen_key.to_string(),
                    stand_in,
                    on_answers,
                });
                on_answers
            }
            None => {
                if had_named {
                    self.set_http_request_header(DESTINATIONS_HEADER, None);
                }
                false
            }
        };
        if had_answers && !on_answers {
            self.set_http_request_header(RETRY_ON_HEADER, None);
            self.set_http_request_header(RETRIABLE_STATUS_CODES_HEADER, None);
        }
    }

    /// Where the request is now: its stand-in when Envoy retried it there (the chosen pod
    /// refused the connection), else `chosen`. A host call only when a stand-in was named.
    pub(super) fn answering_address(&self, chosen: &str) -> String {
        let Some(named) = &self.named else {
            return chosen.to_string();
        };
        let at = hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten();
        if at.as_deref() == Some(named.stand_in.address.as_bytes()) {
            named.stand_in.address.clone()
        } else {
            chosen.to_string()
        }
    }

    /// Once the response starts: when Envoy retried on the stand-in, the chosen pod failed the
    /// request and the request's charges and names move to the stand-in (whose own outcome,
    /// an answer or Envoy's 503 when it refused too, counts as any target's).
    pub(super) fn check_stand_in(&mut self, clock: &mut crate::host::Clock) {
        let Some(named) = self.named.take() else {
            return;
        };
        // Read only once a stand-in was named (most requests have none).
        let now_ms = clock.ms();
        let served = hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten()
            .filter(|a| !a.is_empty());
        // Read only off the common path (the chosen pod served): one host call less there.
        let details = || {
            hostcalls::get_property(vec!["response", "code_details"])
                .ok()
                .flatten()
        };
        let Some(served) = served else {
            if details().as_deref() == Some(b"no_healthy_upstream".as_slice()) {
                self.stand_ins_found_no_host(&named, now_ms);
            }
            return;
        };
        self.vm.borrow_mut().stand_in_breaker.reached();
        if served != named.stand_in.address.as_bytes() {
            return;
        }
        // An answer of the pod's own, or Envoy's reply after the stand-in failed as well, or
        // this filter's own reply (SGLang's prefill leg failed while the stand-in waited for
        // its KV): then the stand-in neither served nor failed.
        let answered = details().is_some_and(|d| d == b"via_upstream");
        let refused_here = !answered && self.local_reply;
        let StandIn { key, name, address } = named.stand_in;
        log::info!(
            "request {}: pod {} {}; retried on stand-in {key}, which {}",
            self.request_id,
            named.chosen_key,
            if named.on_answers {
                "refused the connection or answered a stand_in_statuses error"
            } else {
                "refused the connection"
            },
            if answered {
                "answered"
            } else if refused_here {
                "was still waiting when the gateway refused the request"
            } else {
                "failed too"
            }
        );
        holds::update(&self.vm, self.id, |held, ledger| {
            held.move_decode(ledger, &key, now_ms)
        });
        self.answered_by(&key, &name, &address);
        if let Some(header) = self.obs.explain_header.as_mut() {
            header.push_str(if answered {
                "; stand_in_served"
            } else if refused_here {
                "; stand_in_unused"
            } else {
                "; stand_in_failed"
            });
        }
        let mut vm = self.vm.borrow_mut();
        vm.pod_outcome(&named.chosen_key, false, now_ms);
        if !refused_here {
            Metrics::inc(vm.metrics.stand_in_retries[usize::from(!answered)]);
        }
    }

    /// The retrying cluster knew neither named pod (Envoy tried no host): this gateway's
    /// cluster is not in step with the snapshots, so this worker stops naming stand-ins for
    /// a while (`StandInBreaker`); its requests route as without them. This one request has
    /// failed with Envoy's 503.
    fn stand_ins_found_no_host(&mut self, named: &Named, now_ms: u64) {
        if let Some(header) = self.obs.explain_header.as_mut() {
            header.push_str("; stand_in_no_host");
        }
        // Neither pod was tried: the failure is the gateway's, not the chosen pod's.
        self.served.target = None;
        let mut vm = self.vm.borrow_mut();
        let cool_ms = vm.stand_in_breaker.no_host(now_ms);
        Metrics::inc(vm.metrics.stand_in_retries[2]);
        log::warn!(
            "request {}: the retrying cluster knows neither {} nor stand-in {}: is pd-control's \
             endpoint listing reaching this gateway (--eds-file read by Envoy, or its EDS \
             stream)? no stand-ins from this worker for {} s",
            self.request_id,
            named.chosen_key,
            named.stand_in.key,
            cool_ms / 1000
        );
    }
}
