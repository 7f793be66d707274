//! `model.aibrix.ai/config` annotations: profiles, the default profile, the locked strategy,
//! `config-profile: auto` hints, per-profile PD knobs, and the routing-strategy precedence
//! (locked > header > profile > `ROUTING_ALGORITHM`).

use hashbrown::HashMap;
use serde::Deserialize;
use serde_json::{Map, Value};

/// A profile's `routingConfig`: the PD fields, `auto` hints and per-profile knobs.
///
/// Parsed field by field so one bad value drops only that field (the environment default then
/// applies), as AIBrix does, instead of discarding the whole annotation. The knobs are accepted
/// both flat and under a `pd` sub-object: the documentation says "flat under pd" and AIBrix's
/// code reads a `pd` object.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoutingConfig {
    pub combined: bool,
    pub prompt_len_bucket_min_length: i64,
    pub prompt_len_bucket_max_length: i64,
    pub prefill_score_policy: Option<String>,
    pub decode_score_policy: Option<String>,
    pub prompt_length_bucketing: Option<bool>,
    pub bucket_serve: Option<bool>,
    pub bucket_serve_mode: Option<String>,
    pub hints: Hints,
    pub knobs: Knobs,
    /// Fields present with a value of the wrong type or range, for a log line.
    pub invalid: Vec<String>,
}

/// `config-profile: auto` hints: `*Gte` inclusive, `*Lt` exclusive.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Hints {
    pub prompt_tokens_gte: Option<i64>,
    pub prompt_tokens_lt: Option<i64>,
    pub max_tokens_gte: Option<i64>,
    pub max_tokens_lt: Option<i64>,
}

impl Hints {
    fn count(&self) -> usize {
        [
            self.prompt_tokens_gte,
            self.prompt_tokens_lt,
            self.max_tokens_gte,
            self.max_tokens_lt,
        ]
        .iter()
        .filter(|h| h.is_some())
        .count()
    }

    /// Every hint present matches; a hint on an unknown feature (no `max_tokens`) does not.
    fn matches(&self, prompt_tokens: i64, max_tokens: Option<i64>) -> bool {
        let ge = |hint: Option<i64>, v: Option<i64>| hint.is_none_or(|h| v.is_some_and(|v| v >= h));
        let lt = |hint: Option<i64>, v: Option<i64>| hint.is_none_or(|h| v.is_some_and(|v| v < h));
        ge(self.prompt_tokens_gte, Some(prompt_tokens))
            && lt(self.prompt_tokens_lt, Some(prompt_tokens))
            && ge(self.max_tokens_gte, max_tokens)
            && lt(self.max_tokens_lt, max_tokens)
    }

    /// Prompt-length boundaries, so the caller counts tokens exactly only near one.
    pub fn prompt_boundaries(&self) -> impl Iterator<Item = i64> {
        [self.prompt_tokens_gte, self.prompt_tokens_lt]
            .into_iter()
            .flatten()
    }
}

/// Per-profile overrides of gateway environment variables. `None` keeps the env value.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Knobs {
    pub prefill_request_timeout: Option<f64>,
    pub prefill_load_imbalance_min_spread: Option<f64>,
    pub decode_load_imbalance_min_spread: Option<f64>,
    pub decode_throughput_imbalance_min_spread: Option<f64>,
    pub decode_score_ratio_threshold: Option<f64>,
    pub decode_lb_weight_running: Option<f64>,
    pub decode_lb_weight_throughput: Option<f64>,
    pub hybrid_cache_load_factor: Option<f64>,
    pub min_match_pct: Option<f64>,
    pub token_load_kv_weight: Option<f64>,
    pub token_load_request_cost: Option<f64>,
    pub token_load_ttl_seconds: Option<f64>,
    pub token_load_session_ttl_seconds: Option<f64>,
    pub decode_abort_timeout: Option<f64>,
    pub decode_abort_retry_delay: Option<f64>,
    pub decode_first_response_timeout: Option<f64>,
    pub decode_response_timeout: Option<f64>,
    pub decode_stream_idle_timeout: Option<f64>,
}

