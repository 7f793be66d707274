//! Fleet file parsing: Kubernetes Pod objects in YAML, turned into the records the router uses.
//!
//! The file holds exactly what `kubectl get pods -o yaml` prints (a `v1` `List` or `PodList`),
//! or a multi-document stream of `Pod`s. Parsing goes through the `k8s-openapi` Pod type so the
//! Kubernetes watcher and the fleet file share one Pod → [`PodRecord`] path ([`PodRecord::from_pod`]).

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;

/// Label (or annotation) naming the model a pod serves.
pub const LABEL_MODEL: &str = "model.aibrix.ai/name";
/// Serving port label; default [`DEFAULT_PORT`].
pub const LABEL_PORT: &str = "model.aibrix.ai/port";
/// Metrics port label. AIBrix defaults it to 8000 whatever the serving port; we default it to
/// the serving port, which is where vLLM, SGLang and TRT-LLM actually serve `/metrics`.
pub const LABEL_METRIC_PORT: &str = "model.aibrix.ai/metric-port";
/// Engine label: `vllm` (default), `sglang`, `trtllm`.
pub const LABEL_ENGINE: &str = "model.aibrix.ai/engine";
pub const LABEL_ROLE: &str = "role-name";
pub const LABEL_ROLESET: &str = "roleset-name";
pub const LABEL_ROLE_REPLICA_INDEX: &str = "role-replica-index";
pub const LABEL_KV_CONNECTOR: &str = "model.aibrix.ai/kv-connector-type";
pub const LABEL_POD_GROUP_INDEX: &str = "stormservice.orchestration.aibrix.ai/pod-group-index";
pub const LABEL_RAY_NODE_TYPE: &str = "ray.io/node-type";
pub const ANNOTATION_CONFIG: &str = "model.aibrix.ai/config";
pub const ANNOTATION_SGLANG_BOOTSTRAP_PORT: &str = "model.aibrix.ai/sglang-bootstrap-port";

pub const DEFAULT_PORT: u16 = 8000;
pub const DEFAULT_ENGINE: &str = "vllm";
pub const DEFAULT_SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// Why a fleet file could not be used. The previous fleet stays in force when this happens.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("cannot read fleet file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("fleet YAML document {index} is invalid: {source}")]
    Yaml {
        index: usize,
        source: serde_yaml::Error,
    },
    #[error("fleet YAML document {index} has kind {kind:?}; expected Pod, PodList or List")]
    Kind { index: usize, kind: String },
    #[error(
        "fleet YAML document {index} has items but no kind: a List cut off before its \
         `kind` line (`kubectl get -o yaml` writes it after the items)"
    )]
    ListWithoutKind { index: usize },
}

/// One model-serving pod, as the router sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRecord {
    pub model: String,
    pub namespace: String,
    pub name: String,
    /// `status.podIP`; empty when the pod has none yet.
    pub ip: String,
    pub port: u16,
    pub metric_port: u16,
    pub engine: String,
    pub role: String,
    pub roleset: String,
    pub role_replica_index: String,
    pub kv_connector_type: String,
    /// Raw `model.aibrix.ai/config` annotation, parsed by the filter.
    pub config: String,
    pub sglang_bootstrap_port: u16,
    /// Ready condition true (or absent), an IP, no deletion timestamp, and not ended (phase
    /// `Failed` or `Succeeded`).
    pub ready: bool,
    /// False for non-leader members of a multi-node pod group.
    pub serves_http: bool,
    /// Every label, for the `external-filter` header's selector in the filter.
    pub labels: BTreeMap<String, String>,
    /// When the Ready condition last turned true, Unix ms; 0 when the pod is not ready or
    /// the condition carries no time. The filter eases a newly ready pod in
    /// (`least-request-top-k`); the API server's time survives a pd-control restart, which a
    /// first-seen time would not.
    pub ready_since_unix_ms: i64,
    /// LoRA adapters this pod serves besides its model (AIBrix `ModelAdapter`s listing it in
    /// `status.instances`), sorted: requests naming one route to the pods that serve it.
    pub adapters: Vec<String>,
}

