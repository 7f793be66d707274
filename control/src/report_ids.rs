//! Which users of which token report were added, by the id the gateway gives each report
//! (`x-pd-report-id`), so a report sent again (its answer timed out, or Redis took only some
//! of its users) is added once per user, not twice.
//!
//! A report is remembered for [`REMEMBER`], longer than the gateway keeps sending one again
//! (a minute, the span of a TPM counter), and while it is being added a second copy is
//! turned away as busy rather than added beside it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a report's added users are remembered.
pub const REMEMBER: Duration = Duration::from_secs(120);

/// Reports remembered at most; past it (68 reports a second for two minutes) a new report is
/// added without being remembered, so a copy of it could count twice.
pub const MAX_REPORTS: usize = 8192;

/// User names remembered at most over all reports (each report holds up to
/// [`crate::limits::MAX_USAGE_USERS`]): past it a new report is added without being
/// remembered, so the memory stays bounded however many users the reports name.
pub const MAX_NAMES: usize = 65_536;

/// What to do with a report.
#[derive(Debug, PartialEq, Eq)]
pub enum Claim {
    /// Add these users' tokens (those not added before), then [`ReportIds::settle`].
    Add(Vec<(String, i64)>),
    /// A copy of the report is being added right now: answer that it is not done yet.
    Busy,
}

#[derive(Debug)]
struct Entry {
    seen: Instant,
    added: HashSet<String>,
    busy: bool,
}

#[derive(Debug, Default)]
pub struct ReportIds {
    entries: Mutex<Entries>,
}

#[derive(Debug, Default)]
struct Entries {
    by_id: HashMap<String, Entry>,
    /// Ids in the order they were last claimed, with that claim's time: the front expires
    /// first, so expired reports are dropped on every claim without scanning the table. An
    /// id claimed again is queued again; its older places are skipped as stale.
    expiry: VecDeque<(Instant, String)>,
    /// User names held by all entries.
    names: usize,
}

impl Entries {
    /// Drops the reports not claimed within [`REMEMBER`] of `now`. A report still being
    /// added is kept, queued again as seen `now` (so the loop ends).
    fn expire(&mut self, now: Instant) {
        while let Some((seen, _)) = self.expiry.front() {
            if now.duration_since(*seen) < REMEMBER {
                break;
            }
            let Some((seen, id)) = self.expiry.pop_front() else {
                break;
            };
            let Some(entry) = self.by_id.get_mut(&id) else {
                continue;
            };
            if entry.seen != seen {
                // Claimed again since: a later place in the queue stands for it.
                continue;
            }
            if entry.busy {
                entry.seen = now;
                self.expiry.push_back((now, id));
            } else if let Some(e) = self.by_id.remove(&id) {
                self.names = self.names.saturating_sub(e.added.len());
            }
        }
    }
}

impl ReportIds {
    /// Claims report `id` for adding: the users of `usage` it has not added yet.
    pub fn claim(&self, id: &str, usage: &[(String, i64)], now: Instant) -> Claim {
        let mut entries = self.lock();
        entries.expire(now);
        let entries = &mut *entries;
        if !entries.by_id.contains_key(id)
            && (entries.by_id.len() >= MAX_REPORTS || entries.names >= MAX_NAMES)
        {
            return Claim::Add(usage.to_vec());
        }
        let entry = entries
            .by_id
            .entry(id.to_string())
            .or_insert_with(|| Entry {
                seen: now,
                added: HashSet::new(),
                busy: false,
            });
        if entry.busy {
            return Claim::Busy;
        }
        entry.busy = true;
        entry.seen = now;
        let claim = Claim::Add(
            usage
                .iter()
                .filter(|(user, _)| !entry.added.contains(user))
                .cloned()
                .collect(),
        );
        entries.expiry.push_back((now, id.to_string()));
        // An id claimed again and again leaves stale places behind: compacted once they
        // outnumber the live ones, so the queue stays within a small multiple of the table.
        if entries.expiry.len() > 2 * entries.by_id.len() + 16 {
            let by_id = &entries.by_id;
            entries
                .expiry
                .retain(|(seen, id)| by_id.get(id).is_some_and(|e| e.seen == *seen));
        }
        claim
    }

