//! Prompt hashing (SPEC §2) for an 8,192-token prompt in blocks of 64 (the side-by-side
//! benchmark's mean prompt), as every `select` and every stored KV-event block pays it.
//!
//! - `hash_local_8192_tokens_block_64`: [`local_hashes`], whose 256-byte blocks take XXH3's long
//!   path with the seed's secret derived once per prompt (once at compile time for the base seed).
//! - `hash_local_8192_tokens_block_64_seed_per_block`: the same hashes with `xxh3_64_with_seed`
//!   per block, which derives the secret again for each one; the reference in the same run.
//! - `hash_prompt_8192_tokens_block_64`: local and sequence hashes together
//!   ([`PromptHashes::from_tokens`]).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_core::hash::{BASE_SEED, PromptHashes, local_hashes};
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
    group.finish();
}

criterion_group!(benches, bench_hash);
criterion_main!(benches);