/// Valid range of a knob.
#[derive(Clone, Copy)]
enum Range {
    Positive,
    NonNegative,
    /// A whole number ≥ 0: AIBrix's field is an integer (a TTL of 0.5 s would otherwise
    /// truncate to 0, which switches the force-release off).
    WholeNonNegative,
    Within(f64, f64),
}

impl Range {
    fn accepts(self, v: f64) -> bool {
        v.is_finite()
            && match self {
                Range::Positive => v > 0.0,
                Range::NonNegative => v >= 0.0,
                Range::WholeNonNegative => v >= 0.0 && v.fract() == 0.0,
                Range::Within(lo, hi) => (lo..=hi).contains(&v),
            }
    }
}

type KnobSlot = fn(&mut Knobs) -> &mut Option<f64>;

const KNOBS: [(&str, Range, KnobSlot); 18] = [
    ("prefillRequestTimeout", Range::Positive, |k| {
        &mut k.prefill_request_timeout
    }),
    ("prefillLoadImbalanceMinSpread", Range::Positive, |k| {
        &mut k.prefill_load_imbalance_min_spread
    }),
    ("decodeLoadImbalanceMinSpread", Range::Positive, |k| {
        &mut k.decode_load_imbalance_min_spread
    }),
    ("decodeThroughputImbalanceMinSpread", Range::Positive, |k| {
        &mut k.decode_throughput_imbalance_min_spread
    }),
    ("decodeScoreRatioThreshold", Range::Positive, |k| {
        &mut k.decode_score_ratio_threshold
    }),
    ("decodeLBWeightRunning", Range::Positive, |k| {
        &mut k.decode_lb_weight_running
    }),
    ("decodeLBWeightThroughput", Range::Positive, |k| {
        &mut k.decode_lb_weight_throughput
    }),
    ("hybridCacheLoadFactor", Range::Within(0.0, 1.0), |k| {
        &mut k.hybrid_cache_load_factor
    }),
    ("minMatchPct", Range::Within(0.0, 100.0), |k| {
        &mut k.min_match_pct
    }),
    ("tokenLoadKVWeight", Range::Positive, |k| {
        &mut k.token_load_kv_weight
    }),
    ("tokenLoadRequestCost", Range::Positive, |k| {
        &mut k.token_load_request_cost
    }),
    ("tokenLoadTTLSeconds", Range::WholeNonNegative, |k| {
        &mut k.token_load_ttl_seconds
    }),
    ("tokenLoadSessionTTLSeconds", Range::WholeNonNegative, |k| {
        &mut k.token_load_session_ttl_seconds
    }),
    ("decodeAbortTimeout", Range::NonNegative, |k| {
        &mut k.decode_abort_timeout
    }),
    ("decodeAbortRetryDelay", Range::NonNegative, |k| {
        &mut k.decode_abort_retry_delay
    }),
    ("decodeFirstResponseTimeout", Range::NonNegative, |k| {
        &mut k.decode_first_response_timeout
    }),
    ("decodeResponseTimeout", Range::NonNegative, |k| {
        &mut k.decode_response_timeout
    }),
    ("decodeStreamIdleTimeout", Range::NonNegative, |k| {
        &mut k.decode_stream_idle_timeout
    }),
];

