//! End-to-end: the selection policies under concurrent load, in real Envoy (`--concurrency 2`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pd_wasm_tests::http;
use pd_wasm_tests::stack::{eventually, Fleet, Stack};
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
    // Every prefill leg hangs at its pod until the test has seen all of them arrive, so the
    // whole burst is routed while all of it is in flight: each selection sees every earlier
    // charge, and the assignment the ledger makes is the assignment the pods get.
    let stack = Stack::start_full(
        fleet.clone(),
        fleet,
        2,
        &env,
        &["--prefill-concurrency", "0"],
    );
    for pod in ["p0", "p1"] {
        stack.arm_fault(json!({"pod": pod, "kind": "hang_before_headers", "leg": "prefill"}));
    }

    // 6 long prompts (~6000 tokens) among 24 short ones, all in flight at once.
    let mut prompts: Vec<String> = (0..24)
        .map(|i| format!("short prompt {i} ").repeat(10))
        .collect();
    for i in 0..6 {
        prompts.insert(i * 5, format!("long prompt {i} ").repeat(1700));
    }
    let sent = prompts.len();
    let gateway = stack.gateway.clone();
    // One after another in this order (each sent once the previous one's prefill leg is
    // parked at its pod), so the outcome depends on the policy, not on which client thread
    // the OS ran first: with two workers racing, a burst of long prompts can arrive first
    // and the normalised prefill + decode sum then balances decode tokens at the prefill
    // side's expense (seen as 0.61-0.63 shares).
    let handles: Vec<_> = prompts
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| {
            let gateway = gateway.clone();
            let handle = std::thread::spawn(move || {
                let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4});
                http::post_json(
                    &gateway,
                    "/v1/completions",
                    &[("routing-strategy", "pd")],
                    &body,
                )
            });
            stack.wait_for_legs("prefill", i + 1);
            handle
        })
        .collect();

    // The prefill work each pod was given, from pd-sim's own log, in the ledger's unit:
    // the fixed per-request cost (AIBRIX_TOKEN_LOAD_REQUEST_COST, 3500) plus prompt tokens.
    // least_request would count a 6000-token prompt like a 45-token one; token_load may not.
    let mut per_pod: BTreeMap<String, f64> = BTreeMap::new();
    for e in stack.wait_for_legs("prefill", sent) {
        let tokens = e["body"]["prompt"].as_str().map(str::len).unwrap_or(0) as f64 / 4.0;
        *per_pod
            .entry(e["pod"].as_str().unwrap_or_default().to_string())
            .or_default() += 3500.0 + tokens;
    }
    stack.clear_faults();
    for h in handles {
        let r = h.join().expect("client thread");
        assert_eq!(r.status, 200, "{}", r.text());
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

fn completion(stack: &Stack, prompt: &str) -> http::Response {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let r = http::post_json(
        &stack.gateway,
        "/v1/completions",
        &[("routing-strategy", "pd")],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r
}

/// Two rolesets of one prefill and one decode pod each, scored with `prefix_cache` (the
/// default prefill policy) against an idle, tied decode side, on two workers.
fn two_rolesets_on_prefix_cache() -> Stack {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0")
        .pod("p1", "prefill", "g1")
        .pod("d1", "decode", "g1");
    Stack::start_with(fleet, 2, &[("AIBRIX_DECODE_SCORE_POLICY", "least_request")])
}

#[test]
fn a_prefix_learned_on_one_worker_steers_requests_on_every_worker() {
    let stack = two_rolesets_on_prefix_cache();

    // Prompts that differ from their first block spread over both prefill pods: nothing else
    // pins them. (Prompts sharing even a few leading blocks would not: under prefix_cache
    // a 1 % match outweighs the whole load term, as the contract warns.)
    let mut spread = std::collections::BTreeSet::new();
    for i in 0..16 {
        let r = completion(&stack, &format!("{i:04} unrelated prompt ").repeat(20));
        spread.insert(
            r.header("prefill-target-pod")
                .unwrap_or_default()
                .to_string(),
        );
    }
    assert_eq!(spread.len(), 2, "{spread:?}");

    // Each prompt's first request teaches one worker; the next ones, sent the moment its
    // answer is in, on fresh connections that land on both workers, must all follow it. A
    // worker that learned of the prefix any later (say on its next tick) would pick by load
    // among idle pods for some of them, half the time the other pod.
    for topic in 0..8 {
        let shared =
            format!("Topic {topic}: you are a careful assistant. Answer in one line. ").repeat(40);
        let first = completion(&stack, &shared);
        let owner = first
            .header("prefill-target-pod")
            .unwrap_or_default()
            .to_string();
        for _ in 0..6 {
            let r = completion(&stack, &shared);
            assert_eq!(
                r.header("prefill-target-pod"),
                Some(owner.as_str()),
                "prefix affinity lost on a worker (topic {topic})"
            );
        }
    }
}

#[test]
fn a_worker_that_starts_routing_late_follows_the_prefixes_learned_before() {
    let stack = two_rolesets_on_prefix_cache();
    let topic =
        |t: usize| format!("Late topic {t}: you are a terse assistant. Cite nothing. ").repeat(40);

    // One connection, so one worker routes every first request and learns every owner; the
    // other worker has routed nothing yet and read nothing.
    let mut conn = http::KeepAlive::connect(&stack.gateway).expect("connect");
    let mut owners = Vec::new();
    for t in 0..16 {
        let body = json!({"model": MODEL, "prompt": topic(t), "max_tokens": 2});
        let r = conn
            .post_json("/v1/completions", &[("routing-strategy", "pd")], &body)
            .expect("teach");
        assert_eq!(r.status, 200, "{}", r.text());
        owners.push(
            r.header("prefill-target-pod")
                .unwrap_or_default()
                .to_string(),
        );
    }
    let distinct: std::collections::BTreeSet<&String> = owners.iter().collect();
    assert_eq!(
        distinct.len(),
        2,
        "topics spread over both prefill pods: {owners:?}"
    );
    drop(conn);

    // Fresh connections land on both workers. The one that never routed must find every
    // owner in the other's ring at its first selection; starting from what was published
    // after it arrived, it would pick among idle pods, half the time the other one.
    for round in 0..4 {
        for (t, owner) in owners.iter().enumerate() {
            let r = completion(&stack, &topic(t));
            assert_eq!(
                r.header("prefill-target-pod"),
                Some(owner.as_str()),
                "prefix history lost on a worker (topic {t}, round {round})"
            );
        }
    }
}

/// Two zero-time rolesets on prefix_cache, two workers, both of which have routed (and so
/// follow each other's prefix rings): fresh connections land on both.
fn two_following_workers() -> Stack {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0")
        .pod("p1", "prefill", "g1")
        .pod("d1", "decode", "g1");
    // Zero-time pods: one connection publishes a batch per request as fast as Envoy routes.
    let zero = [
        "--prefill-base-ms",
        "0",
        "--prefill-us-per-token",
        "0",
        "--decode-ms-per-token",
        "0",
        "--kv-pull-base-ms",
        "0",
        "--kv-pull-us-per-token",
        "0",
        "--prefill-concurrency",
        "0",
        "--batch-slowdown",
        "0",
    ];
    let stack = Stack::start_full(
        fleet.clone(),
        fleet,
        2,
        &[("AIBRIX_DECODE_SCORE_POLICY", "least_request")],
        &zero,
    );
    for i in 0..16 {
        completion(&stack, &format!("{i:04} warm-up prompt ").repeat(4));
    }
    stack
}

/// `n` requests with prompts new to the index, numbered from `from`, on one connection: one
/// worker routes them all and publishes a batch for each.
fn busy_connection(conn: &mut http::KeepAlive, from: usize, n: usize) {
    for i in from..from + n {
        let body =
            json!({"model": MODEL, "prompt": format!("{i:05} busy connection"), "max_tokens": 1});
        let r = conn
            .post_json("/v1/completions", &[("routing-strategy", "pd")], &body)
            .expect("request");
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

/// Prefix batches the workers missed while `run` ran.
fn batches_missed_during(stack: &Stack, run: impl FnOnce()) -> u64 {
    let before = stack.stat("pd_router_prefix_batches_missed_total");
    run();
    stack.stat("pd_router_prefix_batches_missed_total") - before
}

#[test]
fn an_idle_worker_reads_a_busy_workers_ring_before_it_laps() {
    let stack = two_following_workers();
    // One connection: one worker routes every request, the other has nothing to do and slows
    // its timer to the idle second, in which a 128-batch ring laps it many times over.
    let mut conn = http::KeepAlive::connect(&stack.gateway).expect("connect");
    // The first half lets the idle worker measure the rate; in the second it must read often
    // enough to lose nothing. Before it did, it missed ≈ 2 000 of every 3 000 batches here; a
    // slack of a tenth covers a worker thread the scheduler holds up on a box busy with
    // another test.
    busy_connection(&mut conn, 0, 3_000);
    let missed = batches_missed_during(&stack, || busy_connection(&mut conn, 3_000, 3_000));
    assert!(
        missed < 300,
        "the idle worker missed {missed} of the busy one's 3000 batches"
    );
}

#[test]
fn an_idle_worker_follows_a_burst_from_its_first_batches() {
    let stack = two_following_workers();
    // The whole gateway idle: every VM's timer at its idle second.
    let vms = (stack.concurrency + 1) as u64;
    eventually(Duration::from_secs(15), || {
        let idle = stack.stat("pd_router_idle_vms");
        (idle == vms)
            .then_some(())
            .ok_or(format!("{idle} of {vms} VMs idle"))
    });
    // A burst on one connection. The worker serving it wakes the others with its first
    // request, and they read its ring closely until they know the burst's rate. Left on its
    // idle tick, the other worker would first read up to a second into the burst and lose
    // all but the ring's last 128 batches of it (≈ 400 on average here, at ≈ 1 000 a second).
    let mut conn = http::KeepAlive::connect(&stack.gateway).expect("connect");
    let missed = batches_missed_during(&stack, || busy_connection(&mut conn, 0, 2_000));
    assert!(
        missed < 100,
        "the idle worker missed {missed} of the burst's 2000 batches"
    );
}

#[test]
fn prompt_length_buckets_choose_the_roleset_or_the_standard_pod() {
    // The AIBrix bucketing scenario: short 0–15 and medium 16–32 tokens, a standard pod beyond.
    let range = |min: u32, max: u32| {
        format!(
            r#"{{"profiles":{{"default":{{"routingStrategy":"pd","routingConfig":{{"promptLenBucketMinLength":{min},"promptLenBucketMaxLength":{max}}}}}}}}}"#
        )
    };
    let fleet = Fleet::new(MODEL)
        .pod("short-p", "prefill", "short")
        .config(&range(0, 15))
        .pod("short-d", "decode", "short")
        .config(&range(0, 15))
        .pod("medium-p", "prefill", "medium")
        .config(&range(16, 32))
        .pod("medium-d", "decode", "medium")
        .config(&range(16, 32))
        .pod("standard", "all", "")
        .config(r#"{"profiles":{"default":{"routingStrategy":"pd","routingConfig":{"combined":true}}}}"#);
    let mut stack = Stack::start_with(fleet, 2, &[("AIBRIX_PROMPT_LENGTH_BUCKETING", "true")]);
    // " hello" is one cl100k token, so these prompts are exactly 10, 20 and 40 tokens.
    let tokens = |n: usize| " hello".repeat(n);
    for _ in 0..4 {
        stack.wait_quiet_snapshot();
        let r = completion(&stack, &tokens(10));
        assert_eq!(
            (r.header("prefill-target-pod"), r.header("target-pod")),
            (Some("short-p"), Some("short-d"))
        );
        stack.wait_quiet_snapshot();
        let r = completion(&stack, &tokens(20));
        assert_eq!(
            (r.header("prefill-target-pod"), r.header("target-pod")),
            (Some("medium-p"), Some("medium-d"))
        );
        stack.wait_quiet_snapshot();
        let r = completion(&stack, &tokens(40));
        assert_eq!(
            (r.header("prefill-target-pod"), r.header("target-pod")),
            (None, Some("standard"))
        );
        // Range edges are inclusive.
        stack.wait_quiet_snapshot();
        let r = completion(&stack, &tokens(15));
        assert_eq!(r.header("target-pod"), Some("short-d"));
        stack.wait_quiet_snapshot();
        let r = completion(&stack, &tokens(16));
        assert_eq!(r.header("target-pod"), Some("medium-d"));
    }
    // The medium bucket loses its decode pod: its prompts go to the standard pod, never to
    // the short pair.
    let edited = stack.fleet.without("medium-d");
    stack.write_fleet(edited);
    stack.load_until_adopted(|| {
        let r = completion(&stack, &tokens(20));
        assert!(
            matches!(r.header("target-pod"), Some("medium-d" | "standard")),
            "only the old pair or the standard pod: {:?}",
            r.header("target-pod")
        );
    });
    for _ in 0..10 {
        let r = completion(&stack, &tokens(20));
        assert_eq!(
            (r.header("prefill-target-pod"), r.header("target-pod")),
            (None, Some("standard"))
        );
    }
}

#[test]
fn a_charge_held_past_its_ttl_is_force_released_once() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0");
    let env = [
        ("AIBRIX_PREFILL_SCORE_POLICY", "token_load"),
        ("AIBRIX_TOKEN_LOAD_TTL_SECONDS", "1"),
        // The prefix index's eviction interval paces its eviction only: once an hour must
        // not hold the force-release (or any other upkeep) back an hour.
        ("AIBRIX_PREFIX_CACHE_EVICTION_INTERVAL_SECONDS", "3600"),
    ];
    // The prefill leg hangs at its pod until the test releases it, far past the 1 s TTL.
    let stack = Stack::start_full(fleet.clone(), fleet, 2, &env, &[]);
    stack.arm_fault(json!({"pod": "p0", "kind": "hang_before_headers", "leg": "prefill"}));
    let gateway = stack.gateway.clone();
    let request = std::thread::spawn(move || completion_at(&gateway, &"slow prompt ".repeat(50)));

    let active = |stack: &Stack| {
        ledger_gauges(stack)
            .get(&("pd_token_load_active_tokens".to_string(), "p0".to_string()))
            .copied()
            .unwrap_or(0.0)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while active(&stack) == 0.0 {
        assert!(Instant::now() < deadline, "the charge never showed up");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The janitor force-releases it while the request is still waiting for its prefill.
    let deadline = Instant::now() + Duration::from_secs(10);
    while active(&stack) != 0.0 {
        assert!(
            Instant::now() < deadline,
            "the charge was never force-released"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !request.is_finished(),
        "released before the request ended, not by it"
    );
    assert_eq!(stack.wait_for_legs("prefill", 1).len(), 1);
    stack.clear_faults();
    let r = request.join().expect("client");
    assert_eq!(
        r.status,
        200,
        "the request itself still completes: {}",
        r.text()
    );
    // Its own releases found nothing left to release: no double subtraction, all exactly 0.
    assert!(
        ledger_gauges(&stack).values().all(|v| *v == 0.0),
        "{:?}",
        ledger_gauges(&stack)
    );
    stack.wait_for_log("force-releasing");
    // Counted once its release landed, after the line was logged.
    eventually(Duration::from_secs(10), || {
        let counted = stack.metric(
            "pd_router_charges_force_released_total",
            &[("reason", "ttl")],
        );
        (counted == 1.0)
            .then_some(())
            .ok_or_else(|| format!("{counted} force-releases counted, not 1"))
    });
}

fn completion_at(gateway: &str, prompt: &str) -> http::Response {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    http::post_json(
        gateway,
        "/v1/completions",
        &[("routing-strategy", "pd")],
        &body,
    )
}

#[test]
fn locked_strategy_and_auto_profiles_apply_in_envoy() {
    // The model config comes from the first pod with a valid annotation.
    let config = r#"{"lockedRoutingStrategy":"pd","defaultProfile":"chat",
        "profiles":{"chat":{"routingStrategy":"pd"},
                    "long":{"routingStrategy":"pd","routingConfig":{"promptTokensGte":30}},
                    "short":{"routingStrategy":"pd","routingConfig":{"promptTokensLt":30}}}}"#;
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .config(config)
        .pod("d0", "decode", "g0")
        .combined("c0");
    let stack = Stack::start(fleet);
    let send = |headers: &[(&str, &str)], words: usize| {
        let body = json!({"model": MODEL, "prompt": " hello".repeat(words), "max_tokens": 2});
        let r = http::post_json(&stack.gateway, "/v1/completions", headers, &body);
        assert_eq!(r.status, 200, "{}", r.text());
        r
    };
    // The locked strategy beats a client asking for a single-pod strategy.
    let r = send(&[("routing-strategy", "random")], 5);
    assert_eq!(
        r.header("prefill-target-pod"),
        Some("p0"),
        "locked pd wins over the header"
    );
    assert_eq!(r.header("routing-strategy"), Some("pd"));
    // config-profile: auto picks by prompt length and says which.
    let r = send(&[("config-profile", "auto")], 40);
    assert_eq!(r.header("x-aibrix-config-profile"), Some("long"));
    let r = send(&[("config-profile", "AUTO")], 10);
    assert_eq!(r.header("x-aibrix-config-profile"), Some("short"));
    // A named profile is used but not echoed.
    let r = send(&[("config-profile", "long")], 10);
    assert_eq!(r.header("x-aibrix-config-profile"), None);
}

/// An operator's "effectively never" in a model's annotation (timeouts of 1e20 s) is taken as
/// the longest bound a call can carry: the requests are routed on every worker. Before, the
/// prefill call's `Duration::from_secs_f64` panicked and trapped each worker's VM, so every
/// request of every model failed, and the watchdog's deadline overflowed.
#[test]
fn huge_timeouts_in_a_profile_route_like_long_ones() {
    let config = r#"{"profiles":{"default":{"routingStrategy":"pd","routingConfig":{"pd":{
        "prefillRequestTimeout":1e20,"decodeAbortTimeout":1e20,
        "decodeFirstResponseTimeout":1e18,"decodeResponseTimeout":1e300,
        "decodeStreamIdleTimeout":1e18}}}}}"#;
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .config(config)
        .pod("d0", "decode", "g0");
    let stack = Stack::start(fleet);
    // More requests than workers, each on its own connection, streamed and not.
    for i in 0..6 {
        let stream = i % 2 == 1;
        let body =
            json!({"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": stream});
        let r = http::post_json(&stack.gateway, "/v1/completions", &[], &body);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(r.header("prefill-target-pod"), Some("p0"));
        if stream {
            assert!(r.text().contains("[DONE]"), "a whole stream: {}", r.text());
        }
    }
}

/// A PD pair that single-pod strategies must never pick, and three standard pods.
fn pair_and_three_standard_pods() -> Fleet {
    Fleet::pair_and_three_standard(MODEL)
}

/// `session-affinity` in real Envoy (two workers): a conversation key keeps every turn on one
/// standard pod, whichever worker takes the connection; `x-session-id` names that pod in
/// base64 and, sent back, wins over the key; prefill/decode pods never take a turn.
#[test]
fn session_affinity_keeps_a_conversation_on_one_standard_pod() {
    use base64::Engine as _;
    let stack = Stack::start(pair_and_three_standard_pods());
    let send = |headers: &[(&str, &str)]| {
        let body = json!({"model": MODEL, "prompt": "hello again", "max_tokens": 2});
        let mut all = vec![("routing-strategy", "session-affinity")];
        all.extend_from_slice(headers);
        let r = http::post_json(&stack.gateway, "/v1/completions", &all, &body);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("routing-strategy"), Some("session-affinity"));
        assert_eq!(r.header("prefill-target-pod"), None, "{:?}", r.headers);
        let pod = r.header("target-pod").expect("target-pod").to_string();
        let id = r.header("x-session-id").expect("x-session-id").to_string();
        let address = base64::engine::general_purpose::STANDARD
            .decode(&id)
            .expect("base64");
        assert_eq!(
            Some(std::str::from_utf8(&address).expect("text")),
            r.header("target-pod-ip"),
            "x-session-id names the pod that answered"
        );
        (pod, id)
    };

    let mut by_key = BTreeMap::new();
    for k in 0..24 {
        let key = format!("conversation-{k}");
        let (first, _) = send(&[("x-aibrix-session-key", &key)]);
        assert!(first.starts_with('c'), "{key} went to {first}");
        for turn in 0..3 {
            let (pod, _) = send(&[("x-aibrix-session-key", &key)]);
            assert_eq!(pod, first, "{key}, turn {turn}");
        }
        by_key.insert(key, first);
    }
    let pods: std::collections::BTreeSet<_> = by_key.values().collect();
    assert!(pods.len() >= 2, "keys spread over the pods: {by_key:?}");

    // A session id from an earlier answer wins over the key.
    let (c_key, c_pod) = by_key.iter().next().expect("a key");
    let other = by_key
        .iter()
        .find(|(_, p)| *p != c_pod)
        .map(|(k, _)| k.clone())
        .expect("a key on another pod");
    let (_, id) = send(&[("x-aibrix-session-key", c_key)]);
    let (pod, _) = send(&[("x-session-id", &id), ("x-aibrix-session-key", &other)]);
    assert_eq!(&pod, c_pod);
    // Without either header any standard pod serves, and the answer still says which.
    let (pod, _) = send(&[]);
    assert!(pod.starts_with('c'), "{pod}");

    let entries = stack.sim_requests();
    assert_eq!(entries.len(), 24 * 4 + 3, "one leg per request");
    assert!(entries
        .iter()
        .all(|e| e["pod"].as_str().is_some_and(|p| p.starts_with('c'))));
    let count =
        |result: &str| stack.metric("pd_router_session_affinity_total", &[("result", result)]);
    assert_eq!(count("session_key"), (24 * 4 + 1) as f64);
    assert_eq!(count("session_id"), 1.0);
    assert_eq!(count("random"), 1.0);
}

