//! The `AIBRIX_EXTERNAL_ROUTER_*` settings, read and validated as AIBrix's gateway does: an
//! enabled configuration that does not hold together stops pd-control at start.

use std::time::Duration;

use reqwest::Url;

/// The external router's knobs as given (flag or AIBrix's environment variable), unparsed so
/// that a bad value is reported the way AIBrix reports it.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ExternalArgs {
    /// The external replica router's complete operation URL (http or https, verified against
    /// the system's roots); unset disables
    /// the `external` strategy.
    #[arg(
        long = "external-router-endpoint",
        env = "AIBRIX_EXTERNAL_ROUTER_ENDPOINT",
        value_name = "URL"
    )]
    pub endpoint: Option<String>,
    /// `Advisory` or `Authoritative` (required with an endpoint).
    #[arg(
        long = "external-router-policy-mode",
        env = "AIBRIX_EXTERNAL_ROUTER_POLICY_MODE",
        value_name = "MODE"
    )]
    pub policy_mode: Option<String>,
    /// `FailOpen` or `FailClosed` (required with an endpoint).
    #[arg(
        long = "external-router-failure-mode",
        env = "AIBRIX_EXTERNAL_ROUTER_FAILURE_MODE",
        value_name = "MODE"
    )]
    pub failure_mode: Option<String>,
    /// The local strategy for `NoDecision` and, failing open, for failures.
    #[arg(
        long = "external-router-fallback",
        env = "AIBRIX_EXTERNAL_ROUTER_FALLBACK",
        value_name = "STRATEGY"
    )]
    pub fallback: Option<String>,
    /// Deadline of one decision exchange (default 10ms).
    #[arg(
        long = "external-router-timeout",
        env = "AIBRIX_EXTERNAL_ROUTER_TIMEOUT",
        value_name = "DURATION"
    )]
    pub timeout: Option<String>,
    /// Exchanges in flight at once before further requests are refused locally (default 256).
    #[arg(
        long = "external-router-max-inflight",
        env = "AIBRIX_EXTERNAL_ROUTER_MAX_INFLIGHT",
        value_name = "N"
    )]
    pub max_inflight: Option<String>,
    /// Largest encoded decision request (default 256KiB).
    #[arg(
        long = "external-router-max-request-bytes",
        env = "AIBRIX_EXTERNAL_ROUTER_MAX_REQUEST_BYTES",
        value_name = "BYTES"
    )]
    pub max_request_bytes: Option<String>,
    /// Largest decision response read (default 64KiB).
    #[arg(
        long = "external-router-max-response-bytes",
        env = "AIBRIX_EXTERNAL_ROUTER_MAX_RESPONSE_BYTES",
        value_name = "BYTES"
    )]
    pub max_response_bytes: Option<String>,
    /// Consecutive failed exchanges that open the circuit (default 5).
    #[arg(
        long = "external-router-failure-threshold",
        env = "AIBRIX_EXTERNAL_ROUTER_FAILURE_THRESHOLD",
        value_name = "N"
    )]
    pub failure_threshold: Option<String>,
    /// How long the circuit stays open before one probe (default 1s).
    #[arg(
        long = "external-router-open-duration",
        env = "AIBRIX_EXTERNAL_ROUTER_OPEN_DURATION",
        value_name = "DURATION"
    )]
    pub open_duration: Option<String>,
    /// A file holding the bearer token sent to the service, read once at start.
    #[arg(
        long = "external-router-auth-token-file",
        env = "AIBRIX_EXTERNAL_ROUTER_AUTH_TOKEN_FILE",
        value_name = "FILE"
    )]
    pub auth_token_file: Option<String>,
    /// Pod-label keys sent as candidate attributes (comma-separated).
    #[arg(
        long = "external-router-candidate-attributes",
        env = "AIBRIX_EXTERNAL_ROUTER_CANDIDATE_ATTRIBUTES",
        value_name = "KEYS"
    )]
    pub candidate_attributes: Option<String>,
    /// `runningRequests`, `engineUtilization`, `kvCacheUsage` (comma-separated).
    #[arg(
        long = "external-router-candidate-metrics",
        env = "AIBRIX_EXTERNAL_ROUTER_CANDIDATE_METRICS",
        value_name = "NAMES"
    )]
    pub candidate_metrics: Option<String>,
    /// Trusted in-process policy attribute names (validated; pd-router has no such source).
    #[arg(
        long = "external-router-policy-attributes",
        env = "AIBRIX_EXTERNAL_ROUTER_POLICY_ATTRIBUTES",
        value_name = "NAMES"
    )]
    pub policy_attributes: Option<String>,
}