impl RoutingConfig {
    fn from_value(value: &Value) -> RoutingConfig {
        let mut rc = RoutingConfig::default();
        let Value::Object(map) = value else {
            if !value.is_null() {
                rc.invalid.push("routingConfig".into());
            }
            return rc;
        };
        let bool_field = |name: &str, invalid: &mut Vec<String>| match map.get(name) {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(_) => {
                invalid.push(name.into());
                None
            }
        };
        let mut invalid = Vec::new();
        rc.combined = bool_field("combined", &mut invalid).unwrap_or(false);
        rc.prompt_length_bucketing = bool_field("promptLengthBucketing", &mut invalid);
        rc.bucket_serve = bool_field("bucketServe", &mut invalid);
        rc.prompt_len_bucket_min_length =
            int_field(map, "promptLenBucketMinLength", &mut invalid).unwrap_or(0);
        rc.prompt_len_bucket_max_length =
            int_field(map, "promptLenBucketMaxLength", &mut invalid).unwrap_or(0);
        rc.prefill_score_policy = str_field(map, "prefillScorePolicy", &mut invalid);
        rc.decode_score_policy = str_field(map, "decodeScorePolicy", &mut invalid);
        rc.bucket_serve_mode = str_field(map, "bucketServeMode", &mut invalid).filter(|mode| {
            // An unknown mode is dropped (the env mode applies) and named in the warning.
            let known = mode
                .parse::<crate::core::pd::bucket_serve::BucketServeMode>()
                .is_ok();
            if !known {
                invalid.push("bucketServeMode".into());
            }
            known
        });
        rc.hints = Hints {
            prompt_tokens_gte: int_field(map, "promptTokensGte", &mut invalid),
            prompt_tokens_lt: int_field(map, "promptTokensLt", &mut invalid),
            max_tokens_gte: int_field(map, "maxTokensGte", &mut invalid),
            max_tokens_lt: int_field(map, "maxTokensLt", &mut invalid),
        };
        let nested = match map.get("pd") {
            Some(Value::Object(pd)) => Some(pd),
            _ => None,
        };
        for (name, range, slot) in KNOBS {
            // The `pd` object wins over a flat field of the same name.
            let raw = nested.and_then(|pd| pd.get(name)).or_else(|| map.get(name));
            match raw {
                None | Some(Value::Null) => {}
                Some(v) => match v.as_f64().filter(|v| range.accepts(*v)) {
                    Some(v) => *slot(&mut rc.knobs) = Some(v),
                    None => invalid.push(name.into()),
                },
            }
        }
        rc.invalid = invalid;
        rc
    }

    /// The prompt-length range `[min, max]` of a pod, or `None` when it can serve no length
    /// (min > max). `max == 0` means unlimited; a negative min counts as 0.
    pub fn prompt_range(&self) -> Option<(i64, i64)> {
        let min = self.prompt_len_bucket_min_length.max(0);
        let max = match self.prompt_len_bucket_max_length {
            0 => i64::from(i32::MAX),
            m => m,
        };
        (min <= max).then_some((min, max))
    }

    /// True when the range holds `len` (both ends inclusive).
    pub fn accepts_prompt_len(&self, len: i64) -> bool {
        self.prompt_range()
            .is_some_and(|(min, max)| (min..=max).contains(&len))
    }
}

fn int_field(map: &Map<String, Value>, name: &str, invalid: &mut Vec<String>) -> Option<i64> {
    match map.get(name) {
        None | Some(Value::Null) => None,
        Some(v) => match v
            .as_i64()
            .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
        {
            Some(i) => Some(i),
            None => {
                invalid.push(name.into());
                None
            }
        },
    }
}

fn str_field(map: &Map<String, Value>, name: &str, invalid: &mut Vec<String>) -> Option<String> {
    match map.get(name) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            invalid.push(name.into());
            None
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    pub routing_strategy: Option<String>,
    pub routing_config: RoutingConfig,
    /// AIBrix's per-model request rate (`requestsPerSecond`), enforced by pd-control when it
    /// checks limits (`core::user_limits`); a value that is not a positive number is none.
    pub requests_per_second: Option<f64>,
}

impl<'de> Deserialize<'de> for Profile {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Profile, D::Error> {
        let value = Value::deserialize(d)?;
        let routing_strategy = value
            .get("routingStrategy")
            .and_then(Value::as_str)
            .map(str::to_string);
        let routing_config = value
            .get("routingConfig")
            .map(RoutingConfig::from_value)
            .unwrap_or_default();
        let requests_per_second = value
            .get("requestsPerSecond")
            .and_then(Value::as_f64)
            .filter(|rps| rps.is_finite() && *rps > 0.0);
        Ok(Profile {
            routing_strategy,
            routing_config,
            requests_per_second,
        })
    }
}

/// A parsed `model.aibrix.ai/config` annotation.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ModelConfig {
    pub locked_routing_strategy: Option<String>,
    pub default_profile: Option<String>,
    pub profiles: HashMap<String, Profile>,
}

