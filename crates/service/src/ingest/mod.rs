//! Live KV-event ingest (SPEC §3.1). PLACEHOLDER API — being implemented.

use crate::metrics::Metrics;
use kvroute_core::event::KvEvent;
use kvroute_core::selector::WorkerRecord;
use std::sync::Arc;

/// Where decoded events go.
pub trait EventSink: Send + Sync + 'static {
    /// Applies decoded events of one rank. Returns false when the worker is unknown.
    fn apply(&self, worker_id: u64, dp_rank: u32, events: &[KvEvent]) -> bool;
}

pub struct IngestManager {
    _sink: Arc<dyn EventSink>,
    _metrics: Arc<Metrics>,
}

impl IngestManager {
    pub fn new(sink: Arc<dyn EventSink>, metrics: Arc<Metrics>) -> Self {
        Self {
            _sink: sink,
            _metrics: metrics,
        }
    }
    pub fn sync_worker(&self, _record: &WorkerRecord, _restart: bool) {}
    pub fn remove_worker(&self, _worker_id: u64) {}
    pub fn shutdown(&self) {}
    pub fn active_listeners(&self) -> usize {
        0
    }
}
