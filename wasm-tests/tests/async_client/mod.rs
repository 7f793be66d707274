//! An async client for the tests that need what the blocking one cannot do: HTTP/2
//! (several streams on one connection, a stream cancelled while its connection stays).
// Each test crate that includes this module uses its own part of it.
#![allow(dead_code)]

use pd_wasm_tests::http::Response;

/// A runtime for the async HTTP/2 client.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// An HTTP/2 client (h2c with prior knowledge, one connection) or an HTTP/1.1 one.
pub fn client(http2: bool) -> reqwest::Client {
    let builder = reqwest::Client::builder().no_proxy();
    let builder = if http2 {
        builder.http2_prior_knowledge().pool_max_idle_per_host(1)
    } else {
        builder.http1_only()
    };
    builder.build().expect("client")
}

/// The whole answer, as the blocking client's [`Response`].
pub async fn answer(r: reqwest::Response) -> Response {
    let status = r.status().as_u16();
    let headers = r
        .headers()
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let body = r.bytes().await.expect("whole body").to_vec();
    Response {
        status,
        headers,
        body,
        complete: true,
    }
}
