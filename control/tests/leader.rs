//! `--leader-elect` end to end: real `pd-control` processes contending for a Lease on the fake
//! API server (`common::kube_api`), each through its own door so one can be cut off alone.
//!
//! Timings are short (lease 3 s, retry 200 ms) so takeovers happen within
//! the tests' deadline; every wait is a poll, and no assertion is on how long anything took.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::envoy::service::endpoint::v3::endpoint_discovery_service_client::EndpointDiscoveryServiceClient;
use serde_json::{json, Value};

mod common;
use common::kube_api::{pod, Door, FakeApi, Fault, LeaseWrite};
use common::{eventually, metric};

const NS: &str = "pd-router";
const LEASE: &str = "pd-control";
const LABEL: &str = "pd-router.io/pd-control-leader";
const REPLICAS: [&str; 2] = ["pc-a", "pc-b"];

/// A pd-control replica's own pod: no model label, so the fleet watch does not see it.
fn replica_pod(name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": NS, "name": name, "labels": {"app": "pd-control"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "podIP": "127.0.0.1"},
    })
}

/// The fake with both replicas' pods and one (unscheduled, so never scraped) model pod.
async fn cluster() -> FakeApi {
    let api = FakeApi::start().await;
    for name in REPLICAS {
        api.put(replica_pod(name));
    }
    api.put(pod("llm", "decode-0", "llama", None, false));
    api
}

/// A loopback address nothing listens on now.
fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").to_string()
}

/// An EDS stream to `addr` with its subscription sent, as a gateway's retrying cluster opens
/// it: the request sender (kept to hold the stream open) and the responses, or the status
/// the stream was refused with.
async fn eds_stream(
    addr: &str,
) -> Result<
    (
        tokio::sync::mpsc::Sender<DiscoveryRequest>,
        tonic::Streaming<DiscoveryResponse>,
    ),
    String,
> {
    let mut client = EndpointDiscoveryServiceClient::connect(format!("http://{addr}"))
        .await
        .map_err(|e| e.to_string())?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let subscribe = DiscoveryRequest {
        node: Some(envoy_types::pb::envoy::config::core::v3::Node {
            id: "gw-1".into(),
            ..Default::default()
        }),
        resource_names: vec!["pd_pods_retry".into()],
        type_url: pd_control::xds::EDS_TYPE_URL.into(),
        ..Default::default()
    };
    tx.send(subscribe).await.expect("queued");
    let stream = client
        .stream_endpoints(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    Ok((tx, stream))
}

/// A raw HTTP/2 connection to `addr` with the client's preface and SETTINGS sent, as a
/// gateway's gRPC channel holds it between streams.
async fn open_h2_connection(addr: &str) -> std::net::TcpStream {
    use std::io::Write;
    let addr = addr.to_string();
    tokio::task::spawn_blocking(move || {
        let mut conn = std::net::TcpStream::connect(&addr).expect("connect");
        conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            .expect("preface");
        conn
    })
    .await
    .expect("open")
}

/// Whether the server closes `conn` (end of stream or an error), reading whatever frames it
/// sends meanwhile; `false` if it is still open after the tests' deadline.
async fn connection_closes(mut conn: std::net::TcpStream) -> bool {
    use std::io::Read;
    tokio::task::spawn_blocking(move || {
        conn.set_read_timeout(Some(common::DEADLINE))
            .expect("timeout");
        let mut buf = [0u8; 4096];
        loop {
            match conn.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return false
                }
                Err(_) => return true,
            }
        }
    })
    .await
    .expect("read")
}

/// Whether a new HTTP/2 connection to `addr` is closed by the server.
async fn closes_h2_connection(addr: &str) -> bool {
    connection_closes(open_h2_connection(addr).await).await
}

/// One running `pd-control --leader-elect`, killed when dropped.
struct Replica {
    identity: &'static str,
    child: Child,
    base: String,
    client: reqwest::Client,
}

impl Replica {
    async fn start(door: &Door, identity: &'static str) -> Replica {
        Replica::start_with(door, identity, &[]).await
    }

