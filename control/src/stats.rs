//! Counters shared between the background tasks and the HTTP server.
//!
//! Atomics rather than a metrics library: the service exports five numbers, and the server reads
//! them without taking any lock the control loop holds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

#[derive(Debug, Default)]
pub struct Stats {
    scrape_errors_total: AtomicU64,
    fleet_reload_errors_total: AtomicU64,
    /// `f64::to_bits` of the last completed round's duration in seconds.
    scrape_duration_bits: AtomicU64,
    fleet_loaded: AtomicBool,
    first_round_done: AtomicBool,
}

impl Stats {
    pub fn scrape_error(&self) {
        self.scrape_errors_total.fetch_add(1, Ordering::Relaxed);
    }

    pub fn scrape_errors_total(&self) -> u64 {
        self.scrape_errors_total.load(Ordering::Relaxed)
    }

    pub fn fleet_reload_error(&self) {
        self.fleet_reload_errors_total
            .fetch_add(1, Ordering::Relaxed);
    }

    pub fn fleet_reload_errors_total(&self) -> u64 {
        self.fleet_reload_errors_total.load(Ordering::Relaxed)
    }

    /// Records a finished scrape round; the first one also makes the service ready.
    pub fn round_finished(&self, duration: Duration) {
        self.scrape_duration_bits
            .store(duration.as_secs_f64().to_bits(), Ordering::Relaxed);
        self.first_round_done.store(true, Ordering::Release);
    }

    pub fn scrape_duration_seconds(&self) -> f64 {
        f64::from_bits(self.scrape_duration_bits.load(Ordering::Relaxed))
    }

    pub fn fleet_loaded(&self) {
        self.fleet_loaded.store(true, Ordering::Release);
    }

    /// Ready means the snapshot reflects a real fleet and real metrics, not start-up placeholders,
    /// so a filter pointed at a freshly started service does not route on all-empty metrics.
    pub fn is_ready(&self) -> bool {
        self.fleet_loaded.load(Ordering::Acquire) && self.first_round_done.load(Ordering::Acquire)
    }
}
