//! Hostile and malformed input, table-driven, through the real `.wasm` in real Envoy
//! (`--concurrency 2`): each input gets its exact status, `x-error-*` header and OpenAI error
//! type, no input reaches a pod it should not, nothing panics the filter, and the gateway
//! keeps serving afterwards with every ledger gauge back at 0.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use pd_wasm_tests::http;
use pd_wasm_tests::stack::{eventually, Fleet, Options, Stack};
use serde_json::{json, Value};

const MODEL: &str = "hostile-llm";
const LOCKED: &str = "locked-llm";

/// What one input must produce.
struct Case {
    name: &'static str,
    path: &'static str,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    status: u16,
    /// `(header, value)` the answer must carry; `None` value means present with any value.
    header: Option<(&'static str, Option<&'static str>)>,
    /// The OpenAI `error.type` of a refusal, or `None` for a success.
    error_type: Option<&'static str>,
}

fn case(name: &'static str, body: impl Into<Vec<u8>>, status: u16) -> Case {
    Case {
        name,
        path: "/v1/completions",
        headers: vec![("routing-strategy", "pd".to_string())],
        body: body.into(),
        status,
        header: None,
        error_type: None,
    }
}

impl Case {
    fn chat(mut self) -> Case {
        self.path = "/v1/chat/completions";
        self
    }
    fn path(mut self, path: &'static str) -> Case {
        self.path = path;
        self
    }
    fn header(mut self, name: &'static str, value: impl Into<String>) -> Case {
        self.headers.retain(|(k, _)| *k != name);
        self.headers.push((name, value.into()));
        self
    }
    fn expect_header(mut self, name: &'static str, value: Option<&'static str>) -> Case {
        self.header = Some((name, value));
        self
    }
    fn error(mut self, kind: &'static str) -> Case {
        self.error_type = Some(kind);
        self
    }
}

fn ok(prompt: &str) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 2})
}

