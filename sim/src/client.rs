//! pd-load's HTTP side: sending one planned request (optionally after doing the prefill leg
//! itself) and turning the response, streamed or not, into a [`RequestResult`].

use std::net::IpAddr;
use std::time::{Duration, Instant};

use reqwest::header::HeaderMap;
use serde_json::Value;
use tokio::time::timeout_at;

use crate::chunk_gaps::{ChunkGaps, StreamGaps};
use crate::load::{LoadConfig, RequestResult};
use crate::workload::{decode_body, prefill_body, Planned};

/// Refuses URLs that are not on this machine unless explicitly allowed: load tests here
/// must only ever hit loopback addresses.
pub fn check_loopback(url: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("bad URL {url}: {e}"))?;
    let host = parsed.host_str().unwrap_or_default();
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if loopback {
        Ok(())
    } else {
        Err(format!(
            "{url} is not a loopback address (pass --allow-non-loopback to override)"
        ))
    }
}

/// The host part of a URL (for `remote_host`).
fn url_host(url: &str) -> Result<String, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("bad URL {url}: {e}"))?;
    Ok(parsed
        .host_str()
        .unwrap_or_default()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Shared by every request of a run.
pub(crate) struct Sender {
    client: reqwest::Client,
    cfg: LoadConfig,
    base: String,
    prefill_base: Option<(String, String)>,
    pub(crate) run_start: Instant,
    /// Every time between token reads of this sender's successful streams.
    pub(crate) chunk_gaps: ChunkGaps,
}

impl Sender {
    pub(crate) fn new(cfg: LoadConfig) -> Result<Self, String> {
        let client = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(cfg.concurrency_limit.max(1))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| format!("cannot build HTTP client: {e}"))?;
        let prefill_base = match &cfg.direct_prefill {
            Some(url) => Some((url.trim_end_matches('/').to_string(), url_host(url)?)),
            None => None,
        };
        Ok(Sender {
            client,
            base: cfg.url.trim_end_matches('/').to_string(),
            prefill_base,
            cfg,
            run_start: Instant::now(),
            chunk_gaps: ChunkGaps::default(),
        })
    }

    fn request(
        &self,
        url: String,
        body: &Value,
        x_request_id: Option<&str>,
        session: Option<&str>,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(url)
            .header("content-type", "application/json")
            .body(body.to_string());
        if !self.cfg.routing_strategy.is_empty() {
            req = req.header("routing-strategy", &self.cfg.routing_strategy);
        }
        for (k, v) in &self.cfg.headers {
            req = req.header(k, v);
        }
        if let Some(id) = x_request_id {
            req = req.header("x-request-id", id);
        }
        if let Some(key) = session {
            req = req.header("x-aibrix-session-key", key);
        }
        req
    }

    /// Sends one planned request and records what happened. Never fails: every outcome,
    /// including timeouts, is a result.
    pub(crate) async fn send(&self, p: Planned) -> RequestResult {
        let start = Instant::now();
        let deadline = tokio::time::Instant::from_std(start + self.cfg.timeout);
        let mut r = RequestResult {
            seq: p.seq,
            start_ms: ms(start - self.run_start),
            path: p.path.to_string(),
            stream: p.stream,
            prompt_tokens: p.prompt_tokens,
            ..RequestResult::default()
        };
        let mut body = p.body;
        let mut x_request_id = None;
        if let Some((prefill_url, prefill_host)) = &self.prefill_base {
            let id = format!("pdload-{}-{}", p.seq, crate::vllm::random_hex(8));
            match self
                .direct_prefill(
                    &mut r,
                    deadline,
                    prefill_url,
                    prefill_host,
                    p.path,
                    &body,
                    &id,
                )
                .await
            {
                Some(decode) => body = decode,
                None => {
                    r.e2e_ms = ms(start.elapsed());
                    return r;
                }
            }
            r.prefill_ms = Some(ms(start.elapsed()));
            x_request_id = Some(id);
        }
        let url = format!("{}{}", self.base, p.path);
        let sent = timeout_at(
            deadline,
            self.request(url, &body, x_request_id.as_deref(), p.session.as_deref())
                .send(),
        )
        .await;
        let mut resp = match sent {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => return failed(r, start, transport_error(&e)),
            Err(_) => return failed(r, start, "timeout before response headers".into()),
        };
        r.status = Some(resp.status().as_u16());
        read_headers(&mut r, resp.headers());
        let mut gaps = StreamGaps::default();
        if p.stream && resp.status().is_success() {
            read_stream(&mut r, &mut resp, start, deadline, &mut gaps).await;
        } else {
            read_body(&mut r, resp, deadline).await;
            r.ttft_ms = Some(ms(start.elapsed()));
        }
        r.e2e_ms = ms(start.elapsed());
        self.chunk_gaps.record(&r, &gaps);
        r
    }

    /// Runs the prefill leg against `--direct-prefill` and returns the decode body, or
    /// `None` after recording why it failed.
    #[allow(clippy::too_many_arguments)]
    async fn direct_prefill(
        &self,
        r: &mut RequestResult,
        deadline: tokio::time::Instant,
        prefill_url: &str,
        prefill_host: &str,
        path: &str,
        body: &Value,
        id: &str,
    ) -> Option<Value> {
        let req = self.request(
            format!("{prefill_url}{path}"),
            &prefill_body(body),
            Some(id),
            None,
        );
        let resp = match timeout_at(deadline, req.send()).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => {
                r.error = Some(format!("prefill leg: {}", transport_error(&e)));
                return None;
            }
            Err(_) => {
                r.error = Some("prefill leg: timeout".into());
                return None;
            }
        };
        let status = resp.status().as_u16();
        let bytes = match timeout_at(deadline, resp.bytes()).await {
            Ok(Ok(b)) => b,
            _ => {
                r.status = Some(status);
                r.error = Some("prefill leg: body not received".into());
                return None;
            }
        };
        let kv = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| v.get("kv_transfer_params").cloned())
            .filter(Value::is_object);
        match (status, kv) {
            (200, Some(kv)) => Some(decode_body(body, kv, prefill_host)),
            (200, None) => {
                r.status = Some(status);
                r.error = Some("prefill leg: no kv_transfer_params in the response".into());
                None
            }
            _ => {
                r.status = Some(status);
                r.error = Some(format!("prefill leg: {}", error_message(&bytes)));
                None
            }
        }
    }
}

