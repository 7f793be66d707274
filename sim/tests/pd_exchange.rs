//! End-to-end over real sockets: a 1 prefill + 1 decode fleet file served in-process, a vLLM
//! prefill leg followed by the decode leg with the returned `kv_transfer_params`, the pods'
//! request logs, `/metrics`, the admin endpoints, and a fleet edit that removes a pod.

use std::time::{Duration, Instant};

use pd_sim::pod::SimConfig;
use pd_sim::sim::{serve_admin, FleetWatcher, Sim};
use serde_json::{json, Value};

mod common;
use common::{fleet_yaml, free_port, pod_yaml, TempFile};

const MODEL: &str = "llama-3-8b";

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

async fn post(url: &str, body: &Value, request_id: Option<&str>) -> reqwest::Response {
    let mut req = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(id) = request_id {
        req = req.header("X-Request-Id", id);
    }
    req.send().await.expect("request sent")
}

async fn get_json(url: &str) -> Value {
    let text = client()
        .get(url)
        .send()
        .await
        .expect("GET")
        .text()
        .await
        .expect("body");
    serde_json::from_str(&text).expect("JSON")
}

async fn get_text(url: &str) -> String {
    client()
        .get(url)
        .send()
        .await
        .expect("GET")
        .text()
        .await
        .expect("body")
}

