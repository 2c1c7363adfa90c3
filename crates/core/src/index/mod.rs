//! The radix index: which rank holds which prompt prefix, on which tier (SPEC §3.2, §4).
//!
//! ## Identifiers
//! - **local hash**: hash of one block's tokens (SPEC §2), computed by kvroute from event tokens.
//! - **sequence hash**: a block together with everything before it. A node of the radix tree is
//!   identified by it: following children by local hash from the root is the same as looking up
//!   the chained sequence hashes, so the tree is stored flat, `sequence hash → node`.
//! - **engine hash**: the engine's opaque id for a block, kept only to find the block again when
//!   the engine removes it or names it as a parent.
//! - **canonical engine hash** of a node: the engine hash of the first engine store that created
//!   or first named it, unless another live node already has that one. Replicas of one model
//!   name a block alike, so it is usually every holder's engine hash.
//! - **rank slot**: a dense, partition-local number for each rank, so holder sets can be bitsets.
//!
//! ## Operations and costs
//! - `apply(rank, event)`: O(blocks) hash-table operations. Stores are reference counted per
//!   `(rank, tier, engine hash)`; a block leaves a rank's tier when removed as often as stored.
//!   One exception: a device store of a block the rank holds only under the selector's
//!   [`predicted_engine_hash`] replaces that entry (`selector/predict.rs`).
//! - `store_at(rank, parent, blocks, tier)`: the selector's predicted blocks, at given sequence
//!   hashes, skipping those the rank holds on the tier.
//!   The blocks of a `Stored` event are looked up a chunk at a time before they are stored, so
//!   the processor overlaps their cache misses; a block already indexed is usually found in the
//!   slot after its parent's node, without a lookup.
//! - `find_matches(sequence_hashes)`: one hash lookup per prompt block (a chunk at a time, for the
//!   same reason; skipped when the block's node is in the slot after the previous block's, as
//!   when a prompt's blocks arrived in one event), plus per block the work to intersect the set
//!   of ranks still matching with its holders (module `walk`): O(ranks / 64) word operations
//!   while many ranks match, O(matching ranks) once few do. It stops at the first block nobody
//!   still matching holds.
//! - Memory is bounded by `max_blocks` nodes per index (one index per partition): past it the
//!   oldest nodes are evicted, counted in the outcome.
//!
//! ## Implicit entries
//! A rank that holds a node under the node's canonical engine hash, once per tier, has no entry
//! of its own: the node's holder set says it holds it (and on which tiers), and `by_engine`
//! (canonical engine hash → node) finds it from the engine hash. Everything else is an explicit
//! entry in the rank's table: an engine hash that differs from the node's canonical one (an
//! engine hashing differently, a conflict, an alias), a second store on one tier (its count),
//! and the selector's predictions (which never become canonical). A rank's holding of a node is
//! explicit iff `explicit_nodes` names the node; it turns explicit ("materialized") when it
//! needs to, never back. Clearing a rank that holds nodes implicitly reads every node's holder
//! set once (the rank has no list of them): the price of not keeping one per pair.
//!
//! ## Memory (17 bytes per `(block, rank)` pair at 7,000 ranks on the Mooncake trace, where
//! replicas share every hash; [`RadixIndex::memory_bytes`] counts every table and vector at its
//! capacity)
//! - A node is 32 bytes: its sequence and local hashes, the low half of its parent's sequence
//!   hash (enough to find the parent again for [`RadixIndex::dump`], verified by re-chaining), and
//!   a 12-byte holder set that keeps up to three holders inline (module `holders`); larger sets
//!   live in an arena. Nodes live in fixed-size chunks, so the node store never over-allocates by
//!   more than one chunk.
//! - `sequence hash → node` is a table of 4-byte node numbers (the key is read from the node).
//! - Per node 8 bytes of canonical engine hash, and a 4-byte node number in `by_engine`.
//! - Each rank maps engine hash → 12-byte entry for its explicit holdings only: node number, the
//!   tiers it holds, and a flag when some tier was stored more than once (exact counts then live
//!   in a small side table).
//! - The creation order (for eviction) is 4 bytes a node.
//!
//! ## Invariants
//! - A node is live iff some rank holds it on some tier; its holder set is exact per tier.
//! - A rank's entry for an engine hash points at one node and holds a store count per tier; the
//!   holder bit of that tier is set iff the count of some entry of that rank on that node is > 0,
//!   or the rank holds the node implicitly (no entry on it) on that tier, then once.
//! - A rank holds a node implicitly only if the node has a canonical engine hash; `by_engine`
//!   holds exactly the live nodes that have one; a rank has at most one holding per engine hash
//!   (entry or implicit).
//!   Two engine hashes of one rank on the same node ("aliases") are counted in `alias_counts`.
//! - A freed node slot is not reused while anything may still point at it: it waits among the
//!   dead until a purge has dropped the rank entries left pointing at it by an eviction (stale
//!   entries) and its creation-order record. So an entry pointing at a dead node is known stale,
//!   and no generation numbers are needed.
//! - Overlap is contiguous from the first block: a rank's overlap on a tier is the depth of the
//!   first prompt block it does not hold there (tiers cumulative: device ⊆ host ⊆ disk).

mod chunked;
mod holders;
mod lookup;
#[cfg(any(test, feature = "reference"))]
pub mod reference;
mod remove;
mod walk;

use crate::event::{KvEvent, Rank, StoredBlock, Tier};
use crate::hash::chain;
use chunked::Chunked;
use hashbrown::{DefaultHashBuilder, HashMap, HashTable};
use holders::{ALLOCATION_OVERHEAD, HolderArena, Holders, TierMask};
use std::collections::VecDeque;
use std::hash::BuildHasher;
use walk::Walk;

