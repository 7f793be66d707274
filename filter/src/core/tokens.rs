//! The token-load ledger math behind the `token_load` and `hybrid_cache_load` prefill policies
//! and the `token_load` decode policy, independent of where the ledger is stored.
//!
//! A prefill pod is charged `request_cost + new_tokens` on both its `active` and `kv`
//! counters when it is selected; `active` is released when the prefill call returns and `kv`
//! when the request completes. A decode pod is charged the whole prompt (its KV arrives in
//! full) plus one outstanding request whose output grows at the pod's generation rate. The
//! table of pods lives in Envoy shared data and is updated by compare-and-swap, hence the
//! fixed-row format of [`crate::core::ledger::Ledger`]; per-request [`Charge`]s live in the request context
//! and make every release idempotent.
//!
//! Where the seed (the product doc) and the reference spec differ, the seed wins: factor and
//! minimum match accept 0 (Go's loaders reject it), the minimum match also applies to
//! `prefix_cache`, idle pods are pruned after a fixed 60 s without writes, and the decode side
//! (which only the doc describes) follows the doc.

use hashbrown::HashMap;

use crate::core::score::effective_match_pct;

/// One token per four bytes of request body: the prompt estimate used for charges, the same
/// heuristic as the vLLM PD proxy examples. It needs no tokenizer on the hot path.
pub const BYTES_PER_TOKEN: usize = 4;
/// Session keys longer than this are ignored, the bound session-affinity routing uses.
pub const MAX_SESSION_KEY_BYTES: usize = 256;
/// A pod row at zero load and without writes for this long is dropped by the janitor.
pub const IDLE_PRUNE_MS: u64 = 60_000;
/// Float residue below this after a release is snapped to 0, so a pod whose charges were all
/// released reads exactly zero (and can be pruned) despite rounding in `a + b − b`.
const ZERO_EPSILON: f64 = 1e-6;

/// Token-load tunables (`AIBRIX_TOKEN_LOAD_*`, `AIBRIX_HYBRID_CACHE_LOAD_FACTOR`,
/// `AIBRIX_MIN_MATCH_PCT`, `AIBRIX_DECODE_TOKEN_LOAD_OUTPUT_GROWTH`).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLoadSettings {
    /// Weight of resident KV tokens in the prefill score; resident KV costs less than compute.
    pub kv_weight: f64,
    /// Fixed per-request prefill cost in tokens (scheduling and KV-transfer setup).
    pub request_cost: f64,
    /// Age after which an outstanding charge is force-released, seconds.
    pub ttl_s: u64,
    /// How long a session's last prompt size is remembered, seconds; 0 turns rule 1 off.
    pub session_ttl_s: u64,
    /// Most sessions remembered at once, so clients cannot grow the table without bound.
    pub max_sessions: usize,
    /// Discount a full prefix match applies to a pod's load in `hybrid_cache_load`, `0..=1`.
    pub hybrid_factor: f64,
    /// Matches below this percentage count as none, `0..=100`; 0 disables the threshold.
    pub min_match_pct: f64,
    /// Add the output generated so far to the decode `token_load` score.
    pub output_growth: bool,
    /// Share the decode ledger and running counts with the other gateway replicas through
    /// pd-control (`AIBRIX_TOKEN_LOAD_SHARED_LEDGER`).
    pub shared_ledger: bool,
}

impl Default for TokenLoadSettings {
    fn default() -> Self {
        TokenLoadSettings {
            kv_weight: 0.3,
            request_cost: 3500.0,
            ttl_s: 3600,
            session_ttl_s: 1800,
            max_sessions: 100_000,
            hybrid_factor: 0.5,
            min_match_pct: 0.0,
            output_growth: true,
            shared_ledger: true,
        }
    }
}

/// Reads one variable: unset or blank keeps the default silently; a value `parse` refuses
/// keeps it with a warning that names the variable, the value and the rule.
fn read<T: Copy + std::fmt::Display>(
    get: &dyn Fn(&str) -> Option<String>,
    warnings: &mut Vec<String>,
    name: &str,
    default: T,
    rule: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> T {
    let Some(raw) = get(name) else {
        return default;
    };
    let trimmed = raw.trim();
    if trimmed.is_empty() {
        return default;
    }
    parse(trimmed).unwrap_or_else(|| {
        warnings.push(format!("{name}={raw:?} is not {rule}; using {default}"));
        default
    })
}

fn float_in(lo: f64, hi: f64, lo_inclusive: bool) -> impl Fn(&str) -> Option<f64> {
    move |s| {
        s.parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v <= hi && (*v > lo || (lo_inclusive && *v == lo)))
    }
}

