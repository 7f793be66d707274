//! The `external` strategy's side of the filter: what it asks pd-control (the request's id,
//! its model, its candidate pods with their running requests), how it reads the answer, and
//! what it then does. pd-control holds the service's address, token and protections and
//! reads its answers strictly (see pd-control's `external` module); the filter only routes.

use serde::Serialize;
use serde_json::Value;

use crate::core::errors::RouteError;
use crate::core::profile::{Strategy, StrategySpec};
use crate::proto;

/// pd-control's route for a decision.
pub const ROUTE_PATH: &str = "/v1/route/external";

/// How long the filter waits for pd-control beyond the service's own deadline: pd-control's
/// hop and its work around the exchange.
pub const MARGIN_MS: u64 = 200;

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Ask<'a> {
    request_id: &'a str,
    model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<&'a str>,
    candidates: Vec<Candidate<'a>>,
}

#[derive(Serialize)]
struct Candidate<'a> {
    id: &'a str,
    running: u32,
}

/// The ask for pd-control: `candidates` are `(namespace/name, running requests)`.
pub fn ask_body<'a>(
    request_id: &str,
    model: &str,
    traceparent: Option<&str>,
    candidates: impl Iterator<Item = (&'a str, u32)>,
) -> Vec<u8> {
    let ask = Ask {
        request_id,
        model,
        traceparent,
        candidates: candidates
            .map(|(id, running)| Candidate { id, running })
            .collect(),
    };
    serde_json::to_vec(&ask).unwrap_or_default()
}

/// What pd-control answered.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// The service chose this pod (`namespace/name`).
    Selected(String),
    /// Run the configured fallback (the reason, for the log).
    Fallback(String),
    Denied,
    /// Failing closed (the failure's outcome, for the log).
    Unavailable(String),
}

/// Reads pd-control's answer; `Err` when there is none (the call failed, not 200, not JSON).
pub fn parse_answer(status: &str, body: &[u8]) -> Result<Answer, String> {
    if status != "200" {
        return Err(format!("pd-control answered {status:?}"));
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("pd-control's answer: {e}"))?;
    let text = |key: &str| {
        v.get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    match v.get("decision").and_then(Value::as_str) {
        Some("selected") if !text("target").is_empty() => Ok(Answer::Selected(text("target"))),
        Some("fallback") => Ok(Answer::Fallback(text("reason"))),
        Some("denied") => Ok(Answer::Denied),
        Some("unavailable") => Ok(Answer::Unavailable(text("reason"))),
        _ => Err(format!("pd-control's answer has no decision: {v}")),
    }
}

/// What the filter does with an external request.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Route to this pod (`namespace/name`).
    Pod(String),
    /// Route by the local fallback strategy.
    Fallback(StrategySpec),
    Refuse(RouteError),
}

/// `pd_router_external_decisions_total{result}`, in [`Outcome`] order.
pub const RESULTS: [&str; 6] = [
    "selected",
    "bypassed",
    "fallback",
    "denied",
    "unavailable",
    "unanswered",
];

/// How an external request was decided, for the metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Selected,
    /// Advisory with one candidate: AIBrix's local fast path, no call.
    Bypassed,
    Fallback,
    Denied,
    Unavailable,
    /// pd-control gave no answer (then fallback or unavailable, by the failure mode).
    Unanswered,
}

impl Outcome {
    /// Its `result` label (and the explanation's `external=`).
    pub fn label(self) -> &'static str {
        RESULTS[self as usize]
    }
}

/// The plan for `answer` (`Err`: pd-control did not answer) under `config`, and its outcome.
pub fn plan(answer: Result<Answer, String>, config: &proto::ExternalRouter) -> (Plan, Outcome) {
    match answer {
        Ok(Answer::Selected(id)) => (Plan::Pod(id), Outcome::Selected),
        Ok(Answer::Fallback(_)) => (fallback(config).into(), Outcome::Fallback),
        Ok(Answer::Denied) => (Plan::Refuse(RouteError::ExternalDenied), Outcome::Denied),
        Ok(Answer::Unavailable(reason)) => (
            Plan::Refuse(RouteError::ExternalUnavailable { detail: reason }),
            Outcome::Unavailable,
        ),
        Err(why) => (failed(config, why).into(), Outcome::Unanswered),
    }
}