/// A completion body of `n` top-level members: `model`, `prompt`, `max_tokens` and tiny
/// ones (`"k12":0`) up to `n`.
fn members(n: usize) -> String {
    let mut raw = format!(r#"{{"model":"{MODEL}","prompt":"x","max_tokens":2"#);
    for i in 0..n.saturating_sub(3) {
        raw.push_str(&format!(r#","k{i}":0"#));
    }
    raw.push('}');
    raw
}

fn nested(depth: usize) -> String {
    format!(
        r#"{{"model":"{MODEL}","prompt":"x","extra":{}{}}}"#,
        "[".repeat(depth),
        "]".repeat(depth)
    )
}

/// A listener on a loopback port of no pod: the inputs that name a destination name it, and
/// it counts every connection made to it. Each is closed at once, so a request sent there
/// fails at once rather than hangs.
struct Canary {
    addr: String,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Canary {
    fn start() -> Canary {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the canary");
        let addr = listener.local_addr().expect("canary address").to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (accepted_t, stop_t) = (accepted.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop_t.load(Ordering::SeqCst) {
                    break;
                }
                if conn.is_ok() {
                    accepted_t.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        Canary {
            addr,
            accepted,
            stop,
            thread: Some(thread),
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(&self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The table; `canary` is the address the destination-header inputs name.
fn cases(canary: &str) -> Vec<Case> {
    let bad = "x-error-request-body-processing";
    let routing = "x-error-routing";
    let no_backend = "x-error-no-model-backends";
    let invalid = "invalid_request_error";
    vec![
        case("invalid JSON", "{", 400)
            .expect_header(bad, Some("true"))
            .error(invalid),
        case("empty body", "", 400).expect_header(bad, Some("true")),
        case("a JSON array", "[]", 400)
            .expect_header(bad, Some("true"))
            .error(invalid),
        case("a JSON string", "\"hi\"", 400)
            .expect_header(bad, Some("true"))
            .error(invalid),
        case(
            "model is a number",
            json!({"model": 5, "prompt": "x"}).to_string(),
            400,
        )
        .expect_header(bad, Some("true"))
        .error(invalid),
        case("model missing", json!({"prompt": "x"}).to_string(), 400)
            .expect_header(no_backend, None)
            .error(invalid),
        case(
            "model empty",
            json!({"model": "", "prompt": "x"}).to_string(),
            400,
        )
        .expect_header(no_backend, None)
        .error(invalid),
        case(
            "unknown model",
            json!({"model": "nope", "prompt": "x"}).to_string(),
            400,
        )
        .expect_header(no_backend, Some("nope"))
        .error(invalid),
        case(
            "model with CR/LF cannot inject a header",
            json!({"model": "m\r\nx-injected: 1", "prompt": "x"}).to_string(),
            400,
        )
        .expect_header(no_backend, None)
        .error(invalid),
        case(
            "model of 10 KB",
            json!({"model": "m".repeat(10_000), "prompt": "x"}).to_string(),
            400,
        )
        .expect_header(no_backend, None)
        .error(invalid),
        case(
            "model with a NUL",
            json!({"model": "a\u{0}b", "prompt": "x"}).to_string(),
            400,
        )
        .expect_header(no_backend, None)
        .error(invalid),
        case("prompt missing", json!({"model": MODEL}).to_string(), 400)
            .expect_header(bad, Some("true"))
            .error(invalid),
        case(
            "prompt is a number",
            json!({"model": MODEL, "prompt": 7}).to_string(),
            400,
        )
        .expect_header(bad, Some("true"))
        .error(invalid),
        case(
            "stream is a string",
            json!({"model": MODEL, "prompt": "x", "stream": "yes"}).to_string(),
            400,
        )
        .expect_header(bad, Some("true"))
        .error(invalid),
        case(
            "max_tokens is a string (the engine judges it)",
            json!({"model": MODEL, "prompt": "x", "max_tokens": "ten"}).to_string(),
            400,
        ),
        case(
            "max_tokens is huge (the engine judges it)",
            r#"{"model":"hostile-llm","prompt":"x","max_tokens":1e30}"#,
            400,
        ),
        case(
            "a 63-bit seed passes through exactly",
            r#"{"model":"hostile-llm","prompt":"x","max_tokens":2,"seed":9223372036854775807}"#,
            200,
        ),
        case(
            "duplicated keys: the last one wins, as in the engine",
            r#"{"model":"nope","model":"hostile-llm","prompt":"x","max_tokens":2}"#,
            200,
        ),
        case("nesting 100 deep is fine", nested(100), 200),
        // The router splices members it does not read without parsing into them, so how
        // deep they nest is the engine's call (pd-sim, like vLLM, refuses this one).
        case(
            "nesting 10000 deep in a member the router does not read: the engine refuses it",
            nested(10_000),
            400,
        ),
        case(
            "chat content nested 10000 deep is refused by the router, not a crash",
            format!(
                r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":{}{}}}]}}"#,
                "[".repeat(10_000),
                "]".repeat(10_000)
            ),
            400,
        )
        .path("/v1/chat/completions")
        .expect_header(bad, Some("true"))
        .error(invalid),
        case(
            "non-UTF-8 body",
            b"{\"model\":\"\xff\xfe\",\"prompt\":\"x\"}".to_vec(),
            400,
        )
        .expect_header(bad, Some("true"))
        .error(invalid),
        case(
            "gzip body",
            b"\x1f\x8b\x08\x00\x00\x00\x00\x00".to_vec(),
            400,
        )
        .header("content-encoding", "gzip")
        .expect_header(bad, Some("true")),
        case("query string on the path", ok("x").to_string(), 501)
            .path("/v1/completions?debug=1")
            .expect_header(bad, Some("true")),
        case("unknown path", ok("x").to_string(), 501)
            .path("/v1/embeddings")
            .expect_header(bad, Some("true")),
        case("unknown routing strategy", ok("x").to_string(), 400)
            .header("routing-strategy", "teleport")
            .expect_header(routing, Some("true"))
            .error(invalid),
        case(
            "unknown profile falls back to the default",
            ok("x").to_string(),
            200,
        )
        .header("config-profile", "no-such-profile"),
        case(
            "empty profile falls back to the default",
            ok("x").to_string(),
            200,
        )
        .header("config-profile", ""),
        case(
            "an over-long session key is ignored",
            ok("x").to_string(),
            200,
        )
        .header("x-aibrix-session-key", "k".repeat(300)),
        // Every header that names an upstream to Envoy (the pods cluster's `target-pod`,
        // ORIGINAL_DST's own, the retrying route's list) and one that looks like it.
        case(
            "client destination headers are stripped",
            ok("x").to_string(),
            200,
        )
        .header("x-envoy-original-dst-host", canary)
        .header("target-pod", canary)
        .header("x-pd-destinations", canary)
        .header("x-pd-dst", canary),
        case(
            "a locked strategy ignores the routing-strategy header",
            json!({"model": LOCKED, "prompt": "x", "max_tokens": 2}).to_string(),
            200,
        )
        .header("routing-strategy", "random")
        .expect_header("prefill-target-pod", Some("lp0")),
        case(
            "chat: messages empty",
            json!({"model": MODEL, "messages": []}).to_string(),
            400,
        )
        .chat()
        .expect_header(bad, Some("true"))
        .error(invalid),
        case(
            "chat: messages not an array",
            json!({"model": MODEL, "messages": "hi"}).to_string(),
            400,
        )
        .chat()
        .expect_header(bad, Some("true"))
        .error(invalid),
        case(
            "chat: a message that is not an object",
            json!({"model": MODEL, "messages": ["hi"]}).to_string(),
            400,
        )
        .chat()
        .expect_header(bad, Some("true"))
        .error(invalid),
        case(
            "chat: content parts are fine",
            json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user",
                "content": [{"type": "text", "text": "hi"}]}]})
            .to_string(),
            200,
        )
        .chat(),
        // Each top-level member is an index entry a PD request keeps while its prefill runs.
        case("1 024 top-level members are routed", members(1024), 200),
        case("1 025 top-level members are refused", members(1025), 400)
            .expect_header(bad, Some("true"))
            .error(invalid),
        case(
            "a 2 MB prompt is routed",
            ok(&"long ".repeat(400_000)).to_string(),
            200,
        ),
        // Envoy's own 413 passes the filter's answer path, which gives it an OpenAI body and
        // the header of the filter's own refusal.
        case(
            "a body over the 8 MiB buffer limit is refused by Envoy",
            ok(&"x".repeat(9 << 20)).to_string(),
            413,
        )
        .expect_header("x-error-request-body-processing", Some("true"))
        .error("api_error"),
    ]
}

#[test]
fn hostile_inputs_get_their_exact_answers_and_break_nothing() {
    let locked =
        r#"{"lockedRoutingStrategy":"pd","profiles":{"default":{"routingStrategy":"pd"}}}"#;
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0")
        .pod("lp0", "prefill", "lg0")
        .of_model(LOCKED)
        .config(locked)
        .pod("ld0", "decode", "lg0")
        .of_model(LOCKED)
        .config(locked);
    let env = [
        ("AIBRIX_PREFILL_SCORE_POLICY", "token_load"),
        ("AIBRIX_DECODE_SCORE_POLICY", "token_load"),
    ];
    let stack = Stack::start_with(fleet, 2, &env);
    let pods: Vec<String> = stack
        .fleet
        .pods
        .iter()
        .map(|p| format!("{}:{}", p.ip, p.port))
        .collect();
    let canary = Canary::start();
    let cases = cases(&canary.addr);
    assert!(cases.len() >= 30, "the table holds {} inputs", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        let mut headers: Vec<(&str, &str)> = vec![("content-type", "application/json")];
        headers.extend(c.headers.iter().map(|(k, v)| (*k, v.as_str())));
        let r = match http::request(&stack.gateway, "POST", c.path, &headers, &c.body) {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{}: no answer ({e})", c.name));
                continue;
            }
        };
        let mut wrong = Vec::new();
        if r.status != c.status {
            wrong.push(format!("status {} (want {})", r.status, c.status));
        }
        if let Some((name, want)) = c.header {
            match (r.header(name), want) {
                (None, _) => wrong.push(format!("no {name} header")),
                (Some(got), Some(want)) if got != want => {
                    wrong.push(format!("{name}: {got:?} (want {want:?})"))
                }
                _ => {}
            }
        }
        if r.headers.iter().any(|(k, _)| k == "x-injected") {
            wrong.push("a client string became a header".into());
        }
        if let Some(kind) = c.error_type {
            let body = r.json();
            if body["error"]["type"] != kind || !body["error"]["message"].is_string() {
                wrong.push(format!("error body {body}"));
            }
        }
        if r.status == 200 {
            if let Some(target) = r.header("target-pod-ip") {
                if !pods.iter().any(|p| p == target) {
                    wrong.push(format!("routed outside the fleet: {target}"));
                }
            }
        }
        if !wrong.is_empty() {
            failures.push(format!("{}: {}", c.name, wrong.join("; ")));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Client text in the gateway's log stays on its line and is cut short: the CR/LF model
    // forges no line, the 10 KB one makes no 10 KB line.
    let log = stack.envoy_log();
    assert!(
        log.contains("m\\r\\nx-injected: 1"),
        "the refusal is logged, escaped"
    );
    assert!(!log.lines().any(|l| l.starts_with("x-injected")), "{log}");
    assert!(
        !log.contains(&"m".repeat(1_000)),
        "a 10 KB model name in one line"
    );
    // Envoy's own 413 counts as the filter's refusal would.
    assert_eq!(
        stack.metric("pd_router_rejected_total", &[("reason", "body_too_large")]),
        1.0
    );
    // ~600 000 tiny members in 7 MB (each cost ≈ 40 bytes of index held with the body until
    // the prefill answered): refused at the cap, naming it, and counted with the one above.
    let r = http::request(
        &stack.gateway,
        "POST",
        "/v1/completions",
        &[
            ("content-type", "application/json"),
            ("routing-strategy", "pd"),
        ],
        members(600_000).as_bytes(),
    )
    .expect("an answer");
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.header("x-error-request-body-processing"), Some("true"));
    assert_eq!(
        r.json()["error"]["message"],
        "request body has more than 1024 top-level members"
    );
    assert_eq!(
        stack.metric(
            "pd_router_rejected_total",
            &[("reason", "too_many_members")]
        ),
        2.0
    );

    // The 63-bit seed reached the engine digit for digit (no f64 round trip).
    let seeds: Vec<String> = stack
        .sim_requests()
        .iter()
        .filter_map(|e| e["body"].get("seed").map(Value::to_string))
        .collect();
    assert!(
        !seeds.is_empty() && seeds.iter().all(|s| s == "9223372036854775807"),
        "{seeds:?}"
    );
    // Nothing was sent to the address the client named as the destination. (Whatever was
    // sent would have been answered by the canary's closing the connection, before the
    // answer this input got: the count is final.)
    assert_eq!(
        canary.accepted(),
        0,
        "a client-named destination ({}) was connected to",
        canary.addr
    );
    // A header value with a bare CR: whatever Envoy's codec makes of it (refuse it, or pass
    // the value on), no client bytes may come back as a header of their own.
    let mut raw = TcpStream::connect(&stack.gateway).expect("connect");
    raw.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let body = ok("x").to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\n\
         routing-strategy: pd\r\nx-aibrix-session-key: a\rinjected: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    raw.write_all(request.as_bytes()).expect("send");
    let mut answer = String::new();
    let _ = raw.read_to_string(&mut answer);
    assert!(
        answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.1 400"),
        "{answer:.300}"
    );
    let head = answer.split("\r\n\r\n").next().unwrap_or_default();
    assert!(
        !head
            .lines()
            .any(|l| l.to_ascii_lowercase().starts_with("injected")),
        "{head}"
    );

    // Header values that are not UTF-8 (RFC 9110 obs-text; Envoy passes them on). Reading one
    // with the SDK's text getters panicked the VM. A PD request refuses one it must forward
    // to the prefill pod (the callout takes text); any other is left alone.
    let raw_status = |strategy: &str, header: &[u8]| -> (String, String) {
        let mut raw = TcpStream::connect(&stack.gateway).expect("connect");
        raw.set_read_timeout(Some(Duration::from_secs(10))).ok();
        let body = ok("x").to_string();
        let mut request = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\n\
             routing-strategy: {strategy}\r\nconnection: close\r\ncontent-length: {}\r\n",
            body.len()
        )
        .into_bytes();
        request.extend_from_slice(header);
        request.extend_from_slice(b"\r\n\r\n");
        request.extend_from_slice(body.as_bytes());
        raw.write_all(&request).expect("send");
        let mut answer = Vec::new();
        let _ = raw.read_to_end(&mut answer);
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let status = answer.get(9..12).unwrap_or_default().to_string();
        (status, answer)
    };
    for (strategy, header, want) in [
        ("pd", &b"authorization: Bearer \xe9t\xe9"[..], "400"),
        ("pd", b"x-session-id: \xff\xfe", "400"),
        ("pd", b"x-aibrix-session-key: k\xff", "400"),
        ("pd", b"traceparent: \xff", "400"),
        ("pd", b"x-unrelated: \xff", "200"),
    ] {
        let (status, answer) = raw_status(strategy, header);
        assert_eq!(
            status,
            want,
            "{strategy} with {:?}: {answer:.400}",
            String::from_utf8_lossy(header)
        );
        if want == "400" {
            assert!(
                answer.contains("x-error-routing: true")
                    && answer.contains("invalid_request_error")
                    && answer.contains("not UTF-8"),
                "{answer:.600}"
            );
        }
    }
    // A strategy that forwards nothing answers as it would without the header.
    let (clean, _) = raw_status("random", b"x-a: b");
    let (status, answer) = raw_status("random", b"authorization: Bearer \xe9t\xe9");
    assert_eq!(status, clean, "{answer:.400}");
    assert!(!answer.contains("not UTF-8"), "{answer:.400}");
    let (status, answer) = raw_status("pd", b"routing-strategy: \xff");
    assert_eq!(
        status, "200",
        "the first routing-strategy counts: {answer:.300}"
    );

    // A client's `config-profile` reaches the access log only when the model has a profile
    // of that name: a made-up one is logged `-`, so it can forge no field of the line.
    let logged = |model: &str, profile: &str| -> String {
        let body = json!({"model": model, "prompt": "x", "max_tokens": 2});
        let r = http::post_json(
            &stack.gateway,
            "/v1/completions",
            &[("routing-strategy", "pd"), ("config-profile", profile)],
            &body,
        );
        assert_eq!(r.status, 200, "{profile:?}: {}", r.text());
        let id = format!("request_id={} ", r.header("request-id").unwrap_or_default());
        eventually(Duration::from_secs(10), || {
            stack
                .access_log_lines()
                .into_iter()
                .find(|l| l.contains(&id))
                .ok_or_else(|| format!("no access-log line with {id}"))
        })
    };
    let forged = logged(MODEL, "a target=forged x");
    assert!(forged.contains(" profile=- "), "{forged}");
    assert!(!forged.contains("forged"), "{forged}");
    assert_eq!(forged.matches(" target=").count(), 1, "{forged}");
    let known = logged(LOCKED, "default");
    assert!(known.contains(" profile=default "), "{known}");

    assert!(
        !stack.envoy_log().contains("panicked at"),
        "an input panicked the filter"
    );
    // Still serving, and nothing left charged.
    let r = http::post_json(
        &stack.gateway,
        "/v1/completions",
        &[("routing-strategy", "pd")],
        &ok("after the storm"),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    stack.wait_ledger_zero();
}

/// A client that starts a request and never finishes its headers is answered 408 and
/// disconnected after the drop-in's `request_headers_timeout` (10 s), not held until the
/// 130 s stream idle timeout; a client finishing its headers on the same gateway meanwhile is
/// served.
#[test]
fn a_client_never_finishing_its_headers_is_cut_off() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let stack = Stack::start(fleet);
    assert_cut_off_with_408(
        &stack,
        b"POST /v1/completions HTTP/1.1\r\nhost: pd\r\nrouting-strategy: pd\r\n",
    );
}

/// Sends `partial` (a request's start) on a connection of its own and never the rest; a
/// client on the same gateway meanwhile is served, and the partial one is answered 408 and
/// disconnected.
fn assert_cut_off_with_408(stack: &Stack, partial: &[u8]) {
    let mut raw = TcpStream::connect(&stack.gateway).expect("connect");
    raw.set_read_timeout(Some(Duration::from_secs(60))).ok();
    raw.write_all(partial).expect("send");
    let r = http::post_json(
        &stack.gateway,
        "/v1/completions",
        &[("routing-strategy", "pd")],
        &ok("served meanwhile"),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let mut answer = String::new();
    let read = raw.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{read:?} {answer:.300}");
}

/// A client that sends its headers and part of its body, then nothing more (a trickle would
/// do the same: each byte resets the idle timer), is answered 408 and disconnected after the
/// drop-in's `request_timeout` (here 2 s), not held with its buffered body until the 130 s
/// stream idle timeout, let alone the routes' hour; a client on the same gateway meanwhile is
/// served.
#[test]
fn a_client_never_finishing_its_body_is_cut_off() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet,
        &Options {
            request_timeout_s: Some(2),
            ..Options::default()
        },
    );
    assert_cut_off_with_408(
        &stack,
        b"POST /v1/completions HTTP/1.1\r\nhost: pd\r\nrouting-strategy: pd\r\n\
          content-type: application/json\r\ncontent-length: 100000\r\n\r\n{\"model\": ",
    );
}

/// A client's own KV-transfer members (here vLLM's `kv_transfer_params`, naming a host and
/// blocks of its choosing) never reach an engine: the prefill and decode legs carry only the
/// gateway's, and a request to a single pod carries none.
#[test]
fn a_clients_kv_transfer_params_never_reach_an_engine() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0")
        .combined("c0");
    let stack = Stack::start(fleet.clone());
    let hostile = json!({"do_remote_prefill": true, "remote_host": "10.9.9.9",
                         "remote_port": 5600, "remote_engine_id": "x",
                         "remote_block_ids": [0, 1, 2]});
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2,
                      "kv_transfer_params": hostile});
    for strategy in ["pd", "random"] {
        let r = http::post_json(
            &stack.gateway,
            "/v1/completions",
            &[("routing-strategy", strategy)],
            &body,
        );
        assert_eq!(r.status, 200, "{strategy}: {}", r.text());
    }
    let p0_ip = &fleet.spec("p0").ip;
    let legs = stack.sim_requests();
    assert_eq!(legs.len(), 3, "{legs:#?}");
    for leg in &legs {
        let params = &leg["kv_transfer_params_in"];
        match leg["pod"].as_str() {
            Some("p0") => assert_eq!(params["do_remote_decode"], true, "{leg:#}"),
            Some("d0") => assert_eq!(params["remote_host"], p0_ip.as_str(), "{leg:#}"),
            Some("c0") => assert!(params.is_null(), "{leg:#}"),
            other => panic!("unexpected pod {other:?}"),
        }
        assert!(
            !leg["body"].to_string().contains("10.9.9.9"),
            "the client's host reached {}: {leg:#}",
            leg["pod"]
        );
    }
}

/// A prefill pod answering 200 with a body over Envoy's async-client buffer limit (32 MB by
/// default; a broken or hostile engine): Envoy fails the call after its answer began and calls
/// the filter back with no answer at all. The request fails with 502 and `x-error-pd-prefill`,
/// and the worker keeps serving: reading the missing answer's status used to trap the VM,
/// taking every stream of the worker along.
#[test]
fn a_prefill_call_envoy_fails_mid_answer_fails_only_its_request() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let stack = Stack::start(fleet);
    stack.arm_fault(json!({"pod": "p0", "kind": "oversized", "bytes": 40 << 20,
                           "leg": "prefill", "times": 1}));
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2});
    let pd = [("routing-strategy", "pd")];
    let r = http::post_json(&stack.gateway, "/v1/completions", &pd, &body);
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.header("x-error-pd-prefill"), Some("true"));
    let message = r.json()["error"]["message"].to_string();
    assert!(
        message.contains("failed after its answer began"),
        "{message}"
    );
    for _ in 0..4 {
        let r = http::post_json(&stack.gateway, "/v1/completions", &pd, &body);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let log = stack.envoy_log();
    assert!(!log.contains("panicked"), "{log}");
    stack.wait_ledger_zero();
}

