//! End-to-end: the real `.wasm` in the real Envoy (`--concurrency 2`), pd-control on a fleet
//! file, and pd-sim pods speaking vLLM's PD protocol.

use std::collections::BTreeSet;

use pd_wasm_tests::http::Response;
use pd_wasm_tests::stack::{Fleet, Options, Stack};
use serde_json::{json, Value};

mod async_client;
use async_client::{answer, client, runtime};

const MODEL: &str = "llama-pd";
const LEAST_REQUEST: &[(&str, &str)] = &[
    ("AIBRIX_PREFILL_SCORE_POLICY", "least_request"),
    ("AIBRIX_DECODE_SCORE_POLICY", "least_request"),
];

fn two_rolesets() -> Fleet {
    Fleet::new(MODEL)
        .pod("vllm-p-0", "prefill", "group-0")
        .pod("vllm-d-0", "decode", "group-0")
        .pod("vllm-p-1", "prefill", "group-1")
        .pod("vllm-d-1", "decode", "group-1")
        .combined("vllm-c-0")
}

fn chat_body(stream: bool, max_tokens: u32) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Tell me about prefill and decode."}],
        "stream": stream,
        "max_tokens": max_tokens,
    })
}

fn header<'a>(r: &'a Response, name: &str) -> &'a str {
    r.header(name)
        .unwrap_or_else(|| panic!("response lacks {name}: {:?} {}", r.headers, r.text()))
}

/// `body` POSTed to the gateway's `path` with a `routing-strategy`.
fn post(stack: &Stack, path: &str, strategy: &str, body: &Value) -> Response {
    pd_wasm_tests::http::post_json(
        &stack.gateway,
        path,
        &[("routing-strategy", strategy)],
        body,
    )
}

/// The pd-sim log entries of one request id, by leg.
fn legs(stack: &Stack, request_id: &str) -> (Vec<Value>, Vec<Value>) {
    let entries: Vec<Value> = stack
        .sim_requests()
        .into_iter()
        .filter(|e| e["x_request_id"] == request_id)
        .collect();
    let prefill = entries
        .iter()
        .filter(|e| e["leg"] == "prefill")
        .cloned()
        .collect();
    let decode = entries
        .iter()
        .filter(|e| e["leg"] == "decode")
        .cloned()
        .collect();
    (prefill, decode)
}

/// Checks one PD exchange: prefill leg on a prefill pod and decode leg on the decode pod of
/// the same roleset, carrying the prefill's kv_transfer_params with remote_host rewritten.
fn assert_pd_exchange(stack: &Stack, r: &Response) -> (String, String) {
    assert_eq!(r.status, 200, "{}", r.text());
    let request_id = header(r, "request-id").to_string();
    let decode_name = header(r, "target-pod").to_string();
    let prefill_name = header(r, "prefill-target-pod").to_string();
    let decode = stack.fleet.spec(&decode_name);
    let prefill = stack.fleet.spec(&prefill_name);
    assert_eq!(decode.role, "decode");
    assert_eq!(prefill.role, "prefill");
    assert_eq!(
        decode.roleset, prefill.roleset,
        "pair must come from one roleset"
    );
    assert_eq!(header(r, "target-pod-ip"), decode.address());
    assert_eq!(header(r, "prefill-target-pod-ip"), prefill.ip);

    let (prefill_legs, decode_legs) = legs(stack, &request_id);
    assert_eq!(prefill_legs.len(), 1, "one prefill leg: {prefill_legs:?}");
    assert_eq!(decode_legs.len(), 1, "one decode leg: {decode_legs:?}");
    let (p, d) = (&prefill_legs[0], &decode_legs[0]);
    assert_eq!(p["pod"], prefill_name.as_str());
    assert_eq!(d["pod"], decode_name.as_str());
    assert_eq!(p["body"]["max_tokens"], 1);
    assert_eq!(p["body"]["stream"], false);
    assert_eq!(p["kv_transfer_params_in"]["do_remote_decode"], true);

    let mut expected = p["kv_transfer_params_out"].clone();
    assert_eq!(
        expected["remote_host"], "localhost",
        "pd-sim reports its side-channel host"
    );
    expected["remote_host"] = json!(prefill.ip);
    assert_eq!(
        d["kv_transfer_params_in"], expected,
        "decode got the prefill's params, remote_host rewritten"
    );
    (prefill_name, decode_name)
}

#[test]
fn non_streaming_pd_request_goes_prefill_then_decode_of_one_roleset() {
    let stack = Stack::start(two_rolesets());
    let r = stack.chat(&[("routing-strategy", "pd")], &chat_body(false, 7));
    assert_pd_exchange(&stack, &r);
    let answer = r.json();
    let request_id = header(&r, "request-id");
    assert_eq!(
        answer["id"],
        format!("chatcmpl-{request_id}"),
        "the decode pod's answer, by its id"
    );
    assert_eq!(
        answer["usage"]["completion_tokens"], 7,
        "decode generated the whole answer"
    );
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(header(&r, "x-went-into-req-headers"), "true");
}

