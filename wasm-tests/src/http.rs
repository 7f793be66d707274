//! A deliberately small HTTP/1.1 client: one fresh connection per request (`connection:
//! close`), so consecutive requests land on different Envoy workers, and the raw bytes of
//! the answer are kept, so tests can check chunked-stream termination.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Lower-cased names, in order.
    pub headers: Vec<(String, String)>,
    /// De-chunked body.
    pub body: Vec<u8>,
    /// True when a chunked body ended with its terminating zero-size chunk.
    pub complete: bool,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends one request and reads the whole answer.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    stream.set_nodelay(true)?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    parse(&raw).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "unparsable HTTP response: {:?}",
                String::from_utf8_lossy(&raw)
            ),
        )
    })
}

pub fn get(addr: &str, path: &str) -> std::io::Result<Response> {
    request(addr, "GET", path, &[], &[])
}

pub fn post_json(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> Response {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    request(addr, "POST", path, &all, body.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("POST {addr}{path} failed: {e}"))
}

fn parse(raw: &[u8]) -> Option<Response> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let rest = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let (body, complete) = if chunked {
        dechunk(rest)
    } else {
        (rest.to_vec(), true)
    };
    Some(Response {
        status,
        headers,
        body,
        complete,
    })
}

fn dechunk(mut data: &[u8]) -> (Vec<u8>, bool) {
    let mut body = Vec::new();
    loop {
        let Some(line_end) = data.windows(2).position(|w| w == b"\r\n") else {
            return (body, false);
        };
        let size_text = String::from_utf8_lossy(&data[..line_end]);
        let Ok(size) = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
        else {
            return (body, false);
        };
        data = &data[line_end + 2..];
        if size == 0 {
            return (body, true);
        }
        if data.len() < size + 2 {
            body.extend_from_slice(&data[..data.len().min(size)]);
            return (body, false);
        }
        body.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_chunked_and_detects_truncation() {
        let full = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let r = parse(full).unwrap();
        assert_eq!(
            (r.status, r.body.as_slice(), r.complete),
            (200, &b"abcde"[..], true)
        );
        assert_eq!(r.header("x-a"), Some("b"));
        let cut = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n";
        assert!(!parse(cut).unwrap().complete);
    }
}
