//! The HTTP API: the snapshot for filters, a JSON view for people, health and own metrics.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use axum::body::Body;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio::sync::watch;

use crate::replicas::ReplicaBook;
use crate::snapshot::Published;
use crate::stats::Stats;

/// Carries the served version on every snapshot response, including 304s, so a poller can log
/// or compare it without decoding.
pub const VERSION_HEADER: &str = "x-pd-snapshot-version";
pub const PROTOBUF: &str = "application/x-protobuf";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Clone)]
pub struct AppState {
    pub snapshots: watch::Receiver<Arc<Published>>,
    pub stats: Arc<Stats>,
    pub replicas: Arc<ReplicaBook>,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/snapshot", get(snapshot))
        .route("/v1/snapshot.json", get(snapshot_json))
        .route("/v1/replicas/report", post(replica_report))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

fn current(state: &AppState) -> Arc<Published> {
    state.snapshots.borrow().clone()
}

fn respond(
    status: StatusCode,
    version: u64,
    content_type: Option<&'static str>,
    body: Body,
) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(VERSION_HEADER, HeaderValue::from(version));
    if let Some(content_type) = content_type {
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    }
    response
}

/// `GET /v1/snapshot[?version=N]`: 304 when the caller already holds the current version.
async fn snapshot(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let published = current(&state);
    let held = match query
        .get("version")
        .map(|v| v.trim())
        .filter(|v| !v.is_empty())
    {
        None => None,
        Some(text) => match text.parse::<u64>() {
            Ok(v) => Some(v),
            Err(_) => {
                let message = format!("version must be an unsigned integer, got {text:?}\n");
                return (StatusCode::BAD_REQUEST, message).into_response();
            }
        },
    };
    if held == Some(published.version) {
        return respond(
            StatusCode::NOT_MODIFIED,
            published.version,
            None,
            Body::empty(),
        );
    }
    respond(
        StatusCode::OK,
        published.version,
        Some(PROTOBUF),
        Body::from(published.bytes.clone()),
    )
}

/// `POST /v1/replicas/report`: a gateway replica's decode ledger in, the other live
/// replicas' summed shares out (both protobuf, `ReplicaReport` / `RemoteShares`).
async fn replica_report(State(state): State<AppState>, body: Bytes) -> Response {
    match state.replicas.report(&body).await {
        Ok(shares) => (
            [(header::CONTENT_TYPE, HeaderValue::from_static(PROTOBUF))],
            prost::Message::encode_to_vec(&shares),
        )
            .into_response(),
        Err(e) => (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    }
}

async fn snapshot_json(State(state): State<AppState>) -> Response {
    let published = current(&state);
    match serde_json::to_vec_pretty(&published.snapshot) {
        Ok(json) => respond(
            StatusCode::OK,
            published.version,
            Some("application/json"),
            Body::from(json),
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot render snapshot: {e}\n"),
        )
            .into_response(),
    }
}

async fn readyz(State(state): State<AppState>) -> Response {
    if state.stats.is_ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "waiting for the fleet and a first scrape round\n",
        )
            .into_response()
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let published = current(&state);
    let (ready, not_ready) = published.pod_counts();
    let stats = &state.stats;
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, samples: &[(&str, String)]| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    };
    family(
        "pd_control_snapshot_version",
        "gauge",
        "Version of the snapshot being served.",
        &[("", published.version.to_string())],
    );
    family(
        "pd_control_pods",
        "gauge",
        "Pods in the served snapshot by readiness.",
        &[
            ("{state=\"ready\"}", ready.to_string()),
            ("{state=\"not_ready\"}", not_ready.to_string()),
        ],
    );
    family(
        "pd_control_scrape_errors_total",
        "counter",
        "Engine metrics scrapes that failed (connect, timeout, status, body).",
        &[("", stats.scrape_errors_total().to_string())],
    );
    family(
        "pd_control_scrape_duration_seconds",
        "gauge",
        "Wall time of the last completed scrape round.",
        &[("", stats.scrape_duration_seconds().to_string())],
    );
    family(
        "pd_control_fleet_reload_errors_total",
        "counter",
        "Fleet updates rejected (unreadable or invalid); the previous fleet was kept.",
        &[("", stats.fleet_reload_errors_total().to_string())],
    );
    for (name, kind, help, value) in state.replicas.metrics() {
        family(name, kind, help, &[("", value)]);
    }
    ([(header::CONTENT_TYPE, PROMETHEUS_TEXT)], out).into_response()
}
