//! Where a request's time goes inside the VM, for `make profile-sections`: wall time of each
//! callback and of the steps inside them (host calls included), per request, per worker.
//! Only in builds with the `sections` feature; the [`section!`](crate::section) macro is the
//! bare expression otherwise. Wall time is what Envoy's worker spends in the call, so on a
//! loaded box it includes preemption: compare sections, and builds, in one sitting.

use std::cell::RefCell;

/// Requests between two log lines (per worker).
const REPORT_EVERY: u64 = 2_000;

#[derive(Default)]
struct Tally {
    /// (section, total ns, calls), in first-seen order.
    sections: Vec<(&'static str, u64, u64)>,
    requests: u64,
}

thread_local! {
    static TALLY: RefCell<Tally> = RefCell::new(Tally::default());
}

pub fn start() -> u128 {
    crate::host::now_ns()
}

pub fn record(name: &'static str, started: u128) {
    let ns = crate::host::now_ns().saturating_sub(started) as u64;
    TALLY.with(|t| {
        let mut t = t.borrow_mut();
        match t.sections.iter_mut().find(|(n, _, _)| *n == name) {
            Some(entry) => {
                entry.1 += ns;
                entry.2 += 1;
            }
            None => t.sections.push((name, ns, 1)),
        }
    });
}

/// Counts one finished request; every [`REPORT_EVERY`] logs µs per request of each section
/// (and calls per request where a section runs more or less than once) and starts over.
pub fn request_done() {
    TALLY.with(|t| {
        let mut t = t.borrow_mut();
        t.requests += 1;
        if t.requests < REPORT_EVERY {
            return;
        }
        let n = t.requests as f64;
        let mut line = format!("sections over {} requests:", t.requests);
        for (name, ns, calls) in &t.sections {
            line += &format!(" {name}={:.1}", *ns as f64 / n / 1000.0);
            if *calls != t.requests {
                line += &format!("(x{:.2})", *calls as f64 / n);
            }
        }
        log::warn!("{line}");
        *t = Tally::default();
    });
}

/// Times the rest of a block (see [`section_scope!`](crate::section_scope)).
pub struct Scope {
    name: &'static str,
    started: u128,
}

impl Scope {
    pub fn new(name: &'static str) -> Scope {
        Scope {
            name,
            started: start(),
        }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        record(self.name, self.started);
    }
}
