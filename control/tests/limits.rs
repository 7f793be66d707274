//! Per-user limits against a real `redis-server`: AIBrix's user records and counter keys,
//! the fixed one-minute window, the HTTP answers the filter reads, the snapshot flag, the
//! metrics, and a Redis outage. Turned off, every check answers `disabled`.

use std::path::{Path, PathBuf};

use pd_control::proto;
use prost::Message;
use redis::AsyncCommands;
use serde_json::{json, Value};

mod common;
use common::redis::{free_port, Redis};

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

/// `POST /v1/limits/admit` for `user`: the JSON answer (status 200 and type checked).
async fn admit(base: &str, user: &str) -> Value {
    let resp = client()
        .post(format!("{base}/v1/limits/admit"))
        .body(user.to_string())
        .send()
        .await
        .expect("admit sent");
    assert_eq!(resp.status(), 200, "admit {user}");
    let content_type = resp.headers().get("content-type").cloned();
    assert_eq!(
        content_type.as_ref().and_then(|v| v.to_str().ok()),
        Some("application/json")
    );
    let body = resp.bytes().await.expect("answer body");
    serde_json::from_slice(&body).expect("JSON answer")
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

/// The sample `name` (labels included, as printed) from `/metrics`.
async fn metric(base: &str, name: &str) -> f64 {
    let text = client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
}

async fn checks(base: &str, outcome: &str) -> f64 {
    metric(
        base,
        &format!("pd_control_user_limit_checks_total{{outcome=\"{outcome}\"}}"),
    )
    .await
}

const ALICE_RPM: &str = "aibrix:alice_RPM_CURRENT:60000:counter";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_count_against_aibrix_records_and_survive_a_redis_outage() {
    let dir = tempfile::tempdir().expect("temp dir");
    let Some(redis) = Redis::start(free_port(), dir.path()) else {
        return;
    };
    redis.wait_ready().await;
    let mut db = redis.connection().await;
    let seed = [
        ("aibrix-users/alice", r#"{"name":"alice","rpm":3,"tpm":0}"#),
        ("aibrix-users/bob", r#"{"name":"bob","rpm":0,"tpm":10}"#),
        ("aibrix-users/carol", r#"{"name":"carol","rpm":3}"#),
        ("aibrix-users/dave", r#"{"rpm":-1}"#),
        ("aibrix-users/erin", r#"{"name":"erin"}"#),
    ];
    for (key, record) in seed {
        let _: () = db.set(key, record).await.expect("seed");
    }
    let (_service, base) = start(&fleet(dir.path()), Some(redis.url()), false).await;

    // Limits on: the snapshot says so.
    assert!(snapshot(&base).await.user_limits);
    assert_eq!(metric(&base, "pd_control_user_limits_enabled").await, 1.0);

    // alice: 3 requests a minute (tokens default to 3 × 1000).
    let answer = admit(&base, "alice").await;
    assert_eq!(
        answer,
        json!({"outcome":"admitted","rpm":1,"rpm_limit":3,"tpm":0,"tpm_limit":3000})
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
        json!({"outcome":"admitted","rpm":1,"rpm_limit":100,"tpm":0,"tpm_limit":10})
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
            .is_some_and(|m| m.contains("rpm")),
        "{answer}"
    );

    // erin's request counter holds garbage: the counter script fails.
    let _: () = db
        .set("aibrix:erin_RPM_CURRENT:60000:counter", "garbage")
        .await
        .expect("set");
    let answer = admit(&base, "erin").await;
    assert_eq!(answer["outcome"], "store_error", "{answer}");
    assert_eq!(answer["stage"], "counters");
    // Her token counter too: her tokens are not added, the others' are (503 all the same).
    let _: () = db
        .set("aibrix:erin_TPM_CURRENT:60000:counter", "garbage")
        .await
        .expect("set");
    assert_eq!(usage(&base, json!({"erin": 5, "alice": 7})).await, 503);
    let tokens: i64 = db
        .get("aibrix:alice_TPM_CURRENT:60000:counter")
        .await
        .expect("get");
    assert_eq!(tokens, 7);

    // Bodies the contract does not allow.
    for bad in [Vec::new(), vec![b'a'; 257], b"\xff\xfe".to_vec()] {
        let (status, text) = post(&base, "/v1/limits/admit", bad).await;
        assert_eq!(status, 400);
        assert!(!text.is_empty());
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
        ("rpm_exceeded", 2.0),
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
        assert_eq!(usage(&base, json!({"alice": 5})).await, 204);
        assert!(!snapshot(&base).await.user_limits, "{redis:?}");
        assert_eq!(metric(&base, "pd_control_user_limits_enabled").await, 0.0);
        assert_eq!(checks(&base, "admitted").await, 0.0);
        assert_eq!(metric(&base, "pd_control_user_tokens_total").await, 0.0);
        service.shutdown().await.expect("shutdown");
    }
}

/// AIBrix's `AIBRIX_DISABLE_RATE_LIMIT=true` turns the limits off in the binary, with
/// `--redis` given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_aibrix_variable_turns_limits_off() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let dir = tempfile::tempdir().expect("temp dir");
    let fleet = fleet(dir.path());
    let mut child = Command::new(env!("CARGO_BIN_EXE_pd-control"))
        .arg("--fleet")
        .arg(&fleet)
        .args(["--listen", "127.0.0.1:0", "--redis"])
        .arg(format!("redis://127.0.0.1:{}/0", free_port()))
        .env("AIBRIX_DISABLE_RATE_LIMIT", "TRUE")
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
    let checked = async {
        let base = base.as_deref()?;
        let answer = admit(base, "alice").await;
        let user_limits = snapshot(base).await.user_limits;
        Some((answer, user_limits))
    }
    .await;
    let _ = child.kill();
    let _ = child.wait();
    read.expect("stdout readable");
    let (answer, user_limits) = checked.unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    assert_eq!(answer, json!({"outcome":"disabled"}));
    assert!(!user_limits);
}
