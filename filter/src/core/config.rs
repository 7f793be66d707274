//! Gateway-wide settings: the plugin configuration JSON from Envoy and the `AIBRIX_*`
//! environment variables, validated once at configure time into an immutable value.

use serde::Deserialize;

use super::api_key::ApiKey;
use super::env::EnvReader;

/// Why a plugin configuration was refused. Envoy then keeps the previous configuration.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("plugin configuration is not valid JSON or has an unknown key: {0}")]
    Json(String),
    #[error("plugin configuration field {field} is invalid: {reason}")]
    Field { field: &'static str, reason: String },
}

/// Slowest allowed timer tick (`refresh_ms`): the cross-worker heartbeats it carries are read
/// as gone after about 5 s without one.
pub const MAX_REFRESH_MS: u64 = 2_000;

/// The plugin configuration (Envoy `configuration` of the wasm filter). Every key is optional.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PluginConfig {
    /// Envoy cluster that reaches pd-control.
    pub control_cluster: String,
    /// `:authority` sent to pd-control.
    pub control_authority: String,
    /// Path of the protobuf snapshot on pd-control.
    pub snapshot_path: String,
    /// How often the snapshot is polled, and the period of the filter's timer. A poll that
    /// brings a new version is followed by the next at once, at most one such follow-up per
    /// tick (`core::poll`).
    pub refresh_ms: u64,
    /// Timeout of one snapshot fetch (on top of the poll's wait, see `snapshot_wait_ms`).
    pub fetch_timeout_ms: u64,
    /// Long poll: how long pd-control may hold a poll for a version we already have before
    /// answering 304 (it answers at once when a newer one is published). An idle fleet then
    /// costs one poll per wait instead of one per `refresh_ms`, and a new snapshot arrives as
    /// soon as pd-control builds it. Capped at a third of `snapshot_stale_after_ms` (a held
    /// poll confirms the snapshot only when it ends); 0 polls every `refresh_ms` instead.
    pub snapshot_wait_ms: u64,
    /// ORIGINAL_DST cluster whose `http_header_name` picks the pod.
    pub pods_cluster: String,
    /// The header that cluster reads (`original_dst_lb_config.http_header_name`).
    pub dst_header: String,
    /// Honour `x-pd-explain: 1`: the response then carries `x-pd-explain`, why these pods.
    /// Off by default: the explanation names pods and scores, which clients need not see.
    pub explain: bool,
    /// How long the fleet snapshot may go unconfirmed by pd-control (no successful poll)
    /// before it counts as stale. Routing then continues on its pods, but their engine
    /// metrics are treated as stale (they describe a past load), and
    /// `pd_router_snapshot_stale` reads 1.
    pub snapshot_stale_after_ms: u64,
    /// Shared secret sent as `authorization: Bearer <token>` on every call to pd-control
    /// (pd-control `--snapshot-token-file`). Empty sends none.
    pub snapshot_token: String,
    /// Passive outlier ejection (`core::ejection`): consecutive failures (refused, 5xx,
    /// dropped stream, silent decode) that take a pod out of this worker's routing view;
    /// 0 turns it off.
    pub eject_after_failures: u32,
    /// First ejection period; doubled on each further ejection without a success between.
    pub eject_base_ms: u64,
    /// Longest ejection period.
    pub eject_max_ms: u64,
    /// How many times a PD request whose prefill leg failed (the pod unreachable, or one of
    /// `prefill_failover_statuses` answered) is routed again, without the pods that failed
    /// it, before the client sees the failure; 0 turns failover off. Only where the decode
    /// leg waits for the prefill answer (vLLM, TRT-LLM `context_first`), so the client has
    /// been sent nothing.
    pub prefill_failover: u32,
    /// The prefill pod's own answers that fail over like an unreachable pod. A dying vLLM
    /// engine answers 500 to every request until its server exits, and 502/503 come from an
    /// engine that is not serving; a prompt that crashes engines costs at most
    /// `prefill_failover` more pods. Empty: only unreachable pods fail over. 5xx only: a 4xx
    /// is the request's fault and would fail anywhere.
    pub prefill_failover_statuses: Vec<u16>,
    /// Rate limits (when pd-control checks them, `Snapshot.user_limits`): how long the
    /// admission of a request naming a `user`, or of a model whose profile limits its rate,
    /// may wait for pd-control's answer.
    pub rate_limits_timeout_ms: u64,
    /// Rate limits: a request whose admission cannot be checked (pd-control unreachable or
    /// late, its Redis failing) is admitted (`true`) or refused with 500 `x-error-user`
    /// (`false`, the default, as AIBrix does when its Redis fails).
    pub rate_limits_fail_open: bool,
    /// Rate limits: a request whose admission reached no pd-control at all (no connection,
    /// no endpoint) is admitted (`true`, the default), whatever `rate_limits_fail_open` says;
    /// an answer saying the limits could not be checked (its Redis failing), or none within
    /// `rate_limits_timeout_ms` (a pd-control waiting on a hung Redis), still follows
    /// `rate_limits_fail_open`.
    /// pd-control runs as one replica, restarted with every rollout (its startup takes
    /// seconds, up to 90 s by its startup probe): refused, every rate-limited request failed
    /// with 500 for that long, while Redis, the limits' source of truth, was fine. As Envoy's
    /// own rate-limit filter does by default (`failure_mode_deny: false`).
    pub rate_limits_fail_open_unreachable: bool,
    /// Name a second pod with every routed request (`x-pd-destinations: chosen,stand-in`,
    /// see `pd::fallback`) for Envoy to retry on when the chosen pod refuses the connection.
    /// Needs the retrying cluster of `envoy/envoy.yaml.tmpl` (override_host over the pods
    /// pd-control writes with `--eds-file`); requests with no stand-in go to `pods_cluster`.
    pub connect_retry: bool,
    /// A single-pod request (a standard pod, no KV elsewhere) is retried on its stand-in also
    /// when the chosen pod answers one of these (Envoy's `x-envoy-retry-on:
    /// retriable-status-codes`, set per request): a live server over a dead engine answers
    /// 500 to everything. Never a PD decode leg: its pod may have pulled the KV, which the
    /// prefill pod then frees. 5xx only; empty retries refused connections only.
    pub stand_in_statuses: Vec<u16>,
    /// The largest request body the filter takes, in bytes; a larger one is refused with 413
    /// before it is read into the VM, whose memory never shrinks. Envoy's own bound
    /// (`per_connection_buffer_limit_bytes`, 8 MiB in the drop-ins) holds only for HTTP/1.1:
    /// an HTTP/2 stream's buffer is bounded by its window (256 MiB by default).
    pub max_request_body_bytes: usize,
    /// The most request-body bytes one VM may hold for requests waiting on a callout (a
    /// vLLM or TRT-LLM `context_first` prefill, `/server_info`, an admission, the external
    /// router), their member indexes included (`core::held_body`). The VM's memory grows with
    /// the sum of those bodies and never shrinks, and Envoy's overload manager does not see
    /// it; a request that would go past this is refused with 503 before its callout. At least
    /// `max_request_body_bytes`; a body of that size also holds its member index (its member
    /// names and ≈ 24 bytes per member), so leave room above it for an idle VM to take any
    /// body the filter accepts. Default 256 MiB: 32 of the largest bodies, thousands of
    /// ordinary prompts.
    pub max_held_body_bytes: usize,
    /// A request for this path is answered by the worker it reaches: 200 once that worker
    /// has a fleet snapshot, 503 before (`core::readiness`), for a readiness probe or a load
    /// balancer's health check; no API key asked, no request counted. Empty turns it off (the
    /// path then gets the 404 of any unknown path). Must not be a path the gateway serves.
    pub ready_path: String,
}

