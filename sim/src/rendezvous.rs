//! The meeting point of two legs that pair up by a shared key instead of by an HTTP
//! hand-off: SGLang's bootstrap room and TRT-LLM generation-first's `disagg_request_id`.
//!
//! Both engines block each side until the other has shown up: the prefill (context) worker
//! cannot push its KV before the decode (generation) worker has registered a receive
//! session, and the decode worker cannot start before the KV arrived. An SGLang prefill
//! worker does not even compute before the decode side registered (it waits in its
//! bootstrap queue: [`Rooms::await_decode`], then [`Rooms::kv_ready`]); a TRT-LLM context
//! worker computes first and then waits ([`Rooms::hand_over`]). Each side gives up
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
        self.until_decode_arrived(key, &room, timeout).await
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

    /// SGLang's prefill side, before it computes: waits in the bootstrap queue until the
    /// decode side has registered for the room (in SGLang, sent the KV pages it
    /// pre-allocated), or gives up after `timeout`. [`Rooms::kv_ready`] follows once the
    /// prefill has computed.
    pub async fn await_decode(&self, key: &str, timeout: Duration) -> Result<(), RendezvousError> {
        let room = self.room(key, timeout * 2);
        self.until_decode_arrived(key, &room, timeout).await
    }

    /// Waits until the decode side of `room` has registered; a room given up is forgotten.
    async fn until_decode_arrived(
        &self,
        key: &str,
        room: &Room,
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
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

    /// SGLang's prefill side, once computed: the KV goes to the decode side registered in
    /// the room. A room that is gone (the decode side gave up) takes nothing.
    pub fn kv_ready(&self, key: &str) {
        if let Some(room) = self.lock().get(key) {
            room.kv_ready.send_replace(true);
        }
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

    /// Lets every other task of this (single-threaded) test runtime run until it waits: what
    /// has not happened then cannot happen without a new event.
    async fn settle() {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn an_sglang_prefill_computes_only_once_its_decode_registered() {
        let rooms = Arc::new(Rooms::default());
        let t = Duration::from_secs(5);
        // Prefill first: it waits for the decode side, and the decode side for the KV.
        let r = rooms.clone();
        let prefill = tokio::spawn(async move { r.await_decode("a", t).await });
        settle().await;
        assert!(!prefill.is_finished(), "no decode side yet");
        let r = rooms.clone();
        let decode = tokio::spawn(async move { r.receive("a", t).await });
        prefill.await.expect("join").expect("decode registered");
        settle().await;
        assert!(!decode.is_finished(), "the prefill has not computed yet");
        rooms.kv_ready("a");
        decode.await.expect("join").expect("kv arrived");
        assert_eq!(rooms.open(), 0);

        // Decode first: the prefill finds it registered at once.
        let r = rooms.clone();
        let decode = tokio::spawn(async move { r.receive("b", t).await });
        tokio::time::timeout(Duration::from_secs(1), async {
            while rooms.open() == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the decode side registered");
        rooms.await_decode("b", t).await.expect("decode registered");
        rooms.kv_ready("b");
        decode.await.expect("join").expect("kv arrived");
        assert_eq!(rooms.open(), 0);

        // Nobody comes: the prefill gives up and leaves no room behind.
        let short = Duration::from_millis(30);
        assert_eq!(
            rooms.await_decode("c", short).await,
            Err(RendezvousError::Timeout(short))
        );
        rooms.kv_ready("c");
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
