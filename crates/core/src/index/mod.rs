//! The radix index: which rank holds which prompt prefix, on which tier (SPEC §3.2, §4).
//!
//! ## Identifiers
//! - **local hash**: hash of one block's tokens (SPEC §2), computed by kvroute from event tokens.
//! - **sequence hash**: a block together with everything before it. A node of the radix tree is
//!   identified by it: following children by local hash from the root is the same as looking up
//!   the chained sequence hashes, so the tree is stored flat, `sequence hash → node`.
//! - **engine hash**: the engine's opaque id for a block, kept per rank only to find the block
//!   again when the engine removes it or names it as a parent.
//! - **rank slot**: a dense, partition-local number for each rank, so holder sets can be bitsets.
//!
//! ## Operations and costs
//! - `apply(rank, event)`: O(blocks) hash-map operations. Stores are reference counted per
//!   `(rank, tier, engine hash)`; a block leaves a rank's tier when removed as often as stored.
//! - `find_matches(sequence_hashes)`: one hash lookup per prompt block (independent lookups, so
//!   the processor overlaps their cache misses), plus per block O(min(holders, ranks/64)) work to
//!   intersect the set of ranks still matching. It stops at the first block nobody holds.
//! - Memory is bounded by `max_blocks` nodes per index (one index per partition): past it the
//!   oldest nodes are evicted, counted in the outcome.
//!
//! ## Invariants
//! - A node exists iff some rank holds it on some tier; its holder set is exact per tier.
//! - A rank's entry for an engine hash points at one node and carries a store count per tier; the
//!   holder bit of that tier is set iff the count of some entry of that rank on that node is > 0.
//!   Two engine hashes of one rank on the same node ("aliases") are counted in `alias_counts`.
//! - Overlap is contiguous from the first block: a rank's overlap on a tier is the depth of the
//!   first prompt block it does not hold there (tiers cumulative: device ⊆ host ⊆ disk).

mod holders;
pub mod reference;

use crate::event::{KvEvent, Rank, StoredBlock, Tier};
use crate::hash::chain;
use hashbrown::HashMap;
use holders::{Holders, TierMask, entry_mask, entry_slot};
use std::collections::VecDeque;

/// Default cap on indexed blocks (nodes) per partition.
pub const DEFAULT_MAX_BLOCKS: usize = 1 << 22;

/// Marks a free node slot.
const FREE_GENERATION_BIT: u32 = 1 << 31;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Cap on distinct indexed blocks; the oldest are evicted beyond it.
    pub max_blocks: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_blocks: DEFAULT_MAX_BLOCKS,
        }
    }
}

/// What applying events did, for metrics and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub cleared_ranks: u64,
    /// `Stored` events dropped because the rank does not hold the named parent.
    pub parent_block_not_found: u64,
    /// `Removed` hashes the rank does not hold on that tier.
    pub unknown_removed_blocks: u64,
    /// Stores of an engine hash the rank already held under a different prefix (re-pointed).
    pub engine_hash_conflicts: u64,
    /// Blocks evicted because the index exceeded its block cap.
    pub evicted_blocks: u64,
    /// Events refused because the partition has too many ranks.
    pub rank_capacity_exceeded: u64,
}

impl ApplyOutcome {
    pub fn merge(&mut self, other: &ApplyOutcome) {
        self.stored_blocks += other.stored_blocks;
        self.removed_blocks += other.removed_blocks;
        self.cleared_ranks += other.cleared_ranks;
        self.parent_block_not_found += other.parent_block_not_found;
        self.unknown_removed_blocks += other.unknown_removed_blocks;
        self.engine_hash_conflicts += other.engine_hash_conflicts;
        self.evicted_blocks += other.evicted_blocks;
        self.rank_capacity_exceeded += other.rank_capacity_exceeded;
    }
}

/// One rank's overlap with a prompt, in blocks, per cumulative tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankOverlap {
    pub rank: Rank,
    /// Leading blocks held on the device.
    pub device_blocks: u32,
    /// Leading blocks held on the device or the host (≥ device).
    pub host_blocks: u32,
    /// Leading blocks held on any tier (≥ host).
    pub disk_blocks: u32,
}

/// The answer of [`RadixIndex::find_matches`]: every rank with a non-zero overlap.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Matches {
    pub ranks: Vec<RankOverlap>,
}

