//! Counters shared between the background tasks and the HTTP server.
//!
//! Atomics rather than a metrics library: the service exports a handful of numbers, and the
//! server reads them without taking any lock the control loop holds for longer than a map
//! copy (the per-pod error counts).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the scrape-latency histogram: a loopback scrape takes about a
/// millisecond, a loaded engine tens, the default timeout one second.
pub const LATENCY_BOUNDS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// A Prometheus histogram of durations, lock-free.
#[derive(Debug, Default)]
pub struct Histogram {
    /// Per-bucket (not cumulative) counts; the last slot is above every bound.
    buckets: [AtomicU64; LATENCY_BOUNDS.len() + 1],
    sum_micros: AtomicU64,
}

/// A histogram read at one instant: cumulative counts per bound, then `+Inf`.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    pub cumulative: Vec<(f64, u64)>,
    pub count: u64,
    pub sum_seconds: f64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let slot = LATENCY_BOUNDS
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(LATENCY_BOUNDS.len());
        self.buckets[slot].fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut running = 0;
        let mut cumulative = Vec::with_capacity(LATENCY_BOUNDS.len() + 1);
        for (i, bucket) in self.buckets.iter().enumerate() {
            running += bucket.load(Ordering::Relaxed);
            let bound = LATENCY_BOUNDS.get(i).copied().unwrap_or(f64::INFINITY);
            cumulative.push((bound, running));
        }
        HistogramSnapshot {
            cumulative,
            count: running,
            sum_seconds: self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

#[derive(Debug, Default)]
pub struct Stats {
    scrape_errors_total: AtomicU64,
    /// Failed scrapes per pod key (`namespace/name`), pruned to the fleet's pods.
    scrape_errors_by_pod: Mutex<BTreeMap<String, u64>>,
    scrape_latency: Histogram,
    fleet_reload_errors_total: AtomicU64,
    /// Failed writes of the retrying cluster's endpoint file (`--eds-file`).
    eds_write_errors_total: AtomicU64,
    /// Pods of the fleet whose `model.aibrix.ai/config` has problems (`config_audit`).
    config_problem_pods: AtomicU64,
    /// Snapshot API requests refused for a missing or wrong token.
    unauthorized_total: AtomicU64,
    /// EDS streams open now (`--xds-listen`), and the listings gateways refused.
    xds_streams: AtomicI64,
    xds_acks_total: AtomicU64,
    xds_nacks_total: AtomicU64,
    /// `f64::to_bits` of the last completed round's duration in seconds.
    scrape_duration_bits: AtomicU64,
    /// Unix ms of the last fleet change the source delivered (0 = none yet).
    last_fleet_event_ms: AtomicI64,
    fleet_loaded: AtomicBool,
    first_round_done: AtomicBool,
    /// Snapshot polls being held for a newer version right now (about one per gateway).
    polls_waiting: AtomicI64,
    /// Snapshot polls answered, by answer: `[snapshot, not_modified, frozen]`.
    polls_answered: [AtomicU64; 3],
    /// When the control loop last completed an iteration (see [`Stats::loop_turned`]).
    loop_beat: Heartbeat,
    /// [`Task`] bits of the background tasks that ended while no shutdown was requested.
    tasks_ended: AtomicU8,
    /// Wakes [`Stats::task_end`]'s waiter (the binary, which then exits).
    task_end: tokio::sync::Notify,
}

/// A monotonic time stamp that one task writes and the server reads, without a lock: the
/// time since `origin` (when the [`Stats`] were made) in nanoseconds (u64: 584 years).
#[derive(Debug)]
struct Heartbeat {
    origin: Instant,
    nanos: AtomicU64,
}

impl Default for Heartbeat {
    fn default() -> Heartbeat {
        Heartbeat {
            origin: Instant::now(),
            nanos: AtomicU64::new(0),
        }
    }
}

impl Heartbeat {
    fn beat(&self, at: Instant) {
        let nanos =
            u64::try_from(at.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX);
        // `fetch_max`: a beat stamped before a later one never moves the heartbeat back.
        self.nanos.fetch_max(nanos, Ordering::Relaxed);
    }

    /// Time from the last beat (or from `origin`, before the first) to `now`; zero when
    /// `now` reads earlier.
    fn age(&self, now: Instant) -> Duration {
        let beat = Duration::from_nanos(self.nanos.load(Ordering::Relaxed));
        now.saturating_duration_since(self.origin)
            .saturating_sub(beat)
    }
}

/// The background tasks whose end, outside a shutdown, nothing restarts: without the control
/// loop the snapshot no longer changes, without the fleet source the fleet no longer does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    ControlLoop = 1,
    FleetSource = 2,
    /// `--leader-elect`: without it a leader keeps a label it may no longer deserve.
    LeaderElection = 4,
}

impl Task {
    /// As named in `/readyz` answers and logs.
    pub fn name(self) -> &'static str {
        match self {
            Task::ControlLoop => "control loop",
            Task::FleetSource => "fleet source",
            Task::LeaderElection => "leader election",
        }
    }
}