/// Default cap on indexed blocks (nodes) per partition.
pub const DEFAULT_MAX_BLOCKS: usize = 1 << 22;

/// The engine hash under which the selector records a block it predicts a rank will hold (the
/// prompt it just booked there; `selector/predict.rs`): a bijection of the block's sequence
/// hash, so a rank has at most one such entry per block, and one an engine would name only by
/// a 2^-64 chance. [`RadixIndex::dump`] leaves these entries out.
pub fn predicted_engine_hash(sequence_hash: u64) -> u64 {
    // Each step is invertible: xor with a constant, multiplication by an odd number, xorshift.
    let x = (sequence_hash ^ 0x7072_6564_6963_7465).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^ (x >> 29)
}

/// Hard cap on indexed blocks whatever the configuration (node numbers have 28 bits, and dead
/// slots waiting for a purge add up to a quarter).
const MAX_LIVE_NODES: usize = 1 << 26;
/// Node slots that node numbers can address (28 bits in a rank's entry).
const NODE_SLOT_LIMIT: u32 = 1 << 28;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Cap on distinct indexed blocks; the oldest are evicted beyond it. Values above 2^26 act
    /// as 2^26.
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
    /// Device stores of a block the rank held only as predicted by the selector: the engine's
    /// entry replaced the predicted one ([`predicted_engine_hash`]).
    pub adopted_predictions: u64,
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
        self.adopted_predictions += other.adopted_predictions;
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

/// The answer of [`RadixIndex::find_matches_compact`]: the ranks listed (in rank order) and the
/// floor, whose members not listed matched `depth` blocks on every tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactMatches {
    pub listed: Vec<RankOverlap>,
    pub floor: Option<Floor>,
}

impl CompactMatches {
    /// The overlap of `rank` (`index`: the index that answered).
    pub fn get(&self, index: &RadixIndex, rank: Rank) -> Option<RankOverlap> {
        match self.listed.binary_search_by_key(&rank, |o| o.rank) {
            Ok(i) => Some(self.listed[i]),
            Err(_) => self
                .floor
                .as_ref()
                .filter(|f| index.floor_has(f, rank))
                .map(|f| f.overlap(rank)),
        }
    }
}

/// Ranks of one answer that matched the same number of blocks (module `walk`), as rank slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Floor {
    pub depth: u32,
    members: Vec<u64>,
    count: usize,
}

impl Floor {
    /// Members, listed ones included.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The members' words, to tell two floors apart cheaply (a cache key).
    pub fn words(&self) -> &[u64] {
        &self.members
    }

    fn has_slot(&self, slot: u32) -> bool {
        self.members
            .get((slot / 64) as usize)
            .is_some_and(|w| w >> (slot % 64) & 1 != 0)
    }

    /// A member's overlap when it is not listed.
    pub fn overlap(&self, rank: Rank) -> RankOverlap {
        RankOverlap {
            rank,
            device_blocks: self.depth,
            host_blocks: self.depth,
            disk_blocks: self.depth,
        }
    }
}

/// One indexed block. 32 bytes, aligned so that a node never straddles two cache lines.
#[derive(Debug, Clone, Copy, Default)]
#[repr(align(32))]
struct Node {
    sequence_hash: u64,
    local_hash: u64,
    /// Low 32 bits of the parent's sequence hash (meaningless for a first block, whose sequence
    /// hash equals its local hash). Enough to find the parent among a rank's blocks; the match is
    /// verified with [`chain`].
    parent_tag: u32,
    /// Empty iff the node is dead (freed) or not yet filled in.
    holders: Holders,
}

/// Nodes per chunk of the node store.
const CHUNK_BITS: u32 = 10;

/// Node slots in fixed-size chunks ([`Chunked`]).
#[derive(Debug, Default)]
struct Nodes {
    /// In chunks of `CHUNK` slots (`chunked.rs`).
    chunks: Chunked<Node, CHUNK_BITS>,
    len: u32,
    /// One bit per slot, set while the slot holds a node (from its allocation until it is
    /// freed): purges test liveness here, in a table that stays in cache, instead of reading
    /// every node a creation record or rank entry names (a cache miss each).
    allocated: Vec<u64>,
    /// Per slot, chunked like the nodes: the node's canonical engine hash, meaningful while its
    /// bit in `canonical_valid` is set (see "Implicit entries" in the module documentation).
    canonical: Chunked<u64, CHUNK_BITS>,
    canonical_valid: Vec<u64>,
}

impl Nodes {
    #[inline]
    fn get(&self, node: u32) -> &Node {
        &self.chunks[node as usize]
    }

    #[inline]
    fn get_mut(&mut self, node: u32) -> &mut Node {
        &mut self.chunks[node as usize]
    }

    #[inline]
    fn is_live(&self, node: u32) -> bool {
        !self.get(node).holders.is_empty()
    }

    /// Whether the slot holds a node (allocated and not freed). Equal to [`Self::is_live`]
    /// except while a node is being created, before it gets its first holder.
    #[inline]
    fn is_allocated(&self, node: u32) -> bool {
        self.allocated
            .get((node >> 6) as usize)
            .is_some_and(|w| w & (1 << (node & 63)) != 0)
    }

    /// Puts a node in a free slot.
    fn reuse(&mut self, slot: u32, node: Node) {
        *self.get_mut(slot) = node;
        self.set_allocated(slot, true);
    }

