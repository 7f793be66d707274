//! The per-VM root context: configuration, the timer that keeps the fleet view fresh, and the
//! factory of HTTP contexts.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

use crate::core::config::PluginConfig;
use crate::core::engine::EngineDefaults;
use crate::core::fleet::FleetView;
use crate::core::freshness::{ConfirmationAge, Freshness, Transition};
use crate::core::ledger;
use crate::core::pd::bucket_serve::Planner;
use crate::core::pd::PdDefaults;
use crate::core::poll::FollowUps;
use crate::core::prefix::{EventBatch, EventRef, PrefixIndex, PrefixSettings};
use crate::core::remote::ReportDue;
use crate::core::tokens::{SessionTable, TokenLoadSettings};
use crate::host::http::PdHttp;
use crate::host::legs::EngineState;
use crate::host::metrics::Metrics;
use crate::host::snapshot::{self, NoticeQueue};
use crate::host::store::SharedData;
use crate::host::watchdog::WatchdogMetrics;
use crate::host::{now_ms, now_us, random_seed, SharedVm, VmState};

pub struct Root {
    vm: SharedVm,
    /// This root context's id, made effective again after acting on an HTTP stream.
    context_id: u32,
    /// Identifies this root context in the lease and the queue registry.
    token: u64,
    /// FNV-1a 64 of the plugin configuration (`snapshot::lead_config`); 0 before it.
    config_fp: u64,
    /// This root's configuration was superseded by a newer one (logged once).
    superseded: bool,
    vm_id: String,
    queue: Option<NoticeQueue>,
    fetch_in_flight: Option<u32>,
    /// The version the poll in flight named (the published one when it was sent).
    polled_with: u64,
    /// Polls this VM may send as soon as an answer brings a new version (`core::poll`).
    follow_ups: FollowUps,
    loaded_once: bool,
    /// The newest adopted view as decoded; the VM routes on a stale-flagged copy of it
    /// while pd-control has not confirmed it for `snapshot_stale_after_ms`.
    latest: Option<Rc<FleetView>>,
    /// When this VM adopted `latest`: its age reference while no poll confirmation has been
    /// recorded in this process yet.
    adopted_at: u64,
    freshness: Freshness,
    /// Stale while this VM has held no snapshot for `snapshot_stale_after_ms` since it
    /// started: a gateway started while pd-control is unreachable answers every request 503,
    /// and must not read fresh (age 0) on the gauges operators alert on.
    unsnapshotted: Freshness,
    /// The stale gauge was written from this root's snapshot at least once.
    stale_gauge_written: bool,
    /// When this root context was created, on the VM's monotonic clock.
    created_steady_ms: u64,
    /// The last confirmation's age on this VM's monotonic clock.
    confirmation_age: ConfirmationAge,
    /// Consecutive failed polls; logged at 1, 2, 4, 8, ... so an outage does not flood the log.
    fetch_failures: u64,
    next_housekeeping: u64,
    next_eviction: u64,
    next_ledger_prune: u64,
    /// When the per-pod ledger gauges are next rewritten from the ledger itself.
    next_gauge_sync: u64,
    /// When the adoption gauges are next rewritten (see [`Root::show_adoption`]).
    next_adoption_show: u64,
    /// A snapshot this VM routes on whose adoption the tally did not take yet (see
    /// `snapshot::record_adoption`): counted again from the housekeeping.
    uncounted: Option<u64>,
    /// This Envoy process's id among gateway replicas (shared by its VMs).
    replica: u64,
    report_in_flight: Option<u32>,
    /// The last report sent and when: an unchanged ledger is reported again only after
    /// [`REPORT_HEARTBEAT_MS`].
    last_report: Option<(Vec<u8>, u64)>,
    /// Other live gateway replicas, as pd-control's last answer counted them.
    other_replicas: u32,
    /// Consecutive failed replica reports, logged at powers of two.
    report_failures: u64,
    /// The token report in flight (`host::user_limits`): the call's token and the report,
    /// handed back to the book if it does not arrive.
    usage_in_flight: Option<(u32, crate::core::user_limits::Report)>,
    usage_failures: u64,
    /// The release in flight (`host::user_limits::send_release`): the call's token and how
    /// many requests it gives back.
    release_in_flight: Option<(u32, u64)>,
    release_failures: u64,
    /// Publishes this VM's outstanding charges and reclaims those of dead VMs.
    journal: crate::host::journal::JournalWriter,
}

/// How long one tick (or adoption) may spend defining waiting per-pod ledger gauges: ≈ 4 pods'
/// worth at Envoy's ≈ 0.1 ms per stat, so a 512-pod fleet's gauges take ≈ 13 s of 100 ms ticks
/// instead of blocking the worker for ≈ 0.26 s at once (see `core::obs::backlog`).
const GAUGE_DEFINE_BUDGET_US: u64 = 2_000;

/// Defines waiting ledger gauges within [`GAUGE_DEFINE_BUDGET_US`].
fn define_waiting_gauges(vm: &mut VmState) {
    let started = now_us();
    let (defined, waiting) = vm.metrics.define_waiting_gauges(GAUGE_DEFINE_BUDGET_US);
    if defined > 0 {
        log::debug!(
            "defined the ledger gauges of {defined} pods in {} µs, {waiting} pods wait",
            now_us().saturating_sub(started)
        );
    }
}

