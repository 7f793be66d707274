//! AIBrix's rate limits as AIBrix keeps them: per user (a `user` header, the user's record and
//! one-minute RPM/TPM counters in Redis) and per model (a profile's `requestsPerSecond`),
//! through the real filter in Envoy (`--concurrency 2`), pd-control with `--redis` and a real
//! `redis-server`: admissions, refusals with AIBrix's headers, answer tokens counted against
//! the user's TPM, and what happens when the store fails. They need `redis-server` (`make test`
//! installs it): without it they fail, unless `PD_TESTS_ALLOW_SKIP=1` lets them pass as
//! skipped (with the reason printed).

use std::path::PathBuf;
use std::time::Duration;

use pd_wasm_tests::http;
use pd_wasm_tests::redis::RedisServer;
use pd_wasm_tests::stack::{eventually, Fleet, Options, Stack};
use serde_json::{json, Value};

const MODEL: &str = "limits-llm";

/// The model's config (read from its first pod): profile `metered` admits 0.01 requests per
/// second, one per 100 s window, so a second request is refused whatever the machine's pace.
/// Profile `broken` shares that window but names a decode policy no gateway knows: its
/// requests are admitted, then refused when the filter resolves their PD settings.
const METERED: &str = r#"{"profiles":{"default":{"routingConfig":{"combined":true}},"metered":{"routingConfig":{"combined":true},"requestsPerSecond":0.01},"broken":{"routingStrategy":"pd","routingConfig":{"decodeScorePolicy":"fastest"},"requestsPerSecond":0.01}}}"#;

fn fleet() -> Fleet {
    Fleet::new(MODEL)
        .combined("c-0")
        .config(METERED)
        .combined("c-1")
}

struct Store {
    redis: RedisServer,
    dir: PathBuf,
}