/// A weighted strategy list is blended, as AIBrix scores one: every request weighs all the
/// listed signals, rather than drawing one strategy per request. The value is echoed as
/// configured; a malformed list is refused before any pod is chosen.
#[test]
fn a_weighted_strategy_list_scores_every_signal_for_each_request() {
    let fleet = Fleet::new(MODEL)
        .combined("c0")
        .combined("c1")
        .combined("c2");
    let stack = Stack::start(fleet);
    let send = |strategy: &str| {
        let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2});
        http::post_json(
            &stack.gateway,
            "/v1/completions",
            &[
                ("routing-strategy", strategy),
                ("x-aibrix-session-key", "chat-7"),
            ],
            &body,
        )
    };
    // Affinity weighs 3/4 and the load 1/4: one pod takes every turn. A draw per request
    // would hand about a quarter of them to least-request.
    let label = "session-affinity:3, least-request";
    let mut pods = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let r = send(label);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("routing-strategy"), Some(label));
        assert!(r.header("x-session-id").is_some(), "{:?}", r.headers);
        pods.insert(r.header("target-pod").expect("target-pod").to_string());
    }
    assert_eq!(pods.len(), 1, "{pods:?}");
    assert_eq!(
        stack.metric(
            "pd_router_session_affinity_total",
            &[("result", "session_key")]
        ),
        20.0
    );

    for bad in [
        "least-request,,random",
        "random:0,least-request:0",
        "least-request:2:1",
    ] {
        let r = send(bad);
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert_eq!(r.header("x-error-routing"), Some("true"));
        assert!(r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("incorrect routing strategy")));
    }
    assert_eq!(stack.sim_requests().len(), 20, "refusals send nothing");
}

