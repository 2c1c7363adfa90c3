//! Route handlers: parse, call the selector, render. No routing logic lives here.

use super::error::ApiError;
use super::json::{OptionalJson, StrictJson};
use super::types::*;
use crate::state::AppState;
use axum::Json;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use kvroute_core::error::{Error, PartitionKey, check_id};
use kvroute_core::event::{KvEvent, Tier};
use kvroute_core::hash::{PromptHashes, seed_for};
use kvroute_core::selector::{Prompt, ReservationRequest, SelectRequest, Selector};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

type AppResult = Result<Response, ApiError>;
type Shared = State<Arc<AppState>>;

fn ok_status() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

/// A path segment as a string, with a JSON 400 (not axum's plain text) when it cannot be read.
pub struct PathId(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(id)| PathId(id))
            .map_err(|e| ApiError::bad_request(format!("invalid path parameter: {e}")))
    }
}

fn worker_id_param(raw: &str) -> Result<u64, ApiError> {
    raw.parse::<u64>().map_err(|_| {
        ApiError::bad_request(format!(
            "invalid worker_id path parameter `{raw}`: expected an integer between 0 and 18446744073709551615"
        ))
    })
}

fn reservation_id_param(raw: &str) -> Result<&str, ApiError> {
    check_id("reservation_id", raw)?;
    Ok(raw)
}

// ---------------------------------------------------------------------------------------------
// Catalog

pub async fn upsert_worker(
    State(state): Shared,
    StrictJson(body): StrictJson<WorkerBody>,
) -> AppResult {
    if body.worker_id.is_none() {
        return Err(ApiError::unprocessable(
            "Failed to deserialize the JSON body into the target type: missing field `worker_id`",
        ));
    }
    let spec = body.into_spec()?;
    let outcome = state.selector.write().upsert_worker(spec)?;
    state.sync_listeners(&outcome.record, outcome.events_changed);
    Ok((StatusCode::CREATED, Json(worker_json(&outcome.record))).into_response())
}

pub async fn patch_worker(
    State(state): Shared,
    PathId(raw): PathId,
    StrictJson(body): StrictJson<WorkerBody>,
) -> AppResult {
    let worker_id = worker_id_param(&raw)?;
    let outcome = {
        let mut selector = state.selector.write();
        let Some(existing) = selector.worker(worker_id) else {
            return Err(Error::WorkerNotFound { worker_id }.into());
        };
        let spec = body.patch(existing.spec.clone())?;
        selector.upsert_worker(spec)?
    };
    state.sync_listeners(&outcome.record, outcome.events_changed);
    Ok(Json(worker_json(&outcome.record)).into_response())
}

pub async fn delete_worker(State(state): Shared, PathId(raw): PathId) -> AppResult {
    let worker_id = worker_id_param(&raw)?;
    let record = state.selector.write().delete_worker(worker_id)?;
    state.ingest.remove_worker(worker_id);
    Ok(Json(worker_json(&record)).into_response())
}

pub async fn list_workers(State(state): Shared, Query(q): Query<PartitionQuery>) -> AppResult {
    let workers = state
        .selector
        .read()
        .list_workers(q.model_name.as_deref(), q.routing_group.as_deref());
    Ok(Json(Value::Array(workers.iter().map(worker_json).collect())).into_response())
}

pub async fn ready(State(state): Shared) -> AppResult {
    let ready = state.selector.read().ready();
    let status = if ready.ready && !state.is_shutting_down() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "ready": ready.ready && !state.is_shutting_down(),
        "schedulable_workers": ready.schedulable_workers,
        "workers": ready.workers.iter().map(worker_json).collect::<Vec<_>>(),
    });
    Ok((status, Json(body)).into_response())
}

pub async fn health() -> Response {
    ok_status()
}

// ---------------------------------------------------------------------------------------------
// Selection

