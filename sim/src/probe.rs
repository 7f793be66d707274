//! What pd-load reads around a run besides the responses: the simulated pods' prefix-cache
//! and prompt-token counters (through pd-sim's admin `/sim/pods` and each pod's `/metrics`),
//! the CPU time of router processes from `/proc/<pid>/stat`, and how busy the whole box was
//! (`/proc/stat`). All are read before and after the run; the report carries the differences.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Counters of one simulated pod, or their increase over a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PodCounters {
    pub pod: String,
    pub role: String,
    pub engine: String,
    /// Prompt tokens looked up in the prefix cache (vLLM `prefix_cache_queries_total`; SGLang
    /// has no such counter, so its `prompt_tokens_total` stands in on non-decode pods).
    pub queried_tokens: f64,
    /// Prompt tokens found cached (vLLM `prefix_cache_hits_total`, SGLang `cached_tokens_total`).
    pub hit_tokens: f64,
    /// Prompt tokens the pod started work on (`prompt_tokens_total`).
    pub prompt_tokens: f64,
}

/// The prefix cache over a run, as pd-sim counts it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PrefixReport {
    pub queried_tokens: f64,
    pub hit_tokens: f64,
    /// `hit_tokens / queried_tokens` over pods that prefill (decode pods pull, not look up).
    pub hit_rate: Option<f64>,
    pub pods: Vec<PodCounters>,
}

/// Router CPU over a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CpuReport {
    pub pids: Vec<u32>,
    /// user + system seconds of all the processes (all threads of each).
    pub seconds: f64,
    pub per_1000_requests: f64,
    /// Microseconds per successful request.
    pub us_per_request: f64,
}

/// CPU the run's own processes do not account for. A router's CPU per request is only
/// comparable with another's when both ran on a quiet box: a second benchmark, a build or a
/// noisy neighbour on the host takes cores from whichever target runs then, and one such run
/// moved a whole sitting's ratios by 2x before anything measured it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OthersReport {
    /// User and system seconds of every process on the box, less the router's, pd-load's own
    /// and the side processes' (the engines and control services the run needs).
    pub seconds: f64,
    /// Seconds the hypervisor ran something else while this box wanted its cores.
    pub steal_seconds: f64,
    /// `seconds + steal_seconds` over the box's capacity during the run (cores × wall time).
    pub share: f64,
    /// `steal_seconds` alone over the same capacity.
    pub steal_share: f64,
}

/// A reading of the box's CPU counters: busy (user, nice, system, irq and softirq) and steal,
/// in clock ticks summed over all cores, and the number of cores. Interrupt time counts as
/// busy because the kernel charges a tick that lands in a softirq to the running process's
/// system time too (a loopback packet is mostly received that way), and to `softirq` in
/// `/proc/stat`: leaving it out made the processes add up to more than the box.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoxTicks {
    pub busy: u64,
    pub steal: u64,
    pub cores: usize,
}

/// The box's counters from the text of `/proc/stat`.
pub fn box_ticks(stat: &str) -> Option<BoxTicks> {
    let mut lines = stat.lines();
    let total = lines.next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = total
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let at = |i: usize| v.get(i).copied().unwrap_or(0);
    let cores = lines
        .take_while(|l| l.starts_with("cpu"))
        .filter(|l| l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .count();
    (v.len() >= 4 && cores > 0).then(|| BoxTicks {
        busy: at(0) + at(1) + at(2) + at(5) + at(6),
        steal: at(7),
        cores,
    })
}

fn clock_hz() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

/// One reading, before or after a run, of everything [`cpu_report`] compares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuReading {
    /// CPU seconds of the router's processes.
    pub router: f64,
    /// CPU seconds of pd-load itself and the side processes; `None` if one is gone.
    pub ours: Option<f64>,
    pub whole: Option<BoxTicks>,
    pub at: std::time::Instant,
}

