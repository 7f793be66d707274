//! Every manifest under envoy/kubernetes/ and envoy/istio/, parsed and checked.
//!
//! Kubernetes documents are deserialized into k8s-openapi types and serialized back: the round
//! trip must give the same JSON, which catches misspelled or misplaced fields (serde would drop
//! them silently, as k8s-openapi cannot deny unknown fields). Istio resources have no typed crate
//! here; they are checked field by field against the static drop-in (envoy/envoy.yaml.tmpl), the
//! filter's own plugin-config parser and pd-control's own CLI parser.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use clap::Parser;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use pd_control::fleet::PodRecord;
use pd_router_filter::core::config::PluginConfig;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use serde_yaml::Value as Yaml;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    let path = repo().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every non-empty document of a multi-document YAML file.
fn documents(rel: &str) -> Vec<Yaml> {
    let text = read(rel);
    let docs: Vec<Yaml> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| Yaml::deserialize(d).unwrap_or_else(|e| panic!("{rel}: {e}")))
        .filter(|d| !d.is_null())
        .collect();
    assert!(!docs.is_empty(), "{rel} holds no document");
    docs
}

fn yaml_files(dir: &str) -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(repo().join(dir))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
        .map(|n| format!("{dir}/{n}"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {dir}");
    files
}

/// Typed parse plus round trip: any field serde dropped shows up as a difference.
fn typed<T: DeserializeOwned + Serialize>(doc: &Yaml, origin: &str) -> T {
    let json = serde_json::to_value(doc).unwrap();
    let value: T = serde_json::from_value(json.clone())
        .unwrap_or_else(|e| panic!("{origin}: not a valid object: {e}"));
    let back = serde_json::to_value(&value).unwrap();
    if back != json {
        panic!(
            "{origin}: fields lost or changed by the typed round trip (unknown or misplaced keys?)\n\
             written: {}\nparsed:  {}",
            serde_json::to_string_pretty(&json).unwrap(),
            serde_json::to_string_pretty(&back).unwrap()
        );
    }
    value
}

#[derive(Default)]
struct Kube {
    namespaces: Vec<Namespace>,
    service_accounts: Vec<ServiceAccount>,
    deployments: Vec<Deployment>,
    services: Vec<Service>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    network_policies: Vec<NetworkPolicy>,
    disruption_budgets: Vec<PodDisruptionBudget>,
    /// (file, pod)
    pods: Vec<(String, Pod)>,
    /// Prometheus Operator's, untyped (no k8s-openapi type for a CRD).
    pod_monitors: Vec<Yaml>,
    /// kustomize's, untyped.
    kustomizations: Vec<Yaml>,
    /// Prometheus Operator's alerting rules, untyped.
    prometheus_rules: Vec<Yaml>,
}

fn kube() -> Kube {
    let mut k = Kube::default();
    for file in yaml_files("envoy/kubernetes") {
        for (i, doc) in documents(&file).iter().enumerate() {
            let api = doc["apiVersion"].as_str().unwrap_or_default();
            let kind = doc["kind"].as_str().unwrap_or_default();
            let origin = format!("{file} document {i} ({api} {kind})");
            match (api, kind) {
                ("v1", "Namespace") => k.namespaces.push(typed(doc, &origin)),
                ("v1", "ServiceAccount") => k.service_accounts.push(typed(doc, &origin)),
                ("apps/v1", "Deployment") => k.deployments.push(typed(doc, &origin)),
                ("v1", "Service") => k.services.push(typed(doc, &origin)),
                ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
                    k.cluster_roles.push(typed(doc, &origin))
                }
                ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
                    k.cluster_role_bindings.push(typed(doc, &origin))
                }
                ("rbac.authorization.k8s.io/v1", "Role") => k.roles.push(typed(doc, &origin)),
                ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
                    k.role_bindings.push(typed(doc, &origin))
                }
                ("v1", "Pod") => k.pods.push((file.clone(), typed(doc, &origin))),
                ("networking.k8s.io/v1", "NetworkPolicy") => {
                    k.network_policies.push(typed(doc, &origin))
                }
                ("monitoring.coreos.com/v1", "PodMonitor") => k.pod_monitors.push(doc.clone()),
                ("monitoring.coreos.com/v1", "PrometheusRule") => {
                    k.prometheus_rules.push(doc.clone())
                }
                ("kustomize.config.k8s.io/v1beta1", "Kustomization") => {
                    k.kustomizations.push(doc.clone())
                }
                ("policy/v1", "PodDisruptionBudget") => {
                    k.disruption_budgets.push(typed(doc, &origin))
                }
                _ => panic!("{origin}: unexpected kind; add it to this test"),
            }
        }
    }
    k
}

fn name_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    meta.name.as_deref().expect("metadata.name")
}

fn ns_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    meta.namespace.as_deref().unwrap_or("default")
}

fn assert_pod_reader(rules: &Option<Vec<PolicyRule>>, origin: &str) {
    let rules = rules
        .as_ref()
        .unwrap_or_else(|| panic!("{origin}: no rules"));
    let granted: Vec<(Vec<String>, Vec<String>)> = rules
        .iter()
        .map(|rule| {
            let mut verbs = rule.verbs.clone();
            verbs.sort();
            assert_eq!(verbs, ["list", "watch"], "{origin}: verbs");
            assert!(rule.resource_names.is_none(), "{origin}: resourceNames");
            assert!(
                rule.non_resource_urls.is_none(),
                "{origin}: nonResourceURLs"
            );
            (
                rule.api_groups.clone().unwrap_or_default(),
                rule.resources.clone().unwrap_or_default(),
            )
        })
        .collect();
    let expected = [
        (vec![String::new()], vec!["pods".to_string()]),
        (
            vec!["model.aibrix.ai".to_string()],
            vec!["modeladapters".to_string()],
        ),
    ];
    assert_eq!(
        granted, expected,
        "{origin}: pods of the core group and AIBrix's ModelAdapters, nothing else"
    );
}

/// Leader election writes the Lease named in control.yaml (created once, so `create` is
/// unnamed) and patches pods (its own label), and nothing else.
fn assert_leader_election(rules: &Option<Vec<PolicyRule>>, origin: &str) {
    let rules = rules
        .as_ref()
        .unwrap_or_else(|| panic!("{origin}: no rules"));
    let granted: BTreeSet<(String, String, Vec<String>, String)> = rules
        .iter()
        .flat_map(|rule| {
            assert!(
                rule.non_resource_urls.is_none(),
                "{origin}: nonResourceURLs"
            );
            let names = rule.resource_names.clone().unwrap_or_default().join(",");
            let groups = rule.api_groups.clone().unwrap_or_default();
            let resources = rule.resources.clone().unwrap_or_default();
            let mut verbs = rule.verbs.clone();
            verbs.sort();
            groups.into_iter().flat_map(move |g| {
                let verbs = verbs.clone();
                let names = names.clone();
                resources
                    .clone()
                    .into_iter()
                    .map(move |r| (g.clone(), r, verbs.clone(), names.clone()))
            })
        })
        .collect();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let expected: BTreeSet<_> = [
        (
            "coordination.k8s.io".into(),
            "leases".into(),
            s(&["create"]),
            String::new(),
        ),
        (
            "coordination.k8s.io".into(),
            "leases".into(),
            s(&["get", "update"]),
            "pd-control".into(),
        ),
        (String::new(), "pods".into(), s(&["patch"]), String::new()),
    ]
    .into_iter()
    .collect();
    assert_eq!(granted, expected, "{origin}");
}

