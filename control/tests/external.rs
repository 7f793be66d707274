//! pd-control's side of the `external` strategy (`POST /v1/route/external`) against a fake
//! decision service on loopback: the decision request it builds, each decision, the failure
//! modes, the circuit, the metrics, and the snapshot's summary for the filters.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use serde_json::{json, Value};

use common::metric;

const MEDIA: &str = "application/vnd.aibrix.external-routing+json;version=v1alpha1";

/// Standard pods `c0`, `c1`, `c2` of model `m` on port 8000, each labelled with a zone.
fn write_fleet(path: &Path) {
    let mut out = String::from("apiVersion: v1\nkind: List\nitems:\n");
    for (i, name) in ["c0", "c1", "c2"].iter().enumerate() {
        out.push_str(&format!(
            "- apiVersion: v1\n  kind: Pod\n  metadata:\n    name: {name}\n    namespace: t\n    \
             labels: {{model.aibrix.ai/name: m, model.aibrix.ai/port: \"8000\", zone: z{i}, secret: s}}\n  \
             status:\n    podIP: 127.0.8.{}\n    conditions: [{{type: Ready, status: \"True\"}}]\n",
            i + 1
        ));
    }
    std::fs::write(path, out).expect("fleet");
}

/// How the fake service answers.
#[derive(Clone)]
enum Mode {
    Select(&'static str),
    NoDecision,
    Deny,
    Status(u16),
    Hung,
}

#[derive(Default)]
struct Seen {
    calls: usize,
    body: Value,
    headers: Vec<(String, String)>,
}

struct Fake {
    mode: Mutex<Mode>,
    seen: Mutex<Seen>,
}

async fn decide(
    axum::extract::State(fake): axum::extract::State<Arc<Fake>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    let request: Value = serde_json::from_slice(&body).unwrap_or_default();
    let mode = fake.mode.lock().unwrap().clone();
    {
        let mut seen = fake.seen.lock().unwrap();
        seen.calls += 1;
        seen.body = request.clone();
        seen.headers = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or_default().to_string()))
            .collect();
    }
    let id = request["metadata"]["requestId"].clone();
    let status = match mode {
        Mode::Select(target) => json!({"decision": "Selected", "target": {"id": target}}),
        Mode::NoDecision => json!({"decision": "NoDecision", "reason": "NoApplicablePolicy"}),
        Mode::Deny => json!({"decision": "Denied", "reason": "CompliancePolicy"}),
        Mode::Status(code) => {
            return (
                StatusCode::from_u16(code).unwrap(),
                "secret upstream details",
            )
                .into_response()
        }
        // A service that never answers: only pd-control's deadline ends the exchange.
        Mode::Hung => std::future::pending().await,
    };
    let answer = json!({
        "apiVersion": "routing.aibrix.ai/v1alpha1",
        "kind": "ReplicaSelectionResponse",
        "metadata": {"requestId": id, "decisionId": "d-1"},
        "status": status,
    });
    ([("content-type", MEDIA)], answer.to_string()).into_response()
}

async fn fake_service(mode: Mode) -> (String, Arc<Fake>) {
    let fake = Arc::new(Fake {
        mode: Mutex::new(mode),
        seen: Mutex::new(Seen::default()),
    });
    let app = axum::Router::new()
        .route("/v1alpha1/select", axum::routing::post(decide))
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/v1alpha1/select"), fake)
}

/// The decision service's verdict is final and its silence refuses (`FailClosed`).
fn authoritative_fail_closed(
    endpoint: String,
    timeout: &str,
) -> impl FnOnce(&mut pd_control::external::config::ExternalArgs) + '_ {
    move |e| {
        e.endpoint = Some(endpoint);
        e.policy_mode = Some("Authoritative".into());
        e.failure_mode = Some("FailClosed".into());
        e.timeout = Some(timeout.into());
    }
}

async fn start(
    dir: &Path,
    external: impl FnOnce(&mut pd_control::external::config::ExternalArgs),
) -> (pd_control::Service, String) {
    let fleet = dir.join("fleet.yaml");
    write_fleet(&fleet);
    let mut config = pd_control::Config::new(&fleet, "127.0.0.1:0".parse().expect("addr"));
    external(&mut config.external);
    let service = pd_control::start(config).await.expect("pd-control starts");
    let base = format!("http://{}", service.local_addr());
    (service, base)
}

