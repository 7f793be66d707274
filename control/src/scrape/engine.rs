//! Engine metric names and the exposition text → [`Reading`] mapping.
//!
//! A [`Reading`] is what one scrape says, raw: gauges as seen, counters and histogram sums as
//! cumulative totals. Turning two readings into rates is [`super::rates`]' job, so this half stays
//! a pure function of the text.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::LazyLock;

// Every line of every pod's exposition is looked up by name: hashbrown's default hasher, not
// std's SipHash (which took ≈ 6 % of pd-control's CPU for these lookups alone).
use hashbrown::{HashMap, HashSet};

use super::exposition::Sample;

/// Label carrying the served model on every engine's model-scoped metrics.
const LABEL_MODEL_NAME: &str = "model_name";
/// Labels that tell data-parallel replicas apart inside one pod: vLLM's engine-core index and
/// SGLang's DP-attention rank. Series that differ only in other labels (TP/PP rank, TRT-LLM's
/// multiprocess `pid`) repeat the same scheduler's value and must not be added up.
const REPLICA_LABELS: [&str; 2] = ["engine", "dp_rank"];
/// TRT-LLM builds that cannot name their model export this instead.
const UNDEFINED_MODEL: &str = "undefined";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Vllm,
    Sglang,
    Trtllm,
}

impl Engine {
    /// Unknown engines get the vLLM handling, as in AIBrix's default handler.
    pub fn from_label(engine: &str) -> Engine {
        match engine {
            "sglang" => Engine::Sglang,
            "trtllm" => Engine::Trtllm,
            _ => Engine::Vllm,
        }
    }

    /// TRT-LLM serves JSON iteration stats on `/metrics`; its Prometheus text lives elsewhere.
    pub fn metrics_path(self) -> &'static str {
        match self {
            Engine::Trtllm => "/prometheus/metrics",
            Engine::Vllm | Engine::Sglang => "/metrics",
        }
    }

    /// Whether the engine adds to its token and request counters only when a request
    /// finishes (SGLang's tokenizer counters, TRT-LLM's per-request metrics), not at every
    /// step as vLLM does: a healthy pod generating long answers moves none of them for as
    /// long as no request ends, so its scheduler gauges are the witness of its work (SGLang
    /// refreshes them every few dozen steps; TRT-LLM's come too late, see `stall_floor`).
    pub fn counts_at_finish(self) -> bool {
        matches!(self, Engine::Sglang | Engine::Trtllm)
    }

    /// The shortest time a pod of this engine may show running requests and no progress
    /// before it counts as stalled, whatever `--stalled-after` says; `None`: never, by this
    /// rule (a wedged server, whose scrapes time out, is still marked). SGLang refreshes its
    /// gauges only while it works, and when idle once 30 s after the last refresh: a pod whose
    /// last requests just finished shows their running count, unmoving, until then.
    /// trtllm-serve refreshes its iteration gauges (running, KV usage) only when a request
    /// ends, and its counters move only then too: a pod generating one long answer, or idle
    /// after a burst with its last running count frozen, looks exactly like a wedged one.
    pub fn stall_floor(self) -> Option<std::time::Duration> {
        match self {
            Engine::Vllm => Some(std::time::Duration::ZERO),
            Engine::Sglang => Some(std::time::Duration::from_secs(35)),
            Engine::Trtllm => None,
        }
    }

    /// The engine option without which it answers 404 on [`Engine::metrics_path`]; vLLM
    /// always serves its page.
    pub fn metrics_switch(self) -> Option<&'static str> {
        match self {
            Engine::Vllm => None,
            Engine::Sglang => {
                Some("SGLang serves /metrics only when started with --enable-metrics")
            }
            Engine::Trtllm => Some(
                "TensorRT-LLM serves /prometheus/metrics only with `return_perf_metrics: true` \
                 in its LLM API options (the YAML file trtllm-serve reads them from)",
            ),
        }
    }

    fn names(self) -> &'static Names {
        match self {
            Engine::Vllm => &VLLM_NAMES,
            Engine::Sglang => &SGLANG_NAMES,
            Engine::Trtllm => &TRTLLM_NAMES,
        }
    }

    /// Whether this engine's own generation-throughput gauge beats the counter-derived rate.
    pub(crate) fn generation_prefers_gauge(self) -> bool {
        self.names().generation_prefers_gauge
    }
}

