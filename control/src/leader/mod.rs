//! Several pd-control replicas with one serving: a Kubernetes Lease held in turn.
//!
//! Every replica watches the fleet and scrapes the engines (as every AIBrix gateway replica
//! does), so a standby's snapshot is current the moment it takes over. What makes one replica
//! *the* one is its pod's label [`LABEL`]: the Service selects it, so the gateways' polls,
//! admissions and reports, whose state is per process, reach the leader alone. The label is
//! used rather than readiness because a standby must be Ready, or a Deployment's rolling update
//! would wait for ever on new pods that cannot lead while the old leader holds the Lease.
//!
//! A replica is ready unless its label may still say "leader" while it does not lead: at
//! start (a restarted container keeps its pod's labels) until it has written "false", and
//! after it lost the Lease until it has withdrawn the label. A leader that stops (SIGTERM),
//! or whose snapshot stops being ready, withdraws its label and releases the Lease, so a
//! standby takes over at its next round.
//!
//! A replica takes the Lease only once it has written its label at least once, and gives it
//! up (sitting one lease duration out) when "true" could not be written for a lease duration:
//! a leader the Service cannot select (its pod missing, the patch refused) serves nobody.
//!
//! A leader that cannot renew keeps leading until it reads the Lease held by another: there
//! is no renew deadline. Controllers built on client-go step down at one, which is safe for
//! them (two leaders would both write) and wrong here: when every replica loses the API for
//! one reason (an RBAC change, an expired token, the API server throttling pd-control),
//! stepping down would leave the Service with no endpoint and the gateways routing blind,
//! whereas two replicas serving (the old leader cut off, a standby that took the Lease)
//! only costs the gateways a full snapshot per poll until the old one reads the Lease again.

pub mod config;
pub mod lease;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};

use self::config::LeaderArgs;
use self::lease::{Observer, Plan};
use crate::sources::Shutdown;

/// The pod label the Service selects: `"true"` on the leader's pod, `"false"` on the others.
pub const LABEL: &str = "pd-router.io/pd-control-leader";

/// `pd_control_leader`'s help, with and without an election.
pub const LEADER_HELP: &str =
    "1 while this replica holds the leader Lease (always, without --leader-elect), 0 on a standby.";

/// What this replica last wrote in its pod's [`LABEL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Label {
    /// Not written yet by this process: a previous container may have left "true".
    Unknown = 0,
    Leader = 1,
    Standby = 2,
}

/// Leadership as the server and the metrics see it.
#[derive(Debug)]
pub struct Leadership {
    /// `namespace/name` of the Lease, for messages.
    lease: String,
    leading: AtomicBool,
    /// The same, for tasks that act on a change (EDS streams end when it turns false).
    leading_changes: tokio::sync::watch::Sender<bool>,
    label: AtomicU8,
    /// The holder the last round read (or this replica), for `/readyz` and logs.
    holder: Mutex<Option<String>>,
    /// Times this process became the leader.
    acquired: AtomicU64,
    /// Failed or timed-out Lease rounds, and failed label writes.
    lease_errors: AtomicU64,
    label_errors: AtomicU64,
}

impl Leadership {
    fn new(lease: String) -> Leadership {
        Leadership {
            lease,
            leading: AtomicBool::new(false),
            leading_changes: tokio::sync::watch::channel(false).0,
            label: AtomicU8::new(Label::Unknown as u8),
            holder: Mutex::new(None),
            acquired: AtomicU64::new(0),
            lease_errors: AtomicU64::new(0),
            label_errors: AtomicU64::new(0),
        }
    }

    pub fn is_leading(&self) -> bool {
        self.leading.load(Ordering::Acquire)
    }

