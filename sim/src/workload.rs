//! What pd-load sends: reproducible request plans (endpoint, stream flag, prompt of an exact
//! token size) and the two legs of a vLLM disaggregated exchange for `--direct-prefill`.

use serde_json::{json, Value};

use crate::load::{LoadConfig, Workload};
use crate::trace::{body_input, fixed_body, words};

/// One request to send, decided up front so runs are reproducible from `--seed`.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub seq: u64,
    pub path: &'static str,
    pub stream: bool,
    pub prompt_tokens: u64,
    pub body: Value,
    /// Sent as `x-aibrix-session-key` (multi-turn sessions of a trace).
    pub session: Option<String>,
}

/// Decides request `seq`: endpoint, stream flag, prompt and body.
pub fn plan(cfg: &LoadConfig, rng: &mut fastrand::Rng, seq: u64) -> Planned {
    match &cfg.workload {
        Workload::Random => plan_random(cfg, rng, seq),
        Workload::Fixed { body_bytes } => {
            let stream = rng.f64() < cfg.stream_ratio;
            let mut body = fixed_body(&cfg.model, cfg.max_tokens, stream, *body_bytes, rng.u64(..));
            add_stream_options(cfg, stream, &mut body);
            Planned {
                seq,
                path: "/v1/chat/completions",
                stream,
                prompt_tokens: (*body_bytes as u64).div_ceil(4),
                body,
                session: None,
            }
        }
        Workload::Mixed | Workload::Replay { .. } => plan_trace(cfg, rng, seq),
    }
}

fn add_stream_options(cfg: &LoadConfig, stream: bool, body: &mut Value) {
    if let Some(map) = body.as_object_mut() {
        if stream && cfg.include_usage {
            map.insert("stream_options".into(), json!({"include_usage": true}));
        }
    }
}

/// Entry `seq` of the trace (cycling when the run outlasts it).
fn plan_trace(cfg: &LoadConfig, rng: &mut fastrand::Rng, seq: u64) -> Planned {
    let len = cfg.trace.len().max(1) as u64;
    let Some(entry) = cfg.trace.get((seq % len) as usize) else {
        return plan_random(cfg, rng, seq);
    };
    let draw = rng.f64() < cfg.stream_ratio;
    let stream = entry.stream.unwrap_or(draw);
    let (path, key, input) = body_input(entry, seq % len, cfg.seed);
    let mut body = json!({"model": cfg.model, "max_tokens": entry.max_tokens.unwrap_or(cfg.max_tokens),
                          "stream": stream});
    if let Some(map) = body.as_object_mut() {
        map.insert(key, input);
    }
    add_stream_options(cfg, stream, &mut body);
    Planned {
        seq,
        path,
        stream,
        prompt_tokens: entry.size_tokens(),
        body,
        session: entry.session.clone(),
    }
}

fn plan_random(cfg: &LoadConfig, rng: &mut fastrand::Rng, seq: u64) -> Planned {
    let chat = rng.f64() < cfg.chat_ratio;
    let stream = rng.f64() < cfg.stream_ratio;
    let (lo, hi) = (
        cfg.prompt_tokens.0.min(cfg.prompt_tokens.1),
        cfg.prompt_tokens.0.max(cfg.prompt_tokens.1),
    );
    let tokens = rng.u64(lo..=hi).max(1);
    let shared = cfg.shared_prefix_tokens.min(tokens);
    let mut prompt = String::with_capacity(tokens as usize * 4);
    words(
        &mut fastrand::Rng::with_seed(cfg.seed ^ 0x5eed),
        shared,
        &mut prompt,
    );
    words(rng, tokens - shared, &mut prompt);
    let mut body = json!({"model": cfg.model, "max_tokens": cfg.max_tokens, "stream": stream});
    if let Some(map) = body.as_object_mut() {
        if chat {
            map.insert(
                "messages".into(),
                json!([{"role": "user", "content": prompt}]),
            );
        } else {
            map.insert("prompt".into(), Value::String(prompt));
        }
        if stream && cfg.include_usage {
            map.insert("stream_options".into(), json!({"include_usage": true}));
        }
    }
    Planned {
        seq,
        path: if chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        },
        stream,
        prompt_tokens: tokens,
        body,
        session: None,
    }
}

/// The vLLM prefill leg built from a client body, as vLLM's toy proxy and AIBrix build it.
pub fn prefill_body(body: &Value) -> Value {
    let mut p = body.clone();
    if let Some(map) = p.as_object_mut() {
        map.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null}),
        );
        map.insert("stream".into(), Value::Bool(false));
        map.insert("max_tokens".into(), json!(1));
        if map.contains_key("max_completion_tokens") {
            map.insert("max_completion_tokens".into(), json!(1));
        }
        for key in ["stream_options", "min_tokens", "min_completion_tokens"] {
            map.remove(key);
        }
    }
    p
}

