//! One sample line of the Prometheus text exposition format, read in place.
//!
//! pd-control reads about fifteen lines of each pod's exposition every scrape round, for every
//! pod. Through prometheus-parse (a regex per line, a formatted copy of each line to hide the
//! `:` its name pattern refuses, a `HashMap<String, String>` of labels per sample) those lines
//! took a quarter of the service's CPU under `perf`, more than the HTTP exchange. This reader
//! borrows everything from the line and allocates nothing unless a label value it is asked for
//! holds an escape. prometheus-parse stays as the oracle of the property test below.
//!
//! The grammar (text format 0.0.4):
//! `name [ "{" label "=" "\"" value "\"" { "," label "=" "\"" value "\"" } [ "," ] "}" ] value [ timestamp ]`,
//! names `[a-zA-Z_:][a-zA-Z0-9_:]*`, label names without `:`, label values with `\\`, `\"` and
//! `\n` escapes, blanks (spaces, tabs) between tokens. A line that breaks it is no sample. What an
//! engine answering in OpenMetrics would add is taken too: a fractional timestamp, and an
//! exemplar (` # {…} value`) after the sample, ignored.

use std::borrow::Cow;

/// A sample: its name, its label block (validated, still escaped) and its value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// What sits between the braces, empty without labels.
    labels: &'a str,
    pub value: f64,
}

impl<'a> Sample<'a> {
    /// Reads one line (without its line break). `None` for comments, blank lines and anything
    /// that is not a well-formed sample.
    pub fn parse(line: &'a str) -> Option<Sample<'a>> {
        let line = line.trim_start_matches(BLANK);
        let name_len = line
            .bytes()
            .position(|b| !is_name_byte(b, true))
            .unwrap_or(line.len());
        let name = &line[..name_len];
        if name.is_empty() || name.as_bytes()[0].is_ascii_digit() {
            return None;
        }
        let mut rest = &line[name_len..];
        let mut labels = "";
        if let Some(after) = rest.strip_prefix('{') {
            let len = label_block_len(after)?;
            labels = &after[..len];
            rest = &after[len + 1..];
        }
        // An OpenMetrics exemplar (` # {trace_id="…"} 0.5`) may follow; it is not the sample's.
        let rest = rest.split_once('#').map_or(rest, |(sample, _)| sample);
        let mut tokens = rest.split(BLANK).filter(|t| !t.is_empty());
        // Go's float syntax as exporters write it (decimal, exponent, `NaN`, `+Inf`, `-Inf`):
        // Rust's parser reads all of it, case-insensitive about the words.
        let value: f64 = tokens.next()?.parse().ok()?;
        if let Some(timestamp) = tokens.next() {
            // Milliseconds in the text format, seconds with a fraction in OpenMetrics.
            timestamp.parse::<f64>().ok()?;
        }
        if tokens.next().is_some() {
            return None;
        }
        Some(Sample {
            name,
            labels,
            value,
        })
    }

    /// The value of label `key`, unescaped; `None` when the sample has no such label.
    pub fn label(&self, key: &str) -> Option<Cow<'a, str>> {
        Pairs { rest: self.labels }
            .find(|(name, _)| *name == key)
            .map(|(_, raw)| unescape(raw))
    }
}

const BLANK: [char; 2] = [' ', '\t'];

fn is_name_byte(b: u8, colon: bool) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || (colon && b == b':')
}

