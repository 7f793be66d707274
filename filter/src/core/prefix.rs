//! The prefix index of spec §4.1: which pods recently prefilled which prompt prefixes.
//!
//! A prompt's token stream is cut into fixed-size blocks; the index answers "how much of this
//! prompt, counted in whole blocks from the start, does each candidate pod already have",
//! which the `prefix_cache`, `conductor` and `hybrid_cache_load` prefill policies turn into
//! scores. The spec names blocks by a chain of XXH64 hashes; [`PrefixIndex`] is a radix tree
//! over the streams themselves with the same matches (see `tree.rs` for why), so the hash
//! seed settings are accepted but change nothing.
//!
//! Each Envoy worker holds its own index. The worker that routed a request learns the prefix,
//! applies it locally and publishes a [`PrefixEvent`] in its ring in shared data; the other
//! workers apply it when they next select with the index (see `log.rs`).

mod event;
pub mod follow;
pub mod log;
mod names;
#[cfg(test)]
mod reference;
mod tree;

pub use event::{EventBatch, EventError, EventRef, PrefixEvent, RingEntry, ENTRY_HEADER};
pub use tree::PrefixIndex;

/// `AIBRIX_PREFIX_CACHE_BLOCK_SIZE` default, in bytes of the token stream.
pub const DEFAULT_BLOCK_SIZE: usize = 4;
/// `AIBRIX_PREFIX_CACHE_BLOCK_NUMBER` default: the LRU capacity in blocks.
pub const DEFAULT_BLOCK_NUMBER: usize = 200_000;
/// `AIBRIX_PREFIX_CACHE_EVICTION_INTERVAL_SECONDS` default: how often to sweep by age.
pub const DEFAULT_EVICTION_INTERVAL_MS: u64 = 1_000;
/// `AIBRIX_PREFIX_CACHE_EVICTION_DURATION_MINS` default (20 min): idle age that evicts a block.
pub const DEFAULT_EVICTION_AGE_MS: u64 = 20 * 60 * 1_000;
/// At most this many (model, pod) holders are kept per block; a new one replaces the least
/// recently seen (the first of the oldest). AIBrix has no cap, but then a block that stays hot forever would collect
/// every pod name that ever served it, and pods get new names on every rollout. Below the cap
/// the behaviour is AIBrix's.
pub const MAX_HOLDERS_PER_BLOCK: usize = 64;

/// The prefix-index settings of the gateway environment (`AIBRIX_PREFIX_CACHE_*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixSettings {
    pub tokenizer: crate::core::tokenize::TokenizerKind,
    pub block_size: usize,
    pub capacity: usize,
    pub eviction_interval_ms: u64,
    pub eviction_age_ms: u64,
}

impl Default for PrefixSettings {
    fn default() -> Self {
        PrefixSettings {
            tokenizer: crate::core::tokenize::TokenizerKind::Character,
            block_size: DEFAULT_BLOCK_SIZE,
            capacity: DEFAULT_BLOCK_NUMBER,
            eviction_interval_ms: DEFAULT_EVICTION_INTERVAL_MS,
            eviction_age_ms: DEFAULT_EVICTION_AGE_MS,
        }
    }
}

