//! Every time between chunks of a run's streams, as one distribution: the quantity of the
//! target "streamed responses show no stalls (p99 of time-between-chunks at the gateway ≈ the
//! engine's)".
//!
//! Why not each stream's longest gap (`max_gap_ms`) alone: that is one figure per stream, so
//! its p99 reads the worst gap of the worst streams; a gateway that delays one chunk in fifty
//! of every stream moves the time-between-chunks p99 while the streams' longest gaps may stay
//! the engine's. Why a histogram and not the gaps themselves: a long run of long streams would
//! keep one float per token. Gaps go into fixed log-spaced buckets instead: a stream keeps
//! only the buckets its gaps fell in (a few dozen for an even engine, [`BUCKETS`] at most,
//! whatever its length) and the run one dense array, merged into when a stream ends, and only
//! when it succeeded (failed streams are left out, as `max_gap_ms`'s summary leaves them).

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::Serialize;

use crate::load::RequestResult;

/// Lower edge of the second bucket (1 µs): anything shorter shares the first bucket.
const LOWEST_MS: f64 = 0.001;
/// Ratio between successive bucket edges. Every value of a bucket is within √1.01 − 1 ≈ 0.5 %
/// of the bucket's geometric middle, which is what a percentile reads: half the 1 % the
/// target's p99 needs, so rounding and the nearest-rank choice stay inside it.
const GROWTH: f64 = 1.01;
/// Buckets from 1 µs to 10⁷ ms (2.8 hours, longer than any request timeout); longer gaps
/// share the last bucket (and the exact maximum is kept apart).
pub const BUCKETS: usize = 2316;

/// The bucket of a gap of `ms` milliseconds.
fn bucket(ms: f64) -> usize {
    if ms.is_nan() || ms <= LOWEST_MS {
        return 0;
    }
    let i = ((ms / LOWEST_MS).ln() / GROWTH.ln()).floor();
    // `i` is finite and ≥ 0 here; `as` saturates on the way to usize.
    (i as usize).min(BUCKETS - 1)
}

/// The value a bucket stands for: its geometric middle.
fn middle(i: usize) -> f64 {
    LOWEST_MS * GROWTH.powf(i as f64 + 0.5)
}

/// One stream's gaps so far: only the buckets they fell in, so a 100 000-token stream of an
/// even engine keeps a few dozen counters rather than 100 000 floats.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamGaps {
    counts: BTreeMap<u16, u32>,
    min: f64,
    max: f64,
}

impl StreamGaps {
    /// Records one gap (NaN and negative values are dropped: no clock gives them).
    pub fn record(&mut self, ms: f64) {
        if ms.is_nan() || ms < 0.0 {
            return;
        }
        if self.counts.is_empty() {
            (self.min, self.max) = (ms, ms);
        } else {
            self.min = self.min.min(ms);
            self.max = self.max.max(ms);
        }
        // BUCKETS < u16::MAX, so the index always fits.
        let i = u16::try_from(bucket(ms)).unwrap_or(u16::MAX);
        let n = self.counts.entry(i).or_insert(0);
        *n = n.saturating_add(1);
    }

    /// How many buckets the stream keeps (its memory, in counters).
    pub fn buckets_kept(&self) -> usize {
        self.counts.len()
    }
}

/// The time between chunks of every stream merged so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GapHistogram {
    /// Dense over [`BUCKETS`] once anything was merged; empty before (no stream, no cost).
    counts: Vec<u64>,
    count: u64,
    min: f64,
    max: f64,
}

/// A time-between-chunks distribution, in milliseconds. Percentiles are nearest-rank values
/// of the histogram: within 0.5 % of the true sample value, clamped to the exact min and
/// max, and exact at the first and last rank; `max` is exact.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GapDist {
    pub count: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p99_9: f64,
    pub max: f64,
}

impl GapHistogram {
    /// Adds one stream's gaps.
    pub fn merge(&mut self, s: &StreamGaps) {
        if s.counts.is_empty() {
            return;
        }
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS];
            (self.min, self.max) = (s.min, s.max);
        } else {
            self.min = self.min.min(s.min);
            self.max = self.max.max(s.max);
        }
        for (&i, &n) in &s.counts {
            if let Some(c) = self.counts.get_mut(usize::from(i)) {
                *c += u64::from(n);
                self.count += u64::from(n);
            }
        }
    }

    /// The nearest-rank percentile `p` (0..=100): the value below or at which `p` % of the
    /// gaps lie. `None` when empty.
    pub fn percentile(&self, p: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((p.clamp(0.0, 100.0) / 100.0) * self.count as f64).ceil() as u64;
        let rank = rank.clamp(1, self.count);
        // The extremes are kept exactly: a small sample's p99 is its largest gap.
        if rank == self.count {
            return Some(self.max);
        }
        if rank == 1 {
            return Some(self.min);
        }
        let mut seen = 0u64;
        for (i, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(middle(i).clamp(self.min, self.max));
            }
        }
        Some(self.max)
    }

    /// The summary pd-load reports; `None` when no stream had two token reads.
    pub fn dist(&self) -> Option<GapDist> {
        Some(GapDist {
            count: self.count,
            p50: self.percentile(50.0)?,
            p90: self.percentile(90.0)?,
            p99: self.percentile(99.0)?,
            p99_9: self.percentile(99.9)?,
            max: self.max,
        })
    }
}

