//! The capacity-bounded LRU approximate cache model (SPEC §9.2): each event-less rank's KV pool of
//! `total_kv_blocks` blocks, evicting the way vLLM's block pool does.
//!
//! ## Model
//! A rank's pool holds **copies**. A copy is either a prompt block (its sequence hash, published
//! in the index) or a **private** block (a trailing partial prompt block or an output block: never
//! shared, never indexed). Each copy has a reference count, the sequence position it was created
//! at, and a unique serial. `resident` = copies in the pool; a copy is *active* while referenced
//! and *inactive* (cached, evictable) at 0 references.
//!
//! - **Acquire** (a booking): walk the prompt's blocks; while the prefix still hits (the rank holds
//!   a copy of the hash), reuse that copy (refs += 1; it leaves the inactive set). From the first
//!   miss on, every block is a new copy, and so is the trailing partial block when present. Room
//!   is made first (evictions below), then the new copies are created and the hashes that gained
//!   their first copy on the rank are published as `Stored` (chained under the previous prompt
//!   block). Events: `Removed` (evictions) then `Stored`, as vLLM evicts while allocating and
//!   caches afterwards.
//! - **Materialize** (`output_block`, with or without a decay fraction): one new private copy at
//!   the lease's next sequence position. It makes room like an allocation and ages nothing.
//! - **Release** (free, or the lease reaped): **one** release epoch for the whole lease; each copy
//!   it holds loses a reference, and copies reaching 0 enter the inactive set, ordered by
//!   `(release_epoch, Reverse(sequence_position), serial)`. A shared copy therefore gets the epoch
//!   of the last release that held it.
//! - **Evict**: while `resident > capacity` (after a release) or `resident + incoming > capacity`
//!   (before an allocation), evict the smallest inactive key: the oldest release first and, within
//!   one release, the deepest block first (tail → root), so prefixes outlive their tails. A hash
//!   is `Removed` from the index only when the rank's last copy of it goes. Active copies are never
//!   evicted: an allocation that finds nothing to evict goes over capacity, counted in
//!   [`LruStats::overcapacity_blocks`] (current excess) and
//!   [`LruCounters::overcapacity_allocations`].
//!
//! Release epochs only grow, so the inactive set is a queue: each release appends its freed
//! copies, sorted deepest first, at the back; eviction pops the front; a hit unlinks a copy from
//! the middle. It is kept as an intrusive doubly linked list through the copy slots (vLLM's
//! `FreeKVCacheBlockQueue`), so every step is O(1). This is exactly vLLM's free-block queue
//! (freed blocks appended tail first, allocation pops the front and evicts its hash, a prefix hit
//! takes a block out of the queue); the test oracle `approx::reference` implements that
//! literally and the property tests compare the two.
//!
//! ## Leases, attempts and incarnations
//! - Every acquire is an **attempt** on a caller-chosen lease id (the reservation id) and returns a
//!   model-wide unique [`Attempt`]. Lifecycle commands name a [`LeaseRef`]: the id alone (acts on
//!   the live attempt) or the id pinned to an attempt (a no-op unless that attempt is still live).
//!   A lease id can be acquired again once released; acquiring a live id is refused.
//! - Release is idempotent: releasing an unknown, released, reaped or retired lease does nothing.
//! - Lifecycle calls ([`LruModel::touch`], [`LruModel::materialize`]) set the lease's reference
//!   bit. The CLOCK (second-chance) reaper: [`LruModel::reap`] scans when at least `scan_interval`
//!   (`active_request_expiry`, 300 s) has passed since the previous scan (the first `now` any call
//!   sees starts the clock; one scan per call, no catch-up). A scan clears set bits and reclaims
//!   (releases) leases whose bit was already clear, so a lease untouched across two scans is
//!   reclaimed: idle for at least one and at most about two intervals.
//! - Each pool lives under an [`Incarnation`] (model-wide unique). [`LruModel::set_rank`] with a new
//!   capacity, or [`LruModel::reset_rank`] (re-registration), retires the old incarnation: its
//!   leases are dropped and the caller applies the returned `Cleared`. A command pinned to a
//!   retired incarnation ([`RankRef::exact`]) or naming a retired lease is a no-op: nothing is ever
//!   resurrected. (Attempts are never reused, so an attempt pins its incarnation too.)
//!
//! ## Calling sequence
//! See [the parent module](super) for how the selector wires the model in: `set_rank` /
//! `reset_rank` / `remove_rank` on worker changes, `acquire` per booking, `touch` on
//! `prefill_complete`, `materialize` per `output_block`, `release` on free and booking expiry,
//! `reap` on every tick. Apply every returned event, in order, to the rank's partition index.
//!
//! ## Invariants
//! - `resident` = live copies = active + inactive; the free queue holds exactly the copies with
//!   0 references, sorted by `(release_epoch, Reverse(position), serial)`.
//! - `by_hash[h]` lists the rank's live copies of `h` in creation order (a hit reuses the first);
//!   an entry exists iff the list is non-empty, which is iff the index was told `Stored` for `h`
//!   and not yet `Removed`.
//! - A copy's references = the live leases holding it (with multiplicity). Leases of a pool carry
//!   its incarnation; resetting or removing the pool drops them, so no lease ever refers to a slot
//!   of another incarnation.
//! - For chained sequence hashes the cache stays prefix-closed: a child copy is always released at
//!   or before its parent's last release and sorts first within an epoch, so a parent is never
//!   evicted before its child, and a prompt never misses a block and then hits a later one.
//!
//! ## Complexity
//! `P` = blocks a lease holds, `L` = live leases. Hash maps are O(1) expected; the free queue is
//! O(1) per step. `acquire`: O(P + log L) plus O(1) per eviction. `materialize`, `touch`:
//! O(log L) plus O(1) per eviction. `release`: O(P + log L) plus O(1) per eviction (a release
//! whose freed copies are out of position order, which chained hashes never produce, sorts them:
//! O(P log P)). `reap`: O(L) per scan (once per interval) plus the releases. `set_rank` /
//! `reset_rank` / `remove_rank`: O(copies + leases of the rank) to drop the old pool. Memory: one
//! 48-byte slot per copy (queue links inline), one hash entry per distinct hash, one slot index
//! per block held by a lease.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use hashbrown::hash_map::Entry;
use smallvec::SmallVec;

