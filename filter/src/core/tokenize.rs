//! Prompt tokenization: the byte stream the prefix index hashes (spec §4.1) and the
//! `cl100k_base` prompt length that bucketing and `config-profile: auto` hints compare with
//! their boundaries (§1.3).
//!
//! # Why `tiktoken-rs`
//!
//! Both candidates embed the BPE data and need no network or files at run time, and both give
//! the same ids as OpenAI's `cl100k_base` on every string checked ("hello world" = `[15339,
//! 1917]`, 100 × "a" = 13 tokens, CJK, emoji, contractions, `<|endoftext|>` as plain text).
//! Measured on this project's shared 2-core machine (ranges over runs; release builds; "V8" is
//! the same wasm32-wasip1 code run under Node's V8, the engine Envoy embeds; the prompt mixes
//! English, code, CJK and emoji at about 286 tokens per KB):
//!
//! | | `tiktoken-rs` 0.12 | `bpe-openai` 0.3 |
//! |---|---|---|
//! | count, 1 KB prompt (native / V8) | 82–138 µs / 163–290 µs | 24–42 µs / 58–62 µs |
//! | count, 64 KB prompt (native / V8) | 5.4–8.8 ms / 10–16 ms | 1.7–2.4 ms / 2.7–4.1 ms |
//! | first use: build the encoder (native / V8) | 58–150 ms / 125–320 ms | 24–29 ms / 75–107 ms |
//! | added to the filter `.wasm` (opt-level s, LTO) | +3.09 MB (0.47 → 3.57 MB) | +16.5 MB (in a bare cdylib) |
//! | linear memory after first use (V8) | 14.6 MiB | 31.9 MiB |
//!
//! [`prompt_tokens_bounds`] costs about 1–2 µs per KB natively and 2–4 µs per KB in V8.
//! Adversarial input does not blow up: `tiktoken-rs` merges long pieces with a heap, so 64 KB
//! of one letter or of spaces (a single pre-tokenizer piece) counts in 15–18 ms natively; text
//! goes to the encoder in segments of at most 64 KiB (its regex fails on a whitespace run of a
//! million characters, see [`SEGMENT_BYTES`]), and bucketing counts at most
//! [`EXACT_COUNT_MAX_BYTES`] of prompt.
//!
//! `bpe-openai` is about 3.5× faster, but it ships a 15 MB pre-serialised dictionary that every
//! Envoy worker VM holds twice (data segment plus the decoded tables), and Envoy loads the module
//! into each worker. The exact count is off the hot path anyway: [`prompt_tokens_if_needed`]
//! skips it whenever the cheap [`prompt_tokens_bounds`] already decide every boundary, so the
//! smaller module and footprint win. The one-off encoder build is paid once per VM; the host
//! should call [`warm_up`] at VM start when anything may need an exact count.
//!
//! Special-token text such as `<|endoftext|>` is encoded as ordinary text, as AIBrix does
//! (tiktoken-go `Encode(text, nil, nil)`).

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

/// The longest `cl100k_base` token, in bytes (a run of 128 spaces). A unit test checks it
/// against the embedded vocabulary.
pub const MAX_TOKEN_BYTES: usize = 128;

/// Which byte stream the prefix index hashes (`AIBRIX_PREFIX_CACHE_TOKENIZER_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TokenizerKind {
    /// UTF-8 bytes of the message text (the default).
    #[default]
    Character,
    /// `cl100k_base` ids, 4 bytes big-endian each.
    Tiktoken,
}

impl TokenizerKind {
    /// Parses the env value. Only the exact string `tiktoken` selects cl100k; every other value,
    /// including `remote` (which the PD router does not support), falls back to `character`, as
    /// in AIBrix's PD router.
    pub fn from_env(value: Option<&str>) -> TokenizerKind {
        match value {
            Some("tiktoken") => TokenizerKind::Tiktoken,
            _ => TokenizerKind::Character,
        }
    }
}

