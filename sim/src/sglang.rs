//! SGLang's disaggregation wire rules (`--disaggregation-mode prefill|decode`): both legs
//! carry the same `bootstrap_host` / `bootstrap_port` / `bootstrap_room`; the prefill
//! worker computes only once the decode worker registered for the same room and answers
//! after its KV went there, and the decode worker waits for that KV. See
//! `engine-protocols.md` §2.

use serde_json::{json, Map, Value};

use crate::vllm::{ApiError, Leg, PodRole};

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// The disaggregation fields of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SglangLeg {
    pub leg: Leg,
    pub bootstrap_host: String,
    /// `None` when the router sent `null` (a prefill worker without a bootstrap port).
    pub bootstrap_port: Option<u16>,
    pub bootstrap_room: u64,
    /// The request id the router set, which `/abort_request` names.
    pub rid: Option<String>,
}

impl SglangLeg {
    /// The address `bootstrap_host` names, as the decode worker reaches it: SGLang builds
    /// `http://{bootstrap_host}:{bootstrap_port}/...`, so an IPv6 address must come in
    /// brackets; a bare one makes no URL (`None`).
    pub fn bootstrap_ip(&self) -> Option<&str> {
        let host = self.bootstrap_host.as_str();
        match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            Some(inner) => Some(inner),
            None if host.contains(':') => None,
            None => Some(host),
        }
    }

    /// The rendezvous key: the bootstrap server the decode worker registers with, and the
    /// room within it.
    pub fn room_key(&self) -> String {
        format!(
            "sglang/{}:{}/{}",
            self.bootstrap_ip().unwrap_or(&self.bootstrap_host),
            self.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT),
            self.bootstrap_room
        )
    }

    /// What the request log records about the exchange.
    pub fn log_value(&self) -> Value {
        json!({
            "bootstrap_host": self.bootstrap_host,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": self.bootstrap_room,
            "rid": self.rid,
        })
    }
}

/// The rendezvous key a prefill worker at `ip` with `bootstrap_port` serves `room` under.
pub fn own_room_key(ip: &str, bootstrap_port: u16, room: u64) -> String {
    format!("sglang/{ip}:{bootstrap_port}/{room}")
}

/// Classifies a request on a pod of `role`. A prefill or decode worker refuses a request
/// without a bootstrap room with 400 (SGLang: "Disaggregated request received without
/// bootstrap room id"): the prefill worker has nobody to send its KV to, the decode worker
/// nowhere to get it from. A standard (`unified`) worker serves every request whole.
pub fn classify(obj: &Map<String, Value>, role: PodRole) -> Result<Option<SglangLeg>, ApiError> {
    let rid = match obj.get("rid") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::bad_request("rid: Input should be a valid string")),
    };
    let leg = match role {
        PodRole::Prefill => Leg::Prefill,
        PodRole::Decode => Leg::Decode,
        PodRole::Combined => return Ok(None),
    };
    let room = match obj.get("bootstrap_room") {
        None | Some(Value::Null) => {
            return Err(ApiError::bad_request(
                "Disaggregated request received without bootstrap room id",
            ))
        }
        // An exact integer in [0, 2^63 - 1]: a float (a router that went through f64) is
        // refused, as SGLang's pydantic model does.
        Some(v) => v
            .as_u64()
            .filter(|r| *r <= i64::MAX as u64)
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "bootstrap_room: Input should be a valid integer in [0, 2^63-1], got {v}"
                ))
            })?,
    };
    let bootstrap_host = obj
        .get("bootstrap_host")
        .and_then(Value::as_str)
        .filter(|h| !h.is_empty())
        .ok_or_else(|| ApiError::bad_request("bootstrap_host: a string is required"))?
        .to_string();
    let bootstrap_port = match obj.get("bootstrap_port") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "bootstrap_port: Input should be a valid port, got {v}"
                    ))
                })?,
        ),
    };
    Ok(Some(SglangLeg {
        leg,
        bootstrap_host,
        bootstrap_port,
        bootstrap_room: room,
        rid,
    }))
}

