//! One simulated engine pod: its load (waiting/running requests, KV usage), counters and
//! histograms, prefix cache, KV blocks pinned for decode pods to pull, and the [`Job`] that
//! plays one request through the timing model while keeping all of that consistent.
//!
//! State changes go through RAII ([`Ticket`]) so that a client that hangs up, or a pod that
//! is removed mid-request, still leaves the gauges exactly right: the router under test
//! reads them and a leaked "running" request would skew its decisions.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pd_control::fleet::PodRecord;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::abort::Aborts;
use crate::engine::{self, TimingModel, BLOCK_SIZE_TOKENS};
use crate::faults::Faults;
use crate::log::RequestLog;
use crate::metrics::{Engine, MetricsSnapshot};
use crate::prefix::PrefixCache;
use crate::rendezvous::Rooms;
use crate::vllm::{Leg, PodRole};

/// Simulator-wide settings shared by every pod.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub timing: TimingModel,
    pub default_max_tokens: u64,
    /// KV cache size of each pod, in tokens; the denominator of `kv_cache_usage_perc`.
    pub kv_capacity_tokens: u64,
    /// vLLM's `--max-num-seqs`: requests beyond it wait (and show as waiting).
    pub max_num_seqs: usize,
    /// Prefills one pod runs at once; 0 means unlimited. 1 models a GPU that is saturated by
    /// one prefill, which is what makes prefill queues (and prefill-aware routing) visible.
    pub prefill_concurrency: usize,
    pub prefix_caching: bool,
    /// How long a prefill pod keeps a finished prefill's blocks for a decode pod to pull.
    pub kv_pin_timeout: Duration,
    /// Entries kept in each pod's request log.
    pub log_limit: usize,
    /// How long either leg of an SGLang or TRT-LLM generation-first exchange waits for the
    /// other (SGLang's `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` / bootstrap timeout, 300 s).
    pub transfer_timeout: Duration,
    /// TRT-LLM workers run the Python KV-cache transceiver, the only one that reports the
    /// generation-first metadata on `/server_info`; false models the default C++ one.
    pub trtllm_python_transceiver: bool,
    /// vLLM pods speak the Neuron NIXL contract (`disagg_prefill_resp`) instead of upstream
    /// vLLM's `kv_transfer_params` exchange (`crate::neuron`).
    pub vllm_neuron: bool,
    /// vLLM prefill pods answer `remote_host` = their own IP, as vLLM does when
    /// `VLLM_NIXL_SIDE_CHANNEL_HOST` is set to the pod IP: what routers that copy
    /// `kv_transfer_params` verbatim (vllm-router) need.
    pub side_channel_host_is_pod_ip: bool,
    /// Export xLLM's `engine_utilization` gauge too (see [`crate::metrics::render_utilization`]).
    pub utilization_gauge: bool,
    /// A connection with no request in flight for this long is closed, as the engines'
    /// uvicorn does (`crate::keep_alive`); `None` keeps it open.
    pub keep_alive: Option<Duration>,
    /// The engines' `--api-key` (`crate::api_key`); `None` leaves every route open.
    pub api_key: Option<String>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            timing: TimingModel::default(),
            default_max_tokens: 16,
            kv_capacity_tokens: 100_000,
            max_num_seqs: 256,
            prefill_concurrency: 1,
            prefix_caching: true,
            kv_pin_timeout: Duration::from_secs(30),
            log_limit: 10_000,
            transfer_timeout: Duration::from_secs(300),
            trtllm_python_transceiver: true,
            vllm_neuron: false,
            side_channel_host_is_pod_ip: false,
            utilization_gauge: false,
            keep_alive: Some(crate::keep_alive::ENGINE_KEEP_ALIVE),
            api_key: None,
        }
    }
}

/// Counters, histograms and cache, behind one lock with short critical sections.
#[derive(Debug)]
struct Inner {
    running: u64,
    waiting: u64,
    /// Tokens held by running requests (prompt plus generated so far).
    active_kv_tokens: u64,
    /// Prefill results waiting to be pulled: remote_request_id → (tokens, deadline).
    pinned: HashMap<String, (u64, Instant)>,
    pinned_tokens: u64,
    next_block_id: u64,
    prefix: PrefixCache,
    metrics: MetricsSnapshot,
    /// SGLang prefill legs waiting for their decode leg to register (bootstrap queue).
    prefill_prealloc: u64,
    /// Decode legs waiting for a request slot before their KV transfer, and those whose KV
    /// is on its way (an SGLang leg from its registration in the room until it has pulled).
    decode_prealloc: u64,
    kv_transfer: u64,
    /// Start of the current generation-throughput window and the token count then.
    throughput_mark: (Instant, u64),
    /// Tokens per second over the last completed window.
    gen_throughput: f64,
    /// TRT-LLM iteration-stats records handed out.
    iterations: u64,
}

