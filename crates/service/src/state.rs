//! The service's shared state: the selector behind one lock, the metrics, the configuration and
//! the KV-event listeners. Requests, events and the periodic tick all reach the selector here.

use crate::config::ServeConfig;
use crate::ingest::{EventSink, IngestManager};
use crate::metrics::Metrics;
use kvroute_core::event::KvEvent;
use kvroute_core::selector::{Selector, WorkerRecord};
use parking_lot::RwLock;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Applies engine events to the selector (used by the listeners).
struct SelectorSink {
    selector: Arc<RwLock<Selector>>,
    metrics: Arc<Metrics>,
}

impl EventSink for SelectorSink {
    fn apply(&self, worker_id: u64, dp_rank: u32, events: &[KvEvent]) -> bool {
        let outcome = self
            .selector
            .write()
            .apply_events(worker_id, dp_rank, events);
        match outcome {
            Some(outcome) => {
                self.metrics.count_events(&outcome);
                true
            }
            None => {
                self.metrics
                    .count_dropped_events("any", "unknown_worker", events.len() as u64);
                false
            }
        }
    }
}

pub struct AppState {
    pub selector: Arc<RwLock<Selector>>,
    pub metrics: Arc<Metrics>,
    pub config: ServeConfig,
    pub ingest: IngestManager,
    /// Replica sync hooks (no-ops without `--nats-url`).
    pub sync: crate::sync::SyncHandle,
    shutting_down: AtomicBool,
}

impl AppState {
    /// Builds the state from a validated configuration (the message names a bad knob).
    pub fn new(config: ServeConfig) -> Result<Arc<Self>, String> {
        let selector_config = config.validate()?;
        let selector = Arc::new(RwLock::new(Selector::new(selector_config)));
        let metrics = Arc::new(Metrics::new());
        let sink = Arc::new(SelectorSink {
            selector: Arc::clone(&selector),
            metrics: Arc::clone(&metrics),
        });
        let sync = crate::sync::SyncHandle::new(&config.sync, Arc::clone(&metrics));
        let ingest = IngestManager::new(sync.wrap_sink(sink), Arc::clone(&metrics));
        Ok(Arc::new(Self {
            selector,
            metrics,
            config,
            ingest,
            sync,
            shutting_down: AtomicBool::new(false),
        }))
    }

    /// Starts, restarts or stops a worker's listeners after a catalog change.
    pub fn sync_listeners(&self, record: &WorkerRecord, events_changed: bool) {
        if self.config.no_kv_events {
            return;
        }
        self.ingest.sync_worker(record, events_changed);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Refuses new work from now on; in-flight requests finish.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.selector.write().shutdown();
        self.ingest.shutdown();
    }

    /// One housekeeping pass: expire idle bookings and cached selections.
    pub fn tick(&self, now: Instant) {
        let outcome = self.selector.write().tick(now);
        if !outcome.expired_reservations.is_empty() {
            tracing::info!(
                count = outcome.expired_reservations.len(),
                "expired idle reservations"
            );
        }
        self.metrics
            .count_expired(outcome.expired_reservations.len());
    }

    /// Runs [`tick`](Self::tick) periodically until shutdown.
    pub async fn run_housekeeping(self: Arc<Self>) {
        let period = Duration::from_secs(1);
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !self.is_shutting_down() {
            interval.tick().await;
            self.tick(Instant::now());
        }
    }
}
