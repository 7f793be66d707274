//! The cascade as first written, with the routing explanation's hooks: Step 0 through
//! `candidates::collect`, every ledger row decoded by `Ledger::rows_for`, the decode batch
//! from `PodView`s, per-roleset pickers in a table sized by the fleet. Slow at 1000 pods and
//! plain to read; it serves `x-pd-explain` requests, and the tests hold the optimised
//! `select.rs` to its choices (pair, charges and random draws) on random fleets.

use crate::core::errors::RouteError;
use crate::core::fleet::{ModelView, PodView};
use crate::core::ledger::{Ledger, Row};
use crate::core::obs::explain::{Explain, PairScore};
use crate::core::pd::select::{FastPaths, PairChoice, PairInput};
use crate::core::pd::{candidates, MinPicker, Selected, Step0, Step0Input};
use crate::core::score::decode::{DecodeBatch, DecodeInput};
use crate::core::score::{
    prefill, DecodePolicy, Normaliser, PrefillPolicy, DECODE_MAX_SCORE_FLOOR,
    PREFILL_MAX_SCORE_FLOOR,
};
use crate::core::tokens;

fn roleset_of(model: &ModelView, pod: usize) -> Option<usize> {
    model.pods.get(pod).and_then(|p| p.roleset_idx)
}

/// The decode-side signals of one pod.
fn decode_input(pod: &PodView, row: &Row) -> DecodeInput {
    let counts = row.counts;
    let metrics = pod.metrics.as_ref().filter(|m| !m.stale);
    DecodeInput {
        count: counts.running,
        // "Metrics ready": the engine has been scraped, or this gateway has routed to it.
        has_running_metric: metrics.is_some() || counts.running > 0,
        throughput: metrics.map(|m| m.generation_throughput),
        kv_usage: metrics.map(|m| m.kv_cache_usage),
        drain_rate: metrics.map(|m| m.drain_rate).filter(|d| *d > 0.0),
    }
}

/// Steps 1–5 over Step 0's candidates.
pub fn select_pair(
    model: &ModelView,
    prefill: Vec<usize>,
    decode: Vec<usize>,
    rows: &[Row],
    input: PairInput<'_>,
    rng: &mut fastrand::Rng,
) -> Result<PairChoice, RouteError> {
    select_pair_explained(model, prefill, decode, rows, input, rng, None)
}

