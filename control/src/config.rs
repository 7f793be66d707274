//! Command line and runtime settings.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// Everything `pd-control` needs to run; built by clap in the binary and by hand in tests.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pd-control",
    version,
    about = "Watches the pd-router fleet, scrapes engine metrics and serves versioned snapshots"
)]
pub struct Config {
    /// Fleet file: `kubectl get pods -o yaml` output (a List/PodList or a stream of Pods).
    #[arg(long, value_name = "FILE")]
    pub fleet: PathBuf,

    /// Address to serve the snapshot API on (port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    pub listen: SocketAddr,

    /// How often the fleet file is re-read and every pod is scraped.
    #[arg(long, value_name = "DURATION", default_value = "50ms", value_parser = parse_positive_duration)]
    pub refresh_interval: Duration,

    /// Bound on one pod's `/metrics` request, so a hung engine cannot hold a scrape slot forever.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_positive_duration)]
    pub scrape_timeout: Duration,

    /// Scrapes allowed in flight at once across the whole fleet.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub scrape_concurrency: u32,

    /// Metrics older than this many refresh intervals are flagged stale.
    #[arg(long, value_name = "INTERVALS", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub stale_after: u32,
}

/// Settings that clap would have rejected, caught again for configs built in code.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
}

impl Config {
    /// A config with the CLI defaults, for embedding and tests.
    pub fn new(fleet: impl Into<PathBuf>, listen: SocketAddr) -> Config {
        Config {
            fleet: fleet.into(),
            listen,
            refresh_interval: Duration::from_millis(50),
            scrape_timeout: Duration::from_secs(1),
            scrape_concurrency: 64,
            stale_after: 3,
        }
    }

    /// Zero values would make tokio's interval panic or the semaphore starve every scrape.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.refresh_interval.is_zero() {
            return Err(ConfigError::Zero("--refresh-interval"));
        }
        if self.scrape_timeout.is_zero() {
            return Err(ConfigError::Zero("--scrape-timeout"));
        }
        if self.scrape_concurrency == 0 {
            return Err(ConfigError::Zero("--scrape-concurrency"));
        }
        if self.stale_after == 0 {
            return Err(ConfigError::Zero("--stale-after"));
        }
        Ok(())
    }

    /// Age beyond which a pod's metrics no longer describe its current load.
    pub fn stale_bound(&self) -> Duration {
        self.refresh_interval.saturating_mul(self.stale_after)
    }
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

fn parse_positive_duration(text: &str) -> Result<Duration, String> {
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
}
