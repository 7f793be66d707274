//! One side of a PD exchange going away mid-flight, seen from both ends: what the engine
//! sees (pd-sim's request log records a request whose client left before the answer was
//! complete as `client_gone`, and every `/abort_request`) and what the client gets.
//!
//! - A client leaving while its prefill leg (the filter's side call) runs. Envoy does not
//!   cancel a side call when the stream that made it ends: its upstream request stays
//!   active until the pod answers or the call's own timeout fires. SGLang's prefill leg is
//!   ended by an `/abort_request` for its rid; a vLLM prefill leg, which nothing but its
//!   connection ends, runs until the prefill timeout closes that connection.
//! - A pod's error answer cut mid-body (the filter holds an error answer whole to rewrite
//!   it): Envoy answers the client itself, bypassing the filter, with a 502, which the
//!   drop-in's local-reply mappers give an OpenAI-style body (and `x-error-pd-decode` for a
//!   PD request).
//! - An SGLang decode leg failing (500, or its port refusing) while its prefill still runs:
//!   the client gets the decode pod's error, the prefill is aborted, the ledger ends at 0.

use std::collections::BTreeSet;
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use pd_wasm_tests::http::{self, Response};
use pd_wasm_tests::stack::{eventually, Fleet, Stack};
use serde_json::{json, Value};

const MODEL: &str = "departure-llm";
const PD: [(&str, &str); 1] = [("routing-strategy", "pd")];

fn pair(engine: &str) -> Fleet {
    Fleet::new(MODEL)
        .engine(engine)
        .pod("p-0", "prefill", "group-0")
        .pod("d-0", "decode", "group-0")
}

fn chat(stream: bool, max_tokens: u32) -> Value {
    json!({"model": MODEL, "stream": stream, "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": "where did everyone go?"}]})
}

/// Sends a request on a raw connection and returns it unread.
fn open_request(addr: &str, headers: &[(&str, &str)], body: &Value) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect to Envoy");
    let body = body.to_string();
    let mut head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("send head");
    s.write_all(body.as_bytes()).expect("send body");
    s
}

/// pd-sim's log entries of `pod`.
fn entries_of(stack: &Stack, pod: &str) -> Vec<Value> {
    stack
        .sim_requests()
        .into_iter()
        .filter(|e| e["pod"] == pod)
        .collect()
}

/// The rid an SGLang leg carried (pd-sim logs it under `pd`).
fn rid(entry: &Value) -> Option<String> {
    entry["pd"]["rid"].as_str().map(str::to_string)
}

/// Waits until the engine ended the prefill leg logged as `prefill`: its connection closed
/// before the answer was complete (`client_gone`), or, where `abort_counts` (SGLang), an
/// `/abort_request` for its rid reached the pod and found it in flight.
fn wait_prefill_ended(stack: &Stack, prefill: &Value, abort_counts: bool) -> String {
    let pod = prefill["pod"].as_str().unwrap_or_default().to_string();
    let seq = prefill["seq"].clone();
    let rid = rid(prefill);
    eventually(Duration::from_secs(10), || {
        let log = entries_of(stack, &pod);
        if log
            .iter()
            .any(|e| e["seq"] == seq && e["client_gone"] == true)
        {
            return Ok("connection closed".to_string());
        }
        let aborted = log.iter().any(|e| {
            e["path"] == "/abort_request"
                && e["pd"]["rid"].as_str() == rid.as_deref()
                && e["pd"]["aborted"].as_u64() >= Some(1)
        });
        if abort_counts && aborted {
            return Ok("aborted by rid".to_string());
        }
        Err(format!(
            "the prefill leg (seq {seq}, rid {rid:?}) still runs on {pod}: {log:?}"
        ))
    })
}

/// Gauges back to 0, the gateway still serves, nothing reached a pod outside the fleet,
/// and the filter never panicked.
fn assert_clean_end(stack: &Stack, fleet: &Fleet) {
    stack.wait_ledger_zero();
    let r = stack.chat(&PD, &chat(false, 2));
    assert_eq!(r.status, 200, "{}", r.describe());
    stack.wait_ledger_zero();
    let pods: BTreeSet<&str> = fleet.pods.iter().map(|p| p.name.as_str()).collect();
    for e in stack.sim_requests() {
        let pod = e["pod"].as_str().unwrap_or_default();
        assert!(pods.contains(pod), "a request reached {pod}: {e}");
    }
    let log = stack.envoy_log();
    assert!(!log.contains("panicked"), "the filter panicked:\n{log}");
}

/// `pd_router_prefill_aborts_total` of a result; and nothing of the prefill's in AIBrix's
/// decode-abort family.
fn prefill_aborts_counted(stack: &Stack, result: &str) -> f64 {
    assert_eq!(
        stack.metric(
            "gateway_pd_decode_abort_total",
            &[("prefill_failure_class", "prefill_abandoned")]
        ),
        0.0,
        "a prefill abort counted as a decode abort"
    );
    stack.metric("pd_router_prefill_aborts_total", &[("result", result)])
}

