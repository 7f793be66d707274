//! The PD selection cascade of the contract, Steps 1–5, after Step 0 (`candidates`):
//! prefill and decode load-imbalance fast paths, adaptive bucket serving, per-roleset prefill
//! and decode scoring, and the final pair by normalised score sum. The pair always comes from
//! one roleset. Token-ledger charges are computed here and applied by the caller in the same
//! CAS round as the selection.
//!
//! Built for 1000-pod fleets inside a wasm VM. Each side's candidates are a position-ordered
//! set of dense arrays ([`PrefillSet`], [`DecodeSet`]); the usual sets (every pod of every
//! complete roleset) and everything that follows from them alone come with the snapshot, so a
//! request only reads its ledger counts (in place, through cached [`RowHints`]), scores each
//! pod in one pass per side into reused [`Scratch`] buffers, and picks per roleset over runs
//! of positions (Step 0 lists candidates roleset by roleset). Every formula, comparison and
//! random draw happens in the same order as the plain statement of the cascade (kept as
//! `explained.rs`, which the tests compare it with), so the same inputs and random state give the same pair.

use crate::core::errors::RouteError;
use crate::core::fleet::{ModelView, Role};
use crate::core::ledger::{Counter, Ledger, PodId, PreparedRows, RowHints, NO_ROW};
use crate::core::pd::columns::{one_to_one, reported, DecodeSet, MinMax, PrefillSet, Run};
use crate::core::pd::settings::PdSettings;
use crate::core::pd::MinPicker;
use crate::core::score::decode::{self, cold_start, FastPathCheck};
use crate::core::score::{
    prefill, DecodePolicy, Normaliser, PrefillPolicy, DECODE_MAX_SCORE_FLOOR,
    PREFILL_MAX_SCORE_FLOOR,
};
use crate::core::tokens::{self, PodTokens};

/// What the request brings to Steps 1–5 besides the fleet and the ledger.
#[derive(Debug, Clone, Copy)]
pub struct PairInput<'a> {
    pub settings: &'a PdSettings,
    /// Prefix-match percent per pod index (`ModelView::pods`); empty when the prefill policy
    /// does not use the prefix index.
    pub match_pct: &'a [f64],
    /// Tokenizer output length in bytes (the conductor's `T`).
    pub token_bytes: usize,
    /// Roleset the adaptive bucket plan assigns this prompt length to, if any.
    pub banded_roleset: Option<&'a str>,
    /// `len(body) / 4`, the token-load estimate of the prompt.
    pub prompt_tokens: u64,
    /// Session-delta of `x-aibrix-session-key` (rule 1 of the new-tokens charge), if any.
    pub session_delta: Option<u64>,
    pub now_ms: u64,
}

/// Which fast path fired, for explanations and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FastPaths {
    pub prefill: bool,
    pub decode: Option<crate::core::score::decode::FastPathCheck>,
    pub banded: bool,
}

/// A chosen pair and the token charges that go with it.
#[derive(Debug, Clone, PartialEq)]
pub struct PairChoice {
    pub prefill: usize,
    pub decode: usize,
    /// Prefill token-ledger cost (`request_cost + new_tokens`), when the policy uses it.
    pub prefill_cost: Option<f64>,
    /// Decode token-ledger charge (whole prompt), when the decode policy is token_load.
    pub decode_tokens: Option<u64>,
    pub fast_paths: FastPaths,
}

/// Step 0's candidates: every pod of every complete roleset (the snapshot has them as sets),
/// or explicit lists of pod indexes, grouped by roleset in roleset order.
#[derive(Debug, Clone, Copy)]
pub enum Candidates<'a> {
    All,
    Listed {
        prefill: &'a [usize],
        decode: &'a [usize],
    },
}

