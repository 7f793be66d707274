//! The second pod named with every routed request, for Envoy to retry on when the chosen one
//! refuses the connection.
//!
//! A pod that died since the last snapshot refuses connections until pd-control sees it
//! (one scrape, ≈ 150 ms) and every worker has the new snapshot. Envoy can retry a refused
//! connection only on a host it was told of before the request left: the filter names the
//! chosen pod and this one in the destinations header, and the `override_host` load
//! balancer of the retrying cluster takes them in that order, one per attempt. Nothing was
//! computed on a pod that refused the connection, so any pod that could have been chosen
//! instead may serve the request whole.
//!
//! Which pods may stand in:
//! - a pair's decode pod: another decode pod of the same complete roleset (the KV comes
//!   from the prefill pod, which any decode pod of the roleset can pull from or join);
//! - a standard pod: another standard pod, combined under the request's profile when the
//!   chosen one is (a PD request's whole-request pod), any otherwise;
//! - with prompt-length bucketing, a decode or combined stand-in also holds the prompt in its
//!   range, as Step 0 requires of the pod it stands in for;
//! - a prefill or decode pod serving alone (a token count): none.
//!
//! The stand-in is drawn at random, not scored: it serves only when the chosen pod is dead,
//! and a dead pod's requests then spread over its siblings instead of piling onto one.
//! Cost: one draw and, usually, one step (a walk past the siblings that do not fit).

use crate::core::fleet::{ModelView, Role};
use crate::core::pd::{Step0Input, Target};

/// [`stand_in_fitting`] for a request routed without prompt-length bucketing; `profile` is
/// the request's. A caller that buckets passes its Step 0 input to [`stand_in_fitting`].
pub fn stand_in(
    model: &ModelView,
    target: Target,
    profile: Option<&str>,
    rng: &mut fastrand::Rng,
) -> Option<usize> {
    let request = Step0Input {
        profile,
        bucketing: false,
        prompt_len: 0,
    };
    stand_in_fitting(model, target, request, rng)
}

/// A pod other than `target`'s answering one that may serve the request if that one refuses
/// the connection; `None` when no such pod is in `model`. `request` is what Step 0 ran with:
/// with bucketing on, a decode or combined stand-in must hold the prompt in its range, as
/// Step 0 required of the chosen pod (a pod of another bucket is never a fallback). A plain
/// standard pod's stand-in is any standard pod: single-pod strategies do not bucket.
pub fn stand_in_fitting(
    model: &ModelView,
    target: Target,
    request: Step0Input<'_>,
    rng: &mut fastrand::Rng,
) -> Option<usize> {
    let chosen = target.pod();
    let pod = model.pods.get(chosen)?;
    let profile = request.profile;
    let in_range = |j: usize| {
        !request.bucketing || model.pods[j].accepts_prompt_len(profile, request.prompt_len)
    };
    match target {
        Target::Pair { decode, .. } => {
            let roleset = model.rolesets.get(pod.roleset_idx?)?;
            draw(&roleset.decode, decode, rng, in_range)
        }
        Target::Single { pod: i } if pod.role == Role::Other => {
            let combined = pod.is_combined(profile);
            draw(&model.others, i, rng, |j| {
                !combined || (model.pods[j].is_combined(profile) && in_range(j))
            })
        }
        Target::Single { .. } => None,
    }
}

