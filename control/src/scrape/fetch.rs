//! One pod's `/metrics` request.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::ACCEPT;
use tokio::sync::Semaphore;

use super::engine::{parse_reading, Engine, Reading};

/// vLLM's full exposition is a few hundred kilobytes; anything far beyond is not an engine.
pub const MAX_BODY_BYTES: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("request failed: {}", chain(.0))]
    Http(#[from] reqwest::Error),
    #[error("HTTP status {0}")]
    Status(reqwest::StatusCode),
    #[error("response exceeds {MAX_BODY_BYTES} bytes")]
    TooLarge,
    #[error("scraper is shutting down")]
    Closed,
}

/// reqwest's own message is "error sending request for url (…)"; the reason an operator needs
/// (connection refused, reset, DNS) is further down the source chain.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

/// `http://ip:port/path`, bracketing IPv6 pod IPs.
pub fn metrics_url(ip: &str, port: u16, engine: Engine) -> String {
    let path = engine.metrics_path();
    match ip.parse::<IpAddr>() {
        Ok(IpAddr::V6(v6)) => format!("http://[{v6}]:{port}{path}"),
        _ => format!("http://{ip}:{port}{path}"),
    }
}

/// The shared client. Proxies are disabled: pod IPs are cluster-internal, and an `HTTP_PROXY`
/// in the environment would send every scrape through it.
pub fn client(timeout: Duration) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(timeout)
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(2)
        .build()
}

/// Fetches and parses one pod's metrics. The timeout covers the whole exchange but not the wait
/// for a concurrency slot, so a queue behind slow pods is not mistaken for slow pods.
pub async fn scrape(
    client: &reqwest::Client,
    slots: &Arc<Semaphore>,
    url: &str,
    engine: Engine,
    model: &str,
    timeout: Duration,
) -> Result<Reading, ScrapeError> {
    scrape_timed(client, slots, url, engine, model, timeout)
        .await
        .0
}

/// [`scrape`] with the duration of the exchange itself (not of the wait for a slot), for the
/// scrape-latency histogram.
pub async fn scrape_timed(
    client: &reqwest::Client,
    slots: &Arc<Semaphore>,
    url: &str,
    engine: Engine,
    model: &str,
    timeout: Duration,
) -> (Result<Reading, ScrapeError>, Duration) {
    let Ok(_slot) = slots.acquire().await else {
        return (Err(ScrapeError::Closed), Duration::ZERO);
    };
    let started = std::time::Instant::now();
    let body = tokio::time::timeout(timeout, fetch_body(client, url))
        .await
        .map_err(|_| ScrapeError::Timeout(timeout));
    let elapsed = started.elapsed();
    let result = match body {
        Ok(Ok(body)) => Ok(parse_reading(&body, engine, model)),
        Ok(Err(e)) | Err(e) => Err(e),
    };
    (result, elapsed)
}

/// The body as sent: [`parse_reading`] reads bytes, so it is neither validated nor copied here.
async fn fetch_body(client: &reqwest::Client, url: &str) -> Result<Vec<u8>, ScrapeError> {
    // Plain text, not OpenMetrics: prometheus_client switches formats on Accept.
    let mut response = client.get(url).header(ACCEPT, "text/plain").send().await?;
    if !response.status().is_success() {
        return Err(ScrapeError::Status(response.status()));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > MAX_BODY_BYTES {
            return Err(ScrapeError::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            metrics_url("10.0.0.5", 8000, Engine::Vllm),
            "http://10.0.0.5:8000/metrics"
        );
        assert_eq!(
            metrics_url("fd00::5", 8000, Engine::Trtllm),
            "http://[fd00::5]:8000/prometheus/metrics"
        );
    }
}