/// `kubectl apply -k envoy/kubernetes` installs pd-control whole: every file it lists exists,
/// and every other file is one it leaves out on purpose (an alternative, an example, an
/// optional CRD's objects), so a new manifest is not forgotten there.
#[test]
fn the_kustomization_lists_what_pd_control_needs() {
    let k = kube();
    assert_eq!(k.kustomizations.len(), 1);
    let listed: BTreeSet<String> = k.kustomizations[0]["resources"]
        .as_sequence()
        .expect("resources")
        .iter()
        .map(|r| r.as_str().expect("a file name").to_string())
        .collect();
    let files: BTreeSet<String> = yaml_files("envoy/kubernetes")
        .iter()
        .map(|f| {
            Path::new(f)
                .file_name()
                .and_then(|n| n.to_str())
                .expect("a file name")
                .to_string()
        })
        .collect();
    for file in &listed {
        assert!(
            files.contains(file),
            "kustomization lists {file}, which is not there"
        );
    }
    let left_out: BTreeSet<&str> = files
        .iter()
        .map(String::as_str)
        .filter(|f| !listed.contains(*f))
        .collect();
    assert_eq!(
        left_out,
        BTreeSet::from([
            "alerts.yaml",
            "engines-example.yaml",
            "kustomization.yaml",
            "monitoring.yaml",
            "rbac-namespaced.yaml",
        ]),
        "files the kustomization leaves out"
    );
}

/// Every alerting rule names itself, says how bad it is and where the operator reference
/// explains it (which metrics the expressions read is checked against real scrapes by the
/// e2e metrics test).
#[test]
fn alerting_rules_are_named_graded_and_explained() {
    let k = kube();
    assert_eq!(k.prometheus_rules.len(), 1);
    let operator = read("docs/OPERATOR.md");
    let mut names = BTreeSet::new();
    for group in k.prometheus_rules[0]["spec"]["groups"]
        .as_sequence()
        .expect("groups")
    {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().expect("an alert name").to_string();
            assert!(names.insert(name.clone()), "{name} twice");
            assert!(
                rule["expr"].as_str().is_some_and(|e| !e.is_empty()),
                "{name}: expr"
            );
            let severity = rule["labels"]["severity"].as_str().unwrap_or_default();
            assert!(
                ["critical", "warning"].contains(&severity),
                "{name}: severity {severity:?}"
            );
            let description = rule["annotations"]["description"]
                .as_str()
                .unwrap_or_default();
            let section = description
                .split('"')
                .nth(1)
                .unwrap_or_else(|| panic!("{name}: no OPERATOR.md section named"));
            assert!(
                operator
                    .lines()
                    .any(|l| l.starts_with('#') && l.trim_start_matches('#').trim() == section),
                "{name}: OPERATOR.md has no section {section:?}"
            );
        }
    }
    assert!(names.len() >= 8, "{names:?}");
}

/// Every alert's and every dashboard panel's PromQL parses (Grafana's `$__rate_interval` and
/// `$__interval` taken as 5m): a typo would otherwise surface only when Prometheus loads
/// the rules or a panel renders empty.
#[test]
fn alert_and_dashboard_queries_are_valid_promql() {
    let parse = |origin: &str, expr: &str| {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$__interval", "5m");
        if let Err(e) = promql_parser::parser::parse(&expr) {
            panic!("{origin}: {expr}\n{e}");
        }
    };
    let k = kube();
    let mut alerts = 0;
    for group in k.prometheus_rules[0]["spec"]["groups"]
        .as_sequence()
        .expect("groups")
    {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().unwrap_or_default();
            parse(name, rule["expr"].as_str().expect("expr"));
            alerts += 1;
        }
    }
    let dashboard: Json =
        serde_json::from_str(&read("envoy/dashboards/pd-router.json")).expect("dashboard JSON");
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or_default();
            parse(title, target["expr"].as_str().expect("expr"));
            queries += 1;
        }
    }
    assert!(
        alerts >= 8 && queries >= 20,
        "{alerts} alerts, {queries} queries"
    );
}

#[test]
fn every_kubernetes_document_is_a_known_typed_object() {
    let k = kube();
    assert!(!k.namespaces.is_empty());
    assert_eq!(k.service_accounts.len(), 1);
    assert_eq!(k.deployments.len(), 1);
    assert_eq!(k.services.len(), 1);
    assert_eq!(k.cluster_roles.len(), 1);
    assert_eq!(k.cluster_role_bindings.len(), 1);
    // The namespaced pod reader, and leader election's in pd-control's namespace.
    assert_eq!(k.roles.len(), 2);
    assert_eq!(k.role_bindings.len(), 2);
    assert_eq!(k.disruption_budgets.len(), 1);
    assert_eq!(k.pods.len(), 3);
    assert_eq!(k.network_policies.len(), 1);
    // Every namespaced object lives in a namespace the manifests create.
    let namespaces: BTreeSet<&str> = k.namespaces.iter().map(|n| name_of(&n.metadata)).collect();
    let used = k
        .service_accounts
        .iter()
        .map(|o| &o.metadata)
        .chain(k.deployments.iter().map(|o| &o.metadata))
        .chain(k.services.iter().map(|o| &o.metadata))
        .chain(k.roles.iter().map(|o| &o.metadata))
        .chain(k.role_bindings.iter().map(|o| &o.metadata))
        .chain(k.network_policies.iter().map(|o| &o.metadata))
        .chain(k.disruption_budgets.iter().map(|o| &o.metadata))
        .chain(k.pods.iter().map(|(_, o)| &o.metadata));
    for meta in used {
        assert!(
            namespaces.contains(ns_of(meta)),
            "{} is in namespace {} which no manifest creates",
            name_of(meta),
            ns_of(meta)
        );
    }
}

