//! A pod's error answers, rewritten as AIBrix's gateway rewrites them (`core::upstream_error`),
//! through the real `.wasm` in real Envoy (`--concurrency 2`): the status stays the pod's, a
//! 500 and a 401 get fixed bodies, an engine's OpenAI-style error (vLLM's nested, SGLang's
//! flat) is normalised and marked `x-error-response-unknown: true`, Envoy's own text for a pod
//! it could not reach becomes a generated error, and the filter's own refusals keep theirs.

use pd_wasm_tests::http::Response;
use pd_wasm_tests::stack::{Fleet, Stack};
use serde_json::{json, Value};

const MODEL: &str = "err-llm";
const SGLANG_MODEL: &str = "err-sg";
const PD: [(&str, &str); 1] = [("routing-strategy", "pd")];
const UNKNOWN: &str = "x-error-response-unknown";

fn chat(model: &str, stream: bool) -> Value {
    json!({"model": model, "stream": stream, "max_tokens": 2,
           "messages": [{"role": "user", "content": "what went wrong?"}]})
}

/// The answer is JSON of its own length, with the gateway's routing headers.
fn assert_json_answer(r: &Response, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.describe());
    assert_eq!(
        r.header("content-type"),
        Some("application/json"),
        "{}",
        r.describe()
    );
    assert!(r.header("request-id").is_some(), "{}", r.describe());
    assert!(r.header("target-pod").is_some(), "{}", r.describe());
    r.json()
}

/// The answer is [`assert_json_answer`]'s with body `want`, marked `x-error-response-unknown`
/// exactly when `marked`.
fn assert_rewritten(r: &Response, status: u16, want: Value, marked: bool) {
    assert_eq!(assert_json_answer(r, status), want, "{}", r.describe());
    let mark = marked.then_some("true");
    assert_eq!(r.header(UNKNOWN), mark, "{}", r.describe());
}

#[test]
fn pod_errors_reach_clients_in_aibrix_shape_and_the_filters_own_refusals_keep_theirs() {
    let fleet = Fleet::new(MODEL)
        .pod("p-0", "prefill", "group-0")
        .pod("d-0", "decode", "group-0")
        .engine("sglang")
        .combined("sg-c-0")
        .of_model(SGLANG_MODEL);
    let env = [
        ("AIBRIX_PREFILL_SCORE_POLICY", "least_request"),
        ("AIBRIX_DECODE_SCORE_POLICY", "least_request"),
    ];
    let stack = Stack::start_with(fleet, 2, &env);
    let decode_fails = |status: u16| {
        stack.arm_fault(json!({"pod": "d-0", "kind": "status", "status": status,
                               "leg": "decode", "times": 1}));
    };

    // vLLM's nested error, normalised and marked; the status stays the pod's.
    decode_fails(400);
    let r = stack.chat(&PD, &chat(MODEL, false));
    let want = json!({"error": {"message": "injected fault: status 400",
                                "type": "BadRequestError", "param": null, "code": 400}});
    assert_rewritten(&r, 400, want, true);
    assert_eq!(
        r.header("x-error-pd-prefill"),
        None,
        "a decode error is the pod's own"
    );
    assert_eq!(
        r.header("content-length"),
        Some(r.body.len().to_string().as_str())
    );

    // A 500 hides the engine's text.
    decode_fails(500);
    let r = stack.chat(&PD, &chat(MODEL, false));
    let want = json!({"error": {"message": "Internal server error", "type": "api_error",
                                "code": null, "param": null}});
    assert_rewritten(&r, 500, want, false);

    // A 401 is an invalid API key.
    decode_fails(401);
    let body = assert_json_answer(&stack.chat(&PD, &chat(MODEL, false)), 401);
    assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
    assert_eq!(body["error"]["type"], "authentication_error", "{body}");

    // A streamed request's error is JSON too, not an event stream.
    decode_fails(429);
    let r = stack.chat(&PD, &chat(MODEL, true));
    let body = assert_json_answer(&r, 429);
    assert_eq!(body["error"]["type"], "BadRequestError", "{}", r.describe());
    assert_eq!(r.header(UNKNOWN), Some("true"), "{}", r.describe());

    // SGLang's flat error from a standard pod (a whole request, not a PD pair).
    stack.arm_fault(json!({"pod": "sg-c-0", "kind": "status", "status": 503,
                           "leg": "full", "times": 1}));
    let r = stack.chat(
        &[("routing-strategy", "random")],
        &chat(SGLANG_MODEL, false),
    );
    let want = json!({"error": {"message": "injected fault: status 503",
                                "type": "InternalServerError", "param": null, "code": 503}});
    assert_rewritten(&r, 503, want, true);

    // Envoy's own text for a decode pod it cannot reach becomes a generated error.
    stack.arm_fault(json!({"pod": "d-0", "kind": "crash"}));
    let r = stack.chat(&PD, &chat(MODEL, false));
    stack.clear_faults();
    let body = assert_json_answer(&r, 503);
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("upstream connect error"),
        "{}",
        r.describe()
    );
    assert_eq!(body["error"]["type"], "overloaded_error", "{body}");
    assert_eq!(body["error"]["code"], "service_unavailable", "{body}");
    assert_eq!(r.header(UNKNOWN), None, "{}", r.describe());

    // The filter's own refusal of a failed prefill leg keeps its body and header.
    stack.arm_fault(json!({"pod": "p-0", "kind": "status", "status": 500,
                           "leg": "prefill", "times": 1}));
    let r = stack.chat(&PD, &chat(MODEL, false));
    assert_eq!(r.status, 500, "{}", r.describe());
    assert_eq!(
        r.header("x-error-pd-prefill"),
        Some("true"),
        "{}",
        r.describe()
    );
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        message.starts_with("prefill request failed"),
        "{}",
        r.describe()
    );
    assert_eq!(r.header(UNKNOWN), None, "{}", r.describe());

    // Successes are untouched, and every rewrite was counted by kind.
    let r = stack.chat(&PD, &chat(MODEL, false));
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(r.header(UNKNOWN), None);
    assert!(r.json()["choices"].is_array(), "{}", r.describe());
    let rewritten = |kind: &str| {
        stack.metric(
            "pd_router_upstream_errors_rewritten_total",
            &[("kind", kind)],
        )
    };
    assert_eq!(
        [
            rewritten("normalized"),
            rewritten("internal_error"),
            rewritten("unauthorized"),
            rewritten("generated"),
        ],
        [3.0, 1.0, 1.0, 1.0]
    );
    stack.wait_ledger_zero();
    assert!(!stack.envoy_log().contains("panicked"));
}

