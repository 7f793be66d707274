//! pd-sim
