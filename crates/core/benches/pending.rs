//! Pending-selection cache throughput at the default 4,096-entry cap (SPEC §8).
//!
//! - `pending_insert_peek_remove_at_4096_cap`: the replay path. 4,095 pinned entries plus the one
//!   in flight keep the cache at the cap while each iteration inserts a selection, peeks it and
//!   removes it by generation.
//! - `pending_insert_evict_at_4096_cap`: selects that are never booked. Every insert into the full
//!   cache evicts the oldest entry.
//!
//! Keys are built outside the timed loop; the timed routine moves an owned key into `insert`.
// A bench reads the clock (the core's `now` arguments, its own timings).
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_core::pending::{PendingCache, PendingConfig, PendingKey};

const CAP: usize = 4096;
const KEY_POOL: usize = 8192;

/// Stand-in for the selector's booking inputs: the sequence hashes dominate its size.
struct BookingInputs {
    sequence_hashes: Vec<u64>,
}

fn key(i: usize) -> PendingKey {
    PendingKey::new(
        "meta-llama/Llama-3.1-8B-Instruct",
        "default",
        format!("sel-{i:08}-3f1c2a9e-7b4d-4e52-9a61-c0ffee{i:06}"),
    )
}

fn value() -> Arc<BookingInputs> {
    Arc::new(BookingInputs {
        sequence_hashes: (0..64).collect(),
    })
}

fn bytes_of(key: &PendingKey, inputs: &BookingInputs) -> u64 {
    key.approximate_entry_bytes(inputs.sequence_hashes.len(), None)
}

fn full_cache(epoch: Instant, pinned: usize) -> PendingCache<BookingInputs> {
    let mut cache = PendingCache::new(PendingConfig::default());
    let inputs = value();
    for i in 0..pinned {
        let key = key(KEY_POOL + i);
        let bytes = bytes_of(&key, &inputs);
        cache.insert(key, Arc::clone(&inputs), bytes, epoch);
    }
    cache
}

fn bench_pending(c: &mut Criterion) {
    let epoch = Instant::now();
    let inputs = value();
    let keys: Vec<PendingKey> = (0..KEY_POOL).map(key).collect();
    let bytes = bytes_of(&keys[0], &inputs);

    let mut group = c.benchmark_group("pending");
    group.throughput(Throughput::Elements(1));

    let mut cache = full_cache(epoch, CAP - 1);
    let mut tick = 0usize;
    group.bench_function("pending_insert_peek_remove_at_4096_cap", |b| {
        b.iter_batched(
            || {
                tick += 1;
                (tick, keys[tick % KEY_POOL].clone())
            },
            |(tick, owned_key)| {
                let now = epoch + Duration::from_nanos(tick as u64);
                let probe = &keys[tick % KEY_POOL];
                cache.insert(owned_key, Arc::clone(&inputs), bytes, now);
                let (_, generation) = cache.peek(probe, now).unwrap_or_else(|| unreachable!());
                black_box(cache.remove(probe, generation))
            },
            BatchSize::SmallInput,
        )
    });
    assert_eq!(cache.len(), CAP - 1);

    let mut cache = full_cache(epoch, CAP);
    let mut tick = 0usize;
    group.bench_function("pending_insert_evict_at_4096_cap", |b| {
        b.iter_batched(
            || {
                tick += 1;
                (tick, keys[tick % KEY_POOL].clone())
            },
            |(tick, owned_key)| {
                let now = epoch + Duration::from_nanos(tick as u64);
                black_box(cache.insert(owned_key, Arc::clone(&inputs), bytes, now))
            },
            BatchSize::SmallInput,
        )
    });
    assert_eq!(cache.len(), CAP);

    group.finish();
}

criterion_group!(benches, bench_pending);
criterion_main!(benches);
