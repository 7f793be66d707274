//! The external router's process-local protections, as AIBrix keeps them per gateway
//! replica: a bulkhead bounding exchanges in flight, and a circuit that opens after
//! consecutive failed exchanges and lets one probe through once its open interval is over.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A slot of the bulkhead, given back when dropped.
pub struct Permit<'a>(&'a AtomicUsize);

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Refuses a new exchange (without waiting) while `limit` are in flight.
#[derive(Debug)]
pub struct Bulkhead {
    limit: usize,
    inflight: AtomicUsize,
}

impl Bulkhead {
    pub fn new(limit: usize) -> Bulkhead {
        Bulkhead {
            limit,
            inflight: AtomicUsize::new(0),
        }
    }

    pub fn try_acquire(&self) -> Option<Permit<'_>> {
        self.inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .ok()
            .map(|_| Permit(&self.inflight))
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Acquire)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    Open,
    HalfOpen,
}

impl State {
    pub const ALL: [State; 3] = [State::Closed, State::Open, State::HalfOpen];

    pub fn label(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }
}

/// What an exchange holds of the circuit: settled by exactly one of success, failure or
/// cancel. A token of an older generation (the circuit opened since) settles nothing.
#[derive(Debug, Clone, Copy)]
pub struct Token {
    half_open: bool,
    generation: u64,
}

#[derive(Debug)]
struct Inner {
    state: State,
    failures: u32,
    opened_at: Option<Instant>,
    probing: bool,
    generation: u64,
}

#[derive(Debug)]
pub struct Circuit {
    threshold: u32,
    open_for: Duration,
    inner: Mutex<Inner>,
}

impl Circuit {
    pub fn new(threshold: u32, open_for: Duration) -> Circuit {
        Circuit {
            threshold: threshold.max(1),
            open_for,
            inner: Mutex::new(Inner {
                state: State::Closed,
                failures: 0,
                opened_at: None,
                probing: false,
                generation: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn state(&self) -> State {
        self.lock().state
    }

    /// A token for one exchange, or `None` while the circuit is open (or its one probe is
    /// out).
    pub fn acquire(&self, now: Instant) -> Option<Token> {
        let mut c = self.lock();
        match c.state {
            State::Closed => Some(Token {
                half_open: false,
                generation: c.generation,
            }),
            State::Open => {
                let waited = c
                    .opened_at
                    .is_none_or(|at| now.saturating_duration_since(at) >= self.open_for);
                if !waited || c.probing {
                    return None;
                }
                c.state = State::HalfOpen;
                c.probing = true;
                Some(Token {
                    half_open: true,
                    generation: c.generation,
                })
            }
            State::HalfOpen if c.probing => None,
            State::HalfOpen => {
                c.probing = true;
                Some(Token {
                    half_open: true,
                    generation: c.generation,
                })
            }
        }
    }

    pub fn success(&self, token: Token) {
        let mut c = self.lock();
        if token.generation != c.generation {
            return;
        }
        if token.half_open {
            if c.state == State::HalfOpen && c.probing {
                c.state = State::Closed;
                c.failures = 0;
                c.probing = false;
            }
        } else if c.state == State::Closed {
            c.failures = 0;
        }
    }

    pub fn failure(&self, token: Token, now: Instant) {
        let mut c = self.lock();
        if token.generation != c.generation {
            return;
        }
        if token.half_open {
            if c.state == State::HalfOpen && c.probing {
                Self::open(&mut c, now);
            }
            return;
        }
        if c.state != State::Closed {
            return;
        }
        c.failures += 1;
        if c.failures >= self.threshold {
            Self::open(&mut c, now);
        }
    }

    /// An exchange that ended without a verdict on the service (never sent, or the caller
    /// left): a probe that ends so reopens the circuit, anything else changes nothing.
    pub fn cancel(&self, token: Token, now: Instant) {
        if !token.half_open {
            return;
        }
        let mut c = self.lock();
        if token.generation == c.generation && c.state == State::HalfOpen && c.probing {
            Self::open(&mut c, now);
        }
    }

    fn open(c: &mut Inner, now: Instant) {
        c.state = State::Open;
        c.opened_at = Some(now);
        c.probing = false;
        c.generation += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bulkhead_refuses_past_its_limit_and_frees_on_drop() {
        let b = Bulkhead::new(2);
        let one = b.try_acquire().expect("first");
        let _two = b.try_acquire().expect("second");
        assert!(b.try_acquire().is_none());
        drop(one);
        assert!(b.try_acquire().is_some());
        assert_eq!(b.inflight(), 1);
    }

    #[test]
    fn consecutive_failures_open_it_and_one_probe_closes_or_reopens_it() {
        let t0 = Instant::now();
        let c = Circuit::new(3, Duration::from_secs(1));
        for _ in 0..2 {
            let t = c.acquire(t0).unwrap();
            c.failure(t, t0);
        }
        let t = c.acquire(t0).unwrap();
        c.success(t);
        for _ in 0..3 {
            let t = c.acquire(t0).unwrap();
            c.failure(t, t0);
        }
        assert_eq!(
            c.state(),
            State::Open,
            "three in a row, after a success reset the count"
        );
        assert!(c.acquire(t0 + Duration::from_millis(999)).is_none());
        let later = t0 + Duration::from_secs(1);
        let probe = c.acquire(later).expect("one probe");
        assert_eq!(c.state(), State::HalfOpen);
        assert!(c.acquire(later).is_none(), "only one probe at a time");
        c.failure(probe, later);
        assert_eq!(c.state(), State::Open);
        let again = later + Duration::from_secs(1);
        let probe = c.acquire(again).unwrap();
        c.success(probe);
        assert_eq!(c.state(), State::Closed);
    }

    #[test]
    fn a_cancelled_probe_reopens_and_stale_tokens_settle_nothing() {
        let t0 = Instant::now();
        let c = Circuit::new(1, Duration::ZERO);
        let stale = c.acquire(t0).unwrap();
        let t = c.acquire(t0).unwrap();
        c.failure(t, t0);
        assert_eq!(c.state(), State::Open);
        c.success(stale);
        assert_eq!(c.state(), State::Open, "a token from before the opening");
        let probe = c.acquire(t0).unwrap();
        c.cancel(probe, t0);
        assert_eq!(c.state(), State::Open);
    }
}
