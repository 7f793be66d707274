//! Decode shares of several gateway replicas (the seed's `AIBRIX_TOKEN_LOAD_SHARED_LEDGER`).
//!
//! Each Envoy process keeps its own ledger in shared data; stock Envoy wasm cannot talk to
//! Redis, so each replica's snapshot poller reports its decode ledger here and gets back the
//! sum of the *other* live replicas' shares. A replica silent for longer than the TTL drops
//! out, so a killed gateway's load stops counting on its own.
//!
//! With `--redis`, the shares live in Redis (expiring keys plus an index, one scripted round
//! trip per report) and every pd-control replica serves every gateway. When Redis fails the
//! answer falls back to the replicas that reported to this pd-control, the degradation shows
//! in `/metrics` and the log, and the next report tries Redis again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prost::Message;

use crate::proto::{DecodeShare, RemoteShares, ReplicaReport};
use crate::redis_link::{LinkError, RedisLink, Retry};

/// The scripted round trip: store the caller's report with its TTL, index it by expiry, drop
/// expired entries, and return every other live report. Redis's own clock decides expiry, so
/// pd-control replicas with skewed clocks agree.
///
/// The first element of the answer is a status: `ok`, or `full` when the caller is a new
/// replica and [`MAX_REPLICAS`] others are live (its report is then not stored), so the
/// Redis book is bounded like the local one whichever pd-control the reports reach.
const REPORT_SCRIPT: &str = r"
local index, prefix = KEYS[1], ARGV[1]
local id, payload, ttl = ARGV[2], ARGV[3], tonumber(ARGV[4])
local cap = tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', index, '-inf', now)
if not redis.call('ZSCORE', index, id) and redis.call('ZCARD', index) >= cap then
  return {'full'}
end
redis.call('SET', prefix .. id, payload, 'PX', ttl)
redis.call('ZADD', index, now + ttl, id)
local out = {'ok'}
for _, other in ipairs(redis.call('ZRANGE', index, 0, -1)) do
  if other ~= id then
    local v = redis.call('GET', prefix .. other)
    if v then table.insert(out, v) end
  end
end
return out
";

/// Shares one report may carry. A gateway reports one share per pod it routes to (the
/// filter tracks at most 4096 pods), and without a bound a 2 MB body of ~100k shares would be
/// kept per replica id and copied into every other replica's answer.
pub const MAX_SHARES: usize = 4096;

/// Replica ids live at once. The sender picks its id, so without a bound fresh ids, each
/// kept for the TTL, would grow the book (and every answer's work) without limit; a new id
/// past the bound is refused until old ones expire, while live replicas keep reporting.
pub const MAX_REPLICAS: usize = 256;

/// Largest decode-token share counted for one pod, from one replica or summed: far above any
/// real backlog, and finite, so `f64::MAX` shares cannot sum to infinity (which the filter
/// would drop as invalid, making the most loaded pod look idle).
pub const MAX_DECODE_TOKENS: f64 = 1e15;

#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("replica report does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("replica report without a replica id")]
    NoReplica,
    #[error("replica report of {0} shares (at most {MAX_SHARES})")]
    TooManyShares(usize),
    #[error(
        "{MAX_REPLICAS} replicas are live already; a new replica id is refused until one expires"
    )]
    TooManyReplicas,
}

/// Where the reports of all replicas are kept.
pub struct ReplicaBook {
    ttl: Duration,
    /// Reports received by this pd-control: the whole book without Redis, the fallback with it.
    local: Mutex<HashMap<u64, (Instant, Vec<DecodeShare>)>>,
    redis: Option<RedisShares>,
    reports_total: AtomicU64,
    redis_errors_total: AtomicU64,
    redis_up: AtomicBool,
}

struct RedisShares {
    link: RedisLink,
    script: redis::Script,
    prefix: String,
}

impl ReplicaBook {
    /// `redis_url`, when given, must parse (`redis://host:port/db`); connecting is lazy.
    pub fn new(ttl: Duration, redis_url: Option<&str>) -> Result<ReplicaBook, redis::RedisError> {
        let redis = match redis_url {
            Some(url) => Some(RedisShares {
                link: RedisLink::open(url)?,
                script: redis::Script::new(REPORT_SCRIPT),
                prefix: "pd-router:replica:".to_string(),
            }),
            None => None,
        };
        Ok(ReplicaBook {
            ttl,
            local: Mutex::new(HashMap::new()),
            redis,
            reports_total: AtomicU64::new(0),
            redis_errors_total: AtomicU64::new(0),
            redis_up: AtomicBool::new(false),
        })
    }

