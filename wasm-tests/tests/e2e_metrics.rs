//! End-to-end observability: after a known load through the real Envoy (`--concurrency 2`),
//! `/stats/prometheus` carries the contract's metric names with real labels and the values
//! the load implies; routing explanations, the access log and the Grafana dashboard are
//! checked against the same run.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use pd_wasm_tests::http::{self, Response};
use pd_wasm_tests::prom::Scrape;
use pd_wasm_tests::stack::{Fleet, Options, Stack};
use serde_json::{json, Value};

/// A model name with dots: labels must keep it whole.
const MODEL: &str = "llama-3.1-8b";
const PD: &[(&str, &str)] = &[("routing-strategy", "pd")];

fn fleet() -> Fleet {
    Fleet::new(MODEL)
        .pod("vllm-p-0", "prefill", "group-0")
        .pod("vllm-d-0", "decode", "group-0")
        .pod("vllm-p-1", "prefill", "group-1")
        .pod("vllm-d-1", "decode", "group-1")
}

fn chat(stream: bool, max_tokens: u32) -> Value {
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Explain prefill and decode disaggregation."}],
        "stream": stream,
        "max_tokens": max_tokens,
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

fn header<'a>(r: &'a Response, name: &str) -> &'a str {
    r.header(name)
        .unwrap_or_else(|| panic!("response lacks {name}: {:?} {}", r.headers, r.text()))
}

/// Polls Envoy's Prometheus output until `ready` holds (histograms appear after a stats
/// flush, once a second), then returns that scrape.
fn scrape_until(stack: &Stack, what: &str, ready: impl Fn(&Scrape) -> bool) -> Scrape {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let s = stack.scrape();
        if ready(&s) {
            return s;
        }
        if Instant::now() > deadline {
            let ours: Vec<String> = s
                .samples
                .iter()
                .filter(|x| x.name.starts_with("gateway_") || x.name.starts_with("pd_"))
                .map(|x| format!("{} {:?} {}", x.name, x.labels, x.value))
                .collect();
            panic!("{what} never held; filter series:\n{}", ours.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The filter's metric families; any other `gateway_`/`pd_` name in the scrape would mean a
/// label that Envoy's `stats_tags` did not turn into a label.
const FAMILIES: &[&str] = &[
    "gateway_request_model_success_total",
    "gateway_request_model_fail_total",
    "gateway_prefill_request_success_total",
    "gateway_prefill_request_fail_total",
    "gateway_prefill_outstanding_requests",
    "gateway_first_token_delay_over_1s_total",
    "gateway_routing_time_bucket_total",
    "gateway_prefill_time_bucket_total",
    "gateway_kv_transfer_time_bucket_total",
    "gateway_decode_time_bucket_total",
    "gateway_ttft_bucket_total",
    "gateway_tpot_bucket_total",
    "gateway_total_time_bucket_total",
    "pd_selected_prefill_pod_total",
    "pd_selected_decode_pod_total",
    "pd_token_load_active_tokens",
    "pd_token_load_kv_tokens",
    "pd_token_load_decode_tokens",
    "pd_router_prefill_inflight",
    "pd_router_running_requests",
    "pd_router_requests_total",
    "pd_router_routed_total",
    "pd_router_session_affinity_total",
    "pd_router_prefill_failover_total",
    "pd_router_external_decisions_total",
    "pd_router_rejected_total",
    "pd_router_upstream_errors_rewritten_total",
    "pd_router_fleet_version",
    "pd_router_fleet_loaded_vms",
    "pd_router_idle_vms",
    "pd_router_fleet_vms_on_latest",
    "pd_router_snapshot_fetch_errors_total",
    "pd_router_snapshot_adoptions_total",
    "pd_router_ejections_total",
    "pd_router_ejections_adopted_total",
    "pd_router_decode_rerouted_total",
    "pd_router_stand_in_retries_total",
    "pd_router_rate_limit_checks_total",
    "pd_router_rate_limit_unchecked_total",
    "pd_router_user_tokens_reported_total",
    "pd_router_user_tokens_unreported_total",
    "pd_router_user_token_report_failures_total",
    "pd_router_model_rps_refunds_total",
    "pd_router_rate_limit_withdrawals_total",
    "pd_router_prefix_batches_missed_total",
    "pd_router_vms_reclaimed_total",
    "pd_router_charges_force_released_total",
    "pd_router_charge_release_errors_total",
    "pd_router_pod_failures_total",
    "pd_router_snapshot_stale",
    "pd_router_snapshot_age_ms",
    "pd_router_selection_us",
    "pd_router_selection_core_us",
    "pd_router_routing_time_us",
    "pd_router_prefill_time_us",
    "pd_router_kv_transfer_time_us",
    "pd_router_decode_time_ms",
    "pd_router_ttft_ms",
    "pd_router_tpot_us",
    "pd_router_total_time_ms",
    "gateway_pd_decode_watchdog_total",
    "gateway_pd_decode_abort_total",
    "pd_router_remote_decode_tokens",
    "pd_router_remote_running_requests",
    "pd_router_remote_replicas",
    "vtc_bucket_size_active",
];

/// The family of a sample name (`x_bucket`, `x_sum`, `x_count` belong to histogram `x`).
fn family(name: &str) -> &str {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix) {
            if FAMILIES.contains(&base) {
                return base;
            }
        }
    }
    name
}

/// Prefill legs per pod, as pd-sim logged them.
fn prefill_legs_per_pod(stack: &Stack) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for e in stack.sim_requests() {
        if e["leg"] == "prefill" {
            *out.entry(e["pod"].as_str().unwrap_or("?").to_string())
                .or_insert(0.0) += 1.0;
        }
    }
    out
}

