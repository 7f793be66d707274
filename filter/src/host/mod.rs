//! Proxy-wasm glue: contexts, shared data, queues, HTTP calls and metrics. Each callback is
//! short and hands the decision to `crate::core`.

pub mod header_map;
pub mod holds;
pub mod http;
pub mod journal;
pub mod legs;
pub mod metrics;
pub mod prefix_sharing;
pub mod replicas;
pub mod root;
#[cfg(feature = "sections")]
pub mod sections;
pub mod snapshot;
pub mod store;
pub mod user_limits;
pub mod watchdog;

use std::cell::RefCell;

/// `section!("name", expr)`: `expr`, timed under `name` in builds with the `sections`
/// feature (see `host::sections`), nothing more otherwise.
#[macro_export]
macro_rules! section {
    ($name:literal, $e:expr) => {{
        #[cfg(feature = "sections")]
        let started = $crate::host::sections::start();
        let value = $e;
        #[cfg(feature = "sections")]
        $crate::host::sections::record($name, started);
        value
    }};
}

/// `section_scope!("name");`: the rest of the enclosing block, timed under `name` in
/// `sections` builds (early returns included), nothing otherwise.
#[macro_export]
macro_rules! section_scope {
    ($name:literal) => {
        #[cfg(feature = "sections")]
        let _section = $crate::host::sections::Scope::new($name);
    };
}
use std::rc::Rc;

use crate::core::config::PluginConfig;
use crate::core::fleet::FleetView;
use crate::core::pd::bucket_serve::Planner;
use crate::core::pd::PdDefaults;
use crate::core::prefix::{PrefixIndex, PrefixSettings};
use crate::core::tokens::SessionTable;

