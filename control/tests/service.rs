//! End-to-end: the service in-process against fake vLLM pods on loopback, plus the binary's
//! start-up contract. Every wait is a poll against a deadline, never a fixed sleep.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::get;
use axum::Router;
use pd_control::proto;

mod common;
use common::eventually;

use prost::Message;

fn vllm_text(model: &str, running: f64) -> String {
    format!(
        r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{model}"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{model}"}} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="{model}"}} 1000.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{model}"}} 10.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="{model}"}} 10.0
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="{model}"}} 2.0
"#
    )
}

/// A fake engine pod whose `/metrics` text the test can change.
struct FakeEngine {
    addr: SocketAddr,
    text: Arc<Mutex<String>>,
}

impl FakeEngine {
    async fn start(text: String) -> FakeEngine {
        let text = Arc::new(Mutex::new(text));
        let app = Router::new()
            .route(
                "/metrics",
                get(|State(t): State<Arc<Mutex<String>>>| async move { t.lock().unwrap().clone() }),
            )
            .with_state(text.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        FakeEngine { addr, text }
    }

    fn set(&self, text: String) {
        *self.text.lock().unwrap() = text;
    }
}

struct PodSpec<'a> {
    name: &'a str,
    model: &'a str,
    role: &'a str,
    /// `None`: the pod has no IP yet.
    port: Option<u16>,
}

/// A decode pod of model `m` that has no IP yet: a fleet pd-control can serve without
/// scraping anything.
fn pending() -> PodSpec<'static> {
    PodSpec {
        name: "pending",
        model: "m",
        role: "decode",
        port: None,
    }
}

/// A decode pod of model `m` served by `engine`.
fn decode_pod<'a>(name: &'a str, engine: &FakeEngine) -> PodSpec<'a> {
    PodSpec {
        name,
        model: "m",
        role: "decode",
        port: Some(engine.addr.port()),
    }
}

fn fleet_yaml(pods: &[PodSpec]) -> String {
    let mut out = String::from("apiVersion: v1\nkind: List\nitems:\n");
    for p in pods {
        let port = p.port.unwrap_or(8000);
        out.push_str(&format!(
            r#"- apiVersion: v1
  kind: Pod
  metadata:
    name: {name}
    namespace: test
    labels:
      model.aibrix.ai/name: {model}
      model.aibrix.ai/port: "{port}"
      role-name: {role}
      roleset-name: rs0
      role-replica-index: "0"
    annotations:
      model.aibrix.ai/config: '{{"defaultProfile":"pd"}}'
"#,
            name = p.name,
            model = p.model,
            role = p.role,
        ));
        match p.port {
            Some(_) => out.push_str(
                "  status:\n    podIP: 127.0.0.1\n    conditions:\n    - type: Ready\n      status: \"True\"\n",
            ),
            None => out.push_str("  status:\n    phase: Pending\n"),
        }
    }
    out
}

/// Replaces the file in one step, so the service never reads a half-written fleet.
fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A fresh directory with a fleet file holding `pods`.
fn fleet_dir(pods: &[PodSpec]) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.yaml");
    write_atomically(&path, &fleet_yaml(pods));
    (dir, path)
}

/// pd-control on the fleet file at `path` (default flags), and its base URL.
async fn start_on(path: &Path) -> (pd_control::Service, String) {
    let config = pd_control::Config::new(path, "127.0.0.1:0".parse().unwrap());
    let service = pd_control::start(config).await.unwrap();
    let base = format!("http://{}", service.local_addr());
    (service, base)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

struct Fetched {
    status: u16,
    version_header: Option<u64>,
    content_type: Option<String>,
    body: Vec<u8>,
}

async fn fetch(client: &reqwest::Client, url: &str) -> Fetched {
    let response = client.get(url).send().await.unwrap();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let version_header = header("x-pd-snapshot-version").and_then(|v| v.parse().ok());
    let content_type = header("content-type");
    let status = response.status().as_u16();
    let body = response.bytes().await.unwrap().to_vec();
    Fetched {
        status,
        version_header,
        content_type,
        body,
    }
}

async fn snapshot(client: &reqwest::Client, base: &str) -> proto::Snapshot {
    let f = fetch(client, &format!("{base}/v1/snapshot")).await;
    assert_eq!(f.status, 200);
    assert_eq!(f.content_type.as_deref(), Some("application/x-protobuf"));
    let snap = proto::Snapshot::decode(f.body.as_slice()).expect("snapshot decodes");
    assert_eq!(
        f.version_header,
        Some(snap.version),
        "header names the body's version"
    );
    snap
}

fn find<'a>(snap: &'a proto::Snapshot, name: &str) -> Option<&'a proto::Pod> {
    snap.models
        .iter()
        .flat_map(|m| &m.pods)
        .find(|p| p.name == name)
}

fn metrics_of(snap: &proto::Snapshot, name: &str) -> Option<proto::PodMetrics> {
    find(snap, name)
        .and_then(|p| p.metrics)
        .filter(|m| m.present)
}

/// The sample `name` (with its labels, as printed) from `/metrics`, if present.
async fn try_counter(client: &reqwest::Client, base: &str, name: &str) -> (Option<f64>, String) {
    let text = String::from_utf8(fetch(client, &format!("{base}/metrics")).await.body).unwrap();
    let value = text.lines().find_map(|l| {
        l.strip_prefix(name)
            .filter(|rest| rest.starts_with(' '))
            .and_then(|rest| rest.trim().parse().ok())
    });
    (value, text)
}

