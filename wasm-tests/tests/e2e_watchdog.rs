//! End-to-end: the decode watchdog and PD failure headers, in real Envoy (`--concurrency 2`)
//! against pd-sim SGLang pods with injected faults.

use std::time::{Duration, Instant};

use pd_wasm_tests::http::Response;
use pd_wasm_tests::stack::{eventually, Fleet, Stack};
use serde_json::{json, Value};

const MODEL: &str = "wd-model";
/// The upper bound on when a watchdog's answer arrives. Not its accuracy (a tick, 50 ms, which
/// is a benchmark's business, not a timed test's): only that the watchdog answered and not
/// the next fallback, Envoy's `stream_idle_timeout` (130 s, envoy.yaml.tmpl) or the test
/// client's 60 s read timeout, with room for any load on the machine. The lower bound ("not
/// before the timeout") is the exact one; the message or the watchdog counter checked with
/// each proves the watchdog ended the request.
const BEFORE_ANY_FALLBACK: Duration = Duration::from_secs(10);

fn fleet() -> Fleet {
    Fleet::new(MODEL)
        .engine("sglang")
        .pod("sg-p-0", "prefill", "group-0")
        .pod("sg-d-0", "decode", "group-0")
}

fn env(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut e = vec![
        ("AIBRIX_PREFILL_SCORE_POLICY", "token_load"),
        ("AIBRIX_DECODE_SCORE_POLICY", "token_load"),
    ];
    e.extend_from_slice(extra);
    e
}

fn chat(stream: bool, max_tokens: u32) -> Value {
    json!({"model": MODEL, "stream": stream, "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": "hello"}]})
}

fn header<'a>(r: &'a Response, name: &str) -> &'a str {
    r.header(name)
        .unwrap_or_else(|| panic!("response lacks {name}: {:?} {}", r.headers, r.text()))
}

/// Sends a PD chat request from a thread of its own, for a test to act while it is held.
fn pd_chat_in_background(stack: &Stack, body: Value) -> std::thread::JoinHandle<Response> {
    let gateway = stack.gateway.clone();
    std::thread::spawn(move || {
        pd_wasm_tests::http::post_json(
            &gateway,
            "/v1/chat/completions",
            &[("routing-strategy", "pd")],
            &body,
        )
    })
}

/// The rid of the decode leg pd-sim logged for `request_id`.
fn decode_rid(stack: &Stack, request_id: &str) -> String {
    stack
        .sim_requests()
        .into_iter()
        .find(|e| e["x_request_id"] == request_id && e["leg"] == "decode")
        .and_then(|e| e["body"]["rid"].as_str().map(str::to_string))
        .unwrap_or_else(|| panic!("no decode leg for {request_id}"))
}

/// Waits until `gateway_pd_decode_abort_total{result, prefill_failure_class}` reaches 1 (the
/// abort's answer is counted after the pod logged it).
fn wait_abort_counted(stack: &Stack, result: &str, class: &str) {
    let labels = [("result", result), ("prefill_failure_class", class)];
    eventually(Duration::from_secs(10), || {
        match stack.metric("gateway_pd_decode_abort_total", &labels) {
            1.0 => Ok(()),
            n => Err(format!("abort {result}/{class} counted {n} times")),
        }
    });
}

/// Polls until the decode pod logged an `/abort_request` for `rid`.
fn wait_for_abort(stack: &Stack, rid: &str) -> Value {
    wait_for_abort_where(stack, rid, |r| r == rid)
}

