//! One lazily opened Redis connection, shared by everything in pd-control that talks to Redis
//! (replica shares, user limits).
//!
//! Connecting is deferred to the first call, so pd-control starts (and serves snapshots) while
//! Redis is down. Every round trip is bounded, because the callers answer a gateway that is
//! holding a request: a slow Redis must cost it a bounded wait, never a hang. A connection that
//! failed is dropped so that the next call reconnects: a restarted Redis is used again at once.
//! So is one to a server that no longer takes writes (a primary demoted by a failover that left
//! its client connections open): only a reconnect reaches the new primary.

use std::future::Future;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;

/// Bound on one Redis round trip (and on connecting).
pub const ROUND_TRIP: Duration = Duration::from_millis(250);

/// After a failed connect, or a round trip that timed out and is not tried again, calls fail at
/// once for this long instead of each trying (and, with an unreachable or unanswering host,
/// each waiting [`ROUND_TRIP`] in turn behind the one connecting, or on a connection of its
/// own).
pub const RECONNECT_BACKOFF: Duration = Duration::from_millis(500);

/// Why a Redis call produced no answer.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("connecting to redis timed out after {0:?}")]
    ConnectTimeout(Duration),
    #[error("redis round trip timed out after {0:?}")]
    Timeout(Duration),
    #[error("redis unreachable (the last connect or round trip failed; retrying within {RECONNECT_BACKOFF:?})")]
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
    /// Not safe to repeat (an increment): a failure is reported as it is, unless the server
    /// refused the call unrun ([`Fault::WrongServer`]).
    Never,
}

/// What a failed call says of the connection it used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// An error reply to the call itself (a script error, a wrong type, a reply of another
    /// shape): the connection is fine and kept.
    Reply,
    /// The server refused the call, unrun, for what it is now: a replica (`READONLY`; a
    /// primary demoted by a failover, whose clients stay connected), one that lost its primary
    /// (`MASTERDOWN`), or a slot in migration (`TRYAGAIN`). Every write on this connection
    /// would fail the same way until pd-control restarted, so it is dropped: the reconnect
    /// reaches whatever the address names now. Nothing ran, so even a [`Retry::Never`] call
    /// may be sent again.
    WrongServer,
    /// No answer within [`ROUND_TRIP`]: the connection may still get the late reply, so it is
    /// dropped; and the server may be hung, so unless the call is tried once more (see
    /// [`RedisLink::call`]) reconnecting waits [`RECONNECT_BACKOFF`].
    TimedOut,
    /// Anything else (I/O, a broken stream, a refused connect): the connection is dropped.
    Broken,
}

impl Fault {
    /// Sorts a failed call by the server's error code, not its text: the codes are the
    /// protocol's, the texts change between Redis versions.
    pub fn of(error: &LinkError) -> Fault {
        use redis::{ErrorKind, ServerErrorKind};
        match error {
            LinkError::Timeout(_) => Fault::TimedOut,
            LinkError::Redis(e) => match e.kind() {
                ErrorKind::Server(
                    ServerErrorKind::ReadOnly
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::TryAgain,
                ) => Fault::WrongServer,
                ErrorKind::Server(_) | ErrorKind::Extension | ErrorKind::UnexpectedReturnType => {
                    Fault::Reply
                }
                _ => Fault::Broken,
            },
            LinkError::ConnectTimeout(_) | LinkError::Backoff => Fault::Broken,
        }
    }
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
    /// Set by a failed connect or a timed-out round trip: no new attempt before then.
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
            let fault = Fault::of(&result);
            if fault == Fault::Reply {
                return Err(result);
            }
            let again = !retried
                && reused
                && (retry == Retry::OnceOnStaleConnection || fault == Fault::WrongServer);
            // A timeout on the connection's second try, or on one that is not tried again,
            // says the server is slow or hung: later calls fail fast for a while rather than
            // each waiting out its own timeout. A first timeout on an older connection may be
            // that connection's (half-open since a Redis restart): it is tried once more.
            let backoff = fault == Fault::TimedOut && !again;
            self.discard(generation, backoff).await;
            if !again {
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

    /// Drops connection `generation` if it is still the current one (a concurrent failure
    /// may have replaced it already), and with `backoff` holds reconnects off for
    /// [`RECONNECT_BACKOFF`].
    async fn discard(&self, generation: u64, backoff: bool) {
        let mut slot = self.slot.lock().await;
        if slot.generation == generation {
            slot.conn = None;
            if backoff {
                slot.retry_at = Some(Instant::now() + RECONNECT_BACKOFF);
            }
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

    /// The error the crate makes of the server's error reply `line` (with its own parser).
    fn reply(line: &str) -> LinkError {
        let frame = format!("-{line}\r\n");
        match redis::parse_redis_value(frame.as_bytes()) {
            Ok(value) => match value.extract_error() {
                Err(e) => LinkError::Redis(e),
                Ok(other) => panic!("{line}: not an error reply: {other:?}"),
            },
            Err(e) => LinkError::Redis(e),
        }
    }

    #[test]
    fn a_server_that_takes_no_writes_is_a_fault_of_the_connection_not_of_the_call() {
        for line in [
            "READONLY You can't write against a read only replica.",
            "READONLY You can't write against a read only replica. script: 2bab3b66, on @user_script:1.",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "TRYAGAIN Multiple keys request during rehashing of slot",
        ] {
            assert_eq!(Fault::of(&reply(line)), Fault::WrongServer, "{line}");
        }
        for line in [
            "ERR value is not an integer or out of range",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
            "NOSCRIPT No matching script. Please use EVAL.",
            "ERR user_script:1: Script attempted to access nonexistent global variable",
        ] {
            assert_eq!(Fault::of(&reply(line)), Fault::Reply, "{line}");
        }
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(
            Fault::of(&LinkError::Redis(redis::RedisError::from(io))),
            Fault::Broken
        );
        assert_eq!(Fault::of(&LinkError::Timeout(ROUND_TRIP)), Fault::TimedOut);
    }
}