/// An HTTP/2 client ending its request with trailers (gRPC-style clients and some proxies
/// do): the body's last DATA frame does not end the stream, the trailers do. The request is
/// routed on its whole body like any other, PD and single-pod.
#[test]
fn a_request_ending_in_trailers_is_routed_on_its_whole_body() {
    let stack = Stack::start(two_rolesets());
    let body = chat_body(false, 3).to_string();
    let send = |strategy: &str| {
        runtime().block_on(async_client::post_with_trailers(
            &stack.gateway,
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                ("routing-strategy", strategy),
            ],
            body.as_bytes(),
        ))
    };
    let r = send("pd");
    assert_pd_exchange(&stack, &r);
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
    let r = send("least-request");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(header(&r, "target-pod"), "vllm-c-0");
}

/// A client streaming its upload (chunked, no content-length, the body cut mid-character and
/// large enough to reach the filter in several body callbacks): the filter routes on the
/// whole body, both legs carry the prompt intact, and a single-pod request is relayed intact.
#[test]
fn a_chunked_request_body_is_routed_whole() {
    let stack = Stack::start(two_rolesets());
    let prompt = "Prefill reads the prompt; décodé tokens follow. ".repeat(4000);
    let body = json!({"model": MODEL, "max_tokens": 3,
                      "messages": [{"role": "user", "content": prompt}]})
    .to_string();
    let bytes = body.as_bytes();
    let cut = bytes
        .iter()
        .position(|b| *b >= 0x80)
        .expect("a multi-byte character")
        + 1;
    let pieces = [
        &bytes[..cut],
        &bytes[cut..bytes.len() / 2],
        &bytes[bytes.len() / 2..],
    ];
    let send = |strategy: &str| {
        pd_wasm_tests::http::post_chunked(
            &stack.gateway,
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                ("routing-strategy", strategy),
            ],
            &pieces,
        )
        .expect("chunked POST")
    };
    let r = send("pd");
    assert_pd_exchange(&stack, &r);
    let (prefill, decode) = legs(&stack, header(&r, "request-id"));
    for leg in [&prefill[0], &decode[0]] {
        assert_eq!(
            leg["body"]["messages"][0]["content"].as_str(),
            Some(prompt.as_str())
        );
    }
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);

    let r = send("least-request");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(header(&r, "target-pod"), "vllm-c-0");
    let entries = stack.sim_requests();
    let served = entries
        .iter()
        .find(|e| e["x_request_id"] == header(&r, "request-id"))
        .expect("the standard pod's log entry");
    assert_eq!(
        served["body"]["messages"][0]["content"].as_str(),
        Some(prompt.as_str())
    );
}

/// An HTTP/2 client (h2c with prior knowledge, as a front proxy or a gRPC-style SDK speaks):
/// eight requests multiplexed on one connection, streaming and not, are each routed through
/// their own PD exchange, and a refusal comes back as on HTTP/1.1.
#[test]
fn http2_clients_multiplex_pd_requests_on_one_connection() {
    let stack = Stack::start(two_rolesets());
    let url = format!("http://{}/v1/chat/completions", stack.gateway);
    let answers: Vec<Response> = runtime().block_on(async {
        let client = client(true);
        let send = |body: Value, strategy: &'static str| {
            let request = client
                .post(&url)
                .header("content-type", "application/json")
                .header("routing-strategy", strategy)
                .body(body.to_string());
            async move {
                let r = request.send().await.expect("sent");
                assert_eq!(r.version(), reqwest::Version::HTTP_2);
                answer(r).await
            }
        };
        // The first request opens the connection the others share.
        let first = send(chat_body(false, 2), "pd").await;
        let mut rest = Vec::new();
        for i in 0..8u32 {
            rest.push(send(chat_body(i % 2 == 0, 2 + i), "pd"));
        }
        let mut answers = vec![first];
        answers.extend(futures_util::future::join_all(rest).await);
        let unknown =
            json!({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]});
        answers.push(send(unknown, "pd").await);
        answers
    });
    let stats = pd_wasm_tests::http::get(&stack.admin, "/stats?filter=downstream_cx_http2_total")
        .expect("Envoy admin")
        .text();
    assert!(
        stats.contains("http.pd_ingress.downstream_cx_http2_total: 1\n"),
        "one HTTP/2 connection carried them all: {stats}"
    );
    let (refused, routed) = answers.split_last().expect("answers");
    let mut ids = BTreeSet::new();
    for (i, r) in routed.iter().enumerate() {
        assert_pd_exchange(&stack, r);
        assert!(
            ids.insert(header(r, "request-id").to_string()),
            "request {i}"
        );
        if i > 0 && (i - 1) % 2 == 0 {
            let text = r.text();
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        } else {
            assert_eq!(r.json()["object"], "chat.completion");
        }
    }
    assert_eq!(refused.status, 400, "{}", refused.text());
    assert_eq!(
        refused.header("x-error-no-model-backends"),
        Some("no-such-model")
    );
    assert!(refused.json()["error"]["message"].is_string());
}

/// POSTs `body` to the gateway over HTTP/2 (h2c) or HTTP/1.1.
fn post_over(stack: &Stack, http2: bool, body: Vec<u8>) -> Response {
    let url = format!("http://{}/v1/completions", stack.gateway);
    runtime().block_on(async {
        let r = client(http2)
            .post(&url)
            .header("content-type", "application/json")
            .header("routing-strategy", "pd")
            .body(body)
            .send()
            .await
            .expect("sent");
        answer(r).await
    })
}

