//! The two legs of a PD pair, per engine: which prefill body goes where, whether the
//! decode request waits for the prefill (vLLM, TRT-LLM context_first) or goes at once
//! (SGLang, TRT-LLM generation_first), how a late prefill failure reaches the client, and
//! the decode watchdog's view of the response.

use crate::core::json_object::{BodyEdit, Spans};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::HttpContext;
use proxy_wasm::types::{Action, BufferType};

use super::{PdHttp, PendingDecode};
use crate::core::charges::HeldCharges;
use crate::core::config::KvConnector;
use crate::core::engine::sglang::{self, Bootstrap};
use crate::core::engine::trtllm::{self, ScheduleStyle, ServerInfo};
use crate::core::engine::{vllm, Engine};
use crate::core::errors::RouteError;
use crate::core::fleet::PodView;
use crate::core::obs::outcome::Outcome;
use crate::core::request::{Endpoint, RoutingRequest};
use crate::core::watchdog::{Watchdog, WatchdogSettings};
use crate::host::legs::{self, AbortCause, AbortOrder, SERVER_INFO_TIMEOUT};
use crate::host::metrics::Metrics;
use crate::host::watchdog::Watched;
use crate::host::{now_ms, Clock};

/// How the decode body is made from the prefill answer (synchronous engines).
#[derive(Debug, Clone, Copy)]
pub enum Merge {
    Vllm(KvConnector),
    /// TRT-LLM context_first; how the client asked to be answered, for a context leg that
    /// finishes the request itself (`trtllm::final_context_answer`).
    Trtllm {
        endpoint: Endpoint,
        stream: bool,
        include_usage: bool,
    },
    /// An engine the router has no adapter for: the client's body as sent.
    Unchanged,
}

/// A prefill (context) leg that runs beside the decode request.
struct AsyncPrefill {
    token: u32,
    rid: Option<String>,
    /// Where the leg went: an abort for `rid` goes there when the request ends first.
    prefill_address: String,
    decode_address: String,
}

/// A `/server_info` lookup that generation_first waits for before sending either leg.
struct ServerInfoCall {
    token: u32,
    id: i64,
    /// The client's body and its members, to splice both legs from once the answer is in
    /// (held in the VM's budget, with the members' index).
    body: crate::core::held_body::HeldBody,
    members: Spans,
    endpoint: Endpoint,
    prefill_address: String,
    /// When the context worker became ready: its `/server_info` is cached for that incarnation.
    prefill_ready_since_ms: u64,
    decode_address: String,
}

/// What generation_first's two legs are made of, once the context worker's `/server_info`
/// is known.
struct GenerationFirst<'a> {
    endpoint: Endpoint,
    raw: &'a [u8],
    members: &'a Spans,
    id: i64,
    prefill_address: &'a str,
    decode_address: &'a str,
}

/// The per-request state of this module.
#[derive(Default)]
pub struct Legs {
    pub watch_settings: WatchdogSettings,
    async_prefill: Option<AsyncPrefill>,
    server_info: Option<ServerInfoCall>,
    /// Response headers went to the client: errors can no longer be a local reply.
    response_started: bool,
    /// The decode pod sent answer bytes, not an error answer held for its rewrite: it has the
    /// prefill's KV (SGLang and TRT-LLM decode workers produce nothing before it arrives).
    body_started: bool,
}

impl Legs {
    /// Whether a `/server_info` lookup holds the request (TRT-LLM `generation_first`, before
    /// either leg is sent).
    pub(super) fn looks_up_server(&self) -> bool {
        self.server_info.is_some()
    }

    /// Drops the body a `/server_info` lookup still holds (the request ended first): its
    /// bytes go back to the VM's budget.
    pub(super) fn drop_held_body(&mut self) {
        self.server_info = None;
    }
}

impl PdHttp {
    /// Whether a pair of `engine` pods always holds the client's body until its prefill
    /// answers: the decode leg is spliced from it then (vLLM, TRT-LLM `context_first`, an
    /// engine without adapter). SGLang's legs go at once; TRT-LLM `generation_first` holds it
    /// only while its context worker's `/server_info` is looked up, when not cached.
    pub(super) fn decode_waits(&self, engine: Engine) -> bool {
        match engine {
            Engine::Sglang => false,
            Engine::Trtllm => {
                self.vm.borrow().engines.defaults.trt_schedule_style
                    != ScheduleStyle::GenerationFirst
            }
            Engine::Vllm | Engine::Other => true,
        }
    }

