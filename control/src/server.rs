//! The HTTP API: the snapshot for filters, a JSON view for people, health and own metrics.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::body::Bytes;
use axum::extract::{Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio::sync::watch;

use crate::auth::SnapshotToken;
use crate::limits::UserLimits;
use crate::replicas::ReplicaBook;
use crate::snapshot::Published;
use crate::stats::{PollAnswer, Stats, Task};

/// Carries the served version on every snapshot response, including 304s, so a poller can log
/// or compare it without decoding.
pub const VERSION_HEADER: &str = "x-pd-snapshot-version";
pub const PROTOBUF: &str = "application/x-protobuf";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
const PLAIN_TEXT: &str = "text/plain; charset=utf-8";

#[derive(Clone)]
pub struct AppState {
    pub snapshots: watch::Receiver<Arc<Published>>,
    /// The JSON view (`crate::snapshot::Update::live`): the served version, current scrape times.
    pub live: watch::Receiver<Arc<crate::proto::Snapshot>>,
    pub stats: Arc<Stats>,
    pub replicas: Arc<ReplicaBook>,
    /// Per-user request and token limits (off unless `--redis`).
    pub limits: Arc<UserLimits>,
    /// `FleetSource::kind` of the running source.
    pub source_kind: &'static str,
    /// `--snapshot-token-file`: required on the snapshot, replica and limits routes when set.
    pub token: Option<Arc<SnapshotToken>>,
    /// Whether a polling gateway's retrying cluster holds the endpoint listing.
    pub eds_here: crate::xds::EdsHere,
    /// The `external` strategy's service, when configured.
    pub external: Option<Arc<crate::external::ExternalRouter>>,
    /// How long the control loop may go without completing an iteration before the snapshot
    /// counts as frozen (`crate::service::loop_stale_after`).
    pub loop_stale_after: Duration,
    /// The polling gateways' TRT-LLM machine ids, to see two on one.
    pub gateways: Arc<crate::gateways::Gateways>,
    /// `--leader-elect`: this replica's part in the election.
    pub leadership: Option<Arc<crate::leader::Leadership>>,
}

pub fn router(state: AppState) -> Router {
    // What names pods and steers routing sits behind the token; health and metrics do not
    // (probes and Prometheus carry no gateway secret).
    let guarded = Router::new()
        .route("/v1/snapshot", get(snapshot))
        .route("/v1/snapshot.json", get(snapshot_json))
        .route("/v1/replicas/report", post(replica_report))
        .route("/v1/limits/admit", post(limits_admit))
        .route("/v1/limits/cancel", post(limits_cancel))
        .route("/v1/limits/usage", post(limits_usage))
        .route("/v1/limits/release", post(limits_release))
        .route("/v1/route/external", post(route_external))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            close_unless_leading,
        ));
    Router::new()
        .merge(guarded)
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/livez", get(livez))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// What `--metrics-listen` serves: health and metrics only, never the APIs.
pub fn metrics_router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/livez", get(livez))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// 401 without `authorization: Bearer <token>` when a token is configured.
async fn require_token(State(state): State<AppState>, request: Request, next: Next) -> Response {
    match &state.token {
        Some(token) if !token.authorizes(request.headers().get(header::AUTHORIZATION)) => {
            state.stats.unauthorized();
            (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                "missing or wrong snapshot token\n",
            )
                .into_response()
        }
        _ => next.run(request).await,
    }
}

