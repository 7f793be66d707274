//! pd-load's engine: an open-loop (or closed-loop) generator of OpenAI completion traffic
//! that records, per request, what a client can observe of the router's decisions (status,
//! `target-pod`, `prefill-target-pod`, `x-error-*` headers) and of its latency (TTFT, E2E).
//!
//! Open loop matters: arrivals do not wait for earlier responses, so a slow router shows up
//! as growing latency rather than as a politely reduced request rate.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::client::Sender;
use crate::probe::{self, CpuReport, OthersReport, PrefixReport};
use crate::stats::{summarize, Summary};
use crate::trace::TraceEntry;
use crate::workload::plan;

/// How arrivals are spaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arrival {
    /// Exponential gaps: the arrival process of many independent users.
    Poisson,
    /// Equal gaps.
    Fixed,
}

/// What requests look like.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum Workload {
    /// `--prompt-tokens`, `--chat-ratio`, `--shared-prefix-tokens`.
    Random,
    /// Chat bodies of exactly this many bytes.
    Fixed { body_bytes: usize },
    /// The synthetic mixed trace ([`crate::trace::mixed`]).
    Mixed,
    /// A JSONL trace file ([`crate::trace`]).
    Replay { trace: String },
}

/// A run's settings (from the command line).
#[derive(Debug, Clone, Serialize)]
pub struct LoadConfig {
    /// Base URL, e.g. `http://127.0.0.1:10000`; the OpenAI path is appended.
    pub url: String,
    pub model: String,
    /// Arrivals per second; 0 means closed loop (`clients` sequential senders).
    pub rps: f64,
    pub duration: Duration,
    /// Stop after this many requests.
    pub requests: Option<u64>,
    pub clients: usize,
    pub arrival: Arrival,
    pub stream_ratio: f64,
    pub chat_ratio: f64,
    /// Inclusive range of prompt sizes, in tokens of ~4 characters.
    pub prompt_tokens: (u64, u64),
    /// Leading tokens every prompt shares (for prefix-cache experiments).
    pub shared_prefix_tokens: u64,
    pub max_tokens: u64,
    pub headers: Vec<(String, String)>,
    /// Value of the `routing-strategy` header; empty sends none.
    pub routing_strategy: String,
    pub concurrency_limit: usize,
    pub timeout: Duration,
    /// Ask streams for a final usage chunk (`stream_options.include_usage`).
    pub include_usage: bool,
    pub seed: u64,
    /// Base URL of a prefill pod: pd-load runs the vLLM prefill leg itself, then sends the
    /// decode leg to `url`. The "no router" baseline of a PD exchange.
    pub direct_prefill: Option<String>,
    pub workload: Workload,
    /// The entries of a `mixed` or `replay` workload, sent in order (cycling).
    #[serde(skip)]
    pub trace: Arc<Vec<TraceEntry>>,
    /// Arrivals at the trace's `offset_ms` instead of `rps`/`clients`.
    pub trace_timing: bool,
    /// pd-sim's admin URL: read the pods' prefix-cache counters before and after the run.
    pub sim_admin: Option<String>,
    /// Processes whose CPU time (from /proc) the run reports, e.g. the router's.
    pub cpu_pids: Vec<u32>,
    /// Processes the run needs besides the router (engines, control services): their CPU is
    /// not the router's, and not a stranger's either (see [`probe::OthersReport`]).
    pub side_pids: Vec<u32>,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            url: "http://127.0.0.1:10000".into(),
            model: String::new(),
            rps: 10.0,
            duration: Duration::from_secs(20),
            requests: None,
            clients: 1,
            arrival: Arrival::Poisson,
            stream_ratio: 0.5,
            chat_ratio: 0.5,
            prompt_tokens: (64, 2048),
            shared_prefix_tokens: 0,
            max_tokens: 16,
            headers: Vec::new(),
            routing_strategy: "pd".into(),
            concurrency_limit: 256,
            timeout: Duration::from_secs(60),
            include_usage: true,
            seed: 1,
            direct_prefill: None,
            workload: Workload::Random,
            trace: Arc::default(),
            trace_timing: false,
            sim_admin: None,
            cpu_pids: Vec::new(),
            side_pids: Vec::new(),
        }
    }
}

