//! Filter metrics. Envoy exposes them as `wasmcustom.<name>`; labels are encoded into the
//! name by `core::obs::labels::tagged` and extracted by the `stats_tags` of envoy.yaml.
//!
//! Ids are per VM and values process-wide (every VM defining a name shares the stat). Labelled
//! series are defined once per label set and their ids cached, so the request path formats no
//! name after the first request of each label set: it only hashes the label values it holds.

use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

use crate::core::errors::RouteError;
use crate::core::fleet::{PodView, Role};
use crate::core::obs::backlog::Backlog;
use crate::core::obs::labels::tagged;
use crate::core::obs::outcome::{self, Outcome};
use crate::core::obs::series::SeriesBook;
use crate::core::obs::timing::{self, Durations, DURATION_BUCKETS, TOTAL_BUCKETS};
use crate::core::pd::session_affinity;
use crate::core::upstream_error;

/// The five ledger gauges of one pod and the values last written to them.
struct TokenGauges {
    ids: [Option<u32>; 5],
    last: Option<[u64; 5]>,
}

impl TokenGauges {
    /// Sets the gauges to `row`'s values unless they already show them.
    fn write(&mut self, row: &crate::core::ledger::Row) {
        let t = &row.tokens;
        let values = [
            t.active.max(0.0).round() as u64,
            t.kv.max(0.0).round() as u64,
            t.decode.max(0.0).round() as u64,
            u64::from(row.counts.prefill_inflight),
            u64::from(row.counts.running),
        ];
        if self.last == Some(values) {
            return;
        }
        self.last = Some(values);
        for (id, value) in self.ids.iter().zip(values) {
            Metrics::set(*id, value);
        }
    }
}

/// Where selections of pods past [`MAX_POD_SERIES`](crate::core::obs::series::MAX_POD_SERIES) are counted.
const OTHER_POD: &str = "_other";
/// Models (a base model and its LoRA adapters) one pod's selection counters are kept apart
/// for; more share the `_other` series.
const MODELS_PER_POD: usize = 32;

/// Durations with AIBrix bucket counters, in `DURATION_KINDS` order.
const DURATION_KINDS: [&str; 6] = [
    "routing",
    "prefill",
    "kv_transfer",
    "decode",
    "ttft",
    "tpot",
];

/// Histograms of the same durations (plus total), unit in the name.
const HISTOGRAMS: [&str; 7] = [
    "pd_router_routing_time_us",
    "pd_router_prefill_time_us",
    "pd_router_kv_transfer_time_us",
    "pd_router_decode_time_ms",
    "pd_router_ttft_ms",
    "pd_router_tpot_us",
    "pd_router_total_time_ms",
];

