//! `pd-bench-report`: reads the pd-load results `envoy/bench.sh` leaves in
//! `<dir>/<scenario>/<target>.<rep>.json`, prints the comparison tables (medians over the
//! repetitions, ratios against the best peer) as Markdown, writes them to `<dir>/summary.md`
//! and draws the SVG charts.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::charts;
use crate::dispatch_bound::{self, Arrival, Rule};
use crate::engine::TimingModel;

/// One pd-load result file, reduced to what the tables need.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Run {
    pub e2e_p50: f64,
    pub e2e_p99: f64,
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    pub tpot_p99: f64,
    /// p99 of each stream's longest wait between token reads (NaN for runs before pd-load
    /// measured it).
    pub gap_p99: f64,
    /// p99 of every wait between token reads of every successful stream (`chunk_gap_ms`; NaN
    /// for runs before pd-load measured it, shown as "–").
    pub chunk_p99: f64,
    pub completed_rps: f64,
    pub errors: u64,
    pub requests: u64,
    pub cpu_us_per_request: Option<f64>,
    /// Share of the box's CPU that other processes (and the host, by stealing) took during
    /// the run; runs from before pd-load measured it have none.
    pub others_share: Option<f64>,
    /// The host's part of `others_share`.
    pub steal_share: Option<f64>,
    pub hit_rate: Option<f64>,
    /// Per pod (`role pod`): prompt tokens from pd-sim's counters, else requests by header.
    pub pods: Vec<(String, f64)>,
    pub e2e_ms: Vec<f64>,
    pub ttft_ms: Vec<f64>,
    /// Every request's send time and prompt size, for [`dispatch_bound`].
    pub arrivals: Vec<Arrival>,
    /// The repetition (the `<rep>` of the file name; `envoy/bench.sh` also seeds pd-load's
    /// trace with it), so that two targets' runs on the same trace can be compared in pairs.
    pub rep: u32,
}

fn f(v: &Value, ptr: &str) -> f64 {
    v.pointer(ptr).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

impl Run {
    /// Reads the fields of a pd-load `--json` report.
    pub fn from_json(v: &Value) -> Run {
        let results = v
            .get("results")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let ok = |r: &&Value| {
            r.get("status").and_then(Value::as_u64) == Some(200)
                && r.get("error").is_none_or(Value::is_null)
        };
        let pick = |key: &str| -> Vec<f64> {
            results
                .iter()
                .filter(ok)
                .filter_map(|r| r.get(key).and_then(Value::as_f64))
                .collect()
        };
        let mut pods: Vec<(String, f64)> = v
            .pointer("/prefix/pods")
            .and_then(Value::as_array)
            .map(|pods| {
                pods.iter()
                    .filter_map(|p| {
                        let name = p.get("pod")?.as_str()?;
                        let role = p.get("role")?.as_str()?;
                        let tokens = p.get("prompt_tokens")?.as_f64()?;
                        (role != "decode").then(|| (format!("{role} {name}"), tokens))
                    })
                    .collect()
            })
            .unwrap_or_default();
        if pods.is_empty() {
            pods = v
                .pointer("/summary/pods")
                .and_then(Value::as_array)
                .map(|rows| {
                    rows.iter()
                        .filter_map(|p| {
                            Some((
                                format!("{} {}", p.get("role")?.as_str()?, p.get("pod")?.as_str()?),
                                p.get("requests")?.as_f64()?,
                            ))
                        })
                        .collect()
                })
                .unwrap_or_default();
        }
        Run {
            e2e_p50: f(v, "/summary/e2e_ms/p50"),
            e2e_p99: f(v, "/summary/e2e_ms/p99"),
            ttft_p50: f(v, "/summary/ttft_ms/p50"),
            ttft_p99: f(v, "/summary/ttft_ms/p99"),
            tpot_p99: f(v, "/summary/tpot_ms/p99"),
            gap_p99: f(v, "/summary/max_gap_ms/p99"),
            chunk_p99: f(v, "/summary/chunk_gap_ms/p99"),
            completed_rps: f(v, "/summary/completed_rps"),
            errors: v
                .pointer("/summary/errors")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            requests: v
                .pointer("/summary/requests")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            cpu_us_per_request: v.pointer("/cpu/us_per_request").and_then(Value::as_f64),
            others_share: v.pointer("/others/share").and_then(Value::as_f64),
            steal_share: v.pointer("/others/steal_share").and_then(Value::as_f64),
            hit_rate: v.pointer("/prefix/hit_rate").and_then(Value::as_f64),
            pods,
            e2e_ms: pick("e2e_ms"),
            ttft_ms: pick("ttft_ms"),
            arrivals: results
                .iter()
                .filter_map(|r| {
                    Some(Arrival {
                        at_ms: r.get("start_ms")?.as_f64()?,
                        prompt_tokens: r.get("prompt_tokens")?.as_u64()?,
                    })
                })
                .collect(),
            rep: 0,
        }
    }
}

/// Median of the finite values, `NaN` when there are none.
pub fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Every run of one target in one scenario, with the medians the tables show.
#[derive(Debug, Clone, Default)]
pub struct Cell {
    pub runs: Vec<Run>,
}

impl Run {
    /// Other processes or the host took more than [`SUSPECT_SHARE`] of the box during it.
    pub fn suspect(&self) -> bool {
        self.others_share.is_some_and(|s| s > SUSPECT_SHARE)
    }
}

impl Cell {
    /// The runs the medians read: the clean ones, or every run when none is clean (the
    /// report names the suspect ones either way).
    fn counted(&self) -> impl Iterator<Item = &Run> {
        let any_clean = self.runs.iter().any(|r| !r.suspect());
        self.runs.iter().filter(move |r| !any_clean || !r.suspect())
    }
    pub fn med(&self, f: impl Fn(&Run) -> f64) -> f64 {
        median(self.counted().map(f))
    }
    pub fn med_opt(&self, f: impl Fn(&Run) -> Option<f64>) -> f64 {
        median(self.counted().filter_map(f))
    }
    pub fn errors(&self) -> u64 {
        self.runs.iter().map(|r| r.errors).sum()
    }
    pub fn requests(&self) -> u64 {
        self.runs.iter().map(|r| r.requests).sum()
    }
}

/// scenario → target → cell.
pub type Results = BTreeMap<String, BTreeMap<String, Cell>>;

/// Loads `<dir>/<scenario>/<target>.<rep>.json`.
pub fn load(dir: &Path) -> Result<Results, String> {
    let mut out: Results = BTreeMap::new();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for scenario in entries.flatten() {
        let path = scenario.path();
        if !path.is_dir() {
            continue;
        }
        let name = scenario.file_name().to_string_lossy().into_owned();
        let Ok(files) = std::fs::read_dir(&path) else {
            continue;
        };
        for file in files.flatten() {
            let fname = file.file_name().to_string_lossy().into_owned();
            let Some(stem) = fname.strip_suffix(".json") else {
                continue;
            };
            let (target, rep) = stem
                .rsplit_once('.')
                .map_or((stem, 0), |(t, r)| (t, r.parse().unwrap_or(0)));
            let target = target.to_string();
            let Ok(text) = std::fs::read_to_string(file.path()) else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<Value>(&text) else {
                continue;
            };
            out.entry(name.clone())
                .or_default()
                .entry(target)
                .or_default()
                .runs
                .push(Run {
                    rep,
                    ..Run::from_json(&v)
                });
        }
    }
    Ok(out)
}

/// Targets in the order the tables list them.
const OVERHEAD_ORDER: [&str; 10] = [
    "direct",
    "envoy-plain",
    "pd-floor-1p1d",
    "pd-router-1p1d",
    "pd-router-1p1d-lr",
    "pd-router-4p4d",
    "pd-floor-1p1d-sglang",
    "pd-router-1p1d-sglang",
    "sglang-router",
    "vllm-router",
];
const PEERS: [&str; 2] = ["sglang-router", "vllm-router"];

fn num(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:.digits$}")
    } else {
        "–".into()
    }
}

