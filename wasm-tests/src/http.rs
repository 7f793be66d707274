//! A deliberately small HTTP/1.1 client: one fresh connection per request (`connection:
//! close`), so consecutive requests land on different Envoy workers, and the raw bytes of
//! the answer are kept, so tests can check chunked-stream termination. [`KeepAlive`] is the
//! opposite: several requests over one connection, each answer framed by its headers.

use std::io::{ErrorKind, Read, Write};
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

    /// Status, headers and the body's first 300 characters: what an assertion message needs
    /// to tell one answer from another.
    pub fn describe(&self) -> String {
        format!(
            "{} headers={:?} body={}",
            self.status,
            self.headers,
            self.text().chars().take(300).collect::<String>()
        )
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
    let length = (!body.is_empty() || method == "POST").then(|| body.len().to_string());
    let framing: Vec<(&str, &str)> = length
        .as_deref()
        .map(|n| ("content-length", n))
        .into_iter()
        .collect();
    let mut stream = send_head(addr, method, path, headers, &framing)?;
    // A server may answer before it has read the whole body and close the connection (Envoy's
    // 413 for a body over its buffer limit): the write then fails, but the answer that came
    // before the close is still there to read, as any HTTP client would.
    let write_error = match stream.write_all(body) {
        Ok(()) => None,
        Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => Some(e),
        Err(e) => return Err(e),
    };
    read_answer(stream, write_error)
}

/// Sends a POST whose body is chunked (no content-length), one chunk per piece, each piece
/// its own write, as a client streaming its upload does.
pub fn post_chunked(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    pieces: &[&[u8]],
) -> std::io::Result<Response> {
    let framing = [("transfer-encoding", "chunked")];
    let mut stream = send_head(addr, "POST", path, headers, &framing)?;
    for piece in pieces.iter().filter(|p| !p.is_empty()) {
        stream.write_all(format!("{:x}\r\n", piece.len()).as_bytes())?;
        stream.write_all(piece)?;
        stream.write_all(b"\r\n")?;
        stream.flush()?;
    }
    stream.write_all(b"0\r\n\r\n")?;
    read_answer(stream, None)
}

/// Connects (one connection per request, `connection: close`) and sends the request line and
/// headers: the client's, then the body's `framing`.
fn send_head(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    framing: &[(&str, &str)],
) -> std::io::Result<TcpStream> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    stream.set_nodelay(true)?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    for (name, value) in headers.iter().chain(framing) {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    Ok(stream)
}

/// Reads a whole answer; `write_error` is a failed body write, the error to report when no
/// answer came.
fn read_answer(
    mut stream: TcpStream,
    write_error: Option<std::io::Error>,
) -> std::io::Result<Response> {
    let mut raw = Vec::new();
    if let Err(e) = stream.read_to_end(&mut raw) {
        // A reset after part of the answer still shows what the client got (a cut stream
        // parses as incomplete); a timeout or a reset before any byte is the error itself.
        if raw.is_empty() || e.kind() != ErrorKind::ConnectionReset {
            return Err(write_error.unwrap_or(e));
        }
    }
    if raw.is_empty() {
        if let Some(e) = write_error {
            return Err(e);
        }
    }
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

/// One persistent HTTP/1.1 connection: requests go out one after another on the same
/// `TcpStream`, and each answer is read by its `content-length` or chunked framing (never
/// by EOF), so the connection stays usable. It never reconnects: a closed connection is an
/// error, which is what a test of per-connection behaviour wants.
pub struct KeepAlive {
    addr: String,
    stream: TcpStream,
    /// Bytes read past the previous answer (none expected without pipelining).
    buf: Vec<u8>,
}

impl KeepAlive {
    pub fn connect(addr: &str) -> std::io::Result<KeepAlive> {
        let stream = TcpStream::connect(addr)?;
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        stream.set_nodelay(true)?;
        Ok(KeepAlive {
            addr: addr.into(),
            stream,
            buf: Vec::new(),
        })
    }

    /// The client side address, identifying this connection.
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.stream.local_addr()
    }

    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<Response> {
        let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {}\r\n", self.addr);
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        if !body.is_empty() || method == "POST" {
            head.push_str(&format!("content-length: {}\r\n", body.len()));
        }
        head.push_str("\r\n");
        self.stream.write_all(head.as_bytes())?;
        self.stream.write_all(body)?;
        self.read_response(method == "HEAD")
    }

    pub fn post_json(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: &serde_json::Value,
    ) -> std::io::Result<Response> {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        self.request("POST", path, &all, body.to_string().as_bytes())
    }

    /// Reads more bytes into `buf`; EOF is an error (the answer is not complete yet).
    fn fill(&mut self) -> std::io::Result<()> {
        let mut chunk = [0u8; 16 * 1024];
        let n = self.stream.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "connection closed mid-answer after {:?}",
                    String::from_utf8_lossy(&self.buf)
                ),
            ));
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    fn read_response(&mut self, head_only: bool) -> std::io::Result<Response> {
        let head_end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            self.fill()?;
        };
        let head = parse(&self.buf[..head_end]).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "unparsable HTTP head: {:?}",
                    String::from_utf8_lossy(&self.buf[..head_end])
                ),
            )
        })?;
        let chunked = head
            .header("transfer-encoding")
            .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
        let no_body = head_only || head.status == 204 || head.status == 304 || head.status < 200;
        let end = if no_body {
            head_end
        } else if chunked {
            loop {
                if let Some(n) = chunked_len(&self.buf[head_end..]) {
                    break head_end + n;
                }
                self.fill()?;
            }
        } else {
            let len: usize = head
                .header("content-length")
                .map(|v| v.trim().parse().unwrap_or(0))
                .unwrap_or(0);
            while self.buf.len() < head_end + len {
                self.fill()?;
            }
            head_end + len
        };
        let raw: Vec<u8> = self.buf.drain(..end).collect();
        let mut response = parse(&raw).expect("head parsed above");
        if no_body {
            response.body.clear();
        }
        Ok(response)
    }
}

