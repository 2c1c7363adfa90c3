//! A naive reference of the LRU model for property tests, written the way vLLM's block pool works
//! rather than the way [`super::lru`] is: per rank a list of physical blocks, a free-block queue
//! (`VecDeque`) that freed blocks join **tail first** and allocations pop from the **front**
//! (evicting the popped block's hash), and a hash → block list in caching order. Every lookup is a
//! linear scan. Obviously correct, slow, unbounded in history.
//!
//! Differences from vLLM, shared with the real model: a pool that is full of active blocks grows
//! past its capacity instead of refusing the request, and shrinks back (front of the queue first)
//! when blocks are freed.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use super::ApproxError;
use super::lru::{
    Acquired, Attempt, Incarnation, LeaseEvents, LeaseRef, LruConfig, LruCounters, LruStats,
    RankRef, RankReset, ReapOutcome,
};
use crate::event::{KvEvent, Rank, StoredBlock, Tier};

#[derive(Debug, Clone)]
struct Block {
    hash: Option<u64>,
    refs: u32,
}

#[derive(Debug, Clone)]
struct Pool {
    capacity: u64,
    incarnation: Incarnation,
    /// Physical blocks; `None` once destroyed.
    blocks: Vec<Option<Block>>,
    /// Free blocks still holding content; the front is evicted first.
    free_queue: VecDeque<usize>,
    /// (hash, block) in the order the blocks were cached.
    cached: Vec<(u64, usize)>,
}

impl Pool {
    fn alive(&self) -> u64 {
        self.blocks.iter().flatten().count() as u64
    }

    fn lookup(&self, hash: u64) -> Option<usize> {
        self.cached
            .iter()
            .find(|(h, _)| *h == hash)
            .map(|&(_, b)| b)
    }

    fn destroy(&mut self, block: usize, removed: &mut Vec<u64>) {
        let Some(Some(gone)) = self.blocks.get_mut(block).map(Option::take) else {
            return;
        };
        if let Some(hash) = gone.hash {
            self.cached.retain(|&(h, b)| !(h == hash && b == block));
            if self.lookup(hash).is_none() {
                removed.push(hash);
            }
        }
    }

    /// One new block (refs 1, no hash yet): a free slot while under capacity, else the front of
    /// the free queue, else past capacity.
    fn allocate(&mut self, removed: &mut Vec<u64>, counters: &mut LruCounters) -> usize {
        if self.alive() >= self.capacity {
            match self.free_queue.pop_front() {
                Some(front) => {
                    self.destroy(front, removed);
                    counters.evicted_blocks += 1;
                }
                None => counters.overcapacity_allocations += 1,
            }
        }
        self.blocks.push(Some(Block {
            hash: None,
            refs: 1,
        }));
        self.blocks.len() - 1
    }

    fn block_mut(&mut self, block: usize) -> Option<&mut Block> {
        self.blocks.get_mut(block).and_then(Option::as_mut)
    }

    /// Frees `held` (tail first), then shrinks back to capacity from the front of the queue.
    fn free(&mut self, held: &[usize], counters: &mut LruCounters) -> (Vec<u64>, u64) {
        for &block in held.iter().rev() {
            if let Some(b) = self.block_mut(block) {
                b.refs -= 1;
                if b.refs == 0 {
                    self.free_queue.push_back(block);
                }
            }
        }
        let mut removed = Vec::new();
        let mut evicted = 0;
        while self.alive() > self.capacity {
            let Some(front) = self.free_queue.pop_front() else {
                break;
            };
            self.destroy(front, &mut removed);
            evicted += 1;
        }
        counters.evicted_blocks += evicted;
        (removed, evicted)
    }
}

#[derive(Debug, Clone)]
struct Lease {
    id: String,
    attempt: Attempt,
    rank: Rank,
    held: Vec<usize>,
    referenced: bool,
}

/// The reference LRU model; same operations and return values as [`super::LruModel`].
#[derive(Debug, Clone, Default)]
pub struct ReferenceLru {
    config: LruConfig,
    pools: BTreeMap<Rank, Pool>,
    /// Live leases in attempt order.
    leases: Vec<Lease>,
    next_attempt: u64,
    next_incarnation: u64,
    last_scan: Option<Instant>,
    counters: LruCounters,
}