/// Single-pod `prefix-cache` in real Envoy (two workers): a prompt goes back to the standard
/// pod that served it before, whichever worker takes it, because each pick is recorded in the
/// prefix index and shared between workers; another prompt spreads by load.
#[test]
fn single_pod_prefix_cache_returns_a_prompt_to_the_pod_that_holds_it() {
    let stack = Stack::start(pair_and_three_standard_pods());
    let send = |prompt: &str| {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
        let r = http::post_json(
            &stack.gateway,
            "/v1/completions",
            &[("routing-strategy", "prefix-cache")],
            &body,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("routing-strategy"), Some("prefix-cache"));
        r.header("target-pod").expect("target-pod").to_string()
    };
    // Twelve long prompts, each sent four times in a row. The first send of each has no
    // match anywhere and idle pods tie: all twelve on one pod has odds of 3 in 531 441.
    for k in 0..12 {
        let prompt = format!("document {k}: ") + &"lorem ipsum dolor sit amet ".repeat(100);
        let first = send(&prompt);
        assert!(first.starts_with('c'), "{first}");
        for turn in 1..4 {
            assert_eq!(send(&prompt), first, "prompt {k}, turn {turn}");
        }
    }
    let entries = stack.sim_requests();
    let pods: std::collections::BTreeSet<_> =
        entries.iter().filter_map(|e| e["pod"].as_str()).collect();
    assert!(pods.len() >= 2, "first sends spread by load: {pods:?}");
    assert!(pods.iter().all(|p| p.starts_with('c')), "{pods:?}");
}