/// The decode leg: the client body plus the prefill's `kv_transfer_params`, with
/// `remote_host` set to the prefill pod's address (what a router must do).
pub fn decode_body(body: &Value, mut kv: Value, prefill_host: &str) -> Value {
    if let Some(map) = kv.as_object_mut() {
        map.insert(
            "remote_host".into(),
            Value::String(prefill_host.to_string()),
        );
    }
    let mut d = body.clone();
    if let Some(map) = d.as_object_mut() {
        map.insert("kv_transfer_params".into(), kv);
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_are_reproducible_and_sized() {
        let cfg = LoadConfig {
            model: "m".into(),
            prompt_tokens: (10, 20),
            ..LoadConfig::default()
        };
        let a: Vec<Planned> = (0..20)
            .map({
                let mut rng = fastrand::Rng::with_seed(3);
                move |i| plan(&cfg, &mut rng, i)
            })
            .collect();
        let cfg2 = LoadConfig {
            model: "m".into(),
            prompt_tokens: (10, 20),
            ..LoadConfig::default()
        };
        let mut rng = fastrand::Rng::with_seed(3);
        let b: Vec<Planned> = (0..20).map(|i| plan(&cfg2, &mut rng, i)).collect();
        assert_eq!(a, b);
        for p in &a {
            assert!((10..=20).contains(&p.prompt_tokens));
            let text = p
                .body
                .get("prompt")
                .or_else(|| p.body.pointer("/messages/0/content"))
                .and_then(Value::as_str)
                .unwrap();
            assert_eq!(crate::engine::prompt_tokens(text), p.prompt_tokens);
            assert_eq!(p.body["stream"], json!(p.stream));
            assert_eq!(p.body.get("stream_options").is_some(), p.stream);
        }
        assert!(
            a.iter().any(|p| p.path == "/v1/completions")
                && a.iter().any(|p| p.path == "/v1/chat/completions")
        );
    }

    #[test]
    fn trace_and_fixed_workloads_plan_their_bodies() {
        let trace = crate::trace::parse(
            "{\"messages\":[{\"role\":\"user\",\"content\":\"abcd\"}],\"session\":\"s1\",\"max_tokens\":3,\"stream\":true}\n\
             {\"prompt_tokens\":20}\n",
        )
        .unwrap();
        let cfg = LoadConfig {
            model: "m".into(),
            workload: Workload::Replay { trace: "t".into() },
            trace: std::sync::Arc::new(trace),
            ..LoadConfig::default()
        };
        let mut rng = fastrand::Rng::with_seed(1);
        let a = plan(&cfg, &mut rng, 0);
        assert_eq!(
            (a.path, a.stream, a.session.as_deref()),
            ("/v1/chat/completions", true, Some("s1"))
        );
        assert_eq!(a.body["max_tokens"], json!(3));
        assert_eq!(a.body["messages"][0]["content"], json!("abcd"));
        let b = plan(&cfg, &mut rng, 1);
        assert_eq!(
            (b.path, b.prompt_tokens, b.session),
            ("/v1/completions", 20, None)
        );
        assert_eq!(b.body["max_tokens"], json!(cfg.max_tokens));
        let c = plan(&cfg, &mut rng, 2);
        assert_eq!(
            c.body["messages"], a.body["messages"],
            "the run cycles through the trace"
        );

        let fixed = LoadConfig {
            model: "m".into(),
            stream_ratio: 0.0,
            workload: Workload::Fixed { body_bytes: 32768 },
            ..LoadConfig::default()
        };
        let f = plan(&fixed, &mut rng, 0);
        assert_eq!(f.body.to_string().len(), 32768);
        assert_eq!(f.path, "/v1/chat/completions");
    }

    #[test]
    fn shared_prefix_is_shared() {
        let cfg = LoadConfig {
            model: "m".into(),
            prompt_tokens: (40, 40),
            shared_prefix_tokens: 32,
            chat_ratio: 0.0,
            ..LoadConfig::default()
        };
        let mut rng = fastrand::Rng::with_seed(9);
        let a = plan(&cfg, &mut rng, 0).body["prompt"]
            .as_str()
            .unwrap()
            .to_string();
        let b = plan(&cfg, &mut rng, 1).body["prompt"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(a[..128], b[..128]);
        assert_ne!(a[128..], b[128..]);
    }

    #[test]
    fn prefill_and_decode_bodies_follow_the_vllm_proxy() {
        let body = json!({"model": "m", "prompt": "p", "stream": true, "max_tokens": 9,
                          "max_completion_tokens": 9, "stream_options": {"include_usage": true}, "min_tokens": 2});
        let p = prefill_body(&body);
        assert_eq!(p["stream"], json!(false));
        assert_eq!(
            (
                p["max_tokens"].as_u64(),
                p["max_completion_tokens"].as_u64()
            ),
            (Some(1), Some(1))
        );
        assert!(p.get("stream_options").is_none() && p.get("min_tokens").is_none());
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], json!(true));
        let kv = crate::vllm::prefill_kv_params("e", "cmpl-x-0", &[1]);
        let d = decode_body(&body, kv, "127.0.10.2");
        assert_eq!(d["kv_transfer_params"]["remote_host"], json!("127.0.10.2"));
        assert_eq!(
            d["stream"],
            json!(true),
            "the decode leg keeps the client's body"
        );
    }
}
