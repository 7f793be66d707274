//! The simulator as a whole: which fleet records become served pods, starting and stopping
//! them as the fleet file changes, and the admin endpoints that see every pod at once.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use pd_control::fleet::{self, PodRecord};
use tokio::net::TcpListener;

use crate::faults::{FaultError, FaultKind, FaultSpec};
use crate::log::LogEntry;
use crate::pod::{PodInfo, PodState, Registry, SimConfig};
use crate::server::{json_response, pod_router, serve, PodCtx, ServeHandle};

/// Records the simulator serves, keyed by `ip:port`, and why the others are left out.
/// Only loopback IPs are served: the simulator must never answer for a real address.
pub fn servable(records: &[PodRecord]) -> (BTreeMap<String, PodRecord>, Vec<String>) {
    let mut served = BTreeMap::new();
    let mut skipped = Vec::new();
    for r in records {
        let why = match r.ip.parse::<IpAddr>() {
            _ if r.ip.is_empty() => Some("has no IP"),
            Ok(ip) if !ip.is_loopback() => Some("is not on a loopback address"),
            Err(_) => Some("has an unparsable IP"),
            Ok(_) if !r.serves_http => Some("is a non-leader pod-group member"),
            Ok(_) if served.contains_key(&r.address()) => {
                Some("shares its address with an earlier pod")
            }
            Ok(_) => None,
        };
        match why {
            Some(why) => skipped.push(format!(
                "{}/{} ({}) {why}",
                r.namespace,
                r.name,
                r.address()
            )),
            None => {
                served.insert(r.address(), r.clone());
            }
        }
    }
    (served, skipped)
}

/// The fields whose change means a different pod; anything else (readiness, annotations)
/// is updated in place so the pod keeps its state and log.
fn same_pod(a: &PodRecord, b: &PodRecord) -> bool {
    (
        &a.model,
        &a.namespace,
        &a.name,
        &a.ip,
        a.port,
        a.metric_port,
        &a.engine,
        &a.role,
        &a.roleset,
    ) == (
        &b.model,
        &b.namespace,
        &b.name,
        &b.ip,
        b.port,
        b.metric_port,
        &b.engine,
        &b.role,
        &b.roleset,
    )
}

struct RunningPod {
    record: PodRecord,
    state: Arc<PodState>,
    servers: Vec<ServeHandle>,
    /// A listener fault (`crash`, `refuse`) in force; cleared, the pod listens again.
    listener_fault: Option<FaultKind>,
}

/// What one [`Sim::apply`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ApplyReport {
    /// Pods served after the call.
    pub serving: usize,
    pub started: Vec<String>,
    pub stopped: Vec<String>,
    /// Pods that could not be bound: `(address, error)`. Retried on the next call.
    pub failed: Vec<(String, String)>,
    pub skipped: Vec<String>,
}

impl ApplyReport {
    /// True when the set of served pods changed.
    pub fn changed(&self) -> bool {
        !self.started.is_empty() || !self.stopped.is_empty()
    }
}

/// All simulated pods of one process.
pub struct Sim {
    config: Arc<SimConfig>,
    registry: Arc<Registry>,
    /// Lifecycle: only [`Sim::apply`] and [`Sim::shutdown`] take it, one at a time.
    pods: tokio::sync::Mutex<BTreeMap<String, RunningPod>>,
    /// What readers (admin endpoints) see: the latest record and state of every served pod.
    view: Mutex<Vec<(PodRecord, Arc<PodState>)>>,
}

impl Sim {
    pub fn new(config: SimConfig) -> Arc<Sim> {
        Arc::new(Sim {
            config: Arc::new(config),
            registry: Arc::new(Registry::default()),
            pods: tokio::sync::Mutex::new(BTreeMap::new()),
            view: Mutex::new(Vec::new()),
        })
    }

