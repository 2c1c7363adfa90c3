//! Full in-process selection benches: `select` of a 131,072-token prompt (hash + find_matches +
//! schedule) against 1,000 ranks whose caches hold random-length prefixes of it plus trace
//! chains, and the `select` → `create_reservation` (replay) → `free` cycle per request; with the
//! engine's events too, predict-on-route off and on (`cycle_with_events_*`).
//! Besides criterion's figures it prints p50/p99 over 2,000 timed selects.
#![allow(clippy::unwrap_used, clippy::expect_used)]
// A bench reads the clock (the core's `now` arguments, its own timings).
#![allow(clippy::disallowed_methods)]

mod common;

// The allocator the kvroute binary uses.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use common::{BLOCK_SIZE, fleet_events, scaled, store_event, trace_prompts};
use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_core::error::PartitionKey;
use kvroute_core::event::{KvEvent, Rank, StoredBlock, Tier};
use kvroute_core::hash::{BASE_SEED, PromptHashes, local_hashes};
use kvroute_core::selector::{
    LifecycleCalls, PredictConfig, Prompt, ReservationRequest, SelectRequest, Selector,
    SelectorConfig, WorkerSpec,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::hint::black_box;
use std::time::Duration;
use std::time::Instant;

const PROMPT_TOKENS: usize = 131_072;
const RANKS: u64 = 1000;

/// The fleet's ranks: [`RANKS`], a tenth of them in a smoke run.
fn ranks() -> u64 {
    scaled(RANKS, 100)
}

fn long_prompt() -> Vec<u32> {
    (0..PROMPT_TOKENS as u32)
        .map(|t| t.wrapping_mul(2_654_435_761) % 150_000)
        .collect()
}

fn fleet(prompt: &[u32], config: SelectorConfig) -> Selector {
    let mut selector = Selector::new(config);
    for w in 0..ranks() {
        selector
            .upsert_worker(WorkerSpec {
                worker_id: w,
                model_name: "m".into(),
                routing_group: "g".into(),
                endpoint: Some(format!("http://worker-{w}")),
                block_size: Some(BLOCK_SIZE as u32),
                kv_events_endpoint: Some(format!("tcp://127.0.0.1:{}", 20000 + w)),
                ..WorkerSpec::default()
            })
            .expect("upsert");
    }
    let prompts = trace_prompts(usize::MAX);
    for (rank, event) in fleet_events(ranks(), &prompts) {
        selector.apply_events(rank.worker_id, rank.dp_rank, &[event]);
    }
    let query_local = local_hashes(prompt, BLOCK_SIZE, BASE_SEED);
    let mut rng = SmallRng::seed_from_u64(7);
    for w in 0..ranks() {
        let len = rng.random_range(0..=query_local.len());
        let mut held = HashSet::new();
        if let Some(event) = store_event(&mut held, &query_local[..len]) {
            let rank = Rank::new(w, 0);
            selector.apply_events(rank.worker_id, rank.dp_rank, &[event]);
        }
    }
    selector
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn bench_select(c: &mut Criterion) {
    let prompt = long_prompt();
    let mut selector = fleet(&prompt, SelectorConfig::default());
    let partition = PartitionKey::new("m", "g");
    let mut rng = SmallRng::seed_from_u64(1);
    let request = SelectRequest::new(
        &partition,
        Prompt::Tokens {
            tokens: &prompt,
            lora_name: None,
            cache_salt: None,
            extras: kvroute_core::hash::BlockExtras::default(),
        },
    );
    let mut samples: Vec<f64> = (0..scaled(2000, 20))
        .map(|_| {
            let start = Instant::now();
            black_box(
                selector
                    .select(&request, Instant::now(), &mut rng)
                    .expect("select"),
            );
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    println!(
        "select_131072_tokens_1000_ranks: p50 {:.1} us, p90 {:.1} us, p99 {:.1} us",
        percentile(&samples, 0.5),
        percentile(&samples, 0.9),
        percentile(&samples, 0.99)
    );
    c.bench_function("select_131072_tokens_1000_ranks", |b| {
        b.iter(|| selector.select(&request, Instant::now(), &mut rng))
    });
    // The same select with the prompt hashed beforehand (as the HTTP edge does outside the lock).
    let hashes = kvroute_core::hash::PromptHashes::from_tokens(&prompt, BLOCK_SIZE, BASE_SEED);
    let prehashed = SelectRequest::new(&partition, Prompt::Hashes(&hashes));
    c.bench_function("select_prehashed_2048_blocks_1000_ranks", |b| {
        b.iter(|| selector.select(&prehashed, Instant::now(), &mut rng))
    });

    let short: Vec<u32> = prompt[..8192].to_vec();
    let mut n = 0u64;
    c.bench_function("select_replay_free_8192_tokens_1000_ranks", |b| {
        b.iter(|| {
            n += 1;
            let id = format!("r{n}");
            let req = SelectRequest {
                selection_id: Some(&id),
                ..SelectRequest::new(
                    &partition,
                    Prompt::Tokens {
                        tokens: &short,
                        lora_name: None,
                        cache_salt: None,
                        extras: kvroute_core::hash::BlockExtras::default(),
                    },
                )
            };
            let now = Instant::now();
            selector.select(&req, now, &mut rng).expect("select");
            selector
                .create_reservation(&ReservationRequest::replay(&partition, &id), now)
                .expect("replay");
            selector.free(&id, now).expect("free");
        })
    });
}

/// A request's whole cycle as the service sees it, the engine's events included: select (a
/// prompt of 8,192 tokens, its first half a prefix the fleet holds in part, its second half new),
/// replay, the engine's `Stored` of the blocks it lacked, free, and (to keep the index's size) the
/// engine's `Removed` of them. With predict-on-route the replay also records the new blocks and
/// the `Stored` confirms them.
fn bench_cycle_with_events(c: &mut Criterion) {
    let prompt = long_prompt();
    for (name, ttl) in [("off", Duration::ZERO), ("on", Duration::from_secs(2))] {
        let config = SelectorConfig {
            predict: PredictConfig {
                ttl,
                ..PredictConfig::default()
            },
            ..SelectorConfig::default()
        };
        let mut selector = fleet(&prompt, config);
        let partition = PartitionKey::new("m", "g");
        let mut rng = SmallRng::seed_from_u64(1);
        let mut n = 0u32;
        c.bench_function(
            &format!("cycle_with_events_8192_tokens_1000_ranks/predict_{name}"),
            |b| {
                b.iter(|| {
                    n += 1;
                    let mut tokens = prompt[..4096].to_vec();
                    tokens.extend((0..4096).map(|t| 200_000_000 + n * 4096 + t));
                    let hashes = PromptHashes::from_tokens(&tokens, BLOCK_SIZE, BASE_SEED);
                    let id = format!("c{n}");
                    let req = SelectRequest {
                        selection_id: Some(&id),
                        ..SelectRequest::new(&partition, Prompt::Hashes(&hashes))
                    };
                    let now = Instant::now();
                    let sel = selector.select(&req, now, &mut rng).expect("select");
                    selector
                        .create_reservation(&ReservationRequest::replay(&partition, &id), now)
                        .expect("replay");
                    let held = (sel.overlap.gpu / BLOCK_SIZE as u64) as usize;
                    let new = held..hashes.sequence.len();
                    let stored = KvEvent::Stored {
                        parent: held.checked_sub(1).map(|i| hashes.sequence[i]),
                        blocks: new
                            .clone()
                            .map(|i| StoredBlock {
                                engine_hash: hashes.sequence[i],
                                local_hash: hashes.local[i],
                            })
                            .collect(),
                        tier: Tier::Device,
                    };
                    selector.apply_events(sel.worker_id, sel.dp_rank, &[stored]);
                    selector.free(&id, now).expect("free");
                    let removed = KvEvent::Removed {
                        engine_hashes: hashes.sequence[new].to_vec(),
                        tier: Tier::Device,
                    };
                    selector.apply_events(sel.worker_id, sel.dp_rank, &[removed]);
                })
            },
        );
        let counters = selector.prediction_counters();
        assert_eq!(counters.predicted, counters.confirmed, "{counters:?}");
    }
}

criterion_group!(benches, bench_select, bench_cycle_with_events);
criterion_main!(benches);
