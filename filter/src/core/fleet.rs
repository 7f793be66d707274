//! The fleet view: a snapshot decoded once per version into per-model indexes, so the
//! request path never touches protobuf and finds rolesets without scanning the fleet.

use std::rc::Rc;

use hashbrown::HashMap;

#[cfg(test)]
mod refresh_tests;
pub mod scan;

use scan::Scan;

use super::config::KvConnector;
use super::profile::{ModelConfig, RoutingConfig};
use crate::proto;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    /// Any other `role-name` value, or none.
    Other,
}

/// One pod as one view routes on it: what a snapshot says about it (shared by every view
/// built from that snapshot's topology), its roleset in this view, and its engine metrics.
#[derive(Debug, Clone)]
pub struct PodView {
    info: Rc<PodInfo>,
    /// Index into `ModelView::rolesets` when the pod belongs to a complete roleset.
    pub roleset_idx: Option<usize>,
    pub metrics: Option<proto::PodMetrics>,
}

/// Everything about a pod but its metrics, precomputed once per topology: a snapshot that
/// only brings new metrics reuses it (see [`FleetView::decode_after`]).
#[derive(Debug)]
pub struct PodInfo {
    /// `namespace/name`: the key of every load counter.
    pub key: String,
    /// The ledger row of the pod, hashed from `key` once per snapshot.
    pub id: crate::core::ledger::PodId,
    pub name: String,
    pub ip: String,
    /// `ip:port`, the value of the destination header.
    pub address: String,
    pub engine: String,
    pub role: Role,
    pub roleset: String,
    /// The pod's own `model.aibrix.ai/config`: bucket ranges and `combined` are read per pod,
    /// from the profile the request resolved to (or the pod's default profile).
    pub config: Option<ModelConfig>,
    /// Per-pod connector label, when it names a known connector.
    pub kv_connector: Option<KvConnector>,
    /// `model.aibrix.ai/sglang-bootstrap-port` (8998 when absent).
    pub sglang_bootstrap_port: u16,
    /// The pod's position in its model's pod list in the snapshot, routable or not: where
    /// its metrics are in a later snapshot of the same topology.
    pub slot: usize,
    /// Every label of the pod, for the `external-filter` header's selector.
    pub labels: Vec<(String, String)>,
    /// When the pod became ready, Unix ms; 0 when unknown (see `pd::top_k`).
    pub ready_since_ms: u64,
}

impl std::ops::Deref for PodView {
    type Target = PodInfo;

    fn deref(&self) -> &PodInfo {
        &self.info
    }
}

impl PodView {
    /// The pod's `routingConfig` for the request's profile name (or the pod's default).
    pub fn routing_config(&self, profile: Option<&str>) -> Option<&RoutingConfig> {
        self.config
            .as_ref()?
            .profile(profile)
            .map(|p| &p.routing_config)
    }

    /// A standard pod that runs whole requests under this profile.
    pub fn is_combined(&self, profile: Option<&str>) -> bool {
        self.role == Role::Other && self.routing_config(profile).is_some_and(|rc| rc.combined)
    }

    /// A standard pod that runs whole requests whatever profile a request resolves to on it:
    /// every profile it has is `combined`, and so is its fallback profile, which a request
    /// naming none of them gets.
    fn combined_for_every_profile(&self) -> bool {
        self.role == Role::Other
            && self.config.as_ref().is_some_and(|c| {
                c.profile(None).is_some() && c.profiles.values().all(|p| p.routing_config.combined)
            })
    }

    /// Whether the pod's prompt-length range holds `len`; a pod without a range holds all.
    pub fn accepts_prompt_len(&self, profile: Option<&str>, len: i64) -> bool {
        self.routing_config(profile)
            .is_none_or(|rc| rc.accepts_prompt_len(len))
    }
}

/// `ip:port`, with an IPv6 address in brackets (`[fd00::7]:8000`): the form Envoy's
/// ORIGINAL_DST header and an HTTP `:authority` take; `fd00::7:8000` would parse as neither.
pub fn host_port(ip: &str, port: u32) -> String {
    if ip.contains(':') && !ip.starts_with('[') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

/// A roleset with at least one routable prefill and one routable decode pod.
#[derive(Debug, Clone)]
pub struct Roleset {
    pub name: String,
    pub prefill: Vec<usize>,
    pub decode: Vec<usize>,
}

#[derive(Debug, Clone, Default)]
pub struct ModelView {
    /// Routable pods only (ready, with an IP, serving HTTP).
    pub pods: Vec<PodView>,
    /// Complete rolesets only: an incomplete one contributes nothing. Shared with the views
    /// that differ from this one only in metrics.
    pub rolesets: Rc<[Roleset]>,
    /// Pods that run whole requests (any role but prefill/decode). Which of them are
    /// `combined: true` standard pods depends on the request's profile.
    pub others: Vec<usize>,
    /// Model-level config: the first pod (in fleet order) whose annotation is valid.
    pub config: Option<ModelConfig>,
    /// Pods of the model in the snapshot, routable or not.
    pub total_pods: usize,
    /// `(ledger id, pod index)` sorted by id, for one-pass ledger reads.
    pub id_order: Vec<(crate::core::ledger::PodId, usize)>,
    /// The selection's per-pod signals as dense arrays (see `pd::columns`).
    pub columns: crate::core::pd::columns::Columns,
    /// Distinct for every view built (0 for a default one): per-view caches outside the view
    /// (ledger row hints) key on it.
    pub uid: u64,
    /// Pod key → index of the prefill pods of complete rolesets (the prefix lookup's
    /// candidates), so a lookup touches only the pods that hold the prompt's prefix.
    prefill_by_key: Rc<HashMap<String, usize>>,
    /// Pod key → index of the standard pods: the candidates of single-pod `prefix-cache`.
    standard_by_key: Rc<HashMap<String, usize>>,
    /// Pod key → index of the decode pods of complete rolesets: whether a pair's decode pod
    /// is still routable when its prefill answers.
    decode_by_key: Rc<HashMap<String, usize>>,
    /// Routable pods this view leaves out, by name, and why: what a routing explanation
    /// shows an operator asking why a pod got nothing.
    pub left_out: Rc<Vec<(String, LeftOut)>>,
    /// The first pod and the first one of another engine label, when the pods disagree: a
    /// PD request needs one protocol for its legs (`engine::agreed_engine`), found here once
    /// per view rather than by a pass over the pods on every request.
    pub engine_mismatch: Option<(usize, usize)>,
}

/// Why a routable pod is not in a routing view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeftOut {
    /// pd-control's scrapes cannot connect to its engine.
    Unreachable,
    /// Its engine's running requests make no progress (pd-control).
    Stalled,
    /// A worker's passive ejection.
    Ejected,
    /// This request's prefill leg could not reach it (prefill failover).
    FailedPrefill,
}

