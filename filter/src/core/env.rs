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

    /// Whether the variable is set at all, blank included.
    pub fn is_set(&self, name: &str) -> bool {
        (self.get)(name).is_some()
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

    /// A positive integer no larger than `max` (a count that must fit what it sizes, or a
    /// period that must not overflow once turned into milliseconds).
    pub fn count_at_most(&mut self, name: &str, default: u64, max: u64) -> u64 {
        let v = self.count(name, default);
        if v <= max {
            return v;
        }
        self.warnings
            .push(format!("{name}={v} is over {max}; using {default}"));
        default
    }

    /// A whole number of either sign (AIBrix's `LoadEnvInt`: what does not parse keeps the
    /// default).
    pub fn integer(&mut self, name: &str, default: i64) -> i64 {
        let Some(raw) = self.string(name) else {
            return default;
        };
        match raw.parse::<i64>() {
            Ok(v) => v,
            _ => {
                self.warnings
                    .push(format!("{name}={raw:?} is not an integer; using {default}"));
                default
            }
        }
    }

    /// A Go duration (`300s`, `5m`, `1h30m`, `250ms`, `0`), in milliseconds; negative values
    /// are refused, as AIBrix's `LoadEnvDuration` refuses them.
    pub fn duration_ms(&mut self, name: &str, default_ms: u64) -> u64 {
        let Some(raw) = self.string(name) else {
            return default_ms;
        };
        match parse_go_duration_ms(&raw) {
            Some(v) => v,
            None => {
                self.warnings.push(format!(
                    "{name}={raw:?} is not a duration such as 300s or 5m; using {default_ms}ms"
                ));
                default_ms
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

/// Go's `time.ParseDuration` for non-negative values, to whole milliseconds: one or more
/// `<number><unit>` terms (`ns`, `us`, `µs`, `ms`, `s`, `m`, `h`), or a bare `0`.
pub fn parse_go_duration_ms(raw: &str) -> Option<u64> {
    let text = raw.strip_prefix('+').unwrap_or(raw);
    if text == "0" {
        return Some(0);
    }
    let mut rest = text;
    let mut total_ms = 0.0;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let ms_per_unit = match &rest[..unit_len] {
            "ns" => 1e-6,
            "us" | "µs" | "μs" => 1e-3,
            "ms" => 1.0,
            "s" => 1e3,
            "m" => 60e3,
            "h" => 3600e3,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total_ms += number * ms_per_unit;
    }
    (total_ms.is_finite() && total_ms < u64::MAX as f64 && !text.is_empty())
        .then_some(total_ms.round() as u64)
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

    #[test]
    fn integers_and_go_durations() {
        let mut r = reader(&[
            ("K", "-1"),
            ("L", "2.5"),
            ("W", "5m"),
            ("X", "1h0m30.5s"),
            ("Y", "0"),
            ("Z", "300"),
            ("N", "-5s"),
        ]);
        assert_eq!(r.integer("K", 5), -1);
        assert_eq!(r.integer("L", 5), 5);
        assert_eq!(r.duration_ms("W", 1), 300_000);
        assert_eq!(r.duration_ms("X", 1), 3_630_500);
        assert_eq!(r.duration_ms("Y", 1), 0);
        assert_eq!(r.duration_ms("Z", 7), 7, "a unit is required, as in Go");
        assert_eq!(r.duration_ms("N", 7), 7, "negative refused");
        assert_eq!(r.duration_ms("unset", 9), 9);
        assert_eq!(r.warnings.len(), 3, "{:?}", r.warnings);
        assert_eq!(parse_go_duration_ms("250ms"), Some(250));
        assert_eq!(parse_go_duration_ms("1.5s"), Some(1500));
        assert_eq!(parse_go_duration_ms("s"), None);
        assert_eq!(parse_go_duration_ms("5x"), None);
    }
}
