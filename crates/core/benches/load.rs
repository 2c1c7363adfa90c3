//! Load-tracker hot paths (SPEC §5) on a fleet of 1,000 ranks (250 workers × 4 DP ranks), each
//! already holding two 512-block bookings that share a 256-block system prompt fleet-wide.
//!
//! - `load_book_free_{64,2048}_blocks_1000_ranks`: book a prompt (system prompt + its own blocks)
//!   on one rank and free it again: the cost of one reservation's life, without lifecycle calls.
//! - `load_book_free_128_blocks_idle_rank_1000_ranks`: the same on a rank with no other booking
//!   (its state comes and goes with the booking).
//! - `load_book_free_fresh_128_blocks_32_live_1000_ranks`: book a prompt of new blocks and free
//!   the one booked 32 iterations before, as a closed loop of 32 clients does.
//! - `load_book_output_x16_free_2048_blocks_1000_ranks`: the same with 16 output blocks reported.
//! - `load_potential_decode_blocks_per_rank_1000_ranks_x_2048_blocks`: the single-rank query
//!   called for every rank, O(ranks × prompt).
//! - `load_potential_decode_batch_1000_ranks_x_2048_blocks`: the one-pass query
//!   (`potential_decode`) then an O(1) answer per rank, as `select` uses it.
// A bench reads the clock (the core's `now` arguments, its own timings).
#![allow(clippy::disallowed_methods)]

mod common;

use common::scaled;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_core::event::Rank;
use kvroute_core::load::{Booking, LoadTracker};

const WORKERS: u64 = 250;
const DP_SIZE: u32 = 4;
const BLOCK_SIZE: u32 = 16;
const SYSTEM_BLOCKS: u64 = 256;
const BOOKED_BLOCKS: u64 = 512;
const PROBE_BLOCKS: u64 = 2048;

/// The fleet's ranks (a tenth of them in a smoke run).
fn ranks() -> impl Iterator<Item = Rank> {
    (0..scaled(WORKERS, 25)).flat_map(|w| (0..DP_SIZE).map(move |d| Rank::new(w, d)))
}

/// A prompt: the shared system prompt, then `own` blocks from a private hash range.
fn prompt(own_start: u64, blocks: u64) -> Arc<[u64]> {
    (0..SYSTEM_BLOCKS)
        .chain(own_start..own_start + blocks.saturating_sub(SYSTEM_BLOCKS))
        .collect()
}

fn booking(id: String, rank: Rank, hashes: Arc<[u64]>) -> Booking {
    let isl_tokens = hashes.len() as u64 * u64::from(BLOCK_SIZE) + 5;
    Booking {
        reservation_id: id,
        rank,
        block_size: BLOCK_SIZE,
        sequence_hashes: hashes,
        isl_tokens,
        effective_prefill_tokens: isl_tokens,
        expected_output_tokens: Some(256),
        track_prefill_tokens: true,
    }
}

fn loaded_fleet(now: Instant) -> LoadTracker {
    let mut tracker = LoadTracker::new();
    for (i, rank) in ranks().enumerate() {
        for j in 0..2u64 {
            let n = i as u64 * 2 + j;
            let hashes = prompt(1_000_000 + n * BOOKED_BLOCKS, BOOKED_BLOCKS);
            if let Err(error) = tracker.book(booking(format!("fleet-{n}"), rank, hashes), now) {
                panic!("fleet booking refused: {error}");
            }
        }
    }
    tracker
}

