//! Adaptive bucket serving (spec §7): a per-model picture of the prompt lengths routed, and a
//! plan that splits the prompt-length ranges several rolesets share into one band per roleset.
//!
//! Plain bucketing keeps every roleset whose declared range covers a request as a candidate.
//! The plan narrows that to one roleset per band so each roleset sees a length-homogeneous
//! slice of the load, in proportion to its replicas. It is advisory: the router applies it only
//! when the banded roleset still has both a prefill and a decode candidate (Step 2b), so a stale
//! plan costs balance, never correctness.
//!
//! Everything here is pure: time comes in as `now_ms`, and decay is applied lazily when a
//! picture is written or read, so idle models cost nothing. With the feature off the caller
//! never calls in, and nothing is recorded.

use crate::core::env::parse_go_bool;
use std::collections::BTreeSet;
use std::str::FromStr;

use hashbrown::HashMap;

/// Histogram resolution: 8 bins per power of two (about 9% per bin). Cuts land on bin centres,
/// so this is also the resolution of the plan.
const BINS_PER_OCTAVE: usize = 8;
/// 21 octaves: prompts up to 2^21 tokens, far beyond any context window; longer ones share
/// the last bin.
const BINS: usize = 21 * BINS_PER_OCTAVE;
/// Half-life of the traffic picture: long enough to span bursts, short enough that a shift in
/// the traffic moves the cuts within a minute.
const HALF_LIFE_MS: u64 = 30_000;
/// A cached plan is reused for this long; planning runs at most once per interval per key.
const REFRESH_MS: u64 = 5_000;
/// A shared segment thinner than this share of the traffic keeps every covering roleset:
/// splitting it would fragment the load for no homogeneity gain.
const MIN_SPLIT_SHARE: f64 = 0.05;
/// At most this many bands per plan, which bounds both gauge label space and fragmentation.
const MAX_BANDS: usize = 16;
/// Cached plans per model: modes times the roleset sets (fleet shapes, profiles) in use, so two
/// profiles asking for different plans do not evict each other.
const PLAN_CACHE_SIZE: usize = 8;

/// The unit the plan balances.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum BucketServeMode {
    /// Prompt-token mass: padding and GPU time track tokens, not requests. The default.
    #[default]
    Throughput,
    /// Request counts, for request-bound, latency-sensitive deployments.
    Rps,
}

/// A mode name that is neither `throughput` nor `rps`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown bucket-serve mode {0:?} (valid: throughput, rps)")]
pub struct UnknownMode(pub String);

impl FromStr for BucketServeMode {
    type Err = UnknownMode;

    /// Case-insensitive, surrounding whitespace ignored.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name.trim().to_ascii_lowercase().as_str() {
            "throughput" => Ok(BucketServeMode::Throughput),
            "rps" => Ok(BucketServeMode::Rps),
            _ => Err(UnknownMode(name.to_string())),
        }
    }
}

impl BucketServeMode {
    /// Parses a name, keeping the default (`Throughput`) for one it does not know: the
    /// planner's own reading of a mode name. A profile's unknown `bucketServeMode` is dropped
    /// instead, so the env mode applies (`PdSettings::resolve`).
    pub fn normalize(name: &str) -> BucketServeMode {
        name.parse().unwrap_or_default()
    }

    /// The canonical name; it keys the plan cache so two spellings share one plan.
    pub fn as_str(self) -> &'static str {
        match self {
            BucketServeMode::Throughput => "throughput",
            BucketServeMode::Rps => "rps",
        }
    }
}

/// `AIBRIX_BUCKET_SERVE` and `AIBRIX_BUCKET_SERVE_MODE`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BucketServeSettings {
    /// The plan is used only when this is on and prompt-length bucketing is on too.
    pub enabled: bool,
    pub mode: BucketServeMode,
}

impl BucketServeSettings {
    /// Reads the two variables through `get`. An empty value counts as unset; a bad value
    /// keeps the default and yields a warning naming it, for the host to log.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> (BucketServeSettings, Vec<String>) {
        let mut settings = BucketServeSettings::default();
        let mut warnings = Vec::new();
        let set = |key: &str| get(key).filter(|v| !v.trim().is_empty());
        if let Some(raw) = set("AIBRIX_BUCKET_SERVE") {
            match parse_go_bool(raw.trim()) {
                Some(on) => settings.enabled = on,
                None => warnings.push(format!(
                    "AIBRIX_BUCKET_SERVE={raw:?} is not a boolean; bucket serving stays off"
                )),
            }
        }
        if let Some(raw) = set("AIBRIX_BUCKET_SERVE_MODE") {
            match raw.parse() {
                Ok(mode) => settings.mode = mode,
                Err(e) => warnings.push(format!(
                    "AIBRIX_BUCKET_SERVE_MODE: {e}; using {}",
                    settings.mode.as_str()
                )),
            }
        }
        (settings, warnings)
    }
}

/// The histogram bin of a prompt length: `floor(log2(len) × 8)`, clamped.
fn bin_of(len: i64) -> usize {
    if len <= 1 {
        return 0;
    }
    // `as usize` saturates, and log2 of a length ≥ 2 is positive, so only the top needs a clamp.
    let bin = ((len as f64).log2() * BINS_PER_OCTAVE as f64).floor() as usize;
    bin.min(BINS - 1)
}