/// With `--leader-elect`, a replica that does not lead answers the gateways' calls as usual
/// (its snapshot follows the fleet as the leader's does) but closes the connection after each
/// answer. The Service reaches the leader alone, but a gateway's kept-alive connection (a
/// poll every few seconds never lets it idle out) stays on the replica it was opened to
/// (kube-proxy balances connections, not requests): without the close, a gateway would keep
/// polling a former leader for as long as that connection lives.
async fn close_unless_leading(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let mut response = next.run(request).await;
    // Judged once the answer is ready: a poll held through a change of leader closes too.
    if state.leadership.as_ref().is_some_and(|l| !l.is_leading()) {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
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

/// Longest a snapshot poll is held (`wait_ms` above it is cut to it): a bound on what one
/// idle poll keeps open, far below any proxy's idle-connection timeout.
pub const MAX_POLL_WAIT: Duration = Duration::from_secs(30);

/// An optional unsigned query parameter; `Err` is the message of the 400 answer.
fn query_u64(query: &HashMap<String, String>, name: &str) -> Result<Option<u64>, String> {
    match query.get(name).map(|v| v.trim()).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(text) => text
            .parse::<u64>()
            .map(Some)
            .map_err(|_| format!("{name} must be an unsigned integer, got {text:?}\n")),
    }
}

/// `GET /v1/snapshot[?version=N[&wait_ms=W]]`: 304 when the caller already holds the current
/// version. With `wait_ms` that answer is held until a newer version is published (answered
/// at once, 200) or W ms pass (304): a long poll. An idle fleet then costs a gateway one poll
/// per W instead of one per refresh period, and a new snapshot reaches it as soon as it is
/// built instead of at its next poll. While the snapshot is [`frozen`] the 304 becomes a 503
/// (with the version header and the reason), so a gateway's staleness bound runs out.
async fn snapshot(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let node = headers
        .get(crate::xds::NODE_HEADER)
        .and_then(|v| v.to_str().ok());
    let machine = headers
        .get(pd_router_filter::core::engine::trtllm::MACHINE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(pd_router_filter::core::engine::trtllm::parse_machine_header);
    let build = headers
        .get(pd_router_filter::core::build::BUILD_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(pd_router_filter::core::build::label_of);
    if let Some((replica, machine)) = machine {
        state
            .gateways
            .observe(replica, machine, build, Instant::now());
    }
    let mut response = snapshot_answer(&state, &query).await;
    // Answered at the end of a held poll: an ACK that came meanwhile counts.
    if let Some(here) = state.eds_here.answer(node) {
        response
            .headers_mut()
            .insert(crate::xds::EDS_HERE_HEADER, HeaderValue::from_static(here));
    }
    response
}

async fn snapshot_answer(state: &AppState, query: &HashMap<String, String>) -> Response {
    let (held, wait_ms) = match (query_u64(query, "version"), query_u64(query, "wait_ms")) {
        (Ok(held), Ok(wait_ms)) => (held, wait_ms.unwrap_or(0)),
        (Err(message), _) | (_, Err(message)) => {
            return (StatusCode::BAD_REQUEST, message).into_response()
        }
    };
    let mut published = current(state);
    if held == Some(published.version) && wait_ms > 0 {
        let wait = Duration::from_millis(wait_ms).min(MAX_POLL_WAIT);
        let _waiting = state.stats.poll_waiting();
        published = newer_than(state, published.version, wait).await;
    }
    if held == Some(published.version) {
        // "Not modified" would confirm a snapshot that nothing updates any more, and the
        // filter treats every confirmed snapshot as fresh: answer what its staleness handling
        // counts as a failed poll instead (the version header says pd-control answered).
        // A caller without this version still gets it below: its pods beat no pods, and the
        // next poll, which names it, lands here.
        if let Some(why) = frozen(&state.stats, state.loop_stale_after, Instant::now()) {
            state.stats.poll_answered(PollAnswer::Frozen);
            return respond(
                StatusCode::SERVICE_UNAVAILABLE,
                published.version,
                Some(PLAIN_TEXT),
                Body::from(why),
            );
        }
        state.stats.poll_answered(PollAnswer::NotModified);
        return respond(
            StatusCode::NOT_MODIFIED,
            published.version,
            None,
            Body::empty(),
        );
    }
    state.stats.poll_answered(PollAnswer::Snapshot);
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

/// `POST /v1/limits/admit`: the body is a JSON object naming a `user`, a `model` with its
/// `rps_limit` and `rps_window_ms`, or both ([`crate::limits::parse_admit`]; 400 with a text
/// body otherwise). The answer is always 200 with a JSON [`crate::limits::Answer`], so the
/// gateway reads one shape whatever happened and decides itself what a `store_error` means
/// for the request.
async fn limits_admit(State(state): State<AppState>, body: Bytes) -> Response {
    admission_answer(state, crate::limits::parse_admit(&body)).await
}

/// `POST /v1/limits/cancel`: withdraws the admission whose body (its `id` required) this is,
/// for a request the gateway refused without the admission's answer
/// ([`crate::limits::parse_cancel`], `limits::cancel`). Answered as an admission is.
async fn limits_cancel(State(state): State<AppState>, body: Bytes) -> Response {
    admission_answer(state, crate::limits::parse_cancel(&body)).await
}

async fn admission_answer(
    state: AppState,
    parsed: Result<crate::limits::AdmitRequest, crate::limits::AdmitError>,
) -> Response {
    let request = match parsed {
        Ok(request) => request,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    // Spawned, so a gateway that stops waiting cannot cut a withdrawal (or the admission it
    // withdraws) off between its Redis calls (see `limits::cancel`).
    let limits = state.limits.clone();
    let answer = match tokio::spawn(async move { limits.admit(&request).await }).await {
        Ok(answer) => answer,
        Err(e) => {
            let message = format!("the admission did not run: {e}\n");
            return (StatusCode::INTERNAL_SERVER_ERROR, message).into_response();
        }
    };
    match serde_json::to_vec(&answer) {
        Ok(json) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            json,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot render the answer: {e}\n"),
        )
            .into_response(),
    }
}

/// `POST /v1/limits/usage`: `{"user": tokens, ...}` added to the users' token counters.
/// 204 when added (or limits are off), 400 for a body that is not such an object, 503 when
/// Redis did not take all of them (those it took stay added). With `x-pd-report-id`, a report
/// sent again adds only the users not added before.
async fn limits_usage(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let usage = match crate::limits::parse_usage(&body) {
        Ok(usage) => usage,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    let id = match headers
        .get(REPORT_ID_HEADER)
        .map(|v| report_id(v.as_bytes()))
    {
        None => None,
        Some(Some(id)) => Some(id),
        Some(None) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("{REPORT_ID_HEADER} must be 1 to 128 of [0-9A-Za-z-]\n"),
            )
                .into_response()
        }
    };
    // Spawned, so a caller that gives up mid-way cannot cut an addition short and leave the
    // report's record unsettled.
    let limits = state.limits.clone();
    let added = tokio::spawn(async move { limits.add_usage(id.as_deref(), &usage).await });
    match added.await {
        Ok(Ok(())) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the token report was not added: {e}\n"),
        )
            .into_response(),
    }
}

/// `POST /v1/limits/release`: `{"refunds": [{"model", "rps_window_ms", "age_ms"}, ...]}`,
/// requests the gateway admitted and then could not route, given back to their model's
/// counter (see `limits::refund`). 200 with `{"given_back": n, "skipped": m}` (zeros when
/// limits are off), 400 for a body outside the contract, 503 when Redis did not run it.
/// Not repeatable: a caller that got no answer must not send the same refunds again.
async fn limits_release(State(state): State<AppState>, body: Bytes) -> Response {
    let refunds = match crate::limits::parse_release(&body) {
        Ok(refunds) => refunds,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    // Spawned, so a caller that gives up cannot cut the script off between sending it and
    // counting what it did.
    let limits = state.limits.clone();
    let released = tokio::spawn(async move { limits.release(&refunds).await });
    match released.await {
        Ok(Ok(released)) => axum::Json(released).into_response(),
        Ok(Err(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("nothing given back: {e}\n"),
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the release did not run: {e}\n"),
        )
            .into_response(),
    }
}

/// The `external` strategy: the filter's candidates in, what to do with the request out
/// (`crate::external::Answer`). 404 when no service is configured, 400 for a body that is not
/// an ask. Spawned, so a filter that stops waiting leaves the exchange to settle the circuit.
async fn route_external(State(state): State<AppState>, body: Bytes) -> Response {
    let Some(router) = state.external.clone() else {
        return (StatusCode::NOT_FOUND, "no external router is configured\n").into_response();
    };
    let ask: crate::external::protocol::Ask = match serde_json::from_slice(&body) {
        Ok(ask) => ask,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("not an external routing ask: {e}\n"),
            )
                .into_response()
        }
    };
    let live = state.live.borrow().clone();
    let decided = tokio::spawn(async move { router.decide(&ask, &live).await });
    match decided.await {
        Ok(answer) => axum::Json(answer).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the decision did not run: {e}\n"),
        )
            .into_response(),
    }
}

/// The request header naming a token report (the filter's `user_limits::REPORT_ID_HEADER`).
const REPORT_ID_HEADER: &str = "x-pd-report-id";

/// A report id as the filter makes them (`<hex>-<n>`): 1 to 128 ASCII letters, digits and
/// `-`, else `None`. The id goes into Redis keys (`pd-router:usage-report:{id}:{user}`), so a
/// `:` in it could name another report's markers for another user, and mark that user's
/// tokens as already added.
fn report_id(raw: &[u8]) -> Option<String> {
    let valid = (1..=128).contains(&raw.len())
        && raw.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'-');
    // Only ASCII passed the check, so the conversion cannot fail.
    valid
        .then(|| std::str::from_utf8(raw).ok().map(str::to_string))
        .flatten()
}

