//! Approximate cache model hot paths (SPEC §9) on a fleet of 1,000 ranks (250 workers × 4 DP
//! ranks). Prompts are 64 blocks: one of 16 shared 32-block system prompts, then 32 blocks of
//! their own. Hashes are computed up front; the benches time the models only.
//!
//! - `lru_acquire_release_64_blocks_1000_ranks_2000_block_pools`: every pool starts full of cached
//!   blocks and keeps 4 leases in flight; one iteration releases a rank's oldest lease and acquires
//!   a new prompt in its place (prefix hits, new copies, evictions): one booking's life.
//! - `lru_acquire_release_64_blocks_1_rank_2000_block_pool`: the same on a single rank cycling
//!   256 prompts, so the pool stays in the CPU cache: the model's own cost.
//! - `lru_materialize_1000_ranks_2000_block_pools`: one output block on a full pool (an eviction).
//! - `lru_release_burst_10k_leases_100_ranks_over_capacity`: 100 ranks of 2,000 blocks each hold
//!   100 live leases (3,232 active blocks, over capacity); all 10,000 are released back to back,
//!   each release evicting down to capacity. Reported per release.
//! - `ttl_insert_expire_64_blocks_1000_ranks`: insert a prompt on a rank of a partition holding
//!   ~130k predicted blocks and expire what ran out, with time advancing 10 ms per insert.
// A bench reads the clock (the core's `now` arguments, its own timings).
#![allow(clippy::disallowed_methods)]

mod common;

use common::scaled;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_core::approx::{LruConfig, LruModel, TtlConfig, TtlModel};
use kvroute_core::event::Rank;
use kvroute_core::hash::sequence_hashes;

const WORKERS: u64 = 250;
const DP_SIZE: u32 = 4;
const POOL_BLOCKS: u64 = 2_000;
const SYSTEM_PROMPTS: u64 = 16;
const SYSTEM_BLOCKS: u64 = 32;
const OWN_BLOCKS: u64 = 32;
const IN_FLIGHT: usize = 4;

/// The fleet's ranks (a tenth of them in a smoke run).
fn ranks() -> Vec<Rank> {
    (0..scaled(WORKERS, 25))
        .flat_map(|w| (0..DP_SIZE).map(move |d| Rank::new(w, d)))
        .collect()
}

struct Prompt {
    local: Vec<u64>,
    seq: Vec<u64>,
}

/// Prompt `n`: system prompt `n % 16`, then 32 blocks unique to `n`.
fn prompt(n: u64) -> Prompt {
    let system = n % SYSTEM_PROMPTS;
    let local: Vec<u64> = (0..SYSTEM_BLOCKS)
        .map(|i| system * 1_000 + i)
        .chain((0..OWN_BLOCKS).map(|i| 1_000_000 + n * 100 + i))
        .collect();
    let seq = sequence_hashes(&local);
    Prompt { local, seq }
}

fn lease_id(rank_index: usize, slot: usize) -> String {
    format!("rank-{rank_index}-slot-{slot}")
}

/// 1,000 full pools, each with `IN_FLIGHT` live leases in slots `0..IN_FLIGHT`.
fn full_fleet(prompts: &[Prompt], now: Instant) -> (LruModel, Vec<Rank>) {
    let ranks = ranks();
    let mut model = LruModel::new(LruConfig::default());
    let mut n = 0usize;
    for (i, &rank) in ranks.iter().enumerate() {
        if model.set_rank(rank, POOL_BLOCKS).is_err() {
            panic!("set_rank refused");
        }
        // Fill the pool with released requests, then keep IN_FLIGHT live.
        for _ in 0..(POOL_BLOCKS / OWN_BLOCKS) {
            let p = &prompts[n % prompts.len()];
            n += 1;
            if model
                .acquire(rank, "warm", &p.local, &p.seq, true, now)
                .is_err()
            {
                panic!("warm-up acquire refused");
            }
            model.release("warm");
        }
        for slot in 0..IN_FLIGHT {
            let p = &prompts[n % prompts.len()];
            n += 1;
            if model
                .acquire(rank, &lease_id(i, slot), &p.local, &p.seq, true, now)
                .is_err()
            {
                panic!("acquire refused");
            }
        }
    }
    (model, ranks)
}

