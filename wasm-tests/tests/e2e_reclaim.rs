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

/// One pair (p0, d0) under token_load on both sides, so every request holds charges; Envoy
/// with two workers and `env` besides.
fn start_charging(env: &[(&str, &str)]) -> Stack {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let mut all = vec![
        ("AIBRIX_PREFILL_SCORE_POLICY", "token_load"),
        ("AIBRIX_DECODE_SCORE_POLICY", "token_load"),
    ];
    all.extend_from_slice(env);
    Stack::start_full(fleet.clone(), fleet, 2, &all, &[])
}

#[test]
fn a_trapped_vms_charges_are_released_and_the_worker_recovers() {
    let stack = start_charging(&[("PD_ROUTER_DEBUG_TRAP_HEADER", "x-pd-test-trap")]);

    // The VM routing this request charges p0 and d0, then traps when the prefill answers.
    // Its client gets no answer (Envoy leaves a stream paused by a trapped VM to the
    // connection manager's idle timeout), so the request is written on a raw socket that is
    // kept open, and never read.
    let trapped = send_trap_request(&stack);
    stack.wait_for_log("trap requested by PD_ROUTER_DEBUG_TRAP_HEADER");
    wait_charged(&stack, "d0");

    // A live VM finds the silent journal and releases it: exactly 0, not "mostly drained".
    pd_wasm_tests::stack::wait_ledger_zero(&stack.admin, Duration::from_secs(40));
    stack.wait_for_log("released the charges of 1 requests");
    // Counted for the alerts: one VM declared dead, one request's charges released for it.
    assert_eq!(stack.filter_stat("pd_router_vms_reclaimed_total"), Some(1));
    assert_eq!(
        stack.metric(
            "pd_router_charges_force_released_total",
            &[("reason", "vm_reclaimed")]
        ),
        1.0
    );
    assert_eq!(
        stack.metric(
            "pd_router_charges_force_released_total",
            &[("reason", "ttl")]
        ),
        0.0
    );

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
    // Nor does the dead VM count as loaded: every VM logs its first snapshot once and its
    // end once, and the one that trapped (it never ends) was taken out by its reclaimer.
    pd_wasm_tests::stack::eventually(Duration::from_secs(10), || {
        let (loaded, done) = stack.vms_loaded_and_ended();
        let vms = stack.stat("pd_router_fleet_loaded_vms");
        (vms + done + 1 == loaded).then_some(()).ok_or(format!(
            "{vms} VMs count as loaded; {loaded} loaded, {done} ended, 1 trapped"
        ))
    });
    drop(trapped);
}

/// Waits until the ledger shows a charge on `pod`. The gauges are written from the ledger by
/// every live VM's sync (every 200 ms), so a dead VM's charge shows although the VM that made
/// it is gone.
fn wait_charged(stack: &Stack, pod: &str) {
    let label = format!("pod_name=\"{pod}\"");
    pd_wasm_tests::stack::eventually(Duration::from_secs(10), || {
        let charged = ledger_samples(stack);
        charged
            .iter()
            .any(|(s, v)| s.contains(&label) && *v > 0.0)
            .then_some(())
            .ok_or_else(|| format!("no charge on {pod} on the ledger: {charged:?}"))
    });
}

/// Sends a request that traps the VM routing it on a raw socket kept open (a trapped stream
/// is never answered).
fn send_trap_request(stack: &Stack) -> std::net::TcpStream {
    let body =
        json!({"model": MODEL, "prompt": "a prompt worth charging ".repeat(40), "max_tokens": 2})
            .to_string();
    let mut socket = std::net::TcpStream::connect(&stack.gateway).expect("connect");
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\n\
         routing-strategy: pd\r\nx-pd-test-trap: 1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    std::io::Write::write_all(&mut socket, request.as_bytes()).expect("send");
    socket
}

/// How many VMs trapped on a trap request so far.
fn traps(stack: &Stack) -> usize {
    stack
        .envoy_log()
        .matches("trap requested by PD_ROUTER_DEBUG_TRAP_HEADER")
        .count()
}

