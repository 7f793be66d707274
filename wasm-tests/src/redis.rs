//! A real `redis-server` on loopback for the multi-replica tests: its own port and temp dir,
//! no persistence, stopped on drop.

use std::io::{BufRead, BufReader, Read, Write};
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

    /// Runs one command (`["SET", "k", "v"]`) and returns its reply as text: a status or bulk
    /// string, an integer's digits, `None` for a nil. Panics on an error reply.
    pub fn command(&self, args: &[&str]) -> Option<String> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).expect("redis connect");
        let mut request = format!("*{}\r\n", args.len());
        for arg in args {
            request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
        }
        stream.write_all(request.as_bytes()).expect("redis write");
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).expect("redis reply");
        let line = line.trim_end();
        let (kind, rest) = line.split_at(1);
        match kind {
            "+" | ":" => Some(rest.to_string()),
            "-" => panic!("redis {args:?}: {rest}"),
            "$" if rest == "-1" => None,
            "$" => {
                let len: usize = rest.parse().expect("bulk length");
                let mut value = vec![0u8; len + 2];
                reader.read_exact(&mut value).expect("bulk value");
                value.truncate(len);
                Some(String::from_utf8_lossy(&value).into_owned())
            }
            other => panic!("redis {args:?}: unexpected reply kind {other:?}"),
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