/// Go's `strconv.ParseBool` spellings, which AIBrix deployments already use.
fn parse_go_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

impl TokenLoadSettings {
    /// Reads the settings through `get` (the environment in production). Each bad value is
    /// reported by name and replaced by its default, so one typo never disables the policy.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> (TokenLoadSettings, Vec<String>) {
        let d = TokenLoadSettings::default();
        let mut w = Vec::new();
        let get: &dyn Fn(&str) -> Option<String> = &get;
        let positive_int = |s: &str| s.parse::<u64>().ok().filter(|v| *v > 0);
        let settings = TokenLoadSettings {
            kv_weight: read(
                get,
                &mut w,
                "AIBRIX_TOKEN_LOAD_KV_WEIGHT",
                d.kv_weight,
                "a positive number",
                float_in(0.0, f64::MAX, false),
            ),
            request_cost: read(
                get,
                &mut w,
                "AIBRIX_TOKEN_LOAD_REQUEST_COST",
                d.request_cost,
                "a positive number",
                float_in(0.0, f64::MAX, false),
            ),
            ttl_s: read(
                get,
                &mut w,
                "AIBRIX_TOKEN_LOAD_TTL_SECONDS",
                d.ttl_s,
                "a positive integer",
                positive_int,
            ),
            session_ttl_s: read(
                get,
                &mut w,
                "AIBRIX_TOKEN_LOAD_SESSION_TTL_SECONDS",
                d.session_ttl_s,
                "a non-negative integer",
                |s| s.parse::<u64>().ok(),
            ),
            max_sessions: read(
                get,
                &mut w,
                "AIBRIX_TOKEN_LOAD_MAX_SESSIONS",
                d.max_sessions,
                "a positive integer",
                |s| s.parse::<usize>().ok().filter(|v| *v > 0),
            ),
            // Seed wins over Go's loader: 0 is accepted and turns the discount off.
            hybrid_factor: read(
                get,
                &mut w,
                "AIBRIX_HYBRID_CACHE_LOAD_FACTOR",
                d.hybrid_factor,
                "a number in [0, 1]",
                float_in(0.0, 1.0, true),
            ),
            min_match_pct: read(
                get,
                &mut w,
                "AIBRIX_MIN_MATCH_PCT",
                d.min_match_pct,
                "a number in [0, 100]",
                float_in(0.0, 100.0, true),
            ),
            output_growth: read(
                get,
                &mut w,
                "AIBRIX_DECODE_TOKEN_LOAD_OUTPUT_GROWTH",
                d.output_growth,
                "a boolean",
                parse_go_bool,
            ),
            shared_ledger: read(
                get,
                &mut w,
                "AIBRIX_TOKEN_LOAD_SHARED_LEDGER",
                d.shared_ledger,
                "a boolean",
                parse_go_bool,
            ),
        };
        (settings, w)
    }

    /// The prefill charge: `request_cost + new_tokens`.
    pub fn prefill_cost(&self, new_tokens: u64) -> f64 {
        self.request_cost + new_tokens as f64
    }
}

/// `len(body) / 4`, integer division.
pub fn prompt_tokens_estimate(body_len: usize) -> u64 {
    (body_len / BYTES_PER_TOKEN) as u64
}

/// Which rule produced a `new_tokens` estimate, for logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NewTokensSource {
    SessionDelta,
    PrefixMatch,
    Prompt,
}

impl NewTokensSource {
    pub fn name(self) -> &'static str {
        match self {
            NewTokensSource::SessionDelta => "session_delta",
            NewTokensSource::PrefixMatch => "prefix_match",
            NewTokensSource::Prompt => "prompt",
        }
    }
}

