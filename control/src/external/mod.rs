//! The `external` strategy's calls to an operator's replica-selection service (AIBrix's
//! external router): the filter sends pd-control its candidates (`POST /v1/route/external`),
//! pd-control adds what it knows of each pod (port, allowlisted labels, engine metrics), asks
//! the service under the configured deadline, bulkhead and circuit, checks the answer against
//! what it offered, and tells the filter what to do. Secrets, the service's address and the
//! strict protocol reading stay here, in native code; the filter only routes.

pub mod circuit;
pub mod config;
pub mod protocol;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;

use circuit::{Bulkhead, Circuit, State, Token};
use config::ExternalConfig;
use protocol::{Ask, Decision};

use crate::proto;

/// What the filter does with the request.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Answer {
    /// Route to this candidate (`namespace/name`).
    Selected { target: String },
    /// Run the local fallback strategy (the reason: `no_decision`, or a failure's outcome
    /// when failing open).
    Fallback { reason: &'static str },
    /// Refuse with 403 `external_policy_denied`.
    Denied,
    /// Refuse with 503 `external_router_unavailable` (failing closed).
    Unavailable { reason: &'static str },
}

/// AIBrix's outcome labels.
const OUTCOMES: [&str; 10] = [
    "selected",
    "no_decision",
    "denied",
    "timeout",
    "transport_error",
    "http_error",
    "invalid_response",
    "request_too_large",
    "bulkhead_rejected",
    "circuit_open",
];

/// Bounds (seconds) of the exchange-duration histogram: AIBrix's, 0.5 ms doubling 12 times.
fn duration_bounds() -> [f64; 12] {
    std::array::from_fn(|i| 0.0005 * f64::from(1u32 << i))
}

#[derive(Debug, Default)]
struct Metrics {
    requests: [AtomicU64; OUTCOMES.len()],
    fallback: [AtomicU64; OUTCOMES.len()],
    buckets: [AtomicU64; 13],
    sum_micros: AtomicU64,
}

fn slot(outcome: &str) -> usize {
    OUTCOMES.iter().position(|o| *o == outcome).unwrap_or(0)
}

/// A circuit token that is cancelled unless settled: an exchange whose caller went away
/// (the filter's call timed out, the client left) counts neither way.
struct Held<'a> {
    circuit: &'a Circuit,
    token: Option<Token>,
}

impl Held<'_> {
    fn success(mut self) {
        if let Some(t) = self.token.take() {
            self.circuit.success(t);
        }
    }
    fn failure(mut self) {
        if let Some(t) = self.token.take() {
            self.circuit.failure(t, Instant::now());
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.token.take() {
            self.circuit.cancel(t, Instant::now());
        }
    }
}

type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

pub struct ExternalRouter {
    cfg: ExternalConfig,
    client: HttpClient,
    bulkhead: Bulkhead,
    circuit: Circuit,
    metrics: Metrics,
}

