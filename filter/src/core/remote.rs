//! The other gateway replicas' decode load: running requests always, decode tokens with the
//! seed's `AIBRIX_TOKEN_LOAD_SHARED_LEDGER`.
//!
//! Each Envoy process reports its own decode ledger to pd-control and gets back the other live
//! replicas' shares summed per pod; selection adds them to the local rows, so several replicas
//! spread decode load as one gateway would. Only decode tokens and running counts travel: the
//! prefill ledger stays local (the seed says so), and the output-growth term of remote
//! requests is not modelled, since their routing times do not travel.
//!
//! The flag governs the `token_load` decode ledger alone (the seed: "`token_load` decode
//! policy only"). The running counts every other policy and the load-imbalance checks read
//! are shared whatever it says, as AIBrix shares them through Redis: an operator who turns
//! the flag off because no model uses `token_load` must not lose the other replicas' load.

use prost::Message;

use crate::core::ledger::{Ledger, PodId, Row};
use crate::proto::{DecodeShare, RemoteShares, ReplicaReport};

/// Remote shares sorted by pod id, ready for a merge pass against a model's `id_order`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RemoteLoad {
    shares: Vec<(u64, f64, u32)>,
    /// Live replicas other than this one.
    pub replicas: u32,
}

impl RemoteLoad {
    /// Decodes pd-control's answer; invalid numbers are dropped rather than trusted.
    pub fn decode(bytes: &[u8]) -> Result<RemoteLoad, prost::DecodeError> {
        let answer = RemoteShares::decode(bytes)?;
        let mut shares: Vec<(u64, f64, u32)> = answer
            .shares
            .into_iter()
            .map(|s| {
                let tokens = if s.decode_tokens.is_finite() && s.decode_tokens > 0.0 {
                    s.decode_tokens
                } else {
                    0.0
                };
                (s.pod_id, tokens, s.running)
            })
            .collect();
        shares.sort_unstable_by_key(|s| s.0);
        Ok(RemoteLoad {
            shares,
            replicas: answer.replicas,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.shares.is_empty()
    }

    /// The shares without their decode tokens (this replica keeps its `token_load` ledger to
    /// itself): running counts only, pods with none left out.
    pub fn running_only(mut self) -> RemoteLoad {
        self.shares.retain(|s| s.2 > 0);
        for share in &mut self.shares {
            share.1 = 0.0;
        }
        self
    }

    /// Sum of the other replicas' running requests over all pods (a gauge).
    pub fn total_running(&self) -> u64 {
        self.shares.iter().map(|s| u64::from(s.2)).sum()
    }

    /// Sum of the other replicas' decode tokens over all pods (a gauge).
    pub fn total_decode_tokens(&self) -> f64 {
        self.shares.iter().map(|s| s.1).sum()
    }

    /// `(decode tokens, running)` the other replicas charged to `id`.
    pub fn get(&self, id: PodId) -> Option<(f64, u32)> {
        self.shares
            .binary_search_by_key(&id.0, |s| s.0)
            .ok()
            .map(|i| (self.shares[i].1, self.shares[i].2))
    }

    /// Adds the shares to `rows` (indexed by slot) in one merge pass over `order`, the
    /// `(id, slot)` list sorted by id that a model keeps.
    pub fn add_to_rows(&self, order: &[(PodId, usize)], rows: &mut [Row]) {
        if self.shares.is_empty() {
            return;
        }
        let mut i = 0usize;
        for &(id, slot) in order {
            while i < self.shares.len() && self.shares[i].0 < id.0 {
                i += 1;
            }
            if i == self.shares.len() {
                break;
            }
            if self.shares[i].0 == id.0 {
                if let Some(row) = rows.get_mut(slot) {
                    add(row, self.shares[i].1, self.shares[i].2);
                }
            }
        }
    }
}

/// Adds one remote share to a local row.
pub fn add(row: &mut Row, decode_tokens: f64, running: u32) {
    row.tokens.decode += decode_tokens;
    row.counts.running = row.counts.running.saturating_add(running);
}

/// This replica's report: every pod it holds decode tokens or running requests on; with
/// `share_decode` false, running requests only (its decode tokens stay its own).
pub fn report(ledger: &Ledger, replica: u64, share_decode: bool) -> ReplicaReport {
    let tokens = |row: &Row| {
        if share_decode {
            row.tokens.decode.max(0.0)
        } else {
            0.0
        }
    };
    let mut shares: Vec<DecodeShare> = ledger
        .iter()
        .filter(|(_, row)| tokens(row) > 0.0 || row.counts.running > 0)
        .map(|(id, row)| DecodeShare {
            pod_id: id.0,
            decode_tokens: tokens(&row),
            running: row.counts.running,
        })
        .collect();
    // In pod order, whatever the ledger's iteration order: an unchanged ledger must encode
    // to the same bytes (the reporter skips reports that would say nothing new).
    shares.sort_unstable_by_key(|s| s.pod_id);
    ReplicaReport { replica, shares }
}

/// Whether the lease holder sends its report at this tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportDue {
    No,
    /// The ledger changed and other replicas read it: send now, and keep ticking fast.
    News,
    /// Unchanged, or nobody to tell: the heartbeat that keeps this replica (and its view of
    /// the others) from ageing out.
    Heartbeat,
}

/// Decides on a report from the last one sent (`(body, at_ms)`) and the report `body` the
/// ledger gives now. Changes go out at once while pd-control counts `other_replicas`; an
/// idle replica (its ledger does not change) routes nothing on the others' shares it then
/// refreshes less often, and a lone one (the usual single gateway) has nobody to tell, so
/// both report only every `heartbeat_ms`. A replica that appears sees the lone one's load
/// within a heartbeat, and the lone one learns of it from its next answer.
pub fn report_due(
    last: Option<(&[u8], u64)>,
    body: &[u8],
    other_replicas: u32,
    now_ms: u64,
    heartbeat_ms: u64,
) -> ReportDue {
    let Some((last, at_ms)) = last else {
        return ReportDue::Heartbeat;
    };
    if last != body && other_replicas > 0 {
        ReportDue::News
    } else if now_ms >= at_ms.saturating_add(heartbeat_ms) {
        ReportDue::Heartbeat
    } else {
        ReportDue::No
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ledger::Counter;

    fn answer(shares: &[(&str, f64, u32)], replicas: u32) -> Vec<u8> {
        RemoteShares {
            shares: shares
                .iter()
                .map(|(k, t, r)| DecodeShare {
                    pod_id: PodId::of(k).0,
                    decode_tokens: *t,
                    running: *r,
                })
                .collect(),
            replicas,
        }
        .encode_to_vec()
    }

    #[test]
    fn shares_land_on_the_slots_of_their_pods() {
        let remote = RemoteLoad::decode(&answer(
            &[
                ("ns/d0", 500.0, 2),
                ("ns/gone", 9.0, 9),
                ("ns/d1", f64::NAN, 1),
            ],
            2,
        ))
        .unwrap();
        let mut order: Vec<(PodId, usize)> = ["ns/d0", "ns/d1", "ns/d2"]
            .iter()
            .enumerate()
            .map(|(slot, k)| (PodId::of(k), slot))
            .collect();
        order.sort_unstable();
        let mut rows = vec![Row::default(); 3];
        rows[0].tokens.decode = 100.0;
        rows[0].counts.running = 1;
        remote.add_to_rows(&order, &mut rows);
        assert_eq!((rows[0].tokens.decode, rows[0].counts.running), (600.0, 3));
        assert_eq!(
            (rows[1].tokens.decode, rows[1].counts.running),
            (0.0, 1),
            "a NaN share counts as no tokens"
        );
        assert_eq!(rows[2], Row::default());
        assert_eq!(remote.replicas, 2);
        assert_eq!(remote.get(PodId::of("ns/gone")), Some((9.0, 9)));
    }

    #[test]
    fn the_report_carries_decode_load_only() {
        let mut ledger = Ledger::default();
        ledger.add("ns/p0", Counter::PrefillInflight, 0);
        ledger.charge_prefill("ns/p0", 4000.0, 0);
        ledger.add("ns/d0", Counter::Running, 0);
        ledger.charge_decode("ns/d0", 700, 0);
        let r = report(&ledger, 42, true);
        assert_eq!(r.replica, 42);
        assert_eq!(
            r.shares,
            vec![DecodeShare {
                pod_id: PodId::of("ns/d0").0,
                decode_tokens: 700.0,
                running: 1
            }]
        );
    }

    #[test]
    fn without_the_shared_ledger_running_counts_still_travel_but_decode_tokens_do_not() {
        let mut ledger = Ledger::default();
        ledger.add("ns/d0", Counter::Running, 0);
        ledger.charge_decode("ns/d0", 700, 0);
        // Tokens left from a request whose count is already released: nothing to report.
        ledger.charge_decode("ns/d1", 300, 0);
        let r = report(&ledger, 42, false);
        assert_eq!(
            r.shares,
            vec![DecodeShare {
                pod_id: PodId::of("ns/d0").0,
                decode_tokens: 0.0,
                running: 1
            }]
        );

        let remote = RemoteLoad::decode(&answer(&[("ns/d0", 500.0, 2), ("ns/d1", 80.0, 0)], 1))
            .unwrap()
            .running_only();
        assert_eq!(remote.get(PodId::of("ns/d0")), Some((0.0, 2)));
        assert_eq!(remote.get(PodId::of("ns/d1")), None);
        assert_eq!(remote.total_decode_tokens(), 0.0);
        assert_eq!(remote.total_running(), 2);
        assert_eq!(remote.replicas, 1);
    }

    #[test]
    fn changes_are_reported_at_once_only_when_another_replica_reads_them() {
        let (a, b) = (&b"load a"[..], &b"load b"[..]);
        assert_eq!(report_due(None, a, 0, 5, 1_000), ReportDue::Heartbeat);
        // Alone: a changed ledger waits for the heartbeat.
        assert_eq!(report_due(Some((a, 100)), b, 0, 600, 1_000), ReportDue::No);
        assert_eq!(
            report_due(Some((a, 100)), b, 0, 1_100, 1_000),
            ReportDue::Heartbeat
        );
        // With others: changes go out at once, unchanged load on the heartbeat.
        assert_eq!(
            report_due(Some((a, 100)), b, 2, 101, 1_000),
            ReportDue::News
        );
        assert_eq!(report_due(Some((a, 100)), a, 2, 600, 1_000), ReportDue::No);
        assert_eq!(
            report_due(Some((a, 100)), a, 2, 1_100, 1_000),
            ReportDue::Heartbeat
        );
    }

    #[test]
    fn the_same_load_reports_the_same_bytes_whatever_the_insertion_order() {
        let pods = ["ns/d0", "ns/d1", "ns/d2", "ns/d3", "ns/d4", "ns/d5"];
        let mut forward = Ledger::default();
        for (i, pod) in pods.iter().enumerate() {
            forward.add(pod, Counter::Running, 0);
            forward.charge_decode(pod, 100 * (i as u64 + 1), 0);
        }
        let mut backward = Ledger::default();
        for (i, pod) in pods.iter().enumerate().rev() {
            backward.add(pod, Counter::Running, 0);
            backward.charge_decode(pod, 100 * (i as u64 + 1), 0);
        }
        let r = report(&forward, 7, true);
        assert!(r.shares.windows(2).all(|w| w[0].pod_id < w[1].pod_id));
        assert_eq!(
            r.encode_to_vec(),
            report(&backward, 7, true).encode_to_vec()
        );
        let decoded = Ledger::decode(&forward.encode()).unwrap();
        assert_eq!(report(&decoded, 7, true).encode_to_vec(), r.encode_to_vec());
    }

    #[test]
    fn the_overlay_is_read_by_selection_but_never_written_back() {
        let mut ledger = Ledger::default();
        ledger.add("ns/d0", Counter::Running, 0);
        let bytes_before = ledger.encode();
        let remote = RemoteLoad::decode(&answer(&[("ns/d0", 300.0, 4)], 1)).unwrap();
        ledger.set_remote(Some(std::sync::Arc::new(remote)));
        assert_eq!(ledger.counts(PodId::of("ns/d0")).running, 5);
        let order = vec![(PodId::of("ns/d0"), 0)];
        let rows = ledger.rows_for(&order, 1);
        assert_eq!((rows[0].tokens.decode, rows[0].counts.running), (300.0, 5));
        assert_eq!(
            ledger.encode(),
            bytes_before,
            "remote load is not local load"
        );
        assert_eq!(ledger.pod("ns/d0").decode, 0.0, "gauges show local load");
    }
}
