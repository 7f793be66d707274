//! A whole local stack for one test: pd-sim pods, pd-control on a fleet file, and the real
//! Envoy with the built filter, each on its own loopback addresses, stopped on drop.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::http;

/// One pod of a test fleet.
#[derive(Debug, Clone)]
pub struct PodSpec {
    pub model: String,
    pub name: String,
    pub role: String,
    pub roleset: String,
    pub ip: String,
    pub port: u16,
    pub ready: bool,
    /// Raw `model.aibrix.ai/config` annotation, empty for none.
    pub config: String,
    /// `model.aibrix.ai/engine` label.
    pub engine: String,
    /// `model.aibrix.ai/sglang-bootstrap-port` annotation, when set.
    pub bootstrap_port: Option<u16>,
    /// Further labels (for `external-filter` selectors).
    pub labels: Vec<(String, String)>,
    /// The Ready condition's `lastTransitionTime` (RFC 3339), when set.
    pub ready_since: Option<String>,
}

impl PodSpec {
    /// `ip:port` as the filter writes it in `target-pod-ip`, an IPv6 address in brackets.
    pub fn address(&self) -> String {
        if self.ip.contains(':') {
            format!("[{}]:{}", self.ip, self.port)
        } else {
            format!("{}:{}", self.ip, self.port)
        }
    }
}

/// A fleet of pods of one model on one random loopback /24, so every pod has its own IP.
#[derive(Debug, Clone)]
pub struct Fleet {
    pub model: String,
    /// Engine label of pods added from now on.
    engine: String,
    pub pods: Vec<PodSpec>,
    /// AIBrix `ModelAdapter`s: a LoRA adapter's name and the pods that loaded it.
    pub adapters: Vec<(String, Vec<String>)>,
    subnet: String,
    port: u16,
}

impl Fleet {
    pub fn new(model: &str) -> Fleet {
        let subnet = format!("127.{}.{}", fastrand::u8(100..250), fastrand::u8(1..250));
        Fleet {
            model: model.into(),
            engine: "vllm".into(),
            pods: Vec::new(),
            adapters: Vec::new(),
            subnet,
            port: free_port(),
        }
    }

    /// A PD pair (`p0`, `d0` of roleset `g0`), which single-pod strategies must never pick,
    /// and three standard pods `c0`, `c1`, `c2`.
    pub fn pair_and_three_standard(model: &str) -> Fleet {
        Fleet::new(model)
            .pod("p0", "prefill", "g0")
            .pod("d0", "decode", "g0")
            .combined("c0")
            .combined("c1")
            .combined("c2")
    }

    /// Adds a pod; `role` "prefill"/"decode"/other, `roleset` may be empty.
    pub fn pod(mut self, name: &str, role: &str, roleset: &str) -> Fleet {
        let ip = format!("{}.{}", self.subnet, self.pods.len() + 10);
        self.pods.push(PodSpec {
            model: self.model.clone(),
            name: name.into(),
            role: role.into(),
            roleset: roleset.into(),
            ip,
            port: self.port,
            ready: true,
            config: String::new(),
            engine: self.engine.clone(),
            bootstrap_port: None,
            labels: Vec::new(),
            ready_since: None,
        });
        self
    }

    /// The `model.aibrix.ai/engine` label of every pod added after this call.
    pub fn engine(mut self, engine: &str) -> Fleet {
        self.engine = engine.into();
        self
    }

    /// Sets the last added pod's `model.aibrix.ai/sglang-bootstrap-port` annotation.
    pub fn bootstrap_port(mut self, port: u16) -> Fleet {
        if let Some(p) = self.pods.last_mut() {
            p.bootstrap_port = Some(port);
        }
        self
    }

    /// Adds a standard pod (`combined: true`) that runs whole requests.
    pub fn combined(self, name: &str) -> Fleet {
        let mut f = self.pod(name, "all", "");
        if let Some(p) = f.pods.last_mut() {
            p.config = r#"{"profiles":{"default":{"routingConfig":{"combined":true}}}}"#.into();
        }
        f
    }

    /// Moves the last added pod to the IPv6 loopback `::1`, on a port of its own (there is
    /// only one IPv6 loopback address to spread pods over).
    pub fn ipv6(mut self) -> Fleet {
        let port = loop {
            let port = free_port();
            if TcpListener::bind(("::1", port)).is_ok() {
                break port;
            }
        };
        if let Some(p) = self.pods.last_mut() {
            p.ip = "::1".into();
            p.port = port;
        }
        self
    }

    /// Adds a label to the last added pod.
    pub fn label(mut self, key: &str, value: &str) -> Fleet {
        if let Some(p) = self.pods.last_mut() {
            p.labels.push((key.into(), value.into()));
        }
        self
    }

    /// Moves the last added pod to another model.
    pub fn of_model(mut self, model: &str) -> Fleet {
        if let Some(p) = self.pods.last_mut() {
            p.model = model.into();
        }
        self
    }

    /// Sets the last added pod's `model.aibrix.ai/config` annotation.
    pub fn config(mut self, json: &str) -> Fleet {
        if let Some(p) = self.pods.last_mut() {
            p.config = json.into();
        }
        self
    }

    /// Sets when the last added pod became ready (RFC 3339, the Ready condition's
    /// `lastTransitionTime`).
    pub fn ready_since(mut self, time: &str) -> Fleet {
        if let Some(p) = self.pods.last_mut() {
            p.ready_since = Some(time.into());
        }
        self
    }

    /// Declares a LoRA adapter (an AIBrix `ModelAdapter`) loaded on `pods`.
    pub fn adapter(mut self, name: &str, pods: &[&str]) -> Fleet {
        self.adapters
            .push((name.into(), pods.iter().map(|p| p.to_string()).collect()));
        self
    }

    /// Marks the last added pod not ready.
    pub fn not_ready(mut self) -> Fleet {
        if let Some(p) = self.pods.last_mut() {
            p.ready = false;
        }
        self
    }

    pub fn spec(&self, name: &str) -> &PodSpec {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name} in the fleet"))
    }

    pub fn without(&self, name: &str) -> Fleet {
        let mut f = self.clone();
        f.pods.retain(|p| p.name != name);
        f
    }

    /// Kubernetes `v1` `List` of Pods, as `kubectl get pods -o yaml` prints.
    pub fn to_yaml(&self) -> String {
        let mut out = String::from("apiVersion: v1\nkind: List\nitems:\n");
        for p in &self.pods {
            out.push_str(&format!(
                "- apiVersion: v1\n  kind: Pod\n  metadata:\n    name: {}\n    namespace: default\n    labels:\n      model.aibrix.ai/name: {}\n      model.aibrix.ai/port: \"{}\"\n      model.aibrix.ai/engine: {}\n",
                p.name, p.model, p.port, p.engine
            ));
            if !p.role.is_empty() {
                out.push_str(&format!("      role-name: {}\n", p.role));
            }
            if !p.roleset.is_empty() {
                out.push_str(&format!("      roleset-name: {}\n", p.roleset));
            }
            for (key, value) in &p.labels {
                out.push_str(&format!("      {key}: \"{value}\"\n"));
            }
            if !p.config.is_empty() || p.bootstrap_port.is_some() {
                out.push_str("    annotations:\n");
            }
            if !p.config.is_empty() {
                out.push_str(&format!("      model.aibrix.ai/config: '{}'\n", p.config));
            }
            if let Some(port) = p.bootstrap_port {
                out.push_str(&format!(
                    "      model.aibrix.ai/sglang-bootstrap-port: \"{port}\"\n"
                ));
            }
            out.push_str(&format!(
                "  status:\n    podIP: \"{}\"\n    conditions:\n    - type: Ready\n      status: \"{}\"\n",
                p.ip,
                if p.ready { "True" } else { "False" }
            ));
            if let Some(time) = &p.ready_since {
                out.push_str(&format!("      lastTransitionTime: \"{time}\"\n"));
            }
        }
        for (name, pods) in &self.adapters {
            out.push_str(&format!(
                "- apiVersion: model.aibrix.ai/v1alpha1\n  kind: ModelAdapter\n  metadata:\n    name: {name}\n    namespace: default\n  status:\n    instances: [{}]\n",
                pods.join(", ")
            ));
        }
        out
    }
}