/// Per-request memo of a term that depends only on a pod's match percentage. The prefix
/// index yields whole percents, so those get a slot each (filled on first use); any other
/// value is computed every time. Most pods of a large fleet share one percentage (0: no
/// match), so the last value answers first, with one comparison. The filled set is two
/// `u64` words, not a `u128`: the filter runs as 32-bit wasm, where wide shifts are costly.
#[derive(Debug, Clone)]
struct PctMemo<T> {
    last: Option<(u64, T)>,
    filled: [u64; 2],
    values: [T; 101],
}

impl<T: Copy + Default> Default for PctMemo<T> {
    fn default() -> Self {
        PctMemo {
            last: None,
            filled: [0; 2],
            values: [T::default(); 101],
        }
    }
}

impl<T: Copy> PctMemo<T> {
    /// Forgets every value (they depend on the request).
    fn clear(&mut self) {
        self.last = None;
        self.filled = [0; 2];
    }

    fn get(&mut self, pct: f64, compute: impl FnOnce() -> T) -> T {
        let bits = pct.to_bits();
        if let Some((last, value)) = self.last {
            if last == bits {
                return value;
            }
        }
        let whole = pct as u32;
        if whole > 100 || f64::from(whole).to_bits() != bits {
            return compute();
        }
        let (word, bit) = ((whole / 64) as usize, 1u64 << (whole % 64));
        let slot = &mut self.values[whole as usize];
        if self.filled[word] & bit == 0 {
            *slot = compute();
            self.filled[word] |= bit;
        }
        self.last = Some((bits, *slot));
        *slot
    }
}

/// The best pod of one roleset on one side.
#[derive(Debug, Clone, Copy)]
struct Best {
    roleset: u32,
    score: f64,
    slot: usize,
}

/// Buffers a selection reuses, and the ledger row hints of the last model it served. One per
/// VM; a fresh one works too (it only costs the allocations and a hint rebuild).
#[derive(Debug, Default)]
pub struct Scratch {
    hints: RowHints,
    /// Candidate sets narrower than the snapshot's.
    prefill_set: PrefillSet,
    decode_set: DecodeSet,
    slots: Vec<usize>,
    /// Per candidate position: ledger count, ledger row, score.
    prefill_counts: Vec<u32>,
    prefill_rows: Vec<u32>,
    prefill_scores: Vec<f64>,
    decode_counts: Vec<u32>,
    decode_rows: Vec<u32>,
    decode_scores: Vec<f64>,
    prefill_best: Vec<Best>,
    decode_best: Vec<Best>,
    miss_memo: PctMemo<f64>,
    conductor_memo: PctMemo<prefill::ConductorParts>,
}

/// Reads one ledger counter of each candidate and where its row is.
fn gather(
    ledger: &Ledger,
    rows_of: PreparedRows<'_>,
    counter: Counter,
    slots: &[usize],
    ids: &[PodId],
    counts: &mut Vec<u32>,
    rows: &mut Vec<u32>,
) {
    counts.resize(slots.len(), 0);
    rows.resize(slots.len(), NO_ROW);
    rows_of.read_counts(counter, slots, counts, rows);
    // Other gateway replicas' running requests count like this one's (`core::remote`).
    if let (Counter::Running, Some(remote)) = (counter, ledger.remote()) {
        for (count, id) in counts.iter_mut().zip(ids) {
            if let Some((_, running)) = remote.get(*id) {
                *count = count.saturating_add(running);
            }
        }
    }
}

fn tokens_of(ledger: &Ledger, row: u32) -> PodTokens {
    if row == NO_ROW {
        PodTokens::default()
    } else {
        ledger.tokens_at(row as usize)
    }
}

/// A decode pod's tokens, with the other gateway replicas' decode charges added.
fn decode_tokens_of(ledger: &Ledger, row: u32, id: PodId) -> PodTokens {
    let mut t = tokens_of(ledger, row);
    if let Some((decode, _)) = ledger.remote().and_then(|r| r.get(id)) {
        t.decode += decode;
    }
    t
}