/// Exposition names per normalised metric. Each list is in preference order: the first family
/// with at least one sample for the pod's model wins, which is how a renamed metric (vLLM's
/// `gpu_cache_usage_perc` → `kv_cache_usage_perc`) keeps working across engine versions.
struct Names {
    running: &'static [&'static str],
    waiting: &'static [&'static str],
    /// Further queues whose requests also wait, each added to `waiting`: SGLang's PD
    /// prealloc queues (requests waiting for KV memory), which AIBrix's queue score counts.
    queued: &'static [&'static str],
    kv_cache_usage: &'static [&'static str],
    generation_gauge: &'static [&'static str],
    prompt_gauge: &'static [&'static str],
    prompt_tokens: &'static [&'static str],
    generation_tokens: &'static [&'static str],
    completed: &'static [&'static str],
    /// Histogram base names (without `_sum` / `_count`).
    ttft: &'static [&'static str],
    tpot: &'static [&'static str],
    generation_prefers_gauge: bool,
    /// The engine's utilization gauge (0..1) for `least-utilization`.
    utilization: &'static [&'static str],
    /// A GPU busy-time ratio (0..1) for `least-busy-time`.
    busy_time: &'static [&'static str],
}

/// xLLM's name for its utilization gauge, the one AIBrix's `least-utilization` reads. None of
/// the three engines exports it today; read from every engine so a build or a sidecar that
/// adds it is used, and a pod without it stays unscored (AIBrix's rule).
const UTILIZATION: &[&str] = &["engine_utilization"];

/// AIBrix's name for the GPU busy-time ratio `least-busy-time` reads; AIBrix maps it to no
/// engine metric, so only an exporter that adds it under this name feeds the strategy.
const BUSY_TIME: &[&str] = &["gpu_busy_time_ratio"];

static VLLM_NAMES: Names = Names {
    running: &["vllm:num_requests_running"],
    waiting: &["vllm:num_requests_waiting"],
    queued: &[],
    kv_cache_usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    // V0-only gauges, used when the V1 token counters are absent.
    generation_gauge: &["vllm:avg_generation_throughput_toks_per_s"],
    prompt_gauge: &["vllm:avg_prompt_throughput_toks_per_s"],
    prompt_tokens: &["vllm:prompt_tokens_total"],
    generation_tokens: &["vllm:generation_tokens_total"],
    completed: &["vllm:request_success_total"],
    ttft: &["vllm:time_to_first_token_seconds"],
    tpot: &[
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ],
    generation_prefers_gauge: false,
    utilization: UTILIZATION,
    busy_time: BUSY_TIME,
};

static SGLANG_NAMES: Names = Names {
    running: &["sglang:num_running_reqs"],
    waiting: &["sglang:num_queue_reqs"],
    queued: &[
        "sglang:num_prefill_prealloc_queue_reqs",
        "sglang:num_decode_prealloc_queue_reqs",
    ],
    kv_cache_usage: &["sglang:token_usage"],
    generation_gauge: &["sglang:gen_throughput"],
    prompt_gauge: &[],
    prompt_tokens: &["sglang:prompt_tokens_total"],
    generation_tokens: &["sglang:generation_tokens_total"],
    completed: &["sglang:num_requests_total"],
    ttft: &["sglang:time_to_first_token_seconds"],
    tpot: &[
        "sglang:inter_token_latency_seconds",
        "sglang:time_per_output_token_seconds",
    ],
    // SGLang computes it over its own logging window, smoother than a 50 ms counter delta.
    generation_prefers_gauge: true,
    utilization: UTILIZATION,
    busy_time: BUSY_TIME,
};