impl Matches {
    /// The deepest overlap of any rank on any tier.
    pub fn longest_matched(&self) -> u32 {
        self.ranks.iter().map(|r| r.disk_blocks).max().unwrap_or(0)
    }

    pub fn get(&self, rank: Rank) -> Option<&RankOverlap> {
        self.ranks.iter().find(|r| r.rank == rank)
    }
}

#[derive(Debug, Clone)]
struct Node {
    sequence_hash: u64,
    local_hash: u64,
    /// Sequence hash of the parent block; meaningful only when `depth > 0`.
    parent_sequence_hash: u64,
    depth: u32,
    /// Bumped each time the slot is reused; `FREE_GENERATION_BIT` marks a free slot.
    generation: u32,
    holders: Holders,
}

/// A rank's reference to one node, under one engine hash.
#[derive(Debug, Clone, Copy)]
struct BlockRef {
    node: u32,
    generation: u32,
    /// Store counts per tier (device, host, disk).
    counts: [u16; 3],
}

impl BlockRef {
    fn mask(&self) -> TierMask {
        let mut mask = 0;
        for (t, &c) in self.counts.iter().enumerate() {
            if c > 0 {
                mask |= 1 << t;
            }
        }
        mask
    }
}

#[derive(Debug, Default)]
struct RankSlot {
    rank: Option<Rank>,
    blocks: HashMap<u64, BlockRef>,
    /// For nodes referenced by two or more engine hashes of this rank ("aliases"; almost never):
    /// per tier the number of those entries holding the tier, then the number of entries.
    alias_counts: HashMap<u32, [u16; 4]>,
    /// Entries in `blocks` that point at evicted nodes; compacted when they pile up.
    stale: usize,
}

/// The prefix index of one partition.
#[derive(Debug, Default)]
pub struct RadixIndex {
    config: IndexConfig,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    by_sequence: HashMap<u64, u32>,
    slots: Vec<RankSlot>,
    slot_of: HashMap<Rank, u32>,
    free_slots: Vec<u32>,
    /// Node creation order, for evicting the oldest past the cap. May hold entries of freed
    /// nodes (skipped by generation); compacted when it exceeds twice the live nodes.
    creation_order: VecDeque<(u32, u32)>,
    live_nodes: usize,
}

