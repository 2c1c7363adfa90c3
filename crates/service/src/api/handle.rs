//! [`Service`]: the one handle of in-process callers (the gateway, the Python binding). Each
//! method is one operation with a typed result; nothing is read back from JSON, and the
//! service's state stays private behind it.

use super::{Admission, Booked, DisaggSelected};
use crate::error::ApiError;
use crate::state::AppState;
use crate::types::{PromptRouteBody, ReservationBody, SelectBody, WorkerBody};
use kvroute_core::event::KvEvent;
use kvroute_core::index::ApplyOutcome;
use kvroute_core::selector::{
    OverlapScores, PartitionDump, PartitionLoads, RankLoadReport, ReadyState, Reservation,
    Selection, WorkerRecord,
};
use std::sync::Arc;

/// The selection service in process: cheap to clone, one method per operation.
#[derive(Clone)]
pub struct Service {
    state: Arc<AppState>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").finish_non_exhaustive()
    }
}

impl Service {
    pub fn new(state: Arc<AppState>) -> Self {
        Self { state }
    }

    /// The state, for what takes it whole (serving HTTP, `http::json::body_bytes`).
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    // -- Catalog

    pub fn upsert_worker(&self, body: WorkerBody) -> Result<WorkerRecord, ApiError> {
        super::upsert_worker(&self.state, body)
    }

    pub fn patch_worker(&self, worker_id: u64, body: WorkerBody) -> Result<WorkerRecord, ApiError> {
        super::patch_worker(&self.state, worker_id, body)
    }

    pub fn delete_worker(&self, worker_id: u64) -> Result<WorkerRecord, ApiError> {
        super::delete_worker(&self.state, worker_id)
    }

    /// The catalog's workers, optionally of one model and routing group.
    pub fn workers(
        &self,
        model_name: Option<&str>,
        routing_group: Option<&str>,
    ) -> Vec<WorkerRecord> {
        super::list_workers(&self.state, model_name, routing_group)
    }

    pub fn ready(&self) -> ReadyState {
        super::ready(&self.state)
    }

    // -- Selection and bookings

    /// A worker for the prompt, booking nothing; it may wait in the admission queue.
    pub fn select(&self, body: SelectBody, tenant: Option<&str>) -> Admission<Selection> {
        super::select(&self.state, body, tenant)
    }

    /// A worker for the prompt, booked; it may wait in the admission queue (dropping the
    /// waiter leaves it, and frees a booking made meanwhile).
    pub fn select_and_reserve(&self, body: SelectBody, tenant: Option<&str>) -> Admission<Booked> {
        super::select_and_reserve(&self.state, body, tenant)
    }

    /// A prefill and a decode worker for the prompt, or one for the whole of it (a bypass),
    /// booking nothing (SPEC §6.1). Decided at once, never queued.
    pub fn select_disaggregated(&self, body: SelectBody) -> Result<DisaggSelected, ApiError> {
        super::select_disaggregated(&self.state, body)
    }

    /// Both legs picked and booked (`<id>.prefill`, `<id>.decode`), or neither. Free the
    /// prefill leg's booking when that leg returns, the decode leg's when its stream ends.
    pub fn select_and_reserve_disaggregated(
        &self,
        body: SelectBody,
    ) -> Result<DisaggSelected, ApiError> {
        super::select_and_reserve_disaggregated(&self.state, body)
    }

    pub fn create_reservation(&self, body: ReservationBody) -> Result<Reservation, ApiError> {
        super::create_reservation(&self.state, body)
    }

    pub fn prefill_complete(&self, reservation_id: &str) -> Result<(), ApiError> {
        super::prefill_complete(&self.state, reservation_id)
    }

    pub fn output_block(
        &self,
        reservation_id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), ApiError> {
        super::output_block(&self.state, reservation_id, decay_fraction)
    }

    pub fn free_reservation(&self, reservation_id: &str) -> Result<(), ApiError> {
        super::free_reservation(&self.state, reservation_id)
    }

    // -- Inspection

    pub fn overlap_scores(&self, body: PromptRouteBody) -> Result<OverlapScores, ApiError> {
        super::overlap_scores(&self.state, body)
    }

    pub fn potential_loads(&self, body: PromptRouteBody) -> Result<Vec<RankLoadReport>, ApiError> {
        super::potential_loads(&self.state, body)
    }

    /// The degraded workers' reasons, as `GET /loads` shows them.
    pub fn degraded(&self) -> std::collections::BTreeMap<u64, Vec<crate::degraded::Degraded>> {
        super::degraded(&self.state)
    }

    /// Raises (`Some(message)`) or clears (`None`) a reason a worker's routing is degraded.
    pub fn report_degraded(
        &self,
        worker_id: u64,
        reason: crate::degraded::Reason,
        message: Option<String>,
    ) {
        super::report_degraded(&self.state, worker_id, reason, message);
    }

    pub fn loads(
        &self,
        model_name: Option<&str>,
        routing_group: Option<&str>,
    ) -> Vec<PartitionLoads> {
        super::loads(&self.state, model_name, routing_group)
    }

    pub fn dump(&self) -> Vec<PartitionDump> {
        super::dump(&self.state)
    }

    /// Applies a worker rank's KV events, as its engine's listener would; `None` when the worker
    /// is unknown.
    pub fn apply_kv_events(
        &self,
        worker_id: u64,
        dp_rank: u32,
        events: &[KvEvent],
    ) -> Option<ApplyOutcome> {
        let applied = self
            .state
            .selector
            .write()
            .apply_events(worker_id, dp_rank, events);
        if let Some(outcome) = &applied {
            self.state.metrics.count_events(outcome);
        }
        applied
    }

    /// Whether taking the selector's lock would wait: for a reader, while a writer holds it;
    /// for a writer, while anyone does.
    pub fn selector_busy(&self, for_writing: bool) -> bool {
        if for_writing {
            self.state.selector.is_locked()
        } else {
            self.state.selector.is_locked_exclusive()
        }
    }

    /// Returns once the KV-event applier does not hold the selector's write lock, so a request
    /// waits as a task rather than blocking a runtime thread on the lock.
    pub async fn applier_passed(&self) {
        self.state.applier.passed().await;
    }

    /// Whether requests wait in an admission queue (`--queue-threshold`).
    pub fn queues_requests(&self) -> bool {
        self.state.admission.settings().is_some()
    }

    // -- Metrics and lifecycle

    /// Adds another crate's metrics to `GET /metrics`.
    pub fn attach_metrics(&self, registry: prometheus_client::registry::Registry) {
        self.state.metrics.attach(registry);
    }

    /// The Prometheus text of `GET /metrics`.
    pub fn render_metrics(&self) -> String {
        self.state.render_metrics()
    }

    /// KV-event listener tasks running.
    pub fn active_listeners(&self) -> usize {
        self.state.ingest.active_listeners()
    }

    pub fn is_shutting_down(&self) -> bool {
        self.state.is_shutting_down()
    }

    pub fn begin_shutdown(&self) {
        self.state.begin_shutdown();
    }
}
