//! Side calls of the engine protocols that are not the prefill leg itself: the TRT-LLM
//! context worker's `/server_info` (cached), `/abort_request` to an SGLang decode pod, and
//! the ids that pair two legs (SGLang room and rid, TRT-LLM Snowflake id).

use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{MetricType, Status};

use crate::core::call_timeout::call_timeout;
use crate::core::engine::trtllm::{self, ServerInfo, ServerInfoCache};
use crate::core::engine::{sglang, EngineDefaults};
use crate::core::watchdog::Phase;
use crate::host::metrics::Metrics;
use crate::host::{now_ms, random_seed};

/// `/server_info` lookups: 3 s, cached a minute per pod.
pub const SERVER_INFO_TIMEOUT: Duration = Duration::from_secs(3);
/// Shared-data key of the Snowflake counter every worker of the process draws from.
const TRT_COUNTER_KEY: &str = "pd-router/trt-counter";

/// An `/abort_request` still to be sent (or sent again).
#[derive(Debug, Clone)]
pub struct PendingAbort {
    pub address: String,
    pub rid: String,
    pub timeout: Duration,
    /// 0: one attempt only.
    pub retry_delay_ms: u64,
    pub attempt: u32,
    pub due_ms: u64,
    /// Why the decode request is aborted ([`AbortCause::class`]), the metric's
    /// `prefill_failure_class`.
    pub class: &'static str,
    /// See [`AbortOrder::authorization`].
    pub authorization: Option<String>,
}

/// Why a decode request is aborted, as AIBrix labels it in
/// `gateway_pd_decode_abort_total{prefill_failure_class}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortCause {
    /// The prefill leg failed terminally; the class of its failure (`transport`, `timeout`,
    /// `http_status`).
    PrefillFailed(&'static str),
    /// The decode watchdog fired in this phase.
    Watchdog(Phase),
    /// Not a decode abort: the request ended (its client left, or the decode pod's error
    /// answered it) while its SGLang prefill leg still ran; the prefill pod drops it.
    /// Counted in `pd_router_prefill_aborts_total`, not in AIBrix's decode-abort family.
    PrefillAbandoned,
}

impl AbortCause {
    pub fn class(self) -> &'static str {
        match self {
            AbortCause::PrefillFailed(class) => class,
            AbortCause::Watchdog(Phase::FirstResponse) => "watchdog_first_response",
            AbortCause::Watchdog(Phase::StreamIdle) => "watchdog_stream_idle",
            AbortCause::PrefillAbandoned => "prefill_abandoned",
        }
    }
}

/// The abort of one decode request: where, which `rid`, and the per-request knobs.
#[derive(Debug, Clone, Copy)]
pub struct AbortOrder<'a> {
    pub address: &'a str,
    pub rid: Option<&'a str>,
    pub timeout_s: f64,
    /// Delay before the second attempt; 0 = one attempt.
    pub retry_s: f64,
    pub cause: AbortCause,
    /// The decode pod already sent response bytes: AIBrix skips the abort then
    /// (`skipped_streaming`), since the engine is producing.
    pub streaming: bool,
    /// The client's `authorization`, which the decode leg carried: an engine started with
    /// `--api-key` refuses an abort without it (SGLang guards every route but health and
    /// metrics).
    pub authorization: Option<&'a str>,
}

/// Per-VM state of the engine protocols.
pub struct EngineState {
    pub defaults: EngineDefaults,
    server_info: ServerInfoCache,
    aborts: Vec<PendingAbort>,
    abort_calls: hashbrown::HashMap<u32, PendingAbort>,
    rid_random: u32,
    rid_counter: u32,
    /// `gateway_pd_decode_abort_total{result, prefill_failure_class}`, defined on first use.
    abort_counters: hashbrown::HashMap<(&'static str, &'static str), Option<u32>>,
}

impl EngineState {
    /// Aborts waiting for their due time (the root tick sends them).
    pub fn has_queued_aborts(&self) -> bool {
        !self.aborts.is_empty()
    }

    pub fn new(defaults: EngineDefaults) -> EngineState {
        EngineState {
            defaults,
            server_info: ServerInfoCache::default(),
            aborts: Vec::new(),
            abort_calls: hashbrown::HashMap::new(),
            rid_random: random_seed() as u32,
            rid_counter: 0,
            abort_counters: hashbrown::HashMap::new(),
        }
    }

