//! The PD settings one request runs with: gateway environment defaults, overridden field by
//! field by the request profile's `routingConfig` (policies and knobs).

use crate::core::config::EnvSettings;
use crate::core::errors::RouteError;
use crate::core::pd::bucket_serve::{BucketServeMode, BucketServeSettings};
use crate::core::profile::RoutingConfig;
use crate::core::score::decode::{DecodeThresholds, LbWeights};
use crate::core::score::{DecodePolicy, PrefillPolicy};
use crate::core::tokens::TokenLoadSettings;

/// Gateway-wide defaults read once from the environment.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PdDefaults {
    pub env: EnvSettings,
    pub prefill_policy: PrefillPolicy,
    pub decode_policy: DecodePolicy,
    pub tokens: TokenLoadSettings,
    pub bucket_serve: BucketServeSettings,
}

impl PdDefaults {
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> (PdDefaults, Vec<String>) {
        let (env, mut warnings) = EnvSettings::from_lookup(&get);
        let (prefill_policy, w) = PrefillPolicy::from_env(Some(&env.pd.prefill_score_policy));
        warnings.extend(w);
        let (decode_policy, w) = DecodePolicy::from_env(Some(&env.pd.decode_score_policy));
        warnings.extend(w);
        let (tokens, w) = TokenLoadSettings::from_lookup(&get);
        warnings.extend(w);
        let (bucket_serve, w) = BucketServeSettings::from_lookup(&get);
        warnings.extend(w);
        (
            PdDefaults {
                env,
                prefill_policy,
                decode_policy,
                tokens,
                bucket_serve,
            },
            warnings,
        )
    }
}

/// Effective settings of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct PdSettings {
    pub prefill_policy: PrefillPolicy,
    pub decode_policy: DecodePolicy,
    pub prefill_spread: f64,
    pub decode: DecodeThresholds,
    pub lb: LbWeights,
    pub std_dev_factor: f64,
    pub tokens: TokenLoadSettings,
    pub prefill_timeout_s: f64,
    /// Adaptive bucket serving applies (it also needs bucketing, which the caller checks).
    pub bucket_serve: bool,
    pub bucket_serve_mode: BucketServeMode,
}

