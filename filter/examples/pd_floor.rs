//! The floor of a PD hop in Envoy with a Proxy-Wasm filter, for `make bench`: the least a
//! filter can do to send a request through a prefill pod and then a decode pod (vLLM's order),
//! with none of pd-router's work: no selection, no ledger, no metrics, no headers on the
//! response, no checks. The prefill answer's `kv_transfer_params` is copied verbatim into the
//! decode body (engines that name their own host in it, as pd-sim's `--side-channel-host pod`). Both pods are fixed by the plugin configuration,
//! `{"prefill": "ip:port", "decode": "ip:port", "cluster": "pd_pods", "dst_header": "target-pod"}`.
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
}

#[derive(Default)]
struct FloorRoot {
    /// Shared with every request, not copied into it: the floor allocates as little as it can.
    config: Rc<FloorConfig>,
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
        // The prefill leg is the client's body asking for a remote decode (the load generator
        // already sends `max_tokens` 1 and no stream, which the leg needs).
        let Some(end) = self.body.iter().rposition(|&b| b == b'}') else {
            self.send_http_response(400, vec![], None);
            return Action::Pause;
        };
        let mut leg = Vec::with_capacity(self.body.len() + 48);
        leg.extend_from_slice(&self.body[..end]);
        leg.extend_from_slice(b",\"kv_transfer_params\":{\"do_remote_decode\":true}}");
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
            Ok(_) => Action::Pause,
            Err(e) => {
                log::error!("pd_floor: prefill dispatch failed: {e:?}");
                self.send_http_response(503, vec![], None);
                Action::Pause
            }
        }
    }
}