/// Keeps the candidates at the positions `keep` accepts: their counts and rows in place, and
/// their pods in `slots` (for refilling the set).
fn narrow(
    from: &[usize],
    counts: &mut Vec<u32>,
    rows: &mut Vec<u32>,
    slots: &mut Vec<usize>,
    keep: impl Fn(usize) -> bool,
) {
    slots.clear();
    let mut kept = 0;
    for k in 0..from.len() {
        if keep(k) {
            counts[kept] = counts[k];
            rows[kept] = rows[k];
            slots.push(from[k]);
            kept += 1;
        }
    }
    counts.truncate(kept);
    rows.truncate(kept);
}

/// The per-request figures of the decode candidates: whether any has the running metric
/// (then cold-start scores apply to the others) and the highest count (`max(1, counts)`).
/// `ready` is handed each position and count of a pod with the metric (Step 2 check 1's
/// stream), in the same pass.
fn decode_counts(
    set: &DecodeSet,
    counts: &[u32],
    mut ready: impl FnMut(usize, f64),
) -> (bool, f64) {
    let (mut any_ready, mut max_count) = (false, 1.0f64);
    for (k, (&count, &fresh)) in counts.iter().zip(&set.fresh).enumerate() {
        let count_f = f64::from(count);
        // Counts are never NaN: a comparison, not `f64::max` (whose NaN rule costs extra
        // instructions in wasm).
        if count_f > max_count {
            max_count = count_f;
        }
        // "Metrics ready": the engine has been scraped, or this gateway has routed to it.
        if fresh || count > 0 {
            any_ready = true;
            ready(k, count_f);
        }
    }
    (any_ready, max_count)
}

/// Step 2 (see `score::decode::decode_fast_path`, whose rules these are): three checks in
/// order, the first that fires picks a position; ties at a minimum go to a uniformly random
/// one, with the same draws as the plain statement makes.
fn decode_fast_path(
    set: &DecodeSet,
    counts: &[u32],
    ready: MinMax,
    th: &decode::DecodeThresholds,
    rng: &mut fastrand::Rng,
) -> Option<(usize, FastPathCheck)> {
    if let Some(((at, min), max)) = ready.get() {
        if max - min >= th.count_spread {
            return Some((at, FastPathCheck::CountSpread));
        }
    }
    if let Some(span) = set.fixed.throughputs {
        if span.max - span.min > th.throughput_spread {
            let j = match set.slowest.len() {
                n if n > 1 => rng.usize(..n),
                _ => 0,
            };
            if let Some(&at) = set.slowest.get(j) {
                return Some((at, FastPathCheck::ThroughputSpread));
            }
        }
    }
    if set.fixed.all_draining {
        let mut scores = MinMax::default();
        for (k, (&count, &divisor)) in counts.iter().zip(&set.drain_divisor).enumerate() {
            scores.push(k, f64::from(count) / divisor, rng);
        }
        if let Some(((at, min), max)) = scores.get() {
            if min > 0.0 && max / min > th.drain_ratio {
                return Some((at, FastPathCheck::DrainRatio));
            }
        }
    }
    None
}

/// Step 3's inputs per prefill candidate, scored by one loop per policy (the caller passes
/// the policy's formula as a closure), so the per-pod work carries no policy dispatch.
struct PrefillPods<'a> {
    counts: &'a [u32],
    slots: &'a [usize],
    rows: &'a [u32],
    /// Pods with more in-flight prefills than this are skipped (the σ filter).
    bound: f64,
}

impl PrefillPods<'_> {
    /// Fills `scores` with `score_of(position, count, slot, row)`, NaN for skipped pods, and
    /// returns the highest score, at least the prefill floor.
    fn score(
        &self,
        scores: &mut Vec<f64>,
        mut score_of: impl FnMut(usize, u32, usize, u32) -> f64,
    ) -> f64 {
        scores.clear();
        scores.resize(self.counts.len(), f64::NAN);
        let mut max = PREFILL_MAX_SCORE_FLOOR;
        let pods = self.counts.iter().zip(self.slots).zip(self.rows);
        for (k, (((&cnt, &slot), &row), score)) in pods.zip(scores.iter_mut()).enumerate() {
            if f64::from(cnt) > self.bound {
                continue; // stays NaN: skipped
            }
            *score = score_of(k, cnt, slot, row);
            // Above the floor, so never a ±0 question: `>` keeps what `f64::max` would.
            if *score > max {
                max = *score;
            }
        }
        max
    }
}

