//! The Kubernetes source: watches model-serving Pods through the API server (kube-rs).
//!
//! The watch filters on the label selector `model.aibrix.ai/name` (label exists). AIBrix also
//! accepts the model name as an annotation, and [`PodRecord::from_pod`] honours that, but an
//! API-server watch can only filter on labels: a pod that names its model only in an annotation
//! is invisible to this source. Listing every pod in the cluster to find those would cost far
//! more than it is worth, so such pods must carry the label to be routed.
//!
//! Each scope (all namespaces, or one per `--namespace`) runs one [`watcher::watcher`], which
//! lists, then watches from the list's `resourceVersion` with bookmarks. When a watch connection ends
//! it resumes from the last seen version; when the API server answers `410 Gone` (the version
//! was compacted away) it re-lists. Both are handled inside kube-runtime; [`FleetState`] buffers a
//! re-list and swaps it in whole, and errors are retried with a capped exponential backoff while
//! the last good fleet stays published. A body cut mid-stream is resumed like a clean end by
//! kube-client; a `410` is logged, not counted as a failure; any other list or watch error is
//! counted (`pd_control_fleet_reload_errors_total`) and retried.
//!
//! Publishing: after every burst of events (drained without waiting, so a re-list or a rollout
//! becomes one update) the whole fleet, sorted by namespace then name, is offered to the
//! [`FleetPublisher`], which forwards it only if it differs from the current one.
//!
//! LoRA adapters: each scope also watches AIBrix `ModelAdapter`s
//! (`modeladapters.model.aibrix.ai/v1alpha1`), whose `status.instances` name the pods that
//! loaded the adapter (see [`crate::fleet::assign_adapters`]). They are optional: the pods are
//! published without waiting for them, and a cluster without the CRD (404) or without the grant
//! (403) is told once in the log and otherwise routes its pods as before.
//!
//! Dead connections: every answer of the API server (a list, a watch's next event) is awaited at
//! most [`KubeSettings::read_timeout`], and each watch asks the server to end it after
//! [`KubeSettings::watch_timeout_s`] (it is then resumed from its version). Without them a list
//! sent on a half-open connection (a control-plane node or load balancer gone without a reset)
//! waits for the kernel, a quarter of an hour or for ever, with the fleet frozen and nothing
//! counted; a dead watch went unnoticed for kube's 290 s default.
//!
//! Start-up: a failed first list is retried (with the backoff) for
//! [`KubeSettings::startup_timeout`], since a control-plane upgrade or the API server's
//! priority-and-fairness 429s during a mass restart are passing; 401, 403 and 404 answers, a bad
//! URL or configuration fail at once.
//!
//! RBAC: the service account needs `list` and `watch` on `pods` (and on `modeladapters` in the
//! `model.aibrix.ai` group, for adapters), cluster-wide, or in each `--namespace` (a Role per
//! namespace is then enough).

mod state;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{self, BoxStream};
use futures_util::{FutureExt as _, StreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt as _;
use kube::Api;

use super::{FleetPublisher, FleetSource, Shutdown, SourceError};
use crate::fleet::{PodRecord, LABEL_MODEL};

pub use state::FleetState;

/// Why the Kubernetes source could not start or keep up.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("--kube-api-url {url:?} is not a valid URL: {reason}")]
    ApiUrl { url: String, reason: String },
    #[error("no Kubernetes configuration found (neither in-cluster nor kubeconfig): {0}")]
    Infer(#[source] kube::config::InferConfigError),
    #[error("cannot build the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error("watching pods {scope}: {source}")]
    Watch {
        scope: String,
        source: watcher::Error,
    },
    #[error("the pod watch ended unexpectedly")]
    Ended,
}

/// Where and how to watch.
#[derive(Debug, Clone)]
pub struct KubeSettings {
    /// API server URL (plain `http://` allowed); `None` infers in-cluster or kubeconfig.
    pub api_url: Option<String>,
    /// Namespaces to watch; empty means all.
    pub namespaces: Vec<String>,
    /// First retry delay after a failed list or watch; doubles up to `backoff_max`.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// The longest any answer of the API server is awaited (kube's `read_timeout`, counted
    /// from each request's write); above `watch_timeout_s` so a quiet healthy watch is not cut.
    pub read_timeout: Duration,
    /// `timeoutSeconds` of each watch request: the server ends the watch after it and it is
    /// resumed; kube-runtime also gives up on a watch silent for this plus 5 s.
    pub watch_timeout_s: u32,
    /// How long start-up retries a failed first pod list before giving up (`--kube-startup-timeout`).
    pub startup_timeout: Duration,
}

impl KubeSettings {
    pub fn new(api_url: Option<String>, namespaces: Vec<String>) -> KubeSettings {
        KubeSettings {
            api_url,
            namespaces,
            backoff_min: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            read_timeout: Duration::from_secs(75),
            watch_timeout_s: 55,
            startup_timeout: Duration::from_secs(60),
        }
    }
}

/// An answer no retry changes: bad credentials, a missing grant, a wrong API path.
fn permanent(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status)) => {
            matches!(status.code, 401 | 403 | 404)
        }
        _ => false,
    }
}

