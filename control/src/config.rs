//! Command line and runtime settings.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, ValueEnum};

use crate::snapshot::LabelPolicy;

/// AIBrix's name for the engine scrape period: integer milliseconds, set on the gateway
/// deployment. pd-control does the scraping here, so it reads the variable an operator
/// moving from AIBrix already sets.
pub const REFRESH_INTERVAL_ENV: &str = "AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS";

/// AIBrix's switch for its per-user limits: `true` (or `1`, `yes`, any case) turns them off
/// here too, so an operator moving from AIBrix keeps the setting they had.
pub const DISABLE_RATE_LIMIT_ENV: &str = "AIBRIX_DISABLE_RATE_LIMIT";

/// AIBrix's switch for its user store: `true` checks every named user against the default
/// limits (100 requests and 100 000 tokens a minute) without reading a record, so no user is
/// unknown.
pub const DISABLE_USER_STORE_ENV: &str = "AIBRIX_DISABLE_REDIS_USER_STORE";

/// Where the fleet comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SourceKind {
    /// Re-read a fleet file (`--fleet`).
    File,
    /// Watch Pods labelled `model.aibrix.ai/name` through the Kubernetes API.
    Kubernetes,
}

/// Everything `pd-control` needs to run; built by clap in the binary and by hand in tests.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pd-control",
    version,
    about = "Watches the pd-router fleet, scrapes engine metrics and serves versioned snapshots"
)]
pub struct Config {
    /// Fleet source. Defaults to `file`; `--fleet` implies it.
    ///
    /// `kubernetes` watches Pods carrying the label `model.aibrix.ai/name` (a watch can only
    /// filter on labels, so pods naming their model only in an annotation are not seen), using
    /// the in-cluster service account or kubeconfig (KUBECONFIG, ~/.kube/config), or
    /// `--kube-api-url`.
    #[arg(long, value_enum, value_name = "SOURCE")]
    pub source: Option<SourceKind>,