/// Polls `check` every 10 ms until it holds or 5 s pass.
async fn wait_for<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(5);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn metric_line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    text.lines().find(|l| l.starts_with(prefix))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_then_decode_over_http() {
    let (p_port, d_port) = (free_port(), free_port());
    let path =
        std::env::temp_dir().join(format!("pd-sim-test-{}-{p_port}.yaml", std::process::id()));
    let _cleanup = TempFile(path.clone());
    let prefill_pod = pod_yaml(MODEL, "vllm-p-0", "vllm", "prefill", p_port);
    let decode_pod = pod_yaml(MODEL, "vllm-d-0", "vllm", "decode", d_port);
    std::fs::write(&path, fleet_yaml(&[prefill_pod.clone(), decode_pod])).expect("write fleet");

    let watcher =
        FleetWatcher::load(path.clone(), Duration::from_millis(20)).expect("fleet parses");
    let sim = Sim::new(SimConfig::default());
    let report = sim.apply(watcher.records()).await;
    assert_eq!((report.serving, report.failed.len()), (2, 0), "{report:?}");
    let (changes_tx, mut changes_rx) = tokio::sync::mpsc::unbounded_channel();
    let watch = tokio::spawn(watcher.run(sim.clone(), move |r| {
        let _ = changes_tx.send(r.serving);
    }));
    let admin = serve_admin(&sim, "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("admin");
    let prefill = format!("http://127.0.0.1:{p_port}");
    let decode = format!("http://127.0.0.1:{d_port}");

    // Prefill leg, as a router builds it.
    let client_body = json!({"model": MODEL, "prompt": "x".repeat(400), "max_tokens": 4, "stream": true,
                             "stream_options": {"include_usage": true}});
    let prefill_body = json!({"model": MODEL, "prompt": "x".repeat(400), "max_tokens": 1, "stream": false,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                               "remote_block_ids": null, "remote_host": null, "remote_port": null}});
    let resp = post(
        &format!("{prefill}/v1/completions"),
        &prefill_body,
        Some("r1"),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let p: Value = serde_json::from_str(&resp.text().await.expect("body")).expect("JSON");
    assert_eq!(p["id"], "cmpl-r1-0");
    assert_eq!(p["choices"][0]["text"], " tok0");
    assert_eq!(p["choices"][0]["finish_reason"], "length");
    assert_eq!(
        (
            p["usage"]["prompt_tokens"].as_u64(),
            p["usage"]["completion_tokens"].as_u64()
        ),
        (Some(100), Some(1))
    );
    let kv = p["kv_transfer_params"].clone();
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(kv["do_remote_decode"], false);
    assert_eq!(
        kv["remote_host"], "localhost",
        "the router must overwrite it"
    );
    assert_eq!(kv["remote_port"], 5600);
    assert_eq!(kv["remote_request_id"], "cmpl-r1-0");
    assert_eq!(
        kv["remote_block_ids"].as_array().map(Vec::len),
        Some(7),
        "100 tokens / 16 per block"
    );
    let engine_id = kv["remote_engine_id"]
        .as_str()
        .expect("engine id")
        .to_string();

    // The prefill pod holds the blocks until the decode pod pulls them.
    let usage_line =
        |text: &str| metric_line(text, "vllm:kv_cache_usage_perc{").map(str::to_string);
    let before = get_text(&format!("{prefill}/metrics")).await;
    assert_ne!(
        usage_line(&before).as_deref(),
        Some("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"llama-3-8b\"} 0.0")
    );

    // Decode leg: the client body plus the params, remote_host set to the prefill pod's IP.
    let mut decode_body = client_body.clone();
    let mut kv_in = kv.clone();
    kv_in["remote_host"] = json!("127.0.0.1");
    decode_body["kv_transfer_params"] = kv_in.clone();
    let resp = post(
        &format!("{decode}/v1/completions"),
        &decode_body,
        Some("r1"),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let sse = resp.text().await.expect("stream");
    assert!(sse.ends_with("data: [DONE]\n\n"), "{sse}");
    let events: Vec<Value> = sse
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("chunk JSON"))
        .collect();
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, " tok0 tok1 tok2 tok3");
    assert_eq!(events[3]["choices"][0]["finish_reason"], "length");
    let usage = events.last().expect("usage chunk");
    assert_eq!(
        (
            usage["choices"].clone(),
            usage["usage"]["completion_tokens"].as_u64()
        ),
        (json!([]), Some(4))
    );
    assert_eq!(usage["id"], "cmpl-r1-0");
    let after = get_text(&format!("{prefill}/metrics")).await;
    assert_eq!(
        usage_line(&after).as_deref(),
        Some("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"llama-3-8b\"} 0.0"),
        "the pull released the pinned blocks"
    );

    // A decode pod refuses a request that did not go through a prefill pod.
    let resp = post(
        &format!("{decode}/v1/chat/completions"),
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        None,
    )
    .await;
    assert_eq!(resp.status(), 400);
    let err: Value = serde_json::from_str(&resp.text().await.expect("body")).expect("JSON");
    assert_eq!(
        err["error"]["message"],
        "decode pod requires kv_transfer_params from a prefill pod"
    );
    assert_eq!(
        (err["error"]["type"].clone(), err["error"]["code"].clone()),
        (json!("BadRequestError"), json!(400))
    );

    // Other rejections.
    let mut streaming_prefill = prefill_body.clone();
    streaming_prefill["stream"] = json!(true);
    assert_eq!(
        post(
            &format!("{prefill}/v1/completions"),
            &streaming_prefill,
            None
        )
        .await
        .status(),
        400
    );
    let wrong_model = json!({"model": "other", "prompt": "p"});
    assert_eq!(
        post(&format!("{prefill}/v1/completions"), &wrong_model, None)
            .await
            .status(),
        404
    );
    let resp = client()
        .post(format!("{prefill}/v1/completions"))
        .body("{oops")
        .send()
        .await
        .expect("sent");
    assert_eq!(resp.status(), 400);

    // The pods' logs.
    let d_log = get_json(&format!("{decode}/sim/requests")).await;
    let d_log = d_log.as_array().expect("array");
    assert_eq!(d_log.len(), 2);
    assert_eq!(d_log[0]["leg"], "decode");
    assert_eq!(d_log[0]["pod"], "vllm-d-0");
    assert_eq!(d_log[0]["role"], "decode");
    assert_eq!(d_log[0]["roleset"], "rs0");
    assert_eq!(d_log[0]["addr"], format!("127.0.0.1:{d_port}"));
    assert_eq!(d_log[0]["x_request_id"], "r1");
    assert_eq!(d_log[0]["stream"], true);
    assert_eq!(d_log[0]["status"], 200);
    assert_eq!(d_log[0]["kv_pull"], "ok");
    assert_eq!(d_log[0]["kv_transfer_params_in"], kv_in);
    assert_eq!(d_log[0]["headers"]["x-request-id"], "r1");
    assert_eq!(d_log[0]["body"]["max_tokens"], 4);
    assert_eq!(
        (d_log[1]["status"].clone(), d_log[1]["leg"].clone()),
        (json!(400), Value::Null)
    );
    assert_eq!(d_log[1]["path"], "/v1/chat/completions");
    let p_log = get_json(&format!("{prefill}/sim/requests")).await;
    let p_log = p_log.as_array().expect("array");
    assert_eq!(p_log.len(), 4);
    assert_eq!(p_log[0]["leg"], "prefill");
    assert_eq!(p_log[0]["kv_transfer_params_out"], kv);
    assert_eq!(
        p_log[0]["kv_transfer_params_out"]["remote_engine_id"],
        engine_id.as_str()
    );
    assert!(p_log[0]["seq"].as_u64() < d_log[0]["seq"].as_u64());
    assert_eq!(
        p_log[3]["body"],
        Value::Null,
        "malformed JSON is logged without a body"
    );

    // Metrics.
    let d_metrics = get_text(&format!("{decode}/metrics")).await;
    let labels = "{engine=\"0\",model_name=\"llama-3-8b\"}";
    for line in [
        format!("vllm:generation_tokens_total{labels} 4.0"),
        format!("vllm:prompt_tokens_total{labels} 100.0"),
        format!("vllm:num_requests_running{labels} 0.0"),
        "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"llama-3-8b\"} 1.0".to_string(),
        "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"llama-3-8b\"} 1.0".to_string(),
        format!("vllm:time_to_first_token_seconds_count{labels} 1.0"),
    ] {
        assert!(d_metrics.lines().any(|l| l == line), "missing {line}\n{d_metrics}");
    }
    assert!(d_metrics.contains("# TYPE vllm:time_to_first_token_seconds histogram"));

    // Gauges move with load: a long stream shows as running, and hanging up releases it.
    let long = json!({"model": MODEL, "prompt": "y", "max_tokens": 100000, "stream": true});
    let resp = post(&format!("{prefill}/v1/completions"), &long, None).await;
    assert_eq!(resp.status(), 200);
    let running = format!("vllm:num_requests_running{labels} ");
    let gauge = |want: &'static str| {
        let url = format!("{prefill}/metrics");
        let line = format!("{running}{want}");
        move || {
            let (url, line) = (url.clone(), line.clone());
            async move { get_text(&url).await.lines().any(|l| l == line) }
        }
    };
    wait_for("running 1", gauge("1.0")).await;
    drop(resp);
    wait_for("running back to 0 after the client hung up", gauge("0.0")).await;
    let aborted = get_text(&format!("{prefill}/metrics")).await;
    assert!(
        aborted.contains("finished_reason=\"abort\",model_name=\"llama-3-8b\"} 1.0"),
        "{aborted}"
    );

    // Admin view over both pods.
    let admin_url = format!("http://{}", admin.addr);
    let all = get_json(&format!("{admin_url}/sim/requests")).await;
    assert_eq!(all.as_array().map(Vec::len), Some(7));
    let pods = get_json(&format!("{admin_url}/sim/pods")).await;
    let names: Vec<&str> = pods
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert_eq!(names.len(), 2);
    assert!(names.contains(&"vllm-p-0") && names.contains(&"vllm-d-0"));
    let cleared = client()
        .delete(format!("{admin_url}/sim/requests"))
        .send()
        .await
        .expect("DELETE");
    assert_eq!(cleared.status(), 204);
    assert_eq!(
        get_json(&format!("{admin_url}/sim/requests")).await,
        json!([])
    );

    // Removing the decode pod from the fleet closes its listener.
    std::fs::write(&path, fleet_yaml(&[prefill_pod])).expect("rewrite fleet");
    let serving = tokio::time::timeout(Duration::from_secs(5), changes_rx.recv())
        .await
        .expect("fleet change seen");
    assert_eq!(serving, Some(1));
    let refused = client().get(format!("{decode}/health")).send().await;
    assert!(refused.is_err(), "decode pod still answering: {refused:?}");
    assert_eq!(
        client()
            .get(format!("{prefill}/health"))
            .send()
            .await
            .expect("prefill up")
            .status(),
        200
    );

    watch.abort();
    admin.stop().await;
    sim.shutdown().await;
    assert!(client()
        .get(format!("{prefill}/health"))
        .send()
        .await
        .is_err());
}