/// Outcome counter ids of one model: (status, status_code) → id.
type OutcomeIds = HashMap<(&'static str, u32), Option<u32>>;

#[derive(Default)]
pub struct Metrics {
    /// Per-pod ledger gauges, defined for every pod of each adopted snapshot (up to
    /// [`MAX_POD_SERIES`](crate::core::obs::series::MAX_POD_SERIES) pods over the VM's life; later pods have none).
    token_gauges: SeriesBook<TokenGauges>,
    /// Pods whose ledger gauges wait to be defined, a time budget per tick
    /// ([`Metrics::define_waiting_gauges`]).
    gauge_backlog: Backlog,
    /// `pd_selected_{prefill,decode}_pod_total` per pod key, one series per model the pod was
    /// selected for (its base model and each LoRA adapter it serves; at most
    /// [`MODELS_PER_POD`], past which its selections count under `pod="_other"`).
    selected: SeriesBook<Vec<(String, Option<u32>)>>,
    /// The shared `pod="_other"` series past [`MAX_POD_SERIES`](crate::core::obs::series::MAX_POD_SERIES), per side, once defined.
    selected_other: [Option<Option<u32>>; 2],
    /// `pd_router_pod_failures_total{namespace,pod}` per pod key: the requests passive ejection
    /// blamed on the pod, which an operator looks for first ("which pod is failing").
    pod_failures: SeriesBook<Option<u32>>,
    /// Its shared `pod="_other"` series, once defined.
    pod_failures_other: Option<Option<u32>>,
    /// `gateway_request_model_{success,fail}_total` per model.
    outcomes: HashMap<String, OutcomeIds>,
    /// `vtc_bucket_size_active{model}` per model, defined on its first `vtc-basic` pick.
    vtc_bucket: HashMap<String, Option<u32>>,
    prefill_fail: HashMap<(&'static str, u32), Option<u32>>,
    duration_buckets: [[Option<u32>; 13]; 6],
    total_buckets: [Option<u32>; 8],
    histograms: [Option<u32>; 7],
    pub requests: Option<u32>,
    pub routed_pair: Option<u32>,
    pub routed_single: Option<u32>,
    /// By `session_affinity::Via`: how each session-affinity request found its pod.
    pub session_affinity: [Option<u32>; 3],
    /// Prefill failovers (`PdHttp::fail_over`): `rerouted`, and `failed` (no other pod could
    /// take the request; the client got the prefill failure).
    pub prefill_failover: [Option<u32>; 2],
    pub prefill_success: Option<u32>,
    pub prefill_outstanding: Option<u32>,
    pub first_token_delay: Option<u32>,
    pub fleet_version: Option<u32>,
    pub fleet_loaded_vms: Option<u32>,
    /// VMs whose timer runs at the idle period (`core::pace`).
    pub idle_vms: Option<u32>,
    /// VMs that adopted the newest snapshot (`core::adoption`).
    pub fleet_vms_on_latest: Option<u32>,
    /// `pd_router_snapshot_fetch_errors_total` by `reason` (`host::snapshot::FETCH_ERRORS`).
    snapshot_fetch_errors: Vec<(&'static str, u32)>,
    /// `pd_router_snapshot_stale` (0/1) and `pd_router_snapshot_age_ms`: process-wide values
    /// every VM computes alike from the shared confirmation time.
    pub snapshot_stale: Option<u32>,
    pub snapshot_age_ms: Option<u32>,
    /// `pd_router_snapshot_adoptions_total{kind}`: `full` (the fleet changed, or the VM's
    /// first) and `metrics` (only engine metrics changed; the VM's view was reused).
    snapshot_adoptions: [Option<u32>; 2],
    /// `pd_router_ejections_total`: pods taken out of a worker's routing view by passive
    /// ejection (`core::ejection`).
    pub ejections: Option<u32>,
    /// `pd_router_ejections_adopted_total`: pods taken out of a VM's routing view because
    /// another worker ejected them.
    pub ejections_adopted: Option<u32>,
    /// `pd_router_decode_rerouted_total`: PD requests whose decode pod left the routing view
    /// while their prefill ran, sent to another decode pod of the roleset.
    pub decode_rerouted: Option<u32>,
    /// `pd_router_stand_in_retries_total{result}`: requests whose chosen pod refused the
    /// connection, retried by Envoy on the stand-in pod (`PluginConfig::connect_retry`):
    /// `[served, failed, no_host]` (the stand-in answered, or failed too; or the retrying
    /// cluster knew neither pod, which turns naming off for a while, `StandInBreaker`).
    pub stand_in_retries: [Option<u32>; 3],
    /// `pd_router_rate_limit_checks_total`: requests (naming a `user`, or of a model whose
    /// profile limits its rate) whose admission was asked of pd-control (`core::user_limits`).
    pub rate_limit_checks: Option<u32>,
    /// `pd_router_rate_limit_unchecked_total`: admissions pd-control could not decide (no
    /// answer, its Redis failing), admitted or refused by `rate_limits_fail_open`.
    pub rate_limit_unchecked: Option<u32>,
    /// `pd_router_user_tokens_reported_total`: answer tokens reported to pd-control for the
    /// users' TPM counters.
    pub user_tokens_reported: Option<u32>,
    /// `pd_router_user_tokens_unreported_total`: tokens given up on, their report failing
    /// for a minute (`user_limits::RESEND_FOR_MS`), or that did not fit
    /// (`user_limits::MAX_PENDING_USERS`): the users' TPM counters miss them.
    pub user_tokens_unreported: Option<u32>,
    /// `pd_router_user_token_report_failures_total`: token reports pd-control did not take
    /// whole (no answer, or not 2xx); each is sent again on the next tick.
    pub user_token_report_failures: Option<u32>,
    /// `pd_router_model_rps_refunds_total{result}`: requests counted against their model's
    /// rate and then refused by the filter, given back to pd-control
    /// (`user_limits::RefundBook`): `[sent, unsent]` (pd-control took the release; or no
    /// answer, a failure, no room, or the window over before the tick).
    pub model_rps_refunds: [Option<u32>; 2],
    /// `pd_router_rate_limit_withdrawals_total{result}`: admissions withdrawn for requests
    /// refused without pd-control's answer (`user_limits::cancel_body`): `[sent, unsent]`
    /// (the call went out, its answer read by no one; or it could not be sent).
    pub withdrawals: [Option<u32>; 2],
    /// `pd_router_external_decisions_total{result}`, by `core::external::Outcome`.
    pub external_decisions: [Option<u32>; 6],
    /// `pd_router_prefix_batches_missed_total`: other workers' prefix-event batches a worker
    /// could no longer read (their ring had moved on; `core::prefix::log`).
    pub prefix_batches_missed: Option<u32>,
    /// `pd_router_vms_reclaimed_total`: VMs of this process another VM found silent and
    /// declared dead (a trap, a stopped worker), whose charges it released.
    pub vms_reclaimed: Option<u32>,
    /// `pd_router_charges_force_released_total{reason}`: requests whose charges were released
    /// for them, `ttl` (held past `AIBRIX_TOKEN_LOAD_TTL_SECONDS`) and `vm_reclaimed` (their
    /// VM was declared dead). Any rise is a leak or a lost VM worth a look.
    pub force_released: [Option<u32>; 2],
    /// `pd_router_charge_release_errors_total`: release rounds the shared ledger refused (the
    /// charges stay held for a later attempt, at worst for their TTL).
    pub charge_release_errors: Option<u32>,
    /// Selection plus charge (one CAS round), microseconds, as measured inside the VM.
    pub selection_us: Option<u32>,
    /// The selection alone (Steps 0–5), without the shared-data round trip, microseconds.
    pub selection_core_us: Option<u32>,
    /// Decode tokens, running requests and live replicas of the other gateway replicas, as
    /// this one sees them.
    pub remote_decode_tokens: Option<u32>,
    pub remote_running_requests: Option<u32>,
    pub remote_replicas: Option<u32>,
    rejected: Vec<(&'static str, u32)>,
    /// `pd_router_upstream_errors_rewritten_total{kind}`, indexed by `upstream_error::Kind`.
    upstream_rewrites: [Option<u32>; 4],
}

fn define(kind: MetricType, name: &str) -> Option<u32> {
    match hostcalls::define_metric(kind, name) {
        Ok(id) => Some(id),
        Err(e) => {
            log::warn!("cannot define metric {name}: {e:?}");
            None
        }
    }
}

fn counter(name: &str, tags: &[(&str, &str)]) -> Option<u32> {
    define(MetricType::Counter, &tagged(name, tags))
}

/// The ledger gauges of `key` in `gauges`, defined on first use; `None` past the book's cap.
fn pod_gauges<'g>(
    gauges: &'g mut SeriesBook<TokenGauges>,
    key: &str,
) -> Option<&'g mut TokenGauges> {
    gauges.series(key, || {
        let (ns, name) = key.split_once('/').unwrap_or(("", key));
        let gauge = |metric: &str| {
            define(
                MetricType::Gauge,
                &tagged(metric, &[("namespace", ns), ("pod_name", name)]),
            )
        };
        let ids = [
            gauge("pd_token_load_active_tokens"),
            gauge("pd_token_load_kv_tokens"),
            gauge("pd_token_load_decode_tokens"),
            gauge("pd_router_prefill_inflight"),
            gauge("pd_router_running_requests"),
        ];
        TokenGauges { ids, last: None }
    })
}

impl Metrics {
    /// Defines the fixed metrics once per VM; labelled per-model and per-pod series come later.
    pub fn define() -> Metrics {
        let c = MetricType::Counter;
        let g = MetricType::Gauge;
        let code = outcome::PREFILL_SUCCESS.1.to_string();
        let mut duration_buckets = [[None; 13]; 6];
        for (kind, ids) in DURATION_KINDS.iter().zip(duration_buckets.iter_mut()) {
            let name = format!("gateway_{kind}_time_bucket_total");
            let name = if *kind == "ttft" || *kind == "tpot" {
                format!("gateway_{kind}_bucket_total")
            } else {
                name
            };
            for (label, id) in DURATION_BUCKETS.iter().zip(ids.iter_mut()) {
                *id = counter(&name, &[("bucket", label)]);
            }
        }
        let mut total_buckets = [None; 8];
        for (label, id) in TOTAL_BUCKETS.iter().zip(total_buckets.iter_mut()) {
            *id = counter("gateway_total_time_bucket_total", &[("bucket", label)]);
        }
        let mut histograms = [None; 7];
        for (name, id) in HISTOGRAMS.iter().zip(histograms.iter_mut()) {
            *id = define(MetricType::Histogram, name);
        }
        // The route-step failure series exist from the start, so a success ratio over them
        // reads 100 % rather than "no data" before the first failure.
        let prefill_fail = [
            ("pd-do-prefill-request-error", 500),
            ("pd-filter-prefill-decode-pods-fail", 400),
        ]
        .into_iter()
        .map(|(status, code)| {
            let id = counter(
                "gateway_prefill_request_fail_total",
                &[("status", status), ("status_code", &code.to_string())],
            );
            ((status, code), id)
        })
        .collect();
        Metrics {
            prefill_fail,
            requests: define(c, "pd_router_requests_total"),
            routed_pair: counter("pd_router_routed_total", &[("kind", "pair")]),
            routed_single: counter("pd_router_routed_total", &[("kind", "single")]),
            session_affinity: session_affinity::Via::ALL.map(|via| {
                counter(
                    "pd_router_session_affinity_total",
                    &[("result", via.name())],
                )
            }),
            external_decisions: crate::core::external::RESULTS
                .map(|result| counter("pd_router_external_decisions_total", &[("result", result)])),
            prefill_failover: ["rerouted", "failed"]
                .map(|result| counter("pd_router_prefill_failover_total", &[("result", result)])),
            prefill_success: counter(
                "gateway_prefill_request_success_total",
                &[
                    ("status", outcome::PREFILL_SUCCESS.0),
                    ("status_code", &code),
                ],
            ),
            prefill_outstanding: define(g, "gateway_prefill_outstanding_requests"),
            first_token_delay: define(c, "gateway_first_token_delay_over_1s_total"),
            fleet_version: define(g, "pd_router_fleet_version"),
            fleet_loaded_vms: define(g, "pd_router_fleet_loaded_vms"),
            idle_vms: define(g, "pd_router_idle_vms"),
            fleet_vms_on_latest: define(g, "pd_router_fleet_vms_on_latest"),
            snapshot_fetch_errors: crate::host::snapshot::FETCH_ERRORS
                .iter()
                .filter_map(|r| {
                    counter("pd_router_snapshot_fetch_errors_total", &[("reason", r)])
                        .map(|id| (*r, id))
                })
                .collect(),
            snapshot_adoptions: ["full", "metrics"]
                .map(|kind| counter("pd_router_snapshot_adoptions_total", &[("kind", kind)])),
            snapshot_stale: define(g, "pd_router_snapshot_stale"),
            snapshot_age_ms: define(g, "pd_router_snapshot_age_ms"),
            ejections: define(c, "pd_router_ejections_total"),
            ejections_adopted: define(c, "pd_router_ejections_adopted_total"),
            decode_rerouted: define(c, "pd_router_decode_rerouted_total"),
            stand_in_retries: ["served", "failed", "no_host"]
                .map(|result| counter("pd_router_stand_in_retries_total", &[("result", result)])),
            rate_limit_checks: define(c, "pd_router_rate_limit_checks_total"),
            rate_limit_unchecked: define(c, "pd_router_rate_limit_unchecked_total"),
            user_tokens_reported: define(c, "pd_router_user_tokens_reported_total"),
            user_tokens_unreported: define(c, "pd_router_user_tokens_unreported_total"),
            user_token_report_failures: define(c, "pd_router_user_token_report_failures_total"),
            model_rps_refunds: ["sent", "unsent"]
                .map(|result| counter("pd_router_model_rps_refunds_total", &[("result", result)])),
            withdrawals: ["sent", "unsent"].map(|result| {
                counter(
                    "pd_router_rate_limit_withdrawals_total",
                    &[("result", result)],
                )
            }),
            prefix_batches_missed: define(c, "pd_router_prefix_batches_missed_total"),
            vms_reclaimed: define(c, "pd_router_vms_reclaimed_total"),
            force_released: ["ttl", "vm_reclaimed"].map(|reason| {
                counter(
                    "pd_router_charges_force_released_total",
                    &[("reason", reason)],
                )
            }),
            charge_release_errors: define(c, "pd_router_charge_release_errors_total"),
            selection_us: define(MetricType::Histogram, "pd_router_selection_us"),
            selection_core_us: define(MetricType::Histogram, "pd_router_selection_core_us"),
            remote_decode_tokens: define(g, "pd_router_remote_decode_tokens"),
            remote_running_requests: define(g, "pd_router_remote_running_requests"),
            remote_replicas: define(g, "pd_router_remote_replicas"),
            rejected: RouteError::REASONS
                .iter()
                .filter_map(|r| {
                    counter("pd_router_rejected_total", &[("reason", r)]).map(|id| (*r, id))
                })
                .collect(),
            upstream_rewrites: upstream_error::Kind::ALL.map(|kind| {
                counter(
                    "pd_router_upstream_errors_rewritten_total",
                    &[("kind", kind.label())],
                )
            }),
            duration_buckets,
            total_buckets,
            histograms,
            ..Metrics::default()
        }
    }

    /// Counts one adopted snapshot: `metrics_only` when it differed from the VM's view only
    /// in engine metrics.
    pub fn snapshot_adopted(&self, metrics_only: bool) {
        Metrics::inc(self.snapshot_adoptions[usize::from(metrics_only)]);
    }

    /// Counts one failed snapshot poll under `reason` (one of `FETCH_ERRORS`).
    pub fn snapshot_fetch_error(&self, reason: &str) {
        if let Some((_, id)) = self
            .snapshot_fetch_errors
            .iter()
            .find(|(r, _)| *r == reason)
        {
            let _ = hostcalls::increment_metric(*id, 1);
        }
    }

    pub fn inc(id: Option<u32>) {
        Metrics::add(id, 1);
    }

    pub fn add(id: Option<u32>, n: u64) {
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    pub fn gauge_add(id: Option<u32>, delta: i64) {
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, delta);
        }
    }

    pub fn set(id: Option<u32>, value: u64) {
        if let Some(id) = id {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    /// Queues the ledger gauges of these pods (keys `namespace/name`: every pod of each
    /// adopted snapshot, and the pods of a dead VM's charges) for definition unless this VM
    /// has them: tokens (`pd_token_load_active_tokens`, `_kv_tokens`, `_decode_tokens`) and
    /// request counters (`pd_router_prefill_inflight`, `pd_router_running_requests`), each
    /// labelled `namespace` and `pod_name`. They are defined a time budget per tick
    /// ([`Metrics::define_waiting_gauges`], see `core::obs::backlog`), except a charged pod's,
    /// which its charge defines at once. A charge writes the charged pods' values from its CAS
    /// round ([`Metrics::charged_gauges`]); everything else, releases included, shows at the
    /// root tick's [`Metrics::sync_ledger_gauges`] (every 200 ms): writing ten gauges in each
    /// of a request's three rounds cost more than the rounds' own work in V8.
    pub fn track_pods<'k>(&mut self, keys: impl Iterator<Item = &'k str>) {
        for key in keys {
            if !self.token_gauges.contains(key) && self.token_gauges.admits(key) {
                self.gauge_backlog.push(key);
            }
        }
    }

    /// Defines waiting ledger gauges for up to `budget_us` of the VM's time (at least one
    /// pod's). Returns how many pods got theirs and how many still wait.
    pub fn define_waiting_gauges(&mut self, budget_us: u64) -> (usize, usize) {
        let gauges = &mut self.token_gauges;
        let defined = self
            .gauge_backlog
            .drain_within(budget_us, crate::host::now_us, |key| {
                pod_gauges(gauges, key);
            });
        (defined, self.gauge_backlog.len())
    }

    /// Whether ledger gauges still wait to be defined (the timer keeps its fast pace).
    pub fn has_waiting_gauges(&self) -> bool {
        !self.gauge_backlog.is_empty()
    }

    /// Writes the gauges of every tracked pod from `ledger` (local rows), skipping the pods
    /// whose values did not change since they were last written. Operators (and the fault
    /// tests) read "all back to exactly 0" from them once a load is over.
    pub fn sync_ledger_gauges(&mut self, ledger: &crate::core::ledger::Ledger) {
        for (key, gauges) in self.token_gauges.live_mut() {
            gauges.write(&ledger.row(crate::core::ledger::PodId::of(key)));
        }
    }

    /// Writes the gauges of pods a selection just charged, from the rows its CAS round
    /// wrote: a charge shows at once (a replica waiting for another's load reads them), while
    /// releases show at the next sync.
    pub fn charged_gauges<'k>(
        &mut self,
        rows: impl Iterator<Item = (&'k str, crate::core::ledger::Row)>,
    ) {
        for (key, row) in rows {
            if let Some(gauges) = pod_gauges(&mut self.token_gauges, key) {
                gauges.write(&row);
            }
        }
    }

    /// Counts one PD selection of `pod` (`pd_selected_prefill_pod_total` or
    /// `pd_selected_decode_pod_total`, labelled namespace, pod, model, roleset, role).
    pub fn selected(&mut self, pod: &PodView, model: &str) {
        let side = usize::from(pod.role == Role::Decode);
        let metric = if side == 0 {
            "pd_selected_prefill_pod_total"
        } else {
            "pd_selected_decode_pod_total"
        };
        let define = || {
            let ns = pod.key.split_once('/').map(|(ns, _)| ns).unwrap_or("");
            let role = if side == 0 { "prefill" } else { "decode" };
            counter(
                metric,
                &[
                    ("namespace", ns),
                    ("roleset", &pod.roleset),
                    ("role", role),
                    ("model", model),
                    ("pod", &pod.name),
                ],
            )
        };
        let defined = self.selected.series(&pod.key, Vec::new).and_then(|models| {
            match models.iter().find(|(m, _)| m == model) {
                Some((_, id)) => Some(*id),
                None if models.len() < MODELS_PER_POD => {
                    let id = define();
                    models.push((model.to_string(), id));
                    Some(id)
                }
                None => None,
            }
        });
        let id = match defined {
            Some(id) => id,
            None => *self.selected_other[side]
                .get_or_insert_with(|| counter(metric, &[("pod", OTHER_POD)])),
        };
        Metrics::inc(id);
    }

    /// Counts a request pod `key` (`namespace/name`) failed (`VmState::pod_outcome`).
    pub fn pod_failed(&mut self, key: &str) {
        let defined = self.pod_failures.series(key, || {
            let (ns, name) = key.split_once('/').unwrap_or(("", key));
            counter(
                "pd_router_pod_failures_total",
                &[("namespace", ns), ("pod", name)],
            )
        });
        let id = match defined {
            Some(id) => *id,
            None => *self.pod_failures_other.get_or_insert_with(|| {
                counter("pd_router_pod_failures_total", &[("pod", OTHER_POD)])
            }),
        };
        Metrics::inc(id);
    }

    /// Zeroes the gauges of pods that are no longer in the fleet (once per departure). Their
    /// series stay, as every stat does in Envoy (a counter must not go down either), and come
    /// back to a pod that returns; see `core::obs::series`.
    pub fn retain_pods(&mut self, live: impl Fn(&str) -> bool) {
        self.token_gauges.retire(&live, |gauges| {
            for id in gauges.ids {
                Metrics::set(id, 0);
            }
        });
        self.selected.retire(&live, |_| {});
        self.pod_failures.retire(&live, |_| {});
        self.gauge_backlog.retain(live);
    }

    /// Whether any pod in the fleet has series (so the caller can skip building the live set).
    pub fn has_pod_series(&self) -> bool {
        self.token_gauges.has_live()
            || self.selected.has_live()
            || self.pod_failures.has_live()
            || !self.gauge_backlog.is_empty()
    }

    /// Counts a request's outcome in `gateway_request_model_{success,fail}_total`.
    pub fn outcome(&mut self, model: &str, outcome: Outcome) {
        let (status, code) = outcome.labels();
        let success = outcome.is_success();
        let by_model = self.outcomes.entry_ref(model).or_default();
        let id = *by_model.entry((status, code)).or_insert_with(|| {
            let metric = if success {
                "gateway_request_model_success_total"
            } else {
                "gateway_request_model_fail_total"
            };
            let code = code.to_string();
            counter(
                metric,
                &[("model", model), ("status", status), ("status_code", &code)],
            )
        });
        Metrics::inc(id);
    }

    /// Sets AIBrix's `vtc_bucket_size_active` for `model`: the adaptive bucket size (tokens)
    /// the last `vtc-basic` placement on any worker used. Smooth is healthy; a saw-tooth says
    /// the window or `AIBRIX_ROUTER_VTC_TOKEN_TRACKER_MIN_TOKENS` is too small.
    pub fn vtc_bucket_size(&mut self, model: &str, tokens: f64) {
        let id = *self.vtc_bucket.entry_ref(model).or_insert_with(|| {
            define(
                MetricType::Gauge,
                &tagged("vtc_bucket_size_active", &[("model", model)]),
            )
        });
        Metrics::set(id, tokens.max(0.0).round() as u64);
    }

    /// Counts a failed prefill leg or selection in `gateway_prefill_request_fail_total`.
    pub fn prefill_failed(&mut self, error: &RouteError) {
        for labels in outcome::prefill_fail_labels(error) {
            self.count_prefill_fail(labels);
        }
    }

    /// Counts a failed prefill call that prefill failover recovered from: its transport
    /// class only, as the request itself did not fail.
    pub fn prefill_call_failed(&mut self, error: &RouteError) {
        if let Some(labels) = outcome::prefill_call_fail_label(error) {
            self.count_prefill_fail(labels);
        }
    }

    fn count_prefill_fail(&mut self, labels: (&'static str, u32)) {
        let id = *self.prefill_fail.entry(labels).or_insert_with(|| {
            let code = labels.1.to_string();
            counter(
                "gateway_prefill_request_fail_total",
                &[("status", labels.0), ("status_code", &code)],
            )
        });
        Metrics::inc(id);
    }

    /// Records a finished request's durations: AIBrix's bucket counters and the histograms.
    pub fn durations(&self, d: &Durations, ttft_threshold_us: u64) {
        let by_kind = [
            d.routing_us,
            d.prefill_us,
            d.kv_transfer_us,
            d.decode_us,
            d.ttft_us,
            d.tpot_us,
        ];
        for (us, ids) in by_kind.iter().zip(&self.duration_buckets) {
            if let Some(us) = us {
                Metrics::inc(ids[timing::duration_bucket(*us)]);
            }
        }
        if let Some(us) = d.total_us {
            Metrics::inc(self.total_buckets[timing::total_bucket(us)]);
        }
        let values = [
            d.routing_us,
            d.prefill_us,
            d.kv_transfer_us,
            d.decode_any_us.map(|us| us / 1000),
            d.ttft_us.map(|us| us / 1000),
            d.tpot_any_us,
            d.total_us.map(|us| us / 1000),
        ];
        for (value, id) in values.iter().zip(&self.histograms) {
            if let Some(v) = value {
                Metrics::set(*id, *v);
            }
        }
        if timing::first_token_delayed(d, ttft_threshold_us) {
            Metrics::inc(self.first_token_delay);
        }
    }

    /// Counts a pod's error answer rewritten for the client (`core::upstream_error`).
    pub fn upstream_error_rewritten(&self, kind: upstream_error::Kind) {
        Metrics::inc(self.upstream_rewrites[kind as usize]);
    }

    pub fn rejected(&self, error: &RouteError) {
        let reason = error.reason();
        if let Some((_, id)) = self.rejected.iter().find(|(r, _)| *r == reason) {
            let _ = hostcalls::increment_metric(*id, 1);
        }
    }
}