    /// Fleet file: `kubectl get pods -o yaml` output (a List/PodList or a stream of Pods).
    /// Required by the file source.
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "source",
        required_if_eq("source", "file")
    )]
    pub fleet: Option<PathBuf>,

    /// Kubernetes: watch only this namespace (repeatable). Default: all namespaces.
    #[arg(long = "namespace", value_name = "NS")]
    pub namespaces: Vec<String>,

    /// Kubernetes: API server URL instead of in-cluster/kubeconfig discovery, without
    /// authentication (plain `http://` allowed), e.g. `kubectl proxy` or a test server.
    #[arg(long, value_name = "URL")]
    pub kube_api_url: Option<String>,

    /// Kubernetes: how long start-up retries a failing first pod list (an API server being
    /// upgraded, priority-and-fairness 429s) before giving up; 401, 403 and 404 answers fail at
    /// once, and 0 fails on the first error.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub kube_startup_timeout: Duration,

    /// Address to serve the snapshot API on (port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    pub listen: SocketAddr,

    /// How often every pod is scraped (and the fleet file re-read; the Kubernetes source is
    /// event-driven). Without this flag, `AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS` (integer
    /// milliseconds) applies when set to a positive integer.
    #[arg(long, value_name = "DURATION", default_value = "50ms", value_parser = parse_positive_duration)]
    pub refresh_interval: Duration,

    /// Bound on one pod's `/metrics` request, so a hung engine cannot hold a scrape slot forever.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_positive_duration)]
    pub scrape_timeout: Duration,

    /// Scrapes allowed in flight at once across the whole fleet; pods whose last scrape got
    /// no answer (no connection, or none in time) have as many again of their own, so dead
    /// pods never queue live pods' scrapes.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub scrape_concurrency: u32,

    /// A pod that answered a scrape before (or of whose model another pod has) and whose
    /// engine refuses this many scrape connections in a row (refused, no route, or no answer to the connection attempt within
    /// half `--scrape-timeout`) is marked unreachable in the snapshot: the gateway routes
    /// around it at once, on every worker and replica, well before Kubernetes marks it unready
    /// (or, with a fleet file, ever does). Its first answered scrape clears the mark. `0`
    /// turns the check off.
    #[arg(long, value_name = "SCRAPES", default_value_t = 3)]
    pub unreachable_after: u32,

    /// A pod whose engine holds running requests while no token or request counter moves
    /// (without counters: no throughput gauge is above zero; for SGLang, which counts at a
    /// request's end, no KV-usage or throughput gauge either) for this long (SGLang: at least
    /// 35 s, its idle refresh; TensorRT-LLM pods are not judged this way) is marked stalled in
    /// the snapshot (a
    /// hung GPU usually leaves the HTTP server answering): the gateway routes around it until
    /// its counters move again. So is a pod whose scrapes all time out on an accepted
    /// connection for this long, three at least (a wedged server), until one is answered. `0s` turns both
    /// checks off.
    #[arg(long, value_name = "DURATION", default_value = "15s", value_parser = parse_duration)]
    pub stalled_after: Duration,

    /// Metrics older than this many refresh intervals are flagged stale.
    #[arg(long, value_name = "INTERVALS", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub stale_after: u32,

    /// Several gateway replicas: a replica whose decode-ledger report is older than this
    /// drops out of the others' shares (a killed gateway stops counting).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_positive_duration)]
    pub replica_ttl: Duration,

    /// Keep replica shares in Redis (`redis://host:port/db`) so every pd-control replica
    /// serves every gateway; without it they are kept in memory, per pd-control.
    #[arg(long, value_name = "URL")]
    pub redis: Option<String>,

    /// Do not check per-user request and token limits even with `--redis` (as
    /// `AIBRIX_DISABLE_RATE_LIMIT=true` does): `/v1/limits/admit` answers `disabled` and the
    /// snapshot tells gateways not to ask. With `--redis` and without this, users' limits are
    /// read from AIBrix's user records in that Redis.
    #[arg(long)]
    pub no_user_limits: bool,

    /// Set by [`Config::try_parse_with_env`] when `AIBRIX_DISABLE_RATE_LIMIT` turns the
    /// limits off.
    #[arg(skip)]
    pub user_limits_off_by_env: bool,
    /// Set by [`Config::try_parse_with_env`] from `AIBRIX_DISABLE_REDIS_USER_STORE`: users
    /// get the default limits, no record is read.
    #[arg(skip)]
    pub user_records_off_by_env: bool,

    /// File holding a shared token: `/v1/snapshot`, `/v1/snapshot.json`,
    /// `/v1/replicas/report` and `/v1/limits/*` then answer 401 unless the request carries
    /// `authorization: Bearer <token>` (the filter's `snapshot_token`). Surrounding
    /// whitespace is ignored; read once at start. Health and `/metrics` stay open.
    #[arg(long, value_name = "FILE", env = "PD_CONTROL_SNAPSHOT_TOKEN_FILE")]
    pub snapshot_token_file: Option<PathBuf>,

    /// Pod labels the snapshot carries for the gateway's `external-filter` selectors: `all`,
    /// `none`, or a comma-separated list of keys. A selector sees only these, so with `none`
    /// every `external-filter` that asks for a label matches no pod. Labels are the largest
    /// part of a big fleet's snapshot (1000 pods with the demo fleet's five labels: 134 KB
    /// without, 279 KB with), which every gateway VM reads at each refresh.
    #[arg(long, value_name = "all|none|KEY,...", default_value = "all", value_parser = LabelPolicy::parse)]
    pub pod_labels: LabelPolicy,

    /// Also write every pod's address (`ip:port`, ready or not) as an Envoy endpoint file
    /// for the gateway's retrying cluster (`pd_pods_retry` of `envoy/envoy.yaml.tmpl`, read
    /// through a path config source). Envoy retries a request whose chosen pod refuses the
    /// connection only on a host that cluster knows; snapshots then tell the gateways they may
    /// name a stand-in pod. Rewritten by rename when the set changes, before the snapshot
    /// naming a new pod is served; a pod that left stays in it for 30 s.
    #[arg(long, value_name = "FILE")]
    pub eds_file: Option<PathBuf>,

    /// The cluster name written into `--eds-file` and served on `--xds-listen`.
    #[arg(long, value_name = "NAME", default_value = crate::eds::DEFAULT_CLUSTER)]
    pub eds_cluster: String,

    /// Also serve that endpoint listing as a gRPC EDS service (Envoy's
    /// `EndpointDiscoveryService`, state of the world) on this address, for gateways that
    /// cannot read `--eds-file` (an Istio ingress gateway runs in another pod). Guarded by
    /// `--snapshot-token-file` like the snapshot. Snapshots then tell the gateways they may
    /// name a stand-in pod, as with `--eds-file`.
    #[arg(long, value_name = "ADDR")]
    pub xds_listen: Option<SocketAddr>,

    /// Also serve `/metrics`, `/healthz` and `/readyz` (and nothing else) on this address, so
    /// Prometheus can be let in to them alone: a NetworkPolicy admits ports, not paths, and
    /// the main listener also serves the snapshot, limits and replica APIs.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,

    /// The `external` strategy's replica-selection service (AIBrix's
    /// `AIBRIX_EXTERNAL_ROUTER_*`, each also a flag).
    #[command(flatten)]
    pub external: crate::external::config::ExternalArgs,

    /// Several replicas, one serving (`--leader-elect` and its settings).
    #[command(flatten)]
    pub leader: crate::leader::config::LeaderArgs,

    /// How the HTTP listeners (`--listen`, `--metrics-listen`) bound what a client can hold.
    /// Not flags: the defaults suit any deployment; tests shorten them.
    #[arg(skip = HttpLimits::default())]
    pub http_limits: HttpLimits,
}

