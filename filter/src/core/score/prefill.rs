//! Prefill-side formulas: the five scoring policies, the σ filter that keeps outliers out of
//! scoring, and the Step 1 load-imbalance fast path.
//!
//! Match percentages are `f64` in `0..=100` (the prefix index yields whole percents; the
//! threshold `AIBRIX_MIN_MATCH_PCT` may be fractional). Out-of-range or non-finite inputs are
//! clamped rather than trusted, since they come from request data and scraped metrics.

/// Weight of the cache term in `prefix_cache`: a full miss costs 10, the load term at most 1.
pub const PREFIX_CACHE_MATCH_WEIGHT: f64 = 0.1;

/// Conductor prefill model (AIBrix constants): time per cached token and its fixed cost …
pub const CONDUCTOR_A_PREFIX: f64 = 0.005;
pub const CONDUCTOR_B_PREFIX: f64 = 1.0;
/// … and `A × unmatched^B + C` for the tokens the pod must compute (attention is superlinear).
pub const CONDUCTOR_A_PREFILL: f64 = 0.001;
pub const CONDUCTOR_B_PREFILL: f64 = 1.5;
pub const CONDUCTOR_C_PREFILL: f64 = 5.0;
/// Without a prefill-time histogram the queue is priced as a 512-token prefill.
pub const CONDUCTOR_FALLBACK_TOKENS: f64 = 512.0;

/// A match percentage made safe, with `AIBRIX_MIN_MATCH_PCT` applied: clamped to `0..=100`,
/// and 0 when below the threshold, so an incidental match on a shared system prompt does not
/// attract a burst of cold prompts to one pod. A threshold of 0 disables the rule.
pub fn effective_match_pct(match_pct: f64, min_match_pct: f64) -> f64 {
    let pct = if match_pct.is_finite() {
        match_pct.clamp(0.0, 100.0)
    } else {
        0.0
    };
    if min_match_pct.is_finite() && pct < min_match_pct {
        0.0
    } else {
        pct
    }
}

/// `prefix_cache`: `(100 − match) × 0.1 + cnt / max_req`. The seed applies the minimum match
/// to this policy too (the spec only found it for hybrid); pass a pct already filtered by
/// [`effective_match_pct`]. `max_req` is `max(1, counts)`, so a 0 here is treated as 1.
pub fn prefix_cache(match_pct: f64, cnt: u32, max_req: u32) -> f64 {
    prefix_cache_with(prefix_cache_miss(match_pct), cnt, reciprocal(max_req))
}

/// `1 / max(1, max_req)`: a selection divides by it once and multiplies per pod (a division
/// per pod costs several multiplications' time in a wasm loop over 1000 pods).
pub fn reciprocal(max_req: u32) -> f64 {
    1.0 / f64::from(max_req.max(1))
}

/// The cache term of [`prefix_cache`], `(100 − match) × 0.1`: most pods of one request share
/// a match percentage (usually 0), so a selection computes it once per distinct match.
pub fn prefix_cache_miss(match_pct: f64) -> f64 {
    (100.0 - effective_match_pct(match_pct, 0.0)) * PREFIX_CACHE_MATCH_WEIGHT
}

/// [`prefix_cache`] from its cache term and [`reciprocal`]`(max_req)`.
pub fn prefix_cache_with(miss: f64, cnt: u32, inv_max_req: f64) -> f64 {
    miss + f64::from(cnt) * inv_max_req
}

/// `least_request`: the raw in-flight prefill count.
pub fn least_request(cnt: u32) -> f64 {
    f64::from(cnt)
}

/// `0.001 × tokens^1.5 + 5`: the conductor's prefill-time model, in ms.
fn conductor_prefill_ms(tokens: f64) -> f64 {
    CONDUCTOR_A_PREFILL * tokens.powf(CONDUCTOR_B_PREFILL) + CONDUCTOR_C_PREFILL
}

