//! The Kubernetes source against a fake API server on loopback (`common::kube_api`).
//!
//! Every wait is a poll against a deadline, never a fixed sleep.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pd_control::fleet::PodRecord;
use pd_control::sources::{
    Fleet, FleetPublisher, FleetSource, KubeSettings, KubernetesSource, Shutdown,
};
use pd_control::stats::Stats;
use serde_json::{json, Value};
use tokio::sync::watch;

mod common;
use common::eventually;
use common::kube_api::{adapter, pod, FakeApi};

// ---------------------------------------------------------------------------------------------
// Running the source

struct Running {
    fleet: watch::Receiver<Fleet>,
    stats: Arc<Stats>,
    /// Every fleet published, in order.
    published: Arc<Mutex<Vec<Fleet>>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

fn settings(api: &FakeApi, namespaces: &[&str]) -> KubeSettings {
    let mut s = KubeSettings::new(
        Some(api.url()),
        namespaces.iter().map(|s| s.to_string()).collect(),
    );
    s.backoff_min = Duration::from_millis(10);
    s.backoff_max = Duration::from_millis(200);
    s
}

async fn run_source(api: &FakeApi, namespaces: &[&str]) -> Running {
    let mut source = KubernetesSource::new(settings(api, namespaces));
    let initial = source.load().await.expect("initial list");
    let stats = Arc::new(Stats::default());
    let (tx, fleet) = watch::channel(Arc::new(initial));
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(source.watch(
        FleetPublisher::new(tx, stats.clone()),
        Shutdown::new(stop_rx),
    ));
    let published = Arc::new(Mutex::new(Vec::new()));
    let mut follow = fleet.clone();
    let record = published.clone();
    tokio::spawn(async move {
        while follow.changed().await.is_ok() {
            let current = follow.borrow_and_update().clone();
            record.lock().unwrap().push(current);
        }
    });
    Running {
        fleet,
        stats,
        published,
        stop,
        task,
    }
}

/// `ns/name model ip ready` per pod, plus the config when there is one.
fn view(pods: &[PodRecord]) -> Vec<String> {
    pods.iter()
        .map(|p| {
            let mut s = format!("{} {} {} {}", p.key(), p.model, p.ip, p.ready);
            if !p.config.is_empty() {
                s.push_str(&format!(" {}", p.config));
            }
            s
        })
        .collect()
}

impl Running {
    fn current(&self) -> Vec<String> {
        view(&self.fleet.borrow())
    }

    async fn wait_for(&self, what: &str, expected: &[&str]) {
        eventually(what, || async {
            (self.current() == expected).then_some(())
        })
        .await
    }

    /// Fleets published so far, once the recorder has caught up with the current one.
    async fn publishes(&self) -> usize {
        eventually("the recorder to catch up", || async {
            let published = self.published.lock().unwrap();
            let current = self.fleet.borrow().clone();
            published
                .last()
                .is_some_and(|last| Arc::ptr_eq(last, &current))
                .then_some(published.len())
        })
        .await
    }

