//! A request's client leaving before its answer was complete, recorded in the pod's request
//! log (`client_gone`), so tests can tell whether the gateway ended a leg at the engine when
//! its own client went away (real vLLM aborts a request whose HTTP client disconnected).
//!
//! hyper drops a request's handler future, or its streamed body, when the connection closes
//! under it; a [`Departure`] held there sees that as a drop without [`Departure::finish`].

use std::sync::Arc;

use crate::pod::PodState;

/// Held by a request until its answer is complete; dropped before that, it marks the
/// request's log entry `client_gone`.
#[derive(Debug)]
pub struct Departure {
    pod: Arc<PodState>,
    seq: u64,
    finished: bool,
}

impl Departure {
    /// Watches the request logged as `seq` on `pod`.
    pub fn new(pod: Arc<PodState>, seq: u64) -> Departure {
        Departure {
            pod,
            seq,
            finished: false,
        }
    }

    /// The answer is complete (an error answer or an abort's included): nothing to record.
    pub fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for Departure {
    fn drop(&mut self) {
        if !self.finished {
            self.pod.log.update(self.seq, |e| e.client_gone = true);
        }
    }
}
