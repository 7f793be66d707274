//! What each Proxy-Wasm host call costs in Envoy, for `envoy/callgrind.sh`: once a request's
//! body is in, it makes each kind of call a known number of times (the counts below) and gets
//! a local 200, so that a callgrind profile of Envoy, whose binary is stripped, names each of
//! Envoy's host functions by how often it ran per request. Not a product.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};

/// Calls per request of each kind: powers of two, so that a host function of Envoy that
/// serves several kinds is named by the sum of their counts. The local reply is the 1.
/// `envoy/callgrind-report.py` (`PROBE_KINDS`) lists the kinds in this order.
pub const GET_SHARED: usize = 2;
pub const GET_PROPERTY: usize = 4;
pub const GET_HEADER: usize = 8;
pub const GET_HEADER_MAP: usize = 16;
pub const GET_BODY: usize = 32;
pub const SET_BODY: usize = 64;
pub const SET_SHARED: usize = 128;
pub const SET_PROPERTY: usize = 256;
pub const SET_HEADER: usize = 512;
pub const RECORD_METRIC: usize = 1024;
pub const INCREMENT_METRIC: usize = 2048;
pub const GET_TIME: usize = 4096;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(ProbeRoot::default()) });
}}

#[derive(Default)]
struct ProbeRoot {
    counter: u32,
    histogram: u32,
}

impl Context for ProbeRoot {}

impl RootContext for ProbeRoot {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        self.counter = hostcalls::define_metric(MetricType::Counter, "probe_counter").unwrap_or(0);
        self.histogram =
            hostcalls::define_metric(MetricType::Histogram, "probe_histogram").unwrap_or(0);
        let _ = hostcalls::set_shared_data("probe", Some(&[7u8; 64]), None);
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(ProbeHttp {
            counter: self.counter,
            histogram: self.histogram,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct ProbeHttp {
    counter: u32,
    histogram: u32,
}

impl Context for ProbeHttp {}

impl HttpContext for ProbeHttp {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        // Hold the request until its body is in (no upstream is ever picked).
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
        for _ in 0..GET_SHARED {
            let _ = hostcalls::get_shared_data("probe");
        }
        for _ in 0..GET_PROPERTY {
            let _ = self.get_property(vec!["request", "path"]);
        }
        for _ in 0..GET_HEADER {
            let _ = self.get_http_request_header(":path");
        }
        for _ in 0..GET_HEADER_MAP {
            let _ = self.get_http_request_headers_bytes();
        }
        let mut body = Vec::new();
        for _ in 0..GET_BODY {
            body = self.get_http_request_body(0, size).unwrap_or_default();
        }
        for _ in 0..SET_BODY {
            self.set_http_request_body(0, body.len(), &body);
        }
        for _ in 0..SET_SHARED {
            let _ = hostcalls::set_shared_data("probe", Some(&[7u8; 64]), None);
        }
        for _ in 0..SET_PROPERTY {
            self.set_property(vec!["probe_state"], Some(b"pod-0"));
        }
        for _ in 0..SET_HEADER {
            self.set_http_request_header("x-probe", Some("value"));
        }
        for i in 0..RECORD_METRIC {
            let _ = hostcalls::record_metric(self.histogram, 40 + i as u64);
        }
        for _ in 0..INCREMENT_METRIC {
            let _ = hostcalls::increment_metric(self.counter, 1);
        }
        for _ in 0..GET_TIME {
            let _ = self.get_current_time();
        }
        self.send_http_response(200, vec![], Some(b"probe\n"));
        Action::Pause
    }
}
