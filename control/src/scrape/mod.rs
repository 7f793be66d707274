//! Scraping every pod's engine metrics.
//!
//! Each pod is scraped on its own: a tick launches a scrape for every pod that has none in
//! flight, and results come back whenever they finish. A hung pod therefore holds one slot until
//! its timeout and delays nobody else's metrics; waiting for a whole round before publishing would
//! let one dead pod (1 s timeout) mark every other pod stale at a 50 ms interval.
//!
//! [`ScrapeBook`] is the bookkeeping (no I/O, unit-tested); [`Scraper`] does the HTTP.

pub mod drain;
pub mod engine;
pub mod exposition;
pub mod fetch;
pub mod latency;
pub mod rates;
pub mod stall;
pub mod window;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use tokio::sync::{mpsc, Semaphore};

use crate::fleet::PodRecord;
use crate::proto::PodMetrics;
use drain::DrainWindow;
use engine::{Engine, Reading};
pub use fetch::ScrapeError;

/// `--scrape-timeout`'s default: the scrape bound a [`ScrapeBook`] assumes until
/// [`ScrapeBook::with_scrape_timeout`] gives it the configured one.
pub const DEFAULT_SCRAPE_TIMEOUT: Duration = Duration::from_secs(1);

/// A scrape to perform.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub key: String,
    /// Identifies the pod state the job was planned for; a result for an older one is dropped.
    pub epoch: u64,
    pub round: u64,
    pub url: String,
    pub engine: Engine,
    pub model: String,
    /// The pod's last scrape could not connect or timed out: this one goes through the
    /// [`Scraper`]'s own slots for such pods (see [`Scraper::spawn`]).
    pub suspect: bool,
}

/// What the scrapes say of one pod, for its snapshot entry.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Observed {
    pub metrics: PodMetrics,
    pub unreachable: bool,
    pub stalled: bool,
}

/// A finished scrape.
#[derive(Debug)]
pub struct Outcome {
    pub job: Job,
    pub result: Result<Reading, ScrapeError>,
    /// Time of the HTTP exchange itself.
    pub elapsed: Duration,
    pub finished: Instant,
    pub finished_unix_ms: i64,
}

/// What a pod is scraped as; a change (new IP after a restart, new engine label) starts its
/// history afresh, since counters from another process cannot be differenced against.
#[derive(Debug, Clone, PartialEq)]
struct Target {
    url: String,
    engine: Engine,
    model: String,
}

impl Target {
    fn of(pod: &PodRecord) -> Target {
        let engine = Engine::from_label(&pod.engine);
        Target {
            url: fetch::metrics_url(&pod.ip, pod.metric_port, engine),
            engine,
            model: pod.model.clone(),
        }
    }
}

struct PodState {
    target: Target,
    epoch: u64,
    /// When the scrape in flight, if any, was planned (see `rates::is_stale`).
    in_flight: Option<Instant>,
    /// Last successful reading and when it was taken: the base for the next rates.
    last: Option<(Reading, Instant)>,
    /// The last reading was a bad read of a token counter (`rates::glitched`) and was not
    /// taken as the base.
    bad_read: bool,
    metrics: PodMetrics,
    last_success: Option<Instant>,
    last_failed: bool,
    /// Scrapes in a row that could not connect, counted once the pod has answered at this
    /// target or another pod of its model has answered (see `ScrapeBook::answered_models`).
    refused: u32,
    /// When the engine last made progress or was idle (see `stall`); none before its first
    /// answered scrape.
    progress_at: Option<Instant>,
    /// The last reading showed running requests and nothing moving.
    still: bool,
    /// Whether the log last said the pod is stalled (the mark itself follows the clock).
    stall_logged: bool,
    /// When the scrapes began to time out on an accepted connection, in a row: an engine
    /// whose server takes connections and answers nothing (a wedged event loop) is as stuck
    /// as one whose running requests do not move, and its readings cannot show either.
    hung_since: Option<Instant>,
    /// How many scrapes of that run timed out.
    hung_scrapes: u32,
    /// The last scrape failed without an answer (no connection, or none in time).
    suspect: bool,
    drain: DrainWindow,
    ttft: latency::LatencyWindow,
    tpot: latency::LatencyWindow,
}

impl PodState {
    fn new(target: Target, next_epoch: &mut u64) -> PodState {
        let epoch = *next_epoch;
        *next_epoch += 1;
        PodState {
            target,
            epoch,
            in_flight: None,
            last: None,
            bad_read: false,
            metrics: PodMetrics::default(),
            last_success: None,
            last_failed: false,
            refused: 0,
            progress_at: None,
            still: false,
            stall_logged: false,
            hung_since: None,
            hung_scrapes: 0,
            suspect: false,
            drain: DrainWindow::default(),
            ttft: latency::LatencyWindow::default(),
            tpot: latency::LatencyWindow::default(),
        }
    }
}

impl PodState {
    /// Moves the stall clock with a new reading (compared with the last one, still in
    /// `self.last`): progress or idleness restarts it, stillness lets it run.
    fn observe_progress(&mut self, reading: &Reading, at: Instant) {
        let counts_at_finish = self.target.engine.counts_at_finish();
        match stall::progress(
            self.last.as_ref().map(|(r, _)| r),
            reading,
            counts_at_finish,
        ) {
            stall::Progress::Still if self.progress_at.is_some() => self.still = true,
            _ => {
                self.still = false;
                self.progress_at = Some(at);
            }
        }
    }
}