/// pd-load against simulated pods: straight to a combined pod, and the `--direct-prefill`
/// baseline (pd-load does the prefill leg, then the decode leg), streamed and not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_generator_against_pods() {
    let (p_port, d_port, c_port) = (free_port(), free_port(), free_port());
    let records = pd_control::fleet::parse_records(&fleet_yaml(&[
        pod_yaml(MODEL, "vllm-p-0", "vllm", "prefill", p_port),
        pod_yaml(MODEL, "vllm-d-0", "vllm", "decode", d_port),
        pod_yaml(MODEL, "vllm-c-0", "vllm", "combined", c_port),
    ]))
    .expect("fleet parses");
    let sim = Sim::new(SimConfig::default());
    assert_eq!(sim.apply(&records).await.serving, 3);

    let base = pd_sim::load::LoadConfig {
        model: MODEL.into(),
        rps: 0.0,
        requests: Some(8),
        clients: 2,
        prompt_tokens: (32, 64),
        max_tokens: 3,
        routing_strategy: String::new(),
        ..pd_sim::load::LoadConfig::default()
    };
    let combined = pd_sim::load::LoadConfig {
        url: format!("http://127.0.0.1:{c_port}"),
        ..base.clone()
    };
    let report = pd_sim::load::run(combined).await.expect("run");
    let s = &report.summary;
    assert_eq!((s.requests, s.ok, s.errors), (8, 8, 0), "{:?}", s.errors_by);
    assert!(report
        .results
        .iter()
        .all(|r| r.tokens == 3 && r.ttft_ms.is_some()));
    assert!(report.results.iter().any(|r| r.stream) && report.results.iter().any(|r| !r.stream));
    // Every gap between token reads of the streams is in the run's histogram: at least each
    // stream's longest, at most one per token after the first, the largest of them exactly.
    let streams: Vec<_> = report.results.iter().filter(|r| r.stream).collect();
    let longest = streams.iter().filter_map(|r| r.max_gap_ms);
    let (with_gap, top) = longest.fold((0u64, 0f64), |(n, m), g| (n + 1, m.max(g)));
    assert!(with_gap > 0, "2 ms a token: streams have gaps");
    let chunks = s.chunk_gap_ms.as_ref().expect("chunk gaps");
    let upper: u64 = streams.iter().map(|r| r.tokens - 1).sum();
    assert!(
        (with_gap..=upper).contains(&chunks.count),
        "{chunks:?}, {with_gap} streams with a gap, {upper} gaps at most"
    );
    assert_eq!(chunks.max, top);
    assert_eq!(s.pods.len(), 1);
    assert_eq!(
        (s.pods[0].role.as_str(), s.pods[0].requests),
        ("unrouted", 8)
    );

    let direct = pd_sim::load::LoadConfig {
        url: format!("http://127.0.0.1:{d_port}"),
        direct_prefill: Some(format!("http://127.0.0.1:{p_port}")),
        rps: 200.0,
        requests: Some(6),
        ..base
    };
    let report = pd_sim::load::run(direct).await.expect("run");
    assert_eq!(report.summary.ok, 6, "{:?}", report.summary.errors_by);
    assert!(report.results.iter().all(|r| r.prefill_ms.is_some()));
    let decode_log: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|e| e.pod == "vllm-d-0")
        .collect();
    assert_eq!(decode_log.len(), 6);
    assert!(decode_log
        .iter()
        .all(|e| e.kv_pull.as_deref() == Some("ok") && e.leg.as_deref() == Some("decode")));
    sim.shutdown().await;
}