/// Period of [`Root::sync_ledger_gauges`], which writes every per-pod ledger gauge (a charge
/// also writes its own pods'): one ledger read per worker, and only changed values are written.
const GAUGE_SYNC_MS: u64 = 200;
/// Period of the adoption gauges' resync.
const ADOPTION_SHOW_MS: u64 = 1_000;
/// Period of the per-VM upkeep (force-release of charges past their TTL, sessions, VTC, the
/// ledger janitor's checks). Fixed: the prefix index's eviction interval, an operator's knob,
/// paces only the eviction, so a long one cannot hold charges past their TTL.
const HOUSEKEEPING_MS: u64 = 1_000;
/// Longest gap between two replica reports (see [`crate::core::remote::report_due`]). Well
/// inside pd-control's replica TTL and [`replicas::REMOTE_STALE_MS`] (5 s each), so neither
/// side ages out.
///
/// [`replicas::REMOTE_STALE_MS`]: crate::host::replicas::REMOTE_STALE_MS
const REPORT_HEARTBEAT_MS: u64 = 1_000;

impl Root {
    pub fn new(context_id: u32) -> Root {
        let seed = random_seed();
        Root {
            vm: Rc::new(RefCell::new(VmState {
                plugin: PluginConfig::default(),
                defaults: PdDefaults::default(),
                sessions: SessionTable::from_settings(&TokenLoadSettings::default()),
                planner: Planner::new(),
                prefix: PrefixIndex::new(1, 1),
                prefix_settings: PrefixSettings::default(),
                peers: Vec::new(),
                queue_identity: None,
                prefix_outbox: Default::default(),
                prefix_batches_sent: 0,
                prefix_log: crate::core::prefix::log::PrefixLog::new(seed | 1),
                prefix_follow: Default::default(),
                holds: hashbrown::HashMap::new(),
                fleet: None,
                rng: fastrand::Rng::with_seed(seed),
                select_scratch: crate::core::pd::Scratch::default(),
                narrowed: Default::default(),
                metrics: Metrics::default(),
                remote: None,
                remote_gen: None,
                remote_at_ms: 0,
                other_replicas: 0,
                debug_trap_header: None,
                journal_token: seed | 1,
                journal_key: crate::host::journal::key_of(seed | 1),
                journal_registered: Default::default(),
                fleet_counted: Default::default(),
                journal_seq: Default::default(),
                engines: EngineState::new(EngineDefaults::default()),
                watched: hashbrown::HashMap::new(),
                watchdog_metrics: WatchdogMetrics::default(),
                watchdog_fired: hashbrown::HashSet::new(),
                ejections: crate::core::ejection::Ejections::default(),
                stand_in_breaker: Default::default(),
                eds_here: None,
                pace: crate::core::pace::TickPace::new(100, 10_000),
                refusal_log: Default::default(),
                user_usage: Default::default(),
                model_refunds: Default::default(),
                vtc: Default::default(),
                held_bodies: Default::default(),
            })),
            context_id,
            token: seed | 1,
            vm_id: String::new(),
            queue: None,
            fetch_in_flight: None,
            polled_with: 0,
            follow_ups: FollowUps::default(),
            loaded_once: false,
            latest: None,
            adopted_at: 0,
            freshness: Freshness::default(),
            unsnapshotted: Freshness::default(),
            stale_gauge_written: false,
            created_steady_ms: crate::host::steady_ms(),
            confirmation_age: ConfirmationAge::default(),
            fetch_failures: 0,
            next_housekeeping: 0,
            next_eviction: 0,
            next_ledger_prune: 0,
            next_gauge_sync: 0,
            next_adoption_show: 0,
            uncounted: None,
            replica: 0,
            report_in_flight: None,
            last_report: None,
            other_replicas: 0,
            report_failures: 0,
            usage_in_flight: None,
            usage_failures: 0,
            release_in_flight: None,
            release_failures: 0,
            journal: crate::host::journal::JournalWriter::new(seed | 1),
            config_fp: 0,
            superseded: false,
        }
    }

    /// Takes or renews the lease that makes this root the one polling pd-control and
    /// reporting to it; never for a root whose configuration was superseded.
    fn lead(&mut self, now: u64, lease_ms: u64) -> bool {
        if !snapshot::leads_config(self.config_fp) {
            if !self.superseded {
                self.superseded = true;
                log::info!(
                    "plugin configuration superseded: leaving snapshot polling and replica \
                     reports to the new one"
                );
            }
            return false;
        }
        self.superseded = false;
        snapshot::hold_lease(self.token, now, lease_ms)
    }

    /// The lease holder reports this process's decode ledger to pd-control (see
    /// [`REPORT_HEARTBEAT_MS`] for how often) and keeps the other replicas' shares it answers.
    /// Running counts go out whatever `AIBRIX_TOKEN_LOAD_SHARED_LEDGER` says; decode tokens only
    /// with it (`core::remote`).
    fn maybe_report(&mut self, now: u64) {
        if self.report_in_flight.is_some() {
            return;
        }
        let share_decode = self.vm.borrow().defaults.tokens.shared_ledger;
        let plugin = self.vm.borrow().plugin.clone();
        let lease_ms = (plugin.refresh_ms * 5).max(1_000);
        if !self.lead(now, lease_ms) {
            return;
        }
        let body = match crate::host::replicas::report_body(self.replica, share_decode) {
            Ok(body) => body,
            Err(e) => return self.report_failed(format!("cannot read the ledger to report: {e}")),
        };
        let last = self.last_report.as_ref().map(|(b, at)| (b.as_slice(), *at));
        let due = crate::core::remote::report_due(
            last,
            &body,
            self.other_replicas,
            now,
            REPORT_HEARTBEAT_MS,
        );
        let news = match due {
            ReportDue::No => return,
            ReportDue::News => true,
            ReportDue::Heartbeat => false,
        };
        match crate::host::replicas::send_report(
            &plugin.control_cluster,
            &plugin.control_authority,
            &body,
            &plugin.snapshot_token,
            Duration::from_millis(plugin.fetch_timeout_ms),
        ) {
            Ok(token) => {
                self.report_in_flight = Some(token);
                if news {
                    // The process is routing and others read its load: report every tick.
                    self.vm.borrow_mut().wake();
                }
                self.last_report = Some((body, now));
            }
            Err(e) => self.report_failed(format!("cannot send the replica report: {e}")),
        }
    }

