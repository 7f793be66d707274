//! Giving a model's request back (`POST /v1/limits/release`).
//!
//! An admission counts a request against its model's window before any pod is chosen (the
//! count and the check are one atomic script). When the gateway then cannot route the request
//! (no pod, a profile it cannot apply, the prefill leg failing), AIBrix does not charge the
//! model's budget for it; so the filter sends such requests back here and each is taken off
//! its counter.
//!
//! A refund must land in the window that counted it: given to a later window it would admit a
//! request over that window's limit. The filter says how long ago the admission was answered
//! (`age_ms`); a counter's window starts with its first write and its expiry is never pushed
//! back, so the window still open began `window - PTTL` ago, and holds the charge only if
//! that is at least `age_ms`. A counter already at 0 is left alone.

use serde::Deserialize;

use super::{model_rps_key, UserLimits, MAX_MODEL_BYTES, RPS_WINDOWS_MS};
use crate::redis_link::{LinkError, Retry};

/// The most refunds one body may carry; the filter sends fewer (it batches one tick's worth).
pub const MAX_REFUNDS: usize = 1024;

/// One admitted request to give back to its model's counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refund {
    pub model: String,
    pub window_ms: u64,
    /// How long before this call the admission was answered.
    pub age_ms: u64,
}

/// A release body the contract does not allow.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReleaseError {
    #[error("want {{\"refunds\": [{{\"model\", \"rps_window_ms\", \"age_ms\"}}, ...]}}: {0}")]
    Body(String),
    #[error("{0} refunds in one body (at most {MAX_REFUNDS})")]
    TooMany(usize),
    #[error("model name of {0} bytes (want 1 to {MAX_MODEL_BYTES})")]
    ModelName(usize),
    #[error("rps_window_ms {0} (want 1000 to 3600000)")]
    Window(u64),
}

#[derive(Deserialize)]
struct ReleaseBody {
    refunds: Vec<RefundBody>,
}

#[derive(Deserialize)]
struct RefundBody {
    model: String,
    rps_window_ms: u64,
    age_ms: u64,
}

/// Parses `{"refunds": [{"model": name, "rps_window_ms": ms, "age_ms": ms}, ...]}`.
pub fn parse_release(body: &[u8]) -> Result<Vec<Refund>, ReleaseError> {
    let body: ReleaseBody =
        serde_json::from_slice(body).map_err(|e| ReleaseError::Body(e.to_string()))?;
    if body.refunds.len() > MAX_REFUNDS {
        return Err(ReleaseError::TooMany(body.refunds.len()));
    }
    body.refunds
        .into_iter()
        .map(|r| {
            if r.model.is_empty() || r.model.len() > MAX_MODEL_BYTES {
                return Err(ReleaseError::ModelName(r.model.len()));
            }
            if !RPS_WINDOWS_MS.contains(&r.rps_window_ms) {
                return Err(ReleaseError::Window(r.rps_window_ms));
            }
            Ok(Refund {
                model: r.model,
                window_ms: r.rps_window_ms,
                age_ms: r.age_ms,
            })
        })
        .collect()
}

/// What a release did: requests given back, and those skipped (their window had passed, or
/// the counter was at 0 or not a counter).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Released {
    pub given_back: u64,
    pub skipped: u64,
}

/// Takes one request off each counter whose open window began at least its age ago.
/// KEYS: model counters. ARGV: window ms, then age ms, per key. Returns one flag per key:
/// 1 given back, 0 skipped.
pub(super) const RELEASE_SCRIPT: &str = r"
local given = {}
for i, key in ipairs(KEYS) do
  local window, age = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local pttl = redis.call('PTTL', key)
  local value = tonumber(redis.call('GET', key) or '0')
  given[i] = 0
  if pttl > 0 and window - pttl >= age and value and value > 0 then
    redis.call('DECRBY', key, 1)
    given[i] = 1
  end
end
return given
";