#[test]
fn pod_monitors_keep_the_engine_pods_labels_and_select_what_they_name() {
    let k = kube();
    assert_eq!(k.pod_monitors.len(), 2, "pd-control's and the gateway's");
    let monitor = |name: &str| {
        k.pod_monitors
            .iter()
            .find(|m| m["metadata"]["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no PodMonitor {name}"))
    };
    for m in &k.pod_monitors {
        let endpoints = m["spec"]["podMetricsEndpoints"]
            .as_sequence()
            .expect("podMetricsEndpoints");
        assert!(!endpoints.is_empty());
        for e in endpoints {
            // Without it the target's own pod/namespace labels replace the engine pod's.
            assert_eq!(e["honorLabels"].as_bool(), Some(true), "{e:?}");
        }
    }
    let matches = |m: &Yaml, labels: &BTreeMap<String, String>| {
        let selector = m["spec"]["selector"]["matchLabels"]
            .as_mapping()
            .expect("matchLabels");
        !selector.is_empty()
            && selector.iter().all(|(key, value)| {
                labels
                    .get(key.as_str().unwrap_or_default())
                    .map(String::as_str)
                    == value.as_str()
            })
    };

    // pd-control's: its pods, on the container port that serves /metrics.
    let control = monitor("pd-control");
    let deployment = &k.deployments[0];
    assert_eq!(
        control["metadata"]["namespace"].as_str(),
        Some(ns_of(&deployment.metadata))
    );
    let template = &deployment.spec.template;
    let pod_labels = template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .expect("pod labels");
    assert!(matches(control, &pod_labels), "selects pd-control's pods");
    let endpoint = &control["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["path"].as_str(), Some("/metrics"));
    let pod_spec = template.spec.as_ref().expect("pod spec");
    let port = container(&pod_spec.containers, "pd-control")
        .ports
        .as_ref()
        .expect("ports")
        .iter()
        .find(|p| p.name.as_deref() == endpoint["port"].as_str())
        .unwrap_or_else(|| panic!("no container port {:?}", endpoint["port"]));
    let args = container(&pod_spec.containers, "pd-control")
        .args
        .clone()
        .unwrap_or_default();
    assert!(
        args.iter()
            .any(|a| a == &format!("--metrics-listen=0.0.0.0:{}", port.container_port)),
        "the monitor's port is the one --metrics-listen binds: {args:?}"
    );

    // The gateway's: the pods the Gateway selects, on Envoy's own Prometheus endpoint.
    let gateway = monitor("pd-gateway");
    let gateways = one_of("envoy/istio/gateway-route.yaml", "Gateway");
    let selector: BTreeMap<String, String> = gateways[0]["spec"]["selector"]
        .as_mapping()
        .expect("Gateway selector")
        .iter()
        .map(|(key, value)| {
            (
                key.as_str().unwrap_or_default().to_string(),
                value.as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    assert!(matches(gateway, &selector), "selects the Gateway's pods");
    assert_eq!(
        gateway["metadata"]["namespace"],
        gateways[0]["metadata"]["namespace"]
    );
    let endpoint = &gateway["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["path"].as_str(), Some("/stats/prometheus"));
    assert_eq!(endpoint["port"].as_str(), Some("http-envoy-prom"));
}

#[test]
fn rbac_grants_pod_and_adapter_reads_and_leader_election_in_its_namespace_alone() {
    let k = kube();
    for role in &k.cluster_roles {
        assert_pod_reader(
            &role.rules,
            &format!("ClusterRole {}", name_of(&role.metadata)),
        );
    }
    let deployment_ns = ns_of(&k.deployments[0].metadata);
    for role in &k.roles {
        let origin = format!("Role {}", name_of(&role.metadata));
        if name_of(&role.metadata) == "pd-control-leader-election" {
            assert_eq!(
                ns_of(&role.metadata),
                deployment_ns,
                "{origin}: pd-control's own"
            );
            assert_leader_election(&role.rules, &origin);
        } else {
            assert_pod_reader(&role.rules, &origin);
        }
    }
    let sa = &k.service_accounts[0];
    let subject_ok = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        let subjects = subjects.as_ref().expect("subjects");
        assert_eq!(subjects.len(), 1);
        assert_eq!(subjects[0].kind, "ServiceAccount");
        assert_eq!(subjects[0].name, name_of(&sa.metadata));
        assert_eq!(subjects[0].namespace.as_deref(), Some(ns_of(&sa.metadata)));
    };
    for b in &k.cluster_role_bindings {
        assert_eq!(b.role_ref.kind, "ClusterRole");
        assert_eq!(
            b.role_ref.api_group.as_deref(),
            Some("rbac.authorization.k8s.io")
        );
        assert!(k
            .cluster_roles
            .iter()
            .any(|r| name_of(&r.metadata) == b.role_ref.name));
        subject_ok(&b.subjects);
    }
    for b in &k.role_bindings {
        assert_eq!(b.role_ref.kind, "Role");
        assert!(k
            .roles
            .iter()
            .any(|r| name_of(&r.metadata) == b.role_ref.name
                && ns_of(&r.metadata) == ns_of(&b.metadata)));
        subject_ok(&b.subjects);
    }
}

/// The snapshot API admits only the gateway and Prometheus, on the Service's port only.
#[test]
fn network_policy_admits_the_gateway_to_the_apis_and_prometheus_to_metrics_alone() {
    let k = kube();
    let policy = &k.network_policies[0];
    let deployment = &k.deployments[0];
    let spec = policy.spec.as_ref().expect("spec");
    let selected = spec
        .pod_selector
        .as_ref()
        .and_then(|s| s.match_labels.as_ref())
        .expect("podSelector");
    let pod_labels = deployment
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.as_ref())
        .expect("pod labels");
    assert!(
        selected.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
        "the policy selects pd-control's pods"
    );
    assert_eq!(ns_of(&policy.metadata), ns_of(&deployment.metadata));
    assert_eq!(
        spec.policy_types.as_deref(),
        Some(&["Ingress".to_string()][..])
    );
    let rules = spec.ingress.as_ref().expect("ingress rules");
    assert_eq!(
        rules.len(),
        2,
        "the gateway's rule and Prometheus's: no allow-all beside them"
    );
    let service = k.services[0].spec.as_ref().expect("spec");
    let service_port = |name: &str| {
        service
            .ports
            .as_ref()
            .expect("ports")
            .iter()
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| IntOrString::Int(p.port))
            .unwrap_or_else(|| panic!("no Service port {name}"))
    };
    let mut service_ports: Vec<String> = service
        .ports
        .as_ref()
        .expect("ports")
        .iter()
        .map(|p| p.port.to_string())
        .collect();
    let mut admitted = Vec::new();
    let mut monitoring_ports = None;
    for rule in rules {
        let from = rule.from.as_ref().expect("from: never open to all");
        assert!(!from.is_empty());
        let mut namespaces = Vec::new();
        for peer in from {
            assert!(peer.ip_block.is_none(), "no address ranges");
            let labels = peer
                .namespace_selector
                .as_ref()
                .and_then(|n| n.match_labels.as_ref())
                .filter(|l| !l.is_empty())
                .expect("every peer names its namespace");
            namespaces.extend(labels.values().cloned());
        }
        let ports: Vec<IntOrString> = rule
            .ports
            .as_ref()
            .expect("ports")
            .iter()
            .map(|p| p.port.clone().expect("port"))
            .collect();
        if namespaces.iter().any(|n| n == "monitoring") {
            assert_eq!(
                namespaces,
                ["monitoring"],
                "Prometheus's rule admits no one else"
            );
            monitoring_ports = Some(ports.clone());
        }
        admitted.extend(ports.iter().map(|p| match p {
            IntOrString::Int(n) => n.to_string(),
            IntOrString::String(s) => s.clone(),
        }));
    }
    // Prometheus reaches health and metrics alone, never the snapshot, limits or replica
    // APIs (a NetworkPolicy admits ports, not paths).
    assert_eq!(
        monitoring_ports.expect("a rule for the monitoring namespace"),
        [service_port("http-metrics")]
    );
    admitted.sort();
    service_ports.sort();
    assert_eq!(admitted, service_ports, "exactly the Service's ports");
}

fn container<'a>(containers: &'a [Container], name: &str) -> &'a Container {
    containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

#[test]
fn control_deployment_matches_its_cli_service_and_account() {
    let k = kube();
    let dep = &k.deployments[0];
    let spec = &dep.spec;
    assert_eq!(spec.replicas, Some(2), "a leader and a standby");
    let strategy = spec.strategy.as_ref().expect("strategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(
        strategy
            .rolling_update
            .as_ref()
            .and_then(|r| r.max_unavailable.clone()),
        Some(IntOrString::Int(0)),
        "one replica up throughout a rollout"
    );
    let template_labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    for (key, value) in spec.selector.match_labels.as_ref().unwrap() {
        assert_eq!(
            template_labels.get(key),
            Some(value),
            "selector label {key}"
        );
    }
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(
        pod.service_account_name.as_deref(),
        Some(name_of(&k.service_accounts[0].metadata))
    );
    assert_eq!(ns_of(&dep.metadata), ns_of(&k.service_accounts[0].metadata));
    for c in &pod.containers {
        let image = c.image.as_deref().unwrap_or_default();
        assert!(
            image.contains(':') || image.contains('@'),
            "{}: image {image:?} untagged",
            c.name
        );
        assert!(c.resources.is_some(), "{}: resources", c.name);
    }

    // pd-control's arguments are accepted by pd-control's own parser.
    let control = container(&pod.containers, "pd-control");
    let args = control.args.clone().unwrap_or_default();
    let mut config = pd_control::Config::try_parse_from(
        std::iter::once("pd-control".to_string()).chain(args.iter().cloned()),
    )
    .unwrap_or_else(|e| panic!("pd-control rejects {args:?}: {e}"));
    // Leader election names this pod and its namespace through the downward API.
    assert!(config.leader.elect, "--leader-elect");
    let env = control.env.clone().unwrap_or_default();
    let field = |name: &str| {
        env.iter()
            .find(|e| e.name == name)
            .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
            .map(|f| f.field_path.clone())
    };
    assert_eq!(field("POD_NAME").as_deref(), Some("metadata.name"));
    assert_eq!(
        field("POD_NAMESPACE").as_deref(),
        Some("metadata.namespace")
    );
    config.leader.identity = Some("pd-control-7d4f9-abcde".into());
    config.leader.namespace = Some(ns_of(&dep.metadata).to_string());
    config.validate().unwrap();
    // The Lease the Role names.
    let election = k
        .roles
        .iter()
        .find(|r| name_of(&r.metadata) == "pd-control-leader-election")
        .expect("leader election's Role");
    assert!(election.rules.iter().flatten().any(|r| r
        .resource_names
        .iter()
        .flatten()
        .any(|n| *n == config.leader.lease)));
    // New pods start as standbys; the Service selects the leader's label, "true".
    assert_eq!(
        template_labels
            .get(pd_control::leader::LABEL)
            .map(String::as_str),
        Some("false")
    );
    let budget = &k.disruption_budgets[0];
    assert_eq!(ns_of(&budget.metadata), ns_of(&dep.metadata));
    let budget = budget.spec.as_ref().expect("budget spec");
    assert_eq!(budget.min_available, Some(IntOrString::Int(1)));
    assert_eq!(
        budget
            .selector
            .as_ref()
            .and_then(|s| s.match_labels.clone()),
        spec.selector.match_labels
    );
    // Probes on --metrics-listen (docs/OPERATOR.md: its own connection cap keeps a flood on
    // the API port from failing them). A startup probe outlasts the first pod list's retries
    // (--kube-startup-timeout, 60 s: the listeners bind after it), and liveness is readiness
    // without the leader label's part (/livez), so a control loop that stopped turning is
    // restarted, not left unready, and a replica whose label write the API refuses is not.
    let metrics = config.metrics_listen.expect("--metrics-listen");
    let port = control
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.container_port == i32::from(metrics.port()))
        .expect("--metrics-listen port is a declared containerPort");
    let port_name = port.name.clone().expect("named port");
    let probes = [
        (&control.startup_probe, "/healthz"),
        (&control.readiness_probe, "/readyz"),
        (&control.liveness_probe, "/livez"),
    ];
    for (probe, path) in probes {
        let probe = probe
            .as_ref()
            .expect("startup, readiness and liveness probes");
        let get = probe.http_get.as_ref().unwrap();
        assert_eq!(get.port, IntOrString::String(port_name.clone()));
        assert_eq!(get.path.as_deref(), Some(path));
    }
    let startup = control.startup_probe.as_ref().unwrap();
    let budget = startup.period_seconds.unwrap_or(10) * startup.failure_threshold.unwrap_or(3);
    assert!(
        budget > 60 + 10,
        "the startup probe gives {budget} s, less than the first list's retries"
    );

    // The EDS service of the gateway's retrying cluster listens on a declared port too, which
    // the Service offers as gRPC.
    let xds = config
        .xds_listen
        .expect("--xds-listen (stand-in pods on the gateway)");
    let xds_port = control
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.container_port == i32::from(xds.port()))
        .expect("--xds-listen port is a declared containerPort");
    let xds_name = xds_port.name.clone().expect("named port");
    let svc_ports = k.services[0]
        .spec
        .as_ref()
        .and_then(|s| s.ports.clone())
        .unwrap_or_default();
    let offered = svc_ports
        .iter()
        .find(|p| p.target_port == Some(IntOrString::String(xds_name.clone())))
        .expect("the Service offers the EDS port");
    assert!(
        offered
            .name
            .as_deref()
            .unwrap_or_default()
            .starts_with("grpc"),
        "Istio protocol by port name: gRPC"
    );

    // Health and metrics alone on a declared port the Service offers as `http-metrics` (the
    // one port the NetworkPolicy opens to Prometheus).
    let metrics = config
        .metrics_listen
        .expect("--metrics-listen (what Prometheus may reach)");
    let metrics_port = control
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.container_port == i32::from(metrics.port()))
        .expect("--metrics-listen port is a declared containerPort");
    let metrics_name = metrics_port.name.clone().expect("named port");
    let offered = svc_ports
        .iter()
        .find(|p| p.target_port == Some(IntOrString::String(metrics_name.clone())))
        .expect("the Service offers the metrics port");
    assert_eq!(offered.name.as_deref(), Some("http-metrics"));

    // pd-control watches Kubernetes itself: no fleet file, no sidecar.
    assert_eq!(
        config.source,
        Some(pd_control::config::SourceKind::Kubernetes)
    );
    assert!(
        config.fleet.is_none(),
        "the kubernetes source takes no --fleet"
    );
    assert_eq!(pod.containers.len(), 1, "pd-control needs no sidecar");

    // The Service reaches that port on these pods.
    let svc = &k.services[0];
    assert_eq!(ns_of(&svc.metadata), ns_of(&dep.metadata));
    let svc_spec = svc.spec.as_ref().unwrap();
    assert_eq!(svc_spec.type_.as_deref(), Some("ClusterIP"));
    let selector = svc_spec.selector.as_ref().unwrap();
    assert_eq!(
        selector.get(pd_control::leader::LABEL).map(String::as_str),
        Some("true"),
        "the Service reaches the leader alone"
    );
    for (key, value) in selector {
        if key != pd_control::leader::LABEL {
            assert_eq!(
                template_labels.get(key),
                Some(value),
                "service selector {key}"
            );
        }
    }
    let listen_port = control
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.container_port == i32::from(config.listen.port()))
        .expect("--listen port is a declared containerPort");
    let sport = &svc_spec.ports.as_ref().unwrap()[0];
    assert_eq!(
        sport.target_port,
        listen_port.name.clone().map(IntOrString::String)
    );
    assert!(
        sport.name.as_deref().unwrap().starts_with("http"),
        "Istio protocol by port name"
    );
}