/// An interleaved run deals the arrivals over its targets, each round in a new order, and
/// sends every target the same requests: two combined pods as the two "routers".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_run_deals_the_same_requests_to_every_target() {
    let (a_port, b_port) = (free_port(), free_port());
    let records = pd_control::fleet::parse_records(&fleet_yaml(&[
        pod_yaml(MODEL, "vllm-a-0", "vllm", "combined", a_port),
        pod_yaml(MODEL, "vllm-b-0", "vllm", "combined", b_port),
    ]))
    .expect("fleet parses");
    let sim = Sim::new(SimConfig::default());
    assert_eq!(sim.apply(&records).await.serving, 2);
    let cfg = pd_sim::load::LoadConfig {
        model: MODEL.into(),
        rps: 500.0,
        arrival: pd_sim::load::Arrival::Fixed,
        concurrency_limit: 1,
        requests: Some(20),
        prompt_tokens: (16, 400),
        max_tokens: 2,
        stream_ratio: 0.5,
        routing_strategy: String::new(),
        // The engines run in this process: the side processes are this one.
        side_pids: vec![std::process::id()],
        ..pd_sim::load::LoadConfig::default()
    };
    let targets = [
        pd_sim::interleave::Target::parse(&format!("a=http://127.0.0.1:{a_port}")).unwrap(),
        pd_sim::interleave::Target::parse(&format!("b=http://127.0.0.1:{b_port}")).unwrap(),
    ];
    let reports = pd_sim::interleave::run(cfg, &targets).await.expect("run");
    assert_eq!(
        reports.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        ["a", "b"]
    );
    let (a, b) = (&reports[0].1, &reports[1].1);
    for r in [a, b] {
        assert_eq!(
            (r.summary.requests, r.summary.ok),
            (10, 10),
            "{:?}",
            r.summary.errors_by
        );
        assert!((r.config.rps - 250.0).abs() < 1e-9);
        // No CPU figure per target (each idles while the other is served), but the box's
        // check covers the whole run, the same for both.
        assert!(r.cpu.is_none());
        let share = r.others.as_ref().map(|o| o.share);
        assert!(share.is_some_and(|s| (0.0..=1.0).contains(&s)), "{share:?}");
    }
    assert_eq!(a.others, b.others);
    // Round n sent one request, the same to both: same prompt size and stream flag.
    let shape = |r: &pd_sim::load::RunReport| -> Vec<(u64, u64, bool)> {
        r.results
            .iter()
            .map(|x| (x.seq, x.prompt_tokens, x.stream))
            .collect()
    };
    assert_eq!(shape(a), shape(b));
    assert!(
        shape(a).windows(2).any(|w| w[0].1 != w[1].1),
        "rounds differ"
    );
    // Each pod served exactly its target's requests.
    let log = sim.requests();
    for pod in ["vllm-a-0", "vllm-b-0"] {
        assert_eq!(log.iter().filter(|e| e.pod == pod).count(), 10, "{pod}");
    }
    sim.shutdown().await;
}