/// What one request observed.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct RequestResult {
    pub seq: u64,
    /// Send time relative to the start of the run.
    pub start_ms: f64,
    pub path: String,
    pub stream: bool,
    pub prompt_tokens: u64,
    /// `None` when no response arrived (connection error, timeout before headers).
    pub status: Option<u16>,
    /// Why the request failed, when it did: transport error, timeout, error body message,
    /// truncated or errored stream.
    pub error: Option<String>,
    pub target_pod: Option<String>,
    pub prefill_target_pod: Option<String>,
    pub request_id: Option<String>,
    /// Every `x-error-*` response header.
    pub error_headers: BTreeMap<String, String>,
    /// Streams: time to the first SSE event carrying a token. Non-streams: the E2E time.
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    /// Generated tokens (usage when reported, else counted chunks).
    pub tokens: u64,
    /// `--direct-prefill`: the duration of the prefill leg pd-load made itself.
    pub prefill_ms: Option<f64>,
    /// Streams: the longest wait between two reads that brought tokens, after the first
    /// token (a gateway that holds a stream back shows here, where the mean TPOT hides it).
    /// Every such wait goes into the run's histogram instead (`Summary::chunk_gap_ms`).
    pub max_gap_ms: Option<f64>,
}

impl RequestResult {
    pub fn is_ok(&self) -> bool {
        self.status == Some(200) && self.error.is_none()
    }

    /// Mean time per output token after the first.
    /// Streams only: a non-stream's TTFT is its E2E, so it says nothing about decode speed.
    pub fn tpot_ms(&self) -> Option<f64> {
        let ttft = self.ttft_ms.filter(|_| self.stream)?;
        (self.tokens > 1).then(|| (self.e2e_ms - ttft) / (self.tokens - 1) as f64)
    }
}

/// Everything a run produced.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    pub config: LoadConfig,
    pub summary: Summary,
    /// With `sim_admin`: the prefix cache and prompt tokens per pod over the run.
    pub prefix: Option<PrefixReport>,
    /// With `cpu_pids`: their CPU time over the run.
    pub cpu: Option<CpuReport>,
    /// With `cpu_pids` or `side_pids`: what the rest of the box took meanwhile.
    pub others: Option<OthersReport>,
    pub results: Vec<RequestResult>,
}

/// `host:port` of a base URL (the summary's target), or the URL itself when it has none.
pub(crate) fn host_port(url: &str) -> String {
    reqwest::Url::parse(url)
        .ok()
        .and_then(|u| Some(format!("{}:{}", u.host_str()?, u.port_or_known_default()?)))
        .unwrap_or_else(|| url.to_string())
}

/// Runs a load test and returns every result plus the summary.
pub async fn run(cfg: LoadConfig) -> Result<RunReport, String> {
    let probe = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| format!("cannot build HTTP client: {e}"))?;
    let sim_before = match &cfg.sim_admin {
        Some(admin) => Some(probe::read_sim(&probe, admin).await?),
        None => None,
    };
    let cpu_before = if cfg.cpu_pids.is_empty() && cfg.side_pids.is_empty() {
        None
    } else {
        Some(
            probe::read_cpu(&cfg.cpu_pids, &cfg.side_pids)
                .ok_or_else(|| format!("cannot read /proc/<pid>/stat of {:?}", cfg.cpu_pids))?,
        )
    };
    let sender = Arc::new(Sender::new(cfg.clone())?);
    let mut rng = fastrand::Rng::with_seed(cfg.seed);
    let run_start = sender.run_start;
    let (mut results, send_window, delayed) = if cfg.rps > 0.0 || cfg.trace_timing {
        open_loop(&cfg, &sender, &mut rng).await
    } else {
        closed_loop(&cfg, &sender, rng).await
    };
    let elapsed = run_start.elapsed().as_secs_f64();
    let cpu_after = cpu_before.and(probe::read_cpu(&cfg.cpu_pids, &cfg.side_pids));
    results.sort_by_key(|r| r.seq);
    let target = host_port(&cfg.url);
    let summary = summarize(
        &results,
        send_window.as_secs_f64().max(1e-9),
        elapsed,
        delayed,
        &target,
        &sender.chunk_gaps.snapshot(),
    );
    let prefix = match (&cfg.sim_admin, sim_before) {
        (Some(admin), Some(before)) => {
            let after = probe::read_sim(&probe, admin).await?;
            Some(probe::prefix_report(&before, &after))
        }
        _ => None,
    };
    let (cpu, others) = match (cpu_before, cpu_after) {
        (Some(b), Some(a)) => (
            (!cfg.cpu_pids.is_empty())
                .then(|| probe::cpu_report(&cfg.cpu_pids, &b, &a, summary.ok)),
            probe::others_report(&b, &a),
        ),
        _ => (None, None),
    };
    Ok(RunReport {
        config: cfg,
        summary,
        prefix,
        cpu,
        others,
        results,
    })
}