/// The length each bin stands for, `round(2^((bin + 0.5)/8))`. Ranges are summed and cuts
/// placed by these centres, so a recorded length counts wherever its bin centre falls.
fn bin_centres() -> [i64; BINS] {
    let mut centres = [0i64; BINS];
    for (bin, centre) in centres.iter_mut().enumerate() {
        *centre = 2f64
            .powf((bin as f64 + 0.5) / BINS_PER_OCTAVE as f64)
            .round() as i64;
    }
    centres
}

/// One model's decayed traffic picture: request counts and prompt tokens per length bin.
#[derive(Debug, Clone, PartialEq)]
pub struct TrafficPicture {
    weights: Vec<f64>,
    masses: Vec<f64>,
    /// The time the series were last decayed to; `None` until the first write.
    last_ms: Option<u64>,
}

impl Default for TrafficPicture {
    fn default() -> Self {
        TrafficPicture {
            weights: vec![0.0; BINS],
            masses: vec![0.0; BINS],
            last_ms: None,
        }
    }
}

impl TrafficPicture {
    /// Records one routed request. Lengths ≤ 0 (no prompt-length estimate) are ignored.
    pub fn record(&mut self, len: i64, now_ms: u64) {
        if len <= 0 {
            return;
        }
        self.decay_to(now_ms);
        let bin = bin_of(len);
        self.weights[bin] += 1.0;
        self.masses[bin] += len as f64;
    }

    /// Brings both series to `now_ms` (half-life 30 s). A clock that goes backwards (workers
    /// disagree by a few ms) keeps the newer state instead of inflating the weights.
    pub fn decay_to(&mut self, now_ms: u64) {
        match self.last_ms {
            Some(last) if now_ms > last => {
                let factor = 0.5f64.powf((now_ms - last) as f64 / HALF_LIFE_MS as f64);
                for w in self.weights.iter_mut().chain(self.masses.iter_mut()) {
                    *w *= factor;
                }
                self.last_ms = Some(now_ms);
            }
            Some(_) => {}
            None => self.last_ms = Some(now_ms),
        }
    }

    /// Decayed request counts per bin, as of the last decay.
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// Decayed prompt tokens per bin, as of the last decay.
    pub fn masses(&self) -> &[f64] {
        &self.masses
    }

    /// The series the mode balances.
    pub fn series(&self, mode: BucketServeMode) -> &[f64] {
        match mode {
            BucketServeMode::Rps => &self.weights,
            BucketServeMode::Throughput => &self.masses,
        }
    }
}

/// One roleset as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub name: String,
    /// Inclusive prompt-length bounds.
    pub min: i64,
    pub max: i64,
    /// Prefill replicas: the share of the model's traffic the roleset should carry. 0 counts
    /// as 1, so a roleset without a count still takes part.
    pub replicas: u32,
}

impl Group {
    /// A group from a roleset's declared `promptLenBucketMin/MaxLength`, normalised as the
    /// suitability check does (§3.0): min < 0 → 0, max == 0 → unlimited (`i32::MAX`).
    /// `None` when min > max: such a roleset suits no length, so it cannot take a band.
    pub fn from_declared(name: &str, min: i64, max: i64, replicas: u32) -> Option<Group> {
        let min = min.max(0);
        let max = if max == 0 { i64::from(i32::MAX) } else { max };
        (min <= max).then(|| Group {
            name: name.to_string(),
            min,
            max,
            replicas,
        })
    }

    fn weight(&self) -> u32 {
        self.replicas.max(1)
    }
}

/// Prompts of length `lo..=hi` prefer `roleset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Band {
    pub lo: i64,
    pub hi: i64,
    pub roleset: String,
}

/// A plan: sorted, non-overlapping bands. Lengths outside every band have no preference, and
/// there every covering roleset stays a candidate, as without the plan.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub bands: Vec<Band>,
    /// Rolesets that held a band in some live plan of the model before this refresh and hold
    /// none now, in name order, so the caller can delete their gauge series. Filled only by
    /// [`Planner::plan_for`] on the call that refreshed the plan; empty otherwise.
    pub dropped: Vec<String>,
    /// True when the call that returned the plan computed it (always for [`build_plan`]);
    /// false when [`Planner::plan_for`] served it from its cache.
    pub refreshed: bool,
    /// When the plan was computed.
    pub computed_at_ms: u64,
}

impl Plan {
    /// The roleset the plan prefers for a prompt length, if a band covers it.
    pub fn lookup(&self, len: i64) -> Option<&str> {
        let i = self.bands.partition_point(|b| b.lo <= len).checked_sub(1)?;
        let band = &self.bands[i];
        (len <= band.hi).then_some(band.roleset.as_str())
    }
}

/// A maximal length interval over which the set of covering groups is constant.
#[derive(Debug, Clone)]
struct Segment<'g> {
    lo: i64,
    hi: i64,
    covering: Vec<&'g Group>,
    weight: f64,
}

