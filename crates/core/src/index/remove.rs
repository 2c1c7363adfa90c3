//! The removal side of the index: `Removed` and `Cleared` events, rank and worker removal, and
//! the eviction and purge that keep it within `max_blocks`.

use super::*;

impl RadixIndex {
    /// Removes the blocks of a `Removed` event a chunk at a time: like [`Self::store`], it first
    /// looks up every block of the chunk in the rank's table, then their nodes and the nodes'
    /// places in `sequence hash → node`, back to back, so that the cache misses of a chunk
    /// overlap; the removals then find those lines in cache.
    pub(super) fn remove(
        &mut self,
        slot: u32,
        engine_hashes: &[u64],
        tier: Tier,
        outcome: &mut ApplyOutcome,
    ) {
        let mut keys = [0u64; REMOVE_CHUNK];
        let mut found = [u32::MAX; REMOVE_CHUNK];
        for chunk in engine_hashes.chunks(REMOVE_CHUNK) {
            for ((k, f), &h) in keys.iter_mut().zip(&mut found).zip(chunk) {
                *k = self.hasher.hash_one(h);
                *f = match self.resolve(slot, h, *k) {
                    Resolved::Explicit(e) => e.node(),
                    Resolved::Implicit(node, _) => node,
                    Resolved::None => u32::MAX,
                };
            }
            let mut warm = 0u64;
            for &node in &found[..chunk.len()] {
                if node < self.nodes.len {
                    let key = self.hasher.hash_one(self.nodes.get(node).sequence_hash);
                    if let Some(&n) = self.by_sequence.find(key, |&n| n == node) {
                        warm ^= u64::from(n) ^ self.nodes.get(n).holders.warm(&self.arena);
                    }
                }
            }
            std::hint::black_box(warm);
            for (&h, &key) in chunk.iter().zip(&keys) {
                self.remove_one(slot, h, key, tier, outcome);
            }
        }
    }

    /// Removes one block of a `Removed` event; `hash` is the table hash of its engine hash.
    pub(super) fn remove_one(
        &mut self,
        slot: u32,
        engine_hash: u64,
        hash: u64,
        tier: Tier,
        outcome: &mut ApplyOutcome,
    ) {
        let t = tier.index();
        let bit: TierMask = 1 << t;
        match self.resolve(slot, engine_hash, hash) {
            Resolved::Explicit(_) => {}
            Resolved::Implicit(node, mask) => {
                if mask & bit == 0 {
                    outcome.unknown_removed_blocks += 1;
                    return;
                }
                outcome.removed_blocks += 1;
                let mask = mask & !bit;
                let entry_delta = if mask == 0 {
                    self.slots[slot as usize].implicit -= 1;
                    -1
                } else {
                    0
                };
                let mut transitions = [0i8; 3];
                transitions[t] = -1;
                self.update_presence(slot, node, transitions, mask, entry_delta);
                return;
            }
            Resolved::None => {
                outcome.unknown_removed_blocks += 1;
                return;
            }
        }
        let nodes = &self.nodes;
        let RankSlot {
            blocks,
            counts,
            stale,
            ..
        } = &mut self.slots[slot as usize];
        let Ok(mut occupied) = blocks.find_entry(hash, |e| e.engine_hash() == engine_hash) else {
            outcome.unknown_removed_blocks += 1;
            return;
        };
        let entry = *occupied.get();
        if !nodes.is_live(entry.node()) {
            // The block was evicted by the cap; forget the stale entry.
            occupied.remove();
            if entry.multi() {
                counts.remove(&engine_hash);
            }
            *stale = stale.saturating_sub(1);
            outcome.unknown_removed_blocks += 1;
            return;
        }
        let mask = entry.mask();
        if mask & bit == 0 {
            outcome.unknown_removed_blocks += 1;
            return;
        }
        outcome.removed_blocks += 1;
        let mut tier_left = true;
        if entry.multi() {
            let mut single = true;
            if let Some(c) = counts.get_mut(&engine_hash) {
                c[t] -= 1;
                tier_left = c[t] == 0;
                single = c.iter().all(|&x| x <= 1);
            }
            if single {
                counts.remove(&engine_hash);
                occupied.get_mut().set_multi(false);
            }
        }
        if !tier_left {
            return;
        }
        let mask = mask & !bit;
        let entry_delta = if mask == 0 {
            occupied.remove();
            self.slots[slot as usize].explicit_removed(entry.node());
            -1
        } else {
            occupied.get_mut().set_mask(mask);
            0
        };
        let mut transitions = [0i8; 3];
        transitions[t] = -1;
        self.update_presence(slot, entry.node(), transitions, mask, entry_delta);
    }