    /// Reports the tokens this VM's limited users' answers used since the last report, one
    /// report in flight at a time. pd-control adds them to the users' TPM counters, which the
    /// next admissions read (across every gateway sharing its Redis).
    fn maybe_send_usage(&mut self) {
        if self.usage_in_flight.is_some() {
            return;
        }
        let now = now_ms();
        let prefix = format!("{:x}", self.token);
        let (report, plugin) = {
            let mut vm = self.vm.borrow_mut();
            let dropped = std::mem::take(&mut vm.user_usage.dropped);
            Metrics::add(vm.metrics.user_tokens_unreported, dropped);
            let Some(report) = vm.user_usage.take(&prefix, now) else {
                return;
            };
            (report, vm.plugin.clone())
        };
        match crate::host::user_limits::send_usage(&plugin, &report.id, &report.body) {
            Ok(token) => self.usage_in_flight = Some((token, report)),
            Err(e) => self.usage_failed(report, format!("cannot send the token report: {e}")),
        }
    }

    fn on_usage_answer(&mut self, report: crate::core::user_limits::Report) {
        let status = crate::host::call_header(":status").unwrap_or_default();
        if status == "204" || status == "200" {
            self.usage_failures = 0;
            Metrics::add(self.vm.borrow().metrics.user_tokens_reported, report.tokens);
        } else if matches!(status.as_str(), "400" | "413" | "422") {
            // Refused as it stands (a report pd-control cannot read): sent again it would be
            // refused alike, holding the newer reports behind it until it ages out. (A 401
            // during a token rotation, or a proxy's 429, is sent again.)
            let vm = self.vm.borrow();
            Metrics::add(vm.metrics.user_tokens_unreported, report.tokens);
            Metrics::add(vm.metrics.user_token_report_failures, 1);
            log::warn!(
                "token report refused with status {status}: its {} tokens are not counted",
                report.tokens
            );
        } else {
            self.usage_failed(report, format!("token report answered status {status:?}"));
        }
    }

    /// A report that did not arrive (or arrived only in part) goes again on the next ticks,
    /// under the same id, for as long as its tokens still fall in the users' TPM minute;
    /// after that its tokens are given up, and `pd_router_user_tokens_unreported_total`
    /// counts them.
    fn usage_failed(&mut self, report: crate::core::user_limits::Report, why: String) {
        let tokens = report.tokens;
        let given_up = {
            let mut vm = self.vm.borrow_mut();
            let given_up = vm.user_usage.failed(report, now_ms());
            Metrics::add(vm.metrics.user_tokens_unreported, given_up);
            Metrics::add(vm.metrics.user_token_report_failures, 1);
            given_up
        };
        self.usage_failures += 1;
        if self.usage_failures.is_power_of_two() {
            log::warn!(
                "{why}: {tokens} tokens not counted against their users' TPM yet, {given_up} given up ({} consecutive failures)",
                self.usage_failures
            );
        }
    }

    /// Gives the requests this VM counted against their model's rate and then refused back to
    /// pd-control, one release in flight at a time. Sent once (see `RefundBook`).
    fn maybe_send_release(&mut self) {
        if self.release_in_flight.is_some() {
            return;
        }
        let (refunds, plugin) = {
            let mut vm = self.vm.borrow_mut();
            if vm.model_refunds.is_empty() && vm.model_refunds.lost == 0 {
                return;
            }
            let refunds = vm.model_refunds.take(crate::host::steady_ms());
            let lost = std::mem::take(&mut vm.model_refunds.lost);
            Metrics::add(vm.metrics.model_rps_refunds[1], lost);
            let Some(refunds) = refunds else {
                return;
            };
            (refunds, vm.plugin.clone())
        };
        match crate::host::user_limits::send_release(&plugin, &refunds.body) {
            Ok(token) => self.release_in_flight = Some((token, refunds.count)),
            Err(e) => self.release_failed(refunds.count, format!("cannot send the release: {e}")),
        }
    }

    fn on_release_answer(&mut self, count: u64) {
        let status = crate::host::call_header(":status").unwrap_or_default();
        if status == "200" {
            self.release_failures = 0;
            Metrics::add(self.vm.borrow().metrics.model_rps_refunds[0], count);
        } else {
            self.release_failed(count, format!("release answered status {status:?}"));
        }
    }

    fn release_failed(&mut self, count: u64, why: String) {
        Metrics::add(self.vm.borrow().metrics.model_rps_refunds[1], count);
        self.release_failures += 1;
        if self.release_failures.is_power_of_two() {
            log::warn!(
                "{why}: {count} requests not given back to their model's rate ({} consecutive failures)",
                self.release_failures
            );
        }
    }

    fn report_failed(&mut self, why: String) {
        // Not delivered: the next tick sends it again, changed or not.
        self.last_report = None;
        self.report_failures += 1;
        if self.report_failures.is_power_of_two() {
            log::warn!(
                "{why} ({} consecutive failures; other replicas' load ages out)",
                self.report_failures
            );
        }
    }

