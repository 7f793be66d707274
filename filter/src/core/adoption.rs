//! How many VMs of this Envoy route on the newest fleet snapshot.
//!
//! The lease holder publishes a snapshot and the other VMs adopt it when their queue notice
//! or timer fires, so for a moment workers route on different snapshots. Operators (and
//! tests that change the fleet, then assert where requests go) need to see when every
//! worker has caught up: `pd_router_fleet_version` alone is whichever VM wrote it last.
//! Each adoption is tallied in one shared record, reset whenever a newer version arrives.

/// `version` (8 bytes LE) then `vms` (4 bytes LE).
pub const ENCODED_LEN: usize = 12;

/// Adoptions of the newest snapshot version seen by any VM of this process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub version: u64,
    /// VMs that adopted `version` (a VM replaced by a reload counts again).
    pub vms: u32,
}

impl Tally {
    /// The tally after one VM adopted `version`. An adoption of an older version than the
    /// tallied one leaves it alone: that VM is already behind and will adopt again.
    pub fn adopted(self, version: u64) -> Tally {
        match version.cmp(&self.version) {
            std::cmp::Ordering::Greater => Tally { version, vms: 1 },
            std::cmp::Ordering::Equal => Tally {
                version,
                vms: self.vms.saturating_add(1),
            },
            std::cmp::Ordering::Less => self,
        }
    }

    pub fn encode(self) -> [u8; ENCODED_LEN] {
        let mut out = [0; ENCODED_LEN];
        out[..8].copy_from_slice(&self.version.to_le_bytes());
        out[8..].copy_from_slice(&self.vms.to_le_bytes());
        out
    }

    /// `None` for anything but [`ENCODED_LEN`] bytes (a fresh process has no record).
    pub fn decode(bytes: &[u8]) -> Option<Tally> {
        let bytes: &[u8; ENCODED_LEN] = bytes.try_into().ok()?;
        let (version, vms) = bytes.split_at(8);
        Some(Tally {
            version: u64::from_le_bytes(version.try_into().ok()?),
            vms: u32::from_le_bytes(vms.try_into().ok()?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adoptions_count_per_version_and_reset_on_a_newer_one() {
        let steps: [(u64, Tally); 6] = [
            (5, Tally { version: 5, vms: 1 }),
            (5, Tally { version: 5, vms: 2 }),
            (4, Tally { version: 5, vms: 2 }),
            (5, Tally { version: 5, vms: 3 }),
            (7, Tally { version: 7, vms: 1 }),
            (7, Tally { version: 7, vms: 2 }),
        ];
        let mut tally = Tally::default();
        for (version, expected) in steps {
            tally = tally.adopted(version);
            assert_eq!(tally, expected, "after adopting {version}");
        }
    }

    #[test]
    fn round_trips_and_rejects_other_lengths() {
        let t = Tally {
            version: u64::MAX - 3,
            vms: 9,
        };
        assert_eq!(Tally::decode(&t.encode()), Some(t));
        assert_eq!(Tally::decode(&t.encode()[..11]), None);
        assert_eq!(Tally::decode(&[0; 13]), None);
        assert_eq!(Tally::decode(&[]), None);
    }

    #[test]
    fn the_count_saturates() {
        let t = Tally {
            version: 1,
            vms: u32::MAX,
        };
        assert_eq!(t.adopted(1).vms, u32::MAX);
    }
}
