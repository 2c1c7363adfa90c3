//! The TTL approximate cache model (SPEC §9.1), one per partition.
//!
//! Each booked request inserts its prompt's block chain for the chosen rank; every block of the
//! chain then expires `ttl` (120 s) after that insert. A re-insert refreshes the expiry of the
//! blocks already present and stores only the missing ones. A size cap (2^20 blocks per
//! partition) prunes the earliest-expiring blocks down to 80 % of the cap.
//!
//! ## Operations
//! - [`TtlModel::insert`]: `Stored` events for the missing blocks (one per run of consecutive
//!   missing positions, chained under the previous prompt block), then `Removed` events for any
//!   blocks the cap pruned.
//! - [`TtlModel::expire`]: `Removed` events (one per rank) for every block whose expiry is `<= now`.
//! - [`TtlModel::remove_rank`]: forgets a rank silently; the caller clears it in the index.
//!
//! ## Order
//! Every block of one insert gets the same expiry `E = max(now + ttl, latest E so far)`: model
//! time never runs backwards, so expiries only grow and the blocks form a **queue**: an insert
//! moves its blocks (refreshed and new) to the back, deepest first; expiry and pruning pop the
//! front. Blocks thus leave earliest expiry first; among equal expiries, least recently inserted
//! first; within one insert, deepest first. The queue is an intrusive doubly linked list through
//! the entry slots, so every step is O(1).
//!
//! ## Invariants
//! - A `(rank, sequence hash)` is present at most once, in exactly one queue slot; `ranks` maps it
//!   to that slot. Every slot index stored anywhere is `< slots.len()` (slots are reused through
//!   `free_slots`, never shrunk).
//! - The queue is sorted by expiry (non-decreasing from the front).
//! - For chained hashes the prediction stays prefix-closed: inserting a child moves its whole
//!   prefix behind it, so a parent always leaves after its children and no `Stored` event ever
//!   names a parent the index has already dropped.
//!
//! ## Complexity
//! `P` = blocks of a prompt. Hash maps are O(1) expected. `insert`: O(P), plus O(1) per pruned
//! block. `expire`: O(k + 1) for `k` expired blocks; live blocks are never scanned. `remove_rank`:
//! O(b) for the rank's `b` blocks. Memory: one slot (~56 bytes) and one hash entry per block.

use std::time::{Duration, Instant};

use hashbrown::HashMap;

use super::{ApproxError, group_removals, stored_runs};
use crate::event::{KvEvent, Rank};

/// Default lifetime of a predicted block after its last insert.
pub const DEFAULT_TTL: Duration = Duration::from_secs(120);
/// Default cap on predicted blocks per partition.
pub const DEFAULT_MAX_BLOCKS: usize = 1 << 20;
/// Default share of the cap that pruning brings the model down to.
pub const DEFAULT_PRUNE_TO_PERCENT: u8 = 80;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtlConfig {
    /// How long a block stays predicted after its last insert.
    pub ttl: Duration,
    /// Cap on predicted blocks (all ranks of the partition together).
    pub max_blocks: usize,
    /// Past the cap, the earliest-expiring blocks are pruned down to this percentage of it.
    pub prune_to_percent: u8,
}

impl Default for TtlConfig {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            max_blocks: DEFAULT_MAX_BLOCKS,
            prune_to_percent: DEFAULT_PRUNE_TO_PERCENT,
        }
    }
}

impl TtlConfig {
    /// Block count that pruning brings the model down to.
    pub fn prune_target(&self) -> usize {
        let percent = usize::from(self.prune_to_percent.min(100));
        // Multiply first only when it cannot overflow; huge caps lose nothing by dividing first.
        match self.max_blocks.checked_mul(percent) {
            Some(product) => product / 100,
            None => self.max_blocks / 100 * percent,
        }
    }
}

/// What one operation did: the events to apply, in order, and counts for metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TtlOutcome {
    pub events: Vec<(Rank, KvEvent)>,
    /// Blocks newly predicted (published as `Stored`).
    pub stored_blocks: u64,
    /// Blocks already present whose expiry was refreshed.
    pub refreshed_blocks: u64,
    /// Blocks removed because their TTL ran out.
    pub expired_blocks: u64,
    /// Blocks removed by the size cap.
    pub pruned_blocks: u64,
}

/// Totals since the model was created, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TtlCounters {
    pub stored_blocks: u64,
    pub refreshed_blocks: u64,
    pub expired_blocks: u64,
    pub pruned_blocks: u64,
    /// Times the cap was exceeded (each followed by one pruning pass).
    pub prune_passes: u64,
}

