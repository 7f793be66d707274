//! PD target selection. This first policy picks the complete roleset whose least-loaded
//! prefill and decode pods carry the fewest outstanding requests, ties broken at random;
//! the full AIBrix cascade (buckets, fast paths, scoring policies) builds on the same shape.

pub mod bucket_serve;
pub mod candidates;
pub mod pick;
pub mod single;

pub use candidates::{Step0, Step0Input};
pub use pick::MinPicker;
pub use single::select_single;

use crate::core::errors::RouteError;
use crate::core::fleet::ModelView;
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
    /// The pod that answers the client: the decode pod of a pair, or the single pod.
    pub fn pod(self) -> usize {
        match self {
            Target::Pair { decode, .. } => decode,
            Target::Single { pod } => pod,
        }
    }

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

/// PD selection: Step 0 (candidates, buckets, standard pods), then the pair with the fewest
/// outstanding requests among the candidates, pairs always from one roleset.
pub fn select_pd(
    model: &ModelView,
    input: Step0Input<'_>,
    loads: &LoadTable,
    rng: &mut fastrand::Rng,
) -> Result<Target, RouteError> {
    let (prefill, decode) = match candidates::collect(model, input, &mut |n| rng.usize(0..n))? {
        Step0::Combined(pod) => return Ok(Target::Single { pod }),
        Step0::Pairs { prefill, decode } => (prefill, decode),
    };
    let mut best = MinPicker::new();
    let mut pairs: Vec<(usize, usize)> = Vec::with_capacity(model.rolesets.len());
    for roleset in &model.rolesets {
        let mut p = MinPicker::new();
        for &i in roleset.prefill.iter().filter(|i| prefill.contains(i)) {
            p.offer(
                loads.counts(&model.pods[i].key).prefill_inflight as f64,
                i,
                rng,
            );
        }
        let mut d = MinPicker::new();
        for &i in roleset.decode.iter().filter(|i| decode.contains(i)) {
            d.offer(loads.counts(&model.pods[i].key).running as f64, i, rng);
        }
        if let (Some((ps, pi)), Some((ds, di))) = (p.best, d.best) {
            best.offer(ps + ds, pairs.len(), rng);
            pairs.push((pi, di));
        }
    }
    match best.best {
        Some((_, i)) => {
            let (prefill, decode) = pairs[i];
            Ok(Target::Pair { prefill, decode })
        }
        None => Err(RouteError::Selection {
            detail: "target prefill pod is nil".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;
    use crate::core::profile::Strategy;

    const INPUT: Step0Input<'static> = Step0Input {
        profile: None,
        bucketing: false,
        prompt_len: 0,
    };

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
            let t = select_pd(&m, INPUT, &table, &mut rng).unwrap();
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
            if let Target::Pair { decode, .. } = select_pd(&m, INPUT, &table, &mut rng).unwrap() {
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
        let t = select_pd(&with_combined, INPUT, &LoadTable::default(), &mut rng).unwrap();
        assert_eq!(with_combined.pods[t.pod()].name, "c0");

        let without = model(vec![pod("p0", "prefill", "g0", true)]);
        assert!(matches!(
            select_pd(&without, INPUT, &LoadTable::default(), &mut rng),
            Err(RouteError::Selection { .. })
        ));
        assert!(matches!(
            select_single(
                &without,
                Strategy::LeastRequest,
                &LoadTable::default(),
                &mut rng
            ),
            Err(RouteError::Selection { .. })
        ));
    }
}
