//! Engine adapters: how each engine's prefill leg is built and how its answer shapes the
//! decode request (`vllm`, `sglang`, `trtllm`), the engine a PD request runs on, and the
//! gateway-wide engine settings.

pub mod sglang;
pub mod trtllm;
pub mod vllm;

use crate::core::env::EnvReader;
use crate::core::errors::RouteError;
use crate::core::fleet::ModelView;
use crate::core::request::Endpoint;
use trtllm::ScheduleStyle;

/// Members through which engines hand KV caches to each other: vLLM's `kv_transfer_params`,
/// the Neuron connector's `disagg_prefill_resp`, TRT-LLM's `disaggregated_params`. Only the
/// gateway writes them. A client's copy would reach an engine on every leg the gateway leaves
/// as sent (a single pod; a decode leg whose prefill answered without parameters) and make it
/// pull KV blocks of the client's choosing from an address of the client's choosing.
pub const GATEWAY_OWNED_MEMBERS: [&str; 3] = [
    "kv_transfer_params",
    "disagg_prefill_resp",
    "disaggregated_params",
];

/// The client's body without any [`GATEWAY_OWNED_MEMBERS`]; `None` when it has none (the
/// common case: the body goes on as sent).
pub fn without_gateway_members(
    members: &crate::core::json_object::Spans,
    raw: &[u8],
) -> Option<Vec<u8>> {
    GATEWAY_OWNED_MEMBERS
        .iter()
        .any(|k| members.value(raw, k).is_some() || members.repeated(k))
        .then(|| members.write(raw, &GATEWAY_OWNED_MEMBERS, &[]))
}

/// The `model.aibrix.ai/engine` of a PD request's pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Vllm,
    Sglang,
    Trtllm,
    /// Any other label: a plain one-token prefill leg and an unchanged decode body.
    Other,
}

impl Engine {
    /// The label value (the fleet view already turned a missing label into `vllm`).
    pub fn from_label(label: &str) -> Engine {
        match label {
            "vllm" | "" => Engine::Vllm,
            "sglang" => Engine::Sglang,
            "trtllm" => Engine::Trtllm,
            _ => Engine::Other,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Trtllm => "trtllm",
            Engine::Other => "other",
        }
    }

    /// Whether a prefill/decode pair of this engine can serve `endpoint`. SGLang's Messages
    /// handler rebuilds the request as chat without the bootstrap fields, so neither leg
    /// would find the other; trtllm-serve has no `/v1/messages`. vLLM's Responses answer has
    /// no `kv_transfer_params`, so no decode leg could find the prefill's KV (AIBrix sends
    /// the prefill leg anyway, with a `max_tokens` the Responses API ignores: the prefill pod
    /// generates a whole answer, and the decode pod computes the prompt again). Refused
    /// before selection, with a reason, rather than sent to fail or waste work on the pods.
    pub fn serves_pd(self, endpoint: Endpoint) -> bool {
        !matches!(
            (self, endpoint),
            (Engine::Sglang | Engine::Trtllm, Endpoint::Messages)
                | (_, Endpoint::Responses | Endpoint::MessagesCountTokens)
        )
    }
}

/// The engine of a PD request: every routable pod of the model must carry the same label,
/// because one request's legs speak one protocol (AIBrix checks the same set).
pub fn agreed_engine(model: &ModelView) -> Result<Engine, RouteError> {
    let Some(first) = model.pods.first() else {
        return Ok(Engine::Vllm);
    };
    let differing = model
        .engine_mismatch
        .and_then(|(a, b)| Some((model.pods.get(a)?, model.pods.get(b)?)));
    match differing {
        None => Ok(Engine::from_label(&first.engine)),
        Some((first, other)) => Err(RouteError::Selection {
            detail: format!(
                "inconsistent LLM engines detected: {} runs {:?}, {} runs {:?}",
                first.name, first.engine, other.name, other.engine
            ),
        }),
    }
}

/// Gateway-wide engine settings from the environment.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineDefaults {
    /// `AIBRIX_TRT_SCHEDULE_STYLE`; an unknown value is logged and leaves context_first.
    pub trt_schedule_style: ScheduleStyle,
    /// `AIBRIX_TRT_MACHINE_ID`, [0, 1024).
    pub trt_machine_id: u16,
    pub watchdog: crate::core::watchdog::WatchdogSettings,
}

impl Default for EngineDefaults {
    fn default() -> Self {
        EngineDefaults {
            trt_schedule_style: ScheduleStyle::ContextFirst,
            trt_machine_id: 0,
            watchdog: crate::core::watchdog::WatchdogSettings::default(),
        }
    }
}

/// A setting the gateway must not start with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineConfigError {
    /// Two gateways sharing TRT workers with clashing ids would mix up requests, so a bad
    /// value stops the VM instead of silently becoming 0 (as AIBrix refuses to start).
    #[error("AIBRIX_TRT_MACHINE_ID={0:?} is not an integer in [0, 1024)")]
    MachineId(String),
}

