//! Command lines of `pd-sim` and `pd-load`, and their `main`s, so the binaries stay one line
//! and argument handling is testable.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

use crate::engine::TimingModel;
use crate::load::{self, Arrival, LoadConfig, Workload};
use crate::pod::SimConfig;
use crate::sim::{serve_admin, FleetWatcher, Sim};
use crate::trace::{self, MixedShape, TraceEntry};
use crate::{interleave, stats};

/// Simulated vLLM engine pods for every loopback pod of a fleet file.
#[derive(Debug, Parser)]
#[command(name = "pd-sim", version)]
pub struct SimArgs {
    /// Fleet file (Kubernetes Pod YAML, as pd-control reads). Watched for changes.
    #[arg(long)]
    pub fleet: PathBuf,
    /// Prefill cost per uncached prompt token, microseconds.
    #[arg(long, default_value_t = 20.0)]
    pub prefill_us_per_token: f64,
    /// Fixed prefill cost, milliseconds.
    #[arg(long, default_value_t = 2.0)]
    pub prefill_base_ms: f64,
    /// Decode step with an empty batch, milliseconds.
    #[arg(long, default_value_t = 2.0)]
    pub decode_ms_per_token: f64,
    /// Decode step slowdown per other running request on the pod.
    #[arg(long, default_value_t = 0.05)]
    pub batch_slowdown: f64,
    /// KV pull (decode pod) fixed cost, milliseconds.
    #[arg(long, default_value_t = 1.0)]
    pub kv_pull_base_ms: f64,
    /// KV pull cost per prompt token, microseconds.
    #[arg(long, default_value_t = 1.0)]
    pub kv_pull_us_per_token: f64,
    /// max_tokens when a request gives none.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u64,
    /// KV cache size per pod, tokens (denominator of kv_cache_usage_perc).
    #[arg(long, default_value_t = 100_000)]
    pub kv_capacity_tokens: u64,
    /// Requests a pod runs at once; more wait (vLLM --max-num-seqs).
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Prefills a pod runs at once (0 = unlimited).
    #[arg(long, default_value_t = 1)]
    pub prefill_concurrency: usize,
    /// Disable the simulated prefix cache.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Seconds a prefill pod keeps blocks for a decode pod to pull.
    #[arg(long, default_value_t = 30.0)]
    pub kv_pin_timeout_s: f64,
    /// Request-log entries kept per pod.
    #[arg(long, default_value_t = 10_000)]
    pub log_limit: usize,
    /// Serve /sim/requests and /sim/pods over all pods on this (loopback) address.
    #[arg(long)]
    pub admin: Option<SocketAddr>,
    /// Fleet file poll interval, milliseconds.
    #[arg(long, default_value_t = 100)]
    pub poll_ms: u64,
    /// Seconds either leg of an SGLang (or TRT-LLM generation-first) exchange waits for the
    /// other before failing, as the engines' transfer and bootstrap timeouts do.
    #[arg(long, default_value_t = 300.0)]
    pub pd_transfer_timeout_s: f64,
    /// TRT-LLM KV-cache transceiver: `python` reports the generation-first metadata on
    /// `/server_info`; `cpp` (TRT-LLM's default) answers an empty `disaggregated_params`.
    #[arg(long, default_value = "python", value_parser = ["python", "cpp"])]
    pub trtllm_transceiver: String,
    /// vLLM KV connector contract: `shfs` (upstream vLLM `kv_transfer_params`, AIBrix's
    /// default) or `nixl` (vLLM on Neuron: the decode leg carries `disagg_prefill_resp`).
    #[arg(long, default_value = "shfs", value_parser = ["shfs", "nixl"])]
    pub vllm_connector: String,
    /// `remote_host` a vLLM prefill answers: `localhost` (vLLM's default, which a router must
    /// overwrite) or `pod` (its own IP, as with `VLLM_NIXL_SIDE_CHANNEL_HOST` set).
    #[arg(long, default_value = "localhost", value_parser = ["localhost", "pod"])]
    pub side_channel_host: String,
    /// Also export xLLM's `engine_utilization` gauge (the signal AIBrix's `least-utilization`
    /// reads) beside the engine's own families, as the pod's batch occupancy.
    #[arg(long)]
    pub utilization_gauge: bool,
    /// Seconds a connection may carry no request before the pod closes it, as the engines'
    /// uvicorn does (`timeout_keep_alive`, 5 s); 0 keeps connections open.
    #[arg(long, default_value_t = 5.0)]
    pub keep_alive_timeout_s: f64,
    /// The engines' `--api-key`: vLLM pods then refuse `/v1/...` requests, SGLang pods every
    /// request but health and metrics, without `Authorization: Bearer <key>` (TRT-LLM has no
    /// such option).
    #[arg(long)]
    pub api_key: Option<String>,
}

