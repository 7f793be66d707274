//! Control-plane faults and the snapshot endpoint's protection, in real Envoy
//! (`--concurrency 2`) with the built filter: pd-control down and back, pd-control answering
//! garbage, the snapshot token, and the snapshot API kept off the data listener.
//!
//! The fault tests check the invariants of the fault matrix: each request ends with a success
//! or a specific error, a request routed while pd-control is down or answering garbage still
//! runs as a whole prefill/decode pair on the last good snapshot (its decode leg pulls the
//! prefill's KV), and the token ledger returns to exactly 0.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pd_wasm_tests::http;
use pd_wasm_tests::stack::{eventually, Fleet, Options, Stack};
use serde_json::{json, Value};

const MODEL: &str = "cp-model";

/// The token ledger only moves under the token-load policies; with them every routed request
/// charges (and must release) prefill and decode tokens.
const LEDGER_ENV: [(&str, &str); 2] = [
    ("AIBRIX_PREFILL_SCORE_POLICY", "token_load"),
    ("AIBRIX_DECODE_SCORE_POLICY", "token_load"),
];

fn two_pairs() -> Fleet {
    Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0")
        .pod("p1", "prefill", "g1")
        .pod("d1", "decode", "g1")
}

fn pd_request(gateway: &str) -> http::Response {
    let body =
        json!({"model": MODEL, "prompt": "control plane fault ".repeat(20), "max_tokens": 3});
    http::post_json(
        gateway,
        "/v1/completions",
        &[("routing-strategy", "pd")],
        &body,
    )
}

/// A request the gateway must route: 200, or the test fails with what it got. Its request
/// id, as the gateway answered it.
fn routed(stack: &Stack) -> String {
    let r = pd_request(&stack.gateway);
    assert_eq!(r.status, 200, "{}: {}", r.status, r.text());
    r.header("request-id")
        .unwrap_or_else(|| panic!("no request-id: {:?}", r.headers))
        .to_string()
}

/// pd-sim's log since the last clear holds exactly the requests `ids`, each run as one whole
/// PD pair: one prefill leg on a prefill pod and one decode leg on a decode pod of the same
/// roleset, both answered 200, the decode leg having pulled that prefill's KV (`kv_pull`
/// `ok`: the params named a prefill pod of the fleet, which still held the blocks).
fn assert_whole_pairs(stack: &Stack, ids: &[String]) {
    let log = stack.sim_requests();
    let legs = |leg: &str| log.iter().filter(|e| e["leg"] == leg).count();
    assert_eq!(
        (legs("prefill"), legs("decode"), log.len()),
        (ids.len(), ids.len(), 2 * ids.len()),
        "one prefill and one decode leg for each of {} requests, nothing else: {log:#?}",
        ids.len()
    );
    for id in ids {
        let leg = |leg: &str| {
            let found: Vec<&serde_json::Value> = log
                .iter()
                .filter(|e| e["x_request_id"] == id.as_str() && e["leg"] == leg)
                .collect();
            assert_eq!(found.len(), 1, "one {leg} leg of {id}: {log:#?}");
            found[0]
        };
        let (prefill, decode) = (leg("prefill"), leg("decode"));
        assert_eq!(
            (&prefill["role"], &decode["role"]),
            (&json!("prefill"), &json!("decode")),
            "{prefill} {decode}"
        );
        assert_eq!(prefill["roleset"], decode["roleset"], "{prefill} {decode}");
        assert_eq!(
            (&prefill["status"], &decode["status"]),
            (&json!(200), &json!(200))
        );
        assert_eq!(
            decode["kv_pull"], "ok",
            "the decode leg got the prefill's KV: {decode}"
        );
    }
}

/// Pods that received any leg since the last clear, by name.
fn pods_reached(stack: &Stack) -> BTreeSet<String> {
    stack
        .sim_requests()
        .iter()
        .filter_map(|e| e["pod"].as_str().map(str::to_string))
        .collect()
}

/// Waits until no VM routes to roleset g1 (p1, d1) any more, by routing requests and looking
/// at where they went.
fn wait_until_g1_unrouted(stack: &Stack) {
    eventually(Duration::from_secs(10), || {
        stack.clear_sim_requests();
        for _ in 0..4 {
            routed(stack);
        }
        let reached = pods_reached(stack);
        (!reached.contains("p1") && !reached.contains("d1"))
            .then_some(())
            .ok_or_else(|| format!("a VM still routes to the departed pair: {reached:?}"))
    });
}

