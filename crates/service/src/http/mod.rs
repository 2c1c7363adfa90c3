//! The HTTP selection service (SPEC §7): routes, middleware (metrics, API key, shutdown) and
//! [`app`], which builds the whole service so tests can drive it without a socket.

pub mod connections;
pub mod handlers;
pub mod json;
pub mod openapi;
pub mod render;

/// The request/response types and the error mapping live at the crate root, below
/// [`crate::api`] (which the handlers call); re-exported where HTTP callers look for them.
pub use crate::{error, types};

use crate::error::ApiError;
use crate::state::AppState;
use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRef, MatchedPath, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter, on};
use handlers::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Routes that answer without an API key and during shutdown.
fn is_open_route(path: &str) -> bool {
    matches!(path, "/health" | "/ready" | "/metrics")
}

/// The key a request offers: `Authorization: Bearer <key>`, or `Authorization: Basic` with the
/// key as the password (any user name), which is how a browser sends it after the login dialog
/// `/dashboard` asks for (its 401 carries `WWW-Authenticate: Basic`).
fn offered_key(headers: &axum::http::HeaderMap) -> Vec<u8> {
    let Some(value) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return Vec::new();
    };
    if let Some(key) = value.strip_prefix("Bearer ") {
        return key.as_bytes().to_vec();
    }
    value
        .strip_prefix("Basic ")
        .and_then(|b| decode_base64(b.trim()))
        .and_then(|pair| {
            let colon = pair.iter().position(|&c| c == b':')?;
            Some(pair[colon + 1..].to_vec())
        })
        .unwrap_or_default()
}

/// Standard base64 (RFC 4648, padding optional); `None` on any other byte.
fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let (mut bits, mut n) = (0u32, 0u32);
    for &c in text.trim_end_matches('=').as_bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        bits = (bits << 6) | u32::from(v);
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
            bits &= (1 << n) - 1;
        }
    }
    Some(out)
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
    pub const DASHBOARD: &str = "/dashboard";
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
    Endpoint::new(Method::GET, route::DASHBOARD, |m| on(m, dashboard)),
];

/// The metrics label of a request's route: its template (one of [`ENDPOINTS`] or of the extra
/// routes' `paths`), or `unmatched`.
fn route_label(matched: Option<&MatchedPath>, extra_paths: &[&'static str]) -> &'static str {
    let Some(path) = matched.map(MatchedPath::as_str) else {
        return "unmatched";
    };
    ENDPOINTS
        .iter()
        .map(|e| e.path)
        .chain(extra_paths.iter().copied())
        .find(|p| *p == path)
        .unwrap_or("unmatched")
}

/// Routes another crate serves on the service's port, behind the same guard (shutdown, API key,
/// metrics) and body limit as the service's own: `kvroute gateway`'s OpenAI routes. `paths`
/// are the router's path templates, the metrics' route labels.
#[derive(Clone, Default)]
pub struct ExtraRoutes {
    pub router: Router<Arc<AppState>>,
    pub paths: &'static [&'static str],
}

/// What the guard middleware reads: the state, and the extra routes' labels.
#[derive(Clone)]
struct GuardState {
    state: Arc<AppState>,
    extra_paths: &'static [&'static str],
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

async fn guard(State(guard): State<GuardState>, req: Request, next: Next) -> Response {
    let GuardState { state, extra_paths } = guard;
    let start = Instant::now();
    let route = route_label(req.extensions().get::<MatchedPath>(), extra_paths);
    let method = method_label(req.method());
    let open = is_open_route(req.uri().path());
    let response = if !open && state.is_shutting_down() {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "selection service is shutting down",
        )
        .into_response()
    } else if let (false, Some(key)) = (open, state.config.api_key.as_deref()) {
        if keys_match(&offered_key(req.headers()), key.as_bytes()) {
            next.run(req).await
        } else {
            let mut response = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or invalid API key: send `Authorization: Bearer <key>`",
            )
            .into_response();
            // A browser opening the status page asks for the key (as the password).
            if req.uri().path() == route::DASHBOARD {
                response.headers_mut().insert(
                    axum::http::header::WWW_AUTHENTICATE,
                    axum::http::HeaderValue::from_static(
                        "Basic realm=\"kvroute\", charset=\"UTF-8\"",
                    ),
                );
            }
            response
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
    app_with(state, ExtraRoutes::default())
}

/// The whole service as a router, with `extra` routes beside the service's own.
pub fn app_with(state: Arc<AppState>, extra: ExtraRoutes) -> Router {
    let body_limit = state.config.body_limit_bytes;
    let guard_state = GuardState {
        state: Arc::clone(&state),
        extra_paths: extra.paths,
    };
    // Methods of one path merge into one route.
    ENDPOINTS
        .iter()
        .fold(Router::new(), |router, e| {
            router.route(e.path, e.method_router())
        })
        .merge(extra.router)
        .fallback(route_not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(guard_state, guard))
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

impl FromRef<Arc<AppState>> for json::BodyReadTimeout {
    fn from_ref(state: &Arc<AppState>) -> Self {
        Self(Duration::from_millis(state.config.body_read_timeout_ms))
    }
}

/// Serves until `shutdown` resolves; then refuses new work, lets in-flight requests finish and
/// returns. The connection limits (`--max-connections`, the header-read and idle timeouts) are
/// [`connections`]'; the body-read timeout is the body extractors' ([`json`]).
pub async fn serve(
    state: Arc<AppState>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(state, listener, ExtraRoutes::default(), shutdown).await
}

/// [`serve`] with `extra` routes beside the service's own ([`app_with`]).
pub async fn serve_with(
    state: Arc<AppState>,
    listener: tokio::net::TcpListener,
    extra: ExtraRoutes,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state
        .config
        .connection_limits()
        .map_err(|message| std::io::Error::new(std::io::ErrorKind::InvalidInput, message))?;
    connections::warn_if_above_file_limit(limits.max_connections);
    tokio::spawn(Arc::clone(&state).run_housekeeping());
    if let Some(every) = state.config.engine_metrics_poll().ok().flatten() {
        tokio::spawn(crate::engine_load::run(Arc::clone(&state), every));
    }
    let drain_state = Arc::clone(&state);
    let listener =
        connections::GuardedListener::new(listener, limits, state.metrics.connections.clone());
    connections::serve(listener, app_with(state, extra), async move {
        shutdown.await;
        tracing::info!("shutting down: refusing new work, finishing in-flight requests");
        drain_state.begin_shutdown();
    })
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{decode_base64, offered_key};
    use axum::http::{HeaderMap, HeaderValue, header::AUTHORIZATION};

    fn offered(value: &str) -> Vec<u8> {
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        offered_key(&headers)
    }

    #[test]
    fn base64_decodes_with_and_without_padding() {
        assert_eq!(
            decode_base64("a3Zyb3V0ZTpzM2NyZXQ=").unwrap(),
            b"kvroute:s3cret"
        );
        assert_eq!(decode_base64("YQ").unwrap(), b"a");
        assert_eq!(decode_base64("YWI=").unwrap(), b"ab");
        assert_eq!(decode_base64("").unwrap(), b"");
        assert!(decode_base64("a-b").is_none());
    }

    #[test]
    fn the_key_comes_as_bearer_or_as_the_basic_password() {
        assert_eq!(offered("Bearer s3cret"), b"s3cret");
        // "anyone:s3:cret": the password is all after the first colon.
        assert_eq!(offered("Basic YW55b25lOnMzOmNyZXQ="), b"s3:cret");
        assert_eq!(offered("Basic bm9jb2xvbg=="), b"");
        assert_eq!(offered("Digest x"), b"");
    }
}
