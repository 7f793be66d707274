//! Ledger tests: the row format, lookups, CAS updates, and the token lifecycle on it.

use super::*;
use crate::core::tokens::{expired, PodTokens, IDLE_PRUNE_MS};
use std::cell::Cell;

#[test]
fn rows_stay_sorted_and_round_trip_through_bytes() {
    let mut rng = fastrand::Rng::with_seed(3);
    let mut l = Ledger::default();
    let mut keys: Vec<String> = (0..300).map(|i| format!("ns{}/pod-{i}", i % 3)).collect();
    rng.shuffle(&mut keys);
    for (i, key) in keys.iter().enumerate() {
        for _ in 0..(i % 4) {
            l.add(key, Counter::Running, 5);
        }
        l.charge_prefill(key, i as f64, 5);
    }
    assert_eq!(l.len(), 300);
    let ids: Vec<u64> = (0..l.len()).map(|i| l.id_at(i)).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "sorted by id");
    let back = Ledger::from_bytes(l.encode()).unwrap();
    assert_eq!(back, l);
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(back.counts_of(key).running, (i % 4) as u32, "{key}");
        assert_eq!(back.pod(key).active, i as f64);
    }
    assert_eq!(back.counts_of("ns9/absent"), Counts::default());
}

#[test]
fn malformed_bytes_are_refused() {
    assert_eq!(
        Ledger::from_bytes(Vec::new()),
        Ok(Ledger::default()),
        "absent is empty"
    );
    assert_eq!(
        Ledger::from_bytes(b"XXXX".to_vec()),
        Err(StoreError::Corrupt)
    );
    let mut l = Ledger::default();
    l.add("ns/a", Counter::Running, 0);
    let mut bytes = l.encode();
    bytes.pop();
    assert_eq!(
        Ledger::from_bytes(bytes),
        Err(StoreError::Corrupt),
        "partial row"
    );
}

#[test]
fn a_corrupt_ledger_fails_one_update_and_is_reset() {
    let store = MemoryStore::default();
    store.set(LOAD_KEY, b"PDL\x09garbage", None).unwrap();
    let charge = |l: &mut Ledger| {
        l.add("ns/a", Counter::Running, 0);
        Ok::<_, StoreError>(())
    };
    assert_eq!(update(&store, charge), Err(StoreError::Corrupt));
    update(&store, charge).expect("the next update works on an empty ledger");
    assert_eq!(read(&store).unwrap().counts_of("ns/a").running, 1);
}

#[test]
fn another_generations_ledger_is_not_this_ones() {
    // A build of another format generation keeps its ledger under another key: its bytes
    // are never read here, and ours never there.
    assert!(LOAD_KEY.contains(&format!("/g{GENERATION}/")), "{LOAD_KEY}");
    assert_eq!(MAGIC[3], GENERATION);
    let store = MemoryStore::default();
    store.set("pd/load", b"PDL\x00older rows", None).unwrap();
    ensure_table(&store).unwrap();
    update(&store, |l| {
        l.add("ns/a", Counter::Running, 0);
        Ok::<_, StoreError>(())
    })
    .unwrap();
    assert_eq!(read(&store).unwrap().counts_of("ns/a").running, 1);
    assert_eq!(
        store.get("pd/load").unwrap().0.as_deref(),
        Some(&b"PDL\x00older rows"[..])
    );
}

#[test]
fn counters_never_go_below_zero_and_namespaces_are_distinct() {
    let mut l = Ledger::default();
    l.add("a/p", Counter::Running, 0);
    l.add("a/p", Counter::PrefillInflight, 0);
    l.add("b/p", Counter::Running, 0);
    assert_ne!(PodId::of("a/p"), PodId::of("b/p"));
    l.release("b/p", Counter::Running, 1);
    l.release("b/p", Counter::Running, 1);
    l.release("c/never", Counter::Running, 1);
    assert_eq!(
        l.counts_of("a/p"),
        Counts {
            prefill_inflight: 1,
            running: 1
        }
    );
    assert_eq!(l.counts_of("b/p"), Counts::default());
    assert_eq!(l.len(), 2, "a release never creates a row");
}

/// A store whose first write loses to another worker's charge, as under real contention.
struct RacingStore {
    inner: MemoryStore,
    raced: Cell<bool>,
}

impl Store for RacingStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        self.inner.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, StoreError> {
        if !self.raced.replace(true) {
            let mut other = Ledger::default();
            other.add("ns/a", Counter::Running, 0);
            let (_, c) = self.inner.get(key)?;
            self.inner.set(key, other.as_bytes(), c)?;
        }
        self.inner.set(key, value, cas)
    }
}