fn fetch_errors(stack: &Stack, reason: &str) -> f64 {
    stack.metric(
        "pd_router_snapshot_fetch_errors_total",
        &[("reason", reason)],
    )
}

#[test]
fn pd_control_down_routes_on_the_last_snapshot_marks_it_stale_and_recovers() {
    let fleet = two_pairs();
    let mut stack = Stack::start_opts(
        fleet.clone(),
        fleet.clone(),
        &Options {
            envoy_env: &LEDGER_ENV,
            plugin_extra: "\"snapshot_stale_after_ms\":1000",
            ..Options::default()
        },
    );
    for _ in 0..6 {
        routed(&stack);
    }
    assert_eq!(stack.filter_stat("pd_router_snapshot_stale"), Some(0));

    // pd-control goes away; requests keep coming until every VM calls the snapshot stale.
    stack.kill("pd-control");
    eventually(Duration::from_secs(20), || {
        routed(&stack);
        (stack.stat("pd_router_snapshot_stale") == 1)
            .then_some(())
            .ok_or_else(|| "the snapshot never went stale".to_string())
    });
    stack.wait_for_log("is stale: pd-control has not confirmed it");
    // The last snapshot is whichever a poll brought before the kill (pd-control publishes a
    // new version whenever scraped load changes, so one may land just before it goes); from
    // here on it must stay the one routed on.
    let version_before = stack.stat("pd_router_fleet_version");
    assert!(stack.stat("pd_router_snapshot_age_ms") > 1000);
    assert!(fetch_errors(&stack, "unreachable") > 0.0);
    // Stale, and still routing whole pairs on the last snapshot.
    stack.clear_sim_requests();
    let ids: Vec<String> = (0..10).map(|_| routed(&stack)).collect();
    assert_eq!(stack.stat("pd_router_fleet_version"), version_before);
    assert_whole_pairs(&stack, &ids);

    // The fleet changes while pd-control is down (pair g1 leaves); pd-control comes back on
    // its address. Its fresh process must still win over the version the gateway holds.
    let smaller = fleet.without("p1").without("d1");
    stack.write_fleet(smaller);
    stack.restart_control(&[]);
    eventually(Duration::from_secs(20), || {
        let fresh = stack.filter_stat("pd_router_snapshot_stale") == Some(0);
        let newer = stack.stat("pd_router_fleet_version") > version_before;
        (fresh && newer).then_some(()).ok_or_else(|| {
            format!(
                "not recovered: stale {} version {} (was {version_before})",
                stack.stat("pd_router_snapshot_stale"),
                stack.stat("pd_router_fleet_version")
            )
        })
    });
    stack.wait_for_log("is fresh again");
    // Every VM adopts the restarted pd-control's snapshot: g1 is gone from routing. (The
    // gauges above show one VM's view; the requests below may reach another.)
    stack.wait_fleet_adopted();
    wait_until_g1_unrouted(&stack);
    stack.clear_sim_requests();
    for _ in 0..12 {
        routed(&stack);
    }
    let reached = pods_reached(&stack);
    assert_eq!(
        reached,
        BTreeSet::from(["d0".to_string(), "p0".to_string()]),
        "only the current fleet's pods"
    );
    stack.wait_ledger_zero();
}

/// A readiness probe (`/pd-router/ready`, the plugin's default `ready_path`) sent `times`
/// times on fresh connections, so each worker answers some: their statuses and bodies.
fn probe(gateway: &str, times: usize) -> Vec<(u16, Value)> {
    (0..times)
        .map(|_| {
            let r = http::get(gateway, "/pd-router/ready?from=test").expect("probe answered");
            assert_eq!(r.header("content-type"), Some("application/json"));
            (r.status, r.json())
        })
        .collect()
}

