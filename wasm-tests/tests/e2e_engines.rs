//! End-to-end: SGLang and TRT-LLM prefill/decode through the real `.wasm` in real Envoy
//! (`--concurrency 2`), against pd-sim pods speaking each engine's protocol.

use std::time::{Duration, Instant};

use pd_wasm_tests::http::{self, Response};
use pd_wasm_tests::stack::{eventually, Fleet, Options, Stack};
use serde_json::{json, Value};

const MODEL: &str = "eng-model";
const TOKEN_LOAD: [(&str, &str); 2] = [
    ("AIBRIX_PREFILL_SCORE_POLICY", "token_load"),
    ("AIBRIX_DECODE_SCORE_POLICY", "token_load"),
];

fn pair(engine: &str) -> Fleet {
    Fleet::new(MODEL)
        .engine(engine)
        .pod(&format!("{engine}-p-0"), "prefill", "group-0")
        .bootstrap_port(9100)
        .pod(&format!("{engine}-d-0"), "decode", "group-0")
        .pod(&format!("{engine}-p-1"), "prefill", "group-1")
        .pod(&format!("{engine}-d-1"), "decode", "group-1")
}

fn chat(stream: bool, max_tokens: u32) -> Value {
    json!({"model": MODEL, "stream": stream, "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": "Explain disaggregated serving in one line."}]})
}

fn header<'a>(r: &'a Response, name: &str) -> &'a str {
    r.header(name)
        .unwrap_or_else(|| panic!("response lacks {name}: {:?} {}", r.headers, r.text()))
}

/// The completion legs pd-sim logged for one request id: (prefill, decode).
fn legs(stack: &Stack, request_id: &str) -> (Value, Value) {
    let entries: Vec<Value> = stack
        .sim_requests()
        .into_iter()
        .filter(|e| e["x_request_id"] == request_id && e["path"] == "/v1/chat/completions")
        .collect();
    let one = |leg: &str| {
        let found: Vec<&Value> = entries.iter().filter(|e| e["leg"] == leg).collect();
        assert_eq!(found.len(), 1, "one {leg} leg: {entries:?}");
        found[0].clone()
    };
    (one("prefill"), one("decode"))
}

/// Pods of one roleset served the legs, and the client got the decode pod's answer.
fn assert_pair(stack: &Stack, r: &Response, tokens: usize) -> (Value, Value) {
    assert_eq!(r.status, 200, "{}", r.text());
    let request_id = header(r, "request-id").to_string();
    let (p, d) = legs(stack, &request_id);
    let (prefill, decode) = (
        stack.fleet.spec(p["pod"].as_str().unwrap_or_default()),
        stack.fleet.spec(d["pod"].as_str().unwrap_or_default()),
    );
    assert_eq!(
        (prefill.role.as_str(), decode.role.as_str()),
        ("prefill", "decode")
    );
    assert_eq!(prefill.roleset, decode.roleset, "legs went to one roleset");
    assert_eq!(header(r, "target-pod"), decode.name);
    assert_eq!(header(r, "prefill-target-pod"), prefill.name);
    assert_eq!(p["status"], 200, "{p}");
    assert_eq!(
        d["kv_pull"], "ok",
        "the decode pod got the prefill's KV: {d}"
    );
    assert_eq!(p["body"]["max_tokens"], 1);
    assert_eq!(p["body"]["stream"], false);
    if r.header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream"))
    {
        assert!(r.complete, "stream ended properly");
        let text = r.text();
        let got = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter(|v| {
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|c| !c.is_empty())
            })
            .count();
        assert_eq!(got, tokens, "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"));
    } else {
        let answer = r.json();
        assert_eq!(
            answer["id"],
            format!("chatcmpl-{request_id}"),
            "the decode pod's answer"
        );
        assert_eq!(answer["usage"]["completion_tokens"], tokens);
    }
    (p, d)
}