/// What in a `model.aibrix.ai/config` annotation has no effect, for pd-control to name once
/// per annotation: the whole annotation when it does not parse (it counts as absent, so a
/// `lockedRoutingStrategy` in it is lost too), else each profile's dropped `routingConfig`
/// fields and its score policies no gateway knows (an unknown prefill policy keeps the
/// default; an unknown decode policy fails the profile's PD requests with 503, as in AIBrix).
/// AIBrix drops such values with a warning; here the gateways drop them quietly, per request.
pub fn annotation_problems(annotation: &str) -> Vec<String> {
    if annotation.trim().is_empty() {
        return Vec::new();
    }
    let Some(config) = ModelConfig::parse(annotation) else {
        return vec![
            "the annotation is not a JSON object with profiles: it is ignored whole".to_string(),
        ];
    };
    let mut names: Vec<&String> = config.profiles.keys().collect();
    names.sort();
    let mut problems = Vec::new();
    for name in names {
        let rc = &config.profiles[name].routing_config;
        if !rc.invalid.is_empty() {
            problems.push(format!(
                "profile {name:?}: routingConfig values dropped as invalid: {}",
                rc.invalid.join(", ")
            ));
        }
        if let Some(p) = rc.prefill_score_policy.as_deref() {
            if !p.trim().is_empty() && crate::core::score::PrefillPolicy::parse(p).is_none() {
                problems.push(format!(
                    "profile {name:?}: prefillScorePolicy {p:?} is unknown; the gateway default applies"
                ));
            }
        }
        if let Err(e) =
            crate::core::score::DecodePolicy::parse_override(rc.decode_score_policy.as_deref())
        {
            problems.push(format!(
                "profile {name:?}: {e}; its PD requests are refused with 503"
            ));
        }
    }
    problems
}

/// The header value that asks for hint-based profile selection.
pub const AUTO_PROFILE: &str = "auto";

impl ModelConfig {
    /// Parses an annotation. One that does not parse, or has no profiles, counts as absent.
    pub fn parse(annotation: &str) -> Option<ModelConfig> {
        if annotation.trim().is_empty() {
            return None;
        }
        let config: ModelConfig = serde_json::from_str(annotation).ok()?;
        (!config.profiles.is_empty()).then_some(config)
    }

    /// `defaultProfile`, or `"default"` when it is unset or empty.
    pub fn fallback_name(&self) -> &str {
        self.default_profile
            .as_deref()
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .unwrap_or("default")
    }

    /// The profile named `name` if it exists, else the fallback profile (or none).
    pub fn profile(&self, name: Option<&str>) -> Option<&Profile> {
        if let Some(p) = name.map(str::trim).and_then(|n| self.profiles.get(n)) {
            return Some(p);
        }
        self.profiles.get(self.fallback_name())
    }

    /// True when some profile carries an `auto` hint on prompt length, so the request's
    /// token count matters.
    pub fn prompt_hint_boundaries(&self) -> impl Iterator<Item = i64> + '_ {
        self.profiles
            .values()
            .flat_map(|p| p.routing_config.hints.prompt_boundaries())
    }

    /// `config-profile: auto`: among profiles with at least one hint whose hints all match,
    /// the most specific (more hints, then higher promptTokensGte, lower promptTokensLt,
    /// higher maxTokensGte, lower maxTokensLt), names visited in sorted order so ties go to
    /// the first name. `None` when nothing matches (the caller uses the fallback name).
    pub fn auto_profile(&self, prompt_tokens: i64, max_tokens: Option<i64>) -> Option<&str> {
        let mut names: Vec<&String> = self.profiles.keys().collect();
        names.sort();
        let mut best: Option<(&str, &Hints)> = None;
        for name in names {
            let hints = &self.profiles[name].routing_config.hints;
            if hints.count() == 0 || !hints.matches(prompt_tokens, max_tokens) {
                continue;
            }
            if best.is_none_or(|(_, b)| more_specific(hints, b)) {
                best = Some((name.as_str(), hints));
            }
        }
        best.map(|(name, _)| name)
    }
}

