//! SGLang and TRT-LLM disaggregation over real sockets: a prefill and a decode pod per
//! engine served in-process, driven the way a PD router drives them.

use std::time::{Duration, Instant};

use pd_sim::pod::SimConfig;
use pd_sim::sim::{FleetWatcher, Sim};
use serde_json::{json, Value};

mod common;
use common::{fleet_yaml, free_port, pod_yaml, TempFile};

const MODEL: &str = "m";

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

async fn post(url: &str, body: &Value) -> (u16, String) {
    let r = client()
        .post(url)
        .header("content-type", "application/json")
        .header("x-request-id", "req-1")
        .body(body.to_string())
        .send()
        .await
        .expect("request sent");
    let status = r.status().as_u16();
    (status, r.text().await.expect("body"))
}

/// Serves one prefill and one decode pod of `engine`; returns their base URLs.
async fn serve(engine: &str, config: SimConfig) -> (std::sync::Arc<Sim>, String, String, TempFile) {
    let (p_port, d_port) = (free_port(), free_port());
    let path = std::env::temp_dir().join(format!(
        "pd-sim-engines-{}-{p_port}.yaml",
        std::process::id()
    ));
    let file = TempFile(path.clone());
    let pods = [
        pod_yaml(MODEL, &format!("{engine}-p-0"), engine, "prefill", p_port),
        pod_yaml(MODEL, &format!("{engine}-d-0"), engine, "decode", d_port),
    ];
    std::fs::write(&path, fleet_yaml(&pods)).expect("fleet");
    let watcher = FleetWatcher::load(path, Duration::from_millis(50)).expect("fleet parses");
    let sim = Sim::new(config);
    let report = sim.apply(watcher.records()).await;
    assert_eq!(report.serving, 2, "{report:?}");
    (
        sim,
        format!("http://127.0.0.1:{p_port}"),
        format!("http://127.0.0.1:{d_port}"),
        file,
    )
}

fn fast() -> SimConfig {
    SimConfig {
        transfer_timeout: Duration::from_secs(10),
        ..SimConfig::default()
    }
}

