//! Names, once per annotation, what in a pod's `model.aibrix.ai/config` has no effect: one
//! that does not parse (the gateways then take it as absent, `lockedRoutingStrategy` and all),
//! `routingConfig` values they drop as invalid, score policies they do not know. The gateways
//! meet these per request and cannot say so once; AIBrix logs them as it applies a config.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use crate::fleet::PodRecord;

/// The annotations already looked at, by pod, and how many of the fleet's have problems.
#[derive(Debug, Default)]
pub struct ConfigAudit {
    /// `namespace/name` → hash of the annotation last looked at.
    seen: HashMap<String, u64>,
    flawed: HashMap<String, bool>,
    /// Hashes of the annotations whose problems were logged: a model's pods usually share
    /// one, and a rollout brings it on every new pod.
    logged: std::collections::HashSet<u64>,
}

fn hash_of(text: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

impl ConfigAudit {
    /// Looks at every annotation that is new or changed on its pod since the last call,
    /// logging the problems of an annotation not logged before (a warning per problem, naming
    /// the first pod seen with it and its model), forgets pods that left, and returns how many
    /// pods' annotations have problems now.
    pub fn check(&mut self, pods: &[PodRecord]) -> usize {
        let mut present = std::collections::HashSet::with_capacity(pods.len());
        let mut hashes = std::collections::HashSet::new();
        for pod in pods {
            let key = format!("{}/{}", pod.namespace, pod.name);
            let hash = hash_of(&pod.config);
            hashes.insert(hash);
            if self.seen.get(&key) != Some(&hash) {
                let problems = pd_router_filter::core::profile::annotation_problems(&pod.config);
                if !problems.is_empty() && self.logged.insert(hash) {
                    for problem in &problems {
                        tracing::warn!(
                            pod = %key,
                            model = %pod.model,
                            "model.aibrix.ai/config: {problem}"
                        );
                    }
                }
                self.seen.insert(key.clone(), hash);
                self.flawed.insert(key.clone(), !problems.is_empty());
            }
            present.insert(key);
        }
        self.seen.retain(|k, _| present.contains(k));
        self.flawed.retain(|k, _| present.contains(k));
        self.logged.retain(|h| hashes.contains(h));
        self.flawed.values().filter(|f| **f).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, config: &str) -> PodRecord {
        PodRecord {
            config: config.into(),
            ..PodRecord::sample(name, "10.0.0.1")
        }
    }

    #[test]
    fn flawed_annotations_are_counted_while_their_pods_stay() {
        let good = r#"{"profiles":{"default":{"routingStrategy":"pd"}}}"#;
        let bad = r#"{"profiles":{"default":{"routingConfig":{"decodeScorePolicy":"x"}}}}"#;
        let mut audit = ConfigAudit::default();
        assert_eq!(
            audit.check(&[pod("a", good), pod("b", bad), pod("c", "{")]),
            2
        );
        assert_eq!(audit.check(&[pod("a", good), pod("b", bad)]), 1, "c left");
        assert_eq!(audit.check(&[pod("a", bad), pod("b", good)]), 1, "edited");
        assert_eq!(audit.check(&[pod("a", ""), pod("b", good)]), 0);
    }

    #[test]
    fn an_annotation_is_logged_once_whatever_number_of_pods_carry_it() {
        let bad = r#"{"profiles":{"default":{"routingConfig":{"decodeScorePolicy":"x"}}}}"#;
        let mut audit = ConfigAudit::default();
        assert_eq!(audit.check(&[pod("a", bad), pod("b", bad)]), 2);
        assert_eq!(audit.logged.len(), 1);
        // A rollout: new pods with the same annotation are counted, not logged again.
        assert_eq!(audit.check(&[pod("c", bad), pod("d", bad)]), 2);
        assert_eq!(audit.logged.len(), 1);
        // Gone from the fleet, forgotten: it would be logged again if it came back.
        assert_eq!(audit.check(&[pod("c", "")]), 0);
        assert!(audit.logged.is_empty());
    }
}