/// SGLang pods on IPv6 addresses: the decode worker reaches its prefill's bootstrap server
/// at `http://{bootstrap_host}:{bootstrap_port}`, so the gateway names the host in brackets
/// (bare, it makes no URL and every transfer fails).
#[test]
fn sglang_pods_on_ipv6_addresses_get_a_bracketed_bootstrap_host() {
    let fleet = Fleet::new(MODEL)
        .engine("sglang")
        .pod("sglang-p-6", "prefill", "group-6")
        .ipv6()
        .bootstrap_port(9106)
        .pod("sglang-d-6", "decode", "group-6")
        .ipv6();
    let stack = Stack::start(fleet);
    for stream in [false, true] {
        let r = stack.chat(&[("routing-strategy", "pd")], &chat(stream, 3));
        let (p, d) = assert_pair(&stack, &r, 3);
        for leg in [&p, &d] {
            assert_eq!(leg["body"]["bootstrap_host"], "[::1]", "{leg}");
            assert_eq!(leg["body"]["bootstrap_port"], 9106, "{leg}");
        }
    }
}

#[test]
fn sglang_legs_share_bootstrap_room_and_rid_and_the_decode_answers() {
    let stack = Stack::start_with(pair("sglang"), 2, &TOKEN_LOAD);
    for stream in [false, true] {
        for _ in 0..3 {
            let r = stack.chat(&[("routing-strategy", "pd")], &chat(stream, 4));
            let (p, d) = assert_pair(&stack, &r, 4);
            let prefill = stack.fleet.spec(p["pod"].as_str().unwrap_or_default());
            assert_eq!(p["body"]["bootstrap_host"], prefill.ip.as_str());
            let port = if prefill.name.ends_with("p-0") {
                9100
            } else {
                8998
            };
            assert_eq!(p["body"]["bootstrap_port"], port, "annotation or default");
            for key in ["bootstrap_host", "bootstrap_port", "bootstrap_room", "rid"] {
                assert_eq!(p["body"][key], d["body"][key], "{key} matches on both legs");
            }
            let room = d["body"]["bootstrap_room"].as_u64().expect("integer room");
            assert!(room < i64::MAX as u64);
            let rid = d["body"]["rid"].as_str().unwrap_or_default();
            assert!(
                rid.starts_with(&format!("{}-", header(&r, "request-id"))),
                "{rid}"
            );
            assert_eq!(
                d["body"]["stream"], stream,
                "decode keeps the client's stream flag"
            );
            assert_eq!(p["x_request_id"], d["x_request_id"]);
        }
    }
    stack.wait_ledger_zero();
}

#[test]
fn sglang_duplicate_controlled_key_is_400_before_any_leg() {
    let stack = Stack::start(pair("sglang"));
    let body = br#"{"model":"eng-model","messages":[{"role":"user","content":"x"}],"stream":true,"stream":false}"#;
    let r = http::request(
        &stack.gateway,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("routing-strategy", "pd"),
        ],
        body,
    )
    .expect("request");
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(header(&r, "x-error-routing"), "true");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("duplicate top-level key"));
    assert!(stack.sim_requests().is_empty(), "no leg was sent");
    assert!(stack.metric("pd_router_rejected_total", &[("reason", "invalid_request")]) >= 1.0);
}

/// SGLang's Messages handler drops the bootstrap fields and trtllm-serve has no
/// `/v1/messages`: a Messages request for such a pair is refused before selection, naming
/// the engine, instead of being sent to fail on the pods.
#[test]
fn messages_for_sglang_or_trtllm_pairs_are_501_before_any_leg() {
    let fleet = pair("sglang")
        .engine("trtllm")
        .pod("trtllm-p-0", "prefill", "t-0")
        .of_model("trt-model")
        .pod("trtllm-d-0", "decode", "t-0")
        .of_model("trt-model");
    let stack = Stack::start(fleet);
    for (model, engine) in [(MODEL, "sglang"), ("trt-model", "trtllm")] {
        let body = json!({"model": model, "max_tokens": 4,
                          "messages": [{"role": "user", "content": "x"}]});
        let r = http::post_json(
            &stack.gateway,
            "/v1/messages",
            &[("routing-strategy", "pd")],
            &body,
        );
        assert_eq!(r.status, 501, "{}", r.text());
        assert_eq!(header(&r, "x-error-routing"), "true");
        assert_eq!(
            r.json()["error"]["message"],
            format!("/v1/messages is not served by {engine} prefill/decode pairs")
        );
    }
    assert!(stack.sim_requests().is_empty(), "no leg was sent");
    assert_eq!(
        stack.metric(
            "pd_router_rejected_total",
            &[("reason", "path_not_for_engine")]
        ),
        2.0
    );
}

