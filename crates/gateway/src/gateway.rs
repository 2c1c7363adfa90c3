//! The gateway's state and its routes: `POST /v1/completions`, `POST /v1/chat/completions`,
//! `GET /v1/models`, served beside the selection service's own routes.
//!
//! A request: read the body (the service's limit and read timeout), parse the few fields the
//! gateway needs, tokenize the prompt once, book the best worker (`select_and_reserve`, in
//! process), send the body as received to that worker over a pooled keep-alive connection, and
//! answer with the worker's status and body as they come ([`ProxyBody`]). A worker that cannot
//! be connected to is left out and the next-best one booked, `--connect-retries` times at most.

use crate::breaker::Breakers;
use crate::config::{GatewayConfig, GatewayPolicy};
use crate::lifecycle::Booking;
use crate::metrics::GatewayMetrics;
use crate::openai::{GatewayError, OpenAiRequest, Prompt};
use crate::proxy::ProxyBody;
use crate::template::ChatInputs;
use crate::tokenize::{RoutingPrompt, TokenizeMode, Tokenizers};
use crate::workers::{self, FileWorkers};
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kvroute_service::queue::QueuedRoute;
use kvroute_service::types::{PinnedBody, SelectBody, WireHash};
use kvroute_service::{AppState, api, http::ExtraRoutes};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// The route templates the gateway adds (the metrics' labels).
pub mod route {
    pub const COMPLETIONS: &str = "/v1/completions";
    pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";
    pub const MODELS: &str = "/v1/models";
    pub const ALL: &[&str] = &[COMPLETIONS, CHAT_COMPLETIONS, MODELS];
}

type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// Which OpenAI route a request came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completions,
    Chat,
}

impl Kind {
    fn path(self) -> &'static str {
        match self {
            Kind::Completions => route::COMPLETIONS,
            Kind::Chat => route::CHAT_COMPLETIONS,
        }
    }
}

