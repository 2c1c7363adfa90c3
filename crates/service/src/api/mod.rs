//! The selection service's operations, independent of the transport: typed request bodies in,
//! typed results out (`WorkerRecord`, `Selection`, [`Booked`], `()`, …), failures as
//! [`ApiError`] (status + the exact message). They are rendered to JSON only at the edges: the
//! HTTP layer (`http::render`) and the Python binding's own renderer. In-process callers (the
//! gateway, Python) use the [`Service`] handle; the HTTP handlers call these functions.
//!
//! - [`select`](mod@select): `/select` and `/select_and_reserve`: the prompt hashed, then
//!   admission.
//! - [`handle`]: [`Service`], the one handle of in-process callers.
//!
//! Every change's follow-ups (replica sync, sessions, listeners, admission) run from
//! [`AppState::changed`]; an operation names the change, never the follow-ups.

use crate::admission;
use crate::error::ApiError;
use crate::state::{AppState, Change};
use crate::types::*;
use kvroute_core::error::{Error, PartitionKey, check_id};
use kvroute_core::hash::PromptHashes;
use kvroute_core::selector::{
    LifecycleCalls, OverlapScores, PartitionDump, PartitionLoads, Prompt, RankLoadReport,
    ReadyState, Reservation, ReservationRequest, WorkerRecord,
};

pub mod handle;
pub mod select;

pub use crate::admission::queue::{Booked, Routed};
pub use crate::admission::release::observe_queue;
pub use crate::admission::{Admission, Waiter};
pub use handle::Service;
pub use select::{
    DisaggSelected, select, select_and_reserve, select_and_reserve_disaggregated,
    select_disaggregated,
};

// ---------------------------------------------------------------------------------------------
// Catalog

/// `POST /workers` (201).
pub fn upsert_worker(state: &AppState, body: WorkerBody) -> Result<WorkerRecord, ApiError> {
    if body.worker_id.is_none() {
        return Err(ApiError::unprocessable(
            "Failed to deserialize the JSON body into the target type: missing field `worker_id`",
        ));
    }
    let spec = body.into_spec()?;
    let outcome = state.selector.write().upsert_worker(spec)?;
    state.changed(Change::WorkerUpserted {
        record: &outcome.record,
        events_changed: outcome.events_changed,
    });
    Ok(outcome.record)
}

/// `PATCH /workers/{id}`.
pub fn patch_worker(
    state: &AppState,
    worker_id: u64,
    body: WorkerBody,
) -> Result<WorkerRecord, ApiError> {
    let outcome = {
        let mut selector = state.selector.write();
        let Some(existing) = selector.worker(worker_id) else {
            return Err(Error::WorkerNotFound { worker_id }.into());
        };
        let spec = body.patch(existing.spec.clone())?;
        selector.upsert_worker(spec)?
    };
    state.changed(Change::WorkerUpserted {
        record: &outcome.record,
        events_changed: outcome.events_changed,
    });
    Ok(outcome.record)
}

/// `DELETE /workers/{id}`.
pub fn delete_worker(state: &AppState, worker_id: u64) -> Result<WorkerRecord, ApiError> {
    let record = state.selector.write().delete_worker(worker_id)?;
    state.changed(Change::WorkerDeleted(worker_id));
    Ok(record)
}

/// `GET /workers`.
pub fn list_workers(
    state: &AppState,
    model_name: Option<&str>,
    routing_group: Option<&str>,
) -> Vec<WorkerRecord> {
    state
        .selector
        .read()
        .list_workers(model_name, routing_group)
}

/// `GET /ready`: ready (200) or not (503); a service shutting down is not.
pub fn ready(state: &AppState) -> ReadyState {
    let mut ready = state.selector.read().ready();
    ready.ready = ready.ready && !state.is_shutting_down();
    ready
}

// ---------------------------------------------------------------------------------------------
// Bookings

/// `POST /reservations` (201).
pub fn create_reservation(
    state: &AppState,
    mut body: ReservationBody,
) -> Result<Reservation, ApiError> {
    let key = body.key()?;
    admission::check_id_not_queued(state, &key, body.selection_id.as_deref())?;
    let overrides = body.overrides()?;
    // The prompt matters only to the explicit form; a replay ignores it entirely.
    let explicit = body.worker_id.is_some();
    let has_prompt = body.has_prompt();
    let mut prompt = body.take_prompt();
    let input = if explicit && has_prompt {
        Some(prompt.resolve("sequence_hashes")?)
    } else {
        None
    };
    let core_prompt = match &input {
        Some(PromptInput::Tokens(tokens)) => Some(Prompt::Tokens {
            tokens: &tokens.tokens,
            lora_name: prompt.lora_name.as_deref(),
            cache_salt: prompt.cache_salt.as_deref(),
            extras: tokens.extras(),
        }),
        Some(PromptInput::Hashes(h)) => Some(Prompt::Hashes(h)),
        None => None,
    };
    let req = ReservationRequest {
        partition: &key,
        selection_id: body.selection_id.as_deref(),
        reservation_id: body.reservation_id.as_deref(),
        worker_id: body.worker_id,
        dp_rank: body.dp_rank,
        prompt: core_prompt,
        effective_prefill_tokens: body.effective_prefill_tokens,
        expected_output_tokens: body.expected_output_tokens,
        track_prefill_tokens: body.track_prefill_tokens,
        overrides,
        session_id: body.session(),
    };
    // A replay onto a rank with KV events books under the read lock; anything else takes the
    // write lock (LifecycleCalls).
    let reservation = state.selector.create_reservation(&req, state.now())?;
    state.changed(Change::Booked {
        reservation_id: &reservation.reservation_id,
        worker_id: reservation.worker_id,
    });
    Ok(reservation)
}

