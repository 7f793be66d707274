//! Prometheus text exposition with each engine's metric names, labels and number formatting, so
//! a scraper written against real pods (pd-control) parses the simulator unchanged: vLLM
//! ([`render`]), SGLang ([`render_sglang`]) and TensorRT-LLM ([`render_trtllm`] on
//! `/prometheus/metrics`, [`render_trtllm_iteration_stats`] as the JSON on `/metrics`).
//!
//! Format details copied from prometheus_client as vLLM uses it: labels sorted by name,
//! every value a float (`4.0`), counters declared under their `_total` name, histogram
//! buckets cumulative with `le` last-but-sorted, `_created` series omitted (as in vLLM's
//! multiprocess mode).

use std::fmt::Write as _;

pub use pd_control::scrape::engine::Engine;
use serde_json::{json, Value};

/// `vllm:time_to_first_token_seconds` bucket upper bounds.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Bucket bounds of vLLM's request-level latency histograms (e2e, prefill time, ...).
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// Bucket bounds of `vllm:time_per_output_token_seconds` / `vllm:inter_token_latency_seconds`.
pub const TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// SGLang's `sglang:time_to_first_token_seconds` bucket upper bounds.
pub const SGLANG_TTFT_BUCKETS: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0,
];
/// SGLang's `sglang:inter_token_latency_seconds` bucket upper bounds.
pub const SGLANG_TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2,
    0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
];
/// SGLang's `sglang:e2e_request_latency_seconds` bucket upper bounds.
pub const SGLANG_REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0, 600.0, 1200.0, 1800.0, 2400.0,
];

/// A Prometheus histogram: per-bucket counts (not cumulative), sum and count.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    /// One slot per bound plus the `+Inf` overflow slot.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, value: f64) {
        let slot = self
            .bounds
            .iter()
            .position(|b| value <= *b)
            .unwrap_or(self.bounds.len());
        if let Some(c) = self.counts.get_mut(slot) {
            *c += 1;
        }
        self.sum += value;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }
}

/// Everything a pod's `/metrics` shows, captured at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsSnapshot {
    pub running: u64,
    pub waiting: u64,
    /// 0..1.
    pub kv_usage: f64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Prompt and generated tokens of the requests that ended: SGLang's and TRT-LLM's token
    /// counters grow when a request finishes, not at every step as vLLM's do.
    pub finished_prompt_tokens: u64,
    pub finished_generation_tokens: u64,
    pub success_stop: u64,
    pub success_length: u64,
    pub success_abort: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub num_gpu_blocks: u64,
    pub block_size: u64,
    pub prefix_caching: bool,
    /// KV tokens held (running requests plus pinned prefill results) and the pool size.
    pub kv_used_tokens: u64,
    pub kv_capacity_tokens: u64,
    /// Generated tokens per second over the last throughput window (SGLang's `gen_throughput`).
    pub gen_throughput: f64,
    /// Prefill results computed and waiting for a decode pod to pull them.
    pub prefill_inflight: u64,
    /// SGLang prefill legs waiting for their decode leg to register in the bootstrap room,
    /// before they compute (part of `waiting`).
    pub prefill_prealloc: u64,
    /// Decode legs waiting for a batch slot before their KV transfer (part of `waiting`).
    pub decode_prealloc: u64,
    /// Decode legs waiting for their KV: an SGLang leg from its registration in the room
    /// (its prefill may not even have computed) until it has pulled; other engines' legs
    /// while pulling (part of `waiting`).
    pub kv_transfer: u64,
    pub ttft: Histogram,
    pub e2e: Histogram,
    pub prefill_time: Histogram,
    pub inter_token: Histogram,
}

impl MetricsSnapshot {
    /// A snapshot with vLLM's histogram buckets.
    pub fn new() -> Self {
        Self::for_engine(Engine::Vllm)
    }

    /// A snapshot whose histograms use `engine`'s bucket bounds (TRT-LLM copies vLLM's).
    pub fn for_engine(engine: Engine) -> Self {
        let (ttft, e2e, inter_token) = match engine {
            Engine::Sglang => (
                SGLANG_TTFT_BUCKETS,
                SGLANG_REQUEST_LATENCY_BUCKETS,
                SGLANG_TOKEN_LATENCY_BUCKETS,
            ),
            Engine::Vllm | Engine::Trtllm => {
                (TTFT_BUCKETS, REQUEST_LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS)
            }
        };
        MetricsSnapshot {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            prompt_tokens: 0,
            generation_tokens: 0,
            finished_prompt_tokens: 0,
            finished_generation_tokens: 0,
            success_stop: 0,
            success_length: 0,
            success_abort: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            num_gpu_blocks: 0,
            block_size: crate::engine::BLOCK_SIZE_TOKENS,
            prefix_caching: true,
            kv_used_tokens: 0,
            kv_capacity_tokens: 0,
            gen_throughput: 0.0,
            prefill_inflight: 0,
            prefill_prealloc: 0,
            decode_prealloc: 0,
            kv_transfer: 0,
            ttft: Histogram::new(ttft),
            e2e: Histogram::new(e2e),
            prefill_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            inter_token: Histogram::new(inter_token),
        }
    }
}

