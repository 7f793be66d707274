//! Several gateway replicas: the lease-holding VM of each Envoy process reports the process's
//! decode ledger (its running counts, and its decode tokens with the shared ledger on) to
//! pd-control and keeps the answer (the other replicas' shares) in shared
//! data, where every worker VM picks it up: at once when the answer changed (a `MSG_REMOTE`
//! notice), else on its tick or when it wakes. See `crate::core::remote`.

use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use proxy_wasm::hostcalls;

use crate::core::ledger::{self, Store};
use crate::core::remote::{self, RemoteLoad};
use crate::host::metrics::Metrics;
use crate::host::store::SharedData;
use crate::host::VmState;

/// The other replicas' shares as pd-control last answered: `at_ms` (u64 LE) then the
/// `RemoteShares` protobuf.
const REMOTE_KEY: &str = "pd/remote";
/// When the last answer came (u64 LE ms) and the generation of its content (u64 LE), bumped
/// only when an answer differs from the one before. VMs read these 16 bytes on their tick,
/// the whole answer only when the generation moved.
const REMOTE_GEN_KEY: &str = "pd/remote/gen";
/// This Envoy process's replica id, chosen by the first VM that starts.
const REPLICA_KEY: &str = "pd/replica";
pub const REPORT_PATH: &str = "/v1/replicas/report";
/// Shares older than this are dropped: with pd-control unreachable, a frozen picture of the
/// others' load would steer traffic away from pods that have long drained.
pub const REMOTE_STALE_MS: u64 = 5_000;

/// The process-wide replica id (random, never 0), shared by every VM of this Envoy.
pub fn replica_id(random: u64) -> u64 {
    let read = || match SharedData.get(REPLICA_KEY) {
        Ok((Some(v), _)) => v
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes),
        _ => None,
    };
    if let Some(id) = read() {
        return id;
    }
    let _ = SharedData.set(REPLICA_KEY, &(random | 1).to_le_bytes(), None);
    read().unwrap_or(random | 1)
}

/// This process's decode ledger as a report body (`ReplicaReport` protobuf); the same ledger
/// always encodes to the same bytes, so unchanged load can be recognised by them.
pub fn report_body(replica: u64, share_decode: bool) -> Result<Vec<u8>, String> {
    let ledger = ledger::read(&SharedData).map_err(|e| e.to_string())?;
    Ok(remote::report(&ledger, replica, share_decode).encode_to_vec())
}

/// Sends a report body to pd-control; returns the call's token.
pub fn send_report(
    cluster: &str,
    authority: &str,
    body: &[u8],
    token: &str,
    timeout: Duration,
) -> Result<u32, String> {
    let authorization = crate::host::snapshot::bearer(token);
    let mut headers = vec![
        (":method", "POST"),
        (":path", REPORT_PATH),
        (":authority", authority),
        ("content-type", "application/x-protobuf"),
    ];
    if let Some(value) = authorization.as_deref() {
        headers.push(("authorization", value));
    }
    hostcalls::dispatch_http_call(cluster, headers, Some(body), vec![], timeout)
        .map_err(|e| format!("{e:?}"))
}

/// pd-control's answer as stored: how many other live replicas it counts, and whether it
/// differs from the previous answer (then the other VMs should re-read it now).
pub struct Stored {
    pub others: u32,
    pub changed: bool,
}

/// Keeps pd-control's answer for every VM of this process, after checking it decodes.
pub fn store_answer(now_ms: u64, body: &[u8]) -> Result<Stored, String> {
    let others = RemoteLoad::decode(body)
        .map_err(|e| format!("replica shares do not decode: {e}"))?
        .replicas;
    let changed = match SharedData.get(REMOTE_KEY) {
        Ok((Some(old), _)) => old.get(8..) != Some(body),
        _ => true,
    };
    let generation = read_gen().map_or(0, |(_, g)| g) + u64::from(changed);
    let mut value = Vec::with_capacity(8 + body.len());
    value.extend_from_slice(&now_ms.to_le_bytes());
    value.extend_from_slice(body);
    let mut gen_value = [0u8; 16];
    gen_value[..8].copy_from_slice(&now_ms.to_le_bytes());
    gen_value[8..].copy_from_slice(&generation.to_le_bytes());
    SharedData
        .set(REMOTE_KEY, &value, None)
        .and_then(|_| SharedData.set(REMOTE_GEN_KEY, &gen_value, None))
        .map(|_| Stored { others, changed })
        .map_err(|e| e.to_string())
}

/// (answered at ms, content generation) of the stored answer.
fn read_gen() -> Option<(u64, u64)> {
    let (value, _) = SharedData.get(REMOTE_GEN_KEY).ok()?;
    let value = value?;
    let at = u64::from_le_bytes(value.get(..8)?.try_into().ok()?);
    let generation = u64::from_le_bytes(value.get(8..16)?.try_into().ok()?);
    Some((at, generation))
}

/// Adopts the stored answer when its content is newer than the VM's view. Cheap when nothing
/// changed (one 16-byte shared-data read): called on each tick, when an idle VM wakes, and
/// when the lease holder announces a changed answer (`MSG_REMOTE`), so no VM scores
/// requests on an answer older than the one this process holds.
pub fn adopt_newer(vm: &mut VmState, now_ms: u64) {
    let Some((at, generation)) = read_gen() else {
        return;
    };
    vm.remote_at_ms = at;
    // A stale answer is not adopted ([`refresh`] drops it); a fresh one, even unchanged, is
    // adopted again once pd-control answers.
    if vm.remote_gen == Some(generation) || now_ms.saturating_sub(at) > REMOTE_STALE_MS {
        return;
    }
    let Ok((Some(value), _)) = SharedData.get(REMOTE_KEY) else {
        return;
    };
    vm.remote_gen = Some(generation);
    let load = value.get(8..).and_then(|b| RemoteLoad::decode(b).ok());
    // Replicas count even while idle: they read this one's load.
    vm.other_replicas = load.as_ref().map_or(0, |r| r.replicas);
    let load = match load {
        Some(r) if !vm.defaults.tokens.shared_ledger => Some(r.running_only()),
        other => other,
    };
    vm.remote = load.filter(|r| !r.is_empty()).map(Arc::new);
}

/// Brings the VM's view of the other replicas up to date on its tick: adopts a newer answer,
/// drops a stale one, and shows the view in the gauges.
pub fn refresh(vm: &mut VmState, now_ms: u64) {
    adopt_newer(vm, now_ms);
    if now_ms.saturating_sub(vm.remote_at_ms) > REMOTE_STALE_MS {
        if vm.remote.is_some() {
            log::warn!(
                "other replicas' decode shares are {} s old (pd-control unreachable?); scoring local load only",
                now_ms.saturating_sub(vm.remote_at_ms) / 1000
            );
        }
        vm.remote = None;
        vm.remote_gen = None;
        vm.other_replicas = 0;
    }
    let tokens = vm.remote.as_ref().map_or(0.0, |r| r.total_decode_tokens());
    Metrics::set(vm.metrics.remote_decode_tokens, tokens.round() as u64);
    let running = vm.remote.as_ref().map_or(0, |r| r.total_running());
    Metrics::set(vm.metrics.remote_running_requests, running);
    Metrics::set(vm.metrics.remote_replicas, u64::from(vm.other_replicas));
}
