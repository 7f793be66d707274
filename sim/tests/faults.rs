//! Fault injection over real sockets: every fault kind armed through `/sim/faults`, what a
//! client then sees, and that clearing the faults puts the pod back to normal service.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

const MODEL: &str = "fault-model";

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

/// One combined (`full`-leg) pod: its simulator, its URL, the admin endpoint, and what
/// keeps them serving.
async fn one_pod() -> (
    std::sync::Arc<pd_sim::sim::Sim>,
    String,
    String,
    common::CombinedPod,
) {
    let pod = common::combined_pod(MODEL).await;
    (pod.sim.clone(), pod.url(), pod.admin.clone(), pod)
}

async fn arm(admin: &str, spec: Value) -> reqwest::StatusCode {
    client()
        .post(format!("{admin}/sim/faults"))
        .body(spec.to_string())
        .send()
        .await
        .expect("arm")
        .status()
}

async fn clear(admin: &str) {
    let status = client()
        .delete(format!("{admin}/sim/faults"))
        .send()
        .await
        .expect("clear")
        .status();
    assert_eq!(status, 204);
}

async fn json_of(resp: reqwest::Response) -> Value {
    serde_json::from_str(&resp.text().await.expect("body")).expect("JSON")
}

fn completion(stream: bool) -> Value {
    json!({"model": MODEL, "prompt": "hello there", "max_tokens": 4, "stream": stream})
}

async fn send(pod: &str, stream: bool) -> reqwest::Result<reqwest::Response> {
    client()
        .post(format!("{pod}/v1/completions"))
        .header("content-type", "application/json")
        .body(completion(stream).to_string())
        .send()
        .await
}

