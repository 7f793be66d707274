//! The retrying cluster's endpoints as a gRPC EDS service (`--xds-listen`).
//!
//! A gateway that cannot read pd-control's endpoint file (an Istio ingress gateway: another
//! pod) gets the same listing over Envoy's state-of-the-world EDS protocol: its retrying
//! cluster names this service as its `api_config_source`, subscribes to the cluster's name,
//! and every change of the listing (`eds::EdsWriter`, which hands it over before the snapshot
//! naming a new pod is published) is pushed on every open stream.
//!
//! Only what EDS needs: one resource (the cluster's `ClusterLoadAssignment`) under the
//! listing's version, answered to the names asked for; ACKs are read and dropped, NACKs
//! logged and counted (the gateway keeps its previous listing). Guarded by the snapshot token
//! when one is configured (`authorization: Bearer` in the gRPC service's `initial_metadata`).

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{address, socket_address, Address, SocketAddress};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::endpoint::v3::endpoint_discovery_service_server::{
    EndpointDiscoveryService, EndpointDiscoveryServiceServer,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::SnapshotToken;
use crate::eds::Listing;
use crate::stats::Stats;

pub const EDS_TYPE_URL: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// The snapshot poll's header naming the polling gateway's Envoy node (`node.id`).
pub const NODE_HEADER: &str = "x-pd-node";
/// The answer's header saying whether that gateway's retrying cluster has the listing
/// (`1`/`0`); sent whenever pd-control provides one.
pub const EDS_HERE_HEADER: &str = "x-pd-eds-here";

/// Which gateways' retrying clusters hold the listing, as the snapshot polls ask.
#[derive(Debug, Clone)]
pub enum EdsHere {
    /// No listing is provided (neither `--eds-file` nor `--xds-listen`): no header.
    Off,
    /// The endpoint file: every gateway reading it has it.
    File,
    /// Over EDS only: per Envoy node, its open streams that ACKed a listing. Counted, not
    /// just named, so a node is forgotten when its last such stream ends: a gateway restarted
    /// under the same node id holds nothing until its new stream ACKs, while one stream of
    /// several closing leaves the node's other clusters counted.
    Nodes(Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>),
}

impl EdsHere {
    /// The header value for a poll from `node` (`None` when no header is due).
    pub fn answer(&self, node: Option<&str>) -> Option<&'static str> {
        let here = match self {
            EdsHere::Off => return None,
            EdsHere::File => true,
            EdsHere::Nodes(nodes) => node.is_some_and(|n| {
                nodes
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .contains_key(n)
            }),
        };
        Some(if here { "1" } else { "0" })
    }

    /// Counts a stream of `node` that ACKed; the count is taken back when the returned mark
    /// drops with the stream. `None` where nodes are not tracked.
    fn hold(&self, node: &str) -> Option<Held> {
        let EdsHere::Nodes(nodes) = self else {
            return None;
        };
        *nodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(node.to_string())
            .or_default() += 1;
        Some(Held {
            here: self.clone(),
            node: node.to_string(),
        })
    }

    fn release(&self, node: &str) {
        let EdsHere::Nodes(nodes) = self else {
            return;
        };
        let mut nodes = nodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(streams) = nodes.get_mut(node) {
            *streams = streams.saturating_sub(1);
            if *streams == 0 {
                nodes.remove(node);
            }
        }
    }
}

/// One open stream's count in [`EdsHere::Nodes`], given back when the stream ends (its task
/// returns, however it returns).
#[derive(Debug)]
struct Held {
    here: EdsHere,
    node: String,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.here.release(&self.node);
    }
}

/// The EDS service over one [`Listing`] watch.
pub struct EdsService {
    listing: watch::Receiver<Arc<Listing>>,
    stats: Arc<Stats>,
    /// Where the nodes that ACKed are recorded for the snapshot polls.
    here: EdsHere,
    /// When this process started serving (Unix ms): the prefix of every version it sends, so
    /// a restarted pd-control, whose listing versions start again at 1, never sends a version
    /// string Envoy already holds for other endpoints.
    instance: i64,
}

