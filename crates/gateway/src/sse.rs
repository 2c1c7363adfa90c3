//! Reading an engine's OpenAI server-sent events as they pass through, only as far as the
//! lifecycle needs: which chunk carries the first generated token, how many tokens each chunk
//! carries, and the total the engine reports in a `usage` chunk.
//!
//! The bytes themselves are forwarded untouched by the caller; the scanner keeps only the
//! unfinished line of the last frame (an event split across frames), at most
//! [`MAX_LINE_BYTES`], so a stream is never held whole. Each `data:` line is parsed by serde
//! into a borrowed skeleton that skips everything but `choices[].text`, `choices[].delta` and
//! `usage.completion_tokens`, allocating nothing for the text itself.
//!
//! Counting follows how vLLM and SGLang stream: one chunk per decode step, so a chunk whose
//! choice has non-empty `text` (completions) or `delta.content` / `delta.reasoning_content` /
//! `delta.tool_calls` (chat) is one token, or `len(token_ids)` tokens when the engine returns
//! them. The role-only first chunk of a chat stream and the final chunk with only a
//! `finish_reason` carry none. A `usage` chunk's `completion_tokens`, when the client asked for
//! it, corrects the count.

use crate::usage::PromptUsage;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, Visitor};
use std::fmt;

/// The longest `data:` line kept across frames; a longer one is skipped (it carries no count).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// What one `data:` payload says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChunkInfo {
    /// Generated tokens in the chunk.
    pub tokens: u64,
    /// `usage.completion_tokens`, when present.
    pub usage_completion_tokens: Option<u64>,
    /// `usage`'s prompt counts, when present.
    pub usage_prompt: Option<PromptUsage>,
    /// `data: [DONE]`.
    pub done: bool,
    /// The engine reported an error in the stream (`{"error": ...}`).
    pub error: bool,
}

/// What a run of bytes added, summed over the complete `data:` lines in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScanOutcome {
    pub tokens: u64,
    /// The largest `usage.completion_tokens` seen.
    pub usage_completion_tokens: Option<u64>,
    /// The last `usage`'s prompt counts seen.
    pub usage_prompt: Option<PromptUsage>,
    pub done: bool,
    pub error: bool,
}

impl ScanOutcome {
    fn add(&mut self, chunk: ChunkInfo) {
        self.tokens += chunk.tokens;
        self.usage_completion_tokens = self
            .usage_completion_tokens
            .max(chunk.usage_completion_tokens);
        self.usage_prompt = chunk.usage_prompt.or(self.usage_prompt);
        self.done |= chunk.done;
        self.error |= chunk.error;
    }
}

/// An incremental scanner of one SSE stream.
#[derive(Debug, Default)]
pub struct SseScanner {
    /// The unfinished last line of the bytes scanned so far.
    partial: Vec<u8>,
    /// The unfinished line is past [`MAX_LINE_BYTES`]: drop the rest of it.
    skipping: bool,
}

impl SseScanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Scans the next bytes of the stream.
    pub fn scan(&mut self, mut bytes: &[u8]) -> ScanOutcome {
        let mut outcome = ScanOutcome::default();
        while let Some(end) = memchr::memchr(b'\n', bytes) {
            let piece = &bytes[..end];
            bytes = &bytes[end + 1..];
            if self.skipping {
                self.skipping = false;
                continue;
            }
            if self.partial.is_empty() {
                outcome.add(line_info(piece));
            } else {
                self.partial.extend_from_slice(piece);
                outcome.add(line_info(&self.partial));
                self.partial.clear();
            }
        }
        if !bytes.is_empty() && !self.skipping {
            if self.partial.len() + bytes.len() > MAX_LINE_BYTES {
                self.partial.clear();
                self.skipping = true;
            } else {
                self.partial.extend_from_slice(bytes);
            }
        }
        outcome
    }
}

/// One line (without its `\n`): a `data:` field's payload is read, any other line says nothing.
fn line_info(line: &[u8]) -> ChunkInfo {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Some(payload) = line.strip_prefix(b"data:") else {
        return ChunkInfo::default();
    };
    let payload = payload.strip_prefix(b" ").unwrap_or(payload);
    chunk_info(payload)
}

/// What one `data:` payload says (a JSON chunk, `[DONE]`, or anything else: nothing).
pub fn chunk_info(payload: &[u8]) -> ChunkInfo {
    if payload.trim_ascii() == b"[DONE]" {
        return ChunkInfo {
            done: true,
            ..ChunkInfo::default()
        };
    }
    let Ok(chunk) = serde_json::from_slice::<Chunk>(payload) else {
        return ChunkInfo::default();
    };
    ChunkInfo {
        tokens: chunk.choices.iter().map(Choice::tokens).sum(),
        usage_completion_tokens: chunk.usage.as_ref().and_then(|u| u.completion_tokens),
        usage_prompt: chunk.usage.as_ref().and_then(|u| {
            Some(PromptUsage {
                prompt_tokens: u.prompt_tokens?,
                cached_tokens: u
                    .prompt_tokens_details
                    .as_ref()
                    .and_then(|d| d.cached_tokens),
            })
        }),
        done: false,
        error: chunk.error.is_some(),
    }
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    text: NonEmpty,
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    token_ids: Option<Count>,
}

