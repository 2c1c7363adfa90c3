//! A request's way to a worker and back: book (the policy's choice), send the body as received
//! over the pooled client, and answer with the worker's status and body as they come
//! ([`ProxyBody`], which then owns the booking).
//!
//! A worker that cannot be connected to is left out and the next-best one booked,
//! `--connect-retries` times at most. The wait for the answer's head is bounded by the
//! first-token timeout (streams) or the request timeout.

use crate::booking::{BookRequest, Booking};
use crate::client::error_chain;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::mismatch::Expected;
use crate::openai::{Kind, OpenAiRequest};
use crate::proxy::ProxyBody;
use crate::tokenize::RoutingPrompt;
use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::Full;
use tokio::time::Instant;

/// One request, parsed and routed, ready to go.
#[derive(Debug)]
pub struct Outbound<'a> {
    pub kind: Kind,
    /// The body as the client sent it.
    pub body: Bytes,
    pub parsed: &'a OpenAiRequest,
    pub model: &'a str,
    pub prompt: &'a RoutingPrompt,
    pub tenant: Option<&'a str>,
    /// The session the request belongs to (body `session_id`, else a session header).
    pub session: Option<&'a str>,
    /// The client's `Authorization`, when it is forwarded.
    pub client_authorization: Option<HeaderValue>,
    /// The client's `X-Request-Id` (both legs of a disaggregated request carry one id).
    pub request_id: Option<HeaderValue>,
}

/// Books a worker and sends it the request, the next-best one after a connection failure.
pub async fn dispatch(gateway: &Gateway, out: Outbound<'_>) -> Result<Response, GatewayError> {
    let stream = out.parsed.is_stream();
    let config = &gateway.config;
    let mut excluded = Vec::new();
    for _attempt in 0..=config.connect_retries {
        gateway.link.applier_passed().await;
        let (booking, endpoint) = book(gateway, &out, &excluded).await?;
        let worker_id = booking.worker_id;
        let upstream = upstream_request(
            gateway,
            &endpoint,
            out.kind,
            out.body.clone(),
            out.client_authorization.as_ref(),
        )?;
        let dispatched_at = Instant::now();
        gateway.health.dispatched(worker_id);
        let wait = if stream {
            config.first_token_timeout.min(config.request_timeout)
        } else {
            config.request_timeout
        };
        // Dropping `booking` on any return below frees it.
        match tokio::time::timeout(wait, gateway.client.request(upstream)).await {
            Ok(Ok(response)) => {
                return Ok(respond(gateway, response, booking, stream, dispatched_at));
            }
            Ok(Err(e)) if e.is_connect() => {
                tracing::warn!(worker_id, %endpoint, error = %e, "cannot connect; trying the next-best worker");
                gateway.health.worker_failed(worker_id, "connect");
                gateway.health.metrics().retries.inc();
                excluded.push(worker_id);
            }
            Ok(Err(e)) => {
                gateway.health.worker_failed(worker_id, "broken_stream");
                return Err(GatewayError::new(
                    StatusCode::BAD_GATEWAY,
                    format!("worker {worker_id} failed: {}", error_chain(&e)),
                ));
            }
            Err(_) => {
                let kind = if stream {
                    "first_token_timeout"
                } else {
                    "timeout"
                };
                gateway.health.worker_failed(worker_id, kind);
                return Err(GatewayError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "worker {worker_id} did not answer within {} ms",
                        wait.as_millis()
                    ),
                ));
            }
        }
    }
    // The retries are spent (the last one's worker was excluded only for this request).
    Err(GatewayError {
        retry_after_secs: Some(1),
        ..GatewayError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no worker could be reached ({} tried)", excluded.len()),
        )
    })
}