/// [`select_pair`] that records the candidates after each step, the fast paths, skipped
/// prefill pods, each roleset's pair scores and the pick into `explain` when one is given.
pub fn select_pair_explained(
    model: &ModelView,
    mut prefill: Vec<usize>,
    mut decode: Vec<usize>,
    rows: &[Row],
    input: PairInput<'_>,
    rng: &mut fastrand::Rng,
    mut explain: Option<&mut Explain>,
) -> Result<PairChoice, RouteError> {
    let s = input.settings;
    let mut fast = FastPaths::default();

    // Step 1: prefill imbalance, on in-flight prefill counts.
    let counts: Vec<u32> = prefill
        .iter()
        .map(|&i| rows[i].counts.prefill_inflight)
        .collect();
    let spread = s.prefill_spread.min(u32::MAX as f64) as u32;
    if let Some(k) = prefill::prefill_fast_path(&counts, spread, rng) {
        let chosen = prefill[k];
        let roleset = roleset_of(model, chosen);
        prefill = vec![chosen];
        decode.retain(|&d| roleset_of(model, d) == roleset);
        fast.prefill = true;
    }
    if let Some(x) = explain.as_deref_mut() {
        x.kept("s1", &prefill, &decode);
    }

    // The decode signals of the candidates; rebuilt below only if a later step narrows them.
    // Steps only ever drop candidates, so an unchanged length means an unchanged list.
    let build_batch = |decode: &[usize]| {
        DecodeBatch::new(
            decode
                .iter()
                .map(|&i| decode_input(&model.pods[i], &rows[i]))
                .collect(),
        )
    };
    let mut batch = build_batch(&decode);
    let mut batch_of = decode.len();

    // Step 2: decode imbalance (not under token_load, which replaces what it measures).
    if s.decode_policy.runs_fast_path() {
        if let Some(pick) = crate::core::score::decode::decode_fast_path(&batch, &s.decode, rng) {
            let chosen = decode[pick.index];
            let roleset = roleset_of(model, chosen);
            decode = vec![chosen];
            let aligned: Vec<usize> = prefill
                .iter()
                .copied()
                .filter(|&p| roleset_of(model, p) == roleset)
                .collect();
            if !aligned.is_empty() {
                prefill = aligned;
            }
            fast.decode = Some(pick.check);
        }
    }
    if let Some(x) = explain.as_deref_mut() {
        x.kept("s2", &prefill, &decode);
    }

    // Step 2b: adaptive bucket serving, advisory: only when the banded roleset keeps both sides.
    if let Some(band) = input.banded_roleset {
        let in_band = |i: &usize| model.pods[*i].roleset == band;
        if prefill.iter().any(in_band) && decode.iter().any(in_band) {
            prefill.retain(in_band);
            decode.retain(in_band);
            fast.banded = true;
        }
        if let Some(x) = explain.as_deref_mut() {
            x.kept("s2b", &prefill, &decode);
        }
    }

    // Step 3: prefill scoring; the lowest per roleset wins, pods far above the mean skipped.
    let counts: Vec<u32> = prefill
        .iter()
        .map(|&i| rows[i].counts.prefill_inflight)
        .collect();
    let max_req = prefill::max_req(&counts);
    let (mean, std) = prefill::mean_std(&counts);
    let tk = &s.tokens;
    let rolesets = model.rolesets.len();
    let mut prefill_best: Vec<MinPicker> = (0..rolesets).map(|_| MinPicker::new()).collect();
    let mut max_prefill = PREFILL_MAX_SCORE_FLOOR;
    for (&i, &cnt) in prefill.iter().zip(&counts) {
        if prefill::skip(cnt, mean, std, s.std_dev_factor) {
            if let Some(x) = explain.as_deref_mut() {
                x.prefill_skipped.push(i);
            }
            continue;
        }
        let pod = &model.pods[i];
        let pct = input.match_pct.get(i).copied().unwrap_or(0.0);
        let tokens = rows[i].tokens;
        let score = match s.prefill_policy {
            PrefillPolicy::PrefixCache => prefill::prefix_cache(
                prefill::effective_match_pct(pct, tk.min_match_pct),
                cnt,
                max_req,
            ),
            PrefillPolicy::LeastRequest => prefill::least_request(cnt),
            PrefillPolicy::Conductor => {
                let avg_ms = pod
                    .metrics
                    .as_ref()
                    .map(|m| m.ttft_avg_seconds * 1000.0)
                    .filter(|v| *v > 0.0);
                prefill::conductor(input.token_bytes, pct, cnt, avg_ms)
            }
            PrefillPolicy::TokenLoad => prefill::token_load(tokens.active, tokens.kv, tk.kv_weight),
            PrefillPolicy::HybridCacheLoad => prefill::hybrid(
                tokens.active,
                tokens.kv,
                tk.kv_weight,
                pct,
                tk.min_match_pct,
                tk.hybrid_factor,
            ),
        };
        if score.is_nan() {
            continue;
        }
        max_prefill = max_prefill.max(score);
        if let Some(r) = pod.roleset_idx {
            prefill_best[r].offer(score, i, rng);
        }
    }

    // Step 4: decode scoring, with cold-start scores for pods the gateway has no signal for.
    // Maxima are relative to the candidates still in play, as in AIBrix.
    if batch_of != decode.len() {
        batch = build_batch(&decode);
        batch_of = decode.len();
    }
    debug_assert_eq!(batch_of, batch.len());
    let rates = if s.decode_policy == DecodePolicy::TokenLoad {
        let pods: Vec<(Option<f64>, f64)> = decode
            .iter()
            .map(|&i| {
                let m = model.pods[i].metrics.as_ref().filter(|m| !m.stale);
                (
                    m.map(|m| m.generation_throughput),
                    m.map(|m| m.running).unwrap_or(0.0),
                )
            })
            .collect();
        tokens::decode_rates(&pods)
    } else {
        Vec::new()
    };
    let mut decode_best: Vec<MinPicker> = (0..rolesets).map(|_| MinPicker::new()).collect();
    let mut max_decode = DECODE_MAX_SCORE_FLOOR;
    for (k, &i) in decode.iter().enumerate() {
        let pod = &model.pods[i];
        let ledger_score = match rates.get(k) {
            Some(&rate) => rows[i]
                .tokens
                .decode_load(rate, input.now_ms, tk.output_growth),
            None => 0.0,
        };
        let Some(score) = batch.score(k, s.decode_policy, s.lb, ledger_score) else {
            continue;
        };
        max_decode = max_decode.max(score.value);
        if let Some(r) = pod.roleset_idx {
            decode_best[r].offer(score.value, i, rng);
        }
    }

    // Step 5: the roleset with the lowest normalised sum.
    let mut best = MinPicker::new();
    let norm = Normaliser::new(max_prefill, max_decode);
    for r in 0..rolesets {
        if let (Some((ps, p)), Some((ds, d))) = (prefill_best[r].best, decode_best[r].best) {
            let total = norm.sum(ps, ds);
            if let Some(x) = explain.as_deref_mut() {
                x.pairs.push(PairScore {
                    prefill: p,
                    prefill_score: ps,
                    decode: d,
                    decode_score: ds,
                    total,
                });
            }
            best.offer(total, r, rng);
        }
    }
    if let Some(x) = explain.as_deref_mut() {
        x.fast = fast;
    }
    let Some(r) = best.item() else {
        let missing = if prefill_best.iter().all(|p| p.best.is_none()) {
            "prefill"
        } else {
            "decode"
        };
        let detail = format!("target {missing} pod is nil");
        if let Some(x) = explain {
            x.error = Some(detail.clone());
        }
        return Err(RouteError::Selection { detail });
    };
    let (Some(p), Some(d)) = (prefill_best[r].item(), decode_best[r].item()) else {
        return Err(RouteError::Selection {
            detail: "target pod is nil".into(),
        });
    };
    if let Some(x) = explain {
        x.chosen = Some((p, d));
    }

    Ok(PairChoice::charged(model, p, d, &input, fast))
}

/// `select_pd` as first written.
pub fn select_pd(
    model: &ModelView,
    step0: Step0Input<'_>,
    ledger: &Ledger,
    pair: PairInput<'_>,
    rng: &mut fastrand::Rng,
) -> Result<Selected, RouteError> {
    match candidates::collect(model, step0, &mut |n| rng.usize(0..n))? {
        Step0::Combined(pod) => Ok(Selected::single(pod)),
        Step0::Pairs { prefill, decode } => {
            let rows = ledger.rows_for(&model.id_order, model.pods.len());
            let c = select_pair(model, prefill, decode, &rows, pair, rng)?;
            Ok(Selected::from(c))
        }
    }
}