/// A difference with its sign always written: `+20`, `-0.191` (never `+-0.191`).
fn signed(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:+.digits$}")
    } else {
        num(v, digits)
    }
}

fn ordered(cells: &BTreeMap<String, Cell>) -> Vec<(&str, &Cell)> {
    let mut v: Vec<(&str, &Cell)> = OVERHEAD_ORDER
        .iter()
        .filter_map(|t| cells.get_key_value(*t).map(|(k, c)| (k.as_str(), c)))
        .collect();
    for (k, c) in cells {
        if !OVERHEAD_ORDER.contains(&k.as_str()) {
            v.push((k.as_str(), c));
        }
    }
    v
}

/// The lowest (or highest, for throughput) peer figure.
fn best_peer(cells: &BTreeMap<String, Cell>, f: impl Fn(&Cell) -> f64, lowest: bool) -> f64 {
    let vals = PEERS
        .iter()
        .filter_map(|p| cells.get(*p))
        .map(f)
        .filter(|v| v.is_finite());
    if lowest {
        vals.fold(f64::NAN, |a, b| if a.is_nan() { b } else { a.min(b) })
    } else {
        vals.fold(f64::NAN, |a, b| if a.is_nan() { b } else { a.max(b) })
    }
}

/// Share of the box's CPU that strangers may take during a run before its figures are called
/// suspect. In a quiet sitting on this VM one run in a hundred passes it (the host's steal;
/// the bench's own idle servers stay near 0); a second benchmark or a build takes a third of
/// the box or more, and a run at 11 % of steal cost pd-router 475 µs per request against
/// 264 in the clean round before it.
pub const SUSPECT_SHARE: f64 = 0.10;

/// The runs of a scenario during which other processes took more than [`SUSPECT_SHARE`] of
/// the box, as a paragraph naming each (empty when there are none): their figures, and every
/// ratio drawn from them, measure the box's contention as much as the target.
fn suspect_runs(cells: &BTreeMap<String, Cell>) -> String {
    let mut named = Vec::new();
    for (t, c) in cells {
        for r in c.runs.iter().filter(|r| r.suspect()) {
            let share = r.others_share.unwrap_or(0.0);
            let steal = r.steal_share.unwrap_or(0.0);
            named.push(format!(
                "{t} #{} ({:.0} %: other processes {:.0} %, the host {:.0} %)",
                r.rep,
                share * 100.0,
                (share - steal).max(0.0) * 100.0,
                steal * 100.0
            ));
        }
    }
    if named.is_empty() {
        return String::new();
    }
    format!(
        "\n**Suspect runs**: other processes or the host took more than {:.0} % of the box's \
         CPU during {}. The medians above leave them out where the same target has a clean \
         run; rerun the others on a quiet box before reading their figures.\n",
        SUSPECT_SHARE * 100.0,
        named.join(", ")
    )
}

/// How many runs of all `results` are suspect (see [`suspect_runs`]).
pub fn suspect_count(results: &Results) -> usize {
    results
        .values()
        .flat_map(BTreeMap::values)
        .flat_map(|c| &c.runs)
        .filter(|r| r.suspect())
        .count()
}

