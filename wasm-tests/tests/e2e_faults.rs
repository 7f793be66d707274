//! End-to-end fault matrix: real Envoy (`--concurrency 2`), the real filter, pd-sim pods with
//! injected faults. Every test checks the same three promises besides its own:
//! - every request ends, with a success or a specific error (a status plus the contract's
//!   `x-error-*` header and an OpenAI-style error body, or, once a 200 stream is under way,
//!   a cut stream the filter counts as `response_cut`), and no client is left hanging;
//! - no request reaches a pod outside the fleet (pd-sim also serves a pod the router was
//!   never told about, which must see nothing);
//! - afterwards every ledger and outstanding gauge reads exactly 0.
//!
//! Faults hold legs until the test clears them (no timing assumptions); where a bound is the
//! behaviour under test (watchdog, prefill timeout) the env var sets it to 1 s.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use pd_wasm_tests::http::{self, Response};
use pd_wasm_tests::stack::{eventually, snapshot_pods, Fleet, Options, Stack};
use serde_json::{json, Value};

mod async_client;

const MODEL: &str = "fault-llm";
/// A pod pd-sim serves under the model but the fleet file never lists.
const ROGUE: &str = "rogue-d-9";
/// How long a test waits for all its clients: far beyond every bound set in these tests,
/// far below Envoy's 120 s route timeout, so a client stuck until that timeout fails here.
const ALL_ENDED: Duration = Duration::from_secs(30);

fn one_roleset() -> Fleet {
    Fleet::new(MODEL)
        .pod("p-0", "prefill", "group-0")
        .pod("d-0", "decode", "group-0")
}

fn two_rolesets() -> Fleet {
    one_roleset()
        .pod("p-1", "prefill", "group-1")
        .pod("d-1", "decode", "group-1")
}

/// pd-control's reachability check off: most tests here count what the filter itself does
/// about a pod that refuses connections (failover, ejection), which a pod pd-control already
/// marked unreachable would never show.
const NO_REACHABILITY_CHECK: &[&str] = &["--unreachable-after", "0"];

/// Starts the stack on `fleet`, with pd-sim also serving [`ROGUE`], without pd-control's
/// reachability check.
fn start(fleet: Fleet, env: &[(&str, &str)]) -> Stack {
    start_with_control(fleet, env, NO_REACHABILITY_CHECK)
}

/// [`start`] with pd-control's reachability check at its defaults.
fn start_checked(fleet: Fleet, env: &[(&str, &str)]) -> Stack {
    start_with_control(fleet, env, &[])
}

fn start_with_control(fleet: Fleet, env: &[(&str, &str)], control_args: &[&str]) -> Stack {
    start_configured(fleet, env, control_args, "")
}

/// [`start_with_control`] with `plugin_extra` as in [`Options`].
fn start_configured(
    fleet: Fleet,
    env: &[(&str, &str)],
    control_args: &[&str],
    plugin_extra: &str,
) -> Stack {
    start_simulating_rogue(
        fleet,
        &Options {
            envoy_env: env,
            control_args,
            plugin_extra,
            ..Options::default()
        },
    )
}

/// Starts `fleet` with `options`, pd-sim also running [`ROGUE`] (a pod outside the fleet).
fn start_simulating_rogue(fleet: Fleet, options: &Options) -> Stack {
    let simulated = fleet.clone().pod(ROGUE, "decode", "group-9");
    Stack::start_opts(fleet, simulated, options)
}

fn chat(stream: bool, max_tokens: u32) -> Value {
    json!({"model": MODEL, "stream": stream, "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": "tell me about faults"}]})
}

const PD: [(&str, &str); 1] = [("routing-strategy", "pd")];

/// A short chat request with a prompt of its own: no prefix affinity holds a run of them on
/// one roleset.
fn question(i: usize) -> Value {
    json!({"model": MODEL, "max_tokens": 2,
           "messages": [{"role": "user", "content": format!("question {i}")}]})
}

/// Waits until pd-control has scraped each of `pods`: only a pod that answered before can be
/// marked (a port never reached may be a wrong port or a network policy, not a dead engine).
fn wait_scraped(stack: &Stack, pods: &[&str]) {
    eventually(Duration::from_secs(15), || {
        let snap = stack.control_snapshot();
        let scraped = |pod: &&str| {
            snapshot_pods(&snap).any(|p| p["name"] == *pod && p["metrics"]["present"] == true)
        };
        pods.iter()
            .all(scraped)
            .then_some(())
            .ok_or_else(|| format!("{pods:?} not all scraped yet"))
    });
}

/// pd-control's `pd_control_pods` gauge for the test model's pods of `role` in `state`.
fn control_pods(stack: &Stack, role: &str, state: &str) -> Option<f64> {
    let text = http::get(&stack.control, "/metrics")
        .expect("pd-control metrics")
        .text();
    pd_wasm_tests::prom::Scrape::parse(&text).value(
        "pd_control_pods",
        &[("model", MODEL), ("role", role), ("state", state)],
    )
}

/// Sends [`question`]s (numbered after `first`) with `headers` until one's `header` names
/// `pod`, every one a success: a pod that was out takes requests again.
fn until_routed_to(
    stack: &Stack,
    headers: &[(&str, &str)],
    header: &str,
    pod: &str,
    first: usize,
    timeout: Duration,
) {
    let mut i = first;
    eventually(timeout, || {
        i += 1;
        let r = stack.chat(headers, &question(i));
        assert_success(&r);
        (r.header(header) == Some(pod))
            .then_some(())
            .ok_or_else(|| format!("{pod} never came back"))
    });
}

/// Sends `n` requests at once, each on its own connection and thread.
fn fire(stack: &Stack, n: usize, body: Value) -> Vec<JoinHandle<Response>> {
    (0..n)
        .map(|_| {
            let (addr, body) = (stack.gateway.clone(), body.clone());
            std::thread::spawn(move || http::post_json(&addr, "/v1/chat/completions", &PD, &body))
        })
        .collect()
}

/// Waits until every client got its answer, failing if one is still waiting after
/// [`ALL_ENDED`].
fn ended(handles: Vec<JoinHandle<Response>>) -> Vec<Response> {
    eventually(ALL_ENDED, || {
        let open = handles.iter().filter(|h| !h.is_finished()).count();
        if open == 0 {
            Ok(())
        } else {
            Err(format!("{open} of {} clients still wait", handles.len()))
        }
    });
    handles
        .into_iter()
        .map(|h| h.join().expect("client thread"))
        .collect()
}

fn describe(r: &Response) -> String {
    format!(
        "{} complete={} target-pod={:?} headers={:?} body={}",
        r.status,
        r.complete,
        r.header("target-pod"),
        r.headers,
        r.text().chars().take(300).collect::<String>()
    )
}

/// A complete 200.
fn assert_success(r: &Response) {
    assert!(r.status == 200 && r.complete, "{}", describe(r));
}

/// A refusal with `status`, the contract's error header and an OpenAI-style error body.
fn assert_error(r: &Response, status: u16, header: &str) {
    assert_eq!(r.status, status, "{}", describe(r));
    assert_eq!(r.header(header), Some("true"), "{}", describe(r));
    let body = r.json();
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
            && body["error"]["type"].is_string(),
        "not an OpenAI error body: {}",
        describe(r)
    );
}

/// A 200 stream that was cut before its end. (Whether its first chunk reached the client
/// depends on the reset: a TCP reset discards bytes the client had not read yet.)
fn assert_cut(r: &Response) {
    assert_eq!(r.status, 200, "{}", describe(r));
    assert!(!r.complete, "the stream should be cut: {}", describe(r));
    assert!(!r.text().contains("[DONE]"), "{}", describe(r));
}

/// No pd-sim pod outside `allowed` (and so never [`ROGUE`]) saw a request.
fn assert_only(stack: &Stack, allowed: &BTreeSet<String>) {
    for e in stack.sim_requests() {
        let pod = e["pod"].as_str().unwrap_or_default();
        assert!(
            allowed.contains(pod),
            "a request reached {pod}, outside the fleet: {e}"
        );
    }
}

fn fleet_pods(fleet: &Fleet) -> BTreeSet<String> {
    fleet.pods.iter().map(|p| p.name.clone()).collect()
}

/// The shared ending of every test: nothing outside the fleet, gauges back to 0, and the
/// gateway still serves.
fn assert_clean_end(stack: &Stack, allowed: &BTreeSet<String>) {
    stack.wait_ledger_zero();
    assert_success(&stack.chat(&PD, &chat(false, 2)));
    stack.wait_ledger_zero();
    assert_only(stack, allowed);
    let log = stack.envoy_log();
    assert!(!log.contains("panicked"), "the filter panicked:\n{log}");
}

fn fail_count(stack: &Stack, status: &str, code: &str) -> f64 {
    stack.metric(
        "gateway_request_model_fail_total",
        &[("status", status), ("status_code", code)],
    )
}

/// Decode legs pd-sim logged per pod.
fn decode_legs(stack: &Stack, pod: &str) -> Vec<Value> {
    stack
        .sim_requests()
        .into_iter()
        .filter(|e| e["leg"] == "decode" && e["pod"] == pod)
        .collect()
}