/// What one client can hold on an HTTP listener: auth runs only once a request's headers are
/// in, so without these, connections that never finish a request (or never send one) would
/// each keep a task and buffers for ever, until the pod's memory or file descriptors run out
/// and its probes, on the same port, fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// How long a connection may take to send a request's headers, counted from its opening
    /// (or from the previous answer on a kept-alive connection); it is closed past that. A
    /// request being answered is not timed: a snapshot poll held for its wait is unaffected.
    pub header_read_timeout: Duration,
    /// Open connections per listener; past it, a new connection is closed at once (logged).
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> HttpLimits {
        HttpLimits {
            header_read_timeout: Duration::from_secs(10),
            max_connections: 10_000,
        }
    }
}

/// Settings that clap would have rejected, caught again for configs built in code.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    #[error("the file source needs --fleet FILE")]
    MissingFleet,
    #[error("invalid --redis URL: {0}")]
    Redis(String),
    #[error("{0} does not apply to the {1} source")]
    NotForSource(&'static str, &'static str),
    #[error(transparent)]
    Leader(#[from] crate::leader::config::LeaderConfigError),
}

/// Whether per-user limits are checked, and if not, why (for the start-up log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UserLimitsSetting {
    On,
    NoRedis,
    OffByFlag,
    OffByEnv,
}

impl std::fmt::Display for UserLimitsSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            UserLimitsSetting::On => "on (user records and counters in --redis)",
            UserLimitsSetting::NoRedis => "off (no --redis)",
            UserLimitsSetting::OffByFlag => "off (--no-user-limits)",
            UserLimitsSetting::OffByEnv => "off (AIBRIX_DISABLE_RATE_LIMIT)",
        })
    }
}