/// A port that is free now, chosen below Linux's ephemeral range (32768+): a port the kernel
/// hands out for `bind(0)` is also what it hands to outgoing connections, so between this
/// check and the child process binding it, another test's connection could take it.
///
/// A port is handed out at most once per test process: the check releases it at once, so
/// two calls in a row (a stack's listener and admin ports, or two tests starting together)
/// could otherwise both get it and one child fail with "address already in use".
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for _ in 0..1000 {
        let port = fastrand::u16(20_000..32_000);
        if !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.push(port);
            return port;
        }
    }
    panic!("no free port in 20000..32000")
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn bin(name: &str) -> PathBuf {
    let dir = std::env::var("PD_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("target/debug"));
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run `make build` (or cargo build) first",
        path.display()
    );
    path
}

fn envoy_bin() -> PathBuf {
    let path = std::env::var("ENVOY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo_root().join(".venv/envoy"));
    assert!(
        path.exists(),
        "{} is missing: run `make setup` first",
        path.display()
    );
    path
}

fn wasm_path() -> PathBuf {
    let path = std::env::var("PD_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("target/wasm32-wasip1/release/pd_router_filter.wasm"));
    assert!(
        path.exists(),
        "{} is missing: run `make build` first",
        path.display()
    );
    path
}

/// The retrying cluster's endpoint file in `eds_dir` (pd-control `--eds-file`).
pub const EDS_FILE: &str = "pd-pods.json";

/// Writes an endpoint file listing no pod into `eds_dir` unless one is there: Envoy refuses to
/// start without it, and pd-control (which writes the real one) may start after Envoy.
pub fn seed_eds(eds_dir: &Path) {
    std::fs::create_dir_all(eds_dir).expect("EDS dir");
    let path = eds_dir.join(EDS_FILE);
    if !path.exists() {
        let empty = serde_json::json!({"version_info": "0", "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": "pd_pods_retry",
        }]});
        std::fs::write(path, empty.to_string()).expect("EDS seed");
    }
}

/// Renders `envoy/envoy.yaml.tmpl`, the retrying cluster reading `eds_dir` (seeded).
pub fn render_envoy(
    listen_port: u16,
    admin_port: u16,
    control_port: u16,
    refresh_ms: u64,
    access_log: &Path,
    eds_dir: &Path,
) -> String {
    seed_eds(eds_dir);
    let template =
        std::fs::read_to_string(repo_root().join("envoy/envoy.yaml.tmpl")).expect("envoy template");
    template
        .replace("@LISTEN_ADDR@", "127.0.0.1")
        .replace("@LISTEN_PORT@", &listen_port.to_string())
        .replace("@ADMIN_PORT@", &admin_port.to_string())
        .replace("@WASM_PATH@", &wasm_path().display().to_string())
        .replace("@CONTROL_ADDR@", "127.0.0.1")
        .replace("@CONTROL_PORT@", &control_port.to_string())
        .replace("@REFRESH_MS@", &refresh_ms.to_string())
        .replace("@ACCESS_LOG@", &access_log.display().to_string())
        .replace("@EDS_DIR@", &eds_dir.display().to_string())
}

/// Passes the filter's testing hooks set in `envoy_env` (`PD_ROUTER_DEBUG_*`) to its VMs: the
/// shipped drop-in leaves them out, so that a stray variable in a production Envoy's
/// environment cannot arm them.
pub fn with_debug_env_keys(rendered: String, envoy_env: &[(&str, &str)]) -> String {
    let anchor = "                    - AIBRIX_AUTH_BEARER_TOKEN\n";
    let keys: String = envoy_env
        .iter()
        .filter(|(k, _)| k.starts_with("PD_ROUTER_DEBUG_"))
        .map(|(k, _)| format!("                    - {k}\n"))
        .collect();
    if keys.is_empty() {
        return rendered;
    }
    assert!(rendered.contains(anchor), "no host_env_keys list");
    rendered.replacen(anchor, &format!("{anchor}{keys}"), 1)
}

/// Makes a rendered drop-in's connection manager count loopback clients as internal.
pub fn with_internal_clients(rendered: String) -> String {
    let anchor = "          stat_prefix: pd_ingress\n";
    assert!(
        rendered.contains(anchor),
        "no pd_ingress connection manager"
    );
    rendered.replacen(
        anchor,
        &format!(
            "{anchor}          use_remote_address: true\n          internal_address_config:\n            cidr_ranges: [{{address_prefix: 127.0.0.0, prefix_len: 8}}]\n"
        ),
        1,
    )
}

/// Points a rendered drop-in's retrying cluster at pd-control's gRPC EDS service at `xds` as
/// an Istio gateway gets it: the drop-in's own `pd_pods_retry` goes, and the one
/// `envoy/istio/envoyfilter-clusters.yaml` adds (its gRPC target pointed at `xds`) arrives
/// over CDS, from the file `cds` (Istio sends an EnvoyFilter's clusters over ADS, never in the
/// bootstrap, and Envoy holds a dynamic cluster to rules a static one escapes: a gRPC config
/// source naming another cluster is refused, for one). `initial_fetch_timeout` bounds the
/// cluster's wait for its first listing. So the Istio manifests' cluster is what this Envoy
/// loads and runs, as Istio would deliver it.
pub fn eds_over_grpc(
    rendered: String,
    xds: &str,
    cds: &Path,
    initial_fetch_timeout: Option<&str>,
) -> String {
    use serde::Deserialize as _;
    let text = std::fs::read_to_string(repo_root().join("envoy/istio/envoyfilter-clusters.yaml"))
        .expect("the Istio cluster patches");
    let mut clusters = std::collections::BTreeMap::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let doc = serde_yaml::Value::deserialize(doc).expect("YAML");
        for patch in doc["spec"]["configPatches"]
            .as_sequence()
            .into_iter()
            .flatten()
        {
            let value = &patch["patch"]["value"];
            if let Some(name) = value["name"].as_str() {
                let json = serde_json::to_value(value).expect("JSON-shaped YAML");
                clusters.insert(name.to_string(), json);
            }
        }
    }
    let mut retry = clusters
        .remove("pd_pods_retry")
        .expect("Istio's pd_pods_retry");
    let eds_config = &mut retry["eds_cluster_config"]["eds_config"];
    if let Some(timeout) = initial_fetch_timeout {
        eds_config["initial_fetch_timeout"] = serde_json::json!(timeout);
    }
    let grpc = &mut eds_config["api_config_source"]["grpc_services"][0];
    let mut resources = Vec::new();
    if grpc["google_grpc"]["target_uri"].is_string() {
        grpc["google_grpc"]["target_uri"] = serde_json::json!(xds);
    } else if let Some(name) = grpc["envoy_grpc"]["cluster_name"].as_str() {
        // A cluster of the same patches carrying the gRPC service: over CDS as well.
        let mut carrier = clusters.remove(name).expect("the gRPC service's cluster");
        let (host, port) = xds.rsplit_once(':').expect("host:port");
        carrier["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"] = serde_json::json!({"address": host, "port_value": port.parse::<u16>().expect("a port")});
        resources.push(carrier);
    }
    resources.push(retry);
    for cluster in &mut resources {
        cluster["@type"] = serde_json::json!("type.googleapis.com/envoy.config.cluster.v3.Cluster");
    }
    std::fs::write(cds, serde_json::json!({"resources": resources}).to_string()).expect("CDS file");
    let lines: Vec<&str> = rendered.lines().collect();
    let start = lines
        .iter()
        .position(|l| *l == "  - name: pd_pods_retry")
        .expect("the drop-in's retrying cluster");
    let end = start
        + 1
        + lines[start + 1..]
            .iter()
            .position(|l| l.starts_with("  - ") || l.starts_with("  #"))
            .expect("a cluster after the retrying one");
    let mut out: Vec<String> = Vec::with_capacity(lines.len() + 5);
    for line in lines[..start].iter().chain(&lines[end..]) {
        out.push(line.to_string());
        // Its routes name a cluster that comes later, over CDS (Istio's come over RDS, which
        // Envoy does not check against the clusters it has).
        if *line == "            name: pd_routes" {
            out.push("            validate_clusters: false".into());
        }
    }
    assert!(
        out.iter().any(|l| l.ends_with("validate_clusters: false")),
        "the drop-in's route configuration"
    );
    out.push("dynamic_resources:".into());
    out.push("  cds_config:".into());
    out.push("    resource_api_version: V3".into());
    out.push(format!(
        "    path_config_source: {{path: \"{}\"}}",
        cds.display()
    ));
    let mut joined = out.join("\n");
    joined.push('\n');
    joined
}