/// Marks the ends of the queue.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Entry {
    rank: Rank,
    hash: u64,
    expires_at: Instant,
    /// The insert that last took this entry (detects a hash repeated inside one prompt).
    batch: u64,
    /// Queue neighbours (`NIL` at the ends).
    prev: u32,
    next: u32,
}

/// Entry slots and the expiry queue threaded through them. Every slot index stored anywhere is
/// `< slots.len()` (slots are reused through `free_slots`, never shrunk).
#[derive(Debug, Clone)]
struct Queue {
    slots: Vec<Entry>,
    free_slots: Vec<u32>,
    /// Front: expires first.
    head: u32,
    tail: u32,
    /// Allocated entries.
    len: usize,
}

impl Queue {
    fn new() -> Self {
        Self {
            slots: Vec::new(),
            free_slots: Vec::new(),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Allocates an entry, not yet linked.
    fn alloc(&mut self, entry: Entry) -> u32 {
        self.len += 1;
        match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot as usize] = entry;
                slot
            }
            None => {
                self.slots.push(entry);
                u32::try_from(self.slots.len() - 1).unwrap_or(NIL)
            }
        }
    }

    /// Frees an unlinked entry.
    fn free(&mut self, slot: u32) {
        self.len -= 1;
        self.free_slots.push(slot);
    }

    fn push_back(&mut self, slot: u32) {
        let tail = self.tail;
        let entry = &mut self.slots[slot as usize];
        entry.prev = tail;
        entry.next = NIL;
        match tail {
            NIL => self.head = slot,
            tail => self.slots[tail as usize].next = slot,
        }
        self.tail = slot;
    }

    /// Unlinks a linked entry.
    fn unlink(&mut self, slot: u32) {
        let entry = &mut self.slots[slot as usize];
        let (prev, next) = (entry.prev, entry.next);
        entry.prev = NIL;
        entry.next = NIL;
        match prev {
            NIL => self.head = next,
            prev => self.slots[prev as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            next => self.slots[next as usize].prev = prev,
        }
    }
}

/// The TTL model of one partition. See the module doc.
#[derive(Debug, Clone)]
pub struct TtlModel {
    config: TtlConfig,
    /// rank → sequence hash → slot.
    ranks: HashMap<Rank, HashMap<u64, u32>>,
    queue: Queue,
    next_batch: u64,
    latest_expiry: Option<Instant>,
    counters: TtlCounters,
}

impl Default for TtlModel {
    fn default() -> Self {
        Self::new(TtlConfig::default())
    }
}

impl TtlModel {
    pub fn new(config: TtlConfig) -> Self {
        Self {
            config,
            ranks: HashMap::new(),
            queue: Queue::new(),
            next_batch: 0,
            latest_expiry: None,
            counters: TtlCounters::default(),
        }
    }

    pub fn config(&self) -> &TtlConfig {
        &self.config
    }

    /// Inserts a booked prompt's chain for `rank`: refreshes present blocks, stores missing ones
    /// (`Stored` events), then prunes if the cap is exceeded (`Removed` events, possibly for other
    /// ranks). Apply the events in order.
    pub fn insert(
        &mut self,
        rank: Rank,
        local_hashes: &[u64],
        sequence_hashes: &[u64],
        now: Instant,
    ) -> Result<TtlOutcome, ApproxError> {
        if local_hashes.len() != sequence_hashes.len() {
            return Err(ApproxError::LengthMismatch {
                local: local_hashes.len(),
                sequence: sequence_hashes.len(),
            });
        }
        let mut outcome = TtlOutcome::default();
        if sequence_hashes.is_empty() {
            return Ok(outcome);
        }
        let expires_at = now.checked_add(self.config.ttl).unwrap_or(now);
        let expires_at = self
            .latest_expiry
            .map_or(expires_at, |latest| latest.max(expires_at));
        self.latest_expiry = Some(expires_at);
        let batch_id = self.next_batch;
        self.next_batch += 1;

        // Take the chain's blocks out of the queue (or create them), then append them deepest
        // first.
        let mut batch = Vec::with_capacity(sequence_hashes.len());
        let mut new_positions = Vec::new();
        let blocks = self.ranks.entry(rank).or_default();
        for (position, &hash) in sequence_hashes.iter().enumerate() {
            let slot = match blocks.get(&hash) {
                Some(&slot) => {
                    if self.queue.slots[slot as usize].batch == batch_id {
                        continue; // repeated inside this prompt: taken already
                    }
                    self.queue.unlink(slot);
                    outcome.refreshed_blocks += 1;
                    slot
                }
                None => {
                    let slot = self.queue.alloc(Entry {
                        rank,
                        hash,
                        expires_at,
                        batch: batch_id,
                        prev: NIL,
                        next: NIL,
                    });
                    blocks.insert(hash, slot);
                    new_positions.push(position);
                    slot
                }
            };
            let entry = &mut self.queue.slots[slot as usize];
            entry.expires_at = expires_at;
            entry.batch = batch_id;
            batch.push(slot);
        }
        for &slot in batch.iter().rev() {
            self.queue.push_back(slot);
        }
        outcome.stored_blocks = new_positions.len() as u64;
        outcome.events = stored_runs(local_hashes, sequence_hashes, new_positions)
            .into_iter()
            .map(|event| (rank, event))
            .collect();
        self.counters.stored_blocks += outcome.stored_blocks;
        self.counters.refreshed_blocks += outcome.refreshed_blocks;
        if self.queue.len > self.config.max_blocks {
            self.counters.prune_passes += 1;
            let excess = self.queue.len.saturating_sub(self.config.prune_target());
            let pruned = self.pop_front(excess, None);
            outcome.pruned_blocks = pruned.len() as u64;
            self.counters.pruned_blocks += outcome.pruned_blocks;
            outcome.events.extend(group_removals(pruned));
        }
        Ok(outcome)
    }

