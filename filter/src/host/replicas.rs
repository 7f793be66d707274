//! Several gateway replicas: the lease-holding VM of each Envoy process reports the process's
//! decode ledger to pd-control and keeps the answer (the other replicas' shares) in shared
//! data, where every worker VM picks it up on its tick. See `crate::core::remote`.

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
/// Rewritten after every answer, after [`REMOTE_KEY`]: its CAS tells a VM whether a newer
/// answer is there for the price of reading 8 bytes, not the whole answer. Requests check it,
/// so none routes on an answer older than the one this process holds.
const REMOTE_SEQ_KEY: &str = "pd/remote/seq";
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
pub fn report_body(replica: u64) -> Result<Vec<u8>, String> {
    let ledger = ledger::read(&SharedData).map_err(|e| e.to_string())?;
    Ok(remote::report(&ledger, replica).encode_to_vec())
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

/// Keeps pd-control's answer for every VM of this process, after checking it decodes;
/// returns how many other live replicas it counts.
pub fn store_answer(now_ms: u64, body: &[u8]) -> Result<u32, String> {
    let others = RemoteLoad::decode(body)
        .map_err(|e| format!("replica shares do not decode: {e}"))?
        .replicas;
    let mut value = Vec::with_capacity(8 + body.len());
    value.extend_from_slice(&now_ms.to_le_bytes());
    value.extend_from_slice(body);
    SharedData
        .set(REMOTE_KEY, &value, None)
        .and_then(|_| SharedData.set(REMOTE_SEQ_KEY, &now_ms.to_le_bytes(), None))
        .map(|_| others)
        .map_err(|e| e.to_string())
}

/// Adopts the answer in shared data when it is newer than the VM's view. Cheap when nothing
/// changed (one 8-byte shared-data read), so the request path calls it before every
/// selection: a VM ticking slowly while idle must not score its first requests on an answer
/// up to a tick old.
pub fn adopt_newer(vm: &mut VmState) {
    if !vm.defaults.tokens.shared_ledger {
        return;
    }
    let Ok((Some(_), cas)) = SharedData.get(REMOTE_SEQ_KEY) else {
        return;
    };
    if cas.is_some() && cas == vm.remote_cas {
        return;
    }
    let Ok((Some(value), _)) = SharedData.get(REMOTE_KEY) else {
        return;
    };
    vm.remote_cas = cas;
    vm.remote_at_ms = value
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0);
    let load = value.get(8..).and_then(|b| RemoteLoad::decode(b).ok());
    // Replicas count even while idle: they read this one's load.
    vm.other_replicas = load.as_ref().map_or(0, |r| r.replicas);
    vm.remote = load.filter(|r| !r.is_empty()).map(Arc::new);
}

/// Brings the VM's view of the other replicas up to date on its tick: adopts a newer answer,
/// drops a stale one, and shows the view in the gauges.
pub fn refresh(vm: &mut VmState, now_ms: u64) {
    if !vm.defaults.tokens.shared_ledger {
        vm.remote = None;
        vm.other_replicas = 0;
        return;
    }
    adopt_newer(vm);
    if now_ms.saturating_sub(vm.remote_at_ms) > REMOTE_STALE_MS {
        if vm.remote.is_some() {
            log::warn!(
                "other replicas' decode shares are {} s old (pd-control unreachable?); scoring local load only",
                now_ms.saturating_sub(vm.remote_at_ms) / 1000
            );
        }
        vm.remote = None;
        vm.other_replicas = 0;
    }
    let tokens = vm.remote.as_ref().map_or(0.0, |r| r.total_decode_tokens());
    Metrics::set(vm.metrics.remote_decode_tokens, tokens.round() as u64);
    Metrics::set(vm.metrics.remote_replicas, u64::from(vm.other_replicas));
}
