//! PD target selection. This first policy picks the complete roleset whose least-loaded
//! prefill and decode pods carry the fewest outstanding requests, ties broken at random;
//! the full AIBrix cascade (buckets, fast paths, scoring policies) builds on the same shape.

pub mod bucket_serve;

use crate::core::errors::RouteError;
use crate::core::fleet::{ModelView, Role};
use crate::core::ledger::{Counter, LoadTable};

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Prefill on one pod, decode on another of the same roleset. Indexes into `ModelView::pods`.
    Pair { prefill: usize, decode: usize },
    /// One pod runs the whole request (a combined pod, or a non-PD strategy).
    Single { pod: usize },
}

impl Target {
    /// The counters a selection charges; released one by one as the request progresses.
    pub fn charges(self) -> [(Option<usize>, Counter); 2] {
        match self {
            Target::Pair { prefill, decode } => [
                (Some(prefill), Counter::PrefillInflight),
                (Some(decode), Counter::Running),
            ],
            Target::Single { pod } => [(Some(pod), Counter::Running), (None, Counter::Running)],
        }
    }

    /// Applies the charges to the table (inside the same CAS round as the selection).
    pub fn charge(self, model: &ModelView, table: &mut LoadTable) {
        for (pod, counter) in self.charges() {
            if let Some(pod) = pod {
                table.add(&model.pods[pod].key, counter);
            }
        }
    }
}

/// Keeps the minimum of a stream, choosing uniformly among equal minima.
struct MinPicker {
    best: Option<(u64, usize)>,
    ties: u32,
}

impl MinPicker {
    fn new() -> Self {
        MinPicker {
            best: None,
            ties: 0,
        }
    }

    fn offer(&mut self, score: u64, item: usize, rng: &mut fastrand::Rng) {
        match self.best {
            Some((best, _)) if score > best => {}
            Some((best, _)) if score == best => {
                self.ties += 1;
                if rng.u32(0..self.ties) == 0 {
                    self.best = Some((score, item));
                }
            }
            _ => {
                self.best = Some((score, item));
                self.ties = 1;
            }
        }
    }
}

/// PD selection: a complete roleset if there is one, else a combined pod.
pub fn select_pd(
    model: &ModelView,
    loads: &LoadTable,
    rng: &mut fastrand::Rng,
) -> Result<Target, RouteError> {
    let mut best = MinPicker::new();
    let mut pairs: Vec<(usize, usize)> = Vec::with_capacity(model.rolesets.len());
    for roleset in &model.rolesets {
        let mut p = MinPicker::new();
        for &i in &roleset.prefill {
            p.offer(
                loads.counts(&model.pods[i].key).prefill_inflight as u64,
                i,
                rng,
            );
        }
        let mut d = MinPicker::new();
        for &i in &roleset.decode {
            d.offer(loads.counts(&model.pods[i].key).running as u64, i, rng);
        }
        if let (Some((ps, pi)), Some((ds, di))) = (p.best, d.best) {
            best.offer(ps + ds, pairs.len(), rng);
            pairs.push((pi, di));
        }
    }
    if let Some((_, i)) = best.best {
        let (prefill, decode) = pairs[i];
        return Ok(Target::Pair { prefill, decode });
    }
    if let Some(pod) = least_running(model, model.combined.iter().copied(), loads, rng) {
        return Ok(Target::Single { pod });
    }
    Err(RouteError::Selection {
        detail: format!(
            "no complete prefill/decode roleset and no combined pod among {} routable pods",
            model.pods.len()
        ),
    })
}

/// Single-pod routing for requests without the `pd` strategy: pods that run whole requests
/// (any role but prefill/decode), least outstanding first.
pub fn select_single(
    model: &ModelView,
    loads: &LoadTable,
    rng: &mut fastrand::Rng,
) -> Result<Target, RouteError> {
    let candidates = model
        .pods
        .iter()
        .enumerate()
        .filter(|(_, p)| p.role == Role::Other)
        .map(|(i, _)| i);
    least_running(model, candidates, loads, rng)
        .map(|pod| Target::Single { pod })
        .ok_or_else(|| RouteError::Selection {
            detail: "no pod of the model serves whole requests; send routing-strategy: pd".into(),
        })
}

fn least_running(
    model: &ModelView,
    candidates: impl Iterator<Item = usize>,
    loads: &LoadTable,
    rng: &mut fastrand::Rng,
) -> Option<usize> {
    let mut best = MinPicker::new();
    for i in candidates {
        best.offer(loads.counts(&model.pods[i].key).running as u64, i, rng);
    }
    best.best.map(|(_, i)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;

    fn model(pods: Vec<crate::proto::Pod>) -> ModelView {
        FleetView::from_snapshot(&snapshot(pods)).models["m"].clone()
    }

    fn two_rolesets() -> ModelView {
        model(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g0", true),
            pod("p1", "prefill", "g1", true),
            pod("d1", "decode", "g1", true),
        ])
    }

    #[test]
    fn pairs_come_from_one_roleset_and_spread_by_load() {
        let m = two_rolesets();
        let mut rng = fastrand::Rng::with_seed(1);
        let mut table = LoadTable::default();
        let mut used = Vec::new();
        for _ in 0..4 {
            let t = select_pd(&m, &table, &mut rng).unwrap();
            let Target::Pair { prefill, decode } = t else {
                panic!("expected a pair")
            };
            assert_eq!(m.pods[prefill].roleset, m.pods[decode].roleset);
            t.charge(&m, &mut table);
            used.push(m.pods[decode].roleset.clone());
        }
        used.sort();
        assert_eq!(
            used,
            ["g0", "g0", "g1", "g1"],
            "charges steer the next selection"
        );
    }

    #[test]
    fn ties_are_broken_at_random() {
        let m = two_rolesets();
        let mut rng = fastrand::Rng::with_seed(7);
        let table = LoadTable::default();
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..64 {
            if let Target::Pair { decode, .. } = select_pd(&m, &table, &mut rng).unwrap() {
                seen.insert(m.pods[decode].roleset.clone());
            }
        }
        assert_eq!(seen.len(), 2);
    }

    #[test]
    fn incomplete_rolesets_fall_back_to_combined_or_fail() {
        let mut c = pod("c0", "all", "", true);
        c.config = r#"{"profiles":{"default":{"routingConfig":{"combined":true}}}}"#.into();
        let with_combined = model(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g0", false),
            c,
        ]);
        let mut rng = fastrand::Rng::with_seed(3);
        let t = select_pd(&with_combined, &LoadTable::default(), &mut rng).unwrap();
        assert_eq!(
            t,
            Target::Single {
                pod: with_combined.combined[0]
            }
        );

        let without = model(vec![pod("p0", "prefill", "g0", true)]);
        assert!(matches!(
            select_pd(&without, &LoadTable::default(), &mut rng),
            Err(RouteError::Selection { .. })
        ));
        assert!(matches!(
            select_single(&without, &LoadTable::default(), &mut rng),
            Err(RouteError::Selection { .. })
        ));
    }
}