use super::{ApproxError, removed_event, stored_runs};
use crate::event::{KvEvent, Rank};

/// Default CLOCK scan interval: the load tracker's `active_request_expiry`.
pub const DEFAULT_SCAN_INTERVAL: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LruConfig {
    /// Interval between reaper scans; a lease idle across two scans is reclaimed.
    pub scan_interval: Duration,
}

impl Default for LruConfig {
    fn default() -> Self {
        Self {
            scan_interval: DEFAULT_SCAN_INTERVAL,
        }
    }
}

/// One life of a rank's pool; a reset or capacity change starts a new one. Unique model-wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Incarnation(pub u64);

/// One booking attempt (one successful acquire). Unique model-wide, increasing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Attempt(pub u64);

/// The rank an acquire targets, optionally pinned to the incarnation the caller last saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankRef {
    pub rank: Rank,
    pub incarnation: Option<Incarnation>,
}

impl RankRef {
    /// The rank in whatever incarnation is current.
    pub fn current(rank: Rank) -> Self {
        Self {
            rank,
            incarnation: None,
        }
    }

    /// The rank only if `incarnation` is still current.
    pub fn exact(rank: Rank, incarnation: Incarnation) -> Self {
        Self {
            rank,
            incarnation: Some(incarnation),
        }
    }
}

impl From<Rank> for RankRef {
    fn from(rank: Rank) -> Self {
        Self::current(rank)
    }
}

/// The lease a lifecycle command names: its id, optionally pinned to one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRef<'a> {
    pub id: &'a str,
    pub attempt: Option<Attempt>,
}

impl<'a> LeaseRef<'a> {
    /// The live attempt of lease `id`, whichever it is.
    pub fn current(id: &'a str) -> Self {
        Self { id, attempt: None }
    }

    /// Lease `id` only while `attempt` is its live attempt.
    pub fn exact(id: &'a str, attempt: Attempt) -> Self {
        Self {
            id,
            attempt: Some(attempt),
        }
    }
}

impl<'a> From<&'a str> for LeaseRef<'a> {
    fn from(id: &'a str) -> Self {
        Self::current(id)
    }
}

