//! Over real sockets: a client that leaves before its answer is complete is logged
//! `client_gone` (hanging, mid-stream), one that gets its whole answer is not, and a
//! `cut_body` error answer stops mid-body with its connection closed.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

const MODEL: &str = "departure-model";

async fn one_pod() -> common::CombinedPod {
    common::combined_pod(MODEL).await
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

async fn arm(admin: &str, spec: Value) {
    let status = client()
        .post(format!("{admin}/sim/faults"))
        .body(spec.to_string())
        .send()
        .await
        .expect("arm")
        .status();
    assert_eq!(status, 204, "{spec}");
}

async fn log(admin: &str) -> Vec<Value> {
    let text = client()
        .get(format!("{admin}/sim/requests"))
        .send()
        .await
        .expect("log")
        .text()
        .await
        .expect("log body");
    serde_json::from_str(&text).expect("log JSON")
}

/// Polls the log until `check` holds for it.
async fn wait_log(admin: &str, what: &str, check: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let entries = log(admin).await;
        if check(&entries) {
            return entries;
        }
        assert!(Instant::now() < deadline, "{what}: {entries:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sends a completion on a raw connection, left open for the caller.
fn open(addr: &str, stream: bool, max_tokens: u32) -> TcpStream {
    let body =
        json!({"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "stream": stream})
            .to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("head");
    s.write_all(body.as_bytes()).expect("body");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_a_hanging_request_is_logged_gone() {
    let pod = one_pod().await;
    arm(
        &pod.admin,
        json!({"pod": "pod-a", "kind": "hang_before_headers"}),
    )
    .await;
    let s = open(&pod.addr, false, 4);
    wait_log(&pod.admin, "logged", |l| l.len() == 1).await;
    assert_eq!(log(&pod.admin).await[0]["client_gone"], false);
    drop(s);
    wait_log(&pod.admin, "never marked gone", |l| {
        l[0]["client_gone"] == true
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_is_logged_gone_and_a_whole_answer_is_not() {
    let pod = one_pod().await;
    // A whole answer, streamed and not.
    for stream in [false, true] {
        let mut s = open(&pod.addr, stream, 2);
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        while !(answer.ends_with(b"0\r\n\r\n") || (!stream && answer.ends_with(b"}"))) {
            let n = s.read(&mut buf).expect("read");
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&buf[..n]);
        }
    }
    // One that stalls after its first event, left by its client.
    arm(
        &pod.admin,
        json!({"pod": "pod-a", "kind": "hang_after_chunks", "chunks": 1}),
    )
    .await;
    let s = open(&pod.addr, true, 50);
    wait_log(&pod.admin, "logged", |l| l.len() == 3).await;
    drop(s);
    let entries = wait_log(&pod.admin, "never marked gone", |l| {
        l[2]["client_gone"] == true
    })
    .await;
    assert_eq!(entries[0]["client_gone"], false, "{entries:?}");
    assert_eq!(entries[1]["client_gone"], false, "{entries:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_body_error_sends_its_headers_and_half_its_body_then_closes() {
    let pod = one_pod().await;
    arm(
        &pod.admin,
        json!({"pod": "pod-a", "kind": "status", "status": 500, "cut_body": true}),
    )
    .await;
    let mut s = open(&pod.addr, false, 2);
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut raw = Vec::new();
    // EOF (or a reset) ends it: the connection closes mid-body.
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a head");
    assert!(head.starts_with("HTTP/1.1 500"), "{text}");
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|v| v.trim().parse().ok())
        .expect("content-length");
    assert!(
        !body.is_empty() && body.len() < length,
        "{} of {length} body bytes: {text}",
        body.len()
    );
}
