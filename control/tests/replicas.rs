//! Several gateway replicas through two pd-control replicas and a real `redis-server`: each
//! gateway sees the others' decode shares whichever pd-control it polls; with Redis down each
//! pd-control keeps answering from the reports it received itself, says so in `/metrics`,
//! and recovers when Redis returns.

use std::path::Path;
use std::time::Duration;

use pd_control::proto::{DecodeShare, RemoteShares, ReplicaReport};
use prost::Message;

mod common;
use common::eventually;
use common::redis::Redis;

async fn start_control(fleet: &Path, redis: &str) -> pd_control::Service {
    let mut config = pd_control::Config::new(fleet, "127.0.0.1:0".parse().expect("addr"));
    config.redis = Some(redis.to_string());
    config.replica_ttl = Duration::from_secs(30);
    pd_control::start(config).await.expect("pd-control starts")
}

async fn report(base: &str, replica: u64, shares: Vec<DecodeShare>) -> RemoteShares {
    let body = ReplicaReport { replica, shares }.encode_to_vec();
    let resp = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
        .post(format!("{base}/v1/replicas/report"))
        .body(body)
        .send()
        .await
        .expect("report sent");
    assert_eq!(resp.status(), 200);
    RemoteShares::decode(resp.bytes().await.expect("body")).expect("RemoteShares")
}

async fn metric(base: &str, name: &str) -> Option<f64> {
    let text = reqwest::Client::builder()
        .no_proxy()
        .build()
        .ok()?
        .get(format!("{base}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

fn share(pod_id: u64, decode_tokens: f64, running: u32) -> DecodeShare {
    DecodeShare {
        pod_id,
        decode_tokens,
        running,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_controls_share_replica_shares_through_redis_and_survive_its_outage() {
    let dir = tempfile::tempdir().expect("temp dir");
    // `None` only where redis-server cannot run and PD_TESTS_ALLOW_SKIP=1 allows a skip.
    let Some(redis) = Redis::start_ready(dir.path()).await else {
        return;
    };
    let port = redis.port();
    let fleet = dir.path().join("fleet.yaml");
    std::fs::write(&fleet, "apiVersion: v1\nkind: List\nitems: []\n").expect("fleet");
    let a = start_control(&fleet, &redis.url()).await;
    let b = start_control(&fleet, &redis.url()).await;
    let (a, b) = (
        format!("http://{}", a.local_addr()),
        format!("http://{}", b.local_addr()),
    );

    // Gateway 1 polls control A, gateway 2 polls control B: each sees the other.
    let first = report(&a, 1, vec![share(42, 900.0, 3)]).await;
    assert!(first.shares.is_empty(), "{first:?}");
    let seen_by_2 = report(&b, 2, vec![share(42, 100.0, 1), share(7, 50.0, 1)]).await;
    assert_eq!(seen_by_2.shares, vec![share(42, 900.0, 3)]);
    assert_eq!(seen_by_2.replicas, 1);
    let seen_by_1 = report(&a, 1, vec![share(42, 950.0, 4)]).await;
    assert_eq!(
        seen_by_1.shares,
        vec![share(7, 50.0, 1), share(42, 100.0, 1)]
    );
    assert_eq!(metric(&a, "pd_control_redis_up").await, Some(1.0));

    // Redis goes away: control A answers from what reached it (gateway 1 only), counts the
    // errors and reports the degradation.
    drop(redis);
    let degraded = report(&a, 3, vec![share(5, 10.0, 1)]).await;
    assert_eq!(degraded.shares, vec![share(42, 950.0, 4)]);
    assert_eq!(metric(&a, "pd_control_redis_up").await, Some(0.0));
    assert!(metric(&a, "pd_control_redis_errors_total").await >= Some(1.0));

    // Redis returns (empty) on its address: the next reports go through it again.
    let _redis = Redis::start_ready_on(port, dir.path())
        .await
        .expect("redis-server ran a moment ago");
    eventually("reports through redis again", || {
        let a = a.clone();
        async move {
            report(&a, 1, vec![share(42, 1.0, 1)]).await;
            (metric(&a, "pd_control_redis_up").await == Some(1.0)).then_some(())
        }
    })
    .await;
    let after = report(&b, 2, vec![]).await;
    assert_eq!(after.shares, vec![share(42, 1.0, 1)], "{after:?}");
}
