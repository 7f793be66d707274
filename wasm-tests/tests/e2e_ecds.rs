//! End-to-end: the wasm filter delivered by ECDS (`envoy/envoy-ecds.yaml.tmpl`). Rewriting
//! the ECDS file changes the filter for an already open keep-alive connection, on its next
//! request, without a drain and without failing a request.

use std::time::{Duration, Instant};

use pd_wasm_tests::http::{KeepAlive, Response};
use pd_wasm_tests::stack::{Fleet, Stack};
use serde_json::{json, Value};

const MODEL: &str = "llama-ecds";

fn chat_body() -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about prefill and decode."}],
        "stream": false,
        "max_tokens": 3,
    })
}

fn describe(r: &Response) -> String {
    format!(
        "{} target-pod={:?} prefill-target-pod={:?} x-error-routing={:?} body={}",
        r.status,
        r.header("target-pod"),
        r.header("prefill-target-pod"),
        r.header("x-error-routing"),
        r.text()
    )
}

#[test]
fn an_ecds_update_reaches_an_open_keep_alive_connection_without_failures() {
    let fleet = Fleet::new(MODEL)
        .pod("vllm-p-0", "prefill", "group-0")
        .pod("vllm-d-0", "decode", "group-0")
        .combined("vllm-c-0");
    let stack = Stack::start_ecds(fleet, &[("ROUTING_ALGORITHM", "random")]);
    let mut conn = KeepAlive::connect(&stack.gateway).expect("connect to Envoy");
    let local = conn.local_addr().expect("local addr");
    let send = |conn: &mut KeepAlive| -> Response {
        conn.post_json("/v1/chat/completions", &[], &chat_body())
            .unwrap_or_else(|e| panic!("request on the kept-alive connection {local} failed: {e}"))
    };

    // Before: `random` sends a request without `routing-strategy` to the standard pod.
    for _ in 0..3 {
        let r = send(&mut conn);
        assert_eq!(r.status, 200, "{}", describe(&r));
        assert_eq!(r.header("target-pod"), Some("vllm-c-0"), "{}", describe(&r));
        assert_eq!(r.header("prefill-target-pod"), None, "{}", describe(&r));
    }
    let vms_before = stack.stat("pd_router_fleet_loaded_vms");

    stack.update_ecds(&[("ROUTING_ALGORITHM", "pd")]);
    let updated = Instant::now();
    let deadline = updated + Duration::from_secs(15);
    let mut seen = Vec::new();
    let switched_after = loop {
        let r = send(&mut conn);
        let elapsed = updated.elapsed();
        seen.push((elapsed, describe(&r)));
        if r.status == 200 && r.header("prefill-target-pod").is_some() {
            break elapsed;
        }
        assert!(
            Instant::now() < deadline,
            "the open connection never saw the ECDS update; answers since it:\n{seen:#?}"
        );
        // Pacing only: the loop ends on the observed effect, not after a fixed time.
        std::thread::sleep(Duration::from_millis(10));
    };

    // After: the same connection keeps getting PD pairs of the one roleset.
    for _ in 0..5 {
        let r = send(&mut conn);
        seen.push((updated.elapsed(), describe(&r)));
        assert_eq!(r.status, 200, "{}", describe(&r));
        assert_eq!(r.header("target-pod"), Some("vllm-d-0"), "{}", describe(&r));
        assert_eq!(
            r.header("prefill-target-pod"),
            Some("vllm-p-0"),
            "{}",
            describe(&r)
        );
    }
    assert_eq!(
        conn.local_addr().expect("local addr"),
        local,
        "one connection throughout"
    );
    // The replaced VMs leave the count as their plugin goes: every VM logs its first snapshot
    // once and its end once, and the gauge counts those between (Envoy makes a VM or two on
    // the main thread for a new configuration, so the count is not simply one per thread).
    pd_wasm_tests::stack::eventually(Duration::from_secs(10), || {
        let (loaded, done) = stack.vms_loaded_and_ended();
        let vms = stack.stat("pd_router_fleet_loaded_vms");
        (done > 0 && vms == loaded - done)
            .then_some(())
            .ok_or(format!(
                "{vms} VMs count as loaded; {loaded} loaded, {done} gone ({vms_before} before)"
            ))
    });
    eprintln!(
        "ECDS switch seen after {switched_after:?} over {} requests on {local}; \
         pd_router_fleet_loaded_vms {vms_before} -> {}",
        seen.len(),
        stack.stat("pd_router_fleet_loaded_vms")
    );
    let failed: Vec<_> = seen
        .iter()
        .filter(|(_, d)| !d.starts_with("200 "))
        .collect();
    assert!(
        failed.is_empty(),
        "requests failed during the ECDS switch (of {}):\n{failed:#?}",
        seen.len()
    );
}

/// The ECDS drop-in stands in for a dead pod as the inline one does: its filter names a
/// sibling with each request, and a refused connection is retried there by its retrying
/// cluster, fed from pd-control's endpoint file.
#[test]
fn the_ecds_drop_in_retries_a_refused_connection_on_a_stand_in() {
    use base64::Engine as _;
    let fleet = Fleet::new(MODEL).combined("c-0").combined("c-1");
    let options = pd_wasm_tests::stack::Options {
        // Nothing tells the gateway c-0 died: the refusal itself must be handled.
        control_args: &["--unreachable-after", "0"],
        ..Default::default()
    };
    let stack = Stack::start_ecds_opts(fleet.clone(), &[], &options);
    stack.wait_snapshot_adopted(|snap| {
        (snap["eds"] == true)
            .then_some(())
            .ok_or_else(|| "the snapshot names no stand-ins".to_string())
    });
    // session-affinity with c-0's session id: c-0 is chosen for as long as it is in view.
    let session = base64::engine::general_purpose::STANDARD.encode(fleet.spec("c-0").address());
    let to_c0 = [
        ("routing-strategy", "session-affinity"),
        ("x-session-id", session.as_str()),
    ];
    let served_by = |pod: &str| {
        let r = pd_wasm_tests::http::post_json(
            &stack.gateway,
            "/v1/chat/completions",
            &to_c0,
            &chat_body(),
        );
        assert_eq!(r.status, 200, "{}", describe(&r));
        assert_eq!(r.header("target-pod"), Some(pod), "{}", describe(&r));
    };
    served_by("c-0");
    stack.arm_fault(json!({"pod": "c-0", "kind": "crash"}));
    served_by("c-1");
    assert_eq!(
        stack.metric("pd_router_stand_in_retries_total", &[("result", "served")]),
        1.0
    );
    stack.clear_faults();
}