fn more_specific(a: &Hints, b: &Hints) -> bool {
    use std::cmp::Ordering::*;
    let low = i64::MIN;
    let high = i64::MAX;
    let order = a
        .count()
        .cmp(&b.count())
        .then(
            a.prompt_tokens_gte
                .unwrap_or(low)
                .cmp(&b.prompt_tokens_gte.unwrap_or(low)),
        )
        .then(
            b.prompt_tokens_lt
                .unwrap_or(high)
                .cmp(&a.prompt_tokens_lt.unwrap_or(high)),
        )
        .then(
            a.max_tokens_gte
                .unwrap_or(low)
                .cmp(&b.max_tokens_gte.unwrap_or(low)),
        )
        .then(
            b.max_tokens_lt
                .unwrap_or(high)
                .cmp(&a.max_tokens_lt.unwrap_or(high)),
        );
    order == Greater
}

/// Resolves the routing strategy: locked > header > profile > env. `None` means no strategy.
pub fn resolve_strategy(
    config: Option<&ModelConfig>,
    profile: Option<&Profile>,
    header: Option<&str>,
    env_default: Option<&str>,
) -> Option<String> {
    let non_empty = |s: Option<&str>| {
        s.map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    };
    non_empty(config.and_then(|c| c.locked_routing_strategy.as_deref()))
        .or_else(|| non_empty(header))
        .or_else(|| non_empty(profile.and_then(|p| p.routing_strategy.as_deref())))
        .or_else(|| non_empty(env_default))
}

/// A routing strategy the gateway implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Pd,
    Random,
    LeastRequest,
    Throughput,
    PrefixCache,
    LeastKvCache,
    /// AIBrix's name for the same signal read from vLLM's older `gpu_cache_usage_perc`;
    /// pd-control reads either metric into one KV-cache usage.
    LeastGpuCache,
    LeastLatency,
    /// One conversation to one standard pod (see `pd::session_affinity`).
    SessionAffinity,
    /// The less loaded of two pods drawn at random.
    PowerOfTwo,
    /// Running requests over the pod's drain rate: the time its queue takes to clear.
    LoadBalance,
    /// A uniform pick among the K least-loaded pods (see `pd::top_k`).
    LeastRequestTopK,
    /// AIBrix's LoRA strategy: the least-loaded pod that has the request's adapter loaded.
    /// A model view holds only such pods (an adapter's model is its instances), so this is
    /// least-request over that view.
    LoraAffinity,
    /// AIBrix's Virtual Token Counter: users placed on the pod line by their recent tokens
    /// (see `pd::vtc`).
    VtcBasic,
    /// The lowest engine utilization gauge (xLLM's `engine_utilization`); pods that do not
    /// export it are passed over, and with none exporting it a pod is drawn at random.
    LeastUtilization,
    /// The lowest GPU busy-time ratio, read like `LeastUtilization`. AIBrix maps this metric
    /// to no engine, so on vLLM, SGLang and TRT-LLM fleets both gateways draw at random;
    /// accepted so that a profile naming it keeps routing after the move.
    LeastBusyTime,
    /// AIBrix's Preble-style rule: a prompt mostly held goes to the least-loaded holder of
    /// its longest match, any other to the least-loaded pod (see `pd::preble`).
    PrefixCachePreble,
    /// AIBrix's external replica router: an operator's HTTP service picks the standard pod,
    /// through pd-control (see `core::external`). Exclusive, like `pd`.
    External,
}