impl RadixIndex {
    pub fn new(config: IndexConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    pub fn config(&self) -> IndexConfig {
        self.config
    }

    /// Number of distinct indexed blocks.
    pub fn block_count(&self) -> usize {
        self.live_nodes
    }

    /// Number of `(block, rank)` pairs held (engine-hash entries, over all tiers).
    pub fn held_pairs(&self) -> usize {
        self.slots.iter().map(|s| s.blocks.len() - s.stale).sum()
    }

    /// Ranks that hold at least one block.
    pub fn ranks(&self) -> Vec<Rank> {
        self.slots
            .iter()
            .filter(|s| !s.blocks.is_empty())
            .filter_map(|s| s.rank)
            .collect()
    }

    /// Blocks held by one rank (any tier).
    pub fn rank_block_count(&self, rank: Rank) -> usize {
        self.slot_of.get(&rank).map_or(0, |&s| {
            self.slots[s as usize].blocks.len() - self.slots[s as usize].stale
        })
    }

    fn slot_for(&mut self, rank: Rank) -> Option<u32> {
        if let Some(&slot) = self.slot_of.get(&rank) {
            return Some(slot);
        }
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                let slot = u32::try_from(self.slots.len()).ok()?;
                if slot >= holders::MAX_RANK_SLOTS {
                    return None;
                }
                self.slots.push(RankSlot::default());
                slot
            }
        };
        self.slots[slot as usize].rank = Some(rank);
        self.slot_of.insert(rank, slot);
        Some(slot)
    }

    fn node_is_live(&self, node: u32, generation: u32) -> bool {
        self.nodes
            .get(node as usize)
            .is_some_and(|n| n.generation == generation)
    }

    /// Applies one event of one rank.
    pub fn apply(&mut self, rank: Rank, event: &KvEvent) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        match event {
            KvEvent::Stored {
                parent,
                blocks,
                tier,
            } => {
                let Some(slot) = self.slot_for(rank) else {
                    outcome.rank_capacity_exceeded += 1;
                    return outcome;
                };
                self.store(slot, *parent, blocks, *tier, &mut outcome);
                self.enforce_cap(&mut outcome);
            }
            KvEvent::Removed {
                engine_hashes,
                tier,
            } => {
                if let Some(&slot) = self.slot_of.get(&rank) {
                    for &h in engine_hashes {
                        self.remove_one(slot, h, *tier, &mut outcome);
                    }
                } else {
                    outcome.unknown_removed_blocks += engine_hashes.len() as u64;
                }
            }
            KvEvent::Cleared => {
                if let Some(&slot) = self.slot_of.get(&rank) {
                    self.clear_slot(slot);
                    outcome.cleared_ranks += 1;
                }
            }
        }
        outcome
    }

    /// Applies a batch of events of one rank in order.
    pub fn apply_all(&mut self, rank: Rank, events: &[KvEvent]) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        for event in events {
            outcome.merge(&self.apply(rank, event));
        }
        outcome
    }

    fn store(
        &mut self,
        slot: u32,
        parent: Option<u64>,
        blocks: &[StoredBlock],
        tier: Tier,
        outcome: &mut ApplyOutcome,
    ) {
        let (mut previous, mut depth) = match parent {
            None => (None, 0u32),
            Some(parent_hash) => {
                let parent_ref = self.slots[slot as usize].blocks.get(&parent_hash).copied();
                match parent_ref {
                    Some(r) if self.node_is_live(r.node, r.generation) => {
                        let node = &self.nodes[r.node as usize];
                        (Some(node.sequence_hash), node.depth + 1)
                    }
                    _ => {
                        outcome.parent_block_not_found += 1;
                        return;
                    }
                }
            }
        };
        let t = tier.index();
        for block in blocks {
            let sequence_hash = match previous {
                None => block.local_hash,
                Some(p) => chain(p, block.local_hash),
            };
            let node = self.node_for(sequence_hash, block.local_hash, previous, depth);
            let generation = self.nodes[node as usize].generation;
            let existing = self.slots[slot as usize]
                .blocks
                .get(&block.engine_hash)
                .copied();
            match existing {
                Some(r) if r.node == node && r.generation == generation => {
                    if let Some(entry) =
                        self.slots[slot as usize].blocks.get_mut(&block.engine_hash)
                    {
                        entry.counts[t] = entry.counts[t].saturating_add(1);
                        if entry.counts[t] == 1 {
                            let mask = entry.mask();
                            let mut transitions = [0i8; 3];
                            transitions[t] = 1;
                            self.update_presence(slot, node, transitions, mask, 0);
                        }
                    }
                }
                other => {
                    if let Some(old) = other {
                        self.slots[slot as usize].blocks.remove(&block.engine_hash);
                        if self.node_is_live(old.node, old.generation) {
                            outcome.engine_hash_conflicts += 1;
                            self.release_entry(slot, old);
                        } else {
                            self.slots[slot as usize].stale =
                                self.slots[slot as usize].stale.saturating_sub(1);
                        }
                    }
                    let held = self.nodes[node as usize].holders.mask_of(slot);
                    let rank_slot = &mut self.slots[slot as usize];
                    if held != 0 && !rank_slot.alias_counts.contains_key(&node) {
                        // A second engine hash of this rank for the same block: from now on
                        // count this node's entries explicitly.
                        let mut counts = [0u16; 4];
                        for (i, c) in counts.iter_mut().take(3).enumerate() {
                            *c = u16::from(held & (1 << i) != 0);
                        }
                        counts[3] = 1;
                        rank_slot.alias_counts.insert(node, counts);
                    }
                    let mut counts = [0u16; 3];
                    counts[t] = 1;
                    let entry = BlockRef {
                        node,
                        generation,
                        counts,
                    };
                    rank_slot.blocks.insert(block.engine_hash, entry);
                    let mut transitions = [0i8; 3];
                    transitions[t] = 1;
                    self.update_presence(slot, node, transitions, entry.mask(), 1);
                }
            }
            outcome.stored_blocks += 1;
            previous = Some(sequence_hash);
            depth += 1;
        }
    }

    fn node_for(
        &mut self,
        sequence_hash: u64,
        local_hash: u64,
        parent: Option<u64>,
        depth: u32,
    ) -> u32 {
        if let Some(&node) = self.by_sequence.get(&sequence_hash) {
            return node;
        }
        let fresh = Node {
            sequence_hash,
            local_hash,
            parent_sequence_hash: parent.unwrap_or(0),
            depth,
            generation: 0,
            holders: Holders::default(),
        };
        let node = match self.free_nodes.pop() {
            Some(node) => {
                let slot = &mut self.nodes[node as usize];
                let generation =
                    (slot.generation & !FREE_GENERATION_BIT).wrapping_add(1) & !FREE_GENERATION_BIT;
                *slot = Node {
                    generation,
                    ..fresh
                };
                node
            }
            None => {
                self.nodes.push(fresh);
                (self.nodes.len() - 1) as u32
            }
        };
        self.by_sequence.insert(sequence_hash, node);
        self.creation_order
            .push_back((node, self.nodes[node as usize].generation));
        self.live_nodes += 1;
        node
    }

    /// Records that one entry of `slot` on `node` changed which tiers it holds (`transitions`:
    /// +1 gained, -1 lost), with `entry_mask` its tiers afterwards and `entry_delta` +1 for a new
    /// entry, -1 for a dropped one. Updates the node's holder set and frees an empty node.
    fn update_presence(
        &mut self,
        slot: u32,
        node: u32,
        transitions: [i8; 3],
        entry_mask: TierMask,
        entry_delta: i8,
    ) {
        let rank_slots = self.slots.len();
        let rank_slot = &mut self.slots[slot as usize];
        let mask = match rank_slot.alias_counts.get_mut(&node) {
            Some(counts) => {
                let mut mask = 0;
                for (t, &d) in transitions.iter().enumerate() {
                    counts[t] = counts[t].saturating_add_signed(i16::from(d));
                    if counts[t] > 0 {
                        mask |= 1 << t;
                    }
                }
                counts[3] = counts[3].saturating_add_signed(i16::from(entry_delta));
                if counts[3] == 0 {
                    rank_slot.alias_counts.remove(&node);
                }
                mask
            }
            None => entry_mask,
        };
        let n = &mut self.nodes[node as usize];
        n.holders.set_mask(slot, mask, rank_slots);
        if n.holders.is_empty() {
            self.free_node(node);
        }
    }

    /// Takes a (live) entry that was just removed from the rank's map out of its node.
    fn release_entry(&mut self, slot: u32, entry: BlockRef) {
        let mut transitions = [0i8; 3];
        for (t, &c) in entry.counts.iter().enumerate() {
            if c > 0 {
                transitions[t] = -1;
            }
        }
        self.update_presence(slot, entry.node, transitions, 0, -1);
    }

    fn remove_one(&mut self, slot: u32, engine_hash: u64, tier: Tier, outcome: &mut ApplyOutcome) {
        let t = tier.index();
        let Some(entry) = self.slots[slot as usize].blocks.get(&engine_hash).copied() else {
            outcome.unknown_removed_blocks += 1;
            return;
        };
        if !self.node_is_live(entry.node, entry.generation) {
            // The block was evicted by the cap; forget the stale entry.
            let rank_slot = &mut self.slots[slot as usize];
            rank_slot.blocks.remove(&engine_hash);
            rank_slot.stale = rank_slot.stale.saturating_sub(1);
            outcome.unknown_removed_blocks += 1;
            return;
        }
        if entry.counts[t] == 0 {
            outcome.unknown_removed_blocks += 1;
            return;
        }
        outcome.removed_blocks += 1;
        let mut updated = entry;
        updated.counts[t] -= 1;
        if updated.counts[t] > 0 {
            if let Some(e) = self.slots[slot as usize].blocks.get_mut(&engine_hash) {
                *e = updated;
            }
            return;
        }
        let mut transitions = [0i8; 3];
        transitions[t] = -1;
        let mask = updated.mask();
        let entry_delta = if mask == 0 {
            self.slots[slot as usize].blocks.remove(&engine_hash);
            -1
        } else {
            if let Some(e) = self.slots[slot as usize].blocks.get_mut(&engine_hash) {
                *e = updated;
            }
            0
        };
        self.update_presence(slot, entry.node, transitions, mask, entry_delta);
    }

    fn clear_slot(&mut self, slot: u32) {
        let rank_slots = self.slots.len();
        let blocks = std::mem::take(&mut self.slots[slot as usize].blocks);
        for entry in blocks.values() {
            if !self.node_is_live(entry.node, entry.generation) {
                continue;
            }
            let n = &mut self.nodes[entry.node as usize];
            n.holders.set_mask(slot, 0, rank_slots);
            if n.holders.is_empty() {
                self.free_node(entry.node);
            }
        }
        let rank_slot = &mut self.slots[slot as usize];
        rank_slot.alias_counts = HashMap::new();
        rank_slot.stale = 0;
        // Keep the allocation when it is modest: a cleared rank usually fills up again.
        let mut blocks = blocks;
        blocks.clear();
        if blocks.capacity() > 4096 {
            blocks = HashMap::new();
        }
        rank_slot.blocks = blocks;
    }

    /// Removes every block of a rank and forgets the rank (worker deleted).
    pub fn remove_rank(&mut self, rank: Rank) -> usize {
        let Some(slot) = self.slot_of.remove(&rank) else {
            return 0;
        };
        let held = self.slots[slot as usize].blocks.len() - self.slots[slot as usize].stale;
        self.clear_slot(slot);
        let rank_slot = &mut self.slots[slot as usize];
        rank_slot.rank = None;
        rank_slot.blocks = HashMap::new();
        self.free_slots.push(slot);
        held
    }

    /// Removes every rank of a worker. Returns the number of `(block, rank)` pairs dropped.
    pub fn remove_worker(&mut self, worker_id: u64) -> usize {
        let ranks: Vec<Rank> = self
            .slot_of
            .keys()
            .filter(|r| r.worker_id == worker_id)
            .copied()
            .collect();
        ranks.into_iter().map(|r| self.remove_rank(r)).sum()
    }

    fn free_node(&mut self, node: u32) {
        let n = &mut self.nodes[node as usize];
        if n.generation & FREE_GENERATION_BIT != 0 {
            return;
        }
        self.by_sequence.remove(&n.sequence_hash);
        n.generation |= FREE_GENERATION_BIT;
        n.holders = Holders::default();
        self.free_nodes.push(node);
        self.live_nodes -= 1;
    }

    fn enforce_cap(&mut self, outcome: &mut ApplyOutcome) {
        while self.live_nodes > self.config.max_blocks {
            let Some((node, generation)) = self.creation_order.pop_front() else {
                break;
            };
            if !self.node_is_live(node, generation) {
                continue;
            }
            self.evict_node(node);
            outcome.evicted_blocks += 1;
        }
        if self.creation_order.len() > 2 * self.live_nodes + 1024 {
            let nodes = &self.nodes;
            self.creation_order
                .retain(|&(n, g)| nodes.get(n as usize).is_some_and(|x| x.generation == g));
        }
    }

    /// Drops a node for every rank holding it; their map entries go stale and are compacted later.
    fn evict_node(&mut self, node: u32) {
        let holders = self.nodes[node as usize].holders.entries();
        self.free_node(node);
        for (slot, _) in holders {
            let nodes = &self.nodes;
            let rank_slot = &mut self.slots[slot as usize];
            let entries = rank_slot
                .alias_counts
                .remove(&node)
                .map_or(1, |c| usize::from(c[3]));
            rank_slot.stale += entries;
            if rank_slot.stale > 1024 && rank_slot.stale * 2 > rank_slot.blocks.len() {
                rank_slot.blocks.retain(|_, r| {
                    nodes
                        .get(r.node as usize)
                        .is_some_and(|x| x.generation == r.generation)
                });
                rank_slot.stale = 0;
            }
        }
    }
}

