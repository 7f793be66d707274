//! Which users of which token report were added, by the id the gateway gives each report
//! (`x-pd-report-id`), so a report sent again (its answer timed out, or Redis took only some
//! of its users) is added once per user, not twice.
//!
//! A report is remembered for [`REMEMBER`], longer than the gateway keeps sending one again
//! (a minute, the span of a TPM counter), and while it is being added a second copy is
//! turned away as busy rather than added beside it.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a report's added users are remembered.
pub const REMEMBER: Duration = Duration::from_secs(120);

/// Reports remembered at most; past it (68 reports a second for two minutes) a new report is
/// added without being remembered, so a copy of it could count twice.
pub const MAX_REPORTS: usize = 8192;

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
    entries: Mutex<HashMap<String, Entry>>,
}

impl ReportIds {
    /// Claims report `id` for adding: the users of `usage` it has not added yet.
    pub fn claim(&self, id: &str, usage: &[(String, i64)], now: Instant) -> Claim {
        let mut entries = self.lock();
        if !entries.contains_key(id) && entries.len() >= MAX_REPORTS {
            entries.retain(|_, e| e.busy || now.duration_since(e.seen) < REMEMBER);
            if entries.len() >= MAX_REPORTS {
                return Claim::Add(usage.to_vec());
            }
        }
        let entry = entries.entry(id.to_string()).or_insert_with(|| Entry {
            seen: now,
            added: HashSet::new(),
            busy: false,
        });
        if entry.busy {
            return Claim::Busy;
        }
        entry.busy = true;
        entry.seen = now;
        Claim::Add(
            usage
                .iter()
                .filter(|(user, _)| !entry.added.contains(user))
                .cloned()
                .collect(),
        )
    }

    /// Report `id` is no longer being added; `added` are the users whose tokens were.
    pub fn settle<'a>(&self, id: &str, added: impl Iterator<Item = &'a str>) {
        if let Some(entry) = self.lock().get_mut(id) {
            entry.busy = false;
            entry.added.extend(added.map(str::to_string));
        }
    }

    /// Reports remembered now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
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
}
