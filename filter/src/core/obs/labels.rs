//! Envoy stat names that become labelled Prometheus series.
//!
//! Envoy keeps one flat name per stat and turns parts of it into labels only through
//! `stats_config.stats_tags` regexes. We encode every label the way Istio's own telemetry
//! does, `<tag>=.=<value>;.;` in front of the metric name, because then one unanchored regex
//! per tag name (`(<tag>=\.=(.*?);\.;)`) extracts it from every metric, values may contain
//! dots (model names such as `llama-3.1-8b`, pod names), and Istio's `extraStatTags` generates
//! exactly those regexes for the tag names an operator lists. The remaining name is the
//! contract's metric name; Envoy's Prometheus output strips the `wasmcustom.` namespace.

/// Every tag name the filter emits; `envoy/envoy.yaml.tmpl` has one `stats_tags` entry per
/// name, and Istio users list them in `extraStatTags`.
pub const TAG_NAMES: [&str; 14] = [
    "model",
    "status",
    "status_code",
    "namespace",
    "pod",
    "pod_name",
    "roleset",
    "role",
    "reason",
    "kind",
    "bucket",
    "phase",
    "result",
    "prefill_failure_class",
];

/// The stat name of `metric` with `tags` as labels. Values lose `;` (the delimiter) and
/// control characters; nothing else in them needs escaping.
pub fn tagged(metric: &str, tags: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(
        metric.len()
            + tags
                .iter()
                .map(|(t, v)| t.len() + v.len() + 6)
                .sum::<usize>(),
    );
    for (tag, value) in tags {
        debug_assert!(TAG_NAMES.contains(tag), "tag {tag} has no stats_tags entry");
        out.push_str(tag);
        out.push_str("=.=");
        out.extend(value.chars().filter(|c| !c.is_control()).map(
            |c| {
                if c == ';' {
                    '_'
                } else {
                    c
                }
            },
        ));
        out.push_str(";.;");
    }
    out.push_str(metric);
    out
}

/// The inverse of [`tagged`], as Envoy applies the `stats_tags` regexes: the metric name and
/// the labels. Used by tests here and in the end-to-end suite's expectations.
pub fn untag(name: &str) -> (String, Vec<(String, String)>) {
    let mut tags = Vec::new();
    let mut rest = name;
    while let Some((tag, after)) = rest.split_once("=.=") {
        if tag.contains(";.;") || tag.contains('.') {
            break;
        }
        let Some((value, next)) = after.split_once(";.;") else {
            break;
        };
        tags.push((tag.to_string(), value.to_string()));
        rest = next;
    }
    (rest.to_string(), tags)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_precede_the_metric_and_survive_dots() {
        let name = tagged(
            "gateway_request_model_success_total",
            &[
                ("model", "llama-3.1-8b"),
                ("status", "response_success"),
                ("status_code", "200"),
            ],
        );
        assert_eq!(
            name,
            "model=.=llama-3.1-8b;.;status=.=response_success;.;status_code=.=200;.;gateway_request_model_success_total"
        );
        let (metric, tags) = untag(&name);
        assert_eq!(metric, "gateway_request_model_success_total");
        assert_eq!(
            tags,
            vec![
                ("model".to_string(), "llama-3.1-8b".to_string()),
                ("status".to_string(), "response_success".to_string()),
                ("status_code".to_string(), "200".to_string()),
            ]
        );
    }

    #[test]
    fn delimiter_and_control_characters_cannot_split_a_value() {
        let name = tagged("m", &[("pod", "a;.;evil=.=x\n")]);
        let (metric, tags) = untag(&name);
        assert_eq!(metric, "m");
        assert_eq!(tags, vec![("pod".to_string(), "a_._evil=.=x".to_string())]);
    }

    #[test]
    fn no_tag_name_is_a_suffix_of_another() {
        // The regexes are unanchored: `pod=\.=` must not match inside `xpod=.=`.
        for a in TAG_NAMES {
            for b in TAG_NAMES {
                if a != b {
                    assert!(
                        !format!("{b}=.=").ends_with(&format!("{a}=.=")),
                        "{a} inside {b}"
                    );
                }
            }
        }
    }
}