/// A token rotation: pd-control restarts with a new snapshot token and ECDS gives the gateway
/// the new one. Streams still open on every worker keep the superseded configuration's root
/// contexts alive; those must leave snapshot polling to the new configuration, or a fleet
/// change would not reach the gateway until the last old stream ended (they poll with the old
/// token and get 401s).
#[test]
fn a_rotated_snapshot_token_is_polled_with_while_old_streams_live() {
    let fleet = Fleet::new(MODEL)
        .pod("p-0", "prefill", "g0")
        .pod("d-0", "decode", "g0")
        .pod("p-1", "prefill", "g1")
        .pod("d-1", "decode", "g1");
    let env = [("ROUTING_ALGORITHM", "pd")];
    let options = pd_wasm_tests::stack::Options {
        plugin_extra: r#""snapshot_token":"old-T0ken""#,
        ..Default::default()
    };
    let mut stack = Stack::start_ecds_opts(fleet.clone(), &env, &options);

    // Streams held open by both decode pods, on every worker, under the old configuration.
    for pod in ["d-0", "d-1"] {
        stack.arm_fault(
            json!({"pod": pod, "kind": "hang_after_chunks", "chunks": 1, "leg": "decode"}),
        );
    }
    let body = json!({"model": MODEL, "stream": true, "max_tokens": 20,
                      "messages": [{"role": "user", "content": "hold this stream open"}]})
    .to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: pd\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let streams = stack.connections_on_every_worker(&request, 2);
    stack.wait_for_legs("decode", streams.len());

    // The rotation: pd-control requires the new token, and ECDS hands it to the gateway.
    let token_file = stack.dir.join("snapshot-token");
    std::fs::write(&token_file, "new-T0ken\n").expect("token file");
    let token_arg = token_file.display().to_string();
    stack.restart_control(&["--snapshot-token-file", &token_arg]);
    stack.update_ecds_with(&env, r#""snapshot_token":"new-T0ken""#);

    // A fleet change reaches the gateway while the old streams still run.
    let version_before = stack.stat("pd_router_fleet_version");
    stack.write_fleet(fleet.without("p-1").without("d-1"));
    pd_wasm_tests::stack::eventually(Duration::from_secs(20), || {
        (stack.stat("pd_router_fleet_version") > version_before)
            .then_some(())
            .ok_or_else(|| {
                format!(
                    "the gateway never got the new fleet; log:\n{}",
                    stack.envoy_log()
                )
            })
    });
    assert!(
        streams.iter().all(|s| s.peer_addr().is_ok()),
        "the old streams were still open"
    );
    stack.clear_faults();
    drop(streams);
}

/// An ECDS update the filter refuses (here `fetch_timeout_ms` 0): Envoy tries the
/// new configuration on a canary VM first, which refuses it, so the update is rejected and
/// counted, and the configuration in force keeps serving every request; a good update after
/// it takes effect.
#[test]
fn a_refused_ecds_update_leaves_the_running_configuration_serving() {
    let fleet = Fleet::new(MODEL)
        .pod("vllm-p-0", "prefill", "group-0")
        .pod("vllm-d-0", "decode", "group-0")
        .combined("vllm-c-0");
    let stack = Stack::start_ecds(fleet, &[("ROUTING_ALGORITHM", "random")]);
    let fails = "extension_config_discovery.http_filter.pd_router.config_fail";
    let send = || {
        pd_wasm_tests::http::post_json(&stack.gateway, "/v1/chat/completions", &[], &chat_body())
    };
    assert_eq!(send().header("target-pod"), Some("vllm-c-0"));
    let before = stack.envoy_stat(fails).unwrap_or(0);

    stack.update_ecds_with(&[("ROUTING_ALGORITHM", "pd")], r#""fetch_timeout_ms":0"#);
    pd_wasm_tests::stack::eventually(Duration::from_secs(15), || {
        let now = stack.envoy_stat(fails).unwrap_or(0);
        (now > before)
            .then_some(())
            .ok_or_else(|| format!("{fails} {now}: the update was not refused yet"))
    });
    for _ in 0..6 {
        let r = send();
        assert_eq!(r.status, 200, "{}", describe(&r));
        assert_eq!(r.header("target-pod"), Some("vllm-c-0"), "{}", describe(&r));
        assert_eq!(r.header("prefill-target-pod"), None, "{}", describe(&r));
    }
    assert!(
        stack.envoy_log().contains("fetch_timeout_ms"),
        "the refusal names the field"
    );

    stack.update_ecds(&[("ROUTING_ALGORITHM", "pd")]);
    pd_wasm_tests::stack::eventually(Duration::from_secs(15), || {
        let r = send();
        (r.status == 200 && r.header("prefill-target-pod") == Some("vllm-p-0"))
            .then_some(())
            .ok_or_else(|| describe(&r))
    });
}