/// A prompt of a million spaces and a letter made the cl100k encoder's regex give up and the
/// tokenizer panic, trapping the VM with every stream of its worker. With the prefix index on
/// `cl100k` ids every prompt is encoded: the request is routed, and the worker keeps serving.
#[test]
fn a_prompt_of_a_million_spaces_traps_nothing() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let stack = Stack::start_with(
        fleet,
        2,
        &[
            ("AIBRIX_PREFIX_CACHE_TOKENIZER_TYPE", "tiktoken"),
            ("AIBRIX_PREFILL_SCORE_POLICY", "prefix_cache"),
        ],
    );
    let pd = [("routing-strategy", "pd")];
    let spaces = format!("{}x", " ".repeat(1_000_000));
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": spaces}],
                      "max_tokens": 2});
    let r = http::post_json(&stack.gateway, "/v1/chat/completions", &pd, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    // Both workers (one connection each) still serve.
    let small = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2});
    for _ in 0..4 {
        let r = http::post_json(&stack.gateway, "/v1/completions", &pd, &small);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let log = stack.envoy_log();
    assert!(!log.contains("panicked"), "{log}");
    stack.wait_ledger_zero();
}

/// Both drop-ins (inline filter and ECDS) bound Envoy's heap (their overload manager): under
/// the shipped bound the monitor runs and requests are served; an Envoy over its bound (here
/// 1 MiB, below what it holds at start) refuses each new request at once with 503 and the
/// OpenAI error body of every other refusal, before the filter or any pod sees it, and counts
/// it.
#[test]
fn an_envoy_over_its_heap_bound_refuses_new_requests_with_an_openai_error() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let pd = [("routing-strategy", "pd")];
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2});
    let stop = "overload.envoy.overload_actions.stop_accepting_requests.active";
    let pressure = "overload.envoy.resource_monitors.fixed_heap.pressure";
    let start = |ecds: bool, max_heap_bytes: Option<u64>| {
        let options = Options {
            max_heap_bytes,
            ..Default::default()
        };
        if ecds {
            Stack::start_ecds_opts(fleet.clone(), &[], &options)
        } else {
            Stack::start_opts(fleet.clone(), fleet.clone(), &options)
        }
    };
    for ecds in [false, true] {
        let shipped = start(ecds, None);
        let under = eventually(Duration::from_secs(10), || {
            match shipped.envoy_stat(pressure) {
                Some(p) if p > 0 => Ok(p),
                other => Err(format!("ecds {ecds}: heap pressure {other:?}")),
            }
        });
        assert!(
            under < 95,
            "ecds {ecds}: the shipped bound is near: {under} %"
        );
        assert_eq!(shipped.envoy_stat(stop), Some(0), "ecds {ecds}");
        let r = http::post_json(&shipped.gateway, "/v1/completions", &pd, &body);
        assert_eq!(r.status, 200, "ecds {ecds}: {}", r.text());
        drop(shipped);

        let over = start(ecds, Some(1 << 20));
        eventually(Duration::from_secs(10), || match over.envoy_stat(stop) {
            Some(1) => Ok(()),
            other => Err(format!("ecds {ecds}: {stop} {other:?}")),
        });
        let r = http::post_json(&over.gateway, "/v1/completions", &pd, &body);
        assert_eq!(r.status, 503, "ecds {ecds}: {}", r.text());
        assert_eq!(
            r.header("content-type"),
            Some("application/json"),
            "ecds {ecds}"
        );
        assert_eq!(
            r.json(),
            json!({"error": {"message": "envoy overloaded", "type": "overloaded_error",
                             "code": "service_unavailable", "param": null}}),
            "ecds {ecds}"
        );
        assert_eq!(
            over.envoy_stat("http.pd_ingress.downstream_rq_overload_close"),
            Some(1),
            "ecds {ecds}"
        );
        assert!(over.sim_requests().is_empty(), "ecds {ecds}");
    }
}

