//! pd-control: the native side of pd-router.
//!
//! It keeps the fleet (from a fleet file, later from Kubernetes), scrapes every pod's engine
//! metrics, and serves a versioned protobuf snapshot that the filter inside Envoy fetches.

pub mod fleet;

/// Types generated from `filter/proto/snapshot.proto`.
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/pdrouter.snapshot.v1.rs"));
}
