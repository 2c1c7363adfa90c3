//! A select's latency alone and during an event storm: KV events flow through the service's own
//! sink (the applier thread, which takes the selector's write lock for a bounded share of the
//! time) as fast as it accepts them, while `api::select` routes 8,192-token prompts over 64
//! workers: straight at the lock, and through the applier's gate as the HTTP handlers do. Before
//! the applier, every listener took the write lock per message and selects starved under a storm.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_core::event::{KvEvent, StoredBlock, Tier};
use kvroute_service::api;
use kvroute_service::config::ServeConfig;
use kvroute_service::http::types::SelectBody;
use kvroute_service::state::AppState;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

mod common;

const WORKERS: u64 = 64;

fn service() -> Arc<AppState> {
    let mut config = ServeConfig::defaults();
    config.no_kv_events = true; // no listeners: the storm comes straight into the sink
    common::service_with_workers(config, WORKERS)
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..8192u32)
        .map(|t| (t.wrapping_add(seed).wrapping_mul(2_654_435_761)) % 151_936)
        .collect()
}

/// Stores and removes 128-block chains on every worker until `stop`, bounded to 60 s.
fn storm(state: &AppState, stop: &AtomicBool) -> u64 {
    let sink = state.ingest().sink();
    let started = Instant::now();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(60) {
        let worker = n % WORKERS + 1;
        let blocks: Vec<StoredBlock> = (0..128u64)
            .map(|b| StoredBlock {
                engine_hash: (n << 8) | b,
                local_hash: (n << 8 | b).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            })
            .collect();
        let hashes: Vec<u64> = blocks.iter().map(|b| b.engine_hash).collect();
        sink.apply(
            worker,
            0,
            vec![KvEvent::Stored {
                parent: None,
                blocks,
                tier: Tier::Device,
            }],
        );
        sink.apply(
            worker,
            0,
            vec![KvEvent::Removed {
                engine_hashes: hashes,
                tier: Tier::Device,
            }],
        );
        n += 1;
    }
    n
}

fn bench(c: &mut Criterion) {
    let state = service();
    let bodies: Vec<SelectBody> = (0..16)
        .map(|i| serde_json::from_value(serde_json::json!({"token_ids": prompt(i)})).unwrap())
        .collect();
    let mut group = c.benchmark_group("select_8192_tokens_64_workers");
    let mut i = 0;
    group.bench_function("quiet", |b| {
        b.iter(|| {
            i += 1;
            black_box(select(&state, bodies[i % bodies.len()].clone()))
        })
    });
    let stop = Arc::new(AtomicBool::new(false));
    let storm_thread = {
        let state = Arc::clone(&state);
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || storm(&state, &stop))
    };
    group.bench_function("during_event_storm", |b| {
        b.iter(|| {
            i += 1;
            black_box(select(&state, bodies[i % bodies.len()].clone()))
        })
    });
    // As the HTTP handlers do: wait at the applier's gate (as a task) before taking the lock.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let service = kvroute_service::Service::new(Arc::clone(&state));
    group.bench_function("during_event_storm_through_the_gate", |b| {
        b.iter(|| {
            i += 1;
            runtime.block_on(service.applier_passed());
            black_box(select(&state, bodies[i % bodies.len()].clone()))
        })
    });
    stop.store(true, Ordering::Relaxed);
    let chains = storm_thread.join().unwrap();
    eprintln!("storm: {chains} chains of 128 blocks stored and removed");
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

/// A select decided at once (no queue in these benches).
fn select(
    state: &std::sync::Arc<kvroute_service::state::AppState>,
    body: SelectBody,
) -> kvroute_core::selector::Selection {
    api::select(state, body, None)
        .decided()
        .expect("no queue")
        .expect("select")
}
