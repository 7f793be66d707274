//! Test-only crate: `tests/manifests.rs` parses every document under `envoy/kubernetes/` and
//! `envoy/istio/` and checks it against k8s-openapi types, pd-control's CLI and the filter's
//! plugin configuration. Run it with `make manifests-test`.