/// Turns on `explain` in a rendered drop-in's plugin configuration.
fn enable_explain(rendered: String) -> String {
    const KEY: &str = "\"refresh_ms\":";
    assert!(
        rendered.contains(KEY),
        "plugin configuration without refresh_ms"
    );
    rendered.replacen(KEY, "\"explain\":true,\"refresh_ms\":", 1)
}

/// Renders `envoy/envoy-ecds.yaml.tmpl`: the drop-in whose wasm filter comes from ECDS,
/// read from `ecds_dir/pd-router.yaml` (see [`render_ecds`]), the retrying cluster reading
/// `eds_dir` (seeded).
pub fn render_envoy_ecds(
    listen_port: u16,
    admin_port: u16,
    control_port: u16,
    ecds_dir: &Path,
    access_log: &Path,
    eds_dir: &Path,
) -> String {
    seed_eds(eds_dir);
    let template = std::fs::read_to_string(repo_root().join("envoy/envoy-ecds.yaml.tmpl"))
        .expect("envoy ECDS template");
    template
        .replace("@LISTEN_ADDR@", "127.0.0.1")
        .replace("@LISTEN_PORT@", &listen_port.to_string())
        .replace("@ADMIN_PORT@", &admin_port.to_string())
        .replace("@CONTROL_ADDR@", "127.0.0.1")
        .replace("@CONTROL_PORT@", &control_port.to_string())
        .replace("@ECDS_DIR@", &ecds_dir.display().to_string())
        .replace("@ACCESS_LOG@", &access_log.display().to_string())
        .replace("@EDS_DIR@", &eds_dir.display().to_string())
}

/// Renders `envoy/ecds-pd-router.yaml.tmpl`, the ECDS resource holding the wasm filter
/// config, with `key_values` as the VM's `environment_variables.key_values`.
pub fn render_ecds(refresh_ms: u64, key_values: &[(&str, &str)]) -> String {
    let template = std::fs::read_to_string(repo_root().join("envoy/ecds-pd-router.yaml.tmpl"))
        .expect("ECDS resource template");
    // JSON strings are valid YAML double-quoted scalars.
    let env = key_values
        .iter()
        .map(|(k, v)| format!("{}: {}", serde_json::json!(k), serde_json::json!(v)))
        .collect::<Vec<_>>()
        .join(", ");
    // Envoy rejects a key in both host_env_keys and key_values, so an overridden key leaves
    // the host_env_keys list (lines `- KEY`).
    let mut out = String::new();
    for line in template.lines() {
        let overridden = line
            .trim()
            .strip_prefix("- ")
            .is_some_and(|key| key_values.iter().any(|(k, _)| *k == key));
        if !overridden {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.replace("@WASM_PATH@", &wasm_path().display().to_string())
        .replace("@REFRESH_MS@", &refresh_ms.to_string())
        .replace("@VM_ENV@", &env)
}

/// The ECDS resource file inside the watched directory `ecds_dir`.
const ECDS_FILE: &str = "pd-router.yaml";

/// Writes the ECDS resource atomically: a temp file in the watched directory, then a rename
/// over the resource (the rename is the event Envoy's `watched_directory` reacts to).
fn write_ecds(ecds_dir: &Path, key_values: &[(&str, &str)], plugin_extra: &str) {
    let tmp = ecds_dir.join(format!(".{ECDS_FILE}.tmp"));
    let rendered = with_plugin_extra(render_ecds(50, key_values), plugin_extra);
    std::fs::write(&tmp, rendered).expect("ECDS file");
    std::fs::rename(&tmp, ecds_dir.join(ECDS_FILE)).expect("rename ECDS file");
}

/// How to start a [`Stack`] beyond its fleet.
#[derive(Debug, Clone)]
pub struct Options<'a> {
    /// Envoy `--concurrency`.
    pub concurrency: usize,
    /// Envoy's environment (the `AIBRIX_*` variables reach the filter through it).
    pub envoy_env: &'a [(&'a str, &'a str)],
    /// pd-sim arguments (its timing model).
    pub sim_args: &'a [&'a str],
    /// Plugin configuration `explain: true`.
    pub explain: bool,
    /// Plugin configuration `refresh_ms`: the snapshot poll period and timer tick.
    pub refresh_ms: u64,
    /// Further plugin configuration members, JSON without braces (e.g.
    /// `"snapshot_stale_after_ms":1000`); empty for none. No single quotes (the drop-in
    /// holds the JSON in a single-quoted YAML scalar).
    pub plugin_extra: &'a str,
    /// Extra pd-control arguments (e.g. `--unreachable-after 0`).
    pub control_args: &'a [&'a str],
    /// The retrying cluster learns its pods from pd-control's gRPC EDS service
    /// (`--xds-listen`, as an Istio gateway does) instead of the endpoint file.
    pub eds_over_grpc: bool,
    /// Envoy's connection manager counts every loopback client as internal
    /// (`use_remote_address` with `internal_address_config` 127.0.0.0/8), as a gateway whose
    /// operator lists the clients' networks does: it then leaves their `x-envoy-*` request
    /// headers on.
    pub internal_clients: bool,
    /// The router keeps its per-request dynamic statistics (Envoy's default, and Istio's),
    /// which the drop-in switches off.
    pub dynamic_stats: bool,
    /// The drop-in's heap bound (`max_heap_size_bytes` of its overload manager) replaced by
    /// this many bytes: a bound below Envoy's heap at start puts it in overload at once.
    pub max_heap_bytes: Option<u64>,
    /// The drop-in's `stream_idle_timeout` (130 s) replaced by this many seconds.
    pub stream_idle_timeout_s: Option<u64>,
    /// The drop-in's `request_timeout` (300 s) replaced by this many seconds.
    pub request_timeout_s: Option<u64>,
}