/// The length of a well-formed label block up to (not including) its closing brace.
fn label_block_len(block: &str) -> Option<usize> {
    let bytes = block.as_bytes();
    let mut i = 0;
    let skip_blanks = |mut i: usize| {
        while matches!(bytes.get(i), Some(b' ' | b'\t')) {
            i += 1;
        }
        i
    };
    loop {
        i = skip_blanks(i);
        match bytes.get(i)? {
            b'}' => return Some(i),
            b if is_name_byte(*b, false) && !b.is_ascii_digit() => {}
            _ => return None,
        }
        while bytes.get(i).is_some_and(|&b| is_name_byte(b, false)) {
            i += 1;
        }
        i = skip_blanks(i);
        if bytes.get(i) != Some(&b'=') {
            return None;
        }
        i = skip_blanks(i + 1);
        if bytes.get(i) != Some(&b'"') {
            return None;
        }
        i += 1;
        loop {
            match bytes.get(i)? {
                b'"' => break,
                b'\\' => {
                    if !matches!(bytes.get(i + 1)?, b'\\' | b'"' | b'n') {
                        return None;
                    }
                    i += 2;
                }
                _ => i += 1,
            }
        }
        i = skip_blanks(i + 1);
        match bytes.get(i)? {
            b',' => i += 1,
            b'}' => return Some(i),
            _ => return None,
        }
    }
}

/// Walks a label block [`label_block_len`] accepted: `(name, raw value)` pairs.
struct Pairs<'a> {
    rest: &'a str,
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (&'a str, &'a str);

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.rest.trim_start_matches(BLANK);
        let (name, after) = rest.split_once('=')?;
        let after = after.trim_start_matches(BLANK).strip_prefix('"')?;
        let bytes = after.as_bytes();
        let mut end = 0;
        while end < bytes.len() && bytes[end] != b'"' {
            end += if bytes[end] == b'\\' { 2 } else { 1 };
        }
        let raw = after.get(..end)?;
        let tail = after.get(end + 1..)?.trim_start_matches(BLANK);
        self.rest = tail.strip_prefix(',').unwrap_or(tail);
        Some((name.trim_end_matches(BLANK), raw))
    }
}

fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => {}
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every label as `(name, value)`, unescaped, in the line's order.
    fn labels_of(s: &Sample<'_>) -> Vec<(String, String)> {
        Pairs { rest: s.labels }
            .map(|(k, v)| (k.to_string(), unescape(v).into_owned()))
            .collect()
    }

    #[test]
    fn reads_engine_lines_with_colons_labels_and_timestamps() {
        let s = Sample::parse(
            r#"vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 4.0"#,
        )
        .unwrap();
        assert_eq!(s.name, "vllm:num_requests_running");
        assert_eq!(s.value, 4.0);
        assert_eq!(
            s.label("model_name").as_deref(),
            Some("meta-llama/Llama-3.1-8B")
        );
        assert_eq!(s.label("engine").as_deref(), Some("0"));
        assert_eq!(s.label("dp_rank"), None);

        let s = Sample::parse("  sglang:prompt_tokens_total 1.07e+07 1735000000123").unwrap();
        assert_eq!((s.name, s.value), ("sglang:prompt_tokens_total", 1.07e7));
        assert!(labels_of(&s).is_empty());

        let s = Sample::parse("x{ a = \"1\" , b=\"2\", }\t+Inf").unwrap();
        assert_eq!(s.value, f64::INFINITY);
        assert_eq!(
            labels_of(&s),
            [("a".into(), "1".into()), ("b".into(), "2".into())]
        );
        assert!(Sample::parse("x NaN").unwrap().value.is_nan());
        assert_eq!(Sample::parse("x -Inf").unwrap().value, f64::NEG_INFINITY);
        assert_eq!(Sample::parse("x{} 2").unwrap().value, 2.0);

        // OpenMetrics: a fractional timestamp, an exemplar after the value.
        let s = Sample::parse(
            r#"vllm:request_success_total{model_name="m"} 7 1735000000.123 # {trace_id="ab"} 1"#,
        )
        .unwrap();
        assert_eq!(
            (s.value, s.label("model_name").as_deref()),
            (7.0, Some("m"))
        );
        assert_eq!(Sample::parse(r#"x 3 # {a="b"} 0.5"#).unwrap().value, 3.0);
    }

    #[test]
    fn label_values_keep_braces_commas_and_escapes() {
        let s = Sample::parse(r#"m{path="/a,b}{c",q="say \"hi\"\n",w="back\\slash"} 1"#).unwrap();
        assert_eq!(s.label("path").as_deref(), Some("/a,b}{c"));
        assert_eq!(s.label("q").as_deref(), Some("say \"hi\"\n"));
        assert_eq!(s.label("w").as_deref(), Some("back\\slash"));
        assert!(
            matches!(s.label("path"), Some(Cow::Borrowed(_))),
            "no copy without escapes"
        );
    }

    #[test]
    fn anything_but_a_well_formed_sample_is_none() {
        for line in [
            "",
            "   ",
            "# TYPE vllm:num_requests_running gauge",
            "# HELP x y",
            "x",
            "x{",
            "x{a=\"1\"",
            "x{a=\"1} 2",
            "x{a=1} 2",
            "x{=\"1\"} 2",
            "x{1a=\"1\"} 2",
            "x{a:b=\"1\"} 2",
            "x{a=\"1\" b=\"2\"} 2",
            "x{a=\"\\q\"} 2",
            "x{a=\"1\"}",
            "x 1 2 3",
            "x 1 later",
            "x one",
            "1x 2",
            "{a=\"1\"} 2",
            "<html>nope</html>",
        ] {
            assert_eq!(Sample::parse(line), None, "{line:?}");
        }
    }

    fn name() -> impl Strategy<Value = String> {
        "[a-zA-Z_:][a-zA-Z0-9_:]{0,20}"
    }

    /// Labels as engines write them: no escapes (prometheus-parse does not unescape).
    fn labels() -> impl Strategy<Value = Vec<(String, String)>> {
        prop::collection::vec(
            ("[a-zA-Z_][a-zA-Z0-9_]{0,10}", "[a-zA-Z0-9 ./:_-]{0,16}"),
            0..4,
        )
        .prop_map(|mut v| {
            v.sort();
            v.dedup_by(|a, b| a.0 == b.0);
            v
        })
    }

    proptest! {
        /// prometheus-parse (the crate this replaced) reads the same name, labels and value
        /// from the lines engines write.
        #[test]
        fn agrees_with_prometheus_parse(
            name in name(),
            labels in labels(),
            value in prop_oneof![any::<f64>().prop_filter("finite", |v| v.is_finite()), Just(0.0), Just(1.5e9)],
            timestamp in prop::option::of(0i64..2_000_000_000_000),
        ) {
            let block: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
            let mut line = name.clone();
            if !labels.is_empty() {
                line.push_str(&format!("{{{}}}", block.join(",")));
            }
            line.push_str(&format!(" {value:?}"));
            if let Some(t) = timestamp {
                line.push_str(&format!(" {t}"));
            }
            let ours = Sample::parse(&line).expect("a well-formed line");
            prop_assert_eq!(ours.name, name.as_str());
            prop_assert_eq!(ours.value, value);
            let mut ours_labels = labels_of(&ours);
            ours_labels.sort();
            prop_assert_eq!(&ours_labels, &labels);

            // prometheus-parse's name pattern is `\w+`: it reads `:` only in disguise.
            let disguised = line.replacen(':', "__colon__", name.matches(':').count());
            let scrape = prometheus_parse::Scrape::parse(std::iter::once(Ok(disguised)))
                .expect("an in-memory line");
            prop_assert_eq!(scrape.samples.len(), 1);
            let theirs = &scrape.samples[0];
            prop_assert_eq!(theirs.metric.replace("__colon__", ":"), name);
            let theirs_value = match theirs.value {
                prometheus_parse::Value::Untyped(v) => v,
                ref other => panic!("untyped without TYPE lines: {other:?}"),
            };
            prop_assert_eq!(theirs_value, value);
            let mut theirs_labels: Vec<(String, String)> = theirs
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            theirs_labels.sort();
            prop_assert_eq!(theirs_labels, labels);
        }

        /// Any text: no panic.
        #[test]
        fn arbitrary_text_never_panics(line in "\\PC{0,60}") {
            let _ = Sample::parse(&line);
        }
    }
}
