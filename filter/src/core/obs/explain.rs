//! Routing explanations: why a request went to the pods it went to.
//!
//! The selection fills an [`Explain`] only when the caller passes one (`x-pd-explain: 1` with
//! `explain` enabled in the plugin configuration); on the normal path the hooks are a `None`
//! check and nothing is allocated or formatted. [`Explain::header`] turns it into one compact
//! line for a response header or an access-log field.

use std::fmt::Write as _;

use crate::core::fleet::ModelView;
use crate::core::pd::FastPaths;

/// Candidate lists longer than this are shown as counts only.
const NAMES_UP_TO: usize = 4;
/// Pairs shown, best first.
pub const TOP_PAIRS: usize = 3;
/// Longest header value produced; the tail is cut with `...`.
pub const MAX_LEN: usize = 1500;

/// Candidates left after one step of the cascade.
#[derive(Debug, Clone, PartialEq)]
pub struct Kept {
    pub step: &'static str,
    pub prefill: Vec<usize>,
    pub decode: Vec<usize>,
}

/// One roleset's best pair in Step 5.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairScore {
    pub prefill: usize,
    pub prefill_score: f64,
    pub decode: usize,
    pub decode_score: f64,
    /// The normalised sum Step 5 minimises.
    pub total: f64,
}

/// What the selection saw and decided, by pod index into `ModelView::pods`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Explain {
    /// Prompt length the buckets were matched with; `None` when bucketing is off.
    pub bucket_len: Option<i64>,
    /// Roleset adaptive bucket serving assigned (advisory).
    pub band: Option<String>,
    pub kept: Vec<Kept>,
    /// Step 0 sent the request to this standard pod.
    pub combined: Option<usize>,
    pub fast: FastPaths,
    /// Prefill pods Step 3 skipped (in-flight count above mean + k·std).
    pub prefill_skipped: Vec<usize>,
    pub pairs: Vec<PairScore>,
    /// The chosen pair (prefill, decode).
    pub chosen: Option<(usize, usize)>,
    /// Why the selection failed, when it did.
    pub error: Option<String>,
}

impl Explain {
    /// Records the candidates after `step`.
    pub fn kept(&mut self, step: &'static str, prefill: &[usize], decode: &[usize]) {
        self.kept.push(Kept {
            step,
            prefill: prefill.to_vec(),
            decode: decode.to_vec(),
        });
    }

    /// One compact line: `bucket=...; s0=p[..] d[..]; s1=...; fast=...; pairs=...; pick=...`.
    pub fn header(&self, model: &ModelView) -> String {
        let name = |i: usize| model.pods.get(i).map(|p| p.name.as_str()).unwrap_or("?");
        let mut out = String::with_capacity(256);
        match self.bucket_len {
            Some(len) => {
                let _ = write!(out, "bucket=len:{len}");
            }
            None => out.push_str("bucket=off"),
        }
        if let Some(band) = &self.band {
            let _ = write!(out, " band={band}");
        }
        if let Some(pod) = self.combined {
            let _ = write!(out, "; combined={}", name(pod));
        }
        for k in &self.kept {
            let _ = write!(out, "; {}=", k.step);
            list(&mut out, 'p', &k.prefill, &name);
            out.push(' ');
            list(&mut out, 'd', &k.decode, &name);
        }
        let mut fast: Vec<&str> = Vec::new();
        if self.fast.prefill {
            fast.push("prefill_imbalance");
        }
        if let Some(check) = self.fast.decode {
            fast.push(check.name());
        }
        if self.fast.banded {
            fast.push("bucket_band");
        }
        if !fast.is_empty() {
            let _ = write!(out, "; fast={}", fast.join(","));
        }
        if !self.prefill_skipped.is_empty() {
            out.push_str("; skipped=");
            list(&mut out, 'p', &self.prefill_skipped, &name);
        }
        if !self.pairs.is_empty() {
            let mut pairs = self.pairs.clone();
            pairs.sort_by(|a, b| a.total.total_cmp(&b.total));
            out.push_str("; pairs=");
            for (n, p) in pairs.iter().take(TOP_PAIRS).enumerate() {
                if n > 0 {
                    out.push(',');
                }
                let _ = write!(
                    out,
                    "{}:{:.3}+{}:{:.3}={:.3}",
                    name(p.prefill),
                    p.prefill_score,
                    name(p.decode),
                    p.decode_score,
                    p.total
                );
            }
            if pairs.len() > TOP_PAIRS {
                let _ = write!(out, ",+{}", pairs.len() - TOP_PAIRS);
            }
        }
        if let Some((p, d)) = self.chosen {
            let _ = write!(out, "; pick={}+{}", name(p), name(d));
        }
        if let Some(e) = &self.error {
            let _ = write!(out, "; error={e}");
        }
        left_out(&mut out, model);
        crate::core::errors::sanitize_header_len(&out, MAX_LEN)
    }
}

