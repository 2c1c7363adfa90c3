//! The response body the client reads: the engine's body, frame by frame as it arrives,
//! driving the booking it owns.
//!
//! A streamed response's frames pass through an [`SseScanner`]: the first frame with a token
//! calls `prefill_complete`, every `block_size` tokens an `output_block`. The stream ends in one
//! of four ways, each freeing the booking: the engine's body ends (`complete`); the engine's
//! body fails, as when the engine dies (`upstream_error`: the client gets an error event, then
//! `[DONE]`); the first token or the request's deadline passes (`timeout`, the same); or the
//! client goes away, and the server drops this body (`client_gone`). A response that is not a
//! stream ends the same ways, but a failure mid-body is a failed body (the connection is cut):
//! a JSON document cannot be completed with an error.

use crate::booking::Booking;
use crate::error::GatewayError;
use crate::health::HealthHandle;
use crate::mismatch::UsageProbe;
use crate::sse::SseScanner;
use axum::http::StatusCode;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::{Instant, Sleep};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a response may take: `--first-token-timeout-ms` and `--request-timeout-ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseLimits {
    pub first_token: Duration,
    pub whole: Duration,
}

/// The engine's response body on its way to the client.
pub struct ProxyBody {
    upstream: Incoming,
    health: HealthHandle,
    limits: ResponseLimits,
    /// `None` once the booking is freed.
    booking: Option<Booking>,
    /// `Some` for a stream of server-sent events.
    scanner: Option<SseScanner>,
    /// Until the first token of a stream.
    first_token: Option<Pin<Box<Sleep>>>,
    deadline: Pin<Box<Sleep>>,
    dispatched_at: Instant,
    finished: bool,
    /// Reads the answer's `usage` for the comparison of counts (`crate::mismatch`).
    probe: Option<UsageProbe>,
}

impl ProxyBody {
    pub fn new(
        upstream: Incoming,
        health: HealthHandle,
        limits: ResponseLimits,
        booking: Booking,
        streaming: bool,
        dispatched_at: Instant,
    ) -> Self {
        let deadline = Box::pin(tokio::time::sleep_until(dispatched_at + limits.whole));
        let first_token = (streaming && !booking.is_prefilled())
            .then(|| Box::pin(tokio::time::sleep_until(dispatched_at + limits.first_token)));
        Self {
            upstream,
            health,
            limits,
            booking: Some(booking),
            scanner: streaming.then(SseScanner::new),
            first_token,
            deadline,
            dispatched_at,
            finished: false,
            probe: None,
        }
    }

    /// Hands the answer's `usage` to `probe` when it ends complete.
    pub fn with_usage_probe(mut self, probe: UsageProbe) -> Self {
        self.probe = Some(probe);
        self
    }

    /// Reads a streamed frame for the lifecycle.
    fn observe(&mut self, data: &Bytes) {
        let (Some(scanner), Some(booking)) = (self.scanner.as_mut(), self.booking.as_mut()) else {
            if let Some(probe) = self.probe.as_mut() {
                probe.document_bytes(data);
            }
            return;
        };
        let outcome = scanner.scan(data);
        if let (Some(usage), Some(probe)) = (outcome.usage_prompt, self.probe.as_mut()) {
            probe.stream_usage(usage);
        }
        if outcome.tokens > 0 && !booking.is_prefilled() {
            booking.prefill_complete();
            self.first_token = None;
            self.health
                .metrics()
                .first_token_seconds
                .observe(self.dispatched_at.elapsed().as_secs_f64());
        }
        if outcome.tokens > 0 {
            booking.generated(outcome.tokens);
        }
        if let Some(total) = outcome.usage_completion_tokens {
            booking.set_generated(total);
        }
    }

    /// Ends the response: frees the booking and counts how it ended.
    fn finish(&mut self, end: &'static str) {
        self.finished = true;
        self.first_token = None;
        if let Some(probe) = self.probe.take()
            && end == "complete"
        {
            probe.finish();
        }
        if let Some(mut booking) = self.booking.take() {
            booking.free();
            self.health.metrics().ended(end);
        }
    }

    /// The engine failed mid-response: its breaker counts it, the client is told (a stream) or
    /// the body fails (a document).
    fn fail(
        &mut self,
        kind: &'static str,
        error: GatewayError,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(booking) = &self.booking {
            self.health.worker_failed(booking.worker_id, kind);
        }
        let end = if kind == "broken_stream" {
            "upstream_error"
        } else {
            "timeout"
        };
        tracing::warn!(error = %error.message, "response ended by a failure");
        self.finish(end);
        if self.scanner.is_some() {
            Poll::Ready(Some(Ok(Frame::data(error.sse_event()))))
        } else {
            Poll::Ready(Some(Err(error.message.into())))
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.upstream).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.observe(data);
                }
                // A body of known length is over with its last byte: the server may not ask
                // again.
                if this.upstream.is_end_stream() {
                    this.finish("complete");
                }
                return Poll::Ready(Some(Ok(frame)));
            }
            Poll::Ready(Some(Err(e))) => {
                let worker = this.booking.as_ref().map_or(0, |b| b.worker_id);
                return this.fail(
                    "broken_stream",
                    GatewayError::new(
                        StatusCode::BAD_GATEWAY,
                        format!("worker {worker} failed mid-response: {e}"),
                    ),
                );
            }
            Poll::Ready(None) => {
                this.finish("complete");
                return Poll::Ready(None);
            }
            Poll::Pending => {}
        }
        if let Some(timer) = this.first_token.as_mut()
            && timer.as_mut().poll(cx).is_ready()
        {
            let limit = this.limits.first_token;
            return this.fail(
                "first_token_timeout",
                GatewayError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("no token within {} ms", limit.as_millis()),
                ),
            );
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            let limit = this.limits.whole;
            return this.fail(
                "timeout",
                GatewayError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("the response took longer than {} ms", limit.as_millis()),
                ),
            );
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }

    fn size_hint(&self) -> SizeHint {
        // A document passes through as it is: its length holds. A stream may get an error
        // event added.
        if self.scanner.is_none() {
            self.upstream.size_hint()
        } else {
            SizeHint::default()
        }
    }
}

impl Drop for ProxyBody {
    fn drop(&mut self) {
        if self.booking.is_some() {
            // The server dropped the body before its end: the client went away.
            self.finish("client_gone");
        }
    }
}
