//! Reading `AIBRIX_*` environment values: one reader, AIBrix's parsing rules, and a named
//! warning (with the default kept) for every value that does not parse or is out of range.

/// Collects values through a lookup function (the process environment in wasm, a table in
/// tests) and the warnings for values it had to ignore.
pub struct EnvReader<F: Fn(&str) -> Option<String>> {
    get: F,
    pub warnings: Vec<String>,
}

impl<F: Fn(&str) -> Option<String>> EnvReader<F> {
    pub fn new(get: F) -> Self {
        EnvReader {
            get,
            warnings: Vec::new(),
        }
    }

    /// The trimmed value, `None` when unset or empty.
    pub fn string(&self, name: &str) -> Option<String> {
        (self.get)(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }

    /// Go `strconv.ParseBool` semantics, which is what AIBrix operators already write.
    pub fn bool(&mut self, name: &str, default: bool) -> bool {
        let Some(raw) = self.string(name) else {
            return default;
        };
        match parse_go_bool(&raw) {
            Some(v) => v,
            None => {
                self.warnings
                    .push(format!("{name}={raw:?} is not a boolean; using {default}"));
                default
            }
        }
    }

    /// A float that must satisfy `valid` (described by `what` in the warning).
    pub fn f64(
        &mut self,
        name: &str,
        default: f64,
        what: &str,
        valid: impl Fn(f64) -> bool,
    ) -> f64 {
        let Some(raw) = self.string(name) else {
            return default;
        };
        match raw.parse::<f64>() {
            Ok(v) if v.is_finite() && valid(v) => v,
            _ => {
                self.warnings
                    .push(format!("{name}={raw:?} is not {what}; using {default}"));
                default
            }
        }
    }

    pub fn positive(&mut self, name: &str, default: f64) -> f64 {
        self.f64(name, default, "a positive number", |v| v > 0.0)
    }

    pub fn non_negative(&mut self, name: &str, default: f64) -> f64 {
        self.f64(name, default, "a number >= 0", |v| v >= 0.0)
    }

    pub fn within(&mut self, name: &str, default: f64, lo: f64, hi: f64) -> f64 {
        let what = format!("a number in [{lo}, {hi}]");
        self.f64(name, default, &what, |v| (lo..=hi).contains(&v))
    }

    /// A positive integer.
    pub fn count(&mut self, name: &str, default: u64) -> u64 {
        let Some(raw) = self.string(name) else {
            return default;
        };
        match raw.parse::<u64>() {
            Ok(v) if v > 0 => v,
            _ => {
                self.warnings.push(format!(
                    "{name}={raw:?} is not a positive integer; using {default}"
                ));
                default
            }
        }
    }

    /// One of `choices` (compared after `normalize`), else the default with a warning.
    pub fn choice<T: Copy>(
        &mut self,
        name: &str,
        default: (T, &str),
        parse: impl Fn(&str) -> Option<T>,
    ) -> T {
        let Some(raw) = self.string(name) else {
            return default.0;
        };
        match parse(&raw) {
            Some(v) => v,
            None => {
                self.warnings.push(format!(
                    "{name}={raw:?} is not recognised; using {}",
                    default.1
                ));
                default.0
            }
        }
    }
}

pub fn parse_go_bool(raw: &str) -> Option<bool> {
    match raw {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(
        pairs: &'static [(&'static str, &'static str)],
    ) -> EnvReader<impl Fn(&str) -> Option<String>> {
        EnvReader::new(move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn values_and_named_warnings() {
        let mut r = reader(&[
            ("A", "T"),
            ("B", "yes"),
            ("C", "0"),
            ("D", " 2.5 "),
            ("E", "1.5"),
            ("F", ""),
        ]);
        assert!(r.bool("A", false));
        assert!(!r.bool("B", false));
        assert_eq!(r.positive("C", 16.0), 16.0, "0 is not positive");
        assert_eq!(r.positive("D", 1.0), 2.5);
        assert_eq!(r.within("E", 0.5, 0.0, 1.0), 0.5);
        assert_eq!(r.count("F", 7), 7, "empty counts as unset");
        assert_eq!(r.non_negative("C", 3.0), 0.0);
        assert_eq!(r.warnings.len(), 3);
        assert!(r.warnings[0].starts_with("B=\"yes\""));
    }
}
