//! HTTP side of the simulator: each pod's axum router (OpenAI endpoints, `/metrics`,
//! `/health`, `/sim/requests`), and listeners that can be closed with every open connection,
//! so that removing a pod from the fleet looks to the router like the pod dying.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::engine;
use crate::faults::{Drawn, FaultError, FaultKind, FaultSpec};
use crate::log::{header_map, next_seq, unix_ms, LogEntry};
use crate::metrics::{self, Engine};
use crate::pod::{Job, JobSpec, KvPull, PodState, Registry};
use crate::prefix::block_hashes;
use crate::sim::fault_error;
use crate::vllm::{self, ApiError, Endpoint, Leg, ResponseMeta, SimRequest};

/// What a pod's handlers share.
#[derive(Debug, Clone)]
pub struct PodCtx {
    pub pod: Arc<PodState>,
    pub registry: Arc<Registry>,
}

/// The router of one simulated pod.
///
/// `/metrics` follows the pod's engine label: vLLM's or SGLang's Prometheus text, or for
/// TRT-LLM its JSON iteration stats, with the Prometheus text on `/prometheus/metrics`.
pub fn pod_router(ctx: PodCtx) -> Router {
    let engine = Engine::from_label(&ctx.pod.record.engine);
    let router = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models));
    let router = match engine {
        Engine::Trtllm => router
            .route("/metrics", get(trtllm_iteration_stats))
            .route("/prometheus/metrics", get(metrics_page)),
        Engine::Vllm | Engine::Sglang => router.route("/metrics", get(metrics_page)),
    };
    router
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/ping", get(|| async { StatusCode::OK }))
        .route(
            "/version",
            get(|| async {
                json_response(
                    StatusCode::OK,
                    &serde_json::json!({"version": "0.10.1-sim"}),
                )
            }),
        )
        .route("/sim/requests", get(pod_requests).delete(pod_clear))
        .route(
            "/sim/faults",
            get(pod_faults).post(pod_arm).delete(pod_clear_faults),
        )
        .fallback(not_found)
        .with_state(ctx)
}

async fn not_found() -> Response {
    json_response(
        StatusCode::NOT_FOUND,
        &serde_json::json!({"detail": "Not Found"}),
    )
}

async fn completions(State(ctx): State<PodCtx>, headers: HeaderMap, body: Bytes) -> Response {
    handle(ctx, Endpoint::Completions, headers, body).await
}

async fn chat_completions(State(ctx): State<PodCtx>, headers: HeaderMap, body: Bytes) -> Response {
    handle(ctx, Endpoint::Chat, headers, body).await
}

async fn models(State(ctx): State<PodCtx>) -> Response {
    json_response(
        StatusCode::OK,
        &vllm::models_body(&ctx.pod.record.model, unix_secs()),
    )
}

/// The pod's Prometheus text in its engine's names.
pub fn exposition(pod: &PodState) -> String {
    let record = &pod.record;
    let m = pod.metrics();
    match Engine::from_label(&record.engine) {
        Engine::Vllm => metrics::render(&record.model, &m),
        Engine::Sglang => {
            metrics::render_sglang(&record.model, metrics::sglang_engine_type(&record.role), &m)
        }
        Engine::Trtllm => metrics::render_trtllm(&record.model, std::process::id(), &m),
    }
}