    /// The node's canonical engine hash, if it has one.
    #[inline]
    fn canonical(&self, node: u32) -> Option<u64> {
        let valid = self
            .canonical_valid
            .get((node >> 6) as usize)
            .is_some_and(|w| w & (1 << (node & 63)) != 0);
        valid.then(|| self.canonical_unchecked(node))
    }

    /// The canonical slot's value whether or not it is valid (for reading ahead).
    #[inline]
    fn canonical_unchecked(&self, node: u32) -> u64 {
        self.canonical[node as usize]
    }

    fn set_canonical(&mut self, node: u32, engine_hash: Option<u64>) {
        let word = (node >> 6) as usize;
        if word >= self.canonical_valid.len() {
            self.canonical_valid.resize(word + 1, 0);
        }
        match engine_hash {
            Some(e) => {
                self.canonical[node as usize] = e;
                self.canonical_valid[word] |= 1 << (node & 63);
            }
            None => self.canonical_valid[word] &= !(1 << (node & 63)),
        }
    }

    /// Marks a slot freed (its node's holders already cleared).
    fn mark_freed(&mut self, slot: u32) {
        self.set_allocated(slot, false);
    }

    #[inline]
    fn set_allocated(&mut self, node: u32, allocated: bool) {
        let word = (node >> 6) as usize;
        if word >= self.allocated.len() {
            self.allocated.resize(word + 1, 0);
        }
        if allocated {
            self.allocated[word] |= 1 << (node & 63);
        } else {
            self.allocated[word] &= !(1 << (node & 63));
        }
    }

    /// Puts a node in a fresh (never used) slot.
    fn push(&mut self, node: Node) -> u32 {
        self.chunks.push(node);
        self.canonical.push(0);
        self.len += 1;
        self.set_allocated(self.len - 1, true);
        self.len - 1
    }

    fn memory_bytes(&self) -> usize {
        self.chunks.memory_bytes()
            + self.allocated.capacity() * 8
            + self.canonical.memory_bytes()
            + self.canonical_valid.capacity() * 8
            + 2 * ALLOCATION_OVERHEAD
    }
}

/// A rank's entry for one engine hash (12 bytes): the node, the tiers it is stored on, and
/// whether some tier was stored more than once (its exact counts are then in
/// [`RankSlot::counts`]).
#[derive(Debug, Clone, Copy)]
struct BlockRef {
    engine_hash: [u32; 2],
    /// `node << 4 | multi << 3 | tier mask`.
    packed: u32,
}

const REF_NODE_SHIFT: u32 = 4;
const REF_MULTI: u32 = 1 << 3;
const REF_MASK: u32 = 0b111;

impl BlockRef {
    fn new(engine_hash: u64, node: u32, mask: TierMask) -> Self {
        Self {
            engine_hash: [engine_hash as u32, (engine_hash >> 32) as u32],
            packed: (node << REF_NODE_SHIFT) | u32::from(mask),
        }
    }

    #[inline]
    fn engine_hash(&self) -> u64 {
        u64::from(self.engine_hash[0]) | (u64::from(self.engine_hash[1]) << 32)
    }

    #[inline]
    fn node(&self) -> u32 {
        self.packed >> REF_NODE_SHIFT
    }

    #[inline]
    fn mask(&self) -> TierMask {
        (self.packed & REF_MASK) as TierMask
    }

    #[inline]
    fn multi(&self) -> bool {
        self.packed & REF_MULTI != 0
    }

    fn set_mask(&mut self, mask: TierMask) {
        self.packed = (self.packed & !REF_MASK) | u32::from(mask);
    }

    fn set_multi(&mut self, multi: bool) {
        if multi {
            self.packed |= REF_MULTI;
        } else {
            self.packed &= !REF_MULTI;
        }
    }
}

/// Node numbers per chunk of the creation-order queue.
const ORDER_CHUNK: usize = 4096;

/// A FIFO of node numbers in fixed-size chunks: growing never copies it nor doubles it.
#[derive(Debug, Default)]
struct ChunkedQueue {
    chunks: VecDeque<Vec<u32>>,
    /// Position of the front in the first chunk.
    head: usize,
}

impl ChunkedQueue {
    fn push_back(&mut self, node: u32) {
        match self.chunks.back_mut() {
            Some(chunk) if chunk.len() < ORDER_CHUNK => chunk.push(node),
            _ => {
                let mut chunk = Vec::with_capacity(ORDER_CHUNK);
                chunk.push(node);
                self.chunks.push_back(chunk);
            }
        }
    }

    fn pop_front(&mut self) -> Option<u32> {
        loop {
            let first = self.chunks.front()?;
            if let Some(&node) = first.get(self.head) {
                self.head += 1;
                return Some(node);
            }
            // A chunk is dropped once read, unless it is the one being filled.
            if first.len() < ORDER_CHUNK {
                return None;
            }
            self.chunks.pop_front();
            self.head = 0;
        }
    }