async fn open_loop(
    cfg: &LoadConfig,
    sender: &Arc<Sender>,
    rng: &mut fastrand::Rng,
) -> (Vec<RequestResult>, Duration, u64) {
    let slots = Arc::new(Semaphore::new(cfg.concurrency_limit.max(1)));
    let mut tasks = JoinSet::new();
    let start = tokio::time::Instant::from_std(sender.run_start);
    let mut next = start;
    let mut delayed = 0;
    let mut seq = 0u64;
    let trace_len = cfg.trace.len() as u64;
    if cfg.trace_timing {
        next = start + trace_offset(cfg, 0);
    }
    while cfg.requests.is_none_or(|n| seq < n)
        && next - start < cfg.duration
        && (!cfg.trace_timing || seq < trace_len)
    {
        tokio::time::sleep_until(next).await;
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                delayed += 1;
                match slots.clone().acquire_owned().await {
                    Ok(p) => p,
                    Err(_) => break,
                }
            }
        };
        let planned = plan(cfg, rng, seq);
        let sender = sender.clone();
        tasks.spawn(async move {
            let result = sender.send(planned).await;
            drop(permit);
            result
        });
        seq += 1;
        if cfg.trace_timing {
            next = start + trace_offset(cfg, seq);
            continue;
        }
        let gap = match cfg.arrival {
            Arrival::Fixed => 1.0 / cfg.rps,
            Arrival::Poisson => -(1.0 - rng.f64()).ln() / cfg.rps,
        };
        next += Duration::from_secs_f64(gap.clamp(0.0, 3600.0));
    }
    // The sending window ends at the next scheduled arrival, so that N requests at R rps
    // report R rps offered rather than R·N/(N−1).
    let window = (next - start).min(cfg.duration);
    let mut results = Vec::with_capacity(seq as usize);
    while let Some(joined) = tasks.join_next().await {
        if let Ok(r) = joined {
            results.push(r);
        }
    }
    (results, window, delayed)
}

/// Arrival time of trace entry `seq` (the last offset seen when an entry has none); past the
/// end of the trace, a time after any duration so the sending loop stops.
fn trace_offset(cfg: &LoadConfig, seq: u64) -> Duration {
    let Some(upto) = cfg.trace.get(..=seq as usize) else {
        return Duration::from_secs(86_400 * 365);
    };
    let ms = upto.iter().rev().find_map(|e| e.offset_ms).unwrap_or(0.0);
    Duration::from_secs_f64((ms / 1000.0).clamp(0.0, 86_400.0 * 30.0))
}

async fn closed_loop(
    cfg: &LoadConfig,
    sender: &Arc<Sender>,
    rng: fastrand::Rng,
) -> (Vec<RequestResult>, Duration, u64) {
    // Plans are drawn from one generator in sequence order, so a closed-loop run sends the
    // same requests as an open-loop run with the same seed.
    let rng = Arc::new(std::sync::Mutex::new(rng));
    let next_seq = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..cfg.clients.max(1) {
        let (cfg, sender, rng, next_seq) =
            (cfg.clone(), sender.clone(), rng.clone(), next_seq.clone());
        tasks.spawn(async move {
            let mut out = Vec::new();
            loop {
                let seq = next_seq.fetch_add(1, Ordering::Relaxed);
                let over_count = cfg.requests.is_some_and(|n| seq >= n);
                let over_time =
                    cfg.requests.is_none() && sender.run_start.elapsed() >= cfg.duration;
                if over_count || over_time {
                    break;
                }
                let planned = {
                    let mut rng = rng.lock().unwrap_or_else(|e| e.into_inner());
                    plan(&cfg, &mut rng, seq)
                };
                out.push(sender.send(planned).await);
            }
            out
        });
    }
    let mut results = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        if let Ok(mut r) = joined {
            results.append(&mut r);
        }
    }
    (results, sender.run_start.elapsed(), 0)
}
