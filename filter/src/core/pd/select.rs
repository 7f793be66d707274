//! The PD selection cascade of the contract, Steps 1–5, after Step 0 (`candidates`):
//! prefill and decode load-imbalance fast paths, adaptive bucket serving, per-roleset prefill
//! and decode scoring, and the final pair by normalised score sum. The pair always comes from
//! one roleset. Token-ledger charges are computed here and applied by the caller in the same
//! CAS round as the selection.
//!
//! Built for 1000-pod fleets inside a wasm VM: the per-pod signals come from the snapshot's
//! dense [`Columns`], ledger rows are read in place through cached [`RowHints`], each side's
//! candidates are gathered once into reused [`Scratch`] buffers, and per-roleset minima are
//! kept per run of candidates (Step 0 lists candidates roleset by roleset) instead of in a
//! table sized by the fleet. Every formula, comparison and random draw happens in the same
//! order as the plain statement of the cascade (kept as `reference.rs` for the tests), so the
//! same inputs and random state give the same pair.

use crate::core::errors::RouteError;
use crate::core::fleet::{ModelView, Role};
use crate::core::ledger::{Ledger, RowHints, StaleHint};
use crate::core::pd::columns::{reported, Columns};
use crate::core::pd::settings::PdSettings;
use crate::core::pd::MinPicker;
use crate::core::score::decode::{
    self, cold_start, DecodeMaxima, DecodeStats, FastPathCheck, LbWeights,
};
use crate::core::score::{
    prefill, DecodePolicy, PrefillPolicy, DECODE_MAX_SCORE_FLOOR, PREFILL_MAX_SCORE_FLOOR,
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

/// A candidate of one side: its pod and where its ledger row is.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    slot: usize,
    row: Option<usize>,
    /// In-flight prefill calls (prefill side) or running requests (decode side).
    count: u32,
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
    prefill: Vec<Candidate>,
    /// The prefill candidates' counts again, densely, for the σ filter's mean and deviation.
    prefill_counts: Vec<u32>,
    decode: Vec<Candidate>,
    rates: Vec<f64>,
    prefill_best: Vec<Best>,
    decode_best: Vec<Best>,
}

/// Reads the candidates' rows, rebuilding the hints once if they are out of date.
fn gather(
    model: &ModelView,
    ledger: &Ledger,
    hints: &mut RowHints,
    mut run: impl FnMut(&RowHints) -> Result<(), StaleHint>,
) -> Result<(), RouteError> {
    if run(hints).is_ok() {
        return Ok(());
    }
    hints.rebuild(model.uid, ledger, &model.id_order);
    run(hints).map_err(|StaleHint| RouteError::Internal("ledger row hints out of date".into()))
}

/// The per-roleset minimum of one side, kept per run of same-roleset candidates: Step 0 lists
/// candidates roleset by roleset (in roleset order) and the steps only drop candidates, so
/// each roleset is one run and the bests come out sorted by roleset.
struct RolesetMins<'a> {
    out: &'a mut Vec<Best>,
    roleset: u32,
    picker: MinPicker,
}

impl<'a> RolesetMins<'a> {
    fn new(out: &'a mut Vec<Best>) -> Self {
        out.clear();
        RolesetMins {
            out,
            roleset: 0,
            picker: MinPicker::new(),
        }
    }

    fn offer(&mut self, roleset: u32, score: f64, slot: usize, rng: &mut fastrand::Rng) {
        if roleset != self.roleset {
            debug_assert!(
                self.picker.best.is_none() || roleset > self.roleset,
                "candidates are grouped by roleset in roleset order"
            );
            self.flush();
            self.roleset = roleset;
        }
        self.picker.offer(score, slot, rng);
    }

    /// Ends the last run.
    fn finish(mut self) {
        self.flush();
    }

    fn flush(&mut self) {
        if let Some((score, slot)) = self.picker.best.take() {
            self.out.push(Best {
                roleset: self.roleset,
                score,
                slot,
            });
        }
        self.picker = MinPicker::new();
    }
}

/// `(first index of the strict minimum, minimum), maximum` of a stream, as Step 2 reads it.
#[derive(Debug, Clone, Copy, Default)]
struct MinMax(Option<((usize, f64), f64)>);

