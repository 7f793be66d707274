//! pd-sim: simulated vLLM engine pods and an open-loop load generator, for testing and
//! benchmarking pd-router without GPUs.
//!
//! - `pd-sim` serves every loopback pod of a fleet file as an OpenAI server speaking the
//!   disaggregation protocol of the pod's engine label: vLLM (`kv_transfer_params`), SGLang
//!   (bootstrap rendezvous, `/abort_request`, `/server_info`) or TRT-LLM
//!   (`disaggregated_params`, context-first and generation-first, `/server_info`), with that
//!   engine's metrics and a request log (`/sim/requests`) that tests assert on.
//! - `pd-load` sends OpenAI traffic through the router and reports latency and per-pod spread.
//!
//! Modules: [`engine`] (timing and token model), [`prefix`] (prefix cache), [`vllm`] (wire
//! shapes and PD rules), [`sglang`] and [`trtllm`] (their PD rules), [`rendezvous`] (legs that
//! meet by key), [`abort`] (`/abort_request`), [`metrics`] (exposition), [`pod`] (per-pod state and request jobs),
//! [`log`] (request log), [`departure`] (clients that left mid-answer), [`faults`] (fault injection), [`server`] (HTTP), [`sim`] (fleet → served pods), [`load`] and
//! [`stats`] (load generator and its summary), [`chunk_gaps`] (every time between chunks of a
//! run's streams), [`trace`] (JSONL traces, the mixed and
//! fixed-size workloads), [`probe`] (pd-sim counters and router CPU around a run), [`report`]
//! and [`charts`] (`pd-bench-report`: tables and SVG charts of `make bench`),
//! [`dispatch_bound`] (what any prefill dispatcher could reach on a run's trace), [`cli`] (the
//! command lines).

pub mod abort;
pub mod anthropic;
pub mod api_key;
pub mod charts;
pub mod chunk_gaps;
pub mod cli;
pub mod client;
pub mod departure;
pub mod dispatch_bound;
pub mod engine;
pub mod faults;
pub mod interleave;
pub mod keep_alive;
pub mod load;
pub mod log;
pub mod metrics;
pub mod neuron;
pub mod pod;
pub mod prefix;
pub mod probe;
pub mod rendezvous;
pub mod report;
pub mod responses;
pub mod server;
pub mod sglang;
pub mod sim;
pub mod stats;
pub mod trace;
pub mod trtllm;
pub mod vllm;
pub mod workload;
