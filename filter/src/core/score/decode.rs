//! Decode-side inputs, the batch maxima every decode policy normalises by, the four decode
//! scores, the cold-start score, and the Step 2 load-imbalance fast path.
//!
//! A [`DecodeBatch`] is built once per selection from the candidates in the caller's order
//! (the fast path draws among ties instead of shuffling); the fast path and the scores then
//! read the same derived numbers, as in AIBrix where Step 2 computes the maxima that Step 4
//! reuses.

use super::DecodePolicy;
use crate::core::pd::MinPicker;

/// What the selection knows about one decode pod.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DecodeInput {
    /// Pending decodes plus the gateway's running count when the pod has the running metric;
    /// for a pod without it, just its pending-decode count.
    pub count: u32,
    /// The gateway has a running-request record for the pod ("metrics ready"). Pods without
    /// it stay out of the count spread, so a freshly restarted pod at 0 does not draw a
    /// thundering herd.
    pub has_running_metric: bool,
    /// Generation throughput, tokens/s; `None` when not scraped.
    pub throughput: Option<f64>,
    /// KV-cache usage as a fraction `0..=1`; `None` reads as empty (100 % free).
    pub kv_usage: Option<f64>,
    /// Completed requests per second over about a minute; `None` when unknown.
    pub drain_rate: Option<f64>,
}

/// The per-pod numbers the decode formulas use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeStats {
    /// Requests the pod holds (see [`DecodeInput::count`]).
    pub count: f64,
    /// Throughput in tokens/s, 0 when missing (so missing is the worst throughput).
    pub throughput: f64,
    /// Free KV percent, `round(100 − usage × 100)`, at least 0.1 so nothing divides by 0.
    pub free: f64,
}

/// Batch maxima, each at least 1, so the normalised terms stay in `0..=1` and finite.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeMaxima {
    pub count: f64,
    pub throughput: f64,
    pub free: f64,
}

/// Weights of the `load_balancing` numerator (`AIBRIX_DECODE_LB_WEIGHT_*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LbWeights {
    pub running: f64,
    pub throughput: f64,
}

impl Default for LbWeights {
    fn default() -> Self {
        LbWeights {
            running: 1.0,
            throughput: 1.0,
        }
    }
}

/// The decode candidates of one selection with their derived numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeBatch {
    inputs: Vec<DecodeInput>,
    stats: Vec<DecodeStats>,
    maxima: DecodeMaxima,
}

/// A usable metric value: finite and not negative (a counter reset can yield a negative rate).
pub fn usable(v: Option<f64>) -> Option<f64> {
    v.filter(|x| x.is_finite()).map(|x| x.max(0.0))
}

/// `round(100 − usage × 100)`, or 0.1 when the cache is full (or over-reported).
pub fn free_percent(kv_usage: Option<f64>) -> f64 {
    let usage = usable(kv_usage).unwrap_or(0.0);
    let free = (100.0 - usage * 100.0).round();
    if free <= 0.0 {
        0.1
    } else {
        free
    }
}

impl DecodeBatch {
    pub fn new(inputs: Vec<DecodeInput>) -> DecodeBatch {
        let stats: Vec<DecodeStats> = inputs
            .iter()
            .map(|i| DecodeStats {
                count: f64::from(i.count),
                throughput: usable(i.throughput).unwrap_or(0.0),
                free: free_percent(i.kv_usage),
            })
            .collect();
        let max_of = |f: fn(&DecodeStats) -> f64| stats.iter().map(f).fold(1.0, f64::max);
        // maxCount counts every pod (including metric-less ones); maxThroughput only the
        // observed values, which max(1, …) makes the same thing since missing reads as 0.
        let maxima = DecodeMaxima {
            count: max_of(|s| s.count),
            throughput: max_of(|s| s.throughput),
            free: max_of(|s| s.free),
        };
        DecodeBatch {
            inputs,
            stats,
            maxima,
        }
    }

    pub fn len(&self) -> usize {
        self.inputs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }

    pub fn input(&self, i: usize) -> Option<&DecodeInput> {
        self.inputs.get(i)
    }

    pub fn stats(&self, i: usize) -> Option<&DecodeStats> {
        self.stats.get(i)
    }

    pub fn maxima(&self) -> DecodeMaxima {
        self.maxima
    }