/// State shared by a VM's root context and its HTTP contexts (one VM per Envoy worker).
pub struct VmState {
    pub plugin: PluginConfig,
    /// Gateway environment: `AIBRIX_*` defaults and thresholds.
    pub defaults: PdDefaults,
    /// Last prompt size per session key (token-load rule 1). Per worker: a session's turns
    /// on another worker are charged by the next rule, never double-counted.
    pub sessions: SessionTable,
    /// Adaptive bucket serving's traffic picture and plans (per worker; the plan is advisory
    /// and each worker sees a fair sample of the traffic).
    pub planner: Planner,
    /// Where each prompt prefix was last sent (per worker; the others' insertions are read
    /// from their rings, `prefix_log`).
    pub prefix: PrefixIndex,
    pub prefix_settings: PrefixSettings,
    /// Notice queues of the other live VMs, refreshed every tick.
    pub peers: Vec<u32>,
    /// This VM's `vm_id` and notice queue name, once registered: what [`Self::peers`] is
    /// read with.
    pub queue_identity: Option<(String, String)>,
    /// Prefix events not published yet, and how many batches this VM has published: a
    /// request remembers the batch its event joined and publishes it, if still pending, when
    /// its response starts (see `host::http`).
    pub prefix_outbox: crate::core::prefix::EventBatch,
    pub prefix_batches_sent: u64,
    /// This VM's prefix-event ring and how far it has read the others' (`host::prefix_sharing`).
    pub prefix_log: crate::core::prefix::log::PrefixLog,
    /// How fast the other VMs publish, and so how often this one must read their rings.
    pub prefix_follow: crate::core::prefix::follow::FollowRate,
    /// Charges of this VM's in-flight requests, by HTTP context id.
    pub holds: hashbrown::HashMap<u32, holds::Hold>,
    /// The fleet view of the newest snapshot this VM has decoded.
    pub fleet: Option<Rc<FleetView>>,
    pub rng: fastrand::Rng,
    /// Buffers and ledger row hints PD selections reuse from one request to the next.
    pub select_scratch: crate::core::pd::Scratch,
    /// The last `external-filter` narrowing, reused by requests with the same selector.
    pub narrowed: crate::core::fleet::NarrowedViews,
    pub metrics: metrics::Metrics,
    /// The other gateway replicas' decode load, added to the ledger rows selection reads.
    pub remote: Option<std::sync::Arc<crate::core::remote::RemoteLoad>>,
    /// Content generation of the answer `remote` was read from, to skip unchanged answers
    /// (`host::replicas::adopt_newer`); `None` after a stale answer was dropped.
    pub remote_gen: Option<u64>,
    pub remote_at_ms: u64,
    /// Live gateway replicas other than this one, as pd-control last counted them (0 when
    /// the ledger is not shared or the count went stale).
    pub other_replicas: u32,
    /// `PD_ROUTER_DEBUG_TRAP_HEADER`: testing only, a request carrying it traps the VM.
    pub debug_trap_header: Option<String>,
    /// This VM's journal token and the shared-data key of its hold journal (`host::journal`).
    pub journal_token: u64,
    pub journal_key: String,
    /// Whether the token is on the journal registry (other VMs watch it). Set by the first
    /// journal write, which comes with the VM's first charge or tick; cleared when the VM
    /// finds it was declared dead.
    pub journal_registered: std::cell::Cell<bool>,
    /// The VM counts itself in `pd_router_fleet_loaded_vms` (said in its journal).
    pub fleet_counted: std::cell::Cell<bool>,
    /// The sequence of the journal last written (`host::journal::write`); a hold made after
    /// it is not in that journal yet.
    pub journal_seq: std::cell::Cell<u64>,
    /// Engine protocol state: `/server_info` cache, queued aborts, rid counter.
    pub engines: legs::EngineState,
    /// Requests of this VM under the decode watchdog, by HTTP context id.
    pub watched: hashbrown::HashMap<u32, watchdog::Watched>,
    pub watchdog_metrics: watchdog::WatchdogMetrics,
    /// Requests whose watchdog fired, by context id: their outcome is `pd_decode_watchdog`.
    pub watchdog_fired: hashbrown::HashSet<u32>,
    /// Pods this VM took out of its routing view after repeated failures.
    pub ejections: crate::core::ejection::Ejections,
    /// Off for a while once this worker's retrying cluster showed it lacks the pods.
    pub stand_in_breaker: crate::core::pd::stand_in_breaker::StandInBreaker,
    /// Whether this Envoy's retrying cluster took pd-control's endpoint listing, as the last
    /// poll said (`None`: not said; the snapshot's flag decides). Read at each tick.
    pub eds_here: Option<bool>,
    /// The root timer's period: slow while the VM has nothing to do.
    pub pace: crate::core::pace::TickPace,
    /// Tokens this VM's answers used per limited user, until the tick reports them.
    pub user_usage: crate::core::user_limits::UsageBook,
    /// Requests counted against their model's rate and then refused, to give back.
    pub model_refunds: crate::core::user_limits::RefundBook,
    /// `vtc-basic`'s per-user token window (per worker, as AIBrix's is per replica).
    pub vtc: crate::core::pd::vtc::TokenTracker,
    /// Request bodies this VM's requests keep while they wait on a callout, bounded by the
    /// plugin's `max_held_body_bytes` (`core::held_body`).
    pub held_bodies: crate::core::held_body::BodyBudget,
    /// Refusal log lines, paced per reason (`core::obs::log_pace`).
    pub refusal_log: crate::core::obs::log_pace::LogPace,
}

impl VmState {
    /// Work arrived: the timer goes back to its fast period if it had slowed down. Any
    /// context may call it (the host sets the period of the VM's root context).
    pub fn wake(&mut self) {
        if let Some(r) = self.pace.wake() {
            self.set_pace(r);
        }
    }

