//! The fleet file source: re-reads a YAML file and publishes it whenever its bytes change.
//!
//! Polling the content (not mtime or inotify) because editors and `kubectl ... > file` replace
//! files in ways that change inode and mtime unpredictably, and mtime has one-second resolution
//! on some filesystems, which would hide a second edit within the same second.
//!
//! A file rewritten in place (`kubectl get pods -o yaml > fleet.yaml`) is read mid-write now
//! and then: empty just after the shell truncated it, or cut short. Either would replace the
//! fleet for a refresh and make the scraper forget the history of every pod missing from it.
//! So new bytes are taken only once two consecutive reads, one refresh apart, return them
//! (a write in progress changes between the two), and a file holding no YAML document at all
//! is refused like a broken one. Renaming a complete file into place never needs either.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::MissedTickBehavior;

use super::{FleetPublisher, FleetSource, Shutdown, SourceError};
use crate::fleet::{self, FleetError, PodRecord};

/// What one re-read found.
#[derive(Debug)]
pub enum Poll {
    /// Same bytes as last time, or a failure already reported.
    Unchanged,
    /// New bytes, seen once: taken if the next read returns them again.
    Settling,
    Updated(Vec<PodRecord>),
    /// The file changed (or vanished) into something unusable; the fleet must stay as it was.
    Rejected(SourceError),
}

pub struct FileSource {
    path: PathBuf,
    interval: Duration,
    /// Bytes of the last read, good or bad, so a broken file is reported once, not every tick.
    last_bytes: Option<Vec<u8>>,
    /// New bytes seen by the last read only, waiting for a second read to confirm them.
    settling: Option<Vec<u8>>,
    /// Last read error, so a missing file is reported once until it changes.
    last_read_error: Option<String>,
}

/// Reads [`FileSource::load`] makes, one poll period apart, for the file to hold still before
/// start-up gives up on it.
pub const LOAD_READS: u32 = 20;

/// The longest the file goes unread: a change is taken on the second read that sees it, so
/// with a long refresh interval (pd-control scraping rarely) a fleet edit, and start-up,
/// would otherwise wait two of them. Reading a small file once a second costs nothing.
const MAX_POLL: Duration = Duration::from_secs(1);

