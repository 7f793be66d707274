//! The fleet as the pod watches have described it so far.
//!
//! Kept apart from the watch plumbing so the event semantics (re-list buffering, relabels,
//! deletions) are unit-testable without an API server.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube::api::DynamicObject;
use kube::runtime::watcher::Event;

use crate::fleet::{assign_adapters, AdapterRecord, PodRecord};

/// `(namespace, name)`: the sort order of the published fleet and the identity of a pod.
type Key = (String, String);

/// The state of one watch (all namespaces, or one `--namespace`).
#[derive(Debug, Default)]
struct Scope {
    /// Completed at least one list; until then the fleet would be partial.
    synced: bool,
    pods: BTreeMap<Key, PodRecord>,
    /// A re-list in progress. It replaces `pods` only once complete, so a re-list (after a
    /// `410 Gone`, or at start-up) never exposes a half-listed or empty fleet.
    relisting: Option<BTreeMap<Key, PodRecord>>,
    /// The scope's `ModelAdapter`s, re-listed the same way. Optional: pods route without
    /// them, so they never hold up [`FleetState::synced`].
    adapters: BTreeMap<Key, AdapterRecord>,
    adapters_relisting: Option<BTreeMap<Key, AdapterRecord>>,
}

/// Pod records per watch scope, fed by [`kube::runtime::watcher()`] events.
#[derive(Debug)]
pub struct FleetState {
    scopes: Vec<Scope>,
}

impl FleetState {
    pub fn new(scopes: usize) -> FleetState {
        FleetState {
            scopes: (0..scopes).map(|_| Scope::default()).collect(),
        }
    }

    /// Every scope has completed its first list, so [`FleetState::fleet`] is the whole fleet.
    pub fn synced(&self) -> bool {
        self.scopes.iter().all(|s| s.synced)
    }

    /// Folds one watcher event of scope `scope` in; returns whether the visible fleet may have
    /// changed (so the caller rebuilds and offers it to the publisher, which drops no-ops).
    pub fn apply(&mut self, scope: usize, event: Event<Pod>) -> bool {
        let Some(state) = self.scopes.get_mut(scope) else {
            return false;
        };
        match event {
            Event::Init => {
                state.relisting = Some(BTreeMap::new());
                false
            }
            Event::InitApply(pod) => {
                let target = state.relisting.as_mut().unwrap_or(&mut state.pods);
                upsert(target, &pod);
                false
            }
            Event::InitDone => {
                if let Some(listed) = state.relisting.take() {
                    state.pods = listed;
                }
                state.synced = true;
                true
            }
            // Every edit goes through `from_pod` again: readiness, IP, labels and annotations
            // all feed the record, and a pod that no longer names a model leaves the fleet.
            Event::Apply(pod) => upsert(&mut state.pods, &pod),
            Event::Delete(pod) => key(&pod).is_some_and(|k| state.pods.remove(&k).is_some()),
        }
    }

    /// Folds one `ModelAdapter` watcher event of scope `scope` in, like [`FleetState::apply`].
    pub fn apply_adapter(&mut self, scope: usize, event: Event<DynamicObject>) -> bool {
        let Some(state) = self.scopes.get_mut(scope) else {
            return false;
        };
        match event {
            Event::Init => {
                state.adapters_relisting = Some(BTreeMap::new());
                false
            }
            Event::InitApply(object) => {
                let target = state
                    .adapters_relisting
                    .as_mut()
                    .unwrap_or(&mut state.adapters);
                upsert_adapter(target, &object);
                false
            }
            Event::InitDone => {
                if let Some(listed) = state.adapters_relisting.take() {
                    state.adapters = listed;
                }
                true
            }
            Event::Apply(object) => upsert_adapter(&mut state.adapters, &object),
            Event::Delete(object) => {
                adapter_key(&object).is_some_and(|k| state.adapters.remove(&k).is_some())
            }
        }
    }

    /// Drops scope `scope`'s adapters (their watch can no longer be read); returns whether any
    /// were known.
    pub fn forget_adapters(&mut self, scope: usize) -> bool {
        let Some(state) = self.scopes.get_mut(scope) else {
            return false;
        };
        state.adapters_relisting = None;
        !std::mem::take(&mut state.adapters).is_empty()
    }

    /// The current fleet, sorted by namespace then name, each pod with the adapters that
    /// list it.
    pub fn fleet(&self) -> Vec<PodRecord> {
        let mut all: Vec<(&Key, &PodRecord)> =
            self.scopes.iter().flat_map(|s| s.pods.iter()).collect();
        all.sort_by(|a, b| a.0.cmp(b.0));
        let mut records: Vec<PodRecord> = all.into_iter().map(|(_, pod)| pod.clone()).collect();
        let adapters: Vec<AdapterRecord> = self
            .scopes
            .iter()
            .flat_map(|s| s.adapters.values().cloned())
            .collect();
        assign_adapters(&mut records, &adapters);
        records
    }
}

fn adapter_key(object: &DynamicObject) -> Option<Key> {
    let name = object.metadata.name.as_deref().filter(|n| !n.is_empty())?;
    let namespace = object.metadata.namespace.as_deref().unwrap_or("default");
    Some((namespace.to_string(), name.to_string()))
}