impl LeftOut {
    pub fn name(self) -> &'static str {
        match self {
            LeftOut::Unreachable => "unreachable",
            LeftOut::Stalled => "stalled",
            LeftOut::Ejected => "ejected",
            LeftOut::FailedPrefill => "failed_prefill",
        }
    }
}

/// The views `external-filter` selectors narrowed models to, reused while a model's view and
/// the selector's text stay the same: narrowing builds a whole view (1024 pods: ≈ 180 µs
/// natively), and requests carry few distinct selectors (a canary tier, a GPU type). Up to
/// [`NARROWED_VIEWS`] are kept, the least recently used giving way, so traffic that alternates
/// between a few selectors, or carries one for each of several models, does not rebuild a
/// view per request. A new snapshot gives the model a new view, and so a new narrowing with
/// its metrics.
#[derive(Default)]
pub struct NarrowedViews {
    /// `(model view uid, selector text, view, last use)`.
    entries: Vec<(u64, String, Rc<ModelView>, u64)>,
    uses: u64,
}

/// How many narrowed views a VM keeps.
pub const NARROWED_VIEWS: usize = 8;

impl NarrowedViews {
    pub fn narrow(
        &mut self,
        model: &ModelView,
        selector_text: &str,
    ) -> Result<Rc<ModelView>, crate::core::label_selector::SelectorError> {
        self.uses += 1;
        let hit = self
            .entries
            .iter_mut()
            .find(|(uid, text, _, _)| *uid == model.uid && text == selector_text);
        if let Some((_, _, view, used)) = hit {
            *used = self.uses;
            return Ok(view.clone());
        }
        let selector = crate::core::label_selector::Selector::parse(selector_text)?;
        let view = Rc::new(model.only(|p| selector.matches(&p.labels)));
        let entry = (
            model.uid,
            selector_text.to_string(),
            view.clone(),
            self.uses,
        );
        if self.entries.len() < NARROWED_VIEWS {
            self.entries.push(entry);
        } else if let Some(oldest) = self.entries.iter_mut().min_by_key(|e| e.3) {
            *oldest = entry;
        }
        Ok(view)
    }
}

/// Source of [`ModelView::uid`].
static NEXT_UID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

#[derive(Debug, Clone, Default)]
pub struct FleetView {
    pub version: u64,
    pub models: HashMap<String, ModelView>,
    /// `ip:port` of every routable pod of every model: the only values the filter ever
    /// writes into the destination header or sends a side call to (see `core::guard`).
    addresses: Rc<hashbrown::HashSet<String>>,
    /// The snapshot's bytes but its version and metrics ([`Scan::topology`]); empty for a
    /// view not decoded from bytes. A later snapshot with the same topology is adopted by
    /// replacing metrics only.
    topology: Rc<[u8]>,
    /// pd-control checks per-user limits (`Snapshot.user_limits`): a request naming a `user`
    /// is admitted by it before routing (see `core::user_limits`).
    pub user_limits: bool,
    /// pd-control writes the retrying cluster's endpoint file (`Snapshot.eds`): stand-in pods
    /// may be named (`PluginConfig::connect_retry`).
    pub eds: bool,
    /// How pd-control's external router is set up (`Snapshot.external_router`); `None`: the
    /// `external` strategy is off.
    pub external_router: Option<Rc<proto::ExternalRouter>>,
}

impl FleetView {
    pub fn from_snapshot(snapshot: &proto::Snapshot) -> FleetView {
        let models: HashMap<String, ModelView> = snapshot
            .models
            .iter()
            .map(|m| (m.name.clone(), ModelView::build(&m.pods, m.labels.as_ref())))
            .collect();
        // Unreachable pods included: a request already routed there finishes its legs, as
        // with an ejected pod.
        let addresses = snapshot
            .models
            .iter()
            .flat_map(|m| &m.pods)
            .filter(|p| routable(p))
            .map(|p| host_port(&p.ip, p.port))
            .collect();
        FleetView {
            version: snapshot.version,
            models,
            addresses: Rc::new(addresses),
            topology: Rc::from(&[][..]),
            user_limits: snapshot.user_limits,
            eds: snapshot.eds,
            external_router: snapshot.external_router.clone().map(Rc::new),
        }
    }

