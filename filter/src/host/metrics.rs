//! Filter metrics. Envoy exposes them as `wasmcustom.<name>`; `stats_tags` in envoy.yaml turn
//! the `.reason.<x>` / `.kind.<x>` suffixes into Prometheus labels.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

use crate::core::errors::RouteError;

/// Ids of the three token-ledger gauges of one pod.
type TokenGaugeIds = [Option<u32>; 3];

#[derive(Default)]
pub struct Metrics {
    /// Per-pod token-ledger gauges, defined on first use (ids are per VM).
    token_gauges: hashbrown::HashMap<String, TokenGaugeIds>,
    pub requests: Option<u32>,
    pub routed_pair: Option<u32>,
    pub routed_single: Option<u32>,
    pub prefill_success: Option<u32>,
    pub prefill_fail: Option<u32>,
    pub fleet_version: Option<u32>,
    pub fleet_loaded_vms: Option<u32>,
    pub snapshot_fetch_errors: Option<u32>,
    /// Selection plus charge (one CAS round), microseconds, as measured inside the VM.
    pub selection_us: Option<u32>,
    /// The selection alone (Steps 0–5), without the shared-data round trip, microseconds.
    pub selection_core_us: Option<u32>,
    /// Decode tokens and live replicas of the other gateway replicas, as this one sees them.
    pub remote_decode_tokens: Option<u32>,
    pub remote_replicas: Option<u32>,
    rejected: Vec<(&'static str, u32)>,
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

impl Metrics {
    /// Defines every metric once per VM (ids are per VM, values process-wide).
    pub fn define() -> Metrics {
        let c = MetricType::Counter;
        let g = MetricType::Gauge;
        Metrics {
            token_gauges: hashbrown::HashMap::new(),
            requests: define(c, "pd_router_requests_total"),
            routed_pair: define(c, "pd_router_routed_total.kind.pair"),
            routed_single: define(c, "pd_router_routed_total.kind.single"),
            prefill_success: define(c, "gateway_prefill_request_success_total"),
            prefill_fail: define(c, "gateway_prefill_request_fail_total"),
            fleet_version: define(g, "pd_router_fleet_version"),
            fleet_loaded_vms: define(g, "pd_router_fleet_loaded_vms"),
            snapshot_fetch_errors: define(c, "pd_router_snapshot_fetch_errors_total"),
            selection_us: define(MetricType::Histogram, "pd_router_selection_us"),
            selection_core_us: define(MetricType::Histogram, "pd_router_selection_core_us"),
            remote_decode_tokens: define(g, "pd_router_remote_decode_tokens"),
            remote_replicas: define(g, "pd_router_remote_replicas"),
            rejected: RouteError::REASONS
                .iter()
                .filter_map(|r| {
                    define(c, &format!("pd_router_rejected_total.reason.{r}")).map(|id| (*r, id))
                })
                .collect(),
        }
    }

    pub fn inc(id: Option<u32>) {
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, 1);
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

    /// Sets the token-ledger gauges (`pd_token_load_active_tokens`, `_kv_tokens`,
    /// `_decode_tokens`, labelled `namespace` and `pod_name`) to the ledger's values. Absolute
    /// values from the shared ledger, so whichever worker writes last is right.
    pub fn token_gauges(&mut self, pods: &[(String, crate::core::tokens::PodTokens)]) {
        for (key, tokens) in pods {
            let ids = self
                .token_gauges
                .entry_ref(key.as_str())
                .or_insert_with(|| {
                    let (ns, name) = key.split_once('/').unwrap_or(("", key.as_str()));
                    let gauge = |metric: &str| {
                        define(
                            MetricType::Gauge,
                            &format!("{metric}.namespace.{ns}.pod_name.{name}"),
                        )
                    };
                    [
                        gauge("pd_token_load_active_tokens"),
                        gauge("pd_token_load_kv_tokens"),
                        gauge("pd_token_load_decode_tokens"),
                    ]
                });
            let values = [tokens.active, tokens.kv, tokens.decode];
            for (id, value) in ids.iter().zip(values) {
                Metrics::set(*id, value.max(0.0).round() as u64);
            }
        }
    }

    pub fn rejected(&self, error: &RouteError) {
        let reason = error.reason();
        if let Some((_, id)) = self.rejected.iter().find(|(r, _)| *r == reason) {
            let _ = hostcalls::increment_metric(*id, 1);
        }
    }
}
