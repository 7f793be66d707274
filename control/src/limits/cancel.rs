//! Withdrawing an admission the gateway gave up on (its body, `{"id", ...}`, on
//! `POST /v1/limits/cancel`), or that pd-control gave up on itself (its counter script got no
//! reply in time, and Redis may still run it).
//!
//! The filter waits `rate_limits_timeout_ms` for an admission; pd-control's own worst case
//! (a record read retried, the counter script, a reconnect) is longer. When the filter gives
//! up and refuses the request, pd-control may still count it, or have counted it with the
//! answer on its way back: the user would lose a request of the window (and the model one of
//! its rate) for a request that never ran.
//!
//! So each admission carries an id of the filter's, and a filter that refuses a request
//! without pd-control's answer withdraws that id (as pd-control does when its own call to
//! Redis timed out: it answered `store_error`, so the gateway refused or let the request
//! through unchecked, and a count landing later would be one nobody asked for). Both calls end in one Redis script each,
//! on one marker key per id, and Redis runs scripts one at a time, so every interleaving
//! ends with nothing counted:
//! - withdrawal first: it leaves the marker `c`; the admission's script, however late it
//!   runs (behind a slow Redis, on another pd-control replica, after a restart), finds the
//!   marker and counts nothing (answer `cancelled`);
//! - admission first: its script writes to the marker what it left counted (each counter
//!   and the end of its window, on Redis's clock); the withdrawal gives exactly that back,
//!   only to the window that counted it, and leaves `c`, so a withdrawal repeated (the
//!   filter's call timing out again, pd-control retrying Redis) gives nothing twice.
//!
//! A deadline sent with the admission (pd-control undoing a count that finishes late) would
//! need no second call, but cannot be right in every interleaving: pd-control's clock starts
//! when the call arrives, not when the filter's did, and an answer sent in time by its clock
//! can still arrive after the filter's; nor can it undo a script Redis ran after pd-control
//! stopped waiting for it. An id remembered only in pd-control's memory would miss a
//! withdrawal reaching another replica or a restarted process. The marker in Redis has
//! neither gap; it costs one key per admission with an id, for [`MARKER_MS`].

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use super::{model_rps_key, rpm_key, AdmitError, AdmitRequest, Answer, Stage, Store, UserLimits};
use crate::redis_link::Retry;

/// Longest admission id: the filter sends 32 hex digits.
pub const MAX_ID_BYTES: usize = 64;

/// How long a marker stays: longer than any withdrawal can take to arrive (the filter sends it
/// at once, pd-control retries Redis for up to [`RETRY_FOR`]) and than a Redis stall can hold
/// an admission's script, and the length of a user's request window, past which its count no
/// longer matters. One key (≈ 100 bytes) per admission with an id: 6 MB at 1000 limited
/// requests a second.
pub const MARKER_MS: u64 = 60_000;

/// A counter's window is the one an admission counted in when its end (on Redis's clock) is
/// within this of the end recorded then. A window never moves once set, and the next one
/// ends at least a window length (1 s or more) later, so any tolerance below that tells them
/// apart; this one absorbs the clock reads of two scripts.
pub const CANCEL_TOLERANCE_MS: i64 = 500;

/// How long a withdrawal is retried against a failing Redis: well within [`MARKER_MS`], so
/// the marker it writes (or finds) is still there when it lands.
const RETRY_FOR: Duration = Duration::from_secs(20);
/// The first pause between tries; doubled each time, up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(250);
const MAX_PAUSE: Duration = Duration::from_secs(4);

/// The marker key of admission `id`.
pub fn admission_key(id: &str) -> String {
    format!("pd-router:admission:{id}")
}

/// An admission id: 1 to [`MAX_ID_BYTES`] of `[0-9A-Za-z-]` (a Redis key part, and logged).
pub(super) fn check_id(id: &str) -> Result<(), AdmitError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    ok.then_some(()).ok_or(AdmitError::Id)
}

/// Withdraws one admission. KEYS: its marker; then the user's request counter, if a user was
/// asked; then the model's counter, if a model was. ARGV: marker ms, user asked ("1"/"0"),
/// model asked, tolerance ms. Returns `{request given back, model request given back}`
/// (1/0). A counter is given back only if the marker says its admission counted it, its
/// window is still the one that did (same end, within the tolerance), and it is above 0.
pub(super) const CANCEL_SCRIPT: &str = r"
if redis.replicate_commands then
  redis.replicate_commands()
end
local marker = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], 'c', 'PX', ARGV[1])
if not marker or marker == 'c' then
  return {0, 0}
end
local rpm_ends, model_ends = string.match(marker, '^(%d+),(%d+)$')
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local tolerance = tonumber(ARGV[4])
local function give_back(key, ends)
  ends = tonumber(ends)
  if not key or not ends or ends == 0 then
    return 0
  end
  local pttl = redis.call('PTTL', key)
  local value = redis.pcall('GET', key)
  if type(value) ~= 'string' or not string.match(value, '^%d+$') then
    return 0
  end
  if pttl > 0 and math.abs(now + pttl - ends) <= tolerance and tonumber(value) > 0 then
    redis.call('DECRBY', key, 1)
    return 1
  end
  return 0
end
local i, rpm_key, model_key = 2, nil, nil
if ARGV[2] == '1' then
  rpm_key = KEYS[i]
  i = i + 1
end
if ARGV[3] == '1' then
  model_key = KEYS[i]
end
return {give_back(rpm_key, rpm_ends), give_back(model_key, model_ends)}
";

