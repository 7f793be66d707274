//! `/abort_request`: the in-flight requests of one pod by their `rid`, so an abort can end
//! them (SGLang drops the request from its scheduler and the stream ends).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

/// Registrations by rid: (registration id, its signal).
type Table = Arc<Mutex<HashMap<String, Vec<(u64, watch::Sender<bool>)>>>>;

/// A pod's in-flight requests that carry a `rid`.
#[derive(Debug, Default)]
pub struct Aborts {
    by_rid: Table,
    next: Mutex<u64>,
}

/// A request's registration; leaving (drop) removes it.
#[derive(Debug)]
pub struct AbortHandle {
    rid: String,
    id: u64,
    signal: watch::Receiver<bool>,
    table: Table,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Aborts {
    pub fn register(&self, rid: &str) -> AbortHandle {
        self.register_in(&mut lock(&self.by_rid), rid)
    }

    fn register_in(
        &self,
        table: &mut HashMap<String, Vec<(u64, watch::Sender<bool>)>>,
        rid: &str,
    ) -> AbortHandle {
        let id = {
            let mut next = lock(&self.next);
            *next += 1;
            *next
        };
        let (tx, rx) = watch::channel(false);
        table.entry(rid.to_string()).or_default().push((id, tx));
        AbortHandle {
            rid: rid.to_string(),
            id,
            signal: rx,
            table: self.by_rid.clone(),
        }
    }

    /// Registers `id` unless a request of that id is in flight already (`None`): a vLLM
    /// engine keys its requests by id and refuses a second one while the first runs.
    pub fn register_unique(&self, id: &str) -> Option<AbortHandle> {
        // Checked and taken under one lock: two requests of one id at once get one slot.
        let mut table = lock(&self.by_rid);
        if table.contains_key(id) {
            return None;
        }
        Some(self.register_in(&mut table, id))
    }

    /// Signals every in-flight request with `rid`; returns how many there were.
    pub fn abort(&self, rid: &str) -> usize {
        let table = lock(&self.by_rid);
        let Some(list) = table.get(rid) else {
            return 0;
        };
        for (_, tx) in list {
            tx.send_replace(true);
        }
        list.len()
    }
}

/// A second view of a registration's signal, for code that does not own the handle.
#[derive(Debug, Clone)]
pub struct AbortSignal(watch::Receiver<bool>);

async fn wait_aborted(signal: &mut watch::Receiver<bool>) {
    if signal.wait_for(|v| *v).await.is_err() {
        std::future::pending::<()>().await;
    }
}

impl AbortHandle {
    /// Resolves once the request was aborted (never, if it never is).
    pub async fn aborted(&mut self) {
        wait_aborted(&mut self.signal).await;
    }

    pub fn signal(&self) -> AbortSignal {
        AbortSignal(self.signal.clone())
    }
}

impl AbortSignal {
    /// Resolves once the request was aborted (never, if it never is).
    pub async fn aborted(&mut self) {
        wait_aborted(&mut self.0).await;
    }
}

impl Drop for AbortHandle {
    fn drop(&mut self) {
        let mut table = lock(&self.table);
        if let Some(list) = table.get_mut(&self.rid) {
            list.retain(|(id, _)| *id != self.id);
            if list.is_empty() {
                table.remove(&self.rid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn abort_reaches_registered_requests_only() {
        let aborts = Aborts::default();
        let mut a = aborts.register("r1");
        let b = aborts.register("r2");
        assert_eq!(aborts.abort("r1"), 1);
        a.aborted().await;
        drop(a);
        assert_eq!(aborts.abort("r1"), 0, "a finished request is gone");
        drop(b);
        assert_eq!(aborts.abort("r2"), 0);
    }

    #[test]
    fn a_unique_registration_refuses_an_id_in_flight() {
        let aborts = Aborts::default();
        let first = aborts.register_unique("cmpl-a-0").expect("first");
        assert!(aborts.register_unique("cmpl-a-0").is_none());
        assert!(aborts.register_unique("cmpl-b-0").is_some());
        drop(first);
        assert!(aborts.register_unique("cmpl-a-0").is_some(), "it finished");
    }
}