impl PluginConfig {
    /// The wait sent with each poll: `snapshot_wait_ms`, at most a third of the stale bound,
    /// so a healthy pd-control confirms the snapshot (wait + one tick + a round trip) well
    /// before it would count as stale.
    pub fn poll_wait_ms(&self) -> u64 {
        self.snapshot_wait_ms.min(self.snapshot_stale_after_ms / 3)
    }

    pub fn ejection(&self) -> crate::core::ejection::EjectionPolicy {
        crate::core::ejection::EjectionPolicy {
            after_failures: self.eject_after_failures,
            base_ms: self.eject_base_ms,
            max_ms: self.eject_max_ms,
        }
    }
}

impl Default for PluginConfig {
    fn default() -> Self {
        PluginConfig {
            control_cluster: "pd_control".into(),
            control_authority: "pd-control".into(),
            snapshot_path: "/v1/snapshot".into(),
            refresh_ms: 100,
            fetch_timeout_ms: 2000,
            snapshot_wait_ms: 3000,
            pods_cluster: "pd_pods".into(),
            dst_header: "target-pod".into(),
            explain: false,
            snapshot_stale_after_ms: 10_000,
            snapshot_token: String::new(),
            eject_after_failures: 3,
            eject_base_ms: 5_000,
            eject_max_ms: 60_000,
            prefill_failover: 1,
            prefill_failover_statuses: vec![500, 502, 503],
            rate_limits_timeout_ms: 500,
            rate_limits_fail_open: false,
            rate_limits_fail_open_unreachable: true,
            connect_retry: false,
            stand_in_statuses: vec![500, 502, 503],
            max_request_body_bytes: DEFAULT_MAX_REQUEST_BODY_BYTES,
            max_held_body_bytes: crate::core::held_body::DEFAULT_MAX_HELD_BODY_BYTES,
            ready_path: DEFAULT_READY_PATH.into(),
        }
    }
}

/// Where a readiness probe asks whether the gateway can route (`ready_path`).
pub const DEFAULT_READY_PATH: &str = "/pd-router/ready";

/// The drop-ins' listener buffer limit: a ~2M-token prompt at 4 bytes a token.
pub const DEFAULT_MAX_REQUEST_BODY_BYTES: usize = 8 * 1024 * 1024;