/// What a snapshot poll was answered with.
#[derive(Debug, Clone, Copy)]
pub enum PollAnswer {
    /// 200 with a snapshot.
    Snapshot = 0,
    /// 304: the caller holds the current version.
    NotModified = 1,
    /// 503 instead of a 304: the caller holds the current version, but the control loop is
    /// stuck or has ended, so that version no longer follows the fleet.
    Frozen = 2,
}

impl Stats {
    pub fn scrape_error(&self, pod: &str) {
        self.scrape_errors_total.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut by_pod) = self.scrape_errors_by_pod.lock() {
            *by_pod.entry(pod.to_string()).or_insert(0) += 1;
        }
    }

    pub fn scrape_errors_total(&self) -> u64 {
        self.scrape_errors_total.load(Ordering::Relaxed)
    }

    /// Failed scrapes of `pod` so far (0 for a pod that never failed).
    pub fn scrape_errors_of(&self, pod: &str) -> u64 {
        self.scrape_errors_by_pod
            .lock()
            .map(|m| m.get(pod).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    /// Whether any pod has a failed scrape on record.
    pub fn has_scrape_errors(&self) -> bool {
        self.scrape_errors_by_pod
            .lock()
            .map(|m| !m.is_empty())
            .unwrap_or(false)
    }

    /// Drops the error counts of pods that left the fleet, so their series go away.
    pub fn retain_scrape_errors(&self, live: impl Fn(&str) -> bool) {
        if let Ok(mut by_pod) = self.scrape_errors_by_pod.lock() {
            by_pod.retain(|pod, _| live(pod));
        }
    }

    /// Time of one scrape exchange (after its concurrency slot was granted).
    pub fn scrape_latency(&self, d: Duration) {
        self.scrape_latency.observe(d);
    }

    pub fn scrape_latency_snapshot(&self) -> HistogramSnapshot {
        self.scrape_latency.snapshot()
    }

    pub fn fleet_reload_error(&self) {
        self.fleet_reload_errors_total
            .fetch_add(1, Ordering::Relaxed);
    }

    pub fn eds_write_error(&self) {
        self.eds_write_errors_total.fetch_add(1, Ordering::Relaxed);
    }

    pub fn set_config_problem_pods(&self, pods: usize) {
        self.config_problem_pods
            .store(pods as u64, Ordering::Relaxed);
    }

    pub fn config_problem_pods(&self) -> u64 {
        self.config_problem_pods.load(Ordering::Relaxed)
    }

    pub fn eds_write_errors_total(&self) -> u64 {
        self.eds_write_errors_total.load(Ordering::Relaxed)
    }

    /// An EDS stream opens; the guard counts it until the stream ends.
    pub fn xds_stream(self: &Arc<Self>) -> XdsStream {
        self.xds_streams.fetch_add(1, Ordering::Relaxed);
        XdsStream(self.clone())
    }

    pub fn xds_streams(&self) -> i64 {
        self.xds_streams.load(Ordering::Relaxed)
    }

    /// Counts an ACK; whether it is the first since this process started.
    pub fn xds_ack(&self) -> bool {
        self.xds_acks_total.fetch_add(1, Ordering::Relaxed) == 0
    }

    /// Whether a gateway has taken an endpoint listing over EDS since this process started.
    pub fn xds_acked(&self) -> bool {
        self.xds_acks_total() > 0
    }

    pub fn xds_acks_total(&self) -> u64 {
        self.xds_acks_total.load(Ordering::Relaxed)
    }

    pub fn xds_nack(&self) {
        self.xds_nacks_total.fetch_add(1, Ordering::Relaxed);
    }

    pub fn xds_nacks_total(&self) -> u64 {
        self.xds_nacks_total.load(Ordering::Relaxed)
    }

    pub fn unauthorized(&self) {
        self.unauthorized_total.fetch_add(1, Ordering::Relaxed);
    }

    /// A poll starts waiting; the guard counts it until dropped (answered or cancelled).
    pub fn poll_waiting(&self) -> PollWaiting<'_> {
        self.polls_waiting.fetch_add(1, Ordering::Relaxed);
        PollWaiting(self)
    }

    pub fn polls_waiting(&self) -> i64 {
        self.polls_waiting.load(Ordering::Relaxed)
    }

    pub fn poll_answered(&self, answer: PollAnswer) {
        self.polls_answered[answer as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn polls_answered(&self, answer: PollAnswer) -> u64 {
        self.polls_answered[answer as usize].load(Ordering::Relaxed)
    }

    pub fn unauthorized_total(&self) -> u64 {
        self.unauthorized_total.load(Ordering::Relaxed)
    }

    pub fn fleet_reload_errors_total(&self) -> u64 {
        self.fleet_reload_errors_total.load(Ordering::Relaxed)
    }

    /// The source delivered a fleet change (a Kubernetes pod event, a fleet-file reload).
    pub fn fleet_event(&self, unix_ms: i64) {
        self.last_fleet_event_ms.store(unix_ms, Ordering::Relaxed);
    }

    /// Unix ms of the last fleet change, `None` before the first.
    pub fn last_fleet_event_ms(&self) -> Option<i64> {
        Some(self.last_fleet_event_ms.load(Ordering::Relaxed)).filter(|ms| *ms > 0)
    }

    /// Records a finished scrape round; the first one also makes the service ready.
    pub fn round_finished(&self, duration: Duration) {
        self.scrape_duration_bits
            .store(duration.as_secs_f64().to_bits(), Ordering::Relaxed);
        self.first_round_done.store(true, Ordering::Release);
    }

    pub fn scrape_duration_seconds(&self) -> f64 {
        f64::from_bits(self.scrape_duration_bits.load(Ordering::Relaxed))
    }

    /// The control loop completed an iteration at `at`: handled a tick (which rebuilds the
    /// snapshot), a scrape outcome or a fleet change.
    pub fn loop_turned(&self, at: Instant) {
        self.loop_beat.beat(at);
    }

    /// Time since the control loop last completed an iteration (since these stats were made,
    /// before the first).
    pub fn loop_age(&self, now: Instant) -> Duration {
        self.loop_beat.age(now)
    }

    /// `task` ended (returned or panicked) while no shutdown was requested.
    pub fn task_ended(&self, task: Task) {
        self.tasks_ended.fetch_or(task as u8, Ordering::Release);
        self.task_end.notify_one();
    }

    /// Resolves once a background task ended outside a shutdown (at once if one did).
    pub async fn task_end(&self) {
        if self.tasks_ended.load(Ordering::Acquire) == 0 {
            self.task_end.notified().await;
        }
    }

    /// Whether `task` ended outside a shutdown (nothing restarts it).
    pub fn has_ended(&self, task: Task) -> bool {
        self.tasks_ended.load(Ordering::Acquire) & (task as u8) != 0
    }

    pub fn fleet_loaded(&self) {
        self.fleet_loaded.store(true, Ordering::Release);
    }

    /// Ready means the snapshot reflects a real fleet and real metrics, not start-up placeholders,
    /// so a filter pointed at a freshly started service does not route on all-empty metrics.
    pub fn is_ready(&self) -> bool {
        self.fleet_loaded.load(Ordering::Acquire) && self.first_round_done.load(Ordering::Acquire)
    }
}

/// Counts one held poll in [`Stats::polls_waiting`] for as long as it lives, so a poll whose
/// caller hangs up mid-wait (its future dropped) is not counted forever.
pub struct PollWaiting<'a>(&'a Stats);

impl Drop for PollWaiting<'_> {
    fn drop(&mut self) {
        self.0.polls_waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An open EDS stream, counted in [`Stats::xds_streams`] until dropped.
pub struct XdsStream(Arc<Stats>);

impl Drop for XdsStream {
    fn drop(&mut self) {
        self.0.xds_streams.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_with_inf_last() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(30));
        h.observe(Duration::from_secs(9));
        let s = h.snapshot();
        assert_eq!(s.count, 3);
        assert_eq!(s.cumulative[0], (0.001, 1));
        assert_eq!(s.cumulative[5], (0.05, 2));
        assert_eq!(s.cumulative.last().copied(), Some((f64::INFINITY, 3)));
        assert!((s.sum_seconds - 9.0305).abs() < 1e-9);
    }

    #[test]
    fn the_loop_age_runs_from_the_last_iteration_and_never_back() {
        let s = Stats::default();
        let t0 = Instant::now();
        s.loop_turned(t0 + Duration::from_secs(3));
        assert_eq!(
            s.loop_age(t0 + Duration::from_secs(10)),
            Duration::from_secs(7)
        );
        s.loop_turned(t0 + Duration::from_secs(1));
        assert_eq!(
            s.loop_age(t0 + Duration::from_secs(10)),
            Duration::from_secs(7),
            "an earlier stamp does not age the loop"
        );
        assert_eq!(
            s.loop_age(t0),
            Duration::ZERO,
            "a clock reading before the beat"
        );
    }

    #[test]
    fn ended_tasks_are_told_apart() {
        let s = Stats::default();
        assert!(!s.has_ended(Task::ControlLoop) && !s.has_ended(Task::FleetSource));
        s.task_ended(Task::FleetSource);
        assert!(!s.has_ended(Task::ControlLoop) && s.has_ended(Task::FleetSource));
    }

    #[test]
    fn errors_are_counted_per_pod_and_pruned_with_the_fleet() {
        let s = Stats::default();
        s.scrape_error("ns/a");
        s.scrape_error("ns/a");
        s.scrape_error("ns/b");
        assert_eq!(
            (s.scrape_errors_of("ns/a"), s.scrape_errors_total()),
            (2, 3)
        );
        s.retain_scrape_errors(|p| p == "ns/b");
        assert_eq!(s.scrape_errors_of("ns/a"), 0);
        assert_eq!(s.scrape_errors_of("ns/b"), 1);
        assert_eq!(s.scrape_errors_total(), 3, "the total never goes down");
    }
}
