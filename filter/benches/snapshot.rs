//! What a VM pays to adopt a snapshot: decoded in full (the first one, or a fleet change)
//! and when only metrics changed (`FleetView::decode_after` with the previous view), at
//! 16, 256 and 1024 pods. Run: `cargo bench -p pd-router-filter --bench snapshot`; the same
//! in V8: `make bench-v8-node` (examples/snapshot_loop.rs).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pd_router_filter::core::fleet::FleetView;

#[allow(dead_code)] // only its pods are used here
#[path = "support/fleet.rs"]
mod fleet;
#[path = "support/snapshot.rs"]
mod support;
use support::snapshot_bytes;

fn snapshot(c: &mut Criterion) {
    let mut group = c.benchmark_group("snapshot");
    for pods in [16usize, 256, 1024] {
        let before = snapshot_bytes(pods, 3.0);
        let after = snapshot_bytes(pods, 4.0);
        let previous = FleetView::decode(&before).expect("a snapshot");
        group.bench_function(BenchmarkId::new("full", pods), |b| {
            b.iter(|| FleetView::decode(&after).map(|v| v.version))
        });
        group.bench_function(BenchmarkId::new("metrics_only", pods), |b| {
            b.iter(|| FleetView::decode_after(&after, Some(&previous)).map(|v| v.version))
        });
    }
    group.finish();
}

criterion_group!(benches, snapshot);
criterion_main!(benches);