/// The byte stream that is cut into prefix blocks. `Tiktoken` runs the full encoder on every
/// call (see the costs above); `Character` is the text itself, borrowed (a copy was a 32 KB
/// allocation per 32 KB prompt).
pub fn token_stream(kind: TokenizerKind, text: &str) -> Cow<'_, [u8]> {
    match kind {
        TokenizerKind::Character => Cow::Borrowed(text.as_bytes()),
        TokenizerKind::Tiktoken => {
            let ids = encode(text);
            let mut out = Vec::with_capacity(ids.len() * 4);
            for id in ids {
                out.extend_from_slice(&id.to_be_bytes());
            }
            Cow::Owned(out)
        }
    }
}

/// `stream` cut to its whole blocks of `block_size` bytes: the prefix index ignores a trailing
/// partial block, and so do the other workers. A borrowed stream stays borrowed.
pub fn whole_blocks(stream: Cow<'_, [u8]>, block_size: usize) -> Cow<'_, [u8]> {
    let whole = stream.len() - stream.len() % block_size.max(1);
    match stream {
        Cow::Borrowed(s) => Cow::Borrowed(&s[..whole]),
        Cow::Owned(mut s) => {
            s.truncate(whole);
            Cow::Owned(s)
        }
    }
}

/// The process-wide encoder, built on first use. `None` if the embedded vocabulary failed to
/// load, which cannot happen with a good build; the spec counts a tokenizer error as 0 tokens.
fn encoder() -> Option<&'static CoreBPE> {
    static ENCODER: OnceLock<Option<CoreBPE>> = OnceLock::new();
    ENCODER
        .get_or_init(|| tiktoken_rs::cl100k_base().ok())
        .as_ref()
}

/// The longest stretch of text handed to the encoder at once. The cl100k pre-tokenizer's
/// `\s+(?!\S)` runs in fancy-regex's backtracking VM, which keeps one stack entry per character
/// of a whitespace run and gives up at a million; `tiktoken-rs`'s `encode_ordinary` then panics,
/// and a panic traps the VM with every stream of its worker: one prompt of a million spaces
/// and a letter (1 MB, under the body limit) did that.
const SEGMENT_BYTES: usize = 64 * 1024;

fn encode(text: &str) -> Vec<u32> {
    let Some(bpe) = encoder() else {
        return Vec::new();
    };
    let mut ids = Vec::new();
    for segment in segments(text, SEGMENT_BYTES) {
        // `encode` reports the regex's failure where `encode_ordinary` panics; special-token
        // text is still plain text (none is allowed). A failed segment counts nothing, as the
        // spec counts a tokenizer error; it cannot happen this far below the regex's limit.
        if let Ok((segment_ids, _)) = bpe.encode(segment, &HashSet::new()) {
            ids.extend(segment_ids);
        }
    }
    ids
}

/// `text` in pieces of at most `max` bytes (`max` ≥ 8). Each piece but the last ends where a
/// pre-tokenizer piece begins when it can, so the counts add up exactly (see [`cut_point`]).
fn segments(text: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let cut = if rest.len() <= max {
            rest.len()
        } else {
            cut_point(rest, max)
        };
        let (head, tail) = rest.split_at(cut);
        rest = tail;
        Some(head)
    })
}

/// Where to end a segment of `text` (longer than `max`): before the last ASCII space in the
/// second half of the first `max` bytes that follows a printable ASCII character. A cl100k
/// piece holding a non-space character ends with it or with line breaks, and the pieces made of
/// whitespace hold no other character, so a piece always begins at such a space; the regex
/// only looks ahead, so matching from it sees what it would in the whole text. Without one
/// (a run of whitespace, letters or CJK text longer than half a segment) the cut falls at the
/// last character boundary, inside a piece: the count is then off by a token or two per cut.
fn cut_point(text: &str, max: usize) -> usize {
    let bytes = text.as_bytes();
    let piece_start = (max / 2 + 1..=max)
        .rev()
        .find(|&i| bytes[i] == b' ' && bytes[i - 1].is_ascii_graphic());
    piece_start.unwrap_or_else(|| {
        (1..=max)
            .rev()
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(text.len())
    })
}

/// Builds the encoder now so the first request that needs it does not pay the set-up (about
/// 150–300 ms in V8). Returns false if the embedded vocabulary could not be loaded.
pub fn warm_up() -> bool {
    encoder().is_some()
}

