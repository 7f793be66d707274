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
use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::abort::AbortHandle;
use crate::anthropic;
use crate::departure::Departure;
use crate::engine;
use crate::faults::{self, Drawn, FaultError, FaultKind, FaultSpec};
use crate::keep_alive;
use crate::log::LogEntry;
use crate::metrics::{self, Engine};
use crate::pod::{Job, JobSpec, KvPull, PodState, Registry};
use crate::prefix::block_hashes;
use crate::responses;
use crate::sglang::{self, SglangLeg};
use crate::sim::fault_error;
use crate::trtllm::{self, TrtLeg};
use crate::vllm::{self, ApiError, Endpoint, Leg, PodRole, ResponseMeta, SimRequest};

/// What a pod's handlers share.
#[derive(Debug, Clone)]
pub struct PodCtx {
    pub pod: Arc<PodState>,
    pub registry: Arc<Registry>,
}

/// Largest request body a simulated pod reads (past the gateway's own 8 MiB limit).
pub const MAX_BODY_BYTES: usize = 64 << 20;

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
    let router = match engine {
        Engine::Sglang | Engine::Trtllm => router
            .route("/server_info", get(server_info))
            .route("/get_server_info", get(server_info))
            .route("/abort_request", post(abort_request)),
        // Only vLLM carries the disaggregation fields through its Messages handler.
        Engine::Vllm => router
            .route("/v1/messages", post(messages))
            .route("/v1/messages/count_tokens", post(count_tokens))
            .route("/v1/responses", post(responses)),
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
        // Engines take long-context prompts (vLLM has no body limit); axum's 2 MB default
        // would answer 413 to prompts a real pod serves.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            crate::api_key::require,
        ))
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

async fn messages(State(ctx): State<PodCtx>, headers: HeaderMap, body: Bytes) -> Response {
    handle(ctx, Endpoint::Messages, headers, body).await
}

/// `/v1/messages/count_tokens`: computes nothing on the engine, so any role answers it.
async fn count_tokens(State(ctx): State<PodCtx>, headers: HeaderMap, body: Bytes) -> Response {
    let pod = &ctx.pod;
    let mut entry = LogEntry::new(&pod.record, "/v1/messages/count_tokens", &headers);
    let counted = vllm::parse_json(&body).and_then(|json| {
        let counted = vllm::count_tokens(&json, served_name(&pod.record, &json));
        entry.body = Some(json);
        counted
    });
    match counted {
        Ok(tokens) => {
            pod.log.push(entry);
            json_response(StatusCode::OK, &serde_json::json!({"input_tokens": tokens}))
        }
        Err(err) => {
            entry.status = err.status;
            entry.error = Some(err.message.clone());
            pod.log.push(entry);
            error_response(&err, Engine::Vllm, Endpoint::Messages)
        }
    }
}

async fn responses(State(ctx): State<PodCtx>, headers: HeaderMap, body: Bytes) -> Response {
    handle(ctx, Endpoint::Responses, headers, body).await
}

async fn models(State(ctx): State<PodCtx>) -> Response {
    let record = &ctx.pod.record;
    json_response(
        StatusCode::OK,
        &vllm::models_body(&record.model, &record.adapters, unix_secs()),
    )
}

/// The model name this pod answers the request under: a LoRA adapter it has loaded when the
/// body names one (as vLLM serves each loaded adapter under its own name), else its model.
fn served_name<'a>(record: &'a pd_control::fleet::PodRecord, body: &Value) -> &'a str {
    let asked = body.get("model").and_then(Value::as_str);
    record
        .adapters
        .iter()
        .find(|a| Some(a.as_str()) == asked)
        .map_or(record.model.as_str(), String::as_str)
}

/// The pod's Prometheus text in its engine's names.
pub fn exposition(pod: &PodState) -> String {
    let record = &pod.record;
    let m = pod.metrics();
    let mut text = match Engine::from_label(&record.engine) {
        Engine::Vllm => metrics::render(&record.model, &m),
        Engine::Sglang => {
            metrics::render_sglang(&record.model, metrics::sglang_engine_type(&record.role), &m)
        }
        Engine::Trtllm => metrics::render_trtllm(&record.model, std::process::id(), &m),
    };
    if pod.config.utilization_gauge {
        text.push_str(&metrics::render_utilization(
            &record.model,
            &m,
            pod.config.max_num_seqs,
        ));
    }
    text
}