fn completion_of(bytes: usize) -> Vec<u8> {
    json!({"model": MODEL, "max_tokens": 2, "prompt": "x".repeat(bytes)})
        .to_string()
        .into_bytes()
}

/// A body over the plugin's `max_request_body_bytes` (8 MiB by default, the drop-in's listener
/// bound) is refused with 413 whatever the client speaks: Envoy's buffer limit holds for
/// HTTP/1.1 only, and an HTTP/2 stream took 9 MiB into the VM before the filter bound it. The
/// refusal is counted, and no pod sees the request.
#[test]
fn a_body_over_the_bound_is_refused_over_http2_too() {
    let stack = Stack::start(two_rolesets());
    let r = post_over(&stack, true, completion_of(9 * 1024 * 1024));
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(r.header("x-error-request-body-processing"), Some("true"));
    assert_eq!(
        r.header("x-error-response-unknown"),
        None,
        "the filter's own"
    );
    assert_eq!(
        r.json()["error"]["message"],
        "request body exceeds 8388608 bytes"
    );
    assert_eq!(
        stack.metric("pd_router_rejected_total", &[("reason", "body_too_large")]),
        1.0
    );
    assert!(stack.sim_requests().is_empty(), "no pod took the body");
    // Below the bound, HTTP/2 bodies are routed as ever.
    assert_pd_exchange(&stack, &post_over(&stack, true, completion_of(1024 * 1024)));
    drop(stack);

    // A lower bound applies to HTTP/1.1 too, below Envoy's own.
    let fleet = two_rolesets();
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet,
        &Options {
            plugin_extra: r#""max_request_body_bytes":65536"#,
            ..Options::default()
        },
    );
    for http2 in [false, true] {
        let r = post_over(&stack, http2, completion_of(100_000));
        assert_eq!(r.status, 413, "http2 {http2}: {}", r.text());
        assert_pd_exchange(&stack, &post_over(&stack, http2, completion_of(60_000)));
    }
}

/// Pods on IPv6 addresses (IPv6-only or dual-stack clusters): the destination Envoy dials is
/// `[ip]:port`, while the engines' own fields (`remote_host`, `prefill-target-pod-ip`) keep
/// the bare IP, as AIBrix writes them.
#[test]
fn pods_on_ipv6_addresses_are_reached_through_envoy() {
    let fleet = Fleet::new(MODEL)
        .pod("vllm-p-6", "prefill", "group-6")
        .ipv6()
        .pod("vllm-d-6", "decode", "group-6")
        .ipv6()
        .combined("vllm-c-6")
        .ipv6();
    let stack = Stack::start(fleet);
    let r = stack.chat(&[("routing-strategy", "pd")], &chat_body(false, 3));
    assert_pd_exchange(&stack, &r);
    assert_eq!(header(&r, "prefill-target-pod-ip"), "::1");
    assert!(header(&r, "target-pod-ip").starts_with("[::1]:"));

    let r = stack.chat(
        &[("routing-strategy", "least-request")],
        &chat_body(true, 3),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.complete, "the stream ended properly");
    assert_eq!(header(&r, "target-pod"), "vllm-c-6");
    assert_eq!(
        header(&r, "target-pod-ip"),
        stack.fleet.spec("vllm-c-6").address()
    );
}

#[test]
fn streaming_pd_request_is_relayed_intact() {
    let stack = Stack::start(two_rolesets());
    let r = stack.chat(&[("routing-strategy", "pd")], &chat_body(true, 5));
    assert_pd_exchange(&stack, &r);
    assert!(header(&r, "content-type").starts_with("text/event-stream"));
    assert!(r.complete, "the chunked stream ended properly");
    let text = r.text();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .collect();
    assert_eq!(events.last().copied(), Some("data: [DONE]"));
    let tokens = events
        .iter()
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).expect("each event is JSON"))
        .filter(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|c| !c.is_empty())
        })
        .count();
    assert_eq!(tokens, 5, "every decode token reached the client: {text}");
}

