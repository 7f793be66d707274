//! The fleet file source: re-reads a YAML file and publishes it whenever its bytes change.
//!
//! Polling the content (not mtime or inotify) because editors and `kubectl ... > file` replace
//! files in ways that change inode and mtime unpredictably, and mtime has one-second resolution
//! on some filesystems, which would hide a second edit within the same second.

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
    Updated(Vec<PodRecord>),
    /// The file changed (or vanished) into something unusable; the fleet must stay as it was.
    Rejected(SourceError),
}

pub struct FileSource {
    path: PathBuf,
    interval: Duration,
    /// Bytes of the last read, good or bad, so a broken file is reported once, not every tick.
    last_bytes: Option<Vec<u8>>,
    /// Last read error, so a missing file is reported once until it changes.
    last_read_error: Option<String>,
}

impl FileSource {
    pub fn new(path: impl Into<PathBuf>, interval: Duration) -> FileSource {
        FileSource {
            path: path.into(),
            interval,
            last_bytes: None,
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
        Ok(fleet::parse_records(text)?)
    }

    /// Re-reads the file once.
    pub async fn poll(&mut self) -> Poll {
        let bytes = match tokio::fs::read(&self.path).await {
            Ok(bytes) => bytes,
            Err(source) => {
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
            return Poll::Unchanged;
        }
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

    async fn load(&mut self) -> Result<Vec<PodRecord>, SourceError> {
        let bytes = tokio::fs::read(&self.path)
            .await
            .map_err(|source| FleetError::Read {
                path: self.path.display().to_string(),
                source,
            })?;
        let pods = self.parse(&bytes)?;
        self.last_bytes = Some(bytes);
        Ok(pods)
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
                Poll::Unchanged => {}
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
        let Poll::Updated(pods) = source.poll().await else {
            panic!("edit not seen")
        };
        assert!(publisher.publish(pods));
        assert_eq!(names(&publisher.current()), ["a"]);

        std::fs::write(&path, "kind: [\n").unwrap();
        match source.poll().await {
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
        let Poll::Updated(pods) = source.poll().await else {
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
    }
}
