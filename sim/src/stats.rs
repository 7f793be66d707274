//! Summary statistics of a pd-load run: latency distributions, status counts, how requests
//! spread over pods and roles, and errors grouped by what the router said about them.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::chunk_gaps::{GapDist, GapHistogram};
use crate::load::{RequestResult, RunReport};

/// Percentile `p` (0..=100) of ascending `sorted` values, interpolating linearly between the
/// two nearest ranks (numpy's default), so small samples still give sensible p99s.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = (p.clamp(0.0, 100.0) / 100.0) * last as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let (a, b) = (*sorted.get(lo)?, *sorted.get(hi)?);
    Some(a + (b - a) * (rank - lo as f64))
}

/// A latency distribution, in milliseconds.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Dist {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Dist {
    /// `None` for an empty sample. NaNs are dropped.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Dist> {
        let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Dist {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: percentile(&v, 50.0)?,
            p90: percentile(&v, 90.0)?,
            p99: percentile(&v, 99.0)?,
            max: *v.last()?,
        })
    }
}

/// Requests one pod served in one role.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PodRow {
    /// `decode` (answered with a `prefill-target-pod`), `prefill`, `combined` (a
    /// `target-pod` alone) or `unrouted` (no `target-pod` header: direct or rejected).
    pub role: String,
    pub pod: String,
    pub requests: usize,
    /// For decode rows: the prefill pods paired with this decode pod, and how often.
    pub paired_prefill: BTreeMap<String, usize>,
}

/// The summary printed at the end of a run and written to `--json`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Summary {
    pub requests: usize,
    pub ok: usize,
    pub errors: usize,
    /// From the first send to the last completion.
    pub elapsed_s: f64,
    /// Sending rate over the sending window.
    pub offered_rps: f64,
    /// Successful completions per second of `elapsed_s`.
    pub completed_rps: f64,
    /// Status code (or `none` for no response) → count.
    pub status: BTreeMap<String, usize>,
    pub pods: Vec<PodRow>,
    /// Over successful requests only.
    pub ttft_ms: Option<Dist>,
    pub tpot_ms: Option<Dist>,
    /// Streams: each request's longest wait between two reads bringing tokens.
    pub max_gap_ms: Option<Dist>,
    /// Streams: every wait between two reads bringing tokens, of every successful stream
    /// (the target's "time between chunks"; see [`crate::chunk_gaps`]).
    pub chunk_gap_ms: Option<GapDist>,
    pub e2e_ms: Option<Dist>,
    /// `--direct-prefill` runs: the prefill leg pd-load made itself.
    pub prefill_ms: Option<Dist>,
    pub output_tokens: u64,
    pub output_tokens_per_s: f64,
    /// `<status> <x-error-* headers>` or `no response: <error>` → count.
    pub errors_by: BTreeMap<String, usize>,
    /// Arrivals that had to wait for a free slot under `--concurrency-limit`.
    pub delayed_by_limit: u64,
}

/// Summarises a run; `send_window_s` is how long arrivals were generated for, `target` names
/// the pod row of requests answered without a `target-pod` header (sent straight to a pod),
/// `chunk_gaps` holds the gaps of the run's successful streams (the client keeps them, one
/// histogram a run, since `results` cannot hold every gap of a long run).
pub fn summarize(
    results: &[RequestResult],
    send_window_s: f64,
    elapsed_s: f64,
    delayed_by_limit: u64,
    target: &str,
    chunk_gaps: &GapHistogram,
) -> Summary {
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.is_ok()).collect();
    let mut status = BTreeMap::new();
    let mut errors_by = BTreeMap::new();
    for r in results {
        let key = r
            .status
            .map_or_else(|| "none".to_string(), |s| s.to_string());
        *status.entry(key).or_insert(0) += 1;
        if !r.is_ok() {
            *errors_by.entry(error_key(r)).or_insert(0) += 1;
        }
    }
    let output_tokens: u64 = ok.iter().map(|r| r.tokens).sum();
    let per_s = |n: f64, s: f64| if s > 0.0 { n / s } else { 0.0 };
    Summary {
        requests: results.len(),
        ok: ok.len(),
        errors: results.len() - ok.len(),
        elapsed_s,
        offered_rps: per_s(results.len() as f64, send_window_s),
        completed_rps: per_s(ok.len() as f64, elapsed_s),
        status,
        pods: pod_rows(results, target),
        ttft_ms: Dist::of(ok.iter().filter_map(|r| r.ttft_ms)),
        tpot_ms: Dist::of(ok.iter().filter_map(|r| r.tpot_ms())),
        max_gap_ms: Dist::of(ok.iter().filter_map(|r| r.max_gap_ms)),
        chunk_gap_ms: chunk_gaps.dist(),
        e2e_ms: Dist::of(ok.iter().map(|r| r.e2e_ms)),
        prefill_ms: Dist::of(ok.iter().filter_map(|r| r.prefill_ms)),
        output_tokens,
        output_tokens_per_s: per_s(output_tokens as f64, elapsed_s),
        errors_by,
        delayed_by_limit,
    }
}

