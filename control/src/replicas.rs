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
const REPORT_SCRIPT: &str = r"
local index, prefix = KEYS[1], ARGV[1]
local id, payload, ttl = ARGV[2], ARGV[3], tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', prefix .. id, payload, 'PX', ttl)
redis.call('ZADD', index, now + ttl, id)
redis.call('ZREMRANGEBYSCORE', index, '-inf', now)
local out = {}
for _, other in ipairs(redis.call('ZRANGE', index, 0, -1)) do
  if other ~= id then
    local v = redis.call('GET', prefix .. other)
    if v then table.insert(out, v) end
  end
end
return out
";

#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("replica report does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("replica report without a replica id")]
    NoReplica,
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
        self.reports_total.fetch_add(1, Ordering::Relaxed);
        let local_others = self.record_local(&report, now);
        let Some(redis) = &self.redis else {
            return Ok(sum(local_others.iter().map(Vec::as_slice)));
        };
        match redis.exchange(&report, body, self.ttl).await {
            Ok(others) => {
                if !self.redis_up.swap(true, Ordering::Relaxed) {
                    tracing::info!("redis: replica shares shared through redis");
                }
                let decoded: Vec<Vec<DecodeShare>> = others
                    .iter()
                    .filter_map(|bytes| ReplicaReport::decode(bytes.as_slice()).ok())
                    .filter(|r| r.replica != report.replica)
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
                Ok(sum(local_others.iter().map(Vec::as_slice)))
            }
        }
    }

    /// Stores the report locally and returns the other live replicas' shares.
    fn record_local(&self, report: &ReplicaReport, now: Instant) -> Vec<Vec<DecodeShare>> {
        let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        local.insert(report.replica, (now, report.shares.clone()));
        let ttl = self.ttl;
        local.retain(|_, (seen, _)| now.duration_since(*seen) <= ttl);
        local
            .iter()
            .filter(|(id, _)| **id != report.replica)
            .map(|(_, (_, shares))| shares.clone())
            .collect()
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

impl RedisShares {
    /// One scripted round trip. Repeating a report is harmless (it overwrites itself), so a
    /// connection broken since the last report (Redis restarted) is replaced and the call
    /// retried once, and a recovered Redis is used at once.
    async fn exchange(
        &self,
        report: &ReplicaReport,
        body: &[u8],
        ttl: Duration,
    ) -> Result<Vec<Vec<u8>>, LinkError> {
        let ttl_ms = ttl.as_millis().max(1) as u64;
        let index = format!("{}index", self.prefix);
        let id = format!("{:016x}", report.replica);
        self.link
            .call(Retry::OnceOnStaleConnection, |mut conn| {
                let mut invocation = self.script.key(&index);
                invocation.arg(&self.prefix).arg(&id).arg(body).arg(ttl_ms);
                async move { invocation.invoke_async::<Vec<Vec<u8>>>(&mut conn).await }
            })
            .await
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
                e.0 += s.decode_tokens;
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
}
