//! A real `redis-server` on loopback for the tests of pd-control's Redis features.

use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use super::eventually;

pub struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    /// Starts `redis-server` on loopback with no persistence, or `None` (with the reason
    /// printed) when the binary is not installed.
    pub fn start(port: u16, dir: &Path) -> Option<Redis> {
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
                eprintln!("SKIPPED: cannot run redis-server ({e}); `make setup` installs it");
                None
            }
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub async fn wait_ready(&self) {
        let port = self.port;
        eventually("redis accepting connections", || async move {
            TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
        })
        .await;
    }

    /// A server on a free port, answering: the port is probed free, but another test's
    /// process may take it before redis-server binds (which then exits, while the other
    /// process answers). So the server must report this child's process id, else another
    /// port is tried. `None` when the binary is missing.
    pub async fn start_ready(dir: &Path) -> Option<Redis> {
        for _ in 0..5 {
            let mut redis = Redis::start(free_port(), dir)?;
            if redis.answers_as_itself().await {
                return Some(redis);
            }
        }
        panic!("redis-server did not start on any of five free ports");
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

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}