    async fn start_with(door: &Door, identity: &'static str, extra: &[&str]) -> Replica {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pd-control"))
            .args(["--source", "kubernetes", "--kube-api-url", &door.url()])
            .args(extra)
            .args(["--listen", "127.0.0.1:0", "--leader-elect"])
            .args(["--leader-elect-namespace", NS])
            .args(["--leader-elect-identity", identity])
            .args(["--leader-elect-lease-duration", "3s"])
            .args(["--leader-elect-retry-period", "200ms"])
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE")
            .env(
                "RUST_LOG",
                std::env::var("PD_TEST_LOG").unwrap_or_else(|_| "warn,kube_client=off".into()),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn pd-control");
        let stdout = child.stdout.take().expect("piped stdout");
        let announced = tokio::task::spawn_blocking(move || {
            let mut first = String::new();
            BufReader::new(stdout).read_line(&mut first).map(|_| first)
        })
        .await
        .expect("reader task")
        .expect("pd-control's first line");
        let addr = announced
            .trim()
            .strip_prefix("pd-control: listening on ")
            .unwrap_or_else(|| panic!("{identity}: unexpected first line {announced:?}"))
            .to_string();
        Replica {
            identity,
            child,
            base: format!("http://{addr}"),
            client: reqwest::Client::builder().no_proxy().build().unwrap(),
        }
    }

    /// `/readyz`'s status and body; `None` while it does not answer.
    async fn readyz(&self) -> Option<(u16, String)> {
        let response = self
            .client
            .get(format!("{}/readyz", self.base))
            .send()
            .await
            .ok()?;
        let code = response.status().as_u16();
        Some((code, response.text().await.ok()?))
    }

    /// The head of a snapshot answer on a fresh connection, and whether the replica closed
    /// that connection after it: the head must say `connection: close`, and the next read
    /// must then see the end (within the tests' deadline, failing rather than hanging).
    async fn snapshot_exchange(&self) -> (String, bool) {
        use std::io::{Read, Write};
        let addr = self.base.trim_start_matches("http://").to_string();
        tokio::task::spawn_blocking(move || {
            let mut conn = std::net::TcpStream::connect(&addr).expect("connect");
            conn.set_read_timeout(Some(common::DEADLINE))
                .expect("timeout");
            conn.write_all(b"GET /v1/snapshot.json HTTP/1.1\r\nhost: pd-control\r\n\r\n")
                .expect("request");
            let mut seen = Vec::new();
            let mut buf = [0u8; 8192];
            let head = loop {
                let n = conn.read(&mut buf).expect("read");
                assert!(n > 0, "closed before a whole answer");
                seen.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&seen).to_string();
                let Some((head, body)) = text.split_once("\r\n\r\n") else {
                    continue;
                };
                let length = head.lines().find_map(|l| {
                    let l = l.to_ascii_lowercase();
                    l.strip_prefix("content-length:")?
                        .trim()
                        .parse::<usize>()
                        .ok()
                });
                if length.is_some_and(|len| body.len() >= len) {
                    break head.to_string();
                }
            };
            if !head.to_ascii_lowercase().contains("connection: close") {
                return (head, false);
            }
            let closed = matches!(conn.read(&mut buf), Ok(0));
            (head, closed)
        })
        .await
        .expect("exchange")
    }

    async fn ready(&self) -> bool {
        self.readyz().await.is_some_and(|(code, _)| code == 200)
    }

    async fn metric(&self, name: &str) -> f64 {
        metric(&self.base, name).await
    }

