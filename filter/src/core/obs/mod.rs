//! Observability, pure: metric names with labels, request outcomes, request timing and its
//! AIBrix duration buckets, stream usage scanning, routing explanations, and the backlog of
//! series too many to define at once. The host only
//! emits what these functions compute, so all of it is testable natively.

pub mod backlog;
pub mod explain;
pub mod labels;
pub mod log_pace;
pub mod outcome;
pub mod series;
pub mod timing;
pub mod usage;

pub use explain::Explain;
