//! pd-control's gRPC EDS service (`--xds-listen`), spoken to by a real gRPC client the way
//! Envoy speaks to it: the token guard, the first listing, a push on a fleet edit, ACKs and
//! NACKs, and the stream gauge.

mod common;

use std::path::Path;

use envoy_types::pb::envoy::config::endpoint::v3::{lb_endpoint, ClusterLoadAssignment};
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::envoy::service::endpoint::v3::endpoint_discovery_service_client::EndpointDiscoveryServiceClient;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use common::{eventually, metric};
use pd_control::proto;
use pd_control::xds::EDS_TYPE_URL;

const TOKEN: &str = "xds-t0ken";

/// A fleet of decode pods of model `m`, one per `(name, ip)`, all on port 8000. Nothing
/// listens there: the listing does not wait for scrapes.
fn write_fleet(path: &Path, pods: &[(&str, &str)]) {
    let mut out = String::from("apiVersion: v1\nkind: List\nitems:\n");
    for (name, ip) in pods {
        out.push_str(&format!(
            "- apiVersion: v1\n  kind: Pod\n  metadata:\n    name: {name}\n    namespace: t\n    \
             labels: {{model.aibrix.ai/name: m, model.aibrix.ai/port: \"8000\", role-name: decode}}\n  \
             status:\n    podIP: {ip}\n    conditions: [{{type: Ready, status: \"True\"}}]\n"
        ));
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, out).expect("fleet");
    std::fs::rename(&tmp, path).expect("fleet");
}