/// Sends `n` completions with `strategy`, one after another, each held at its pod (every
/// standard pod of [`aibrix_load_strategies_read_the_shared_running_counts`] hangs before
/// answering) until the test saw it arrive, so each selection sees every
/// earlier request running. Returns the pods in the order they were chosen; the requests
/// are released and must all succeed.
fn held_picks(stack: &Stack, strategy: &str, n: usize) -> Vec<String> {
    for pod in ["c0", "c1", "new"] {
        stack.arm_fault(json!({"pod": pod, "kind": "hang_before_headers"}));
    }
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let gateway = stack.gateway.clone();
            let strategy = strategy.to_string();
            let handle = std::thread::spawn(move || {
                let body = json!({"model": MODEL, "prompt": format!("held {i}"), "max_tokens": 2});
                http::post_json(
                    &gateway,
                    "/v1/completions",
                    &[("routing-strategy", &strategy)],
                    &body,
                )
            });
            stack.wait_for_legs("full", i + 1);
            handle
        })
        .collect();
    let pods: Vec<String> = stack
        .wait_for_legs("full", n)
        .iter()
        .map(|e| e["pod"].as_str().unwrap_or_default().to_string())
        .collect();
    stack.clear_faults();
    for h in handles {
        let r = h.join().expect("client thread");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("routing-strategy"), Some(strategy));
    }
    stack.wait_ledger_zero();
    stack.clear_sim_requests();
    pods
}