    /// Starts the legs of the pair: the prefill call, and the decode request now or once
    /// the prefill (or `/server_info`) answered.
    pub(super) fn start_pair(
        &mut self,
        engine: Engine,
        req: RoutingRequest,
        raw: Vec<u8>,
        prefill: &PodView,
        decode: &PodView,
        stand_in: Option<super::stand_in::StandIn>,
    ) -> Result<Action, RouteError> {
        let endpoint = req.endpoint;
        match engine {
            Engine::Sglang => {
                let rid = crate::section!(
                    "sglang.rid",
                    self.vm.borrow_mut().engines.next_rid(&self.request_id)
                );
                let bootstrap = Bootstrap {
                    host: sglang::bootstrap_host(&prefill.ip),
                    port: prefill.sglang_bootstrap_port,
                    room: crate::section!("sglang.room", legs::bootstrap_room()),
                    rid: rid.clone(),
                };
                let (prefill_body, decode_edit) = crate::section!(
                    "sglang.bodies",
                    sglang::legs_edited(&raw, &req.members, &bootstrap)
                );
                let token = self.dispatch_prefill(endpoint, &prefill.address, &prefill_body)?;
                self.legs.async_prefill = Some(AsyncPrefill {
                    token,
                    rid: Some(rid.clone()),
                    prefill_address: prefill.address.clone(),
                    decode_address: decode.address.clone(),
                });
                crate::section!("sglang.watch", self.watch(decode, Some(rid), req.stream));
                crate::section!(
                    "sglang.replace_body",
                    self.edit_body(&decode_edit, raw.len())
                )?;
                crate::section!("sglang.destination", self.route_to(&decode.address))?;
                // A decode pod that refused the connection never joined the bootstrap room:
                // another decode pod of the roleset joins it with the same leg.
                self.name_destinations(&decode.key, &decode.address, stand_in, false);
                Ok(Action::Continue)
            }
            Engine::Trtllm
                if self.vm.borrow().engines.defaults.trt_schedule_style
                    == ScheduleStyle::GenerationFirst =>
            {
                let machine = self.vm.borrow().engines.defaults.trt_machine_id;
                let id = legs::disagg_request_id(machine);
                let cached = self.vm.borrow().engines.server_info(
                    &prefill.address,
                    prefill.ready_since_ms,
                    now_ms(),
                );
                if let Some(info) = cached {
                    self.watch(decode, None, req.stream);
                    let legs = GenerationFirst {
                        endpoint,
                        raw: &raw,
                        members: &req.members,
                        id,
                        prefill_address: &prefill.address,
                        decode_address: &decode.address,
                    };
                    self.send_generation_first(legs, &info)?;
                    return Ok(Action::Continue);
                }
                // The body waits for the lookup: refused (the selection's charges released
                // with the refusal) when the VM holds its budget of bodies already.
                let body = self.hold_body(raw, req.members.heap_bytes())?;
                self.watch(decode, None, req.stream);
                let token = self.dispatch_get(&prefill.address, "/server_info")?;
                self.legs.server_info = Some(ServerInfoCall {
                    token,
                    id,
                    body,
                    members: req.members,
                    endpoint,
                    prefill_address: prefill.address.clone(),
                    prefill_ready_since_ms: prefill.ready_since_ms,
                    decode_address: decode.address.clone(),
                });
                Ok(Action::Pause)
            }
            _ => {
                let (body, merge) = match engine {
                    Engine::Trtllm => {
                        let machine = self.vm.borrow().engines.defaults.trt_machine_id;
                        let id = legs::disagg_request_id(machine);
                        (
                            trtllm::context_body(
                                &raw,
                                &req.members,
                                id,
                                ScheduleStyle::ContextFirst,
                            ),
                            Merge::Trtllm {
                                endpoint,
                                stream: req.stream,
                                include_usage: req.include_usage,
                            },
                        )
                    }
                    Engine::Vllm => {
                        let connector = prefill
                            .kv_connector
                            .unwrap_or(self.vm.borrow().defaults.env.kv_connector);
                        (
                            crate::section!(
                                "vllm.prefill_body",
                                vllm::prefill_body(&raw, &req.members, connector)
                            ),
                            Merge::Vllm(connector),
                        )
                    }
                    _ => (
                        vllm::prefill_body(&raw, &req.members, KvConnector::Mooncake),
                        Merge::Unchanged,
                    ),
                };
                // Held until the prefill answers (`route` checked the room before selecting).
                let raw = self.hold_body(raw, req.members.heap_bytes())?;
                let token = self.dispatch_prefill(endpoint, &prefill.address, &body)?;
                crate::section!("vllm.watch", self.watch(decode, None, req.stream));
                self.pending = Some(PendingDecode {
                    token,
                    body: raw,
                    members: req.members,
                    prefill_ip: prefill.ip.clone(),
                    decode: super::redecode::ChosenDecode {
                        key: decode.key.clone(),
                        roleset: decode.roleset.clone(),
                        address: decode.address.clone(),
                        stand_in,
                    },
                    merge,
                });
                Ok(Action::Pause)
            }
        }
    }

