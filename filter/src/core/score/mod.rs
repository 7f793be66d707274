//! Scoring policies of the PD cascade as pure functions: which policy a request uses, the
//! prefill and decode formulas, the σ filter and the two load-imbalance fast paths.
//!
//! Everything here takes explicit numbers and returns numbers, so the selection code can stay
//! a thin loop over pods and every formula is tested against hand-computed values. Lower
//! scores are better everywhere, as in AIBrix.

pub mod decode;
pub mod prefill;

pub use decode::{
    decode_fast_path, DecodeBatch, DecodeInput, DecodeMaxima, DecodeScore, DecodeStats,
    DecodeThresholds, FastPathCheck, FastPathPick, LbWeights, ScoreSource,
};
pub use prefill::{effective_match_pct, mean_std, prefill_fast_path};

/// The final-pair normaliser of the prefill side starts here (`max(1, scores)`), so a batch of
/// tiny scores is not blown up into a decisive difference.
pub const PREFILL_MAX_SCORE_FLOOR: f64 = 1.0;
/// The decode side's normaliser starts at 0.01 (AIBrix's `run.MaxScore` seed): decode scores
/// can be legitimately small (a TBT in ms, a fraction) and must still be comparable.
pub const DECODE_MAX_SCORE_FLOOR: f64 = 0.01;

/// Step 5's normalised sum `prefill / maxPrefill + decode / maxDecode`, with both maxima
/// inverted once per selection: the sum is taken for every roleset, and a division in that
/// loop costs several multiplications' time. Every implementation of Step 5 uses this, so
/// they agree to the last bit.
#[derive(Debug, Clone, Copy)]
pub struct Normaliser {
    inv_prefill: f64,
    inv_decode: f64,
}

impl Normaliser {
    /// From the two maxima (each at least its floor, so neither is 0).
    pub fn new(max_prefill: f64, max_decode: f64) -> Normaliser {
        Normaliser {
            inv_prefill: 1.0 / max_prefill,
            inv_decode: 1.0 / max_decode,
        }
    }

    pub fn sum(&self, prefill: f64, decode: f64) -> f64 {
        prefill * self.inv_prefill + decode * self.inv_decode
    }
}

/// How prefill pods are scored (`prefillScorePolicy`, `AIBRIX_PREFILL_SCORE_POLICY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillPolicy {
    /// Prefix-cache affinity plus a small load term (the default).
    #[default]
    PrefixCache,
    /// Fewest in-flight prefill calls.
    LeastRequest,
    /// Estimated TTFT: queue, cached prefix and unmatched prefill time.
    Conductor,
    /// Token-weighted ledger of the prefill work charged to each pod.
    TokenLoad,
    /// The token ledger, discounted by the squared prefix match.
    HybridCacheLoad,
}

impl PrefillPolicy {
    pub const ALL: [PrefillPolicy; 5] = [
        PrefillPolicy::PrefixCache,
        PrefillPolicy::LeastRequest,
        PrefillPolicy::Conductor,
        PrefillPolicy::TokenLoad,
        PrefillPolicy::HybridCacheLoad,
    ];

    /// The configuration spelling, also used in logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            PrefillPolicy::PrefixCache => "prefix_cache",
            PrefillPolicy::LeastRequest => "least_request",
            PrefillPolicy::Conductor => "conductor",
            PrefillPolicy::TokenLoad => "token_load",
            PrefillPolicy::HybridCacheLoad => "hybrid_cache_load",
        }
    }

    /// Parses a `routingConfig.prefillScorePolicy`: trimmed, then a case-sensitive exact match
    /// (AIBrix compares the prefill name as written, unlike the decode one). Unknown (or
    /// empty) gives `None`, and the caller keeps the gateway default: a typo in one profile
    /// must not fail its requests, it only loses the override (the caller logs it).
    pub fn parse(value: &str) -> Option<PrefillPolicy> {
        let value = value.trim();
        PrefillPolicy::ALL.into_iter().find(|p| p.name() == value)
    }

    /// The gateway default from `AIBRIX_PREFILL_SCORE_POLICY`: unset or empty keeps
    /// `prefix_cache` silently, an unknown value keeps it with a warning for the host to log.
    pub fn from_env(raw: Option<&str>) -> (PrefillPolicy, Option<String>) {
        match raw.map(str::trim).filter(|v| !v.is_empty()) {
            None => (PrefillPolicy::default(), None),
            Some(v) => match PrefillPolicy::parse(v) {
                Some(p) => (p, None),
                None => (
                    PrefillPolicy::default(),
                    Some(format!(
                        "AIBRIX_PREFILL_SCORE_POLICY={v:?} is not one of {}; using prefix_cache",
                        names(PrefillPolicy::ALL.map(PrefillPolicy::name))
                    )),
                ),
            },
        }
    }

    /// Whether selections under this policy are charged to the prefill token ledger; AIBrix
    /// charges only these two, so switching policies never leaves a stale ledger behind.
    pub fn uses_token_ledger(self) -> bool {
        matches!(
            self,
            PrefillPolicy::TokenLoad | PrefillPolicy::HybridCacheLoad
        )
    }

    /// Whether the policy looks the prompt up in the prefix index (and so warms it with the
    /// selected pod afterwards).
    pub fn uses_prefix_index(self) -> bool {
        matches!(
            self,
            PrefillPolicy::PrefixCache | PrefillPolicy::Conductor | PrefillPolicy::HybridCacheLoad
        )
    }
}