/// Everything a gateway request reads.
pub struct Gateway {
    state: Arc<AppState>,
    config: GatewayConfig,
    client: UpstreamClient,
    breakers: Breakers,
    tokenizers: Tokenizers,
    metrics: GatewayMetrics,
    /// Spreads remote tokenization over a model's workers.
    next_tokenizer_worker: AtomicUsize,
    /// `--gateway-policy round-robin`'s turn.
    next_worker: AtomicUsize,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Gateway {
    /// Loads the tokenizers, registers the flags' and the file's workers and attaches the
    /// metrics to the service's. The message of an error names the flag or file at fault.
    pub fn new(state: Arc<AppState>, config: GatewayConfig) -> Result<Arc<Self>, String> {
        let tokenizers = Tokenizers::load(config.tokenize, &config.tokenizers)?;
        workers::register(&state, &config.workers)?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        let (metrics, registry) = GatewayMetrics::new();
        state.metrics.attach(registry);
        Ok(Arc::new(Self {
            breakers: Breakers::new(config.breaker),
            state,
            config,
            client,
            tokenizers,
            metrics,
            next_tokenizer_worker: AtomicUsize::new(0),
            next_worker: AtomicUsize::new(0),
        }))
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.config
    }

    pub fn metrics(&self) -> &GatewayMetrics {
        &self.metrics
    }

    pub fn breakers(&self) -> &Breakers {
        &self.breakers
    }

    /// The gateway's routes, to serve beside the service's (`http::serve_with`).
    pub fn routes(self: &Arc<Self>) -> ExtraRoutes {
        let router = Router::new()
            .route(route::COMPLETIONS, post(completions))
            .route(route::CHAT_COMPLETIONS, post(chat_completions))
            .route(route::MODELS, get(models))
            .with_state(Arc::clone(self));
        ExtraRoutes {
            router,
            paths: route::ALL,
        }
    }

    /// Starts the health checks and the workers file's watch on the current runtime; both
    /// end when the service shuts down.
    pub fn start_background(self: &Arc<Self>) -> Result<(), String> {
        if let Some(path) = &self.config.workers_file {
            let mut file = FileWorkers::default();
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--workers-file {}: {e}", path.display()))?;
            file.apply(
                &self.state,
                &text,
                &self.config.default_model,
                self.config.block_size,
                self.config.max_num_batched_tokens,
            )
            .map_err(|e| format!("--workers-file {}: {e}", path.display()))?;
            tokio::spawn(Arc::clone(self).watch_workers_file(file));
        }
        if let Some(every) = self.config.health_check_every {
            tokio::spawn(Arc::clone(self).run_health_checks(every));
        }
        Ok(())
    }

    /// A failure of a worker: counted, and held against its breaker.
    pub fn worker_failed(&self, worker_id: u64, kind: &'static str) {
        self.metrics.failure(kind);
        if self.breakers.failed(worker_id, std::time::Instant::now()) {
            self.metrics.breakers_opened.inc();
            tracing::warn!(
                worker_id,
                open_for_secs = self.config.breaker.open_for.as_secs_f64(),
                "circuit breaker opened"
            );
        }
    }

    // -----------------------------------------------------------------------------------------
    // Tokenization

    /// What the request is routed by: its token ids, or an estimate of its length.
    async fn routing_prompt(
        &self,
        kind: Kind,
        request: &mut OpenAiRequest,
        model: &str,
    ) -> Result<RoutingPrompt, GatewayError> {
        let local = self.tokenizers.local(model);
        match kind {
            Kind::Completions => {
                // Taken, not copied: nothing after routing reads the prompt (the body is
                // forwarded as it came).
                let prompt = request
                    .prompt
                    .take()
                    .ok_or_else(|| GatewayError::invalid_param("prompt is required", "prompt"))?
                    .single()?;
                let text = match prompt {
                    Prompt::Tokens(ids) => return Ok(RoutingPrompt::Tokens(ids)),
                    Prompt::Text(text) => text,
                };
                let add_special_tokens = request.add_special_tokens.unwrap_or(true);
                if let Some(tokenizer) = local {
                    return tokenizer
                        .encode(&text, add_special_tokens)
                        .map(RoutingPrompt::Tokens);
                }
                let body = json!({"model": model, "prompt": text,
                                  "add_special_tokens": add_special_tokens});
                Ok(self.tokenize_remotely(model, body, text.len()).await)
            }
            Kind::Chat => {
                let messages = request.messages.as_deref().ok_or_else(|| {
                    GatewayError::invalid_param("messages is required", "messages")
                })?;
                if messages.is_empty() {
                    return Err(GatewayError::invalid_param(
                        "messages must not be empty",
                        "messages",
                    ));
                }
                let continue_final_message = request.continue_final_message.unwrap_or(false);
                let inputs = ChatInputs {
                    messages,
                    add_generation_prompt: request
                        .add_generation_prompt
                        .unwrap_or(!continue_final_message),
                    continue_final_message,
                    tools: request.tools.as_ref(),
                    documents: request.documents.as_ref(),
                    extra: request.chat_template_kwargs.as_ref(),
                };
                if let Some(rendered) = local.and_then(|t| t.render_chat(&inputs)) {
                    let text = rendered?;
                    let tokenizer = local.ok_or_else(|| {
                        GatewayError::new(StatusCode::INTERNAL_SERVER_ERROR, "tokenizer vanished")
                    })?;
                    return tokenizer.encode(&text, false).map(RoutingPrompt::Tokens);
                }
                let size: usize = messages.iter().map(|m| m.to_string().len()).sum();
                let body = json!({
                    "model": model,
                    "messages": messages,
                    "add_generation_prompt": inputs.add_generation_prompt,
                    "continue_final_message": continue_final_message,
                    "tools": request.tools,
                    "chat_template_kwargs": request.chat_template_kwargs,
                    "add_special_tokens": false,
                });
                Ok(self.tokenize_remotely(model, body, size).await)
            }
        }
    }

    /// A worker's `POST /tokenize`, with `--tokenize remote`; otherwise, or when it fails,
    /// the estimate. Nothing of the prompt is kept.
    async fn tokenize_remotely(&self, model: &str, body: Value, size: usize) -> RoutingPrompt {
        if self.tokenizers.mode != TokenizeMode::Remote {
            self.metrics.untokenized_prompts.inc();
            return RoutingPrompt::estimate(size);
        }
        let refused = self.breakers.refused(std::time::Instant::now());
        let endpoints: Vec<String> = self
            .state
            .selector
            .read()
            .list_workers(Some(model), None)
            .into_iter()
            .filter(|r| !refused.contains(&r.spec.worker_id))
            .filter_map(|r| r.spec.endpoint)
            .collect();
        if endpoints.is_empty() {
            self.metrics.untokenized_prompts.inc();
            return RoutingPrompt::estimate(size);
        }
        let pick = self.next_tokenizer_worker.fetch_add(1, Ordering::Relaxed) % endpoints.len();
        let endpoint = &endpoints[pick];
        match self.post_tokenize(endpoint, &body).await {
            Ok(tokens) if !tokens.is_empty() => RoutingPrompt::Tokens(tokens),
            Ok(_) => RoutingPrompt::estimate(size),
            Err(e) => {
                tracing::warn!(%endpoint, error = %e, "remote tokenization failed; routing by length");
                self.metrics.untokenized_prompts.inc();
                RoutingPrompt::estimate(size)
            }
        }
    }

    async fn post_tokenize(&self, endpoint: &str, body: &Value) -> Result<Vec<u32>, String> {
        #[derive(serde::Deserialize)]
        struct Tokenized {
            tokens: Vec<u32>,
        }
        let uri: Uri = format!("{endpoint}/tokenize")
            .parse()
            .map_err(|e| format!("{e}"))?;
        let mut request = hyper::Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(auth) = &self.config.upstream_authorization {
            request = request.header(header::AUTHORIZATION, auth);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let limit = self.config.first_token_timeout.min(Duration::from_secs(10));
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| e.to_string())?;
            let status = response.status();
            let bytes = response
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            if !status.is_success() {
                return Err(format!("status {status}"));
            }
            serde_json::from_slice::<Tokenized>(&bytes)
                .map(|t| t.tokens)
                .map_err(|e| e.to_string())
        };
        tokio::time::timeout(limit, exchange)
            .await
            .map_err(|_| format!("no answer within {} ms", limit.as_millis()))?
    }

