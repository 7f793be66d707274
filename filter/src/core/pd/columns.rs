//! The per-pod signals Steps 1–5 read, laid out as one array per signal and computed once per
//! snapshot. A selection at 1024 pods then walks a few dense arrays instead of `PodView`s
//! (strings, protobuf metrics, configs), and every derivation that depends only on the
//! snapshot (metric freshness, usable throughput, free KV percent, the batch maxima of the
//! decode side and the terms of its scores that follow from them) is paid once per snapshot
//! instead of once per pod per request.
//!
//! [`Columns`] is indexed by pod; a [`PrefillSet`] or [`DecodeSet`] holds one side's
//! candidates position by position, so the passes of a selection read memory in order. The
//! sets of "every pod of every complete roleset" (Step 0 without bucketing, the usual case)
//! are built here; narrower sets are filled per request into reused buffers.
//!
//! `NaN` marks "not reported" in the `f64` columns: every reported value that survives its
//! filter is a number, so the marker never collides with data.

use crate::core::fleet::{PodView, Roleset};
use crate::core::ledger::PodId;
use crate::core::pd::MinPicker;
use crate::core::score::decode::{
    self, free_percent, usable, ConductorParts, DecodeMaxima, DecodeStats, LbParts,
};

/// Marks a pod outside any complete roleset in [`Columns::roleset`].
pub const NO_ROLESET: u32 = u32::MAX;

/// The smallest drain rate Step 2's drain score divides by.
const MIN_DRAIN_RATE: f64 = 0.1;

/// Per-pod signals, indexed like `ModelView::pods`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Columns {
    /// Ledger identity of each pod.
    pub id: Vec<PodId>,
    /// `ModelView::rolesets` index, or [`NO_ROLESET`].
    pub roleset: Vec<u32>,
    /// Engine metrics present and not stale (the decode side's "scraped" signal).
    pub fresh: Vec<bool>,
    /// Usable generation throughput (finite, at least 0) of fresh metrics; NaN otherwise.
    pub throughput: Vec<f64>,
    /// Free KV percent (`round(100 − usage × 100)`, at least 0.1); 100 without fresh metrics.
    pub free: Vec<f64>,
    /// Drain rate of fresh metrics when above 0 (may be +∞); NaN otherwise.
    pub drain: Vec<f64>,
    /// Decode `token_load`'s own per-request generation rate (throughput over running
    /// requests); NaN when the pod has none.
    pub own_rate: Vec<f64>,
    /// Conductor prefill: mean TTFT in ms when positive (metrics of any age, as the policy
    /// reads them); NaN otherwise.
    pub prefill_ms: Vec<f64>,
    /// Step 0 without bucketing: every prefill and every decode pod of the complete rolesets,
    /// roleset by roleset in roleset order.
    pub all_prefill: PrefillSet,
    pub all_decode: DecodeSet,
    /// Both of those hold one pod per roleset, of the same rolesets in the same order.
    pub all_one_to_one: bool,
}

impl Columns {
    pub fn build(pods: &[PodView], rolesets: &[Roleset]) -> Columns {
        let n = pods.len();
        let mut c = Columns {
            id: Vec::with_capacity(n),
            roleset: Vec::with_capacity(n),
            fresh: Vec::with_capacity(n),
            throughput: Vec::with_capacity(n),
            free: Vec::with_capacity(n),
            drain: Vec::with_capacity(n),
            own_rate: Vec::with_capacity(n),
            prefill_ms: Vec::with_capacity(n),
            all_prefill: PrefillSet::default(),
            all_decode: DecodeSet::default(),
            all_one_to_one: false,
        };
        for pod in pods {
            let fresh = pod.metrics.as_ref().filter(|m| !m.stale);
            c.id.push(pod.id);
            c.roleset.push(
                pod.roleset_idx
                    .and_then(|r| u32::try_from(r).ok())
                    .unwrap_or(NO_ROLESET),
            );
            c.fresh.push(fresh.is_some());
            c.throughput
                .push(usable(fresh.map(|m| m.generation_throughput)).unwrap_or(f64::NAN));
            c.free.push(free_percent(fresh.map(|m| m.kv_cache_usage)));
            c.drain.push(
                fresh
                    .map(|m| m.drain_rate)
                    .filter(|d| *d > 0.0)
                    .unwrap_or(f64::NAN),
            );
            c.own_rate.push(
                crate::core::tokens::own_rate(
                    fresh.map(|m| m.generation_throughput),
                    fresh.map(|m| m.running).unwrap_or(0.0),
                )
                .unwrap_or(f64::NAN),
            );
            c.prefill_ms.push(
                pod.metrics
                    .as_ref()
                    .map(|m| m.ttft_avg_seconds * 1000.0)
                    .filter(|v| *v > 0.0)
                    .unwrap_or(f64::NAN),
            );
        }
        let mut all_prefill = PrefillSet::default();
        all_prefill.fill(&c, rolesets.iter().flat_map(|r| r.prefill.iter().copied()));
        let mut all_decode = DecodeSet::default();
        all_decode.fill(&c, rolesets.iter().flat_map(|r| r.decode.iter().copied()));
        c.all_one_to_one = one_to_one(&all_prefill, &all_decode);
        c.all_prefill = all_prefill;
        c.all_decode = all_decode;
        c
    }
}

