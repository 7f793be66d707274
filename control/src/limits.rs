//! Per-user request and token limits, compatible with AIBrix's.
//!
//! A request that names a user (AIBrix's `user` header) is checked against that user's record
//! in Redis: at most `rpm` requests and `tpm` tokens per fixed one-minute window. Stock Envoy
//! wasm cannot talk to Redis, so the filter asks pd-control (`POST /v1/limits/admit`) and
//! reports the tokens each answer used (`POST /v1/limits/usage`).
//!
//! The same admission also enforces a model's request rate (a config profile's
//! `requestsPerSecond`, sent by the filter as `rps_limit` requests per `rps_window_ms`) on
//! AIBrix's model counter: increment, and take the increment back when it went over the
//! limit, so that refusals do not use up the window.
//!
//! The record and counter keys, the defaults and the order of the checks are AIBrix's own, so
//! that an AIBrix gateway and pd-router sharing one Redis during a migration count against the
//! same limits. Unlike AIBrix, the counter part of a check is one Lua script, so two gateways
//! admitting the same user at once cannot both take the last request of a window.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::redis_link::{Fault, LinkError, RedisLink, Retry};
use crate::report_ids::{Claim, ReportIds, REMEMBER};

mod cancel;
mod refund;
pub use cancel::{admission_key, CANCEL_TOLERANCE_MS, MARKER_MS, MAX_ID_BYTES};
pub use refund::{parse_release, Refund, ReleaseError, Released, MAX_REFUNDS};

/// Prefix of the user records: `aibrix-users/{name}`, a JSON string value.
pub const USER_KEY_PREFIX: &str = "aibrix-users/";
/// The counting window. AIBrix writes it into the counter keys, so it is part of their names.
pub const WINDOW_MS: u64 = 60_000;
/// Longest user name accepted; a name is a Redis key part and a log field.
pub const MAX_NAME_BYTES: usize = 256;
/// AIBrix's request limit for a record without one (or with 0).
pub const DEFAULT_RPM: i64 = 100;
/// AIBrix's token limit for a record without one: this many tokens per allowed request.
pub const TOKENS_PER_REQUEST: i64 = 1000;
/// Users one usage report may name: the filter sends at most its `MAX_PENDING_USERS`
/// (4096) per report, and a bigger one would only make one request's parsing and Redis work
/// (and the report ids' memory) grow with the sender's whim.
pub const MAX_USAGE_USERS: usize = 4096;
/// Users whose token counters one script call adds to: bounds the work of one Redis call.
const USAGE_BATCH: usize = 128;
/// Longest model name accepted, as for user names.
pub const MAX_MODEL_BYTES: usize = 256;
/// The shortest and longest model rate windows accepted (one second to one hour).
pub const RPS_WINDOWS_MS: std::ops::RangeInclusive<u64> = 1000..=3_600_000;

/// The Redis key of `name`'s record.
pub fn user_key(name: &str) -> String {
    format!("{USER_KEY_PREFIX}{name}")
}

/// The key of `name`'s request counter in the current window.
pub fn rpm_key(name: &str) -> String {
    format!("aibrix:{name}_RPM_CURRENT:{WINDOW_MS}:counter")
}

/// The key of `name`'s token counter in the current window.
pub fn tpm_key(name: &str) -> String {
    format!("aibrix:{name}_TPM_CURRENT:{WINDOW_MS}:counter")
}

/// The key of `model`'s request counter for a `window_ms` window (AIBrix's model RPS key).
pub fn model_rps_key(model: &str, window_ms: u64) -> String {
    format!("aibrix_model:{model}_MODEL_RPS_CURRENT:{window_ms}:counter")
}

/// Checks a user name as the filter sends it.
pub fn user_name(raw: &[u8]) -> Result<&str, NameError> {
    if raw.is_empty() {
        return Err(NameError::Empty);
    }
    if raw.len() > MAX_NAME_BYTES {
        return Err(NameError::TooLong(raw.len()));
    }
    std::str::from_utf8(raw).map_err(|_| NameError::NotUtf8)
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NameError {
    #[error("empty user name")]
    Empty,
    #[error("user name of {0} bytes (at most {MAX_NAME_BYTES})")]
    TooLong(usize),
    #[error("user name is not UTF-8")]
    NotUtf8,
}

/// A model's request rate: at most `limit` requests per `window_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRps {
    pub model: String,
    pub limit: i64,
    pub window_ms: u64,
}

/// What one `POST /v1/limits/admit` asks to check: a user's limits, a model's rate, or both
/// (at least one). With an `id`, the admission can be withdrawn: the same body on `POST
/// /v1/limits/cancel` (`cancel` set, see `limits::cancel`) names the same user and model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmitRequest {
    pub user: Option<String>,
    pub model: Option<ModelRps>,
    pub id: Option<String>,
    pub cancel: bool,
}

/// An admission body the contract does not allow.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdmitError {
    #[error("want a JSON object with \"user\" and/or \"model\": {0}")]
    Body(String),
    #[error("neither \"user\" nor \"model\" given")]
    Nothing,
    #[error("{0}")]
    User(#[from] NameError),
    #[error("model name of {0} bytes (want 1 to {MAX_MODEL_BYTES})")]
    ModelName(usize),
    #[error("\"model\" wants both \"rps_limit\" and \"rps_window_ms\"")]
    RpsMissing,
    #[error("\"rps_limit\" and \"rps_window_ms\" need a \"model\"")]
    RpsWithoutModel,
    #[error("rps_limit {0} (want at least 1)")]
    RpsLimit(i64),
    #[error("rps_window_ms {0} (want 1000 to 3600000)")]
    RpsWindow(u64),
    #[error("\"id\" must be 1 to {MAX_ID_BYTES} of [0-9A-Za-z-]")]
    Id,
    #[error("a withdrawal needs the admission's \"id\"")]
    CancelWithoutId,
}

/// The members of an admission body that count here; others are ignored.
#[derive(Deserialize)]
struct AdmitBody {
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    rps_limit: Option<i64>,
    #[serde(default)]
    rps_window_ms: Option<u64>,
    #[serde(default)]
    id: Option<String>,
}

/// Parses an admission body: `{"user": name}`, `{"model": name, "rps_limit": n,
/// "rps_window_ms": ms}`, or both in one object. A member that is `null` counts as absent.
pub fn parse_admit(body: &[u8]) -> Result<AdmitRequest, AdmitError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| AdmitError::Body(e.to_string()))?;
    // serde would also read a struct from an array; the body is an object.
    if !value.is_object() {
        return Err(AdmitError::Body("not an object".into()));
    }
    let body = AdmitBody::deserialize(value).map_err(|e| AdmitError::Body(e.to_string()))?;
    if let Some(user) = &body.user {
        user_name(user.as_bytes())?;
    }
    let model = match (body.model, body.rps_limit, body.rps_window_ms) {
        (None, None, None) => None,
        (None, _, _) => return Err(AdmitError::RpsWithoutModel),
        (Some(_), None, _) | (Some(_), _, None) => return Err(AdmitError::RpsMissing),
        (Some(model), Some(limit), Some(window_ms)) => {
            if model.is_empty() || model.len() > MAX_MODEL_BYTES {
                return Err(AdmitError::ModelName(model.len()));
            }
            if limit < 1 {
                return Err(AdmitError::RpsLimit(limit));
            }
            if !RPS_WINDOWS_MS.contains(&window_ms) {
                return Err(AdmitError::RpsWindow(window_ms));
            }
            Some(ModelRps {
                model,
                limit,
                window_ms,
            })
        }
    };
    if body.user.is_none() && model.is_none() {
        return Err(AdmitError::Nothing);
    }
    if let Some(id) = &body.id {
        cancel::check_id(id)?;
    }
    Ok(AdmitRequest {
        user: body.user,
        model,
        id: body.id,
        cancel: false,
    })
}