#[test]
fn a_conflicting_write_reruns_the_selection_on_fresh_data() {
    let store = RacingStore {
        inner: MemoryStore::default(),
        raced: Cell::new(false),
    };
    ensure_table(&store.inner).unwrap();
    let mut runs = 0;
    // "Select" the least-running of a and b, then charge it.
    let chosen = update(&store, |l| {
        runs += 1;
        let pick = if l.counts_of("ns/a").running <= l.counts_of("ns/b").running {
            "ns/a"
        } else {
            "ns/b"
        };
        l.add(pick, Counter::Running, 0);
        Ok::<_, StoreError>(pick)
    })
    .unwrap();
    assert_eq!(runs, 2, "the first attempt lost the race");
    assert_eq!(
        chosen, "ns/b",
        "the retry saw the other worker's charge on a"
    );
    let l = read(&store).unwrap();
    assert_eq!(
        (l.counts_of("ns/a").running, l.counts_of("ns/b").running),
        (1, 1)
    );
}

#[test]
fn prefill_lifecycle_tokens_then_kv() {
    let mut t = Ledger::default();
    let mut c = t.charge_prefill("ns/p", 4500.0, 0);
    assert_eq!((t.pod("ns/p").active, t.pod("ns/p").kv), (4500.0, 4500.0));
    assert!((t.pod("ns/p").prefill_load(0.3) - 5850.0).abs() < 1e-9);
    assert!(t.release_tokens(&mut c, 10));
    assert_eq!((t.pod("ns/p").active, t.pod("ns/p").kv), (0.0, 4500.0));
    assert!(!c.is_settled());
    assert!(t.release_kv(&mut c, 20));
    assert!(c.is_settled());
    assert!(t.pod("ns/p").is_zero());
    assert_eq!(t.pod("ns/p").touched_ms, 20);
    // Repeats are no-ops.
    assert!(!t.release_tokens(&mut c, 30));
    assert!(!t.release_kv(&mut c, 30));
    t.release_all(&mut c, 30);
    assert_eq!(t.pod("ns/p").touched_ms, 20);
}

#[test]
fn prefill_lifecycle_kv_before_tokens_and_interleaved() {
    let mut t = Ledger::default();
    let mut a = t.charge_prefill("ns/p", 1000.0, 0);
    let mut b = t.charge_prefill("ns/p", 3000.0, 1);
    assert_eq!((t.pod("ns/p").active, t.pod("ns/p").kv), (4000.0, 4000.0));
    // a's completion arrives before its prefill release.
    t.release_kv(&mut a, 2);
    assert_eq!((t.pod("ns/p").active, t.pod("ns/p").kv), (4000.0, 3000.0));
    t.release_tokens(&mut b, 3);
    assert_eq!((t.pod("ns/p").active, t.pod("ns/p").kv), (1000.0, 3000.0));
    t.release_tokens(&mut a, 4);
    t.release_tokens(&mut a, 4);
    assert_eq!((t.pod("ns/p").active, t.pod("ns/p").kv), (0.0, 3000.0));
    t.release_all(&mut b, 5);
    t.release_all(&mut b, 5);
    assert!(t.pod("ns/p").is_zero());
    assert!(a.is_settled() && b.is_settled());
}

#[test]
fn charges_are_per_pod_and_clamped_at_zero() {
    let mut t = Ledger::default();
    let mut a = t.charge_prefill("ns1/p", 100.0, 0);
    let _b = t.charge_prefill("ns2/p", 200.0, 0);
    assert_eq!(t.pod("ns1/p").active, 100.0);
    assert_eq!(t.pod("ns2/p").active, 200.0, "same name, other namespace");
    // Something else (a janitor force-release, a table reset) already zeroed the row.
    let mut row = t.pod("ns1/p");
    row.release_all(100.0, 1);
    row.release_all(100.0, 1);
    assert!(row.is_zero(), "never below zero");
    t.modify(PodId::of("ns1/p"), |r| r.tokens = row);
    t.release_all(&mut a, 2);
    assert!(t.pod("ns1/p").is_zero());
    // Releasing on a pruned pod does not re-create it.
    assert_eq!(t.prune_idle(2 + IDLE_PRUNE_MS), 1);
    let mut stale = Charge {
        pod: "ns1/p".into(),
        cost: 5.0,
        charged_at_ms: 0,
        tokens_released: false,
        kv_released: false,
    };
    t.release_all(&mut stale, 3 + IDLE_PRUNE_MS);
    assert_eq!(t.len(), 1);
    // Float residue is snapped to exactly zero.
    let mut t = Ledger::default();
    let mut cs: Vec<Charge> = [0.1, 0.2, 0.7]
        .iter()
        .map(|&c| t.charge_prefill("ns/p", c, 0))
        .collect();
    for c in cs.iter_mut() {
        t.release_all(c, 1);
    }
    assert!(t.pod("ns/p").is_zero());
}