/// A run's histogram, shared by its requests in flight.
#[derive(Debug, Default)]
pub struct ChunkGaps(Mutex<GapHistogram>);

impl ChunkGaps {
    /// Keeps a finished request's gaps if it succeeded: a broken or errored stream's last gap
    /// says how it failed, not how the gateway streams, and the error count reports it.
    pub fn record(&self, r: &RequestResult, gaps: &StreamGaps) {
        if !r.is_ok() || gaps.counts.is_empty() {
            return;
        }
        self.0.lock().unwrap_or_else(|e| e.into_inner()).merge(gaps);
    }

    /// What has been recorded so far.
    pub fn snapshot(&self) -> GapHistogram {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact nearest-rank percentile of a sorted sample (what the histogram estimates).
    fn exact(sorted: &[f64], p: f64) -> f64 {
        let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
        sorted[rank.clamp(1, sorted.len()) - 1]
    }

    #[test]
    fn every_value_is_within_half_a_percent_of_its_bucket() {
        let mut v = LOWEST_MS * 1.000_01;
        while v < 1e7 {
            let m = middle(bucket(v));
            assert!(((m - v) / v).abs() <= 0.005, "{v} ms reads as {m}");
            v *= 1.000_7;
        }
        assert_eq!(bucket(0.0), 0);
        assert_eq!(bucket(1e12), BUCKETS - 1);
        assert!(middle(BUCKETS - 1) >= 1e7, "the range covers 10^7 ms");
    }

    #[test]
    fn percentiles_stay_within_one_percent_of_the_sample() {
        // Log-uniform from 10 µs to 10 s, split over streams of uneven length.
        let mut rng = fastrand::Rng::with_seed(11);
        let mut all = Vec::new();
        let mut h = GapHistogram::default();
        while all.len() < 200_000 {
            let mut s = StreamGaps::default();
            for _ in 0..rng.usize(1..500) {
                let ms = 10f64.powf(rng.f64() * 6.0 - 2.0);
                s.record(ms);
                all.push(ms);
            }
            h.merge(&s);
        }
        all.sort_by(f64::total_cmp);
        for p in [1.0, 50.0, 90.0, 99.0, 99.9] {
            let (want, got) = (exact(&all, p), h.percentile(p).expect("gaps"));
            assert!(
                ((got - want) / want).abs() <= 0.01,
                "p{p}: {got} against {want}"
            );
        }
        let d = h.dist().expect("gaps");
        assert_eq!(d.count, all.len() as u64);
        assert_eq!(d.max, *all.last().expect("values"), "max is exact");
    }

    #[test]
    fn a_long_even_stream_keeps_few_counters() {
        let mut rng = fastrand::Rng::with_seed(3);
        let mut s = StreamGaps::default();
        for _ in 0..100_000 {
            s.record(1.5 + rng.f64() * 1.5);
        }
        s.record(250.0);
        // 1.5..3 ms spans ln 2 / ln 1.01 ≈ 70 buckets, plus the stall's.
        assert!(s.buckets_kept() <= 72, "{}", s.buckets_kept());
        let mut h = GapHistogram::default();
        h.merge(&s);
        let d = h.dist().expect("gaps");
        assert_eq!((d.count, d.max), (100_001, 250.0));
        assert!(d.p99 < 3.0 && d.p50 > 2.0, "{d:?}");
    }

    #[test]
    fn small_samples_read_their_own_values() {
        let mut s = StreamGaps::default();
        for ms in [2.0, 2.0, 2.0, 40.0, f64::NAN, -1.0] {
            s.record(ms);
        }
        let mut h = GapHistogram::default();
        assert_eq!(h.dist(), None);
        h.merge(&s);
        let d = h.dist().expect("gaps");
        assert_eq!(d.count, 4, "NaN and negative dropped");
        assert!((d.p50 - 2.0).abs() <= 0.01, "{d:?}");
        assert_eq!(
            (d.p99, d.p99_9, d.max),
            (40.0, 40.0, 40.0),
            "clamped to max"
        );
    }
}