/// AIBrix's other load strategies in real Envoy (two workers), each reading the running
/// requests both workers hold:
/// - `least-request-top-k` eases in a pod that has just become ready: the fleet file's Ready
///   `lastTransitionTime` travels through pd-control to the filter, which charges the pod
///   the warm pods' load (epsilon 0 here, so only the least effective load is eligible).
///   Plain least-request would give it a third of the requests;
/// - `power-of-two` never sends a request to the pod that is busiest of all;
/// - `load-balance` answers from a standard pod.
#[test]
fn aibrix_load_strategies_read_the_shared_running_counts() {
    let fleet = Fleet::new(MODEL)
        .pod("p0", "prefill", "g0")
        .pod("d0", "decode", "g0")
        .combined("c0")
        .combined("c1")
        .combined("new")
        .ready_since("2026-01-01T00:00:00Z");
    let env = [
        ("AIBRIX_ROUTING_LEAST_REQUEST_TOP_K_EPSILON", "0"),
        // A century: the pod stays at the start of its ramp whatever today's date.
        ("AIBRIX_ROUTING_LEAST_REQUEST_TOP_K_RAMP_WINDOW", "876000h"),
    ];
    let stack = Stack::start_with(fleet, 2, &env);

    let picks = held_picks(&stack, "least-request-top-k", 12);
    let count = |pod: &str| picks.iter().filter(|p| *p == pod).count();
    assert!(count("new") <= 1, "the ramping pod is eased in: {picks:?}");
    assert!(count("c0") >= 5 && count("c1") >= 5, "{picks:?}");

    let picks = held_picks(&stack, "power-of-two", 12);
    let mut running: BTreeMap<&str, usize> = ["c0", "c1", "new"].map(|p| (p, 0)).into();
    for pod in &picks {
        let mine = running[pod.as_str()];
        let others = running
            .iter()
            .filter(|(p, _)| **p != pod.as_str())
            .map(|(_, n)| *n)
            .max()
            .unwrap_or(0);
        assert!(
            mine <= others,
            "{pod} was the busiest pod of all ({running:?}) and still won: {picks:?}"
        );
        *running.get_mut(pod.as_str()).expect("a standard pod") += 1;
    }

    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 2});
    let r = http::post_json(
        &stack.gateway,
        "/v1/completions",
        &[("routing-strategy", "load-balance")],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("target-pod")
        .is_some_and(|p| p.starts_with('c') || p == "new"));
}