/// Strategies a fallback may name: AIBrix's registered routers that need no dedicated
/// preprocessing, which pd-router serves to a standard pod (`pd`, `slo*` and `external` itself
/// are not among them).
pub const FALLBACK_STRATEGIES: &[&str] = &[
    "random",
    "least-request",
    "throughput",
    "prefix-cache",
    "least-kv-cache",
    "least-gpu-cache",
    "least-latency",
    "session-affinity",
    "power-of-two",
    "load-balance",
    "least-request-top-k",
    "lora-affinity",
    "vtc-basic",
    "least-utilization",
    "least-busy-time",
    "prefix-cache-preble",
];

/// Candidate metrics the protocol defines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CandidateMetrics {
    pub running_requests: bool,
    pub engine_utilization: bool,
    pub kv_cache_usage: bool,
}

/// A validated, enabled external router configuration.
#[derive(Debug, Clone)]
pub struct ExternalConfig {
    pub endpoint: Url,
    pub advisory: bool,
    pub fail_open: bool,
    /// Empty only for Authoritative with FailClosed, which never falls back.
    pub fallback: String,
    pub timeout: Duration,
    pub max_inflight: usize,
    pub max_request_bytes: usize,
    pub max_response_bytes: usize,
    pub failure_threshold: u32,
    pub open_duration: Duration,
    pub bearer_token: Option<String>,
    /// Sorted label keys.
    pub candidate_attributes: Vec<String>,
    pub candidate_metrics: CandidateMetrics,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ExternalConfigError {
    #[error("AIBRIX_EXTERNAL_ROUTER_ENDPOINT must be a complete absolute URL")]
    Endpoint,
    #[error("AIBRIX_EXTERNAL_ROUTER_ENDPOINT scheme must be http or https")]
    Scheme,
    #[error("AIBRIX_EXTERNAL_ROUTER_ENDPOINT must not contain userinfo or fragment")]
    UserinfoOrFragment,
    #[error("AIBRIX_EXTERNAL_ROUTER_POLICY_MODE must be Advisory or Authoritative")]
    PolicyMode,
    #[error("AIBRIX_EXTERNAL_ROUTER_FAILURE_MODE must be FailOpen or FailClosed")]
    FailureMode,
    #[error("authoritative external routing requires FailClosed")]
    AuthoritativeFailOpen,
    #[error("AIBRIX_EXTERNAL_ROUTER_FALLBACK is required for Advisory or FailOpen")]
    FallbackRequired,
    #[error("AIBRIX_EXTERNAL_ROUTER_FALLBACK {0:?} is not a local non-exclusive strategy")]
    Fallback(String),
    #[error("{0} must be a positive duration")]
    Duration(&'static str),
    #[error("{0} must be a positive integer")]
    Integer(&'static str),
    #[error("{0} must be a positive byte size")]
    Bytes(&'static str),
    #[error("{0}: {1}")]
    Allowlist(&'static str, String),
    #[error("AIBRIX_EXTERNAL_ROUTER_CANDIDATE_METRICS contains unsupported metric {0:?}")]
    Metric(String),
    #[error("read AIBRIX_EXTERNAL_ROUTER_AUTH_TOKEN_FILE: {0}")]
    TokenFile(String),
    #[error("AIBRIX_EXTERNAL_ROUTER_AUTH_TOKEN_FILE contains an empty token")]
    EmptyToken,
    #[error("AIBRIX_EXTERNAL_ROUTER_AUTH_TOKEN_FILE contains an invalid token")]
    InvalidToken,
}

impl ExternalArgs {
    /// The enabled configuration, `None` without an endpoint (the strategy is then refused),
    /// or why an enabled one is invalid. `read_file` reads the token file.
    pub fn resolve(
        &self,
        read_file: impl Fn(&str) -> std::io::Result<String>,
    ) -> Result<Option<ExternalConfig>, ExternalConfigError> {
        use ExternalConfigError as E;
        let text = |v: &Option<String>| v.as_deref().map(str::trim).unwrap_or_default().to_string();
        let raw = text(&self.endpoint);
        if raw.is_empty() {
            return Ok(None);
        }
        let endpoint = Url::parse(&raw).map_err(|_| E::Endpoint)?;
        if endpoint.cannot_be_a_base() || endpoint.host_str().is_none_or(str::is_empty) {
            return Err(E::Endpoint);
        }
        if endpoint.scheme() != "http" && endpoint.scheme() != "https" {
            return Err(E::Scheme);
        }
        if !endpoint.username().is_empty()
            || endpoint.password().is_some()
            || endpoint.fragment().is_some()
        {
            return Err(E::UserinfoOrFragment);
        }
        let advisory = match text(&self.policy_mode).as_str() {
            "Advisory" => true,
            "Authoritative" => false,
            _ => return Err(E::PolicyMode),
        };
        let fail_open = match text(&self.failure_mode).as_str() {
            "FailOpen" => true,
            "FailClosed" => false,
            _ => return Err(E::FailureMode),
        };
        if !advisory && fail_open {
            return Err(E::AuthoritativeFailOpen);
        }
        let fallback = text(&self.fallback);
        if !fallback.is_empty() && !FALLBACK_STRATEGIES.contains(&fallback.as_str()) {
            return Err(E::Fallback(fallback));
        }
        if (advisory || fail_open) && fallback.is_empty() {
            return Err(E::FallbackRequired);
        }
        let duration = |v: &Option<String>, key, default| match text(v).as_str() {
            "" => Ok(default),
            s => crate::config::parse_duration(s)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or(E::Duration(key)),
        };
        let integer = |v: &Option<String>, key, default: u64| match text(v).as_str() {
            "" => Ok(default),
            s => s
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or(E::Integer(key)),
        };
        let bytes = |v: &Option<String>, key, default| match text(v).as_str() {
            "" => Ok(default),
            s => byte_size(s).ok_or(E::Bytes(key)),
        };
        let timeout = duration(
            &self.timeout,
            "AIBRIX_EXTERNAL_ROUTER_TIMEOUT",
            Duration::from_millis(10),
        )?;
        let open_duration = duration(
            &self.open_duration,
            "AIBRIX_EXTERNAL_ROUTER_OPEN_DURATION",
            Duration::from_secs(1),
        )?;
        let max_inflight = integer(
            &self.max_inflight,
            "AIBRIX_EXTERNAL_ROUTER_MAX_INFLIGHT",
            256,
        )?;
        let failure_threshold = integer(
            &self.failure_threshold,
            "AIBRIX_EXTERNAL_ROUTER_FAILURE_THRESHOLD",
            5,
        )?;
        let max_request_bytes = bytes(
            &self.max_request_bytes,
            "AIBRIX_EXTERNAL_ROUTER_MAX_REQUEST_BYTES",
            256 * 1024,
        )?;
        let max_response_bytes = bytes(
            &self.max_response_bytes,
            "AIBRIX_EXTERNAL_ROUTER_MAX_RESPONSE_BYTES",
            64 * 1024,
        )?;
        let candidate_attributes = allowlist(&text(&self.candidate_attributes))
            .map_err(|e| E::Allowlist("AIBRIX_EXTERNAL_ROUTER_CANDIDATE_ATTRIBUTES", e))?;
        allowlist(&text(&self.policy_attributes))
            .map_err(|e| E::Allowlist("AIBRIX_EXTERNAL_ROUTER_POLICY_ATTRIBUTES", e))?;
        let mut candidate_metrics = CandidateMetrics::default();
        for name in allowlist(&text(&self.candidate_metrics))
            .map_err(|e| E::Allowlist("AIBRIX_EXTERNAL_ROUTER_CANDIDATE_METRICS", e))?
        {
            match name.as_str() {
                "runningRequests" => candidate_metrics.running_requests = true,
                "engineUtilization" => candidate_metrics.engine_utilization = true,
                "kvCacheUsage" => candidate_metrics.kv_cache_usage = true,
                _ => return Err(E::Metric(name)),
            }
        }
        let bearer_token = match text(&self.auth_token_file).as_str() {
            "" => None,
            path => {
                let token = read_file(path).map_err(|e| E::TokenFile(e.to_string()))?;
                let token = token.trim().to_string();
                if token.is_empty() {
                    return Err(E::EmptyToken);
                }
                if token.len() > 8192 || token.contains(['\r', '\n']) {
                    return Err(E::InvalidToken);
                }
                Some(token)
            }
        };
        Ok(Some(ExternalConfig {
            endpoint,
            advisory,
            fail_open,
            fallback,
            timeout,
            max_inflight: usize::try_from(max_inflight).unwrap_or(usize::MAX),
            max_request_bytes,
            max_response_bytes,
            failure_threshold: u32::try_from(failure_threshold).unwrap_or(u32::MAX),
            open_duration,
            bearer_token,
            candidate_attributes,
            candidate_metrics,
        }))
    }
}

/// `N`, `NKiB` or `NMiB`, positive.
fn byte_size(text: &str) -> Option<usize> {
    let (number, factor) = if let Some(n) = text.strip_suffix("KiB") {
        (n, 1024)
    } else if let Some(n) = text.strip_suffix("MiB") {
        (n, 1024 * 1024)
    } else {
        (text, 1)
    };
    let value: usize = number.trim().parse().ok().filter(|v| *v > 0)?;
    value.checked_mul(factor).filter(|v| *v <= 1 << 40)
}

/// A key is a letter, then up to 127 of letters, digits and `_./-`.
fn valid_key(key: &str) -> bool {
    let mut chars = key.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && key.len() <= 128
        && chars.all(|c| c.is_ascii_alphanumeric() || "_./-".contains(c))
}

/// A comma-separated list of keys: each valid, none repeated, at most 32; sorted.
fn allowlist(raw: &str) -> Result<Vec<String>, String> {
    if raw.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut out: Vec<String> = Vec::new();
    for item in raw.split(',').map(str::trim) {
        if !valid_key(item) {
            return Err(format!("invalid name {item:?}"));
        }
        if out.iter().any(|k| k == item) {
            return Err(format!("duplicate name {item:?}"));
        }
        out.push(item.to_string());
    }
    if out.len() > 32 {
        return Err("allowlist contains more than 32 names".into());
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(pairs: &[(&str, &str)]) -> ExternalArgs {
        let mut a = ExternalArgs::default();
        for (k, v) in pairs {
            let v = Some(v.to_string());
            match *k {
                "endpoint" => a.endpoint = v,
                "policy" => a.policy_mode = v,
                "failure" => a.failure_mode = v,
                "fallback" => a.fallback = v,
                "timeout" => a.timeout = v,
                "inflight" => a.max_inflight = v,
                "request" => a.max_request_bytes = v,
                "metrics" => a.candidate_metrics = v,
                "attributes" => a.candidate_attributes = v,
                "token" => a.auth_token_file = v,
                other => panic!("{other}"),
            }
        }
        a
    }

    fn resolve(pairs: &[(&str, &str)]) -> Result<Option<ExternalConfig>, ExternalConfigError> {
        args(pairs).resolve(|path| match path {
            "/token" => Ok(" secret \n".into()),
            "/empty" => Ok("\n".into()),
            _ => Err(std::io::Error::other("no such file")),
        })
    }

    const ADVISORY: [(&str, &str); 4] = [
        ("endpoint", "http://router.svc:8080/v1alpha1/select"),
        ("policy", "Advisory"),
        ("failure", "FailOpen"),
        ("fallback", "least-request"),
    ];

    #[test]
    fn no_endpoint_disables_and_a_full_advisory_config_takes_aibrix_defaults() {
        assert!(resolve(&[]).unwrap().is_none());
        let c = resolve(&ADVISORY).unwrap().unwrap();
        assert!(c.advisory && c.fail_open);
        assert_eq!(c.timeout, Duration::from_millis(10));
        assert_eq!((c.max_inflight, c.failure_threshold), (256, 5));
        assert_eq!(
            (c.max_request_bytes, c.max_response_bytes),
            (256 * 1024, 64 * 1024)
        );
        assert_eq!(c.open_duration, Duration::from_secs(1));
        assert_eq!(c.bearer_token, None);
    }

    #[test]
    fn settings_that_do_not_hold_together_are_refused() {
        use ExternalConfigError as E;
        let with = |extra: &[(&str, &str)]| {
            let mut pairs = ADVISORY.to_vec();
            for (k, v) in extra {
                pairs.retain(|(key, _)| key != k);
                pairs.push((k, v));
            }
            resolve(&pairs).err()
        };
        assert_eq!(with(&[("endpoint", "router:8080")]), Some(E::Endpoint));
        assert_eq!(with(&[("endpoint", "ftp://r/x")]), Some(E::Scheme));
        assert_eq!(
            with(&[("endpoint", "http://u:p@r/x")]),
            Some(E::UserinfoOrFragment)
        );
        assert_eq!(
            with(&[("endpoint", "http://r/x#f")]),
            Some(E::UserinfoOrFragment)
        );
        assert_eq!(with(&[("policy", "advisory")]), Some(E::PolicyMode));
        assert_eq!(with(&[("failure", "Open")]), Some(E::FailureMode));
        assert_eq!(
            with(&[("policy", "Authoritative")]),
            Some(E::AuthoritativeFailOpen)
        );
        assert_eq!(with(&[("fallback", "")]), Some(E::FallbackRequired));
        for bad in ["pd", "external", "slo", "nope"] {
            assert_eq!(with(&[("fallback", bad)]), Some(E::Fallback(bad.into())));
        }
        assert!(matches!(with(&[("timeout", "0s")]), Some(E::Duration(_))));
        assert!(matches!(with(&[("inflight", "-1")]), Some(E::Integer(_))));
        assert!(matches!(with(&[("request", "1GiB")]), Some(E::Bytes(_))));
        assert_eq!(with(&[("metrics", "cpu")]), Some(E::Metric("cpu".into())));
        assert!(matches!(
            with(&[("attributes", "zone,zone")]),
            Some(E::Allowlist(..))
        ));
        assert_eq!(with(&[("token", "/empty")]), Some(E::EmptyToken));
        assert!(matches!(
            with(&[("token", "/missing")]),
            Some(E::TokenFile(_))
        ));
    }

    #[test]
    fn authoritative_fail_closed_needs_no_fallback_and_reads_its_lists() {
        let c = resolve(&[
            ("endpoint", "https://router/select"),
            ("policy", "Authoritative"),
            ("failure", "FailClosed"),
            ("timeout", "25ms"),
            ("request", "2KiB"),
            ("metrics", "kvCacheUsage, runningRequests"),
            ("attributes", "zone,topology.kubernetes.io/zone"),
            ("token", "/token"),
        ])
        .unwrap()
        .unwrap();
        assert!(!c.advisory && !c.fail_open && c.fallback.is_empty());
        assert_eq!(
            (c.timeout, c.max_request_bytes),
            (Duration::from_millis(25), 2048)
        );
        assert!(c.candidate_metrics.running_requests && c.candidate_metrics.kv_cache_usage);
        assert!(!c.candidate_metrics.engine_utilization);
        assert_eq!(
            c.candidate_attributes,
            ["topology.kubernetes.io/zone", "zone"]
        );
        assert_eq!(c.bearer_token.as_deref(), Some("secret"));
    }
}
