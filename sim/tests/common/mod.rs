//! Fleet-file helpers shared by pd-sim's integration tests.
#![allow(dead_code)] // each test crate uses its own subset of the helpers

use std::path::PathBuf;

/// A loopback port nothing listens on, for a simulator pod to bind: below the kernel's
/// ephemeral range (32768 and up on Linux), so no outgoing connection's local port takes it
/// before the pod binds, and never the same one twice in this process, so ports drawn back
/// to back (a prefill and a decode pod) do not collide. As wasm-tests' `stack::free_port`.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for _ in 0..1000 {
        let port = fastrand::u16(20_000..32_000);
        if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.push(port);
            return port;
        }
    }
    panic!("no free port in 20000..32000")
}

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

/// A fleet file in the temp dir, removed on drop.
pub struct TempFile(pub PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
