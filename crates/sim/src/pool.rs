//! A vLLM-like KV block pool with prefix caching and LRU eviction (one per simulated worker).
//!
//! ## Model
//! - The pool has `capacity` blocks (or is unlimited). A request holds a *block table*: its full,
//!   computed blocks are **cached** — named by their sequence hash, shareable by every request
//!   whose prompt starts the same way — and the block it is still filling is **private**.
//! - A cached block carries a reference count. When it drops to 0 the block stays resident (and
//!   can still be hit) but becomes *free*: it joins the eviction order with a fresh stamp.
//! - A request releases its blocks **tail first**, so within one request the deepest block gets
//!   the oldest stamp; eviction takes the smallest stamp. Hence the oldest release goes first
//!   and, within it, tail → root, so shared prefixes outlive their private suffixes (vLLM's
//!   free-block queue behaves the same way).
//! - Allocation needs `in_use + new ≤ capacity`, where `in_use` counts referenced cached blocks
//!   plus private ones; free cached blocks are evicted on demand to make room.
//! - Filling a block caches it under its hash. If that hash is already resident (another request
//!   computed the same block meanwhile), the request shares the resident copy instead of keeping
//!   a second one (a simplification of vLLM, which keeps both copies until eviction).
//!
//! Every block that becomes cached is reported as a `Stored` event (chained to its parent by
//! sequence hash, which doubles as the engine's block hash) and every eviction as a `Removed`
//! event, in order, exactly as the engine's KV-event publisher would.
//!
//! All operations are O(blocks touched) hash-map work plus O(log n) per block entering or leaving
//! the eviction order.

use hashbrown::HashMap;
use kvroute_core::event::{KvEvent, StoredBlock, Tier};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy)]
struct CachedBlock {
    refs: u32,
    /// Position in the eviction order; meaningful only while `refs == 0`.
    free_stamp: u64,
}

/// Counters of what the pool did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounters {
    /// Blocks that became cached (each one a stored block in an event).
    pub stored_blocks: u64,
    /// Cached blocks evicted to make room.
    pub evicted_blocks: u64,
    /// Fills that found their hash already resident and shared it.
    pub deduplicated_blocks: u64,
}

/// The KV block pool of one engine. See the module documentation.
#[derive(Debug, Clone)]
pub struct BlockPool {
    capacity: Option<u64>,
    cached: HashMap<u64, CachedBlock>,
    /// Free cached blocks by eviction stamp (smallest first out).
    free: BTreeMap<u64, u64>,
    next_stamp: u64,
    private_in_use: u64,
    referenced_cached: u64,
    events: Vec<KvEvent>,
    counters: PoolCounters,
}

impl BlockPool {
    /// A pool of `capacity` blocks (`None`: unlimited, nothing is ever evicted).
    pub fn new(capacity: Option<u64>) -> Self {
        Self {
            capacity,
            cached: HashMap::new(),
            free: BTreeMap::new(),
            next_stamp: 0,
            private_in_use: 0,
            referenced_cached: 0,
            events: Vec::new(),
            counters: PoolCounters::default(),
        }
    }

    pub fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// Blocks held by requests (referenced cached blocks plus private ones).
    pub fn in_use(&self) -> u64 {
        self.private_in_use + self.referenced_cached
    }

    /// Blocks occupying memory: in use plus free cached blocks kept for prefix hits.
    pub fn resident(&self) -> u64 {
        self.private_in_use + self.cached.len() as u64
    }

    /// Free cached blocks (evictable, still hittable).
    pub fn free_cached(&self) -> u64 {
        self.free.len() as u64
    }

    pub fn counters(&self) -> PoolCounters {
        self.counters
    }

    /// Whether a block with this sequence hash is resident.
    pub fn is_cached(&self, sequence_hash: u64) -> bool {
        self.cached.contains_key(&sequence_hash)
    }

    /// How many leading blocks of a prompt (its sequence hashes) are resident: the prefix a
    /// request sent here now would find cached.
    pub fn cached_prefix_blocks(&self, sequence: &[u64]) -> usize {
        sequence.iter().take_while(|h| self.is_cached(**h)).count()
    }

    /// Blocks that could still be allocated (evicting free cached blocks as needed).
    pub fn allocatable(&self) -> u64 {
        match self.capacity {
            Some(c) => c.saturating_sub(self.in_use()),
            None => u64::MAX,
        }
    }

    /// Takes a reference on each hit block (all must be resident) and allocates `new_private`
    /// private blocks, evicting free cached blocks as needed. Returns `false`, changing nothing,
    /// when that does not fit.
    pub fn try_allocate(&mut self, hits: &[u64], new_private: u64) -> bool {
        let reactivated = hits
            .iter()
            .filter(|h| self.cached.get(*h).is_some_and(|b| b.refs == 0))
            .count() as u64;
        if hits.iter().any(|h| !self.cached.contains_key(h)) {
            return false;
        }
        if new_private.saturating_add(reactivated) > self.allocatable() {
            return false;
        }
        for h in hits {
            self.take_reference(*h);
        }
        if let Some(capacity) = self.capacity {
            while self.resident() + new_private > capacity {
                if !self.evict_one() {
                    break;
                }
            }
        }
        self.private_in_use += new_private;
        true
    }

