//! `vtc-basic`: AIBrix's Virtual Token Counter strategy, fairness between users first and
//! pod load second.
//!
//! Each user's estimated tokens over a sliding window (5 minutes by default) place the user
//! on the line of standard pods: a user with few tokens lands near the first pod, a heavy
//! user further along, so heavy users share pods with each other rather than with everyone.
//! Where exactly depends on a bucket size that adapts to the traffic, half the sum of the
//! smallest and largest user totals (never below `min_tokens`). A pod's score is its
//! distance from that place (times the fairness weight) plus its load over `max_pod_load`,
//! capped at 1 (times the utilization weight), plus a draw in `0..0.1` that breaks ties; the
//! lowest wins. A request without a `user` goes to a pod drawn at random.
//!
//! Tokens are estimated from the prompt text as AIBrix does (4 bytes a token, 1.5 output
//! tokens per input token) and charged when the request is routed, not when it is answered:
//! the counter steers the next request, so it must move now.
//!
//! The counters are per Envoy worker (as AIBrix's are per gateway replica): a user's requests
//! spread over workers count on each separately.

use std::collections::{BTreeMap, VecDeque};

use crate::core::errors::RouteError;
use crate::core::fleet::ModelView;
use crate::core::pd::single::no_standard_pod;
use crate::core::pd::{MinPicker, Target};

/// Users tracked at most; a new user past it counts as having no tokens until an idle user's
/// window empties (see [`TokenTracker::sweep`]).
pub const MAX_USERS: usize = 4096;

/// A total at or below it is empty: subtracting float buckets can leave dust.
const EMPTY: f64 = 1e-9;

/// The `AIBRIX_ROUTER_VTC_*` knobs (AIBrix's names and defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct VtcSettings {
    /// `AIBRIX_ROUTER_VTC_BASIC_MAX_POD_LOAD` (100): running requests that count as a full pod.
    pub max_pod_load: f64,
    /// `AIBRIX_ROUTER_VTC_BASIC_INPUT_TOKEN_WEIGHT` (1).
    pub input_weight: f64,
    /// `AIBRIX_ROUTER_VTC_BASIC_OUTPUT_TOKEN_WEIGHT` (2).
    pub output_weight: f64,
    /// `AIBRIX_ROUTER_VTC_BASIC_FAIRNESS_WEIGHT` (1).
    pub fairness_weight: f64,
    /// `AIBRIX_ROUTER_VTC_BASIC_UTILIZATION_WEIGHT` (1).
    pub utilization_weight: f64,
    /// `AIBRIX_ROUTER_VTC_TOKEN_TRACKER_WINDOW_SIZE` (5) × `..._TIME_UNIT` (`minutes`).
    pub window_ms: u64,
    /// One bucket of the window: a second (a millisecond for `milliseconds`), or a 64th of
    /// the window if longer (see [`VtcSettings::bucket_for`]).
    pub bucket_ms: u64,
    /// `AIBRIX_ROUTER_VTC_TOKEN_TRACKER_MIN_TOKENS` (1000): the smallest bucket size, and the
    /// smallest total while no user has tokens.
    pub min_tokens: f64,
    /// `AIBRIX_ROUTER_VTC_TOKEN_TRACKER_MAX_TOKENS` (8000): the largest total while no user
    /// has tokens.
    pub max_tokens: f64,
}

impl Default for VtcSettings {
    fn default() -> Self {
        VtcSettings {
            max_pod_load: 100.0,
            input_weight: 1.0,
            output_weight: 2.0,
            fairness_weight: 1.0,
            utilization_weight: 1.0,
            window_ms: 5 * 60_000,
            bucket_ms: 300_000 / 64,
            min_tokens: 1000.0,
            max_tokens: 8000.0,
        }
    }
}

impl VtcSettings {
    /// The window's unit and bucket length for `..._TIME_UNIT`; `None` for an unknown unit.
    pub fn unit_ms(unit: &str) -> Option<(u64, u64)> {
        match unit.to_ascii_lowercase().as_str() {
            "minutes" => Some((60_000, 1000)),
            "seconds" => Some((1000, 1000)),
            "milliseconds" => Some((1, 1)),
            _ => None,
        }
    }

