//! The parts of an OpenAI request the gateway reads, and its errors in OpenAI's shape.
//!
//! The request body is forwarded to the engine as received; the gateway only reads `model`
//! (the partition), `stream`, the prompt (`prompt` or `messages`) and the token limits. A
//! prompt of token ids is kept as ids, with no copy through a generic JSON value.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde_json::{Value, json};
use std::fmt;

/// The fields of `POST /v1/completions` and `POST /v1/chat/completions` that matter here.
#[derive(Debug, Deserialize)]
pub struct OpenAiRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub prompt: Option<PromptField>,
    #[serde(default)]
    pub messages: Option<Vec<Value>>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    // Chat-template inputs, as vLLM reads them.
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    #[serde(default)]
    pub tools: Option<Value>,
    #[serde(default)]
    pub documents: Option<Value>,
    #[serde(default)]
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    // Completions: whether the tokenizer adds its special tokens (vLLM's default: yes).
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub cache_salt: Option<String>,
}

impl OpenAiRequest {
    pub fn parse(body: &[u8]) -> Result<Self, GatewayError> {
        let request: Self = serde_json::from_slice(body)
            .map_err(|e| GatewayError::invalid(format!("invalid request body: {e}")))?;
        if let Some(model) = &request.model
            && (model.is_empty() || model.len() > 1024)
        {
            return Err(GatewayError::invalid_param(
                "model must be between 1 and 1024 bytes",
                "model",
            ));
        }
        Ok(request)
    }

    pub fn is_stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn expected_output_tokens(&self) -> Option<u64> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

/// `prompt`: text, token ids, or a batch of one of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

impl PromptField {
    /// The one prompt of the request; a batch of several is refused (each prompt of a batch
    /// could belong on another worker).
    pub fn single(self) -> Result<Prompt, GatewayError> {
        let one = |n: usize| -> Result<(), GatewayError> {
            if n == 1 {
                Ok(())
            } else {
                Err(GatewayError::invalid_param(
                    format!(
                        "the gateway routes one prompt per request (got a batch of {n}); send each prompt as its own request"
                    ),
                    "prompt",
                ))
            }
        };
        let prompt = match self {
            PromptField::Text(text) => Prompt::Text(text),
            PromptField::Tokens(ids) => Prompt::Tokens(ids),
            PromptField::Texts(mut texts) => {
                one(texts.len())?;
                Prompt::Text(texts.pop().unwrap_or_default())
            }
            PromptField::TokenLists(mut lists) => {
                one(lists.len())?;
                Prompt::Tokens(lists.pop().unwrap_or_default())
            }
        };
        if let Prompt::Tokens(ids) = &prompt
            && ids.is_empty()
        {
            return Err(GatewayError::invalid_param(
                "prompt must not be empty",
                "prompt",
            ));
        }
        Ok(prompt)
    }
}

/// One prompt: text to tokenize, or token ids that pass straight through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// An element of a `prompt` array.
enum PromptItem {
    Id(u32),
    Text(String),
    Ids(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a token id, a string or an array of token ids")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<PromptItem, E> {
                u32::try_from(v)
                    .map(PromptItem::Id)
                    .map_err(|_| E::custom(format!("token id {v} is above 4294967295")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<PromptItem, E> {
                Err(E::custom(format!("token id {v} is negative")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v.to_string()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptItem::Ids(ids))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for PromptField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptField;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, an array of strings, token ids or arrays of token ids")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptField, E> {
                Ok(PromptField::Text(v.to_string()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<PromptField, E> {
                Ok(PromptField::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptField, A::Error> {
                let mut field = match seq.next_element::<PromptItem>()? {
                    None => return Ok(PromptField::Tokens(Vec::new())),
                    Some(PromptItem::Id(id)) => {
                        let mut ids =
                            Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20) + 1);
                        ids.push(id);
                        PromptField::Tokens(ids)
                    }
                    Some(PromptItem::Text(t)) => PromptField::Texts(vec![t]),
                    Some(PromptItem::Ids(ids)) => PromptField::TokenLists(vec![ids]),
                };
                let mixed = || de::Error::custom("prompt arrays must not mix kinds");
                match &mut field {
                    PromptField::Tokens(ids) => {
                        while let Some(id) = seq.next_element::<u32>()? {
                            ids.push(id);
                        }
                    }
                    PromptField::Texts(texts) => {
                        while let Some(item) = seq.next_element::<PromptItem>()? {
                            let PromptItem::Text(t) = item else {
                                return Err(mixed());
                            };
                            texts.push(t);
                        }
                    }
                    PromptField::TokenLists(lists) => {
                        while let Some(item) = seq.next_element::<PromptItem>()? {
                            let PromptItem::Ids(ids) = item else {
                                return Err(mixed());
                            };
                            lists.push(ids);
                        }
                    }
                    PromptField::Text(_) => {}
                }
                Ok(field)
            }
        }
        d.deserialize_any(V)
    }
}

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

    fn prompt(body: &str) -> Result<Prompt, GatewayError> {
        OpenAiRequest::parse(body.as_bytes())?
            .prompt
            .ok_or_else(|| GatewayError::invalid("none"))?
            .single()
    }

    #[test]
    fn prompts_of_every_shape_parse() {
        assert_eq!(prompt(r#"{"prompt": "hi"}"#), Ok(Prompt::Text("hi".into())));
        assert_eq!(
            prompt(r#"{"prompt": ["hi"]}"#),
            Ok(Prompt::Text("hi".into()))
        );
        assert_eq!(
            prompt(r#"{"prompt": [1, 2, 3]}"#),
            Ok(Prompt::Tokens(vec![1, 2, 3]))
        );
        assert_eq!(
            prompt(r#"{"prompt": [[4, 5]]}"#),
            Ok(Prompt::Tokens(vec![4, 5]))
        );
        let batch = prompt(r#"{"prompt": ["a", "b"]}"#).unwrap_err();
        assert_eq!(batch.status, StatusCode::BAD_REQUEST);
        assert!(batch.message.contains("batch of 2"), "{}", batch.message);
        assert!(prompt(r#"{"prompt": []}"#).is_err());
        for bad in [
            r#"{"prompt": [1, "a"]}"#,
            r#"{"prompt": [-1]}"#,
            r#"{"prompt": [4294967296]}"#,
            r#"{"prompt": 5}"#,
            r#"{"prompt": "a""#,
            r#"{"model": ""}"#,
        ] {
            let e = OpenAiRequest::parse(bad.as_bytes()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        }
    }

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