impl Config {
    /// Parses `args` like [`Parser::try_parse_from`], then applies
    /// [`REFRESH_INTERVAL_ENV`] (read through `env`) unless `--refresh-interval` was given.
    /// Like AIBrix's loader, a value that is not a positive integer keeps the default; the
    /// returned warnings say so, for the caller to log once logging is up.
    pub fn try_parse_with_env<I, T>(
        args: I,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(Config, Vec<String>), clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = Config::command().try_get_matches_from(args)?;
        let mut config = Config::from_arg_matches(&matches)?;
        let mut warnings = Vec::new();
        let from_flag = matches.value_source("refresh_interval") == Some(ValueSource::CommandLine);
        if let (false, Some(raw)) = (from_flag, env(REFRESH_INTERVAL_ENV)) {
            match refresh_interval_from_env(&raw) {
                Ok(interval) => config.refresh_interval = interval,
                Err(why) => warnings.push(format!(
                    "{REFRESH_INTERVAL_ENV}={raw:?} ignored ({why}); scraping every {:?}",
                    config.refresh_interval
                )),
            }
        }
        config.user_limits_off_by_env = env(DISABLE_RATE_LIMIT_ENV)
            .as_deref()
            .is_some_and(env_flag_on);
        config.user_records_off_by_env = env(DISABLE_USER_STORE_ENV)
            .as_deref()
            .is_some_and(env_flag_on);
        Ok((config, warnings))
    }

    /// A config with the CLI defaults, for embedding and tests.
    pub fn new(fleet: impl Into<PathBuf>, listen: SocketAddr) -> Config {
        Config {
            source: None,
            fleet: Some(fleet.into()),
            namespaces: Vec::new(),
            kube_api_url: None,
            kube_startup_timeout: Duration::from_secs(60),
            listen,
            refresh_interval: Duration::from_millis(50),
            scrape_timeout: Duration::from_secs(1),
            scrape_concurrency: 64,
            stale_after: 3,
            unreachable_after: 3,
            stalled_after: Duration::from_secs(15),
            replica_ttl: Duration::from_secs(5),
            redis: None,
            no_user_limits: false,
            user_limits_off_by_env: false,
            user_records_off_by_env: false,
            snapshot_token_file: None,
            pod_labels: LabelPolicy::All,
            eds_file: None,
            eds_cluster: crate::eds::DEFAULT_CLUSTER.into(),
            xds_listen: None,
            metrics_listen: None,
            external: Default::default(),
            leader: Default::default(),
            http_limits: HttpLimits::default(),
        }
    }

    /// A Kubernetes-sourced config with the CLI defaults; `api_url` `None` infers the cluster.
    pub fn kubernetes(api_url: Option<String>, listen: SocketAddr) -> Config {
        Config {
            source: Some(SourceKind::Kubernetes),
            fleet: None,
            kube_api_url: api_url,
            ..Config::new(PathBuf::new(), listen)
        }
    }

    /// The source in force: `--source`, else the file source (`--fleet` implies it).
    pub fn source_kind(&self) -> SourceKind {
        self.source.unwrap_or(SourceKind::File)
    }

    /// Zero values would make tokio's interval panic or the semaphore starve every scrape;
    /// options of the other source are rejected rather than silently ignored.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self.source_kind() {
            SourceKind::File => {
                if self.fleet.is_none() {
                    return Err(ConfigError::MissingFleet);
                }
                if !self.namespaces.is_empty() {
                    return Err(ConfigError::NotForSource("--namespace", "file"));
                }
                if self.kube_api_url.is_some() {
                    return Err(ConfigError::NotForSource("--kube-api-url", "file"));
                }
            }
            SourceKind::Kubernetes => {
                if self.fleet.is_some() {
                    return Err(ConfigError::NotForSource("--fleet", "kubernetes"));
                }
            }
        }
        if self.refresh_interval.is_zero() {
            return Err(ConfigError::Zero("--refresh-interval"));
        }
        if self.scrape_timeout.is_zero() {
            return Err(ConfigError::Zero("--scrape-timeout"));
        }
        // A zero timeout would close every connection before its first request; no slot
        // would refuse them all.
        if self.http_limits.header_read_timeout.is_zero() {
            return Err(ConfigError::Zero("the HTTP header read timeout"));
        }
        if self.http_limits.max_connections == 0 {
            return Err(ConfigError::Zero("the HTTP connection cap"));
        }
        if self.scrape_concurrency == 0 {
            return Err(ConfigError::Zero("--scrape-concurrency"));
        }
        if self.stale_after == 0 {
            return Err(ConfigError::Zero("--stale-after"));
        }
        self.leader
            .validate(self.source_kind() == SourceKind::Kubernetes)?;
        Ok(())
    }

    /// Whether per-user limits are checked: with `--redis`, unless turned off.
    pub fn user_limits(&self) -> UserLimitsSetting {
        if self.redis.is_none() {
            UserLimitsSetting::NoRedis
        } else if self.no_user_limits {
            UserLimitsSetting::OffByFlag
        } else if self.user_limits_off_by_env {
            UserLimitsSetting::OffByEnv
        } else {
            UserLimitsSetting::On
        }
    }

    /// Age beyond which a pod's metrics no longer describe its current load.
    pub fn stale_bound(&self) -> Duration {
        self.refresh_interval.saturating_mul(self.stale_after)
    }
}

