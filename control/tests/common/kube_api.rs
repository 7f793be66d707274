//! A fake Kubernetes API server on loopback, for the Kubernetes source's and the leader
//! election's tests.
//!
//! It implements just what pd-control calls: list and watch of `/api/v1/pods` and
//! `/api/v1/namespaces/{ns}/pods` with `labelSelector` (and of AIBrix's `modeladapters`, the
//! same way), a global `resourceVersion`, a history of changes replayed to watches that resume
//! from a version, bookmarks, `410 Gone` for versions older than its compaction floor, and
//! dropping every open watch on demand; merge-PATCH of a pod's labels; and the
//! `coordination.k8s.io/v1` Leases the elector reads, creates and replaces (optimistic
//! concurrency on `metadata.resourceVersion`, every write recorded).
//!
//! [`FakeApi::door`] opens another address onto the same state whose requests can be failed
//! on demand: one pd-control replica cut off from the API server while another still reaches it.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

pub const MODEL: &str = "model.aibrix.ai/name";

const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases";

/// `(kind, namespace, name)`.
type Key = (String, String, String);

/// One committed change: `new` is `None` for a deletion.
struct Change {
    rv: u64,
    old: Option<Value>,
    new: Option<Value>,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    pods: BTreeMap<Key, Value>,
    history: Vec<Change>,
    /// Watches resuming from a version below this are answered `410 Gone`.
    floor: u64,
    fail_lists: bool,
    /// The status failing lists answer (500 unless set).
    fail_status: Option<u16>,
    /// Pod lists failed so far (adapter lists fail too, uncounted).
    failed_lists: usize,
    /// When each of them came.
    failed_list_times: Vec<std::time::Instant>,
    /// Leave list requests unanswered, as a server on a half-open connection does.
    hang_lists: bool,
    /// Answer 403 to ModelAdapter requests, as a cluster without the grant does.
    deny_adapters: bool,
    lists: usize,
    watches: usize,
    gone: usize,
    /// Leases by `(namespace, name)`; their versions come from the same counter as the pods'.
    leases: BTreeMap<(String, String), Value>,
    /// Every accepted Lease write, in order.
    lease_writes: Vec<LeaseWrite>,
    /// Lease writes refused with 409 (stale resourceVersion, or a create of an existing one).
    lease_conflicts: usize,
    /// Pod merge-PATCHes applied.
    pod_patches: usize,
}

/// One accepted Lease write: what the holder and the transition count became.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseWrite {
    /// `"create"` (POST) or `"replace"` (PUT).
    pub verb: &'static str,
    pub namespace: String,
    pub name: String,
    /// `spec.holderIdentity`, `None` when absent or empty (a released Lease).
    pub holder: Option<String>,
    pub transitions: i64,
    /// The resourceVersion the write got.
    pub rv: u64,
}

#[derive(Clone)]
pub struct FakeApi {
    addr: SocketAddr,
    inner: Arc<Mutex<Inner>>,
    /// Bumped on every committed change, to wake open watches.
    changes: Arc<watch::Sender<u64>>,
    /// Bumped to end every open watch; the flag says whether to break the connection (a
    /// transport error) rather than end the response cleanly.
    drops: Arc<watch::Sender<(u64, bool)>>,
}

fn key_of(pod: &Value) -> Key {
    let meta = &pod["metadata"];
    (
        pod["kind"].as_str().unwrap_or("Pod").to_string(),
        meta["namespace"].as_str().unwrap_or("default").to_string(),
        meta["name"]
            .as_str()
            .expect("test pods have names")
            .to_string(),
    )
}

/// `k`, `!k`, `k=v`, `k==v`, `k!=v`, comma-separated: the subset of selectors tests use.
fn selector_matches(selector: Option<&str>, pod: &Value) -> bool {
    let labels = &pod["metadata"]["labels"];
    let get = |k: &str| labels.get(k.trim()).and_then(Value::as_str);
    selector
        .unwrap_or("")
        .split(',')
        .filter(|t| !t.trim().is_empty())
        .all(|term| {
            if let Some((k, v)) = term.split_once("!=") {
                get(k) != Some(v.trim())
            } else if let Some((k, v)) = term.split_once('=') {
                get(k) == Some(v.trim_start_matches('=').trim())
            } else if let Some(k) = term.trim().strip_prefix('!') {
                get(k).is_none()
            } else {
                get(term).is_some()
            }
        })
}