/// Number of prompt blocks whose nodes are looked up together, so their cache misses overlap.
const LOOKUP_CHUNK: usize = 32;

/// The ranks still matching during a lookup, per cumulative tier (0 device, 1 host, 2 any), as
/// bitsets over rank slots, with the depth at which each rank stopped matching.
struct Walk {
    alive: [Vec<u64>; 3],
    count: [usize; 3],
    ends: Vec<[u32; 3]>,
    /// Words of `alive[2]` outside `lo..hi` are zero.
    lo: usize,
    hi: usize,
}

impl Walk {
    fn new(slots: usize) -> Self {
        let words = slots.div_ceil(64);
        Self {
            alive: [vec![0; words], vec![0; words], vec![0; words]],
            count: [0; 3],
            ends: vec![[0; 3]; slots],
            lo: 0,
            hi: words,
        }
    }

    fn start(&mut self, holders: &Holders) {
        for (slot, mask) in holders.entries() {
            let (w, bit) = ((slot / 64) as usize, 1u64 << (slot % 64));
            for t in 0..3 {
                if cumulative(mask, t) {
                    self.alive[t][w] |= bit;
                    self.count[t] += 1;
                }
            }
        }
        self.shrink_range();
    }

    fn shrink_range(&mut self) {
        while self.lo < self.hi && self.alive[2][self.lo] == 0 {
            self.lo += 1;
        }
        while self.hi > self.lo && self.alive[2][self.hi - 1] == 0 {
            self.hi -= 1;
        }
    }

