//! AIBrix's rate limits: per user (the `user` header; requests and tokens per minute) and per
//! model (a profile's `requestsPerSecond`). What to ask pd-control, what its admission answer
//! means for a request, and the tokens each answer used, gathered for the report.
//!
//! Stock Envoy wasm cannot talk to Redis, where AIBrix keeps the user records and the
//! counters; pd-control can. So a request naming a user, or of a model whose profile limits
//! its rate, waits for one call to pd-control (`ADMIT_PATH`) before it is routed, and the
//! tokens of a user's answer go back in batches (`USAGE_PATH`) from the VM's tick. Other
//! requests, and every request while pd-control does not check limits, never wait.

use hashbrown::HashMap;
use serde::Deserialize;

use crate::core::errors::RouteError;
use crate::core::obs::usage;

mod refunds;
pub use refunds::{Charge, RefundBook, Refunds, MAX_PENDING_REFUNDS, RELEASE_PATH};

pub const ADMIT_PATH: &str = "/v1/limits/admit";
pub const USAGE_PATH: &str = "/v1/limits/usage";
/// Longest user name sent for admission; pd-control refuses longer ones.
pub const MAX_USER_BYTES: usize = 256;
/// The longest window a model's rate is counted over: a rate below one request per hour
/// admits one request per hour.
pub const MAX_RPS_WINDOW_MS: u64 = 3_600_000;

/// A model's `requestsPerSecond` as a counter: `limit` requests per `window_ms`. A rate of
/// one or more counts whole requests per second (AIBrix's one-second window); a slower rate
/// admits one request per `1/rps` seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelRps {
    pub limit: u64,
    pub window_ms: u64,
}

impl ModelRps {
    pub fn of(rps: f64) -> Option<ModelRps> {
        if !rps.is_finite() || rps <= 0.0 {
            return None;
        }
        if rps >= 1.0 {
            return Some(ModelRps {
                limit: rps.floor().min(u32::MAX as f64) as u64,
                window_ms: 1000,
            });
        }
        let window_ms = ((1000.0 / rps).round() as u64).clamp(1000, MAX_RPS_WINDOW_MS);
        Some(ModelRps {
            limit: 1,
            window_ms,
        })
    }
}

/// The admission request's body (`{"id", "user", "model", "rps_limit", "rps_window_ms"}`).
/// `id` names the admission so that it can be withdrawn ([`cancel_body`]).
pub fn admission_body(id: &str, user: Option<&str>, model: Option<(&str, ModelRps)>) -> Vec<u8> {
    let mut body = serde_json::Map::new();
    if !id.is_empty() {
        body.insert("id".into(), id.into());
    }
    if let Some(user) = user {
        body.insert("user".into(), user.into());
    }
    if let Some((name, rps)) = model {
        body.insert("model".into(), name.into());
        body.insert("rps_limit".into(), rps.limit.into());
        body.insert("rps_window_ms".into(), rps.window_ms.into());
    }
    serde_json::Value::Object(body).to_string().into_bytes()
}

/// Where a withdrawal goes: a path of its own, which a pd-control older than the gateway
/// answers 404 (it would read a withdrawal sent to `ADMIT_PATH` as one more admission).
pub const CANCEL_PATH: &str = "/v1/limits/cancel";

/// The withdrawal of admission `ask` (its admission's body, sent on [`CANCEL_PATH`]), for a
/// request refused without pd-control's answer: pd-control may count it after the filter gave
/// up, or have counted it with the answer still on its way. pd-control's marker of the id
/// makes the withdrawal and the admission, in whichever order Redis runs them, count nothing
/// (its `limits::cancel`); the withdrawal names the same user and model so that it finds
/// their counters.
pub fn cancel_body(ask: &Ask) -> Vec<u8> {
    let model = ask
        .rps
        .and_then(ModelRps::of)
        .map(|r| (ask.model.as_str(), r));
    admission_body(&ask.id, ask.user.as_deref(), model)
}

/// An admission id: 32 hex digits from the VM's generator (seeded from the host's random
/// source), so that two requests, on any worker or gateway, do not share one: one request's
/// withdrawal must not take back another's count.
pub fn admission_id(random: u128) -> String {
    format!("{random:032x}")
}

