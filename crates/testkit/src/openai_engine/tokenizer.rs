//! What the mock engine turns text into, and the text it generates.
//!
//! - **Built in, byte-level**: each UTF-8 byte `b` of the text is token `b + 3` (ids 0–2 are
//!   left for special tokens, as ByT5 does), so the vocabulary has 259 ids and no special token
//!   is ever added.
//! - **A HuggingFace `tokenizer.json`** (`--tokenizer PATH`), loaded with the `tokenizers` crate
//!   (no network, no C dependencies).
//!
//! Chat messages are rendered with [`render_chat`], a trivial built-in template, before they are
//! tokenized: the engine and `/tokenize` call the same functions, so `/tokenize` answers with
//! exactly the ids the engine computes and publishes KV events for.
//!
//! The engine's output is [`OUTPUT_TEXT`] tokenized once and repeated: token `i` of every
//! answer is the same, so identical requests produce identical blocks, as greedy decoding does.

use std::path::Path;
use std::sync::Arc;

/// The first id of a byte in the built-in tokenizer: byte `b` is `b + BYTE_TOKEN_OFFSET`.
pub const BYTE_TOKEN_OFFSET: u32 = 3;

/// The text every answer repeats (tokenized with the engine's tokenizer).
pub const OUTPUT_TEXT: &str = "The mock engine streams these words at the pace of a real one. ";

enum Kind {
    Bytes,
    HuggingFace(Box<tokenizers::Tokenizer>),
}

struct Inner {
    kind: Kind,
    /// The generated tokens, repeated: `output_ids[i % len]` is the answer's token `i`.
    output_ids: Vec<u32>,
    /// The text of each, as a stream shows it.
    output_pieces: Vec<String>,
}

/// The engine's tokenizer; cheap to clone.
#[derive(Clone)]
pub struct MockTokenizer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MockTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner.kind {
            Kind::Bytes => "bytes",
            Kind::HuggingFace(_) => "huggingface",
        };
        f.debug_struct("MockTokenizer")
            .field("kind", &kind)
            .finish()
    }
}

impl MockTokenizer {
    /// The built-in byte-level tokenizer.
    pub fn bytes() -> Self {
        let output_ids: Vec<u32> = OUTPUT_TEXT
            .bytes()
            .map(|b| u32::from(b) + BYTE_TOKEN_OFFSET)
            .collect();
        // OUTPUT_TEXT is ASCII: one character per byte.
        let output_pieces = OUTPUT_TEXT.chars().map(String::from).collect();
        Self::with(Kind::Bytes, output_ids, output_pieces)
    }

