//! The parts of an OpenAI request the gateway reads: its route and a few fields of its body.
//!
//! The request body is forwarded to the engine as received; the gateway only reads `model`
//! (the partition), `stream`, the prompt (`prompt`, `messages`, or a response's `input`) and
//! the token limits. A prompt of token ids is kept as ids, with no copy through a generic JSON
//! value.
//!
//! Bad input is answered here, before any booking, as OpenAI answers it: a 400 whose `param`
//! names the field (`GatewayError::invalid_param`). A body that is not JSON names none.

mod prompt;

use crate::error::GatewayError;
pub use prompt::{Prompt, PromptField};
use serde::Deserialize;
use serde_json::Value;
use serde_json::error::Category;

/// The route templates the gateway adds (the metrics' labels).
pub mod route {
    pub const COMPLETIONS: &str = "/v1/completions";
    pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";
    pub const RESPONSES: &str = "/v1/responses";
    pub const MODELS: &str = "/v1/models";
    pub const ALL: &[&str] = &[COMPLETIONS, CHAT_COMPLETIONS, RESPONSES, MODELS];
}

/// Which OpenAI route a request came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completions,
    Chat,
    /// `POST /v1/responses`: routed as a chat of its `input` (`crate::responses`).
    Responses,
}

impl Kind {
    /// The route's path, on the gateway and on the engine alike.
    pub fn path(self) -> &'static str {
        match self {
            Kind::Completions => route::COMPLETIONS,
            Kind::Chat => route::CHAT_COMPLETIONS,
            Kind::Responses => route::RESPONSES,
        }
    }
}

/// The fields of the generation routes' bodies that matter here. Unknown fields are ignored
/// (the engine reads them).
#[derive(Debug, Deserialize)]
pub struct OpenAiRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub stream: Option<bool>,
    /// Read only to check that it comes with `stream`.
    #[serde(default)]
    pub stream_options: Option<Value>,
    #[serde(default)]
    pub prompt: Option<PromptField>,
    #[serde(default)]
    pub messages: Option<Vec<Value>>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// The Responses API's limit.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    #[serde(default)]
    pub min_tokens: Option<u64>,
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub n: Option<u64>,
    // The Responses API's prompt: `input` (a string or items) and `instructions`.
    #[serde(default)]
    pub input: Option<Value>,
    #[serde(default)]
    pub instructions: Option<String>,
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
    /// The request's session (kvroute's session affinity); wins over a session header.
    #[serde(default)]
    pub session_id: Option<String>,
}

/// Each field the gateway reads, and what it must be (the 400's message).
const FIELDS: &[(&str, &str)] = &[
    ("model", "a string"),
    ("stream", "a boolean"),
    ("stream_options", "an object"),
    (
        "prompt",
        "a string, an array of strings, an array of token ids or an array of arrays of token ids",
    ),
    ("messages", "an array of messages"),
    ("max_tokens", "an integer of at least 1"),
    ("max_completion_tokens", "an integer of at least 1"),
    ("max_output_tokens", "an integer of at least 1"),
    ("min_tokens", "a non-negative integer"),
    ("ignore_eos", "a boolean"),
    ("n", "an integer of at least 1"),
    ("input", "a string or an array of input items"),
    ("instructions", "a string"),
    ("add_generation_prompt", "a boolean"),
    ("continue_final_message", "a boolean"),
    ("tools", "an array of tools"),
    ("documents", "an array of documents"),
    ("chat_template_kwargs", "an object"),
    ("add_special_tokens", "a boolean"),
    ("cache_salt", "a string"),
    ("session_id", "a string"),
];

impl OpenAiRequest {
    /// Parses the body; a field of the wrong type is a 400 naming it.
    pub fn parse(body: &[u8]) -> Result<Self, GatewayError> {
        let mut deserializer = serde_json::Deserializer::from_slice(body);
        let request: Self = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
            let inner = e.inner();
            let field = match e.path().iter().next() {
                Some(serde_path_to_error::Segment::Map { key }) => {
                    FIELDS.iter().find(|(name, _)| name == key)
                }
                _ => None,
            };
            match (inner.classify(), field) {
                (Category::Data, Some((name, expected))) => GatewayError::invalid_param(
                    format!("`{name}` must be {expected} ({inner})"),
                    name,
                ),
                (Category::Data, None) => GatewayError::invalid(format!(
                    "the request body must be a JSON object ({inner})"
                )),
                _ => GatewayError::invalid(format!("the request body is not valid JSON: {inner}")),
            }
        })?;
        // Trailing bytes after the object.
        deserializer.end().map_err(|e| {
            GatewayError::invalid(format!("the request body is not valid JSON: {e}"))
        })?;
        Ok(request)
    }

    /// What the route needs beyond the fields' types: the model, the route's prompt, limits
    /// in range. The prompt's own shape (one prompt, not empty) is checked where it is read.
    pub fn validate(&self, kind: Kind) -> Result<(), GatewayError> {
        match &self.model {
            // vLLM serves its one model to a request that names none; so does the gateway
            // (`--model`).
            None => {}
            Some(model) if model.is_empty() || model.len() > 1024 => {
                return Err(GatewayError::invalid_param(
                    "`model` must be between 1 and 1024 bytes",
                    "model",
                ));
            }
            Some(_) => {}
        }
        for (name, value) in [
            ("max_tokens", self.max_tokens),
            ("max_completion_tokens", self.max_completion_tokens),
            ("max_output_tokens", self.max_output_tokens),
            ("n", self.n),
        ] {
            if value == Some(0) {
                return Err(GatewayError::invalid_param(
                    format!("`{name}` must be an integer of at least 1, got 0"),
                    name,
                ));
            }
        }
        if let (Some(min), Some(max)) = (self.min_tokens, self.expected_output_tokens())
            && min > max
        {
            return Err(GatewayError::invalid_param(
                format!("`min_tokens` ({min}) must not exceed the maximum ({max})"),
                "min_tokens",
            ));
        }
        if self.stream_options.as_ref().is_some_and(|o| !o.is_null()) && !self.is_stream() {
            return Err(GatewayError::invalid_param(
                "`stream_options` can only be given with `stream: true`",
                "stream_options",
            ));
        }
        match kind {
            Kind::Completions => {
                if self.prompt.is_none() {
                    return Err(GatewayError::invalid_param(
                        "`prompt` is required",
                        "prompt",
                    ));
                }
            }
            Kind::Chat => {
                let messages = self.messages.as_deref().ok_or_else(|| {
                    GatewayError::invalid_param("`messages` is required", "messages")
                })?;
                if messages.is_empty() {
                    return Err(GatewayError::invalid_param(
                        "`messages` must not be empty",
                        "messages",
                    ));
                }
                for (i, message) in messages.iter().enumerate() {
                    if !message.get("role").is_some_and(Value::is_string) {
                        return Err(GatewayError::invalid_param(
                            format!("`messages[{i}]` must be an object with a string `role`"),
                            "messages",
                        ));
                    }
                }
            }
            Kind::Responses => crate::responses::validate_input(self.input.as_ref())?,
        }
        Ok(())
    }

    pub fn is_stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// The output tokens to book: the most of one choice times the choices (`n`).
    pub fn booked_output_tokens(&self) -> Option<u64> {
        let per_choice = self.expected_output_tokens()?;
        Some(per_choice.saturating_mul(self.n.unwrap_or(1)))
    }

    /// The most output tokens of one choice, when the request says.
    pub fn expected_output_tokens(&self) -> Option<u64> {
        self.max_completion_tokens
            .or(self.max_tokens)
            .or(self.max_output_tokens)
    }
}

#[cfg(test)]
mod tests;
