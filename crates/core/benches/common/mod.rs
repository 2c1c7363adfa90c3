//! Shared bench workloads: the Mooncake conversation trace expanded into 64-token blocks, and a
//! fleet of ranks filled from it the way engines would publish their stores.
#![allow(dead_code)]

use kvroute_core::event::{KvEvent, Rank, StoredBlock, Tier};
use kvroute_core::hash::{BASE_SEED, local_hashes, sequence_hashes};
use std::collections::HashSet;
use std::path::PathBuf;

pub const BLOCK_SIZE: usize = 64;
/// Mooncake hash ids stand for 512-token blocks: 8 blocks of 64 tokens each.
pub const SUB_BLOCKS: u64 = 8;

/// Whether this is `cargo test`'s smoke run of a bench (criterion's test mode: no `--bench`
/// flag, or `--test`). It only has to show that every bench still runs, on a debug build: with
/// the whole trace and the full sample loops that took the index and selector benches minutes.
pub fn smoke_run() -> bool {
    static SMOKE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SMOKE.get_or_init(|| {
        let args: Vec<String> = std::env::args().collect();
        args.iter().any(|a| a == "--test") || !args.iter().any(|a| a == "--bench")
    })
}

/// `full` in a real run, `smoke` in a smoke run.
pub fn scaled<T>(full: T, smoke: T) -> T {
    if smoke_run() { smoke } else { full }
}

pub fn trace_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/traces/mooncake/conversation_trace.jsonl")
}

/// Deterministic tokens for one Mooncake hash id: equal ids give equal tokens.
pub fn tokens_for_id(id: u64) -> Vec<u32> {
    (0..SUB_BLOCKS * BLOCK_SIZE as u64)
        .map(|t| ((id * SUB_BLOCKS * BLOCK_SIZE as u64 + t) % 4_000_000_000) as u32)
        .collect()
}

/// Each trace request as the local hashes of its full 64-token blocks (capped at its length);
/// the first 200 only in a smoke run.
pub fn trace_prompts(limit: usize) -> Vec<Vec<u64>> {
    let limit = limit.min(scaled(usize::MAX, 200));
    let Ok(text) = std::fs::read_to_string(trace_path()) else {
        eprintln!(
            "trace not found at {:?}; using a synthetic workload",
            trace_path()
        );
        return synthetic_prompts(limit);
    };
    text.lines()
        .take(limit)
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .map(|v| {
            let input = v["input_length"].as_u64().unwrap_or(0) as usize;
            let ids: Vec<u64> = v["hash_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
                .unwrap_or_default();
            let tokens: Vec<u32> = ids.iter().flat_map(|&id| tokens_for_id(id)).collect();
            let full = (input / BLOCK_SIZE).min(tokens.len() / BLOCK_SIZE);
            local_hashes(&tokens[..full * BLOCK_SIZE], BLOCK_SIZE, BASE_SEED)
        })
        .collect()
}

fn synthetic_prompts(limit: usize) -> Vec<Vec<u64>> {
    (0..limit.min(4000) as u64)
        .map(|i| {
            let tokens: Vec<u32> = (0..(i % 50 + 1) * 512)
                .map(|t| ((i / 8) * 1_000_003 + t) as u32)
                .collect();
            local_hashes(&tokens, BLOCK_SIZE, BASE_SEED)
        })
        .collect()
}

/// Turns a prompt into the `Stored` event an engine would publish for the blocks a rank does not
/// hold yet (engine hash = sequence hash, parent = the last block it already holds).
pub fn store_event(held: &mut HashSet<u64>, local: &[u64]) -> Option<KvEvent> {
    let sequence = sequence_hashes(local);
    let have = sequence.iter().take_while(|s| held.contains(s)).count();
    if have == sequence.len() {
        return None;
    }
    let parent = have.checked_sub(1).map(|i| sequence[i]);
    let blocks = local[have..]
        .iter()
        .zip(&sequence[have..])
        .map(|(&local_hash, &engine_hash)| {
            held.insert(engine_hash);
            StoredBlock {
                engine_hash,
                local_hash,
            }
        })
        .collect();
    Some(KvEvent::Stored {
        parent,
        blocks,
        tier: Tier::Device,
    })
}

/// The events that fill `ranks` ranks: trace requests dealt round-robin over them.
pub fn fleet_events(ranks: u64, prompts: &[Vec<u64>]) -> Vec<(Rank, KvEvent)> {
    let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); ranks as usize];
    let mut events = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let r = (i as u64) % ranks;
        if let Some(event) = store_event(&mut held[r as usize], prompt) {
            events.push((Rank::new(r, 0), event));
        }
    }
    events
}

/// The events of `ranks` engines that each hold at most `capacity` blocks and evict their oldest
/// (as the load generator's fake engines do): trace requests are routed by their first block, so
/// that prefixes come back to the rank that has them, and the trace is replayed `passes` times.
/// Once the engines are full, each `Stored` event is followed by the `Removed` event of what it
/// pushed out.
pub fn churn_events(
    ranks: u64,
    capacity: usize,
    prompts: &[Vec<u64>],
    passes: usize,
) -> Vec<(Rank, KvEvent)> {
    let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); ranks as usize];
    let mut order: Vec<std::collections::VecDeque<u64>> =
        vec![std::collections::VecDeque::new(); ranks as usize];
    let mut events = Vec::new();
    for (i, prompt) in (0..passes).flat_map(|_| prompts.iter()).enumerate() {
        let Some(&first) = prompt.first() else {
            continue;
        };
        // Mostly by prefix, one request in eight anywhere (as load would spread them).
        let r = if i % 8 == 7 { i as u64 } else { first } % ranks;
        let rank = r as usize;
        let Some(event) = store_event(&mut held[rank], prompt) else {
            continue;
        };
        if let KvEvent::Stored { blocks, .. } = &event {
            order[rank].extend(blocks.iter().map(|b| b.engine_hash));
        }
        events.push((Rank::new(r, 0), event));
        let mut evicted = Vec::new();
        while order[rank].len() > capacity {
            if let Some(h) = order[rank].pop_front() {
                held[rank].remove(&h);
                evicted.push(h);
            }
        }
        if !evicted.is_empty() {
            events.push((
                Rank::new(r, 0),
                KvEvent::Removed {
                    engine_hashes: evicted,
                    tier: Tier::Device,
                },
            ));
        }
    }
    events
}
