//! The endpoints of the gateway's retrying cluster: a file (`--eds-file`) and a gRPC EDS stream
//! (`--xds-listen`, see `xds`).
//!
//! Envoy's ORIGINAL_DST cluster reaches any address the filter names, but cannot retry on
//! another: its host comes from one header that a retry does not change. The retrying
//! cluster (`pd_pods_retry` in `envoy/envoy.yaml.tmpl`) uses the `override_host` load
//! balancer instead, which takes the filter's `chosen,stand-in` list one host per attempt, but
//! only among hosts the cluster knows. [`EdsWriter`] is how it knows them: one
//! `ClusterLoadAssignment`, written as a `DiscoveryResponse` file that a path config source
//! reloads when a new one is renamed into its watched directory, and handed to the EDS
//! streams of gateways that cannot read pd-control's filesystem (an Istio gateway).
//!
//! Every pod with an address that serves HTTP is listed, ready or not: a pod gets its IP well before it is
//! routable, so by the time a snapshot names it, Envoy has long known it. A pod that leaves
//! stays listed for [`LINGER`], as requests routed on an older snapshot may still name it.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::fleet::PodRecord;

/// The retrying cluster's name in `envoy/envoy.yaml.tmpl`.
pub const DEFAULT_CLUSTER: &str = "pd_pods_retry";

/// How long a pod that left the fleet stays listed.
pub const LINGER: Duration = Duration::from_secs(30);

/// Why the endpoint file could not be written. The previous file stays in force.
#[derive(Debug, thiserror::Error)]
#[error("cannot write the endpoint file {path}: {source}")]
pub struct EdsError {
    path: String,
    source: std::io::Error,
}

/// The retrying cluster's endpoints at one version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listing {
    pub cluster: String,
    /// Bumped on every change of `endpoints`; 0 before the fleet was first taken in.
    pub version: u64,
    /// `(ip, port)`, sorted.
    pub endpoints: Vec<(String, u16)>,
}

/// Keeps the endpoint listing in step with the fleet, in the file and for the EDS streams.
#[derive(Debug)]
pub struct EdsWriter {
    path: Option<PathBuf>,
    /// `(ip, port)` → when the fleet last held it.
    seen: BTreeMap<(String, u16), Instant>,
    listing: watch::Sender<Arc<Listing>>,
    /// The version the file holds; `None` until the first write lands.
    written: Option<u64>,
    /// The newest version on disk, held by each blocking write while it runs: writes go one
    /// at a time, and an older listing never replaces a newer one, even from a write that
    /// outlived the update that started it.
    on_disk: Arc<Mutex<u64>>,
}

impl EdsWriter {
    /// A listing written to `path` (if any) and offered to [`EdsWriter::subscribe`]rs.
    pub fn new(path: Option<PathBuf>, cluster: impl Into<String>) -> EdsWriter {
        let empty = Listing {
            cluster: cluster.into(),
            version: 0,
            endpoints: Vec::new(),
        };
        EdsWriter {
            path,
            seen: BTreeMap::new(),
            listing: watch::Sender::new(Arc::new(empty)),
            written: None,
            on_disk: Arc::new(Mutex::new(0)),
        }
    }

    /// The listing now and as it changes (the EDS streams' source).
    pub fn subscribe(&self) -> watch::Receiver<Arc<Listing>> {
        self.listing.subscribe()
    }

    /// Takes in the fleet as of `now`; a changed set gets a new version, handed to the
    /// streams at once and written to the file (also when an earlier write failed). Returns
    /// whether the file was written. The write (rendering, `fsync`, rename) runs on tokio's
    /// blocking pool, not on the async workers that serve snapshots; it is awaited, so the
    /// caller still publishes a snapshot only once the file lists its pods.
    pub async fn update(&mut self, fleet: &[PodRecord], now: Instant) -> Result<bool, EdsError> {
        let listing = self.take_in(fleet, now);
        let Some(path) = &self.path else {
            return Ok(false);
        };
        if self.written == Some(listing.version) {
            return Ok(false);
        }
        let error = |source| EdsError {
            path: path.display().to_string(),
            source,
        };
        let (on_disk, file) = (self.on_disk.clone(), path.clone());
        let version = listing.version;
        let written = tokio::task::spawn_blocking(move || {
            write_newer(&on_disk, &file, version, render(&listing).as_bytes())
        })
        .await
        .map_err(|join| error(std::io::Error::other(join)))?
        .map_err(error)?;
        self.written = Some(version);
        Ok(written)
    }