    fn on_report_answer(&mut self, body_size: usize) {
        self.report_in_flight = None;
        let status = crate::host::call_header(":status").unwrap_or_default();
        if status != "200" {
            return self.report_failed(format!("replica report answered status {status:?}"));
        }
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        let now = now_ms();
        match crate::host::replicas::store_answer(now, &body) {
            Ok(stored) => {
                self.report_failures = 0;
                self.other_replicas = stored.others;
                if stored.changed {
                    // Every VM scores on the new shares now, not at its next (maybe idle) tick.
                    let mut vm = self.vm.borrow_mut();
                    snapshot::broadcast(&vm.peers, snapshot::MSG_REMOTE, &[]);
                    crate::host::replicas::refresh(&mut vm, now);
                }
            }
            Err(e) => self.report_failed(e),
        }
    }

    /// Adopts the published snapshot when it is newer than this VM's view.
    fn reload(&mut self) {
        let have = self
            .vm
            .borrow()
            .fleet
            .as_ref()
            .map(|f| f.version)
            .unwrap_or(0);
        match snapshot::load_newer(have, self.latest.as_deref()) {
            Ok(Some(view)) => self.adopt(view),
            Ok(None) => {}
            Err(e) => log::warn!("{e}"),
        }
    }

    fn adopt(&mut self, view: FleetView) {
        let version = view.version;
        let (version_gauge, loaded_gauge) = {
            let mut vm = self.vm.borrow_mut();
            // The poll that brought this snapshot said what it says of this gateway's retrying
            // cluster before publishing it: a VM routing on it knows that too.
            if vm.plugin.connect_retry {
                vm.eds_here = snapshot::eds_here();
            }
            // Nearly every snapshot only brings new metrics: the pod set is the one in hand.
            let same_pods = self
                .latest
                .as_ref()
                .is_some_and(|latest| latest.same_topology(&view));
            vm.metrics.snapshot_adopted(same_pods);
            if !same_pods {
                if vm.metrics.has_pod_series() {
                    // Pods that left the fleet: zero their gauges, stop updating their counters.
                    let live: hashbrown::HashSet<&str> = view
                        .models
                        .values()
                        .flat_map(|m| m.pods.iter().map(|p| p.key.as_str()))
                        .collect();
                    vm.metrics.retain_pods(|key| live.contains(key));
                }
                // Every VM shows every pod's ledger gauges (written by `sync_ledger_gauges`),
                // so a charge shows even when the VM that made it died before its next sync.
                vm.metrics.track_pods(
                    view.models
                        .values()
                        .flat_map(|m| m.pods.iter().map(|p| p.key.as_str())),
                );
                // A small fleet gets all of its gauges now, a large one over the next ticks.
                define_waiting_gauges(&mut vm);
            }
            let view = Rc::new(view);
            vm.fleet = Some(routing_view(
                &view,
                self.freshness.is_stale(),
                &vm.ejections,
            ));
            self.latest = Some(view);
            self.adopted_at = now_ms();
            (vm.metrics.fleet_version, vm.metrics.fleet_loaded_vms)
        };
        match snapshot::record_adoption(version) {
            Ok((tally, counted)) => {
                self.uncounted = (!counted).then_some(version);
                self.show_adoption(tally);
            }
            Err(e) => {
                Metrics::set(version_gauge, version);
                log::warn!("cannot count the adoption of snapshot {version}: {e}");
            }
        }
        if !self.loaded_once {
            self.loaded_once = true;
            Metrics::gauge_add(loaded_gauge, 1);
            log::info!("fleet snapshot {version} loaded");
            // Said in the journal from its next write (a charge or the tick): should the VM
            // die, its reclaimer takes it out. Not written here: Envoy's canary VM, which
            // adopts a snapshot in `on_configure` and is then destroyed without `on_done`,
            // would register and be reclaimed ten seconds later.
            self.vm.borrow().fleet_counted.set(true);
        }
    }

    /// Periodic upkeep of per-VM state: prefix-index age eviction (every
    /// `AIBRIX_PREFIX_CACHE_EVICTION_INTERVAL_SECONDS`), the rest every [`HOUSEKEEPING_MS`].
    /// Paced on this VM's monotonic clock: a backward step of the wall clock would otherwise
    /// hold every upkeep (and the force-release of charges) back by its size.
    fn housekeeping(&mut self, now: u64) {
        let steady = crate::host::steady_ms();
        let mut vm = self.vm.borrow_mut();
        if steady >= self.next_eviction {
            let interval = vm.prefix_settings.eviction_interval_ms.max(100);
            self.next_eviction = steady.saturating_add(interval);
            let age = vm.prefix_settings.eviction_age_ms;
            vm.prefix.evict_older_than(now, age);
        }
        if steady < self.next_housekeeping {
            return;
        }
        self.next_housekeeping = steady + HOUSEKEEPING_MS;
        vm.sessions.prune(now);
        // Users idle for a whole window give their memory back (at most once a second).
        let state = &mut *vm;
        state.vtc.sweep(now, &state.defaults.env.single.vtc);
        drop(vm);
        crate::host::holds::expire(&self.vm, now, steady);
        if steady >= self.next_adoption_show {
            self.next_adoption_show = steady + ADOPTION_SHOW_MS;
            self.count_uncounted_adoption();
            if let Some(tally) = snapshot::adoption_tally() {
                self.show_adoption(tally);
            }
        }
        if steady >= self.next_ledger_prune {
            // Pods that left (autoscaling, rollouts) must not accumulate in the shared ledger.
            self.next_ledger_prune = steady + crate::core::tokens::IDLE_PRUNE_MS;
            let pruned = crate::core::ledger::update(&SharedData, |l| {
                Ok::<_, crate::core::ledger::StoreError>(l.prune_idle(now))
            });
            match pruned {
                Ok(n) if n > 0 => log::info!("ledger janitor dropped {n} idle pods"),
                Ok(_) => {}
                Err(e) => log::warn!("ledger janitor: {e}"),
            }
        }
    }

