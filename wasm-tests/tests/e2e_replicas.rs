//! Two gateway replicas (two Envoy processes, `--concurrency 2` each) in front of one
//! pd-control and the same pods: with the shared ledger, decode load routed by one gateway
//! steers the other; with `AIBRIX_TOKEN_LOAD_SHARED_LEDGER=false` each scores only its own
//! decode tokens, while the running counts still travel.
//!
//! Decode legs are held at the pods (pd-sim faults) so every charge stays in place while the
//! test looks; nothing depends on timing.

use std::time::Duration;

use pd_wasm_tests::http;
use pd_wasm_tests::stack::{admin_stat, eventually, Fleet, Gateway, Stack};
use serde_json::json;

const MODEL: &str = "replica-llm";

fn fleet() -> Fleet {
    Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0")
        .pod("p1", "prefill", "g1")
        .pod("d1", "decode", "g1")
}

fn env(shared: &str) -> Vec<(&'static str, String)> {
    vec![
        // Prefill legs finish (their counts go back to zero); the decode score decides.
        ("AIBRIX_PREFILL_SCORE_POLICY", "least_request".to_string()),
        ("AIBRIX_DECODE_SCORE_POLICY", "token_load".to_string()),
        ("AIBRIX_TOKEN_LOAD_SHARED_LEDGER", shared.to_string()),
    ]
}

fn send(gateway: &str, prompt: String) -> std::thread::JoinHandle<http::Response> {
    let gateway = gateway.to_string();
    std::thread::spawn(move || {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
        http::post_json(
            &gateway,
            "/v1/completions",
            &[("routing-strategy", "pd")],
            &body,
        )
    })
}

/// The decode pod a prompt's decode leg reached (waiting for it to arrive).
fn decode_pod_of(stack: &Stack, prompt: &str, legs_so_far: usize) -> String {
    let legs = stack.wait_for_legs("decode", legs_so_far);
    legs.iter()
        .find(|e| e["body"]["prompt"] == prompt)
        .and_then(|e| e["pod"].as_str())
        .unwrap_or_else(|| panic!("no decode leg carried {prompt:.20}"))
        .to_string()
}

/// Gateway A (the stack's) and gateway B on one pd-control, both with `env(shared)`.
fn two_gateways(shared: &str) -> (Stack, Gateway) {
    let env_a = env(shared);
    let env_a: Vec<(&str, &str)> = env_a.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let fleet = fleet();
    let mut stack = Stack::start_full(fleet.clone(), fleet, 2, &env_a, &[]);
    let b = stack.add_gateway(&env_a);
    (stack, b)
}

/// Routes one long prompt through gateway A and five short ones through gateway B, one at a
/// time, with every decode leg held; returns A's decode pod and B's five.
fn run(shared: &str) -> (String, Vec<String>, Stack, Gateway) {
    let (stack, b) = two_gateways(shared);
    let (a_pod, b_pods) = steer(&stack, &b, shared == "true");
    (a_pod, b_pods, stack, b)
}