impl PodRecord {
    /// A ready vLLM pod `ns/NAME` of model `m` at `IP:8000` with nothing else set, for tests
    /// (here and in pd-sim) to adjust.
    #[doc(hidden)]
    pub fn sample(name: &str, ip: &str) -> PodRecord {
        PodRecord {
            model: "m".into(),
            namespace: "ns".into(),
            name: name.into(),
            ip: ip.into(),
            port: 8000,
            metric_port: 8000,
            engine: "vllm".into(),
            role: String::new(),
            roleset: String::new(),
            role_replica_index: String::new(),
            kv_connector_type: String::new(),
            config: String::new(),
            sglang_bootstrap_port: 8998,
            ready: true,
            serves_http: true,
            labels: Default::default(),
            ready_since_unix_ms: 0,
            adapters: Vec::new(),
        }
    }

    /// The `namespace/name` key under which the router tracks a pod.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// `ip:port` of the serving endpoint, an IPv6 address in brackets.
    pub fn address(&self) -> String {
        host_port(&self.ip, self.port)
    }

    /// `ip:port` of the metrics endpoint, an IPv6 address in brackets.
    pub fn metrics_address(&self) -> String {
        host_port(&self.ip, self.metric_port)
    }

    /// Maps a Kubernetes Pod to a record, or `None` when the pod serves no model
    /// (no `model.aibrix.ai/name` label or annotation), is a Ray worker, or has ended.
    pub fn from_pod(pod: &Pod) -> Option<PodRecord> {
        let empty = BTreeMap::new();
        let meta = &pod.metadata;
        let labels = meta.labels.as_ref().unwrap_or(&empty);
        let annotations = meta.annotations.as_ref().unwrap_or(&empty);
        let model = labels
            .get(LABEL_MODEL)
            .or_else(|| annotations.get(LABEL_MODEL))
            .map(|m| m.trim().to_string())
            .filter(|m| !m.is_empty())?;
        if labels.get(LABEL_RAY_NODE_TYPE).map(String::as_str) == Some("worker") {
            return None;
        }
        let status = pod.status.as_ref();
        // A pod whose containers all ended (`Failed`, `Succeeded`: evicted, OOM-killed with
        // `restartPolicy: Never`) never serves again, whatever its last Ready condition says,
        // yet stays in the API until the pod garbage collector's threshold (12 500 ended pods
        // by default). Kept as a not-ready member, an evicted pod of an old ReplicaSet still
        // set its model's configuration (the first pod whose annotation parses, in name
        // order) long after the rollout: it is no member at all.
        if status
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|phase| matches!(phase, "Failed" | "Succeeded"))
        {
            return None;
        }
        let ip = status
            .and_then(|s| s.pod_ip.clone())
            .unwrap_or_default()
            .trim()
            .to_string();
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .and_then(|conds| conds.iter().find(|c| c.type_ == "Ready"));
        let ready_condition = ready.is_none_or(|c| c.status == "True");
        let terminating = meta.deletion_timestamp.is_some();
        let label = |key: &str| {
            labels
                .get(key)
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        let port = parse_port(labels.get(LABEL_PORT)).unwrap_or(DEFAULT_PORT);
        Some(PodRecord {
            model,
            namespace: meta.namespace.clone().unwrap_or_else(|| "default".into()),
            name: meta.name.clone().unwrap_or_default(),
            port,
            metric_port: parse_port(labels.get(LABEL_METRIC_PORT)).unwrap_or(port),
            engine: labels
                .get(LABEL_ENGINE)
                .or_else(|| annotations.get(LABEL_ENGINE))
                .map(|e| e.trim().to_ascii_lowercase())
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| DEFAULT_ENGINE.into()),
            role: label(LABEL_ROLE),
            roleset: label(LABEL_ROLESET),
            role_replica_index: label(LABEL_ROLE_REPLICA_INDEX),
            kv_connector_type: label(LABEL_KV_CONNECTOR).to_ascii_lowercase(),
            config: annotations
                .get(ANNOTATION_CONFIG)
                .cloned()
                .unwrap_or_default(),
            sglang_bootstrap_port: parse_port(annotations.get(ANNOTATION_SGLANG_BOOTSTRAP_PORT))
                .unwrap_or(DEFAULT_SGLANG_BOOTSTRAP_PORT),
            serves_http: labels
                .get(LABEL_POD_GROUP_INDEX)
                .is_none_or(|idx| idx == "0"),
            ready: ready_condition && !ip.is_empty() && !terminating,
            ready_since_unix_ms: ready
                .filter(|c| c.status == "True")
                .and_then(|c| c.last_transition_time.as_ref())
                .map_or(0, |t| t.0.as_millisecond()),
            ip,
            labels: labels.clone(),
            adapters: Vec::new(),
        })
    }
}