#[test]
fn re_acquire_replaces_the_earlier_charge() {
    let mut t = Ledger::default();
    let mut first = t.charge_prefill("ns/a", 1000.0, 0);
    t.release_all(&mut first, 1);
    let second = t.charge_prefill("ns/b", 2000.0, 1);
    assert!(t.pod("ns/a").is_zero());
    assert_eq!(t.pod("ns/b").kv, 2000.0);
    assert_eq!(second.cost, 2000.0);
}

#[test]
fn cas_retry_on_a_cloned_charge_keeps_flags_honest() {
    // A lost CAS round releases on a throwaway table; the request keeps its flags clear
    // and the retry releases for real.
    let mut stored = Ledger::default();
    let mut charge = stored.charge_prefill("ns/p", 500.0, 0);
    let mut lost = stored.clone();
    let mut attempt = charge.clone();
    lost.release_tokens(&mut attempt, 1); // write lost: drop `lost` and `attempt`
    let mut attempt = charge.clone();
    assert!(stored.release_tokens(&mut attempt, 2));
    charge = attempt;
    assert!(charge.tokens_released);
    assert_eq!(stored.pod("ns/p").active, 0.0);
}

#[test]
fn decode_lifecycle_and_generated_tokens() {
    let mut t = Ledger::default();
    let mut a = t.charge_decode("ns/d", 1000, 10_000);
    let mut b = t.charge_decode("ns/d", 500, 12_000);
    let row = t.pod("ns/d");
    assert_eq!((row.decode, row.decode_requests), (1500.0, 2));
    assert_eq!(row.decode_routed_at_sum_ms, 22_000.0);
    // At 14 s: a has run 4 s, b 2 s; at 50 tok/s per request → 300 tokens.
    assert!((row.generated_tokens(50.0, 14_000) - 300.0).abs() < 1e-9);
    assert!((row.decode_load(50.0, 14_000, true) - 1800.0).abs() < 1e-9);
    assert_eq!(row.decode_load(50.0, 14_000, false), 1500.0);
    assert_eq!(row.generated_tokens(0.0, 14_000), 0.0);
    assert_eq!(row.generated_tokens(f64::NAN, 14_000), 0.0);
    // A clock behind the routing times never makes the term negative.
    assert_eq!(row.generated_tokens(50.0, 0), 0.0);
    assert!(t.release_decode(&mut a, 15_000));
    assert!(!t.release_decode(&mut a, 15_000));
    let row = t.pod("ns/d");
    assert_eq!((row.decode, row.decode_requests), (500.0, 1));
    assert!((row.generated_tokens(50.0, 14_000) - 100.0).abs() < 1e-9);
    t.release_decode(&mut b, 16_000);
    let row = t.pod("ns/d");
    assert!(row.is_zero());
    assert_eq!(row.decode_routed_at_sum_ms, 0.0);
    assert_eq!(row.generated_tokens(50.0, 20_000), 0.0);
    // An over-release stays clamped.
    let mut row = row;
    row.release_decode(10.0, 1, 1);
    assert!(row.is_zero());
}

#[test]
fn janitor_expiry() {
    // (charged_at, now, ttl_s, expired)
    let cases = [
        (0, 3_600_000, 3600, false),
        (0, 3_600_001, 3600, true),
        (5_000, 1_000, 3600, false), // clock went backwards
        (0, u64::MAX, 0, false),     // TTL 0: never force-released
    ];
    for (at, now, ttl, want) in cases {
        assert_eq!(expired(at, now, ttl), want, "({at}, {now}, {ttl})");
    }
    let mut t = Ledger::default();
    let mut c = t.charge_prefill("ns/p", 10.0, 0);
    assert!(c.expired(3_600_001, 3600));
    t.release_all(&mut c, 3_600_001);
    assert!(
        !c.expired(3_600_001, 3600),
        "settled charges are not expired again"
    );
    let mut d = t.charge_decode("ns/d", 10, 0);
    assert!(d.expired(3_600_001, 3600));
    t.release_decode(&mut d, 3_600_001);
    assert!(!d.expired(3_600_001, 3600));
}