    /// Removes every block whose expiry is `<= now`: one `Removed` event per rank.
    pub fn expire(&mut self, now: Instant) -> TtlOutcome {
        let expired = self.pop_front(usize::MAX, Some(now));
        let expired_blocks = expired.len() as u64;
        self.counters.expired_blocks += expired_blocks;
        TtlOutcome {
            events: group_removals(expired),
            expired_blocks,
            ..TtlOutcome::default()
        }
    }

    /// Forgets every block of `rank` without events (the caller clears the rank in the index).
    /// Returns how many blocks it held.
    pub fn remove_rank(&mut self, rank: Rank) -> usize {
        let Some(blocks) = self.ranks.remove(&rank) else {
            return 0;
        };
        for &slot in blocks.values() {
            self.queue.unlink(slot);
            self.queue.free(slot);
        }
        blocks.len()
    }

    /// Blocks predicted in the whole partition.
    pub fn blocks(&self) -> usize {
        self.queue.len
    }

    /// Blocks predicted for one rank.
    pub fn rank_blocks(&self, rank: Rank) -> usize {
        self.ranks.get(&rank).map_or(0, HashMap::len)
    }

    /// Ranks with at least one predicted block.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// The sequence hashes predicted for `rank`, sorted (inspection and tests).
    pub fn cached_hashes(&self, rank: Rank) -> Vec<u64> {
        let mut hashes: Vec<u64> = self
            .ranks
            .get(&rank)
            .map(|blocks| blocks.keys().copied().collect())
            .unwrap_or_default();
        hashes.sort_unstable();
        hashes
    }

    /// When `rank`'s block `sequence_hash` expires, if predicted.
    pub fn expires_at(&self, rank: Rank, sequence_hash: u64) -> Option<Instant> {
        let slot = *self.ranks.get(&rank)?.get(&sequence_hash)?;
        Some(self.queue.slots[slot as usize].expires_at)
    }

    /// Every predicted `(rank, sequence hash)` in removal order, front first (inspection, tests).
    pub fn removal_order(&self) -> Vec<(Rank, u64)> {
        let mut order = Vec::with_capacity(self.queue.len);
        let mut slot = self.queue.head;
        while slot != NIL {
            let entry = &self.queue.slots[slot as usize];
            order.push((entry.rank, entry.hash));
            slot = entry.next;
        }
        order
    }

    pub fn counters(&self) -> TtlCounters {
        self.counters
    }

    /// Pops up to `limit` blocks from the front, stopping at the first block that expires after
    /// `deadline` (when given).
    fn pop_front(&mut self, limit: usize, deadline: Option<Instant>) -> Vec<(Rank, u64)> {
        let mut popped = Vec::new();
        while popped.len() < limit && self.queue.head != NIL {
            let slot = self.queue.head;
            let entry = self.queue.slots[slot as usize];
            if deadline.is_some_and(|deadline| entry.expires_at > deadline) {
                break;
            }
            self.queue.unlink(slot);
            self.queue.free(slot);
            if let Some(blocks) = self.ranks.get_mut(&entry.rank) {
                blocks.remove(&entry.hash);
                if blocks.is_empty() {
                    self.ranks.remove(&entry.rank);
                }
            }
            popped.push((entry.rank, entry.hash));
        }
        popped
    }
}