/// Length of a complete chunked body (through the terminating chunk and trailers) at the
/// start of `data`, or `None` while incomplete.
fn chunked_len(data: &[u8]) -> Option<usize> {
    let mut at = 0;
    loop {
        let line_end = at + data[at..].windows(2).position(|w| w == b"\r\n")?;
        let size_text = String::from_utf8_lossy(&data[at..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        at = line_end + 2;
        if size == 0 {
            // Trailers, if any, end with an empty line.
            loop {
                let end = at + data[at..].windows(2).position(|w| w == b"\r\n")?;
                let empty = end == at;
                at = end + 2;
                if empty {
                    return Some(at);
                }
            }
        }
        if data.len() < at + size + 2 {
            return None;
        }
        at += size + 2;
    }
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

    #[test]
    fn chunked_len_finds_the_end_of_one_answer() {
        let body = b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1 200 OK";
        assert_eq!(chunked_len(body), Some(13));
        assert_eq!(chunked_len(b"3\r\nabc\r\n0\r\nx-t: 1\r\n\r\n"), Some(21));
        assert_eq!(chunked_len(b"3\r\nabc\r\n"), None);
        assert_eq!(chunked_len(b"3\r\nab"), None);
    }

    /// Reads a request up to the end of its head (the test servers' side).
    fn read_head(s: &mut TcpStream) {
        let mut seen = Vec::new();
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let mut b = [0u8; 1024];
            let n = s.read(&mut b).unwrap();
            seen.extend_from_slice(&b[..n]);
        }
    }

    /// A one-connection server on a free port running `serve`; its address and thread.
    fn serve_one(
        serve: impl FnOnce(TcpStream) + Send + 'static,
    ) -> (String, std::thread::JoinHandle<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || serve(listener.accept().unwrap().0));
        (addr, server)
    }

    #[test]
    fn keep_alive_reads_consecutive_answers_on_one_connection() {
        let (addr, server) = serve_one(|mut s| {
            let answers: [&[u8]; 2] = [
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi",
                b"HTTP/1.1 201 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nyo\r\n0\r\n\r\n",
            ];
            for answer in answers {
                read_head(&mut s);
                s.write_all(answer).unwrap();
            }
            // Keep the socket open until the client is done: no EOF framing.
            let mut b = [0u8; 1];
            let _ = s.read(&mut b);
        });
        let mut c = KeepAlive::connect(&addr).unwrap();
        let a = c.request("GET", "/a", &[], &[]).unwrap();
        assert_eq!((a.status, a.body.as_slice()), (200, &b"hi"[..]));
        let b = c.request("GET", "/b", &[], &[]).unwrap();
        assert_eq!(
            (b.status, b.body.as_slice(), b.complete),
            (201, &b"yo"[..], true)
        );
        drop(c);
        server.join().unwrap();
    }

    /// A server that answers after the head and closes with the body unread resets the
    /// connection: the client's write fails, and the answer must still reach the caller.
    #[test]
    fn an_answer_sent_before_the_body_was_read_is_returned() {
        let (addr, server) = serve_one(|mut s| {
            read_head(&mut s);
            s.write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\n\r\n")
                .unwrap();
            // Closing with unread bytes queued sends a reset.
        });
        let body = vec![b'x'; 64 << 20];
        let r = request(&addr, "POST", "/", &[], &body).unwrap();
        assert_eq!(r.status, 413);
        server.join().unwrap();
    }
}