impl ReferenceLru {
    pub fn new(config: LruConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    pub fn set_rank(&mut self, rank: Rank, capacity_blocks: u64) -> Result<RankReset, ApproxError> {
        if capacity_blocks == 0 {
            return Err(ApproxError::ZeroCapacity { rank });
        }
        if let Some(pool) = self.pools.get(&rank)
            && pool.capacity == capacity_blocks
        {
            return Ok(RankReset {
                incarnation: pool.incarnation,
                events: Vec::new(),
                retired_leases: 0,
            });
        }
        self.reset_rank(rank, capacity_blocks)
    }

    pub fn reset_rank(
        &mut self,
        rank: Rank,
        capacity_blocks: u64,
    ) -> Result<RankReset, ApproxError> {
        if capacity_blocks == 0 {
            return Err(ApproxError::ZeroCapacity { rank });
        }
        let existed = self.pools.contains_key(&rank);
        let retired_leases = self.drop_rank(rank);
        let incarnation = Incarnation(self.next_incarnation);
        self.next_incarnation += 1;
        self.pools.insert(
            rank,
            Pool {
                capacity: capacity_blocks,
                incarnation,
                blocks: Vec::new(),
                free_queue: VecDeque::new(),
                cached: Vec::new(),
            },
        );
        Ok(RankReset {
            incarnation,
            events: if existed {
                vec![KvEvent::Cleared]
            } else {
                Vec::new()
            },
            retired_leases,
        })
    }

    pub fn remove_rank(&mut self, rank: Rank) -> bool {
        let existed = self.pools.contains_key(&rank);
        self.drop_rank(rank);
        existed
    }

    fn drop_rank(&mut self, rank: Rank) -> u64 {
        self.pools.remove(&rank);
        let before = self.leases.len();
        self.leases.retain(|lease| lease.rank != rank);
        let retired = (before - self.leases.len()) as u64;
        self.counters.retired_leases += retired;
        retired
    }

    pub fn acquire(
        &mut self,
        rank: impl Into<RankRef>,
        lease_id: &str,
        local_hashes: &[u64],
        sequence_hashes: &[u64],
        partial_block: bool,
        now: Instant,
    ) -> Result<Acquired, ApproxError> {
        let target = rank.into();
        let rank = target.rank;
        if local_hashes.len() != sequence_hashes.len() {
            return Err(ApproxError::LengthMismatch {
                local: local_hashes.len(),
                sequence: sequence_hashes.len(),
            });
        }
        let Some(pool) = self.pools.get_mut(&rank) else {
            return Err(ApproxError::UnknownRank { rank });
        };
        if let Some(requested) = target.incarnation
            && requested != pool.incarnation
        {
            return Err(ApproxError::StaleIncarnation {
                rank,
                requested,
                current: pool.incarnation,
            });
        }
        if let Some(lease) = self.leases.iter().find(|lease| lease.id == lease_id) {
            return Err(ApproxError::LeaseExists {
                lease_id: lease_id.to_owned(),
                attempt: lease.attempt,
            });
        }
        if self.last_scan.is_none() {
            self.last_scan = Some(now);
        }

        // Prefix hits: take each block out of the free queue and reference it.
        let mut held = Vec::new();
        for &hash in sequence_hashes {
            let Some(block) = pool.lookup(hash) else {
                break;
            };
            let Some(b) = pool.block_mut(block) else {
                break;
            };
            b.refs += 1;
            if b.refs == 1 {
                pool.free_queue.retain(|&q| q != block);
            }
            held.push(block);
        }
        let hit_blocks = held.len();
        // Allocate every new block first (evicting), then cache the full ones.
        let new_count = sequence_hashes.len() - hit_blocks + usize::from(partial_block);
        let mut removed = Vec::new();
        let evicted_before = self.counters.evicted_blocks;
        let fresh: Vec<usize> = (0..new_count)
            .map(|_| pool.allocate(&mut removed, &mut self.counters))
            .collect();
        let evicted_blocks = self.counters.evicted_blocks - evicted_before;
        let mut events = Vec::new();
        if !removed.is_empty() {
            events.push(KvEvent::Removed {
                engine_hashes: removed,
                tier: Tier::Device,
            });
        }
        let mut run: Option<(Option<u64>, Vec<StoredBlock>, usize)> = None;
        for (offset, &block) in fresh.iter().enumerate() {
            let position = hit_blocks + offset;
            held.push(block);
            let Some(&hash) = sequence_hashes.get(position) else {
                continue; // the partial block: private
            };
            let first = pool.lookup(hash).is_none();
            if let Some(b) = pool.block_mut(block) {
                b.hash = Some(hash);
            }
            pool.cached.push((hash, block));
            if !first {
                if let Some((parent, blocks, _)) = run.take() {
                    events.push(stored(parent, blocks));
                }
                continue;
            }
            let parent = position.checked_sub(1).map(|p| sequence_hashes[p]);
            let block = StoredBlock {
                engine_hash: hash,
                local_hash: local_hashes[position],
            };
            match &mut run {
                Some((_, blocks, last)) if *last + 1 == position => {
                    blocks.push(block);
                    *last = position;
                }
                _ => {
                    if let Some((parent, blocks, _)) = run.take() {
                        events.push(stored(parent, blocks));
                    }
                    run = Some((parent, vec![block], position));
                }
            }
        }
        if let Some((parent, blocks, _)) = run {
            events.push(stored(parent, blocks));
        }

        let attempt = Attempt(self.next_attempt);
        self.next_attempt += 1;
        self.leases.push(Lease {
            id: lease_id.to_owned(),
            attempt,
            rank,
            held,
            referenced: true,
        });
        Ok(Acquired {
            attempt,
            incarnation: pool.incarnation,
            events,
            hit_blocks: hit_blocks as u64,
            new_blocks: new_count as u64,
            evicted_blocks,
        })
    }

    fn find<'a>(&self, lease: LeaseRef<'a>) -> Option<usize> {
        self.leases.iter().position(|l| {
            l.id == lease.id && lease.attempt.is_none_or(|attempt| attempt == l.attempt)
        })
    }

