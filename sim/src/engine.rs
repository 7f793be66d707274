//! The simulated engine's cost model: how long prefill, KV pull and decode steps take, how
//! prompt text turns into tokens, and what the generated tokens look like.
//!
//! Everything here is pure arithmetic so the timing model can be unit-tested and reasoned
//! about without running a server. The numbers are deliberately small by default: the
//! simulator exists to exercise a router, and fast pods keep end-to-end tests fast.

use std::time::Duration;

/// Tokens per KV-cache block, as vLLM's default `block_size`.
pub const BLOCK_SIZE_TOKENS: u64 = 16;
/// The simulator's tokenizer: one token per this many characters (rounded up).
pub const CHARS_PER_TOKEN: u64 = 4;

/// Knobs of the timing model, all taken from the `pd-sim` command line.
#[derive(Debug, Clone, PartialEq)]
pub struct TimingModel {
    /// Fixed cost of one prefill, in milliseconds.
    pub prefill_base_ms: f64,
    /// Cost of each prompt token that is not in the prefix cache, in microseconds.
    pub prefill_us_per_token: f64,
    /// Cost of one decode step with an otherwise empty batch, in milliseconds.
    pub decode_ms_per_token: f64,
    /// Relative slowdown of a decode step per other running request on the same pod.
    pub batch_slowdown: f64,
    /// Fixed cost of pulling a prefill pod's KV cache onto a decode pod, in milliseconds.
    pub kv_pull_base_ms: f64,
    /// Pull cost per prompt token, in microseconds.
    pub kv_pull_us_per_token: f64,
}

impl Default for TimingModel {
    fn default() -> Self {
        TimingModel {
            prefill_base_ms: 2.0,
            prefill_us_per_token: 20.0,
            decode_ms_per_token: 2.0,
            batch_slowdown: 0.05,
            kv_pull_base_ms: 1.0,
            kv_pull_us_per_token: 1.0,
        }
    }
}

impl TimingModel {
    /// Time to prefill `new_tokens` prompt tokens (those not served from the prefix cache).
    pub fn prefill_time(&self, new_tokens: u64) -> Duration {
        millis(self.prefill_base_ms + new_tokens as f64 * self.prefill_us_per_token / 1000.0)
    }

    /// Time of one decode step while `running` requests (this one included) share the pod.
    /// The batch grows the step linearly, which is what makes a busy pod visibly slower.
    pub fn decode_step(&self, running: u64) -> Duration {
        let others = running.saturating_sub(1) as f64;
        millis(self.decode_ms_per_token * (1.0 + self.batch_slowdown * others))
    }

    /// Time a decode pod spends pulling the KV cache of a `prompt_tokens` prompt.
    pub fn kv_pull_time(&self, prompt_tokens: u64) -> Duration {
        millis(self.kv_pull_base_ms + prompt_tokens as f64 * self.kv_pull_us_per_token / 1000.0)
    }
}

/// Spends `d` of simulated engine time. Zero takes no time at all: tokio rounds every timer
/// up to its next 1 ms tick, so `sleep(ZERO)` would cost up to a millisecond per call and a
/// "zero compute" pod (the overhead benchmarks' engine) would add 1–3 ms to every request.
/// Zero still yields, so a long zero-time stream cannot hold a runtime thread.
pub async fn spend(d: Duration) {
    if d.is_zero() {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(d).await;
    }
}

/// Converts a non-negative millisecond count to a `Duration`; negative or NaN inputs
/// (a mistyped flag) become zero rather than a panic.
fn millis(ms: f64) -> Duration {
    if ms.is_finite() && ms > 0.0 {
        Duration::from_secs_f64(ms / 1000.0)
    } else {
        Duration::ZERO
    }
}

/// Prompt tokens of a text: ceil(chars / 4). Characters, not bytes, so that non-ASCII text
/// is not over-counted.
pub fn prompt_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(CHARS_PER_TOKEN)
}

/// The text of generated token `index`: deterministic filler, so that a full request and
/// the same request served as a prefill/decode pair produce the same output.
pub fn token_text(index: u64) -> String {
    format!(" tok{index}")
}

/// The concatenated text of the first `count` generated tokens.
pub fn output_text(count: u64) -> String {
    (0..count).map(token_text).collect()
}

/// KV blocks needed to hold `tokens` tokens.
pub fn blocks_for(tokens: u64) -> u64 {
    tokens.div_ceil(BLOCK_SIZE_TOKENS)
}

/// A stable, UUID-shaped engine id derived from the pod's identity, so that a pod keeps its
/// `remote_engine_id` across simulator restarts and a test can predict it.
pub fn engine_id(namespace: &str, name: &str) -> String {
    let key = format!("{namespace}/{name}");
    let hi = fnv1a(0xcbf2_9ce4_8422_2325, key.as_bytes());
    let lo = fnv1a(hi ^ 0x9e37_79b9_7f4a_7c15, key.as_bytes());
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        hi >> 32,
        (hi >> 16) & 0xffff,
        hi & 0xffff,
        lo >> 48,
        lo & 0xffff_ffff_ffff
    )
}

/// FNV-1a over `bytes`, starting from `seed`. Used where a hash must be identical across
/// processes and Rust versions (std's `DefaultHasher` promises neither).
pub fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(seed, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_time_is_base_plus_per_token() {
        let t = TimingModel::default();
        assert_eq!(t.prefill_time(0), Duration::from_millis(2));
        assert_eq!(t.prefill_time(1000), Duration::from_millis(22));
    }

    #[test]
    fn decode_step_grows_with_batch() {
        let t = TimingModel::default();
        assert_eq!(t.decode_step(0), Duration::from_millis(2));
        assert_eq!(t.decode_step(1), Duration::from_millis(2));
        assert_eq!(t.decode_step(11), Duration::from_secs_f64(0.003));
    }

    #[test]
    fn bad_flags_give_zero_not_panic() {
        let t = TimingModel {
            prefill_base_ms: -5.0,
            prefill_us_per_token: f64::NAN,
            ..TimingModel::default()
        };
        assert_eq!(t.prefill_time(10), Duration::ZERO);
    }

    #[test]
    fn tokens_round_up_and_count_chars() {
        assert_eq!(prompt_tokens(""), 0);
        assert_eq!(prompt_tokens("abcd"), 1);
        assert_eq!(prompt_tokens("abcde"), 2);
        assert_eq!(prompt_tokens("ééééé"), 2, "characters, not bytes");
        assert_eq!(blocks_for(16), 1);
        assert_eq!(blocks_for(17), 2);
    }

    #[test]
    fn output_is_deterministic_filler() {
        assert_eq!(output_text(3), " tok0 tok1 tok2");
        assert_eq!(token_text(7), " tok7");
    }

    #[test]
    fn engine_id_is_stable_uuid_shaped_and_distinct() {
        let a = engine_id("default", "vllm-p-0");
        assert_eq!(a, engine_id("default", "vllm-p-0"));
        assert_ne!(a, engine_id("default", "vllm-p-1"));
        let parts: Vec<usize> = a.split('-').map(str::len).collect();
        assert_eq!(parts, vec![8, 4, 4, 4, 12]);
        assert!(a.chars().all(|c| c == '-' || c.is_ascii_hexdigit()));
    }
}