    /// Takes in the fleet as of `now` and returns the listing, under a new version (handed to
    /// the streams) when its set of endpoints changed.
    fn take_in(&mut self, fleet: &[PodRecord], now: Instant) -> Arc<Listing> {
        for pod in fleet.iter().filter(|p| !p.ip.is_empty() && p.serves_http) {
            self.seen.insert((pod.ip.clone(), pod.port), now);
        }
        self.seen
            .retain(|_, last| now.saturating_duration_since(*last) <= LINGER);
        let current = self.listing.borrow().clone();
        let fresh = current.version == 0
            || current.endpoints.len() != self.seen.len()
            || !current.endpoints.iter().eq(self.seen.keys());
        if !fresh {
            return current;
        }
        let next = Arc::new(Listing {
            cluster: current.cluster.clone(),
            version: current.version + 1,
            endpoints: self.seen.keys().cloned().collect(),
        });
        self.listing.send_replace(next.clone());
        next
    }
}

/// Writes `bytes`, the listing at `version`, unless `on_disk` says the file already holds
/// that version or a newer one; returns whether it wrote. Blocking.
fn write_newer(
    on_disk: &Mutex<u64>,
    path: &Path,
    version: u64,
    bytes: &[u8],
) -> std::io::Result<bool> {
    let mut newest = on_disk.lock().unwrap_or_else(PoisonError::into_inner);
    if *newest >= version {
        return Ok(false);
    }
    write_by_rename(path, bytes)?;
    *newest = version;
    Ok(true)
}

/// The `DiscoveryResponse` Envoy's path config source reads.
fn render(listing: &Listing) -> String {
    let lb_endpoints: Vec<serde_json::Value> = listing
        .endpoints
        .iter()
        .map(|(ip, port)| {
            serde_json::json!({
                "endpoint": {"address": {"socket_address": {"address": ip, "port_value": port}}}
            })
        })
        .collect();
    serde_json::json!({
        "version_info": listing.version.to_string(),
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": listing.cluster,
            "endpoints": [{"lb_endpoints": lb_endpoints}],
        }],
    })
    .to_string()
}

/// What an endpoint file lists: its cluster and its endpoints as `ip:port` (an IPv6 address
/// as written, without brackets); `None` for a file that is not a listing of this shape. Reads
/// back what [`EdsWriter`] wrote, for tests and for checking a deployed file.
pub fn read_listing(path: &Path) -> Option<(String, Vec<String>)> {
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    let assignment = &doc["resources"][0];
    if assignment["@type"] != "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment" {
        return None;
    }
    let endpoints = assignment["endpoints"][0]["lb_endpoints"]
        .as_array()?
        .iter()
        .map(|e| {
            let a = &e["endpoint"]["address"]["socket_address"];
            Some(format!(
                "{}:{}",
                a["address"].as_str()?,
                a["port_value"].as_u64()?
            ))
        })
        .collect::<Option<Vec<_>>>()?;
    Some((assignment["cluster_name"].as_str()?.to_string(), endpoints))
}

