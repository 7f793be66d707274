//! Per-user limits and per-model rates against a real `redis-server`: AIBrix's user records
//! and counter keys, the fixed windows, the take-back of a refused model request, the HTTP
//! answers the filter reads, the snapshot flag, the metrics, and a Redis outage. Turned off,
//! every check answers `disabled`.

use std::path::{Path, PathBuf};

use pd_control::proto;
use prost::Message;
use redis::AsyncCommands;
use serde_json::{json, Value};

mod common;
use common::redis::{free_port, Redis};
use common::{eventually, metric};

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

/// An empty fleet: the limits need no pods.
fn fleet(dir: &Path) -> PathBuf {
    let path = dir.join("fleet.yaml");
    std::fs::write(&path, "apiVersion: v1\nkind: List\nitems: []\n").expect("fleet");
    path
}

async fn start(
    fleet: &Path,
    redis: Option<String>,
    no_user_limits: bool,
) -> (pd_control::Service, String) {
    let mut config = pd_control::Config::new(fleet, "127.0.0.1:0".parse().expect("addr"));
    config.redis = redis;
    config.no_user_limits = no_user_limits;
    let service = pd_control::start(config).await.expect("pd-control starts");
    let base = format!("http://{}", service.local_addr());
    (service, base)
}

/// `POST /v1/limits/admit` of the JSON `body`: the JSON answer (status 200 and type checked).
async fn admit_body(base: &str, body: &Value) -> Value {
    limits_call(base, "/v1/limits/admit", body).await
}

/// `POST <path>` of the JSON `body`: the JSON answer (status 200 and type checked).
async fn limits_call(base: &str, path: &str, body: &Value) -> Value {
    let resp = client()
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("admit sent");
    assert_eq!(resp.status(), 200, "admit {body}");
    let content_type = resp.headers().get("content-type").cloned();
    assert_eq!(
        content_type.as_ref().and_then(|v| v.to_str().ok()),
        Some("application/json")
    );
    let body = resp.bytes().await.expect("answer body");
    serde_json::from_slice(&body).expect("JSON answer")
}

/// The admission of a request of `user` alone.
async fn admit(base: &str, user: &str) -> Value {
    admit_body(base, &json!({ "user": user })).await
}

/// The body asking for `model`'s rate, `limit` requests per `window_ms`.
fn model_body(model: &str, limit: i64, window_ms: u64) -> Value {
    json!({"model": model, "rps_limit": limit, "rps_window_ms": window_ms})
}

/// The body asking for `user`'s limits and `model`'s rate.
fn both_body(user: &str, model: &str, limit: i64, window_ms: u64) -> Value {
    let mut body = model_body(model, limit, window_ms);
    body["user"] = user.into();
    body
}

/// AIBrix's key of `model`'s request counter for a `window_ms` window.
fn model_key(model: &str, window_ms: u64) -> String {
    format!("aibrix_model:{model}_MODEL_RPS_CURRENT:{window_ms}:counter")
}

/// `POST` of raw `body` to `path`: status and text.
async fn post(base: &str, path: &str, body: Vec<u8>) -> (u16, String) {
    let resp = client()
        .post(format!("{base}{path}"))
        .body(body)
        .send()
        .await
        .expect("sent");
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("body"))
}

/// `POST /v1/limits/admit` of a body the contract does not allow: 400 with a text body.
async fn refused_body(base: &str, body: Vec<u8>) {
    let shown = String::from_utf8_lossy(&body).into_owned();
    let (status, text) = post(base, "/v1/limits/admit", body).await;
    assert_eq!(status, 400, "{shown}: {text}");
    assert!(!text.is_empty(), "{shown}");
}

async fn usage(base: &str, body: Value) -> u16 {
    post(base, "/v1/limits/usage", body.to_string().into_bytes())
        .await
        .0
}

async fn snapshot(base: &str) -> proto::Snapshot {
    let resp = client()
        .get(format!("{base}/v1/snapshot"))
        .send()
        .await
        .expect("snapshot");
    assert_eq!(resp.status(), 200);
    proto::Snapshot::decode(resp.bytes().await.expect("body")).expect("snapshot decodes")
}

async fn checks(base: &str, outcome: &str) -> f64 {
    metric(
        base,
        &format!("pd_control_user_limit_checks_total{{outcome=\"{outcome}\"}}"),
    )
    .await
}

/// A `redis-server` accepting connections, and the test's own connection to it; `None` (the
/// test returns as skipped) only where the binary cannot run and `PD_TESTS_ALLOW_SKIP=1`
/// allows it, else the test fails (`common::redis::missing_redis`).
async fn store(dir: &Path) -> Option<(Redis, redis::aio::MultiplexedConnection)> {
    let redis = Redis::start_ready(dir).await?;
    let db = redis.connection().await;
    Some((redis, db))
}

/// Writes user records (`aibrix-users/<name>` → JSON), as AIBrix's user API stores them.
async fn seed(db: &mut redis::aio::MultiplexedConnection, records: &[(&str, &str)]) {
    for (key, record) in records {
        let _: () = db.set(*key, *record).await.expect("seed");
    }
}