impl Default for MetricsSnapshot {
    fn default() -> Self {
        Self::new()
    }
}

/// Formats a value the way prometheus_client does (`floatToGoString`): Python's `repr`, with
/// Go's earlier switch to exponent notation for large numbers (`1.735e+09`).
pub fn go_float(value: f64) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value.is_infinite() {
        return if value > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
    }
    let repr = python_repr(value);
    if value > 0.0 {
        if let Some(dot) = repr.find('.') {
            if dot > 6 && !repr.contains('e') {
                let digits = format!("{}{}", &repr[1..dot], &repr[dot + 1..]);
                let mantissa = format!("{}.{}", &repr[..1], digits);
                let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
                return format!("{mantissa}e+0{}", dot - 1);
            }
        }
    }
    repr
}

/// Python's float `repr` for the values a simulator produces: shortest round-trip digits,
/// always with a `.0` for integral values.
fn python_repr(value: f64) -> String {
    let s = format!("{value:?}");
    if s.contains('e') {
        // Rust writes `1e-7`, Python `1e-07`; normalise the exponent to two digits.
        if let Some((mantissa, exp)) = s.split_once('e') {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ("-", d),
                None => ("+", exp),
            };
            return format!("{mantissa}e{sign}{digits:0>2}");
        }
    }
    s
}

/// Escapes a label value for the text format.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Writes one sample with `base` and `extra` labels merged and sorted by name.
fn sample_with(
    out: &mut String,
    name: &str,
    base: &[(&str, &str)],
    extra: &[(&str, &str)],
    value: f64,
) {
    let mut labels: Vec<(&str, &str)> = base.iter().chain(extra).copied().collect();
    labels.sort_by_key(|(k, _)| *k);
    sample(out, name, &labels, value);
}

/// Writes one sample; `labels` must already be sorted by name.
fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: f64) {
    let rendered: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    let _ = writeln!(out, "{name}{{{}}} {}", rendered.join(","), go_float(value));
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn gauge(out: &mut String, name: &str, help: &str, model: &str, value: f64) {
    header(out, name, "gauge", help);
    sample(out, name, &[("engine", "0"), ("model_name", model)], value);
}

fn counter(out: &mut String, name: &str, help: &str, model: &str, value: u64) {
    header(out, name, "counter", help);
    sample(
        out,
        name,
        &[("engine", "0"), ("model_name", model)],
        value as f64,
    );
}

fn histogram(out: &mut String, name: &str, help: &str, model: &str, h: &Histogram) {
    histogram_with(
        out,
        name,
        help,
        &[("engine", "0"), ("model_name", model)],
        h,
        false,
    );
}

/// A histogram family; `sum_first` is the multiprocess collector's order (`_sum`, buckets,
/// `_count`) that SGLang and TRT-LLM expose.
fn histogram_with(
    out: &mut String,
    name: &str,
    help: &str,
    labels: &[(&str, &str)],
    h: &Histogram,
    sum_first: bool,
) {
    header(out, name, "histogram", help);
    let sum_name = format!("{name}_sum");
    if sum_first {
        sample_with(out, &sum_name, labels, &[], h.sum);
    }
    let bucket = format!("{name}_bucket");
    let mut cumulative = 0u64;
    for (i, count) in h.counts.iter().enumerate() {
        cumulative += count;
        let le = h
            .bounds
            .get(i)
            .map_or_else(|| "+Inf".to_string(), |b| go_float(*b));
        sample_with(out, &bucket, labels, &[("le", &le)], cumulative as f64);
    }
    sample_with(out, &format!("{name}_count"), labels, &[], h.count as f64);
    if !sum_first {
        sample_with(out, &sum_name, labels, &[], h.sum);
    }
}

/// A single-series gauge or counter family with the given labels.
fn scalar(out: &mut String, name: &str, kind: &str, help: &str, labels: &[(&str, &str)], v: f64) {
    header(out, name, kind, help);
    sample_with(out, name, labels, &[], v);
}

/// Fraction of queried prompt tokens found in the prefix cache, 0 before any query.
pub fn hit_rate(m: &MetricsSnapshot) -> f64 {
    if m.prefix_queries == 0 {
        0.0
    } else {
        m.prefix_hits as f64 / m.prefix_queries as f64
    }
}

/// Renders a pod's `/metrics` page.
pub fn render(model: &str, m: &MetricsSnapshot) -> String {
    let mut out = String::with_capacity(8192);
    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        model,
        m.running as f64,
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        model,
        m.waiting as f64,
    );
    gauge(
        &mut out,
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        model,
        m.kv_usage,
    );
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        model,
        m.kv_usage,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        model,
        m.prefix_queries,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        model,
        m.prefix_hits,
    );
    counter(
        &mut out,
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        model,
        m.prompt_tokens,
    );
    counter(
        &mut out,
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        model,
        m.generation_tokens,
    );
    header(
        &mut out,
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
    );
    for (reason, value) in [
        ("stop", m.success_stop),
        ("length", m.success_length),
        ("abort", m.success_abort),
    ] {
        let labels = [
            ("engine", "0"),
            ("finished_reason", reason),
            ("model_name", model),
        ];
        sample(
            &mut out,
            "vllm:request_success_total",
            &labels,
            value as f64,
        );
    }
    histogram(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        model,
        &m.ttft,
    );
    histogram(
        &mut out,
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
        model,
        &m.inter_token,
    );
    histogram(
        &mut out,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        model,
        &m.inter_token,
    );
    histogram(
        &mut out,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        model,
        &m.e2e,
    );
    histogram(
        &mut out,
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        model,
        &m.prefill_time,
    );
    header(
        &mut out,
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
    );
    let blocks = m.num_gpu_blocks.to_string();
    let block_size = m.block_size.to_string();
    let labels = [
        ("block_size", block_size.as_str()),
        ("cache_dtype", "auto"),
        (
            "enable_prefix_caching",
            if m.prefix_caching { "True" } else { "False" },
        ),
        ("engine", "0"),
        ("gpu_memory_utilization", "0.9"),
        ("num_gpu_blocks", blocks.as_str()),
    ];
    sample(&mut out, "vllm:cache_config_info", &labels, 1.0);
    out
}

