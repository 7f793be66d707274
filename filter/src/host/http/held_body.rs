//! Request bodies kept in the VM while the request waits on a callout, within the VM's
//! `max_held_body_bytes` budget: a flood of waiting requests is refused, not held until the
//! worker runs out of memory.

use super::PdHttp;
use crate::core::errors::RouteError;
use crate::core::held_body::HeldBody;

impl PdHttp {
    /// Keeps `body`, and `index` bytes of its member index, in this VM's account of held
    /// bodies while the request waits on a callout; refused (503) when that would take the
    /// account past `max_held_body_bytes` (see `core::held_body`). The bytes go back when
    /// the returned body is dropped or unwrapped, however the request ends.
    pub(super) fn hold_body(&self, body: Vec<u8>, index: usize) -> Result<HeldBody, RouteError> {
        let vm = self.vm.borrow();
        vm.held_bodies
            .hold(body, index, vm.plugin.max_held_body_bytes)
            .map_err(|e| self.over_budget(e))
    }

    /// Whether `bytes` more would fit in this VM's account of held bodies (see
    /// [`PdHttp::hold_body`]), for a refusal before work it would waste.
    pub(super) fn body_fits(&self, bytes: usize) -> Result<(), RouteError> {
        let vm = self.vm.borrow();
        vm.held_bodies
            .fits(bytes, vm.plugin.max_held_body_bytes)
            .map_err(|e| self.over_budget(e))
    }

    fn over_budget(&self, e: crate::core::held_body::OverBudget) -> RouteError {
        log::debug!("request {}: {e}", self.request_id);
        RouteError::HeldBodiesOverBudget { limit: e.limit }
    }
}