/// Starts `fleet` with `env`, arms a hang on p-0's prefill legs, sends one request on a raw
/// connection and drops that connection once the prefill leg reached p-0; returns the
/// stack, once the gateway released every charge, and the prefill leg's log entry.
fn leave_mid_prefill(fleet: &Fleet, env: &[(&str, &str)]) -> (Stack, Value) {
    let stack = Stack::start_with(fleet.clone(), 2, env);
    stack.arm_fault(json!({"pod": "p-0", "kind": "hang_before_headers", "leg": "prefill"}));
    let client = open_request(&stack.gateway, &PD, &chat(false, 4));
    let prefill = stack.wait_for_legs("prefill", 1).remove(0);
    drop(client);
    stack.wait_ledger_zero();
    (stack, prefill)
}

/// SGLang: the gateway asks the prefill pod to drop the leg (`/abort_request` for the rid
/// the leg carried), since Envoy leaves the side call running.
#[test]
fn an_sglang_client_leaving_mid_prefill_gets_its_prefill_aborted() {
    let fleet = pair("sglang");
    let (stack, prefill) = leave_mid_prefill(&fleet, &[]);
    assert!(rid(&prefill).is_some(), "{prefill}");
    assert_eq!(wait_prefill_ended(&stack, &prefill, true), "aborted by rid");
    eventually(Duration::from_secs(10), || {
        let ok = prefill_aborts_counted(&stack, "ok");
        (ok == 1.0)
            .then_some(())
            .ok_or_else(|| format!("{ok} prefill aborts counted ok"))
    });
    stack.clear_faults();
    assert_clean_end(&stack, &fleet);
}

/// A request answered whole while its prefill leg's answer is still out (the prefill pod
/// handed its KV over, the decode pod finished, the prefill's own answer lags) aborts
/// nothing: that leg's work is done. Checked against a later departure's abort, which the
/// one VM (`--concurrency 1`) sends after any abort of the first request.
#[test]
fn an_sglang_request_answered_whole_aborts_no_prefill() {
    let fleet = pair("sglang");
    let stack = Stack::start_with(fleet.clone(), 1, &[]);
    stack.arm_fault(
        json!({"pod": "p-0", "kind": "fail_after_serving", "status": 500,
                           "leg": "prefill", "times": 1}),
    );
    let r = stack.chat(&PD, &chat(false, 2));
    assert_eq!(r.status, 200, "{}", r.describe());
    let whole = stack.wait_for_legs("prefill", 1).remove(0);
    let whole_rid = rid(&whole).expect("an SGLang prefill leg carries a rid");

    stack.arm_fault(json!({"pod": "p-0", "kind": "hang_before_headers", "leg": "prefill"}));
    let client = open_request(&stack.gateway, &PD, &chat(false, 4));
    let departed = stack.wait_for_legs("prefill", 2).remove(1);
    drop(client);
    assert_eq!(
        wait_prefill_ended(&stack, &departed, true),
        "aborted by rid"
    );
    let aborted_whole = stack.sim_requests().into_iter().find(|e| {
        e["path"] == "/abort_request" && e["pd"]["rid"].as_str() == Some(whole_rid.as_str())
    });
    assert_eq!(aborted_whole, None, "a request answered whole was aborted");
    stack.clear_faults();
    assert_clean_end(&stack, &fleet);
}

/// vLLM: nothing but the connection ends a request at the engine, and Envoy keeps a side
/// call's connection after its stream ended (proxy-wasm has no cancel for HTTP calls): the
/// gateway releases its charges at once, while the prefill pod keeps the leg until the
/// call's own timeout (`AIBRIX_PREFILL_REQUEST_TIMEOUT`) closes the connection. Should
/// Envoy start cancelling such calls, the first asserts here fail: update this test and
/// docs/OPERATOR.md then.
#[test]
fn a_vllm_client_leaving_mid_prefill_leaves_the_leg_to_the_prefill_timeout() {
    let fleet = pair("vllm");
    let (stack, prefill) = leave_mid_prefill(&fleet, &[("AIBRIX_PREFILL_REQUEST_TIMEOUT", "5")]);
    assert_eq!(
        stack.envoy_stat("cluster.pd_pods.upstream_rq_active"),
        Some(1),
        "the prefill side call outlives its stream"
    );
    let still_open = entries_of(&stack, "p-0")
        .iter()
        .any(|e| e["seq"] == prefill["seq"] && e["client_gone"] == false);
    assert!(still_open, "the prefill pod still holds the leg");
    assert_eq!(
        wait_prefill_ended(&stack, &prefill, false),
        "connection closed"
    );
    assert_eq!(
        stack.envoy_stat("cluster.pd_pods.upstream_rq_timeout"),
        Some(1),
        "closed by the call's timeout"
    );
    stack.clear_faults();
    assert_clean_end(&stack, &fleet);
}

/// The stack's fleet: a vLLM pair and a standard pod.
fn pair_and_standard() -> Fleet {
    pair("vllm").combined("c-0")
}