/// xLLM's `engine_utilization` gauge, which AIBrix's `least-utilization` reads: here the
/// share of the batch slots (`--max-num-seqs`) running requests hold, 0..1.
pub fn render_utilization(model: &str, m: &MetricsSnapshot, max_num_seqs: usize) -> String {
    let occupancy = (m.running as f64 / max_num_seqs.max(1) as f64).min(1.0);
    format!(
        "# HELP engine_utilization Engine utilization.\n\
         # TYPE engine_utilization gauge\n\
         engine_utilization{{model_name=\"{model}\"}} {}\n",
        go_float(occupancy)
    )
}

/// SGLang's `engine_type` label for a pod role: `prefill`, `decode`, else `unified`.
pub fn sglang_engine_type(role: &str) -> &'static str {
    match role {
        "prefill" => "prefill",
        "decode" => "decode",
        _ => "unified",
    }
}

/// Renders an SGLang pod's `/metrics` page (SGLang's `collector.py` names, multiprocess form:
/// no `_created`, histograms `_sum` first). Scheduler gauges carry `engine_type`, `model_name`
/// and the rank labels of rank 0; tokenizer counters and histograms `engine_type` and
/// `model_name` only.
///
/// SGLang's PD queues, as its disaggregation scheduler moves requests through them: a decode
/// leg waits for its request slot (`num_decode_prealloc_queue_reqs`), then for its prefill's
/// KV, from its registration in the bootstrap room until it has pulled the KV
/// (`num_decode_transfer_queue_reqs`), then runs; a prefill leg waits for its decode leg to
/// register (`num_prefill_prealloc_queue_reqs`), computes, and holds its KV while it is sent
/// (`num_prefill_inflight_queue_reqs`). `sglang:num_queue_reqs` is the waiting queue proper:
/// requests waiting for a batch slot, without those in the prealloc and transfer queues
/// (which vLLM counts as waiting).
pub fn render_sglang(model: &str, engine_type: &str, m: &MetricsSnapshot) -> String {
    let mut out = String::with_capacity(8192);
    let sched = [
        ("engine_type", engine_type),
        ("model_name", model),
        ("moe_ep_rank", "0"),
        ("pp_rank", "0"),
        ("tp_rank", "0"),
    ];
    let queue = m
        .waiting
        .saturating_sub(m.prefill_prealloc + m.decode_prealloc + m.kv_transfer);
    for (name, help, value) in [
        (
            "sglang:num_running_reqs",
            "The number of running requests.",
            m.running as f64,
        ),
        (
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            queue as f64,
        ),
        (
            "sglang:num_used_tokens",
            "The number of used tokens.",
            m.kv_used_tokens as f64,
        ),
        (
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            m.kv_capacity_tokens as f64,
        ),
        ("sglang:token_usage", "The token usage.", m.kv_usage),
        (
            "sglang:gen_throughput",
            "The generation throughput (token/s).",
            m.gen_throughput,
        ),
        (
            "sglang:cache_hit_rate",
            "The prefix cache hit rate.",
            hit_rate(m),
        ),
        (
            "sglang:num_prefill_prealloc_queue_reqs",
            "The number of requests in the prefill prealloc queue.",
            m.prefill_prealloc as f64,
        ),
        (
            "sglang:num_prefill_inflight_queue_reqs",
            "The number of requests in the prefill inflight queue.",
            m.prefill_inflight as f64,
        ),
        (
            "sglang:num_decode_prealloc_queue_reqs",
            "The number of requests in the decode prealloc queue.",
            m.decode_prealloc as f64,
        ),
        (
            "sglang:num_decode_transfer_queue_reqs",
            "The number of requests in the decode transfer queue.",
            m.kv_transfer as f64,
        ),
    ] {
        scalar(&mut out, name, "gauge", help, &sched, value);
    }
    let tok = [("engine_type", engine_type), ("model_name", model)];
    let finished = m.success_stop + m.success_length + m.success_abort;
    for (name, help, value) in [
        (
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            m.finished_prompt_tokens,
        ),
        (
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            m.finished_generation_tokens,
        ),
        (
            "sglang:cached_tokens_total",
            "Number of cached prompt tokens.",
            m.prefix_hits,
        ),
        (
            "sglang:num_requests_total",
            "Number of requests processed.",
            finished,
        ),
        (
            "sglang:num_aborted_requests_total",
            "Number of requests aborted.",
            m.success_abort,
        ),
    ] {
        scalar(&mut out, name, "counter", help, &tok, value as f64);
    }
    for (name, help, h) in [
        (
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &m.ttft,
        ),
        (
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &m.inter_token,
        ),
        (
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            &m.e2e,
        ),
    ] {
        histogram_with(&mut out, name, help, &tok, h, true);
    }
    out
}

