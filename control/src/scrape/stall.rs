//! Engines that hold requests but stopped working on them.
//!
//! A GPU that hangs (a collective that never returns, a wedged kernel) usually leaves the
//! engine's HTTP server up: connections are accepted, `/metrics` answers, and every request
//! sent there waits until the decode watchdog gives up on it (60 s by default). What the
//! metrics do show is that nothing moves: requests are running, yet no token or request
//! counter grows (for an engine without counters: no throughput gauge is above zero), scrape
//! after scrape. A healthy engine with running requests moves one of them within a scheduler
//! step (milliseconds to a few seconds).

use super::engine::Reading;

/// What one reading says about the engine's progress since the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// No running request: nothing to make progress on.
    Idle,
    /// A token or request counter grew (or restarted); without counters, a throughput gauge
    /// is above zero.
    Moved,
    /// Requests are running and no signal moved.
    Still,
    /// The reading cannot tell: no running count, no progress signal, or no earlier reading
    /// to compare counters with.
    Unknown,
}

/// Compares `current` with the `previous` reading of the same engine process. With
/// `counts_at_finish` (see `Engine::counts_at_finish`), counters that stand still are not
/// enough: the scheduler's own work gauges (KV usage, throughput) standing still too are.
pub fn progress(previous: Option<&Reading>, current: &Reading, counts_at_finish: bool) -> Progress {
    let Some(running) = current.running else {
        return Progress::Unknown;
    };
    if running <= 0.0 {
        return Progress::Idle;
    }
    if previous.and_then(|p| p.running).is_some_and(|r| r <= 0.0) {
        // Work arrived since an idle reading: its clock starts now.
        return Progress::Moved;
    }
    let counters: [fn(&Reading) -> Option<f64>; 3] = [
        |r| r.prompt_tokens,
        |r| r.generation_tokens,
        |r| r.completed,
    ];
    let mut comparable = false;
    for counter in counters {
        if let (Some(before), Some(now)) = (previous.and_then(counter), counter(current)) {
            comparable = true;
            // A decrease is a restarted engine: a new process is progress too.
            if now != before {
                return Progress::Moved;
            }
        }
    }
    if comparable {
        // Counters are the witness: a throughput gauge keeps its last value when the engine
        // stops updating it (SGLang writes its gauge every few dozen steps). An engine that
        // counts at finish moves its gauges while it works: a changed one is progress.
        if counts_at_finish && previous.is_some_and(|p| work_gauges_moved(p, current)) {
            return Progress::Moved;
        }
        return Progress::Still;
    }
    let gauges = [current.generation_gauge, current.prompt_gauge];
    if gauges.iter().flatten().any(|g| *g > 0.0) {
        Progress::Moved
    } else if gauges.iter().any(Option::is_some) {
        Progress::Still
    } else {
        Progress::Unknown
    }
}

/// Whether a gauge the engine's scheduler refreshes as it works changed between two readings.
/// Running and waiting counts are left out: requests arriving at a wedged engine can move
/// them.
fn work_gauges_moved(previous: &Reading, current: &Reading) -> bool {
    let gauges: [fn(&Reading) -> Option<f64>; 3] = [
        |r| r.kv_cache_usage,
        |r| r.generation_gauge,
        |r| r.prompt_gauge,
    ];
    gauges
        .iter()
        .any(|g| matches!((g(previous), g(current)), (Some(a), Some(b)) if a != b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As vLLM reads: its counters move at every step.
    fn progress(previous: Option<&Reading>, current: &Reading) -> Progress {
        super::progress(previous, current, false)
    }

    #[test]
    fn an_engine_counting_at_finish_shows_its_work_in_its_gauges() {
        // SGLang mid-way through long answers: no request ended, so no counter moved, but the
        // KV in use and the measured throughput did.
        let working = |kv, throughput| Reading {
            running: Some(2.0),
            kv_cache_usage: Some(kv),
            generation_gauge: Some(throughput),
            ..reading(Some(2.0), Some(50.0))
        };
        let before = working(0.41, 2900.0);
        assert_eq!(
            super::progress(Some(&before), &working(0.47, 3100.0), true),
            Progress::Moved
        );
        assert_eq!(
            super::progress(Some(&before), &working(0.41, 3100.0), true),
            Progress::Moved,
            "one gauge is enough"
        );
        // Wedged: every gauge as it was.
        assert_eq!(
            super::progress(Some(&before), &working(0.41, 2900.0), true),
            Progress::Still
        );
        // Requests arriving at a wedged engine move its running and waiting counts only.
        let arrived = Reading {
            running: Some(5.0),
            waiting: Some(3.0),
            ..working(0.41, 2900.0)
        };
        assert_eq!(
            super::progress(Some(&before), &arrived, true),
            Progress::Still
        );
        // vLLM counts every step: its gauges are no witness.
        assert_eq!(
            super::progress(Some(&before), &working(0.47, 3100.0), false),
            Progress::Still
        );
    }

    fn reading(running: Option<f64>, generated: Option<f64>) -> Reading {
        Reading {
            running,
            generation_tokens: generated,
            prompt_tokens: Some(100.0),
            completed: Some(3.0),
            ..Reading::default()
        }
    }

    #[test]
    fn running_requests_with_no_counter_moving_are_still() {
        let before = reading(Some(2.0), Some(50.0));
        assert_eq!(
            progress(Some(&before), &reading(Some(2.0), Some(50.0))),
            Progress::Still
        );
        assert_eq!(
            progress(Some(&before), &reading(Some(2.0), Some(51.0))),
            Progress::Moved
        );
        assert_eq!(
            progress(Some(&before), &reading(Some(2.0), Some(4.0))),
            Progress::Moved,
            "a restarted engine counts from zero"
        );
        assert_eq!(
            progress(Some(&before), &reading(Some(0.0), Some(50.0))),
            Progress::Idle
        );
        assert_eq!(
            progress(Some(&reading(Some(0.0), Some(50.0))), &before),
            Progress::Moved,
            "requests arrived after an idle reading"
        );
        let finished = Reading {
            completed: Some(4.0),
            ..reading(Some(2.0), Some(50.0))
        };
        assert_eq!(progress(Some(&before), &finished), Progress::Moved);
    }

    #[test]
    fn gauges_count_and_a_reading_without_signals_tells_nothing() {
        // SGLang and TRT-LLM report throughput as gauges.
        let gauge = |value| Reading {
            running: Some(1.0),
            generation_gauge: Some(value),
            ..Reading::default()
        };
        assert_eq!(progress(None, &gauge(12.5)), Progress::Moved);
        let counted = |value| Reading {
            generation_tokens: Some(70.0),
            ..gauge(value)
        };
        assert_eq!(
            progress(Some(&counted(12.5)), &counted(12.5)),
            Progress::Still,
            "a gauge left at its last value does not outweigh counters standing still"
        );
        assert_eq!(progress(Some(&gauge(0.0)), &gauge(0.0)), Progress::Still);
        assert_eq!(
            progress(None, &reading(Some(2.0), Some(50.0))),
            Progress::Unknown,
            "no earlier reading to compare counters with"
        );
        assert_eq!(
            progress(None, &reading(None, Some(50.0))),
            Progress::Unknown
        );
        let bare = Reading {
            running: Some(3.0),
            ..Reading::default()
        };
        assert_eq!(progress(Some(&bare), &bare), Progress::Unknown);
    }
}
