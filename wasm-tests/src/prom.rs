//! A reader of Prometheus text exposition (what Envoy's `/stats/prometheus` and pd-control's
//! `/metrics` serve), enough for tests to ask "what is the value of this series".

use std::collections::{BTreeMap, BTreeSet};

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Every sample of one scrape, plus the `# TYPE` of each family.
#[derive(Debug, Clone, Default)]
pub struct Scrape {
    pub samples: Vec<Sample>,
    pub types: BTreeMap<String, String>,
}

impl Scrape {
    /// Parses the text format; lines it cannot read are skipped (and would show up as a
    /// missing series in the test that needs them).
    pub fn parse(text: &str) -> Scrape {
        let mut out = Scrape::default();
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                if let Some((name, kind)) = rest.split_once(' ') {
                    out.types.insert(name.to_string(), kind.trim().to_string());
                }
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            if let Some(sample) = parse_sample(line) {
                out.samples.push(sample);
            }
        }
        out
    }

    /// Samples of `name` whose labels include every pair of `labels`.
    pub fn series<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    }

    /// Sum over the matching series; 0 when there is none.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.series(name, labels).map(|s| s.value).sum()
    }

    /// The value of the one matching series, `None` when absent; panics when ambiguous.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let found: Vec<&Sample> = self.series(name, labels).collect();
        assert!(found.len() <= 1, "{name} {labels:?} matches {found:?}");
        found.first().map(|s| s.value)
    }

    /// Every metric family name (histogram `_bucket`/`_sum`/`_count` samples count under
    /// their sample names too).
    pub fn names(&self) -> BTreeSet<String> {
        self.samples.iter().map(|s| s.name.clone()).collect()
    }
}

fn parse_sample(line: &str) -> Option<Sample> {
    let (series, value) = line.rsplit_once(' ')?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    let (name, labels) = match series.split_once('{') {
        None => (series, BTreeMap::new()),
        Some((name, rest)) => (name, parse_labels(rest.strip_suffix('}')?)?),
    };
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// `a="x",b="y"` with `\"`, `\\` and `\n` escapes in values.
fn parse_labels(text: &str) -> Option<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    let mut rest = text.trim_start_matches(',');
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => {
                    end = Some(i);
                    break;
                }
                c => value.push(c),
            }
        }
        labels.insert(key.trim().to_string(), value);
        rest = after[end? + 1..].trim_start_matches(',');
    }
    Some(labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_labels_types_and_histograms() {
        let text = "# TYPE gateway_request_model_success_total counter\n\
            gateway_request_model_success_total{model=\"llama-3.1\",status=\"response_success\",status_code=\"200\"} 12\n\
            # TYPE pd_router_ttft_ms histogram\n\
            pd_router_ttft_ms_bucket{le=\"+Inf\"} 3\n\
            weird{a=\"x\\\"y,z\"} 1.5\n";
        let s = Scrape::parse(text);
        assert_eq!(
            s.value(
                "gateway_request_model_success_total",
                &[("model", "llama-3.1")]
            ),
            Some(12.0)
        );
        assert_eq!(s.types["pd_router_ttft_ms"], "histogram");
        assert_eq!(s.sum("pd_router_ttft_ms_bucket", &[("le", "+Inf")]), 3.0);
        assert_eq!(s.value("weird", &[("a", "x\"y,z")]), Some(1.5));
        assert_eq!(s.sum("absent", &[]), 0.0);
    }
}