/// `conductor`: estimated TTFT in ms = queue + cached prefix + unmatched prefill.
///
/// `token_bytes` is AIBrix's `T`, the tokenizer output length in bytes (a quirk kept for
/// parity: the tiktoken stream counts 4 bytes per token). `avg_prefill_ms` is the mean of the
/// pod's prefill-time histogram; `None` (no histogram, or no samples) and unusable values
/// (negative, non-finite) price the queue with the 512-token estimate (≈ 16.585 ms).
pub fn conductor(token_bytes: usize, match_pct: f64, cnt: u32, avg_prefill_ms: Option<f64>) -> f64 {
    conductor_with(conductor_parts(token_bytes, match_pct), cnt, avg_prefill_ms)
}

/// The part of [`conductor`] that depends only on the prompt and the pod's match:
/// `(cached prefix ms, unmatched prefill ms)`. It holds the `powf`, and most pods of one
/// request share a match percentage, so a selection computes it once per distinct match.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ConductorParts {
    pub prefix_ms: f64,
    pub prefill_ms: f64,
}

pub fn conductor_parts(token_bytes: usize, match_pct: f64) -> ConductorParts {
    let total = token_bytes as f64;
    let matched = total * effective_match_pct(match_pct, 0.0) / 100.0;
    let unmatched = total - matched;
    ConductorParts {
        prefix_ms: if matched > 0.0 {
            CONDUCTOR_A_PREFIX * matched + CONDUCTOR_B_PREFIX
        } else {
            0.0
        },
        prefill_ms: if unmatched > 0.0 {
            conductor_prefill_ms(unmatched)
        } else {
            0.0
        },
    }
}

/// [`conductor`] from its prompt-only parts: `queue + prefix + prefill`, in that order.
pub fn conductor_with(parts: ConductorParts, cnt: u32, avg_prefill_ms: Option<f64>) -> f64 {
    let per_request = avg_prefill_ms
        .filter(|ms| ms.is_finite() && *ms >= 0.0)
        .unwrap_or_else(|| conductor_prefill_ms(CONDUCTOR_FALLBACK_TOKENS));
    let queue = f64::from(cnt) * per_request;
    queue + parts.prefix_ms + parts.prefill_ms
}

/// `token_load`: `active + kv_weight × kv`, the prefill work charged to the pod in tokens.
pub fn token_load(active: f64, kv: f64, kv_weight: f64) -> f64 {
    active.max(0.0) + kv_weight * kv.max(0.0)
}

/// `hybrid_cache_load`: `load × (1 − r² × factor)` with `r = match/100` (0 below
/// `min_match_pct`), or the bare discount when the pod is idle (`load < 1`).
///
/// On idle pods every score is a discount below 1, so the best prefix match wins outright; on
/// busy pods the match only discounts the load, and the square keeps small matches from
/// moving the decision (30 % → 4.5 %, 70 % → 24.5 % at factor 0.5).
pub fn hybrid(
    active: f64,
    kv: f64,
    kv_weight: f64,
    match_pct: f64,
    min_match_pct: f64,
    factor: f64,
) -> f64 {
    let load = token_load(active, kv, kv_weight);
    let discount = hybrid_discount(match_pct, min_match_pct, factor);
    if load >= 1.0 {
        load * discount
    } else {
        discount
    }
}

/// `1 − r² × factor`, the multiplier [`hybrid`] applies to a pod's load.
pub fn hybrid_discount(match_pct: f64, min_match_pct: f64, factor: f64) -> f64 {
    let r = effective_match_pct(match_pct, min_match_pct) / 100.0;
    let factor = if factor.is_finite() {
        factor.clamp(0.0, 1.0)
    } else {
        0.0
    };
    1.0 - r * r * factor
}

/// `max(1, counts)`: the load normaliser of `prefix_cache`.
pub fn max_req(counts: &[u32]) -> u32 {
    counts.iter().copied().max().unwrap_or(0).max(1)
}

/// Mean and **sample** standard deviation (n − 1) of the candidates' in-flight counts; the
/// deviation is 0 for n ≤ 1 (one pod is never an outlier).
pub fn mean_std(counts: &[u32]) -> (f64, f64) {
    mean_std_with(counts, CountStats::of(counts))
}

