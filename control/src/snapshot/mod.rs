//! The versioned snapshot the filter fetches.
//!
//! Filters poll with the version they hold and decode only when it changes, so a version must
//! name exactly one byte string: it moves only when the content does, and the bytes of a version
//! are built once and shared by every response.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;

use crate::fleet::PodRecord;
use crate::proto;
use crate::scrape::Observed;

/// A built snapshot: the message (for counts) and its encoding.
#[derive(Debug)]
pub struct Published {
    pub version: u64,
    pub snapshot: Arc<proto::Snapshot>,
    pub bytes: Bytes,
}

/// What one [`SnapshotBuilder::update`] produced.
pub struct Update {
    /// The version to serve (the previous one when nothing but scrape times moved).
    pub published: Arc<Published>,
    /// Whether `published` is a new version.
    pub changed: bool,
    /// `published`'s version and build time with the metrics as of this update, scrape times
    /// included: the JSON view for people, which must show that a pod is being scraped even
    /// while its figures (and so the version) stand still.
    pub live: Arc<proto::Snapshot>,
}

impl Published {
    /// `(ready, not_ready)` pod counts across models.
    pub fn pod_counts(&self) -> (usize, usize) {
        let pods = self.snapshot.models.iter().flat_map(|m| &m.pods);
        pods.fold((0, 0), |(ready, not), p| {
            if p.ready {
                (ready + 1, not)
            } else {
                (ready, not + 1)
            }
        })
    }
}

pub fn pod_to_proto(pod: &PodRecord, observed: Observed) -> proto::Pod {
    proto::Pod {
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        ip: pod.ip.clone(),
        port: pod.port.into(),
        engine: pod.engine.clone(),
        role: pod.role.clone(),
        roleset: pod.roleset.clone(),
        ready: pod.ready,
        config: pod.config.clone(),
        sglang_bootstrap_port: pod.sglang_bootstrap_port.into(),
        kv_connector_type: pod.kv_connector_type.clone(),
        role_replica_index: pod.role_replica_index.clone(),
        serves_http: pod.serves_http,
        metrics: Some(observed.metrics),
        ready_since_unix_ms: pod.ready_since_unix_ms,
        unreachable: observed.unreachable,
        stalled: observed.stalled,
    }
}

/// Which pod labels a snapshot carries (`--pod-labels`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LabelPolicy {
    #[default]
    All,
    /// Only these keys; none when empty.
    Keys(std::collections::BTreeSet<String>),
}

impl LabelPolicy {
    /// `all`, `none`, or `key,key,...`.
    pub fn parse(text: &str) -> Result<LabelPolicy, String> {
        match text.trim() {
            "all" => Ok(LabelPolicy::All),
            "none" => Ok(LabelPolicy::Keys(Default::default())),
            keys => {
                let keys: std::collections::BTreeSet<String> = keys
                    .split(',')
                    .map(|k| k.trim().to_string())
                    .filter(|k| !k.is_empty())
                    .collect();
                if keys.is_empty() {
                    return Err("want all, none or a comma-separated list of label keys".into());
                }
                Ok(LabelPolicy::Keys(keys))
            }
        }
    }

    fn keeps(&self, key: &str) -> bool {
        match self {
            LabelPolicy::All => true,
            LabelPolicy::Keys(keys) => keys.contains(key),
        }
    }
}

/// A pod's labels as the snapshot carries them, sorted by key (the map's order).
fn labels_to_proto(pod: &PodRecord, policy: &LabelPolicy) -> proto::PodLabels {
    proto::PodLabels {
        labels: pod
            .labels
            .iter()
            .filter(|(key, _)| policy.keeps(key))
            .map(|(key, value)| proto::Label {
                key: key.clone(),
                value: value.clone(),
            })
            .collect(),
    }
}