struct Filter {
    kind: &'static str,
    namespace: Option<String>,
    selector: Option<String>,
}

impl Filter {
    fn matches(&self, pod: &Value) -> bool {
        let (kind, namespace, _) = key_of(pod);
        kind == self.kind
            && self.namespace.as_deref().is_none_or(|ns| namespace == ns)
            && selector_matches(self.selector.as_deref(), pod)
    }

    /// What a watch with this filter sees of a change, as the real API server does it: an
    /// object that starts matching is ADDED, one that stops matching is DELETED.
    fn event(&self, change: &Change) -> Option<Value> {
        let old = change.old.as_ref().is_some_and(|p| self.matches(p));
        let new = change.new.as_ref().is_some_and(|p| self.matches(p));
        let (kind, object) = match (old, new) {
            (false, true) => ("ADDED", change.new.as_ref()?),
            (true, true) => ("MODIFIED", change.new.as_ref()?),
            (true, false) => ("DELETED", change.new.as_ref().or(change.old.as_ref())?),
            (false, false) => return None,
        };
        Some(json!({"type": kind, "object": object}))
    }
}

fn line(value: &Value) -> Result<Bytes, std::io::Error> {
    Ok(Bytes::from(format!("{value}\n")))
}

impl FakeApi {
    pub async fn start() -> FakeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let api = FakeApi {
            addr: listener.local_addr().unwrap(),
            inner: Arc::default(),
            changes: Arc::new(watch::channel(0).0),
            drops: Arc::new(watch::channel((0, false)).0),
        };
        let app = api.router();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        api
    }

    fn router(&self) -> Router {
        Router::new()
            .route("/api/v1/pods", get(all_pods))
            .route("/api/v1/namespaces/{ns}/pods", get(namespaced_pods))
            .route(
                "/api/v1/namespaces/{ns}/pods/{name}",
                get(get_pod).patch(patch_pod),
            )
            .route(ADAPTERS, get(all_adapters))
            .route(
                &format!("{ADAPTERS_NS}/{{ns}}/modeladapters"),
                get(namespaced_adapters),
            )
            .route(LEASES, post(create_lease))
            .route(
                &format!("{LEASES}/{{name}}"),
                get(get_lease).put(replace_lease),
            )
            .with_state(self.clone())
    }

    /// Another address onto this server's state, whose requests fail while its [`Fault`]
    /// says so: give each pd-control replica its own door to cut one off alone.
    pub async fn door(&self) -> Door {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let door = Door {
            addr: listener.local_addr().unwrap(),
            fault: Arc::new(watch::channel(Fault::Open).0),
            refused: Arc::default(),
        };
        let app = self
            .router()
            .layer(middleware::from_fn_with_state(door.clone(), guard));
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        door
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Commits a change; `record: false` leaves it out of the watch history, as if compacted.
    fn commit(&self, key: Key, new: Option<Value>, record: bool) {
        let mut inner = self.inner.lock().unwrap();
        let rv = commit_in(&mut inner, key, new, record);
        drop(inner);
        self.changes.send_replace(rv);
    }

    /// Answer 403 to ModelAdapter requests from now on (or no longer).
    pub fn deny_adapters(&self, deny: bool) {
        self.inner.lock().unwrap().deny_adapters = deny;
    }

    /// The pod's label `key`, if the pod exists and carries it.
    pub fn label(&self, namespace: &str, name: &str, key: &str) -> Option<String> {
        let inner = self.inner.lock().unwrap();
        let pod = inner
            .pods
            .get(&("Pod".to_string(), namespace.to_string(), name.to_string()))?;
        pod["metadata"]["labels"][key].as_str().map(str::to_string)
    }

    /// Pod merge-PATCHes applied so far.
    pub fn pod_patches(&self) -> usize {
        self.inner.lock().unwrap().pod_patches
    }

    /// The stored Lease, if any.
    pub fn lease(&self, namespace: &str, name: &str) -> Option<Value> {
        let inner = self.inner.lock().unwrap();
        inner
            .leases
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// The stored Lease's `spec.holderIdentity`, if the Lease exists and names a holder.
    pub fn lease_holder(&self, namespace: &str, name: &str) -> Option<String> {
        let lease = self.lease(namespace, name)?;
        holder_of(&lease)
    }

    /// Every accepted Lease write so far, in order.
    pub fn lease_writes(&self) -> Vec<LeaseWrite> {
        self.inner.lock().unwrap().lease_writes.clone()
    }

    /// Lease writes refused with 409 so far.
    pub fn lease_conflicts(&self) -> usize {
        self.inner.lock().unwrap().lease_conflicts
    }

    /// Creates or replaces a pod (ADDED/MODIFIED to watchers).
    pub fn put(&self, pod: Value) {
        self.commit(key_of(&pod), Some(pod), true);
    }

    pub fn delete(&self, namespace: &str, name: &str) {
        self.commit(("Pod".into(), namespace.into(), name.into()), None, true);
    }

    pub fn delete_adapter(&self, namespace: &str, name: &str) {
        self.commit(
            ("ModelAdapter".into(), namespace.into(), name.into()),
            None,
            true,
        );
    }

    /// The stored pod, to edit and `put` back.
    pub fn get(&self, namespace: &str, name: &str) -> Value {
        let inner = self.inner.lock().unwrap();
        inner.pods[&("Pod".to_string(), namespace.to_string(), name.to_string())].clone()
    }

    /// Ends every open watch cleanly, as an API server does on its watch timeout.
    pub fn drop_watches(&self) {
        self.drops
            .send_modify(|(epoch, abort)| (*epoch, *abort) = (*epoch + 1, false));
    }

    /// Breaks every open watch connection mid-stream, as a restarting API server or a lost
    /// network path does.
    pub fn break_watches(&self) {
        self.drops
            .send_modify(|(epoch, abort)| (*epoch, *abort) = (*epoch + 1, true));
    }

    /// Applies changes that no watch will ever replay, moves the compaction floor past every
    /// version handed out so far and drops the watches: a client can only catch up by
    /// re-listing after the `410 Gone` its resumed watch gets.
    pub fn compact_with(&self, puts: Vec<Value>, deletes: &[(&str, &str)]) {
        for pod in puts {
            self.commit(key_of(&pod), Some(pod), false);
        }
        for (ns, name) in deletes {
            self.commit(
                ("Pod".into(), ns.to_string(), name.to_string()),
                None,
                false,
            );
        }
        {
            let mut inner = self.inner.lock().unwrap();
            inner.floor = inner.rv;
        }
        self.drop_watches();
    }

    pub fn fail_lists(&self, fail: bool) {
        self.inner.lock().unwrap().fail_lists = fail;
    }

    /// Lists fail with `status` from now on.
    pub fn fail_lists_with(&self, status: u16) {
        let mut inner = self.inner.lock().unwrap();
        inner.fail_lists = true;
        inner.fail_status = Some(status);
    }

    pub fn failed_lists(&self) -> usize {
        self.inner.lock().unwrap().failed_lists
    }

    /// When each failed pod list came, in order.
    pub fn failed_list_times(&self) -> Vec<std::time::Instant> {
        self.inner.lock().unwrap().failed_list_times.clone()
    }

    pub fn hang_lists(&self, hang: bool) {
        self.inner.lock().unwrap().hang_lists = hang;
    }

    /// Never returns for a list request while lists hang (the client gives up, or not).
    async fn maybe_hang(&self, q: &HashMap<String, String>) {
        let watch = q.get("watch").map(String::as_str) == Some("true");
        if !watch && self.inner.lock().unwrap().hang_lists {
            std::future::pending::<()>().await;
        }
    }

    /// (lists, watches, 410s) served so far.
    pub fn counts(&self) -> (usize, usize, usize) {
        let inner = self.inner.lock().unwrap();
        (inner.lists, inner.watches, inner.gone)
    }

    fn list(&self, filter: &Filter) -> Response {
        let mut inner = self.inner.lock().unwrap();
        if inner.fail_lists {
            if filter.kind == "Pod" {
                inner.failed_lists += 1;
                inner.failed_list_times.push(std::time::Instant::now());
            }
            let code = inner.fail_status.unwrap_or(500);
            let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "code": code, "reason": "InternalError",
                "message": "etcdserver: request timed out"});
            let http = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return (http, axum::Json(status)).into_response();
        }
        if filter.kind == "Pod" {
            inner.lists += 1;
        }
        // Like the real server, list items carry neither apiVersion nor kind.
        let items: Vec<Value> = inner
            .pods
            .values()
            .filter(|p| filter.matches(p))
            .map(|p| {
                let mut p = p.clone();
                if let Some(obj) = p.as_object_mut() {
                    obj.remove("apiVersion");
                    obj.remove("kind");
                }
                p
            })
            .collect();
        axum::Json(
            json!({"kind": format!("{}List", filter.kind), "apiVersion": "v1",
            "metadata": {"resourceVersion": inner.rv.to_string()}, "items": items}),
        )
        .into_response()
    }

    fn watch(&self, filter: Filter, from: Option<u64>, bookmarks: bool) -> Response {
        let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
        let api = self.clone();
        let mut changes = self.changes.subscribe();
        let mut drops = self.drops.subscribe();
        let (start, expired) = {
            let mut inner = self.inner.lock().unwrap();
            if filter.kind == "Pod" {
                inner.watches += 1;
            }
            let start = from.unwrap_or(inner.rv);
            let expired = start < inner.floor;
            if expired {
                inner.gone += 1;
            }
            (start, expired)
        };
        tokio::spawn(async move {
            if expired {
                let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
                    "metadata": {}, "status": "Failure", "code": 410, "reason": "Expired",
                    "message": "too old resource version"}});
                let _ = tx.send(line(&gone)).await;
                return;
            }
            let mut sent = start;
            let mut first = true;
            loop {
                // Bookmarks only vouch for recorded history: a silent (compacted) change must
                // not be covered by one, or the client would resume past it without a 410.
                let (events, now) = {
                    let inner = api.inner.lock().unwrap();
                    let fresh: Vec<&Change> =
                        inner.history.iter().filter(|c| c.rv > sent).collect();
                    let now = fresh.last().map_or(sent, |c| c.rv);
                    let events: Vec<Value> = fresh.iter().filter_map(|c| filter.event(c)).collect();
                    (events, now)
                };
                for event in events {
                    if tx.send(line(&event)).await.is_err() {
                        return;
                    }
                }
                if bookmarks && (first || now > sent) {
                    let mark = json!({"type": "BOOKMARK", "object": {"kind": "Pod",
                        "apiVersion": "v1", "metadata": {"resourceVersion": now.to_string()}}});
                    if tx.send(line(&mark)).await.is_err() {
                        return;
                    }
                }
                first = false;
                sent = now;
                tokio::select! {
                    r = changes.changed() => if r.is_err() { return },
                    _ = drops.changed() => {
                        let abort = drops.borrow().1;
                        if abort {
                            let _ = tx.send(Err(std::io::Error::other("connection reset"))).await;
                        }
                        return;
                    }
                    _ = tx.closed() => return,
                }
            }
        });
        let body = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(body))
            .unwrap()
    }

    fn serve(
        &self,
        kind: &'static str,
        namespace: Option<String>,
        q: HashMap<String, String>,
    ) -> Response {
        if kind == "ModelAdapter" && self.inner.lock().unwrap().deny_adapters {
            let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "code": 403, "reason": "Forbidden",
                "message": "modeladapters.model.aibrix.ai is forbidden"});
            return (StatusCode::FORBIDDEN, axum::Json(status)).into_response();
        }
        let filter = Filter {
            kind,
            namespace,
            selector: q.get("labelSelector").cloned(),
        };
        if q.get("watch").map(String::as_str) == Some("true") {
            let from = q.get("resourceVersion").and_then(|v| v.parse().ok());
            let bookmarks = q.get("allowWatchBookmarks").map(String::as_str) == Some("true");
            self.watch(filter, from, bookmarks)
        } else {
            self.list(&filter)
        }
    }
}