/// Reads the router's CPU, pd-load's own, the side processes' and the box's counters.
/// `None` when a router process is gone.
pub fn read_cpu(router: &[u32], side: &[u32]) -> Option<CpuReading> {
    let mut sides: Vec<u32> = side
        .iter()
        .copied()
        .filter(|p| !router.contains(p) && *p != std::process::id())
        .collect();
    sides.sort_unstable();
    sides.dedup();
    sides.push(std::process::id());
    Some(CpuReading {
        router: cpu_seconds(router)?,
        ours: cpu_seconds(&sides),
        whole: std::fs::read_to_string("/proc/stat")
            .ok()
            .as_deref()
            .and_then(box_ticks),
        at: std::time::Instant::now(),
    })
}

#[derive(Deserialize)]
struct SimPod {
    name: String,
    role: String,
    engine: String,
    metrics_addr: String,
}

/// The value of a counter `name` (unlabelled or summed over label sets) in Prometheus text.
pub fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let rest = if rest.starts_with('{') {
                &rest[rest.find('}')? + 1..]
            } else if rest.starts_with(' ') {
                rest
            } else {
                return None;
            };
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

/// A pod's counters from its exposition, in its engine's names.
pub fn pod_counters(text: &str, pod: &str, role: &str, engine: &str) -> PodCounters {
    let (queried, hits, prompt) = match engine {
        "sglang" => {
            let prompt = counter(text, "sglang:prompt_tokens_total");
            let queried = if role == "decode" { 0.0 } else { prompt };
            (queried, counter(text, "sglang:cached_tokens_total"), prompt)
        }
        _ => (
            counter(text, "vllm:prefix_cache_queries_total"),
            counter(text, "vllm:prefix_cache_hits_total"),
            counter(text, "vllm:prompt_tokens_total"),
        ),
    };
    PodCounters {
        pod: pod.to_string(),
        role: role.to_string(),
        engine: engine.to_string(),
        queried_tokens: queried,
        hit_tokens: if role == "decode" { 0.0 } else { hits },
        prompt_tokens: prompt,
    }
}

/// Every served pod's counters now. Pods pd-sim serves without metrics are skipped.
pub async fn read_sim(client: &reqwest::Client, admin: &str) -> Result<Vec<PodCounters>, String> {
    let base = admin.trim_end_matches('/');
    let bytes = client
        .get(format!("{base}/sim/pods"))
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|e| format!("pd-sim admin {base}: {e}"))?
        .bytes()
        .await
        .map_err(|e| format!("pd-sim admin {base}/sim/pods: {e}"))?;
    let pods: Vec<SimPod> =
        serde_json::from_slice(&bytes).map_err(|e| format!("pd-sim admin {base}/sim/pods: {e}"))?;
    let mut out = Vec::with_capacity(pods.len());
    for p in pods {
        let url = format!("http://{}/metrics", p.metrics_addr);
        let Ok(resp) = client.get(&url).send().await else {
            continue;
        };
        let Ok(text) = resp.text().await else {
            continue;
        };
        out.push(pod_counters(&text, &p.name, &p.role, &p.engine));
    }
    Ok(out)
}

/// The increase of every pod's counters from `before` to `after`.
pub fn prefix_report(before: &[PodCounters], after: &[PodCounters]) -> PrefixReport {
    let old: BTreeMap<&str, &PodCounters> = before.iter().map(|p| (p.pod.as_str(), p)).collect();
    let mut pods: Vec<PodCounters> = after
        .iter()
        .map(|a| {
            let b = old.get(a.pod.as_str());
            let d = |f: fn(&PodCounters) -> f64| (f(a) - b.map_or(0.0, |b| f(b))).max(0.0);
            PodCounters {
                queried_tokens: d(|p| p.queried_tokens),
                hit_tokens: d(|p| p.hit_tokens),
                prompt_tokens: d(|p| p.prompt_tokens),
                ..a.clone()
            }
        })
        .collect();
    pods.sort_by(|a, b| (&a.role, &a.pod).cmp(&(&b.role, &b.pod)));
    let queried: f64 = pods.iter().map(|p| p.queried_tokens).sum();
    let hits: f64 = pods.iter().map(|p| p.hit_tokens).sum();
    PrefixReport {
        queried_tokens: queried,
        hit_tokens: hits,
        hit_rate: (queried > 0.0).then(|| hits / queried),
        pods,
    }
}

