//! Approximate cache models for ranks that publish no KV events (SPEC §9).
//!
//! When a worker publishes no KV events, kvroute predicts its cache from its own bookings. Two
//! policies exist:
//! - [`ttl::TtlModel`] (the default, SPEC §9.1): a booked prompt's block chain is assumed cached
//!   on its rank for a TTL (120 s), refreshed on re-insert; a per-partition size cap prunes the
//!   earliest-expiring blocks.
//! - [`lru::LruModel`] (SPEC §9.2): each rank's KV pool of `total_kv_blocks` blocks, with
//!   reference-counted copies, a vLLM-style free queue (oldest release first, tail → root within a
//!   release), output blocks, leases with a CLOCK reaper, and rank incarnations.
//!
//! ## How a model talks to the index
//! A model never touches the radix index. Every operation **returns** the [`KvEvent`]s the caller
//! applies, in order, to the partition's [`RadixIndex`](crate::index::RadixIndex), so the index
//! stays the single source of overlap answers:
//! - newly predicted blocks: `Stored { parent, blocks, tier: Device }`, with the block's sequence
//!   hash as its engine hash and `parent` the sequence hash of the previous prompt block (`None`
//!   for the first block). A model publishes a hash for a rank once, when the rank's first copy of
//!   it appears, so the index's per-(rank, engine hash) store count stays at 1;
//! - forgotten blocks: `Removed { engine_hashes, tier: Device }`, when the rank's last copy goes;
//! - a reset rank: `Cleared`.
//!
//! Removing a whole rank (worker deleted, or the rank starts publishing events) returns nothing:
//! the caller clears the rank in the index itself.
//!
//! ## Which model serves a rank
//! [`rank_model`] maps the configured [`CachePolicy`] and a rank's registered `total_kv_blocks` to
//! the model that serves it: the LRU policy needs a known, non-zero capacity and falls back to the
//! TTL model otherwise (SPEC §9.2).
//!
//! ## Wiring into the selector
//! One [`TtlModel`] per partition (its cap is per partition) and one [`LruModel`] for the whole
//! selector (ranks and reservation ids are service-wide; the caller routes each returned event to
//! the index of the rank's partition). Everything runs under the selector's write lock and the
//! events are applied before the lock is released, so read-your-writes holds (SPEC §7).
//! - **Worker upsert** (no KV events): per rank, `rank_model(policy, total_kv_blocks)`.
//!   `Lru { capacity_blocks }` → `lru.set_rank(rank, capacity)` (or `lru.reset_rank` when the
//!   worker's identity, e.g. its endpoint, changed) and `ttl.remove_rank(rank)`; `Ttl` →
//!   `lru.remove_rank(rank)`. Apply the returned events; when a rank moves from one model to the
//!   other, clear it in the index (`Cleared`).
//! - **Worker deleted, or it starts publishing KV events**: `lru.remove_rank` and
//!   `ttl.remove_rank`, then clear the rank in the index.
//! - **Booking** (after the load tracker accepted it): LRU rank → `lru.acquire(rank,
//!   reservation_id, local, sequence, isl_tokens % block_size != 0, now)`; TTL rank →
//!   `ttl.insert(rank, local, sequence, now)`. `ApproxError::UnknownRank` from `acquire` means
//!   "serve it with TTL". `LeaseExists` means a lease outlived its booking: `release` it and retry.
//! - **`prefill_complete`**: `lru.touch(id, now)`. **`output_block`** (any `decay_fraction`):
//!   `lru.materialize(id, now)`. Call them only for bookings on LRU ranks: for any other id they
//!   do nothing but count an ignored lease command.
//! - **`free`**, and every booking the load tracker expires: `lru.release(id)`.
//! - **Tick**: `ttl.expire(now)` per partition, then `lru.reap(now)`.
//!
//! A `Stored` event whose parent the index no longer holds (the index's own block cap evicted it)
//! is dropped and counted by the index, and the later `Removed` of those blocks is counted as
//! unknown: both benign.
//!
//! Both models are pure: time is an argument (`now`), there are no clocks, no logging and no
//! globals; outcomes (counts) are returned values for the edge's metrics.

pub mod lru;
#[cfg(test)]
mod reference;
pub mod ttl;

#[cfg(test)]
mod tests;

use crate::event::{KvEvent, Rank, StoredBlock, Tier};

pub use lru::{
    Acquired, Attempt, Incarnation, LeaseEvents, LeaseRef, LeaseView, LruConfig, LruCounters,
    LruModel, LruStats, RankRef, RankReset, ReapOutcome,
};
pub use ttl::{TtlConfig, TtlCounters, TtlModel, TtlOutcome};

