//! vLLM disaggregated prefill over the OpenAI API.
//!
//! The prefill leg is the client's request capped at one token and marked
//! `kv_transfer_params.do_remote_decode`; the decode leg is the client's request plus the
//! `kv_transfer_params` the prefill returned, with `remote_host` set to the prefill pod's IP
//! (vLLM reports its side-channel host, which defaults to `localhost`).

use serde_json::{json, Map, Value};

use crate::core::config::KvConnector;
use crate::core::errors::RouteError;

/// The prefill request body, built from the parsed client body.
pub fn prefill_body(client: &Map<String, Value>, connector: KvConnector) -> Vec<u8> {
    let mut body = client.clone();
    if connector == KvConnector::Shfs {
        body.insert(
            "kv_transfer_params".into(),
            json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null,
            }),
        );
    }
    cap_to_one_token(&mut body);
    Value::Object(body).to_string().into_bytes()
}

/// What every engine's prefill leg shares: one token, no streaming (vLLM rejects
/// `stream_options` without `stream`), and no `min_tokens` a one-token leg cannot honour.
fn cap_to_one_token(body: &mut Map<String, Value>) {
    body.insert("max_tokens".into(), json!(1));
    body.insert("max_completion_tokens".into(), json!(1));
    body.insert("stream".into(), json!(false));
    body.remove("stream_options");
    body.remove("min_tokens");
}

/// The decode request body from the client body and the prefill's response bytes.
/// `None` means "forward the client's body unchanged".
pub fn decode_body(
    client: &Map<String, Value>,
    prefill_response: &[u8],
    prefill_ip: &str,
    connector: KvConnector,
) -> Result<Option<Vec<u8>>, RouteError> {
    if connector == KvConnector::Mooncake {
        return Ok(None);
    }
    let response = match serde_json::from_slice::<Value>(prefill_response) {
        Ok(Value::Object(map)) => map,
        _ => return Err(bad_response("the prefill response is not a JSON object")),
    };
    let mut body = client.clone();
    match connector {
        KvConnector::Nixl => {
            body.insert("disagg_prefill_resp".into(), Value::Object(response));
        }
        _ => match response.get("kv_transfer_params") {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Object(params)) => {
                let mut params = params.clone();
                params.insert("remote_host".into(), Value::String(prefill_ip.to_string()));
                body.insert("kv_transfer_params".into(), Value::Object(params));
            }
            Some(_) => {
                return Err(bad_response(
                    "kv_transfer_params in the prefill response is not an object",
                ))
            }
        },
    }
    Ok(Some(Value::Object(body).to_string().into_bytes()))
}

fn bad_response(detail: &str) -> RouteError {
    RouteError::Prefill {
        status: 502,
        class: "invalid_response",
        detail: detail.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> Map<String, Value> {
        match serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
                "stream_options":{"include_usage":true},"min_tokens":3,"max_tokens":64,"seed":9007199254740993}"#,
        )
        .unwrap()
        {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn prefill_leg_is_capped_and_marked() {
        let body: Value =
            serde_json::from_slice(&prefill_body(&client(), KvConnector::Shfs)).unwrap();
        assert_eq!(body["max_tokens"], 1);
        assert_eq!(body["max_completion_tokens"], 1);
        assert_eq!(body["stream"], false);
        assert!(body.get("stream_options").is_none() && body.get("min_tokens").is_none());
        assert_eq!(body["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(body["kv_transfer_params"]["do_remote_prefill"], false);
        let raw = String::from_utf8(prefill_body(&client(), KvConnector::Nixl)).unwrap();
        assert!(!raw.contains("kv_transfer_params"));
        assert!(
            raw.contains("9007199254740993"),
            "large integers keep their exact digits"
        );
    }

    #[test]
    fn decode_leg_carries_params_with_prefill_ip() {
        let resp = br#"{"id":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"localhost","remote_port":5600,"remote_block_ids":[1,2]}}"#;
        let out = decode_body(&client(), resp, "10.0.0.7", KvConnector::Shfs)
            .unwrap()
            .unwrap();
        let body: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(body["kv_transfer_params"]["remote_host"], "10.0.0.7");
        assert_eq!(body["kv_transfer_params"]["remote_port"], 5600);
        assert_eq!(
            body["stream"], true,
            "the decode leg keeps the client's parameters"
        );
        assert_eq!(body["max_tokens"], 64);
        let raw = String::from_utf8(out).unwrap();
        assert!(
            raw.starts_with(r#"{"model":"m","messages""#),
            "key order is kept: {raw}"
        );
    }

    #[test]
    fn decode_leg_edge_cases() {
        assert_eq!(
            decode_body(&client(), br#"{"id":"x"}"#, "ip", KvConnector::Shfs).unwrap(),
            None
        );
        assert!(decode_body(&client(), b"oops", "ip", KvConnector::Shfs).is_err());
        assert!(decode_body(
            &client(),
            br#"{"kv_transfer_params":3}"#,
            "ip",
            KvConnector::Shfs
        )
        .is_err());
        let nixl = decode_body(&client(), br#"{"id":"x"}"#, "ip", KvConnector::Nixl)
            .unwrap()
            .unwrap();
        let body: Value = serde_json::from_slice(&nixl).unwrap();
        assert_eq!(body["disagg_prefill_resp"]["id"], "x");
        assert_eq!(
            decode_body(&client(), b"{}", "ip", KvConnector::Mooncake).unwrap(),
            None
        );
    }
}