    /// Whether `other` was decoded from a snapshot of the same topology: the same pods with
    /// the same labels and config, metrics aside. Per-pod state kept outside the view (metric
    /// series) then needs no revisit.
    pub fn same_topology(&self, other: &FleetView) -> bool {
        (Rc::ptr_eq(&self.topology, &other.topology) && !self.topology.is_empty())
            || self.has_topology(&other.topology)
    }

    /// Whether this view was decoded from a snapshot whose topology is `topology`.
    fn has_topology(&self, topology: &[u8]) -> bool {
        !self.topology.is_empty() && *self.topology == *topology
    }

    /// Whether `address` (`ip:port`) is a routable pod of this snapshot.
    pub fn holds_address(&self, address: &str) -> bool {
        self.addresses.contains(address)
    }

    /// The same fleet with every pod's engine metrics flagged stale: what the filter routes
    /// on once pd-control has not confirmed the snapshot for a while. The pods stay (they
    /// were serving a moment ago, and refusing everything would turn a control-plane outage
    /// into a data-plane one), but their load figures describe the past, so selection treats
    /// them as it treats any stale scrape. A new view: per-view caches keyed on `uid` reset.
    pub fn with_stale_metrics(&self) -> FleetView {
        self.map_models(|model| {
            let mut model = model.clone();
            for pod in &mut model.pods {
                if let Some(m) = pod.metrics.as_mut() {
                    m.stale = true;
                }
            }
            model.columns = crate::core::pd::columns::Columns::build(&model.pods, &model.rolesets);
            model.uid = NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            model
        })
    }

    /// The routing view without the pods `leaves` names (ejected ones, see
    /// `core::ejection`); a model that would be left with no route keeps all its pods. The
    /// addresses stay: requests already routed to a leaving pod finish their legs there.
    pub fn without_pods(&self, leaves: impl Fn(&str) -> bool) -> FleetView {
        self.map_models(|model| model.without(&leaves).unwrap_or_else(|| model.clone()))
    }