/// Anthropic's Messages API, which vLLM serves with chat's `kv_transfer_params`: the pair is
/// chosen and spliced as for chat, the named-event stream reaches the client whole, and its
/// `message_delta` usage (`output_tokens`, not `completion_tokens`) gives the request a TPOT.
/// Outside PD the body goes to one pod unchanged.
#[test]
fn anthropic_messages_go_through_a_vllm_pair_and_their_stream_counts_its_tokens() {
    let stack = Stack::start(two_rolesets());
    let body = json!({
        "model": MODEL,
        "system": "be brief",
        "max_tokens": 5,
        "stream": true,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me about prefill and decode."}]}],
    });
    let r = post(&stack, "/v1/messages", "pd", &body);
    assert_pd_exchange(&stack, &r);
    assert!(r.complete, "the chunked stream ended properly");
    let text = r.text();
    let events: Vec<(&str, Value)> = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').expect("event and data lines");
            let data = data.strip_prefix("data: ").expect("data line");
            (
                name.trim_start_matches("event: "),
                serde_json::from_str(data).expect("each event is JSON"),
            )
        })
        .collect();
    assert_eq!(events.first().map(|e| e.0), Some("message_start"), "{text}");
    assert_eq!(events.last().map(|e| e.0), Some("message_stop"), "{text}");
    let deltas = events
        .iter()
        .filter(|(name, _)| *name == "content_block_delta")
        .count();
    assert_eq!(deltas, 5, "every decode token reached the client: {text}");
    let request_id = header(&r, "request-id").to_string();
    let (prefill, decode) = legs(&stack, &request_id);
    assert_eq!(prefill[0]["path"], "/v1/messages");
    assert_eq!(decode[0]["path"], "/v1/messages");
    assert_eq!(
        decode[0]["body"]["system"], "be brief",
        "the client's body, spliced"
    );
    assert_eq!(decode[0]["body"]["max_tokens"], 5);
    let tpot = |stack: &Stack| stack.scrape().sum("gateway_tpot_bucket_total", &[]);
    pd_wasm_tests::stack::eventually(std::time::Duration::from_secs(10), || {
        let n = tpot(&stack);
        if n == 1.0 {
            Ok(())
        } else {
            Err(format!(
                "{n} TPOT counts; the stream's output_tokens was not read"
            ))
        }
    });

    // Not PD: one pod, the body as sent.
    let mut plain = body.clone();
    plain["stream"] = json!(false);
    let r = post(&stack, "/v1/messages", "random", &plain);
    assert_eq!(r.status, 200, "{}", r.text());
    let answer = r.json();
    assert_eq!(answer["type"], "message");
    assert_eq!(answer["usage"]["output_tokens"], 5);
    assert!(answer.get("kv_transfer_params").is_none(), "{answer}");
}

/// `external-filter` narrows the candidates by a Kubernetes label selector before selection:
/// every pair then comes from the pods it keeps; one that keeps none, or does not parse, is
/// a selection failure (503) before any leg.
#[test]
fn external_filter_selects_the_pods_a_request_may_use() {
    let fleet = Fleet::new(MODEL)
        .pod("vllm-p-0", "prefill", "group-0")
        .label("tier", "canary")
        .pod("vllm-d-0", "decode", "group-0")
        .label("tier", "canary")
        .pod("vllm-p-1", "prefill", "group-1")
        .label("tier", "stable")
        .pod("vllm-d-1", "decode", "group-1")
        .label("tier", "stable")
        .combined("vllm-c-0");
    let stack = Stack::start_with(fleet, 2, LEAST_REQUEST);
    for (selector, prefill, decode) in [
        ("tier=canary", "vllm-p-0", "vllm-d-0"),
        ("tier in (stable), !gone", "vllm-p-1", "vllm-d-1"),
    ] {
        for _ in 0..4 {
            let r = stack.chat(
                &[("routing-strategy", "pd"), ("external-filter", selector)],
                &chat_body(false, 2),
            );
            let (p, d) = assert_pd_exchange(&stack, &r);
            assert_eq!((p.as_str(), d.as_str()), (prefill, decode), "{selector}");
        }
    }
    let prefill_legs: Vec<Value> = stack
        .sim_requests()
        .into_iter()
        .filter(|e| e["leg"] == "prefill")
        .collect();
    assert!(
        prefill_legs
            .iter()
            .all(|e| e["headers"]["external-filter"].is_string()),
        "the header is forwarded on the prefill leg, as AIBrix does"
    );
    let r = stack.chat(
        &[
            ("routing-strategy", "random"),
            ("external-filter", "tier!=canary"),
        ],
        &chat_body(false, 2),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(header(&r, "target-pod"), "vllm-c-0");

    let before = stack.sim_requests().len();
    for selector in ["tier=gone", "tier in (canary"] {
        let r = stack.chat(
            &[("routing-strategy", "pd"), ("external-filter", selector)],
            &chat_body(false, 2),
        );
        assert_error(
            &r,
            503,
            "x-error-routing",
            "true",
            "error on selecting target pod",
        );
    }
    assert_eq!(stack.sim_requests().len(), before, "no leg was sent");
}

/// `/v1/messages/count_tokens` computes nothing on the engine: under `pd`, in a fleet of
/// prefill and decode pods only, it goes whole to the least busy of them.
#[test]
fn a_messages_token_count_goes_to_one_pod_of_any_role() {
    let stack = Stack::start(
        Fleet::new(MODEL)
            .pod("vllm-p-0", "prefill", "group-0")
            .pod("vllm-d-0", "decode", "group-0"),
    );
    let body = json!({"model": MODEL, "system": "x".repeat(39),
                      "messages": [{"role": "user", "content": "y".repeat(40)}]});
    let r = post(&stack, "/v1/messages/count_tokens", "pd", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json(), json!({"input_tokens": 20}));
    assert_eq!(header(&r, "routing-strategy"), "least-request");
    assert!(
        r.header("prefill-target-pod").is_none(),
        "no pair: {:?}",
        r.headers
    );
    let entries = stack.sim_requests();
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0]["path"], "/v1/messages/count_tokens");
    assert_eq!(entries[0]["pod"], header(&r, "target-pod"));
    assert_eq!(entries[0]["body"], body, "the body as sent");
}

