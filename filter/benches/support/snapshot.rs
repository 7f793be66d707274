//! The wire snapshot of a PD fleet, shared by `benches/snapshot.rs` and
//! `examples/snapshot_loop.rs`: `pods` pods in rolesets of one prefill and one decode pod,
//! every pod scraped, each with the config annotation the demo fleet carries (the pods of
//! `fleet.rs`, which the includer declares as `mod fleet` beside this one) and the labels
//! pd-control carries for such a pod. `load` sets every pod's running count, so two calls
//! differ in metrics only.

use pd_router_filter::proto;
use prost::Message;

use super::fleet::pd_pod;

pub fn snapshot_bytes(count: usize, load: f64) -> Vec<u8> {
    let config = r#"{"profiles": {"default": {"routingStrategy": "pd"}}}"#;
    let pods = (0..count)
        .map(|i| proto::Pod {
            config: config.into(),
            sglang_bootstrap_port: 8998,
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
            ..pd_pod(i, "llama")
        })
        .collect();
    // A demo-fleet pod's labels, sorted by key as pd-control sends them.
    let labels = (0..count)
        .map(|i| proto::PodLabels {
            labels: [
                ("model.aibrix.ai/engine", "vllm".to_string()),
                ("model.aibrix.ai/name", "llama".to_string()),
                ("model.aibrix.ai/port", "8000".to_string()),
                (
                    "role-name",
                    if i % 2 == 0 { "prefill" } else { "decode" }.to_string(),
                ),
                ("roleset-name", format!("rs-{}", i / 2)),
            ]
            .into_iter()
            .map(|(key, value)| proto::Label {
                key: key.into(),
                value,
            })
            .collect(),
        })
        .collect();
    proto::Snapshot {
        version: 7,
        generated_unix_ms: 1_700_000_000_000,
        user_limits: false,
        eds: false,
        external_router: None,
        models: vec![proto::Model {
            name: "m".into(),
            pods,
            labels: Some(proto::PodLabelSets { pods: labels }),
        }],
    }
    .encode_to_vec()
}