fn subscribe(version: &str, nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        node: Some(envoy_types::pb::envoy::config::core::v3::Node {
            id: "gw-1".into(),
            ..Default::default()
        }),
        resource_names: vec!["pd_pods_retry".into()],
        type_url: EDS_TYPE_URL.into(),
        version_info: version.into(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

type Client = EndpointDiscoveryServiceClient<tonic::transport::Channel>;

/// An EDS stream opened with the token, its first request (a subscription) sent: the
/// sender for the next requests and the stream of responses.
async fn subscribed(
    client: &mut Client,
) -> (
    mpsc::Sender<DiscoveryRequest>,
    tonic::Streaming<DiscoveryResponse>,
) {
    let (tx, rx) = mpsc::channel(4);
    tx.send(subscribe("", "")).await.expect("queued");
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    let bearer = format!("Bearer {TOKEN}").parse().expect("metadata");
    request.metadata_mut().insert("authorization", bearer);
    let stream = client
        .stream_endpoints(request)
        .await
        .expect("with the token")
        .into_inner();
    (tx, stream)
}

/// The `ip:port` endpoints of a response's one assignment.
fn endpoints(response: &DiscoveryResponse) -> Vec<String> {
    assert_eq!(response.type_url, EDS_TYPE_URL);
    assert_eq!(response.resources.len(), 1, "{response:?}");
    let cla = ClusterLoadAssignment::decode(response.resources[0].value.as_slice())
        .expect("a ClusterLoadAssignment");
    assert_eq!(cla.cluster_name, "pd_pods_retry");
    cla.endpoints
        .iter()
        .flat_map(|l| &l.lb_endpoints)
        .map(|e| {
            let Some(lb_endpoint::HostIdentifier::Endpoint(ep)) = &e.host_identifier else {
                panic!("not an endpoint: {e:?}");
            };
            let address = ep.address.as_ref().and_then(|a| a.address.as_ref());
            let Some(envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(
                sa,
            )) = address
            else {
                panic!("not a socket address: {address:?}");
            };
            let Some(envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier::PortValue(
                port,
            )) = sa.port_specifier
            else {
                panic!("no port: {sa:?}");
            };
            format!("{}:{port}", sa.address)
        })
        .collect()
}

/// Whether the snapshot served now tells gateways they may name stand-ins, and what it says
/// of the retrying cluster of the gateway whose Envoy node is `node` (`x-pd-eds-here`).
async fn snapshot_says_eds(base: &str, node: &str) -> (bool, Option<String>) {
    let response = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
        .get(format!("{base}/v1/snapshot"))
        .bearer_auth(TOKEN)
        .header("x-pd-node", node)
        .send()
        .await
        .expect("snapshot");
    let here = response
        .headers()
        .get("x-pd-eds-here")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let bytes = response.bytes().await.expect("snapshot body");
    (
        proto::Snapshot::decode(bytes).expect("a snapshot").eds,
        here,
    )
}

/// pd-control on a one-pod fleet file, with the EDS service and the token; the fleet's
/// directory (kept alive with the service) and file.
async fn start_with_eds() -> (tempfile::TempDir, std::path::PathBuf, pd_control::Service) {
    let dir = tempfile::tempdir().expect("dir");
    let fleet = dir.path().join("fleet.yaml");
    write_fleet(&fleet, &[("a", "127.0.9.1")]);
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).expect("token");
    let mut config = pd_control::Config::new(&fleet, "127.0.0.1:0".parse().expect("addr"));
    config.xds_listen = Some("127.0.0.1:0".parse().expect("addr"));
    config.snapshot_token_file = Some(token);
    let service = pd_control::start(config).await.expect("pd-control starts");
    (dir, fleet, service)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_eds_stream_sends_the_listing_and_every_change_behind_the_token() {
    let (_dir, fleet, service) = start_with_eds().await;
    let base = format!("http://{}", service.local_addr());
    let xds = format!("http://{}", service.xds_addr().expect("EDS bound"));
    let mut client = EndpointDiscoveryServiceClient::connect(xds)
        .await
        .expect("connects");

    // Without the token: refused, counted with the snapshot routes' refusals.
    let (tx, rx) = mpsc::channel(4);
    tx.send(subscribe("", "")).await.expect("queued");
    let refused = client
        .stream_endpoints(ReceiverStream::new(rx))
        .await
        .expect_err("no token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert_eq!(
        metric(&base, "pd_control_unauthorized_requests_total").await,
        1.0
    );

    let (tx, mut stream) = subscribed(&mut client).await;
    let first = stream.message().await.expect("a response").expect("open");
    assert_eq!(endpoints(&first), ["127.0.9.1:8000"]);
    assert_eq!(metric(&base, "pd_control_xds_streams").await, 1.0);

    // No gateway has taken a listing yet: no stand-ins (its cluster may know no pod).
    assert_eq!(
        snapshot_says_eds(&base, "gw-1").await,
        (false, Some("0".into()))
    );
    // An ACK asks for nothing, and tells pd-control a gateway knows the pods; the fleet edit
    // is the next thing on the stream.
    tx.send(subscribe(&first.version_info, &first.nonce))
        .await
        .expect("ack");
    eventually("a snapshot naming stand-ins", || async {
        (snapshot_says_eds(&base, "gw-1").await == (true, Some("1".into()))).then_some(())
    })
    .await;
    // Only for the gateway that took it: another one's cluster may still be empty.
    assert_eq!(
        snapshot_says_eds(&base, "gw-2").await,
        (true, Some("0".into()))
    );
    assert_eq!(metric(&base, "pd_control_xds_acks_total").await, 1.0);
    write_fleet(&fleet, &[("a", "127.0.9.1"), ("b", "127.0.9.2")]);
    let second = stream.message().await.expect("a response").expect("open");
    assert_eq!(endpoints(&second), ["127.0.9.1:8000", "127.0.9.2:8000"]);
    assert_ne!(second.version_info, first.version_info);
    assert_ne!(second.nonce, first.nonce);

    // A NACK is counted; the gateway keeps what it had.
    let mut nack = subscribe(&first.version_info, &second.nonce);
    nack.error_detail = Some(RpcStatus {
        code: 3,
        message: "refused".into(),
        ..Default::default()
    });
    tx.send(nack).await.expect("nack");
    eventually("the NACK counted", || async {
        (metric(&base, "pd_control_xds_nacks_total").await == 1.0).then_some(())
    })
    .await;

    drop(tx);
    drop(stream);
    eventually("the stream closed", || async {
        (metric(&base, "pd_control_xds_streams").await == 0.0).then_some(())
    })
    .await;
    // Its node is forgotten with it: restarted under the same id, the gateway's new cluster
    // holds nothing until it takes a listing.
    assert_eq!(
        snapshot_says_eds(&base, "gw-1").await,
        (true, Some("0".into()))
    );

    // A gateway still connected does not hold pd-control's shutdown: its stream ends.
    let (tx, mut open) = subscribed(&mut client).await;
    open.message().await.expect("a response").expect("open");
    tokio::time::timeout(std::time::Duration::from_secs(20), service.shutdown())
        .await
        .expect("shutdown does not wait for the gateway")
        .expect("clean shutdown");
    assert!(
        !matches!(open.message().await, Ok(Some(_))),
        "the stream ended with the service"
    );
    drop(tx);
}

/// A request over the size limit (1 MiB; tonic's default is 4 MiB) ends its stream rather
/// than being buffered; one the size of a real Envoy's node is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_request_ends_its_stream() {
    let (_dir, _fleet, service) = start_with_eds().await;
    let xds = format!("http://{}", service.xds_addr().expect("EDS bound"));
    let mut client = EndpointDiscoveryServiceClient::connect(xds)
        .await
        .expect("connects");

    let (tx, mut stream) = subscribed(&mut client).await;
    let first = stream.message().await.expect("a response").expect("open");
    // 100 KiB of node metadata, as Envoy's extension list and Istio's metadata can reach.
    let mut ack = subscribe(&first.version_info, &first.nonce);
    if let Some(node) = ack.node.as_mut() {
        node.user_agent_name = "x".repeat(100 * 1024);
    }
    tx.send(ack).await.expect("ack");
    let mut big = subscribe(&first.version_info, &first.nonce);
    if let Some(node) = big.node.as_mut() {
        node.user_agent_name = "x".repeat(2 * 1024 * 1024);
    }
    tx.send(big).await.expect("queued");
    // Taken whole, the request would leave the stream open, waiting for the next change.
    let ended = tokio::time::timeout(std::time::Duration::from_secs(20), stream.message())
        .await
        .expect("the stream ends")
        .expect_err("with the reason");
    assert!(
        matches!(
            ended.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{ended:?}"
    );
    service.shutdown().await.expect("clean shutdown");
}