    /// CTX leg in the background, GEN leg forwarded now (generation_first).
    fn send_generation_first(
        &mut self,
        legs: GenerationFirst<'_>,
        info: &ServerInfo,
    ) -> Result<(), RouteError> {
        let GenerationFirst {
            endpoint,
            raw,
            members,
            id,
            prefill_address,
            decode_address,
        } = legs;
        let ctx = trtllm::context_body(raw, members, id, ScheduleStyle::GenerationFirst);
        let token = self.dispatch_prefill(endpoint, prefill_address, &ctx)?;
        self.legs.async_prefill = Some(AsyncPrefill {
            token,
            rid: None,
            prefill_address: prefill_address.to_string(),
            decode_address: decode_address.to_string(),
        });
        self.replace_body(&trtllm::generation_first_body(raw, members, id, info))?;
        self.route_to(decode_address)?;
        Ok(())
    }

    /// Answers of the calls this module made (not the synchronous prefill).
    pub(super) fn on_leg_response(&mut self, token: u32, body_size: usize) {
        let status = crate::host::call_header(":status").unwrap_or_default();
        let body = |max: usize| {
            if status.is_empty() {
                // Envoy failed the call: there is no answer to read.
                return Vec::new();
            }
            hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size.min(max))
                .ok()
                .flatten()
                .unwrap_or_default()
        };
        if self.legs.server_info.as_ref().map(|c| c.token) == Some(token) {
            self.on_server_info(&status, &body(usize::MAX));
        } else if self.legs.async_prefill.as_ref().map(|p| p.token) == Some(token) {
            // A prefill that answered 200 has nothing more to say: its body is read only
            // to explain a failure, and only its first bytes do.
            let body = if status == "200" {
                Vec::new()
            } else {
                body(crate::core::errors::ERROR_BODY_READ_BYTES)
            };
            self.on_async_prefill(&status, &body);
        }
    }

    fn on_server_info(&mut self, status: &str, body: &[u8]) {
        let Some(call) = self.legs.server_info.take() else {
            return;
        };
        let info = if status == "200" {
            trtllm::parse_server_info(body)
        } else {
            Err(format!("/server_info answered status {status:?}"))
        };
        let result = info
            .map_err(|e| RouteError::Selection {
                detail: format!(
                    "TRT-LLM generation_first: context worker {}: {e}",
                    call.prefill_address
                ),
            })
            .and_then(|info| {
                self.vm.borrow_mut().engines.cache_server_info(
                    &call.prefill_address,
                    call.prefill_ready_since_ms,
                    info.clone(),
                    now_ms(),
                );
                let legs = GenerationFirst {
                    endpoint: call.endpoint,
                    raw: &call.body,
                    members: &call.members,
                    id: call.id,
                    prefill_address: &call.prefill_address,
                    decode_address: &call.decode_address,
                };
                self.send_generation_first(legs, &info)
            });
        match result {
            Ok(()) => self.resume_http_request(),
            Err(e) => {
                self.vm.borrow_mut().watched.remove(&self.id);
                self.routed = None;
                self.reject(e);
            }
        }
    }

    fn on_async_prefill(&mut self, status: &str, body: &[u8]) {
        let Some(leg) = self.legs.async_prefill.take() else {
            return;
        };
        let mut clock = Clock::default();
        self.release_stage(HeldCharges::release_prefill_leg, &mut clock);
        self.prefill_returned();
        self.prefill_served(status, &mut clock);
        let success = self.vm.borrow().metrics.prefill_success;
        if status == "200" {
            Metrics::inc(success);
            self.arm_watchdog();
            return;
        }
        let error = RouteError::prefill_answer(status, body, "http_error");
        log::warn!(
            "request {}: {} (prefill pod {})",
            self.request_id,
            crate::core::errors::loggable(&error.to_string()),
            self.served.prefill.as_deref().unwrap_or("-")
        );
        // Unless it is already answering, the decode pod will never get its KV: ask it to drop
        // the request (the stand-in, when the chosen one refused the connection and Envoy
        // retried there) and stop the watchdog.
        let settings = self.legs.watch_settings;
        let decode_address = self.answering_address(&leg.decode_address);
        self.vm.borrow_mut().engines.queue_abort(AbortOrder {
            address: &decode_address,
            rid: leg.rid.as_deref(),
            timeout_s: settings.abort_timeout_s,
            retry_s: settings.abort_retry_delay_s,
            cause: AbortCause::PrefillFailed(RouteError::prefill_failure_class(status, body)),
            streaming: self.legs.response_started,
            authorization: self.forwarded_value("authorization"),
        });
        if self.legs.body_started {
            // The decode pod is producing, so its KV arrived: the prefill failed after the
            // transfer (its answer, not its work). The generation is left to finish, under
            // its watchdog; the failed call counts by its class, as a call failover recovered
            // from does, since the request did not fail.
            self.vm.borrow_mut().metrics.prefill_call_failed(&error);
            self.arm_watchdog();
            log::warn!(
                "request {}: the prefill answer failed after the decode pod began its answer; \
                 letting the answer finish",
                self.request_id
            );
            return;
        }
        self.vm.borrow_mut().watched.remove(&self.id);
        if !self.legs.response_started {
            self.routed = None;
            self.reject(error); // counts the failed leg
            return;
        }
        self.vm.borrow_mut().metrics.prefill_failed(&error);
        // The request's outcome is the prefill's failure, not the cut stream's: the decode pod
        // is not to blame for it, the prefill pod was counted above.
        self.obs.outcome = Some(Outcome::PrefillFailure {
            code: error.status(),
        });

        // The decode pod is already answering and will never get its KV: cut the stream as
        // the watchdog would (the client sees a truncated answer, not a wait for the engine's
        // bootstrap timeout), and the engine cancels the generation as its client leaves.
        if let Err(e) = hostcalls::reset_http_response() {
            log::warn!(
                "request {}: cannot reset the stream: {e:?}",
                self.request_id
            );
        }
    }

    /// At the end of the stream: a prefill leg still out (SGLang's, sent beside the decode
    /// leg) is asked to stop at its pod with `/abort_request` for its rid, unless the client
    /// got a whole 2xx answer (the leg is then finishing its transfer, not wasted work).
    ///
    /// Envoy does not cancel a side call when the stream that made it ends (its upstream
    /// request stays active until the pod answers or the call times out), so without this
    /// a client that left, or a decode pod that failed at once, leaves the prefill pod
    /// holding the request in its bootstrap queue (and then computing it) for nothing.
    /// TRT-LLM's context leg has no rid to abort by; a vLLM prefill leg is a synchronous
    /// side call with nothing but its connection to end it by, which the filter cannot
    /// close (proxy-wasm has no cancel for HTTP calls).
    pub(super) fn abort_abandoned_prefill(&mut self) {
        let Some(leg) = self.legs.async_prefill.take() else {
            return;
        };
        let answered_whole = self.obs.times.end_us.is_some()
            && self
                .obs
                .response_status
                .is_some_and(|s| (200..300).contains(&s));
        if answered_whole || leg.rid.is_none() {
            return;
        }
        log::info!(
            "request {}: ended while its prefill leg still ran; aborting rid {:?} on {}",
            self.request_id,
            leg.rid,
            leg.prefill_address
        );
        let settings = self.legs.watch_settings;
        let authorization = self.forwarded_value("authorization").map(str::to_string);
        self.vm.borrow_mut().engines.queue_abort(AbortOrder {
            address: &leg.prefill_address,
            rid: leg.rid.as_deref(),
            timeout_s: settings.abort_timeout_s,
            retry_s: settings.abort_retry_delay_s,
            cause: AbortCause::PrefillAbandoned,
            streaming: false,
            authorization: authorization.as_deref(),
        });
        // The root context's tick sends it: keep this VM's tick running.
        self.vm.borrow_mut().wake();
    }

    /// Puts the request under the decode watchdog (not yet armed).
    fn watch(&mut self, decode: &PodView, rid: Option<String>, stream: bool) {
        let settings = self.legs.watch_settings;
        if let Some(watchdog) = Watchdog::new(&settings, stream) {
            let watched = Watched {
                watchdog,
                settings,
                request_id: self.request_id.clone(),
                decode_pod: decode.name.clone(),
                decode_address: decode.address.clone(),
                authorization: rid
                    .as_ref()
                    .and_then(|_| self.forwarded_value("authorization"))
                    .map(str::to_string),
                rid,
            };
            self.vm.borrow_mut().watched.insert(self.id, watched);
        }
    }

    /// The prefill succeeded: the decode pod owes the answer from now on.
    pub(super) fn arm_watchdog(&mut self) {
        if let Some(w) = self.vm.borrow_mut().watched.get_mut(&self.id) {
            w.watchdog.arm(crate::host::steady_ms());
        }
    }

    pub(super) fn watch_headers(&mut self) {
        self.legs.response_started = true;
        if let Some(w) = self.vm.borrow_mut().watched.get_mut(&self.id) {
            w.watchdog.on_headers();
        }
    }

    pub(super) fn watch_chunk(&mut self, size: usize, end: bool) {
        if size == 0 && !end {
            return;
        }
        // An error answer held for its rewrite is no generation under way: the decode pod
        // that sends it received no KV (see `on_async_prefill`).
        self.legs.body_started |= size > 0 && self.error_rewrite.is_none();
        if let Some(w) = self.vm.borrow_mut().watched.get_mut(&self.id) {
            let now = if w.watchdog.times_chunks() {
                crate::host::steady_ms()
            } else {
                0
            };
            w.watchdog.on_chunk(now, end);
        }
    }

    /// Replaces the buffered request body and its `content-length` (Envoy does not).
    pub(super) fn replace_body(&self, body: &[u8]) -> Result<(), RouteError> {
        self.splice_body(usize::MAX >> 1, body, body.len())
    }

    /// Makes the buffered request body, the client's `raw_len` bytes as sent, a leg's body:
    /// an edit replaces only its first bytes, in place.
    pub(super) fn edit_body(&self, edit: &BodyEdit, raw_len: usize) -> Result<(), RouteError> {
        match edit {
            BodyEdit::Prefix { replace, with } => {
                self.splice_body(*replace, with, edit.len_from(raw_len))
            }
            BodyEdit::Whole(body) => self.replace_body(body),
        }
    }

    /// Puts `with` in place of the buffered body's first `drain` bytes (Envoy drains them and
    /// prepends; all of the body when `drain` exceeds it) and sets `content-length` to `len`.
    fn splice_body(&self, drain: usize, with: &[u8], len: usize) -> Result<(), RouteError> {
        hostcalls::set_buffer(BufferType::HttpRequestBody, 0, drain, with)
            .map_err(|e| RouteError::Internal(format!("cannot replace the request body: {e:?}")))?;
        self.set_http_request_header("content-length", Some(&len.to_string()));
        Ok(())
    }

    fn route_to(&self, address: &str) -> Result<(), RouteError> {
        let strategy = self
            .routed
            .as_ref()
            .map(|r| r.strategy.clone())
            .unwrap_or_default();
        self.set_destination(address, &strategy)
    }

    /// A `GET` side call to a pod (`/server_info`).
    fn dispatch_get(&self, address: &str, path: &str) -> Result<u32, RouteError> {
        self.guard_target(address)?;
        let (dst_header, cluster) = {
            let vm = self.vm.borrow();
            (vm.plugin.dst_header.clone(), vm.plugin.pods_cluster.clone())
        };
        let mut headers: Vec<(&str, &str)> = vec![
            (":method", "GET"),
            (":path", path),
            (":authority", address),
            ("x-request-id", &self.request_id),
            (dst_header.as_str(), address),
        ];
        if dst_header != super::ENVOY_DST_HEADER {
            headers.push((super::ENVOY_DST_HEADER, address));
        }
        hostcalls::dispatch_http_call(&cluster, headers, None, vec![], SERVER_INFO_TIMEOUT).map_err(
            |e| RouteError::Selection {
                detail: format!("cannot ask {address} for {path}: {e:?}"),
            },
        )
    }
}
