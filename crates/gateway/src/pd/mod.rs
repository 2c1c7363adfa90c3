//! Disaggregated prefill and decode (`--pd-protocol`): each request is booked on a prefill and
//! a decode worker at once (`ServiceLink::book_disaggregated`), then its two legs are sent in
//! the engines' protocol.
//!
//! - **vLLM** (NixlConnector): the prefill leg is the client's body with `stream: false`,
//!   `max_tokens: 1` (and `max_completion_tokens: 1` when present), no `stream_options` or
//!   `min_tokens`, and `kv_transfer_params` asking for a remote decode; its answer's
//!   `kv_transfer_params` go unchanged into the decode leg, the client's body otherwise.
//! - **SGLang** (`--disaggregation-mode`): one body, the client's with `bootstrap_host` (the
//!   prefill worker's host), `bootstrap_port` (its bootstrap port, `null` when unknown: the
//!   engine's default) and a random 63-bit `bootstrap_room` (a list of rooms for a batch), goes
//!   to both legs at once.
//! - **Bypass** (the selector ran the request whole: short or cached prompt, no or busy prefill
//!   workers): the client's body to the one worker booked.
//!
//! Both legs carry one `X-Request-Id` (the client's, else a new one). The prefill booking is
//! freed when the prefill leg returns; the decode booking lives for the decode answer's body
//! (`crate::proxy`), as a whole request's does. A failed prefill leg fails the request: its
//! own 4xx status and message when the engine refused it, else a 502 (504 on a timeout). Every
//! booking is owned by the future or body that waits on its leg, so a client that leaves, an
//! engine that dies or a timeout frees both. A leg is not retried on another worker.

mod bodies;

pub use bodies::{sglang_body, vllm_decode_body, vllm_prefill_body};

use crate::booking::{BookRequest, LegBooking, PdBooked};
use crate::client::error_chain;
use crate::config::PdProtocol;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::upstream::{Outbound, respond, upstream_request};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use bodies::{bootstrap_host, random_room};
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use serde_json::{Map, Value};
use std::time::Duration;
use tokio::time::Instant;

/// The largest prefill answer read (a one-token answer is a few hundred bytes).
const MAX_PREFILL_ANSWER_BYTES: usize = 1 << 20;

/// Books both legs and sends them; the client gets the decode leg's answer.
pub async fn dispatch(
    gateway: &Gateway,
    out: Outbound<'_>,
    protocol: PdProtocol,
) -> Result<Response, GatewayError> {
    // The legs' bodies are made from it (it parsed as a request already: an object).
    let client_body: Map<String, Value> = serde_json::from_slice(&out.body)
        .map_err(|e| GatewayError::invalid(format!("the body is not a JSON object: {e}")))?;
    gateway.link.applier_passed().await;
    let refused = gateway.health.refused();
    let allowed_worker_ids =
        (!refused.is_empty()).then(|| gateway.link.worker_ids(out.model, false, &refused));
    let request = BookRequest {
        model: out.model,
        prompt: out.prompt,
        expected_output_tokens: out.parsed.expected_output_tokens(),
        cache_salt: out.parsed.cache_salt.clone(),
        allowed_worker_ids,
        pinned_worker: None,
        tenant: out.tenant,
        session: out.session,
    };
    let booked = match gateway.link.book_disaggregated(
        request,
        protocol == PdProtocol::Vllm,
        &gateway.health.metrics().bookings_open,
    ) {
        Err(e)
            if e.status == StatusCode::SERVICE_UNAVAILABLE
                && gateway.link.is_unknown_model(out.model) =>
        {
            return Err(GatewayError::unknown_model(out.model));
        }
        other => other?,
    };
    let request_id = out
        .request_id
        .clone()
        .unwrap_or_else(|| new_request_id(gateway));
    let PdBooked {
        prefill, decode, ..
    } = booked;
    let prefill_worker = prefill.as_ref().map(|p| p.booking.worker_id);
    let mut response = match (prefill, protocol) {
        (None, _) => send_decode(gateway, &out, decode, out.body.clone(), &request_id).await,
        (Some(prefill), PdProtocol::Vllm) => {
            let params = vllm_prefill(gateway, &out, prefill, &client_body, &request_id).await?;
            let body = to_bytes(vllm_decode_body(&client_body, params));
            send_decode(gateway, &out, decode, body, &request_id).await
        }
        (Some(prefill), PdProtocol::Sglang) => {
            sglang(gateway, &out, prefill, decode, &client_body, &request_id).await
        }
    }?;
    // `x-kvroute-worker-id` names the decode worker (or a bypass's); this one the prefill's.
    if let Some(id) = prefill_worker
        && let Ok(value) = HeaderValue::from_str(&id.to_string())
    {
        response
            .headers_mut()
            .insert("x-kvroute-prefill-worker-id", value);
    }
    Ok(response)
}

