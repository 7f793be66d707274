//! The fleet view: a snapshot decoded once per version into per-model indexes, so the
//! request path never touches protobuf and finds rolesets without scanning the fleet.

use hashbrown::HashMap;

use super::config::KvConnector;
use super::profile::ModelConfig;
use crate::proto;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    /// Any other `role-name` value, or none.
    Other,
}

/// One pod, with everything the request path needs precomputed.
#[derive(Debug, Clone)]
pub struct PodView {
    /// `namespace/name`: the key of every load counter.
    pub key: String,
    pub name: String,
    pub ip: String,
    /// `ip:port`, the value of the destination header.
    pub address: String,
    pub engine: String,
    pub role: Role,
    pub roleset: String,
    /// `routingConfig.combined` of the pod's own default profile.
    pub combined: bool,
    /// Per-pod connector label, when it names a known connector.
    pub kv_connector: Option<KvConnector>,
    pub metrics: Option<proto::PodMetrics>,
}

/// A roleset with at least one routable prefill and one routable decode pod.
#[derive(Debug, Clone)]
pub struct Roleset {
    pub name: String,
    pub prefill: Vec<usize>,
    pub decode: Vec<usize>,
}

#[derive(Debug, Clone, Default)]
pub struct ModelView {
    /// Routable pods only (ready, with an IP, serving HTTP).
    pub pods: Vec<PodView>,
    /// Complete rolesets only: an incomplete one contributes nothing.
    pub rolesets: Vec<Roleset>,
    /// Standard pods that run both phases (`combined: true`).
    pub combined: Vec<usize>,
    /// Model-level config: the first pod (in fleet order) whose annotation is valid.
    pub config: Option<ModelConfig>,
    /// Pods of the model in the snapshot, routable or not.
    pub total_pods: usize,
}

#[derive(Debug, Clone, Default)]
pub struct FleetView {
    pub version: u64,
    pub models: HashMap<String, ModelView>,
}

impl FleetView {
    pub fn from_snapshot(snapshot: &proto::Snapshot) -> FleetView {
        let models = snapshot
            .models
            .iter()
            .map(|m| (m.name.clone(), ModelView::build(&m.pods)))
            .collect();
        FleetView {
            version: snapshot.version,
            models,
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<FleetView, prost::DecodeError> {
        let snapshot: proto::Snapshot = prost::Message::decode(bytes)?;
        Ok(FleetView::from_snapshot(&snapshot))
    }
}

impl ModelView {
    fn build(pods: &[proto::Pod]) -> ModelView {
        let mut view = ModelView {
            total_pods: pods.len(),
            ..ModelView::default()
        };
        let mut roleset_index: HashMap<&str, usize> = HashMap::new();
        let mut groups: Vec<Roleset> = Vec::new();
        for pod in pods {
            let parsed = ModelConfig::parse(&pod.config);
            if view.config.is_none() {
                view.config = parsed.clone();
            }
            if !(pod.ready && pod.serves_http && !pod.ip.is_empty()) {
                continue;
            }
            let role = match pod.role.as_str() {
                "prefill" => Role::Prefill,
                "decode" => Role::Decode,
                _ => Role::Other,
            };
            let combined = parsed
                .as_ref()
                .and_then(|c| c.profile(None))
                .is_some_and(|p| p.routing_config.combined);
            let idx = view.pods.len();
            view.pods.push(PodView {
                key: format!("{}/{}", pod.namespace, pod.name),
                name: pod.name.clone(),
                ip: pod.ip.clone(),
                address: format!("{}:{}", pod.ip, pod.port),
                engine: if pod.engine.is_empty() {
                    "vllm".into()
                } else {
                    pod.engine.clone()
                },
                role,
                roleset: pod.roleset.clone(),
                combined,
                kv_connector: KvConnector::parse(&pod.kv_connector_type),
                metrics: pod.metrics.filter(|m| m.present),
            });
            if role == Role::Other {
                if combined {
                    view.combined.push(idx);
                }
                continue;
            }
            if pod.roleset.is_empty() {
                continue; // a PD pod outside any roleset can never be paired
            }
            let g = *roleset_index
                .entry(pod.roleset.as_str())
                .or_insert_with(|| {
                    groups.push(Roleset {
                        name: pod.roleset.clone(),
                        prefill: vec![],
                        decode: vec![],
                    });
                    groups.len() - 1
                });
            match role {
                Role::Prefill => groups[g].prefill.push(idx),
                _ => groups[g].decode.push(idx),
            }
        }
        view.rolesets = groups
            .into_iter()
            .filter(|g| !g.prefill.is_empty() && !g.decode.is_empty())
            .collect();
        view
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn pod(name: &str, role: &str, roleset: &str, ready: bool) -> proto::Pod {
        proto::Pod {
            namespace: "ns".into(),
            name: name.into(),
            ip: format!("127.0.0.{}", name.len()),
            port: 8000,
            engine: "vllm".into(),
            role: role.into(),
            roleset: roleset.into(),
            ready,
            serves_http: true,
            ..Default::default()
        }
    }

    pub fn snapshot(pods: Vec<proto::Pod>) -> proto::Snapshot {
        proto::Snapshot {
            version: 7,
            generated_unix_ms: 0,
            models: vec![proto::Model {
                name: "m".into(),
                pods,
            }],
        }
    }

    #[test]
    fn only_complete_rolesets_and_combined_pods_are_indexed() {
        let mut combined = pod("c0", "all", "", true);
        combined.config = r#"{"profiles":{"default":{"routingConfig":{"combined":true}}}}"#.into();
        let fleet = FleetView::from_snapshot(&snapshot(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g0", true),
            pod("p1", "prefill", "g1", true),
            pod("d1", "decode", "g1", false),
            pod("d2", "decode", "g2", true),
            pod("x0", "decode", "", true),
            combined,
            pod("plain", "", "", true),
        ]));
        let m = &fleet.models["m"];
        assert_eq!(fleet.version, 7);
        assert_eq!(m.total_pods, 8);
        assert_eq!(m.rolesets.len(), 1);
        assert_eq!(m.rolesets[0].name, "g0");
        assert_eq!(m.pods[m.rolesets[0].prefill[0]].key, "ns/p0");
        assert_eq!(m.combined.len(), 1);
        assert_eq!(m.pods[m.combined[0]].name, "c0");
        assert_eq!(m.pods[m.combined[0]].address, "127.0.0.2:8000");
        assert!(
            m.config.is_some(),
            "model config comes from the first valid annotation"
        );
    }
}
