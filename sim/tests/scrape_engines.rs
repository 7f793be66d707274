//! One pod per engine (vLLM, SGLang, TRT-LLM) served in-process, loaded with finished, pinned
//! and in-flight requests, then scraped exactly as pd-control scrapes: its URL builder, HTTP
//! client and fetch-and-parse path, and its rate derivation. The readings must agree with the
//! simulator's own state of each pod. SGLang's pod is a standard (`unified`) one, as its
//! prefill worker serves only PD prefill legs; that worker is scraped with a prefill leg
//! waiting in its bootstrap queue.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_control::scrape::engine::{Engine, Reading};
use pd_control::scrape::fetch::{client as scrape_client, metrics_url, scrape};
use pd_control::scrape::rates::derive;
use pd_sim::engine::TimingModel;
use pd_sim::metrics::MetricsSnapshot;
use pd_sim::pod::{PodState, SimConfig};
use pd_sim::sim::{FleetWatcher, Sim};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

mod common;
use common::{fleet_yaml, free_port, pod_yaml, TempFile};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const ENGINES: [&str; 3] = ["vllm", "sglang", "trtllm"];

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

async fn post(base: &str, body: Value) -> reqwest::Response {
    http()
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request sent")
}

async fn get_json(url: &str) -> Value {
    let text = http()
        .get(url)
        .send()
        .await
        .expect("GET")
        .text()
        .await
        .expect("body");
    serde_json::from_str(&text).expect("JSON")
}

struct Pod {
    engine: Engine,
    label: &'static str,
    base: String,
    url: String,
    state: Arc<PodState>,
}

/// Scrapes through pd-control's own fetch path.
async fn read(pod: &Pod) -> Reading {
    let slots = Arc::new(Semaphore::new(4));
    let client = scrape_client(Duration::from_secs(2)).expect("scrape client");
    scrape(
        &client,
        &slots,
        &pod.url,
        pod.engine,
        MODEL,
        Duration::from_secs(2),
    )
    .await
    .unwrap_or_else(|e| panic!("pd-control failed to scrape the {} pod: {e}", pod.label))
}

/// A reading taken while the pod's state did not change, with that state.
async fn steady_read(pod: &Pod) -> (Reading, MetricsSnapshot) {
    for _ in 0..50 {
        let before = pod.state.metrics();
        let reading = read(pod).await;
        let after = pod.state.metrics();
        if before == after {
            return (reading, after);
        }
        tokio::time::sleep(Duration::from_millis(7)).await;
    }
    panic!("{} pod never held still for a scrape", pod.label);
}

fn close(a: Option<f64>, b: f64) -> bool {
    a.is_some_and(|a| (a - b).abs() < 1e-9)
}