struct Round {
    id: u64,
    started: Instant,
    pending: usize,
}

/// Per-pod scrape history and round accounting.
pub struct ScrapeBook {
    pods: HashMap<String, PodState>,
    rounds: Vec<Round>,
    next_round: u64,
    next_epoch: u64,
    stale_bound: Duration,
    /// Bound on one scrape: until then, a scrape in flight keeps fresh metrics fresh (see
    /// `rates::is_stale`).
    scrape_timeout: Duration,
    /// Connection failures in a row that make a pod unreachable; 0 never does.
    unreachable_after: u32,
    /// How long running requests may go without progress before the pod counts as stalled;
    /// zero never.
    stalled_after: Duration,
    /// Models at least one of whose pods has answered a scrape since pd-control started.
    /// Until then a pod's refusals say nothing (every port unreachable may be a network
    /// policy that lets the gateway in but not pd-control); after, a pod of the model that
    /// refuses is taken at its word, even one that never answered: a pod still loading its
    /// engine, or one already dead when pd-control restarted.
    answered_models: HashSet<String>,
}

/// Whether `state` has held running requests without progress for `after` (zero: never), or
/// has answered no scrape it accepted for that long.
fn stalled_state(state: &PodState, after: Duration, now: Instant) -> bool {
    let held_for = |since: Option<Instant>, bound: Duration| {
        since.is_some_and(|at| now.saturating_duration_since(at) >= bound)
    };
    // Stillness is judged no sooner than the engine's gauges can show idleness, if at all.
    let still_for = state
        .target
        .engine
        .stall_floor()
        .map(|floor| after.max(floor));
    !after.is_zero()
        && ((state.still
            && !state.last_failed
            && still_for.is_some_and(|bound| held_for(state.progress_at, bound)))
            || (state.hung_scrapes >= HUNG_SCRAPES && held_for(state.hung_since, after)))
}

/// Timed-out scrapes in a row that may mark a pod stalled (with `--stalled-after` elapsed):
/// one slow answer on a busy node is not a wedged server.
const HUNG_SCRAPES: u32 = 3;

/// Logs a pod's turn into or out of the stalled mark, once per turn.
fn log_stall(state: &mut PodState, key: &str, after: Duration, now: Instant) {
    let stalled = stalled_state(state, after, now);
    if stalled == state.stall_logged {
        return;
    }
    state.stall_logged = stalled;
    if !stalled {
        tracing::info!(pod = %key, "pod makes progress again; routable");
    } else if state.hung_since.is_some() {
        tracing::warn!(
            pod = %key,
            "pod has accepted every scrape connection for {after:?} and answered none; \
             marked stalled, so the gateway routes around it"
        );
    } else {
        let after = after.max(state.target.engine.stall_floor().unwrap_or_default());
        tracing::warn!(
            pod = %key,
            "pod has held running requests for {after:?} with no token or request \
             counter moving; marked stalled, so the gateway routes around it"
        );
    }
}

/// Only pods that can serve are scraped, as AIBrix does: a starting or terminating pod's
/// endpoint would just add timeouts, and the filter ignores such pods anyway.
fn scrapable(pod: &PodRecord) -> bool {
    pod.ready && pod.serves_http && !pod.ip.is_empty()
}

impl ScrapeBook {
    pub fn new(stale_bound: Duration, unreachable_after: u32) -> ScrapeBook {
        ScrapeBook {
            pods: HashMap::new(),
            rounds: Vec::new(),
            next_round: 1,
            next_epoch: 1,
            stale_bound,
            scrape_timeout: DEFAULT_SCRAPE_TIMEOUT,
            unreachable_after,
            stalled_after: Duration::ZERO,
            answered_models: HashSet::new(),
        }
    }

    /// The [`Scraper`]'s bound on one scrape (`--scrape-timeout`), for staleness.
    pub fn with_scrape_timeout(mut self, timeout: Duration) -> ScrapeBook {
        self.scrape_timeout = timeout;
        self
    }

    /// Marks pods whose running requests make no progress for `after` (zero: never).
    pub fn with_stalled_after(mut self, after: Duration) -> ScrapeBook {
        self.stalled_after = after;
        self
    }

    /// Plans a round: one job per scrapable pod without a scrape in flight. Pods that left the
    /// fleet (or stopped being scrapable) lose their history.
    pub fn plan(&mut self, fleet: &[PodRecord], now: Instant) -> Vec<Job> {
        let round = self.next_round;
        let mut seen = HashSet::new();
        let mut jobs = Vec::new();
        for pod in fleet.iter().filter(|p| scrapable(p)) {
            let key = pod.key();
            if !seen.insert(key.clone()) {
                continue; // a duplicated pod in the fleet file is scraped once
            }
            let target = Target::of(pod);
            let next_epoch = &mut self.next_epoch;
            let state = self
                .pods
                .entry(key.clone())
                .or_insert_with(|| PodState::new(target.clone(), next_epoch));
            if state.target != target {
                *state = PodState::new(target.clone(), next_epoch);
            }
            if state.in_flight.is_some() {
                continue;
            }
            state.in_flight = Some(now);
            jobs.push(Job {
                key,
                epoch: state.epoch,
                round,
                url: target.url,
                engine: target.engine,
                model: target.model,
                suspect: state.suspect,
            });
        }
        self.pods.retain(|key, _| seen.contains(key));
        if !jobs.is_empty() {
            self.next_round += 1;
            self.rounds.push(Round {
                id: round,
                started: now,
                pending: jobs.len(),
            });
        }
        jobs
    }