/// How an error is grouped: what the client could see of why it failed.
fn error_key(r: &RequestResult) -> String {
    let mut key = match r.status {
        Some(s) => s.to_string(),
        None => "no response".to_string(),
    };
    for (name, value) in &r.error_headers {
        let value: String = value.chars().take(60).collect();
        let _ = write!(key, " {name}={value}");
    }
    if r.error_headers.is_empty() {
        if let Some(err) = &r.error {
            let err: String = err.chars().take(80).collect();
            let _ = write!(key, ": {err}");
        }
    }
    key
}

fn pod_rows(results: &[RequestResult], target: &str) -> Vec<PodRow> {
    let mut rows: BTreeMap<(u8, String, String), PodRow> = BTreeMap::new();
    let mut bump = |order: u8, role: &str, pod: &str, prefill: Option<&str>| {
        let row = rows
            .entry((order, role.to_string(), pod.to_string()))
            .or_insert_with(|| PodRow {
                role: role.to_string(),
                pod: pod.to_string(),
                requests: 0,
                paired_prefill: BTreeMap::new(),
            });
        row.requests += 1;
        if let Some(p) = prefill {
            *row.paired_prefill.entry(p.to_string()).or_insert(0) += 1;
        }
    };
    for r in results {
        match (r.target_pod.as_deref(), r.prefill_target_pod.as_deref()) {
            (Some(d), Some(p)) => {
                bump(0, "decode", d, Some(p));
                bump(1, "prefill", p, None);
            }
            (Some(c), None) => bump(2, "combined", c, None),
            (None, Some(p)) => bump(1, "prefill", p, None),
            (None, None) => bump(3, "unrouted", target, None),
        }
    }
    rows.into_values().collect()
}

fn fmt_dist(label: &str, d: &Option<Dist>) -> String {
    match d {
        Some(d) => format!(
            "{label} ms  p50 {:.1}  p90 {:.1}  p99 {:.1}  max {:.1}  mean {:.1}  (n={})",
            d.p50, d.p90, d.p99, d.max, d.mean, d.count
        ),
        None => format!("{label} ms  -"),
    }
}

fn fmt_gaps(d: &GapDist) -> String {
    format!(
        "CHUNK ms  p50 {:.2}  p90 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.1}  (n={})",
        d.p50, d.p90, d.p99, d.p99_9, d.max, d.count
    )
}

/// The human-readable summary.
pub fn render(s: &Summary) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "pd-load: {} requests in {:.1} s ({:.1} rps offered, {:.1} rps completed), {} errors",
        s.requests, s.elapsed_s, s.offered_rps, s.completed_rps, s.errors
    );
    let status: Vec<String> = s.status.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(out, "status: {}", status.join(" "));
    let _ = writeln!(out, "requests per pod and role:");
    let width = s
        .pods
        .iter()
        .map(|r| r.pod.len())
        .max()
        .unwrap_or(0)
        .max(12);
    for row in &s.pods {
        let _ = write!(
            out,
            "  {:<8} {:<width$} {:>6}",
            row.role, row.pod, row.requests
        );
        if !row.paired_prefill.is_empty() {
            let pairs: Vec<String> = row
                .paired_prefill
                .iter()
                .map(|(p, n)| format!("{p} {n}"))
                .collect();
            let _ = write!(out, "   (prefill {})", pairs.join(", "));
        }
        out.push('\n');
    }
    let _ = writeln!(out, "{}", fmt_dist("TTFT", &s.ttft_ms));
    let _ = writeln!(out, "{}", fmt_dist("TPOT", &s.tpot_ms));
    if s.max_gap_ms.is_some() {
        let _ = writeln!(out, "{}", fmt_dist("GAP ", &s.max_gap_ms));
    }
    if let Some(d) = &s.chunk_gap_ms {
        let _ = writeln!(out, "{}", fmt_gaps(d));
    }
    let _ = writeln!(out, "{}", fmt_dist("E2E ", &s.e2e_ms));
    if s.prefill_ms.is_some() {
        let _ = writeln!(out, "{}", fmt_dist("PREF", &s.prefill_ms));
    }
    let _ = writeln!(
        out,
        "output: {} tokens, {:.1} tok/s",
        s.output_tokens, s.output_tokens_per_s
    );
    if s.delayed_by_limit > 0 {
        let _ = writeln!(
            out,
            "arrivals delayed by --concurrency-limit: {}",
            s.delayed_by_limit
        );
    }
    if s.errors_by.is_empty() {
        let _ = writeln!(out, "errors by status/header: none");
    } else {
        let _ = writeln!(out, "errors by status/header:");
        for (k, v) in &s.errors_by {
            let _ = writeln!(out, "  {v:>6}  {k}");
        }
    }
    out
}