/// A gateway started while pd-control is unreachable has no snapshot and answers every
/// request 503: past `snapshot_stale_after_ms` it reads stale on the gauges operators alert on
/// (it read fresh, age 0) and says so once in its log, and it answers its readiness probe 503
/// (Envoy's own readiness says ready); its first snapshot makes it fresh and ready.
#[test]
fn a_gateway_started_without_pd_control_reads_stale_until_its_first_snapshot() {
    let fleet = two_pairs();
    let mut stack = Stack::start(fleet);
    stack.kill("pd-control");
    let control = stack.control.clone();
    let (gateway, log) = stack.add_gateway_unloaded(&control, "\"snapshot_stale_after_ms\":1000");
    // Each VM writes its own age (its uptime, without a snapshot): read both in one go.
    eventually(Duration::from_secs(20), || {
        let stale = gateway.filter_stat("pd_router_snapshot_stale");
        let age = gateway.filter_stat("pd_router_snapshot_age_ms");
        (stale == Some(1) && age > Some(1000))
            .then_some(())
            .ok_or_else(|| format!("not stale: {stale:?}, age {age:?}"))
    });
    assert_eq!(
        gateway.stat("pd_router_fleet_version"),
        0,
        "no snapshot yet"
    );
    let r = pd_request(&gateway.gateway);
    assert_eq!(r.status, 503, "{}", r.text());
    let requests = gateway.filter_stat("pd_router_requests_total");
    for (status, body) in probe(&gateway.gateway, 8) {
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["ready"], false, "{body}");
    }
    assert_eq!(
        gateway.filter_stat("pd_router_requests_total"),
        requests,
        "probes are no requests"
    );
    eventually(Duration::from_secs(10), || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("no fleet snapshot after")
            .then_some(())
            .ok_or_else(|| "the stale state was not logged".to_string())
    });

    stack.restart_control(&[]);
    eventually(Duration::from_secs(20), || {
        let fresh = gateway.filter_stat("pd_router_snapshot_stale") == Some(0);
        let loaded = gateway.stat("pd_router_fleet_version") > 0;
        (fresh && loaded).then_some(()).ok_or_else(|| {
            format!(
                "not fresh: stale {:?}, version {}",
                gateway.filter_stat("pd_router_snapshot_stale"),
                gateway.stat("pd_router_fleet_version")
            )
        })
    });
    eventually(Duration::from_secs(10), || {
        let r = pd_request(&gateway.gateway);
        (r.status == 200)
            .then_some(())
            .ok_or_else(|| format!("{}: {}", r.status, r.text()))
    });
    // Once every VM has adopted the snapshot, every probe says ready, whichever worker it
    // reaches: one round, not retried until a lucky one (a worker answering wrong would
    // slip through a retried round whose probes all landed on the other).
    let vms = (stack.concurrency + 1) as u64;
    eventually(Duration::from_secs(10), || {
        let loaded = gateway.stat("pd_router_fleet_loaded_vms");
        (loaded >= vms).then_some(()).ok_or_else(|| {
            format!("{loaded} VMs hold the snapshot, not the {vms} of the workers and root")
        })
    });
    // Each answers the version it routes on (pd-control publishes newer ones as engine
    // metrics move, and workers adopt each within a poll of one another).
    let answers = probe(&gateway.gateway, 8);
    assert!(
        answers.iter().all(|(status, body)| *status == 200
            && body["ready"] == true
            && body["snapshot_version"].as_u64().is_some_and(|v| v > 0)),
        "not ready everywhere: {answers:?}"
    );
}

/// What the fake control service answers, in rotation, one answer per connection.
#[derive(Debug, Clone, Copy)]
enum Garbage {
    /// 200, a version, bytes that start with an invalid protobuf tag.
    RandomBytes,
    /// 200, a version, a real snapshot missing its last byte.
    Truncated,
    /// 500 with a text body.
    ServerError,
    /// 200, a version, an HTML page.
    WrongContent,
    /// 200 and a real snapshot, but no version header.
    NoVersion,
    /// 200 and a real snapshot, version header not a number.
    BadVersion,
    /// The connection closes without an answer.
    Hangup,
    /// Not garbage: 200 and a real snapshot under [`BOGUS_VERSION`], as a pd-control whose
    /// clock runs far ahead would serve it.
    Ahead,
}

const GARBAGE: [Garbage; 7] = [
    Garbage::RandomBytes,
    Garbage::Truncated,
    Garbage::ServerError,
    Garbage::WrongContent,
    Garbage::NoVersion,
    Garbage::BadVersion,
    Garbage::Hangup,
];

/// A version far above anything real: if any garbage answer were adopted, the gateway's
/// `pd_router_fleet_version` would show it.
const BOGUS_VERSION: u64 = 9_000_000_000_000_000;

struct FakeControl {
    stop: Arc<AtomicBool>,
    served: Arc<AtomicUsize>,
    addr: String,
    thread: Option<JoinHandle<()>>,
}

