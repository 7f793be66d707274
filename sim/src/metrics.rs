//! Prometheus text exposition with vLLM's metric names, labels and number formatting, so a
//! scraper written against real vLLM pods (pd-control) parses the simulator unchanged.
//!
//! Format details copied from prometheus_client as vLLM uses it: labels sorted by name,
//! every value a float (`4.0`), counters declared under their `_total` name, histogram
//! buckets cumulative with `le` last-but-sorted, `_created` series omitted (as in vLLM's
//! multiprocess mode).

use std::fmt::Write as _;

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
    pub success_stop: u64,
    pub success_length: u64,
    pub success_abort: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub num_gpu_blocks: u64,
    pub block_size: u64,
    pub prefix_caching: bool,
    pub ttft: Histogram,
    pub e2e: Histogram,
    pub prefill_time: Histogram,
    pub inter_token: Histogram,
}

impl MetricsSnapshot {
    pub fn new() -> Self {
        MetricsSnapshot {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            prompt_tokens: 0,
            generation_tokens: 0,
            success_stop: 0,
            success_length: 0,
            success_abort: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            num_gpu_blocks: 0,
            block_size: crate::engine::BLOCK_SIZE_TOKENS,
            prefix_caching: true,
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
            prefill_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            inter_token: Histogram::new(TOKEN_LATENCY_BUCKETS),
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
    header(out, name, "histogram", help);
    let bucket = format!("{name}_bucket");
    let mut cumulative = 0u64;
    for (i, count) in h.counts.iter().enumerate() {
        cumulative += count;
        let le = h
            .bounds
            .get(i)
            .map_or_else(|| "+Inf".to_string(), |b| go_float(*b));
        sample(
            out,
            &bucket,
            &[("engine", "0"), ("le", &le), ("model_name", model)],
            cumulative as f64,
        );
    }
    let labels = [("engine", "0"), ("model_name", model)];
    sample(out, &format!("{name}_count"), &labels, h.count as f64);
    sample(out, &format!("{name}_sum"), &labels, h.sum);
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
}