async fn trtllm_iteration_stats(State(ctx): State<PodCtx>) -> Response {
    let m = ctx.pod.metrics();
    let iter = if m.running + m.waiting > 0 {
        ctx.pod.next_iteration()
    } else {
        0
    };
    let secs = unix_secs() % 86_400;
    let timestamp = format!("{:02}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60);
    json_response(
        StatusCode::OK,
        &metrics::render_trtllm_iteration_stats(iter, &timestamp, &m),
    )
}

async fn metrics_page(State(ctx): State<PodCtx>) -> Response {
    let text = exposition(&ctx.pod);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

async fn pod_requests(State(ctx): State<PodCtx>) -> Response {
    json_response(StatusCode::OK, &ctx.pod.log.snapshot())
}

async fn pod_clear(State(ctx): State<PodCtx>) -> Response {
    ctx.pod.log.clear();
    StatusCode::NO_CONTENT.into_response()
}

async fn pod_faults(State(ctx): State<PodCtx>) -> Response {
    json_response(StatusCode::OK, &ctx.pod.faults.list())
}

/// A pod's own `POST /sim/faults`: request faults only, since a pod cannot restart its own
/// listener (the simulator-wide admin endpoint arms `crash` and `refuse`).
async fn pod_arm(State(ctx): State<PodCtx>, body: Bytes) -> Response {
    let spec = match serde_json::from_slice::<FaultSpec>(&body) {
        Ok(spec) => spec,
        Err(e) => return fault_error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    if spec.kind.is_listener_fault() {
        return fault_error(
            StatusCode::BAD_REQUEST,
            &FaultError::ListenerFaultOnPod.to_string(),
        );
    }
    match ctx.pod.faults.arm(spec) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => fault_error(StatusCode::BAD_REQUEST, &e.to_string()),
    }
}

async fn pod_clear_faults(State(ctx): State<PodCtx>) -> Response {
    ctx.pod.faults.clear();
    StatusCode::NO_CONTENT.into_response()
}

/// Serialises `value` as a JSON response.
pub fn json_response<T: serde::Serialize + ?Sized>(status: StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(bytes) => (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            bytes,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

fn error_response(err: &ApiError) -> Response {
    let status = StatusCode::from_u16(err.status).unwrap_or(StatusCode::BAD_REQUEST);
    json_response(status, &err.body())
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// One completion request: validate, log, then play it through the timing model.
async fn handle(ctx: PodCtx, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
    let received = Instant::now();
    let pod = &ctx.pod;
    let record = &pod.record;
    let x_request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut entry = LogEntry {
        seq: next_seq(),
        pod: record.name.clone(),
        namespace: record.namespace.clone(),
        role: record.role.clone(),
        roleset: record.roleset.clone(),
        addr: record.address(),
        path: endpoint.path().to_string(),
        leg: None,
        x_request_id: x_request_id.clone(),
        stream: false,
        status: 200,
        error: None,
        kv_transfer_params_in: None,
        kv_transfer_params_out: None,
        kv_pull: None,
        headers: header_map(&headers),
        body: None,
        received_unix_ms: unix_ms(),
        fault: None,
    };
    let reject = |mut entry: LogEntry, err: ApiError| {
        entry.status = err.status;
        entry.error = Some(err.message.clone());
        pod.log.push(entry);
        error_response(&err)
    };
    let json = match vllm::parse_json(&body) {
        Ok(v) => v,
        Err(err) => return reject(entry, err),
    };
    entry.stream = json.get("stream").and_then(Value::as_bool) == Some(true);
    entry.kv_transfer_params_in = json
        .get("kv_transfer_params")
        .filter(|v| !v.is_null())
        .cloned();
    entry.body = Some(json);
    let parsed = SimRequest::from_json(
        endpoint,
        entry.body.as_ref().unwrap_or(&Value::Null),
        &record.model,
        pod.role,
        pod.config.default_max_tokens,
    );
    let req = match parsed {
        Ok(r) => r,
        Err(err) => return reject(entry, err),
    };
    entry.leg = Some(req.leg.as_str().to_string());
    let fault = pod.faults.draw(req.leg);
    entry.fault = fault.as_ref().map(|f| f.kind.name().to_string());
    if let Some(FaultKind::Status { status }) = fault.as_ref().map(|f| f.kind) {
        return reject(entry, ApiError::injected(status));
    }

    let id = endpoint.response_id(x_request_id.as_deref());
    let hashes = block_hashes(&req.prompt_text);
    let work = match (req.leg, &req.kv_transfer_params) {
        (Leg::Decode, Some(kv)) => {
            let pull = ctx.registry.pull(kv);
            entry.kv_pull = Some(pull.as_str().to_string());
            if pull == KvPull::Ok {
                Leg::Decode
            } else {
                Leg::Full // the pull failed: recompute the prefill here
            }
        }
        (leg, _) => leg,
    };
    let new_tokens = match work {
        Leg::Decode => {
            pod.cache_insert(&hashes);
            0
        }
        _ => pod.prefill_lookup(&hashes, req.prompt_tokens),
    };
    let kv_out = (req.leg == Leg::Prefill).then(|| {
        let blocks = pod.allocate_blocks(engine::blocks_for(req.prompt_tokens));
        vllm::prefill_kv_params(&pod.engine_id, &id, &blocks)
    });
    entry.kv_transfer_params_out = kv_out.clone();
    pod.log.push(entry);

    // The request is logged (tests poll for it) before it starts hanging.
    let stall = match fault {
        Some(drawn) => match drawn.kind {
            FaultKind::HangBeforeHeaders => {
                drawn.released().await;
                None
            }
            FaultKind::Slow { delay_ms } => {
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                None
            }
            FaultKind::HangAfterChunks { chunks } => Some(Stall { chunks, drawn }),
            FaultKind::Status { .. } | FaultKind::Crash | FaultKind::Refuse => None,
        },
        None => None,
    };

    let spec = JobSpec {
        work,
        prompt_tokens: req.prompt_tokens,
        new_tokens,
        output_tokens: req.output_tokens(),
        pin_as: (req.leg == Leg::Prefill).then(|| id.clone()),
    };
    let job = Job::new(pod.clone(), spec, received);
    let meta = ResponseMeta {
        endpoint,
        id,
        created: unix_secs(),
        model: req.model.clone(),
    };
    match (req.stream, stall) {
        (true, stall) => stream_response(job, meta, req.prompt_tokens, req.include_usage, stall),
        (false, None) => full_response(job, meta, req.prompt_tokens, kv_out).await,
        (false, Some(stall)) => stalled_full_response(job, meta, req.prompt_tokens, kv_out, stall),
    }
}

/// A `hang_after_chunks` fault drawn by a request: the stream stalls after `chunks` events
/// until the pod's faults are cleared.
struct Stall {
    chunks: u64,
    drawn: Drawn,
}

/// An unstreamed answer whose headers go out at once and whose body waits for the fault's
/// release: what a client sees from an engine that hangs after accepting the request.
fn stalled_full_response(
    job: Job,
    meta: ResponseMeta,
    prompt_tokens: u64,
    kv_out: Option<Value>,
    stall: Stall,
) -> Response {
    let body = futures_util::stream::once(async move {
        stall.drawn.released().await;
        let full = full_response(job, meta, prompt_tokens, kv_out).await;
        axum::body::to_bytes(full.into_body(), usize::MAX)
            .await
            .map_err(std::io::Error::other)
    });
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        Body::from_stream(body),
    )
        .into_response()
}

async fn full_response(
    mut job: Job,
    meta: ResponseMeta,
    prompt_tokens: u64,
    kv_out: Option<Value>,
) -> Response {
    let mut produced = 0;
    while job.next_token().await.is_some() {
        produced += 1;
    }
    let body = meta.full_body(
        &engine::output_text(produced),
        prompt_tokens,
        produced,
        kv_out.as_ref(),
    );
    json_response(StatusCode::OK, &body)
}

enum StreamPhase {
    Tokens,
    Usage,
    Done,
    Finished,
}

struct StreamState {
    job: Job,
    meta: ResponseMeta,
    prompt_tokens: u64,
    include_usage: bool,
    produced: u64,
    phase: StreamPhase,
    stall: Option<Stall>,
}

/// Headers go out at once (as vLLM's StreamingResponse does); each token follows as its own
/// SSE event when the timing model produces it. The job lives inside the body stream, so a
/// client that hangs up aborts it.
fn stream_response(
    job: Job,
    meta: ResponseMeta,
    prompt_tokens: u64,
    include_usage: bool,
    stall: Option<Stall>,
) -> Response {
    let state = StreamState {
        job,
        meta,
        prompt_tokens,
        include_usage,
        produced: 0,
        phase: StreamPhase::Tokens,
        stall,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        if st.stall.as_ref().is_some_and(|s| s.chunks <= st.produced) {
            if let Some(stall) = st.stall.take() {
                stall.drawn.released().await;
            }
        }
        let text = match st.phase {
            StreamPhase::Tokens => match st.job.next_token().await {
                Some(index) => {
                    st.produced += 1;
                    let last = st.produced == st.job.spec().output_tokens;
                    let mut text = String::new();
                    if index == 0 && st.meta.endpoint == Endpoint::Chat {
                        text.push_str(&vllm::sse_event(&st.meta.role_chunk()));
                    }
                    text.push_str(&vllm::sse_event(
                        &st.meta.token_chunk(&engine::token_text(index), last),
                    ));
                    text
                }
                None => {
                    st.phase = if st.include_usage {
                        StreamPhase::Usage
                    } else {
                        StreamPhase::Done
                    };
                    String::new()
                }
            },
            StreamPhase::Usage => {
                st.phase = StreamPhase::Done;
                vllm::sse_event(&st.meta.usage_chunk(st.prompt_tokens, st.produced))
            }
            StreamPhase::Done => {
                st.phase = StreamPhase::Finished;
                vllm::SSE_DONE.to_string()
            }
            StreamPhase::Finished => return None,
        };
        Some((Ok::<_, Infallible>(Bytes::from(text)), st))
    });
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        )],
        Body::from_stream(stream),
    )
        .into_response()
}