async fn all_pods(
    State(api): State<FakeApi>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    api.maybe_hang(&q).await;
    api.serve("Pod", None, q)
}

async fn namespaced_pods(
    State(api): State<FakeApi>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    api.maybe_hang(&q).await;
    api.serve("Pod", Some(ns), q)
}

const ADAPTERS: &str = "/apis/model.aibrix.ai/v1alpha1/modeladapters";
const ADAPTERS_NS: &str = "/apis/model.aibrix.ai/v1alpha1/namespaces";

async fn all_adapters(
    State(api): State<FakeApi>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    api.serve("ModelAdapter", None, q)
}

async fn namespaced_adapters(
    State(api): State<FakeApi>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    api.serve("ModelAdapter", Some(ns), q)
}

// ---------------------------------------------------------------------------------------------
// Pod writes and Leases

/// A `kind: Status` failure, as the API server answers it (kube-rs parses it into its error).
fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "code": code.as_u16(), "reason": reason, "message": message});
    (code, axum::Json(body)).into_response()
}

fn not_found(resource: &str, name: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{resource} {name:?} not found"),
    )
}

/// Applies the RFC 7386 JSON merge patch `patch` to `target`.
fn merge(target: &mut Value, patch: &Value) {
    let Some(fields) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let Some(object) = target.as_object_mut() else {
        return;
    };
    for (k, v) in fields {
        if v.is_null() {
            object.remove(k);
        } else {
            merge(object.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// Stores `new` (or deletes, for `None`) under a fresh version; returns that version. The
/// caller wakes the watches once the lock is released.
fn commit_in(inner: &mut Inner, key: Key, new: Option<Value>, record: bool) -> u64 {
    inner.rv += 1;
    let rv = inner.rv;
    let new = new.map(|mut pod| {
        pod["metadata"]["resourceVersion"] = json!(rv.to_string());
        pod
    });
    let old = match &new {
        Some(pod) => inner.pods.insert(key, pod.clone()),
        None => inner.pods.remove(&key),
    };
    if record {
        inner.history.push(Change { rv, old, new });
    }
    rv
}

async fn get_pod(State(api): State<FakeApi>, Path((ns, name)): Path<(String, String)>) -> Response {
    let inner = api.inner.lock().unwrap();
    match inner.pods.get(&("Pod".to_string(), ns, name.clone())) {
        Some(pod) => axum::Json(pod.clone()).into_response(),
        None => not_found("pods", &name),
    }
}

/// A merge-PATCH of a pod (what the elector sends for its label), committed as a change
/// watches see; any other patch type is refused as the API server refuses unknown ones.
async fn patch_pod(
    State(api): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !content_type.starts_with("application/merge-patch+json") {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            &format!("the body of the request was in an unknown format: {content_type}"),
        );
    }
    let Ok(patch) = serde_json::from_slice::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON patch");
    };
    let key = ("Pod".to_string(), ns, name.clone());
    let mut inner = api.inner.lock().unwrap();
    let Some(mut pod) = inner.pods.get(&key).cloned() else {
        return not_found("pods", &name);
    };
    merge(&mut pod, &patch);
    inner.pod_patches += 1;
    let rv = commit_in(&mut inner, key.clone(), Some(pod), true);
    let stored = inner.pods[&key].clone();
    drop(inner);
    api.changes.send_replace(rv);
    axum::Json(stored).into_response()
}

fn holder_of(lease: &Value) -> Option<String> {
    lease["spec"]["holderIdentity"]
        .as_str()
        .filter(|h| !h.is_empty())
        .map(str::to_string)
}

/// Stores a Lease write under a fresh version and records it; returns what is stored.
fn store_lease(
    inner: &mut Inner,
    verb: &'static str,
    ns: &str,
    name: &str,
    mut lease: Value,
) -> Value {
    inner.rv += 1;
    let rv = inner.rv;
    lease["apiVersion"] = json!("coordination.k8s.io/v1");
    lease["kind"] = json!("Lease");
    lease["metadata"]["namespace"] = json!(ns);
    lease["metadata"]["name"] = json!(name);
    lease["metadata"]["resourceVersion"] = json!(rv.to_string());
    inner.lease_writes.push(LeaseWrite {
        verb,
        namespace: ns.to_string(),
        name: name.to_string(),
        holder: holder_of(&lease),
        transitions: lease["spec"]["leaseTransitions"].as_i64().unwrap_or(0),
        rv,
    });
    inner
        .leases
        .insert((ns.to_string(), name.to_string()), lease.clone());
    lease
}

/// The Lease a write carries, or `None` for a body that is no JSON object.
fn lease_body(body: &Bytes) -> Option<Value> {
    serde_json::from_slice::<Value>(body)
        .ok()
        .filter(Value::is_object)
}

fn bad_lease() -> Response {
    status(StatusCode::BAD_REQUEST, "BadRequest", "invalid Lease body")
}

async fn get_lease(
    State(api): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    match api.lease(&ns, &name) {
        Some(lease) => axum::Json(lease).into_response(),
        None => not_found("leases.coordination.k8s.io", &name),
    }
}

/// POST: 201, or 409 AlreadyExists.
async fn create_lease(State(api): State<FakeApi>, Path(ns): Path<String>, body: Bytes) -> Response {
    let Some(lease) = lease_body(&body) else {
        return bad_lease();
    };
    let Some(name) = lease["metadata"]["name"].as_str().map(str::to_string) else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "a Lease needs a name",
        );
    };
    let mut inner = api.inner.lock().unwrap();
    if inner.leases.contains_key(&(ns.clone(), name.clone())) {
        inner.lease_conflicts += 1;
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("leases.coordination.k8s.io {name:?} already exists"),
        );
    }
    let stored = store_lease(&mut inner, "create", &ns, &name, lease);
    (StatusCode::CREATED, axum::Json(stored)).into_response()
}