/// Polls until the decode pod logged an `/abort_request` whose rid satisfies `matches`.
fn wait_for_abort_where(stack: &Stack, what: &str, matches: impl Fn(&str) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(e) = stack.sim_requests().into_iter().find(|e| {
            e["path"] == "/abort_request" && e["body"]["rid"].as_str().is_some_and(&matches)
        }) {
            return e;
        }
        assert!(Instant::now() < deadline, "no /abort_request for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn decode_silent_before_its_first_token_gets_504_and_an_abort() {
    let stack = Stack::start_with(
        fleet(),
        2,
        &env(&[("AIBRIX_DECODE_FIRST_RESPONSE_TIMEOUT", "1")]),
    );
    stack.arm_fault(json!({"pod": "sg-d-0", "kind": "hang_before_headers", "leg": "decode"}));
    let started = Instant::now();
    let r = stack.chat(&[("routing-strategy", "pd")], &chat(true, 4));
    let took = started.elapsed();
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(header(&r, "x-error-pd-decode"), "true");
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        message,
        "decode pod sg-d-0 did not start responding within 1s"
    );
    assert!(
        took >= Duration::from_secs(1),
        "not before the bound: {took:?}"
    );
    assert!(
        took < BEFORE_ANY_FALLBACK,
        "the watchdog answered, not a later fallback: {took:?}"
    );
    let rid = decode_rid(&stack, header(&r, "request-id"));
    let abort = wait_for_abort(&stack, &rid);
    assert_eq!(abort["pod"], "sg-d-0");
    assert_eq!(abort["status"], 200);
    wait_abort_counted(&stack, "ok", "watchdog_first_response");
    assert_eq!(
        stack.metric(
            "gateway_request_model_fail_total",
            &[("status", "pd_decode_watchdog"), ("status_code", "504")]
        ),
        1.0
    );
    assert_eq!(
        stack.metric(
            "gateway_pd_decode_watchdog_total",
            &[("phase", "first_response")]
        ),
        1.0
    );
    stack.clear_faults();
    stack.wait_ledger_zero();
}

#[test]
fn decode_stalling_mid_stream_is_cut_and_aborted() {
    let stack = Stack::start_with(
        fleet(),
        2,
        &env(&[("AIBRIX_DECODE_STREAM_IDLE_TIMEOUT", "1")]),
    );
    stack.arm_fault(
        json!({"pod": "sg-d-0", "kind": "hang_after_chunks", "chunks": 2, "leg": "decode"}),
    );
    let started = Instant::now();
    let r = stack.chat(&[("routing-strategy", "pd")], &chat(true, 50));
    let took = started.elapsed();
    assert_eq!(r.status, 200, "headers had gone out: the status stays");
    assert!(
        !r.complete,
        "the client sees a truncated stream: {}",
        r.text()
    );
    assert!(
        r.text().contains("tok1"),
        "the first chunks arrived: {}",
        r.text()
    );
    assert!(!r.text().contains("[DONE]"));
    assert!(
        took >= Duration::from_secs(1),
        "not cut before one idle bound: {took:?}"
    );
    assert!(
        took < BEFORE_ANY_FALLBACK,
        "cut by the watchdog, not a later fallback: {took:?}"
    );
    let rid = decode_rid(&stack, header(&r, "request-id"));
    wait_for_abort(&stack, &rid);
    wait_abort_counted(&stack, "ok", "watchdog_stream_idle");
    assert_eq!(
        stack.metric(
            "gateway_pd_decode_watchdog_total",
            &[("phase", "stream_idle")]
        ),
        1.0
    );
    assert_eq!(
        stack.metric(
            "gateway_request_model_fail_total",
            &[("status", "pd_decode_watchdog"), ("status_code", "504")]
        ),
        1.0
    );
    stack.clear_faults();
    stack.wait_ledger_zero();
}

/// A non-streaming request whose decode pod does not finish its answer within
/// `AIBRIX_DECODE_RESPONSE_TIMEOUT`: no response header reached the client, so the watchdog
/// answers 504 with `x-error-pd-decode` (a local reply) and asks the pod to drop the request.
#[test]
fn an_unstreamed_decode_not_finishing_in_time_gets_504_and_an_abort() {
    let stack = Stack::start_with(fleet(), 2, &env(&[("AIBRIX_DECODE_RESPONSE_TIMEOUT", "1")]));
    stack.arm_fault(json!({"pod": "sg-d-0", "kind": "hang_before_headers", "leg": "decode"}));
    let started = Instant::now();
    let r = stack.chat(&[("routing-strategy", "pd")], &chat(false, 4));
    let took = started.elapsed();
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(header(&r, "x-error-pd-decode"), "true");
    assert_eq!(header(&r, "content-type"), "application/json");
    assert_eq!(
        r.json(),
        json!({"error": {"message": "decode pod sg-d-0 did not finish responding within 1s",
                         "type": "api_error", "code": null, "param": null}}),
        "the unstreamed answer's message, not the stream's"
    );
    assert!(
        took >= Duration::from_secs(1),
        "not before the bound: {took:?}"
    );
    assert!(
        took < BEFORE_ANY_FALLBACK,
        "the watchdog answered, not a later fallback: {took:?}"
    );
    let rid = decode_rid(&stack, header(&r, "request-id"));
    let abort = wait_for_abort(&stack, &rid);
    assert_eq!(abort["pod"], "sg-d-0");
    wait_abort_counted(&stack, "ok", "watchdog_first_response");
    assert_eq!(stack.model_fail_count("pd_decode_watchdog", "504"), 1.0);
    assert_eq!(
        stack.metric(
            "gateway_pd_decode_watchdog_total",
            &[("phase", "first_response")]
        ),
        1.0
    );
    assert_eq!(
        stack.metric(
            "pd_router_rejected_total",
            &[("reason", "pd_decode_watchdog")]
        ),
        1.0,
        "a local reply"
    );
    assert_eq!(
        stack.metric("gateway_prefill_request_fail_total", &[]),
        0.0,
        "the prefill leg succeeded"
    );
    stack.clear_faults();
    stack.wait_ledger_zero();
}

