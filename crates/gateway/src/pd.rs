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

use crate::booking::{BookRequest, LegBooking, PdBooked};
use crate::client::error_chain;
use crate::config::PdProtocol;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::upstream::{Outbound, respond, upstream_request};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use serde_json::{Map, Value, json};
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
    let booked = match gateway
        .link
        .book_disaggregated(request, &gateway.health.metrics().bookings_open)
    {
        Err(e)
            if e.status == StatusCode::SERVICE_UNAVAILABLE
                && gateway.link.is_unknown_model(out.model) =>
        {
            return Err(GatewayError::unknown_model(out.model));
        }
        other => other?,
    };
    let client_body: Map<String, Value> = serde_json::from_slice(&out.body)
        .map_err(|e| GatewayError::invalid(format!("the body is not a JSON object: {e}")))?;
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
    prefill_booking.prefill_complete();
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

/// The prefill leg's body (vLLM): one token, not streamed, asking for a remote decode.
pub fn vllm_prefill_body(client_body: &Map<String, Value>) -> Map<String, Value> {
    let mut body = client_body.clone();
    body.insert("stream".into(), Value::Bool(false));
    body.insert("max_tokens".into(), json!(1));
    if body.contains_key("max_completion_tokens") {
        body.insert("max_completion_tokens".into(), json!(1));
    }
    body.remove("stream_options");
    body.remove("min_tokens");
    body.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    body
}

/// The decode leg's body (vLLM): the client's, with the prefill answer's `kv_transfer_params`.
pub fn vllm_decode_body(client_body: &Map<String, Value>, params: Value) -> Map<String, Value> {
    let mut body = client_body.clone();
    body.insert("kv_transfer_params".into(), params);
    body
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

/// A bootstrap room: random, 63 bits (SGLang's rooms are non-negative 64-bit integers).
fn random_room() -> u64 {
    rand::random::<u64>() >> 1
}

/// The host of a worker URL (`http://host:port/...`).
fn bootstrap_host(endpoint: &str) -> Option<String> {
    let uri: axum::http::Uri = endpoint.parse().ok()?;
    let host = uri.host()?;
    Some(
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
    )
}

/// The body of both SGLang legs: the client's with the bootstrap fields; a batch (`prompt` a
/// list of prompts) gets one room per prompt.
pub fn sglang_body(
    client_body: &Map<String, Value>,
    host: &str,
    port: Option<u16>,
    room: u64,
    mut more_rooms: impl FnMut() -> u64,
) -> Map<String, Value> {
    let mut body = client_body.clone();
    let batch = match body.get("prompt") {
        Some(Value::Array(items)) if items.iter().all(|i| i.is_string() || i.is_array()) => {
            Some(items.len())
        }
        _ => None,
    };
    let room = match batch {
        Some(n) => Value::Array(
            std::iter::once(room)
                .chain(std::iter::repeat_with(&mut more_rooms))
                .take(n)
                .map(Value::from)
                .collect(),
        ),
        None => Value::from(room),
    };
    body.insert("bootstrap_host".into(), Value::from(host));
    body.insert("bootstrap_port".into(), json!(port));
    body.insert("bootstrap_room".into(), room);
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!("an object"),
        }
    }

    #[test]
    fn the_vllm_prefill_leg_makes_one_token_and_asks_for_a_remote_decode() {
        let client = map(
            json!({"model": "m", "prompt": "p", "stream": true, "max_tokens": 50,
            "max_completion_tokens": 50, "min_tokens": 5,
            "stream_options": {"include_usage": true}, "temperature": 0.5}),
        );
        let prefill = vllm_prefill_body(&client);
        assert_eq!(
            Value::Object(prefill),
            json!({"model": "m", "prompt": "p", "stream": false, "max_tokens": 1,
                "max_completion_tokens": 1, "temperature": 0.5,
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                    "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
                    "remote_port": null}})
        );
        let without = vllm_prefill_body(&map(json!({"prompt": "p"})));
        assert!(!without.contains_key("max_completion_tokens"));
        let params = json!({"do_remote_prefill": true, "remote_engine_id": "e"});
        let decode = vllm_decode_body(&client, params.clone());
        let mut expected = client.clone();
        expected.insert("kv_transfer_params".into(), params);
        assert_eq!(
            decode, expected,
            "the client's body, the params added unchanged"
        );
    }

    #[test]
    fn sglang_bodies_carry_the_bootstrap_fields_and_a_room_per_prompt() {
        let mut next = 10;
        let mut rooms = || {
            next += 1;
            next
        };
        let one = sglang_body(
            &map(json!({"prompt": "p"})),
            "10.0.0.1",
            Some(8998),
            7,
            &mut rooms,
        );
        assert_eq!(
            Value::Object(one),
            json!({"prompt": "p", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
                "bootstrap_room": 7})
        );
        let batch = sglang_body(
            &map(json!({"prompt": ["a", "b", "c"]})),
            "h",
            None,
            7,
            &mut rooms,
        );
        assert_eq!(batch["bootstrap_room"], json!([7, 11, 12]));
        assert_eq!(batch["bootstrap_port"], Value::Null);
        let ids = sglang_body(&map(json!({"prompt": [1, 2, 3]})), "h", None, 7, &mut rooms);
        assert_eq!(ids["bootstrap_room"], json!(7), "token ids are one prompt");
        assert_eq!(
            bootstrap_host("http://127.0.0.1:8001").as_deref(),
            Some("127.0.0.1")
        );
        assert_eq!(
            bootstrap_host("http://[::1]:8001/v").as_deref(),
            Some("::1")
        );
    }
}