    /// Whether any pod has the running metric; only then do metric-less pods get the
    /// cold-start score (with none ready, every pod is scored by the policy alike).
    pub fn any_metrics_ready(&self) -> bool {
        self.inputs.iter().any(|i| i.has_running_metric)
    }

    /// Step 4 for pod `i`: the cold-start score for a metric-less pod when a sibling has
    /// metrics (not under `token_load`), else the policy's score; a NaN from a policy other
    /// than `load_balancing` is retried with `load_balancing`, and a NaN after that skips the
    /// pod (`None`). `token_load_score` is the ledger score (`decode + generated`), used only
    /// by `token_load`. ±∞ is a valid (if extreme) score.
    pub fn score(
        &self,
        i: usize,
        policy: DecodePolicy,
        weights: LbWeights,
        token_load_score: f64,
    ) -> Option<DecodeScore> {
        let input = self.inputs.get(i)?;
        let stats = self.stats.get(i)?;
        if policy.uses_cold_start() && !input.has_running_metric && self.any_metrics_ready() {
            return Some(DecodeScore {
                value: cold_start(input.count),
                source: ScoreSource::ColdStart,
            });
        }
        let value = match policy {
            DecodePolicy::LoadBalancing => load_balancing(stats, &self.maxima, weights),
            DecodePolicy::LeastRequest => least_request(stats),
            DecodePolicy::Conductor => conductor(stats),
            DecodePolicy::TokenLoad => token_load_score,
        };
        if !value.is_nan() {
            return Some(DecodeScore {
                value,
                source: ScoreSource::Policy,
            });
        }
        if policy == DecodePolicy::LoadBalancing {
            return None;
        }
        let value = load_balancing(stats, &self.maxima, weights);
        (!value.is_nan()).then_some(DecodeScore {
            value,
            source: ScoreSource::LoadBalancingFallback,
        })
    }
}

/// Where a decode score came from, for explanations and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreSource {
    Policy,
    ColdStart,
    LoadBalancingFallback,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeScore {
    pub value: f64,
    pub source: ScoreSource,
}

/// `load_balancing`: `(w_run × cnt/maxCnt + w_thru × (1 − thr/maxThr)) / (free/maxFree)`.
/// Busy, slow and KV-full pods score high; a full cache (free 0.1) multiplies the numerator
/// by up to 1000 against an empty one.
pub fn load_balancing(s: &DecodeStats, m: &DecodeMaxima, w: LbWeights) -> f64 {
    load_balancing_with(s.count, inv_max_count(m.count), lb_parts(s, m), w)
}

/// The terms of [`load_balancing`] that do not depend on the request counts: for a fixed set
/// of candidates they are the same on every request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LbParts {
    /// `1 − thr/maxThr`.
    pub slowness: f64,
    /// `maxFree/free`: the reciprocal of the denominator, so a score multiplies instead of
    /// dividing (a division per pod costs several multiplications' time over 1000 pods).
    pub inv_free: f64,
}

pub fn lb_parts(s: &DecodeStats, m: &DecodeMaxima) -> LbParts {
    LbParts {
        slowness: 1.0 - s.throughput / m.throughput.max(1.0),
        inv_free: m.free.max(1.0) / s.free,
    }
}

/// `1 / max(1, maxCnt)`, computed once per selection for [`load_balancing_with`].
pub fn inv_max_count(max_count: f64) -> f64 {
    1.0 / max_count.max(1.0)
}

/// [`load_balancing`] from the pod's count, [`inv_max_count`] of the batch's maximum count
/// and the fixed parts.
pub fn load_balancing_with(count: f64, inv_max_count: f64, parts: LbParts, w: LbWeights) -> f64 {
    let running = count * inv_max_count;
    (w.running * running + w.throughput * parts.slowness) * parts.inv_free
}

/// `least_request`: pending + running decode requests.
pub fn least_request(s: &DecodeStats) -> f64 {
    s.count
}

/// TBT assumed when a pod reports no throughput, in ms.
pub const CONDUCTOR_DEFAULT_TBT_MS: f64 = 20.0;
/// KV usage above which the conductor adds its GPU-pressure penalty.
pub const CONDUCTOR_PRESSURE_USAGE: f64 = 0.9;
pub const CONDUCTOR_PRESSURE_PENALTY: f64 = 1.5;

