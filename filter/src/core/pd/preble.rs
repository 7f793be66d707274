//! `prefix-cache-preble`: AIBrix's Preble-style strategy, its two branches kept and its load
//! measure replaced.
//!
//! AIBrix looks the prompt up in a token tree. When more than half of it is already held
//! (the longest match over all pods), the request goes to the least-loaded pod among those
//! holding that longest match; otherwise to the pod with the lowest cost, a sliding-window
//! estimate of the prefill and decode work sent to each pod over three minutes, computed
//! from a latency model calibrated for one model on one GPU (`AIBRIX_ROUTER_PREBLE_TARGET_GPU`).
//!
//! Here the match is the prefix index's (the one `prefix-cache` reads, shared by every
//! worker), and the load in both branches is the pod's running requests across workers and
//! replicas: what the window estimates, counted instead of modelled, and right on any GPU.

/// The share of the prompt (in percent) above which the longest match decides.
pub const MATCH_THRESHOLD_PCT: f64 = 50.0;

/// The longest match over the pods in `slots`, in percent (0 when no pod holds any of it).
pub fn longest_match(slots: &[usize], match_pct: &[f64]) -> f64 {
    slots
        .iter()
        .map(|&i| match_pct.get(i).copied().unwrap_or(0.0))
        .fold(0.0, f64::max)
}

/// One pod's score, lower better: its running requests, when it holds the longest match of a
/// prompt mostly held (`longest` above [`MATCH_THRESHOLD_PCT`]) or when no match decides;
/// `None` (passed over) for a pod without the longest match of a prompt mostly held.
pub fn score(running: u32, match_pct: f64, longest: f64) -> Option<f64> {
    let holds_it = match_pct >= longest;
    (longest <= MATCH_THRESHOLD_PCT || holds_it).then_some(f64::from(running))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_mostly_held_goes_to_the_holders_only() {
        let pct = [80.0, 80.0, 40.0];
        let longest = longest_match(&[0, 1, 2], &pct);
        assert_eq!(longest, 80.0);
        assert_eq!(score(5, pct[0], longest), Some(5.0));
        assert_eq!(
            score(0, pct[2], longest),
            None,
            "idle but without the match"
        );
    }

    #[test]
    fn at_half_or_less_the_load_alone_decides() {
        for longest in [0.0, 30.0, 50.0] {
            assert_eq!(score(3, 0.0, longest), Some(3.0), "{longest}");
            assert_eq!(score(1, longest, longest), Some(1.0), "{longest}");
        }
        assert_eq!(longest_match(&[], &[]), 0.0);
        assert_eq!(longest_match(&[4], &[10.0]), 0.0, "a slot past the scores");
    }
}
