//! The core's [`Store`] over Envoy shared data, which every worker VM with our `vm_id` sees.

use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;

use crate::core::ledger::{Store, StoreError};

pub struct SharedData;

impl Store for SharedData {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        crate::section!("shared.get", hostcalls::get_shared_data(key))
            .map_err(|s| StoreError::Host(format!("get {key}: {s:?}")))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, StoreError> {
        match crate::section!(
            "shared.set",
            hostcalls::set_shared_data(key, Some(value), cas)
        ) {
            Ok(()) => Ok(true),
            Err(Status::CasMismatch) => Ok(false),
            Err(s) => Err(StoreError::Host(format!("set {key}: {s:?}"))),
        }
    }
}
