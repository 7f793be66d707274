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
