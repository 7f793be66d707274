//! The floor of a PD hop in Envoy with a Proxy-Wasm filter, for `make bench`: the least a
//! filter can do to send a request through a prefill pod and a decode pod, with none of
//! pd-router's work: no selection, no ledger, no metrics, no headers on the response, no
//! checks. Both pods are fixed by the plugin configuration,
//! `{"prefill": "ip:port", "decode": "ip:port", "cluster": "pd_pods", "dst_header": "target-pod"}`,
//! plus `"protocol": "sglang", "bootstrap_port": N` for SGLang's order.
//!
//! - vLLM (default): the prefill leg first; its answer's `kv_transfer_params` is copied
//!   verbatim into the decode body (engines that name their own host in it, as pd-sim's
//!   `--side-channel-host pod`), then the decode leg.
//! - SGLang: both legs at once, carrying the same `bootstrap_host` / `bootstrap_port` /
//!   `bootstrap_room`; the prefill answer is dropped (the decode pod waits for the KV itself).
//!
//! pd-router's Envoy CPU per request minus this filter's is what our own code costs; this
//! filter's minus plain Envoy's is what the architecture costs (a wasm VM on the request path
//! and a second upstream exchange through Envoy's async HTTP client). Not a product: it skips
//! every check pd-router makes.

use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(FloorRoot::default()) });
}}

#[derive(Default, serde::Deserialize)]
#[serde(default)]
struct FloorConfig {
    prefill: String,
    decode: String,
    cluster: String,
    dst_header: String,
    protocol: String,
    bootstrap_port: u16,
}

impl FloorConfig {
    fn sglang(&self) -> bool {
        self.protocol == "sglang"
    }
}

#[derive(Default)]
struct FloorRoot {
    /// Shared with every request, not copied into it: the floor allocates as little as it can.
    config: Rc<FloorConfig>,
    /// SGLang bootstrap rooms: a random start (rooms must not repeat across the VMs of the
    /// gateway) counted up per request, within SGLang's `[0, 2^63)`.
    next_room: Rc<std::cell::Cell<u64>>,
}

impl Context for FloorRoot {}

impl RootContext for FloorRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(raw) = self.get_plugin_configuration() else {
            return false;
        };
        match serde_json::from_slice::<FloorConfig>(&raw) {
            Ok(config) if !config.prefill.is_empty() && !config.decode.is_empty() => {
                self.config = Rc::new(config);
                let seed = std::hash::BuildHasher::hash_one(
                    &std::collections::hash_map::RandomState::new(),
                    0u8,
                );
                self.next_room.set(seed >> 1);
                true
            }
            _ => {
                log::error!("pd_floor needs {{\"prefill\": ..., \"decode\": ...}}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(FloorHttp {
            config: self.config.clone(),
            next_room: self.next_room.clone(),
            path: String::new(),
            body: Vec::new(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct FloorHttp {
    config: Rc<FloorConfig>,
    next_room: Rc<std::cell::Cell<u64>>,
    path: String,
    body: Vec<u8>,
}

#[derive(serde::Deserialize)]
struct PrefillAnswer<'a> {
    #[serde(borrow)]
    kv_transfer_params: Option<&'a serde_json::value::RawValue>,
}

impl Context for FloorHttp {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, size: usize, _: usize) {
        if self.config.sglang() {
            return;
        }
        let answer = self
            .get_http_call_response_body(0, size)
            .unwrap_or_default();
        let params = serde_json::from_slice::<PrefillAnswer>(&answer)
            .ok()
            .and_then(|a| a.kv_transfer_params);
        let end = self.body.iter().rposition(|&b| b == b'}');
        if let (Some(params), Some(end)) = (params, end) {
            let mut decode = Vec::with_capacity(self.body.len() + params.get().len() + 24);
            decode.extend_from_slice(&self.body[..end]);
            decode.extend_from_slice(b",\"kv_transfer_params\":");
            decode.extend_from_slice(params.get().as_bytes());
            decode.push(b'}');
            self.set_http_request_body(0, self.body.len(), &decode);
            self.set_http_request_header("content-length", Some(&decode.len().to_string()));
        }
        let (header, decode) = (&self.config.dst_header, &self.config.decode);
        self.set_http_request_header(header, Some(decode));
        self.resume_http_request();
    }
}

impl HttpContext for FloorHttp {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        self.path = self.get_http_request_header(":path").unwrap_or_default();
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        self.body = self.get_http_request_body(0, size).unwrap_or_default();
        let Some(end) = self.body.iter().rposition(|&b| b == b'}') else {
            self.send_http_response(400, vec![], None);
            return Action::Pause;
        };
        let mut leg = Vec::with_capacity(self.body.len() + 96);
        leg.extend_from_slice(&self.body[..end]);
        if self.config.sglang() {
            // Both legs carry the same bootstrap fields; the decode leg goes on at once.
            let room = self.next_room.get();
            self.next_room.set(room.wrapping_add(1) & (u64::MAX >> 1));
            let host = self.config.prefill.rsplit_once(':').map_or("", |(h, _)| h);
            let fields = format!(
                ",\"bootstrap_host\":\"{host}\",\"bootstrap_port\":{},\"bootstrap_room\":{room}}}",
                self.config.bootstrap_port
            );
            leg.extend_from_slice(fields.as_bytes());
            self.set_http_request_body(0, self.body.len(), &leg);
            self.set_http_request_header("content-length", Some(&leg.len().to_string()));
            let (header, decode) = (&self.config.dst_header, &self.config.decode);
            self.set_http_request_header(header, Some(decode));
        } else {
            // The prefill leg is the client's body asking for a remote decode (the load
            // generator already sends `max_tokens` 1 and no stream, which the leg needs).
            leg.extend_from_slice(b",\"kv_transfer_params\":{\"do_remote_decode\":true}}");
        }
        let prefill = self.config.prefill.as_str();
        let headers = vec![
            (":method", "POST"),
            (":path", self.path.as_str()),
            (":authority", prefill),
            ("content-type", "application/json"),
            (self.config.dst_header.as_str(), prefill),
        ];
        match self.dispatch_http_call(
            &self.config.cluster,
            headers,
            Some(&leg),
            vec![],
            Duration::from_secs(120),
        ) {
            Ok(_) if self.config.sglang() => Action::Continue,
            Ok(_) => Action::Pause,
            Err(e) => {
                log::error!("pd_floor: prefill dispatch failed: {e:?}");
                self.send_http_response(503, vec![], None);
                Action::Pause
            }
        }
    }
}