    /// Records `body` (an encoded [`ReplicaReport`]) and answers the other live replicas'
    /// shares, summed per pod.
    pub async fn report(&self, body: &[u8]) -> Result<RemoteShares, ReplicaError> {
        self.report_at(body, Instant::now()).await
    }

    /// [`ReplicaBook::report`] as of `now` (the TTL is measured against it).
    pub async fn report_at(&self, body: &[u8], now: Instant) -> Result<RemoteShares, ReplicaError> {
        let report = ReplicaReport::decode(body)?;
        if report.replica == 0 {
            return Err(ReplicaError::NoReplica);
        }
        if report.shares.len() > MAX_SHARES {
            return Err(ReplicaError::TooManyShares(report.shares.len()));
        }
        self.reports_total.fetch_add(1, Ordering::Relaxed);
        let replica = report.replica;
        // Re-encoded, so unknown fields padding the body are not stored in Redis.
        let payload = self.redis.as_ref().map(|_| report.encode_to_vec());
        self.record_local(report, now)?;
        let (Some(redis), Some(payload)) = (&self.redis, payload) else {
            return Ok(self.local_others(replica, now));
        };
        match redis.exchange(replica, &payload, self.ttl).await {
            Ok(Exchange::Full) => Err(ReplicaError::TooManyReplicas),
            Ok(Exchange::Others(others)) => {
                if !self.redis_up.swap(true, Ordering::Relaxed) {
                    tracing::info!("redis: replica shares shared through redis");
                }
                let decoded: Vec<Vec<DecodeShare>> = others
                    .iter()
                    .filter_map(|bytes| ReplicaReport::decode(bytes.as_slice()).ok())
                    .filter(|r| r.replica != replica && r.shares.len() <= MAX_SHARES)
                    .map(|r| r.shares)
                    .collect();
                Ok(sum(decoded.iter().map(Vec::as_slice)))
            }
            Err(err) => {
                self.redis_errors_total.fetch_add(1, Ordering::Relaxed);
                if self.redis_up.swap(false, Ordering::Relaxed)
                    || self.redis_errors_total.load(Ordering::Relaxed) == 1
                {
                    tracing::warn!(
                        "redis unavailable ({err}); answering with the replicas that report to this pd-control"
                    );
                }
                Ok(self.local_others(replica, now))
            }
        }
    }

    /// Stores the report locally (expired replicas dropped first), or refuses a new replica
    /// id while [`MAX_REPLICAS`] are live.
    fn record_local(&self, report: ReplicaReport, now: Instant) -> Result<(), ReplicaError> {
        let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        let ttl = self.ttl;
        local.retain(|_, (seen, _)| now.duration_since(*seen) <= ttl);
        if !local.contains_key(&report.replica) && local.len() >= MAX_REPLICAS {
            return Err(ReplicaError::TooManyReplicas);
        }
        local.insert(report.replica, (now, report.shares));
        Ok(())
    }

    /// The other live replicas' local shares, summed under the lock rather than copied out.
    fn local_others(&self, replica: u64, now: Instant) -> RemoteShares {
        let local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        sum(local
            .iter()
            .filter(|(id, (seen, _))| **id != replica && now.duration_since(*seen) <= self.ttl)
            .map(|(_, (_, shares))| shares.as_slice()))
    }

    /// Replicas heard from within the TTL by this pd-control.
    pub fn live_local(&self) -> usize {
        let now = Instant::now();
        let local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        local
            .values()
            .filter(|(seen, _)| now.duration_since(*seen) <= self.ttl)
            .count()
    }