    /// No round is waiting for results.
    pub fn idle(&self) -> bool {
        self.rounds.is_empty()
    }

    /// Records a finished scrape; returns the round's duration when this was its last scrape.
    pub fn apply(&mut self, outcome: Outcome) -> Option<Duration> {
        let Outcome {
            job,
            result,
            finished,
            finished_unix_ms,
            ..
        } = outcome;
        let mut round_done = None;
        if let Some(i) = self.rounds.iter().position(|r| r.id == job.round) {
            let round = &mut self.rounds[i];
            round.pending = round.pending.saturating_sub(1);
            if round.pending == 0 {
                round_done = Some(finished.saturating_duration_since(round.started));
                self.rounds.remove(i);
            }
        }
        let Some(state) = self.pods.get_mut(&job.key).filter(|s| s.epoch == job.epoch) else {
            return round_done; // the pod left or was re-targeted while this scrape ran
        };
        state.in_flight = None;
        state.suspect = matches!(
            result,
            Err(ScrapeError::Connect(_) | ScrapeError::Timeout(_))
        );
        match result {
            Ok(reading) => {
                state.observe_progress(&reading, finished);
                let previous = state
                    .last
                    .as_ref()
                    .map(|(r, at)| (r, finished.saturating_duration_since(*at)));
                // A bad read (a sum missing a DP rank for one scrape) is not the base of the
                // next rates, or the rank's return would read as a burst. Unless the read
                // before was bad too: read twice, the counter did move (a rank gone for
                // good), and the rates count from here.
                let keep_base = !state.bad_read
                    && previous
                        .is_some_and(|(last, elapsed)| rates::glitched(last, &reading, elapsed));
                let carried = Some(&state.metrics).filter(|m| m.present);
                let mut metrics = rates::derive(job.engine, &reading, previous, carried);
                metrics.drain_rate =
                    rates::non_negative(state.drain.observe(finished, reading.completed));
                metrics.ttft_avg_seconds =
                    rates::non_negative(state.ttft.observe(finished, reading.ttft));
                metrics.tpot_avg_seconds =
                    rates::non_negative(state.tpot.observe(finished, reading.tpot));
                metrics.last_scrape_unix_ms = finished_unix_ms;
                if state.last_failed {
                    tracing::info!(pod = %job.key, url = %job.url, "metrics scrape recovered");
                }
                state.metrics = metrics;
                state.bad_read = keep_base;
                if !keep_base {
                    state.last = Some((reading, finished));
                }
                state.last_success = Some(finished);
                state.last_failed = false;
                state.hung_since = None;
                state.hung_scrapes = 0;
                log_stall(state, &job.key, self.stalled_after, finished);
                if state.refused >= self.unreachable_after && self.unreachable_after > 0 {
                    tracing::info!(pod = %job.key, url = %job.url, "pod answers again; routable");
                }
                state.refused = 0;
                if !self.answered_models.contains(&job.model) {
                    self.answered_models.insert(job.model.clone());
                }
            }
            Err(error) => {
                let trusted =
                    state.last_success.is_some() || self.answered_models.contains(&job.model);
                if error.is_connect() && trusted {
                    state.refused = state.refused.saturating_add(1);
                    if state.refused == self.unreachable_after {
                        tracing::warn!(
                            pod = %job.key, url = %job.url, %error,
                            "pod refused {} scrape connections in a row; marked unreachable, \
                             so the gateway routes around it until it answers",
                            state.refused
                        );
                    }
                } else {
                    // It accepted the connection: alive, if unwell (ejection's business).
                    state.refused = 0;
                }
                // Only silence counts towards hung: an error answer is an answer.
                if matches!(error, ScrapeError::Timeout(_)) {
                    state.hung_since.get_or_insert(finished);
                    state.hung_scrapes = state.hung_scrapes.saturating_add(1);
                } else {
                    state.hung_since = None;
                    state.hung_scrapes = 0;
                }
                log_stall(state, &job.key, self.stalled_after, finished);
                // Warn on the transition only: a down pod would otherwise log 20 lines a second.
                if state.last_failed {
                    tracing::debug!(pod = %job.key, url = %job.url, %error, "metrics scrape failed");
                } else {
                    tracing::warn!(pod = %job.key, url = %job.url, %error, "metrics scrape failed");
                }
                state.last_failed = true;
            }
        }
        round_done
    }

    /// Whether the pod's engine stopped taking connections (see `--unreachable-after`). Only
    /// where the metrics are the engine's own port: a separate metrics port may be another
    /// process (an exporter), whose death says nothing of the engine.
    pub fn unreachable(&self, pod: &PodRecord) -> bool {
        self.unreachable_after > 0
            && pod.metric_port == pod.port
            && scrapable(pod)
            && self
                .pods
                .get(&pod.key())
                .is_some_and(|s| s.refused >= self.unreachable_after && s.target == Target::of(pod))
    }

    /// Whether the pod's engine holds running requests that made no progress for
    /// `--stalled-after` (see `stall`).
    pub fn stalled(&self, pod: &PodRecord, now: Instant) -> bool {
        scrapable(pod)
            && self.pods.get(&pod.key()).is_some_and(|s| {
                s.target == Target::of(pod) && stalled_state(s, self.stalled_after, now)
            })
    }