/// PUT: 409 Conflict unless the body carries the stored resourceVersion (stricter than the
/// real server, which would let a Lease update without one through: the elector must always
/// send the version it read).
async fn replace_lease(
    State(api): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let Some(lease) = lease_body(&body) else {
        return bad_lease();
    };
    if lease["metadata"]["name"].as_str() != Some(name.as_str()) {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "the name of the object does not match the name on the URL",
        );
    }
    let mut inner = api.inner.lock().unwrap();
    let Some(stored) = inner.leases.get(&(ns.clone(), name.clone())) else {
        return not_found("leases.coordination.k8s.io", &name);
    };
    if lease["metadata"]["resourceVersion"] != stored["metadata"]["resourceVersion"] {
        inner.lease_conflicts += 1;
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on leases.coordination.k8s.io {name:?}: the object \
                 has been modified; please apply your changes to the latest version and try again"
            ),
        );
    }
    let stored = store_lease(&mut inner, "replace", &ns, &name, lease);
    axum::Json(stored).into_response()
}

// ---------------------------------------------------------------------------------------------
// Doors

/// What a [`Door`] does to the requests through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Passes everything.
    Open,
    /// Answers every request 503 and cuts the responses it is still streaming (watches), as
    /// an API server this replica can no longer reach.
    Down,
    /// Answers pod PATCHes 503 (a label write that cannot succeed); the rest passes.
    PodWrites,
}