/// Books the policy's worker for the request, leaving out `excluded` and the workers whose
/// breaker refuses.
async fn book(
    gateway: &Gateway,
    out: &Outbound<'_>,
    excluded: &[u64],
) -> Result<(Booking, String), GatewayError> {
    let mut refused = gateway.health.refused();
    refused.extend_from_slice(excluded);
    let choice = gateway.policy.choose(&gateway.link, out.model, &refused);
    let request = BookRequest {
        model: out.model,
        prompt: out.prompt,
        expected_output_tokens: out.parsed.expected_output_tokens(),
        cache_salt: out.parsed.cache_salt.clone(),
        allowed_worker_ids: choice.allowed_worker_ids,
        pinned_worker: choice.pinned_worker,
        tenant: out.tenant,
        session: out.session,
    };
    let booked = gateway
        .link
        .book(request, &gateway.health.metrics().bookings_open)
        .await;
    match booked {
        // No worker serves this model while others serve theirs: the model does not exist here
        // (404, as vLLM and OpenAI answer; clients do not retry it). An empty catalog stays the
        // selector's 503: an outage, worth retrying.
        Err(e)
            if e.status == StatusCode::SERVICE_UNAVAILABLE
                && gateway.link.is_unknown_model(out.model) =>
        {
            Err(GatewayError::unknown_model(out.model))
        }
        other => other,
    }
}

pub(crate) fn upstream_request(
    gateway: &Gateway,
    endpoint: &str,
    kind: Kind,
    body: Bytes,
    client_authorization: Option<&HeaderValue>,
) -> Result<hyper::Request<Full<Bytes>>, GatewayError> {
    let uri: Uri = format!("{endpoint}{}", kind.path()).parse().map_err(|e| {
        GatewayError::new(
            StatusCode::BAD_GATEWAY,
            format!("worker endpoint `{endpoint}` is not a URL: {e}"),
        )
    })?;
    let mut request = hyper::Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(auth) = &gateway.config.upstream_authorization {
        request = request.header(header::AUTHORIZATION, auth);
    } else if let Some(auth) = client_authorization {
        request = request.header(header::AUTHORIZATION, auth);
    }
    request
        .body(Full::new(body))
        .map_err(|e| GatewayError::new(StatusCode::BAD_GATEWAY, e.to_string()))
}

/// The engine answered: its status and body go to the client, the body driving the booking.
pub(crate) fn respond(
    gateway: &Gateway,
    response: hyper::Response<hyper::body::Incoming>,
    mut booking: Booking,
    stream: bool,
    dispatched_at: Instant,
) -> Response {
    let status = response.status();
    if status.is_server_error() {
        gateway
            .health
            .worker_failed(booking.worker_id, "status_5xx");
    } else {
        gateway.health.succeeded(booking.worker_id);
    }
    let is_event_stream = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let streaming = stream && status.is_success() && is_event_stream;
    if !streaming && status.is_success() {
        // A whole document: the engine is done with the prompt (and the output).
        booking.prefill_complete();
    }
    let worker_id = booking.worker_id;
    let probe = status
        .is_success()
        .then(|| gateway.mismatch.probe(worker_id, expected(&booking)));
    let (parts, incoming) = response.into_parts();
    let mut body = ProxyBody::new(
        incoming,
        gateway.health.clone(),
        gateway.response_limits(),
        booking,
        streaming,
        dispatched_at,
    );
    if let Some(probe) = probe {
        body = body.with_usage_probe(probe);
    }
    let mut out = Response::new(Body::new(body));
    *out.status_mut() = parts.status;
    copy_headers(&parts.headers, out.headers_mut());
    if let Ok(value) = HeaderValue::from_str(&worker_id.to_string()) {
        out.headers_mut().insert("x-kvroute-worker-id", value);
    }
    out
}

/// What the booking predicted, for the comparison with the answer's `usage`.
fn expected(booking: &Booking) -> Expected {
    Expected {
        prompt_tokens: booking.routed.prompt_tokens,
        cached_tokens: booking.routed.cached_tokens,
        cached_tokens_max: booking.routed.cached_tokens_max,
        block_size: booking.block_size(),
    }
}

/// The headers of the engine's answer the client gets (no hop-by-hop or framing headers).
fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for name in [
        header::CONTENT_TYPE,
        header::RETRY_AFTER,
        header::CACHE_CONTROL,
    ] {
        if let Some(value) = from.get(&name) {
            to.insert(name, value.clone());
        }
    }
    if let Some(value) = from.get("x-request-id") {
        to.insert("x-request-id", value.clone());
    }
}