/// Polls the admin request log until `n` requests have arrived.
async fn wait_logged(admin: &str, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let log = client()
            .get(format!("{admin}/sim/requests"))
            .send()
            .await
            .expect("log");
        let log: Vec<Value> = serde_json::from_value(json_of(log).await).expect("list");
        if log.len() >= n {
            return log;
        }
        assert!(
            Instant::now() < deadline,
            "only {} requests logged",
            log.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_before_headers_holds_until_cleared_then_serves() {
    let (_sim, pod, admin, _h) = one_pod().await;
    assert_eq!(
        arm(
            &admin,
            json!({"pod": "pod-a", "kind": "hang_before_headers"})
        )
        .await,
        204
    );
    let pending = tokio::spawn({
        let pod = pod.clone();
        async move { send(&pod, false).await }
    });
    let log = wait_logged(&admin, 1).await;
    assert_eq!(log[0]["fault"], "hang_before_headers");
    assert!(!pending.is_finished(), "the request must still hang");
    clear(&admin).await;
    let resp = pending.await.expect("task").expect("response");
    assert_eq!(resp.status(), 200);
    let body: Value = json_of(resp).await;
    assert_eq!(body["usage"]["completion_tokens"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_fault_answers_an_openai_error_for_its_leg_and_count_only() {
    let (_sim, pod, admin, _h) = one_pod().await;
    // A fault for another leg never fires on this combined pod.
    assert_eq!(
        arm(
            &admin,
            json!({"pod": "pod-a", "kind": "status", "status": 503, "leg": "decode"})
        )
        .await,
        204
    );
    assert_eq!(send(&pod, false).await.expect("sent").status(), 200);
    assert_eq!(
        arm(
            &admin,
            json!({"pod": "pod-a", "kind": "status", "status": 503, "times": 1})
        )
        .await,
        204
    );
    let resp = send(&pod, false).await.expect("sent");
    assert_eq!(resp.status(), 503);
    let body: Value = json_of(resp).await;
    assert_eq!(body["error"]["code"], 503);
    assert!(body["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("injected")));
    assert_eq!(
        send(&pod, false).await.expect("sent").status(),
        200,
        "times: 1 disarms after one request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_stalls_after_n_chunks_and_resumes_when_cleared() {
    let (_sim, pod, admin, _h) = one_pod().await;
    assert_eq!(
        arm(
            &admin,
            json!({"pod": "pod-a", "kind": "hang_after_chunks", "chunks": 2})
        )
        .await,
        204
    );
    let mut resp = send(&pod, true).await.expect("headers arrive");
    assert_eq!(resp.status(), 200);
    let mut seen = String::new();
    while seen.matches("data: ").count() < 2 {
        let chunk = resp.chunk().await.expect("chunk").expect("not ended");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    // The stream is stalled now: no third event arrives until the fault is cleared, which
    // the next read proves by completing only after `clear`.
    let rest = tokio::spawn(async move {
        let mut rest = String::new();
        while let Ok(Some(chunk)) = resp.chunk().await {
            rest.push_str(&String::from_utf8_lossy(&chunk));
        }
        rest
    });
    assert!(!rest.is_finished());
    clear(&admin).await;
    let rest = rest.await.expect("task");
    assert_eq!(seen.matches("data: ").count(), 2, "{seen}");
    assert!(rest.contains("[DONE]"), "{rest}");
    assert_eq!((seen + &rest).matches(" tok").count(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_refuses_connections_and_drops_open_ones_until_cleared() {
    let (sim, pod, admin, _h) = one_pod().await;
    assert_eq!(
        arm(
            &admin,
            json!({"pod": "pod-a", "kind": "hang_after_chunks", "chunks": 1})
        )
        .await,
        204
    );
    let mut open = send(&pod, true).await.expect("headers");
    let first = open.chunk().await.expect("chunk");
    assert!(first.is_some());
    assert_eq!(
        arm(&admin, json!({"pod": "pod-a", "kind": "crash"})).await,
        204
    );
    // The open stream is cut, not finished.
    let mut ended_cleanly = false;
    loop {
        match open.chunk().await {
            Ok(Some(c)) if String::from_utf8_lossy(&c).contains("[DONE]") => ended_cleanly = true,
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    assert!(!ended_cleanly, "a crash must not finish the stream");
    let err = send(&pod, false).await.expect_err("refused while crashed");
    assert!(err.is_connect(), "{err}");
    let listed = client()
        .get(format!("{admin}/sim/faults"))
        .send()
        .await
        .expect("list");
    let listed: Vec<Value> = serde_json::from_value(json_of(listed).await).expect("list");
    assert!(listed
        .iter()
        .any(|f| f["kind"] == "crash" && f["pod"] == "default/pod-a"));
    clear(&admin).await;
    assert_eq!(send(&pod, false).await.expect("back").status(), 200);
    // The crashed stream's work was dropped with its connection: the pod is idle again.
    let state = sim
        .pod_state(pod.trim_start_matches("http://"))
        .expect("pod");
    assert_eq!(state.metrics().running, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuse_closes_the_port_but_lets_open_streams_finish() {
    let (_sim, pod, admin, _h) = one_pod().await;
    assert_eq!(
        arm(
            &admin,
            json!({"pod": "pod-a", "kind": "hang_after_chunks", "chunks": 1, "times": 1})
        )
        .await,
        204
    );
    let mut open = send(&pod, true).await.expect("headers");
    assert!(open.chunk().await.expect("chunk").is_some());
    assert_eq!(
        arm(&admin, json!({"pod": "pod-a", "kind": "refuse"})).await,
        204
    );
    let err = send(&pod, false).await.expect_err("refused");
    assert!(err.is_connect(), "{err}");
    clear(&admin).await;
    let mut rest = String::new();
    while let Some(chunk) = open.chunk().await.expect("open stream carries on") {
        rest.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(rest.contains("[DONE]"), "{rest}");
    assert_eq!(
        send(&pod, false).await.expect("listening again").status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_fault_specs_are_refused_with_a_reason() {
    let (_sim, pod, admin, _h) = one_pod().await;
    for (spec, status) in [
        (json!({"pod": "pod-a", "kind": "explode"}), 400),
        (json!({"kind": "crash"}), 400),
        (json!({"pod": "nobody", "kind": "crash"}), 404),
        (
            json!({"pod": "pod-a", "kind": "status", "status": 204}),
            400,
        ),
        (
            json!({"pod": "pod-a", "kind": "slow", "delay_ms": 1, "leg": "sideways"}),
            400,
        ),
    ] {
        assert_eq!(arm(&admin, spec.clone()).await, status, "{spec}");
    }
    // A pod's own endpoint takes request faults but not listener ones.
    let on_pod = client()
        .post(format!("{pod}/sim/faults"))
        .body(json!({"kind": "crash"}).to_string())
        .send()
        .await
        .expect("sent");
    assert_eq!(on_pod.status(), 400);
    let on_pod = client()
        .post(format!("{pod}/sim/faults"))
        .body(json!({"kind": "status", "status": 500, "times": 1}).to_string())
        .send()
        .await
        .expect("sent");
    assert_eq!(on_pod.status(), 204);
    assert_eq!(send(&pod, false).await.expect("sent").status(), 500);
}
