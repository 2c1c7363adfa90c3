//! The parts of an OpenAI request the gateway reads: its route and a few fields of its body.
//!
//! The request body is forwarded to the engine as received; the gateway only reads `model`
//! (the partition), `stream`, the prompt (`prompt` or `messages`) and the token limits. A
//! prompt of token ids is kept as ids, with no copy through a generic JSON value.

use crate::error::GatewayError;
use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde_json::Value;
use std::fmt;

/// The route templates the gateway adds (the metrics' labels).
pub mod route {
    pub const COMPLETIONS: &str = "/v1/completions";
    pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";
    pub const MODELS: &str = "/v1/models";
    pub const ALL: &[&str] = &[COMPLETIONS, CHAT_COMPLETIONS, MODELS];
}

/// Which OpenAI route a request came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completions,
    Chat,
}

impl Kind {
    /// The route's path, on the gateway and on the engine alike.
    pub fn path(self) -> &'static str {
        match self {
            Kind::Completions => route::COMPLETIONS,
            Kind::Chat => route::CHAT_COMPLETIONS,
        }
    }
}

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
    /// The request's session (kvroute's session affinity); wins over a session header.
    #[serde(default)]
    pub session_id: Option<String>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

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
}
