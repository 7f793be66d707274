//! The decode watchdog: once the prefill succeeded, the decode pod owes the client an
//! answer. If its first body chunk (a stream's first token, or a whole unstreamed answer)
//! does not come in time, or a stream goes quiet for too long, the gateway fails the
//! request instead of leaving the client waiting for the route timeout, and asks the pod to
//! drop it (`/abort_request`).
//!
//! Pure state: the host feeds events and the current time, and asks whether it fired.
//! Response headers do not count as progress: SGLang sends a stream's headers before the
//! first token.

use crate::core::env::EnvReader;
use crate::core::profile::Knobs;

/// Seconds; 0 turns a timer off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WatchdogSettings {
    /// `AIBRIX_DECODE_FIRST_RESPONSE_TIMEOUT`: streaming, until the first chunk.
    pub first_response_s: f64,
    /// `AIBRIX_DECODE_RESPONSE_TIMEOUT`: unstreamed, until the answer.
    pub response_s: f64,
    /// `AIBRIX_DECODE_STREAM_IDLE_TIMEOUT`: streaming, between chunks.
    pub stream_idle_s: f64,
    /// `AIBRIX_DECODE_ABORT_TIMEOUT`: per `/abort_request` attempt; 0 sends none.
    pub abort_timeout_s: f64,
    /// `AIBRIX_DECODE_ABORT_RETRY_DELAY`: before the second attempt; 0 makes one attempt.
    pub abort_retry_delay_s: f64,
}

impl Default for WatchdogSettings {
    fn default() -> Self {
        WatchdogSettings {
            first_response_s: 60.0,
            response_s: 0.0,
            stream_idle_s: 120.0,
            abort_timeout_s: 3.0,
            abort_retry_delay_s: 2.0,
        }
    }
}

impl WatchdogSettings {
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> (WatchdogSettings, Vec<String>) {
        let d = WatchdogSettings::default();
        let mut r = EnvReader::new(get);
        let s = WatchdogSettings {
            first_response_s: r
                .non_negative("AIBRIX_DECODE_FIRST_RESPONSE_TIMEOUT", d.first_response_s),
            response_s: r.non_negative("AIBRIX_DECODE_RESPONSE_TIMEOUT", d.response_s),
            stream_idle_s: r.non_negative("AIBRIX_DECODE_STREAM_IDLE_TIMEOUT", d.stream_idle_s),
            abort_timeout_s: r.non_negative("AIBRIX_DECODE_ABORT_TIMEOUT", d.abort_timeout_s),
            abort_retry_delay_s: r
                .non_negative("AIBRIX_DECODE_ABORT_RETRY_DELAY", d.abort_retry_delay_s),
        };
        (s, r.warnings)
    }

    /// The request profile's `decode*` knobs over the gateway values.
    pub fn with_knobs(&self, k: &Knobs) -> WatchdogSettings {
        WatchdogSettings {
            first_response_s: k
                .decode_first_response_timeout
                .unwrap_or(self.first_response_s),
            response_s: k.decode_response_timeout.unwrap_or(self.response_s),
            stream_idle_s: k.decode_stream_idle_timeout.unwrap_or(self.stream_idle_s),
            abort_timeout_s: k.decode_abort_timeout.unwrap_or(self.abort_timeout_s),
            abort_retry_delay_s: k
                .decode_abort_retry_delay
                .unwrap_or(self.abort_retry_delay_s),
        }
    }
}

fn ms(s: f64) -> u64 {
    (s * 1000.0).round() as u64
}

/// Which bound fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    FirstResponse,
    StreamIdle,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::FirstResponse => "first_response",
            Phase::StreamIdle => "stream_idle",
        }
    }
}

/// A fired watchdog: what the host must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fire {
    pub phase: Phase,
    /// Headers already reached the client: only cutting the stream is possible.
    pub headers_sent: bool,
    /// The bound that was exceeded, milliseconds.
    pub timeout_ms: u64,
    pub stream: bool,
}

/// One request's watchdog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watchdog {
    stream: bool,
    first_ms: u64,
    idle_ms: u64,
    armed_at: Option<u64>,
    headers_sent: bool,
    last_chunk: Option<u64>,
    finished: bool,
}

impl Watchdog {
    /// A watchdog for a request, not yet armed. `None` when every bound that applies to it
    /// is off.
    pub fn new(settings: &WatchdogSettings, stream: bool) -> Option<Watchdog> {
        let (first_ms, idle_ms) = if stream {
            (ms(settings.first_response_s), ms(settings.stream_idle_s))
        } else {
            (ms(settings.response_s), 0)
        };
        (first_ms > 0 || idle_ms > 0).then_some(Watchdog {
            stream,
            first_ms,
            idle_ms,
            armed_at: None,
            headers_sent: false,
            last_chunk: None,
            finished: false,
        })
    }