/// Cuts the declared ranges into segments. Groups that cannot take a band (no name, negative
/// or empty range) are left out.
fn segments(groups: &[Group]) -> Vec<Segment<'_>> {
    let valid: Vec<&Group> = groups
        .iter()
        .filter(|g| !g.name.is_empty() && g.min >= 0 && g.min <= g.max)
        .collect();
    // Segment bounds are held as `max + 1`, so a top at the end of the integer range moves down
    // one rather than wrap; one token off an open range is not observable.
    let top = |g: &Group| g.max.min(i64::MAX - 1);
    let mut bounds: Vec<i64> = valid.iter().flat_map(|g| [g.min, top(g) + 1]).collect();
    bounds.sort_unstable();
    bounds.dedup();
    bounds
        .windows(2)
        .filter_map(|w| {
            let (lo, end) = (w[0], w[1]);
            let covering: Vec<&Group> = valid
                .iter()
                .copied()
                .filter(|g| g.min <= lo && end <= top(g) + 1)
                .collect();
            (!covering.is_empty()).then_some(Segment {
                lo,
                hi: end - 1,
                covering,
                weight: 0.0,
            })
        })
        .collect()
}

/// One series of the picture, summed and cut by bin centres.
struct Histogram<'a> {
    series: &'a [f64],
    centres: [i64; BINS],
}

impl Histogram<'_> {
    /// The traffic of the bins whose centre lies in `lo..=hi`.
    fn weight(&self, lo: i64, hi: i64) -> f64 {
        self.series
            .iter()
            .zip(&self.centres)
            .filter(|(_, &c)| lo <= c && c <= hi)
            .map(|(w, _)| w)
            .sum()
    }

    /// One cut per boundary between consecutive shares, at the bin centre where the running
    /// traffic of `lo..=hi` first reaches the cumulative share. `None` when the histogram
    /// cannot place them all strictly inside `(lo, hi]`: the segment then stays whole rather
    /// than publish a split the traffic did not ask for.
    fn cuts(&self, lo: i64, hi: i64, shares: &[f64]) -> Option<Vec<i64>> {
        let sum: f64 = shares.iter().filter(|s| **s > 0.0).sum();
        let total = self.weight(lo, hi);
        if shares.len() < 2 || hi <= lo || sum <= 0.0 || total <= 0.0 {
            return None;
        }
        let mut cuts = Vec::with_capacity(shares.len() - 1);
        let mut acc = 0.0;
        for share in &shares[..shares.len() - 1] {
            acc += share;
            let target = total * acc / sum;
            let mut running = 0.0;
            let cut = self
                .series
                .iter()
                .zip(&self.centres)
                .filter(|(_, &c)| lo <= c && c <= hi)
                .find_map(|(w, &c)| {
                    running += w;
                    (running >= target).then_some(c)
                })?;
            if cut <= lo || cut > hi {
                return None;
            }
            cuts.push(cut);
        }
        // Equal quantiles (one heavy bin) would give empty bands; nudge them apart and give up
        // if that runs past the top.
        cuts.sort_unstable();
        for i in 1..cuts.len() {
            cuts[i] = cuts[i].max(cuts[i - 1] + 1);
        }
        (cuts.last().is_some_and(|&c| c <= hi)).then_some(cuts)
    }
}

/// Builds a plan from a picture (§7 steps 1–6). `now_ms` stamps the plan: decay scales every
/// bin by the same factor, so the picture need not be brought to `now_ms` to plan from it.
pub fn build_plan(
    picture: &TrafficPicture,
    groups: &[Group],
    mode: BucketServeMode,
    now_ms: u64,
) -> Plan {
    Plan {
        bands: plan_bands(picture, groups, mode),
        dropped: Vec::new(),
        refreshed: true,
        computed_at_ms: now_ms,
    }
}

