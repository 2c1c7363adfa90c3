//! Prompts from a Mooncake trace (JSONL, one request a line with `input_length` and
//! `hash_ids`), as the load generator replays them.
//!
//! The trace gives no tokens, only one hash id per 512-token block; each id becomes 512
//! pseudo-random token ids in a real vocabulary's range (Qwen2's 151,936 tokens), drawn from a
//! [`SmallRng`] seeded with the id. So equal hash ids give equal tokens (prompts share prefixes
//! exactly where the trace says), different ids give different ones, and bodies are as long as
//! a real prompt's. The tokens are the same from run to run of one build; rand does not promise
//! `SmallRng`'s stream across its versions or platforms, so compare runs of one binary.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};

/// Tokens per hash id in a Mooncake trace.
pub const TOKENS_PER_HASH_ID: usize = 512;

/// Token ids are drawn from a vocabulary of this size.
pub const VOCAB: u32 = 151_936;

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read {path:?}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path:?} line {line}: {source}")]
    Line {
        path: PathBuf,
        line: usize,
        source: serde_json::Error,
    },
    #[error("{path:?} has no prompts")]
    Empty { path: PathBuf },
}

/// The first `len` tokens of the blocks named by `hash_ids` (at most
/// `hash_ids.len() * TOKENS_PER_HASH_ID`).
pub fn expand_hash_ids(hash_ids: &[u64], len: usize) -> Vec<u32> {
    let len = len.min(hash_ids.len() * TOKENS_PER_HASH_ID);
    let mut tokens = Vec::with_capacity(len);
    for &id in hash_ids {
        let n = (len - tokens.len()).min(TOKENS_PER_HASH_ID);
        if n == 0 {
            break;
        }
        let mut rng = SmallRng::seed_from_u64(id);
        tokens.extend((0..n).map(|_| rng.random_range(0..VOCAB)));
    }
    tokens
}

/// The token ids of each request of the trace at `path`, cut to its `input_length` and to `cap`;
/// requests left without tokens are skipped.
pub fn mooncake_prompts(path: &Path, cap: usize) -> Result<Vec<Vec<u32>>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|source| TraceError::Line {
                path: path.to_path_buf(),
                line: i + 1,
                source,
            })?;
        let input = v["input_length"].as_u64().unwrap_or(0) as usize;
        let ids: Vec<u64> = v["hash_ids"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default();
        let tokens = expand_hash_ids(&ids, input.min(cap));
        if !tokens.is_empty() {
            prompts.push(tokens);
        }
    }
    if prompts.is_empty() {
        return Err(TraceError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(prompts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_hash_ids_give_equal_tokens_in_the_vocabulary() {
        let a = expand_hash_ids(&[7, 8, 9], 1200);
        let b = expand_hash_ids(&[7, 8, 10], 5000);
        assert_eq!(a.len(), 1200);
        assert_eq!(
            b.len(),
            3 * TOKENS_PER_HASH_ID,
            "no more tokens than the ids name"
        );
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1200], b[1024..1200]);
        assert_ne!(a[..512], a[512..1024]);
        assert!(a.iter().chain(&b).all(|&t| t < VOCAB));
        assert!(expand_hash_ids(&[], 100).is_empty());
    }

    #[test]
    fn a_trace_file_gives_its_prompts_cut_to_the_cap() {
        let path = std::env::temp_dir().join(format!("kvroute-trace-{}.jsonl", std::process::id()));
        let lines = [
            r#"{"timestamp": 0, "input_length": 700, "output_length": 10, "hash_ids": [1, 2]}"#,
            r#"{"timestamp": 1, "input_length": 0, "hash_ids": [3]}"#,
            r#"{"timestamp": 2, "input_length": 100, "hash_ids": [1]}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let prompts = mooncake_prompts(&path, 600);
        std::fs::write(&path, "{}\n").unwrap();
        let empty = mooncake_prompts(&path, 600);
        std::fs::write(&path, "not json\n").unwrap();
        let broken = mooncake_prompts(&path, 600);
        let _ = std::fs::remove_file(&path);

        let prompts = prompts.unwrap();
        assert_eq!(prompts.len(), 2, "the request without tokens is skipped");
        assert_eq!(prompts[0].len(), 600);
        assert_eq!(prompts[1], prompts[0][..100]);
        assert!(matches!(empty, Err(TraceError::Empty { .. })));
        assert!(matches!(broken, Err(TraceError::Line { line: 1, .. })));
    }
}