fn steer(stack: &Stack, b: &Gateway, shared: bool) -> (String, Vec<String>) {
    for pod in ["d0", "d1"] {
        stack.arm_fault(json!({"pod": pod, "kind": "hang_before_headers", "leg": "decode"}));
    }
    let mut clients = Vec::new();
    let long = "long context ".repeat(2000); // ≈ 6500 prompt tokens on its decode pod
    clients.push(send(&stack.gateway, long.clone()));
    let a_pod = decode_pod_of(stack, &long, 1);

    // B learns A's load through pd-control: wait until its VMs see it. The running count
    // travels whatever the flag says (every other policy reads it); the decode tokens only
    // with the shared ledger.
    eventually(Duration::from_secs(20), || {
        let tokens = b.stat("pd_router_remote_decode_tokens");
        let running = b.stat("pd_router_remote_running_requests");
        (running >= 1 && (!shared || tokens >= 5000))
            .then_some(())
            .ok_or_else(|| {
                format!("gateway B sees {running} running and {tokens} decode tokens of A's")
            })
    });
    let mut b_pods = Vec::new();
    for i in 0..5 {
        let short = format!("short question {i} ").repeat(4);
        clients.push(send(&b.gateway, short.clone()));
        b_pods.push(decode_pod_of(stack, &short, 2 + i));
    }
    stack.clear_faults();
    for c in clients {
        let r = c.join().expect("client");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    (a_pod, b_pods)
}

#[test]
fn a_shared_ledger_steers_one_gateway_by_the_others_decode_load() {
    let (a_pod, b_pods, stack, b) = run("true");
    // A's ~6500-token decode outweighs B's five short prompts: B sends all of them elsewhere.
    assert!(
        b_pods.iter().all(|p| *p != a_pod),
        "gateway B ignored A's load on {a_pod}: {b_pods:?}"
    );
    assert!(b.stat("pd_router_remote_replicas") >= 1);
    stack.wait_ledger_zero();
    b.wait_ledger_zero();
}

#[test]
fn without_the_shared_ledger_each_gateway_scores_only_its_own() {
    let (a_pod, b_pods, stack, b) = run("false");
    // B sees two idle decode pods and alternates between them, A's charge notwithstanding.
    assert!(
        b_pods.contains(&a_pod),
        "gateway B avoided {a_pod} without knowing about it: {b_pods:?}"
    );
    assert_eq!(b.filter_stat("pd_router_remote_decode_tokens"), Some(0));
    stack.wait_ledger_zero();
    b.wait_ledger_zero();
}

#[test]
fn a_killed_gateways_share_expires_and_the_survivor_scores_its_own_load() {
    let (mut stack, b) = two_gateways("true");
    for pod in ["d0", "d1"] {
        stack.arm_fault(json!({"pod": pod, "kind": "hang_before_headers", "leg": "decode"}));
    }
    let long = "long context ".repeat(2000);
    let client = send(&stack.gateway, long.clone());
    decode_pod_of(&stack, &long, 1);
    let wait_for = |what: &str, ok: &dyn Fn(u64) -> bool| {
        eventually(Duration::from_secs(30), || {
            b.filter_stat("pd_router_remote_decode_tokens")
                .is_some_and(ok)
                .then_some(())
                .ok_or(format!("waiting for {what}"))
        })
    };
    wait_for("B to see A's charge", &|t| t >= 5000);
    // Gateway A dies with its charge outstanding; pd-control drops it after the replica TTL.
    stack.kill("envoy");
    wait_for("A's share to expire", &|t| t == 0);
    assert_eq!(b.filter_stat("pd_router_remote_replicas"), Some(0));
    stack.clear_faults();
    let _ = client.join(); // A's client lost its gateway; only B matters now.
}

#[test]
fn two_pd_controls_share_through_redis_one_gateway_each() {
    let dir = std::env::temp_dir().join(format!("pd-redis-{}", fastrand::u64(..)));
    std::fs::create_dir_all(&dir).expect("redis dir");
    // `None` only where redis-server cannot run and PD_TESTS_ALLOW_SKIP=1 allows a skip.
    let Some(redis) = pd_wasm_tests::redis::RedisServer::start(&dir) else {
        return;
    };
    let url = redis.url();
    let env_a = env("true");
    let env_a: Vec<(&str, &str)> = env_a.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut stack = Stack::start_with_control_args(fleet(), 2, &env_a, &["--redis", &url]);
    let second_control = stack.add_control(&["--redis", &url]);
    let b = stack.add_gateway_via(&second_control, &env_a);
    let (a_pod, b_pods) = steer(&stack, &b, true);
    assert!(
        b_pods.iter().all(|p| *p != a_pod),
        "gateway B (other pd-control) ignored A's load on {a_pod}: {b_pods:?}"
    );
    stack.wait_ledger_zero();
    b.wait_ledger_zero();
    drop(redis);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sum of a gateway's own `pd_token_load_decode_tokens` gauges.
/// A request reaching an idle gateway that has other replicas wakes all of its VMs, so the
/// one holding the snapshot lease reports the new load at the fast tick, not on its idle one.
#[test]
fn a_request_wakes_every_vm_of_an_idle_gateway_with_other_replicas() {
    let (stack, _b) = two_gateways("true");
    let vms = (stack.concurrency + 1) as u64;
    eventually(Duration::from_secs(30), || {
        let (replicas, idle) = (
            stack.stat("pd_router_remote_replicas"),
            stack.stat("pd_router_idle_vms"),
        );
        (replicas >= 1 && idle == vms).then_some(()).ok_or(format!(
            "A sees {replicas} other replicas, {idle} of {vms} VMs idle"
        ))
    });
    for pod in ["d0", "d1"] {
        stack.arm_fault(json!({"pod": pod, "kind": "hang_before_headers", "leg": "decode"}));
    }
    let prompt = "wake everyone ".repeat(8);
    let client = send(&stack.gateway, prompt.clone());
    decode_pod_of(&stack, &prompt, 1);
    // Held at the decode pod: the worker serving it is awake, and so is every other VM.
    eventually(Duration::from_secs(10), || {
        let idle = stack.filter_stat("pd_router_idle_vms");
        (idle == Some(0))
            .then_some(())
            .ok_or(format!("{idle:?} of {vms} VMs of gateway A still idle"))
    });
    stack.clear_faults();
    let r = client.join().expect("client");
    assert_eq!(r.status, 200, "{}", r.text());
    stack.wait_ledger_zero();
}

fn local_decode_total(admin: &str) -> u64 {
    http::get(admin, "/stats?filter=pd_token_load_decode_tokens")
        .expect("admin")
        .text()
        .lines()
        .filter_map(|l| l.rsplit_once(": "))
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .sum()
}

/// Per-decode-pod prompt tokens (chars / 4) of the decode legs pd-sim received, sorted.
fn decode_spread(stack: &Stack, n: usize) -> Vec<u64> {
    let mut per_pod = std::collections::BTreeMap::<String, u64>::new();
    for e in stack.wait_for_legs("decode", n) {
        let tokens = e["body"]["prompt"].as_str().map(str::len).unwrap_or(0) as u64 / 4;
        *per_pod
            .entry(e["pod"].as_str().unwrap_or_default().to_string())
            .or_default() += tokens;
    }
    let mut v: Vec<u64> = per_pod.into_values().collect();
    v.resize(2, 0);
    v.sort_unstable();
    v
}

const BURST: [usize; 10] = [1500, 200, 800, 50, 1200, 400, 900, 100, 600, 300];

/// Sends the burst (decode legs held) alternating over `gateways`; before each request the
/// gateway about to route has seen every charge the others made (their remote gauge equals
/// the others' own ledgers), so the comparison with one gateway is exact, not a race.
fn burst(stack: &Stack, gateways: &[(&str, &str)]) -> Vec<u64> {
    for pod in ["d0", "d1"] {
        stack.arm_fault(json!({"pod": pod, "kind": "hang_before_headers", "leg": "decode"}));
    }
    let mut clients = Vec::new();
    for (i, words) in BURST.iter().enumerate() {
        let (listener, admin) = gateways[i % gateways.len()];
        if gateways.len() > 1 {
            let others: u64 = gateways
                .iter()
                .filter(|(_, a)| *a != admin)
                .map(|(_, a)| local_decode_total(a))
                .sum();
            eventually(Duration::from_secs(20), || {
                (admin_stat(admin, "pd_router_remote_decode_tokens") == others)
                    .then_some(())
                    .ok_or(format!(
                        "gateway {admin} never saw the others' {others} decode tokens"
                    ))
            });
        }
        let prompt = format!("burst {i} ") + &"word ".repeat(*words);
        clients.push(send(listener, prompt.clone()));
        decode_pod_of(stack, &prompt, i + 1);
    }
    let spread = decode_spread(stack, BURST.len());
    stack.clear_faults();
    for c in clients {
        let r = c.join().expect("client");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    spread
}

#[test]
fn a_burst_split_over_two_gateways_spreads_like_one_gateway() {
    let env_a = env("true");
    let env_a: Vec<(&str, &str)> = env_a.iter().map(|(k, v)| (*k, v.as_str())).collect();

    let one = {
        let f = fleet();
        let stack = Stack::start_full(f.clone(), f, 2, &env_a, &[]);
        burst(&stack, &[(stack.gateway.as_str(), stack.admin.as_str())])
    };
    let split = {
        let f = fleet();
        let mut stack = Stack::start_full(f.clone(), f, 2, &env_a, &[]);
        let b = stack.add_gateway(&env_a);
        let spread = burst(
            &stack,
            &[
                (stack.gateway.as_str(), stack.admin.as_str()),
                (b.gateway.as_str(), b.admin.as_str()),
            ],
        );
        stack.wait_ledger_zero();
        b.wait_ledger_zero();
        spread
    };
    // Tolerance: 5 % of the burst's tokens per pod. Both runs make the same greedy choices
    // (ties aside, which the sort makes symmetric), so they normally agree exactly.
    let total: u64 = one.iter().sum();
    eprintln!("decode tokens per pod: one gateway {one:?}, two gateways {split:?}");
    for (o, s) in one.iter().zip(&split) {
        assert!(
            o.abs_diff(*s) * 20 <= total,
            "one gateway {one:?} vs two gateways {split:?}"
        );
    }
}

/// Two gateway processes left on the default `AIBRIX_TRT_MACHINE_ID` (every replica of a
/// Deployment gets one environment) are seen by pd-control, which both poll; a third on a
/// value of its own shares nothing.
#[test]
fn gateways_sharing_a_trt_machine_id_are_counted_by_pd_control() {
    let f = fleet();
    let mut stack = Stack::start_full(f.clone(), f, 2, &[], &[]);
    let _b = stack.add_gateway(&[]);
    // Loaded means each gateway has polled: pd-control has seen both.
    let shared = |stack: &Stack| stack.control_metric("pd_control_trt_machine_id_shared_gateways");
    assert_eq!(shared(&stack), 2.0, "A and B on machine id 0");
    let _c = stack.add_gateway(&[("AIBRIX_TRT_MACHINE_ID", "7")]);
    assert_eq!(shared(&stack), 2.0, "C's id is its own");

    // The same polls name each gateway's filter build, which each VM logs as it starts: all
    // three run this one.
    let log = stack.envoy_log();
    let build = log
        .lines()
        .find_map(|l| l.split("pd-router filter ").nth(1)?.split(' ').next())
        .expect("a VM logged its build")
        .to_string();
    let scrape = pd_wasm_tests::prom::Scrape::parse(
        &pd_wasm_tests::http::get(&stack.control, "/metrics")
            .expect("pd-control")
            .text(),
    );
    let builds: Vec<(String, f64)> = scrape
        .series("pd_control_gateway_builds", &[])
        .map(|s| (s.labels["build"].clone(), s.value))
        .collect();
    assert_eq!(builds, [(build, 3.0)], "every gateway on the one build");
}