    /// Loads a HuggingFace `tokenizer.json`.
    pub fn from_file(path: &Path) -> std::io::Result<Self> {
        let invalid = |reason: String| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("tokenizer {}: {reason}", path.display()),
            )
        };
        let tokenizer =
            tokenizers::Tokenizer::from_file(path).map_err(|e| invalid(e.to_string()))?;
        let vocab = tokenizer.get_vocab_size(true);
        if vocab == 0 {
            return Err(invalid("the vocabulary is empty".to_string()));
        }
        let mut output_ids = tokenizer
            .encode(OUTPUT_TEXT, false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default();
        if output_ids.is_empty() {
            // A vocabulary that cannot spell the text (no unknown token): its first ids.
            output_ids = (0..vocab.min(16) as u32).collect();
        }
        let output_pieces = incremental_pieces(&tokenizer, &output_ids);
        Ok(Self::with(
            Kind::HuggingFace(Box::new(tokenizer)),
            output_ids,
            output_pieces,
        ))
    }

    fn with(kind: Kind, output_ids: Vec<u32>, output_pieces: Vec<String>) -> Self {
        Self {
            inner: Arc::new(Inner {
                kind,
                output_ids,
                output_pieces,
            }),
        }
    }

    /// Token ids of `text`; `add_special_tokens` lets a HuggingFace tokenizer's post-processor
    /// add its BOS/EOS (vLLM's default: yes for a completion's prompt, no for rendered chat).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        match &self.inner.kind {
            Kind::Bytes => Ok(text
                .bytes()
                .map(|b| u32::from(b) + BYTE_TOKEN_OFFSET)
                .collect()),
            Kind::HuggingFace(tokenizer) => tokenizer
                .encode(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| format!("cannot tokenize: {e}")),
        }
    }

    /// The text of token ids (special and out-of-vocabulary ids are skipped).
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.inner.kind {
            Kind::Bytes => {
                let bytes: Vec<u8> = ids
                    .iter()
                    .filter_map(|&id| u8::try_from(id.checked_sub(BYTE_TOKEN_OFFSET)?).ok())
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Kind::HuggingFace(tokenizer) => tokenizer.decode(ids, true).unwrap_or_default(),
        }
    }

    /// Token `index` of every answer, and its text.
    pub fn output_token(&self, index: usize) -> (u32, &str) {
        let i = index % self.inner.output_ids.len();
        (self.inner.output_ids[i], &self.inner.output_pieces[i])
    }

    /// The first `count` tokens of every answer.
    pub fn output_ids(&self, count: usize) -> Vec<u32> {
        (0..count).map(|i| self.output_token(i).0).collect()
    }
}

/// The text each token adds when the tokens are decoded one after another (a token may complete
/// a character another started, so decoding each alone could split one).
fn incremental_pieces(tokenizer: &tokenizers::Tokenizer, ids: &[u32]) -> Vec<String> {
    let mut pieces = Vec::with_capacity(ids.len());
    let mut previous = String::new();
    for end in 1..=ids.len() {
        let text = tokenizer.decode(&ids[..end], true).unwrap_or_default();
        let piece = match text.strip_prefix(previous.as_str()) {
            Some(added) => added.to_string(),
            None => tokenizer
                .decode(&ids[end - 1..end], true)
                .unwrap_or_default(),
        };
        pieces.push(piece);
        previous = text;
    }
    pieces
}

/// One chat message, its content already flattened to text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// The built-in chat template: `<|role|>\ncontent<|end|>\n` per message, then `<|assistant|>\n`
/// when `add_generation_prompt`. A follow-up turn's prompt so extends the previous turn's prompt
/// and answer, whose blocks it hits.
pub fn render_chat(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let mut text = String::new();
    for message in messages {
        text.push_str("<|");
        text.push_str(&message.role);
        text.push_str("|>\n");
        text.push_str(&message.content);
        text.push_str("<|end|>\n");
    }
    if add_generation_prompt {
        text.push_str("<|assistant|>\n");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_the_output_spells_its_text() {
        let tokenizer = MockTokenizer::bytes();
        let ids = tokenizer.encode("héllo", true).unwrap();
        assert_eq!(ids.len(), 6, "é is two bytes");
        assert_eq!(ids[0], u32::from(b'h') + BYTE_TOKEN_OFFSET);
        assert_eq!(tokenizer.decode(&ids), "héllo");
        assert_eq!(
            tokenizer.decode(&[0, 1, 2, 999]),
            "",
            "specials are skipped"
        );
        let n = OUTPUT_TEXT.len();
        let text: String = (0..n).map(|i| tokenizer.output_token(i).1).collect();
        assert_eq!(text, OUTPUT_TEXT);
        assert_eq!(tokenizer.output_token(n), tokenizer.output_token(0));
        assert_eq!(
            tokenizer.encode(OUTPUT_TEXT, false).unwrap(),
            tokenizer.output_ids(n)
        );
    }

    #[test]
    fn the_template_renders_each_message_then_the_generation_prompt() {
        let messages = [
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
        ];
        assert_eq!(
            render_chat(&messages, true),
            "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
        );
        assert!(!render_chat(&messages, false).ends_with("<|assistant|>\n"));
    }
}