    fn drop_bits(&mut self, t: usize, w: usize, mut dropped: u64, depth: u32) {
        self.count[t] -= dropped.count_ones() as usize;
        while dropped != 0 {
            let b = dropped.trailing_zeros() as usize;
            dropped &= dropped - 1;
            self.ends[w * 64 + b][t] = depth;
        }
    }

    /// Intersects the alive sets with the holders of the block at `depth`.
    fn step(&mut self, holders: &Holders, depth: u32) {
        match holders {
            Holders::Sparse(entries) => {
                let mut kept = [0usize; 3];
                for &e in entries {
                    let (slot, mask) = (entry_slot(e), entry_mask(e));
                    let (w, bit) = ((slot / 64) as usize, 1u64 << (slot % 64));
                    for (t, k) in kept.iter_mut().enumerate() {
                        if cumulative(mask, t) && self.alive[t].get(w).is_some_and(|a| a & bit != 0)
                        {
                            *k += 1;
                        }
                    }
                }
                for (t, &kept_t) in kept.iter().enumerate() {
                    if kept_t == self.count[t] {
                        continue;
                    }
                    let mut fresh = vec![0u64; self.hi - self.lo];
                    for &e in entries {
                        let (slot, mask) = (entry_slot(e), entry_mask(e));
                        let (w, bit) = ((slot / 64) as usize, 1u64 << (slot % 64));
                        if cumulative(mask, t)
                            && w >= self.lo
                            && w < self.hi
                            && self.alive[t][w] & bit != 0
                        {
                            fresh[w - self.lo] |= bit;
                        }
                    }
                    for w in self.lo..self.hi {
                        let before = self.alive[t][w];
                        let after = fresh[w - self.lo];
                        if before != after {
                            self.alive[t][w] = after;
                            self.drop_bits(t, w, before & !after, depth);
                        }
                    }
                }
            }
            Holders::Dense(dense) => {
                for t in 0..3 {
                    if self.count[t] == 0 {
                        continue;
                    }
                    for w in self.lo..self.hi {
                        let before = self.alive[t][w];
                        if before == 0 {
                            continue;
                        }
                        let after = before & dense.cumulative_word(t, w);
                        if after != before {
                            self.alive[t][w] = after;
                            self.drop_bits(t, w, before & !after, depth);
                        }
                    }
                }
            }
        }
        self.shrink_range();
    }

