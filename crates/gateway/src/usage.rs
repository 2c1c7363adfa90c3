//! The prompt counts of an engine's answer: `usage.prompt_tokens` and
//! `usage.prompt_tokens_details.cached_tokens`, from a stream's usage chunk (`crate::sse`) or
//! from the end of a whole answer ([`document_usage`]), for `crate::mismatch`.

use serde::{Deserialize, Deserializer};

/// An answer's `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens` (vLLM
/// reports the latter only with `--enable-prompt-tokens-details`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct PromptUsage {
    pub prompt_tokens: u64,
    #[serde(default, deserialize_with = "cached_tokens")]
    #[serde(rename = "prompt_tokens_details")]
    pub cached_tokens: Option<u64>,
}

/// `prompt_tokens_details`: `null`, or an object with `cached_tokens` (maybe `null`).
fn cached_tokens<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Details {
        #[serde(default)]
        cached_tokens: Option<u64>,
    }
    Ok(Option::<Details>::deserialize(deserializer)?.and_then(|d| d.cached_tokens))
}

/// The `usage` object of a whole (not streamed) answer: the last `"usage"` key in `tail`, the
/// document's end (vLLM and SGLang write `usage` after the choices). `None` when it has none
/// or it is not a usage object.
pub fn document_usage(tail: &[u8]) -> Option<PromptUsage> {
    const KEY: &[u8] = b"\"usage\"";
    // Inside a JSON string a quote is escaped, so an unescaped `"usage"` followed by a colon
    // is a key.
    let mut end = tail.len();
    while let Some(at) = memchr::memmem::rfind(&tail[..end], KEY) {
        end = at;
        let rest = tail[at + KEY.len()..].trim_ascii_start();
        let Some(value) = rest.strip_prefix(b":") else {
            continue;
        };
        let mut values = serde_json::Deserializer::from_slice(value).into_iter::<PromptUsage>();
        if let Some(Ok(usage)) = values.next() {
            return Some(usage);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_documents_usage_is_read_from_its_end() {
        let doc = br#"{"id":"c","choices":[{"text":"say \"usage\": {\"prompt_tokens\": 1}"}],"usage": {"prompt_tokens":12,"total_tokens":14,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}},"prompt_logprobs":null}"#;
        assert_eq!(
            document_usage(doc),
            Some(PromptUsage {
                prompt_tokens: 12,
                cached_tokens: Some(8)
            })
        );
        // From the middle of the document on, as a bounded tail keeps it.
        assert_eq!(
            document_usage(&doc[20..]).map(|u| u.prompt_tokens),
            Some(12)
        );
        let without_details =
            br#"{"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":null}}"#;
        assert_eq!(
            document_usage(without_details),
            Some(PromptUsage {
                prompt_tokens: 3,
                cached_tokens: None
            })
        );
        // A quoted "usage" inside a string is not the key.
        assert_eq!(
            document_usage(br#"{"text":"\"usage\": {\"prompt_tokens\": 1}"}"#),
            None
        );
        assert_eq!(document_usage(b"not json"), None);
        assert_eq!(document_usage(br#"{"usage": 5}"#), None);
    }
}
