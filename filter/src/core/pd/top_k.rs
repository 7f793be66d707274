//! `least-request-top-k`: a uniform pick among the few least-loaded standard pods rather
//! than always the least-loaded one.
//!
//! Plain least-request sends a burst of simultaneous requests to the one pod that was
//! least loaded when each of them read the counts: gateway replicas share counts only every
//! ~100 ms, so all of them pick the same pod. Spreading the burst over the K least-loaded
//! pods, but only those within `epsilon` requests of the least-loaded one, keeps the choice
//! near the minimum while no pod takes a whole burst. A skewed fleet (one idle pod, the rest
//! far busier) still gets the idle pod, because the epsilon bound leaves it alone.
//!
//! A pod that has just become ready reads 0 running requests and would take every request
//! until its count caught up with the fleet's, before its engine has warmed up. For a ramp
//! window after it became ready it is charged extra requests: the lowest count among the pods
//! that are not ramping, decaying linearly to none at the end of the window. When every pod
//! is ramping (a fleet that started together) there is no baseline and nobody is charged.
//!
//! Knobs and defaults are AIBrix's (`AIBRIX_ROUTING_LEAST_REQUEST_TOP_K*`). AIBrix dates the
//! ramp from when its gateway first saw the pod ready, so a gateway restart forgets it; here
//! it is the Ready condition's transition time, read by pd-control from the API server.

use crate::core::config::SingleEnv;
use crate::core::fleet::ModelView;

/// The knobs of one selection and the time it runs at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopK {
    /// At most this many candidates; 0 means every pod.
    pub k: usize,
    /// Candidates are within this many requests of the least-loaded pod; `None`: no bound.
    pub epsilon: Option<u32>,
    /// Ramp window after a pod became ready, ms; 0 turns the ramp off.
    pub ramp_window_ms: u64,
    /// Unix ms.
    pub now_ms: u64,
}

impl TopK {
    pub fn new(env: &SingleEnv, now_ms: u64) -> TopK {
        TopK {
            k: env.top_k,
            epsilon: env.top_k_epsilon,
            ramp_window_ms: env.top_k_ramp_window_ms,
            now_ms,
        }
    }

    /// The eligible standard pods, least loaded first (ties in random order), as
    /// `(effective count, position in model.others)`, and the effective count of every
    /// standard pod in `model.others` order. `running` is by slot (see
    /// `single::running_by_slot`). Only the K least are ordered: one selection pass, then a
    /// sort of K, not of the fleet.
    pub fn eligible(
        &self,
        model: &ModelView,
        running: &[u32],
        rng: &mut fastrand::Rng,
    ) -> (Vec<(u32, usize)>, Vec<u32>) {
        let counts = self.effective_counts(model, running);
        let mut ranked: Vec<(u32, u32, usize)> = counts
            .iter()
            .enumerate()
            .map(|(pos, &count)| (count, rng.u32(..), pos))
            .collect();
        let k = if self.k == 0 {
            ranked.len()
        } else {
            self.k.min(ranked.len())
        };
        if k == 0 {
            return (Vec::new(), counts);
        }
        if k < ranked.len() {
            ranked.select_nth_unstable(k - 1);
        }
        let least = &mut ranked[..k];
        least.sort_unstable();
        let min = least[0].0;
        let n = match self.epsilon {
            Some(epsilon) => least
                .iter()
                .take_while(|(count, _, _)| count - min <= epsilon)
                .count(),
            None => k,
        };
        let eligible = least[..n]
            .iter()
            .map(|&(count, _, pos)| (count, pos))
            .collect();
        (eligible, counts)
    }

    /// One eligible pod's slot, uniformly; `None` without standard pods.
    pub fn pick(
        &self,
        model: &ModelView,
        running: &[u32],
        rng: &mut fastrand::Rng,
    ) -> Option<usize> {
        let (eligible, _) = self.eligible(model, running, rng);
        if eligible.is_empty() {
            return None;
        }
        let (_, pos) = eligible[rng.usize(..eligible.len())];
        model.others.get(pos).copied()
    }