/// Step 4's inputs per decode candidate, scored by one loop per policy like [`PrefillPods`].
struct DecodePods<'a> {
    counts: &'a [u32],
    fresh: &'a [bool],
    rows: &'a [u32],
    /// Pods without any signal get cold-start scores instead of the policy's.
    cold_starts: bool,
}

impl DecodePods<'_> {
    /// Fills `scores` with `score_of(position, count, row)` or a cold-start score and returns
    /// the highest, at least the decode floor.
    fn score(
        &self,
        scores: &mut Vec<f64>,
        mut score_of: impl FnMut(usize, f64, u32) -> f64,
    ) -> f64 {
        scores.clear();
        scores.resize(self.counts.len(), f64::NAN);
        let mut max = DECODE_MAX_SCORE_FLOOR;
        let pods = self.counts.iter().zip(self.fresh).zip(self.rows);
        for (k, (((&count, &fresh), &row), score)) in pods.zip(scores.iter_mut()).enumerate() {
            *score = if self.cold_starts && !(fresh || count > 0) {
                cold_start(count)
            } else {
                score_of(k, f64::from(count), row)
            };
            // Above the floor, so never a ±0 question: `>` keeps what `f64::max` would.
            if *score > max {
                max = *score;
            }
        }
        max
    }
}

/// The lowest score of each run (one roleset's candidates), ties broken at random in
/// candidate order; NaN scores (skipped pods) never win. Runs come in roleset order, so the
/// bests do too.
fn pick_per_roleset(
    runs: &[Run],
    scores: &[f64],
    slots: &[usize],
    out: &mut Vec<Best>,
    rng: &mut fastrand::Rng,
) {
    out.clear();
    for run in runs {
        debug_assert!(out.last().is_none_or(|b| b.roleset < run.roleset));
        let best = if run.end - run.start == 1 {
            // One candidate: no tie to break, no random draw.
            let score = scores[run.start];
            (!score.is_nan()).then(|| (score, slots[run.start]))
        } else {
            let mut picker = MinPicker::new();
            for k in run.start..run.end {
                picker.offer(scores[k], slots[k], rng);
            }
            picker.best
        };
        if let Some((score, slot)) = best {
            out.push(Best {
                roleset: run.roleset,
                score,
                slot,
            });
        }
    }
}