/// What a successful [`LruModel::acquire`] did. Apply `events` to the rank, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquired {
    pub attempt: Attempt,
    pub incarnation: Incarnation,
    pub events: Vec<KvEvent>,
    /// Leading prompt blocks reused from the pool.
    pub hit_blocks: u64,
    /// Copies created (prompt blocks after the first miss, plus the partial block).
    pub new_blocks: u64,
    /// Copies evicted to make room.
    pub evicted_blocks: u64,
}

/// Events produced by a lifecycle command on one lease's rank. Apply them to `rank`, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseEvents {
    pub rank: Rank,
    pub attempt: Attempt,
    pub events: Vec<KvEvent>,
    /// Copies evicted by this command.
    pub evicted_blocks: u64,
}

/// What one [`LruModel::reap`] call did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReapOutcome {
    /// Whether a scan ran (at most one per `scan_interval`).
    pub scanned: bool,
    /// Lease ids reclaimed, in attempt order.
    pub reclaimed: Vec<String>,
    /// Events of the reclaiming releases, in order.
    pub events: Vec<(Rank, KvEvent)>,
    pub evicted_blocks: u64,
}

/// What [`LruModel::set_rank`] / [`LruModel::reset_rank`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankReset {
    /// The rank's current incarnation.
    pub incarnation: Incarnation,
    /// `[Cleared]` when an existing pool was reset (apply it to the rank); empty otherwise.
    pub events: Vec<KvEvent>,
    /// Leases of the retired incarnation that were dropped.
    pub retired_leases: u64,
}

/// One rank's pool, for metrics and inspection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LruStats {
    pub capacity_blocks: u64,
    pub incarnation: Incarnation,
    pub resident_blocks: u64,
    pub active_blocks: u64,
    pub inactive_blocks: u64,
    /// Resident blocks beyond capacity (all of them active).
    pub overcapacity_blocks: u64,
    /// Distinct hashes published in the index for this rank.
    pub indexed_blocks: u64,
    pub leases: u64,
}

/// Model-wide totals since creation, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LruCounters {
    /// Copies evicted (prompt and private).
    pub evicted_blocks: u64,
    /// Leases reclaimed by the reaper.
    pub reaped_leases: u64,
    /// Copies created while nothing was evictable (the pool went, or stayed, over capacity).
    pub overcapacity_allocations: u64,
    /// Leases dropped because their rank was reset or removed.
    pub retired_leases: u64,
    /// Lifecycle commands that named no live lease (stale attempt, released, reaped, retired).
    pub ignored_lease_commands: u64,
}

/// A live lease as the model holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseView {
    pub id: String,
    pub rank: Rank,
    pub attempt: Attempt,
    pub incarnation: Incarnation,
    /// Copies held (prompt blocks, partial block, materialized outputs).
    pub blocks: u64,
    pub last_touched: Instant,
}

/// Marks the end of the free queue.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct CopySlot {
    /// `None` for a private block.
    hash: Option<u64>,
    position: u32,
    serial: u64,
    refs: u32,
    /// Whether the copy is in the free queue (inactive, 0 refs).
    queued: bool,
    /// Free-queue neighbours (`NIL` at the ends or when not queued).
    prev: u32,
    next: u32,
}

/// One rank's pool. Every slot index stored anywhere (free queue, `by_hash`, leases) is
/// `< slots.len()`: slots are reused through `free_slots` but never shrunk, which is what makes
/// the indexing below infallible.
#[derive(Debug, Clone)]
struct Pool {
    capacity: u64,
    incarnation: Incarnation,
    slots: Vec<CopySlot>,
    free_slots: Vec<u32>,
    resident: u64,
    by_hash: HashMap<u64, SmallVec<[u32; 1]>>,
    /// The free queue of inactive copies, front = next to evict.
    head: u32,
    tail: u32,
    inactive: u64,
    next_serial: u64,
    leases: BTreeSet<Attempt>,
}

impl Pool {
    fn new(capacity: u64, incarnation: Incarnation) -> Self {
        Self {
            capacity,
            incarnation,
            slots: Vec::new(),
            free_slots: Vec::new(),
            resident: 0,
            by_hash: HashMap::new(),
            head: NIL,
            tail: NIL,
            inactive: 0,
            next_serial: 0,
            leases: BTreeSet::new(),
        }
    }