    /// Prometheus samples: `(name, type, help, value)`.
    pub fn metrics(&self) -> Vec<(&'static str, &'static str, &'static str, String)> {
        let mut out = vec![
            (
                "pd_control_replica_reports_total",
                "counter",
                "Decode-ledger reports received from gateway replicas.",
                self.reports_total.load(Ordering::Relaxed).to_string(),
            ),
            (
                "pd_control_replicas_live",
                "gauge",
                "Gateway replicas that reported to this pd-control within the replica TTL.",
                self.live_local().to_string(),
            ),
        ];
        if self.redis.is_some() {
            out.push((
                "pd_control_redis_up",
                "gauge",
                "1 when the last replica report went through Redis, 0 when it fell back to local shares.",
                u8::from(self.redis_up.load(Ordering::Relaxed)).to_string(),
            ));
            out.push((
                "pd_control_redis_errors_total",
                "counter",
                "Replica reports whose Redis round trip failed (answered from local shares).",
                self.redis_errors_total.load(Ordering::Relaxed).to_string(),
            ));
        }
        out
    }
}

/// What the report script answered.
enum Exchange {
    /// The other live replicas' payloads.
    Others(Vec<Vec<u8>>),
    /// [`MAX_REPLICAS`] others are live and the caller is new: not stored.
    Full,
}

impl RedisShares {
    /// One scripted round trip. Repeating a report is harmless (it overwrites itself), so a
    /// connection broken since the last report (Redis restarted) is replaced and the call
    /// retried once, and a recovered Redis is used at once.
    async fn exchange(
        &self,
        replica: u64,
        payload: &[u8],
        ttl: Duration,
    ) -> Result<Exchange, LinkError> {
        let ttl_ms = ttl.as_millis().max(1) as u64;
        let index = format!("{}index", self.prefix);
        let id = format!("{replica:016x}");
        let mut answer = self
            .link
            .call(Retry::OnceOnStaleConnection, |mut conn| {
                let mut invocation = self.script.key(&index);
                invocation
                    .arg(&self.prefix)
                    .arg(&id)
                    .arg(payload)
                    .arg(ttl_ms)
                    .arg(MAX_REPLICAS);
                async move { invocation.invoke_async::<Vec<Vec<u8>>>(&mut conn).await }
            })
            .await?
            .into_iter();
        // The script (run by its hash, so always this one) answers `ok` or `full` first.
        Ok(match answer.next().as_deref() {
            Some(b"full") => Exchange::Full,
            _ => Exchange::Others(answer.collect()),
        })
    }
}

