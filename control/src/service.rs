//! Wires the fleet source, the scraper, the snapshot builder and the server together.
//!
//! One control-loop task owns all mutable state (scrape history, snapshot versions), so nothing
//! on the request path takes a lock: the server only clones the `Arc` of the current snapshot.

use std::future::Future;
use std::io::{self, Write as _};
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt as _;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::config::{Config, ConfigError, SourceKind, UserLimitsSetting};
use crate::eds::{EdsError, EdsWriter};
use crate::limits::UserLimits;
use crate::replicas::ReplicaBook;
use crate::scrape::{Outcome, ScrapeBook, Scraper};
use crate::server::{self, AppState};
use crate::snapshot::{self, Published, SnapshotBuilder};
use crate::sources::{
    FileSource, Fleet, FleetPublisher, FleetSource, KubeSettings, KubernetesSource, Shutdown,
    SourceError,
};
use crate::stats::{Stats, Task};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("cannot load the initial fleet from {origin}: {source}")]
    InitialFleet { origin: String, source: SourceError },
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: io::Error },
    #[error("cannot build the scrape HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("HTTP server failed: {0}")]
    Serve(#[source] io::Error),
    #[error("cannot install signal handlers: {0}")]
    Signal(#[source] io::Error),
    #[error(transparent)]
    Token(#[from] crate::auth::TokenError),
    #[error(transparent)]
    Eds(#[from] EdsError),
    #[error("invalid external router configuration: {0}")]
    External(#[from] crate::external::config::ExternalConfigError),
    #[error("{0}")]
    ExternalClient(String),
    #[error("background task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    #[error("cannot start leader election: {0}")]
    Leader(String),
    #[error("the {0} ended while pd-control was not shutting down")]
    TaskEnded(String),
}

/// How long the control loop may go without completing an iteration before `/readyz` fails
/// and snapshot polls get 503 instead of 304: `max(10 × refresh, 5 s)`.
///
/// A healthy loop completes one at least every `refresh` (its ticker), plus the time one
/// iteration takes: building the snapshot (milliseconds) and, on a fleet change, the endpoint
/// file's write with its `fsync`, which a busy or network disk can stretch to seconds. Ten
/// ticks missed in a row is no hiccup; the 5 s floor keeps the default 50 ms interval from
/// calling a slow `fsync` a hang (and failing readiness under disk pressure), and is half the
/// filter's default `snapshot_stale_after_ms` (10 s), so with the defaults a gateway flags a
/// frozen snapshot within about 5 s + its poll wait + 10 s of the loop stopping.
pub fn loop_stale_after(refresh: Duration) -> Duration {
    refresh.saturating_mul(10).max(Duration::from_secs(5))
}

/// A running service. Dropping it without [`Service::shutdown`] leaves the tasks running until
/// the runtime stops.
pub struct Service {
    local_addr: SocketAddr,
    xds_addr: Option<SocketAddr>,
    metrics_addr: Option<SocketAddr>,
    stats: Arc<Stats>,
    snapshots: watch::Receiver<Arc<Published>>,
    shutdown: watch::Sender<bool>,
    server: Option<JoinHandle<io::Result<()>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Service {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Where the EDS service listens (`--xds-listen`), once bound.
    pub fn xds_addr(&self) -> Option<SocketAddr> {
        self.xds_addr
    }

    /// Where health and metrics alone are served (`--metrics-listen`), once bound.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// The snapshot currently served.
    pub fn current(&self) -> Arc<Published> {
        self.snapshots.borrow().clone()
    }

    /// Resolves only on an error: the HTTP server stopped by itself, or a background task
    /// nothing restarts (the control loop, the fleet source) ended. The binary then exits
    /// non-zero, so that its supervisor (Kubernetes) starts it afresh rather than leaving a
    /// service whose snapshot no longer follows the fleet.
    pub async fn stopped(&mut self) -> Result<(), Error> {
        let stats = self.stats.clone();
        let task_end = async move {
            stats.task_end().await;
            let ended = [Task::ControlLoop, Task::FleetSource, Task::LeaderElection]
                .into_iter()
                .filter(|t| stats.has_ended(*t))
                .map(Task::name)
                .collect::<Vec<_>>()
                .join(" and ");
            Error::TaskEnded(ended)
        };
        match self.server.as_mut() {
            Some(server) => tokio::select! {
                result = server => {
                    self.server = None;
                    result?.map_err(Error::Serve)?;
                    Err(Error::Serve(io::Error::other("server exited")))
                }
                ended = task_end => Err(ended),
            },
            None => Err(task_end.await),
        }
    }

    /// Stops accepting requests, lets in-flight ones finish, and stops the background tasks.
    /// A task that panicked earlier is reported, after the others and the server stopped.
    pub async fn shutdown(mut self) -> Result<(), Error> {
        let _ = self.shutdown.send(true);
        let mut failed = None;
        for task in self.tasks.drain(..) {
            if let Err(e) = task.await {
                failed.get_or_insert(e);
            }
        }
        if let Some(server) = self.server.take() {
            server.await?.map_err(Error::Serve)?;
        }
        failed.map_or(Ok(()), |e| Err(e.into()))
    }
}

/// Starts the service with the source `config` selects (`--source`, `--fleet`).
pub async fn start(config: Config) -> Result<Service, Error> {
    config.validate()?;
    match (config.source_kind(), config.fleet.clone()) {
        (SourceKind::File, Some(fleet)) => {
            let source = FileSource::new(fleet, config.refresh_interval);
            start_with_source(config, source).await
        }
        (SourceKind::File, None) => Err(ConfigError::MissingFleet.into()),
        (SourceKind::Kubernetes, _) => {
            let mut settings =
                KubeSettings::new(config.kube_api_url.clone(), config.namespaces.clone());
            settings.startup_timeout = config.kube_startup_timeout;
            start_with_source(config, KubernetesSource::new(settings)).await
        }
    }
}

/// Starts the service fed by any fleet source. Returns once the initial fleet is loaded and the
/// listener is bound, so the caller can announce the address.
pub async fn start_with_source<S: FleetSource>(
    config: Config,
    mut source: S,
) -> Result<Service, Error> {
    config.validate()?;
    let token = match &config.snapshot_token_file {
        Some(path) => Some(Arc::new(crate::auth::SnapshotToken::from_file(path)?)),
        None => None,
    };
    let stats = Arc::new(Stats::default());
    let replicas = Arc::new(
        ReplicaBook::new(config.replica_ttl, config.redis.as_deref())
            .map_err(|e| Error::Config(ConfigError::Redis(e.to_string())))?,
    );
    let setting = config.user_limits();
    let limits = Arc::new(match (setting, config.redis.as_deref()) {
        (UserLimitsSetting::On, Some(url)) => {
            let limits = UserLimits::redis(url)
                .map_err(|e| Error::Config(ConfigError::Redis(e.to_string())))?;
            if config.user_records_off_by_env {
                tracing::info!(
                    "AIBRIX_DISABLE_REDIS_USER_STORE: users get the default limits, no record is read"
                );
                limits.without_records()
            } else {
                limits
            }
        }
        _ => UserLimits::disabled(),
    });
    tracing::info!("per-user limits {setting}");
    let origin = source.describe();
    let pods = source.load().await.map_err(|source| Error::InitialFleet {
        origin: origin.clone(),
        source,
    })?;
    tracing::info!(%origin, pods = pods.len(), "initial fleet loaded");
    stats.fleet_loaded();
    stats.fleet_event(crate::unix_ms_now());
    let source_kind = source.kind();

    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| Error::Bind {
            addr: config.listen,
            source,
        })?;
    let local_addr = listener.local_addr().map_err(|source| Error::Bind {
        addr: config.listen,
        source,
    })?;

    let fleet: Fleet = Arc::new(pods);
    let (fleet_tx, fleet_rx) = watch::channel(fleet.clone());
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let shutdown = Shutdown::new(shutdown_rx);

    let concurrency = usize::try_from(config.scrape_concurrency).unwrap_or(usize::MAX);
    let (scraper, outcomes) =
        Scraper::new(config.scrape_timeout, concurrency).map_err(Error::Client)?;
    let book = ScrapeBook::new(config.stale_bound(), config.unreachable_after)
        .with_scrape_timeout(config.scrape_timeout)
        .with_stalled_after(config.stalled_after);
    // The endpoint listing goes first: Envoy must know every pod before a snapshot names it.
    let mut eds = (config.eds_file.is_some() || config.xds_listen.is_some())
        .then(|| EdsWriter::new(config.eds_file.clone(), config.eds_cluster.clone()));
    let now = Instant::now();
    if let Some(eds) = eds.as_mut() {
        eds.update(&fleet, now).await?;
    }
    let (xds_listener, xds_addr) = bind_optional(config.xds_listen).await?;
    let (metrics_listener, metrics_addr) = bind_optional(config.metrics_listen).await?;
    let listing = eds.as_ref().map(EdsWriter::subscribe);
    // Stand-ins are named only where the retrying cluster knows the pods: always with the
    // file (Envoy reads it at start), over EDS once a gateway has taken a listing.
    let file = config.eds_file.is_some();
    let external = config
        .external
        .resolve(|path| std::fs::read_to_string(path))?
        .map(crate::external::ExternalRouter::new)
        .transpose()
        .map_err(Error::ExternalClient)?
        .map(Arc::new);
    if let Some(router) = &external {
        tracing::info!(endpoint = router.endpoint(), "external router on");
    }
    let mut builder = SnapshotBuilder::with_user_limits(limits.enabled())
        .with_eds(file)
        .with_external_router(external.as_ref().map(|r| r.summary()));
    let first = builder.update(
        snapshot::models(&fleet, &config.pod_labels, |p| book.observe(p, now)),
        crate::unix_ms_now(),
    );
    let (snapshots_tx, snapshots_rx) = watch::channel(first.published);
    let (live_tx, live_rx) = watch::channel(first.live);

    let mut audit = crate::config_audit::ConfigAudit::default();
    stats.set_config_problem_pods(audit.check(&fleet));
    let publisher = FleetPublisher::new(fleet_tx, stats.clone());
    let control = ControlLoop {
        fleet: fleet_rx,
        book,
        scraper,
        outcomes,
        builder,
        snapshots: snapshots_tx,
        live: live_tx,
        stats: stats.clone(),
        interval: config.refresh_interval,
        labels: config.pod_labels.clone(),
        audit,
        audited: fleet.clone(),
        eds: eds.map(|writer| EdsState {
            writer,
            file,
            fleet: fleet.clone(),
            at: now,
        }),
    };
    let mut tasks = vec![
        tokio::spawn(watched(
            Task::FleetSource,
            stats.clone(),
            shutdown_tx.subscribe(),
            source.watch(publisher, shutdown.clone()),
        )),
        tokio::spawn(watched(
            Task::ControlLoop,
            stats.clone(),
            shutdown_tx.subscribe(),
            control.run(shutdown.clone()),
        )),
    ];
    let leadership = match config.leader.elect {
        false => None,
        true => {
            let client = crate::sources::kubernetes::client(
                config.kube_api_url.clone(),
                config.leader.retry_period,
                false,
            )
            .await
            .map_err(|e| Error::Leader(e.to_string()))?;
            let eligible_stats = stats.clone();
            let stale_after = loop_stale_after(config.refresh_interval);
            let eligible = Box::new(move || {
                server::unready(&eligible_stats, stale_after, Instant::now()).is_none()
            });
            let (elector, leadership) =
                crate::leader::Elector::new(client, &config.leader, eligible);
            tasks.push(tokio::spawn(watched(
                Task::LeaderElection,
                stats.clone(),
                shutdown_tx.subscribe(),
                elector.run(shutdown.clone()),
            )));
            Some(leadership)
        }
    };

    let eds_here = match (&config.eds_file, &xds_listener) {
        (Some(_), _) => crate::xds::EdsHere::File,
        (None, Some(_)) => crate::xds::EdsHere::Nodes(Default::default()),
        (None, None) => crate::xds::EdsHere::Off,
    };
    if let (Some(listener), Some(listing)) = (xds_listener, listing) {
        let service = crate::xds::service(listing, stats.clone(), token.clone(), eds_here.clone());
        let mut stop = shutdown.clone();
        tasks.push(tokio::spawn(crate::xds::serve(
            listener,
            service,
            leadership.as_ref().map(|l| l.subscribe()),
            async move { stop.requested().await },
        )));
        tracing::info!(addr = ?xds_addr, "serving the retrying cluster's endpoints over EDS");
    }

    let guarded = token.is_some();
    let state = AppState {
        snapshots: snapshots_rx.clone(),
        live: live_rx,
        stats: stats.clone(),
        replicas,
        limits,
        source_kind,
        token,
        eds_here,
        external,
        loop_stale_after: loop_stale_after(config.refresh_interval),
        gateways: Default::default(),
        leadership,
    };
    if let Some(listener) = metrics_listener {
        let app = server::metrics_router(state.clone());
        let mut stop = shutdown.clone();
        let limits = config.http_limits;
        tasks.push(tokio::spawn(serve_http(
            listener,
            app,
            limits,
            "metrics",
            async move { stop.requested().await },
        )));
        tracing::info!(addr = ?metrics_addr, "serving health and metrics");
    }
    let app = server::router(state);
    let mut server_shutdown = shutdown;
    let limits = config.http_limits;
    let server = tokio::spawn(async move {
        serve_http(listener, app, limits, "main", async move {
            server_shutdown.requested().await
        })
        .await;
        Ok(())
    });
    tracing::info!(
        %local_addr,
        token = guarded,
        "serving snapshots"
    );

    Ok(Service {
        local_addr,
        xds_addr,
        metrics_addr,
        stats,
        snapshots: snapshots_rx,
        shutdown: shutdown_tx,
        server: Some(server),
        tasks,
    })
}

/// Runs `work`, a task nothing restarts, and records in `stats` when it ends (returns or
/// panics) while no shutdown was requested: `/readyz` then fails and the end is logged, where
/// otherwise it would surface only when [`Service::shutdown`] awaits the handle. A stop with
/// the trigger gone (the [`Service`] dropped) counts as a shutdown. A panic is passed on, so
/// the handle still reports it.
async fn watched(
    task: Task,
    stats: Arc<Stats>,
    stop: watch::Receiver<bool>,
    work: impl Future<Output = ()>,
) {
    // Unwind safety: nothing `work` held is looked at after a panic (it is dropped); only an
    // atomic of `stats` is set.
    let ended = AssertUnwindSafe(work).catch_unwind().await;
    let stopping = *stop.borrow() || stop.has_changed().is_err();
    if !stopping {
        stats.task_ended(task);
        tracing::error!(
            task = task.name(),
            panicked = ended.is_err(),
            "a background task ended while pd-control is not shutting down; /readyz fails from now on"
        );
    }
    if let Err(panic) = ended {
        std::panic::resume_unwind(panic);
    }
}

/// Serves `app` on `listener` over HTTP/1.1 until `stop` resolves, then lets the requests in
/// flight finish (idle connections close at once) and returns.
///
/// Not `axum::serve`: it sets no timer, so hyper's header read timeout never runs, and it
/// takes every connection. Here a connection that has not sent a request's headers within
/// `limits.header_read_timeout` (from its opening, or from the previous answer) is closed,
/// and past `limits.max_connections` open ones a new connection is closed as soon as it is
/// accepted. HTTP/1.1 only: nobody speaks HTTP/2 to these ports (Envoy's `pd_control`
/// cluster, the probes and Prometheus use HTTP/1.1), and a cleartext HTTP/2 connection would
/// escape the header timeout (it is per HTTP/1 request, and the protocol sniffing that
/// precedes it waits for bytes without limit).
async fn serve_http(
    listener: TcpListener,
    app: axum::Router,
    limits: crate::config::HttpLimits,
    name: &'static str,
    stop: impl Future<Output = ()>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;

    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    // Set to start the connections' graceful shutdown; each holds a receiver, so the sender
    // sees every connection gone once it has no receiver left.
    let (closing_tx, closing_rx) = watch::channel(false);
    let mut refused = Refusals::default();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            () = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Out of file descriptors, say: accepting again at once would spin.
                    tracing::error!(listener = name, error = %e, "cannot accept a connection; retrying in 1 s");
                    tokio::select! {
                        () = &mut stop => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(stream);
            refused.note(name, limits.max_connections);
            continue;
        };
        let conn =
            builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let mut closing = closing_rx.clone();
        tokio::spawn(async move {
            tokio::pin!(conn);
            let mut asked = false;
            loop {
                tokio::select! {
                    served = conn.as_mut() => {
                        // A client gone, a timeout, a malformed request: its connection's end.
                        if let Err(e) = served {
                            tracing::debug!(listener = name, error = %e, "connection ended");
                        }
                        break;
                    }
                    _ = closing.wait_for(|c| *c), if !asked => {
                        asked = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(slot);
            drop(closing);
        });
    }
    drop(listener);
    closing_tx.send_replace(true);
    drop(closing_rx);
    closing_tx.closed().await;
}

/// Accept errors of one connection only (gone before it was taken): the next accept is fine.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Connections closed for the connection cap, logged at most every 10 s (a flood of them must
/// not flood the log too).
#[derive(Default)]
struct Refusals {
    since_log: u64,
    logged: Option<Instant>,
}

impl Refusals {
    fn note(&mut self, listener: &'static str, cap: usize) {
        self.since_log = self.since_log.saturating_add(1);
        let now = Instant::now();
        if self
            .logged
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(10))
        {
            tracing::warn!(
                listener,
                refused = self.since_log,
                cap,
                "connection cap reached: new connections are closed at once"
            );
            self.since_log = 0;
            self.logged = Some(now);
        }
    }
}

/// Binds an optional extra listener (`--xds-listen`, `--metrics-listen`) and the address it
/// got (port 0 picks one).
async fn bind_optional(
    addr: Option<SocketAddr>,
) -> Result<(Option<TcpListener>, Option<SocketAddr>), Error> {
    let Some(addr) = addr else {
        return Ok((None, None));
    };
    let bound = async {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        Ok::<_, io::Error>((listener, local))
    };
    let (listener, local) = bound.await.map_err(|source| Error::Bind { addr, source })?;
    Ok((Some(listener), Some(local)))
}

/// The binary's entry: start, announce, serve until SIGINT/SIGTERM.
pub async fn run(config: Config) -> Result<(), Error> {
    let mut service = start(config).await?;
    // Scripts and tests wait for this line, so it goes to stdout and is flushed at once.
    let mut stdout = io::stdout().lock();
    let _ = writeln!(stdout, "pd-control: listening on {}", service.local_addr());
    let _ = stdout.flush();
    drop(stdout);

    tokio::select! {
        signal = shutdown_signal() => {
            signal?;
            tracing::info!("shutting down");
        }
        stopped = service.stopped() => {
            // Stop the rest too, so a leader withdraws its label and releases the Lease
            // (a standby takes over at once rather than after the lease duration).
            let _ = tokio::time::timeout(Duration::from_secs(10), service.shutdown()).await;
            return stopped;
        }
    }
    service.shutdown().await
}

async fn shutdown_signal() -> Result<(), Error> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).map_err(Error::Signal)?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r.map_err(Error::Signal),
            _ = term.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await.map_err(Error::Signal)
    }
}

struct ControlLoop {
    fleet: watch::Receiver<Fleet>,
    book: ScrapeBook,
    scraper: Scraper,
    outcomes: mpsc::UnboundedReceiver<Outcome>,
    builder: SnapshotBuilder,
    snapshots: watch::Sender<Arc<Published>>,
    /// The JSON view: the served version with every round's scrape times.
    live: watch::Sender<Arc<crate::proto::Snapshot>>,
    stats: Arc<Stats>,
    interval: Duration,
    labels: snapshot::LabelPolicy,
    /// Pods' config annotations looked at, and the fleet they were last looked at in.
    audit: crate::config_audit::ConfigAudit,
    audited: Fleet,
    eds: Option<EdsState>,
}

/// The endpoint listing's writer and the fleet it last took in.
struct EdsState {
    writer: EdsWriter,
    /// The listing is written to a file (`--eds-file`), not only served over EDS.
    file: bool,
    fleet: Fleet,
    at: Instant,
}

impl EdsState {
    /// Takes in `fleet` when it is a new one, or once a second for pods whose linger ran out.
    async fn update(&mut self, fleet: &Fleet, now: Instant, stats: &Stats) {
        if Arc::ptr_eq(&self.fleet, fleet) && now.duration_since(self.at) < Duration::from_secs(1) {
            return;
        }
        self.fleet = fleet.clone();
        self.at = now;
        if let Err(e) = self.writer.update(fleet, now).await {
            stats.eds_write_error();
            tracing::warn!("{e}; retrying within a second");
        }
    }
}

impl ControlLoop {
    async fn run(mut self, mut shutdown: Shutdown) {
        let mut ticker = tokio::time::interval(self.interval);
        // After a stall, one catch-up round is enough; a burst of rounds would only re-scrape.
        ticker.set_missed_tick_behavior(MissedTickBehavior::Skip);
        // Counted from here, not from start-up (the first fleet may take long to load).
        self.stats.loop_turned(Instant::now());
        loop {
            tokio::select! {
                _ = shutdown.requested() => return,
                _ = ticker.tick() => self.tick().await,
                Some(outcome) = self.outcomes.recv() => self.apply(outcome).await,
                // A fleet edit shows up at once rather than on the next tick.
                Ok(()) = self.fleet.changed() => self.publish().await,
            }
            // The heartbeat `/readyz` and the snapshot poll judge the loop by: an iteration
            // that hangs (on the endpoint file's disk, say) stops it.
            self.stats.loop_turned(Instant::now());
        }
    }

    async fn tick(&mut self) {
        let fleet = self.fleet.borrow_and_update().clone();
        let jobs = self.book.plan(&fleet, Instant::now());
        if jobs.is_empty() && self.book.idle() {
            // Nothing to scrape at all: that round is trivially complete.
            self.stats.round_finished(Duration::ZERO);
        }
        for job in jobs {
            self.scraper.spawn(job);
        }
        // Also catches staleness, which changes with time alone.
        self.publish().await;
    }

    async fn apply(&mut self, outcome: Outcome) {
        match &outcome.result {
            Err(crate::scrape::ScrapeError::Closed) => {}
            Err(_) => {
                self.stats.scrape_error(&outcome.job.key);
                self.stats.scrape_latency(outcome.elapsed);
            }
            Ok(_) => self.stats.scrape_latency(outcome.elapsed),
        }
        if let Some(duration) = self.book.apply(outcome) {
            // Publish before recording, so a caller that sees /readyz succeed also sees the
            // metrics of that first round.
            self.publish().await;
            self.stats.round_finished(duration);
        }
    }

    /// Builds and publishes the snapshot, after the endpoint listing took in the fleet (the
    /// file written, off the async workers): Envoy must know a pod before a snapshot names it.
    async fn publish(&mut self) {
        let fleet = self.fleet.borrow_and_update().clone();
        if self.stats.has_scrape_errors() {
            // Error counts of pods that left would otherwise stay exported for ever.
            let live: std::collections::HashSet<(&str, &str)> = fleet
                .iter()
                .map(|p| (p.namespace.as_str(), p.name.as_str()))
                .collect();
            self.stats.retain_scrape_errors(|key| {
                key.split_once('/').is_some_and(|pod| live.contains(&pod))
            });
        }
        if !Arc::ptr_eq(&self.audited, &fleet) {
            self.stats.set_config_problem_pods(self.audit.check(&fleet));
            self.audited = fleet.clone();
        }
        let now = Instant::now();
        if let Some(eds) = self.eds.as_mut() {
            eds.update(&fleet, now, &self.stats).await;
            self.builder.set_eds(eds.file || self.stats.xds_acked());
        }
        let models = snapshot::models(&fleet, &self.labels, |pod| self.book.observe(pod, now));
        let update = self.builder.update(models, crate::unix_ms_now());
        if update.changed {
            tracing::debug!(version = update.published.version, "snapshot updated");
            self.snapshots.send_replace(update.published);
        }
        // Nobody waits on this one: replacing it every round wakes no poller.
        self.live.send_replace(update.live);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loop_bound_is_ten_intervals_and_five_seconds_at_least() {
        assert_eq!(
            loop_stale_after(Duration::from_millis(50)),
            Duration::from_secs(5)
        );
        assert_eq!(
            loop_stale_after(Duration::from_secs(2)),
            Duration::from_secs(20)
        );
        assert_eq!(loop_stale_after(Duration::MAX), Duration::MAX);
    }

    /// A task that panics or returns while the service runs is recorded; one that ends for a
    /// shutdown (requested, or the trigger dropped) is not. A panic still reaches the handle.
    #[tokio::test]
    async fn a_task_that_ends_outside_a_shutdown_is_recorded() {
        let (stop, rx) = watch::channel(false);
        let stats = Arc::new(Stats::default());
        let panicked = tokio::spawn(watched(
            Task::ControlLoop,
            stats.clone(),
            rx.clone(),
            async { panic!("the loop fails") },
        ))
        .await;
        assert!(panicked.is_err_and(|e| e.is_panic()));
        assert!(stats.has_ended(Task::ControlLoop));
        assert!(!stats.has_ended(Task::FleetSource));

        let stats = Arc::new(Stats::default());
        watched(Task::FleetSource, stats.clone(), rx.clone(), async {}).await;
        assert!(stats.has_ended(Task::FleetSource), "returned");

        let stats = Arc::new(Stats::default());
        stop.send_replace(true);
        watched(Task::FleetSource, stats.clone(), rx.clone(), async {}).await;
        assert!(!stats.has_ended(Task::FleetSource), "shutting down");
        let (stop, rx) = watch::channel(false);
        drop(stop);
        watched(Task::ControlLoop, stats.clone(), rx, async {}).await;
        assert!(!stats.has_ended(Task::ControlLoop), "the trigger is gone");
    }
}