/// Hashes a token prompt with the partition's block size, outside any write lock.
fn hash_for_partition(
    state: &AppState,
    key: &PartitionKey,
    prompt: PromptInput,
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
) -> Result<PromptHashes, ApiError> {
    match prompt {
        PromptInput::Hashes(h) => Ok(h),
        PromptInput::Tokens(tokens) => {
            let block_size = state.selector.read().block_size_for(key)?;
            let start = Instant::now();
            let hashes = PromptHashes::from_tokens(
                &tokens,
                block_size as usize,
                seed_for(lora_name, cache_salt),
            );
            state
                .metrics
                .observe_phase("hash", start.elapsed().as_secs_f64());
            Ok(hashes)
        }
    }
}

pub async fn select(
    State(state): Shared,
    StrictJson(mut body): StrictJson<SelectBody>,
) -> AppResult {
    let key = body.key()?;
    let mut prompt = body.take_prompt();
    let input = prompt.resolve("block_hashes")?;
    let overrides = body.overrides()?;
    let hashes = hash_for_partition(
        &state,
        &key,
        input,
        prompt.lora_name.as_deref(),
        prompt.cache_salt.as_deref(),
    )?;
    let pinned = body.pinned();
    let req = SelectRequest {
        partition: &key,
        selection_id: body.selection_id.as_deref(),
        prompt: Prompt::Hashes(&hashes),
        lora_name: prompt.lora_name.as_deref(),
        expected_output_tokens: body.expected_output_tokens,
        overrides,
        pinned_worker: pinned,
        allowed_worker_ids: body.allowed_worker_ids.as_deref(),
        advisory: body.advisory,
    };
    let start = Instant::now();
    let selection = state
        .selector
        .read()
        .select(&req, Instant::now(), &mut rand::rng())?;
    state
        .metrics
        .observe_phase("route", start.elapsed().as_secs_f64());
    Ok(Json(selection_json(&selection)).into_response())
}

pub async fn select_and_reserve(
    State(state): Shared,
    StrictJson(mut body): StrictJson<SelectBody>,
) -> AppResult {
    let key = body.key()?;
    let mut prompt = body.take_prompt();
    let input = prompt.resolve("block_hashes")?;
    let overrides = body.overrides()?;
    let hashes = hash_for_partition(
        &state,
        &key,
        input,
        prompt.lora_name.as_deref(),
        prompt.cache_salt.as_deref(),
    )?;
    let req = SelectRequest {
        partition: &key,
        selection_id: body.selection_id.as_deref(),
        prompt: Prompt::Hashes(&hashes),
        lora_name: prompt.lora_name.as_deref(),
        expected_output_tokens: body.expected_output_tokens,
        overrides,
        pinned_worker: body.pinned(),
        allowed_worker_ids: body.allowed_worker_ids.as_deref(),
        advisory: false,
    };
    let (selection, reservation) = state.selector.write().select_and_reserve(
        &req,
        body.reservation_id.as_deref(),
        Instant::now(),
        &mut rand::rng(),
    )?;
    Ok(Json(select_and_reserve_json(&selection, &reservation)).into_response())
}

pub async fn create_reservation(
    State(state): Shared,
    StrictJson(mut body): StrictJson<ReservationBody>,
) -> AppResult {
    let key = body.key()?;
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
            tokens,
            lora_name: prompt.lora_name.as_deref(),
            cache_salt: prompt.cache_salt.as_deref(),
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
    };
    let reservation = state
        .selector
        .write()
        .create_reservation(&req, Instant::now())?;
    Ok((StatusCode::CREATED, Json(reservation_json(&reservation))).into_response())
}

pub async fn prefill_complete(
    State(state): Shared,
    PathId(raw): PathId,
    OptionalJson(_body): OptionalJson<Value>,
) -> AppResult {
    let id = reservation_id_param(&raw)?;
    state
        .selector
        .write()
        .prefill_complete(id, Instant::now())?;
    Ok(ok_status())
}