/// AIBrix's reading of the scrape-period variable: a positive integer of milliseconds.
pub fn refresh_interval_from_env(raw: &str) -> Result<Duration, String> {
    match raw.trim().parse::<i64>() {
        Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms.unsigned_abs())),
        Ok(_) => Err("not greater than zero".into()),
        Err(_) => Err("not an integer of milliseconds".into()),
    }
}

/// A boolean environment switch: `true`, `1` or `yes` in any case is on, anything else off.
pub fn env_flag_on(raw: &str) -> bool {
    ["true", "1", "yes"]
        .iter()
        .any(|on| raw.trim().eq_ignore_ascii_case(on))
}

/// Parses `50ms`, `1s`, `1.5s`, `2m`, `1h`, `250us`, `10ns`. A unit is mandatory: a bare `50`
/// is ambiguous between the AIBrix millisecond env vars and seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("duration {text:?} needs a unit (ns, us, ms, s, m, h)"))?;
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("duration {text:?} does not start with a number"))?;
    let seconds = match unit.trim() {
        "ns" => value / 1e9,
        "us" | "µs" => value / 1e6,
        "ms" => value / 1e3,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(format!(
                "unknown duration unit {other:?} (use ns, us, ms, s, m, h)"
            ))
        }
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("duration {text:?}: {e}"))
}

