//! The gateway's metrics (`kvroute_gateway_*`), in a registry of their own that the service's
//! `GET /metrics` renders after its own.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabel {
    /// `connect`, `timeout`, `first_token_timeout`, `broken_stream`, `status_5xx`, `health`.
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndLabel {
    /// `complete`, `client_gone`, `upstream_error`, `timeout`.
    pub end: &'static str,
}

#[derive(Debug, Clone)]
pub struct GatewayMetrics {
    /// Bookings the gateway holds now (0 when idle: none leaked).
    pub bookings_open: Gauge,
    /// Requests sent to another worker after a connection failure.
    pub retries: Counter,
    pub upstream_failures: Family<FailureLabel, Counter>,
    /// How the responses the gateway forwarded ended.
    pub responses: Family<EndLabel, Counter>,
    pub breakers_opened: Counter,
    /// From dispatch to the first streamed token, in seconds.
    pub first_token_seconds: Histogram,
    /// Prompts routed by their estimated length, with no tokenizer for their model.
    pub untokenized_prompts: Counter,
}

impl GatewayMetrics {
    /// The metrics, and the registry that renders them.
    pub fn new() -> (Self, Registry) {
        let mut registry = Registry::with_prefix("kvroute_gateway");
        let metrics = Self {
            bookings_open: Gauge::default(),
            retries: Counter::default(),
            upstream_failures: Family::default(),
            responses: Family::default(),
            breakers_opened: Counter::default(),
            first_token_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            untokenized_prompts: Counter::default(),
        };
        registry.register(
            "bookings_open",
            "Bookings held for requests in flight",
            metrics.bookings_open.clone(),
        );
        registry.register(
            "retries",
            "Requests sent to the next-best worker after a connection failure",
            metrics.retries.clone(),
        );
        registry.register(
            "upstream_failures",
            "Failures of workers by kind",
            metrics.upstream_failures.clone(),
        );
        registry.register(
            "responses",
            "Forwarded responses by how they ended",
            metrics.responses.clone(),
        );
        registry.register(
            "breakers_opened",
            "Times a worker's circuit breaker opened",
            metrics.breakers_opened.clone(),
        );
        registry.register(
            "first_token_seconds",
            "From dispatch to the first streamed token",
            metrics.first_token_seconds.clone(),
        );
        registry.register(
            "untokenized_prompts",
            "Prompts routed by estimated length (no tokenizer for their model)",
            metrics.untokenized_prompts.clone(),
        );
        (metrics, registry)
    }

    pub fn failure(&self, kind: &'static str) {
        self.upstream_failures
            .get_or_create(&FailureLabel { kind })
            .inc();
    }

    pub fn ended(&self, end: &'static str) {
        self.responses.get_or_create(&EndLabel { end }).inc();
    }
}