impl Strategy {
    /// Whether the strategy scores pods by how much of the prompt the prefix index says
    /// they hold (the index is then looked up before the pick and told the pick after).
    pub fn reads_prefix_index(self) -> bool {
        matches!(self, Strategy::PrefixCache | Strategy::PrefixCachePreble)
    }

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Pd => "pd",
            Strategy::Random => "random",
            Strategy::LeastRequest => "least-request",
            Strategy::Throughput => "throughput",
            Strategy::PrefixCache => "prefix-cache",
            Strategy::LeastKvCache => "least-kv-cache",
            Strategy::LeastGpuCache => "least-gpu-cache",
            Strategy::LeastLatency => "least-latency",
            Strategy::SessionAffinity => "session-affinity",
            Strategy::PowerOfTwo => "power-of-two",
            Strategy::LoadBalance => "load-balance",
            Strategy::LeastRequestTopK => "least-request-top-k",
            Strategy::LoraAffinity => "lora-affinity",
            Strategy::VtcBasic => "vtc-basic",
            Strategy::LeastUtilization => "least-utilization",
            Strategy::LeastBusyTime => "least-busy-time",
            Strategy::PrefixCachePreble => "prefix-cache-preble",
            Strategy::External => "external",
        }
    }

    /// Every strategy the gateway implements.
    pub const ALL: [Strategy; 18] = [
        Strategy::Pd,
        Strategy::Random,
        Strategy::LeastRequest,
        Strategy::Throughput,
        Strategy::PrefixCache,
        Strategy::LeastKvCache,
        Strategy::LeastGpuCache,
        Strategy::LeastLatency,
        Strategy::SessionAffinity,
        Strategy::PowerOfTwo,
        Strategy::LoadBalance,
        Strategy::LeastRequestTopK,
        Strategy::LoraAffinity,
        Strategy::VtcBasic,
        Strategy::LeastUtilization,
        Strategy::LeastBusyTime,
        Strategy::PrefixCachePreble,
        Strategy::External,
    ];

    fn from_name(name: &str) -> Option<Strategy> {
        Strategy::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Parses a strategy value, AIBrix's multi-strategy syntax: `name[:weight]` items joined
    /// by commas, weights whole numbers in 0..=1 000 000 (1 when left out), 0 dropping the
    /// item. `pd` is exclusive: if it appears with a weight above 0, it is the strategy. Several
    /// other items are blended (see `pd::blend`). An unknown name, an empty item, a bad weight
    /// or nothing left after dropping the zeros refuses the whole value.
    pub fn parse(value: &str) -> Result<StrategySpec, String> {
        let refuse = || value.to_string();
        let mut items: Vec<(Strategy, u32)> = Vec::new();
        for item in value.split(',').map(str::trim) {
            let (name, weight) = match item.split_once(':') {
                Some((n, w)) => (
                    n.trim(),
                    w.trim()
                        .parse::<u32>()
                        .ok()
                        .filter(|w| *w <= MAX_STRATEGY_WEIGHT)
                        .ok_or_else(refuse)?,
                ),
                None => (item, 1),
            };
            let strategy = Strategy::from_name(name).ok_or_else(refuse)?;
            if weight > 0 && !items.iter().any(|(s, _)| *s == strategy) {
                items.push((strategy, weight));
            } else if let Some(kept) = items.iter_mut().find(|(s, _)| *s == strategy) {
                // A name listed twice counts once, with the weights added.
                kept.1 = kept.1.saturating_add(weight);
            }
        }
        if items.iter().any(|(s, _)| *s == Strategy::Pd) {
            return Ok(StrategySpec::One(Strategy::Pd));
        }
        // The external service chooses the pod itself: nothing to blend it with.
        if items.iter().any(|(s, _)| *s == Strategy::External) {
            return Ok(StrategySpec::One(Strategy::External));
        }
        match items.as_slice() {
            [] => Err(refuse()),
            [(one, _)] => Ok(StrategySpec::One(*one)),
            _ => Ok(StrategySpec::Blend(Blend {
                items,
                label: value.trim().to_string(),
            })),
        }
    }
}

/// AIBrix's bound on a multi-strategy weight.
pub const MAX_STRATEGY_WEIGHT: u32 = 1_000_000;

/// A routing-strategy value once parsed.
#[derive(Debug, Clone, PartialEq)]
pub enum StrategySpec {
    One(Strategy),
    /// Two or more single-pod strategies, scored together (see `pd::blend`).
    Blend(Blend),
}

