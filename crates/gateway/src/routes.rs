//! The gateway's routes: `POST /v1/completions`, `POST /v1/chat/completions`,
//! `POST /v1/responses`, `GET /v1/models`, served beside the selection service's own routes.
//!
//! A completion: read the body (the service's limit and read timeout), parse and check the few
//! fields the gateway needs (`crate::openai`: a bad one is a 400 naming it), tokenize the prompt
//! once when the policy reads it (`crate::tokenize`; a response's input as chat messages,
//! `crate::responses`), then book a worker and forward (`crate::upstream`).

use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::openai::{Kind, OpenAiRequest, route};
use crate::pd;
use crate::responses;
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
            .route(route::RESPONSES, post(responses))
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
    parsed.validate(kind)?;
    if kind == Kind::Responses {
        // Routed as the chat the engine will render from it.
        let input = parsed.input.take().unwrap_or_default();
        parsed.messages = Some(responses::chat_messages(
            parsed.instructions.as_deref(),
            &input,
        ));
        parsed.tools = parsed.tools.as_ref().map(responses::chat_tools);
    }
    let model = parsed
        .model
        .clone()
        .unwrap_or_else(|| gateway.config.default_model.clone());
    // A response whose input holds no message (only references to stored items, say) has
    // nothing to render: it is routed by its length.
    let has_prompt =
        kind != Kind::Responses || parsed.messages.as_ref().is_some_and(|m| !m.is_empty());
    let prompt = if gateway.policy.reads_prompt() && has_prompt {
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

async fn responses(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    handle(&gateway, Kind::Responses, request)
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