impl PluginConfig {
    pub fn parse(raw: &[u8]) -> Result<PluginConfig, ConfigError> {
        let trimmed = std::str::from_utf8(raw).map(str::trim).unwrap_or("");
        let config: PluginConfig = if trimmed.is_empty() {
            PluginConfig::default()
        } else {
            serde_json::from_slice(raw).map_err(|e| ConfigError::Json(e.to_string()))?
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let non_empty = [
            ("control_cluster", &self.control_cluster),
            ("pods_cluster", &self.pods_cluster),
            ("snapshot_path", &self.snapshot_path),
        ];
        for (field, value) in non_empty {
            if value.trim().is_empty() {
                return Err(ConfigError::Field {
                    field,
                    reason: "must not be empty".into(),
                });
            }
        }
        let header_ok = !self.dst_header.is_empty()
            && self
                .dst_header
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !header_ok {
            return Err(ConfigError::Field {
                field: "dst_header",
                reason: format!("{:?} is not a lower-case header name", self.dst_header),
            });
        }
        if !self.snapshot_path.starts_with('/') {
            return Err(ConfigError::Field {
                field: "snapshot_path",
                reason: format!("{:?} does not start with /", self.snapshot_path),
            });
        }
        // The timer carries every cross-worker heartbeat (the prefix-queue registry, replica
        // reports, the journal's liveness mark), each read as gone after about 5 s without
        // one: a slower tick would have live workers' state dropped and their charges reclaimed.
        if !(10..=MAX_REFRESH_MS).contains(&self.refresh_ms) {
            return Err(ConfigError::Field {
                field: "refresh_ms",
                reason: format!("must be 10..={MAX_REFRESH_MS}"),
            });
        }
        // Envoy takes a call's timeout as a signed 32-bit count of milliseconds: a larger one
        // fails every call (or wraps), and every poll with it.
        if !(1..=60_000).contains(&self.fetch_timeout_ms) {
            return Err(ConfigError::Field {
                field: "fetch_timeout_ms",
                reason: "must be 1..=60000".into(),
            });
        }
        if !(1..=60_000).contains(&self.rate_limits_timeout_ms) {
            return Err(ConfigError::Field {
                field: "rate_limits_timeout_ms",
                reason: "must be 1..=60000".into(),
            });
        }
        // Below one poll period every snapshot would flap stale between two polls.
        if self.snapshot_stale_after_ms < self.refresh_ms.saturating_mul(2) {
            return Err(ConfigError::Field {
                field: "snapshot_stale_after_ms",
                reason: format!("must be at least twice refresh_ms ({})", self.refresh_ms),
            });
        }
        // Each attempt is one more pod's connection timeout the client waits through.
        if self.prefill_failover > MAX_PREFILL_FAILOVER {
            return Err(ConfigError::Field {
                field: "prefill_failover",
                reason: format!("must be 0..={MAX_PREFILL_FAILOVER}"),
            });
        }
        let statuses = [
            ("prefill_failover_statuses", &self.prefill_failover_statuses),
            ("stand_in_statuses", &self.stand_in_statuses),
        ];
        for (field, list) in statuses {
            if let Some(bad) = list.iter().find(|s| !(500..=599).contains(*s)) {
                return Err(ConfigError::Field {
                    field,
                    reason: format!("{bad} is not a 5xx status"),
                });
            }
        }
        if self.max_request_body_bytes == 0 {
            return Err(ConfigError::Field {
                field: "max_request_body_bytes",
                reason: "must be above 0".into(),
            });
        }
        // Below one body of the largest size taken, such a request would be refused even by
        // an idle VM: on every PD pair that waits for its prefill, whatever the load.
        if self.max_held_body_bytes < self.max_request_body_bytes {
            return Err(ConfigError::Field {
                field: "max_held_body_bytes",
                reason: format!(
                    "must be at least max_request_body_bytes ({})",
                    self.max_request_body_bytes
                ),
            });
        }
        // The probe is answered before the path is looked at, so an endpoint's path here
        // would answer every request of that endpoint with the readiness answer.
        if !self.ready_path.is_empty()
            && (!self.ready_path.starts_with('/')
                || self.ready_path.contains('?')
                || crate::core::request::Endpoint::from_path(&self.ready_path).is_ok())
        {
            return Err(ConfigError::Field {
                field: "ready_path",
                reason: format!(
                    "{:?} must start with / and be no path the gateway serves",
                    self.ready_path
                ),
            });
        }
        // A header value: visible ASCII only, so it can neither split the request nor
        // be mangled on the way.
        if !self.snapshot_token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::Field {
                field: "snapshot_token",
                reason: "must be visible ASCII without spaces".into(),
            });
        }
        Ok(())
    }
}

/// The most re-routes `prefill_failover` may ask for.
pub const MAX_PREFILL_FAILOVER: u32 = 4;

