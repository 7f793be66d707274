//! Seconds from configuration (an env var or a profile's knob, any finite positive number)
//! as the timeout of a host call. Proxy-Wasm carries a call's timeout as 32-bit
//! milliseconds, which Envoy reads as a signed `int` and refuses (`BadArgument`) when
//! negative, and `Duration::from_secs_f64` panics past `u64` seconds: an operator's
//! "effectively never" (`1e20`) must neither trap the VM nor fail every call.

use std::time::Duration;

/// The longest timeout Envoy takes for a host call: `i32::MAX` milliseconds, about 24.8 days.
pub const MAX_CALL_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// `seconds` as a call timeout: rounded to the millisecond, at least 1 ms (Envoy reads 0 as
/// "no timeout"), at most [`MAX_CALL_TIMEOUT`]. Callers only pass values the settings
/// validated as positive; anything else is taken as the shortest timeout.
pub fn call_timeout(seconds: f64) -> Duration {
    let ms = (seconds * 1000.0).round();
    if ms.is_nan() || ms < 1.0 {
        return Duration::from_millis(1);
    }
    // `as` saturates, and the bound is below u64::MAX.
    Duration::from_millis((ms as u64).min(i32::MAX as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_timeouts_are_kept_to_the_millisecond() {
        assert_eq!(call_timeout(30.0), Duration::from_secs(30));
        assert_eq!(call_timeout(0.25), Duration::from_millis(250));
        assert_eq!(call_timeout(1e-3), Duration::from_millis(1));
    }

    #[test]
    fn huge_timeouts_saturate_instead_of_panicking_or_wrapping() {
        for s in [
            2_147_483.647,
            2_147_484.0,
            4_294_967.295,
            1e20,
            f64::MAX,
            f64::INFINITY,
        ] {
            assert_eq!(call_timeout(s), MAX_CALL_TIMEOUT, "{s}");
        }
        assert_eq!(call_timeout(2_147_483.0), Duration::from_secs(2_147_483));
        // What the SDK sends (milliseconds as u32) and Envoy reads (as i32) stays positive.
        assert!((call_timeout(1e20).as_millis() as u32 as i32) > 0);
    }

    #[test]
    fn values_the_settings_should_have_refused_still_give_a_timeout() {
        for s in [0.0, -1.0, 1e-9, f64::NAN, f64::NEG_INFINITY] {
            assert_eq!(call_timeout(s), Duration::from_millis(1), "{s}");
        }
    }
}