/// How decode pods are scored (`decodeScorePolicy`, `AIBRIX_DECODE_SCORE_POLICY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodePolicy {
    /// Normalised running requests and inverse throughput over free KV (the default).
    #[default]
    LoadBalancing,
    /// Running plus pending decode requests.
    LeastRequest,
    /// Estimated time between tokens.
    Conductor,
    /// Gateway-side ledger of prompt KV plus the output generated so far.
    TokenLoad,
}

/// A routing configuration names a policy that does not exist.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// Unlike the prefill side, AIBrix fails the request here (503 "error on selecting target
    /// pod"), so the message keeps its exact shape: `%q` of the trimmed value, `%v` of the list.
    #[error("unknown decodeScorePolicy {value:?} in routingConfig (valid: {valid})")]
    UnknownDecode { value: String, valid: String },
}

impl DecodePolicy {
    pub const ALL: [DecodePolicy; 4] = [
        DecodePolicy::LoadBalancing,
        DecodePolicy::LeastRequest,
        DecodePolicy::Conductor,
        DecodePolicy::TokenLoad,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DecodePolicy::LoadBalancing => "load_balancing",
            DecodePolicy::LeastRequest => "least_request",
            DecodePolicy::Conductor => "conductor",
            DecodePolicy::TokenLoad => "token_load",
        }
    }

    fn lookup(value: &str) -> Option<DecodePolicy> {
        let lowered = value.trim().to_ascii_lowercase();
        DecodePolicy::ALL.into_iter().find(|p| p.name() == lowered)
    }

    /// Parses a `routingConfig.decodeScorePolicy`: trimmed and lower-cased. An unknown name is
    /// an error, which fails selection, as in AIBrix.
    pub fn parse(value: &str) -> Result<DecodePolicy, PolicyError> {
        DecodePolicy::lookup(value).ok_or_else(|| PolicyError::UnknownDecode {
            value: value.trim().to_string(),
            valid: names(DecodePolicy::ALL.map(DecodePolicy::name)),
        })
    }

    /// The profile override: absent or blank means "no override" (`Ok(None)`).
    pub fn parse_override(value: Option<&str>) -> Result<Option<DecodePolicy>, PolicyError> {
        match value.map(str::trim).filter(|v| !v.is_empty()) {
            None => Ok(None),
            Some(v) => DecodePolicy::parse(v).map(Some),
        }
    }

    /// The gateway default from `AIBRIX_DECODE_SCORE_POLICY`: empty or unknown keeps
    /// `load_balancing` (unknown with a warning), since a bad env value must not stop routing.
    pub fn from_env(raw: Option<&str>) -> (DecodePolicy, Option<String>) {
        match raw.map(str::trim).filter(|v| !v.is_empty()) {
            None => (DecodePolicy::default(), None),
            Some(v) => match DecodePolicy::lookup(v) {
                Some(p) => (p, None),
                None => (
                    DecodePolicy::default(),
                    Some(format!(
                        "AIBRIX_DECODE_SCORE_POLICY={v:?} is not one of {}; using load_balancing",
                        names(DecodePolicy::ALL.map(DecodePolicy::name))
                    )),
                ),
            },
        }
    }

    /// The decode fast path picks by request count, throughput or drain rate, which is what
    /// `token_load` replaces (a pod holding one long prompt has the fewest requests), so the
    /// seed skips Step 2 under it.
    pub fn runs_fast_path(self) -> bool {
        self != DecodePolicy::TokenLoad
    }

    /// `token_load` scores metric-less pods from its ledger instead of the cold-start score.
    pub fn uses_cold_start(self) -> bool {
        self != DecodePolicy::TokenLoad
    }
}