/// A random member of `pods` other than `chosen` that `fits`, found by walking from a random
/// start: uniform enough for spreading, and it stops at the first fit.
fn draw(
    pods: &[usize],
    chosen: usize,
    rng: &mut fastrand::Rng,
    fits: impl Fn(usize) -> bool,
) -> Option<usize> {
    if pods.len() < 2 {
        return None;
    }
    let start = rng.usize(..pods.len());
    (0..pods.len())
        .map(|step| pods[(start + step) % pods.len()])
        .find(|&p| p != chosen && fits(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;
    use crate::proto;

    fn view(pods: Vec<proto::Pod>) -> ModelView {
        let fleet = FleetView::from_snapshot(&snapshot(pods));
        fleet.models.values().next().cloned().expect("one model")
    }

    fn index(model: &ModelView, name: &str) -> usize {
        model
            .pods
            .iter()
            .position(|p| p.name == name)
            .expect("pod in view")
    }

    fn combined(mut p: proto::Pod) -> proto::Pod {
        p.config = r#"{"profiles":{"pd":{"routingConfig":{"combined":true}}}}"#.into();
        p
    }

    #[test]
    fn a_decode_pod_stands_in_only_for_a_decode_pod_of_its_roleset() {
        let model = view(vec![
            pod("p-a", "prefill", "a", true),
            pod("d-a1", "decode", "a", true),
            pod("d-a2", "decode", "a", true),
            pod("p-b", "prefill", "b", true),
            pod("d-b1", "decode", "b", true),
        ]);
        let (prefill, decode) = (index(&model, "p-a"), index(&model, "d-a1"));
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..50 {
            let got = stand_in(&model, Target::Pair { prefill, decode }, None, &mut rng);
            assert_eq!(got, Some(index(&model, "d-a2")));
        }
        let lone = Target::Pair {
            prefill: index(&model, "p-b"),
            decode: index(&model, "d-b1"),
        };
        assert_eq!(
            stand_in(&model, lone, None, &mut rng),
            None,
            "d-b1 has no sibling"
        );
    }

    #[test]
    fn standard_pods_stand_in_for_each_other_and_spread_over_the_siblings() {
        let model = view(
            (0..4)
                .map(|i| pod(&format!("s{i}"), "", "", true))
                .collect(),
        );
        let chosen = index(&model, "s0");
        let mut rng = fastrand::Rng::with_seed(3);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let got = stand_in(&model, Target::Single { pod: chosen }, None, &mut rng)
                .expect("three siblings");
            assert_ne!(got, chosen);
            seen.insert(got);
        }
        assert_eq!(seen.len(), 3, "every sibling is drawn");
    }

    #[test]
    fn a_combined_pod_stands_in_only_for_a_combined_pod_of_the_same_profile() {
        let model = view(vec![
            combined(pod("c1", "", "", true)),
            pod("plain", "", "", true),
            combined(pod("c2", "", "", true)),
        ]);
        let chosen = index(&model, "c1");
        let mut rng = fastrand::Rng::with_seed(11);
        for _ in 0..50 {
            let got = stand_in(&model, Target::Single { pod: chosen }, Some("pd"), &mut rng);
            assert_eq!(got, Some(index(&model, "c2")));
        }
        // A plain pod may be stood in for by any standard pod, combined or not.
        let plain = index(&model, "plain");
        let got = stand_in(&model, Target::Single { pod: plain }, Some("pd"), &mut rng);
        assert!(got.is_some_and(|g| g != plain));
    }

    /// `p` with the `pd` profile's prompt-length range `[min, max]` (and `combined` for a
    /// standard pod).
    fn ranged(mut p: proto::Pod, min: i64, max: i64) -> proto::Pod {
        let combined = p.role.is_empty();
        p.config = format!(
            r#"{{"profiles":{{"pd":{{"routingConfig":{{"combined":{combined},
            "promptLenBucketMinLength":{min},"promptLenBucketMaxLength":{max}}}}}}}}}"#
        );
        p
    }

    #[test]
    fn with_bucketing_a_stand_in_holds_the_prompt_in_its_range() {
        let model = view(vec![
            ranged(pod("c-short", "", "", true), 0, 2048),
            ranged(pod("c-long", "", "", true), 2049, 0),
            ranged(pod("c-any", "", "", true), 0, 0),
            ranged(pod("p", "prefill", "a", true), 0, 0),
            ranged(pod("d-short", "decode", "a", true), 0, 2048),
            ranged(pod("d-long", "decode", "a", true), 2049, 0),
            ranged(pod("d-any", "decode", "a", true), 0, 0),
        ]);
        let long = Step0Input {
            profile: Some("pd"),
            bucketing: true,
            prompt_len: 3000,
        };
        let mut rng = fastrand::Rng::with_seed(5);
        let single = Target::Single {
            pod: index(&model, "c-long"),
        };
        let pair = Target::Pair {
            prefill: index(&model, "p"),
            decode: index(&model, "d-long"),
        };
        for _ in 0..50 {
            let got = stand_in_fitting(&model, single, long, &mut rng);
            assert_eq!(got, Some(index(&model, "c-any")), "c-short is too short");
            let got = stand_in_fitting(&model, pair, long, &mut rng);
            assert_eq!(got, Some(index(&model, "d-any")), "d-short is too short");
        }
        // Without bucketing the ranges do not matter.
        let mut seen = std::collections::HashSet::new();
        for _ in 0..100 {
            seen.extend(stand_in(&model, single, Some("pd"), &mut rng));
        }
        assert!(seen.contains(&index(&model, "c-short")), "{seen:?}");
    }

    #[test]
    fn a_prefill_or_decode_pod_serving_alone_has_no_stand_in() {
        let model = view(vec![
            pod("p", "prefill", "a", true),
            pod("d1", "decode", "a", true),
            pod("d2", "decode", "a", true),
        ]);
        let mut rng = fastrand::Rng::with_seed(1);
        let alone = Target::Single {
            pod: index(&model, "d1"),
        };
        assert_eq!(stand_in(&model, alone, None, &mut rng), None);
    }

    #[test]
    fn a_lone_pod_or_an_index_outside_the_view_has_none() {
        let model = view(vec![pod("s", "", "", true)]);
        let mut rng = fastrand::Rng::with_seed(1);
        assert_eq!(
            stand_in(&model, Target::Single { pod: 0 }, None, &mut rng),
            None
        );
        assert_eq!(
            stand_in(&model, Target::Single { pod: 9 }, None, &mut rng),
            None
        );
    }
}
