//! A real `redis-server` on loopback for the tests of pd-control's Redis features.

use std::path::Path;
use std::process::{Child, Command, Stdio};

pub struct Redis {
    child: Child,
    port: u16,
}

/// The one rule for a test that needs `redis-server` when it cannot run (shared with the
/// end-to-end tests).
pub use pd_wasm_tests::redis::missing_redis;

impl Redis {
    /// Starts `redis-server` on loopback with no persistence. When the binary cannot run,
    /// [`missing_redis`] decides: the test fails, or (`PD_TESTS_ALLOW_SKIP=1`) this returns
    /// `None` and the test returns as skipped. Not yet known to answer: see
    /// [`Redis::start_ready`].
    fn start(port: u16, dir: &Path) -> Option<Redis> {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        match child {
            Ok(child) => Some(Redis { child, port }),
            Err(e) => {
                missing_redis(&e);
                None
            }
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// A server on a free port, answering: the port is probed free, but another test's
    /// process may take it before redis-server binds (which then exits, while the other
    /// process answers). So the server must report this child's process id, else another
    /// port is tried. `None` only where the binary cannot run and [`missing_redis`] allows a
    /// skip.
    pub async fn start_ready(dir: &Path) -> Option<Redis> {
        for _ in 0..5 {
            let mut redis = Redis::start(free_port(), dir)?;
            if redis.answers_as_itself().await {
                return Some(redis);
            }
        }
        panic!("redis-server did not start on any of five free ports");
    }

    /// A server on `port` again (a Redis that went away and returns on its address),
    /// answering as this child. The port was just freed by the previous server, but may be
    /// held a moment longer (or taken by another test's process): the start is retried until
    /// a server of its own answers, failing the test after [`super::DEADLINE`]. `None` as for
    /// [`Redis::start_ready`].
    pub async fn start_ready_on(port: u16, dir: &Path) -> Option<Redis> {
        let start = std::time::Instant::now();
        loop {
            let mut redis = Redis::start(port, dir)?;
            if redis.answers_as_itself().await {
                return Some(redis);
            }
            drop(redis);
            assert!(
                start.elapsed() < super::DEADLINE,
                "redis-server could not start again on port {port}"
            );
            tokio::time::sleep(super::POLL).await;
        }
    }

    /// Waits (up to the deadline) until the server on this port reports this child's process
    /// id; false once the child exited or another process answered.
    async fn answers_as_itself(&mut self) -> bool {
        let pid = format!("process_id:{}", self.child.id());
        let start = std::time::Instant::now();
        while start.elapsed() < super::DEADLINE {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return false;
            }
            let info = tokio::time::timeout(super::POLL * 10, self.info_server()).await;
            if let Ok(Some(info)) = info {
                return info.lines().any(|l| l.trim() == pid);
            }
            tokio::time::sleep(super::POLL).await;
        }
        false
    }

    async fn info_server(&self) -> Option<String> {
        let client = redis::Client::open(self.url()).ok()?;
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        redis::cmd("INFO")
            .arg("server")
            .query_async::<String>(&mut conn)
            .await
            .ok()
    }

    /// A connection of the test's own, to seed and inspect keys.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("redis url")
            .get_multiplexed_async_connection()
            .await
            .expect("test connection to redis")
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port for a server to bind, never the same twice in this process.
pub use pd_wasm_tests::stack::free_port;
