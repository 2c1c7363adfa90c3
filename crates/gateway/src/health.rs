//! The workers' health: each worker's circuit breaker ([`crate::breaker`]) fed by the
//! requests' failures and by the periodic health checks (`GET /health` of every catalog
//! worker every `--health-check-secs`), and the counters of how requests went.
//!
//! A [`HealthHandle`] is all a response body needs of the gateway: one `Arc` to report a
//! failure, a success or how the response ended.

use crate::booking::ServiceLink;
use crate::breaker::Breakers;
use crate::client::UpstreamClient;
use crate::metrics::GatewayMetrics;
use axum::http::{Method, Uri};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug)]
struct Health {
    breakers: Breakers,
    metrics: GatewayMetrics,
}

/// The breakers and the metrics, shared by the gateway and its responses in flight.
#[derive(Debug, Clone)]
pub struct HealthHandle(Arc<Health>);

impl HealthHandle {
    pub fn new(breakers: Breakers, metrics: GatewayMetrics) -> Self {
        Self(Arc::new(Health { breakers, metrics }))
    }

    pub fn breakers(&self) -> &Breakers {
        &self.0.breakers
    }

    pub fn metrics(&self) -> &GatewayMetrics {
        &self.0.metrics
    }

    /// The workers whose breaker keeps them out now.
    pub fn refused(&self) -> Vec<u64> {
        self.0.breakers.refused(Instant::now())
    }

    /// A request went to the worker (a half-open breaker's probe).
    pub fn dispatched(&self, worker_id: u64) {
        self.0.breakers.dispatched(worker_id, Instant::now());
    }

    pub fn succeeded(&self, worker_id: u64) {
        self.0.breakers.succeeded(worker_id);
    }

    /// The worker is gone from the catalog.
    pub fn forget(&self, worker_id: u64) {
        self.0.breakers.forget(worker_id);
    }

    /// A failure of a worker: counted, and held against its breaker.
    pub fn worker_failed(&self, worker_id: u64, kind: &'static str) {
        let Health { breakers, metrics } = &*self.0;
        metrics.failure(kind);
        if breakers.failed(worker_id, Instant::now()) {
            metrics.breakers_opened.inc();
            tracing::warn!(
                worker_id,
                open_for_secs = breakers.config().open_for.as_secs_f64(),
                "circuit breaker opened"
            );
        }
    }

    /// Checks every catalog worker's `GET /health` each `every`, until the service shuts down.
    pub async fn run_checks(self, link: ServiceLink, client: UpstreamClient, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !link.is_shutting_down() {
            tick.tick().await;
            let mut checks = tokio::task::JoinSet::new();
            for (worker_id, endpoint) in link.endpoints(None) {
                let client = client.clone();
                checks.spawn(async move {
                    let healthy = check(&client, &endpoint, every).await;
                    (worker_id, healthy)
                });
            }
            while let Some(Ok((worker_id, healthy))) = checks.join_next().await {
                if healthy {
                    self.0.breakers.health_ok(worker_id, Instant::now());
                } else {
                    self.worker_failed(worker_id, "health");
                }
            }
        }
    }
}

/// Whether `endpoint`'s `GET /health` answers a success within `every` (5 s at most).
async fn check(client: &UpstreamClient, endpoint: &str, every: Duration) -> bool {
    let Ok(uri) = format!("{endpoint}/health").parse::<Uri>() else {
        return false;
    };
    let Ok(request) = hyper::Request::builder()
        .method(Method::GET)
        .uri(uri)
        .body(Full::new(Bytes::new()))
    else {
        return false;
    };
    let limit = every.min(Duration::from_secs(5));
    let check = async {
        let response = client.request(request).await.ok()?;
        let ok = response.status().is_success();
        // Read the (short) body so the connection goes back to the pool.
        response.into_body().collect().await.ok()?;
        Some(ok)
    };
    matches!(tokio::time::timeout(limit, check).await, Ok(Some(true)))
}