/// Parses a withdrawal (`POST /v1/limits/cancel`): an admission's body, its `id` required.
/// A path of its own, not a member of the admission's body: a pd-control older than the
/// gateway ignores members it does not know, and would count a withdrawal sent to the
/// admission's path as one more admission; it answers an unknown path 404 and counts nothing.
pub fn parse_cancel(body: &[u8]) -> Result<AdmitRequest, AdmitError> {
    let mut request = parse_admit(body)?;
    if request.id.is_none() {
        return Err(AdmitError::CancelWithoutId);
    }
    request.cancel = true;
    Ok(request)
}

/// A user's limits per window, defaults applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub rpm: i64,
    pub tpm: i64,
}

/// Why a stored user record cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("not a JSON user record: {0}")]
    Json(String),
}

/// The fields of AIBrix's user record that count here; others (`name`) are ignored.
#[derive(Deserialize)]
struct Record {
    #[serde(default)]
    rpm: Option<i64>,
    #[serde(default)]
    tpm: Option<i64>,
}

/// Parses a user record and applies AIBrix's defaults: no (or a zero) request limit means
/// [`DEFAULT_RPM`], no token limit [`TOKENS_PER_REQUEST`] per allowed request. A negative
/// limit is a broken record rather than "no requests": refusing everyone it names silently
/// would be worse than saying the store is wrong.
pub fn parse_record(raw: &[u8]) -> Result<Limits, RecordError> {
    let value: serde_json::Value =
        serde_json::from_slice(raw).map_err(|e| RecordError::Json(e.to_string()))?;
    // serde would also read a struct from an array (`[10, 5000]`); a record is an object.
    if !value.is_object() {
        return Err(RecordError::Json("not an object".into()));
    }
    let record = Record::deserialize(value).map_err(|e| RecordError::Json(e.to_string()))?;
    let (rpm, tpm) = (record.rpm.unwrap_or(0), record.tpm.unwrap_or(0));
    // A negative limit is kept: every count is at or above it, so the user is refused (429),
    // as AIBrix's `count >= limit` refuses them. Read as an error it gave 500, and with
    // `rate_limits_fail_open` admitted the user without any limit.
    let rpm = if rpm == 0 { DEFAULT_RPM } else { rpm };
    let tpm = if tpm == 0 {
        rpm.saturating_mul(TOKENS_PER_REQUEST)
    } else {
        tpm
    };
    Ok(Limits { rpm, tpm })
}

/// The limits of a user without a record: AIBrix's defaults, as with
/// `AIBRIX_DISABLE_REDIS_USER_STORE`.
pub const UNRECORDED: Limits = Limits {
    rpm: DEFAULT_RPM,
    tpm: DEFAULT_RPM * TOKENS_PER_REQUEST,
};

/// Which Redis step a `store_error` answer failed at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Reading the user record, or the record is unusable (AIBrix's `x-error-user`).
    User,
    /// Reading the user's request counter: it is not an integer, or the counter script of a
    /// check naming a user did not run (nothing counted). AIBrix reads that counter first
    /// after the record and answers its failure 500 `x-error-rpm-exceeded`, so a Redis that
    /// fails after the record read gets that header from both gateways.
    Rpm,
    /// Incrementing the user's request counter (nothing counted): AIBrix's
    /// `x-error-incr-rpm`.
    IncrRpm,
    /// Reading the user's token counter: it is not an integer. The request stays counted,
    /// as AIBrix's `checkTPM` runs after `incrRPM`; AIBrix answers 500
    /// `x-error-tpm-exceeded`.
    Tpm,
    /// The counter script before stages were told apart (pd-control older than the filter);
    /// never sent now, read by gateways as `x-error-incr-rpm`.
    Counters,
    /// The model's counter cannot be incremented (the user's request, if any, stays
    /// counted), or the counter script of a model-only check failed.
    Model,
}

/// The answer of `POST /v1/limits/admit`, as JSON: `{"outcome": ..., fields}`. Counters are
/// the values after this check; limits are the user's (defaults applied) and the model's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Answer {
    /// Counted against the windows (`rpm` and `model_rps` include this request). The fields
    /// of a part not asked for are `null`.
    Admitted {
        rpm: Option<i64>,
        rpm_limit: Option<i64>,
        tpm: Option<i64>,
        tpm_limit: Option<i64>,
        model_rps: Option<i64>,
        rps_limit: Option<i64>,
    },
    /// The window's requests are used up; nothing was counted.
    RpmExceeded { rpm: i64, rpm_limit: i64 },
    /// The window's tokens are used up. The request was counted (`rpm`), as AIBrix does.
    TpmExceeded {
        rpm: i64,
        rpm_limit: i64,
        tpm: i64,
        tpm_limit: i64,
    },
    /// The model's window is used up; its counter was given this request back (`model_rps`
    /// is what the window admitted). The user's request, if one was named, stays counted.
    ModelRpsExceeded { model_rps: i64, rps_limit: i64 },
    /// No record for the user.
    UnknownUser,
    /// Redis failed or holds an unusable record; the gateway decides whether to let it pass.
    StoreError { stage: Stage, message: String },
    /// This pd-control does not check user limits.
    Disabled,
    /// The admission `id` was withdrawn (`limits::cancel`): an admit finding its withdrawal
    /// counts nothing (`given_back` 0); a withdrawal gives back what its admission counted
    /// (`given_back` counters: the user's request, the model's).
    Cancelled { given_back: u64 },
}

impl Answer {
    /// Index into the per-outcome counters; `None` for answers that are no check.
    fn counted(&self) -> Option<usize> {
        match self {
            Answer::Admitted { .. } => Some(0),
            Answer::RpmExceeded { .. } => Some(1),
            Answer::TpmExceeded { .. } => Some(2),
            Answer::UnknownUser => Some(3),
            Answer::StoreError { .. } => Some(4),
            Answer::ModelRpsExceeded { .. } => Some(5),
            Answer::Cancelled { .. } => Some(6),
            Answer::Disabled => None,
        }
    }
}

/// Metric label of each counted outcome, in [`Answer::counted`] order.
const OUTCOMES: [&str; 7] = [
    "admitted",
    "rpm_exceeded",
    "tpm_exceeded",
    "unknown_user",
    "store_error",
    "model_rps_exceeded",
    "cancelled",
];

/// The Lua helper the counter scripts test a `redis.pcall('INCRBY', ...)` reply with (a macro,
/// so that `concat!` can put it in front of them): true when the counter itself refused (not
/// an integer, another type), which fails that counter alone. A server that takes no writes
/// (`READONLY`: a primary demoted by a failover, its clients still connected; `MASTERDOWN`;
/// `TRYAGAIN`) fails the whole script with its own error code, so that the link drops the
/// connection and reconnects to the new primary (see `redis_link::Fault::WrongServer`):
/// swallowed here, it would fail every model check until pd-control restarted.
macro_rules! counter_failed_lua {
    () => {
        r"
local function counter_failed(reply)
  if type(reply) ~= 'table' or not reply.err then
    return false
  end
  local code = string.match(reply.err, '^%S+')
  if code == 'READONLY' or code == 'MASTERDOWN' or code == 'TRYAGAIN' then
    error(reply)
  end
  return true
end
"
    };
}

