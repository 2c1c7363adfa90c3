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

use crate::openai::GatewayError;
use crate::template::{ChatInputs, ChatTemplate};
use axum::http::StatusCode;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// One model's tokenizer and chat template.
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("template", &self.template)
            .finish_non_exhaustive()
    }
}

impl ModelTokenizer {
    /// Loads `PATH`: a `tokenizer.json`, or a directory holding one; `tokenizer_config.json`
    /// beside it, when there, gives the chat template and the special tokens.
    pub fn load(path: &Path) -> Result<Self, String> {
        let (tokenizer_file, config_file) = if path.is_dir() {
            (
                path.join("tokenizer.json"),
                path.join("tokenizer_config.json"),
            )
        } else {
            let dir = path.parent().map_or_else(PathBuf::new, Path::to_path_buf);
            (path.to_path_buf(), dir.join("tokenizer_config.json"))
        };
        let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_file)
            .map_err(|e| format!("cannot load {}: {e}", tokenizer_file.display()))?;
        let template = match std::fs::read(&config_file) {
            Ok(bytes) => {
                let config: serde_json::Value = serde_json::from_slice(&bytes)
                    .map_err(|e| format!("cannot parse {}: {e}", config_file.display()))?;
                ChatTemplate::from_config(&config)
                    .map_err(|e| format!("{}: {e}", config_file.display()))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("cannot read {}: {e}", config_file.display())),
        };
        Ok(Self {
            tokenizer,
            template,
        })
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, GatewayError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| {
                GatewayError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("tokenizer failed: {e}"),
                )
            })
    }

    /// The conversation rendered with the chat template, as text; `None` without a template.
    pub fn render_chat(&self, inputs: &ChatInputs<'_>) -> Option<Result<String, GatewayError>> {
        let template = self.template.as_ref()?;
        Some(
            template
                .render(inputs)
                .map_err(|e| GatewayError::invalid_param(e, "messages")),
        )
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

/// The tokenizers of every model given one.
#[derive(Debug, Default)]
pub struct Tokenizers {
    pub mode: TokenizeMode,
    local: HashMap<String, Arc<ModelTokenizer>>,
}

impl Tokenizers {
    /// Loads `--tokenizer MODEL=PATH` pairs.
    pub fn load(mode: TokenizeMode, specs: &[(String, PathBuf)]) -> Result<Self, String> {
        let mut local = HashMap::new();
        for (model, path) in specs {
            let tokenizer = ModelTokenizer::load(path)
                .map_err(|e| format!("--tokenizer {model}={}: {e}", path.display()))?;
            local.insert(model.clone(), Arc::new(tokenizer));
        }
        Ok(Self { mode, local })
    }

    pub fn local(&self, model: &str) -> Option<&Arc<ModelTokenizer>> {
        self.local.get(model)
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
