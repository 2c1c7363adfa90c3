//! The JSON the mock engine reads and writes, in vLLM's OpenAI-compatible shapes.
//!
//! Requests: unknown fields are ignored (vLLM logs and ignores them), so sampling parameters
//! are accepted and have no effect: every answer is `max_tokens` long (`finish_reason:
//! "length"`), as with `ignore_eos`. Responses: the fields vLLM writes, in its order; stream
//! chunks leave out what vLLM leaves unset (`usage` except in the final usage chunk).
//!
//! Errors carry OpenAI's nested `error` object (what vLLM has sent since 0.10.2) and the same
//! fields flat with `"object": "error"` (what earlier vLLM sent), so a client of either parses
//! them; the messages are produced here, in [`ApiError`]'s constructors.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub(crate) use super::disagg::PdFieldsIn;

/// An error answer: status, OpenAI error type, message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
        }
    }

    /// A body that is not the JSON the route takes.
    pub fn invalid_json(error: &serde_json::Error) -> Self {
        Self::bad_request(format!("Invalid JSON body: {error}"))
    }

    /// vLLM's answer for a model it does not serve.
    pub fn unknown_model(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!("The model `{model}` does not exist."),
        }
    }

    /// vLLM's answer for a prompt and completion longer than the model's context.
    pub fn too_long(max_model_len: u32, prompt_tokens: usize, max_tokens: u32) -> Self {
        Self::bad_request(format!(
            "This model's maximum context length is {max_model_len} tokens. However, you \
             requested {} tokens ({prompt_tokens} in the messages, {max_tokens} in the \
             completion). Please reduce the length of the messages or completion.",
            prompt_tokens as u64 + u64::from(max_tokens)
        ))
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "InternalServerError",
            message: message.into(),
        }
    }

    /// The JSON body (also a stream's error chunk).
    pub fn body(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Info<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            param: Option<()>,
            code: u16,
        }
        #[derive(Serialize)]
        struct Body<'a> {
            error: Info<'a>,
            object: &'static str,
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            param: Option<()>,
            code: u16,
        }
        let code = self.status.as_u16();
        let body = Body {
            error: Info {
                message: &self.message,
                kind: self.kind,
                param: None,
                code,
            },
            object: "error",
            message: &self.message,
            kind: self.kind,
            param: None,
            code,
        };
        serde_json::to_vec(&body).unwrap_or_default()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = json_response(self.body());
        *response.status_mut() = self.status;
        response
    }
}

/// A 200 with a JSON body.
pub(crate) fn json_response(body: Vec<u8>) -> Response {
    let mut response = body.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Parses a route's body.
pub(crate) fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid_json(&e))
}

// ---------------------------------------------------------------------------------------------
// Requests

#[derive(Debug, Deserialize, Default)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// A string, token ids, or a list of one of either.
    #[serde(default)]
    pub prompt: Value,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(flatten)]
    pub pd: PdFieldsIn,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<MessageIn>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(flatten)]
    pub pd: PdFieldsIn,
}

/// A chat message as sent: `content` a string, a list of parts, or absent.
#[derive(Debug, Deserialize)]
pub(crate) struct MessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Value,
}

/// `POST /tokenize`: a prompt, or chat messages.
#[derive(Debug, Deserialize)]
pub(crate) struct TokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<MessageIn>>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub return_token_strs: Option<bool>,
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub(crate) struct DetokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// The prompt of a completion request: text or token ids (one prompt; vLLM's batches of
/// several are refused).
pub(crate) enum PromptIn {
    Text(String),
    Tokens(Vec<u32>),
}

impl PromptIn {
    pub fn from_value(value: Value) -> Result<Self, ApiError> {
        let empty = || {
            ApiError::bad_request("Either prompt or prompt_embeds must be provided and non-empty.")
        };
        match value {
            Value::String(text) if text.is_empty() => Err(empty()),
            Value::String(text) => Ok(PromptIn::Text(text)),
            Value::Array(items) if items.is_empty() => Err(empty()),
            Value::Array(items) if items.iter().all(Value::is_number) => {
                token_ids(&items).map(PromptIn::Tokens)
            }
            Value::Array(mut items) if items.len() == 1 => match items.pop() {
                Some(Value::String(text)) if !text.is_empty() => Ok(PromptIn::Text(text)),
                Some(Value::Array(ids)) if !ids.is_empty() => token_ids(&ids).map(PromptIn::Tokens),
                _ => Err(ApiError::bad_request(
                    "prompt must be a string, a list of token ids, or a list of one of either",
                )),
            },
            Value::Array(_) => Err(ApiError::bad_request(
                "the mock engine takes one prompt per request",
            )),
            Value::Null => Err(empty()),
            _ => Err(ApiError::bad_request(
                "prompt must be a string, a list of token ids, or a list of one of either",
            )),
        }
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| ApiError::bad_request(format!("token id {v} is not a valid id")))
        })
        .collect()
}