/// Refuses a stream without the snapshot token, when one is configured.
#[derive(Clone)]
pub struct TokenCheck {
    token: Option<Arc<SnapshotToken>>,
    stats: Arc<Stats>,
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.token else {
            return Ok(request);
        };
        let header = request
            .metadata()
            .get("authorization")
            .and_then(|v| http::HeaderValue::from_bytes(v.as_bytes()).ok());
        if token.authorizes(header.as_ref()) {
            Ok(request)
        } else {
            self.stats.unauthorized();
            Err(Status::unauthenticated("missing or wrong bearer token"))
        }
    }
}

/// The EDS service as served: behind the token check.
pub type Served = tonic::service::interceptor::InterceptedService<
    EndpointDiscoveryServiceServer<EdsService>,
    TokenCheck,
>;

pub fn service(
    listing: watch::Receiver<Arc<Listing>>,
    stats: Arc<Stats>,
    token: Option<Arc<SnapshotToken>>,
    here: EdsHere,
) -> Served {
    let check = TokenCheck {
        token,
        stats: stats.clone(),
    };
    let instance = crate::unix_ms_now();
    let server = EndpointDiscoveryServiceServer::new(EdsService {
        listing,
        stats,
        here,
        instance,
    })
    .max_decoding_message_size(MAX_REQUEST_BYTES);
    tonic::service::interceptor::InterceptedService::new(server, check)
}

/// The largest `DiscoveryRequest` taken (tonic's default is 4 MiB), so that a stream cannot
/// make pd-control buffer megabytes per message. Not tens of KiB, although all it reads is
/// the node id, the nonce and a NACK's error: Envoy sends its whole `Node` with every request
/// (`set_node_on_first_message_only` is off by default), including the list of every
/// extension it was built with and, under Istio, the proxy's metadata, which together reach
/// tens of KiB; a request over the limit ends the gateway's stream.
const MAX_REQUEST_BYTES: usize = 1024 * 1024;
/// Streams at once on one connection (HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`; hyper's
/// default is 200, h2's unbounded). A gateway opens one per EDS cluster, so one in practice.
const MAX_STREAMS_PER_CONNECTION: u32 = 64;

/// HTTP/2 PING interval on an EDS connection: a stream is quiet between listing changes, and
/// a gateway that vanished without closing it (node lost, network cut) would otherwise hold
/// its stream, its task and its node's count in [`EdsHere::Nodes`] for ever.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a PING may go unanswered before the connection is closed.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// TCP keepalive idle time, for a peer whose connection is dead below HTTP/2.
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

/// Serves `service` on `listener` until `stop` resolves (its open streams end with it).
/// Connections whose gateway stops answering are closed (see [`KEEPALIVE_INTERVAL`]).
///
/// With `leading` (`--leader-elect`), a replica that does not lead closes a connection as soon
/// as it is accepted, and one that stops leading closes every connection it holds. Ending the
/// stream alone is not enough: Envoy's gRPC client opens its next stream on the same HTTP/2
/// connection, which kube-proxy tied to this pod, and would be refused there for as long as
/// this replica runs; a closed connection makes it dial the Service again, which reaches the
/// leader.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: Served,
    leading: Option<watch::Receiver<bool>>,
    stop: impl std::future::Future<Output = ()> + Send,
) {
    use tokio_stream::StreamExt as _;
    // The builder's `tcp_keepalive` applies only to listeners it binds itself: this one is
    // set on the incoming stream.
    // A connection accepted while this replica does not lead fails its first read.
    let incoming = tonic::transport::server::TcpIncoming::from(listener)
        .with_keepalive(Some(TCP_KEEPALIVE))
        .map(move |accepted| accepted.map(|io| LeaderConnection::new(io, leading.clone())));
    let served = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        // Requests being answered at once per connection: for a stream, until its response
        // has begun (one listing); the bound for calls opened faster than they are answered.
        .concurrency_limit_per_connection(MAX_STREAMS_PER_CONNECTION as usize)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, stop)
        .await;
    if let Err(e) = served {
        tracing::error!("the EDS service stopped: {e}");
    }
}

/// An accepted EDS connection that fails its next read or write once this replica stops
/// leading, which closes it (see [`serve`]). Without an election it is the plain connection.
struct LeaderConnection {
    io: tokio::net::TcpStream,
    /// Resolves when leadership is lost; `None` without an election, or once it resolved.
    lost: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
    closed: bool,
}

