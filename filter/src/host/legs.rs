//! Side calls of the engine protocols that are not the prefill leg itself: the TRT-LLM
//! context worker's `/server_info` (cached), `/abort_request` to an SGLang decode pod, and
//! the ids that pair two legs (SGLang room and rid, TRT-LLM Snowflake id).

use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{MetricType, Status};

use crate::core::engine::trtllm::{self, ServerInfo};
use crate::core::engine::{sglang, EngineDefaults};
use crate::host::metrics::Metrics;
use crate::host::{now_ms, random_seed};

/// `/server_info` lookups: 3 s, cached a minute per pod.
pub const SERVER_INFO_TIMEOUT: Duration = Duration::from_secs(3);
const SERVER_INFO_TTL_MS: u64 = 60_000;
/// Shared-data key of the Snowflake counter every worker of the process draws from.
const TRT_COUNTER_KEY: &str = "pd-router/trt-counter";

/// An `/abort_request` still to be sent (or sent again).
#[derive(Debug, Clone)]
pub struct PendingAbort {
    pub address: String,
    pub rid: String,
    pub timeout: Duration,
    pub retry_delay_ms: u64,
    pub attempt: u32,
    pub due_ms: u64,
}

/// Per-VM state of the engine protocols.
pub struct EngineState {
    pub defaults: EngineDefaults,
    server_info: hashbrown::HashMap<String, (ServerInfo, u64)>,
    aborts: Vec<PendingAbort>,
    abort_calls: hashbrown::HashMap<u32, PendingAbort>,
    rid_random: u32,
    rid_counter: u32,
    abort_ok: Option<u32>,
    abort_error: Option<u32>,
    abort_skipped: Option<u32>,
}

impl EngineState {
    pub fn new(defaults: EngineDefaults) -> EngineState {
        EngineState {
            defaults,
            server_info: hashbrown::HashMap::new(),
            aborts: Vec::new(),
            abort_calls: hashbrown::HashMap::new(),
            rid_random: random_seed() as u32,
            rid_counter: 0,
            abort_ok: None,
            abort_error: None,
            abort_skipped: None,
        }
    }

    /// Defines this VM's metric ids (`gateway_pd_decode_abort_total{result}`).
    pub fn define_metrics(&mut self) {
        let define = |r: &str| {
            hostcalls::define_metric(
                MetricType::Counter,
                &crate::core::obs::labels::tagged(
                    "gateway_pd_decode_abort_total",
                    &[("result", r)],
                ),
            )
            .ok()
        };
        self.abort_ok = define("ok");
        self.abort_error = define("error");
        self.abort_skipped = define("skipped_no_rid");
    }

    /// The SGLang `rid` of a request.
    pub fn next_rid(&mut self, request_id: &str) -> String {
        self.rid_counter = self.rid_counter.wrapping_add(1);
        sglang::rid(request_id, self.rid_random, self.rid_counter)
    }

    /// A cached `/server_info` of the pod at `address`, while fresh.
    pub fn server_info(&self, address: &str, now: u64) -> Option<ServerInfo> {
        self.server_info
            .get(address)
            .filter(|(_, expires)| *expires > now)
            .map(|(info, _)| info.clone())
    }

    pub fn cache_server_info(&mut self, address: &str, info: ServerInfo, now: u64) {
        self.server_info.retain(|_, (_, expires)| *expires > now);
        self.server_info
            .insert(address.to_string(), (info, now + SERVER_INFO_TTL_MS));
    }

    /// Queues an abort of `rid` on the decode pod at `address` (sent on the next tick by
    /// the root context, whose calls outlive the request's own context).
    pub fn queue_abort(&mut self, address: &str, rid: Option<&str>, timeout_s: f64, retry_s: f64) {
        let Some(rid) = rid else {
            Metrics::inc(self.abort_skipped);
            return;
        };
        if timeout_s <= 0.0 {
            return; // AIBRIX_DECODE_ABORT_TIMEOUT=0 turns aborts off
        }
        self.aborts.push(PendingAbort {
            address: address.to_string(),
            rid: rid.to_string(),
            timeout: Duration::from_secs_f64(timeout_s),
            retry_delay_ms: (retry_s * 1000.0) as u64,
            attempt: 0,
            due_ms: 0,
        });
    }