fn reservation_id(raw: &str) -> Result<&str, ApiError> {
    check_id("reservation_id", raw)?;
    Ok(raw)
}

/// `POST /reservations/{id}/prefill_complete`.
pub fn prefill_complete(state: &AppState, id: &str) -> Result<(), ApiError> {
    let id = reservation_id(id)?;
    state.selector.prefill_complete(id, state.now())?;
    state.changed(Change::PrefillCompleted(id));
    Ok(())
}

/// `POST /reservations/{id}/output_block`.
pub fn output_block(
    state: &AppState,
    id: &str,
    decay_fraction: Option<f64>,
) -> Result<(), ApiError> {
    let id = reservation_id(id)?;
    state
        .selector
        .output_block(id, decay_fraction, state.now())?;
    state.changed(Change::OutputBlock(id));
    Ok(())
}

/// `DELETE /reservations/{id}`.
pub fn free_reservation(state: &AppState, id: &str) -> Result<(), ApiError> {
    let id = reservation_id(id)?;
    state.selector.free(id, state.now())?;
    state.changed(Change::Freed(id));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Inspection

fn resolve_prompt_route(
    state: &AppState,
    body: &mut PromptRouteBody,
) -> Result<(PartitionKey, PromptHashes), ApiError> {
    let key = body.key()?;
    let mut prompt = body.take_prompt();
    let input = prompt.resolve("block_hashes")?;
    let hashes = select::hash_for_partition(
        state,
        &key,
        input,
        prompt.lora_name.as_deref(),
        prompt.cache_salt.as_deref(),
    )?;
    Ok((key, hashes))
}

/// `POST /overlap_scores`.
pub fn overlap_scores(
    state: &AppState,
    mut body: PromptRouteBody,
) -> Result<OverlapScores, ApiError> {
    let (key, hashes) = resolve_prompt_route(state, &mut body)?;
    let scores = state
        .selector
        .read()
        .overlap_scores(&key, Prompt::Hashes(&hashes))?;
    Ok(scores)
}

/// `POST /potential_loads`.
pub fn potential_loads(
    state: &AppState,
    mut body: PromptRouteBody,
) -> Result<Vec<RankLoadReport>, ApiError> {
    let overrides = body.overrides()?;
    let (key, hashes) = resolve_prompt_route(state, &mut body)?;
    let loads = state
        .selector
        .read()
        .potential_loads(&key, Prompt::Hashes(&hashes), &overrides)?;
    Ok(loads)
}

/// `GET /loads`, with what waits in each partition's admission queue.
pub fn loads(
    state: &AppState,
    model_name: Option<&str>,
    routing_group: Option<&str>,
) -> Vec<PartitionLoads> {
    let mut loads = state.selector.read().loads(model_name, routing_group);
    if state.admission.settings().is_some() {
        // Dynamo's pending_count / pending_isl_tokens: what waits in the partition's queue.
        let waiting = state.admission.snapshot();
        for partition in &mut loads {
            if let Some(q) = waiting.get(&partition.partition) {
                partition.pending_count = q.count as u64;
                partition.pending_isl_tokens = q.isl_tokens;
            }
        }
    }
    loads
}

/// The degraded workers' reasons (`crate::degraded`), shown on their ranks in `GET /loads`.
pub fn degraded(
    state: &AppState,
) -> std::collections::BTreeMap<u64, Vec<crate::degraded::Degraded>> {
    state.metrics.degraded.snapshot()
}

/// Raises (`Some(message)`) or clears (`None`) a degradation found outside the service (the
/// gateway's comparisons of its counts with the engines' answers).
pub fn report_degraded(
    state: &AppState,
    worker_id: u64,
    reason: crate::degraded::Reason,
    message: Option<String>,
) {
    state.metrics.degraded.set(worker_id, reason, message);
}

/// `GET /dump`: the index as a snapshot taken under the read lock (the edges render it, after
/// the lock is released: serializing a large index takes a while).
pub fn dump(state: &AppState) -> Vec<PartitionDump> {
    state.selector.read().dump()
}