/// vLLM KV connector contract used on the prefill leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvConnector {
    /// `kv_transfer_params` handed from the prefill response to the decode request.
    Shfs,
    /// The whole prefill response travels as `disagg_prefill_resp` (AWS Neuron fork).
    Nixl,
    /// AIBrix's stub: no augmentation and no merge.
    Mooncake,
}

impl KvConnector {
    pub fn parse(value: &str) -> Option<KvConnector> {
        match value.trim().to_ascii_lowercase().as_str() {
            "shfs" => Some(KvConnector::Shfs),
            "nixl" => Some(KvConnector::Nixl),
            "mooncake" => Some(KvConnector::Mooncake),
            _ => None,
        }
    }
}

/// Settings from the gateway environment (`AIBRIX_*`, same names and defaults as AIBrix).
#[derive(Debug, Clone, PartialEq)]
pub struct EnvSettings {
    /// `ROUTING_ALGORITHM`: strategy when no locked/header/profile value applies.
    pub routing_algorithm: Option<String>,
    /// `AIBRIX_PREFILL_REQUEST_TIMEOUT`, seconds.
    pub prefill_request_timeout_s: f64,
    /// `AIBRIX_KV_CONNECTOR_TYPE`.
    pub kv_connector: KvConnector,
    /// `AIBRIX_AUTH_BEARER_TOKEN`: when set, requests without this bearer key get 401.
    pub api_key: Option<ApiKey>,
    /// `AIBRIX_TTFT_THRESHOLD_S`: TTFT above it counts in
    /// `gateway_first_token_delay_over_1s_total`. AIBrix reads whole seconds; fractions are
    /// accepted too.
    pub ttft_threshold_s: f64,
    pub pd: PdEnv,
    pub single: SingleEnv,
}

/// Knobs of the single-pod strategies.
#[derive(Debug, Clone, PartialEq)]
pub struct SingleEnv {
    /// `AIBRIX_ROUTING_LEAST_REQUEST_TOP_K` (5): `least-request-top-k` picks among this many
    /// least-loaded pods; 0 or less means every pod.
    pub top_k: usize,
    /// `AIBRIX_ROUTING_LEAST_REQUEST_TOP_K_EPSILON` (4): ... and only among pods within this
    /// many running requests of the least-loaded one; `None` (a negative value) drops that
    /// bound.
    pub top_k_epsilon: Option<u32>,
    /// `AIBRIX_ROUTING_LEAST_REQUEST_TOP_K_RAMP_WINDOW` (300s, 0 off): how long a pod that
    /// just became ready is charged extra requests, decaying to none.
    pub top_k_ramp_window_ms: u64,
    /// `AIBRIX_ROUTER_VTC_*`: `vtc-basic`'s weights and token window.
    pub vtc: crate::core::pd::vtc::VtcSettings,
}

impl Default for SingleEnv {
    fn default() -> Self {
        SingleEnv {
            top_k: 5,
            top_k_epsilon: Some(4),
            top_k_ramp_window_ms: 300_000,
            vtc: Default::default(),
        }
    }
}

/// The PD selection thresholds and defaults; per-profile knobs override them per request.
#[derive(Debug, Clone, PartialEq)]
pub struct PdEnv {
    /// `AIBRIX_PROMPT_LENGTH_BUCKETING`.
    pub prompt_length_bucketing: bool,
    /// `AIBRIX_PREFILL_SCORE_POLICY` (validated when the policy is resolved).
    pub prefill_score_policy: String,
    /// `AIBRIX_DECODE_SCORE_POLICY`.
    pub decode_score_policy: String,
    /// `AIBRIX_PREFILL_LOAD_IMBALANCE_MIN_SPREAD` (Step 1, strict >).
    pub prefill_load_imbalance_min_spread: f64,
    /// `AIBRIX_DECODE_LOAD_IMBALANCE_MIN_SPREAD` (Step 2 count check, >=).
    pub decode_load_imbalance_min_spread: f64,
    /// `AIBRIX_DECODE_THROUGHPUT_IMBALANCE_MIN_SPREAD` (Step 2 throughput check, >).
    pub decode_throughput_imbalance_min_spread: f64,
    /// `AIBRIX_DECODE_SCORE_RATIO_THRESHOLD` (Step 2 drain-rate check, >).
    pub decode_score_ratio_threshold: f64,
    /// `AIBRIX_DECODE_LB_WEIGHT_RUNNING`.
    pub decode_lb_weight_running: f64,
    /// `AIBRIX_DECODE_LB_WEIGHT_THROUGHPUT`.
    pub decode_lb_weight_throughput: f64,
    /// `AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR` (Step 3 σ filter).
    pub std_dev_factor: f64,
}

impl Default for PdEnv {
    fn default() -> Self {
        PdEnv {
            prompt_length_bucketing: false,
            prefill_score_policy: "prefix_cache".into(),
            decode_score_policy: "load_balancing".into(),
            prefill_load_imbalance_min_spread: 16.0,
            decode_load_imbalance_min_spread: 16.0,
            decode_throughput_imbalance_min_spread: 2048.0,
            decode_score_ratio_threshold: 1.5,
            decode_lb_weight_running: 1.0,
            decode_lb_weight_throughput: 1.0,
            std_dev_factor: 1.0,
        }
    }
}