/// Writes a sibling file and renames it over `path`: Envoy reloads on the move into the
/// watched directory and never reads a half-written file.
fn write_by_rename(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: &str, port: u16) -> PodRecord {
        PodRecord {
            port,
            ..PodRecord::sample(name, ip)
        }
    }

    fn listed(path: &Path) -> Vec<String> {
        read_listing(path).expect("an endpoint listing").1
    }

    #[tokio::test]
    async fn lists_every_pod_with_an_address_and_writes_only_on_change() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("pods.json");
        let mut eds = EdsWriter::new(Some(path.clone()), "pd_pods_retry");
        let t0 = Instant::now();
        let mut follower = pod("d", "10.0.0.4", 8000);
        follower.serves_http = false;
        let fleet = vec![
            pod("a", "10.0.0.1", 8000),
            pod("b", "", 8000),
            pod("c", "fd00::7", 8001),
            follower,
        ];
        assert!(eds.update(&fleet, t0).await.expect("write"));
        let (cluster, endpoints) = read_listing(&path).expect("an endpoint listing");
        assert_eq!(cluster, "pd_pods_retry");
        assert_eq!(endpoints, ["10.0.0.1:8000", "fd00::7:8001"]);
        assert!(!eds
            .update(&fleet, t0 + Duration::from_secs(1))
            .await
            .expect("same"));
        assert!(!path.with_extension("json.tmp").exists());
    }

    #[tokio::test]
    async fn the_streams_get_a_new_version_only_when_the_set_changes() {
        let mut eds = EdsWriter::new(None, "pd_pods_retry");
        let listing = eds.subscribe();
        assert_eq!(listing.borrow().version, 0, "nothing taken in yet");
        let t0 = Instant::now();
        let fleet = [pod("a", "10.0.0.1", 8000)];
        assert!(!eds.update(&fleet, t0).await.expect("no file to write"));
        let first = listing.borrow().clone();
        assert_eq!(first.version, 1);
        assert_eq!(first.endpoints, [("10.0.0.1".to_string(), 8000)]);
        eds.update(&fleet, t0 + Duration::from_secs(1))
            .await
            .expect("same set");
        assert_eq!(listing.borrow().version, 1);
        let grown = [pod("a", "10.0.0.1", 8000), pod("b", "10.0.0.2", 8000)];
        eds.update(&grown, t0 + Duration::from_secs(2))
            .await
            .expect("grown");
        assert_eq!(listing.borrow().version, 2);
        assert_eq!(listing.borrow().endpoints.len(), 2);
    }

    #[tokio::test]
    async fn a_pod_that_left_lingers_then_goes() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("pods.json");
        let mut eds = EdsWriter::new(Some(path.clone()), "c");
        let t0 = Instant::now();
        eds.update(
            &[pod("a", "10.0.0.1", 8000), pod("b", "10.0.0.2", 8000)],
            t0,
        )
        .await
        .expect("write");
        let only_a = [pod("a", "10.0.0.1", 8000)];
        assert!(!eds.update(&only_a, t0 + LINGER).await.expect("b lingers"));
        assert_eq!(listed(&path), ["10.0.0.1:8000", "10.0.0.2:8000"]);
        assert!(eds
            .update(&only_a, t0 + LINGER + Duration::from_millis(1))
            .await
            .expect("b goes"));
        assert_eq!(listed(&path), ["10.0.0.1:8000"]);
    }

    #[tokio::test]
    async fn an_unwritable_path_is_an_error_and_is_tried_again() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("missing").join("pods.json");
        let mut eds = EdsWriter::new(Some(path.clone()), "c");
        let fleet = [pod("a", "10.0.0.1", 8000)];
        let e = eds
            .update(&fleet, Instant::now())
            .await
            .expect_err("no directory");
        assert!(e.to_string().contains("missing"), "{e}");
        std::fs::create_dir(dir.path().join("missing")).expect("mkdir");
        assert!(eds
            .update(&fleet, Instant::now())
            .await
            .expect("written now"));
    }

    #[test]
    fn an_older_listing_never_replaces_a_newer_one() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("pods.json");
        let listing = |version, ip: &str| Listing {
            cluster: "c".into(),
            version,
            endpoints: vec![(ip.into(), 8000)],
        };
        let on_disk = Mutex::new(0);
        let v2 = render(&listing(2, "10.0.0.2"));
        assert!(write_newer(&on_disk, &path, 2, v2.as_bytes()).expect("write"));
        // A write of version 1 that ran late (its update was dropped mid-way, say).
        let v1 = render(&listing(1, "10.0.0.1"));
        assert!(!write_newer(&on_disk, &path, 1, v1.as_bytes()).expect("skipped"));
        assert!(!write_newer(&on_disk, &path, 2, v2.as_bytes()).expect("there already"));
        assert_eq!(listed(&path), ["10.0.0.2:8000"]);
        let v3 = render(&listing(3, "10.0.0.3"));
        assert!(write_newer(&on_disk, &path, 3, v3.as_bytes()).expect("newer"));
        assert_eq!(listed(&path), ["10.0.0.3:8000"]);
    }
}