impl From<Result<StrategySpec, RouteError>> for Plan {
    fn from(r: Result<StrategySpec, RouteError>) -> Plan {
        match r {
            Ok(spec) => Plan::Fallback(spec),
            Err(error) => Plan::Refuse(error),
        }
    }
}

/// A failure without the service's verdict (no answer, a chosen pod gone from the view): the
/// fallback strategy when failing open, else the 503.
pub fn failed(config: &proto::ExternalRouter, why: String) -> Result<StrategySpec, RouteError> {
    if config.fail_open {
        fallback(config)
    } else {
        Err(RouteError::ExternalUnavailable { detail: why })
    }
}

/// The configured fallback, which must be a local single-pod strategy (pd-control checks it at
/// start; a snapshot from elsewhere is checked again here).
fn fallback(config: &proto::ExternalRouter) -> Result<StrategySpec, RouteError> {
    match Strategy::parse(&config.fallback) {
        Ok(StrategySpec::One(Strategy::Pd | Strategy::External)) | Err(_) => {
            Err(RouteError::ExternalUnavailable {
                detail: format!("no usable fallback strategy {:?}", config.fallback),
            })
        }
        Ok(spec) => Ok(spec),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(fail_open: bool, fallback: &str) -> proto::ExternalRouter {
        proto::ExternalRouter {
            advisory: true,
            fail_open,
            fallback: fallback.into(),
            timeout_ms: 10,
        }
    }

    #[test]
    fn the_ask_names_each_candidate_with_its_load() {
        let body = ask_body("r1", "m", None, [("ns/a", 2), ("ns/b", 0)].into_iter());
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"requestId": "r1", "model": "m",
                "candidates": [{"id": "ns/a", "running": 2}, {"id": "ns/b", "running": 0}]})
        );
    }

    #[test]
    fn answers_become_plans() {
        let c = config(false, "least-request");
        let read = |body: &str| parse_answer("200", body.as_bytes());
        assert_eq!(
            plan(read(r#"{"decision":"selected","target":"ns/a"}"#), &c),
            (Plan::Pod("ns/a".into()), Outcome::Selected)
        );
        assert_eq!(
            plan(
                read(r#"{"decision":"fallback","reason":"no_decision"}"#),
                &c
            ),
            (
                Plan::Fallback(StrategySpec::One(Strategy::LeastRequest)),
                Outcome::Fallback
            )
        );
        assert_eq!(
            plan(read(r#"{"decision":"denied"}"#), &c).0,
            Plan::Refuse(RouteError::ExternalDenied)
        );
        assert_eq!(
            plan(read(r#"{"decision":"unavailable","reason":"timeout"}"#), &c).1,
            Outcome::Unavailable
        );
        assert!(read(r#"{"decision":"selected"}"#).is_err(), "no target");
        assert!(parse_answer("503", b"{}").is_err());
        assert!(parse_answer("", b"").is_err(), "the call itself failed");
    }

    #[test]
    fn each_outcome_has_its_own_label() {
        let all = [
            Outcome::Selected,
            Outcome::Bypassed,
            Outcome::Fallback,
            Outcome::Denied,
            Outcome::Unavailable,
            Outcome::Unanswered,
        ];
        let labels: Vec<&str> = all.iter().map(|o| o.label()).collect();
        assert_eq!(labels, RESULTS);
    }

    #[test]
    fn no_answer_falls_back_only_when_failing_open_and_only_to_a_local_strategy() {
        let closed = plan(Err("down".into()), &config(false, "random"));
        assert!(matches!(
            closed,
            (
                Plan::Refuse(RouteError::ExternalUnavailable { .. }),
                Outcome::Unanswered
            )
        ));
        let open = plan(
            Err("down".into()),
            &config(true, "least-request:2,throughput"),
        );
        assert!(matches!(open.0, Plan::Fallback(StrategySpec::Blend(_))));
        for bad in ["pd", "external", "nope", ""] {
            let (p, _) = plan(Err("down".into()), &config(true, bad));
            assert!(
                matches!(p, Plan::Refuse(RouteError::ExternalUnavailable { .. })),
                "{bad}"
            );
        }
    }
}
