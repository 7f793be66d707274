//! Per-request routing decisions that precede selection: the profile (including
//! `config-profile: auto`), the strategy, whether bucketing applies, and the prompt length.

use crate::core::config::EnvSettings;
use crate::core::errors::{sanitize_header, RouteError};
use crate::core::fleet::ModelView;
use crate::core::profile::{
    resolve_strategy, Blend, Hints, ModelConfig, RoutingConfig, Strategy, StrategySpec,
    AUTO_PROFILE,
};
use crate::core::request::RoutingRequest;

/// Everything selection needs to know about the request beyond the fleet and the loads.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The strategy; for a blend, its first item (never `pd`).
    pub strategy: Strategy,
    /// Several single-pod strategies scored together, when the value lists them.
    pub blend: Option<Blend>,
    /// The profile name pods are resolved with (the auto pick replaces the header value).
    pub profile: Option<String>,
    /// Set only for `config-profile: auto`, echoed as `x-aibrix-config-profile`.
    pub auto_profile: Option<String>,
    pub bucketing: bool,
    /// Prompt tokens (cl100k); 0 when nothing needs it.
    pub prompt_len: i64,
    /// The request-level profile's `routingConfig` (policies and knobs).
    pub routing_config: Option<RoutingConfig>,
    /// The request-level profile's `requestsPerSecond`, the model's rate limit.
    pub requests_per_second: Option<f64>,
}

impl Decision {
    /// The profile name the access log shows (filter state `wasm.pd_profile`): the one the
    /// request resolved to when the model's config has a profile of that name; `None`
    /// (printed `-`) when the request named one it does not have (one only some pods'
    /// annotations have too: looking through every pod would be a second scan of the pods
    /// per request, for a log field). The name in
    /// `config-profile` is the client's text: written as sent, `a target=forged` would forge a
    /// field of the space-separated log line, and a 60 KB value make a 60 KB line. Routing
    /// still takes the name as sent (a missing profile resolves to the fallback one, as in
    /// AIBrix); only the logged value changes.
    pub fn logged_profile(&self, model: &ModelView) -> Option<&str> {
        let name = self.profile.as_deref()?;
        let known = model
            .config
            .as_ref()
            .is_some_and(|c| c.profiles.contains_key(name));
        known.then_some(name)
    }
}

/// Resolves the profile and strategy of a request for `model`. `tokens` counts the prompt's
/// tokens given the range boundaries that matter (exact near one of them, cheap elsewhere);
/// it is called at most once, and only when bucketing or an auto profile needs the length.
pub fn decide(
    model: &ModelView,
    req: &RoutingRequest,
    strategy_header: Option<&str>,
    profile_header: Option<&str>,
    env: &EnvSettings,
    tokens: &dyn Fn(&[i64]) -> i64,
) -> Result<Decision, RouteError> {
    let config = model.config.as_ref();
    let requested = profile_header.map(str::trim).filter(|p| !p.is_empty());
    let mut prompt_len: Option<i64> = None;
    let mut boundaries: Vec<i64> = Vec::new();

    let (profile, auto_profile) = match (config, requested) {
        (Some(c), Some(p)) if p.eq_ignore_ascii_case(AUTO_PROFILE) => {
            boundaries.extend(c.prompt_hint_boundaries());
            // The count also decides Step 0's bucket, and the profile that fixes the buckets
            // is not known yet: every profile auto may pick brings its pods' edges.
            for name in auto_candidates(c) {
                let on = c
                    .profile(Some(name))
                    .and_then(|p| p.routing_config.prompt_length_bucketing)
                    .unwrap_or(env.pd.prompt_length_bucketing);
                if on {
                    push_bucket_edges(model, Some(name), &mut boundaries);
                }
            }
            let len = tokens(&boundaries);
            prompt_len = Some(len);
            let max_tokens = req.max_tokens;
            let name = c
                .auto_profile(len, max_tokens)
                .unwrap_or_else(|| c.fallback_name())
                .to_string();
            (Some(name.clone()), Some(name))
        }
        (_, p) => (p.map(str::to_string), None),
    };
    let resolved = config.and_then(|c| c.profile(profile.as_deref()));
    let routing_config = resolved.map(|p| p.routing_config.clone());
    let requests_per_second = resolved.and_then(|p| p.requests_per_second);
    let strategy_value = resolve_strategy(
        config,
        resolved,
        strategy_header,
        env.routing_algorithm.as_deref(),
    );
    let spec = match strategy_value {
        None => StrategySpec::One(Strategy::Random),
        Some(v) => {
            Strategy::parse(&v).map_err(|bad| RouteError::BadStrategy(sanitize_header(&bad)))?
        }
    };
    let (strategy, blend) = match spec {
        StrategySpec::One(s) => (s, None),
        StrategySpec::Blend(b) => (
            b.items.first().map_or(Strategy::Random, |(s, _)| *s),
            Some(b),
        ),
    };
    let bucketing = routing_config
        .as_ref()
        .and_then(|rc| rc.prompt_length_bucketing)
        .unwrap_or(env.pd.prompt_length_bucketing);
    let prompt_len = match (strategy, bucketing, prompt_len) {
        (_, _, Some(len)) => len,
        (Strategy::Pd, true, None) => {
            push_bucket_edges(model, profile.as_deref(), &mut boundaries);
            tokens(&boundaries)
        }
        _ => 0,
    };
    Ok(Decision {
        strategy,
        blend,
        profile,
        auto_profile,
        bucketing,
        prompt_len,
        routing_config,
        requests_per_second,
    })
}