    /// Sends the aborts that are due; called from the root context.
    pub fn send_due_aborts(&mut self, cluster: &str, dst_header: &str, now: u64) {
        let (due, later): (Vec<_>, Vec<_>) = self.aborts.drain(..).partition(|a| a.due_ms <= now);
        self.aborts = later;
        for mut a in due {
            a.attempt += 1;
            let body = serde_json::json!({"rid": a.rid}).to_string();
            let mut headers = vec![
                (":method", "POST"),
                (":path", "/abort_request"),
                (":authority", a.address.as_str()),
                ("content-type", "application/json"),
                (dst_header, a.address.as_str()),
            ];
            if dst_header != "x-envoy-original-dst-host" {
                headers.push(("x-envoy-original-dst-host", a.address.as_str()));
            }
            match hostcalls::dispatch_http_call(
                cluster,
                headers,
                Some(body.as_bytes()),
                vec![],
                a.timeout,
            ) {
                Ok(token) => {
                    self.abort_calls.insert(token, a);
                }
                Err(e) => {
                    log::warn!("cannot send /abort_request to {}: {e:?}", a.address);
                    self.abort_failed(a, now);
                }
            }
        }
    }

    /// The answer to an abort call; false when `token` is not one.
    pub fn on_abort_response(&mut self, token: u32, status: &str, now: u64) -> bool {
        let Some(a) = self.abort_calls.remove(&token) else {
            return false;
        };
        if status == "200" {
            Metrics::inc(self.abort_ok);
            log::info!("aborted rid {} on {}", a.rid, a.address);
        } else {
            log::warn!(
                "/abort_request of rid {} on {} answered {status:?}",
                a.rid,
                a.address
            );
            self.abort_failed(a, now);
        }
        true
    }

    fn abort_failed(&mut self, mut a: PendingAbort, now: u64) {
        if a.attempt < 2 && a.retry_delay_ms > 0 {
            a.due_ms = now + a.retry_delay_ms;
            self.aborts.push(a);
        } else {
            Metrics::inc(self.abort_error);
        }
    }
}

/// A fresh SGLang bootstrap room from the CSPRNG (WASI `random_get`).
pub fn bootstrap_room() -> u64 {
    loop {
        let mut buf = [0u8; 8];
        let random = match getrandom::fill(&mut buf) {
            Ok(()) => u64::from_le_bytes(buf),
            Err(_) => random_seed(),
        };
        if let Some(room) = sglang::room(random) {
            return room;
        }
    }
}

/// Creates the Snowflake counter before workers race on it (a CAS on a missing key is
/// ignored by Envoy).
pub fn ensure_trt_counter() {
    if let Ok((None, _)) = hostcalls::get_shared_data(TRT_COUNTER_KEY) {
        let _ = hostcalls::set_shared_data(TRT_COUNTER_KEY, Some(&0u64.to_le_bytes()), None);
    }
}

/// The next `disagg_request_id`, its 12-bit counter shared by all workers of the process.
pub fn disagg_request_id(machine_id: u16) -> i64 {
    let counter = loop {
        let Ok((value, cas)) = hostcalls::get_shared_data(TRT_COUNTER_KEY) else {
            break random_seed();
        };
        let current = value
            .and_then(|v| v.get(..8).and_then(|b| b.try_into().ok()))
            .map(u64::from_le_bytes)
            .unwrap_or(0);
        let next = current.wrapping_add(1);
        match hostcalls::set_shared_data(TRT_COUNTER_KEY, Some(&next.to_le_bytes()), cas) {
            Ok(()) => break next,
            Err(Status::CasMismatch) => continue,
            Err(_) => break random_seed(),
        }
    };
    trtllm::snowflake(now_ms(), machine_id, counter.wrapping_sub(1))
}