impl Store {
    /// A running store; `None` (the test returns, passing as skipped) only where
    /// `redis-server` cannot run and `PD_TESTS_ALLOW_SKIP=1` allows it, else the test fails
    /// (`pd_wasm_tests::redis::missing_redis`).
    fn start() -> Option<Store> {
        let dir = std::env::temp_dir().join(format!("pd-limits-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).expect("redis dir");
        let Some(redis) = RedisServer::start(&dir) else {
            let _ = std::fs::remove_dir_all(&dir);
            return None;
        };
        Some(Store { redis, dir })
    }

    /// Writes a user record as AIBrix's user API stores it.
    fn user(&self, record: Value) {
        let name = record["name"].as_str().expect("a name").to_string();
        let key = format!("aibrix-users/{name}");
        self.redis.command(&["SET", &key, &record.to_string()]);
    }

    /// A user's counter in the current window (0 when it has none).
    fn counter(&self, user: &str, kind: &str) -> u64 {
        let key = format!("aibrix:{user}_{kind}_CURRENT:60000:counter");
        self.redis
            .command(&["GET", &key])
            .map_or(0, |v| v.parse().expect("a counter"))
    }
}

impl Store {
    /// Waits until `user`'s TPM counter reads `want` (the filter reports from its ticks).
    fn wait_tpm(&self, user: &str, want: u64, within: Duration) {
        eventually(within, || {
            let counted = self.counter(user, "TPM");
            (counted == want)
                .then_some(())
                .ok_or(format!("{user}'s TPM counter reads {counted}, want {want}"))
        });
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(store: &Store, plugin_extra: &str) -> Stack {
    let url = store.redis.url();
    // One fleet: each `fleet()` picks its own loopback addresses.
    let fleet = fleet();
    Stack::start_opts(
        fleet.clone(),
        fleet,
        &Options {
            control_args: &["--redis", &url],
            plugin_extra,
            ..Options::default()
        },
    )
}

fn chat(stack: &Stack, user: Option<&str>, body: Value) -> http::Response {
    chat_in(stack, user, None, body)
}

fn chat_in(
    stack: &Stack,
    user: Option<&str>,
    profile: Option<&str>,
    body: Value,
) -> http::Response {
    let mut headers = vec![("routing-strategy", "random")];
    if let Some(user) = user {
        headers.push(("user", user));
    }
    if let Some(profile) = profile {
        headers.push(("config-profile", profile));
    }
    http::post_json(&stack.gateway, "/v1/chat/completions", &headers, &body)
}

fn question(stream: bool, include_usage: bool) -> Value {
    let mut body = json!({"model": MODEL, "max_tokens": 12, "stream": stream,
        "messages": [{"role": "user", "content": "how many tokens is this?"}]});
    if include_usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// `total_tokens` of an answer: the JSON body's, or a stream's last usage chunk's.
fn total_tokens(r: &http::Response) -> u64 {
    let text = r.text();
    let json_usage = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v["usage"]["total_tokens"].as_u64());
    json_usage
        .or_else(|| {
            text.lines()
                .rev()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                .find_map(|v| v["usage"]["total_tokens"].as_u64())
        })
        .unwrap_or_else(|| panic!("no usage in {text}"))
}

#[test]
fn a_user_is_held_to_its_rpm_and_an_unknown_user_is_refused() {
    let Some(store) = Store::start() else {
        return;
    };
    store.user(json!({"name": "alice", "rpm": 3}));
    let stack = start(&store, "");
    for n in 1..=3 {
        let r = chat(&stack, Some("alice"), question(false, false));
        assert_eq!(r.status, 200, "request {n}: {}", r.text());
        assert_eq!(r.header("x-update-rpm"), Some(n.to_string().as_str()));
    }
    let refused = chat(&stack, Some("alice"), question(false, false));
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.header("x-error-rpm-exceeded"), Some("true"));
    let error = &refused.json()["error"];
    assert_eq!(error["message"], "user: alice has exceeded RPM: 3");
    assert_eq!(error["type"], "rate_limit_error");
    // A refused request takes nothing from the window.
    assert_eq!(store.counter("alice", "RPM"), 3);

    let unknown = chat(&stack, Some("mallory"), question(false, false));
    assert_eq!(unknown.status, 500, "{}", unknown.text());
    assert_eq!(unknown.header("x-error-user"), Some("true"));
    // Requests naming no user are not checked at all.
    let anonymous = chat(&stack, None, question(false, false));
    assert_eq!(anonymous.status, 200, "{}", anonymous.text());
    assert_eq!(anonymous.header("x-update-rpm"), None);
    assert_eq!(stack.stat("pd_router_rate_limit_checks_total"), 5);
    let rejected = |reason| stack.metric("pd_router_rejected_total", &[("reason", reason)]);
    assert_eq!(rejected("rpm_exceeded"), 1.0);
    assert_eq!(rejected("unknown_user"), 1.0);

    // The window ends (its counter expires): alice is admitted again.
    store
        .redis
        .command(&["DEL", "aibrix:alice_RPM_CURRENT:60000:counter"]);
    let again = chat(&stack, Some("alice"), question(false, false));
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(again.header("x-update-rpm"), Some("1"));

    // The store fails: the request is refused as AIBrix refuses it, not let through.
    drop(store);
    let failed = chat(&stack, Some("alice"), question(false, false));
    assert_eq!(failed.status, 500, "{}", failed.text());
    assert_eq!(failed.header("x-error-user"), Some("true"));
    assert_eq!(stack.stat("pd_router_rate_limit_unchecked_total"), 1);
    assert_eq!(rejected("user_limits_unavailable"), 1.0);
    assert_eq!(
        rejected("unknown_user"),
        1.0,
        "the store failed, the user is not unknown"
    );
    stack.wait_ledger_zero();
}

#[test]
fn answers_count_against_the_users_tpm_and_a_limited_stream_must_carry_its_usage() {
    let Some(store) = Store::start() else {
        return;
    };
    // Room for one answer's tokens, not two.
    store.user(json!({"name": "bob", "rpm": 100, "tpm": 20}));
    let stack = start(&store, "");

    let no_usage = chat(&stack, Some("bob"), question(true, false));
    assert_eq!(no_usage.status, 400, "{}", no_usage.text());
    assert_eq!(
        no_usage.header("x-error-no-stream-options-include-usage"),
        Some("include usage for stream options not set")
    );
    assert_eq!(no_usage.json()["error"]["param"], "stream_options");

    let streamed = chat(&stack, Some("bob"), question(true, true));
    assert_eq!(streamed.status, 200, "{}", streamed.text());
    let first = total_tokens(&streamed);
    assert!(first > 0 && first < 20, "the stream used {first} tokens");
    store.wait_tpm("bob", first, Duration::from_secs(10));
    let whole = chat(&stack, Some("bob"), question(false, false));
    assert_eq!(whole.status, 200, "{}", whole.text());
    let second = total_tokens(&whole);
    store.wait_tpm("bob", first + second, Duration::from_secs(10));
    assert!(first + second >= 20, "the test needs bob over 20 tokens");
    let refused = chat(&stack, Some("bob"), question(false, false));
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.header("x-error-tpm-exceeded"), Some("true"));
    assert_eq!(
        refused.json()["error"]["message"],
        "user: bob has exceeded TPM: 20"
    );
    assert_eq!(
        stack.stat("pd_router_user_tokens_reported_total"),
        first + second
    );
    assert_eq!(
        stack.filter_stat("pd_router_user_tokens_unreported_total"),
        Some(0)
    );
    let rejected = |reason| stack.metric("pd_router_rejected_total", &[("reason", reason)]);
    assert_eq!(rejected("stream_usage_required"), 1.0);
    assert_eq!(rejected("tpm_exceeded"), 1.0);
    stack.wait_ledger_zero();
}

/// `/v1/messages/count_tokens` generates nothing: a limited user's count takes no request of
/// its limits and its `input_tokens` are not charged to its TPM (clients that count before
/// every message were charged their prompts twice).
#[test]
fn a_token_count_is_no_request_and_no_usage_of_the_user() {
    let Some(store) = Store::start() else {
        return;
    };
    store.user(json!({"name": "cara", "rpm": 100, "tpm": 100000}));
    let stack = start(&store, "");
    let count = json!({"model": MODEL,
        "messages": [{"role": "user", "content": "how many tokens is this prompt, roughly?"}]});
    let counted = http::post_json(
        &stack.gateway,
        "/v1/messages/count_tokens",
        &[("user", "cara")],
        &count,
    );
    assert_eq!(counted.status, 200, "{}", counted.text());
    assert!(counted.json()["input_tokens"].as_u64().unwrap_or(0) > 0);
    assert_eq!(
        stack.filter_stat("pd_router_rate_limit_checks_total"),
        Some(0)
    );

    let asked = chat(&stack, Some("cara"), question(false, false));
    assert_eq!(asked.status, 200, "{}", asked.text());
    assert_eq!(stack.stat("pd_router_rate_limit_checks_total"), 1);
    // The count went first: had it been charged, the counter would read more than the chat.
    store.wait_tpm("cara", total_tokens(&asked), Duration::from_secs(10));
    assert_eq!(store.counter("cara", "RPM"), 1);
    stack.wait_ledger_zero();
}

/// A token report pd-control could not add (its Redis holding every write, as a stalled or
/// failing-over server does) goes again on the next ticks, and counts once Redis takes
/// writes again: the answer's tokens are not lost to a short store failure.
#[test]
fn a_token_report_that_failed_is_sent_again_until_it_counts() {
    let Some(store) = Store::start() else {
        return;
    };
    store.user(json!({"name": "erin", "rpm": 100, "tpm": 100000}));
    let stack = start(&store, "");
    // Hold erin's request at its pod, admitted, while Redis stops taking writes.
    for pod in ["c-0", "c-1"] {
        stack.arm_fault(json!({"pod": pod, "kind": "hang_before_headers"}));
    }
    let gateway = stack.gateway.clone();
    let client = std::thread::spawn(move || {
        let headers = [("routing-strategy", "random"), ("user", "erin")];
        http::post_json(
            &gateway,
            "/v1/chat/completions",
            &headers,
            &question(false, false),
        )
    });
    stack.wait_for_legs("full", 1);
    // Writes held 8 s: every report in that span times out in pd-control (503).
    store.redis.command(&["CLIENT", "PAUSE", "8000", "WRITE"]);
    stack.clear_faults();
    let answer = client.join().expect("client thread");
    assert_eq!(answer.status, 200, "{}", answer.text());
    let tokens = total_tokens(&answer);
    // Refused, then sent again: at least two failed attempts, nothing given up.
    eventually(Duration::from_secs(30), || {
        let failures = stack.stat("pd_router_user_token_report_failures_total");
        (failures >= 2)
            .then_some(())
            .ok_or(format!("{failures} failed token reports so far"))
    });
    store.wait_tpm("erin", tokens, Duration::from_secs(30));
    eventually(Duration::from_secs(10), || {
        let reported = stack.stat("pd_router_user_tokens_reported_total");
        (reported == tokens)
            .then_some(())
            .ok_or(format!("{reported} tokens reported of {tokens}"))
    });
    assert_eq!(
        stack.filter_stat("pd_router_user_tokens_unreported_total"),
        Some(0)
    );
    stack.wait_ledger_zero();
}

/// Without Redis on pd-control no limit is checked, a model's rate included: a request of a
/// profile with `requestsPerSecond` makes no admission call, so it is served while pd-control
/// is down (it failed with 500 `x-error-user`, waiting on a call whose answer could only be
/// "limits off").
#[test]
fn without_limits_a_models_rate_asks_nothing() {
    let mut stack = Stack::start(fleet());
    let metered = [
        ("routing-strategy", "random"),
        ("config-profile", "metered"),
    ];
    let gateway = stack.gateway.clone();
    let ask = || {
        http::post_json(
            &gateway,
            "/v1/chat/completions",
            &metered,
            &question(false, false),
        )
    };
    for _ in 0..3 {
        let r = ask();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    stack.kill("pd-control");
    let r = ask();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        stack.filter_stat("pd_router_rate_limit_checks_total"),
        Some(0)
    );
}

/// pd-control down (a restart: one replica, every rollout) leaves the limits unchecked, not
/// the service down: a limited user is admitted while no pd-control answers (counted as
/// unchecked), and held to the limit again once it is back. With
/// `rate_limits_fail_open_unreachable: false` such a request is refused (500 `x-error-user`).
#[test]
fn a_pd_control_restart_admits_limited_users_unchecked_unless_told_otherwise() {
    let Some(store) = Store::start() else {
        return;
    };
    store.user(json!({"name": "dave", "rpm": 1}));
    for fail_open in [true, false] {
        let extra = if fail_open {
            ""
        } else {
            r#""rate_limits_fail_open_unreachable":false"#
        };
        let mut stack = start(&store, extra);
        store
            .redis
            .command(&["DEL", "aibrix:dave_RPM_CURRENT:60000:counter"]);
        let first = chat(&stack, Some("dave"), question(false, false));
        assert_eq!(first.status, 200, "{}", first.text());
        let over = chat(&stack, Some("dave"), question(false, false));
        assert_eq!(over.status, 429, "{}", over.text());
        stack.kill("pd-control");
        let down = chat(&stack, Some("dave"), question(false, false));
        if fail_open {
            assert_eq!(down.status, 200, "{}", down.text());
            assert_eq!(down.header("x-update-rpm"), None, "not counted anywhere");
        } else {
            assert_eq!(down.status, 500, "{}", down.text());
            assert_eq!(down.header("x-error-user"), Some("true"));
        }
        assert_eq!(stack.stat("pd_router_rate_limit_unchecked_total"), 1);
        stack.wait_ledger_zero();
    }
}

#[test]
fn a_models_request_rate_is_held_to_its_profile() {
    let Some(store) = Store::start() else {
        return;
    };
    store.user(json!({"name": "erin", "rpm": 10}));
    let stack = start(&store, "");
    let counter = "aibrix_model:limits-llm_MODEL_RPS_CURRENT:100000:counter";
    let first = chat_in(&stack, None, Some("metered"), question(false, false));
    assert_eq!(first.status, 200, "{}", first.text());
    let refused = chat_in(&stack, None, Some("metered"), question(false, false));
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.header("x-error-model-rps-exceeded"), Some("true"));
    let error = &refused.json()["error"];
    assert_eq!(error["message"], "model: limits-llm has exceeded RPS: 0.01");
    assert_eq!(error["code"], "rate_limit_exceeded");
    // A refusal gives its count back: the window holds the one admitted request.
    assert_eq!(store.redis.command(&["GET", counter]).as_deref(), Some("1"));
    // The profile limits the rate, not the model: its default profile is not metered.
    let other = chat_in(&stack, None, None, question(false, false));
    assert_eq!(other.status, 200, "{}", other.text());
    // A user admitted by its own limits is still held to the model's rate; its request counts
    // against its RPM, as in AIBrix, where the user is checked first.
    let user = chat_in(
        &stack,
        Some("erin"),
        Some("metered"),
        question(false, false),
    );
    assert_eq!(user.status, 429, "{}", user.text());
    assert_eq!(user.header("x-error-model-rps-exceeded"), Some("true"));
    assert_eq!(store.counter("erin", "RPM"), 1);
    assert_eq!(stack.stat("pd_router_rate_limit_checks_total"), 3);
    let rejected = stack.metric(
        "pd_router_rejected_total",
        &[("reason", "model_rps_exceeded")],
    );
    assert_eq!(rejected, 2.0);
    stack.wait_ledger_zero();
}

/// AIBrix does not charge a model's rate for a request it could not route: the filter gives
/// the admitted request back to the window that counted it, and the next request is admitted.
#[test]
fn a_request_refused_after_its_admission_gives_its_model_count_back() {
    let Some(store) = Store::start() else {
        return;
    };
    let stack = start(&store, "");
    let counter = "aibrix_model:limits-llm_MODEL_RPS_CURRENT:100000:counter";
    let headers = [("routing-strategy", "pd"), ("config-profile", "broken")];
    let path = "/v1/chat/completions";
    let refused = http::post_json(&stack.gateway, path, &headers, &question(false, false));
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(
        refused.json()["error"]["message"],
        "error on selecting target pod"
    );
    assert_eq!(stack.stat("pd_router_rate_limit_checks_total"), 1);
    eventually(Duration::from_secs(10), || {
        let count = store.redis.command(&["GET", counter]);
        (count.as_deref() == Some("0"))
            .then_some(())
            .ok_or(format!("the model's counter reads {count:?}, want 0"))
    });
    let sent = [("result", "sent")];
    eventually(Duration::from_secs(10), || {
        let n = stack.metric("pd_router_model_rps_refunds_total", &sent);
        (n == 1.0).then_some(()).ok_or(format!("{n} refunds sent"))
    });
    // The window's one request is free again: admitted, and the next refused.
    let first = chat_in(&stack, None, Some("metered"), question(false, false));
    assert_eq!(first.status, 200, "{}", first.text());
    let over = chat_in(&stack, None, Some("metered"), question(false, false));
    assert_eq!(over.status, 429, "{}", over.text());
    assert_eq!(store.redis.command(&["GET", counter]).as_deref(), Some("1"));
    // A refusal over the rate was never counted: nothing more is given back.
    let unsent = [("result", "unsent")];
    assert_eq!(
        stack.metric("pd_router_model_rps_refunds_total", &unsent),
        0.0
    );
    assert_eq!(
        stack.metric("pd_router_model_rps_refunds_total", &sent),
        1.0
    );
    stack.wait_ledger_zero();
}

#[test]
fn a_failing_store_lets_requests_through_when_the_plugin_fails_open() {
    let Some(store) = Store::start() else {
        return;
    };
    store.user(json!({"name": "carol", "rpm": 1}));
    let stack = start(&store, r#""rate_limits_fail_open":true"#);
    assert_eq!(
        chat(&stack, Some("carol"), question(false, false)).status,
        200
    );
    let over = chat(&stack, Some("carol"), question(false, false));
    assert_eq!(
        over.status, 429,
        "failing open is no way past a working store"
    );
    drop(store);
    let through = chat(&stack, Some("carol"), question(false, false));
    assert_eq!(through.status, 200, "{}", through.text());
    assert_eq!(through.header("x-update-rpm"), None);
    assert_eq!(stack.stat("pd_router_rate_limit_unchecked_total"), 1);
    let rejected = |reason| stack.metric("pd_router_rejected_total", &[("reason", reason)]);
    assert_eq!(rejected("rpm_exceeded"), 1.0);
    assert_eq!(
        rejected("user_limits_unavailable"),
        0.0,
        "let through, not refused"
    );
}

#[test]
fn without_a_user_store_the_user_header_changes_nothing() {
    let stack = Stack::start(fleet());
    let r = chat(&stack, Some("anyone"), question(true, false));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        stack.filter_stat("pd_router_rate_limit_checks_total"),
        Some(0)
    );
}

/// Not a test: what waiting for the admission adds to a request, printed (p50/p90/p99 of
/// 1000 sequential keep-alive requests naming a user against 1000 naming none, three
/// rounds). Run with release binaries:
/// `cargo build --release -p pd-control -p pd-sim && PD_BIN_DIR=$PWD/target/release
/// cargo test -p pd-wasm-tests --test e2e_rate_limits admission_cost -- --ignored --nocapture`
#[test]
#[ignore = "a measurement; see docs/BENCHMARKS.md"]
fn admission_cost() {
    let Some(store) = Store::start() else {
        return;
    };
    store.user(json!({"name": "dave", "rpm": 1_000_000, "tpm": 1_000_000_000}));
    let fleet = Fleet::new(MODEL).combined("c-0");
    let url = store.redis.url();
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet,
        &Options {
            control_args: &["--redis", &url],
            ..Options::default()
        },
    );
    let body = json!({"model": MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}]});
    let mut client = http::KeepAlive::connect(&stack.gateway).expect("connect");
    let mut run = |user: bool, n: usize| {
        let mut micros = Vec::with_capacity(n);
        for _ in 0..n {
            let mut headers = vec![("routing-strategy", "random")];
            if user {
                headers.push(("user", "dave"));
            }
            let start = std::time::Instant::now();
            let r = client
                .post_json("/v1/chat/completions", &headers, &body)
                .expect("answer");
            assert_eq!(r.status, 200, "{}", r.text());
            micros.push(start.elapsed().as_micros());
        }
        micros.sort_unstable();
        [n / 2, n * 9 / 10, n * 99 / 100].map(|i| micros[i])
    };
    run(false, 200);
    run(true, 200);
    for round in 0..3 {
        let (none, named) = (run(false, 1000), run(true, 1000));
        eprintln!("round {round}: p50/p90/p99 µs without a user {none:?}, with one {named:?}");
    }
}