    fn take_reference(&mut self, sequence_hash: u64) {
        if let Some(block) = self.cached.get_mut(&sequence_hash) {
            if block.refs == 0 {
                self.free.remove(&block.free_stamp);
                self.referenced_cached += 1;
            }
            block.refs += 1;
        }
    }

    fn evict_one(&mut self) -> bool {
        let Some((_, sequence_hash)) = self.free.pop_first() else {
            return false;
        };
        self.cached.remove(&sequence_hash);
        self.counters.evicted_blocks += 1;
        match self.events.last_mut() {
            Some(KvEvent::Removed { engine_hashes, .. }) => engine_hashes.push(sequence_hash),
            _ => self.events.push(KvEvent::Removed {
                engine_hashes: vec![sequence_hash],
                tier: Tier::Device,
            }),
        }
        true
    }

    /// One private block of a request is now full and computed: cache it under its hash (or share
    /// the resident copy). `parent` is the sequence hash of the block before it (`None` for a
    /// prompt's first block). The caller must hold a private block.
    pub fn fill(&mut self, parent: Option<u64>, block: StoredBlock) {
        self.private_in_use = self.private_in_use.saturating_sub(1);
        let sequence_hash = block.engine_hash;
        if self.cached.contains_key(&sequence_hash) {
            self.counters.deduplicated_blocks += 1;
            self.take_reference(sequence_hash);
            return;
        }
        self.cached.insert(
            sequence_hash,
            CachedBlock {
                refs: 1,
                free_stamp: 0,
            },
        );
        self.referenced_cached += 1;
        self.counters.stored_blocks += 1;
        // Extend the last event when this block continues its chain: one event per run of blocks.
        if let Some(KvEvent::Stored {
            parent: event_parent,
            blocks,
            ..
        }) = self.events.last_mut()
        {
            let continues = match blocks.last() {
                Some(last) => Some(last.engine_hash) == parent,
                None => *event_parent == parent,
            };
            if continues {
                blocks.push(block);
                return;
            }
        }
        self.events.push(KvEvent::Stored {
            parent,
            blocks: vec![block],
            tier: Tier::Device,
        });
    }

    /// Releases a request's block table: its cached blocks (root first, as held) and `private`
    /// private blocks. Cached blocks whose count reaches 0 become free, tail first.
    pub fn release(&mut self, cached: &[u64], private: u64) {
        self.private_in_use = self.private_in_use.saturating_sub(private);
        for &sequence_hash in cached.iter().rev() {
            let Some(block) = self.cached.get_mut(&sequence_hash) else {
                continue;
            };
            block.refs = block.refs.saturating_sub(1);
            if block.refs == 0 {
                block.free_stamp = self.next_stamp;
                self.free.insert(self.next_stamp, sequence_hash);
                self.next_stamp += 1;
                self.referenced_cached = self.referenced_cached.saturating_sub(1);
            }
        }
    }