impl LeaderConnection {
    fn new(io: tokio::net::TcpStream, leading: Option<watch::Receiver<bool>>) -> Self {
        let lost = leading.map(|mut rx| {
            Box::pin(async move {
                // The sender gone means pd-control is stopping: the server ends it then.
                if rx.wait_for(|l| !*l).await.is_err() {
                    std::future::pending::<()>().await;
                }
            }) as std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        });
        LeaderConnection {
            io,
            lost,
            closed: false,
        }
    }

    /// Whether leadership was lost; registers `cx` to be woken when it is.
    fn lost(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        if !self.closed {
            if let Some(lost) = self.lost.as_mut() {
                if lost.as_mut().poll(cx).is_ready() {
                    self.closed = true;
                    self.lost = None;
                }
            }
        }
        self.closed
    }
}

fn not_leading_io() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "this pd-control replica stopped leading",
    )
}

impl tokio::io::AsyncRead for LeaderConnection {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.lost(cx) {
            return std::task::Poll::Ready(Err(not_leading_io()));
        }
        std::pin::Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for LeaderConnection {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.lost(cx) {
            return std::task::Poll::Ready(Err(not_leading_io()));
        }
        std::pin::Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.lost(cx) {
            return std::task::Poll::Ready(Err(not_leading_io()));
        }
        std::pin::Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for LeaderConnection {
    type ConnectInfo = <tokio::net::TcpStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// The response for `names` (empty: every resource, i.e. ours) at `listing`'s version, as
/// served by the process started at `instance`.
pub fn response(
    listing: &Listing,
    instance: i64,
    names: &[String],
    nonce: u64,
) -> DiscoveryResponse {
    let wanted = names.is_empty() || names.contains(&listing.cluster);
    let resources = if wanted {
        vec![Any {
            type_url: EDS_TYPE_URL.into(),
            value: assignment(listing).encode_to_vec(),
        }]
    } else {
        Vec::new()
    };
    DiscoveryResponse {
        version_info: format!("{instance}-{}", listing.version),
        resources,
        type_url: EDS_TYPE_URL.into(),
        nonce: nonce.to_string(),
        ..Default::default()
    }
}

/// The listing as Envoy's `ClusterLoadAssignment`.
pub fn assignment(listing: &Listing) -> ClusterLoadAssignment {
    let lb_endpoints = listing
        .endpoints
        .iter()
        .map(|(ip, port)| LbEndpoint {
            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                address: Some(Address {
                    address: Some(address::Address::SocketAddress(SocketAddress {
                        address: ip.clone(),
                        port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(
                            *port,
                        ))),
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            })),
            ..Default::default()
        })
        .collect();
    ClusterLoadAssignment {
        cluster_name: listing.cluster.clone(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// One stream's state: what it subscribed to and what it was last sent.
struct Subscription {
    instance: i64,
    /// The subscriber's Envoy node id, from its first request.
    node: Option<String>,
    names: Option<Vec<String>>,
    sent_version: Option<u64>,
    nonce: u64,
    /// This stream's count for its node once it ACKed, given back with the subscription.
    held: Option<Held>,
}

impl Subscription {
    fn new(instance: i64) -> Subscription {
        Subscription {
            instance,
            node: None,
            names: None,
            sent_version: None,
            nonce: 0,
            held: None,
        }
    }

    /// Takes in a request; whether it asks for something not sent yet: a first request, or
    /// other names. An ACK (same names, the last nonce) asks for nothing and is counted (the
    /// gateways' retrying cluster knows the pods: snapshots may say so); so does a NACK,
    /// counted apart: the same listing would be refused again, so the next change is sent.
    fn request(&mut self, request: &DiscoveryRequest, stats: &Stats, here: &EdsHere) -> bool {
        if self.node.is_none() {
            self.node = request.node.as_ref().map(|n| n.id.clone());
        }
        if let Some(error) = &request.error_detail {
            stats.xds_nack();
            tracing::warn!(
                version = %request.version_info,
                error = %error.message,
                "a gateway refused the endpoint listing; it keeps its previous one"
            );
        }
        if self.names.as_deref() == Some(request.resource_names.as_slice()) {
            if request.error_detail.is_none() && request.response_nonce == self.nonce.to_string() {
                if let (None, Some(node)) = (&self.held, &self.node) {
                    self.held = here.hold(node);
                }
                if stats.xds_ack() {
                    tracing::info!(
                        version = %request.version_info,
                        node = self.node.as_deref().unwrap_or_default(),
                        "a gateway took the endpoint listing; snapshots now let gateways name stand-in pods"
                    );
                }
            }
            return false;
        }
        self.names = Some(request.resource_names.clone());
        true
    }

    /// The response to send now, if the subscriber lacks `listing` (or asked again).
    fn due(&mut self, listing: &Listing, asked: bool) -> Option<DiscoveryResponse> {
        let names = self.names.as_ref()?;
        if !asked && self.sent_version == Some(listing.version) {
            return None;
        }
        self.nonce += 1;
        self.sent_version = Some(listing.version);
        Some(response(listing, self.instance, names, self.nonce))
    }
}

#[tonic::async_trait]
impl EndpointDiscoveryService for EdsService {
    type StreamEndpointsStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaEndpointsStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_endpoints(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamEndpointsStream>, Status> {
        let mut inbound = request.into_inner();
        let mut listing = self.listing.clone();
        let stats = self.stats.clone();
        let here = self.here.clone();
        let instance = self.instance;
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let _open = stats.xds_stream();
            // Dropped before `_open`: by the time the stream gauge falls, the node's count has.
            let mut subscription = Subscription::new(instance);
            loop {
                let asked = tokio::select! {
                    message = inbound.message() => match message {
                        Ok(Some(request)) => subscription.request(&request, &stats, &here),
                        // The gateway closed the stream: it reconnects itself.
                        Ok(None) => return,
                        // Broken, or a request refused (over `MAX_REQUEST_BYTES`): the
                        // gateway is told why, where it still listens.
                        Err(status) => {
                            let _ = tx.send(Err(status)).await;
                            return;
                        }
                    },
                    changed = listing.changed() => {
                        if changed.is_err() {
                            return; // pd-control is stopping
                        }
                        false
                    }
                };
                let current = listing.borrow_and_update().clone();
                if let Some(response) = subscription.due(&current, asked) {
                    if tx.send(Ok(response)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_endpoints(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaEndpointsStream>, Status> {
        Err(Status::unimplemented(
            "delta EDS is not served; use the state-of-the-world stream (api_type: GRPC)",
        ))
    }

    async fn fetch_endpoints(
        &self,
        request: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        let listing = self.listing.borrow().clone();
        let names = request.into_inner().resource_names;
        Ok(Response::new(response(&listing, self.instance, &names, 0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(version: u64) -> Listing {
        Listing {
            cluster: "pd_pods_retry".into(),
            version,
            endpoints: vec![("10.0.0.1".into(), 8000), ("fd00::7".into(), 8001)],
        }
    }

    fn request(names: &[&str], version: &str, nonce: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            version_info: version.into(),
            response_nonce: nonce.into(),
            type_url: EDS_TYPE_URL.into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_assignment_lists_every_endpoint_under_the_cluster_name() {
        let r = response(&listing(3), 42, &["pd_pods_retry".into()], 7);
        assert_eq!((r.version_info.as_str(), r.nonce.as_str()), ("42-3", "7"));
        assert_eq!(r.resources.len(), 1);
        let cla = ClusterLoadAssignment::decode(r.resources[0].value.as_slice()).expect("decodes");
        assert_eq!(cla.cluster_name, "pd_pods_retry");
        let listed: Vec<String> = cla.endpoints[0]
            .lb_endpoints
            .iter()
            .map(|e| match &e.host_identifier {
                Some(lb_endpoint::HostIdentifier::Endpoint(ep)) => {
                    match ep.address.as_ref().and_then(|a| a.address.as_ref()) {
                        Some(address::Address::SocketAddress(sa)) => {
                            format!("{}:{:?}", sa.address, sa.port_specifier)
                        }
                        other => panic!("{other:?}"),
                    }
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            listed,
            [
                "10.0.0.1:Some(PortValue(8000))",
                "fd00::7:Some(PortValue(8001))"
            ]
        );
        assert!(
            response(&listing(3), 42, &["other".into()], 1)
                .resources
                .is_empty(),
            "a name it does not serve gets no resource"
        );
        assert_eq!(
            response(&listing(3), 42, &[], 1).resources.len(),
            1,
            "wildcard"
        );
    }

    #[test]
    fn a_subscriber_gets_each_version_once_and_acks_ask_for_nothing() {
        let stats = Stats::default();
        let here = EdsHere::Nodes(Default::default());
        let mut sub = Subscription::new(42);
        assert!(sub.due(&listing(1), false).is_none(), "nothing asked yet");
        assert!(!stats.xds_acked());
        let mut first_request = request(&["pd_pods_retry"], "", "");
        first_request.node = Some(envoy_types::pb::envoy::config::core::v3::Node {
            id: "gw-1".into(),
            ..Default::default()
        });
        assert!(sub.request(&first_request, &stats, &here));
        let first = sub.due(&listing(1), true).expect("the first answer");
        assert_eq!(
            (first.version_info.as_str(), first.nonce.as_str()),
            ("42-1", "1")
        );
        assert_eq!(here.answer(Some("gw-1")), Some("0"), "sent, not yet taken");
        assert!(
            !sub.request(&request(&["pd_pods_retry"], "42-1", "1"), &stats, &here),
            "an ACK"
        );
        assert_eq!(here.answer(Some("gw-1")), Some("1"), "that node has it");
        assert_eq!(here.answer(Some("gw-2")), Some("0"), "another has not");
        assert_eq!(here.answer(None), Some("0"));
        assert!(sub.due(&listing(1), false).is_none());
        assert_eq!(
            sub.due(&listing(2), false).expect("a change").version_info,
            "42-2"
        );
        let mut nack = request(&["pd_pods_retry"], "42-1", "2");
        nack.error_detail = Some(Default::default());
        assert!(!sub.request(&nack, &stats, &here));
        assert_eq!(stats.xds_nacks_total(), 1);
        assert_eq!(stats.xds_acks_total(), 1, "a NACK is no ACK");
        assert!(
            sub.due(&listing(2), false).is_none(),
            "refused: wait for a change"
        );
        // Other names: answered at once, for those names.
        assert!(sub.request(&request(&["other"], "42-2", "2"), &stats, &here));
        assert!(sub
            .due(&listing(2), true)
            .expect("answered")
            .resources
            .is_empty());
        assert_eq!(EdsHere::File.answer(None), Some("1"));
        assert_eq!(EdsHere::Off.answer(Some("gw-1")), None);
    }

    /// A stream of `node` that subscribed, was answered and ACKed.
    fn acked(node: &str, stats: &Stats, here: &EdsHere) -> Subscription {
        let mut sub = Subscription::new(42);
        let mut first = request(&["pd_pods_retry"], "", "");
        first.node = Some(envoy_types::pb::envoy::config::core::v3::Node {
            id: node.into(),
            ..Default::default()
        });
        assert!(sub.request(&first, stats, here));
        let answer = sub.due(&listing(1), true).expect("the first answer");
        let ack = request(&["pd_pods_retry"], &answer.version_info, &answer.nonce);
        assert!(!sub.request(&ack, stats, here));
        assert!(!sub.request(&ack, stats, here), "an ACK again counts once");
        sub
    }

    #[test]
    fn a_node_is_forgotten_when_its_last_acked_stream_ends() {
        let stats = Stats::default();
        let here = EdsHere::Nodes(Default::default());
        let one = acked("gw-1", &stats, &here);
        let two = acked("gw-1", &stats, &here);
        drop(one);
        assert_eq!(
            here.answer(Some("gw-1")),
            Some("1"),
            "its other stream holds it"
        );
        drop(two);
        assert_eq!(here.answer(Some("gw-1")), Some("0"), "no stream holds it");

        // Restarted under the same id: nothing held until the new stream ACKs.
        let mut restarted = Subscription::new(43);
        let mut first = request(&["pd_pods_retry"], "", "");
        first.node = Some(envoy_types::pb::envoy::config::core::v3::Node {
            id: "gw-1".into(),
            ..Default::default()
        });
        assert!(restarted.request(&first, &stats, &here));
        assert!(restarted.due(&listing(1), true).is_some());
        assert_eq!(here.answer(Some("gw-1")), Some("0"), "sent, not yet taken");
        assert!(EdsHere::File.hold("gw-1").is_none());
    }
}