impl Default for Options<'_> {
    fn default() -> Self {
        Options {
            concurrency: 2,
            envoy_env: &[],
            sim_args: &[],
            explain: false,
            refresh_ms: 50,
            plugin_extra: "",
            control_args: &[],
            eds_over_grpc: false,
            internal_clients: false,
            dynamic_stats: false,
            max_heap_bytes: None,
            stream_idle_timeout_s: None,
            request_timeout_s: None,
        }
    }
}

/// Running processes; killed (and reaped) on drop.
pub struct Stack {
    pub dir: PathBuf,
    pub fleet_path: PathBuf,
    pub fleet: Fleet,
    /// Envoy's data listener, `127.0.0.1:port`.
    pub gateway: String,
    pub admin: String,
    pub control: String,
    pub sim_admin: String,
    pub concurrency: usize,
    /// The watched ECDS directory when started by [`Stack::start_ecds`].
    pub ecds_dir: Option<PathBuf>,
    /// Envoy's access log (the drop-in's format).
    pub access_log: PathBuf,
    /// pd-control's EDS service (`127.0.0.1:port`) when the stack was started with
    /// [`Options::eds_over_grpc`]; the endpoint file is not written then.
    pub xds: Option<String>,
    children: Vec<(String, Child)>,
}

/// Spawns a process and waits for a line on its stdout containing `ready`.
fn spawn_until(name: &str, mut cmd: Command, ready: &str, log: &Path) -> Child {
    let stderr = std::fs::File::create(log).expect("log file");
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    let needle = ready.to_string();
    std::thread::spawn(move || {
        let mut signalled = false;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if !signalled && line.contains(&needle) {
                signalled = true;
                let _ = tx.send(());
            }
        }
    });
    if rx.recv_timeout(Duration::from_secs(30)).is_err() {
        let _ = child.kill();
        let log_text = std::fs::read_to_string(log).unwrap_or_default();
        panic!("{name} did not become ready; its log:\n{log_text}");
    }
    child
}

impl Stack {
    pub fn start(fleet: Fleet) -> Stack {
        Stack::start_with(fleet, 2, &[])
    }

    /// Starts pd-sim, pd-control and Envoy (`--concurrency`), with extra env for Envoy.
    pub fn start_with(fleet: Fleet, concurrency: usize, envoy_env: &[(&str, &str)]) -> Stack {
        Stack::start_full(fleet.clone(), fleet, concurrency, envoy_env, &[])
    }

    /// Like [`Stack::start_with`], but pd-sim serves `simulated` while pd-control (and so
    /// the router) sees `fleet` (pods missing from `simulated` refuse connections), and
    /// pd-sim gets `sim_args` (its timing model).
    pub fn start_full(
        fleet: Fleet,
        simulated: Fleet,
        concurrency: usize,
        envoy_env: &[(&str, &str)],
        sim_args: &[&str],
    ) -> Stack {
        let options = Options {
            concurrency,
            envoy_env,
            sim_args,
            ..Options::default()
        };
        Stack::start_inner(fleet, simulated, &options, None, &[])
    }

    /// Starts pd-sim serving `simulated`, pd-control on `fleet`, and Envoy with `options`.
    pub fn start_opts(fleet: Fleet, simulated: Fleet, options: &Options<'_>) -> Stack {
        Stack::start_inner(fleet, simulated, options, None, &[])
    }

    /// [`Stack::start`] with routing explanations allowed (`"explain": true`), so a request
    /// carrying `x-pd-explain: 1` gets one.
    pub fn start_explained(fleet: Fleet) -> Stack {
        let options = Options {
            explain: true,
            ..Options::default()
        };
        Stack::start_opts(fleet.clone(), fleet, &options)
    }

    /// Like [`Stack::start_full`] with extra pd-control arguments (e.g. `--redis URL`).
    pub fn start_with_control_args(
        fleet: Fleet,
        concurrency: usize,
        envoy_env: &[(&str, &str)],
        control_args: &[&str],
    ) -> Stack {
        let options = Options {
            concurrency,
            envoy_env,
            ..Options::default()
        };
        Stack::start_inner(fleet.clone(), fleet, &options, None, control_args)
    }

    /// Starts one more pd-control on the stack's fleet file with `args`; returns its address.
    pub fn add_control(&mut self, args: &[&str]) -> String {
        let addr = format!("127.0.0.1:{}", free_port());
        let n = self.children.len();
        let mut control = Command::new(bin("pd-control"));
        control
            .arg("--fleet")
            .arg(&self.fleet_path)
            .arg("--listen")
            .arg(&addr)
            .arg("--refresh-interval")
            .arg("50ms")
            .args(args);
        let child = spawn_until(
            "pd-control",
            control,
            "pd-control: listening",
            &self.dir.join(format!("pd-control-{n}.log")),
        );
        self.children.push((format!("pd-control-{n}"), child));
        addr
    }

    /// Like [`Stack::start`] (`--concurrency 2`), but Envoy runs `envoy/envoy-ecds.yaml.tmpl`:
    /// the wasm filter comes from an ECDS file in the test's temp dir, whose VM environment
    /// `key_values` can later be changed by [`Stack::update_ecds`].
    pub fn start_ecds(fleet: Fleet, key_values: &[(&str, &str)]) -> Stack {
        Stack::start_ecds_opts(fleet, key_values, &Options::default())
    }

    /// [`Stack::start_ecds`] with `options` (pd-control arguments, explanations, ...).
    pub fn start_ecds_opts(
        fleet: Fleet,
        key_values: &[(&str, &str)],
        options: &Options<'_>,
    ) -> Stack {
        Stack::start_inner(fleet.clone(), fleet, options, Some(key_values), &[])
    }

    /// Sends `signal` (e.g. `libc::SIGSTOP`) to the process started as `name` (`envoy`,
    /// `pd-control`, `pd-sim`, `envoy-N`).
    pub fn signal(&self, name: &str, signal: i32) {
        let (_, child) = self
            .children
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no process named {name}"));
        let pid = i32::try_from(child.id()).expect("pid");
        // SAFETY: kill(2) on a child this stack started and has not reaped.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "kill({pid}, {signal}) failed");
    }