/// Go's `%v` of a string slice: `[a b c]`.
fn names<const N: usize>(list: [&str; N]) -> String {
    format!("[{}]", list.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_policy_is_trimmed_and_case_sensitive() {
        let cases: &[(&str, Option<PrefillPolicy>)] = &[
            ("prefix_cache", Some(PrefillPolicy::PrefixCache)),
            (" least_request ", Some(PrefillPolicy::LeastRequest)),
            ("conductor", Some(PrefillPolicy::Conductor)),
            ("token_load", Some(PrefillPolicy::TokenLoad)),
            (
                "\thybrid_cache_load\n",
                Some(PrefillPolicy::HybridCacheLoad),
            ),
            ("Token_Load", None),
            ("PREFIX_CACHE", None),
            ("", None),
            ("random", None),
        ];
        for (raw, want) in cases {
            assert_eq!(PrefillPolicy::parse(raw), *want, "{raw:?}");
        }
        for p in PrefillPolicy::ALL {
            assert_eq!(PrefillPolicy::parse(p.name()), Some(p));
        }
    }

    #[test]
    fn prefill_env_default_falls_back_with_a_warning() {
        assert_eq!(
            PrefillPolicy::from_env(None),
            (PrefillPolicy::PrefixCache, None)
        );
        assert_eq!(
            PrefillPolicy::from_env(Some("  ")),
            (PrefillPolicy::PrefixCache, None)
        );
        assert_eq!(
            PrefillPolicy::from_env(Some("token_load")),
            (PrefillPolicy::TokenLoad, None)
        );
        let (p, w) = PrefillPolicy::from_env(Some("Conductor"));
        assert_eq!(p, PrefillPolicy::PrefixCache);
        assert!(w.unwrap().contains("AIBRIX_PREFILL_SCORE_POLICY"));
    }

    #[test]
    fn decode_policy_is_lowercased_and_unknown_is_an_error() {
        let cases: &[(&str, DecodePolicy)] = &[
            ("load_balancing", DecodePolicy::LoadBalancing),
            (" Least_Request ", DecodePolicy::LeastRequest),
            ("CONDUCTOR", DecodePolicy::Conductor),
            ("token_load", DecodePolicy::TokenLoad),
        ];
        for (raw, want) in cases {
            assert_eq!(DecodePolicy::parse(raw), Ok(*want), "{raw:?}");
        }
        let err = DecodePolicy::parse(" not_a_real_policy ").unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown decodeScorePolicy \"not_a_real_policy\" in routingConfig \
             (valid: [load_balancing least_request conductor token_load])"
        );
        assert_eq!(DecodePolicy::parse_override(None), Ok(None));
        assert_eq!(DecodePolicy::parse_override(Some(" ")), Ok(None));
        assert_eq!(
            DecodePolicy::parse_override(Some("Conductor")),
            Ok(Some(DecodePolicy::Conductor))
        );
        assert!(DecodePolicy::parse_override(Some("fastest")).is_err());
    }

    #[test]
    fn decode_env_default_never_fails() {
        assert_eq!(
            DecodePolicy::from_env(None),
            (DecodePolicy::LoadBalancing, None)
        );
        assert_eq!(
            DecodePolicy::from_env(Some(" TOKEN_LOAD ")),
            (DecodePolicy::TokenLoad, None)
        );
        let (p, w) = DecodePolicy::from_env(Some("bogus"));
        assert_eq!(p, DecodePolicy::LoadBalancing);
        assert!(w.unwrap().contains("AIBRIX_DECODE_SCORE_POLICY"));
    }

    #[test]
    fn policy_capabilities() {
        let ledger: Vec<_> = PrefillPolicy::ALL
            .into_iter()
            .filter(|p| p.uses_token_ledger())
            .collect();
        assert_eq!(
            ledger,
            [PrefillPolicy::TokenLoad, PrefillPolicy::HybridCacheLoad]
        );
        assert!(!PrefillPolicy::TokenLoad.uses_prefix_index());
        assert!(PrefillPolicy::HybridCacheLoad.uses_prefix_index());
        assert!(!PrefillPolicy::LeastRequest.uses_prefix_index());
        for p in DecodePolicy::ALL {
            let token_load = p == DecodePolicy::TokenLoad;
            assert_eq!(p.runs_fast_path(), !token_load);
            assert_eq!(p.uses_cold_start(), !token_load);
        }
    }
}