/// `conductor`: estimated time between tokens, ms. `1000/thr` (20 ms without throughput),
/// scaled by `1 + 1/max(cnt, 1)` for batching, ×1.5 above 90 % KV usage.
pub fn conductor(s: &DecodeStats) -> f64 {
    conductor_with(conductor_parts(s), s.count)
}

/// The count-independent part of [`conductor`]: the pod's base TBT and its KV pressure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConductorParts {
    pub tbt_ms: f64,
    pub pressure: bool,
}

pub fn conductor_parts(s: &DecodeStats) -> ConductorParts {
    ConductorParts {
        tbt_ms: if s.throughput > 0.0 {
            1000.0 / s.throughput
        } else {
            CONDUCTOR_DEFAULT_TBT_MS
        },
        pressure: 1.0 - s.free / 100.0 > CONDUCTOR_PRESSURE_USAGE,
    }
}

/// [`conductor`] from the fixed parts and the pod's count.
pub fn conductor_with(parts: ConductorParts, count: f64) -> f64 {
    let mut tbt = parts.tbt_ms;
    tbt *= 1.0 + 1.0 / count.max(1.0);
    if parts.pressure {
        tbt *= CONDUCTOR_PRESSURE_PENALTY;
    }
    tbt
}

/// `token_load` (decode): prompt KV charged to the pod plus the output it has generated since.
pub fn token_load(decode_tokens: f64, generated_tokens: f64) -> f64 {
    decode_tokens.max(0.0) + generated_tokens.max(0.0)
}

/// Cold start: a pod whose running metric has not appeared yet competes as if it held one
/// request more than its pending decodes, so it joins gradually instead of drawing everything.
pub fn cold_start(pending: u32) -> f64 {
    1.0 + f64::from(pending)
}

/// Step 2 thresholds (`AIBRIX_DECODE_*`), defaults 16 / 2048 / 1.5.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeThresholds {
    /// Count spread that fires check 1 (≥, unlike Step 1's >).
    pub count_spread: f64,
    /// Throughput spread, tokens/s, that fires check 2 (strict >).
    pub throughput_spread: f64,
    /// `max/min` drain score ratio that fires check 3 (strict >).
    pub drain_ratio: f64,
}

impl Default for DecodeThresholds {
    fn default() -> Self {
        DecodeThresholds {
            count_spread: 16.0,
            throughput_spread: 2048.0,
            drain_ratio: 1.5,
        }
    }
}

/// Which Step 2 check chose the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastPathCheck {
    CountSpread,
    ThroughputSpread,
    DrainRatio,
}

