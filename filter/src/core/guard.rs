//! The last check before an address becomes an upstream. Envoy's ORIGINAL_DST cluster sends a
//! request wherever the destination header points, so whatever writes that header decides
//! where traffic goes. Selection only picks pods of the fleet, the client's own destination
//! headers are stripped on arrival, and this check makes the rule explicit at the point of
//! use: every destination header, prefill leg and side call to a pod passes through it, checked
//! against the snapshot the request was routed on (the host keeps it for the request, so a
//! pod that leaves while its prefill runs still receives the decode leg prepared for it).

use crate::core::errors::RouteError;
use crate::core::fleet::FleetView;

/// `Ok` when `address` is a routable pod of `fleet`; [`RouteError::TargetOutsideFleet`]
/// otherwise, including when there is no fleet at all.
pub fn check_target(fleet: Option<&FleetView>, address: &str) -> Result<(), RouteError> {
    match fleet {
        Some(fleet) if fleet.holds_address(address) => Ok(()),
        _ => Err(RouteError::TargetOutsideFleet(address.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::fleet::tests::{pod, snapshot};

    fn fleet() -> FleetView {
        FleetView::from_snapshot(&snapshot(vec![
            pod("p0", "prefill", "g0", true),
            pod("d00", "decode", "g0", true),
            pod("gone", "decode", "g0", false),
        ]))
    }

    #[test]
    fn fleet_pods_pass() {
        let f = fleet();
        for p in &f.models["m"].pods {
            assert_eq!(check_target(Some(&f), &p.address), Ok(()));
        }
    }

    #[test]
    fn anything_else_is_refused_with_a_routing_error() {
        let f = fleet();
        for bad in [
            "127.0.0.4:8000",  // a pod of the snapshot that is not ready
            "127.0.0.2:8001",  // a fleet IP on another port
            "127.0.0.1:15000", // Envoy's own admin, say
            "169.254.169.254:80",
            "127.0.0.2:8000\r\nx-evil: 1",
            " 127.0.0.2:8000",
            "",
        ] {
            let err = check_target(Some(&f), bad).unwrap_err();
            assert_eq!(err, RouteError::TargetOutsideFleet(bad.to_string()));
            assert_eq!(err.status(), 503);
            assert_eq!(err.header(), Some(("x-error-routing", "true".to_string())));
            assert_eq!(err.reason(), "target_outside_fleet");
        }
    }

    #[test]
    fn no_fleet_means_no_target() {
        assert!(check_target(None, "127.0.0.2:8000").is_err());
    }

    #[test]
    fn a_pod_that_left_is_refused_by_the_newer_fleet() {
        let before = fleet();
        let address = before.models["m"].pods[1].address.clone();
        let after = FleetView::from_snapshot(&snapshot(vec![pod("p0", "prefill", "g0", true)]));
        assert_eq!(check_target(Some(&before), &address), Ok(()));
        assert!(check_target(Some(&after), &address).is_err());
    }
}