/// Length of the window `sglang:gen_throughput` is averaged over (SGLang logs decode stats
/// every `decode_log_interval` steps; a second is the same order at simulated speeds).
pub const GEN_THROUGHPUT_WINDOW: Duration = Duration::from_secs(1);

/// A served pod.
#[derive(Debug)]
pub struct PodState {
    pub record: PodRecord,
    pub role: PodRole,
    pub engine_id: String,
    pub config: Arc<SimConfig>,
    pub log: RequestLog,
    /// Request faults armed through `/sim/faults`.
    pub faults: Faults,
    /// In-flight requests by `rid`, for `/abort_request`.
    pub aborts: Aborts,
    seqs: Arc<Semaphore>,
    prefill_lane: Option<Arc<Semaphore>>,
    inner: Mutex<Inner>,
}

/// What `GET /sim/pods` lists for each pod.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PodInfo {
    pub name: String,
    pub namespace: String,
    pub model: String,
    pub role: String,
    pub roleset: String,
    pub engine: String,
    pub ready: bool,
    pub addr: String,
    pub metrics_addr: String,
    pub engine_id: String,
}

impl PodState {
    pub fn new(record: PodRecord, config: Arc<SimConfig>) -> Self {
        let capacity_blocks = if config.prefix_caching {
            engine::blocks_for(config.kv_capacity_tokens) as usize
        } else {
            0
        };
        let mut metrics = MetricsSnapshot::for_engine(Engine::from_label(&record.engine));
        metrics.kv_capacity_tokens = config.kv_capacity_tokens;
        metrics.num_gpu_blocks = engine::blocks_for(config.kv_capacity_tokens);
        metrics.prefix_caching = config.prefix_caching;
        PodState {
            role: PodRole::from_label(&record.role),
            engine_id: engine::engine_id(&record.namespace, &record.name),
            log: RequestLog::new(config.log_limit),
            faults: Faults::default(),
            aborts: Aborts::default(),
            seqs: Arc::new(Semaphore::new(config.max_num_seqs.max(1))),
            prefill_lane: (config.prefill_concurrency > 0)
                .then(|| Arc::new(Semaphore::new(config.prefill_concurrency))),
            inner: Mutex::new(Inner {
                running: 0,
                waiting: 0,
                active_kv_tokens: 0,
                pinned: HashMap::new(),
                pinned_tokens: 0,
                next_block_id: 1,
                prefix: PrefixCache::new(capacity_blocks),
                metrics,
                prefill_prealloc: 0,
                decode_prealloc: 0,
                kv_transfer: 0,
                throughput_mark: (Instant::now(), 0),
                gen_throughput: 0.0,
                iterations: 0,
            }),
            record,
            config,
        }
    }

