//! Shared helpers of the service's integration tests: an in-process app driven with `oneshot`.
#![allow(dead_code)]

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use kvroute_service::{AppState, ServeConfig, app};
use serde_json::Value;
use std::sync::Arc;
use tower::ServiceExt;

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
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        let text = String::from_utf8_lossy(&bytes).to_string();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply { status, body, text }
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

/// A minimal HTTP/1.1 client over one keep-alive TCP connection (for the real-socket tests).
pub struct RawClient {
    stream: tokio::io::BufReader<tokio::net::TcpStream>,
}

impl RawClient {
    pub async fn connect(addr: std::net::SocketAddr) -> Self {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        Self {
            stream: tokio::io::BufReader::new(stream),
        }
    }

    /// Sends one request and reads the response: `(status, body)`.
    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> (u16, Vec<u8>) {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let mut head = format!("{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n");
        if let Some(b) = body {
            head.push_str(&format!(
                "content-type: application/json\r\ncontent-length: {}\r\n",
                b.len()
            ));
        } else {
            head.push_str("content-length: 0\r\n");
        }
        head.push_str("\r\n");
        let stream = self.stream.get_mut();
        stream.write_all(head.as_bytes()).await.expect("write");
        if let Some(b) = body {
            stream.write_all(b).await.expect("write body");
        }
        let mut line = String::new();
        self.stream.read_line(&mut line).await.expect("status line");
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("status code");
        let mut length = 0usize;
        loop {
            line.clear();
            self.stream.read_line(&mut line).await.expect("header");
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse().expect("length");
            }
        }
        let mut buf = vec![0u8; length];
        self.stream.read_exact(&mut buf).await.expect("body");
        (status, buf)
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
