//! The prompt's token ids, to compute the block hashes the engine will publish for it.
//!
//! - **Local** (`--tokenizer MODEL=PATH`): the model's `tokenizer.json`, loaded once with the
//!   `tokenizers` crate, and its chat template from `tokenizer_config.json` beside it. A
//!   completion's text is encoded with the special tokens (vLLM's default for completions); a
//!   chat is rendered with the template, then encoded without them (the template writes them),
//!   as vLLM does.
//! - **Remote** (`--tokenize remote`): a worker's `POST /tokenize` (vLLM's route) with the same
//!   fields, asked per request; nothing of the prompt is kept.
//! - Token ids sent by the client pass straight through.
//! - A model with neither routes by the prompt's estimated length alone (no cache affinity).
//!
//! Each prompt is tokenized once per request, on the request's task.

pub mod model;
pub mod remote;
pub mod template;

use crate::error::GatewayError;
use crate::openai::{Kind, OpenAiRequest, Prompt};
use axum::http::StatusCode;
use model::ModelTokenizer;
use prometheus_client::metrics::counter::Counter;
pub use remote::RemoteTokenizer;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use template::ChatInputs;

/// What the gateway routes a prompt by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoutingPrompt {
    /// The token ids the engine will see: routed by cache overlap and load.
    Tokens(Vec<u32>),
    /// No tokenizer: routed by load, with this estimate of the prompt's length in tokens.
    Estimate { isl_tokens: u64 },
}

impl RoutingPrompt {
    /// A text's length in tokens, roughly (4 bytes a token), at least 1.
    pub fn estimate(text_bytes: usize) -> Self {
        Self::Estimate {
            isl_tokens: (text_bytes as u64).div_ceil(4).max(1),
        }
    }
}

/// How prompts are tokenized (`--tokenize`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TokenizeMode {
    /// With the `--tokenizer` files; models without one route by length.
    #[default]
    Local,
    /// By a worker's `POST /tokenize` for models without a `--tokenizer` file.
    Remote,
}

/// The tokenizers of every model given one, and the remote one.
#[derive(Debug)]
pub struct Tokenizers {
    local: HashMap<String, Arc<ModelTokenizer>>,
    /// `Some` with `--tokenize remote`.
    remote: Option<RemoteTokenizer>,
    /// Prompts routed by their estimated length.
    untokenized: Counter,
}

impl Tokenizers {
    /// Loads `--tokenizer MODEL=PATH` pairs.
    pub fn load(
        specs: &[(String, PathBuf)],
        remote: Option<RemoteTokenizer>,
        untokenized: Counter,
    ) -> Result<Self, String> {
        let mut local = HashMap::new();
        for (model, path) in specs {
            let tokenizer = ModelTokenizer::load(path)
                .map_err(|e| format!("--tokenizer {model}={}: {e}", path.display()))?;
            local.insert(model.clone(), Arc::new(tokenizer));
        }
        Ok(Self {
            local,
            remote,
            untokenized,
        })
    }

    /// What the request is routed by: its token ids, or an estimate of its length.
    /// `remote_endpoints` lists the workers that may tokenize it remotely.
    pub async fn routing_prompt(
        &self,
        kind: Kind,
        request: &mut OpenAiRequest,
        model: &str,
        remote_endpoints: impl FnOnce() -> Vec<String>,
    ) -> Result<RoutingPrompt, GatewayError> {
        let local = self.local.get(model);
        match kind {
            Kind::Completions => {
                // Taken, not copied: nothing after routing reads the prompt (the body is
                // forwarded as it came).
                let prompt = request
                    .prompt
                    .take()
                    .ok_or_else(|| GatewayError::invalid_param("`prompt` is required", "prompt"))?
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
                Ok(self.remotely(body, text.len(), remote_endpoints).await)
            }
            // A response's input was turned into messages (`crate::responses`).
            Kind::Chat | Kind::Responses => {
                let messages = request.messages.as_deref().ok_or_else(|| {
                    GatewayError::invalid_param("`messages` is required", "messages")
                })?;
                if messages.is_empty() {
                    return Err(GatewayError::invalid_param(
                        "`messages` must not be empty",
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
                Ok(self.remotely(body, size, remote_endpoints).await)
            }
        }
    }

    /// A worker's `POST /tokenize`, with `--tokenize remote`; otherwise, or when it fails,
    /// the estimate of a prompt of `size` bytes.
    async fn remotely(
        &self,
        body: Value,
        size: usize,
        endpoints: impl FnOnce() -> Vec<String>,
    ) -> RoutingPrompt {
        let Some(remote) = &self.remote else {
            self.untokenized.inc();
            return RoutingPrompt::estimate(size);
        };
        let endpoints = endpoints();
        if endpoints.is_empty() {
            self.untokenized.inc();
            return RoutingPrompt::estimate(size);
        }
        let endpoint = remote.pick(&endpoints);
        match remote.tokenize(endpoint, &body).await {
            Ok(tokens) if !tokens.is_empty() => RoutingPrompt::Tokens(tokens),
            Ok(_) => RoutingPrompt::estimate(size),
            Err(e) => {
                tracing::warn!(%endpoint, error = %e, "remote tokenization failed; routing by length");
                self.untokenized.inc();
                RoutingPrompt::estimate(size)
            }
        }
    }
}

/// `--tokenizer MODEL=PATH`.
pub fn parse_tokenizer_flag(raw: &str) -> Result<(String, PathBuf), String> {
    match raw.split_once('=') {
        Some((model, path)) if !model.is_empty() && !path.is_empty() => {
            Ok((model.to_string(), PathBuf::from(path)))
        }
        _ => Err(format!(
            "expected MODEL=PATH (a tokenizer.json or its directory), got `{raw}`"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_names_a_model_and_a_path() {
        assert_eq!(
            parse_tokenizer_flag("llama=/m/tokenizer.json").unwrap(),
            ("llama".to_string(), PathBuf::from("/m/tokenizer.json"))
        );
        assert!(parse_tokenizer_flag("llama").is_err());
        assert!(parse_tokenizer_flag("=x").is_err());
    }

    #[test]
    fn estimates_are_at_least_one_token() {
        assert_eq!(
            RoutingPrompt::estimate(0),
            RoutingPrompt::Estimate { isl_tokens: 1 }
        );
        assert_eq!(
            RoutingPrompt::estimate(9),
            RoutingPrompt::Estimate { isl_tokens: 3 }
        );
    }
}