impl MinMax {
    fn push(&mut self, i: usize, v: f64) {
        self.0 = Some(match self.0 {
            None => ((i, v), v),
            Some(((bi, bv), max)) => (if v < bv { (i, v) } else { (bi, bv) }, max.max(v)),
        });
    }
}

/// What Steps 2 and 4 need to know about the decode candidates as a whole.
#[derive(Debug, Clone, Copy)]
struct DecodeView {
    /// Some candidate has the running metric (cold-start scores apply to the others).
    any_ready: bool,
    maxima: DecodeMaxima,
    counts: MinMax,
    throughputs: MinMax,
    all_draining: bool,
    drain_scores: MinMax,
}

/// "Metrics ready": the engine has been scraped, or this gateway has routed to it.
fn has_running_metric(cols: &Columns, c: &Candidate) -> bool {
    cols.fresh[c.slot] || c.count > 0
}

fn decode_stats(cols: &Columns, c: &Candidate) -> DecodeStats {
    DecodeStats {
        count: f64::from(c.count),
        throughput: reported(cols.throughput[c.slot]).unwrap_or(0.0),
        free: cols.free[c.slot],
    }
}

/// The smallest drain rate the drain score divides by.
const MIN_DRAIN_RATE: f64 = 0.1;

fn decode_view(cols: &Columns, cands: &[Candidate]) -> DecodeView {
    let mut v = DecodeView {
        any_ready: false,
        maxima: DecodeMaxima {
            count: 1.0,
            throughput: 1.0,
            free: 1.0,
        },
        counts: MinMax::default(),
        throughputs: MinMax::default(),
        all_draining: !cands.is_empty(),
        drain_scores: MinMax::default(),
    };
    for (k, c) in cands.iter().enumerate() {
        let stats = decode_stats(cols, c);
        let ready = has_running_metric(cols, c);
        v.any_ready |= ready;
        v.maxima.count = v.maxima.count.max(stats.count);
        v.maxima.throughput = v.maxima.throughput.max(stats.throughput);
        v.maxima.free = v.maxima.free.max(stats.free);
        if ready {
            v.counts.push(k, stats.count);
        }
        if let Some(t) = reported(cols.throughput[c.slot]) {
            v.throughputs.push(k, t);
        }
        let drain = cols.drain[c.slot];
        if drain.is_finite() && drain > 0.0 {
            v.drain_scores
                .push(k, stats.count / drain.max(MIN_DRAIN_RATE));
        } else {
            v.all_draining = false;
        }
    }
    v
}

/// Step 2 (see `score::decode::decode_fast_path`, whose rules these are).
fn decode_fast_path(
    v: &DecodeView,
    th: &decode::DecodeThresholds,
) -> Option<(usize, FastPathCheck)> {
    if let Some(((index, min), max)) = v.counts.0 {
        if max - min >= th.count_spread {
            return Some((index, FastPathCheck::CountSpread));
        }
    }
    if let Some(((index, min), max)) = v.throughputs.0 {
        if max - min > th.throughput_spread {
            return Some((index, FastPathCheck::ThroughputSpread));
        }
    }
    if v.all_draining {
        if let Some(((index, min), max)) = v.drain_scores.0 {
            if min > 0.0 && max / min > th.drain_ratio {
                return Some((index, FastPathCheck::DrainRatio));
            }
        }
    }
    None
}

/// Step 4 for one candidate (see `DecodeBatch::score`): cold start, the policy, then the
/// `load_balancing` fallback for a NaN; `None` skips the pod.
fn decode_score(
    cols: &Columns,
    c: &Candidate,
    v: &DecodeView,
    policy: DecodePolicy,
    weights: LbWeights,
    token_load_score: f64,
) -> Option<f64> {
    if policy.uses_cold_start() && v.any_ready && !has_running_metric(cols, c) {
        return Some(cold_start(c.count));
    }
    let stats = decode_stats(cols, c);
    let value = match policy {
        DecodePolicy::LoadBalancing => decode::load_balancing(&stats, &v.maxima, weights),
        DecodePolicy::LeastRequest => decode::least_request(&stats),
        DecodePolicy::Conductor => decode::conductor(&stats),
        DecodePolicy::TokenLoad => token_load_score,
    };
    if !value.is_nan() {
        return Some(value);
    }
    if policy == DecodePolicy::LoadBalancing {
        return None;
    }
    let value = decode::load_balancing(&stats, &v.maxima, weights);
    (!value.is_nan()).then_some(value)
}

