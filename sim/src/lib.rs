//! pd-sim: simulated vLLM engine pods and an open-loop load generator, for testing and
//! benchmarking pd-router without GPUs.
//!
//! - `pd-sim` serves every loopback pod of a fleet file as a vLLM OpenAI server speaking the
//!   disaggregated-prefill protocol (`kv_transfer_params`), with the Prometheus metrics of the
//!   pod's engine label (vLLM, SGLang or TRT-LLM names and endpoints) and a request log
//!   (`/sim/requests`) that tests assert on.
//! - `pd-load` sends OpenAI traffic through the router and reports latency and per-pod spread.
//!
//! Modules: [`engine`] (timing and token model), [`prefix`] (prefix cache), [`vllm`] (wire
//! shapes and PD rules), [`metrics`] (exposition), [`pod`] (per-pod state and request jobs),
//! [`log`] (request log), [`faults`] (fault injection), [`server`] (HTTP), [`sim`] (fleet → served pods), [`load`] and
//! [`stats`] (load generator and its summary), [`cli`] (both command lines).

pub mod cli;
pub mod client;
pub mod engine;
pub mod faults;
pub mod load;
pub mod log;
pub mod metrics;
pub mod pod;
pub mod prefix;
pub mod server;
pub mod sim;
pub mod stats;
pub mod vllm;
pub mod workload;