    /// The same snapshot (version, routable addresses) with every model view replaced.
    fn map_models(&self, f: impl Fn(&ModelView) -> ModelView) -> FleetView {
        FleetView {
            version: self.version,
            models: self
                .models
                .iter()
                .map(|(name, model)| (name.clone(), f(model)))
                .collect(),
            addresses: self.addresses.clone(),
            // A derived view (stale, ejections) is not what any snapshot decodes to: never
            // refresh metrics onto it.
            topology: Rc::from(&[][..]),
            user_limits: self.user_limits,
            eds: self.eds,
            external_router: self.external_router.clone(),
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<FleetView, prost::DecodeError> {
        FleetView::decode_after(bytes, None)
    }

    /// Decodes a snapshot that follows `previous` (the last view decoded; a stale or ejection
    /// copy of it has no topology and is never refreshed). When the two differ only in engine
    /// metrics, as nearly every snapshot does under traffic, the new view shares `previous`'s
    /// pods, rolesets and addresses and only its metrics and selection columns are new: the
    /// walk plus one column build, instead of a decode that allocates per pod and parses every
    /// pod's config.
    pub fn decode_after(
        bytes: &[u8],
        previous: Option<&FleetView>,
    ) -> Result<FleetView, prost::DecodeError> {
        let scan = Scan::of(bytes).ok();
        if let (Some(scan), Some(previous)) = (&scan, previous) {
            if previous.has_topology(&scan.topology) {
                if let Some(view) = previous.with_metrics(scan) {
                    return Ok(view);
                }
            }
        }
        let snapshot: proto::Snapshot = prost::Message::decode(bytes)?;
        let mut view = FleetView::from_snapshot(&snapshot);
        if let Some(scan) = scan {
            view.topology = scan.topology.into();
        }
        Ok(view)
    }

    /// This fleet with the metrics of `scan`, a snapshot of the same topology; `None` if
    /// `scan` does not fit (then the caller decodes in full).
    fn with_metrics(&self, scan: &Scan) -> Option<FleetView> {
        let mut models = HashMap::with_capacity(self.models.len());
        // A model named twice: the last one is the fleet's, as when the map was built.
        for m in scan.models.iter().rev() {
            if models.contains_key(m.name.as_str()) {
                continue;
            }
            let model = self.models.get(m.name.as_str())?.with_metrics(&m.pods)?;
            models.insert(m.name.clone(), model);
        }
        (models.len() == self.models.len()).then(|| FleetView {
            version: scan.version,
            models,
            addresses: self.addresses.clone(),
            topology: self.topology.clone(),
            // Part of the topology: equal topologies carry the same flag.
            user_limits: self.user_limits,
            eds: self.eds,
            external_router: self.external_router.clone(),
        })
    }
}

/// Whether a pod may be routed to at all: ready, serving HTTP, with an address.
fn routable(pod: &proto::Pod) -> bool {
    pod.ready && pod.serves_http && !pod.ip.is_empty()
}

/// A pod's metrics as the view keeps them: none when pd-control has no scrape of it.
fn usable_metrics(metrics: Option<proto::PodMetrics>) -> Option<proto::PodMetrics> {
    metrics.filter(|m| m.present)
}

impl ModelView {
    fn build(pods: &[proto::Pod], labels: Option<&proto::PodLabelSets>) -> ModelView {
        let mut view = ModelView {
            total_pods: pods.len(),
            ..ModelView::default()
        };
        // Pods pd-control cannot connect to, or whose engine sits on its requests.
        let mut avoided: Vec<(String, LeftOut)> = Vec::new();
        for (slot, pod) in pods.iter().enumerate() {
            let parsed = ModelConfig::parse(&pod.config);
            if view.config.is_none() {
                view.config = parsed.clone();
            }
            if !routable(pod) {
                continue;
            }
            let role = match pod.role.as_str() {
                "prefill" => Role::Prefill,
                "decode" => Role::Decode,
                _ => Role::Other,
            };
            let key = format!("{}/{}", pod.namespace, pod.name);
            if pod.unreachable {
                avoided.push((key.clone(), LeftOut::Unreachable));
            } else if pod.stalled {
                avoided.push((key.clone(), LeftOut::Stalled));
            }
            let info = PodInfo {
                id: crate::core::ledger::PodId::of(&key),
                key,
                name: pod.name.clone(),
                ip: pod.ip.clone(),
                address: host_port(&pod.ip, pod.port),
                engine: if pod.engine.is_empty() {
                    "vllm".into()
                } else {
                    pod.engine.clone()
                },
                role,
                roleset: pod.roleset.clone(),
                config: parsed,
                kv_connector: KvConnector::parse(&pod.kv_connector_type),
                sglang_bootstrap_port: u16::try_from(pod.sglang_bootstrap_port)
                    .ok()
                    .filter(|p| *p != 0)
                    .unwrap_or(crate::core::engine::sglang::DEFAULT_BOOTSTRAP_PORT),
                slot,
                labels: labels
                    .and_then(|sets| sets.pods.get(slot))
                    .map(|set| {
                        set.labels
                            .iter()
                            .map(|l| (l.key.clone(), l.value.clone()))
                            .collect()
                    })
                    .unwrap_or_default(),
                ready_since_ms: u64::try_from(pod.ready_since_unix_ms).unwrap_or(0),
            };
            view.pods.push(PodView {
                info: Rc::new(info),
                roleset_idx: None,
                metrics: usable_metrics(pod.metrics),
            });
        }
        view.assemble();
        if avoided.is_empty() {
            return view;
        }
        // Route around them, as around a pod this worker ejected, unless nothing would be
        // left.
        view.without_because(|key| avoided.iter().find(|(k, _)| k == key).map(|(_, why)| *why))
            .unwrap_or(view)
    }

    /// The same model with the metrics of `metrics` (the model's pods in snapshot order).
    pub(crate) fn with_metrics(&self, metrics: &[Option<proto::PodMetrics>]) -> Option<ModelView> {
        if metrics.len() != self.total_pods {
            return None;
        }
        let mut pods = self.pods.clone();
        for pod in &mut pods {
            pod.metrics = usable_metrics(*metrics.get(pod.slot)?);
        }
        let columns = crate::core::pd::columns::Columns::build(&pods, &self.rolesets);
        Some(ModelView {
            pods,
            rolesets: self.rolesets.clone(),
            others: self.others.clone(),
            config: self.config.clone(),
            total_pods: self.total_pods,
            id_order: self.id_order.clone(),
            columns,
            uid: NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            prefill_by_key: self.prefill_by_key.clone(),
            standard_by_key: self.standard_by_key.clone(),
            decode_by_key: self.decode_by_key.clone(),
            left_out: self.left_out.clone(),
            engine_mismatch: self.engine_mismatch,
        })
    }

    /// Everything derived from `pods`: rolesets (in order of first appearance), standard
    /// pods, the ledger id order, the selection columns and a fresh uid.
    fn assemble(&mut self) {
        let view = self;
        let mut others = Vec::new();
        let mut roleset_index: HashMap<&str, usize> = HashMap::new();
        let mut groups: Vec<Roleset> = Vec::new();
        for (idx, pod) in view.pods.iter().enumerate() {
            if pod.role == Role::Other {
                others.push(idx);
                continue;
            }
            if pod.roleset.is_empty() {
                continue; // a PD pod outside any roleset can never be paired
            }
            let g = *roleset_index
                .entry(pod.roleset.as_str())
                .or_insert_with(|| {
                    groups.push(Roleset {
                        name: pod.roleset.clone(),
                        prefill: vec![],
                        decode: vec![],
                    });
                    groups.len() - 1
                });
            match pod.role {
                Role::Prefill => groups[g].prefill.push(idx),
                _ => groups[g].decode.push(idx),
            }
        }
        drop(roleset_index);
        view.others = others;
        for pod in &mut view.pods {
            pod.roleset_idx = None;
        }
        view.rolesets = groups
            .into_iter()
            .filter(|g| !g.prefill.is_empty() && !g.decode.is_empty())
            .collect::<Vec<_>>()
            .into();
        view.id_order = view
            .pods
            .iter()
            .enumerate()
            .map(|(i, p)| (p.id, i))
            .collect();
        view.id_order.sort_unstable();
        for (r, roleset) in view.rolesets.iter().enumerate() {
            for &i in roleset.prefill.iter().chain(&roleset.decode) {
                view.pods[i].roleset_idx = Some(r);
            }
        }
        let by_key = |slots: &mut dyn Iterator<Item = usize>| {
            Rc::new(slots.map(|i| (view.pods[i].key.clone(), i)).collect())
        };
        view.prefill_by_key =
            by_key(&mut view.rolesets.iter().flat_map(|r| r.prefill.iter().copied()));
        view.decode_by_key =
            by_key(&mut view.rolesets.iter().flat_map(|r| r.decode.iter().copied()));
        view.standard_by_key = by_key(&mut view.others.iter().copied());
        view.columns = crate::core::pd::columns::Columns::build(&view.pods, &view.rolesets);
        view.uid = NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        view.engine_mismatch = view.pods.first().and_then(|first| {
            let other = view.pods.iter().position(|p| p.engine != first.engine)?;
            Some((0, other))
        });
    }

    /// The index of the prefill pod `key` of a complete roleset, if it is one.
    pub fn prefill_slot(&self, key: &str) -> Option<usize> {
        self.prefill_by_key.get(key).copied()
    }

    /// The index of the decode pod `key` of a complete roleset, if it is one.
    pub fn decode_slot(&self, key: &str) -> Option<usize> {
        self.decode_by_key.get(key).copied()
    }

    /// The decode pods of the complete roleset `name` (none when it is not complete here).
    pub fn decode_pods_of(&self, name: &str) -> &[usize] {
        self.rolesets
            .iter()
            .find(|r| r.name == name)
            .map_or(&[], |r| r.decode.as_slice())
    }

    /// The index of the standard pod `key`, if it is one.
    pub fn standard_slot(&self, key: &str) -> Option<usize> {
        self.standard_by_key.get(key).copied()
    }

    /// The kinds of request the view has a route for.
    fn routes(&self) -> Routes {
        Routes {
            pd: !self.rolesets.is_empty()
                || self
                    .others
                    .iter()
                    .any(|&i| self.pods[i].combined_for_every_profile()),
            single: !self.others.is_empty(),
        }
    }

    /// The view of only the pods `keep` accepts (the `external-filter` header's selector).
    /// Unlike [`ModelView::without`] there is no fallback: a selector that leaves no pod is
    /// the client's to see.
    pub fn only(&self, keep: impl Fn(&PodView) -> bool) -> ModelView {
        let mut view = ModelView {
            pods: self.pods.iter().filter(|p| keep(p)).cloned().collect(),
            config: self.config.clone(),
            total_pods: self.total_pods,
            left_out: self.left_out.clone(),
            ..ModelView::default()
        };
        view.assemble();
        view
    }

    /// The view without the pods `leaves` names (by key), or `None` when none of them
    /// leaves. The fallback is per kind of request, since a request can only take a route of
    /// its own kind: when the pods leaving would take the last route of a kind the model had
    /// (a PD request's pair or combined pod, a single-pod strategy's standard pod), the ones
    /// serving that kind stay (better a suspect pod than a certain 503, as Envoy's panic
    /// threshold does); `None` as well when no pod is left to leave. The pods leave as
    /// ejected ones.
    pub fn without(&self, leaves: impl Fn(&str) -> bool) -> Option<ModelView> {
        self.without_because(|key| leaves(key).then_some(LeftOut::Ejected))
    }

    /// [`ModelView::without`] with the reason each pod leaves, for explanations.
    pub fn without_because(&self, leaves: impl Fn(&str) -> Option<LeftOut>) -> Option<ModelView> {
        if !self.pods.iter().any(|p| leaves(&p.key).is_some()) {
            return None;
        }
        let view = self.keeping(&leaves, |_| false);
        let lost = self.routes().lost_in(view.routes());
        let view = if lost.pd || lost.single {
            self.keeping(&leaves, |pod| lost.served_by(pod))
        } else {
            view
        };
        (view.pods.len() < self.pods.len()).then_some(view)
    }

    /// The view without the pods `leaves` names, but for those `stays` keeps.
    fn keeping(
        &self,
        leaves: &impl Fn(&str) -> Option<LeftOut>,
        stays: impl Fn(&PodView) -> bool,
    ) -> ModelView {
        let mut left_out = (*self.left_out).clone();
        let mut pods = Vec::with_capacity(self.pods.len());
        for pod in &self.pods {
            match leaves(&pod.key).filter(|_| !stays(pod)) {
                Some(why) => left_out.push((pod.name.clone(), why)),
                None => pods.push(pod.clone()),
            }
        }
        let mut view = ModelView {
            pods,
            config: self.config.clone(),
            total_pods: self.total_pods,
            left_out: Rc::new(left_out),
            ..ModelView::default()
        };
        view.assemble();
        view
    }
}

/// The kinds of request a view can route, each on its own pods: a PD request on a complete
/// roleset or, failing one, a standard pod that is `combined` whatever the request's profile
/// (Step 0's fallback); a single-pod strategy's request on any standard pod. Prompt-length
/// ranges are the request's affair, not the view's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Routes {
    pd: bool,
    single: bool,
}

impl Routes {
    /// The kinds routable here and not in `after`.
    fn lost_in(self, after: Routes) -> Routes {
        Routes {
            pd: self.pd && !after.pd,
            single: self.single && !after.single,
        }
    }

