//! `session-affinity`: keeps a conversation on one standard pod, where the pod's own prefix
//! cache still holds its earlier turns.
//!
//! The pod is found, in AIBrix's order:
//! 1. `x-session-id`, the address this gateway (or AIBrix's) handed out on an earlier answer,
//!    in standard base64: honoured while that pod is still a candidate;
//! 2. `x-aibrix-session-key`, the caller's own key, mapped to a pod by rendezvous hashing;
//! 3. otherwise any candidate, uniformly.
//!
//! Rendezvous hashing needs no table: every worker and every replica maps a key to the same
//! pod, and a pod leaving moves only its own sessions (a pod joining takes about 1/n of them).
//! The hash is FNV-1a 64 over key, a zero byte and `ip:port`, as AIBrix computes it, so a fleet
//! half moved from AIBrix to pd-router still sends a session to one pod.

use base64::Engine as _;
use std::hash::Hasher;

use crate::core::errors::RouteError;
use crate::core::fleet::ModelView;
use crate::core::pd::single::no_standard_pod;
use crate::core::pd::{MinPicker, Target};
use crate::core::profile::Strategy;
use crate::core::tokens::MAX_SESSION_KEY_BYTES;

/// The response header naming the chosen pod, and the request header that asks for it again.
pub const SESSION_ID_HEADER: &str = "x-session-id";

/// What the request says about its session.
#[derive(Debug, Clone, Copy, Default)]
pub struct SessionHint<'a> {
    /// `x-session-id` as received.
    pub session_id: Option<&'a str>,
    /// `x-aibrix-session-key` as received.
    pub session_key: Option<&'a str>,
}

/// Which rule found the pod: the `result` label of `pd_router_session_affinity_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    SessionId,
    SessionKey,
    Random,
}

impl Via {
    pub const ALL: [Via; 3] = [Via::SessionId, Via::SessionKey, Via::Random];

    pub fn name(self) -> &'static str {
        match self {
            Via::SessionId => "session_id",
            Via::SessionKey => "session_key",
            Via::Random => "random",
        }
    }
}

/// The `x-session-id` value that leads back to `address`.
pub fn session_id(address: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(address)
}

/// The address an `x-session-id` value names; `None` for anything that is not base64 of text.
fn address_of(session_id: &str) -> Option<String> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(session_id)
        .ok()?;
    String::from_utf8(bytes).ok()
}

/// The rendezvous weight of `address` for `key`: the highest wins.
fn weight(key: &str, address: &str) -> u64 {
    let mut h = fnv::FnvHasher::default();
    h.write(key.as_bytes());
    // Separates the two strings, so "ab"+"c" and "a"+"bc" differ.
    h.write_u8(0);
    h.write(address.as_bytes());
    h.finish()
}

/// The pod the request's session names, by `x-session-id` or else `x-aibrix-session-key`,
/// among the pods that run whole requests; `None` when neither names one.
pub fn resolve(model: &ModelView, hint: SessionHint<'_>) -> Option<(usize, Via)> {
    let candidates = || model.others.iter().map(|&i| (i, &model.pods[i]));
    if let Some(address) = hint.session_id.and_then(address_of) {
        if let Some((i, _)) = candidates().find(|(_, p)| p.address == address) {
            return Some((i, Via::SessionId));
        }
    }
    let key = hint
        .session_key
        .filter(|k| !k.is_empty() && k.len() <= MAX_SESSION_KEY_BYTES)?;
    candidates()
        .map(|(i, p)| (weight(key, &p.address), std::cmp::Reverse(&p.address), i))
        .max()
        .map(|(_, _, i)| (i, Via::SessionKey))
}