/// `vtc-basic` in real Envoy: users are placed on the line of standard pods by their recent
/// tokens. On one connection (one worker, whose counters these are), a user sending long
/// prompts moves to the far end of the line, away from a user sending short ones, who keeps
/// the first pod; the explanation gives each user's place; requests without a `user` are drawn
/// at random; PD pods never serve.
#[test]
fn vtc_basic_keeps_a_heavy_user_apart_from_a_light_one() {
    let stack = Stack::start_explained(pair_and_three_standard_pods());
    let mut conn = http::KeepAlive::connect(&stack.gateway).expect("connect");
    // The pod and the explanation of one request.
    let mut send = |user: Option<&str>, prompt: &str| {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
        let mut headers = vec![("routing-strategy", "vtc-basic"), ("x-pd-explain", "1")];
        if let Some(u) = user {
            headers.push(("user", u));
        }
        let r = conn
            .post_json("/v1/completions", &headers, &body)
            .expect("answer");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("routing-strategy"), Some("vtc-basic"));
        let pod = r.header("target-pod").expect("target-pod").to_string();
        assert!(pod.starts_with('c'), "{pod}");
        let why = r.header("x-pd-explain").unwrap_or_default().to_string();
        (pod, why)
    };
    let long = "a long retrieved passage of text ".repeat(250);
    // Alone, the heavy user sits at its total over itself: the middle of three pods.
    for _ in 0..3 {
        send(Some("heavy"), &long);
    }
    let mut light = std::collections::BTreeSet::new();
    let mut heavy = std::collections::BTreeSet::new();
    let mut why = (String::new(), String::new());
    for _ in 0..10 {
        let (pod, light_why) = send(Some("light"), "hi");
        light.insert(pod);
        let (pod, heavy_why) = send(Some("heavy"), &long);
        heavy.insert(pod);
        why = (light_why, heavy_why);
    }
    assert_eq!(light.len(), 1, "the light user keeps one pod: {light:?}");
    assert_eq!(heavy.len(), 1, "the heavy user keeps one pod: {heavy:?}");
    assert_ne!(light, heavy, "and they are not the same pod");
    // The explanation gives each user's place on the line of three pods: the light user at
    // its start, the heavy one at its end.
    assert!(
        why.0.starts_with("strategy=vtc-basic; place=0.00; pick=c"),
        "{why:?}"
    );
    assert!(
        why.1.starts_with("strategy=vtc-basic; place=2.00; pick=c"),
        "{why:?}"
    );
    // AIBrix's gauge of the bucket size: half the lightest and heaviest totals, here far
    // above its 1000-token floor.
    let bucket = stack.metric("vtc_bucket_size_active", &[("model", MODEL)]);
    assert!(bucket > 10_000.0, "vtc_bucket_size_active {bucket}");

    let anyone: std::collections::BTreeSet<_> = (0..30).map(|_| send(None, "hi").0).collect();
    assert!(anyone.len() >= 2, "no user: drawn at random, {anyone:?}");
    let entries = stack.sim_requests();
    assert_eq!(entries.len(), 3 + 20 + 30, "one leg per request");
    assert!(entries
        .iter()
        .all(|e| e["pod"].as_str().is_some_and(|p| p.starts_with('c'))));
}