impl SimArgs {
    pub fn config(&self) -> SimConfig {
        SimConfig {
            timing: TimingModel {
                prefill_base_ms: self.prefill_base_ms,
                prefill_us_per_token: self.prefill_us_per_token,
                decode_ms_per_token: self.decode_ms_per_token,
                batch_slowdown: self.batch_slowdown,
                kv_pull_base_ms: self.kv_pull_base_ms,
                kv_pull_us_per_token: self.kv_pull_us_per_token,
            },
            default_max_tokens: self.default_max_tokens.max(1),
            kv_capacity_tokens: self.kv_capacity_tokens.max(1),
            max_num_seqs: self.max_num_seqs.max(1),
            prefill_concurrency: self.prefill_concurrency,
            prefix_caching: !self.no_prefix_caching,
            kv_pin_timeout: Duration::try_from_secs_f64(self.kv_pin_timeout_s)
                .unwrap_or(Duration::from_secs(30)),
            log_limit: self.log_limit.max(1),
            transfer_timeout: Duration::try_from_secs_f64(self.pd_transfer_timeout_s)
                .unwrap_or(Duration::from_secs(300)),
            trtllm_python_transceiver: self.trtllm_transceiver == "python",
            vllm_neuron: self.vllm_connector == "nixl",
            side_channel_host_is_pod_ip: self.side_channel_host == "pod",
            utilization_gauge: self.utilization_gauge,
            keep_alive: Duration::try_from_secs_f64(self.keep_alive_timeout_s)
                .ok()
                .filter(|d| !d.is_zero()),
            api_key: self.api_key.clone(),
        }
    }
}

fn init_tracing(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

/// Prints the readiness line scripts wait for, and flushes so a pipe sees it at once.
fn announce(serving: usize) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "pd-sim: serving {serving} pods");
    let _ = out.flush();
}

