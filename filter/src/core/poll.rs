//! When the snapshot lease holder sends its next poll to pd-control.
//!
//! Polls go out on the VM's timer, every `refresh_ms`. With the long poll on, that leaves a
//! gap after each new version: the answer arrives when pd-control publishes, the next poll
//! only at the next tick, and a version published in that gap waits for it. With pd-control
//! and the filter both at 50 ms, snapshots reached the gateway 29 ms after pd-control built
//! them on average. So a poll answered with a new version is followed by the next one at once:
//! the holder is already waiting when the version after that is built (4–7 ms on average,
//! mostly pd-control's own time from building a snapshot to answering).
//!
//! `refresh_ms` still bounds the rate: each tick earns one follow-up (two at most banked), so
//! a pd-control publishing faster than the filter's period, or one whose version changes on
//! every answer, costs at most two polls a period, never a loop of polls. Without the long
//! poll (a wait of 0: pd-control answers at once) the timer alone polls.
//!
//! Pure: the host reports ticks and answers, and sends the poll.

/// Follow-up polls a VM may still send at once, earned by its ticks.
#[derive(Debug, Clone, Default)]
pub struct FollowUps {
    credits: u8,
}

/// Follow-ups banked at most: one spare absorbs the drift between the VM's timer and
/// pd-control's schedule (each slips against the other by a little every period).
const MAX_CREDITS: u8 = 2;

impl FollowUps {
    /// One tick of the VM's timer.
    pub fn tick(&mut self) {
        self.credits = (self.credits + 1).min(MAX_CREDITS);
    }

    /// Whether to poll again right away after an answer that brought a newer version, given
    /// the wait the polls carry; uses up one follow-up when it does.
    pub fn poll_again_now(&mut self, wait_ms: u64) -> bool {
        if wait_ms == 0 || self.credits == 0 {
            return false;
        }
        self.credits -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_tick_earns_one_follow_up_and_two_at_most_are_banked() {
        let mut f = FollowUps::default();
        assert!(!f.poll_again_now(3_000), "nothing earned yet");
        f.tick();
        assert!(f.poll_again_now(3_000));
        assert!(!f.poll_again_now(3_000), "one tick, one follow-up");
        for _ in 0..5 {
            f.tick();
        }
        assert!(f.poll_again_now(3_000) && f.poll_again_now(3_000));
        assert!(!f.poll_again_now(3_000), "at most two banked");
    }

    #[test]
    fn without_the_long_poll_the_timer_alone_polls() {
        let mut f = FollowUps::default();
        f.tick();
        assert!(!f.poll_again_now(0));
        assert!(f.poll_again_now(3_000), "the refusal used nothing up");
    }

    /// What the holder sees over 20 s: pd-control publishing every `publish_ms` (first at
    /// `phase_ms`), the holder ticking every `refresh_ms` plus 1 ms (Envoy re-arms the timer
    /// after each tick, so the ticks drift against pd-control's fixed schedule and meet every
    /// phase of it), a zero-time network. Returns the mean delay from publication to
    /// delivery and the polls sent per second.
    fn run(refresh_ms: u64, publish_ms: u64, phase_ms: u64, follow: bool) -> (f64, f64) {
        const WAIT_MS: u64 = 3_000;
        const END_MS: u64 = 20_000;
        let published = |t: u64| {
            if t < phase_ms {
                0
            } else {
                (t - phase_ms) / publish_ms + 1
            }
        };
        let built_at = |v: u64| phase_ms + (v - 1) * publish_ms;
        let (mut have, mut polls, mut delays) = (0u64, 0u64, Vec::new());
        let mut follow_ups = FollowUps::default();
        // A poll in flight: when it went out.
        let mut in_flight: Option<u64> = None;
        for now in 0..END_MS {
            if now % (refresh_ms + 1) == 0 {
                follow_ups.tick();
                if in_flight.is_none() {
                    in_flight = Some(now);
                    polls += 1;
                }
            }
            // Answer every poll that can be answered now; a follow-up may be answered at once.
            while let Some(sent) = in_flight {
                let latest = published(now);
                if latest > have {
                    in_flight = None;
                    delays.push((now - built_at(latest)) as f64);
                    have = latest;
                    if follow && follow_ups.poll_again_now(WAIT_MS) {
                        in_flight = Some(now);
                        polls += 1;
                        continue;
                    }
                } else if now >= sent + WAIT_MS {
                    in_flight = None; // 304
                }
                break;
            }
        }
        let mean = delays.iter().sum::<f64>() / delays.len().max(1) as f64;
        (mean, polls as f64 * 1000.0 / END_MS as f64)
    }

    #[test]
    fn snapshots_arrive_as_pd_control_builds_them_at_equal_periods() {
        for (period, phase) in [(50, 7), (50, 31), (100, 13), (100, 77)] {
            let (mean, rate) = run(period, period, phase, true);
            let (tick_mean, tick_rate) = run(period, period, phase, false);
            assert!(
                mean < 1.0,
                "period {period}, phase {phase}: delivered {mean} ms after publication"
            );
            assert!(
                tick_mean >= period as f64 / 10.0,
                "the tick alone delivers late ({tick_mean} ms): the case this rule is for"
            );
            assert!(
                rate <= tick_rate * 1.1 + 1.0,
                "no more polls than versions: {rate}/s against {tick_rate}/s"
            );
        }
    }

    #[test]
    fn a_faster_pd_control_costs_at_most_two_polls_a_period() {
        for (refresh, publish) in [(1_000, 50), (200, 50), (100, 30), (50, 10)] {
            let (_, rate) = run(refresh, publish, 3, true);
            let bound = 2.0 * 1000.0 / refresh as f64;
            assert!(
                rate <= bound + 0.1,
                "refresh {refresh} ms, publishing every {publish} ms: {rate} polls/s > {bound}"
            );
        }
    }
}