/// Sums shares per pod, in pod-id order (a stable answer is easier to diff and test).
pub fn sum<'a>(reports: impl Iterator<Item = &'a [DecodeShare]>) -> RemoteShares {
    let mut by_pod: std::collections::BTreeMap<u64, (f64, u32)> = Default::default();
    let mut replicas = 0u32;
    for shares in reports {
        replicas += 1;
        for s in shares {
            let e = by_pod.entry(s.pod_id).or_default();
            if s.decode_tokens.is_finite() && s.decode_tokens > 0.0 {
                e.0 = (e.0 + s.decode_tokens.min(MAX_DECODE_TOKENS)).min(MAX_DECODE_TOKENS);
            }
            e.1 = e.1.saturating_add(s.running);
        }
    }
    RemoteShares {
        shares: by_pod
            .into_iter()
            .filter(|(_, (tokens, running))| *tokens > 0.0 || *running > 0)
            .map(|(pod_id, (decode_tokens, running))| DecodeShare {
                pod_id,
                decode_tokens,
                running,
            })
            .collect(),
        replicas,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(pod_id: u64, decode_tokens: f64, running: u32) -> DecodeShare {
        DecodeShare {
            pod_id,
            decode_tokens,
            running,
        }
    }

    fn report(replica: u64, shares: Vec<DecodeShare>) -> Vec<u8> {
        ReplicaReport { replica, shares }.encode_to_vec()
    }

    #[test]
    fn sums_per_pod_and_drops_empty_or_invalid_values() {
        let a = vec![share(1, 100.0, 1), share(2, 0.0, 0)];
        let b = vec![share(1, 50.0, 2), share(3, f64::NAN, 1)];
        let s = sum([a.as_slice(), b.as_slice()].into_iter());
        assert_eq!(s.replicas, 2);
        assert_eq!(s.shares, vec![share(1, 150.0, 3), share(3, 0.0, 1)]);
    }

    #[tokio::test]
    async fn each_replica_sees_only_the_others() {
        let book = ReplicaBook::new(Duration::from_secs(5), None).unwrap();
        let first = book
            .report(&report(7, vec![share(1, 10.0, 1)]))
            .await
            .unwrap();
        assert_eq!((first.replicas, first.shares.len()), (0, 0));
        let second = book
            .report(&report(8, vec![share(1, 5.0, 1), share(2, 3.0, 1)]))
            .await
            .unwrap();
        assert_eq!(second.shares, vec![share(1, 10.0, 1)]);
        let again = book
            .report(&report(7, vec![share(1, 12.0, 2)]))
            .await
            .unwrap();
        assert_eq!(again.shares, vec![share(1, 5.0, 1), share(2, 3.0, 1)]);
        assert_eq!(book.live_local(), 2);
    }

    #[tokio::test]
    async fn a_silent_replica_drops_out_after_the_ttl() {
        let book = ReplicaBook::new(Duration::from_millis(50), None).unwrap();
        let t0 = Instant::now();
        book.report_at(&report(1, vec![share(9, 100.0, 1)]), t0)
            .await
            .unwrap();
        let at_ttl = t0 + Duration::from_millis(50);
        let seen = book.report_at(&report(2, vec![]), at_ttl).await.unwrap();
        assert_eq!(
            seen.shares,
            vec![share(9, 100.0, 1)],
            "still live at the TTL"
        );
        // Replica 1 stays silent past its TTL.
        let past = t0 + Duration::from_millis(51);
        let later = book.report_at(&report(2, vec![]), past).await.unwrap();
        assert!(later.shares.is_empty(), "{later:?}");
    }

    #[tokio::test]
    async fn bad_reports_are_refused() {
        let book = ReplicaBook::new(Duration::from_secs(1), None).unwrap();
        assert!(matches!(
            book.report(b"\xff\xff\xff").await,
            Err(ReplicaError::Decode(_))
        ));
        assert!(matches!(
            book.report(&report(0, vec![])).await,
            Err(ReplicaError::NoReplica)
        ));
    }

    #[test]
    fn maximal_shares_sum_to_a_finite_value() {
        let a = vec![share(1, f64::MAX, 1)];
        let b = vec![share(1, f64::MAX, 1)];
        let s = sum([a.as_slice(), b.as_slice()].into_iter());
        assert_eq!(s.shares.len(), 1, "{s:?}");
        assert!(s.shares[0].decode_tokens.is_finite(), "{s:?}");
        assert_eq!(s.shares[0].decode_tokens, MAX_DECODE_TOKENS);
    }

    #[tokio::test]
    async fn fresh_replica_ids_are_bounded_while_old_ones_live() {
        let book = ReplicaBook::new(Duration::from_secs(5), None).unwrap();
        let t0 = Instant::now();
        let mut refused = 0;
        for id in 1..=10_000u64 {
            match book
                .report_at(&report(id, vec![share(1, 1.0, 1)]), t0)
                .await
            {
                Ok(_) => {}
                Err(ReplicaError::TooManyReplicas) => refused += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(book.live_local(), MAX_REPLICAS);
        assert_eq!(refused, 10_000 - MAX_REPLICAS);
        // A live replica keeps reporting; once the old ids expire, new ones get in.
        let known = book.report_at(&report(1, vec![]), t0).await.unwrap();
        assert_eq!(known.replicas as usize, MAX_REPLICAS - 1);
        let later = t0 + Duration::from_secs(6);
        assert!(book.report_at(&report(20_000, vec![]), later).await.is_ok());
        assert_eq!(book.live_local(), 1);
    }

    #[tokio::test]
    async fn a_report_of_too_many_shares_is_refused() {
        let book = ReplicaBook::new(Duration::from_secs(5), None).unwrap();
        let shares = (0..=MAX_SHARES as u64).map(|p| share(p, 1.0, 1)).collect();
        assert!(matches!(
            book.report(&report(1, shares)).await,
            Err(ReplicaError::TooManyShares(n)) if n == MAX_SHARES + 1
        ));
        assert_eq!(book.live_local(), 0);
        let shares = (0..MAX_SHARES as u64).map(|p| share(p, 1.0, 1)).collect();
        assert!(book.report(&report(1, shares)).await.is_ok());
    }
}