/// [`store`] holding one user record: alice, 5 requests a minute (the withdrawal tests').
async fn store_with_alice(dir: &Path) -> Option<(Redis, redis::aio::MultiplexedConnection)> {
    let (redis, mut db) = store(dir).await?;
    seed(
        &mut db,
        &[("aibrix-users/alice", r#"{"name":"alice","rpm":5}"#)],
    )
    .await;
    Some((redis, db))
}

const ALICE_RPM: &str = "aibrix:alice_RPM_CURRENT:60000:counter";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_count_against_aibrix_records_and_survive_a_redis_outage() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some((redis, mut db)) = store(dir.path()).await else {
        return;
    };
    seed(
        &mut db,
        &[
            ("aibrix-users/alice", r#"{"name":"alice","rpm":3,"tpm":0}"#),
            ("aibrix-users/bob", r#"{"name":"bob","rpm":0,"tpm":10}"#),
            ("aibrix-users/carol", r#"{"name":"carol","rpm":3}"#),
            ("aibrix-users/dave", r#"{"rpm":"many"}"#),
            ("aibrix-users/fred", r#"{"name":"fred","rpm":-1}"#),
            ("aibrix-users/erin", r#"{"name":"erin"}"#),
        ],
    )
    .await;
    let (_service, base) = start(&fleet(dir.path()), Some(redis.url()), false).await;

    // Limits on: the snapshot says so.
    assert!(snapshot(&base).await.user_limits);
    assert_eq!(metric(&base, "pd_control_user_limits_enabled").await, 1.0);

    // alice: 3 requests a minute (tokens default to 3 × 1000).
    let answer = admit(&base, "alice").await;
    assert_eq!(
        answer,
        json!({"outcome":"admitted","rpm":1,"rpm_limit":3,"tpm":0,"tpm_limit":3000,
               "model_rps":null,"rps_limit":null})
    );
    let pttl: i64 = db.pttl(ALICE_RPM).await.expect("pttl");
    assert!(
        pttl > 0 && pttl <= 60_000,
        "window set at the first write: {pttl}"
    );
    // Shorten the window by hand: a check that set the expiry again would lengthen it.
    let _: () = db.pexpire(ALICE_RPM, 30_000).await.expect("pexpire");
    for n in [2, 3] {
        let answer = admit(&base, "alice").await;
        assert_eq!(answer["outcome"], "admitted", "{answer}");
        assert_eq!(answer["rpm"], n);
    }
    let before: i64 = db.pttl(ALICE_RPM).await.expect("pttl");
    assert!(
        before > 0 && before <= 30_000,
        "later writes keep the window: {before}"
    );
    let refused = admit(&base, "alice").await;
    assert_eq!(
        refused,
        json!({"outcome":"rpm_exceeded","rpm":3,"rpm_limit":3})
    );
    let after: i64 = db.pttl(ALICE_RPM).await.expect("pttl");
    assert!(
        after > 0 && after <= before,
        "a refusal keeps the window: {after} after {before}"
    );
    let count: i64 = db.get(ALICE_RPM).await.expect("get");
    assert_eq!(count, 3, "a refusal is not counted");

    // carol's request counter was left at her limit without an expiry (a writer died between
    // its increment and its expiry): she is refused, and the counter now expires.
    let carol = "aibrix:carol_RPM_CURRENT:60000:counter";
    let _: () = db.set(carol, 3).await.expect("set");
    let refused = admit(&base, "carol").await;
    assert_eq!(refused["outcome"], "rpm_exceeded", "{refused}");
    let pttl: i64 = db.pttl(carol).await.expect("pttl");
    assert!(pttl > 0 && pttl <= 60_000, "{pttl}");

    assert_eq!(
        admit(&base, "nobody").await,
        json!({"outcome":"unknown_user"})
    );

    // bob: 10 tokens a minute. The tokens of his first answer use them up.
    let answer = admit(&base, "bob").await;
    assert_eq!(
        answer,
        json!({"outcome":"admitted","rpm":1,"rpm_limit":100,"tpm":0,"tpm_limit":10,
               "model_rps":null,"rps_limit":null})
    );
    assert_eq!(usage(&base, json!({"bob": 12, "nobody": 0})).await, 204);
    let bob_tpm = "aibrix:bob_TPM_CURRENT:60000:counter";
    let tokens: i64 = db.get(bob_tpm).await.expect("get");
    assert_eq!(tokens, 12);
    let pttl: i64 = db.pttl(bob_tpm).await.expect("pttl");
    assert!(pttl > 0 && pttl <= 60_000, "{pttl}");
    let exists: bool = db
        .exists("aibrix:nobody_TPM_CURRENT:60000:counter")
        .await
        .expect("exists");
    assert!(!exists, "0 tokens write nothing");
    let refused = admit(&base, "bob").await;
    assert_eq!(
        refused,
        json!({"outcome":"tpm_exceeded","rpm":2,"rpm_limit":100,"tpm":12,"tpm_limit":10})
    );
    let requests: i64 = db
        .get("aibrix:bob_RPM_CURRENT:60000:counter")
        .await
        .expect("get");
    assert_eq!(requests, 2, "a refusal on tokens still counts the request");

    // dave's record is broken: a store error, not a refusal.
    let answer = admit(&base, "dave").await;
    assert_eq!(answer["outcome"], "store_error", "{answer}");
    assert_eq!(answer["stage"], "user");
    assert!(
        answer["message"]
            .as_str()
            .is_some_and(|m| m.contains("aibrix-users/dave")),
        "{answer}"
    );
    // fred's limit is negative: no count stays under it, so he is refused, as AIBrix refuses
    // him (an error here let `rate_limits_fail_open` admit him without any limit).
    let answer = admit(&base, "fred").await;
    assert_eq!(answer["outcome"], "rpm_exceeded", "{answer}");
    assert_eq!(answer["rpm_limit"], -1, "{answer}");

    // erin's request counter holds garbage: the counter script fails.
    let _: () = db
        .set("aibrix:erin_RPM_CURRENT:60000:counter", "garbage")
        .await
        .expect("set");
    let answer = admit(&base, "erin").await;
    assert_eq!(answer["outcome"], "store_error", "{answer}");
    // AIBrix's `checkRPM` read fails first: its header is `x-error-rpm-exceeded`.
    assert_eq!(answer["stage"], "rpm");
    // Her token counter too: her tokens are given up, the others' are added, and the report
    // is taken (sent again, it would fail alike and hold newer reports behind it).
    let _: () = db
        .set("aibrix:erin_TPM_CURRENT:60000:counter", "garbage")
        .await
        .expect("set");
    assert_eq!(usage(&base, json!({"erin": 5, "alice": 7})).await, 204);
    let tokens: i64 = db
        .get("aibrix:alice_TPM_CURRENT:60000:counter")
        .await
        .expect("get");
    assert_eq!(tokens, 7);

    // Bodies the contract does not allow (the raw user name of old among them).
    for bad in [
        Vec::new(),
        b"alice".to_vec(),
        b"\xff\xfe".to_vec(),
        json!({"user": ""}).to_string().into_bytes(),
        json!({ "user": "a".repeat(257) }).to_string().into_bytes(),
    ] {
        refused_body(&base, bad).await;
    }
    assert_eq!(
        admit(&base, &"a".repeat(256)).await["outcome"],
        "unknown_user"
    );
    for bad in [
        &b"nope"[..],
        b"[]",
        b"{\"bob\": -1}",
        b"{\"bob\": 1.5}",
        b"",
    ] {
        let (status, text) = post(&base, "/v1/limits/usage", bad.to_vec()).await;
        assert_eq!(status, 400, "{:?}", String::from_utf8_lossy(bad));
        assert!(!text.is_empty());
    }

    for (outcome, n) in [
        ("admitted", 4.0),
        ("rpm_exceeded", 3.0),
        ("tpm_exceeded", 1.0),
        ("unknown_user", 2.0),
        ("store_error", 2.0),
    ] {
        assert_eq!(checks(&base, outcome).await, n, "{outcome}");
    }
    assert_eq!(metric(&base, "pd_control_user_tokens_total").await, 19.0);
    // erin's script failure and her token addition; a broken record is no Redis failure.
    assert_eq!(
        metric(&base, "pd_control_user_limit_errors_total").await,
        2.0
    );

    // Redis goes away: checks answer store_error at once, usage reports 503.
    drop(db);
    drop(redis);
    let answer = admit(&base, "alice").await;
    assert_eq!(answer["outcome"], "store_error", "{answer}");
    assert_eq!(answer["stage"], "user");
    assert_eq!(usage(&base, json!({"bob": 1})).await, 503);
    assert_eq!(checks(&base, "store_error").await, 3.0);
    assert!(metric(&base, "pd_control_user_limit_errors_total").await >= 4.0);
}

/// `POST /v1/limits/usage` of `body` under report id `id`: the status.
async fn usage_as(base: &str, id: &str, body: &Value) -> u16 {
    client()
        .post(format!("{base}/v1/limits/usage"))
        .header("x-pd-report-id", id)
        .body(body.to_string())
        .send()
        .await
        .expect("sent")
        .status()
        .as_u16()
}

/// A token report the filter sends again under the same `x-pd-report-id` (its answer was lost,
/// or Redis took only some users) adds each user's tokens once: the users added the first
/// time are skipped and counted as duplicates. Without an id, or under a new one, a report
/// is always added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_sent_again_adds_each_user_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some((redis, mut db)) = store(dir.path()).await else {
        return;
    };
    let (_service, base) = start(&fleet(dir.path()), Some(redis.url()), false).await;
    let erin_tpm = "aibrix:erin_TPM_CURRENT:60000:counter";
    let alice_tpm = "aibrix:alice_TPM_CURRENT:60000:counter";
    let _: () = db.set(erin_tpm, "not a number").await.expect("set");
    let report = json!({"alice": 7, "erin": 5});
    // erin's counter cannot take it: her tokens are given up and counted as an error (sent
    // again, the report would fail alike and hold the gateway's newer reports behind it),
    // alice's are added: the report is taken.
    let errors = metric(&base, "pd_control_user_limit_errors_total").await;
    assert_eq!(usage_as(&base, "vm1-1", &report).await, 204);
    assert_eq!(
        metric(&base, "pd_control_user_limit_errors_total").await,
        errors + 1.0
    );
    let tokens = |db: &mut redis::aio::MultiplexedConnection, key: &'static str| {
        let mut db = db.clone();
        async move { db.get::<_, Option<i64>>(key).await.expect("get") }
    };
    assert_eq!(tokens(&mut db, alice_tpm).await, Some(7));
    // Sent again (its 204 lost on the way back) once erin's counter is sound: nothing is
    // added twice, and erin's given-up tokens stay given up.
    let _: () = db.del(erin_tpm).await.expect("del");
    assert_eq!(usage_as(&base, "vm1-1", &report).await, 204);
    assert_eq!(tokens(&mut db, alice_tpm).await, Some(7));
    assert_eq!(tokens(&mut db, erin_tpm).await, None);
    assert_eq!(
        metric(&base, "pd_control_user_usage_duplicates_total").await,
        2.0
    );
    // A third copy adds nothing either.
    assert_eq!(usage_as(&base, "vm1-1", &report).await, 204);
    assert_eq!(tokens(&mut db, alice_tpm).await, Some(7));
    assert_eq!(tokens(&mut db, erin_tpm).await, None);
    assert_eq!(
        metric(&base, "pd_control_user_usage_duplicates_total").await,
        4.0
    );
    // The next report, and a report without an id, are added.
    assert_eq!(usage_as(&base, "vm1-2", &report).await, 204);
    assert_eq!(usage(&base, report.clone()).await, 204);
    assert_eq!(tokens(&mut db, alice_tpm).await, Some(21));
    assert_eq!(tokens(&mut db, erin_tpm).await, Some(10));
    assert_eq!(
        metric(&base, "pd_control_user_tokens_total").await,
        7.0 + 24.0
    );
}

/// A report whose answer was lost is sent again, and may reach another pd-control replica
/// (or the same one, which had counted the lost attempt as failed): Redis itself remembers
/// which users of the report were added, so each user's tokens count once across replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_reaching_two_replicas_adds_each_user_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some((redis, mut db)) = store(dir.path()).await else {
        return;
    };
    let fleet = fleet(dir.path());
    let (_a, a) = start(&fleet, Some(redis.url()), false).await;
    let (_b, b) = start(&fleet, Some(redis.url()), false).await;
    let alice_tpm = "aibrix:alice_TPM_CURRENT:60000:counter";
    let report = json!({"alice": 7, "bob": 5});
    assert_eq!(usage_as(&a, "vm3-1", &report).await, 204);
    assert_eq!(
        usage_as(&b, "vm3-1", &report).await,
        204,
        "already added: done"
    );
    let alice: Option<i64> = db.get(alice_tpm).await.expect("get");
    assert_eq!(alice, Some(7));
    assert_eq!(
        metric(&b, "pd_control_user_usage_duplicates_total").await,
        2.0
    );
    assert_eq!(metric(&b, "pd_control_user_tokens_total").await, 0.0);
    // The marker lives as long as a report may be sent again, then goes.
    let ttl: i64 = db.pttl(limits_key("vm3-1", "alice")).await.expect("pttl");
    assert!((1..=120_000).contains(&ttl), "{ttl}");
    // Another report is added on either replica.
    assert_eq!(usage_as(&b, "vm3-2", &report).await, 204);
    let alice: Option<i64> = db.get(alice_tpm).await.expect("get");
    assert_eq!(alice, Some(14));
}

fn limits_key(id: &str, user: &str) -> String {
    pd_control::limits::usage_report_key(id, user)
}

/// A model's rate alone (AIBrix's `requestsPerSecond` as the filter sends it): increment,
/// then check, taking a refused request back so that refusals do not use up the window; the
/// window rule of the user counters; concurrent checks never over-admit; a broken counter and
/// a Redis outage answer `store_error` at stage `model`. No user counter is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_rates_are_counted_with_a_take_back() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some((redis, mut db)) = store(dir.path()).await else {
        return;
    };
    let (_service, base) = start(&fleet(dir.path()), Some(redis.url()), false).await;

    // llama: 2 requests per 30 s.
    let llama = model_key("llama", 30_000);
    let body = model_body("llama", 2, 30_000);
    assert_eq!(
        admit_body(&base, &body).await,
        json!({"outcome":"admitted","rpm":null,"rpm_limit":null,"tpm":null,"tpm_limit":null,
               "model_rps":1,"rps_limit":2})
    );
    let pttl: i64 = db.pttl(&llama).await.expect("pttl");
    assert!(
        pttl > 0 && pttl <= 30_000,
        "window set at the first write: {pttl}"
    );
    // Shorten the window by hand: a check that set the expiry again would lengthen it.
    let _: () = db.pexpire(&llama, 20_000).await.expect("pexpire");
    let answer = admit_body(&base, &body).await;
    assert_eq!(answer["outcome"], "admitted", "{answer}");
    assert_eq!(answer["model_rps"], 2);
    for _ in 0..2 {
        assert_eq!(
            admit_body(&base, &body).await,
            json!({"outcome":"model_rps_exceeded","model_rps":2,"rps_limit":2})
        );
    }
    let count: i64 = db.get(&llama).await.expect("get");
    assert_eq!(count, 2, "refusals are taken back");
    let pttl: i64 = db.pttl(&llama).await.expect("pttl");
    assert!(
        pttl > 0 && pttl <= 20_000,
        "later writes keep the window: {pttl}"
    );

    // The window is part of the key: another window is another counter.
    let answer = admit_body(&base, &model_body("llama", 2, 1000)).await;
    assert_eq!(answer["outcome"], "admitted", "{answer}");
    assert_eq!(answer["model_rps"], 1);

    // A counter at its limit without an expiry (its writer died in between) gets one.
    let orphan = model_key("orphan", 60_000);
    let _: () = db.set(&orphan, 1).await.expect("set");
    let refused = admit_body(&base, &model_body("orphan", 1, 60_000)).await;
    assert_eq!(refused["outcome"], "model_rps_exceeded", "{refused}");
    let pttl: i64 = db.pttl(&orphan).await.expect("pttl");
    assert!(pttl > 0 && pttl <= 60_000, "{pttl}");

    // Concurrent checks of one model: exactly its limit admitted, the others all taken back.
    let burst = model_body("burst", 3, 60_000);
    let answers = futures_util::future::join_all((0..12).map(|_| admit_body(&base, &burst))).await;
    let admitted = answers
        .iter()
        .filter(|a| a["outcome"] == "admitted")
        .count();
    assert_eq!(admitted, 3, "{answers:?}");
    for refused in answers.iter().filter(|a| a["outcome"] != "admitted") {
        assert_eq!(
            *refused,
            json!({"outcome":"model_rps_exceeded","model_rps":3,"rps_limit":3})
        );
    }
    let count: i64 = db.get(model_key("burst", 60_000)).await.expect("get");
    assert_eq!(count, 3);

    // A model counter holding garbage: a store error at the model stage.
    let broken = model_key("broken", 1000);
    let _: () = db.set(&broken, "garbage").await.expect("set");
    let answer = admit_body(&base, &model_body("broken", 5, 1000)).await;
    assert_eq!(answer["outcome"], "store_error", "{answer}");
    assert_eq!(answer["stage"], "model");
    assert!(
        answer["message"]
            .as_str()
            .is_some_and(|m| m.contains(&broken)),
        "{answer}"
    );

    // Model-only checks write no user counter.
    let user_keys: Vec<String> = redis::cmd("KEYS")
        .arg("aibrix:*")
        .query_async(&mut db)
        .await
        .expect("keys");
    assert!(user_keys.is_empty(), "{user_keys:?}");

    for (outcome, n) in [
        ("admitted", 6.0),
        ("model_rps_exceeded", 12.0),
        ("store_error", 1.0),
        ("rpm_exceeded", 0.0),
        ("unknown_user", 0.0),
    ] {
        assert_eq!(checks(&base, outcome).await, n, "{outcome}");
    }
    assert_eq!(
        metric(&base, "pd_control_user_limit_errors_total").await,
        1.0
    );

    // Redis goes away: a model-only check fails at the model stage, one naming a user at
    // the user record.
    drop(db);
    drop(redis);
    let answer = admit_body(&base, &body).await;
    assert_eq!(answer["outcome"], "store_error", "{answer}");
    assert_eq!(answer["stage"], "model");
    let answer = admit_body(&base, &both_body("alice", "llama", 2, 30_000)).await;
    assert_eq!(answer["outcome"], "store_error", "{answer}");
    assert_eq!(answer["stage"], "user");
    assert_eq!(checks(&base, "store_error").await, 3.0);
}