/// `pd-sim`'s main.
pub fn sim_main() -> ExitCode {
    let args = SimArgs::parse();
    init_tracing("info");
    let result = runtime().and_then(|rt| rt.block_on(run_sim(args)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("pd-sim: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn run_sim(args: SimArgs) -> Result<(), String> {
    if let Some(addr) = args.admin {
        if !addr.ip().is_loopback() {
            return Err(format!("--admin {addr} is not a loopback address"));
        }
    }
    let watcher = FleetWatcher::load(
        args.fleet.clone(),
        Duration::from_millis(args.poll_ms.max(10)),
    )
    .map_err(|e| e.to_string())?;
    let sim = Sim::new(args.config());
    let report = sim.apply(watcher.records()).await;
    for skipped in &report.skipped {
        tracing::warn!("not served: {skipped}");
    }
    if !report.failed.is_empty() {
        let failures: Vec<String> = report
            .failed
            .iter()
            .map(|(a, e)| format!("{a}: {e}"))
            .collect();
        sim.shutdown().await;
        return Err(format!("cannot serve every pod: {}", failures.join("; ")));
    }
    let _admin = match args.admin {
        Some(addr) => Some(serve_admin(&sim, addr).await.map_err(|e| e.to_string())?),
        None => None,
    };
    announce(report.serving);
    let watch = tokio::spawn(watcher.run(sim.clone(), |report| announce(report.serving)));
    shutdown_signal().await;
    watch.abort();
    sim.shutdown().await;
    Ok(())
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Open-loop load generator for OpenAI completion endpoints behind pd-router.
#[derive(Debug, Parser)]
#[command(name = "pd-load", version)]
pub struct LoadArgs {
    /// Base URL of the router (or of a pod); must be a loopback address.
    #[arg(long, required_unless_present = "targets", default_value = "")]
    pub url: String,
    /// Instead of --url: several routers in one run, NAME=URL (repeatable). Arrivals are
    /// dealt to them request by request, in a new random order every round, so all see the
    /// same moments of the machine; each gets the same requests (see `interleave`). Needs
    /// --rps > 0 and --json-dir; no CPU or prefix figures.
    #[arg(long = "target", value_parser = crate::interleave::Target::parse)]
    pub targets: Vec<crate::interleave::Target>,
    /// With --target: write each target's report to DIR/NAME.SEED.json.
    #[arg(long)]
    pub json_dir: Option<PathBuf>,
    /// Model name to request.
    #[arg(long)]
    pub model: String,
    /// Arrivals per second; 0 = closed loop (--clients sequential senders).
    #[arg(long, default_value_t = 10.0)]
    pub rps: f64,
    /// How long to generate arrivals, e.g. 20s, 500ms, 2m.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Stop after this many requests.
    #[arg(long)]
    pub requests: Option<u64>,
    /// Closed-loop senders (with --rps 0).
    #[arg(long, default_value_t = 1)]
    pub clients: usize,
    /// Send one request and report it (same as --requests 1 --rps 0).
    #[arg(long)]
    pub once: bool,
    /// Arrival process: poisson or fixed.
    #[arg(long, default_value = "poisson", value_parser = parse_arrival)]
    pub arrival: Arrival,
    /// Fraction of requests that stream.
    #[arg(long, default_value_t = 0.5)]
    pub stream_ratio: f64,
    /// Fraction of requests sent to /v1/chat/completions (the rest to /v1/completions).
    #[arg(long, default_value_t = 0.5)]
    pub chat_ratio: f64,
    /// Prompt size in tokens (~4 characters each): N or LO..HI (uniform).
    #[arg(long, default_value = "64..2048", value_parser = parse_range)]
    pub prompt_tokens: (u64, u64),
    /// Leading prompt tokens shared by every request.
    #[arg(long, default_value_t = 0)]
    pub shared_prefix_tokens: u64,
    /// max_tokens of every request (the pods generate exactly this many).
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u64,
    /// Extra request header, K:V (repeatable).
    #[arg(long = "header", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// routing-strategy header value; empty sends none.
    #[arg(long, default_value = "pd")]
    pub routing_strategy: String,
    /// Most requests in flight; further arrivals wait.
    #[arg(long, default_value_t = 256)]
    pub concurrency_limit: usize,
    /// Per-request timeout, e.g. 60s.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Ask streams for a usage chunk (stream_options.include_usage).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub include_usage: bool,
    /// Seed of arrivals, prompts and stream/chat choices: same seed, same requests.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Base URL of a prefill pod: pd-load does the vLLM prefill leg itself and sends the
    /// decode leg to --url (the no-router baseline of a PD exchange).
    #[arg(long)]
    pub direct_prefill: Option<String>,
    /// What to send: random (--prompt-tokens, --chat-ratio), fixed (chat bodies of exactly
    /// --body-bytes), mixed (short chat, long RAG, multi-turn sessions) or replay (--trace).
    #[arg(long, default_value = "random", value_parser = ["random", "fixed", "mixed", "replay"])]
    pub workload: String,
    /// Body size of --workload fixed, bytes.
    #[arg(long, default_value_t = 2048)]
    pub body_bytes: usize,
    /// JSONL trace of --workload replay (format: the `trace` module's doc, docs/BENCHMARKS.md).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Send trace entries at their offset_ms instead of at --rps / with --clients.
    #[arg(long)]
    pub trace_timing: bool,
    /// Entries of the --workload mixed trace (the run cycles through them).
    #[arg(long, default_value_t = 2000)]
    pub mixed_entries: usize,
    /// Write the mixed or replayed trace as JSONL to this file.
    #[arg(long)]
    pub write_trace: Option<PathBuf>,
    /// pd-sim's admin URL: report the prefix-cache hit rate and per-pod prompt tokens.
    #[arg(long)]
    pub sim_admin: Option<String>,
    /// Report the CPU time these processes used during the run (repeatable).
    #[arg(long = "cpu-pid")]
    pub cpu_pids: Vec<u32>,
    /// Processes the run needs besides the router, e.g. the engines (repeatable; with
    /// --target, every router's too): the report counts what the rest of the box used (a busy
    /// box makes the run's figures suspect) and leaves these out of it.
    #[arg(long = "side-pid")]
    pub side_pids: Vec<u32>,
    /// Write the config, summary and every result as JSON to this file.
    #[arg(long, visible_alias = "out")]
    pub json: Option<PathBuf>,
    /// Exit 1 when any request failed.
    #[arg(long)]
    pub fail_on_error: bool,
    /// Allow URLs that are not loopback addresses.
    #[arg(long)]
    pub allow_non_loopback: bool,
}

impl LoadArgs {
    pub fn config(&self) -> Result<LoadConfig, String> {
        if !self.allow_non_loopback {
            if self.targets.is_empty() {
                crate::client::check_loopback(&self.url)?;
            }
            for t in &self.targets {
                crate::client::check_loopback(&t.url)?;
            }
            if let Some(p) = &self.direct_prefill {
                crate::client::check_loopback(p)?;
            }
        }
        let ratio = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(v)
            } else {
                Err(format!("--{name} must be within 0..=1, got {v}"))
            }
        };
        if !(self.rps.is_finite() && self.rps >= 0.0) {
            return Err(format!("--rps must be >= 0, got {}", self.rps));
        }
        let (workload, trace) = self.workload()?;
        if self.trace_timing && trace.is_empty() {
            return Err("--trace-timing needs --workload replay".into());
        }
        let (rps, requests) = if self.once {
            (0.0, Some(1))
        } else {
            (self.rps, self.requests)
        };
        Ok(LoadConfig {
            url: self.url.clone(),
            model: self.model.clone(),
            rps,
            duration: self.duration,
            requests,
            clients: if self.once { 1 } else { self.clients.max(1) },
            arrival: self.arrival,
            stream_ratio: ratio("stream-ratio", self.stream_ratio)?,
            chat_ratio: ratio("chat-ratio", self.chat_ratio)?,
            prompt_tokens: self.prompt_tokens,
            shared_prefix_tokens: self.shared_prefix_tokens,
            max_tokens: self.max_tokens.max(1),
            headers: self.headers.clone(),
            routing_strategy: self.routing_strategy.clone(),
            concurrency_limit: self.concurrency_limit.max(1),
            timeout: self.timeout,
            include_usage: self.include_usage,
            seed: self.seed,
            direct_prefill: self.direct_prefill.clone(),
            workload,
            trace: Arc::new(trace),
            trace_timing: self.trace_timing,
            sim_admin: self.sim_admin.clone(),
            cpu_pids: self.cpu_pids.clone(),
            side_pids: self.side_pids.clone(),
        })
    }

    fn workload(&self) -> Result<(Workload, Vec<TraceEntry>), String> {
        Ok(match self.workload.as_str() {
            "fixed" => (
                Workload::Fixed {
                    body_bytes: self.body_bytes,
                },
                Vec::new(),
            ),
            "mixed" => {
                let shape = MixedShape {
                    entries: self.mixed_entries.max(1),
                    ..MixedShape::default()
                };
                (Workload::Mixed, trace::mixed(&shape, self.seed))
            }
            "replay" => {
                let path = self
                    .trace
                    .as_ref()
                    .ok_or("--workload replay needs --trace FILE")?;
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                let entries =
                    trace::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
                (
                    Workload::Replay {
                        trace: path.display().to_string(),
                    },
                    entries,
                )
            }
            _ => (Workload::Random, Vec::new()),
        })
    }
}

/// Durations take a unit (`20s`, `500ms`, `2m`): the same parser as pd-control's flags.
pub use pd_control::config::parse_duration;

/// `N` or `LO..HI` (also `LO-HI`).
pub fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let parse = |v: &str| {
        v.trim()
            .parse::<u64>()
            .map_err(|_| format!("bad range {s:?}"))
    };
    let (lo, hi) = match s.split_once("..").or_else(|| s.split_once('-')) {
        Some((a, b)) => (parse(a)?, parse(b.trim_start_matches('='))?),
        None => {
            let n = parse(s)?;
            (n, n)
        }
    };
    if lo > hi || hi == 0 {
        return Err(format!("bad range {s:?}: need 1 <= HI and LO <= HI"));
    }
    Ok((lo, hi))
}

/// `Name:value`.
pub fn parse_header(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once(':')
        .ok_or_else(|| format!("bad header {s:?}: expected K:V"))?;
    let k = k.trim();
    if k.is_empty() {
        return Err(format!("bad header {s:?}: empty name"));
    }
    Ok((k.to_string(), v.trim().to_string()))
}

fn parse_arrival(s: &str) -> Result<Arrival, String> {
    match s {
        "poisson" => Ok(Arrival::Poisson),
        "fixed" => Ok(Arrival::Fixed),
        _ => Err(format!("bad arrival {s:?}: poisson or fixed")),
    }
}

/// `pd-load`'s main.
pub fn load_main() -> ExitCode {
    let args = LoadArgs::parse();
    init_tracing("warn");
    let cfg = match args.config() {
        Ok(cfg) => cfg,
        Err(err) => {
            eprintln!("pd-load: {err}");
            return ExitCode::from(2);
        }
    };
    if let Some(path) = &args.write_trace {
        if let Err(e) = std::fs::write(path, trace::to_jsonl(&cfg.trace)) {
            eprintln!("pd-load: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if !args.targets.is_empty() {
        return interleaved(&args, cfg);
    }
    let report = match runtime().and_then(|rt| rt.block_on(load::run(cfg))) {
        Ok(r) => r,
        Err(err) => {
            eprintln!("pd-load: {err}");
            return ExitCode::FAILURE;
        }
    };
    print!("{}", stats::render(&report.summary));
    print!("{}", stats::render_probes(&report));
    let _ = std::io::stdout().flush();
    if let Some(path) = &args.json {
        let written = serde_json::to_vec_pretty(&report)
            .map_err(|e| e.to_string())
            .and_then(|bytes| std::fs::write(path, bytes).map_err(|e| e.to_string()));
        if let Err(err) = written {
            eprintln!("pd-load: cannot write {}: {err}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if args.fail_on_error && report.summary.errors > 0 {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// `--target`: one run dealt over several routers, one report file each.
fn interleaved(args: &LoadArgs, cfg: LoadConfig) -> ExitCode {
    let Some(dir) = &args.json_dir else {
        eprintln!("pd-load: --target needs --json-dir");
        return ExitCode::from(2);
    };
    let seed = cfg.seed;
    let reports = match runtime().and_then(|rt| rt.block_on(interleave::run(cfg, &args.targets))) {
        Ok(r) => r,
        Err(err) => {
            eprintln!("pd-load: {err}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!("pd-load: cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    let mut failed = false;
    for (name, report) in &reports {
        print!("[{name}] {}", stats::render(&report.summary));
        let path = dir.join(format!("{name}.{seed}.json"));
        let written = serde_json::to_vec_pretty(report)
            .map_err(|e| e.to_string())
            .and_then(|bytes| std::fs::write(&path, bytes).map_err(|e| e.to_string()));
        if let Err(err) = written {
            eprintln!("pd-load: cannot write {}: {err}", path.display());
            return ExitCode::FAILURE;
        }
        failed |= report.summary.errors > 0;
    }
    let _ = std::io::stdout().flush();
    if args.fail_on_error && failed {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("20s"), Ok(Duration::from_secs(20)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("abc").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn ranges_and_headers() {
        assert_eq!(parse_range("64..2048"), Ok((64, 2048)));
        assert_eq!(parse_range("100"), Ok((100, 100)));
        assert_eq!(parse_range("5-9"), Ok((5, 9)));
        assert!(parse_range("9..5").is_err());
        assert!(parse_range("x").is_err());
        assert_eq!(parse_header("x-a: b:c"), Ok(("x-a".into(), "b:c".into())));
        assert!(parse_header("nocolon").is_err());
    }

    #[test]
    fn load_args_validate() {
        let args = LoadArgs::parse_from([
            "pd-load",
            "--url",
            "http://127.0.0.1:1",
            "--model",
            "m",
            "--once",
        ]);
        let cfg = args.config().unwrap();
        assert_eq!((cfg.rps, cfg.requests, cfg.clients), (0.0, Some(1), 1));
        let args = LoadArgs::parse_from(["pd-load", "--url", "http://10.1.2.3:1", "--model", "m"]);
        assert!(args.config().is_err(), "non-loopback refused by default");
        let args = LoadArgs::parse_from([
            "pd-load",
            "--url",
            "http://127.0.0.1:1",
            "--model",
            "m",
            "--stream-ratio",
            "2",
        ]);
        assert!(args.config().is_err());
        let args = LoadArgs::parse_from([
            "pd-load",
            "--url",
            "http://127.0.0.1:1",
            "--model",
            "m",
            "--include-usage",
            "false",
            "--header",
            "a:b",
            "--header",
            "c:d",
            "--prompt-tokens",
            "10",
        ]);
        let cfg = args.config().unwrap();
        assert!(!cfg.include_usage);
        assert_eq!(cfg.headers.len(), 2);
        assert_eq!(cfg.prompt_tokens, (10, 10));
    }

    #[test]
    fn sim_args_defaults_are_small() {
        let args = SimArgs::parse_from(["pd-sim", "--fleet", "f.yaml"]);
        let cfg = args.config();
        assert_eq!(cfg.timing, TimingModel::default());
        assert_eq!(
            (cfg.default_max_tokens, cfg.kv_capacity_tokens),
            (16, 100_000)
        );
    }
}