/// `ip:port`, with an IPv6 address in brackets (`[fd00::7]:8000`), the only form a socket
/// address or an HTTP authority takes.
pub fn host_port(ip: &str, port: u16) -> String {
    if ip.contains(':') && !ip.starts_with('[') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

fn parse_port(value: Option<&String>) -> Option<u16> {
    value
        .and_then(|v| v.trim().parse::<u16>().ok())
        .filter(|p| *p != 0)
}

#[derive(Deserialize)]
struct KindProbe {
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    items: Vec<serde_yaml::Value>,
}

/// A LoRA adapter as AIBrix's `ModelAdapter` (`model.aibrix.ai/v1alpha1`) declares it: the
/// adapter's name is the model name requests use, and `status.instances` names the pods of
/// its namespace that have it loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterRecord {
    pub namespace: String,
    pub name: String,
    pub instances: Vec<String>,
}

impl AdapterRecord {
    /// Reads a `ModelAdapter` object; `None` without a name.
    pub fn from_value(value: &serde_yaml::Value) -> Option<AdapterRecord> {
        let meta = &value["metadata"];
        let name = meta["name"].as_str()?.trim();
        if name.is_empty() {
            return None;
        }
        let instances = value["status"]["instances"]
            .as_sequence()
            .map(|seq| {
                seq.iter()
                    .filter_map(|v| v.as_str())
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        Some(AdapterRecord {
            namespace: meta["namespace"]
                .as_str()
                .map(str::trim)
                .filter(|ns| !ns.is_empty())
                .unwrap_or("default")
                .to_string(),
            name: name.to_string(),
            instances,
        })
    }
}

/// The kind of a LoRA adapter object.
pub const KIND_MODEL_ADAPTER: &str = "ModelAdapter";

/// Parses fleet YAML into Kubernetes Pods and AIBrix `ModelAdapter`s, in file order: Pod
/// documents, `List`/`PodList` documents of Pods, and `ModelAdapter` documents or items.
pub fn parse_objects(text: &str) -> Result<(Vec<Pod>, Vec<AdapterRecord>), FleetError> {
    parse_documents(text).map(|(pods, adapters, _)| (pods, adapters))
}

/// [`parse_objects`], with how many documents held anything (not empty, not `null`).
fn parse_documents(text: &str) -> Result<(Vec<Pod>, Vec<AdapterRecord>, usize), FleetError> {
    let mut documents = 0;
    let mut pods = Vec::new();
    let mut adapters = Vec::new();
    let is_adapter = |v: &serde_yaml::Value| v["kind"].as_str() == Some(KIND_MODEL_ADAPTER);
    for (index, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = serde_yaml::Value::deserialize(doc)
            .map_err(|source| FleetError::Yaml { index, source })?;
        if value.is_null() {
            continue; // an empty document, e.g. a trailing `---`
        }
        documents += 1;
        let probe: KindProbe = serde_yaml::from_value(value.clone())
            .map_err(|source| FleetError::Yaml { index, source })?;
        // `kubectl get pods -o yaml` writes `kind: List` after `items`: a file cut (or caught
        // half-written) anywhere in the items reads as a kind-less document, which as a Pod
        // would be no pod at all, and the fleet would lose every pod it had.
        if probe.kind.is_none() && value.get("items").is_some() {
            return Err(FleetError::ListWithoutKind { index });
        }
        match probe.kind.as_deref() {
            Some("Pod") | None => pods.push(
                serde_yaml::from_value(value)
                    .map_err(|source| FleetError::Yaml { index, source })?,
            ),
            Some(KIND_MODEL_ADAPTER) => adapters.extend(AdapterRecord::from_value(&value)),
            Some("List") | Some("PodList") => {
                for item in probe.items {
                    if is_adapter(&item) {
                        adapters.extend(AdapterRecord::from_value(&item));
                        continue;
                    }
                    pods.push(
                        serde_yaml::from_value(item)
                            .map_err(|source| FleetError::Yaml { index, source })?,
                    );
                }
            }
            Some(other) => {
                return Err(FleetError::Kind {
                    index,
                    kind: other.to_string(),
                })
            }
        }
    }
    Ok((pods, adapters, documents))
}

/// Parses fleet YAML into Kubernetes Pods, in file order (adapters left out).
pub fn parse_pods(text: &str) -> Result<Vec<Pod>, FleetError> {
    parse_objects(text).map(|(pods, _)| pods)
}

/// Records on each pod the adapters whose `status.instances` name it (same namespace), as
/// AIBrix maps an adapter to the pods of its status. An adapter named like the pod's own
/// model adds nothing.
pub fn assign_adapters(records: &mut [PodRecord], adapters: &[AdapterRecord]) {
    for record in records.iter_mut() {
        let mut names: Vec<String> = adapters
            .iter()
            .filter(|a| a.namespace == record.namespace && a.name != record.model)
            .filter(|a| a.instances.contains(&record.name))
            .map(|a| a.name.clone())
            .collect();
        names.sort();
        names.dedup();
        record.adapters = names;
    }
}

/// Parses fleet YAML straight into model-serving pod records, adapters assigned.
pub fn parse_records(text: &str) -> Result<Vec<PodRecord>, FleetError> {
    let (pods, adapters) = parse_objects(text)?;
    Ok(records_of(&pods, &adapters))
}

/// The model-serving pods among `pods`, adapters assigned.
fn records_of(pods: &[Pod], adapters: &[AdapterRecord]) -> Vec<PodRecord> {
    let mut records: Vec<PodRecord> = pods.iter().filter_map(PodRecord::from_pod).collect();
    assign_adapters(&mut records, adapters);
    records
}

/// [`parse_records`] for a fleet source, which must tell "no pods" from "nothing written":
/// `None` when the text holds no document at all (empty, whitespace, comments, bare `---`),
/// which is what a file truncated for rewriting (`cmd > fleet.yaml`) reads as. A fleet with
/// no pods is still a document (`kind: List` with `items: []`).
pub fn parse_written_records(text: &str) -> Result<Option<Vec<PodRecord>>, FleetError> {
    let (pods, adapters, documents) = parse_documents(text)?;
    Ok((documents > 0).then(|| records_of(&pods, &adapters)))
}

/// Reads and parses a fleet file.
pub fn load(path: &Path) -> Result<Vec<PodRecord>, FleetError> {
    let text = std::fs::read_to_string(path).map_err(|source| FleetError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_records(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIST: &str = r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Pod
  metadata:
    name: p0
    namespace: ns
    labels:
      model.aibrix.ai/name: m
      model.aibrix.ai/port: "8100"
      role-name: prefill
      roleset-name: g0
  status:
    podIP: 127.0.0.2
    conditions:
    - type: Ready
      status: "True"
      lastTransitionTime: "2026-12-01T10:00:00Z"
- apiVersion: v1
  kind: Pod
  metadata:
    name: d0
    labels:
      model.aibrix.ai/name: m
      role-name: decode
      roleset-name: g0
      model.aibrix.ai/engine: SGLang
  status:
    podIP: 127.0.0.3
    conditions:
    - type: Ready
      status: "False"
      lastTransitionTime: "2026-12-01T10:00:00Z"
- apiVersion: v1
  kind: Pod
  metadata:
    name: unrelated
  status:
    podIP: 127.0.0.4
"#;

    #[test]
    fn list_is_parsed_with_defaults() {
        let pods = parse_records(LIST).unwrap();
        assert_eq!(pods.len(), 2, "the pod without a model label is dropped");
        let p = &pods[0];
        assert_eq!(
            (p.key().as_str(), p.port, p.metric_port),
            ("ns/p0", 8100, 8100)
        );
        assert_eq!(
            (p.engine.as_str(), p.role.as_str(), p.roleset.as_str()),
            ("vllm", "prefill", "g0")
        );
        assert!(p.ready && p.serves_http);
        let d = &pods[1];
        assert_eq!(
            (d.namespace.as_str(), d.port, d.engine.as_str()),
            ("default", 8000, "sglang")
        );
        assert!(!d.ready, "Ready=False is not ready");
        assert_eq!(
            p.ready_since_unix_ms, 1_796_119_200_000,
            "Ready's lastTransitionTime"
        );
        assert_eq!(
            d.ready_since_unix_ms, 0,
            "a pod not ready has no ready time"
        );
    }

    #[test]
    fn model_adapters_name_the_pods_of_their_namespace_that_serve_them() {
        let text = r#"
apiVersion: v1
kind: List
items:
- kind: Pod
  metadata: {name: p0, namespace: ns, labels: {model.aibrix.ai/name: base}}
  status: {podIP: 127.0.0.2}
- kind: Pod
  metadata: {name: p1, namespace: ns, labels: {model.aibrix.ai/name: base}}
  status: {podIP: 127.0.0.3}
- apiVersion: model.aibrix.ai/v1alpha1
  kind: ModelAdapter
  metadata: {name: sql-lora, namespace: ns}
  status: {instances: [p1, gone]}
---
apiVersion: model.aibrix.ai/v1alpha1
kind: ModelAdapter
metadata: {name: chat-lora, namespace: ns}
status: {instances: [p1, p0]}
---
kind: ModelAdapter
metadata: {name: elsewhere, namespace: other}
status: {instances: [p0]}
---
kind: ModelAdapter
metadata: {name: base, namespace: ns}
status: {instances: [p0]}
---
kind: ModelAdapter
metadata: {name: pending, namespace: ns}
"#;
        let pods = parse_records(text).unwrap();
        let adapters: Vec<(&str, Vec<&str>)> = pods
            .iter()
            .map(|p| {
                let names = p.adapters.iter().map(String::as_str).collect();
                (p.name.as_str(), names)
            })
            .collect();
        assert_eq!(
            adapters,
            [
                ("p0", vec!["chat-lora"]),
                ("p1", vec!["chat-lora", "sql-lora"])
            ],
            "another namespace's adapter, one named like the model and one without \
             instances add nothing"
        );
        let (_, all) = parse_objects(text).unwrap();
        assert_eq!(all.len(), 5);
        assert_eq!(all[4].instances, Vec::<String>::new());
    }

    #[test]
    fn multi_document_stream_and_missing_conditions() {
        let text = "kind: Pod\nmetadata:\n  name: a\n  labels: {model.aibrix.ai/name: m}\nstatus: {podIP: 127.0.0.9}\n---\nkind: Pod\nmetadata:\n  name: b\n  labels: {model.aibrix.ai/name: m}\n---\n";
        let pods = parse_records(text).unwrap();
        assert_eq!(pods.len(), 2);
        assert!(pods[0].ready, "absent conditions count as ready");
        assert_eq!(pods[0].ready_since_unix_ms, 0, "with no time to read");
        assert!(!pods[1].ready, "a pod without an IP is not ready");
    }

    #[test]
    fn ipv6_pod_addresses_are_bracketed() {
        let text = "kind: Pod\nmetadata:\n  name: a\n  labels: {model.aibrix.ai/name: m, model.aibrix.ai/metric-port: \"9100\"}\nstatus: {podIP: \"fd00::7\"}\n";
        let p = &parse_records(text).unwrap()[0];
        assert_eq!(p.ip, "fd00::7");
        assert_eq!(p.address(), "[fd00::7]:8000");
        assert_eq!(p.metrics_address(), "[fd00::7]:9100");
        assert_eq!(host_port("10.0.0.1", 80), "10.0.0.1:80");
    }

    #[test]
    fn text_without_a_document_is_not_a_fleet_but_an_empty_list_is() {
        for nothing in ["", "  \n \n", "# being regenerated\n", "---\n---\n", "~\n"] {
            assert_eq!(parse_written_records(nothing).unwrap(), None, "{nothing:?}");
            assert_eq!(parse_records(nothing).unwrap(), [], "{nothing:?}");
        }
        let none = parse_written_records("apiVersion: v1\nkind: List\nitems: []\n").unwrap();
        assert_eq!(none, Some(Vec::new()));
        let unrelated = "kind: Pod\nmetadata: {name: x}\n";
        assert_eq!(parse_written_records(unrelated).unwrap(), Some(Vec::new()));
    }

    /// `kubectl get pods -o yaml > fleet.yaml` caught (or cut) before its trailing `kind: List`
    /// line: every prefix of the file that ends inside the items is refused, not read as a
    /// fleet without pods; the whole file reads as its pods.
    #[test]
    fn a_kubectl_list_cut_before_its_kind_is_refused() {
        let whole = "apiVersion: v1\nitems:\n- apiVersion: v1\n  kind: Pod\n  metadata:\n    name: a\n    labels: {model.aibrix.ai/name: m}\n  status: {podIP: 10.0.0.1}\n- apiVersion: v1\n  kind: Pod\n  metadata:\n    name: b\n    labels: {model.aibrix.ai/name: m}\n  status: {podIP: 10.0.0.2}\nkind: List\nmetadata:\n  resourceVersion: \"\"\n";
        assert_eq!(
            parse_written_records(whole).unwrap().map(|p| p.len()),
            Some(2)
        );
        let kind_at = whole.find("kind: List").unwrap();
        for cut in (whole.find("items:").unwrap() + 7)..kind_at {
            if !whole.is_char_boundary(cut) || !whole[..cut].ends_with('\n') {
                continue;
            }
            let text = &whole[..cut];
            assert!(
                matches!(
                    parse_written_records(text),
                    Err(FleetError::ListWithoutKind { index: 0 })
                ),
                "{text:?} read as {:?}",
                parse_written_records(text)
            );
        }
    }

    #[test]
    fn a_pod_whose_containers_ended_is_no_member_of_the_fleet() {
        let pod = |phase: &str| {
            format!("kind: Pod\nmetadata:\n  name: a\n  labels: {{model.aibrix.ai/name: m}}\nstatus: {{podIP: 10.0.0.1, phase: {phase}}}\n")
        };
        let p = &parse_records(&pod("Running")).unwrap()[0];
        assert!(p.ready);
        for phase in ["Failed", "Succeeded"] {
            assert_eq!(parse_records(&pod(phase)).unwrap(), vec![], "{phase}");
        }
    }

    #[test]
    fn pod_group_followers_do_not_serve_http_and_bad_kind_is_rejected() {
        let text = "kind: Pod\nmetadata:\n  name: a\n  labels: {model.aibrix.ai/name: m, stormservice.orchestration.aibrix.ai/pod-group-index: \"1\"}\n";
        assert!(!parse_records(text).unwrap()[0].serves_http);
        assert!(matches!(
            parse_records("kind: Service\n"),
            Err(FleetError::Kind { .. })
        ));
        assert!(matches!(
            parse_records("kind: [\n"),
            Err(FleetError::Yaml { .. })
        ));
    }
}
