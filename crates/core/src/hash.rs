//! Block hashing, compatible with Dynamo's KV router (SPEC §2).
//!
//! - A block is `block_size` consecutive `u32` tokens; only full blocks are hashed.
//! - `local_hash = xxh3_64_with_seed(tokens as little-endian u32 bytes, seed)`, `seed = 1337`
//!   unless a LoRA adapter name or a cache salt changes it ([`seed_for`]).
//! - `sequence_hash[0] = local_hash[0]`; `sequence_hash[i] = xxh3_64_with_seed(
//!   sequence_hash[i-1] LE ‖ local_hash[i] LE, 1337)`: a block together with all blocks before it.
//!
//! Hashing is linear in the prompt length; a 131,072-token prompt is 512 KiB of input.

use xxhash_rust::const_xxh3::const_custom_default_secret;
use xxhash_rust::xxh3::{xxh3_64_with_secret, xxh3_64_with_seed};

/// The seed of every hash when no LoRA adapter and no cache salt apply.
pub const BASE_SEED: u64 = 1337;

/// The local-hash seed for a LoRA adapter name and/or a cache salt. Empty strings count as absent.
pub fn seed_for(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut seed = BASE_SEED;
    if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
    }
    if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
    }
    seed
}

/// Inputs longer than this take XXH3's long path, where a seed only selects a secret derived
/// from it: hashing with that secret gives the seeded hash without deriving it on every call.
const XXH3_MID_SIZE_MAX: usize = 240;

/// The secret XXH3 derives from [`BASE_SEED`], derived once at compile time.
const BASE_SECRET: [u8; 192] = const_custom_default_secret(BASE_SEED);

/// A seed ready for many hashes: `xxh3_64_with_seed` for any input, with the long path's
/// secret derived once.
struct Seeded {
    seed: u64,
    secret: [u8; 192],
}

impl Seeded {
    fn new(seed: u64) -> Self {
        Self {
            seed,
            secret: const_custom_default_secret(seed),
        }
    }

    /// Runs `f` with `seed` ready: the compile-time one for [`BASE_SEED`], else derived now.
    fn with<R>(seed: u64, f: impl FnOnce(&Seeded) -> R) -> R {
        if seed == BASE_SEED {
            f(&BASE_SEEDED)
        } else {
            f(&Seeded::new(seed))
        }
    }

    /// Equals `xxh3_64_with_seed(bytes, self.seed)`.
    fn hash(&self, bytes: &[u8]) -> u64 {
        if bytes.len() > XXH3_MID_SIZE_MAX {
            xxh3_64_with_secret(bytes, &self.secret)
        } else {
            xxh3_64_with_seed(bytes, self.seed)
        }
    }

    fn block(&self, tokens: &[u32]) -> u64 {
        #[cfg(target_endian = "little")]
        {
            // On little-endian machines the in-memory bytes of the tokens are their LE encoding.
            self.hash(bytemuck::cast_slice(tokens))
        }
        #[cfg(not(target_endian = "little"))]
        {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            self.hash(&bytes)
        }
    }
}

/// Hash of one block of tokens with the given seed.
pub fn block_hash(tokens: &[u32], seed: u64) -> u64 {
    Seeded::with(seed, |seeded| seeded.block(tokens))
}

static BASE_SEEDED: Seeded = Seeded {
    seed: BASE_SEED,
    secret: BASE_SECRET,
};

/// Local hashes of every full block of `tokens`. Returns an empty vector for `block_size == 0`.
pub fn local_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    Seeded::with(seed, |seeded| {
        tokens
            .chunks_exact(block_size)
            .map(|block| seeded.block(block))
            .collect()
    })
}

/// Chains one block's local hash onto the sequence hash of everything before it.
pub fn chain(previous_sequence_hash: u64, local_hash: u64) -> u64 {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&previous_sequence_hash.to_le_bytes());
    bytes[8..].copy_from_slice(&local_hash.to_le_bytes());
    xxh3_64_with_seed(&bytes, BASE_SEED)
}

/// Sequence hashes for a run of local hashes that starts at the first block of a prompt.
pub fn sequence_hashes(local_hashes: &[u64]) -> Vec<u64> {
    sequence_hashes_from(None, local_hashes)
}

/// Sequence hashes for local hashes that continue after a block whose sequence hash is `parent`
/// (or start the prompt when `parent` is `None`).
pub fn sequence_hashes_from(parent: Option<u64>, local_hashes: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(local_hashes.len());
    let mut previous = parent;
    for &local in local_hashes {
        let sequence = match previous {
            None => local,
            Some(p) => chain(p, local),
        };
        out.push(sequence);
        previous = Some(sequence);
    }
    out
}