    /// The first live copy of `hash`, if the rank holds one.
    fn find(&self, hash: u64) -> Option<u32> {
        self.by_hash
            .get(&hash)
            .and_then(|copies| copies.first().copied())
    }

    fn push_back(&mut self, slot: u32) {
        let tail = self.tail;
        let copy = &mut self.slots[slot as usize];
        copy.queued = true;
        copy.prev = tail;
        copy.next = NIL;
        match tail {
            NIL => self.head = slot,
            tail => self.slots[tail as usize].next = slot,
        }
        self.tail = slot;
        self.inactive += 1;
    }

    fn unlink(&mut self, slot: u32) {
        let copy = &mut self.slots[slot as usize];
        let (prev, next) = (copy.prev, copy.next);
        copy.queued = false;
        copy.prev = NIL;
        copy.next = NIL;
        match prev {
            NIL => self.head = next,
            prev => self.slots[prev as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            next => self.slots[next as usize].prev = prev,
        }
        self.inactive -= 1;
    }

    /// Adds a reference to a live copy, taking it out of the free queue.
    fn reference(&mut self, slot: u32) {
        if self.slots[slot as usize].queued {
            self.unlink(slot);
        }
        let copy = &mut self.slots[slot as usize];
        copy.refs = copy.refs.saturating_add(1);
    }

    /// Creates an active copy (1 reference). Returns its slot and whether it is the rank's first
    /// copy of its hash (to be published).
    fn create(&mut self, hash: Option<u64>, position: u32) -> (u32, bool) {
        let copy = CopySlot {
            hash,
            position,
            serial: self.next_serial,
            refs: 1,
            queued: false,
            prev: NIL,
            next: NIL,
        };
        self.next_serial += 1;
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot as usize] = copy;
                slot
            }
            None => {
                self.slots.push(copy);
                u32::try_from(self.slots.len() - 1).unwrap_or(NIL)
            }
        };
        self.resident += 1;
        let first = match hash {
            Some(hash) => {
                let copies = self.by_hash.entry(hash).or_default();
                copies.push(slot);
                copies.len() == 1
            }
            None => false,
        };
        (slot, first)
    }

    /// Evicts from the front of the free queue while `resident + incoming > capacity`. Hashes
    /// whose last copy went are appended to `removed`. Returns the number of copies evicted.
    fn make_room(&mut self, incoming: u64, removed: &mut Vec<u64>) -> u64 {
        let mut evicted = 0;
        while self.resident + incoming > self.capacity && self.head != NIL {
            let slot = self.head;
            self.unlink(slot);
            evicted += 1;
            self.resident -= 1;
            self.free_slots.push(slot);
            let Some(hash) = self.slots[slot as usize].hash.take() else {
                continue;
            };
            // One probe: the map access is the cache miss that dominates an eviction.
            if let Entry::Occupied(mut copies) = self.by_hash.entry(hash) {
                if let Some(i) = copies.get().iter().position(|&s| s == slot) {
                    copies.get_mut().remove(i);
                }
                if copies.get().is_empty() {
                    copies.remove();
                    removed.push(hash);
                }
            }
        }
        evicted
    }

    /// Drops one reference from each copy in `held`; the copies reaching 0 join the back of the
    /// free queue as one release, deepest first (`Reverse(position)`, then serial).
    fn release(&mut self, held: &[u32]) {
        let mut freed: SmallVec<[u32; 64]> = SmallVec::new();
        // Leases hold copies in position order, so the reverse walk is already sorted.
        for &slot in held.iter().rev() {
            let copy = &mut self.slots[slot as usize];
            if copy.refs == 0 {
                continue;
            }
            copy.refs -= 1;
            if copy.refs == 0 {
                freed.push(slot);
            }
        }
        let key = |slot: &u32| {
            let copy = &self.slots[*slot as usize];
            (Reverse(copy.position), copy.serial)
        };
        if !freed.is_sorted_by_key(key) {
            freed.sort_unstable_by_key(key);
        }
        for slot in freed {
            self.push_back(slot);
        }
    }

    fn stats(&self) -> LruStats {
        LruStats {
            capacity_blocks: self.capacity,
            incarnation: self.incarnation,
            resident_blocks: self.resident,
            active_blocks: self.resident.saturating_sub(self.inactive),
            inactive_blocks: self.inactive,
            overcapacity_blocks: self.resident.saturating_sub(self.capacity),
            indexed_blocks: self.by_hash.len() as u64,
            leases: self.leases.len() as u64,
        }
    }
}

