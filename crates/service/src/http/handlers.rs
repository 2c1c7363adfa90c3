//! Route handlers: extract, call [`crate::api`], render ([`super::render`]). No routing logic
//! lives here.

use super::json::{JsonBody, OptionalJson, StrictJson};
use super::render;
use crate::api;
use crate::error::ApiError;
use crate::state::AppState;
use crate::types::*;
use axum::Json;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::sync::Arc;

type AppResult = Result<Response, ApiError>;

// The bodies the handlers parse with `StrictJson`; those with a top-level `token_ids` array let
// it take the fast path.
macro_rules! json_body_with_tokens {
    ($($t:ty),*) => {$(
        impl JsonBody for $t {
            const HAS_TOKEN_IDS: bool = true;

            fn token_ids_slot(&mut self) -> Option<&mut Option<Vec<u32>>> {
                Some(&mut self.token_ids)
            }
        }
    )*};
}

json_body_with_tokens!(SelectBody, ReservationBody, PromptRouteBody);

impl JsonBody for WorkerBody {}
impl JsonBody for OutputBlockBody {}
type Shared = State<Arc<AppState>>;

fn ok(value: Value) -> AppResult {
    Ok(Json(value).into_response())
}

fn created(value: Value) -> AppResult {
    Ok((StatusCode::CREATED, Json(value)).into_response())
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

pub async fn upsert_worker(
    State(state): Shared,
    StrictJson(body): StrictJson<WorkerBody>,
) -> AppResult {
    created(render::worker(&api::upsert_worker(&state, body)?))
}

pub async fn patch_worker(
    State(state): Shared,
    PathId(raw): PathId,
    StrictJson(body): StrictJson<WorkerBody>,
) -> AppResult {
    ok(render::worker(&api::patch_worker(
        &state,
        worker_id_param(&raw)?,
        body,
    )?))
}

pub async fn delete_worker(State(state): Shared, PathId(raw): PathId) -> AppResult {
    ok(render::worker(&api::delete_worker(
        &state,
        worker_id_param(&raw)?,
    )?))
}

pub async fn list_workers(State(state): Shared, Query(q): Query<PartitionQuery>) -> AppResult {
    ok(render::workers(&api::list_workers(
        &state,
        q.model_name.as_deref(),
        q.routing_group.as_deref(),
    )))
}

pub async fn ready(State(state): Shared) -> AppResult {
    let ready = api::ready(&state);
    let status = if ready.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    Ok((status, Json(render::ready(&ready))).into_response())
}

pub async fn health() -> AppResult {
    ok(render::ok_status())
}

/// The request's tenant in the admission queue: its `x-tenant-id` header (only that header is
/// copied, and only when sent).
pub struct Tenant(pub Option<String>);

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        match parts.headers.get("x-tenant-id") {
            None => Ok(Tenant(None)),
            Some(v) => v
                .to_str()
                .map(|t| Tenant(Some(t.to_string())))
                .map_err(|_| ApiError::bad_request("x-tenant-id must be visible ASCII")),
        }
    }
}

pub async fn select(
    State(state): Shared,
    Tenant(tenant): Tenant,
    StrictJson(body): StrictJson<SelectBody>,
) -> AppResult {
    state.applier.passed().await;
    if body.disaggregated {
        return ok(render::disaggregated(&api::select_disaggregated(
            &state, body,
        )?));
    }
    let selection = api::select(&state, body, tenant.as_deref())
        .answer()
        .await?;
    ok(render::selection(&selection))
}

pub async fn select_and_reserve(
    State(state): Shared,
    Tenant(tenant): Tenant,
    StrictJson(body): StrictJson<SelectBody>,
) -> AppResult {
    state.applier.passed().await;
    if body.disaggregated {
        let booked = api::select_and_reserve_disaggregated(&state, body)?;
        return ok(render::disaggregated(&booked));
    }
    let booked = api::select_and_reserve(&state, body, tenant.as_deref())
        .answer()
        .await?;
    ok(render::booked(&booked))
}

pub async fn create_reservation(
    State(state): Shared,
    StrictJson(body): StrictJson<ReservationBody>,
) -> AppResult {
    state.applier.passed().await;
    created(render::reservation(&api::create_reservation(&state, body)?))
}

pub async fn prefill_complete(
    State(state): Shared,
    PathId(id): PathId,
    OptionalJson(_body): OptionalJson<Value>,
) -> AppResult {
    state.applier.passed().await;
    api::prefill_complete(&state, &id)?;
    ok(render::ok_status())
}

pub async fn output_block(
    State(state): Shared,
    PathId(id): PathId,
    OptionalJson(body): OptionalJson<OutputBlockBody>,
) -> AppResult {
    state.applier.passed().await;
    api::output_block(&state, &id, body.and_then(|b| b.decay_fraction))?;
    ok(render::ok_status())
}

pub async fn free_reservation(State(state): Shared, PathId(id): PathId) -> AppResult {
    state.applier.passed().await;
    api::free_reservation(&state, &id)?;
    ok(render::ok_status())
}

pub async fn overlap_scores(
    State(state): Shared,
    StrictJson(body): StrictJson<PromptRouteBody>,
) -> AppResult {
    state.applier.passed().await;
    ok(render::overlap_scores(&api::overlap_scores(&state, body)?))
}

pub async fn potential_loads(
    State(state): Shared,
    StrictJson(body): StrictJson<PromptRouteBody>,
) -> AppResult {
    state.applier.passed().await;
    ok(render::potential_loads(&api::potential_loads(
        &state, body,
    )?))
}

pub async fn loads(State(state): Shared, Query(q): Query<PartitionQuery>) -> AppResult {
    let loads = api::loads(&state, q.model_name.as_deref(), q.routing_group.as_deref());
    ok(render::loads_with_degraded(&loads, &api::degraded(&state)))
}

pub async fn dump(State(state): Shared) -> AppResult {
    // The snapshot under the read lock; the JSON (seconds for millions of blocks) after it, off
    // the request threads, written straight from the snapshot.
    let partitions = api::dump(&state);
    let failed = |e: &dyn std::fmt::Display| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("building the dump failed: {e}"),
        )
    };
    let body = tokio::task::spawn_blocking(move || serde_json::to_vec(&render::Dump(partitions)))
        .await
        .map_err(|e| failed(&e))?
        .map_err(|e| failed(&e))?;
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response())
}

pub async fn metrics(State(state): Shared) -> Response {
    api::observe_queue(&state);
    let text = state.render_metrics();
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

/// The status page (`dashboard.html`, compiled in): it polls `/loads` and `/metrics`.
pub async fn dashboard() -> Response {
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (axum::http::header::CACHE_CONTROL, "no-store"),
        ],
        include_str!("dashboard.html"),
    )
        .into_response()
}
