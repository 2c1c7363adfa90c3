//! Prompt hashing (SPEC §2) for an 8,192-token prompt in blocks of 64 (the side-by-side
//! benchmark's mean prompt), as every `select` and every stored KV-event block pays it.
//!
//! - `hash_local_8192_tokens_block_64`: [`local_hashes`], whose 256-byte blocks take XXH3's long
//!   path with the seed's secret derived once per prompt (once at compile time for the base seed).
//! - `hash_local_8192_tokens_block_64_seed_per_block`: the same hashes with `xxh3_64_with_seed`
//!   per block, which derives the secret again for each one; the reference in the same run.
//! - `hash_prompt_8192_tokens_block_64`: local and sequence hashes together
//!   ([`PromptHashes::from_tokens`]).
//! - `hash_local_8192_tokens_block_64_eagle_mm_every_4th_block`: [`local_hashes_with`] for an
//!   Eagle prompt with two multimodal objects in every fourth block (the bytes of such a block
//!   are copied into a reused buffer; the others hash in place).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_core::hash::{
    BASE_SEED, BlockExtras, BlockMmInfo, MmObject, PromptHashes, local_hashes, local_hashes_with,
};
use xxhash_rust::xxh3::xxh3_64_with_seed;

const TOKENS: usize = 8192;
const BLOCK_SIZE: usize = 64;

fn bench_hash(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..TOKENS as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 152_064)
        .collect();
    let mut group = c.benchmark_group("hash");
    group.throughput(Throughput::Bytes((TOKENS * 4) as u64));
    group.bench_function("hash_local_8192_tokens_block_64", |b| {
        b.iter(|| black_box(local_hashes(black_box(&tokens), BLOCK_SIZE, BASE_SEED)))
    });
    group.bench_function("hash_local_8192_tokens_block_64_seed_per_block", |b| {
        b.iter(|| {
            let hashes: Vec<u64> = black_box(&tokens)
                .chunks_exact(BLOCK_SIZE)
                .map(|block| xxh3_64_with_seed(bytemuck::cast_slice(block), BASE_SEED))
                .collect();
            black_box(hashes)
        })
    });
    group.bench_function("hash_prompt_8192_tokens_block_64", |b| {
        b.iter(|| {
            black_box(PromptHashes::from_tokens(
                black_box(&tokens),
                BLOCK_SIZE,
                BASE_SEED,
            ))
        })
    });
    let infos: Vec<Option<BlockMmInfo>> = (0..TOKENS / BLOCK_SIZE)
        .map(|i| {
            (i % 4 == 0).then(|| BlockMmInfo {
                mm_objects: [i as u64 * 7 + 1, i as u64]
                    .into_iter()
                    .map(|mm_hash| MmObject {
                        mm_hash,
                        offsets: vec![(0, BLOCK_SIZE as u64)],
                    })
                    .collect(),
            })
        })
        .collect();
    let extras = BlockExtras {
        is_eagle: true,
        block_mm_infos: &infos,
    };
    group.bench_function(
        "hash_local_8192_tokens_block_64_eagle_mm_every_4th_block",
        |b| {
            b.iter(|| {
                black_box(local_hashes_with(
                    black_box(&tokens),
                    BLOCK_SIZE,
                    BASE_SEED,
                    extras,
                ))
            })
        },
    );
    group.finish();
}

criterion_group!(benches, bench_hash);
criterion_main!(benches);