    /// SIGTERM, as the kubelet stops a container.
    fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {}", self.child.id());
    }

    /// Waits for the process to exit; whether it exited cleanly.
    async fn exited(&mut self) -> bool {
        let child = &mut self.child;
        let status = eventually("pd-control to exit", || {
            let status = child.try_wait().expect("try_wait");
            async move { status }
        })
        .await;
        status.success()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Which of `replicas` leads once the election settled: one pod labelled "true", the others
/// "false", the Lease naming the labelled one, every replica ready, and `pd_control_leader`
/// 1 on the leader alone.
async fn settled(api: &FakeApi, replicas: &[&Replica]) -> usize {
    eventually(
        "one leader, labelled, the others standby and all ready",
        || async {
            let labels: Vec<Option<String>> = replicas
                .iter()
                .map(|r| api.label(NS, r.identity, LABEL))
                .collect();
            let leaders: Vec<usize> = (0..replicas.len())
                .filter(|i| labels[*i].as_deref() == Some("true"))
                .collect();
            let [leader] = leaders[..] else { return None };
            let others_standby = (0..replicas.len())
                .filter(|i| *i != leader)
                .all(|i| labels[i].as_deref() == Some("false"));
            if !others_standby
                || api.lease_holder(NS, LEASE).as_deref() != Some(replicas[leader].identity)
            {
                return None;
            }
            for (i, r) in replicas.iter().enumerate() {
                let expected = if i == leader { 1.0 } else { 0.0 };
                if !r.ready().await || r.metric("pd_control_leader").await != expected {
                    return None;
                }
            }
            Some(leader)
        },
    )
    .await
}

/// Waits until `replica` leads as the Service sees it: its pod labelled "true", the Lease
/// naming it, and its own `pd_control_leader` at 1.
async fn wait_leads(api: &FakeApi, replica: &Replica, what: &str) {
    eventually(what, || async {
        let labelled = api.label(NS, replica.identity, LABEL).as_deref() == Some("true");
        let holds = api.lease_holder(NS, LEASE).as_deref() == Some(replica.identity);
        (labelled && holds && replica.metric("pd_control_leader").await == 1.0).then_some(())
    })
    .await
}

/// In `writes`, a release (a PUT with no holder) before `holder`'s takeover: the positions of
/// both (a takeover after expiry alone has no release before it).
fn released_then_taken(writes: &[LeaseWrite], holder: &str) -> (usize, usize) {
    let released = writes
        .iter()
        .position(|w| w.verb == "replace" && w.holder.is_none())
        .unwrap_or_else(|| panic!("no release among {writes:?}"));
    let taken = writes
        .iter()
        .position(|w| w.holder.as_deref() == Some(holder))
        .unwrap_or_else(|| panic!("no takeover among {writes:?}"));
    assert!(released < taken, "release then takeover: {writes:?}");
    (released, taken)
}

fn transitions(api: &FakeApi) -> i64 {
    api.lease(NS, LEASE).expect("the lease")["spec"]["leaseTransitions"]
        .as_i64()
        .unwrap_or(0)
}

/// Two replicas: one leads, the other stands by, both ready. SIGTERM to the leader withdraws
/// its label and releases the Lease, and the standby takes it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_leads_and_a_terminated_leader_hands_over() {
    let api = cluster().await;
    let a = Replica::start(&api.door().await, "pc-a").await;
    let b = Replica::start(&api.door().await, "pc-b").await;
    let mut replicas = [a, b];
    let leader = settled(&api, &[&replicas[0], &replicas[1]]).await;
    let standby = 1 - leader;
    let (leader_id, standby_id) = (replicas[leader].identity, replicas[standby].identity);
    assert_eq!(
        replicas[leader]
            .metric("pd_control_leader_acquisitions_total")
            .await,
        1.0
    );
    assert_eq!(
        replicas[standby]
            .metric("pd_control_leader_acquisitions_total")
            .await,
        0.0
    );
    // The standby answers a gateway's call, then closes the connection, so the gateway's
    // next one goes through the Service to the leader; the leader keeps it alive.
    let (head, closed) = replicas[standby].snapshot_exchange().await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(closed, "the standby closes after its answer: {head}");
    let (head, closed) = replicas[leader].snapshot_exchange().await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(!closed, "the leader keeps the connection: {head}");
    // A hand edit of the leader's label is undone within a lease duration (the Service would
    // otherwise stay off the leader).
    let mut edited = api.get(NS, leader_id);
    edited["metadata"]["labels"][LABEL] = json!("false");
    api.put(edited);
    eventually("the leader to write its label again", || async {
        (api.label(NS, leader_id, LABEL).as_deref() == Some("true")).then_some(())
    })
    .await;
    let before = transitions(&api);
    let writes_before = api.lease_writes().len();

    let stopped_at = std::time::Instant::now();
    replicas[leader].terminate();
    assert!(replicas[leader].exited().await, "a clean exit on SIGTERM");
    assert_eq!(
        api.label(NS, leader_id, LABEL).as_deref(),
        Some("false"),
        "the stopped leader withdrew its label"
    );
    let standby_ref = &replicas[standby];
    wait_leads(&api, standby_ref, "the standby to lead").await;
    // A figure, not an assertion: SIGTERM to the standby labelled (retry 200 ms).
    eprintln!("figure: handover on SIGTERM {:?}", stopped_at.elapsed());
    assert!(standby_ref.ready().await);
    assert_eq!(
        transitions(&api),
        before + 1,
        "the takeover is one transition"
    );

    // The leader released the Lease (a PUT with no holder) before the standby took it.
    let writes: Vec<LeaseWrite> = api.lease_writes().split_off(writes_before);
    let (released, taken) = released_then_taken(&writes, standby_id);
    assert_eq!(writes[taken].transitions, before + 1, "{writes:?}");
    assert!(
        writes[..released]
            .iter()
            .all(|w| w.holder.as_deref() == Some(leader_id)),
        "only the leader's renewals before its release: {writes:?}"
    );
}

