//! The error catalogue: every request the filter refuses gets a status, the `x-error-*` header
//! AIBrix operators already alert on, an OpenAI-style JSON body, and a metric reason.

use serde_json::json;

/// Of a failed call's answer, only this much is read: it is logged and quoted (256
/// characters), and classified by its first bytes.
pub const ERROR_BODY_READ_BYTES: usize = 4096;

/// `text` (a client's or a pod's) fit for one log line: control characters escaped, so a
/// model name holding a newline cannot forge a line, and cut after 256 characters, so an 8 MiB
/// name does not make an 8 MiB line.
pub fn loggable(text: &str) -> String {
    const MAX_CHARS: usize = 256;
    let mut out = String::with_capacity(text.len().min(MAX_CHARS + 16));
    for (i, c) in text.chars().enumerate() {
        if i == MAX_CHARS {
            out.push_str(&format!("... ({} bytes)", text.len()));
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// A refusal that becomes a local reply.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    /// `AIBRIX_AUTH_BEARER_TOKEN` is set and the request does not carry it.
    #[error("Incorrect API key provided")]
    Unauthorized,
    #[error("error processing request body")]
    BadBody,
    /// The body is larger than the plugin's `max_request_body_bytes`.
    #[error("request body exceeds {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// The body's top-level object has more members than `json_object::MAX_BODY_MEMBERS`:
    /// each one costs an index entry that a PD request keeps while its prefill runs. A body
    /// refusal like any other (400, `x-error-request-body-processing`), naming the limit.
    #[error("request body has more than {limit} top-level members")]
    TooManyMembers { limit: usize },
    #[error("no messages in the request body")]
    NoMessages,
    #[error("unknown request path")]
    UnknownPath,
    /// A member the endpoint requires is missing or of the wrong kind (AIBrix's messages for
    /// the Responses API's `model` and `input`).
    #[error("{message}")]
    MissingField {
        message: &'static str,
        param: &'static str,
    },
    /// A known path the model's prefill/decode pairs cannot serve (`Engine::serves_pd`).
    #[error("{path} is not served by {engine} prefill/decode pairs")]
    PathNotForEngine {
        path: &'static str,
        engine: &'static str,
    },
    #[error("model {0} does not exist")]
    UnknownModel(String),
    #[error("error on getting pods for model {0}")]
    NoRoutablePods(String),
    #[error("incorrect routing strategy {0}")]
    BadStrategy(String),
    /// Selection found nothing routable: incomplete rolesets, no combined pod, and so on.
    /// As AIBrix, the client gets the fixed message and the log gets `detail`, which may name
    /// pods and engines a client has no business learning.
    #[error("error on selecting target pod")]
    Selection { detail: String },
    #[error("pd-router has not received a fleet snapshot yet")]
    NoSnapshot,
    /// The address about to become an upstream (the destination header, a prefill or side
    /// call) is not a pod of the current fleet snapshot. Selection only ever picks fleet pods,
    /// so this is a last line of defence: no code path may let anything else steer
    /// ORIGINAL_DST. The address stays in the logs, not in the reply.
    #[error("routing target is not a pod of the current fleet")]
    TargetOutsideFleet(String),
    /// The prefill leg failed; `status` is the prefill's own 4xx/5xx, or 502/503/504.
    #[error("prefill request failed ({class}): {detail}")]
    Prefill {
        status: u32,
        class: &'static str,
        detail: String,
    },
    /// The engine refused the body's shape before any selection (SGLang's validation).
    #[error("{0}")]
    InvalidRequest(String),
    /// The decode watchdog fired before any response header reached the client.
    #[error("{0}")]
    DecodeTimeout(String),
    #[error("internal error: {0}")]
    Internal(String),
    /// The request's `user` has no record in the user store (AIBrix: the user lookup failed).
    #[error("user {0} is not known")]
    UnknownUser(String),
    /// The user's limits could not be checked: pd-control unreachable or late, or its Redis
    /// failing. `header` is the contract's header for the step that failed (`x-error-user`
    /// for the lookup, `x-error-incr-rpm` for the counters).
    #[error("user limits cannot be checked: {detail}")]
    UserLimitsUnavailable {
        header: &'static str,
        detail: String,
    },
    /// AIBrix's message, word for word: clients and alerts may match it.
    #[error("user: {user} has exceeded RPM: {limit}")]
    RpmExceeded { user: String, limit: i64 },
    #[error("user: {user} has exceeded TPM: {limit}")]
    TpmExceeded { user: String, limit: i64 },
    /// The model's profile limits its requests per second (`requestsPerSecond`).
    #[error("model: {model} has exceeded RPS: {rps}")]
    ModelRpsExceeded { model: String, rps: f64 },
    /// A stream for a rate-limited user must end with its usage, or its tokens could not be
    /// counted against the user's TPM.
    #[error("include usage for stream options not set")]
    StreamUsageRequired,
    /// The `external` strategy's service, in Authoritative mode, refused the request
    /// (AIBrix's fixed answer; the service's reason stays in pd-control's log).
    #[error("external routing policy denied")]
    ExternalDenied,
    /// The `external` strategy's service could not decide and the configuration fails closed
    /// (or has no usable fallback). `detail` (the failure's outcome) stays in the log.
    #[error("external router unavailable")]
    ExternalUnavailable { detail: String },
    /// Waiting for a callout (a prefill leg, `/server_info`, an admission, the external
    /// router), the request would have pushed the bodies this VM holds past the plugin's
    /// `max_held_body_bytes` (`core::held_body`). A 503 of the gateway's own load, with the
    /// header of the filter's other gateway-side 503s (no snapshot, a target outside the
    /// fleet): the contract has no header of its own for it.
    #[error("the gateway is holding its limit of request bodies ({limit} bytes per worker) waiting for engines; retry later")]
    HeldBodiesOverBudget { limit: usize },
}

/// How Envoy's own answer to a callout it could not deliver (connection refused, reset
/// before any header) begins; Envoy answers it as a 503.
const ENVOY_UNDELIVERED: &[u8] = b"upstream connect error or disconnect/reset before headers";
/// How Envoy's own 504 for a callout that outlived its timeout begins.
const ENVOY_TIMED_OUT: &[u8] = b"upstream request timeout";
/// Envoy's body when its cluster has no endpoint to send to (a DNS cluster between
/// resolutions, a Service with no ready pod).
const ENVOY_NO_HOST: &[u8] = b"no healthy upstream";

/// Whether a callout's `status` and `body` are Envoy's own for a call that reached no
/// process at all (no connection, no endpoint; `status` empty: no answer of any kind), not
/// the called service's answer. A call that timed out is not one: the service may have taken
/// it and be slow (pd-control waiting on a hung Redis), which is its answer's business.
pub fn callout_unanswered(status: &str, body: &[u8]) -> bool {
    match status {
        "" => true,
        "503" => body.starts_with(ENVOY_UNDELIVERED) || body.starts_with(ENVOY_NO_HOST),
        _ => false,
    }
}

/// Whether a callout's `status` and `body` are Envoy's answer for a cluster with no endpoint
/// to send to: the call never left the gateway.
pub fn callout_found_no_host(status: &str, body: &[u8]) -> bool {
    status == "503" && body.starts_with(ENVOY_NO_HOST)
}

impl RouteError {
    /// The refusal for a prefill leg that answered `status` (not 200) with `body`. The pod's
    /// own 4xx/5xx passes through; a callout Envoy could not deliver is the pod's transport
    /// failing, a 502 (`error`), not the 503 "overloaded" Envoy synthesises; an unparsable or
    /// 499 status is a 502 too.
    /// A side call Envoy failed after the pod began its answer: the stream was reset
    /// mid-answer, or the answer outgrew Envoy's async-client buffer
    /// (`http.async_response_buffer_limit`, 32 MB by default). `leg`: which call.
    pub fn leg_call_failed(leg: &str) -> RouteError {
        RouteError::Prefill {
            status: 502,
            class: "error",
            detail: format!(
                "the {leg} call failed after its answer began (reset mid-answer, or over \
                 Envoy's async-client response buffer limit)"
            ),
        }
    }

    pub fn prefill_answer(status: &str, body: &[u8], class: &'static str) -> RouteError {
        // AIBrix's cut: 256 characters, marked.
        let text = String::from_utf8_lossy(body);
        let mut detail: String = text.chars().take(256).collect();
        if detail.len() < text.len() {
            detail.push_str("...");
        }
        if status == "503" && body.starts_with(ENVOY_UNDELIVERED) {
            return RouteError::Prefill {
                status: 502,
                class: "error",
                detail,
            };
        }
        let status = status
            .parse::<u32>()
            .ok()
            .filter(|c| (400..=599).contains(c) && *c != 499)
            .unwrap_or(502);
        RouteError::Prefill {
            status,
            class,
            detail,
        }
    }

    /// AIBrix's class of a failed SGLang prefill leg, as `gateway_pd_decode_abort_total`
    /// labels the abort it causes: `transport` (no answer: refused, reset before headers),
    /// `timeout` (Envoy gave up waiting), `http_status` (the pod answered an error).
    pub fn prefill_failure_class(status: &str, body: &[u8]) -> &'static str {
        match status {
            "" => "transport",
            "503" if body.starts_with(ENVOY_UNDELIVERED) => "transport",
            "504" if body.starts_with(ENVOY_TIMED_OUT) => "timeout",
            _ => "http_status",
        }
    }

    /// Whether a failed prefill leg may be routed again without its pod (prefill failover):
    /// the pod was never reached, or it answered one of `statuses` (the plugin's
    /// `prefill_failover_statuses`). Never after a timeout: the pod may still be working, and
    /// the client has waited one timeout already.
    pub fn prefill_fails_over(status: &str, body: &[u8], statuses: &[u16]) -> bool {
        match Self::prefill_failure_class(status, body) {
            "transport" => true,
            "http_status" => status.parse::<u16>().is_ok_and(|s| statuses.contains(&s)),
            _ => false,
        }
    }

    /// What the log adds to the client's message: the selection's reason, the address the
    /// guard refused.
    pub fn detail(&self) -> Option<&str> {
        match self {
            RouteError::Selection { detail }
            | RouteError::TargetOutsideFleet(detail)
            | RouteError::ExternalUnavailable { detail } => Some(detail),
            _ => None,
        }
    }

    pub fn status(&self) -> u32 {
        match self {
            RouteError::Unauthorized => 401,
            RouteError::BadBody | RouteError::NoMessages | RouteError::MissingField { .. } => 400,
            RouteError::BodyTooLarge { .. } => 413,
            RouteError::TooManyMembers { .. } => 400,
            RouteError::HeldBodiesOverBudget { .. } => 503,
            RouteError::UnknownPath | RouteError::PathNotForEngine { .. } => 501,
            RouteError::UnknownModel(_) | RouteError::BadStrategy(_) => 400,
            RouteError::NoRoutablePods(_)
            | RouteError::Selection { .. }
            | RouteError::NoSnapshot
            | RouteError::TargetOutsideFleet(_) => 503,
            RouteError::Prefill { status, .. } => *status,
            RouteError::InvalidRequest(_) => 400,
            RouteError::DecodeTimeout(_) => 504,
            RouteError::Internal(_)
            | RouteError::UnknownUser(_)
            | RouteError::UserLimitsUnavailable { .. } => 500,
            RouteError::RpmExceeded { .. }
            | RouteError::TpmExceeded { .. }
            | RouteError::ModelRpsExceeded { .. } => 429,
            RouteError::StreamUsageRequired => 400,
            RouteError::ExternalDenied => 403,
            RouteError::ExternalUnavailable { .. } => 503,
        }
    }

    /// The `x-error-*` header of the contract, name and value; the contract names none for
    /// a refused API key.
    pub fn header(&self) -> Option<(&'static str, String)> {
        let header = match self {
            RouteError::Unauthorized => return None,
            RouteError::BadBody
            | RouteError::BodyTooLarge { .. }
            | RouteError::TooManyMembers { .. }
            | RouteError::NoMessages
            | RouteError::MissingField { .. }
            | RouteError::UnknownPath => ("x-error-request-body-processing", "true".into()),
            RouteError::UnknownModel(model) => {
                ("x-error-no-model-backends", sanitize_header(model))
            }
            RouteError::NoRoutablePods(_) => ("x-error-no-model-backends", "true".into()),
            RouteError::BadStrategy(_)
            | RouteError::PathNotForEngine { .. }
            | RouteError::Selection { .. }
            | RouteError::NoSnapshot
            | RouteError::TargetOutsideFleet(_)
            | RouteError::InvalidRequest(_)
            | RouteError::ExternalDenied
            | RouteError::ExternalUnavailable { .. }
            | RouteError::HeldBodiesOverBudget { .. } => ("x-error-routing", "true".into()),
            RouteError::Prefill { .. } => ("x-error-pd-prefill", "true".into()),
            RouteError::DecodeTimeout(_) => ("x-error-pd-decode", "true".into()),
            RouteError::Internal(_) => ("x-error-internal", "true".into()),
            RouteError::UnknownUser(_) => ("x-error-user", "true".into()),
            RouteError::UserLimitsUnavailable { header, .. } => (*header, "true".into()),
            RouteError::RpmExceeded { .. } => ("x-error-rpm-exceeded", "true".into()),
            RouteError::TpmExceeded { .. } => ("x-error-tpm-exceeded", "true".into()),
            RouteError::ModelRpsExceeded { .. } => ("x-error-model-rps-exceeded", "true".into()),
            RouteError::StreamUsageRequired => (
                "x-error-no-stream-options-include-usage",
                "include usage for stream options not set".into(),
            ),
        };
        Some(header)
    }

    /// Short, stable name used as the metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            RouteError::Unauthorized => "unauthorized",
            RouteError::BadBody => "bad_body",
            RouteError::BodyTooLarge { .. } => "body_too_large",
            RouteError::TooManyMembers { .. } => "too_many_members",
            RouteError::HeldBodiesOverBudget { .. } => "held_bodies_over_budget",
            RouteError::NoMessages => "no_messages",
            RouteError::MissingField { .. } => "missing_field",
            RouteError::UnknownPath => "unknown_path",
            RouteError::PathNotForEngine { .. } => "path_not_for_engine",
            RouteError::UnknownModel(_) => "unknown_model",
            RouteError::NoRoutablePods(_) => "no_routable_pods",
            RouteError::BadStrategy(_) => "bad_strategy",
            RouteError::Selection { .. } => "selection",
            RouteError::NoSnapshot => "no_snapshot",
            RouteError::TargetOutsideFleet(_) => "target_outside_fleet",
            RouteError::Prefill { .. } => "prefill",
            RouteError::InvalidRequest(_) => "invalid_request",
            RouteError::DecodeTimeout(_) => "pd_decode_watchdog",
            RouteError::Internal(_) => "internal",
            RouteError::UnknownUser(_) => "unknown_user",
            RouteError::UserLimitsUnavailable { .. } => "user_limits_unavailable",
            RouteError::RpmExceeded { .. } => "rpm_exceeded",
            RouteError::TpmExceeded { .. } => "tpm_exceeded",
            RouteError::ModelRpsExceeded { .. } => "model_rps_exceeded",
            RouteError::StreamUsageRequired => "stream_usage_required",
            RouteError::ExternalDenied => "external_policy_denied",
            RouteError::ExternalUnavailable { .. } => "external_router_unavailable",
        }
    }

    /// All reasons, so the host can define one counter each up front.
    pub const REASONS: [&'static str; 27] = [
        "unauthorized",
        "bad_body",
        "body_too_large",
        "too_many_members",
        "held_bodies_over_budget",
        "no_messages",
        "missing_field",
        "unknown_path",
        "path_not_for_engine",
        "unknown_model",
        "no_routable_pods",
        "bad_strategy",
        "selection",
        "no_snapshot",
        "target_outside_fleet",
        "prefill",
        "invalid_request",
        "pd_decode_watchdog",
        "internal",
        "unknown_user",
        "user_limits_unavailable",
        "rpm_exceeded",
        "tpm_exceeded",
        "stream_usage_required",
        "model_rps_exceeded",
        "external_policy_denied",
        "external_router_unavailable",
    ];

    /// OpenAI error body: `{"error":{"message","type","code","param"}}`.
    pub fn body(&self) -> Vec<u8> {
        let status = self.status();
        let kind = error_type(status);
        let code = match self {
            RouteError::Unauthorized => Some("invalid_api_key"),
            RouteError::UnknownModel(_) => Some("model_not_found"),
            RouteError::RpmExceeded { .. }
            | RouteError::TpmExceeded { .. }
            | RouteError::ModelRpsExceeded { .. } => Some("rate_limit_exceeded"),
            // AIBrix's codes, which its troubleshooting guide tells operators to look for.
            RouteError::ExternalDenied => Some("external_policy_denied"),
            RouteError::ExternalUnavailable { .. } => Some("external_router_unavailable"),
            _ if status == 503 => Some("service_unavailable"),
            _ => None,
        };
        let param = match self {
            RouteError::Unauthorized => Some("api_key"),
            RouteError::UnknownModel(_) => Some("model"),
            RouteError::NoMessages => Some("messages"),
            RouteError::MissingField { param, .. } => Some(*param),
            RouteError::StreamUsageRequired => Some("stream_options"),
            _ => None,
        };
        json!({"error": {"message": self.to_string(), "type": kind, "code": code, "param": param}})
            .to_string()
            .into_bytes()
    }
}