impl PrefixSettings {
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> (PrefixSettings, Vec<String>) {
        let d = PrefixSettings::default();
        let mut r = crate::core::env::EnvReader::new(get);
        let tokenizer_value = r.string("AIBRIX_PREFIX_CACHE_TOKENIZER_TYPE");
        let tokenizer = crate::core::tokenize::TokenizerKind::from_env(tokenizer_value.as_deref());
        if let Some(v) = tokenizer_value.filter(|v| !matches!(v.as_str(), "character" | "tiktoken"))
        {
            // AIBrix falls back as silently; a typo of `tiktoken` would change every prefix
            // match without a word.
            r.warnings.push(format!(
                "AIBRIX_PREFIX_CACHE_TOKENIZER_TYPE={v:?} is neither \"character\" nor \"tiktoken\"; using character"
            ));
        }
        // Sizes fit a 32-bit usize (wasm32) and periods their milliseconds a u64 (a year and
        // ten years at most): a larger value would truncate or wrap to a tiny one silently
        // (a block number of 2^32 turned the cache off, an age of 2^59 minutes evicted every
        // block at each sweep).
        let block_size = r.count_at_most(
            "AIBRIX_PREFIX_CACHE_BLOCK_SIZE",
            d.block_size as u64,
            u64::from(u32::MAX),
        ) as usize;
        let capacity = r.count_at_most(
            "AIBRIX_PREFIX_CACHE_BLOCK_NUMBER",
            d.capacity as u64,
            u64::from(u32::MAX),
        ) as usize;
        let interval_s = r.count_at_most(
            "AIBRIX_PREFIX_CACHE_EVICTION_INTERVAL_SECONDS",
            d.eviction_interval_ms / 1000,
            366 * 24 * 3600,
        );
        let age_min = r.count_at_most(
            "AIBRIX_PREFIX_CACHE_EVICTION_DURATION_MINS",
            d.eviction_age_ms / 60_000,
            10 * 366 * 24 * 60,
        );
        if r.string("AIBRIX_PREFIX_CACHE_HASH_SEED").is_some() {
            // The index compares prompt bytes rather than chained hashes: no seed to share.
            r.warnings.push(
                "AIBRIX_PREFIX_CACHE_HASH_SEED has no effect: the prefix index compares prompt \
                 bytes, not hashes"
                    .into(),
            );
        }
        let settings = PrefixSettings {
            tokenizer,
            block_size,
            capacity,
            eviction_interval_ms: interval_s.saturating_mul(1000),
            eviction_age_ms: age_min.saturating_mul(60_000),
        };
        (settings, r.warnings)
    }
}

/// `AIBRIX_MIN_MATCH_PCT`: a match below the threshold counts as no match. A threshold of 0
/// turns the rule off (no percentage is below 0).
pub fn apply_min_match(pct: u32, min_match_pct: u32) -> u32 {
    if pct < min_match_pct {
        0
    } else {
        pct
    }
}

#[cfg(test)]
mod tests {
    use super::reference::ReferenceIndex;
    use super::*;
    use crate::core::tokenize::TokenizerKind;
    use proptest::prelude::*;

    #[test]
    fn min_match() {
        let cases = [
            (0, 0, 0),
            (50, 0, 50),
            (100, 0, 100),
            (49, 50, 0),
            (50, 50, 50),
            (51, 50, 51),
            (100, 100, 100),
            (99, 100, 0),
        ];
        for (pct, min, want) in cases {
            assert_eq!(apply_min_match(pct, min), want, "{pct} {min}");
        }
    }