    /// Report `id` is no longer being added; `added` are the users whose tokens were.
    pub fn settle<'a>(&self, id: &str, added: impl Iterator<Item = &'a str>) {
        let mut entries = self.lock();
        let entries = &mut *entries;
        if let Some(entry) = entries.by_id.get_mut(id) {
            entry.busy = false;
            for name in added {
                if entry.added.insert(name.to_string()) {
                    entries.names += 1;
                }
            }
        }
    }

    /// Reports remembered now.
    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        // A panic while holding the lock leaves nothing half-done that matters here.
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(users: &[(&str, i64)]) -> Vec<(String, i64)> {
        users.iter().map(|(u, t)| (u.to_string(), *t)).collect()
    }

    #[test]
    fn a_report_sent_again_adds_only_the_users_not_added() {
        let ids = ReportIds::default();
        let now = Instant::now();
        let report = usage(&[("alice", 5), ("bob", 7)]);
        assert_eq!(ids.claim("vm-1", &report, now), Claim::Add(report.clone()));
        // Redis took alice, not bob.
        ids.settle("vm-1", ["alice"].into_iter());
        assert_eq!(
            ids.claim("vm-1", &report, now),
            Claim::Add(usage(&[("bob", 7)]))
        );
        ids.settle("vm-1", ["bob"].into_iter());
        assert_eq!(ids.claim("vm-1", &report, now), Claim::Add(vec![]));
        ids.settle("vm-1", std::iter::empty());
        // Another report is another id.
        assert_eq!(ids.claim("vm-2", &report, now), Claim::Add(report.clone()));
    }

    #[test]
    fn a_copy_arriving_while_the_first_is_added_is_busy() {
        let ids = ReportIds::default();
        let now = Instant::now();
        let report = usage(&[("alice", 5)]);
        assert!(matches!(ids.claim("r", &report, now), Claim::Add(_)));
        assert_eq!(ids.claim("r", &report, now), Claim::Busy);
        ids.settle("r", std::iter::empty());
        assert_eq!(ids.claim("r", &report, now), Claim::Add(report));
    }

    #[test]
    fn old_reports_make_room_and_a_full_memory_still_adds() {
        let ids = ReportIds::default();
        let start = Instant::now();
        let report = usage(&[("u", 1)]);
        for i in 0..MAX_REPORTS {
            let id = format!("r{i}");
            ids.claim(&id, &report, start);
            ids.settle(&id, ["u"].into_iter());
        }
        // Full, none old: added, not remembered.
        let soon = start + Duration::from_secs(1);
        assert_eq!(ids.claim("new", &report, soon), Claim::Add(report.clone()));
        assert_eq!(ids.len(), MAX_REPORTS);
        // Two minutes on, the old ones go.
        let later = start + REMEMBER + Duration::from_secs(1);
        assert_eq!(ids.claim("new", &report, later), Claim::Add(report.clone()));
        assert_eq!(ids.len(), 1);
    }

    #[test]
    fn expired_reports_are_dropped_on_every_claim() {
        let ids = ReportIds::default();
        let start = Instant::now();
        let report = usage(&[("u", 1)]);
        for i in 0..100 {
            let id = format!("r{i}");
            ids.claim(&id, &report, start);
            ids.settle(&id, ["u"].into_iter());
        }
        assert_eq!(ids.len(), 100);
        let later = start + REMEMBER + Duration::from_secs(1);
        assert_eq!(ids.claim("new", &report, later), Claim::Add(report.clone()));
        assert_eq!(ids.len(), 1);
    }

    #[test]
    fn a_report_claimed_again_and_again_stays_bounded_and_busy_ones_outlive_their_time() {
        let ids = ReportIds::default();
        let start = Instant::now();
        let report = usage(&[("u", 1)]);
        for i in 0..10_000u64 {
            let now = start + Duration::from_millis(i);
            ids.claim("same", &report, now);
            ids.settle("same", ["u"].into_iter());
        }
        let queued = ids.lock().expiry.len();
        assert!(queued <= 2 * ids.len() + 17, "{queued}");
        // Busy past its time: kept, so a copy is still turned away.
        assert!(matches!(ids.claim("slow", &report, start), Claim::Add(_)));
        let later = start + REMEMBER + Duration::from_secs(30);
        assert_eq!(
            ids.claim("other", &report, later),
            Claim::Add(report.clone())
        );
        assert_eq!(ids.claim("slow", &report, later), Claim::Busy);
    }

    #[test]
    fn remembered_names_are_bounded() {
        let ids = ReportIds::default();
        let now = Instant::now();
        let names: Vec<String> = (0..4096).map(|i| format!("u{i}")).collect();
        let report: Vec<(String, i64)> = names.iter().map(|n| (n.clone(), 1)).collect();
        let mut i = 0;
        while ids.lock().names < MAX_NAMES {
            let id = format!("r{i}");
            ids.claim(&id, &report, now);
            ids.settle(&id, names.iter().map(String::as_str));
            i += 1;
        }
        let remembered = ids.len();
        assert_eq!(ids.claim("past", &report, now), Claim::Add(report.clone()));
        assert_eq!(ids.len(), remembered, "added, not remembered");
    }
}
