//! AIBrix's external replica-selection protocol (`routing.aibrix.ai/v1alpha1`): the decision
//! request built from the gateway's candidates, and the strict reading of the answer. Only what
//! the request offered can be chosen; anything malformed is a failure, never a guess.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::config::ExternalConfig;
use crate::proto;

pub const API_VERSION: &str = "routing.aibrix.ai/v1alpha1";
pub const MEDIA_TYPE: &str = "application/vnd.aibrix.external-routing+json;version=v1alpha1";
const MEDIA_TYPE_BASE: &str = "application/vnd.aibrix.external-routing+json";

/// What the filter asks: the request's id, its model, and the pods it may go to (after the
/// filter's own filters: readiness, reachability, ejection, `external-filter`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Ask {
    pub request_id: String,
    pub model: String,
    #[serde(default)]
    pub traceparent: Option<String>,
    pub candidates: Vec<AskCandidate>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct AskCandidate {
    /// `namespace/name`.
    pub id: String,
    /// Running requests as the filter's shared ledger counts them (every worker and replica).
    #[serde(default)]
    pub running: Option<u32>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Request<'a> {
    api_version: &'static str,
    kind: &'static str,
    metadata: RequestMetadata<'a>,
    spec: Spec<'a>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct RequestMetadata<'a> {
    request_id: &'a str,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Spec<'a> {
    model: &'a str,
    policy_mode: &'static str,
    candidates: Vec<Candidate>,
}

#[derive(Debug, Serialize)]
struct Candidate {
    id: String,
    ports: Vec<u32>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    attributes: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    metrics: Option<CandidateMetrics>,
}

#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
struct CandidateMetrics {
    #[serde(skip_serializing_if = "Option::is_none")]
    running_requests: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_utilization: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_cache_usage: Option<f64>,
}

/// The encoded decision request and, by candidate id, the one port each advertised.
#[derive(Debug)]
pub struct Built {
    pub body: Vec<u8>,
    pub ports: BTreeMap<String, u32>,
}

/// Candidates one ask may offer: the filter routes among at most 4096 pods of a model, and
/// each candidate costs a lookup and a place in the decision request.
pub const MAX_CANDIDATES: usize = 4096;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BuildError {
    /// The id goes out as the `x-request-id` header: a control or non-ASCII character there
    /// would fail the HTTP request itself, the caller's mistake, not the service's.
    #[error("external request ID must be 1 to 256 visible ASCII characters")]
    RequestId,
    #[error("external request model is empty")]
    Model,
    #[error("duplicate external candidate identity {0:?}")]
    Duplicate(String),
    #[error("external candidate list is empty")]
    NoCandidate,
    #[error("{0} external candidates (at most {MAX_CANDIDATES})")]
    TooManyCandidates(usize),
}

/// Builds the decision request from the filter's ask and pd-control's view of the pods
/// (`snapshot`: ports, labels, metrics). Candidates pd-control does not know as routable pods
/// of the model are left out; candidates are sorted by id.
pub fn build(
    cfg: &ExternalConfig,
    ask: &Ask,
    snapshot: &proto::Snapshot,
) -> Result<Built, BuildError> {
    if ask.request_id.is_empty()
        || ask.request_id.len() > 256
        || !ask.request_id.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(BuildError::RequestId);
    }
    if ask.candidates.len() > MAX_CANDIDATES {
        return Err(BuildError::TooManyCandidates(ask.candidates.len()));
    }
    if ask.model.is_empty() {
        return Err(BuildError::Model);
    }
    let model = snapshot.models.iter().find(|m| m.name == ask.model);
    // Ready pods by `(namespace, name)`, the first of a repeated name winning as a scan would.
    let mut ready: HashMap<(&str, &str), (usize, &proto::Pod)> = HashMap::new();
    for (slot, pod) in model.iter().flat_map(|m| m.pods.iter().enumerate()) {
        if pod.ready {
            ready
                .entry((pod.namespace.as_str(), pod.name.as_str()))
                .or_insert((slot, pod));
        }
    }
    let mut ids: Vec<&AskCandidate> = ask.candidates.iter().collect();
    ids.sort_by(|a, b| a.id.cmp(&b.id));
    let mut candidates = Vec::with_capacity(ids.len());
    let mut ports = BTreeMap::new();
    for asked in ids {
        if ports.contains_key(&asked.id) {
            return Err(BuildError::Duplicate(asked.id.clone()));
        }
        let found = asked
            .id
            .split_once('/')
            .and_then(|key| ready.get(&key).copied());
        let Some((slot, pod)) = found else { continue };
        if !(1..=65535).contains(&pod.port) || asked.id.len() > 256 {
            continue;
        }
        let labels = model
            .and_then(|m| m.labels.as_ref())
            .and_then(|l| l.pods.get(slot))
            .map(|l| l.labels.as_slice())
            .unwrap_or_default();
        let attributes = cfg
            .candidate_attributes
            .iter()
            .filter_map(|key| {
                labels
                    .iter()
                    .find(|l| &l.key == key)
                    .filter(|l| l.value.len() <= 256)
                    .map(|l| (key.clone(), l.value.clone()))
            })
            .collect();
        let fresh = pod.metrics.as_ref().filter(|m| m.present && !m.stale);
        let ratio = |v: Option<f64>| v.filter(|v| v.is_finite() && (0.0..=1.0).contains(v));
        let wanted = cfg.candidate_metrics;
        let metrics = CandidateMetrics {
            running_requests: asked.running.filter(|_| wanted.running_requests),
            engine_utilization: ratio(fresh.and_then(|m| m.engine_utilization))
                .filter(|_| wanted.engine_utilization),
            kv_cache_usage: ratio(fresh.map(|m| m.kv_cache_usage))
                .filter(|_| wanted.kv_cache_usage),
        };
        let any = metrics.running_requests.is_some()
            || metrics.engine_utilization.is_some()
            || metrics.kv_cache_usage.is_some();
        ports.insert(asked.id.clone(), pod.port);
        candidates.push(Candidate {
            id: asked.id.clone(),
            ports: vec![pod.port],
            attributes,
            metrics: any.then_some(metrics),
        });
    }
    if candidates.is_empty() {
        return Err(BuildError::NoCandidate);
    }
    let request = Request {
        api_version: API_VERSION,
        kind: "ReplicaSelectionRequest",
        metadata: RequestMetadata {
            request_id: &ask.request_id,
        },
        spec: Spec {
            model: &ask.model,
            policy_mode: if cfg.advisory {
                "Advisory"
            } else {
                "Authoritative"
            },
            candidates,
        },
    };
    let body = serde_json::to_vec(&request).unwrap_or_default();
    Ok(Built { body, ports })
}

/// A decision the service may give.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Selected { id: String },
    NoDecision,
    Denied,
}