    /// Whether `pod` can serve one of the kinds in `self`.
    fn served_by(self, pod: &PodView) -> bool {
        let pd_pod = matches!(pod.role, Role::Prefill | Role::Decode);
        (self.pd && (pd_pod || pod.combined_for_every_profile()))
            || (self.single && pod.role == Role::Other)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn pod(name: &str, role: &str, roleset: &str, ready: bool) -> proto::Pod {
        proto::Pod {
            namespace: "ns".into(),
            name: name.into(),
            ip: format!("127.0.0.{}", name.len()),
            port: 8000,
            engine: "vllm".into(),
            role: role.into(),
            roleset: roleset.into(),
            ready,
            serves_http: true,
            ..Default::default()
        }
    }

    pub fn snapshot(pods: Vec<proto::Pod>) -> proto::Snapshot {
        proto::Snapshot {
            version: 7,
            generated_unix_ms: 0,
            user_limits: false,
            eds: false,
            external_router: None,
            models: vec![proto::Model {
                name: "m".into(),
                pods,
                labels: None,
            }],
        }
    }

    fn scraped(mut pod: proto::Pod) -> proto::Pod {
        pod.metrics = Some(proto::PodMetrics {
            present: true,
            running: 3.0,
            generation_throughput: 500.0,
            ..Default::default()
        });
        pod
    }

    #[test]
    fn ejected_pods_leave_the_view_unless_nothing_would_be_left() {
        let fleet = FleetView::from_snapshot(&snapshot(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g0", true),
            pod("p11", "prefill", "g1", true),
            pod("d11", "decode", "g1", true),
            pod("c222", "all", "", true),
        ]));
        let m = &fleet.models["m"];
        assert!(m.without(|k| k == "ns/zz").is_none(), "nothing to remove");
        let v = fleet.without_pods(|k| k == "ns/d0");
        let view = &v.models["m"];
        let names = |idx: &[usize]| -> Vec<String> {
            idx.iter().map(|&i| view.pods[i].name.clone()).collect()
        };
        assert_eq!(view.rolesets.len(), 1, "g0 lost its decode pod: incomplete");
        assert_eq!(*view.left_out, [("d0".to_string(), LeftOut::Ejected)]);
        assert_eq!(names(&view.rolesets[0].prefill), ["p11"]);
        assert_eq!(names(&view.others), ["c222"]);
        assert_ne!(view.uid, m.uid);
        assert_eq!(view.columns.all_prefill.len(), 1);
        assert!(
            v.holds_address(&m.pods[1].address),
            "in-flight legs may still go there"
        );
        // Removing every route keeps the model whole.
        let all = fleet.without_pods(|k| k != "ns/p0");
        assert_eq!(all.models["m"].pods.len(), 5);
    }

