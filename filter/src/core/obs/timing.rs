//! Per-request timing (contract §8.1): the durations AIBrix derives at request end, and its
//! duration buckets (`gateway_*_time_bucket_total{bucket}`).
//!
//! All instants are microseconds on the host clock. A duration that needs an instant the
//! request never reached (no prefill leg, not a stream, no usage) is `None`, never 0, so the
//! histograms and bucket counters only see real measurements.

/// Instants of one request, filled in as the request moves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Instants {
    /// Request headers arrived.
    pub request_us: u64,
    /// The routing decision was made: the prefill leg dispatched, or the single pod chosen.
    pub routed_us: Option<u64>,
    /// The synchronous prefill leg answered successfully.
    pub prefill_end_us: Option<u64>,
    /// First non-empty response body chunk.
    pub first_token_us: Option<u64>,
    /// The response ended.
    pub end_us: Option<u64>,
    /// Completion tokens from the response's `usage` (streams with `include_usage`).
    pub completion_tokens: Option<u64>,
    pub stream: bool,
}

/// The durations the contract defines, each present only when it is meaningful.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Durations {
    /// PrefillStart − RequestTime (for single-pod picks: the decision time).
    pub routing_us: Option<u64>,
    /// PrefillEnd − PrefillStart.
    pub prefill_us: Option<u64>,
    /// TTFT − (PrefillEnd − RequestTime): from the prefill's answer to the first token.
    pub kv_transfer_us: Option<u64>,
    /// end − PrefillEnd, or end − first token for streams.
    pub decode_us: Option<u64>,
    /// First token − RequestTime, streams only.
    pub ttft_us: Option<u64>,
    /// Decode time / completion tokens, streams with usage only.
    pub tpot_us: Option<u64>,
    /// end − RequestTime, every request that got a response.
    pub total_us: Option<u64>,
    /// The histograms' decode time and TPOT: as `decode_us` and `tpot_us`, and for a stream
    /// without a synchronous prefill leg (SGLang's and TRT-LLM generation_first's concurrent
    /// legs, one-pod strategies) from its first token too. AIBrix's bucket counters keep its
    /// rule (a PrefillEnd first); without this an SGLang fleet had no TPOT at all.
    pub decode_any_us: Option<u64>,
    pub tpot_any_us: Option<u64>,
}

impl Instants {
    pub fn durations(&self) -> Durations {
        let since = |from: u64, to: Option<u64>| to.map(|t| t.saturating_sub(from));
        let ttft_us = if self.stream {
            since(self.request_us, self.first_token_us)
        } else {
            None
        };
        let decode_us = match (self.prefill_end_us, self.end_us) {
            (Some(p), Some(end)) if self.stream => {
                Some(end.saturating_sub(self.first_token_us.unwrap_or(p)))
            }
            (Some(p), Some(end)) => Some(end.saturating_sub(p)),
            _ => None,
        };
        let kv_transfer_us = match (self.prefill_end_us, self.first_token_us) {
            (Some(p), Some(first)) if self.stream => Some(first.saturating_sub(p)),
            _ => None,
        };
        let per_token = |decode: Option<u64>| match (decode, self.completion_tokens, self.stream) {
            (Some(d), Some(n), true) if n > 0 => Some(d / n),
            _ => None,
        };
        let tpot_us = per_token(decode_us);
        let decode_any_us = match (self.first_token_us, self.end_us) {
            (Some(first), Some(end)) if self.stream => Some(end.saturating_sub(first)),
            _ => decode_us,
        };
        Durations {
            routing_us: since(self.request_us, self.routed_us),
            prefill_us: self
                .routed_us
                .and_then(|start| since(start, self.prefill_end_us)),
            kv_transfer_us,
            decode_us,
            ttft_us,
            tpot_us,
            total_us: since(self.request_us, self.end_us),
            decode_any_us,
            tpot_any_us: per_token(decode_any_us),
        }
    }
}

/// AIBrix's duration bucket labels (`ms` suffix; a negative value counts as 0).
pub const DURATION_BUCKETS: [&str; 13] = [
    "0-1ms",
    "1-2ms",
    "2-5ms",
    "5-10ms",
    "10-20ms",
    "20-50ms",
    "50-100ms",
    "100-200ms",
    "200-500ms",
    "500-1000ms",
    "1000-2000ms",
    "2000-5000ms",
    "5000ms+",
];
const DURATION_UPPER_MS: [u64; 12] = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000];

/// AIBrix's total-time bucket labels.
pub const TOTAL_BUCKETS: [&str; 8] = [
    "0-100ms",
    "100-250ms",
    "250-500ms",
    "500-1000ms",
    "1000-5000ms",
    "5000-20000ms",
    "20000-60000ms",
    "60000ms+",
];
const TOTAL_UPPER_MS: [u64; 7] = [100, 250, 500, 1000, 5000, 20000, 60000];

/// Index into [`DURATION_BUCKETS`]; lower bounds inclusive, upper exclusive.
pub fn duration_bucket(us: u64) -> usize {
    bucket(us, &DURATION_UPPER_MS)
}