    /// What the snapshot says of a pod now: its metrics, whether it is reachable, whether
    /// it works on what it holds.
    pub fn observe(&self, pod: &PodRecord, now: Instant) -> Observed {
        Observed {
            metrics: self.metrics(pod, now),
            unreachable: self.unreachable(pod),
            stalled: self.stalled(pod, now),
        }
    }

    /// The metrics to publish for a pod now; staleness depends on the time of asking.
    pub fn metrics(&self, pod: &PodRecord, now: Instant) -> PodMetrics {
        let state = self
            .pods
            .get(&pod.key())
            .filter(|s| s.metrics.present && scrapable(pod) && s.target == Target::of(pod));
        match state {
            Some(s) => PodMetrics {
                stale: rates::is_stale(
                    s.last_success,
                    s.last_failed,
                    s.in_flight,
                    now,
                    self.stale_bound,
                    self.scrape_timeout,
                ),
                ..s.metrics
            },
            None => PodMetrics {
                stale: true,
                ..PodMetrics::default()
            },
        }
    }
}

/// Runs [`Job`]s over HTTP and sends their [`Outcome`]s back to the control loop.
pub struct Scraper {
    client: reqwest::Client,
    slots: Arc<Semaphore>,
    /// Slots of suspect jobs (pods whose last scrape got no answer), as many again: a dead
    /// pod holds its slot for the connect bound (half the timeout) or the whole timeout, and
    /// scraped from the shared slots, more dead pods than slots (a lost rack: its pods stay
    /// Ready for the node controller's 40 s) queued every live pod's scrape behind them
    /// until all the fleet's metrics read stale. Only a pod's first unanswered scrape
    /// takes a shared slot.
    suspect_slots: Arc<Semaphore>,
    timeout: Duration,
    outcomes: mpsc::UnboundedSender<Outcome>,
}

impl Scraper {
    pub fn new(
        timeout: Duration,
        concurrency: usize,
    ) -> Result<(Scraper, mpsc::UnboundedReceiver<Outcome>), reqwest::Error> {
        let (tx, rx) = mpsc::unbounded_channel();
        let scraper = Scraper {
            client: fetch::client(timeout)?,
            slots: Arc::new(Semaphore::new(concurrency.max(1))),
            suspect_slots: Arc::new(Semaphore::new(concurrency.max(1))),
            timeout,
            outcomes: tx,
        };
        Ok((scraper, rx))
    }

    pub fn spawn(&self, job: Job) {
        let client = self.client.clone();
        let slots = if job.suspect {
            self.suspect_slots.clone()
        } else {
            self.slots.clone()
        };
        let timeout = self.timeout;
        let (url, engine, model) = (job.url.clone(), job.engine, job.model.clone());
        let scrape = async move {
            fetch::scrape_timed(&client, &slots, &url, engine, &model, timeout).await
        };
        tokio::spawn(deliver(job, scrape, self.outcomes.clone()));
    }
}

