//! The pooled HTTP/1.1 client every request to a worker goes through (completions, health
//! checks, remote tokenization): keep-alive, `TCP_NODELAY`, `--connect-timeout-ms`.

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::time::Duration;

pub type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// A client whose connections wait at most `connect_timeout` to open and stay pooled for a
/// minute of idleness.
pub fn build(connect_timeout: Duration) -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    connector.enforce_http(true);
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .build(connector)
}

/// An error with its causes, one after another.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    let mut depth = 0;
    while let Some(cause) = source
        && depth < 8
    {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
        depth += 1;
    }
    text
}
