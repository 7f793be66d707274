//! The gateway's readiness answer: a request for `PluginConfig::ready_path` is answered by
//! the worker it lands on, ready once that worker has a fleet snapshot to route on.
//!
//! Envoy's own readiness (its admin `/ready`, what Istio's agent reports) turns true once the
//! listeners are up, while a worker without a snapshot answers every request 503: a gateway
//! started while pd-control is unreachable would take a load balancer's share of traffic and
//! fail all of it, and a rollout would replace working gateways with such ones. A snapshot
//! that went stale keeps the gateway ready: it routes on that snapshot's pods (pd-control's
//! last word), and calling every gateway unready while pd-control is down would take the whole
//! fleet out of service at once.

/// Whether a request's `:path` (its query ignored) asks for the readiness answer; an empty
/// `ready_path` turns the answer off.
pub fn is_probe(path: &str, ready_path: &str) -> bool {
    !ready_path.is_empty() && path.split('?').next() == Some(ready_path)
}

/// The status and JSON body of the answer, given the version of the snapshot the worker
/// routes on (`None`: it has none yet).
pub fn answer(snapshot_version: Option<u64>) -> (u32, String) {
    match snapshot_version {
        Some(version) => (
            200,
            format!(r#"{{"ready":true,"snapshot_version":{version}}}"#),
        ),
        None => (
            503,
            r#"{"ready":false,"reason":"no fleet snapshot yet: pd-control has not answered this worker's poll"}"#
                .to_string(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_path_matches_whole_and_without_its_query() {
        let ready = "/pd-router/ready";
        assert!(is_probe("/pd-router/ready", ready));
        assert!(is_probe("/pd-router/ready?verbose=1", ready));
        for other in [
            "/pd-router/ready/",
            "/pd-router/readyz",
            "/pd-router",
            "/v1/chat/completions",
            "",
        ] {
            assert!(!is_probe(other, ready), "{other}");
        }
        assert!(
            !is_probe("/pd-router/ready", ""),
            "an empty ready_path is off"
        );
        assert!(!is_probe("", ""));
    }

    #[test]
    fn ready_only_with_a_snapshot() {
        let (status, body) = answer(Some(42));
        assert_eq!(status, 200);
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(
            v,
            serde_json::json!({"ready": true, "snapshot_version": 42})
        );
        let (status, body) = answer(None);
        assert_eq!(status, 503);
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(v["ready"], false);
        assert!(v["reason"]
            .as_str()
            .is_some_and(|r| r.contains("pd-control")));
    }
}