/// The Responses API: vLLM's answer carries no `kv_transfer_params`, so a PD request is
/// refused before any leg (AIBrix would send a prefill leg that generates a whole answer);
/// a single-pod strategy relays it, stream and all. AIBrix's refusals of a bad `input`.
#[test]
fn responses_go_to_one_pod_and_are_refused_as_a_pd_pair() {
    let stack = Stack::start(two_rolesets());
    let post = |strategy: &str, body: &Value| post(&stack, "/v1/responses", strategy, body);
    let body = json!({"model": MODEL, "input": [{"role": "user", "content": "Tell me about prefill."}],
                      "max_output_tokens": 4, "stream": true});
    let r = post("pd", &body);
    assert_error(
        &r,
        501,
        "x-error-routing",
        "true",
        "/v1/responses is not served by vllm prefill/decode pairs",
    );
    let r = post("pd", &json!({"model": MODEL, "input": []}));
    assert_error(
        &r,
        400,
        "x-error-request-body-processing",
        "true",
        "'input' array cannot be empty",
    );
    assert_eq!(r.json()["error"]["param"], "input");
    assert!(
        stack.sim_requests().is_empty(),
        "{:?}",
        stack.sim_requests()
    );

    let r = post("least-request", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(header(&r, "target-pod"), "vllm-c-0");
    assert!(r.complete, "the chunked stream ended properly");
    let text = r.text();
    assert_eq!(
        text.matches("event: response.output_text.delta\n").count(),
        4,
        "{text}"
    );
    let entries = stack.sim_requests();
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0]["path"], "/v1/responses");
    assert_eq!(entries[0]["body"], body, "the body as sent");
    let scrape = stack.scrape();
    for reason in ["path_not_for_engine", "missing_field"] {
        assert_eq!(
            scrape.sum("pd_router_rejected_total", &[("reason", reason)]),
            1.0,
            "{reason}"
        );
    }
}

#[test]
fn a_roleset_whose_decode_pod_is_removed_stops_being_chosen_once_every_worker_adopted_it() {
    // least_request on both sides: idle rolesets tie, so sequential requests reach both.
    let mut stack = Stack::start_with(two_rolesets(), 2, LEAST_REQUEST);
    let body = chat_body(false, 2);
    let mut before = BTreeSet::new();
    for _ in 0..24 {
        let r = stack.chat(&[("routing-strategy", "pd")], &body);
        assert_eq!(r.status, 200, "{}", r.text());
        before.insert(header(&r, "target-pod").to_string());
    }
    assert_eq!(
        before.len(),
        2,
        "both rolesets serve before the edit: {before:?}"
    );

    let edited = stack.fleet.without("vllm-d-1");
    stack.write_fleet(edited);
    // Traffic keeps flowing during the switch-over; nothing may fail.
    stack.load_until_adopted(|| {
        let r = stack.chat(&[("routing-strategy", "pd")], &body);
        assert_eq!(r.status, 200, "{}", r.text());
    });
    // From now on every worker must route around group-1. Fresh connections spread the
    // requests over both workers (40 requests all on one worker: probability 2^-39).
    for _ in 0..40 {
        let r = stack.chat(&[("routing-strategy", "pd")], &body);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(header(&r, "target-pod"), "vllm-d-0");
        assert_eq!(
            header(&r, "prefill-target-pod"),
            "vllm-p-0",
            "the incomplete roleset gives no prefill pod either"
        );
    }
}

#[test]
fn client_supplied_destination_headers_have_no_effect() {
    let stack = Stack::start(two_rolesets());
    let decoy = stack.fleet.spec("vllm-p-1");
    let decoy_addr = format!("{}:{}", decoy.ip, decoy.port);
    for header_name in ["x-envoy-original-dst-host", "target-pod"] {
        // PD requests: the decode leg must still land on a decode pod.
        let r = stack.chat(
            &[
                ("routing-strategy", "pd"),
                (header_name, decoy_addr.as_str()),
            ],
            &chat_body(false, 2),
        );
        assert_pd_exchange(&stack, &r);
        // Single-pod requests: the combined pod, not the decoy.
        let r = stack.chat(&[(header_name, decoy_addr.as_str())], &chat_body(false, 2));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(header(&r, "target-pod"), "vllm-c-0");
    }
    let on_decoy: Vec<Value> = stack
        .sim_requests()
        .into_iter()
        .filter(|e| e["pod"] == "vllm-p-1" && e["leg"] != "prefill")
        .collect();
    assert!(
        on_decoy.is_empty(),
        "the decoy only ever served prefill legs: {on_decoy:?}"
    );
}

fn assert_error(r: &Response, status: u16, header_name: &str, header_value: &str, message: &str) {
    assert_eq!(r.status, status, "{}", r.text());
    assert_eq!(r.header(header_name), Some(header_value), "{:?}", r.headers);
    assert!(r.header("request-id").is_some_and(|v| !v.is_empty()));
    assert_eq!(r.header("content-type"), Some("application/json"));
    let body = r.json();
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with(message)),
        "message {:?} should start with {message:?}",
        body["error"]["message"]
    );
    assert!(
        body["error"].get("type").is_some()
            && body["error"].get("code").is_some()
            && body["error"].get("param").is_some()
    );
}