    /// The KV events produced since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Checks the bookkeeping invariants (for tests): counts agree with the maps and the pool is
    /// within capacity.
    pub fn check_invariants(&self) -> Result<(), String> {
        let referenced = self.cached.values().filter(|b| b.refs > 0).count() as u64;
        if referenced != self.referenced_cached {
            return Err(format!(
                "referenced cached blocks {referenced} != counter {}",
                self.referenced_cached
            ));
        }
        let free = self.cached.values().filter(|b| b.refs == 0).count();
        if free != self.free.len() {
            return Err(format!(
                "free blocks {free} != eviction order {}",
                self.free.len()
            ));
        }
        for (stamp, h) in &self.free {
            match self.cached.get(h) {
                Some(b) if b.refs == 0 && b.free_stamp == *stamp => {}
                _ => return Err(format!("eviction entry {stamp} → {h:#x} is stale")),
            }
        }
        if let Some(c) = self.capacity
            && self.resident() > c
        {
            return Err(format!("resident {} > capacity {c}", self.resident()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(h: u64) -> StoredBlock {
        StoredBlock {
            engine_hash: h,
            local_hash: h ^ 0xabc,
        }
    }

    /// Allocates and fills a chain of blocks as one request would; returns its table.
    fn compute(pool: &mut BlockPool, chain: &[u64]) -> Vec<u64> {
        let hits: Vec<u64> = chain
            .iter()
            .copied()
            .take_while(|h| pool.is_cached(*h))
            .collect();
        let new = (chain.len() - hits.len()) as u64;
        assert!(pool.try_allocate(&hits, new));
        for i in hits.len()..chain.len() {
            let parent = i.checked_sub(1).map(|p| chain[p]);
            pool.fill(parent, block(chain[i]));
        }
        chain.to_vec()
    }

    #[test]
    fn a_released_prefix_is_hit_again() {
        let mut pool = BlockPool::new(Some(10));
        let table = compute(&mut pool, &[1, 2, 3]);
        assert_eq!(pool.in_use(), 3);
        pool.release(&table, 0);
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.resident(), 3);
        assert!(pool.is_cached(1) && pool.is_cached(3));
        // A second prompt sharing the first two blocks reuses them and computes one new block.
        let table = compute(&mut pool, &[1, 2, 4]);
        assert_eq!(pool.in_use(), 3);
        assert_eq!(pool.resident(), 4);
        assert_eq!(pool.counters().stored_blocks, 4);
        pool.release(&table, 0);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn eviction_is_lru_by_release_and_tail_to_root_within_a_release() {
        let mut pool = BlockPool::new(Some(6));
        let a = compute(&mut pool, &[1, 2, 3]);
        let b = compute(&mut pool, &[10, 20, 30]);
        pool.take_events();
        pool.release(&a, 0); // freed first: 3, 2, 1 (tail first)
        pool.release(&b, 0); // then 30, 20, 10
        // Two new private blocks need two evictions: the tail of the oldest release first.
        assert!(pool.try_allocate(&[], 2));
        assert_eq!(
            pool.take_events(),
            vec![KvEvent::Removed {
                engine_hashes: vec![3, 2],
                tier: Tier::Device
            }]
        );
        assert!(pool.is_cached(1) && !pool.is_cached(2) && !pool.is_cached(3));
        assert!(pool.try_allocate(&[], 2));
        assert_eq!(
            pool.take_events(),
            vec![KvEvent::Removed {
                engine_hashes: vec![1, 30],
                tier: Tier::Device
            }]
        );
        pool.check_invariants().unwrap();
    }

    #[test]
    fn a_hit_takes_the_block_out_of_the_eviction_order() {
        let mut pool = BlockPool::new(Some(4));
        let a = compute(&mut pool, &[1, 2]);
        let b = compute(&mut pool, &[5, 6]);
        pool.release(&a, 0);
        pool.release(&b, 0);
        // Re-using [1, 2] makes 6 then 5 the next victims.
        let a = compute(&mut pool, &[1, 2]);
        pool.take_events();
        assert!(pool.try_allocate(&[], 1));
        assert_eq!(
            pool.take_events(),
            vec![KvEvent::Removed {
                engine_hashes: vec![6],
                tier: Tier::Device
            }]
        );
        pool.release(&a, 1);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn allocation_fails_without_room_and_changes_nothing() {
        let mut pool = BlockPool::new(Some(3));
        let _held = compute(&mut pool, &[1, 2]);
        assert!(!pool.try_allocate(&[], 2));
        assert_eq!(pool.in_use(), 2);
        assert!(pool.try_allocate(&[], 1));
        assert_eq!(pool.allocatable(), 0);
        // Re-activating a free cached block also needs room.
        let mut pool = BlockPool::new(Some(2));
        let a = compute(&mut pool, &[1]);
        pool.release(&a, 0);
        assert!(pool.try_allocate(&[], 2)); // evicts block 1
        assert!(!pool.is_cached(1));
        let mut pool = BlockPool::new(Some(2));
        let a = compute(&mut pool, &[1]);
        pool.release(&a, 0);
        assert!(pool.try_allocate(&[], 1));
        assert!(
            !pool.try_allocate(&[1], 1),
            "1 free hit + 1 new > 1 allocatable"
        );
        assert!(pool.try_allocate(&[1], 0));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn stored_events_chain_runs_of_blocks() {
        let mut pool = BlockPool::new(None);
        compute(&mut pool, &[1, 2, 3]);
        compute(&mut pool, &[1, 2, 7, 8]);
        assert_eq!(
            pool.take_events(),
            vec![
                KvEvent::Stored {
                    parent: None,
                    blocks: vec![block(1), block(2), block(3)],
                    tier: Tier::Device
                },
                KvEvent::Stored {
                    parent: Some(2),
                    blocks: vec![block(7), block(8)],
                    tier: Tier::Device
                },
            ]
        );
        assert!(pool.take_events().is_empty());
    }

    #[test]
    fn filling_an_already_resident_hash_shares_it() {
        let mut pool = BlockPool::new(Some(8));
        // Two requests allocate privately before either fills (they were admitted together).
        assert!(pool.try_allocate(&[], 1));
        assert!(pool.try_allocate(&[], 1));
        pool.fill(None, block(1));
        pool.fill(None, block(1));
        assert_eq!(pool.in_use(), 1);
        assert_eq!(pool.resident(), 1);
        assert_eq!(pool.counters().deduplicated_blocks, 1);
        pool.release(&[1], 0);
        assert!(pool.is_cached(1));
        pool.release(&[1], 0);
        assert_eq!(pool.free_cached(), 1);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn unlimited_pools_never_evict() {
        let mut pool = BlockPool::new(None);
        let chain: Vec<u64> = (1..=10_000).collect();
        let table = compute(&mut pool, &chain);
        pool.release(&table, 0);
        assert!(pool.try_allocate(&[], 1_000_000));
        assert_eq!(pool.counters().evicted_blocks, 0);
        assert_eq!(pool.resident(), 1_010_000);
    }
}
