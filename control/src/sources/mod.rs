//! Where the fleet comes from.
//!
//! A source produces the full list of [`PodRecord`]s and pushes every change through a
//! [`FleetPublisher`]: the fleet file ([`mod@file`]) or the Kubernetes API ([`kubernetes`]). Both
//! turn Pods into records through [`PodRecord::from_pod`], so nothing downstream (scraper,
//! snapshot, server) knows which source is running.

pub mod file;
pub mod kubernetes;

use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch;

use crate::fleet::{FleetError, PodRecord};
use crate::stats::Stats;

pub use file::FileSource;
pub use kubernetes::{KubeError, KubeSettings, KubernetesSource};

/// The current fleet, shared without copying between the source and the control loop.
pub type Fleet = Arc<Vec<PodRecord>>;

/// Why a source could not produce a fleet.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(transparent)]
    Fleet(#[from] FleetError),
    #[error("fleet file {path} is not UTF-8")]
    NotUtf8 { path: String },
    /// Also what a file truncated for rewriting reads as, so it never stands for "no pods".
    #[error(
        "fleet file {path} holds no YAML document; a fleet without pods is `kind: List` with `items: []`"
    )]
    Empty { path: String },
    #[error("fleet file {path} kept changing over {reads} reads; is something still writing it?")]
    Unsettled { path: String, reads: u32 },
    #[error(transparent)]
    Kubernetes(#[from] KubeError),
}

/// A producer of fleet updates.
pub trait FleetSource: Send + 'static {
    /// Human-readable origin, for logs and start-up errors.
    fn describe(&self) -> String;

    /// Short kind of source, the `source` label of `pd_control_fleet_event_age_seconds`.
    fn kind(&self) -> &'static str {
        "custom"
    }

    /// The first complete fleet. A failure here stops start-up: serving an empty snapshot would
    /// tell every filter that no model has pods.
    fn load(&mut self) -> impl Future<Output = Result<Vec<PodRecord>, SourceError>> + Send;

    /// Keeps the fleet current until shutdown. A source must never publish a partial or empty
    /// fleet because of its own failure; it reports the failure and keeps the last good one.
    fn watch(
        self,
        publisher: FleetPublisher,
        shutdown: Shutdown,
    ) -> impl Future<Output = ()> + Send;
}

/// The write end of the fleet channel, handed to whichever source is running.
#[derive(Clone)]
pub struct FleetPublisher {
    tx: Arc<watch::Sender<Fleet>>,
    stats: Arc<Stats>,
}

impl FleetPublisher {
    pub fn new(tx: watch::Sender<Fleet>, stats: Arc<Stats>) -> FleetPublisher {
        FleetPublisher {
            tx: Arc::new(tx),
            stats,
        }
    }

    /// Replaces the fleet; returns whether it differed. Identical fleets are not sent so the
    /// control loop does not rebuild snapshots for a no-op re-read.
    pub fn publish(&self, pods: Vec<PodRecord>) -> bool {
        self.stats.fleet_event(crate::unix_ms_now());
        self.tx.send_if_modified(|current| {
            if **current == pods {
                return false;
            }
            *current = Arc::new(pods);
            true
        })
    }

    /// Counts and logs a failed update; the previous fleet stays in force.
    pub fn reload_failed(&self, source: &str, error: &dyn std::error::Error) {
        self.stats.fleet_reload_error();
        tracing::warn!(source, %error, "fleet update rejected; keeping the previous fleet");
    }

    pub fn current(&self) -> Fleet {
        self.tx.borrow().clone()
    }
}

/// A cloneable shutdown signal for background tasks.
#[derive(Clone)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    pub fn new(rx: watch::Receiver<bool>) -> Shutdown {
        Shutdown(rx)
    }

    /// Resolves once shutdown is requested (or the trigger is gone, which means the same).
    pub async fn requested(&mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}