/// The counter half of a check, atomic so that concurrent checks of one user or model (from
/// several gateways or pd-controls) never both take the last request of a window.
/// KEYS: with a user, its request and token counters; then, with a model, its counter; then,
/// with an admission id, its marker (`limits::cancel`).
/// ARGV: user asked ("1"/"0"), request limit, token limit, user window ms, model asked,
/// model limit, model window ms (the limits of a part not asked are ignored), marker asked,
/// marker ms.
/// Returns `{verdict, requests, tokens, model requests}` (0 for a part not asked):
/// 0 refused on requests (nothing counted), 1 admitted, 2 refused on tokens (the request
/// counted), 3 refused on the model's rate (its increment taken back; the user's request
/// counted), 4 the model counter cannot be incremented (not an integer; the user's request
/// counted), 5 the request counter cannot be read (not an integer, another type; nothing
/// counted), 6 it cannot be incremented (nothing counted), 7 the token counter cannot be read
/// (the request counted), 8 the admission was withdrawn before it ran (nothing counted).
/// 5 to 7 are AIBrix's three steps (`checkRPM`, `incrRPM`, `checkTPM`), each with its own
/// error header. The user part goes first; when it refuses, the model counter is not touched.
/// A counter's window starts with its first write (the expiry is set only while it has none),
/// so later writes never stretch it. A counter read without an expiry (left by a writer that
/// died between its increment and its expiry) gets one, or it would refuse for ever.
/// With a marker, what the call leaves counted is written to it (each counter's window end,
/// on Redis's clock) so that a withdrawal arriving later gives exactly that back.
const ADMIT_SCRIPT: &str = concat!(
    counter_failed_lua!(),
    r"
if redis.replicate_commands then
  redis.replicate_commands()
end
local function current(key, window)
  local value = redis.pcall('GET', key)
  if type(value) == 'table' then
    return nil
  end
  if not value then
    return 0
  end
  if not string.match(value, '^%-?%d+$') then
    return nil
  end
  if redis.call('PTTL', key) == -1 then
    redis.call('PEXPIRE', key, window)
  end
  return tonumber(value)
end
local function windowed(key, window)
  if redis.call('PTTL', key) == -1 then
    redis.call('PEXPIRE', key, window)
  end
end
local function ends_at(key)
  local now = redis.call('TIME')
  return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + redis.call('PTTL', key)
end
local marker = nil
if ARGV[8] == '1' then
  marker = KEYS[#KEYS]
  if redis.call('EXISTS', marker) == 1 then
    return {8, 0, 0, 0}
  end
end
local rpm_ends, model_ends = 0, 0
local function answer(code, rpm, tpm, rps)
  if marker and (rpm_ends ~= 0 or model_ends ~= 0) then
    redis.call('SET', marker, rpm_ends .. ',' .. model_ends, 'PX', ARGV[9])
  end
  return {code, rpm, tpm, rps}
end
local rpm, tpm, model = 0, 0, 1
if ARGV[1] == '1' then
  local rpm_limit, tpm_limit, window = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
  rpm = current(KEYS[1], window)
  if not rpm then
    return {5, 0, 0, 0}
  end
  if rpm >= rpm_limit then
    return {0, rpm, 0, 0}
  end
  rpm = redis.pcall('INCRBY', KEYS[1], 1)
  if counter_failed(rpm) then
    return {6, 0, 0, 0}
  end
  windowed(KEYS[1], window)
  rpm_ends = ends_at(KEYS[1])
  tpm = current(KEYS[2], window)
  if not tpm then
    return answer(7, rpm, 0, 0)
  end
  if tpm >= tpm_limit then
    return answer(2, rpm, tpm, 0)
  end
  model = 3
end
if ARGV[5] == '1' then
  local key, rps_limit, window = KEYS[model], tonumber(ARGV[6]), ARGV[7]
  local rps = redis.pcall('INCRBY', key, 1)
  if counter_failed(rps) then
    return answer(4, rpm, tpm, 0)
  end
  windowed(key, window)
  if rps > rps_limit then
    rps = redis.call('DECRBY', key, 1)
    return answer(3, rpm, tpm, rps)
  end
  model_ends = ends_at(key)
  return answer(1, rpm, tpm, rps)
end
return answer(1, rpm, tpm, 0)
"
);

/// Adds tokens to users' token counters, with the window rule of [`ADMIT_SCRIPT`].
/// KEYS: n token counters, then (for a report with an id) their n report markers. ARGV:
/// window ms, how long a marker is kept (ms, 0 without markers), then the tokens of each key.
/// Returns one flag per counter: 1 added, 2 added before under this report (its marker is
/// set: the earlier call ran though its answer was lost, or another pd-control took the
/// report), 0 refused by Redis (a counter that is not an integer), which leaves the other
/// users' additions standing. Marker and addition happen in one script, so a report is added
/// once per user whichever pd-control replica gets each copy, and however its answers fare.
const USAGE_SCRIPT: &str = concat!(
    counter_failed_lua!(),
    r"
local window, remember = ARGV[1], tonumber(ARGV[2])
local n = #KEYS
if remember > 0 then n = n / 2 end
local added = {}
for i = 1, n do
  local key = KEYS[i]
  if remember > 0 and not redis.call('SET', KEYS[n + i], 1, 'NX', 'PX', remember) then
    added[i] = 2
  else
    local total = redis.pcall('INCRBY', key, ARGV[i + 2])
    if counter_failed(total) then
      if remember > 0 then redis.call('DEL', KEYS[n + i]) end
      added[i] = 0
    else
      if redis.call('PTTL', key) == -1 then
        redis.call('PEXPIRE', key, window)
      end
      added[i] = 1
    end
  end
end
return added
"
);

/// The key marking `user`'s tokens of report `id` as added (see [`USAGE_SCRIPT`]).
pub fn usage_report_key(id: &str, user: &str) -> String {
    format!("pd-router:usage-report:{id}:{user}")
}

/// Reads the admit script's reply, given the user's limits and the model's rate when asked.
fn verdict(reply: &[i64], user: Option<Limits>, model: Option<&ModelRps>) -> Option<Answer> {
    let [code, rpm, tpm, model_rps] = *reply else {
        return None;
    };
    let rps_limit = model.map(|m| m.limit);
    match (code, user, rps_limit) {
        (0, Some(limits), _) => Some(Answer::RpmExceeded {
            rpm,
            rpm_limit: limits.rpm,
        }),
        (1, _, _) if user.is_some() || model.is_some() => Some(Answer::Admitted {
            rpm: user.map(|_| rpm),
            rpm_limit: user.map(|l| l.rpm),
            tpm: user.map(|_| tpm),
            tpm_limit: user.map(|l| l.tpm),
            model_rps: model.map(|_| model_rps),
            rps_limit,
        }),
        (2, Some(limits), _) => Some(Answer::TpmExceeded {
            rpm,
            rpm_limit: limits.rpm,
            tpm,
            tpm_limit: limits.tpm,
        }),
        (3, _, Some(rps_limit)) => Some(Answer::ModelRpsExceeded {
            model_rps,
            rps_limit,
        }),
        (4, _, _) => {
            let model = model?;
            let key = model_rps_key(&model.model, model.window_ms);
            Some(Answer::StoreError {
                stage: Stage::Model,
                message: format!("model counter {key} cannot be incremented: not an integer"),
            })
        }
        (5, Some(_), _) => Some(Answer::StoreError {
            stage: Stage::Rpm,
            message: "the user's request counter cannot be read: not an integer".into(),
        }),
        (6, Some(_), _) => Some(Answer::StoreError {
            stage: Stage::IncrRpm,
            message: "the user's request counter cannot be incremented: not an integer".into(),
        }),
        (7, Some(_), _) => Some(Answer::StoreError {
            stage: Stage::Tpm,
            message: format!("the user's token counter cannot be read: not an integer (the request counted: {rpm})"),
        }),
        (8, _, _) => Some(Answer::Cancelled { given_back: 0 }),
        _ => None,
    }
}

/// A body of `POST /v1/limits/usage` that cannot be applied.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error("want a JSON object of user names to token counts: {0}")]
    Body(String),
    #[error("{0}")]
    Name(#[from] NameError),
    #[error("{tokens} tokens for one user is more than a counter holds")]
    TooMany { tokens: u64 },
    #[error("usage report names more than {MAX_USAGE_USERS} users")]
    TooManyUsers,
}

/// Parses a usage report, `{"alice": 123, ...}`, into the additions to make (users with no
/// tokens left out), in name order.
pub fn parse_usage(body: &[u8]) -> Result<Vec<(String, i64)>, UsageError> {
    use serde::Deserializer as _;
    let mut de = serde_json::Deserializer::from_slice(body);
    let usage = de
        .deserialize_map(UsageVisitor)
        .and_then(|usage| de.end().map(|()| usage))
        .map_err(|e| UsageError::Body(e.to_string()))?;
    let usage = usage?;
    let mut out = Vec::with_capacity(usage.len());
    for (name, tokens) in usage {
        user_name(name.as_bytes())?;
        if tokens == 0 {
            continue;
        }
        let tokens = i64::try_from(tokens).map_err(|_| UsageError::TooMany { tokens })?;
        out.push((name, tokens));
    }
    Ok(out)
}

/// Reads a usage object into a map, stopping at the [`MAX_USAGE_USERS`] + 1st entry rather
/// than reading the whole body first.
struct UsageVisitor;

impl<'de> serde::de::Visitor<'de> for UsageVisitor {
    type Value = Result<BTreeMap<String, u64>, UsageError>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object of user names to token counts")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut usage = BTreeMap::new();
        let mut entries = 0usize;
        while let Some((name, tokens)) = map.next_entry::<String, u64>()? {
            entries += 1;
            if entries > MAX_USAGE_USERS {
                return Ok(Err(UsageError::TooManyUsers));
            }
            usage.insert(name, tokens);
        }
        Ok(Ok(usage))
    }
}

