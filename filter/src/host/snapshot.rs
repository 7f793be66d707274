//! Getting the fleet snapshot from pd-control to every worker.
//!
//! One VM at a time fetches: the holder of a lease kept in shared data (Istio's `WasmPlugin`
//! installs only HTTP filters, so there is no bootstrap singleton to rely on). It stores the
//! snapshot bytes in shared data and pushes a notice into every VM's own shared queue
//! (a queue has exactly one consumer, so broadcast needs one queue per VM). Each VM also
//! compares a small version key on its timer, so a lost notice delays a VM by one tick at most.

use std::time::Duration;

use proxy_wasm::hostcalls;

use crate::core::adoption::{supersedes, Tally};
use crate::core::fleet::FleetView;
use crate::core::ledger::{Store, StoreError};
use crate::host::store::SharedData;

/// 8-byte little-endian version followed by the protobuf snapshot.
pub const SNAPSHOT_KEY: &str = "pd/snapshot";
/// The version alone, cheap to poll.
pub const VERSION_KEY: &str = "pd/snapshot/version";
/// `"<holder token hex> <expiry ms>"`.
pub const LEASE_KEY: &str = "pd/lease";
/// One line per VM queue: `"<queue name> <expiry ms>"`.
pub const QUEUES_KEY: &str = "pd/queues";
/// When pd-control last confirmed the published snapshot (a 200 or 304 poll), 8-byte
/// little-endian milliseconds: every VM judges the snapshot's freshness from it, not only
/// the lease holder that polls.
pub const CONFIRMED_KEY: &str = "pd/snapshot/confirmed";
/// Whether this Envoy's retrying cluster holds pd-control's endpoint listing, as the last
/// poll's answer said (`1`, `0`, empty when it did not say).
pub const EDS_HERE_KEY: &str = "pd/snapshot/eds_here";
/// The poll's header naming this Envoy's node, and the answer's saying whether that node's
/// retrying cluster took the listing (pd-control `xds::EdsHere`).
pub const NODE_HEADER: &str = "x-pd-node";
pub const EDS_HERE_HEADER: &str = "x-pd-eds-here";
/// [`Tally`] of the VMs routing on the newest snapshot.
pub const ADOPTED_KEY: &str = "pd/snapshot/adopted";

/// How long a VM's queue entry lives without a heartbeat; dead VMs (reloads) drop out.
const QUEUE_TTL_MS: u64 = 5_000;
const HEARTBEAT_MS: u64 = 1_000;

/// Reads the published snapshot version (0 when none).
pub fn published_version() -> u64 {
    match SharedData.get(VERSION_KEY) {
        Ok((Some(bytes), _)) => bytes
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .unwrap_or(0),
        _ => 0,
    }
}

/// Why a snapshot poll failed: the `reason` label of `pd_router_snapshot_fetch_errors_total`.
/// `unreachable`: no answer (refused, reset, timed out); `unauthorized`: 401/403 (the
/// `snapshot_token` does not match pd-control's); `status`: any other unexpected status;
/// `no_version`: a 200 without a valid `x-pd-snapshot-version`; `undecodable`: the body is
/// not a snapshot; `dispatch`: Envoy refused to send the call (unknown cluster, say).
pub const FETCH_ERRORS: [&str; 6] = [
    "unreachable",
    "unauthorized",
    "status",
    "no_version",
    "undecodable",
    "dispatch",
];

/// The reason label of a poll answered with `status` (neither 200 nor 304). pd-control
/// stamps its version on every snapshot answer; a 503/504 without it is Envoy's own reply
/// for a connection that failed or timed out, so pd-control was not reached.
pub fn status_reason(status: &str, from_control: bool) -> &'static str {
    match status {
        "" => "unreachable",
        "503" | "504" if !from_control => "unreachable",
        "401" | "403" => "unauthorized",
        _ => "status",
    }
}

/// Counts this VM's adoption of `version`; returns the tally after it, and whether it counted
/// this adoption. It does not while the version key still names the previous snapshot: the
/// publisher writes the snapshot, then the version key, and a VM on another thread can read
/// the new snapshot in between (the caller counts it again later, or its count was missing
/// from `pd_router_fleet_vms_on_latest` until the next snapshot).
pub fn record_adoption(version: u64) -> Result<(Tally, bool), StoreError> {
    for _ in 0..16 {
        let (current, cas) = SharedData.get(ADOPTED_KEY)?;
        let published = published_version();
        let tally = current
            .as_deref()
            .and_then(Tally::decode)
            .unwrap_or_default()
            .adopted(version, published);
        if SharedData.set(ADOPTED_KEY, &tally.encode(), cas)? {
            return Ok((tally, published == version));
        }
    }
    Err(StoreError::Contention(16))
}