    /// Follows leadership as it changes.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<bool> {
        self.leading_changes.subscribe()
    }

    /// Sets leadership; whether it was set before.
    fn set_leading(&self, leading: bool) -> bool {
        let was = self.leading.swap(leading, Ordering::AcqRel);
        // Only a change wakes the EDS connections and streams that wait on it (a leader
        // renews every round).
        self.leading_changes.send_if_modified(|current| {
            let changed = *current != leading;
            *current = leading;
            changed
        });
        was
    }

    fn label(&self) -> Label {
        match self.label.load(Ordering::Acquire) {
            1 => Label::Leader,
            2 => Label::Standby,
            _ => Label::Unknown,
        }
    }

    fn holder(&self) -> Option<String> {
        self.holder.lock().map(|h| h.clone()).unwrap_or_default()
    }

    fn set_holder(&self, holder: Option<String>) {
        if let Ok(mut h) = self.holder.lock() {
            *h = holder;
        }
    }

    /// Why this replica must not be Ready, if its label may send it traffic it should not
    /// serve: not leading while the label is not known to say "false".
    pub fn unready_reason(&self) -> Option<String> {
        if self.is_leading() || self.label() == Label::Standby {
            return None;
        }
        let holder = self
            .holder()
            .map_or_else(|| "nobody".to_string(), |h| format!("{h:?}"));
        Some(format!(
            "not the leader (lease {} held by {holder}) and the pod's {LABEL} label is not yet \"false\"\n",
            self.lease
        ))
    }

    /// `(name, kind, help, value)` of the leadership metrics.
    pub fn metrics(&self) -> [(&'static str, &'static str, &'static str, String); 4] {
        metrics(
            self.is_leading(),
            [
                self.acquired.load(Ordering::Relaxed),
                self.lease_errors.load(Ordering::Relaxed),
                self.label_errors.load(Ordering::Relaxed),
            ],
        )
    }
}

