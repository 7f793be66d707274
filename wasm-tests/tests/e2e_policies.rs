//! End-to-end: the selection policies under concurrent load, in real Envoy (`--concurrency 2`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pd_wasm_tests::http;
use pd_wasm_tests::stack::{Fleet, Stack};
use serde_json::json;

const MODEL: &str = "tok-model";

/// Ledger gauge samples from Envoy's Prometheus output: (metric, pod_name) → value.
fn ledger_gauges(stack: &Stack) -> BTreeMap<(String, String), f64> {
    let text = http::get(&stack.admin, "/stats/prometheus")
        .expect("admin")
        .text();
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("pd_token_load_")) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = series.split('{').next().unwrap_or_default().to_string();
        let pod = series
            .split("pod_name=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap_or_default()
            .to_string();
        assert!(
            series.contains("namespace=\"default\""),
            "namespace label missing: {series}"
        );
        out.insert((name, pod), value.parse().unwrap_or(f64::NAN));
    }
    out
}

#[test]
fn token_load_spreads_long_and_short_prompts_and_the_ledger_returns_to_zero() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0")
        .pod("p1", "prefill", "g1")
        .pod("d1", "decode", "g1");
    let env = [
        ("AIBRIX_PREFILL_SCORE_POLICY", "token_load"),
        ("AIBRIX_DECODE_SCORE_POLICY", "token_load"),
    ];
    // Every prefill leg takes at least 400 ms, so the whole burst is routed while all of it
    // is still in flight: each selection sees every earlier charge, and the assignment the
    // ledger makes is the assignment the pods get.
    let stack = Stack::start_full(
        fleet.clone(),
        fleet,
        2,
        &env,
        &["--prefill-base-ms", "400", "--prefill-concurrency", "0"],
    );

    // 6 long prompts (~6000 tokens) among 24 short ones, all in flight at once.
    let mut prompts: Vec<String> = (0..24)
        .map(|i| format!("short prompt {i} ").repeat(10))
        .collect();
    for i in 0..6 {
        prompts.insert(i * 5, format!("long prompt {i} ").repeat(1700));
    }
    let gateway = stack.gateway.clone();
    let start = std::sync::Arc::new(std::sync::Barrier::new(prompts.len()));
    let handles: Vec<_> = prompts
        .into_iter()
        .map(|prompt| {
            let gateway = gateway.clone();
            let start = start.clone();
            std::thread::spawn(move || {
                let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4});
                start.wait();
                http::post_json(
                    &gateway,
                    "/v1/completions",
                    &[("routing-strategy", "pd")],
                    &body,
                )
            })
        })
        .collect();
    for h in handles {
        let r = h.join().expect("client thread");
        assert_eq!(r.status, 200, "{}", r.text());
    }

    // The prefill work each pod was given, from pd-sim's own log, in the ledger's unit:
    // the fixed per-request cost (AIBRIX_TOKEN_LOAD_REQUEST_COST, 3500) plus prompt tokens.
    // least_request would count a 6000-token prompt like a 45-token one; token_load may not.
    let mut per_pod: BTreeMap<String, f64> = BTreeMap::new();
    for e in stack
        .sim_requests()
        .iter()
        .filter(|e| e["leg"] == "prefill")
    {
        let tokens = e["body"]["prompt"].as_str().map(str::len).unwrap_or(0) as f64 / 4.0;
        *per_pod
            .entry(e["pod"].as_str().unwrap_or_default().to_string())
            .or_default() += 3500.0 + tokens;
    }
    let total: f64 = per_pod.values().sum();
    assert_eq!(per_pod.len(), 2, "{per_pod:?}");
    for (pod, cost) in &per_pod {
        let share = cost / total;
        assert!(
            share <= 0.6,
            "{pod} carried {share:.2} of the prefill cost: {per_pod:?}"
        );
    }

    // Every charge is released once the requests are done: the gauges read exactly 0.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let gauges = ledger_gauges(&stack);
        let pods: std::collections::BTreeSet<&str> =
            gauges.keys().map(|(_, p)| p.as_str()).collect();
        assert!(
            pods.contains("p0") && pods.contains("p1"),
            "prefill gauges exist: {gauges:?}"
        );
        assert!(
            pods.contains("d0") && pods.contains("d1"),
            "decode gauges exist: {gauges:?}"
        );
        if gauges.values().all(|v| *v == 0.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ledger gauges stuck above zero: {gauges:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