    /// Makes the served pods match `records`: stops pods that are gone or changed, starts new
    /// ones (binding their IP exactly), and retries pods that failed to bind before.
    pub async fn apply(&self, records: &[PodRecord]) -> ApplyReport {
        let (desired, skipped) = servable(records);
        let mut report = ApplyReport {
            skipped,
            ..ApplyReport::default()
        };
        let mut pods = self.pods.lock().await;
        let gone: Vec<String> = pods
            .iter()
            .filter(|(addr, p)| !desired.get(*addr).is_some_and(|r| same_pod(r, &p.record)))
            .map(|(addr, _)| addr.clone())
            .collect();
        for addr in gone {
            if let Some(pod) = pods.remove(&addr) {
                report.stopped.push(format!(
                    "{}/{} {addr}",
                    pod.record.namespace, pod.record.name
                ));
                self.stop_pod(pod).await;
            }
        }
        for (addr, record) in desired {
            match pods.get_mut(&addr) {
                Some(running) => running.record = record,
                None => match self.start_pod(record.clone()).await {
                    Ok(pod) => {
                        report
                            .started
                            .push(format!("{}/{} {addr}", record.namespace, record.name));
                        pods.insert(addr, pod);
                    }
                    Err(err) => report.failed.push((addr, err.to_string())),
                },
            }
        }
        report.serving = pods.len();
        let view = pods
            .values()
            .map(|p| (p.record.clone(), p.state.clone()))
            .collect();
        *self.view.lock().unwrap_or_else(|e| e.into_inner()) = view;
        report
    }

    async fn start_pod(&self, record: PodRecord) -> std::io::Result<RunningPod> {
        let ip: IpAddr = record.ip.parse().map_err(|e| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("bad IP: {e}"))
        })?;
        let state = Arc::new(PodState::new(record.clone(), self.config.clone()));
        let servers = self.listen(ip, &record, &state).await?;
        self.registry.insert(state.clone());
        tracing::info!(pod = %record.key(), addr = %record.address(), role = %record.role, "pod started");
        Ok(RunningPod {
            record,
            state,
            servers,
            listener_fault: None,
        })
    }

    /// Binds the pod's serving (and, when distinct, metrics) port and serves its router.
    async fn listen(
        &self,
        ip: IpAddr,
        record: &PodRecord,
        state: &Arc<PodState>,
    ) -> std::io::Result<Vec<ServeHandle>> {
        let mut ports = vec![record.port];
        if record.metric_port != record.port {
            ports.push(record.metric_port);
        }
        let mut listeners = Vec::with_capacity(ports.len());
        for port in ports {
            let addr = SocketAddr::new(ip, port);
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|e| std::io::Error::new(e.kind(), format!("cannot bind {addr}: {e}")))?;
            listeners.push(listener);
        }
        let router = pod_router(PodCtx {
            pod: state.clone(),
            registry: self.registry.clone(),
        });
        let mut servers = Vec::with_capacity(listeners.len());
        for listener in listeners {
            servers.push(serve(listener, router.clone(), state.config.keep_alive)?);
        }
        Ok(servers)
    }

    /// Arms a fault on the pod `spec.pod` names (`name` or `namespace/name`). Request faults
    /// go to the pod; `crash` and `refuse` act on its listeners here and now.
    pub async fn arm_fault(&self, spec: FaultSpec) -> Result<(), FaultError> {
        spec.validate()?;
        let name = spec.pod.clone().ok_or(FaultError::MissingPod)?;
        let mut pods = self.pods.lock().await;
        let pod = pods
            .values_mut()
            .find(|p| p.record.name == name || p.record.key() == name)
            .ok_or_else(|| FaultError::UnknownPod(name.clone()))?;
        match spec.kind {
            FaultKind::Crash => {
                for server in pod.servers.drain(..) {
                    server.stop().await;
                }
                pod.listener_fault = Some(FaultKind::Crash);
                tracing::info!(pod = %pod.record.key(), "fault: crashed");
            }
            FaultKind::Refuse => {
                for server in &pod.servers {
                    server.stop_accepting().await;
                }
                pod.listener_fault.get_or_insert(FaultKind::Refuse);
                tracing::info!(pod = %pod.record.key(), "fault: refusing connections");
            }
            _ => pod.state.faults.arm(spec)?,
        }
        Ok(())
    }

    /// Clears the faults of one pod (by name or key) or of every pod: hanging requests are
    /// released and crashed or refusing pods listen again. Returns how many pods were cleared.
    pub async fn clear_faults(&self, pod: Option<&str>) -> Result<usize, FaultError> {
        let mut pods = self.pods.lock().await;
        let mut cleared = 0;
        for running in pods.values_mut() {
            if pod.is_some_and(|n| running.record.name != n && running.record.key() != n) {
                continue;
            }
            cleared += 1;
            running.state.faults.clear();
            if running.listener_fault.take().is_none() {
                continue;
            }
            // A refusing pod's old handles keep driving their open connections until the pod
            // is stopped; the new listeners take every new one.
            let relisten = match running.record.ip.parse() {
                Ok(ip) => self.listen(ip, &running.record, &running.state).await,
                Err(e) => Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("bad IP: {e}"),
                )),
            };
            match relisten {
                Ok(servers) => running.servers.extend(servers),
                Err(err) => {
                    tracing::warn!(pod = %running.record.key(), "cannot listen again: {err}")
                }
            }
        }
        match (pod, cleared) {
            (Some(name), 0) => Err(FaultError::UnknownPod(name.to_string())),
            _ => Ok(cleared),
        }
    }

    /// Every armed fault, request and listener faults alike, with its pod.
    pub async fn faults(&self) -> Vec<FaultSpec> {
        let pods = self.pods.lock().await;
        let mut all = Vec::new();
        for running in pods.values() {
            let pod = Some(running.record.key());
            if let Some(kind) = running.listener_fault {
                all.push(FaultSpec {
                    pod: pod.clone(),
                    kind,
                    leg: None,
                    times: None,
                });
            }
            all.extend(running.state.faults.list().into_iter().map(|mut f| {
                f.pod = pod.clone();
                f
            }));
        }
        all
    }

    async fn stop_pod(&self, pod: RunningPod) {
        self.registry.remove(&pod.state.engine_id);
        for server in pod.servers {
            server.stop().await;
        }
        tracing::info!(pod = %pod.record.key(), addr = %pod.record.address(), "pod stopped");
    }

    /// Stops every pod.
    pub async fn shutdown(&self) {
        self.apply(&[]).await;
    }

    fn view(&self) -> Vec<(PodRecord, Arc<PodState>)> {
        self.view.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Every served pod, in address order.
    pub fn pods(&self) -> Vec<PodInfo> {
        self.view()
            .into_iter()
            .map(|(record, state)| {
                let mut info = state.info();
                info.ready = record.ready;
                info
            })
            .collect()
    }

    /// The state of the pod served at `addr` (`ip:port`), for tests and tools that compare
    /// what a scraper sees with what the simulator holds.
    pub fn pod_state(&self, addr: &str) -> Option<Arc<PodState>> {
        self.view()
            .into_iter()
            .find(|(record, _)| record.address() == addr)
            .map(|(_, state)| state)
    }

    /// Every pod's request log, merged in arrival order.
    pub fn requests(&self) -> Vec<LogEntry> {
        let mut all: Vec<LogEntry> = self
            .view()
            .iter()
            .flat_map(|(_, s)| s.log.snapshot())
            .collect();
        all.sort_by_key(|e| e.seq);
        all
    }

    pub fn clear_requests(&self) {
        for (_, state) in self.view() {
            state.log.clear();
        }
    }

    /// The admin router: `/sim/requests` (GET, DELETE), `/sim/pods` and `/sim/faults` (GET, POST,
    /// DELETE) over all pods.
    pub fn admin_router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/sim/requests", get(admin_requests).delete(admin_clear))
            .route("/sim/pods", get(admin_pods))
            .route(
                "/sim/faults",
                get(admin_faults).post(admin_arm).delete(admin_clear_faults),
            )
            .route("/health", get(|| async { StatusCode::OK }))
            .with_state(self.clone())
    }
}