/// The leadership metrics of a replica without `--leader-elect`: it serves alone (leader 1),
/// and its counters stay 0. Exported all the same, so dashboards and alerts read the same
/// families whether or not the replicas elect.
pub fn metrics_without_election() -> [(&'static str, &'static str, &'static str, String); 4] {
    metrics(true, [0; 3])
}

fn metrics(
    leading: bool,
    [acquired, lease_errors, label_errors]: [u64; 3],
) -> [(&'static str, &'static str, &'static str, String); 4] {
    [
        (
            "pd_control_leader",
            "gauge",
            LEADER_HELP,
            u8::from(leading).to_string(),
        ),
        (
            "pd_control_leader_acquisitions_total",
            "counter",
            "Times this replica became the leader (0 without --leader-elect).",
            acquired.to_string(),
        ),
        (
            "pd_control_leader_lease_errors_total",
            "counter",
            "Lease rounds that failed or got no answer within the retry period (a leader keeps leading through them).",
            lease_errors.to_string(),
        ),
        (
            "pd_control_leader_label_errors_total",
            "counter",
            "Failed writes of this replica's own pod label (a replica that lost the lease stays unready until one succeeds).",
            label_errors.to_string(),
        ),
    ]
}

/// Why a round failed.
#[derive(Debug, thiserror::Error)]
enum RoundError {
    #[error("{0}")]
    Api(#[from] kube::Error),
    #[error("no answer within the round's bound")]
    Timeout,
}

/// What a round found.
enum Round {
    /// This replica wrote the Lease: it leads.
    Held,
    /// This replica held the Lease but may not lead (why): it emptied it for a standby.
    Released(&'static str),
    /// Another replica holds it.
    Follows(String),
    /// Another replica wrote it between our read and our write.
    Lost,
}

/// The election task: one round every retry period.
pub struct Elector {
    leases: Api<Lease>,
    pods: Api<Pod>,
    args: LeaderArgs,
    me: String,
    state: Arc<Leadership>,
    observer: Observer,
    /// Whether this replica may lead now (ready apart from leadership): a replica whose
    /// snapshot is not ready, or frozen, does not take the Lease and gives it up.
    eligible: Box<dyn Fn() -> bool + Send + Sync>,
    rng: fastrand::Rng,
    /// Since when the label has not said "true" while this replica leads.
    label_pending: Option<Instant>,
    /// Until when this replica does not lead, after giving the Lease up for its label.
    benched_until: Option<Instant>,
    /// When the label was last written (it is written again once a lease duration).
    label_written_at: Option<Instant>,
    /// Rounds failed in a row, and when that streak was last logged.
    failures: u64,
    failure_log: LogEvery,
    label_log: LogEvery,
}

/// At most one line a minute of a failure that repeats every round (an API outage would
/// otherwise log one every retry period).
#[derive(Debug, Default)]
struct LogEvery {
    last: Option<Instant>,
}

impl LogEvery {
    fn due(&mut self, now: Instant) -> bool {
        let due = self
            .last
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(60));
        if due {
            self.last = Some(now);
        }
        due
    }
}

impl Elector {
    /// For validated `args` (namespace and identity named).
    pub fn new(
        client: kube::Client,
        args: &LeaderArgs,
        eligible: Box<dyn Fn() -> bool + Send + Sync>,
    ) -> (Elector, Arc<Leadership>) {
        let ns = args.namespace.clone().unwrap_or_default();
        let me = args.identity.clone().unwrap_or_default();
        let state = Arc::new(Leadership::new(format!("{ns}/{}", args.lease)));
        let elector = Elector {
            leases: Api::namespaced(client.clone(), &ns),
            pods: Api::namespaced(client, &ns),
            args: args.clone(),
            me,
            state: state.clone(),
            observer: Observer::default(),
            eligible,
            rng: fastrand::Rng::new(),
            label_pending: None,
            benched_until: None,
            label_written_at: None,
            failures: 0,
            failure_log: LogEvery::default(),
            label_log: LogEvery::default(),
        };
        (elector, state)
    }

    /// Until `shutdown`; then withdraws the label and releases the Lease if it names this
    /// replica.
    pub async fn run(mut self, mut shutdown: Shutdown) {
        tracing::info!(lease = %self.state.lease, identity = %self.me, "leader election on");
        loop {
            let started = Instant::now();
            let bound = started + self.args.retry_period;
            let round = tokio::select! {
                _ = shutdown.requested() => break,
                r = tokio::time::timeout_at(bound.into(), self.round()) => {
                    r.unwrap_or(Err(RoundError::Timeout))
                }
            };
            self.settle(round);
            tokio::select! {
                _ = shutdown.requested() => break,
                _ = self.write_label() => {}
            }
            // Up to a fifth more, so replicas that started together do not race every round.
            let pause = self.args.retry_period.mul_f64(1.0 + 0.2 * self.rng.f64());
            tokio::select! {
                _ = shutdown.requested() => break,
                _ = tokio::time::sleep_until((started + pause).into()) => {}
            }
        }
        self.release().await;
    }

    async fn round(&mut self) -> Result<Round, RoundError> {
        let name = self.args.lease.clone();
        let now = k8s_openapi::jiff::Timestamp::now();
        let duration = self.args.lease_duration;
        // A replica leads only once it has written its label (it would otherwise hold the
        // Lease with no pod the Service selects: a pod that does not exist, a patch denied)
        // and, leading, only while "true" gets written within a lease duration.
        let ineligible = self.ineligible();
        let eligible = ineligible.is_none();
        let Some(current) = self.leases.get_opt(&name).await? else {
            if !eligible {
                return Ok(Round::Follows(String::new()));
            }
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name),
                    ..ObjectMeta::default()
                },
                spec: Some(lease::created(&self.me, duration, now)),
            };
            return match self.leases.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(Round::Held),
                Err(e) if conflict(&e) => Ok(Round::Lost),
                Err(e) => Err(e.into()),
            };
        };
        let version = current
            .metadata
            .resource_version
            .clone()
            .unwrap_or_default();
        // Dated when the read came back: a version written while a slow read was on its way
        // was seen no earlier than that.
        let first_seen = self.observer.observe(&version, Instant::now());
        let spec = current.spec.clone().unwrap_or_default();
        let (next, done) =
            match lease::plan(Some(&spec), &self.me, first_seen, duration, Instant::now()) {
                Plan::Follow(holder) => return Ok(Round::Follows(holder)),
                // Not ready: a holder empties the Lease for a standby, anyone else leaves it.
                Plan::Renew if !eligible => (
                    lease::released(&spec, now),
                    Round::Released(ineligible.unwrap_or_default()),
                ),
                Plan::TakeOver if !eligible => {
                    return Ok(Round::Follows(
                        lease::holder(Some(&spec)).unwrap_or_default().to_string(),
                    ))
                }
                Plan::Renew => (lease::renewed(&spec, &self.me, duration, now), Round::Held),
                Plan::TakeOver => (
                    lease::taken_over(&spec, &self.me, duration, now),
                    Round::Held,
                ),
            };
        let mut written = current;
        written.spec = Some(next);
        // The read's resourceVersion rides along: a write by another replica since then
        // makes this one fail with 409 instead of overwriting it.
        match self
            .leases
            .replace(&self.args.lease, &PostParams::default(), &written)
            .await
        {
            Ok(_) => Ok(done),
            Err(e) if conflict(&e) => Ok(Round::Lost),
            Err(e) => Err(e.into()),
        }
    }

    fn settle(&mut self, round: Result<Round, RoundError>) {
        if round.is_ok() && self.failures > 0 {
            tracing::info!(lease = %self.state.lease, failed_rounds = self.failures, "lease rounds succeed again");
            self.failures = 0;
            self.failure_log = LogEvery::default();
        }
        match round {
            Ok(Round::Held) => {
                self.state.set_holder(Some(self.me.clone()));
                if !self.state.set_leading(true) {
                    self.state.acquired.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(lease = %self.state.lease, "this replica leads");
                }
            }
            Ok(Round::Released(why)) => {
                self.state.set_holder(None);
                tracing::warn!(lease = %self.state.lease, why, "lease released");
                self.step_down(why);
            }
            Ok(Round::Follows(holder)) => {
                self.state
                    .set_holder(Some(holder.clone()).filter(|h| !h.is_empty()));
                if self.state.is_leading() {
                    self.step_down("another replica holds the lease");
                }
            }
            // Another write came first, or ours committed and its answer was lost: the next
            // round's read says which (a leader that still holds it renews then).
            Ok(Round::Lost) => {}
            Err(e) => {
                self.state.lease_errors.fetch_add(1, Ordering::Relaxed);
                // A leader keeps leading (see the module's docs). One line when failures
                // start, then one a minute: an API outage must not flood the log.
                self.failures = self.failures.saturating_add(1);
                if self.failure_log.due(Instant::now()) {
                    tracing::warn!(lease = %self.state.lease, error = %e, failed_rounds = self.failures, leading = self.state.is_leading(), "lease rounds failing");
                }
            }
        }
    }

    fn step_down(&mut self, why: &str) {
        if self.state.set_leading(false) {
            tracing::warn!(lease = %self.state.lease, why, "this replica stops leading");
        }
    }

    /// Brings the pod's label in line with leadership, if it is not already.
    async fn write_label(&mut self) {
        let want = if self.state.is_leading() {
            Label::Leader
        } else {
            Label::Standby
        };
        let now = Instant::now();
        if want == Label::Standby {
            self.label_pending = None;
        }
        let current = self.state.label() == want;
        if current {
            self.label_pending = None;
            // Written again once a lease duration: someone's `kubectl label` (or a restored
            // pod spec) would otherwise keep the Service off the leader, or on a standby.
            let fresh = self
                .label_written_at
                .is_some_and(|at| now.saturating_duration_since(at) < self.args.lease_duration);
            if fresh {
                return;
            }
        } else if want == Label::Leader {
            self.label_pending.get_or_insert(now);
        }
        let value = if want == Label::Leader {
            "true"
        } else {
            "false"
        };
        let patch = serde_json::json!({"metadata": {"labels": {LABEL: value}}});
        let bound = self.args.retry_period;
        let written = tokio::time::timeout(
            bound,
            self.pods
                .patch(&self.me, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await;
        match written {
            Ok(Ok(_)) => {
                self.label_pending = None;
                self.label_written_at = Some(now);
                self.state.label.store(want as u8, Ordering::Release);
                if !current {
                    tracing::info!(pod = %self.me, label = LABEL, value, "pod label written");
                }
            }
            Ok(Err(e)) => self.label_failed(&e.to_string(), current, now),
            Err(_) => self.label_failed("no answer in time", current, now),
        }
    }

    /// Why this replica may not lead now, if it may not.
    fn ineligible(&mut self) -> Option<&'static str> {
        if !(self.eligible)() {
            Some("its snapshot is not ready or frozen")
        } else if self.state.label() == Label::Unknown {
            Some("its pod label is not written yet")
        } else if self.label_overdue(Instant::now()) {
            Some("its leader label could not be written for a lease duration")
        } else {
            None
        }
    }

    /// Whether this replica leads without having got "true" written for a lease duration: it
    /// then gives the Lease up (the Service reaches no pod of its) and sits out one lease
    /// duration, so that a standby whose label can be written takes it.
    fn label_overdue(&mut self, now: Instant) -> bool {
        if self.benched_until.is_some_and(|until| now < until) {
            return true;
        }
        let overdue = self
            .label_pending
            .is_some_and(|since| now.saturating_duration_since(since) >= self.args.lease_duration);
        if overdue {
            self.label_pending = None;
            self.benched_until = Some(now + self.args.lease_duration);
            tracing::warn!(pod = %self.me, label = LABEL, "the leader label could not be written for a lease duration: giving the lease up");
        }
        overdue
    }

    /// A failed write; `refresh`: the label already said so (a rewrite), which is tried
    /// again a lease duration later rather than every round, so an API outage costs one call
    /// per duration, not one per round.
    fn label_failed(&mut self, error: &str, refresh: bool, now: Instant) {
        if refresh {
            self.label_written_at = Some(now);
        }
        self.state.label_errors.fetch_add(1, Ordering::Relaxed);
        if self.label_log.due(Instant::now()) {
            tracing::warn!(pod = %self.me, label = LABEL, error, "cannot write this pod's label (logged once a minute)");
        }
    }

    /// On shutdown: a leader withdraws its label (the Service stops sending it polls), then
    /// empties the Lease so a standby takes it at once. Bounded; what fails is logged (a
    /// standby then waits the lease duration out).
    async fn release(&mut self) {
        // Also when not (yet) leading: a round that wrote the Lease may have been cut short
        // by the shutdown before it was settled, and the Lease must not name a stopped pod.
        self.step_down("shutting down");
        // Two calls at most, each bounded so the whole stays well inside the pod's
        // termination grace period (30 s by default) whatever the retry period.
        let bound = self
            .args
            .retry_period
            .clamp(Duration::from_secs(1), Duration::from_secs(5));
        let _ = tokio::time::timeout(bound, self.write_label()).await;
        let name = self.args.lease.clone();
        let released = tokio::time::timeout(bound, async {
            let Some(mut current) = self.leases.get_opt(&name).await? else {
                return Ok(false);
            };
            let spec = current.spec.clone().unwrap_or_default();
            if lease::holder(Some(&spec)) != Some(self.me.as_str()) {
                return Ok(false);
            }
            current.spec = Some(lease::released(&spec, k8s_openapi::jiff::Timestamp::now()));
            self.leases
                .replace(&name, &PostParams::default(), &current)
                .await
                .map(|_| true)
        })
        .await;
        match released {
            Ok(Ok(true)) => tracing::info!(lease = %self.state.lease, "lease released"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => {
                tracing::warn!(lease = %self.state.lease, error = %e, "cannot release the lease")
            }
            Err(_) => tracing::warn!(lease = %self.state.lease, "cannot release the lease in time"),
        }
    }
}

/// A write that lost to another replica's (409 Conflict, or AlreadyExists on create).
fn conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == 409)
}