/// One event of a scope's watches.
enum Watched {
    // Boxed: events are kilobytes, and the stream's items are moved around.
    Pods(Box<Result<Event<Pod>, watcher::Error>>),
    Adapters(Box<Result<Event<DynamicObject>, watcher::Error>>),
}

type Item = (usize, Watched);

/// AIBrix's LoRA adapter resource.
pub(crate) fn model_adapters() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(
            "model.aibrix.ai",
            "v1alpha1",
            crate::fleet::KIND_MODEL_ADAPTER,
        ),
        "modeladapters",
    )
}

/// The API server has no such resource (the CRD is not installed) or denies it to us.
fn unavailable(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => {
            status.code == 404 || status.code == 403
        }
        _ => false,
    }
}

pub struct KubernetesSource {
    settings: KubeSettings,
    /// Human-readable scope of each watch, indexed like the watch streams.
    scopes: Vec<String>,
    state: FleetState,
    /// Created by `load`, consumed by `watch`: the same watches continue, so nothing that
    /// happened between the two is missed.
    events: Option<BoxStream<'static, Item>>,
    /// The adapter watch was found unavailable (and said so in the log).
    adapters_unavailable: bool,
}

impl KubernetesSource {
    pub fn new(mut settings: KubeSettings) -> KubernetesSource {
        settings.namespaces.sort();
        settings.namespaces.dedup();
        let scopes: Vec<String> = if settings.namespaces.is_empty() {
            vec!["in all namespaces".into()]
        } else {
            settings
                .namespaces
                .iter()
                .map(|ns| format!("in namespace {ns}"))
                .collect()
        };
        KubernetesSource {
            state: FleetState::new(scopes.len()),
            settings,
            scopes,
            events: None,
            adapters_unavailable: false,
        }
    }

    fn watches(&self, client: kube::Client) -> BoxStream<'static, Item> {
        let config = watcher::Config::default()
            .labels(LABEL_MODEL)
            .timeout(self.settings.watch_timeout_s);
        let resource = model_adapters();
        let apis: Vec<(Api<Pod>, Api<DynamicObject>)> = if self.settings.namespaces.is_empty() {
            vec![(Api::all(client.clone()), Api::all_with(client, &resource))]
        } else {
            self.settings
                .namespaces
                .iter()
                .map(|ns| {
                    (
                        Api::namespaced(client.clone(), ns),
                        Api::namespaced_with(client.clone(), ns, &resource),
                    )
                })
                .collect()
        };
        let (min, max) = (self.settings.backoff_min, self.settings.backoff_max);
        let mut streams = Vec::new();
        for (index, (pods, adapters)) in apis.into_iter().enumerate() {
            let backoff = RetryBackoff::new(min, max);
            let answered = backoff.answered.clone();
            streams.push(
                watcher::watcher(pods, config.clone())
                    .inspect(move |item| note_answer(&answered, item))
                    .backoff(backoff)
                    .map(move |item| (index, Watched::Pods(Box::new(item))))
                    .boxed(),
            );
            let backoff = RetryBackoff::new(min, max);
            let answered = backoff.answered.clone();
            streams.push(
                watcher::watcher(
                    adapters,
                    watcher::Config::default().timeout(self.settings.watch_timeout_s),
                )
                .inspect(move |item| note_answer(&answered, item))
                .backoff(backoff)
                .map(move |item| (index, Watched::Adapters(Box::new(item))))
                .boxed(),
            );
        }
        stream::select_all(streams).boxed()
    }

    fn scope(&self, index: usize) -> String {
        self.scopes.get(index).cloned().unwrap_or_default()
    }

    /// Applies one watch item; returns whether the fleet may have changed.
    fn handle(&mut self, (index, item): Item, publisher: &FleetPublisher) -> bool {
        let item = match item {
            Watched::Pods(item) => *item,
            Watched::Adapters(item) => match *item {
                Ok(event) => {
                    self.adapters_unavailable = false;
                    return self.state.apply_adapter(index, event);
                }
                Err(error) => return self.adapters_failed(index, error, Some(publisher)),
            },
        };
        match item {
            Ok(event) => self.state.apply(index, event),
            // Routine: the resume point was compacted; the watcher re-lists next.
            Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                let scope = self.scope(index);
                tracing::info!(%scope, "pod watch expired (410 Gone); re-listing");
                false
            }
            Err(source) => {
                let error = KubeError::Watch {
                    scope: self.scope(index),
                    source,
                };
                publisher.reload_failed(&self.describe(), &error);
                false
            }
        }
    }
}