/// The overhead tables (latency, throughput, CPU) and ratios against the best peer.
pub fn overhead_tables(results: &Results) -> String {
    let mut out = String::new();
    for (scenario, cells) in results.iter().filter(|(s, _)| !s.starts_with("policy")) {
        let direct_p50 = cells
            .get("direct")
            .map_or(f64::NAN, |c| c.med(|r| r.e2e_p50));
        let stream = scenario.starts_with("stream");
        let _ = writeln!(out, "\n#### {scenario}\n");
        if stream {
            let _ = writeln!(out, "| target | TTFT p50 ms | TTFT p99 ms | TPOT p99 ms | longest gap p99 ms | chunk gap p99 ms | E2E p50 ms | E2E p99 ms | rps | CPU µs/req | errors |");
            let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|");
        } else {
            let _ = writeln!(
                out,
                "| target | E2E p50 ms | added p50 ms | E2E p99 ms | rps | CPU µs/req | errors |"
            );
            let _ = writeln!(out, "|---|---|---|---|---|---|---|");
        }
        for (t, c) in ordered(cells) {
            let cpu = c.med_opt(|r| r.cpu_us_per_request);
            let errors = format!("{}/{}", c.errors(), c.requests());
            if stream {
                let _ = writeln!(
                    out,
                    "| {t} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {errors} |",
                    num(c.med(|r| r.ttft_p50), 2),
                    num(c.med(|r| r.ttft_p99), 2),
                    num(c.med(|r| r.tpot_p99), 3),
                    num(c.med(|r| r.gap_p99), 2),
                    num(c.med(|r| r.chunk_p99), 3),
                    num(c.med(|r| r.e2e_p50), 2),
                    num(c.med(|r| r.e2e_p99), 2),
                    num(c.med(|r| r.completed_rps), 0),
                    num(cpu, 0),
                );
            } else {
                let p50 = c.med(|r| r.e2e_p50);
                let _ = writeln!(
                    out,
                    "| {t} | {} | {} | {} | {} | {} | {errors} |",
                    num(p50, 3),
                    num(p50 - direct_p50, 3),
                    num(c.med(|r| r.e2e_p99), 3),
                    num(c.med(|r| r.completed_rps), 0),
                    num(cpu, 0),
                );
            }
        }
        out.push_str(&suspect_runs(cells));
        let ours = cells.get("pd-router-1p1d");
        if let Some(ours) = ours {
            let ratio = |a: f64, b: f64| num(a / b, 2);
            let peer_cpu = best_peer(cells, |c| c.med_opt(|r| r.cpu_us_per_request), true);
            let peer_rps = best_peer(cells, |c| c.med(|r| r.completed_rps), false);
            let peer_add = best_peer(cells, |c| c.med(|r| r.e2e_p50) - direct_p50, true);
            let peer_p99 = best_peer(cells, |c| c.med(|r| r.e2e_p99), true);
            let _ = writeln!(
                out,
                "\npd-router 1P1D ÷ best peer: CPU per request {}, throughput {}, added p50 {}, p99 {}",
                ratio(ours.med_opt(|r| r.cpu_us_per_request), peer_cpu),
                ratio(ours.med(|r| r.completed_rps), peer_rps),
                ratio(ours.med(|r| r.e2e_p50) - direct_p50, peer_add),
                ratio(ours.med(|r| r.e2e_p99), peer_p99),
            );
        }
        // Each protocol against the peer speaking it: vLLM waits for the prefill answer before
        // the decode leg, SGLang sends both legs at once, so their latencies differ by design.
        for (ours, peer) in [
            ("pd-router-1p1d", "vllm-router"),
            ("pd-router-1p1d-sglang", "sglang-router"),
        ] {
            let (Some(o), Some(p)) = (cells.get(ours), cells.get(peer)) else {
                continue;
            };
            let ratio = |f: &dyn Fn(&Cell) -> f64| num(f(o) / f(p), 2);
            let _ = writeln!(
                out,
                "
{ours} ÷ {peer} (same protocol): CPU per request {}, throughput {}, added p50 {}, p99 {}",
                ratio(&|c: &Cell| c.med_opt(|r| r.cpu_us_per_request)),
                ratio(&|c: &Cell| c.med(|r| r.completed_rps)),
                ratio(&|c: &Cell| c.med(|r| r.e2e_p50) - direct_p50),
                ratio(&|c: &Cell| c.med(|r| r.e2e_p99)),
            );
        }
        // A floor filter does a PD hop with no routing work: what is left above it is ours,
        // what it costs itself is the architecture's (a wasm VM and a second exchange). The
        // SGLang floor is held against the peer speaking SGLang, the vLLM one against the best.
        let cpu = |c: &Cell| c.med_opt(|r| r.cpu_us_per_request);
        let added = |c: &Cell| c.med(|r| r.e2e_p50) - direct_p50;
        for (ours, floor, peer) in [
            ("pd-router-1p1d", "pd-floor-1p1d", None),
            (
                "pd-router-1p1d-sglang",
                "pd-floor-1p1d-sglang",
                Some("sglang-router"),
            ),
        ] {
            let (Some(o), Some(f)) = (cells.get(ours), cells.get(floor)) else {
                continue;
            };
            let (label, peer_cpu, peer_added) = match peer.and_then(|p| cells.get_key_value(p)) {
                Some((p, c)) => (format!("{p}'s"), cpu(c), added(c)),
                None => (
                    "the best peer's".to_string(),
                    best_peer(cells, cpu, true),
                    best_peer(cells, added, true),
                ),
            };
            let _ = writeln!(
                out,
                "\n{ours} over the PD-hop floor ({floor}): CPU per request {} µs, \
                 throughput {}, added p50 {} ms; the floor's CPU per request is {} of {label}, \
                 its added p50 {}",
                signed(cpu(o) - cpu(f), 0),
                num(o.med(|r| r.completed_rps) / f.med(|r| r.completed_rps), 2),
                signed(o.med(|r| r.e2e_p50) - f.med(|r| r.e2e_p50), 3),
                num(cpu(f) / peer_cpu, 2),
                num(added(f) / peer_added, 2),
            );
        }
    }
    out
}