/// Sends one request whose answer is `pod`'s error (`status`) cut mid-body, to `gateway`.
fn cut_error(
    stack: &Stack,
    gateway: &str,
    pod: &str,
    leg: &str,
    status: u16,
    headers: &[(&str, &str)],
) -> Response {
    stack.arm_fault(
        json!({"pod": pod, "kind": "status", "status": status, "cut_body": true,
                           "leg": leg, "times": 1}),
    );
    let body = chat(false, 2).to_string();
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    http::request(
        gateway,
        "POST",
        "/v1/chat/completions",
        &all,
        body.as_bytes(),
    )
    .unwrap_or_else(|e| panic!("no answer at all for {pod}'s cut error: {e}"))
}

const STANDARD: [(&str, &str); 1] = [("routing-strategy", "random")];

/// A pod's error answer cut mid-body: not an empty reply but Envoy's own 502, which the
/// drop-in's local-reply mappers give an OpenAI-style JSON body, marked `x-error-pd-decode`
/// for the decode pod of a PD pair only; counted as a response the upstream cut.
#[test]
fn a_pods_error_cut_mid_body_is_an_openai_json_502_and_counted() {
    let fleet = pair_and_standard();
    let stack = Stack::start_with(fleet.clone(), 2, &[]);
    let cases = [
        ("d-0", "decode", 500, &PD, Some("true")),
        ("c-0", "full", 429, &STANDARD, None),
    ];
    for (i, (pod, leg, status, headers, marked)) in cases.into_iter().enumerate() {
        let r = cut_error(&stack, &stack.gateway, pod, leg, status, headers);
        assert_eq!(r.status, 502, "{}", r.describe());
        assert_eq!(
            r.header("content-type"),
            Some("application/json"),
            "{}",
            r.describe()
        );
        let body = r.json();
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("cut off")
                && message.contains("upstream_reset_after_response_started"),
            "{}",
            r.describe()
        );
        assert_eq!(body["error"]["type"], "api_error", "{}", r.describe());
        assert_eq!(r.header("x-error-pd-decode"), marked, "{}", r.describe());
        // The request's id, as the pod got it, as every other answer carries it.
        let id = r.header("request-id").unwrap_or_default().to_string();
        assert!(!id.is_empty(), "no request-id: {}", r.describe());
        let seen = entries_of(&stack, pod)
            .iter()
            .any(|e| e["x_request_id"] == id.as_str() && e["leg"] == leg);
        assert!(seen, "{pod} saw no request {id} on its {leg} leg");
        eventually(Duration::from_secs(10), || {
            let cut = stack.model_fail_count("response_cut", "502");
            (cut == (i + 1) as f64)
                .then_some(())
                .ok_or_else(|| format!("{cut} cut answers counted, not {}", i + 1))
        });
    }
    // Envoy's other answers keep theirs: a whole pod error is the filter's rewrite still.
    stack.arm_fault(
        json!({"pod": "d-0", "kind": "status", "status": 500, "leg": "decode",
                           "times": 1}),
    );
    let r = http::post_json(&stack.gateway, "/v1/chat/completions", &PD, &chat(false, 2));
    assert_eq!(r.status, 500, "{}", r.describe());
    assert_eq!(r.json()["error"]["message"], "Internal server error");
    assert_eq!(r.header("x-error-pd-decode"), None, "{}", r.describe());
    assert_clean_end(&stack, &fleet);
}

/// An SGLang decode leg failing at once while its prefill leg waits in the bootstrap queue
/// for it (SGLang sends both legs together): the client gets the decode pod's error, the
/// prefill pod is asked to drop the leg, and the ledger ends at zero.
fn sglang_decode_failing_aborts_its_prefill(fault: Value, want_status: u16) {
    let fleet = pair("sglang");
    let stack = Stack::start_with(fleet.clone(), 2, &[]);
    stack.arm_fault(fault);
    let r = stack.chat(&PD, &chat(false, 4));
    assert_eq!(r.status, want_status, "{}", r.describe());
    let body = r.json();
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{}",
        r.describe()
    );
    assert_eq!(r.header("x-error-pd-prefill"), None, "{}", r.describe());
    let prefill = stack.wait_for_legs("prefill", 1).remove(0);
    assert_eq!(wait_prefill_ended(&stack, &prefill, true), "aborted by rid");
    stack.wait_ledger_zero();
    stack.clear_faults();
    assert_clean_end(&stack, &fleet);
}

#[test]
fn an_sglang_decode_answering_500_while_its_prefill_runs_gets_the_prefill_aborted() {
    sglang_decode_failing_aborts_its_prefill(
        json!({"pod": "d-0", "kind": "status", "status": 500, "leg": "decode", "times": 1}),
        500,
    );
}

#[test]
fn an_sglang_decode_refusing_connections_while_its_prefill_runs_gets_the_prefill_aborted() {
    sglang_decode_failing_aborts_its_prefill(json!({"pod": "d-0", "kind": "refuse"}), 503);
}
