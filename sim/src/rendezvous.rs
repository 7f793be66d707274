//! The meeting point of two legs that pair up by a shared key instead of by an HTTP
//! hand-off: SGLang's bootstrap room and TRT-LLM generation-first's `disagg_request_id`.
//!
//! Both engines block each side until the other has shown up: the prefill (context) worker
//! cannot push its KV before the decode (generation) worker has registered a receive
//! session, and the decode worker cannot start before the KV arrived. Each side gives up
//! after the engine's transfer timeout, which is what a router must cope with when it sends
//! only one of the two legs, or sends them to workers that cannot find each other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// Why one side of a rendezvous gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// The other leg never arrived within the transfer timeout.
    #[error("the peer leg did not arrive within {0:?}")]
    Timeout(Duration),
}

#[derive(Debug)]
struct Room {
    kv_ready: watch::Sender<bool>,
    decode_arrived: watch::Sender<bool>,
    created: Instant,
}

impl Room {
    fn new() -> Room {
        Room {
            kv_ready: watch::channel(false).0,
            decode_arrived: watch::channel(false).0,
            created: Instant::now(),
        }
    }
}

/// Every open room of the simulator, by key.
#[derive(Debug, Default)]
pub struct Rooms {
    rooms: Mutex<HashMap<String, Arc<Room>>>,
}

impl Rooms {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Room>>> {
        self.rooms.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The room of `key`, created on first use. Rooms older than `stale` (twice the
    /// transfer timeout: both sides have given up by then) are swept on the way.
    fn room(&self, key: &str, stale: Duration) -> Arc<Room> {
        let mut rooms = self.lock();
        let now = Instant::now();
        rooms.retain(|_, r| now.saturating_duration_since(r.created) < stale);
        rooms
            .entry(key.to_string())
            .or_insert_with(|| Arc::new(Room::new()))
            .clone()
    }

    fn forget(&self, key: &str) {
        self.lock().remove(key);
    }

    /// The prefill side: its KV is ready; waits until the decode side has registered, so
    /// the transfer can happen, or gives up after `timeout`.
    pub async fn hand_over(&self, key: &str, timeout: Duration) -> Result<(), RendezvousError> {
        let room = self.room(key, timeout * 2);
        room.kv_ready.send_replace(true);
        let mut arrived = room.decode_arrived.subscribe();
        let met = matches!(
            tokio::time::timeout(timeout, arrived.wait_for(|v| *v)).await,
            Ok(Ok(_))
        );
        if met {
            Ok(())
        } else {
            self.forget(key);
            Err(RendezvousError::Timeout(timeout))
        }
    }

    /// The decode side: registers, then waits for the KV, or gives up after `timeout`.
    pub async fn receive(&self, key: &str, timeout: Duration) -> Result<(), RendezvousError> {
        let room = self.room(key, timeout * 2);
        room.decode_arrived.send_replace(true);
        let mut ready = room.kv_ready.subscribe();
        let met = matches!(
            tokio::time::timeout(timeout, ready.wait_for(|v| *v)).await,
            Ok(Ok(_))
        );
        let result = if met {
            Ok(())
        } else {
            Err(RendezvousError::Timeout(timeout))
        };
        // Either the KV arrived (the room is done) or the decode side gave up.
        self.forget(key);
        result
    }

    /// Rooms currently open (for tests).
    pub fn open(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn either_side_may_arrive_first() {
        let rooms = Arc::new(Rooms::default());
        let t = Duration::from_secs(5);
        let r = rooms.clone();
        let decode = tokio::spawn(async move { r.receive("a", t).await });
        rooms.hand_over("a", t).await.expect("decode registered");
        decode.await.expect("join").expect("kv arrived");

        let r = rooms.clone();
        let prefill = tokio::spawn(async move { r.hand_over("b", t).await });
        rooms.receive("b", t).await.expect("kv arrived");
        prefill.await.expect("join").expect("decode registered");
        assert_eq!(rooms.open(), 0);
    }

    #[tokio::test]
    async fn a_lonely_side_times_out_and_other_keys_do_not_meet() {
        let rooms = Rooms::default();
        let t = Duration::from_millis(30);
        let r = tokio::join!(rooms.hand_over("x", t), rooms.receive("y", t));
        assert_eq!(r.0, Err(RendezvousError::Timeout(t)));
        assert_eq!(r.1, Err(RendezvousError::Timeout(t)));
        assert_eq!(rooms.open(), 0);
    }
}