/// The fleet of envoy/fleets/demo.yaml, by pod name.
fn demo_records() -> BTreeMap<String, PodRecord> {
    pd_control::fleet::parse_records(&read("envoy/fleets/demo.yaml"))
        .unwrap()
        .into_iter()
        .map(|r| (r.name.clone(), r))
        .collect()
}

#[test]
fn example_engines_carry_the_contract_labels_and_annotations() {
    let k = kube();
    let demo = demo_records();
    let mut roles = BTreeSet::new();
    for (file, pod) in &k.pods {
        let name = name_of(&pod.metadata);
        let record =
            PodRecord::from_pod(pod).unwrap_or_else(|| panic!("{file} {name}: not a model pod"));
        assert!(
            ["vllm", "sglang", "trtllm"].contains(&record.engine.as_str()),
            "{name}: engine"
        );
        assert!(
            ["prefill", "decode", "standard"].contains(&record.role.as_str()),
            "{name}: role"
        );
        assert!(!record.roleset.is_empty(), "{name}: roleset-name");
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(
            labels
                .get("model.aibrix.ai/port")
                .map(|p| p.parse::<u16>().unwrap()),
            Some(record.port)
        );
        let spec = pod.spec.as_ref().unwrap();
        let engine = &spec.containers[0];
        assert!(engine.image.as_deref().is_some_and(|i| !i.is_empty()));
        assert!(
            engine
                .ports
                .as_ref()
                .unwrap()
                .iter()
                .any(|p| p.container_port == i32::from(record.port)),
            "{name}: model.aibrix.ai/port is a containerPort"
        );
        let config: Json =
            serde_json::from_str(&record.config).expect("model.aibrix.ai/config is JSON");
        assert!(config["profiles"]["default"]["routingStrategy"].is_string());
        // Same semantics as the demo fleet's pod of the same name.
        let d = demo
            .get(name)
            .unwrap_or_else(|| panic!("{name} has no counterpart in demo.yaml"));
        assert_eq!(
            (&record.model, &record.engine, &record.role, &record.roleset),
            (&d.model, &d.engine, &d.role, &d.roleset),
            "{name}"
        );
        assert_eq!(
            config,
            serde_json::from_str::<Json>(&d.config).unwrap(),
            "{name}: annotation"
        );
        roles.insert(record.role.clone());
    }
    assert_eq!(
        roles,
        BTreeSet::from(["decode".into(), "prefill".into(), "standard".into()])
    );
}