    pub fn info(&self) -> PodInfo {
        let r = &self.record;
        PodInfo {
            name: r.name.clone(),
            namespace: r.namespace.clone(),
            model: r.model.clone(),
            role: r.role.clone(),
            roleset: r.roleset.clone(),
            engine: r.engine.clone(),
            ready: r.ready,
            addr: r.address(),
            metrics_addr: r.metrics_address(),
            engine_id: self.engine_id.clone(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every update below is a handful of integer adds; a panic cannot leave them torn in a
        // way worth refusing all later requests for.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The `/metrics` view, with gauges computed now.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.metrics_at(Instant::now())
    }

    /// [`PodState::metrics`] as of `now`; the generation-throughput window closes when
    /// [`GEN_THROUGHPUT_WINDOW`] has passed since it opened.
    pub fn metrics_at(&self, now: Instant) -> MetricsSnapshot {
        let mut inner = self.lock();
        expire_pins(&mut inner, now);
        let generated = inner.metrics.generation_tokens;
        let (opened, at_open) = inner.throughput_mark;
        let elapsed = now.saturating_duration_since(opened);
        if elapsed >= GEN_THROUGHPUT_WINDOW {
            inner.gen_throughput = (generated - at_open) as f64 / elapsed.as_secs_f64();
            inner.throughput_mark = (now, generated);
        }
        let mut m = inner.metrics.clone();
        m.running = inner.running;
        m.waiting = inner.waiting;
        let held = inner.active_kv_tokens + inner.pinned_tokens;
        m.kv_used_tokens = held;
        m.kv_usage = (held as f64 / self.config.kv_capacity_tokens.max(1) as f64).min(1.0);
        m.gen_throughput = inner.gen_throughput;
        m.prefill_inflight = inner.pinned.len() as u64;
        m.prefill_prealloc = inner.prefill_prealloc;
        m.decode_prealloc = inner.decode_prealloc;
        m.kv_transfer = inner.kv_transfer;
        m
    }

    /// Numbers the next TRT-LLM iteration-stats record.
    pub fn next_iteration(&self) -> u64 {
        let mut inner = self.lock();
        inner.iterations += 1;
        inner.iterations
    }

    pub fn running(&self) -> u64 {
        self.lock().running
    }

    /// Prompt tokens that must actually be computed: those past the cached prefix (at least
    /// one, as vLLM always recomputes the last token). Counts the prefix-cache query.
    pub fn prefill_lookup(&self, hashes: &[u64], prompt_tokens: u64) -> u64 {
        let mut inner = self.lock();
        let hit_tokens =
            (inner.prefix.lookup_and_insert(hashes) as u64 * BLOCK_SIZE_TOKENS).min(prompt_tokens);
        if self.config.prefix_caching {
            inner.metrics.prefix_queries += prompt_tokens;
            inner.metrics.prefix_hits += hit_tokens;
        }
        prompt_tokens.saturating_sub(hit_tokens).max(1)
    }

    /// A decode pod that pulled a prompt's KV now holds its blocks in its own prefix cache.
    pub fn cache_insert(&self, hashes: &[u64]) {
        self.lock().prefix.insert(hashes);
    }

    /// Fresh KV block ids for a prefill result.
    pub fn allocate_blocks(&self, count: u64) -> Vec<u64> {
        let mut inner = self.lock();
        let first = inner.next_block_id;
        inner.next_block_id += count;
        (first..first + count).collect()
    }

    /// Keeps `tokens` of KV for `request_id` until a decode pod pulls them or the pin expires.
    fn pin(&self, request_id: &str, tokens: u64) {
        let mut inner = self.lock();
        let now = Instant::now();
        expire_pins(&mut inner, now);
        let deadline = now + self.config.kv_pin_timeout;
        if let Some((old, _)) = inner
            .pinned
            .insert(request_id.to_string(), (tokens, deadline))
        {
            inner.pinned_tokens -= old;
        }
        inner.pinned_tokens += tokens;
    }

    /// Frees a pin after a decode pod pulled it. False when there was none (never pinned,
    /// already pulled, or expired).
    pub fn release_pin(&self, request_id: &str) -> bool {
        let mut inner = self.lock();
        expire_pins(&mut inner, Instant::now());
        match inner.pinned.remove(request_id) {
            Some((tokens, _)) => {
                inner.pinned_tokens -= tokens;
                true
            }
            None => false,
        }
    }
}

fn expire_pins(inner: &mut Inner, now: Instant) {
    let before = inner.pinned.len();
    let mut freed = 0;
    inner.pinned.retain(|_, (tokens, deadline)| {
        let keep = *deadline > now;
        if !keep {
            freed += *tokens;
        }
        keep
    });
    if inner.pinned.len() != before {
        inner.pinned_tokens -= freed;
    }
}

/// Outcome of a decode pod's attempt to pull KV named by `kv_transfer_params`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPull {
    Ok,
    /// `remote_engine_id` is not a pod this simulator serves.
    UnknownEngine,
    /// `remote_host` is not the prefill pod's IP (e.g. vLLM's default `localhost` that the
    /// router should have overwritten).
    HostMismatch,
    /// The prefill pod holds no blocks for `remote_request_id` (never sent, already pulled,
    /// or expired).
    UnknownRequest,
}

impl KvPull {
    pub fn as_str(self) -> &'static str {
        match self {
            KvPull::Ok => "ok",
            KvPull::UnknownEngine => "unknown_engine",
            KvPull::HostMismatch => "host_mismatch",
            KvPull::UnknownRequest => "unknown_request",
        }
    }
}

/// How long a prefill leg that ended at its first token vouches for a plain decode leg of the
/// same request id.
const FINISHED_EARLY_FOR: Duration = Duration::from_secs(60);

/// Every pod's engine id, so a decode pod can find the prefill pod it is told to pull from,
/// and the rooms where SGLang and TRT-LLM generation-first legs meet.
#[derive(Debug, Default)]
pub struct Registry {
    engines: Mutex<HashMap<String, Arc<PodState>>>,
    pub rooms: Rooms,
    /// `x-request-id`s of vLLM prefill legs whose first token ended the answer, and when: vLLM
    /// returned no `kv_transfer_params`, so the decode leg comes as the client's plain body.
    finished_early: Mutex<HashMap<String, Instant>>,
}

impl Registry {
    pub fn insert(&self, pod: Arc<PodState>) {
        self.lock().insert(pod.engine_id.clone(), pod);
    }

