//! The per-pod request log behind `GET /sim/requests`: what each pod was sent and what it
//! answered, so end-to-end tests can assert on the router's behaviour from the pods' side
//! (which pod got which leg, with which headers and `kv_transfer_params`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use pd_control::fleet::PodRecord;
use serde::Serialize;
use serde_json::Value;

/// One request as a pod saw it. Field names are the JSON schema of `/sim/requests`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LogEntry {
    /// Process-wide sequence number: unique across pods and increasing in arrival order.
    pub seq: u64,
    pub pod: String,
    pub namespace: String,
    pub role: String,
    pub roleset: String,
    /// The pod's serving `ip:port`.
    pub addr: String,
    pub path: String,
    /// `prefill`, `decode` or `full`; `null` when the request was rejected before it could be
    /// classified (bad JSON, unknown model, invalid fields).
    pub leg: Option<String>,
    pub x_request_id: Option<String>,
    pub stream: bool,
    pub status: u16,
    /// The error message answered, when `status` is not 200.
    pub error: Option<String>,
    pub kv_transfer_params_in: Option<Value>,
    pub kv_transfer_params_out: Option<Value>,
    /// Decode legs only: `ok` when the params named a prefill pod this simulator serves, with its
    /// IP as `remote_host`, and blocks still pinned there; otherwise why the pull failed
    /// (`unknown_engine`, `host_mismatch`, `unknown_request`) and the pod recomputed the prefill.
    pub kv_pull: Option<String>,
    /// Header names lower-cased; repeated headers joined with `, `.
    pub headers: BTreeMap<String, String>,
    pub body: Option<Value>,
    pub received_unix_ms: u64,
    /// The fault armed through `/sim/faults` that this request drew (`hang_before_headers`,
    /// `status`, ...), if any.
    pub fault: Option<String>,
    /// SGLang and TRT-LLM legs: the disaggregation fields the pod acted on (bootstrap
    /// host/port/room and rid; request type, schedule style and ids); `/abort_request`: the
    /// rid and how many requests it ended.
    pub pd: Option<Value>,
    /// The client (the gateway) went away before the answer was complete: its connection
    /// closed while the pod still computed or sent it (`crate::departure`). A real vLLM
    /// aborts such a request; one that never noticed would compute the whole prefill and pin
    /// its KV blocks for a decode leg that never comes.
    pub client_gone: bool,
}

impl LogEntry {
    /// A fresh entry for a request to `record`'s pod on `path`, answered 200 unless changed.
    pub fn new(record: &PodRecord, path: &str, headers: &HeaderMap) -> LogEntry {
        LogEntry {
            seq: next_seq(),
            pod: record.name.clone(),
            namespace: record.namespace.clone(),
            role: record.role.clone(),
            roleset: record.roleset.clone(),
            addr: record.address(),
            path: path.to_string(),
            leg: None,
            x_request_id: headers
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            stream: false,
            status: 200,
            error: None,
            kv_transfer_params_in: None,
            kv_transfer_params_out: None,
            kv_pull: None,
            headers: header_map(headers),
            body: None,
            received_unix_ms: unix_ms(),
            fault: None,
            pd: None,
            client_gone: false,
        }
    }
}

static NEXT_SEQ: AtomicU64 = AtomicU64::new(1);

/// The next process-wide sequence number.
pub fn next_seq() -> u64 {
    NEXT_SEQ.fetch_add(1, Ordering::Relaxed)
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Headers as a sorted map of lower-case names (which `HeaderMap` already guarantees).
pub fn header_map(headers: &HeaderMap) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in headers {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        out.entry(name.as_str().to_string())
            .and_modify(|v| {
                v.push_str(", ");
                v.push_str(&value);
            })
            .or_insert(value);
    }
    out
}

/// A bounded, ordered log. When full the oldest entries go, so a long load run cannot grow
/// the simulator without limit.
#[derive(Debug)]
pub struct RequestLog {
    limit: usize,
    entries: Mutex<VecDeque<LogEntry>>,
}

impl RequestLog {
    pub fn new(limit: usize) -> Self {
        RequestLog {
            limit: limit.max(1),
            entries: Mutex::new(VecDeque::new()),
        }
    }

    /// Appends an entry, keeping the log sorted by `seq` even when entries are recorded out of
    /// arrival order (a slow parse can finish after a later request's).
    pub fn push(&self, entry: LogEntry) {
        let mut entries = self.lock();
        let at = entries
            .iter()
            .rposition(|e| e.seq < entry.seq)
            .map_or(0, |i| i + 1);
        entries.insert(at, entry);
        while entries.len() > self.limit {
            entries.pop_front();
        }
    }

    /// Changes the entry `seq` in place (an outcome known only after it was logged, such as
    /// a rendezvous that completed or timed out). A no-op once the entry left the log.
    pub fn update(&self, seq: u64, change: impl FnOnce(&mut LogEntry)) {
        if let Some(e) = self.lock().iter_mut().rev().find(|e| e.seq == seq) {
            change(e);
        }
    }

    pub fn snapshot(&self) -> Vec<LogEntry> {
        self.lock().iter().cloned().collect()
    }

    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<LogEntry>> {
        // A panic while holding the lock cannot leave a VecDeque half-updated in a way that
        // matters here, so recover the data rather than poisoning every later request.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64) -> LogEntry {
        LogEntry {
            seq,
            pod: "p".into(),
            namespace: "default".into(),
            role: "prefill".into(),
            roleset: "r".into(),
            addr: "127.0.0.1:1".into(),
            path: "/v1/completions".into(),
            leg: Some("full".into()),
            x_request_id: None,
            stream: false,
            status: 200,
            error: None,
            kv_transfer_params_in: None,
            kv_transfer_params_out: None,
            kv_pull: None,
            headers: BTreeMap::new(),
            body: None,
            received_unix_ms: 0,
            fault: None,
            pd: None,
            client_gone: false,
        }
    }

    #[test]
    fn ordered_bounded_and_clearable() {
        let log = RequestLog::new(2);
        log.push(entry(2));
        log.push(entry(1));
        assert_eq!(
            log.snapshot().iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![1, 2]
        );
        log.push(entry(3));
        assert_eq!(
            log.snapshot().iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![2, 3]
        );
        log.clear();
        assert!(log.snapshot().is_empty());
    }

    #[test]
    fn headers_lower_case_and_joined() {
        let mut h = HeaderMap::new();
        h.append("X-Request-Id", "a".parse().unwrap());
        h.append("accept", "x".parse().unwrap());
        h.append("accept", "y".parse().unwrap());
        let m = header_map(&h);
        assert_eq!(m.get("x-request-id").map(String::as_str), Some("a"));
        assert_eq!(m.get("accept").map(String::as_str), Some("x, y"));
    }

    #[test]
    fn entry_serializes_with_schema_field_names() {
        let v = serde_json::to_value(entry(7)).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        for k in [
            "seq",
            "pod",
            "namespace",
            "role",
            "roleset",
            "addr",
            "path",
            "leg",
            "x_request_id",
            "stream",
            "status",
            "error",
            "kv_transfer_params_in",
            "kv_transfer_params_out",
            "kv_pull",
            "headers",
            "body",
            "received_unix_ms",
            "fault",
            "pd",
            "client_gone",
        ] {
            assert!(keys.contains(&k), "{k}");
        }
    }
}
