//! Fleet-file helpers shared by pd-sim's integration tests.
#![allow(dead_code)] // each test crate uses its own subset of the helpers

use std::path::PathBuf;

/// A loopback port for a simulator pod to bind, never the same twice in this process (a
/// prefill and a decode pod drawn back to back do not collide).
pub use pd_wasm_tests::stack::free_port;

/// One ready Pod on 127.0.0.1 in roleset `rs0`, as an item of a `v1` `List`.
pub fn pod_yaml(model: &str, name: &str, engine: &str, role: &str, port: u16) -> String {
    format!(
        r#"- apiVersion: v1
  kind: Pod
  metadata:
    name: {name}
    namespace: default
    labels:
      model.aibrix.ai/name: {model}
      model.aibrix.ai/port: "{port}"
      model.aibrix.ai/engine: {engine}
      role-name: {role}
      roleset-name: rs0
  status:
    podIP: 127.0.0.1
    conditions:
    - type: Ready
      status: "True"
"#
    )
}

pub fn fleet_yaml(pods: &[String]) -> String {
    format!("apiVersion: v1\nkind: List\nitems:\n{}", pods.concat())
}

/// One combined (`full`-leg) vLLM pod, `pod-a` of `model`, served by a simulator of its own
/// on a free port, with the simulator's admin endpoint; both live as long as this does.
pub struct CombinedPod {
    pub sim: std::sync::Arc<pd_sim::sim::Sim>,
    /// `127.0.0.1:<port>` of the pod.
    pub addr: String,
    /// `http://<addr>` of the admin endpoint (`/sim/faults`, `/sim/requests`, ...).
    pub admin: String,
    _admin: pd_sim::server::ServeHandle,
}

impl CombinedPod {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

pub async fn combined_pod(model: &str) -> CombinedPod {
    let port = free_port();
    let text = fleet_yaml(&[pod_yaml(model, "pod-a", "vllm", "combined", port)]);
    let records = pd_control::fleet::parse_records(&text).expect("fleet parses");
    let sim = pd_sim::sim::Sim::new(pd_sim::pod::SimConfig::default());
    let report = sim.apply(&records).await;
    assert_eq!(report.serving, 1, "{report:?}");
    let admin = pd_sim::sim::serve_admin(&sim, "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("admin");
    CombinedPod {
        sim,
        addr: format!("127.0.0.1:{port}"),
        admin: format!("http://{}", admin.addr),
        _admin: admin,
    }
}

/// A fleet file in the temp dir, removed on drop.
pub struct TempFile(pub PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