#[test]
fn failed_sglang_prefill_answers_x_error_pd_prefill_and_aborts_the_decode() {
    let stack = Stack::start_with(fleet(), 2, &env(&[]));
    stack.arm_fault(json!({"pod": "sg-p-0", "kind": "status", "status": 500, "leg": "prefill"}));
    let r = stack.chat(&[("routing-strategy", "pd")], &chat(false, 4));
    assert_eq!(
        r.status,
        500,
        "the prefill pod's status passes through: {}",
        r.text()
    );
    assert_eq!(header(&r, "x-error-pd-prefill"), "true");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .starts_with("prefill request failed"));
    // The decode leg went out with the prefill leg; the gateway's local reply may cancel it
    // before the pod logs it, but the abort names the request's rid (`<request-id>-<hex>`).
    let prefix = format!("{}-", header(&r, "request-id"));
    let abort = wait_for_abort_where(&stack, &prefix, |rid| rid.starts_with(&prefix));
    assert_eq!(abort["pod"], "sg-d-0");
    wait_abort_counted(&stack, "ok", "http_status");
    assert_eq!(
        stack.metric(
            "gateway_pd_decode_watchdog_total",
            &[("phase", "first_response")]
        ),
        0.0,
        "not a watchdog failure"
    );
    // The failed call counts by the pod's status, as vLLM's prefill calls do.
    assert_eq!(stack.prefill_fail_count("http_error", "500"), 1.0);
    assert_eq!(stack.prefill_fail_count("error", "502"), 0.0);
    stack.clear_faults();
    // The gateway keeps serving once the pod recovers.
    let ok = stack.chat(&[("routing-strategy", "pd")], &chat(false, 2));
    assert_eq!(ok.status, 200, "{}", ok.text());
    stack.wait_ledger_zero();
}

/// The SGLang prefill leg fails after the decode pod has started its streamed answer (its
/// headers are out, it waits for the KV): the stream is cut at once rather than left waiting
/// for the engine's transfer timeout, and the request counts as the prefill's failure, not
/// as the decode pod's answer.
#[test]
fn an_sglang_prefill_failing_after_the_decode_answered_cuts_the_stream() {
    let fleet = fleet();
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet,
        &pd_wasm_tests::stack::Options {
            envoy_env: &env(&[]),
            // Without the cut, the stream would end with pd-sim's transfer error after this.
            sim_args: &["--pd-transfer-timeout-s", "4"],
            ..Default::default()
        },
    );
    stack.arm_fault(
        json!({"pod": "sg-p-0", "kind": "status", "status": 500, "delay_ms": 400,
                          "leg": "prefill", "times": 2}),
    );
    for _ in 0..2 {
        let started = Instant::now();
        let r = stack.chat(&[("routing-strategy", "pd")], &chat(true, 4));
        assert_eq!(
            r.status,
            200,
            "the decode pod's headers were out: {}",
            r.text()
        );
        assert!(!r.complete, "the stream is cut: {}", r.text());
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "not the transfer timeout"
        );
    }
    eventually(Duration::from_secs(10), || {
        match stack.model_fail_count("pd_prefill_failure", "500") {
            2.0 => Ok(()),
            n => Err(format!("{n} prefill failures counted")),
        }
    });
    assert_eq!(
        stack.model_fail_count("response_cut", "502"),
        0.0,
        "not the decode pod's cut"
    );
    assert_eq!(stack.prefill_fail_count("http_error", "500"), 2.0);
    stack.clear_faults();
    stack.wait_ledger_zero();
}

