//! The gateway processes polling this pd-control: which `AIBRIX_TRT_MACHINE_ID` and which
//! filter build each runs.
//!
//! A TensorRT-LLM `disagg_request_id` is the millisecond, the gateway's 10-bit machine id and a
//! 12-bit counter of the process: two gateway processes on one machine id issue the same id
//! for about one pair in 4 096 of the requests they send in the same millisecond, and a worker
//! given one id twice can join one request's KV cache to another's generation (one client's
//! prompt shaping another client's answer). The contract leaves the value to the operator, and
//! every replica of a Deployment gets the same environment, so the mistake is easy and silent.
//! Every gateway polls pd-control, naming its process and machine id
//! (`pd_router_filter::core::engine::trtllm::MACHINE_HEADER`): here two live processes on one
//! id are seen, logged and counted in `pd_control_trt_machine_id_shared_gateways`.
//!
//! The same polls name the filter build (`pd_router_filter::core::build::BUILD_HEADER`): a
//! filter update that reached some gateways only (an image pull that failed on one pod, an
//! ECDS push one Envoy refused) shows as two builds in `pd_control_gateway_builds`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A gateway process that has not polled for this long is gone: a poll is held at most
/// `server::MAX_POLL_WAIT` (30 s), and the next one follows within a tick.
pub const LIVE_FOR: Duration = Duration::from_secs(40);

/// Gateway processes followed at once; a process past the bound is not followed until others
/// leave (the header is the caller's text: fresh ids must not grow the book without bound).
pub const MAX_GATEWAYS: usize = 256;

struct Seen {
    machine: u16,
    /// The filter build it named (`None` for a filter older than the header).
    build: Option<String>,
    at: Instant,
    /// The log last said this process shares its id (logged on each turn only).
    shared: bool,
}

/// The live gateway processes, their machine ids and builds.
#[derive(Default)]
pub struct Gateways {
    seen: Mutex<HashMap<u64, Seen>>,
}

impl Gateways {
    /// Records a poll of gateway process `replica` on `machine` running `build`; logs when it
    /// starts or stops sharing its machine id with another live process.
    pub fn observe(&self, replica: u64, machine: u16, build: Option<&str>, now: Instant) {
        let Ok(mut seen) = self.seen.lock() else {
            return;
        };
        seen.retain(|_, s| now.saturating_duration_since(s.at) <= LIVE_FOR);
        if !seen.contains_key(&replica) && seen.len() >= MAX_GATEWAYS {
            return;
        }
        let others = seen
            .iter()
            .filter(|(id, s)| **id != replica && s.machine == machine)
            .count();
        let entry = seen.entry(replica).or_insert(Seen {
            machine,
            build: None,
            at: now,
            shared: false,
        });
        entry.machine = machine;
        entry.at = now;
        if entry.build.as_deref() != build {
            entry.build = build.map(str::to_string);
        }
        let shared = others > 0;
        if shared != entry.shared {
            entry.shared = shared;
            if shared {
                tracing::warn!(
                    gateway = format!("{replica:016x}"),
                    machine_id = machine,
                    others,
                    "gateway processes share AIBRIX_TRT_MACHINE_ID {machine}: with TensorRT-LLM \
                     pods their disagg_request_ids can collide and a worker can mix two \
                     requests' KV caches; give every gateway process its own value"
                );
            } else {
                tracing::info!(
                    gateway = format!("{replica:016x}"),
                    machine_id = machine,
                    "gateway's AIBRIX_TRT_MACHINE_ID is its own again"
                );
            }
        }
    }

    /// Live gateway processes by the filter build they named (`unknown`: a filter older than
    /// the build header).
    pub fn builds(&self, now: Instant) -> BTreeMap<String, usize> {
        let mut builds = BTreeMap::new();
        let Ok(seen) = self.seen.lock() else {
            return builds;
        };
        for s in seen
            .values()
            .filter(|s| now.saturating_duration_since(s.at) <= LIVE_FOR)
        {
            let build = s.build.clone().unwrap_or_else(|| "unknown".to_string());
            *builds.entry(build).or_default() += 1;
        }
        builds
    }

    /// Live gateway processes whose machine id another live process has too.
    pub fn shared(&self, now: Instant) -> usize {
        let Ok(seen) = self.seen.lock() else {
            return 0;
        };
        let live: Vec<u16> = seen
            .values()
            .filter(|s| now.saturating_duration_since(s.at) <= LIVE_FOR)
            .map(|s| s.machine)
            .collect();
        live.iter()
            .filter(|m| live.iter().filter(|n| n == m).count() > 1)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_processes_on_one_machine_id_are_counted_until_one_leaves_or_changes() {
        let ids = Gateways::default();
        let t0 = Instant::now();
        ids.observe(1, 0, None, t0);
        ids.observe(1, 0, None, t0 + Duration::from_secs(1));
        assert_eq!(ids.shared(t0), 0, "one process polling twice");
        ids.observe(2, 7, None, t0);
        assert_eq!(ids.shared(t0), 0);
        ids.observe(3, 0, None, t0);
        assert_eq!(ids.shared(t0), 2, "1 and 3 on machine id 0");
        ids.observe(3, 5, None, t0);
        assert_eq!(ids.shared(t0), 0, "3 moved to its own id");
        ids.observe(3, 0, None, t0 + Duration::from_secs(2));
        let later = t0 + LIVE_FOR + Duration::from_millis(1500);
        assert_eq!(ids.shared(later), 0, "1 stopped polling: gone");
    }

    #[test]
    fn live_processes_are_counted_by_the_build_they_named() {
        let book = Gateways::default();
        let t0 = Instant::now();
        book.observe(1, 0, Some("0.1.0+aaaa"), t0);
        book.observe(2, 1, Some("0.1.0+aaaa"), t0);
        book.observe(3, 2, Some("0.1.0+bbbb"), t0);
        book.observe(4, 3, None, t0);
        let builds = |at| book.builds(at).into_iter().collect::<Vec<_>>();
        assert_eq!(
            builds(t0),
            [
                ("0.1.0+aaaa".to_string(), 2),
                ("0.1.0+bbbb".to_string(), 1),
                ("unknown".to_string(), 1)
            ]
        );
        // 3 is updated; the others stop polling.
        let later = t0 + LIVE_FOR;
        book.observe(3, 2, Some("0.1.0+aaaa"), later);
        let gone = later + Duration::from_secs(1);
        assert_eq!(builds(gone), [("0.1.0+aaaa".to_string(), 1)]);
    }

    #[test]
    fn the_book_is_bounded() {
        let ids = Gateways::default();
        let t0 = Instant::now();
        for replica in 0..(MAX_GATEWAYS as u64 + 10) {
            ids.observe(replica, 1, None, t0);
        }
        assert_eq!(ids.shared(t0), MAX_GATEWAYS);
    }
}