/// A completion body whose prompt is `bytes` bytes long.
fn prompt_of(bytes: usize) -> Value {
    json!({"model": MODEL, "prompt": "x".repeat(bytes), "max_tokens": 2})
}

/// Sends a PD completion on its own thread; joining gives its answer.
fn send_pd(gateway: &str, bytes: usize) -> std::thread::JoinHandle<http::Response> {
    let gateway = gateway.to_string();
    std::thread::spawn(move || {
        http::post_json(
            &gateway,
            "/v1/completions",
            &[("routing-strategy", "pd")],
            &prompt_of(bytes),
        )
    })
}

/// Polls until pd-sim logged `n` prefill legs, failing at once (with its answer) if `waiting`
/// was answered instead: the request it sent was refused rather than held.
fn wait_held(stack: &Stack, n: usize, waiting: &std::thread::JoinHandle<http::Response>) {
    eventually(Duration::from_secs(20), || {
        if waiting.is_finished() {
            return Ok(false);
        }
        let legs = stack
            .sim_requests()
            .iter()
            .filter(|e| e["leg"] == "prefill")
            .count();
        if legs >= n {
            Ok(true)
        } else {
            Err(format!("{legs} of {n} prefill legs arrived"))
        }
    })
    .then_some(())
    .expect("the request was answered instead of waiting for its prefill");
}

