//! An async client for the tests that need what the blocking one cannot do: HTTP/2
//! (several streams on one connection, a stream cancelled while its connection stays, a
//! body followed by trailers).
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
    let headers = pairs(r.headers());
    let body = r.bytes().await.expect("whole body").to_vec();
    Response {
        status,
        headers,
        body,
        complete: true,
    }
}

/// POSTs `body` over a fresh h2c connection as one DATA frame followed by trailers (so the
/// body's last frame does not end the stream), and reads the whole answer.
pub async fn post_with_trailers(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (send, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(connection);
    let mut send = send.ready().await.expect("a stream");
    let mut request = http::Request::post(format!("http://{addr}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(()).expect("request");
    let (answer, mut stream) = send.send_request(request, false).expect("headers sent");
    stream
        .send_data(body.to_vec().into(), false)
        .expect("body sent");
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-checksum", http::HeaderValue::from_static("none"));
    stream.send_trailers(trailers).expect("trailers sent");
    let answer = answer.await.expect("response headers");
    let status = answer.status().as_u16();
    let headers = pairs(answer.headers());
    let mut received = answer.into_body();
    let mut body = Vec::new();
    while let Some(chunk) = received.data().await {
        let chunk = chunk.expect("body chunk");
        let _ = received.flow_control().release_capacity(chunk.len());
        body.extend_from_slice(&chunk);
    }
    Response {
        status,
        headers,
        body,
        complete: true,
    }
}

/// Response headers as the blocking client's [`Response`] holds them.
fn pairs(headers: &http::HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("").to_string()))
        .collect()
}

/// POSTs a chat body to the gateway with `routing-strategy: pd` on `client`.
pub async fn pd_chat(
    client: &reqwest::Client,
    gateway: &str,
    body: &serde_json::Value,
) -> reqwest::Response {
    client
        .post(format!("http://{gateway}/v1/chat/completions"))
        .header("routing-strategy", "pd")
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("response headers")
}
