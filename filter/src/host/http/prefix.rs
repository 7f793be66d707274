//! The prefix index in the request path: looked up by the selections that score it, warmed
//! with the pod they chose, and shared with the other workers so their next selection knows.

use std::borrow::Cow;

use super::PdHttp;
use crate::core::fleet::ModelView;
use crate::core::prefix::EventRef;
use crate::core::request::RoutingRequest;
use crate::core::tokenize;
use crate::host::{Clock, VmState};

impl PdHttp {
    /// Publishes the prefix-event batch this request's event joined, unless another request
    /// already did. Called when the response starts (and at the end, for requests whose
    /// response never started), so a client that has this request's answer finds its prefix
    /// known to every worker's next selection.
    pub(super) fn send_prefix_batch(&mut self, clock: &mut Clock) {
        if let Some(batch) = self.prefix_batch.take() {
            let mut vm = self.vm.borrow_mut();
            if vm.prefix_batches_sent == batch {
                crate::section!(
                    "prefix_batch.send",
                    crate::host::prefix_sharing::publish(&mut vm, clock.ms())
                );
            }
        }
    }

    /// Warms the prefix index with the pod chosen for `stream`, here and on every other
    /// worker. Published with the events gathered until this request's response starts (see
    /// `send_prefix_batch`): one shared-data write for many selections. A VM alone in the
    /// process has nobody to tell.
    pub(super) fn record_prefix(
        &mut self,
        vm: &mut VmState,
        model: &str,
        pod: &str,
        stream: &[u8],
        now: u64,
    ) {
        if stream.is_empty() {
            return;
        }
        let event = EventRef {
            model,
            pod,
            stream,
            at_ms: now,
        };
        crate::section!(
            "select.prefix_event",
            vm.prefix
                .add_prefix(event.stream, event.model, event.pod, now)
        );
        if !vm.peers.is_empty() {
            vm.prefix_outbox.push(event);
            self.prefix_batch = Some(vm.prefix_batches_sent);
            if vm.prefix_outbox.bytes() >= crate::core::prefix::log::MAX_BATCH_BYTES {
                crate::section!(
                    "select.publish",
                    crate::host::prefix_sharing::publish(vm, now)
                );
            }
        }
    }

    /// Looks the prompt up in this worker's prefix index, after reading what the others
    /// published: the prompt's whole blocks, by slot how much of them each pod `slot_of`
    /// names holds, and the token stream's length in bytes. Only the pods holding the
    /// prompt's prefix are touched, not every candidate.
    pub(super) fn prefix_match<'r>(
        vm: &mut VmState,
        model: &ModelView,
        req: &'r RoutingRequest,
        now: u64,
        slot_of: impl Fn(&str) -> Option<usize>,
    ) -> (Cow<'r, [u8]>, Vec<f64>, usize) {
        crate::section!(
            "select.prefix_catch_up",
            crate::host::prefix_sharing::catch_up(vm, now, true)
        );
        crate::section_scope!("select.prefix_lookup");
        let p = vm.prefix_settings;
        let tokens = tokenize::token_stream(p.tokenizer, &req.prompt_text);
        let token_bytes = tokens.len();
        let stream = tokenize::whole_blocks(tokens, vm.prefix.block_size());
        let mut pct = vec![0.0; model.pods.len()];
        vm.prefix
            .match_candidates(&stream, &req.model, slot_of, |slot, m| {
                if let Some(p) = pct.get_mut(slot) {
                    *p = f64::from(m);
                }
            });
        (stream, pct, token_bytes)
    }
}