/// Index into [`TOTAL_BUCKETS`].
pub fn total_bucket(us: u64) -> usize {
    bucket(us, &TOTAL_UPPER_MS)
}

fn bucket(us: u64, upper_ms: &[u64]) -> usize {
    upper_ms
        .iter()
        .position(|&ms| us < ms * 1000)
        .unwrap_or(upper_ms.len())
}

/// `gateway_first_token_delay_over_1s_total` fires for a PD request with a synchronous
/// prefill whose TTFT exceeds the threshold (`AIBRIX_TTFT_THRESHOLD_S`).
pub fn first_token_delayed(d: &Durations, threshold_us: u64) -> bool {
    d.prefill_us.is_some() && d.ttft_us.is_some_and(|t| t > threshold_us)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pd_stream() -> Instants {
        Instants {
            request_us: 1_000,
            routed_us: Some(1_400),
            prefill_end_us: Some(31_400),
            first_token_us: Some(41_400),
            end_us: Some(141_400),
            completion_tokens: Some(10),
            stream: true,
        }
    }

    #[test]
    fn a_pd_stream_has_every_duration() {
        let d = pd_stream().durations();
        assert_eq!(d.routing_us, Some(400));
        assert_eq!(d.prefill_us, Some(30_000));
        assert_eq!(d.ttft_us, Some(40_400));
        assert_eq!(
            d.kv_transfer_us,
            Some(10_000),
            "TTFT − (PrefillEnd − RequestTime)"
        );
        assert_eq!(d.decode_us, Some(100_000), "streams: end − first token");
        assert_eq!(d.tpot_us, Some(10_000));
        assert_eq!(d.total_us, Some(140_400));
        assert_eq!((d.decode_any_us, d.tpot_any_us), (d.decode_us, d.tpot_us));
    }

    #[test]
    fn a_stream_without_a_synchronous_prefill_has_decode_and_tpot_for_the_histograms_only() {
        let mut concurrent = pd_stream();
        concurrent.prefill_end_us = None;
        let d = concurrent.durations();
        assert_eq!((d.decode_us, d.tpot_us), (None, None), "AIBrix's buckets");
        assert_eq!(d.decode_any_us, Some(100_000), "end − first token");
        assert_eq!(d.tpot_any_us, Some(10_000));
        concurrent.completion_tokens = None;
        assert_eq!(
            concurrent.durations().tpot_any_us,
            None,
            "no usage, no TPOT"
        );
        // A one-pod answer that is not a stream has no first-token split.
        let single = Instants {
            request_us: 0,
            routed_us: Some(300),
            first_token_us: Some(4_000),
            end_us: Some(5_000),
            ..Default::default()
        };
        assert_eq!(single.durations().decode_any_us, None);
    }

    #[test]
    fn missing_instants_give_no_duration_rather_than_zero() {
        let mut t = pd_stream();
        t.stream = false;
        t.completion_tokens = None;
        let d = t.durations();
        assert_eq!(d.ttft_us, None);
        assert_eq!(d.kv_transfer_us, None);
        assert_eq!(d.tpot_us, None);
        assert_eq!(d.decode_us, Some(110_000), "non-stream: end − PrefillEnd");

        let single = Instants {
            request_us: 0,
            routed_us: Some(300),
            end_us: Some(5_000),
            ..Default::default()
        };
        let d = single.durations();
        assert_eq!(
            (d.routing_us, d.prefill_us, d.decode_us),
            (Some(300), None, None)
        );

        let mut zero_tokens = pd_stream();
        zero_tokens.completion_tokens = Some(0);
        assert_eq!(zero_tokens.durations().tpot_us, None);
    }

    #[test]
    fn buckets_follow_aibrix_bounds() {
        assert_eq!(DURATION_BUCKETS[duration_bucket(0)], "0-1ms");
        assert_eq!(DURATION_BUCKETS[duration_bucket(999)], "0-1ms");
        assert_eq!(DURATION_BUCKETS[duration_bucket(1_000)], "1-2ms");
        assert_eq!(DURATION_BUCKETS[duration_bucket(4_999_999)], "2000-5000ms");
        assert_eq!(DURATION_BUCKETS[duration_bucket(5_000_000)], "5000ms+");
        assert_eq!(TOTAL_BUCKETS[total_bucket(99_999)], "0-100ms");
        assert_eq!(TOTAL_BUCKETS[total_bucket(100_000)], "100-250ms");
        assert_eq!(TOTAL_BUCKETS[total_bucket(u64::MAX / 2)], "60000ms+");
    }

    #[test]
    fn first_token_delay_needs_a_prefill_leg_and_a_slow_ttft() {
        let d = pd_stream().durations();
        assert!(first_token_delayed(&d, 40_000));
        assert!(!first_token_delayed(&d, 40_400), "strictly greater");
        let mut single = pd_stream();
        single.prefill_end_us = None;
        assert!(!first_token_delayed(&single.durations(), 0));
    }
}