/// The approximate policy the router is configured with (`--approximate-cache-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CachePolicy {
    /// TTL model for every event-less rank (SPEC §9.1).
    #[default]
    Ttl,
    /// Capacity-bounded LRU where the rank's capacity is known (SPEC §9.2).
    Lru,
}

/// The model that serves one event-less rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankModel {
    Ttl,
    Lru { capacity_blocks: u64 },
}

/// Which model serves a rank registered with `total_kv_blocks` under `policy`: LRU only with a
/// known, non-zero capacity; TTL otherwise.
pub fn rank_model(policy: CachePolicy, total_kv_blocks: Option<u64>) -> RankModel {
    match (policy, total_kv_blocks) {
        (CachePolicy::Lru, Some(capacity_blocks)) if capacity_blocks > 0 => {
            RankModel::Lru { capacity_blocks }
        }
        _ => RankModel::Ttl,
    }
}

/// Failures of the approximate models. Each leaves the model unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApproxError {
    /// The prompt's local and sequence hashes differ in length.
    #[error("local_hashes length {local} must match sequence_hashes length {sequence}")]
    LengthMismatch { local: usize, sequence: usize },
    /// The LRU model has no pool for this rank (never set, removed, or capacity unknown / 0): the
    /// caller serves it with the TTL model.
    #[error("rank {} (dp {}) has no capacity-bounded pool", rank.worker_id, rank.dp_rank)]
    UnknownRank { rank: Rank },
    /// A command pinned to a rank incarnation that a reset or capacity change retired.
    #[error(
        "rank {} (dp {}) incarnation {} was retired (current {})",
        rank.worker_id,
        rank.dp_rank,
        requested.0,
        current.0
    )]
    StaleIncarnation {
        rank: Rank,
        requested: Incarnation,
        current: Incarnation,
    },
    /// The lease id is already held by a live attempt; release it first.
    #[error("lease {lease_id} is already live (attempt {})", attempt.0)]
    LeaseExists { lease_id: String, attempt: Attempt },
    /// An LRU pool needs a capacity of at least one block (use the TTL model otherwise).
    #[error("total_kv_blocks must be greater than 0 for the LRU model")]
    ZeroCapacity { rank: Rank },
}

/// `Stored` events for the blocks of a prompt chain at `new_positions` (ascending): one event per
/// run of consecutive positions, chained under the sequence hash of the position before the run
/// (`None` at position 0). Engine hash = sequence hash.
fn stored_runs(
    local_hashes: &[u64],
    sequence_hashes: &[u64],
    new_positions: impl IntoIterator<Item = usize>,
) -> Vec<KvEvent> {
    let mut events = Vec::new();
    let mut run: Vec<StoredBlock> = Vec::new();
    let mut run_parent: Option<u64> = None;
    let mut previous_position: Option<usize> = None;
    for position in new_positions {
        let (Some(&local_hash), Some(&engine_hash)) =
            (local_hashes.get(position), sequence_hashes.get(position))
        else {
            continue;
        };
        let continues = previous_position.is_some_and(|p| p + 1 == position);
        if !continues {
            if !run.is_empty() {
                events.push(stored_event(run_parent, std::mem::take(&mut run)));
            }
            run_parent = position
                .checked_sub(1)
                .and_then(|p| sequence_hashes.get(p).copied());
        }
        run.push(StoredBlock {
            engine_hash,
            local_hash,
        });
        previous_position = Some(position);
    }
    if !run.is_empty() {
        events.push(stored_event(run_parent, run));
    }
    events
}

fn stored_event(parent: Option<u64>, blocks: Vec<StoredBlock>) -> KvEvent {
    KvEvent::Stored {
        parent,
        blocks,
        tier: Tier::Device,
    }
}

fn removed_event(engine_hashes: Vec<u64>) -> KvEvent {
    KvEvent::Removed {
        engine_hashes,
        tier: Tier::Device,
    }
}

/// Groups `(rank, hash)` removals into one `Removed` event per rank, ranks in order of first
/// appearance, hashes in the given order.
fn group_removals(removals: Vec<(Rank, u64)>) -> Vec<(Rank, KvEvent)> {
    let mut groups: Vec<(Rank, Vec<u64>)> = Vec::new();
    let mut slot_of: hashbrown::HashMap<Rank, usize> = hashbrown::HashMap::new();
    for (rank, hash) in removals {
        let slot = *slot_of.entry(rank).or_insert_with(|| {
            groups.push((rank, Vec::new()));
            groups.len() - 1
        });
        if let Some((_, hashes)) = groups.get_mut(slot) {
            hashes.push(hash);
        }
    }
    groups
        .into_iter()
        .map(|(rank, hashes)| (rank, removed_event(hashes)))
        .collect()
}