/// Lowest, highest and total of the candidates' in-flight counts (one pass).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CountStats {
    pub min: u32,
    pub max: u32,
    pub sum: u64,
}

impl CountStats {
    pub fn of(counts: &[u32]) -> CountStats {
        let mut s = CountStats {
            min: u32::MAX,
            max: 0,
            sum: 0,
        };
        for &c in counts {
            s.min = s.min.min(c);
            s.max = s.max.max(c);
            s.sum += u64::from(c);
        }
        s
    }
}

/// [`mean_std`] given the counts' [`CountStats`]. Whole counts add up exactly in `f64`, so
/// the mean is the exact sum over n; equal counts deviate by exactly 0.
pub fn mean_std_with(counts: &[u32], stats: CountStats) -> (f64, f64) {
    let n = counts.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let mean = stats.sum as f64 / n as f64;
    if n == 1 || stats.min == stats.max {
        return (mean, 0.0);
    }
    let var = counts
        .iter()
        .map(|&c| (f64::from(c) - mean).powi(2))
        .sum::<f64>()
        / (n - 1) as f64;
    (mean, var.sqrt())
}

/// The σ filter: a pod whose count exceeds `mean + factor × std` is skipped in scoring, so a
/// pod that is already swamped is not picked for its cache (strict >: at the bound it stays).
pub fn skip(cnt: u32, mean: f64, std: f64, factor: f64) -> bool {
    f64::from(cnt) > skip_bound(mean, std, factor)
}

/// `mean + factor × std`: the count above which [`skip`] drops a pod (one per selection).
pub fn skip_bound(mean: f64, std: f64, factor: f64) -> f64 {
    mean + factor * std
}

/// Step 1: when `max − min` of the in-flight prefill counts exceeds `min_spread` (strict >),
/// the index of a uniformly random pod among those at the minimum; otherwise (or with no
/// pods) `None`. Counts are in the caller's candidate order.
pub fn prefill_fast_path(
    counts: &[u32],
    min_spread: u32,
    rng: &mut fastrand::Rng,
) -> Option<usize> {
    prefill_fast_path_with(counts, CountStats::of(counts), min_spread, rng)
}