impl KubernetesSource {
    /// A failed adapter list or watch: without the resource or the grant, said once and not
    /// counted (adapters are optional), and the scope's adapters known so far dropped (a
    /// revoked grant would otherwise freeze them: pods kept advertising adapters they may have
    /// unloaded, and LoRA requests went there); otherwise counted like a pod watch failure
    /// (when a publisher is running) and retried. Returns whether the fleet changed.
    fn adapters_failed(
        &mut self,
        index: usize,
        error: watcher::Error,
        publisher: Option<&FleetPublisher>,
    ) -> bool {
        let scope = format!("{} (ModelAdapters)", self.scope(index));
        if unavailable(&error) {
            let dropped = self.state.forget_adapters(index);
            if dropped {
                tracing::warn!(
                    %scope,
                    %error,
                    "ModelAdapters can no longer be read; their adapters are dropped from the \
                     pods until they can be"
                );
            } else if !std::mem::replace(&mut self.adapters_unavailable, true) {
                tracing::info!(
                    %scope,
                    %error,
                    "ModelAdapters are not available (CRD not installed, or no list/watch \
                     grant); LoRA adapters are not routed"
                );
            }
            return dropped;
        }
        match (publisher, error) {
            (_, watcher::Error::WatchError(status)) if status.code == 410 => {
                tracing::info!(%scope, "watch expired (410 Gone); re-listing");
            }
            (Some(publisher), source) => {
                let error = KubeError::Watch { scope, source };
                publisher.reload_failed(&self.describe(), &error);
            }
            (None, error) => tracing::warn!(%scope, %error, "list failed; retrying"),
        }
        false
    }
}

impl FleetSource for KubernetesSource {
    fn kind(&self) -> &'static str {
        "kubernetes"
    }

    fn describe(&self) -> String {
        let server = self
            .settings
            .api_url
            .as_deref()
            .unwrap_or("inferred config");
        let scope = if self.settings.namespaces.is_empty() {
            "all namespaces".to_string()
        } else {
            format!("namespaces {}", self.settings.namespaces.join(", "))
        };
        format!("Kubernetes pods labelled {LABEL_MODEL} in {scope} ({server})")
    }

    async fn load(&mut self) -> Result<Vec<PodRecord>, SourceError> {
        // A free function: the source holds a non-`Sync` stream, so no `&self` may cross an await.
        let client = client(
            self.settings.api_url.clone(),
            self.settings.read_timeout,
            true,
        )
        .await?;
        let mut events = self.watches(client);
        // Unlike later failures, a first pod list failing for good is fatal: there is no good
        // fleet to keep. Adapters are optional and never hold the start up.
        let started = tokio::time::Instant::now();
        while !self.state.synced() {
            let (index, item) = match events.next().await {
                Some((index, Watched::Pods(item))) => (index, *item),
                Some((index, Watched::Adapters(item))) => {
                    match *item {
                        Ok(event) => {
                            self.state.apply_adapter(index, event);
                        }
                        Err(error) => {
                            self.adapters_failed(index, error, None);
                        }
                    }
                    continue;
                }
                None => return Err(KubeError::Ended.into()),
            };
            match item {
                Ok(event) => {
                    self.state.apply(index, event);
                }
                Err(source)
                    if !permanent(&source) && started.elapsed() < self.settings.startup_timeout =>
                {
                    tracing::warn!(
                        scope = %self.scope(index),
                        error = %source,
                        "listing pods failed; retrying until the start-up timeout"
                    );
                }
                Err(source) => {
                    return Err(KubeError::Watch {
                        scope: self.scope(index),
                        source,
                    }
                    .into())
                }
            }
        }
        self.events = Some(events);
        Ok(self.state.fleet())
    }

    async fn watch(mut self, publisher: FleetPublisher, mut shutdown: Shutdown) {
        let Some(mut events) = self.events.take() else {
            tracing::error!("kubernetes source watched before a successful load");
            return;
        };
        let source = self.describe();
        loop {
            let next = tokio::select! {
                _ = shutdown.requested() => return,
                next = events.next() => next,
            };
            let Some(item) = next else {
                publisher.reload_failed(&source, &KubeError::Ended);
                return;
            };
            let mut changed = self.handle(item, &publisher);
            // Fold a burst (a re-list, a rollout) into one publish.
            while let Some(Some(item)) = events.next().now_or_never() {
                changed |= self.handle(item, &publisher);
            }
            if changed && self.state.synced() {
                let pods = self.state.fleet();
                let count = pods.len();
                if publisher.publish(pods) {
                    tracing::info!(%source, pods = count, "fleet updated");
                }
            }
        }
    }
}