/// Steps 1–5 over Step 0's candidates (pod indexes, grouped by roleset in roleset order).
pub fn select_pair(
    model: &ModelView,
    prefill: &[usize],
    decode: &[usize],
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
        prefill: pc,
        prefill_counts,
        decode: dc,
        rates,
        prefill_best,
        decode_best,
    } = scratch;
    hints.prepare(model.uid, ledger, &model.id_order);

    // Step 1: prefill imbalance, on in-flight prefill counts.
    gather(model, ledger, hints, |hints| {
        pc.clear();
        prefill_counts.clear();
        for &slot in prefill {
            let row = hints.row(ledger, slot, cols.id[slot])?;
            let count = row.map_or(0, |i| ledger.prefill_inflight_at(i));
            pc.push(Candidate { slot, row, count });
            prefill_counts.push(count);
        }
        Ok(())
    })?;
    let spread = s.prefill_spread.min(u32::MAX as f64) as u32;
    let mut decode_roleset = None;
    if let Some(k) = prefill::prefill_fast_path(prefill_counts, spread, rng) {
        let chosen = pc[k];
        pc.clear();
        pc.push(chosen);
        prefill_counts.clear();
        prefill_counts.push(chosen.count);
        decode_roleset = Some(cols.roleset[chosen.slot]);
        fast.prefill = true;
    }

    // The decode candidates and their batch figures; recomputed below only if a later step
    // narrows them, since maxima are relative to the candidates still in play.
    gather(model, ledger, hints, |hints| {
        dc.clear();
        for &slot in decode {
            if decode_roleset.is_some_and(|r| cols.roleset[slot] != r) {
                continue;
            }
            let row = hints.row(ledger, slot, cols.id[slot])?;
            let count = row.map_or(0, |i| ledger.running_at(i));
            dc.push(Candidate { slot, row, count });
        }
        Ok(())
    })?;
    let mut view = decode_view(cols, dc);
    let mut narrowed = false;

    // Step 2: decode imbalance (not under token_load, which replaces what it measures).
    if s.decode_policy.runs_fast_path() {
        if let Some((index, check)) = decode_fast_path(&view, &s.decode) {
            let chosen = dc[index];
            let roleset = cols.roleset[chosen.slot];
            dc.clear();
            dc.push(chosen);
            if pc.iter().any(|c| cols.roleset[c.slot] == roleset) {
                retain_prefill(pc, prefill_counts, |c| cols.roleset[c.slot] == roleset);
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
            let in_band = |c: &Candidate| cols.roleset[c.slot] == band;
            if pc.iter().any(in_band) && dc.iter().any(in_band) {
                retain_prefill(pc, prefill_counts, in_band);
                dc.retain(in_band);
                fast.banded = true;
                narrowed = true;
            }
        }
    }

    // Step 3: prefill scoring; the lowest per roleset wins, pods far above the mean skipped.
    let max_req = prefill::max_req(prefill_counts);
    let (mean, std) = prefill::mean_std(prefill_counts);
    let tk = &s.tokens;
    let mut max_prefill = PREFILL_MAX_SCORE_FLOOR;
    let mut conductor_memo: Option<(u64, prefill::ConductorParts)> = None;
    let mut mins = RolesetMins::new(prefill_best);
    for c in pc.iter() {
        let cnt = c.count;
        if prefill::skip(cnt, mean, std, s.std_dev_factor) {
            continue;
        }
        let pct = input.match_pct.get(c.slot).copied().unwrap_or(0.0);
        let tokens = || c.row.map(|i| ledger.tokens_at(i)).unwrap_or_default();
        let score = match s.prefill_policy {
            PrefillPolicy::PrefixCache => prefill::prefix_cache(
                prefill::effective_match_pct(pct, tk.min_match_pct),
                cnt,
                max_req,
            ),
            PrefillPolicy::LeastRequest => prefill::least_request(cnt),
            PrefillPolicy::Conductor => {
                let parts = match conductor_memo {
                    Some((bits, parts)) if bits == pct.to_bits() => parts,
                    _ => {
                        let parts = prefill::conductor_parts(input.token_bytes, pct);
                        conductor_memo = Some((pct.to_bits(), parts));
                        parts
                    }
                };
                prefill::conductor_with(parts, cnt, reported(cols.prefill_ms[c.slot]))
            }
            PrefillPolicy::TokenLoad => {
                let t = tokens();
                prefill::token_load(t.active, t.kv, tk.kv_weight)
            }
            PrefillPolicy::HybridCacheLoad => {
                let t = tokens();
                prefill::hybrid(
                    t.active,
                    t.kv,
                    tk.kv_weight,
                    pct,
                    tk.min_match_pct,
                    tk.hybrid_factor,
                )
            }
        };
        if score.is_nan() {
            continue;
        }
        max_prefill = max_prefill.max(score);
        mins.offer(cols.roleset[c.slot], score, c.slot, rng);
    }
    mins.finish();

    // Step 4: decode scoring, with cold-start scores for pods the gateway has no signal for.
    // Maxima are relative to the candidates still in play, as in AIBrix.
    if narrowed {
        view = decode_view(cols, dc);
    }
    rates.clear();
    if s.decode_policy == DecodePolicy::TokenLoad {
        // Pods without their own rate borrow the mean of the candidates that have one.
        let own = |c: &Candidate| reported(cols.own_rate[c.slot]);
        let known = dc.iter().filter(|c| own(c).is_some()).count();
        let mean = (known > 0).then(|| dc.iter().filter_map(own).sum::<f64>() / known as f64);
        rates.extend(dc.iter().map(|c| own(c).or(mean).unwrap_or(0.0)));
    }
    let mut max_decode = DECODE_MAX_SCORE_FLOOR;
    let mut mins = RolesetMins::new(decode_best);
    for (k, c) in dc.iter().enumerate() {
        let ledger_score = match rates.get(k) {
            Some(&rate) => c
                .row
                .map(|i| ledger.tokens_at(i))
                .unwrap_or_else(PodTokens::default)
                .decode_load(rate, input.now_ms, tk.output_growth),
            None => 0.0,
        };
        let Some(score) = decode_score(cols, c, &view, s.decode_policy, s.lb, ledger_score) else {
            continue;
        };
        max_decode = max_decode.max(score);
        mins.offer(cols.roleset[c.slot], score, c.slot, rng);
    }
    mins.finish();

    // Step 5: the roleset with the lowest normalised sum (both lists are in roleset order).
    let mut best = MinPicker::new();
    let mut d = decode_best.iter().peekable();
    for (k, p) in prefill_best.iter().enumerate() {
        while d.next_if(|d| d.roleset < p.roleset).is_some() {}
        if let Some(d) = d.next_if(|d| d.roleset == p.roleset) {
            best.offer(p.score / max_prefill + d.score / max_decode, k, rng);
        }
    }
    let Some(k) = best.item() else {
        let missing = if prefill_best.is_empty() {
            "prefill"
        } else {
            "decode"
        };
        return Err(RouteError::Selection {
            detail: format!("target {missing} pod is nil"),
        });
    };
    let p = prefill_best[k];
    let Some(d) = decode_best.iter().find(|d| d.roleset == p.roleset) else {
        return Err(RouteError::Selection {
            detail: "target pod is nil".into(),
        });
    };
    let (p, d) = (p.slot, d.slot);

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
    let decode_tokens = (s.decode_policy == DecodePolicy::TokenLoad).then_some(input.prompt_tokens);
    debug_assert!(model.pods[p].role == Role::Prefill && model.pods[d].role == Role::Decode);
    Ok(PairChoice {
        prefill: p,
        decode: d,
        prefill_cost,
        decode_tokens,
        fast_paths: fast,
    })
}

/// Keeps the prefill candidates (and their dense counts) that pass `keep`.
fn retain_prefill(
    pc: &mut Vec<Candidate>,
    counts: &mut Vec<u32>,
    keep: impl Fn(&Candidate) -> bool,
) {
    pc.retain(|c| keep(c));
    counts.clear();
    counts.extend(pc.iter().map(|c| c.count));
}
