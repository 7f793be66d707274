//! Snapshot adoption as wasm under Node's V8 (TurboFan only, as Envoy runs it), without
//! Envoy: a full decode and a metrics-only one (`FleetView::decode_after`) of the
//! `benches/snapshot.rs` fleet. `make bench-v8-node` runs it; by hand:
//! `cargo build --release --target wasm32-wasip1 --example snapshot_loop -p pd-router-filter`,
//! then `node --no-liftoff wasm-tests/run-wasi target/wasm32-wasip1/release/examples/snapshot_loop.wasm 1024`.
//! Prints the median time of each over batches.

use pd_router_filter::core::fleet::FleetView;
#[allow(dead_code)] // only its pods are used here
#[path = "../benches/support/fleet.rs"]
mod fleet;
#[path = "../benches/support/snapshot.rs"]
mod support;
use support::snapshot_bytes;

fn median_us(batches: usize, per_batch: usize, mut f: impl FnMut() -> u64) -> f64 {
    let mut times = Vec::with_capacity(batches);
    let mut sink = 0u64;
    for _ in 0..batches {
        let t = std::time::Instant::now();
        for _ in 0..per_batch {
            sink ^= f();
        }
        times.push(t.elapsed().as_nanos() as f64 / per_batch as f64 / 1000.0);
    }
    // The first third warms the JIT up.
    let mut timed = times.split_off(batches / 3);
    timed.sort_by(f64::total_cmp);
    std::hint::black_box(sink);
    timed[timed.len() / 2]
}

fn main() {
    let pods: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let before = snapshot_bytes(pods, 3.0);
    let after = snapshot_bytes(pods, 4.0);
    let previous = FleetView::decode(&before).expect("a snapshot");
    let per_batch = (20_000 / pods).max(1);
    let full = median_us(30, per_batch, || {
        FleetView::decode(&after).map(|v| v.version).unwrap_or(0)
    });
    let refresh = median_us(30, per_batch, || {
        FleetView::decode_after(&after, Some(&previous))
            .map(|v| v.version)
            .unwrap_or(0)
    });
    println!(
        "pods={pods} snapshot of {} bytes: full decode p50 {full:.1} us, metrics only p50 {refresh:.1} us",
        after.len()
    );
}