    /// [`VmState::wake`] for a request. When this VM was idle it wakes the other VMs too (one
    /// message on each peer's queue, only on that edge) if they have a reason to keep up with
    /// it: other gateway replicas read this one's load, and whichever VM holds the snapshot
    /// lease reports it (asleep, it would send the first report of a burst on its idle tick,
    /// up to a second late); and a VM that routes by prefix publishes to its ring, which a
    /// burst from here would lap before an idle follower's next tick (a ring holds 128
    /// batches; the follower measures the rate only from its second read on, see
    /// `core::prefix::follow`). For that second reason alone only the followers wake, and only
    /// their ring reads ([`snapshot::WAKE_FOLLOWERS`]). A lone gateway whose policies use no
    /// prefix index keeps its other VMs asleep.
    pub fn wake_for_request(&mut self) {
        if let Some(r) = self.pace.wake() {
            self.set_pace(r);
            // The replica count as this process knows it now, not as of this VM's last
            // (idle, up to a second old) tick.
            replicas::adopt_newer(self, now_ms());
            if self.other_replicas > 0 {
                snapshot::broadcast(&self.peers, snapshot::MSG_WAKE, &[]);
            } else if self.prefix_batches_sent > 0 {
                snapshot::broadcast(&self.peers, snapshot::MSG_WAKE, &[snapshot::WAKE_FOLLOWERS]);
            }
        }
    }

    /// Applies a period [`crate::core::pace::TickPace`] chose and, when the VM went idle or
    /// woke with it, counts the VM in or out of `pd_router_idle_vms`.
    pub fn set_pace(&self, r: crate::core::pace::Retick) {
        set_tick_period(r.period_ms);
        if r.slow_changed {
            let delta = if self.pace.is_slow() { 1 } else { -1 };
            metrics::Metrics::gauge_add(self.metrics.idle_vms, delta);
        }
    }

    /// Whether anything outstanding needs the timer: charges to release or journal,
    /// streams under the watchdog, queued aborts, prefix events not published yet, ledger gauges
    /// not defined yet.
    pub fn has_outstanding_work(&self) -> bool {
        !self.holds.is_empty()
            || !self.watched.is_empty()
            || self.engines.has_queued_aborts()
            || !self.prefix_outbox.is_empty()
            || self.metrics.has_waiting_gauges()
    }

    /// Records how a pod served a request (`ok`) for passive ejection, logging and counting
    /// an ejection, which the other VMs are told of.
    pub fn pod_outcome(&mut self, pod: &str, ok: bool, now_ms: u64) {
        if ok {
            self.ejections.success(pod);
            return;
        }
        self.metrics.pod_failed(pod);
        if let crate::core::ejection::Verdict::Ejected { for_ms } =
            self.ejections.failure(pod, now_ms)
        {
            log::warn!(
                "ejecting pod {pod} from routing for {for_ms} ms after {} consecutive failures",
                self.plugin.eject_after_failures
            );
            metrics::Metrics::inc(self.metrics.ejections);
            self.drop_ejected_pods();
            if let Some(notice) = self.ejections.notice(pod) {
                let mut payload = Vec::with_capacity(12 + pod.len());
                notice.encode_into(&mut payload);
                // Read afresh (ejections are rare): a VM that registered since this one's
                // last tick must hear of it too.
                if let Some((vm_id, queue)) = &self.queue_identity {
                    self.peers = snapshot::live_queues(vm_id, now_ms, Some(queue));
                }
                snapshot::broadcast(&self.peers, snapshot::MSG_EJECT, &payload);
            }
        }
    }

    /// Another VM ejected a pod (a queued `EjectNotice`): out of this VM's view too.
    pub fn adopt_ejection(&mut self, payload: &[u8], now_ms: u64) {
        let notice = match crate::core::ejection::EjectNotice::decode(payload) {
            Ok(notice) => notice,
            Err(e) => {
                log::warn!("dropping an ejection notice: {e}");
                return;
            }
        };
        if self.ejections.adopt(&notice, now_ms) {
            log::info!(
                "pod {} out of routing until another worker's ejection of it ends ({} ms)",
                notice.pod,
                notice.until_ms.saturating_sub(now_ms)
            );
            metrics::Metrics::inc(self.metrics.ejections_adopted);
            self.drop_ejected_pods();
        }
    }

    /// Takes ejected pods out of this VM's view at once, not at the next tick: the next
    /// request must not be routed there. (The tick rebuilds the view from the snapshot anyway.)
    fn drop_ejected_pods(&mut self) {
        if let Some(fleet) = &self.fleet {
            let ejections = &self.ejections;
            self.fleet = Some(Rc::new(fleet.without_pods(|k| ejections.is_ejected(k))));
        }
    }
}

pub type SharedVm = Rc<RefCell<VmState>>;