/// The part of the prompt the selected prefill pod has to compute, by the first rule that
/// applies:
/// 1. `session_delta` (from [`SessionTable::new_tokens`]): the growth since the session's last
///    prompt, since the engine still holds the earlier turns;
/// 2. `match_pct` (only when the policy looked the prefix index up, i.e. hybrid): the
///    unmatched part, `prompt × (100 − pct) / 100` in integer arithmetic like AIBrix, with pct
///    clamped to `0..=100` and zeroed below `min_match_pct`;
/// 3. the whole prompt.
///
/// The result never exceeds `prompt_tokens`.
pub fn new_tokens(
    prompt_tokens: u64,
    session_delta: Option<u64>,
    match_pct: Option<f64>,
    min_match_pct: f64,
) -> (u64, NewTokensSource) {
    if let Some(delta) = session_delta {
        return (delta.min(prompt_tokens), NewTokensSource::SessionDelta);
    }
    if let Some(pct) = match_pct {
        let pct = effective_match_pct(pct, min_match_pct);
        // Exact for whole percents: prompt × (100 − pct) is an integer well below 2^53.
        let unmatched = (prompt_tokens as f64 * (100.0 - pct) / 100.0).floor();
        let unmatched = if unmatched.is_finite() && unmatched > 0.0 {
            (unmatched as u64).min(prompt_tokens)
        } else {
            0
        };
        return (unmatched, NewTokensSource::PrefixMatch);
    }
    (prompt_tokens, NewTokensSource::Prompt)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Session {
    prompt_tokens: u64,
    last_seen_ms: u64,
    /// The TTL of the profile that recorded it: the janitor keeps each entry as long as
    /// the request that wrote it was promised, whatever the other profiles' TTLs.
    ttl_ms: u64,
}

/// The last prompt size per `(model, x-aibrix-session-key)`, for rule 1 of [`new_tokens`].
/// One table serves every profile; each request brings its profile's TTL
/// (`tokenLoadSessionTTLSeconds`, else `AIBRIX_TOKEN_LOAD_SESSION_TTL_SECONDS`).
#[derive(Debug, Clone, PartialEq)]
pub struct SessionTable {
    capacity: usize,
    entries: HashMap<String, Session>,
}

impl SessionTable {
    pub fn new(capacity: usize) -> SessionTable {
        SessionTable {
            capacity,
            entries: HashMap::new(),
        }
    }

    pub fn from_settings(s: &TokenLoadSettings) -> SessionTable {
        SessionTable::new(s.max_sessions)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// New keys are refused once this holds; the host logs it once.
    pub fn is_full(&self) -> bool {
        self.entries.len() >= self.capacity
    }

    fn key(model: &str, session: &str) -> String {
        // The same session key may be reused against several models; deltas only make sense
        // within one, and NUL cannot appear in a header value.
        format!("{model}\0{session}")
    }

    fn is_expired(s: &Session, now_ms: u64, ttl_ms: u64) -> bool {
        now_ms.saturating_sub(s.last_seen_ms) > ttl_ms
    }

    /// Rule 1: records `prompt_tokens` as the session's current size and returns the growth
    /// since the previous size, if it grew and is younger than `ttl_s` (the request's
    /// profile's session TTL). `None` (fall through to rules 2/3) when the rule is off for
    /// the profile (`ttl_s` 0: nothing is recorded either, as prefill pods that cannot reach
    /// a conversation's earlier KV must be charged the whole prompt), the key is empty or
    /// longer than 256 bytes, the session is new or expired, the prompt did not grow, or the
    /// table is full (a new key is then not recorded).
    pub fn new_tokens(
        &mut self,
        model: &str,
        session_key: &str,
        prompt_tokens: u64,
        now_ms: u64,
        ttl_s: u64,
    ) -> Option<u64> {
        let ttl_ms = ttl_s.saturating_mul(1000);
        if ttl_ms == 0 || session_key.is_empty() || session_key.len() > MAX_SESSION_KEY_BYTES {
            return None;
        }
        let key = SessionTable::key(model, session_key);
        let current = Session {
            prompt_tokens,
            last_seen_ms: now_ms,
            ttl_ms,
        };
        let previous = match self.entries.get(&key).copied() {
            Some(prev) => {
                self.entries.insert(key, current);
                (!SessionTable::is_expired(&prev, now_ms, ttl_ms)).then_some(prev.prompt_tokens)
            }
            None if self.is_full() => return None,
            None => {
                self.entries.insert(key, current);
                None
            }
        };
        previous
            .filter(|&last| prompt_tokens > last)
            .map(|last| prompt_tokens - last)
    }

    /// Janitor: forgets sessions idle longer than the TTL they were recorded with, returning
    /// how many.
    pub fn prune(&mut self, now_ms: u64) -> usize {
        let before = self.entries.len();
        self.entries
            .retain(|_, s| !SessionTable::is_expired(s, now_ms, s.ttl_ms));
        before - self.entries.len()
    }
}

/// `v − x`, clamped at 0 with float residue snapped to 0.
fn sub_clamped(v: f64, x: f64) -> f64 {
    let r = v - x;
    if r.is_finite() && r > ZERO_EPSILON {
        r
    } else {
        0.0
    }
}

/// Amounts from callers are costs and token counts: anything else must not corrupt the row.
pub(crate) fn amount(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 {
        x
    } else {
        0.0
    }
}

/// The ledger row of one pod (prefill and decode counters; a pod normally uses one side).
///
/// Decode output growth is kept as `decode_requests` and the sum of their routing times, so
/// `Σ (now − routed_at) = n × now − Σ routed_at` needs no per-request list in shared data. The
/// sum is exact while it stays below 2^53 ms (about 5000 outstanding requests at today's epoch
/// milliseconds; beyond that the error stays in the milliseconds), and resets to 0 whenever
/// the pod's last decode request is released, so rounding never outlives the requests.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PodTokens {
    /// Prompt tokens the pod is prefilling right now.
    pub active: f64,
    /// Prompt tokens whose KV is still resident on the prefill pod.
    pub kv: f64,
    /// Prompt tokens charged to the pod as a decode pod.
    pub decode: f64,
    /// Outstanding decode requests.
    pub decode_requests: u32,
    /// Sum of their routing times, ms.
    pub decode_routed_at_sum_ms: f64,
    /// Last write, ms; the janitor prunes zero rows untouched for a minute.
    pub touched_ms: u64,
}

impl PodTokens {
    /// A prefill selection adds its cost to both counters.
    pub fn charge_prefill(&mut self, cost: f64, now_ms: u64) {
        let cost = amount(cost);
        self.active += cost;
        self.kv += cost;
        self.touched_ms = now_ms;
    }

    /// The prefill call returned: its compute is done, its KV stays.
    pub fn release_tokens(&mut self, cost: f64, now_ms: u64) {
        self.active = sub_clamped(self.active, amount(cost));
        self.touched_ms = now_ms;
    }

    /// The request completed: the decode pod no longer needs the prefill pod's KV.
    pub fn release_kv(&mut self, cost: f64, now_ms: u64) {
        self.kv = sub_clamped(self.kv, amount(cost));
        self.touched_ms = now_ms;
    }

    /// A failed prefill: nothing of the request remains on the pod.
    pub fn release_all(&mut self, cost: f64, now_ms: u64) {
        self.release_tokens(cost, now_ms);
        self.release_kv(cost, now_ms);
    }

    /// A decode selection: the whole prompt's KV and one request growing from `routed_at_ms`.
    pub fn charge_decode(&mut self, prompt_tokens: f64, routed_at_ms: u64, now_ms: u64) {
        self.decode += amount(prompt_tokens);
        self.decode_requests = self.decode_requests.saturating_add(1);
        self.decode_routed_at_sum_ms += routed_at_ms as f64;
        self.touched_ms = now_ms;
    }

    /// Reverses [`PodTokens::charge_decode`] with the same arguments.
    pub fn release_decode(&mut self, prompt_tokens: f64, routed_at_ms: u64, now_ms: u64) {
        self.decode = sub_clamped(self.decode, amount(prompt_tokens));
        self.decode_requests = self.decode_requests.saturating_sub(1);
        self.decode_routed_at_sum_ms = if self.decode_requests == 0 {
            0.0
        } else {
            (self.decode_routed_at_sum_ms - routed_at_ms as f64).max(0.0)
        };
        self.touched_ms = now_ms;
    }

    /// The prefill score of `token_load`: `active + kv_weight × kv`.
    pub fn prefill_load(&self, kv_weight: f64) -> f64 {
        crate::core::score::prefill::token_load(self.active, self.kv, kv_weight)
    }

    /// Output the outstanding decode requests have produced so far:
    /// `rate × (n × now − Σ routed_at) / 1000`, with `rate` in tokens/s per request.
    pub fn generated_tokens(&self, rate: f64, now_ms: u64) -> f64 {
        if self.decode_requests == 0 || !rate.is_finite() || rate <= 0.0 {
            return 0.0;
        }
        let elapsed_ms =
            f64::from(self.decode_requests) * now_ms as f64 - self.decode_routed_at_sum_ms;
        rate * elapsed_ms.max(0.0) / 1000.0
    }

    /// The decode score of `token_load`: `decode + generated` (growth off → prompts only).
    pub fn decode_load(&self, rate: f64, now_ms: u64, output_growth: bool) -> f64 {
        let generated = if output_growth {
            self.generated_tokens(rate, now_ms)
        } else {
            0.0
        };
        crate::core::score::decode::token_load(self.decode, generated)
    }

    pub fn is_zero(&self) -> bool {
        self.active == 0.0 && self.kv == 0.0 && self.decode == 0.0 && self.decode_requests == 0
    }
}

/// Per-request generation rate of a decode pod: its scraped throughput over its running
/// requests, or, when it has none yet (no throughput metric or nothing running), the mean of
/// the other decode pods' rates (0 without any).
pub fn decode_rate(pod_throughput: Option<f64>, pod_running: f64, others_mean: Option<f64>) -> f64 {
    own_rate(pod_throughput, pod_running)
        .or(others_mean.filter(|m| m.is_finite() && *m >= 0.0))
        .unwrap_or(0.0)
}

/// A pod's own per-request generation rate, when it reports throughput and runs requests.
pub fn own_rate(throughput: Option<f64>, running: f64) -> Option<f64> {
    let t = throughput.filter(|t| t.is_finite() && *t >= 0.0)?;
    (running.is_finite() && running > 0.0).then(|| t / running)
}

/// [`decode_rate`] for a whole batch of `(throughput, running)` pairs: pods without their own
/// rate get the mean of the pods that have one.
pub fn decode_rates(pods: &[(Option<f64>, f64)]) -> Vec<f64> {
    let own: Vec<Option<f64>> = pods.iter().map(|&(t, r)| own_rate(t, r)).collect();
    let known: Vec<f64> = own.iter().flatten().copied().collect();
    let mean = (!known.is_empty()).then(|| known.iter().sum::<f64>() / known.len() as f64);
    own.iter().map(|r| r.or(mean).unwrap_or(0.0)).collect()
}

/// Janitor: a charge made at `charged_at_ms` has outlived `ttl_s` (strict >). A TTL of 0
/// disables force-release.
pub fn expired(charged_at_ms: u64, now_ms: u64, ttl_s: u64) -> bool {
    ttl_s > 0 && now_ms.saturating_sub(charged_at_ms) > ttl_s.saturating_mul(1000)
}

/// One prefill charge held by a request. The flags make each release happen once whatever
/// order (or how often) the completion paths call them; the janitor uses the same flags.
///
/// Inside a CAS retry loop, release on a clone of the charge and keep the clone only once the
/// write has landed, so a lost race does not leave a flag set without its subtraction.
#[derive(Debug, Clone, PartialEq)]
pub struct Charge {
    pub pod: String,
    pub cost: f64,
    pub charged_at_ms: u64,
    pub tokens_released: bool,
    pub kv_released: bool,
}

impl Charge {
    /// Both parts released: the request holds nothing on the pod any more.
    pub fn is_settled(&self) -> bool {
        self.tokens_released && self.kv_released
    }

    pub fn expired(&self, now_ms: u64, ttl_s: u64) -> bool {
        !self.is_settled() && expired(self.charged_at_ms, now_ms, ttl_s)
    }
}

/// One decode charge held by a request.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeCharge {
    pub pod: String,
    pub prompt_tokens: f64,
    pub routed_at_ms: u64,
    pub released: bool,
}