    #[test]
    fn the_hash_seed_is_reported_as_without_effect() {
        let (settings, warnings) = PrefixSettings::from_lookup(|k| {
            (k == "AIBRIX_PREFIX_CACHE_HASH_SEED").then(|| "42".to_string())
        });
        assert_eq!(settings, PrefixSettings::default());
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("no effect"));
    }

    #[test]
    fn an_unknown_tokenizer_falls_back_to_character_with_a_warning() {
        for (value, want, warned) in [
            ("tiktoken", TokenizerKind::Tiktoken, false),
            ("character", TokenizerKind::Character, false),
            ("Tiktoken", TokenizerKind::Character, true),
            ("remote", TokenizerKind::Character, true),
        ] {
            let (settings, warnings) = PrefixSettings::from_lookup(|k| {
                (k == "AIBRIX_PREFIX_CACHE_TOKENIZER_TYPE").then(|| value.to_string())
            });
            assert_eq!(settings.tokenizer, want, "{value}");
            assert_eq!(
                warnings.iter().any(|w| w.contains(value)),
                warned,
                "{value}: {warnings:?}"
            );
        }
    }

    #[test]
    fn values_that_would_truncate_or_wrap_keep_the_default_with_a_warning() {
        for (name, value) in [
            ("AIBRIX_PREFIX_CACHE_BLOCK_SIZE", "4294967296"),
            ("AIBRIX_PREFIX_CACHE_BLOCK_NUMBER", "4294967296"),
            (
                "AIBRIX_PREFIX_CACHE_EVICTION_INTERVAL_SECONDS",
                "18446744073709552",
            ),
            (
                "AIBRIX_PREFIX_CACHE_EVICTION_DURATION_MINS",
                "576460752303423488",
            ),
        ] {
            let (settings, warnings) =
                PrefixSettings::from_lookup(|k| (k == name).then(|| value.to_string()));
            assert_eq!(settings, PrefixSettings::default(), "{name}");
            assert!(
                warnings.len() == 1 && warnings[0].contains(name),
                "{name}: {warnings:?}"
            );
        }
        let (settings, warnings) = PrefixSettings::from_lookup(|k| {
            (k == "AIBRIX_PREFIX_CACHE_EVICTION_DURATION_MINS").then(|| "5256000".to_string())
        });
        assert_eq!(settings.eviction_age_ms, 5_256_000 * 60_000);
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    /// Index with one-byte blocks, so a prompt "abcd" is four blocks.
    fn bytes_index(capacity: usize) -> PrefixIndex {
        PrefixIndex::new(capacity, 1)
    }

    #[test]
    fn match_walks() {
        struct Case {
            name: &'static str,
            /// (prompt, model, pod) added in order.
            adds: Vec<(&'static str, &'static str, &'static str)>,
            query: &'static str,
            model: &'static str,
            candidates: Vec<&'static str>,
            want: Vec<u32>,
        }
        let case = |name, adds, query, model, candidates, want| Case {
            name,
            adds,
            query,
            model,
            candidates,
            want,
        };
        let cases = vec![
            case(
                "empty index",
                vec![],
                "abcd",
                "m",
                vec!["a", "b"],
                vec![0, 0],
            ),
            case(
                "no blocks",
                vec![("abcd", "m", "a")],
                "",
                "m",
                vec!["a"],
                vec![0],
            ),
            case(
                "full match",
                vec![("abcd", "m", "a")],
                "abcd",
                "m",
                vec!["a", "b"],
                vec![100, 0],
            ),
            case(
                // 1·100/3 = 33, 2·100/3 = 66.
                "partial prefix, integer division",
                vec![("a", "m", "a"), ("ab", "m", "b")],
                "abc",
                "m",
                vec!["a", "b", "c"],
                vec![33, 66, 0],
            ),
            case(
                "seven blocks",
                vec![("abcde", "m", "a")],
                "abcdefg",
                "m",
                vec!["a"],
                vec![71],
            ),
            case(
                "a pod that stops holding blocks leaves the walk for good",
                vec![("abcd", "m", "a"), ("ab", "m", "b")],
                "abcd",
                "m",
                vec!["b", "a"],
                vec![50, 100],
            ),
            case(
                "a pod dropped early keeps its last percentage",
                vec![("abcd", "m", "a"), ("a", "m", "b")],
                "abcd",
                "m",
                vec!["a", "b"],
                vec![100, 25],
            ),
            case(
                "walk stops at a block only non-candidates hold",
                vec![("abc", "m", "z"), ("a", "m", "a")],
                "abc",
                "m",
                vec!["a"],
                vec![33],
            ),
            case(
                "prompts diverging inside a run",
                vec![("abXY", "m", "a")],
                "abcd",
                "m",
                vec!["a"],
                vec![50],
            ),
            case(
                "same bytes at another position are not a prefix",
                vec![("bcd", "m", "a")],
                "abcd",
                "m",
                vec!["a"],
                vec![0],
            ),
            case(
                "block 0 held only by a non-candidate",
                vec![("abc", "m", "z")],
                "abc",
                "m",
                vec!["a", "b"],
                vec![0, 0],
            ),
            case(
                "models are separate",
                vec![("abcd", "m1", "a"), ("ab", "m2", "b")],
                "abcd",
                "m2",
                vec!["a", "b"],
                vec![0, 50],
            ),
            case(
                "unknown model",
                vec![("abcd", "m1", "a")],
                "abcd",
                "m9",
                vec!["a"],
                vec![0],
            ),
            case(
                "a block held only under another model stops the walk",
                vec![("abc", "other", "a"), ("a", "m", "a")],
                "abc",
                "m",
                vec!["a"],
                vec![33],
            ),
            case(
                "duplicate candidates",
                vec![("ab", "m", "a")],
                "ab",
                "m",
                vec!["a", "a"],
                vec![100, 100],
            ),
            case(
                "no candidates",
                vec![("ab", "m", "a")],
                "ab",
                "m",
                vec![],
                vec![],
            ),
            case(
                "model names and pod names do not collide",
                vec![("ab", "a", "m")],
                "ab",
                "m",
                vec!["a"],
                vec![0],
            ),
        ];
        for c in cases {
            let mut index = bytes_index(100);
            for (i, (prompt, model, pod)) in c.adds.iter().enumerate() {
                index.add_prefix(prompt.as_bytes(), model, pod, i as u64);
                index.check();
            }
            assert_eq!(
                index.match_prefix(c.query.as_bytes(), c.model, &c.candidates),
                c.want,
                "{}",
                c.name
            );
        }
    }

    /// A lookup reports only the candidates holding a prefix, at the slots the caller
    /// gives, each once; holders that are not candidates (a pod that left the fleet) are
    /// passed over, and another model's holders do not count.
    #[test]
    fn a_lookup_reports_only_candidates_holding_the_prefix() {
        let mut index = PrefixIndex::new(1000, DEFAULT_BLOCK_SIZE);
        let shared = b"system prompt: be brief. ";
        let long = b"system prompt: be brief. tell me more about it";
        index.add_prefix(long, "m", "ns/a", 0);
        index.add_prefix(shared, "m", "ns/b", 1);
        index.add_prefix(long, "m", "ns/gone", 2);
        index.add_prefix(long, "other", "ns/c", 3);
        let slots = |key: &str| match key {
            "ns/a" => Some(7),
            "ns/b" => Some(3),
            "ns/c" => Some(5),
            _ => None,
        };
        let mut found = Vec::new();
        index.match_candidates(long, "m", slots, |slot, pct| found.push((slot, pct)));
        found.sort_unstable();
        // 46 bytes → 11 blocks; "ns/b" holds the first 6 (24 bytes).
        assert_eq!(found, vec![(3, 54), (7, 100)]);
        let mut none = Vec::new();
        index.match_candidates(b"unrelated prompt text", "m", slots, |s, p| {
            none.push((s, p))
        });
        assert_eq!(none, vec![]);
    }

    #[test]
    fn four_byte_blocks_ignore_a_trailing_partial_block() {
        let a = b"system prompt: be brief. question one";
        let b = b"system prompt: be brief. question two";
        let mut index = PrefixIndex::new(1000, DEFAULT_BLOCK_SIZE);
        index.add_prefix(a, "m", "pod-a", 0);
        // 36 bytes → 9 blocks; "system prompt: be brief. question " is 33 bytes → 8 shared.
        assert_eq!(index.len(), 9);
        assert_eq!(index.match_prefix(b, "m", &["pod-a"]), vec![88]);
        assert_eq!(index.match_prefix(a, "m", &["pod-a"]), vec![100]);
        // A partial last block changes nothing; a prompt below one block has no blocks.
        assert_eq!(index.match_prefix(&a[..35], "m", &["pod-a"]), vec![100]);
        assert_eq!(index.match_prefix(b"sys", "m", &["pod-a"]), vec![0]);
        index.add_prefix(b"sys", "m", "pod-b", 1);
        assert_eq!(index.len(), 9);
        // Blocks longer than a packed key (hashed keys, bytes confirmed).
        let mut wide = PrefixIndex::new(1000, 16);
        wide.add_prefix(a, "m", "pod-a", 0);
        assert_eq!(wide.len(), 2);
        assert_eq!(wide.match_prefix(b, "m", &["pod-a"]), vec![100]);
        assert_eq!(
            wide.match_prefix(b"system promXt: be brief.", "m", &["pod-a"]),
            vec![0]
        );
        wide.check();
    }

    #[test]
    fn capacity_evicts_least_recently_added() {
        let mut index = bytes_index(3);
        index.add_prefix(b"1", "m", "a", 0);
        index.add_prefix(b"2", "m", "a", 1);
        index.add_prefix(b"3", "m", "a", 2);
        assert_eq!(index.len(), 3);
        // Refreshing 1 makes 2 the least recent.
        index.add_prefix(b"1", "m", "b", 3);
        index.add_prefix(b"4", "m", "a", 4);
        index.check();
        assert_eq!(index.len(), 3);
        let held = |index: &PrefixIndex, p: &[u8]| index.match_prefix(p, "m", &["a"])[0] == 100;
        assert!(held(&index, b"1") && !held(&index, b"2"));
        assert!(held(&index, b"3") && held(&index, b"4"));
        // Lookups do not refresh: 3 is still the least recent and goes next.
        index.add_prefix(b"5", "m", "a", 5);
        assert!(!held(&index, b"3") && held(&index, b"1"));
        // One prompt longer than the capacity keeps its first blocks.
        let mut small = bytes_index(2);
        small.add_prefix(b"abcde", "m", "a", 0);
        small.check();
        assert_eq!(small.len(), 2);
        assert_eq!(small.match_prefix(b"abcde", "m", &["a"]), vec![40]);
        // Capacity 0 keeps nothing, and leaks no names.
        let mut none = bytes_index(0);
        none.add_prefix(b"abc", "m", "a", 0);
        assert!(none.is_empty());
        assert_eq!(none.name_count(), 0);
        none.check();
    }

    #[test]
    fn a_full_index_reuses_its_edges() {
        let mut index = bytes_index(50);
        for i in 0..10_000u64 {
            let pod = format!("pod-{}", i % 7);
            let prompt = i.to_le_bytes();
            index.add_prefix(&prompt[..3], "m", &pod, i);
        }
        index.check();
        assert_eq!(index.len(), 50);
        assert!(index.nodes_allocated() <= 60, "{}", index.nodes_allocated());
        // Only the pods still holding a block keep their names.
        assert!(index.name_count() <= 8);
        let last = 9_999u64.to_le_bytes();
        assert_eq!(index.match_prefix(&last[..3], "m", &["pod-3"]), vec![100]);
    }

    #[test]
    fn huge_prompts_leave_no_huge_buffers_behind() {
        // The default capacity (200 000 blocks of 4 bytes) against 8 MiB prompts.
        let mut index = PrefixIndex::new(DEFAULT_BLOCK_NUMBER, DEFAULT_BLOCK_SIZE);
        for salt in 0..6u8 {
            let mut huge = vec![b'x'; 8 << 20];
            huge[0] = salt;
            index.add_prefix(&huge, "m", "a", u64::from(salt));
            for i in 0..100u32 {
                index.add_prefix(format!("short prompt {salt} {i}").as_bytes(), "m", "a", 9);
            }
        }
        index.check();
        let held = index.len() * DEFAULT_BLOCK_SIZE;
        assert!(
            index.edge_capacity() < held + 64 * 16 * 1024,
            "{} bytes of buffers for {held} bytes held",
            index.edge_capacity()
        );
    }

    #[test]
    fn add_refreshes_times() {
        let mut index = bytes_index(10);
        index.add_prefix(b"xy", "m", "a", 100);
        index.add_prefix(b"x", "m", "b", 200);
        assert_eq!(index.last_access(b"x", "m", "a"), Some(100));
        assert_eq!(index.last_access(b"x", "m", "b"), Some(200));
        assert_eq!(index.last_access(b"xy", "m", "b"), None);
        index.add_prefix(b"xy", "m", "a", 300);
        assert_eq!(index.last_access(b"x", "m", "a"), Some(300));
        assert_eq!(index.last_access(b"xy", "m", "a"), Some(300));
        assert_eq!(index.last_access(b"z", "m", "a"), None);
        assert_eq!(index.last_access(b"xyz", "m", "a"), None);
        assert_eq!(index.last_access(b"x", "other", "a"), None);
        index.check();
    }

    #[test]
    fn age_eviction() {
        let mut index = bytes_index(100);
        index.add_prefix(b"1", "m", "a", 1_000);
        index.add_prefix(b"2", "m", "a", 2_000);
        index.add_prefix(b"3", "m", "a", 3_000);
        // Strictly older than the age goes: 1 is exactly 1000 ms old and stays.
        assert_eq!(index.evict_older_than(2_000, 1_000), 0);
        assert_eq!(index.evict_older_than(2_001, 1_000), 1);
        assert_eq!(index.len(), 2);
        // Refreshing 2 keeps it past 3.
        index.add_prefix(b"2", "m", "b", 5_000);
        assert_eq!(index.evict_older_than(5_500, 1_000), 1);
        assert_eq!(index.match_prefix(b"2", "m", &["a", "b"]), vec![100, 100]);
        assert_eq!(index.match_prefix(b"3", "m", &["a"]), vec![0]);
        assert_eq!(index.evict_older_than(100_000, 1_000), 1);
        assert!(index.is_empty());
        assert_eq!(index.name_count(), 0);
        // A clock that went backwards evicts nothing.
        index.add_prefix(b"7", "m", "a", 10_000);
        assert_eq!(index.evict_older_than(0, 0), 0);
        // Late events (older times ahead of younger edges) wait for the edges behind them.
        let mut index = bytes_index(100);
        index.add_prefix(b"1", "m", "a", 5_000);
        index.add_prefix(b"2", "m", "a", 1_000);
        assert_eq!(index.evict_older_than(5_500, 1_000), 0);
        assert_eq!(index.evict_older_than(6_001, 1_000), 2);
        // A long prompt's blocks go together, counted one by one.
        index.add_prefix(b"abcdef", "m", "a", 7_000);
        assert_eq!(index.evict_older_than(9_000, 1_000), 6);
        index.check();
    }

    #[test]
    fn holders_per_block_are_capped() {
        let mut index = bytes_index(10);
        let extra = 5;
        for i in 0..(MAX_HOLDERS_PER_BLOCK + extra) {
            index.add_prefix(b"1", "m", &format!("p{i}"), i as u64);
        }
        // The least recently seen holders were replaced.
        for i in 0..extra {
            assert_eq!(index.last_access(b"1", "m", &format!("p{i}")), None);
        }
        let last = format!("p{}", MAX_HOLDERS_PER_BLOCK + extra - 1);
        assert_eq!(index.match_prefix(b"1", "m", &[&last, "p0"]), vec![100, 0]);
        // Names of replaced holders are freed: the model plus the kept pods.
        assert_eq!(index.name_count(), 1 + MAX_HOLDERS_PER_BLOCK);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add {
            prompt: Vec<u8>,
            model: usize,
            pod: usize,
            at_ms: u64,
        },
        Match {
            prompt: Vec<u8>,
            model: usize,
            candidates: Vec<usize>,
        },
        Evict {
            now_ms: u64,
            age_ms: u64,
        },
    }

    const MODELS: [&str; 2] = ["m1", "m2"];
    const PODS: [&str; 5] = ["p0", "p1", "p2", "p3", "p4"];

    fn prompt() -> impl Strategy<Value = Vec<u8>> {
        // A three-letter alphabet so prompts share prefixes and diverge inside runs.
        proptest::collection::vec(prop_oneof![Just(b'a'), Just(b'b'), Just(b'c')], 0..14)
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (prompt(), 0..2usize, 0..5usize, 0..200u64).prop_map(|(prompt, model, pod, at_ms)| {
                Op::Add { prompt, model, pod, at_ms }
            }),
            3 => (prompt(), 0..2usize, proptest::collection::vec(0..5usize, 0..4)).prop_map(
                |(prompt, model, candidates)| Op::Match { prompt, model, candidates }
            ),
            1 => (0..250u64, 0..100u64).prop_map(|(now_ms, age_ms)| Op::Evict { now_ms, age_ms }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The radix tree answers every lookup, eviction and timestamp query exactly as the
        /// per-block hashed index of the spec does.
        #[test]
        fn the_tree_agrees_with_the_per_block_index(
            block_size in 1..4usize,
            capacity in 0..24usize,
            ops in proptest::collection::vec(op(), 1..60),
        ) {
            let mut tree = PrefixIndex::new(capacity, block_size);
            let mut oracle = ReferenceIndex::new(capacity, block_size);
            for op in ops {
                match op {
                    Op::Add { prompt, model, pod, at_ms } => {
                        tree.add_prefix(&prompt, MODELS[model], PODS[pod], at_ms);
                        oracle.add_prefix(&prompt, MODELS[model], PODS[pod], at_ms);
                        for m in MODELS {
                            for p in PODS {
                                prop_assert_eq!(
                                    tree.last_access(&prompt, m, p),
                                    oracle.last_access(&prompt, m, p)
                                );
                            }
                        }
                    }
                    Op::Match { prompt, model, candidates } => {
                        let names: Vec<&str> = candidates.iter().map(|&c| PODS[c]).collect();
                        prop_assert_eq!(
                            tree.match_prefix(&prompt, MODELS[model], &names),
                            oracle.match_prefix(&prompt, MODELS[model], &names)
                        );
                    }
                    Op::Evict { now_ms, age_ms } => {
                        prop_assert_eq!(
                            tree.evict_older_than(now_ms, age_ms),
                            oracle.evict_older_than(now_ms, age_ms)
                        );
                    }
                }
                tree.check();
                prop_assert_eq!(tree.len(), oracle.len());
            }
        }
    }
}