    /// The prefill succeeded: from now on the decode pod owes the answer.
    pub fn arm(&mut self, now_ms: u64) {
        self.armed_at.get_or_insert(now_ms);
    }

    pub fn on_headers(&mut self) {
        self.headers_sent = true;
    }

    /// Whether a chunk's arrival time matters: only a stream's idle bound reads it, so the
    /// host reads no clock for the chunks of any other answer.
    pub fn times_chunks(&self) -> bool {
        self.stream && self.idle_ms > 0
    }

    /// A response body chunk (non-empty) arrived; `end` when it was the last. `now_ms` may
    /// be anything when [`Watchdog::times_chunks`] says no.
    pub fn on_chunk(&mut self, now_ms: u64, end: bool) {
        self.last_chunk = Some(now_ms);
        self.finished |= end;
    }

    /// When the watchdog fires next, and which bound that is.
    pub fn deadline(&self) -> Option<(u64, Phase)> {
        let armed = self.armed_at?;
        if self.finished {
            return None;
        }
        match self.last_chunk {
            None => (self.first_ms > 0)
                .then_some((armed.saturating_add(self.first_ms), Phase::FirstResponse)),
            Some(_) if !self.stream => None,
            Some(t) => (self.idle_ms > 0)
                .then_some((t.max(armed).saturating_add(self.idle_ms), Phase::StreamIdle)),
        }
    }

    /// Fires (once) when `now` is past the deadline.
    pub fn poll(&mut self, now_ms: u64) -> Option<Fire> {
        let (deadline, phase) = self.deadline()?;
        if now_ms < deadline {
            return None;
        }
        self.finished = true;
        Some(Fire {
            phase,
            headers_sent: self.headers_sent,
            timeout_ms: match phase {
                Phase::FirstResponse => self.first_ms,
                Phase::StreamIdle => self.idle_ms,
            },
            stream: self.stream,
        })
    }
}

/// The 504 message of a watchdog that fired before the headers.
pub fn message(pod: &str, fire: &Fire) -> String {
    let t = go_duration(fire.timeout_ms);
    if fire.stream {
        format!("decode pod {pod} did not start responding within {t}")
    } else {
        format!("decode pod {pod} did not finish responding within {t}")
    }
}