/// The current tally of adoptions (none before the first adoption).
pub fn adoption_tally() -> Option<Tally> {
    match SharedData.get(ADOPTED_KEY) {
        Ok((Some(bytes), _)) => Tally::decode(&bytes),
        _ => None,
    }
}

/// Records a successful poll at `now` for every VM of this process.
pub fn confirm(now: u64) {
    if let Err(e) = SharedData.set(CONFIRMED_KEY, &now.to_le_bytes(), None) {
        log::warn!("cannot record the snapshot confirmation: {e}");
    }
}

/// When a poll last succeeded, if one ever did in this process.
pub fn confirmed_at() -> Option<u64> {
    match SharedData.get(CONFIRMED_KEY) {
        Ok((Some(bytes), _)) => bytes
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes),
        _ => None,
    }
}

/// Records what the last poll's answer said of this Envoy's retrying cluster, for every VM.
pub fn set_eds_here(answer: Option<&str>) {
    let value = answer.map(str::trim).unwrap_or_default();
    if let Err(e) = SharedData.set(EDS_HERE_KEY, value.as_bytes(), None) {
        log::warn!("cannot record the endpoint listing's state: {e}");
    }
}

/// Whether this Envoy's retrying cluster holds the listing: `None` when pd-control did not
/// say (an older one, or no poll answered yet), so the snapshot's own flag decides.
pub fn eds_here() -> Option<bool> {
    match SharedData.get(EDS_HERE_KEY) {
        Ok((Some(bytes), _)) => match bytes.as_slice() {
            b"1" => Some(true),
            b"0" => Some(false),
            _ => None,
        },
        _ => None,
    }
}

/// `authorization: Bearer <token>` for calls to pd-control, when a token is configured.
pub fn bearer(token: &str) -> Option<String> {
    (!token.is_empty()).then(|| format!("Bearer {token}"))
}

/// Decodes the published snapshot when it is not the one this VM has (`have`): published is
/// newest even when numerically older (see `core::adoption::supersedes`); `previous` (the
/// VM's last decoded view) spares the full decode when only metrics changed.
pub fn load_newer(have: u64, previous: Option<&FleetView>) -> Result<Option<FleetView>, String> {
    if published_version() == have {
        return Ok(None);
    }
    let (bytes, _) = SharedData.get(SNAPSHOT_KEY).map_err(|e| e.to_string())?;
    let Some(bytes) = bytes else { return Ok(None) };
    if bytes.len() < 8 {
        return Err("published snapshot is truncated".into());
    }
    let view = FleetView::decode_after(&bytes[8..], previous)
        .map_err(|e| format!("cannot decode snapshot: {e}"))?;
    Ok((view.version != have).then_some(view))
}

/// Stores a snapshot pd-control answered to a poll that named `polled_with`, when it
/// supersedes the one there (`core::adoption::supersedes`: two fetchers may overlap while a
/// lease changes hands, and the newer publication must win).
pub fn publish(version: u64, polled_with: u64, proto: &[u8]) -> Result<bool, StoreError> {
    for _ in 0..16 {
        let (current, cas) = SharedData.get(SNAPSHOT_KEY)?;
        let current_version = current
            .as_deref()
            .and_then(|b| b.get(..8))
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .unwrap_or(0);
        if !supersedes(current_version, polled_with, version) {
            // The version key is written after the snapshot, without CAS: two overlapping
            // fetchers can leave it naming the other's snapshot. Mend it here, or every poll
            // would name that version and fetch the whole snapshot again.
            if current_version != 0 && published_version() != current_version {
                SharedData.set(VERSION_KEY, &current_version.to_le_bytes(), None)?;
            }
            return Ok(false);
        }
        let mut value = Vec::with_capacity(8 + proto.len());
        value.extend_from_slice(&version.to_le_bytes());
        value.extend_from_slice(proto);
        if SharedData.set(SNAPSHOT_KEY, &value, cas)? {
            SharedData.set(VERSION_KEY, &version.to_le_bytes(), None)?;
            return Ok(true);
        }
    }
    Err(StoreError::Contention(16))
}

/// The fingerprint of the plugin configuration configured last (see [`lead_config`]).
const LEAD_CONFIG_KEY: &str = "pd/lease-config";