    /// Kills a process of the stack by name (`envoy`, `pd-control`, `pd-sim`, `envoy-N`).
    pub fn kill(&mut self, name: &str) {
        let (_, child) = self
            .children
            .iter_mut()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no process named {name}"));
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Starts one more Envoy (`--concurrency` as the stack's) polling the same pd-control and
    /// routing to the same pods: a second gateway replica. Stopped with the stack.
    pub fn add_gateway(&mut self, envoy_env: &[(&str, &str)]) -> Gateway {
        let control = self.control.clone();
        self.add_gateway_via(&control, envoy_env)
    }

    /// Like [`Stack::add_gateway`], polling the pd-control at `control` (see
    /// [`Stack::add_control`]).
    pub fn add_gateway_via(&mut self, control: &str, envoy_env: &[(&str, &str)]) -> Gateway {
        let (gateway, log) = self.spawn_gateway(control.to_string(), envoy_env, "", |c| c);
        self.wait_gateway_loaded(&gateway, &log);
        gateway
    }

    /// One more Envoy polling `control` with `plugin_extra` in its plugin configuration,
    /// returned once its admin answers with the filter's stats defined, snapshot or not (a
    /// gateway started while pd-control is unreachable). Stopped with the stack.
    pub fn add_gateway_unloaded(
        &mut self,
        control: &str,
        plugin_extra: &str,
    ) -> (Gateway, PathBuf) {
        let (gateway, log) = self.spawn_gateway(control.to_string(), &[], plugin_extra, |c| c);
        eventually(Duration::from_secs(30), || {
            http::get(&gateway.admin, "/stats?filter=pd_router_snapshot_age_ms")
                .ok()
                .filter(|r| r.status == 200 && r.text().contains("pd_router_snapshot_age_ms"))
                .map(|_| ())
                .ok_or_else(|| format!("the Envoy never came up; log in {}", log.display()))
        });
        (gateway, log)
    }

    /// Like [`Stack::add_gateway`], its rendered drop-in passed through `edit` first (another
    /// node id, another retrying cluster).
    pub fn add_gateway_edited(&mut self, edit: impl FnOnce(String) -> String) -> Gateway {
        let control = self.control.clone();
        let (gateway, log) = self.spawn_gateway(control, &[], "", edit);
        self.wait_gateway_loaded(&gateway, &log);
        gateway
    }

    fn wait_gateway_loaded(&self, gateway: &Gateway, log: &Path) {
        let expected = (self.concurrency + 1) as u64;
        eventually(Duration::from_secs(30), || {
            (gateway.stat("pd_router_fleet_loaded_vms") >= expected)
                .then_some(())
                .ok_or_else(|| {
                    format!(
                        "the second Envoy never loaded the fleet; log in {}",
                        log.display()
                    )
                })
        });
    }

    /// Starts one more Envoy (`--concurrency` as the stack's) polling pd-control at
    /// `control`, with `envoy_env` and `plugin_extra`; returns it and its log path.
    fn spawn_gateway(
        &mut self,
        control: String,
        envoy_env: &[(&str, &str)],
        plugin_extra: &str,
        edit: impl FnOnce(String) -> String,
    ) -> (Gateway, PathBuf) {
        let (listen_port, admin_port) = (free_port(), free_port());
        let n = self.children.len();
        let control_port: u16 = control
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("control port");
        let config = self.dir.join(format!("envoy-{n}.yaml"));
        let rendered = render_envoy(
            listen_port,
            admin_port,
            control_port,
            50,
            &self.dir.join(format!("access-{n}.log")),
            &self.eds_dir(),
        );
        std::fs::write(&config, edit(with_plugin_extra(rendered, plugin_extra)))
            .expect("envoy config");
        let log = self.dir.join(format!("envoy-{n}.log"));
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&config)
            .arg("--concurrency")
            .arg(self.concurrency.to_string())
            .arg("--disable-hot-restart")
            .arg("--base-id")
            .arg(fastrand::u32(1..1_000_000).to_string())
            .arg("-l")
            .arg("info")
            .arg("--log-path")
            .arg(&log)
            .env_clear()
            .envs(envoy_env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start another envoy");
        self.children.push((format!("envoy-{n}"), child));
        let gateway = Gateway {
            gateway: format!("127.0.0.1:{listen_port}"),
            admin: format!("127.0.0.1:{admin_port}"),
        };
        (gateway, log)
    }

    /// Rewrites the ECDS resource (atomically) with new VM `key_values`; Envoy picks it up
    /// asynchronously, so callers poll for its effect.
    pub fn update_ecds(&self, key_values: &[(&str, &str)]) {
        self.update_ecds_with(key_values, "");
    }

    /// [`Stack::update_ecds`] with `plugin_extra` in the plugin configuration (as in
    /// [`Options`]).
    pub fn update_ecds_with(&self, key_values: &[(&str, &str)], plugin_extra: &str) {
        let dir = self
            .ecds_dir
            .as_ref()
            .expect("update_ecds needs a stack started by start_ecds");
        write_ecds(dir, key_values, plugin_extra);
    }

    /// `listener.<address>.worker_<n>.downstream_cx_active` of the data listener, by worker.
    pub fn active_connections_by_worker(&self) -> Vec<u64> {
        let prefix = format!("listener.{}.", self.gateway.replace(':', "_"));
        let stats = http::get(&self.admin, "/stats?filter=downstream_cx_active")
            .expect("admin")
            .text();
        (0..self.concurrency)
            .map(|w| {
                let name = format!("{prefix}worker_{w}.downstream_cx_active");
                stats
                    .lines()
                    .filter_map(|l| l.split_once(": "))
                    .find(|(n, _)| *n == name)
                    .and_then(|(_, v)| v.trim().parse().ok())
                    .unwrap_or(0)
            })
            .collect()
    }

    /// Sends `request` (raw HTTP/1.1) on new connections, never read, until every worker holds
    /// at least `per_worker` of them; returns the connections (dropping them closes them).
    pub fn connections_on_every_worker(
        &self,
        request: &str,
        per_worker: u64,
    ) -> Vec<std::net::TcpStream> {
        let mut open = Vec::new();
        while self
            .active_connections_by_worker()
            .iter()
            .any(|n| *n < per_worker)
        {
            assert!(open.len() < 40, "connections never reached every worker");
            let mut s = std::net::TcpStream::connect(&self.gateway).expect("connect");
            std::io::Write::write_all(&mut s, request.as_bytes()).expect("send");
            open.push(s);
            // Counted once the listener accepted it, so the next check sees it.
            let opened = open.len() as u64;
            eventually(Duration::from_secs(10), || {
                let n: u64 = self.active_connections_by_worker().iter().sum();
                (n >= opened)
                    .then_some(())
                    .ok_or(format!("{n} of {opened} accepted"))
            });
        }
        open
    }

    fn start_inner(
        fleet: Fleet,
        simulated: Fleet,
        options: &Options<'_>,
        ecds: Option<&[(&str, &str)]>,
        control_args: &[&str],
    ) -> Stack {
        let (concurrency, envoy_env, sim_args) =
            (options.concurrency, options.envoy_env, options.sim_args);
        let dir = std::env::temp_dir().join(format!(
            "pd-e2e-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(dir.join("eds")).expect("temp dir");
        let fleet_path = dir.join("fleet.yaml");
        std::fs::write(&fleet_path, fleet.to_yaml()).expect("fleet file");
        let (sim_admin_port, control_port, listen_port, admin_port) =
            (free_port(), free_port(), free_port(), free_port());
        let mut stack = Stack {
            dir: dir.clone(),
            fleet_path: fleet_path.clone(),
            fleet,
            gateway: format!("127.0.0.1:{listen_port}"),
            admin: format!("127.0.0.1:{admin_port}"),
            control: format!("127.0.0.1:{control_port}"),
            sim_admin: format!("127.0.0.1:{sim_admin_port}"),
            concurrency,
            ecds_dir: None,
            access_log: dir.join("access.log"),
            xds: options
                .eds_over_grpc
                .then(|| format!("127.0.0.1:{}", free_port())),
            children: Vec::new(),
        };

        let sim_fleet_path = dir.join("simulated.yaml");
        std::fs::write(&sim_fleet_path, simulated.to_yaml()).expect("fleet file");
        let mut sim = Command::new(bin("pd-sim"));
        sim.arg("--fleet")
            .arg(&sim_fleet_path)
            .arg("--admin")
            .arg(&stack.sim_admin)
            .args(sim_args);
        let child = spawn_until("pd-sim", sim, "pd-sim: serving", &dir.join("pd-sim.log"));
        stack.children.push(("pd-sim".into(), child));

        let mut control = Command::new(bin("pd-control"));
        control
            .arg("--fleet")
            .arg(&fleet_path)
            .arg("--listen")
            .arg(&stack.control)
            .arg("--refresh-interval")
            .arg("50ms")
            .args(stack.endpoint_args())
            .args(options.control_args)
            .args(control_args);
        let child = spawn_until(
            "pd-control",
            control,
            "pd-control: listening",
            &dir.join("pd-control.log"),
        );
        stack.children.push(("pd-control".into(), child));

        let config = dir.join("envoy.yaml");
        let rendered = match ecds {
            None => render_envoy(
                listen_port,
                admin_port,
                control_port,
                options.refresh_ms,
                &stack.access_log,
                &stack.eds_dir(),
            ),
            Some(key_values) => {
                let ecds_dir = dir.join("ecds");
                std::fs::create_dir_all(&ecds_dir).expect("ECDS dir");
                write_ecds(&ecds_dir, key_values, options.plugin_extra);
                stack.ecds_dir = Some(ecds_dir.clone());
                render_envoy_ecds(
                    listen_port,
                    admin_port,
                    control_port,
                    &ecds_dir,
                    &stack.access_log,
                    &stack.eds_dir(),
                )
            }
        };
        let rendered = if options.explain {
            enable_explain(rendered)
        } else {
            rendered
        };
        // With ECDS the plugin configuration is in the ECDS file (above).
        let rendered = match ecds {
            None => with_plugin_extra(rendered, options.plugin_extra),
            Some(_) => rendered,
        };
        let rendered = match &stack.xds {
            Some(xds) => eds_over_grpc(rendered, xds, &dir.join("cds.json"), None),
            None => rendered,
        };
        let rendered = if options.internal_clients {
            with_internal_clients(rendered)
        } else {
            rendered
        };
        let rendered = with_debug_env_keys(rendered, options.envoy_env);
        let rendered = if options.dynamic_stats {
            assert!(
                rendered.contains("dynamic_stats: false"),
                "no router stats switch"
            );
            rendered.replacen("dynamic_stats: false", "dynamic_stats: true", 1)
        } else {
            rendered
        };
        let rendered = match options.max_heap_bytes {
            Some(bytes) => {
                let bound = "max_heap_size_bytes: 2147483648";
                assert_eq!(rendered.matches(bound).count(), 1, "no heap bound");
                rendered.replacen(bound, &format!("max_heap_size_bytes: {bytes}"), 1)
            }
            None => rendered,
        };
        let rendered = match options.stream_idle_timeout_s {
            Some(s) => {
                let timeout = "stream_idle_timeout: 130s";
                assert_eq!(
                    rendered.matches(timeout).count(),
                    1,
                    "no stream idle timeout"
                );
                rendered.replacen(timeout, &format!("stream_idle_timeout: {s}s"), 1)
            }
            None => rendered,
        };
        let rendered = match options.request_timeout_s {
            Some(s) => {
                let timeout = "request_timeout: 300s";
                assert_eq!(rendered.matches(timeout).count(), 1, "no request timeout");
                rendered.replacen(timeout, &format!("request_timeout: {s}s"), 1)
            }
            None => rendered,
        };
        std::fs::write(&config, rendered).expect("envoy config");
        let mut envoy = Command::new(envoy_bin());
        envoy
            .arg("-c")
            .arg(&config)
            .arg("--concurrency")
            .arg(concurrency.to_string())
            .arg("--disable-hot-restart")
            .arg("--base-id")
            .arg(fastrand::u32(1..1_000_000).to_string())
            .arg("-l")
            .arg("info")
            .arg("--log-path")
            .arg(dir.join("envoy.log"))
            .arg("--file-flush-interval-msec")
            .arg("100")
            .env_clear()
            .envs(envoy_env.iter().copied());
        let child = envoy
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.join("envoy.stderr")).expect("log"),
            ))
            .spawn()
            .expect("cannot start envoy");
        stack.children.push(("envoy".into(), child));
        stack.wait_until_loaded();
        stack
    }

    /// Waits until every ticking VM (each worker plus the main thread) has a fleet view.
    fn wait_until_loaded(&mut self) {
        let expected = (self.concurrency + 1) as u64;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.stat("pd_router_fleet_loaded_vms") >= expected {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "Envoy never loaded the fleet snapshot; logs in {}:\n{}",
                    self.dir.display(),
                    self.envoy_log()
                );
            }
            for (name, child) in &mut self.children {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!(
                        "{name} exited with {status}; logs in {}",
                        self.dir.display()
                    );
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn envoy_log(&self) -> String {
        let mut log = std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default();
        log.push_str(&std::fs::read_to_string(self.dir.join("envoy.stderr")).unwrap_or_default());
        log
    }

    /// How many VMs logged their first snapshot, and how many logged their end, so far: each
    /// does both once, and `pd_router_fleet_loaded_vms` counts those between.
    pub fn vms_loaded_and_ended(&self) -> (u64, u64) {
        let log = self.envoy_log();
        let loaded = log
            .lines()
            .filter(|l| l.contains("fleet snapshot") && l.ends_with(" loaded"))
            .count() as u64;
        (loaded, log.matches("plugin done: VM").count() as u64)
    }

    /// Sum of the Prometheus series `name` whose labels include `labels`, 0 when absent.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        admin_metric(&self.admin, name, labels)
    }

    /// `gateway_request_model_fail_total` of one failure kind and status code.
    pub fn model_fail_count(&self, status: &str, code: &str) -> f64 {
        self.metric(
            "gateway_request_model_fail_total",
            &[("status", status), ("status_code", code)],
        )
    }

    /// `gateway_prefill_request_fail_total` of one failure class and status code.
    pub fn prefill_fail_count(&self, status: &str, code: &str) -> f64 {
        self.metric(
            "gateway_prefill_request_fail_total",
            &[("status", status), ("status_code", code)],
        )
    }

    /// Sum of pd-control's Prometheus series `name` (all labels), 0 when absent.
    pub fn control_metric(&self, name: &str) -> f64 {
        let text = http::get(&self.control, "/metrics")
            .expect("pd-control metrics")
            .text();
        crate::prom::Scrape::parse(&text).sum(name, &[])
    }

    /// See [`wait_ledger_zero`] (10 s).
    pub fn wait_ledger_zero(&self) {
        wait_ledger_zero(&self.admin, Duration::from_secs(10));
    }

    /// A filter metric (`wasmcustom.<name>`) from Envoy's admin, 0 when absent.
    pub fn stat(&self, name: &str) -> u64 {
        admin_stat(&self.admin, name)
    }

    /// A filter metric (`wasmcustom.<name>`), `None` when Envoy has no stat of that name: for
    /// asserting a metric reads 0, which must fail when the metric is missing.
    pub fn filter_stat(&self, name: &str) -> Option<u64> {
        admin_filter_stat(&self.admin, name)
    }

    /// One of Envoy's own stats (e.g. `cluster.pd_pods.upstream_rq_retry`), `None` when Envoy
    /// has no stat of that name.
    pub fn envoy_stat(&self, name: &str) -> Option<u64> {
        let escaped = name.replace('.', "\\.");
        http::get(&self.admin, &format!("/stats?filter=^{escaped}$"))
            .expect("Envoy admin")
            .text()
            .lines()
            .filter_map(|l| l.split_once(": "))
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| v.trim().parse().ok())
    }