/// `ms` as Go's `time.Duration` prints it (`500ms`, `1.5s`, `1m0s`, `1h0m0s`), which is how
/// AIBrix's message reads: clients or alerts matching it see the same text.
pub fn go_duration(ms: u64) -> String {
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, m) = (ms / 3_600_000, ms / 60_000 % 60);
    let (s, frac) = (ms / 1000 % 60, ms % 1000);
    let seconds = if frac == 0 {
        format!("{s}s")
    } else {
        let frac = format!("{frac:03}");
        format!("{s}.{}s", frac.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => seconds,
        (0, m) => format!("{m}m{seconds}"),
        (h, m) => format!("{h}h{m}m{seconds}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(first: f64, response: f64, idle: f64) -> WatchdogSettings {
        WatchdogSettings {
            first_response_s: first,
            response_s: response,
            stream_idle_s: idle,
            ..WatchdogSettings::default()
        }
    }

    #[test]
    fn an_effectively_infinite_bound_never_fires_and_never_overflows() {
        let now = 1_700_000_000_000;
        for (first, idle) in [(1e17, 0.0), (1e300, 0.0), (f64::MAX, 0.0), (0.0, 1e20)] {
            let mut w = Watchdog::new(&settings(first, 0.0, idle), true).expect("a bound is set");
            w.arm(now);
            if idle > 0.0 {
                w.on_headers();
                w.on_chunk(now, false);
            }
            assert_eq!(w.poll(now + 1), None, "({first}, {idle})");
            assert_eq!(w.poll(u64::MAX - 1), None, "({first}, {idle})");
        }
    }

    /// (stream, events, poll time, expected fire phase + headers_sent)
    #[test]
    fn table() {
        #[derive(Clone, Copy)]
        enum Ev {
            Arm(u64),
            Headers,
            Chunk(u64),
            End(u64),
        }
        use Ev::*;
        let s = settings(1.0, 2.0, 0.5);
        type Case = (&'static str, bool, Vec<Ev>, u64, Option<(Phase, bool)>);
        let cases: Vec<Case> = vec![
            ("not armed never fires", true, vec![Headers], 99_000, None),
            (
                "first token late",
                true,
                vec![Arm(0)],
                1000,
                Some((Phase::FirstResponse, false)),
            ),
            ("just in time", true, vec![Arm(0)], 999, None),
            (
                "headers are not a token",
                true,
                vec![Arm(0), Headers],
                1000,
                Some((Phase::FirstResponse, true)),
            ),
            (
                "first chunk moves to idle",
                true,
                vec![Arm(0), Headers, Chunk(900)],
                1399,
                None,
            ),
            (
                "stalls mid-stream",
                true,
                vec![Arm(0), Headers, Chunk(900)],
                1400,
                Some((Phase::StreamIdle, true)),
            ),
            (
                "finished stream",
                true,
                vec![Arm(0), Chunk(10), End(20)],
                10_000,
                None,
            ),
            (
                "chunk before arm counts from arm",
                true,
                vec![Chunk(0), Arm(300)],
                799,
                None,
            ),
            (
                "unstreamed answer late",
                false,
                vec![Arm(0)],
                2000,
                Some((Phase::FirstResponse, false)),
            ),
            (
                "unstreamed answer started",
                false,
                vec![Arm(0), Headers, Chunk(100)],
                60_000,
                None,
            ),
        ];
        for (name, stream, events, at, want) in cases {
            let mut w = Watchdog::new(&s, stream).expect("on");
            for e in events {
                match e {
                    Arm(t) => w.arm(t),
                    Headers => w.on_headers(),
                    Chunk(t) => w.on_chunk(t, false),
                    End(t) => w.on_chunk(t, true),
                }
            }
            let got = w.poll(at).map(|f| (f.phase, f.headers_sent));
            assert_eq!(got, want, "{name}");
            if got.is_some() {
                assert_eq!(w.poll(at + 10_000), None, "{name}: fires once");
            }
        }
    }

    #[test]
    fn a_chunks_time_matters_only_where_the_watchdog_says_it_times_chunks() {
        for (s, stream) in [
            (settings(1.0, 2.0, 3.0), false),
            (settings(1.0, 2.0, 0.0), true),
            (settings(1.0, 2.0, 3.0), true),
        ] {
            let mut w = Watchdog::new(&s, stream).expect("on");
            w.arm(100);
            let after = |t: u64| {
                let mut w = w.clone();
                w.on_chunk(t, false);
                (w.deadline(), w.poll(1_000_000).map(|f| f.phase))
            };
            if !w.times_chunks() {
                assert_eq!(after(0), after(50_000), "{s:?} stream {stream}");
            } else {
                assert_ne!(after(0), after(50_000), "{s:?} stream {stream}");
            }
        }
    }

    #[test]
    fn zero_turns_timers_off_and_knobs_override() {
        assert!(Watchdog::new(&settings(0.0, 0.0, 0.0), true).is_none());
        assert!(
            Watchdog::new(&WatchdogSettings::default(), false).is_none(),
            "response timeout is off by default"
        );
        let mut w = Watchdog::new(&settings(0.0, 0.0, 1.0), true).unwrap();
        w.arm(0);
        assert_eq!(w.poll(1_000_000), None, "no first-token bound");
        w.on_chunk(5, false);
        assert_eq!(w.poll(1005).map(|f| f.phase), Some(Phase::StreamIdle));

        let k = Knobs {
            decode_first_response_timeout: Some(0.25),
            decode_abort_timeout: Some(0.0),
            ..Knobs::default()
        };
        let s = WatchdogSettings::default().with_knobs(&k);
        assert_eq!(
            (s.first_response_s, s.stream_idle_s, s.abort_timeout_s),
            (0.25, 120.0, 0.0)
        );
        let (env, warnings) = WatchdogSettings::from_lookup(|k| match k {
            "AIBRIX_DECODE_STREAM_IDLE_TIMEOUT" => Some("0".into()),
            "AIBRIX_DECODE_RESPONSE_TIMEOUT" => Some("-3".into()),
            _ => None,
        });
        assert_eq!((env.stream_idle_s, env.response_s), (0.0, 0.0));
        assert_eq!(warnings.len(), 1);
        let fire = Fire {
            phase: Phase::FirstResponse,
            headers_sent: false,
            timeout_ms: 1500,
            stream: true,
        };
        assert_eq!(
            message("d0", &fire),
            "decode pod d0 did not start responding within 1.5s"
        );
    }

    #[test]
    fn durations_print_as_go_prints_them() {
        let cases = [
            (0, "0s"),
            (500, "500ms"),
            (1_000, "1s"),
            (1_500, "1.5s"),
            (2_050, "2.05s"),
            (60_000, "1m0s"),
            (90_500, "1m30.5s"),
            (120_000, "2m0s"),
            (3_600_000, "1h0m0s"),
            (3_723_004, "1h2m3.004s"),
        ];
        for (ms, want) in cases {
            assert_eq!(go_duration(ms), want, "{ms} ms");
        }
    }
}