/// Whether a `Content-Type` is the protocol's media type, version v1alpha1.
pub fn is_protocol_media_type(value: &str) -> bool {
    let mut parts = value.split(';').map(str::trim);
    if !parts
        .next()
        .is_some_and(|t| t.eq_ignore_ascii_case(MEDIA_TYPE_BASE))
    {
        return false;
    }
    parts.any(|p| {
        p.split_once('=').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("version") && v.trim().trim_matches('"') == "v1alpha1"
        })
    })
}

/// Reads an answer: one JSON object without duplicate members or trailing values; the fixed
/// envelope; the request's own id echoed; optional strings absent rather than null and at
/// most 256 bytes; a decision legal in `advisory` mode; a target among `ports` with its port.
/// Unknown members are ignored (the alpha protocol grows by adding them).
pub fn validate(
    data: &[u8],
    request_id: &str,
    advisory: bool,
    ports: &BTreeMap<String, u32>,
) -> Result<Decision, String> {
    if data.is_empty() {
        return Err("empty external routing response".into());
    }
    let mut de = serde_json::Deserializer::from_slice(data);
    NoDuplicates
        .deserialize(&mut de)
        .map_err(|e| format!("external response: {e}"))?;
    de.end()
        .map_err(|_| "external routing response contains trailing JSON".to_string())?;
    let v: Value = serde_json::from_slice(data)
        .map_err(|e| format!("decode external routing response: {e}"))?;
    let text = |v: &Value| v.as_str().map(str::to_string);
    let envelope_ok = v.get("apiVersion").and_then(Value::as_str) == Some(API_VERSION)
        && v.get("kind").and_then(Value::as_str) == Some("ReplicaSelectionResponse")
        && v.pointer("/metadata/requestId").and_then(Value::as_str) == Some(request_id)
        && v.pointer("/status/decision").is_some_and(Value::is_string);
    if !envelope_ok {
        return Err("invalid external routing response envelope".into());
    }
    // Optional members: absent, or a string of at most 256 bytes (never null).
    for path in ["/metadata/decisionId", "/status/reason"] {
        match v.pointer(path) {
            None => {}
            Some(s) if s.as_str().is_some_and(|s| s.len() <= 256) => {}
            Some(_) => return Err(format!("invalid external response field {path}")),
        }
    }
    let target = v.pointer("/status/target");
    if target.is_some_and(Value::is_null) {
        return Err("external response field target must be omitted instead of null".into());
    }
    match v.pointer("/status/decision").and_then(text).as_deref() {
        Some("Selected") => {
            let id = target
                .and_then(|t| t.get("id"))
                .and_then(Value::as_str)
                .filter(|id| !id.is_empty())
                .ok_or("selected response is missing target")?;
            let port = *ports
                .get(id)
                .ok_or("external target is outside the candidate snapshot")?;
            match target.and_then(|t| t.get("port")) {
                None => {}
                Some(p) if p.as_u64() == Some(u64::from(port)) => {}
                Some(p) if p.is_null() => {
                    return Err(
                        "external response field port must be omitted instead of null".into(),
                    )
                }
                Some(_) => {
                    return Err("external target port is outside the candidate snapshot".into())
                }
            }
            Ok(Decision::Selected { id: id.to_string() })
        }
        Some("NoDecision") if advisory && target.is_none() => Ok(Decision::NoDecision),
        Some("NoDecision") => Err("NoDecision is valid only for Advisory without a target".into()),
        Some("Denied") if !advisory && target.is_none() => Ok(Decision::Denied),
        Some("Denied") => Err("denied is valid only for Authoritative without a target".into()),
        Some(other) => Err(format!("unknown external decision {other:?}")),
        None => Err("invalid external routing response envelope".into()),
    }
}

