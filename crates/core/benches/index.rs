//! Index benches: hashing a 128k-token prompt, `find_matches` for a 2,048-block prompt against
//! 8 / 64 / 1,000 ranks (each holding a random-length prefix of it plus unrelated chains from the
//! Mooncake conversation trace), and applying `Stored` events from the same trace.
//! Besides criterion's figures it prints lookup p50/p99 over 2,000 timed lookups and the index's
//! bytes per (block, rank) pair.
#![allow(clippy::unwrap_used, clippy::expect_used)]
// A bench reads the clock (the core's `now` arguments, its own timings).
#![allow(clippy::disallowed_methods)]

mod common;

// The allocator the kvroute binary uses.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use common::{BLOCK_SIZE, churn_events, fleet_events, scaled, store_event, trace_prompts};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_core::event::{KvEvent, Rank};
use kvroute_core::hash::{BASE_SEED, PromptHashes, local_hashes, sequence_hashes};
use kvroute_core::index::RadixIndex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::hint::black_box;
use std::time::Instant;

const PROMPT_TOKENS: usize = 131_072;
const PROMPT_BLOCKS: usize = PROMPT_TOKENS / BLOCK_SIZE;

fn long_prompt() -> Vec<u32> {
    (0..PROMPT_TOKENS as u32)
        .map(|t| t.wrapping_mul(2_654_435_761) % 150_000)
        .collect()
}

fn bench_hashing(c: &mut Criterion) {
    let tokens = long_prompt();
    let mut group = c.benchmark_group("hash");
    group.throughput(Throughput::Bytes((PROMPT_TOKENS * 4) as u64));
    group.bench_function("hash_131072_tokens_block_64", |b| {
        b.iter(|| PromptHashes::from_tokens(black_box(&tokens), BLOCK_SIZE, BASE_SEED))
    });
    group.finish();
}