impl Default for EnvSettings {
    fn default() -> Self {
        EnvSettings {
            routing_algorithm: None,
            prefill_request_timeout_s: 30.0,
            kv_connector: KvConnector::Shfs,
            api_key: None,
            ttft_threshold_s: 1.0,
            pd: PdEnv::default(),
            single: SingleEnv::default(),
        }
    }
}

impl EnvSettings {
    /// Reads settings through `get`; returns the settings and one warning per bad value
    /// (named, with the default kept), for the host to log.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> (EnvSettings, Vec<String>) {
        let d = EnvSettings::default();
        let mut r = EnvReader::new(get);
        let settings = EnvSettings {
            routing_algorithm: r.string("ROUTING_ALGORITHM"),
            prefill_request_timeout_s: r.positive(
                "AIBRIX_PREFILL_REQUEST_TIMEOUT",
                d.prefill_request_timeout_s,
            ),
            kv_connector: r.choice(
                "AIBRIX_KV_CONNECTOR_TYPE",
                (KvConnector::Shfs, "shfs"),
                KvConnector::parse,
            ),
            api_key: ApiKey::from_env(r.string("AIBRIX_AUTH_BEARER_TOKEN").as_deref()),
            ttft_threshold_s: r.positive("AIBRIX_TTFT_THRESHOLD_S", d.ttft_threshold_s),
            pd: PdEnv {
                prompt_length_bucketing: r.bool("AIBRIX_PROMPT_LENGTH_BUCKETING", false),
                prefill_score_policy: r
                    .string("AIBRIX_PREFILL_SCORE_POLICY")
                    .unwrap_or(d.pd.prefill_score_policy),
                decode_score_policy: r
                    .string("AIBRIX_DECODE_SCORE_POLICY")
                    .map(|p| p.to_ascii_lowercase())
                    .unwrap_or(d.pd.decode_score_policy),
                prefill_load_imbalance_min_spread: r.positive(
                    "AIBRIX_PREFILL_LOAD_IMBALANCE_MIN_SPREAD",
                    d.pd.prefill_load_imbalance_min_spread,
                ),
                decode_load_imbalance_min_spread: r.positive(
                    "AIBRIX_DECODE_LOAD_IMBALANCE_MIN_SPREAD",
                    d.pd.decode_load_imbalance_min_spread,
                ),
                decode_throughput_imbalance_min_spread: r.positive(
                    "AIBRIX_DECODE_THROUGHPUT_IMBALANCE_MIN_SPREAD",
                    d.pd.decode_throughput_imbalance_min_spread,
                ),
                decode_score_ratio_threshold: r.positive(
                    "AIBRIX_DECODE_SCORE_RATIO_THRESHOLD",
                    d.pd.decode_score_ratio_threshold,
                ),
                decode_lb_weight_running: r.positive(
                    "AIBRIX_DECODE_LB_WEIGHT_RUNNING",
                    d.pd.decode_lb_weight_running,
                ),
                decode_lb_weight_throughput: r.positive(
                    "AIBRIX_DECODE_LB_WEIGHT_THROUGHPUT",
                    d.pd.decode_lb_weight_throughput,
                ),
                std_dev_factor: r.positive(
                    "AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR",
                    d.pd.std_dev_factor,
                ),
            },
            single: SingleEnv {
                top_k: usize::try_from(r.integer("AIBRIX_ROUTING_LEAST_REQUEST_TOP_K", 5))
                    .unwrap_or(0),
                top_k_epsilon: u32::try_from(
                    r.integer("AIBRIX_ROUTING_LEAST_REQUEST_TOP_K_EPSILON", 4),
                )
                .ok(),
                top_k_ramp_window_ms: r.duration_ms(
                    "AIBRIX_ROUTING_LEAST_REQUEST_TOP_K_RAMP_WINDOW",
                    d.single.top_k_ramp_window_ms,
                ),
                vtc: vtc_settings(&mut r),
            },
        };
        // Both are read per request; a bad value would otherwise surface only as every
        // request refused (or every key accepted), with nothing said at start.
        if let Some(v) = &settings.routing_algorithm {
            if crate::core::profile::Strategy::parse(v).is_err() {
                r.warnings.push(format!(
                    "ROUTING_ALGORITHM={v:?} is not a routing strategy (names are lower-case, \
                     e.g. pd); requests without a routing-strategy header are refused with 400"
                ));
            }
        }
        if settings.api_key.is_none() && r.is_set("AIBRIX_AUTH_BEARER_TOKEN") {
            r.warnings.push(
                "AIBRIX_AUTH_BEARER_TOKEN is set but blank: requests are NOT checked for an API key"
                    .into(),
            );
        }
        (settings, r.warnings)
    }
}