/// The client for `--kube-api-url` (no auth, plain http allowed), else in-cluster/kubeconfig.
/// `retry`: kube's own retry of 429, 503 and 504 answers (off for callers that retry each
/// round themselves and must see what each call got: a write retried after a 504 that had
/// committed reads as a conflict).
pub(crate) async fn client(
    api_url: Option<String>,
    read_timeout: Duration,
    retry: bool,
) -> Result<kube::Client, KubeError> {
    let mut config = match api_url {
        Some(url) => {
            let uri = url
                .parse()
                .map_err(|e: http::uri::InvalidUri| KubeError::ApiUrl {
                    reason: e.to_string(),
                    url,
                })?;
            kube::Config::new(uri)
        }
        None => kube::Config::infer().await.map_err(KubeError::Infer)?,
    };
    config.read_timeout = Some(read_timeout);
    // From each request's write, not from when its pooled connection went idle.
    config.reset_reader_on_write = true;
    config.default_retry = retry;
    kube::Client::try_from(config).map_err(KubeError::Client)
}

/// Marks that the API server answered a watch: a list completed (`InitDone`) or a change came.
/// `Init` is no answer: kube's watcher yields it before listing, asking nothing.
fn note_answer<K>(answered: &AtomicBool, item: &Result<Event<K>, watcher::Error>) {
    if matches!(
        item,
        Ok(Event::InitDone | Event::Apply(_) | Event::Delete(_))
    ) {
        answered.store(true, Ordering::Relaxed);
    }
}

/// Exponential retry delay, each delay drawn between half and all of its step: pd-control
/// replicas (and scopes) that lost the API server together would otherwise come back to it in
/// lockstep, every retry a burst of lists.
///
/// It starts again from the minimum once the server has answered (`answered`, set by
/// [`note_answer`] on the stream it retries), not on kube's `reset`: kube's watcher resets its
/// backoff on every item it yields, and after a failed list it yields `Init` before listing
/// again without asking the server anything, so a list that kept failing was retried at the
/// minimum delay for ever (a cluster without the ModelAdapter CRD: several lists a second per
/// scope and replica, for the life of the process).
struct RetryBackoff {
    min: Duration,
    max: Duration,
    next: Duration,
    answered: Arc<AtomicBool>,
    rng: fastrand::Rng,
}

impl RetryBackoff {
    fn new(min: Duration, max: Duration) -> RetryBackoff {
        RetryBackoff::seeded(min, max, fastrand::Rng::new())
    }

    fn seeded(min: Duration, max: Duration, rng: fastrand::Rng) -> RetryBackoff {
        RetryBackoff {
            min,
            max,
            next: min,
            answered: Arc::new(AtomicBool::new(false)),
            rng,
        }
    }

    /// The delay after an error.
    fn after_error(&mut self) -> Duration {
        if self.answered.swap(false, Ordering::Relaxed) {
            self.next = self.min;
        }
        let step = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        step.mul_f64(0.5 + 0.5 * self.rng.f64())
    }
}

impl Iterator for RetryBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.after_error())
    }
}

impl Backoff for RetryBackoff {
    /// Ignored: see [`RetryBackoff`].
    fn reset(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_caps_restarts_once_answered_and_spreads() {
        let ms = Duration::from_millis;
        for seed in 0..50 {
            let rng = fastrand::Rng::with_seed(seed);
            let mut b = RetryBackoff::seeded(ms(100), ms(300), rng);
            let got: Vec<_> = (0..4).map(|_| b.after_error()).collect();
            for (delay, step) in got.iter().zip([100, 200, 300, 300]) {
                assert!(
                    *delay >= ms(step / 2) && *delay <= ms(step),
                    "{delay:?} for a step of {step} ms"
                );
            }
            // kube's watcher resets after every item, an `Init` after a failed list included.
            b.reset();
            note_answer::<Pod>(&b.answered, &Ok(Event::Init));
            assert!(
                b.after_error() >= ms(150),
                "still failing: still backing off"
            );
            note_answer::<Pod>(&b.answered, &Ok(Event::InitDone));
            assert!(
                b.after_error() <= ms(100),
                "answered: from the minimum again"
            );
        }
        // Two replicas that failed together do not retry together.
        let mut a = RetryBackoff::seeded(ms(1000), ms(1000), fastrand::Rng::with_seed(1));
        let mut b = RetryBackoff::seeded(ms(1000), ms(1000), fastrand::Rng::with_seed(2));
        assert_ne!(a.next(), b.next());
    }

    #[test]
    fn describe_and_dedup_namespaces() {
        let s = KubernetesSource::new(KubeSettings::new(
            Some("http://127.0.0.1:1".into()),
            vec!["b".into(), "a".into(), "b".into()],
        ));
        assert_eq!(s.scopes, ["in namespace a", "in namespace b"]);
        assert!(s
            .describe()
            .contains("namespaces a, b (http://127.0.0.1:1)"));
    }
}
