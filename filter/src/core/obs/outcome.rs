//! How a request ended, as the `status` / `status_code` labels of
//! `gateway_request_model_success_total` and `gateway_request_model_fail_total`, and of the
//! prefill-leg counters. Every request gets exactly one outcome.
//!
//! AIBrix labels an outcome with the phase that decided it plus `_success` / `_fail`; the
//! contract names two specific ones (`pd_prefill_failure`, `pd_decode_watchdog`/504).

use crate::core::errors::RouteError;

/// Where a request's fate was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Refused while reading the request headers (unknown path).
    RequestHeadersFail { code: u32 },
    /// Refused after reading the body: bad body, unknown model, no pods, bad strategy,
    /// selection failure, no snapshot.
    RequestBodyFail { code: u32 },
    /// The prefill leg failed; the client got `code`.
    PrefillFailure { code: u32 },
    /// The decode watchdog gave up on the decode pod (504 even when a 200 stream was cut).
    DecodeWatchdog,
    /// The upstream (decode or single pod) answered with `code`.
    Response { code: u32 },
    /// The stream ended without a response (the client went away, or a reset).
    Aborted,
    /// Response headers went out but the body never ended: the pod died or stalled
    /// mid-stream (`code` 502) or the client went away (499). Counted apart from a clean
    /// 200 so a decode pod dying mid-stream shows up as a failure, not a success.
    Cut { code: u32 },
}

/// Why a started response ended without its end of stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutBy {
    Upstream,
    Client,
}

impl CutBy {
    /// Reads Envoy's `response.code_details` (e.g. `downstream_remote_disconnect`,
    /// `upstream_reset_after_response_started{connection_termination}`): the downstream's
    /// words, or its codec's (`http2.remote_reset`: an HTTP/2 client or front proxy reset the
    /// stream, Envoy's `DR` flag; upstream codecs' resets reach these details only as
    /// `upstream_reset_*`), are the client's doing; anything else is the upstream's, the
    /// conservative reading for an operator. A pod wrongly blamed counts towards its ejection.
    pub fn from_code_details(details: &str) -> CutBy {
        const DOWNSTREAM_CODECS: [&str; 3] = ["http1.", "http2.", "http3."];
        if details.contains("downstream")
            || DOWNSTREAM_CODECS.iter().any(|c| details.starts_with(c))
        {
            CutBy::Client
        } else {
            CutBy::Upstream
        }
    }

    pub fn outcome(self) -> Outcome {
        match self {
            CutBy::Upstream => Outcome::Cut { code: 502 },
            CutBy::Client => Outcome::Cut { code: ABORTED_CODE },
        }
    }
}

/// Status label values; `&'static` so the host can key its metric-id cache without copies.
pub const REQUEST_HEADERS_FAIL: &str = "request_headers_fail";
pub const REQUEST_BODY_FAIL: &str = "request_body_fail";
pub const PD_PREFILL_FAILURE: &str = "pd_prefill_failure";
pub const PD_DECODE_WATCHDOG: &str = "pd_decode_watchdog";
pub const RESPONSE_SUCCESS: &str = "response_success";
pub const RESPONSE_FAIL: &str = "response_fail";
pub const RESPONSE_CUT: &str = "response_cut";
/// nginx's "client closed request", AIBrix's `context_canceled` code.
pub const ABORTED_CODE: u32 = 499;

impl Outcome {
    /// The outcome of a local reply for `error`.
    pub fn rejected(error: &RouteError) -> Outcome {
        let code = error.status();
        match error {
            RouteError::UnknownPath | RouteError::Unauthorized => {
                Outcome::RequestHeadersFail { code }
            }
            RouteError::Prefill { .. } => Outcome::PrefillFailure { code },
            _ => Outcome::RequestBodyFail { code },
        }
    }

    /// True for the success counter; a 2xx answer from the pod is a success.
    pub fn is_success(self) -> bool {
        matches!(self, Outcome::Response { code } if (200..300).contains(&code))
    }