// ---- Istio --------------------------------------------------------------------------------

fn one_of(rel: &str, kind: &str) -> Vec<Yaml> {
    documents(rel)
        .into_iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .collect()
}

fn wasm_plugin() -> Yaml {
    let mut plugins = one_of("envoy/istio/wasmplugin.yaml", "WasmPlugin");
    assert_eq!(plugins.len(), 1);
    plugins.remove(0)
}

/// The plugin configuration JSON and host_env_keys of the static drop-in, without its
/// testing-only `PD_ROUTER_DEBUG_*` keys (production manifests do not pass them).
fn drop_in() -> (Json, Vec<String>) {
    let text = read("envoy/envoy.yaml.tmpl");
    let config_line = text
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("value: '{\"control_cluster\""))
        .expect("plugin configuration line");
    let json = config_line
        .trim_start_matches("value: '")
        .trim_end_matches('\'')
        .replace("@REFRESH_MS@", "100");
    let mut keys = Vec::new();
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if line == "host_env_keys:" {
            inside = true;
        } else if inside && !line.starts_with('#') {
            match line.strip_prefix("- ") {
                Some(key) if key.starts_with("PD_ROUTER_DEBUG_") => {}
                Some(key) => keys.push(key.to_string()),
                None => break,
            }
        }
    }
    assert!(keys.len() > 10, "host_env_keys of the drop-in");
    (serde_json::from_str(&json).unwrap(), keys)
}

fn plugin_config(plugin: &Yaml) -> (Json, PluginConfig) {
    let json = serde_json::to_value(&plugin["spec"]["pluginConfig"]).unwrap();
    let parsed = PluginConfig::parse(json.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("the filter rejects pluginConfig: {e}"));
    (json, parsed)
}

#[test]
fn wasm_plugin_mirrors_the_drop_in_and_never_fails_open() {
    let plugin = wasm_plugin();
    assert_eq!(
        plugin["apiVersion"].as_str(),
        Some("extensions.istio.io/v1alpha1")
    );
    let spec = &plugin["spec"];
    assert!(spec["url"].as_str().unwrap().starts_with("oci://"));
    assert_eq!(spec["failStrategy"].as_str(), Some("FAIL_CLOSE"));
    assert_eq!(spec["type"].as_str(), Some("HTTP"));
    assert!(
        ["AUTHN", "AUTHZ", "STATS", "UNSPECIFIED_PHASE"].contains(&spec["phase"].as_str().unwrap())
    );
    assert!(spec["selector"]["matchLabels"]
        .as_mapping()
        .is_some_and(|m| !m.is_empty()));

    let (json, config) = plugin_config(&plugin);
    let (drop_in_json, host_env_keys) = drop_in();
    for (key, value) in drop_in_json.as_object().unwrap() {
        assert_eq!(
            json.get(key),
            Some(value),
            "pluginConfig.{key} differs from the drop-in"
        );
    }
    assert_eq!(config.pods_cluster, "pd_pods");
    assert_eq!(config.dst_header, "target-pod");

    let env = spec["vmConfig"]["env"].as_sequence().expect("vmConfig.env");
    let mut names = BTreeSet::new();
    for entry in env {
        let map = entry.as_mapping().unwrap();
        for key in map.keys() {
            assert!(
                ["name", "value", "valueFrom"].contains(&key.as_str().unwrap()),
                "env key {key:?}"
            );
        }
        let name = entry["name"].as_str().unwrap();
        assert!(names.insert(name.to_string()), "{name} twice");
        match (entry.get("value"), entry.get("valueFrom")) {
            (Some(v), None) => assert!(v.is_string(), "{name}: inline values are strings"),
            (None, Some(from)) => assert_eq!(from.as_str(), Some("HOST"), "{name}"),
            other => panic!("{name}: exactly one of value / valueFrom, got {other:?}"),
        }
    }
    let expected: BTreeSet<String> = host_env_keys.into_iter().collect();
    assert_eq!(
        names, expected,
        "vmConfig.env must list exactly the drop-in's host_env_keys"
    );
}

fn name_of_yaml(object: &Yaml) -> String {
    object["metadata"]["name"]
        .as_str()
        .expect("a named object")
        .to_string()
}

fn patches(rel: &str) -> Vec<(Yaml, Yaml)> {
    let mut out = Vec::new();
    let selector = wasm_plugin()["spec"]["selector"]["matchLabels"].clone();
    for filter in one_of(rel, "EnvoyFilter") {
        assert_eq!(
            filter["apiVersion"].as_str(),
            Some("networking.istio.io/v1alpha3")
        );
        assert_eq!(
            filter["spec"]["workloadSelector"]["labels"], selector,
            "same proxies as the plugin"
        );
        for p in filter["spec"]["configPatches"].as_sequence().unwrap() {
            out.push((p.clone(), filter.clone()));
        }
    }
    assert!(!out.is_empty(), "{rel}: no EnvoyFilter patches");
    out
}

/// Every Istio object and the NetworkPolicy select the same gateway proxies as the plugin, and
/// that is a gateway of pd-router's own: on the mesh's shared `istio: ingressgateway` every
/// other host's requests would meet the filter (501 for their paths) and these timeouts.
#[test]
fn everything_targets_one_dedicated_gateway() {
    let selector = wasm_plugin()["spec"]["selector"]["matchLabels"].clone();
    assert_ne!(
        selector["istio"].as_str(),
        Some("ingressgateway"),
        "not the shared ingress gateway"
    );
    let gateways = one_of("envoy/istio/gateway-route.yaml", "Gateway");
    assert_eq!(gateways[0]["spec"]["selector"], selector);
    for rel in [
        "envoy/istio/gateway-route.yaml",
        "envoy/istio/envoyfilter-clusters.yaml",
        "envoy/istio/envoyfilter-wasm-fallback.yaml",
    ] {
        patches(rel); // asserts each EnvoyFilter's workloadSelector
    }
    let policy = documents("envoy/kubernetes/networkpolicy.yaml");
    let peer = &policy[0]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"];
    assert_eq!(*peer, selector, "pd-control admits that gateway");
}

