//! vLLM on AWS Neuron with its NIXL integration (AIBrix's `AIBRIX_KV_CONNECTOR_TYPE=nixl`):
//! the gateway sends the prefill pod the client's request unmarked (capped at one unstreamed
//! token) and hands the decode pod the prefill pod's whole answer as `disagg_prefill_resp`.
//! pd-sim's vLLM pods speak it with `--vllm-connector nixl`, by mapping it onto the same
//! pinned-blocks model as the upstream NixlConnector contract.

use serde_json::{json, Map, Value};

use crate::vllm::PodRole;

/// Rewrites a request in the Neuron contract into the upstream shape the pod's engine model
/// understands: an unmarked unstreamed request to a prefill pod becomes a prefill leg, and a
/// decode request's `disagg_prefill_resp.kv_transfer_params` become its `kv_transfer_params`.
/// Anything else is left as it is (and judged by the usual rules).
pub fn adapt(mut body: Value, role: PodRole) -> Value {
    let Some(map) = body.as_object_mut() else {
        return body;
    };
    let has_params = map.get("kv_transfer_params").is_some_and(|v| !v.is_null());
    match role {
        PodRole::Prefill if !has_params && !streams(map) => {
            map.insert(
                "kv_transfer_params".into(),
                json!({"do_remote_decode": true, "do_remote_prefill": false}),
            );
        }
        PodRole::Decode if !has_params => {
            if let Some(params) = map
                .get("disagg_prefill_resp")
                .and_then(|r| r.get("kv_transfer_params"))
                .filter(|p| p.is_object())
                .cloned()
            {
                map.insert("kv_transfer_params".into(), params);
            }
        }
        _ => {}
    }
    body
}

fn streams(map: &Map<String, Value>) -> bool {
    map.get("stream").and_then(Value::as_bool) == Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmarked_prefill_requests_become_prefill_legs() {
        let b = adapt(json!({"prompt": "x", "max_tokens": 1}), PodRole::Prefill);
        assert_eq!(b["kv_transfer_params"]["do_remote_decode"], true);
        let streamed = adapt(json!({"prompt": "x", "stream": true}), PodRole::Prefill);
        assert!(
            streamed.get("kv_transfer_params").is_none(),
            "a stream is no prefill leg"
        );
    }

    #[test]
    fn decode_requests_take_their_params_from_the_prefill_answer() {
        let body = json!({"prompt": "x", "disagg_prefill_resp": {"id": "cmpl-1",
            "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "127.0.0.9"}}});
        let b = adapt(body, PodRole::Decode);
        assert_eq!(b["kv_transfer_params"]["remote_host"], "127.0.0.9");
        let without = adapt(json!({"prompt": "x"}), PodRole::Decode);
        assert!(without.get("kv_transfer_params").is_none());
    }
}
