//! One model's local tokenizer: its `tokenizer.json`, loaded once with the `tokenizers` crate,
//! and the chat template of the `tokenizer_config.json` beside it.

use super::template::{ChatInputs, ChatTemplate};
use crate::error::GatewayError;
use axum::http::StatusCode;
use std::path::{Path, PathBuf};

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