    pub fn remove(&self, engine_id: &str) {
        self.lock().remove(engine_id);
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<PodState>>> {
        self.engines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes that the prefill leg of request `x_request_id` ended at its first token (it
    /// answered `kv_transfer_params: null`).
    pub fn note_finished_early(&self, x_request_id: &str) {
        let now = Instant::now();
        let mut early = self
            .finished_early
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // A decode leg that never came (the client left, the router refused) is forgotten.
        early.retain(|_, at| now.saturating_duration_since(*at) < FINISHED_EARLY_FOR);
        early.insert(x_request_id.to_string(), now);
    }

    /// Whether request `x_request_id`'s prefill leg ended at its first token, forgetting it:
    /// then, and only then, a decode pod takes the request without `kv_transfer_params`.
    pub fn take_finished_early(&self, x_request_id: &str) -> bool {
        self.finished_early
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(x_request_id)
            .is_some_and(|at| at.elapsed() < FINISHED_EARLY_FOR)
    }

    /// The pod with engine id `engine_id`.
    pub fn get(&self, engine_id: &str) -> Option<Arc<PodState>> {
        self.lock().get(engine_id).cloned()
    }

    /// Whether some served prefill pod of `engine` listens at `ip` with bootstrap port
    /// `port`: what an SGLang decode worker needs to reach the bootstrap server it is told.
    pub fn has_bootstrap_server(&self, engine: Engine, ip: &str, port: u16) -> bool {
        self.lock().values().any(|p| {
            p.role == PodRole::Prefill
                && Engine::from_label(&p.record.engine) == engine
                && p.record.ip == ip
                && p.record.sglang_bootstrap_port == port
        })
    }

    /// Checks `kv` against the prefill pod it names and, when it is right, frees the pinned
    /// blocks there (the NIXL notification a real decode pod sends after its READ).
    pub fn pull(&self, kv: &Value) -> KvPull {
        let field = |k: &str| kv.get(k).and_then(Value::as_str).unwrap_or_default();
        let Some(prefill) = self.lock().get(field("remote_engine_id")).cloned() else {
            return KvPull::UnknownEngine;
        };
        if field("remote_host") != prefill.record.ip {
            return KvPull::HostMismatch;
        }
        if prefill.release_pin(field("remote_request_id")) {
            KvPull::Ok
        } else {
            KvPull::UnknownRequest
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Running,
    Done,
}

/// A request's share of the pod's gauges, undone exactly once whatever way it ends.
#[derive(Debug)]
struct Ticket {
    pod: Arc<PodState>,
    phase: Phase,
    held_tokens: u64,
    prompt_tokens: u64,
    generated: u64,
}

impl Ticket {
    fn new(pod: Arc<PodState>) -> Self {
        pod.lock().waiting += 1;
        Ticket {
            pod,
            phase: Phase::Waiting,
            held_tokens: 0,
            prompt_tokens: 0,
            generated: 0,
        }
    }

    /// Waiting → running, holding the prompt's KV and counting its prompt tokens.
    fn start(&mut self, prompt_tokens: u64) {
        if self.phase != Phase::Waiting {
            return;
        }
        let mut inner = self.pod.lock();
        inner.waiting -= 1;
        inner.running += 1;
        inner.active_kv_tokens += prompt_tokens;
        inner.metrics.prompt_tokens += prompt_tokens;
        self.held_tokens = prompt_tokens;
        self.prompt_tokens = prompt_tokens;
        self.phase = Phase::Running;
    }

    fn token(&mut self) {
        let mut inner = self.pod.lock();
        inner.metrics.generation_tokens += 1;
        self.generated += 1;
        if self.phase == Phase::Running {
            inner.active_kv_tokens += 1;
            self.held_tokens += 1;
        }
    }

    /// The request's tokens, into the counters that grow when a request ends.
    fn count_finished(&self, inner: &mut Inner) {
        inner.metrics.finished_prompt_tokens += self.prompt_tokens;
        inner.metrics.finished_generation_tokens += self.generated;
    }

    /// Running → done; returns the KV tokens the request held.
    fn finish(&mut self, e2e: Duration) -> u64 {
        let mut inner = self.pod.lock();
        release(&mut inner, self.phase, self.held_tokens);
        self.count_finished(&mut inner);
        inner.metrics.success_length += 1;
        inner.metrics.e2e.observe(e2e.as_secs_f64());
        self.phase = Phase::Done;
        self.held_tokens
    }
}

fn release(inner: &mut Inner, phase: Phase, held: u64) {
    match phase {
        Phase::Waiting => inner.waiting -= 1,
        Phase::Running => {
            inner.running -= 1;
            inner.active_kv_tokens -= held;
        }
        Phase::Done => {}
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.phase == Phase::Done {
            return;
        }
        let mut inner = self.pod.lock();
        release(&mut inner, self.phase, self.held_tokens);
        self.count_finished(&mut inner);
        inner.metrics.success_abort += 1;
    }
}

/// The sub-queues of `waiting` that SGLang reports apart.
#[derive(Debug, Clone, Copy)]
enum Queue {
    PrefillPrealloc,
    DecodePrealloc,
    KvTransfer,
}

/// A request's place in one [`Queue`], left on drop (a client hanging up included).
#[derive(Debug)]
struct QueueSlot {
    pod: Arc<PodState>,
    queue: Queue,
}

impl QueueSlot {
    fn new(pod: Arc<PodState>, queue: Queue) -> Self {
        *Self::counter(&mut pod.lock(), queue) += 1;
        QueueSlot { pod, queue }
    }

    fn counter(inner: &mut Inner, queue: Queue) -> &mut u64 {
        match queue {
            Queue::PrefillPrealloc => &mut inner.prefill_prealloc,
            Queue::DecodePrealloc => &mut inner.decode_prealloc,
            Queue::KvTransfer => &mut inner.kv_transfer,
        }
    }
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        let mut inner = self.pod.lock();
        let c = Self::counter(&mut inner, self.queue);
        *c = c.saturating_sub(1);
    }
}

/// What a job is asked to do; derived from the validated request.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// The work actually done: a decode leg whose pull failed is run as `Full` (recompute).
    pub work: Leg,
    pub prompt_tokens: u64,
    /// Prompt tokens past the prefix-cache hit; what prefill time is charged for.
    pub new_tokens: u64,
    pub output_tokens: u64,
    /// Prefill legs: the `remote_request_id` under which the result's blocks stay pinned.
    pub pin_as: Option<String>,
}

/// One request being played through the timing model, one token at a time.
#[derive(Debug)]
pub struct Job {
    pod: Arc<PodState>,
    spec: JobSpec,
    received: Instant,
    produced: u64,
    last_token_at: Option<Instant>,
    ticket: Ticket,
    _admission: Option<OwnedSemaphorePermit>,
    /// An SGLang decode leg's place in the transfer queue, from its registration in the
    /// room until its KV is pulled.
    transfer: Option<QueueSlot>,
}

impl Job {
    /// Starts waiting on `pod`; `received` is when the request arrived, for TTFT and E2E.
    pub fn new(pod: Arc<PodState>, spec: JobSpec, received: Instant) -> Self {
        Job {
            ticket: Ticket::new(pod.clone()),
            pod,
            spec,
            received,
            produced: 0,
            last_token_at: None,
            _admission: None,
            transfer: None,
        }
    }

    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// An SGLang prefill leg before it may compute: waits for `decode` (its decode leg
    /// registering in the bootstrap room) in the prefill bootstrap queue
    /// (`num_prefill_prealloc_queue_reqs`), holding no batch slot.
    pub async fn bootstrap<T, E>(
        &mut self,
        decode: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let _queued = QueueSlot::new(self.pod.clone(), Queue::PrefillPrealloc);
        decode.await
    }

    /// An SGLang decode leg: takes its request slot in the decode prealloc queue, as SGLang
    /// pre-allocates the KV pages before it registers with the prefill side, then waits for
    /// `kv` (which registers it in the room) in the transfer queue. The KV pull that follows
    /// in [`Job::next_token`] stays in the transfer queue; once it is done the request runs at
    /// once, its slot being already held.
    pub async fn receive_kv<T, E>(
        &mut self,
        kv: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        self.admit().await;
        let transfer = QueueSlot::new(self.pod.clone(), Queue::KvTransfer);
        let got = kv.await;
        if got.is_ok() {
            self.transfer = Some(transfer);
        }
        got
    }

    /// Takes a batch slot; a decode leg waits for it in the decode prealloc queue.
    async fn admit(&mut self) {
        if self._admission.is_some() {
            return;
        }
        let prealloc = (self.spec.work == Leg::Decode)
            .then(|| QueueSlot::new(self.pod.clone(), Queue::DecodePrealloc));
        self._admission = self.pod.seqs.clone().acquire_owned().await.ok();
        drop(prealloc);
    }

    /// Waits until the next token exists and returns its index, or `None` when the request
    /// has produced all its tokens (at which point it is counted as finished).
    pub async fn next_token(&mut self) -> Option<u64> {
        if self.produced >= self.spec.output_tokens {
            return None;
        }
        let config = self.pod.config.clone();
        let timing = &config.timing;
        if self.produced == 0 {
            self.admit().await;
            let scheduled = match self.spec.work {
                Leg::Prefill | Leg::Full => {
                    let _lane = match &self.pod.prefill_lane {
                        Some(lane) => lane.clone().acquire_owned().await.ok(),
                        None => None,
                    };
                    self.ticket.start(self.spec.prompt_tokens);
                    let scheduled = Instant::now();
                    engine::spend(timing.prefill_time(self.spec.new_tokens)).await;
                    scheduled
                }
                Leg::Decode => {
                    // vLLM counts a request as waiting while its KV is being pulled.
                    let transfer = self
                        .transfer
                        .take()
                        .unwrap_or_else(|| QueueSlot::new(self.pod.clone(), Queue::KvTransfer));
                    engine::spend(timing.kv_pull_time(self.spec.prompt_tokens)).await;
                    drop(transfer);
                    self.ticket.start(self.spec.prompt_tokens);
                    let scheduled = Instant::now();
                    engine::spend(timing.decode_step(self.pod.running())).await;
                    scheduled
                }
            };
            let now = Instant::now();
            let mut inner = self.pod.lock();
            inner
                .metrics
                .prefill_time
                .observe((now - scheduled).as_secs_f64());
            inner
                .metrics
                .ttft
                .observe((now - self.received).as_secs_f64());
        } else {
            engine::spend(timing.decode_step(self.pod.running())).await;
            if let Some(last) = self.last_token_at {
                self.pod
                    .lock()
                    .metrics
                    .inter_token
                    .observe(last.elapsed().as_secs_f64());
            }
        }
        let index = self.produced;
        self.produced += 1;
        self.last_token_at = Some(Instant::now());
        self.ticket.token();
        if self.produced == self.spec.output_tokens {
            let held = self.ticket.finish(self.received.elapsed());
            if let Some(request_id) = &self.spec.pin_as {
                self.pod.pin(request_id, held);
            }
            self._admission = None;
        }
        Some(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, role: &str, ip: &str) -> PodRecord {
        PodRecord {
            namespace: "default".into(),
            role: role.into(),
            roleset: "rs".into(),
            ..PodRecord::sample(name, ip)
        }
    }

    fn fast_config() -> Arc<SimConfig> {
        Arc::new(SimConfig {
            timing: TimingModel {
                prefill_base_ms: 0.0,
                prefill_us_per_token: 0.0,
                decode_ms_per_token: 0.0,
                batch_slowdown: 0.0,
                kv_pull_base_ms: 0.0,
                kv_pull_us_per_token: 0.0,
            },
            kv_capacity_tokens: 1000,
            ..SimConfig::default()
        })
    }

    fn spec(work: Leg, pin_as: Option<&str>) -> JobSpec {
        JobSpec {
            work,
            prompt_tokens: 100,
            new_tokens: 100,
            output_tokens: 3,
            pin_as: pin_as.map(String::from),
        }
    }

    #[tokio::test]
    async fn job_moves_gauges_and_counts() {
        let pod = Arc::new(PodState::new(record("p", "", "127.0.0.2"), fast_config()));
        let mut job = Job::new(pod.clone(), spec(Leg::Full, None), Instant::now());
        assert_eq!((pod.metrics().waiting, pod.metrics().running), (1, 0));
        assert_eq!(job.next_token().await, Some(0));
        let m = pod.metrics();
        assert_eq!((m.waiting, m.running, m.prompt_tokens), (0, 1, 100));
        assert!(
            (m.kv_usage - 0.101).abs() < 1e-9,
            "prompt + one token of 1000"
        );
        assert_eq!(job.next_token().await, Some(1));
        assert_eq!(job.next_token().await, Some(2));
        assert_eq!(job.next_token().await, None);
        let m = pod.metrics();
        assert_eq!(
            (
                m.running,
                m.generation_tokens,
                m.success_length,
                m.ttft.count()
            ),
            (0, 3, 1, 1)
        );
        assert_eq!(m.kv_usage, 0.0);
    }

    /// The overhead benchmarks' "zero compute" engine must really take no time. tokio rounds
    /// every timer up to its next 1 ms tick, so the proof is that no timer is armed at all:
    /// the jobs run on a runtime without a time driver, where arming one panics.
    #[test]
    fn zero_timing_arms_no_timer() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime without timers");
        let pod = Arc::new(PodState::new(
            record("d", "decode", "127.0.0.2"),
            fast_config(),
        ));
        rt.block_on(async {
            for leg in [Leg::Full, Leg::Prefill, Leg::Decode] {
                let mut job = Job::new(pod.clone(), spec(leg, None), Instant::now());
                let mut tokens = 0;
                while job.next_token().await.is_some() {
                    tokens += 1;
                }
                assert_eq!(tokens, 3);
            }
        });
    }

    #[tokio::test]
    async fn dropped_job_is_an_abort_and_releases_everything() {
        let pod = Arc::new(PodState::new(record("p", "", "127.0.0.2"), fast_config()));
        let mut job = Job::new(pod.clone(), spec(Leg::Full, None), Instant::now());
        job.next_token().await;
        drop(job);
        let m = pod.metrics();
        assert_eq!(
            (m.running, m.waiting, m.success_abort, m.kv_usage),
            (0, 0, 1, 0.0)
        );
        drop(Job::new(pod.clone(), spec(Leg::Full, None), Instant::now()));
        assert_eq!(pod.metrics().waiting, 0);
    }

    #[tokio::test]
    async fn prefill_pins_until_pulled_through_the_registry() {
        let prefill = Arc::new(PodState::new(
            record("p", "prefill", "127.0.0.2"),
            fast_config(),
        ));
        let registry = Registry::default();
        registry.insert(prefill.clone());
        let mut job = Job::new(
            prefill.clone(),
            JobSpec {
                output_tokens: 1,
                ..spec(Leg::Prefill, Some("r1"))
            },
            Instant::now(),
        );
        while job.next_token().await.is_some() {}
        assert!(
            (prefill.metrics().kv_usage - 0.101).abs() < 1e-9,
            "blocks stay pinned"
        );
        let kv = |host: &str, engine: &str, rid: &str| serde_json::json!({"remote_engine_id": engine, "remote_host": host, "remote_request_id": rid});
        assert_eq!(
            registry.pull(&kv("127.0.0.2", "nope", "r1")),
            KvPull::UnknownEngine
        );
        assert_eq!(
            registry.pull(&kv("localhost", &prefill.engine_id, "r1")),
            KvPull::HostMismatch
        );
        assert_eq!(
            registry.pull(&kv("127.0.0.2", &prefill.engine_id, "r2")),
            KvPull::UnknownRequest
        );
        assert_eq!(
            registry.pull(&kv("127.0.0.2", &prefill.engine_id, "r1")),
            KvPull::Ok
        );
        assert_eq!(prefill.metrics().kv_usage, 0.0);
        assert_eq!(
            registry.pull(&kv("127.0.0.2", &prefill.engine_id, "r1")),
            KvPull::UnknownRequest
        );
    }

    #[test]
    fn pins_expire() {
        let config = Arc::new(SimConfig {
            kv_pin_timeout: Duration::ZERO,
            ..(*fast_config()).clone()
        });
        let pod = PodState::new(record("p", "prefill", "127.0.0.2"), config);
        pod.pin("r", 10);
        assert_eq!(pod.metrics().kv_usage, 0.0);
        assert!(!pod.release_pin("r"));
    }

    #[test]
    fn prefix_hits_reduce_new_tokens() {
        let pod = PodState::new(record("p", "", "127.0.0.2"), fast_config());
        let text = "x".repeat(64 * 3);
        let hashes = crate::prefix::block_hashes(&text);
        assert_eq!(pod.prefill_lookup(&hashes, 48), 48);
        assert_eq!(
            pod.prefill_lookup(&hashes, 48),
            1,
            "full hit still computes one token"
        );
        let m = pod.metrics();
        assert_eq!((m.prefix_queries, m.prefix_hits), (96, 48));
        assert_eq!(pod.allocate_blocks(2), vec![1, 2]);
        assert_eq!(pod.allocate_blocks(1), vec![3]);
    }

    #[test]
    fn gen_throughput_is_averaged_over_closed_windows() {
        let start = Instant::now();
        let pod = PodState::new(record("p", "", "127.0.0.2"), fast_config());
        pod.lock().metrics.generation_tokens = 3;
        assert_eq!(
            pod.metrics_at(start).gen_throughput,
            0.0,
            "window still open"
        );
        let m = pod.metrics_at(start + Duration::from_secs(2));
        assert!(
            (1.4..=1.6).contains(&m.gen_throughput),
            "{}",
            m.gen_throughput
        );
        pod.lock().metrics.generation_tokens = 10;
        let held = pod.metrics_at(start + Duration::from_millis(2500));
        assert_eq!(
            held.gen_throughput, m.gen_throughput,
            "kept until the window closes"
        );
        let next = pod.metrics_at(start + Duration::from_secs(4));
        assert!(
            (3.4..=3.6).contains(&next.gen_throughput),
            "7 tokens over ~2 s"
        );
        let idle = pod.metrics_at(start + Duration::from_secs(6));
        assert_eq!(idle.gen_throughput, 0.0);
    }

    #[tokio::test]
    async fn decode_legs_show_in_prealloc_then_transfer_queues() {
        let mut config = (*fast_config()).clone();
        config.max_num_seqs = 1;
        config.timing.kv_pull_base_ms = 10_000.0;
        let pod = Arc::new(PodState::new(
            record("d", "decode", "127.0.0.2"),
            Arc::new(config),
        ));
        let mut holder = Job::new(pod.clone(), spec(Leg::Full, None), Instant::now());
        assert_eq!(holder.next_token().await, Some(0));
        let mut decode = Job::new(pod.clone(), spec(Leg::Decode, None), Instant::now());
        let task = tokio::spawn(async move { decode.next_token().await });
        let settled = |want: (u64, u64, u64)| {
            let pod = pod.clone();
            async move {
                for _ in 0..200 {
                    let m = pod.metrics();
                    if (m.waiting, m.decode_prealloc, m.kv_transfer) == want {
                        return m;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                panic!("never reached {want:?}: {:?}", pod.metrics());
            }
        };
        let m = settled((1, 1, 0)).await;
        assert_eq!(m.running, 1);
        while holder.next_token().await.is_some() {}
        let m = settled((1, 0, 1)).await;
        assert_eq!(m.running, 0);
        task.abort();
        let _ = task.await;
        let m = settled((0, 0, 0)).await;
        assert_eq!(m.running, 0);
    }

    /// (waiting, prefill prealloc, decode prealloc, transfer, running) of `pod`, once it
    /// holds still at `want`.
    async fn settles(pod: &PodState, want: (u64, u64, u64, u64, u64)) {
        let queues = |m: MetricsSnapshot| {
            (
                m.waiting,
                m.prefill_prealloc,
                m.decode_prealloc,
                m.kv_transfer,
                m.running,
            )
        };
        for _ in 0..400 {
            if queues(pod.metrics()) == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("never reached {want:?}: {:?}", queues(pod.metrics()));
    }

    /// A gate that records when it is first polled (the leg registered in its room) and
    /// opens when the sender fires (or fails when it is dropped).
    fn gate() -> (
        tokio::sync::oneshot::Sender<()>,
        Arc<std::sync::atomic::AtomicBool>,
        impl Future<Output = Result<(), ()>> + Send + 'static,
    ) {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let polled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = polled.clone();
        let wait = async move {
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
            rx.await.map_err(|_| ())
        };
        (tx, polled, wait)
    }

    #[tokio::test]
    async fn an_sglang_decode_leg_takes_its_slot_then_waits_for_kv_in_the_transfer_queue() {
        let mut config = (*fast_config()).clone();
        config.max_num_seqs = 1;
        let pod = Arc::new(PodState::new(
            record("d", "decode", "127.0.0.2"),
            Arc::new(config),
        ));
        let mut holder = Job::new(pod.clone(), spec(Leg::Full, None), Instant::now());
        assert_eq!(holder.next_token().await, Some(0));
        let (kv, registered, wait) = gate();
        let mut decode = Job::new(pod.clone(), spec(Leg::Decode, None), Instant::now());
        let task = tokio::spawn(async move {
            decode.receive_kv(wait).await.expect("kv arrived");
            let first = decode.next_token().await;
            (first, decode)
        });
        // The batch is full: the leg waits for its slot and has not registered yet.
        settles(&pod, (1, 0, 1, 0, 1)).await;
        assert!(!registered.load(std::sync::atomic::Ordering::SeqCst));
        // Slot taken: registered, waiting for the KV in the transfer queue, not the queue.
        while holder.next_token().await.is_some() {}
        settles(&pod, (1, 0, 0, 1, 0)).await;
        assert!(registered.load(std::sync::atomic::Ordering::SeqCst));
        let text = crate::metrics::render_sglang("m", "decode", &pod.metrics());
        assert!(
            text.lines()
                .any(|l| l.starts_with("sglang:num_queue_reqs{") && l.ends_with(" 0.0")),
            "{text}"
        );
        // The KV arrived: pulled, then running at once on the slot it holds.
        kv.send(()).expect("leg waiting");
        let (first, running) = task.await.expect("join");
        assert_eq!(first, Some(0));
        settles(&pod, (0, 0, 0, 0, 1)).await;
        drop(running);

        // A leg whose KV never comes leaves the transfer queue with its failure.
        let (gone, _, wait) = gate();
        drop(gone);
        let mut decode = Job::new(pod.clone(), spec(Leg::Decode, None), Instant::now());
        assert_eq!(decode.receive_kv(wait).await, Err(()));
        settles(&pod, (1, 0, 0, 0, 0)).await;
        drop(decode);
        settles(&pod, (0, 0, 0, 0, 0)).await;
    }

    #[tokio::test]
    async fn an_sglang_prefill_leg_waits_for_its_decode_leg_in_the_bootstrap_queue() {
        let pod = Arc::new(PodState::new(
            record("p", "prefill", "127.0.0.2"),
            fast_config(),
        ));
        let (decode_registered, _, wait) = gate();
        let mut prefill = Job::new(
            pod.clone(),
            spec(Leg::Prefill, Some("room")),
            Instant::now(),
        );
        let task = tokio::spawn(async move {
            prefill.bootstrap(wait).await.expect("decode registered");
            while prefill.next_token().await.is_some() {}
        });
        settles(&pod, (1, 1, 0, 0, 0)).await;
        let m = pod.metrics();
        assert_eq!(
            (m.prompt_tokens, m.kv_used_tokens),
            (0, 0),
            "nothing computed"
        );
        let text = crate::metrics::render_sglang("m", "prefill", &m);
        for line in [
            "sglang:num_prefill_prealloc_queue_reqs{engine_type=\"prefill\",model_name=\"m\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"} 1.0",
            "sglang:num_queue_reqs{engine_type=\"prefill\",model_name=\"m\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"} 0.0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        }
        decode_registered.send(()).expect("leg waiting");
        task.await.expect("join");
        settles(&pod, (0, 0, 0, 0, 0)).await;
        let m = pod.metrics();
        assert_eq!(
            (m.prompt_tokens, m.prefill_inflight),
            (100, 1),
            "computed, KV pinned"
        );

        // Nobody registers: the leg leaves the queue with its failure.
        let (gone, _, wait) = gate();
        drop(gone);
        let mut prefill = Job::new(pod.clone(), spec(Leg::Prefill, None), Instant::now());
        assert_eq!(prefill.bootstrap(wait).await, Err(()));
        settles(&pod, (1, 0, 0, 0, 0)).await;
        drop(prefill);
        settles(&pod, (0, 0, 0, 0, 0)).await;
    }
}
