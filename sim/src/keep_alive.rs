//! The engines' keep-alive close: vLLM, SGLang and TRT-LLM serve their API with uvicorn, which
//! closes a kept-alive connection that has carried no request for 5 s (`timeout_keep_alive`).
//!
//! A proxy that keeps idle upstream connections longer (Envoy's default is an hour) races the
//! engine's close: a request written just as the engine closes the connection fails with no
//! answer (Envoy's 503 "upstream connect error or disconnect/reset before headers"). pd-sim
//! closes idle connections the same way so that the race, and the gateway's guard against it
//! (an upstream idle timeout below the engines'), can be seen here.
//!
//! A connection is idle while no request is in flight on it: from the moment the last response
//! body is done (sent or dropped) to the next request's arrival. A long response (a slow
//! decode, a hung fault) is never cut by this timer, as uvicorn's is not.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, Response};
use futures_util::future::BoxFuture;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::time::Instant;

/// uvicorn's default `timeout_keep_alive`, which the engines keep.
pub const ENGINE_KEEP_ALIVE: Duration = Duration::from_secs(5);

/// Requests in flight on one connection, and when the last one ended.
#[derive(Debug)]
pub struct Activity {
    in_flight: AtomicUsize,
    idle_since: Mutex<Instant>,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            in_flight: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
        })
    }

    /// When the connection may be closed, or `None` while a request is in flight.
    pub fn close_at(&self, timeout: Duration) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = *self.idle_since.lock().unwrap_or_else(|e| e.into_inner());
        Some(since + timeout)
    }

    fn begin(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Busy(self.clone())
    }
}

/// One request in flight; dropped with its response body.
#[derive(Debug)]
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        // Stamped before the count falls, so a watcher that sees no request in flight also
        // sees this end.
        *self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that holds its request's [`Busy`] until hyper is done with it.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A hyper service that counts its requests in an [`Activity`].
pub struct Counted<S> {
    pub inner: S,
    pub activity: Arc<Activity>,
}

impl<S, B> hyper::service::Service<Request<B>> for Counted<S>
where
    S: hyper::service::Service<Request<B>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn call(&self, request: Request<B>) -> Self::Future {
        let busy = self.activity.begin();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|inner| Body::new(Tracked { inner, _busy: busy })))
        })
    }
}

/// Resolves when the connection has been idle for `timeout`.
pub async fn idle_for(activity: Arc<Activity>, timeout: Duration) {
    loop {
        match activity.close_at(timeout) {
            Some(at) if at <= Instant::now() => return,
            Some(at) => tokio::time::sleep_until(at).await,
            // A request in flight: look again a timeout later (its end restarts the clock).
            None => tokio::time::sleep(timeout).await,
        }
    }
}