/// A leader cut off from the API server keeps serving (no renew deadline: stepping down
/// would leave no endpoint when every replica loses the API for one reason); the standby
/// takes the Lease once it ran out unrenewed, and the old leader, reconnected, reads it held
/// by the other, stops leading and withdraws its label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_keeps_serving_until_it_sees_the_standby_took_over() {
    let api = cluster().await;
    let doors = [api.door().await, api.door().await];
    let replicas = [
        Replica::start(&doors[0], "pc-a").await,
        Replica::start(&doors[1], "pc-b").await,
    ];
    let leader = settled(&api, &[&replicas[0], &replicas[1]]).await;
    let standby = 1 - leader;
    let (old, new) = (&replicas[leader], &replicas[standby]);

    let cut_at = std::time::Instant::now();
    doors[leader].set(Fault::Down);
    eventually("the cut-off leader to count failed rounds", || async {
        (old.metric("pd_control_leader_lease_errors_total").await >= 2.0).then_some(())
    })
    .await;
    assert!(doors[leader].refused() >= 1);

    wait_leads(&api, new, "the standby to take over").await;
    // A figure, not an assertion: the cut to the standby labelled (lease 3 s, retry 200 ms).
    eprintln!(
        "figure: takeover from a silent leader {:?}",
        cut_at.elapsed()
    );
    // The cut-off leader never read another holder: it still leads, labelled and ready.
    assert_eq!(old.metric("pd_control_leader").await, 1.0);
    assert!(
        old.ready().await,
        "a leader cut off from the API stays ready"
    );
    assert_eq!(api.label(NS, old.identity, LABEL).as_deref(), Some("true"));

    doors[leader].set(Fault::Open);
    eventually(
        "the old leader to see the new holder, withdraw its label and stay ready",
        || async {
            let withdrawn = api.label(NS, old.identity, LABEL).as_deref() == Some("false");
            let standby = old.metric("pd_control_leader").await == 0.0;
            (withdrawn && standby && old.ready().await).then_some(())
        },
    )
    .await;
    assert_eq!(new.metric("pd_control_leader").await, 1.0);
    assert_eq!(api.lease_holder(NS, LEASE).as_deref(), Some(new.identity));
}