/// The log line of an unusable record. The message names Redis keys built from user and
/// model names that came in request bodies and may hold CR/LF, which the log writer does not
/// escape: Debug formatting escapes them, so a name cannot forge log lines.
/// Whether a call that failed with `error` may have run on the server all the same: no reply
/// within the round-trip bound, or the connection lost on the way. Not a connect that never
/// happened, an error reply (it ran and failed) or a refusal unrun (`Fault::WrongServer`).
fn may_have_run(error: &LinkError) -> bool {
    match error {
        LinkError::Timeout(_) => true,
        LinkError::Redis(_) => Fault::of(error) == Fault::Broken,
        LinkError::ConnectTimeout(_) | LinkError::Backoff => false,
    }
}

/// A counter family's samples by `result` label, `(labels, value)`: the give-back counters of
/// refunds and withdrawals.
fn result_samples(counts: &[(&str, &AtomicU64)]) -> Vec<(String, String)> {
    counts
        .iter()
        .map(|(result, n)| {
            (
                format!("{{result=\"{result}\"}}"),
                n.load(Ordering::Relaxed).to_string(),
            )
        })
        .collect()
}

fn record_warning(message: &str) -> String {
    format!("user limits: {message:?}; its requests answer store_error")
}

/// Token additions Redis did not make.
#[derive(Debug, thiserror::Error)]
#[error("{failed} of {of} users' token counts not added: {reason}")]
pub struct UsageFailure {
    pub failed: usize,
    pub of: usize,
    pub reason: String,
}

/// A Prometheus family: `(name, type, help, samples)`, each sample `(labels, value)` with
/// `labels` `{...}` or empty.
pub type MetricFamily = (
    &'static str,
    &'static str,
    &'static str,
    Vec<(String, String)>,
);

/// The limits of this pd-control: off, or checked against Redis.
pub struct UserLimits {
    store: Option<Store>,
    /// Users' limits are read from their records; off (`AIBRIX_DISABLE_REDIS_USER_STORE`),
    /// every named user has [`UNRECORDED`] and none is unknown.
    records: bool,
    checks: [AtomicU64; 7],
    tokens_total: AtomicU64,
    errors_total: AtomicU64,
    /// Redis failed on the last call: its failures are logged on the way in and out of that
    /// state, not once per request.
    failing: AtomicBool,
    /// When an unusable record was last logged (Unix ms), to log one per minute at most.
    record_warned_ms: AtomicI64,
    /// Token reports by id, so one sent again counts once (see `report_ids`).
    reports: ReportIds,
    /// Users' tokens of reports sent again that had been added already.
    duplicates_total: AtomicU64,
    /// Model requests given back after the gateway could not route them.
    refunds: refund::RefundCounts,
    /// Withdrawn admissions, by result.
    cancels: cancel::CancelCounts,
}

struct Store {
    link: RedisLink,
    admit: redis::Script,
    usage: redis::Script,
    release: redis::Script,
    cancel: redis::Script,
}

impl UserLimits {
    /// Limits off: every check answers [`Answer::Disabled`].
    pub fn disabled() -> UserLimits {
        UserLimits::with_store(None)
    }

    /// Limits checked against the Redis at `url` (which must parse); connecting is lazy.
    pub fn redis(url: &str) -> Result<UserLimits, redis::RedisError> {
        Ok(UserLimits::with_store(Some(Store {
            link: RedisLink::open(url)?,
            admit: redis::Script::new(ADMIT_SCRIPT),
            usage: redis::Script::new(USAGE_SCRIPT),
            release: redis::Script::new(refund::RELEASE_SCRIPT),
            cancel: redis::Script::new(cancel::CANCEL_SCRIPT),
        })))
    }

    fn with_store(store: Option<Store>) -> UserLimits {
        UserLimits {
            store,
            records: true,
            checks: Default::default(),
            tokens_total: AtomicU64::new(0),
            errors_total: AtomicU64::new(0),
            failing: AtomicBool::new(false),
            record_warned_ms: AtomicI64::new(i64::MIN),
            reports: ReportIds::default(),
            duplicates_total: AtomicU64::new(0),
            refunds: Default::default(),
            cancels: Default::default(),
        }
    }

    /// Every named user gets the default limits; no record is read (AIBrix's
    /// `AIBRIX_DISABLE_REDIS_USER_STORE`).
    pub fn without_records(mut self) -> UserLimits {
        self.records = false;
        self
    }

    pub fn enabled(&self) -> bool {
        self.store.is_some()
    }

    /// Checks one request against its user's limits and its model's rate, counting it as
    /// the answer says (or, for `request.cancel`, withdraws it).
    pub async fn admit(self: &Arc<Self>, request: &AdmitRequest) -> Answer {
        let answer = match &self.store {
            None => Answer::Disabled,
            Some(store) if request.cancel => return self.cancel(store, request).await,
            Some(store) => {
                let (answer, unsure) = self.check(store, request).await;
                if unsure {
                    self.withdraw_in_background(request);
                }
                answer
            }
        };
        if let Some(i) = answer.counted() {
            self.checks[i].fetch_add(1, Ordering::Relaxed);
        }
        let user = request.user.as_deref().unwrap_or_default();
        let model = request.model.as_ref().map_or("", |m| m.model.as_str());
        match &answer {
            Answer::RpmExceeded { rpm, rpm_limit } => {
                tracing::debug!(user, rpm, rpm_limit, "user over its request limit");
            }
            Answer::TpmExceeded { tpm, tpm_limit, .. } => {
                tracing::debug!(user, tpm, tpm_limit, "user over its token limit");
            }
            Answer::ModelRpsExceeded {
                model_rps,
                rps_limit,
            } => {
                tracing::debug!(model, model_rps, rps_limit, "model over its request rate");
            }
            _ => {}
        }
        answer
    }