#[test]
fn decode_pod_crashing_mid_stream_cuts_its_streams_and_counts_them() {
    let fleet = one_roleset();
    let stack = start(fleet.clone(), &[]);
    stack.arm_fault(
        json!({"pod": "d-0", "kind": "hang_after_chunks", "chunks": 1, "leg": "decode"}),
    );
    let clients = fire(&stack, 4, chat(true, 20));
    stack.wait_for_legs("decode", 4);
    stack.arm_fault(json!({"pod": "d-0", "kind": "crash"}));
    for r in ended(clients) {
        assert_cut(&r);
        assert_eq!(r.header("target-pod"), Some("d-0"));
    }
    assert_eq!(
        fail_count(&stack, "response_cut", "502"),
        4.0,
        "a stream the pod dropped is a failure, not a success"
    );
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

#[test]
fn decode_hanging_before_its_first_token_gets_504_from_the_watchdog() {
    let fleet = one_roleset();
    let stack = start(
        fleet.clone(),
        &[("AIBRIX_DECODE_FIRST_RESPONSE_TIMEOUT", "1")],
    );
    stack.arm_fault(json!({"pod": "d-0", "kind": "hang_before_headers", "leg": "decode"}));
    for r in ended(fire(&stack, 4, chat(true, 8))) {
        assert_error(&r, 504, "x-error-pd-decode");
    }
    assert_eq!(fail_count(&stack, "pd_decode_watchdog", "504"), 4.0);
    let rejected = |reason| stack.metric("pd_router_rejected_total", &[("reason", reason)]);
    assert_eq!(rejected("pd_decode_watchdog"), 4.0, "local replies");
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// A decode pod that sends an error status and then stalls its body: the filter holds those
/// headers (it rewrites error bodies), so the client has none yet and the watchdog answers
/// 504 with `x-error-pd-decode`, not a reset without any status.
#[test]
fn a_decode_error_whose_body_stalls_gets_504_from_the_watchdog() {
    let fleet = one_roleset();
    let stack = start(
        fleet.clone(),
        &[("AIBRIX_DECODE_FIRST_RESPONSE_TIMEOUT", "1")],
    );
    stack.arm_fault(json!({"pod": "d-0", "kind": "status", "status": 503,
                           "stall_body": true, "leg": "decode"}));
    for r in ended(fire(&stack, 2, chat(true, 8))) {
        assert_error(&r, 504, "x-error-pd-decode");
    }
    assert_eq!(fail_count(&stack, "pd_decode_watchdog", "504"), 2.0);
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

#[test]
fn decode_stalling_after_some_chunks_is_cut_by_the_watchdog() {
    let fleet = one_roleset();
    let stack = start(fleet.clone(), &[("AIBRIX_DECODE_STREAM_IDLE_TIMEOUT", "1")]);
    stack.arm_fault(
        json!({"pod": "d-0", "kind": "hang_after_chunks", "chunks": 2, "leg": "decode"}),
    );
    for r in ended(fire(&stack, 4, chat(true, 40))) {
        assert_cut(&r);
    }
    assert_eq!(fail_count(&stack, "pd_decode_watchdog", "504"), 4.0);
    assert_eq!(
        stack.metric(
            "gateway_pd_decode_watchdog_total",
            &[("phase", "stream_idle")]
        ),
        4.0
    );
    assert_eq!(
        stack.metric(
            "pd_router_rejected_total",
            &[("reason", "pd_decode_watchdog")]
        ),
        0.0,
        "a cut stream is no local reply"
    );
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// Two rolesets (and [`ROGUE`] in pd-sim) under count-based scores: idle rolesets tie and
/// each request picks one at random (engine-metric policies would prefer one roleset for every
/// request). `plugin_extra` as in [`Options`].
fn two_tied_rolesets(plugin_extra: &str, control_args: &[&str]) -> (Fleet, Stack) {
    let fleet = two_rolesets();
    let stack = start_simulating_rogue(
        fleet.clone(),
        &Options {
            plugin_extra,
            control_args,
            envoy_env: &[
                ("AIBRIX_PREFILL_SCORE_POLICY", "least_request"),
                ("AIBRIX_DECODE_SCORE_POLICY", "least_request"),
            ],
            ..Options::default()
        },
    );
    (fleet, stack)
}

/// Prefill failures of every kind: the client gets `status` with `x-error-pd-prefill`, no
/// decode leg is sent, and the prefill failure is counted. The fleet has one roleset, so a
/// failover finds no other pair. `plugin_extra` as in [`Options`]. Returns the stack, its
/// ledger back at zero.
fn prefill_failure(fault: Value, env: &[(&str, &str)], plugin_extra: &str, status: u16) -> Stack {
    let fleet = one_roleset();
    let stack = start_configured(fleet.clone(), env, NO_REACHABILITY_CHECK, plugin_extra);
    stack.arm_fault(fault);
    for r in ended(fire(&stack, 4, chat(false, 4))) {
        assert_error(&r, status, "x-error-pd-prefill");
    }
    assert!(
        decode_legs(&stack, "d-0").is_empty(),
        "no decode after a failed prefill"
    );
    assert_eq!(
        fail_count(&stack, "pd_prefill_failure", &status.to_string()),
        4.0
    );
    assert_eq!(
        stack.metric(
            "gateway_prefill_request_fail_total",
            &[("status", "pd-do-prefill-request-error")]
        ),
        4.0
    );
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
    stack
}

fn failovers(stack: &Stack, result: &str) -> f64 {
    stack.metric("pd_router_prefill_failover_total", &[("result", result)])
}

fn assert_no_failover(stack: &Stack) {
    assert_eq!(
        failovers(stack, "rerouted") + failovers(stack, "failed"),
        0.0
    );
}

#[test]
fn prefill_answering_5xx_fails_the_request_with_x_error_pd_prefill() {
    let stack = prefill_failure(
        json!({"pod": "p-0", "kind": "status", "status": 503, "leg": "prefill"}),
        &[],
        "",
        503,
    );
    // 503 is one of the default `prefill_failover_statuses`: each request tried to fail
    // over, and no other pair could take it.
    assert_eq!(failovers(&stack, "failed"), 4.0);
    assert_eq!(failovers(&stack, "rerouted"), 0.0);
}

/// A failover whose new selection fails for another reason than "no pod left" still answers
/// the prefill's failure, as the client would get it without failover, not the re-route's
/// selection error: here the other roleset serves another prompt-length bucket.
#[test]
fn a_failover_that_finds_no_pair_answers_the_prefills_failure() {
    let range = |min: u32, max: u32| {
        format!(
            r#"{{"profiles":{{"default":{{"routingStrategy":"pd","routingConfig":{{"promptLenBucketMinLength":{min},"promptLenBucketMaxLength":{max}}}}}}}}}"#
        )
    };
    let fleet = Fleet::new(MODEL)
        .pod("short-p", "prefill", "short")
        .config(&range(0, 15))
        .pod("short-d", "decode", "short")
        .config(&range(0, 15))
        .pod("long-p", "prefill", "long")
        .config(&range(16, 4096))
        .pod("long-d", "decode", "long")
        .config(&range(16, 4096));
    let stack = start(fleet.clone(), &[("AIBRIX_PROMPT_LENGTH_BUCKETING", "true")]);
    stack.arm_fault(json!({"pod": "short-p", "kind": "status", "status": 503, "leg": "prefill"}));
    // " hello" is one token: a 10-token prompt only the short roleset serves.
    let body = json!({"model": MODEL, "prompt": " hello".repeat(10), "max_tokens": 2});
    for _ in 0..2 {
        let r = http::post_json(&stack.gateway, "/v1/completions", &PD, &body);
        assert_error(&r, 503, "x-error-pd-prefill");
        assert_eq!(r.header("x-error-routing"), None, "{}", describe(&r));
    }
    assert_eq!(failovers(&stack, "failed"), 2.0);
    assert_eq!(fail_count(&stack, "pd_prefill_failure", "503"), 2.0);
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

#[test]
fn prefill_answers_outside_prefill_failover_statuses_are_not_routed_again() {
    // The request's own fault: it would fail on any pod.
    let stack = prefill_failure(
        json!({"pod": "p-0", "kind": "status", "status": 400, "leg": "prefill"}),
        &[],
        "",
        400,
    );
    assert_no_failover(&stack);
    // With the list emptied, a 5xx answer passes through untried elsewhere too.
    let stack = prefill_failure(
        json!({"pod": "p-0", "kind": "status", "status": 500, "leg": "prefill"}),
        &[],
        r#""prefill_failover_statuses": []"#,
        500,
    );
    assert_no_failover(&stack);
}

#[test]
fn prefill_timing_out_fails_the_request_with_504() {
    prefill_failure(
        json!({"pod": "p-0", "kind": "hang_before_headers", "leg": "prefill"}),
        &[("AIBRIX_PREFILL_REQUEST_TIMEOUT", "1")],
        "",
        504,
    );
}

/// Envoy's own `stream_idle_timeout` (130 s in the drop-in, 2 s here) firing while a request
/// waits on its prefill leg, as it does under a prefill timeout an operator raised past it:
/// a prefill failure (504 `x-error-pd-prefill`, `pd_prefill_failure`, the prefill pod
/// blamed), not a failure of the decode pod, which vLLM's order had not even asked (three of
/// them ejected a healthy decode pod).
#[test]
fn envoys_stream_timeout_during_the_prefill_is_the_prefills_failure_not_the_decodes() {
    let fleet = one_roleset();
    let stack = start_simulating_rogue(
        fleet.clone(),
        &Options {
            // One worker: the four failures land on one ejection tally.
            concurrency: 1,
            envoy_env: &[("AIBRIX_PREFILL_REQUEST_TIMEOUT", "30")],
            control_args: NO_REACHABILITY_CHECK,
            stream_idle_timeout_s: Some(2),
            ..Options::default()
        },
    );
    stack.arm_fault(json!({"pod": "p-0", "kind": "hang_before_headers", "leg": "prefill"}));
    for r in ended(fire(&stack, 4, chat(false, 4))) {
        assert_error(&r, 504, "x-error-pd-prefill");
    }
    assert!(decode_legs(&stack, "d-0").is_empty(), "no decode leg went");
    // Counted as each stream is logged, which may follow the client's answer.
    eventually(Duration::from_secs(10), || {
        let counted = fail_count(&stack, "pd_prefill_failure", "504")
            + fail_count(&stack, "response_fail", "504");
        (counted == 4.0)
            .then_some(())
            .ok_or_else(|| format!("{counted} of 4 outcomes counted"))
    });
    assert_eq!(fail_count(&stack, "pd_prefill_failure", "504"), 4.0);
    assert_eq!(
        stack.metric(
            "gateway_prefill_request_fail_total",
            &[("status", "timeout"), ("status_code", "504")]
        ),
        4.0
    );
    // Three failures in a row eject a pod (the default `eject_after_failures`).
    eventually(Duration::from_secs(10), || {
        let log = stack.envoy_log();
        let ejected: Vec<&str> = log.lines().filter(|l| l.contains("ejecting pod")).collect();
        assert!(
            ejected.iter().all(|l| !l.contains("d-0")),
            "the decode pod was blamed: {ejected:?}"
        );
        (ejected.iter().any(|l| l.contains("p-0")))
            .then_some(())
            .ok_or_else(|| {
                format!(
                    "the prefill pod was not blamed: {ejected:?}, ejections {}",
                    stack.stat("pd_router_ejections_total")
                )
            })
    });
    // Which pod failed, per pod: each of the four requests against the prefill pod.
    let failures = |pod: &str| stack.metric("pd_router_pod_failures_total", &[("pod", pod)]);
    assert_eq!(failures("p-0"), 4.0);
    assert_eq!(failures("d-0"), 0.0, "the decode pod failed nothing");
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

#[test]
fn prefill_port_refusing_connections_fails_the_request_with_502() {
    let stack = prefill_failure(json!({"pod": "p-0", "kind": "refuse"}), &[], "", 502);
    // Each request tried to fail over, and no other pair could take it.
    assert_eq!(failovers(&stack, "failed"), 4.0);
    assert_eq!(failovers(&stack, "rerouted"), 0.0);
}

/// A vLLM prefill pod answering 200 with a body that is not a JSON object (a broken engine, a
/// proxy's page): the decode leg has no KV parameters to take, so the request fails with 502
/// `x-error-pd-prefill` (class `invalid_response`), no decode leg is sent, and the failed call
/// counts as `error`/502. A 200 is no answer prefill failover routes again.
#[test]
fn a_prefill_answering_200_with_no_json_object_fails_the_request_with_502() {
    let fleet = one_roleset();
    let stack = start(fleet.clone(), &[]);
    stack.arm_fault(json!({"pod": "p-0", "kind": "oversized", "bytes": 64,
                           "not_json": true, "leg": "prefill"}));
    let mut clients = fire(&stack, 2, chat(false, 4));
    clients.extend(fire(&stack, 2, chat(true, 4)));
    for r in ended(clients) {
        assert_error(&r, 502, "x-error-pd-prefill");
        assert_eq!(
            r.json(),
            json!({"error": {"message": "prefill request failed (invalid_response): the prefill response is not a JSON object",
                             "type": "api_error", "code": null, "param": null}}),
            "{}",
            describe(&r)
        );
    }
    let prefills: Vec<Value> = stack
        .sim_requests()
        .into_iter()
        .filter(|e| e["leg"] == "prefill")
        .collect();
    assert_eq!(prefills.len(), 4, "one prefill leg each: {prefills:?}");
    assert!(prefills.iter().all(|e| e["fault"] == "oversized"));
    assert!(
        decode_legs(&stack, "d-0").is_empty(),
        "no decode after a failed prefill"
    );
    assert_eq!(fail_count(&stack, "pd_prefill_failure", "502"), 4.0);
    let prefill_fail = |status, code| {
        stack.metric(
            "gateway_prefill_request_fail_total",
            &[("status", status), ("status_code", code)],
        )
    };
    assert_eq!(prefill_fail("pd-do-prefill-request-error", "500"), 4.0);
    assert_eq!(prefill_fail("error", "502"), 4.0);
    assert_eq!(
        stack.metric("gateway_prefill_request_fail_total", &[]),
        8.0,
        "counted once per step and once per class, nothing else"
    );
    assert_eq!(
        stack.metric("pd_router_rejected_total", &[("reason", "prefill")]),
        4.0
    );
    assert_no_failover(&stack);
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// Prefill failover: a request whose prefill pod refuses the connection is routed again
/// without that pod, so the client never sees the dead pod, on any worker, while passive
/// ejection still takes it out of every worker's view after 3 failures (one failover each)
/// on one worker.
#[test]
fn a_prefill_pod_refusing_connections_costs_no_request() {
    prefill_failover_costs_no_request(json!({"pod": "p-0", "kind": "refuse"}));
}

/// The same for a prefill pod answering 500 to everything, as a vLLM server whose engine
/// died does until it exits.
#[test]
fn a_prefill_pod_answering_500_costs_no_request() {
    prefill_failover_costs_no_request(
        json!({"pod": "p-0", "kind": "status", "status": 500, "leg": "prefill"}),
    );
}

/// p-0 failing every prefill leg as `fault` says, on two tied rolesets: every request is
/// served by the other roleset, the failed ones after one failover each.
fn prefill_failover_costs_no_request(fault: Value) {
    // No ejection ends (and lets p-0 in again) while the test runs.
    let (fleet, stack) = two_tied_rolesets(r#""eject_base_ms": 60000"#, NO_REACHABILITY_CHECK);
    stack.arm_fault(fault);
    let workers = stack.concurrency as u64;
    let mut sent = 0;
    while !out_on_every_worker(&stack) {
        assert!(
            sent < 200,
            "{sent} requests and not every worker ejected p-0"
        );
        let r = stack.chat(&PD, &question(sent));
        sent += 1;
        assert_success(&r);
        assert_eq!(
            r.header("prefill-target-pod"),
            Some("p-1"),
            "{}",
            describe(&r)
        );
        assert_eq!(r.header("target-pod"), Some("d-1"), "{}", describe(&r));
    }
    // The failures ejection needed, each one routed again: 3 on the worker that ejected
    // first, and fewer than 3 on each other worker before its notice came (3 if it ejected on
    // its own first).
    let rerouted = failovers(&stack, "rerouted") as u64;
    assert!((3..=3 * workers).contains(&rerouted), "{rerouted}");
    // Each failed prefill call counts in AIBrix's failure counter, by transport class
    // only: no request failed at the route step.
    let prefill_fails =
        |labels: &[(&str, &str)]| stack.metric("gateway_prefill_request_fail_total", labels) as u64;
    assert_eq!(prefill_fails(&[]), rerouted);
    assert_eq!(
        prefill_fails(&[("status", "pd-do-prefill-request-error")]),
        0
    );
    assert_eq!(
        stack.metric("pd_router_routed_total", &[("kind", "pair")]),
        sent as f64,
        "each request routed once, failed over or not"
    );
    assert_eq!(failovers(&stack, "failed"), 0.0);
    assert!(
        decode_legs(&stack, "d-0").is_empty(),
        "group-0 lost its prefill pod"
    );
    stack.wait_for_log("routing again without it");
    // The access log (flushed by Envoy every second) names the pod each failed-over request
    // left, and only those requests name one.
    let lines = eventually(Duration::from_secs(10), || {
        let lines = stack.access_log_lines();
        if lines.len() >= sent {
            Ok(lines)
        } else {
            Err(format!("{} of {sent} access log lines", lines.len()))
        }
    });
    let failed_over = lines
        .iter()
        .filter(|l| l.contains("failed_prefill=default/p-0 "))
        .count();
    assert_eq!(failed_over as u64, rerouted, "{lines:#?}");
    assert!(
        lines
            .iter()
            .all(|l| l.contains("failed_prefill=default/p-0 ") || l.contains("failed_prefill=- ")),
        "{lines:#?}"
    );
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// Failover to a standard pod: with the only roleset's prefill pod refusing connections, the
/// request is routed again to the combined pod, which answers it whole.
#[test]
fn a_failed_over_request_may_land_on_a_combined_pod() {
    let fleet = one_roleset().combined("c-0");
    let stack = start(fleet.clone(), &[]);
    stack.arm_fault(json!({"pod": "p-0", "kind": "refuse"}));
    for i in 0..8 {
        let r = stack.chat(&PD, &question(i));
        assert_success(&r);
        assert_eq!(r.header("target-pod"), Some("c-0"), "{}", describe(&r));
        assert_eq!(r.header("prefill-target-pod"), None, "{}", describe(&r));
    }
    assert!(failovers(&stack, "rerouted") >= 1.0);
    assert_eq!(failovers(&stack, "failed"), 0.0);
    assert!(decode_legs(&stack, "d-0").is_empty());
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

#[test]
fn a_roleset_losing_its_decode_pod_in_flight_routes_new_requests_to_complete_rolesets() {
    let fleet = two_rolesets();
    // Count-based scores: the default prefix_cache would send every copy of the same prompt
    // to the roleset that served it first, and this test needs streams on both.
    let mut stack = start(
        fleet.clone(),
        &[
            ("AIBRIX_PREFILL_SCORE_POLICY", "least_request"),
            ("AIBRIX_DECODE_SCORE_POLICY", "least_request"),
        ],
    );
    for pod in ["d-0", "d-1"] {
        stack.arm_fault(
            json!({"pod": pod, "kind": "hang_after_chunks", "chunks": 1, "leg": "decode"}),
        );
    }
    // Open streams, two at a time, until both decode pods hold some: which pod a burst lands
    // on depends on the policy's view at that instant (a CI run once put six on d-1), so the
    // test does not bet on one burst spreading.
    let mut clients = Vec::new();
    while decode_legs(&stack, "d-0").is_empty() || decode_legs(&stack, "d-1").is_empty() {
        assert!(
            clients.len() < 24,
            "{} streams and still one decode pod holds none",
            clients.len()
        );
        clients.extend(fire(&stack, 2, chat(true, 20)));
        stack.wait_for_legs("decode", clients.len());
    }
    let opened = clients.len();
    let on_d0 = decode_legs(&stack, "d-0").len();

    // d-0 leaves the fleet while its streams are open; group-0 is now incomplete.
    stack.write_fleet(fleet.without("d-0"));
    stack.wait_fleet_adopted();
    stack.clear_faults_of("d-1");
    for _ in 0..4 {
        let r = stack.chat(&PD, &chat(false, 2));
        assert_success(&r);
        assert_eq!(r.header("target-pod"), Some("d-1"), "{}", describe(&r));
        assert_eq!(
            r.header("prefill-target-pod"),
            Some("p-1"),
            "{}",
            describe(&r)
        );
    }
    // The pod goes away for good, as a deleted pod does: its streams are cut.
    stack.arm_fault(json!({"pod": "d-0", "kind": "crash"}));
    let (mut cut, mut whole) = (0, 0);
    for r in ended(clients) {
        if r.header("target-pod") == Some("d-0") {
            assert_cut(&r);
            cut += 1;
        } else {
            assert_success(&r);
            whole += 1;
        }
    }
    assert_eq!((cut, whole), (on_d0, opened - on_d0));
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// Two clients sending requests back to back (one streaming, one not) until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    clients: Vec<JoinHandle<Vec<Response>>>,
}

impl Load {
    fn start(gateway: &str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let clients = (0..2)
            .map(|i| {
                let (addr, stop) = (gateway.to_string(), stop.clone());
                std::thread::spawn(move || {
                    let mut answers = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let body = chat(i == 0, 3);
                        answers.push(http::post_json(&addr, "/v1/chat/completions", &PD, &body));
                    }
                    answers
                })
            })
            .collect();
        Load { stop, clients }
    }

    /// Stops the clients and returns every answer they got.
    fn stop(self) -> Vec<Response> {
        self.stop.store(true, Ordering::Relaxed);
        self.clients
            .into_iter()
            .flat_map(|h| h.join().expect("load thread"))
            .collect()
    }
}

#[test]
fn pods_churning_under_load_never_fail_a_request() {
    let full = two_rolesets()
        .pod("p-2", "prefill", "group-2")
        .pod("d-2", "decode", "group-2")
        .combined("c-0");
    let mut stack = start(full.clone(), &[]);
    let shapes = [
        full.without("d-1"),
        full.clone(),
        full.without("p-2").without("c-0"),
        full.without("d-0").without("p-1"),
        full.clone(),
    ];
    let load = Load::start(&stack.gateway);
    // The churn itself: a new fleet every 500 ms, each adopted by Envoy before the next.
    for shape in shapes.iter().cycle().take(10) {
        stack.write_fleet(shape.clone());
        stack.wait_fleet_adopted();
        std::thread::sleep(Duration::from_millis(500));
    }
    let answers = load.stop();
    assert!(answers.len() >= 10, "too little load: {}", answers.len());
    for r in &answers {
        assert_success(r);
    }
    assert_clean_end(&stack, &fleet_pods(&full));
}

#[test]
fn an_ecds_reload_under_load_fails_no_request_and_keeps_the_ledger_exact() {
    let fleet = two_rolesets();
    let policies = ["least_request", "token_load", "prefix_cache", "token_load"];
    let stack = Stack::start_ecds(
        fleet.clone(),
        &[("AIBRIX_PREFILL_SCORE_POLICY", "token_load")],
    );
    let load = Load::start(&stack.gateway);
    // Every VM logs its first snapshot once (the loaded-VM gauge also counts the replaced
    // ones down, so it need not grow).
    let loads = || {
        stack
            .envoy_log()
            .lines()
            .filter(|l| l.contains("fleet snapshot") && l.ends_with(" loaded"))
            .count()
    };
    for (generation, policy) in policies.into_iter().enumerate() {
        let loaded = loads();
        let served = stack.stat("pd_router_requests_total");
        // A VM configuration never used before, so Envoy starts new VMs rather than reusing
        // a cached one with the same environment (token_load comes back in the list).
        let generation = generation.to_string();
        stack.update_ecds(&[
            ("AIBRIX_PREFILL_SCORE_POLICY", policy),
            ("PD_TEST_CONFIG_GENERATION", &generation),
        ]);
        // New VMs load the fleet, and the load keeps flowing through them.
        eventually(Duration::from_secs(20), || {
            (loads() > loaded && stack.stat("pd_router_requests_total") > served + 4)
                .then_some(())
                .ok_or_else(|| format!("no reload seen for {policy}"))
        });
    }
    let answers = load.stop();
    for r in &answers {
        assert_success(r);
    }
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// Sends a request on a raw connection and returns it unread.
fn open_request(addr: &str, body: &Value) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect to Envoy");
    let body = body.to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         routing-strategy: pd\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("send head");
    s.write_all(body.as_bytes()).expect("send body");
    s
}

#[test]
fn a_client_leaving_mid_prefill_releases_everything_it_held() {
    let fleet = one_roleset();
    let stack = start(fleet.clone(), &[]);
    stack.arm_fault(json!({"pod": "p-0", "kind": "hang_before_headers", "leg": "prefill"}));
    let clients: Vec<TcpStream> = (0..3)
        .map(|_| open_request(&stack.gateway, &chat(false, 4)))
        .collect();
    stack.wait_for_legs("prefill", 3);
    eventually(Duration::from_secs(10), || {
        let held = stack.metric("pd_router_prefill_inflight", &[("pod_name", "p-0")]);
        (held == 3.0)
            .then_some(())
            .ok_or_else(|| format!("the ledger shows {held} prefill legs on p-0, not 3"))
    });
    drop(clients);
    // The charges go as the streams end, while the prefill legs still hang at the pod.
    stack.wait_ledger_zero();
    eventually(Duration::from_secs(10), || {
        let aborted = fail_count(&stack, "response_fail", "499");
        (aborted == 3.0)
            .then_some(())
            .ok_or_else(|| format!("{aborted} of 3 departures counted"))
    });
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
    assert!(
        decode_legs(&stack, "d-0").len() == 1,
        "only the final check's request reached the decode pod"
    );
}

/// A client behind an HTTP/2 front proxy pressing "stop": its stream is reset (RST_STREAM)
/// mid-generation while its connection stays up. Envoy names that `http2.remote_reset`, not
/// `downstream_*`; read as the pod's doing, each cancel counted as a 502 cut and as a failure
/// of the decode pod, and three of them ejected a healthy pod.
#[test]
fn an_http2_client_cancelling_its_stream_is_not_blamed_on_the_pod() {
    let fleet = one_roleset();
    let stack = start(fleet.clone(), &[]);
    let cancels = 3; // the default `eject_after_failures`
    async_client::runtime().block_on(async {
        let client = async_client::client(true);
        for _ in 0..cancels {
            let mut r = async_client::pd_chat(&client, &stack.gateway, &chat(true, 200)).await;
            assert_eq!(r.status().as_u16(), 200);
            let first = r.chunk().await.expect("a first chunk");
            assert!(first.is_some_and(|c| !c.is_empty()));
            drop(r); // resets the stream; the connection (in `client`) stays open
        }
        // One whole request after them on the same connection: its frames follow the last
        // reset, which this single-threaded runtime only writes while a request awaits.
        let r = async_client::pd_chat(&client, &stack.gateway, &chat(false, 2)).await;
        assert_success(&async_client::answer(r).await);
        eventually(Duration::from_secs(10), || {
            let cancelled = fail_count(&stack, "response_cut", "499");
            (cancelled == f64::from(cancels))
                .then_some(())
                .ok_or_else(|| format!("{cancelled} of {cancels} cancels counted as the client's"))
        });
        assert_eq!(
            envoy_stat(&stack, "http.pd_ingress.downstream_cx_http2_total"),
            1
        );
    });
    assert_eq!(fail_count(&stack, "response_cut", "502"), 0.0);
    assert_eq!(
        stack.filter_stat("pd_router_ejections_total"),
        Some(0),
        "d-0 did nothing wrong"
    );
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

#[test]
fn a_slow_reader_gets_its_whole_stream_and_holds_up_nobody() {
    let fleet = one_roleset();
    // A long stream: 200 tokens at pd-sim's decode pace.
    let stack = start(fleet.clone(), &[]);
    let (first_chunk_tx, first_chunk_rx) = mpsc::channel();
    let (go_on_tx, go_on_rx) = mpsc::channel::<()>();
    let addr = stack.gateway.clone();
    let reader = std::thread::spawn(move || {
        let mut s = open_request(&addr, &chat(true, 200));
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).expect("first bytes");
        got.extend_from_slice(&buf[..n]);
        first_chunk_tx.send(()).expect("signal");
        go_on_rx.recv().expect("go on");
        // The slow reader itself: 64 bytes at a time with a pause, far slower than pd-sim
        // produces tokens, so Envoy buffers and applies flow control behind it.
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => panic!("slow reader lost its stream: {e}"),
            }
            if got.ends_with(b"0\r\n\r\n") {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        String::from_utf8_lossy(&got).into_owned()
    });
    first_chunk_rx.recv().expect("first chunk");
    // While the slow reader sits on its stream, other requests flow normally.
    for _ in 0..3 {
        assert_success(&stack.chat(&PD, &chat(false, 2)));
    }
    go_on_tx.send(()).expect("go on");
    eventually(ALL_ENDED, || {
        if reader.is_finished() {
            Ok(())
        } else {
            Err("the slow reader is still reading".to_string())
        }
    });
    let stream = reader.join().expect("reader");
    assert!(stream.starts_with("HTTP/1.1 200"), "{stream}");
    assert!(
        stream.contains("data: [DONE]"),
        "the whole stream arrived: {stream}"
    );
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// Whether every worker has taken a pod out of its view, by its own ejection or another's
/// notice. The counters are process-wide and the main thread's VM, which never routes, adopts
/// notices too (at most once per ejection): own ejections plus adoptions above the worker
/// count leave no worker out.
fn out_on_every_worker(stack: &Stack) -> bool {
    let own = stack.stat("pd_router_ejections_total");
    let adopted = stack.stat("pd_router_ejections_adopted_total");
    own + adopted > stack.concurrency as u64
}

/// A failing pod leaves each worker's routing view after `eject_after_failures` (3)
/// consecutive failures there, so at most 3 requests per worker fail; the rest go to the
/// other roleset; once the pod serves again it comes back after the ejection period.
fn failing_pod_is_ejected_then_readmitted(fault: Value, failed_status: u16, header: Option<&str>) {
    // Longer than the requests below take even on a loaded box, so no ejection ends (and
    // lets a failure in again) before the test looks. Failover off: this test counts the
    // failures ejection lets through.
    let (fleet, stack) = two_tied_rolesets(
        r#""eject_base_ms": 8000, "prefill_failover": 0"#,
        NO_REACHABILITY_CHECK,
    );
    stack.arm_fault(fault);
    let ask = |i: usize| stack.chat(&PD, &question(i));
    // Until every worker has the pod out: ejected after 3 failures it saw itself, or told
    // by a worker that did.
    let mut failed = 0;
    let mut sent = 0;
    while !out_on_every_worker(&stack) {
        assert!(
            sent < 200,
            "{sent} requests and not every worker ejected the pod"
        );
        let r = ask(sent);
        sent += 1;
        if r.status == 200 {
            assert_success(&r);
        } else {
            match header {
                Some(h) => assert_error(&r, failed_status, h),
                // The pod's own error answer, relayed as it is.
                None => assert_eq!(r.status, failed_status, "{}", describe(&r)),
            }
            failed += 1;
        }
    }
    assert!(
        failed <= 3 * stack.concurrency,
        "{failed} requests failed; ejection allows at most 3 per worker"
    );
    // From now on no request reaches the failing roleset.
    for i in 0..10 {
        let r = ask(1000 + i);
        assert_success(&r);
        assert_eq!(
            r.header("prefill-target-pod"),
            Some("p-1"),
            "{}",
            describe(&r)
        );
    }
    assert!(stack.stat("pd_router_ejections_total") >= 1);
    stack.wait_for_log("ejecting pod default/");

    // Healthy again: after the ejection period the pod takes requests once more.
    stack.clear_faults();
    until_routed_to(
        &stack,
        &PD,
        "prefill-target-pod",
        "p-0",
        5000,
        Duration::from_secs(25),
    );
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// Whether pd-control's snapshot gives `pod` the mark `field` (`unreachable`, `stalled`) as
/// `want`s; an error says what it shows instead.
fn marked(snap: &Value, pod: &str, field: &str, want: bool) -> Result<(), String> {
    let entry = snapshot_pods(snap).find(|p| p["name"] == pod);
    let is = entry.and_then(|p| p[field].as_bool()) == Some(true);
    if is == want {
        Ok(())
    } else {
        Err(format!("{pod} {field}: {is}, want {want}"))
    }
}

fn marked_unreachable(snap: &Value, pod: &str, want: bool) -> Result<(), String> {
    marked(snap, pod, "unreachable", want)
}

/// pd-control finds an engine that stopped taking connections (3 refused scrapes, about
/// 150 ms at its 50 ms interval) and marks it unreachable; every worker then routes around
/// it at once. A dead decode or standard pod, which failover cannot save, then costs no
/// request: none is sent there, so none fails and nothing needs ejecting. Its first answered
/// scrape brings it back. Policies that see only the ledger (token_load, least-request)
/// would otherwise send the dead pods, idle by every count, about half the requests.
#[test]
fn a_pod_pd_control_cannot_reach_costs_no_request_on_any_worker() {
    let fleet = two_rolesets().combined("c-0").combined("c-1");
    let stack = start_simulating_rogue(
        fleet.clone(),
        &Options {
            // Failover off: only pd-control's mark can save these requests.
            plugin_extra: r#""prefill_failover": 0"#,
            explain: true,
            envoy_env: &[
                ("AIBRIX_PREFILL_SCORE_POLICY", "token_load"),
                ("AIBRIX_DECODE_SCORE_POLICY", "token_load"),
            ],
            ..Options::default()
        },
    );
    let (pd, single) = (PD, [("routing-strategy", "least-request")]);
    let ask = |headers: &[(&str, &str)], i: usize| stack.chat(headers, &question(i));
    wait_scraped(&stack, &["d-0", "c-0"]);

    // The engines die: their connections close (pd-control's kept-alive ones too) and new
    // ones are refused.
    for pod in ["d-0", "c-0"] {
        stack.arm_fault(json!({"pod": pod, "kind": "crash"}));
    }
    stack.wait_snapshot_adopted(|snap| {
        marked_unreachable(snap, "d-0", true)?;
        marked_unreachable(snap, "c-0", true)
    });
    let pods = |role, state| control_pods(&stack, role, state);
    assert_eq!(
        [pods("decode", "ready"), pods("decode", "unreachable")],
        [Some(1.0), Some(1.0)]
    );
    assert_eq!(pods("other", "unreachable"), Some(1.0));
    for n in 0..12 {
        let r = ask(&pd, 1000 + n);
        assert_success(&r);
        assert_eq!(r.header("target-pod"), Some("d-1"), "{}", describe(&r));
        assert_eq!(
            r.header("prefill-target-pod"),
            Some("p-1"),
            "group-0 is incomplete without d-0: {}",
            describe(&r)
        );
        let r = ask(&single, 2000 + n);
        assert_success(&r);
        assert_eq!(r.header("target-pod"), Some("c-1"), "{}", describe(&r));
    }
    assert_eq!(
        stack.filter_stat("pd_router_ejections_total"),
        Some(0),
        "nothing failed"
    );
    let log = std::fs::read_to_string(stack.dir.join("pd-control.log")).expect("pd-control log");
    assert!(log.contains("marked unreachable"), "{log}");
    // An explanation says why the dead pods got nothing.
    for headers in [&pd[..], &single[..]] {
        let mut asked = headers.to_vec();
        asked.push(("x-pd-explain", "1"));
        let r = ask(&asked, 3000);
        let explained = r.header("x-pd-explain").unwrap_or_default();
        for pod in ["d-0:unreachable", "c-0:unreachable"] {
            assert!(explained.contains(pod), "{explained}");
        }
    }

    // Back: the first answered scrape clears the mark, and the pods take requests again.
    stack.clear_faults();
    stack.wait_snapshot_adopted(|snap| {
        marked_unreachable(snap, "d-0", false)?;
        marked_unreachable(snap, "c-0", false)
    });
    let before = decode_legs(&stack, "d-0").len();
    let (mut pd_back, mut single_back) = (false, false);
    let mut i = 3000;
    eventually(Duration::from_secs(15), || {
        i += 1;
        assert_success(&ask(&pd, i));
        let r = ask(&single, i);
        assert_success(&r);
        single_back |= r.header("target-pod") == Some("c-0");
        pd_back |= decode_legs(&stack, "d-0").len() > before;
        (pd_back && single_back)
            .then_some(())
            .ok_or_else(|| format!("back: d-0 {pd_back}, c-0 {single_back}"))
    });
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// A pod already dead when pd-control starts (here pd-control restarts after the pod's engine
/// died, so it never heard from that pod) is marked unreachable too, once another pod of its
/// model has answered: the sibling proves pd-control reaches the model's pods, so the dead
/// pod's refusals are taken at their word. No request goes there.
#[test]
fn a_pod_dead_before_pd_control_restarts_is_still_marked_unreachable() {
    let fleet = Fleet::new(MODEL).combined("c-0").combined("c-1");
    let mut stack = start_checked(fleet.clone(), &[]);
    wait_scraped(&stack, &["c-0", "c-1"]);
    stack.arm_fault(json!({"pod": "c-0", "kind": "crash"}));
    stack.restart_control(&[]);
    stack.wait_snapshot_adopted(|snap| marked_unreachable(snap, "c-0", true));
    let single = [("routing-strategy", "least-request")];
    for n in 0..12 {
        let r = stack.chat(&single, &question(n));
        assert_success(&r);
        assert_eq!(r.header("target-pod"), Some("c-1"), "{}", describe(&r));
    }
    assert_eq!(
        stack.filter_stat("pd_router_ejections_total"),
        Some(0),
        "nothing failed"
    );
    stack.clear_faults();
    stack.wait_snapshot_adopted(|snap| marked_unreachable(snap, "c-0", false));
}

/// A decode pod that dies while its pair's prefill runs: once pd-control has marked it, the
/// decode leg goes to the roleset's other decode pod when the prefill answers (vLLM pulls the
/// KV from the prefill pod, whichever decode pod asks), and the request succeeds where it
/// would have met a dead pod.
#[test]
fn a_decode_pod_dying_during_the_prefill_hands_the_decode_leg_to_its_roleset_sibling() {
    let fleet = Fleet::new(MODEL)
        .pod("p-0", "prefill", "group-0")
        .pod("d-0", "decode", "group-0")
        .pod("d-1", "decode", "group-0");
    let stack = start_checked(fleet.clone(), &[]);
    wait_scraped(&stack, &["d-0", "d-1"]);
    // The prefill leg waits at p-0 until the test lets it answer.
    stack.arm_fault(json!({"pod": "p-0", "kind": "hang_before_headers", "leg": "prefill"}));
    let client = fire(&stack, 1, chat(false, 4));
    stack.wait_for_legs("prefill", 1);
    let selected = |pod: &str| stack.metric("pd_selected_decode_pod_total", &[("pod", pod)]);
    let (chosen, sibling) = if selected("d-0") == 1.0 {
        ("d-0", "d-1")
    } else {
        ("d-1", "d-0")
    };
    assert_eq!(selected(chosen), 1.0);
    stack.arm_fault(json!({"pod": chosen, "kind": "crash"}));
    stack.wait_snapshot_adopted(|snap| marked_unreachable(snap, chosen, true));
    stack.clear_faults_of("p-0");
    let r = ended(client).remove(0);
    assert_success(&r);
    assert_eq!(r.header("target-pod"), Some(sibling), "{}", describe(&r));
    assert_eq!(
        r.header("prefill-target-pod"),
        Some("p-0"),
        "{}",
        describe(&r)
    );
    assert_eq!(decode_legs(&stack, sibling).len(), 1);
    assert_eq!(stack.stat("pd_router_decode_rerouted_total"), 1);
    stack.wait_for_log("left the routing view during the prefill");
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// A pod whose engine holds running requests and makes no progress on them (a hung GPU
/// behind an HTTP server that still answers) is marked stalled by pd-control once no counter
/// has moved for `--stalled-after`, and every worker routes around it; when its counters move
/// again it is routed to once more. `random` would otherwise send it half the requests.
#[test]
fn a_pod_sitting_on_its_requests_is_routed_around_until_it_moves_again() {
    let fleet = Fleet::new(MODEL)
        .combined("c-0")
        .label("tier", "stuck")
        .combined("c-1");
    let stack = start_simulating_rogue(
        fleet.clone(),
        &Options {
            control_args: &["--stalled-after", "300ms"],
            ..Options::default()
        },
    );
    let random = [("routing-strategy", "random")];
    wait_scraped(&stack, &["c-0"]);
    // Two streams on c-0 stop after their first chunk: running, and nothing moves.
    stack.arm_fault(
        json!({"pod": "c-0", "kind": "hang_after_chunks", "chunks": 1,
                           "leg": "full", "times": 2}),
    );
    let streams: Vec<JoinHandle<Response>> = (0..2)
        .map(|_| {
            let addr = stack.gateway.clone();
            std::thread::spawn(move || {
                let headers = [
                    ("routing-strategy", "random"),
                    ("external-filter", "tier=stuck"),
                ];
                http::post_json(&addr, "/v1/chat/completions", &headers, &chat(true, 20))
            })
        })
        .collect();
    stack.wait_for_legs("full", 2);
    stack.wait_snapshot_adopted(|snap| marked(snap, "c-0", "stalled", true));
    assert_eq!(control_pods(&stack, "other", "stalled"), Some(1.0));
    for i in 0..12 {
        let r = stack.chat(&random, &question(i));
        assert_success(&r);
        assert_eq!(r.header("target-pod"), Some("c-1"), "{}", describe(&r));
    }
    let log = std::fs::read_to_string(stack.dir.join("pd-control.log")).expect("pd-control log");
    assert!(log.contains("marked stalled"), "{log}");

    // The engine moves again: the streams finish and the mark goes.
    stack.clear_faults();
    for r in ended(streams) {
        assert_success(&r);
        assert_eq!(r.header("target-pod"), Some("c-0"));
    }
    stalled_mark_goes(&stack, "c-0", &fleet);
}

/// TensorRT-LLM adds to its token and request counters only when a request ends (as SGLang
/// does), and refreshes its gauges only then too: a decode pod generating one long answer
/// moves nothing for the answer's whole length. pd-control does not judge its stillness, so it
/// is never marked stalled, however long the answer (it was, `--stalled-after` into it).
#[test]
fn a_trtllm_pod_generating_a_long_answer_is_not_marked_stalled() {
    let fleet = Fleet::new(MODEL)
        .engine("trtllm")
        .pod("p-0", "prefill", "group-0")
        .pod("d-0", "decode", "group-0");
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet,
        &Options {
            control_args: &["--stalled-after", "300ms"],
            sim_args: &["--decode-ms-per-token", "40"],
            ..Options::default()
        },
    );
    wait_scraped(&stack, &["d-0"]);
    // About 2.4 s of decoding, no request ending meanwhile.
    let r = stack.chat(&PD, &chat(true, 60));
    assert_success(&r);
    assert_eq!(r.header("target-pod"), Some("d-0"));
    let log = std::fs::read_to_string(stack.dir.join("pd-control.log")).expect("pd-control log");
    assert!(!log.contains("marked stalled"), "{log}");
}

/// Once `pod`'s stalled mark is gone from the snapshot every worker routes on, `random`
/// reaches it again; then nothing is left charged.
fn stalled_mark_goes(stack: &Stack, pod: &str, fleet: &Fleet) {
    stack.wait_snapshot_adopted(|snap| marked(snap, pod, "stalled", false));
    let random = [("routing-strategy", "random")];
    until_routed_to(
        stack,
        &random,
        "target-pod",
        pod,
        100,
        Duration::from_secs(15),
    );
    assert_clean_end(stack, &fleet_pods(fleet));
}

/// An engine whose server is wedged (its port takes connections and answers nothing, its
/// `/metrics` included) cannot show a stall in its readings and refuses nothing, so neither
/// other mark fits; pd-control marks it stalled once its scrapes have timed out for
/// `--stalled-after`, and every worker routes around it. Unwedged, it is routed to again.
#[test]
fn a_wedged_engine_is_marked_stalled_and_routed_around() {
    let fleet = Fleet::new(MODEL).combined("c-0").combined("c-1");
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet.clone(),
        &Options {
            control_args: &["--scrape-timeout", "300ms", "--stalled-after", "1s"],
            ..Options::default()
        },
    );
    let random = [("routing-strategy", "random")];
    wait_scraped(&stack, &["c-0", "c-1"]);
    stack.arm_fault(json!({"pod": "c-0", "kind": "wedge"}));
    stack.wait_snapshot_adopted(|snap| marked(snap, "c-0", "stalled", true));
    assert_eq!(control_pods(&stack, "other", "stalled"), Some(1.0));
    // Logged with the next scrape's timeout, which may come after the snapshot.
    eventually(Duration::from_secs(10), || {
        let log = std::fs::read_to_string(stack.dir.join("pd-control.log")).unwrap_or_default();
        log.contains("answered none; marked stalled")
            .then_some(())
            .ok_or_else(|| "pd-control has not logged the mark".to_string())
    });
    for i in 0..12 {
        let r = stack.chat(&random, &question(i));
        assert_success(&r);
        assert_eq!(r.header("target-pod"), Some("c-1"), "{}", describe(&r));
    }

    stack.clear_faults();
    stalled_mark_goes(&stack, "c-0", &fleet);
}

/// A worker that ejects a pod tells the others, which take it out at once: requests on one
/// connection (one worker) see the pod fail 3 times and eject it, and then requests on fresh
/// connections, which land on every worker, never reach it. Without the notice each worker
/// would first fail 3 requests of its own.
#[test]
fn a_pod_one_worker_ejects_leaves_every_worker() {
    let (fleet, stack) = two_tied_rolesets(
        r#""eject_base_ms": 60000, "prefill_failover": 0"#,
        NO_REACHABILITY_CHECK,
    );
    stack.arm_fault(json!({"pod": "d-0", "kind": "status", "status": 500, "leg": "decode"}));
    let mut one_worker = http::KeepAlive::connect(&stack.gateway).expect("connect");
    let mut failed = 0;
    let mut sent = 0;
    while stack.stat("pd_router_ejections_total") == 0 {
        assert!(sent < 100, "{sent} requests and d-0 not ejected");
        let r = one_worker
            .post_json("/v1/chat/completions", &PD, &question(sent))
            .expect("answer");
        sent += 1;
        if r.status != 200 {
            assert_eq!(r.status, 500, "{}", describe(&r));
            failed += 1;
        }
    }
    assert_eq!(failed, 3, "one worker, 3 failures in a row of d-0");
    // Every other VM (the other workers and the main thread's) takes the notice.
    eventually(Duration::from_secs(10), || {
        let adopted = stack.stat("pd_router_ejections_adopted_total");
        (adopted >= stack.concurrency as u64)
            .then_some(())
            .ok_or_else(|| format!("{adopted} VMs took the notice"))
    });
    for i in 0..20 {
        let r = stack.chat(&PD, &question(1000 + i));
        assert_success(&r);
        assert_eq!(
            r.header("prefill-target-pod"),
            Some("p-1"),
            "{}",
            describe(&r)
        );
    }
    assert_eq!(
        stack.stat("pd_router_ejections_total"),
        1,
        "no worker needed its own"
    );
    stack.wait_for_log("out of routing until another worker's ejection of it ends");
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

#[test]
fn a_prefill_pod_refusing_connections_is_ejected_then_readmitted() {
    failing_pod_is_ejected_then_readmitted(
        json!({"pod": "p-0", "kind": "refuse"}),
        502,
        Some("x-error-pd-prefill"),
    );
}

/// With failover off, a prefill pod's own 500s reach clients until ejection takes it out.
#[test]
fn a_prefill_pod_answering_500_is_ejected_then_readmitted() {
    failing_pod_is_ejected_then_readmitted(
        json!({"pod": "p-0", "kind": "status", "status": 500, "leg": "prefill"}),
        500,
        Some("x-error-pd-prefill"),
    );
}

#[test]
fn a_decode_pod_answering_500_is_ejected_and_its_roleset_skipped() {
    failing_pod_is_ejected_then_readmitted(
        json!({"pod": "d-0", "kind": "status", "status": 500, "leg": "decode"}),
        500,
        None,
    );
}

/// An Envoy stat that is not the filter's (`cluster.<name>.<stat>`). Envoy defines the ones
/// read here up front, so one missing fails the test: a 0 read is a real 0.
fn envoy_stat(stack: &Stack, name: &str) -> u64 {
    stack
        .envoy_stat(name)
        .unwrap_or_else(|| panic!("Envoy has no stat {name}"))
}

/// session-affinity's session id for the pod at `address`: requests carrying it choose that
/// pod for as long as it is in view.
fn session_id(address: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(address)
}

/// Waits until every VM routes on a snapshot that lets it name stand-ins.
fn wait_stand_ins_allowed(stack: &Stack) {
    stack.wait_snapshot_adopted(|snap| {
        (snap["eds"] == true)
            .then_some(())
            .ok_or_else(|| "the snapshot names no stand-ins".to_string())
    });
}

/// `pd_router_stand_in_retries_total{result}`.
fn stand_ins(stack: &Stack, result: &str) -> f64 {
    stack.metric("pd_router_stand_in_retries_total", &[("result", result)])
}

/// Requests pd-sim logged per pod (any leg).
fn requests_at(stack: &Stack, pod: &str) -> usize {
    stack
        .sim_requests()
        .iter()
        .filter(|e| e["pod"] == pod)
        .count()
}

/// A client naming pods in the retrying cluster's header picks nothing: on requests the filter
/// names no stand-in for (no pod here has a sibling) the header is dropped, so the requests
/// go where the filter routed them, not down the retrying route to the pods the client
/// listed.
#[test]
fn a_client_sent_destinations_header_picks_no_pod() {
    let fleet = one_roleset().combined("c-0");
    let stack = start(fleet.clone(), &[]);
    wait_stand_ins_allowed(&stack);
    let p0 = fleet.spec("p-0").address();
    let d0 = fleet.spec("d-0").address();
    let c0 = fleet.spec("c-0").address();
    // A PD request asking for its decode leg on the prefill pod.
    let r = stack.chat(
        &[PD.as_slice(), &[("x-pd-destinations", p0.as_str())]].concat(),
        &question(0),
    );
    assert_success(&r);
    assert_eq!(r.header("target-pod"), Some("d-0"), "{}", describe(&r));
    // A single-pod request asking for the decode pod instead of the standard pod.
    let to_c0 = session_id(&c0);
    let r = stack.chat(
        &[
            ("routing-strategy", "session-affinity"),
            ("x-session-id", to_c0.as_str()),
            ("x-pd-destinations", d0.as_str()),
        ],
        &question(1),
    );
    assert_success(&r);
    assert_eq!(r.header("target-pod"), Some("c-0"), "{}", describe(&r));
    assert_eq!(
        [
            requests_at(&stack, "p-0"),
            requests_at(&stack, "d-0"),
            requests_at(&stack, "c-0")
        ],
        [1, 1, 1],
        "{:#?}",
        stack.sim_requests()
    );
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// A standard pod whose engine died since the last snapshot (pd-control's reachability check
/// off here, so nothing told the gateway) refuses the connection: Envoy retries on the
/// stand-in the filter named with the request, and the client gets its answer from the sibling
/// instead of a 503. The dead pod hears of the failure (passive ejection takes it out), and
/// the answer, the access log and the counters name the pod that served.
#[test]
fn a_standard_pod_refusing_the_connection_is_stood_in_for_by_a_sibling() {
    let fleet = Fleet::new(MODEL).combined("c-0").combined("c-1");
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet.clone(),
        &Options {
            control_args: NO_REACHABILITY_CHECK,
            explain: true,
            ..Options::default()
        },
    );
    // session-affinity with c-0's session id: c-0 is chosen for as long as it is in view.
    let session = session_id(&fleet.spec("c-0").address());
    let to_c0 = [
        ("routing-strategy", "session-affinity"),
        ("x-session-id", session.as_str()),
    ];
    let explained = [to_c0.as_slice(), &[("x-pd-explain", "1")]].concat();
    let r = stack.chat(&explained, &question(0));
    assert_success(&r);
    assert_eq!(r.header("target-pod"), Some("c-0"), "{}", describe(&r));
    let why = r.header("x-pd-explain").unwrap_or_default();
    assert!(
        why.contains("pick=c-0") && why.contains("stand_in=c-1") && !why.contains("stand_in_"),
        "the explanation names the stand-in: {why}"
    );
    assert_eq!(stand_ins(&stack, "served"), 0.0);

    stack.arm_fault(json!({"pod": "c-0", "kind": "crash"}));
    let r = stack.chat(&explained, &question(1));
    assert_success(&r);
    assert_eq!(r.header("target-pod"), Some("c-1"), "{}", describe(&r));
    let why = r.header("x-pd-explain").unwrap_or_default();
    assert!(
        why.contains("stand_in=c-1; stand_in_served"),
        "the explanation says the stand-in served: {why}"
    );
    assert_eq!(stand_ins(&stack, "served"), 1.0);
    assert_eq!(
        envoy_stat(&stack, "cluster.pd_pods_retry.upstream_rq_retry_success"),
        1
    );
    assert_eq!(requests_at(&stack, "c-1"), 1);
    // The access log names the stand-in and, in Envoy's own field, the host the retry reached.
    let c1 = format!("upstream={}", fleet.spec("c-1").address());
    eventually(Duration::from_secs(5), || {
        let lines = stack.access_log_lines();
        lines
            .iter()
            .any(|l| l.contains(" 200 ") && l.contains("target=c-1") && l.contains(&c1))
            .then_some(())
            .ok_or_else(|| format!("no 200 line naming c-1 and {c1}: {lines:?}"))
    });

    // Every request keeps succeeding; c-0's refusals count as failures, so it leaves the
    // routing view and the affinity falls through to c-1 without a retry.
    for i in 2..30 {
        let r = stack.chat(&to_c0, &question(i));
        assert_success(&r);
        assert_eq!(r.header("target-pod"), Some("c-1"), "{}", describe(&r));
    }
    assert!(stack.stat("pd_router_ejections_total") >= 1);
    let stood_in = stand_ins(&stack, "served");
    assert!(
        (1.0..=3.0 * stack.concurrency as f64).contains(&stood_in),
        "{stood_in} stand-ins: at most 3 refusals per worker before c-0 is ejected"
    );
    assert_eq!(requests_at(&stack, "c-1"), 29);
    assert_eq!(stand_ins(&stack, "failed"), 0.0);
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// The hosts Envoy's retrying cluster knows, `ip:port`, from the admin `/clusters` page.
fn retry_cluster_hosts(stack: &Stack) -> Vec<String> {
    let text = http::get(&stack.admin, "/clusters")
        .expect("Envoy admin")
        .text();
    let mut hosts: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("pd_pods_retry::")?.split_once("::cx_active"))
        .map(|(host, _)| host.to_string())
        .collect();
    hosts.sort();
    hosts
}

/// The retrying cluster of a gateway that cannot read pd-control's endpoint file (an Istio
/// gateway) learns the pods from pd-control's gRPC EDS service instead: Envoy starts with the
/// listing, follows a fleet edit pushed on the stream, and a crashed pod's request is served
/// by its stand-in as with the file.
#[test]
fn the_retrying_cluster_can_learn_its_pods_over_grpc_eds() {
    let fleet = Fleet::new(MODEL).combined("c-0").combined("c-1");
    let grown = fleet.clone().combined("c-2");
    let simulated = grown.clone().combined("c-3");
    let mut stack = Stack::start_opts(
        fleet.clone(),
        simulated.clone(),
        &Options {
            control_args: NO_REACHABILITY_CHECK,
            eds_over_grpc: true,
            ..Options::default()
        },
    );
    // pd-control writes no endpoint file here (the seeded one lists no pod, and the
    // cluster does not read it): the stream is the only source.
    let address = |pod: &str| simulated.spec(pod).address();
    assert_eq!(
        retry_cluster_hosts(&stack),
        [address("c-0"), address("c-1")]
    );
    assert_eq!(stack.control_metric("pd_control_xds_streams"), 1.0);

    let wait_hosts = |stack: &Stack, want: Vec<String>| {
        eventually(Duration::from_secs(15), || {
            let hosts = retry_cluster_hosts(stack);
            (hosts == want).then_some(()).ok_or(format!(
                "the retrying cluster holds {hosts:?}, want {want:?}"
            ))
        })
    };
    stack.write_fleet(grown.clone());
    wait_hosts(&stack, ["c-0", "c-1", "c-2"].map(address).to_vec());
    // Envoy took the listing (its ACK): the snapshots every worker routes on name stand-ins.
    wait_stand_ins_allowed(&stack);
    assert!(stack.control_metric("pd_control_xds_acks_total") >= 1.0);

    stack.arm_fault(json!({"pod": "c-0", "kind": "crash"}));
    let session = session_id(&address("c-0"));
    let to_c0 = [
        ("routing-strategy", "session-affinity"),
        ("x-session-id", session.as_str()),
    ];
    let r = stack.chat(&to_c0, &question(0));
    assert_success(&r);
    assert_ne!(r.header("target-pod"), Some("c-0"), "{}", describe(&r));
    assert_eq!(stand_ins(&stack, "served"), 1.0);
    assert_eq!(stack.control_metric("pd_control_xds_nacks_total"), 0.0);
    stack.clear_faults();

    // A restarted pd-control: Envoy reconnects to it (keeping its hosts meanwhile) and
    // follows its changes.
    stack.restart_control(NO_REACHABILITY_CHECK);
    stack.write_fleet(simulated.clone());
    wait_hosts(&stack, ["c-0", "c-1", "c-2", "c-3"].map(address).to_vec());
    assert_eq!(stack.control_metric("pd_control_xds_streams"), 1.0);
    assert_clean_end(&stack, &fleet_pods(&simulated));
}

/// With pd-control's listing on EDS alone, only a gateway whose own stream took it names
/// stand-ins: pd-control answers each snapshot poll for the polling Envoy node
/// (`x-pd-node` → `x-pd-eds-here`). Gateway B (another node, its EDS source unreachable, so
/// its retrying cluster is empty) routes as without stand-ins and never tries its empty
/// cluster; gateway A, whose stream took the listing, has a crashed pod stood in for.
#[test]
fn only_a_gateway_whose_cluster_took_the_listing_names_stand_ins() {
    let fleet = Fleet::new(MODEL).combined("c-0").combined("c-1");
    let mut stack = Stack::start_opts(
        fleet.clone(),
        fleet.clone(),
        &Options {
            control_args: NO_REACHABILITY_CHECK,
            eds_over_grpc: true,
            ..Options::default()
        },
    );
    wait_stand_ins_allowed(&stack);
    let nowhere = format!("127.0.0.1:{}", pd_wasm_tests::stack::free_port());
    let cds_b = stack.dir.join("cds-b.json");
    let b = stack.add_gateway_edited(|config| {
        let config = config.replace(
            "node: {id: pd-router, cluster: pd-router}",
            "node: {id: gateway-b, cluster: pd-router}",
        );
        // An EDS source that never answers: the cluster starts empty after 1 s.
        pd_wasm_tests::stack::eds_over_grpc(config, &nowhere, &cds_b, Some("1s"))
    });
    let session = session_id(&fleet.spec("c-0").address());
    let to_c0 = [
        ("routing-strategy", "session-affinity"),
        ("x-session-id", session.as_str()),
    ];
    let random = [("routing-strategy", "random")];
    for i in 0..8 {
        let path = "/v1/chat/completions";
        let r = http::post_json(&b.gateway, path, &random, &chat(false, 4 + i));
        assert_success(&r);
    }
    assert_eq!(
        b.metric("pd_router_stand_in_retries_total", &[("result", "no_host")]),
        0.0,
        "B never sent a request into its empty cluster"
    );

    stack.arm_fault(json!({"pod": "c-0", "kind": "crash"}));
    let path = "/v1/chat/completions";
    let via_b = http::post_json(&b.gateway, path, &to_c0, &chat(false, 4));
    assert_eq!(via_b.status, 503, "no stand-in at B: {}", describe(&via_b));
    assert_eq!(
        b.metric("pd_router_stand_in_retries_total", &[("result", "no_host")]),
        0.0
    );
    let via_a = stack.chat(&to_c0, &question(1));
    assert_success(&via_a);
    assert_eq!(stand_ins(&stack, "served"), 1.0);
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// A gateway whose retrying cluster does not know the pods (its endpoint listing stopped
/// matching the snapshots: here the file emptied behind a stopped pd-control) must not keep
/// failing named requests: the first on each worker fails with Envoy's `no healthy upstream`
/// (no host tried), and that worker then names no stand-in for a while, so every later
/// request routes as without stand-ins and succeeds.
#[test]
fn a_retrying_cluster_that_lacks_the_pods_turns_stand_ins_off() {
    let fleet = Fleet::new(MODEL).combined("c-0").combined("c-1");
    let mut stack = start(fleet.clone(), &[]);
    wait_stand_ins_allowed(&stack);
    stack.kill("pd-control");
    let file = stack.eds_dir().join(pd_wasm_tests::stack::EDS_FILE);
    let tmp = stack.eds_dir().join("empty.tmp");
    let empty = json!({"version_info": "emptied", "resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": "pd_pods_retry"}]});
    std::fs::write(&tmp, empty.to_string()).expect("listing");
    std::fs::rename(&tmp, &file).expect("listing in place");
    eventually(Duration::from_secs(10), || {
        let hosts = retry_cluster_hosts(&stack);
        hosts
            .is_empty()
            .then_some(())
            .ok_or(format!("the retrying cluster still holds {hosts:?}"))
    });

    let mut failed = 0;
    for i in 0..24 {
        let r = stack.chat(&[("routing-strategy", "random")], &question(i));
        if r.status == 503 {
            failed += 1;
            assert!(
                r.json()["error"]["message"].is_string(),
                "an OpenAI error body: {}",
                describe(&r)
            );
        } else {
            assert_success(&r);
        }
    }
    assert!(
        (1..=stack.concurrency).contains(&failed),
        "{failed} requests failed: at most the first on each worker"
    );
    assert_eq!(stand_ins(&stack, "no_host"), failed as f64);
    assert_eq!(
        stand_ins(&stack, "served") + stand_ins(&stack, "failed"),
        0.0
    );
    assert_eq!(
        stack.filter_stat("pd_router_ejections_total"),
        Some(0),
        "the failure was the gateway's, not the pod's"
    );
    stack.wait_for_log("the retrying cluster knows neither");
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// A standard pod answering 500 to everything (a live server over a dead engine) is stood in
/// for as if it refused the connection: Envoy retries the request on the sibling the filter
/// named, so the client gets its answer; the failing pod hears of the failure. With
/// `stand_in_statuses` emptied, the 500 reaches the client.
#[test]
fn a_standard_pod_answering_500_is_stood_in_for_by_a_sibling() {
    for (extra, retried) in [("", true), (r#""stand_in_statuses": []"#, false)] {
        let fleet = Fleet::new(MODEL).combined("c-0").combined("c-1");
        let stack = start_configured(fleet.clone(), &[], NO_REACHABILITY_CHECK, extra);
        wait_stand_ins_allowed(&stack);
        stack.arm_fault(json!({"pod": "c-0", "kind": "status", "status": 500, "leg": "full"}));
        let session = session_id(&fleet.spec("c-0").address());
        let to_c0 = [
            ("routing-strategy", "session-affinity"),
            ("x-session-id", session.as_str()),
        ];
        let r = stack.chat(&to_c0, &question(0));
        assert_eq!(requests_at(&stack, "c-0"), 1, "{extra}");
        if retried {
            assert_success(&r);
            assert_eq!(r.header("target-pod"), Some("c-1"), "{}", describe(&r));
            assert_eq!(stand_ins(&stack, "served"), 1.0);
            assert_eq!(requests_at(&stack, "c-1"), 1);
        } else {
            assert_eq!(r.status, 500, "{}", describe(&r));
            assert_eq!(stand_ins(&stack, "served"), 0.0);
            assert_eq!(requests_at(&stack, "c-1"), 0);
        }
        stack.clear_faults();
        assert_clean_end(&stack, &fleet_pods(&fleet));
    }
}

/// A PD decode leg is never retried on a pod's answer, only on a refused connection: the
/// pod that answered may have pulled the KV, which the prefill pod then frees. With a
/// sibling decode pod to stand in, d-0's 500 still reaches the client.
#[test]
fn a_decode_pod_answering_500_is_not_retried_on_its_sibling() {
    let fleet = one_roleset().pod("d-1", "decode", "group-0");
    let stack = start(
        fleet.clone(),
        &[("AIBRIX_DECODE_SCORE_POLICY", "least_request")],
    );
    wait_stand_ins_allowed(&stack);
    stack.arm_fault(json!({"pod": "d-0", "kind": "status", "status": 500, "leg": "decode"}));
    let sent = send_until_d0_chosen(&stack, |r| {
        if r.header("target-pod") == Some("d-0") {
            assert_eq!(r.status, 500, "{}", describe(r));
        } else {
            assert_success(r);
        }
    });
    assert_eq!(
        stand_ins(&stack, "served") + stand_ins(&stack, "failed"),
        0.0
    );
    assert_eq!(
        decode_legs(&stack, "d-0").len() + decode_legs(&stack, "d-1").len(),
        sent,
        "one decode leg per request"
    );
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// Taking a gateway out of service (docs/OPERATOR.md "Taking a gateway out of service"):
/// draining its listeners while a generation streams refuses new connections at once, lets
/// that generation finish whole, and the filter's accounting ends at zero as on any other
/// request.
#[test]
fn a_drained_gateway_lets_a_running_generation_finish() {
    let fleet = one_roleset();
    let stack = start(fleet.clone(), &[]);
    let (first_chunk_tx, first_chunk_rx) = mpsc::channel();
    let addr = stack.gateway.clone();
    let reader = std::thread::spawn(move || {
        // About 2 s of tokens at pd-sim's decode pace: the drain lands mid-stream.
        let mut s = open_request(&addr, &chat(true, 1000));
        s.set_read_timeout(Some(ALL_ENDED)).ok();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).expect("first bytes");
        got.extend_from_slice(&buf[..n]);
        first_chunk_tx.send(()).expect("signal");
        while !got.ends_with(b"0\r\n\r\n") {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => panic!("the stream was lost in the drain: {e}"),
            }
        }
        String::from_utf8_lossy(&got).into_owned()
    });
    first_chunk_rx.recv().expect("first chunk");
    let r = http::request(&stack.admin, "POST", "/drain_listeners", &[], &[]).expect("Envoy admin");
    assert_eq!(r.status, 200, "{}", r.text());
    eventually(ALL_ENDED, || match TcpStream::connect(&stack.gateway) {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
        other => Err(format!("the listener still answers: {other:?}")),
    });
    assert!(
        !reader.is_finished(),
        "the drain came after the stream ended"
    );
    let stream = reader.join().expect("reader");
    assert!(stream.starts_with("HTTP/1.1 200"), "{stream:.300}");
    assert!(
        stream.contains("data: [DONE]"),
        "the whole stream arrived: {stream}"
    );
    eventually(ALL_ENDED, || {
        let active = envoy_stat(&stack, "http.pd_ingress.downstream_rq_active");
        (active == 0)
            .then_some(())
            .ok_or(format!("{active} requests still active"))
    });
    stack.wait_ledger_zero();
}

/// Envoy closes a pod connection left idle for its 3 s, before the engine's own keep-alive
/// (pd-sim's 5 s, as uvicorn's) would: a pod never closes a connection under Envoy, so no
/// request is ever written on one the pod is closing.
#[test]
fn idle_pod_connections_are_closed_by_envoy_before_the_engine_closes_them() {
    let fleet = one_roleset();
    let stack = start(fleet.clone(), &[]);
    assert_success(&stack.chat(&PD, &question(0)));
    let opened = envoy_stat(&stack, "cluster.pd_pods.upstream_cx_total");
    assert!(opened >= 2, "a prefill and a decode connection: {opened}");
    eventually(Duration::from_secs(20), || {
        let idle = envoy_stat(&stack, "cluster.pd_pods.upstream_cx_idle_timeout");
        (idle >= opened)
            .then_some(())
            .ok_or(format!("{idle} of {opened} closed for idleness"))
    });
    assert_eq!(
        envoy_stat(&stack, "cluster.pd_pods.upstream_cx_destroy_remote"),
        0
    );
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// A client cannot buy retries from Envoy's router, even one Envoy counts as internal (whose
/// `x-envoy-*` headers its connection manager leaves on): with `x-envoy-retry-on: 5xx` and
/// three retries asked for, a decode pod's 500 reaches the client after one decode leg (left
/// on, the headers have the leg, and its KV pull, run four times on the same pod), and the
/// pods never see the headers; nor can it name statistics of its own.
#[test]
fn client_sent_envoy_retry_headers_buy_no_retries() {
    let fleet = one_roleset();
    // Clients the connection manager counts as internal: it leaves the controls on.
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet.clone(),
        &Options {
            internal_clients: true,
            // As a stock or Istio Envoy: x-envoy-upstream-alt-stat-name would name statistics.
            dynamic_stats: true,
            ..Options::default()
        },
    );
    stack.arm_fault(json!({"pod": "d-0", "kind": "status", "status": 500, "leg": "decode"}));
    let controls = [
        ("x-envoy-retry-on", "5xx,retriable-status-codes"),
        ("x-envoy-retriable-status-codes", "500"),
        ("x-envoy-max-retries", "3"),
        ("x-envoy-upstream-rq-per-try-timeout-ms", "60000"),
        ("x-envoy-upstream-alt-stat-name", "client_made_up"),
    ];
    let r = stack.chat(&[PD.as_slice(), &controls].concat(), &question(0));
    assert_eq!(r.status, 500, "{}", describe(&r));
    let legs = decode_legs(&stack, "d-0");
    assert_eq!(legs.len(), 1, "{legs:#?}");
    assert_eq!(envoy_stat(&stack, "cluster.pd_pods.upstream_rq_retry"), 0);
    let stats = http::get(&stack.admin, "/stats")
        .expect("Envoy admin")
        .text();
    assert!(
        !stats.contains("client_made_up"),
        "a client named statistics: {}",
        stats
            .lines()
            .filter(|l| l.contains("client_made_up"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let seen = stack.sim_requests();
    for (name, _) in controls {
        assert!(
            seen.iter().all(|e| e["headers"].get(name).is_none()),
            "{name} reached a pod: {seen:#?}"
        );
    }
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// When the stand-in refuses too, the client gets Envoy's 503 as an OpenAI error body, both
/// pods count the failure, and the retry is counted as failed; nothing is left charged.
#[test]
fn a_stand_in_refusing_too_ends_the_request_with_a_503() {
    let fleet = Fleet::new(MODEL).combined("c-0").combined("c-1");
    let stack = start(fleet.clone(), &[]);
    stack.arm_fault(json!({"pod": "c-0", "kind": "crash"}));
    stack.arm_fault(json!({"pod": "c-1", "kind": "crash"}));
    let r = stack.chat(&[("routing-strategy", "random")], &question(0));
    assert_eq!(r.status, 503, "{}", describe(&r));
    let body = r.json();
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "not an OpenAI error body: {}",
        describe(&r)
    );
    assert_eq!(stand_ins(&stack, "failed"), 1.0);
    assert_eq!(stand_ins(&stack, "served"), 0.0);
    assert_eq!(
        envoy_stat(&stack, "cluster.pd_pods_retry.upstream_rq_retry"),
        1
    );
    assert!(stack.sim_requests().is_empty(), "no pod took the request");
    stack.wait_ledger_zero();
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// A decode pod that died since the last snapshot refuses the decode leg's connection; Envoy
/// retries the leg on the roleset's other decode pod, which takes the KV from the same prefill
/// pod (vLLM: the prefill answer names it; SGLang: the same bootstrap room). Every request
/// succeeds, and each time the dead pod was chosen a stand-in served. pd-control is stopped
/// first, so its last snapshot (fresh for `snapshot_stale_after_ms`) still shows the pod
/// alive and well, as it does for the moments after a real crash; decode by least request
/// draws between the two idle pods at random.
/// Times the selection picked `pod` as a decode pod.
fn decode_chosen(stack: &Stack, pod: &str) -> f64 {
    stack.metric("pd_selected_decode_pod_total", &[("pod", pod)])
}

/// Sends PD questions, each answer checked by `check`, until d-0 was chosen as a decode pod
/// once (at most 50); returns how many were sent.
fn send_until_d0_chosen(stack: &Stack, check: impl Fn(&Response)) -> usize {
    let mut sent = 0;
    while decode_chosen(stack, "d-0") < 1.0 {
        assert!(sent < 50, "{sent} requests and d-0 never chosen");
        check(&stack.chat(&PD, &question(sent)));
        sent += 1;
    }
    sent
}

/// One roleset of `engine` with two decode pods, both scraped, then pd-control gone (so no
/// mark keeps d-0 out of the routing view) and d-0 crashed: its connections are refused.
fn decode_pod_d0_refusing(engine: &str) -> (Fleet, Stack) {
    decode_pod_d0_refusing_with(engine, &[])
}

/// [`decode_pod_d0_refusing`] with more of Envoy's environment.
fn decode_pod_d0_refusing_with(engine: &str, env: &[(&str, &str)]) -> (Fleet, Stack) {
    let fleet = Fleet::new(MODEL)
        .engine(engine)
        .pod("p-0", "prefill", "group-0")
        .pod("d-0", "decode", "group-0")
        .pod("d-1", "decode", "group-0");
    let mut env = env.to_vec();
    env.push(("AIBRIX_DECODE_SCORE_POLICY", "least_request"));
    let mut stack = start(fleet.clone(), &env);
    stack.wait_snapshot_adopted(|snap| {
        let fresh = |pod: &str| {
            snapshot_pods(snap).any(|p| {
                p["name"] == pod && p["metrics"]["present"] == true && p["metrics"]["stale"] != true
            })
        };
        // And the retrying cluster has taken its endpoints (the stand-ins are named only
        // then): a refusal before that was Envoy's 503, now and then, to the first request.
        (fresh("d-0") && fresh("d-1") && snap["eds"] == true)
            .then_some(())
            .ok_or_else(|| "decode pods not both scraped, or no stand-ins yet".to_string())
    });
    stack.kill("pd-control");
    stack.arm_fault(json!({"pod": "d-0", "kind": "crash"}));
    (fleet, stack)
}

/// Waits until `pod` has been sent `n` `/abort_request`s.
fn wait_aborts_at(stack: &Stack, pod: &str, n: usize) {
    eventually(Duration::from_secs(10), || {
        let aborts = stack
            .sim_requests()
            .into_iter()
            .filter(|e| e["path"] == "/abort_request" && e["pod"] == pod)
            .count();
        (aborts == n)
            .then_some(())
            .ok_or_else(|| format!("{aborts} of {n} aborts reached {pod}"))
    });
}

/// An SGLang decode leg refused by its chosen pod runs on the stand-in; when the stand-in
/// then answers nothing, the watchdog's abort goes to it, where the request waits, not to the
/// pod that refused the connection (which holds nothing, and refuses the abort too).
#[test]
fn a_watchdogs_abort_follows_the_decode_leg_to_its_stand_in() {
    let (fleet, stack) =
        decode_pod_d0_refusing_with("sglang", &[("AIBRIX_DECODE_RESPONSE_TIMEOUT", "1")]);
    stack.arm_fault(json!({"pod": "d-1", "kind": "hang_before_headers", "leg": "decode"}));
    let sent = send_until_d0_chosen(&stack, |r| assert_error(r, 504, "x-error-pd-decode"));
    wait_aborts_at(&stack, "d-1", sent);
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

/// An SGLang decode leg refused by its chosen pod runs on the stand-in; when the prefill
/// leg then fails, the abort goes where the decode request waits for its KV (the stand-in),
/// not to the pod that refused it.
#[test]
fn an_sglang_abort_follows_the_decode_leg_to_its_stand_in() {
    let (fleet, stack) = decode_pod_d0_refusing("sglang");
    stack.arm_fault(
        json!({"pod": "p-0", "kind": "status", "status": 500, "delay_ms": 300, "leg": "prefill"}),
    );
    let sent = send_until_d0_chosen(&stack, |r| assert_error(r, 500, "x-error-pd-prefill"));
    wait_aborts_at(&stack, "d-1", sent);
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

fn a_decode_pod_refusing_the_connection_is_stood_in_for(engine: &str) {
    let (fleet, stack) = decode_pod_d0_refusing(engine);
    let sent = send_until_d0_chosen(&stack, |r| {
        assert_success(r);
        assert_eq!(r.header("target-pod"), Some("d-1"), "{}", describe(r));
    });
    assert_eq!(
        stand_ins(&stack, "served"),
        decode_chosen(&stack, "d-0"),
        "every request that chose d-0 was served by d-1"
    );
    assert_eq!(decode_legs(&stack, "d-1").len(), sent);
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

#[test]
fn a_vllm_decode_pod_refusing_the_connection_is_stood_in_for_by_its_roleset_sibling() {
    a_decode_pod_refusing_the_connection_is_stood_in_for("vllm");
}

#[test]
fn an_sglang_decode_pod_refusing_the_connection_is_stood_in_for_by_its_roleset_sibling() {
    a_decode_pod_refusing_the_connection_is_stood_in_for("sglang");
}

/// SGLang sends both legs at once: a prefill that fails while Envoy retries the refused decode
/// leg on the stand-in (which waits for the KV) ends the request with the prefill's failure,
/// the filter's own answer. The chosen pod refused, but the stand-in neither served nor
/// failed: it is not counted as a stand-in that failed too.
#[test]
fn a_prefill_failing_while_the_stand_in_waits_counts_no_failed_stand_in() {
    let (fleet, stack) = decode_pod_d0_refusing("sglang");
    // Failing 300 ms in: Envoy has retried the refused leg on the stand-in by then.
    stack.arm_fault(
        json!({"pod": "p-0", "kind": "status", "status": 500, "delay_ms": 300, "leg": "prefill"}),
    );
    let sent = send_until_d0_chosen(&stack, |r| {
        assert_eq!(r.status, 500, "{}", describe(r));
        assert_eq!(
            r.header("x-error-pd-prefill"),
            Some("true"),
            "{}",
            describe(r)
        );
    });
    // Counted as each stream is logged, which may follow the client's answer.
    eventually(Duration::from_secs(10), || {
        let counted = fail_count(&stack, "pd_prefill_failure", "500");
        (counted == sent as f64)
            .then_some(())
            .ok_or_else(|| format!("{counted} of {sent} prefill failures counted"))
    });
    assert!(
        !decode_legs(&stack, "d-1").is_empty(),
        "Envoy retried the refused leg on the stand-in"
    );
    assert!(
        envoy_stat(&stack, "cluster.pd_pods_retry.upstream_rq_retry") >= 1,
        "Envoy retried d-0's refused leg"
    );
    assert_eq!(
        stand_ins(&stack, "failed"),
        0.0,
        "the stand-in did not fail"
    );
    assert_eq!(stand_ins(&stack, "served"), 0.0, "nor serve");
    stack.clear_faults();
    assert_clean_end(&stack, &fleet_pods(&fleet));
}

#[test]
fn a_trtllm_decode_pod_refusing_the_connection_is_stood_in_for_by_its_roleset_sibling() {
    // TRT-LLM's default `context_first`: the generation leg follows the context answer, which
    // names the context pod any generation pod of the roleset can pull from.
    a_decode_pod_refusing_the_connection_is_stood_in_for("trtllm");
}