static TRTLLM_NAMES: Names = Names {
    // Only recent builds export these; 1.0/1.1 leave running/waiting at zero.
    running: &["trtllm_num_requests_running"],
    waiting: &["trtllm_num_requests_waiting"],
    queued: &[],
    kv_cache_usage: &["trtllm_kv_cache_utilization"],
    generation_gauge: &[],
    prompt_gauge: &[],
    prompt_tokens: &["trtllm_prompt_tokens_total"],
    generation_tokens: &["trtllm_generation_tokens_total"],
    completed: &[
        "trtllm_request_success_total",
        "trtllm_num_requests_completed_total",
    ],
    ttft: &["trtllm_time_to_first_token_seconds"],
    tpot: &["trtllm_time_per_output_token_seconds"],
    generation_prefers_gauge: false,
    utilization: UTILIZATION,
    busy_time: BUSY_TIME,
};

impl Names {
    fn scalar_lists(&self) -> [&'static [&'static str]; 11] {
        [
            self.utilization,
            self.busy_time,
            self.running,
            self.waiting,
            self.queued,
            self.kv_cache_usage,
            self.generation_gauge,
            self.prompt_gauge,
            self.prompt_tokens,
            self.generation_tokens,
            self.completed,
        ]
    }

    /// Every sample name this engine's mapping reads: the scalar families and the `_sum` and
    /// `_count` of each histogram.
    fn sample_names(&self) -> HashSet<String> {
        let scalars = self.scalar_lists().into_iter().flatten();
        let histograms = self.ttft.iter().chain(self.tpot);
        scalars
            .map(|name| name.to_string())
            .chain(histograms.flat_map(|base| [format!("{base}_sum"), format!("{base}_count")]))
            .collect()
    }
}

/// [`Names::sample_names`] of each engine, built once: the scrape loop asks for every line of
/// every pod's exposition.
static WANTED: LazyLock<[HashSet<String>; 3]> = LazyLock::new(|| {
    [
        VLLM_NAMES.sample_names(),
        SGLANG_NAMES.sample_names(),
        TRTLLM_NAMES.sample_names(),
    ]
});

impl Engine {
    fn wanted(self) -> &'static HashSet<String> {
        let i = match self {
            Engine::Vllm => 0,
            Engine::Sglang => 1,
            Engine::Trtllm => 2,
        };
        &WANTED[i]
    }
}

/// Cumulative `_sum` and `_count` of a histogram.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Histo {
    pub sum: f64,
    pub count: f64,
}

/// One scrape's raw values for one pod and model. `None` means the engine does not export it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reading {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    pub kv_cache_usage: Option<f64>,
    pub generation_gauge: Option<f64>,
    pub prompt_gauge: Option<f64>,
    pub prompt_tokens: Option<f64>,
    pub generation_tokens: Option<f64>,
    pub completed: Option<f64>,
    pub ttft: Option<Histo>,
    pub tpot: Option<Histo>,
    pub utilization: Option<f64>,
    pub busy_time: Option<f64>,
}

/// Extracts the sample name of an exposition line, or `None` for comments and blank lines.
fn sample_name(line: &[u8]) -> Option<&[u8]> {
    let start = line.iter().position(|b| !b.is_ascii_whitespace())?;
    let line = &line[start..];
    if line[0] == b'#' {
        return None;
    }
    let end = line
        .iter()
        .position(|&b| b == b'{' || b.is_ascii_whitespace())
        .unwrap_or(line.len());
    Some(&line[..end])
}