    fn retain(&mut self, mut keep: impl FnMut(u32) -> bool) {
        let old = std::mem::take(&mut self.chunks);
        let head = std::mem::take(&mut self.head);
        for (i, chunk) in old.into_iter().enumerate() {
            let from = if i == 0 { head } else { 0 };
            for &node in &chunk[from.min(chunk.len())..] {
                if keep(node) {
                    self.push_back(node);
                }
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.chunks.iter().map(Vec::len).sum::<usize>() - self.head
    }

    fn memory_bytes(&self) -> usize {
        self.chunks.len() * (ORDER_CHUNK * 4 + ALLOCATION_OVERHEAD)
            + self.chunks.capacity() * std::mem::size_of::<Vec<u32>>()
    }
}

#[derive(Debug, Default)]
struct RankSlot {
    rank: Option<Rank>,
    blocks: HashTable<BlockRef>,
    /// Exact per-tier store counts of the entries flagged `multi` (some tier stored twice or
    /// more; rare). Counts saturate at `u32::MAX`.
    counts: HashMap<u64, [u32; 3]>,
    /// For nodes referenced by two or more engine hashes of this rank ("aliases"; almost never):
    /// per tier the number of those entries holding the tier, then the number of entries.
    alias_counts: HashMap<u32, [u32; 4]>,
    /// Entries in `blocks` that point at evicted (dead) nodes; dropped by the next purge.
    stale: usize,
    /// Live nodes that entries of `blocks` point at, with the number of such entries: the nodes
    /// this rank holds explicitly. Any other node it holds, it holds implicitly.
    explicit_nodes: HashMap<u32, u32>,
    /// Nodes this rank holds implicitly (under their canonical engine hash).
    implicit: usize,
}

impl RankSlot {
    fn explicit_added(&mut self, node: u32) {
        *self.explicit_nodes.entry(node).or_default() += 1;
    }

    fn explicit_removed(&mut self, node: u32) {
        if let Some(c) = self.explicit_nodes.get_mut(&node) {
            *c -= 1;
            if *c == 0 {
                self.explicit_nodes.remove(&node);
            }
        }
    }

    /// `(block, rank)` pairs: live entries plus implicit holdings.
    fn held(&self) -> usize {
        self.blocks.len() - self.stale + self.implicit
    }
}

/// One block stored by one rank, as [`RadixIndex::store_entry`] takes it.
#[derive(Debug, Clone, Copy)]
struct BlockStore {
    slot: u32,
    /// The block's live node, that of `sequence_hash`.
    node: u32,
    sequence_hash: u64,
    engine_hash: u64,
    /// `engine_hash`'s table hash.
    hash: u64,
    /// The tier's index.
    t: usize,
    /// Whether a node without a canonical engine hash may take this one: an engine's store, not
    /// the selector's predictions.
    canonize: bool,
}

impl BlockStore {
    fn new(
        slot: u32,
        (sequence_hash, node): (u64, u32),
        block: &StoredBlock,
        hash: u64,
        t: usize,
        canonize: bool,
    ) -> Self {
        Self {
            slot,
            node,
            sequence_hash,
            engine_hash: block.engine_hash,
            hash,
            t,
            canonize,
        }
    }

    /// Rank slot, node, engine hash and its table hash.
    fn key(&self) -> (u32, u32, u64, u64) {
        (self.slot, self.node, self.engine_hash, self.hash)
    }

    /// The tier's bit, and the transitions of a holding that gains it.
    fn gained(&self) -> (TierMask, [i8; 3]) {
        let mut transitions = [0i8; 3];
        transitions[self.t] = 1;
        (1 << self.t, transitions)
    }
}

/// Where a rank's engine hash points, if anywhere.
#[derive(Debug, Clone, Copy)]
enum Resolved {
    /// An entry of the rank's table (its node may be dead: a stale entry).
    Explicit(BlockRef),
    /// A live node held implicitly, with the tiers the rank holds it on.
    Implicit(u32, TierMask),
    None,
}

/// Bytes of a hashbrown table of `capacity` (as reported by the table) with `entry`-byte
/// entries: buckets, control bytes and the allocation.
fn table_bytes(capacity: usize, entry: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        capacity + 1
    } else {
        capacity / 7 * 8
    };
    (entry * buckets).next_multiple_of(16) + buckets + 16 + ALLOCATION_OVERHEAD
}

/// The prefix index of one partition.
#[derive(Debug, Default)]
pub struct RadixIndex {
    config: IndexConfig,
    hasher: DefaultHashBuilder,
    nodes: Nodes,
    arena: HolderArena,
    /// The live nodes' numbers, hashed by sequence hash (read from the node).
    by_sequence: HashTable<u32>,
    /// The live nodes with a canonical engine hash, hashed by it (read from `nodes`): an engine
    /// hash is the canonical one of at most one live node.
    by_engine: HashTable<u32>,
    /// Slots free for reuse.
    free_nodes: Vec<u32>,
    /// Freed slots waiting for a purge before reuse (see the module invariants).
    dead_nodes: Vec<u32>,
    /// Whether an eviction since the last purge may have left stale rank entries.
    stale_entries: bool,
    slots: Vec<RankSlot>,
    slot_of: HashMap<Rank, u32>,
    /// The known ranks and their slots, in rank order: lookups answer in this order, so a caller
    /// that wants its answers sorted by rank (the selector's candidates) gets them so.
    rank_order: Vec<(Rank, u32)>,
    free_slots: Vec<u32>,
    /// Node creation order, for evicting the oldest past the cap. Also holds records of dead
    /// nodes (skipped), dropped by the purge that recycles them.
    creation_order: ChunkedQueue,
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
        self.slots.iter().map(RankSlot::held).sum()
    }

    /// Ranks that hold at least one block.
    pub fn ranks(&self) -> Vec<Rank> {
        self.slots
            .iter()
            .filter(|s| s.held() > 0)
            .filter_map(|s| s.rank)
            .collect()
    }

    /// Blocks held by one rank (any tier).
    pub fn rank_block_count(&self, rank: Rank) -> usize {
        self.slot_of
            .get(&rank)
            .map_or(0, |&s| self.slots[s as usize].held())
    }