    /// Stops the source and checks it never published an empty fleet.
    async fn finish(self) {
        let _ = self.stop.send(true);
        self.task.await.expect("source task");
        let published = self.published.lock().unwrap();
        assert!(
            published.iter().all(|f| !f.is_empty()),
            "an empty fleet was published: {:?}",
            published.iter().map(|f| view(f)).collect::<Vec<_>>()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_adds_readiness_ips_edits_relabels_and_deletes() {
    let api = FakeApi::start().await;
    api.put(pod("ns", "b", "m", Some("10.0.0.2"), false));
    api.put(pod("ns", "a", "m", Some("10.0.0.1"), true));
    let mut stranger = pod("ns", "web", "m", Some("10.0.0.9"), true);
    stranger["metadata"]["labels"] = json!({"app": "web"});
    api.put(stranger);

    let run = run_source(&api, &[]).await;
    assert_eq!(
        run.current(),
        ["ns/a m 10.0.0.1 true", "ns/b m 10.0.0.2 false"],
        "initial list: sorted, unlabelled pods not watched"
    );

    api.put(pod("ns", "c", "m2", None, false));
    run.wait_for(
        "add",
        &[
            "ns/a m 10.0.0.1 true",
            "ns/b m 10.0.0.2 false",
            "ns/c m2  false",
        ],
    )
    .await;

    api.put(pod("ns", "b", "m", Some("10.0.0.2"), true));
    run.wait_for(
        "ready flip",
        &[
            "ns/a m 10.0.0.1 true",
            "ns/b m 10.0.0.2 true",
            "ns/c m2  false",
        ],
    )
    .await;

    api.put(pod("ns", "c", "m2", Some("10.0.0.3"), true));
    api.put(pod("ns", "a", "m", Some("10.0.1.1"), true));
    run.wait_for(
        "IP changes",
        &[
            "ns/a m 10.0.1.1 true",
            "ns/b m 10.0.0.2 true",
            "ns/c m2 10.0.0.3 true",
        ],
    )
    .await;

    let mut a = api.get("ns", "a");
    a["metadata"]["annotations"] = json!({"model.aibrix.ai/config": "{\"p\":1}"});
    api.put(a);
    run.wait_for(
        "annotation edit",
        &[
            "ns/a m 10.0.1.1 true {\"p\":1}",
            "ns/b m 10.0.0.2 true",
            "ns/c m2 10.0.0.3 true",
        ],
    )
    .await;

    // An edit that changes no record publishes nothing (labels are carried, for
    // external-filter selectors; other annotations than the config and the bootstrap port
    // are not).
    let before = run.publishes().await;
    let mut b = api.get("ns", "b");
    b["metadata"]["annotations"]["unrelated"] = json!("x");
    api.put(b);

    let mut c = api.get("ns", "c");
    c["metadata"]["labels"] = json!({"app": "no-longer-a-model"});
    api.put(c);
    run.wait_for(
        "relabel to leave",
        &["ns/a m 10.0.1.1 true {\"p\":1}", "ns/b m 10.0.0.2 true"],
    )
    .await;
    assert_eq!(
        run.publishes().await,
        before + 1,
        "the unrelated edit was not published"
    );

    api.delete("ns", "b");
    run.wait_for("delete", &["ns/a m 10.0.1.1 true {\"p\":1}"])
        .await;
    assert_eq!(run.stats.fleet_reload_errors_total(), 0);
    assert_eq!(api.counts().0, 1, "no re-list was needed");
    run.finish().await;
}

/// A pod being deleted stops being routable at once (as its Endpoints entry goes), though it
/// stays Ready for its grace period; a pod whose containers ended (evicted) leaves the fleet,
/// so its annotation no longer sets its model's configuration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_pods_stop_routing_and_ended_pods_leave() {
    let api = FakeApi::start().await;
    let mut old = pod("ns", "a-old", "m", Some("10.0.0.1"), true);
    old["metadata"]["annotations"] = json!({"model.aibrix.ai/config": "{\"old\":1}"});
    api.put(old);
    api.put(pod("ns", "b", "m", Some("10.0.0.2"), true));
    let run = run_source(&api, &[]).await;
    assert_eq!(
        run.current(),
        [
            "ns/a-old m 10.0.0.1 true {\"old\":1}",
            "ns/b m 10.0.0.2 true"
        ]
    );

    let mut b = api.get("ns", "b");
    b["metadata"]["deletionTimestamp"] = json!("2026-12-06T10:00:00Z");
    api.put(b);
    run.wait_for(
        "terminating",
        &[
            "ns/a-old m 10.0.0.1 true {\"old\":1}",
            "ns/b m 10.0.0.2 false",
        ],
    )
    .await;

    let mut evicted = api.get("ns", "a-old");
    evicted["status"]["phase"] = json!("Failed");
    evicted["status"]["reason"] = json!("Evicted");
    api.put(evicted);
    run.wait_for("evicted", &["ns/b m 10.0.0.2 false"]).await;
    run.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_after_a_dropped_watch_without_relisting() {
    let api = FakeApi::start().await;
    api.put(pod("ns", "a", "m", Some("10.0.0.1"), true));
    let run = run_source(&api, &[]).await;
    eventually("the first watch", || async {
        (api.counts().1 >= 1).then_some(())
    })
    .await;

    for round in 0..4 {
        let watches = api.counts().1;
        if round % 2 == 0 {
            api.drop_watches();
        } else {
            api.break_watches();
        }
        let name = format!("p{round}");
        api.put(pod("ns", &name, "m", Some("10.0.0.5"), true));
        eventually("the pod added around the disconnect", || async {
            run.current()
                .iter()
                .any(|p| p.starts_with(&format!("ns/{name} ")))
                .then_some(())
        })
        .await;
        eventually("a new watch", || async {
            (api.counts().1 > watches).then_some(())
        })
        .await;
    }
    api.delete("ns", "p1");
    run.wait_for(
        "a delete after reconnects",
        &[
            "ns/a m 10.0.0.1 true",
            "ns/p0 m 10.0.0.5 true",
            "ns/p2 m 10.0.0.5 true",
            "ns/p3 m 10.0.0.5 true",
        ],
    )
    .await;
    let (lists, _, gone) = api.counts();
    assert_eq!(
        (lists, gone),
        (1, 0),
        "a dropped or broken watch resumes from its resourceVersion"
    );
    // kube-client treats a body cut mid-chunk like a clean end (its "resumable watch
    // termination"), so neither kind of drop is an error worth counting.
    assert_eq!(run.stats.fleet_reload_errors_total(), 0);
    run.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_forces_a_relist_that_replaces_the_fleet_whole() {
    let api = FakeApi::start().await;
    api.put(pod("ns", "a", "m", Some("10.0.0.1"), true));
    api.put(pod("ns", "b", "m", Some("10.0.0.2"), true));
    let run = run_source(&api, &[]).await;
    eventually("the first watch", || async {
        (api.counts().1 >= 1).then_some(())
    })
    .await;

    // Changes the watch history no longer holds: only a re-list can reveal them.
    api.compact_with(
        vec![
            pod("ns", "b", "m", Some("10.0.9.2"), true),
            pod("ns", "c", "m", Some("10.0.0.3"), true),
        ],
        &[("ns", "a")],
    );
    run.wait_for(
        "the re-listed fleet",
        &["ns/b m 10.0.9.2 true", "ns/c m 10.0.0.3 true"],
    )
    .await;
    let (lists, _, gone) = api.counts();
    assert!(
        gone >= 1 && lists >= 2,
        "410 then re-list: {:?}",
        api.counts()
    );
    assert_eq!(run.stats.fleet_reload_errors_total(), 0, "a 410 is routine");

    // And the watch after the re-list works.
    api.delete("ns", "c");
    run.wait_for("a delete after the re-list", &["ns/b m 10.0.9.2 true"])
        .await;
    run.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_keep_the_last_good_fleet() {
    let api = FakeApi::start().await;
    api.put(pod("ns", "a", "m", Some("10.0.0.1"), true));
    let run = run_source(&api, &[]).await;
    eventually("the first watch", || async {
        (api.counts().1 >= 1).then_some(())
    })
    .await;

    // The watch expires and every re-list fails: the source must hold on to what it has.
    api.fail_lists(true);
    api.compact_with(
        vec![pod("ns", "d", "m", Some("10.0.0.4"), true)],
        &[("ns", "a")],
    );
    eventually("failed re-lists to be reported", || async {
        (run.stats.fleet_reload_errors_total() >= 2).then_some(())
    })
    .await;
    assert_eq!(
        run.current(),
        ["ns/a m 10.0.0.1 true"],
        "last good fleet kept"
    );

    api.fail_lists(false);
    run.wait_for("recovery", &["ns/d m 10.0.0.4 true"]).await;
    run.finish().await;
}

/// A re-list that keeps failing is retried with a growing delay: kube's watcher resets its
/// backoff with the `Init` it yields before each list, which kept every retry at the minimum
/// (several lists a second per scope and replica against an API server in trouble).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_re_lists_back_off() {
    let api = FakeApi::start().await;
    api.put(pod("ns", "a", "m", Some("10.0.0.1"), true));
    let run = run_source(&api, &[]).await;
    run.wait_for("the first fleet", &["ns/a m 10.0.0.1 true"])
        .await;
    eventually("the watch", || async {
        (api.counts().1 >= 1).then_some(())
    })
    .await;
    api.fail_lists(true);
    api.compact_with(vec![pod("ns", "b", "m", Some("10.0.0.2"), true)], &[]);
    eventually("six failed re-lists", || async {
        (api.failed_lists() >= 6).then_some(())
    })
    .await;
    let times = api.failed_list_times();
    // Delays of 10, 20, 40, 80 ms (each between half and all of it), then 160: the sixth list
    // comes at least 80 ms after the fifth, where the minimum alone gave 5-10 ms.
    let gap = times[5].saturating_duration_since(times[4]);
    assert!(
        gap >= Duration::from_millis(80),
        "{gap:?} between the fifth and sixth list"
    );
    api.fail_lists(false);
    run.finish().await;
}

/// `ns/name adapter,adapter` per pod.
fn adapters_view(pods: &[PodRecord]) -> Vec<String> {
    pods.iter()
        .map(|p| format!("{} {}", p.key(), p.adapters.join(",")))
        .collect()
}

/// Waits until the published fleet's pods carry `expected` adapters ([`adapters_view`]).
async fn adapters_become(run: &Running, what: &str, expected: &[&str]) {
    eventually(what, || async {
        (adapters_view(&run.fleet.borrow()) == expected).then_some(())
    })
    .await
}

/// ModelAdapters are watched beside the pods: an adapter's `status.instances` put its name on
/// those pods of its namespace, and follow its edits and deletion; a namespaced watch sees only
/// its namespaces' adapters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_adapters_name_their_pods_and_follow_edits() {
    let api = FakeApi::start().await;
    api.put(pod("llm", "p0", "m", Some("10.0.0.1"), true));
    api.put(pod("llm", "p1", "m", Some("10.0.0.2"), true));
    api.put(adapter("llm", "sql-lora", &["p1"]));
    api.put(adapter("other", "far-lora", &["p0"]));
    let run = run_source(&api, &["llm"]).await;
    adapters_become(
        &run,
        "the listed adapter on p1",
        &["llm/p0 ", "llm/p1 sql-lora"],
    )
    .await;
    api.put(adapter("llm", "sql-lora", &["p0", "p1"]));
    api.put(adapter("llm", "chat-lora", &["p0"]));
    adapters_become(
        &run,
        "an edited and a new adapter",
        &["llm/p0 chat-lora,sql-lora", "llm/p1 sql-lora"],
    )
    .await;
    api.delete_adapter("llm", "sql-lora");
    adapters_become(&run, "a deleted adapter", &["llm/p0 chat-lora", "llm/p1 "]).await;
    assert_eq!(run.stats.fleet_reload_errors_total(), 0);
    run.finish().await;
}

/// A grant to read ModelAdapters revoked after they were read drops their adapters from the
/// pods (they were kept for ever, however the adapters changed meanwhile), and the pods stay
/// routed; once the grant is back, the adapters are read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_that_can_no_longer_be_read_are_dropped() {
    let api = FakeApi::start().await;
    api.put(pod("llm", "p0", "m", Some("10.0.0.1"), true));
    api.put(adapter("llm", "sql-lora", &["p0"]));
    let run = run_source(&api, &[]).await;
    adapters_become(&run, "the listed adapter", &["llm/p0 sql-lora"]).await;
    api.deny_adapters(true);
    // The watches expire and the adapter re-list is refused.
    api.compact_with(vec![pod("llm", "p1", "m", Some("10.0.0.2"), true)], &[]);
    adapters_become(&run, "the adapter dropped", &["llm/p0 ", "llm/p1 "]).await;
    assert_eq!(run.stats.fleet_reload_errors_total(), 0);
    api.deny_adapters(false);
    api.compact_with(vec![pod("llm", "p2", "m", Some("10.0.0.3"), true)], &[]);
    adapters_become(
        &run,
        "the adapter read again",
        &["llm/p0 sql-lora", "llm/p1 ", "llm/p2 "],
    )
    .await;
    run.finish().await;
}

/// Without the grant to read ModelAdapters (or without the CRD), pods load and route as before
/// and no fleet failure is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidden_adapter_watch_leaves_the_pods_routed() {
    let api = FakeApi::start().await;
    api.deny_adapters(true);
    api.put(pod("llm", "p0", "m", Some("10.0.0.1"), true));
    api.put(adapter("llm", "sql-lora", &["p0"]));
    let run = run_source(&api, &[]).await;
    assert_eq!(run.current(), ["llm/p0 m 10.0.0.1 true"]);
    api.put(pod("llm", "p1", "m", Some("10.0.0.2"), true));
    run.wait_for(
        "pods keep following",
        &["llm/p0 m 10.0.0.1 true", "llm/p1 m 10.0.0.2 true"],
    )
    .await;
    assert_eq!(adapters_view(&run.fleet.borrow()), ["llm/p0 ", "llm/p1 "]);
    assert_eq!(run.stats.fleet_reload_errors_total(), 0);
    run.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaces_restrict_the_watch() {
    let api = FakeApi::start().await;
    api.put(pod("one", "z", "m", Some("10.0.0.1"), true));
    api.put(pod("two", "a", "m", Some("10.0.0.2"), true));
    api.put(pod("three", "a", "m", Some("10.0.0.3"), true));
    let run = run_source(&api, &["three", "one"]).await;
    assert_eq!(
        run.current(),
        ["one/z m 10.0.0.1 true", "three/a m 10.0.0.3 true"],
        "only the chosen namespaces, sorted by namespace then name"
    );

    api.put(pod("two", "b", "m", Some("10.0.0.4"), true));
    api.put(pod("three", "b", "m", Some("10.0.0.5"), true));
    run.wait_for(
        "an add in a watched namespace",
        &[
            "one/z m 10.0.0.1 true",
            "three/a m 10.0.0.3 true",
            "three/b m 10.0.0.5 true",
        ],
    )
    .await;
    api.delete("one", "z");
    run.wait_for(
        "a delete in the other watched namespace",
        &["three/a m 10.0.0.3 true", "three/b m 10.0.0.5 true"],
    )
    .await;
    assert!(
        run.published
            .lock()
            .unwrap()
            .iter()
            .all(|f| f.iter().all(|p| p.namespace != "two")),
        "namespace two never leaked in"
    );
    run.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_list_failure_fails_startup() {
    let api = FakeApi::start().await;
    api.fail_lists(true);
    let mut config =
        pd_control::Config::kubernetes(Some(api.url()), "127.0.0.1:0".parse().unwrap());
    config.kube_startup_timeout = Duration::ZERO;
    let error = match pd_control::start(config).await {
        Ok(_) => panic!("started without an initial fleet"),
        Err(e) => e.to_string(),
    };
    assert!(
        error.contains("cannot load the initial fleet from Kubernetes pods labelled")
            && error.contains("initial object list"),
        "unclear error: {error}"
    );

    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut unreachable = KubeSettings::new(Some(format!("http://{closed}")), Vec::new());
    unreachable.startup_timeout = Duration::ZERO;
    let mut source = KubernetesSource::new(unreachable);
    assert!(source.load().await.is_err(), "unreachable API server");

    let mut bad = KubernetesSource::new(KubeSettings::new(Some("not a url".into()), Vec::new()));
    let error = bad.load().await.expect_err("bad URL rejected").to_string();
    assert!(error.contains("--kube-api-url"), "{error}");
}

/// A first list failing for a while (an API server being upgraded) is retried until it
/// succeeds, within `--kube-startup-timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passing_list_failure_at_start_is_retried() {
    let api = FakeApi::start().await;
    api.put(pod("ns", "a", "m", Some("10.0.0.1"), true));
    api.fail_lists(true);
    let mut source = KubernetesSource::new(settings(&api, &[]));
    let load = tokio::spawn(async move { source.load().await.map(|pods| view(&pods)) });
    eventually("two failed lists", || async {
        (api.failed_lists() >= 2).then_some(())
    })
    .await;
    api.fail_lists(false);
    let pods = load.await.unwrap().expect("started once lists answer");
    assert_eq!(pods, ["ns/a m 10.0.0.1 true"]);
}

/// A 403 (no grant) or 401 is no passing state: start-up fails at once, whatever the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidden_first_list_fails_start_up_at_once() {
    let api = FakeApi::start().await;
    api.fail_lists_with(403);
    let mut settings = settings(&api, &[]);
    settings.startup_timeout = Duration::from_secs(3600);
    let mut source = KubernetesSource::new(settings);
    let error = tokio::time::timeout(Duration::from_secs(20), source.load())
        .await
        .expect("failed at once, not retried for the start-up timeout")
        .expect_err("a forbidden list fails start-up");
    assert!(error.to_string().contains("initial object list"), "{error}");
    assert_eq!(api.failed_lists(), 1, "not retried");
}

/// A list the API server never answers (a half-open connection) fails after the read timeout
/// and is retried, rather than freezing the fleet with nothing counted; once lists answer
/// again the fleet catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_re_list_times_out_and_is_retried() {
    let api = FakeApi::start().await;
    api.put(pod("ns", "a", "m", Some("10.0.0.1"), true));
    let mut settings = settings(&api, &[]);
    settings.read_timeout = Duration::from_millis(500);
    settings.watch_timeout_s = 0; // the server's default; the read timeout must not cut watches
    let mut source = KubernetesSource::new(settings);
    let initial = source.load().await.expect("initial list");
    let stats = Arc::new(Stats::default());
    let (tx, fleet) = watch::channel(Arc::new(initial));
    let (_stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(source.watch(
        FleetPublisher::new(tx, stats.clone()),
        Shutdown::new(stop_rx),
    ));
    eventually("the first watch", || async {
        (api.counts().1 >= 1).then_some(())
    })
    .await;
    api.hang_lists(true);
    api.compact_with(vec![pod("ns", "b", "m", Some("10.0.0.2"), true)], &[]);
    eventually("the hung re-list to be counted", || async {
        (stats.fleet_reload_errors_total() >= 1).then_some(())
    })
    .await;
    api.hang_lists(false);
    eventually("the fleet to catch up", || async {
        let pods = view(&fleet.borrow());
        (pods == ["ns/a m 10.0.0.1 true", "ns/b m 10.0.0.2 true"]).then_some(())
    })
    .await;
    task.abort();
}

/// The binary, end to end: `--source kubernetes --kube-api-url` serves the fake server's pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_pods_from_the_api_server() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let api = FakeApi::start().await;
    api.put(pod("prod", "decode-0", "llama", Some("127.0.0.1"), true));
    api.put(pod("prod", "prefill-0", "llama", None, false));
    let exe = env!("CARGO_BIN_EXE_pd-control");