/// Parses an engine's `/metrics` body into the readings for `model`. A line it cannot read
/// counts as absent, so a body that is not an exposition at all is an empty reading.
///
/// Only lines the mapping reads are parsed: vLLM exposes over a thousand lines, mostly
/// histogram buckets, and pd-control scrapes every pod every 50 ms. The body is filtered as
/// bytes and only the kept lines are checked as UTF-8, so a scrape never copies or validates
/// the whole exposition; a kept line that is not UTF-8 is dropped like any line that is not a
/// sample. The kept lines are read in place ([`Sample`]), nothing copied.
pub fn parse_reading(body: impl AsRef<[u8]>, engine: Engine, model: &str) -> Reading {
    let names = engine.names();
    let wanted = engine.wanted();
    let mut families: HashMap<&str, Vec<Sample<'_>>> = HashMap::new();
    let body = body.as_ref();
    let mut start = 0;
    // memchr finds line ends a word at a time; HELP lines are long and most lines are skipped.
    for end in memchr::memchr_iter(b'\n', body).chain(std::iter::once(body.len())) {
        let line = &body[start..end];
        start = end + 1;
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(name) = sample_name(line).and_then(|n| std::str::from_utf8(n).ok()) else {
            continue;
        };
        if !wanted.contains(name) {
            continue;
        }
        let Some(sample) = std::str::from_utf8(line).ok().and_then(Sample::parse) else {
            continue;
        };
        if sample.value.is_finite() {
            families.entry(sample.name).or_default().push(sample);
        }
    }

    // A model_name that never matches the pod's label is the engine naming the same model
    // differently (TRT-LLM uses the checkpoint directory's basename, vLLM the served name), not a
    // second model: the load is still this pod's, so keep it rather than report an idle pod.
    let strict = families
        .values()
        .flatten()
        .any(|s| s.label(LABEL_MODEL_NAME).as_deref() == Some(model));
    for series in families.values_mut() {
        series.retain(|s| match s.label(LABEL_MODEL_NAME).as_deref() {
            None => true,
            Some(name) => !strict || name == model || name == UNDEFINED_MODEL,
        });
    }
    families.retain(|_, series| !series.is_empty());

    let first = |list: &[&str]| list.iter().find_map(|name| families.get(*name));
    let histo = |bases: &[&str]| {
        bases.iter().find_map(|base| {
            let sum = families.get(format!("{base}_sum").as_str())?;
            let count = families.get(format!("{base}_count").as_str())?;
            Some(Histo {
                sum: total(sum),
                count: total(count),
            })
        })
    };
    Reading {
        running: first(names.running).map(|s| gauge(s, Combine::Sum)),
        waiting: names
            .queued
            .iter()
            .filter_map(|name| families.get(*name))
            .map(|s| gauge(s, Combine::Sum))
            .fold(
                first(names.waiting).map(|s| gauge(s, Combine::Sum)),
                |sum, q| Some(sum.unwrap_or(0.0) + q),
            ),
        kv_cache_usage: first(names.kv_cache_usage).map(|s| gauge(s, Combine::Mean)),
        generation_gauge: first(names.generation_gauge).map(|s| gauge(s, Combine::Sum)),
        prompt_gauge: first(names.prompt_gauge).map(|s| gauge(s, Combine::Sum)),
        prompt_tokens: first(names.prompt_tokens).map(|s| total(s)),
        generation_tokens: first(names.generation_tokens).map(|s| total(s)),
        completed: first(names.completed).map(|s| total(s)),
        ttft: histo(names.ttft),
        tpot: histo(names.tpot),
        utilization: first(names.utilization).map(|s| gauge(s, Combine::Mean)),
        busy_time: first(names.busy_time).map(|s| gauge(s, Combine::Mean)),
    }
}

/// Why a successful `/metrics` answer is not the pod's engine speaking.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Foreign {
    #[error("the answer carries {found:?}'s load metrics, not {expected:?}'s: is the pod's model.aibrix.ai/engine label right?")]
    OtherEngine { expected: Engine, found: Engine },
    #[error("the answer is not a Prometheus exposition (HTML or JSON): is something other than the engine answering on the metric port?")]
    NotExposition,
}

impl Reading {
    /// Whether the reading holds any of the gauges the routing scores read.
    fn has_load(&self) -> bool {
        self.running.is_some()
            || self.waiting.is_some()
            || self.kv_cache_usage.is_some()
            || self.utilization.is_some()
            || self.busy_time.is_some()
    }
}