    fn max_live_nodes(&self) -> usize {
        self.config.max_blocks.min(MAX_LIVE_NODES)
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
        let at = self.rank_order.partition_point(|&(r, _)| r < rank);
        self.rank_order.insert(at, (rank, slot));
        Some(slot)
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
                    self.remove(slot, engine_hashes, *tier, &mut outcome);
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

    /// Where `slot`'s engine hash `engine_hash` (whose table hash is `hash`) points: an entry of
    /// its table, else a node it holds implicitly under that hash.
    #[inline]
    fn resolve(&self, slot: u32, engine_hash: u64, hash: u64) -> Resolved {
        let rank_slot = &self.slots[slot as usize];
        if !rank_slot.blocks.is_empty()
            && let Some(entry) = rank_slot
                .blocks
                .find(hash, |e| e.engine_hash() == engine_hash)
        {
            return Resolved::Explicit(*entry);
        }
        let nodes = &self.nodes;
        match self
            .by_engine
            .find(hash, |&n| nodes.canonical_unchecked(n) == engine_hash)
        {
            Some(&node) if !rank_slot.explicit_nodes.contains_key(&node) => {
                match nodes.get(node).holders.mask_of(&self.arena, slot) {
                    0 => Resolved::None,
                    mask => Resolved::Implicit(node, mask),
                }
            }
            _ => Resolved::None,
        }
    }

    /// The live node `slot` holds under an engine hash.
    fn live_node(&self, slot: u32, engine_hash: u64) -> Option<u32> {
        match self.resolve(slot, engine_hash, self.hasher.hash_one(engine_hash)) {
            Resolved::Explicit(e) if self.nodes.is_live(e.node()) => Some(e.node()),
            Resolved::Implicit(node, _) => Some(node),
            _ => None,
        }
    }

    /// Makes `node` canonical for `engine_hash` (whose table hash is `hash`). The caller checked
    /// that the node has no canonical hash and that no live node has this one.
    fn make_canonical(&mut self, node: u32, engine_hash: u64, hash: u64) {
        if self.by_engine.len() == self.by_engine.capacity() {
            self.grow_by_engine();
        }
        self.nodes.set_canonical(node, Some(engine_hash));
        let nodes = &self.nodes;
        let hasher = &self.hasher;
        self.by_engine.insert_unique(hash, node, |&n| {
            hasher.hash_one(nodes.canonical_unchecked(n))
        });
    }

    /// Doubles `by_engine` by re-inserting in node order (see [`Self::grow_by_sequence`]).
    fn grow_by_engine(&mut self) {
        let nodes = &self.nodes;
        let hasher = &self.hasher;
        let hash_of = |&n: &u32| hasher.hash_one(nodes.canonical_unchecked(n));
        let mut grown = HashTable::with_capacity((self.by_engine.capacity() * 2).max(64));
        for n in (0..nodes.len).filter(|&n| nodes.canonical(n).is_some()) {
            grown.insert_unique(hash_of(&n), n, hash_of);
        }
        self.by_engine = grown;
    }

    /// Takes the canonical engine hash of a node being freed out of `by_engine`.
    fn drop_canonical(&mut self, node: u32) {
        if let Some(e) = self.nodes.canonical(node) {
            if let Ok(entry) = self
                .by_engine
                .find_entry(self.hasher.hash_one(e), |&n| n == node)
            {
                entry.remove();
            }
            self.nodes.set_canonical(node, None);
        }
    }

    fn store(
        &mut self,
        slot: u32,
        parent: Option<u64>,
        blocks: &[StoredBlock],
        tier: Tier,
        outcome: &mut ApplyOutcome,
    ) {
        // The previous block's sequence hash and node.
        let (mut previous, mut previous_node) = match parent {
            None => (None, None),
            Some(parent_hash) => match self.live_node(slot, parent_hash) {
                Some(node) => (Some(self.nodes.get(node).sequence_hash), Some(node)),
                None => {
                    outcome.parent_block_not_found += 1;
                    return;
                }
            },
        };
        let t = tier.index();
        let mut sequence_hashes = [0u64; STORE_CHUNK];
        let mut keys = [(0u64, 0u64); STORE_CHUNK];
        for chunk in blocks.chunks(STORE_CHUNK) {
            // Warm up: chain the chunk's sequence hashes, then look every block up in the
            // tables back to back, so that their cache misses overlap rather than queue behind
            // each block's bookkeeping. The stores below then find the lines in cache.
            let mut chained = previous;
            for ((s, k), block) in sequence_hashes.iter_mut().zip(&mut keys).zip(chunk) {
                *s = chained.map_or(block.local_hash, |p| chain(p, block.local_hash));
                *k = (
                    self.hasher.hash_one(*s),
                    self.hasher.hash_one(block.engine_hash),
                );
                chained = Some(*s);
            }
            let nodes = &self.nodes;
            let blocks_of_rank = &self.slots[slot as usize].blocks;
            let mut warm = 0u64;
            let mut hint = previous_node;
            for ((&s, &(node_key, engine_key)), block) in
                sequence_hashes.iter().zip(&keys).zip(chunk)
            {
                hint = hint.and_then(|p| self.node_after(p, s)).or_else(|| {
                    self.by_sequence
                        .find(node_key, |&n| nodes.get(n).sequence_hash == s)
                        .copied()
                });
                if let Some(n) = hint {
                    warm ^= u64::from(n)
                        ^ nodes.get(n).holders.warm(&self.arena)
                        ^ nodes.canonical_unchecked(n);
                }
                let e = block.engine_hash;
                if !blocks_of_rank.is_empty()
                    && let Some(r) = blocks_of_rank.find(engine_key, |r| r.engine_hash() == e)
                {
                    warm ^= u64::from(r.packed);
                }
            }
            std::hint::black_box(warm);
            for ((&sequence_hash, &key), block) in sequence_hashes.iter().zip(&keys).zip(chunk) {
                let node = self.store_block(
                    slot,
                    (sequence_hash, key),
                    block,
                    (previous, previous_node),
                    t,
                    outcome,
                );
                previous = Some(sequence_hash);
                previous_node = Some(node);
            }
        }
    }

    /// Stores those of `blocks` the rank does not already hold on `tier`, at the sequence hashes
    /// given with them, the first one under the block of sequence hash `parent` (which the rank
    /// need not hold), instead of chaining them under a parent engine hash as a `Stored` event
    /// does: how the selector records the blocks it predicts (under [`predicted_engine_hash`]).
    /// Appends the sequence hashes of the blocks it stored to `stored`. Counted as stores,
    /// evictions included. These entries are always explicit: a guess never becomes a node's
    /// canonical engine hash.
    pub fn store_at(
        &mut self,
        rank: Rank,
        parent: Option<u64>,
        blocks: &[(u64, StoredBlock)],
        tier: Tier,
        stored: &mut Vec<u64>,
    ) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        let Some(slot) = self.slot_for(rank) else {
            outcome.rank_capacity_exceeded += 1;
            return outcome;
        };
        let t = tier.index();
        let mut previous = parent;
        let mut previous_node = parent.and_then(|p| self.lookup(p));
        for &(sequence_hash, block) in blocks {
            let node = match previous_node.and_then(|p| self.node_after(p, sequence_hash)) {
                Some(node) => node,
                None => {
                    let key = self.hasher.hash_one(sequence_hash);
                    self.node_for(sequence_hash, key, block.local_hash, previous, &mut outcome)
                }
            };
            if self.nodes.get(node).holders.mask_of(&self.arena, slot) & (1 << t) == 0 {
                let hash = self.hasher.hash_one(block.engine_hash);
                self.store_entry(
                    BlockStore::new(slot, (sequence_hash, node), &block, hash, t, false),
                    &mut outcome,
                );
                stored.push(sequence_hash);
            }
            previous = Some(sequence_hash);
            previous_node = Some(node);
        }
        self.enforce_cap(&mut outcome);
        outcome
    }