/// Sets the period of the calling VM's root timer.
pub fn set_tick_period(period_ms: u64) {
    let period = std::time::Duration::from_millis(period_ms);
    if let Err(e) = proxy_wasm::hostcalls::set_tick_period(period) {
        log::warn!("cannot set the timer period to {period_ms} ms: {e:?}");
    }
}

thread_local! {
    static CALL_ANSWERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the side-call answer about to be handled (`headers`: how many it has). Envoy calls
/// back with none when it failed the call after the answer began (a stream reset mid-answer,
/// an answer over its async-client buffer limit): there is no header map then, and asking for
/// a header is an error the SDK turns into a panic, a trap of the VM with every stream of the
/// worker.
///
/// The mark lasts while the returned guard lives (hold it for the whole callback): outside an
/// answer there is no answer map either, and a stale mark would let [`call_header`] ask for one.
#[must_use = "the answer is marked only while the guard lives"]
pub fn answering_call(headers: usize) -> CallAnswer {
    CALL_ANSWERED.with(|a| a.set(headers > 0));
    CallAnswer
}

/// See [`answering_call`].
pub struct CallAnswer;

impl Drop for CallAnswer {
    fn drop(&mut self) {
        CALL_ANSWERED.with(|a| a.set(false));
    }
}

/// A header of the side-call answer being handled; `None` when it has none (see
/// [`answering_call`]) or its value is not UTF-8 (the SDK's text getter panics on one, which
/// would trap the VM).
pub fn call_header(name: &str) -> Option<String> {
    if !CALL_ANSWERED.with(|a| a.get()) {
        return None;
    }
    proxy_wasm::hostcalls::get_map_value_bytes(
        proxy_wasm::types::MapType::HttpCallResponseHeaders,
        name,
    )
    .ok()
    .flatten()
    .and_then(|value| String::from_utf8(value).ok())
}

/// Milliseconds since the Unix epoch from the host clock.
pub fn now_ms() -> u64 {
    proxy_wasm::hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Milliseconds on Envoy's monotonic clock (WASI `clock_time_get`, `CLOCK_MONOTONIC`), from an
/// origin of this VM's own: for deadlines the VM both sets and checks (the decode watchdog).
/// The wall clock of `now_ms` may step with NTP or a VM migration; a step forward of a
/// minute read as elapsed time would fire every running request's watchdog at once (mass
/// 504s and cut streams), a step back would hold them all.
pub fn steady_ms() -> u64 {
    thread_local! {
        static ORIGIN: std::time::Instant = std::time::Instant::now();
    }
    // The first reading is a few ms after the origin (0 is "never armed" nowhere, but keep
    // every reading positive anyway).
    ORIGIN.with(|origin| origin.elapsed().as_millis() as u64 + 1)
}

/// Nanoseconds since the Unix epoch from the host clock, for durations inside the VM.
pub fn now_ns() -> u128 {
    proxy_wasm::hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Microseconds since the Unix epoch from the host clock, for request timing.
pub fn now_us() -> u64 {
    (now_ns() / 1_000) as u64
}

/// The host clock read at most once for one callback. Each reading is a host call (≈ 1 200
/// instructions in Envoy, `make profile-instructions`), and the steps of one callback run
/// within microseconds of each other; read lazily, so a callback that needs no time reads none.
#[derive(Default)]
pub struct Clock(Option<u128>);

impl Clock {
    pub fn ns(&mut self) -> u128 {
        *self.0.get_or_insert_with(now_ns)
    }

    pub fn us(&mut self) -> u64 {
        (self.ns() / 1_000) as u64
    }

    pub fn ms(&mut self) -> u64 {
        (self.ns() / 1_000_000) as u64
    }
}

/// A random seed from WASI `random_get`; falls back to the clock, which is only less
/// unpredictable, never wrong for tie-breaks.
pub fn random_seed() -> u64 {
    let mut buf = [0u8; 8];
    match getrandom::fill(&mut buf) {
        Ok(()) => u64::from_le_bytes(buf),
        Err(_) => now_ms().wrapping_mul(0x9e37_79b9_7f4a_7c15),
    }
}