/// A VM reloaded after a trap (FAIL_RELOAD) whose very first request traps it, before its
/// first tick: its charges are released all the same. The journal registry used to learn of a
/// VM at its first tick, so no live VM watched this one's journal and its charges stayed on
/// the pods for good. One worker (so the reloaded VM is the one the next request meets) and
/// a 2 s tick (so the trap certainly comes first).
#[test]
fn a_vm_trapping_before_its_first_tick_has_its_charges_released() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let env = [
        ("AIBRIX_PREFILL_SCORE_POLICY", "token_load"),
        ("AIBRIX_DECODE_SCORE_POLICY", "token_load"),
        ("PD_ROUTER_DEBUG_TRAP_HEADER", "x-pd-test-trap"),
    ];
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet,
        &pd_wasm_tests::stack::Options {
            concurrency: 1,
            refresh_ms: 2000,
            envoy_env: &env,
            ..Default::default()
        },
    );
    let mut sockets = vec![send_trap_request(&stack)];
    stack.wait_for_log("trap requested by PD_ROUTER_DEBUG_TRAP_HEADER");
    // Requests meet no VM until Envoy's reload backoff has passed; the first one after it
    // creates the new VM, whose first request this is.
    let deadline = Instant::now() + Duration::from_secs(30);
    while traps(&stack) < 2 {
        assert!(
            Instant::now() < deadline,
            "no reloaded VM took a trap request"
        );
        sockets.push(send_trap_request(&stack));
        let waited = Instant::now();
        while traps(&stack) < 2 && waited.elapsed() < Duration::from_millis(500) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // A third VM routes (and scans the journals) once the backoff has passed again.
    let deadline = Instant::now() + Duration::from_secs(30);
    while completion(&stack, &[]).status != 200 {
        assert!(Instant::now() < deadline, "the worker did not recover");
    }
    // The live VM shows the dead VMs' charges...
    wait_charged(&stack, "d0");
    // ...and releases both: exactly 0.
    pd_wasm_tests::stack::wait_ledger_zero(&stack.admin, Duration::from_secs(40));
    drop(sockets);
}

fn running_on(stack: &Stack, pod: &str) -> f64 {
    stack.metric("pd_router_running_requests", &[("pod_name", pod)])
}

/// A pause of the whole gateway process longer than the journals' silence bound (a frozen
/// container, a VM resumed after migration, a wall clock stepped forward) makes no worker
/// reclaim another's charges: every journal stood still only because every VM did, and the
/// first VM to wake sees the others write within a tick. Before, it released the other
/// workers' in-flight charges, and pods read less loaded than they were.
#[test]
fn a_paused_gateway_keeps_every_workers_charges() {
    let stack = start_charging(&[]);
    // Decode answers its headers and a first chunk, then holds every stream until cleared.
    stack
        .arm_fault(json!({"pod": "d0", "kind": "hang_after_chunks", "chunks": 1, "leg": "decode"}));

    // Streams on both workers: at least two on each.
    let body = json!({"model": MODEL, "prompt": "a prompt worth charging ".repeat(40),
                      "max_tokens": 50, "stream": true})
    .to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\n\
         routing-strategy: pd\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let streams = stack.connections_on_every_worker(&request, 2);
    let n = streams.len();
    stack.wait_for_legs("decode", n);
    pd_wasm_tests::stack::eventually(Duration::from_secs(10), || {
        let running = running_on(&stack, "d0");
        (running == n as f64)
            .then_some(())
            .ok_or(format!("d0 runs {running} of {n} streams"))
    });

    // The pause is the fault under test, so it is timed: past the 10 s silence bound.
    stack.signal("envoy", libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(11_500));
    stack.signal("envoy", libc::SIGCONT);

    // Every VM scans about once a second: over three seconds each has scanned the others'
    // journals a few times, and the charges of every stream are still there. Read every
    // 50 ms, not in a loop that keeps Envoy's admin busy: a charge wrongly reclaimed stays
    // gone until the streams end, so no reading in between could miss it.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let running = running_on(&stack, "d0");
        assert_eq!(
            running,
            n as f64,
            "a worker reclaimed another's charges after the pause; log:\n{}",
            stack.envoy_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = stack.envoy_log();
    assert!(
        !log.contains("released the charges of") && !log.contains("declared dead"),
        "{log}"
    );

    // The streams end and release exactly what they charged: no double release.
    stack.clear_faults();
    stack.wait_ledger_zero();
    drop(streams);
}
