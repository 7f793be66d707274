//! A worker VM that traps while its request holds charges (forced through the testing-only
//! `PD_ROUTER_DEBUG_TRAP_HEADER`): Envoy's FAIL_RELOAD replaces the VM, and a live VM releases
//! the dead one's charges from its journal, so the ledger returns to exactly 0 instead of
//! pinning load on the pods for ever. Real Envoy, `--concurrency 2`.

use std::time::{Duration, Instant};

use pd_wasm_tests::http;
use pd_wasm_tests::stack::{Fleet, Stack};
use serde_json::json;

const MODEL: &str = "trap-model";

/// Every `pd_token_load_*` sample of the gateway, as (series, value).
fn ledger_samples(stack: &Stack) -> Vec<(String, f64)> {
    http::get(&stack.admin, "/stats/prometheus")
        .expect("admin")
        .text()
        .lines()
        .filter(|l| l.starts_with("pd_token_load_"))
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(s, v)| (s.to_string(), v.parse().unwrap_or(f64::NAN)))
        .collect()
}

fn completion(stack: &Stack, headers: &[(&str, &str)]) -> http::Response {
    let body =
        json!({"model": MODEL, "prompt": "a prompt worth charging ".repeat(40), "max_tokens": 2});
    let mut all = vec![("routing-strategy", "pd")];
    all.extend_from_slice(headers);
    http::post_json(&stack.gateway, "/v1/completions", &all, &body)
}

#[test]
fn a_trapped_vms_charges_are_released_and_the_worker_recovers() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let env = [
        ("AIBRIX_PREFILL_SCORE_POLICY", "token_load"),
        ("AIBRIX_DECODE_SCORE_POLICY", "token_load"),
        ("PD_ROUTER_DEBUG_TRAP_HEADER", "x-pd-test-trap"),
    ];
    let stack = Stack::start_full(fleet.clone(), fleet, 2, &env, &[]);

    // The VM routing this request charges p0 and d0, then traps when the prefill answers.
    // Its client gets no answer (Envoy leaves a stream paused by a trapped VM to the
    // connection manager's idle timeout), so the request is written on a raw socket that is
    // kept open, and never read.
    let body =
        json!({"model": MODEL, "prompt": "a prompt worth charging ".repeat(40), "max_tokens": 2})
            .to_string();
    let mut trapped = std::net::TcpStream::connect(&stack.gateway).expect("connect");
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\n\
         routing-strategy: pd\r\nx-pd-test-trap: 1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    std::io::Write::write_all(&mut trapped, request.as_bytes()).expect("send");
    stack.wait_for_log("trap requested by PD_ROUTER_DEBUG_TRAP_HEADER");
    // The gauges are written from the ledger by every live VM's sync (every 200 ms), so the
    // dead VM's charge shows although the VM that made it is gone.
    pd_wasm_tests::stack::eventually(Duration::from_secs(10), || {
        let charged = ledger_samples(&stack);
        charged
            .iter()
            .any(|(s, v)| s.contains("pod_name=\"d0\"") && *v > 0.0)
            .then_some(())
            .ok_or_else(|| format!("the dead VM's charge is not on the ledger: {charged:?}"))
    });

    // A live VM finds the silent journal and releases it: exactly 0, not "mostly drained".
    pd_wasm_tests::stack::wait_ledger_zero(&stack.admin, Duration::from_secs(40));
    stack.wait_for_log("released the charges of 1 requests");

    // Both workers route again (the trapped one through a reloaded VM), each request on a
    // new connection so both workers are reached.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut ok_in_a_row = 0;
    while ok_in_a_row < 10 {
        if completion(&stack, &[]).status == 200 {
            ok_in_a_row += 1;
        } else {
            ok_in_a_row = 0;
        }
        assert!(Instant::now() < deadline, "the gateway did not recover");
    }
    // Nothing of the dead VM's charge came back (the gauges lag the ledger by ≤ 200 ms).
    pd_wasm_tests::stack::wait_ledger_zero(&stack.admin, Duration::from_secs(10));
    drop(trapped);
}