async fn ask(base: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
        .post(format!("{base}/v1/route/external"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("pd-control answers");
    let status = r.status().as_u16();
    let bytes = r.bytes().await.unwrap_or_default();
    (status, serde_json::from_slice(&bytes).unwrap_or_default())
}

async fn snapshot_json(base: &str) -> Value {
    let r = reqwest::get(format!("{base}/v1/snapshot.json"))
        .await
        .expect("snapshot");
    serde_json::from_slice(&r.bytes().await.expect("body")).expect("json")
}

fn candidates(request_id: &str) -> Value {
    json!({
        "requestId": request_id,
        "model": "m",
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "candidates": [{"id": "t/c2", "running": 1}, {"id": "t/c0", "running": 3}, {"id": "t/gone"}],
    })
}

#[tokio::test]
async fn advisory_routes_by_the_service_and_falls_back_on_no_decision_and_failures() {
    let dir = tempfile::tempdir().expect("dir");
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").expect("token");
    let (url, fake) = fake_service(Mode::Select("t/c2")).await;
    let (_service, base) = start(dir.path(), |e| {
        e.endpoint = Some(url);
        e.policy_mode = Some("Advisory".into());
        e.failure_mode = Some("FailOpen".into());
        e.fallback = Some("least-request".into());
        e.failure_threshold = Some("2".into());
        e.open_duration = Some("1h".into());
        e.timeout = Some("2s".into());
        e.candidate_metrics = Some("runningRequests".into());
        e.candidate_attributes = Some("zone".into());
        e.auth_token_file = Some(token.display().to_string());
    })
    .await;

    let (status, answer) = ask(&base, candidates("r-1")).await;
    assert_eq!(
        (status, answer.clone()),
        (200, json!({"decision": "selected", "target": "t/c2"}))
    );
    {
        let seen = fake.seen.lock().unwrap();
        let header = |name: &str| {
            seen.headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(header("content-type").as_deref(), Some(MEDIA));
        assert_eq!(header("accept").as_deref(), Some(MEDIA));
        assert_eq!(header("authorization").as_deref(), Some("Bearer s3cret"));
        assert_eq!(header("x-request-id").as_deref(), Some("r-1"));
        assert!(header("traceparent").is_some());
        let spec = &seen.body["spec"];
        assert_eq!(spec["policyMode"], "Advisory");
        // Sorted, only pods pd-control knows, the allowlisted label alone, the asked metric.
        assert_eq!(
            spec["candidates"],
            json!([
                {"id": "t/c0", "ports": [8000], "attributes": {"zone": "z0"}, "metrics": {"runningRequests": 3}},
                {"id": "t/c2", "ports": [8000], "attributes": {"zone": "z2"}, "metrics": {"runningRequests": 1}},
            ])
        );
        assert_eq!(seen.body["metadata"]["requestId"], "r-1");
    }

    *fake.mode.lock().unwrap() = Mode::NoDecision;
    assert_eq!(
        ask(&base, candidates("r-2")).await.1,
        json!({"decision": "fallback", "reason": "no_decision"})
    );
    // A choice outside the candidates is a failure, not a route.
    *fake.mode.lock().unwrap() = Mode::Select("t/c1");
    assert_eq!(
        ask(&base, candidates("r-3")).await.1,
        json!({"decision": "fallback", "reason": "invalid_response"})
    );
    *fake.mode.lock().unwrap() = Mode::Status(500);
    assert_eq!(
        ask(&base, candidates("r-4")).await.1,
        json!({"decision": "fallback", "reason": "http_error"})
    );
    // Two failures in a row (the threshold): the circuit opens, the service is not called.
    let calls = fake.seen.lock().unwrap().calls;
    assert_eq!(
        ask(&base, candidates("r-5")).await.1,
        json!({"decision": "fallback", "reason": "circuit_open"})
    );
    assert_eq!(fake.seen.lock().unwrap().calls, calls);

    let m = |name: &'static str| {
        let base = base.clone();
        async move { metric(&base, name).await }
    };
    assert_eq!(
        m("aibrix_gateway_external_router_requests_total{outcome=\"selected\"}").await,
        1.0
    );
    assert_eq!(
        m("aibrix_gateway_external_router_requests_total{outcome=\"invalid_response\"}").await,
        1.0
    );
    assert_eq!(
        m("aibrix_gateway_external_router_fallback_total{reason=\"no_decision\"}").await,
        1.0
    );
    assert_eq!(
        m("aibrix_gateway_external_router_fallback_total{reason=\"circuit_open\"}").await,
        1.0
    );
    assert_eq!(
        m("aibrix_gateway_external_router_circuit_state{state=\"open\"}").await,
        1.0
    );
    assert_eq!(
        m("aibrix_gateway_external_router_duration_seconds_count").await,
        4.0
    );
    assert_eq!(m("aibrix_gateway_external_router_inflight").await, 0.0);

    let snapshot = snapshot_json(&base).await;
    assert_eq!(
        snapshot["external_router"],
        json!({"advisory": true, "fail_open": true, "fallback": "least-request", "timeout_ms": 2000})
    );
}

#[tokio::test]
async fn authoritative_denies_and_fails_closed() {
    let dir = tempfile::tempdir().expect("dir");
    let (url, fake) = fake_service(Mode::Deny).await;
    let (_service, base) = start(dir.path(), authoritative_fail_closed(url, "100ms")).await;
    assert_eq!(
        ask(&base, candidates("r-1")).await.1,
        json!({"decision": "denied"})
    );
    assert!(fake
        .seen
        .lock()
        .unwrap()
        .headers
        .iter()
        .all(|(k, _)| k != "authorization"));
    *fake.mode.lock().unwrap() = Mode::Hung;
    assert_eq!(
        ask(&base, candidates("r-2")).await.1,
        json!({"decision": "unavailable", "reason": "timeout"})
    );
    *fake.mode.lock().unwrap() = Mode::NoDecision;
    assert_eq!(
        ask(&base, candidates("r-3")).await.1,
        json!({"decision": "unavailable", "reason": "invalid_response"}),
        "NoDecision is not an Authoritative answer"
    );
    let (status, _) = ask(&base, json!({"model": "m"})).await;
    assert_eq!(status, 400, "not an ask");
}

/// An https endpoint is spoken to over TLS (verified against the system's roots): a service
/// that answers plain http there fails the handshake, a transport error, and nothing is
/// routed by it.
#[tokio::test]
async fn an_https_endpoint_is_reached_over_tls() {
    let dir = tempfile::tempdir().expect("dir");
    let (url, fake) = fake_service(Mode::Select("t/c0")).await;
    let (_service, base) = start(
        dir.path(),
        authoritative_fail_closed(url.replacen("http://", "https://", 1), "2s"),
    )
    .await;
    assert_eq!(
        ask(&base, candidates("r-1")).await.1,
        json!({"decision": "unavailable", "reason": "transport_error"})
    );
    assert_eq!(
        fake.seen.lock().unwrap().calls,
        0,
        "no plain request reached it"
    );
}

#[tokio::test]
async fn without_an_endpoint_there_is_no_external_router_and_a_bad_one_stops_the_start() {
    let dir = tempfile::tempdir().expect("dir");
    let (_service, base) = start(dir.path(), |_| {}).await;
    assert_eq!(ask(&base, candidates("r-1")).await.0, 404);
    let snapshot = snapshot_json(&base).await;
    assert!(snapshot["external_router"].is_null());

    let fleet = dir.path().join("fleet.yaml");
    let mut config = pd_control::Config::new(&fleet, "127.0.0.1:0".parse().expect("addr"));
    config.external.endpoint = Some("http://router/select".into());
    config.external.policy_mode = Some("Authoritative".into());
    config.external.failure_mode = Some("FailOpen".into());
    let error = pd_control::start(config)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(
        error.contains("authoritative external routing requires FailClosed"),
        "{error}"
    );
}

/// A request id that cannot be an HTTP header value is the asker's mistake: refused without
/// calling the service or touching the circuit shared by every gateway, so a valid ask after
/// more of them than the failure threshold is still served.
#[tokio::test]
async fn request_ids_that_are_no_header_value_do_not_open_the_circuit() {
    let dir = tempfile::tempdir().expect("dir");
    let (url, fake) = fake_service(Mode::Select("t/c0")).await;
    let (_service, base) = start(dir.path(), authoritative_fail_closed(url, "2s")).await;
    for _ in 0..5 {
        let (status, answer) = ask(&base, candidates("r\u{1}")).await;
        assert_eq!(status, 200);
        assert_ne!(answer["reason"], "circuit_open", "{answer}");
    }
    assert_eq!(
        ask(&base, candidates("r-ok")).await.1,
        json!({"decision": "selected", "target": "t/c0"})
    );
    assert_eq!(fake.seen.lock().unwrap().calls, 1);
}

/// A decision request that cannot be formed at all (here a token with a control character,
/// which the header check refuses) is not the service's failure: the circuit stays closed.
#[tokio::test]
async fn a_request_that_cannot_be_formed_does_not_count_against_the_service() {
    let dir = tempfile::tempdir().expect("dir");
    let token = dir.path().join("token");
    std::fs::write(&token, "s3\u{1}cret\n").expect("token");
    let (url, fake) = fake_service(Mode::Select("t/c0")).await;
    let (_service, base) = start(dir.path(), |e| {
        authoritative_fail_closed(url, "2s")(e);
        e.auth_token_file = Some(token.display().to_string());
    })
    .await;
    for i in 0..6 {
        assert_eq!(
            ask(&base, candidates(&format!("r-{i}"))).await.1,
            json!({"decision": "unavailable", "reason": "transport_error"})
        );
    }
    assert_eq!(fake.seen.lock().unwrap().calls, 0);
    assert_eq!(
        metric(
            &base,
            "aibrix_gateway_external_router_circuit_state{state=\"closed\"}"
        )
        .await,
        1.0
    );
}