/// Groups the fleet by model, models sorted by name so the encoding does not depend on hash or
/// file order, pods in fleet order because the filter takes the first valid config in that order.
pub fn models(
    fleet: &[PodRecord],
    labels: &LabelPolicy,
    mut observe: impl FnMut(&PodRecord) -> Observed,
) -> Vec<proto::Model> {
    let mut by_model: BTreeMap<&str, (Vec<proto::Pod>, Vec<proto::PodLabels>)> = BTreeMap::new();
    for pod in fleet {
        let proto_pod = pod_to_proto(pod, observe(pod));
        let label_set = labels_to_proto(pod, labels);
        // A LoRA adapter is a model of its own, served by the pods that loaded it: the same
        // pods (same keys, so the same load counters) under the adapter's name.
        for adapter in &pod.adapters {
            let (pods, sets) = by_model.entry(adapter.as_str()).or_default();
            pods.push(proto_pod.clone());
            sets.push(label_set.clone());
        }
        let (pods, sets) = by_model.entry(pod.model.as_str()).or_default();
        pods.push(proto_pod);
        sets.push(label_set);
    }
    by_model
        .into_iter()
        .map(|(name, (pods, labels))| proto::Model {
            name: name.to_string(),
            pods,
            labels: Some(proto::PodLabelSets { pods: labels }),
        })
        .collect()
}

/// Assigns versions and keeps the bytes of the current one.
#[derive(Default)]
pub struct SnapshotBuilder {
    /// Carried as `Snapshot.user_limits`: fixed for the life of the process.
    user_limits: bool,
    /// Carried as `Snapshot.eds`: the gateways' retrying cluster knows the pods (pd-control
    /// writes its endpoint file, or a gateway took the listing over EDS).
    eds: bool,
    /// Carried as `Snapshot.external_router`: fixed for the life of the process.
    external_router: Option<proto::ExternalRouter>,
    version: u64,
    /// Encoding of `models` without scrape timestamps: the part a version stands for.
    content: Bytes,
    current: Option<Arc<Published>>,
}

impl SnapshotBuilder {
    /// A builder whose snapshots tell the gateways whether pd-control checks user limits.
    pub fn with_user_limits(user_limits: bool) -> SnapshotBuilder {
        SnapshotBuilder {
            user_limits,
            ..SnapshotBuilder::default()
        }
    }

    /// The same builder, its snapshots telling the gateways whether pd-control writes the
    /// retrying cluster's endpoint file (`--eds-file`).
    pub fn with_eds(self, eds: bool) -> SnapshotBuilder {
        SnapshotBuilder { eds, ..self }
    }

    /// The same builder, its snapshots telling the gateways how the `external` strategy is
    /// configured (`None`: it is off).
    pub fn with_external_router(
        self,
        external_router: Option<proto::ExternalRouter>,
    ) -> SnapshotBuilder {
        SnapshotBuilder {
            external_router,
            ..self
        }
    }

    /// Changes what the next snapshots say of the retrying cluster (a new version if it
    /// differs).
    pub fn set_eds(&mut self, eds: bool) {
        self.eds = eds;
    }

    /// Offers new content; returns the snapshot to serve, whether it is a new version, and the
    /// live view.
    pub fn update(&mut self, models: Vec<proto::Model>, now_unix_ms: i64) -> Update {
        let mut snapshot = proto::Snapshot {
            version: 0,
            generated_unix_ms: 0,
            models,
            user_limits: self.user_limits,
            eds: self.eds,
            external_router: self.external_router.clone(),
        };
        // The version stands for what routing reads. Scrape timestamps move every round even
        // on an idle fleet; counting them would make every poll a full download and decode in
        // every Envoy worker, so they are left out of the comparison (staleness itself is the
        // `stale` flag, which is compared).
        let mut comparable = snapshot.clone();
        for pod in comparable.models.iter_mut().flat_map(|m| m.pods.iter_mut()) {
            if let Some(m) = pod.metrics.as_mut() {
                m.last_scrape_unix_ms = 0;
            }
        }
        let fingerprint = Bytes::from(comparable.encode_to_vec());
        if let Some(current) = self
            .current
            .as_ref()
            .filter(|_| self.content == fingerprint)
        {
            snapshot.version = current.version;
            snapshot.generated_unix_ms = current.snapshot.generated_unix_ms;
            return Update {
                published: current.clone(),
                changed: false,
                live: Arc::new(snapshot),
            };
        }
        // With version and time at their defaults, prost encodes only the fields after them
        // (models, user_limits, eds).
        let content = Bytes::from(snapshot.encode_to_vec());
        // At least the build time in ms: a restarted pd-control must serve versions above
        // those of the process before it, or every filter (which only adopts a newer version)
        // would keep the old snapshot until the new counter caught up. One version per ms at
        // most is far above the refresh rate, so the versions stay close to the clock.
        self.version = (self.version + 1).max(u64::try_from(now_unix_ms).unwrap_or(0));
        snapshot.version = self.version;
        snapshot.generated_unix_ms = now_unix_ms;
        // Protobuf fields may be concatenated, and prost writes them in tag order (version,
        // time, models, user_limits, eds), so header + content is byte-identical to encoding the
        // whole message, without encoding the models a second time. The header holds fields
        // 1 and 2 alone: anything else set in it would be encoded twice.
        let header = proto::Snapshot {
            version: snapshot.version,
            generated_unix_ms: snapshot.generated_unix_ms,
            ..proto::Snapshot::default()
        };
        let mut bytes = BytesMut::with_capacity(header.encoded_len() + content.len());
        header.encode_raw(&mut bytes);
        bytes.put_slice(&content);
        let snapshot = Arc::new(snapshot);
        let published = Arc::new(Published {
            version: self.version,
            snapshot: snapshot.clone(),
            bytes: bytes.freeze(),
        });
        self.content = fingerprint;
        self.current = Some(published.clone());
        Update {
            published,
            changed: true,
            live: snapshot,
        }
    }