/// [`prefill_fast_path`] given the counts' [`CountStats`].
pub fn prefill_fast_path_with(
    counts: &[u32],
    stats: CountStats,
    min_spread: u32,
    rng: &mut fastrand::Rng,
) -> Option<usize> {
    let (min, max) = (stats.min, stats.max);
    if counts.is_empty() || max - min <= min_spread {
        return None;
    }
    let at_min: Vec<usize> = (0..counts.len()).filter(|&i| counts[i] == min).collect();
    at_min.get(rng.usize(0..at_min.len())).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn prefix_cache_formula() {
        // (match, cnt, max_req, score)
        let cases = [
            (100.0, 0, 1, 0.0),
            (0.0, 0, 1, 10.0),
            (50.0, 3, 6, 5.5),
            (75.0, 2, 8, 2.75),
            (100.0, 7, 7, 1.0),
            (0.0, 5, 0, 15.0),  // max_req 0 is floored to 1
            (150.0, 0, 1, 0.0), // clamped
            (f64::NAN, 0, 1, 10.0),
        ];
        for (pct, cnt, max, want) in cases {
            let got = prefix_cache(pct, cnt, max);
            assert!(
                close(got, want),
                "({pct}, {cnt}, {max}) = {got}, want {want}"
            );
        }
        // A higher match wins at equal load; fewer requests win at equal match.
        assert!(prefix_cache(80.0, 1, 4) < prefix_cache(40.0, 1, 4));
        assert!(prefix_cache(50.0, 0, 4) < prefix_cache(50.0, 3, 4));
    }

    #[test]
    fn least_request_is_the_count() {
        assert_eq!(least_request(0), 0.0);
        assert_eq!(least_request(3), 3.0);
        assert_eq!(least_request(7), 7.0);
    }

    #[test]
    fn conductor_spec_vectors() {
        let fallback = 0.001 * 512f64.powf(1.5) + 5.0;
        assert!((fallback - 16.585).abs() < 1e-3);
        // (T, match, cnt, avg_ms, score)
        let cases = [
            // §9.3: mean 2 ms, cnt 3, a 4-byte message all unmatched → 6 + 5.008.
            (4, 0.0, 3, Some(2.0), 11.008),
            // An empty message → queue only.
            (0, 0.0, 3, Some(2.0), 6.0),
            // No histogram → the 512-token estimate per queued request.
            (0, 0.0, 2, None, 2.0 * fallback),
            (0, 0.0, 1, Some(-1.0), fallback),
            // cnt 0 → no queue; fully matched 100 bytes → 0.005 × 100 + 1.
            (100, 100.0, 0, None, 1.5),
            // Half matched 200 bytes: prefix 0.005×100+1 = 1.5, prefill 0.001×100^1.5+5 = 6.
            (200, 50.0, 0, Some(3.0), 7.5),
        ];
        for (t, pct, cnt, avg, want) in cases {
            let got = conductor(t, pct, cnt, avg);
            assert!(
                close(got, want),
                "({t}, {pct}, {cnt}, {avg:?}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn token_load_formula() {
        let cases = [
            (0.0, 0.0, 0.3, 0.0),
            (1000.0, 0.0, 0.3, 1000.0),
            (0.0, 1000.0, 0.3, 300.0),
            (3500.0, 7000.0, 0.3, 5600.0),
            (100.0, 100.0, 1.0, 200.0),
        ];
        for (a, k, w, want) in cases {
            assert!(close(token_load(a, k, w), want), "({a}, {k}, {w})");
        }
    }

    #[test]
    fn hybrid_discounts_match_the_seed() {
        // The seed's numbers: a 30 % match discounts by 4.5 %, 70 % by 24.5 %, full by half.
        let cases = [(0.0, 0.0), (30.0, 0.045), (70.0, 0.245), (100.0, 0.5)];
        for (pct, cut) in cases {
            let d = hybrid_discount(pct, 0.0, 0.5);
            assert!(close(1.0 - d, cut), "{pct}% → {}", 1.0 - d);
        }
        // Factor 1 makes a full match score 0; factor 0 turns the discount off.
        assert!(close(hybrid_discount(100.0, 0.0, 1.0), 0.0));
        assert!(close(hybrid_discount(100.0, 0.0, 0.0), 1.0));
        // Out-of-range factors are clamped.
        assert!(close(hybrid_discount(100.0, 0.0, 7.0), 0.0));
    }

    #[test]
    fn hybrid_score_idle_and_busy() {
        // (active, kv, weight, match, min, factor, score)
        let cases = [
            // Idle pods: bare discount, the better match wins.
            (0.0, 0.0, 0.3, 70.0, 0.0, 0.5, 0.755),
            (0.0, 0.0, 0.3, 30.0, 0.0, 0.5, 0.955),
            (0.0, 0.0, 0.3, 0.0, 0.0, 0.5, 1.0),
            // load 0.9 < 1 still counts as idle.
            (0.0, 3.0, 0.3, 100.0, 0.0, 0.5, 0.5),
            // Busy: load × discount.
            (1000.0, 0.0, 0.3, 100.0, 0.0, 0.5, 500.0),
            (1000.0, 1000.0, 0.3, 70.0, 0.0, 0.5, 1300.0 * 0.755),
            // Below the minimum match, the match counts as 0.
            (1000.0, 0.0, 0.3, 30.0, 40.0, 0.5, 1000.0),
            (1000.0, 0.0, 0.3, 40.0, 40.0, 0.5, 1000.0 * 0.92),
        ];
        for (a, k, w, pct, min, f, want) in cases {
            let got = hybrid(a, k, w, pct, min, f);
            assert!(
                close(got, want),
                "({a},{k},{w},{pct},{min},{f}) = {got}, want {want}"
            );
        }
        // A full match loses once its pod carries more than twice an idle neighbour's load.
        assert!(
            hybrid(2001.0, 0.0, 0.3, 100.0, 0.0, 0.5) > hybrid(1000.0, 0.0, 0.3, 0.0, 0.0, 0.5)
        );
        assert!(
            hybrid(1999.0, 0.0, 0.3, 100.0, 0.0, 0.5) < hybrid(1000.0, 0.0, 0.3, 0.0, 0.0, 0.5)
        );
    }

    #[test]
    fn min_match_threshold() {
        let cases = [
            (30.0, 0.0, 30.0),
            (30.0, 40.0, 0.0),
            (40.0, 40.0, 40.0),
            (-5.0, 0.0, 0.0),
            (120.0, 50.0, 100.0),
            (f64::INFINITY, 0.0, 0.0),
        ];
        for (pct, min, want) in cases {
            assert_eq!(effective_match_pct(pct, min), want, "({pct}, {min})");
        }
    }

    #[test]
    fn sigma_filter() {
        assert_eq!(mean_std(&[]), (0.0, 0.0));
        assert_eq!(mean_std(&[5]), (5.0, 0.0));
        let (m, s) = mean_std(&[2, 4, 4, 4, 5, 5, 7, 9]);
        assert!(close(m, 5.0));
        assert!(
            close(s, (32.0f64 / 7.0).sqrt()),
            "sample, not population: {s}"
        );
        let (m, s) = mean_std(&[0, 1000]);
        assert!(close(m, 500.0) && close(s, 500.0 * 2f64.sqrt()));
        // Two pods: the outlier sits at mean + std/√2, never skipped with factor 1.
        assert!(!skip(1000, m, s, 1.0));
        // Three pods, one swamped: mean 333.3, std 577.4 → 1000 > 910.7, skipped.
        let (m, s) = mean_std(&[0, 0, 1000]);
        assert!(skip(1000, m, s, 1.0));
        assert!(!skip(0, m, s, 1.0));
        assert!(!skip(1000, m, s, 2.0));
        // Equal counts: std 0 and nobody is above the mean.
        let (m, s) = mean_std(&[3, 3, 3]);
        assert!(!skip(3, m, s, 1.0));
        // Strict >: exactly at the bound stays in.
        assert!(!skip(6, 4.0, 2.0, 1.0));
        assert!(skip(7, 4.0, 2.0, 1.0));
        assert_eq!(max_req(&[]), 1);
        assert_eq!(max_req(&[0, 0]), 1);
        assert_eq!(max_req(&[3, 7, 1]), 7);
    }

    #[test]
    fn prefill_fast_path_cases() {
        let mut rng = fastrand::Rng::with_seed(42);
        // §9.5 prefill: (counts, spread, allowed picks)
        type Case<'a> = (&'a [u32], u32, Option<&'a [usize]>);
        let cases: &[Case] = &[
            (&[5, 5, 5], 16, None),
            (&[0, 16], 16, None), // difference within the threshold (strict >)
            (&[0, 17], 16, Some(&[0])),
            (&[1, 30, 40], 16, Some(&[0])),
            (&[40, 2, 2, 30], 16, Some(&[1, 2])),
            (&[], 16, None),
            (&[100], 16, None),
            (&[0, 1000], 16, Some(&[0])),
        ];
        for (counts, spread, want) in cases {
            let got = prefill_fast_path(counts, *spread, &mut rng);
            match want {
                None => assert_eq!(got, None, "{counts:?}"),
                Some(allowed) => {
                    let got = got.unwrap_or(usize::MAX);
                    assert!(allowed.contains(&got), "{counts:?} → {got}");
                }
            }
        }
    }

    #[test]
    fn prefill_fast_path_spreads_ties_at_random() {
        let mut rng = fastrand::Rng::with_seed(9);
        let counts = [0, 50, 0, 0];
        let mut seen = [0u32; 4];
        for _ in 0..300 {
            if let Some(i) = prefill_fast_path(&counts, 16, &mut rng) {
                seen[i] += 1;
            }
        }
        assert_eq!(seen[1], 0);
        assert!(seen[0] > 50 && seen[2] > 50 && seen[3] > 50, "{seen:?}");
    }
}
