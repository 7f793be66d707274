//! How many VMs of this Envoy route on the newest fleet snapshot.
//!
//! The lease holder publishes a snapshot and the other VMs adopt it when their queue notice
//! or timer fires, so for a moment workers route on different snapshots. Operators (and
//! tests that change the fleet, then assert where requests go) need to see when every
//! worker has caught up: `pd_router_fleet_version` alone is whichever VM wrote it last.
//! Each adoption is tallied in one shared record, reset whenever a newer version arrives.

/// Whether a snapshot pd-control answered (`fetched`) replaces the `published` one, given the
/// version the poll named (`polled_with`). A newer version always does. An older one does
/// only when the poll named the published version: pd-control answers at once with its own
/// snapshot when that is not the version named, so its current one is `fetched`, and it was
/// restarted on a clock behind the last (or another replica answered). Without this a
/// gateway would keep routing on the old pods until pd-control's clock passed the version it
/// last adopted (unbounded after a clock far ahead), polling a full snapshot every tick. An
/// older answer to a poll that named an older version still loses: two fetchers overlapped
/// while the lease changed hands, and the newer publication stands.
pub fn supersedes(published: u64, polled_with: u64, fetched: u64) -> bool {
    fetched > published || (fetched != published && polled_with == published)
}

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
    /// The tally after one VM adopted `version` while `published` is the process's snapshot.
    /// The published version is the newest by definition (it may be numerically older, see
    /// [`supersedes`]): an adoption of it starts a new count or adds to its count; one of any
    /// other version leaves the tally alone (that VM is behind and will adopt again).
    pub fn adopted(self, version: u64, published: u64) -> Tally {
        if version != published {
            return self;
        }
        if version == self.version {
            Tally {
                version,
                vms: self.vms.saturating_add(1),
            }
        } else {
            Tally { version, vms: 1 }
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
    fn adoptions_count_per_published_version_and_reset_on_another() {
        // (adopted, published, tally after)
        let steps: [(u64, u64, Tally); 8] = [
            (5, 5, Tally { version: 5, vms: 1 }),
            (5, 5, Tally { version: 5, vms: 2 }),
            (4, 5, Tally { version: 5, vms: 2 }),
            (5, 5, Tally { version: 5, vms: 3 }),
            (5, 7, Tally { version: 5, vms: 3 }),
            (7, 7, Tally { version: 7, vms: 1 }),
            (7, 7, Tally { version: 7, vms: 2 }),
            // pd-control restarted behind: the older published version counts from one.
            (3, 3, Tally { version: 3, vms: 1 }),
        ];
        let mut tally = Tally::default();
        for (version, published, expected) in steps {
            tally = tally.adopted(version, published);
            assert_eq!(tally, expected, "after adopting {version} of {published}");
        }
    }

    #[test]
    fn a_snapshot_supersedes_the_published_one_when_newer_or_pd_controls_own() {
        // (published, polled with, fetched, replaces)
        let cases = [
            (5, 5, 6, true),
            (5, 3, 6, true),
            (5, 5, 5, false),
            // pd-control answered a poll for 5 with 3: 3 is what it holds now.
            (5, 5, 3, true),
            (u64::MAX / 2, u64::MAX / 2, 1_700_000_000_000, true),
            // A poll for 3 answered 4 after another fetcher published 5: 5 stands.
            (5, 3, 4, false),
            (5, 3, 5, false),
            (0, 0, 1, true),
        ];
        for (published, polled, fetched, replaces) in cases {
            assert_eq!(
                supersedes(published, polled, fetched),
                replaces,
                "({published}, {polled}, {fetched})"
            );
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
        assert_eq!(t.adopted(1, 1).vms, u32::MAX);
    }
}
