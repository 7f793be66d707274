//! Step 0: which prefill, decode and standard pods may serve this request.
//!
//! Only complete rolesets count. With prompt-length bucketing a roleset contributes only when
//! both its prefill and its decode side have a pod whose range holds the prompt, so half-pairs
//! never enter; when no bucket-matched pair exists the request goes to a standard pod whose
//! range matches, never to a pair of another bucket.
//!
//! Where AIBrix's code and the product documentation disagree, the documentation wins:
//! a standard pod may omit `role-name` and `roleset-name` (the code required both), and a
//! standard pod is also the fallback when bucketing is off and no complete roleset exists
//! (the code considered standard pods only with bucketing on).

use crate::core::errors::RouteError;
use crate::core::fleet::{ModelView, PodView};

/// What Step 0 decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Step0 {
    /// PD candidates (indexes into `ModelView::pods`), to be narrowed by the later steps.
    Pairs {
        prefill: Vec<usize>,
        decode: Vec<usize>,
    },
    /// A standard pod serves the whole request.
    Combined(usize),
}

/// Inputs of Step 0 that come from the request.
#[derive(Debug, Clone, Copy)]
pub struct Step0Input<'a> {
    pub profile: Option<&'a str>,
    pub bucketing: bool,
    /// Prompt tokens; only read when `bucketing` is on.
    pub prompt_len: i64,
}

/// Runs Step 0. `random` picks uniformly in `0..n`.
pub fn collect(
    model: &ModelView,
    input: Step0Input<'_>,
    random: &mut dyn FnMut(usize) -> usize,
) -> Result<Step0, RouteError> {
    let fits =
        |pod: &PodView| !input.bucketing || pod.accepts_prompt_len(input.profile, input.prompt_len);
    let combined: Vec<usize> = model
        .others
        .iter()
        .copied()
        .filter(|&i| model.pods[i].is_combined(input.profile) && fits(&model.pods[i]))
        .collect();

    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut bucket_prefill = Vec::new();
    let mut bucket_decode = Vec::new();
    for roleset in model.rolesets.iter() {
        prefill.extend_from_slice(&roleset.prefill);
        decode.extend_from_slice(&roleset.decode);
        if input.bucketing {
            let p: Vec<usize> = roleset
                .prefill
                .iter()
                .copied()
                .filter(|&i| fits(&model.pods[i]))
                .collect();
            let d: Vec<usize> = roleset
                .decode
                .iter()
                .copied()
                .filter(|&i| fits(&model.pods[i]))
                .collect();
            if !p.is_empty() && !d.is_empty() {
                bucket_prefill.extend(p);
                bucket_decode.extend(d);
            }
        }
    }

    if input.bucketing {
        if bucket_prefill.is_empty() || bucket_decode.is_empty() {
            return match combined.len() {
                0 => Err(RouteError::Selection {
                    detail: format!(
                        "no prompt-length bucket matches prompt length {} and no combined pods available",
                        input.prompt_len
                    ),
                }),
                n => Ok(Step0::Combined(combined[random(n)])),
            };
        }
        if let Some(pod) =
            overflow_to_combined(model, &bucket_prefill, &bucket_decode, &combined, random)
        {
            return Ok(Step0::Combined(pod));
        }
        return Ok(Step0::Pairs {
            prefill: bucket_prefill,
            decode: bucket_decode,
        });
    }

    if prefill.is_empty() || decode.is_empty() {
        if !combined.is_empty() {
            return Ok(Step0::Combined(combined[random(combined.len())]));
        }
        // Name the side that is missing; when both sides have ready pods, no roleset holds
        // one of each.
        let ready_prefill = count_role(model, crate::core::fleet::Role::Prefill);
        let ready_decode = count_role(model, crate::core::fleet::Role::Decode);
        let what = match (ready_prefill, ready_decode) {
            (0, _) => "prefill pods are not ready",
            (_, 0) => "decode pods are not ready",
            _ => "no roleset has both a ready prefill and a ready decode pod",
        };
        return Err(RouteError::Selection {
            detail: format!("{what}: prefill={ready_prefill}, decode={ready_decode}"),
        });
    }
    Ok(Step0::Pairs { prefill, decode })
}

