//! Kubernetes label selectors, the language of the `external-filter` request header, which
//! narrows a request's candidate pods before selection (AIBrix applies it to the ready pods).
//!
//! Requirements are separated by commas and must all hold: `key` and `!key` (the label is
//! present / absent), `key=value`, `key==value`, `key!=value`, `key in (a,b)`,
//! `key notin (a,b)`, and `key>n`, `key<n` (integer labels), as Kubernetes' `labels.Parse`
//! reads them. As there, `!=` and `notin` also hold for a pod without the label, and an empty
//! selector selects every pod.

/// Why a selector does not parse; the router answers it as a selection failure (503).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid label selector at byte {at}: {what}")]
pub struct SelectorError {
    pub at: usize,
    pub what: &'static str,
}

#[derive(Debug, Clone, PartialEq)]
enum Op {
    Exists,
    Absent,
    In(Vec<String>),
    NotIn(Vec<String>),
    Gt(i64),
    Lt(i64),
}

#[derive(Debug, Clone, PartialEq)]
struct Requirement {
    key: String,
    op: Op,
}

/// A parsed selector.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

/// Characters of label keys (with a `prefix/`) and values.
fn is_name_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.' | b'/')
}

struct Cursor<'a> {
    text: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn skip_space(&mut self) {
        while self.text.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }

    fn fail<T>(&self, what: &'static str) -> Result<T, SelectorError> {
        Err(SelectorError { at: self.at, what })
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_space();
        self.text.get(self.at).copied()
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_space();
        if self.text[self.at..].starts_with(token.as_bytes()) {
            self.at += token.len();
            true
        } else {
            false
        }
    }

    /// A key or value; `allow_empty` for values (`key=` selects an empty value).
    fn name(&mut self, allow_empty: bool) -> Result<String, SelectorError> {
        self.skip_space();
        let start = self.at;
        while self.text.get(self.at).copied().is_some_and(is_name_char) {
            self.at += 1;
        }
        if self.at == start && !allow_empty {
            return self.fail("expected a label key");
        }
        Ok(String::from_utf8_lossy(&self.text[start..self.at]).into_owned())
    }

    /// `(a, b, ...)`.
    fn set(&mut self) -> Result<Vec<String>, SelectorError> {
        if !self.eat("(") {
            return self.fail("expected '('");
        }
        let mut values = vec![self.name(true)?];
        while self.eat(",") {
            values.push(self.name(true)?);
        }
        if !self.eat(")") {
            return self.fail("expected ')'");
        }
        Ok(values)
    }

    fn integer(&mut self) -> Result<i64, SelectorError> {
        let value = self.name(false)?;
        match value.parse() {
            Ok(n) => Ok(n),
            Err(_) => self.fail("expected an integer"),
        }
    }

    /// A word operator (`in`, `notin`) must end where the word does.
    fn eat_word(&mut self, word: &str) -> bool {
        let save = self.at;
        if self.eat(word) && !self.text.get(self.at).copied().is_some_and(is_name_char) {
            return true;
        }
        self.at = save;
        false
    }

    fn requirement(&mut self) -> Result<Requirement, SelectorError> {
        if self.eat("!") {
            let key = self.name(false)?;
            return Ok(Requirement {
                key,
                op: Op::Absent,
            });
        }
        let key = self.name(false)?;
        let op = if self.eat("==") || self.eat("=") {
            Op::In(vec![self.name(true)?])
        } else if self.eat("!=") {
            Op::NotIn(vec![self.name(true)?])
        } else if self.eat(">") {
            Op::Gt(self.integer()?)
        } else if self.eat("<") {
            Op::Lt(self.integer()?)
        } else if self.eat_word("notin") {
            Op::NotIn(self.set()?)
        } else if self.eat_word("in") {
            Op::In(self.set()?)
        } else {
            match self.peek() {
                None | Some(b',') => Op::Exists,
                Some(_) => return self.fail("expected an operator"),
            }
        };
        Ok(Requirement { key, op })
    }
}

/// Bounds on a selector. The header is the client's: each requirement is checked against
/// every routable pod's labels, so without them one request of `!a,!a,...` (twenty thousand
/// requirements in Envoy's 60 KiB header limit) held a worker for a second at 1000 pods. Far
/// above any selector an operator writes (Kubernetes' own are a few requirements).
pub const MAX_SELECTOR_BYTES: usize = 4096;
pub const MAX_REQUIREMENTS: usize = 64;
pub const MAX_SET_VALUES: usize = 256;

