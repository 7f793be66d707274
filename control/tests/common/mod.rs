//! Helpers shared by pd-control's integration tests.

// Only the tests of the Redis features use it; the others compile it unused.
#[allow(dead_code)]
pub mod redis;

// The fake Kubernetes API server of the Kubernetes source's and the leader election's tests.
#[allow(dead_code)]
pub mod kube_api;

use std::future::Future;
use std::time::{Duration, Instant};

pub const DEADLINE: Duration = Duration::from_secs(20);
pub const POLL: Duration = Duration::from_millis(20);

/// Polls `check` until it yields `Some`, failing the test with `what` after [`DEADLINE`]:
/// waiting on a condition, never on a fixed delay.
// Only some tests wait this way; the others compile it unused.
#[allow(dead_code)]
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(POLL).await;
    }
}

/// The sample `name` (labels included, as printed) from pd-control's `/metrics` at `base`.
// Only some tests read metrics this way; the others compile it unused.
#[allow(dead_code)]
pub async fn metric(base: &str, name: &str) -> f64 {
    let text = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
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