/// `vtc-basic`'s `AIBRIX_ROUTER_VTC_*` knobs.
fn vtc_settings<F: Fn(&str) -> Option<String>>(
    r: &mut EnvReader<F>,
) -> crate::core::pd::vtc::VtcSettings {
    use crate::core::pd::vtc::VtcSettings;
    let d = VtcSettings::default();
    const UNIT: &str = "AIBRIX_ROUTER_VTC_TOKEN_TRACKER_TIME_UNIT";
    let (unit_ms, bucket_ms) = match r.string(UNIT) {
        None => (60_000, d.bucket_ms),
        Some(raw) => VtcSettings::unit_ms(&raw).unwrap_or_else(|| {
            r.warnings.push(format!(
                "{UNIT}={raw:?} is not minutes, seconds or milliseconds; using minutes"
            ));
            (60_000, d.bucket_ms)
        }),
    };
    let size = r.count("AIBRIX_ROUTER_VTC_TOKEN_TRACKER_WINDOW_SIZE", 5);
    VtcSettings {
        max_pod_load: r.positive("AIBRIX_ROUTER_VTC_BASIC_MAX_POD_LOAD", d.max_pod_load),
        input_weight: r.non_negative("AIBRIX_ROUTER_VTC_BASIC_INPUT_TOKEN_WEIGHT", d.input_weight),
        output_weight: r.non_negative(
            "AIBRIX_ROUTER_VTC_BASIC_OUTPUT_TOKEN_WEIGHT",
            d.output_weight,
        ),
        fairness_weight: r
            .non_negative("AIBRIX_ROUTER_VTC_BASIC_FAIRNESS_WEIGHT", d.fairness_weight),
        utilization_weight: r.non_negative(
            "AIBRIX_ROUTER_VTC_BASIC_UTILIZATION_WEIGHT",
            d.utilization_weight,
        ),
        window_ms: size.saturating_mul(unit_ms),
        bucket_ms: VtcSettings::bucket_for(size.saturating_mul(unit_ms), bucket_ms),
        min_tokens: r.positive("AIBRIX_ROUTER_VTC_TOKEN_TRACKER_MIN_TOKENS", d.min_tokens),
        max_tokens: r.positive("AIBRIX_ROUTER_VTC_TOKEN_TRACKER_MAX_TOKENS", d.max_tokens),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_gives_defaults() {
        assert_eq!(PluginConfig::parse(b"").unwrap(), PluginConfig::default());
        assert_eq!(PluginConfig::parse(b"{}").unwrap(), PluginConfig::default());
    }

    #[test]
    fn the_poll_wait_stays_within_a_third_of_the_stale_bound() {
        assert_eq!(PluginConfig::default().poll_wait_ms(), 3000);
        let short = PluginConfig::parse(br#"{"refresh_ms":50,"snapshot_stale_after_ms":900}"#);
        assert_eq!(short.unwrap().poll_wait_ms(), 300);
        let off = PluginConfig::parse(br#"{"snapshot_wait_ms":0}"#).unwrap();
        assert_eq!(off.poll_wait_ms(), 0);
    }

    /// The field a configuration is refused for, `None` when it is not refused that way.
    fn refused_field(raw: &[u8]) -> Option<&'static str> {
        match PluginConfig::parse(raw) {
            Err(ConfigError::Field { field, .. }) => Some(field),
            _ => None,
        }
    }

    /// Asserts each of `raw` is refused for `field`.
    fn assert_refused(field: &str, raw: &[&[u8]]) {
        for bad in raw {
            assert_eq!(
                refused_field(bad),
                Some(field),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn staleness_bound_and_token_are_checked() {
        let ok = PluginConfig::parse(
            br#"{"refresh_ms":50,"snapshot_stale_after_ms":100,"snapshot_token":"s3cr3t-Tok_en"}"#,
        )
        .unwrap();
        assert_eq!(ok.snapshot_stale_after_ms, 100);
        assert_eq!(ok.snapshot_token, "s3cr3t-Tok_en");
        assert_refused(
            "snapshot_stale_after_ms",
            &[
                br#"{"refresh_ms":50,"snapshot_stale_after_ms":99}"#,
                br#"{"snapshot_stale_after_ms":0}"#,
            ],
        );
        assert_refused(
            "snapshot_token",
            &[
                br#"{"snapshot_token":"a b"}"#,
                br#"{"snapshot_token":"a\r\nx-evil: 1"}"#,
                br#"{"snapshot_token":"caf\u00e9"}"#,
            ],
        );
    }

    #[test]
    fn periods_timeouts_and_path_are_bounded() {
        let ok = PluginConfig::parse(
            br#"{"refresh_ms":2000,"fetch_timeout_ms":60000,"snapshot_path":"/v1/s"}"#,
        )
        .unwrap();
        assert_eq!((ok.refresh_ms, ok.fetch_timeout_ms), (2000, 60000));
        assert_refused(
            "refresh_ms",
            &[br#"{"refresh_ms":2001}"#, br#"{"refresh_ms":9}"#],
        );
        assert_refused(
            "fetch_timeout_ms",
            &[
                br#"{"fetch_timeout_ms":0}"#,
                br#"{"fetch_timeout_ms":60001}"#,
                br#"{"fetch_timeout_ms":2147483648}"#,
                br#"{"fetch_timeout_ms":4294967296}"#,
            ],
        );
        assert_refused("snapshot_path", &[br#"{"snapshot_path":"v1/snapshot"}"#]);
    }

    #[test]
    fn prefill_failover_is_bounded() {
        assert_eq!(PluginConfig::default().prefill_failover, 1);
        let off = PluginConfig::parse(br#"{"prefill_failover":0}"#).unwrap();
        assert_eq!(off.prefill_failover, 0);
        assert_refused("prefill_failover", &[br#"{"prefill_failover":5}"#]);
    }

    #[test]
    fn prefill_failover_statuses_are_server_errors() {
        assert_eq!(
            PluginConfig::default().prefill_failover_statuses,
            [500, 502, 503]
        );
        let none = PluginConfig::parse(br#"{"prefill_failover_statuses":[]}"#).unwrap();
        assert!(none.prefill_failover_statuses.is_empty());
        let more = PluginConfig::parse(br#"{"prefill_failover_statuses":[503,529]}"#).unwrap();
        assert_eq!(more.prefill_failover_statuses, [503, 529]);
        assert_refused(
            "prefill_failover_statuses",
            &[
                br#"{"prefill_failover_statuses":[429]}"#,
                br#"{"prefill_failover_statuses":[503,600]}"#,
            ],
        );
        assert_eq!(PluginConfig::default().stand_in_statuses, [500, 502, 503]);
        assert_refused("stand_in_statuses", &[br#"{"stand_in_statuses":[404]}"#]);
    }

    #[test]
    fn request_body_bound() {
        assert_eq!(
            PluginConfig::default().max_request_body_bytes,
            8 * 1024 * 1024
        );
        let small = PluginConfig::parse(br#"{"max_request_body_bytes":65536}"#).unwrap();
        assert_eq!(small.max_request_body_bytes, 65536);
        assert_refused(
            "max_request_body_bytes",
            &[br#"{"max_request_body_bytes":0}"#],
        );
    }

    #[test]
    fn held_body_budget_takes_at_least_one_largest_body() {
        assert_eq!(
            PluginConfig::default().max_held_body_bytes,
            256 * 1024 * 1024
        );
        let low =
            PluginConfig::parse(br#"{"max_request_body_bytes":65536,"max_held_body_bytes":65536}"#)
                .unwrap();
        assert_eq!(low.max_held_body_bytes, 65536);
        assert_refused(
            "max_held_body_bytes",
            &[
                br#"{"max_held_body_bytes":1048576}"#,
                br#"{"max_request_body_bytes":65536,"max_held_body_bytes":65535}"#,
                br#"{"max_held_body_bytes":0}"#,
            ],
        );
    }

    #[test]
    fn the_ready_path_is_no_path_the_gateway_serves() {
        assert_eq!(PluginConfig::default().ready_path, "/pd-router/ready");
        let off = PluginConfig::parse(br#"{"ready_path":""}"#).expect("empty turns it off");
        assert_eq!(off.ready_path, "");
        let other = PluginConfig::parse(br#"{"ready_path":"/healthz/ready"}"#).expect("a path");
        assert_eq!(other.ready_path, "/healthz/ready");
        assert_refused(
            "ready_path",
            &[
                br#"{"ready_path":"/v1/chat/completions"}"#,
                br#"{"ready_path":"/v1/messages"}"#,
                br#"{"ready_path":"ready"}"#,
                br#"{"ready_path":"/ready?x=1"}"#,
            ],
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        assert!(
            matches!(PluginConfig::parse(br#"{"refresh":5}"#), Err(ConfigError::Json(m)) if m.contains("refresh"))
        );
        assert_refused("dst_header", &[br#"{"dst_header":"Bad Header"}"#]);
        assert_refused("refresh_ms", &[br#"{"refresh_ms":1}"#]);
        let ok = PluginConfig::parse(
            br#"{"dst_header":"x-gateway-destination-endpoint","refresh_ms":50}"#,
        )
        .unwrap();
        assert_eq!(
            (ok.dst_header.as_str(), ok.refresh_ms),
            ("x-gateway-destination-endpoint", 50)
        );
        assert!(!ok.explain, "explanations are off unless asked for");
        assert!(PluginConfig::parse(br#"{"explain":true}"#).unwrap().explain);
        assert!(PluginConfig::parse(br#"{"explain":"yes"}"#).is_err());
    }

    #[test]
    fn env_values_fall_back_with_a_named_warning() {
        let env = |k: &str| match k {
            "AIBRIX_PREFILL_REQUEST_TIMEOUT" => Some("0".to_string()),
            "AIBRIX_KV_CONNECTOR_TYPE" => Some("NIXL".to_string()),
            "ROUTING_ALGORITHM" => Some(" pd ".to_string()),
            _ => None,
        };
        let (s, warnings) = EnvSettings::from_lookup(env);
        assert_eq!(s.prefill_request_timeout_s, 30.0);
        assert_eq!(s.kv_connector, KvConnector::Nixl);
        assert_eq!(s.routing_algorithm.as_deref(), Some("pd"));
        assert_eq!(s.ttft_threshold_s, 1.0);
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("AIBRIX_PREFILL_REQUEST_TIMEOUT"));
        assert_eq!(s.single, SingleEnv::default());
    }

    #[test]
    fn a_bad_routing_algorithm_and_a_blank_api_key_are_named_at_start() {
        let env = |k: &str| match k {
            "ROUTING_ALGORITHM" => Some("PD".to_string()),
            "AIBRIX_AUTH_BEARER_TOKEN" => Some("  ".to_string()),
            _ => None,
        };
        let (s, warnings) = EnvSettings::from_lookup(env);
        assert!(s.api_key.is_none());
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(
            warnings[0].contains("ROUTING_ALGORITHM=\"PD\""),
            "{warnings:?}"
        );
        assert!(warnings[1].contains("NOT checked"), "{warnings:?}");
        let fine = |k: &str| match k {
            "ROUTING_ALGORITHM" => Some("least-request:10,throughput".to_string()),
            "AIBRIX_AUTH_BEARER_TOKEN" => Some("sk-1".to_string()),
            _ => None,
        };
        let (s, warnings) = EnvSettings::from_lookup(fine);
        assert!(s.api_key.is_some());
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    #[test]
    fn top_k_knobs_read_as_aibrix_reads_them() {
        let env = |k: &str| match k {
            "AIBRIX_ROUTING_LEAST_REQUEST_TOP_K" => Some("-2".to_string()),
            "AIBRIX_ROUTING_LEAST_REQUEST_TOP_K_EPSILON" => Some("-1".to_string()),
            "AIBRIX_ROUTING_LEAST_REQUEST_TOP_K_RAMP_WINDOW" => Some("90s".to_string()),
            _ => None,
        };
        let (s, warnings) = EnvSettings::from_lookup(env);
        assert_eq!(
            s.single,
            SingleEnv {
                top_k: 0,
                top_k_epsilon: None,
                top_k_ramp_window_ms: 90_000,
                vtc: Default::default(),
            },
            "K ≤ 0: every pod; a negative epsilon: no bound"
        );
        assert!(warnings.is_empty());
        let off = |k: &str| {
            (k == "AIBRIX_ROUTING_LEAST_REQUEST_TOP_K_RAMP_WINDOW").then(|| "0".to_string())
        };
        assert_eq!(
            EnvSettings::from_lookup(off).0.single.top_k_ramp_window_ms,
            0
        );
    }

    #[test]
    fn vtc_knobs_read_with_their_unit_and_bad_values_named() {
        let env = |k: &str| match k {
            "AIBRIX_ROUTER_VTC_TOKEN_TRACKER_WINDOW_SIZE" => Some("30".to_string()),
            "AIBRIX_ROUTER_VTC_TOKEN_TRACKER_TIME_UNIT" => Some("Seconds".to_string()),
            "AIBRIX_ROUTER_VTC_BASIC_FAIRNESS_WEIGHT" => Some("0".to_string()),
            "AIBRIX_ROUTER_VTC_BASIC_MAX_POD_LOAD" => Some("0".to_string()),
            "AIBRIX_ROUTER_VTC_TOKEN_TRACKER_MIN_TOKENS" => Some("250".to_string()),
            _ => None,
        };
        let (s, warnings) = EnvSettings::from_lookup(env);
        let v = &s.single.vtc;
        assert_eq!((v.window_ms, v.bucket_ms), (30_000, 1000));
        let long =
            |k: &str| (k == "AIBRIX_ROUTER_VTC_TOKEN_TRACKER_WINDOW_SIZE").then(|| "60".into());
        let hour = EnvSettings::from_lookup(long).0.single.vtc;
        assert_eq!(
            (hour.window_ms, hour.bucket_ms),
            (3_600_000, 56_250),
            "in 64 buckets"
        );
        assert_eq!(v.fairness_weight, 0.0, "a weight may switch its term off");
        assert_eq!(v.max_pod_load, 100.0, "0 pods' load would divide by zero");
        assert_eq!(v.min_tokens, 250.0);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("AIBRIX_ROUTER_VTC_BASIC_MAX_POD_LOAD"));
        let ms = |k: &str| {
            (k == "AIBRIX_ROUTER_VTC_TOKEN_TRACKER_TIME_UNIT").then(|| "milliseconds".to_string())
        };
        let v = EnvSettings::from_lookup(ms).0.single.vtc;
        assert_eq!((v.window_ms, v.bucket_ms), (5, 1));
        let bad =
            |k: &str| (k == "AIBRIX_ROUTER_VTC_TOKEN_TRACKER_TIME_UNIT").then(|| "hours".into());
        let (s, warnings) = EnvSettings::from_lookup(bad);
        assert_eq!(s.single.vtc.window_ms, 300_000);
        assert!(warnings[0].contains("hours"), "{warnings:?}");
    }
}