    /// The bucket length for a window: the unit's, or a 64th of the window if that is longer,
    /// so a busy user holds at most about 64 buckets (1 KiB) however long the window. AIBrix
    /// buckets by the second; a 5-minute window then ages out in 5-second steps instead.
    pub fn bucket_for(window_ms: u64, unit_bucket_ms: u64) -> u64 {
        unit_bucket_ms.max(window_ms / 64).max(1)
    }

    /// The weighted tokens a prompt of `prompt_bytes` is charged: its estimated input tokens
    /// and the output estimated from them.
    pub fn charge(&self, prompt_bytes: usize) -> f64 {
        if prompt_bytes == 0 {
            return 0.0;
        }
        let input = (prompt_bytes as f64 / 4.0).ceil();
        let output = (input * 1.5).ceil();
        input * self.input_weight + output * self.output_weight
    }
}

/// One user's tokens in the window: buckets oldest first, and their sum.
#[derive(Debug, Default)]
struct UserWindow {
    buckets: VecDeque<(u64, f64)>,
    total: f64,
}

/// Per-user token totals over a sliding window, with the smallest and largest total at hand.
#[derive(Debug, Default)]
pub struct TokenTracker {
    users: hashbrown::HashMap<String, UserWindow>,
    /// The positive totals as a multiset (count by value), ordered: `f64::to_bits` orders
    /// non-negative floats as their values.
    totals: BTreeMap<u64, u32>,
    last_sweep_ms: u64,
}

impl TokenTracker {
    /// Users with tokens in their window (or not swept since theirs emptied).
    pub fn users(&self) -> usize {
        self.users.len()
    }

    /// `user`'s tokens in the window ending at `now_ms`.
    pub fn tokens(&mut self, user: &str, now_ms: u64, s: &VtcSettings) -> f64 {
        let cutoff = now_ms.saturating_sub(s.window_ms);
        match self.users.get_mut(user) {
            Some(w) => {
                let (old, new) = prune(w, cutoff);
                moved(&mut self.totals, old, new);
                new
            }
            None => 0.0,
        }
    }

    /// The smallest and largest positive totals; the configured defaults while no user has
    /// any. Totals of users nobody asked about lately may be past their window until the next
    /// sweep, as in AIBrix, which prunes a user only when it is asked for or charged.
    pub fn bounds(&self, s: &VtcSettings) -> (f64, f64) {
        let value = |k: Option<(&u64, &u32)>| k.map(|(bits, _)| f64::from_bits(*bits));
        (
            value(self.totals.first_key_value()).unwrap_or(s.min_tokens),
            value(self.totals.last_key_value()).unwrap_or(s.max_tokens),
        )
    }

    /// Adds `tokens` to `user`'s current bucket.
    pub fn charge(&mut self, user: &str, tokens: f64, now_ms: u64, s: &VtcSettings) {
        if user.is_empty() || tokens.is_nan() || tokens <= 0.0 || tokens.is_infinite() {
            return;
        }
        if !self.users.contains_key(user) {
            if self.users.len() >= MAX_USERS {
                self.sweep(now_ms, s);
            }
            if self.users.len() >= MAX_USERS {
                return;
            }
            self.users.insert(user.to_string(), UserWindow::default());
        }
        let Some(w) = self.users.get_mut(user) else {
            return;
        };
        let (old, _) = prune(w, now_ms.saturating_sub(s.window_ms));
        let bucket = now_ms - now_ms % s.bucket_ms.max(1);
        match w.buckets.back_mut() {
            Some((at, sum)) if *at == bucket => *sum += tokens,
            _ => w.buckets.push_back((bucket, tokens)),
        }
        w.total += tokens;
        let new = w.total;
        moved(&mut self.totals, old, new);
    }