/// Steps 1–5 over Step 0's candidates.
pub fn select_pair(
    model: &ModelView,
    candidates: Candidates<'_>,
    ledger: &Ledger,
    input: PairInput<'_>,
    rng: &mut fastrand::Rng,
    scratch: &mut Scratch,
) -> Result<PairChoice, RouteError> {
    let s = input.settings;
    let cols = &model.columns;
    let mut fast = FastPaths::default();
    let Scratch {
        hints,
        prefill_set,
        decode_set,
        slots,
        prefill_counts,
        prefill_rows,
        prefill_scores,
        decode_counts: dcounts,
        decode_rows,
        decode_scores,
        prefill_best,
        decode_best,
        miss_memo,
        conductor_memo,
    } = scratch;
    let rows_of = hints.prepare(model.uid, ledger, &model.id_order);
    let (mut pset, mut dset): (&PrefillSet, &DecodeSet) = match candidates {
        Candidates::All => (&cols.all_prefill, &cols.all_decode),
        Candidates::Listed { prefill, decode } => {
            prefill_set.fill(cols, prefill.iter().copied());
            decode_set.fill(cols, decode.iter().copied());
            (&*prefill_set, &*decode_set)
        }
    };

    // Step 1: prefill imbalance, on in-flight prefill counts.
    gather(
        ledger,
        rows_of,
        Counter::PrefillInflight,
        &pset.slot,
        &pset.id,
        prefill_counts,
        prefill_rows,
    );
    let mut count_stats = prefill::CountStats::of(prefill_counts);
    let spread = s.prefill_spread.min(u32::MAX as f64) as u32;
    if let Some(k) = prefill::prefill_fast_path_with(prefill_counts, count_stats, spread, rng) {
        let roleset = pset.roleset[k];
        narrow(&pset.slot, prefill_counts, prefill_rows, slots, |j| j == k);
        prefill_set.fill(cols, slots.iter().copied());
        pset = &*prefill_set;
        slots.clear();
        slots.extend(
            dset.slot
                .iter()
                .zip(&dset.roleset)
                .filter(|&(_, &r)| r == roleset)
                .map(|(&slot, _)| slot),
        );
        decode_set.fill(cols, slots.iter().copied());
        dset = &*decode_set;
        fast.prefill = true;
    }

    // The decode candidates' counts; their batch figures are recomputed below only if a later
    // step narrows them, since maxima are relative to the candidates still in play.
    gather(
        ledger,
        rows_of,
        Counter::Running,
        &dset.slot,
        &dset.id,
        dcounts,
        decode_rows,
    );
    // Step 2 check 1's stream is read in the same pass, when Step 2 runs.
    let fast_path = s.decode_policy.runs_fast_path();
    let mut ready = MinMax::default();
    let (mut any_ready, mut max_count) = if fast_path {
        decode_counts(dset, dcounts, |k, count| ready.push(k, count, rng))
    } else {
        decode_counts(dset, dcounts, |_, _| {})
    };
    let mut narrowed = false;

    // Step 2: decode imbalance (not under token_load, which replaces what it measures).
    if fast_path {
        if let Some((k, check)) = decode_fast_path(dset, dcounts, ready, &s.decode, rng) {
            let roleset = dset.roleset[k];
            narrow(&dset.slot, dcounts, decode_rows, slots, |j| j == k);
            decode_set.fill(cols, slots.iter().copied());
            dset = &*decode_set;
            if pset.roleset.contains(&roleset) {
                let rolesets = &pset.roleset;
                narrow(&pset.slot, prefill_counts, prefill_rows, slots, |j| {
                    rolesets[j] == roleset
                });
                prefill_set.fill(cols, slots.iter().copied());
                pset = &*prefill_set;
            }
            fast.decode = Some(check);
            narrowed = true;
        }
    }

    // Step 2b: adaptive bucket serving, advisory: only when the banded roleset keeps both sides.
    if let Some(band) = input.banded_roleset {
        let band = model
            .rolesets
            .iter()
            .position(|r| r.name == band)
            .and_then(|r| u32::try_from(r).ok());
        if let Some(band) = band {
            if pset.roleset.contains(&band) && dset.roleset.contains(&band) {
                let rolesets = &pset.roleset;
                narrow(&pset.slot, prefill_counts, prefill_rows, slots, |j| {
                    rolesets[j] == band
                });
                prefill_set.fill(cols, slots.iter().copied());
                pset = &*prefill_set;
                let rolesets = &dset.roleset;
                narrow(&dset.slot, dcounts, decode_rows, slots, |j| {
                    rolesets[j] == band
                });
                decode_set.fill(cols, slots.iter().copied());
                dset = &*decode_set;
                fast.banded = true;
                narrowed = true;
            }
        }
    }

    // Step 3: prefill scoring; the lowest per roleset wins, pods far above the mean skipped.
    if fast.prefill || fast.decode.is_some() || fast.banded {
        count_stats = prefill::CountStats::of(prefill_counts);
    }
    let inv_max_req = prefill::reciprocal(count_stats.max);
    let (mean, std) = prefill::mean_std_with(prefill_counts, count_stats);
    let bound = prefill::skip_bound(mean, std, s.std_dev_factor);
    let tk = &s.tokens;
    // Terms that depend only on a pod's match percentage, computed once per distinct match.
    miss_memo.clear();
    conductor_memo.clear();
    let pct_of = |slot: usize| input.match_pct.get(slot).copied().unwrap_or(0.0);
    let prefill_pods = PrefillPods {
        counts: prefill_counts,
        slots: &pset.slot,
        rows: prefill_rows,
        bound,
    };
    let max_prefill = match s.prefill_policy {
        PrefillPolicy::PrefixCache => prefill_pods.score(prefill_scores, |_, cnt, slot, _| {
            let pct = pct_of(slot);
            let miss = miss_memo.get(pct, || {
                prefill::prefix_cache_miss(prefill::effective_match_pct(pct, tk.min_match_pct))
            });
            prefill::prefix_cache_with(miss, cnt, inv_max_req)
        }),
        PrefillPolicy::LeastRequest => {
            prefill_pods.score(prefill_scores, |_, cnt, _, _| prefill::least_request(cnt))
        }
        PrefillPolicy::Conductor => prefill_pods.score(prefill_scores, |k, cnt, slot, _| {
            let pct = pct_of(slot);
            let parts =
                conductor_memo.get(pct, || prefill::conductor_parts(input.token_bytes, pct));
            prefill::conductor_with(parts, cnt, reported(pset.prefill_ms[k]))
        }),
        PrefillPolicy::TokenLoad => prefill_pods.score(prefill_scores, |_, _, _, row| {
            let t = tokens_of(ledger, row);
            prefill::token_load(t.active, t.kv, tk.kv_weight)
        }),
        PrefillPolicy::HybridCacheLoad => prefill_pods.score(prefill_scores, |_, _, slot, row| {
            let t = tokens_of(ledger, row);
            let pct = pct_of(slot);
            prefill::hybrid(
                t.active,
                t.kv,
                tk.kv_weight,
                pct,
                tk.min_match_pct,
                tk.hybrid_factor,
            )
        }),
    };
    let prefill_singles = pset.runs.len() == pset.len();
    if !prefill_singles {
        pick_per_roleset(&pset.runs, prefill_scores, &pset.slot, prefill_best, rng);
    }

    // Step 4: decode scoring, with cold-start scores for pods the gateway has no signal for.
    // Maxima are relative to the candidates still in play, as in AIBrix.
    if narrowed {
        (any_ready, max_count) = decode_counts(dset, dcounts, |_, _| {});
    }
    let policy = s.decode_policy;
    let cold_starts = policy.uses_cold_start() && any_ready;
    let inv_max_count = decode::inv_max_count(max_count);
    let decode_pods = DecodePods {
        counts: dcounts,
        fresh: &dset.fresh,
        rows: decode_rows,
        cold_starts,
    };
    let lb =
        |k: usize, count: f64| decode::load_balancing_with(count, inv_max_count, dset.lb[k], s.lb);
    // A NaN from another policy falls back to load_balancing; a NaN after that skips.
    let or_lb = |value: f64, k: usize, count: f64| {
        if value.is_nan() {
            lb(k, count)
        } else {
            value
        }
    };
    let max_decode = match policy {
        DecodePolicy::LoadBalancing => decode_pods.score(decode_scores, |k, count, _| lb(k, count)),
        DecodePolicy::LeastRequest => {
            decode_pods.score(decode_scores, |k, count, _| or_lb(count, k, count))
        }
        DecodePolicy::Conductor => decode_pods.score(decode_scores, |k, count, _| {
            or_lb(decode::conductor_with(dset.conductor[k], count), k, count)
        }),
        DecodePolicy::TokenLoad => decode_pods.score(decode_scores, |k, count, row| {
            // Pods without their own rate borrow the mean of the candidates' rates.
            let rate = reported(dset.own_rate[k])
                .or(dset.fixed.own_rate_mean)
                .unwrap_or(0.0);
            let load = decode_tokens_of(ledger, row, dset.id[k]).decode_load(
                rate,
                input.now_ms,
                tk.output_growth,
            );
            or_lb(load, k, count)
        }),
    };

    // Step 5: the roleset with the lowest normalised sum.
    let norm = Normaliser::new(max_prefill, max_decode);
    let whole = std::ptr::eq(pset, &cols.all_prefill) && std::ptr::eq(dset, &cols.all_decode);
    let paired = if whole {
        cols.all_one_to_one
    } else {
        one_to_one(pset, dset)
    };
    let (p, d) = if paired {
        // One pod per roleset on both sides, the same rolesets in the same order (every
        // roleset of a 1P1D fleet): a roleset's best pods are its pods.
        let mut best = MinPicker::new();
        for (k, (&p, &d)) in prefill_scores.iter().zip(decode_scores.iter()).enumerate() {
            // A skipped pod's NaN makes the sum NaN, which the picker passes over.
            best.offer(norm.sum(p, d), k, rng);
        }
        match best.item() {
            Some(k) => (pset.slot[k], dset.slot[k]),
            None => {
                let missing = if prefill_scores.iter().all(|p| p.is_nan()) {
                    "prefill"
                } else {
                    "decode"
                };
                return Err(RouteError::Selection {
                    detail: format!("target {missing} pod is nil"),
                });
            }
        }
    } else {
        if prefill_singles {
            pick_per_roleset(&pset.runs, prefill_scores, &pset.slot, prefill_best, rng);
        }
        pick_per_roleset(&dset.runs, decode_scores, &dset.slot, decode_best, rng);
        // Both lists are in roleset order.
        let mut best = MinPicker::new();
        let mut j = 0;
        for (i, p) in prefill_best.iter().enumerate() {
            while decode_best.get(j).is_some_and(|d| d.roleset < p.roleset) {
                j += 1;
            }
            if let Some(d) = decode_best.get(j).filter(|d| d.roleset == p.roleset) {
                best.offer(norm.sum(p.score, d.score), i, rng);
            }
        }
        let Some(i) = best.item() else {
            let missing = if prefill_best.is_empty() {
                "prefill"
            } else {
                "decode"
            };
            return Err(RouteError::Selection {
                detail: format!("target {missing} pod is nil"),
            });
        };
        let p = prefill_best[i];
        let Ok(j) = decode_best.binary_search_by_key(&p.roleset, |d| d.roleset) else {
            return Err(RouteError::Selection {
                detail: "target pod is nil".into(),
            });
        };
        (p.slot, decode_best[j].slot)
    };

    Ok(PairChoice::charged(model, p, d, &input, fast))
}