/// Single-pod strategies blended by weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Blend {
    /// Distinct strategies, weights above 0, in the order given.
    pub items: Vec<(Strategy, u32)>,
    /// The value as configured, echoed in `routing-strategy` (AIBrix echoes it unchanged).
    pub label: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"{"lockedRoutingStrategy":"","defaultProfile":"main",
        "profiles":{"main":{"routingStrategy":"pd","routingConfig":{"combined":true,"promptLenBucketMaxLength":2048}},
                    "other":{"routingStrategy":"random","routingConfig":"garbage"}}}"#;

    #[test]
    fn profiles_and_defaults() {
        let c = ModelConfig::parse(CONFIG).unwrap();
        let main = c.profile(None).unwrap();
        assert!(main.routing_config.combined);
        assert_eq!(main.routing_config.prompt_len_bucket_max_length, 2048);
        assert_eq!(
            c.profile(Some(" other "))
                .unwrap()
                .routing_strategy
                .as_deref(),
            Some("random")
        );
        assert_eq!(
            c.profile(Some("other")).unwrap().routing_config.invalid,
            vec!["routingConfig"]
        );
        assert_eq!(c.profile(Some("missing")), Some(main));
        assert!(ModelConfig::parse(r#"{"profiles":{}}"#).is_none());
        assert!(ModelConfig::parse("not json").is_none());
    }

    #[test]
    fn knobs_flat_or_nested_and_bad_values_dropped() {
        let c = ModelConfig::parse(
            r#"{"profiles":{"default":{"routingConfig":{
                "decodeScoreRatioThreshold": 2.5, "minMatchPct": 140, "tokenLoadTTLSeconds": 0,
                "tokenLoadSessionTTLSeconds": 0.5, "prefillRequestTimeout": -1, "pd": {"decodeScoreRatioThreshold": 3, "hybridCacheLoadFactor": 0},
                "combined": "yes", "promptLenBucketMinLength": 10, "bucketServeMode": "fastest"}}}}"#,
        )
        .unwrap();
        let rc = &c.profile(None).unwrap().routing_config;
        assert_eq!(
            rc.knobs.decode_score_ratio_threshold,
            Some(3.0),
            "the pd object wins"
        );
        assert_eq!(
            rc.knobs.hybrid_cache_load_factor,
            Some(0.0),
            "0 turns the discount off"
        );
        assert_eq!(rc.knobs.token_load_ttl_seconds, Some(0.0));
        assert_eq!(
            rc.knobs.token_load_session_ttl_seconds, None,
            "a fraction of a second is not AIBrix's integer"
        );
        assert_eq!(rc.knobs.min_match_pct, None);
        assert_eq!(rc.knobs.prefill_request_timeout, None);
        assert!(!rc.combined);
        assert_eq!(rc.prompt_len_bucket_min_length, 10);
        assert_eq!(rc.bucket_serve_mode, None);
        let mut invalid = rc.invalid.clone();
        invalid.sort();
        assert_eq!(
            invalid,
            [
                "bucketServeMode",
                "combined",
                "minMatchPct",
                "prefillRequestTimeout",
                "tokenLoadSessionTTLSeconds"
            ]
        );
    }

    #[test]
    fn annotation_problems_name_what_has_no_effect() {
        assert!(annotation_problems("").is_empty());
        assert!(
            annotation_problems(CONFIG).len() == 1,
            "{:?}",
            annotation_problems(CONFIG)
        );
        assert_eq!(
            annotation_problems("{\"lockedRoutingStrategy\":\"pd\"").len(),
            1,
            "cut JSON"
        );
        let problems = annotation_problems(
            r#"{"profiles":{"b":{"routingConfig":{"prefillScorePolicy":"prefix-cache",
                "decodeScorePolicy":"fastest","tokenLoadTTLSeconds":0.5}},
                "a":{"routingConfig":{"prefillScorePolicy":"token_load"}}}}"#,
        );
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].contains("tokenLoadTTLSeconds"), "{problems:?}");
        assert!(problems[1].contains("\"prefix-cache\""), "{problems:?}");
        assert!(problems[2].contains("fastest"), "{problems:?}");
        let fine = r#"{"defaultProfile":"p","profiles":{"p":{"routingStrategy":"pd",
            "routingConfig":{"prefillScorePolicy":"token_load","decodeScorePolicy":"Token_Load"}}}}"#;
        assert!(
            annotation_problems(fine).is_empty(),
            "{:?}",
            annotation_problems(fine)
        );
    }

    #[test]
    fn prompt_ranges() {
        let rc = |min: i64, max: i64| RoutingConfig {
            prompt_len_bucket_min_length: min,
            prompt_len_bucket_max_length: max,
            ..RoutingConfig::default()
        };
        assert!(rc(0, 2048).accepts_prompt_len(2048), "max is inclusive");
        assert!(rc(16, 32).accepts_prompt_len(16), "min is inclusive");
        assert!(!rc(16, 32).accepts_prompt_len(33));
        assert!(rc(2048, 0).accepts_prompt_len(1_000_000), "0 = unlimited");
        assert!(rc(-5, 10).accepts_prompt_len(0), "negative min counts as 0");
        assert!(
            !rc(20, 10).accepts_prompt_len(15),
            "min > max serves nothing"
        );
    }

    #[test]
    fn auto_profile_picks_the_most_specific_match() {
        let c = ModelConfig::parse(
            r#"{"profiles":{
                "default":{},
                "short":{"routingConfig":{"promptTokensLt":100}},
                "short-small":{"routingConfig":{"promptTokensLt":100,"maxTokensLt":64}},
                "long":{"routingConfig":{"promptTokensGte":100}},
                "longer":{"routingConfig":{"promptTokensGte":1000}},
                "b-tie":{"routingConfig":{"promptTokensGte":1000}}}}"#,
        )
        .unwrap();
        assert_eq!(
            c.auto_profile(10, Some(16)),
            Some("short-small"),
            "more hints win"
        );
        assert_eq!(
            c.auto_profile(10, None),
            Some("short"),
            "unknown max_tokens fails its hint"
        );
        assert_eq!(c.auto_profile(500, None), Some("long"));
        assert_eq!(
            c.auto_profile(5000, None),
            Some("b-tie"),
            "higher gte wins; ties go to the first name"
        );
        let none = ModelConfig::parse(r#"{"profiles":{"default":{}}}"#).unwrap();
        assert_eq!(none.auto_profile(10, None), None);
    }

    #[test]
    fn strategy_precedence() {
        let locked = ModelConfig::parse(
            r#"{"lockedRoutingStrategy":"pd","profiles":{"default":{"routingStrategy":"random"}}}"#,
        )
        .unwrap();
        let p = locked.profile(None);
        assert_eq!(
            resolve_strategy(Some(&locked), p, Some("random"), None).as_deref(),
            Some("pd")
        );
        let open =
            ModelConfig::parse(r#"{"profiles":{"default":{"routingStrategy":"pd"}}}"#).unwrap();
        let p = open.profile(None);
        assert_eq!(
            resolve_strategy(Some(&open), p, Some(" random "), None).as_deref(),
            Some("random")
        );
        assert_eq!(
            resolve_strategy(Some(&open), p, Some(""), Some("x")).as_deref(),
            Some("pd")
        );
        assert_eq!(
            resolve_strategy(None, None, None, Some("least-request")).as_deref(),
            Some("least-request")
        );
        assert_eq!(resolve_strategy(None, None, None, None), None);
    }

    #[test]
    fn strategy_lists() {
        use StrategySpec::One;
        assert_eq!(Strategy::parse("pd"), Ok(One(Strategy::Pd)));
        assert_eq!(
            Strategy::parse("random:3, pd"),
            Ok(One(Strategy::Pd)),
            "pd is exclusive"
        );
        assert_eq!(
            Strategy::parse("pd:0, random"),
            Ok(One(Strategy::Random)),
            "a zero weight drops even pd"
        );
        assert_eq!(
            Strategy::parse("least-request:5, throughput:0"),
            Ok(One(Strategy::LeastRequest)),
            "one item left is that strategy alone"
        );
        assert_eq!(
            Strategy::parse(" least-request:10,throughput "),
            Ok(StrategySpec::Blend(Blend {
                items: vec![(Strategy::LeastRequest, 10), (Strategy::Throughput, 1)],
                label: "least-request:10,throughput".into(),
            }))
        );
        assert_eq!(
            Strategy::parse("least-request,throughput:2,least-request:3"),
            Ok(StrategySpec::Blend(Blend {
                items: vec![(Strategy::LeastRequest, 4), (Strategy::Throughput, 2)],
                label: "least-request,throughput:2,least-request:3".into(),
            })),
            "a repeated name adds its weights"
        );
        for bad in [
            "pd,bogus",
            "random:x",
            "random:-1",
            "random:1000001",
            "random:1:2",
            "",
            "random,,least-request",
            "random,",
            "random:0,least-request:0",
        ] {
            assert!(Strategy::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Strategy::parse("random:1000000").is_ok());
    }
}