async fn counter(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    match try_counter(client, base, name).await {
        (Some(v), _) => v,
        (None, text) => panic!("{name} missing from /metrics:\n{text}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_scraped_fleet_and_follows_fleet_edits() {
    let prefill = FakeEngine::start(vllm_text("m", 3.0)).await;
    let decode = FakeEngine::start(vllm_text("m", 7.0)).await;
    let dir = tempfile::tempdir().unwrap();
    let fleet_path = dir.path().join("fleet.yaml");
    let p0 = PodSpec {
        name: "p0",
        model: "m",
        role: "prefill",
        port: Some(prefill.addr.port()),
    };
    let d0 = PodSpec {
        name: "d0",
        model: "m",
        role: "decode",
        port: Some(decode.addr.port()),
    };
    let x0 = PodSpec {
        name: "x0",
        model: "a-model",
        role: "decode",
        port: None,
    };
    write_atomically(&fleet_path, &fleet_yaml(&[p0, d0, x0]));

    let config = pd_control::Config::new(&fleet_path, "127.0.0.1:0".parse().unwrap());
    let service = pd_control::start(config).await.expect("service starts");
    let base = format!("http://{}", service.local_addr());
    let client = client();

    assert_eq!(fetch(&client, &format!("{base}/healthz")).await.body, b"ok");
    eventually("readiness", || async {
        (fetch(&client, &format!("{base}/readyz")).await.status == 200).then_some(())
    })
    .await;

    // Pods and metrics.
    let snap = eventually("both pods scraped", || async {
        let s = snapshot(&client, &base).await;
        (metrics_of(&s, "p0").is_some() && metrics_of(&s, "d0").is_some()).then_some(s)
    })
    .await;
    let models: Vec<_> = snap.models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(models, ["a-model", "m"], "models sorted by name");
    let pods: Vec<_> = snap.models[1]
        .pods
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(pods, ["p0", "d0"], "fleet order");
    let p = find(&snap, "p0").unwrap();
    assert_eq!((p.namespace.as_str(), p.ip.as_str()), ("test", "127.0.0.1"));
    assert_eq!(p.port, u32::from(prefill.addr.port()));
    assert_eq!(
        (
            p.role.as_str(),
            p.roleset.as_str(),
            p.role_replica_index.as_str()
        ),
        ("prefill", "rs0", "0")
    );
    assert_eq!(
        (p.engine.as_str(), p.config.as_str()),
        ("vllm", r#"{"defaultProfile":"pd"}"#)
    );
    assert!(p.ready && p.serves_http);
    assert_eq!(p.sglang_bootstrap_port, 8998);
    let m = metrics_of(&snap, "p0").unwrap();
    assert_eq!((m.running, m.waiting, m.kv_cache_usage), (3.0, 1.0, 0.25));
    assert!((m.ttft_avg_seconds - 0.2).abs() < 1e-9);
    assert!(m.last_scrape_unix_ms > 0);
    assert_eq!(metrics_of(&snap, "d0").unwrap().running, 7.0);
    let x = find(&snap, "x0").unwrap();
    assert!(!x.ready && x.ip.is_empty());
    assert!(
        x.metrics.as_ref().is_some_and(|m| !m.present),
        "unscraped pods carry empty metrics"
    );

    // The version the caller holds → 304 with the header and no body. Early scrape rounds may
    // still move the version (load, then rates, filled in), so retry until two requests land
    // on the same one. (Scrape timestamps alone never move it.)
    eventually("a 304 for the current version", || async {
        let s = snapshot(&client, &base).await;
        let f = fetch(
            &client,
            &format!("{base}/v1/snapshot?version={}", s.version),
        )
        .await;
        match f.status {
            304 => {
                assert_eq!(f.version_header, Some(s.version));
                assert!(f.body.is_empty());
                Some(())
            }
            200 => {
                assert!(f.version_header.unwrap() > s.version);
                None
            }
            other => panic!("unexpected status {other}"),
        }
    })
    .await;
    assert_eq!(
        fetch(&client, &format!("{base}/v1/snapshot?version=0"))
            .await
            .status,
        200
    );
    assert_eq!(
        fetch(&client, &format!("{base}/v1/snapshot?version=abc"))
            .await
            .status,
        400
    );

    // An engine's load changes → new version carrying it.
    let before = snapshot(&client, &base).await.version;
    decode.set(vllm_text("m", 9.0));
    eventually("the decode pod's new load", || async {
        let s = snapshot(&client, &base).await;
        (metrics_of(&s, "d0")?.running == 9.0).then_some(())
    })
    .await;

    // Remove d0 from the fleet file → a newer version without it.
    let p0 = PodSpec {
        name: "p0",
        model: "m",
        role: "prefill",
        port: Some(prefill.addr.port()),
    };
    let x0 = PodSpec {
        name: "x0",
        model: "a-model",
        role: "decode",
        port: None,
    };
    write_atomically(&fleet_path, &fleet_yaml(&[p0, x0]));
    let after_edit = eventually("d0 to leave the snapshot", || async {
        let s = snapshot(&client, &base).await;
        find(&s, "d0").is_none().then_some(s)
    })
    .await;
    assert!(after_edit.version > before);
    assert!(find(&after_edit, "p0").is_some());

    // A broken edit is rejected and counted; the fleet stays as it was.
    let errors_before = counter(&client, &base, "pd_control_fleet_reload_errors_total").await;
    write_atomically(&fleet_path, "apiVersion: v1\nkind: List\nitems: [\n");
    eventually("the broken edit to be rejected", || async {
        (counter(&client, &base, "pd_control_fleet_reload_errors_total").await > errors_before)
            .then_some(())
    })
    .await;
    let s = snapshot(&client, &base).await;
    assert!(find(&s, "p0").is_some() && find(&s, "x0").is_some() && find(&s, "d0").is_none());
    assert_eq!(fetch(&client, &format!("{base}/readyz")).await.status, 200);

    // JSON view and own metrics.
    let json = fetch(&client, &format!("{base}/v1/snapshot.json")).await;
    assert_eq!(json.status, 200);
    assert!(json.version_header.is_some());
    let v: serde_json::Value = serde_json::from_slice(&json.body).unwrap();
    let m_pods = &v["models"][1]["pods"];
    assert_eq!(m_pods[0]["name"], "p0");
    assert_eq!(m_pods[0]["metrics"]["present"], true);
    assert_eq!(m_pods[0]["metrics"]["running"], 3.0);
    assert_eq!(m_pods[0]["role"], "prefill");
    // The view keeps showing each round's scrape time while p0's figures, and so the version,
    // stand still (the protobuf a version names keeps the times of its build).
    let view = |f: Fetched| {
        let v: serde_json::Value = serde_json::from_slice(&f.body).unwrap();
        let scraped = v["models"][1]["pods"][0]["metrics"]["last_scrape_unix_ms"].as_i64();
        (f.version_header, scraped)
    };
    eventually("a newer scrape time under an unchanged version", || async {
        let (v1, t1) = view(fetch(&client, &format!("{base}/v1/snapshot.json")).await);
        let (v2, t2) = eventually("the next scrape round", || async {
            let later = view(fetch(&client, &format!("{base}/v1/snapshot.json")).await);
            (later.1 != t1).then_some(later)
        })
        .await;
        (v1 == v2 && t2 > t1).then_some(())
    })
    .await;
    let text = String::from_utf8(fetch(&client, &format!("{base}/metrics")).await.body).unwrap();
    for family in [
        // Each pod's annotation names a default profile but holds no profile: ignored whole.
        "pd_control_config_problem_pods 2",
        "pd_control_snapshot_version ",
        "pd_control_snapshot_age_seconds ",
        "pd_control_pods{model=\"m\",role=\"prefill\",state=\"ready\"} 1",
        "pd_control_pods{model=\"m\",role=\"prefill\",state=\"not_ready\"} 0",
        "pd_control_pods{model=\"a-model\",role=\"decode\",state=\"not_ready\"} 1",
        "pd_control_scrape_errors_total{namespace=\"test\",pod=\"p0\"} 0",
        "pd_control_scrape_latency_seconds_bucket{le=\"+Inf\"} ",
        "pd_control_scrape_duration_seconds ",
        "pd_control_fleet_reload_errors_total ",
        "pd_control_eds_write_errors_total ",
        "pd_control_fleet_event_age_seconds{source=\"file\"} ",
    ] {
        assert!(text.contains(family), "{family:?} missing from:\n{text}");
    }

    service.shutdown().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_fleet_keeps_its_version_and_dead_pods_go_stale() {
    // One pod without an IP (never scraped) and one whose metrics port refuses connections.
    let closed_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (_dir, fleet_path) = fleet_dir(&[pending()]);
    let (service, base) = start_on(&fleet_path).await;
    let client = client();
    let first = snapshot(&client, &base).await.version;

    eventually("readiness with nothing to scrape", || async {
        (fetch(&client, &format!("{base}/readyz")).await.status == 200).then_some(())
    })
    .await;
    let v = snapshot(&client, &base).await.version;
    assert_eq!(v, first, "nothing changed since start");
    let f = fetch(&client, &format!("{base}/v1/snapshot?version={v}")).await;
    assert_eq!(
        (f.status, f.version_header, f.body.len()),
        (304, Some(v), 0)
    );

    let dead = PodSpec {
        name: "dead",
        model: "m",
        role: "decode",
        port: Some(closed_port),
    };
    write_atomically(&fleet_path, &fleet_yaml(&[pending(), dead]));
    let dead_errors = "pd_control_scrape_errors_total{namespace=\"test\",pod=\"dead\"}";
    eventually("scrape errors for the dead pod", || async {
        (try_counter(&client, &base, dead_errors).await.0? > 0.0).then_some(())
    })
    .await;
    let s = snapshot(&client, &base).await;
    assert!(s.version > 1);
    let m = find(&s, "dead").and_then(|p| p.metrics).unwrap();
    assert!(!m.present && m.stale);

    // Errors are per pod: the pod without an IP is never scraped, so it has none.
    let pending_errors = "pd_control_scrape_errors_total{namespace=\"test\",pod=\"pending\"}";
    assert_eq!(counter(&client, &base, pending_errors).await, 0.0);
    // Each failed attempt was timed.
    assert!(counter(&client, &base, "pd_control_scrape_latency_seconds_count").await > 0.0);
    assert_eq!(
        counter(
            &client,
            &base,
            "pd_control_pods{model=\"m\",role=\"decode\",state=\"ready\"}"
        )
        .await
            + counter(
                &client,
                &base,
                "pd_control_pods{model=\"m\",role=\"decode\",state=\"not_ready\"}"
            )
            .await,
        2.0
    );
    // Ages are exported in seconds (their arithmetic is unit-tested in server.rs).
    let event_age = counter(
        &client,
        &base,
        "pd_control_fleet_event_age_seconds{source=\"file\"}",
    )
    .await;
    assert!((0.0..20.0).contains(&event_age), "{event_age}");
    let snapshot_age = counter(&client, &base, "pd_control_snapshot_age_seconds").await;
    assert!((0.0..20.0).contains(&snapshot_age), "{snapshot_age}");

    // The dead pod leaves: its error series goes with it.
    write_atomically(&fleet_path, &fleet_yaml(&[pending()]));
    eventually("the dead pod's error series to go", || async {
        let f = fetch(&client, &format!("{base}/metrics")).await;
        let text = String::from_utf8(f.body).unwrap();
        (!text.contains("pod=\"dead\"")).then_some(())
    })
    .await;

    service.shutdown().await.unwrap();
}

#[test]
fn binary_announces_its_address_and_rejects_a_bad_fleet() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let exe = env!("CARGO_BIN_EXE_pd-control");
    let dir = tempfile::tempdir().unwrap();

    let missing = dir.path().join("missing.yaml");
    let out = Command::new(exe)
        .args([
            "--fleet",
            missing.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot load the initial fleet"),
        "stderr: {stderr}"
    );

    let fleet = dir.path().join("fleet.yaml");
    write_atomically(&fleet, &fleet_yaml(&[pending()]));
    let mut child = Command::new(exe)
        .args([
            "--fleet",
            fleet.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--refresh-interval",
            "20ms",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let read = BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
    let addr = line
        .trim()
        .strip_prefix("pd-control: listening on ")
        .map(str::to_string);
    let reply = addr.as_deref().and_then(|a| {
        let mut stream = std::net::TcpStream::connect(a).ok()?;
        std::io::Write::write_all(&mut stream, b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
        let mut reply = String::new();
        std::io::Read::read_to_string(&mut stream, &mut reply).ok()?;
        Some(reply)
    });
    child.kill().unwrap();
    child.wait().unwrap();
    read.unwrap();
    assert!(addr.is_some(), "unexpected first line {line:?}");
    let reply = reply.expect("healthz reachable at the announced address");
    assert!(
        reply.starts_with("HTTP/1.") && reply.contains(" 200 ") && reply.ends_with("ok"),
        "{reply}"
    );
}

/// `--snapshot-token-file`: the snapshot, replica and limits routes want `authorization: Bearer
/// <token>`; health, readiness and metrics stay open; refusals are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_routes_require_the_token_when_one_is_configured() {
    let dir = tempfile::tempdir().unwrap();
    let fleet_path = dir.path().join("fleet.yaml");
    write_atomically(&fleet_path, &fleet_yaml(&[pending()]));
    let token_path = dir.path().join("token");
    std::fs::write(&token_path, "t0ken-Abc_123\n").unwrap();
    let mut config = pd_control::Config::new(&fleet_path, "127.0.0.1:0".parse().unwrap());
    config.snapshot_token_file = Some(token_path.clone());
    let service = pd_control::start(config).await.unwrap();
    let base = format!("http://{}", service.local_addr());
    let client = client();

    let call = |method: reqwest::Method, path: &str, auth: Option<&str>| {
        let mut r = client.request(method, format!("{base}{path}"));
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        async move {
            let resp = r.send().await.unwrap();
            let status = resp.status().as_u16();
            let challenge = resp
                .headers()
                .get("www-authenticate")
                .map(|v| v.to_str().unwrap().to_string());
            (status, challenge, resp.bytes().await.unwrap())
        }
    };
    let guarded = [
        (reqwest::Method::GET, "/v1/snapshot"),
        (reqwest::Method::GET, "/v1/snapshot?version=0"),
        (reqwest::Method::GET, "/v1/snapshot.json"),
        (reqwest::Method::POST, "/v1/replicas/report"),
        (reqwest::Method::POST, "/v1/limits/admit"),
        (reqwest::Method::POST, "/v1/limits/cancel"),
        (reqwest::Method::POST, "/v1/limits/usage"),
        (reqwest::Method::POST, "/v1/limits/release"),
    ];
    let mut refused = 0.0;
    for (method, path) in &guarded {
        for auth in [
            None,
            Some("Bearer wrong"),
            Some("Bearer t0ken-Abc_12"),
            Some("Bearer t0ken-Abc_1234"),
            Some("bearer t0ken-Abc_123"),
            Some("t0ken-Abc_123"),
        ] {
            let (status, challenge, body) = call(method.clone(), path, auth).await;
            assert_eq!(status, 401, "{method} {path} with {auth:?}");
            assert_eq!(challenge.as_deref(), Some("Bearer"));
            assert!(
                !body.windows(7).any(|w| w == b"pending"),
                "a refusal leaks nothing of the fleet"
            );
            refused += 1.0;
        }
    }
    let (status, _, body) = call(
        reqwest::Method::GET,
        "/v1/snapshot",
        Some("Bearer t0ken-Abc_123"),
    )
    .await;
    assert_eq!(status, 200);
    let snap = proto::Snapshot::decode(body).unwrap();
    assert!(find(&snap, "pending").is_some());
    let (status, _, _) = call(
        reqwest::Method::GET,
        "/v1/snapshot.json",
        Some("Bearer t0ken-Abc_123"),
    )
    .await;
    assert_eq!(status, 200);
    // An empty report with the token reaches the handler (which accepts or refuses the
    // body on its own terms), not the 401.
    let (status, _, _) = call(
        reqwest::Method::POST,
        "/v1/replicas/report",
        Some("Bearer t0ken-Abc_123"),
    )
    .await;
    assert_ne!(status, 401);
    // The limits routes too (limits are off here: no --redis).
    let (status, _, body) = call(
        reqwest::Method::POST,
        "/v1/limits/admit",
        Some("Bearer t0ken-Abc_123"),
    )
    .await;
    assert_eq!(status, 400, "an empty user name reaches the handler");
    assert!(!body.is_empty());
    for open in ["/healthz", "/readyz", "/metrics"] {
        let (status, _, _) = call(reqwest::Method::GET, open, None).await;
        assert_ne!(status, 401, "{open} stays open");
    }
    assert_eq!(
        counter(&client, &base, "pd_control_unauthorized_requests_total").await,
        refused
    );

    // A token file that is empty, or absent, stops the service from starting.
    std::fs::write(&token_path, "  \n").unwrap();
    let mut config = pd_control::Config::new(&fleet_path, "127.0.0.1:0".parse().unwrap());
    config.snapshot_token_file = Some(token_path.clone());
    let err = pd_control::start(config)
        .await
        .err()
        .expect("an empty token is refused");
    assert!(err.to_string().contains("is empty"), "{err}");
    let mut config = pd_control::Config::new(&fleet_path, "127.0.0.1:0".parse().unwrap());
    config.snapshot_token_file = Some(dir.path().join("absent"));
    let err = pd_control::start(config)
        .await
        .err()
        .expect("a missing file is refused");
    assert!(
        err.to_string()
            .contains("cannot read the snapshot token file"),
        "{err}"
    );
}

/// Sends a poll for version `v` that may wait up to a minute (the server cuts it to 30 s) and
/// returns once pd-control holds it.
async fn held_poll(
    client: &reqwest::Client,
    base: &str,
    v: u64,
) -> tokio::task::JoinHandle<Fetched> {
    let url = format!("{base}/v1/snapshot?version={v}&wait_ms=60000");
    let held = tokio::spawn({
        let client = client.clone();
        async move { fetch(&client, &url).await }
    });
    eventually("the poll to be held", || async {
        (counter(client, base, "pd_control_snapshot_polls_waiting").await == 1.0).then_some(())
    })
    .await;
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_poll_answers_as_soon_as_a_newer_snapshot_is_published() {
    let (_dir, fleet_path) = fleet_dir(&[pending()]);
    let (service, base) = start_on(&fleet_path).await;
    let client = client();
    let v = snapshot(&client, &base).await.version;

    // Nothing changes: a short wait ends in a 304 for the held version.
    let f = fetch(
        &client,
        &format!("{base}/v1/snapshot?version={v}&wait_ms=50"),
    )
    .await;
    assert_eq!((f.status, f.version_header), (304, Some(v)));

    // A poll held for up to 30 s (the server's cap) while the fleet changes: it must come
    // back with the new snapshot, not a 304 half a minute later.
    let held = held_poll(&client, &base, v).await;
    let other = PodSpec {
        name: "other",
        model: "m",
        role: "prefill",
        port: None,
    };
    write_atomically(&fleet_path, &fleet_yaml(&[pending(), other]));
    let f = held.await.unwrap();
    assert_eq!(f.status, 200, "the held poll ends with the new snapshot");
    let snap = proto::Snapshot::decode(f.body.as_slice()).unwrap();
    assert!(snap.version > v && find(&snap, "other").is_some());
    assert_eq!(f.version_header, Some(snap.version));
    assert_eq!(
        counter(&client, &base, "pd_control_snapshot_polls_waiting").await,
        0.0
    );
    assert!(
        counter(
            &client,
            &base,
            "pd_control_snapshot_polls_total{answer=\"not_modified\"}"
        )
        .await
            >= 1.0
    );
    assert_eq!(
        fetch(&client, &format!("{base}/v1/snapshot?version=1&wait_ms=-5"))
            .await
            .status,
        400
    );

    // A poll held at shutdown does not hold the shutdown: it is answered (304) at once.
    let v = snap.version;
    let held = held_poll(&client, &base, v).await;
    // Bounded well below the server's 30 s cap on the wait, which a hung shutdown would reach.
    tokio::time::timeout(std::time::Duration::from_secs(20), service.shutdown())
        .await
        .expect("the held poll does not hold the shutdown")
        .expect("clean shutdown");
    let f = held.await.unwrap();
    assert_eq!((f.status, f.version_header), (304, Some(v)));
}

/// The `ip:port` entries of the endpoint file pd-control writes with `--eds-file`.
fn endpoints_listed(path: &Path) -> Vec<String> {
    let (cluster, endpoints) = pd_control::eds::read_listing(path).expect("an endpoint listing");
    assert_eq!(cluster, "pd_pods_retry");
    endpoints
}

/// With `--eds-file`, the file lists every pod with an address before pd-control serves
/// anything, snapshots say the file is written, and a pod added to the fleet is listed once a
/// snapshot names it (the service writes the file before it publishes that snapshot; the
/// moments between are too short for a test to observe). Without the flag, snapshots say
/// there is none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_file_lists_a_pod_before_a_snapshot_names_it() {
    let (engine_a, engine_b) = (
        FakeEngine::start(vllm_text("m", 0.0)).await,
        FakeEngine::start(vllm_text("m", 0.0)).await,
    );
    let pod = decode_pod;
    let (dir, path) = fleet_dir(&[pod("a", &engine_a), pending()]);
    let eds = dir.path().join("pd-pods.json");
    let mut config = pd_control::Config::new(&path, "127.0.0.1:0".parse().unwrap());
    config.eds_file = Some(eds.clone());
    let service = pd_control::start(config).await.unwrap();
    let base = format!("http://{}", service.local_addr());
    let a = format!("127.0.0.1:{}", engine_a.addr.port());
    let b = format!("127.0.0.1:{}", engine_b.addr.port());
    assert_eq!(
        endpoints_listed(&eds),
        vec![a.clone()],
        "the pod without an IP is left out"
    );
    let client = client();
    assert!(snapshot(&client, &base).await.eds);

    write_atomically(
        &path,
        &fleet_yaml(&[pod("a", &engine_a), pod("b", &engine_b), pending()]),
    );
    eventually("a snapshot naming b", || async {
        find(&snapshot(&client, &base).await, "b").map(|_| ())
    })
    .await;
    let mut listed = endpoints_listed(&eds);
    listed.sort();
    let mut want = vec![a, b];
    want.sort();
    assert_eq!(listed, want);
    assert_eq!(
        counter(&client, &base, "pd_control_eds_write_errors_total").await,
        0.0
    );
    service.shutdown().await.expect("clean shutdown");

    let (without, base) = start_on(&path).await;
    assert!(!snapshot(&client, &base).await.eds);
    without.shutdown().await.expect("clean shutdown");
}

/// `--metrics-listen`: health, readiness and metrics on a port of their own, and nothing else
/// there (what a NetworkPolicy admits Prometheus to); the main listener keeps serving them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_listener_serves_health_and_metrics_and_no_api() {
    let dir = tempfile::tempdir().unwrap();
    let fleet_path = dir.path().join("fleet.yaml");
    write_atomically(&fleet_path, &fleet_yaml(&[pending()]));
    let mut config = pd_control::Config::new(&fleet_path, "127.0.0.1:0".parse().unwrap());
    config.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let service = pd_control::start(config).await.unwrap();
    let metrics_addr = service.metrics_addr().expect("bound");
    assert_ne!(metrics_addr, service.local_addr());
    let metrics = format!("http://{metrics_addr}");
    let main = format!("http://{}", service.local_addr());
    let client = client();
    for path in ["/healthz", "/readyz", "/metrics"] {
        let f = fetch(&client, &format!("{metrics}{path}")).await;
        assert_eq!(f.status, 200, "{path} on the metrics listener");
        assert_eq!(
            fetch(&client, &format!("{main}{path}")).await.status,
            200,
            "{path} on the main one"
        );
    }
    let f = fetch(&client, &format!("{metrics}/metrics")).await;
    assert!(String::from_utf8_lossy(&f.body).contains("pd_control_snapshot_version"));
    for path in ["/v1/snapshot", "/v1/snapshot.json"] {
        assert_eq!(
            fetch(&client, &format!("{metrics}{path}")).await.status,
            404,
            "{path}"
        );
    }
    for path in [
        "/v1/limits/admit",
        "/v1/limits/cancel",
        "/v1/limits/usage",
        "/v1/limits/release",
        "/v1/replicas/report",
        "/v1/route/external",
    ] {
        let status = client
            .post(format!("{metrics}{path}"))
            .body("{}")
            .send()
            .await
            .unwrap()
            .status()
            .as_u16();
        assert_eq!(status, 404, "{path}");
    }
    assert_eq!(
        fetch(&client, &format!("{main}/v1/snapshot")).await.status,
        200
    );
}

/// The body of `/readyz` when it answers 503, `None` while it answers 200.
async fn unready(client: &reqwest::Client, base: &str) -> Option<String> {
    let f = fetch(client, &format!("{base}/readyz")).await;
    match f.status {
        200 => None,
        503 => Some(String::from_utf8_lossy(&f.body).into_owned()),
        other => panic!("/readyz answered {other}"),
    }
}

/// A named pipe where pd-control writes the endpoint file first (`<file>.tmp`, renamed over
/// the file): opening it for writing blocks until a reader opens it, as a write to a hung disk
/// blocks. [`HungDisk::release`] lets the blocked write go on (it fails: a pipe has no
/// `fsync`) and removes the pipe, so the next write lands; so does dropping it, so a failed
/// assertion does not leave a blocked thread that the runtime's shutdown would wait for.
#[cfg(target_os = "linux")]
struct HungDisk(std::path::PathBuf);

#[cfg(target_os = "linux")]
impl HungDisk {
    fn new(endpoint_file: &Path) -> HungDisk {
        let mut pipe = endpoint_file.as_os_str().to_owned();
        pipe.push(".tmp");
        let pipe = std::path::PathBuf::from(pipe);
        let made = std::process::Command::new("mkfifo")
            .arg(&pipe)
            .status()
            .expect("mkfifo runs");
        assert!(made.success(), "mkfifo {}", pipe.display());
        HungDisk(pipe)
    }

    fn release(&self) {
        if !self.0.exists() {
            return;
        }
        // Read and write: on Linux that open never blocks, and it counts as the reader the
        // blocked writer waits for.
        let reader = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.0)
            .expect("open the pipe");
        std::fs::remove_file(&self.0).expect("remove the pipe");
        drop(reader);
    }
}

#[cfg(target_os = "linux")]
impl Drop for HungDisk {
    fn drop(&mut self) {
        self.release();
    }
}

/// A control loop stuck in the endpoint file's write (a hung disk) builds no snapshot: within
/// `max(10 × --refresh-interval, 5 s)` `/readyz` says so, and a poll for the version the
/// gateway holds is answered 503 instead of "not modified", so the gateway's staleness bound
/// runs out instead of being reset by every poll. Both recover once the write ends.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_loop_hung_on_the_endpoint_file_fails_readiness_and_polls_until_it_ends() {
    use std::time::{Duration, Instant};

    let (engine_a, engine_b) = (
        FakeEngine::start(vllm_text("m", 0.0)).await,
        FakeEngine::start(vllm_text("m", 0.0)).await,
    );
    let pod = decode_pod;
    let (dir, path) = fleet_dir(&[pod("a", &engine_a)]);
    let eds = dir.path().join("pd-pods.json");
    let mut config = pd_control::Config::new(&path, "127.0.0.1:0".parse().unwrap());
    config.eds_file = Some(eds.clone());
    let bound = pd_control::service::loop_stale_after(config.refresh_interval);
    let service = pd_control::start(config).await.unwrap();
    let base = format!("http://{}", service.local_addr());
    let client = client();
    eventually("ready", || async {
        unready(&client, &base).await.is_none().then_some(())
    })
    .await;
    let v = snapshot(&client, &base).await.version;
    let poll = format!("{base}/v1/snapshot?version={v}");
    assert_eq!(fetch(&client, &poll).await.status, 304);

    // The next change of the endpoint set hangs in the write.
    let disk = HungDisk::new(&eds);
    write_atomically(
        &path,
        &fleet_yaml(&[pod("a", &engine_a), pod("b", &engine_b)]),
    );
    let hung = Instant::now();
    let why = eventually("/readyz to fail", || async {
        unready(&client, &base).await
    })
    .await;
    assert!(
        hung.elapsed() < bound + Duration::from_secs(5),
        "noticed after {:?} (bound {bound:?})",
        hung.elapsed()
    );
    assert!(why.contains("control loop"), "{why}");
    assert_eq!(fetch(&client, &format!("{base}/healthz")).await.status, 200);
    let f = fetch(&client, &poll).await;
    assert_eq!((f.status, f.version_header), (503, Some(v)), "no 304 now");
    assert!(String::from_utf8_lossy(&f.body).contains("control loop"));
    // Nothing was built meanwhile; a gateway without the version still gets it.
    assert_eq!(snapshot(&client, &base).await.version, v);
    assert!(counter(&client, &base, "pd_control_loop_age_seconds").await > bound.as_secs_f64());
    assert!(
        counter(
            &client,
            &base,
            "pd_control_snapshot_polls_total{answer=\"frozen\"}"
        )
        .await
            >= 1.0
    );

    // The write ends (failing); the loop turns again and retries it.
    disk.release();
    eventually("/readyz to recover", || async {
        unready(&client, &base).await.is_none().then_some(())
    })
    .await;
    eventually("b listed in the endpoint file", || async {
        let listed = endpoints_listed(&eds);
        (listed.len() == 2).then_some(())
    })
    .await;
    assert!(counter(&client, &base, "pd_control_eds_write_errors_total").await >= 1.0);
    assert!(counter(&client, &base, "pd_control_loop_age_seconds").await < bound.as_secs_f64());
    let v = snapshot(&client, &base).await.version;
    let f = fetch(&client, &format!("{base}/v1/snapshot?version={v}")).await;
    assert_eq!(f.status, 304, "not modified again");
    service.shutdown().await.expect("clean shutdown");
}

/// A fleet source that hands out an empty fleet, then ends when `end` is notified: by a
/// panic, or by returning.
struct EndingSource {
    end: Arc<tokio::sync::Notify>,
    panics: bool,
}

impl pd_control::sources::FleetSource for EndingSource {
    fn describe(&self) -> String {
        "a source that ends".into()
    }

    async fn load(
        &mut self,
    ) -> Result<Vec<pd_control::fleet::PodRecord>, pd_control::sources::SourceError> {
        Ok(Vec::new())
    }

    async fn watch(
        self,
        _publisher: pd_control::sources::FleetPublisher,
        _shutdown: pd_control::sources::Shutdown,
    ) {
        self.end.notified().await;
        if self.panics {
            panic!("the fleet source fails");
        }
    }
}

/// Nothing restarts a fleet source that ended: `/readyz` fails from then on (while the
/// service is not shutting down). Its pods' metrics stay current, so snapshot polls still get
/// "not modified".
async fn an_ended_fleet_source_fails_readiness(panics: bool) {
    let end = Arc::new(tokio::sync::Notify::new());
    let source = EndingSource {
        end: end.clone(),
        panics,
    };
    let config = pd_control::Config::new("unused", "127.0.0.1:0".parse().unwrap());
    let mut service = pd_control::start_with_source(config, source).await.unwrap();
    let base = format!("http://{}", service.local_addr());
    let client = client();
    eventually("ready", || async {
        unready(&client, &base).await.is_none().then_some(())
    })
    .await;

    // The binary waits on `stopped()` to exit non-zero, so its supervisor starts it afresh:
    // it must wake when the source ends while it waits.
    let (stopped, ()) = tokio::join!(
        tokio::time::timeout(std::time::Duration::from_secs(20), service.stopped()),
        async { end.notify_one() },
    );
    let stopped = stopped.expect("stopped() resolves once the fleet source ended");
    let error = stopped
        .expect_err("an ended fleet source is an error")
        .to_string();
    assert!(error.contains("fleet source ended"), "{error}");
    let why = eventually("/readyz to fail", || async {
        unready(&client, &base).await
    })
    .await;
    assert!(why.contains("fleet source"), "{why}");
    assert_eq!(fetch(&client, &format!("{base}/healthz")).await.status, 200);
    let v = snapshot(&client, &base).await.version;
    let f = fetch(&client, &format!("{base}/v1/snapshot?version={v}")).await;
    assert_eq!(f.status, 304, "the control loop still runs");
    let stopped = service.shutdown().await;
    assert_eq!(
        stopped.is_err(),
        panics,
        "a panic surfaces at shutdown: {stopped:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_source_that_panics_fails_readiness() {
    an_ended_fleet_source_fails_readiness(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_source_that_returns_fails_readiness() {
    an_ended_fleet_source_fails_readiness(false).await;
}

/// Writes `partial` (a request cut short, or nothing) on a new connection to `addr` and reads
/// until the server closes it, failing after `deadline`: how long the server kept it open.
async fn closed_after(
    addr: SocketAddr,
    partial: &[u8],
    deadline: std::time::Duration,
) -> std::time::Duration {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let start = std::time::Instant::now();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(partial).await.unwrap();
    let mut rest = Vec::new();
    match tokio::time::timeout(deadline, conn.read_to_end(&mut rest)).await {
        // Closed, with or without a word (a reset counts too).
        Ok(_) => start.elapsed(),
        Err(_) => panic!("{addr} kept a connection sending {partial:?} open for {deadline:?}"),
    }
}

/// A config on the fleet at `path` whose HTTP listeners time out headers after `timeout`.
fn config_with_header_timeout(path: &Path, timeout: std::time::Duration) -> pd_control::Config {
    let mut config = pd_control::Config::new(path, "127.0.0.1:0".parse().unwrap());
    config.http_limits.header_read_timeout = timeout;
    config
}

/// A connection that never completes its request's headers (slowloris: the request line,
/// then nothing) is closed after the header timeout, on the main listener and the metrics
/// one; the service keeps answering on new connections meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_finishes_its_headers_is_closed() {
    let (_dir, fleet_path) = fleet_dir(&[pending()]);
    let timeout = std::time::Duration::from_secs(1);
    let mut config = config_with_header_timeout(&fleet_path, timeout);
    config.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let service = pd_control::start(config).await.unwrap();
    let client = client();
    for addr in [service.local_addr(), service.metrics_addr().unwrap()] {
        let stalled = tokio::spawn(closed_after(
            addr,
            b"GET /healthz HTTP/1.1\r\n",
            std::time::Duration::from_secs(10),
        ));
        // One that sends nothing at all is closed too.
        let silent = tokio::spawn(closed_after(addr, b"", std::time::Duration::from_secs(10)));
        let f = fetch(&client, &format!("http://{addr}/healthz")).await;
        assert_eq!(f.status, 200, "a new connection is served meanwhile");
        for held in [stalled.await.unwrap(), silent.await.unwrap()] {
            assert!(
                held >= timeout - std::time::Duration::from_millis(50),
                "{held:?}"
            );
        }
    }
    service.shutdown().await.unwrap();
}

/// The header timeout counts only until a request is read: a snapshot poll held longer than
/// it is answered as usual, and its connection serves the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_held_past_the_header_timeout_is_answered() {
    let (_dir, fleet_path) = fleet_dir(&[pending()]);
    let timeout = std::time::Duration::from_secs(1);
    let config = config_with_header_timeout(&fleet_path, timeout);
    let service = pd_control::start(config).await.unwrap();
    let base = format!("http://{}", service.local_addr());
    let client = client();
    let v = snapshot(&client, &base).await.version;
    let start = std::time::Instant::now();
    let f = fetch(
        &client,
        &format!("{base}/v1/snapshot?version={v}&wait_ms=2500"),
    )
    .await;
    assert_eq!((f.status, f.version_header), (304, Some(v)));
    assert!(start.elapsed() > 2 * timeout, "held for its wait");
    assert_eq!(snapshot(&client, &base).await.version, v);
    service.shutdown().await.unwrap();
}

/// Past the connection cap, a new connection is closed at once; once one closes, new ones are
/// served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_are_closed_at_once() {
    let (_dir, fleet_path) = fleet_dir(&[pending()]);
    // Long enough that only the cap can close the second connection within the deadline.
    let mut config = config_with_header_timeout(&fleet_path, std::time::Duration::from_secs(60));
    config.http_limits.max_connections = 1;
    let service = pd_control::start(config).await.unwrap();
    let addr = service.local_addr();
    // Accepted first (the listener takes connections in order), it holds the one slot.
    let first = tokio::net::TcpStream::connect(addr).await.unwrap();
    closed_after(addr, b"", std::time::Duration::from_secs(10)).await;
    drop(first);
    let client = client();
    eventually(
        "a new connection to be served once the slot is free",
        || async {
            let r = client.get(format!("http://{addr}/healthz")).send().await;
            r.ok().filter(|r| r.status() == 200).map(|_| ())
        },
    )
    .await;
    service.shutdown().await.unwrap();
}

/// `x-pd-report-id` goes into Redis keys separated by `:`: only the filter's alphabet
/// (`<hex>-<n>`) is taken, anything else is refused rather than ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_id_outside_letters_digits_and_dashes_is_refused() {
    let (_dir, fleet_path) = fleet_dir(&[pending()]);
    let (service, base) = start_on(&fleet_path).await;
    let client = client();
    let long = "a".repeat(129);
    for (id, status) in [
        ("1f3a-7", 204),
        ("a:b", 400),
        ("a b", 400),
        ("a{b}", 400),
        ("", 400),
        (long.as_str(), 400),
    ] {
        let answer = client
            .post(format!("{base}/v1/limits/usage"))
            .header("x-pd-report-id", id)
            .body(r#"{"alice": 5}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status().as_u16(), status, "{id:?}");
    }
    service.shutdown().await.unwrap();
}