    /// Counts this VM's adoption that raced with the publication of its snapshot, once the
    /// version key names that snapshot (while it names another, the VM is behind or the
    /// publisher is between its two writes: it waits).
    fn count_uncounted_adoption(&mut self) {
        let Some(version) = self.uncounted else {
            return;
        };
        if self.latest.as_ref().map(|l| l.version) != Some(version) {
            self.uncounted = None; // routing on another snapshot, counted (or not) on its own
            return;
        }
        if snapshot::published_version() != version {
            return;
        }
        match snapshot::record_adoption(version) {
            Ok((tally, counted)) => {
                if counted {
                    self.uncounted = None;
                }
                self.show_adoption(tally);
            }
            Err(e) => log::warn!("cannot count the adoption of snapshot {version}: {e}"),
        }
    }

    /// Shows the newest snapshot and how many VMs route on it. Called after each adoption
    /// and every second: two VMs' writes can land out of order, the resync bounds the lag.
    /// The count goes first: whoever reads the version and then the count (as tests waiting
    /// for every VM do) never pairs a new version with the old version's count from this VM.
    fn show_adoption(&self, tally: crate::core::adoption::Tally) {
        let vm = self.vm.borrow();
        Metrics::set(vm.metrics.fleet_vms_on_latest, u64::from(tally.vms));
        Metrics::set(vm.metrics.fleet_version, tally.version);
    }

    /// Writes the per-pod ledger gauges from the shared ledger (the request path writes only
    /// a charge's pods). Every worker does, from the same ledger, so whichever writes last
    /// writes a value at most one period old: an idle gateway reads exactly 0 within
    /// [`GAUGE_SYNC_MS`] plus one tick.
    fn sync_ledger_gauges(&mut self) {
        if !self.vm.borrow().metrics.has_pod_series() {
            return;
        }
        match crate::core::ledger::read(&SharedData) {
            Ok(ledger) => self.vm.borrow_mut().metrics.sync_ledger_gauges(&ledger),
            Err(e) => log::warn!("cannot read the ledger for its gauges: {e}"),
        }
    }

    fn fetch_failed(&mut self, reason: &'static str, why: String) {
        self.fetch_failures += 1;
        self.vm.borrow().metrics.snapshot_fetch_error(reason);
        if self.fetch_failures.is_power_of_two() {
            log::warn!(
                "{why} ({} consecutive failures; routing on the last snapshot)",
                self.fetch_failures
            );
        }
    }

    fn fetch_succeeded(&mut self) {
        snapshot::confirm(now_ms());
        if self.fetch_failures > 0 {
            log::info!(
                "snapshot polls recovered after {} failures",
                self.fetch_failures
            );
            self.fetch_failures = 0;
        }
    }

    /// This Envoy's node id (`xds.node.id`), which its EDS stream names too: pd-control answers
    /// each poll with whether that node's retrying cluster took the endpoint listing.
    fn node_id(&self) -> Option<String> {
        // Envoy 1.40 answers `xds.node.id` (the older `node.id` path reads nothing).
        self.get_property(vec!["xds", "node", "id"])
            .and_then(|id| String::from_utf8(id).ok())
            .filter(|id| !id.is_empty())
    }

    fn maybe_fetch(&mut self, now: u64) {
        let plugin = self.vm.borrow().plugin.clone();
        let lease_ms = (plugin.refresh_ms * 5).max(1_000);
        if self.fetch_in_flight.is_some() {
            // A long poll may be held for seconds: keep the lease meanwhile, or another VM
            // would take it and poll too. A VM that dies mid-poll stops renewing, and the
            // next takes over within `lease_ms`.
            self.lead(now, lease_ms);
            return;
        }
        if !self.lead(now, lease_ms) {
            return;
        }
        let have = snapshot::published_version();
        let machine = crate::core::engine::trtllm::machine_header(
            self.replica,
            self.vm.borrow().engines.defaults.trt_machine_id,
        );
        match snapshot::fetch_request(&plugin, have, self.node_id().as_deref(), &machine) {
            Ok(token) => {
                self.fetch_in_flight = Some(token);
                self.polled_with = have;
            }
            Err(e) => self.fetch_failed(
                "dispatch",
                format!("cannot poll cluster {}: {e:?}", plugin.control_cluster),
            ),
        }
    }

