//! One lazily opened Redis connection, shared by everything in pd-control that talks to Redis
//! (replica shares, user limits).
//!
//! Connecting is deferred to the first call, so pd-control starts (and serves snapshots) while
//! Redis is down. Every round trip is bounded, because the callers answer a gateway that is
//! holding a request: a slow Redis must cost it a bounded wait, never a hang. A connection that
//! failed is dropped so that the next call reconnects: a restarted Redis is used again at once.

use std::future::Future;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;

/// Bound on one Redis round trip (and on connecting).
pub const ROUND_TRIP: Duration = Duration::from_millis(250);

/// After a failed connect, calls fail at once for this long instead of each trying (and, with
/// an unreachable host, each waiting [`ROUND_TRIP`] in turn behind the one connecting).
pub const RECONNECT_BACKOFF: Duration = Duration::from_millis(500);

/// Why a Redis call produced no answer.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("connecting to redis timed out after {0:?}")]
    ConnectTimeout(Duration),
    #[error("redis round trip timed out after {0:?}")]
    Timeout(Duration),
    #[error("redis unreachable (the last connect failed; retrying within {RECONNECT_BACKOFF:?})")]
    Backoff,
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// Whether a failed call may be sent again on a fresh connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Safe to repeat (a read, or a write whose repetition is harmless): when it fails on a
    /// connection opened by an earlier call (likely broken by a Redis restart since), it is
    /// sent once more on a new one.
    OnceOnStaleConnection,
    /// Not safe to repeat (an increment): a failure is reported as it is.
    Never,
}

/// A multiplexed connection opened on first use and replaced after a failure.
pub struct RedisLink {
    client: redis::Client,
    slot: tokio::sync::Mutex<Slot>,
}

#[derive(Default)]
struct Slot {
    /// Counts connections opened: a failing call drops the connection only if it is still the
    /// one it used, so concurrent failures do not discard a fresh replacement.
    generation: u64,
    conn: Option<MultiplexedConnection>,
    /// Set by a failed connect: no new attempt before then.
    retry_at: Option<Instant>,
}

impl RedisLink {
    /// `url` must parse (`redis://host:port/db`); nothing is connected yet.
    pub fn open(url: &str) -> Result<RedisLink, redis::RedisError> {
        Ok(RedisLink {
            client: redis::Client::open(url)?,
            slot: tokio::sync::Mutex::new(Slot::default()),
        })
    }

    /// Runs `call` on the shared connection with the [`ROUND_TRIP`] bound. `call` gets its
    /// own handle (a multiplexed connection is a cheap clone), so calls run concurrently.
    pub async fn call<T, F, Fut>(&self, retry: Retry, mut call: F) -> Result<T, LinkError>
    where
        F: FnMut(MultiplexedConnection) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let mut retried = false;
        loop {
            let (generation, reused, conn) = self.connection().await?;
            let result = match tokio::time::timeout(ROUND_TRIP, call(conn)).await {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(e)) => LinkError::Redis(e),
                Err(_) => LinkError::Timeout(ROUND_TRIP),
            };
            // An error reply (a script error, a wrong type) leaves the connection usable;
            // anything else may have left it broken or with a late reply in flight.
            let connection_fault = match &result {
                LinkError::Redis(e) => !matches!(
                    e.kind(),
                    redis::ErrorKind::Server(_)
                        | redis::ErrorKind::Extension
                        | redis::ErrorKind::UnexpectedReturnType
                ),
                _ => true,
            };
            if !connection_fault {
                return Err(result);
            }
            self.discard(generation).await;
            if retry == Retry::Never || !reused || retried {
                return Err(result);
            }
            retried = true;
        }
    }

    /// The current connection, opening one if there is none: `(generation, reused, handle)`.
    async fn connection(&self) -> Result<(u64, bool, MultiplexedConnection), LinkError> {
        let mut slot = self.slot.lock().await;
        if let Some(conn) = &slot.conn {
            return Ok((slot.generation, true, conn.clone()));
        }
        if slot.retry_at.is_some_and(|at| Instant::now() < at) {
            return Err(LinkError::Backoff);
        }
        let opened =
            tokio::time::timeout(ROUND_TRIP, self.client.get_multiplexed_async_connection())
                .await
                .map_err(|_| LinkError::ConnectTimeout(ROUND_TRIP))
                .and_then(|r| r.map_err(LinkError::from));
        match opened {
            Ok(conn) => {
                slot.generation += 1;
                slot.conn = Some(conn.clone());
                slot.retry_at = None;
                Ok((slot.generation, false, conn))
            }
            Err(e) => {
                slot.retry_at = Some(Instant::now() + RECONNECT_BACKOFF);
                Err(e)
            }
        }
    }

    async fn discard(&self, generation: u64) {
        let mut slot = self.slot.lock().await;
        if slot.generation == generation {
            slot.conn = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn ping(mut conn: MultiplexedConnection) -> redis::RedisResult<String> {
        redis::cmd("PING").query_async(&mut conn).await
    }

    #[tokio::test]
    async fn a_failed_connect_fails_the_next_calls_at_once() {
        // A port nobody listens on: the connect is refused.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let link = RedisLink::open(&format!("redis://127.0.0.1:{port}/0")).unwrap();
        let first = link.call(Retry::OnceOnStaleConnection, ping).await;
        assert!(
            matches!(
                first,
                Err(LinkError::Redis(_) | LinkError::ConnectTimeout(_))
            ),
            "{first:?}"
        );
        let second = link.call(Retry::OnceOnStaleConnection, ping).await;
        assert!(matches!(second, Err(LinkError::Backoff)), "{second:?}");
    }
}