/// Inserts or replaces an adapter (removes one that no longer reads as an adapter); returns
/// whether the map changed.
fn upsert_adapter(adapters: &mut BTreeMap<Key, AdapterRecord>, object: &DynamicObject) -> bool {
    let Some(key) = adapter_key(object) else {
        return false;
    };
    let record = serde_yaml::to_value(object)
        .ok()
        .and_then(|value| AdapterRecord::from_value(&value));
    match record {
        Some(record) => adapters.insert(key, record.clone()).as_ref() != Some(&record),
        None => adapters.remove(&key).is_some(),
    }
}

/// Same namespace default as [`PodRecord::from_pod`], so deletions find what upserts stored.
fn key(pod: &Pod) -> Option<Key> {
    let name = pod.metadata.name.as_deref().filter(|n| !n.is_empty())?;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    Some((namespace.to_string(), name.to_string()))
}

/// Inserts, replaces or (when the pod no longer serves a model, or its containers ended)
/// removes; returns whether the map changed.
fn upsert(pods: &mut BTreeMap<Key, PodRecord>, pod: &Pod) -> bool {
    let Some(key) = key(pod) else {
        return false;
    };
    match PodRecord::from_pod(pod) {
        Some(record) => pods.insert(key, record.clone()).as_ref() != Some(&record),
        None => pods.remove(&key).is_some(),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn pod(ns: &str, name: &str, model: Option<&str>) -> Pod {
        let labels: BTreeMap<String, String> = model
            .map(|m| (crate::fleet::LABEL_MODEL.to_string(), m.to_string()))
            .into_iter()
            .collect();
        Pod {
            metadata: ObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    fn names(state: &FleetState) -> Vec<String> {
        state.fleet().iter().map(PodRecord::key).collect()
    }

    #[test]
    fn relist_replaces_atomically_and_events_edit() {
        let mut s = FleetState::new(2);
        assert!(!s.synced());
        s.apply(0, Event::Init);
        s.apply(0, Event::InitApply(pod("b", "x", Some("m"))));
        s.apply(0, Event::InitApply(pod("b", "nomodel", None)));
        assert!(s.apply(0, Event::InitDone));
        assert!(!s.synced(), "scope 1 has not listed yet");
        s.apply(1, Event::Init);
        s.apply(1, Event::InitApply(pod("a", "y", Some("m"))));
        s.apply(1, Event::InitDone);
        assert!(s.synced());
        assert_eq!(names(&s), ["a/y", "b/x"], "sorted across scopes");

        // A re-list in progress leaves the old fleet visible until it completes.
        s.apply(0, Event::Init);
        s.apply(0, Event::InitApply(pod("b", "z", Some("m"))));
        assert_eq!(names(&s), ["a/y", "b/x"]);
        s.apply(0, Event::InitDone);
        assert_eq!(names(&s), ["a/y", "b/z"]);

        assert!(s.apply(1, Event::Apply(pod("a", "y", None))), "relabel");
        assert_eq!(names(&s), ["b/z"]);
        assert!(!s.apply(1, Event::Delete(pod("a", "y", None))));
        assert!(s.apply(0, Event::Delete(pod("b", "z", Some("m")))));
        assert!(names(&s).is_empty());
        assert!(!s.apply(7, Event::InitDone), "unknown scope ignored");
    }

    fn adapter(ns: &str, name: &str, instances: &[&str]) -> DynamicObject {
        let mut object = DynamicObject::new(name, &super::super::model_adapters()).within(ns);
        object.data = serde_json::json!({"status": {"instances": instances}});
        object
    }

    fn adapters_of(state: &FleetState) -> Vec<String> {
        state
            .fleet()
            .iter()
            .map(|p| format!("{} {}", p.key(), p.adapters.join(",")))
            .collect()
    }

    #[test]
    fn adapters_follow_their_watch_without_holding_up_the_pods() {
        let mut s = FleetState::new(1);
        s.apply(0, Event::Init);
        s.apply(0, Event::InitApply(pod("ns", "p0", Some("m"))));
        s.apply(0, Event::InitApply(pod("ns", "p1", Some("m"))));
        s.apply(0, Event::InitDone);
        assert!(s.synced(), "no adapter list needed");
        assert_eq!(adapters_of(&s), ["ns/p0 ", "ns/p1 "]);
        s.apply_adapter(0, Event::Init);
        s.apply_adapter(0, Event::InitApply(adapter("ns", "sql", &["p1"])));
        assert_eq!(
            adapters_of(&s),
            ["ns/p0 ", "ns/p1 "],
            "a re-list shows when done"
        );
        assert!(s.apply_adapter(0, Event::InitDone));
        assert_eq!(adapters_of(&s), ["ns/p0 ", "ns/p1 sql"]);
        assert!(s.apply_adapter(0, Event::Apply(adapter("ns", "sql", &["p0", "p1"]))));
        assert!(s.apply_adapter(0, Event::Apply(adapter("other", "far", &["p0"]))));
        assert_eq!(adapters_of(&s), ["ns/p0 sql", "ns/p1 sql"]);
        assert!(!s.apply_adapter(0, Event::Apply(adapter("ns", "sql", &["p0", "p1"]))));
        assert!(s.apply_adapter(0, Event::Delete(adapter("ns", "sql", &[]))));
        assert_eq!(adapters_of(&s), ["ns/p0 ", "ns/p1 "]);
    }
}