fn log_of(sim: &Sim, path: &str) -> Vec<Value> {
    sim.requests()
        .into_iter()
        .map(|e| serde_json::to_value(e).expect("entry"))
        .filter(|e| e["path"] == path)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_legs_meet_in_their_room_whichever_comes_first() {
    let (sim, prefill, decode, _f) = serve("sglang", fast()).await;
    let room = 9_223_372_036_854_775_000u64;
    let decode_body = json!({"model": MODEL, "prompt": "x".repeat(80), "max_tokens": 3,
        "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": room, "rid": "req-1-ab"});
    let mut prefill_body = decode_body.clone();
    prefill_body["max_tokens"] = json!(1);
    prefill_body["stream"] = json!(false);
    // Decode first: it waits for its room; then the prefill hands the KV over.
    let d = tokio::spawn({
        let url = format!("{decode}/v1/completions");
        async move { post(&url, &decode_body).await }
    });
    let (ps, pbody) = post(&format!("{prefill}/v1/completions"), &prefill_body).await;
    let (ds, dbody) = d.await.expect("join");
    assert_eq!(ps, 200, "{pbody}");
    assert_eq!(ds, 200, "{dbody}");
    let answer: Value = serde_json::from_str(&dbody).expect("JSON");
    assert_eq!(answer["choices"][0]["text"], " tok0 tok1 tok2");
    assert!(
        answer.get("kv_transfer_params").is_none(),
        "SGLang has no such field"
    );
    let legs: Vec<Value> = log_of(&sim, "/v1/completions");
    assert_eq!(legs.len(), 2);
    for leg in &legs {
        assert_eq!(leg["kv_pull"], "ok", "{leg}");
        assert_eq!(
            leg["pd"]["bootstrap_room"].as_u64(),
            Some(room),
            "exact 63-bit room"
        );
        assert_eq!(leg["pd"]["rid"], "req-1-ab");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_decode_without_its_prefill_fails_after_the_transfer_timeout() {
    let config = SimConfig {
        transfer_timeout: Duration::from_millis(300),
        ..SimConfig::default()
    };
    let (sim, _prefill, decode, _f) = serve("sglang", config).await;
    let body = json!({"model": MODEL, "prompt": "hello", "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 8998, "bootstrap_room": 5});
    let started = Instant::now();
    let (status, text) = post(&format!("{decode}/v1/completions"), &body).await;
    assert_eq!(status, 500, "{text}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    let err: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(err["object"], "error");
    assert!(err["message"]
        .as_str()
        .unwrap_or("")
        .starts_with("Decode transfer failed"));
    assert_eq!(log_of(&sim, "/v1/completions")[0]["kv_pull"], "timeout");

    // No bootstrap server at the host it was told: fails without waiting.
    let mut wrong = body.clone();
    wrong["bootstrap_host"] = json!("127.0.0.77");
    let (status, _) = post(&format!("{decode}/v1/completions"), &wrong).await;
    assert_eq!(status, 500);
    // Without a room the worker refuses the request outright.
    let (status, _) = post(
        &format!("{decode}/v1/completions"),
        &json!({"model": MODEL, "prompt": "hello"}),
    )
    .await;
    assert_eq!(status, 400);
}

/// The value of the SGLang scheduler gauge `name` on the pod at `base`.
async fn gauge(base: &str, name: &str) -> f64 {
    let text = client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("scrape")
        .text()
        .await
        .expect("body");
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// Polls until the pod at `base` reports `want` for each SGLang queue gauge.
async fn queues_settle(base: &str, want: &[(&str, f64)]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut got = Vec::new();
        for (name, _) in want {
            got.push(gauge(base, name).await);
        }
        if got.iter().zip(want).all(|(g, (_, w))| g == w) {
            return;
        }
        assert!(Instant::now() < deadline, "{base}: {got:?}, want {want:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_legs_wait_for_each_other_in_sglangs_pd_queues() {
    let (_sim, prefill, decode, _f) = serve("sglang", fast()).await;
    let body = |room: u64| {
        json!({"model": MODEL, "prompt": "q".repeat(80), "max_tokens": 2,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": room})
    };
    let spawn_post =
        |url: String, body: Value| tokio::spawn(async move { post(&url, &body).await });
    let (p_url, d_url) = (
        format!("{prefill}/v1/completions"),
        format!("{decode}/v1/completions"),
    );

    // Decode first: registered, it waits for its KV in the transfer queue, not the queue.
    let d = spawn_post(d_url.clone(), body(1));
    let decode_waits = [
        ("sglang:num_decode_transfer_queue_reqs", 1.0),
        ("sglang:num_decode_prealloc_queue_reqs", 0.0),
        ("sglang:num_queue_reqs", 0.0),
        ("sglang:num_running_reqs", 0.0),
    ];
    queues_settle(&decode, &decode_waits).await;
    let (ps, pbody) = post(&p_url, &body(1)).await;
    assert_eq!(ps, 200, "{pbody}");
    let (ds, dbody) = d.await.expect("join");
    assert_eq!(ds, 200, "{dbody}");

    // Prefill first: it waits for its decode leg in the bootstrap queue, uncomputed.
    let p = spawn_post(p_url, body(2));
    let prefill_waits = [
        ("sglang:num_prefill_prealloc_queue_reqs", 1.0),
        ("sglang:num_queue_reqs", 0.0),
        ("sglang:num_running_reqs", 0.0),
        ("sglang:num_prefill_inflight_queue_reqs", 0.0),
    ];
    queues_settle(&prefill, &prefill_waits).await;
    let (ds, dbody) = post(&d_url, &body(2)).await;
    assert_eq!(ds, 200, "{dbody}");
    let (ps, pbody) = p.await.expect("join");
    assert_eq!(ps, 200, "{pbody}");

    for (base, names) in [(&prefill, &prefill_waits[..]), (&decode, &decode_waits[..])] {
        let idle: Vec<(&str, f64)> = names.iter().map(|(n, _)| (*n, 0.0)).collect();
        queues_settle(base, &idle).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_prefill_alone_fails_its_bootstrap_without_computing() {
    let config = SimConfig {
        transfer_timeout: Duration::from_millis(300),
        ..SimConfig::default()
    };
    let (sim, prefill, _decode, _f) = serve("sglang", config).await;
    let body = json!({"model": MODEL, "prompt": "hello", "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 8998, "bootstrap_room": 8, "rid": "r-8"});
    let started = Instant::now();
    let (status, text) = post(&format!("{prefill}/v1/completions"), &body).await;
    assert_eq!(status, 500, "{text}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    let err: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(err["object"], "error");
    assert!(err["message"]
        .as_str()
        .unwrap_or("")
        .starts_with("Prefill bootstrap failed for request rid=r-8 bootstrap_room=8"));
    assert_eq!(log_of(&sim, "/v1/completions")[0]["kv_pull"], "timeout");
    assert_eq!(
        gauge(&prefill, "sglang:num_prefill_prealloc_queue_reqs").await,
        0.0
    );
    assert_eq!(
        gauge(&prefill, "sglang:num_used_tokens").await,
        0.0,
        "nothing computed, no KV held"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_prefill_worker_refuses_a_request_without_a_room() {
    let (sim, prefill, _decode, _f) = serve("sglang", fast()).await;
    for body in [
        json!({"model": MODEL, "prompt": "hello"}),
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": true,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}),
    ] {
        let path = if body.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let (status, text) = post(&format!("{prefill}{path}"), &body).await;
        assert_eq!(status, 400, "{text}");
        let err: Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(
            err,
            json!({"object": "error", "type": "BadRequestError", "param": null, "code": 400,
                "message": "Disaggregated request received without bootstrap room id"})
        );
    }
    let refused = log_of(&sim, "/v1/completions");
    assert_eq!(refused[0]["status"], 400);
    assert_eq!(
        refused[0]["leg"],
        Value::Null,
        "refused before classification"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_abort_request_ends_a_waiting_decode_and_is_logged() {
    let (sim, _prefill, decode, _f) = serve("sglang", fast()).await;
    let body = json!({"model": MODEL, "prompt": "hello", "stream": true, "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 8998, "bootstrap_room": 6, "rid": "rid-6"});
    let url = format!("{decode}/v1/completions");
    let stream = tokio::spawn(async move { post(&url, &body).await });
    // Wait until the decode leg is logged (waiting for its KV), then abort it.
    let deadline = Instant::now() + Duration::from_secs(5);
    while log_of(&sim, "/v1/completions").is_empty() {
        assert!(Instant::now() < deadline, "decode leg never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = client()
        .post(format!("{decode}/abort_request"))
        .body(json!({"rid": "rid-6"}).to_string())
        .send()
        .await
        .expect("abort");
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(
        r.text().await.expect("body"),
        "",
        "SGLang answers an empty body"
    );
    let (status, text) = stream.await.expect("join");
    assert_eq!(status, 200, "stream headers went out before the KV");
    assert!(text.contains("aborted"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    let aborts = log_of(&sim, "/abort_request");
    assert_eq!(aborts[0]["pd"], json!({"rid": "rid-6", "aborted": 1}));

    let info: Value = client()
        .get(format!("{decode}/get_server_info"))
        .send()
        .await
        .expect("info")
        .text()
        .await
        .map(|t| serde_json::from_str(&t).expect("JSON"))
        .expect("body");
    assert_eq!(info["disaggregation_mode"], "decode");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_context_first_hands_params_and_ids_to_generation() {
    let (sim, ctx, gen, _f) = serve("trtllm", fast()).await;
    let disagg_id: i64 = 4_611_686_018_427_387_905; // above 2^53: an f64 would change it
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "y".repeat(40)}],
        "max_tokens": 4});
    let mut ctx_body = chat.clone();
    ctx_body["max_tokens"] = json!(1);
    ctx_body["stream"] = json!(false);
    ctx_body["disaggregated_params"] =
        json!({"request_type": "context_only", "disagg_request_id": disagg_id});
    let (status, text) = post(&format!("{ctx}/v1/chat/completions"), &ctx_body).await;
    assert_eq!(status, 200, "{text}");
    let c: Value = serde_json::from_str(&text).expect("JSON");
    let params = c["choices"][0]["disaggregated_params"].clone();
    assert_eq!(params["request_type"], "context_only");
    assert_eq!(params["disagg_request_id"].as_i64(), Some(disagg_id));
    let ctx_id = params["ctx_request_id"].as_i64().expect("int64 ctx id");
    assert!(ctx_id > 1 << 53);
    assert_eq!(c["prompt_token_ids"].as_array().map(Vec::len), Some(10));

    // A generation leg whose ids went through f64 is refused.
    let mut lossy = chat.clone();
    let mut p = params.clone();
    p["request_type"] = json!("generation_only");
    p["ctx_request_id"] = json!(ctx_id as f64);
    lossy["disaggregated_params"] = p;
    let (status, _) = post(&format!("{gen}/v1/chat/completions"), &lossy).await;
    assert_eq!(status, 400);

    let mut gen_body = chat.clone();
    let mut p = params.clone();
    p["request_type"] = json!("generation_only");
    gen_body["disaggregated_params"] = p;
    gen_body["prompt_token_ids"] = c["prompt_token_ids"].clone();
    gen_body["stream"] = json!(true);
    let (status, text) = post(&format!("{gen}/v1/chat/completions"), &gen_body).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    let legs = log_of(&sim, "/v1/chat/completions");
    let gen_leg = legs
        .iter()
        .find(|e| e["leg"] == "decode" && e["status"] == 200)
        .expect("gen leg");
    assert_eq!(gen_leg["kv_pull"], "ok");
    // The KV was fetched once: the same params again find nothing.
    let (status, _) = post(&format!("{gen}/v1/chat/completions"), &gen_body).await;
    assert_eq!(status, 500);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_generation_first_legs_meet_at_the_ctx_endpoint() {
    let (sim, ctx, gen, _f) = serve("trtllm", fast()).await;
    let info: Value = client()
        .get(format!("{ctx}/server_info"))
        .send()
        .await
        .expect("info")
        .text()
        .await
        .map(|t| serde_json::from_str(&t).expect("JSON"))
        .expect("body");
    let endpoint = info["disaggregated_params"]["ctx_info_endpoint"][0]
        .as_str()
        .expect("endpoint")
        .to_string();
    let id: i64 = 4_398_046_511_105;
    let body = json!({"model": MODEL, "prompt": "z".repeat(20), "max_tokens": 2});
    let mut gen_body = body.clone();
    gen_body["disaggregated_params"] = json!({"request_type": "generation_only", "disagg_request_id": id,
        "ctx_request_id": id, "schedule_style": 1, "ctx_info_endpoint": endpoint, "ctx_dp_rank": 0});
    let mut ctx_body = body.clone();
    ctx_body["disaggregated_params"] =
        json!({"request_type": "context_only", "disagg_request_id": id, "schedule_style": 1});
    let g = tokio::spawn({
        let url = format!("{gen}/v1/completions");
        async move { post(&url, &gen_body).await }
    });
    let (cs, ctext) = post(&format!("{ctx}/v1/completions"), &ctx_body).await;
    let (gs, gtext) = g.await.expect("join");
    assert_eq!((cs, gs), (200, 200), "{ctext} {gtext}");
    let answer: Value = serde_json::from_str(&gtext).expect("JSON");
    assert_eq!(answer["choices"][0]["text"], " tok0 tok1");
    assert_eq!(log_of(&sim, "/server_info").len(), 1);
    for leg in log_of(&sim, "/v1/completions") {
        assert_eq!(leg["kv_pull"], "ok", "{leg}");
    }
}

/// `--side-channel-host pod`: the vLLM prefill names its own IP in `remote_host`, so a router
/// that copies `kv_transfer_params` verbatim (vllm-router) gets a real KV pull; by default
/// vLLM's `localhost` is answered and the decode pod, reached unchanged, recomputes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_side_channel_host_names_the_prefill_pod() {
    for (pod_ip, want_host, want_pull) in [
        (true, "127.0.0.1", "ok"),
        (false, "localhost", "host_mismatch"),
    ] {
        let config = SimConfig {
            side_channel_host_is_pod_ip: pod_ip,
            ..fast()
        };
        let (sim, prefill, decode, _f) = serve("vllm", config).await;
        let body = json!({"model": MODEL, "prompt": "one two three four", "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}});
        let (status, text) = post(&format!("{prefill}/v1/completions"), &body).await;
        assert_eq!(status, 200, "{text}");
        let kv = serde_json::from_str::<Value>(&text).expect("json")["kv_transfer_params"].clone();
        assert_eq!(kv["remote_host"], json!(want_host));
        let decode_body = json!({"model": MODEL, "prompt": "one two three four", "max_tokens": 2,
            "kv_transfer_params": kv});
        let (status, text) = post(&format!("{decode}/v1/completions"), &decode_body).await;
        assert_eq!(status, 200, "{text}");
        let pulls: Vec<Value> = log_of(&sim, "/v1/completions")
            .into_iter()
            .filter_map(|e| e.get("kv_pull").cloned())
            .filter(|p| !p.is_null())
            .collect();
        assert_eq!(pulls, vec![json!(want_pull)]);
    }
}
