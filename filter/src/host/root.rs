//! The per-VM root context: configuration, the timer that keeps the fleet view fresh, and the
//! factory of HTTP contexts.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

use crate::core::config::PluginConfig;
use crate::core::fleet::FleetView;
use crate::core::ledger;
use crate::core::pd::bucket_serve::Planner;
use crate::core::pd::PdDefaults;
use crate::core::prefix::{PrefixEvent, PrefixIndex, PrefixSettings};
use crate::core::tokens::{SessionTable, TokenLoadSettings};
use crate::host::http::PdHttp;
use crate::host::metrics::Metrics;
use crate::host::snapshot::{self, NoticeQueue};
use crate::host::store::SharedData;
use crate::host::{now_ms, random_seed, SharedVm, VmState};

pub struct Root {
    vm: SharedVm,
    /// Identifies this root context in the lease and the queue registry.
    token: u64,
    vm_id: String,
    queue: Option<NoticeQueue>,
    fetch_in_flight: Option<u32>,
    loaded_once: bool,
    /// Consecutive failed polls; logged at 1, 2, 4, 8, ... so an outage does not flood the log.
    fetch_failures: u64,
    next_housekeeping: u64,
    next_ledger_prune: u64,
}

impl Root {
    pub fn new(_context_id: u32) -> Root {
        let seed = random_seed();
        Root {
            vm: Rc::new(RefCell::new(VmState {
                plugin: PluginConfig::default(),
                defaults: PdDefaults::default(),
                sessions: SessionTable::from_settings(&TokenLoadSettings::default()),
                planner: Planner::new(),
                prefix: PrefixIndex::new(1),
                prefix_settings: PrefixSettings::default(),
                prefix_seed: 0,
                peers: Vec::new(),
                holds: hashbrown::HashMap::new(),
                fleet: None,
                rng: fastrand::Rng::with_seed(seed),
                select_scratch: crate::core::pd::Scratch::default(),
                metrics: Metrics::default(),
            })),
            token: seed | 1,
            vm_id: String::new(),
            queue: None,
            fetch_in_flight: None,
            loaded_once: false,
            fetch_failures: 0,
            next_housekeeping: 0,
            next_ledger_prune: 0,
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
        match snapshot::load_newer(have) {
            Ok(Some(view)) => self.adopt(view),
            Ok(None) => {}
            Err(e) => log::warn!("{e}"),
        }
    }

    fn adopt(&mut self, view: FleetView) {
        let version = view.version;
        let (version_gauge, loaded_gauge) = {
            let mut vm = self.vm.borrow_mut();
            vm.fleet = Some(Rc::new(view));
            (vm.metrics.fleet_version, vm.metrics.fleet_loaded_vms)
        };
        Metrics::set(version_gauge, version);
        if !self.loaded_once {
            self.loaded_once = true;
            Metrics::gauge_add(loaded_gauge, 1);
            log::info!("fleet snapshot {version} loaded");
        }
    }

    /// Periodic upkeep of per-VM state: prefix-index age eviction and the session table.
    fn housekeeping(&mut self, now: u64) {
        if now < self.next_housekeeping {
            return;
        }
        let mut vm = self.vm.borrow_mut();
        let interval = vm.prefix_settings.eviction_interval_ms.max(100);
        self.next_housekeeping = now + interval;
        let age = vm.prefix_settings.eviction_age_ms;
        vm.prefix.evict_older_than(now, age);
        vm.sessions.prune(now);
        drop(vm);
        crate::host::holds::expire(&self.vm, now);
        if now >= self.next_ledger_prune {
            // Pods that left (autoscaling, rollouts) must not accumulate in the shared ledger.
            self.next_ledger_prune = now + crate::core::tokens::IDLE_PRUNE_MS;
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

    fn fetch_failed(&mut self, why: String) {
        self.fetch_failures += 1;
        Metrics::inc(self.vm.borrow().metrics.snapshot_fetch_errors);
        if self.fetch_failures.is_power_of_two() {
            log::warn!(
                "{why} ({} consecutive failures; routing on the last snapshot)",
                self.fetch_failures
            );
        }
    }

    fn fetch_succeeded(&mut self) {
        if self.fetch_failures > 0 {
            log::info!(
                "snapshot polls recovered after {} failures",
                self.fetch_failures
            );
            self.fetch_failures = 0;
        }
    }

    fn maybe_fetch(&mut self, now: u64) {
        if self.fetch_in_flight.is_some() {
            return;
        }
        let plugin = self.vm.borrow().plugin.clone();
        let lease_ms = (plugin.refresh_ms * 5).max(1_000);
        if !snapshot::hold_lease(self.token, now, lease_ms) {
            return;
        }
        let have = snapshot::published_version();
        match snapshot::fetch_request(
            &plugin.control_cluster,
            &plugin.control_authority,
            &plugin.snapshot_path,
            have,
            Duration::from_millis(plugin.fetch_timeout_ms),
        ) {
            Ok(token) => self.fetch_in_flight = Some(token),
            Err(e) => self.fetch_failed(format!(
                "cannot poll cluster {}: {e:?}",
                plugin.control_cluster
            )),
        }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        if self.fetch_in_flight != Some(token) {
            return;
        }
        self.fetch_in_flight = None;
        let status = self
            .get_http_call_response_header(":status")
            .unwrap_or_default();
        match status.as_str() {
            "304" => return self.fetch_succeeded(),
            "200" => {}
            other => return self.fetch_failed(format!("snapshot poll answered status {other:?}")),
        }
        let version = self
            .get_http_call_response_header("x-pd-snapshot-version")
            .and_then(|v| v.trim().parse::<u64>().ok());
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        let Some(version) = version.filter(|v| *v > 0) else {
            return self.fetch_failed(
                "snapshot response without a valid x-pd-snapshot-version header".into(),
            );
        };
        // Refuse what we could not decode ourselves: a bad snapshot must not reach the workers.
        let view = match FleetView::decode(&body) {
            Ok(view) => view,
            Err(e) => return self.fetch_failed(format!("snapshot {version} does not decode: {e}")),
        };
        self.fetch_succeeded();
        match snapshot::publish(version, &body) {
            Ok(true) => {
                snapshot::notify_all(&self.vm_id, version, now_ms());
                self.adopt(view);
            }
            Ok(false) => {}
            Err(e) => log::warn!("cannot publish snapshot {version}: {e}"),
        }
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        let (defaults, warnings) = PdDefaults::from_lookup(|k| std::env::var(k).ok());
        for w in warnings {
            log::warn!("{w}");
        }
        let (prefix_settings, warnings) = PrefixSettings::from_lookup(|k| std::env::var(k).ok());
        for w in warnings {
            log::warn!("{w}");
        }
        let seed = snapshot::shared_prefix_seed(
            prefix_settings.seed,
            prefix_settings.statesync,
            random_seed(),
        );
        if defaults.env.pd.prompt_length_bucketing {
            // The first exact count would otherwise cost a request a few hundred ms in V8.
            crate::core::tokenize::warm_up();
        }
        let mut vm = self.vm.borrow_mut();
        vm.sessions = SessionTable::from_settings(&defaults.tokens);
        vm.defaults = defaults;
        vm.prefix = PrefixIndex::new(prefix_settings.capacity);
        vm.prefix_settings = prefix_settings;
        vm.prefix_seed = seed;
        drop(vm);
        if let Err(e) = ledger::ensure_table(&SharedData) {
            log::error!("cannot create the load table: {e}");
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
        self.vm_id = self
            .get_property(vec!["plugin_vm_id"])
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default();
        let period = Duration::from_millis(plugin.refresh_ms);
        {
            let mut vm = self.vm.borrow_mut();
            vm.plugin = plugin;
            vm.metrics = Metrics::define();
        }
        self.set_tick_period(period);
        // A VM replaced by a config update (ECDS, new vm_config) with the same vm_id finds
        // the snapshot already in shared data: adopt it now, not at the first tick, so its
        // first requests are not refused with "has not received a fleet snapshot yet".
        self.reload();
        true
    }

    fn on_tick(&mut self) {
        let now = now_ms();
        // Registered lazily: only VMs that tick (workers and the main thread) get a queue.
        if self.queue.is_none() {
            self.queue = NoticeQueue::register(self.token);
        }
        if let Some(q) = self.queue.as_mut() {
            q.heartbeat(now);
            // Every tick: a VM that registers later must start receiving prefix events at
            // once, not after the next heartbeat. Reading the small registry is cheap.
            let peers = snapshot::live_queues(&self.vm_id, now, Some(&q.name));
            self.vm.borrow_mut().peers = peers;
        }
        self.maybe_fetch(now);
        self.reload();
        self.housekeeping(now);
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        if self.queue.as_ref().map(|q| q.id) != Some(queue_id) {
            return;
        }
        let mut snapshot_notice = false;
        while let Ok(Some(msg)) = proxy_wasm::hostcalls::dequeue_shared_queue(queue_id) {
            match msg.split_first() {
                Some((&snapshot::MSG_SNAPSHOT, _)) => snapshot_notice = true,
                Some((&snapshot::MSG_PREFIX, event)) => match PrefixEvent::decode(event) {
                    Ok(e) => self
                        .vm
                        .borrow_mut()
                        .prefix
                        .add_prefix(&e.hashes, &e.model, &e.pod, e.at_ms),
                    Err(err) => log::warn!("dropping a malformed prefix event: {err}"),
                },
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