#[test]
fn errors_have_status_header_and_openai_body() {
    let fleet = two_rolesets()
        .pod("half-p-0", "prefill", "half-0")
        .of_model("half-model")
        .pod("down-0", "all", "")
        .of_model("down-model")
        .not_ready();
    let stack = Stack::start(fleet);
    let gw = stack.gateway.clone();
    let pd = [
        ("routing-strategy", "pd"),
        ("content-type", "application/json"),
    ];

    let r = pd_wasm_tests::http::request(&gw, "POST", "/v1/chat/completions", &pd, b"{\"model\": ")
        .unwrap();
    assert_error(
        &r,
        400,
        "x-error-request-body-processing",
        "true",
        "error processing request body",
    );

    let r = stack.chat(&pd, &json!({"model": MODEL, "messages": []}));
    assert_error(
        &r,
        400,
        "x-error-request-body-processing",
        "true",
        "no messages in the request body",
    );

    let r = stack.chat(
        &pd,
        &json!({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_error(
        &r,
        400,
        "x-error-no-model-backends",
        "no-such-model",
        "model no-such-model does not exist",
    );
    assert_eq!(r.json()["error"]["code"], "model_not_found");

    let r = stack.chat(
        &pd,
        &json!({"model": "down-model", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_error(
        &r,
        503,
        "x-error-no-model-backends",
        "true",
        "error on getting pods for model down-model",
    );

    let r = stack.chat(
        &pd,
        &json!({"model": "half-model", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_error(
        &r,
        503,
        "x-error-routing",
        "true",
        "error on selecting target pod",
    );

    let r = stack.chat(
        &[("routing-strategy", "no-such-strategy")],
        &chat_body(false, 1),
    );
    assert_error(
        &r,
        400,
        "x-error-routing",
        "true",
        "incorrect routing strategy no-such-strategy",
    );

    let r = pd_wasm_tests::http::post_json(&gw, "/v1/unknown", &pd, &chat_body(false, 1));
    assert_error(
        &r,
        501,
        "x-error-request-body-processing",
        "true",
        "unknown request path",
    );

    // Refusals are counted by reason: one of each above.
    let scrape = stack.scrape();
    for reason in [
        "bad_body",
        "no_messages",
        "unknown_model",
        "no_routable_pods",
        "selection",
        "bad_strategy",
        "unknown_path",
    ] {
        assert_eq!(
            scrape.sum("pd_router_rejected_total", &[("reason", reason)]),
            1.0,
            "{reason}"
        );
    }
    assert_eq!(scrape.sum("pd_router_rejected_total", &[]), 7.0);
    // The unknown path is refused on its headers, before any model is read.
    assert_eq!(
        scrape.sum(
            "gateway_request_model_fail_total",
            &[("status", "request_headers_fail")]
        ),
        1.0
    );
    assert_eq!(
        scrape.value(
            "gateway_request_model_fail_total",
            &[
                ("model", "unknown"),
                ("status", "request_headers_fail"),
                ("status_code", "501")
            ]
        ),
        Some(1.0)
    );
    // Nothing reached a pod for any of them.
    assert!(
        stack.sim_requests().is_empty(),
        "{:?}",
        stack.sim_requests()
    );
}

#[test]
fn a_failed_prefill_leg_answers_x_error_pd_prefill_and_releases_its_charges() {
    let fleet = Fleet::new(MODEL)
        .pod("dead-p-0", "prefill", "group-0")
        .pod("vllm-d-0", "decode", "group-0")
        .pod("vllm-p-1", "prefill", "group-1")
        .pod("vllm-d-1", "decode", "group-1");
    // pd-sim does not serve dead-p-0: its address refuses connections. Passive ejection,
    // prefill failover and pd-control's reachability mark are off: this test is about the
    // charges of failed legs, so the dead pod must stay chosen and its failures reach the
    // client.
    let simulated = fleet.without("dead-p-0");
    let stack = Stack::start_opts(
        fleet,
        simulated,
        &Options {
            envoy_env: LEAST_REQUEST,
            control_args: &["--unreachable-after", "0"],
            plugin_extra: r#""eject_after_failures": 0, "prefill_failover": 0"#,
            ..Options::default()
        },
    );
    let mut failures = 0;
    for _ in 0..40 {
        let r = stack.chat(&[("routing-strategy", "pd")], &chat_body(false, 1));
        if r.status == 200 {
            assert_eq!(header(&r, "prefill-target-pod"), "vllm-p-1");
            continue;
        }
        failures += 1;
        // A refused connection is the pod's transport failing: 502, not Envoy's 503.
        assert_error(
            &r,
            502,
            "x-error-pd-prefill",
            "true",
            "prefill request failed",
        );
    }
    // Both rolesets are idle between these sequential requests, so a released charge leaves
    // group-0 tied with group-1 (chosen about half the time). A leaked charge would make
    // group-0 look busy for ever after its first failure.
    assert!(
        failures >= 8,
        "group-0 stopped being chosen after {failures} failures: a charge leaked"
    );
    let decode_on_dead_roleset = stack
        .sim_requests()
        .into_iter()
        .filter(|e| e["pod"] == "vllm-d-0")
        .count();
    assert_eq!(
        decode_on_dead_roleset, 0,
        "no decode leg follows a failed prefill"
    );
    // Counted as AIBrix does: once by the route step, once by transport class.
    let scrape = stack.scrape();
    let fails = |status: &str, code: &str| {
        scrape.sum(
            "gateway_prefill_request_fail_total",
            &[("status", status), ("status_code", code)],
        )
    };
    assert_eq!(fails("pd-do-prefill-request-error", "500"), failures as f64);
    assert_eq!(fails("error", "502"), failures as f64);
    assert_eq!(
        scrape.sum(
            "gateway_request_model_fail_total",
            &[
                ("model", MODEL),
                ("status", "pd_prefill_failure"),
                ("status_code", "502")
            ]
        ),
        failures as f64
    );
    assert_eq!(
        scrape.value("gateway_prefill_outstanding_requests", &[]),
        Some(0.0)
    );
}

#[test]
fn with_an_api_key_set_only_requests_carrying_it_reach_a_pod() {
    let stack = Stack::start_with(
        two_rolesets(),
        2,
        &[("AIBRIX_AUTH_BEARER_TOKEN", " s3cret ")],
    );
    let refused = [
        vec![("routing-strategy", "pd")],
        vec![
            ("routing-strategy", "pd"),
            ("authorization", "Bearer wrong"),
        ],
        vec![
            ("routing-strategy", "pd"),
            ("authorization", "Basic s3cret"),
        ],
        vec![("routing-strategy", "pd"), ("authorization", "s3cret")],
    ];
    for headers in &refused {
        let r = stack.chat(headers, &chat_body(false, 2));
        assert_eq!(r.status, 401, "{headers:?}: {}", r.text());
        assert!(r.header("request-id").is_some());
        assert_eq!(
            r.json(),
            json!({"error": {"message": "Incorrect API key provided",
                             "type": "authentication_error", "code": "invalid_api_key",
                             "param": "api_key"}}),
            "{headers:?}"
        );
    }
    // Refused before the path is looked at: an unauthenticated client learns nothing else.
    let r = pd_wasm_tests::http::request(
        &stack.gateway,
        "POST",
        "/v1/unknown",
        &[("content-type", "application/json")],
        chat_body(false, 2).to_string().as_bytes(),
    )
    .expect("answer");
    assert_eq!(r.status, 401, "{}", r.text());
    // A readiness probe carries no key: it is answered, and counted nowhere.
    let probe = pd_wasm_tests::http::get(&stack.gateway, "/pd-router/ready").expect("answer");
    assert_eq!(probe.status, 200, "{}", probe.text());
    assert_eq!(probe.json()["ready"], true, "{}", probe.text());
    assert!(
        stack.sim_requests().is_empty(),
        "a refused request reached a pod"
    );
    assert_eq!(
        stack.metric("pd_router_rejected_total", &[("reason", "unauthorized")]),
        5.0
    );
    // Refused on the request headers, the unknown path among them.
    assert_eq!(
        stack.metric(
            "gateway_request_model_fail_total",
            &[
                ("model", "unknown"),
                ("status", "request_headers_fail"),
                ("status_code", "401")
            ]
        ),
        5.0
    );

    // The key itself, in any case of the scheme, passes; the prefill leg carries it on.
    let r = stack.chat(
        &[
            ("routing-strategy", "pd"),
            ("authorization", "bearer s3cret"),
        ],
        &chat_body(false, 2),
    );
    let (_, _) = assert_pd_exchange(&stack, &r);
    let (prefill, _) = legs(&stack, header(&r, "request-id"));
    assert_eq!(
        prefill[0]["headers"]["authorization"], "bearer s3cret",
        "{prefill:?}"
    );
}

/// The decode pod sees the strategy that routed it: the client's own header when it says
/// exactly that once, the gateway's when it said another (a locked strategy), said it twice,
/// or said nothing.
#[test]
fn the_decode_leg_carries_the_strategy_that_routed_it() {
    let locked =
        r#"{"lockedRoutingStrategy":"pd","profiles":{"default":{"routingStrategy":"pd"}}}"#;
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .config(locked)
        .pod("d0", "decode", "g0")
        .config(locked);
    let stack = Stack::start(fleet);
    let cases: [&[(&str, &str)]; 4] = [
        &[("routing-strategy", "pd")],
        &[("routing-strategy", "random")],
        &[("routing-strategy", "pd"), ("routing-strategy", "pd")],
        &[],
    ];
    for sent in cases {
        let r = pd_wasm_tests::http::post_json(
            &stack.gateway,
            "/v1/chat/completions",
            sent,
            &chat_body(false, 2),
        );
        let (_, decode) = legs(&stack, header(&r, "request-id"));
        assert_eq!(decode.len(), 1, "{sent:?}: {decode:?}");
        assert_eq!(
            decode[0]["headers"]["routing-strategy"], "pd",
            "{sent:?}: {decode:?}"
        );
    }
}

/// LoRA adapters (AIBrix `ModelAdapter`s in the fleet file): a request naming an adapter is
/// routed among the pods that loaded it only, PD pairs and standard pods alike, and the pods
/// answer under the adapter's name; the base model keeps every pod; an adapter no pod loaded
/// is an unknown model.
#[test]
fn a_lora_adapter_routes_to_the_pods_that_loaded_it() {
    let fleet = two_rolesets()
        .combined("vllm-c-1")
        .adapter("sql-lora", &["vllm-p-1", "vllm-d-1", "vllm-c-1"])
        .adapter("half-lora", &["vllm-p-0", "vllm-c-0"]);
    let stack = Stack::start(fleet);
    let ask = |model: &str, strategy: &str, i: usize| {
        let body = json!({"model": model, "max_tokens": 2,
                          "messages": [{"role": "user", "content": format!("query {i}")}]});
        post(&stack, "/v1/chat/completions", strategy, &body)
    };
    // The base model's PD requests reach vllm-p-1 first (narrowed to its roleset): its
    // selection counters keep the two models apart, whichever came first.
    for i in 0..2 {
        let body = json!({"model": MODEL, "max_tokens": 2,
                          "messages": [{"role": "user", "content": format!("base {i}")}]});
        let r = pd_wasm_tests::http::post_json(
            &stack.gateway,
            "/v1/chat/completions",
            &[
                ("routing-strategy", "pd"),
                ("external-filter", "roleset-name=group-1"),
            ],
            &body,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(header(&r, "prefill-target-pod"), "vllm-p-1");
    }
    stack.clear_sim_requests();
    for i in 0..8 {
        let r = ask("sql-lora", "pd", i);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.json()["model"],
            "sql-lora",
            "the pod answers as the adapter"
        );
        assert_eq!(header(&r, "prefill-target-pod"), "vllm-p-1");
        assert_eq!(header(&r, "target-pod"), "vllm-d-1");
        let r = ask("sql-lora", "random", i);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(header(&r, "target-pod"), "vllm-c-1");
        let r = ask("sql-lora", "lora-affinity", i);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(header(&r, "target-pod"), "vllm-c-1");
        assert_eq!(header(&r, "routing-strategy"), "lora-affinity");
    }
    let selected = |model: &str| {
        stack.metric(
            "pd_selected_prefill_pod_total",
            &[("pod", "vllm-p-1"), ("model", model)],
        )
    };
    assert_eq!(selected("sql-lora"), 8.0);
    assert_eq!(selected(MODEL), 2.0);
    // Both legs reached the adapter's pods with the adapter's name.
    let legs = stack.sim_requests();
    assert_eq!(legs.len(), 8 * 4);
    assert!(
        legs.iter().all(|e| e["body"]["model"] == "sql-lora"),
        "{legs:?}"
    );
    // half-lora has no complete roleset: PD goes to its standard pod (Step 0).
    let r = ask("half-lora", "pd", 0);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(header(&r, "target-pod"), "vllm-c-0");
    // The base model still has every pod.
    let mut pairs = BTreeSet::new();
    for i in 0..16 {
        let r = ask(MODEL, "least-request", i);
        assert_eq!(r.status, 200, "{}", r.text());
        pairs.insert(header(&r, "target-pod").to_string());
    }
    assert_eq!(
        pairs.len(),
        2,
        "both standard pods serve the base model: {pairs:?}"
    );
    let r = ask("never-loaded", "pd", 0);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.header("x-error-no-model-backends"), Some("never-loaded"));
}

/// Two requests of one trace (an agent's parallel calls share a `traceparent` trace id) are
/// in flight on one vLLM prefill pod at once: each is its own request to the engine, which
/// refuses a second request of an id still running. The ids begin with the trace id.
#[test]
fn two_requests_of_one_trace_in_flight_at_once_are_two_requests_to_the_engine() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let stack = Stack::start(fleet);
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traced = [
        ("routing-strategy", "pd"),
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
    ];
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2});
    // The first request's prefill is held at its pod until the second was answered.
    stack.arm_fault(
        json!({"pod": "p0", "kind": "hang_before_headers", "leg": "prefill",
                           "times": 1}),
    );
    let first = {
        let (gateway, body) = (stack.gateway.clone(), body.clone());
        std::thread::spawn(move || {
            pd_wasm_tests::http::post_json(&gateway, "/v1/completions", &traced, &body)
        })
    };
    stack.wait_for_legs("prefill", 1);
    let second = pd_wasm_tests::http::post_json(&stack.gateway, "/v1/completions", &traced, &body);
    assert_eq!(second.status, 200, "{}", second.text());
    stack.clear_faults();
    let first = first.join().expect("client");
    assert_eq!(first.status, 200, "{}", first.text());
    let (a, b) = (header(&first, "request-id"), header(&second, "request-id"));
    assert_ne!(a, b);
    for id in [a, b] {
        assert!(id.starts_with(&format!("{trace}-")), "{id}");
        let (prefill, decode) = legs(&stack, id);
        assert_eq!((prefill.len(), decode.len()), (1, 1), "{id}");
        assert_eq!(decode[0]["kv_pull"], "ok", "{:#}", decode[0]);
    }
}
