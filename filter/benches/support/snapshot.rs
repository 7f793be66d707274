//! The wire snapshot of a PD fleet, shared by `benches/snapshot.rs` and
//! `examples/snapshot_loop.rs`: `pods` pods in rolesets of one prefill and one decode pod,
//! every pod scraped, each with the config annotation the demo fleet carries. `load` sets
//! every pod's running count, so two calls differ in metrics only.

use pd_router_filter::proto;
use prost::Message;

pub fn snapshot_bytes(pods: usize, load: f64) -> Vec<u8> {
    let config = r#"{"profiles": {"default": {"routingStrategy": "pd"}}}"#;
    let pods = (0..pods)
        .map(|i| {
            let role = if i % 2 == 0 { "prefill" } else { "decode" };
            proto::Pod {
                namespace: "bench".into(),
                name: format!("llama-{role}-{i}"),
                ip: format!("10.0.{}.{}", i / 250, i % 250),
                port: 8000,
                engine: "vllm".into(),
                role: role.into(),
                roleset: format!("rs-{}", i / 2),
                ready: true,
                config: config.into(),
                sglang_bootstrap_port: 8998,
                serves_http: true,
                metrics: Some(proto::PodMetrics {
                    present: true,
                    running: load,
                    waiting: 1.0,
                    kv_cache_usage: 0.4,
                    prompt_throughput: 1000.0,
                    generation_throughput: 300.0,
                    ttft_avg_seconds: 0.1,
                    tpot_avg_seconds: 0.02,
                    last_scrape_unix_ms: 1_700_000_000_000,
                    ..Default::default()
                }),
                ..Default::default()
            }
        })
        .collect();
    proto::Snapshot {
        version: 7,
        generated_unix_ms: 1_700_000_000_000,
        models: vec![proto::Model {
            name: "m".into(),
            pods,
        }],
    }
    .encode_to_vec()
}
