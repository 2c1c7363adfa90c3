//! Admission-queue metrics (`kvroute_queue_*`), registered in the service's one registry.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::{Labels, labels};

fn wait_histogram() -> Histogram {
    // 1 ms … ~9 min.
    Histogram::new(exponential_buckets(1e-3, 2.0, 20))
}

#[derive(Debug, Clone)]
pub struct QueueMetrics {
    depth: Family<Labels, Gauge>,
    isl_tokens: Family<Labels, Gauge>,
    wait: Family<Labels, Histogram, fn() -> Histogram>,
    shed: Family<Labels, Counter>,
    admitted: Counter,
}

impl QueueMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            depth: Family::default(),
            isl_tokens: Family::default(),
            wait: Family::new_with_constructor(wait_histogram),
            shed: Family::default(),
            admitted: Counter::default(),
        };
        registry.register(
            "queue_depth",
            "Requests waiting in the admission queue per partition and tenant",
            metrics.depth.clone(),
        );
        registry.register(
            "queue_pending_isl_tokens",
            "Prompt tokens of the requests waiting in the admission queue per partition",
            metrics.isl_tokens.clone(),
        );
        registry.register(
            "queue_wait_seconds",
            "Time requests spent in the admission queue, by outcome (admitted, timeout, disconnected, shutdown)",
            metrics.wait.clone(),
        );
        registry.register(
            "queue_shed",
            "Requests refused or dropped by the admission queue, by reason (full, timeout, disconnected, shutdown)",
            metrics.shed.clone(),
        );
        registry.register(
            "queue_admitted",
            "Requests that waited in the admission queue and were decided",
            metrics.admitted.clone(),
        );
        for reason in ["full", "timeout", "disconnected", "shutdown"] {
            metrics
                .shed
                .get_or_create(&labels(&[("reason", reason)]))
                .inc_by(0);
        }
        metrics
    }

    /// A request left the queue after `seconds`: decided (`admitted`) or shed.
    pub fn observe_wait(&self, outcome: &str, seconds: f64) {
        self.wait
            .get_or_create(&labels(&[("outcome", outcome)]))
            .observe(seconds);
        if outcome == "admitted" {
            self.admitted.inc();
        } else {
            self.count_shed(outcome);
        }
    }

    /// A request refused or dropped (`full` never waited).
    pub fn count_shed(&self, reason: &str) {
        self.shed
            .get_or_create(&labels(&[("reason", reason)]))
            .inc();
    }

    /// Sets the depth gauges: (model_name, routing_group, prompt tokens, [(tenant, count)]).
    pub fn set_depths<'a>(
        &self,
        partitions: impl Iterator<Item = (&'a str, &'a str, u64, Vec<(&'a str, usize)>)>,
    ) {
        self.depth.clear();
        self.isl_tokens.clear();
        for (model, group, isl, tenants) in partitions {
            let p = labels(&[("model_name", model), ("routing_group", group)]);
            self.isl_tokens.get_or_create(&p).set(isl as i64);
            for (tenant, n) in tenants {
                self.depth
                    .get_or_create(&labels(&[
                        ("model_name", model),
                        ("routing_group", group),
                        ("tenant", tenant),
                    ]))
                    .set(n as i64);
            }
        }
    }
}