/// The idealised prefill side the token_load target is measured against
/// ([`dispatch_bound`]): as many FIFO lanes as the policy fleet has prefill pods, pd-sim's
/// default prefill timing (the policy bench's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bound {
    pub prefill_pods: usize,
    /// token_load's `AIBRIX_TOKEN_LOAD_REQUEST_COST` in the runs.
    pub request_cost: f64,
}

impl Default for Bound {
    /// envoy/bench.sh's policy fleet (4 rolesets) and the contract's default request cost.
    fn default() -> Self {
        Bound {
            prefill_pods: 4,
            request_cost: 3500.0,
        }
    }
}

/// What a better prefill load estimate could reach at best on `baseline`'s traces: each run's
/// arrivals replayed into [`Bound`]'s idealised pods at the run's hit rate, least work left
/// (an oracle) and token_load's charge over least_request's request counting, run by run.
fn bound_line(cells: &BTreeMap<String, Cell>, baseline: &str, bound: Bound) -> String {
    let Some(cell) = cells.get(baseline) else {
        return String::new();
    };
    let mut oracle = Vec::new();
    let mut charge = Vec::new();
    for run in cell.runs.iter().filter(|r| !r.arrivals.is_empty()) {
        let model = dispatch_bound::Model {
            pods: bound.prefill_pods,
            timing: TimingModel::default(),
            hit_rate: run.hit_rate.unwrap_or(0.0),
        };
        oracle.push(dispatch_bound::p99_ratio_to_fewest(
            &run.arrivals,
            &model,
            Rule::LeastWorkLeft,
        ));
        charge.push(dispatch_bound::p99_ratio_to_fewest(
            &run.arrivals,
            &model,
            Rule::TokenCharge {
                request_cost: bound.request_cost,
            },
        ));
    }
    if oracle.is_empty() {
        return String::new();
    }
    let each = |v: &[f64]| listed(v.iter().copied(), |r| num(r, 2));
    format!(
        "\nThe same traces in idealised prefill pods ({} FIFO lanes, pd-sim's prefill timing, \
         each run's hit rate on every request; `sim/src/dispatch_bound.rs`), prefill end p99 \
         over least_request's request counting: least work left, an oracle that sends each \
         request where it starts soonest, {} ({}); token_load's charge at request cost {} {} ({})\n",
        bound.prefill_pods,
        num(median(oracle.iter().copied()), 2),
        each(&oracle),
        bound.request_cost,
        num(median(charge.iter().copied()), 2),
        each(&charge),
    )
}

/// Policy-quality tables, one per load, plus the two comparisons the issue sets targets for.
pub fn policy_tables(results: &Results, bound: Bound) -> String {
    let mut out = String::new();
    for (scenario, cells) in results.iter().filter(|(s, _)| s.starts_with("policy")) {
        let _ = writeln!(out, "\n#### {scenario}\n");
        let _ = writeln!(out, "| prefill + decode policy | TTFT p50 ms | TTFT p99 ms | longest gap p99 ms | chunk gap p99 ms | E2E p99 ms | rps | hit rate | errors |");
        let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|");
        for (t, c) in cells {
            let _ = writeln!(
                out,
                "| {t} | {} | {} | {} | {} | {} | {} | {} | {}/{} |",
                num(c.med(|r| r.ttft_p50), 1),
                num(c.med(|r| r.ttft_p99), 1),
                num(c.med(|r| r.gap_p99), 1),
                num(c.med(|r| r.chunk_p99), 2),
                num(c.med(|r| r.e2e_p99), 1),
                num(c.med(|r| r.completed_rps), 1),
                num(c.med_opt(|r| r.hit_rate) * 100.0, 1) + " %",
                c.errors(),
                c.requests(),
            );
        }
        out.push_str(&suspect_runs(cells));
        let p99 = |t: &str| cells.get(t).map_or(f64::NAN, |c| c.med(|r| r.ttft_p99));
        let hit = |t: &str| cells.get(t).map_or(f64::NAN, |c| c.med_opt(|r| r.hit_rate));
        // The pair the targets are read from: token_load against least_request, each on both
        // sides; then token_load as the prefill policy alone, under each decode policy.
        let (both_tl, both_lr) = ("token_load+token_load", "least_request+least_request");
        if cells.contains_key(both_tl) && cells.contains_key(both_lr) {
            let _ = writeln!(
                out,
                "\ntoken_load on both sides ({both_tl}) ÷ least_request on both sides ({both_lr}) TTFT p99: {} (target ≤ 0.7 at 90 %){}",
                num(p99(both_tl) / p99(both_lr), 2),
                paired_ratios(cells, both_tl, both_lr, 0.7)
            );
            out.push_str(&bound_line(cells, both_lr, bound));
        }
        for decode in ["least_request", "load_balancing", "token_load"] {
            let (tl, lr) = (
                format!("token_load+{decode}"),
                format!("least_request+{decode}"),
            );
            if cells.contains_key(&tl) && cells.contains_key(&lr) {
                let _ = writeln!(
                    out,
                    "\n{tl} ÷ {lr} TTFT p99: {} (target ≤ 0.7 at 90 %){}",
                    num(p99(&tl) / p99(&lr), 2),
                    paired_ratios(cells, &tl, &lr, 0.7)
                );
            }
        }
        for decode in ["load_balancing", "least_request"] {
            let (h, p) = (
                format!("hybrid_cache_load+{decode}"),
                format!("prefix_cache+{decode}"),
            );
            if cells.contains_key(&h) && cells.contains_key(&p) {
                let _ = writeln!(
                    out,
                    "\n{h} ÷ {p} TTFT p99: {} at hit rate {} vs {} (target ≤ 1 at equal or better hit rate){}",
                    num(p99(&h) / p99(&p), 2),
                    num(hit(&h) * 100.0, 1) + " %",
                    num(hit(&p) * 100.0, 1) + " %",
                    paired_hybrid(cells, &h, &p),
                );
            }
        }
    }
    out
}