/// What each engine's normalised reading should say about `m`.
fn assert_matches(pod: &Pod, r: &Reading, m: &MetricsSnapshot) {
    let who = pod.label;
    assert_eq!(r.running, Some(m.running as f64), "{who} running: {r:?}");
    let waiting = match pod.engine {
        // SGLang's waiting queue plus its prealloc queues (pd-control adds them, as AIBrix's
        // queue score does), without the decode legs waiting for their KV.
        Engine::Sglang => m.waiting - m.kv_transfer,
        Engine::Vllm | Engine::Trtllm => m.waiting,
    };
    assert_eq!(r.waiting, Some(waiting as f64), "{who} waiting: {r:?}");
    assert!(
        close(r.kv_cache_usage, m.kv_usage),
        "{who} KV usage {:?} vs {}",
        r.kv_cache_usage,
        m.kv_usage
    );
    // SGLang and TRT-LLM count a request's tokens when it ends; vLLM at every step.
    let (prompt, generated) = match pod.engine {
        Engine::Vllm => (m.prompt_tokens, m.generation_tokens),
        Engine::Sglang | Engine::Trtllm => (m.finished_prompt_tokens, m.finished_generation_tokens),
    };
    assert_eq!(r.prompt_tokens, Some(prompt as f64), "{who}");
    assert_eq!(r.generation_tokens, Some(generated as f64), "{who}");
    let completed = match pod.engine {
        // TRT-LLM's success counter has no aborted requests.
        Engine::Trtllm => m.success_stop + m.success_length,
        Engine::Vllm | Engine::Sglang => m.success_stop + m.success_length + m.success_abort,
    };
    assert_eq!(r.completed, Some(completed as f64), "{who} completed");
    let ttft = r.ttft.unwrap_or_else(|| panic!("{who} has no TTFT"));
    assert_eq!(ttft.count, m.ttft.count() as f64, "{who} TTFT count");
    assert!((ttft.sum - m.ttft.sum()).abs() < 1e-6, "{who} TTFT sum");
    let tpot = r.tpot.unwrap_or_else(|| panic!("{who} has no TPOT"));
    assert_eq!(tpot.count, m.inter_token.count() as f64, "{who} TPOT count");
    match pod.engine {
        Engine::Sglang => assert_eq!(r.generation_gauge, Some(m.gen_throughput), "{who}"),
        Engine::Vllm | Engine::Trtllm => assert_eq!(r.generation_gauge, None, "{who}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_control_reads_every_engines_exposition() {
    let ports: Vec<u16> = ENGINES.iter().map(|_| free_port()).collect();
    let sglang_prefill_port = free_port();
    let path = std::env::temp_dir().join(format!(
        "pd-sim-engines-{}-{}.yaml",
        std::process::id(),
        ports[0]
    ));
    let _cleanup = TempFile(path.clone());
    let pods: Vec<String> = ENGINES
        .iter()
        .zip(&ports)
        .map(|(engine, port)| {
            // SGLang's prefill worker refuses a request without a bootstrap room.
            let role = if *engine == "sglang" {
                "unified"
            } else {
                "prefill"
            };
            pod_yaml(MODEL, &format!("{engine}-0"), engine, role, *port)
        })
        .chain([pod_yaml(
            MODEL,
            "sglang-p-0",
            "sglang",
            "prefill",
            sglang_prefill_port,
        )])
        .collect();
    std::fs::write(&path, fleet_yaml(&pods)).expect("write fleet");
    let watcher = FleetWatcher::load(path.clone(), Duration::from_millis(50)).expect("fleet");

    // One batch slot and slow decode steps: a long request holds the pod busy and a second
    // one waits behind it, both for long enough to scrape.
    let sim = Sim::new(SimConfig {
        timing: TimingModel {
            prefill_base_ms: 1.0,
            prefill_us_per_token: 0.0,
            decode_ms_per_token: 150.0,
            batch_slowdown: 0.0,
            kv_pull_base_ms: 0.0,
            kv_pull_us_per_token: 0.0,
        },
        max_num_seqs: 1,
        kv_capacity_tokens: 10_000,
        ..SimConfig::default()
    });
    let report = sim.apply(watcher.records()).await;
    assert_eq!((report.serving, report.failed.len()), (4, 0), "{report:?}");

    let pods: Vec<Pod> = ENGINES
        .iter()
        .zip(&ports)
        .map(|(label, port)| {
            let engine = Engine::from_label(label);
            let addr = format!("127.0.0.1:{port}");
            Pod {
                engine,
                label,
                base: format!("http://{addr}"),
                url: metrics_url("127.0.0.1", *port, engine),
                state: sim.pod_state(&addr).expect("pod served"),
            }
        })
        .collect();
    assert_eq!(
        pods[2].url,
        format!("http://127.0.0.1:{}/prometheus/metrics", ports[2])
    );
    let sglang_prefill = {
        let addr = format!("127.0.0.1:{sglang_prefill_port}");
        Pod {
            engine: Engine::Sglang,
            label: "sglang prefill",
            base: format!("http://{addr}"),
            url: metrics_url("127.0.0.1", sglang_prefill_port, Engine::Sglang),
            state: sim.pod_state(&addr).expect("pod served"),
        }
    };

    // Idle: zero gauges, counters present.
    for pod in &pods {
        let (r, m) = steady_read(pod).await;
        assert_eq!(m.running + m.waiting + m.prompt_tokens, 0);
        assert_matches(pod, &r, &m);
    }
    let idle_stats = get_json(&format!("{}/metrics", pods[2].base)).await;
    assert_eq!(idle_stats, json!([]), "TRT-LLM iteration stats when idle");
    for pod in &pods[..2] {
        let status = http()
            .get(format!("{}/prometheus/metrics", pod.base))
            .send()
            .await
            .expect("GET")
            .status();
        assert_eq!(status, 404, "{} has no /prometheus/metrics", pod.label);
    }

    // Finished requests, and a prefill leg of each engine: vLLM's and TRT-LLM's keep their KV
    // pinned for a decode pod; SGLang's prefill worker does not even compute before a decode
    // worker registered for the room, which none does here.
    let mut pending_prefill = None;
    for pod in &pods {
        for i in 0..2 {
            let body = json!({"model": MODEL, "prompt": format!("{i} {}", "y".repeat(200)), "max_tokens": 2});
            assert_eq!(post(&pod.base, body).await.status(), 200);
        }
        // Each engine's own prefill leg.
        let prefill = json!({"model": MODEL, "prompt": "z".repeat(400), "max_tokens": 1});
        let mut prefill = prefill.as_object().cloned().unwrap_or_default();
        match pod.engine {
            Engine::Vllm => {
                prefill.insert(
                    "kv_transfer_params".into(),
                    json!({"do_remote_decode": true, "do_remote_prefill": false}),
                );
            }
            Engine::Sglang => {
                prefill.insert("bootstrap_host".into(), json!("127.0.0.1"));
                prefill.insert("bootstrap_port".into(), json!(8998));
                prefill.insert("bootstrap_room".into(), json!(77));
            }
            Engine::Trtllm => {
                prefill.insert("disaggregated_params".into(),
                    json!({"request_type": "context_only", "disagg_request_id": 4_398_046_511_105i64}));
            }
        }
        let body = Value::Object(prefill);
        if pod.engine == Engine::Sglang {
            let base = sglang_prefill.base.clone();
            pending_prefill = Some(tokio::spawn(
                async move { post(&base, body).await.status() },
            ));
        } else {
            assert_eq!(post(&pod.base, body).await.status(), 200);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while sglang_prefill.state.metrics().prefill_prealloc != 1 {
        assert!(
            Instant::now() < deadline,
            "the SGLang prefill leg never reached the bootstrap queue"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for pod in &pods {
        let (r, m) = steady_read(pod).await;
        assert_eq!((m.running, m.waiting), (0, 0));
        if pod.engine == Engine::Sglang {
            assert_eq!(m.success_length, 2, "{}", pod.label);
        } else {
            assert_eq!(m.success_length, 3, "{}", pod.label);
            assert!(m.kv_usage > 0.0, "the pinned prefill holds KV");
            assert_eq!(m.prefill_inflight, 1);
        }
        assert_matches(pod, &r, &m);
    }
    // The SGLang prefill leg waits in the bootstrap queue: waiting in pd-control's reading
    // (AIBrix's queue score counts the prealloc queues), not in `num_queue_reqs`, and it has
    // neither computed nor taken KV.
    let (r, m) = steady_read(&sglang_prefill).await;
    assert_eq!((m.running, m.waiting, m.prefill_prealloc), (0, 1, 1));
    assert_eq!(
        (m.prompt_tokens, m.kv_used_tokens, m.prefill_inflight),
        (0, 0, 0)
    );
    assert_eq!(r.waiting, Some(1.0), "{r:?}");
    assert_matches(&sglang_prefill, &r, &m);
    let text = http()
        .get(&sglang_prefill.url)
        .send()
        .await
        .expect("GET")
        .text()
        .await
        .expect("body");
    let sched = format!(
        r#"{{engine_type="prefill",model_name="{MODEL}",moe_ep_rank="0",pp_rank="0",tp_rank="0"}}"#
    );
    for line in [
        format!("sglang:num_prefill_prealloc_queue_reqs{sched} 1.0"),
        format!("sglang:num_queue_reqs{sched} 0.0"),
        format!("sglang:num_prefill_inflight_queue_reqs{sched} 0.0"),
    ] {
        assert!(text.lines().any(|l| l == line), "{line}\n{text}");
    }

    // In flight: one running request per pod and one waiting behind it.
    let mut held = Vec::new();
    for pod in &pods {
        for i in 0..2 {
            let body = json!({"model": MODEL, "prompt": format!("hold {i}"), "max_tokens": 1000, "stream": true});
            held.push(post(&pod.base, body).await);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for pod in &pods {
        while (pod.state.metrics().running, pod.state.metrics().waiting) != (1, 1) {
            assert!(Instant::now() < deadline, "{} never got busy", pod.label);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let mut first = Vec::new();
    for pod in &pods {
        let (r, m) = steady_read(pod).await;
        assert_eq!((m.running, m.waiting), (1, 1), "{}", pod.label);
        assert_matches(pod, &r, &m);
        first.push(r);
    }
    let busy_stats = get_json(&format!("{}/metrics", pods[2].base)).await;
    let rec = &busy_stats[0];
    assert_eq!(rec["numActiveRequests"], 1, "{busy_stats}");
    assert_eq!(rec["numQueuedRequests"], 1, "{busy_stats}");
    assert!(rec["kvCacheStats"]["usedNumBlocks"].as_u64() > Some(0));

    // Tokens keep coming: vLLM's counter shows them at once, SGLang's gauge measures them,
    // and SGLang's and TRT-LLM's counters wait for the requests to end.
    // Not synchronisation: a rate needs time to pass between two scrapes.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let elapsed = Duration::from_millis(1200);
    for (pod, before) in pods.iter().zip(&first) {
        let (r, m) = steady_read(pod).await;
        assert_matches(pod, &r, &m);
        let gained = r.generation_tokens.unwrap_or(0.0) - before.generation_tokens.unwrap_or(0.0);
        if pod.engine == Engine::Vllm {
            assert!(gained > 0.0, "{} generated nothing", pod.label);
        } else {
            assert_eq!(
                gained, 0.0,
                "{} counts tokens when a request ends",
                pod.label
            );
        }
        let derived = derive(pod.engine, &r, Some((before, elapsed)), None);
        assert_eq!(derived.running, 1.0);
        assert_eq!(derived.waiting, 1.0);
        assert!((derived.kv_cache_usage - m.kv_usage).abs() < 1e-9);
        let expected = match pod.engine {
            Engine::Sglang => m.gen_throughput,
            Engine::Vllm | Engine::Trtllm => gained / elapsed.as_secs_f64(),
        };
        assert!(
            expected > 0.0 || pod.engine == Engine::Trtllm,
            "{} throughput",
            pod.label
        );
        assert!(
            (derived.generation_throughput - expected).abs() < 1e-9,
            "{}: {} vs {expected}",
            pod.label,
            derived.generation_throughput
        );
    }

    drop(held);
    let deadline = Instant::now() + Duration::from_secs(5);
    for pod in &pods {
        while pod.state.metrics().running + pod.state.metrics().waiting > 0 {
            assert!(Instant::now() < deadline, "{} kept its requests", pod.label);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (r, m) = steady_read(pod).await;
        assert_eq!(
            (r.running, m.success_abort),
            (Some(0.0), 2),
            "{}",
            pod.label
        );
        assert_matches(pod, &r, &m);
    }
    if let Some(task) = pending_prefill {
        assert!(
            !task.is_finished(),
            "the SGLang prefill waits for its decode worker"
        );
        task.abort();
        // The client hung up: the leg leaves the bootstrap queue as an abort.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let m = sglang_prefill.state.metrics();
            if (m.waiting, m.prefill_prealloc, m.success_abort) == (0, 0, 1) {
                break;
            }
            assert!(Instant::now() < deadline, "the leg stayed queued: {m:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    sim.shutdown().await;
}
