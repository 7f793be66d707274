//! The request headers in one host call, read in place (`core::header_map`) instead of through
//! the SDK's `get_http_request_headers_bytes`, which copies every name and value into an
//! allocation of its own before `Inbound::read` keeps the few the filter needs.

use proxy_wasm::types::MapType;

use crate::core::header_map;
use crate::core::inbound::Inbound;

#[link(wasm_import_module = "env")]
extern "C" {
    /// The SDK's own import (proxy-wasm 0.2.5 `hostcalls::get_map_bytes`); the status is read
    /// as a plain `u32` (0 = Ok), so a value the SDK's `Status` does not know stays harmless.
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
}

/// The serialized header map `map` (empty when the host returns none), or `None` when the
/// host refuses the call.
fn serialized(map: MapType) -> Option<Vec<u8>> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: as in the SDK's `get_map_bytes`: the host writes a buffer of `size` bytes it
    // allocated through this module's `proxy_on_memory_allocate` (the SDK's, a boxed slice of
    // exactly `size` bytes), whose ownership passes to the caller.
    unsafe {
        if proxy_get_header_map_pairs(map, &mut data, &mut size) != 0 {
            return None;
        }
        if data.is_null() {
            return Some(Vec::new());
        }
        Some(Vec::from_raw_parts(data, size, size))
    }
}

/// What the filter needs from the request headers ([`Inbound::read`]), from one read of the
/// serialized map parsed in place. Should the host refuse the call or hand back a buffer that
/// is not a header map, the SDK's getter reads them instead (as before this read existed).
pub fn read_request(dst_header: &str, explain_header: &str, trap_header: Option<&str>) -> Inbound {
    let buf = serialized(MapType::HttpRequestHeaders);
    if let Some(Ok(pairs)) = buf.as_deref().map(header_map::pairs) {
        return Inbound::read(pairs, dst_header, explain_header, trap_header);
    }
    log::debug!("request headers: unreadable serialized map; read through the SDK");
    let pairs =
        proxy_wasm::hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default();
    Inbound::read(
        pairs.iter().map(|(n, v)| (n.as_str(), v.as_slice())),
        dst_header,
        explain_header,
        trap_header,
    )
}