/// One pod per roleset on both sides, the same rolesets in the same order: then position `k`
/// of one side pairs with position `k` of the other.
pub fn one_to_one(prefill: &PrefillSet, decode: &DecodeSet) -> bool {
    prefill.runs.len() == prefill.len()
        && decode.runs.len() == decode.len()
        && prefill.roleset == decode.roleset
}

/// `Some(v)` unless `v` is the "not reported" marker.
pub fn reported(v: f64) -> Option<f64> {
    (!v.is_nan()).then_some(v)
}

/// Consecutive candidates of one roleset: positions `start..end` of a set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub roleset: u32,
    pub start: usize,
    pub end: usize,
}

/// Appends position `at` (of `roleset`) to the runs.
fn extend_runs(runs: &mut Vec<Run>, roleset: u32, at: usize) {
    match runs.last_mut() {
        Some(run) if run.roleset == roleset && run.end == at => run.end = at + 1,
        _ => runs.push(Run {
            roleset,
            start: at,
            end: at + 1,
        }),
    }
}

/// Prefill candidates, position by position.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefillSet {
    pub slot: Vec<usize>,
    pub id: Vec<PodId>,
    pub roleset: Vec<u32>,
    pub prefill_ms: Vec<f64>,
    pub runs: Vec<Run>,
}

impl PrefillSet {
    /// Replaces the set with the pods in `slots` (in that order).
    pub fn fill(&mut self, cols: &Columns, slots: impl IntoIterator<Item = usize>) {
        self.slot.clear();
        self.id.clear();
        self.roleset.clear();
        self.prefill_ms.clear();
        self.runs.clear();
        for slot in slots {
            extend_runs(&mut self.runs, cols.roleset[slot], self.slot.len());
            self.slot.push(slot);
            self.id.push(cols.id[slot]);
            self.roleset.push(cols.roleset[slot]);
            self.prefill_ms.push(cols.prefill_ms[slot]);
        }
    }

    pub fn len(&self) -> usize {
        self.slot.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slot.is_empty()
    }
}

/// Lowest and highest of a stream of `(position, value)` of finite values, as the Step 2
/// checks read them. Ties at the lowest are broken uniformly at random, [`MinPicker`]'s rule:
/// AIBrix scans a shuffled list with strict <, and a fixed order would send every request
/// to the first of several idle pods until the next scrape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MinMax {
    min: MinPicker,
    max: f64,
}

impl Default for MinMax {
    fn default() -> Self {
        MinMax {
            min: MinPicker::new(),
            max: f64::NEG_INFINITY,
        }
    }
}

impl MinMax {
    pub fn push(&mut self, at: usize, v: f64, rng: &mut fastrand::Rng) {
        debug_assert!(v.is_finite());
        self.min.offer(v, at, rng);
        // Finite values: a comparison, not `f64::max` (whose NaN rule costs extra in wasm).
        if v > self.max {
            self.max = v;
        }
    }

    /// `((position of the minimum, minimum), maximum)`, `None` for an empty stream.
    pub fn get(&self) -> Option<((usize, f64), f64)> {
        self.min.best.map(|(min, at)| ((at, min), self.max))
    }
}

/// The throughput check's figures, fixed with the candidate set, where no random state is at
/// hand: the lowest and highest reported throughput, and every position at the lowest (in
/// [`DecodeSet::slowest`]) for the request to draw from.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Span {
    pub min: f64,
    pub max: f64,
}