#[test]
fn prune_idle_drops_only_zero_rows_untouched_for_a_minute() {
    let mut t = Ledger::default();
    let mut a = t.charge_prefill("ns/a", 10.0, 0);
    t.release_all(&mut a, 1_000);
    let _busy = t.charge_prefill("ns/busy", 10.0, 0);
    let _dec = t.charge_decode("ns/dec", 10, 0);
    let mut fresh = t.charge_prefill("ns/fresh", 10.0, 0);
    t.release_all(&mut fresh, 30_000);
    assert_eq!(t.prune_idle(60_999), 0);
    assert_eq!(t.prune_idle(61_000), 1);
    assert_eq!(t.pod("ns/a"), PodTokens::default());
    assert_eq!(t.prune_idle(89_999), 0);
    assert_eq!(t.prune_idle(90_000), 1);
    assert_eq!(t.len(), 2, "loaded pods stay however old");
    // The next charge re-creates a pruned pod from zero.
    let _again = t.charge_prefill("ns/a", 7.0, 100_000);
    assert_eq!(t.pod("ns/a").active, 7.0);
}

/// Row hints follow rows as other rows are inserted before them and pruned (even when the
/// number of rows stays the same), are kept while only counts change, and read the same
/// counts as a lookup by name.
#[test]
fn row_hints_follow_every_moved_row() {
    let keys: Vec<String> = (0..40).map(|i| format!("ns/pod-{i}")).collect();
    let mut order: Vec<(PodId, usize)> = keys
        .iter()
        .enumerate()
        .map(|(slot, k)| (PodId::of(k), slot))
        .collect();
    order.sort_unstable();
    let slots: Vec<usize> = (0..keys.len()).collect();
    let mut ledger = Ledger::default();
    for k in keys.iter().step_by(3) {
        ledger.add(k, Counter::Running, 0);
    }
    let mut hints = RowHints::default();
    // Counts through the hints, and whether reading them rebuilt the hints.
    let mut read = |model: u64, ledger: &Ledger| -> (Vec<u32>, bool) {
        let before = hints.rebuilds();
        let rows_of = hints.prepare(model, ledger, &order);
        let (mut counts, mut rows) = (vec![9; slots.len()], vec![0; slots.len()]);
        rows_of.read_counts(Counter::Running, &slots, &mut counts, &mut rows);
        for (slot, (&count, &row)) in counts.iter().zip(&rows).enumerate() {
            assert_eq!(rows_of.row(slot), (row != NO_ROW).then_some(row as usize));
            if row != NO_ROW {
                assert_eq!(ledger.running_at(row as usize), count);
            }
        }
        (counts, hints.rebuilds() > before)
    };
    let truth = |ledger: &Ledger| -> Vec<u32> {
        keys.iter().map(|k| ledger.counts_of(k).running).collect()
    };
    assert_eq!(read(1, &ledger), (truth(&ledger), true));
    assert_eq!(read(1, &ledger), (truth(&ledger), false), "nothing moved");

    // Counts change in place: the hints stay and read the new values.
    let mut bumped = ledger.clone();
    bumped.add(&keys[3], Counter::Running, 0);
    bumped.add(&keys[6], Counter::Running, 0);
    assert_eq!(read(1, &bumped), (truth(&bumped), false));

    // A pod without a row gets one: its own hint (absent) and the rows after it move.
    let mut changed = ledger.clone();
    changed.add(&keys[1], Counter::Running, 0);
    assert_eq!(read(1, &changed), (truth(&changed), true));
    // A row inserted elsewhere, then one pruned, leaving the count of rows as before.
    let mut same_len = ledger.clone();
    same_len.add("ns/outsider", Counter::Running, 0);
    same_len.release(&keys[0], Counter::Running, 0);
    assert_eq!(same_len.prune_idle(IDLE_PRUNE_MS), 1);
    assert_eq!(same_len.len(), ledger.len());
    assert_eq!(read(1, &same_len), (truth(&same_len), true));
    // Hints of another model are rebuilt, not trusted.
    assert_eq!(read(2, &same_len), (truth(&same_len), true));
    // Every row gone.
    assert_eq!(read(2, &Ledger::default()), (vec![0; keys.len()], true));
}