/// A pod (or a proxy in front of it) answering an error with no body at all: the client
/// still gets the contract's JSON error, with the pod's status, its other headers and the
/// gateway's routing headers, for a decode leg and a whole request alike.
#[test]
fn a_pods_error_without_a_body_gets_a_json_one() {
    let fleet = Fleet::new(MODEL)
        .pod("p-0", "prefill", "group-0")
        .pod("d-0", "decode", "group-0")
        .combined("c-0");
    let stack = Stack::start_with(fleet, 2, &[]);
    stack.arm_fault(
        json!({"pod": "d-0", "kind": "status", "status": 429, "empty_body": true,
                           "leg": "decode", "times": 1}),
    );
    let r = stack.chat(&PD, &chat(MODEL, false));
    let want = json!({"error": {"message": "upstream answered 429 without a body",
                                "type": "rate_limit_error", "code": null, "param": null}});
    assert_rewritten(&r, 429, want, false);
    assert_eq!(r.header("target-pod"), Some("d-0"), "{}", r.describe());
    assert_eq!(
        r.header("prefill-target-pod"),
        Some("p-0"),
        "{}",
        r.describe()
    );

    stack.arm_fault(
        json!({"pod": "c-0", "kind": "status", "status": 500, "empty_body": true,
                           "leg": "full", "times": 1}),
    );
    let r = stack.chat(&[("routing-strategy", "random")], &chat(MODEL, true));
    let want = json!({"error": {"message": "Internal server error", "type": "api_error",
                                "code": null, "param": null}});
    assert_rewritten(&r, 500, want, false);
    assert_eq!(
        stack.metric(
            "pd_router_upstream_errors_rewritten_total",
            &[("kind", "generated")]
        ) + stack.metric(
            "pd_router_upstream_errors_rewritten_total",
            &[("kind", "internal_error")]
        ),
        2.0
    );
    stack.wait_ledger_zero();
}

/// A bodiless pod error carrying a header whose value is not UTF-8: the filter read the pod's
/// headers as text to copy them into its reply, and the SDK's text getter panicked, trapping
/// the VM with every stream of its worker. The reply leaves that header out.
#[test]
fn a_bodiless_pod_error_with_a_raw_header_traps_nothing() {
    let fleet = Fleet::new(MODEL)
        .pod("p-0", "prefill", "group-0")
        .pod("d-0", "decode", "group-0");
    let stack = Stack::start_with(fleet, 2, &[]);
    stack.arm_fault(
        json!({"pod": "d-0", "kind": "status", "status": 503, "empty_body": true,
               "raw_header": true, "leg": "decode", "times": 1}),
    );
    let r = stack.chat(&PD, &chat(MODEL, false));
    let want = json!({"error": {"message": "upstream answered 503 without a body",
                                "type": "overloaded_error", "code": "service_unavailable",
                                "param": null}});
    assert_rewritten(&r, 503, want, false);
    assert_eq!(r.header("x-sim-raw"), None, "{}", r.describe());
    for _ in 0..4 {
        let ok = stack.chat(&PD, &chat(MODEL, false));
        assert_eq!(ok.status, 200, "{}", ok.describe());
    }
    let log = stack.envoy_log();
    assert!(!log.contains("panicked"), "{log}");
    stack.wait_ledger_zero();
}