    /// Prunes every user and forgets those whose window is empty; at most once a second, as
    /// it visits every user.
    pub fn sweep(&mut self, now_ms: u64, s: &VtcSettings) {
        if now_ms.saturating_sub(self.last_sweep_ms) < 1000 && self.last_sweep_ms != 0 {
            return;
        }
        self.last_sweep_ms = now_ms;
        let cutoff = now_ms.saturating_sub(s.window_ms);
        let totals = &mut self.totals;
        self.users.retain(|_, w| {
            let (old, new) = prune(w, cutoff);
            moved(totals, old, new);
            new > EMPTY
        });
    }
}

/// Drops `w`'s buckets older than `cutoff`; the total before and after.
fn prune(w: &mut UserWindow, cutoff: u64) -> (f64, f64) {
    let old = w.total;
    while let Some(&(at, sum)) = w.buckets.front() {
        if at >= cutoff {
            break;
        }
        w.total -= sum;
        w.buckets.pop_front();
    }
    if w.buckets.is_empty() || w.total <= EMPTY {
        w.total = w.buckets.iter().map(|(_, t)| t).sum();
    }
    (old, w.total)
}

/// Moves one user's total from `old` to `new` in the multiset of positive totals.
fn moved(totals: &mut BTreeMap<u64, u32>, old: f64, new: f64) {
    if old.to_bits() == new.to_bits() {
        return;
    }
    if old > EMPTY {
        if let Some(n) = totals.get_mut(&old.to_bits()) {
            *n -= 1;
            if *n == 0 {
                totals.remove(&old.to_bits());
            }
        }
    }
    if new > EMPTY {
        *totals.entry(new.to_bits()).or_insert(0) += 1;
    }
}

/// The tokens one step along the pod line stands for: half the sum of the smallest and
/// largest user totals (`bounds`), never below `min_tokens`.
pub fn bucket_size(bounds: (f64, f64), s: &VtcSettings) -> f64 {
    s.min_tokens.max((bounds.0 + bounds.1) / 2.0)
}

/// Where a user with `user_tokens` stands on the line of `pods` standard pods, `0..=pods−1`.
pub fn place(user_tokens: f64, bounds: (f64, f64), pods: usize, s: &VtcSettings) -> f64 {
    let bucket = bucket_size(bounds, s);
    let last = pods.saturating_sub(1) as f64;
    if bucket > 0.0 {
        (user_tokens / bucket).min(last)
    } else {
        last
    }
}

/// One standard pod's score, lower is better, without the tie-breaking draw:
/// `fairness × |index − place| + utilization × min(running / max_pod_load, 1)`.
fn score(index: usize, place: f64, running: u32, s: &VtcSettings) -> f64 {
    let utilization = if s.max_pod_load > 0.0 {
        (f64::from(running) / s.max_pod_load).min(1.0)
    } else {
        1.0
    };
    s.fairness_weight * (index as f64 - place).abs() + s.utilization_weight * utilization
}

/// Every standard pod's [`score`] by slot, for a blend; other slots are NaN. `running` is
/// by slot (0 where missing).
pub fn scores(model: &ModelView, place: f64, running: &[u32], s: &VtcSettings) -> Vec<f64> {
    let mut out = vec![f64::NAN; model.pods.len()];
    for (index, &slot) in model.others.iter().enumerate() {
        let load = running.get(slot).copied().unwrap_or(0);
        if let Some(o) = out.get_mut(slot) {
            *o = score(index, place, load, s);
        }
    }
    out
}

/// What `vtc-basic` knows of the request: its user and its prompt's size.
#[derive(Debug, Clone, Copy)]
pub struct VtcAsk<'a> {
    /// The `user` header; `None` (or empty) routes at random and charges nobody.
    pub user: Option<&'a str>,
    pub prompt_bytes: usize,
    pub now_ms: u64,
}