/// The profile names `config-profile: auto` can resolve to: those with a hint, and the
/// fallback name (what it resolves to when no hinted profile matches).
fn auto_candidates(c: &ModelConfig) -> impl Iterator<Item = &str> {
    c.profiles
        .iter()
        .filter(|(_, p)| p.routing_config.hints != Hints::default())
        .map(|(name, _)| name.as_str())
        .chain(std::iter::once(c.fallback_name()))
}

/// Appends the prompt-length range edges of the pods under `profile`: the boundaries Step 0
/// compares the prompt with, so the count is exact wherever one of them could change the
/// bucket. A range equal to the previous pod's is skipped (a roleset's pods usually share
/// theirs), which keeps the list near two entries per roleset.
fn push_bucket_edges(model: &ModelView, profile: Option<&str>, out: &mut Vec<i64>) {
    let mut last = None;
    for pod in &model.pods {
        let range = pod
            .routing_config(profile)
            .and_then(RoutingConfig::prompt_range);
        if let Some((min, max)) = range.filter(|r| last != Some(*r)) {
            out.push(min);
            out.push(max);
            last = Some((min, max));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;
    use crate::core::request::Endpoint;

    fn model(config: &str) -> ModelView {
        let mut p = pod("p0", "prefill", "g0", true);
        p.config = config.into();
        FleetView::from_snapshot(&snapshot(vec![p, pod("d0", "decode", "g0", true)])).models["m"]
            .clone()
    }

    fn req(max_tokens: Option<i64>) -> RoutingRequest {
        let body = match max_tokens {
            Some(n) => format!(r#"{{"model":"m","prompt":"hello","max_tokens":{n}}}"#),
            None => r#"{"model":"m","prompt":"hello"}"#.to_string(),
        };
        RoutingRequest::parse(Endpoint::Completions, body.as_bytes()).unwrap()
    }

    fn decide_with(
        m: &ModelView,
        strategy: Option<&str>,
        profile: Option<&str>,
        env: &EnvSettings,
        len: i64,
    ) -> Result<Decision, RouteError> {
        decide(m, &req(Some(8)), strategy, profile, env, &|_| len)
    }

    #[test]
    fn auto_profile_replaces_the_name_and_drives_the_strategy() {
        let m = model(
            r#"{"profiles":{"default":{"routingStrategy":"random"},
                "long":{"routingStrategy":"pd","routingConfig":{"promptTokensGte":1000}}}}"#,
        );
        let env = EnvSettings::default();
        let d = decide_with(&m, None, Some("AUTO"), &env, 5000).unwrap();
        assert_eq!(
            (d.strategy, d.profile.as_deref(), d.auto_profile.as_deref()),
            (Strategy::Pd, Some("long"), Some("long"))
        );
        assert_eq!(d.prompt_len, 5000);
        let d = decide_with(&m, None, Some("auto"), &env, 10).unwrap();
        assert_eq!(
            (d.strategy, d.auto_profile.as_deref()),
            (Strategy::Random, Some("default")),
            "no match: the fallback name"
        );
        let d = decide_with(&m, None, Some("long"), &env, 10).unwrap();
        assert_eq!(
            (d.strategy, d.auto_profile),
            (Strategy::Pd, None),
            "the header is only echoed for auto"
        );
    }

    #[test]
    fn bucketing_from_env_or_profile_and_token_count_only_when_needed() {
        let m = model(
            r#"{"profiles":{"default":{"routingStrategy":"pd","routingConfig":{"promptLengthBucketing":true}}}}"#,
        );
        let env = EnvSettings::default();
        let d = decide_with(&m, None, None, &env, 77).unwrap();
        assert!(d.bucketing, "the profile turns bucketing on");
        assert_eq!(d.prompt_len, 77);
        let plain = model(r#"{"profiles":{"default":{"routingStrategy":"pd"}}}"#);
        let d = decide_with(&plain, None, None, &env, 77).unwrap();
        assert_eq!(
            (d.bucketing, d.prompt_len),
            (false, 0),
            "no count without a use for it"
        );
    }

    /// A stand-in for `tokenize::prompt_tokens_if_needed` on a prompt whose cheap bounds
    /// are `lo..=hi` and whose exact count is `exact`.
    fn counted(lo: i64, hi: i64, exact: i64) -> impl Fn(&[i64]) -> i64 {
        move |b: &[i64]| {
            if b.iter().any(|e| (lo..=hi).contains(e)) {
                exact
            } else {
                lo
            }
        }
    }

    #[test]
    fn an_auto_pick_counts_exactly_at_the_bucket_edges_of_the_profiles_it_may_pick() {
        // 3 000 CJK characters: the cheap bounds say 71..=12 000, the count is 3 000. No hint
        // boundary lies in between, so only the bucket edge 2048 asks for the exact count.
        let config = |range: &str| {
            format!(
                r#"{{"profiles":{{"default":{{"routingStrategy":"random"}},
                "chat":{{"routingStrategy":"pd","routingConfig":{{"promptTokensLt":100000,
                "promptLengthBucketing":true,{range}}}}}}}}}"#
            )
        };
        let short = config(r#""promptLenBucketMaxLength":2048"#);
        let long = config(r#""promptLenBucketMinLength":2049"#);
        let pods = [
            ("p0", "prefill", "g0", &short),
            ("d0", "decode", "g0", &short),
            ("p1", "prefill", "g1", &long),
            ("d1", "decode", "g1", &long),
        ];
        let snap = snapshot(
            pods.iter()
                .map(|(name, role, roleset, config)| {
                    let mut p = pod(name, role, roleset, true);
                    p.config = config.to_string();
                    p
                })
                .collect(),
        );
        let m = FleetView::from_snapshot(&snap).models["m"].clone();
        let env = EnvSettings::default();
        let auto = |tokens: &dyn Fn(&[i64]) -> i64| {
            decide(&m, &req(None), None, Some("auto"), &env, tokens).unwrap()
        };
        let d = auto(&counted(71, 12_000, 3_000));
        assert_eq!(
            (d.auto_profile.as_deref(), d.strategy, d.bucketing),
            (Some("chat"), Strategy::Pd, true)
        );
        assert_eq!(
            d.prompt_len, 3_000,
            "the bucket is matched on the exact count"
        );
        // Far from every edge, the cheap bound stands (no exact count).
        let d = auto(&counted(100, 120, 110));
        assert_eq!(d.prompt_len, 100);
    }

    #[test]
    fn the_requested_profile_carries_the_models_request_rate() {
        let m = model(
            r#"{"profiles":{"default":{"routingStrategy":"random","requestsPerSecond":2},
                "slow":{"requestsPerSecond":0.5},"off":{"requestsPerSecond":0},
                "text":{"requestsPerSecond":"5"}}}"#,
        );
        let env = EnvSettings::default();
        let rps = |profile| {
            decide_with(&m, None, profile, &env, 0)
                .unwrap()
                .requests_per_second
        };
        assert_eq!(rps(None), Some(2.0));
        assert_eq!(rps(Some("slow")), Some(0.5));
        assert_eq!(rps(Some("off")), None, "0 is no limit");
        assert_eq!(rps(Some("text")), None, "a string is not a rate");
        assert_eq!(
            decide_with(&model(""), None, None, &env, 0)
                .unwrap()
                .requests_per_second,
            None
        );
    }

    #[test]
    fn only_a_profile_that_exists_is_logged() {
        let m = model(
            r#"{"profiles":{"default":{"routingStrategy":"random"},"batch":{"routingStrategy":"pd"}}}"#,
        );
        let env = EnvSettings::default();
        let logged = |profile: Option<&str>| {
            let d = decide_with(&m, None, profile, &env, 0).unwrap();
            d.logged_profile(&m).map(str::to_string)
        };
        assert_eq!(logged(Some("batch")).as_deref(), Some("batch"));
        assert_eq!(logged(Some(" batch ")).as_deref(), Some("batch"));
        assert_eq!(logged(Some("default")).as_deref(), Some("default"));
        assert_eq!(logged(None), None, "no header: nothing named");
        // A client's name for a profile that does not exist routes on the fallback profile,
        // and is not written.
        let forged = "a target=forged";
        let d = decide_with(&m, None, Some(forged), &env, 0).unwrap();
        assert_eq!(d.profile.as_deref(), Some(forged), "routing keeps the name");
        assert_eq!(
            d.strategy,
            Strategy::Random,
            "the fallback profile's strategy"
        );
        assert_eq!(d.logged_profile(&m), None);
        assert_eq!(logged(Some(&"x".repeat(60_000))), None);
        // Without any config, no name is known.
        let bare = model("");
        let d = decide_with(&bare, None, Some("batch"), &env, 0).unwrap();
        assert_eq!(d.logged_profile(&bare), None);
        // A profile only a later pod's annotation has is not the model's: not looked for.
        let mut p0 = pod("p0", "prefill", "g0", true);
        p0.config = r#"{"profiles":{"default":{"routingStrategy":"pd"}}}"#.into();
        let mut d0 = pod("d0", "decode", "g0", true);
        d0.config = r#"{"profiles":{"default":{},"edge":{}}}"#.into();
        let mixed = FleetView::from_snapshot(&snapshot(vec![p0, d0])).models["m"].clone();
        let d = decide_with(&mixed, None, Some("edge"), &env, 0).unwrap();
        assert_eq!(d.logged_profile(&mixed), None);
        let d = decide_with(&mixed, None, Some("default"), &env, 0).unwrap();
        assert_eq!(d.logged_profile(&mixed), Some("default"));
    }

    #[test]
    fn unknown_strategy_is_refused() {
        let m = model("");
        let err = decide_with(&m, Some("fastest"), None, &EnvSettings::default(), 0).unwrap_err();
        assert_eq!(err, RouteError::BadStrategy("fastest".into()));
        let d = decide_with(&m, None, None, &EnvSettings::default(), 0).unwrap();
        assert_eq!(
            d.strategy,
            Strategy::Random,
            "no strategy anywhere: one pod at random"
        );
    }
}
