//! The engines' `--api-key`: with it, vLLM refuses any `/v1/...` request and SGLang any
//! request but its health and metrics pages unless it carries `Authorization: Bearer <key>`
//! (401 `{"error": "Unauthorized"}`; `OPTIONS` passes). A gateway must then carry the client's
//! key on every call it makes to an engine of its own accord, SGLang's `/abort_request`
//! included. TRT-LLM's `trtllm-serve` has no such option, so its pods stay open.
//!
//! The simulator's own pages (`/sim/...`) are never guarded: tests read them.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use crate::log::LogEntry;
use crate::metrics::Engine;
use crate::server::{json_response, PodCtx, MAX_BODY_BYTES};

/// Whether `engine` with an API key asks for it on a `method` request to `path`.
pub fn guarded(engine: Engine, method: &Method, path: &str) -> bool {
    if method == Method::OPTIONS || path.starts_with("/sim/") {
        return false;
    }
    match engine {
        Engine::Vllm => path.starts_with("/v1"),
        Engine::Sglang => !path.starts_with("/health") && !path.starts_with("/metrics"),
        Engine::Trtllm => false,
    }
}

/// Whether an `authorization` header value carries `key` as the engines compare it (the
/// whole value, byte for byte).
pub fn admits(key: &str, authorization: Option<&[u8]>) -> bool {
    authorization
        .is_some_and(|value| value.strip_prefix(b"Bearer ".as_slice()) == Some(key.as_bytes()))
}

/// Middleware of a pod's router: refuses (and logs, so tests see the refusal) a guarded request
/// without the key.
pub async fn require(State(ctx): State<PodCtx>, request: Request<Body>, next: Next) -> Response {
    let Some(key) = ctx.pod.config.api_key.as_deref() else {
        return next.run(request).await;
    };
    let engine = Engine::from_label(&ctx.pod.record.engine);
    let path = request.uri().path();
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    if !guarded(engine, request.method(), path) || admits(key, authorization) {
        return next.run(request).await;
    }
    let mut entry = LogEntry::new(&ctx.pod.record, path, request.headers());
    entry.status = StatusCode::UNAUTHORIZED.as_u16();
    entry.error = Some("Unauthorized".into());
    // The body too, so that a test finds the refused request by what it asked for.
    let body = axum::body::to_bytes(request.into_body(), MAX_BODY_BYTES).await;
    entry.body = body.ok().and_then(|b| serde_json::from_slice(&b).ok());
    ctx.pod.log.push(entry);
    json_response(
        StatusCode::UNAUTHORIZED,
        &serde_json::json!({"error": "Unauthorized"}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_engine_guards_what_it_guards() {
        let post = Method::POST;
        assert!(guarded(Engine::Vllm, &post, "/v1/chat/completions"));
        assert!(!guarded(Engine::Vllm, &Method::GET, "/metrics"));
        assert!(!guarded(Engine::Vllm, &Method::GET, "/health"));
        assert!(!guarded(Engine::Vllm, &Method::OPTIONS, "/v1/models"));
        assert!(guarded(Engine::Sglang, &post, "/abort_request"));
        assert!(guarded(Engine::Sglang, &post, "/v1/completions"));
        assert!(guarded(Engine::Sglang, &Method::GET, "/server_info"));
        assert!(!guarded(Engine::Sglang, &Method::GET, "/health_generate"));
        assert!(!guarded(Engine::Sglang, &Method::GET, "/metrics"));
        assert!(!guarded(Engine::Trtllm, &post, "/v1/completions"));
        assert!(!guarded(Engine::Sglang, &Method::GET, "/sim/requests"));
    }

    #[test]
    fn only_the_exact_bearer_value_is_admitted() {
        assert!(admits("k1", Some(b"Bearer k1")));
        assert!(!admits("k1", None));
        assert!(!admits("k1", Some(b"Bearer k2")));
        assert!(!admits("k1", Some(b"bearer k1")));
        assert!(!admits("k1", Some(b"Bearer k1 ")));
        assert!(!admits("k1", Some(b"k1")));
    }
}