    /// Envoy's Prometheus output (`/stats/prometheus`), parsed.
    pub fn scrape(&self) -> crate::prom::Scrape {
        let r = http::get(&self.admin, "/stats/prometheus").expect("Envoy admin");
        crate::prom::Scrape::parse(&r.text())
    }

    /// The access log's lines so far.
    pub fn access_log_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.access_log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Every request pd-sim pods received, in arrival order per pod.
    pub fn sim_requests(&self) -> Vec<serde_json::Value> {
        let r = http::get(&self.sim_admin, "/sim/requests").expect("pd-sim admin");
        match r.json() {
            serde_json::Value::Array(a) => a,
            other => panic!("unexpected /sim/requests answer {other}"),
        }
    }

    pub fn clear_sim_requests(&self) {
        http::request(&self.sim_admin, "DELETE", "/sim/requests", &[], &[]).expect("pd-sim admin");
    }

    /// Arms a pd-sim fault (`POST /sim/faults`, e.g. `{"pod":"p0","kind":"hang_before_headers"}`).
    pub fn arm_fault(&self, spec: serde_json::Value) {
        let r = http::request(
            &self.sim_admin,
            "POST",
            "/sim/faults",
            &[("content-type", "application/json")],
            spec.to_string().as_bytes(),
        )
        .expect("pd-sim admin");
        assert_eq!(r.status, 204, "arming {spec}: {}", r.text());
    }