    /// Lower-is-better scores for a blend, in `model.others` order: the effective count, less
    /// a random amount below epsilon for the eligible pods. A blend takes its best sum, so
    /// equal counts would let another strategy's tie-break decide every time; the jitter
    /// reorders the eligible pods among themselves and never lifts an ineligible pod above
    /// them.
    pub fn scores(&self, model: &ModelView, running: &[u32], rng: &mut fastrand::Rng) -> Vec<f64> {
        let (eligible, counts) = self.eligible(model, running, rng);
        let jitter = f64::from(self.epsilon.unwrap_or(0));
        let mut scores: Vec<f64> = counts.into_iter().map(f64::from).collect();
        for (_, pos) in eligible {
            if let Some(score) = scores.get_mut(pos) {
                *score -= rng.f64() * jitter;
            }
        }
        scores
    }

    /// Running requests plus the ramp charge, in `model.others` order.
    fn effective_counts(&self, model: &ModelView, running: &[u32]) -> Vec<u32> {
        let count = |slot: usize| running.get(slot).copied().unwrap_or(0);
        let mut counts: Vec<u32> = model.others.iter().map(|&slot| count(slot)).collect();
        if self.ramp_window_ms == 0 {
            return counts;
        }
        // Time since the pod became ready while inside the window; `None` when warm.
        let ramping = |slot: usize| {
            let since = model.pods[slot].ready_since_ms;
            let elapsed = self.now_ms.saturating_sub(since);
            (since != 0 && elapsed < self.ramp_window_ms).then_some(elapsed)
        };
        let warm_min = model
            .others
            .iter()
            .filter(|&&slot| ramping(slot).is_none())
            .map(|&slot| count(slot))
            .min();
        let Some(warm_min) = warm_min else {
            return counts;
        };
        for (c, &slot) in counts.iter_mut().zip(&model.others) {
            if let Some(elapsed) = ramping(slot) {
                let left = 1.0 - elapsed as f64 / self.ramp_window_ms as f64;
                *c = c.saturating_add((f64::from(warm_min) * left).round() as u32);
            }
        }
        counts
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;
    use std::collections::BTreeMap;

    const NOW: u64 = 1_800_000_000_000;

    /// AIBrix's K and epsilon, no ramp: for tests of other strategies.
    pub const TOP_K_DEFAULTS: TopK = TopK {
        k: 5,
        epsilon: Some(4),
        ramp_window_ms: 0,
        now_ms: 0,
    };

    /// Standard pods `s0..s{n}`, the ones listed in `ready_since` with that ready time.
    fn model(n: usize, ready_since: &[(usize, u64)]) -> ModelView {
        let pods = (0..n)
            .map(|i| {
                let mut p = pod(&format!("s{i}"), "", "", true);
                if let Some((_, t)) = ready_since.iter().find(|(j, _)| *j == i) {
                    p.ready_since_unix_ms = *t as i64;
                }
                p
            })
            .collect();
        FleetView::from_snapshot(&snapshot(pods)).models["m"].clone()
    }

    fn top_k(k: usize, epsilon: Option<u32>, ramp_window_ms: u64) -> TopK {
        TopK {
            k,
            epsilon,
            ramp_window_ms,
            now_ms: NOW,
        }
    }

    /// How often each pod name is picked in `n` draws.
    fn picks(t: &TopK, m: &ModelView, running: &[u32], n: usize) -> BTreeMap<String, usize> {
        let mut rng = fastrand::Rng::with_seed(11);
        let mut seen = BTreeMap::new();
        for _ in 0..n {
            let slot = t.pick(m, running, &mut rng).unwrap();
            *seen.entry(m.pods[slot].name.clone()).or_default() += 1;
        }
        seen
    }

    #[test]
    fn the_k_least_loaded_pods_within_epsilon_share_the_requests() {
        let m = model(8, &[]);
        // s0..s7 run 3,0,1,9,2,4,12,5: the five least loaded are s1,s2,s4,s0,s5 (0..=4).
        let running = [3, 0, 1, 9, 2, 4, 12, 5];
        let seen = picks(&top_k(5, Some(4), 0), &m, &running, 2000);
        let names: Vec<_> = seen.keys().map(String::as_str).collect();
        assert_eq!(names, ["s0", "s1", "s2", "s4", "s5"]);
        assert!(seen.values().all(|&c| c > 300), "uniform: {seen:?}");
        // epsilon 1 keeps s1 (0) and s2 (1) only.
        let seen = picks(&top_k(5, Some(1), 0), &m, &running, 400);
        assert_eq!(
            seen.keys().map(String::as_str).collect::<Vec<_>>(),
            ["s1", "s2"]
        );
        // No epsilon bound: the five least loaded; k 0: every pod within epsilon.
        assert_eq!(picks(&top_k(5, None, 0), &m, &running, 2000).len(), 5);
        assert_eq!(picks(&top_k(0, Some(100), 0), &m, &running, 4000).len(), 8);
    }

    #[test]
    fn a_skewed_fleet_sends_everything_to_the_idle_pod() {
        let m = model(4, &[]);
        let seen = picks(&top_k(5, Some(4), 0), &m, &[20, 0, 21, 22], 200);
        assert_eq!(seen.get("s1"), Some(&200));
    }

    #[test]
    fn a_newly_ready_pod_is_eased_in_over_the_ramp_window() {
        let window = 300_000;
        // s3 became ready a fifth into the window: charged round(10 × 0.8) = 8 requests.
        let m = model(4, &[(0, NOW - 3_600_000), (3, NOW - window / 5)]);
        let running = [10, 11, 12, 0];
        let t = top_k(5, Some(4), window);
        let mut rng = fastrand::Rng::with_seed(1);
        let (_, counts) = t.eligible(&m, &running, &mut rng);
        assert_eq!(counts, [10, 11, 12, 8]);
        // Eligible: 8 (s3) .. 12 (s2), all within 4 of 8.
        assert_eq!(picks(&t, &m, &running, 2000).len(), 4);
        // Without the ramp, s3 alone (10 − 0 > 4).
        let seen = picks(&top_k(5, Some(4), 0), &m, &running, 50);
        assert_eq!(seen.get("s3"), Some(&50));
        // Past the window it is warm; a clock behind its ready time charges it in full.
        let late = TopK {
            now_ms: NOW + window,
            ..t
        };
        assert_eq!(late.eligible(&m, &running, &mut rng).1, [10, 11, 12, 0]);
        let early = TopK {
            now_ms: NOW - window,
            ..t
        };
        assert_eq!(early.eligible(&m, &running, &mut rng).1, [10, 11, 12, 10]);
    }

    #[test]
    fn a_fleet_that_became_ready_together_has_no_baseline_to_charge() {
        let m = model(3, &[(0, NOW - 10), (1, NOW - 20), (2, NOW - 30)]);
        let t = top_k(5, Some(4), 300_000);
        let mut rng = fastrand::Rng::with_seed(1);
        assert_eq!(t.eligible(&m, &[5, 6, 7], &mut rng).1, [5, 6, 7]);
    }

    #[test]
    fn blend_scores_jitter_only_the_eligible_pods() {
        let m = model(4, &[]);
        let t = top_k(2, Some(4), 0);
        let mut rng = fastrand::Rng::with_seed(5);
        for _ in 0..50 {
            let s = t.scores(&m, &[0, 1, 3, 9], &mut rng);
            assert!(
                (-4.0..=0.0).contains(&s[0]) && (-3.0..=1.0).contains(&s[1]),
                "{s:?}"
            );
            assert_eq!(&s[2..], [3.0, 9.0], "outside the top 2: plain counts");
        }
    }
}