impl EngineDefaults {
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<(EngineDefaults, Vec<String>), EngineConfigError> {
        let mut r = EnvReader::new(&get);
        let trt_schedule_style = r.choice(
            "AIBRIX_TRT_SCHEDULE_STYLE",
            (ScheduleStyle::ContextFirst, "context_first"),
            ScheduleStyle::parse,
        );
        let trt_machine_id = match r.string("AIBRIX_TRT_MACHINE_ID") {
            None => 0,
            Some(raw) => raw
                .parse::<u16>()
                .ok()
                .filter(|v| *v < 1024)
                .ok_or(EngineConfigError::MachineId(raw))?,
        };
        let mut warnings = r.warnings;
        let (watchdog, w) = crate::core::watchdog::WatchdogSettings::from_lookup(&get);
        warnings.extend(w);
        Ok((
            EngineDefaults {
                trt_schedule_style,
                trt_machine_id,
                watchdog,
            },
            warnings,
        ))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_clients_kv_transfer_members_never_reach_an_engine() {
        use crate::core::json_object::Members;
        let clean = br#"{"model":"m","prompt":"hi","max_tokens":3}"#;
        let spans = Members::parse(clean).unwrap().spans(clean);
        assert_eq!(without_gateway_members(&spans, clean), None, "left as sent");
        for body in [
            &br#"{"model":"m","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.9.9.9"},"prompt":"hi"}"#[..],
            br#"{"model":"m","prompt":"hi","disaggregated_params":{"request_type":"generation_only"}}"#,
            br#"{"disagg_prefill_resp":{},"model":"m","prompt":"hi"}"#,
            // An escaped name is the same name to the engine's JSON parser.
            br#"{"model":"m","kv_transfer\u005fparams":{"remote_port":1},"prompt":"hi"}"#,
            // So is a repeated one.
            br#"{"model":"m","kv_transfer_params":1,"kv_transfer_params":null,"prompt":"hi"}"#,
        ] {
            let spans = Members::parse(body).unwrap().spans(body);
            let out = without_gateway_members(&spans, body).expect("edited");
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(
                v,
                serde_json::json!({"model": "m", "prompt": "hi"}),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;

    #[test]
    fn pairs_serve_only_the_paths_whose_engine_carries_the_pd_fields() {
        for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions] {
            for engine in [Engine::Vllm, Engine::Sglang, Engine::Trtllm, Engine::Other] {
                assert!(engine.serves_pd(endpoint), "{engine:?} {endpoint:?}");
            }
        }
        assert!(Engine::Vllm.serves_pd(Endpoint::Messages));
        assert!(Engine::Other.serves_pd(Endpoint::Messages));
        assert!(!Engine::Sglang.serves_pd(Endpoint::Messages));
        assert!(!Engine::Trtllm.serves_pd(Endpoint::Messages));
        for engine in [Engine::Vllm, Engine::Sglang, Engine::Trtllm, Engine::Other] {
            assert!(!engine.serves_pd(Endpoint::Responses), "{engine:?}");
        }
    }

    #[test]
    fn engines_must_agree() {
        let mut sg = pod("d0", "decode", "g0", true);
        sg.engine = "sglang".into();
        let mut sp = pod("p0", "prefill", "g0", true);
        sp.engine = "sglang".into();
        let fleet = FleetView::from_snapshot(&snapshot(vec![sp.clone(), sg.clone()]));
        assert_eq!(agreed_engine(&fleet.models["m"]), Ok(Engine::Sglang));
        let mut missing = pod("c0", "all", "", true);
        missing.engine = String::new();
        let fleet =
            FleetView::from_snapshot(&snapshot(vec![missing, pod("x", "decode", "g", true)]));
        assert_eq!(
            agreed_engine(&fleet.models["m"]),
            Ok(Engine::Vllm),
            "missing counts as vllm"
        );
        let fleet = FleetView::from_snapshot(&snapshot(vec![sp, pod("d1", "decode", "g0", true)]));
        let err = agreed_engine(&fleet.models["m"]).unwrap_err();
        assert!(
            matches!(&err, RouteError::Selection { detail } if detail.starts_with("inconsistent LLM engines detected"))
        );
        assert_eq!(err.status(), 503);
        assert_eq!(Engine::from_label("tgi"), Engine::Other);
        // Views derived from a mixed one (an `external-filter` selector, pods left out) are
        // judged on the pods they keep.
        let mixed = &fleet.models["m"];
        let sglang_only = mixed.only(|p| p.engine == "sglang");
        assert_eq!(agreed_engine(&sglang_only), Ok(Engine::Sglang));
        let vllm_only = mixed.only(|p| p.engine != "sglang");
        assert_eq!(agreed_engine(&vllm_only), Ok(Engine::Vllm));
        let metrics = vec![None; mixed.total_pods];
        assert!(agreed_engine(&mixed.with_metrics(&metrics).expect("same pods")).is_err());
    }

    #[test]
    fn env_values() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let (d, w) = EngineDefaults::from_lookup(env(&[
            ("AIBRIX_TRT_SCHEDULE_STYLE", "generation_first"),
            ("AIBRIX_TRT_MACHINE_ID", "1023"),
        ]))
        .unwrap();
        assert_eq!(
            (d.trt_schedule_style, d.trt_machine_id),
            (ScheduleStyle::GenerationFirst, 1023)
        );
        assert!(w.is_empty());
        let (d, w) =
            EngineDefaults::from_lookup(env(&[("AIBRIX_TRT_SCHEDULE_STYLE", "parallel")])).unwrap();
        assert_eq!(d.trt_schedule_style, ScheduleStyle::ContextFirst);
        assert!(
            w[0].contains("AIBRIX_TRT_SCHEDULE_STYLE"),
            "unknown value is logged: {w:?}"
        );
        for bad in ["1024", "-1", "x"] {
            let pairs: &'static [(&str, &str)] = match bad {
                "1024" => &[("AIBRIX_TRT_MACHINE_ID", "1024")],
                "-1" => &[("AIBRIX_TRT_MACHINE_ID", "-1")],
                _ => &[("AIBRIX_TRT_MACHINE_ID", "x")],
            };
            assert!(EngineDefaults::from_lookup(env(pairs)).is_err(), "{bad}");
        }
    }
}