    const COMBINED: &str = r#"{"profiles":{"default":{"routingConfig":{"combined":true}}}}"#;

    #[test]
    fn the_last_route_of_each_kind_of_request_keeps_its_pods() {
        let names =
            |m: &ModelView| -> Vec<String> { m.pods.iter().map(|p| p.name.clone()).collect() };
        let plain = |name| pod(name, "", "", true);
        // A plain standard pod is no route for a PD request: the pair keeps its decode pod.
        let fleet = FleetView::from_snapshot(&snapshot(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g0", true),
            plain("s0"),
        ]));
        let m = &fleet.models["m"];
        assert!(
            m.without(|k| k == "ns/d0").is_none(),
            "d0 stays for PD requests"
        );
        assert!(
            m.without(|k| k == "ns/s0").is_none(),
            "s0 stays for single-pod ones"
        );
        // Each kind keeps only its own pods: d1 leaves (g0 remains), s0 stays (the last).
        let fleet = FleetView::from_snapshot(&snapshot(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g0", true),
            pod("p1", "prefill", "g1", true),
            pod("d1", "decode", "g1", true),
            plain("s0"),
        ]));
        let m = &fleet.models["m"];
        let view = m
            .without(|k| k == "ns/d1" || k == "ns/s0")
            .expect("d1 leaves");
        assert_eq!(names(&view), ["p0", "d0", "p1", "s0"]);
        assert_eq!(*view.left_out, [("d1".to_string(), LeftOut::Ejected)]);
        // A pod combined whatever the profile is a PD route: the decode pod may leave.
        let fleet = FleetView::from_snapshot(&snapshot(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g0", true),
            proto::Pod {
                config: COMBINED.into(),
                ..plain("c0")
            },
        ]));
        let view = fleet.models["m"]
            .without(|k| k == "ns/d0")
            .expect("c0 serves PD");
        assert_eq!(names(&view), ["p0", "c0"]);
        // One combined under a named profile only is not: a request without it gets none.
        let fleet = FleetView::from_snapshot(&snapshot(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g0", true),
            proto::Pod {
                config: r#"{"profiles":{"pd":{"routingConfig":{"combined":true}}}}"#.into(),
                ..plain("c0")
            },
        ]));
        assert!(fleet.models["m"].without(|k| k == "ns/d0").is_none());
    }

    #[test]
    fn pods_pd_control_cannot_reach_or_finds_stalled_leave_the_view_unless_nothing_would_be_left() {
        use prost::Message;
        let unreachable = |mut p: proto::Pod| {
            p.unreachable = true;
            p
        };
        let fleet = |d0: proto::Pod, running: f64| {
            let mut snap = snapshot(vec![
                scraped(pod("p0", "prefill", "g0", true)),
                d0,
                scraped(pod("p11", "prefill", "g1", true)),
                scraped(pod("d11", "decode", "g1", true)),
            ]);
            for p in &mut snap.models[0].pods {
                if let Some(m) = p.metrics.as_mut() {
                    m.running = running;
                }
            }
            snap.encode_to_vec()
        };
        let reachable = FleetView::decode(&fleet(scraped(pod("d0", "decode", "g0", true)), 1.0))
            .expect("decodes");
        assert_eq!(reachable.models["m"].rolesets.len(), 2);

        let dead_d0 = scraped(unreachable(pod("d0", "decode", "g0", true)));
        let marked = FleetView::decode_after(&fleet(dead_d0.clone(), 1.0), Some(&reachable))
            .expect("decodes");
        let m = &marked.models["m"];
        assert!(
            !marked.same_topology(&reachable),
            "a new mark is a full adoption"
        );
        assert_eq!(m.rolesets.len(), 1, "g0 lost its decode pod");
        assert!(m.pods.iter().all(|p| p.name != "d0"));
        assert_eq!(*m.left_out, [("d0".to_string(), LeftOut::Unreachable)]);
        assert!(
            marked.holds_address(&reachable.models["m"].pods[1].address),
            "legs already routed there may finish"
        );
        // Later snapshots of the same topology refresh metrics onto the narrowed view.
        let later = FleetView::decode_after(&fleet(dead_d0, 2.0), Some(&marked)).expect("decodes");
        let m = &later.models["m"];
        assert!(later.same_topology(&marked));
        assert_eq!(m.rolesets.len(), 1);
        for p in &m.pods {
            let snapshot_slot = ["p0", "d0", "p11", "d11"][p.slot];
            assert_eq!(p.name, snapshot_slot, "slots still index the snapshot");
            assert_eq!(p.metrics.map(|m| m.running), Some(2.0));
        }

        // Every route unreachable: the model keeps its pods (a suspect pod over a sure 503).
        let all = FleetView::from_snapshot(&snapshot(vec![
            unreachable(pod("p0", "prefill", "g0", true)),
            pod("d0", "decode", "g0", true),
        ]));
        assert_eq!(all.models["m"].rolesets.len(), 1);

        // A stalled engine is avoided alike (a PD request still has the combined pod).
        let stalled = FleetView::from_snapshot(&snapshot(vec![
            pod("p0", "prefill", "g0", true),
            proto::Pod {
                stalled: true,
                ..pod("d0", "decode", "g0", true)
            },
            proto::Pod {
                config: COMBINED.into(),
                ..pod("c1", "all", "", true)
            },
        ]));
        let m = &stalled.models["m"];
        assert!(m.rolesets.is_empty());
        assert_eq!(m.pods.len(), 2);
        assert_eq!(*m.left_out, [("d0".to_string(), LeftOut::Stalled)]);
        // An ejection on top adds its own reason; a selector's narrowing keeps the list.
        let ejected = m.without(|k| k == "ns/c1");
        assert!(ejected.is_none(), "no route would be left");
        let mut explained = String::new();
        crate::core::obs::explain::left_out(&mut explained, m);
        assert_eq!(explained, "; out=d0:stalled");
        assert_eq!(*m.only(|_| true).left_out, *m.left_out);
    }

    #[test]
    fn a_selector_narrows_the_view_to_the_pods_it_keeps_with_no_fallback() {
        let mut snap = snapshot(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g0", true),
            pod("p11", "prefill", "g1", true),
            pod("d11", "decode", "g1", true),
            pod("c222", "all", "", true),
        ]);
        let tier = |value: &str| proto::PodLabels {
            labels: vec![proto::Label {
                key: "tier".into(),
                value: value.into(),
            }],
        };
        snap.models[0].labels = Some(proto::PodLabelSets {
            pods: vec![
                tier("canary"),
                tier("canary"),
                tier("stable"),
                tier("stable"),
            ],
        });
        let fleet = FleetView::from_snapshot(&snap);
        let m = &fleet.models["m"];
        assert_eq!(
            m.pods[0].labels,
            [("tier".to_string(), "canary".to_string())]
        );
        let selector = crate::core::label_selector::Selector::parse("tier=canary").unwrap();
        let view = m.only(|p| selector.matches(&p.labels));
        assert_eq!(view.pods.len(), 2);
        assert_eq!(view.rolesets.len(), 1);
        assert_eq!(view.rolesets[0].name, "g0");
        assert!(view.others.is_empty());
        assert_ne!(view.uid, m.uid);
        let none = crate::core::label_selector::Selector::parse("tier=gone").unwrap();
        assert!(m.only(|p| none.matches(&p.labels)).pods.is_empty());

        // Narrowed once per view and selector text.
        let mut cache = NarrowedViews::default();
        let a = cache.narrow(m, "tier=canary").unwrap();
        assert!(Rc::ptr_eq(&a, &cache.narrow(m, "tier=canary").unwrap()));
        let b = cache.narrow(m, "tier=stable").unwrap();
        assert_eq!(b.rolesets[0].name, "g1");
        let newer = FleetView::from_snapshot(&snap);
        let c = cache.narrow(&newer.models["m"], "tier=stable").unwrap();
        assert!(
            !Rc::ptr_eq(&b, &c),
            "a new view of the model is narrowed again"
        );
        assert!(cache.narrow(m, "tier in (").is_err());
        // Alternating selectors keep their views; the least recently used gives way.
        let a = cache.narrow(m, "tier=canary").unwrap();
        assert!(Rc::ptr_eq(&b, &cache.narrow(m, "tier=stable").unwrap()));
        assert!(Rc::ptr_eq(&a, &cache.narrow(m, "tier=canary").unwrap()));
        for i in 0..NARROWED_VIEWS - 1 {
            cache.narrow(m, &format!("rank={i}")).unwrap();
            assert!(Rc::ptr_eq(&a, &cache.narrow(m, "tier=canary").unwrap()));
        }
        assert!(
            !Rc::ptr_eq(&b, &cache.narrow(m, "tier=stable").unwrap()),
            "tier=stable was the least recently used"
        );
    }

    #[test]
    fn addresses_are_those_of_routable_pods_only() {
        let mut other = pod("q0", "decode", "g0", true);
        other.port = 9000;
        let mut snap = snapshot(vec![
            pod("p0", "prefill", "g0", true),
            pod("d00", "decode", "g0", false),
        ]);
        snap.models.push(proto::Model {
            name: "m2".into(),
            pods: vec![other],
            labels: None,
        });
        let fleet = FleetView::from_snapshot(&snap);
        assert!(fleet.holds_address("127.0.0.2:8000"));
        assert!(fleet.holds_address("127.0.0.2:9000"), "other models count");
        assert!(
            !fleet.holds_address("127.0.0.3:8000"),
            "a pod that is not ready is no target"
        );
        assert!(!fleet.holds_address("127.0.0.2:8001"));
        assert!(!fleet.holds_address(""));
    }

    #[test]
    fn an_ipv6_pod_address_is_bracketed() {
        let mut v6 = pod("p6", "prefill", "g0", true);
        v6.ip = "fd00::7".into();
        let fleet = FleetView::from_snapshot(&snapshot(vec![v6, pod("d0", "decode", "g0", true)]));
        let p = &fleet.models["m"].pods[0];
        assert_eq!(p.address, "[fd00::7]:8000");
        assert_eq!(
            p.ip, "fd00::7",
            "the bare IP for remote_host / bootstrap_host"
        );
        assert!(fleet.holds_address("[fd00::7]:8000"));
        assert!(!fleet.holds_address("fd00::7:8000"));
        assert_eq!(host_port("10.1.2.3", 80), "10.1.2.3:80");
        assert_eq!(host_port("[::1]", 80), "[::1]:80");
    }

    #[test]
    fn a_stale_copy_keeps_pods_and_flags_every_metric() {
        let fleet = FleetView::from_snapshot(&snapshot(vec![
            scraped(pod("p0", "prefill", "g0", true)),
            scraped(pod("d0", "decode", "g0", true)),
            pod("d1", "decode", "g0", true),
        ]));
        let fresh = &fleet.models["m"];
        assert!(fresh.columns.fresh[0] && fresh.columns.fresh[1]);
        let stale = fleet.with_stale_metrics();
        let m = &stale.models["m"];
        assert_eq!(stale.version, fleet.version);
        assert_eq!(m.pods.len(), 3);
        assert_eq!(m.rolesets.len(), 1);
        assert!(m
            .pods
            .iter()
            .all(|p| p.metrics.as_ref().is_none_or(|m| m.stale)));
        assert!(m.columns.fresh.iter().all(|f| !f), "{:?}", m.columns.fresh);
        assert!(m.columns.throughput.iter().all(|t| t.is_nan()));
        assert_ne!(m.uid, fresh.uid, "per-view caches must not carry over");
        assert!(stale.holds_address(&m.pods[0].address));
        assert!(
            fleet.models["m"].columns.fresh[0],
            "the original view is untouched"
        );
    }

    #[test]
    fn only_complete_rolesets_and_combined_pods_are_indexed() {
        let mut combined = pod("c0", "all", "", true);
        combined.config = r#"{"profiles":{"default":{"routingConfig":{"combined":true}}}}"#.into();
        let fleet = FleetView::from_snapshot(&snapshot(vec![
            pod("p0", "prefill", "g0", true),
            pod("d0", "decode", "g0", true),
            pod("p1", "prefill", "g1", true),
            pod("d1", "decode", "g1", false),
            pod("d2", "decode", "g2", true),
            pod("x0", "decode", "", true),
            combined,
            pod("plain", "", "", true),
        ]));
        let m = &fleet.models["m"];
        assert_eq!(fleet.version, 7);
        assert_eq!(m.total_pods, 8);
        assert_eq!(m.rolesets.len(), 1);
        assert_eq!(m.rolesets[0].name, "g0");
        assert_eq!(m.pods[m.rolesets[0].prefill[0]].key, "ns/p0");
        assert_eq!(m.others.len(), 2, "c0 and plain run whole requests");
        let c0 = &m.pods[m.others[0]];
        assert_eq!(
            (c0.name.as_str(), c0.address.as_str()),
            ("c0", "127.0.0.2:8000")
        );
        assert!(c0.routing_config(None).is_some_and(|rc| rc.combined));
        assert!(m.pods[m.others[1]].routing_config(None).is_none());
        assert!(
            m.config.is_some(),
            "model config comes from the first valid annotation"
        );
    }
}
