//! Fault injection: what `POST /sim/faults` arms on a pod, so tests can make a leg hang, fail,
//! stall mid-stream or lose its listener on demand, and release it again on their own signal.
//!
//! Hangs wait for the fault to be cleared rather than for a timer: a test that wants "the
//! prefill legs are all in flight now" arms a hang, polls the request log until every leg
//! has arrived, asserts, then clears. Nothing in a test depends on how fast the machine is.

use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::vllm::Leg;

/// What a pod does to a request the fault matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FaultKind {
    /// Take the request (it is logged) and send nothing until the fault is cleared.
    HangBeforeHeaders,
    /// Send the response headers and `chunks` stream events, then stall until cleared. An
    /// unstreamed response stalls right after its headers.
    HangAfterChunks { chunks: u64 },
    /// Answer `status` with an OpenAI-style error body instead of serving the request, after
    /// `delay_ms` (default 0): a leg that fails once its partner has started answering.
    Status {
        status: u16,
        #[serde(default)]
        delay_ms: u64,
        /// Send the status and headers at once and hold the error body until the fault is
        /// cleared: an error answer whose body stalls.
        #[serde(default)]
        stall_body: bool,
        /// Send the status, the headers and the first half of the error body at once and
        /// hold the rest until the fault is cleared: an error answer the router has begun
        /// to read when something else happens.
        #[serde(default)]
        stall_half: bool,
        /// Answer the status with no body at all (`content-length: 0`), as a proxy in front
        /// of an engine may.
        #[serde(default)]
        empty_body: bool,
        /// Add a header whose value is not UTF-8 (`x-sim-raw: \xff\xfe`, obs-text, which
        /// HTTP allows and a proxy on the way may add).
        #[serde(default)]
        raw_header: bool,
        /// Send the status, the headers (`content-length` of the whole error body) and half
        /// of the body, then close the connection: an engine that died while it answered an
        /// error.
        #[serde(default)]
        cut_body: bool,
    },
    /// Serve the request normally after an extra `delay_ms`.
    Slow { delay_ms: u64 },
    /// Serve an unstreamed request whole (a prefill leg computes and hands its KV over), then
    /// hold the answer until the fault is cleared and answer `status` with an error body
    /// instead: a leg whose work was done but whose answer failed.
    FailAfterServing { status: u16 },
    /// Serve the request, but finish it with `finish_reason: "stop"` (an unstreamed answer):
    /// a model whose first token is its end, which a TRT-LLM context leg reports so.
    FinishFirst,
    /// Answer 200 with a JSON object of `bytes` bytes instead of serving the request: a
    /// broken or hostile engine's answer. With `not_json`, the 200's `bytes` bytes are plain
    /// text, not JSON at all.
    Oversized {
        bytes: u64,
        #[serde(default)]
        not_json: bool,
    },
    /// Stop listening and drop every open connection (a process that died); cleared, the pod
    /// listens again with empty load.
    Crash,
    /// Stop accepting connections while open ones carry on (a port that refuses).
    Refuse,
    /// Accept every connection and answer nothing, `/metrics` included, until cleared: an
    /// engine whose server loop is stuck (its port open, its process alive).
    Wedge,
}

impl FaultKind {
    /// The `kind` tag, as the request log records it.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::HangBeforeHeaders => "hang_before_headers",
            FaultKind::HangAfterChunks { .. } => "hang_after_chunks",
            FaultKind::Status { .. } => "status",
            FaultKind::Slow { .. } => "slow",
            FaultKind::FailAfterServing { .. } => "fail_after_serving",
            FaultKind::FinishFirst => "finish_first",
            FaultKind::Oversized { .. } => "oversized",
            FaultKind::Crash => "crash",
            FaultKind::Refuse => "refuse",
            FaultKind::Wedge => "wedge",
        }
    }

    /// Faults of the pod's listener rather than of one request; the simulator applies them.
    pub fn is_listener_fault(self) -> bool {
        matches!(self, FaultKind::Crash | FaultKind::Refuse)
    }
}

/// The body of an `oversized` fault's 200: `{"pad":"xx…"}` of `bytes` bytes (never shorter
/// than its 10 bytes of framing), or with `not_json` exactly `bytes` bytes of `x`.
pub fn oversized_body(bytes: u64, not_json: bool) -> Vec<u8> {
    let len = usize::try_from(bytes).unwrap_or(usize::MAX);
    if not_json {
        return vec![b'x'; len];
    }
    let pad = len.saturating_sub(10);
    let mut body = Vec::with_capacity(pad + 10);
    body.extend_from_slice(b"{\"pad\":\"");
    body.resize(body.len() + pad, b'x');
    body.extend_from_slice(b"\"}");
    body
}