/// Metric names an expression uses: identifiers of our families (histogram samples included).
fn expr_metric_names(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|t| {
            [
                "gateway_",
                "pd_router_",
                "pd_selected_",
                "pd_token_load_",
                "pd_control_",
            ]
            .iter()
            .any(|p| t.starts_with(p))
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn a_known_load_shows_up_with_contract_names_labels_and_values() {
    const NON_STREAM: usize = 6;
    const STREAM: usize = 6;
    const ROUTED: usize = NON_STREAM + STREAM;
    let fleet = fleet();
    let stack = Stack::start_opts(
        fleet.clone(),
        fleet,
        &Options {
            // Every PD stream takes > 80 ms to its first token (the KV pull alone), above the
            // 50 ms threshold; non-streaming requests never count.
            envoy_env: &[("AIBRIX_TTFT_THRESHOLD_S", "0.05")],
            sim_args: &["--kv-pull-base-ms", "80"],
            explain: true,
            ..Options::default()
        },
    );

    let mut pairs = Vec::new();
    for i in 0..ROUTED {
        let stream = i % 2 == 1;
        let r = stack.chat(PD, &chat(stream, 4));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(
            r.header("x-pd-explain").is_none(),
            "no explanation unless asked"
        );
        pairs.push((
            header(&r, "request-id").to_string(),
            header(&r, "prefill-target-pod").to_string(),
            header(&r, "target-pod").to_string(),
        ));
    }
    // Two refusals whose model the fleet does not know: labelled model="unknown".
    let r = stack.chat(
        PD,
        &json!({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(r.status, 400);
    let r = http::request(
        &stack.gateway,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        b"{not json",
    )
    .expect("gateway");
    assert_eq!(r.status, 400);

    let s = scrape_until(&stack, "every histogram flushed", |s| {
        s.sum("pd_router_total_time_ms_count", &[]) >= ROUTED as f64
            && s.sum("pd_router_ttft_ms_count", &[]) >= STREAM as f64
            && s.sum("gateway_request_model_fail_total", &[]) >= 2.0
    });
    let n = |v: usize| v as f64;

    // Outcomes: one per request, by model, phase status and code.
    assert_eq!(
        s.value(
            "gateway_request_model_success_total",
            &[
                ("model", MODEL),
                ("status", "response_success"),
                ("status_code", "200")
            ]
        ),
        Some(n(ROUTED))
    );
    assert_eq!(s.sum("gateway_request_model_success_total", &[]), n(ROUTED));
    assert_eq!(
        s.value(
            "gateway_request_model_fail_total",
            &[
                ("model", "unknown"),
                ("status", "request_body_fail"),
                ("status_code", "400")
            ]
        ),
        Some(2.0)
    );

    // Prefill legs.
    assert_eq!(
        s.value(
            "gateway_prefill_request_success_total",
            &[
                ("status", "pd-prefill-request-success"),
                ("status_code", "200")
            ]
        ),
        Some(n(ROUTED))
    );
    assert_eq!(s.sum("gateway_prefill_request_fail_total", &[]), 0.0);
    assert_eq!(
        s.value("gateway_prefill_outstanding_requests", &[]),
        Some(0.0)
    );

    // Per-pod selections: labelled, summing to the requests, and matching what each pod saw.
    let legs = prefill_legs_per_pod(&stack);
    for (metric, role) in [
        ("pd_selected_prefill_pod_total", "prefill"),
        ("pd_selected_decode_pod_total", "decode"),
    ] {
        assert_eq!(s.sum(metric, &[("model", MODEL)]), n(ROUTED), "{metric}");
        for sample in s.series(metric, &[]) {
            let pod = &sample.labels["pod"];
            let spec = stack.fleet.spec(pod);
            assert_eq!(spec.role, role, "{sample:?}");
            assert_eq!(sample.labels["role"], role);
            assert_eq!(sample.labels["roleset"], spec.roleset);
            assert_eq!(sample.labels["namespace"], "default");
            if role == "prefill" {
                assert_eq!(Some(&sample.value), legs.get(pod), "{pod}: {legs:?}");
            }
            let chosen = pairs
                .iter()
                .filter(|(_, p, d)| {
                    if role == "prefill" {
                        p == pod
                    } else {
                        d == pod
                    }
                })
                .count();
            assert_eq!(sample.value, n(chosen), "{pod} per the response headers");
        }
    }

    // AIBrix's duration bucket counters: one count per measured request.
    for (metric, count) in [
        ("gateway_routing_time_bucket_total", ROUTED),
        ("gateway_prefill_time_bucket_total", ROUTED),
        ("gateway_decode_time_bucket_total", ROUTED),
        ("gateway_total_time_bucket_total", ROUTED),
        ("gateway_ttft_bucket_total", STREAM),
        ("gateway_kv_transfer_time_bucket_total", STREAM),
        ("gateway_tpot_bucket_total", STREAM),
    ] {
        assert_eq!(s.sum(metric, &[]), n(count), "{metric}");
        assert!(
            s.series(metric, &[])
                .all(|x| x.labels["bucket"].ends_with("ms") || x.labels["bucket"].ends_with("ms+")),
            "{metric} bucket labels"
        );
    }
    // Every stream's KV pull alone is 80 ms: its TTFT and KV-transfer buckets are >= 50 ms.
    let fast_ttft: f64 = ["0-1ms", "1-2ms", "2-5ms", "5-10ms", "10-20ms", "20-50ms"]
        .iter()
        .map(|b| s.sum("gateway_ttft_bucket_total", &[("bucket", b)]))
        .sum();
    assert_eq!(fast_ttft, 0.0, "no stream had a TTFT under 50 ms");

    // Histograms, in the units their names carry.
    for (metric, count) in [
        ("pd_router_routing_time_us", ROUTED),
        ("pd_router_prefill_time_us", ROUTED),
        ("pd_router_decode_time_ms", ROUTED),
        ("pd_router_total_time_ms", ROUTED),
        ("pd_router_ttft_ms", STREAM),
        ("pd_router_kv_transfer_time_us", STREAM),
        ("pd_router_tpot_us", STREAM),
    ] {
        assert_eq!(
            s.types.get(metric).map(String::as_str),
            Some("histogram"),
            "{metric}"
        );
        assert_eq!(s.sum(&format!("{metric}_count"), &[]), n(count), "{metric}");
    }
    // The drop-in's bucket settings: TPOT in ms steps, µs histograms past an hour.
    let bounds = |metric: &str| -> Vec<f64> {
        s.series(&format!("{metric}_bucket"), &[])
            .filter_map(|b| b.labels.get("le")?.parse().ok())
            .collect()
    };
    for (metric, bound) in [
        ("pd_router_tpot_us", 15_000.0),
        ("pd_router_prefill_time_us", 10_000_000.0),
        ("pd_router_ttft_ms", 3_600_000.0),
    ] {
        let found = bounds(metric);
        assert!(found.contains(&bound), "{metric}: buckets {found:?}");
    }
    let ttft_sum = s.sum("pd_router_ttft_ms_sum", &[]);
    assert!(
        ttft_sum >= 0.9 * 80.0 * n(STREAM),
        "TTFT in ms includes the 80 ms KV pull: sum {ttft_sum}"
    );
    let kv_sum = s.sum("pd_router_kv_transfer_time_us_sum", &[]);
    assert!(
        kv_sum >= 0.9 * 80_000.0 * n(STREAM),
        "KV transfer in µs: sum {kv_sum}"
    );
    assert_eq!(
        s.value("gateway_first_token_delay_over_1s_total", &[]),
        Some(n(STREAM)),
        "streams over AIBRIX_TTFT_THRESHOLD_S"
    );

    // Ledger gauges: per pod of the fleet (every VM shows every pod, charged or not),
    // labelled, and back to zero once every request ended.
    let charged: BTreeSet<&str> = pairs
        .iter()
        .flat_map(|(_, p, d)| [p.as_str(), d.as_str()])
        .collect();
    let gauges: Vec<_> = s.series("pd_token_load_kv_tokens", &[]).collect();
    let labelled: BTreeSet<&str> = gauges
        .iter()
        .map(|g| g.labels["pod_name"].as_str())
        .collect();
    let fleet_pods: BTreeSet<&str> = stack.fleet.pods.iter().map(|p| p.name.as_str()).collect();
    assert!(
        charged.is_subset(&labelled) && labelled.is_subset(&fleet_pods),
        "one series per pod of the fleet, charged ones included: {gauges:?}"
    );
    for g in gauges {
        assert_eq!(g.labels["namespace"], "default");
        assert_eq!(g.value, 0.0);
    }

    // Every filter series was labelled by stats_tags: no unknown family names.
    for sample in &s.samples {
        if sample.name.starts_with("gateway_") || sample.name.starts_with("pd_") {
            assert!(
                FAMILIES.contains(&family(&sample.name)),
                "unexpected series {} {:?}: a label was not extracted",
                sample.name,
                sample.labels
            );
        }
    }

    // The access log names the pods of each request.
    let (request_id, prefill, decode) = pairs[0].clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    let line = loop {
        let found = stack
            .access_log_lines()
            .into_iter()
            .find(|l| l.contains(&format!("request_id={request_id}")));
        if let Some(line) = found {
            break line;
        }
        assert!(
            Instant::now() < deadline,
            "no access-log line for {request_id}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(line.contains(" 200 "), "{line}");
    assert!(line.contains(" strategy=pd "), "{line}");
    assert!(line.contains(&format!(" prefill={prefill} ")), "{line}");
    assert!(line.contains(&format!(" decode={decode} ")), "{line}");
    assert!(line.contains(&format!(" target={decode} ")), "{line}");
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
    };
    let selection_us = field("selection_us").and_then(|v| v.parse::<u64>().ok());
    assert!(selection_us.is_some(), "selection time in µs: {line}");
    // Envoy's own fields: no response flag, the pod answered, and which address it was at.
    assert_eq!(field("flags"), Some("-"), "{line}");
    assert_eq!(field("details"), Some("via_upstream"), "{line}");
    assert!(field("upstream").is_some_and(|u| u.contains(':')), "{line}");
    assert_eq!(
        field("client"),
        Some("127.0.0.1"),
        "the client's address: {line}"
    );

    // The dashboard: valid JSON, and every metric its queries use exists in these scrapes.
    let control = Scrape::parse(
        &http::get(&stack.control, "/metrics")
            .expect("pd-control")
            .text(),
    );
    let mut seen = s.names();
    seen.extend(control.names());
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(repo.join("envoy/dashboards/pd-router.json"))
        .expect("dashboard file");
    let dashboard: Value = serde_json::from_str(&text).expect("dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels").iter();
    let queries = panels.flat_map(|panel| {
        let title = format!("panel {:?}", panel["title"]);
        let targets = panel["targets"].as_array().expect("targets").iter();
        targets.map(move |t| (title.clone(), t["expr"].as_str().expect("expr").to_string()))
    });
    let checked = assert_scraped(queries, &seen);
    assert!(checked >= 20, "only {checked} metric references checked");

    // The alerting rules likewise (envoy/kubernetes/alerts.yaml).
    let text =
        std::fs::read_to_string(repo.join("envoy/kubernetes/alerts.yaml")).expect("alerting rules");
    let rules: serde_yaml::Value = serde_yaml::from_str(&text).expect("alerts are YAML");
    let groups = rules["spec"]["groups"]
        .as_sequence()
        .expect("groups")
        .iter();
    let alerts: Vec<(String, String)> = groups
        .flat_map(|g| g["rules"].as_sequence().expect("rules").iter())
        .map(|r| {
            let expr = r["expr"].as_str().expect("expr").to_string();
            (format!("alert {:?}", r["alert"]), expr)
        })
        .collect();
    assert!(alerts.len() >= 8, "only {} alerts checked", alerts.len());
    assert_scraped(alerts.into_iter(), &seen);
}

/// Checks that every `(origin, PromQL)` names pd-router metrics and only ones a scrape showed
/// (`seen`); returns how many references were checked.
fn assert_scraped(
    queries: impl Iterator<Item = (String, String)>,
    seen: &BTreeSet<String>,
) -> usize {
    let mut checked = 0;
    for (origin, expr) in queries {
        let names = expr_metric_names(&expr);
        assert!(
            !names.is_empty(),
            "{origin}: {expr} names no pd-router metric"
        );
        for name in names {
            assert!(
                seen.contains(&name),
                "{origin} reads {name}, which no scrape shows"
            );
            checked += 1;
        }
    }
    checked
}

/// SGLang sends both legs at once: no synchronous prefill, so AIBrix's rule gives its streams
/// no decode time or TPOT. The histograms take them from the first token.
#[test]
fn sglang_streams_have_decode_time_and_tpot_in_the_histograms_not_in_aibrixs_buckets() {
    const STREAMS: usize = 4;
    let fleet = Fleet::new(MODEL)
        .engine("sglang")
        .pod("sglang-p-0", "prefill", "group-0")
        .pod("sglang-d-0", "decode", "group-0");
    let stack = Stack::start(fleet);
    for _ in 0..STREAMS {
        let r = stack.chat(PD, &chat(true, 4));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let streams = STREAMS as f64;
    let s = scrape_until(&stack, "the streams' decode and TPOT histograms", |s| {
        s.sum("pd_router_tpot_us_count", &[]) >= streams
            && s.sum("pd_router_decode_time_ms_count", &[]) >= streams
    });
    assert_eq!(s.sum("pd_router_tpot_us_count", &[]), streams);
    assert_eq!(s.sum("pd_router_decode_time_ms_count", &[]), streams);
    assert_eq!(s.sum("pd_router_ttft_ms_count", &[]), streams);
    // Every stream generated its 4 tokens, each at least one engine step apart.
    assert!(s.sum("pd_router_tpot_us_sum", &[]) > 0.0);
    for aibrix in [
        "gateway_tpot_bucket_total",
        "gateway_decode_time_bucket_total",
    ] {
        assert_eq!(
            s.sum(aibrix, &[]),
            0.0,
            "{aibrix}: no PrefillEnd, as AIBrix"
        );
    }
    assert_eq!(
        s.sum("gateway_ttft_bucket_total", &[]),
        streams,
        "the bucket counters do count these streams where AIBrix does"
    );
}

#[test]
fn an_explanation_is_returned_only_when_asked_and_names_the_pick() {
    let stack = Stack::start_explained(fleet());
    let mut headers = PD.to_vec();
    headers.push(("x-pd-explain", "1"));
    let r = stack.chat(&headers, &chat(false, 2));
    assert_eq!(r.status, 200, "{}", r.text());
    let explain = header(&r, "x-pd-explain");
    let (prefill, decode) = (header(&r, "prefill-target-pod"), header(&r, "target-pod"));
    assert!(
        explain.starts_with("bucket=off; s0=p[vllm-p-0,vllm-p-1] d[vllm-d-0,vllm-d-1]; s1="),
        "{explain}"
    );
    assert!(explain.contains("; pairs="), "{explain}");
    assert!(
        explain.ends_with(&format!("; pick={prefill}+{decode}")),
        "{explain}"
    );
    // The engine never sees the request header.
    let request_id = header(&r, "request-id");
    let legs: Vec<Value> = stack
        .sim_requests()
        .into_iter()
        .filter(|e| e["x_request_id"] == request_id)
        .collect();
    assert_eq!(legs.len(), 2, "{legs:?}");

    // A refused selection explains itself too: no pod here serves whole requests.
    let r = stack.chat(
        &[("routing-strategy", "least-request"), ("x-pd-explain", "1")],
        &chat(false, 1),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    let explain = header(&r, "x-pd-explain");
    assert!(
        explain.starts_with("strategy=least-request; error=strategy least-request needs a pod"),
        "{explain}"
    );
}

#[test]
fn without_the_plugin_switch_the_explain_header_is_ignored() {
    let stack = Stack::start(fleet());
    let mut headers = PD.to_vec();
    headers.push(("x-pd-explain", "1"));
    let r = stack.chat(&headers, &chat(false, 1));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.header("x-pd-explain").is_none(),
        "explain is off in the plugin"
    );
}

#[test]
fn a_pod_that_leaves_the_fleet_has_its_gauges_zeroed_and_its_counters_frozen() {
    let fleet = fleet();
    let mut stack = Stack::start_opts(
        fleet.clone(),
        fleet,
        &Options {
            envoy_env: &[
                ("AIBRIX_PREFILL_SCORE_POLICY", "least_request"),
                ("AIBRIX_DECODE_SCORE_POLICY", "token_load"),
            ],
            sim_args: &["--decode-ms-per-token", "50"],
            ..Options::default()
        },
    );
    // One long stream (about 3 s of decode) holds a decode-ledger charge on its decode pod.
    let gateway = stack.gateway.clone();
    let long = std::thread::spawn(move || {
        http::post_json(&gateway, "/v1/chat/completions", PD, &chat(true, 60))
    });
    let charged = scrape_until(&stack, "a decode charge", |s| {
        s.series("pd_token_load_decode_tokens", &[])
            .any(|g| g.value > 0.0)
    });
    let busy: Vec<String> = charged
        .series("pd_token_load_decode_tokens", &[])
        .filter(|g| g.value > 0.0)
        .map(|g| g.labels["pod_name"].clone())
        .collect();
    assert_eq!(busy.len(), 1, "one request in flight: {busy:?}");
    let decode = busy[0].clone();
    let roleset = stack.fleet.spec(&decode).roleset.clone();
    let prefill = if roleset == "group-0" {
        "vllm-p-0"
    } else {
        "vllm-p-1"
    };
    // The gauge can show the charge before the selection counter moves (another worker's
    // 1 s gauge sync may run between the charge and the count): wait for the count.
    let selected =
        |s: &Scrape| s.value("pd_selected_decode_pod_total", &[("pod", decode.as_str())]);
    let frozen = selected(&scrape_until(
        &stack,
        "the busy pod's selection counted",
        |s| selected(s).is_some(),
    ))
    .expect("the busy pod was selected");

    // Its roleset leaves the router's fleet (pd-sim keeps serving it, so the stream goes on).
    let remaining = stack.fleet.without(prefill).without(&decode);
    stack.write_fleet(remaining);
    scrape_until(&stack, "the left pod's gauge zeroed", |s| {
        s.value(
            "pd_token_load_decode_tokens",
            &[("pod_name", decode.as_str())],
        ) == Some(0.0)
    });
    assert!(
        !long.is_finished(),
        "the gauge must drop because the pod left, not because its request ended"
    );
    let r = long.join().expect("stream thread");
    assert_eq!(r.status, 200, "{}", r.text());

    // New requests go elsewhere; the left pod's counter no longer moves. (The gauge showed
    // one VM's adoption; the loop's requests may reach another.)
    stack.wait_fleet_adopted();
    for _ in 0..6 {
        let r = stack.chat(PD, &chat(false, 1));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_ne!(header(&r, "target-pod"), decode);
    }
    let after = stack.scrape();
    assert_eq!(
        after.value("pd_selected_decode_pod_total", &[("pod", decode.as_str())]),
        Some(frozen)
    );
    assert_eq!(
        after.value(
            "pd_token_load_decode_tokens",
            &[("pod_name", decode.as_str())]
        ),
        Some(0.0)
    );
    assert!(after.sum("pd_selected_decode_pod_total", &[]) >= frozen + 6.0);
}

#[test]
fn snapshots_that_only_move_metrics_reuse_the_view_and_a_fleet_change_decodes_in_full() {
    let mut stack = Stack::start(fleet());
    let vms = (stack.concurrency + 1) as f64;
    let adoptions = |s: &Scrape, kind: &str| {
        s.value("pd_router_snapshot_adoptions_total", &[("kind", kind)])
            .unwrap_or(0.0)
    };
    // Every VM decoded its first snapshot in full.
    let start = scrape_until(&stack, "every VM's first adoption", |s| {
        adoptions(s, "full") >= vms
    });
    let full = adoptions(&start, "full");
    assert_eq!(full, vms, "one full decode per VM, nothing else yet");

    // Traffic moves the pods' metrics: pd-control publishes new snapshots of the same pods,
    // and every VM adopts them without decoding the fleet again.
    let metrics_only = scrape_until(&stack, "metrics-only adoptions", |s| {
        let r = stack.chat(PD, &chat(false, 4));
        assert_eq!(r.status, 200, "{}", r.text());
        adoptions(s, "metrics") >= 2.0 * vms
    });
    assert_eq!(
        adoptions(&metrics_only, "full"),
        full,
        "no fleet change, no full decode"
    );

    // A pod leaves: the next snapshot is another fleet, decoded in full by every VM, and
    // routing follows it.
    let remaining = stack.fleet.without("vllm-d-1").without("vllm-p-1");
    stack.write_fleet(remaining);
    stack.wait_fleet_adopted();
    let after = stack.scrape();
    assert!(
        adoptions(&after, "full") >= full + vms,
        "full decodes {} after the change, {full} before",
        adoptions(&after, "full")
    );
    for _ in 0..4 {
        let r = stack.chat(PD, &chat(false, 1));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(header(&r, "target-pod"), "vllm-d-0");
    }
}

#[test]
fn every_pod_of_a_large_fleet_gets_its_gauges_over_ticks_and_a_charged_pod_at_once() {
    // Sixty more pods of another model: in the router's fleet, not served. Envoy takes
    // ≈ 0.1 ms to define a stat, so a VM defines ledger gauges within a time budget per tick
    // (a few pods each) instead of all of a large fleet's at once when it adopts it.
    let served = fleet();
    let mut large = served.clone();
    for i in 0..60 {
        let role = if i % 2 == 0 { "prefill" } else { "decode" };
        large = large
            .pod(&format!("big-{i}"), role, &format!("big-{}", i / 2))
            .of_model("big-llm");
    }
    let stack = Stack::start_opts(large.clone(), served, &Options::default());

    // A request's pods show their charge at once, whatever waits in the backlog.
    let r = stack.chat(PD, &chat(false, 1));
    assert_eq!(r.status, 200, "{}", r.text());
    let charged = [header(&r, "target-pod"), header(&r, "prefill-target-pod")];
    let s = stack.scrape();
    for pod in charged {
        assert!(
            s.value("pd_router_running_requests", &[("pod_name", pod)])
                .is_some(),
            "the gauges of {pod}, charged by the request, exist when its answer arrives"
        );
    }

    // Every pod of the fleet, charged or not, gets all five gauges once the backlog drains.
    let all: BTreeSet<&str> = large.pods.iter().map(|p| p.name.as_str()).collect();
    const GAUGES: [&str; 5] = [
        "pd_token_load_active_tokens",
        "pd_token_load_kv_tokens",
        "pd_token_load_decode_tokens",
        "pd_router_prefill_inflight",
        "pd_router_running_requests",
    ];
    let labelled = |s: &Scrape, family: &str| -> BTreeSet<String> {
        s.series(family, &[])
            .map(|g| g.labels["pod_name"].clone())
            .collect()
    };
    let s = scrape_until(&stack, "every pod's five ledger gauges", |s| {
        GAUGES.iter().all(|f| labelled(s, f).len() == all.len())
    });
    for family in GAUGES {
        let names = labelled(&s, family);
        assert_eq!(
            names.iter().map(String::as_str).collect::<BTreeSet<_>>(),
            all,
            "{family}: one series per pod of the fleet"
        );
    }
}

/// A pod's error answer feeds no latency: a pod shedding load with fast 503s would make the
/// TTFT and total-time histograms (and AIBrix's duration buckets) look better the worse it
/// gets. The error is answered first, so any sample of it flushes no later than the success's.
#[test]
fn an_error_answer_feeds_no_latency_histogram() {
    let stack = Stack::start(fleet());
    for pod in ["vllm-d-0", "vllm-d-1"] {
        stack.arm_fault(
            json!({"pod": pod, "kind": "status", "status": 503, "leg": "decode",
                               "times": 1}),
        );
    }
    let failed = stack.chat(PD, &chat(true, 4));
    assert_eq!(failed.status, 503, "{}", failed.text());
    stack.clear_faults();
    let ok = stack.chat(PD, &chat(true, 4));
    assert_eq!(ok.status, 200, "{}", ok.text());
    let s = scrape_until(&stack, "the success's samples flushed", |s| {
        s.sum("pd_router_total_time_ms_count", &[]) >= 1.0
            && s.sum("pd_router_ttft_ms_count", &[]) >= 1.0
    });
    for metric in ["pd_router_total_time_ms_count", "pd_router_ttft_ms_count"] {
        assert_eq!(s.sum(metric, &[]), 1.0, "{metric}");
    }
    for metric in [
        "gateway_total_time_bucket_total",
        "gateway_ttft_bucket_total",
    ] {
        assert_eq!(s.sum(metric, &[]), 1.0, "{metric}");
    }
    stack.wait_ledger_zero();
}