/// The exact `cl100k_base` token count of `text` (0 if the tokenizer is unavailable).
pub fn prompt_tokens(text: &str) -> usize {
    encode(text).len()
}

/// Bounds `(min, max)` that always contain [`prompt_tokens`]`(text)`, from one pass over the
/// bytes, with no tokenizer.
///
/// * `max` = the byte length: every token is at least one byte, and pieces never share bytes.
/// * `min` = the larger of
///   - `ceil(bytes / MAX_TOKEN_BYTES)`: no token is longer than [`MAX_TOKEN_BYTES`];
///   - `letter_groups + ceil(ascii_digits / 3)`, from the cl100k pre-tokenizer, whose pieces
///     no token crosses. Every piece holds letters of at most one maximal `\p{L}` run (the
///     letter alternatives are `'(?i:[sdmt]|ll|ve|re)` and `[^\r\n\p{L}\p{N}]?\p{L}+`; the
///     others hold no letters), so there are at least as many tokens as letter runs. Digits
///     appear only in `\p{N}{1,3}` pieces, which hold no letters and at most 3 digits. ASCII
///     letters/digits are `\p{L}`/`\p{N}`; two ASCII letters with an ASCII non-letter between
///     them are in different runs. Non-ASCII characters are never counted, and never split a
///     group (they may be letters), so both terms only under-count.
///
/// For English prose `min` is roughly 0.75× and `max` roughly 4× the exact count.
pub fn prompt_tokens_bounds(text: &str) -> (usize, usize) {
    let bytes = text.as_bytes();
    let mut letter_groups = 0usize;
    let mut digits = 0usize;
    // True while the last ASCII character seen was a letter (non-ASCII bytes leave it as is).
    let mut in_letters = false;
    for &b in bytes {
        if b.is_ascii_alphabetic() {
            if !in_letters {
                letter_groups += 1;
                in_letters = true;
            }
        } else if b.is_ascii() {
            in_letters = false;
            if b.is_ascii_digit() {
                digits += 1;
            }
        }
    }
    let by_length = bytes.len().div_ceil(MAX_TOKEN_BYTES);
    let by_pieces = letter_groups + digits.div_ceil(3);
    (by_length.max(by_pieces), bytes.len())
}

/// The longest prompt [`prompt_tokens_if_needed`] counts exactly. Counting costs about
/// 0.1 µs per byte of prose and up to 0.7 µs per byte of one long piece (whitespace, one letter)
/// natively, two to three times that in V8; an 8 MiB body of spaces would hold its worker for
/// seconds. Past this the length is estimated, for prompts long enough that every boundary but
/// the largest is far from them.
pub const EXACT_COUNT_MAX_BYTES: usize = 256 * 1024;

/// The prompt length to compare with `boundaries` (bucket edges, profile hint limits):
/// the exact count when some boundary `b` lies in `min ..= max` of [`prompt_tokens_bounds`],
/// otherwise the lower bound `min`; past [`EXACT_COUNT_MAX_BYTES`] a boundary in the bounds
/// gets the estimate of four bytes per token, kept within them, instead of the count.
///
/// Returning `min` is safe for any range check `x < b`, `x <= b`, `x > b`, `x >= b` against a
/// listed boundary: with no boundary inside `[min, max]`, every boundary is either below `min`
/// or above `max`, so each check gives the same answer for `min` as for the exact count, which
/// lies in `[min, max]`. The value is not the exact count in that case: use
/// [`PromptLength::counted`] where the number itself matters.
pub fn prompt_tokens_if_needed(text: &str, boundaries: &[i64]) -> usize {
    PromptLength::new(text).for_boundaries(boundaries)
}

/// One prompt's length, counted at most once however many steps of a request ask for it
/// (boundary checks, then adaptive bucket serving's picture of the traffic).
pub struct PromptLength<'t> {
    text: &'t str,
    counted: std::cell::Cell<Option<usize>>,
}

