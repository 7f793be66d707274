//! The per-pod signals Steps 1–5 read, laid out as one array per signal, computed once per
//! snapshot. A selection at 1024 pods then walks a few dense arrays instead of `PodView`s
//! (strings, protobuf metrics, configs), and every derivation that depends only on the
//! snapshot (metric freshness, usable throughput, free KV percent, ...) is paid once per
//! snapshot instead of once per pod per request.
//!
//! `NaN` marks "not reported" in the `f64` columns: every reported value that survives its
//! filter is a number, so the marker never collides with data.

use crate::core::fleet::PodView;
use crate::core::ledger::PodId;
use crate::core::score::decode::{free_percent, usable};

/// Marks a pod outside any complete roleset in [`Columns::roleset`].
pub const NO_ROLESET: u32 = u32::MAX;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Columns {
    /// Ledger identity of each pod.
    pub id: Vec<PodId>,
    /// `ModelView::rolesets` index, or [`NO_ROLESET`].
    pub roleset: Vec<u32>,
    /// Engine metrics present and not stale (the decode side's "scraped" signal).
    pub fresh: Vec<bool>,
    /// Usable generation throughput (finite, at least 0) of fresh metrics; NaN otherwise.
    pub throughput: Vec<f64>,
    /// Free KV percent (`round(100 − usage × 100)`, at least 0.1); 100 without fresh metrics.
    pub free: Vec<f64>,
    /// Drain rate of fresh metrics when above 0 (may be +∞); NaN otherwise.
    pub drain: Vec<f64>,
    /// Decode `token_load`'s own per-request generation rate (throughput over running
    /// requests); NaN when the pod has none.
    pub own_rate: Vec<f64>,
    /// Conductor prefill: mean TTFT in ms when positive (metrics of any age, as the policy
    /// reads them); NaN otherwise.
    pub prefill_ms: Vec<f64>,
    /// Step 0 without bucketing: every prefill and every decode pod of the complete rolesets,
    /// roleset by roleset in roleset order.
    pub all_prefill: Vec<usize>,
    pub all_decode: Vec<usize>,
}

impl Columns {
    pub fn build(pods: &[PodView], rolesets: &[crate::core::fleet::Roleset]) -> Columns {
        let n = pods.len();
        let mut c = Columns {
            id: Vec::with_capacity(n),
            roleset: Vec::with_capacity(n),
            fresh: Vec::with_capacity(n),
            throughput: Vec::with_capacity(n),
            free: Vec::with_capacity(n),
            drain: Vec::with_capacity(n),
            own_rate: Vec::with_capacity(n),
            prefill_ms: Vec::with_capacity(n),
            all_prefill: rolesets
                .iter()
                .flat_map(|r| r.prefill.iter().copied())
                .collect(),
            all_decode: rolesets
                .iter()
                .flat_map(|r| r.decode.iter().copied())
                .collect(),
        };
        for pod in pods {
            let fresh = pod.metrics.as_ref().filter(|m| !m.stale);
            c.id.push(pod.id);
            c.roleset.push(
                pod.roleset_idx
                    .and_then(|r| u32::try_from(r).ok())
                    .unwrap_or(NO_ROLESET),
            );
            c.fresh.push(fresh.is_some());
            c.throughput
                .push(usable(fresh.map(|m| m.generation_throughput)).unwrap_or(f64::NAN));
            c.free.push(free_percent(fresh.map(|m| m.kv_cache_usage)));
            c.drain.push(
                fresh
                    .map(|m| m.drain_rate)
                    .filter(|d| *d > 0.0)
                    .unwrap_or(f64::NAN),
            );
            c.own_rate.push(
                crate::core::tokens::own_rate(
                    fresh.map(|m| m.generation_throughput),
                    fresh.map(|m| m.running).unwrap_or(0.0),
                )
                .unwrap_or(f64::NAN),
            );
            c.prefill_ms.push(
                pod.metrics
                    .as_ref()
                    .map(|m| m.ttft_avg_seconds * 1000.0)
                    .filter(|v| *v > 0.0)
                    .unwrap_or(f64::NAN),
            );
        }
        c
    }
}

/// `Some(v)` unless `v` is the "not reported" marker.
pub fn reported(v: f64) -> Option<f64> {
    (!v.is_nan()).then_some(v)
}