/// Runs `scrape` and sends `job`'s [`Outcome`], whatever becomes of the scrape: one that
/// panics is a failed scrape ([`ScrapeError::Panicked`]). Unsent, the outcome would leave the
/// pod in flight for ever (`ScrapeBook::plan` skips it: never scraped again, its metrics stale
/// for good) and its round never complete.
async fn deliver(
    job: Job,
    scrape: impl Future<Output = (Result<Reading, ScrapeError>, Duration)>,
    outcomes: mpsc::UnboundedSender<Outcome>,
) {
    let started = Instant::now();
    let (result, elapsed) = match AssertUnwindSafe(scrape).catch_unwind().await {
        Ok(scraped) => scraped,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|m| m.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            // The time of the exchange is unknown; the slot wait is counted in.
            (Err(ScrapeError::Panicked(message)), started.elapsed())
        }
    };
    let _ = outcomes.send(Outcome {
        job,
        result,
        elapsed,
        finished: Instant::now(),
        finished_unix_ms: crate::unix_ms_now(),
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: &str, ready: bool) -> PodRecord {
        PodRecord {
            ready,
            ..PodRecord::sample(name, ip)
        }
    }

    fn ok(job: &Job, at: Instant, running: f64, prompt: f64) -> Outcome {
        Outcome {
            elapsed: Duration::from_millis(1),
            job: job.clone(),
            result: Ok(Reading {
                running: Some(running),
                prompt_tokens: Some(prompt),
                ..Reading::default()
            }),
            finished: at,
            finished_unix_ms: 1_000,
        }
    }

    fn failed(job: &Job, at: Instant) -> Outcome {
        Outcome {
            elapsed: Duration::from_millis(1),
            job: job.clone(),
            result: Err(ScrapeError::Timeout(Duration::from_secs(1))),
            finished: at,
            finished_unix_ms: 2_000,
        }
    }

    fn with(job: &Job, at: Instant, error: ScrapeError) -> Outcome {
        Outcome {
            result: Err(error),
            ..failed(job, at)
        }
    }

    fn refused() -> ScrapeError {
        ScrapeError::Connect("connection refused".into())
    }

    #[test]
    fn a_pod_refusing_connections_after_answering_is_unreachable_until_it_answers() {
        let mut book = ScrapeBook::new(Duration::from_millis(150), 3);
        let fleet = vec![pod("a", "10.0.0.1", true), pod("b", "10.0.0.2", true)];
        let t0 = Instant::now();
        let round = |book: &mut ScrapeBook, a: Option<ScrapeError>, b: Option<ScrapeError>| {
            let jobs = book.plan(&fleet, t0);
            for (job, error) in jobs.iter().zip([a, b]) {
                book.apply(match error {
                    Some(e) => with(job, t0, e),
                    None => ok(job, t0, 1.0, 0.0),
                });
            }
        };
        // No pod of the model has answered yet: every port unreachable may be a network policy.
        for _ in 0..5 {
            round(&mut book, Some(refused()), Some(refused()));
        }
        assert!(!book.unreachable(&fleet[0]) && !book.unreachable(&fleet[1]));

        round(&mut book, None, None);
        round(&mut book, Some(refused()), None);
        round(&mut book, Some(refused()), None);
        assert!(!book.unreachable(&fleet[0]), "two refusals of three");
        // A connection that was accepted resets the count: the engine is alive, if unwell.
        round(
            &mut book,
            Some(ScrapeError::Timeout(Duration::from_secs(1))),
            None,
        );
        round(&mut book, Some(refused()), None);
        round(&mut book, Some(refused()), None);
        assert!(!book.unreachable(&fleet[0]), "the timeout broke the run");
        round(&mut book, Some(refused()), None);
        assert!(book.unreachable(&fleet[0]) && !book.unreachable(&fleet[1]));
        assert!(book.observe(&fleet[0], t0).unreachable);

        // Metrics on a port of their own may come from another process: no verdict.
        let mut exporter = fleet[0].clone();
        exporter.metric_port = 9100;
        let mut apart = ScrapeBook::new(Duration::from_millis(150), 3);
        let jobs = apart.plan(std::slice::from_ref(&exporter), t0);
        apart.apply(ok(&jobs[0], t0, 1.0, 0.0));
        for _ in 0..5 {
            let jobs = apart.plan(std::slice::from_ref(&exporter), t0);
            apart.apply(with(&jobs[0], t0, refused()));
        }
        assert!(!apart.unreachable(&exporter));

        // A new IP is a new pod: it must answer once before it can be unreachable.
        let moved = [pod("a", "10.0.0.7", true), fleet[1].clone()];
        assert!(!book.unreachable(&moved[0]));
        round(&mut book, None, None);
        assert!(!book.unreachable(&fleet[0]), "answered again");

        let mut off = ScrapeBook::new(Duration::from_millis(150), 0);
        let jobs = off.plan(&fleet[..1], t0);
        off.apply(ok(&jobs[0], t0, 1.0, 0.0));
        for _ in 0..5 {
            let jobs = off.plan(&fleet[..1], t0);
            off.apply(with(&jobs[0], t0, refused()));
        }
        assert!(!off.unreachable(&fleet[0]), "0 turns the check off");
    }

    #[test]
    fn a_pod_that_never_answered_is_unreachable_once_a_pod_of_its_model_has() {
        let mut book = ScrapeBook::new(Duration::from_millis(150), 3);
        let mut other = pod("c", "10.0.0.3", true);
        other.model = "other".into();
        let fleet = vec![
            pod("a", "10.0.0.1", true),
            pod("b", "10.0.0.2", true),
            other,
        ];
        let t0 = Instant::now();
        // a answers; b (its engine still loading, say) and c refuse, three times.
        for _ in 0..3 {
            let jobs = book.plan(&fleet, t0);
            for job in &jobs {
                book.apply(if job.key.ends_with("/a") {
                    ok(job, t0, 1.0, 0.0)
                } else {
                    with(job, t0, refused())
                });
            }
        }
        assert!(!book.unreachable(&fleet[0]));
        assert!(
            book.unreachable(&fleet[1]),
            "a sibling answered: b is taken at its word"
        );
        assert!(
            !book.unreachable(&fleet[2]),
            "no pod of c's model ever answered: no verdict"
        );
    }

    #[test]
    fn running_requests_without_progress_for_the_bound_mark_a_pod_stalled() {
        let mut book = ScrapeBook::new(Duration::from_millis(150), 3)
            .with_stalled_after(Duration::from_secs(1));
        let fleet = vec![pod("a", "10.0.0.1", true)];
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let scrape = |book: &mut ScrapeBook, ms: u64, running: f64, prompt: f64| {
            let jobs = book.plan(&fleet, at(ms));
            book.apply(ok(&jobs[0], at(ms), running, prompt));
        };
        scrape(&mut book, 0, 2.0, 100.0);
        scrape(&mut book, 500, 2.0, 100.0);
        assert!(!book.stalled(&fleet[0], at(999)));
        assert!(
            book.stalled(&fleet[0], at(1_000)),
            "a second without progress"
        );
        assert!(book.observe(&fleet[0], at(1_000)).stalled);
        scrape(&mut book, 1_200, 2.0, 100.0);
        assert!(book.stalled(&fleet[0], at(1_200)));
        scrape(&mut book, 1_300, 2.0, 180.0);
        assert!(
            !book.stalled(&fleet[0], at(2_300)),
            "the last scrape saw progress"
        );
        scrape(&mut book, 1_400, 2.0, 180.0);
        assert!(
            !book.stalled(&fleet[0], at(2_200)),
            "the counter moved at 1.3 s"
        );
        assert!(book.stalled(&fleet[0], at(2_300)));
        scrape(&mut book, 2_400, 0.0, 180.0);
        assert!(!book.stalled(&fleet[0], at(9_000)), "nothing running: idle");
        scrape(&mut book, 9_000, 1.0, 180.0);
        scrape(&mut book, 9_100, 1.0, 180.0);
        assert!(
            !book.stalled(&fleet[0], at(9_900)),
            "the clock restarted when idle"
        );
        let jobs = book.plan(&fleet, at(10_100));
        book.apply(failed(&jobs[0], at(10_100)));
        assert!(
            !book.stalled(&fleet[0], at(10_100)),
            "a failed scrape tells nothing"
        );

        let mut off = ScrapeBook::new(Duration::from_millis(150), 3);
        for ms in [0, 500, 5_000] {
            let jobs = off.plan(&fleet, at(ms));
            off.apply(ok(&jobs[0], at(ms), 2.0, 100.0));
        }
        assert!(!off.stalled(&fleet[0], at(9_000)), "off unless asked for");
    }

    #[test]
    fn an_sglang_pod_is_judged_still_only_after_its_idle_gauges_would_have_shown_it() {
        let mut book = ScrapeBook::new(Duration::from_millis(150), 3)
            .with_stalled_after(Duration::from_secs(1));
        let fleet = vec![PodRecord {
            engine: "sglang".into(),
            ..pod("a", "10.0.0.1", true)
        }];
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        // Its last requests finished (the counter moved at 0.5 s) and the running count it
        // logged during the burst stays, unmoving, until SGLang's idle refresh.
        for ms in [0, 500, 20_000, 30_000] {
            let jobs = book.plan(&fleet, at(ms));
            book.apply(ok(
                &jobs[0],
                at(ms),
                2.0,
                100.0 + f64::from(u8::from(ms > 0)),
            ));
        }
        assert!(
            !book.stalled(&fleet[0], at(30_000)),
            "within SGLang's 30 s idle refresh"
        );
        assert!(book.stalled(&fleet[0], at(35_500)), "past it: wedged");
        let jobs = book.plan(&fleet, at(36_000));
        book.apply(ok(&jobs[0], at(36_000), 0.0, 101.0));
        assert!(
            !book.stalled(&fleet[0], at(36_000)),
            "the idle refresh came"
        );
    }

    #[test]
    fn a_trtllm_pod_is_not_judged_on_stillness_its_gauges_cannot_show() {
        let mut book = ScrapeBook::new(Duration::from_millis(150), 3)
            .with_stalled_after(Duration::from_secs(1));
        let fleet = vec![PodRecord {
            engine: "trtllm".into(),
            ..pod("a", "10.0.0.1", true)
        }];
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        // trtllm-serve refreshes its gauges when a request ends: one long answer, or an idle
        // pod whose last running count stayed, reads like this for as long as it lasts.
        for ms in [0, 500, 60_000, 600_000] {
            let jobs = book.plan(&fleet, at(ms));
            book.apply(ok(&jobs[0], at(ms), 2.0, 100.0));
        }
        assert!(!book.stalled(&fleet[0], at(600_000)));
        // A server that answers no scrape is marked still.
        for ms in [601_000, 602_000, 603_000] {
            let jobs = book.plan(&fleet, at(ms));
            book.apply(failed(&jobs[0], at(ms)));
        }
        assert!(book.stalled(&fleet[0], at(603_000)));
    }

    #[test]
    fn a_pod_that_answers_no_scrape_it_accepted_is_marked_stalled() {
        let mut book = ScrapeBook::new(Duration::from_millis(150), 3)
            .with_stalled_after(Duration::from_secs(2));
        let fleet = vec![pod("a", "10.0.0.1", true)];
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let outcome = |book: &mut ScrapeBook, ms: u64, made: fn(&Job, Instant) -> Outcome| {
            let jobs = book.plan(&fleet, at(ms));
            book.apply(made(&jobs[0], at(ms)));
        };
        outcome(&mut book, 0, |job, at| ok(job, at, 0.0, 0.0));
        for ms in [1_000, 2_000] {
            outcome(&mut book, ms, failed);
        }
        assert!(!book.stalled(&fleet[0], at(2_999)), "silent for under 2 s");
        assert!(
            !book.stalled(&fleet[0], at(9_000)),
            "two timeouts: a slow node, not yet a wedged server"
        );
        outcome(&mut book, 2_500, failed);
        assert!(!book.stalled(&fleet[0], at(2_999)), "silent for under 2 s");
        assert!(
            book.stalled(&fleet[0], at(3_000)),
            "silent since 1 s, 3 timeouts"
        );
        assert!(!book.unreachable(&fleet[0]), "it took the connections");
        // An error answer is an answer: the silence is over.
        outcome(&mut book, 3_000, |job, at| {
            with(
                job,
                at,
                ScrapeError::Status(reqwest::StatusCode::INTERNAL_SERVER_ERROR),
            )
        });
        assert!(!book.stalled(&fleet[0], at(9_000)));
        for ms in [4_000, 5_000, 6_000] {
            outcome(&mut book, ms, failed);
        }
        assert!(book.stalled(&fleet[0], at(6_000)));
        assert!(book.observe(&fleet[0], at(6_000)).stalled);
        outcome(&mut book, 6_500, |job, at| ok(job, at, 1.0, 10.0));
        assert!(!book.stalled(&fleet[0], at(6_500)), "answered again");
        // Refusals are the unreachable mark's business, not this one's.
        for ms in [7_000, 8_000, 9_000, 10_000] {
            outcome(&mut book, ms, |job, at| with(job, at, refused()));
        }
        assert!(!book.stalled(&fleet[0], at(12_000)));
        assert!(book.unreachable(&fleet[0]));
    }

    #[test]
    fn rounds_rates_staleness_and_in_flight_skipping() {
        let bound = Duration::from_millis(150);
        let mut book = ScrapeBook::new(bound, 3);
        let fleet = vec![
            pod("a", "10.0.0.1", true),
            pod("b", "10.0.0.2", true),
            pod("c", "", false),
        ];
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);

        let jobs = book.plan(&fleet, t0);
        assert_eq!(jobs.len(), 2, "the pod without an IP is not scraped");
        assert_eq!(jobs[0].url, "http://10.0.0.1:8000/metrics");
        assert!(!book.metrics(&fleet[0], t0).present);
        assert!(book.metrics(&fleet[2], t0).stale);

        assert_eq!(
            book.apply(ok(&jobs[0], ms(10), 3.0, 100.0)),
            None,
            "b still pending"
        );
        let again = book.plan(&fleet, ms(50));
        assert_eq!(again.len(), 1, "a is due again; b is still in flight");
        assert_eq!(again[0].key, "ns/a");
        let round_time = book.apply(ok(&jobs[1], ms(60), 5.0, 0.0));
        assert_eq!(round_time, Some(Duration::from_millis(60)));

        let a = book.metrics(&fleet[0], ms(60));
        assert!(a.present && !a.stale);
        assert_eq!((a.running, a.last_scrape_unix_ms), (3.0, 1_000));

        assert_eq!(
            book.apply(ok(&again[0], ms(510), 4.0, 300.0)),
            Some(Duration::from_millis(460))
        );
        let a = book.metrics(&fleet[0], ms(510));
        assert_eq!(a.running, 4.0);
        assert_eq!(a.prompt_throughput, 400.0, "200 tokens over 500 ms");

        assert!(!book.metrics(&fleet[0], ms(660)).stale);
        assert!(
            book.metrics(&fleet[0], ms(661)).stale,
            "older than 3 intervals"
        );

        let jobs3 = book.plan(&fleet, ms(515));
        assert_eq!(jobs3.len(), 2);
        book.apply(failed(&jobs3[1], ms(520)));
        let b = book.metrics(&fleet[1], ms(520));
        assert!(
            b.present && b.stale,
            "a failed scrape keeps the last values, flagged stale"
        );
        assert_eq!(b.running, 5.0);
        book.apply(failed(&jobs3[0], ms(530)));
        assert!(book.metrics(&fleet[0], ms(530)).stale, "failed");
        assert!(book.idle());
    }

    #[test]
    fn a_pod_slower_to_answer_than_the_stale_bound_stays_fresh_while_its_scrape_is_on_its_way() {
        let mut book = ScrapeBook::new(Duration::from_millis(150), 3)
            .with_scrape_timeout(Duration::from_secs(1));
        let fleet = vec![pod("a", "10.0.0.1", true)];
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let jobs = book.plan(&fleet, t0);
        book.apply(ok(&jobs[0], t0, 1.0, 0.0));
        let slow = book.plan(&fleet, ms(50));
        assert_eq!(slow.len(), 1);
        assert!(
            !book.metrics(&fleet[0], ms(200)).stale,
            "answered 200 ms ago, asked again 50 ms after: on its way"
        );
        assert!(!book.metrics(&fleet[0], ms(1_050)).stale);
        assert!(
            book.metrics(&fleet[0], ms(1_051)).stale,
            "the scrape in flight is past its timeout"
        );
        book.apply(ok(&slow[0], ms(260), 1.0, 0.0));
        assert!(!book.metrics(&fleet[0], ms(300)).stale, "answered");
        assert!(
            book.metrics(&fleet[0], ms(411)).stale,
            "nothing on its way: the bound alone"
        );
    }

    #[test]
    fn a_pod_whose_scrape_got_no_answer_is_scraped_as_a_suspect_until_it_answers() {
        let mut book = ScrapeBook::new(Duration::from_millis(150), 3);
        let fleet = vec![pod("a", "10.0.0.1", true)];
        let t0 = Instant::now();
        let mut next = |outcome: Option<ScrapeError>| {
            let job = book.plan(&fleet, t0).remove(0);
            let suspect = job.suspect;
            book.apply(match outcome {
                Some(e) => with(&job, t0, e),
                None => ok(&job, t0, 1.0, 0.0),
            });
            suspect
        };
        assert!(!next(Some(ScrapeError::Timeout(Duration::from_secs(1)))));
        assert!(next(Some(refused())), "after a timeout");
        assert!(
            next(Some(ScrapeError::Status(reqwest::StatusCode::BAD_GATEWAY))),
            "after a refusal"
        );
        assert!(!next(None), "an error answer is an answer");
        assert!(!next(None));
    }

    /// Live pods' scrapes never wait for a slot behind suspects': with one slot each, a
    /// live pod's scrape finishes while a suspect's hangs.
    #[tokio::test]
    async fn a_suspect_pods_hung_scrape_holds_no_live_pods_slot() {
        let hung = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let hung_addr = hung.local_addr().expect("addr");
        let live = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let live_addr = live.local_addr().expect("addr");
        tokio::spawn(async move {
            // Accepts and never answers; the connections stay open until the test ends.
            let mut held = Vec::new();
            while let Ok((conn, _)) = hung.accept().await {
                held.push(conn);
            }
        });
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut conn, _)) = live.accept().await {
                let mut request = [0u8; 1024];
                let _ = conn.read(&mut request).await;
                let body = "vllm:num_requests_running{model_name=\"m\"} 1\n";
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
            }
        });
        let (scraper, mut outcomes) = Scraper::new(Duration::from_secs(30), 1).expect("scraper");
        let job = |key: &str, addr: std::net::SocketAddr, suspect| Job {
            key: key.into(),
            epoch: 1,
            round: 1,
            url: format!("http://{addr}/metrics"),
            engine: Engine::Vllm,
            model: "m".into(),
            suspect,
        };
        scraper.spawn(job("ns/dead", hung_addr, true));
        scraper.spawn(job("ns/live", live_addr, false));
        let first = outcomes.recv().await.expect("an outcome");
        assert_eq!(first.job.key, "ns/live", "{:?}", first.result);
        assert!(first.result.is_ok(), "{:?}", first.result);
    }

    #[tokio::test]
    async fn a_scrape_that_panics_is_a_failed_scrape_and_its_pod_is_scraped_again() {
        let mut book = ScrapeBook::new(Duration::from_millis(150), 3);
        let fleet = vec![pod("a", "10.0.0.1", true)];
        let t0 = Instant::now();
        let jobs = book.plan(&fleet, t0);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let planned = jobs.len();
        let scrape = async move {
            if planned == 1 {
                panic!("an exposition the parser did not expect");
            }
            (Err(ScrapeError::Closed), Duration::ZERO)
        };
        tokio::spawn(deliver(jobs[0].clone(), scrape, tx));
        let outcome = rx.recv().await.expect("an outcome, panic or not");
        assert!(
            matches!(&outcome.result, Err(ScrapeError::Panicked(m)) if m.contains("parser")),
            "{:?}",
            outcome.result
        );
        assert!(book.apply(outcome).is_some(), "the round completes");
        assert!(book.idle());
        assert!(book.metrics(&fleet[0], t0).stale);
        assert_eq!(book.plan(&fleet, t0).len(), 1, "scraped again");
    }

    #[test]
    fn a_read_short_of_a_dp_rank_is_not_the_base_of_the_next_rates() {
        let mut book = ScrapeBook::new(Duration::from_millis(150), 3);
        let fleet = vec![pod("a", "10.0.0.1", true)];
        let t0 = Instant::now();
        let mut scrape = |ms: u64, prompt: f64| {
            let at = t0 + Duration::from_millis(ms);
            let jobs = book.plan(&fleet, at);
            book.apply(ok(&jobs[0], at, 1.0, prompt));
            book.metrics(&fleet[0], at).prompt_throughput
        };
        scrape(0, 8e9);
        assert_eq!(scrape(50, 8e9 + 5_000.0), 100_000.0);
        assert_eq!(
            scrape(100, 7e9 + 5_000.0),
            100_000.0,
            "a rank missing: the last rate stands"
        );
        assert_eq!(
            scrape(150, 8e9 + 25_000.0),
            200_000.0,
            "the rank back: 20 000 tokens over the 100 ms since the last good read"
        );
        // A fall read twice is believed (a rank gone for good): the rates count from there.
        assert_eq!(scrape(200, 7e9), 200_000.0);
        assert_eq!(scrape(250, 7e9 + 1_000.0), 200_000.0);
        assert_eq!(scrape(300, 7e9 + 3_000.0), 40_000.0);
    }

    #[test]
    fn plan_skips_in_flight_pods_and_forgets_departed_ones() {
        let mut book = ScrapeBook::new(Duration::from_millis(150), 3);
        let t0 = Instant::now();
        let fleet = vec![pod("a", "10.0.0.1", true), pod("b", "10.0.0.2", true)];
        let jobs = book.plan(&fleet, t0);
        assert_eq!(jobs.len(), 2);
        assert!(book.plan(&fleet, t0).is_empty(), "both still in flight");
        assert!(!book.idle());

        // b restarts with a new IP while its old scrape runs: the old result must not count.
        let moved = vec![pod("a", "10.0.0.1", true), pod("b", "10.0.0.9", true)];
        let jobs2 = book.plan(&moved, t0);
        assert_eq!(jobs2.len(), 1);
        assert_eq!(jobs2[0].url, "http://10.0.0.9:8000/metrics");
        book.apply(ok(&jobs[1], t0, 9.0, 0.0));
        assert!(
            !book.metrics(&moved[1], t0).present,
            "result for the old IP dropped"
        );
        book.apply(ok(&jobs2[0], t0, 2.0, 0.0));
        assert_eq!(book.metrics(&moved[1], t0).running, 2.0);

        // a leaves the fleet while in flight.
        let only_b = vec![pod("b", "10.0.0.9", true)];
        let jobs3 = book.plan(&only_b, t0);
        assert_eq!(jobs3.len(), 1);
        book.apply(ok(&jobs[0], t0, 1.0, 0.0));
        assert!(!book.metrics(&fleet[0], t0).present);
        book.apply(ok(&jobs3[0], t0, 1.0, 0.0));
        assert!(book.idle(), "every round accounted for");

        let not_ready = vec![pod("b", "10.0.0.9", false)];
        assert!(book.plan(&not_ready, t0).is_empty());
        assert!(
            !book.metrics(&not_ready[0], t0).present,
            "not-ready pods publish no metrics"
        );
    }
}
