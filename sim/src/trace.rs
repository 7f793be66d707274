//! Request traces: the JSONL format `pd-load --workload replay --trace FILE` reads (and
//! `--write-trace` writes), and the synthetic workloads that are traces too (`mixed`).
//!
//! One JSON object per line; blank lines and lines starting with `#` are skipped:
//!
//! | field | type | meaning |
//! |---|---|---|
//! | `offset_ms` | number, optional | arrival time from the start of the run (used with `--trace-timing`) |
//! | `messages` | array of `{role, content}` | a chat request (`/v1/chat/completions`) |
//! | `prompt` | string | a completion request (`/v1/completions`) |
//! | `prompt_tokens` | integer | a completion of this many filler tokens (when neither of the above) |
//! | `prefix_id` + `shared_prefix_tokens` | integer, optional | the first tokens are equal across entries with the same `prefix_id` |
//! | `max_tokens` | integer, optional | default `--max-tokens` |
//! | `stream` | bool, optional | default: drawn with `--stream-ratio` |
//! | `session` | string, optional | sent as `x-aibrix-session-key` |
//!
//! Exactly one of `messages`, `prompt` and `prompt_tokens` must be present.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use thiserror::Error;

use crate::engine::prompt_tokens;

/// One chat message of a trace entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceEntry {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<Message>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_prefix_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
}

/// Why a trace could not be read.
#[derive(Debug, Error, PartialEq)]
pub enum TraceError {
    #[error("trace line {line}: {reason}")]
    Line { line: usize, reason: String },
    #[error("trace is empty")]
    Empty,
}

/// What an entry asks for, once validated.
#[derive(Debug, Clone, PartialEq)]
pub enum Input<'a> {
    Chat(&'a [Message]),
    Text(&'a str),
    Tokens {
        tokens: u64,
        prefix: Option<(u64, u64)>,
    },
}

impl TraceEntry {
    /// The entry's input, or why it is not usable.
    pub fn input(&self) -> Result<Input<'_>, String> {
        match (&self.messages, &self.prompt, self.prompt_tokens) {
            (Some(m), None, None) if !m.is_empty() => Ok(Input::Chat(m)),
            (Some(_), None, None) => Err("messages is empty".into()),
            (None, Some(p), None) => Ok(Input::Text(p)),
            (None, None, Some(0)) => Err("prompt_tokens must be >= 1".into()),
            (None, None, Some(t)) => Ok(Input::Tokens {
                tokens: t,
                prefix: self
                    .prefix_id
                    .map(|id| (id, self.shared_prefix_tokens.unwrap_or(0).min(t))),
            }),
            (None, None, None) => Err("one of messages, prompt, prompt_tokens is required".into()),
            _ => Err("give only one of messages, prompt, prompt_tokens".into()),
        }
    }

    /// Prompt size in the simulator's tokens.
    pub fn size_tokens(&self) -> u64 {
        match self.input() {
            Ok(Input::Chat(m)) => m.iter().map(|m| prompt_tokens(&m.content)).sum(),
            Ok(Input::Text(p)) => prompt_tokens(p),
            Ok(Input::Tokens { tokens, .. }) => tokens,
            Err(_) => 0,
        }
    }
}

/// Parses a JSONL trace; every entry is validated so a bad line fails before the run starts.
pub fn parse(text: &str) -> Result<Vec<TraceEntry>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let entry: TraceEntry = serde_json::from_str(trimmed).map_err(|e| TraceError::Line {
            line: line_no,
            reason: e.to_string(),
        })?;
        entry.input().map_err(|reason| TraceError::Line {
            line: line_no,
            reason,
        })?;
        if let Some(o) = entry.offset_ms {
            if !(o.is_finite() && o >= 0.0) {
                return Err(TraceError::Line {
                    line: line_no,
                    reason: format!("offset_ms must be >= 0, got {o}"),
                });
            }
        }
        out.push(entry);
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(out)
}

