//! One pod's `/metrics` request.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::ACCEPT;
use tokio::sync::Semaphore;

use super::engine::{check_engine, parse_reading, Engine, Foreign, Reading};

/// vLLM's full exposition is a few hundred kilobytes; anything far beyond is not an engine.
pub const MAX_BODY_BYTES: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// No connection could be made: refused, no route, or the attempt timed out. The
    /// engine's process (or its node) is gone; a slow or failing answer is not this.
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("request failed: {}", chain(.0))]
    Http(#[from] reqwest::Error),
    #[error("HTTP status {0}")]
    Status(reqwest::StatusCode),
    /// A 404 from an engine that serves its Prometheus page only when told to: the log names
    /// the switch, since the pod otherwise looks healthy and stays unscored for ever.
    #[error("HTTP status 404 Not Found: {0}")]
    MetricsOff(&'static str),
    /// Redirects are not followed: a pod's answer must not send the scraper to another
    /// address, nor charge that address's failures to the pod.
    #[error("HTTP status {status}: redirect to {location:?} not followed; scrape the engine's metrics port and path")]
    Redirect {
        status: reqwest::StatusCode,
        location: String,
    },
    #[error("response exceeds {MAX_BODY_BYTES} bytes")]
    TooLarge,
    /// A 200 that is not the pod's engine speaking (see [`check_engine`]): a failed scrape,
    /// so the pod's metrics are stale rather than read as an idle engine's.
    #[error("{0}")]
    Foreign(#[from] Foreign),
    #[error("scraper is shutting down")]
    Closed,
    /// The scrape's code panicked (a bug, most likely on an engine's unexpected exposition):
    /// a failed scrape, so that the pod is scraped again (see `Scraper::spawn`).
    #[error("the scrape panicked: {0}")]
    Panicked(String),
}

impl ScrapeError {
    pub fn is_connect(&self) -> bool {
        matches!(self, ScrapeError::Connect(_))
    }

    /// Sorts a failed send: connection failures apart from the rest.
    fn of_send(error: reqwest::Error) -> ScrapeError {
        if error.is_connect() {
            ScrapeError::Connect(chain(&error))
        } else {
            ScrapeError::Http(error)
        }
    }
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
/// in the environment would send every scrape through it. A connection attempt gets half the
/// scrape's bound, so a pod whose node vanished (the attempt is never answered) fails as a
/// connection failure, which marks a pod unreachable, rather than as a slow answer, which
/// does not. Idle connections are dropped after 3 s, before the engines' uvicorn closes them
/// (5 s): a scrape sent as the engine closes would fail as a connection error (the gateway's
/// pod clusters do the same, docs/OPERATOR.md "Idle connections to the engines"). Redirects
/// are answers, not followed (see [`ScrapeError::Redirect`]).
pub fn client(timeout: Duration) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(timeout / 2)
        .pool_idle_timeout(Duration::from_secs(3))
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
        Ok(Ok(body)) => {
            let reading = parse_reading(&body, engine, model);
            check_engine(&body, engine, &reading)
                .map(|()| reading)
                .map_err(ScrapeError::from)
        }
        Ok(Err(ScrapeError::Status(status))) if status == reqwest::StatusCode::NOT_FOUND => {
            Err(engine
                .metrics_switch()
                .map_or(ScrapeError::Status(status), ScrapeError::MetricsOff))
        }
        Ok(Err(e)) | Err(e) => Err(e),
    };
    (result, elapsed)
}

/// Longest `Location` quoted in a [`ScrapeError::Redirect`]: it is the pod's text, logged.
const MAX_LOCATION_CHARS: usize = 200;

/// A redirect's `Location`, for the log: as sent, cut to [`MAX_LOCATION_CHARS`].
fn location_of(response: &reqwest::Response) -> String {
    let location = response
        .headers()
        .get(reqwest::header::LOCATION)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    location.chars().take(MAX_LOCATION_CHARS).collect()
}

/// The body as sent: [`parse_reading`] reads bytes, so it is neither validated nor copied here.
async fn fetch_body(client: &reqwest::Client, url: &str) -> Result<Vec<u8>, ScrapeError> {
    // Plain text, not OpenMetrics: prometheus_client switches formats on Accept.
    let mut response = client
        .get(url)
        .header(ACCEPT, "text/plain")
        .send()
        .await
        .map_err(ScrapeError::of_send)?;
    let status = response.status();
    if status.is_redirection() {
        return Err(ScrapeError::Redirect {
            status,
            location: location_of(&response),
        });
    }
    if !status.is_success() {
        return Err(ScrapeError::Status(status));
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

    async fn scrape_of(url: &str) -> Result<Reading, ScrapeError> {
        scrape_as(url, Engine::Vllm).await
    }

    async fn scrape_as(url: &str, engine: Engine) -> Result<Reading, ScrapeError> {
        let client = client(Duration::from_secs(1)).expect("client");
        let slots = Arc::new(Semaphore::new(1));
        scrape(&client, &slots, url, engine, "m", Duration::from_secs(1)).await
    }

    #[tokio::test]
    async fn a_404_names_the_switch_the_engine_serves_its_metrics_with() {
        let not_found = "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
        for (engine, switch) in [
            (Engine::Sglang, "--enable-metrics"),
            (Engine::Trtllm, "return_perf_metrics"),
        ] {
            let addr = answering(not_found.into()).await;
            let url = metrics_url(&addr.ip().to_string(), addr.port(), engine);
            let error = scrape_as(&url, engine).await.expect_err("a 404");
            assert!(!error.is_connect(), "the pod answered");
            assert!(error.to_string().contains(switch), "{engine:?}: {error}");
        }
        // vLLM always serves /metrics: a 404 there is something else, said as it is.
        let addr = answering(not_found.into()).await;
        let failed = scrape_of(&format!("http://{addr}/metrics")).await;
        assert!(
            matches!(&failed, Err(ScrapeError::Status(s)) if s.as_u16() == 404),
            "{failed:?}"
        );
    }

    #[tokio::test]
    async fn a_closed_port_is_a_connection_failure_and_an_error_answer_is_not() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = closed.local_addr().expect("addr").port();
        drop(closed);
        let refused = scrape_of(&format!("http://127.0.0.1:{port}/metrics")).await;
        assert!(matches!(&refused, Err(e) if e.is_connect()), "{refused:?}");

        let answer = "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n";
        let addr = answering(answer.into()).await;
        let failed = scrape_of(&format!("http://{addr}/metrics")).await;
        assert!(
            matches!(&failed, Err(ScrapeError::Status(s)) if s.as_u16() == 500),
            "{failed:?}"
        );
    }

    /// A one-connection server answering `answer` to the first request, on loopback.
    async fn answering(answer: String) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut conn, _) = listener.accept().await.expect("accept");
            let mut request = [0u8; 1024];
            let _ = conn.read(&mut request).await;
            conn.write_all(answer.as_bytes()).await.expect("write");
        });
        addr
    }

    #[tokio::test]
    async fn a_redirect_is_a_failed_scrape_not_followed() {
        // Where the pod points: a closed port, so following it would fail as a connection
        // failure and mark the pod unreachable.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let elsewhere = format!("http://{}/metrics", closed.local_addr().expect("addr"));
        drop(closed);
        let answer =
            format!("HTTP/1.1 302 Found\r\nlocation: {elsewhere}\r\ncontent-length: 0\r\n\r\n");
        let addr = answering(answer).await;
        let result = scrape_of(&format!("http://{addr}/metrics")).await;
        let Err(error @ ScrapeError::Redirect { status, location }) = &result else {
            panic!("{result:?}");
        };
        assert_eq!(
            (status.as_u16(), location.as_str()),
            (302, elsewhere.as_str())
        );
        assert!(!error.is_connect(), "the pod answered");
        assert!(error.to_string().contains("not followed"), "{error}");
    }

    #[tokio::test]
    async fn a_login_page_answered_with_200_is_a_failed_scrape_not_an_idle_engine() {
        let page = "<html><body>sign in</body></html>";
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\n\r\n{page}",
            page.len()
        );
        let addr = answering(answer).await;
        let result = scrape_of(&format!("http://{addr}/metrics")).await;
        assert!(
            matches!(&result, Err(e @ ScrapeError::Foreign(Foreign::NotExposition)) if !e.is_connect()),
            "{result:?}"
        );
    }

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