/// A second address onto a [`FakeApi`]'s state: one replica's own path to the API server.
#[derive(Clone)]
pub struct Door {
    addr: SocketAddr,
    fault: Arc<watch::Sender<Fault>>,
    /// Requests refused so far.
    refused: Arc<AtomicUsize>,
}

impl Door {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Requests this door refused so far.
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::Relaxed)
    }
}

fn refuses(fault: Fault, method: &Method, path: &str) -> bool {
    match fault {
        Fault::Open => false,
        Fault::Down => true,
        Fault::PodWrites => {
            method == Method::PATCH
                && path.starts_with("/api/v1/namespaces/")
                && path.contains("/pods/")
        }
    }
}

async fn guard(State(door): State<Door>, req: Request, next: Next) -> Response {
    let fault = *door.fault.borrow();
    if refuses(fault, req.method(), req.uri().path()) {
        door.refused.fetch_add(1, Ordering::Relaxed);
        return status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the test closed this door",
        );
    }
    let (parts, body) = next.run(req).await.into_parts();
    // What is still streaming when the door goes down breaks, as on a lost network path.
    let down = door.fault.subscribe();
    let stream =
        futures_util::stream::unfold(Some((body.into_data_stream(), down)), |state| async move {
            let (mut body, down) = state?;
            let mut watching = down.clone();
            let cut = async move {
                let _ = watching.wait_for(|f| *f == Fault::Down).await;
            };
            tokio::select! {
                item = body.next() => {
                    let item = item?.map_err(std::io::Error::other);
                    Some((item, Some((body, down))))
                }
                _ = cut => Some((Err(std::io::Error::other("door closed")), None)),
            }
        });
    Response::from_parts(parts, Body::from_stream(stream))
}

// ---------------------------------------------------------------------------------------------
// Objects

/// An AIBrix `ModelAdapter` whose status lists `instances`.
pub fn adapter(ns: &str, name: &str, instances: &[&str]) -> Value {
    json!({
        "apiVersion": "model.aibrix.ai/v1alpha1",
        "kind": "ModelAdapter",
        "metadata": {"namespace": ns, "name": name},
        "status": {"instances": instances},
    })
}

/// A model pod; `ip: None` is a pod not yet scheduled.
pub fn pod(ns: &str, name: &str, model: &str, ip: Option<&str>, ready: bool) -> Value {
    let ready_status = if ready { "True" } else { "False" };
    let mut p = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": ns, "name": name, "labels": {MODEL: model}},
        "status": {"conditions": [{"type": "Ready", "status": ready_status}]},
    });
    if let Some(ip) = ip {
        p["status"]["podIP"] = json!(ip);
    }
    p
}