impl UserLimits {
    /// Withdraws admission `request.id` (see the module), retrying a failing Redis for up to
    /// [`RETRY_FOR`]: the withdrawal is idempotent, and the gateway that sent it has refused
    /// its request already, so only Redis taking it matters. Run it to the end (the handler
    /// spawns it), or a count may stay behind.
    pub(super) async fn cancel(&self, store: &Store, request: &AdmitRequest) -> Answer {
        let Some(id) = request.id.as_deref() else {
            // `parse_admit` refuses a cancel without an id.
            return Answer::Cancelled { given_back: 0 };
        };
        let mut keys = vec![super::admission_key(id)];
        if let Some(user) = &request.user {
            keys.push(rpm_key(user));
        }
        if let Some(rps) = &request.model {
            keys.push(model_rps_key(&rps.model, rps.window_ms));
        }
        let args = [
            super::MARKER_MS as i64,
            i64::from(request.user.is_some()),
            i64::from(request.model.is_some()),
            CANCEL_TOLERANCE_MS,
        ];
        let stage = if request.user.is_some() {
            Stage::Rpm
        } else {
            Stage::Model
        };
        let Some(_slot) = InFlight::take(&self.cancels) else {
            // Redis has been failing for a while and withdrawals pile up: each one left is
            // a count that stays, which `failed` shows.
            self.cancels.failed.fetch_add(1, Relaxed);
            return Answer::StoreError {
                stage,
                message: format!("{MAX_IN_FLIGHT} withdrawals wait for Redis already"),
            };
        };
        let started = tokio::time::Instant::now();
        let mut pause = FIRST_PAUSE;
        loop {
            let answer = store
                .link
                .call(Retry::OnceOnStaleConnection, |mut conn| {
                    let mut invocation = store.cancel.prepare_invoke();
                    for key in &keys {
                        invocation.key(key);
                    }
                    for arg in args {
                        invocation.arg(arg);
                    }
                    async move { invocation.invoke_async::<Vec<i64>>(&mut conn).await }
                })
                .await;
            match answer {
                Ok(flags) => {
                    self.redis_ok();
                    let given_back = flags.iter().filter(|f| **f == 1).count() as u64;
                    self.cancels.add(given_back);
                    if given_back > 0 {
                        tracing::debug!(id, given_back, "admission withdrawn after it counted");
                    }
                    return Answer::Cancelled { given_back };
                }
                Err(e) if started.elapsed() + pause > RETRY_FOR => {
                    self.cancels.failed.fetch_add(1, Relaxed);
                    self.errors_total.fetch_add(1, Relaxed);
                    // Logged when Redis turns failing, and then at most once a minute
                    // (`pd_control_admission_cancels_total{result="failed"}` counts each).
                    self.redis_failed(&e);
                    if self.cancels.time_to_warn() {
                        tracing::warn!(error = %e, "user limits: an admission could not be withdrawn; what it counted stays counted (logged at most once a minute)");
                    }
                    return Answer::StoreError {
                        stage,
                        message: format!("the withdrawal did not run: {e}"),
                    };
                }
                Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_PAUSE);
                }
            }
        }
    }
}

/// The most withdrawals waiting on Redis at once: each retries for up to [`RETRY_FOR`], so
/// a Redis down for long would otherwise gather a task per refused request.
pub const MAX_IN_FLIGHT: usize = 4096;

/// `pd_control_admission_cancels_total{result}`, and the withdrawals in flight.
#[derive(Debug, Default)]
pub(super) struct CancelCounts {
    given_back: AtomicU64,
    nothing_counted: AtomicU64,
    failed: AtomicU64,
    in_flight: AtomicUsize,
    /// When a failed withdrawal was last logged (Unix ms).
    warned_ms: AtomicI64,
}

/// A withdrawal's place among the [`MAX_IN_FLIGHT`]; given back when dropped.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn take(counts: &'a CancelCounts) -> Option<InFlight<'a>> {
        let n = &counts.in_flight;
        n.fetch_update(Relaxed, Relaxed, |v| (v < MAX_IN_FLIGHT).then_some(v + 1))
            .ok()
            .map(|_| InFlight(n))
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl CancelCounts {
    /// Whether a failed withdrawal is logged: once a minute at most, as a Redis down for long
    /// fails every one.
    fn time_to_warn(&self) -> bool {
        let now = crate::unix_ms_now();
        let last = self.warned_ms.load(Relaxed);
        now.saturating_sub(last) >= 60_000
            && self
                .warned_ms
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
    }

    fn add(&self, given_back: u64) {
        if given_back > 0 {
            self.given_back.fetch_add(1, Relaxed);
        } else {
            self.nothing_counted.fetch_add(1, Relaxed);
        }
    }

    /// The family's samples, `(labels, value)`.
    pub(super) fn samples(&self) -> Vec<(String, String)> {
        super::result_samples(&[
            ("given_back", &self.given_back),
            ("nothing_counted", &self.nothing_counted),
            ("failed", &self.failed),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_ids_are_key_safe() {
        assert_eq!(check_id("0123abcdef-XYZ"), Ok(()));
        assert_eq!(check_id(&"a".repeat(MAX_ID_BYTES)), Ok(()));
        for bad in [
            "",
            "a b",
            "a:b",
            "a\r\nb",
            "ü",
            &"a".repeat(MAX_ID_BYTES + 1),
        ] {
            assert_eq!(check_id(bad), Err(AdmitError::Id), "{bad:?}");
        }
    }
}