fn plan_bands(picture: &TrafficPicture, groups: &[Group], mode: BucketServeMode) -> Vec<Band> {
    let mut segs = segments(groups);
    let hist = Histogram {
        series: picture.series(mode),
        centres: bin_centres(),
    };
    let mut total = 0.0;
    for seg in &mut segs {
        seg.weight = hist.weight(seg.lo, seg.hi);
        total += seg.weight;
    }
    if total <= 0.0 {
        return Vec::new();
    }

    // Each roleset is owed its replica share of all traffic. What only it can serve (its
    // exclusive segments) is already charged to it, so the shared segments only have to make
    // up the rest; a roleset whose exclusive tail exceeds its share needs nothing more.
    let mut replicas: HashMap<&str, u32> = HashMap::new();
    let mut exclusive: HashMap<&str, f64> = HashMap::new();
    for seg in &segs {
        for g in &seg.covering {
            replicas.entry(g.name.as_str()).or_insert(g.weight());
        }
        if let [only] = seg.covering.as_slice() {
            *exclusive.entry(only.name.as_str()).or_default() += seg.weight;
        }
    }
    if replicas.len() < 2 {
        return Vec::new();
    }
    let replica_total: f64 = replicas.values().map(|&r| f64::from(r)).sum();
    let mut need: HashMap<&str, f64> = replicas
        .iter()
        .map(|(&name, &r)| {
            let owed = total * f64::from(r) / replica_total;
            (name, owed - exclusive.get(name).copied().unwrap_or(0.0))
        })
        .collect();
    let needs = |need: &HashMap<&str, f64>, name: &str| need.get(name).copied().unwrap_or(0.0);

    // Busiest shared segments first, so the band budget goes where the traffic is.
    let mut candidates: Vec<&Segment> = segs
        .iter()
        .filter(|s| s.covering.len() >= 2 && s.weight / total >= MIN_SPLIT_SHARE)
        .collect();
    candidates.sort_by(|a, b| b.weight.total_cmp(&a.weight));

    let mut bands: Vec<Band> = Vec::with_capacity(MAX_BANDS);
    let mut budget = MAX_BANDS;
    for seg in candidates {
        if budget == 0 {
            break;
        }
        let mut active: Vec<&Group> = seg
            .covering
            .iter()
            .copied()
            .filter(|g| needs(&need, &g.name) > 0.0)
            .collect();
        active.sort_by(|a, b| {
            needs(&need, &b.name)
                .total_cmp(&needs(&need, &a.name))
                .then_with(|| a.name.cmp(&b.name))
        });
        let parts = active.len().min(budget);
        match parts {
            0 => continue,
            1 => {
                // Pin the whole segment only when one roleset alone still needs it; when the
                // budget squeezed several down to one, leave the segment to the fast paths.
                if let [only] = active.as_slice() {
                    bands.push(Band {
                        lo: seg.lo,
                        hi: seg.hi,
                        roleset: only.name.clone(),
                    });
                    budget -= 1;
                    if let Some(n) = need.get_mut(only.name.as_str()) {
                        *n -= seg.weight;
                    }
                }
                continue;
            }
            _ => {}
        }
        let shares: Vec<f64> = active[..parts]
            .iter()
            .map(|g| needs(&need, &g.name))
            .collect();
        let Some(cuts) = hist.cuts(seg.lo, seg.hi, &shares) else {
            continue;
        };
        let mut lo = seg.lo;
        for (j, g) in active[..parts].iter().enumerate() {
            let hi = cuts.get(j).map_or(seg.hi, |c| c - 1);
            // Debit what the band takes, so a roleset spanning several shared segments draws
            // on one replica share instead of one per segment.
            let taken = hist.weight(lo, hi);
            if let Some(n) = need.get_mut(g.name.as_str()) {
                *n -= taken;
            }
            bands.push(Band {
                lo,
                hi,
                roleset: g.name.clone(),
            });
            lo = hi + 1;
        }
        budget -= parts;
    }
    bands.sort_by_key(|b| b.lo);
    bands
}

/// Identifies a plan: the mode and the fleet shape (names, ranges, replicas) it was built for.
/// Length-prefixed names keep the key unambiguous whatever characters a name holds.
fn cache_key(mode: BucketServeMode, groups: &[Group]) -> String {
    let mut parts: Vec<String> = groups
        .iter()
        .map(|g| {
            format!(
                "{}:{}={}-{}x{}",
                g.name.len(),
                g.name,
                g.min,
                g.max,
                g.weight()
            )
        })
        .collect();
    parts.sort_unstable();
    format!("{}|{}", mode.as_str(), parts.join(","))
}

/// One model's picture and cached plans.
#[derive(Debug, Clone, Default)]
struct ModelState {
    picture: TrafficPicture,
    plans: HashMap<String, Plan>,
    /// Rolesets the model's live plans held after the last refresh, to report the ones that
    /// leave every live plan.
    published: BTreeSet<String>,
}

/// Per-model traffic pictures and plan caches.
#[derive(Debug, Clone, Default)]
pub struct Planner {
    models: HashMap<String, ModelState>,
}

impl Planner {
    pub fn new() -> Planner {
        Planner::default()
    }

    /// Records one routed request. An empty model or a length ≤ 0 creates no state, so
    /// requests without a prompt-length estimate never allocate a picture.
    pub fn record(&mut self, model: &str, len: i64, now_ms: u64) {
        if model.is_empty() || len <= 0 {
            return;
        }
        self.models
            .entry_ref(model)
            .or_default()
            .picture
            .record(len, now_ms);
    }