    /// Judges the snapshot's age from the last confirmed poll (shared by every VM), flags
    /// its metrics stale past `snapshot_stale_after_ms` and unflags them once pd-control
    /// answers again. Routing never stops for it: the pods of the last snapshot stay.
    fn check_freshness(&mut self, now: u64) {
        let Some(latest) = self.latest.clone() else {
            self.check_unsnapshotted();
            return;
        };
        if !self.stale_gauge_written {
            // This root's first snapshot: the gauge says its state from here, whatever a VM
            // without one (this root, or one a reload replaced) left in it.
            self.stale_gauge_written = true;
            self.unsnapshotted = Freshness::default();
            let gauge = self.vm.borrow().metrics.snapshot_stale;
            Metrics::set(gauge, u64::from(self.freshness.is_stale()));
        }
        // The process-wide confirmation wins: a VM created by a reload while pd-control is
        // down must not call its inherited snapshot fresh just because it adopted it now.
        let confirmed = snapshot::confirmed_at().unwrap_or(self.adopted_at);
        let age_ms = self
            .confirmation_age
            .age_ms(now, confirmed, crate::host::steady_ms());
        let (bound, stale_gauge, age_gauge) = self.freshness_settings();
        Metrics::set(age_gauge, age_ms);
        let Some(transition) = self.freshness.observe_age(age_ms, bound) else {
            return;
        };
        let view = match transition {
            Transition::BecameStale { age_ms } => {
                log::warn!(
                    "fleet snapshot {} is stale: pd-control has not confirmed it for {age_ms} ms \
                     (snapshot_stale_after_ms {bound}); routing on its pods, ignoring their \
                     engine metrics",
                    latest.version
                );
                Metrics::set(stale_gauge, 1);
                latest.clone()
            }
            Transition::BecameFresh { age_ms } => {
                log::info!(
                    "fleet snapshot {} is fresh again (confirmed {age_ms} ms ago)",
                    latest.version
                );
                Metrics::set(stale_gauge, 0);
                latest
            }
        };
        let mut vm = self.vm.borrow_mut();
        vm.fleet = Some(routing_view(
            &view,
            self.freshness.is_stale(),
            &vm.ejections,
        ));
    }

    /// `snapshot_stale_after_ms` and the two gauges that show the snapshot's freshness.
    fn freshness_settings(&self) -> (u64, Option<u32>, Option<u32>) {
        let vm = self.vm.borrow();
        (
            vm.plugin.snapshot_stale_after_ms,
            vm.metrics.snapshot_stale,
            vm.metrics.snapshot_age_ms,
        )
    }

    /// Before the first snapshot: its age is the VM's, and past `snapshot_stale_after_ms`
    /// the snapshot counts as stale (gauge 1, logged once), as a confirmation that stopped.
    fn check_unsnapshotted(&mut self) {
        let age_ms = crate::host::steady_ms().saturating_sub(self.created_steady_ms);
        let (bound, stale_gauge, age_gauge) = self.freshness_settings();
        Metrics::set(age_gauge, age_ms);
        if let Some(Transition::BecameStale { age_ms }) =
            self.unsnapshotted.observe_age(age_ms, bound)
        {
            log::warn!(
                "no fleet snapshot after {age_ms} ms (snapshot_stale_after_ms {bound}): every \
                 request is answered 503 until pd-control answers a poll"
            );
            Metrics::set(stale_gauge, 1);
        }
    }

    /// Brings pods whose ejection is over back, and rebuilds the routing view when the set
    /// of ejected pods changed (requests record failures; the view follows within a tick).
    fn apply_ejections(&mut self, now: u64) {
        let Some(latest) = self.latest.clone() else {
            return;
        };
        let mut vm = self.vm.borrow_mut();
        vm.ejections.expire(now);
        if vm.ejections.take_changed() {
            vm.fleet = Some(routing_view(
                &latest,
                self.freshness.is_stale(),
                &vm.ejections,
            ));
        }
    }
}

/// What requests route on: the newest snapshot without the ejected pods, its engine metrics
/// flagged stale while pd-control has not confirmed it.
fn routing_view(
    latest: &Rc<FleetView>,
    stale: bool,
    ejections: &crate::core::ejection::Ejections,
) -> Rc<FleetView> {
    let view = if ejections.ejected().next().is_some() {
        Rc::new(latest.without_pods(|key| ejections.is_ejected(key)))
    } else {
        latest.clone()
    };
    if stale {
        Rc::new(view.with_stale_metrics())
    } else {
        view
    }
}

impl Context for Root {
    /// The plugin is going away (a configuration update replaced it): this VM no longer
    /// counts among the idle ones nor among those with a snapshot, and hands the poll lease
    /// on at once rather than when it expires.
    fn on_done(&mut self) -> bool {
        let vm = self.vm.borrow();
        if vm.pace.is_slow() {
            Metrics::gauge_add(vm.metrics.idle_vms, -1);
        }
        if self.loaded_once {
            Metrics::gauge_add(vm.metrics.fleet_loaded_vms, -1);
        }
        vm.fleet_counted.set(false);
        // A root that ends is no dead VM: off the registry, unless its requests still hold
        // charges (then its journal, now saying it no longer counts itself, stays watched).
        crate::host::journal::leave(&vm);
        snapshot::release_lease(self.token);
        log::info!("plugin done: VM {:x} leaves", self.token);
        true
    }