    /// Clears every pd-sim fault: hanging requests go on, crashed pods listen again.
    pub fn clear_faults(&self) {
        let r = http::request(&self.sim_admin, "DELETE", "/sim/faults", &[], &[])
            .expect("pd-sim admin");
        assert_eq!(r.status, 204, "{}", r.text());
    }

    /// Clears the pd-sim faults of one pod only.
    pub fn clear_faults_of(&self, pod: &str) {
        let r = http::request(
            &self.sim_admin,
            "DELETE",
            &format!("/sim/faults?pod={pod}"),
            &[],
            &[],
        )
        .expect("pd-sim admin");
        assert_eq!(r.status, 204, "{}", r.text());
    }

    /// Polls pd-sim's log until `n` legs of kind `leg` (`prefill`, `decode`, `full`) arrived.
    pub fn wait_for_legs(&self, leg: &str, n: usize) -> Vec<serde_json::Value> {
        eventually(Duration::from_secs(30), || {
            let legs: Vec<_> = self
                .sim_requests()
                .into_iter()
                .filter(|e| e["leg"] == leg)
                .collect();
            if legs.len() >= n {
                Ok(legs)
            } else {
                Err(format!(
                    "only {} of {n} {leg} legs arrived; logs in {}",
                    legs.len(),
                    self.dir.display()
                ))
            }
        })
    }

    /// Waits until Envoy's log (flushed every 100 ms) contains `needle`.
    pub fn wait_for_log(&self, needle: &str) {
        eventually(Duration::from_secs(20), || {
            self.envoy_log()
                .contains(needle)
                .then_some(())
                .ok_or_else(|| format!("Envoy never logged {needle:?}"))
        })
    }

    /// Rewrites the fleet file atomically (write + rename), as an operator's tooling would.
    pub fn write_fleet(&mut self, fleet: Fleet) {
        let tmp = self.dir.join("fleet.yaml.tmp");
        std::fs::write(&tmp, fleet.to_yaml()).expect("fleet file");
        std::fs::rename(&tmp, &self.fleet_path).expect("rename fleet file");
        self.fleet = fleet;
    }

    /// Waits until pd-control's snapshot shows no waiting request on any pod and Envoy routes
    /// on that snapshot: a test asserting a routing choice right after earlier requests must
    /// not see a scrape taken while they were queued (which rightly changes the choice).
    pub fn wait_quiet_snapshot(&self) {
        eventually(Duration::from_secs(15), || {
            let snap = self.control_snapshot();
            let busy =
                snapshot_pods(&snap).any(|p| p["metrics"]["waiting"].as_f64().unwrap_or(0.0) > 0.0);
            let version = snap["version"].as_u64().unwrap_or(u64::MAX);
            let all_vms = self.stat("pd_router_fleet_vms_on_latest") > self.concurrency as u64;
            if !busy && self.stat("pd_router_fleet_version") >= version && all_vms {
                Ok(())
            } else {
                Err(format!("the fleet never looked idle: {snap}"))
            }
        })
    }

    /// Waits until pd-control serves exactly the pods of the fleet last written and every
    /// ticking VM of Envoy (each worker plus the main thread) routes on that snapshot or a
    /// newer one.
    pub fn wait_fleet_adopted(&self) {
        let mut wanted: Vec<&str> = self.fleet.pods.iter().map(|p| p.name.as_str()).collect();
        wanted.sort_unstable();
        self.wait_snapshot_adopted(|snap| {
            let mut served: Vec<&str> = snapshot_pods(snap)
                .filter_map(|p| p["name"].as_str())
                .collect();
            served.sort_unstable();
            served.dedup();
            if served == wanted {
                Ok(())
            } else {
                Err(format!("pd-control serves {served:?}, not {wanted:?}"))
            }
        });
    }

    /// Waits until pd-control serves a snapshot `wanted` accepts (it says what is missing
    /// otherwise) and every ticking VM of Envoy routes on that snapshot or a newer one.
    /// `pd_router_fleet_version` alone is not enough: it shows the VM that wrote last, and a
    /// worker that has not caught up yet still routes on the old fleet.
    pub fn wait_snapshot_adopted(&self, wanted: impl Fn(&serde_json::Value) -> Result<(), String>) {
        let vms = (self.concurrency + 1) as u64;
        eventually(Duration::from_secs(15), || {
            let snap = self.control_snapshot();
            wanted(&snap)?;
            let version = snap["version"].as_u64().unwrap_or(u64::MAX);
            // The count is read between two equal version reads. A VM writes the count before
            // the version, so a count written for another version shows as a version change
            // (unless its writer stalls between its two writes for a whole admin round trip).
            let adopted = self.stat("pd_router_fleet_version");
            let on_latest = self.stat("pd_router_fleet_vms_on_latest");
            let adopted_after = self.stat("pd_router_fleet_version");
            if adopted >= version && adopted_after == adopted && on_latest >= vms {
                Ok(())
            } else {
                Err(format!(
                    "Envoy is on snapshot {adopted} with {on_latest} of {vms} VMs; \
                     pd-control serves {version}"
                ))
            }
        })
    }

    /// Calls `request` over and over until [`Stack::wait_fleet_adopted`] returns: traffic
    /// that keeps flowing while a fleet edit reaches every worker.
    pub fn load_until_adopted(&self, mut request: impl FnMut()) {
        /// Ends the load even when the wait fails (its panic then fails the test).
        struct Done<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let _done = Done(&done);
                self.wait_fleet_adopted();
            });
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                request();
            }
        });
    }

    /// The snapshot pd-control currently serves, as JSON.
    pub fn control_snapshot(&self) -> serde_json::Value {
        http::get(&self.control, "/v1/snapshot.json")
            .expect("pd-control")
            .json()
    }

    pub fn chat(&self, headers: &[(&str, &str)], body: &serde_json::Value) -> http::Response {
        http::post_json(&self.gateway, "/v1/chat/completions", headers, body)
    }
}

/// Every pod entry of a snapshot's JSON, model by model.
pub fn snapshot_pods(snap: &serde_json::Value) -> impl Iterator<Item = &serde_json::Value> {
    snap["models"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|m| m["pods"].as_array().into_iter().flatten())
}