    // -----------------------------------------------------------------------------------------
    // Booking and dispatch

    /// Books the best worker for the prompt, leaving out `excluded` and the workers whose
    /// breaker refuses.
    async fn book(
        &self,
        model: &str,
        prompt: &RoutingPrompt,
        request: &OpenAiRequest,
        excluded: &[u64],
        tenant: Option<&str>,
    ) -> Result<(Booking, String), GatewayError> {
        let mut refused = self.breakers.refused(std::time::Instant::now());
        refused.extend_from_slice(excluded);
        let allowed_worker_ids = (!refused.is_empty()).then(|| {
            self.state
                .selector
                .read()
                .list_workers(Some(model), None)
                .iter()
                .map(|r| r.spec.worker_id)
                .filter(|id| !refused.contains(id))
                .collect::<Vec<u64>>()
        });
        // Round robin: the next schedulable worker of the model, pinned (pinning skips scoring;
        // the booking is made and tracked as any other).
        let pinned_worker = match self.config.policy {
            GatewayPolicy::Kvroute => None,
            GatewayPolicy::RoundRobin => {
                let workers: Vec<u64> = self
                    .state
                    .selector
                    .read()
                    .list_workers(Some(model), None)
                    .iter()
                    .filter(|r| r.lifecycle == kvroute_core::selector::Lifecycle::Schedulable)
                    .map(|r| r.spec.worker_id)
                    .filter(|id| !refused.contains(id))
                    .collect();
                let turn = self.next_worker.fetch_add(1, Ordering::Relaxed);
                workers
                    .get(turn % workers.len().max(1))
                    .map(|&worker_id| PinnedBody {
                        worker_id,
                        dp_rank: None,
                    })
            }
        };
        let mut body = SelectBody {
            model_name: model.to_string(),
            expected_output_tokens: request.expected_output_tokens(),
            allowed_worker_ids,
            pinned_worker,
            cache_salt: request.cache_salt.clone(),
            ..SelectBody::default()
        };
        match prompt {
            RoutingPrompt::Tokens(ids) => body.token_ids = Some(ids.clone()),
            RoutingPrompt::Estimate { isl_tokens } => {
                body.block_hashes = Some(Vec::<WireHash>::new());
                body.sequence_hashes = Some(Vec::new());
                body.isl_tokens = Some(*isl_tokens);
            }
        }
        // With `--queue-threshold` this may wait in the admission queue; a client that leaves
        // meanwhile drops this future, which takes the request out of the queue.
        let selection = api::admit(&self.state, QueuedRoute::SelectAndReserve, body, tenant)
            .answer()
            .await?;
        let reservation_id = selection["reservation_id"].as_str().unwrap_or_default();
        let worker_id = selection["worker_id"].as_u64().unwrap_or_default();
        let block_size = selection["block_size"].as_u64().unwrap_or(1);
        let booking = Booking::new(
            Arc::clone(&self.state),
            reservation_id.to_string(),
            worker_id,
            u32::try_from(block_size).unwrap_or(u32::MAX),
            self.metrics.bookings_open.clone(),
        );
        let Some(endpoint) = selection["endpoint"].as_str().filter(|e| !e.is_empty()) else {
            return Err(GatewayError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("worker {worker_id} has no endpoint URL to send requests to"),
            ));
        };
        Ok((booking, endpoint.to_string()))
    }

    fn upstream_request(
        &self,
        endpoint: &str,
        kind: Kind,
        body: Bytes,
        client_authorization: Option<&HeaderValue>,
    ) -> Result<hyper::Request<Full<Bytes>>, GatewayError> {
        let uri: Uri = format!("{endpoint}{}", kind.path()).parse().map_err(|e| {
            GatewayError::new(
                StatusCode::BAD_GATEWAY,
                format!("worker endpoint `{endpoint}` is not a URL: {e}"),
            )
        })?;
        let mut request = hyper::Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(auth) = &self.config.upstream_authorization {
            request = request.header(header::AUTHORIZATION, auth);
        } else if let Some(auth) = client_authorization {
            request = request.header(header::AUTHORIZATION, auth);
        }
        request
            .body(Full::new(body))
            .map_err(|e| GatewayError::new(StatusCode::BAD_GATEWAY, e.to_string()))
    }

    /// The whole of a completion request.
    async fn handle(
        self: Arc<Self>,
        kind: Kind,
        request: Request,
    ) -> Result<Response, GatewayError> {
        // The admission queue's tenant, as on the selection API.
        let tenant = request
            .headers()
            .get("x-tenant-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let client_authorization = if self.config.forward_client_authorization {
            request.headers().get(header::AUTHORIZATION).cloned()
        } else {
            None
        };
        // The service's body limit and read timeout (`--body-read-timeout-ms`).
        let body = kvroute_service::http::json::body_bytes(request, &self.state)
            .await
            .map_err(GatewayError::from)?;
        let mut parsed = OpenAiRequest::parse(&body)?;
        let model = parsed
            .model
            .clone()
            .unwrap_or_else(|| self.config.default_model.clone());
        let prompt = match self.config.policy {
            GatewayPolicy::Kvroute => self.routing_prompt(kind, &mut parsed, &model).await?,
            // Round robin reads no cache: the prompt's length is only booked as load.
            GatewayPolicy::RoundRobin => RoutingPrompt::estimate(body.len()),
        };
        let stream = parsed.is_stream();
        let mut excluded = Vec::new();
        for _attempt in 0..=self.config.connect_retries {
            self.state.applier.passed().await;
            let (booking, endpoint) = self
                .book(&model, &prompt, &parsed, &excluded, tenant.as_deref())
                .await?;
            let worker_id = booking.worker_id;
            let upstream = self.upstream_request(
                &endpoint,
                kind,
                body.clone(),
                client_authorization.as_ref(),
            )?;
            let dispatched_at = Instant::now();
            self.breakers
                .dispatched(worker_id, std::time::Instant::now());
            let wait = if stream {
                self.config
                    .first_token_timeout
                    .min(self.config.request_timeout)
            } else {
                self.config.request_timeout
            };
            // Dropping `booking` on any return below frees it.
            match tokio::time::timeout(wait, self.client.request(upstream)).await {
                Ok(Ok(response)) => {
                    return Ok(self.respond(response, booking, stream, dispatched_at));
                }
                Ok(Err(e)) if e.is_connect() => {
                    tracing::warn!(worker_id, %endpoint, error = %e, "cannot connect; trying the next-best worker");
                    self.worker_failed(worker_id, "connect");
                    self.metrics.retries.inc();
                    excluded.push(worker_id);
                }
                Ok(Err(e)) => {
                    self.worker_failed(worker_id, "broken_stream");
                    return Err(GatewayError::new(
                        StatusCode::BAD_GATEWAY,
                        format!("worker {worker_id} failed: {}", error_chain(&e)),
                    ));
                }
                Err(_) => {
                    let kind = if stream {
                        "first_token_timeout"
                    } else {
                        "timeout"
                    };
                    self.worker_failed(worker_id, kind);
                    return Err(GatewayError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        format!(
                            "worker {worker_id} did not answer within {} ms",
                            wait.as_millis()
                        ),
                    ));
                }
            }
        }
        // The retries are spent (the last one's worker was excluded only for this request).
        Err(GatewayError {
            retry_after_secs: Some(1),
            ..GatewayError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no worker could be reached ({} tried)", excluded.len()),
            )
        })
    }

    /// The engine answered: its status and body go to the client, the body driving the booking.
    fn respond(
        self: &Arc<Self>,
        response: hyper::Response<hyper::body::Incoming>,
        mut booking: Booking,
        stream: bool,
        dispatched_at: Instant,
    ) -> Response {
        let status = response.status();
        if status.is_server_error() {
            self.worker_failed(booking.worker_id, "status_5xx");
        } else {
            self.breakers.succeeded(booking.worker_id);
        }
        let is_event_stream = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let streaming = stream && status.is_success() && is_event_stream;
        if !streaming && status.is_success() {
            // A whole document: the engine is done with the prompt (and the output).
            booking.prefill_complete();
        }
        let worker_id = booking.worker_id;
        let (parts, incoming) = response.into_parts();
        let body = ProxyBody::new(
            incoming,
            Arc::clone(self),
            booking,
            streaming,
            dispatched_at,
        );
        let mut out = Response::new(Body::new(body));
        *out.status_mut() = parts.status;
        copy_headers(&parts.headers, out.headers_mut());
        if let Ok(value) = HeaderValue::from_str(&worker_id.to_string()) {
            out.headers_mut().insert("x-kvroute-worker-id", value);
        }
        out
    }

    // -----------------------------------------------------------------------------------------
    // Background tasks

    async fn watch_workers_file(self: Arc<Self>, mut file: FileWorkers) {
        let Some(path) = self.config.workers_file.clone() else {
            return;
        };
        let mut tick = tokio::time::interval(self.config.workers_file_poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !self.state.is_shutting_down() {
            tick.tick().await;
            let text = match tokio::fs::read_to_string(&path).await {
                Ok(text) => text,
                Err(e) => {
                    tracing::debug!(path = %path.display(), error = %e, "workers file unreadable");
                    continue;
                }
            };
            match file.apply(
                &self.state,
                &text,
                &self.config.default_model,
                self.config.block_size,
                self.config.max_num_batched_tokens,
            ) {
                Ok(Some(outcome)) => {
                    for id in &outcome.deleted {
                        self.breakers.forget(*id);
                    }
                    tracing::info!(path = %path.display(), upserted = outcome.upserted,
                        deleted = outcome.deleted.len(), "workers file reloaded");
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e,
                        "workers file not reloaded: keeping the workers as they were");
                }
            }
        }
    }

    async fn run_health_checks(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !self.state.is_shutting_down() {
            tick.tick().await;
            let workers: Vec<(u64, String)> = self
                .state
                .selector
                .read()
                .list_workers(None, None)
                .into_iter()
                .filter_map(|r| Some((r.spec.worker_id, r.spec.endpoint?)))
                .collect();
            let mut checks = tokio::task::JoinSet::new();
            for (worker_id, endpoint) in workers {
                let gateway = Arc::clone(&self);
                checks.spawn(async move {
                    let healthy = gateway.check_health(&endpoint, every).await;
                    (worker_id, healthy)
                });
            }
            while let Some(Ok((worker_id, healthy))) = checks.join_next().await {
                if healthy {
                    self.breakers
                        .health_ok(worker_id, std::time::Instant::now());
                } else {
                    self.worker_failed(worker_id, "health");
                }
            }
        }
    }

    async fn check_health(&self, endpoint: &str, every: Duration) -> bool {
        let Ok(uri) = format!("{endpoint}/health").parse::<Uri>() else {
            return false;
        };
        let Ok(request) = hyper::Request::builder()
            .method(Method::GET)
            .uri(uri)
            .body(Full::new(Bytes::new()))
        else {
            return false;
        };
        let limit = every.min(Duration::from_secs(5));
        let check = async {
            let response = self.client.request(request).await.ok()?;
            let ok = response.status().is_success();
            // Read the (short) body so the connection goes back to the pool.
            response.into_body().collect().await.ok()?;
            Some(ok)
        };
        matches!(tokio::time::timeout(limit, check).await, Ok(Some(true)))
    }
}

/// The headers of the engine's answer the client gets (no hop-by-hop or framing headers).
fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for name in [
        header::CONTENT_TYPE,
        header::RETRY_AFTER,
        header::CACHE_CONTROL,
    ] {
        if let Some(value) = from.get(&name) {
            to.insert(name, value.clone());
        }
    }
    if let Some(value) = from.get("x-request-id") {
        to.insert("x-request-id", value.clone());
    }
}

/// An error with its causes, one after another.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    let mut depth = 0;
    while let Some(cause) = source
        && depth < 8
    {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
        depth += 1;
    }
    text
}

async fn completions(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    gateway
        .handle(Kind::Completions, request)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    gateway
        .handle(Kind::Chat, request)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `GET /v1/models`: the models of the catalog.
async fn models(State(gateway): State<Arc<Gateway>>) -> Response {
    let mut names: Vec<String> = gateway
        .state
        .selector
        .read()
        .list_workers(None, None)
        .into_iter()
        .map(|r| r.spec.model_name)
        .collect();
    names.dedup();
    let data: Vec<Value> = names
        .iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "kvroute"}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}