/// AIBrix's `least-utilization` and `least-busy-time` in real Envoy (two workers): both are
/// served, not refused. No pod exports a busy-time ratio, so `least-busy-time` draws among
/// the standard pods as AIBrix does. With pd-sim exporting xLLM's `engine_utilization`
/// gauge, a standard pod holding two streams reports itself busier, pd-control carries the
/// gauge in the snapshot, and `least-utilization` sends nothing there.
#[test]
fn least_utilization_avoids_the_pod_whose_engine_reports_itself_busy() {
    let fleet = pair_and_three_standard_pods();
    let stack = Stack::start_full(fleet.clone(), fleet, 2, &[], &["--utilization-gauge"]);
    let send = |strategy: &str, prompt: &str| {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
        let r = http::post_json(
            &stack.gateway,
            "/v1/completions",
            &[("routing-strategy", strategy)],
            &body,
        );
        assert_eq!(r.status, 200, "{strategy}: {}", r.text());
        assert_eq!(r.header("routing-strategy"), Some(strategy));
        r.header("target-pod").expect("target-pod").to_string()
    };

    let drawn: std::collections::BTreeSet<String> = (0..12)
        .map(|i| send("least-busy-time", &format!("drawn {i}")))
        .collect();
    assert!(
        drawn.len() >= 2 && drawn.iter().all(|p| p.starts_with('c')),
        "a draw over the standard pods: {drawn:?}"
    );

    // Two streams held on c0 after their first chunk: two of its batch slots in use.
    stack.arm_fault(json!({"pod": "c0", "kind": "hang_after_chunks", "chunks": 1}));
    let c0 = stack.fleet.spec("c0").address();
    let held: Vec<_> = (0..2)
        .map(|i| {
            let c0 = c0.clone();
            std::thread::spawn(move || {
                let body = json!({"model": MODEL, "prompt": format!("held {i}"),
                                  "max_tokens": 4, "stream": true});
                http::post_json(&c0, "/v1/completions", &[], &body)
            })
        })
        .collect();
    let utilization = |snap: &serde_json::Value, pod: &str| {
        pd_wasm_tests::stack::snapshot_pods(snap)
            .find(|p| p["name"] == pod)
            .and_then(|p| p["metrics"]["engine_utilization"].as_f64())
    };
    stack.wait_snapshot_adopted(|snap| {
        let busy = utilization(snap, "c0").unwrap_or(0.0);
        let idle = utilization(snap, "c1").unwrap_or(1.0);
        (busy >= 2.0 / 256.0 && idle == 0.0)
            .then_some(())
            .ok_or_else(|| format!("c0 reports {busy}, c1 {idle}"))
    });

    let picked: Vec<String> = (0..12)
        .map(|i| send("least-utilization", &format!("placed {i}")))
        .collect();
    assert!(
        picked.iter().all(|p| p == "c1" || p == "c2"),
        "the busy engine and the PD pods take nothing: {picked:?}"
    );
    stack.clear_faults();
    for h in held {
        assert_eq!(h.join().expect("client thread").status, 200);
    }
}