impl FakeControl {
    /// Serves `kinds` in turn on `addr` (the real pd-control's address, now free) until
    /// dropped.
    fn start(addr: &str, snapshot: Vec<u8>, kinds: &'static [Garbage]) -> FakeControl {
        let listener = eventually(Duration::from_secs(10), || {
            TcpListener::bind(addr).map_err(|e| format!("cannot bind {addr}: {e}"))
        });
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicUsize::new(0));
        let (stop_t, served_t) = (stop.clone(), served.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop_t.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(mut conn) = conn else { continue };
                let n = served_t.fetch_add(1, Ordering::SeqCst);
                answer(&mut conn, kinds[n % kinds.len()], &snapshot);
            }
        });
        FakeControl {
            stop,
            served,
            addr: addr.to_string(),
            thread: Some(thread),
        }
    }
}

impl Drop for FakeControl {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = std::net::TcpStream::connect(&self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads one request head and writes the garbage answer (Envoy keeps connections alive, so
/// the connection is closed after each answer to take the next one fresh).
fn answer(conn: &mut std::net::TcpStream, kind: Garbage, snapshot: &[u8]) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    let bogus = BOGUS_VERSION.to_string();
    let (status, headers, body): (&str, Vec<(&str, &str)>, Vec<u8>) = match kind {
        Garbage::RandomBytes => {
            let mut body = vec![0xff];
            body.extend((0..512).map(|_| fastrand::u8(..)));
            ("200 OK", vec![("x-pd-snapshot-version", &bogus)], body)
        }
        Garbage::Truncated => (
            "200 OK",
            vec![("x-pd-snapshot-version", &bogus)],
            snapshot[..snapshot.len() - 1].to_vec(),
        ),
        Garbage::ServerError => (
            "500 Internal Server Error",
            vec![("content-type", "text/plain")],
            b"boom\n".to_vec(),
        ),
        Garbage::WrongContent => (
            "200 OK",
            vec![
                ("x-pd-snapshot-version", &bogus),
                ("content-type", "text/html"),
            ],
            b"<html><body>not a snapshot</body></html>".to_vec(),
        ),
        Garbage::NoVersion => ("200 OK", vec![], snapshot.to_vec()),
        Garbage::BadVersion => (
            "200 OK",
            vec![("x-pd-snapshot-version", "12abc")],
            snapshot.to_vec(),
        ),
        Garbage::Hangup => return,
        Garbage::Ahead => (
            "200 OK",
            vec![("x-pd-snapshot-version", &bogus)],
            snapshot.to_vec(),
        ),
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (name, value) in headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str("\r\n");
    let _ = conn.write_all(out.as_bytes());
    let _ = conn.write_all(&body);
}

#[test]
fn pd_control_answering_garbage_keeps_the_last_good_snapshot_and_counts_each_failure() {
    let fleet = two_pairs();
    let (mut stack, snapshot) = routing_with_snapshot(&fleet);
    let version_before = stack.stat("pd_router_fleet_version");
    assert!(snapshot.len() > 8, "a real snapshot to mangle");
    let reasons = ["undecodable", "status", "no_version", "unreachable"];
    let before: Vec<f64> = reasons.iter().map(|r| fetch_errors(&stack, r)).collect();

    stack.kill("pd-control");
    let fake = FakeControl::start(&stack.control.clone(), snapshot, &GARBAGE);
    // The version in use once the real pd-control is gone (it may have published one more
    // between the read above and its end): from here on only garbage could change it.
    eventually(Duration::from_secs(10), || {
        (fake.served.load(Ordering::SeqCst) >= 1)
            .then_some(())
            .ok_or_else(|| "the fake control service was never polled".to_string())
    });
    let version_held = stack.stat("pd_router_fleet_version");
    assert!(version_held >= version_before && version_held < BOGUS_VERSION);
    // Requests go on while every kind of garbage is served, until each failure reason counted.
    let started = Instant::now();
    stack.clear_sim_requests();
    let mut ids = Vec::new();
    eventually(Duration::from_secs(30), || {
        ids.push(routed(&stack));
        let missing: Vec<&str> = reasons
            .iter()
            .zip(&before)
            .filter(|(r, b)| fetch_errors(&stack, r) <= **b)
            .map(|(r, _)| *r)
            .collect();
        let rounds = fake.served.load(Ordering::SeqCst) / GARBAGE.len();
        (missing.is_empty() && rounds >= 2)
            .then_some(())
            .ok_or_else(|| format!("not counted yet: {missing:?} after {rounds} rounds"))
    });
    assert_eq!(
        stack.stat("pd_router_fleet_version"),
        version_held,
        "no garbage was adopted"
    );
    assert!(
        !stack.envoy_log().contains("panicked"),
        "no VM panicked: {}",
        stack.envoy_log()
    );
    stack.wait_for_log("does not decode");
    // Every request meanwhile ran as a whole pair on the last good snapshot.
    assert_whole_pairs(&stack, &ids);
    let garbage_for = started.elapsed();

    // The real pd-control comes back with a changed fleet: its snapshot is adopted.
    real_control_returns_without_g1(&mut stack, &fleet, fake, version_held);
    stack.wait_ledger_zero();
    eprintln!("garbage served for {garbage_for:?}");
}

/// A stack on `fleet` under the token-load policies that has routed a request, and the
/// snapshot pd-control serves (for a fake pd-control to serve as it is, or mangled).
fn routing_with_snapshot(fleet: &Fleet) -> (Stack, Vec<u8>) {
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet.clone(),
        &Options {
            envoy_env: &LEDGER_ENV,
            ..Options::default()
        },
    );
    routed(&stack);
    let snapshot = http::get(&stack.control, "/v1/snapshot")
        .expect("pd-control")
        .body;
    (stack, snapshot)
}

/// Ends `fake` and starts the real pd-control again on `fleet` less roleset g1; waits until
/// the gateway adopted one of its snapshots (a version above `held`, below the fake's) and
/// routes no more to g1.
fn real_control_returns_without_g1(stack: &mut Stack, fleet: &Fleet, fake: FakeControl, held: u64) {
    drop(fake);
    stack.write_fleet(fleet.without("p1").without("d1"));
    stack.restart_control(&[]);
    eventually(Duration::from_secs(20), || {
        let v = stack.stat("pd_router_fleet_version");
        (v > held && v < BOGUS_VERSION)
            .then_some(())
            .ok_or_else(|| format!("the real pd-control's snapshot not adopted ({v}, held {held})"))
    });
    wait_until_g1_unrouted(stack);
}

/// pd-control's versions are its clock's milliseconds: one that served a version far ahead
/// (its node's clock ran ahead) and is replaced by one on a sound clock serves versions below
/// the one the gateway holds. The gateway follows the new one: its snapshots answer polls
/// that named the published version, so they are pd-control's current state. Before, they
/// were dropped as older and the gateway routed on the old pods until the clock caught up.
#[test]
fn a_pd_control_whose_versions_went_back_is_followed() {
    let fleet = two_pairs();
    let (mut stack, snapshot) = routing_with_snapshot(&fleet);
    stack.kill("pd-control");
    let ahead = FakeControl::start(&stack.control.clone(), snapshot, &[Garbage::Ahead]);
    // A second poll follows the handling of the first answer: the far version is published.
    eventually(Duration::from_secs(10), || {
        (ahead.served.load(Ordering::SeqCst) >= 2)
            .then_some(())
            .ok_or_else(|| "the clock-ahead pd-control was not polled twice".to_string())
    });
    routed(&stack);
    let held = stack.stat("pd_router_fleet_version");
    real_control_returns_without_g1(&mut stack, &fleet, ahead, held);
    // Every worker follows: twenty requests, none to the departed pair (a worker still on
    // the old pods would send it about half of its requests).
    stack.clear_sim_requests();
    for _ in 0..20 {
        routed(&stack);
    }
    let reached = pods_reached(&stack);
    assert!(
        !reached.contains("p1") && !reached.contains("d1"),
        "{reached:?}"
    );
    stack.wait_ledger_zero();
}

const TOKEN: &str = "e2e-Sn4pshot_T0ken";

#[test]
fn the_snapshot_token_gates_the_fetch_and_the_api_is_not_on_the_data_listener() {
    let fleet = two_pairs();
    let extra = format!("\"snapshot_token\":\"{TOKEN}\"");
    let mut stack = Stack::start_opts(
        fleet.clone(),
        fleet.clone(),
        &Options {
            envoy_env: &LEDGER_ENV,
            plugin_extra: &extra,
            ..Options::default()
        },
    );
    routed(&stack);

    // pd-control now requires the token, which this gateway sends: polls keep succeeding,
    // and a fleet change made meanwhile is adopted.
    let version_before = stack.stat("pd_router_fleet_version");
    let token_file = stack.dir.join("snapshot-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("token file");
    stack.write_fleet(fleet.without("p1").without("d1"));
    let token_arg = token_file.display().to_string();
    stack.restart_control(&["--snapshot-token-file", &token_arg]);
    eventually(Duration::from_secs(20), || {
        (stack.stat("pd_router_fleet_version") > version_before)
            .then_some(())
            .ok_or_else(|| "the gateway with the right token never got the new fleet".to_string())
    });
    let unauthorized_before = fetch_errors(&stack, "unauthorized");
    routed(&stack);

    // Without the token, pd-control refuses the snapshot (people and tools too).
    let r = http::get(&stack.control, "/v1/snapshot.json").expect("pd-control");
    assert_eq!(r.status, 401);
    let r = http::request(
        &stack.control,
        "GET",
        "/v1/snapshot.json",
        &[("authorization", &format!("Bearer {TOKEN}"))],
        &[],
    )
    .expect("pd-control");
    assert_eq!(r.status, 200);

    // A gateway with the wrong token never gets a snapshot: requests get the contract's
    // no-snapshot error, and its failed polls are counted as unauthorized.
    let wrong = stack.add_gateway_with_plugin("\"snapshot_token\":\"not-the-token\"");
    eventually(Duration::from_secs(20), || {
        let scraped = http::get(&wrong.admin, "/stats/prometheus")
            .map(|r| pd_wasm_tests::prom::Scrape::parse(&r.text()))
            .map(|s| {
                s.sum(
                    "pd_router_snapshot_fetch_errors_total",
                    &[("reason", "unauthorized")],
                )
            })
            .unwrap_or(0.0);
        (scraped > 0.0)
            .then_some(())
            .ok_or_else(|| "the wrong token's polls are not counted".to_string())
    });
    for _ in 0..4 {
        let r = pd_request(&wrong.gateway);
        assert_eq!(r.status, 503, "{}", r.text());
        assert_eq!(r.header("x-error-routing"), Some("true"));
        assert!(
            r.text().contains("has not received a fleet snapshot"),
            "{}",
            r.text()
        );
    }
    assert_eq!(wrong.filter_stat("pd_router_fleet_loaded_vms"), Some(0));
    assert_eq!(
        wrong.metric("pd_router_rejected_total", &[("reason", "no_snapshot")]),
        4.0
    );
    assert_eq!(
        fetch_errors(&stack, "unauthorized"),
        unauthorized_before,
        "the right token is never refused"
    );

    // The snapshot API is a separate cluster: through the data listener, with or without the
    // token and with destination headers pointing at pd-control, nothing of it comes back.
    let pod_names: Vec<&str> = fleet.pods.iter().map(|p| p.name.as_str()).collect();
    for path in [
        "/v1/snapshot",
        "/v1/snapshot.json",
        "/v1/snapshot?version=0",
    ] {
        for headers in [
            vec![],
            vec![("authorization", format!("Bearer {TOKEN}"))],
            vec![
                ("authorization", format!("Bearer {TOKEN}")),
                ("target-pod", stack.control.clone()),
                ("x-envoy-original-dst-host", stack.control.clone()),
            ],
        ] {
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            let r = http::request(&stack.gateway, "GET", path, &headers, &[]).expect("gateway");
            // Refused by the filter as a path it does not route, never proxied.
            assert_eq!(
                r.status,
                501,
                "GET {path} through the data port: {}",
                r.text()
            );
            assert!(r.header("x-pd-snapshot-version").is_none());
            let text = r.text();
            assert!(
                !pod_names.iter().any(|p| text.contains(&format!("\"{p}\""))),
                "GET {path} leaked the fleet: {text}"
            );
        }
    }
    // Nine refusals of an unknown path, on the request headers.
    assert_eq!(
        stack.metric("pd_router_rejected_total", &[("reason", "unknown_path")]),
        9.0
    );
    assert_eq!(
        stack.metric(
            "gateway_request_model_fail_total",
            &[
                ("model", "unknown"),
                ("status", "request_headers_fail"),
                ("status_code", "501")
            ]
        ),
        9.0
    );
    assert_eq!(stack.metric("pd_router_rejected_total", &[]), 9.0);
    stack.wait_ledger_zero();
}

/// A pd-control gauge or counter (0 when absent).
/// Waits until pd-control holds exactly `want` snapshot polls (`when` explains the wait).
fn wait_polls_held(stack: &Stack, want: f64, within: Duration, when: &str) {
    eventually(within, || {
        let waiting = stack.control_metric("pd_control_snapshot_polls_waiting");
        (waiting == want)
            .then_some(())
            .ok_or(format!("{waiting} polls held {when}"))
    });
}

/// A poll answered with a new snapshot is followed by the next one at once (`core::poll`),
/// so the lease holder is already waiting when pd-control builds the version after it. With
/// ticks 2 s apart (the slowest `refresh_ms` allowed): the fleet is edited while no poll is
/// held (between a held poll's 304 and the next tick), the tick's poll brings the edit, and a
/// poll must be held again within 1 s of the adoption. Polling on the tick alone leaves none
/// held until the next tick, 2 s after the one that brought the edit.
#[test]
fn a_new_snapshot_finds_the_next_poll_already_waiting_not_the_next_tick() {
    let fleet = two_pairs();
    let mut stack = Stack::start_opts(
        fleet.clone(),
        fleet.clone(),
        &Options {
            refresh_ms: 2_000,
            plugin_extra: "\"snapshot_stale_after_ms\":30000",
            ..Options::default()
        },
    );
    wait_polls_held(
        &stack,
        0.0,
        Duration::from_secs(10),
        "while waiting for the gap before a tick",
    );
    stack.write_fleet(fleet.without("d1"));
    stack.wait_fleet_adopted();
    wait_polls_held(&stack, 1.0, Duration::from_secs(1), "after the adoption");
    assert_eq!(pd_request(&stack.gateway).status, 200);
}

#[test]
fn an_idle_gateway_holds_one_long_poll_and_slows_its_timers_until_work_arrives() {
    // Decode at 50 ms a token: a 60-token stream stays open for about 3 s.
    let fleet = two_pairs();
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet,
        &Options {
            sim_args: &["--decode-ms-per-token", "50"],
            ..Options::default()
        },
    );
    let vms = (stack.concurrency + 1) as u64;
    // One VM (the lease holder) polls, and pd-control holds its poll: the filter sends the
    // wait and keeps its lease while waiting, so no other VM polls meanwhile.
    wait_polls_held(&stack, 1.0, Duration::from_secs(10), "at start-up");
    // Nothing to do: every VM's timer slows down (two seconds after its last work).
    eventually(Duration::from_secs(15), || {
        let idle = stack.stat("pd_router_idle_vms");
        (idle == vms)
            .then_some(())
            .ok_or(format!("{idle} of {vms} VMs idle"))
    });

    // A long stream: the worker serving it goes back to the fast period while it lasts (a
    // lone gateway leaves its other VMs asleep; e2e_replicas checks a replica wakes them) ...
    let gateway = stack.gateway.clone();
    let stream = std::thread::spawn(move || {
        let body = json!({"model": MODEL, "prompt": "wake up ".repeat(20), "max_tokens": 60,
            "stream": true});
        http::post_json(
            &gateway,
            "/v1/completions",
            &[("routing-strategy", "pd")],
            &body,
        )
    });
    eventually(Duration::from_secs(10), || {
        let idle = stack.filter_stat("pd_router_idle_vms");
        idle.is_some_and(|idle| idle < vms)
            .then_some(())
            .ok_or(format!("{idle:?} of {vms} VMs still idle during a request"))
    });
    assert!(
        !stream.is_finished(),
        "the VM must wake for the request, not after it"
    );
    let r = stream.join().expect("stream thread");
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("[DONE]"), "{}", r.text());
    // ... and everything settles again: timers slow, charges released, one poll held.
    eventually(Duration::from_secs(15), || {
        let idle = stack.stat("pd_router_idle_vms");
        (idle == vms)
            .then_some(())
            .ok_or(format!("{idle} of {vms} VMs idle after the request"))
    });
    stack.wait_ledger_zero();
    // Between a held poll's 304 and the next poll (one tick) none is held: wait for it.
    wait_polls_held(&stack, 1.0, Duration::from_secs(10), "after the request");
    routed(&stack);
}

/// A drop-in whose `pd_control` cluster is `envoy/pd-control-standby.yaml`'s: health-checked,
/// `primary` first, `standby` behind it (priority 1). The fragment's own text is spliced in
/// (comments dropped, addresses filled), so what operators copy is what runs here.
fn with_standby_control(rendered: String, primary: &str, standby: &str) -> String {
    let fragment = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../envoy/pd-control-standby.yaml"),
    )
    .expect("the standby fragment");
    let (addr, port) = primary.rsplit_once(':').expect("host:port");
    let (standby_addr, standby_port) = standby.rsplit_once(':').expect("host:port");
    let keys: Vec<String> = fragment
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let l = l
                .replace("@CONTROL_ADDR@", addr)
                .replace("@CONTROL_PORT@", port)
                .replace("@STANDBY_ADDR@", standby_addr)
                .replace("@STANDBY_PORT@", standby_port);
            format!("    {l}")
        })
        .collect();
    let lines: Vec<&str> = rendered.lines().collect();
    let cluster = lines
        .iter()
        .position(|l| *l == "  - name: pd_control")
        .expect("the drop-in's pd_control cluster");
    let start = cluster
        + lines[cluster..]
            .iter()
            .position(|l| *l == "    load_assignment:")
            .expect("its load_assignment");
    let end = start
        + 1
        + lines[start + 1..]
            .iter()
            .position(|l| !l.starts_with("      "))
            .unwrap_or(lines.len() - start - 1);
    let mut out: Vec<String> = lines[..start].iter().map(|l| l.to_string()).collect();
    out.extend(keys);
    out.extend(lines[end..].iter().map(|l| l.to_string()));
    let mut joined = out.join("\n");
    joined.push('\n');
    assert!(joined.contains("priority: 1"), "the standby spliced in");
    joined
}