/// `; out=d-0:unreachable,c-1:ejected`: the routable pods the view left out and why (the
/// first few, then a count), so an explanation also says why a pod got nothing.
pub fn left_out(out: &mut String, model: &ModelView) {
    let pods = model.left_out.as_slice();
    if pods.is_empty() {
        return;
    }
    out.push_str("; out=");
    for (n, (name, why)) in pods.iter().take(NAMES_UP_TO).enumerate() {
        if n > 0 {
            out.push(',');
        }
        let _ = write!(out, "{name}:{}", why.name());
    }
    if pods.len() > NAMES_UP_TO {
        let _ = write!(out, ",+{}", pods.len() - NAMES_UP_TO);
    }
}

/// `p[a,b]` for short lists, `p4` for long ones.
fn list<'a>(out: &mut String, side: char, pods: &[usize], name: &impl Fn(usize) -> &'a str) {
    if pods.len() > NAMES_UP_TO {
        let _ = write!(out, "{side}{}", pods.len());
        return;
    }
    out.push(side);
    out.push('[');
    for (n, &i) in pods.iter().enumerate() {
        if n > 0 {
            out.push(',');
        }
        out.push_str(name(i));
    }
    out.push(']');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};
    use crate::core::fleet::FleetView;
    use crate::core::ledger::{Counter, Ledger};
    use crate::core::pd::{self, PairInput, PdDefaults, PdSettings, Step0Input, Target};
    use crate::core::score::{DecodePolicy, PrefillPolicy};
    use crate::proto;

    const STEP0: Step0Input<'static> = Step0Input {
        profile: None,
        bucketing: false,
        prompt_len: 0,
    };

    fn model(pods: Vec<proto::Pod>) -> ModelView {
        FleetView::from_snapshot(&snapshot(pods)).models["m"].clone()
    }

    fn rolesets(n: usize) -> ModelView {
        let mut pods = Vec::new();
        for r in 0..n {
            pods.push(pod(&format!("p{r}"), "prefill", &format!("g{r}"), true));
            pods.push(pod(&format!("d{r}"), "decode", &format!("g{r}"), true));
        }
        model(pods)
    }

    fn least_request() -> PdSettings {
        let mut s = PdSettings::resolve(&PdDefaults::default(), None).unwrap();
        s.prefill_policy = PrefillPolicy::LeastRequest;
        s.decode_policy = DecodePolicy::LeastRequest;
        s
    }

    fn input(s: &PdSettings) -> PairInput<'_> {
        PairInput {
            settings: s,
            match_pct: &[],
            token_bytes: 0,
            banded_roleset: None,
            prompt_tokens: 100,
            session_delta: None,
            now_ms: 1_000,
        }
    }

    fn explained(
        m: &ModelView,
        ledger: &Ledger,
        s: &PdSettings,
        seed: u64,
    ) -> (
        Result<pd::Selected, crate::core::errors::RouteError>,
        Explain,
    ) {
        let mut x = Explain::default();
        let mut rng = fastrand::Rng::with_seed(seed);
        let r = pd::select_pd_explained(m, STEP0, ledger, input(s), &mut rng, Some(&mut x));
        (r, x)
    }

    #[test]
    fn explaining_does_not_change_the_pick_and_names_it() {
        let m = rolesets(2);
        let mut ledger = Ledger::default();
        // g0's decode pod is busy, so g1 wins on the decode score.
        for _ in 0..3 {
            ledger.add("ns/d0", Counter::Running, 0);
        }
        let s = least_request();
        for seed in 0..10 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let plain = pd::select_pd(&m, STEP0, &ledger, input(&s), &mut rng).unwrap();
            let (with, x) = explained(&m, &ledger, &s, seed);
            let with = with.unwrap();
            assert_eq!(plain, with, "seed {seed}");
            let Target::Pair { prefill, decode } = with.target else {
                panic!("a pair");
            };
            assert_eq!(x.chosen, Some((prefill, decode)));
            assert_eq!(x.pairs.len(), 2, "one scored pair per roleset");
            let header = x.header(&m);
            assert!(
                header.starts_with("bucket=off; s0=p[p0,p1] d[d0,d1]"),
                "{header}"
            );
            assert!(header.contains("; s1=p[p0,p1] d[d0,d1]"), "{header}");
            // d1 has no running signal while d0 has: d1 gets the cold-start score 1.0.
            assert!(
                header.contains("; pairs=p1:0.000+d1:1.000=0.333,p0:0.000+d0:3.000=1.000"),
                "{header}"
            );
            assert!(header.ends_with("; pick=p1+d1"), "{header}");
            assert!(!header.contains("fast="), "{header}");
        }
    }

    #[test]
    fn a_fast_path_shows_and_narrows_the_candidates() {
        let m = rolesets(2);
        let mut ledger = Ledger::default();
        for _ in 0..20 {
            ledger.add("ns/p0", Counter::PrefillInflight, 0);
        }
        let (r, x) = explained(&m, &ledger, &least_request(), 3);
        assert!(r.is_ok());
        assert!(x.fast.prefill);
        let header = x.header(&m);
        assert!(header.contains("; s1=p[p1] d[d1]"), "{header}");
        assert!(header.contains("; fast=prefill_imbalance"), "{header}");
        assert!(header.ends_with("; pick=p1+d1"), "{header}");
    }

    #[test]
    fn a_failed_selection_says_why() {
        let m = model(vec![pod("p0", "prefill", "g0", true)]);
        let (r, x) = explained(&m, &Ledger::default(), &least_request(), 1);
        assert!(r.is_err());
        let header = x.header(&m);
        assert!(
            header.ends_with("; error=decode pods are not ready: prefill=1, decode=0"),
            "{header}"
        );
        assert_eq!(x.chosen, None);
    }

    #[test]
    fn a_combined_pick_is_named() {
        let mut c = pod("c0", "all", "", true);
        c.config = r#"{"profiles":{"default":{"routingConfig":{"combined":true}}}}"#.into();
        let m = model(vec![pod("p0", "prefill", "g0", true), c]);
        let (r, x) = explained(&m, &Ledger::default(), &least_request(), 1);
        assert!(matches!(r.unwrap().target, Target::Single { .. }));
        assert_eq!(x.header(&m), "bucket=off; combined=c0");
    }

    #[test]
    fn big_fleets_show_counts_and_the_top_pairs_only() {
        let m = rolesets(60);
        let (r, x) = explained(&m, &Ledger::default(), &least_request(), 5);
        assert!(r.is_ok());
        let header = x.header(&m);
        assert!(header.contains("; s0=p60 d60"), "{header}");
        assert!(header.contains(",+57"), "top 3 of 60 pairs: {header}");
        assert!(header.len() <= MAX_LEN);
    }

    #[test]
    fn long_lines_are_cut_at_the_limit() {
        let x = Explain {
            error: Some("x".repeat(3 * MAX_LEN)),
            ..Default::default()
        };
        let header = x.header(&ModelView::default());
        assert_eq!(header.len(), MAX_LEN);
        assert!(header.ends_with("..."));
    }
}
