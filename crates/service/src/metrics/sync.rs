//! Replica-sync metrics (`kvroute_sync_*`), registered in the service's one registry.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::Labels;

fn lag_histogram() -> Histogram {
    // 100 µs … ~100 s.
    Histogram::new(exponential_buckets(1e-4, 2.0, 21))
}

#[derive(Debug, Clone)]
pub struct SyncMetrics {
    published: Family<Labels, Counter>,
    applied: Family<Labels, Counter>,
    dropped: Family<Labels, Counter>,
    lag: Family<Labels, Histogram, fn() -> Histogram>,
    reconnects: Counter,
    connected: Gauge,
}

fn kind_labels(kind: &str) -> Labels {
    vec![("kind".to_string(), kind.to_string())]
}

impl SyncMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            published: Family::default(),
            applied: Family::default(),
            dropped: Family::default(),
            lag: Family::new_with_constructor(lag_histogram),
            reconnects: Counter::default(),
            connected: Gauge::default(),
        };
        registry.register(
            "sync_messages_published",
            "Replica-sync messages published to NATS, by kind (booking_put, booking_delete, catalog_put, catalog_delete, events)",
            metrics.published.clone(),
        );
        registry.register(
            "sync_messages_applied",
            "Replica-sync messages from other replicas applied here, by kind",
            metrics.applied.clone(),
        );
        registry.register(
            "sync_messages_dropped",
            "Replica-sync messages not applied or not published, by kind and reason (own, unknown_worker, malformed, channel_full, publish_failed)",
            metrics.dropped.clone(),
        );
        registry.register(
            "sync_lag_seconds",
            "Delay from a replica's publish to its application here, by kind",
            metrics.lag.clone(),
        );
        registry.register(
            "sync_reconnects",
            "Reconnections to NATS after a lost connection",
            metrics.reconnects.clone(),
        );
        registry.register(
            "sync_connected",
            "1 while connected to NATS",
            metrics.connected.clone(),
        );
        metrics
    }

    pub fn published(&self, kind: &str, n: u64) {
        if n > 0 {
            self.published.get_or_create(&kind_labels(kind)).inc_by(n);
        }
    }

    pub fn applied(&self, kind: &str) {
        self.applied.get_or_create(&kind_labels(kind)).inc();
    }

    pub fn dropped(&self, kind: &str, reason: &str, n: u64) {
        if n > 0 {
            let labels = vec![
                ("kind".to_string(), kind.to_string()),
                ("reason".to_string(), reason.to_string()),
            ];
            self.dropped.get_or_create(&labels).inc_by(n);
        }
    }

    pub fn observe_lag(&self, kind: &str, seconds: f64) {
        self.lag.get_or_create(&kind_labels(kind)).observe(seconds);
    }

    pub fn reconnected(&self) {
        self.reconnects.inc();
    }

    pub fn set_connected(&self, connected: bool) {
        self.connected.set(i64::from(connected));
    }

    /// Applied messages of `kind` so far (tests and diagnostics).
    pub fn applied_count(&self, kind: &str) -> u64 {
        self.applied.get_or_create(&kind_labels(kind)).get()
    }

    /// Reconnections so far.
    pub fn reconnect_count(&self) -> u64 {
        self.reconnects.get()
    }
}