/// The first snapshot newer than `version`, or the current one after `wait`. Returns early
/// when the control loop ends and drops the sender (pd-control shuts down, or the loop
/// panicked), so a held poll never delays a graceful stop.
async fn newer_than(state: &AppState, version: u64, wait: Duration) -> Arc<Published> {
    let mut snapshots = state.snapshots.clone();
    let newer = snapshots.wait_for(|p| p.version != version);
    if let Ok(Ok(published)) = tokio::time::timeout(wait, newer).await {
        return published.clone();
    }
    current(state)
}

async fn snapshot_json(State(state): State<AppState>) -> Response {
    let live = state.live.borrow().clone();
    match serde_json::to_vec_pretty(&*live) {
        Ok(json) => respond(
            StatusCode::OK,
            live.version,
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

/// 200 while the snapshot reflects the fleet and its load and keeps doing so, and (with
/// `--leader-elect`) the pod's label sends this replica no traffic it should not serve; 503
/// with the reason otherwise.
async fn readyz(State(state): State<AppState>) -> Response {
    let why = unready(&state.stats, state.loop_stale_after, Instant::now()).or_else(|| {
        let leadership = state.leadership.as_ref()?;
        if state.stats.has_ended(Task::LeaderElection) {
            return Some(
                "leader election ended: this replica's label no longer follows the lease (restart pd-control)\n"
                    .to_string(),
            );
        }
        leadership.unready_reason()
    });
    match why {
        None => (StatusCode::OK, "ready\n").into_response(),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
    }
}

/// For a liveness probe: `/readyz` without the leadership part. A replica unready only
/// because its label could not be written (the API server down or refusing it) must not be
/// restarted for it: a restart during an API outage cannot even load the fleet, and the
/// leader then serving alone would go with it.
async fn livez(State(state): State<AppState>) -> Response {
    match unready(&state.stats, state.loop_stale_after, Instant::now()) {
        None => (StatusCode::OK, "live\n").into_response(),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
    }
}

/// Why the snapshot does not (or no longer) reflect the fleet and its load, if it does not:
/// before the first fleet and scrape round, once the snapshot is [`frozen`], and once the
/// fleet source ended (the pods' metrics stay current, but pods that come and go are no
/// longer seen). A replica in this state also may not lead.
pub(crate) fn unready(stats: &Stats, loop_stale_after: Duration, now: Instant) -> Option<String> {
    if !stats.is_ready() {
        Some("waiting for the fleet and a first scrape round\n".to_string())
    } else if let Some(why) = frozen(stats, loop_stale_after, now) {
        Some(why)
    } else if stats.has_ended(Task::FleetSource) {
        Some(
            "the fleet source ended: pods that come and go are no longer seen (restart pd-control)\n"
                .to_string(),
        )
    } else {
        None
    }
}

/// Why the served snapshot no longer follows the fleet and the pods' load, if it does not:
/// the control loop ended, or has not completed an iteration for longer than
/// `loop_stale_after` (hung on the endpoint file's disk, say).
fn frozen(stats: &Stats, loop_stale_after: Duration, now: Instant) -> Option<String> {
    if stats.has_ended(Task::ControlLoop) {
        return Some(
            "the control loop ended: the snapshot no longer changes (restart pd-control)\n"
                .to_string(),
        );
    }
    let age = stats.loop_age(now);
    (age > loop_stale_after).then(|| {
        format!(
            "the control loop has not completed an iteration for {:.1}s (bound {:.1}s): the snapshot is frozen\n",
            age.as_secs_f64(),
            loop_stale_after.as_secs_f64()
        )
    })
}

async fn metrics(State(state): State<AppState>) -> Response {
    let published = current(&state);
    let mut text = render_metrics(
        &published,
        &state.stats,
        state.source_kind,
        crate::unix_ms_now(),
        state.stats.loop_age(Instant::now()),
    );
    for (name, kind, help, value) in state.replicas.metrics() {
        family(&mut text, name, kind, help, &[(String::new(), value)]);
    }
    let leadership = match &state.leadership {
        Some(leadership) => leadership.metrics(),
        None => crate::leader::metrics_without_election(),
    };
    for (name, kind, help, value) in leadership {
        family(&mut text, name, kind, help, &[(String::new(), value)]);
    }
    family(
        &mut text,
        "pd_control_trt_machine_id_shared_gateways",
        "gauge",
        "Gateway processes polling in the last 40 s whose AIBRIX_TRT_MACHINE_ID another one has too: with TensorRT-LLM pods their disagg_request_ids can collide (see the log).",
        &[(
            String::new(),
            state.gateways.shared(Instant::now()).to_string(),
        )],
    );
    let builds: Vec<(String, String)> = state
        .gateways
        .builds(Instant::now())
        .into_iter()
        .map(|(build, n)| (format!("{{build=\"{}\"}}", label(&build)), n.to_string()))
        .collect();
    family(
        &mut text,
        "pd_control_gateway_builds",
        "gauge",
        "Gateway processes polling in the last 40 s by the filter build they run (unknown: a filter older than the build header); two builds outside a rollout mean a filter update missed some gateways.",
        &builds,
    );
    for (name, kind, help, samples) in state.limits.metrics() {
        family(&mut text, name, kind, help, &samples);
    }
    if let Some(router) = &state.external {
        for (name, kind, help, samples) in router.metrics() {
            family(&mut text, name, kind, help, &samples);
        }
    }
    ([(header::CONTENT_TYPE, PROMETHEUS_TEXT)], text).into_response()
}

/// A Prometheus label value: backslash, quote and newline escaped.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One metric family: HELP, TYPE and its samples (`labels` is `{...}` or empty).
fn family(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, String)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, value) in samples {
        let _ = writeln!(out, "{name}{labels} {value}");
    }
}

/// Every pod of the snapshot once, as `(namespace, name)`, sorted. A pod appears under each
/// model it serves (its base model and every LoRA adapter it loaded), and a series per
/// appearance would repeat one label set, which Prometheus refuses as a duplicate.
fn fleet_pods(published: &Published) -> BTreeSet<(&str, &str)> {
    published
        .snapshot
        .models
        .iter()
        .flat_map(|m| &m.pods)
        .map(|p| (p.namespace.as_str(), p.name.as_str()))
        .collect()
}

/// A pod's role as the metrics label it: the roles PD routing knows, `none`, or `other`
/// (a role label's value is the operator's text; the series stay few and predictable).
fn role_label(role: &str) -> &str {
    match role {
        "prefill" | "decode" => role,
        "" => "none",
        _ => "other",
    }
}

/// The engine load each pod was routed on, as the snapshot carries it: a slow or full pod,
/// or one whose metrics stopped, is found from Prometheus without the snapshot API (which
/// the NetworkPolicy keeps to the gateways). Once per pod (see [`fleet_pods`]); values only
/// for pods scraped at least once.
fn engine_view(out: &mut String, published: &Published, now_ms: i64) {
    let mut pods: BTreeMap<(&str, &str), &crate::proto::Pod> = BTreeMap::new();
    for pod in published.snapshot.models.iter().flat_map(|m| &m.pods) {
        pods.entry((pod.namespace.as_str(), pod.name.as_str()))
            .or_insert(pod);
    }
    type Read = fn(&crate::proto::PodMetrics, i64) -> f64;
    let gauges: [(&str, &str, Read); 7] = [
        (
            "pd_control_pod_running_requests",
            "Requests the engine reports running, as last scraped.",
            |m, _| m.running,
        ),
        (
            "pd_control_pod_waiting_requests",
            "Requests the engine reports queued, as last scraped.",
            |m, _| m.waiting,
        ),
        (
            "pd_control_pod_kv_cache_usage",
            "The engine's KV-cache usage, 0 to 1, as last scraped.",
            |m, _| m.kv_cache_usage,
        ),
        (
            "pd_control_pod_ttft_avg_seconds",
            "The engine's mean time to first token over the last scrape interval.",
            |m, _| m.ttft_avg_seconds,
        ),
        (
            "pd_control_pod_tpot_avg_seconds",
            "The engine's mean time per output token over the last scrape interval.",
            |m, _| m.tpot_avg_seconds,
        ),
        (
            "pd_control_pod_metrics_age_seconds",
            "Time since the pod's last successful scrape.",
            |m, now| now.saturating_sub(m.last_scrape_unix_ms).max(0) as f64 / 1000.0,
        ),
        (
            "pd_control_pod_metrics_stale",
            "1 when the pod's last scrape failed or is older than the staleness bound: the gateways route on it without its load.",
            |m, _| if m.stale { 1.0 } else { 0.0 },
        ),
    ];
    for (name, help, read) in gauges {
        let samples: Vec<(String, String)> = pods
            .iter()
            .filter_map(|((namespace, pod_name), pod)| {
                let metrics = pod.metrics.as_ref().filter(|m| m.present)?;
                Some((
                    format!(
                        "{{namespace=\"{}\",pod=\"{}\",role=\"{}\"}}",
                        label(namespace),
                        label(pod_name),
                        role_label(&pod.role)
                    ),
                    read(metrics, now_ms).to_string(),
                ))
            })
            .collect();
        family(out, name, "gauge", help, &samples);
    }
}

/// pd-control's own metrics in the Prometheus text format, at `now_ms`, when the control
/// loop last completed an iteration `loop_age` ago ([`Stats::loop_age`], monotonic).
pub fn render_metrics(
    published: &Published,
    stats: &Stats,
    source_kind: &str,
    now_ms: i64,
    loop_age: Duration,
) -> String {
    let mut out = String::new();
    let seconds_since = |ms: i64| (now_ms.saturating_sub(ms).max(0) as f64 / 1000.0).to_string();
    let plain = |value: String| vec![(String::new(), value)];

    family(
        &mut out,
        "pd_control_snapshot_version",
        "gauge",
        "Version of the snapshot being served.",
        &plain(published.version.to_string()),
    );
    family(
        &mut out,
        "pd_control_snapshot_age_seconds",
        "gauge",
        "Time since the served snapshot was built (it is rebuilt whenever the fleet or a pod's metrics change).",
        &plain(seconds_since(published.snapshot.generated_unix_ms)),
    );
    family(
        &mut out,
        "pd_control_loop_age_seconds",
        "gauge",
        "Time since the control loop last completed an iteration (it does every --refresh-interval at least); past max(10 x --refresh-interval, 5s) /readyz fails and polls get 503 instead of 304.",
        &plain(loop_age.as_secs_f64().to_string()),
    );

    // Pods by model, role and readiness; every combination present in the fleet, zeros kept
    // for the readiness a group has none of, so a group going all-unready reads 0, not absent.
    // A ready pod whose engine refuses connections counts as `unreachable`, one that sits on
    // its requests as `stalled`, not as `ready`.
    let mut pods: BTreeMap<(&str, &str), [u64; 4]> = BTreeMap::new();
    for model in &published.snapshot.models {
        for pod in &model.pods {
            let role = role_label(&pod.role);
            let state = match (pod.ready, pod.unreachable, pod.stalled) {
                (false, _, _) => 1,
                (true, true, _) => 2,
                (true, false, true) => 3,
                (true, false, false) => 0,
            };
            pods.entry((model.name.as_str(), role)).or_default()[state] += 1;
        }
    }
    let samples: Vec<(String, String)> = pods
        .iter()
        .flat_map(|((model, role), counts)| {
            ["ready", "not_ready", "unreachable", "stalled"]
                .into_iter()
                .zip(counts)
                .map(move |(state, n)| {
                    (
                        format!(
                            "{{model=\"{}\",role=\"{role}\",state=\"{state}\"}}",
                            label(model)
                        ),
                        n.to_string(),
                    )
                })
        })
        .collect();
    family(
        &mut out,
        "pd_control_pods",
        "gauge",
        "Pods in the served snapshot by model, role (prefill, decode, other, none) and state (ready, not_ready, unreachable: ready but refusing scrape connections, stalled: ready but making no progress on its running requests).",
        &samples,
    );

    let samples: Vec<(String, String)> = fleet_pods(published)
        .into_iter()
        .map(|(namespace, name)| {
            let key = format!("{namespace}/{name}");
            (
                format!(
                    "{{namespace=\"{}\",pod=\"{}\"}}",
                    label(namespace),
                    label(name)
                ),
                stats.scrape_errors_of(&key).to_string(),
            )
        })
        .collect();
    family(
        &mut out,
        "pd_control_scrape_errors_total",
        "counter",
        "Engine metrics scrapes that failed (connect, timeout, status, body), per pod of the fleet.",
        &samples,
    );
    engine_view(&mut out, published, now_ms);

    let latency = stats.scrape_latency_snapshot();
    let _ = writeln!(
        out,
        "# HELP pd_control_scrape_latency_seconds Time of one engine metrics scrape (the HTTP exchange and parse).\n# TYPE pd_control_scrape_latency_seconds histogram"
    );
    for (bound, count) in &latency.cumulative {
        let le = if bound.is_infinite() {
            "+Inf".to_string()
        } else {
            bound.to_string()
        };
        let _ = writeln!(
            out,
            "pd_control_scrape_latency_seconds_bucket{{le=\"{le}\"}} {count}"
        );
    }
    let _ = writeln!(
        out,
        "pd_control_scrape_latency_seconds_sum {}",
        latency.sum_seconds
    );
    let _ = writeln!(
        out,
        "pd_control_scrape_latency_seconds_count {}",
        latency.count
    );

    family(
        &mut out,
        "pd_control_scrape_duration_seconds",
        "gauge",
        "Wall time of the last completed scrape round.",
        &plain(stats.scrape_duration_seconds().to_string()),
    );
    family(
        &mut out,
        "pd_control_unauthorized_requests_total",
        "counter",
        "Snapshot API requests refused for a missing or wrong token (--snapshot-token-file).",
        &plain(stats.unauthorized_total().to_string()),
    );
    family(
        &mut out,
        "pd_control_snapshot_polls_waiting",
        "gauge",
        "Snapshot polls held until a newer version is published (wait_ms); about one per connected gateway.",
        &plain(stats.polls_waiting().to_string()),
    );
    family(
        &mut out,
        "pd_control_snapshot_polls_total",
        "counter",
        "Snapshot polls answered, by answer: snapshot (200), not_modified (304), or frozen (503 instead of a 304: the control loop is stuck or has ended).",
        &[
            (
                "{answer=\"snapshot\"}".to_string(),
                stats.polls_answered(PollAnswer::Snapshot).to_string(),
            ),
            (
                "{answer=\"not_modified\"}".to_string(),
                stats.polls_answered(PollAnswer::NotModified).to_string(),
            ),
            (
                "{answer=\"frozen\"}".to_string(),
                stats.polls_answered(PollAnswer::Frozen).to_string(),
            ),
        ],
    );
    family(
        &mut out,
        "pd_control_fleet_reload_errors_total",
        "counter",
        "Fleet updates rejected (unreadable, invalid, or holding no document); the previous fleet was kept.",
        &plain(stats.fleet_reload_errors_total().to_string()),
    );
    family(
        &mut out,
        "pd_control_config_problem_pods",
        "gauge",
        "Pods whose model.aibrix.ai/config annotation has values without effect (does not parse, routingConfig values dropped as invalid, unknown score policies); each is logged once as a warning.",
        &plain(stats.config_problem_pods().to_string()),
    );
    family(
        &mut out,
        "pd_control_eds_write_errors_total",
        "counter",
        "Failed writes of the retrying cluster's endpoint file (--eds-file); the previous file stays in force.",
        &plain(stats.eds_write_errors_total().to_string()),
    );
    family(
        &mut out,
        "pd_control_xds_streams",
        "gauge",
        "Gateways' EDS streams open on --xds-listen (one per retrying cluster per gateway process).",
        &plain(stats.xds_streams().to_string()),
    );
    family(
        &mut out,
        "pd_control_xds_acks_total",
        "counter",
        "Endpoint listings gateways took (an ACK on their EDS stream). Until the first, snapshots say the gateways' retrying cluster may not know the pods (no stand-ins), unless --eds-file is written too.",
        &plain(stats.xds_acks_total().to_string()),
    );
    family(
        &mut out,
        "pd_control_xds_nacks_total",
        "counter",
        "Endpoint listings a gateway refused (a NACK on its EDS stream); it keeps the previous one.",
        &plain(stats.xds_nacks_total().to_string()),
    );
    if let Some(ms) = stats.last_fleet_event_ms() {
        family(
            &mut out,
            "pd_control_fleet_event_age_seconds",
            "gauge",
            "Time since the fleet source last delivered a change (a Kubernetes pod event, a fleet-file reload).",
            &[(
                format!("{{source=\"{}\"}}", label(source_kind)),
                seconds_since(ms),
            )],
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto;

    fn pod(name: &str, role: &str, ready: bool) -> proto::Pod {
        proto::Pod {
            namespace: "ns".into(),
            name: name.into(),
            role: role.into(),
            ready,
            ..Default::default()
        }
    }

    fn published() -> Published {
        let snapshot = proto::Snapshot {
            version: 4,
            generated_unix_ms: 10_000,
            models: vec![proto::Model {
                name: "m\"1".into(),
                pods: vec![
                    proto::Pod {
                        metrics: Some(proto::PodMetrics {
                            present: true,
                            running: 3.0,
                            waiting: 1.0,
                            kv_cache_usage: 0.5,
                            ttft_avg_seconds: 0.25,
                            tpot_avg_seconds: 0.02,
                            last_scrape_unix_ms: 12_000,
                            ..Default::default()
                        }),
                        ..pod("p0", "prefill", true)
                    },
                    proto::Pod {
                        // Scraped once, long ago: its load is no longer routed on.
                        metrics: Some(proto::PodMetrics {
                            present: true,
                            last_scrape_unix_ms: 2_500,
                            stale: true,
                            ..Default::default()
                        }),
                        ..pod("d0", "decode", true)
                    },
                    pod("d1", "decode", false),
                    proto::Pod {
                        unreachable: true,
                        ..pod("d2", "decode", true)
                    },
                    proto::Pod {
                        stalled: true,
                        ..pod("p1", "prefill", true)
                    },
                    pod("c0", "all", true),
                ],
                labels: None,
            }],
            user_limits: false,
            eds: false,
            external_router: None,
        };
        Published {
            version: 4,
            snapshot: Arc::new(snapshot),
            bytes: Default::default(),
        }
    }

    #[test]
    fn pods_errors_ages_and_latency_render_as_prometheus_text() {
        let stats = Stats::default();
        stats.scrape_error("ns/d1");
        stats.scrape_error("ns/gone");
        stats.scrape_latency(Duration::from_millis(3));
        stats.fleet_event(9_000);
        let text = render_metrics(
            &published(),
            &stats,
            "kubernetes",
            12_500,
            Duration::from_millis(1_250),
        );
        for line in [
            "pd_control_snapshot_version 4",
            "pd_control_snapshot_age_seconds 2.5",
            "pd_control_loop_age_seconds 1.25",
            "pd_control_pods{model=\"m\\\"1\",role=\"decode\",state=\"ready\"} 1",
            "pd_control_pods{model=\"m\\\"1\",role=\"decode\",state=\"not_ready\"} 1",
            "pd_control_pods{model=\"m\\\"1\",role=\"decode\",state=\"unreachable\"} 1",
            "pd_control_pods{model=\"m\\\"1\",role=\"prefill\",state=\"unreachable\"} 0",
            "pd_control_pods{model=\"m\\\"1\",role=\"prefill\",state=\"stalled\"} 1",
            "pd_control_pods{model=\"m\\\"1\",role=\"prefill\",state=\"ready\"} 1",
            "pd_control_pods{model=\"m\\\"1\",role=\"other\",state=\"ready\"} 1",
            "pd_control_scrape_errors_total{namespace=\"ns\",pod=\"d1\"} 1",
            "pd_control_scrape_errors_total{namespace=\"ns\",pod=\"p0\"} 0",
            "pd_control_scrape_latency_seconds_bucket{le=\"0.0025\"} 0",
            "pd_control_scrape_latency_seconds_bucket{le=\"0.005\"} 1",
            "pd_control_scrape_latency_seconds_bucket{le=\"+Inf\"} 1",
            "pd_control_scrape_latency_seconds_count 1",
            "pd_control_fleet_event_age_seconds{source=\"kubernetes\"} 3.5",
            "pd_control_pod_running_requests{namespace=\"ns\",pod=\"p0\",role=\"prefill\"} 3",
            "pd_control_pod_waiting_requests{namespace=\"ns\",pod=\"p0\",role=\"prefill\"} 1",
            "pd_control_pod_kv_cache_usage{namespace=\"ns\",pod=\"p0\",role=\"prefill\"} 0.5",
            "pd_control_pod_ttft_avg_seconds{namespace=\"ns\",pod=\"p0\",role=\"prefill\"} 0.25",
            "pd_control_pod_tpot_avg_seconds{namespace=\"ns\",pod=\"p0\",role=\"prefill\"} 0.02",
            "pd_control_pod_metrics_age_seconds{namespace=\"ns\",pod=\"p0\",role=\"prefill\"} 0.5",
            "pd_control_pod_metrics_stale{namespace=\"ns\",pod=\"p0\",role=\"prefill\"} 0",
            "pd_control_pod_metrics_age_seconds{namespace=\"ns\",pod=\"d0\",role=\"decode\"} 10",
            "pd_control_pod_metrics_stale{namespace=\"ns\",pod=\"d0\",role=\"decode\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing from:\n{text}"
            );
        }
        assert!(
            !text.contains("gone"),
            "only pods of the served snapshot are exported"
        );
        assert!(
            !text.contains("pd_control_pod_running_requests{namespace=\"ns\",pod=\"d1\""),
            "a pod never scraped has no engine values: {text}"
        );
    }

    #[test]
    fn a_pod_serving_lora_adapters_is_one_series() {
        let mut published = published();
        let snapshot = Arc::make_mut(&mut published.snapshot);
        let base = snapshot.models[0].pods.clone();
        // p0 has loaded two adapters: it sits under its model and under each of them.
        for adapter in ["chat-lora", "sql-lora"] {
            snapshot.models.push(proto::Model {
                name: adapter.into(),
                pods: vec![base[0].clone()],
                labels: None,
            });
        }
        let stats = Stats::default();
        stats.scrape_error("ns/p0");
        let text = render_metrics(&published, &stats, "file", 12_500, Duration::ZERO);
        let p0 = "pd_control_scrape_errors_total{namespace=\"ns\",pod=\"p0\"} 1";
        assert_eq!(text.lines().filter(|l| *l == p0).count(), 1, "{text}");
        let mut series = BTreeSet::new();
        for sample in text.lines().filter(|l| !l.starts_with('#')) {
            let (name_and_labels, _) = sample.rsplit_once(' ').expect("a sample");
            assert!(
                series.insert(name_and_labels),
                "{name_and_labels} twice in:\n{text}"
            );
        }
    }

    /// The server's state over `stats`, serving [`published`] from `snapshots`.
    fn state(stats: Arc<Stats>, snapshots: watch::Receiver<Arc<Published>>) -> AppState {
        AppState {
            snapshots,
            live: watch::channel(Arc::new(proto::Snapshot::default())).1,
            stats,
            replicas: Arc::new(ReplicaBook::new(Duration::from_secs(5), None).expect("book")),
            limits: Arc::new(UserLimits::disabled()),
            source_kind: "file",
            token: None,
            eds_here: crate::xds::EdsHere::Off,
            external: None,
            loop_stale_after: Duration::from_secs(3600),
            gateways: Default::default(),
            leadership: None,
        }
    }

    async fn body_text(response: Response) -> String {
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .expect("body");
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// A control loop that panicked drops the snapshot sender: a poll held for the current
    /// version ends at once, with a 503 rather than "not modified", and `/readyz` fails.
    #[tokio::test]
    async fn a_control_loop_that_ended_fails_readiness_and_turns_not_modified_into_503() {
        let stats = Arc::new(Stats::default());
        stats.fleet_loaded();
        stats.round_finished(Duration::ZERO);
        let (tx, rx) = watch::channel(Arc::new(published()));
        let state = state(stats.clone(), rx);
        assert_eq!(readyz(State(state.clone())).await.status(), StatusCode::OK);
        let held: HashMap<String, String> = [("version", "4"), ("wait_ms", "60000")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let fresh: HashMap<String, String> = HashMap::new();

        stats.task_ended(Task::ControlLoop);
        drop(tx);
        let answer = tokio::time::timeout(Duration::from_secs(5), snapshot_answer(&state, &held))
            .await
            .expect("answered at once");
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            answer.headers().get(VERSION_HEADER),
            Some(&HeaderValue::from(4u64))
        );
        assert!(body_text(answer).await.contains("control loop ended"));
        assert_eq!(
            snapshot_answer(&state, &fresh).await.status(),
            StatusCode::OK,
            "a caller without the version still gets it"
        );
        let ready = readyz(State(state)).await;
        assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(body_text(ready).await.contains("control loop ended"));
        assert_eq!(stats.polls_answered(PollAnswer::Frozen), 1);
    }

    #[tokio::test]
    async fn a_loop_silent_past_its_bound_is_frozen_and_a_fleet_source_gone_is_unready() {
        let stats = Arc::new(Stats::default());
        stats.fleet_loaded();
        stats.round_finished(Duration::ZERO);
        let now = Instant::now();
        stats.loop_turned(now);
        let (_tx, rx) = watch::channel(Arc::new(published()));
        let state = AppState {
            loop_stale_after: Duration::from_secs(5),
            ..state(stats.clone(), rx)
        };
        assert_eq!(
            frozen(
                &state.stats,
                state.loop_stale_after,
                now + Duration::from_secs(5)
            ),
            None
        );
        let why = frozen(
            &state.stats,
            state.loop_stale_after,
            now + Duration::from_secs(6),
        )
        .expect("frozen");
        assert!(why.contains("for 6.0s (bound 5.0s)"), "{why}");

        stats.task_ended(Task::FleetSource);
        assert_eq!(
            frozen(&state.stats, state.loop_stale_after, now),
            None,
            "the loop itself still runs"
        );
        let ready = readyz(State(state)).await;
        assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(body_text(ready).await.contains("fleet source ended"));
    }

    #[test]
    fn no_fleet_event_yet_means_no_age_sample() {
        let text = render_metrics(&published(), &Stats::default(), "file", 1, Duration::ZERO);
        assert!(!text.contains("pd_control_fleet_event_age_seconds"));
        assert!(
            text.contains("pd_control_snapshot_age_seconds 0\n"),
            "a clock behind the snapshot reads 0"
        );
    }
}