async fn admin_requests(State(sim): State<Arc<Sim>>) -> Response {
    json_response(StatusCode::OK, &sim.requests())
}

async fn admin_clear(State(sim): State<Arc<Sim>>) -> Response {
    sim.clear_requests();
    StatusCode::NO_CONTENT.into_response()
}

async fn admin_faults(State(sim): State<Arc<Sim>>) -> Response {
    json_response(StatusCode::OK, &sim.faults().await)
}

async fn admin_arm(State(sim): State<Arc<Sim>>, body: Bytes) -> Response {
    let spec = match serde_json::from_slice::<FaultSpec>(&body) {
        Ok(spec) => spec,
        Err(e) => return fault_error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    match sim.arm_fault(spec).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e @ FaultError::UnknownPod(_)) => fault_error(StatusCode::NOT_FOUND, &e.to_string()),
        Err(e) => fault_error(StatusCode::BAD_REQUEST, &e.to_string()),
    }
}

/// `DELETE /sim/faults[?pod=NAME]`.
async fn admin_clear_faults(
    State(sim): State<Arc<Sim>>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    match sim.clear_faults(q.get("pod").map(String::as_str)).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => fault_error(StatusCode::NOT_FOUND, &e.to_string()),
    }
}

/// `{"error": "..."}`, what the fault endpoints answer to a spec they refuse.
pub fn fault_error(status: StatusCode, message: &str) -> Response {
    json_response(status, &serde_json::json!({ "error": message }))
}

