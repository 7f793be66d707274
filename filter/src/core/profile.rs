//! `model.aibrix.ai/config` annotations: profiles, the default profile, the locked strategy,
//! and the routing-strategy precedence (locked > header > profile > `ROUTING_ALGORITHM`).

use hashbrown::HashMap;
use serde::Deserialize;

/// The PD fields of a profile's `routingConfig`. Unknown fields are ignored, as in AIBrix.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct RoutingConfig {
    pub combined: bool,
    pub prompt_len_bucket_min_length: i64,
    pub prompt_len_bucket_max_length: i64,
    pub prefill_score_policy: Option<String>,
    pub decode_score_policy: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Profile {
    pub routing_strategy: Option<String>,
    #[serde(deserialize_with = "lenient_routing_config")]
    pub routing_config: RoutingConfig,
}

/// An invalid `routingConfig` keeps every default instead of discarding the whole annotation.
fn lenient_routing_config<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<RoutingConfig, D::Error> {
    let value = serde_json::Value::deserialize(d)?;
    Ok(serde_json::from_value(value).unwrap_or_default())
}

/// A parsed `model.aibrix.ai/config` annotation.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ModelConfig {
    pub locked_routing_strategy: Option<String>,
    pub default_profile: Option<String>,
    pub profiles: HashMap<String, Profile>,
}

impl ModelConfig {
    /// Parses an annotation. One that does not parse, or has no profiles, counts as absent.
    pub fn parse(annotation: &str) -> Option<ModelConfig> {
        if annotation.trim().is_empty() {
            return None;
        }
        let config: ModelConfig = serde_json::from_str(annotation).ok()?;
        (!config.profiles.is_empty()).then_some(config)
    }

    /// The profile a request uses: the `config-profile` header when it names a profile,
    /// else `defaultProfile` (or `"default"`), else none.
    pub fn profile(&self, requested: Option<&str>) -> Option<&Profile> {
        if let Some(p) = requested
            .map(str::trim)
            .and_then(|name| self.profiles.get(name))
        {
            return Some(p);
        }
        let fallback = self
            .default_profile
            .as_deref()
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .unwrap_or("default");
        self.profiles.get(fallback)
    }
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
            c.profile(Some("other")).unwrap().routing_config,
            RoutingConfig::default()
        );
        assert_eq!(c.profile(Some("missing")), Some(main));
        assert!(ModelConfig::parse(r#"{"profiles":{}}"#).is_none());
        assert!(ModelConfig::parse("not json").is_none());
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
}