/// A local reply's headers: JSON, the request id, and `header` (the refusal's
/// [`RouteError::header`], if the contract names one).
pub fn reply_headers<'a>(
    header: &'a Option<(&'static str, String)>,
    request_id: &'a str,
) -> Vec<(&'a str, &'a str)> {
    let mut headers = vec![
        ("content-type", "application/json"),
        ("request-id", request_id),
    ];
    if let Some((name, value)) = header {
        headers.push((name, value.as_str()));
    }
    headers
}

/// The OpenAI `error.type` AIBrix gives an error answer of `status`, its own or a pod's.
pub fn error_type(status: u32) -> &'static str {
    match status {
        400 | 404 => "invalid_request_error",
        401 => "authentication_error",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        _ => "api_error",
    }
}

impl From<crate::core::ledger::StoreError> for RouteError {
    fn from(e: crate::core::ledger::StoreError) -> Self {
        RouteError::Internal(e.to_string())
    }
}

/// Header values must not carry control characters (CR/LF would split headers).
pub fn sanitize_header(value: &str) -> String {
    let cleaned: String = value
        .chars()
        .filter(|c| !c.is_control())
        .take(256)
        .collect();
    cleaned
}

/// Like [`sanitize_header`] for longer values: at most `max` bytes, a cut marked with `...`.
pub fn sanitize_header_len(value: &str, max: usize) -> String {
    let mut cleaned: String = value.chars().filter(|c| !c.is_control()).collect();
    if cleaned.len() > max {
        let mut cut = max.saturating_sub(3);
        while !cleaned.is_char_boundary(cut) {
            cut -= 1;
        }
        cleaned.truncate(cut);
        cleaned.push_str("...");
    }
    cleaned
}