impl VtcAsk<'_> {
    fn user(&self) -> Option<&str> {
        self.user.filter(|u| !u.is_empty())
    }

    /// The user's place on the pod line (`None` without a user); reads the tracker only.
    pub fn place(&self, model: &ModelView, t: &mut TokenTracker, s: &VtcSettings) -> Option<f64> {
        let user = self.user()?;
        let tokens = t.tokens(user, self.now_ms, s);
        Some(place(tokens, t.bounds(s), model.others.len(), s))
    }

    /// Charges the request's estimated tokens to its user, once it is routed.
    pub fn charge(&self, t: &mut TokenTracker, s: &VtcSettings) {
        if let Some(user) = self.user() {
            t.charge(user, s.charge(self.prompt_bytes), self.now_ms, s);
        }
    }
}

/// Picks the pod for `vtc-basic` among the standard pods, given the user's `place` (see
/// [`VtcAsk::place`]; `None` draws a pod at random). Pure: it may run again when the ledger's
/// CAS round retries, so the caller charges the user ([`VtcAsk::charge`]) once it is routed.
pub fn select_vtc(
    model: &ModelView,
    place: Option<f64>,
    running: &[u32],
    s: &VtcSettings,
    rng: &mut fastrand::Rng,
) -> Result<Target, RouteError> {
    let pods = &model.others;
    if pods.is_empty() {
        return Err(no_standard_pod("vtc-basic"));
    }
    let pod = match place {
        None => pods[rng.usize(..pods.len())],
        Some(place) => {
            let mut best = MinPicker::new();
            for (index, &slot) in pods.iter().enumerate() {
                let load = running.get(slot).copied().unwrap_or(0);
                best.offer(score(index, place, load, s) + rng.f64() * 0.1, slot, rng);
            }
            best.item().unwrap_or(pods[0])
        }
    };
    Ok(Target::Single { pod })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;

    fn model(n: usize) -> ModelView {
        let mut pods: Vec<_> = (0..n)
            .map(|i| pod(&format!("s{i}"), "", "", true))
            .collect();
        pods.push(pod("p", "prefill", "g", true));
        pods.push(pod("d", "decode", "g", true));
        FleetView::from_snapshot(&snapshot(pods)).models["m"].clone()
    }

    fn ask(user: Option<&str>, bytes: usize, now_ms: u64) -> VtcAsk<'_> {
        VtcAsk {
            user,
            prompt_bytes: bytes,
            now_ms,
        }
    }

    /// What the host does: place, select, then charge the routed request.
    fn select_vtc_charged(
        m: &ModelView,
        ask: VtcAsk<'_>,
        running: &[u32],
        t: &mut TokenTracker,
        s: &VtcSettings,
        rng: &mut fastrand::Rng,
    ) -> Result<Target, RouteError> {
        let place = ask.place(m, t, s);
        let target = select_vtc(m, place, running, s, rng)?;
        ask.charge(t, s);
        Ok(target)
    }

    fn name(m: &ModelView, t: Target) -> String {
        m.pods[t.pod()].name.clone()
    }

    #[test]
    fn the_charge_is_aibrix_estimate_weighted() {
        let s = VtcSettings::default();
        // 10 bytes: 3 input tokens, 5 output tokens (ceil 4.5): 3 × 1 + 5 × 2.
        assert_eq!(s.charge(10), 13.0);
        assert_eq!(s.charge(0), 0.0);
        assert_eq!(s.charge(4000), 1000.0 + 1500.0 * 2.0);
    }

    #[test]
    fn totals_slide_out_of_the_window_and_the_bounds_follow() {
        let s = VtcSettings {
            window_ms: 10_000,
            bucket_ms: 1000,
            ..VtcSettings::default()
        };
        let mut t = TokenTracker::default();
        assert_eq!(t.bounds(&s), (1000.0, 8000.0), "defaults with no user");
        t.charge("a", 100.0, 1_000, &s);
        t.charge("a", 50.0, 1_500, &s); // same one-second bucket
        t.charge("b", 400.0, 6_000, &s);
        assert_eq!(t.tokens("a", 6_000, &s), 150.0);
        assert_eq!(t.bounds(&s), (150.0, 400.0));
        // At 11.5 s the bucket of second 1 has left a's window.
        assert_eq!(t.tokens("a", 11_500, &s), 0.0);
        assert_eq!(t.bounds(&s), (400.0, 400.0));
        assert_eq!(t.tokens("b", 17_000, &s), 0.0);
        assert_eq!(t.bounds(&s), (1000.0, 8000.0));
        assert_eq!(t.tokens("nobody", 17_000, &s), 0.0);
    }

    #[test]
    fn a_sweep_forgets_idle_users_and_a_full_table_takes_no_new_one() {
        let s = VtcSettings {
            window_ms: 1000,
            bucket_ms: 1000,
            ..VtcSettings::default()
        };
        let mut t = TokenTracker::default();
        for i in 0..MAX_USERS {
            t.charge(&format!("u{i}"), 1.0, 5_000, &s);
        }
        t.charge("late", 7.0, 5_500, &s);
        assert_eq!(t.users(), MAX_USERS);
        assert_eq!(t.tokens("late", 5_500, &s), 0.0, "no room: counted as none");
        // Once the others' windows have passed, the sweep makes room.
        t.charge("late", 7.0, 7_000, &s);
        assert_eq!(t.users(), 1);
        assert_eq!(t.tokens("late", 7_000, &s), 7.0);
        assert_eq!(t.bounds(&s), (7.0, 7.0));
    }

    #[test]
    fn a_light_user_takes_the_first_pod_and_a_heavy_one_the_last() {
        let m = model(3);
        let s = VtcSettings::default();
        let mut t = TokenTracker::default();
        let mut rng = fastrand::Rng::with_seed(7);
        let idle = vec![0; m.pods.len()];
        // Alone, a user's total is both bounds: past min_tokens it sits at total/total = 1.
        for _ in 0..5 {
            select_vtc_charged(
                &m,
                ask(Some("heavy"), 8000, 1_000),
                &idle,
                &mut t,
                &s,
                &mut rng,
            )
            .unwrap();
        }
        // A newcomer has no tokens: place 0, the first pod.
        let light = select_vtc_charged(
            &m,
            ask(Some("light"), 40, 2_000),
            &idle,
            &mut t,
            &s,
            &mut rng,
        );
        assert_eq!(name(&m, light.unwrap()), "s0");
        // heavy's total (5 × 8000 bytes) is far above the bucket (light's + heavy's) / 2:
        // clamped to the last pod.
        let heavy = select_vtc_charged(
            &m,
            ask(Some("heavy"), 8000, 2_000),
            &idle,
            &mut t,
            &s,
            &mut rng,
        );
        assert_eq!(name(&m, heavy.unwrap()), "s2");
    }

    #[test]
    fn load_pushes_a_user_off_its_place() {
        let m = model(2);
        // Utilization weighed twice: a full pod costs as much as two places of distance.
        let s = VtcSettings {
            utilization_weight: 2.0,
            ..VtcSettings::default()
        };
        let mut t = TokenTracker::default();
        let mut rng = fastrand::Rng::with_seed(9);
        let mut running = vec![0; m.pods.len()];
        let s0 = m.others[0];
        // A newcomer belongs on s0 (score 0 against 1); s0 full (0 + 2 against 1) loses.
        running[s0] = 100;
        for i in 0..20 {
            let user = format!("new{i}");
            let t = select_vtc_charged(
                &m,
                ask(Some(&user), 4, 1_000),
                &running,
                &mut t,
                &s,
                &mut rng,
            );
            assert_eq!(name(&m, t.unwrap()), "s1");
        }
        // With utilization weighed at 0, only fairness counts.
        let fair = VtcSettings {
            utilization_weight: 0.0,
            ..VtcSettings::default()
        };
        let got = select_vtc_charged(
            &m,
            ask(Some("x"), 4, 1_000),
            &running,
            &mut t,
            &fair,
            &mut rng,
        );
        assert_eq!(name(&m, got.unwrap()), "s0");
    }

    #[test]
    fn without_a_user_any_standard_pod_is_drawn_and_nobody_is_charged() {
        let m = model(3);
        let s = VtcSettings::default();
        let mut t = TokenTracker::default();
        let mut rng = fastrand::Rng::with_seed(11);
        let idle = vec![0; m.pods.len()];
        let mut seen = std::collections::HashSet::new();
        for user in [None, Some("")].into_iter().cycle().take(60) {
            let got = select_vtc_charged(&m, ask(user, 400, 1_000), &idle, &mut t, &s, &mut rng);
            seen.insert(name(&m, got.unwrap()));
        }
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert!(seen.iter().all(|n| n.starts_with('s')), "{seen:?}");
        assert_eq!(t.users(), 0);
    }

    #[test]
    fn prefill_and_decode_pods_are_never_taken() {
        let m = model(0);
        let mut t = TokenTracker::default();
        let mut rng = fastrand::Rng::with_seed(1);
        let err = select_vtc_charged(
            &m,
            ask(Some("u"), 4, 0),
            &[],
            &mut t,
            &VtcSettings::default(),
            &mut rng,
        );
        assert!(matches!(err, Err(RouteError::Selection { .. })));
        assert_eq!(t.users(), 0, "a request that was not routed charges nobody");
    }

    #[test]
    fn the_place_is_clamped_to_the_line() {
        let s = VtcSettings::default();
        assert_eq!(
            place(500.0, (100.0, 300.0), 4, &s),
            0.5,
            "bucket floors at 1000"
        );
        assert_eq!(place(9000.0, (1000.0, 5000.0), 4, &s), 3.0);
        assert_eq!(place(4500.0, (1000.0, 5000.0), 4, &s), 1.5);
        assert_eq!(place(10.0, (0.0, 0.0), 1, &s), 0.0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Charge { user: usize, tokens: u32, dt: u64 },
        Tokens { user: usize, dt: u64 },
        Sweep { dt: u64 },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (0..5usize, 1..1000u32, 0..3000u64)
                .prop_map(|(user, tokens, dt)| Op::Charge { user, tokens, dt }),
            2 => (0..5usize, 0..3000u64).prop_map(|(user, dt)| Op::Tokens { user, dt }),
            1 => (0..5000u64).prop_map(|dt| Op::Sweep { dt }),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Whatever the order of charges, reads and sweeps: a user's tokens are the sum of its
        /// charges whose bucket is still in the window, every total is its buckets' sum, and
        /// the ordered multiset holds exactly the positive totals (so the bounds are their
        /// min and max).
        #[test]
        fn the_window_and_the_bounds_agree_with_a_log_of_charges(
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let s = VtcSettings { window_ms: 10_000, bucket_ms: 1000, ..VtcSettings::default() };
            let users = ["a", "b", "c", "d", "e"];
            let mut t = TokenTracker::default();
            let mut log: Vec<(usize, u64, f64)> = Vec::new();
            let mut now = 1_000u64;
            for op in ops {
                match op {
                    Op::Charge { user, tokens, dt } => {
                        now += dt;
                        t.charge(users[user], f64::from(tokens), now, &s);
                        log.push((user, now - now % 1000, f64::from(tokens)));
                    }
                    Op::Tokens { user, dt } => {
                        now += dt;
                        let cutoff = now.saturating_sub(s.window_ms);
                        let want: f64 = log
                            .iter()
                            .filter(|(u, at, _)| *u == user && *at >= cutoff)
                            .map(|(_, _, n)| n)
                            .sum();
                        proptest::prop_assert_eq!(t.tokens(users[user], now, &s), want);
                    }
                    Op::Sweep { dt } => {
                        now += dt;
                        t.sweep(now, &s);
                    }
                }
                let mut positive: Vec<u64> = Vec::new();
                for w in t.users.values() {
                    let sum: f64 = w.buckets.iter().map(|(_, n)| n).sum();
                    proptest::prop_assert_eq!(w.total, sum);
                    if w.total > EMPTY {
                        positive.push(w.total.to_bits());
                    }
                }
                positive.sort_unstable();
                let held: Vec<u64> = t
                    .totals
                    .iter()
                    .flat_map(|(bits, n)| std::iter::repeat_n(*bits, *n as usize))
                    .collect();
                proptest::prop_assert_eq!(held, positive);
            }
        }
    }
}
