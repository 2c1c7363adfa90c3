//! `POST /select` and `POST /select_and_reserve`: the body resolved (partition, overrides) and
//! its prompt hashed outside any lock, then handed to admission, which decides it at once or
//! queues it (`crate::admission`). The path goes one way: here → admission → decide.

use crate::admission::queue::{Booked, ResolvedSelect, Routed};
use crate::admission::{self, Admission};
use crate::error::ApiError;
use crate::state::{AppState, Change};
use crate::types::{PromptInput, SelectBody};
use kvroute_core::error::PartitionKey;
use kvroute_core::hash::{PromptHashes, seed_for};
use kvroute_core::selector::{DisaggReservation, DisaggSelection, Selection};
use std::sync::Arc;
use std::time::Instant;

/// `POST /select`: a worker for the prompt, booking nothing (decided at once, or after waiting
/// in the admission queue).
pub fn select(
    state: &Arc<AppState>,
    body: SelectBody,
    tenant: Option<&str>,
) -> Admission<Selection> {
    admit(state, body, tenant)
}

/// `POST /select_and_reserve`: a worker for the prompt, booked.
pub fn select_and_reserve(
    state: &Arc<AppState>,
    body: SelectBody,
    tenant: Option<&str>,
) -> Admission<Booked> {
    admit(state, body, tenant)
}

fn admit<T: Routed>(
    state: &Arc<AppState>,
    mut body: SelectBody,
    tenant: Option<&str>,
) -> Admission<T> {
    match resolve_select(state, &mut body) {
        Ok(resolved) => admission::admit(state, resolved, body, tenant),
        Err(e) => Admission::Decided(Err(e)),
    }
}

/// Hashes a token prompt with the partition's block size, outside any write lock.
pub(super) fn hash_for_partition(
    state: &AppState,
    key: &PartitionKey,
    prompt: PromptInput,
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
) -> Result<PromptHashes, ApiError> {
    match prompt {
        PromptInput::Hashes(h) => Ok(h),
        PromptInput::Tokens(prompt) => {
            let block_size = state.selector.read().block_size_for(key)?;
            let start = Instant::now();
            let hashes = PromptHashes::from_tokens_with(
                &prompt.tokens,
                block_size as usize,
                seed_for(lora_name, cache_salt),
                prompt.extras(),
            );
            state
                .metrics
                .observe_phase("hash", start.elapsed().as_secs_f64());
            Ok(hashes)
        }
    }
}

fn resolve_select(state: &AppState, body: &mut SelectBody) -> Result<ResolvedSelect, ApiError> {
    let key = body.key()?;
    let mut prompt = body.take_prompt();
    let input = prompt.resolve("block_hashes")?;
    let overrides = body.overrides()?;
    let hashes = hash_for_partition(
        state,
        &key,
        input,
        prompt.lora_name.as_deref(),
        prompt.cache_salt.as_deref(),
    )?;
    Ok(ResolvedSelect {
        key,
        hashes,
        lora_name: prompt.lora_name,
        overrides,
        routing_constraints: body.routing_constraints.take(),
    })
}

/// A disaggregated select decided (SPEC §6.1): the picks, and, from `/select_and_reserve`, the
/// bookings of its legs.
#[derive(Debug, Clone)]
pub struct DisaggSelected {
    pub selection: DisaggSelection,
    pub reservations: Option<DisaggReservation>,
}

/// `POST /select` with `"disaggregated": true`: a prefill and a decode worker, or one worker
/// for the whole request (a bypass), booking nothing. Decided at once: a disaggregated request
/// does not wait in the admission queue.
pub fn select_disaggregated(
    state: &AppState,
    mut body: SelectBody,
) -> Result<DisaggSelected, ApiError> {
    let resolved = resolve_select(state, &mut body)?;
    let req = resolved.request(&body, body.advisory);
    let start = Instant::now();
    let selection =
        state
            .selector
            .read()
            .select_disaggregated(&req, state.now(), &mut rand::rng())?;
    state
        .metrics
        .observe_phase("route", start.elapsed().as_secs_f64());
    observe_legs(state, &selection);
    Ok(DisaggSelected {
        selection,
        reservations: None,
    })
}

/// `POST /select_and_reserve` with `"disaggregated": true`: both legs picked and booked (under
/// `<id>.prefill` and `<id>.decode`), or neither.
pub fn select_and_reserve_disaggregated(
    state: &AppState,
    mut body: SelectBody,
) -> Result<DisaggSelected, ApiError> {
    let resolved = resolve_select(state, &mut body)?;
    let req = resolved.request(&body, false);
    let booked = state.selector.write().select_and_reserve_disaggregated(
        &req,
        body.reservation_id.as_deref(),
        state.now(),
        &mut rand::rng(),
    );
    match booked {
        Ok((selection, reservations)) => {
            for r in reservations.prefill.iter().chain([&reservations.decode]) {
                state.changed(Change::Booked {
                    reservation_id: &r.reservation_id,
                    worker_id: r.worker_id,
                });
            }
            observe_legs(state, &selection);
            Ok(DisaggSelected {
                selection,
                reservations: Some(reservations),
            })
        }
        Err(e) => {
            // A refused booking may have dropped its session's binding.
            state.changed(Change::BookingRefused);
            Err(e.into())
        }
    }
}

/// Decision quality counts each leg in its own right.
fn observe_legs(state: &AppState, selection: &DisaggSelection) {
    for leg in selection.prefill.iter().chain([&selection.decode]) {
        state.metrics.observe_selection(leg);
    }
}