/// Walks a JSON value, refusing an object that names a member twice (at any depth).
struct NoDuplicates;

impl<'de> DeserializeSeed<'de> for NoDuplicates {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for NoDuplicates {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(NoDuplicates)?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(serde::de::Error::custom(format!(
                    "duplicate JSON member {key:?}"
                )));
            }
            map.next_value_seed(NoDuplicates)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ports() -> BTreeMap<String, u32> {
        [("ns/a".to_string(), 8000), ("ns/b".to_string(), 8001)].into()
    }

    fn answer(status: &str) -> String {
        format!(
            r#"{{"apiVersion":"{API_VERSION}","kind":"ReplicaSelectionResponse","metadata":{{"requestId":"r1","decisionId":"d"}},"status":{status}}}"#
        )
    }

    #[test]
    fn a_selected_target_must_be_a_candidate_on_its_port() {
        let ok = |s: &str, advisory| validate(answer(s).as_bytes(), "r1", advisory, &ports());
        assert_eq!(
            ok(
                r#"{"decision":"Selected","target":{"id":"ns/b","port":8001}}"#,
                true
            ),
            Ok(Decision::Selected { id: "ns/b".into() })
        );
        assert_eq!(
            ok(
                r#"{"decision":"Selected","target":{"id":"ns/a"},"extra":1}"#,
                false
            ),
            Ok(Decision::Selected { id: "ns/a".into() }),
            "one port: it may be left out; unknown members are ignored"
        );
        for bad in [
            r#"{"decision":"Selected","target":{"id":"ns/c"}}"#,
            r#"{"decision":"Selected","target":{"id":"ns/a","port":8001}}"#,
            r#"{"decision":"Selected","target":{"id":"ns/a","port":null}}"#,
            r#"{"decision":"Selected"}"#,
            r#"{"decision":"Selected","target":null}"#,
            r#"{"decision":"Selected","target":{"id":"ns/a"},"reason":null}"#,
            r#"{"decision":"Maybe"}"#,
        ] {
            assert!(ok(bad, true).is_err(), "{bad}");
        }
    }

