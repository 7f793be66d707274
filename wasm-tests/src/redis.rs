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

/// The one rule for a test that needs `redis-server` when it cannot run: with
/// `PD_TESTS_ALLOW_SKIP=1` the test returns, passing as skipped (the reason printed); otherwise
/// it fails, saying so. `why` is the error that stopped the binary.
pub fn missing_redis(why: &dyn std::fmt::Display) {
    let allowed = std::env::var("PD_TESTS_ALLOW_SKIP").is_ok_and(|v| v == "1");
    assert!(
        allowed,
        "cannot run redis-server ({why}): `make setup` installs it \
         (PD_TESTS_ALLOW_SKIP=1 skips the tests that need it instead)"
    );
    eprintln!("SKIPPED: cannot run redis-server ({why}); PD_TESTS_ALLOW_SKIP=1 is set");
}

impl RedisServer {
    /// Starts it and waits until it answers. When the binary cannot run, [`missing_redis`]
    /// decides: the test fails, or (`PD_TESTS_ALLOW_SKIP=1`) this returns `None` and the test
    /// returns as skipped. The free port it is given may be taken by another test's process
    /// between the probe and redis-server's bind (which then exits): so the server that
    /// answers must report this child's process id, else another port is tried.
    pub fn start(dir: &Path) -> Option<RedisServer> {
        for _ in 0..5 {
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
                    missing_redis(&e);
                    return None;
                }
            };
            let mut server = RedisServer { child, port };
            if server.answers_as_itself() {
                return Some(server);
            }
        }
        panic!("redis-server did not start on any of five free ports");
    }

    /// Waits until the server on this port answers with this child's process id; false if
    /// the child exited (its port was taken) or another process answers.
    fn answers_as_itself(&mut self) -> bool {
        let pid = format!("process_id:{}", self.child.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return false;
            }
            if let Ok(Some(info)) = self.try_command(&["INFO", "server"]) {
                return info.lines().any(|l| l.trim() == pid);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Runs one command (`["SET", "k", "v"]`) and returns its reply as text: a status or bulk
    /// string, an integer's digits, `None` for a nil. Panics on an error reply.
    pub fn command(&self, args: &[&str]) -> Option<String> {
        self.try_command(args)
            .unwrap_or_else(|e| panic!("redis {args:?}: {e}"))
    }

    /// [`RedisServer::command`], with failures (no connection, an error reply) returned.
    fn try_command(&self, args: &[&str]) -> Result<Option<String>, String> {
        let io = |e: std::io::Error| e.to_string();
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).map_err(io)?;
        let mut request = format!("*{}\r\n", args.len());
        for arg in args {
            request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
        }
        stream.write_all(request.as_bytes()).map_err(io)?;
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).map_err(io)?;
        let line = line.trim_end();
        if line.is_empty() {
            return Err("no reply".into());
        }
        let (kind, rest) = line.split_at(1);
        match kind {
            "+" | ":" => Ok(Some(rest.to_string())),
            "-" => Err(rest.to_string()),
            "$" if rest == "-1" => Ok(None),
            "$" => {
                let len: usize = rest.parse().map_err(|_| format!("bulk length {rest:?}"))?;
                let mut value = vec![0u8; len + 2];
                reader.read_exact(&mut value).map_err(io)?;
                value.truncate(len);
                Ok(Some(String::from_utf8_lossy(&value).into_owned()))
            }
            other => Err(format!("unexpected reply kind {other:?}")),
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