fn bench_book_free(c: &mut Criterion) {
    let now = Instant::now();
    let mut tracker = loaded_fleet(now);
    let rank = Rank::new(7, 1);
    let mut group = c.benchmark_group("load");
    group.throughput(Throughput::Elements(1));
    for blocks in [64u64, 2048] {
        let hashes = prompt(900_000_000, blocks);
        group.bench_function(format!("load_book_free_{blocks}_blocks_1000_ranks"), |b| {
            b.iter(|| {
                let outcome = tracker.book(booking("bench".into(), rank, Arc::clone(&hashes)), now);
                black_box(&outcome);
                black_box(tracker.free("bench").is_ok())
            })
        });
    }
    // A rank with no other booking, as most ranks are in a fleet with fewer requests in flight
    // than ranks: its state is created by the booking and dropped by the free.
    let idle = Rank::new(WORKERS + 1, 0);
    let hashes = prompt(900_000_000, 128);
    group.bench_function("load_book_free_128_blocks_idle_rank_1000_ranks", |b| {
        b.iter(|| {
            let outcome = tracker.book(booking("bench".into(), idle, Arc::clone(&hashes)), now);
            black_box(&outcome);
            black_box(tracker.free("bench").is_ok())
        })
    });
    // A closed loop's pattern: each iteration books a prompt never seen before (its blocks are
    // new keys, scattered over the fleet's table) and frees the one booked 32 iterations ago.
    let mut live = std::collections::VecDeque::new();
    let mut serial = 0u64;
    group.bench_function("load_book_free_fresh_128_blocks_32_live_1000_ranks", |b| {
        b.iter(|| {
            serial += 1;
            let hashes: Arc<[u64]> = (0..128)
                .map(|k| (2_000_000_000 + serial * 128 + k).wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .collect();
            let id = format!("ring-{serial}");
            let rank = Rank::new(serial % WORKERS, 0);
            black_box(tracker.book(booking(id.clone(), rank, hashes), now).is_ok());
            live.push_back(id);
            if live.len() > 32
                && let Some(old) = live.pop_front()
            {
                black_box(tracker.free(&old).is_ok());
            }
        })
    });
    for id in live.drain(..) {
        black_box(tracker.free(&id).is_ok());
    }
    let hashes = prompt(900_000_000, 2048);
    group.bench_function("load_book_output_x16_free_2048_blocks_1000_ranks", |b| {
        b.iter(|| {
            let outcome = tracker.book(booking("bench".into(), rank, Arc::clone(&hashes)), now);
            black_box(&outcome);
            for i in 0..16 {
                let decay = (i == 8).then_some(0.5);
                black_box(tracker.output_block("bench", decay, now).is_ok());
            }
            black_box(tracker.free("bench").is_ok())
        })
    });
    group.finish();
}

fn bench_potential(c: &mut Criterion) {
    let now = Instant::now();
    let tracker = loaded_fleet(now);
    // Shares the system prompt with every rank and 256 more blocks with rank (0, 0)'s first
    // booking; the rest is new everywhere.
    let probe: Vec<u64> = (0..SYSTEM_BLOCKS)
        .chain(1_000_000..1_000_000 + 256)
        .chain(5_000_000_000..5_000_000_000 + PROBE_BLOCKS - SYSTEM_BLOCKS - 256)
        .collect();
    let isl = PROBE_BLOCKS * u64::from(BLOCK_SIZE) + 3;
    let all_ranks: Vec<Rank> = ranks().collect();

    let mut group = c.benchmark_group("load");
    group.throughput(Throughput::Elements(all_ranks.len() as u64));
    group.sample_size(20);
    group.bench_function(
        "load_potential_decode_blocks_per_rank_1000_ranks_x_2048_blocks",
        |b| {
            b.iter(|| {
                all_ranks
                    .iter()
                    .map(|&rank| tracker.potential_decode_blocks(rank, &probe, isl, BLOCK_SIZE))
                    .sum::<u64>()
            })
        },
    );
    group.sample_size(100);
    group.bench_function(
        "load_potential_decode_batch_1000_ranks_x_2048_blocks",
        |b| {
            b.iter(|| {
                let potential = tracker.potential_decode(&probe, isl, BLOCK_SIZE);
                all_ranks
                    .iter()
                    .map(|&rank| potential.blocks(rank))
                    .sum::<u64>()
            })
        },
    );
    group.finish();
}

criterion_group!(benches, bench_book_free, bench_potential);
criterion_main!(benches);
