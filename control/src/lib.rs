//! pd-control: the native side of pd-router.
//!
//! It keeps the fleet (from a fleet file or a Kubernetes pod watch), scrapes every pod's engine
//! metrics, and serves a versioned protobuf snapshot that the filter inside Envoy fetches.
//!
//! Data flows one way: a [`sources::FleetSource`] publishes pod records, the control loop in
//! [`service`] scrapes them ([`scrape`]) and folds both into a [`snapshot`], which [`server`]
//! hands out.

pub mod auth;
pub mod config;
pub mod config_audit;
pub mod eds;
pub mod external;
pub mod fleet;
pub mod gateways;
pub mod leader;
pub mod limits;
pub mod redis_link;
pub mod replicas;
pub mod report_ids;
pub mod scrape;
pub mod server;
pub mod service;
pub mod snapshot;
pub mod sources;
pub mod stats;
pub mod xds;

pub use config::Config;
pub use service::{run, start, start_with_source, Error, Service};

/// Types generated from `filter/proto/snapshot.proto`.
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/pdrouter.snapshot.v1.rs"));
}

/// Wall-clock milliseconds since the Unix epoch; 0 if the clock is before it.
pub(crate) fn unix_ms_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