/// utime + stime of a `/proc/<pid>/stat` line, in clock ticks (all threads of the process).
pub fn stat_ticks(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses; fields after its last ')'
    // start at field 3 (state), so utime (14) and stime (15) are the 12th and 13th.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// CPU seconds used so far by `pids` together; `None` if one of them is gone.
pub fn cpu_seconds(pids: &[u32]) -> Option<f64> {
    let hz = clock_hz();
    let mut ticks = 0;
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        ticks += stat_ticks(&stat)?;
    }
    Some(ticks as f64 / hz)
}

/// The CPU report of a run from the readings before and after it.
pub fn cpu_report(
    pids: &[u32],
    before: &CpuReading,
    after: &CpuReading,
    ok_requests: usize,
) -> CpuReport {
    let seconds = (after.router - before.router).max(0.0);
    let n = ok_requests.max(1) as f64;
    CpuReport {
        pids: pids.to_vec(),
        seconds,
        per_1000_requests: seconds * 1000.0 / n,
        us_per_request: seconds * 1e6 / n,
    }
}

/// What the rest of the box did during a run, from the readings before and after it;
/// `None` when `/proc/stat` or a side process could not be read.
pub fn others_report(before: &CpuReading, after: &CpuReading) -> Option<OthersReport> {
    others(before, after, clock_hz())
}