/// Checks that a reading with no load gauges at all is an idle engine's and not someone
/// else's answer. Taken as is, such a reading published the pod as fresh and idle (nothing
/// running, free KV): an SGLang pod without its engine label read with vLLM's names, or an
/// auth proxy's login page, won every request under the load-scoring policies, with nothing
/// logged and nothing stale. An exposition without any of the engine's gauges is accepted:
/// an idle engine may not have them yet (SGLang's labelled gauges have no sample before its
/// first statistics; TRT-LLM 1.0/1.1 exports its KV gauge once iteration statistics exist;
/// vLLM with `--disable-log-stats` exports none), and an exporter on the metric port cannot
/// be told from them.
pub fn check_engine(body: &[u8], engine: Engine, reading: &Reading) -> Result<(), Foreign> {
    if reading.has_load() {
        return Ok(());
    }
    let mentions = |other: Engine| {
        let names = other.names();
        names
            .running
            .iter()
            .chain(names.waiting)
            .chain(names.kv_cache_usage)
            .any(|name| memchr::memmem::find(body, name.as_bytes()).is_some())
    };
    if let Some(found) = [Engine::Vllm, Engine::Sglang, Engine::Trtllm]
        .into_iter()
        .find(|&other| other != engine && mentions(other))
    {
        return Err(Foreign::OtherEngine {
            expected: engine,
            found,
        });
    }
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if matches!(first, Some(b'<' | b'{' | b'[')) {
        return Err(Foreign::NotExposition);
    }
    Ok(())
}