/// The rolesets as adaptive bucket serving sees them: the declared range of the roleset's
/// first prefill pod (for the request's profile) and its prefill replica count.
pub fn bucket_groups(
    model: &ModelView,
    profile: Option<&str>,
) -> Vec<crate::core::pd::bucket_serve::Group> {
    model
        .rolesets
        .iter()
        .filter_map(|r| {
            let first = model.pods.get(*r.prefill.first()?)?;
            let (min, max) = first
                .routing_config(profile)
                .map(|rc| {
                    (
                        rc.prompt_len_bucket_min_length,
                        rc.prompt_len_bucket_max_length,
                    )
                })
                .unwrap_or((0, 0));
            crate::core::pd::bucket_serve::Group::from_declared(
                &r.name,
                min,
                max,
                r.prefill.len() as u32,
            )
        })
        .collect()
}

fn count_role(model: &ModelView, role: crate::core::fleet::Role) -> usize {
    model.pods.iter().filter(|p| p.role == role).count()
}

/// Queue-drain score of a pod: waiting requests over completed requests per second.
/// NaN without metrics, which never compares true: no overflow without evidence.
pub fn drain_score(pod: &PodView) -> f64 {
    match &pod.metrics {
        Some(m) if !m.stale => m.waiting / m.drain_rate.max(0.01),
        _ => f64::NAN,
    }
}