    fn on_http_call_response(
        &mut self,
        token: u32,
        headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let _answer = crate::host::answering_call(headers);
        if self.report_in_flight == Some(token) {
            return self.on_report_answer(body_size);
        }
        if let Some((_, report)) = self.usage_in_flight.take_if(|(t, _)| *t == token) {
            return self.on_usage_answer(report);
        }
        if let Some((_, count)) = self.release_in_flight.take_if(|(t, _)| *t == token) {
            return self.on_release_answer(count);
        }
        if self.fetch_in_flight != Some(token) {
            let status = crate::host::call_header(":status").unwrap_or_default();
            self.vm
                .borrow_mut()
                .engines
                .on_abort_response(token, &status, now_ms());
            return;
        }
        self.fetch_in_flight = None;
        let status = crate::host::call_header(":status").unwrap_or_default();
        let version_header = crate::host::call_header("x-pd-snapshot-version");
        if matches!(status.as_str(), "200" | "304") {
            let here = crate::host::call_header(snapshot::EDS_HERE_HEADER);
            snapshot::set_eds_here(here.as_deref());
        }
        match status.as_str() {
            "304" => return self.fetch_succeeded(),
            "200" => {}
            other => {
                let reason = snapshot::status_reason(other, version_header.is_some());
                return self
                    .fetch_failed(reason, format!("snapshot poll answered status {other:?}"));
            }
        }
        let version = version_header.and_then(|v| v.trim().parse::<u64>().ok());
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        let Some(version) = version.filter(|v| *v > 0) else {
            return self.fetch_failed(
                "no_version",
                "snapshot response without a valid x-pd-snapshot-version header".into(),
            );
        };
        // Refuse what we could not decode ourselves: a bad snapshot must not reach the workers.
        let view = match FleetView::decode_after(&body, self.latest.as_deref()) {
            Ok(view) => view,
            Err(e) => {
                return self.fetch_failed(
                    "undecodable",
                    format!("snapshot {version} does not decode: {e}"),
                )
            }
        };
        self.fetch_succeeded();
        // Versions move with load: more may follow soon, poll again at the fast period.
        self.vm.borrow_mut().wake();
        match snapshot::publish(version, self.polled_with, &body) {
            Ok(true) => {
                snapshot::notify_all(&self.vm_id, version, now_ms());
                self.adopt(view);
                // pd-control builds the next version on its own schedule: be waiting for it
                // already rather than poll at the next tick, after it (see `core::poll`).
                let wait_ms = self.vm.borrow().plugin.poll_wait_ms();
                if self.follow_ups.poll_again_now(wait_ms) {
                    self.maybe_fetch(now_ms());
                }
            }
            Ok(false) => {}
            Err(e) => log::warn!("cannot publish snapshot {version}: {e}"),
        }
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        log::info!("pd-router filter {} starting", crate::core::build::BUILD);
        let (defaults, warnings) = PdDefaults::from_lookup(|k| std::env::var(k).ok());
        for w in warnings {
            log::warn!("{w}");
        }
        let (prefix_settings, warnings) = PrefixSettings::from_lookup(|k| std::env::var(k).ok());
        for w in warnings {
            log::warn!("{w}");
        }
        if defaults.env.pd.prompt_length_bucketing {
            // The first exact count would otherwise cost a request a few hundred ms in V8.
            crate::core::tokenize::warm_up();
        }
        let engines = match EngineDefaults::from_lookup(|k| std::env::var(k).ok()) {
            Ok((engines, warnings)) => {
                for w in warnings {
                    log::warn!("{w}");
                }
                engines
            }
            Err(e) => {
                log::error!("{e}");
                return false;
            }
        };
        crate::host::legs::ensure_trt_counter();
        let mut vm = self.vm.borrow_mut();
        vm.debug_trap_header = std::env::var("PD_ROUTER_DEBUG_TRAP_HEADER")
            .ok()
            .map(|h| h.trim().to_ascii_lowercase())
            .filter(|h| !h.is_empty());
        if let Some(h) = &vm.debug_trap_header {
            log::warn!("PD_ROUTER_DEBUG_TRAP_HEADER is set: requests carrying {h} trap this VM (testing only)");
        }
        vm.engines = EngineState::new(engines);
        vm.sessions = SessionTable::from_settings(&defaults.tokens);
        vm.defaults = defaults;
        vm.prefix = PrefixIndex::new(prefix_settings.capacity, prefix_settings.block_size);
        vm.prefix_settings = prefix_settings;
        drop(vm);
        self.replica = crate::host::replicas::replica_id(random_seed());
        if let Err(e) = ledger::ensure_table(&SharedData) {
            log::error!("cannot create the load table: {e}");
            return false;
        }
        if let Err(e) = crate::host::journal::ensure_registry() {
            log::error!("cannot create the journal registry: {e}");
            return false;
        }
        true
    }

    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = self.get_plugin_configuration().unwrap_or_default();
        let plugin = match PluginConfig::parse(&raw) {
            Ok(p) => p,
            Err(e) => {
                log::error!("{e}");
                return false;
            }
        };
        self.config_fp = {
            let mut h = fnv::FnvHasher::default();
            std::hash::Hasher::write(&mut h, &raw);
            std::hash::Hasher::finish(&h)
        };
        snapshot::lead_config(self.config_fp);
        self.vm_id = self
            .get_property(vec!["plugin_vm_id"])
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default();
        let period = Duration::from_millis(plugin.refresh_ms);
        {
            let mut vm = self.vm.borrow_mut();
            if vm.pace.is_slow() {
                // Reconfigured while idle: it starts over at the fast period.
                Metrics::gauge_add(vm.metrics.idle_vms, -1);
            }
            vm.pace =
                crate::core::pace::TickPace::new(plugin.refresh_ms, plugin.snapshot_stale_after_ms);
            vm.ejections = crate::core::ejection::Ejections::new(plugin.ejection());
            vm.plugin = plugin;
            vm.metrics = Metrics::define();
            vm.watchdog_metrics = WatchdogMetrics::define();
        }
        self.set_tick_period(period);
        // A VM replaced by a config update (ECDS, new vm_config) with the same vm_id finds
        // the snapshot already in shared data: adopt it now, not at the first tick, so its
        // first requests are not refused with "has not received a fleet snapshot yet".
        self.reload();
        true
    }

    fn on_tick(&mut self) {
        crate::section_scope!("root.tick");
        let now = now_ms();
        // Registered lazily: only VMs that tick (workers and the main thread) get a queue.
        if self.queue.is_none() {
            self.queue = NoticeQueue::register(self.token);
        }
        if let Some(q) = self.queue.as_mut() {
            crate::section_scope!("tick.queues");
            q.heartbeat(now);
            // Every tick: a VM that registers later must start receiving prefix events at
            // once, not after the next heartbeat. Reading the small registry is cheap.
            let peers = snapshot::live_queues(&self.vm_id, now, Some(&q.name));
            let mut vm = self.vm.borrow_mut();
            vm.peers = peers;
            if vm.queue_identity.is_none() {
                vm.queue_identity = Some((self.vm_id.clone(), q.name.clone()));
            }
        }
        {
            crate::section_scope!("tick.prefix");
            let mut vm = self.vm.borrow_mut();
            // A request that ended without publishing its batch (none does) cannot hold
            // events back for longer than a tick.
            crate::host::prefix_sharing::publish(&mut vm, now);
            // A VM that selects with the prefix index keeps up between requests too, at a
            // period short enough that no ring laps it (`core::prefix::follow`). One that
            // never selects with it (the main thread) never reads.
            if vm.prefix_log.is_following() {
                crate::host::prefix_sharing::catch_up(&mut vm, now, false);
            }
        }
        self.follow_ups.tick();
        crate::section!("tick.fetch", self.maybe_fetch(now));
        crate::section!("tick.report", self.maybe_report(now));
        crate::section!("tick.usage", self.maybe_send_usage());
        crate::section!("tick.release", self.maybe_send_release());
        crate::section!("tick.reload", self.reload());
        crate::section!("tick.freshness", self.check_freshness(now));
        {
            let mut vm = self.vm.borrow_mut();
            if vm.plugin.connect_retry {
                vm.eds_here = snapshot::eds_here();
            }
        }
        crate::section!(
            "tick.replicas",
            crate::host::replicas::refresh(&mut self.vm.borrow_mut(), now)
        );
        crate::section!("tick.housekeeping", self.housekeeping(now));
        if self.vm.borrow().metrics.has_waiting_gauges() {
            crate::section!(
                "tick.define_gauges",
                define_waiting_gauges(&mut self.vm.borrow_mut())
            );
        }
        if now >= self.next_gauge_sync {
            self.next_gauge_sync = now + GAUGE_SYNC_MS;
            crate::section!("tick.gauges", self.sync_ledger_gauges());
        }
        crate::section!("tick.ejections", self.apply_ejections(now));
        crate::section!("tick.journal", self.journal.tick(&self.vm));
        crate::section!(
            "tick.watchdog",
            crate::host::watchdog::tick(&self.vm, self.context_id)
        );
        let mut vm = self.vm.borrow_mut();
        let (cluster, dst) = (vm.plugin.pods_cluster.clone(), vm.plugin.dst_header.clone());
        let fleet = vm.fleet.clone();
        let in_fleet =
            |address: &str| crate::core::guard::check_target(fleet.as_deref(), address).is_ok();
        vm.engines.send_due_aborts(&cluster, &dst, now, in_fleet);
        let busy = vm.has_outstanding_work();
        if let Some(r) = vm.pace.tick(now, busy) {
            vm.set_pace(r);
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        if self.queue.as_ref().map(|q| q.id) != Some(queue_id) {
            return;
        }
        crate::section_scope!("root.queue");
        let mut snapshot_notice = false;
        while let Ok(Some(msg)) = proxy_wasm::hostcalls::dequeue_shared_queue(queue_id) {
            match msg.split_first() {
                Some((&snapshot::MSG_SNAPSHOT, _)) => snapshot_notice = true,
                Some((&snapshot::MSG_PREFIX, event)) => match EventRef::decode(event) {
                    Ok(e) => self
                        .vm
                        .borrow_mut()
                        .prefix
                        .add_prefix(e.stream, e.model, e.pod, e.at_ms),
                    Err(err) => log::warn!("dropping a malformed prefix event: {err}"),
                },
                Some((&snapshot::MSG_PREFIX_BATCH, batch)) => {
                    let mut vm = self.vm.borrow_mut();
                    for e in EventBatch::events(batch) {
                        match e {
                            Ok(e) => vm.prefix.add_prefix(e.stream, e.model, e.pod, e.at_ms),
                            Err(err) => log::warn!(
                                "dropping the rest of a malformed prefix event batch: {err}"
                            ),
                        }
                    }
                }
                // Another VM got a request after an idle spell: tick at the fast period (no
                // message back, so a wake-up never echoes), and read its prefix ring closely
                // until the burst's rate is known.
                Some((&snapshot::MSG_WAKE, payload)) => {
                    let mut vm = self.vm.borrow_mut();
                    if payload != [snapshot::WAKE_FOLLOWERS] {
                        vm.wake();
                    }
                    crate::host::prefix_sharing::expect_burst(&mut vm, now_ms());
                }
                Some((&snapshot::MSG_REMOTE, _)) => {
                    crate::host::replicas::refresh(&mut self.vm.borrow_mut(), now_ms())
                }
                Some((&snapshot::MSG_EJECT, notice)) => {
                    self.vm.borrow_mut().adopt_ejection(notice, now_ms())
                }
                _ => log::warn!("dropping an unknown queue message"),
            }
        }
        if snapshot_notice {
            self.reload();
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(PdHttp::new(context_id, self.vm.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