pub async fn output_block(
    State(state): Shared,
    PathId(raw): PathId,
    OptionalJson(body): OptionalJson<OutputBlockBody>,
) -> AppResult {
    let id = reservation_id_param(&raw)?;
    let decay = body.and_then(|b| b.decay_fraction);
    state
        .selector
        .write()
        .output_block(id, decay, Instant::now())?;
    Ok(ok_status())
}

pub async fn free_reservation(State(state): Shared, PathId(raw): PathId) -> AppResult {
    let id = reservation_id_param(&raw)?;
    state.selector.write().free(id)?;
    Ok(ok_status())
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
    let hashes = hash_for_partition(
        state,
        &key,
        input,
        prompt.lora_name.as_deref(),
        prompt.cache_salt.as_deref(),
    )?;
    Ok((key, hashes))
}

pub async fn overlap_scores(
    State(state): Shared,
    StrictJson(mut body): StrictJson<PromptRouteBody>,
) -> AppResult {
    let (key, hashes) = resolve_prompt_route(&state, &mut body)?;
    let scores = state
        .selector
        .read()
        .overlap_scores(&key, Prompt::Hashes(&hashes))?;
    Ok(Json(overlap_scores_json(&scores)).into_response())
}

pub async fn potential_loads(
    State(state): Shared,
    StrictJson(mut body): StrictJson<PromptRouteBody>,
) -> AppResult {
    let overrides = body.overrides()?;
    let (key, hashes) = resolve_prompt_route(&state, &mut body)?;
    let loads = state
        .selector
        .read()
        .potential_loads(&key, Prompt::Hashes(&hashes), &overrides)?;
    Ok(Json(loads.iter().map(RankLoadJson::from).collect::<Vec<_>>()).into_response())
}

pub async fn loads(State(state): Shared, Query(q): Query<PartitionQuery>) -> AppResult {
    let loads = state
        .selector
        .read()
        .loads(q.model_name.as_deref(), q.routing_group.as_deref());
    Ok(Json(loads_json(&loads)).into_response())
}

fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "device",
        Tier::Host => "host_pinned",
        Tier::Disk => "disk",
    }
}

/// `GET /dump`: the index as Dynamo-shaped stored events, keyed `"{model}:{group}"`.
pub fn dump_json(selector: &Selector) -> Value {
    let mut out = BTreeMap::new();
    let mut event_id = 0u64;
    for partition in selector.dump() {
        let events: Vec<Value> = partition
            .events
            .iter()
            .filter_map(|(rank, event)| match event {
                KvEvent::Stored {
                    parent,
                    blocks,
                    tier,
                } => {
                    let id = event_id;
                    event_id += 1;
                    Some(json!({
                        "worker_id": rank.worker_id,
                        "dp_rank": rank.dp_rank,
                        "storage_tier": tier_name(*tier),
                        "residency_domain": "worker",
                        "event": {
                            "event_id": id,
                            "data": {"stored": {
                                "parent_hash": parent,
                                "start_position": null,
                                "blocks": blocks.iter().map(|b| json!({
                                    "block_hash": b.engine_hash,
                                    "tokens_hash": b.local_hash,
                                    "mm_extra_info": null,
                                })).collect::<Vec<_>>(),
                            }},
                            "dp_rank": rank.dp_rank,
                        },
                    }))
                }
                _ => None,
            })
            .collect();
        out.insert(
            format!(
                "{}:{}",
                partition.partition.model_name, partition.partition.routing_group
            ),
            json!({"block_size": partition.block_size, "events": events}),
        );
    }
    json!(out)
}

pub async fn dump(State(state): Shared) -> AppResult {
    let body = dump_json(&state.selector.read());
    Ok(Json(body).into_response())
}

pub async fn metrics(State(state): Shared) -> Response {
    let text = state.metrics.render(&state.selector.read());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

pub async fn openapi() -> Response {
    Json(super::openapi::document()).into_response()
}