/// An index where `ranks` ranks each hold a random-length prefix of the long prompt, plus the
/// trace's requests dealt over them.
fn fleet_with_prompt(ranks: u64, prompts: &[Vec<u64>], query_local: &[u64]) -> RadixIndex {
    let mut index = RadixIndex::default();
    for (rank, event) in fleet_events(ranks, prompts) {
        index.apply(rank, &event);
    }
    let mut rng = SmallRng::seed_from_u64(7);
    for r in 0..ranks {
        let len = rng.random_range(0..=query_local.len());
        let mut held = HashSet::new();
        if let Some(event) = store_event(&mut held, &query_local[..len]) {
            index.apply(Rank::new(r, 0), &event);
        }
    }
    index
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn bench_find_matches(c: &mut Criterion) {
    let prompts = trace_prompts(usize::MAX);
    let query_local = local_hashes(&long_prompt(), BLOCK_SIZE, BASE_SEED);
    assert_eq!(query_local.len(), PROMPT_BLOCKS);
    let query = sequence_hashes(&query_local);
    let mut group = c.benchmark_group("find_matches");
    for ranks in [8u64, 64, scaled(1000, 100)] {
        let index = fleet_with_prompt(ranks, &prompts, &query_local);
        let mut samples: Vec<f64> = (0..scaled(2000, 20))
            .map(|_| {
                let start = Instant::now();
                black_box(index.find_matches(black_box(&query)));
                start.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        samples.sort_by(f64::total_cmp);
        let pairs = index.held_pairs();
        println!(
            "find_matches_2048_blocks_x_{ranks}_ranks: p50 {:.1} us, p99 {:.1} us; index {} blocks, {} (block, rank) pairs, {:.1} MiB, {:.1} bytes/pair",
            percentile(&samples, 0.5),
            percentile(&samples, 0.99),
            index.block_count(),
            pairs,
            index.memory_bytes() as f64 / (1 << 20) as f64,
            index.memory_bytes() as f64 / pairs as f64
        );
        group.bench_with_input(
            BenchmarkId::new("find_matches_2048_blocks", format!("{ranks}_ranks")),
            &index,
            |b, index| b.iter(|| index.find_matches(black_box(&query))),
        );
    }
    group.finish();
}

/// Blocks stored or removed by the events.
fn event_blocks(events: &[(Rank, KvEvent)]) -> usize {
    events.iter().map(|(_, e)| e.blocks()).sum()
}

/// A new index with the events applied in order.
fn fresh_index_with(events: &[(Rank, KvEvent)]) -> RadixIndex {
    let mut index = RadixIndex::default();
    for (rank, event) in events {
        index.apply(*rank, event);
    }
    index
}

fn bench_apply_stored(c: &mut Criterion) {
    let prompts = trace_prompts(usize::MAX);
    let mut group = c.benchmark_group("apply");
    group.sample_size(10);
    for ranks in [64u64, scaled(1000, 100)] {
        let events = fleet_events(ranks, &prompts);
        let blocks = event_blocks(&events);
        group.throughput(Throughput::Elements(blocks as u64));
        group.bench_function(
            BenchmarkId::new(
                "apply_stored_mooncake_trace",
                format!("{ranks}_ranks_{blocks}_blocks"),
            ),
            |b| b.iter(|| fresh_index_with(&events)),
        );
    }
    group.finish();
}

/// The same fleet's blocks stored, then removed again, each `Stored` event answered by a
/// `Removed` of its blocks in store order (as a full engine evicts): the removals' share is this
/// bench's time less `apply_stored_mooncake_trace`'s.
fn bench_apply_stored_then_removed(c: &mut Criterion) {
    let prompts = trace_prompts(usize::MAX);
    let mut group = c.benchmark_group("apply");
    group.sample_size(10);
    let ranks = 64u64;
    let events = fleet_events(ranks, &prompts);
    let removals: Vec<(Rank, KvEvent)> = events
        .iter()
        .filter_map(|(rank, e)| match e {
            KvEvent::Stored { blocks, tier, .. } => Some((
                *rank,
                KvEvent::Removed {
                    engine_hashes: blocks.iter().map(|b| b.engine_hash).collect(),
                    tier: *tier,
                },
            )),
            _ => None,
        })
        .collect();
    let blocks = event_blocks(&removals);
    group.throughput(Throughput::Elements(blocks as u64));
    group.bench_function(
        BenchmarkId::new(
            "apply_stored_then_removed_mooncake_trace",
            format!("{ranks}_ranks_{blocks}_blocks"),
        ),
        |b| {
            b.iter(|| {
                let mut index = fresh_index_with(&events);
                for (rank, event) in &removals {
                    index.apply(*rank, event);
                }
                assert_eq!(index.block_count(), 0, "every block was removed");
                index
            })
        },
    );
    group.finish();
}

/// Engines at capacity (64 ranks of 16,384 blocks, as in the side-by-side's cycle runs): the
/// stores and evictions of a second pass over the trace, applied to an index the first pass
/// filled. Prints ns per stored or removed block over the timed part (best of three).
fn bench_apply_churn(c: &mut Criterion) {
    let prompts = trace_prompts(usize::MAX);
    let ranks = 64u64;
    let capacity = scaled(16_384, 256);
    let events = churn_events(ranks, capacity, &prompts, 2);
    let (fill, churn) = events.split_at(events.len() / 2);
    let blocks = event_blocks(churn);
    let mut best = f64::MAX;
    for _ in 0..scaled(3, 1) {
        let mut index = fresh_index_with(fill);
        let start = Instant::now();
        for (rank, event) in churn {
            index.apply(*rank, event);
        }
        best = best.min(start.elapsed().as_secs_f64() * 1e9 / blocks as f64);
        black_box(&index);
    }
    println!(
        "apply_churn_{ranks}_ranks_{capacity}_blocks_each: {best:.1} ns per stored or removed block ({blocks} blocks, {} events)",
        churn.len()
    );
    let mut group = c.benchmark_group("apply");
    group.sample_size(10);
    group.throughput(Throughput::Elements(event_blocks(&events) as u64));
    group.bench_function(
        BenchmarkId::new(
            "apply_churn_mooncake_trace_two_passes",
            format!("{ranks}_ranks_{capacity}_blocks_each"),
        ),
        |b| b.iter(|| fresh_index_with(&events)),
    );
    group.finish();
}

criterion_group!(
    benches,
    bench_hashing,
    bench_find_matches,
    bench_apply_stored,
    bench_apply_stored_then_removed,
    bench_apply_churn
);
criterion_main!(benches);
