//! Observability, pure: metric names with labels, request outcomes, request timing and its
//! AIBrix duration buckets, stream usage scanning, and routing explanations. The host only
//! emits what these functions compute, so all of it is testable natively.

pub mod explain;
pub mod labels;
pub mod outcome;
pub mod timing;
pub mod usage;

pub use explain::Explain;