/// Without Kubernetes, a standby pd-control behind the first in the `pd_control` cluster
/// (`envoy/pd-control-standby.yaml`): when the first goes away, the gateway's polls reach
/// the standby, so a fleet edit made meanwhile still reaches every worker and the snapshot
/// stays fresh, while a gateway polling the first alone goes stale on the old fleet.
#[test]
fn a_standby_pd_control_serves_the_gateway_when_the_first_goes_away() {
    let fleet = two_pairs();
    let mut stack = Stack::start_opts(
        fleet.clone(),
        fleet.clone(),
        &Options {
            plugin_extra: "\"snapshot_stale_after_ms\":1000",
            ..Options::default()
        },
    );
    let standby = stack.add_control(&[]);
    let primary = stack.control.clone();
    let gw = stack.add_gateway_edited(|c| with_standby_control(c, &primary, &standby));
    let route = |gateway: &str| {
        let r = pd_request(gateway);
        assert_eq!(r.status, 200, "{}: {}", r.status, r.text());
    };
    route(&gw.gateway);
    assert_eq!(gw.filter_stat("pd_router_snapshot_stale"), Some(0));

    stack.kill("pd-control");
    stack.write_fleet(fleet.without("p1").without("d1"));
    // The standby's snapshot without g1, and every VM of the standby's gateway on it.
    let vms = (stack.concurrency + 1) as u64;
    eventually(Duration::from_secs(20), || {
        let snap: Value = http::get(&standby, "/v1/snapshot.json")
            .map_err(|e| e.to_string())?
            .json();
        let names: BTreeSet<&str> = pd_wasm_tests::stack::snapshot_pods(&snap)
            .filter_map(|p| p["name"].as_str())
            .collect();
        if names.contains("p1") {
            return Err(format!("the standby still serves g1: {names:?}"));
        }
        let version = snap["version"].as_u64().unwrap_or(u64::MAX);
        let adopted = gw.stat("pd_router_fleet_version");
        let on_latest = gw.stat("pd_router_fleet_vms_on_latest");
        let fresh = gw.filter_stat("pd_router_snapshot_stale") == Some(0);
        (adopted >= version && on_latest >= vms && fresh)
            .then_some(())
            .ok_or_else(|| {
                format!("the gateway is on {adopted} ({on_latest} VMs, fresh {fresh}), the standby serves {version}")
            })
    });
    stack.clear_sim_requests();
    for _ in 0..12 {
        route(&gw.gateway);
    }
    assert_eq!(
        pods_reached(&stack),
        BTreeSet::from(["d0".to_string(), "p0".to_string()]),
        "the standby's fleet"
    );
    // The stack's own gateway knows the first pd-control alone: stale, on the old fleet.
    eventually(Duration::from_secs(20), || {
        route(&stack.gateway);
        (stack.stat("pd_router_snapshot_stale") == 1)
            .then_some(())
            .ok_or_else(|| "the single-control gateway never went stale".to_string())
    });
}