/// The `model_name` TRT-LLM exports: the checkpoint directory's basename.
pub fn trtllm_model_name(model: &str) -> &str {
    model.rsplit('/').next().unwrap_or(model)
}

/// KV blocks held, rounded up.
fn used_blocks(m: &MetricsSnapshot) -> u64 {
    m.kv_used_tokens
        .div_ceil(m.block_size.max(1))
        .min(m.num_gpu_blocks)
}

/// Renders a TensorRT-LLM pod's `/prometheus/metrics` page (`trtllm_` prefix, labels
/// `engine_type="pytorch"` and `model_name` = checkpoint basename; gauges, created without a
/// multiprocess mode, also carry `pid`; histograms `_sum` first, vLLM's buckets).
pub fn render_trtllm(model: &str, pid: u32, m: &MetricsSnapshot) -> String {
    let mut out = String::with_capacity(8192);
    let model = trtllm_model_name(model);
    let base = [("engine_type", "pytorch"), ("model_name", model)];
    let name = "trtllm_request_success_total";
    header(
        &mut out,
        name,
        "counter",
        "Count of successfully processed requests.",
    );
    for (reason, value) in [("stop", m.success_stop), ("length", m.success_length)] {
        sample_with(
            &mut out,
            name,
            &base,
            &[("finished_reason", reason)],
            value as f64,
        );
    }
    for (name, help, h) in [
        (
            "trtllm_e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            &m.e2e,
        ),
        (
            "trtllm_time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &m.ttft,
        ),
        (
            "trtllm_time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            &m.inter_token,
        ),
    ] {
        histogram_with(&mut out, name, help, &base, h, true);
    }
    let pid = pid.to_string();
    let gauges = [base[0], base[1], ("pid", pid.as_str())];
    let used = used_blocks(m);
    for (name, help, value) in [
        (
            "trtllm_kv_cache_utilization",
            "KV cache utilization",
            m.kv_usage,
        ),
        ("trtllm_kv_cache_hit_rate", "KV cache hit rate", hit_rate(m)),
        (
            "trtllm_num_requests_running",
            "Number of running requests",
            m.running as f64,
        ),
        (
            "trtllm_num_requests_waiting",
            "Number of waiting requests",
            m.waiting as f64,
        ),
        (
            "trtllm_kv_cache_max_blocks",
            "Maximum number of KV cache blocks",
            m.num_gpu_blocks as f64,
        ),
        (
            "trtllm_kv_cache_used_blocks",
            "Number of used KV cache blocks",
            used as f64,
        ),
        (
            "trtllm_kv_cache_free_blocks",
            "Number of free KV cache blocks",
            m.num_gpu_blocks.saturating_sub(used) as f64,
        ),
    ] {
        scalar(&mut out, name, "gauge", help, &gauges, value);
    }
    for (name, help, value) in [
        (
            "trtllm_prompt_tokens_total",
            "Number of prefill tokens processed.",
            m.finished_prompt_tokens,
        ),
        (
            "trtllm_generation_tokens_total",
            "Number of generation tokens processed.",
            m.finished_generation_tokens,
        ),
    ] {
        scalar(&mut out, name, "counter", help, &base, value as f64);
    }
    out
}

