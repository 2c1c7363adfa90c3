//! The mock engine's server: the router, the routes other than generation, and the connections.
//!
//! Connections are served by hyper's HTTP/1 (keep-alive), each on its own task, which also
//! watches two signals: `graceful` (finish the response in progress, then close) and `killed`
//! (drop the connection at once, mid-stream included). The accept loop stops on either and
//! drops the listener, so new connections are refused.

use super::disagg::{PdProtocol, PdRole};
use super::generate::{self, chat_prompt};
use super::protocol::{
    ApiError, DetokenizeRequest, ModelCard, ModelList, ModelPermission, TokenizeRequest,
    TokenizeResponse, json_response, parse,
};
use super::{AppState, unix_secs, until_true};
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper_util::rt::TokioIo;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceExt as _;

/// The largest request body read (a 128k-token prompt as JSON ids is ~1 MiB).
pub(crate) const MAX_BODY_BYTES: usize = 64 << 20;

pub(crate) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(generate::completions))
        .route("/v1/chat/completions", post(generate::chat_completions))
        .route("/v1/responses", post(generate::responses))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/kv_transfer/pull", post(super::disagg::pull_vllm))
        .fallback(not_found)
        .with_state(state)
}

/// Reads a body whole, or answers why not.
pub(crate) async fn read_body(body: Body) -> Result<axum::body::Bytes, ApiError> {
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|e| ApiError::bad_request(format!("cannot read the request body: {e}")))
}

/// A request naming a model this engine does not serve gets vLLM's 404.
pub(crate) fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(model) if model != state.model => Err(ApiError::unknown_model(model)),
        _ => Ok(()),
    }
}

async fn health(State(state): State<Arc<AppState>>) -> StatusCode {
    if state.shared.unhealthy.load(Ordering::Relaxed) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

/// vLLM's (V1) load gauges and request counters in the Prometheus text format, labelled as
/// vLLM labels them. The prefix-cache counters count tokens as the answers' `cached_tokens`
/// do: on a decode engine, the blocks received from a prefill engine are cached tokens.
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let (running, waiting, usage) = state.shared.load.read();
    let shared = &state.shared;
    let served = shared.served.load(Ordering::Relaxed);
    let prompt = shared.prompt_tokens_served.load(Ordering::Relaxed);
    let cached = shared.cached_tokens_served.load(Ordering::Relaxed);
    let labels = format!("engine=\"0\",model_name=\"{}\"", escape_label(&state.model));
    let body = format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{{labels}}} {running}.0\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{{labels}}} {waiting}.0\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{{labels}}} {usage}\n\
         # HELP vllm:request_success_total Count of successfully processed requests.\n\
         # TYPE vllm:request_success_total counter\n\
         vllm:request_success_total{{{labels},finished_reason=\"length\"}} {served}.0\n\
         # HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n\
         # TYPE vllm:prompt_tokens_total counter\n\
         vllm:prompt_tokens_total{{{labels}}} {prompt}.0\n\
         # HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of tokens.\n\
         # TYPE vllm:prefix_cache_queries_total counter\n\
         vllm:prefix_cache_queries_total{{{labels}}} {prompt}.0\n\
         # HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of tokens.\n\
         # TYPE vllm:prefix_cache_hits_total counter\n\
         vllm:prefix_cache_hits_total{{{labels}}} {cached}.0\n"
    );
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// A Prometheus label value: backslash, quote and newline escaped.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let created = unix_secs();
    let permission_id = format!("modelperm-{:016x}", state.shared.nonce);
    let list = ModelList {
        object: "list",
        data: [ModelCard {
            id: &state.model,
            object: "model",
            created,
            // What routers that detect the engine (SGLang's or vLLM's P/D flow) read.
            owned_by: match (state.pd.config.role, state.pd.config.protocol) {
                (PdRole::Prefill | PdRole::Decode, Some(PdProtocol::Sglang)) => "sglang",
                _ => "vllm",
            },
            root: &state.model,
            parent: None,
            max_model_len: state.max_model_len,
            permission: [ModelPermission {
                id: &permission_id,
                object: "model_permission",
                created,
                allow_create_engine: false,
                allow_sampling: true,
                allow_logprobs: true,
                allow_search_indices: false,
                allow_view: true,
                allow_fine_tuning: false,
                organization: "*",
                group: None,
                is_blocking: false,
            }],
        }],
    };
    json_response(serde_json::to_vec(&list).unwrap_or_default())
}

