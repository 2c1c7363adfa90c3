//! The HTTP selection service (SPEC §7): routes, middleware (metrics, API key, shutdown) and
//! [`app`], which builds the whole service so tests can drive it without a socket.

pub mod handlers;
pub mod json;
pub mod openapi;

/// The request/response types and the error mapping live at the crate root, below
/// [`crate::api`] (which the handlers call); re-exported where HTTP callers look for them.
pub use crate::{error, types};

use crate::error::ApiError;
use crate::state::AppState;
use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter, on};
use handlers::*;
use std::sync::Arc;
use std::time::Instant;

/// Routes that answer without an API key and during shutdown.
fn is_open_route(path: &str) -> bool {
    matches!(path, "/health" | "/ready" | "/metrics")
}

fn keys_match(given: &[u8], expected: &[u8]) -> bool {
    // Compare in time independent of where the first difference is.
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// The route templates [`app`] serves; the metrics label requests with them.
pub mod route {
    pub const WORKERS: &str = "/workers";
    pub const WORKER: &str = "/workers/{worker_id}";
    pub const SELECT: &str = "/select";
    pub const SELECT_AND_RESERVE: &str = "/select_and_reserve";
    pub const RESERVATIONS: &str = "/reservations";
    pub const PREFILL_COMPLETE: &str = "/reservations/{reservation_id}/prefill_complete";
    pub const OUTPUT_BLOCK: &str = "/reservations/{reservation_id}/output_block";
    pub const RESERVATION: &str = "/reservations/{reservation_id}";
    pub const OVERLAP_SCORES: &str = "/overlap_scores";
    pub const POTENTIAL_LOADS: &str = "/potential_loads";
    pub const LOADS: &str = "/loads";
    pub const READY: &str = "/ready";
    pub const HEALTH: &str = "/health";
    pub const DUMP: &str = "/dump";
    pub const METRICS: &str = "/metrics";
    pub const OPENAPI: &str = "/openapi.json";
}

/// One route [`app`] serves: a method on a path template, and its handler.
pub struct Endpoint {
    pub method: Method,
    pub path: &'static str,
    handler: fn(MethodFilter) -> MethodRouter<Arc<AppState>>,
}

impl Endpoint {
    const fn new(
        method: Method,
        path: &'static str,
        handler: fn(MethodFilter) -> MethodRouter<Arc<AppState>>,
    ) -> Self {
        Self {
            method,
            path,
            handler,
        }
    }

    fn method_router(&self) -> MethodRouter<Arc<AppState>> {
        let filter = MethodFilter::try_from(self.method.clone())
            .unwrap_or_else(|_| panic!("no method filter for {}", self.method));
        (self.handler)(filter)
    }
}

/// Every route the service serves, read by [`app`] (the router), the metrics labels and the
/// test that holds the OpenAPI document to it.
pub const ENDPOINTS: &[Endpoint] = &[
    Endpoint::new(Method::POST, route::WORKERS, |m| on(m, upsert_worker)),
    Endpoint::new(Method::GET, route::WORKERS, |m| on(m, list_workers)),
    Endpoint::new(Method::PATCH, route::WORKER, |m| on(m, patch_worker)),
    Endpoint::new(Method::DELETE, route::WORKER, |m| on(m, delete_worker)),
    Endpoint::new(Method::POST, route::SELECT, |m| on(m, select)),
    Endpoint::new(Method::POST, route::SELECT_AND_RESERVE, |m| {
        on(m, select_and_reserve)
    }),
    Endpoint::new(Method::POST, route::RESERVATIONS, |m| {
        on(m, create_reservation)
    }),
    Endpoint::new(Method::POST, route::PREFILL_COMPLETE, |m| {
        on(m, prefill_complete)
    }),
    Endpoint::new(Method::POST, route::OUTPUT_BLOCK, |m| on(m, output_block)),
    Endpoint::new(Method::DELETE, route::RESERVATION, |m| {
        on(m, free_reservation)
    }),
    Endpoint::new(Method::POST, route::OVERLAP_SCORES, |m| {
        on(m, overlap_scores)
    }),
    Endpoint::new(Method::POST, route::POTENTIAL_LOADS, |m| {
        on(m, potential_loads)
    }),
    Endpoint::new(Method::GET, route::LOADS, |m| on(m, loads)),
    Endpoint::new(Method::GET, route::READY, |m| on(m, ready)),
    Endpoint::new(Method::GET, route::HEALTH, |m| on(m, health)),
    Endpoint::new(Method::GET, route::DUMP, |m| on(m, dump)),
    Endpoint::new(Method::GET, route::METRICS, |m| on(m, metrics)),
    Endpoint::new(Method::GET, route::OPENAPI, |m| on(m, openapi)),
];

/// The metrics label of a request's route: its template, or `unmatched`.
fn route_label(matched: Option<&MatchedPath>) -> &'static str {
    matched
        .and_then(|path| ENDPOINTS.iter().find(|e| e.path == path.as_str()))
        .map_or("unmatched", |e| e.path)
}

fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

async fn guard(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let start = Instant::now();
    let route = route_label(req.extensions().get::<MatchedPath>());
    let method = method_label(req.method());
    let open = is_open_route(req.uri().path());
    let response = if !open && state.is_shutting_down() {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "selection service is shutting down",
        )
        .into_response()
    } else if let (false, Some(key)) = (open, state.config.api_key.as_deref()) {
        let given = req
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if keys_match(given.as_bytes(), key.as_bytes()) {
            next.run(req).await
        } else {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or invalid API key: send `Authorization: Bearer <key>`",
            )
            .into_response()
        }
    } else {
        next.run(req).await
    };
    state.metrics.observe_http(
        route,
        method,
        response.status().as_u16(),
        start.elapsed().as_secs_f64(),
    );
    response
}

async fn route_not_found() -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "route not found").into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed").into_response()
}

/// The whole service as a router.
pub fn app(state: Arc<AppState>) -> Router {
    let body_limit = state.config.body_limit_bytes;
    // Methods of one path merge into one route.
    ENDPOINTS
        .iter()
        .fold(Router::new(), |router, e| {
            router.route(e.path, e.method_router())
        })
        .fallback(route_not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(Arc::clone(&state), guard))
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// Serves until `shutdown` resolves; then refuses new work, lets in-flight requests finish and
/// returns.
pub async fn serve(
    state: Arc<AppState>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    tokio::spawn(Arc::clone(&state).run_housekeeping());
    let drain_state = Arc::clone(&state);
    use axum::serve::ListenerExt;
    // Responses leave at once (no Nagle delay behind an unacknowledged segment).
    let listener = listener.tap_io(|stream| {
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY");
        }
    });
    axum::serve(listener, app(state))
        .with_graceful_shutdown(async move {
            shutdown.await;
            tracing::info!("shutting down: refusing new work, finishing in-flight requests");
            drain_state.begin_shutdown();
        })
        .await
}
