//! The prompts a run sends: from a Mooncake trace ([`kvroute_testkit::trace`]) or a synthetic
//! shared-prefix set, and what is computed from them once before the run so that the loop
//! measures the server, not the client: each select body's token array, pre-rendered, and each
//! prompt's block hashes and packed ids for the fake engines.

use kvroute_core::hash::{BASE_SEED, PromptHashes};
use kvroute_wire::PackedTokens;
use std::path::Path;

/// The prompts of `--trace`, else the synthetic set, each cut to `cap` tokens.
pub fn load(trace: Option<&Path>, cap: usize) -> Result<Vec<Vec<u32>>, String> {
    match trace {
        Some(path) => {
            kvroute_testkit::trace::mooncake_prompts(path, cap).map_err(|e| e.to_string())
        }
        None => Ok(synthetic_prompts(cap)),
    }
}

/// 64 groups sharing a 2,048-token system prompt, each request adding 512 tokens of its own.
fn synthetic_prompts(cap: usize) -> Vec<Vec<u32>> {
    (0..1024u32)
        .map(|i| {
            let group = i % 64;
            let mut t: Vec<u32> = (0..2048).map(|k| group * 100_000 + k).collect();
            t.extend((0..512).map(|k| 10_000_000 + i * 1000 + k));
            t.truncate(cap);
            t
        })
        .collect()
}

/// What [`prepare`] makes of each prompt, in prompt order.
#[derive(Default)]
pub struct PreparedPrompts {
    /// The select body's token array and closing brace.
    pub bodies: Vec<String>,
    /// The engines' block hashes.
    pub sequences: Vec<Vec<u64>>,
    /// The ids packed for the fake engines' events (empty when there are no engines).
    pub packed: Vec<PackedTokens>,
}

/// A prompt's select-body tail, its block hashes and its packed ids (when asked for).
type Prepared = (String, Vec<u64>, Option<PackedTokens>);

/// Each prompt's select-body tail (its token array and the closing brace), its block hashes and,
/// with `pack`, its packed ids, in prompt order, prepared on all available cores (a trace's
/// ~100 M tokens take seconds on one).
pub fn prepare(
    prompts: &[Vec<u32>],
    block_size: usize,
    pack: bool,
) -> Result<PreparedPrompts, String> {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, 8);
    let chunk = prompts.len().div_ceil(threads).max(1);
    let prepare = |part: &[Vec<u32>]| -> Vec<Prepared> {
        part.iter()
            .map(|p| {
                let hashes = PromptHashes::from_tokens(p, block_size, BASE_SEED).sequence;
                let packed = pack.then(|| PackedTokens::new(p, block_size as u32));
                (token_array_tail(p), hashes, packed)
            })
            .collect()
    };
    let parts: Result<Vec<Vec<Prepared>>, String> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .chunks(chunk)
            .map(|part| scope.spawn(move || prepare(part)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| "preparing the prompts failed".to_string())
            })
            .collect()
    });
    let mut prepared = PreparedPrompts::default();
    for (body, hashes, packed) in parts?.into_iter().flatten() {
        prepared.bodies.push(body);
        prepared.sequences.push(hashes);
        prepared.packed.extend(packed);
    }
    Ok(prepared)
}

/// `[1,2,3]}`: a prompt's token ids as a JSON array, and the brace that closes the body.
fn token_array_tail(tokens: &[u32]) -> String {
    // Vocabulary ids have at most six digits; one more byte for the comma.
    let mut out = String::with_capacity(tokens.len() * 7 + 3);
    let mut digits = itoa::Buffer::new();
    out.push('[');
    for (k, &token) in tokens.iter().enumerate() {
        if k > 0 {
            out.push(',');
        }
        out.push_str(digits.format(token));
    }
    out.push_str("]}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepared_prompts_match_serde_and_the_hashes() {
        let prompts: Vec<Vec<u32>> = (0..37u32)
            .map(|i| {
                (0..(i * 29) % 300)
                    .map(|t| t.wrapping_mul(2_654_435_761) >> (t % 32))
                    .collect()
            })
            .filter(|p: &Vec<u32>| !p.is_empty())
            .collect();
        let prepared = prepare(&prompts, 16, true).unwrap();
        assert_eq!(prepared.bodies.len(), prompts.len());
        assert_eq!(prepared.packed.len(), prompts.len());
        for (i, p) in prompts.iter().enumerate() {
            let body = &prepared.bodies[i];
            assert_eq!(body, &(serde_json::to_string(p).unwrap() + "}"));
            let expected = PromptHashes::from_tokens(p, 16, BASE_SEED).sequence;
            assert_eq!(prepared.sequences[i], expected);
            assert_eq!(prepared.packed[i].len(), p.len());
        }
        assert!(prepare(&prompts, 16, false).unwrap().packed.is_empty());
        assert_eq!(token_array_tail(&[0, 4_294_967_295]), "[0,4294967295]}");
    }
}