#[test]
fn mixed_engines_fail_selection() {
    let fleet = Fleet::new(MODEL)
        .engine("sglang")
        .pod("p0", "prefill", "g0")
        .engine("vllm")
        .pod("d0", "decode", "g0");
    let stack = Stack::start(fleet);
    let r = stack.chat(&[("routing-strategy", "pd")], &chat(false, 2));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(header(&r, "x-error-routing"), "true");
    // The client gets AIBrix's fixed message; the pods and engines are for the log.
    assert_eq!(
        r.json()["error"]["message"],
        "error on selecting target pod",
        "{}",
        r.text()
    );
    stack.wait_for_log("inconsistent LLM engines detected");
    assert_eq!(
        stack.metric(
            "gateway_prefill_request_fail_total",
            &[("status", "pd-filter-prefill-decode-pods-fail")]
        ),
        1.0,
        "counted as AIBrix counts a PD selection failure"
    );
    assert!(stack.sim_requests().is_empty());
}

#[test]
fn trtllm_context_first_forwards_params_and_prompt_ids() {
    let stack = Stack::start_with(pair("trtllm"), 2, &TOKEN_LOAD);
    for stream in [false, true] {
        let r = stack.chat(&[("routing-strategy", "pd")], &chat(stream, 3));
        let (p, d) = assert_pair(&stack, &r, 3);
        let ctx = &p["body"]["disaggregated_params"];
        assert_eq!(ctx["request_type"], "context_only");
        let id = ctx["disagg_request_id"].as_i64().expect("int64 id");
        assert!(
            id >= 1 << 42,
            "Snowflake ids are above the local range: {id}"
        );
        assert!(p["body"].get("max_completion_tokens").is_none());
        let gen = &d["body"]["disaggregated_params"];
        assert_eq!(gen["request_type"], "generation_only");
        assert_eq!(gen["disagg_request_id"].as_i64(), Some(id));
        assert!(
            gen["ctx_request_id"].as_i64().is_some_and(|c| c > 1 << 53),
            "{gen}"
        );
        assert!(gen["encoded_opaque_state"].is_string() && gen["first_gen_tokens"].is_array());
        assert!(d["body"]["prompt_token_ids"]
            .as_array()
            .is_some_and(|a| !a.is_empty()));
    }
    stack.wait_ledger_zero();
}