/// A message's content as text: a string, the text parts of a list joined by newlines, or
/// nothing.
pub(crate) fn content_text(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(text) => Ok(text.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(text)) => texts.push(text),
                    _ => {
                        return Err(ApiError::bad_request(
                            "the mock engine takes text content parts only",
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(ApiError::bad_request(
            "message content must be a string or a list of content parts",
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Responses

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub(crate) struct PromptTokensDetails {
    pub cached_tokens: u64,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub(crate) struct Usage {
    pub prompt_tokens: u64,
    pub total_tokens: u64,
    pub completion_tokens: u64,
    /// `null` unless the engine reports it (vLLM: `--enable-prompt-tokens-details`).
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    /// The mock's own time to first token, from its handler's start (not vLLM's: a benchmark
    /// subtracts it from the client's to see what sits between them; OpenAI clients ignore it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvroute_engine_ttft_us: Option<u64>,
}

impl Usage {
    /// `cached_tokens`: `None` when the engine does not report it.
    pub fn new(prompt_tokens: u64, completion_tokens: u64, cached_tokens: Option<u64>) -> Self {
        Self {
            prompt_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            completion_tokens,
            prompt_tokens_details: cached_tokens
                .map(|cached_tokens| PromptTokensDetails { cached_tokens }),
            kvroute_engine_ttft_us: None,
        }
    }
}

/// Every completion answer and chunk: `choices` holds the route's choice type.
#[derive(Debug, Serialize)]
pub(crate) struct Envelope<'a, C: Serialize> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: C,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// A vLLM prefill leg's answer (P/D): what the decode leg carries.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<&'a Value>,
}

/// A `text_completion` choice (whole or a chunk's).
#[derive(Debug, Serialize)]
pub(crate) struct TextChoice<'a> {
    pub index: u32,
    pub text: &'a str,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<()>,
}

/// A `chat.completion` choice.
#[derive(Debug, Serialize)]
pub(crate) struct ChatChoice<'a> {
    pub index: u32,
    pub message: ChatMessageOut<'a>,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<()>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ChatMessageOut<'a> {
    pub role: &'static str,
    pub content: &'a str,
    pub tool_calls: [(); 0],
}

/// A `chat.completion.chunk` choice.
#[derive(Debug, Serialize)]
pub(crate) struct ChatChunkChoice<'a> {
    pub index: u32,
    pub delta: Delta<'a>,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    pub content: &'a str,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub(crate) struct ModelList<'a> {
    pub object: &'static str,
    pub data: [ModelCard<'a>; 1],
}

#[derive(Debug, Serialize)]
pub(crate) struct ModelCard<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: &'a str,
    pub parent: Option<()>,
    pub max_model_len: u32,
    pub permission: [ModelPermission<'a>; 1],
}

#[derive(Debug, Serialize)]
pub(crate) struct ModelPermission<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub allow_create_engine: bool,
    pub allow_sampling: bool,
    pub allow_logprobs: bool,
    pub allow_search_indices: bool,
    pub allow_view: bool,
    pub allow_fine_tuning: bool,
    pub organization: &'static str,
    pub group: Option<()>,
    pub is_blocking: bool,
}

/// `POST /tokenize`.
#[derive(Debug, Serialize)]
pub(crate) struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: u32,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_carry_both_shapes() {
        let body: Value = serde_json::from_slice(&ApiError::unknown_model("x").body()).unwrap();
        assert_eq!(body["error"]["type"], "NotFoundError");
        assert_eq!(body["error"]["code"], 404);
        assert_eq!(body["error"]["message"], "The model `x` does not exist.");
        assert_eq!(body["object"], "error");
        assert_eq!(body["type"], "NotFoundError");
        assert_eq!(body["code"], 404);
        assert!(body["param"].is_null());
    }

    #[test]
    fn prompts_parse_in_every_accepted_form() {
        let parse = |json: &str| PromptIn::from_value(serde_json::from_str(json).unwrap());
        assert!(matches!(parse(r#""hi""#), Ok(PromptIn::Text(t)) if t == "hi"));
        assert!(matches!(parse("[1, 2]"), Ok(PromptIn::Tokens(t)) if t == [1, 2]));
        assert!(matches!(parse(r#"["hi"]"#), Ok(PromptIn::Text(t)) if t == "hi"));
        assert!(matches!(parse("[[3]]"), Ok(PromptIn::Tokens(t)) if t == [3]));
        for bad in [
            r#""""#,
            "[]",
            "null",
            "[-1]",
            "[4294967296]",
            "[1.5]",
            r#"["a", "b"]"#,
            "[[]]",
            "{}",
            "7",
        ] {
            let error = parse(bad).err().unwrap();
            assert_eq!(error.status, StatusCode::BAD_REQUEST, "{bad}");
        }
    }

    #[test]
    fn content_is_a_string_text_parts_or_nothing() {
        let text = |json: &str| content_text(&serde_json::from_str(json).unwrap());
        assert_eq!(text(r#""hi""#).unwrap(), "hi");
        assert_eq!(text("null").unwrap(), "");
        assert_eq!(
            text(r#"[{"type":"text","text":"a"},{"type":"text","text":"b"}]"#).unwrap(),
            "a\nb"
        );
        assert!(text(r#"[{"type":"image_url","image_url":{}}]"#).is_err());
        assert!(text("3").is_err());
    }
}