    /// Counts one abort outcome: `ok`, `error`, or why none was sent (`skipped_*`). A
    /// prefill leg's abort has a family of its own, `pd_router_prefill_aborts_total{result}`:
    /// AIBrix's decode-abort family means a failed exchange, and alerts on it must not fire
    /// for every client that leaves while its prompt is prefilled.
    fn count_abort(&mut self, result: &'static str, class: &'static str) {
        let id = *self
            .abort_counters
            .entry((result, class))
            .or_insert_with(|| {
                let name = if class == AbortCause::PrefillAbandoned.class() {
                    crate::core::obs::labels::tagged(
                        "pd_router_prefill_aborts_total",
                        &[("result", result)],
                    )
                } else {
                    crate::core::obs::labels::tagged(
                        "gateway_pd_decode_abort_total",
                        &[("result", result), ("prefill_failure_class", class)],
                    )
                };
                hostcalls::define_metric(MetricType::Counter, &name).ok()
            });
        Metrics::inc(id);
    }

    /// The SGLang `rid` of a request.
    pub fn next_rid(&mut self, request_id: &str) -> String {
        self.rid_counter = self.rid_counter.wrapping_add(1);
        sglang::rid(request_id, self.rid_random, self.rid_counter)
    }

    /// A cached `/server_info` of the context worker at `address` (ready since
    /// `ready_since_ms`), while fresh.
    pub fn server_info(&self, address: &str, ready_since_ms: u64, now: u64) -> Option<ServerInfo> {
        self.server_info.get(address, ready_since_ms, now).cloned()
    }

    pub fn cache_server_info(
        &mut self,
        address: &str,
        ready_since_ms: u64,
        info: ServerInfo,
        now: u64,
    ) {
        self.server_info.put(address, ready_since_ms, info, now);
    }

    /// Queues an abort of a decode request (sent on the next tick by the root context, whose
    /// calls outlive the request's own context), or counts why none is sent.
    pub fn queue_abort(&mut self, order: AbortOrder<'_>) {
        let class = order.cause.class();
        let Some(rid) = order.rid else {
            return self.count_abort("skipped_no_rid", class);
        };
        if order.streaming {
            return self.count_abort("skipped_streaming", class);
        }
        if order.timeout_s <= 0.0 {
            return; // AIBRIX_DECODE_ABORT_TIMEOUT=0 turns aborts off
        }
        self.aborts.push(PendingAbort {
            address: order.address.to_string(),
            rid: rid.to_string(),
            timeout: call_timeout(order.timeout_s),
            // `as` saturates: a huge delay is "never", not a wrap.
            retry_delay_ms: (order.retry_s.max(0.0) * 1000.0) as u64,
            attempt: 0,
            due_ms: 0,
            class,
            authorization: order.authorization.map(str::to_string),
        });
    }

    /// Sends the aborts that are due to pods that `in_fleet` still knows; called from the
    /// root context. An abort for a pod that left the fleet is dropped (`skipped_no_target`):
    /// its address may already belong to another workload, and nothing else is ever sent
    /// outside the fleet.
    pub fn send_due_aborts(
        &mut self,
        cluster: &str,
        dst_header: &str,
        now: u64,
        in_fleet: impl Fn(&str) -> bool,
    ) {
        let (due, later): (Vec<_>, Vec<_>) = self.aborts.drain(..).partition(|a| a.due_ms <= now);
        self.aborts = later;
        for mut a in due {
            if !in_fleet(&a.address) {
                log::warn!(
                    "not sending /abort_request of rid {} to {}: no longer a pod of the fleet",
                    a.rid,
                    a.address
                );
                self.count_abort("skipped_no_target", a.class);
                continue;
            }
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
            if let Some(value) = a.authorization.as_deref() {
                headers.push(("authorization", value));
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
            self.count_abort("ok", a.class);
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
            a.due_ms = now.saturating_add(a.retry_delay_ms);
            self.aborts.push(a);
        } else {
            self.count_abort("error", a.class);
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
    let mut attempts = 0;
    let counter = loop {
        // Losing the CAS this often means something is wrong; a random counter keeps the
        // request going (the id stays unique with high probability).
        attempts += 1;
        if attempts > 64 {
            break random_seed();
        }
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