/// A leader whose snapshot freezes (its control loop hangs, here on the endpoint file's write:
/// a FIFO where the file's temporary sibling goes, which nobody reads) gives the Lease up
/// (a PUT with no holder), so the standby takes over at once instead of never: the leader's
/// election task, apart from the loop, would otherwise renew for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_snapshot_freezes_releases_the_lease() {
    let api = cluster().await;
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let eds = |i: usize| dirs[i].path().join("eds.json");
    let (eds_a, eds_b) = (eds(0), eds(1));
    let xds = [free_addr(), free_addr()];
    let replicas = [
        Replica::start_with(
            &api.door().await,
            "pc-a",
            &[
                "--eds-file",
                eds_a.to_str().unwrap(),
                "--xds-listen",
                &xds[0],
            ],
        )
        .await,
        Replica::start_with(
            &api.door().await,
            "pc-b",
            &[
                "--eds-file",
                eds_b.to_str().unwrap(),
                "--xds-listen",
                &xds[1],
            ],
        )
        .await,
    ];
    let leader = settled(&api, &[&replicas[0], &replicas[1]]).await;
    let (old, new) = (&replicas[leader], &replicas[1 - leader]);
    // The standby closes an EDS connection as soon as it takes it; the leader serves a
    // stream (the gateway's, until the leader stops leading) and keeps its connections.
    assert!(
        closes_h2_connection(&xds[1 - leader]).await,
        "a standby closes a new EDS connection"
    );
    assert!(eds_stream(&xds[1 - leader]).await.is_err());
    let (_requests, mut stream) = eds_stream(&xds[leader]).await.expect("the leader's stream");
    let first = stream.message().await.expect("a listing");
    assert!(first.is_some(), "the leader sends its listing");
    let held = open_h2_connection(&xds[leader]).await;
    let before = transitions(&api);
    let writes_before = api.lease_writes().len();

    let fifo = dirs[leader].path().join("eds.json.tmp");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    // A new pod: every replica rewrites its endpoint file, and the leader's write blocks.
    api.put(pod("llm", "decode-1", "llama", Some("127.0.0.9"), true));

    wait_leads(&api, new, "the standby to take over from the frozen leader").await;
    let (code, why) = old.readyz().await.expect("the frozen leader answers");
    assert_eq!(code, 503, "{why}");
    assert!(why.contains("frozen"), "{why}");
    assert_eq!(old.metric("pd_control_leader").await, 0.0);
    assert_eq!(api.label(NS, old.identity, LABEL).as_deref(), Some("false"));
    // Its EDS stream ended and its connections closed, so the gateway dials the Service
    // again, which reaches the leader (a stream refused on a kept connection would be
    // retried on that same connection, to this replica, for ever).
    let ended = tokio::time::timeout(common::DEADLINE, async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => break None,
                Err(status) => break Some(status),
            }
        }
    })
    .await
    .expect("the former leader ends its EDS stream");
    assert!(ended.is_some(), "ended with an error status");
    assert!(
        connection_closes(held).await,
        "the former leader closes the EDS connections it held"
    );
    let writes: Vec<LeaseWrite> = api.lease_writes().split_off(writes_before);
    released_then_taken(&writes, new.identity);
    assert_eq!(transitions(&api), before + 1);
}

/// A leader whose pod label cannot be written (a patch the API refuses: RBAC, a webhook)
/// leads no traffic, since the Service selects the label: it gives the Lease up after a lease
/// duration and sits one out, so a replica whose label can be written takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_label_cannot_be_written_gives_the_lease_up() {
    let api = cluster().await;
    api.put(replica_pod("pc-c"));
    let mut b = Replica::start(&api.door().await, "pc-b").await;
    eventually("pc-b to lead", || async {
        let labelled = api.label(NS, "pc-b", LABEL).as_deref() == Some("true");
        (labelled && api.lease_holder(NS, LEASE).as_deref() == Some("pc-b")).then_some(())
    })
    .await;
    let door = api.door().await;
    let a = Replica::start(&door, "pc-a").await;
    eventually("pc-a to stand by", || async {
        let standby = api.label(NS, "pc-a", LABEL).as_deref() == Some("false");
        (standby && a.ready().await).then_some(())
    })
    .await;
    door.set(Fault::PodWrites);
    b.terminate();
    assert!(b.exited().await, "a clean exit on SIGTERM");
    eventually("pc-a to take the lease, its label unwritten", || async {
        let holds = api.lease_holder(NS, LEASE).as_deref() == Some("pc-a");
        (holds && a.metric("pd_control_leader").await == 1.0).then_some(())
    })
    .await;
    assert_eq!(api.label(NS, "pc-a", LABEL).as_deref(), Some("false"));
    let writes_before = api.lease_writes().len();

    let c = Replica::start(&api.door().await, "pc-c").await;
    wait_leads(&api, &c, "pc-c to take over from the unlabelled leader").await;
    assert_eq!(a.metric("pd_control_leader").await, 0.0);
    assert!(a.ready().await, "its label says \"false\": a ready standby");
    let writes: Vec<LeaseWrite> = api.lease_writes().split_off(writes_before);
    released_then_taken(&writes, "pc-c");
}