impl DecodeCharge {
    pub fn expired(&self, now_ms: u64, ttl_s: u64) -> bool {
        !self.released && expired(self.routed_at_ms, now_ms, ttl_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn settings_defaults() {
        let (s, w) = TokenLoadSettings::from_lookup(|_| None);
        assert!(w.is_empty());
        assert_eq!(s, TokenLoadSettings::default());
        assert_eq!(
            (s.kv_weight, s.request_cost, s.ttl_s, s.session_ttl_s),
            (0.3, 3500.0, 3600, 1800)
        );
        assert_eq!(
            (s.max_sessions, s.hybrid_factor, s.min_match_pct),
            (100_000, 0.5, 0.0)
        );
        assert!(s.output_growth);
        assert!(s.shared_ledger);
    }

    #[test]
    fn settings_valid_values() {
        let (s, w) = TokenLoadSettings::from_lookup(env(&[
            ("AIBRIX_TOKEN_LOAD_KV_WEIGHT", "0.5"),
            ("AIBRIX_TOKEN_LOAD_REQUEST_COST", " 1000 "),
            ("AIBRIX_TOKEN_LOAD_TTL_SECONDS", "60"),
            ("AIBRIX_TOKEN_LOAD_SESSION_TTL_SECONDS", "0"),
            ("AIBRIX_TOKEN_LOAD_MAX_SESSIONS", "10"),
            ("AIBRIX_HYBRID_CACHE_LOAD_FACTOR", "0"),
            ("AIBRIX_MIN_MATCH_PCT", "40"),
            ("AIBRIX_DECODE_TOKEN_LOAD_OUTPUT_GROWTH", "False"),
            ("AIBRIX_TOKEN_LOAD_SHARED_LEDGER", "0"),
        ]));
        assert!(w.is_empty(), "{w:?}");
        assert_eq!(
            s,
            TokenLoadSettings {
                kv_weight: 0.5,
                request_cost: 1000.0,
                ttl_s: 60,
                session_ttl_s: 0,
                max_sessions: 10,
                hybrid_factor: 0.0,
                min_match_pct: 40.0,
                output_growth: false,
                shared_ledger: false,
            }
        );
        let (s, _) = TokenLoadSettings::from_lookup(env(&[
            ("AIBRIX_HYBRID_CACHE_LOAD_FACTOR", "1"),
            ("AIBRIX_MIN_MATCH_PCT", "100"),
            ("AIBRIX_DECODE_TOKEN_LOAD_OUTPUT_GROWTH", "t"),
        ]));
        assert_eq!(
            (s.hybrid_factor, s.min_match_pct, s.output_growth),
            (1.0, 100.0, true)
        );
    }

    #[test]
    fn settings_bad_values_warn_by_name_and_keep_defaults() {
        let cases = [
            ("AIBRIX_TOKEN_LOAD_KV_WEIGHT", "0"),
            ("AIBRIX_TOKEN_LOAD_KV_WEIGHT", "-1"),
            ("AIBRIX_TOKEN_LOAD_KV_WEIGHT", "NaN"),
            ("AIBRIX_TOKEN_LOAD_REQUEST_COST", "cheap"),
            ("AIBRIX_TOKEN_LOAD_REQUEST_COST", "inf"),
            ("AIBRIX_TOKEN_LOAD_TTL_SECONDS", "0"),
            ("AIBRIX_TOKEN_LOAD_TTL_SECONDS", "1.5"),
            ("AIBRIX_TOKEN_LOAD_SESSION_TTL_SECONDS", "-1"),
            ("AIBRIX_TOKEN_LOAD_MAX_SESSIONS", "0"),
            ("AIBRIX_HYBRID_CACHE_LOAD_FACTOR", "1.5"),
            ("AIBRIX_HYBRID_CACHE_LOAD_FACTOR", "-0.1"),
            ("AIBRIX_MIN_MATCH_PCT", "101"),
            ("AIBRIX_DECODE_TOKEN_LOAD_OUTPUT_GROWTH", "yes"),
        ];
        for (name, value) in cases {
            let (s, w) = TokenLoadSettings::from_lookup(env(&[(name, value)]));
            assert_eq!(s, TokenLoadSettings::default(), "{name}={value}");
            assert_eq!(w.len(), 1, "{name}={value}");
            assert!(w[0].starts_with(name) && w[0].contains(value), "{}", w[0]);
        }
        // Blank counts as unset.
        let (_, w) = TokenLoadSettings::from_lookup(env(&[("AIBRIX_MIN_MATCH_PCT", " ")]));
        assert!(w.is_empty());
    }

    #[test]
    fn cost_and_estimate() {
        let s = TokenLoadSettings::default();
        let cases = [
            (0, 0, 3500.0),
            (3, 0, 3500.0),
            (4, 1, 3501.0),
            (4003, 1000, 4500.0),
        ];
        for (len, tokens, cost) in cases {
            assert_eq!(prompt_tokens_estimate(len), tokens);
            assert_eq!(s.prefill_cost(prompt_tokens_estimate(len)), cost);
        }
    }

    #[test]
    fn new_tokens_rules() {
        use NewTokensSource::*;
        // (prompt, session delta, match pct, min match, want)
        type Case = (u64, Option<u64>, Option<f64>, f64, (u64, NewTokensSource));
        let cases: &[Case] = &[
            (1000, Some(200), Some(90.0), 0.0, (200, SessionDelta)),
            (1000, Some(5000), None, 0.0, (1000, SessionDelta)),
            (1000, None, Some(70.0), 0.0, (300, PrefixMatch)),
            (1000, None, Some(0.0), 0.0, (1000, PrefixMatch)),
            (1000, None, Some(100.0), 0.0, (0, PrefixMatch)),
            (1000, None, Some(150.0), 0.0, (0, PrefixMatch)), // clamped to 100
            (1000, None, Some(-20.0), 0.0, (1000, PrefixMatch)), // clamped to 0
            (1000, None, Some(30.0), 40.0, (1000, PrefixMatch)), // below the minimum
            (1000, None, Some(50.0), 40.0, (500, PrefixMatch)),
            (999, None, Some(33.0), 0.0, (669, PrefixMatch)), // 999 × 67 / 100 = 669.33
            (1000, None, None, 0.0, (1000, Prompt)),
        ];
        for (prompt, delta, pct, min, want) in cases {
            assert_eq!(
                new_tokens(*prompt, *delta, *pct, *min),
                *want,
                "({prompt}, {delta:?}, {pct:?}, {min})"
            );
        }
        assert_eq!(SessionDelta.name(), "session_delta");
    }

    #[test]
    fn session_growth_and_no_growth() {
        let mut t = SessionTable::new(100);
        // First turn: nothing known, recorded.
        assert_eq!(t.new_tokens("m", "s1", 1000, 0, 1800), None);
        // The conversation grew: charge the growth.
        assert_eq!(t.new_tokens("m", "s1", 1500, 1000, 1800), Some(500));
        // A shorter prompt (new conversation under the same key): whole prompt, re-based.
        assert_eq!(t.new_tokens("m", "s1", 400, 2000, 1800), None);
        assert_eq!(t.new_tokens("m", "s1", 450, 3000, 1800), Some(50));
        // Same size: no growth.
        assert_eq!(t.new_tokens("m", "s1", 450, 4000, 1800), None);
        // Keys are per model.
        assert_eq!(t.new_tokens("other", "s1", 5000, 5000, 1800), None);
        assert_eq!(t.len(), 2);
        // Empty keys are ignored.
        assert_eq!(t.new_tokens("m", "", 10, 0, 1800), None);
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn session_ttl_expiry_and_prune() {
        let mut t = SessionTable::new(100);
        assert_eq!(t.new_tokens("m", "s", 100, 0, 10), None);
        // Exactly at the TTL the size is still remembered.
        assert_eq!(t.new_tokens("m", "s", 200, 10_000, 10), Some(100));
        // Past the TTL it is not, but the new size is recorded.
        assert_eq!(t.new_tokens("m", "s", 300, 20_001, 10), None);
        assert_eq!(t.new_tokens("m", "s", 350, 20_002, 10), Some(50));
        assert_eq!(t.new_tokens("m", "t", 1, 25_000, 10), None);
        assert_eq!(t.prune(30_002), 0);
        assert_eq!(t.prune(30_003), 1);
        assert_eq!(t.len(), 1);
        assert_eq!(t.prune(35_000), 0);
        assert_eq!(t.prune(35_001), 1);
        assert!(t.is_empty());
    }

    #[test]
    fn session_ttl_zero_turns_the_rule_off() {
        let (s, _) =
            TokenLoadSettings::from_lookup(env(&[("AIBRIX_TOKEN_LOAD_SESSION_TTL_SECONDS", "0")]));
        let mut t = SessionTable::from_settings(&s);
        assert_eq!(t.new_tokens("m", "s", 100, 0, s.session_ttl_s), None);
        assert_eq!(t.new_tokens("m", "s", 200, 1, s.session_ttl_s), None);
        assert!(t.is_empty(), "nothing is recorded");
    }

    #[test]
    fn each_profile_brings_its_own_session_ttl() {
        let mut t = SessionTable::new(100);
        // A profile with the rule off records nothing and charges no delta...
        assert_eq!(t.new_tokens("m", "s", 100, 0, 0), None);
        assert_eq!(t.new_tokens("m", "s", 200, 1, 0), None);
        assert!(t.is_empty());
        // ...while another profile's requests on the same table keep the rule.
        assert_eq!(t.new_tokens("m", "s", 100, 2, 1800), None);
        assert_eq!(t.new_tokens("m", "s", 300, 3, 1800), Some(200));
        // A short TTL and a long one: the janitor keeps each entry for its own.
        assert_eq!(t.new_tokens("m", "short", 10, 0, 5), None);
        assert_eq!(t.prune(5_001), 1, "short is gone, s is kept");
        assert_eq!(t.new_tokens("m", "s", 400, 1_800_003, 1800), Some(100));
        // The size a request compares against expires on that request's own TTL.
        assert_eq!(t.new_tokens("m", "s", 500, 1_810_004, 10), None);
    }

    #[test]
    fn session_table_full_refuses_new_keys_only() {
        let mut t = SessionTable::new(2);
        assert_eq!(t.new_tokens("m", "a", 100, 0, 1800), None);
        assert_eq!(t.new_tokens("m", "b", 100, 0, 1800), None);
        assert!(t.is_full());
        // A new key is not recorded, so its next turn gets no delta either.
        assert_eq!(t.new_tokens("m", "c", 100, 0, 1800), None);
        assert_eq!(t.new_tokens("m", "c", 300, 1, 1800), None);
        assert_eq!(t.len(), 2);
        // Known keys keep working.
        assert_eq!(t.new_tokens("m", "a", 250, 2, 1800), Some(150));
        // Once the janitor forgets idle ones, new keys are admitted again.
        assert_eq!(
            t.prune(1_800_002),
            1,
            "b idle past the TTL, a refreshed at 2"
        );
        assert_eq!(t.new_tokens("m", "c", 300, 1_800_003, 1800), None);
        assert_eq!(t.new_tokens("m", "c", 400, 1_800_004, 1800), Some(100));
    }

    #[test]
    fn session_keys_over_256_bytes_are_ignored() {
        let mut t = SessionTable::new(100);
        let at_limit = "k".repeat(MAX_SESSION_KEY_BYTES);
        let over = "k".repeat(MAX_SESSION_KEY_BYTES + 1);
        assert_eq!(t.new_tokens("m", &at_limit, 100, 0, 1800), None);
        assert_eq!(t.new_tokens("m", &at_limit, 150, 1, 1800), Some(50));
        assert_eq!(t.new_tokens("m", &over, 100, 0, 1800), None);
        assert_eq!(t.new_tokens("m", &over, 150, 1, 1800), None);
        assert_eq!(t.len(), 1);
        // Length is in bytes: 104 characters, 260 bytes.
        let wide = "é€".repeat(52);
        assert!(wide.len() > MAX_SESSION_KEY_BYTES);
        assert_eq!(t.new_tokens("m", &wide, 100, 0, 1800), None);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn generated_tokens_stays_accurate_at_epoch_milliseconds() {
        let now = 1_790_000_000_000u64;
        let mut row = PodTokens::default();
        for i in 0..1000u64 {
            row.charge_decode(100.0, now - i * 10, now);
        }
        // Σ (now − routed_at) = 10 × Σ i = 10 × 499500 ms; at 1 tok/s → 4995 tokens.
        assert!((row.generated_tokens(1.0, now) - 4995.0).abs() < 1e-3);
        for i in 0..1000u64 {
            row.release_decode(100.0, now - i * 10, now);
        }
        assert!(row.is_zero() && row.decode_routed_at_sum_ms == 0.0);
    }

    #[test]
    fn decode_rate_rules() {
        // (throughput, running, others_mean, rate)
        let cases = [
            (Some(300.0), 3.0, Some(7.0), 100.0),
            (Some(300.0), 0.0, Some(7.0), 7.0), // nothing running: borrow the others' mean
            (None, 3.0, Some(7.0), 7.0),
            (None, 3.0, None, 0.0),
            (Some(f64::NAN), 3.0, Some(7.0), 7.0),
            (Some(0.0), 2.0, Some(7.0), 0.0),
        ];
        for (thr, running, mean, want) in cases {
            assert_eq!(
                decode_rate(thr, running, mean),
                want,
                "({thr:?}, {running}, {mean:?})"
            );
        }
        let rates = decode_rates(&[
            (Some(300.0), 3.0),
            (None, 0.0),
            (Some(100.0), 2.0),
            (Some(5.0), 0.0),
        ]);
        assert_eq!(rates, [100.0, 75.0, 50.0, 75.0]);
        assert_eq!(decode_rates(&[(None, 1.0), (None, 0.0)]), [0.0, 0.0]);
        assert!(decode_rates(&[]).is_empty());
    }
}