/// TRT-LLM's JSON iteration stats on `/metrics`: one record describing the current iteration
/// while the pod has work, `[]` when idle (the real endpoint drains its queue of records).
pub fn render_trtllm_iteration_stats(iter: u64, timestamp: &str, m: &MetricsSnapshot) -> Value {
    if m.running + m.waiting == 0 {
        return json!([]);
    }
    let used = used_blocks(m);
    let reused = m.prefix_hits / m.block_size.max(1);
    let missed = (m.prefix_queries - m.prefix_hits.min(m.prefix_queries)) / m.block_size.max(1);
    json!([{
        "timestamp": timestamp,
        "iter": iter,
        "iterLatencyMS": 0.0,
        "newActiveRequestsQueueLatencyMS": 0.0,
        "numActiveRequests": m.running,
        "numQueuedRequests": m.waiting,
        "numCompletedRequests": 0,
        "numNewActiveRequests": 0,
        "maxNumActiveRequests": 0,
        "gpuMemUsage": 0,
        "cpuMemUsage": 0,
        "pinnedMemUsage": 0,
        "kvCacheStats": {
            "maxNumBlocks": m.num_gpu_blocks,
            "freeNumBlocks": m.num_gpu_blocks.saturating_sub(used),
            "usedNumBlocks": used,
            "tokensPerBlock": m.block_size,
            "allocTotalBlocks": used,
            "allocNewBlocks": 0,
            "reusedBlocks": reused,
            "missedBlocks": missed,
            "cacheHitRate": hit_rate(m),
        },
        "inflightBatchingStats": {
            "numContextRequests": 0,
            "numGenRequests": m.running,
            "numPausedRequests": 0,
            "numScheduledRequests": m.running,
            "numCtxTokens": 0,
            "microBatchId": 0,
            "avgNumDecodedTokensPerIter": 1.0,
        },
        "staticBatchingStats": null,
    }])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_format_like_prometheus_client() {
        assert_eq!(go_float(4.0), "4.0");
        assert_eq!(go_float(0.0), "0.0");
        assert_eq!(go_float(0.0834), "0.0834");
        assert_eq!(go_float(0.001), "0.001");
        assert_eq!(go_float(2560.0), "2560.0");
        assert_eq!(go_float(1_735_000_001.2), "1.7350000012e+09");
        assert_eq!(go_float(123_456_789.0), "1.23456789e+08");
        assert_eq!(go_float(f64::INFINITY), "+Inf");
        assert_eq!(go_float(1e-7), "1e-07");
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        let mut out = String::new();
        histogram(&mut out, "x", "help", "m", &h);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines,
            vec![
                "# HELP x help",
                "# TYPE x histogram",
                "x_bucket{engine=\"0\",le=\"0.1\",model_name=\"m\"} 1.0",
                "x_bucket{engine=\"0\",le=\"1.0\",model_name=\"m\"} 2.0",
                "x_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 3.0",
                "x_count{engine=\"0\",model_name=\"m\"} 3.0",
                "x_sum{engine=\"0\",model_name=\"m\"} 5.55",
            ]
        );
    }

    #[test]
    fn the_utilization_gauge_is_batch_occupancy_read_back_by_pd_control() {
        let mut m = MetricsSnapshot::new();
        m.running = 3;
        let text = render_utilization("m", &m, 4);
        let r = pd_control::scrape::engine::parse_reading(
            text.as_bytes(),
            pd_control::scrape::engine::Engine::Sglang,
            "m",
        );
        assert_eq!(r.utilization, Some(0.75));
        m.running = 9;
        assert!(
            render_utilization("m", &m, 4).contains("} 1.0\n"),
            "capped at 1"
        );
    }

    #[test]
    fn render_has_vllm_lines() {
        let mut m = MetricsSnapshot::new();
        m.running = 4;
        m.kv_usage = 0.25;
        m.success_length = 3;
        m.ttft.observe(0.003);
        let text = render("meta-llama/Llama-3.1-8B-Instruct", &m);
        let model = "model_name=\"meta-llama/Llama-3.1-8B-Instruct\"";
        for line in [
            "# TYPE vllm:num_requests_running gauge".to_string(),
            format!("vllm:num_requests_running{{engine=\"0\",{model}}} 4.0"),
            format!("vllm:num_requests_waiting{{engine=\"0\",{model}}} 0.0"),
            format!("vllm:kv_cache_usage_perc{{engine=\"0\",{model}}} 0.25"),
            format!("vllm:gpu_cache_usage_perc{{engine=\"0\",{model}}} 0.25"),
            "# TYPE vllm:prompt_tokens_total counter".to_string(),
            format!(
                "vllm:request_success_total{{engine=\"0\",finished_reason=\"length\",{model}}} 3.0"
            ),
            format!(
                "vllm:request_success_total{{engine=\"0\",finished_reason=\"stop\",{model}}} 0.0"
            ),
            format!(
                "vllm:time_to_first_token_seconds_bucket{{engine=\"0\",le=\"0.001\",{model}}} 0.0"
            ),
            format!(
                "vllm:time_to_first_token_seconds_bucket{{engine=\"0\",le=\"0.005\",{model}}} 1.0"
            ),
            format!(
                "vllm:time_to_first_token_seconds_bucket{{engine=\"0\",le=\"+Inf\",{model}}} 1.0"
            ),
            format!("vllm:time_to_first_token_seconds_count{{engine=\"0\",{model}}} 1.0"),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing line: {line}\n{text}"
            );
        }
        // Every sample line is `name{labels} value` with sorted label names.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, rest) = line.split_once('{').unwrap();
            let (labels, value) = rest.split_once("} ").unwrap();
            assert!(value.parse::<f64>().is_ok() || value == "+Inf", "{line}");
            let names: Vec<&str> = labels
                .split("\",")
                .map(|kv| kv.split('=').next().unwrap())
                .collect();
            let mut sorted = names.clone();
            sorted.sort();
            assert_eq!(names, sorted, "{line}");
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let mut out = String::new();
        sample(&mut out, "x", &[("a", "q\"b\\")], 1.0);
        assert_eq!(out, "x{a=\"q\\\"b\\\\\"} 1.0\n");
    }

    /// Every sample line is `name{labels} value` with label names sorted; returns the lines.
    fn assert_well_formed(text: &str) {
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, rest) = line.split_once('{').unwrap();
            let (labels, value) = rest.split_once("} ").unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
            let names: Vec<&str> = labels
                .split("\",")
                .map(|kv| kv.split('=').next().unwrap())
                .collect();
            let mut sorted = names.clone();
            sorted.sort();
            assert_eq!(names, sorted, "{line}");
        }
        // Each family is declared once, TYPE right after HELP.
        let types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE ")).collect();
        let mut unique = types.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(types.len(), unique.len(), "{text}");
    }

    fn has(text: &str, line: &str) {
        assert!(
            text.lines().any(|l| l == line),
            "missing line: {line}\n{text}"
        );
    }

    fn busy_snapshot(engine: Engine) -> MetricsSnapshot {
        let mut m = MetricsSnapshot::for_engine(engine);
        m.running = 3;
        m.waiting = 5;
        m.prefill_prealloc = 1;
        m.decode_prealloc = 1;
        m.kv_transfer = 2;
        m.kv_usage = 0.25;
        m.kv_used_tokens = 250;
        m.kv_capacity_tokens = 1000;
        m.num_gpu_blocks = 63;
        m.gen_throughput = 120.5;
        m.prefill_inflight = 4;
        m.prompt_tokens = 700;
        m.generation_tokens = 90;
        m.finished_prompt_tokens = 700;
        m.finished_generation_tokens = 90;
        m.prefix_queries = 800;
        m.prefix_hits = 200;
        m.success_stop = 1;
        m.success_length = 6;
        m.success_abort = 2;
        m.ttft.observe(0.15);
        m.inter_token.observe(0.003);
        m.e2e.observe(1.5);
        m
    }

    #[test]
    fn sglang_exposition_has_its_names_labels_and_values() {
        let idle = render_sglang(
            "Qwen/Qwen3-8B",
            "decode",
            &MetricsSnapshot::for_engine(Engine::Sglang),
        );
        let m = busy_snapshot(Engine::Sglang);
        let text = render_sglang("Qwen/Qwen3-8B", "decode", &m);
        assert_well_formed(&text);
        assert_well_formed(&idle);
        assert!(!text.contains("vllm:"), "{text}");
        let sched = r#"{engine_type="decode",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"}"#;
        let tok = r#"{engine_type="decode",model_name="Qwen/Qwen3-8B"}"#;
        for (name, kind) in [
            ("sglang:num_running_reqs", "gauge"),
            ("sglang:num_queue_reqs", "gauge"),
            ("sglang:token_usage", "gauge"),
            ("sglang:gen_throughput", "gauge"),
            ("sglang:cache_hit_rate", "gauge"),
            ("sglang:num_prefill_prealloc_queue_reqs", "gauge"),
            ("sglang:num_decode_prealloc_queue_reqs", "gauge"),
            ("sglang:num_decode_transfer_queue_reqs", "gauge"),
            ("sglang:num_requests_total", "counter"),
            ("sglang:prompt_tokens_total", "counter"),
            ("sglang:generation_tokens_total", "counter"),
            ("sglang:time_to_first_token_seconds", "histogram"),
        ] {
            has(&text, &format!("# TYPE {name} {kind}"));
        }
        for (name, idle_value, value) in [
            ("sglang:num_running_reqs", "0.0", "3.0"),
            // 5 waiting - 1 prefill prealloc - 1 decode prealloc - 2 transfer
            ("sglang:num_queue_reqs", "0.0", "1.0"),
            ("sglang:num_used_tokens", "0.0", "250.0"),
            ("sglang:max_total_num_tokens", "0.0", "1000.0"),
            ("sglang:token_usage", "0.0", "0.25"),
            ("sglang:gen_throughput", "0.0", "120.5"),
            ("sglang:cache_hit_rate", "0.0", "0.25"),
            ("sglang:num_prefill_prealloc_queue_reqs", "0.0", "1.0"),
            ("sglang:num_prefill_inflight_queue_reqs", "0.0", "4.0"),
            ("sglang:num_decode_prealloc_queue_reqs", "0.0", "1.0"),
            ("sglang:num_decode_transfer_queue_reqs", "0.0", "2.0"),
        ] {
            has(&idle, &format!("{name}{sched} {idle_value}"));
            has(&text, &format!("{name}{sched} {value}"));
        }
        for (name, value) in [
            ("sglang:prompt_tokens_total", "700.0"),
            ("sglang:generation_tokens_total", "90.0"),
            ("sglang:cached_tokens_total", "200.0"),
            ("sglang:num_requests_total", "9.0"),
            ("sglang:num_aborted_requests_total", "2.0"),
            ("sglang:time_to_first_token_seconds_count", "1.0"),
            ("sglang:time_to_first_token_seconds_sum", "0.15"),
        ] {
            has(&text, &format!("{name}{tok} {value}"));
        }
        // SGLang's buckets, multiprocess order (`_sum` first).
        has(
            &text,
            r#"sglang:time_to_first_token_seconds_bucket{engine_type="decode",le="0.1",model_name="Qwen/Qwen3-8B"} 0.0"#,
        );
        has(
            &text,
            r#"sglang:time_to_first_token_seconds_bucket{engine_type="decode",le="0.2",model_name="Qwen/Qwen3-8B"} 1.0"#,
        );
        has(
            &text,
            r#"sglang:inter_token_latency_seconds_bucket{engine_type="decode",le="0.004",model_name="Qwen/Qwen3-8B"} 1.0"#,
        );
        let ttft: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("sglang:time_to_first_token_seconds"))
            .collect();
        assert!(ttft[0].starts_with("sglang:time_to_first_token_seconds_sum{"));
        assert!(ttft[ttft.len() - 1].starts_with("sglang:time_to_first_token_seconds_count{"));
        assert_eq!(ttft.len(), SGLANG_TTFT_BUCKETS.len() + 3);
        assert!(
            render_sglang("m", "unified", &m).contains(r#"{engine_type="unified",model_name="m","#)
        );
        assert_eq!(sglang_engine_type("prefill"), "prefill");
        assert_eq!(sglang_engine_type(""), "unified");
    }

    #[test]
    fn trtllm_exposition_has_its_names_labels_and_values() {
        let m = busy_snapshot(Engine::Trtllm);
        let text = render_trtllm("Qwen/Qwen3-8B", 4121, &m);
        let idle = render_trtllm(
            "Qwen/Qwen3-8B",
            4121,
            &MetricsSnapshot::for_engine(Engine::Trtllm),
        );
        assert_well_formed(&text);
        assert_well_formed(&idle);
        assert!(
            !text.contains("vllm:") && !text.contains("sglang:"),
            "{text}"
        );
        let base = r#"engine_type="pytorch",model_name="Qwen3-8B""#;
        for (name, kind) in [
            ("trtllm_request_success_total", "counter"),
            ("trtllm_time_to_first_token_seconds", "histogram"),
            ("trtllm_time_per_output_token_seconds", "histogram"),
            ("trtllm_e2e_request_latency_seconds", "histogram"),
            ("trtllm_kv_cache_utilization", "gauge"),
            ("trtllm_kv_cache_hit_rate", "gauge"),
            ("trtllm_num_requests_running", "gauge"),
            ("trtllm_num_requests_waiting", "gauge"),
            ("trtllm_prompt_tokens_total", "counter"),
            ("trtllm_generation_tokens_total", "counter"),
        ] {
            has(&text, &format!("# TYPE {name} {kind}"));
        }
        for (name, idle_value, value) in [
            ("trtllm_kv_cache_utilization", "0.0", "0.25"),
            ("trtllm_kv_cache_hit_rate", "0.0", "0.25"),
            ("trtllm_num_requests_running", "0.0", "3.0"),
            ("trtllm_num_requests_waiting", "0.0", "5.0"),
            ("trtllm_kv_cache_max_blocks", "0.0", "63.0"),
            ("trtllm_kv_cache_used_blocks", "0.0", "16.0"), // 250 tokens / 16, rounded up
            ("trtllm_kv_cache_free_blocks", "0.0", "47.0"),
        ] {
            has(
                &idle,
                &format!("{name}{{{base},pid=\"4121\"}} {idle_value}"),
            );
            has(&text, &format!("{name}{{{base},pid=\"4121\"}} {value}"));
        }
        for (line, value) in [
            (
                r#"trtllm_request_success_total{engine_type="pytorch",finished_reason="stop",model_name="Qwen3-8B"}"#,
                "1.0",
            ),
            (
                r#"trtllm_request_success_total{engine_type="pytorch",finished_reason="length",model_name="Qwen3-8B"}"#,
                "6.0",
            ),
            (
                r#"trtllm_prompt_tokens_total{engine_type="pytorch",model_name="Qwen3-8B"}"#,
                "700.0",
            ),
            (
                r#"trtllm_generation_tokens_total{engine_type="pytorch",model_name="Qwen3-8B"}"#,
                "90.0",
            ),
            (
                r#"trtllm_time_to_first_token_seconds_sum{engine_type="pytorch",model_name="Qwen3-8B"}"#,
                "0.15",
            ),
            (
                r#"trtllm_time_to_first_token_seconds_bucket{engine_type="pytorch",le="0.001",model_name="Qwen3-8B"}"#,
                "0.0",
            ),
            (
                r#"trtllm_time_to_first_token_seconds_bucket{engine_type="pytorch",le="0.25",model_name="Qwen3-8B"}"#,
                "1.0",
            ),
            (
                r#"trtllm_time_to_first_token_seconds_count{engine_type="pytorch",model_name="Qwen3-8B"}"#,
                "1.0",
            ),
        ] {
            has(&text, &format!("{line} {value}"));
        }
        // Counters and histograms carry no pid.
        for line in text
            .lines()
            .filter(|l| l.contains("_total{") || l.contains("_seconds_"))
        {
            assert!(!line.contains("pid="), "{line}");
        }
        assert_eq!(trtllm_model_name("llama-3-8b"), "llama-3-8b");
    }

    #[test]
    fn trtllm_iteration_stats_follow_state() {
        let idle = MetricsSnapshot::for_engine(Engine::Trtllm);
        assert_eq!(
            render_trtllm_iteration_stats(0, "00:00:00", &idle),
            json!([])
        );
        let m = busy_snapshot(Engine::Trtllm);
        let v = render_trtllm_iteration_stats(7, "01:23:56", &m);
        let r = &v[0];
        assert_eq!(r["iter"], 7);
        assert_eq!(r["timestamp"], "01:23:56");
        assert_eq!(
            (
                r["numActiveRequests"].as_u64(),
                r["numQueuedRequests"].as_u64()
            ),
            (Some(3), Some(5))
        );
        let kv = &r["kvCacheStats"];
        assert_eq!(
            (
                kv["maxNumBlocks"].as_u64(),
                kv["usedNumBlocks"].as_u64(),
                kv["freeNumBlocks"].as_u64()
            ),
            (Some(63), Some(16), Some(47))
        );
        assert_eq!(kv["tokensPerBlock"], 16);
        assert_eq!(kv["cacheHitRate"], 0.25);
        assert_eq!(r["inflightBatchingStats"]["numGenRequests"], 3);
    }

    #[test]
    fn each_engine_exposition_parses_with_pd_controls_mapping() {
        use pd_control::scrape::engine::parse_reading;
        let m = busy_snapshot(Engine::Vllm);
        let r = parse_reading(render("org/m", &m), Engine::Vllm, "org/m");
        assert_eq!(
            (r.running, r.waiting, r.kv_cache_usage),
            (Some(3.0), Some(5.0), Some(0.25))
        );
        assert_eq!(r.completed, Some(9.0));
        let m = busy_snapshot(Engine::Sglang);
        let r = parse_reading(
            render_sglang("org/m", "decode", &m),
            Engine::Sglang,
            "org/m",
        );
        // Waiting as AIBrix's queue score counts it: the queue (1) and the prefill and decode
        // prealloc queues (1 each), not the legs waiting for their KV (2).
        assert_eq!(
            (r.running, r.waiting, r.kv_cache_usage),
            (Some(3.0), Some(3.0), Some(0.25))
        );
        assert_eq!(
            (r.generation_gauge, r.completed, r.prompt_tokens),
            (Some(120.5), Some(9.0), Some(700.0))
        );
        let m = busy_snapshot(Engine::Trtllm);
        let r = parse_reading(render_trtllm("org/m", 1, &m), Engine::Trtllm, "org/m");
        assert_eq!(
            (r.running, r.waiting, r.kv_cache_usage),
            (Some(3.0), Some(5.0), Some(0.25))
        );
        assert_eq!((r.completed, r.generation_tokens), (Some(7.0), Some(90.0)));
    }
}
