//! Refusal log lines, paced per reason. A client that sends a thousand over-limit or
//! unknown-model requests a second must not make a worker format a thousand log lines a
//! second (nor bury every other line): each reason logs at most [`BURST`] refusals per
//! [`INTERVAL_MS`], and its next line says how many it left out. The access log still has
//! every request, and `pd_router_rejected_total{reason}` counts every refusal.

use hashbrown::HashMap;

/// The length of one pacing window.
pub const INTERVAL_MS: u64 = 1_000;
/// Lines one reason may log per window: a few refusals in a row are all seen.
pub const BURST: u32 = 10;

#[derive(Debug, Clone, Copy)]
struct Window {
    started_ms: u64,
    logged: u32,
    left_out: u64,
}

#[derive(Debug, Default)]
pub struct LogPace {
    reasons: HashMap<&'static str, Window>,
}

impl LogPace {
    /// Whether a refusal for `reason` at `now_ms` (a monotonic clock) is logged:
    /// `Some(left_out)` (refusals of that reason not logged since its last line) when it is,
    /// `None` when it is left out.
    pub fn admit(&mut self, reason: &'static str, now_ms: u64) -> Option<u64> {
        let window = self.reasons.entry(reason).or_insert(Window {
            started_ms: now_ms,
            logged: 0,
            left_out: 0,
        });
        if now_ms.saturating_sub(window.started_ms) >= INTERVAL_MS {
            window.started_ms = now_ms;
            window.logged = 0;
        }
        if window.logged >= BURST {
            window.left_out += 1;
            return None;
        }
        window.logged += 1;
        Some(std::mem::take(&mut window.left_out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_reason_logs_a_burst_per_window_and_says_what_it_left_out() {
        let mut pace = LogPace::default();
        for t in 0..BURST as u64 {
            assert_eq!(pace.admit("rpm_exceeded", 10_000 + t), Some(0));
        }
        for t in 0..500 {
            assert_eq!(pace.admit("rpm_exceeded", 10_010 + t), None);
        }
        assert_eq!(
            pace.admit("model_not_found", 10_100),
            Some(0),
            "another reason has its own pace"
        );
        assert_eq!(pace.admit("rpm_exceeded", 10_999), None);
        assert_eq!(pace.admit("rpm_exceeded", 11_000), Some(501));
        assert_eq!(pace.admit("rpm_exceeded", 11_001), Some(0));
        for t in 0..20 {
            pace.admit("rpm_exceeded", 11_002 + t);
        }
        assert_eq!(pace.admit("rpm_exceeded", 30_000), Some(12));
    }
}
