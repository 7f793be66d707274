//! How often a VM that follows the other workers' prefix rings must read them.
//!
//! A follower reads before each of its own selections and on its ticks. A worker that has
//! routed and then idles ticks once a second; while another worker serves a busy connection
//! and publishes a batch per request, its ring ([`RING`] batches, and a byte budget of what a
//! reader's index holds) laps the idle one within a fraction of that second, and what it
//! misses it never learns: when its next request comes, it routes without the prefixes the
//! busy worker placed meanwhile. So a follower measures how fast the others fill their rings
//! and asks its timer for a period in which a quarter ring fills at most: a writer's rate may
//! double between two reads before anything is lost. When the writers slow down it lets go,
//! so a quiet gateway ticks as slowly as before; and a worker busy with its own selections,
//! each of which reads first, leaves its timer alone (at full load both workers publish
//! thousands of batches a second, and 16-ms ticks there would be work for nothing).

use super::log::{CatchUp, RING};
use crate::core::pace::MAX_IDLE_TICK_MS;

/// The share of a ring a read should find at most.
const FILL_PER_READ: f64 = 0.25;
/// The shortest period a follower asks for: 64 ticks a second, each one a cheap heads read
/// when nothing is new, only while another worker fills a ring in a quarter of a second, and
/// for the first window after another worker woke from idle.
pub const MIN_FOLLOW_MS: u64 = 16;
/// The rate is measured over at least this long: reads a millisecond apart (a request right
/// after a tick) say nothing about it.
const WINDOW_MS: u64 = 100;

/// How much of a ring a catch-up found the others had published since the previous one: the
/// larger of its share of [`RING`] batches and its share of the ring's byte budget (`budget`,
/// the publisher's [`super::log::PrefixLog::publish`] bound). Lost batches count at the size
/// of the ones read.
pub fn fill(done: &CatchUp, budget_bytes: usize) -> f64 {
    let found = done.batches.saturating_add(done.missed) as f64;
    let by_count = found / RING as f64;
    let bytes = match done.batches {
        0 => 0.0,
        n => done.bytes as f64 * found / n as f64,
    };
    by_count.max(bytes / budget_bytes.max(1) as f64)
}

/// A follower's estimate of how fast the others fill their rings, and the period it asks
/// its timer for.
#[derive(Debug, Clone, Default)]
pub struct FollowRate {
    window_start_ms: u64,
    /// Rings' worth found since `window_start_ms`.
    filled: f64,
    /// The longest gap between reads that keeps up with the rate measured.
    need_ms: Option<u64>,
    /// When this VM last read before one of its own selections.
    selection_read_ms: u64,
}

impl FollowRate {
    /// A read at `now_ms` found `fill` (see [`fill`]); `before_selection` says it was the
    /// read a selection makes first, not a tick's. Returns the period the timer must keep (a
    /// power of two from [`MIN_FOLLOW_MS`] up), or `None` when it need not hurry: the rate is
    /// low enough for the idle tick, or this VM's own selections read at least that often.
    /// A busy worker so leaves its timer alone; once its selections stop, its next tick
    /// brings the period down.
    pub fn read(&mut self, now_ms: u64, fill: f64, before_selection: bool) -> Option<u64> {
        if before_selection {
            self.selection_read_ms = now_ms;
        }
        if self.window_start_ms == 0 {
            // The first read starts the clock: what it finds may have piled up for minutes.
            self.window_start_ms = now_ms;
            return self.timer_need(now_ms);
        }
        self.filled += fill;
        let elapsed = now_ms.saturating_sub(self.window_start_ms);
        if elapsed >= WINDOW_MS {
            let filled = std::mem::take(&mut self.filled);
            self.window_start_ms = now_ms;
            let ms = elapsed as f64 * FILL_PER_READ / filled;
            self.need_ms = (filled > 0.0 && ms < MAX_IDLE_TICK_MS as f64)
                .then(|| power_of_two_at_most((ms as u64).max(MIN_FOLLOW_MS)));
        }
        self.timer_need(now_ms)
    }

    /// Another VM woke from idle with a request: a burst from it may follow. Until a window
    /// has measured its rate, ask for the shortest period: the first batches of a burst fill
    /// a ring as fast as any later ones, and on its idle tick this VM would read them a
    /// second late. Returns the period to ask for.
    pub fn expect_burst(&mut self, now_ms: u64) -> Option<u64> {
        self.window_start_ms = now_ms.max(1);
        self.filled = 0.0;
        self.need_ms = Some(MIN_FOLLOW_MS);
        self.timer_need(now_ms)
    }

    fn timer_need(&self, now_ms: u64) -> Option<u64> {
        let need = self.need_ms?;
        let since_selection = now_ms.saturating_sub(self.selection_read_ms);
        (self.selection_read_ms == 0 || since_selection >= need).then_some(need)
    }
}