/// A prompt reduced to what routing needs: its full-block hashes and its length in tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptHashes {
    /// Local hash of each full block.
    pub local: Vec<u64>,
    /// Sequence hash of each full block.
    pub sequence: Vec<u64>,
    /// Prompt length in tokens, including a trailing partial block.
    pub isl_tokens: u64,
}

impl PromptHashes {
    /// Hashes a token prompt.
    pub fn from_tokens(tokens: &[u32], block_size: usize, seed: u64) -> Self {
        let local = local_hashes(tokens, block_size, seed);
        let sequence = sequence_hashes(&local);
        Self {
            local,
            sequence,
            isl_tokens: tokens.len() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens_1_to_17() -> Vec<u32> {
        (1..=17).collect()
    }

    #[test]
    fn seeded_hashes_equal_xxh3_with_seed_on_every_path() {
        // Lengths around each of XXH3's size classes (0-16, 17-128, 129-240, long), seeds
        // including 0, the base seed and LoRA/salt-derived ones.
        let bytes: Vec<u8> = (0..2000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let seeds = [
            0,
            1,
            BASE_SEED,
            seed_for(Some("adapter"), None),
            seed_for(None, Some("salt")),
            u64::MAX,
        ];
        for seed in seeds {
            let seeded = Seeded::new(seed);
            for len in (0..=300).chain([511, 512, 1024, 1025, 2000]) {
                assert_eq!(
                    seeded.hash(&bytes[..len]),
                    xxh3_64_with_seed(&bytes[..len], seed),
                    "seed {seed}, {len} bytes"
                );
            }
        }
        let tokens: Vec<u32> = (0..512).map(|i| i * 7919).collect();
        for block_size in [1, 16, 60, 61, 64, 128] {
            for seed in seeds {
                let expected: Vec<u64> = tokens
                    .chunks_exact(block_size)
                    .map(|block| xxh3_64_with_seed(bytemuck::cast_slice(block), seed))
                    .collect();
                assert_eq!(local_hashes(&tokens, block_size, seed), expected);
                assert_eq!(block_hash(&tokens[..block_size], seed), expected[0]);
            }
        }
    }

    #[test]
    fn local_hashes_match_dynamo_vectors() {
        let local = local_hashes(&tokens_1_to_17(), 4, BASE_SEED);
        assert_eq!(
            local,
            vec![
                14643705804678351452,
                16777012769546811212,
                483935686894639516,
                135165725823939817
            ]
        );
    }

    #[test]
    fn sequence_hashes_match_dynamo_vectors() {
        let local = local_hashes(&tokens_1_to_17(), 4, BASE_SEED);
        let sequence: Vec<i64> = sequence_hashes(&local)
            .into_iter()
            .map(|h| h as i64)
            .collect();
        assert_eq!(
            sequence,
            vec![
                -3803038269031200164,
                4945711292740353085,
                -5863151826378895484,
                1921452330601040443
            ]
        );
    }

    #[test]
    fn lora_and_salt_change_the_seed_as_dynamo_does() {
        let tokens = tokens_1_to_17();
        let lora = local_hashes(&tokens, 4, seed_for(Some("adapter-a"), None));
        assert_eq!(&lora[..2], &[11381080598872079209, 5698110331184095209]);
        let salt = local_hashes(&tokens, 4, seed_for(None, Some("salt-1")));
        assert_eq!(&salt[..2], &[914885034549397476, 3069815956657004924]);
        assert_eq!(seed_for(Some(""), Some("")), BASE_SEED);
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert_eq!(local_hashes(&[1, 2, 3], 4, BASE_SEED).len(), 0);
        assert_eq!(local_hashes(&tokens_1_to_17(), 0, BASE_SEED).len(), 0);
        let p = PromptHashes::from_tokens(&tokens_1_to_17(), 16, BASE_SEED);
        assert_eq!(p.local.len(), 1);
        assert_eq!(p.isl_tokens, 17);
    }

    #[test]
    fn block_hash_hashes_little_endian_token_bytes() {
        let tokens: Vec<u32> = (0..1000).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(
            block_hash(&tokens, BASE_SEED),
            xxh3_64_with_seed(&bytes, BASE_SEED)
        );
    }

    #[test]
    fn continuing_a_chain_equals_hashing_the_whole_prompt() {
        let local = local_hashes(&(0..64).collect::<Vec<u32>>(), 4, BASE_SEED);
        let whole = sequence_hashes(&local);
        let tail = sequence_hashes_from(Some(whole[7]), &local[8..]);
        assert_eq!(&whole[8..], &tail[..]);
    }
}