    /// The model's plan for `groups` in `mode`: the cached one while younger than 5 s, else a
    /// fresh one. `None` when the model has recorded nothing (no picture, no state created).
    /// A plan with no bands is "no plan": fewer than two groups, or nothing worth splitting.
    pub fn plan_for(
        &mut self,
        model: &str,
        groups: &[Group],
        mode: BucketServeMode,
        now_ms: u64,
    ) -> Option<&Plan> {
        let state = self.models.get_mut(model)?;
        state.picture.decay_to(now_ms);
        let key = cache_key(mode, groups);
        let fresh = |p: &Plan| now_ms.saturating_sub(p.computed_at_ms) < REFRESH_MS;
        if state.plans.get(&key).is_some_and(fresh) {
            let plan = state.plans.get_mut(&key)?;
            plan.refreshed = false;
            plan.dropped.clear();
            return Some(plan);
        }

        let mut plan = build_plan(&state.picture, groups, mode, now_ms);
        // Live = this plan plus every other cached plan still fresh: a refresh in one mode must
        // not drop the gauges another mode's plan still serves.
        let mut live: BTreeSet<String> = plan.bands.iter().map(|b| b.roleset.clone()).collect();
        for (k, other) in &state.plans {
            if *k != key && fresh(other) {
                live.extend(other.bands.iter().map(|b| b.roleset.clone()));
            }
        }
        plan.dropped = state.published.difference(&live).cloned().collect();
        state.published = live;

        if !state.plans.contains_key(&key) && state.plans.len() >= PLAN_CACHE_SIZE {
            let oldest = state
                .plans
                .iter()
                .min_by_key(|(_, p)| p.computed_at_ms)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                state.plans.remove(&oldest);
            }
        }
        Some(state.plans.entry(key).insert(plan).into_mut())
    }

    /// The model's picture, as of its last decay.
    pub fn picture(&self, model: &str) -> Option<&TrafficPicture> {
        self.models.get(model).map(|s| &s.picture)
    }

    /// Number of models with state.
    pub fn model_count(&self) -> usize {
        self.models.len()
    }

    /// Keeps only the models `keep` accepts, so models that left the fleet free their state.
    pub fn retain_models(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.models.retain(|name, _| keep(name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_767_225_600_000;
    const SEC: u64 = 1_000;

    fn group(name: &str, min: i64, max: i64, replicas: u32) -> Group {
        Group {
            name: name.into(),
            min,
            max,
            replicas,
        }
    }

    fn two_equal() -> Vec<Group> {
        vec![group("dep-a", 0, 4096, 0), group("dep-b", 0, 4096, 0)]
    }

    /// Records `count` requests with evenly spaced lengths over `from..=to`: the uniform
    /// traffic the §9.9 expectations are stated against.
    fn serve_even(planner: &mut Planner, model: &str, from: i64, to: i64, count: i64, now: u64) {
        for i in 0..count {
            planner.record(model, from + (to - from) * i / (count - 1), now);
        }
    }

    fn plan(planner: &mut Planner, groups: &[Group], mode: BucketServeMode, now: u64) -> Plan {
        planner
            .plan_for("m", groups, mode, now)
            .expect("the model has a picture")
            .clone()
    }

    /// The plan is a sorted, gap-free, overlap-free tiling of `lo..=hi`.
    fn assert_tiles(plan: &Plan, lo: i64, hi: i64) {
        let bands = &plan.bands;
        assert!(!bands.is_empty());
        assert_eq!(bands[0].lo, lo);
        assert_eq!(bands[bands.len() - 1].hi, hi);
        for w in bands.windows(2) {
            assert_eq!(w[0].hi + 1, w[1].lo, "{bands:?}");
            assert!(w[0].lo <= w[0].hi, "{bands:?}");
        }
    }

    #[test]
    fn splits_shared_range_in_replica_proportion() {
        // 400 requests spread evenly over [200, 4000] in rps mode: dep-b (3 of 4 replicas)
        // needs three quarters of the requests, so its band ends near the 75% length quantile
        // (~3050), which the 9%-wide bins place somewhere in (2400, 3600).
        let groups = [group("dep-a", 0, 4096, 1), group("dep-b", 0, 4096, 3)];
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 400, T0);
        let plan = plan(&mut p, &groups, BucketServeMode::Rps, T0);
        assert!(plan.refreshed);
        assert_eq!(plan.bands.len(), 2);
        assert_tiles(&plan, 0, 4096);
        assert_eq!(plan.bands[0].roleset, "dep-b");
        assert_eq!(plan.bands[1].roleset, "dep-a");
        assert!(
            plan.bands[0].hi > 2400 && plan.bands[0].hi < 3600,
            "{plan:?}"
        );
        assert_eq!(plan.lookup(200), Some("dep-b"));
        assert_eq!(plan.lookup(4000), Some("dep-a"));
        assert_eq!(plan.lookup(5000), None);
    }

    #[test]
    fn equal_replicas_split_evenly() {
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 400, T0);
        let plan = plan(&mut p, &two_equal(), BucketServeMode::Rps, T0);
        assert_eq!(plan.bands.len(), 2);
        assert_tiles(&plan, 0, 4096);
        // Replicas 0 count as 1; equal needs tie-break by name.
        assert_eq!(plan.bands[0].roleset, "dep-a");
        assert_eq!(plan.bands[1].roleset, "dep-b");
        assert!(
            plan.bands[0].hi > 1000 && plan.bands[0].hi < 3200,
            "{plan:?}"
        );
    }

    #[test]
    fn charges_exclusive_tails() {
        // 100 requests in the shared [0, 4096], 200 in general's own tail: general already
        // holds more than its half, so only "short" still needs the shared segment, whole.
        let groups = [group("short", 0, 4096, 1), group("general", 0, 8192, 1)];
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 100, T0);
        serve_even(&mut p, "m", 4200, 7800, 200, T0);
        let plan = plan(&mut p, &groups, BucketServeMode::Rps, T0);
        assert_eq!(plan.bands.len(), 1, "{plan:?}");
        assert_tiles(&plan, 0, 4096);
        assert_eq!(plan.bands[0].roleset, "short");
        assert_eq!(plan.lookup(6000), None, "an exclusive tail carries no band");
    }

    #[test]
    fn keeps_thin_shared_intervals_whole() {
        let groups = [
            group("short-a", 0, 4000, 1),
            group("short-b", 0, 4000, 1),
            group("long-a", 4001, 40000, 1),
            group("long-b", 4001, 40000, 1),
        ];
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 1000, T0);
        serve_even(&mut p, "m", 5000, 39000, 20, T0); // ~2% of the traffic
        let plan = plan(&mut p, &groups, BucketServeMode::Rps, T0);
        assert_eq!(plan.bands.len(), 2, "{plan:?}");
        assert_tiles(&plan, 0, 4000);
        assert!(matches!(plan.lookup(2000), Some("short-a" | "short-b")));
        assert_eq!(plan.lookup(30000), None);
    }

    #[test]
    fn caps_bands_at_the_budget() {
        let groups: Vec<Group> = (0..17)
            .map(|i| group(&format!("rs-{i:02}"), 0, 4096, 1))
            .collect();
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 1000, T0);
        let plan = plan(&mut p, &groups, BucketServeMode::Rps, T0);
        assert_eq!(plan.bands.len(), MAX_BANDS);
        assert_tiles(&plan, 0, 4096);
        let names: BTreeSet<&str> = plan.bands.iter().map(|b| b.roleset.as_str()).collect();
        assert_eq!(names.len(), MAX_BANDS, "one band per banded roleset");
    }

    #[test]
    fn mode_moves_the_cut() {
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 200, T0);
        let rps = plan(&mut p, &two_equal(), BucketServeMode::Rps, T0);
        let tput = plan(&mut p, &two_equal(), BucketServeMode::Throughput, T0);
        assert_eq!(rps.bands.len(), 2);
        assert_eq!(tput.bands.len(), 2);
        // Token mass sits on the long prompts, so the throughput cut is further up.
        assert!(rps.bands[0].hi < tput.bands[0].hi, "{rps:?} {tput:?}");
    }

    #[test]
    fn normalizes_mode_and_caches_per_mode() {
        assert_eq!(
            BucketServeMode::normalize("THROUGHPUT"),
            BucketServeMode::Throughput
        );
        assert_eq!(BucketServeMode::normalize(" Rps "), BucketServeMode::Rps);
        assert_eq!(
            BucketServeMode::normalize("throughput-ish"),
            BucketServeMode::Throughput
        );
        assert!("throughput-ish".parse::<BucketServeMode>().is_err());

        let groups = two_equal();
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 200, T0);
        let mode = BucketServeMode::normalize;
        assert!(plan(&mut p, &groups, mode("THROUGHPUT"), T0).refreshed);
        assert!(!plan(&mut p, &groups, mode("throughput"), T0 + SEC).refreshed);
        assert!(!plan(&mut p, &groups, mode("throughput-ish"), T0 + 2 * SEC).refreshed);
        // The other mode has its own entry and does not evict the first.
        assert!(plan(&mut p, &groups, mode("rps"), T0 + SEC).refreshed);
        assert!(!plan(&mut p, &groups, mode("rps"), T0 + 2 * SEC).refreshed);
        assert!(!plan(&mut p, &groups, mode("throughput"), T0 + 2 * SEC).refreshed);
    }

    #[test]
    fn refreshes_after_interval() {
        let groups = two_equal();
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 200, T0);
        let rps = BucketServeMode::Rps;
        assert!(plan(&mut p, &groups, rps, T0).refreshed);
        assert!(!plan(&mut p, &groups, rps, T0 + SEC).refreshed);
        assert!(!plan(&mut p, &groups, rps, T0 + REFRESH_MS - 1).refreshed);
        let again = plan(&mut p, &groups, rps, T0 + REFRESH_MS);
        assert!(again.refreshed);
        assert_eq!(again.computed_at_ms, T0 + REFRESH_MS);
        // A changed fleet shape is a plan of its own.
        let reshaped = plan(&mut p, &groups[..1], rps, T0 + REFRESH_MS + SEC);
        assert!(reshaped.refreshed);
        assert!(reshaped.bands.is_empty());
    }

    #[test]
    fn cache_holds_at_most_eight_plans() {
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 200, T0);
        for i in 0..=PLAN_CACHE_SIZE as u64 {
            let groups = [group("a", 0, 4096, 1), group("b", 0, 4096, 1 + i as u32)];
            assert!(plan(&mut p, &groups, BucketServeMode::Rps, T0 + i).refreshed);
        }
        assert_eq!(p.models["m"].plans.len(), PLAN_CACHE_SIZE);
        // The oldest (replicas 1) was evicted; the newest is still cached.
        let oldest = [group("a", 0, 4096, 1), group("b", 0, 4096, 1)];
        let newest = [group("a", 0, 4096, 1), group("b", 0, 4096, 9)];
        assert!(!plan(&mut p, &newest, BucketServeMode::Rps, T0 + 20).refreshed);
        assert!(plan(&mut p, &oldest, BucketServeMode::Rps, T0 + 20).refreshed);
    }

    #[test]
    fn reports_dropped_rolesets() {
        let groups = two_equal();
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 200, T0);
        let rps = BucketServeMode::Rps;
        let first = plan(&mut p, &groups, rps, T0);
        assert_eq!(first.bands.len(), 2);
        assert!(first.dropped.is_empty(), "the first plan replaces nothing");
        // The fleet shrinks to one roleset: its plan has no band, and the two-roleset plan
        // is no longer fresh, so both rolesets leave every live plan.
        let shrunk = plan(&mut p, &groups[..1], rps, T0 + REFRESH_MS);
        assert_eq!(shrunk.dropped, ["dep-a", "dep-b"]);
        // Reported once.
        let again = plan(&mut p, &groups[..1], rps, T0 + 2 * REFRESH_MS);
        assert!(again.dropped.is_empty());
    }

    #[test]
    fn a_fresh_plan_of_another_mode_keeps_its_rolesets_live() {
        let groups = two_equal();
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 200, T0);
        plan(&mut p, &groups, BucketServeMode::Rps, T0);
        plan(
            &mut p,
            &groups,
            BucketServeMode::Throughput,
            T0 + REFRESH_MS - 1,
        );
        let shrunk = plan(&mut p, &groups[..1], BucketServeMode::Rps, T0 + REFRESH_MS);
        assert!(
            shrunk.dropped.is_empty(),
            "the throughput plan still serves"
        );
    }

    #[test]
    fn decays_traffic_picture() {
        let total = |p: &Planner| p.picture("m").unwrap().weights().iter().sum::<f64>();
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 101, T0);
        assert!((total(&p) - 101.0).abs() < 1e-9);
        // One half-life later the picture has halved, and the new request lands on top.
        p.record("m", 200, T0 + HALF_LIFE_MS);
        assert!((total(&p) - 51.5).abs() < 1e-9, "{}", total(&p));
        let mass: f64 = p.picture("m").unwrap().masses().iter().sum();
        let recorded: f64 = (0..101).map(|i| (200 + 3800 * i / 100) as f64).sum();
        assert!((mass - (recorded / 2.0 + 200.0)).abs() < 1e-6);
        // Reading also decays; a clock that steps back changes nothing.
        p.plan_for(
            "m",
            &two_equal(),
            BucketServeMode::Rps,
            T0 + 2 * HALF_LIFE_MS,
        );
        assert!((total(&p) - 25.75).abs() < 1e-9);
        p.record("m", 200, T0);
        assert!((total(&p) - 26.75).abs() < 1e-9);
    }

    #[test]
    fn keeps_models_separate() {
        let groups = two_equal();
        let mut p = Planner::new();
        serve_even(&mut p, "short-model", 200, 2000, 200, T0);
        serve_even(&mut p, "long-model", 3000, 4000, 200, T0);
        let rps = BucketServeMode::Rps;
        let short = p.plan_for("short-model", &groups, rps, T0).unwrap().clone();
        let long = p.plan_for("long-model", &groups, rps, T0).unwrap().clone();
        assert_eq!(short.bands.len(), 2);
        assert_eq!(long.bands.len(), 2);
        assert!(short.bands[0].hi < long.bands[0].hi);
    }

    #[test]
    fn single_roleset_or_no_groups_has_no_plan() {
        let mut p = Planner::new();
        assert!(
            p.plan_for("m", &two_equal(), BucketServeMode::Rps, T0)
                .is_none(),
            "no traffic recorded, no plan"
        );
        serve_even(&mut p, "m", 200, 4000, 100, T0);
        let single = plan(&mut p, &two_equal()[..1], BucketServeMode::Rps, T0);
        assert!(single.bands.is_empty());
        assert_eq!(single.lookup(1000), None);
        let none = plan(&mut p, &[], BucketServeMode::Rps, T0);
        assert!(none.bands.is_empty());
        assert_eq!(none.lookup(2000), None);
    }

    #[test]
    fn segments_clamp_top_of_int() {
        let groups = [group("open", 0, i64::MAX, 1), group("short", 0, 4096, 1)];
        let segs = segments(&groups);
        assert_eq!(segs.len(), 2);
        assert_eq!((segs[0].lo, segs[0].hi), (0, 4096));
        assert_eq!(segs[0].covering.len(), 2);
        assert_eq!((segs[1].lo, segs[1].hi), (4097, i64::MAX - 1));
        let names: Vec<&str> = segs[1].covering.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, ["open"]);

        // An open range as declared (max 0 → i32::MAX) plans without overflow.
        let open = Group::from_declared("open", 0, 0, 1).unwrap();
        let mut p = Planner::new();
        serve_even(&mut p, "m", 200, 4000, 200, T0);
        let plan = plan(
            &mut p,
            &[open, group("short", 0, 4096, 1)],
            BucketServeMode::Rps,
            T0,
        );
        assert!(plan
            .bands
            .iter()
            .all(|b| b.lo <= b.hi && b.hi <= i64::from(i32::MAX)));
    }

    #[test]
    fn declared_ranges_follow_suitability_rules() {
        let g = Group::from_declared("a", -5, 0, 2).unwrap();
        assert_eq!((g.min, g.max), (0, i64::from(i32::MAX)));
        assert_eq!(
            Group::from_declared("a", 10, 20, 1).map(|g| (g.min, g.max)),
            Some((10, 20))
        );
        assert!(Group::from_declared("a", 30, 20, 1).is_none());
    }

    #[test]
    fn bands_stay_inside_declared_ranges() {
        // Staggered overlaps: every band must lie inside its roleset's range.
        let groups = [
            group("a", 0, 3000, 1),
            group("b", 1000, 6000, 2),
            group("c", 2000, 9000, 1),
        ];
        let mut p = Planner::new();
        serve_even(&mut p, "m", 100, 9000, 2000, T0);
        for mode in [BucketServeMode::Rps, BucketServeMode::Throughput] {
            let plan = plan(&mut p, &groups, mode, T0);
            assert!(!plan.bands.is_empty());
            for w in plan.bands.windows(2) {
                assert!(w[0].hi < w[1].lo, "{plan:?}");
            }
            for b in &plan.bands {
                let g = groups.iter().find(|g| g.name == b.roleset).unwrap();
                assert!(g.min <= b.lo && b.hi <= g.max, "{b:?} outside {g:?}");
            }
        }
    }

    #[test]
    fn inert_inputs() {
        let mut p = Planner::new();
        p.record("", 100, T0);
        p.record("m", 0, T0);
        p.record("m", -5, T0);
        assert_eq!(p.model_count(), 0, "inert input creates no model state");
        assert!(p
            .plan_for("", &two_equal(), BucketServeMode::Rps, T0)
            .is_none());
        assert!(p
            .plan_for("m", &two_equal(), BucketServeMode::Rps, T0)
            .is_none());
        assert_eq!(p.model_count(), 0);

        let mut picture = TrafficPicture::default();
        picture.record(0, T0);
        assert_eq!(picture, TrafficPicture::default());
        assert_eq!(Plan::default().lookup(1), None);
    }

    #[test]
    fn retain_models_frees_state() {
        let mut p = Planner::new();
        p.record("a", 10, T0);
        p.record("b", 10, T0);
        p.retain_models(|m| m == "b");
        assert!(p.picture("a").is_none());
        assert!(p.picture("b").is_some());
    }

    #[test]
    fn bins_and_centres() {
        assert_eq!(bin_of(1), 0);
        assert_eq!(bin_of(2), 8);
        assert_eq!(bin_of(4096), 96);
        assert_eq!(bin_of(i64::MAX), BINS - 1);
        let centres = bin_centres();
        assert_eq!(centres[0], 1);
        assert_eq!(centres[8], 2);
        assert!(centres.windows(2).all(|w| w[0] <= w[1]));
        // A length's bin centre is within one bin width of it.
        for len in [3i64, 100, 2500, 100_000] {
            let c = centres[bin_of(len)] as f64;
            assert!((c / len as f64 - 1.0).abs() < 0.1, "{len} → {c}");
        }
    }

    #[test]
    fn env_bucket_serve() {
        type Row = (
            Option<&'static str>,
            Option<&'static str>,
            bool,
            BucketServeMode,
            usize,
        );
        let rows: [Row; 8] = [
            (None, None, false, BucketServeMode::Throughput, 0),
            (Some(""), Some(""), false, BucketServeMode::Throughput, 0),
            (Some("true"), Some("rps"), true, BucketServeMode::Rps, 0),
            (
                Some("1"),
                Some("THROUGHPUT"),
                true,
                BucketServeMode::Throughput,
                0,
            ),
            (Some("1"), Some("Rps"), true, BucketServeMode::Rps, 0),
            (
                Some("1"),
                Some("throughput-ish"),
                true,
                BucketServeMode::Throughput,
                1,
            ),
            (Some("yes"), Some("rps"), false, BucketServeMode::Rps, 1),
            (Some("True"), None, true, BucketServeMode::Throughput, 0),
        ];
        for (serve, mode, enabled, want_mode, warnings) in rows {
            let (s, w) = BucketServeSettings::from_lookup(|k| match k {
                "AIBRIX_BUCKET_SERVE" => serve.map(str::to_string),
                "AIBRIX_BUCKET_SERVE_MODE" => mode.map(str::to_string),
                _ => None,
            });
            assert_eq!(s.enabled, enabled, "{serve:?} {mode:?}");
            assert_eq!(s.mode, want_mode, "{serve:?} {mode:?}");
            assert_eq!(w.len(), warnings, "{serve:?} {mode:?}: {w:?}");
        }
        for v in ["1", "t", "T", "TRUE", "true", "True"] {
            assert_eq!(parse_go_bool(v.trim()), Some(true), "{v}");
        }
        for v in ["0", "f", "F", "FALSE", "false", "False"] {
            assert_eq!(parse_go_bool(v.trim()), Some(false), "{v}");
        }
        for v in ["yes", "on", "tRUE", "2", ""] {
            assert_eq!(parse_go_bool(v.trim()), None, "{v}");
        }
    }
}
