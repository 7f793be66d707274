//! The leader-election flags.

use std::time::Duration;

use crate::config::parse_positive_duration;

/// Several pd-control replicas, one serving: they hold a Kubernetes Lease in turn, and the one
/// holding it labels its own pod so the Service, which selects that label, sends it the
/// gateways' traffic (docs/OPERATOR.md "Several pd-control replicas").
#[derive(Debug, Clone, clap::Args)]
pub struct LeaderArgs {
    /// Take part in leader election (Kubernetes source only). Every replica watches the fleet
    /// and scrapes; only the leader's pod carries `pd-router.io/pd-control-leader: "true"`.
    #[arg(long = "leader-elect")]
    pub elect: bool,

    /// The Lease (coordination.k8s.io/v1) the replicas contend for.
    #[arg(
        long = "leader-elect-lease",
        value_name = "NAME",
        default_value = "pd-control"
    )]
    pub lease: String,

    /// Namespace of the Lease and of this replica's pod (the downward API's
    /// `metadata.namespace`).
    #[arg(
        long = "leader-elect-namespace",
        value_name = "NS",
        env = "POD_NAMESPACE"
    )]
    pub namespace: Option<String>,

    /// This replica's pod name (the downward API's `metadata.name`): the holder named in the
    /// Lease and the pod whose label says who leads.
    #[arg(long = "leader-elect-identity", value_name = "POD", env = "POD_NAME")]
    pub identity: Option<String>,

    /// How long a holder's renewal keeps the Lease its own; a standby takes it over once it
    /// has seen no renewal for this long. A leader that cannot renew keeps serving until it
    /// reads the Lease held by another (no renew deadline: see the module's docs).
    #[arg(long = "leader-elect-lease-duration", value_name = "DURATION", default_value = "15s", value_parser = parse_positive_duration)]
    pub lease_duration: Duration,

    /// How often the Lease is read and renewed (or a takeover tried).
    #[arg(long = "leader-elect-retry-period", value_name = "DURATION", default_value = "2s", value_parser = parse_positive_duration)]
    pub retry_period: Duration,
}

impl Default for LeaderArgs {
    fn default() -> LeaderArgs {
        LeaderArgs {
            elect: false,
            lease: "pd-control".into(),
            namespace: None,
            identity: None,
            lease_duration: Duration::from_secs(15),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// Leader-election settings that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaderConfigError {
    #[error("--leader-elect needs the kubernetes source")]
    NotKubernetes,
    #[error("--leader-elect needs {0}")]
    Missing(&'static str),
    #[error(
        "leader election needs --leader-elect-lease-duration >= 3 x --leader-elect-retry-period \
         (a standby must see a renewal within the duration: renewals come up to 1.2 retry \
         periods apart, and a standby reads one retry period late at worst)"
    )]
    Timings,
}

impl LeaderArgs {
    /// Checks the flags given `kubernetes` (whether the source is the Kubernetes one).
    pub fn validate(&self, kubernetes: bool) -> Result<(), LeaderConfigError> {
        if !self.elect {
            return Ok(());
        }
        if !kubernetes {
            return Err(LeaderConfigError::NotKubernetes);
        }
        let named = |v: &Option<String>| v.as_deref().is_some_and(|s| !s.is_empty());
        if !named(&self.namespace) {
            return Err(LeaderConfigError::Missing(
                "--leader-elect-namespace (or POD_NAMESPACE)",
            ));
        }
        if !named(&self.identity) {
            return Err(LeaderConfigError::Missing(
                "--leader-elect-identity (or POD_NAME)",
            ));
        }
        if self.lease.is_empty() {
            return Err(LeaderConfigError::Missing("a --leader-elect-lease name"));
        }
        if self.retry_period.saturating_mul(3) > self.lease_duration {
            return Err(LeaderConfigError::Timings);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> LeaderArgs {
        LeaderArgs {
            elect: true,
            namespace: Some("pd-router".into()),
            identity: Some("pd-control-0".into()),
            ..LeaderArgs::default()
        }
    }

    #[test]
    fn election_needs_kubernetes_a_pod_and_ordered_timings() {
        assert_eq!(LeaderArgs::default().validate(false), Ok(()));
        assert_eq!(on().validate(true), Ok(()));
        assert_eq!(on().validate(false), Err(LeaderConfigError::NotKubernetes));
        let mut a = on();
        a.identity = Some(String::new());
        assert!(matches!(
            a.validate(true),
            Err(LeaderConfigError::Missing(_))
        ));
        let mut a = on();
        a.namespace = None;
        assert!(matches!(
            a.validate(true),
            Err(LeaderConfigError::Missing(_))
        ));
        let mut a = on();
        a.retry_period = a.lease_duration;
        assert_eq!(a.validate(true), Err(LeaderConfigError::Timings));
        a.retry_period = Duration::from_secs(5);
        assert_eq!(a.validate(true), Ok(()), "15 s is three 5 s periods");
        a.retry_period = Duration::from_millis(5001);
        assert_eq!(a.validate(true), Err(LeaderConfigError::Timings));
    }
}