    /// How the request's target pod served it, for passive ejection: `Some(true)` for a
    /// 2xx, `Some(false)` for a 5xx (a refused connection is Envoy's 503), a stream the pod
    /// dropped or a decode the watchdog gave up on; `None` where the pod is not to blame
    /// (4xx, the client leaving, the filter refusing before any pod answered).
    pub fn pod_served(self) -> Option<bool> {
        match self {
            Outcome::Response { code } if (200..300).contains(&code) => Some(true),
            Outcome::Response { code } if (500..600).contains(&code) => Some(false),
            Outcome::Cut { code: 502 } | Outcome::DecodeWatchdog => Some(false),
            _ => None,
        }
    }

    /// `(status, status_code)` labels.
    pub fn labels(self) -> (&'static str, u32) {
        match self {
            Outcome::RequestHeadersFail { code } => (REQUEST_HEADERS_FAIL, code),
            Outcome::RequestBodyFail { code } => (REQUEST_BODY_FAIL, code),
            Outcome::PrefillFailure { code } => (PD_PREFILL_FAILURE, code),
            Outcome::DecodeWatchdog => (PD_DECODE_WATCHDOG, 504),
            Outcome::Response { code } if (200..300).contains(&code) => (RESPONSE_SUCCESS, code),
            Outcome::Response { code } => (RESPONSE_FAIL, code),
            Outcome::Aborted => (RESPONSE_FAIL, ABORTED_CODE),
            Outcome::Cut { code } => (RESPONSE_CUT, code),
        }
    }
}

/// How a prefill pod answered its leg (the callout's status), for passive ejection: 200
/// served; a 5xx (Envoy answers a leg it could not deliver or that timed out with its own
/// 503/504) or no status at all failed; anything else is not the pod's fault.
pub fn prefill_served(status: &str) -> Option<bool> {
    match status.parse::<u32>() {
        Ok(200) => Some(true),
        Ok(code) if (500..600).contains(&code) => Some(false),
        Ok(_) => None,
        Err(_) => Some(false),
    }
}

/// `gateway_prefill_request_fail_total` labels of a failed prefill leg, as AIBrix counts it:
/// once as `pd-do-prefill-request-error`/500 (the route step) and once per transport class
/// (`http_error`/<code>, `timeout`/504, `error`/502). A selection failure counts
/// `pd-filter-prefill-decode-pods-fail`/400 instead.
pub fn prefill_fail_labels(error: &RouteError) -> Vec<(&'static str, u32)> {
    match error {
        RouteError::Prefill { .. } => std::iter::once(("pd-do-prefill-request-error", 500))
            .chain(prefill_call_fail_label(error))
            .collect(),
        RouteError::Selection { .. } => vec![("pd-filter-prefill-decode-pods-fail", 400)],
        _ => Vec::new(),
    }
}

/// The one label of [`prefill_fail_labels`] that counts the failed prefill HTTP call itself,
/// by transport class. A call that prefill failover recovered from counts only this: the
/// call failed, the request did not.
pub fn prefill_call_fail_label(error: &RouteError) -> Option<(&'static str, u32)> {
    match error {
        RouteError::Prefill { status, class, .. } => Some(match *class {
            "http_error" if *status == 504 => ("timeout", 504),
            "http_error" => ("http_error", *status),
            _ => ("error", 502),
        }),
        _ => None,
    }
}