#[test]
fn no_abort_goes_to_a_decode_pod_that_left_the_fleet() {
    let fleet = fleet();
    let mut stack = Stack::start_with(
        fleet.clone(),
        2,
        &env(&[("AIBRIX_DECODE_FIRST_RESPONSE_TIMEOUT", "4")]),
    );
    stack.arm_fault(json!({"pod": "sg-d-0", "kind": "hang_before_headers", "leg": "decode"}));
    let client = pd_chat_in_background(&stack, chat(true, 4));
    stack.wait_for_legs("decode", 1);
    // The pod is deleted while its request hangs; its address may soon be someone else's.
    stack.write_fleet(fleet.without("sg-d-0"));
    stack.wait_fleet_adopted();
    let r = client.join().expect("client thread");
    assert_eq!(
        r.status,
        504,
        "the watchdog still fails the request: {}",
        r.text()
    );
    wait_abort_counted(&stack, "skipped_no_target", "watchdog_first_response");
    assert!(
        !stack
            .sim_requests()
            .iter()
            .any(|e| e["path"] == "/abort_request"),
        "an abort reached a pod outside the fleet"
    );
    stack.clear_faults();
    stack.wait_ledger_zero();
}

/// SGLang pods started with `--api-key` refuse any request without the key, `/abort_request`
/// included: the gateway's aborts carry the client's `authorization` (which the legs carried),
/// after a failed prefill and after a watchdog fire alike.
#[test]
fn engines_with_an_api_key_accept_the_gateways_aborts() {
    let fleet = fleet();
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet,
        &pd_wasm_tests::stack::Options {
            envoy_env: &env(&[("AIBRIX_DECODE_FIRST_RESPONSE_TIMEOUT", "1")]),
            sim_args: &["--api-key", "k-e2e"],
            ..Default::default()
        },
    );
    let auth = [
        ("routing-strategy", "pd"),
        ("authorization", "Bearer k-e2e"),
    ];
    let refused = stack.chat(&[("routing-strategy", "pd")], &chat(false, 2));
    assert_eq!(
        refused.status,
        401,
        "the pods ask for the key: {}",
        refused.text()
    );

    stack.arm_fault(json!({"pod": "sg-p-0", "kind": "status", "status": 500, "leg": "prefill"}));
    let r = stack.chat(&auth, &chat(false, 4));
    assert_eq!(r.status, 500, "{}", r.text());
    let prefix = format!("{}-", header(&r, "request-id"));
    let abort = wait_for_abort_where(&stack, &prefix, |rid| rid.starts_with(&prefix));
    assert_eq!(abort["status"], 200, "{abort}");
    assert_eq!(abort["headers"]["authorization"], "Bearer k-e2e");
    wait_abort_counted(&stack, "ok", "http_status");
    stack.clear_faults();

    stack.arm_fault(json!({"pod": "sg-d-0", "kind": "hang_before_headers", "leg": "decode"}));
    let r = stack.chat(&auth, &chat(true, 4));
    assert_eq!(r.status, 504, "{}", r.text());
    let rid = decode_rid(&stack, header(&r, "request-id"));
    let abort = wait_for_abort(&stack, &rid);
    assert_eq!(abort["status"], 200, "{abort}");
    wait_abort_counted(&stack, "ok", "watchdog_first_response");
    stack.clear_faults();
    stack.wait_ledger_zero();
}

/// The SGLang prefill's answer fails after the decode pod began streaming tokens: the decode
/// worker has the KV (it produces nothing before it arrives), so the answer is left to finish
/// rather than cut; the failed call still counts, as one failover recovered from does.
#[test]
fn an_sglang_prefill_answer_failing_mid_stream_lets_the_stream_finish() {
    use std::io::{BufRead, BufReader, Read, Write};
    let stack = Stack::start_with(fleet(), 2, &env(&[]));
    stack.arm_fault(
        json!({"pod": "sg-p-0", "kind": "fail_after_serving", "status": 500,
                           "leg": "prefill", "times": 1}),
    );
    // A long answer (500 tokens at pd-sim's 2 ms each): the failure arrives while it streams.
    let body = chat(true, 500).to_string();
    let mut conn = std::net::TcpStream::connect(&stack.gateway).expect("gateway");
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(
        conn,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nrouting-strategy: pd\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("request");
    let mut reader = BufReader::new(conn);
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        let n = reader.read_line(&mut line).expect("a line of the answer");
        assert!(n > 0, "the answer ended before its first token: {seen}");
        seen.push_str(&line);
        if line.starts_with("data: {") {
            break;
        }
    }
    // Tokens are flowing, so the KV arrived; now the prefill's answer fails.
    stack.clear_faults();
    let mut rest = String::new();
    let _ = reader.read_to_string(&mut rest);
    seen.push_str(&rest);
    assert!(
        seen.contains("data: [DONE]"),
        "the stream was cut: {}",
        &seen[seen.len().saturating_sub(400)..]
    );
    eventually(Duration::from_secs(10), || {
        match stack.prefill_fail_count("http_error", "500") {
            1.0 => Ok(()),
            n => Err(format!("{n} failed prefill calls counted")),
        }
    });
    assert_eq!(stack.model_fail_count("pd_prefill_failure", "500"), 0.0);
    stack.wait_ledger_zero();
}