impl Selector {
    pub fn parse(text: &str) -> Result<Selector, SelectorError> {
        if text.len() > MAX_SELECTOR_BYTES {
            return Err(SelectorError {
                at: MAX_SELECTOR_BYTES,
                what: "longer than 4096 bytes",
            });
        }
        let mut cursor = Cursor {
            text: text.as_bytes(),
            at: 0,
        };
        let mut requirements = Vec::new();
        if cursor.peek().is_none() {
            return Ok(Selector { requirements });
        }
        let mut values = 0;
        loop {
            let requirement = cursor.requirement()?;
            if let Op::In(set) | Op::NotIn(set) = &requirement.op {
                values += set.len();
            }
            requirements.push(requirement);
            if requirements.len() > MAX_REQUIREMENTS {
                return cursor.fail("more than 64 requirements");
            }
            if values > MAX_SET_VALUES {
                return cursor.fail("more than 256 values in its sets");
            }
            match cursor.peek() {
                None => return Ok(Selector { requirements }),
                Some(b',') => cursor.at += 1,
                Some(_) => return cursor.fail("expected ','"),
            }
        }
    }

    /// Whether a pod with `labels` (any order) satisfies every requirement.
    pub fn matches(&self, labels: &[(String, String)]) -> bool {
        let get = |key: &str| {
            labels
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        self.requirements.iter().all(|r| {
            let value = get(&r.key);
            let number = || value.and_then(|v| v.parse::<i64>().ok());
            match &r.op {
                Op::Exists => value.is_some(),
                Op::Absent => value.is_none(),
                Op::In(set) => value.is_some_and(|v| set.iter().any(|s| s == v)),
                Op::NotIn(set) => value.is_none_or(|v| set.iter().all(|s| s != v)),
                Op::Gt(n) => number().is_some_and(|v| v > *n),
                Op::Lt(n) => number().is_some_and(|v| v < *n),
            }
        })
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_selector_is_bounded() {
        let many = vec!["!a"; MAX_REQUIREMENTS].join(",");
        assert!(Selector::parse(&many).is_ok(), "64 requirements");
        let err = Selector::parse(&format!("{many},!b")).unwrap_err();
        assert_eq!(err.what, "more than 64 requirements");
        let err = Selector::parse(&"!a,".repeat(20_000)).unwrap_err();
        assert_eq!(err.what, "longer than 4096 bytes");
        let set = |n: usize| {
            (0..n)
                .map(|i| format!("v{i}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        assert!(Selector::parse(&format!("k in ({})", set(MAX_SET_VALUES))).is_ok());
        let err =
            Selector::parse(&format!("k in ({}),j notin (x)", set(MAX_SET_VALUES))).unwrap_err();
        assert_eq!(err.what, "more than 256 values in its sets");
    }
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn holds(selector: &str, pairs: &[(&str, &str)]) -> bool {
        Selector::parse(selector)
            .unwrap_or_else(|e| panic!("{selector}: {e}"))
            .matches(&labels(pairs))
    }

    #[test]
    fn each_operator_as_kubernetes_reads_it() {
        let pod = [("tier", "canary"), ("gpu", "h100"), ("rank", "3")];
        for (selector, want) in [
            ("", true),
            ("  ", true),
            ("tier=canary", true),
            ("tier == canary", true),
            ("tier=stable", false),
            ("tier!=stable", true),
            ("zone!=a", true),
            ("tier", true),
            ("zone", false),
            ("!zone", true),
            ("!tier", false),
            ("gpu in (a100, h100)", true),
            ("gpu in (a100)", false),
            ("gpu notin (a100)", true),
            ("zone notin (a)", true),
            ("rank>2", true),
            ("rank<3", false),
            ("tier>2", false),
            ("tier=canary,gpu in (h100),!zone,rank>1", true),
            ("tier=canary, gpu=a100", false),
            ("example.com/team=ml", false),
            ("tier=", false),
        ] {
            assert_eq!(holds(selector, &pod), want, "{selector}");
        }
        assert!(holds("tier=", &[("tier", "")]));
        assert!(holds("example.com/team=ml", &[("example.com/team", "ml")]));
    }

    #[test]
    fn malformed_selectors_say_where() {
        for (selector, at) in [
            ("=x", 0),
            ("tier=canary,", 12),
            ("tier canary", 5),
            ("gpu in h100", 7),
            ("gpu in (h100", 12),
            ("rank>x", 6),
            ("tier=ca nary", 8),
            ("tier=a;b", 6),
            ("!", 1),
        ] {
            let e = Selector::parse(selector).unwrap_err();
            assert_eq!(e.at, at, "{selector}: {e}");
        }
        // `in` is a word: a key that starts with it is not the operator.
        assert!(Selector::parse("gpu inx (a)").is_err());
        assert!(holds("index", &[("index", "1")]));
    }
}
