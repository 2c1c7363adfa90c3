//! The gateway's one error type: a failure answered to the client in OpenAI's shape, or, once
//! a stream has begun, as its last server-sent event.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// A failure answered to the client in OpenAI's shape:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<&'static str>,
    /// `Retry-After`, in seconds, for a 429 or 503.
    pub retry_after_secs: Option<u64>,
}

impl GatewayError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            retry_after_secs: None,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn invalid_param(message: impl Into<String>, param: &'static str) -> Self {
        Self {
            param: Some(param),
            ..Self::invalid(message)
        }
    }

    /// A model no worker serves: 404 naming it, as vLLM and OpenAI answer (`param` `model`).
    pub fn unknown_model(model: &str) -> Self {
        Self {
            param: Some("model"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                format!("The model `{model}` does not exist."),
            )
        }
    }

    /// OpenAI's `type` for the status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 404 | 409 | 413 | 415 | 422 => "invalid_request_error",
            401 | 403 => "authentication_error",
            429 => "rate_limit_exceeded",
            503 => "service_unavailable",
            504 => "timeout",
            _ => "upstream_error",
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }

    /// The error as one server-sent event, for a stream that has already begun.
    pub fn sse_event(&self) -> bytes::Bytes {
        let mut out = b"data: ".to_vec();
        // Serializing a `Value` into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut out, &self.body());
        out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        out.into()
    }
}

impl From<kvroute_service::error::ApiError> for GatewayError {
    /// The selection service's answer: a 429 (every worker busy, or an admission queue that is
    /// full) and a 503 (no worker) keep their status and get a `Retry-After`.
    fn from(e: kvroute_service::error::ApiError) -> Self {
        let retry_after_secs = match e.status.as_u16() {
            429 | 503 => Some(e.retry_after.unwrap_or(1)),
            _ => None,
        };
        Self {
            retry_after_secs,
            ..Self::new(e.status, e.message)
        }
    }
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after_secs
            && let Ok(value) = HeaderValue::from_str(&secs.to_string())
        {
            response.headers_mut().insert(header::RETRY_AFTER, value);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_take_openais_shape_and_admission_answers_keep_retry_after() {
        let e = GatewayError::from(kvroute_service::error::ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "all eligible workers are overloaded",
        ));
        let response = e.clone().into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "all eligible workers are overloaded",
                             "type": "rate_limit_exceeded", "param": null, "code": 429}})
        );
        let event = GatewayError::new(StatusCode::BAD_GATEWAY, "gone").sse_event();
        assert!(event.starts_with(b"data: {\"error\""));
        assert!(event.ends_with(b"data: [DONE]\n\n"));
    }
}
