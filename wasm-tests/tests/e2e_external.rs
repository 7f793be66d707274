//! End-to-end: AIBrix's `external` strategy in real Envoy (`--concurrency 2`): the filter asks
//! pd-control, pd-control asks an operator's decision service (a fake on loopback here), and
//! the request goes where the service says, to the fallback, or is refused.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use pd_wasm_tests::http;
use pd_wasm_tests::stack::{Fleet, Options, Stack};
use serde_json::{json, Value};

const MODEL: &str = "ext-model";
const MEDIA: &str = "application/vnd.aibrix.external-routing+json;version=v1alpha1";

/// How the fake decision service answers.
#[derive(Clone, Copy)]
enum Mode {
    /// Select the last candidate (ids are sorted, so the same pod every time).
    SelectLast,
    NoDecision,
    Deny,
    Fail,
}

#[derive(Default)]
struct Seen {
    candidates: Vec<String>,
    calls: usize,
}

struct Fake {
    mode: Mutex<Mode>,
    seen: Mutex<Seen>,
}

/// A one-connection-at-a-time HTTP/1.1 decision service on loopback; returns its URL.
fn fake_service(mode: Mode) -> (String, Arc<Fake>) {
    let fake = Arc::new(Fake {
        mode: Mutex::new(mode),
        seen: Mutex::new(Seen::default()),
    });
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}/select", listener.local_addr().expect("addr"));
    let shared = fake.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut length = 0;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some((k, v)) = line.split_once(':') {
                    if k.eq_ignore_ascii_case("content-length") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                }
            }
            let mut body = vec![0; length];
            if reader.read_exact(&mut body).is_err() {
                continue;
            }
            let request: Value = serde_json::from_slice(&body).unwrap_or_default();
            let ids: Vec<String> = request["spec"]["candidates"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["id"].as_str().map(String::from))
                .collect();
            let mode = *shared.mode.lock().unwrap();
            {
                let mut seen = shared.seen.lock().unwrap();
                seen.calls += 1;
                seen.candidates = ids.clone();
            }
            let status = match mode {
                Mode::SelectLast => json!({"decision": "Selected", "target": {"id": ids.last()}}),
                Mode::NoDecision => json!({"decision": "NoDecision"}),
                Mode::Deny => json!({"decision": "Denied", "reason": "CompliancePolicy"}),
                Mode::Fail => json!({}),
            };
            let answer = json!({
                "apiVersion": "routing.aibrix.ai/v1alpha1",
                "kind": "ReplicaSelectionResponse",
                "metadata": {"requestId": request["metadata"]["requestId"]},
                "status": status,
            })
            .to_string();
            let head = if matches!(mode, Mode::Fail) {
                "HTTP/1.1 500 Internal Server Error"
            } else {
                "HTTP/1.1 200 OK"
            };
            let mut out = stream;
            let _ = write!(
                out,
                "{head}\r\ncontent-type: {MEDIA}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                answer.len()
            );
        }
    });
    (url, fake)
}

/// Envoy and pd-control (`control_args`) over a PD pair the service is never offered and
/// three standard pods.
/// pd-control's flags for a decision service at `url` in `policy` / `failure` mode, then `extra`.
fn router_flags<'a>(
    url: &'a str,
    policy: &'a str,
    failure: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut flags = vec![
        "--external-router-endpoint",
        url,
        "--external-router-policy-mode",
        policy,
        "--external-router-failure-mode",
        failure,
    ];
    flags.extend_from_slice(extra);
    flags
}

fn start(control_args: &[&str]) -> Stack {
    start_on(Fleet::pair_and_three_standard(MODEL), control_args)
}

fn start_on(fleet: Fleet, control_args: &[&str]) -> Stack {
    Stack::start_opts(
        fleet.clone(),
        fleet,
        &Options {
            control_args,
            explain: true,
            ..Options::default()
        },
    )
}

fn send(stack: &Stack, i: usize) -> http::Response {
    let body = json!({"model": MODEL, "prompt": format!("question {i}"), "max_tokens": 2});
    http::post_json(
        &stack.gateway,
        "/v1/completions",
        &[("routing-strategy", "external"), ("x-pd-explain", "1")],
        &body,
    )
}

/// The explanation's account of an external decision.
fn explained(r: &http::Response) -> String {
    r.header("x-pd-explain").unwrap_or_default().to_string()
}