async fn trtllm_iteration_stats(State(ctx): State<PodCtx>) -> Response {
    if let Some(wedge) = ctx.pod.faults.wedged() {
        wedge.released().await;
    }
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
    if let Some(wedge) = ctx.pod.faults.wedged() {
        wedge.released().await;
    }
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

/// An error in the engine's body shape: vLLM's nested `error` object, or SGLang's and
/// TRT-LLM's flat `{"object":"error",...}`; on vLLM's Messages endpoint, Anthropic's.
fn error_response(err: &ApiError, engine: Engine, endpoint: Endpoint) -> Response {
    let status = StatusCode::from_u16(err.status).unwrap_or(StatusCode::BAD_REQUEST);
    match engine {
        Engine::Vllm if endpoint == Endpoint::Messages => {
            json_response(status, &anthropic::error_body(err.kind, &err.message))
        }
        Engine::Vllm => json_response(status, &err.body()),
        Engine::Sglang | Engine::Trtllm => json_response(status, &err.flat_body()),
    }
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Edits a response body into the engine's shape.
type Decorate = Box<dyn FnOnce(&mut Value) + Send>;

/// Engine-specific steps around the timing model: a leg waiting for its peer leg before
/// the first token (`gate`: a decode leg for its KV, an SGLang prefill leg for its decode
/// leg to register), a prefill leg handing its KV over before it answers (`handover`), and
/// what the engine adds to a response body (`decorate`).
struct Hooks {
    engine: Engine,
    endpoint: Endpoint,
    gate: Option<BoxFuture<'static, Result<(), ApiError>>>,
    /// Which of the engine's queues the request waits in while it passes `gate`.
    gate_queue: GateQueue,
    handover: Option<BoxFuture<'static, Result<(), ApiError>>>,
    decorate: Option<Decorate>,
    /// A drawn `fail_after_serving` fault: the status answered once the work is done and the
    /// fault is released.
    fail_after: Option<(u16, Drawn)>,
    /// A drawn `finish_first` fault: the answer's `finish_reason` is `stop`.
    finish_first: bool,
}

/// Where a request waits while it passes its [`Hooks::gate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GateQueue {
    /// In the waiting count only (vLLM-shaped engines: TRT-LLM's generation leg).
    Waiting,
    /// An SGLang decode leg: its request slot first (decode prealloc queue), then the
    /// transfer queue until its KV arrived.
    SglangTransfer,
    /// An SGLang prefill leg: the bootstrap (prefill prealloc) queue until its decode leg
    /// registered; only then may it compute.
    SglangBootstrap,
}

impl Hooks {
    fn new(engine: Engine, endpoint: Endpoint) -> Hooks {
        Hooks {
            engine,
            endpoint,
            gate: None,
            gate_queue: GateQueue::Waiting,
            handover: None,
            decorate: None,
            fail_after: None,
            finish_first: false,
        }
    }

    /// Waits for the gate, if any, in its queue of `job`'s pod.
    async fn pass_gate(&mut self, job: &mut Job) -> Result<(), ApiError> {
        let Some(gate) = self.gate.take() else {
            return Ok(());
        };
        match self.gate_queue {
            GateQueue::Waiting => gate.await,
            GateQueue::SglangTransfer => job.receive_kv(gate).await,
            GateQueue::SglangBootstrap => job.bootstrap(gate).await,
        }
    }

    /// The final body in the engine's shape: only vLLM reports `kv_transfer_params`.
    fn finish_body(&mut self, body: &mut Value) {
        if self.engine != Engine::Vllm {
            if let Some(map) = body.as_object_mut() {
                map.remove("kv_transfer_params");
            }
        }
        if let Some(decorate) = self.decorate.take() {
            decorate(body);
        }
        if self.finish_first {
            if let Some(choice) = body
                .get_mut("choices")
                .and_then(|c| c.get_mut(0))
                .and_then(Value::as_object_mut)
            {
                choice.insert("finish_reason".into(), Value::from("stop"));
            }
        }
    }
}

/// Wraps a rendezvous wait so that its outcome lands in the request's log entry.
fn logged_wait(
    pod: Arc<PodState>,
    seq: u64,
    wait: BoxFuture<'static, Result<(), String>>,
) -> BoxFuture<'static, Result<(), ApiError>> {
    Box::pin(async move {
        let result = wait.await;
        let outcome = match &result {
            Ok(()) => "ok".to_string(),
            Err(_) => "timeout".to_string(),
        };
        pod.log.update(seq, |e| e.kv_pull = Some(outcome));
        result.map_err(ApiError::server_error)
    })
}

/// The leg and disaggregation fields of a request, by the pod's engine.
fn classify(
    engine: Engine,
    body: &Value,
    req: &SimRequest,
    role: PodRole,
    plain_decode_ok: bool,
) -> Result<(Leg, Option<SglangLeg>, Option<TrtLeg>), ApiError> {
    let empty = serde_json::Map::new();
    let obj = body.as_object().unwrap_or(&empty);
    match engine {
        Engine::Vllm => Ok((
            vllm::classify_leg(
                req.kv_transfer_params.as_ref(),
                role,
                req.stream,
                plain_decode_ok,
            )?,
            None,
            None,
        )),
        Engine::Sglang => Ok(match sglang::classify(obj, role)? {
            Some(s) => (s.leg, Some(s), None),
            None => (Leg::Full, None, None),
        }),
        Engine::Trtllm => match trtllm::classify(obj, role)? {
            Some(t) if t.leg == Leg::Prefill && req.stream => Err(ApiError::bad_request(
                "a context_only request cannot stream",
            )),
            Some(t) => Ok((t.leg, None, Some(t))),
            None => Ok((Leg::Full, None, None)),
        },
    }
}