/// A restarted container whose pod still says "true" from its previous life, while another
/// replica holds the Lease: it is unready until it has written "false", and never leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_replica_is_unready_until_its_stale_label_is_withdrawn() {
    let api = cluster().await;
    let b = Replica::start(&api.door().await, "pc-b").await;
    eventually("pc-b to lead", || async {
        let labelled = api.label(NS, "pc-b", LABEL).as_deref() == Some("true");
        let holds = api.lease_holder(NS, LEASE).as_deref() == Some("pc-b");
        (labelled && holds).then_some(())
    })
    .await;
    let mut stale = api.get(NS, "pc-a");
    stale["metadata"]["labels"][LABEL] = json!("true");
    api.put(stale);

    let door = api.door().await;
    door.set(Fault::PodWrites);
    let a = Replica::start(&door, "pc-a").await;
    // Once the snapshot is ready, only the label keeps pc-a unready: its writes fail.
    let reason = eventually("pc-a unready for its label, its writes failing", || async {
        let (code, body) = a.readyz().await?;
        let failing = a.metric("pd_control_leader_label_errors_total").await >= 2.0;
        (code == 503 && body.contains("is not yet \"false\"") && failing).then_some(body)
    })
    .await;
    assert!(
        reason.contains(&format!("lease {NS}/{LEASE} held by \"pc-b\"")),
        "{reason}"
    );
    assert_eq!(api.label(NS, "pc-a", LABEL).as_deref(), Some("true"));
    assert_eq!(
        a.readyz().await.map(|(code, _)| code),
        Some(503),
        "still unready"
    );
    // Unready for its label alone: live, so a liveness probe does not restart it.
    let live = a
        .client
        .get(format!("{}/livez", a.base))
        .send()
        .await
        .expect("livez");
    assert_eq!(live.status().as_u16(), 200);
    assert_eq!(a.metric("pd_control_leader").await, 0.0);

    door.set(Fault::Open);
    eventually(
        "pc-a to withdraw the stale label and turn ready",
        || async {
            let withdrawn = api.label(NS, "pc-a", LABEL).as_deref() == Some("false");
            (withdrawn && a.ready().await).then_some(())
        },
    )
    .await;
    assert_eq!(a.metric("pd_control_leader").await, 0.0);
    assert_eq!(a.metric("pd_control_leader_acquisitions_total").await, 0.0);
    assert_eq!(b.metric("pd_control_leader").await, 1.0);
    assert_eq!(api.lease_holder(NS, LEASE).as_deref(), Some("pc-b"));
    let writes = api.lease_writes();
    assert!(
        writes.iter().all(|w| w.holder.as_deref() == Some("pc-b")),
        "pc-a never wrote the lease: {writes:?}"
    );
}

/// Misconfigured election fails start-up with a message naming the flag.
#[test]
fn election_flags_that_cannot_work_fail_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = dir.path().join("fleet.yaml");
    std::fs::write(&fleet, "pods: []\n").unwrap();
    let fleet = fleet.to_str().unwrap();
    // Nothing listens here: start-up must fail before any connection is tried.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let kube = format!("http://{closed}");
    let named = [
        "--leader-elect-namespace",
        NS,
        "--leader-elect-identity",
        "pc-a",
    ];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            [&["--fleet", fleet, "--leader-elect"][..], &named[..]].concat(),
            "--leader-elect needs the kubernetes source",
        ),
        (
            [
                &["--source", "file", "--fleet", fleet, "--leader-elect"][..],
                &named[..],
            ]
            .concat(),
            "--leader-elect needs the kubernetes source",
        ),
        (
            vec![
                "--source",
                "kubernetes",
                "--kube-api-url",
                &kube,
                "--leader-elect",
                "--leader-elect-namespace",
                NS,
            ],
            "--leader-elect needs --leader-elect-identity (or POD_NAME)",
        ),
        (
            [
                &[
                    "--source",
                    "kubernetes",
                    "--kube-api-url",
                    &kube,
                    "--leader-elect",
                ][..],
                &named[..],
                &["--leader-elect-retry-period", "20s"][..],
            ]
            .concat(),
            "--leader-elect-lease-duration >= 3 x --leader-elect-retry-period",
        ),
    ];
    for (args, expected) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_pd-control"))
            .args(&args)
            .args(["--listen", "127.0.0.1:0"])
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?} announced a listener");
    }
}