async fn tokenize(State(state): State<Arc<AppState>>, body: Body) -> Response {
    match tokenize_body(&state, body).await {
        Ok(response) => json_response(serde_json::to_vec(&response).unwrap_or_default()),
        Err(error) => error.into_response(),
    }
}

async fn tokenize_body(state: &AppState, body: Body) -> Result<TokenizeResponse, ApiError> {
    let body = read_body(body).await?;
    let request: TokenizeRequest = parse(&body)?;
    check_model(state, request.model.as_deref())?;
    let tokens = match (&request.messages, &request.prompt) {
        (Some(messages), _) => chat_prompt(
            state,
            messages,
            request.add_generation_prompt.unwrap_or(true),
            request.add_special_tokens.unwrap_or(false),
        )?,
        (None, Some(prompt)) => state
            .tokenizer
            .encode(prompt, request.add_special_tokens.unwrap_or(true))
            .map_err(ApiError::bad_request)?,
        (None, None) => {
            return Err(ApiError::bad_request(
                "give `prompt` or `messages` to tokenize",
            ));
        }
    };
    let token_strs = request.return_token_strs.unwrap_or(false).then(|| {
        tokens
            .iter()
            .map(|&id| state.tokenizer.decode(&[id]))
            .collect()
    });
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.max_model_len,
        tokens,
        token_strs,
    })
}

async fn detokenize(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let result = async {
        let body = read_body(body).await?;
        let request: DetokenizeRequest = parse(&body)?;
        check_model(&state, request.model.as_deref())?;
        Ok::<_, ApiError>(serde_json::json!({
            "prompt": state.tokenizer.decode(&request.tokens)
        }))
    }
    .await;
    match result {
        Ok(json) => json_response(serde_json::to_vec(&json).unwrap_or_default()),
        Err(error) => error.into_response(),
    }
}

/// FastAPI's answer for an unknown path, as vLLM gives it.
async fn not_found() -> Response {
    let mut response = json_response(br#"{"detail":"Not Found"}"#.to_vec());
    *response.status_mut() = StatusCode::NOT_FOUND;
    response
}

/// Accepts connections until `graceful` or `killed` turns true, then drops the listener. Each
/// connection holds a clone of `open` until it ends.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    mut graceful: watch::Receiver<bool>,
    mut killed: watch::Receiver<bool>,
    open: watch::Receiver<()>,
) {
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of file descriptors, or a connection that failed before its accept.
                    tracing::debug!(%error, "mock engine: accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = until_true(&mut graceful) => break,
            () = until_true(&mut killed) => break,
        };
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "mock engine: cannot set TCP_NODELAY");
        }
        tokio::spawn(serve_connection(
            stream,
            router.clone(),
            graceful.clone(),
            killed.clone(),
            open.clone(),
        ));
    }
}

async fn serve_connection(
    stream: tokio::net::TcpStream,
    router: Router,
    mut graceful: watch::Receiver<bool>,
    mut killed: watch::Receiver<bool>,
    open: watch::Receiver<()>,
) {
    let mut killed_later = killed.clone();
    let service = hyper::service::service_fn(move |request| router.clone().oneshot(request));
    let builder = hyper::server::conn::http1::Builder::new();
    let mut connection = pin!(builder.serve_connection(TokioIo::new(stream), service));
    let result = tokio::select! {
        result = connection.as_mut() => Some(result),
        () = until_true(&mut killed) => None,
        () = until_true(&mut graceful) => {
            connection.as_mut().graceful_shutdown();
            tokio::select! {
                result = connection.as_mut() => Some(result),
                () = until_true(&mut killed_later) => None,
            }
        }
    };
    if let Some(Err(error)) = result {
        tracing::trace!(%error, "mock engine: connection ended with an error");
    }
    drop(open);
}