impl FastPathCheck {
    pub fn name(self) -> &'static str {
        match self {
            FastPathCheck::CountSpread => "count_spread",
            FastPathCheck::ThroughputSpread => "throughput_spread",
            FastPathCheck::DrainRatio => "drain_ratio",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastPathPick {
    /// Index into the batch.
    pub index: usize,
    pub check: FastPathCheck,
}

/// Lowest and highest of `(index, value)`; ties at the lowest are broken uniformly at random
/// ([`MinPicker`]'s rule), as AIBrix's strict < over a shuffled list does.
fn min_max(
    values: impl Iterator<Item = (usize, f64)>,
    rng: &mut fastrand::Rng,
) -> Option<((usize, f64), f64)> {
    let mut min = MinPicker::new();
    let mut max = f64::NEG_INFINITY;
    for (i, v) in values {
        min.offer(v, i, rng);
        max = max.max(v);
    }
    min.best.map(|(v, i)| ((i, v), max))
}

/// The drain score's denominator floor, so a near-zero rate cannot make a pod look infinite.
const MIN_DRAIN_RATE: f64 = 0.1;

/// Step 2: three checks in order; the first that fires picks one decode pod.
///
/// 1. Count spread over pods with the running metric: `max − min ≥ count_spread` → min count.
/// 2. Throughput spread over pods reporting throughput: `max − min > throughput_spread` → the
///    lowest-throughput pod.
/// 3. Only if **every** pod reports a drain rate > 0: `score = count / max(drain, 0.1)`; if
///    `min > 0` and `max/min > drain_ratio` → the lowest score (fastest estimated drain).
///
/// Ties at a minimum go to a uniformly random pod. The optimised selection fixes the
/// throughput figures with the candidate set, so that check draws once among the slowest
/// after it fires; the other two break ties as they scan. The caller skips this under decode
/// `token_load`.
pub fn decode_fast_path(
    batch: &DecodeBatch,
    th: &DecodeThresholds,
    rng: &mut fastrand::Rng,
) -> Option<FastPathPick> {
    let counted = batch
        .inputs
        .iter()
        .zip(&batch.stats)
        .enumerate()
        .filter(|(_, (input, _))| input.has_running_metric)
        .map(|(i, (_, s))| (i, s.count));
    if let Some(((index, min), max)) = min_max(counted, rng) {
        if max - min >= th.count_spread {
            return Some(FastPathPick {
                index,
                check: FastPathCheck::CountSpread,
            });
        }
    }

    let observed = || {
        batch
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(i, input)| usable(input.throughput).map(|t| (i, t)))
    };
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    for (_, t) in observed() {
        (min, max) = (min.min(t), max.max(t));
    }
    if max - min > th.throughput_spread {
        let slowest = observed().filter(|&(_, t)| t == min).count();
        let j = if slowest > 1 { rng.usize(..slowest) } else { 0 };
        if let Some((index, _)) = observed().filter(|&(_, t)| t == min).nth(j) {
            return Some(FastPathPick {
                index,
                check: FastPathCheck::ThroughputSpread,
            });
        }
    }

    let all_draining = !batch.is_empty()
        && batch
            .inputs
            .iter()
            .all(|i| i.drain_rate.is_some_and(|d| d.is_finite() && d > 0.0));
    if all_draining {
        let scores = batch
            .inputs
            .iter()
            .zip(&batch.stats)
            .enumerate()
            .map(|(i, (input, s))| {
                let drain = input
                    .drain_rate
                    .unwrap_or(MIN_DRAIN_RATE)
                    .max(MIN_DRAIN_RATE);
                (i, s.count / drain)
            });
        if let Some(((index, min), max)) = min_max(scores, rng) {
            if min > 0.0 && max / min > th.drain_ratio {
                return Some(FastPathPick {
                    index,
                    check: FastPathCheck::DrainRatio,
                });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    /// A pod with the running metric.
    fn pod(count: u32, thr: Option<f64>, kv: Option<f64>) -> DecodeInput {
        DecodeInput {
            count,
            has_running_metric: true,
            throughput: thr,
            kv_usage: kv,
            drain_rate: None,
        }
    }

    fn cold(pending: u32) -> DecodeInput {
        DecodeInput {
            count: pending,
            ..DecodeInput::default()
        }
    }

    fn draining(count: u32, drain: Option<f64>) -> DecodeInput {
        DecodeInput {
            drain_rate: drain,
            ..pod(count, None, None)
        }
    }

    fn stats(b: &DecodeBatch) -> Vec<(f64, f64, f64)> {
        (0..b.len())
            .map(|i| {
                let s = b.stats(i).unwrap();
                (s.count, s.throughput, s.free)
            })
            .collect()
    }

    fn maxima(b: &DecodeBatch) -> (f64, f64, f64) {
        let m = b.maxima();
        (m.count, m.throughput, m.free)
    }

    fn pick(b: &DecodeBatch) -> Option<(usize, FastPathCheck)> {
        let mut rng = fastrand::Rng::with_seed(1);
        decode_fast_path(b, &DecodeThresholds::default(), &mut rng).map(|p| (p.index, p.check))
    }

    /// The pods `b`'s fast path picks over many draws, and by which check.
    fn picks(b: &DecodeBatch) -> (std::collections::BTreeSet<usize>, Option<FastPathCheck>) {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut seen = std::collections::BTreeSet::new();
        let mut check = None;
        for _ in 0..200 {
            if let Some(p) = decode_fast_path(b, &DecodeThresholds::default(), &mut rng) {
                seen.insert(p.index);
                check = Some(p.check);
            }
        }
        (seen, check)
    }

    #[test]
    fn spec_fast_path_vectors() {
        use FastPathCheck::*;
        // §9.5 decode: balanced → none, maxima and per-pod maps exact.
        let b = DecodeBatch::new(vec![
            pod(5, Some(100.0), Some(0.5)),
            pod(7, Some(120.0), Some(0.6)),
        ]);
        assert_eq!(pick(&b), None);
        assert_eq!(maxima(&b), (7.0, 120.0, 50.0));
        assert_eq!(stats(&b), [(5.0, 100.0, 50.0), (7.0, 120.0, 40.0)]);

        // Count imbalance {2, 40, 35} → pod1 (index 0), maxFree 70.
        let b = DecodeBatch::new(vec![
            pod(2, Some(100.0), Some(0.3)),
            pod(40, Some(100.0), Some(0.5)),
            pod(35, Some(100.0), Some(0.4)),
        ]);
        assert_eq!(pick(&b), Some((0, CountSpread)));
        assert_eq!(b.maxima().free, 70.0);

        // Throughput {50, 3000} → the slow pod.
        let b = DecodeBatch::new(vec![pod(3, Some(50.0), None), pod(3, Some(3000.0), None)]);
        assert_eq!(pick(&b), Some((0, ThroughputSpread)));
        // Throughput {100, 200} → none.
        let b = DecodeBatch::new(vec![pod(3, Some(100.0), None), pod(3, Some(200.0), None)]);
        assert_eq!(pick(&b), None);
        // Counts {0, 5} → none.
        let b = DecodeBatch::new(vec![pod(0, None, None), pod(5, None, None)]);
        assert_eq!(pick(&b), None);

        // No metrics at all → none, maxima 1/1/100, pod maps {0, 0, 100}.
        let b = DecodeBatch::new(vec![cold(0), cold(0)]);
        assert_eq!(pick(&b), None);
        assert_eq!(maxima(&b), (1.0, 1.0, 100.0));
        assert_eq!(stats(&b), [(0.0, 0.0, 100.0), (0.0, 0.0, 100.0)]);

        // High KV usage → free {5, 0.1}, maxFree 5.
        let b = DecodeBatch::new(vec![pod(1, None, Some(0.95)), pod(1, None, Some(1.0))]);
        assert_eq!(stats(&b)[0].2, 5.0);
        assert_eq!(stats(&b)[1].2, 0.1);
        assert_eq!(b.maxima().free, 5.0);

        // Drain {8/2.0, 6/0.3} → scores 4 vs 20 → pod1.
        let b = DecodeBatch::new(vec![draining(8, Some(2.0)), draining(6, Some(0.3))]);
        assert_eq!(pick(&b), Some((0, DrainRatio)));
        // Drain {8/2.0, 6/1.5} → 4 vs 4 → none.
        let b = DecodeBatch::new(vec![draining(8, Some(2.0)), draining(6, Some(1.5))]);
        assert_eq!(pick(&b), None);
        // One drain rate missing (or zero) → none.
        let b = DecodeBatch::new(vec![draining(8, Some(2.0)), draining(6, None)]);
        assert_eq!(pick(&b), None);
        let b = DecodeBatch::new(vec![draining(8, Some(2.0)), draining(6, Some(0.0))]);
        assert_eq!(pick(&b), None);
    }

    #[test]
    fn count_spread_is_inclusive_and_ignores_cold_pods() {
        use FastPathCheck::*;
        // Exactly 16 fires (≥).
        let b = DecodeBatch::new(vec![pod(20, None, None), pod(4, None, None)]);
        assert_eq!(pick(&b), Some((1, CountSpread)));
        let b = DecodeBatch::new(vec![pod(19, None, None), pod(4, None, None)]);
        assert_eq!(pick(&b), None);
        // A cold pod at 0 does not make a spread, and is never the pick …
        let b = DecodeBatch::new(vec![cold(0), pod(10, None, None), pod(12, None, None)]);
        assert_eq!(pick(&b), None);
        let b = DecodeBatch::new(vec![cold(0), pod(30, None, None), pod(10, None, None)]);
        assert_eq!(pick(&b), Some((2, CountSpread)));
        // … but its pending count still raises maxCount for scoring.
        let b = DecodeBatch::new(vec![cold(9), pod(3, None, None)]);
        assert_eq!(b.maxima().count, 9.0);
    }

    #[test]
    fn ties_at_a_minimum_go_to_any_of_the_tied_pods() {
        use FastPathCheck::*;
        let set = |picked: &[usize]| picked.iter().copied().collect();
        let b = DecodeBatch::new(vec![
            pod(40, None, None),
            pod(1, None, None),
            pod(1, None, None),
        ]);
        assert_eq!(picks(&b), (set(&[1, 2]), Some(CountSpread)));
        // Two idle pods and a busy one: every request until the next scrape would go to the
        // first idle pod if ties were not broken.
        let b = DecodeBatch::new(vec![
            pod(3, Some(0.0), None),
            pod(3, Some(0.0), None),
            pod(3, Some(3000.0), None),
        ]);
        assert_eq!(picks(&b), (set(&[0, 1]), Some(ThroughputSpread)));
        let b = DecodeBatch::new(vec![
            draining(8, Some(1.0)),
            draining(2, Some(1.0)),
            draining(2, Some(1.0)),
        ]);
        assert_eq!(picks(&b), (set(&[1, 2]), Some(DrainRatio)));
    }

    #[test]
    fn checks_run_in_order_and_missing_throughput_is_excluded() {
        use FastPathCheck::*;
        // Both a count and a throughput spread: the count check wins.
        let b = DecodeBatch::new(vec![pod(40, Some(10.0), None), pod(2, Some(5000.0), None)]);
        assert_eq!(pick(&b), Some((1, CountSpread)));
        // Throughput beats drain.
        let mut slow = draining(8, Some(2.0));
        slow.throughput = Some(10.0);
        let mut fast = draining(6, Some(0.3));
        fast.throughput = Some(4000.0);
        let b = DecodeBatch::new(vec![fast, slow]);
        assert_eq!(pick(&b), Some((1, ThroughputSpread)));
        // A pod without throughput is not "0 tok/s" for the spread.
        let b = DecodeBatch::new(vec![pod(3, None, None), pod(3, Some(3000.0), None)]);
        assert_eq!(pick(&b), None);
        // Strict >: a spread of exactly 2048 does not fire.
        let b = DecodeBatch::new(vec![pod(3, Some(0.0), None), pod(3, Some(2048.0), None)]);
        assert_eq!(pick(&b), None);
        // Custom thresholds.
        let th = DecodeThresholds {
            count_spread: 2.0,
            throughput_spread: 10.0,
            drain_ratio: 1.1,
        };
        let b = DecodeBatch::new(vec![pod(5, None, None), pod(3, None, None)]);
        assert_eq!(
            decode_fast_path(&b, &th, &mut fastrand::Rng::with_seed(1)),
            Some(FastPathPick {
                index: 1,
                check: CountSpread
            })
        );
        assert_eq!(pick(&DecodeBatch::new(vec![])), None);
    }

    #[test]
    fn drain_check_details() {
        use FastPathCheck::*;
        // The drain check uses every pod's count, cold pods included, and floors drain at 0.1.
        let mut c = cold(2);
        c.drain_rate = Some(0.01); // 2 / 0.1 = 20
        let b = DecodeBatch::new(vec![c, draining(4, Some(1.0))]);
        assert_eq!(pick(&b), Some((1, DrainRatio)));
        // A zero minimum score (an idle pod) disables the ratio.
        let b = DecodeBatch::new(vec![draining(0, Some(1.0)), draining(9, Some(1.0))]);
        assert_eq!(pick(&b), None);
    }

    #[test]
    fn conductor_spec_vectors() {
        // §4.9: (cnt, thr, free) → score.
        let cases = [
            (4.0, 50.0, 5.0, 37.5),
            (2.0, 0.0, 50.0, 30.0),
            (0.0, 50.0, 50.0, 40.0),
            (1.0, 100.0, 10.0, 20.0), // exactly 90 % used: no penalty
            (1.0, 100.0, 9.0, 30.0),
        ];
        for (count, throughput, free, want) in cases {
            let s = DecodeStats {
                count,
                throughput,
                free,
            };
            assert!(close(conductor(&s), want), "{s:?} → {}", conductor(&s));
        }
    }

    #[test]
    fn load_balancing_formula() {
        let m = DecodeMaxima {
            count: 8.0,
            throughput: 200.0,
            free: 80.0,
        };
        let w = LbWeights::default();
        // (cnt, thr, free, score)
        let cases = [
            (0.0, 200.0, 80.0, 0.0),
            (8.0, 0.0, 80.0, 2.0),
            (4.0, 100.0, 40.0, 2.0), // (0.5 + 0.5) / 0.5
            (2.0, 150.0, 80.0, 0.5),
            (8.0, 0.0, 0.1, 1600.0),
        ];
        for (count, throughput, free, want) in cases {
            let s = DecodeStats {
                count,
                throughput,
                free,
            };
            assert!(close(load_balancing(&s, &m, w), want), "{s:?}");
        }
        let s = DecodeStats {
            count: 4.0,
            throughput: 100.0,
            free: 80.0,
        };
        let w = LbWeights {
            running: 2.0,
            throughput: 0.0,
        };
        assert!(close(load_balancing(&s, &m, w), 1.0));
    }

    #[test]
    fn simple_scores() {
        let s = DecodeStats {
            count: 3.0,
            throughput: 0.0,
            free: 100.0,
        };
        assert_eq!(least_request(&s), 3.0);
        assert_eq!(token_load(1200.0, 345.5), 1545.5);
        assert_eq!(token_load(-1.0, 10.0), 10.0);
        assert_eq!(cold_start(0), 1.0);
        assert_eq!(cold_start(4), 5.0);
    }

    #[test]
    fn batch_scoring_with_cold_start() {
        let b = DecodeBatch::new(vec![cold(2), pod(3, Some(100.0), Some(0.5))]);
        let w = LbWeights::default();
        for policy in [
            DecodePolicy::LoadBalancing,
            DecodePolicy::LeastRequest,
            DecodePolicy::Conductor,
        ] {
            let s = b.score(0, policy, w, 0.0).unwrap();
            assert_eq!((s.value, s.source), (3.0, ScoreSource::ColdStart));
            assert_eq!(
                b.score(1, policy, w, 0.0).unwrap().source,
                ScoreSource::Policy
            );
        }
        assert_eq!(
            b.score(1, DecodePolicy::LeastRequest, w, 0.0)
                .unwrap()
                .value,
            3.0
        );
        // token_load scores cold pods from the ledger.
        let s = b.score(0, DecodePolicy::TokenLoad, w, 777.0).unwrap();
        assert_eq!((s.value, s.source), (777.0, ScoreSource::Policy));
        // Without any ready pod nobody gets the cold-start score.
        let b = DecodeBatch::new(vec![cold(2), cold(0)]);
        let s = b.score(0, DecodePolicy::LeastRequest, w, 0.0).unwrap();
        assert_eq!((s.value, s.source), (2.0, ScoreSource::Policy));
        assert!(b.score(5, DecodePolicy::LeastRequest, w, 0.0).is_none());
    }

    #[test]
    fn nan_falls_back_to_load_balancing() {
        let b = DecodeBatch::new(vec![pod(2, Some(50.0), Some(0.5))]);
        let w = LbWeights::default();
        let s = b.score(0, DecodePolicy::TokenLoad, w, f64::NAN).unwrap();
        assert_eq!(s.source, ScoreSource::LoadBalancingFallback);
        assert!(close(s.value, (1.0 + 0.0) / 1.0));
        let nan_weights = LbWeights {
            running: f64::NAN,
            throughput: 1.0,
        };
        assert!(b
            .score(0, DecodePolicy::LoadBalancing, nan_weights, 0.0)
            .is_none());
        assert!(b
            .score(0, DecodePolicy::TokenLoad, nan_weights, f64::NAN)
            .is_none());
        // ±∞ is accepted as a score.
        let s = b
            .score(0, DecodePolicy::TokenLoad, w, f64::INFINITY)
            .unwrap();
        assert_eq!(s.value, f64::INFINITY);
    }

    #[test]
    fn hostile_metric_values_are_sanitised() {
        let b = DecodeBatch::new(vec![DecodeInput {
            count: 1,
            has_running_metric: true,
            throughput: Some(f64::NAN),
            kv_usage: Some(-3.0),
            drain_rate: Some(f64::INFINITY),
        }]);
        assert_eq!(stats(&b), [(1.0, 0.0, 100.0)]);
        assert_eq!(pick(&b), None);
        let b = DecodeBatch::new(vec![pod(1, Some(-5.0), Some(7.0))]);
        assert_eq!(stats(&b), [(1.0, 0.0, 0.1)]);
    }
}
