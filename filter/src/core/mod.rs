//! The routing core: pure Rust, no proxy-wasm imports, testable natively and on wasm32.

pub mod adoption;
pub mod charges;
pub mod config;
pub mod ejection;
pub mod engine;
pub mod env;
pub mod errors;
pub mod fleet;
pub mod freshness;
pub mod guard;
pub mod inbound;
pub mod journal;
pub mod json_object;
pub mod ledger;
pub mod obs;
pub mod pace;
pub mod pd;
pub mod prefix;
pub mod profile;
pub mod remote;
pub mod request;
pub mod route;
pub mod score;
pub mod tokenize;
pub mod tokens;
pub mod watchdog;