#[derive(Debug, Clone)]
struct Lease {
    id: Arc<str>,
    rank: Rank,
    incarnation: Incarnation,
    /// Slots held, in sequence-position order.
    held: Vec<u32>,
    next_position: u32,
    /// CLOCK reference bit: set by every lifecycle call, cleared by a scan.
    referenced: bool,
    last_touched: Instant,
}

/// The capacity-bounded LRU model. See the module doc.
#[derive(Debug, Clone, Default)]
pub struct LruModel {
    config: LruConfig,
    pools: HashMap<Rank, Pool>,
    leases: BTreeMap<Attempt, Lease>,
    live: HashMap<Arc<str>, Attempt>,
    next_attempt: u64,
    next_incarnation: u64,
    last_scan: Option<Instant>,
    counters: LruCounters,
}

impl LruModel {
    pub fn new(config: LruConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    pub fn config(&self) -> &LruConfig {
        &self.config
    }

    /// Ensures `rank` has a pool of `capacity_blocks`. A new rank gets a fresh pool; a different
    /// capacity resets the pool under a new incarnation (returns `[Cleared]`); the same capacity
    /// changes nothing. Capacity 0 is refused: serve such a rank with the TTL model.
    pub fn set_rank(&mut self, rank: Rank, capacity_blocks: u64) -> Result<RankReset, ApproxError> {
        if capacity_blocks == 0 {
            return Err(ApproxError::ZeroCapacity { rank });
        }
        match self.pools.get(&rank) {
            Some(pool) if pool.capacity == capacity_blocks => Ok(RankReset {
                incarnation: pool.incarnation,
                events: Vec::new(),
                retired_leases: 0,
            }),
            _ => self.reset_rank(rank, capacity_blocks),
        }
    }

    /// Starts a new incarnation of `rank` with an empty pool of `capacity_blocks`, whatever the
    /// current state (re-registration, identity change). Leases of the old incarnation are
    /// dropped; returns `[Cleared]` when a pool existed.
    pub fn reset_rank(
        &mut self,
        rank: Rank,
        capacity_blocks: u64,
    ) -> Result<RankReset, ApproxError> {
        if capacity_blocks == 0 {
            return Err(ApproxError::ZeroCapacity { rank });
        }
        let (existed, retired_leases) = self.drop_pool(rank);
        let incarnation = Incarnation(self.next_incarnation);
        self.next_incarnation += 1;
        self.pools
            .insert(rank, Pool::new(capacity_blocks, incarnation));
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

    /// Forgets `rank` and its leases without events (the caller clears the rank in the index).
    /// Returns whether the rank had a pool.
    pub fn remove_rank(&mut self, rank: Rank) -> bool {
        self.drop_pool(rank).0
    }

    /// Books a prompt on `rank` under lease `lease_id`: reuses the hit prefix, creates the rest
    /// (plus one private copy for a trailing partial block), evicting to make room. The lease
    /// starts referenced (it survives the next scan).
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
        if let Some(&attempt) = self.live.get(lease_id) {
            return Err(ApproxError::LeaseExists {
                lease_id: lease_id.to_owned(),
                attempt,
            });
        }
        self.last_scan.get_or_insert(now);

        let mut held = Vec::with_capacity(sequence_hashes.len() + usize::from(partial_block));
        for &hash in sequence_hashes {
            let Some(slot) = pool.find(hash) else {
                break;
            };
            pool.reference(slot);
            held.push(slot);
        }
        let hit_blocks = held.len();
        let new_blocks = (sequence_hashes.len() - hit_blocks) as u64 + u64::from(partial_block);
        let mut removed = Vec::new();
        let evicted_blocks = pool.make_room(new_blocks, &mut removed);
        let overcapacity = (pool.resident + new_blocks).saturating_sub(pool.capacity);
        let mut published = Vec::new();
        for (position, &hash) in sequence_hashes.iter().enumerate().skip(hit_blocks) {
            let (slot, first) = pool.create(Some(hash), position_u32(position));
            held.push(slot);
            if first {
                published.push(position);
            }
        }
        if partial_block {
            let (slot, _) = pool.create(None, position_u32(sequence_hashes.len()));
            held.push(slot);
        }

        let attempt = Attempt(self.next_attempt);
        self.next_attempt += 1;
        pool.leases.insert(attempt);
        let incarnation = pool.incarnation;
        let id: Arc<str> = Arc::from(lease_id);
        self.live.insert(Arc::clone(&id), attempt);
        self.leases.insert(
            attempt,
            Lease {
                id,
                rank,
                incarnation,
                next_position: position_u32(held.len()),
                held,
                referenced: true,
                last_touched: now,
            },
        );
        self.counters.evicted_blocks += evicted_blocks;
        self.counters.overcapacity_allocations += overcapacity.min(new_blocks);

        let mut events = Vec::new();
        if !removed.is_empty() {
            events.push(removed_event(removed));
        }
        events.extend(stored_runs(local_hashes, sequence_hashes, published));
        Ok(Acquired {
            attempt,
            incarnation,
            events,
            hit_blocks: hit_blocks as u64,
            new_blocks,
            evicted_blocks,
        })
    }

    /// Marks the lease as used (a lifecycle call such as `prefill_complete`). Returns whether a
    /// live lease matched.
    pub fn touch<'a>(&mut self, lease: impl Into<LeaseRef<'a>>, now: Instant) -> bool {
        self.last_scan.get_or_insert(now);
        match self.live_attempt(lease.into()) {
            Some(attempt) => {
                if let Some(lease) = self.leases.get_mut(&attempt) {
                    lease.referenced = true;
                    lease.last_touched = now;
                }
                true
            }
            None => {
                self.counters.ignored_lease_commands += 1;
                false
            }
        }
    }

