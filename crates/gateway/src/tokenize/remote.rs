//! `--tokenize remote`: a worker's `POST /tokenize` (vLLM's route), asked per request, the
//! model's workers taken in turn. Nothing of the prompt is kept.

use crate::client::UpstreamClient;
use axum::http::{Method, Uri, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::Value;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Asks workers for token ids.
#[derive(Debug)]
pub struct RemoteTokenizer {
    client: UpstreamClient,
    /// `--upstream-authorization`, sent as the `Authorization` header.
    authorization: Option<String>,
    /// The wait for one answer.
    limit: Duration,
    /// Spreads the requests over a model's workers.
    next_worker: AtomicUsize,
}

impl RemoteTokenizer {
    pub fn new(client: UpstreamClient, authorization: Option<String>, limit: Duration) -> Self {
        Self {
            client,
            authorization,
            limit,
            next_worker: AtomicUsize::new(0),
        }
    }

    /// The next of `endpoints` (not empty) in turn.
    pub fn pick<'a>(&self, endpoints: &'a [String]) -> &'a str {
        let turn = self.next_worker.fetch_add(1, Ordering::Relaxed);
        &endpoints[turn % endpoints.len()]
    }

    /// `body` (vLLM's `/tokenize` fields) sent to `endpoint`: its token ids, or why not.
    pub async fn tokenize(&self, endpoint: &str, body: &Value) -> Result<Vec<u32>, String> {
        #[derive(serde::Deserialize)]
        struct Tokenized {
            tokens: Vec<u32>,
        }
        let uri: Uri = format!("{endpoint}/tokenize")
            .parse()
            .map_err(|e| format!("{e}"))?;
        let mut request = hyper::Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(auth) = &self.authorization {
            request = request.header(header::AUTHORIZATION, auth);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| e.to_string())?;
            let status = response.status();
            let bytes = response
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            if !status.is_success() {
                return Err(format!("status {status}"));
            }
            serde_json::from_slice::<Tokenized>(&bytes)
                .map(|t| t.tokens)
                .map_err(|e| e.to_string())
        };
        tokio::time::timeout(self.limit, exchange)
            .await
            .map_err(|_| format!("no answer within {} ms", self.limit.as_millis()))?
    }
}