    let out = Command::new(exe)
        .args([
            "--source",
            "kubernetes",
            "--fleet",
            "f.yaml",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "--fleet conflicts with --source kubernetes"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--fleet does not apply"), "{stderr}");

    let mut child = Command::new(exe)
        .args(["--source", "kubernetes", "--kube-api-url", &api.url()])
        .args(["--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let announced = tokio::task::spawn_blocking(move || {
        let mut first = String::new();
        BufReader::new(stdout).read_line(&mut first).unwrap();
        first
    })
    .await
    .unwrap();
    let addr = announced
        .trim()
        .strip_prefix("pd-control: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {announced:?}"))
        .to_string();
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let url = format!("http://{addr}/v1/snapshot.json");
    let pods = eventually("the snapshot to list the API server's pods", || async {
        let body = client.get(&url).send().await.ok()?.bytes().await.ok()?;
        let v: Value = serde_json::from_slice(&body).ok()?;
        let mut names: Vec<String> = v["models"]
            .as_array()?
            .iter()
            .flat_map(|m| m["pods"].as_array().cloned().unwrap_or_default())
            .map(|p| format!("{}/{} {}", p["namespace"], p["name"], p["ready"]))
            .collect();
        names.sort();
        (names.len() == 2).then_some(names)
    })
    .await;
    assert_eq!(
        pods,
        [r#""prod"/"decode-0" true"#, r#""prod"/"prefill-0" false"#]
    );

    api.delete("prod", "prefill-0");
    eventually("the deletion to reach the snapshot", || async {
        let body = client.get(&url).send().await.ok()?.bytes().await.ok()?;
        let v: Value = serde_json::from_slice(&body).ok()?;
        (v["models"][0]["pods"].as_array()?.len() == 1).then_some(())
    })
    .await;
    child.kill().unwrap();
    child.wait().unwrap();
}