    /// Stores one block of a `Stored` event whose sequence hash (chained under the previous
    /// block's, whose node is `previous_node`) is known, with the table hashes of that sequence
    /// hash and of the block's engine hash. Returns the block's node.
    #[inline]
    fn store_block(
        &mut self,
        slot: u32,
        (sequence_hash, (node_key, hash)): (u64, (u64, u64)),
        block: &StoredBlock,
        (previous, previous_node): (Option<u64>, Option<u32>),
        t: usize,
        outcome: &mut ApplyOutcome,
    ) -> u32 {
        let node = match previous_node.and_then(|p| self.node_after(p, sequence_hash)) {
            Some(node) => node,
            None => self.node_for(sequence_hash, node_key, block.local_hash, previous, outcome),
        };
        self.store_entry(
            BlockStore::new(slot, (sequence_hash, node), block, hash, t, true),
            outcome,
        );
        node
    }

    /// Stores the rank's holding of one block (see [`BlockStore`]).
    #[inline]
    fn store_entry(&mut self, store: BlockStore, outcome: &mut ApplyOutcome) {
        let (slot, node, engine_hash, hash) = store.key();
        let (bit, transitions) = store.gained();
        outcome.stored_blocks += 1;
        match self.resolve(slot, engine_hash, hash) {
            Resolved::Explicit(entry) if entry.node() == node => {
                // Stored again (a dead node is never the one just looked up, so the entry is
                // live): raise the count.
                if let Some(mask) = self.store_again(slot, engine_hash, hash, bit) {
                    self.update_presence(slot, node, transitions, mask, 0);
                }
                return;
            }
            Resolved::Explicit(old) => {
                // Re-pointed to another block, or left stale by an eviction.
                let rank_slot = &mut self.slots[slot as usize];
                if let Ok(found) = rank_slot
                    .blocks
                    .find_entry(hash, |e| e.engine_hash() == engine_hash)
                {
                    found.remove();
                }
                if old.multi() {
                    rank_slot.counts.remove(&engine_hash);
                }
                if self.nodes.is_live(old.node()) {
                    outcome.engine_hash_conflicts += 1;
                    self.slots[slot as usize].explicit_removed(old.node());
                    self.release_entry(slot, old);
                } else {
                    rank_slot.stale = rank_slot.stale.saturating_sub(1);
                }
            }
            Resolved::Implicit(n, held) if n == node => {
                if held & bit == 0 {
                    self.update_presence(slot, node, transitions, held | bit, 0);
                } else {
                    // Twice on one tier: the count needs an entry.
                    self.materialize(slot, node, held);
                    self.store_again(slot, engine_hash, hash, bit);
                }
                return;
            }
            Resolved::Implicit(old, held) => {
                // The rank held this engine hash at another block: it names a new one now.
                outcome.engine_hash_conflicts += 1;
                self.slots[slot as usize].implicit -= 1;
                let mut lost = [0i8; 3];
                for (i, l) in lost.iter_mut().enumerate() {
                    if held & (1 << i) != 0 {
                        *l = -1;
                    }
                }
                self.update_presence(slot, old, lost, 0, -1);
            }
            Resolved::None => {}
        }
        self.store_new(store, outcome);
    }