/// Labels of `gateway_prefill_request_success_total`.
pub const PREFILL_SUCCESS: (&str, u32) = ("pd-prefill-request-success", 200);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_maps_to_its_phase_and_status() {
        let cases = [
            (RouteError::UnknownPath, REQUEST_HEADERS_FAIL, 501),
            (RouteError::BadBody, REQUEST_BODY_FAIL, 400),
            (RouteError::UnknownModel("m".into()), REQUEST_BODY_FAIL, 400),
            (
                RouteError::Selection { detail: "x".into() },
                REQUEST_BODY_FAIL,
                503,
            ),
            (
                RouteError::Prefill {
                    status: 502,
                    class: "http_error",
                    detail: String::new(),
                },
                PD_PREFILL_FAILURE,
                502,
            ),
        ];
        for (error, status, code) in cases {
            let outcome = Outcome::rejected(&error);
            assert_eq!(outcome.labels(), (status, code), "{error:?}");
            assert!(!outcome.is_success());
        }
    }

    #[test]
    fn responses_split_on_2xx_and_the_watchdog_is_504() {
        assert!(Outcome::Response { code: 200 }.is_success());
        assert_eq!(
            Outcome::Response { code: 200 }.labels(),
            (RESPONSE_SUCCESS, 200)
        );
        assert_eq!(
            Outcome::Response { code: 429 }.labels(),
            (RESPONSE_FAIL, 429)
        );
        assert_eq!(Outcome::Aborted.labels(), (RESPONSE_FAIL, 499));
        assert!(!Outcome::Cut { code: 502 }.is_success());
        assert_eq!(Outcome::DecodeWatchdog.labels(), (PD_DECODE_WATCHDOG, 504));
        assert!(!Outcome::DecodeWatchdog.is_success());
    }

    #[test]
    fn only_the_pods_own_failures_count_against_it() {
        let cases = [
            (Outcome::Response { code: 200 }, Some(true)),
            (Outcome::Response { code: 503 }, Some(false)),
            (Outcome::Response { code: 429 }, None),
            (Outcome::Cut { code: 502 }, Some(false)),
            (Outcome::Cut { code: 499 }, None),
            (Outcome::DecodeWatchdog, Some(false)),
            (Outcome::Aborted, None),
            (Outcome::PrefillFailure { code: 502 }, None),
            (Outcome::RequestBodyFail { code: 503 }, None),
        ];
        for (outcome, verdict) in cases {
            assert_eq!(outcome.pod_served(), verdict, "{outcome:?}");
        }
        let legs = [
            ("200", Some(true)),
            ("503", Some(false)),
            ("404", None),
            ("", Some(false)),
        ];
        for (status, verdict) in legs {
            assert_eq!(prefill_served(status), verdict, "{status:?}");
        }
    }

    #[test]
    fn a_cut_stream_blames_the_side_envoy_names() {
        let cases = [
            ("downstream_remote_disconnect", (RESPONSE_CUT, 499)),
            ("http2.remote_reset", (RESPONSE_CUT, 499)),
            ("http2.remote_refuse", (RESPONSE_CUT, 499)),
            ("http3.remote_reset", (RESPONSE_CUT, 499)),
            ("http1.codec_error", (RESPONSE_CUT, 499)),
            (
                "upstream_reset_after_response_started{connection_termination}",
                (RESPONSE_CUT, 502),
            ),
            (
                "upstream_reset_after_response_started{remote_reset}",
                (RESPONSE_CUT, 502),
            ),
            ("", (RESPONSE_CUT, 502)),
        ];
        for (details, labels) in cases {
            assert_eq!(
                CutBy::from_code_details(details).outcome().labels(),
                labels,
                "{details}"
            );
        }
    }

    #[test]
    fn prefill_failures_count_twice_like_aibrix() {
        let timeout = RouteError::Prefill {
            status: 504,
            class: "http_error",
            detail: String::new(),
        };
        assert_eq!(
            prefill_fail_labels(&timeout),
            vec![("pd-do-prefill-request-error", 500), ("timeout", 504)]
        );
        let dispatch = RouteError::Prefill {
            status: 503,
            class: "dispatch",
            detail: String::new(),
        };
        assert_eq!(prefill_fail_labels(&dispatch)[1], ("error", 502));
        assert_eq!(
            prefill_fail_labels(&RouteError::Selection { detail: "x".into() }),
            vec![("pd-filter-prefill-decode-pods-fail", 400)]
        );
        assert!(prefill_fail_labels(&RouteError::BadBody).is_empty());
    }

    #[test]
    fn a_recovered_prefill_call_counts_its_transport_class_only() {
        let answered = RouteError::Prefill {
            status: 500,
            class: "http_error",
            detail: String::new(),
        };
        assert_eq!(
            prefill_call_fail_label(&answered),
            Some(("http_error", 500))
        );
        assert_eq!(
            prefill_fail_labels(&answered),
            vec![("pd-do-prefill-request-error", 500), ("http_error", 500)]
        );
        let selection = RouteError::Selection { detail: "x".into() };
        assert_eq!(prefill_call_fail_label(&selection), None);
    }
}