    /// One output block of the lease: a new private copy at its next sequence position (touches
    /// the lease). `None` when no live lease matched (a no-op).
    pub fn materialize<'a>(
        &mut self,
        lease: impl Into<LeaseRef<'a>>,
        now: Instant,
    ) -> Option<LeaseEvents> {
        self.last_scan.get_or_insert(now);
        let Some(attempt) = self.live_attempt(lease.into()) else {
            self.counters.ignored_lease_commands += 1;
            return None;
        };
        let lease = self.leases.get_mut(&attempt)?;
        let pool = self.pools.get_mut(&lease.rank)?;
        lease.referenced = true;
        lease.last_touched = now;
        let mut removed = Vec::new();
        let evicted_blocks = pool.make_room(1, &mut removed);
        if pool.resident >= pool.capacity {
            self.counters.overcapacity_allocations += 1;
        }
        let (slot, _) = pool.create(None, lease.next_position);
        lease.held.push(slot);
        lease.next_position = lease.next_position.saturating_add(1);
        self.counters.evicted_blocks += evicted_blocks;
        Some(LeaseEvents {
            rank: lease.rank,
            attempt,
            events: removed_events(removed),
            evicted_blocks,
        })
    }

    /// Ends the lease: one release epoch for all its copies, then evicts down to capacity.
    /// Idempotent: `None` when no live lease matched.
    pub fn release<'a>(&mut self, lease: impl Into<LeaseRef<'a>>) -> Option<LeaseEvents> {
        let Some(attempt) = self.live_attempt(lease.into()) else {
            self.counters.ignored_lease_commands += 1;
            return None;
        };
        self.release_attempt(attempt)
    }

    /// Runs a CLOCK scan if `scan_interval` has passed since the previous one: leases whose
    /// reference bit is clear are reclaimed (released, in attempt order); set bits are cleared.
    pub fn reap(&mut self, now: Instant) -> ReapOutcome {
        let last_scan = *self.last_scan.get_or_insert(now);
        let mut outcome = ReapOutcome::default();
        if now.saturating_duration_since(last_scan) < self.config.scan_interval {
            return outcome;
        }
        self.last_scan = Some(now);
        outcome.scanned = true;
        let mut idle = Vec::new();
        for (&attempt, lease) in &mut self.leases {
            if lease.referenced {
                lease.referenced = false;
            } else {
                idle.push(attempt);
            }
        }
        for attempt in idle {
            let Some(id) = self.leases.get(&attempt).map(|lease| lease.id.to_string()) else {
                continue;
            };
            if let Some(released) = self.release_attempt(attempt) {
                outcome.evicted_blocks += released.evicted_blocks;
                outcome.events.extend(
                    released
                        .events
                        .into_iter()
                        .map(|event| (released.rank, event)),
                );
            }
            outcome.reclaimed.push(id);
        }
        self.counters.reaped_leases += outcome.reclaimed.len() as u64;
        outcome
    }

    /// One rank's pool statistics; `None` when the rank has no pool.
    pub fn stats(&self, rank: Rank) -> Option<LruStats> {
        self.pools.get(&rank).map(Pool::stats)
    }

    /// Ranks with a pool, in no particular order.
    pub fn ranks(&self) -> impl Iterator<Item = Rank> + '_ {
        self.pools.keys().copied()
    }

    pub fn counters(&self) -> LruCounters {
        self.counters
    }

    /// The rank's current incarnation, if it has a pool.
    pub fn incarnation(&self, rank: Rank) -> Option<Incarnation> {
        self.pools.get(&rank).map(|pool| pool.incarnation)
    }

    /// The live attempt of lease `lease_id`.
    pub fn lease(&self, lease_id: &str) -> Option<LeaseView> {
        let attempt = self.live.get(lease_id)?;
        let lease = self.leases.get(attempt)?;
        Some(LeaseView {
            id: lease.id.to_string(),
            rank: lease.rank,
            attempt: *attempt,
            incarnation: lease.incarnation,
            blocks: lease.held.len() as u64,
            last_touched: lease.last_touched,
        })
    }

    /// Live leases (all ranks).
    pub fn leases(&self) -> usize {
        self.leases.len()
    }

    /// The rank's indexed hashes with their copy counts, sorted by hash (inspection and tests).
    pub fn cached_hashes(&self, rank: Rank) -> Vec<(u64, usize)> {
        let mut hashes: Vec<(u64, usize)> = self
            .pools
            .get(&rank)
            .map(|pool| {
                pool.by_hash
                    .iter()
                    .map(|(&hash, copies)| (hash, copies.len()))
                    .collect()
            })
            .unwrap_or_default();
        hashes.sort_unstable();
        hashes
    }

    /// The rank's inactive copies in eviction order, as `(sequence hash or None, position)`
    /// (inspection and tests).
    pub fn eviction_order(&self, rank: Rank) -> Vec<(Option<u64>, u32)> {
        let mut order = Vec::new();
        let Some(pool) = self.pools.get(&rank) else {
            return order;
        };
        let mut slot = pool.head;
        while slot != NIL {
            let copy = &pool.slots[slot as usize];
            order.push((copy.hash, copy.position));
            slot = copy.next;
        }
        order
    }

    fn live_attempt(&self, lease: LeaseRef<'_>) -> Option<Attempt> {
        let attempt = *self.live.get(lease.id)?;
        match lease.attempt {
            Some(pinned) if pinned != attempt => None,
            _ => Some(attempt),
        }
    }

    fn release_attempt(&mut self, attempt: Attempt) -> Option<LeaseEvents> {
        let lease = self.leases.remove(&attempt)?;
        self.live.remove(&lease.id);
        let pool = self.pools.get_mut(&lease.rank)?;
        pool.leases.remove(&attempt);
        pool.release(&lease.held);
        let mut removed = Vec::new();
        let evicted_blocks = pool.make_room(0, &mut removed);
        self.counters.evicted_blocks += evicted_blocks;
        Some(LeaseEvents {
            rank: lease.rank,
            attempt,
            events: removed_events(removed),
            evicted_blocks,
        })
    }

    /// Removes the rank's pool and its leases. Returns (whether a pool existed, leases dropped).
    fn drop_pool(&mut self, rank: Rank) -> (bool, u64) {
        let Some(pool) = self.pools.remove(&rank) else {
            return (false, 0);
        };
        let mut retired = 0;
        for attempt in &pool.leases {
            if let Some(lease) = self.leases.remove(attempt) {
                self.live.remove(&lease.id);
                retired += 1;
            }
        }
        self.counters.retired_leases += retired;
        (true, retired)
    }
}

fn position_u32(position: usize) -> u32 {
    u32::try_from(position).unwrap_or(u32::MAX)
}

fn removed_events(removed: Vec<u64>) -> Vec<KvEvent> {
    if removed.is_empty() {
        Vec::new()
    } else {
        vec![removed_event(removed)]
    }
}