/// The largest power of two not above `ms` (`ms` ≥ 1): needs that differ by less than half
/// set one period, so the timer is not reset on every read.
fn power_of_two_at_most(ms: u64) -> u64 {
    1 << (63 - ms.leading_zeros())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A catch-up that applied `batches` of `size` bytes each and lost `missed`.
    fn found(batches: u64, size: u64, missed: u64) -> CatchUp {
        CatchUp {
            batches,
            bytes: batches * size,
            missed,
            malformed: None,
        }
    }

    /// Rings' worth of `n` small batches.
    fn batches(n: u64) -> f64 {
        fill(&found(n, 100, 0), 1 << 20)
    }

    #[test]
    fn a_busy_writer_asks_for_a_read_every_quarter_ring() {
        let mut f = FollowRate::default();
        assert_eq!(
            f.read(1_000, batches(5_000), false),
            None,
            "the first read starts the clock"
        );
        // 2 000 batches a second: a quarter ring fills in 16 ms.
        assert_eq!(f.read(2_000, batches(2_000), false), Some(16));
        // 400 a second: 80 ms, rounded down to 64.
        assert_eq!(f.read(3_000, batches(400), false), Some(64));
        // 100 a second: 320 ms, 256.
        assert_eq!(f.read(4_000, batches(100), false), Some(256));
        // 20 a second: a quarter ring in 1.6 s, the idle tick keeps up.
        assert_eq!(f.read(5_000, batches(20), false), None);
        // Nothing published: nothing needed.
        assert_eq!(f.read(6_000, 0.0, false), None);
    }

    #[test]
    fn long_prompts_fill_the_byte_budget_first() {
        // 32 KB batches against an 800 KB budget: 25 fill it, far fewer than 128.
        let long = found(4, 32 << 10, 0);
        assert!((fill(&long, 800 << 10) - 4.0 / 25.0).abs() < 1e-9);
        // Lost batches count at the size of those read: 2 read and 2 lost weigh as 4 read.
        let lapped = found(2, 32 << 10, 2);
        assert_eq!(fill(&lapped, 800 << 10), fill(&long, 800 << 10));
        // Only lost ones: their count is all there is to go by.
        assert_eq!(fill(&found(0, 0, 64), 800 << 10), 0.5);
        // 100 such batches a second fill 4 budgets a second: read every 62 ms, 32.
        let mut f = FollowRate::default();
        f.read(1_000, 0.0, false);
        let second = fill(&found(100, 32 << 10, 0), 800 << 10);
        assert_eq!(f.read(2_000, second, false), Some(32));
    }

    #[test]
    fn the_rate_is_measured_over_a_window_not_between_close_reads() {
        let mut f = FollowRate::default();
        f.read(1_000, 0.0, false);
        assert_eq!(f.read(1_500, batches(200), false), Some(64), "400 a second");
        // A request 2 ms after a tick finds nothing new: the need stands until a window has
        // passed, and then the window's reads count together.
        assert_eq!(f.read(1_502, 0.0, false), Some(64));
        assert_eq!(f.read(1_550, batches(20), false), Some(64));
        assert_eq!(
            f.read(1_600, batches(20), false),
            Some(64),
            "40 batches in 100 ms"
        );
    }

    #[test]
    fn a_burst_is_followed_closely_until_its_rate_is_known() {
        let mut f = FollowRate::default();
        f.read(1_000, 0.0, false);
        assert_eq!(f.read(2_000, 0.0, false), None, "a quiet gateway");
        assert_eq!(f.expect_burst(5_000), Some(MIN_FOLLOW_MS));
        assert_eq!(f.read(5_016, batches(16), false), Some(MIN_FOLLOW_MS));
        // The first window measures it: 40 batches in 100 ms is a read every 80 ms, 64.
        assert_eq!(f.read(5_100, batches(24), false), Some(64));
        // A wake-up with no burst behind it lets go after one window.
        assert_eq!(f.expect_burst(9_000), Some(MIN_FOLLOW_MS));
        assert_eq!(f.read(9_100, 0.0, false), None);
        // Even before the first read ever, a burst is followed from its start.
        assert_eq!(FollowRate::default().expect_burst(7), Some(MIN_FOLLOW_MS));
    }

    #[test]
    fn a_worker_whose_selections_keep_up_leaves_its_timer_alone() {
        let mut f = FollowRate::default();
        f.read(1_000, 0.0, false);
        // 2 000 batches a second while this worker selects every millisecond or so: each
        // selection reads first, which keeps up without ticks.
        assert_eq!(f.read(2_000, batches(2_000), true), None);
        assert_eq!(f.read(2_001, batches(2), true), None);
        assert_eq!(f.read(2_011, batches(20), false), None, "a tick soon after");
        // Its selections stop: the first tick more than a need after the last asks for it.
        assert_eq!(f.read(2_101, batches(180), false), Some(16));
        // A burst announced while it selects: its selections read anyway.
        assert_eq!(f.read(3_000, batches(2), true), None);
        assert_eq!(f.expect_burst(3_001), None);
        assert_eq!(f.expect_burst(3_100), Some(MIN_FOLLOW_MS));
    }

    #[test]
    fn the_shortest_period_is_bounded() {
        let mut f = FollowRate::default();
        f.read(1, 0.0, false);
        assert_eq!(
            f.read(1_001, batches(1_000_000), false),
            Some(MIN_FOLLOW_MS)
        );
        assert_eq!(power_of_two_at_most(1), 1);
        assert_eq!(power_of_two_at_most(1_023), 512);
        assert_eq!(power_of_two_at_most(1_024), 1_024);
    }
}