#[test]
fn envoy_filters_add_the_clusters_the_plugin_names() {
    let (_, config) = plugin_config(&wasm_plugin());
    let mut filter_of = BTreeMap::new();
    let clusters: BTreeMap<String, Yaml> = patches("envoy/istio/envoyfilter-clusters.yaml")
        .into_iter()
        .filter(|(p, _)| p["applyTo"].as_str() == Some("CLUSTER"))
        .map(|(p, filter)| {
            assert_eq!(p["patch"]["operation"].as_str(), Some("ADD"));
            let value = p["patch"]["value"].clone();
            let name = value["name"].as_str().unwrap().to_string();
            filter_of.insert(name.clone(), name_of_yaml(&filter));
            (name, value)
        })
        .collect();
    // An istiod refusing the retrying cluster (its load-balancing extension unknown to it)
    // refuses its EnvoyFilter whole: the clusters every request needs must not be in it.
    assert_ne!(filter_of["pd_pods_retry"], filter_of["pd_pods"]);
    assert_ne!(filter_of["pd_pods_retry"], filter_of["pd_control"]);

    let pods = &clusters[&config.pods_cluster];
    assert_eq!(pods["type"].as_str(), Some("ORIGINAL_DST"));
    assert_eq!(pods["lb_policy"].as_str(), Some("CLUSTER_PROVIDED"));
    assert_eq!(
        pods["original_dst_lb_config"]["use_http_header"].as_bool(),
        Some(true)
    );
    assert_eq!(
        pods["original_dst_lb_config"]["http_header_name"].as_str(),
        Some(config.dst_header.as_str())
    );

    let control = &clusters[&config.control_cluster];
    let k = kube();
    let svc = &k.services[0];
    let address = &control["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        ["address"]["socket_address"];
    let fqdn = format!(
        "{}.{}.svc.cluster.local",
        name_of(&svc.metadata),
        ns_of(&svc.metadata)
    );
    assert_eq!(address["address"].as_str(), Some(fqdn.as_str()));
    assert_eq!(config.control_authority, fqdn);
    let port = svc.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port;
    assert_eq!(address["port_value"].as_i64(), Some(i64::from(port)));

    // The retrying cluster balances as the drop-in's does, fed by pd-control's EDS service.
    let retry = &clusters["pd_pods_retry"];
    let drop_in_retry = drop_in_cluster("pd_pods_retry");
    assert_eq!(retry["type"].as_str(), Some("EDS"));
    for key in [
        "load_balancing_policy",
        "circuit_breakers",
        "connect_timeout",
        "typed_extension_protocol_options",
    ] {
        assert_eq!(retry[key], drop_in_retry[key], "pd_pods_retry.{key}");
    }
    // Idle connections to the pods closed as the drop-in closes them.
    assert_eq!(
        pods["typed_extension_protocol_options"],
        drop_in_cluster("pd_pods")["typed_extension_protocol_options"]
    );
    let source = &retry["eds_cluster_config"]["eds_config"]["api_config_source"];
    assert_eq!(source["api_type"].as_str(), Some("GRPC"));
    // Istio delivers the cluster over CDS: its gRPC source cannot name another cluster (Envoy
    // refuses an `envoy_grpc` source that is not a bootstrap cluster), so it dials pd-control
    // itself.
    let google = &source["grpc_services"][0]["google_grpc"];
    assert!(
        source["grpc_services"][0]["envoy_grpc"].is_null(),
        "no envoy_grpc source on a CDS cluster"
    );
    let grpc_port = svc
        .spec
        .as_ref()
        .unwrap()
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.name.as_deref().is_some_and(|n| n.starts_with("grpc")))
        .expect("the Service's gRPC port")
        .port;
    assert_eq!(
        google["target_uri"].as_str(),
        Some(format!("{fqdn}:{grpc_port}").as_str())
    );
    assert!(config.connect_retry, "the plugin names stand-ins");
}