    pub fn current(&self) -> Option<&Arc<Published>> {
        self.current.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, model: &str) -> PodRecord {
        PodRecord {
            model: model.into(),
            namespace: "ns".into(),
            name: name.into(),
            ip: "10.0.0.1".into(),
            port: 8100,
            metric_port: 8100,
            engine: "sglang".into(),
            role: "prefill".into(),
            roleset: "rs0".into(),
            role_replica_index: "0".into(),
            kv_connector_type: "nixl".into(),
            config: r#"{"defaultProfile":"pd"}"#.into(),
            sglang_bootstrap_port: 9000,
            ready: true,
            serves_http: false,
            labels: [("zone", "b"), ("app", "x")]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into(),
            ready_since_unix_ms: 1_700_000_000_123,
            adapters: Vec::new(),
        }
    }

    fn metrics(running: f64) -> Observed {
        Observed {
            metrics: proto::PodMetrics {
                present: true,
                running,
                ..Default::default()
            },
            unreachable: false,
            stalled: false,
        }
    }

    #[test]
    fn an_adapter_is_a_model_of_the_pods_that_loaded_it() {
        let mut a = pod("a1", "base");
        a.adapters = vec!["sql-lora".into()];
        let b = pod("b1", "base");
        let mut c = pod("c1", "base");
        c.adapters = vec!["chat-lora".into(), "sql-lora".into()];
        let models = models(&[a, b, c], &LabelPolicy::All, |_| metrics(2.0));
        let by_name: Vec<(&str, Vec<&str>)> = models
            .iter()
            .map(|m| {
                let pods = m.pods.iter().map(|p| p.name.as_str()).collect();
                (m.name.as_str(), pods)
            })
            .collect();
        assert_eq!(
            by_name,
            [
                ("base", vec!["a1", "b1", "c1"]),
                ("chat-lora", vec!["c1"]),
                ("sql-lora", vec!["a1", "c1"]),
            ]
        );
        let sql = &models[2];
        assert_eq!(sql.pods[0].metrics.as_ref().map(|m| m.running), Some(2.0));
        assert_eq!(sql.labels.as_ref().map(|l| l.pods.len()), Some(2));
    }