/// The prefix-cache and CPU lines of a run, when it measured them.
pub fn render_probes(report: &RunReport) -> String {
    let mut out = String::new();
    if let Some(p) = &report.prefix {
        let rate = p
            .hit_rate
            .map_or_else(|| "-".to_string(), |r| format!("{:.1} %", r * 100.0));
        let _ = writeln!(
            out,
            "prefix cache (pd-sim): hit rate {rate} ({:.0} of {:.0} prompt tokens)",
            p.hit_tokens, p.queried_tokens
        );
        for pod in &p.pods {
            let _ = writeln!(
                out,
                "  {:<8} {:<24} prompt tokens {:>10.0}  cached {:>10.0}",
                pod.role, pod.pod, pod.prompt_tokens, pod.hit_tokens
            );
        }
    }
    if let Some(c) = &report.cpu {
        let _ = writeln!(
            out,
            "router CPU (pids {:?}): {:.2} s, {:.1} us per request, {:.3} s per 1000 requests",
            c.pids, c.seconds, c.us_per_request, c.per_1000_requests
        );
    }
    if let Some(o) = &report.others {
        let _ = writeln!(
            out,
            "rest of the box: {:.2} s of other processes, {:.2} s stolen by the host, \
             {:.1} % of its CPU",
            o.seconds,
            o.steal_seconds,
            o.share * 100.0
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.5));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert!((percentile(&v, 99.0).unwrap() - 99.01).abs() < 1e-9);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[1.0, 3.0], 50.0), Some(2.0));
    }

    #[test]
    fn dist_sorts_and_skips_nan() {
        let d = Dist::of([3.0, f64::NAN, 1.0, 2.0]).unwrap();
        assert_eq!((d.count, d.p50, d.max, d.mean), (3, 2.0, 3.0, 2.0));
        assert!(Dist::of([]).is_none());
    }

    fn result(status: Option<u16>, target: Option<&str>, prefill: Option<&str>) -> RequestResult {
        RequestResult {
            status,
            target_pod: target.map(String::from),
            prefill_target_pod: prefill.map(String::from),
            stream: true,
            e2e_ms: 10.0,
            ttft_ms: Some(5.0),
            tokens: 6,
            ..RequestResult::default()
        }
    }

    #[test]
    fn the_longest_gap_of_each_stream_is_summarised_over_successes() {
        let gap = |g: Option<f64>, status: u16| RequestResult {
            max_gap_ms: g,
            ..result(Some(status), Some("d0"), Some("p0"))
        };
        let results = [
            gap(Some(1.0), 200),
            gap(Some(40.0), 200),
            gap(None, 200),
            gap(Some(900.0), 503),
        ];
        let s = summarize(&results, 1.0, 1.0, 0, "x", &GapHistogram::default());
        let d = s.max_gap_ms.as_ref().expect("gaps");
        assert_eq!((d.count, d.max), (2, 40.0), "successes with a gap only");
        assert!(render(&s).contains("GAP  ms  p50 20.5"), "{}", render(&s));
        let none = summarize(
            &[gap(None, 200)],
            1.0,
            1.0,
            0,
            "x",
            &GapHistogram::default(),
        );
        assert!(none.max_gap_ms.is_none());
        assert!(!render(&none).contains("GAP"));
    }

    #[test]
    fn every_gap_of_the_successful_streams_is_summarised() {
        use crate::chunk_gaps::{ChunkGaps, StreamGaps};
        let stream = |gaps: &[f64]| {
            let mut s = StreamGaps::default();
            gaps.iter().for_each(|g| s.record(*g));
            s
        };
        let ok = result(Some(200), Some("d0"), Some("p0"));
        let broken = RequestResult {
            error: Some("stream broken: connection reset".into()),
            ..ok.clone()
        };
        let run = ChunkGaps::default();
        // 99 gaps of 2 ms and one stall of 50 ms over two good streams: the stall is the
        // p99.9 and the max, the p99 is the engine's 2 ms; the broken stream's 900 ms and
        // the 503's gaps never count.
        run.record(&ok, &stream(&[2.0; 60]));
        run.record(&ok, &stream(&[[2.0; 39].as_slice(), &[50.0]].concat()));
        run.record(&broken, &stream(&[900.0, 900.0]));
        run.record(
            &result(Some(503), Some("d0"), Some("p0")),
            &stream(&[700.0]),
        );
        let results = [ok.clone(), ok, broken];
        let s = summarize(&results, 1.0, 1.0, 0, "x", &run.snapshot());
        let d = s.chunk_gap_ms.as_ref().expect("gaps");
        assert_eq!((d.count, d.max, d.p99_9), (100, 50.0, 50.0), "{d:?}");
        for p in [d.p50, d.p90, d.p99] {
            assert!((p - 2.0).abs() <= 0.02, "{d:?}");
        }
        let text = render(&s);
        assert!(
            text.contains("CHUNK ms  p50 2.00  p90 2.00  p99 2.00  p99.9 50.00  max 50.0  (n=100)"),
            "{text}"
        );
        let json = serde_json::to_value(&s).expect("json");
        assert_eq!(json["chunk_gap_ms"]["p99_9"], 50.0);
        assert_eq!(json["chunk_gap_ms"]["count"], 100);
        let none = summarize(&results, 1.0, 1.0, 0, "x", &GapHistogram::default());
        assert!(none.chunk_gap_ms.is_none());
        assert!(!render(&none).contains("CHUNK"));
    }

    #[test]
    fn summary_counts_roles_and_errors() {
        let mut routed_error = result(Some(503), None, None);
        routed_error
            .error_headers
            .insert("x-error-routing".into(), "true".into());
        let mut refused = result(None, None, None);
        refused.error = Some("connection refused".into());
        let results = vec![
            result(Some(200), Some("d0"), Some("p0")),
            result(Some(200), Some("d0"), Some("p1")),
            result(Some(200), Some("c0"), None),
            routed_error,
            refused,
        ];
        let s = summarize(
            &results,
            1.0,
            2.0,
            0,
            "127.0.0.1:1",
            &GapHistogram::default(),
        );
        assert_eq!((s.requests, s.ok, s.errors), (5, 3, 2));
        assert_eq!(s.offered_rps, 5.0);
        assert_eq!(s.completed_rps, 1.5);
        assert_eq!(s.status.get("200"), Some(&3));
        assert_eq!(s.status.get("none"), Some(&1));
        assert_eq!(s.errors_by.get("503 x-error-routing=true"), Some(&1));
        assert_eq!(s.errors_by.get("no response: connection refused"), Some(&1));
        let rows: Vec<(&str, &str, usize)> = s
            .pods
            .iter()
            .map(|r| (r.role.as_str(), r.pod.as_str(), r.requests))
            .collect();
        assert_eq!(
            rows,
            vec![
                ("decode", "d0", 2),
                ("prefill", "p0", 1),
                ("prefill", "p1", 1),
                ("combined", "c0", 1),
                ("unrouted", "127.0.0.1:1", 2)
            ]
        );
        assert_eq!(s.pods[0].paired_prefill.get("p1"), Some(&1));
        assert_eq!(
            s.tpot_ms.as_ref().map(|d| d.p50),
            Some(1.0),
            "(10 - 5) / (6 - 1)"
        );
        let text = render(&s);
        assert!(text.starts_with(
            "pd-load: 5 requests in 2.0 s (5.0 rps offered, 1.5 rps completed), 2 errors\n"
        ));
        assert!(text.contains("status: 200=3 503=1 none=1"));
        assert!(text.contains("(prefill p0 1, p1 1)"));
        assert!(text.contains("TTFT ms  p50 5.0"));
    }
}
