//! Block hashing, compatible with Dynamo's KV router (SPEC §2).
//!
//! - A block is `block_size` consecutive `u32` tokens; only full blocks are hashed.
//! - `local_hash = xxh3_64_with_seed(tokens as little-endian u32 bytes, seed)`, `seed = 1337`
//!   unless a LoRA adapter name or a cache salt changes it ([`seed_for`]).
//! - `sequence_hash[0] = local_hash[0]`; `sequence_hash[i] = xxh3_64_with_seed(
//!   sequence_hash[i-1] LE ‖ local_hash[i] LE, 1337)`: a block together with all blocks before it.
//!
//! Two request options change what a block's local hash covers ([`BlockExtras`]), as Dynamo's
//! `compute_block_hash_for_seq` does:
//! - **Eagle** (`is_eagle`): block `i` hashes the `block_size + 1` tokens from `i * block_size`
//!   (its own and the next block's first), so a prompt of `n` tokens has `(n - 1) / block_size`
//!   blocks;
//! - **multimodal** (`block_mm_infos`): after a block's token bytes come the `mm_hash` of each
//!   multimodal object in it, sorted ascending, as `u64` LE; their token offsets are not hashed.
//!   A block without an entry (or past the end of the list) hashes its tokens alone.
//!
//! Both are checked against fixtures generated from Dynamo's own function
//! (`tests/dynamo_hashes.rs`). Hashing is linear in the prompt length; a 131,072-token prompt is
//! 512 KiB of input.

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

    /// The hash of a block with multimodal objects: its tokens, then the objects' `mm_hash`es
    /// sorted ascending, all little-endian. `bytes` and `mm_hashes` are scratch space reused
    /// from block to block.
    fn block_with_mm(
        &self,
        tokens: &[u32],
        info: &BlockMmInfo,
        bytes: &mut Vec<u8>,
        mm_hashes: &mut Vec<u64>,
    ) -> u64 {
        mm_hashes.clear();
        mm_hashes.extend(info.mm_objects.iter().map(|object| object.mm_hash));
        mm_hashes.sort_unstable();
        bytes.clear();
        bytes.reserve(4 * tokens.len() + 8 * mm_hashes.len());
        for token in tokens {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        for mm_hash in mm_hashes.iter() {
            bytes.extend_from_slice(&mm_hash.to_le_bytes());
        }
        self.hash(bytes)
    }
}

/// One multimodal object (an image, a video, ...) of a block, as Dynamo's `BlockMmObjectInfo`:
/// its hash and the token ranges it covers. Only `mm_hash` enters the block hash.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MmObject {
    pub mm_hash: u64,
    /// `[start, end)` token ranges; kept for callers, not hashed.
    pub offsets: Vec<(u64, u64)>,
}

/// The multimodal objects of one block, as Dynamo's `BlockExtraInfo`. No objects hashes like no
/// entry at all.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockMmInfo {
    pub mm_objects: Vec<MmObject>,
}

/// What enters a prompt's block hashes besides its tokens and seed: Dynamo's `is_eagle` and
/// `block_mm_infos` (module docs). The default is a plain prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockExtras<'a> {
    /// Each block's hash also covers the next token (Eagle speculative decoding).
    pub is_eagle: bool,
    /// Per block, its multimodal objects (`None`: none). Entries past the last block are
    /// ignored; blocks past the last entry have none.
    pub block_mm_infos: &'a [Option<BlockMmInfo>],
}

impl BlockExtras<'_> {
    /// No Eagle window and no multimodal entries: blocks hash their tokens alone.
    pub fn is_plain(&self) -> bool {
        !self.is_eagle && self.block_mm_infos.is_empty()
    }
}