/// A listener serving a router until stopped. Stopping (or dropping) closes the listening
/// socket and aborts every open connection, in-flight requests included.
#[derive(Debug)]
pub struct ServeHandle {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
    accepting: watch::Sender<bool>,
}

impl ServeHandle {
    /// Stops serving and waits until the socket is closed.
    pub async fn stop(mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }

    /// Closes the listening socket (new connections are refused) while open connections
    /// finish what they are doing.
    pub fn stop_accepting(&self) {
        let _ = self.accepting.send(false);
    }
}

impl Drop for ServeHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `router` on an already bound listener.
pub fn serve(listener: TcpListener, router: Router) -> std::io::Result<ServeHandle> {
    let addr = listener.local_addr()?;
    let (accepting, accepting_rx) = watch::channel(true);
    let task = tokio::spawn(accept_loop(listener, router, accepting_rx));
    Ok(ServeHandle {
        addr,
        task,
        accepting,
    })
}

async fn accept_loop(listener: TcpListener, router: Router, mut accepting: watch::Receiver<bool>) {
    // Connection tasks live in the JoinSet, so aborting this task (dropping the set) aborts
    // them all: that is what makes a removed pod go away completely.
    let mut connections = JoinSet::new();
    let mut listener = Some(listener);
    loop {
        tokio::select! {
            accepted = async {
                match &listener {
                    Some(l) => l.accept().await,
                    None => std::future::pending().await,
                }
            }, if listener.is_some() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let service = TowerToHyperService::new(router.clone());
                    connections.spawn(async move {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
                Err(err) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("accept failed: {err}");
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
            },
            changed = accepting.changed(), if listener.is_some() => {
                if changed.is_err() || !*accepting.borrow() {
                    // Dropping the listener closes the socket: connects are refused from now.
                    listener = None;
                }
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            else => std::future::pending::<()>().await,
        }
    }
}
