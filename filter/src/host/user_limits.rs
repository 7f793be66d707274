//! Calls to pd-control for rate limits (see `crate::core::user_limits`): a request's
//! admission, sent from its HTTP context, and a VM's token report and release of requests
//! it could not route, sent from its tick.

use std::time::Duration;

use proxy_wasm::hostcalls;

use crate::core::config::PluginConfig;
use crate::core::user_limits::{
    ADMIT_PATH, CANCEL_PATH, RELEASE_PATH, REPORT_ID_HEADER, USAGE_PATH,
};

/// Asks pd-control to admit a request (`user_limits::admission_body`); returns the call's
/// token.
pub fn send_admission(plugin: &PluginConfig, body: &[u8]) -> Result<u32, String> {
    post(
        plugin,
        ADMIT_PATH,
        None,
        body,
        Duration::from_millis(plugin.rate_limits_timeout_ms),
    )
}

/// Withdraws an admission (`user_limits::cancel_body`) the gateway refused its request
/// without; the answer is read by no one.
pub fn send_withdrawal(plugin: &PluginConfig, body: &[u8]) -> Result<u32, String> {
    post(
        plugin,
        CANCEL_PATH,
        None,
        body,
        Duration::from_millis(plugin.rate_limits_timeout_ms),
    )
}

/// Sends a token report (`UsageBook::take`) under its id; returns the call's token.
pub fn send_usage(plugin: &PluginConfig, id: &str, body: &[u8]) -> Result<u32, String> {
    post(
        plugin,
        USAGE_PATH,
        Some(id),
        body,
        Duration::from_millis(plugin.fetch_timeout_ms),
    )
}

/// Gives requests back to their model's rate (`RefundBook::take`); returns the call's token.
pub fn send_release(plugin: &PluginConfig, body: &[u8]) -> Result<u32, String> {
    post(
        plugin,
        RELEASE_PATH,
        None,
        body,
        Duration::from_millis(plugin.fetch_timeout_ms),
    )
}

/// POSTs a JSON `body` to pd-control's `path`; `report_id` names a token report. Returns
/// the call's token.
pub fn post(
    plugin: &PluginConfig,
    path: &str,
    report_id: Option<&str>,
    body: &[u8],
    timeout: Duration,
) -> Result<u32, String> {
    let authorization = crate::host::snapshot::bearer(&plugin.snapshot_token);
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", plugin.control_authority.as_str()),
        ("content-type", "application/json"),
    ];
    if let Some(id) = report_id {
        headers.push((REPORT_ID_HEADER, id));
    }
    if let Some(value) = authorization.as_deref() {
        headers.push(("authorization", value));
    }
    hostcalls::dispatch_http_call(
        &plugin.control_cluster,
        headers,
        Some(body),
        vec![],
        timeout,
    )
    .map_err(|e| format!("{e:?}"))
}