/// Names the plugin configuration a root context was just configured with (its fingerprint)
/// as the one that polls pd-control and reports to it. After a configuration change (ECDS,
/// LDS) the superseded root contexts live on while their streams do, up to an hour for a long
/// answer; holding the lease, one would keep polling with the old snapshot token or cluster
/// (after a token rotation: 401s and a stale snapshot for every worker) and the new ones
/// would never poll.
pub fn lead_config(fingerprint: u64) {
    if let Err(e) = SharedData.set(LEAD_CONFIG_KEY, &fingerprint.to_le_bytes(), None) {
        log::warn!("cannot record the plugin configuration that polls: {e}");
    }
}

/// Whether a root context configured with `fingerprint` may take or keep the lease: its
/// configuration is the one configured last (or none is recorded).
pub fn leads_config(fingerprint: u64) -> bool {
    match SharedData.get(LEAD_CONFIG_KEY) {
        Ok((Some(v), _)) => v.as_slice() == fingerprint.to_le_bytes(),
        _ => true,
    }
}

/// Gives the fetch lease up if this VM holds it (its plugin is going away).
pub fn release_lease(token: u64) {
    let Ok((Some(value), cas)) = SharedData.get(LEASE_KEY) else {
        return;
    };
    let held = std::str::from_utf8(&value)
        .ok()
        .and_then(|s| s.split_once(' '))
        .and_then(|(h, _)| u64::from_str_radix(h, 16).ok())
        == Some(token);
    if held {
        // Expired at once; a CAS so a holder that took it meanwhile keeps it.
        let _ = SharedData.set(LEASE_KEY, format!("{token:x} 0").as_bytes(), cas);
    }
}

/// Tries to take or renew the fetch lease; true when this VM holds it.
pub fn hold_lease(token: u64, now: u64, lease_ms: u64) -> bool {
    let Ok((value, cas)) = SharedData.get(LEASE_KEY) else {
        return false;
    };
    let (holder, expiry) = value
        .as_deref()
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|s| s.split_once(' '))
        .and_then(|(h, e)| Some((u64::from_str_radix(h, 16).ok()?, e.parse::<u64>().ok()?)))
        .unwrap_or((0, 0));
    if holder != token && expiry > now {
        return false;
    }
    let next = format!("{token:x} {}", now + lease_ms);
    match SharedData.set(LEASE_KEY, next.as_bytes(), cas) {
        Ok(true) if value.is_some() => true,
        // The key was absent, so the CAS was not checked: read back to see who won.
        Ok(true) => matches!(SharedData.get(LEASE_KEY), Ok((Some(v), _)) if v == next.as_bytes()),
        _ => false,
    }
}

/// This VM's notice queue and its registry entry.
pub struct NoticeQueue {
    pub id: u32,
    pub name: String,
    last_heartbeat: u64,
}

impl NoticeQueue {
    pub fn register(token: u64) -> Option<NoticeQueue> {
        let name = format!("pd/notify/{token:016x}");
        match hostcalls::register_shared_queue(&name) {
            Ok(id) => Some(NoticeQueue {
                id,
                name,
                last_heartbeat: 0,
            }),
            Err(e) => {
                log::warn!("cannot register shared queue {name}: {e:?}");
                None
            }
        }
    }

    /// Keeps this queue's registry entry alive and prunes entries of VMs that are gone.
    /// True when it wrote the registry (about once a second).
    pub fn heartbeat(&mut self, now: u64) -> bool {
        if now < self.last_heartbeat + HEARTBEAT_MS {
            return false;
        }
        for _ in 0..16 {
            let Ok((value, cas)) = SharedData.get(QUEUES_KEY) else {
                return false;
            };
            let text = value
                .as_deref()
                .and_then(|v| std::str::from_utf8(v).ok())
                .unwrap_or("");
            let mut next = String::with_capacity(text.len() + 64);
            for line in text.lines() {
                let Some((name, expiry)) = line.split_once(' ') else {
                    continue;
                };
                let alive = expiry.parse::<u64>().map(|e| e > now).unwrap_or(false);
                if name != self.name && alive {
                    next.push_str(line);
                    next.push('\n');
                }
            }
            next.push_str(&format!("{} {}\n", self.name, now + QUEUE_TTL_MS));
            if let Ok(true) = SharedData.set(QUEUES_KEY, next.as_bytes(), cas) {
                self.last_heartbeat = now;
                return true;
            }
        }
        false
    }
}