/// What one admission asks, kept with the waiting request to read the answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    pub user: Option<String>,
    pub model: String,
    /// The model's configured rate, when the admission checks it.
    pub rps: Option<f64>,
    /// The admission's id ([`admission_id`]).
    pub id: String,
}

/// Distinct users one VM gathers between two reports. Beyond it a user's tokens are dropped
/// (and counted): a client inventing names must not grow the VM's memory without bound.
pub const MAX_PENDING_USERS: usize = 4096;

/// pd-control's answer to an admission (`{"outcome": ...}`).
#[derive(Debug, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
enum Answer {
    Admitted {
        rpm: Option<i64>,
        /// The model's count with this request; absent when the model was not counted.
        #[serde(default)]
        model_rps: Option<i64>,
    },
    RpmExceeded {
        rpm_limit: i64,
    },
    TpmExceeded {
        tpm_limit: i64,
    },
    ModelRpsExceeded,
    UnknownUser,
    StoreError {
        stage: String,
        message: String,
    },
    /// pd-control stopped checking limits after the snapshot this VM routes on said it did.
    Disabled,
    /// The id was withdrawn before this admission counted (ids are random: not for a first
    /// admission); read as no answer.
    Cancelled,
}

/// What admission decided for one request.
#[derive(Debug, PartialEq)]
pub enum Verdict {
    /// Go on; `rpm` is the user's request count in the current window, when known;
    /// `charged` the model's rate when the request was counted against it (to be given
    /// back if the request cannot be routed after all).
    Admitted {
        rpm: Option<i64>,
        charged: Option<ModelRps>,
    },
    /// The user is over a limit or unknown: the client gets this refusal.
    Refused(RouteError),
    /// The limits could not be checked; the plugin's `rate_limits_fail_open` decides.
    Unchecked(RouteError),
    /// pd-control was not reached or did not answer (Envoy's own reply to the call); the
    /// plugin's `rate_limits_fail_open_unreachable` decides.
    Unreachable(RouteError),
}

/// Reads pd-control's answer to `ask` (`status` empty when the call got none at all).
pub fn judge(ask: &Ask, status: &str, body: &[u8]) -> Verdict {
    let unchecked = |header: &'static str, detail: String| {
        Verdict::Unchecked(RouteError::UserLimitsUnavailable { header, detail })
    };
    if status != "200" {
        let detail = match status {
            "" => "pd-control did not answer".to_string(),
            other => format!("pd-control answered status {other}"),
        };
        if crate::core::errors::callout_unanswered(status, body) {
            return Verdict::Unreachable(RouteError::UserLimitsUnavailable {
                header: "x-error-user",
                detail,
            });
        }
        return unchecked("x-error-user", detail);
    }
    let answer: Answer = match serde_json::from_slice(body) {
        Ok(answer) => answer,
        Err(e) => return unchecked("x-error-user", format!("unreadable answer: {e}")),
    };
    let user = ask.user.clone().unwrap_or_default();
    match answer {
        Answer::Admitted { rpm, model_rps } => Verdict::Admitted {
            rpm,
            charged: model_rps.and(ask.rps).and_then(ModelRps::of),
        },
        Answer::Disabled => Verdict::Admitted {
            rpm: None,
            charged: None,
        },
        Answer::RpmExceeded { rpm_limit } => Verdict::Refused(RouteError::RpmExceeded {
            user,
            limit: rpm_limit,
        }),
        Answer::TpmExceeded { tpm_limit } => Verdict::Refused(RouteError::TpmExceeded {
            user,
            limit: tpm_limit,
        }),
        Answer::ModelRpsExceeded => Verdict::Refused(RouteError::ModelRpsExceeded {
            model: ask.model.clone(),
            rps: ask.rps.unwrap_or_default(),
        }),
        Answer::UnknownUser => Verdict::Refused(RouteError::UnknownUser(user)),
        Answer::StoreError { stage, message } => {
            // AIBrix's headers, one per step (its `checkLimits`): the lookup's failure is
            // `x-error-user`; reading the request counter `x-error-rpm-exceeded`,
            // incrementing it `x-error-incr-rpm`, reading the token counter
            // `x-error-tpm-exceeded` (all 500); the model counter's `x-error-incr-model-rps`.
            // `counters` (an older pd-control) and stages unknown here: `x-error-incr-rpm`.
            let header = match stage.as_str() {
                "user" => "x-error-user",
                "rpm" => "x-error-rpm-exceeded",
                "tpm" => "x-error-tpm-exceeded",
                "model" => "x-error-incr-model-rps",
                _ => "x-error-incr-rpm",
            };
            unchecked(header, format!("user store ({stage}): {message}"))
        }
        Answer::Cancelled => unchecked("x-error-user", "the admission was withdrawn".into()),
    }
}