/// `/get_server_info` (alias `/server_info`): the server arguments a router or operator
/// reads, trimmed to the disaggregation-relevant ones.
pub fn server_info(model: &str, role: PodRole, bootstrap_port: u16) -> Value {
    let mode = match role {
        PodRole::Prefill => "prefill",
        PodRole::Decode => "decode",
        PodRole::Combined => "null",
    };
    json!({
        "model_path": model,
        "served_model_name": model,
        "disaggregation_mode": mode,
        "disaggregation_bootstrap_port": bootstrap_port,
        "disaggregation_transfer_backend": "mooncake",
        "tp_size": 1,
        "dp_size": 1,
        "max_total_num_tokens": 100000,
        "internal_states": [{"last_gen_throughput": 0.0, "avg_spec_accept_length": null}],
        "version": "0.4.10-sim",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn pd_workers_need_the_bootstrap_fields() {
        let ok = obj(
            json!({"bootstrap_host": "127.0.0.9", "bootstrap_port": 8998,
            "bootstrap_room": 9_223_372_036_854_775_806u64, "rid": "r-1"}),
        );
        let leg = classify(&ok, PodRole::Decode).unwrap().unwrap();
        assert_eq!(leg.leg, Leg::Decode);
        assert_eq!(leg.room_key(), "sglang/127.0.0.9:8998/9223372036854775806");
        assert_eq!(
            leg.room_key(),
            own_room_key("127.0.0.9", 8998, 9_223_372_036_854_775_806)
        );
        assert_eq!(leg.rid.as_deref(), Some("r-1"));
        assert!(classify(&ok, PodRole::Combined).unwrap().is_none());

        assert!(classify(&obj(json!({})), PodRole::Combined)
            .unwrap()
            .is_none());
        // Neither PD worker serves a request without a room, whatever else it carries.
        for role in [PodRole::Prefill, PodRole::Decode] {
            for body in [
                json!({}),
                json!({"bootstrap_room": null}),
                json!({"bootstrap_host": "127.0.0.9", "bootstrap_port": 8998}),
            ] {
                let err = classify(&obj(body.clone()), role).unwrap_err();
                assert_eq!(err.status, 400, "{role:?} {body}");
                assert_eq!(
                    err.message,
                    "Disaggregated request received without bootstrap room id"
                );
            }
        }
        let cases = [
            json!({"bootstrap_host": "h", "bootstrap_room": 1.5}),
            json!({"bootstrap_host": "h", "bootstrap_room": 9.2e18}),
            json!({"bootstrap_room": 1}),
            json!({"bootstrap_host": "h", "bootstrap_room": 1, "bootstrap_port": 70000}),
            json!({"bootstrap_host": "h", "bootstrap_room": 1, "rid": 5}),
        ];
        for c in cases {
            let err = classify(&obj(c.clone()), PodRole::Prefill).unwrap_err();
            assert_eq!(err.status, 400, "{c}");
        }
    }

    #[test]
    fn an_ipv6_bootstrap_host_is_reached_in_brackets_only() {
        let leg = |host: &str| {
            classify(
                &obj(json!({"bootstrap_host": host, "bootstrap_room": 7})),
                PodRole::Decode,
            )
            .unwrap()
            .unwrap()
        };
        assert_eq!(leg("[fd00::1]").bootstrap_ip(), Some("fd00::1"));
        assert_eq!(
            leg("[fd00::1]").room_key(),
            own_room_key("fd00::1", DEFAULT_BOOTSTRAP_PORT, 7)
        );
        assert_eq!(
            leg("fd00::1").bootstrap_ip(),
            None,
            "http://fd00::1:8998 is no URL"
        );
        assert_eq!(leg("10.0.0.7").bootstrap_ip(), Some("10.0.0.7"));
    }
}