/// One completion request: validate, log, then play it through the timing model.
async fn handle(ctx: PodCtx, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
    let received = Instant::now();
    let pod = &ctx.pod;
    let record = &pod.record;
    let engine = Engine::from_label(&record.engine);
    let mut entry = LogEntry::new(record, endpoint.path(), &headers);
    let x_request_id = entry.x_request_id.clone();
    let seq = entry.seq;
    let reject = |mut entry: LogEntry, err: ApiError| {
        entry.status = err.status;
        entry.error = Some(err.message.clone());
        pod.log.push(entry);
        error_response(&err, engine, endpoint)
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
    // Logged as received (above and in `entry.body`); classified in the upstream shape.
    let neuron = engine == Engine::Vllm && pod.config.vllm_neuron;
    let received_body = neuron.then(|| json.clone());
    let json = if neuron {
        crate::neuron::adapt(json, pod.role)
    } else {
        json
    };
    let parsed = SimRequest::parse_fields(
        endpoint,
        &json,
        served_name(record, &json),
        pod.config.default_max_tokens,
    )
    .and_then(|mut req| {
        // vLLM's decode pod after a prefill that ended at its first token: see `classify_leg`.
        let plain_decode_ok = engine == Engine::Vllm
            && pod.role == PodRole::Decode
            && req.kv_transfer_params.is_none()
            && x_request_id
                .as_deref()
                .is_some_and(|id| ctx.registry.take_finished_early(id));
        if plain_decode_ok {
            entry.kv_pull = Some("recomputed".into());
        }
        let (leg, s, t) = classify(engine, &json, &req, pod.role, plain_decode_ok)?;
        req.leg = leg;
        Ok((req, s, t))
    });
    entry.body = Some(received_body.unwrap_or(json));
    let (req, sglang_leg, trt_leg) = match parsed {
        Ok(r) => r,
        Err(err) => return reject(entry, err),
    };
    entry.leg = Some(req.leg.as_str().to_string());
    entry.pd = sglang_leg
        .as_ref()
        .map(SglangLeg::log_value)
        .or_else(|| trt_leg.as_ref().map(TrtLeg::log_value));
    let fault = pod.faults.draw(req.leg);
    entry.fault = fault.as_ref().map(|f| f.kind.name().to_string());
    if let Some(FaultKind::Oversized { bytes, not_json }) = fault.as_ref().map(|f| f.kind) {
        pod.log.push(entry);
        let content_type = if not_json {
            "text/plain"
        } else {
            "application/json"
        };
        return (
            [(header::CONTENT_TYPE, HeaderValue::from_static(content_type))],
            faults::oversized_body(bytes, not_json),
        )
            .into_response();
    }
    if let Some(FaultKind::Status {
        status,
        delay_ms,
        stall_body,
        stall_half,
        empty_body,
        raw_header,
        cut_body,
    }) = fault.as_ref().map(|f| f.kind)
    {
        if delay_ms > 0 {
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        }
        let mut answer = reject(entry, ApiError::injected(status));
        if raw_header {
            if let Ok(value) = HeaderValue::from_bytes(b"\xff\xfe") {
                answer.headers_mut().insert("x-sim-raw", value);
            }
        }
        if empty_body {
            let (mut parts, _) = answer.into_parts();
            parts.headers.remove(header::CONTENT_TYPE);
            return Response::from_parts(parts, Body::empty());
        }
        if cut_body {
            return cut_body_response(answer).await;
        }
        return match fault.filter(|_| stall_body || stall_half) {
            Some(drawn) => stalled_body(answer, drawn, stall_half).await,
            None => answer,
        };
    }

    let id = endpoint.response_id(x_request_id.as_deref());
    // vLLM keys a request by the id its `x-request-id` gives it and refuses a second one
    // while the first is in flight (versions that do not add a random suffix, and every
    // version under VLLM_DISABLE_REQUEST_ID_RANDOMIZATION, which P2P-NCCL setups need).
    let running = match engine {
        Engine::Vllm => match pod.aborts.register_unique(&id) {
            Some(handle) => Some(handle),
            None => {
                let err = ApiError::bad_request(format!("Request id {id} already running."));
                return reject(entry, err);
            }
        },
        _ => None,
    };
    let hashes = block_hashes(&req.prompt_text);
    let mut hooks = Hooks::new(engine, endpoint);
    let mut pin_as = (req.leg == Leg::Prefill && engine == Engine::Vllm).then(|| id.clone());
    let timeout = pod.config.transfer_timeout;
    let work = match (req.leg, &req.kv_transfer_params, &sglang_leg, &trt_leg) {
        (Leg::Decode, Some(kv), None, None) => {
            let pull = ctx.registry.pull(kv);
            entry.kv_pull = Some(pull.as_str().to_string());
            if pull == KvPull::Ok {
                Leg::Decode
            } else {
                Leg::Full // the pull failed: recompute the prefill here
            }
        }
        (Leg::Decode, _, Some(s), _) => {
            let port = s.bootstrap_port.unwrap_or(sglang::DEFAULT_BOOTSTRAP_PORT);
            let reachable = s
                .bootstrap_ip()
                .is_some_and(|ip| ctx.registry.has_bootstrap_server(Engine::Sglang, ip, port));
            if !reachable {
                entry.kv_pull = Some("unknown_bootstrap".into());
                let err = ApiError::server_error(format!(
                    "Decode transfer failed for request rid={} bootstrap_room={}: no prefill bootstrap server at {}:{port}",
                    s.rid.as_deref().unwrap_or(""), s.bootstrap_room, s.bootstrap_host
                ));
                return reject(entry, err);
            }
            let (registry, key, what) = (
                ctx.registry.clone(),
                s.room_key(),
                format!(
                    "Decode transfer failed for request rid={} bootstrap_room={}: KV did not arrive",
                    s.rid.as_deref().unwrap_or(""),
                    s.bootstrap_room
                ),
            );
            // Registers in the room, then waits for the KV: SGLang's transfer queue.
            let wait = async move {
                registry
                    .rooms
                    .receive(&key, timeout)
                    .await
                    .map_err(|e| format!("{what} ({e})"))
            };
            hooks.gate = Some(logged_wait(pod.clone(), seq, Box::pin(wait)));
            hooks.gate_queue = GateQueue::SglangTransfer;
            Leg::Decode
        }
        (Leg::Prefill, _, Some(s), _) => {
            // SGLang's bootstrap queue: the prefill computes only once the decode worker
            // registered for the room, or fails after the bootstrap timeout.
            let key =
                sglang::own_room_key(&record.ip, record.sglang_bootstrap_port, s.bootstrap_room);
            let (registry, waiting_key, what) = (
                ctx.registry.clone(),
                key.clone(),
                format!(
                    "Prefill bootstrap failed for request rid={} bootstrap_room={}",
                    s.rid.as_deref().unwrap_or(""),
                    s.bootstrap_room
                ),
            );
            let wait = async move {
                registry
                    .rooms
                    .await_decode(&waiting_key, timeout)
                    .await
                    .map_err(|e| format!("{what} ({e})"))
            };
            hooks.gate = Some(logged_wait(pod.clone(), seq, Box::pin(wait)));
            hooks.gate_queue = GateQueue::SglangBootstrap;
            // Then the computed KV goes to the decode worker and stays on the pod while it
            // is sent (SGLang's inflight queue: the decode side's pull time); the prefill
            // answers once the transfer is done.
            pin_as = Some(key.clone());
            let (registry, holder) = (ctx.registry.clone(), pod.clone());
            let transfer = pod.config.timing.kv_pull_time(req.prompt_tokens);
            hooks.handover = Some(Box::pin(async move {
                registry.rooms.kv_ready(&key);
                engine::spend(transfer).await;
                holder.release_pin(&key);
                Ok(())
            }));
            Leg::Prefill
        }
        (Leg::Prefill, _, _, Some(t)) => {
            let generation_first = t.schedule_style == trtllm::GENERATION_FIRST;
            let ctx_id = match (generation_first, t.disagg_request_id) {
                (true, Some(id)) => id,
                _ => trtllm::new_ctx_request_id(),
            };
            let opaque = trtllm::opaque_state(&pod.engine_id, ctx_id);
            let prompt_ids = trtllm::prompt_token_ids(&req.prompt_text);
            let first = prompt_ids.last().copied().unwrap_or(1000) + 1;
            let params = trtllm::ctx_params(t, ctx_id, &opaque, first);
            hooks.decorate = Some(Box::new(move |body: &mut Value| {
                trtllm::decorate_ctx_response(body, params, &prompt_ids)
            }));
            if generation_first {
                let key = trtllm::room_key(&trtllm::ctx_info_endpoint(&record.ip), ctx_id);
                let registry = ctx.registry.clone();
                let wait = async move {
                    registry.rooms.hand_over(&key, timeout).await.map_err(|e| {
                        format!("context transfer failed for disagg_request_id={ctx_id} ({e})")
                    })
                };
                hooks.handover = Some(logged_wait(pod.clone(), seq, Box::pin(wait)));
            } else {
                pin_as = Some(ctx_id.to_string());
            }
            Leg::Prefill
        }
        (Leg::Decode, _, _, Some(t)) if t.schedule_style == trtllm::GENERATION_FIRST => {
            let (endpoint_name, id) = (
                t.ctx_info_endpoint.clone().unwrap_or_default(),
                t.disagg_request_id.unwrap_or_default(),
            );
            let key = trtllm::room_key(&endpoint_name, id);
            let registry = ctx.registry.clone();
            let wait = async move {
                registry
                    .rooms
                    .receive(&key, timeout)
                    .await
                    .map_err(|e| format!("DISAGG_TRANS_ERROR: no KV from {endpoint_name} for disagg_request_id={id} ({e})"))
            };
            hooks.gate = Some(logged_wait(pod.clone(), seq, Box::pin(wait)));
            Leg::Decode
        }
        (Leg::Decode, _, _, Some(t)) => {
            let pull = trtllm_pull(&ctx.registry, t);
            entry.kv_pull = Some(pull.as_str().to_string());
            if pull != KvPull::Ok {
                let err = ApiError::server_error(format!(
                    "DISAGG_TRANS_ERROR: cannot fetch the KV of ctx_request_id={:?}: {}",
                    t.ctx_request_id,
                    pull.as_str()
                ));
                return reject(entry, err);
            }
            Leg::Decode
        }
        (leg, _, _, _) => leg,
    };
    let new_tokens = match work {
        Leg::Decode => {
            pod.cache_insert(&hashes);
            0
        }
        _ => pod.prefill_lookup(&hashes, req.prompt_tokens),
    };
    // vLLM returns `kv_transfer_params` only for a prefill capped by its length: one whose
    // first token ended the answer pins no KV and returns null.
    let finished_first = matches!(fault.as_ref().map(|f| f.kind), Some(FaultKind::FinishFirst));
    if finished_first && req.leg == Leg::Prefill && engine == Engine::Vllm {
        if let Some(x) = x_request_id.as_deref() {
            ctx.registry.note_finished_early(x);
        }
    }
    let kv_out =
        (req.leg == Leg::Prefill && engine == Engine::Vllm && !finished_first).then(|| {
            let blocks = pod.allocate_blocks(engine::blocks_for(req.prompt_tokens));
            let mut params = vllm::prefill_kv_params(&pod.engine_id, &id, &blocks);
            if neuron || pod.config.side_channel_host_is_pod_ip {
                // No gateway rewrites `remote_host` in this contract: the pod names itself.
                params["remote_host"] = Value::String(record.ip.clone());
            }
            params
        });
    entry.kv_transfer_params_out = kv_out.clone();
    pod.log.push(entry);
    let mut abort = sglang_leg
        .as_ref()
        .and_then(|s| s.rid.as_deref())
        .map(|rid| pod.aborts.register(rid))
        .or(running);
    let mut signal = abort.as_ref().map(AbortHandle::signal);
    // Dropped with this future (the client left while the pod computed), or moved into a
    // body that outlives it and dropped with that (the client left while it was sent).
    let mut departure = Some(Departure::new(pod.clone(), seq));
    let departure_slot = &mut departure;

    // The request is logged (tests poll for it) before it starts hanging.
    let pod = pod.clone();
    let respond = async move {
        let stall = match fault {
            Some(drawn) => match drawn.kind {
                FaultKind::HangBeforeHeaders => {
                    // A decode leg that meets its prefill first and hangs afterwards: the
                    // KV was taken (so the prefill answers), then the scheduler stalled.
                    // (A prefill leg hangs before it even waits for its decode leg.)
                    if hooks.gate_queue != GateQueue::SglangBootstrap {
                        if let Some(gate) = hooks.gate.take() {
                            if let Err(err) = gate.await {
                                return error_response(&err, engine, endpoint);
                            }
                        }
                    }
                    drawn.released().await;
                    None
                }
                FaultKind::Wedge => {
                    drawn.released().await;
                    None
                }
                FaultKind::Slow { delay_ms } => {
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                    None
                }
                FaultKind::HangAfterChunks { chunks } => Some(Stall { chunks, drawn }),
                FaultKind::FailAfterServing { status } => {
                    hooks.fail_after = Some((status, drawn));
                    None
                }
                FaultKind::FinishFirst => {
                    hooks.finish_first = true;
                    None
                }
                FaultKind::Status { .. }
                | FaultKind::Oversized { .. }
                | FaultKind::Crash
                | FaultKind::Refuse => None,
            },
            None => None,
        };
        let spec = JobSpec {
            work,
            prompt_tokens: req.prompt_tokens,
            new_tokens,
            output_tokens: req.output_tokens(),
            pin_as,
        };
        let job = Job::new(pod, spec, received);
        let meta = ResponseMeta {
            endpoint,
            id,
            created: unix_secs(),
            model: req.model.clone(),
        };
        match (req.stream, stall) {
            (true, stall) => stream_response(
                job,
                meta,
                StreamOptions {
                    prompt_tokens: req.prompt_tokens,
                    include_usage: req.include_usage,
                    stall,
                    hooks,
                    abort: abort.take(),
                    departure: departure_slot.take(),
                },
            ),
            (false, None) => full_response(job, meta, req.prompt_tokens, kv_out, hooks).await,
            (false, Some(stall)) => {
                let answer = StalledAnswer {
                    job,
                    meta,
                    prompt_tokens: req.prompt_tokens,
                    kv_out,
                    hooks,
                    departure: departure_slot.take(),
                };
                stalled_full_response(answer, stall)
            }
        }
    };
    let response = match signal.as_mut() {
        None => respond.await,
        Some(signal) => {
            tokio::select! {
                response = respond => response,
                _ = signal.aborted() => aborted_response(engine, endpoint),
            }
        }
    };
    // Answered whole here (a streamed body carries its own departure on).
    if let Some(departure) = departure.take() {
        departure.finish();
    }
    response
}

/// A context-first TRT-LLM generation leg fetching the KV its `encoded_opaque_state` names.
fn trtllm_pull(registry: &Registry, t: &TrtLeg) -> KvPull {
    let Some((engine_id, id)) = t
        .encoded_opaque_state
        .as_deref()
        .and_then(trtllm::parse_opaque_state)
    else {
        return KvPull::UnknownEngine;
    };
    let Some(ctx_pod) = registry.get(&engine_id) else {
        return KvPull::UnknownEngine;
    };
    if t.ctx_request_id != Some(id) {
        return KvPull::UnknownRequest;
    }
    if ctx_pod.release_pin(&id.to_string()) {
        KvPull::Ok
    } else {
        KvPull::UnknownRequest
    }
}

/// What an aborted unstreamed request answers (SGLang finishes it with an abort reason).
fn aborted_response(engine: Engine, endpoint: Endpoint) -> Response {
    error_response(
        &ApiError {
            status: 500,
            kind: "InternalServerError",
            message: "request aborted by /abort_request".into(),
        },
        engine,
        endpoint,
    )
}

/// `POST /abort_request {"rid": ...}`: ends every in-flight request with that rid and
/// answers 200 with an empty body, as SGLang does. Logged, so tests can see the router's
/// abort arrive.
async fn abort_request(State(ctx): State<PodCtx>, headers: HeaderMap, body: Bytes) -> Response {
    let mut entry = LogEntry::new(&ctx.pod.record, "/abort_request", &headers);
    let parsed = serde_json::from_slice::<Value>(&body);
    let rid = parsed
        .as_ref()
        .ok()
        .and_then(|v| v.get("rid"))
        .and_then(Value::as_str)
        .map(str::to_string);
    entry.body = parsed.ok();
    let Some(rid) = rid else {
        entry.status = 400;
        entry.error = Some("abort_request needs a rid".into());
        ctx.pod.log.push(entry);
        return json_response(
            StatusCode::BAD_REQUEST,
            &serde_json::json!({"error": {"message": "abort_request needs a rid"}}),
        );
    };
    let aborted = ctx.pod.aborts.abort(&rid);
    entry.pd = Some(serde_json::json!({"rid": rid, "aborted": aborted}));
    ctx.pod.log.push(entry);
    StatusCode::OK.into_response()
}

/// `GET /server_info` (and SGLang's `/get_server_info`), logged like a request.
async fn server_info(State(ctx): State<PodCtx>, headers: HeaderMap) -> Response {
    let record = &ctx.pod.record;
    let entry = LogEntry::new(record, "/server_info", &headers);
    ctx.pod.log.push(entry);
    let body = match Engine::from_label(&record.engine) {
        Engine::Trtllm => trtllm::server_info(&record.ip, ctx.pod.config.trtllm_python_transceiver),
        _ => sglang::server_info(&record.model, ctx.pod.role, record.sglang_bootstrap_port),
    };
    json_response(StatusCode::OK, &body)
}

/// A `hang_after_chunks` fault drawn by a request: the stream stalls after `chunks` events
/// until the pod's faults are cleared.
struct Stall {
    chunks: u64,
    drawn: Drawn,
}

/// `answer`'s status, its headers with the whole body's `content-length`, and the first half
/// of its body; then the body fails, which makes hyper close the connection mid-body.
async fn cut_body_response(answer: Response) -> Response {
    let (mut parts, body) = answer.into_parts();
    let whole = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(whole.len()));
    let half = whole.slice(..whole.len() / 2);
    let first = futures_util::stream::once(async move { Ok::<_, std::io::Error>(half) });
    // The failure comes a moment later: hyper writes what it has before it sees the error
    // (which closes the connection), so the peer gets the headers and half a body.
    let cut = futures_util::stream::once(async {
        tokio::time::sleep(CUT_BODY_AFTER).await;
        Err(std::io::Error::other("cut_body fault: the pod went away"))
    });
    Response::from_parts(parts, Body::from_stream(first.chain(cut)))
}