fn bench_lru(c: &mut Criterion) {
    let now = Instant::now();
    let prompts: Vec<Prompt> = (0..8_192).map(prompt).collect();
    let (mut model, ranks) = full_fleet(&prompts, now);
    let ids: Vec<Vec<String>> = (0..ranks.len())
        .map(|i| (0..IN_FLIGHT).map(|slot| lease_id(i, slot)).collect())
        .collect();

    let mut group = c.benchmark_group("approx");
    group.throughput(Throughput::Elements(1));
    group.measurement_time(Duration::from_secs(4));
    let mut step = 0usize;
    group.bench_function(
        "lru_acquire_release_64_blocks_1000_ranks_2000_block_pools",
        |b| {
            b.iter(|| {
                let rank_index = step % ranks.len();
                let slot = (step / ranks.len()) % IN_FLIGHT;
                let id = &ids[rank_index][slot];
                let p = &prompts[(step * 7 + 3) % prompts.len()];
                step += 1;
                black_box(model.release(id.as_str()));
                black_box(
                    model
                        .acquire(ranks[rank_index], id, &p.local, &p.seq, true, now)
                        .is_ok(),
                )
            })
        },
    );
    // The same on one rank: the model's own cost without the fleet's cache misses.
    let (one_prompts, one_rank) = (&prompts[..256], ranks[0]);
    let mut step = 0usize;
    group.bench_function(
        "lru_acquire_release_64_blocks_1_rank_2000_block_pool",
        |b| {
            b.iter(|| {
                let id = &ids[0][step % IN_FLIGHT];
                let p = &one_prompts[(step * 7 + 3) % one_prompts.len()];
                step += 1;
                black_box(model.release(id.as_str()));
                black_box(
                    model
                        .acquire(one_rank, id, &p.local, &p.seq, true, now)
                        .is_ok(),
                )
            })
        },
    );
    let mut step = 0usize;
    group.bench_function("lru_materialize_1000_ranks_2000_block_pools", |b| {
        b.iter(|| {
            let id = &ids[step % ranks.len()][0];
            step += 1;
            black_box(model.materialize(id.as_str(), now))
        })
    });
    group.finish();
}

fn bench_release_burst(c: &mut Criterion) {
    const LEASES_PER_RANK: usize = 100;
    let burst_ranks = scaled(100, 10);
    let now = Instant::now();
    let mut model = LruModel::new(LruConfig::default());
    let mut ids = Vec::with_capacity(burst_ranks * LEASES_PER_RANK);
    for r in 0..burst_ranks {
        let rank = Rank::new(r as u64, 0);
        if model.set_rank(rank, POOL_BLOCKS).is_err() {
            panic!("set_rank refused");
        }
        for l in 0..LEASES_PER_RANK {
            let p = prompt((r * LEASES_PER_RANK + l) as u64);
            let id = format!("burst-{r}-{l}");
            if model
                .acquire(rank, &id, &p.local, &p.seq, false, now)
                .is_err()
            {
                panic!("acquire refused");
            }
            ids.push(id);
        }
    }
    // Release in acquisition order interleaved across ranks, as a mass expiry would.
    ids.sort_by_key(|id| {
        let mut parts = id.rsplit('-');
        let l: usize = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let r: usize = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        (l, r)
    });

    let mut group = c.benchmark_group("approx");
    group.throughput(Throughput::Elements(ids.len() as u64));
    group.sample_size(10);
    group.bench_function(
        "lru_release_burst_10k_leases_100_ranks_over_capacity",
        |b| {
            b.iter_batched(
                || model.clone(),
                |mut burst| {
                    let mut evicted = 0u64;
                    for id in &ids {
                        if let Some(released) = burst.release(id.as_str()) {
                            evicted += released.evicted_blocks;
                        }
                    }
                    black_box(evicted);
                    burst
                },
                BatchSize::PerIteration,
            )
        },
    );
    group.finish();
}

fn bench_ttl(c: &mut Criterion) {
    let start = Instant::now();
    let prompts: Vec<Prompt> = (0..8_192).map(prompt).collect();
    let ranks = ranks();
    let mut model = TtlModel::new(TtlConfig::default());
    // Steady state: 120 s TTL at one insert per 10 ms keeps ~12k prompts (~130k blocks) live.
    let mut now = start;
    let mut n = 0usize;
    let mut insert = |model: &mut TtlModel, now: Instant| {
        let p = &prompts[n % prompts.len()];
        let rank = ranks[(n * 13) % ranks.len()];
        n += 1;
        let inserted = model.insert(rank, &p.local, &p.seq, now);
        let expired = model.expire(now);
        (
            inserted.map(|o| o.stored_blocks).unwrap_or(0),
            expired.expired_blocks,
        )
    };
    for _ in 0..scaled(12_000, 1_200) {
        now += Duration::from_millis(10);
        insert(&mut model, now);
    }
    let mut group = c.benchmark_group("approx");
    group.throughput(Throughput::Elements(1));
    group.measurement_time(Duration::from_secs(4));
    group.bench_function("ttl_insert_expire_64_blocks_1000_ranks", |b| {
        b.iter(|| {
            now += Duration::from_millis(10);
            black_box(insert(&mut model, now))
        })
    });
    group.finish();
}

criterion_group!(benches, bench_lru, bench_release_burst, bench_ttl);
criterion_main!(benches);
