//! `prompt` of `POST /v1/completions`: text, token ids, or a batch of one of them, read with
//! no copy through a generic JSON value (a prompt of 100k ids is one `Vec<u32>`).

use crate::error::GatewayError;
use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use std::fmt;

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