/// The number of blocks a prompt of `tokens` tokens hashes: `tokens / block_size`, or with
/// Eagle `(tokens - 1) / block_size` (the last block needs one token after it). 0 for
/// `block_size == 0`.
pub fn block_count(tokens: usize, block_size: usize, is_eagle: bool) -> usize {
    let window = block_size + usize::from(is_eagle);
    if block_size == 0 || tokens < window {
        return 0;
    }
    (tokens - window) / block_size + 1
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

/// Local hashes of a prompt's blocks with Eagle and multimodal options (module docs); equals
/// [`local_hashes`] for [`BlockExtras::default`], and takes its path (no allocation per block)
/// whenever the extras are plain. Returns an empty vector for `block_size == 0`.
pub fn local_hashes_with(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    extras: BlockExtras<'_>,
) -> Vec<u64> {
    if extras.is_plain() {
        return local_hashes(tokens, block_size, seed);
    }
    let count = block_count(tokens.len(), block_size, extras.is_eagle);
    let window = block_size + usize::from(extras.is_eagle);
    Seeded::with(seed, |seeded| {
        let mut bytes = Vec::new();
        let mut mm_hashes = Vec::new();
        (0..count)
            .map_while(|i| {
                let block = tokens.get(i * block_size..i * block_size + window)?;
                Some(match extras.block_mm_infos.get(i) {
                    Some(Some(info)) if !info.mm_objects.is_empty() => {
                        seeded.block_with_mm(block, info, &mut bytes, &mut mm_hashes)
                    }
                    _ => seeded.block(block),
                })
            })
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
        Self::from_tokens_with(tokens, block_size, seed, BlockExtras::default())
    }

    /// Hashes a token prompt with Eagle and multimodal options ([`local_hashes_with`]).
    pub fn from_tokens_with(
        tokens: &[u32],
        block_size: usize,
        seed: u64,
        extras: BlockExtras<'_>,
    ) -> Self {
        let local = local_hashes_with(tokens, block_size, seed, extras);
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

    fn mm(hashes: &[u64]) -> Option<BlockMmInfo> {
        Some(BlockMmInfo {
            mm_objects: hashes
                .iter()
                .map(|&mm_hash| MmObject {
                    mm_hash,
                    offsets: vec![(0, 1)],
                })
                .collect(),
        })
    }

    /// The reference model of [`local_hashes_with`]: every block's bytes built from scratch.
    fn reference(
        tokens: &[u32],
        block_size: usize,
        seed: u64,
        is_eagle: bool,
        infos: &[Option<BlockMmInfo>],
    ) -> Vec<u64> {
        let window = block_size + usize::from(is_eagle);
        let mut out = Vec::new();
        let mut start = 0;
        while block_size > 0 && start + window <= tokens.len() {
            let mut bytes: Vec<u8> = tokens[start..start + window]
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect();
            if let Some(Some(info)) = infos.get(out.len()) {
                let mut hashes: Vec<u64> = info.mm_objects.iter().map(|o| o.mm_hash).collect();
                hashes.sort();
                bytes.extend(hashes.iter().flat_map(|h| h.to_le_bytes()));
            }
            out.push(xxh3_64_with_seed(&bytes, seed));
            start += block_size;
        }
        out
    }

    #[test]
    fn eagle_blocks_cover_the_next_token() {
        let tokens = tokens_1_to_17();
        let extras = BlockExtras {
            is_eagle: true,
            block_mm_infos: &[],
        };
        let local = local_hashes_with(&tokens, 4, BASE_SEED, extras);
        assert_eq!(local.len(), 4);
        assert_eq!(local[0], block_hash(&tokens[0..5], BASE_SEED));
        assert_eq!(local[3], block_hash(&tokens[12..17], BASE_SEED));
        // Sixteen tokens leave the last block without its next token.
        assert_eq!(
            local_hashes_with(&tokens[..16], 4, BASE_SEED, extras).len(),
            3
        );
        assert_eq!(block_count(16, 4, true), 3);
        assert_eq!(block_count(17, 4, true), 4);
        assert_eq!(block_count(4, 4, true), 0);
        assert_eq!(block_count(17, 4, false), 4);
        assert_eq!(block_count(17, 0, true), 0);
    }

    #[test]
    fn multimodal_hashes_follow_the_tokens_sorted_and_offsets_do_not_count() {
        let tokens = tokens_1_to_17();
        let infos = [None, mm(&[9, 3, 9]), Some(BlockMmInfo::default())];
        let extras = BlockExtras {
            is_eagle: false,
            block_mm_infos: &infos,
        };
        let local = local_hashes_with(&tokens, 4, BASE_SEED, extras);
        let plain = local_hashes(&tokens, 4, BASE_SEED);
        assert_eq!(local[0], plain[0]);
        let mut bytes: Vec<u8> = tokens[4..8].iter().flat_map(|t| t.to_le_bytes()).collect();
        for h in [3u64, 9, 9] {
            bytes.extend_from_slice(&h.to_le_bytes());
        }
        assert_eq!(local[1], xxh3_64_with_seed(&bytes, BASE_SEED));
        // No objects, and blocks past the list, hash their tokens alone.
        assert_eq!(&local[2..], &plain[2..]);
        // Order and offsets of the objects do not matter.
        let mut reordered = mm(&[9, 9, 3]);
        if let Some(info) = reordered.as_mut() {
            info.mm_objects[0].offsets = vec![(5, 70), (1, 2)];
        }
        let infos = [None, reordered];
        let again = local_hashes_with(
            &tokens,
            4,
            BASE_SEED,
            BlockExtras {
                is_eagle: false,
                block_mm_infos: &infos,
            },
        );
        assert_eq!(again, local);
        // A plain prompt takes the plain path.
        assert_eq!(
            PromptHashes::from_tokens_with(&tokens, 4, BASE_SEED, BlockExtras::default()),
            PromptHashes::from_tokens(&tokens, 4, BASE_SEED)
        );
    }

    proptest::proptest! {
        #[test]
        fn local_hashes_with_equals_the_reference_model(
            tokens in proptest::collection::vec(proptest::prelude::any::<u32>(), 0..80),
            block_size in 1usize..9,
            is_eagle in proptest::prelude::any::<bool>(),
            salted in proptest::prelude::any::<bool>(),
            infos in proptest::collection::vec(
                proptest::option::of(proptest::collection::vec(proptest::prelude::any::<u64>(), 0..4)),
                0..12,
            ),
        ) {
            let infos: Vec<Option<BlockMmInfo>> =
                infos.iter().map(|i| i.as_deref().and_then(mm)).collect();
            let seed = if salted { seed_for(Some("lora"), Some("salt")) } else { BASE_SEED };
            let extras = BlockExtras { is_eagle, block_mm_infos: &infos };
            let local = local_hashes_with(&tokens, block_size, seed, extras);
            proptest::prop_assert_eq!(
                &local,
                &reference(&tokens, block_size, seed, is_eagle, &infos)
            );
            proptest::prop_assert_eq!(local.len(), block_count(tokens.len(), block_size, is_eagle));
        }
    }

    #[test]
    fn continuing_a_chain_equals_hashing_the_whole_prompt() {
        let local = local_hashes(&(0..64).collect::<Vec<u32>>(), 4, BASE_SEED);
        let whole = sequence_hashes(&local);
        let tail = sequence_hashes_from(Some(whole[7]), &local[8..]);
        assert_eq!(&whole[8..], &tail[..]);
    }
}