#[cfg(test)]
mod tests {

    #[test]
    fn client_text_is_one_bounded_log_line() {
        assert_eq!(loggable("llama-3"), "llama-3");
        assert_eq!(loggable("a\nb\r\u{1b}[31m"), "a\\nb\\r\\u{1b}[31m");
        let long = "x".repeat(10_000);
        let line = loggable(&long);
        assert!(line.starts_with(&"x".repeat(256)) && line.ends_with("... (10000 bytes)"));
        assert!(line.len() < 300);
    }
    use super::*;

    #[test]
    fn prefill_answers_keep_the_pods_status_and_blame_transport_on_502() {
        let undelivered = b"upstream connect error or disconnect/reset before headers. reset reason: remote connection failure";
        let cases: [(&str, &[u8], u32, &str); 6] = [
            ("500", b"{\"error\":1}", 500, "http_error"),
            ("429", b"", 429, "http_error"),
            ("503", b"busy", 503, "http_error"),
            ("503", undelivered, 502, "error"),
            ("499", b"", 502, "http_error"),
            ("abc", b"", 502, "http_error"),
        ];
        for (status, body, code, class) in cases {
            match RouteError::prefill_answer(status, body, "http_error") {
                RouteError::Prefill {
                    status: s,
                    class: c,
                    ..
                } => assert_eq!((s, c), (code, class), "{status}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_long_prefill_answer_is_cut_at_256_characters_and_marked() {
        let long = "é".repeat(300);
        let RouteError::Prefill { detail, .. } =
            RouteError::prefill_answer("500", long.as_bytes(), "http_error")
        else {
            panic!("not a prefill error");
        };
        assert_eq!(detail, format!("{}...", "é".repeat(256)));
        let RouteError::Prefill { detail, .. } =
            RouteError::prefill_answer("500", "é".repeat(256).as_bytes(), "http_error")
        else {
            panic!("not a prefill error");
        };
        assert_eq!(detail, "é".repeat(256), "exactly 256 is not cut");
    }

    #[test]
    fn prefill_failures_get_aibrix_classes() {
        let undelivered = b"upstream connect error or disconnect/reset before headers. reset reason: remote connection failure";
        let cases: [(&str, &[u8], &str); 7] = [
            ("", b"", "transport"),
            ("503", undelivered, "transport"),
            ("504", b"upstream request timeout", "timeout"),
            ("504", b"{\"error\":\"slow\"}", "http_status"),
            ("503", b"busy", "http_status"),
            ("500", b"", "http_status"),
            ("404", b"upstream request timeout", "http_status"),
        ];
        for (status, body, class) in cases {
            assert_eq!(
                RouteError::prefill_failure_class(status, body),
                class,
                "{status}"
            );
        }
    }

    #[test]
    fn prefill_failover_takes_unreachable_pods_and_the_listed_answers() {
        let undelivered = b"upstream connect error or disconnect/reset before headers. reset reason: remote connection failure";
        let listed = [500, 502, 503];
        let cases: [(&str, &[u8], &[u16], bool); 9] = [
            ("", b"", &[], true),
            ("503", undelivered, &[], true),
            ("503", b"busy", &listed, true),
            ("503", b"busy", &[], false),
            ("500", b"{}", &listed, true),
            ("501", b"{}", &listed, false),
            ("504", b"upstream request timeout", &[504], false),
            ("504", b"{}", &[504], true),
            ("400", b"{}", &listed, false),
        ];
        for (status, body, statuses, due) in cases {
            assert_eq!(
                RouteError::prefill_fails_over(status, body, statuses),
                due,
                "{status} {statuses:?}"
            );
        }
    }

    fn body(e: &RouteError) -> serde_json::Value {
        serde_json::from_slice(&e.body()).unwrap()
    }

    #[test]
    fn catalogue_matches_contract() {
        let cases: Vec<(RouteError, u32, &str, &str)> = vec![
            (
                RouteError::BadBody,
                400,
                "x-error-request-body-processing",
                "true",
            ),
            (
                RouteError::TooManyMembers { limit: 1024 },
                400,
                "x-error-request-body-processing",
                "true",
            ),
            (
                RouteError::HeldBodiesOverBudget { limit: 1 << 28 },
                503,
                "x-error-routing",
                "true",
            ),
            (
                RouteError::UnknownPath,
                501,
                "x-error-request-body-processing",
                "true",
            ),
            (
                RouteError::MissingField {
                    message: "'input' is a required property",
                    param: "input",
                },
                400,
                "x-error-request-body-processing",
                "true",
            ),
            (
                RouteError::PathNotForEngine {
                    path: "/v1/messages",
                    engine: "sglang",
                },
                501,
                "x-error-routing",
                "true",
            ),
            (
                RouteError::UnknownModel("m1".into()),
                400,
                "x-error-no-model-backends",
                "m1",
            ),
            (
                RouteError::NoRoutablePods("m1".into()),
                503,
                "x-error-no-model-backends",
                "true",
            ),
            (
                RouteError::BadStrategy("x".into()),
                400,
                "x-error-routing",
                "true",
            ),
            (
                RouteError::Selection { detail: "d".into() },
                503,
                "x-error-routing",
                "true",
            ),
            (
                RouteError::InvalidRequest("dup".into()),
                400,
                "x-error-routing",
                "true",
            ),
            (
                RouteError::TargetOutsideFleet("10.0.0.9:8000".into()),
                503,
                "x-error-routing",
                "true",
            ),
            (RouteError::ExternalDenied, 403, "x-error-routing", "true"),
            (
                RouteError::ExternalUnavailable {
                    detail: "timeout".into(),
                },
                503,
                "x-error-routing",
                "true",
            ),
            (
                RouteError::DecodeTimeout("late".into()),
                504,
                "x-error-pd-decode",
                "true",
            ),
            (
                RouteError::UnknownUser("u".into()),
                500,
                "x-error-user",
                "true",
            ),
            (
                RouteError::UserLimitsUnavailable {
                    header: "x-error-incr-rpm",
                    detail: "redis down".into(),
                },
                500,
                "x-error-incr-rpm",
                "true",
            ),
            (
                RouteError::RpmExceeded {
                    user: "u".into(),
                    limit: 3,
                },
                429,
                "x-error-rpm-exceeded",
                "true",
            ),
            (
                RouteError::TpmExceeded {
                    user: "u".into(),
                    limit: 3,
                },
                429,
                "x-error-tpm-exceeded",
                "true",
            ),
            (
                RouteError::ModelRpsExceeded {
                    model: "m".into(),
                    rps: 0.5,
                },
                429,
                "x-error-model-rps-exceeded",
                "true",
            ),
            (
                RouteError::StreamUsageRequired,
                400,
                "x-error-no-stream-options-include-usage",
                "include usage for stream options not set",
            ),
            (
                RouteError::BodyTooLarge { limit: 8 << 20 },
                413,
                "x-error-request-body-processing",
                "true",
            ),
            (
                RouteError::NoMessages,
                400,
                "x-error-request-body-processing",
                "true",
            ),
            (RouteError::NoSnapshot, 503, "x-error-routing", "true"),
            (
                RouteError::Prefill {
                    status: 502,
                    class: "error",
                    detail: "reset".into(),
                },
                502,
                "x-error-pd-prefill",
                "true",
            ),
            (
                RouteError::Internal("shared data".into()),
                500,
                "x-error-internal",
                "true",
            ),
        ];
        // Every variant but `Unauthorized` (ordinal 0), which has no header (its own test
        // below), once.
        let covered: std::collections::BTreeSet<usize> =
            cases.iter().map(|(e, ..)| ordinal(e)).collect();
        assert_eq!(cases.len(), VARIANTS - 1);
        assert_eq!(covered, (1..VARIANTS).collect());
        for (err, status, header, value) in cases {
            assert_eq!(err.status(), status, "{err:?}");
            assert_eq!(err.header(), Some((header, value.to_string())), "{err:?}");
            assert!(RouteError::REASONS.contains(&err.reason()));
        }
    }

    /// How many variants `RouteError` has: [`ordinal`] gives each its own index below it.
    const VARIANTS: usize = 27;

    /// A variant's index. The match is exhaustive: a variant added to `RouteError` fails to
    /// compile here until it has an index (and [`VARIANTS`] grows, or the index overflows
    /// `one_of_each_is_every_variant`'s table).
    fn ordinal(e: &RouteError) -> usize {
        match e {
            RouteError::Unauthorized => 0,
            RouteError::BadBody => 1,
            RouteError::BodyTooLarge { .. } => 2,
            RouteError::TooManyMembers { .. } => 3,
            RouteError::NoMessages => 4,
            RouteError::UnknownPath => 5,
            RouteError::MissingField { .. } => 6,
            RouteError::PathNotForEngine { .. } => 7,
            RouteError::UnknownModel(_) => 8,
            RouteError::NoRoutablePods(_) => 9,
            RouteError::BadStrategy(_) => 10,
            RouteError::Selection { .. } => 11,
            RouteError::NoSnapshot => 12,
            RouteError::TargetOutsideFleet(_) => 13,
            RouteError::Prefill { .. } => 14,
            RouteError::InvalidRequest(_) => 15,
            RouteError::DecodeTimeout(_) => 16,
            RouteError::Internal(_) => 17,
            RouteError::UnknownUser(_) => 18,
            RouteError::UserLimitsUnavailable { .. } => 19,
            RouteError::RpmExceeded { .. } => 20,
            RouteError::TpmExceeded { .. } => 21,
            RouteError::ModelRpsExceeded { .. } => 22,
            RouteError::StreamUsageRequired => 23,
            RouteError::ExternalDenied => 24,
            RouteError::ExternalUnavailable { .. } => 25,
            RouteError::HeldBodiesOverBudget { .. } => 26,
        }
    }

    /// One value of every variant.
    fn one_of_each() -> Vec<RouteError> {
        vec![
            RouteError::Unauthorized,
            RouteError::BadBody,
            RouteError::BodyTooLarge { limit: 1 },
            RouteError::TooManyMembers { limit: 1 },
            RouteError::NoMessages,
            RouteError::UnknownPath,
            RouteError::MissingField {
                message: "m",
                param: "p",
            },
            RouteError::PathNotForEngine {
                path: "/p",
                engine: "e",
            },
            RouteError::UnknownModel("m".into()),
            RouteError::NoRoutablePods("m".into()),
            RouteError::BadStrategy("s".into()),
            RouteError::Selection { detail: "d".into() },
            RouteError::NoSnapshot,
            RouteError::TargetOutsideFleet("a".into()),
            RouteError::Prefill {
                status: 500,
                class: "http_error",
                detail: "d".into(),
            },
            RouteError::InvalidRequest("i".into()),
            RouteError::DecodeTimeout("t".into()),
            RouteError::Internal("i".into()),
            RouteError::UnknownUser("u".into()),
            RouteError::UserLimitsUnavailable {
                header: "x-error-user",
                detail: "d".into(),
            },
            RouteError::RpmExceeded {
                user: "u".into(),
                limit: 1,
            },
            RouteError::TpmExceeded {
                user: "u".into(),
                limit: 1,
            },
            RouteError::ModelRpsExceeded {
                model: "m".into(),
                rps: 1.0,
            },
            RouteError::StreamUsageRequired,
            RouteError::ExternalDenied,
            RouteError::ExternalUnavailable { detail: "d".into() },
            RouteError::HeldBodiesOverBudget { limit: 1 },
        ]
    }

    #[test]
    fn one_of_each_is_every_variant() {
        let mut seen = [0usize; VARIANTS];
        for e in one_of_each() {
            seen[ordinal(&e)] += 1;
        }
        assert!(seen.iter().all(|n| *n == 1), "variants seen: {seen:?}");
    }

    /// The host defines one `pd_router_rejected_total` counter per entry of `REASONS` up
    /// front: the list must be exactly the reasons the variants give, each once.
    #[test]
    fn reasons_are_every_variants_reason_once() {
        use std::collections::BTreeSet;
        let listed: BTreeSet<&str> = RouteError::REASONS.iter().copied().collect();
        assert_eq!(
            listed.len(),
            RouteError::REASONS.len(),
            "REASONS repeats one"
        );
        let given: BTreeSet<&str> = one_of_each().iter().map(RouteError::reason).collect();
        assert_eq!(
            given.len(),
            VARIANTS,
            "a reason of its own for each variant"
        );
        assert_eq!(listed, given);
    }

    #[test]
    fn rate_limit_refusals_read_as_aibrixs() {
        let b = body(&RouteError::RpmExceeded {
            user: "alice".into(),
            limit: 10,
        });
        assert_eq!(b["error"]["message"], "user: alice has exceeded RPM: 10");
        assert_eq!(b["error"]["type"], "rate_limit_error");
        assert_eq!(b["error"]["code"], "rate_limit_exceeded");
        let b = body(&RouteError::ModelRpsExceeded {
            model: "llama".into(),
            rps: 2.0,
        });
        assert_eq!(b["error"]["message"], "model: llama has exceeded RPS: 2");
        assert_eq!(b["error"]["code"], "rate_limit_exceeded");
        let b = body(&RouteError::StreamUsageRequired);
        assert_eq!(b["error"]["param"], "stream_options");
        assert_eq!(b["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn a_path_the_engine_cannot_pair_names_both() {
        let b = body(&RouteError::PathNotForEngine {
            path: "/v1/messages",
            engine: "trtllm",
        });
        assert_eq!(
            b["error"]["message"],
            "/v1/messages is not served by trtllm prefill/decode pairs"
        );
        assert_eq!(b["error"]["type"], "api_error");
    }

    #[test]
    fn unknown_model_body_is_openai_shaped() {
        let b = body(&RouteError::UnknownModel("llama".into()));
        assert_eq!(b["error"]["message"], "model llama does not exist");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["code"], "model_not_found");
        assert_eq!(b["error"]["param"], "model");
        let b = body(&RouteError::Selection {
            detail: "no complete roleset".into(),
        });
        assert_eq!(b["error"]["code"], "service_unavailable");
        assert_eq!(b["error"]["type"], "overloaded_error");
        assert_eq!(b["error"]["message"], "error on selecting target pod");
        assert!(
            !b.to_string().contains("roleset"),
            "the detail stays in the log: {b}"
        );
    }

    #[test]
    fn a_refused_api_key_is_aibrixs_401_without_an_x_error_header() {
        let e = RouteError::Unauthorized;
        assert_eq!(
            (e.status(), e.header(), e.reason()),
            (401, None, "unauthorized")
        );
        let b = body(&e);
        assert_eq!(
            b,
            json!({"error": {"message": "Incorrect API key provided",
                              "type": "authentication_error", "code": "invalid_api_key",
                              "param": "api_key"}})
        );
    }

    #[test]
    fn the_memory_refusals_name_their_limits() {
        let b = body(&RouteError::TooManyMembers { limit: 1024 });
        assert_eq!(
            b["error"]["message"],
            "request body has more than 1024 top-level members"
        );
        assert_eq!(b["error"]["type"], "invalid_request_error");
        let b = body(&RouteError::HeldBodiesOverBudget { limit: 4096 });
        assert_eq!(b["error"]["type"], "overloaded_error");
        assert_eq!(b["error"]["code"], "service_unavailable");
        assert!(
            b["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("4096 bytes per worker")),
            "{b}"
        );
    }

    #[test]
    fn a_target_outside_the_fleet_does_not_echo_the_address() {
        let e = RouteError::TargetOutsideFleet("10.1.2.3:8000".into());
        let b = body(&e);
        assert_eq!(b["error"]["code"], "service_unavailable");
        assert!(!b.to_string().contains("10.1.2.3"), "{b}");
    }

    #[test]
    fn header_values_are_sanitized() {
        let e = RouteError::UnknownModel("a\r\nx-evil: 1".into());
        assert_eq!(e.header().map(|h| h.1).as_deref(), Some("ax-evil: 1"));
    }
}