    /// Every rank still alive matched all blocks up to `depth`.
    fn finish(&mut self, depth: u32) {
        for t in 0..3 {
            for w in self.lo..self.hi {
                let mut bits = self.alive[t][w];
                while bits != 0 {
                    let b = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    self.ends[w * 64 + b][t] = depth;
                }
            }
        }
    }
}

/// Whether a holder with tiers `mask` is in cumulative tier `t`.
#[inline]
fn cumulative(mask: TierMask, t: usize) -> bool {
    mask & ((2u8 << t) - 1) != 0
}

impl RadixIndex {
    /// Each rank's overlap with a prompt given by its sequence hashes: the number of leading
    /// blocks it holds, per cumulative tier. Ranks with no overlap are left out.
    pub fn find_matches(&self, sequence_hashes: &[u64]) -> Matches {
        let Some(&first) = sequence_hashes
            .first()
            .and_then(|h| self.by_sequence.get(h))
        else {
            return Matches::default();
        };
        let mut walk = Walk::new(self.slots.len());
        walk.start(&self.nodes[first as usize].holders);
        let mut depth = 1usize;
        let mut chunk = [0u32; LOOKUP_CHUNK];
        'walk: while depth < sequence_hashes.len() && walk.count[2] > 0 {
            let end = (depth + LOOKUP_CHUNK).min(sequence_hashes.len());
            let mut found = 0;
            for (i, h) in sequence_hashes[depth..end].iter().enumerate() {
                match self.by_sequence.get(h) {
                    Some(&node) => {
                        chunk[i] = node;
                        found += 1;
                    }
                    None => break,
                }
            }
            for &node in &chunk[..found] {
                walk.step(&self.nodes[node as usize].holders, depth as u32);
                depth += 1;
                if walk.count[2] == 0 {
                    break 'walk;
                }
            }
            if depth < end {
                break;
            }
        }
        walk.finish(depth as u32);
        let ranks = walk
            .ends
            .iter()
            .enumerate()
            .filter(|(_, e)| e[2] > 0)
            .filter_map(|(slot, e)| {
                self.slots[slot].rank.map(|rank| RankOverlap {
                    rank,
                    device_blocks: e[0],
                    host_blocks: e[1],
                    disk_blocks: e[2],
                })
            })
            .collect();
        Matches { ranks }
    }

    /// [`find_matches`](Self::find_matches) for a prompt given by its local hashes.
    pub fn find_matches_local(&self, local_hashes: &[u64]) -> Matches {
        self.find_matches(&crate::hash::sequence_hashes(local_hashes))
    }

    /// The index as events: per rank, `Stored` events that re-create what it holds (parents
    /// before children, one event per block and tier with its store count), for recovery.
    /// Blocks whose parent the rank no longer holds cannot be re-stored under it and are left out;
    /// they add nothing to any overlap (overlap is contiguous from the first block).
    pub fn dump(&self) -> Vec<(Rank, KvEvent)> {
        let mut out = Vec::new();
        for (slot_index, slot) in self.slots.iter().enumerate() {
            let Some(rank) = slot.rank else { continue };
            let _ = slot_index;
            let mut entries: Vec<(u32, u64, BlockRef)> = slot
                .blocks
                .iter()
                .filter(|(_, r)| self.node_is_live(r.node, r.generation))
                .map(|(&h, r)| (self.nodes[r.node as usize].depth, h, *r))
                .collect();
            entries.sort_unstable_by_key(|&(depth, h, _)| (depth, h));
            // Engine hash of this rank for each node, to name parents.
            let mut engine_of: HashMap<u64, u64> = HashMap::with_capacity(entries.len());
            for &(_, h, r) in &entries {
                engine_of
                    .entry(self.nodes[r.node as usize].sequence_hash)
                    .or_insert(h);
            }
            for &(depth, engine_hash, r) in &entries {
                let node = &self.nodes[r.node as usize];
                let parent = if depth == 0 {
                    None
                } else {
                    match engine_of.get(&node.parent_sequence_hash) {
                        Some(&p) => Some(p),
                        None => continue,
                    }
                };
                for tier in Tier::ALL {
                    for _ in 0..r.counts[tier.index()] {
                        out.push((
                            rank,
                            KvEvent::Stored {
                                parent,
                                blocks: vec![StoredBlock {
                                    engine_hash,
                                    local_hash: node.local_hash,
                                }],
                                tier,
                            },
                        ));
                    }
                }
            }
        }
        out
    }

    /// Estimated heap and inline bytes of the index (maps at capacity, nodes, holder sets).
    pub fn memory_bytes(&self) -> usize {
        let map_entry = |k: usize, v: usize| k + v + 1;
        let nodes = self.nodes.capacity() * std::mem::size_of::<Node>()
            + self
                .nodes
                .iter()
                .map(|n| n.holders.heap_bytes())
                .sum::<usize>();
        let by_sequence = self.by_sequence.capacity() * map_entry(8, 4);
        let slots = self
            .slots
            .iter()
            .map(|s| {
                std::mem::size_of::<RankSlot>()
                    + s.blocks.capacity() * map_entry(8, std::mem::size_of::<BlockRef>())
                    + s.alias_counts.capacity() * map_entry(4, 8)
            })
            .sum::<usize>();
        let order = self.creation_order.capacity() * 8;
        nodes + by_sequence + slots + order + self.free_nodes.capacity() * 4
    }
}

#[cfg(test)]
mod tests;