/// A request id for both legs: unique per gateway and request.
fn new_request_id(gateway: &Gateway) -> HeaderValue {
    let n = gateway.next_request_number();
    let id = format!("kvroute-{:016x}{n:016x}", gateway.nonce());
    // Hex digits and a dash are a valid header value.
    HeaderValue::from_str(&id).unwrap_or_else(|_| HeaderValue::from_static("kvroute"))
}

fn to_bytes(body: Map<String, Value>) -> Bytes {
    // Serializing a map of JSON values cannot fail.
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// How long a leg may take to answer: the first-token timeout for a stream, else the whole.
fn leg_wait(gateway: &Gateway, stream: bool) -> Duration {
    let config = &gateway.config;
    if stream {
        config.first_token_timeout.min(config.request_timeout)
    } else {
        config.request_timeout
    }
}

/// The decode leg (or a bypass's whole request): its answer goes to the client, its body
/// driving and finally freeing the booking.
async fn send_decode(
    gateway: &Gateway,
    out: &Outbound<'_>,
    decode: LegBooking,
    body: Bytes,
    request_id: &HeaderValue,
) -> Result<Response, GatewayError> {
    let stream = out.parsed.is_stream();
    let worker_id = decode.booking.worker_id;
    let mut upstream = upstream_request(
        gateway,
        &decode.endpoint,
        out.kind,
        body,
        out.client_authorization.as_ref(),
    )?;
    upstream
        .headers_mut()
        .insert("x-request-id", request_id.clone());
    let dispatched_at = Instant::now();
    gateway.health.dispatched(worker_id);
    let wait = leg_wait(gateway, stream);
    match tokio::time::timeout(wait, gateway.client.request(upstream)).await {
        Ok(Ok(response)) => Ok(respond(
            gateway,
            response,
            decode.booking,
            stream,
            dispatched_at,
        )),
        Ok(Err(e)) => {
            let kind = if e.is_connect() {
                "connect"
            } else {
                "broken_stream"
            };
            gateway.health.worker_failed(worker_id, kind);
            Err(GatewayError::new(
                StatusCode::BAD_GATEWAY,
                format!("decode worker {worker_id} failed: {}", error_chain(&e)),
            ))
        }
        Err(_) => {
            gateway.health.worker_failed(worker_id, "timeout");
            Err(GatewayError::new(
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "decode worker {worker_id} did not answer within {} ms",
                    wait.as_millis()
                ),
            ))
        }
    }
}