    /// [`Self::store_entry`] when the rank has nothing under the engine hash.
    fn store_new(&mut self, store: BlockStore, outcome: &mut ApplyOutcome) {
        let (slot, node, engine_hash, hash) = store.key();
        let (bit, transitions) = store.gained();
        let (sequence_hash, t, canonize) = (store.sequence_hash, store.t, store.canonize);
        let held = self.nodes.get(node).holders.mask_of(&self.arena, slot);
        if held == 0 {
            if !self.implicit_possible(node, engine_hash, hash, canonize) {
                self.insert_entry(slot, node, engine_hash, hash, bit);
            } else {
                self.slots[slot as usize].implicit += 1;
            }
            self.update_presence(slot, node, transitions, bit, 1);
            return;
        }
        if !self.slots[slot as usize].explicit_nodes.contains_key(&node) {
            // Held implicitly under the node's canonical hash, and now under another: both
            // become entries, counted as aliases.
            self.materialize(slot, node, held);
            self.insert_entry(slot, node, engine_hash, hash, bit);
            self.update_presence(slot, node, transitions, bit, 1);
            return;
        }
        let hasher = &self.hasher;
        let rank_slot = &mut self.slots[slot as usize];
        if held == bit
            && t == Tier::Device.index()
            && adopt_prediction(rank_slot, hasher, sequence_hash, node)
        {
            // The engine's holding takes the place of the predicted one: same holders.
            rank_slot.explicit_removed(node);
            outcome.adopted_predictions += 1;
            let other_entries = rank_slot.explicit_nodes.contains_key(&node)
                || rank_slot.alias_counts.contains_key(&node);
            if other_entries || !self.implicit_possible(node, engine_hash, hash, canonize) {
                self.add_entry(slot, node, engine_hash, hash, bit);
            } else {
                self.slots[slot as usize].implicit += 1;
            }
            return;
        }
        self.insert_entry(slot, node, engine_hash, hash, bit);
        self.update_presence(slot, node, transitions, bit, 1);
    }

    /// Whether a rank that does not hold `node` can hold it implicitly under `engine_hash`: the
    /// node's canonical hash is that one, or it has none yet and may take it (then it does).
    fn implicit_possible(
        &mut self,
        node: u32,
        engine_hash: u64,
        hash: u64,
        canonize: bool,
    ) -> bool {
        match self.nodes.canonical(node) {
            Some(c) => c == engine_hash,
            None if canonize => {
                let nodes = &self.nodes;
                let taken = self
                    .by_engine
                    .find(hash, |&n| nodes.canonical_unchecked(n) == engine_hash)
                    .is_some();
                if !taken {
                    self.make_canonical(node, engine_hash, hash);
                }
                !taken
            }
            None => false,
        }
    }

    /// Turns the rank's implicit holding of `node` (on tiers `held`) into an entry under the
    /// node's canonical engine hash.
    fn materialize(&mut self, slot: u32, node: u32, held: TierMask) {
        let Some(engine_hash) = self.nodes.canonical(node) else {
            // Implicit holdings exist only under a canonical hash.
            debug_assert!(
                false,
                "an implicit holding of a node without a canonical hash"
            );
            return;
        };
        let hash = self.hasher.hash_one(engine_hash);
        self.add_entry(slot, node, engine_hash, hash, held);
        self.slots[slot as usize].implicit -= 1;
    }

    /// Raises the store count of the rank's (live) entry for `engine_hash` on the tier `bit`.
    /// Returns the entry's tiers when it gained this one.
    fn store_again(
        &mut self,
        slot: u32,
        engine_hash: u64,
        hash: u64,
        bit: TierMask,
    ) -> Option<TierMask> {
        let t = bit.trailing_zeros() as usize;
        let rank_slot = &mut self.slots[slot as usize];
        let entry = rank_slot
            .blocks
            .find_mut(hash, |e| e.engine_hash() == engine_hash)?;
        let mask = entry.mask();
        if entry.multi() {
            let counts = rank_slot.counts.entry(engine_hash).or_default();
            counts[t] = counts[t].saturating_add(1);
        } else if mask & bit != 0 {
            let mut counts = [0u32; 3];
            for (i, c) in counts.iter_mut().enumerate() {
                *c = u32::from(mask & (1 << i) != 0);
            }
            counts[t] = 2;
            rank_slot.counts.insert(engine_hash, counts);
            entry.set_multi(true);
        }
        if mask & bit == 0 {
            entry.set_mask(mask | bit);
            Some(mask | bit)
        } else {
            None
        }
    }

    /// Adds a fresh entry (count 1 on the tier `bit`) of `slot` for `node`; the caller updates
    /// the node's holders.
    fn insert_entry(&mut self, slot: u32, node: u32, engine_hash: u64, hash: u64, bit: TierMask) {
        let held = self.nodes.get(node).holders.mask_of(&self.arena, slot);
        self.add_entry(slot, node, engine_hash, hash, bit);
        if held != 0 {
            note_alias(&mut self.slots[slot as usize], node, held);
        }
    }

    /// Puts an entry (count 1 on each tier of `mask`) of `slot` for `node` in the rank's table.
    fn add_entry(&mut self, slot: u32, node: u32, engine_hash: u64, hash: u64, mask: TierMask) {
        let hasher = &self.hasher;
        let rank_slot = &mut self.slots[slot as usize];
        rank_slot
            .blocks
            .insert_unique(hash, BlockRef::new(engine_hash, node, mask), |e| {
                hasher.hash_one(e.engine_hash())
            });
        rank_slot.explicit_added(node);
    }