    #[test]
    fn decisions_are_legal_only_in_their_mode() {
        let v = |s: &str, advisory| validate(answer(s).as_bytes(), "r1", advisory, &ports());
        assert_eq!(
            v(r#"{"decision":"NoDecision","reason":"none"}"#, true),
            Ok(Decision::NoDecision)
        );
        assert!(v(r#"{"decision":"NoDecision"}"#, false).is_err());
        assert_eq!(v(r#"{"decision":"Denied"}"#, false), Ok(Decision::Denied));
        assert!(v(r#"{"decision":"Denied"}"#, true).is_err());
        assert!(v(r#"{"decision":"Denied","target":{"id":"ns/a"}}"#, false).is_err());
    }

    #[test]
    fn malformed_envelopes_are_failures() {
        let good = answer(r#"{"decision":"NoDecision"}"#);
        assert!(
            validate(good.as_bytes(), "r2", true, &ports()).is_err(),
            "another request's id"
        );
        assert!(validate(b"", "r1", true, &ports()).is_err());
        assert!(
            validate(format!("{good} {{}}").as_bytes(), "r1", true, &ports()).is_err(),
            "trailing JSON"
        );
        let twice = good.replacen("\"kind\"", "\"kind\":\"x\",\"kind\"", 1);
        assert!(
            validate(twice.as_bytes(), "r1", true, &ports()).is_err(),
            "duplicate member"
        );
        let nested = answer(r#"{"decision":"NoDecision","x":{"y":1,"y":2}}"#);
        assert!(
            validate(nested.as_bytes(), "r1", true, &ports()).is_err(),
            "duplicate nested member"
        );
        let null_id = good.replace("\"decisionId\":\"d\"", "\"decisionId\":null");
        assert!(validate(null_id.as_bytes(), "r1", true, &ports()).is_err());
        let old = good.replace(API_VERSION, "routing.aibrix.ai/v0");
        assert!(validate(old.as_bytes(), "r1", true, &ports()).is_err());
    }

    #[test]
    fn the_media_type_needs_its_version() {
        assert!(is_protocol_media_type(MEDIA_TYPE));
        assert!(is_protocol_media_type(
            "Application/Vnd.Aibrix.External-Routing+JSON; version=\"v1alpha1\""
        ));
        assert!(!is_protocol_media_type("application/json"));
        assert!(!is_protocol_media_type(MEDIA_TYPE_BASE));
        assert!(!is_protocol_media_type(
            "application/vnd.aibrix.external-routing+json;version=v1"
        ));
    }

    fn config() -> ExternalConfig {
        let args = super::super::config::ExternalArgs {
            endpoint: Some("http://router.svc/select".into()),
            policy_mode: Some("Advisory".into()),
            failure_mode: Some("FailOpen".into()),
            fallback: Some("least-request".into()),
            ..Default::default()
        };
        args.resolve(|_| Err(std::io::Error::other("no token file")))
            .unwrap()
            .unwrap()
    }

    fn fleet(pods: usize) -> proto::Snapshot {
        proto::Snapshot {
            models: vec![proto::Model {
                name: "m".into(),
                pods: (0..pods)
                    .map(|i| proto::Pod {
                        namespace: "ns".into(),
                        name: format!("p{i}"),
                        port: 8000,
                        ready: true,
                        ..Default::default()
                    })
                    .collect(),
                labels: None,
            }],
            ..Default::default()
        }
    }

    fn asking(request_id: &str, candidates: usize) -> Ask {
        Ask {
            request_id: request_id.into(),
            model: "m".into(),
            traceparent: None,
            candidates: (0..candidates)
                .map(|i| AskCandidate {
                    id: format!("ns/p{i}"),
                    running: None,
                })
                .collect(),
        }
    }

    #[test]
    fn request_ids_that_are_no_header_value_are_the_callers_mistake() {
        let snapshot = fleet(2);
        assert!(build(&config(), &asking("r-1", 2), &snapshot).is_ok());
        for bad in [
            "",
            "r\u{1}",
            "r\r\nx: y",
            "r\u{e9}",
            "r 1",
            &"r".repeat(257),
        ] {
            assert_eq!(
                build(&config(), &asking(bad, 2), &snapshot).err(),
                Some(BuildError::RequestId),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn candidates_are_bounded_and_looked_up_by_name() {
        let snapshot = fleet(MAX_CANDIDATES);
        let built = build(&config(), &asking("r", MAX_CANDIDATES), &snapshot).unwrap();
        assert_eq!(built.ports.len(), MAX_CANDIDATES);
        assert_eq!(
            build(&config(), &asking("r", 100_000), &snapshot).err(),
            Some(BuildError::TooManyCandidates(100_000))
        );
    }
}