/// `POST /v1/limits/release` of `refunds` (`[(model, window_ms, age_ms)]`): status and body.
async fn release(base: &str, refunds: &[(&str, u64, u64)]) -> (u16, String) {
    let refunds: Vec<Value> = refunds
        .iter()
        .map(|(model, window, age)| json!({"model": model, "rps_window_ms": window, "age_ms": age}))
        .collect();
    let body = json!({ "refunds": refunds }).to_string().into_bytes();
    post(base, "/v1/limits/release", body).await
}

/// A request the gateway admitted and then could not route goes back to its model's
/// counter, but only to the window that counted it, and never below 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_request_given_back_lands_only_in_its_own_window() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some((redis, mut db)) = store(dir.path()).await else {
        return;
    };
    let (_service, base) = start(&fleet(dir.path()), Some(redis.url()), false).await;
    let llama = model_key("llama", 30_000);
    let body = model_body("llama", 1, 30_000);
    assert_eq!(admit_body(&base, &body).await["outcome"], "admitted");
    assert_eq!(
        admit_body(&base, &body).await["outcome"],
        "model_rps_exceeded"
    );

    // Answered just now: the window open now counted it.
    let answer = release(&base, &[("llama", 30_000, 0)]).await;
    assert_eq!(answer, (200, r#"{"given_back":1,"skipped":0}"#.into()));
    let count: i64 = db.get(&llama).await.expect("get");
    assert_eq!(count, 0);
    // Given back once: the counter is not driven below 0 by a second copy.
    let answer = release(&base, &[("llama", 30_000, 0)]).await;
    assert_eq!(answer, (200, r#"{"given_back":0,"skipped":1}"#.into()));
    assert_eq!(db.get::<_, i64>(&llama).await.expect("get"), 0);
    // The budget is back: the next request is admitted, the one after refused.
    assert_eq!(admit_body(&base, &body).await["outcome"], "admitted");
    assert_eq!(
        admit_body(&base, &body).await["outcome"],
        "model_rps_exceeded"
    );

    // A window that began 10 s ago holds a request answered 5 s ago, not one answered 15 s
    // ago (that one was counted by a window since gone).
    let _: () = db.pexpire(&llama, 20_000).await.expect("pexpire");
    let answer = release(&base, &[("llama", 30_000, 15_000)]).await;
    assert_eq!(answer, (200, r#"{"given_back":0,"skipped":1}"#.into()));
    assert_eq!(db.get::<_, i64>(&llama).await.expect("get"), 1);
    let answer = release(&base, &[("llama", 30_000, 5_000)]).await;
    assert_eq!(answer, (200, r#"{"given_back":1,"skipped":0}"#.into()));
    assert_eq!(db.get::<_, i64>(&llama).await.expect("get"), 0);
    let pttl: i64 = db.pttl(&llama).await.expect("pttl");
    assert!(pttl > 0 && pttl <= 20_000, "the window is kept: {pttl}");

    // No counter, a counter that is not one: skipped, in the same call as one given back.
    let _: () = db
        .set(model_key("broken", 1000), "garbage")
        .await
        .expect("set");
    let _: () = db.set(model_key("qwen", 1000), 3).await.expect("set");
    let _: () = db
        .pexpire(model_key("qwen", 1000), 1000)
        .await
        .expect("pexpire");
    let answer = release(
        &base,
        &[("gone", 1000, 0), ("broken", 1000, 0), ("qwen", 1000, 0)],
    )
    .await;
    assert_eq!(answer, (200, r#"{"given_back":1,"skipped":2}"#.into()));
    assert_eq!(
        db.get::<_, i64>(model_key("qwen", 1000))
            .await
            .expect("get"),
        2
    );
    let given = r#"pd_control_model_rps_refunds_total{result="given_back"}"#;
    assert_eq!(metric(&base, given).await, 3.0);
    let skipped = r#"pd_control_model_rps_refunds_total{result="skipped"}"#;
    assert_eq!(metric(&base, skipped).await, 4.0);

    // Bodies outside the contract: 400, nothing given back.
    for bad in [
        json!({"refunds": [{"model": "qwen", "rps_window_ms": 10, "age_ms": 0}]}),
        json!({"refunds": [{"model": "", "rps_window_ms": 1000, "age_ms": 0}]}),
        json!({"refund": []}),
    ] {
        let (status, text) = post(&base, "/v1/limits/release", bad.to_string().into_bytes()).await;
        assert_eq!(status, 400, "{bad}: {text}");
    }
    assert_eq!(
        db.get::<_, i64>(model_key("qwen", 1000))
            .await
            .expect("get"),
        2
    );

    // Redis gone: 503, counted as a store error.
    let errors = metric(&base, "pd_control_user_limit_errors_total").await;
    drop(db);
    drop(redis);
    let (status, text) = release(&base, &[("llama", 30_000, 0)]).await;
    assert_eq!(status, 503, "{text}");
    assert_eq!(
        metric(&base, "pd_control_user_limit_errors_total").await,
        errors + 1.0
    );
}

/// A user and a model in one admission: the user part first; a user refusal leaves the model
/// counter alone; a model refusal leaves the user's request counted (as AIBrix, which checks
/// the user at the request headers, before the model). Bodies outside the contract are 400
/// and count nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_and_model_are_checked_in_order() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some((redis, mut db)) = store(dir.path()).await else {
        return;
    };
    seed(
        &mut db,
        &[
            ("aibrix-users/alice", r#"{"name":"alice","rpm":1}"#),
            ("aibrix-users/bob", r#"{"name":"bob","tpm":10}"#),
            ("aibrix-users/carol", r#"{"name":"carol","rpm":5}"#),
        ],
    )
    .await;
    let (_service, base) = start(&fleet(dir.path()), Some(redis.url()), false).await;
    let llama = model_key("llama", 60_000);

    // Both admitted: every field filled.
    assert_eq!(
        admit_body(&base, &both_body("alice", "llama", 5, 60_000)).await,
        json!({"outcome":"admitted","rpm":1,"rpm_limit":1,"tpm":0,"tpm_limit":1000,
               "model_rps":1,"rps_limit":5})
    );

    // The user refused (requests, no record, tokens): the model counter is not touched.
    assert_eq!(
        admit_body(&base, &both_body("alice", "llama", 5, 60_000)).await,
        json!({"outcome":"rpm_exceeded","rpm":1,"rpm_limit":1})
    );
    assert_eq!(
        admit_body(&base, &both_body("nobody", "llama", 5, 60_000)).await,
        json!({"outcome":"unknown_user"})
    );
    let _: () = db
        .set("aibrix:bob_TPM_CURRENT:60000:counter", 12)
        .await
        .expect("set");
    assert_eq!(
        admit_body(&base, &both_body("bob", "llama", 5, 60_000)).await,
        json!({"outcome":"tpm_exceeded","rpm":1,"rpm_limit":100,"tpm":12,"tpm_limit":10})
    );
    let count: i64 = db.get(&llama).await.expect("get");
    assert_eq!(count, 1, "user refusals leave the model counter alone");

    // The user admitted, the model refused: the user's request stays counted, the model's
    // is taken back.
    let carol_rpm = "aibrix:carol_RPM_CURRENT:60000:counter";
    let answer = admit_body(&base, &both_body("carol", "tiny", 1, 60_000)).await;
    assert_eq!(answer["outcome"], "admitted", "{answer}");
    assert_eq!(answer["rpm"], 1);
    assert_eq!(answer["model_rps"], 1);
    assert_eq!(
        admit_body(&base, &both_body("carol", "tiny", 1, 60_000)).await,
        json!({"outcome":"model_rps_exceeded","model_rps":1,"rps_limit":1})
    );
    let requests: i64 = db.get(carol_rpm).await.expect("get");
    assert_eq!(
        requests, 2,
        "a model refusal still counts the user's request"
    );
    let tiny: i64 = db.get(model_key("tiny", 60_000)).await.expect("get");
    assert_eq!(tiny, 1);

    // The model counter holds garbage: stage model, the user's request counted.
    let _: () = db
        .set(model_key("broken", 60_000), "garbage")
        .await
        .expect("set");
    let answer = admit_body(&base, &both_body("carol", "broken", 1, 60_000)).await;
    assert_eq!(answer["outcome"], "store_error", "{answer}");
    assert_eq!(answer["stage"], "model");
    let requests: i64 = db.get(carol_rpm).await.expect("get");
    assert_eq!(requests, 3);

    // Bodies the contract does not allow: 400, and nothing counted.
    let mut bad: Vec<Vec<u8>> = [
        json!({}),
        json!({"name": "carol"}),
        json!({"user": null, "model": null}),
        json!({"model": "llama"}),
        json!({"user": "carol", "model": "llama", "rps_limit": 2}),
        json!({"user": "carol", "model": "llama", "rps_window_ms": 1000}),
        json!({"user": "carol", "rps_limit": 2, "rps_window_ms": 1000}),
        both_body("carol", "llama", 0, 60_000),
        both_body("carol", "llama", -1, 60_000),
        both_body("carol", "llama", 5, 999),
        both_body("carol", "llama", 5, 3_600_001),
        both_body("carol", "", 5, 60_000),
        both_body("carol", &"m".repeat(257), 5, 60_000),
        json!({"user": "carol", "model": "llama", "rps_limit": 1.5, "rps_window_ms": 1000}),
        json!({"user": "carol", "model": "llama", "rps_limit": "2", "rps_window_ms": 1000}),
        json!({"user": 7}),
        json!(["carol"]),
        json!("carol"),
    ]
    .iter()
    .map(|v| v.to_string().into_bytes())
    .collect();
    bad.extend([
        b"carol".to_vec(),
        b"{\"user\": \"carol\"".to_vec(),
        Vec::new(),
    ]);
    for body in bad {
        refused_body(&base, body).await;
    }
    let requests: i64 = db.get(carol_rpm).await.expect("get");
    assert_eq!(requests, 3, "a refused body counts nothing");
    let count: i64 = db.get(&llama).await.expect("get");
    assert_eq!(count, 1);

    // Unknown members are ignored.
    let mut body = both_body("carol", "llama", 5, 60_000);
    body["stream"] = true.into();
    let answer = admit_body(&base, &body).await;
    assert_eq!(answer["outcome"], "admitted", "{answer}");
    assert_eq!(answer["model_rps"], 2);

    for (outcome, n) in [
        ("admitted", 3.0),
        ("rpm_exceeded", 1.0),
        ("tpm_exceeded", 1.0),
        ("unknown_user", 1.0),
        ("model_rps_exceeded", 1.0),
        ("store_error", 1.0),
    ] {
        assert_eq!(checks(&base, outcome).await, n, "{outcome}");
    }
}

/// `--no-user-limits`, and no `--redis`: every check answers `disabled`, usage is ignored,
/// and the snapshot tells gateways not to ask.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_turned_off_answer_disabled() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fleet = fleet(dir.path());
    // Nothing listens on the port: with the limits off, nothing connects to it.
    let unused = format!("redis://127.0.0.1:{}/0", free_port());
    for (redis, off) in [(Some(unused), true), (None, false)] {
        let (service, base) = start(&fleet, redis.clone(), off).await;
        assert_eq!(admit(&base, "alice").await, json!({"outcome":"disabled"}));
        assert_eq!(
            admit_body(&base, &both_body("alice", "llama", 1, 1000)).await,
            json!({"outcome":"disabled"})
        );
        assert_eq!(
            admit_body(&base, &model_body("llama", 1, 1000)).await,
            json!({"outcome":"disabled"})
        );
        assert_eq!(usage(&base, json!({"alice": 5})).await, 204);
        assert_eq!(
            release(&base, &[("llama", 1000, 0)]).await,
            (200, r#"{"given_back":0,"skipped":0}"#.into())
        );
        assert!(!snapshot(&base).await.user_limits, "{redis:?}");
        assert_eq!(metric(&base, "pd_control_user_limits_enabled").await, 0.0);
        assert_eq!(checks(&base, "admitted").await, 0.0);
        assert_eq!(metric(&base, "pd_control_user_tokens_total").await, 0.0);
        service.shutdown().await.expect("shutdown");
    }
}

/// The pd-control binary with `--redis URL` and one environment variable set, listening on a
/// free loopback port; killed on drop.
struct Binary {
    child: std::process::Child,
    base: String,
}

impl Binary {
    fn start(fleet: &Path, redis_url: &str, env: (&str, &str)) -> Binary {
        use std::io::{BufRead, BufReader};
        use std::process::{Command, Stdio};

        let mut child = Command::new(env!("CARGO_BIN_EXE_pd-control"))
            .arg("--fleet")
            .arg(fleet)
            .args(["--listen", "127.0.0.1:0", "--redis", redis_url])
            .env(env.0, env.1)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("pd-control runs");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("stdout");
        let read = BufReader::new(stdout).read_line(&mut line);
        let base = line
            .trim()
            .strip_prefix("pd-control: listening on ")
            .map(|addr| format!("http://{addr}"));
        match (read, base) {
            (Ok(_), Some(base)) => Binary { child, base },
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("unexpected first line {line:?}");
            }
        }
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// AIBrix's `AIBRIX_DISABLE_RATE_LIMIT=true` turns the limits off in the binary, with
/// `--redis` given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_aibrix_variable_turns_limits_off() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fleet = fleet(dir.path());
    let url = format!("redis://127.0.0.1:{}/0", free_port());
    let control = Binary::start(&fleet, &url, ("AIBRIX_DISABLE_RATE_LIMIT", "TRUE"));
    let answer = admit(&control.base, "alice").await;
    let user_limits = snapshot(&control.base).await.user_limits;
    assert_eq!(answer, json!({"outcome":"disabled"}));
    assert!(!user_limits);
}

/// AIBrix's `AIBRIX_DISABLE_REDIS_USER_STORE=true`: no record is read, every named user gets
/// the default limits (100 requests and 100 000 tokens a minute), so none is unknown; the
/// counters still count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_user_store_every_user_has_the_default_limits() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some(redis) = Redis::start_ready(dir.path()).await else {
        return;
    };
    let fleet = fleet(dir.path());
    let control = Binary::start(
        &fleet,
        &redis.url(),
        ("AIBRIX_DISABLE_REDIS_USER_STORE", "true"),
    );
    let first = admit(&control.base, "nobody").await;
    let second = admit(&control.base, "nobody").await;
    assert_eq!(first["outcome"], "admitted", "{first}");
    assert_eq!(
        (&first["rpm_limit"], &first["tpm_limit"]),
        (&json!(100), &json!(100_000))
    );
    assert_eq!((&first["rpm"], &second["rpm"]), (&json!(1), &json!(2)));
}

/// The port of the redis-server at `url` (`redis://127.0.0.1:port/0`).
fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .and_then(|rest| rest.split('/').next())
        .and_then(|port| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in {url}"))
}

/// The address clients know Redis by (a Service, a DNS name), as a TCP forwarder: each new
/// connection goes to the port `target` names at the time, while connections already open stay
/// with the server they reached, as a failover that closes no client connection leaves them.
struct Forwarder {
    port: u16,
    target: std::sync::Arc<std::sync::atomic::AtomicU16>,
    task: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    async fn start(target: u16) -> Forwarder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("forwarder binds");
        let port = listener.local_addr().expect("forwarder address").port();
        let target = std::sync::Arc::new(std::sync::atomic::AtomicU16::new(target));
        let to = target.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let port = to.load(std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    if let Ok(mut outbound) =
                        tokio::net::TcpStream::connect(("127.0.0.1", port)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Forwarder { port, target, task }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// New connections go to `port` from now on.
    fn point_at(&self, port: u16) {
        self.target.store(port, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A failover that leaves client connections open (Sentinel's, a managed Redis's): the old
/// primary turns replica and refuses writes (`READONLY`) on pd-control's connection, which
/// must be dropped so that the next call reaches the new primary by the same address. Kept,
/// every counter write would fail until pd-control restarted. A refused write ran nothing, so
/// the check itself is sent again on the new connection and answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_that_leaves_connections_open_is_followed_to_the_new_primary() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (old_dir, new_dir) = (dir.path().join("old"), dir.path().join("new"));
    std::fs::create_dir_all(&old_dir).expect("dir");
    std::fs::create_dir_all(&new_dir).expect("dir");
    let Some((old, mut old_db)) = store(&old_dir).await else {
        return;
    };
    let Some((new, mut new_db)) = store(&new_dir).await else {
        return;
    };
    let record = r#"{"name":"alice","rpm":100,"tpm":1000}"#;
    seed(&mut old_db, &[("aibrix-users/alice", record)]).await;
    seed(&mut new_db, &[("aibrix-users/alice", record)]).await;
    let address = Forwarder::start(port_of(&old.url())).await;
    let (_service, base) = start(&fleet(dir.path()), Some(address.url()), false).await;
    let llama = model_body("llama", 100, 60_000);
    let llama_key = model_key("llama", 60_000);
    let tpm = "aibrix:alice_TPM_CURRENT:60000:counter";

    let answer = admit_body(&base, &llama).await;
    assert_eq!(answer["model_rps"], 1, "{answer}");
    assert_eq!(admit(&base, "alice").await["rpm"], 1);

    // The old primary turns replica (of a primary nobody runs: it keeps its data, serves
    // reads and refuses writes); the address now leads to the new primary.
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(free_port())
        .query_async(&mut old_db)
        .await
        .expect("replicaof");
    address.point_at(port_of(&new.url()));

    // A model-only check first: its script's one write is an increment whose own failures
    // (a counter that is not an integer) the script catches; a read-only server's must not be.
    let answer = admit_body(&base, &llama).await;
    assert_eq!(answer["outcome"], "admitted", "{answer}");
    assert_eq!(
        answer["model_rps"], 1,
        "counted on the new primary: {answer}"
    );
    let answer = admit(&base, "alice").await;
    assert_eq!(answer["outcome"], "admitted", "{answer}");
    assert_eq!(answer["rpm"], 1, "counted on the new primary: {answer}");
    assert_eq!(usage(&base, json!({"alice": 5})).await, 204);

    let counted: (i64, i64) = (
        new_db.get(&llama_key).await.expect("get"),
        new_db.get(tpm).await.expect("get"),
    );
    assert_eq!(counted, (1, 5));
    let left: (i64, i64) = (
        old_db.get(&llama_key).await.expect("get"),
        old_db.get(ALICE_RPM).await.expect("get"),
    );
    assert_eq!(left, (1, 1), "the old primary took no write");
    assert_eq!(checks(&base, "store_error").await, 0.0);
}

/// A Redis that holds every command (`CLIENT PAUSE`, as a hung or overloaded server): the
/// check waiting on it fails after its round trip bound, and the checks right after fail at
/// once rather than each connecting again and waiting out a bound of its own; once Redis
/// answers again, so do the checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_round_trip_times_out_checks_fail_fast_for_a_while() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some((redis, mut db)) = store(dir.path()).await else {
        return;
    };
    let (_service, base) = start(&fleet(dir.path()), Some(redis.url()), false).await;
    let llama = model_body("llama", 100, 60_000);
    let answer = admit_body(&base, &llama).await;
    assert_eq!(answer["outcome"], "admitted", "{answer}");

    // Long enough for both checks below, short enough that the test waits little after.
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1500)
        .arg("ALL")
        .query_async(&mut db)
        .await
        .expect("client pause");
    let timed_out = admit_body(&base, &llama).await;
    assert_eq!(timed_out["outcome"], "store_error", "{timed_out}");
    assert!(
        timed_out["message"]
            .as_str()
            .is_some_and(|m| m.contains("round trip timed out")),
        "{timed_out}"
    );
    // Failing fast shows in the message: "unreachable" is the back-off's answer, given
    // without a new connect; a check that waited out a round trip would say "timed out".
    // (How fast is a benchmark's business, not a timed assertion's.)
    let fast = admit_body(&base, &llama).await;
    assert_eq!(fast["outcome"], "store_error", "{fast}");
    assert!(
        fast["message"]
            .as_str()
            .is_some_and(|m| m.contains("unreachable")),
        "no new connect while backing off: {fast}"
    );

    common::eventually("checks answered again", || {
        let base = base.clone();
        let llama = llama.clone();
        async move {
            let answer = admit_body(&base, &llama).await;
            (answer["outcome"] == "admitted").then_some(())
        }
    })
    .await;
}

/// The withdrawal of admission `id` (the filter's, for a request it refused without an
/// answer): the answer, `cancelled` with what was given back.
async fn withdraw(base: &str, id: &str, mut body: Value) -> Value {
    body["id"] = id.into();
    limits_call(base, "/v1/limits/cancel", &body).await
}

/// Alice's request counter and the model counter `model_key`, as one pair.
async fn counts(db: &mut redis::aio::MultiplexedConnection, model_key: &str) -> (i64, i64) {
    (count(db, ALICE_RPM).await, count(db, model_key).await)
}

async fn count(db: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    let value: Option<i64> = db.get(key).await.expect("get");
    value.unwrap_or(0)
}

/// An admission the filter gave up on counts nothing, in whichever order Redis runs it and
/// its withdrawal: withdrawn after it counted, the user's request and the model's are given
/// back, once; withdrawn before it ran, it counts nothing when it comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_withdrawn_admission_counts_nothing_in_either_order() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some((redis, mut db)) = store_with_alice(dir.path()).await else {
        return;
    };
    let (_service, base) = start(&fleet(dir.path()), Some(redis.url()), false).await;
    let llama = model_key("llama", 60_000);
    let both = both_body("alice", "llama", 5, 60_000);

    // Counted, then withdrawn (the answer came too late for the filter).
    let mut first = both.clone();
    first["id"] = "a1".into();
    let answer = admit_body(&base, &first).await;
    assert_eq!(answer["outcome"], "admitted", "{answer}");
    assert_eq!(counts(&mut db, &llama).await, (1, 1));
    assert_eq!(
        withdraw(&base, "a1", both.clone()).await,
        json!({"outcome": "cancelled", "given_back": 2})
    );
    assert_eq!(counts(&mut db, &llama).await, (0, 0));
    // A withdrawal sent again, or the admission arriving again: nothing more.
    assert_eq!(
        withdraw(&base, "a1", both.clone()).await,
        json!({"outcome": "cancelled", "given_back": 0})
    );
    assert_eq!(
        admit_body(&base, &first).await,
        json!({"outcome": "cancelled", "given_back": 0})
    );
    assert_eq!(counts(&mut db, &llama).await, (0, 0));

    // Withdrawn before it ran (pd-control still waiting on Redis): it counts nothing when
    // it comes.
    assert_eq!(
        withdraw(&base, "b2", both.clone()).await,
        json!({"outcome": "cancelled", "given_back": 0})
    );
    let mut late = both.clone();
    late["id"] = "b2".into();
    assert_eq!(
        admit_body(&base, &late).await,
        json!({"outcome": "cancelled", "given_back": 0})
    );
    assert_eq!(counts(&mut db, &llama).await, (0, 0));

    // Refused on its model, counted on its user: only the user's request comes back.
    let mut tiny = both_body("alice", "tiny", 1, 60_000);
    let answer = admit_body(&base, &tiny).await;
    assert_eq!(answer["outcome"], "admitted", "{answer}");
    tiny["id"] = "c3".into();
    let answer = admit_body(&base, &tiny).await;
    assert_eq!(answer["outcome"], "model_rps_exceeded", "{answer}");
    assert_eq!(count(&mut db, ALICE_RPM).await, 2);
    let answer = withdraw(&base, "c3", both_body("alice", "tiny", 1, 60_000)).await;
    assert_eq!(answer, json!({"outcome": "cancelled", "given_back": 1}));
    assert_eq!(count(&mut db, ALICE_RPM).await, 1);
    assert_eq!(count(&mut db, &model_key("tiny", 60_000)).await, 1);

    // A withdrawal is given only to the window that counted: once that window is over, a
    // newer window's count stays.
    let short = model_body("short", 5, 1000);
    let mut old = short.clone();
    old["id"] = "d4".into();
    assert_eq!(admit_body(&base, &old).await["outcome"], "admitted");
    let short_key = model_key("short", 1000);
    eventually("the 1 s window to pass", || {
        let mut db = db.clone();
        let key = short_key.clone();
        async move { (count(&mut db, &key).await == 0).then_some(()) }
    })
    .await;
    assert_eq!(admit_body(&base, &short).await["outcome"], "admitted");
    assert_eq!(
        withdraw(&base, "d4", short).await,
        json!({"outcome": "cancelled", "given_back": 0})
    );
    assert_eq!(
        count(&mut db, &short_key).await,
        1,
        "the newer window keeps its count"
    );

    for (result, n) in [("given_back", 2.0), ("nothing_counted", 3.0)] {
        let name = format!("pd_control_admission_cancels_total{{result=\"{result}\"}}");
        assert_eq!(metric(&base, &name).await, n, "{result}");
    }
    assert_eq!(checks(&base, "cancelled").await, 2.0);
}

/// AIBrix's `checkLimits` answers each failing step with its own header; pd-control names
/// the step: the request counter unreadable (nothing counted; `x-error-rpm-exceeded`), the
/// token counter unreadable (the request counted, as AIBrix's `incrRPM` ran before;
/// `x-error-tpm-exceeded`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_failing_user_step_is_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some((redis, mut db)) = store(dir.path()).await else {
        return;
    };
    seed(
        &mut db,
        &[
            ("aibrix-users/gina", r#"{"name":"gina"}"#),
            ("aibrix-users/hal", r#"{"name":"hal"}"#),
            ("aibrix-users/ida", r#"{"name":"ida"}"#),
        ],
    )
    .await;
    let (_service, base) = start(&fleet(dir.path()), Some(redis.url()), false).await;
    let gina_rpm = "aibrix:gina_RPM_CURRENT:60000:counter";
    let _: () = db.set(gina_rpm, "1.5").await.expect("set");
    let answer = admit(&base, "gina").await;
    assert_eq!(
        (&answer["outcome"], &answer["stage"]),
        (&json!("store_error"), &json!("rpm")),
        "{answer}"
    );
    let _: () = db
        .hset("aibrix:hal_RPM_CURRENT:60000:counter", "f", 1)
        .await
        .expect("hset");
    let answer = admit(&base, "hal").await;
    assert_eq!(answer["stage"], "rpm", "another type: {answer}");
    let _: () = db
        .set("aibrix:ida_TPM_CURRENT:60000:counter", "lots")
        .await
        .expect("set");
    let answer = admit(&base, "ida").await;
    assert_eq!(
        (&answer["outcome"], &answer["stage"]),
        (&json!("store_error"), &json!("tpm")),
        "{answer}"
    );
    assert_eq!(
        count(&mut db, "aibrix:ida_RPM_CURRENT:60000:counter").await,
        1
    );
}

/// A TCP link to Redis that holds the next chunk carrying a script call (`EVALSHA`) back for
/// `hold` once armed, then forwards it even when the client has gone: what a slow network or
/// a Redis busy with a long script does to one call. Everything else passes at once.
struct SlowLink {
    addr: std::net::SocketAddr,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl SlowLink {
    async fn start(redis_port: u16, hold: std::time::Duration) -> SlowLink {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let armed = Arc::new(AtomicBool::new(false));
        let arm = Arc::clone(&armed);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", redis_port)).await
                else {
                    continue;
                };
                let (mut client_r, mut client_w) = client.into_split();
                let (mut server_r, mut server_w) = server.into_split();
                let arm = Arc::clone(&arm);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match client_r.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let script = buf[..n].windows(7).any(|w| w == b"EVALSHA");
                        if script && arm.swap(false, Ordering::SeqCst) {
                            tokio::time::sleep(hold).await;
                        }
                        if server_w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    // The client left: its last call still reaches Redis, which runs it
                    // before it reads the close.
                    let _ = server_w.shutdown().await;
                });
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut server_r, &mut client_w).await;
                });
            }
        });
        SlowLink { addr, armed }
    }

    fn url(&self) -> String {
        format!("redis://{}/0", self.addr)
    }

    fn arm(&self) {
        self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// pd-control's counter script got no reply within its Redis round trip (250 ms), so it
/// answered `store_error` and the gateway refused the request; Redis ran the script all the
/// same, later. pd-control withdraws such an admission itself: the late count is given back
/// (or, withdrawn first, never lands). Without it the user lost a request of its window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_pd_control_gave_up_on_is_withdrawn_by_pd_control() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some((redis, mut db)) = store_with_alice(dir.path()).await else {
        return;
    };
    let link = SlowLink::start(redis.port(), std::time::Duration::from_millis(600)).await;
    let (_service, base) = start(&fleet(dir.path()), Some(link.url()), false).await;
    // The script is loaded (EVALSHA finds it) by a first admission, given back at once.
    let warm = json!({"user": "alice", "id": "warm-1"});
    assert_eq!(admit_body(&base, &warm).await["outcome"], "admitted");
    assert_eq!(
        withdraw(&base, "warm-1", json!({"user": "alice"})).await,
        json!({"outcome": "cancelled", "given_back": 1})
    );
    assert_eq!(count(&mut db, ALICE_RPM).await, 0);

    let scripts_before = evalsha_calls(&mut db).await;
    link.arm();
    let late = json!({"user": "alice", "id": "late-1"});
    let answer = admit_body(&base, &late).await;
    assert_eq!(answer["outcome"], "store_error", "{answer}");
    assert_eq!(answer["stage"], "rpm", "{answer}");
    // The held script reaches Redis 600 ms after it was sent and runs; pd-control's own
    // withdrawal makes it count nothing, in whichever order the two land.
    eventually("the withdrawal answered", || {
        let base = base.clone();
        async move {
            let done = metric(
                &base,
                "pd_control_admission_cancels_total{result=\"given_back\"}",
            )
            .await
                + metric(
                    &base,
                    "pd_control_admission_cancels_total{result=\"nothing_counted\"}",
                )
                .await;
            (done == 2.0).then_some(())
        }
    })
    .await;
    // The held script has run once Redis counted two more script calls than before it (it
    // and the withdrawal, in either order): only then may the count be read as final.
    eventually("the held script ran", || {
        let mut db = db.clone();
        async move { (evalsha_calls(&mut db).await >= scripts_before + 2).then_some(()) }
    })
    .await;
    assert_eq!(count(&mut db, ALICE_RPM).await, 0, "the late count stood");
    let marker: Option<String> = db.get("pd-router:admission:late-1").await.expect("get");
    assert_eq!(marker.as_deref(), Some("c"), "withdrawn");
}

/// Script calls Redis has run (`INFO commandstats`, `cmdstat_evalsha:calls=N`).
async fn evalsha_calls(db: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(db)
        .await
        .expect("info");
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}
