//! A snapshot adopted by replacing metrics must route exactly as the same snapshot decoded
//! in full: the views are compared field by field over random fleets and random edits.

use std::rc::Rc;

use proptest::prelude::*;
use prost::Message;

use super::*;

/// Everything a view routes on, in a form two views can be compared by (maps sorted, the
/// per-view uid left out).
fn shape(view: &FleetView) -> String {
    let mut models: Vec<_> = view.models.iter().collect();
    models.sort_by(|a, b| a.0.cmp(b.0));
    let mut out = format!("version {}\n", view.version);
    for (name, m) in models {
        let mut by_key: Vec<_> = m.prefill_by_key.iter().collect();
        by_key.sort();
        out += &format!(
            "{name}: pods {:?}\nrolesets {:?}\nothers {:?}\nconfig {:?}\ntotal {}\nids {:?}\n\
             columns {:?}\nby_key {by_key:?}\n",
            m.pods, m.rolesets, m.others, m.config, m.total_pods, m.id_order, m.columns
        );
    }
    let mut addresses: Vec<_> = view.addresses.iter().collect();
    addresses.sort();
    out + &format!("addresses {addresses:?}")
}

fn metrics_strategy() -> impl Strategy<Value = Option<proto::PodMetrics>> {
    prop::option::of(
        (any::<bool>(), 0u8..4, 0u8..3, 0u8..3, any::<bool>()).prop_map(
            |(present, running, usage, throughput, stale)| proto::PodMetrics {
                present,
                running: f64::from(running),
                kv_cache_usage: f64::from(usage) / 4.0,
                generation_throughput: f64::from(throughput) * 100.0,
                drain_rate: f64::from(running) / 2.0,
                ttft_avg_seconds: f64::from(usage) / 10.0,
                last_scrape_unix_ms: i64::from(running),
                stale,
                ..Default::default()
            },
        ),
    )
}

fn pod_strategy() -> impl Strategy<Value = proto::Pod> {
    (
        0u8..6,
        prop::sample::select(vec!["prefill", "decode", "", "worker"]),
        0u8..3,
        any::<bool>(),
        metrics_strategy(),
    )
        .prop_map(|(n, role, roleset, ready, metrics)| {
            let mut p = tests::pod(&format!("pod{n}"), role, &format!("g{roleset}"), ready);
            p.ip = format!("127.0.0.{n}");
            p.metrics = metrics;
            p
        })
}

fn fleet_strategy() -> impl Strategy<Value = proto::Snapshot> {
    prop::collection::vec(
        (
            prop::sample::select(vec!["a", "b"]),
            prop::collection::vec(pod_strategy(), 0..7),
        ),
        1..3,
    )
    .prop_map(|models| proto::Snapshot {
        version: 1,
        generated_unix_ms: 5,
        user_limits: false,
        eds: false,
        external_router: None,
        models: models
            .into_iter()
            .map(|(name, pods)| proto::Model {
                name: name.into(),
                pods,
                labels: None,
            })
            .collect(),
    })
}

/// Whether `view` reuses `previous`'s pods (the metrics-only path was taken).
fn shares_pods(view: &FleetView, previous: &FleetView) -> bool {
    view.models.iter().any(|(name, m)| {
        m.pods.first().is_some_and(|p| {
            previous.models[name]
                .pods
                .first()
                .is_some_and(|q| Rc::ptr_eq(&p.info, &q.info))
        })
    })
}

proptest! {
    #[test]
    fn new_metrics_on_the_same_pods_adopt_as_a_full_decode_would(
        before in fleet_strategy(),
        metrics in prop::collection::vec(metrics_strategy(), 64),
        version in 2u64..100,
    ) {
        let mut after = before.clone();
        after.version = version;
        after.generated_unix_ms = 9;
        for (i, p) in after.models.iter_mut().flat_map(|m| &mut m.pods).enumerate() {
            p.metrics = metrics[i % metrics.len()];
        }
        let previous = FleetView::decode(&before.encode_to_vec()).unwrap();
        let bytes = after.encode_to_vec();
        let refreshed = FleetView::decode_after(&bytes, Some(&previous)).unwrap();
        let full = FleetView::decode(&bytes).unwrap();
        prop_assert_eq!(shape(&refreshed), shape(&full));
        prop_assert_eq!(refreshed.version, version);
        prop_assert!(refreshed.same_topology(&previous) && full.same_topology(&previous));
        let any_pod = previous.models.values().any(|m| !m.pods.is_empty());
        prop_assert_eq!(shares_pods(&refreshed, &previous), any_pod);
        for (name, m) in &refreshed.models {
            prop_assert_ne!(m.uid, previous.models[name].uid, "per-view caches reset");
        }
    }

    #[test]
    fn any_other_change_decodes_in_full(
        before in fleet_strategy(),
        after in fleet_strategy(),
    ) {
        let previous = FleetView::decode(&before.encode_to_vec()).unwrap();
        let bytes = after.encode_to_vec();
        let adopted = FleetView::decode_after(&bytes, Some(&previous)).unwrap();
        prop_assert_eq!(shape(&adopted), shape(&FleetView::decode(&bytes).unwrap()));
        let same = scan::Scan::of(&before.encode_to_vec()).unwrap().topology
            == scan::Scan::of(&bytes).unwrap().topology;
        prop_assert_eq!(adopted.same_topology(&previous), same);
    }
}

#[test]
fn a_view_without_bytes_behind_it_is_never_refreshed() {
    let snap = tests::snapshot(vec![tests::pod("p0", "prefill", "g0", true)]);
    let built = FleetView::from_snapshot(&snap);
    let decoded = FleetView::decode_after(&snap.encode_to_vec(), Some(&built)).unwrap();
    assert!(!shares_pods(&decoded, &built));
    assert!(!built.same_topology(&decoded), "no bytes, no topology");
    assert_eq!(shape(&decoded), shape(&built));
    // Nor is a copy derived from a decoded view (stale metrics, ejected pods).
    let bytes = snap.encode_to_vec();
    for derived in [decoded.with_stale_metrics(), decoded.without_pods(|_| true)] {
        let again = FleetView::decode_after(&bytes, Some(&derived)).unwrap();
        assert!(!shares_pods(&again, &derived));
        assert!(!derived.same_topology(&again));
    }
    let refreshed = FleetView::decode_after(&bytes, Some(&decoded)).unwrap();
    assert!(shares_pods(&refreshed, &decoded));
}