/// What the box did besides the router and the run's own processes.
fn others(before: &CpuReading, after: &CpuReading, hz: f64) -> Option<OthersReport> {
    let (b, a) = (before.whole?, after.whole?);
    let router_seconds = (after.router - before.router).max(0.0);
    let ours = after.ours? - before.ours?;
    let wall = after.at.saturating_duration_since(before.at).as_secs_f64();
    let busy = a.busy.saturating_sub(b.busy) as f64 / hz;
    let steal = a.steal.saturating_sub(b.steal) as f64 / hz;
    let seconds = (busy - router_seconds - ours).max(0.0);
    let capacity = wall * a.cores as f64;
    (capacity > 0.0).then(|| OthersReport {
        seconds,
        steal_seconds: steal,
        share: (seconds + steal) / capacity,
        steal_share: steal / capacity,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = "# HELP vllm:prefix_cache_queries_total x\n# TYPE vllm:prefix_cache_queries_total counter\n\
vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 800.0\n\
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 200.0\n\
vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 900.0\n\
vllm:prompt_tokens_total_extra 5\n";

    #[test]
    fn counters_are_read_by_exact_name() {
        assert_eq!(counter(VLLM, "vllm:prompt_tokens_total"), 900.0);
        assert_eq!(counter("a 1\na{x=\"1\"} 2\nab 7\n", "a"), 3.0);
        assert_eq!(counter("", "a"), 0.0);
        let p = pod_counters(VLLM, "p0", "prefill", "vllm");
        assert_eq!(
            (p.queried_tokens, p.hit_tokens, p.prompt_tokens),
            (800.0, 200.0, 900.0)
        );
        let sg = "sglang:prompt_tokens_total{model_name=\"m\"} 700.0\nsglang:cached_tokens_total{model_name=\"m\"} 70.0\n";
        let s = pod_counters(sg, "p1", "prefill", "sglang");
        assert_eq!((s.queried_tokens, s.hit_tokens), (700.0, 70.0));
        let d = pod_counters(sg, "d1", "decode", "sglang");
        assert_eq!(
            (d.queried_tokens, d.hit_tokens, d.prompt_tokens),
            (0.0, 0.0, 700.0)
        );
    }

    #[test]
    fn report_is_the_increase() {
        let pc = |pod: &str, role: &str, q, h, p| PodCounters {
            pod: pod.into(),
            role: role.into(),
            engine: "vllm".into(),
            queried_tokens: q,
            hit_tokens: h,
            prompt_tokens: p,
        };
        let before = vec![pc("p0", "prefill", 100.0, 10.0, 100.0)];
        let after = vec![
            pc("p0", "prefill", 500.0, 210.0, 500.0),
            pc("d0", "decode", 0.0, 0.0, 400.0),
        ];
        let r = prefix_report(&before, &after);
        assert_eq!((r.queried_tokens, r.hit_tokens), (400.0, 200.0));
        assert_eq!(r.hit_rate, Some(0.5));
        assert_eq!(r.pods[0].pod, "d0");
        assert_eq!(r.pods[1].prompt_tokens, 400.0);
        assert_eq!(prefix_report(&[], &[]).hit_rate, None);
    }

    #[test]
    fn proc_stat_fields() {
        let line =
            "1234 (envoy (main) x) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0 77 0 0";
        assert_eq!(stat_ticks(line), Some(300));
        assert_eq!(stat_ticks("garbage"), None);
        let own = cpu_seconds(&[std::process::id()]);
        assert!(own.is_some_and(|s| s >= 0.0));
        let t0 = std::time::Instant::now();
        let reading = |router, ours, busy, steal, secs| CpuReading {
            router,
            ours,
            whole: Some(BoxTicks {
                busy,
                steal,
                cores: 2,
            }),
            at: t0 + std::time::Duration::from_secs(secs),
        };
        // 10 s on 2 cores: the router used 2 s, pd-load and the pods 3 s, the box 6.5 s in
        // all (100 ticks a second) and the host stole 0.5 s: 1.5 + 0.5 of 20 s are others'.
        let (before, after) = (
            reading(1.0, Some(1.0), 1_000, 100, 0),
            reading(3.0, Some(4.0), 1_650, 150, 10),
        );
        let r = cpu_report(&[1], &before, &after, 4000);
        assert_eq!(
            (r.seconds, r.per_1000_requests, r.us_per_request),
            (2.0, 0.5, 500.0)
        );
        let o = others(&before, &after, 100.0).expect("readings complete");
        assert!((o.seconds - 1.5).abs() < 1e-9, "{o:?}");
        assert!((o.steal_seconds - 0.5).abs() < 1e-9, "{o:?}");
        assert!((o.share - 0.1).abs() < 1e-9, "{o:?}");
        assert!((o.steal_share - 0.025).abs() < 1e-9, "{o:?}");
        // A side process that exited leaves the share unknown rather than wrong.
        let gone = CpuReading {
            ours: None,
            ..after
        };
        assert_eq!(others(&before, &gone, 100.0), None);
        // Processes counted on their own never make the rest negative.
        let quiet = reading(3.0, Some(9.0), 1_650, 100, 10);
        assert_eq!(others(&before, &quiet, 100.0).map(|o| o.share), Some(0.0));
    }

    #[test]
    fn the_box_counters_are_read_from_proc_stat() {
        let stat = "cpu  2589323 7 418733 9065194 13148 0 33033 27478 0 0\n\
cpu0 1155356 0 197110 4686844 3090 0 15892 13929 0 0\n\
cpu1 1433967 7 221623 4378350 10058 0 17141 13549 0 0\n\
intr 28737647 0 0\nctxt 63406449\n";
        assert_eq!(
            box_ticks(stat),
            Some(BoxTicks {
                busy: 2_589_323 + 7 + 418_733 + 33_033,
                steal: 27_478,
                cores: 2
            })
        );
        // Old kernels without the steal column read as no steal.
        assert_eq!(
            box_ticks("cpu  10 0 5 100 3 1 2\ncpu0 10 0 5 100 3 1 2\n").map(|t| (t.busy, t.steal)),
            Some((18, 0))
        );
        assert_eq!(box_ticks("intr 1 2\n"), None);
        assert_eq!(box_ticks("cpu  x y z w\ncpu0 1 1 1 1\n"), None);
        let live = read_cpu(&[std::process::id()], &[]).expect("own process is readable");
        assert!(live.whole.is_some_and(|w| w.cores >= 1));
    }
}