/// How long a `cut_body` answer's first half is out before its connection closes.
const CUT_BODY_AFTER: Duration = Duration::from_millis(50);

/// `answer` with its status and headers at once and its body once the fault is released.
/// `answer` with its body held until the fault is released; with `half`, the first half of
/// it goes out at once.
async fn stalled_body(answer: Response, drawn: Drawn, half: bool) -> Response {
    let (parts, body) = answer.into_parts();
    let whole = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let split = if half { whole.len() / 2 } else { 0 };
    let (first, rest) = (whole.slice(..split), whole.slice(split..));
    let first =
        futures_util::stream::iter((!first.is_empty()).then_some(Ok::<_, std::io::Error>(first)));
    let rest = futures_util::stream::once(async move {
        drawn.released().await;
        Ok(rest)
    });
    use futures_util::StreamExt;
    Response::from_parts(parts, Body::from_stream(first.chain(rest)))
}

/// What an unstreamed answer held by a `hang_after_chunks` fault is made of.
struct StalledAnswer {
    job: Job,
    meta: ResponseMeta,
    prompt_tokens: u64,
    kv_out: Option<Value>,
    hooks: Hooks,
    departure: Option<Departure>,
}

/// An unstreamed answer whose headers go out at once and whose body waits for the fault's
/// release: what a client sees from an engine that hangs after accepting the request.
fn stalled_full_response(answer: StalledAnswer, stall: Stall) -> Response {
    let StalledAnswer {
        job,
        meta,
        prompt_tokens,
        kv_out,
        hooks,
        departure,
    } = answer;
    let body = futures_util::stream::once(async move {
        stall.drawn.released().await;
        let full = full_response(job, meta, prompt_tokens, kv_out, hooks).await;
        let bytes = axum::body::to_bytes(full.into_body(), usize::MAX)
            .await
            .map_err(std::io::Error::other);
        if let Some(departure) = departure {
            departure.finish();
        }
        bytes
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
    mut hooks: Hooks,
) -> Response {
    if let Err(err) = hooks.pass_gate(&mut job).await {
        return error_response(&err, hooks.engine, hooks.endpoint);
    }
    let mut produced = 0;
    while job.next_token().await.is_some() {
        produced += 1;
    }
    if let Some(handover) = hooks.handover.take() {
        if let Err(err) = handover.await {
            return error_response(&err, hooks.engine, hooks.endpoint);
        }
    }
    if let Some((status, drawn)) = hooks.fail_after.take() {
        drawn.released().await;
        let err = ApiError::injected(status);
        return error_response(&err, hooks.engine, hooks.endpoint);
    }
    let mut body = meta.full_body(
        &engine::output_text(produced),
        prompt_tokens,
        produced,
        kv_out.as_ref(),
    );
    hooks.finish_body(&mut body);
    json_response(StatusCode::OK, &body)
}

enum StreamPhase {
    Gate,
    Tokens,
    Usage,
    Done,
    Finished,
}

/// What a streamed answer needs besides the job and its identity.
struct StreamOptions {
    prompt_tokens: u64,
    include_usage: bool,
    stall: Option<Stall>,
    hooks: Hooks,
    abort: Option<AbortHandle>,
    /// Finished once the stream's last event is out (`crate::departure`).
    departure: Option<Departure>,
}

struct StreamState {
    job: Job,
    meta: ResponseMeta,
    opts: StreamOptions,
    produced: u64,
    phase: StreamPhase,
}

/// One SSE event of an error after the headers went out, then the stream ends.
fn stream_error(endpoint: Endpoint, message: &str) -> String {
    if endpoint == Endpoint::Messages {
        return anthropic::event(
            "error",
            &anthropic::error_body("InternalServerError", message),
        );
    }
    let mut text = vllm::sse_event(
        &serde_json::json!({"error": {"message": message, "type": "InternalServerError", "code": 500}}),
    );
    text.push_str(vllm::SSE_DONE);
    text
}

impl StreamState {
    async fn step(&mut self) -> Option<String> {
        if self
            .opts
            .stall
            .as_ref()
            .is_some_and(|s| s.chunks <= self.produced)
        {
            if let Some(stall) = self.opts.stall.take() {
                stall.drawn.released().await;
            }
        }
        let text = match self.phase {
            StreamPhase::Gate => {
                self.phase = StreamPhase::Tokens;
                match self.opts.hooks.pass_gate(&mut self.job).await {
                    Ok(()) => String::new(),
                    Err(err) => {
                        self.phase = StreamPhase::Finished;
                        stream_error(self.meta.endpoint, &err.message)
                    }
                }
            }
            StreamPhase::Tokens => match self.job.next_token().await {
                Some(index) => {
                    self.produced += 1;
                    let last = self.produced == self.job.spec().output_tokens;
                    let mut text = String::new();
                    let token = engine::token_text(index);
                    match self.meta.endpoint {
                        Endpoint::Responses => {
                            let meta = self.meta.responses_meta(self.job.spec().output_tokens);
                            if index == 0 {
                                text.push_str(&responses::opening(&meta));
                            }
                            text.push_str(&responses::text_delta(&meta, index, &token));
                        }
                        Endpoint::Messages => {
                            if index == 0 {
                                text.push_str(&anthropic::opening(
                                    &self.meta.id,
                                    &self.meta.model,
                                    self.opts.prompt_tokens,
                                ));
                            }
                            text.push_str(&anthropic::text_delta(&token));
                        }
                        endpoint => {
                            if index == 0 && endpoint == Endpoint::Chat {
                                text.push_str(&vllm::sse_event(&self.meta.role_chunk()));
                            }
                            text.push_str(&vllm::sse_event(&self.meta.token_chunk(&token, last)));
                        }
                    }
                    text
                }
                None => {
                    if let Some(handover) = self.opts.hooks.handover.take() {
                        if let Err(err) = handover.await {
                            self.phase = StreamPhase::Finished;
                            return Some(stream_error(self.meta.endpoint, &err.message));
                        }
                    }
                    self.phase = if self.opts.include_usage {
                        StreamPhase::Usage
                    } else {
                        StreamPhase::Done
                    };
                    String::new()
                }
            },
            StreamPhase::Usage => {
                self.phase = StreamPhase::Done;
                match self.meta.endpoint {
                    Endpoint::Messages => {
                        anthropic::closing(self.opts.prompt_tokens, self.produced)
                    }
                    Endpoint::Responses => responses::closing(
                        &self.meta.responses_meta(self.job.spec().output_tokens),
                        &engine::output_text(self.produced),
                        self.opts.prompt_tokens,
                        self.produced,
                    ),
                    _ => vllm::sse_event(
                        &self
                            .meta
                            .usage_chunk(self.opts.prompt_tokens, self.produced),
                    ),
                }
            }
            StreamPhase::Done => {
                self.phase = StreamPhase::Finished;
                match self.meta.endpoint {
                    Endpoint::Messages => anthropic::message_stop(),
                    // The Responses stream ends with `response.completed`.
                    Endpoint::Responses => String::new(),
                    _ => vllm::SSE_DONE.to_string(),
                }
            }
            StreamPhase::Finished => return None,
        };
        Some(text)
    }
}

/// Headers go out at once (as vLLM's and SGLang's StreamingResponse do: before the first
/// token, and before an SGLang decode leg has its KV); each token follows as its own SSE
/// event when the timing model produces it. The job lives inside the body stream, so a
/// client that hangs up aborts it; an `/abort_request` ends it with an error event.
fn stream_response(job: Job, meta: ResponseMeta, opts: StreamOptions) -> Response {
    let state = StreamState {
        job,
        meta,
        opts,
        produced: 0,
        phase: StreamPhase::Gate,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        let mut abort = st.opts.abort.take();
        let text = match abort.as_mut() {
            None => st.step().await,
            Some(a) => {
                tokio::select! {
                    text = st.step() => text,
                    _ = a.aborted() => {
                        st.phase = StreamPhase::Finished;
                        Some(stream_error(st.meta.endpoint, "request aborted by /abort_request"))
                    }
                }
            }
        };
        st.opts.abort = abort;
        if text.is_none() {
            if let Some(departure) = st.opts.departure.take() {
                departure.finish();
            }
        }
        text.map(|t| (Ok::<_, Infallible>(Bytes::from(t)), st))
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
    /// Set by the accept loop once it has closed the listening socket.
    closed: watch::Receiver<bool>,
}

impl ServeHandle {
    /// Stops serving and waits until the socket is closed.
    pub async fn stop(mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }

    /// Closes the listening socket (new connections are refused) while open connections
    /// finish what they are doing. Returns once the socket is closed: a connect made after
    /// the `refuse` fault is armed must be refused, not queued on a socket about to close.
    pub async fn stop_accepting(&self) {
        let _ = self.accepting.send(false);
        let mut closed = self.closed.clone();
        let _ = closed.wait_for(|c| *c).await;
    }
}

impl Drop for ServeHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `router` on an already bound listener; with `keep_alive`, a connection that carries
/// no request for that long is closed, as the engines' uvicorn does (`crate::keep_alive`).
pub fn serve(
    listener: TcpListener,
    router: Router,
    keep_alive: Option<Duration>,
) -> std::io::Result<ServeHandle> {
    let addr = listener.local_addr()?;
    let (accepting, accepting_rx) = watch::channel(true);
    let (closed_tx, closed) = watch::channel(false);
    let task = tokio::spawn(accept_loop(
        listener,
        router,
        keep_alive,
        accepting_rx,
        closed_tx,
    ));
    Ok(ServeHandle {
        addr,
        task,
        accepting,
        closed,
    })
}

async fn serve_connection(
    stream: tokio::net::TcpStream,
    service: TowerToHyperService<Router>,
    keep_alive: Option<Duration>,
) {
    let builder = hyper::server::conn::http1::Builder::new();
    let io = TokioIo::new(stream);
    let Some(timeout) = keep_alive else {
        let _ = builder.serve_connection(io, service).await;
        return;
    };
    let activity = keep_alive::Activity::new();
    let service = keep_alive::Counted {
        inner: service,
        activity: activity.clone(),
    };
    let connection = builder.serve_connection(io, service);
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => {}
        () = keep_alive::idle_for(activity, timeout) => {
            // Closes at once when idle; a request that raced in is answered first.
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    router: Router,
    keep_alive: Option<Duration>,
    mut accepting: watch::Receiver<bool>,
    closed: watch::Sender<bool>,
) {
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
                    connections.spawn(serve_connection(stream, service, keep_alive));
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
                    let _ = closed.send(true);
                }
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            else => std::future::pending::<()>().await,
        }
    }
}