/// SGLang's prefill leg fails while the decode pod is sending an error answer (its status and
/// half its body are in, the rest held): a decode pod answering an error received no KV, so
/// the request ends with the prefill's failure at once, as when the prefill fails before the
/// error's first byte, not whenever the error body ends (it was taken for a generation under
/// way, whose KV had arrived).
#[test]
fn an_sglang_prefill_failing_during_the_decodes_error_body_is_the_prefills_failure() {
    let stack = Stack::start_with(fleet(), 2, &env(&[]));
    stack.arm_fault(
        json!({"pod": "sg-d-0", "kind": "status", "status": 503, "stall_half": true,
                           "leg": "decode"}),
    );
    stack.arm_fault(
        json!({"pod": "sg-p-0", "kind": "status", "status": 500, "delay_ms": 300,
                           "leg": "prefill"}),
    );
    let client = pd_chat_in_background(&stack, chat(false, 4));
    // Answered while the decode pod still holds the rest of its error body.
    eventually(Duration::from_secs(10), || {
        let counted = stack.model_fail_count("pd_prefill_failure", "500");
        (counted == 1.0)
            .then_some(())
            .ok_or_else(|| format!("{counted} prefill failures counted"))
    });
    stack.clear_faults();
    let r = client.join().expect("client thread");
    assert_eq!(r.status, 500, "the prefill's status: {}", r.text());
    assert_eq!(header(&r, "x-error-pd-prefill"), "true");
    assert_eq!(stack.model_fail_count("response_fail", "503"), 0.0);
    stack.wait_ledger_zero();
}

/// SGLang's decode leg fails while its prefill leg (sent at the same time) is still running:
/// the client gets the decode pod's error, not a prefill failure; the decode pod is the one
/// counted; and the request leaves nothing behind (its charges, the prefill leg's count).
#[test]
fn an_sglang_decode_failing_while_its_prefill_runs_answers_the_decodes_error() {
    let stack = Stack::start_with(fleet(), 2, &env(&[]));
    stack.arm_fault(json!({"pod": "sg-p-0", "kind": "slow", "delay_ms": 1500, "leg": "prefill"}));
    stack.arm_fault(json!({"pod": "sg-d-0", "kind": "status", "status": 503, "leg": "decode"}));
    let r = stack.chat(&[("routing-strategy", "pd")], &chat(false, 4));
    assert_eq!(r.status, 503, "the decode pod's status: {}", r.text());
    assert_eq!(r.header("x-error-pd-prefill"), None, "{:?}", r.headers);
    assert!(
        r.json()["error"]["message"].is_string(),
        "an OpenAI error body: {}",
        r.text()
    );
    eventually(Duration::from_secs(10), || {
        let counted = stack.model_fail_count("response_fail", "503");
        (counted == 1.0)
            .then_some(())
            .ok_or_else(|| format!("{counted} decode failures counted"))
    });
    assert_eq!(stack.model_fail_count("pd_prefill_failure", "503"), 0.0);
    assert_eq!(stack.model_fail_count("pd_prefill_failure", "500"), 0.0);
    eventually(Duration::from_secs(10), || {
        let out = stack.metric("gateway_prefill_outstanding_requests", &[]);
        (out == 0.0)
            .then_some(())
            .ok_or_else(|| format!("{out} prefill legs still counted out"))
    });
    stack.wait_ledger_zero();
    stack.clear_faults();
    let ok = stack.chat(&[("routing-strategy", "pd")], &chat(false, 2));
    assert_eq!(ok.status, 200, "{}", ok.text());
}