/// Picks the pod for a `session-affinity` request: the session's pod, else any pod that runs
/// whole requests, uniformly.
pub fn select(
    model: &ModelView,
    hint: SessionHint<'_>,
    rng: &mut fastrand::Rng,
) -> Result<(Target, Via), RouteError> {
    if let Some((pod, via)) = resolve(model, hint) {
        return Ok((Target::Single { pod }, via));
    }
    let mut any = MinPicker::new();
    for &i in &model.others {
        any.offer(0.0, i, rng);
    }
    any.item()
        .map(|pod| (Target::Single { pod }, Via::Random))
        .ok_or_else(|| no_standard_pod(Strategy::SessionAffinity.name()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;
    use crate::proto;

    fn fleet(names: &[&str]) -> ModelView {
        let mut pods: Vec<proto::Pod> = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let mut p = pod(n, "", "", true);
                p.ip = format!("10.0.0.{}", i + 1);
                p
            })
            .collect();
        pods.push(pod("pre", "prefill", "g", true));
        pods.push(pod("dec", "decode", "g", true));
        FleetView::from_snapshot(&snapshot(pods)).models["m"].clone()
    }

    fn pick(m: &ModelView, hint: SessionHint<'_>) -> (String, Via) {
        let mut rng = fastrand::Rng::with_seed(7);
        let (t, via) = select(m, hint, &mut rng).unwrap();
        (m.pods[t.pod()].name.clone(), via)
    }

    fn keyed(key: &str) -> SessionHint<'_> {
        SessionHint {
            session_id: None,
            session_key: Some(key),
        }
    }

    #[test]
    fn the_hash_is_fnv1a_64_over_key_zero_and_address() {
        // FNV-1a 64 of the empty input is its offset basis; of "a" a published test vector.
        assert_eq!(fnv::FnvHasher::default().finish(), 0xcbf2_9ce4_8422_2325);
        let mut h = fnv::FnvHasher::default();
        h.write(b"a");
        assert_eq!(h.finish(), 0xaf63_dc4c_8601_ec8c);
        // The separator keeps concatenations apart.
        assert_ne!(weight("ab", "c"), weight("a", "bc"));
    }

    #[test]
    fn a_session_key_always_lands_on_the_same_pod_and_keys_spread() {
        let m = fleet(&["a", "b", "c", "d"]);
        let mut seen = std::collections::HashMap::new();
        for k in 0..400 {
            let key = format!("conversation-{k}");
            let (first, via) = pick(&m, keyed(&key));
            assert_eq!(via, Via::SessionKey);
            for _ in 0..3 {
                assert_eq!(pick(&m, keyed(&key)).0, first);
            }
            assert!(!["pre", "dec"].contains(&first.as_str()));
            *seen.entry(first).or_insert(0) += 1;
        }
        assert_eq!(seen.len(), 4, "{seen:?}");
        assert!(seen.values().all(|&n| n > 60), "{seen:?}");
    }

    #[test]
    fn a_pod_leaving_moves_only_its_own_sessions() {
        let before = fleet(&["a", "b", "c", "d"]);
        // Same addresses for a, b, d; c is gone.
        let mut pods: Vec<proto::Pod> = [("a", 1), ("b", 2), ("d", 4)]
            .iter()
            .map(|(n, i)| {
                let mut p = pod(n, "", "", true);
                p.ip = format!("10.0.0.{i}");
                p
            })
            .collect();
        pods.push(pod("pre", "prefill", "g", true));
        let after = FleetView::from_snapshot(&snapshot(pods)).models["m"].clone();
        let mut moved = 0;
        for k in 0..300 {
            let key = format!("s{k}");
            let (was, _) = pick(&before, keyed(&key));
            let (now, _) = pick(&after, keyed(&key));
            if was != "c" {
                assert_eq!(was, now, "{key} moved off a pod that stayed");
            } else {
                moved += 1;
            }
        }
        assert!(moved > 0);
    }

    #[test]
    fn a_session_id_names_its_pod_while_it_is_a_candidate() {
        let m = fleet(&["a", "b", "c"]);
        let b = m.pods.iter().find(|p| p.name == "b").unwrap();
        let id = session_id(&b.address);
        assert_eq!(address_of(&id).as_deref(), Some(b.address.as_str()));
        let hint = SessionHint {
            session_id: Some(&id),
            session_key: Some("k"),
        };
        assert_eq!(pick(&m, hint), ("b".to_string(), Via::SessionId));
        // A prefill pod's address is not a candidate: the key decides instead.
        let pre = m.pods.iter().find(|p| p.name == "pre").unwrap();
        let id = session_id(&pre.address);
        let hint = SessionHint {
            session_id: Some(&id),
            session_key: Some("k"),
        };
        assert_eq!(pick(&m, hint), (pick(&m, keyed("k")).0, Via::SessionKey));
        // Garbage and unknown addresses fall through the same way.
        for bad in ["not base64!", "", &session_id("10.9.9.9:8000"), "//79"] {
            let hint = SessionHint {
                session_id: Some(bad),
                session_key: None,
            };
            assert_eq!(pick(&m, hint).1, Via::Random, "{bad}");
        }
    }

    #[test]
    fn no_usable_key_is_a_uniform_pick_and_no_standard_pod_is_an_error() {
        let m = fleet(&["a", "b", "c"]);
        let long = "k".repeat(MAX_SESSION_KEY_BYTES + 1);
        let mut rng = fastrand::Rng::with_seed(1);
        let mut seen = std::collections::HashSet::new();
        for hint in [keyed(""), keyed(&long), SessionHint::default()] {
            for _ in 0..30 {
                let (t, via) = select(&m, hint, &mut rng).unwrap();
                assert_eq!(via, Via::Random);
                seen.insert(m.pods[t.pod()].name.clone());
            }
        }
        assert_eq!(seen.len(), 3, "{seen:?}");
        let pd_only = fleet(&[]);
        assert!(matches!(
            select(&pd_only, keyed("k"), &mut rng),
            Err(RouteError::Selection { .. })
        ));
    }
}