impl ExternalRouter {
    pub fn new(cfg: ExternalConfig) -> Result<ExternalRouter, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = hyper_rustls::HttpsConnectorBuilder::new();
        let builder = if cfg.endpoint.scheme() == "https" {
            builder
                .with_provider_and_native_roots(provider)
                .map_err(|e| format!("external router TLS (system roots): {e}"))?
        } else {
            // Plain http: TLS is never used, so no root store is read.
            let tls = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("external router TLS: {e}"))?
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth();
            builder.with_tls_config(tls)
        };
        let connector = builder.https_or_http().enable_http1().build();
        // No redirects (hyper follows none), no compression (none asked for), no retries.
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(cfg.max_inflight)
            // Below the 5 s keep-alive of common Python servers (uvicorn), which close idle
            // connections: one reused as it closes would fail the ask.
            .pool_idle_timeout(std::time::Duration::from_secs(3))
            .build(connector);
        Ok(ExternalRouter {
            bulkhead: Bulkhead::new(cfg.max_inflight),
            circuit: Circuit::new(cfg.failure_threshold, cfg.open_duration),
            metrics: Metrics::default(),
            client,
            cfg,
        })
    }

    /// What the snapshot tells the filters.
    pub fn summary(&self) -> proto::ExternalRouter {
        proto::ExternalRouter {
            advisory: self.cfg.advisory,
            fail_open: self.cfg.fail_open,
            fallback: self.cfg.fallback.clone(),
            timeout_ms: u32::try_from(self.cfg.timeout.as_millis()).unwrap_or(u32::MAX),
        }
    }

    pub fn endpoint(&self) -> &str {
        self.cfg.endpoint.as_str()
    }

    /// Asks the service about `ask`'s candidates, pods of `snapshot` (AIBrix's `Route`).
    pub async fn decide(&self, ask: &Ask, snapshot: &proto::Snapshot) -> Answer {
        let built = match protocol::build(&self.cfg, ask, snapshot) {
            Ok(built) => built,
            Err(e) => return self.failed("invalid_response", &e.to_string()),
        };
        let body_len = built.body.len();
        // Built before the circuit is asked: a request that cannot even be formed (a header
        // value the HTTP library refuses) says nothing of the service's health, so it must
        // not count as a failure that opens the circuit shared by every gateway.
        let request = match self.http_request(ask, built.body) {
            Ok(request) => request,
            Err(e) => {
                return self.failed("transport_error", &format!("request not formed: {e}"));
            }
        };
        let Some(token) = self.circuit.acquire(Instant::now()) else {
            return self.failed("circuit_open", "the circuit is open");
        };
        let held = Held {
            circuit: &self.circuit,
            token: Some(token),
        };
        let Some(_permit) = self.bulkhead.try_acquire() else {
            drop(held);
            return self.failed("bulkhead_rejected", "too many exchanges in flight");
        };
        if body_len > self.cfg.max_request_bytes {
            drop(held);
            return self.failed(
                "request_too_large",
                "the decision request exceeds its limit",
            );
        }
        let started = Instant::now();
        let exchanged = self.exchange(request).await;
        self.observe(started.elapsed());
        let body = match exchanged {
            Ok(body) => body,
            Err((outcome, why)) => {
                held.failure();
                return self.failed(outcome, &why);
            }
        };
        match protocol::validate(&body, &ask.request_id, self.cfg.advisory, &built.ports) {
            Err(why) => {
                held.failure();
                self.failed("invalid_response", &why)
            }
            Ok(decision) => {
                held.success();
                match decision {
                    Decision::Selected { id } => {
                        self.count("selected");
                        Answer::Selected { target: id }
                    }
                    Decision::NoDecision => {
                        self.count("no_decision");
                        self.fall_back("no_decision")
                    }
                    Decision::Denied => {
                        self.count("denied");
                        Answer::Denied
                    }
                }
            }
        }
    }

    /// One HTTP exchange, all of it (connecting, sending, reading) within the deadline: the
    /// body of a 200 with the protocol's media type, read up to the response limit, or the
    /// failure's outcome.
    async fn exchange(
        &self,
        request: http::Request<Full<Bytes>>,
    ) -> Result<Vec<u8>, (&'static str, String)> {
        match tokio::time::timeout(self.cfg.timeout, self.exchange_unbounded(request)).await {
            Ok(result) => result,
            Err(_) => Err((
                "timeout",
                format!("no answer within {:?}", self.cfg.timeout),
            )),
        }
    }

    /// The decision request for `ask` carrying `body`.
    fn http_request(
        &self,
        ask: &Ask,
        body: Vec<u8>,
    ) -> Result<http::Request<Full<Bytes>>, http::Error> {
        let mut request = http::Request::post(self.cfg.endpoint.as_str())
            .header(http::header::CONTENT_TYPE, protocol::MEDIA_TYPE)
            .header(http::header::ACCEPT, protocol::MEDIA_TYPE)
            .header("x-request-id", ask.request_id.as_str());
        if let Some(tp) = ask.traceparent.as_deref().filter(|t| valid_traceparent(t)) {
            request = request.header("traceparent", tp);
        }
        if let Some(token) = &self.cfg.bearer_token {
            request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        request.body(Full::new(Bytes::from(body)))
    }

    async fn exchange_unbounded(
        &self,
        request: http::Request<Full<Bytes>>,
    ) -> Result<Vec<u8>, (&'static str, String)> {
        let transport = |e: &dyn std::fmt::Display| ("transport_error", e.to_string());
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| transport(&e))?;
        let (parts, mut incoming) = response.into_parts();
        let mut body = Vec::new();
        while let Some(frame) = incoming.frame().await {
            let frame = frame.map_err(|e| transport(&e))?;
            if let Some(data) = frame.data_ref() {
                body.extend_from_slice(data);
                if body.len() > self.cfg.max_response_bytes {
                    return Err((
                        "invalid_response",
                        "external response exceeds configured limit".into(),
                    ));
                }
            }
        }
        if parts.status != http::StatusCode::OK {
            return Err((
                "http_error",
                format!("external service returned HTTP {}", parts.status.as_u16()),
            ));
        }
        let media = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if !protocol::is_protocol_media_type(media) {
            return Err((
                "invalid_response",
                "external response has invalid content type".into(),
            ));
        }
        Ok(body)
    }

    fn failed(&self, outcome: &'static str, why: &str) -> Answer {
        self.count(outcome);
        tracing::debug!(outcome, "external router: {why}");
        if self.cfg.fail_open {
            self.fall_back(outcome)
        } else {
            Answer::Unavailable { reason: outcome }
        }
    }

    fn fall_back(&self, reason: &'static str) -> Answer {
        self.metrics.fallback[slot(reason)].fetch_add(1, Ordering::Relaxed);
        Answer::Fallback { reason }
    }

    fn count(&self, outcome: &str) {
        self.metrics.requests[slot(outcome)].fetch_add(1, Ordering::Relaxed);
    }

    fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let bounds = duration_bounds();
        let i = bounds.iter().position(|b| s <= *b).unwrap_or(bounds.len());
        self.metrics.buckets[i].fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.metrics.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    /// AIBrix's five families: (name, type, help, samples as (labels, value)).
    pub fn metrics(&self) -> Vec<crate::limits::MetricFamily> {
        let by = |counts: &[AtomicU64; OUTCOMES.len()], label: &str| {
            OUTCOMES
                .iter()
                .zip(counts)
                .map(|(o, n)| {
                    (
                        format!("{{{label}=\"{o}\"}}"),
                        n.load(Ordering::Relaxed).to_string(),
                    )
                })
                .collect::<Vec<_>>()
        };
        let mut histogram = Vec::new();
        let mut running = 0;
        for (i, bound) in duration_bounds()
            .iter()
            .map(|b| b.to_string())
            .chain(["+Inf".to_string()])
            .enumerate()
        {
            running += self.metrics.buckets[i].load(Ordering::Relaxed);
            histogram.push((format!("_bucket{{le=\"{bound}\"}}"), running.to_string()));
        }
        let sum = self.metrics.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        histogram.push(("_sum".into(), sum.to_string()));
        histogram.push(("_count".into(), running.to_string()));
        let state = self.circuit.state();
        let circuit = State::ALL
            .iter()
            .map(|s| {
                (
                    format!("{{state=\"{}\"}}", s.label()),
                    u8::from(*s == state).to_string(),
                )
            })
            .collect();
        vec![
            (
                "aibrix_gateway_external_router_requests_total",
                "counter",
                "External router requests by fixed outcome.",
                by(&self.metrics.requests, "outcome"),
            ),
            (
                "aibrix_gateway_external_router_fallback_total",
                "counter",
                "External router fallback invocations by fixed reason.",
                by(&self.metrics.fallback, "reason"),
            ),
            (
                "aibrix_gateway_external_router_duration_seconds",
                "histogram",
                "External routing service exchange duration.",
                histogram,
            ),
            (
                "aibrix_gateway_external_router_inflight",
                "gauge",
                "Current external routing HTTP exchanges.",
                vec![(String::new(), self.bulkhead.inflight().to_string())],
            ),
            (
                "aibrix_gateway_external_router_circuit_state",
                "gauge",
                "External router circuit state (1 for current state).",
                circuit,
            ),
        ]
    }
}

/// A W3C `traceparent` AIBrix would propagate: version, 32-hex trace id and 16-hex span id
/// not all zero, flags; version `ff` is invalid.
fn valid_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    parts.len() == 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex(parts[3], 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_checked_before_they_are_passed_on() {
        assert!(valid_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        assert!(!valid_traceparent(
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        assert!(!valid_traceparent(
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
        ));
        assert!(!valid_traceparent(
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"
        ));
        assert!(!valid_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"
        ));
    }

    #[test]
    fn duration_bounds_double_from_half_a_millisecond() {
        let b = duration_bounds();
        assert_eq!((b[0], b[1], b[11]), (0.0005, 0.001, 1.024));
    }
}