/// Queue message tags: a snapshot notice (then the 8-byte version), a prefix event or a
/// batch of them (`EventBatch`; sent by VMs of earlier builds, which pushed their events
/// where this one publishes them, `core::prefix::log`, still applied while an ECDS update
/// runs both), a wake-up (an idle VM got a request, see `VmState::wake_for_request`; no
/// payload, or [`WAKE_FOLLOWERS`]), news of the other replicas (no payload: the lease
/// holder stored a changed answer, see `host::replicas::adopt_newer`), or a pod another VM
/// ejected (`core::ejection::EjectNotice`).
pub const MSG_SNAPSHOT: u8 = 1;
pub const MSG_PREFIX: u8 = 2;
pub const MSG_PREFIX_BATCH: u8 = 3;
pub const MSG_WAKE: u8 = 4;
pub const MSG_REMOTE: u8 = 5;
pub const MSG_EJECT: u8 = 6;
/// Payload of a [`MSG_WAKE`] sent only so that the VMs following this one's prefix ring read
/// it closely (`core::prefix::follow`): the others stay asleep. An empty payload (as earlier
/// builds send) wakes every VM.
pub const WAKE_FOLLOWERS: u8 = 1;

/// Queue ids of every live VM's notice queue except `exclude` (this VM's own queue name).
pub fn live_queues(vm_id: &str, now: u64, exclude: Option<&str>) -> Vec<u32> {
    let Ok((Some(value), _)) = SharedData.get(QUEUES_KEY) else {
        return Vec::new();
    };
    let Ok(text) = std::str::from_utf8(&value) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|line| line.split_once(' '))
        .filter(|(name, expiry)| {
            Some(*name) != exclude && expiry.parse::<u64>().is_ok_and(|e| e > now)
        })
        .filter_map(|(name, _)| hostcalls::resolve_shared_queue(vm_id, name).ok().flatten())
        .collect()
}

/// Sends `version` to every live VM queue (this VM's too: it is how the others learn).
pub fn notify_all(vm_id: &str, version: u64, now: u64) {
    let mut msg = vec![MSG_SNAPSHOT];
    msg.extend_from_slice(&version.to_le_bytes());
    for id in live_queues(vm_id, now, None) {
        let _ = hostcalls::enqueue_shared_queue(id, Some(&msg));
    }
}

/// Sends a tagged message to the given queues; a vanished queue is skipped.
pub fn broadcast(queues: &[u32], tag: u8, payload: &[u8]) {
    let mut msg = Vec::with_capacity(1 + payload.len());
    msg.push(tag);
    msg.extend_from_slice(payload);
    for &id in queues {
        let _ = hostcalls::enqueue_shared_queue(id, Some(&msg));
    }
}

/// Sends a snapshot poll. The version we hold lets pd-control answer 304, and `wait_ms`
/// lets it hold that answer until a newer version exists (a long poll; an older pd-control
/// ignores the parameter and answers at once). `fetch_timeout_ms` covers one answer, on top
/// of the wait. `node` (this Envoy's node id) lets pd-control say whether this gateway's
/// retrying cluster took its endpoint listing (`EDS_HERE_HEADER`); `trt_machine` (the
/// process's `MACHINE_HEADER` value) lets it see gateways sharing one TRT-LLM machine id.
pub fn fetch_request(
    plugin: &crate::core::config::PluginConfig,
    have: u64,
    node: Option<&str>,
    trt_machine: &str,
) -> Result<u32, proxy_wasm::types::Status> {
    let wait_ms = plugin.poll_wait_ms();
    let path = &plugin.snapshot_path;
    let path = if wait_ms > 0 && have > 0 {
        format!("{path}?version={have}&wait_ms={wait_ms}")
    } else {
        format!("{path}?version={have}")
    };
    let timeout = Duration::from_millis(plugin.fetch_timeout_ms) + Duration::from_millis(wait_ms);
    let authorization = bearer(&plugin.snapshot_token);
    let mut headers = vec![
        (":method", "GET"),
        (":path", path.as_str()),
        (":authority", plugin.control_authority.as_str()),
    ];
    if let Some(value) = authorization.as_deref() {
        headers.push(("authorization", value));
    }
    if let Some(node) = node {
        headers.push((NODE_HEADER, node));
    }
    headers.push((crate::core::engine::trtllm::MACHINE_HEADER, trt_machine));
    headers.push((crate::core::build::BUILD_HEADER, crate::core::build::BUILD));
    hostcalls::dispatch_http_call(&plugin.control_cluster, headers, None, vec![], timeout)
}