impl<'t> PromptLength<'t> {
    pub fn new(text: &'t str) -> PromptLength<'t> {
        PromptLength {
            text,
            counted: std::cell::Cell::new(None),
        }
    }

    /// [`prompt_tokens_if_needed`], keeping a count it takes.
    pub fn for_boundaries(&self, boundaries: &[i64]) -> usize {
        let (min, max) = prompt_tokens_bounds(self.text);
        if min == max {
            return min;
        }
        let lo = i64::try_from(min).unwrap_or(i64::MAX);
        let hi = i64::try_from(max).unwrap_or(i64::MAX);
        if boundaries.iter().any(|b| (lo..=hi).contains(b)) {
            self.counted()
        } else {
            min
        }
    }

    /// The count taken so far, if one was.
    pub fn taken(&self) -> Option<usize> {
        self.counted.get()
    }

    /// The `cl100k_base` count, or past [`EXACT_COUNT_MAX_BYTES`] the estimate of four bytes
    /// per token within [`prompt_tokens_bounds`].
    pub fn counted(&self) -> usize {
        if let Some(n) = self.counted.get() {
            return n;
        }
        let n = if self.text.len() > EXACT_COUNT_MAX_BYTES {
            let (min, max) = prompt_tokens_bounds(self.text);
            (self.text.len() / 4).clamp(min, max)
        } else {
            prompt_tokens(self.text)
        };
        self.counted.set(Some(n));
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_from_env() {
        let cases = [
            (None, TokenizerKind::Character),
            (Some("character"), TokenizerKind::Character),
            (Some("tiktoken"), TokenizerKind::Tiktoken),
            (Some("Tiktoken"), TokenizerKind::Character),
            (Some(" tiktoken"), TokenizerKind::Character),
            (Some("remote"), TokenizerKind::Character),
            (Some(""), TokenizerKind::Character),
        ];
        for (value, want) in cases {
            assert_eq!(TokenizerKind::from_env(value), want, "{value:?}");
        }
        assert_eq!(TokenizerKind::default(), TokenizerKind::Character);
    }

    #[test]
    fn known_cl100k_ids() {
        let cases: &[(&str, &[u32])] = &[
            ("", &[]),
            ("hello world", &[15339, 1917]),
            ("a", &[64]),
            ("  \n\n  x", &[19124, 220, 865]),
            ("12345678901", &[4513, 10961, 16474, 1721]),
            ("don't I'LL we've", &[15357, 956, 358, 6, 4178, 584, 3077]),
            ("🚀", &[9468, 248, 222]),
            // Special tokens are plain text.
            ("<|endoftext|> hi", &[27, 91, 8862, 728, 428, 91, 29, 15960]),
        ];
        for (text, ids) in cases {
            assert_eq!(encode(text), *ids, "{text:?}");
            assert_eq!(prompt_tokens(text), ids.len(), "{text:?}");
        }
        assert_eq!(prompt_tokens(&"a".repeat(100)), 13);
        assert!(warm_up());
    }

    #[test]
    fn streams_are_cut_to_whole_blocks() {
        let text = "abcdefghij";
        let cut = whole_blocks(token_stream(TokenizerKind::Character, text), 4);
        assert!(matches!(cut, Cow::Borrowed(b"abcdefgh")));
        let cut = whole_blocks(Cow::Owned(vec![1, 2, 3, 4, 5]), 2);
        assert_eq!(*cut, [1, 2, 3, 4]);
    }

    #[test]
    fn token_streams() {
        assert_eq!(*token_stream(TokenizerKind::Character, ""), *b"");
        assert_eq!(
            *token_stream(TokenizerKind::Character, "hé"),
            [b'h', 0xc3, 0xa9]
        );
        assert_eq!(*token_stream(TokenizerKind::Tiktoken, ""), *b"");
        // 15339 = 0x3BEB, 1917 = 0x077D.
        assert_eq!(
            *token_stream(TokenizerKind::Tiktoken, "hello world"),
            [0, 0, 0x3b, 0xeb, 0, 0, 0x07, 0x7d]
        );
    }

    #[test]
    fn max_token_bytes_matches_vocabulary() {
        let bpe = encoder().expect("vocabulary loads");
        let longest = (0..100_256u32)
            .filter_map(|id| bpe.decode_bytes(&[id]).ok())
            .map(|b| b.len())
            .max();
        assert_eq!(longest, Some(MAX_TOKEN_BYTES));
    }

    /// Varied texts for the bounds property: ASCII prose, code, numbers, CJK, emoji, accents,
    /// whitespace runs, punctuation runs and mixtures.
    fn corpus() -> Vec<String> {
        let atoms = [
            "hello",
            " world",
            "The quick brown fox jumps over the lazy dog.",
            "don't",
            "'s",
            "I'LL",
            "1234567",
            "3.14159",
            "2024-03-15",
            "数据分析显示增长",
            "日本語のテキスト",
            "🚀",
            "👨‍👩‍👧",
            "café",
            "naïve",
            "Ωmega",
            "٣٤٥",
            "Ⅻ",
            "   ",
            "\n\n",
            "\t",
            " \r\n ",
            "                                                                                                                                                                      ",
            "!!!???",
            "((x))",
            "====",
            "fn main() { println!(\"{}\", x + 42); }",
            "<|endoftext|>",
            "a",
            "zxqjvk",
            "€",
            "\u{0301}",
            "x\u{301}y",
            "a'sb",
            "'s'S'LL'd",
            "a1b2c3",
            "ÀBÇ",
            "$100,000.00",
            "\r\n\r\n",
            "  \n  ",
        ];
        let mut out: Vec<String> = atoms.iter().map(|s| s.to_string()).collect();
        // Deterministic pseudo-random concatenations.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..400 {
            let mut s = String::new();
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let parts = 1 + (state % 12) as usize;
            for k in 0..parts {
                let pick = ((state >> (k * 5)) as usize + k * 7) % atoms.len();
                s.push_str(atoms[pick]);
            }
            out.push(s);
        }
        out.push("a".repeat(1000));
        out.push(" ".repeat(1000));
        out.push("9".repeat(1000));
        out.push("🚀".repeat(300));
        out.push("word ".repeat(500));
        out
    }

    #[test]
    fn bounds_contain_exact_count() {
        for text in corpus() {
            let exact = prompt_tokens(&text);
            let (min, max) = prompt_tokens_bounds(&text);
            assert!(
                min <= exact && exact <= max,
                "{text:?}: {min} <= {exact} <= {max}"
            );
        }
    }

    #[test]
    fn bounds_examples() {
        let cases = [
            ("", (0, 0)),
            ("a", (1, 1)),
            ("hello world", (2, 11)),
            ("don't", (2, 5)),
            ("1234567", (3, 7)),
            ("café au lait", (3, 13)),
            ("数据", (1, 6)),
        ];
        for (text, want) in cases {
            assert_eq!(prompt_tokens_bounds(text), want, "{text:?}");
        }
        // Only the length term helps on a long whitespace run.
        assert_eq!(prompt_tokens_bounds(&" ".repeat(300)), (3, 300));
    }

    #[test]
    fn if_needed_counts_only_near_a_boundary() {
        let text = "The quick brown fox jumps over the lazy dog."; // 10 tokens, bounds (9, 44)
        assert_eq!(prompt_tokens(text), 10);
        assert_eq!(prompt_tokens_bounds(text), (9, 44));
        let cases: &[(&[i64], usize)] = &[
            (&[], 9),
            (&[5], 9),
            (&[8, 45, 1000], 9),
            (&[-1, i64::MIN, i64::MAX], 9),
            (&[9], 10),
            (&[10], 10),
            (&[11], 10),
            (&[44], 10),
            (&[2, 30], 10),
        ];
        for (boundaries, want) in cases {
            assert_eq!(
                prompt_tokens_if_needed(text, boundaries),
                *want,
                "{boundaries:?}"
            );
        }
        // Equal bounds are exact with no tokenizer.
        assert_eq!(prompt_tokens_if_needed("", &[0]), 0);
        assert_eq!(prompt_tokens_if_needed("x", &[1]), 1);
    }

    #[test]
    fn if_needed_agrees_with_exact_on_every_range_check() {
        for text in corpus().iter().take(120) {
            let exact = prompt_tokens(text) as i64;
            for b in [0i64, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 1000] {
                let got = prompt_tokens_if_needed(text, &[b]) as i64;
                assert_eq!(got < b, exact < b, "{text:?} vs {b}");
                assert_eq!(got <= b, exact <= b, "{text:?} vs {b}");
            }
        }
    }

    /// A million spaces and a letter made the encoder's regex give up and `tiktoken-rs` panic
    /// (a trapped VM); counted in segments it is a count like any, near the exact one (a run of
    /// spaces is cut every segment, each cut costing at most a token).
    #[test]
    fn a_million_spaces_count_without_a_panic() {
        for filler in [" ", "\t", "\u{a0}"] {
            let text = format!("{}x", filler.repeat(1_000_000));
            let tokens = prompt_tokens(&text);
            let (min, max) = prompt_tokens_bounds(&text);
            assert!((min..=max).contains(&tokens), "{filler:?}: {tokens}");
        }
        let spaces = prompt_tokens(&format!("{}x", " ".repeat(1_000_000)));
        // 128 spaces per token, then " x"; 16 cuts.
        let exact = 1_000_000usize.div_ceil(128);
        assert!((exact..=exact + 2 * 16).contains(&spaces), "{spaces}");
    }

    /// Cut before a space that follows a printable character, segments add up to the whole
    /// text's ids exactly, cut after cut.
    #[test]
    fn segments_cut_where_pieces_begin() {
        let text = "The quick brown fox jumps over the lazy dog. Don't stop: x = f(y) + 42;\n\n  \
                    indented {braces}!\tand 1234567 digits, \"quotes\" 's 'll... "
            .repeat(40);
        let bpe = encoder().expect("encoder");
        let whole = bpe.encode_ordinary(&text);
        let mut pieces = Vec::new();
        let mut cuts = 0;
        for segment in segments(&text, 64) {
            assert!(segment.len() <= 64);
            cuts += 1;
            pieces.extend(bpe.encode_ordinary(segment));
        }
        assert!(cuts > 50, "{cuts}");
        assert!(
            pieces == whole,
            "{} ids in pieces, {} whole",
            pieces.len(),
            whole.len()
        );
        assert!(encode(&text) == whole);
        // Without a space to cut before, segments still cover the text, on char boundaries.
        let cjk = "日本語のテキスト".repeat(50);
        assert_eq!(segments(&cjk, 64).collect::<String>(), cjk);
    }

    /// Past the exact-count limit a boundary within the bounds gets the estimate, not a count.
    #[test]
    fn a_huge_prompt_near_a_boundary_is_estimated() {
        let text = " ".repeat(EXACT_COUNT_MAX_BYTES + 1);
        let (min, max) = prompt_tokens_bounds(&text);
        let boundary = [i64::try_from(min + 1).unwrap()];
        let estimate = prompt_tokens_if_needed(&text, &boundary);
        assert_eq!(estimate, text.len() / 4);
        assert!((min..=max).contains(&estimate));
        let counted = " ".repeat(EXACT_COUNT_MAX_BYTES);
        assert_eq!(
            prompt_tokens_if_needed(&counted, &boundary),
            prompt_tokens(&counted)
        );
    }

    /// Routing asks for the length twice (boundary checks, then bucket serving's picture):
    /// the count is taken once, and what bucket serving reads is the count, not the lower
    /// bound Step 0 may have settled for (CJK's is a thirtieth of the count).
    #[test]
    fn a_prompt_length_is_counted_once_and_never_a_bound() {
        let cjk = "東京の天気は今日とても良いです。".repeat(40);
        let exact = prompt_tokens(&cjk);
        let (min, _) = prompt_tokens_bounds(&cjk);
        assert!(min * 5 < exact, "{min} vs {exact}");

        let far = PromptLength::new(&cjk);
        assert_eq!(far.for_boundaries(&[1 << 40]), min);
        assert_eq!(far.taken(), None, "no boundary near: nothing counted");
        assert_eq!(far.counted(), exact);

        let near = PromptLength::new(&cjk);
        let edge = [i64::try_from(exact).unwrap()];
        assert_eq!(near.for_boundaries(&edge), exact);
        assert_eq!(near.taken(), Some(exact));
        assert_eq!(near.counted(), exact);
    }
}
