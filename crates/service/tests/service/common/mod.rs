//! Shared helpers of the service's integration tests: an in-process app driven with `oneshot`,
//! a panicking keep-alive client, and a `nats-server` of a test's own ([`nats`]).
#![allow(dead_code)]

pub mod nats;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use kvroute_service::{AppState, ServeConfig, app};
use serde_json::Value;
use std::sync::Arc;
use tower::ServiceExt;

#[derive(Clone)]
pub struct TestApp {
    pub state: Arc<AppState>,
}

pub struct Reply {
    pub status: StatusCode,
    pub body: Value,
    pub text: String,
}

impl TestApp {
    pub fn new() -> Self {
        Self::with_config(ServeConfig::defaults())
    }

    pub fn with_config(config: ServeConfig) -> Self {
        Self {
            state: AppState::new(config).expect("valid config"),
        }
    }

    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Reply {
        self.raw_full(method, path, content_type, body, headers)
            .await
            .0
    }

    /// A JSON request with extra headers; the reply and its `Retry-After`.
    pub async fn raw_with_headers(
        &self,
        method: Method,
        path: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> (Reply, Option<String>) {
        let (reply, response_headers) = self
            .raw_full(method, path, Some("application/json"), body, headers)
            .await;
        let retry = response_headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        (reply, retry)
    }

    async fn raw_full(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> (Reply, axum::http::HeaderMap) {
        let mut builder = Request::builder().method(method).uri(path);
        if let Some(ct) = content_type {
            builder = builder.header("content-type", ct);
        }
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let request = builder.body(Body::from(body)).expect("request");
        let response = app(Arc::clone(&self.state))
            .oneshot(request)
            .await
            .expect("infallible");
        let status = response.status();
        let response_headers = response.headers().clone();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        let text = String::from_utf8_lossy(&bytes).to_string();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (Reply { status, body, text }, response_headers)
    }

    pub async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Reply {
        match body {
            Some(b) => {
                self.raw(
                    method,
                    path,
                    Some("application/json"),
                    serde_json::to_vec(&b).expect("json"),
                    &[],
                )
                .await
            }
            None => self.raw(method, path, None, Vec::new(), &[]).await,
        }
    }

    pub async fn post(&self, path: &str, body: Value) -> Reply {
        self.call(Method::POST, path, Some(body)).await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.call(Method::GET, path, None).await
    }

    pub async fn delete(&self, path: &str) -> Reply {
        self.call(Method::DELETE, path, None).await
    }
}

/// The error text of a reply.
pub fn error_of(reply: &Reply) -> &str {
    reply.body["error"].as_str().unwrap_or("")
}

/// A keep-alive client that panics on transport errors (tests only).
pub struct RawClient(kvroute_testkit::client::HttpClient);

impl RawClient {
    pub async fn connect(addr: std::net::SocketAddr) -> Self {
        Self(
            kvroute_testkit::client::HttpClient::connect(addr)
                .await
                .expect("connect"),
        )
    }

    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> (u16, Vec<u8>) {
        self.0.request(method, path, body).await.expect("request")
    }
}

/// Resident memory of this process in bytes.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}