    /// The live node for a sequence hash (whose `by_sequence` hash is `hash`), created (without
    /// holders) when absent.
    fn node_for(
        &mut self,
        sequence_hash: u64,
        hash: u64,
        local_hash: u64,
        parent: Option<u64>,
        outcome: &mut ApplyOutcome,
    ) -> u32 {
        let nodes = &self.nodes;
        if let Some(&node) = self
            .by_sequence
            .find(hash, |&n| nodes.get(n).sequence_hash == sequence_hash)
        {
            return node;
        }
        let node = self.alloc_node(
            Node {
                sequence_hash,
                local_hash,
                parent_tag: parent.map_or(0, |p| p as u32),
                holders: Holders::default(),
            },
            outcome,
        );
        if self.by_sequence.len() == self.by_sequence.capacity() {
            self.grow_by_sequence();
        }
        let nodes = &self.nodes;
        let hasher = &self.hasher;
        self.by_sequence
            .insert_unique(hash, node, |&n| hasher.hash_one(nodes.get(n).sequence_hash));
        self.creation_order.push_back(node);
        self.live_nodes += 1;
        node
    }

    /// Doubles `by_sequence` by re-inserting the live nodes in node order: a rehash would read
    /// each entry's node (for its key) in random order, a cache miss per entry.
    fn grow_by_sequence(&mut self) {
        let nodes = &self.nodes;
        let hasher = &self.hasher;
        let hash_of = |&n: &u32| hasher.hash_one(nodes.get(n).sequence_hash);
        let mut grown = HashTable::with_capacity((self.by_sequence.capacity() * 2).max(64));
        // Every live node is in the table (a node being created has no holders yet).
        for n in (0..nodes.len).filter(|&n| nodes.is_live(n)) {
            grown.insert_unique(hash_of(&n), n, hash_of);
        }
        self.by_sequence = grown;
    }

    /// Puts a new node in a free slot (or a fresh one).
    fn alloc_node(&mut self, node: Node, outcome: &mut ApplyOutcome) -> u32 {
        if self.free_nodes.is_empty() && self.dead_nodes.len() >= (self.live_nodes / 4).max(1024) {
            self.purge();
        }
        if self.free_nodes.is_empty() && self.nodes.len >= NODE_SLOT_LIMIT {
            // Only reachable when a single event stores hundreds of millions of blocks: make
            // room by evicting the oldest blocks now rather than after the event.
            while self.dead_nodes.is_empty() && self.evict_oldest() {
                outcome.evicted_blocks += 1;
            }
            self.purge();
        }
        match self.free_nodes.pop() {
            Some(slot) => {
                self.nodes.reuse(slot, node);
                slot
            }
            None => self.nodes.push(node),
        }
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
        let mask = if rank_slot.alias_counts.is_empty() {
            entry_mask
        } else {
            match rank_slot.alias_counts.get_mut(&node) {
                Some(counts) => {
                    let mut mask = 0;
                    for (t, &d) in transitions.iter().enumerate() {
                        counts[t] = counts[t].saturating_add_signed(i32::from(d));
                        if counts[t] > 0 {
                            mask |= 1 << t;
                        }
                    }
                    counts[3] = counts[3].saturating_add_signed(i32::from(entry_delta));
                    if counts[3] == 0 {
                        rank_slot.alias_counts.remove(&node);
                    }
                    mask
                }
                None => entry_mask,
            }
        };
        let n = self.nodes.get_mut(node);
        n.holders.set_mask(&mut self.arena, slot, mask, rank_slots);
        if n.holders.is_empty() {
            self.free_node(node);
        }
    }

    /// Takes a (live) entry that was just removed from the rank's map out of its node.
    fn release_entry(&mut self, slot: u32, entry: BlockRef) {
        let mut transitions = [0i8; 3];
        for (t, tr) in transitions.iter_mut().enumerate() {
            if entry.mask() & (1 << t) != 0 {
                *tr = -1;
            }
        }
        self.update_presence(slot, entry.node(), transitions, 0, -1);
    }
}

/// When a rank's only entry on `node` (the block of `sequence_hash`) is the selector's prediction
/// of it ([`predicted_engine_hash`], on the device tier alone), removes it: the engine's entry
/// just stored on the device takes its place, with no alias in between (`selector/predict.rs`
/// then counts the prediction confirmed).
fn adopt_prediction(
    rank_slot: &mut RankSlot,
    hasher: &DefaultHashBuilder,
    sequence_hash: u64,
    node: u32,
) -> bool {
    if rank_slot.alias_counts.get(&node).is_some_and(|c| c[3] > 1) {
        // More entries than the predicted one (and the new one): the general path. (A record
        // of one entry, left by an alias that has gone, stays right: the new entry holds the
        // same tier as the one it replaces.)
        return false;
    }
    let predicted = predicted_engine_hash(sequence_hash);
    let Ok(entry) = rank_slot
        .blocks
        .find_entry(hasher.hash_one(predicted), |e| e.engine_hash() == predicted)
    else {
        return false;
    };
    let e = *entry.get();
    if e.node() != node || e.mask() != 1 << Tier::Device.index() || e.multi() {
        return false;
    }
    entry.remove();
    true
}

/// Notes a second entry of a rank on a node it already holds with tiers `held` (before the new
/// entry): from now on the node's entries of that rank are counted explicitly.
fn note_alias(rank_slot: &mut RankSlot, node: u32, held: TierMask) {
    rank_slot.alias_counts.entry(node).or_insert_with(|| {
        let mut counts = [0u32; 4];
        for (i, c) in counts.iter_mut().take(3).enumerate() {
            *c = u32::from(held & (1 << i) != 0);
        }
        counts[3] = 1;
        counts
    });
}

/// Number of stored blocks looked up together before they are stored, so their cache misses
/// overlap.
const STORE_CHUNK: usize = 16;
/// Blocks of a `Removed` event looked up together before they are removed.
const REMOVE_CHUNK: usize = 32;

#[cfg(test)]
mod tests;