/// A PD request over the VM's budget of held bodies (`max_held_body_bytes`, here 100 000
/// bytes on one worker) is refused with 503 before it reaches any pod, while requests within
/// it wait for their prefill and are served; a client that leaves gives its body's room back,
/// and so does every request that ended, whichever way: after them all, the whole budget is
/// there again.
#[test]
fn bodies_held_past_the_vms_budget_are_refused_and_their_room_comes_back() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let options = Options {
        concurrency: 1,
        plugin_extra: r#""max_request_body_bytes":65536,"max_held_body_bytes":100000"#,
        ..Default::default()
    };
    let stack = Stack::start_opts(fleet.clone(), fleet, &options);
    let hang = json!({"pod": "p0", "kind": "hang_before_headers", "leg": "prefill"});
    let refused = |r: &http::Response, count: f64| {
        assert_eq!(r.status, 503, "{}", r.text());
        assert_eq!(r.header("x-error-routing"), Some("true"));
        assert_eq!(r.header("content-type"), Some("application/json"));
        let error = &r.json()["error"];
        assert_eq!(error["type"], "overloaded_error", "{error}");
        assert_eq!(error["code"], "service_unavailable", "{error}");
        assert!(
            error["message"]
                .as_str()
                .is_some_and(|m| m.contains("100000 bytes per worker")),
            "{error}"
        );
        assert_eq!(
            stack.metric(
                "pd_router_rejected_total",
                &[("reason", "held_bodies_over_budget")]
            ),
            count
        );
    };
    stack.arm_fault(hang.clone());
    // Two bodies of 40 KB wait for their prefill: one from a client that will leave.
    let a = send_pd(&stack.gateway, 40_000);
    wait_held(&stack, 1, &a);
    let mut leaving = TcpStream::connect(&stack.gateway).expect("connect");
    let body = prompt_of(40_000).to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\n\
         routing-strategy: pd\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    leaving.write_all(head.as_bytes()).expect("send");
    leaving.write_all(body.as_bytes()).expect("send");
    stack.wait_for_legs("prefill", 2);
    // A third would pass 100 000 bytes: refused at once, before its selection and any leg.
    let r = http::post_json(
        &stack.gateway,
        "/v1/completions",
        &[("routing-strategy", "pd")],
        &prompt_of(40_000),
    );
    refused(&r, 1.0);
    // A small one fits and waits.
    let small = send_pd(&stack.gateway, 5_000);
    wait_held(&stack, 3, &small);
    // The leaving client's room comes back when its stream ends, its prefill still hanging.
    drop(leaving);
    eventually(Duration::from_secs(10), || {
        let gone = stack.model_fail_count("response_fail", "499");
        (gone == 1.0)
            .then_some(())
            .ok_or_else(|| format!("{gone} departures counted"))
    });
    let after = send_pd(&stack.gateway, 40_000);
    wait_held(&stack, 4, &after);
    let prefill_legs = |stack: &Stack| {
        stack
            .sim_requests()
            .iter()
            .filter(|e| e["leg"] == "prefill")
            .count()
    };
    assert_eq!(
        prefill_legs(&stack),
        4,
        "the refused request reached no pod"
    );
    // Released, the held requests are served.
    stack.clear_faults();
    for waiting in [a, small, after] {
        let r = waiting.join().expect("client thread");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    stack.wait_ledger_zero();

    // Every body's room came back exactly: 98 000 bytes of prompts (and their framing and
    // index) fit again, and the next 5 000 do not.
    stack.clear_sim_requests();
    stack.arm_fault(hang);
    let big = send_pd(&stack.gateway, 60_000);
    wait_held(&stack, 1, &big);
    let second = send_pd(&stack.gateway, 38_000);
    wait_held(&stack, 2, &second);
    let r = http::post_json(
        &stack.gateway,
        "/v1/completions",
        &[("routing-strategy", "pd")],
        &prompt_of(5_000),
    );
    refused(&r, 2.0);
    stack.clear_faults();
    for waiting in [big, second] {
        let r = waiting.join().expect("client thread");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    stack.wait_ledger_zero();
    assert!(!stack.envoy_log().contains("panicked"));
}

/// A flood of refusals of one reason costs no worker a log line per request: each reason
/// logs a burst a second, and a later line says how many were left out. Every refusal still
/// counts in `pd_router_rejected_total`.
#[test]
fn a_flood_of_refusals_is_counted_whole_and_logged_in_paced_lines() {
    const CLIENTS: usize = 8;
    const EACH: usize = 40;
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let stack = Stack::start(fleet);
    let unknown = json!({"model": "no-such-model", "prompt": "x", "max_tokens": 1});
    let refuse = |gateway: &str| {
        let r = http::post_json(gateway, "/v1/completions", &[], &unknown);
        assert_eq!(r.status, 400, "{}", r.text());
    };
    std::thread::scope(|s| {
        for _ in 0..CLIENTS {
            s.spawn(|| {
                for _ in 0..EACH {
                    refuse(&stack.gateway);
                }
            });
        }
    });
    let sent = (CLIENTS * EACH) as f64;
    let counted =
        |stack: &Stack| stack.metric("pd_router_rejected_total", &[("reason", "unknown_model")]);
    assert_eq!(counted(&stack), sent, "every refusal counted");
    // Once a window has passed, a refusal's line says how many the flood left unlogged.
    let mut more = 0.0;
    eventually(Duration::from_secs(20), || {
        refuse(&stack.gateway);
        more += 1.0;
        let log = stack.envoy_log();
        log.lines()
            .any(|l| l.contains("more unknown_model refusals since the last such line"))
            .then_some(())
            .ok_or_else(|| "no line counted the refusals left out".to_string())
    });
    let logged = stack
        .envoy_log()
        .lines()
        .filter(|l| l.contains("refused: ") && l.contains("no-such-model"))
        .count() as f64;
    assert!(
        logged < sent,
        "{logged} refusal lines for {sent} refusals: not paced"
    );
    assert_eq!(counted(&stack), sent + more);
}