/// One armed fault, as `POST /sim/faults` takes it and `GET /sim/faults` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultSpec {
    /// Pod name; required on the simulator-wide admin endpoint, ignored on a pod's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(flatten)]
    pub kind: FaultKind,
    /// Only requests of this leg (`prefill`, `decode`, `full`); every request when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leg: Option<String>,
    /// Apply to this many matching requests, then disarm; until cleared when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub times: Option<u64>,
}

/// Why a fault spec was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FaultError {
    #[error("unknown leg {0:?}: expected prefill, decode or full")]
    UnknownLeg(String),
    #[error("status {0} is not an error status (400-599)")]
    NotAnErrorStatus(u16),
    #[error("times must be at least 1")]
    ZeroTimes,
    #[error("no pod named {0:?}")]
    UnknownPod(String),
    #[error("the admin endpoint needs a \"pod\" field")]
    MissingPod,
    #[error("crash and refuse are faults of the listener: arm them on the admin endpoint")]
    ListenerFaultOnPod,
}

impl FaultSpec {
    pub fn validate(&self) -> Result<(), FaultError> {
        if let Some(leg) = &self.leg {
            parse_leg(leg)?;
        }
        if let FaultKind::Status { status, .. } = self.kind {
            if !(400..=599).contains(&status) {
                return Err(FaultError::NotAnErrorStatus(status));
            }
        }
        if self.times == Some(0) {
            return Err(FaultError::ZeroTimes);
        }
        Ok(())
    }

    fn matches(&self, leg: Leg) -> bool {
        match &self.leg {
            None => true,
            Some(want) => parse_leg(want).is_ok_and(|l| l == leg),
        }
    }
}

fn parse_leg(leg: &str) -> Result<Leg, FaultError> {
    match leg {
        "prefill" => Ok(Leg::Prefill),
        "decode" => Ok(Leg::Decode),
        "full" => Ok(Leg::Full),
        other => Err(FaultError::UnknownLeg(other.to_string())),
    }
}

/// A pod's armed request faults and the signal that releases its hangs.
#[derive(Debug)]
pub struct Faults {
    armed: Mutex<Vec<FaultSpec>>,
    /// Bumped on every clear; a hang waits for it to move past the value it saw.
    cleared: watch::Sender<u64>,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            armed: Mutex::new(Vec::new()),
            cleared: watch::channel(0).0,
        }
    }
}

/// The fault a request drew, with what it needs to wait for its release.
#[derive(Debug)]
pub struct Drawn {
    pub kind: FaultKind,
    release: watch::Receiver<u64>,
}

impl Drawn {
    /// Resolves when the pod's faults are cleared (never, if they never are).
    pub async fn released(mut self) {
        // An error means the pod is gone; its connections are being dropped anyway.
        if self.release.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// The extra delay of a `slow` fault.
    pub fn delay(&self) -> Option<Duration> {
        match self.kind {
            FaultKind::Slow { delay_ms } => Some(Duration::from_millis(delay_ms)),
            _ => None,
        }
    }
}

impl Faults {
    pub fn arm(&self, spec: FaultSpec) -> Result<(), FaultError> {
        spec.validate()?;
        self.lock().push(spec);
        Ok(())
    }

    /// Disarms every fault and releases every request hanging on one.
    pub fn clear(&self) {
        self.lock().clear();
        self.cleared.send_modify(|g| *g += 1);
    }

    pub fn list(&self) -> Vec<FaultSpec> {
        self.lock().clone()
    }

    /// The first armed fault matching `leg`, counted against its `times`.
    pub fn draw(&self, leg: Leg) -> Option<Drawn> {
        let mut armed = self.lock();
        let i = armed.iter().position(|f| f.matches(leg))?;
        let kind = armed[i].kind;
        if let Some(times) = &mut armed[i].times {
            *times -= 1;
            if *times == 0 {
                armed.remove(i);
            }
        }
        // Subscribed under the lock: a clear after this point always wakes the request.
        Some(Drawn {
            kind,
            release: self.cleared.subscribe(),
        })
    }