    /// Withdraws admission `request` from a task of its own: its counter script failed on
    /// the way (no reply within the round-trip bound, the connection lost), so Redis may run
    /// it still, after the `store_error` answer let the gateway refuse the request. The
    /// withdrawal's marker makes the late count, whenever it lands, count nothing.
    fn withdraw_in_background(self: &Arc<Self>, request: &AdmitRequest) {
        let mut withdrawal = request.clone();
        withdrawal.cancel = true;
        let limits = Arc::clone(self);
        tokio::spawn(async move {
            if let Some(store) = &limits.store {
                limits.cancel(store, &withdrawal).await;
            }
        });
    }

    /// With a user, two round trips: the record (a plain read, which AIBrix keeps current),
    /// then the counter script with the limits it names (and the model's rate). A model-only
    /// check is the counter script alone. Also says whether the script may have counted
    /// after all without the answer saying so (its call failed on the way, and the admission
    /// has an id to withdraw).
    async fn check(&self, store: &Store, request: &AdmitRequest) -> (Answer, bool) {
        let user = match &request.user {
            None => None,
            Some(name) => match self.user_limits(store, name).await {
                Ok(limits) => Some((name.as_str(), limits)),
                Err(answer) => return (answer, false),
            },
        };
        let model = request.model.as_ref();
        // The script as a whole failing, AIBrix's first step after the record (its `checkRPM`
        // read) is the one that fails.
        let stage = if user.is_some() {
            Stage::Rpm
        } else {
            Stage::Model
        };
        let mut keys = Vec::with_capacity(4);
        let mut args: Vec<i64> = vec![0; 9];
        if let Some((name, limits)) = user {
            keys.push(rpm_key(name));
            keys.push(tpm_key(name));
            args[..4].copy_from_slice(&[1, limits.rpm, limits.tpm, WINDOW_MS as i64]);
        }
        if let Some(rps) = model {
            keys.push(model_rps_key(&rps.model, rps.window_ms));
            let window = i64::try_from(rps.window_ms).unwrap_or(i64::MAX);
            args[4..7].copy_from_slice(&[1, rps.limit, window]);
        }
        if let Some(id) = &request.id {
            keys.push(admission_key(id));
            args[7..].copy_from_slice(&[1, MARKER_MS as i64]);
        }
        let counted = store
            .link
            .call(Retry::Never, |mut conn| {
                let mut invocation = store.admit.prepare_invoke();
                for key in &keys {
                    invocation.key(key);
                }
                for arg in &args {
                    invocation.arg(*arg);
                }
                async move { invocation.invoke_async::<Vec<i64>>(&mut conn).await }
            })
            .await;
        let reply = match counted {
            Ok(reply) => reply,
            Err(e) => {
                let unsure = request.id.is_some() && may_have_run(&e);
                return (self.store_error(stage, &e), unsure);
            }
        };
        self.redis_ok();
        let answer = verdict(&reply, user.map(|(_, limits)| limits), model).unwrap_or_else(|| {
            Answer::StoreError {
                stage,
                message: format!("unexpected counter script reply {reply:?}"),
            }
        });
        if let Answer::StoreError { message, .. } = &answer {
            // Redis answered, but a counter is unusable (or the reply is): a store failure
            // all the same, logged at most once a minute as its requests repeat it.
            self.errors_total.fetch_add(1, Ordering::Relaxed);
            self.warn_record(message);
        }
        (answer, false)
    }

    /// A user's limits from its record, or the answer when there are none to check against.
    async fn user_limits(&self, store: &Store, name: &str) -> Result<Limits, Answer> {
        if !self.records {
            return Ok(UNRECORDED);
        }
        let key = user_key(name);
        let read = store
            .link
            .call(Retry::OnceOnStaleConnection, |mut conn| {
                let mut get = redis::cmd("GET");
                get.arg(&key);
                async move { get.query_async::<Option<Vec<u8>>>(&mut conn).await }
            })
            .await;
        let raw = match read {
            Ok(Some(raw)) => raw,
            Ok(None) => {
                self.redis_ok();
                return Err(Answer::UnknownUser);
            }
            Err(e) => return Err(self.store_error(Stage::User, &e)),
        };
        self.redis_ok();
        parse_record(&raw).map_err(|e| {
            let message = format!("user record {key}: {e}");
            self.warn_record(&message);
            Answer::StoreError {
                stage: Stage::User,
                message,
            }
        })
    }