/// The JSONL text of `entries` (what `--write-trace` writes).
pub fn to_jsonl(entries: &[TraceEntry]) -> String {
    let mut out = String::new();
    for e in entries {
        if let Ok(line) = serde_json::to_string(e) {
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

/// Random filler "tokens" of exactly four characters, so prompt size in tokens is exact
/// under the ceil(chars/4) rule engines and the simulator use.
pub fn words(rng: &mut fastrand::Rng, count: u64, out: &mut String) {
    for _ in 0..count {
        for _ in 0..3 {
            out.push(rng.lowercase());
        }
        out.push(' ');
    }
}

fn filler(seed: u64, count: u64) -> String {
    let mut s = String::with_capacity(count as usize * 4);
    words(&mut fastrand::Rng::with_seed(seed), count, &mut s);
    s
}

/// What the request body carries for an entry: the path and the JSON fields other than
/// `model`, `max_tokens` and `stream`. Filler for `prompt_tokens` entries is seeded by the
/// entry index (and the prefix by its id), so a replay sends the same bytes every time.
pub fn body_input(entry: &TraceEntry, index: u64, seed: u64) -> (&'static str, String, Value) {
    match entry.input() {
        Ok(Input::Chat(m)) => (
            "/v1/chat/completions",
            "messages".into(),
            json!(m
                .iter()
                .map(|m| json!({"role": m.role, "content": m.content}))
                .collect::<Vec<_>>()),
        ),
        Ok(Input::Text(p)) => ("/v1/completions", "prompt".into(), Value::String(p.into())),
        Ok(Input::Tokens { tokens, prefix }) => {
            let mut text = String::new();
            let shared = match prefix {
                Some((id, n)) => {
                    text.push_str(&filler(
                        seed ^ 0x9e37_79b9 ^ id.wrapping_mul(0x1000_0001),
                        n,
                    ));
                    n
                }
                None => 0,
            };
            words(
                &mut fastrand::Rng::with_seed(seed ^ index.wrapping_mul(0x5851_f42d)),
                tokens - shared,
                &mut text,
            );
            ("/v1/completions", "prompt".into(), Value::String(text))
        }
        Err(_) => (
            "/v1/completions",
            "prompt".into(),
            Value::String("x".into()),
        ),
    }
}

/// Shape of the synthetic mixed workload (defaults: a chat service with RAG and agents).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MixedShape {
    /// Entries generated (the run cycles through them).
    pub entries: usize,
    /// Fractions of short chat and long RAG requests; the rest are session turns.
    pub chat_share: f64,
    pub rag_share: f64,
    pub chat_tokens: (u64, u64),
    pub rag_tokens: (u64, u64),
    /// Distinct RAG documents: requests on the same document share its first tokens.
    pub rag_documents: u64,
    pub system_prompts: u64,
    pub system_tokens: u64,
    pub sessions: u64,
    pub turn_tokens: (u64, u64),
    /// Assistant reply appended to a session's history after each turn.
    pub reply_tokens: u64,
    /// A session starts over (fresh history) after this many turns.
    pub max_turns: u64,
}

impl Default for MixedShape {
    fn default() -> Self {
        MixedShape {
            entries: 2000,
            chat_share: 0.4,
            rag_share: 0.2,
            chat_tokens: (32, 256),
            rag_tokens: (1500, 4000),
            rag_documents: 16,
            system_prompts: 4,
            system_tokens: 400,
            sessions: 48,
            turn_tokens: (16, 128),
            reply_tokens: 48,
            max_turns: 8,
        }
    }
}

/// The mixed workload as a trace (no offsets: arrivals come from `--rps`/`--clients`):
/// short chats, long RAG prompts over a few documents (shared leading tokens), and multi-turn
/// sessions whose conversations start with one of a few system prompts and grow by each
/// turn's question and reply, carrying `x-aibrix-session-key`.
pub fn mixed(shape: &MixedShape, seed: u64) -> Vec<TraceEntry> {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x6d_6978_6564);
    let systems: Vec<String> = (0..shape.system_prompts.max(1))
        .map(|i| filler(seed ^ 0x5157 ^ i.wrapping_mul(0x9e37), shape.system_tokens))
        .collect();
    let mut histories: Vec<Vec<Message>> = vec![Vec::new(); shape.sessions.max(1) as usize];
    let range = |rng: &mut fastrand::Rng, (lo, hi): (u64, u64)| rng.u64(lo.min(hi)..=hi.max(lo));
    (0..shape.entries)
        .map(|_| {
            let pick = rng.f64();
            if pick < shape.chat_share {
                let n = range(&mut rng, shape.chat_tokens).max(1);
                let mut text = String::new();
                words(&mut rng, n, &mut text);
                TraceEntry {
                    messages: Some(vec![Message {
                        role: "user".into(),
                        content: text,
                    }]),
                    ..TraceEntry::default()
                }
            } else if pick < shape.chat_share + shape.rag_share {
                let n = range(&mut rng, shape.rag_tokens).max(1);
                let doc = rng.u64(0..shape.rag_documents.max(1));
                TraceEntry {
                    prompt_tokens: Some(n),
                    prefix_id: Some(doc),
                    // The document is most of the prompt; the question at the end differs.
                    shared_prefix_tokens: Some(n.saturating_sub(64).min(shape.rag_tokens.0)),
                    ..TraceEntry::default()
                }
            } else {
                let s = rng.usize(0..histories.len());
                let history = &mut histories[s];
                if history.len() as u64 > 2 * shape.max_turns {
                    history.clear();
                }
                if history.is_empty() {
                    let sys = &systems[s % systems.len()];
                    history.push(Message {
                        role: "system".into(),
                        content: sys.clone(),
                    });
                }
                let mut question = String::new();
                let n = range(&mut rng, shape.turn_tokens).max(1);
                words(&mut rng, n, &mut question);
                history.push(Message {
                    role: "user".into(),
                    content: question,
                });
                let entry = TraceEntry {
                    messages: Some(history.clone()),
                    session: Some(format!("session-{s}")),
                    ..TraceEntry::default()
                };
                let mut reply = String::new();
                words(&mut rng, shape.reply_tokens, &mut reply);
                history.push(Message {
                    role: "assistant".into(),
                    content: reply,
                });
                entry
            }
        })
        .collect()
}

/// A chat body of exactly `bytes` bytes when serialised (for `--workload fixed`), or the
/// smallest possible one when `bytes` is below the fixed overhead.
pub fn fixed_body(model: &str, max_tokens: u64, stream: bool, bytes: usize, seed: u64) -> Value {
    let mut body = json!({"model": model, "max_tokens": max_tokens, "stream": stream,
                          "messages": [{"role": "user", "content": ""}]});
    let overhead = body.to_string().len();
    let want = bytes.saturating_sub(overhead);
    let mut text = String::with_capacity(want + 4);
    words(
        &mut fastrand::Rng::with_seed(seed),
        want.div_ceil(4) as u64,
        &mut text,
    );
    text.truncate(want);
    if let Some(c) = body.pointer_mut("/messages/0/content") {
        *c = Value::String(text);
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_input_kind_and_skips_comments() {
        let text = r#"
# a comment
{"offset_ms": 0, "messages": [{"role": "user", "content": "hello there"}], "session": "s1", "max_tokens": 8}
{"offset_ms": 12.5, "prompt": "abcdefgh", "stream": true}
{"prompt_tokens": 100, "prefix_id": 3, "shared_prefix_tokens": 80}
"#;
        let t = parse(text).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t[0].session.as_deref(), Some("s1"));
        assert_eq!(t[0].size_tokens(), 3);
        assert_eq!(t[1].size_tokens(), 2);
        assert_eq!(
            t[2].input(),
            Ok(Input::Tokens {
                tokens: 100,
                prefix: Some((3, 80))
            })
        );
        assert_eq!(parse(&to_jsonl(&t)).unwrap(), t, "round trip");
    }

    #[test]
    fn the_documented_example_parses() {
        let t = parse(include_str!("../../docs/bench/example-trace.jsonl")).unwrap();
        assert_eq!(t.len(), 4);
        assert_eq!(t[3].session.as_deref(), Some("user-17"));
        assert_eq!(t[2].size_tokens(), 3000);
    }

    #[test]
    fn bad_lines_name_the_line() {
        let cases = [
            ("{}", "one of messages"),
            (r#"{"prompt": "a", "prompt_tokens": 3}"#, "only one"),
            (r#"{"messages": []}"#, "empty"),
            (r#"{"prompt_tokens": 0}"#, ">= 1"),
            (r#"{"prompt": "a", "offset_ms": -1}"#, "offset_ms"),
            (r#"{"prompt": "a", "colour": 1}"#, "unknown field"),
            ("not json", "expected"),
        ];
        for (line, want) in cases {
            let err = parse(&format!("{{\"prompt\":\"ok\"}}\n{line}\n")).unwrap_err();
            match err {
                TraceError::Line { line: 2, reason } => assert!(reason.contains(want), "{reason}"),
                other => panic!("{line}: {other:?}"),
            }
        }
        assert_eq!(parse("\n# only\n"), Err(TraceError::Empty));
    }

    #[test]
    fn token_entries_share_their_prefix_and_are_stable() {
        let e = |id| TraceEntry {
            prompt_tokens: Some(50),
            prefix_id: Some(id),
            shared_prefix_tokens: Some(40),
            ..TraceEntry::default()
        };
        let text = |entry: &TraceEntry, i| body_input(entry, i, 7).2.as_str().unwrap().to_string();
        let (a, b, c) = (text(&e(1), 0), text(&e(1), 1), text(&e(2), 2));
        assert_eq!(prompt_tokens(&a), 50);
        assert_eq!(a[..160], b[..160]);
        assert_ne!(a[160..], b[160..]);
        assert_ne!(a[..160], c[..160]);
        assert_eq!(a, text(&e(1), 0), "same index, same bytes");
    }

    #[test]
    fn mixed_has_every_kind_and_growing_sessions() {
        let shape = MixedShape {
            entries: 600,
            ..MixedShape::default()
        };
        let t = mixed(&shape, 1);
        assert_eq!(t, mixed(&shape, 1), "reproducible");
        let sessions: Vec<&TraceEntry> = t.iter().filter(|e| e.session.is_some()).collect();
        let rag = t.iter().filter(|e| e.prefix_id.is_some()).count();
        let chat = t.len() - sessions.len() - rag;
        for (n, share) in [
            (chat, shape.chat_share),
            (rag, shape.rag_share),
            (sessions.len(), 1.0 - shape.chat_share - shape.rag_share),
        ] {
            let got = n as f64 / t.len() as f64;
            assert!((got - share).abs() < 0.08, "{got} vs {share}");
        }
        // A session's later turn extends its earlier one: same system prompt, longer history.
        let s0: Vec<&&TraceEntry> = sessions
            .iter()
            .filter(|e| e.session.as_deref() == Some("session-0"))
            .collect();
        assert!(s0.len() >= 2);
        let (first, second) = (
            s0[0].messages.as_ref().unwrap(),
            s0[1].messages.as_ref().unwrap(),
        );
        assert_eq!(first[0].role, "system");
        assert_eq!(second.len(), first.len() + 2);
        assert_eq!(second[..first.len()], first[..]);
        assert!(t.iter().all(|e| e.input().is_ok()));
        // Sessions on the same system prompt share it.
        let other = sessions
            .iter()
            .find(|e| e.session.as_deref() == Some("session-4"))
            .unwrap();
        assert_eq!(other.messages.as_ref().unwrap()[0], first[0]);
    }

    #[test]
    fn fixed_bodies_have_the_exact_size() {
        for bytes in [2048, 32768, 262_144] {
            let b = fixed_body("bench-llm", 16, false, bytes, 3);
            assert_eq!(b.to_string().len(), bytes);
            assert_eq!(b["max_tokens"], json!(16));
        }
        let tiny = fixed_body("m", 1, true, 10, 3);
        assert_eq!(tiny.pointer("/messages/0/content"), Some(&json!("")));
    }
}
