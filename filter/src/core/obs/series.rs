//! Per-pod metric series, bounded by the number of pods that ever had one.
//!
//! Envoy cannot delete a stat: a series defined for a pod stays in its store (and in every
//! Prometheus scrape) for the life of the process, whatever the filter does with its id. A
//! bound on the pods that are in the fleet at one time therefore bounds nothing under churn
//! (every rollout brings new pod names); the bound must be on the pods ever given series.
//! A pod that leaves keeps its entry, marked departed, so that it gets the same series back
//! if it returns (a readiness flap) instead of having them defined again.

use hashbrown::HashMap;

/// Pods given per-pod series over a VM's life, per kind of series: past it, a pod's
/// selections count under `pod="_other"` and it has no ledger gauges.
pub const MAX_POD_SERIES: usize = 4096;

/// The series of one pod and whether the pod is in the fleet.
struct Entry<T> {
    series: T,
    live: bool,
}

/// Series per pod key (`namespace/name`), for at most `cap` keys over the VM's life.
pub struct SeriesBook<T> {
    cap: usize,
    entries: HashMap<String, Entry<T>>,
}

impl<T> Default for SeriesBook<T> {
    fn default() -> Self {
        SeriesBook::new(MAX_POD_SERIES)
    }
}

impl<T> SeriesBook<T> {
    pub fn new(cap: usize) -> SeriesBook<T> {
        SeriesBook {
            cap,
            entries: HashMap::new(),
        }
    }

    /// The series of `key`, defined by `define` on its first use; `None` for a key that has
    /// none once `cap` keys have had series.
    pub fn series(&mut self, key: &str, define: impl FnOnce() -> T) -> Option<&mut T> {
        if !self.entries.contains_key(key) {
            if self.entries.len() >= self.cap {
                return None;
            }
            let entry = Entry {
                series: define(),
                live: true,
            };
            self.entries.insert(key.to_string(), entry);
        }
        let entry = self.entries.get_mut(key)?;
        entry.live = true;
        Some(&mut entry.series)
    }

    /// Whether `key` could be given series now (it has them, or there is room).
    pub fn admits(&self, key: &str) -> bool {
        self.entries.len() < self.cap || self.entries.contains_key(key)
    }

    /// Whether `key` has series.
    pub fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    /// Marks the pods `live` rejects as departed, handing the series of each one that was
    /// live to `retire` (to zero its gauges), once per departure.
    pub fn retire(&mut self, live: impl Fn(&str) -> bool, mut retire: impl FnMut(&T)) {
        for (key, entry) in self.entries.iter_mut() {
            if entry.live && !live(key) {
                entry.live = false;
                retire(&entry.series);
            }
        }
    }

    /// The series of the pods in the fleet.
    pub fn live_mut(&mut self) -> impl Iterator<Item = (&str, &mut T)> {
        self.entries
            .iter_mut()
            .filter(|(_, e)| e.live)
            .map(|(k, e)| (k.as_str(), &mut e.series))
    }

    /// Whether any pod in the fleet has series.
    pub fn has_live(&self) -> bool {
        self.entries.values().any(|e| e.live)
    }

    /// Pods that ever had series.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rollouts bring new pod names, never more than 50 in the fleet at once: the book defines
    /// series for `cap` pods in all, not `cap` at a time, and a returning pod gets its own
    /// series back without a new definition.
    #[test]
    fn churn_is_bounded_by_pods_ever_seen() {
        let mut book = SeriesBook::new(100);
        let mut defined = 0;
        let mut refused = 0;
        for generation in 0..40 {
            let fleet: Vec<String> = (0..50)
                .map(|i| format!("ns/pod-{generation}-{i}"))
                .collect();
            for key in &fleet {
                match book.series(key, || {
                    defined += 1;
                    defined
                }) {
                    Some(_) => {}
                    None => refused += 1,
                }
            }
            book.retire(|k| fleet.iter().any(|f| f == k), |_| {});
        }
        assert_eq!(defined, 100);
        assert_eq!(book.len(), 100);
        assert_eq!(refused, 40 * 50 - 100);
        assert!(
            !book.has_live(),
            "the last fleet had no series left to give"
        );

        // A pod of the first generation returns: its series, not a new one.
        let mut again = 0;
        let id = *book
            .series("ns/pod-0-7", || {
                again += 1;
                0
            })
            .expect("a pod that had series keeps them");
        assert_eq!((id, again), (8, 0));
        assert!(book.has_live());
        assert!(!book.admits("ns/new"));
        assert!(book.admits("ns/pod-1-3"));
    }

    #[test]
    fn a_departure_is_retired_once_and_live_series_are_listed() {
        let mut book = SeriesBook::new(10);
        for key in ["a/x", "a/y"] {
            book.series(key, || key.len());
        }
        let mut retired = 0;
        book.retire(|k| k == "a/x", |_| retired += 1);
        book.retire(|k| k == "a/x", |_| retired += 1);
        assert_eq!(retired, 1);
        let live: Vec<&str> = book.live_mut().map(|(k, _)| k).collect();
        assert_eq!(live, ["a/x"]);
        book.series("a/y", || 0);
        assert_eq!(book.live_mut().count(), 2);
    }
}
