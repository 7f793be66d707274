//! pd-router filter: a Proxy-Wasm HTTP filter that routes OpenAI-style LLM requests across
//! prefill/decode-disaggregated engine pods.
//!
//! `core` is the pure routing logic; `host` is the thin proxy-wasm glue around it.

pub mod core;
#[cfg(all(target_arch = "wasm32", not(test)))]
pub mod host;

/// Types generated from `proto/snapshot.proto`.
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/pdrouter.snapshot.v1.rs"));
}

#[cfg(all(target_arch = "wasm32", not(test)))]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| Box::new(host::root::Root::new(context_id)));
}}