/// Whether a request refused after this answer to its admission must withdraw it
/// ([`cancel_body`]): pd-control's answer was not read (no answer in time, Envoy's reply,
/// pd-control cut off), so pd-control may have counted the request, or count it still, and
/// its user and model would lose a request of their windows for nothing. Not when Envoy found
/// no pd-control to send the admission to: it never arrived.
pub fn needs_withdrawal(status: &str, body: &[u8]) -> bool {
    let answered = status == "200" && serde_json::from_slice::<Answer>(body).is_ok();
    !answered && !crate::core::errors::callout_found_no_host(status, body)
}

/// The user a request is checked for: the `user` header's value, when it is not empty.
/// `Err` for one too long to be a user name of the store.
pub fn user_of(header: Option<String>) -> Result<Option<String>, RouteError> {
    match header {
        Some(name) if name.len() > MAX_USER_BYTES => Err(RouteError::UnknownUser(format!(
            "{}...",
            name.chars().take(32).collect::<String>()
        ))),
        Some(name) if !name.is_empty() => Ok(Some(name)),
        _ => Ok(None),
    }
}

/// How long a report that did not arrive is sent again: a user's TPM counter covers a
/// minute, so tokens older than that no longer change any admission.
pub const RESEND_FOR_MS: u64 = 60_000;

/// The request header naming a token report, so that pd-control adds a report sent again
/// (after a timeout, or a Redis failure that took only some users) once per user.
pub const REPORT_ID_HEADER: &str = "x-pd-report-id";

/// One token report: `{"user": tokens, ...}`, its id and token total, and when it was first
/// sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub id: String,
    pub body: Vec<u8>,
    pub tokens: u64,
    pub first_sent_ms: u64,
}

/// Tokens used per user since the last report, one VM's worth, and the report that did not
/// arrive, if any, sent again before anything newer.
#[derive(Debug, Default)]
pub struct UsageBook {
    pending: HashMap<String, u64>,
    /// Tokens dropped because [`MAX_PENDING_USERS`] users were already waiting.
    pub dropped: u64,
    resend: Option<Report>,
    reports: u64,
}