/// `values`, each as `write` spells it, comma-separated.
fn listed(values: impl Iterator<Item = f64>, write: impl Fn(f64) -> String) -> String {
    values.map(write).collect::<Vec<_>>().join(", ")
}

/// The runs of `a` and `b` made on the same trace (same repetition), in repetition order.
fn pairs<'c>(cells: &'c BTreeMap<String, Cell>, a: &str, b: &str) -> Vec<(&'c Run, &'c Run)> {
    let (Some(a), Some(b)) = (cells.get(a), cells.get(b)) else {
        return Vec::new();
    };
    let mut out: Vec<(&Run, &Run)> = a
        .runs
        .iter()
        .filter_map(|ra| Some((ra, b.runs.iter().find(|rb| rb.rep == ra.rep)?)))
        .collect();
    out.sort_by_key(|(ra, _)| ra.rep);
    out
}

/// With several repetitions, `a`'s TTFT p99 over `b`'s run by run: one sitting's ratio of
/// medians hides how often the target holds, and tail latencies of 15 s runs spread widely.
fn paired_ratios(cells: &BTreeMap<String, Cell>, a: &str, b: &str, target: f64) -> String {
    let pairs = pairs(cells, a, b);
    if pairs.len() < 2 {
        return String::new();
    }
    let ratios: Vec<f64> = pairs
        .iter()
        .map(|(ra, rb)| ra.ttft_p99 / rb.ttft_p99)
        .collect();
    let met = ratios.iter().filter(|r| **r <= target).count();
    format!(
        "; run by run on the same trace: {} (median {}, met in {met} of {})",
        listed(ratios.iter().copied(), |r| num(r, 2)),
        num(median(ratios.iter().copied()), 2),
        ratios.len(),
    )
}

/// The hybrid target run by run: the TTFT p99 ratio and the hit-rate difference in points,
/// and how many runs meet both (ratio ≤ 1 at an equal or better hit rate).
fn paired_hybrid(cells: &BTreeMap<String, Cell>, h: &str, p: &str) -> String {
    let pairs = pairs(cells, h, p);
    if pairs.len() < 2 {
        return String::new();
    }
    let rows: Vec<(f64, f64)> = pairs
        .iter()
        .map(|(rh, rp)| {
            let gap = (rh.hit_rate.unwrap_or(f64::NAN) - rp.hit_rate.unwrap_or(f64::NAN)) * 100.0;
            (rh.ttft_p99 / rp.ttft_p99, gap)
        })
        .collect();
    let met = rows
        .iter()
        .filter(|(r, gap)| *r <= 1.0 && *gap >= 0.0)
        .count();
    format!(
        "; run by run on the same trace: p99 ratio {} (median {}), hit-rate difference {} points (median {}); both met in {met} of {}",
        listed(rows.iter().map(|(r, _)| *r), |r| num(r, 2)),
        num(median(rows.iter().map(|(r, _)| *r)), 2),
        listed(rows.iter().map(|(_, g)| *g), |g| signed(g, 1)),
        signed(median(rows.iter().map(|(_, g)| *g)), 1),
        rows.len(),
    )
}

/// Draws every chart into `dir`; returns the files written and the failures.
pub fn draw(results: &Results, dir: &Path) -> (Vec<PathBuf>, Vec<String>) {
    let mut written = Vec::new();
    let mut failed = Vec::new();
    let mut keep = |path: PathBuf, r: charts::ChartResult| match r {
        Ok(()) => written.push(path),
        Err(e) => failed.push(format!("{}: {e}", path.display())),
    };
    for (scenario, cells) in results {
        let policy = scenario.starts_with("policy");
        let stream = scenario.starts_with("stream") || policy;
        let series: Vec<(String, Vec<f64>)> = ordered(cells)
            .into_iter()
            .filter(|(t, _)| !policy || chart_policy_target(t))
            .map(|(t, c)| {
                let v = c
                    .runs
                    .iter()
                    .flat_map(|r| {
                        if stream {
                            r.ttft_ms.clone()
                        } else {
                            r.e2e_ms.clone()
                        }
                    })
                    .collect();
                (t.to_string(), v)
            })
            .collect();
        let what = if stream { "TTFT" } else { "E2E latency" };
        let path = dir.join(format!("{scenario}-cdf.svg"));
        keep(
            path.clone(),
            charts::latency_cdf(&path, &format!("{scenario}: {what} CDF"), &series),
        );
        if scenario.starts_with("max") {
            let rows: Vec<(String, f64)> = ordered(cells)
                .into_iter()
                .map(|(t, c)| (t.to_string(), c.med_opt(|r| r.cpu_us_per_request)))
                .filter(|(_, v)| v.is_finite())
                .collect();
            let path = dir.join(format!("{scenario}-cpu.svg"));
            keep(
                path.clone(),
                charts::bars(
                    &path,
                    &format!("{scenario}: router CPU per request"),
                    "CPU µs per request (all threads)",
                    &rows,
                ),
            );
            let rows: Vec<(String, f64)> = ordered(cells)
                .into_iter()
                .map(|(t, c)| (t.to_string(), c.med(|r| r.completed_rps)))
                .collect();
            let path = dir.join(format!("{scenario}-rps.svg"));
            keep(
                path.clone(),
                charts::bars(
                    &path,
                    &format!("{scenario}: throughput"),
                    "requests per second",
                    &rows,
                ),
            );
        }
        if policy {
            for (t, c) in cells.iter().filter(|(t, _)| chart_policy_target(t)) {
                let Some(run) = c.runs.first() else { continue };
                let path = dir.join(format!("{scenario}-pods-{t}.svg"));
                keep(
                    path.clone(),
                    charts::bars(
                        &path,
                        &format!("{scenario} {t}: prompt tokens per prefill/combined pod"),
                        "prompt tokens (pd-sim counters)",
                        &run.pods,
                    ),
                );
            }
        }
    }
    (written, failed)
}