    pub fn touch<'a>(&mut self, lease: impl Into<LeaseRef<'a>>, now: Instant) -> bool {
        if self.last_scan.is_none() {
            self.last_scan = Some(now);
        }
        match self.find(lease.into()) {
            Some(i) => {
                self.leases[i].referenced = true;
                true
            }
            None => {
                self.counters.ignored_lease_commands += 1;
                false
            }
        }
    }

    pub fn materialize<'a>(
        &mut self,
        lease: impl Into<LeaseRef<'a>>,
        now: Instant,
    ) -> Option<LeaseEvents> {
        if self.last_scan.is_none() {
            self.last_scan = Some(now);
        }
        let Some(i) = self.find(lease.into()) else {
            self.counters.ignored_lease_commands += 1;
            return None;
        };
        let lease = &mut self.leases[i];
        lease.referenced = true;
        let pool = self.pools.get_mut(&lease.rank)?;
        let mut removed = Vec::new();
        let evicted_before = self.counters.evicted_blocks;
        let block = pool.allocate(&mut removed, &mut self.counters);
        lease.held.push(block);
        Some(LeaseEvents {
            rank: lease.rank,
            attempt: lease.attempt,
            events: removed_events(removed),
            evicted_blocks: self.counters.evicted_blocks - evicted_before,
        })
    }

    pub fn release<'a>(&mut self, lease: impl Into<LeaseRef<'a>>) -> Option<LeaseEvents> {
        let Some(i) = self.find(lease.into()) else {
            self.counters.ignored_lease_commands += 1;
            return None;
        };
        self.release_at(i)
    }

    fn release_at(&mut self, i: usize) -> Option<LeaseEvents> {
        let lease = self.leases.remove(i);
        let pool = self.pools.get_mut(&lease.rank)?;
        let (removed, evicted_blocks) = pool.free(&lease.held, &mut self.counters);
        Some(LeaseEvents {
            rank: lease.rank,
            attempt: lease.attempt,
            events: removed_events(removed),
            evicted_blocks,
        })
    }

    pub fn reap(&mut self, now: Instant) -> ReapOutcome {
        let last_scan = *self.last_scan.get_or_insert(now);
        let mut outcome = ReapOutcome::default();
        if now.saturating_duration_since(last_scan) < self.config.scan_interval {
            return outcome;
        }
        self.last_scan = Some(now);
        outcome.scanned = true;
        let idle: Vec<Attempt> = self
            .leases
            .iter()
            .filter(|lease| !lease.referenced)
            .map(|lease| lease.attempt)
            .collect();
        for lease in &mut self.leases {
            lease.referenced = false;
        }
        for attempt in idle {
            let Some(i) = self.leases.iter().position(|l| l.attempt == attempt) else {
                continue;
            };
            let id = self.leases[i].id.clone();
            if let Some(released) = self.release_at(i) {
                outcome.evicted_blocks += released.evicted_blocks;
                for event in released.events {
                    outcome.events.push((released.rank, event));
                }
            }
            outcome.reclaimed.push(id);
            self.counters.reaped_leases += 1;
        }
        outcome
    }

    pub fn stats(&self, rank: Rank) -> Option<LruStats> {
        let pool = self.pools.get(&rank)?;
        let resident = pool.alive();
        let inactive = pool.free_queue.len() as u64;
        let mut distinct: Vec<u64> = pool.cached.iter().map(|&(h, _)| h).collect();
        distinct.sort_unstable();
        distinct.dedup();
        Some(LruStats {
            capacity_blocks: pool.capacity,
            incarnation: pool.incarnation,
            resident_blocks: resident,
            active_blocks: resident - inactive,
            inactive_blocks: inactive,
            overcapacity_blocks: resident.saturating_sub(pool.capacity),
            indexed_blocks: distinct.len() as u64,
            leases: self.leases.iter().filter(|l| l.rank == rank).count() as u64,
        })
    }

    pub fn cached_hashes(&self, rank: Rank) -> Vec<(u64, usize)> {
        let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
        if let Some(pool) = self.pools.get(&rank) {
            for &(hash, _) in &pool.cached {
                *counts.entry(hash).or_default() += 1;
            }
        }
        counts.into_iter().collect()
    }

    pub fn counters(&self) -> LruCounters {
        self.counters
    }
}

fn stored(parent: Option<u64>, blocks: Vec<StoredBlock>) -> KvEvent {
    KvEvent::Stored {
        parent,
        blocks,
        tier: Tier::Device,
    }
}

fn removed_events(removed: Vec<u64>) -> Vec<KvEvent> {
    if removed.is_empty() {
        Vec::new()
    } else {
        vec![KvEvent::Removed {
            engine_hashes: removed,
            tier: Tier::Device,
        }]
    }
}