/// A TRT-LLM context leg whose first token ended the answer (`finish_reason: "stop"`) is the
/// answer, as TRT-LLM's own disagg server has it: no generation leg, the context answer without
/// its disaggregation members, and for a stream one chunk, the usage chunk and `[DONE]`.
#[test]
fn trtllm_context_answer_that_finished_is_the_answer() {
    let stack = Stack::start_with(pair("trtllm"), 2, &TOKEN_LOAD);
    for pod in ["trtllm-p-0", "trtllm-p-1"] {
        stack.arm_fault(json!({"pod": pod, "kind": "finish_first", "leg": "prefill"}));
    }
    let pd = [("routing-strategy", "pd")];
    let completion_legs = |r: &Response| -> Vec<String> {
        let id = header(r, "request-id").to_string();
        stack
            .sim_requests()
            .into_iter()
            .filter(|e| e["x_request_id"] == id.as_str())
            .filter_map(|e| e["leg"].as_str().map(str::to_string))
            .collect()
    };

    let r = stack.chat(&pd, &chat(false, 8));
    assert_eq!(r.status, 200, "{}", r.text());
    let answer = r.json();
    assert_eq!(answer["choices"][0]["finish_reason"], "stop", "{answer}");
    assert!(answer["choices"][0].get("disaggregated_params").is_none());
    assert!(answer.get("prompt_token_ids").is_none());
    assert_eq!(completion_legs(&r), ["prefill"], "no generation leg");

    let mut body = chat(true, 8);
    body["stream_options"] = json!({"include_usage": true});
    let r = stack.chat(&pd, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let text = r.text();
    assert!(text.contains(r#""finish_reason":"stop""#), "{text}");
    assert!(text.contains(r#""total_tokens""#), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(completion_legs(&r), ["prefill"], "no generation leg");

    stack.clear_faults();
    let r = stack.chat(&pd, &chat(false, 3));
    assert_pair(&stack, &r, 3);
    stack.wait_ledger_zero();
}

/// vLLM returns `kv_transfer_params` only for a prefill its length capped: one whose first
/// token ended the answer returns null, and the decode leg goes as the client's body, which
/// the decode pod computes itself (as vLLM's own proxies have it); the client gets its answer.
#[test]
fn a_vllm_prefill_ended_by_its_first_token_sends_the_clients_body_to_decode() {
    let stack = Stack::start_with(pair("vllm"), 2, &TOKEN_LOAD);
    for pod in ["vllm-p-0", "vllm-p-1"] {
        stack.arm_fault(json!({"pod": pod, "kind": "finish_first", "leg": "prefill"}));
    }
    let pd = [("routing-strategy", "pd")];
    for stream in [false, true] {
        let r = stack.chat(&pd, &chat(stream, 4));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.complete, "{}", r.text());
        let id = header(&r, "request-id");
        let entries: Vec<Value> = stack
            .sim_requests()
            .into_iter()
            .filter(|e| e["x_request_id"] == id)
            .collect();
        let prefill = entries
            .iter()
            .find(|e| e["leg"] == "prefill")
            .unwrap_or_else(|| panic!("no prefill leg: {entries:?}"));
        assert!(
            prefill["kv_transfer_params_out"].is_null(),
            "vLLM returns no parameters: {prefill}"
        );
        let decode = entries
            .iter()
            .find(|e| e["pod"] == header(&r, "target-pod"))
            .unwrap_or_else(|| panic!("no decode leg: {entries:?}"));
        assert_eq!(decode["status"], 200, "{decode}");
        assert_eq!(decode["kv_pull"], "recomputed", "{decode}");
        assert!(
            decode["body"].get("kv_transfer_params").is_none(),
            "the client's body: {decode}"
        );
        assert_eq!(decode["body"]["max_tokens"], 4, "the client's own limit");
    }
    stack.clear_faults();
    assert_pair(&stack, &stack.chat(&pd, &chat(false, 3)), 3);
    stack.wait_ledger_zero();
}

/// A context answer that finished is the context pod's answer: it names that pod as its
/// target, and it credits no decode pod, so a decode pod failing every generation leg is
/// still ejected after its failures in a row, whatever short answers come between them.
#[test]
fn trtllm_context_answer_credits_the_context_pod_not_the_decode_pod() {
    let fleet = Fleet::new(MODEL)
        .engine("trtllm")
        .pod("trtllm-p-0", "prefill", "group-0")
        .pod("trtllm-d-0", "decode", "group-0");
    // One worker: every outcome lands on one ejection tally.
    let stack = Stack::start_with(fleet, 1, &TOKEN_LOAD);
    let pd = [("routing-strategy", "pd")];
    let failing_decode =
        json!({"pod": "trtllm-d-0", "kind": "status", "status": 500, "leg": "decode"});
    stack.arm_fault(failing_decode.clone());
    let r = stack.chat(&pd, &chat(false, 4));
    assert_eq!(r.status, 500, "the decode pod's failure: {}", r.text());

    stack.arm_fault(json!({"pod": "trtllm-p-0", "kind": "finish_first", "leg": "prefill"}));
    let r = stack.chat(&pd, &chat(false, 4));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(header(&r, "target-pod"), "trtllm-p-0", "{:?}", r.headers);
    assert_eq!(header(&r, "prefill-target-pod"), "trtllm-p-0");

    stack.clear_faults();
    stack.arm_fault(failing_decode);
    for _ in 0..2 {
        let r = stack.chat(&pd, &chat(false, 4));
        assert_eq!(r.status, 500, "{}", r.text());
    }
    // Three generation legs failed, with a context answer between the first and the others:
    // three in a row (the default `eject_after_failures`) for the decode pod.
    eventually(Duration::from_secs(10), || {
        let log = stack.envoy_log();
        log.lines()
            .any(|l| l.contains("ejecting pod") && l.contains("trtllm-d-0"))
            .then_some(())
            .ok_or_else(|| {
                format!(
                    "decode pod not ejected; ejections {}",
                    stack.stat("pd_router_ejections_total")
                )
            })
    });
    stack.clear_faults();
}

#[test]
fn trtllm_generation_first_sends_both_legs_with_one_id() {
    let mut env = TOKEN_LOAD.to_vec();
    env.push(("AIBRIX_TRT_SCHEDULE_STYLE", "generation_first"));
    env.push(("AIBRIX_TRT_MACHINE_ID", "7"));
    let stack = Stack::start_with(pair("trtllm"), 2, &env);
    for stream in [false, true, false, true] {
        let r = stack.chat(&[("routing-strategy", "pd")], &chat(stream, 3));
        let (p, d) = assert_pair(&stack, &r, 3);
        let (ctx, gen) = (
            &p["body"]["disaggregated_params"],
            &d["body"]["disaggregated_params"],
        );
        let id = ctx["disagg_request_id"].as_i64().expect("id");
        assert_eq!((id >> 12) & 0x3ff, 7, "machine id bits");
        assert_eq!(ctx["schedule_style"], 1);
        assert_eq!(gen["schedule_style"], 1);
        assert_eq!(gen["disagg_request_id"].as_i64(), Some(id));
        assert_eq!(gen["ctx_request_id"].as_i64(), Some(id));
        let prefill = stack.fleet.spec(p["pod"].as_str().unwrap_or_default());
        assert_eq!(
            gen["ctx_info_endpoint"],
            format!("tcp://{}:5555", prefill.ip)
        );
    }
    let lookups = stack
        .sim_requests()
        .into_iter()
        .filter(|e| e["path"] == "/server_info")
        .count();
    assert!(
        (1..=4).contains(&lookups),
        "server_info is cached per worker and pod, not fetched per request: {lookups}"
    );
    stack.wait_ledger_zero();
}

#[test]
fn trtllm_generation_first_without_metadata_fails_before_either_leg() {
    let fleet = pair("trtllm");
    let env = [("AIBRIX_TRT_SCHEDULE_STYLE", "generation_first")];
    let stack = Stack::start_full(
        fleet.clone(),
        fleet,
        2,
        &env,
        &["--trtllm-transceiver", "cpp"],
    );
    let r = stack.chat(&[("routing-strategy", "pd")], &chat(false, 2));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(header(&r, "x-error-routing"), "true");
    assert!(!r.text().contains("ctx_dp_rank"), "{}", r.text());
    stack.wait_for_log("ctx_dp_rank");
    let log = stack.sim_requests();
    assert!(log.iter().any(|e| e["path"] == "/server_info"), "{log:?}");
    assert!(
        log.iter().all(|e| e["leg"].is_null()),
        "no inference leg was sent: {log:?}"
    );
}

/// Without the filter's answer, a generation leg waiting for a context leg that failed would
/// end with pd-sim's transfer error after this many seconds.
const TRANSFER_TIMEOUT_S: &str = "4";

/// One TRT-LLM roleset under `generation_first` (no other pair to route to), pd-sim's
/// transfer timeout at [`TRANSFER_TIMEOUT_S`].
fn generation_first_roleset() -> Stack {
    let fleet = Fleet::new(MODEL)
        .engine("trtllm")
        .pod("trtllm-p-0", "prefill", "group-0")
        .pod("trtllm-d-0", "decode", "group-0");
    let mut env = TOKEN_LOAD.to_vec();
    env.push(("AIBRIX_TRT_SCHEDULE_STYLE", "generation_first"));
    Stack::start_opts(
        fleet.clone(),
        fleet,
        &Options {
            envoy_env: &env,
            sim_args: &["--pd-transfer-timeout-s", TRANSFER_TIMEOUT_S],
            ..Options::default()
        },
    )
}

/// `generation_first` sends the context leg alongside the generation leg; when the context
/// worker answers 500 while the (unstreamed) generation leg has sent no header yet, the
/// client gets the context leg's status with `x-error-pd-prefill`, at once rather than after
/// the engine's transfer timeout.
#[test]
fn trtllm_generation_first_context_failing_before_any_header_answers_its_status() {
    let stack = generation_first_roleset();
    stack
        .arm_fault(json!({"pod": "trtllm-p-0", "kind": "status", "status": 500, "leg": "prefill"}));
    let started = Instant::now();
    let r = stack.chat(&[("routing-strategy", "pd")], &chat(false, 3));
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "not the transfer timeout: {:?}",
        started.elapsed()
    );
    assert_eq!(
        r.status,
        500,
        "the context worker's status passes through: {}",
        r.text()
    );
    assert_eq!(header(&r, "x-error-pd-prefill"), "true");
    assert_eq!(header(&r, "content-type"), "application/json");
    let body = r.json();
    let error = &body["error"];
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("prefill request failed (http_error): ")),
        "{body}"
    );
    assert_eq!(
        (&error["type"], &error["code"], &error["param"]),
        (&json!("api_error"), &Value::Null, &Value::Null),
        "{body}"
    );
    let request_id = header(&r, "request-id");
    let context: Vec<Value> = stack
        .sim_requests()
        .into_iter()
        .filter(|e| e["x_request_id"] == request_id && e["leg"] == "prefill")
        .collect();
    assert_eq!(context.len(), 1, "{context:?}");
    assert_eq!(
        (&context[0]["status"], &context[0]["fault"]),
        (&json!(500), &json!("status"))
    );
    assert_eq!(stack.model_fail_count("pd_prefill_failure", "500"), 1.0);
    assert_eq!(
        stack.prefill_fail_count("pd-do-prefill-request-error", "500"),
        1.0
    );
    assert_eq!(stack.prefill_fail_count("http_error", "500"), 1.0);
    assert_eq!(
        stack.metric("pd_router_rejected_total", &[("reason", "prefill")]),
        1.0,
        "a local reply"
    );
    stack.clear_faults();
    stack.wait_ledger_zero();
    // The gateway keeps serving once the worker recovers.
    let ok = stack.chat(&[("routing-strategy", "pd")], &chat(false, 2));
    assert_eq!(ok.status, 200, "{}", ok.text());
    stack.wait_ledger_zero();
}

/// The context leg fails after the generation worker's streamed answer began (its headers
/// are out, it waits for the KV): the stream is cut at once rather than left waiting for the
/// engine's transfer timeout, and the request counts as the context leg's failure
/// (`pd_prefill_failure` with its status), not as the generation worker's cut stream.
#[test]
fn trtllm_generation_first_context_failing_after_the_generation_answered_cuts_the_stream() {
    let stack = generation_first_roleset();
    stack.arm_fault(json!({"pod": "trtllm-p-0", "kind": "status", "status": 500,
                           "delay_ms": 400, "leg": "prefill", "times": 2}));
    for _ in 0..2 {
        let started = Instant::now();
        let r = stack.chat(&[("routing-strategy", "pd")], &chat(true, 3));
        assert_eq!(
            r.status,
            200,
            "the generation worker's headers were out: {}",
            r.text()
        );
        assert!(!r.complete, "the stream is cut: {}", r.text());
        assert!(!r.text().contains("[DONE]"), "{}", r.text());
        assert_eq!(r.header("x-error-pd-prefill"), None, "headers were out");
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "not the transfer timeout: {:?}",
            started.elapsed()
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
        "not the generation worker's cut"
    );
    assert_eq!(
        stack.metric("gateway_request_model_success_total", &[]),
        0.0
    );
    assert_eq!(
        stack.prefill_fail_count("pd-do-prefill-request-error", "500"),
        2.0
    );
    assert_eq!(stack.prefill_fail_count("http_error", "500"), 2.0);
    assert_eq!(
        stack.metric("pd_router_rejected_total", &[("reason", "prefill")]),
        0.0,
        "a cut stream is no local reply"
    );
    stack.clear_faults();
    stack.wait_ledger_zero();
}

#[test]
fn vllm_nixl_hands_the_decode_pod_the_whole_prefill_answer() {
    // AIBRIX_KV_CONNECTOR_TYPE=nixl is the Neuron contract: no kv_transfer_params on the
    // prefill leg, the decode leg gets the prefill's whole answer as `disagg_prefill_resp`.
    let mut env = TOKEN_LOAD.to_vec();
    env.push(("AIBRIX_KV_CONNECTOR_TYPE", "nixl"));
    let fleet = pair("vllm");
    let stack = Stack::start_full(fleet.clone(), fleet, 2, &env, &["--vllm-connector", "nixl"]);
    for stream in [false, true] {
        let r = stack.chat(&[("routing-strategy", "pd")], &chat(stream, 3));
        let (p, d) = assert_pair(&stack, &r, 3);
        assert!(
            p["kv_transfer_params_in"].is_null(),
            "nixl marks nothing on the prefill leg: {p}"
        );
        assert!(p["body"].get("stream_options").is_none());
        let handed = &d["body"]["disagg_prefill_resp"];
        assert_eq!(
            handed["kv_transfer_params"], p["kv_transfer_params_out"],
            "the decode pod got the prefill's own answer"
        );
        assert_eq!(handed["usage"]["completion_tokens"], 1);
        assert!(
            d["kv_transfer_params_in"].is_null(),
            "no upstream-vLLM params in this contract: {d}"
        );
        assert_eq!(p["x_request_id"], d["x_request_id"]);
    }
    stack.wait_ledger_zero();
}