/// `shouldPickCombined`: some standard pod is nearly idle (score < 0.25) while some
/// bucket-matched prefill or decode pod is backed up (score > 1.0). Returns the standard pod
/// with the lowest score, ties broken at random.
fn overflow_to_combined(
    model: &ModelView,
    prefill: &[usize],
    decode: &[usize],
    combined: &[usize],
    random: &mut dyn FnMut(usize) -> usize,
) -> Option<usize> {
    let idle = combined.iter().any(|&i| drain_score(&model.pods[i]) < 0.25);
    let busy = prefill
        .iter()
        .chain(decode)
        .any(|&i| drain_score(&model.pods[i]) > 1.0);
    if !(idle && busy) {
        return None;
    }
    let mut best: Option<(f64, usize)> = None;
    let mut ties = 0usize;
    for &i in combined {
        let score = drain_score(&model.pods[i]);
        if score.is_nan() {
            continue;
        }
        match best {
            Some((b, _)) if score > b => {}
            Some((b, _)) if score == b => {
                ties += 1;
                if random(ties) == 0 {
                    best = Some((score, i));
                }
            }
            _ => {
                best = Some((score, i));
                ties = 1;
            }
        }
    }
    best.map(|(_, i)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;
    use crate::proto;

    fn ranged(mut p: proto::Pod, min: i64, max: i64, combined: bool) -> proto::Pod {
        p.config = format!(
            r#"{{"profiles":{{"default":{{"routingConfig":{{"combined":{combined},"promptLenBucketMinLength":{min},"promptLenBucketMaxLength":{max}}}}}}}}}"#
        );
        p
    }

    fn with_metrics(mut p: proto::Pod, waiting: f64, drain: f64) -> proto::Pod {
        p.metrics = Some(proto::PodMetrics {
            present: true,
            waiting,
            drain_rate: drain,
            ..Default::default()
        });
        p
    }

    fn model(pods: Vec<proto::Pod>) -> ModelView {
        FleetView::from_snapshot(&snapshot(pods)).models["m"].clone()
    }

    fn names(m: &ModelView, idx: &[usize]) -> Vec<String> {
        idx.iter().map(|&i| m.pods[i].name.clone()).collect()
    }

    fn run(m: &ModelView, bucketing: bool, len: i64) -> Result<Step0, RouteError> {
        let mut rng = fastrand::Rng::with_seed(5);
        collect(
            m,
            Step0Input {
                profile: None,
                bucketing,
                prompt_len: len,
            },
            &mut |n| rng.usize(0..n),
        )
    }

    /// The e2e fixture of AIBrix: short 0–15, medium 16–32, and a combined pod.
    fn buckets() -> Vec<proto::Pod> {
        vec![
            ranged(pod("sp", "prefill", "short", true), 0, 15, false),
            ranged(pod("sd", "decode", "short", true), 0, 15, false),
            ranged(pod("mp", "prefill", "medium", true), 16, 32, false),
            ranged(pod("md", "decode", "medium", true), 16, 32, false),
            ranged(pod("all0", "all", "", true), 0, 0, true),
        ]
    }

    #[test]
    fn bucketing_selects_the_matching_roleset_or_the_combined_pod() {
        let m = model(buckets());
        let Ok(Step0::Pairs { prefill, decode }) = run(&m, true, 10) else {
            panic!()
        };
        assert_eq!(
            (names(&m, &prefill), names(&m, &decode)),
            (vec!["sp".to_string()], vec!["sd".to_string()])
        );
        let Ok(Step0::Pairs { prefill, .. }) = run(&m, true, 20) else {
            panic!()
        };
        assert_eq!(names(&m, &prefill), ["mp"]);
        let Ok(Step0::Combined(c)) = run(&m, true, 40) else {
            panic!()
        };
        assert_eq!(m.pods[c].name, "all0");
        // Edges are inclusive.
        assert!(matches!(run(&m, true, 15), Ok(Step0::Pairs { .. })));
        assert!(matches!(run(&m, true, 32), Ok(Step0::Pairs { .. })));
    }

    #[test]
    fn bucket_decode_down_falls_back_to_combined_and_without_one_errors() {
        let mut pods = buckets();
        pods[3].ready = false; // medium decode pod down
        let m = model(pods.clone());
        assert!(
            matches!(run(&m, true, 20), Ok(Step0::Combined(_))),
            "never a pair from another bucket"
        );
        pods.pop();
        let m = model(pods);
        let err = run(&m, true, 20).unwrap_err();
        assert!(
            matches!(&err, RouteError::Selection { detail } if detail.contains("no prompt-length bucket matches prompt length 20"))
        );
    }

    #[test]
    fn only_both_sides_suitable_enter_the_bucket_lists() {
        let m = model(vec![
            ranged(pod("p0", "prefill", "g0", true), 0, 100, false),
            ranged(pod("d0", "decode", "g0", true), 200, 300, false),
            ranged(pod("p1", "prefill", "g1", true), 0, 100, false),
            ranged(pod("d1", "decode", "g1", true), 0, 100, false),
        ]);
        let Ok(Step0::Pairs { prefill, decode }) = run(&m, true, 50) else {
            panic!()
        };
        assert_eq!(
            (names(&m, &prefill), names(&m, &decode)),
            (vec!["p1".to_string()], vec!["d1".to_string()])
        );
        // Bucketing off: ranges are ignored and every complete roleset counts.
        let Ok(Step0::Pairs { prefill, .. }) = run(&m, false, 50) else {
            panic!()
        };
        assert_eq!(prefill.len(), 2);
    }

    #[test]
    fn without_bucketing_an_incomplete_fleet_uses_a_standard_pod_or_fails() {
        let m = model(vec![
            pod("p0", "prefill", "g0", true),
            ranged(pod("c", "", "", true), 0, 0, true),
        ]);
        assert!(
            matches!(run(&m, false, 5), Ok(Step0::Combined(_))),
            "a standard pod may omit role-name"
        );
        let m = model(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g1", true),
        ]);
        let err = run(&m, false, 5).unwrap_err();
        assert!(
            matches!(&err, RouteError::Selection { detail } if detail == "no roleset has both a ready prefill and a ready decode pod: prefill=1, decode=1")
        );
        let m = model(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g0", false),
        ]);
        let err = run(&m, false, 5).unwrap_err();
        assert!(
            matches!(&err, RouteError::Selection { detail } if detail == "decode pods are not ready: prefill=1, decode=0"),
            "the missing side is named: {err:?}"
        );
    }

    #[test]
    fn overflow_to_an_idle_combined_pod_needs_evidence() {
        let busy = |p| with_metrics(p, 40.0, 10.0); // score 4
        let idle = |p| with_metrics(p, 0.0, 10.0); // score 0
        let mut pods = vec![
            busy(ranged(pod("p0", "prefill", "g0", true), 0, 0, false)),
            ranged(pod("d0", "decode", "g0", true), 0, 0, false),
            idle(ranged(pod("c0", "all", "", true), 0, 0, true)),
        ];
        let m = model(pods.clone());
        assert!(matches!(run(&m, true, 5), Ok(Step0::Combined(_))));
        pods[2].metrics = None; // no drain rate: NaN never compares
        let m = model(pods);
        assert!(matches!(run(&m, true, 5), Ok(Step0::Pairs { .. })));
    }
}