/// The engines' API servers (uvicorn) close a kept-alive connection after 5 s without a
/// request; every Envoy cluster of engine pods must close its idle ones sooner, or a request
/// written as the engine closes fails unanswered.
#[test]
fn pod_clusters_close_idle_connections_before_the_engines_do() {
    const ENGINE_KEEP_ALIVE_S: f64 = 5.0;
    let idle_timeout = |cluster: &Yaml, origin: &str| -> f64 {
        let text = cluster["typed_extension_protocol_options"]
            ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            ["common_http_protocol_options"]["idle_timeout"]
            .as_str()
            .unwrap_or_else(|| panic!("{origin}: no upstream idle_timeout"));
        text.strip_suffix('s')
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{origin}: idle_timeout {text} is not N s"))
    };
    let mut checked = 0;
    for rel in [
        "envoy/envoy.yaml.tmpl",
        "envoy/envoy-ecds.yaml.tmpl",
        "envoy/envoy-passthrough.yaml.tmpl",
    ] {
        let doc = template_yaml(rel);
        for cluster in doc["static_resources"]["clusters"]
            .as_sequence()
            .expect("clusters")
        {
            let name = cluster["name"].as_str().unwrap_or_default();
            if matches!(name, "pd_pods" | "pd_pods_retry" | "pod") {
                let t = idle_timeout(cluster, &format!("{rel} {name}"));
                assert!(t > 0.0 && t < ENGINE_KEEP_ALIVE_S, "{rel} {name}: {t} s");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 5);
}

/// The `pd_control` cluster Istio's EnvoyFilter adds.
fn istio_pd_control_cluster() -> Yaml {
    let istio: Vec<Yaml> = patches("envoy/istio/envoyfilter-clusters.yaml")
        .into_iter()
        .filter(|(p, _)| p["patch"]["value"]["name"].as_str() == Some("pd_control"))
        .map(|(p, _)| p["patch"]["value"].clone())
        .collect();
    assert_eq!(istio.len(), 1);
    istio[0].clone()
}

/// pd-control closes a kept-alive connection after 10 s without a request; the gateways'
/// `pd_control` cluster closes its idle ones sooner, in the typed protocol options (Envoy 1.40
/// warns that the cluster-level field will go, and a cluster it refuses takes every poll and
/// admission with it).
#[test]
fn pd_control_connections_close_idle_before_pd_control_does() {
    let istio = istio_pd_control_cluster();
    let ecds = template_yaml("envoy/envoy-ecds.yaml.tmpl")["static_resources"]["clusters"]
        .as_sequence()
        .expect("clusters")
        .iter()
        .find(|c| c["name"].as_str() == Some("pd_control"))
        .cloned()
        .expect("the ECDS drop-in's pd_control");
    for cluster in [drop_in_cluster("pd_control"), ecds, istio.clone()] {
        assert!(
            cluster["common_http_protocol_options"].is_null(),
            "the deprecated field"
        );
        let idle = cluster["typed_extension_protocol_options"]
            ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            ["common_http_protocol_options"]["idle_timeout"]
            .as_str();
        assert_eq!(idle, Some("5s"), "{cluster:?}");
    }
}

/// The Istio gateway's connection manager gets the drop-in's timeouts.
#[test]
fn istio_connection_manager_keeps_the_drop_ins_timeouts() {
    let hcm = |doc: &Yaml| {
        doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            .clone()
    };
    let inline = hcm(&drop_in_yaml());
    let patches: Vec<Yaml> = patches("envoy/istio/envoyfilter-clusters.yaml")
        .into_iter()
        .filter(|(p, _)| p["applyTo"].as_str() == Some("NETWORK_FILTER"))
        .map(|(p, _)| p["patch"]["value"]["typed_config"].clone())
        .collect();
    assert_eq!(patches.len(), 1);
    for key in [
        "stream_idle_timeout",
        "request_headers_timeout",
        "request_timeout",
        "delayed_close_timeout",
    ] {
        assert!(!inline[key].is_null(), "the drop-in sets {key}");
        assert_eq!(patches[0][key], inline[key], "{key}");
    }
}

/// Every Envoy of ours bounds its client connections the same way (the drop-ins, and the
/// plain Envoy the benchmarks compare them with).
#[test]
fn every_envoy_bounds_its_client_connections() {
    let inline = drop_in_yaml()["overload_manager"].clone();
    let limit = inline["resource_monitors"][0]["typed_config"]["max_active_downstream_connections"]
        .as_i64()
        .expect("a downstream connection limit");
    assert!(limit >= 1000, "{limit}");
    for rel in [
        "envoy/envoy-ecds.yaml.tmpl",
        "envoy/envoy-passthrough.yaml.tmpl",
    ] {
        assert_eq!(template_yaml(rel)["overload_manager"], inline, "{rel}");
    }
}

/// The drop-in (envoy/envoy.yaml.tmpl) as YAML, its `@PLACEHOLDER@`s filled.
fn drop_in_yaml() -> Yaml {
    template_yaml("envoy/envoy.yaml.tmpl")
}

/// An Envoy template as YAML, its `@PLACEHOLDER@`s filled.
fn template_yaml(rel: &str) -> Yaml {
    let text = read(rel);
    let mut filled = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(at) = rest.find('@') {
        filled.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let name_len = after
            .find(|c: char| !(c.is_ascii_uppercase() || c == '_'))
            .unwrap_or(after.len());
        if name_len > 0 && after[name_len..].starts_with('@') {
            filled.push_str("placeholder");
            rest = &after[name_len + 1..];
        } else {
            filled.push('@');
            rest = after;
        }
    }
    filled.push_str(rest);
    serde_yaml::from_str(&filled).unwrap_or_else(|e| panic!("{rel} is not YAML: {e}"))
}

/// The ECDS drop-in routes and retries as the inline one: the same routes (the stand-in route
/// first), the same pod clusters, and a filter config that names stand-ins.
#[test]
fn the_ecds_drop_in_routes_and_retries_as_the_inline_one() {
    let inline = drop_in_yaml();
    let ecds = template_yaml("envoy/envoy-ecds.yaml.tmpl");
    let routes = |doc: &Yaml| {
        doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            ["route_config"]
            .clone()
    };
    assert_eq!(routes(&ecds), routes(&inline));
    let cluster = |doc: &Yaml, name: &str| {
        doc["static_resources"]["clusters"]
            .as_sequence()
            .expect("clusters")
            .iter()
            .find(|c| c["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no cluster {name}"))
            .clone()
    };
    for name in ["pd_pods", "pd_pods_retry", "pd_control"] {
        assert_eq!(cluster(&ecds, name), cluster(&inline, name), "{name}");
    }
    let resource = template_yaml("envoy/ecds-pd-router.yaml.tmpl");
    let value = resource["resources"][0]["typed_config"]["config"]["configuration"]["value"]
        .as_str()
        .expect("the ECDS resource's plugin configuration")
        .replace("placeholder", "100");
    let json: Json = serde_json::from_str(&value).expect("plugin configuration JSON");
    assert_eq!(
        json,
        drop_in().0,
        "the same plugin configuration as the inline drop-in"
    );
    let config = PluginConfig::parse(value.as_bytes()).expect("the filter takes it");
    assert!(config.connect_retry, "the ECDS filter names stand-ins");
}

/// One cluster of the drop-in, by name.
fn drop_in_cluster(name: &str) -> Yaml {
    drop_in_yaml()["static_resources"]["clusters"]
        .as_sequence()
        .expect("clusters")
        .iter()
        .find(|c| c["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no cluster {name} in the drop-in"))
        .clone()
}

#[test]
fn gateway_route_points_the_named_route_at_pd_pods() {
    let (_, config) = plugin_config(&wasm_plugin());
    let rel = "envoy/istio/gateway-route.yaml";
    let gateways = one_of(rel, "Gateway");
    let services = one_of(rel, "VirtualService");
    assert_eq!((gateways.len(), services.len()), (1, 1));
    let vs = &services[0]["spec"];
    assert_eq!(vs["gateways"][0], gateways[0]["metadata"]["name"]);
    let route_name = vs["http"][0]["name"].as_str().expect("named http route");
    // Istio's default retries would survive the MERGE below (the drop-in's route has none).
    assert_eq!(vs["http"][0]["retries"]["attempts"].as_i64(), Some(0));
    let routes: Vec<_> = patches(rel)
        .into_iter()
        .filter(|(p, _)| p["applyTo"].as_str() == Some("HTTP_ROUTE"))
        .collect();
    assert_eq!(routes.len(), 2);
    for (patch, _) in &routes {
        assert_eq!(
            patch["match"]["routeConfiguration"]["vhost"]["route"]["name"].as_str(),
            Some(route_name)
        );
    }
    let by_operation = |operation: &str| {
        routes
            .iter()
            .find(|(p, _)| p["patch"]["operation"].as_str() == Some(operation))
            .map(|(p, _)| p["patch"]["value"].clone())
            .unwrap_or_else(|| panic!("no {operation} route patch"))
    };
    assert_eq!(
        by_operation("MERGE")["route"]["cluster"].as_str(),
        Some(config.pods_cluster.as_str())
    );
    // Before it, the drop-in's first route: stand-in requests to the retrying cluster.
    let stand_in = by_operation("INSERT_BEFORE");
    let drop_in_routes = &drop_in_yaml()["static_resources"]["listeners"][0]["filter_chains"][0]
        ["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"];
    let first = &drop_in_routes[0];
    assert_eq!(first["route"]["cluster"].as_str(), Some("pd_pods_retry"));
    assert_eq!(stand_in["match"], first["match"]);
    assert_eq!(stand_in["route"], first["route"]);
}

/// Every route to the pods has no total timeout (it would cut a long generation's stream
/// mid-answer) and an hour's `max_stream_duration` instead: the drop-ins' routes, the Istio
/// route's MERGE and inserted stand-in route, and the VirtualService itself (whose own
/// timeout Istio would otherwise write into the route).
#[test]
fn no_route_cuts_a_long_generation() {
    let drop_in_routes = |doc: &Yaml| {
        doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            ["route_config"]["virtual_hosts"][0]["routes"]
            .as_sequence()
            .expect("routes")
            .iter()
            .map(|r| r["route"].clone())
            .collect::<Vec<_>>()
    };
    let mut routes = drop_in_routes(&drop_in_yaml());
    routes.extend(drop_in_routes(&template_yaml("envoy/envoy-ecds.yaml.tmpl")));
    let rel = "envoy/istio/gateway-route.yaml";
    routes.extend(
        patches(rel)
            .into_iter()
            .filter(|(p, _)| p["applyTo"].as_str() == Some("HTTP_ROUTE"))
            .map(|(p, _)| p["patch"]["value"]["route"].clone()),
    );
    assert_eq!(routes.len(), 6);
    for route in &routes {
        assert_eq!(route["timeout"].as_str(), Some("0s"), "{route:?}");
        assert_eq!(
            route["max_stream_duration"]["max_stream_duration"].as_str(),
            Some("3600s"),
            "{route:?}"
        );
    }
    // Istio's validation refuses a VirtualService timeout under 1 ms ("duration must be
    // greater than 1ms"): `0s` there would reject the whole VirtualService. The route patch
    // above takes the total timeout off; Istio's own default sets none.
    let services = one_of(rel, "VirtualService");
    assert!(
        services[0]["spec"]["http"][0]["timeout"].is_null(),
        "{:?}",
        services[0]["spec"]["http"][0]["timeout"]
    );
    // Until the route patch applies, the route's own destination answers: never pd-control,
    // whose API the gateway's clients must not reach.
    let host = services[0]["spec"]["http"][0]["route"][0]["destination"]["host"]
        .as_str()
        .expect("a destination");
    assert!(host.starts_with("pd-router-placeholder."), "{host}");
}

/// pd-control's cluster carries per-request calls (admissions, the external router), so
/// like the pod clusters it is not held to Envoy's default 1024 requests at once, in the
/// drop-ins and on Istio alike.
#[test]
fn pd_controls_cluster_is_not_held_to_envoys_default_limits() {
    let istio = istio_pd_control_cluster();
    for cluster in [drop_in_cluster("pd_control"), istio] {
        let limits = &cluster["circuit_breakers"]["thresholds"][0];
        for key in ["max_connections", "max_pending_requests", "max_requests"] {
            assert!(
                limits[key].as_u64().is_some_and(|n| n >= 100_000),
                "{key}: {cluster:?}"
            );
        }
    }
}

#[test]
fn every_istio_document_names_itself() {
    for file in yaml_files("envoy/istio") {
        for doc in documents(&file) {
            if doc["apiVersion"].as_str() == Some("v1") {
                // The route's placeholder destination: a Service nothing stands behind.
                let svc: Service = typed(&doc, &file);
                assert_eq!(name_of(&svc.metadata), "pd-router-placeholder", "{file}");
                assert!(
                    svc.spec.as_ref().is_some_and(|s| s.selector.is_none()),
                    "{file}: a placeholder selects no pod"
                );
                continue;
            }
            assert!(
                doc["apiVersion"]
                    .as_str()
                    .is_some_and(|a| a.contains("istio.io")),
                "{file}"
            );
            assert!(doc["kind"].as_str().is_some(), "{file}");
            assert!(doc["metadata"]["name"].as_str().is_some(), "{file}");
            assert!(doc["spec"].is_mapping(), "{file}");
        }
    }
}

#[test]
fn fallback_envoy_filter_carries_the_drop_in_wasm_config() {
    let (plugin_json, _) = plugin_config(&wasm_plugin());
    let (_, host_env_keys) = drop_in();
    let inserted: Vec<_> = patches("envoy/istio/envoyfilter-wasm-fallback.yaml")
        .into_iter()
        .filter(|(p, _)| p["applyTo"].as_str() == Some("HTTP_FILTER"))
        .collect();
    assert_eq!(inserted.len(), 1);
    let (patch, _) = &inserted[0];
    assert_eq!(patch["patch"]["operation"].as_str(), Some("INSERT_BEFORE"));
    assert_eq!(
        patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"].as_str(),
        Some("envoy.filters.http.router")
    );
    let config = &patch["patch"]["value"]["typed_config"]["config"];
    assert_eq!(
        config["allow_on_headers_stop_iteration"].as_bool(),
        Some(true)
    );
    assert_eq!(config["failure_policy"].as_str(), Some("FAIL_RELOAD"));
    // The environment: the WasmPlugin's INLINE values inline, every other drop-in key from
    // the host, none in both (Envoy rejects a key listed twice).
    let env = &config["vm_config"]["environment_variables"];
    let host: Vec<String> = env["host_env_keys"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_string())
        .collect();
    let inline: BTreeMap<String, String> = env["key_values"]
        .as_mapping()
        .expect("key_values")
        .iter()
        .map(|(k, v)| (k.as_str().unwrap().into(), v.as_str().unwrap().into()))
        .collect();
    let plugin_inline: BTreeMap<String, String> = wasm_plugin()["spec"]["vmConfig"]["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?.into(), e["value"].as_str()?.into())))
        .collect();
    assert_eq!(inline, plugin_inline, "the WasmPlugin's inline values");
    assert!(host.iter().all(|k| !inline.contains_key(k)), "{host:?}");
    let mut all: Vec<String> = host.iter().chain(inline.keys()).cloned().collect();
    let mut expected = host_env_keys.clone();
    all.sort();
    expected.sort();
    assert_eq!(all, expected, "every variable of the drop-in");
    // The plugin configuration: the WasmPlugin's, every key (stand-ins named included).
    let raw = config["configuration"]["value"].as_str().unwrap();
    PluginConfig::parse(raw.as_bytes()).expect("the filter accepts the fallback configuration");
    let json: Json = serde_json::from_str(raw).unwrap();
    assert_eq!(
        json, plugin_json,
        "the fallback's plugin configuration is wasmplugin.yaml's"
    );
}

// ---- Metrics labels ------------------------------------------------------------------------

/// Every label the filter writes into a stat name has a `stats_tags` entry, with the regex
/// Istio generates for `extraStatTags`, in both drop-ins; otherwise the label would stay in
/// the metric name and the series would not match the contract's name.
#[test]
fn drop_ins_extract_every_filter_label() {
    use pd_router_filter::core::obs::labels::TAG_NAMES;
    let mut bucket_settings = Vec::new();
    for rel in ["envoy/envoy.yaml.tmpl", "envoy/envoy-ecds.yaml.tmpl"] {
        let text = read(rel).replace('@', "x");
        let doc: Yaml = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{rel}: {e}"));
        bucket_settings.push(doc["stats_config"]["histogram_bucket_settings"].clone());
        let tags: BTreeMap<String, String> = doc["stats_config"]["stats_tags"]
            .as_sequence()
            .unwrap_or_else(|| panic!("{rel}: no stats_tags"))
            .iter()
            .map(|t| {
                (
                    t["tag_name"].as_str().unwrap().to_string(),
                    t["regex"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        for tag in TAG_NAMES {
            assert_eq!(
                tags.get(tag).map(String::as_str),
                Some(format!(r"({tag}=\.=(.*?);\.;)").as_str()),
                "{rel}: tag {tag}"
            );
        }
    }
    assert!(bucket_settings[0].is_sequence(), "histogram buckets set");
    assert_eq!(
        bucket_settings[0], bucket_settings[1],
        "both drop-ins bucket the histograms alike"
    );
}

/// pd-control accepts as the external router's fallback exactly the filter's single-pod
/// strategies: not `pd` or `external`, which need their own preprocessing.
#[test]
fn external_router_fallbacks_are_the_filters_single_pod_strategies() {
    use pd_router_filter::core::profile::Strategy;
    let single: Vec<&str> = Strategy::ALL
        .iter()
        .filter(|s| !matches!(s, Strategy::Pd | Strategy::External))
        .map(|s| s.name())
        .collect();
    assert_eq!(single, pd_control::external::config::FALLBACK_STRATEGIES);
}