    /// Adds each user's tokens to its token counter. Users are added in batches; a failed
    /// batch does not stop the others, and what was added stays added. A report with an
    /// `id` sent again adds only the users it did not add before (see `report_ids`); a copy
    /// arriving while the first is still being added fails as busy, to be sent again later.
    /// Run it to the end (a spawned task): dropped halfway, the report would stay busy.
    pub async fn add_usage(
        &self,
        id: Option<&str>,
        usage: &[(String, i64)],
    ) -> Result<(), UsageFailure> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        let todo = match id.map(|id| self.reports.claim(id, usage, Instant::now())) {
            None => usage.to_vec(),
            Some(Claim::Busy) => {
                return Err(UsageFailure {
                    failed: usage.len(),
                    of: usage.len(),
                    reason: "a copy of this report is still being added".into(),
                })
            }
            Some(Claim::Add(todo)) => todo,
        };
        let skipped = usage.len() - todo.len();
        self.duplicates_total
            .fetch_add(skipped as u64, Ordering::Relaxed);
        let (added, reason) = self.add_each(store, id, &todo).await;
        if let Some(id) = id {
            let names = todo.iter().zip(&added).filter(|(_, ok)| **ok);
            self.reports
                .settle(id, names.map(|((name, _), _)| name.as_str()));
        }
        let failed = added.iter().filter(|ok| !**ok).count();
        if failed == 0 {
            return Ok(());
        }
        // One error per user whose tokens were not added, whatever the batch's fate.
        let errors = u64::try_from(failed).unwrap_or(u64::MAX);
        self.errors_total.fetch_add(errors, Ordering::Relaxed);
        Err(UsageFailure {
            failed,
            of: usage.len(),
            reason,
        })
    }

    /// Adds `usage` (of report `id`, when it has one) batch by batch; whether each user's
    /// tokens were added, and why the last that was not.
    async fn add_each(
        &self,
        store: &Store,
        id: Option<&str>,
        usage: &[(String, i64)],
    ) -> (Vec<bool>, String) {
        let mut added = Vec::with_capacity(usage.len());
        let mut reason = String::new();
        let remember_ms = id.map_or(0, |_| REMEMBER.as_millis());
        for batch in usage.chunks(USAGE_BATCH) {
            let counters = batch.iter().map(|(name, _)| tpm_key(name));
            let markers = id.into_iter().flat_map(|id| {
                batch
                    .iter()
                    .map(move |(name, _)| usage_report_key(id, name))
            });
            let keys: Vec<String> = counters.chain(markers).collect();
            let answer = store
                .link
                .call(Retry::Never, |mut conn| {
                    let mut invocation = store.usage.prepare_invoke();
                    invocation.arg(WINDOW_MS).arg(remember_ms as u64);
                    for key in &keys {
                        invocation.key(key);
                    }
                    for (_, tokens) in batch {
                        invocation.arg(*tokens);
                    }
                    async move { invocation.invoke_async::<Vec<i64>>(&mut conn).await }
                })
                .await;
            match answer {
                Ok(flags) => {
                    self.redis_ok();
                    for (i, (name, tokens)) in batch.iter().enumerate() {
                        let flag = flags.get(i).copied();
                        match flag {
                            Some(1) => {
                                self.tokens_total
                                    .fetch_add(tokens.unsigned_abs(), Ordering::Relaxed);
                            }
                            Some(2) => {
                                self.duplicates_total.fetch_add(1, Ordering::Relaxed);
                            }
                            Some(0) => {
                                // Redis refused this user's counter (not an integer, another
                                // type). A resend would fail alike and hold the worker's
                                // newer reports, every other user's tokens, behind it for a
                                // minute: these tokens are given up, counted and logged.
                                self.errors_total.fetch_add(1, Ordering::Relaxed);
                                self.warn_record(&format!(
                                    "the token counter of {name} is not an integer: {tokens} tokens not counted"
                                ));
                            }
                            _ => {
                                reason = format!("the usage script answered {flags:?}");
                            }
                        }
                        added.push(matches!(flag, Some(0..=2)));
                    }
                }
                Err(e) => {
                    added.extend(std::iter::repeat_n(false, batch.len()));
                    reason = e.to_string();
                    self.redis_failed(&e);
                }
            }
        }
        (added, reason)
    }

    fn store_error(&self, stage: Stage, error: &LinkError) -> Answer {
        self.errors_total.fetch_add(1, Ordering::Relaxed);
        self.redis_failed(error);
        Answer::StoreError {
            stage,
            message: error.to_string(),
        }
    }

    /// Logs the turn to failing (the caller counts the errors).
    fn redis_failed(&self, error: &LinkError) {
        if !self.failing.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                %error,
                "user limits: redis failing; checks answer store_error until it recovers"
            );
        }
    }

    fn redis_ok(&self) {
        if self.failing.swap(false, Ordering::Relaxed) {
            tracing::info!("user limits: redis answering again");
        }
    }

    /// An unusable record is an operator's mistake that every request of the user would
    /// repeat: logged once a minute at most.
    fn warn_record(&self, message: &str) {
        let now = crate::unix_ms_now();
        let last = self.record_warned_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 60_000
            && self
                .record_warned_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!("{}", record_warning(message));
        }
    }

    /// Prometheus families for `/metrics`.
    pub fn metrics(&self) -> Vec<MetricFamily> {
        let plain = |value: u64| vec![(String::new(), value.to_string())];
        let checks = OUTCOMES
            .iter()
            .zip(&self.checks)
            .map(|(outcome, n)| {
                (
                    format!("{{outcome=\"{outcome}\"}}"),
                    n.load(Ordering::Relaxed).to_string(),
                )
            })
            .collect();
        vec![
            (
                "pd_control_user_limits_enabled",
                "gauge",
                "1 when this pd-control checks per-user request and token limits (--redis, not turned off).",
                plain(u64::from(self.enabled())),
            ),
            (
                "pd_control_user_limit_checks_total",
                "counter",
                "Per-user and per-model limit checks by outcome (admitted, rpm_exceeded, tpm_exceeded, model_rps_exceeded, unknown_user, store_error).",
                checks,
            ),
            (
                "pd_control_user_tokens_total",
                "counter",
                "Tokens added to users' token counters.",
                plain(self.tokens_total.load(Ordering::Relaxed)),
            ),
            (
                "pd_control_user_usage_duplicates_total",
                "counter",
                "Users' token counts in reports sent again (same x-pd-report-id) that had been added already, so not added twice.",
                plain(self.duplicates_total.load(Ordering::Relaxed)),
            ),
            (
                "pd_control_model_rps_refunds_total",
                "counter",
                "Model requests the gateway could not route, sent back to their model's rate counter: given_back, or skipped (the window that counted them had passed, or the counter was at 0).",
                self.refunds.samples(),
            ),
            (
                "pd_control_admission_cancels_total",
                "counter",
                "Admissions the gateway gave up on (no answer in time) and withdrew: given_back (what the admission had counted was given back), nothing_counted (withdrawn before it counted, or withdrawn already), failed (Redis did not take the withdrawal).",
                self.cancels.samples(),
            ),
            (
                "pd_control_user_limit_errors_total",
                "counter",
                "Redis failures of user limits: failed record reads and counter scripts of checks, model counters that cannot be incremented, token additions not made, and releases not made.",
                plain(self.errors_total.load(Ordering::Relaxed)),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn keys_are_aibrix_keys() {
        assert_eq!(user_key("alice"), "aibrix-users/alice");
        assert_eq!(rpm_key("alice"), "aibrix:alice_RPM_CURRENT:60000:counter");
        assert_eq!(tpm_key("alice"), "aibrix:alice_TPM_CURRENT:60000:counter");
        assert_eq!(
            model_rps_key("llama", 1000),
            "aibrix_model:llama_MODEL_RPS_CURRENT:1000:counter"
        );
    }

    #[test]
    fn admission_bodies_parse() {
        let parse = |body: Value| parse_admit(body.to_string().as_bytes());
        let llama = |limit, window_ms| ModelRps {
            model: "llama".into(),
            limit,
            window_ms,
        };
        assert_eq!(
            parse(json!({"user": "alice"})),
            Ok(AdmitRequest {
                user: Some("alice".into()),
                model: None,
                id: None,
                cancel: false
            })
        );
        assert_eq!(
            parse(json!({"model": "llama", "rps_limit": 2, "rps_window_ms": 1000})),
            Ok(AdmitRequest {
                user: None,
                model: Some(llama(2, 1000)),
                id: None,
                cancel: false
            })
        );
        assert_eq!(
            parse(json!({"user": "a", "model": "llama", "rps_limit": 1,
                         "rps_window_ms": 3_600_000, "extra": [1], "stream": true})),
            Ok(AdmitRequest {
                user: Some("a".into()),
                model: Some(llama(1, 3_600_000)),
                id: None,
                cancel: false
            }),
            "unknown members are ignored"
        );
        assert_eq!(
            parse(json!({"user": "a", "model": null, "rps_limit": null})),
            Ok(AdmitRequest {
                user: Some("a".into()),
                model: None,
                id: None,
                cancel: false
            }),
            "null is absent"
        );
        assert_eq!(
            parse(json!({"user": "a", "id": "f00d-1", "cancel": true})),
            Ok(AdmitRequest {
                user: Some("a".into()),
                model: None,
                id: Some("f00d-1".into()),
                cancel: false
            }),
            "an admission is never a withdrawal, whatever its body says"
        );
        let cancel = |body: serde_json::Value| parse_cancel(body.to_string().as_bytes());
        assert_eq!(
            cancel(json!({"user": "a", "id": "f00d-1"})),
            Ok(AdmitRequest {
                user: Some("a".into()),
                model: None,
                id: Some("f00d-1".into()),
                cancel: true
            }),
            "a withdrawal names the admission's id"
        );
        assert_eq!(
            cancel(json!({"user": "a"})),
            Err(AdmitError::CancelWithoutId)
        );
        assert_eq!(
            parse(json!({"user": "a", "id": "a:b"})),
            Err(AdmitError::Id)
        );
        assert_eq!(parse(json!({"user": "a", "id": ""})), Err(AdmitError::Id));
        let user_256 = "u".repeat(256);
        assert!(parse(json!({ "user": user_256 })).is_ok());
        let model_256 = "m".repeat(256);
        assert!(parse(json!({"model": model_256, "rps_limit": 1, "rps_window_ms": 1000})).is_ok());

        let model = |name: &str, limit: Value, window: Value| {
            parse(json!({"model": name, "rps_limit": limit, "rps_window_ms": window}))
        };
        assert_eq!(parse(json!({})), Err(AdmitError::Nothing));
        assert_eq!(parse(json!({"name": "alice"})), Err(AdmitError::Nothing));
        assert_eq!(
            parse(json!({"user": ""})),
            Err(AdmitError::User(NameError::Empty))
        );
        assert_eq!(
            parse(json!({ "user": "u".repeat(257) })),
            Err(AdmitError::User(NameError::TooLong(257)))
        );
        assert_eq!(
            parse(json!({"model": "llama"})),
            Err(AdmitError::RpsMissing)
        );
        assert_eq!(
            parse(json!({"user": "a", "model": "llama", "rps_limit": 2})),
            Err(AdmitError::RpsMissing)
        );
        assert_eq!(
            parse(json!({"model": "llama", "rps_window_ms": 1000})),
            Err(AdmitError::RpsMissing)
        );
        assert_eq!(
            parse(json!({"user": "a", "rps_limit": 2, "rps_window_ms": 1000})),
            Err(AdmitError::RpsWithoutModel)
        );
        assert_eq!(
            parse(json!({"rps_window_ms": 1000})),
            Err(AdmitError::RpsWithoutModel)
        );
        assert_eq!(
            model("llama", json!(0), json!(1000)),
            Err(AdmitError::RpsLimit(0))
        );
        assert_eq!(
            model("llama", json!(-3), json!(1000)),
            Err(AdmitError::RpsLimit(-3))
        );
        assert_eq!(
            model("llama", json!(1), json!(999)),
            Err(AdmitError::RpsWindow(999))
        );
        assert_eq!(
            model("llama", json!(1), json!(3_600_001)),
            Err(AdmitError::RpsWindow(3_600_001))
        );
        assert_eq!(
            model("", json!(1), json!(1000)),
            Err(AdmitError::ModelName(0))
        );
        assert_eq!(
            model(&"m".repeat(257), json!(1), json!(1000)),
            Err(AdmitError::ModelName(257))
        );
        for (limit, window) in [
            (json!(1.5), json!(1000)),
            (json!("2"), json!(1000)),
            (json!(2), json!(-1000)),
            (json!(2), json!(1000.5)),
        ] {
            assert!(
                matches!(
                    model("llama", limit.clone(), window.clone()),
                    Err(AdmitError::Body(_))
                ),
                "{limit} {window}"
            );
        }
        for garbage in [
            &b""[..],
            b"alice",
            b"\"alice\"",
            b"123",
            b"[]",
            b"null",
            b"{\"user\": 7}",
            b"{\"user\": \"a\"",
        ] {
            assert!(
                matches!(parse_admit(garbage), Err(AdmitError::Body(_))),
                "{:?}",
                String::from_utf8_lossy(garbage)
            );
        }
    }

    #[test]
    fn records_parse_with_aibrix_defaults() {
        let limits = |raw: &str| parse_record(raw.as_bytes());
        let ok = |rpm, tpm| Ok(Limits { rpm, tpm });
        assert_eq!(
            limits(r#"{"name":"alice","rpm":10,"tpm":5000}"#),
            ok(10, 5000)
        );
        assert_eq!(limits(r#"{"name":"alice","rpm":0,"tpm":7}"#), ok(100, 7));
        assert_eq!(limits(r#"{"rpm":3,"tpm":0}"#), ok(3, 3000), "tpm from rpm");
        assert_eq!(limits(r#"{"rpm":0,"tpm":0}"#), ok(100, 100_000));
        assert_eq!(limits(r#"{"name":"alice"}"#), ok(100, 100_000), "absent");
        assert_eq!(limits(r#"{"rpm":null,"tpm":null}"#), ok(100, 100_000));
        assert_eq!(limits(r#"{"rpm":5,"extra":[1]}"#), ok(5, 5000));
        assert_eq!(
            limits(&format!(r#"{{"rpm":{}}}"#, i64::MAX)),
            ok(i64::MAX, i64::MAX),
            "the default token limit saturates"
        );
    }

    #[test]
    fn unusable_records_are_errors() {
        let limits = |raw: &str| parse_record(raw.as_bytes());
        // Negative limits are limits nothing stays under (AIBrix refuses such a user).
        assert_eq!(
            limits(r#"{"rpm":-1}"#),
            Ok(Limits {
                rpm: -1,
                tpm: -1_000
            })
        );
        assert_eq!(
            limits(r#"{"rpm":1,"tpm":-5}"#),
            Ok(Limits { rpm: 1, tpm: -5 })
        );
        for garbage in [
            "",
            "not json",
            "[]",
            "[10, 5000]",
            "null",
            "7",
            r#"{"rpm":"10"}"#,
            r#"{"rpm":1.5}"#,
            r#"{"rpm":99999999999999999999}"#,
            r#"{"rpm":1"#,
        ] {
            assert!(
                matches!(limits(garbage), Err(RecordError::Json(_))),
                "{garbage:?}"
            );
        }
    }

    #[test]
    fn user_names_are_checked() {
        assert_eq!(user_name(b"alice"), Ok("alice"));
        assert_eq!(user_name("ü".as_bytes()), Ok("ü"));
        assert_eq!(user_name(b""), Err(NameError::Empty));
        assert_eq!(user_name(&[b'a'; 256]).map(str::len), Ok(256));
        assert_eq!(user_name(&[b'a'; 257]), Err(NameError::TooLong(257)));
        assert_eq!(user_name(b"\xff"), Err(NameError::NotUtf8));
    }

    #[test]
    fn answers_have_the_contract_shapes() {
        let shape = |answer: Answer| serde_json::to_value(answer).unwrap();
        assert_eq!(
            shape(Answer::Admitted {
                rpm: Some(1),
                rpm_limit: Some(3),
                tpm: Some(0),
                tpm_limit: Some(3000),
                model_rps: None,
                rps_limit: None,
            }),
            json!({"outcome":"admitted","rpm":1,"rpm_limit":3,"tpm":0,"tpm_limit":3000,
                   "model_rps":null,"rps_limit":null})
        );
        assert_eq!(
            shape(Answer::Admitted {
                rpm: None,
                rpm_limit: None,
                tpm: None,
                tpm_limit: None,
                model_rps: Some(2),
                rps_limit: Some(5),
            }),
            json!({"outcome":"admitted","rpm":null,"rpm_limit":null,"tpm":null,"tpm_limit":null,
                   "model_rps":2,"rps_limit":5})
        );
        assert_eq!(
            shape(Answer::ModelRpsExceeded {
                model_rps: 2,
                rps_limit: 2
            }),
            json!({"outcome":"model_rps_exceeded","model_rps":2,"rps_limit":2})
        );
        assert_eq!(
            shape(Answer::RpmExceeded {
                rpm: 3,
                rpm_limit: 3
            }),
            json!({"outcome":"rpm_exceeded","rpm":3,"rpm_limit":3})
        );
        assert_eq!(
            shape(Answer::TpmExceeded {
                rpm: 2,
                rpm_limit: 100,
                tpm: 12,
                tpm_limit: 10
            }),
            json!({"outcome":"tpm_exceeded","rpm":2,"rpm_limit":100,"tpm":12,"tpm_limit":10})
        );
        assert_eq!(
            shape(Answer::UnknownUser),
            json!({"outcome":"unknown_user"})
        );
        assert_eq!(
            shape(Answer::StoreError {
                stage: Stage::User,
                message: "m".into()
            }),
            json!({"outcome":"store_error","stage":"user","message":"m"})
        );
        assert_eq!(
            shape(Answer::StoreError {
                stage: Stage::Counters,
                message: "m".into()
            }),
            json!({"outcome":"store_error","stage":"counters","message":"m"})
        );
        assert_eq!(
            shape(Answer::StoreError {
                stage: Stage::Model,
                message: "m".into()
            }),
            json!({"outcome":"store_error","stage":"model","message":"m"})
        );
        assert_eq!(shape(Answer::Disabled), json!({"outcome":"disabled"}));
        let back: Answer =
            serde_json::from_str(r#"{"outcome":"rpm_exceeded","rpm":4,"rpm_limit":3}"#).unwrap();
        assert_eq!(
            back,
            Answer::RpmExceeded {
                rpm: 4,
                rpm_limit: 3
            }
        );
    }

    #[test]
    fn script_replies_read_as_answers() {
        let user = Some(Limits { rpm: 3, tpm: 10 });
        let rps = ModelRps {
            model: "llama".into(),
            limit: 2,
            window_ms: 1000,
        };
        let model = Some(&rps);
        assert_eq!(
            verdict(&[0, 3, 0, 0], user, model),
            Some(Answer::RpmExceeded {
                rpm: 3,
                rpm_limit: 3
            })
        );
        assert_eq!(
            verdict(&[1, 2, 4, 0], user, None),
            Some(Answer::Admitted {
                rpm: Some(2),
                rpm_limit: Some(3),
                tpm: Some(4),
                tpm_limit: Some(10),
                model_rps: None,
                rps_limit: None,
            })
        );
        assert_eq!(
            verdict(&[1, 0, 0, 1], None, model),
            Some(Answer::Admitted {
                rpm: None,
                rpm_limit: None,
                tpm: None,
                tpm_limit: None,
                model_rps: Some(1),
                rps_limit: Some(2),
            })
        );
        assert_eq!(
            verdict(&[1, 2, 4, 1], user, model),
            Some(Answer::Admitted {
                rpm: Some(2),
                rpm_limit: Some(3),
                tpm: Some(4),
                tpm_limit: Some(10),
                model_rps: Some(1),
                rps_limit: Some(2),
            })
        );
        assert_eq!(
            verdict(&[2, 2, 12, 0], user, model),
            Some(Answer::TpmExceeded {
                rpm: 2,
                rpm_limit: 3,
                tpm: 12,
                tpm_limit: 10
            })
        );
        assert_eq!(
            verdict(&[3, 2, 4, 2], user, model),
            Some(Answer::ModelRpsExceeded {
                model_rps: 2,
                rps_limit: 2
            })
        );
        assert!(matches!(
            verdict(&[4, 0, 0, 0], None, model),
            Some(Answer::StoreError {
                stage: Stage::Model,
                ..
            })
        ));
        // Verdicts about a part that was not asked, and malformed replies.
        assert_eq!(verdict(&[0, 3, 0, 0], None, model), None);
        assert_eq!(verdict(&[2, 3, 0, 0], None, model), None);
        assert_eq!(verdict(&[3, 1, 1, 3], user, None), None);
        assert_eq!(verdict(&[4, 1, 1, 0], user, None), None);
        assert_eq!(verdict(&[1, 1, 1, 1], None, None), None);
        assert_eq!(verdict(&[9, 1, 1, 1], user, model), None);
        assert_eq!(verdict(&[5, 0, 0, 0], None, model), None);
        // AIBrix's three user steps, each its own stage (and so its own error header).
        for (code, stage) in [(5, Stage::Rpm), (6, Stage::IncrRpm), (7, Stage::Tpm)] {
            assert!(
                matches!(verdict(&[code, 1, 0, 0], user, model), Some(Answer::StoreError { stage: s, .. }) if s == stage),
                "{code}"
            );
        }
        assert_eq!(
            verdict(&[8, 0, 0, 0], user, model),
            Some(Answer::Cancelled { given_back: 0 })
        );
        assert_eq!(verdict(&[1, 1, 1], user, None), None);
    }

    #[test]
    fn usage_bodies_parse_into_additions() {
        let parsed = parse_usage(br#"{"bob": 7, "alice": 123, "carol": 0}"#).unwrap();
        assert_eq!(parsed, [("alice".to_string(), 123), ("bob".to_string(), 7)]);
        assert!(parse_usage(b"{}").unwrap().is_empty());
        for bad in [
            &b"[]"[..],
            b"",
            b"{\"a\": -1}",
            b"{\"a\": 1.5}",
            b"{\"a\": \"1\"}",
            b"{\"\": 1}",
        ] {
            assert!(
                parse_usage(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let long = format!("{{\"{}\": 1}}", "a".repeat(257));
        assert!(matches!(
            parse_usage(long.as_bytes()),
            Err(UsageError::Name(NameError::TooLong(257)))
        ));
        assert!(matches!(
            parse_usage(format!("{{\"a\": {}}}", u64::MAX).as_bytes()),
            Err(UsageError::TooMany { .. })
        ));
    }

    #[tokio::test]
    async fn disabled_limits_answer_disabled_and_count_nothing() {
        let limits = Arc::new(UserLimits::disabled());
        assert!(!limits.enabled());
        for body in [
            json!({"user": "alice"}),
            json!({"model": "llama", "rps_limit": 1, "rps_window_ms": 1000}),
        ] {
            let request = parse_admit(body.to_string().as_bytes()).unwrap();
            assert_eq!(limits.admit(&request).await, Answer::Disabled);
        }
        assert!(limits.add_usage(None, &[("alice".into(), 5)]).await.is_ok());
        let families = limits.metrics();
        let value = |name: &str| {
            families
                .iter()
                .find(|f| f.0 == name)
                .map(|f| f.3.clone())
                .unwrap()
        };
        assert_eq!(value("pd_control_user_limits_enabled")[0].1, "0");
        assert_eq!(value("pd_control_user_tokens_total")[0].1, "0");
        assert!(value("pd_control_user_limit_checks_total")
            .iter()
            .all(|(_, v)| v == "0"));
    }

    #[test]
    fn a_usage_report_names_at_most_the_filters_users() {
        let report = |n: usize| {
            let users: serde_json::Map<String, Value> =
                (0..n).map(|i| (format!("u{i}"), json!(1))).collect();
            serde_json::to_vec(&users).unwrap()
        };
        assert_eq!(
            parse_usage(&report(MAX_USAGE_USERS)).unwrap().len(),
            MAX_USAGE_USERS
        );
        assert!(matches!(
            parse_usage(&report(MAX_USAGE_USERS + 1)),
            Err(UsageError::TooManyUsers)
        ));
        assert!(matches!(parse_usage(b"{} x"), Err(UsageError::Body(_))));
        assert!(matches!(parse_usage(b"[1]"), Err(UsageError::Body(_))));
    }

    #[test]
    fn a_record_warning_cannot_forge_log_lines() {
        let line = record_warning(&format!(
            "user record {}: not JSON",
            user_key("eve\r\nERROR forged")
        ));
        assert!(!line.contains(['\r', '\n']), "{line}");
        assert!(line.contains("eve\\r\\nERROR forged"), "{line}");
    }
}