impl PairChoice {
    /// The chosen pair with the token-ledger charges its policies make: the prefill's
    /// `request_cost + new_tokens` (session delta and, for hybrid_cache_load, the prefix
    /// match), the decode's whole prompt.
    pub fn charged(
        model: &ModelView,
        p: usize,
        d: usize,
        input: &PairInput<'_>,
        fast: FastPaths,
    ) -> PairChoice {
        let (s, tk) = (input.settings, &input.settings.tokens);
        let prefill_cost = s.prefill_policy.uses_token_ledger().then(|| {
            let pct = (s.prefill_policy == PrefillPolicy::HybridCacheLoad)
                .then(|| input.match_pct.get(p).copied().unwrap_or(0.0));
            let (new_tokens, _) = tokens::new_tokens(
                input.prompt_tokens,
                input.session_delta,
                pct,
                tk.min_match_pct,
            );
            tk.prefill_cost(new_tokens)
        });
        let decode_tokens =
            (s.decode_policy == DecodePolicy::TokenLoad).then_some(input.prompt_tokens);
        debug_assert!(model.pods[p].role == Role::Prefill && model.pods[d].role == Role::Decode);
        PairChoice {
            prefill: p,
            decode: d,
            prefill_cost,
            decode_tokens,
            fast_paths: fast,
        }
    }
}