/// The policy targets drawn (all pairs would make unreadable charts).
fn chart_policy_target(t: &str) -> bool {
    matches!(
        t,
        "prefix_cache+load_balancing"
            | "least_request+least_request"
            | "token_load+least_request"
            | "token_load+token_load"
            | "hybrid_cache_load+load_balancing"
            | "sglang-cache_aware"
            | "vllm-router"
            | "pd-router"
    )
}

/// `pd-bench-report`'s command line.
#[derive(Debug, clap::Parser)]
#[command(
    name = "pd-bench-report",
    about = "Tables and SVG charts of make bench results"
)]
pub struct ReportArgs {
    /// Directory holding `<scenario>/<target>.<rep>.json`.
    #[arg(long, default_value = "target/bench")]
    pub dir: PathBuf,
    /// Where to draw the charts (default: --dir).
    #[arg(long)]
    pub charts: Option<PathBuf>,
    /// Prefill pods of the policy fleet, for the idealised dispatch bound.
    #[arg(long, default_value_t = Bound::default().prefill_pods)]
    pub bound_prefill_pods: usize,
    /// `AIBRIX_TOKEN_LOAD_REQUEST_COST` of the runs, for the bound's token charge.
    #[arg(long, default_value_t = Bound::default().request_cost)]
    pub bound_request_cost: f64,
}