/// Polls `check` every 20 ms until it yields `Ok`, failing the test with its last `Err`
/// after `timeout`: tests wait on conditions, never on fixed delays.
pub fn eventually<T>(timeout: Duration, mut check: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        match check() {
            Ok(value) => return value,
            Err(why) => assert!(Instant::now() < deadline, "timed out: {why}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A filter metric (`wasmcustom.<name>`) from the Envoy admin at `admin`, 0 when absent (or
/// the admin does not answer). To assert a metric reads 0, use [`admin_filter_stat`].
pub fn admin_stat(admin: &str, name: &str) -> u64 {
    let Ok(r) = http::get(admin, &format!("/stats?filter=^wasmcustom\\.{name}$")) else {
        return 0;
    };
    stat_in(&r.text(), name).unwrap_or(0)
}

/// A filter metric (`wasmcustom.<name>`) from the Envoy admin at `admin`, `None` when Envoy
/// has no stat of that name; panics when the admin does not answer.
pub fn admin_filter_stat(admin: &str, name: &str) -> Option<u64> {
    let r = http::get(admin, &format!("/stats?filter=^wasmcustom\\.{name}$"))
        .unwrap_or_else(|e| panic!("Envoy admin {admin}: {e}"));
    stat_in(&r.text(), name)
}

/// The value of `wasmcustom.<name>` in the text of Envoy's `/stats`.
fn stat_in(stats: &str, name: &str) -> Option<u64> {
    let full = format!("wasmcustom.{name}");
    stats
        .lines()
        .filter_map(|l| l.split_once(": "))
        .find(|(n, _)| *n == full)
        .and_then(|(_, v)| v.trim().parse().ok())
}

/// Gauges that must all read exactly 0 once no request is in flight: the token ledger, the
/// per-pod request counters of the shared ledger and the outstanding prefill legs.
pub const LEDGER_GAUGES: [&str; 4] = [
    "pd_token_load_",
    "pd_router_prefill_inflight",
    "pd_router_running_requests",
    "gateway_prefill_outstanding_requests",
];

/// Waits until every ledger and outstanding gauge ([`LEDGER_GAUGES`]) of the Envoy at
/// `admin` reads exactly 0, failing after `timeout`; some gauges must exist.
pub fn wait_ledger_zero(admin: &str, timeout: Duration) {
    eventually(timeout, || {
        let text = http::get(admin, "/stats/prometheus").expect("admin").text();
        let values: Vec<f64> = text
            .lines()
            .filter(|l| LEDGER_GAUGES.iter().any(|g| l.starts_with(g)))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse().ok()))
            .collect();
        if !values.is_empty() && values.iter().all(|v| *v == 0.0) {
            Ok(())
        } else {
            Err(format!(
                "ledger gauges of {admin} not back to 0: {values:?}"
            ))
        }
    })
}

/// A further Envoy replica started by [`Stack::add_gateway`].
pub struct Gateway {
    /// Its data listener, `127.0.0.1:port`.
    pub gateway: String,
    pub admin: String,
}

impl Gateway {
    pub fn stat(&self, name: &str) -> u64 {
        admin_stat(&self.admin, name)
    }

    /// See [`Stack::filter_stat`].
    pub fn filter_stat(&self, name: &str) -> Option<u64> {
        admin_filter_stat(&self.admin, name)
    }

    /// See [`Stack::metric`].
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        admin_metric(&self.admin, name, labels)
    }

    /// See [`wait_ledger_zero`] (10 s).
    pub fn wait_ledger_zero(&self) {
        wait_ledger_zero(&self.admin, Duration::from_secs(10));
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        for (_, child) in self.children.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Sum of the Prometheus series `name` (labels including `labels`) on the Envoy admin `admin`.
fn admin_metric(admin: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = http::get(admin, "/stats/prometheus").expect("admin").text();
    crate::prom::Scrape::parse(&text).sum(name, labels)
}

/// Adds `extra` (JSON members without braces) to a rendered drop-in's plugin configuration.
fn with_plugin_extra(rendered: String, extra: &str) -> String {
    if extra.is_empty() {
        return rendered;
    }
    assert!(
        !extra.contains('\''),
        "plugin_extra must not contain single quotes"
    );
    const KEY: &str = "\"refresh_ms\":";
    assert!(
        rendered.contains(KEY),
        "plugin configuration without refresh_ms"
    );
    rendered.replacen(KEY, &format!("{extra},{KEY}"), 1)
}

/// Control-plane faults: pd-control stopped, replaced, restarted on its address.
impl Stack {
    /// Whether the stack's pd-control process is running.
    pub fn control_running(&mut self) -> bool {
        self.children
            .iter_mut()
            .find(|(n, _)| n == "pd-control")
            .is_some_and(|(_, c)| matches!(c.try_wait(), Ok(None)))
    }

    /// pd-control's arguments feeding the retrying cluster: the endpoint file, or the EDS
    /// service.
    fn endpoint_args(&self) -> Vec<String> {
        match &self.xds {
            Some(xds) => vec!["--xds-listen".into(), xds.clone()],
            None => vec![
                "--eds-file".into(),
                self.eds_dir().join(EDS_FILE).display().to_string(),
            ],
        }
    }

    /// The directory of the retrying cluster's endpoint file, which the stack's pd-control
    /// writes (`--eds-file`).
    pub fn eds_dir(&self) -> PathBuf {
        self.dir.join("eds")
    }

    /// Starts pd-control again on the stack's control address (after [`Stack::kill`] of
    /// `pd-control`), with extra `args`; returns once it listens.
    pub fn restart_control(&mut self, args: &[&str]) {
        self.kill("pd-control");
        let n = self.children.len();
        let fleet = self.fleet_path.display().to_string();
        let endpoints = self.endpoint_args();
        let mut argv: Vec<&str> = vec![
            "--fleet",
            &fleet,
            "--listen",
            &self.control,
            "--refresh-interval",
            "50ms",
        ];
        argv.extend(endpoints.iter().map(String::as_str));
        argv.extend_from_slice(args);
        // The old process just closed the port; a bind can still race its teardown for a
        // moment, so a failed start is retried against a deadline.
        let log = self.dir.join(format!("pd-control-restart-{n}.log"));
        let child = eventually(Duration::from_secs(10), || {
            let mut cmd = Command::new(bin("pd-control"));
            cmd.args(&argv);
            let stderr = std::fs::File::create(&log).map_err(|e| e.to_string())?;
            let mut child = cmd
                .stdout(Stdio::piped())
                .stderr(Stdio::from(stderr))
                .spawn()
                .map_err(|e| e.to_string())?;
            let stdout = child.stdout.take().ok_or("no stdout")?;
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            if line.contains("pd-control: listening") {
                Ok(child)
            } else {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!(
                    "pd-control did not restart on {}: {}",
                    self.control,
                    std::fs::read_to_string(&log).unwrap_or_default()
                ))
            }
        });
        let slot = self
            .children
            .iter_mut()
            .find(|(name, _)| name == "pd-control")
            .expect("the stack's pd-control");
        slot.1 = child;
    }

    /// Starts one more Envoy like [`Stack::add_gateway`] with `plugin_extra` members in its
    /// plugin configuration, and does not wait for it to load a snapshot (it may never).
    pub fn add_gateway_with_plugin(&mut self, plugin_extra: &str) -> Gateway {
        let n = self.children.len();
        let (gateway, _) = self.spawn_gateway(self.control.clone(), &[], plugin_extra, |c| c);
        eventually(Duration::from_secs(30), || {
            http::get(&gateway.admin, "/ready")
                .ok()
                .filter(|r| r.status == 200)
                .map(|_| ())
                .ok_or_else(|| format!("Envoy {n} never became ready"))
        });
        gateway
    }
}