pub(crate) fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d.is_zero() {
        return Err("duration must be greater than zero".into());
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("50ms"), Ok(Duration::from_millis(50)));
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert!(parse_duration("50").is_err());
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_positive_duration("0s").is_err());
    }

    #[test]
    fn cli_defaults_and_rejections() {
        let c =
            Config::try_parse_from(["pd-control", "--fleet", "f.yaml", "--listen", "127.0.0.1:0"])
                .unwrap();
        assert_eq!(c.refresh_interval, Duration::from_millis(50));
        assert_eq!(c.scrape_timeout, Duration::from_secs(1));
        assert_eq!((c.scrape_concurrency, c.stale_after), (64, 3));
        assert_eq!(c.stale_bound(), Duration::from_millis(150));
        c.validate().unwrap();
        let bad = [
            "pd-control",
            "--fleet",
            "f",
            "--listen",
            "127.0.0.1:0",
            "--scrape-concurrency",
            "0",
        ];
        assert!(Config::try_parse_from(bad).is_err());
        assert!(Config::try_parse_from(["pd-control", "--listen", "127.0.0.1:0"]).is_err());
        let mut c = Config::new("f", "127.0.0.1:0".parse().unwrap());
        c.refresh_interval = Duration::ZERO;
        assert!(c.validate().is_err());
    }

    #[test]
    fn the_aibrix_scrape_period_variable_applies_unless_the_flag_is_given() {
        let args = ["pd-control", "--fleet", "f", "--listen", "127.0.0.1:0"];
        let env = |value: &'static str| {
            move |name: &str| (name == REFRESH_INTERVAL_ENV).then(|| value.to_string())
        };
        let (c, warnings) = Config::try_parse_with_env(args, env("200")).unwrap();
        assert_eq!(
            (c.refresh_interval, warnings.len()),
            (Duration::from_millis(200), 0)
        );
        let (c, _) = Config::try_parse_with_env(args, |_| None).unwrap();
        assert_eq!(c.refresh_interval, Duration::from_millis(50));
        for bad in ["0", "-5", "fast", "1.5", ""] {
            let (c, warnings) = Config::try_parse_with_env(args, env(bad)).unwrap();
            assert_eq!(c.refresh_interval, Duration::from_millis(50), "{bad:?}");
            assert_eq!(warnings.len(), 1, "{bad:?}");
            assert!(
                warnings[0].contains(REFRESH_INTERVAL_ENV),
                "{}",
                warnings[0]
            );
        }
        let flagged = [&args[..], &["--refresh-interval", "1s"]].concat();
        let (c, warnings) = Config::try_parse_with_env(flagged, env("200")).unwrap();
        assert_eq!(c.refresh_interval, Duration::from_secs(1), "the flag wins");
        assert!(warnings.is_empty());
    }

    #[test]
    fn user_limits_need_redis_and_yield_to_the_flag_and_the_aibrix_variable() {
        let base = ["pd-control", "--fleet", "f", "--listen", "127.0.0.1:0"];
        let redis = [&base[..], &["--redis", "redis://127.0.0.1:6379/0"]].concat();
        let flagged = [&redis[..], &["--no-user-limits"]].concat();
        let env = |value: &'static str| {
            move |name: &str| (name == DISABLE_RATE_LIMIT_ENV).then(|| value.to_string())
        };
        let setting = |args: &[&str], value: &'static str| {
            Config::try_parse_with_env(args, env(value))
                .unwrap()
                .0
                .user_limits()
        };
        assert_eq!(setting(&base, ""), UserLimitsSetting::NoRedis);
        assert_eq!(setting(&base, "true"), UserLimitsSetting::NoRedis);
        assert_eq!(setting(&redis, ""), UserLimitsSetting::On);
        assert_eq!(setting(&flagged, ""), UserLimitsSetting::OffByFlag);
        assert_eq!(setting(&flagged, "true"), UserLimitsSetting::OffByFlag);
        for on in ["true", "TRUE", "True", "1", "yes", "YES", " true "] {
            assert_eq!(setting(&redis, on), UserLimitsSetting::OffByEnv, "{on:?}");
        }
        for off in ["false", "0", "no", "", "on", "disabled", "2"] {
            assert_eq!(setting(&redis, off), UserLimitsSetting::On, "{off:?}");
        }
        let (c, _) = Config::try_parse_with_env(&redis, |_| None).unwrap();
        assert_eq!(c.user_limits(), UserLimitsSetting::On);
        let mut c = Config::new("f", "127.0.0.1:0".parse().unwrap());
        assert_eq!(c.user_limits(), UserLimitsSetting::NoRedis);
        c.redis = Some("redis://127.0.0.1:6379/0".into());
        assert_eq!(c.user_limits(), UserLimitsSetting::On);
    }

    #[test]
    fn source_selection() {
        let parse = |args: &[&str]| {
            let mut all = vec!["pd-control", "--listen", "127.0.0.1:0"];
            all.extend_from_slice(args);
            Config::try_parse_from(all).map_err(|e| e.to_string())
        };
        let c = parse(&["--fleet", "f"]).unwrap();
        assert_eq!(c.source_kind(), SourceKind::File);
        let c = parse(&[
            "--source",
            "kubernetes",
            "--namespace",
            "a",
            "--namespace",
            "b",
            "--kube-api-url",
            "http://127.0.0.1:1",
        ])
        .unwrap();
        assert_eq!(c.source_kind(), SourceKind::Kubernetes);
        assert_eq!(c.namespaces, ["a", "b"]);
        c.validate().unwrap();
        assert!(parse(&["--source", "file"]).is_err(), "file needs --fleet");
        let both = parse(&["--source", "kubernetes", "--fleet", "f"]).unwrap();
        assert!(both.validate().is_err(), "--fleet implies the file source");
        let stray = parse(&["--fleet", "f", "--namespace", "a"]).unwrap();
        assert!(stray.validate().is_err());
        Config::kubernetes(None, "127.0.0.1:0".parse().unwrap())
            .validate()
            .unwrap();
    }
}