fn decisions(stack: &Stack, result: &str) -> f64 {
    stack.metric("pd_router_external_decisions_total", &[("result", result)])
}

#[test]
fn the_service_chooses_the_standard_pod_and_the_fallback_covers_for_it() {
    let (url, fake) = fake_service(Mode::SelectLast);
    let stack = start(&router_flags(
        &url,
        "Advisory",
        "FailOpen",
        &[
            "--external-router-fallback",
            "least-request",
            "--external-router-timeout",
            "2s",
            "--external-router-failure-threshold",
            "100",
        ],
    ));
    for i in 0..6 {
        let r = send(&stack, i);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("routing-strategy"), Some("external"));
        assert_eq!(r.header("target-pod"), Some("c2"), "the service's choice");
        assert!(
            explained(&r).starts_with("strategy=external; external=selected; pick=c2"),
            "{}",
            explained(&r)
        );
    }
    assert_eq!(
        fake.seen.lock().unwrap().candidates,
        ["default/c0", "default/c1", "default/c2"],
        "the standard pods only, sorted"
    );
    assert_eq!(decisions(&stack, "selected"), 6.0);

    // No decision, then a failing service: the fallback routes every request.
    for mode in [Mode::NoDecision, Mode::Fail] {
        *fake.mode.lock().unwrap() = mode;
        for i in 0..4 {
            let r = send(&stack, i);
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.header("routing-strategy"), Some("external"));
            assert!(r.header("target-pod").is_some_and(|p| p.starts_with('c')));
            assert!(
                explained(&r).contains("external=fallback; pick=c"),
                "{}",
                explained(&r)
            );
        }
    }
    assert_eq!(decisions(&stack, "fallback"), 8.0);
    assert_eq!(fake.seen.lock().unwrap().calls, 14);
    let entries = stack.sim_requests();
    assert_eq!(entries.len(), 14, "one leg per request");
}

#[test]
fn an_authoritative_service_refuses_and_a_failing_one_fails_closed() {
    let (url, fake) = fake_service(Mode::Deny);
    let stack = start(&router_flags(
        &url,
        "Authoritative",
        "FailClosed",
        &["--external-router-timeout", "2s"],
    ));
    let r = send(&stack, 0);
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.header("x-error-routing"), Some("true"));
    assert_eq!(r.json()["error"]["code"], "external_policy_denied");
    *fake.mode.lock().unwrap() = Mode::Fail;
    let r = send(&stack, 1);
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-error-routing"), Some("true"));
    assert_eq!(r.json()["error"]["code"], "external_router_unavailable");
    assert!(stack.sim_requests().is_empty(), "no pod saw either request");
    assert_eq!(decisions(&stack, "denied"), 1.0);
    assert_eq!(decisions(&stack, "unavailable"), 1.0);
    let rejected = |reason| stack.metric("pd_router_rejected_total", &[("reason", reason)]);
    assert_eq!(rejected("external_policy_denied"), 1.0);
    assert_eq!(rejected("external_router_unavailable"), 1.0);
}

#[test]
fn without_a_service_the_strategy_is_refused() {
    let stack = start(&[]);
    let r = send(&stack, 0);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.header("x-error-routing"), Some("true"));
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m == "incorrect routing strategy external"));
    assert_eq!(
        stack.metric("pd_router_rejected_total", &[("reason", "bad_strategy")]),
        1.0
    );
}

/// Advisory with a single candidate keeps AIBrix's local fast path: nothing to advise on, so
/// the service is not asked and the one standard pod serves.
#[test]
fn an_advisory_router_is_not_asked_about_a_single_candidate() {
    let (url, fake) = fake_service(Mode::Deny);
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0")
        .combined("c0");
    let stack = start_on(
        fleet,
        &router_flags(
            &url,
            "Advisory",
            "FailClosed",
            &["--external-router-fallback", "random"],
        ),
    );
    for i in 0..3 {
        let r = send(&stack, i);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("target-pod"), Some("c0"));
        assert!(
            explained(&r).contains("external=bypassed"),
            "{}",
            explained(&r)
        );
    }
    assert_eq!(fake.seen.lock().unwrap().calls, 0);
    assert_eq!(decisions(&stack, "bypassed"), 3.0);
}