impl Span {
    /// Widens `span` by the value `v` at position `at`, keeping `slowest` the positions at
    /// the lowest value.
    fn push(span: &mut Option<Span>, slowest: &mut Vec<usize>, at: usize, v: f64) {
        match span {
            None => {
                *span = Some(Span { min: v, max: v });
                slowest.push(at);
            }
            Some(s) => {
                if v < s.min {
                    s.min = v;
                    slowest.clear();
                    slowest.push(at);
                } else if v == s.min {
                    slowest.push(at);
                }
                if v > s.max {
                    s.max = v;
                }
            }
        }
    }
}

/// What the decode side's candidate set fixes, whatever the request counts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodeFixed {
    /// `max(1, throughputs)`, missing throughput read as 0.
    pub max_throughput: f64,
    /// `max(1, free percents)`.
    pub max_free: f64,
    /// Step 2 check 2: over the pods reporting throughput (`None` when none does).
    pub throughputs: Option<Span>,
    /// Step 2 check 3 applies: the set is not empty and every pod drains (finite rate > 0).
    pub all_draining: bool,
    /// Decode `token_load`: mean of the own rates the set has, the rate of the others.
    pub own_rate_mean: Option<f64>,
}

/// Decode candidates, position by position, with the parts of their scores that depend on
/// the set alone.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeSet {
    pub slot: Vec<usize>,
    pub id: Vec<PodId>,
    pub roleset: Vec<u32>,
    pub fresh: Vec<bool>,
    /// Usable throughput, NaN when not reported.
    pub throughput: Vec<f64>,
    /// What Step 2's drain score divides a pod's count by: its drain rate, at least 0.1.
    pub drain_divisor: Vec<f64>,
    pub own_rate: Vec<f64>,
    pub lb: Vec<LbParts>,
    pub conductor: Vec<ConductorParts>,
    pub runs: Vec<Run>,
    pub fixed: DecodeFixed,
    /// Positions at the lowest reported throughput, in candidate order.
    pub slowest: Vec<usize>,
}

impl DecodeSet {
    /// Replaces the set with the pods in `slots` (in that order).
    pub fn fill(&mut self, cols: &Columns, slots: impl IntoIterator<Item = usize>) {
        self.slot.clear();
        self.id.clear();
        self.roleset.clear();
        self.fresh.clear();
        self.throughput.clear();
        self.drain_divisor.clear();
        self.own_rate.clear();
        self.lb.clear();
        self.conductor.clear();
        self.runs.clear();
        self.slowest.clear();
        let mut fixed = DecodeFixed {
            max_throughput: 1.0,
            max_free: 1.0,
            throughputs: None,
            all_draining: true,
            own_rate_mean: None,
        };
        for slot in slots {
            let at = self.slot.len();
            extend_runs(&mut self.runs, cols.roleset[slot], at);
            self.slot.push(slot);
            self.id.push(cols.id[slot]);
            self.roleset.push(cols.roleset[slot]);
            self.fresh.push(cols.fresh[slot]);
            let throughput = cols.throughput[slot];
            self.throughput.push(throughput);
            fixed.max_throughput = fixed
                .max_throughput
                .max(reported(throughput).unwrap_or(0.0));
            fixed.max_free = fixed.max_free.max(cols.free[slot]);
            if let Some(t) = reported(throughput) {
                Span::push(&mut fixed.throughputs, &mut self.slowest, at, t);
            }
            let drain = cols.drain[slot];
            fixed.all_draining &= drain.is_finite() && drain > 0.0;
            self.drain_divisor.push(drain.max(MIN_DRAIN_RATE));
            self.own_rate.push(cols.own_rate[slot]);
        }
        fixed.all_draining &= !self.slot.is_empty();
        // Summed in candidate order, as `tokens::decode_rates` does.
        let own = || self.own_rate.iter().filter_map(|&r| reported(r));
        let rates = own().count();
        fixed.own_rate_mean = (rates > 0).then(|| own().sum::<f64>() / rates as f64);
        let maxima = DecodeMaxima {
            count: 1.0,
            throughput: fixed.max_throughput,
            free: fixed.max_free,
        };
        for &slot in &self.slot {
            // The count does not enter these parts; 0 stands in for it.
            let stats = DecodeStats {
                count: 0.0,
                throughput: reported(cols.throughput[slot]).unwrap_or(0.0),
                free: cols.free[slot],
            };
            self.lb.push(decode::lb_parts(&stats, &maxima));
            self.conductor.push(decode::conductor_parts(&stats));
        }
        self.fixed = fixed;
    }

    pub fn len(&self) -> usize {
        self.slot.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slot.is_empty()
    }
}
