//! The default-policy selection on an idle, never-scraped fleet (what `make bench-v8` times in
//! Envoy), in a loop, for timing the routing core as wasm under Node's V8 without Envoy:
//! `cargo build --release --target wasm32-wasip1 --example select_loop -p pd-router-filter`,
//! then `node --no-liftoff wasm-tests/run-wasi target/wasm32-wasip1/release/examples/select_loop.wasm 1024 3000`.
//! A third argument `prefill:decode` (policy names) selects on the scraped, loaded fleet of
//! `cargo bench --bench select` with those policies instead. Natively, under callgrind, it
//! counts the instructions of one selection. Prints the median and p90 of per-selection
//! times over batches of 100.

use pd_router_filter::core::pd::{self, PdDefaults, PdSettings};
use pd_router_filter::core::score::{DecodePolicy, PrefillPolicy};
#[path = "../benches/support/fleet.rs"]
mod fleet;
use fleet::{fleet_with, match_pcts, request, STEP0};

fn main() {
    let mut args = std::env::args().skip(1);
    let pods: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(1024);
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(3000);
    let policies = args.next();
    let mut settings = PdSettings::resolve(&PdDefaults::default(), None).expect("defaults");
    let (model, ledger) = fleet_with(pods, policies.is_some());
    let match_pct: Vec<f64> = match &policies {
        Some(pair) => {
            let (p, d) = pair.split_once(':').expect("prefill:decode");
            settings.prefill_policy = PrefillPolicy::parse(p).expect("a prefill policy");
            settings.decode_policy = DecodePolicy::parse(d).expect("a decode policy");
            match_pcts(&model)
        }
        None => Vec::new(),
    };
    let input = request(&settings, &match_pct, policies.is_some());
    let mut rng = fastrand::Rng::with_seed(7);
    let mut scratch = pd::Scratch::default();
    let mut batches = Vec::new();
    let mut picked = 0usize;
    for _ in 0..n / 100 {
        let t = std::time::Instant::now();
        for _ in 0..100 {
            let s = pd::select_pd_with(&model, STEP0, &ledger, input, &mut rng, &mut scratch)
                .expect("a pair");
            picked ^= s.target.pod();
        }
        batches.push(t.elapsed().as_nanos() as f64 / 100_000.0);
    }
    // The first third warms the JIT up.
    let mut timed = batches.split_off(batches.len() / 3);
    timed.sort_by(f64::total_cmp);
    let at = |q: f64| timed[((timed.len() - 1) as f64 * q) as usize];
    println!(
        "pods={pods} selections={} per selection: p50 {:.1} us, p90 {:.1} us ({picked})",
        timed.len() * 100,
        at(0.5),
        at(0.9)
    );
}