    /// A `wedge` fault's hold on a request that is not a leg (`/metrics`), when one is
    /// armed: wait on it. It is not counted against `times`.
    pub fn wedged(&self) -> Option<Drawn> {
        let armed = self.lock();
        armed
            .iter()
            .any(|f| f.kind == FaultKind::Wedge)
            .then(|| Drawn {
                kind: FaultKind::Wedge,
                release: self.cleared.subscribe(),
            })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<FaultSpec>> {
        self.armed.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: &str) -> FaultSpec {
        serde_json::from_str(json).expect("spec parses")
    }

    #[test]
    fn specs_parse_from_their_json_shape() {
        let s = spec(r#"{"pod":"p0","kind":"hang_after_chunks","chunks":3,"leg":"decode"}"#);
        assert_eq!(s.kind, FaultKind::HangAfterChunks { chunks: 3 });
        assert_eq!(s.pod.as_deref(), Some("p0"));
        assert_eq!(
            spec(r#"{"kind":"status","status":503}"#).kind,
            FaultKind::Status {
                status: 503,
                delay_ms: 0,
                stall_body: false,
                stall_half: false,
                empty_body: false,
                raw_header: false,
                cut_body: false
            }
        );
        assert!(matches!(
            spec(r#"{"kind":"status","status":500,"stall_body":true}"#).kind,
            FaultKind::Status {
                stall_body: true,
                ..
            }
        ));
        assert!(serde_json::from_str::<FaultSpec>(r#"{"kind":"explode"}"#).is_err());
    }

    #[test]
    fn an_oversized_answer_is_a_json_object_unless_not_json() {
        let s = spec(r#"{"pod":"p0","kind":"oversized","bytes":64,"not_json":true}"#);
        assert_eq!(
            s.kind,
            FaultKind::Oversized {
                bytes: 64,
                not_json: true
            }
        );
        assert_eq!(
            spec(r#"{"kind":"oversized","bytes":64}"#).kind,
            FaultKind::Oversized {
                bytes: 64,
                not_json: false
            },
            "JSON unless asked"
        );
        let listed = serde_json::to_value(&s).unwrap();
        assert_eq!(
            listed,
            serde_json::json!({"pod": "p0", "kind": "oversized", "bytes": 64, "not_json": true})
        );

        let body = oversized_body(64, false);
        assert_eq!(body.len(), 64);
        let object: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert!(object.is_object(), "{object}");
        let text = oversized_body(64, true);
        assert_eq!(text.len(), 64);
        assert!(serde_json::from_slice::<serde_json::Value>(&text).is_err());
        assert_eq!(
            oversized_body(3, false),
            br#"{"pad":""}"#,
            "at least the framing"
        );
        assert!(oversized_body(0, true).is_empty());
    }

    #[test]
    fn bad_specs_are_refused_with_the_reason() {
        let f = Faults::default();
        assert_eq!(
            f.arm(spec(r#"{"kind":"status","status":200}"#)),
            Err(FaultError::NotAnErrorStatus(200))
        );
        assert_eq!(
            f.arm(spec(r#"{"kind":"crash","leg":"middle"}"#)),
            Err(FaultError::UnknownLeg("middle".into()))
        );
        assert_eq!(
            f.arm(spec(r#"{"kind":"crash","times":0}"#)),
            Err(FaultError::ZeroTimes)
        );
        assert!(f.list().is_empty());
    }

    #[test]
    fn faults_match_their_leg_and_count_down() {
        let f = Faults::default();
        f.arm(spec(
            r#"{"kind":"status","status":500,"leg":"prefill","times":2}"#,
        ))
        .unwrap();
        assert!(f.draw(Leg::Decode).is_none());
        assert!(f.draw(Leg::Prefill).is_some());
        assert!(f.draw(Leg::Prefill).is_some());
        assert!(f.draw(Leg::Prefill).is_none(), "disarmed after two");
        assert!(f.list().is_empty());
    }

    #[tokio::test]
    async fn a_hang_is_released_by_clear_even_when_cleared_before_it_waits() {
        let f = Faults::default();
        f.arm(spec(r#"{"kind":"hang_before_headers"}"#)).unwrap();
        let first = f.draw(Leg::Full).expect("drawn");
        let second = f.draw(Leg::Full).expect("unlimited");
        f.clear();
        // Both waited on nothing yet; the clear still releases both.
        first.released().await;
        second.released().await;
        assert!(f.draw(Leg::Full).is_none());
    }

    #[tokio::test]
    async fn a_wedge_holds_every_metrics_read_until_cleared() {
        let f = Faults::default();
        assert!(f.wedged().is_none());
        f.arm(spec(r#"{"kind":"wedge","times":1}"#)).unwrap();
        let metrics = f.wedged().expect("wedged");
        assert!(
            f.wedged().is_some(),
            "a metrics read does not count against times"
        );
        assert_eq!(f.draw(Leg::Full).map(|d| d.kind), Some(FaultKind::Wedge));
        f.clear();
        metrics.released().await;
        assert!(f.wedged().is_none());
    }
}