/// Sends a prefill leg and reads its whole answer: `(status, body)`, or why it failed. The
/// booking is freed when this returns, whichever way.
async fn prefill_leg(
    gateway: &Gateway,
    out: &Outbound<'_>,
    prefill: LegBooking,
    body: Bytes,
    request_id: &HeaderValue,
) -> Result<Bytes, GatewayError> {
    let LegBooking {
        booking: mut prefill_booking,
        endpoint,
        ..
    } = prefill;
    let worker_id = prefill_booking.worker_id;
    let mut upstream = upstream_request(
        gateway,
        &endpoint,
        out.kind,
        body,
        out.client_authorization.as_ref(),
    )?;
    upstream
        .headers_mut()
        .insert("x-request-id", request_id.clone());
    gateway.health.dispatched(worker_id);
    let wait = leg_wait(gateway, out.parsed.is_stream());
    let answer = tokio::time::timeout(wait, async {
        let response = gateway.client.request(upstream).await.map_err(|e| {
            let kind = if e.is_connect() {
                "connect"
            } else {
                "broken_stream"
            };
            (kind, error_chain(&e))
        })?;
        let (parts, body) = response.into_parts();
        let bytes = Limited::new(body, MAX_PREFILL_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| ("broken_stream", e.to_string()))?
            .to_bytes();
        Ok::<_, (&'static str, String)>((parts.status, bytes))
    })
    .await;
    prefill_booking.free();
    let (status, bytes) = match answer {
        Ok(Ok(answer)) => answer,
        Ok(Err((kind, reason))) => {
            gateway.health.worker_failed(worker_id, kind);
            return Err(GatewayError::new(
                StatusCode::BAD_GATEWAY,
                format!("prefill worker {worker_id} failed: {reason}"),
            ));
        }
        Err(_) => {
            gateway.health.worker_failed(worker_id, "timeout");
            return Err(GatewayError::new(
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "prefill worker {worker_id} did not answer within {} ms",
                    wait.as_millis()
                ),
            ));
        }
    };
    if status.is_success() {
        gateway.health.succeeded(worker_id);
        return Ok(bytes);
    }
    let message = engine_message(&bytes);
    if status.is_client_error() {
        // The engine refused the request itself (too long, bad parameters): the client's error.
        gateway.health.succeeded(worker_id);
        return Err(GatewayError::new(
            status,
            format!("prefill worker {worker_id} refused the request: {message}"),
        ));
    }
    gateway.health.worker_failed(worker_id, "status_5xx");
    Err(GatewayError::new(
        StatusCode::BAD_GATEWAY,
        format!("prefill worker {worker_id} answered {status}: {message}"),
    ))
}

/// An engine's error message (OpenAI's nested or flat shape), else its body as text.
fn engine_message(body: &[u8]) -> String {
    let json: Option<Value> = serde_json::from_slice(body).ok();
    json.as_ref()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("error"))
                .and_then(Value::as_str)
        })
        .map(str::to_string)
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned())
}

/// vLLM's prefill leg; returns its answer's `kv_transfer_params`.
async fn vllm_prefill(
    gateway: &Gateway,
    out: &Outbound<'_>,
    prefill: LegBooking,
    client_body: &Map<String, Value>,
    request_id: &HeaderValue,
) -> Result<Value, GatewayError> {
    let worker_id = prefill.booking.worker_id;
    let body = to_bytes(vllm_prefill_body(client_body));
    let answer = prefill_leg(gateway, out, prefill, body, request_id).await?;
    let params = serde_json::from_slice::<Value>(&answer)
        .ok()
        .and_then(|mut v| v.get_mut("kv_transfer_params").map(Value::take))
        .filter(Value::is_object);
    params.ok_or_else(|| {
        GatewayError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "prefill worker {worker_id} answered without kv_transfer_params: is it a vLLM \
                 engine with a KV connector (--kv-transfer-config)?"
            ),
        )
    })
}

/// SGLang: the same body to both legs at once; a failed prefill fails the request.
async fn sglang(
    gateway: &Gateway,
    out: &Outbound<'_>,
    prefill: LegBooking,
    decode: LegBooking,
    client_body: &Map<String, Value>,
    request_id: &HeaderValue,
) -> Result<Response, GatewayError> {
    let host = bootstrap_host(&prefill.endpoint).ok_or_else(|| {
        GatewayError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "prefill worker {} has no host in its URL `{}`",
                prefill.booking.worker_id, prefill.endpoint
            ),
        )
    })?;
    let body = to_bytes(sglang_body(
        client_body,
        &host,
        prefill.bootstrap_port,
        random_room(),
        random_room,
    ));
    let (prefilled, decoded) = tokio::join!(
        prefill_leg(gateway, out, prefill, body.clone(), request_id),
        send_decode(gateway, out, decode, body, request_id),
    );
    // A failed prefill fails the request; the decode's answer, if any, is dropped (its
    // booking with it).
    prefilled?;
    decoded
}