impl UsageBook {
    pub fn add(&mut self, user: &str, tokens: u64) {
        if tokens == 0 {
            return;
        }
        if let Some(total) = self.pending.get_mut(user) {
            *total = total.saturating_add(tokens);
        } else if self.pending.len() < MAX_PENDING_USERS {
            self.pending.insert(user.to_string(), tokens);
        } else {
            self.dropped = self.dropped.saturating_add(tokens);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty() && self.resend.is_none()
    }

    /// The next report to send: the one that did not arrive, unchanged (same id, so
    /// pd-control skips the users it already added), else the tokens gathered since, under a
    /// new id `<id_prefix>-<n>` (the prefix tells this VM's reports from every other's).
    pub fn take(&mut self, id_prefix: &str, now_ms: u64) -> Option<Report> {
        if let Some(report) = self.resend.take() {
            return Some(report);
        }
        if self.pending.is_empty() {
            return None;
        }
        let pending = std::mem::take(&mut self.pending);
        let tokens = pending.values().fold(0u64, |a, b| a.saturating_add(*b));
        let body = serde_json::to_vec(&pending).ok()?;
        self.reports += 1;
        Some(Report {
            id: format!("{id_prefix}-{}", self.reports),
            body,
            tokens,
            first_sent_ms: now_ms,
        })
    }

    /// `report` did not arrive (or not whole): kept to be sent again while it is younger
    /// than [`RESEND_FOR_MS`]. Returns the tokens given up on (0 when kept).
    pub fn failed(&mut self, report: Report, now_ms: u64) -> u64 {
        if now_ms.saturating_sub(report.first_sent_ms) >= RESEND_FOR_MS {
            return report.tokens;
        }
        let tokens = self.resend.take().map_or(0, |older| older.tokens);
        self.resend = Some(report);
        tokens
    }
}

/// The most tokens one answer is charged: far above any context window, and far enough below
/// `i64::MAX` that a report of many users' sums stays a number pd-control takes.
pub const MAX_ANSWER_TOKENS: u64 = 1 << 40;

/// The tokens an answer used, read from its `usage` as the body streams by: `total_tokens`
/// (OpenAI's chat, completions, embeddings and responses), else `input_tokens` plus
/// `output_tokens` (Anthropic's messages). The last value of each key counts, as the final
/// usage event repeats and supersedes earlier ones.
///
/// The keys are found by a scan, not a parse, so only where no client-shaped JSON object can
/// hold them before the usage: OpenAI answers carry tool arguments as strings (whose quotes
/// are escaped), but an Anthropic answer's `tool_use.input` is a JSON object of the client's
/// schema. Its usage has no `total_tokens`, so a Messages answer's scan ignores that key
/// (a tool input `{"total_tokens":0}` made the answer free); its real `input_tokens` and
/// `output_tokens` come after the content and win.
#[derive(Debug, Default)]
pub struct UsageScan {
    /// Messages (Anthropic): `total_tokens` is no usage key there.
    anthropic: bool,
    total: Option<u64>,
    input: Option<u64>,
    output: Option<u64>,
    /// Where the last chunk ended, so a key or number cut between two chunks is read whole.
    seam: usage::Seam,
}

impl UsageScan {
    /// A scan of an answer to `endpoint`.
    pub fn of(endpoint: crate::core::request::Endpoint) -> UsageScan {
        UsageScan {
            anthropic: endpoint == crate::core::request::Endpoint::Messages,
            ..UsageScan::default()
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        let seam = &self.seam;
        let read = |key: &[u8], slot: &mut Option<u64>| {
            if let Some(n) = seam.read(chunk, key) {
                *slot = Some(n);
            }
        };
        if !self.anthropic {
            read(b"\"total_tokens\"", &mut self.total);
        }
        read(b"\"input_tokens\"", &mut self.input);
        read(b"\"output_tokens\"", &mut self.output);
        self.seam.keep(chunk);
    }

    pub fn tokens(&self) -> Option<u64> {
        self.total
            .or(match (self.input, self.output) {
                (None, None) => None,
                (i, o) => Some(i.unwrap_or(0).saturating_add(o.unwrap_or(0))),
            })
            .map(|n| n.min(MAX_ANSWER_TOKENS))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(user: &str) -> Ask {
        Ask {
            user: Some(user.into()),
            model: "m".into(),
            rps: None,
            id: String::new(),
        }
    }

    fn judge(user: &str, status: &str, body: &[u8]) -> Verdict {
        super::judge(&ask(user), status, body)
    }

    #[test]
    fn a_models_rate_becomes_a_counter_window() {
        let rps = |r| ModelRps::of(r).map(|m| (m.limit, m.window_ms));
        assert_eq!(rps(2.0), Some((2, 1000)));
        assert_eq!(rps(2.9), Some((2, 1000)));
        assert_eq!(rps(1.0), Some((1, 1000)));
        assert_eq!(rps(0.5), Some((1, 2000)));
        assert_eq!(rps(0.1), Some((1, 10_000)));
        assert_eq!(rps(1e-9), Some((1, MAX_RPS_WINDOW_MS)));
        assert_eq!(rps(0.0), None);
        assert_eq!(rps(-1.0), None);
        assert_eq!(rps(f64::NAN), None);
    }

    #[test]
    fn the_body_asks_for_what_applies() {
        let body = |user, model| -> serde_json::Value {
            serde_json::from_slice(&admission_body("", user, model)).expect("json")
        };
        assert_eq!(
            body(Some("a\"b"), None),
            serde_json::json!({"user": "a\"b"})
        );
        let rps = ModelRps::of(0.5).expect("a rate");
        assert_eq!(
            body(Some("u"), Some(("m", rps))),
            serde_json::json!({"user": "u", "model": "m", "rps_limit": 1, "rps_window_ms": 2000})
        );
        let id = admission_id(0xabc);
        assert_eq!(id, format!("{:0>32}", "abc"));
        let named: serde_json::Value =
            serde_json::from_slice(&admission_body(&id, Some("u"), None)).expect("json");
        assert_eq!(named, serde_json::json!({"id": id, "user": "u"}));
    }

    #[test]
    fn a_withdrawal_names_the_admission_and_its_counters() {
        let ask = Ask {
            user: Some("u".into()),
            model: "m".into(),
            rps: Some(0.5),
            id: admission_id(7),
        };
        let body: serde_json::Value = serde_json::from_slice(&cancel_body(&ask)).expect("json");
        assert_eq!(
            body,
            serde_json::json!({"id": ask.id, "user": "u", "model": "m",
                               "rps_limit": 1, "rps_window_ms": 2000}),
            "the admission's own body, sent on its own path"
        );
        // Only an answer of pd-control's tells what it counted.
        let admitted = br#"{"outcome":"rpm_exceeded","rpm":3,"rpm_limit":3}"#;
        assert!(!needs_withdrawal("200", admitted));
        assert!(!needs_withdrawal(
            "200",
            br#"{"outcome":"store_error","stage":"rpm","message":"m"}"#
        ));
        for (status, body) in [
            ("", &b""[..]),
            ("504", &b"upstream request timeout"[..]),
            (
                "503",
                &b"upstream connect error or disconnect/reset before headers"[..],
            ),
            ("503", &admitted[..]),
            ("200", &b"{"[..]),
            ("200", &b"{\"outcome\":\"maybe\"}"[..]),
        ] {
            assert!(needs_withdrawal(status, body), "{status} {body:?}");
        }
        // Envoy had no pd-control to send the admission to: it never arrived.
        assert!(!needs_withdrawal("503", b"no healthy upstream"));
    }

    #[test]
    fn a_model_over_its_rate_is_refused_with_its_configured_rate() {
        let ask = Ask {
            user: None,
            model: "llama".into(),
            rps: Some(0.5),
            id: String::new(),
        };
        let refused = br#"{"outcome":"model_rps_exceeded","model_rps":1,"rps_limit":1}"#;
        assert_eq!(
            super::judge(&ask, "200", refused),
            Verdict::Refused(RouteError::ModelRpsExceeded {
                model: "llama".into(),
                rps: 0.5
            })
        );
        let admitted = br#"{"outcome":"admitted","rpm":null,"rpm_limit":null,"tpm":null,"tpm_limit":null,"model_rps":1,"rps_limit":1}"#;
        assert_eq!(
            super::judge(&ask, "200", admitted),
            Verdict::Admitted {
                rpm: None,
                charged: ModelRps::of(0.5)
            }
        );
        let not_counted = br#"{"outcome":"disabled"}"#;
        assert_eq!(
            super::judge(&ask, "200", not_counted),
            Verdict::Admitted {
                rpm: None,
                charged: None
            }
        );
        let store = br#"{"outcome":"store_error","stage":"model","message":"down"}"#;
        match super::judge(&ask, "200", store) {
            Verdict::Unchecked(e) => {
                assert_eq!(e.header().map(|(h, _)| h), Some("x-error-incr-model-rps"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn answers_map_to_aibrixs_refusals() {
        let admitted = br#"{"outcome":"admitted","rpm":2,"rpm_limit":3,"tpm":0,"tpm_limit":3000,"model_rps":null,"rps_limit":null}"#;
        assert_eq!(
            judge("alice", "200", admitted),
            Verdict::Admitted {
                rpm: Some(2),
                charged: None
            }
        );
        let rpm = br#"{"outcome":"rpm_exceeded","rpm":3,"rpm_limit":3}"#;
        assert_eq!(
            judge("alice", "200", rpm),
            Verdict::Refused(RouteError::RpmExceeded {
                user: "alice".into(),
                limit: 3
            })
        );
        let tpm = br#"{"outcome":"tpm_exceeded","rpm":1,"rpm_limit":3,"tpm":12,"tpm_limit":10}"#;
        assert_eq!(
            judge("bob", "200", tpm),
            Verdict::Refused(RouteError::TpmExceeded {
                user: "bob".into(),
                limit: 10
            })
        );
        assert_eq!(
            judge("eve", "200", br#"{"outcome":"unknown_user"}"#),
            Verdict::Refused(RouteError::UnknownUser("eve".into()))
        );
        assert_eq!(
            judge("eve", "200", br#"{"outcome":"disabled"}"#),
            Verdict::Admitted {
                rpm: None,
                charged: None
            }
        );
    }

    #[test]
    fn a_check_that_could_not_be_made_names_the_step_that_failed() {
        let header = |v: Verdict| match v {
            Verdict::Unchecked(e) => e.header().map(|(h, _)| h),
            other => panic!("{other:?}"),
        };
        let store = |stage: &str| {
            format!(r#"{{"outcome":"store_error","stage":"{stage}","message":"timeout"}}"#)
        };
        assert_eq!(
            header(judge("a", "200", store("user").as_bytes())),
            Some("x-error-user")
        );
        assert_eq!(
            header(judge("a", "200", store("counters").as_bytes())),
            Some("x-error-incr-rpm")
        );
        // AIBrix's `checkLimits`: each user step its own header.
        for (stage, aibrix) in [
            ("rpm", "x-error-rpm-exceeded"),
            ("incr_rpm", "x-error-incr-rpm"),
            ("tpm", "x-error-tpm-exceeded"),
        ] {
            assert_eq!(
                header(judge("a", "200", store(stage).as_bytes())),
                Some(aibrix),
                "{stage}"
            );
        }
        assert_eq!(header(judge("a", "503", b"down")), Some("x-error-user"));
        assert_eq!(header(judge("a", "200", b"{")), Some("x-error-user"));
        assert_eq!(
            header(judge("a", "200", br#"{"outcome":"maybe"}"#)),
            Some("x-error-user")
        );
    }

    /// Envoy's own replies to a call that reached no pd-control are told from pd-control's
    /// answers (`rate_limits_fail_open_unreachable` decides them).
    #[test]
    fn a_call_that_reached_no_pd_control_is_unreachable_not_unchecked() {
        let unreachable = [
            ("", &b""[..]),
            ("503", &b"upstream connect error or disconnect/reset before headers. reset reason: connection failure"[..]),
            ("503", &b"no healthy upstream"[..]),
        ];
        for (status, body) in unreachable {
            match judge("a", status, body) {
                Verdict::Unreachable(e) => {
                    assert_eq!(e.header().map(|(h, _)| h), Some("x-error-user"))
                }
                other => panic!("{status} {body:?}: {other:?}"),
            }
        }
        // pd-control's own answers, and a call it took but did not answer in time (a hung
        // Redis behind it: `rate_limits_fail_open` decides, as for a failing one).
        let answered = [
            ("503", &b"down"[..]),
            ("504", &b"{}"[..]),
            ("504", &b"upstream request timeout"[..]),
            ("500", &b""[..]),
        ];
        for (status, body) in answered {
            assert!(
                matches!(judge("a", status, body), Verdict::Unchecked(_)),
                "pd-control's own {status} answer"
            );
        }
    }

    #[test]
    fn only_a_nonempty_bounded_user_header_is_checked() {
        assert_eq!(user_of(None), Ok(None));
        assert_eq!(user_of(Some(String::new())), Ok(None));
        assert_eq!(user_of(Some("a".into())), Ok(Some("a".into())));
        assert!(user_of(Some("x".repeat(MAX_USER_BYTES))).is_ok());
        assert!(matches!(
            user_of(Some("x".repeat(MAX_USER_BYTES + 1))),
            Err(RouteError::UnknownUser(_))
        ));
    }

    #[test]
    fn the_book_sums_per_user_and_bounds_the_number_of_users() {
        let mut book = UsageBook::default();
        assert!(book.take("vm", 0).is_none());
        book.add("a", 5);
        book.add("a", 7);
        book.add("b", 0);
        book.add("b", 1);
        let report = book.take("vm", 0).expect("a report");
        let (body, total) = (report.body, report.tokens);
        assert_eq!(total, 13);
        assert_eq!(report.id, "vm-1");
        let sent: std::collections::HashMap<String, u64> =
            serde_json::from_slice(&body).expect("json");
        assert_eq!(sent.len(), 2);
        assert_eq!((sent["a"], sent["b"]), (12, 1));
        assert!(book.is_empty());
        for i in 0..MAX_PENDING_USERS + 3 {
            book.add(&format!("u{i}"), 2);
        }
        assert_eq!(book.dropped, 6);
        book.add("u0", 1);
        assert_eq!(
            book.take("vm", 0).map(|r| r.tokens),
            Some(2 * MAX_PENDING_USERS as u64 + 1)
        );
    }

    #[test]
    fn a_report_that_did_not_arrive_goes_again_first_until_a_minute_has_passed() {
        let mut book = UsageBook::default();
        book.add("a", 5);
        let first = book.take("vm7", 1_000).expect("a report");
        book.add("b", 3);
        assert_eq!(book.failed(first.clone(), 2_000), 0, "kept");
        // The same report, same id, before the newer tokens.
        assert_eq!(book.take("vm7", 3_000), Some(first.clone()));
        let next = book.take("vm7", 3_000).expect("the newer tokens");
        assert_eq!((next.id.as_str(), next.tokens), ("vm7-2", 3));
        assert!(book.is_empty());
        // Failing again later than a minute after it was first sent: given up.
        assert_eq!(book.failed(first.clone(), 61_000), 5);
        assert!(book.is_empty());
        // Two failed reports at once (only one is ever in flight, but be safe): the older
        // one is given up for the newer.
        assert_eq!(book.failed(first, 2_000), 0);
        assert_eq!(book.failed(next, 3_000), 5);
        assert_eq!(book.take("vm7", 3_000).map(|r| r.tokens), Some(3));
    }

    #[test]
    fn usage_is_read_from_a_whole_body_or_a_stream_cut_anywhere() {
        let body = br#"{"id":"x","choices":[{"message":{"content":"\"total_tokens\":99"}}],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19}}"#;
        let mut whole = UsageScan::default();
        whole.feed(body);
        assert_eq!(whole.tokens(), Some(19));
        for cut in 1..body.len() {
            let mut scan = UsageScan::default();
            scan.feed(&body[..cut]);
            scan.feed(&body[cut..]);
            assert_eq!(scan.tokens(), Some(19), "cut at {cut}");
        }
        let mut messages = UsageScan::default();
        messages.feed(b"data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":9,\"output_tokens\":1}}}\n\n");
        messages.feed(b"data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":16}}\n\n");
        assert_eq!(messages.tokens(), Some(25));
        let mut none = UsageScan::default();
        none.feed(b"data: {\"choices\":[]}\n\n");
        assert_eq!(none.tokens(), None);
    }

    #[test]
    fn a_tool_input_sets_no_messages_answers_usage() {
        use crate::core::request::Endpoint;
        // A non-streamed Messages answer: the tool input is a JSON object of the client's
        // schema, before the usage.
        let body = br#"{"type":"message","content":[{"type":"tool_use","id":"t","name":"f","input":{"total_tokens":0,"input_tokens":1,"output_tokens":1}}],"stop_reason":"tool_use","usage":{"input_tokens":100,"output_tokens":50}}"#;
        let mut scan = UsageScan::of(Endpoint::Messages);
        scan.feed(body);
        assert_eq!(scan.tokens(), Some(150));
        let mut huge = UsageScan::of(Endpoint::ChatCompletions);
        huge.feed(br#"{"usage":{"total_tokens":18446744073709551615}}"#);
        assert_eq!(huge.tokens(), Some(MAX_ANSWER_TOKENS));
        let mut chat = UsageScan::of(Endpoint::ChatCompletions);
        chat.feed(br#"{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#);
        assert_eq!(chat.tokens(), Some(7));
    }
}