    pub(super) fn clear_slot(&mut self, slot: u32) {
        let rank_slots = self.slots.len();
        let mut blocks = std::mem::take(&mut self.slots[slot as usize].blocks);
        for entry in blocks.iter() {
            let node = entry.node();
            if !self.nodes.is_live(node) {
                continue;
            }
            let n = self.nodes.get_mut(node);
            n.holders.set_mask(&mut self.arena, slot, 0, rank_slots);
            if n.holders.is_empty() {
                self.free_node(node);
            }
        }
        let mut implicit = self.slots[slot as usize].implicit;
        if implicit > 0 {
            // The nodes held implicitly are known only by their holder sets: a pass over the
            // nodes until all are found (what the per-rank entries saved in memory costs this
            // rare event).
            for node in 0..self.nodes.len {
                if implicit == 0 {
                    break;
                }
                if !self.nodes.is_live(node) {
                    continue;
                }
                let n = self.nodes.get_mut(node);
                if n.holders.mask_of(&self.arena, slot) == 0 {
                    continue;
                }
                n.holders.set_mask(&mut self.arena, slot, 0, rank_slots);
                implicit -= 1;
                if n.holders.is_empty() {
                    self.free_node(node);
                }
            }
        }
        let rank_slot = &mut self.slots[slot as usize];
        rank_slot.alias_counts = HashMap::new();
        rank_slot.counts = HashMap::new();
        rank_slot.explicit_nodes = HashMap::new();
        rank_slot.implicit = 0;
        rank_slot.stale = 0;
        // Keep the allocation when it is modest: a cleared rank usually fills up again.
        blocks.clear();
        if blocks.capacity() > 4096 {
            blocks = HashTable::new();
        }
        rank_slot.blocks = blocks;
    }

    /// Removes every block of a rank and forgets the rank (worker deleted).
    pub fn remove_rank(&mut self, rank: Rank) -> usize {
        let Some(slot) = self.slot_of.remove(&rank) else {
            return 0;
        };
        self.rank_order.retain(|&(_, s)| s != slot);
        let held = self.slots[slot as usize].held();
        self.clear_slot(slot);
        let rank_slot = &mut self.slots[slot as usize];
        rank_slot.rank = None;
        rank_slot.blocks = HashTable::new();
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

    /// Frees a node whose holder set is (or has just been made) empty.
    pub(super) fn free_node(&mut self, node: u32) {
        self.drop_canonical(node);
        let n = self.nodes.get_mut(node);
        n.holders.clear(&mut self.arena);
        let hash = self.hasher.hash_one(n.sequence_hash);
        if let Ok(entry) = self.by_sequence.find_entry(hash, |&x| x == node) {
            entry.remove();
        }
        self.nodes.mark_freed(node);
        self.dead_nodes.push(node);
        self.live_nodes -= 1;
    }

    /// Recycles the dead slots: drops the stale rank entries and creation records that may
    /// still point at them, then makes them free.
    pub(super) fn purge(&mut self) {
        if self.stale_entries {
            let nodes = &self.nodes;
            for rank_slot in &mut self.slots {
                let RankSlot {
                    blocks,
                    counts,
                    stale,
                    ..
                } = rank_slot;
                blocks.retain(|e| {
                    // (No node is being created during a purge: allocated is live.)
                    let live = nodes.is_allocated(e.node());
                    if !live && e.multi() {
                        counts.remove(&e.engine_hash());
                    }
                    live
                });
                *stale = 0;
            }
            self.stale_entries = false;
        }
        let nodes = &self.nodes;
        self.creation_order.retain(|n| nodes.is_allocated(n));
        self.free_nodes.append(&mut self.dead_nodes);
    }

    pub(super) fn enforce_cap(&mut self, outcome: &mut ApplyOutcome) {
        while self.live_nodes > self.max_live_nodes() {
            if !self.evict_oldest() {
                break;
            }
            outcome.evicted_blocks += 1;
        }
    }

    /// Evicts the oldest live node; false when there is none.
    pub(super) fn evict_oldest(&mut self) -> bool {
        while let Some(node) = self.creation_order.pop_front() {
            if self.nodes.is_live(node) {
                self.evict_node(node);
                return true;
            }
        }
        false
    }

    /// Drops a node for every rank holding it; their map entries go stale until the next purge.
    pub(super) fn evict_node(&mut self, node: u32) {
        for (slot, _) in self.nodes.get(node).holders.entries(&self.arena) {
            let rank_slot = &mut self.slots[slot as usize];
            rank_slot.alias_counts.remove(&node);
            match rank_slot.explicit_nodes.remove(&node) {
                Some(entries) => rank_slot.stale += entries as usize,
                None => rank_slot.implicit -= 1,
            }
        }
        self.stale_entries = true;
        self.free_node(node);
    }
}