/// pd-control counting a request after the filter stopped waiting for it (Redis held writes
/// longer than `rate_limits_timeout_ms`, shorter than pd-control's own round-trip bound):
/// the client gets 500 and the filter withdraws the admission (`/v1/limits/cancel`, its
/// answer unread), so the user's window keeps its request, whichever of the count and the
/// withdrawal Redis runs first. Without the withdrawal the late count stood: a request that
/// never ran used one of the user's requests.
#[test]
fn an_admission_counted_after_the_filter_gave_up_is_given_back() {
    let Some(store) = Store::start() else {
        return;
    };
    store.user(json!({"name": "dave", "rpm": 5}));
    let stack = start(&store, r#""rate_limits_timeout_ms":40"#);
    // Writes (the counter script, then the withdrawal's) wait 180 ms: past the filter's
    // 40 ms, within pd-control's 250 ms round trip, so the script runs and counts late.
    store.redis.command(&["CLIENT", "PAUSE", "180", "WRITE"]);
    let refused = chat(&stack, Some("dave"), question(false, false));
    assert_eq!(refused.status, 500, "{}", refused.text());
    assert_eq!(refused.header("x-error-user"), Some("true"));
    assert_eq!(
        stack.metric(
            "pd_router_rate_limit_withdrawals_total",
            &[("result", "sent")]
        ),
        1.0,
        "the filter withdrew the admission as it refused the request"
    );
    // pd-control finished the admission (it counted it, or found it withdrawn).
    eventually(Duration::from_secs(10), || {
        let checks = stack.control_metric("pd_control_user_limit_checks_total");
        (checks >= 1.0)
            .then_some(())
            .ok_or(format!("{checks} admissions finished"))
    });
    eventually(Duration::from_secs(10), || {
        let rpm = store.counter("dave", "RPM");
        (rpm == 0).then_some(()).ok_or(format!(
            "dave's RPM counter reads {rpm}: the late count stood"
        ))
    });
    // Counted once the withdrawal's script answered, which may follow the give-back.
    eventually(Duration::from_secs(10), || {
        let cancels = stack.control_metric("pd_control_admission_cancels_total");
        (cancels == 1.0)
            .then_some(())
            .ok_or(format!("{cancels} withdrawals counted, not 1"))
    });
}
