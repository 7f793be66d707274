//! The engines' keep-alive close over real sockets: an idle kept-alive connection is closed
//! after the timeout, as uvicorn does; one carrying a response is not, however long it runs.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use pd_sim::engine::TimingModel;
use pd_sim::pod::SimConfig;
use pd_sim::sim::{FleetWatcher, Sim};

mod common;
use common::{fleet_yaml, free_port, pod_yaml, TempFile};

/// Serves one standard vLLM pod; returns its address.
async fn serve(config: SimConfig) -> (std::sync::Arc<Sim>, String, TempFile) {
    let port = free_port();
    let path = std::env::temp_dir().join(format!(
        "pd-sim-keep-alive-{}-{port}.yaml",
        std::process::id()
    ));
    let file = TempFile(path.clone());
    let pod = pod_yaml("m", "vllm-c-0", "vllm", "", port).replace("      role-name: \n", "");
    std::fs::write(&path, fleet_yaml(&[pod])).expect("fleet");
    let watcher = FleetWatcher::load(path, Duration::from_millis(50)).expect("fleet parses");
    let sim = Sim::new(config);
    let report = sim.apply(watcher.records()).await;
    assert_eq!(report.serving, 1, "{report:?}");
    (sim, format!("127.0.0.1:{port}"), file)
}

/// Sends `request` on `stream` and reads bytes until `done` says the answer is whole.
fn exchange(stream: &mut TcpStream, request: &str, done: impl Fn(&[u8]) -> bool) -> String {
    stream.write_all(request.as_bytes()).expect("send");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !done(&got) {
        let n = stream.read(&mut buf).expect("read");
        assert!(
            n > 0,
            "closed mid-answer: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Blocks until the pod closes the connection (a read of 0 bytes), failing on any byte.
fn wait_closed(stream: &mut TcpStream) {
    let mut buf = [0u8; 64];
    match stream.read(&mut buf) {
        Ok(0) => {}
        Ok(n) => panic!("unexpected bytes: {:?}", String::from_utf8_lossy(&buf[..n])),
        Err(e) => panic!("no close within the read timeout: {e}"),
    }
}

fn connect(addr: &str) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("read timeout");
    stream
}

/// Runs the socket exchange `f` off the runtime that serves the pod.
async fn blocking(f: impl FnOnce() + Send + 'static) {
    tokio::task::spawn_blocking(f).await.expect("join");
}

const HEALTH: &str = "GET /health HTTP/1.1\r\nhost: pod\r\n\r\n";

fn head_done(got: &[u8]) -> bool {
    got.windows(4).any(|w| w == b"\r\n\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_after_the_keep_alive_timeout() {
    let timeout = Duration::from_millis(300);
    let (_sim, addr, _f) = serve(SimConfig {
        keep_alive: Some(timeout),
        ..SimConfig::default()
    })
    .await;
    blocking(move || {
        let mut stream = connect(&addr);
        // Two requests on one connection: it is kept alive between them.
        for _ in 0..2 {
            let answer = exchange(&mut stream, HEALTH, head_done);
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        }
        let idle = Instant::now();
        wait_closed(&mut stream);
        assert!(idle.elapsed() >= timeout - Duration::from_millis(20));
    })
    .await;
}

/// A streamed answer that runs about ten times the timeout is sent whole; the close comes a timeout
/// after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_outlasting_the_timeout_is_not_cut() {
    let timeout = Duration::from_millis(50);
    let (_sim, addr, _f) = serve(SimConfig {
        keep_alive: Some(timeout),
        timing: TimingModel {
            decode_ms_per_token: 25.0,
            ..TimingModel::default()
        },
        ..SimConfig::default()
    })
    .await;
    blocking(move || {
        let mut stream = connect(&addr);
        let body = r#"{"model":"m","prompt":"hello","max_tokens":20,"stream":true}"#;
        let request = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: pod\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        let started = Instant::now();
        let answer = exchange(&mut stream, &request, |got| got.ends_with(b"0\r\n\r\n"));
        // 19 decode steps of 25 ms after the first token: well over the timeout.
        assert!(started.elapsed() >= timeout * 5, "the answer ran long");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("data: [DONE]"), "{answer}");
        // The idle clock starts when the answer ends, not when the connection opened.
        let ended = Instant::now();
        wait_closed(&mut stream);
        assert!(ended.elapsed() >= timeout - Duration::from_millis(10));
    })
    .await;
}

/// With no timeout the pod keeps an idle connection open: a request long after the first
/// (here: after a peer connection was closed by its own timeout) is answered on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_timeout_connections_stay_open() {
    let (_sim, addr, _f) = serve(SimConfig {
        keep_alive: None,
        ..SimConfig::default()
    })
    .await;
    let (_timed_sim, timed_addr, _g) = serve(SimConfig {
        keep_alive: Some(Duration::from_millis(200)),
        ..SimConfig::default()
    })
    .await;
    blocking(move || {
        let mut kept = connect(&addr);
        let mut timed = connect(&timed_addr);
        assert!(exchange(&mut kept, HEALTH, head_done).starts_with("HTTP/1.1 200"));
        assert!(exchange(&mut timed, HEALTH, head_done).starts_with("HTTP/1.1 200"));
        wait_closed(&mut timed);
        assert!(exchange(&mut kept, HEALTH, head_done).starts_with("HTTP/1.1 200"));
    })
    .await;
}