async fn admin_pods(State(sim): State<Arc<Sim>>) -> Response {
    json_response(StatusCode::OK, &sim.pods())
}

/// Serves the admin router on `addr`.
pub async fn serve_admin(sim: &Arc<Sim>, addr: SocketAddr) -> std::io::Result<ServeHandle> {
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot bind admin address {addr}: {e}"))
    })?;
    serve(listener, sim.admin_router(), None)
}

/// Polls a fleet file and keeps a [`Sim`] in step with it.
pub struct FleetWatcher {
    pub path: PathBuf,
    pub poll: Duration,
    last_text: String,
    records: Vec<PodRecord>,
    last_failures: Vec<(String, String)>,
}

impl FleetWatcher {
    /// Reads and parses the fleet file once; an unreadable or invalid file is an error here,
    /// at start-up, where the operator is watching.
    pub fn load(path: PathBuf, poll: Duration) -> Result<Self, fleet::FleetError> {
        let last_text =
            std::fs::read_to_string(&path).map_err(|source| fleet::FleetError::Read {
                path: path.display().to_string(),
                source,
            })?;
        let records = fleet::parse_records(&last_text)?;
        Ok(FleetWatcher {
            path,
            poll,
            last_text,
            records,
            last_failures: Vec::new(),
        })
    }

    /// The records of the last good parse.
    pub fn records(&self) -> &[PodRecord] {
        &self.records
    }

    /// Re-reads the file; on a change, re-parses it. A broken file keeps the previous fleet,
    /// like pd-control does, so a half-written edit does not take every pod down.
    pub async fn refresh(&mut self) {
        let text = match tokio::fs::read_to_string(&self.path).await {
            Ok(text) => text,
            Err(err) => {
                if !self.last_text.is_empty() {
                    tracing::warn!(
                        "cannot read fleet file {}: {err}; keeping the previous fleet",
                        self.path.display()
                    );
                    self.last_text.clear();
                }
                return;
            }
        };
        if text == self.last_text {
            return;
        }
        match fleet::parse_records(&text) {
            Ok(records) => self.records = records,
            Err(err) => tracing::warn!("{err}; keeping the previous fleet"),
        }
        self.last_text = text;
    }

    /// Polls forever, applying every change to `sim` and calling `on_change` whenever the set
    /// of served pods changed. Failed binds are retried on every poll.
    pub async fn run(mut self, sim: Arc<Sim>, mut on_change: impl FnMut(&ApplyReport) + Send) {
        loop {
            tokio::time::sleep(self.poll).await;
            self.refresh().await;
            let report = sim.apply(&self.records).await;
            if report.failed != self.last_failures {
                for (addr, err) in &report.failed {
                    tracing::warn!("pod {addr} not served: {err}");
                }
                self.last_failures = report.failed.clone();
            }
            if report.changed() {
                on_change(&report);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, ip: &str, port: u16) -> PodRecord {
        PodRecord {
            model: "m".into(),
            namespace: "default".into(),
            name: name.into(),
            ip: ip.into(),
            port,
            metric_port: port,
            engine: "vllm".into(),
            role: "decode".into(),
            roleset: "rs".into(),
            role_replica_index: String::new(),
            kv_connector_type: String::new(),
            config: String::new(),
            sglang_bootstrap_port: 8998,
            ready: false,
            serves_http: true,
            labels: Default::default(),
            ready_since_unix_ms: 0,
            adapters: Vec::new(),
        }
    }

    #[test]
    fn only_loopback_unique_leaders_are_served() {
        let mut follower = record("f", "127.0.0.5", 8000);
        follower.serves_http = false;
        let records = vec![
            record("a", "127.0.10.2", 18000),
            record("b", "10.0.0.1", 8000),
            record("c", "", 8000),
            record("d", "127.0.10.2", 18000),
            follower,
            record("e", "::1", 8001),
        ];
        let (served, skipped) = servable(&records);
        assert_eq!(
            served.keys().cloned().collect::<Vec<_>>(),
            vec!["127.0.10.2:18000", "[::1]:8001"]
        );
        assert_eq!(skipped.len(), 4, "{skipped:?}");
        assert!(
            served.values().all(|r| !r.ready),
            "readiness does not matter"
        );
    }

    #[test]
    fn readiness_is_not_identity() {
        let a = record("a", "127.0.0.2", 1);
        let mut b = a.clone();
        b.ready = true;
        assert!(same_pod(&a, &b));
        b.role = "prefill".into();
        assert!(!same_pod(&a, &b));
    }
}