impl PdSettings {
    /// Resolves the request's settings. An unknown `decodeScorePolicy` in the profile fails
    /// selection (AIBrix answers 503); an unknown `prefillScorePolicy` keeps the default.
    pub fn resolve(d: &PdDefaults, rc: Option<&RoutingConfig>) -> Result<PdSettings, RouteError> {
        let pd = &d.env.pd;
        let knobs = rc.map(|rc| rc.knobs).unwrap_or_default();
        let prefill_policy = rc
            .and_then(|rc| rc.prefill_score_policy.as_deref())
            .and_then(PrefillPolicy::parse)
            .unwrap_or(d.prefill_policy);
        let decode_policy =
            DecodePolicy::parse_override(rc.and_then(|rc| rc.decode_score_policy.as_deref()))
                .map_err(|e| RouteError::Selection {
                    detail: e.to_string(),
                })?
                .unwrap_or(d.decode_policy);
        let mut tokens = d.tokens.clone();
        let pick = |knob: Option<f64>, default: f64| knob.unwrap_or(default);
        tokens.kv_weight = pick(knobs.token_load_kv_weight, tokens.kv_weight);
        tokens.request_cost = pick(knobs.token_load_request_cost, tokens.request_cost);
        tokens.ttl_s = knobs
            .token_load_ttl_seconds
            .map(|v| v as u64)
            .unwrap_or(tokens.ttl_s);
        tokens.session_ttl_s = knobs
            .token_load_session_ttl_seconds
            .map(|v| v as u64)
            .unwrap_or(tokens.session_ttl_s);
        tokens.hybrid_factor = pick(knobs.hybrid_cache_load_factor, tokens.hybrid_factor);
        tokens.min_match_pct = pick(knobs.min_match_pct, tokens.min_match_pct);
        Ok(PdSettings {
            prefill_policy,
            decode_policy,
            prefill_spread: pick(
                knobs.prefill_load_imbalance_min_spread,
                pd.prefill_load_imbalance_min_spread,
            ),
            decode: DecodeThresholds {
                count_spread: pick(
                    knobs.decode_load_imbalance_min_spread,
                    pd.decode_load_imbalance_min_spread,
                ),
                throughput_spread: pick(
                    knobs.decode_throughput_imbalance_min_spread,
                    pd.decode_throughput_imbalance_min_spread,
                ),
                drain_ratio: pick(
                    knobs.decode_score_ratio_threshold,
                    pd.decode_score_ratio_threshold,
                ),
            },
            lb: LbWeights {
                running: pick(knobs.decode_lb_weight_running, pd.decode_lb_weight_running),
                throughput: pick(
                    knobs.decode_lb_weight_throughput,
                    pd.decode_lb_weight_throughput,
                ),
            },
            std_dev_factor: pd.std_dev_factor,
            tokens,
            prefill_timeout_s: pick(
                knobs.prefill_request_timeout,
                d.env.prefill_request_timeout_s,
            ),
            bucket_serve: rc
                .and_then(|rc| rc.bucket_serve)
                .unwrap_or(d.bucket_serve.enabled),
            // An unknown mode is an invalid value: dropped, so the env default applies (spec
            // §8.2), not replaced by the built-in default.
            bucket_serve_mode: rc
                .and_then(|rc| rc.bucket_serve_mode.as_deref())
                .and_then(|mode| mode.parse().ok())
                .unwrap_or(d.bucket_serve.mode),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::profile::ModelConfig;

    fn rc(json: &str) -> RoutingConfig {
        let c = ModelConfig::parse(&format!(
            r#"{{"profiles":{{"default":{{"routingConfig":{json}}}}}}}"#
        ))
        .unwrap();
        c.profile(None).unwrap().routing_config.clone()
    }

    #[test]
    fn env_defaults_and_profile_overrides() {
        let (d, warnings) = PdDefaults::from_lookup(|k| match k {
            "AIBRIX_PREFILL_SCORE_POLICY" => Some("token_load".into()),
            "AIBRIX_DECODE_SCORE_POLICY" => Some("nonsense".into()),
            "AIBRIX_TOKEN_LOAD_REQUEST_COST" => Some("100".into()),
            _ => None,
        });
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        let s = PdSettings::resolve(&d, None).unwrap();
        assert_eq!(
            (s.prefill_policy, s.decode_policy),
            (PrefillPolicy::TokenLoad, DecodePolicy::LoadBalancing)
        );
        assert_eq!(s.tokens.request_cost, 100.0);
        assert_eq!(s.decode.count_spread, 16.0);

        let over = rc(
            r#"{"prefillScorePolicy":"least_request","decodeScorePolicy":" Conductor ",
                          "pd":{"decodeLoadImbalanceMinSpread":4,"tokenLoadRequestCost":7,"prefillRequestTimeout":2}}"#,
        );
        let s = PdSettings::resolve(&d, Some(&over)).unwrap();
        assert_eq!(
            (s.prefill_policy, s.decode_policy),
            (PrefillPolicy::LeastRequest, DecodePolicy::Conductor)
        );
        assert_eq!(
            (
                s.decode.count_spread,
                s.tokens.request_cost,
                s.prefill_timeout_s
            ),
            (4.0, 7.0, 2.0)
        );

        let unknown_prefill = rc(r#"{"prefillScorePolicy":"Token_Load"}"#);
        assert_eq!(
            PdSettings::resolve(&d, Some(&unknown_prefill))
                .unwrap()
                .prefill_policy,
            PrefillPolicy::TokenLoad
        );
        let bad_decode = rc(r#"{"decodeScorePolicy":"fastest"}"#);
        let err = PdSettings::resolve(&d, Some(&bad_decode)).unwrap_err();
        assert!(
            matches!(err, RouteError::Selection { detail } if detail.contains("unknown decodeScorePolicy \"fastest\""))
        );
    }

    #[test]
    fn an_unknown_bucket_serve_mode_in_a_profile_keeps_the_env_mode() {
        let (d, _) = PdDefaults::from_lookup(|k| match k {
            "AIBRIX_BUCKET_SERVE_MODE" => Some("rps".into()),
            _ => None,
        });
        let mode = |json: &str| {
            PdSettings::resolve(&d, Some(&rc(json)))
                .unwrap()
                .bucket_serve_mode
        };
        assert_eq!(
            mode(r#"{"bucketServeMode":"fastest"}"#),
            BucketServeMode::Rps
        );
        assert_eq!(
            mode(r#"{"bucketServeMode":" Throughput "}"#),
            BucketServeMode::Throughput
        );
        assert_eq!(mode(r#"{"bucketServe":true}"#), BucketServeMode::Rps);
    }
}