impl FileSource {
    /// Polls `path` every `interval` (pd-control's refresh interval), at most [`MAX_POLL`].
    pub fn new(path: impl Into<PathBuf>, interval: Duration) -> FileSource {
        FileSource {
            path: path.into(),
            interval: interval.min(MAX_POLL),
            last_bytes: None,
            settling: None,
            last_read_error: None,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn parse(&self, bytes: &[u8]) -> Result<Vec<PodRecord>, SourceError> {
        let text = std::str::from_utf8(bytes).map_err(|_| SourceError::NotUtf8 {
            path: self.path.display().to_string(),
        })?;
        fleet::parse_written_records(text)?.ok_or_else(|| SourceError::Empty {
            path: self.path.display().to_string(),
        })
    }

    /// Re-reads the file once.
    pub async fn poll(&mut self) -> Poll {
        let bytes = match tokio::fs::read(&self.path).await {
            Ok(bytes) => bytes,
            Err(source) => {
                // Whatever comes back must be seen twice anew.
                self.settling = None;
                let message = source.to_string();
                if self.last_read_error.as_deref() == Some(message.as_str()) {
                    return Poll::Unchanged;
                }
                self.last_read_error = Some(message);
                return Poll::Rejected(SourceError::Fleet(FleetError::Read {
                    path: self.path.display().to_string(),
                    source,
                }));
            }
        };
        self.last_read_error = None;
        if self.last_bytes.as_deref() == Some(bytes.as_slice()) {
            // Back to what is in force (e.g. rewritten with the same content): nothing to take.
            self.settling = None;
            return Poll::Unchanged;
        }
        if self.settling.as_deref() != Some(bytes.as_slice()) {
            self.settling = Some(bytes);
            return Poll::Settling;
        }
        self.settling = None;
        let parsed = self.parse(&bytes);
        self.last_bytes = Some(bytes);
        match parsed {
            Ok(pods) => Poll::Updated(pods),
            Err(e) => Poll::Rejected(e),
        }
    }
}

impl FleetSource for FileSource {
    fn describe(&self) -> String {
        format!("fleet file {}", self.path.display())
    }

    fn kind(&self) -> &'static str {
        "file"
    }

    /// The first fleet, by the same rule as every re-read: bytes two reads agree on, holding a
    /// document. Start-up waits a poll period for the second read; a file still changing after
    /// [`LOAD_READS`] reads is an error rather than a fleet picked mid-write.
    async fn load(&mut self) -> Result<Vec<PodRecord>, SourceError> {
        self.last_bytes = None;
        self.settling = None;
        self.last_read_error = None;
        for _ in 0..LOAD_READS {
            match self.poll().await {
                Poll::Updated(pods) => return Ok(pods),
                Poll::Rejected(error) => return Err(error),
                Poll::Settling | Poll::Unchanged => tokio::time::sleep(self.interval).await,
            }
        }
        Err(SourceError::Unsettled {
            path: self.path.display().to_string(),
            reads: LOAD_READS,
        })
    }

    async fn watch(mut self, publisher: FleetPublisher, mut shutdown: Shutdown) {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Skip);
        ticker.tick().await; // the first tick is immediate and `load` has just read the file
        let source = self.describe();
        loop {
            tokio::select! {
                _ = shutdown.requested() => return,
                _ = ticker.tick() => {}
            }
            match self.poll().await {
                Poll::Unchanged | Poll::Settling => {}
                Poll::Updated(pods) => {
                    let count = pods.len();
                    if publisher.publish(pods) {
                        tracing::info!(%source, pods = count, "fleet reloaded");
                    }
                }
                Poll::Rejected(error) => publisher.reload_failed(&source, &error),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::watch;

    use super::*;
    use crate::stats::Stats;

    fn pod_yaml(names: &[&str]) -> String {
        names
            .iter()
            .map(|n| {
                format!(
                    "kind: Pod\nmetadata:\n  name: {n}\n  labels: {{model.aibrix.ai/name: m}}\nstatus: {{podIP: 127.0.0.1}}\n---\n"
                )
            })
            .collect()
    }

    fn names(pods: &[PodRecord]) -> Vec<&str> {
        pods.iter().map(|p| p.name.as_str()).collect()
    }

    /// The poll that takes an edit: the first read of new bytes only notes them.
    async fn settled(source: &mut FileSource) -> Poll {
        let first = source.poll().await;
        assert!(
            matches!(first, Poll::Settling),
            "first read of an edit: {first:?}"
        );
        source.poll().await
    }

    /// A source loaded from `yaml`, and the publisher holding what it loaded.
    async fn loaded(dir: &Path, yaml: &str) -> (FileSource, FleetPublisher, Arc<Stats>) {
        let path = dir.join("fleet.yaml");
        std::fs::write(&path, yaml).unwrap();
        let mut source = FileSource::new(&path, Duration::from_millis(1));
        let initial = source.load().await.unwrap();
        let stats = Arc::new(Stats::default());
        let (tx, _rx) = watch::channel(Arc::new(initial));
        (source, FleetPublisher::new(tx, stats.clone()), stats)
    }

    /// Applies a poll's verdict as `watch` does.
    fn apply(publisher: &FleetPublisher, poll: Poll) {
        match poll {
            Poll::Updated(pods) => {
                publisher.publish(pods);
            }
            Poll::Rejected(e) => publisher.reload_failed("test", &e),
            Poll::Unchanged | Poll::Settling => {}
        }
    }

    #[tokio::test]
    async fn a_file_truncated_for_rewriting_keeps_the_last_fleet() {
        let dir = tempfile::tempdir().unwrap();
        let (mut source, publisher, stats) = loaded(dir.path(), &pod_yaml(&["a", "b"])).await;
        // What `cmd > fleet.yaml` leaves while cmd runs, however long it takes.
        for empty in ["", " \n\n", "# regenerated below\n", "---\n"] {
            std::fs::write(source.path(), empty).unwrap();
            for _ in 0..3 {
                apply(&publisher, source.poll().await);
                assert_eq!(names(&publisher.current()), ["a", "b"], "after {empty:?}");
            }
        }
        assert_eq!(
            stats.fleet_reload_errors_total(),
            4,
            "each refusal counted once"
        );
        std::fs::write(source.path(), pod_yaml(&["a", "b", "c"])).unwrap();
        apply(&publisher, settled(&mut source).await);
        assert_eq!(names(&publisher.current()), ["a", "b", "c"]);
    }

    #[tokio::test]
    async fn only_the_finished_write_is_published() {
        let dir = tempfile::tempdir().unwrap();
        let (mut source, publisher, _) = loaded(dir.path(), &pod_yaml(&["a", "b", "c"])).await;
        let full = pod_yaml(&["a", "b", "c", "d"]);
        // Cut at a document boundary: valid YAML naming fewer pods.
        let cut = full.find("name: b").unwrap();
        let partial = &full[..full[..cut].rfind("---\n").unwrap() + 4];
        assert_eq!(fleet::parse_records(partial).unwrap().len(), 1);
        std::fs::write(source.path(), partial).unwrap();
        apply(&publisher, source.poll().await);
        assert_eq!(names(&publisher.current()), ["a", "b", "c"], "mid-write");
        std::fs::write(source.path(), &full).unwrap();
        apply(&publisher, source.poll().await);
        assert_eq!(
            names(&publisher.current()),
            ["a", "b", "c"],
            "changed again"
        );
        apply(&publisher, source.poll().await);
        assert_eq!(
            names(&publisher.current()),
            ["a", "b", "c", "d"],
            "held still"
        );
    }

    #[tokio::test]
    async fn a_rewrite_with_the_same_content_is_no_change() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = pod_yaml(&["a"]);
        let (mut source, publisher, stats) = loaded(dir.path(), &yaml).await;
        std::fs::write(source.path(), "").unwrap();
        assert!(matches!(source.poll().await, Poll::Settling));
        std::fs::write(source.path(), &yaml).unwrap();
        assert!(matches!(source.poll().await, Poll::Unchanged));
        assert!(matches!(source.poll().await, Poll::Unchanged));
        assert_eq!(stats.fleet_reload_errors_total(), 0);
        assert_eq!(names(&publisher.current()), ["a"]);
    }

    #[tokio::test]
    async fn reread_publishes_changes_and_keeps_old_fleet_on_bad_edit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet.yaml");
        std::fs::write(&path, pod_yaml(&["a", "b"])).unwrap();
        let mut source = FileSource::new(&path, Duration::from_millis(50));
        let initial = source.load().await.unwrap();
        assert_eq!(names(&initial), ["a", "b"]);

        let stats = Arc::new(Stats::default());
        let (tx, _rx) = watch::channel(Arc::new(initial));
        let publisher = FleetPublisher::new(tx, stats.clone());

        assert!(
            matches!(source.poll().await, Poll::Unchanged),
            "same bytes are not re-parsed"
        );

        std::fs::write(&path, pod_yaml(&["a"])).unwrap();
        let Poll::Updated(pods) = settled(&mut source).await else {
            panic!("edit not seen")
        };
        assert!(publisher.publish(pods));
        assert_eq!(names(&publisher.current()), ["a"]);

        std::fs::write(&path, "kind: [\n").unwrap();
        match settled(&mut source).await {
            Poll::Rejected(e) => publisher.reload_failed("test", &e),
            other => panic!("broken edit accepted: {other:?}"),
        }
        assert_eq!(
            names(&publisher.current()),
            ["a"],
            "a bad edit never wipes the fleet"
        );
        assert_eq!(stats.fleet_reload_errors_total(), 1);
        assert!(
            matches!(source.poll().await, Poll::Unchanged),
            "a broken file is reported once"
        );

        std::fs::remove_file(&path).unwrap();
        assert!(matches!(source.poll().await, Poll::Rejected(_)));
        assert!(
            matches!(source.poll().await, Poll::Unchanged),
            "a missing file is reported once"
        );

        std::fs::write(&path, pod_yaml(&["c"])).unwrap();
        let Poll::Updated(pods) = settled(&mut source).await else {
            panic!("recovery not seen")
        };
        assert_eq!(names(&pods), ["c"]);
        assert!(!publisher.publish(pods.clone()) || names(&publisher.current()) == ["c"]);
        assert!(
            !publisher.publish(pods),
            "an identical fleet is not re-sent"
        );
    }

    #[tokio::test]
    async fn load_failure_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut missing = FileSource::new(dir.path().join("nope.yaml"), Duration::from_millis(50));
        assert!(matches!(
            missing.load().await,
            Err(SourceError::Fleet(FleetError::Read { .. }))
        ));
        let path = dir.path().join("bad.yaml");
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        let mut bad = FileSource::new(&path, Duration::from_millis(50));
        assert!(matches!(bad.load().await, Err(SourceError::NotUtf8 { .. })));
        std::fs::write(&path, "\n").unwrap();
        let mut empty = FileSource::new(&path, Duration::from_millis(1));
        let error = empty.load().await.expect_err("no fleet to start on");
        assert!(matches!(error, SourceError::Empty { .. }), "{error:?}");
        assert!(error.to_string().contains("items: []"), "{error}");
        std::fs::write(&path, "apiVersion: v1\nkind: List\nitems: []\n").unwrap();
        assert_eq!(
            empty.load().await.unwrap(),
            [],
            "a fleet without pods, said so"
        );
    }
}
