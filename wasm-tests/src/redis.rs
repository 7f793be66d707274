//! A real `redis-server` on loopback for the multi-replica tests: its own port and temp dir,
//! no persistence, stopped on drop.

use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Child,
    pub port: u16,
}

impl RedisServer {
    /// Starts it and waits until it accepts connections, or returns `None` with the reason
    /// printed when the binary is missing (`make setup` installs it).
    pub fn start(dir: &Path) -> Option<RedisServer> {
        let port = crate::stack::free_port();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) => {
                eprintln!("SKIPPED: cannot run redis-server ({e}); `make setup` installs it");
                return None;
            }
        };
        let server = RedisServer { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(server)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