/// Counters and histogram parts: every label set (finished reason, DP engine…) adds up.
fn total(series: &[Sample<'_>]) -> f64 {
    series.iter().map(|s| s.value).sum()
}

#[derive(Clone, Copy)]
enum Combine {
    /// Queue lengths and throughputs of DP replicas add up.
    Sum,
    /// A usage fraction does not: two replicas at 50% are a pod at 50%.
    Mean,
}

/// Combines a gauge across DP replicas (see [`REPLICA_LABELS`]). Within one replica the series
/// repeat one scheduler's value, so the largest is taken rather than a sum.
fn gauge(series: &[Sample<'_>], combine: Combine) -> f64 {
    let mut replicas: BTreeMap<[Option<Cow<'_, str>>; 2], f64> = BTreeMap::new();
    for s in series {
        let key = REPLICA_LABELS.map(|l| s.label(l));
        let slot = replicas.entry(key).or_insert(s.value);
        *slot = slot.max(s.value);
    }
    let sum: f64 = replicas.values().sum();
    match combine {
        Combine::Sum => sum,
        Combine::Mean if replicas.is_empty() => 0.0,
        Combine::Mean => sum / replicas.len() as f64,
    }
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! Exposition text shaped like each engine's real output (label order, `_created` families,
    //! multiprocess `_sum`-first histograms, TRT-LLM's `pid` label), trimmed to the families the
    //! mapping reads plus some it must ignore.

    pub const VLLM_V1: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0834
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 61440.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 61440.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7350000012e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 15360.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 52.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 41.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 60.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 60.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 6.0
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 15300.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 15300.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 306.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="28672"} 1.0
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 60.0
"#;

    /// vLLM 0.8-era output: no `kv_cache_usage_perc`, the deprecated per-token latency name,
    /// and two data-parallel engine cores.
    pub const VLLM_OLD_DP2: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.6
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 3000.0
# HELP vllm:time_per_output_token_seconds Histogram of time per output token in seconds.
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_sum{engine="0",model_name="m"} 2.0
vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 100.0
vllm:time_per_output_token_seconds_count{engine="0",model_name="m"} 100.0
vllm:time_per_output_token_seconds_sum{engine="1",model_name="m"} 6.0
vllm:time_per_output_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 100.0
vllm:time_per_output_token_seconds_count{engine="1",model_name="m"} 100.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="other-model"} 9.0
"#;

    pub const SGLANG_DECODE: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 87.0
sglang:num_running_reqs{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 87.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.41
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2931.5
# HELP sglang:num_decode_prealloc_queue_reqs The number of requests in the decode prealloc queue.
# TYPE sglang:num_decode_prealloc_queue_reqs gauge
sglang:num_decode_prealloc_queue_reqs{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.0
# HELP sglang:num_requests_total Number of requests processed.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3"} 10452.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3"} 1.07e+07
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3"} 2508.0
sglang:time_to_first_token_seconds_bucket{engine_type="decode",le="0.1",model_name="deepseek-ai/DeepSeek-V3"} 1203.0
sglang:time_to_first_token_seconds_bucket{engine_type="decode",le="+Inf",model_name="deepseek-ai/DeepSeek-V3"} 10450.0
sglang:time_to_first_token_seconds_count{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3"} 10450.0
# HELP sglang:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_sum{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3"} 400.0
sglang:inter_token_latency_seconds_bucket{engine_type="decode",le="+Inf",model_name="deepseek-ai/DeepSeek-V3"} 20000.0
sglang:inter_token_latency_seconds_count{engine_type="decode",model_name="deepseek-ai/DeepSeek-V3"} 20000.0
"#;

    /// TRT-LLM 1.x, served-model name = checkpoint basename, gauges carrying `pid`.
    pub const TRTLLM: &str = r#"# HELP trtllm_request_success_total Count of successfully processed requests.
# TYPE trtllm_request_success_total counter
trtllm_request_success_total{engine_type="pytorch",finished_reason="stop",model_name="Qwen3-8B"} 120.0
trtllm_request_success_total{engine_type="pytorch",finished_reason="length",model_name="Qwen3-8B"} 30.0
# HELP trtllm_time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE trtllm_time_to_first_token_seconds histogram
trtllm_time_to_first_token_seconds_sum{engine_type="pytorch",model_name="Qwen3-8B"} 15.0
trtllm_time_to_first_token_seconds_bucket{engine_type="pytorch",le="0.001",model_name="Qwen3-8B"} 0.0
trtllm_time_to_first_token_seconds_bucket{engine_type="pytorch",le="+Inf",model_name="Qwen3-8B"} 150.0
trtllm_time_to_first_token_seconds_count{engine_type="pytorch",model_name="Qwen3-8B"} 150.0
# HELP trtllm_time_per_output_token_seconds Histogram of time per output token in seconds.
# TYPE trtllm_time_per_output_token_seconds histogram
trtllm_time_per_output_token_seconds_sum{engine_type="pytorch",model_name="Qwen3-8B"} 3.0
trtllm_time_per_output_token_seconds_bucket{engine_type="pytorch",le="+Inf",model_name="Qwen3-8B"} 200.0
trtllm_time_per_output_token_seconds_count{engine_type="pytorch",model_name="Qwen3-8B"} 200.0
# HELP trtllm_kv_cache_utilization KV cache utilization
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{engine_type="pytorch",model_name="Qwen3-8B",pid="4121"} 0.23
# HELP trtllm_kv_cache_hit_rate KV cache hit rate
# TYPE trtllm_kv_cache_hit_rate gauge
trtllm_kv_cache_hit_rate{engine_type="pytorch",model_name="Qwen3-8B",pid="4121"} 0.61
# HELP trtllm_num_requests_running Number of running requests
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{engine_type="pytorch",model_name="Qwen3-8B",pid="4121"} 6.0
# HELP trtllm_num_requests_waiting Number of waiting requests
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{engine_type="pytorch",model_name="Qwen3-8B",pid="4121"} 2.0
"#;
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-9)
    }

    #[test]
    fn vllm_v1_prefers_kv_cache_usage_perc_and_sums_counters_over_reasons() {
        let r = parse_reading(VLLM_V1, Engine::Vllm, "meta-llama/Llama-3.1-8B-Instruct");
        assert_eq!((r.running, r.waiting), (Some(4.0), Some(1.0)));
        assert!(
            close(r.kv_cache_usage, 0.0834),
            "new name wins over the deprecated one: {r:?}"
        );
        assert_eq!(
            (r.prompt_tokens, r.generation_tokens),
            (Some(61440.0), Some(15360.0))
        );
        assert_eq!(r.completed, Some(60.0), "stop + length + abort");
        assert_eq!(
            r.ttft,
            Some(Histo {
                sum: 6.0,
                count: 60.0
            })
        );
        assert_eq!(
            r.tpot,
            Some(Histo {
                sum: 306.0,
                count: 15300.0
            })
        );
        assert_eq!((r.generation_gauge, r.prompt_gauge), (None, None));
    }

    #[test]
    fn vllm_old_falls_back_to_gpu_cache_usage_and_sums_dp_engines() {
        let r = parse_reading(VLLM_OLD_DP2, Engine::Vllm, "m");
        assert_eq!(
            r.running,
            Some(8.0),
            "engines 0 and 1 add up; other-model is ignored"
        );
        assert_eq!(r.waiting, Some(2.0));
        assert!(
            close(r.kv_cache_usage, 0.4),
            "usage is averaged over DP engines: {r:?}"
        );
        assert_eq!(r.prompt_tokens, Some(4000.0));
        assert_eq!(r.generation_tokens, None);
        assert_eq!(
            r.tpot,
            Some(Histo {
                sum: 8.0,
                count: 200.0
            }),
            "deprecated TPOT name"
        );
        assert_eq!(r.ttft, None);
    }

    #[test]
    fn model_filter_applies_only_when_the_pods_model_is_present() {
        let other = parse_reading(VLLM_OLD_DP2, Engine::Vllm, "other-model");
        assert_eq!(other.running, Some(9.0));
        assert_eq!(other.waiting, None, "m's series are not other-model's");
        // No series names the pod's model at all: the engine calls it something else.
        let renamed = parse_reading(VLLM_V1, Engine::Vllm, "llama-8b");
        assert_eq!(renamed.running, Some(4.0));
    }

    #[test]
    fn sglang_maps_its_names_and_does_not_add_tp_ranks() {
        let r = parse_reading(SGLANG_DECODE, Engine::Sglang, "deepseek-ai/DeepSeek-V3");
        assert_eq!(
            r.running,
            Some(87.0),
            "tp_rank 0 and 1 report the same batch"
        );
        assert_eq!(
            r.waiting,
            Some(5.0),
            "2 in the queue + 3 in the decode prealloc queue (AIBrix's queue score)"
        );
        assert!(close(r.kv_cache_usage, 0.41));
        assert_eq!(r.generation_gauge, Some(2931.5));
        assert_eq!(r.prompt_tokens, Some(1.07e7));
        assert_eq!(r.completed, Some(10452.0));
        assert_eq!(
            r.ttft,
            Some(Histo {
                sum: 2508.0,
                count: 10450.0
            })
        );
        assert_eq!(
            r.tpot,
            Some(Histo {
                sum: 400.0,
                count: 20000.0
            })
        );
        let as_vllm = parse_reading(SGLANG_DECODE, Engine::Vllm, "deepseek-ai/DeepSeek-V3");
        assert_eq!(
            as_vllm,
            Reading::default(),
            "the engine label picks the names"
        );
    }

    #[test]
    fn trtllm_maps_its_names_despite_basename_model_and_pid_label() {
        let r = parse_reading(TRTLLM, Engine::Trtllm, "Qwen/Qwen3-8B");
        assert!(close(r.kv_cache_usage, 0.23));
        assert_eq!((r.running, r.waiting), (Some(6.0), Some(2.0)));
        assert_eq!(r.completed, Some(150.0));
        assert_eq!(
            r.ttft,
            Some(Histo {
                sum: 15.0,
                count: 150.0
            })
        );
        assert_eq!(
            r.tpot,
            Some(Histo {
                sum: 3.0,
                count: 200.0
            })
        );
        assert_eq!(Engine::Trtllm.metrics_path(), "/prometheus/metrics");
        assert_eq!(Engine::from_label("vllm").metrics_path(), "/metrics");
    }

    #[test]
    fn garbage_yields_an_empty_reading_not_a_panic() {
        let r = parse_reading(
            "<html>nope</html>\n{}\nvllm:num_requests_running{ 1\n",
            Engine::Vllm,
            "m",
        );
        assert_eq!(r, Reading::default());
        let nan = "vllm:num_requests_running{model_name=\"m\"} NaN\nvllm:num_requests_waiting 2\n";
        let r = parse_reading(nan, Engine::Vllm, "m");
        assert_eq!((r.running, r.waiting), (None, Some(2.0)));
    }

    #[test]
    fn an_answer_without_the_engines_load_gauges_is_told_from_an_idle_engine() {
        let check = |body: &str, engine| {
            check_engine(body.as_bytes(), engine, &parse_reading(body, engine, "m"))
        };
        for (fixture, engine) in [(VLLM_V1, Engine::Vllm), (TRTLLM, Engine::Trtllm)] {
            assert_eq!(check(fixture, engine), Ok(()), "{engine:?}");
        }
        let sglang = "sglang:num_running_reqs{model_name=\"m\"} 0\nsglang:token_usage{model_name=\"m\"} 0.1\n";
        assert_eq!(check(sglang, Engine::Sglang), Ok(()));
        assert_eq!(
            check(sglang, Engine::Vllm),
            Err(Foreign::OtherEngine {
                expected: Engine::Vllm,
                found: Engine::Sglang
            }),
            "an SGLang pod without its engine label"
        );
        // An engine without its gauges yet, or an exporter: an exposition, taken as idle.
        let exporter =
            "# TYPE node_cpu_seconds_total counter\nnode_cpu_seconds_total{cpu=\"0\"} 5\n";
        assert_eq!(check(exporter, Engine::Vllm), Ok(()));
        assert_eq!(check("", Engine::Sglang), Ok(()));
        // A pod exporting only a utilization gauge (least-utilization's) is read.
        assert_eq!(check("engine_utilization 0.4\n", Engine::Vllm), Ok(()));
        for page in [
            "<!doctype html><p>sign in</p>",
            "  {\"detail\":\"Not Found\"}",
        ] {
            assert_eq!(
                check(page, Engine::Trtllm),
                Err(Foreign::NotExposition),
                "{page}"
            );
        }
        // An idle TRT-LLM 1.0 pod: histograms registered, no iteration statistics yet.
        let idle_trt =
            "# HELP trtllm_request_success_total x\n# TYPE trtllm_request_success_total counter\n";
        assert_eq!(check(idle_trt, Engine::Trtllm), Ok(()));
        assert_eq!(check("", Engine::Trtllm), Ok(()));
    }

    #[test]
    fn utilization_gauges_are_read_from_any_engine_and_absent_when_not_exported() {
        let body = "# TYPE engine_utilization gauge\n\
                    engine_utilization{model_name=\"m\"} 0.25\n\
                    engine_utilization{model_name=\"m\",engine=\"1\"} 0.75\n\
                    gpu_busy_time_ratio 0.4\n\
                    sglang:num_running_reqs{model_name=\"m\"} 2\n";
        let r = parse_reading(body, Engine::Sglang, "m");
        assert_eq!(
            (r.utilization, r.busy_time, r.running),
            (Some(0.5), Some(0.4), Some(2.0)),
            "DP ranks average, as a usage fraction does"
        );
        for (fixture, engine) in [(VLLM_V1, Engine::Vllm), (TRTLLM, Engine::Trtllm)] {
            let r = parse_reading(fixture, engine, "Qwen3-8B");
            assert_eq!((r.utilization, r.busy_time), (None, None), "{engine:?}");
        }
    }

    #[test]
    fn bytes_that_are_not_utf8_cost_only_their_own_line() {
        let mut body = b"# HELP vllm:num_requests_running caf\xe9 \xff\r\n".to_vec();
        body.extend_from_slice(b"vllm:num_requests_running{model_name=\"m\"} 3\r\n");
        body.extend_from_slice(b"vllm:num_requests_waiting{model_name=\"m\",x=\"\xe9\"} 9\n");
        body.extend_from_slice(b"  vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5");
        let r = parse_reading(&body, Engine::Vllm, "m");
        assert_eq!(
            (r.running, r.waiting, r.kv_cache_usage),
            (Some(3.0), None, Some(0.5)),
            "CRLF ends a line, a kept line that is not UTF-8 is dropped, indentation is allowed"
        );
    }
}