/// Serves `pods` (fleet YAML documents) from a fleet file named after `tag`; the file lives as
/// long as the returned guard.
async fn serve_pods(tag: &str, pods: &[String]) -> (std::sync::Arc<Sim>, usize, TempFile) {
    let path = std::env::temp_dir().join(format!(
        "pd-sim-{tag}-{}-{}.yaml",
        std::process::id(),
        free_port()
    ));
    let file = TempFile(path.clone());
    std::fs::write(&path, fleet_yaml(pods)).expect("write fleet");
    let watcher = FleetWatcher::load(path, Duration::from_millis(20)).expect("fleet parses");
    let sim = Sim::new(SimConfig::default());
    let report = sim.apply(watcher.records()).await;
    assert!(report.failed.is_empty(), "{report:?}");
    (sim, report.serving, file)
}

/// vLLM's Anthropic endpoint as a PD pair: the prefill leg answers a Messages body with
/// `kv_transfer_params` at the top level, the decode leg pulls with them and streams named
/// events ending in `message_stop`, its usage in `message_delta`; SGLang pods have no
/// `/v1/messages` (their handler drops the bootstrap fields).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_prefill_then_decode_over_http() {
    let (p_port, d_port, s_port) = (free_port(), free_port(), free_port());
    let pods = [
        pod_yaml(MODEL, "vllm-p-0", "vllm", "prefill", p_port),
        pod_yaml(MODEL, "vllm-d-0", "vllm", "decode", d_port),
        pod_yaml(MODEL, "sglang-p-0", "sglang", "prefill", s_port),
    ];
    let (_sim, serving, _fleet) = serve_pods("messages", &pods).await;
    assert_eq!(serving, 3);
    let prefill = format!("http://127.0.0.1:{p_port}/v1/messages");
    let decode = format!("http://127.0.0.1:{d_port}/v1/messages");

    let client_body = json!({"model": MODEL, "system": "s".repeat(40), "max_tokens": 3,
        "stream": true, "messages": [{"role": "user", "content": "x".repeat(360)}]});
    let mut prefill_body = client_body.clone();
    prefill_body["max_tokens"] = json!(1);
    prefill_body["stream"] = json!(false);
    prefill_body["kv_transfer_params"] =
        json!({"do_remote_decode": true, "do_remote_prefill": false});
    let resp = post(&prefill, &prefill_body, Some("m1")).await;
    assert_eq!(resp.status(), 200);
    let p: Value = serde_json::from_str(&resp.text().await.expect("body")).expect("JSON");
    assert_eq!(
        (p["type"].as_str(), p["id"].as_str()),
        (Some("message"), Some("chatcmpl-m1"))
    );
    assert_eq!(p["content"][0]["text"], " tok0");
    assert_eq!(p["stop_reason"], "max_tokens");
    // The system prompt counts: (40 + 1 + 360) / 4, rounded up.
    assert_eq!(
        (
            p["usage"]["input_tokens"].as_u64(),
            p["usage"]["output_tokens"].as_u64()
        ),
        (Some(101), Some(1))
    );
    let mut kv = p["kv_transfer_params"].clone();
    assert_eq!(kv["do_remote_prefill"], true);
    kv["remote_host"] = json!("127.0.0.1");

    // Without the params a decode pod refuses the body, in Anthropic's error shape.
    let resp = post(&decode, &client_body, Some("m1")).await;
    assert_eq!(resp.status(), 400);
    let e: Value = serde_json::from_str(&resp.text().await.expect("body")).expect("JSON");
    assert_eq!(e["type"], "error");
    assert!(e["error"]["message"].is_string(), "{e}");

    let mut decode_body = client_body.clone();
    decode_body["kv_transfer_params"] = kv;
    let resp = post(&decode, &decode_body, Some("m1")).await;
    assert_eq!(resp.status(), 200);
    let sse = resp.text().await.expect("stream");
    let events = pd_sim::vllm::named_events(&sse).expect("named events");
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{sse}");
    assert_eq!(names.last(), Some(&"message_stop"), "{sse}");
    let text: String = events
        .iter()
        .filter_map(|(_, e)| e["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, " tok0 tok1 tok2");
    let delta = events
        .iter()
        .find(|(n, _)| n == "message_delta")
        .expect("message_delta");
    assert_eq!(delta.1["usage"]["output_tokens"], 3);
    let log = get_json(&format!("http://127.0.0.1:{d_port}/sim/requests")).await;
    let legs: Vec<&str> = log
        .as_array()
        .expect("log")
        .iter()
        .filter_map(|e| e["leg"].as_str())
        .collect();
    assert_eq!(
        legs,
        ["decode"],
        "the refused body is logged without a leg: {log}"
    );

    // The token count of the same body, from the decode pod: nothing computed, any role.
    let resp = post(
        &format!("http://127.0.0.1:{d_port}/v1/messages/count_tokens"),
        &client_body,
        None,
    )
    .await;
    assert_eq!(resp.status(), 200);
    let n: Value = serde_json::from_str(&resp.text().await.expect("body")).expect("JSON");
    assert_eq!(n, json!({"input_tokens": 101}));

    let resp = post(
        &format!("http://127.0.0.1:{s_port}/v1/messages"),
        &prefill_body,
        None,
    )
    .await;
    assert_eq!(resp.status(), 404);
}

/// vLLM's Responses API on a pod: whole answers (streamed as numbered events ending with
/// `response.completed`) and, even for a prefill leg, no `kv_transfer_params` in the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_answer_without_kv_transfer_params() {
    let (c_port, p_port) = (free_port(), free_port());
    let pods = [
        pod_yaml(MODEL, "vllm-c-0", "vllm", "all", c_port),
        pod_yaml(MODEL, "vllm-p-0", "vllm", "prefill", p_port),
    ];
    let (_sim, serving, _fleet) = serve_pods("responses", &pods).await;
    assert_eq!(serving, 2);
    let url = |port| format!("http://127.0.0.1:{port}/v1/responses");

    let body = json!({"model": MODEL, "input": "y".repeat(40), "max_output_tokens": 3});
    let resp = post(&url(c_port), &body, Some("q1")).await;
    assert_eq!(resp.status(), 200);
    let r: Value = serde_json::from_str(&resp.text().await.expect("body")).expect("JSON");
    assert_eq!(
        (r["object"].as_str(), r["id"].as_str()),
        (Some("response"), Some("resp_q1"))
    );
    assert_eq!(r["output"][0]["content"][0]["text"], " tok0 tok1 tok2");
    assert_eq!(
        (
            r["usage"]["input_tokens"].as_u64(),
            r["usage"]["output_tokens"].as_u64()
        ),
        (Some(10), Some(3))
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let sse = post(&url(c_port), &streamed, None)
        .await
        .text()
        .await
        .expect("stream");
    let last = sse
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .last()
        .expect("events");
    assert!(last.starts_with("event: response.completed\n"), "{sse}");
    let deltas = sse.matches("event: response.output_text.delta\n").count();
    assert_eq!(deltas, 3, "{sse}");

    let mut prefill = body.clone();
    prefill["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false});
    let resp = post(&url(p_port), &prefill, None).await;
    assert_eq!(resp.status(), 200);
    let r: Value = serde_json::from_str(&resp.text().await.expect("body")).expect("JSON");
    assert!(r.get("kv_transfer_params").is_none(), "{r}");
    let log = get_json(&format!("http://127.0.0.1:{p_port}/sim/requests")).await;
    assert_eq!(log[0]["leg"], "prefill", "{log}");
}