fn failed(mut r: RequestResult, start: Instant, error: String) -> RequestResult {
    r.error = Some(error);
    r.e2e_ms = ms(start.elapsed());
    r
}

fn transport_error(e: &reqwest::Error) -> String {
    if e.is_connect() {
        "connection failed".into()
    } else if e.is_timeout() {
        "timeout".into()
    } else {
        let mut msg = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            msg = format!("{msg}: {s}");
            source = s.source();
        }
        msg
    }
}

fn read_headers(r: &mut RequestResult, headers: &HeaderMap) {
    let get = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    r.target_pod = get("target-pod");
    r.prefill_target_pod = get("prefill-target-pod");
    r.request_id = get("request-id");
    for (name, value) in headers {
        if name.as_str().starts_with("x-error-") {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            r.error_headers.insert(name.as_str().to_string(), value);
        }
    }
}

/// The `error.message` of an OpenAI-style error body, else the start of the body text.
fn error_message(bytes: &[u8]) -> String {
    let parsed: Option<Value> = serde_json::from_slice(bytes).ok();
    let msg = parsed
        .as_ref()
        .and_then(|v| v.get("error"))
        .and_then(|e| {
            e.get("message")
                .and_then(Value::as_str)
                .or_else(|| e.as_str())
        })
        .map(str::to_string)
        .or_else(|| {
            parsed
                .as_ref()
                .and_then(|v| v.get("message"))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(bytes).into_owned());
    msg.chars().take(200).collect()
}

async fn read_body(r: &mut RequestResult, resp: reqwest::Response, deadline: tokio::time::Instant) {
    let ok = resp.status().is_success();
    let bytes = match timeout_at(deadline, resp.bytes()).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            r.error = Some(format!("body: {}", transport_error(&e)));
            return;
        }
        Err(_) => {
            r.error = Some("timeout reading the body".into());
            return;
        }
    };
    if !ok {
        r.error = Some(error_message(&bytes));
        return;
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(v) if v.get("error").is_some() => r.error = Some(error_message(&bytes)),
        Ok(v) => {
            r.tokens = v
                .pointer("/usage/completion_tokens")
                .and_then(Value::as_u64)
                .unwrap_or_default();
        }
        Err(_) => r.error = Some("response body is not JSON".into()),
    }
}

/// What an SSE stream has shown so far.
#[derive(Debug, Default, PartialEq)]
pub struct SseProgress {
    pub token_events: u64,
    pub usage_tokens: Option<u64>,
    pub done: bool,
    pub error: Option<String>,
}

