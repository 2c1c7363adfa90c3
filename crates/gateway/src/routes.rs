//! The gateway's routes: `POST /v1/completions`, `POST /v1/chat/completions`,
//! `GET /v1/models`, served beside the selection service's own routes.
//!
//! A completion: read the body (the service's limit and read timeout), parse the few fields
//! the gateway needs (`crate::openai`), tokenize the prompt once when the policy reads it
//! (`crate::tokenize`), then book a worker and forward (`crate::upstream`).

use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::openai::{Kind, OpenAiRequest, route};
use crate::pd;
use crate::tokenize::RoutingPrompt;
use crate::upstream::{self, Outbound};
use axum::Router;
use axum::extract::{Request, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvroute_service::http::ExtraRoutes;
use serde_json::{Value, json};
use std::sync::Arc;

impl Gateway {
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
}

/// The whole of a completion request.
async fn handle(gateway: &Gateway, kind: Kind, request: Request) -> Result<Response, GatewayError> {
    // The admission queue's tenant, as on the selection API.
    let tenant = request
        .headers()
        .get("x-tenant-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    // The session: the first configured header present (the body's `session_id` wins, below).
    let session_header = gateway
        .config
        .session_headers
        .iter()
        .find_map(|name| request.headers().get(name)?.to_str().ok())
        .filter(|v| !v.is_empty())
        .map(str::to_string);
    let client_authorization = if gateway.config.forward_client_authorization {
        request.headers().get(header::AUTHORIZATION).cloned()
    } else {
        None
    };
    let request_id = request.headers().get("x-request-id").cloned();
    let body = gateway.link.read_body(request).await?;
    let mut parsed = OpenAiRequest::parse(&body)?;
    let model = parsed
        .model
        .clone()
        .unwrap_or_else(|| gateway.config.default_model.clone());
    let prompt = if gateway.policy.reads_prompt() {
        let remote_endpoints = || {
            let refused = gateway.health.refused();
            gateway
                .link
                .endpoints(Some(&model))
                .into_iter()
                .filter(|(id, _)| !refused.contains(id))
                .map(|(_, endpoint)| endpoint)
                .collect()
        };
        gateway
            .tokenizers
            .routing_prompt(kind, &mut parsed, &model, remote_endpoints)
            .await?
    } else {
        RoutingPrompt::estimate(body.len())
    };
    let out = Outbound {
        kind,
        body,
        parsed: &parsed,
        model: &model,
        prompt: &prompt,
        tenant: tenant.as_deref(),
        session: parsed.session_id.as_deref().or(session_header.as_deref()),
        client_authorization,
        request_id,
    };
    match gateway.config.pd_protocol {
        Some(protocol) => pd::dispatch(gateway, out, protocol).await,
        None => upstream::dispatch(gateway, out).await,
    }
}

async fn completions(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    handle(&gateway, Kind::Completions, request)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    handle(&gateway, Kind::Chat, request)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `GET /v1/models`: the models of the catalog.
async fn models(State(gateway): State<Arc<Gateway>>) -> Response {
    let data: Vec<Value> = gateway
        .link
        .model_names()
        .iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "kvroute"}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}