impl Choice {
    fn tokens(&self) -> u64 {
        if let Some(Count(n)) = self.token_ids {
            return n;
        }
        let delta = self.delta.as_ref().is_some_and(|d| {
            d.content.0 || d.reasoning_content.0 || d.reasoning.0 || d.tool_calls.is_some()
        });
        u64::from(self.text.0 || delta)
    }
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: NonEmpty,
    #[serde(default)]
    reasoning_content: NonEmpty,
    #[serde(default)]
    reasoning: NonEmpty,
    #[serde(default)]
    tool_calls: Option<IgnoredAny>,
}

/// Whether a string field is present and not empty, read without copying it.
#[derive(Default)]
struct NonEmpty(bool);

impl<'de> Deserialize<'de> for NonEmpty {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = NonEmpty;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or null")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<NonEmpty, E> {
                Ok(NonEmpty(!s.is_empty()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<NonEmpty, E> {
                Ok(NonEmpty(false))
            }
            fn visit_none<E: de::Error>(self) -> Result<NonEmpty, E> {
                Ok(NonEmpty(false))
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<NonEmpty, D::Error> {
                d.deserialize_any(V)
            }
            // Content given as a list of parts: count it when not empty.
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<NonEmpty, A::Error> {
                let mut any = false;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    any = true;
                }
                Ok(NonEmpty(any))
            }
        }
        deserializer.deserialize_any(V)
    }
}

/// The length of an array, read without keeping its elements.
struct Count(u64);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Count;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Count, A::Error> {
                let mut n = 0;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(Count(n))
            }
        }
        deserializer.deserialize_seq(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CHAT_STREAM: &str = concat!(
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo \\\"x\\\"\"}}]}\n\n",
        ": a comment\n",
        "event: message\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\n",
        "data: [DONE]\n\n",
    );

    #[test]
    fn chat_chunks_count_content_not_roles_or_finishes() {
        let mut scanner = SseScanner::new();
        let outcome = scanner.scan(CHAT_STREAM.as_bytes());
        assert_eq!(
            outcome,
            ScanOutcome {
                tokens: 2,
                usage_completion_tokens: Some(2),
                usage_prompt: Some(PromptUsage {
                    prompt_tokens: 5,
                    cached_tokens: Some(3),
                }),
                done: true,
                error: false,
            }
        );
    }

    #[test]
    fn completion_chunks_count_text_and_token_ids() {
        let info = chunk_info(br#"{"choices":[{"index":0,"text":"a","logprobs":null}]}"#);
        assert_eq!(info.tokens, 1);
        let info = chunk_info(br#"{"choices":[{"index":0,"text":""}]}"#);
        assert_eq!(info.tokens, 0);
        let info = chunk_info(br#"{"choices":[{"text":"ab","token_ids":[5,6,7]}]}"#);
        assert_eq!(info.tokens, 3);
        let info = chunk_info(br#"{"choices":[{"text":"a"},{"text":"b"}]}"#);
        assert_eq!(info.tokens, 2, "one token per choice (n > 1)");
        let info = chunk_info(br#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#);
        assert_eq!(info.tokens, 1);
        let info = chunk_info(br#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#);
        assert_eq!(info.tokens, 1);
        let info = chunk_info(br#"{"error":{"message":"boom","code":500}}"#);
        assert!(info.error);
        assert_eq!(chunk_info(b"not json"), ChunkInfo::default());
        assert!(chunk_info(b" [DONE] ").done);
    }

    #[test]
    fn crlf_lines_and_lines_without_a_space_are_read() {
        let mut scanner = SseScanner::new();
        let outcome =
            scanner.scan(b"data:{\"choices\":[{\"text\":\"a\"}]}\r\n\r\ndata: [DONE]\r\n\r\n");
        assert_eq!((outcome.tokens, outcome.done), (1, true));
    }

    #[test]
    fn an_overlong_line_is_skipped_and_the_next_read() {
        let mut scanner = SseScanner::new();
        let big = vec![b'x'; MAX_LINE_BYTES + 10];
        assert_eq!(scanner.scan(b"data: "), ScanOutcome::default());
        assert_eq!(scanner.scan(&big), ScanOutcome::default());
        assert_eq!(scanner.scan(b"yy\n"), ScanOutcome::default());
        assert!(scanner.partial.is_empty());
        let outcome = scanner.scan(b"data: {\"choices\":[{\"text\":\"a\"}]}\n");
        assert_eq!(outcome.tokens, 1);
    }

    proptest! {
        /// However the stream is cut into frames, the scanner counts what it counts whole.
        #[test]
        fn frame_cuts_do_not_change_the_count(cuts in proptest::collection::vec(0usize..CHAT_STREAM.len(), 0..12)) {
            let bytes = CHAT_STREAM.as_bytes();
            let mut cuts = cuts;
            cuts.sort_unstable();
            let mut scanner = SseScanner::new();
            let mut total = ScanOutcome::default();
            let mut at = 0;
            for cut in cuts.into_iter().chain([bytes.len()]) {
                let part = scanner.scan(&bytes[at..cut.max(at)]);
                total.tokens += part.tokens;
                total.usage_completion_tokens = total.usage_completion_tokens.max(part.usage_completion_tokens);
                total.usage_prompt = part.usage_prompt.or(total.usage_prompt);
                total.done |= part.done;
                at = cut.max(at);
            }
            prop_assert_eq!(total, SseScanner::new().scan(bytes));
        }
    }
}