    #[test]
    fn every_pod_field_is_carried_and_models_are_sorted() {
        let fleet = [pod("z1", "zeta"), pod("a1", "alpha"), pod("z0", "zeta")];
        let models = models(&fleet, &LabelPolicy::All, |p| Observed {
            unreachable: p.name == "a1",
            stalled: p.name == "a1",
            ..metrics(1.0)
        });
        let names: Vec<_> = models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["alpha", "zeta"]);
        let zeta: Vec<_> = models[1].pods.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(zeta, ["z1", "z0"], "fleet order within a model");
        let p = &models[0].pods[0];
        let expected = proto::Pod {
            namespace: "ns".into(),
            name: "a1".into(),
            ip: "10.0.0.1".into(),
            port: 8100,
            engine: "sglang".into(),
            role: "prefill".into(),
            roleset: "rs0".into(),
            ready: true,
            config: r#"{"defaultProfile":"pd"}"#.into(),
            sglang_bootstrap_port: 9000,
            kv_connector_type: "nixl".into(),
            role_replica_index: "0".into(),
            serves_http: false,
            metrics: Some(metrics(1.0).metrics),
            ready_since_unix_ms: 1_700_000_000_123,
            unreachable: true,
            stalled: true,
        };
        assert_eq!(p, &expected);
        // Labels sorted by key (equal topologies encode to equal bytes), one set per pod.
        let labels = models[1].labels.as_ref().expect("labels");
        assert_eq!(labels.pods.len(), 2);
        let keys: Vec<_> = labels.pods[0]
            .labels
            .iter()
            .map(|l| l.key.as_str())
            .collect();
        assert_eq!(keys, ["app", "zone"]);
        assert_eq!(labels.pods[0].labels[1].value, "b");
    }

    #[test]
    fn pod_labels_policy_keeps_all_none_or_the_keys_named() {
        assert_eq!(LabelPolicy::parse("all"), Ok(LabelPolicy::All));
        assert!(LabelPolicy::parse(" , ").is_err());
        let carried = |policy: &str| -> Vec<String> {
            let policy = LabelPolicy::parse(policy).unwrap();
            let models = models(&[pod("a", "m")], &policy, |_| metrics(1.0));
            let sets = models[0].labels.as_ref().expect("a set per pod");
            sets.pods[0].labels.iter().map(|l| l.key.clone()).collect()
        };
        assert_eq!(carried("all"), ["app", "zone"]);
        assert!(carried("none").is_empty());
        assert_eq!(carried("zone, tier"), ["zone"]);
    }

    #[test]
    fn version_moves_only_with_content() {
        let fleet = vec![pod("a", "m"), pod("b", "m")];
        let mut builder = SnapshotBuilder::default();
        let Update {
            published: v1,
            changed: new,
            ..
        } = builder.update(models(&fleet, &LabelPolicy::All, |_| metrics(1.0)), 1_000);
        assert!(new);
        assert_eq!(
            v1.version, 1_000,
            "the first version is the build time in ms; 0 is never served"
        );

        let Update {
            published: same,
            changed: new,
            ..
        } = builder.update(models(&fleet, &LabelPolicy::All, |_| metrics(1.0)), 2_000);
        assert!(!new);
        assert_eq!(same.version, 1_000);
        assert!(
            Arc::ptr_eq(&v1, &same),
            "same content serves the same bytes"
        );
        assert_eq!(
            same.snapshot.generated_unix_ms, 1_000,
            "time alone is no change"
        );

        let rescraped = |_: &PodRecord| Observed {
            metrics: proto::PodMetrics {
                last_scrape_unix_ms: 1_950,
                ..metrics(1.0).metrics
            },
            unreachable: false,
            stalled: false,
        };
        let Update {
            published: same,
            changed: new,
            live,
        } = builder.update(models(&fleet, &LabelPolicy::All, rescraped), 2_500);
        assert!(
            !new && same.version == 1_000,
            "a new scrape time alone is no change"
        );
        assert!(Arc::ptr_eq(&v1, &same), "nor new bytes");
        let scraped = |s: &proto::Snapshot| -> Vec<i64> {
            let pods = s.models.iter().flat_map(|m| &m.pods);
            pods.map(|p| p.metrics.as_ref().map_or(0, |m| m.last_scrape_unix_ms))
                .collect()
        };
        assert_eq!(
            (live.version, live.generated_unix_ms, scraped(&live)),
            (1_000, 1_000, vec![1_950, 1_950]),
            "the live view shows the new scrape time under the served version"
        );
        assert_eq!(scraped(&same.snapshot), vec![0, 0]);

        let Update {
            published: v2,
            changed: new,
            live,
        } = builder.update(
            models(&fleet, &LabelPolicy::All, |p| {
                metrics(if p.name == "b" { 2.0 } else { 1.0 })
            }),
            3_000,
        );
        assert!(new);
        assert!(
            Arc::ptr_eq(&live, &v2.snapshot),
            "a new version is its own live view"
        );
        assert_eq!(v2.version, 3_000, "a metric change bumps (to the clock)");

        let v3 = builder
            .update(
                models(&fleet[..1], &LabelPolicy::All, |_| metrics(1.0)),
                3_000,
            )
            .published;
        assert_eq!(
            v3.version, 3_001,
            "a fleet change bumps, in the same ms too"
        );
        assert_eq!(v3.pod_counts(), (1, 0));
    }

    #[test]
    fn concatenated_encoding_equals_prost_encoding() {
        let mut builder = SnapshotBuilder::default();
        let p = builder
            .update(
                models(&[pod("a", "m")], &LabelPolicy::All, |_| metrics(3.5)),
                1_700_000_000_123,
            )
            .published;
        assert_eq!(p.bytes.as_ref(), p.snapshot.encode_to_vec().as_slice());
        let decoded = proto::Snapshot::decode(p.bytes.as_ref()).unwrap();
        assert_eq!(decoded, *p.snapshot);
        assert_eq!(
            (decoded.version, decoded.generated_unix_ms),
            (1_700_000_000_123, 1_700_000_000_123)
        );
    }

    #[test]
    fn served_bytes_carry_the_user_limits_and_eds_flags() {
        let fleet = [pod("a", "m")];
        for (user_limits, eds) in [(false, false), (true, false), (false, true), (true, true)] {
            let p = SnapshotBuilder::with_user_limits(user_limits)
                .with_eds(eds)
                .update(models(&fleet, &LabelPolicy::All, |_| metrics(1.0)), 5_000)
                .published;
            let decoded = proto::Snapshot::decode(p.bytes.as_ref()).unwrap();
            assert_eq!((decoded.user_limits, decoded.eds), (user_limits, eds));
            assert_eq!(
                decoded, *p.snapshot,
                "header + content is the whole message"
            );
            assert_eq!(p.bytes.as_ref(), p.snapshot.encode_to_vec().as_slice());
            assert_eq!((decoded.version, decoded.models.len()), (5_000, 1));
        }
        // Same models, flag on: other content, so another version's bytes.
        let off = SnapshotBuilder::default()
            .update(models(&fleet, &LabelPolicy::All, |_| metrics(1.0)), 5_000)
            .published;
        let on = SnapshotBuilder::with_user_limits(true)
            .update(models(&fleet, &LabelPolicy::All, |_| metrics(1.0)), 5_000)
            .published;
        assert_ne!(off.bytes, on.bytes);
    }

    #[test]
    fn the_flag_is_part_of_the_version_fingerprint() {
        let fleet = [pod("a", "m")];
        let mut builder = SnapshotBuilder::default();
        let first = builder
            .update(models(&fleet, &LabelPolicy::All, |_| metrics(1.0)), 5_000)
            .published;
        builder.user_limits = true;
        let update = builder.update(models(&fleet, &LabelPolicy::All, |_| metrics(1.0)), 6_000);
        assert!(update.changed, "a flag change is a content change");
        assert_eq!(update.published.version, 6_000);
        assert!(first.version < update.published.version);
        assert!(
            proto::Snapshot::decode(update.published.bytes.as_ref())
                .unwrap()
                .user_limits
        );
    }

    #[test]
    fn a_restarted_builder_serves_newer_versions_than_the_last_process() {
        let fleet = vec![pod("a", "m")];
        let mut before = SnapshotBuilder::default();
        let mut last = 0;
        for (i, now) in (10_000..10_050).enumerate() {
            last = before
                .update(
                    models(&fleet, &LabelPolicy::All, |_| metrics(i as f64)),
                    now,
                )
                .published
                .version;
        }
        let mut after = SnapshotBuilder::default();
        let first = after
            .update(models(&fleet, &LabelPolicy::All, |_| metrics(0.0)), 10_051)
            .published;
        assert!(first.version > last, "{} after {last}", first.version);
        let clock_behind = SnapshotBuilder::default()
            .update(models(&fleet, &LabelPolicy::All, |_| metrics(0.0)), -5)
            .published;
        assert_eq!(
            clock_behind.version, 1,
            "a clock before the epoch still serves 1"
        );
    }
}
