//! Engine adapters: how each engine's prefill leg is built and how its answer shapes the
//! decode request.

pub mod vllm;