impl UserLimits {
    /// Gives `refunds` back to their model counters (one script call). With limits off,
    /// nothing is counted and nothing is given back.
    pub async fn release(&self, refunds: &[Refund]) -> Result<Released, LinkError> {
        let Some(store) = &self.store else {
            return Ok(Released::default());
        };
        if refunds.is_empty() {
            return Ok(Released::default());
        }
        let keys: Vec<String> = refunds
            .iter()
            .map(|r| model_rps_key(&r.model, r.window_ms))
            .collect();
        let answer = store
            .link
            .call(Retry::Never, |mut conn| {
                let mut invocation = store.release.prepare_invoke();
                for (key, refund) in keys.iter().zip(refunds) {
                    invocation.key(key).arg(refund.window_ms).arg(refund.age_ms);
                }
                async move { invocation.invoke_async::<Vec<i64>>(&mut conn).await }
            })
            .await;
        let flags = match answer {
            Ok(flags) => flags,
            Err(e) => {
                self.errors_total
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.redis_failed(&e);
                return Err(e);
            }
        };
        self.redis_ok();
        let given_back = flags.iter().filter(|f| **f == 1).count() as u64;
        let released = Released {
            given_back,
            skipped: refunds.len() as u64 - given_back,
        };
        self.refunds.add(released);
        Ok(released)
    }
}

/// `pd_control_model_rps_refunds_total{result}`.
#[derive(Debug, Default)]
pub(super) struct RefundCounts {
    given_back: std::sync::atomic::AtomicU64,
    skipped: std::sync::atomic::AtomicU64,
}

impl RefundCounts {
    fn add(&self, released: Released) {
        use std::sync::atomic::Ordering::Relaxed;
        self.given_back.fetch_add(released.given_back, Relaxed);
        self.skipped.fetch_add(released.skipped, Relaxed);
    }

    /// The family's samples, `(labels, value)`.
    pub(super) fn samples(&self) -> Vec<(String, String)> {
        super::result_samples(&[("given_back", &self.given_back), ("skipped", &self.skipped)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: serde_json::Value) -> Result<Vec<Refund>, ReleaseError> {
        parse_release(body.to_string().as_bytes())
    }

    #[test]
    fn release_bodies_parse() {
        assert_eq!(
            parse(json!({"refunds": [
                {"model": "llama", "rps_window_ms": 1000, "age_ms": 40},
                {"model": "qwen", "rps_window_ms": 3_600_000, "age_ms": 0, "extra": 1}]})),
            Ok(vec![
                Refund {
                    model: "llama".into(),
                    window_ms: 1000,
                    age_ms: 40
                },
                Refund {
                    model: "qwen".into(),
                    window_ms: 3_600_000,
                    age_ms: 0
                },
            ])
        );
        assert_eq!(parse(json!({"refunds": []})), Ok(vec![]));
    }

    #[test]
    fn release_bodies_outside_the_contract_are_refused() {
        let one = |model: &str, window: u64| json!({"refunds": [{"model": model, "rps_window_ms": window, "age_ms": 1}]});
        assert_eq!(parse(one("", 1000)), Err(ReleaseError::ModelName(0)));
        let long = "m".repeat(MAX_MODEL_BYTES + 1);
        assert_eq!(
            parse(one(&long, 1000)),
            Err(ReleaseError::ModelName(MAX_MODEL_BYTES + 1))
        );
        assert_eq!(parse(one("llama", 999)), Err(ReleaseError::Window(999)));
        let many: Vec<_> = (0..=MAX_REFUNDS)
            .map(|_| json!({"model": "m", "rps_window_ms": 1000, "age_ms": 1}))
            .collect();
        assert_eq!(
            parse(json!({ "refunds": many })),
            Err(ReleaseError::TooMany(MAX_REFUNDS + 1))
        );
        for bad in [
            json!([1]),
            json!({"refunds": [{"model": "m", "rps_window_ms": 1000}]}),
            json!({"refunds": [{"model": "m", "rps_window_ms": 1000, "age_ms": -1}]}),
            json!({}),
        ] {
            assert!(
                matches!(parse(bad.clone()), Err(ReleaseError::Body(_))),
                "{bad}"
            );
        }
    }
}