/// `pd-bench-report`'s main.
pub fn report_main() -> std::process::ExitCode {
    use clap::Parser as _;
    let args = ReportArgs::parse();
    let results = match load(&args.dir) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pd-bench-report: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let suspect = match suspect_count(&results) {
        0 => String::new(),
        n => format!("; **{n} suspect runs**, named under their tables"),
    };
    let mut text = format!(
        "### Results ({} scenarios; load average at report time: {}{suspect})\n",
        results.len(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    text.push_str(&overhead_tables(&results));
    let bound = Bound {
        prefill_pods: args.bound_prefill_pods,
        request_cost: args.bound_request_cost,
    };
    text.push_str(&policy_tables(&results, bound));
    print!("{text}");
    if let Err(e) = std::fs::write(args.dir.join("summary.md"), &text) {
        eprintln!("pd-bench-report: cannot write summary.md: {e}");
    }
    let charts_dir = args.charts.unwrap_or(args.dir);
    let (written, failed) = draw(&results, &charts_dir);
    println!(
        "\ncharts: {} written to {}",
        written.len(),
        charts_dir.display()
    );
    for f in &failed {
        eprintln!("pd-bench-report: chart not drawn: {f}");
    }
    std::process::ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn report(p50: f64, cpu: f64, rps: f64) -> Value {
        json!({"summary": {"e2e_ms": {"p50": p50, "p99": p50 * 2.0}, "ttft_ms": {"p50": p50, "p99": p50},
                           "completed_rps": rps, "errors": 0, "requests": 10,
                           "pods": [{"role": "unrouted", "pod": "x", "requests": 10}]},
               "cpu": {"us_per_request": cpu},
               "results": [{"status": 200, "e2e_ms": p50, "ttft_ms": p50, "error": null},
                           {"status": 503, "e2e_ms": 99.0, "error": "x"}]})
    }

    #[test]
    fn runs_read_the_report_and_medians_skip_gaps() {
        let r = Run::from_json(&report(1.0, 50.0, 900.0));
        assert_eq!((r.e2e_p50, r.e2e_p99, r.completed_rps), (1.0, 2.0, 900.0));
        assert_eq!(r.cpu_us_per_request, Some(50.0));
        assert_eq!(r.e2e_ms, vec![1.0], "failed requests left out");
        assert_eq!(r.pods, vec![("unrouted x".to_string(), 10.0)]);
        assert_eq!(median([3.0, f64::NAN, 1.0, 2.0]), 2.0);
        assert_eq!(median([4.0, 1.0]), 2.5);
        assert!(median([]).is_nan());
    }

    #[test]
    fn tables_compare_with_the_best_peer() {
        let mut results: Results = BTreeMap::new();
        let s = results.entry("max-2k".into()).or_default();
        for (t, p50, cpu, rps) in [
            ("direct", 0.5, f64::NAN, 2000.0),
            ("pd-router-1p1d", 1.0, 50.0, 1800.0),
            ("pd-floor-1p1d", 0.75, 30.0, 2400.0),
            ("pd-router-1p1d-sglang", 0.9, 60.0, 1500.0),
            ("pd-floor-1p1d-sglang", 0.7, 45.0, 2000.0),
            ("sglang-router", 1.5, 150.0, 900.0),
            ("vllm-router", 1.7, 100.0, 800.0),
        ] {
            let mut v = report(p50, cpu, rps);
            if cpu.is_nan() {
                v["cpu"] = Value::Null;
            }
            s.entry(t.into()).or_default().runs.push(Run::from_json(&v));
        }
        let text = overhead_tables(&results);
        assert!(
            text.contains("| pd-router-1p1d | 1.000 | 0.500 | 2.000 | 1800 | 50 | 0/10 |"),
            "{text}"
        );
        // CPU 50 / 100, rps 1800 / 900, added 0.5 / 1.0, p99 2.0 / 3.0
        assert!(
            text.contains("CPU per request 0.50, throughput 2.00, added p50 0.50, p99 0.67"),
            "{text}"
        );
        assert!(text.find("| direct").unwrap() < text.find("| envoy").unwrap_or(usize::MAX));
        // 50 - 30 µs, 1800 / 2400 rps, 1.0 - 0.75 ms, 30 / 100 µs, 0.25 / 1.0 ms
        assert!(
            text.contains("pd-router-1p1d over the PD-hop floor (pd-floor-1p1d): CPU per request +20 µs, throughput 0.75, added p50 +0.250 ms; the floor's CPU per request is 0.30 of the best peer's, its added p50 0.25"),
            "{text}"
        );
        // The SGLang floor against sglang-router, not the best peer: 45 / 150 µs, 0.2 / 1.0 ms
        assert!(
            text.contains("pd-router-1p1d-sglang over the PD-hop floor (pd-floor-1p1d-sglang): CPU per request +15 µs, throughput 0.75, added p50 +0.200 ms; the floor's CPU per request is 0.30 of sglang-router's, its added p50 0.20"),
            "{text}"
        );
        assert!(text.find("| pd-floor-1p1d |").unwrap() < text.find("| pd-router-1p1d |").unwrap());
        assert!(
            text.find("| pd-floor-1p1d-sglang").unwrap()
                < text.find("| pd-router-1p1d-sglang").unwrap()
        );
    }

    #[test]
    fn runs_on_a_busy_box_are_named_as_suspect() {
        let mut results: Results = BTreeMap::new();
        let s = results.entry("max-2k".into()).or_default();
        for (t, rep, share) in [
            ("sglang-router", 1, Some(0.46)),
            ("sglang-router", 2, Some(0.02)),
            ("vllm-router", 1, Some(0.10)),
            ("pd-router-1p1d", 1, None),
        ] {
            let mut v = report(1.0, 50.0, 900.0);
            if let Some(share) = share {
                v["others"] = json!({"seconds": 1.0, "steal_seconds": 0.5, "share": share, "steal_share": 0.06});
            }
            let run = Run::from_json(&v);
            assert_eq!(run.others_share, share);
            s.entry(t.into()).or_default().runs.push(Run { rep, ..run });
        }
        let text = overhead_tables(&results);
        assert!(
            text.contains("**Suspect runs**: other processes or the host took more than 10 % of the box's CPU during sglang-router #1 (46 %: other processes 40 %, the host 6 %). The medians"),
            "{text}"
        );
        assert!(
            !text.contains("vllm-router #1"),
            "at the threshold is not above it: {text}"
        );
        assert_eq!(suspect_count(&results), 1);
        // sglang-router's medians read its clean run only (both runs are alike here, so
        // give the suspect one another figure and read it back).
        let cell = &results["max-2k"]["sglang-router"];
        let mut runs = cell.runs.clone();
        runs[0].completed_rps = 100.0;
        let mixed = Cell { runs };
        assert_eq!(mixed.med(|r| r.completed_rps), 900.0);
        let all_suspect = Cell {
            runs: vec![mixed.runs[0].clone()],
        };
        assert_eq!(all_suspect.med(|r| r.completed_rps), 100.0);
        // Below the table, before the ratios drawn from it.
        assert!(text.find("| vllm-router").unwrap() < text.find("Suspect").unwrap());
        let quiet: Results = BTreeMap::from([(
            "policy-90".to_string(),
            BTreeMap::from([("a+b".to_string(), Cell::default())]),
        )]);
        assert!(!policy_tables(&quiet, Bound::default()).contains("Suspect"));
    }

    /// A policy run with this TTFT p99, hit rate and repetition.
    fn policy_run(p99: f64, hit: f64, rep: u32) -> Run {
        let mut v = report(10.0, 1.0, 50.0);
        v["summary"]["ttft_ms"]["p99"] = json!(p99);
        v["prefix"] = json!({"hit_rate": hit, "pods": []});
        Run {
            rep,
            ..Run::from_json(&v)
        }
    }

    #[test]
    fn policy_tables_state_the_targets() {
        let mut results: Results = BTreeMap::new();
        let s = results.entry("policy-90".into()).or_default();
        for (t, p99) in [
            ("token_load+least_request", 70.0),
            ("least_request+least_request", 200.0),
            ("token_load+token_load", 50.0),
        ] {
            s.entry(t.into())
                .or_default()
                .runs
                .push(policy_run(p99, 0.25, 0));
        }
        let text = policy_tables(&results, Bound::default());
        assert!(
            text.contains("token_load+least_request ÷ least_request+least_request TTFT p99: 0.35"),
            "{text}"
        );
        assert!(
            text.contains("token_load on both sides (token_load+token_load) ÷ least_request on both sides (least_request+least_request) TTFT p99: 0.25"),
            "{text}"
        );
        assert!(text.contains("| 25.0 % |"), "{text}");
    }

    #[test]
    fn the_token_load_target_comes_with_the_idealised_bound_of_its_baseline_traces() {
        let mut results: Results = BTreeMap::new();
        let s = results.entry("policy-90".into()).or_default();
        s.entry("token_load+token_load".into())
            .or_default()
            .runs
            .push(policy_run(50.0, 0.0, 1));
        // Without the requests' arrivals (an older report) there is no bound to give.
        s.entry("least_request+least_request".into())
            .or_default()
            .runs
            .push(policy_run(100.0, 0.0, 1));
        assert!(!policy_tables(&results, Bound::default()).contains("idealised"));
        // Two pods: a long prompt, then short ones that counting queues behind it.
        let mut v = report(10.0, 1.0, 50.0);
        v["prefix"] = json!({"hit_rate": 0.0, "pods": []});
        v["results"] = json!([
            {"start_ms": 0.0, "prompt_tokens": 10000, "status": 200},
            {"start_ms": 0.1, "prompt_tokens": 100, "status": 200},
            {"start_ms": 0.15, "prompt_tokens": 100, "status": 200},
            {"start_ms": 0.2, "prompt_tokens": 100, "status": 200},
        ]);
        let run = Run::from_json(&v);
        assert_eq!(run.arrivals.len(), 4);
        let s = results.get_mut("policy-90").unwrap();
        s.get_mut("least_request+least_request").unwrap().runs = vec![Run { rep: 1, ..run }];
        let bound = Bound {
            prefill_pods: 2,
            request_cost: 1e9,
        };
        let text = policy_tables(&results, bound);
        // Counting sends the third request behind the long prompt (205.85 ms), the oracle
        // never does (worst: the long prompt itself, 202 ms); a request cost that dwarfs every
        // prompt counts requests and sends the fourth there instead (205.8 ms).
        assert!(
            text.contains(
                "least work left, an oracle that sends each request where it starts soonest, 0.98 (0.98)"
            ),
            "{text}"
        );
        assert!(
            text.contains("token_load's charge at request cost 1000000000 1.00 (1.00)"),
            "{text}"
        );
    }

    #[test]
    fn repeated_policy_runs_are_compared_on_the_same_trace() {
        let mut results: Results = BTreeMap::new();
        let s = results.entry("policy-90".into()).or_default();
        // (target, rep, TTFT p99, hit rate): rep 3 of token_load has no partner.
        for (t, rep, p99, hit) in [
            ("token_load+token_load", 1, 60.0, 0.3),
            ("token_load+token_load", 2, 90.0, 0.3),
            ("token_load+token_load", 3, 10.0, 0.3),
            ("least_request+least_request", 1, 100.0, 0.3),
            ("least_request+least_request", 2, 100.0, 0.3),
            ("hybrid_cache_load+load_balancing", 1, 90.0, 0.34),
            ("hybrid_cache_load+load_balancing", 2, 110.0, 0.36),
            ("prefix_cache+load_balancing", 2, 100.0, 0.35),
            ("prefix_cache+load_balancing", 1, 100.0, 0.35),
        ] {
            s.entry(t.into())
                .or_default()
                .runs
                .push(policy_run(p99, hit, rep));
        }
        let text = policy_tables(&results, Bound::default());
        assert!(
            text.contains("run by run on the same trace: 0.60, 0.90 (median 0.75, met in 1 of 2)"),
            "{text}"
        );
        assert!(
            text.contains("p99 ratio 0.90, 1.10 (median 1.00), hit-rate difference -1.0, +1.0 points (median +0.0); both met in 0 of 2"),
            "{text}"
        );
    }

    #[test]
    fn stream_tables_show_the_chunk_gap_p99_and_a_dash_for_older_files() {
        // A current report, and one from before pd-load measured chunk gaps (no field).
        let stream = |p99: Option<f64>| {
            let mut v = report(10.0, 1.0, 50.0);
            v["summary"]["tpot_ms"] = json!({"p99": 2.1});
            v["summary"]["max_gap_ms"] = json!({"p99": 7.5});
            if let Some(p99) = p99 {
                v["summary"]["chunk_gap_ms"] = json!({"count": 640, "p50": 2.0, "p90": 2.1, "p99": p99, "p99_9": 6.0, "max": 9.0});
            }
            Run::from_json(&v)
        };
        let old = stream(None);
        assert!(old.chunk_p99.is_nan(), "missing field reads as no figure");
        let mut results: Results = BTreeMap::new();
        let s = results.entry("stream-timed-2k".into()).or_default();
        s.entry("direct".into())
            .or_default()
            .runs
            .push(stream(Some(2.25)));
        s.entry("pd-router-1p1d".into())
            .or_default()
            .runs
            .extend([stream(Some(2.5)), stream(Some(2.75))]);
        s.entry("vllm-router".into())
            .or_default()
            .runs
            .push(old.clone());
        let text = overhead_tables(&results);
        assert!(
            text.contains("| longest gap p99 ms | chunk gap p99 ms |"),
            "{text}"
        );
        assert!(
            text.contains("| direct | 10.00 | 10.00 | 2.100 | 7.50 | 2.250 | 10.00 |"),
            "{text}"
        );
        assert!(
            text.contains("| pd-router-1p1d | 10.00 | 10.00 | 2.100 | 7.50 | 2.625 |"),
            "median of two: {text}"
        );
        assert!(
            text.contains("| vllm-router | 10.00 | 10.00 | 2.100 | 7.50 | – |"),
            "{text}"
        );
        let mut policy: Results = BTreeMap::new();
        let p = policy.entry("policy-90".into()).or_default();
        p.entry("token_load+token_load".into())
            .or_default()
            .runs
            .push(stream(Some(3.0)));
        p.entry("least_request+least_request".into())
            .or_default()
            .runs
            .push(old);
        let text = policy_tables(&policy, Bound::default());
        assert!(
            text.contains("| token_load+token_load | 10.0 | 10.0 | 7.5 | 3.00 | 20.0 |"),
            "{text}"
        );
        assert!(
            text.contains("| least_request+least_request | 10.0 | 10.0 | 7.5 | – | 20.0 |"),
            "{text}"
        );
    }

    #[test]
    fn differences_carry_one_sign() {
        assert_eq!(signed(20.0, 0), "+20");
        assert_eq!(signed(-0.1912, 3), "-0.191");
        assert_eq!(signed(f64::NAN, 1), "–");
    }
}