/// `prefix-cache-preble` in real Envoy (two workers): a prompt more than half held goes back
/// to the pod holding it even while that pod is the busiest, whichever worker takes it; a
/// prompt sharing less than half of it goes to a less loaded pod, where `prefix-cache`'s
/// formula (which still weighs 40 % of match above two running requests) would not.
#[test]
fn preble_lets_a_long_match_decide_and_the_load_decide_the_rest() {
    let stack = Stack::start(pair_and_three_standard_pods());
    let spawn_send = |prompt: String| {
        let gateway = stack.gateway.clone();
        std::thread::spawn(move || {
            let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
            http::post_json(
                &gateway,
                "/v1/completions",
                &[("routing-strategy", "prefix-cache-preble")],
                &body,
            )
        })
    };
    let pod_of = |r: http::Response| {
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("routing-strategy"), Some("prefix-cache-preble"));
        r.header("target-pod").expect("target-pod").to_string()
    };
    let send = |prompt: &str| pod_of(spawn_send(prompt.to_string()).join().expect("client"));

    let held = "report: ".to_string() + &"lorem ipsum dolor sit amet ".repeat(100);
    let holder = send(&held);
    assert!(holder.starts_with('c'), "{holder}");
    for turn in 1..4 {
        assert_eq!(send(&held), holder, "turn {turn}");
    }

    // Two requests for the same prompt held at its pod: it is now the busiest of the three.
    stack.clear_sim_requests();
    stack.arm_fault(json!({"pod": holder, "kind": "hang_before_headers"}));
    let mut waiting: Vec<_> = (0..2).map(|_| spawn_send(held.clone())).collect();
    let legs = stack.wait_for_legs("full", 2);
    assert!(legs.iter().all(|e| e["pod"] == holder.as_str()), "{legs:?}");

    // 40 % of the prompt, then text of its own: the load decides.
    let cut = held.len() * 2 / 5;
    let partly = held[..cut].to_string() + &"consectetur adipiscing elit ".repeat(60);
    for _ in 0..4 {
        assert_ne!(
            send(&partly),
            holder,
            "the busy holder of 40 % of the prompt"
        );
    }
    // The whole prompt again: back to its holder, busy as it is.
    waiting.push(spawn_send(held.clone()));
    let legs = stack.wait_for_legs("full", 2 + 4 + 1);
    assert!(
        legs.iter().filter(|e| e["pod"] == holder.as_str()).count() == 3,
        "{legs:?}"
    );
    stack.clear_faults();
    for h in waiting {
        assert_eq!(pod_of(h.join().expect("client")), holder);
    }
}