impl SseProgress {
    /// Consumes whole events from `buf` (leaving a trailing partial one); returns true if a
    /// token event was among them.
    pub fn feed(&mut self, buf: &mut String) -> bool {
        let mut saw_token = false;
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    self.done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    self.error
                        .get_or_insert_with(|| "malformed SSE data".into());
                    continue;
                };
                if let Some(err) = v.get("error") {
                    let msg = err
                        .get("message")
                        .and_then(Value::as_str)
                        .unwrap_or("error event");
                    self.error
                        .get_or_insert_with(|| format!("stream error: {msg}"));
                }
                if let Some(n) = v
                    .pointer("/usage/completion_tokens")
                    .and_then(Value::as_u64)
                {
                    self.usage_tokens = Some(n);
                }
                let choice = v.pointer("/choices/0");
                let text = choice
                    .and_then(|c| c.get("text").or_else(|| c.pointer("/delta/content")))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                if !text.is_empty() {
                    self.token_events += 1;
                    saw_token = true;
                }
            }
        }
        saw_token
    }
}

async fn read_stream(
    r: &mut RequestResult,
    resp: &mut reqwest::Response,
    start: Instant,
    deadline: tokio::time::Instant,
    gaps: &mut StreamGaps,
) {
    let mut progress = SseProgress::default();
    let mut buf = String::new();
    let mut last_token: Option<Instant> = None;
    loop {
        match timeout_at(deadline, resp.chunk()).await {
            Ok(Ok(Some(chunk))) => {
                buf.push_str(&String::from_utf8_lossy(&chunk).replace("\r\n", "\n"));
                if progress.feed(&mut buf) {
                    let now = Instant::now();
                    if r.ttft_ms.is_none() {
                        r.ttft_ms = Some(ms(now - start));
                    }
                    if let Some(last) = last_token {
                        let gap = ms(now - last);
                        r.max_gap_ms = Some(r.max_gap_ms.map_or(gap, |m| m.max(gap)));
                        gaps.record(gap);
                    }
                    last_token = Some(now);
                }
            }
            Ok(Ok(None)) => break,
            Ok(Err(e)) => {
                progress
                    .error
                    .get_or_insert_with(|| format!("stream broken: {}", transport_error(&e)));
                break;
            }
            Err(_) => {
                progress
                    .error
                    .get_or_insert_with(|| "timeout while streaming".into());
                break;
            }
        }
    }
    r.tokens = progress.usage_tokens.unwrap_or(progress.token_events);
    r.error = progress
        .error
        .or_else(|| (!progress.done).then(|| "stream ended without [DONE]".to_string()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_progress_counts_tokens_usage_done_and_errors() {
        let mut p = SseProgress::default();
        let mut buf = String::from("data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\" tok0\"}}]}\n\ndata: {\"choi");
        assert!(p.feed(&mut buf));
        assert_eq!(p.token_events, 1);
        assert_eq!(buf, "data: {\"choi");
        buf.push_str("ces\":[{\"text\":\" tok1\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"completion_tokens\":2}}\n\ndata: [DONE]\n\n");
        assert!(p.feed(&mut buf));
        assert_eq!(
            (p.token_events, p.usage_tokens, p.done, p.error.clone()),
            (2, Some(2), true, None)
        );
        let mut e = SseProgress::default();
        e.feed(&mut "data: {\"error\":{\"message\":\"boom\"}}\n\n".to_string());
        assert_eq!(e.error.as_deref(), Some("stream error: boom"));
    }

    #[test]
    fn only_loopback_targets() {
        assert!(check_loopback("http://127.0.0.1:10000").is_ok());
        assert!(check_loopback("http://127.0.10.2:8000/x").is_ok());
        assert!(check_loopback("http://localhost:1").is_ok());
        assert!(check_loopback("http://[::1]:1").is_ok());
        assert!(check_loopback("http://10.0.0.1:8000").is_err());
        assert!(check_loopback("http://example.com").is_err());
        assert!(check_loopback("not a url").is_err());
    }

    #[test]
    fn error_messages_are_extracted() {
        assert_eq!(
            error_message(br#"{"error":{"message":"boom","type":"x"}}"#),
            "boom"
        );
        assert_eq!(
            error_message(br#"{"object":"error","message":"flat"}"#),
            "flat"
        );
        assert_eq!(error_message(br#"{"error":"plain"}"#), "plain");
        assert_eq!(
            error_message(b"upstream connect error"),
            "upstream connect error"
        );
    }
}
