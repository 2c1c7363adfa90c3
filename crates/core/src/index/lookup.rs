//! The read side of the index: prefix matches for a prompt, the dump as events, memory use.

use super::*;

/// Number of prompt blocks whose nodes are looked up together, so their cache misses overlap.
const LOOKUP_CHUNK: usize = 32;

impl RadixIndex {
    /// The slot after `node`, if it holds the live node of `sequence_hash` (the check is exact:
    /// a live node is the only one with its sequence hash).
    #[inline]
    pub(super) fn node_after(&self, node: u32, sequence_hash: u64) -> Option<u32> {
        let next = node + 1;
        (next < self.nodes.len).then_some(next).filter(|&n| {
            let n = self.nodes.get(n);
            n.sequence_hash == sequence_hash && !n.holders.is_empty()
        })
    }

    #[inline]
    pub(super) fn lookup(&self, sequence_hash: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.by_sequence
            .find(self.hasher.hash_one(sequence_hash), |&n| {
                nodes.get(n).sequence_hash == sequence_hash
            })
            .copied()
    }

    /// Each rank's overlap with a prompt given by its sequence hashes: the number of leading
    /// blocks it holds, per cumulative tier. Ranks with no overlap are left out; the others come
    /// in rank order. [`Self::find_matches_compact`], every floor member listed.
    pub fn find_matches(&self, sequence_hashes: &[u64]) -> Matches {
        let compact = self.find_matches_compact(sequence_hashes);
        let Some(floor) = &compact.floor else {
            return Matches {
                ranks: compact.listed,
            };
        };
        let mut ranks = Vec::with_capacity(compact.listed.len() + floor.count());
        let mut listed = compact.listed.iter().peekable();
        for &(rank, slot) in &self.rank_order {
            if let Some(o) = listed.next_if(|o| o.rank == rank) {
                ranks.push(*o);
            } else if floor.has_slot(slot) {
                ranks.push(floor.overlap(rank));
            }
        }
        Matches { ranks }
    }

    /// Whether `rank` is a member of `floor` (an answer of this index).
    pub fn floor_has(&self, floor: &Floor, rank: Rank) -> bool {
        self.slot_of
            .get(&rank)
            .is_some_and(|&slot| floor.has_slot(slot))
    }

    /// The members of `floor` (an answer of this index), in slot order.
    pub fn floor_members(&self, floor: &Floor) -> Vec<Rank> {
        let mut out = Vec::with_capacity(floor.count());
        for (w, &word) in floor.members.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let slot = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if let Some(rank) = self.slots.get(slot).and_then(|s| s.rank) {
                    out.push(rank);
                }
            }
        }
        out
    }

    /// [`Self::find_matches`] without listing the ranks a shared first block makes alike: when
    /// most ranks matching a prompt stop at the same block, they are a [`Floor`] (module `walk`),
    /// and the answer lists only the others, so its size is that of the deep matches.
    pub fn find_matches_compact(&self, sequence_hashes: &[u64]) -> CompactMatches {
        let mut walk: Option<Walk> = None;
        let mut chunk = [0u32; LOOKUP_CHUNK];
        let mut previous: Option<u32> = None;
        let mut depth = 0usize;
        'walk: while depth < sequence_hashes.len() {
            let end = (depth + LOOKUP_CHUNK).min(sequence_hashes.len());
            let mut found = 0;
            for &key in &sequence_hashes[depth..end] {
                // A prompt's blocks usually arrived in one event and sit in consecutive slots:
                // try the slot after the previous block's before the table.
                let next = previous
                    .and_then(|p| self.node_after(p, key))
                    .or_else(|| self.lookup(key));
                match next {
                    Some(node) => {
                        chunk[found] = node;
                        found += 1;
                        previous = Some(node);
                    }
                    None => break,
                }
            }
            let complete = found == end - depth;
            for &node in &chunk[..found] {
                let holders = self.nodes.get(node).holders.view(&self.arena);
                match walk.as_mut() {
                    None => walk = Some(Walk::new(holders, self.slots.len())),
                    Some(w) => w.step(holders, depth as u32),
                }
                depth += 1;
                if walk.as_ref().is_some_and(|w| !w.any_alive()) {
                    break 'walk;
                }
            }
            if !complete {
                break;
            }
        }
        match walk {
            None => CompactMatches::default(),
            Some(w) => w.finish_compact(depth as u32, &self.slots, &self.rank_order),
        }
    }

    /// Whether `rank` holds the block of `sequence_hash` on `tier` (under any engine hash).
    pub fn holds(&self, rank: Rank, sequence_hash: u64, tier: Tier) -> bool {
        let Some(&slot) = self.slot_of.get(&rank) else {
            return false;
        };
        self.lookup(sequence_hash).is_some_and(|node| {
            self.nodes.get(node).holders.mask_of(&self.arena, slot) & (1 << tier.index()) != 0
        })
    }

    /// How many leading blocks of a prompt `rank` holds on `tier`: [`Self::holds`] block after
    /// block up to the first miss, trying the slot after each block's node before the table.
    pub fn held_prefix(&self, rank: Rank, sequence_hashes: &[u64], tier: Tier) -> usize {
        let Some(&slot) = self.slot_of.get(&rank) else {
            return 0;
        };
        let bit = 1 << tier.index();
        let mut previous: Option<u32> = None;
        for (depth, &s) in sequence_hashes.iter().enumerate() {
            let node = previous
                .and_then(|p| self.node_after(p, s))
                .or_else(|| self.lookup(s));
            match node {
                Some(n) if self.nodes.get(n).holders.mask_of(&self.arena, slot) & bit != 0 => {
                    previous = Some(n);
                }
                _ => return depth,
            }
        }
        sequence_hashes.len()
    }

    /// The sequence hash of the block `rank` holds under `engine_hash`, if it holds one.
    pub fn sequence_hash_of(&self, rank: Rank, engine_hash: u64) -> Option<u64> {
        let &slot = self.slot_of.get(&rank)?;
        self.live_node(slot, engine_hash)
            .map(|node| self.nodes.get(node).sequence_hash)
    }

    /// [`find_matches`](Self::find_matches) for a prompt given by its local hashes.
    pub fn find_matches_local(&self, local_hashes: &[u64]) -> Matches {
        self.find_matches(&crate::hash::sequence_hashes(local_hashes))
    }

    /// The index as events: per rank, `Stored` events that re-create what it holds (parents
    /// before children, one event per block and tier with its store count), for recovery.
    /// Blocks the rank cannot reach from a first block through blocks it holds cannot be
    /// re-stored under their parent and are left out; they add nothing to any overlap (overlap
    /// is contiguous from the first block). Blocks recorded under [`predicted_engine_hash`] are
    /// left out: they are the selector's guesses of the next few seconds, which a copy would keep
    /// forever.
    pub fn dump(&self) -> Vec<(Rank, KvEvent)> {
        let mut out = Vec::new();
        // The implicit holdings of every rank, as entries, in one pass over the nodes.
        let mut implicit: Vec<Vec<BlockRef>> = vec![Vec::new(); self.slots.len()];
        for node in 0..self.nodes.len {
            let Some(engine_hash) = self.nodes.canonical(node) else {
                continue;
            };
            for (slot, mask) in self.nodes.get(node).holders.entries(&self.arena) {
                if !self.slots[slot as usize].explicit_nodes.contains_key(&node) {
                    implicit[slot as usize].push(BlockRef::new(engine_hash, node, mask));
                }
            }
        }
        for (slot, implicit) in self.slots.iter().zip(implicit) {
            let Some(rank) = slot.rank else { continue };
            let mut entries: Vec<BlockRef> = slot
                .blocks
                .iter()
                .filter(|r| self.nodes.is_live(r.node()))
                .filter(|r| {
                    r.engine_hash() != predicted_engine_hash(self.nodes.get(r.node()).sequence_hash)
                })
                .copied()
                .chain(implicit)
                .collect();
            entries.sort_unstable_by_key(|r| r.engine_hash());
            // This rank's engine hash for each node it holds (the smallest, if several).
            let mut engine_of: HashMap<u32, u64> = HashMap::with_capacity(entries.len());
            for r in &entries {
                engine_of.entry(r.node()).or_insert(r.engine_hash());
            }
            // The held nodes by the low half of their sequence hash, to find parents.
            let mut by_tag: Vec<(u32, u32)> = engine_of
                .keys()
                .map(|&n| (self.nodes.get(n).sequence_hash as u32, n))
                .collect();
            by_tag.sort_unstable();
            let parent_of = |node: u32| -> Option<Option<u32>> {
                let n = self.nodes.get(node);
                if n.sequence_hash == n.local_hash {
                    return Some(None);
                }
                let from = by_tag.partition_point(|&(tag, _)| tag < n.parent_tag);
                by_tag[from..]
                    .iter()
                    .take_while(|&&(tag, _)| tag == n.parent_tag)
                    .map(|&(_, p)| p)
                    .find(|&p| {
                        chain(self.nodes.get(p).sequence_hash, n.local_hash) == n.sequence_hash
                    })
                    .map(Some)
            };
            // Depth of each node within this rank's chains; `None` when a chain is broken.
            let mut depth_of: HashMap<u32, Option<u32>> = HashMap::with_capacity(engine_of.len());
            let mut path = Vec::new();
            for &start in engine_of.keys() {
                // Climb to a node of known depth, a first block or a missing parent.
                let mut node = start;
                let mut next = loop {
                    if let Some(&known) = depth_of.get(&node) {
                        break known.map(|d| d + 1);
                    }
                    path.push(node);
                    if path.len() > engine_of.len() {
                        break None;
                    }
                    match parent_of(node) {
                        None => break None,
                        Some(None) => break Some(0),
                        Some(Some(parent)) => node = parent,
                    }
                };
                while let Some(n) = path.pop() {
                    depth_of.insert(n, next);
                    next = next.map(|d| d + 1);
                }
            }
            let mut ordered: Vec<(u32, BlockRef)> = entries
                .iter()
                .filter_map(|r| depth_of.get(&r.node()).copied().flatten().map(|d| (d, *r)))
                .collect();
            ordered.sort_by_key(|&(d, r)| (d, r.engine_hash()));
            for (_, r) in ordered {
                let node = self.nodes.get(r.node());
                let parent = match parent_of(r.node()) {
                    Some(Some(p)) => engine_of.get(&p).copied(),
                    _ => None,
                };
                let counts = if r.multi() {
                    slot.counts
                        .get(&r.engine_hash())
                        .copied()
                        .unwrap_or_default()
                } else {
                    let mut counts = [0u32; 3];
                    for (t, c) in counts.iter_mut().enumerate() {
                        *c = u32::from(r.mask() & (1 << t) != 0);
                    }
                    counts
                };
                for tier in Tier::ALL {
                    for _ in 0..counts[tier.index()] {
                        out.push((
                            rank,
                            KvEvent::Stored {
                                parent,
                                blocks: vec![StoredBlock {
                                    engine_hash: r.engine_hash(),
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

    /// Estimated heap and inline bytes of the index: every table and vector at its capacity
    /// (not its length), node chunks, holder sets, plus an allocator overhead per allocation.
    pub fn memory_bytes(&self) -> usize {
        let slots = self
            .slots
            .iter()
            .map(|s| {
                table_bytes(s.blocks.capacity(), std::mem::size_of::<BlockRef>())
                    + table_bytes(s.counts.capacity(), 8 + 12)
                    + table_bytes(s.alias_counts.capacity(), 4 + 16)
                    + table_bytes(s.explicit_nodes.capacity(), 4 + 4)
            })
            .sum::<usize>();
        std::mem::size_of::<Self>()
            + self.nodes.memory_bytes()
            + self.arena.memory_bytes()
            + table_bytes(self.by_sequence.capacity(), 4)
            + table_bytes(self.by_engine.capacity(), 4)
            + (self.free_nodes.capacity() + self.dead_nodes.capacity()) * 4
            + self.creation_order.memory_bytes()
            + self.slots.capacity() * std::mem::size_of::<RankSlot>()
            + slots
            + table_bytes(self.slot_of.capacity(), std::mem::size_of::<(Rank, u32)>())
            + self.free_slots.capacity() * 4
            + self.rank_order.capacity() * std::mem::size_of::<(Rank, u32)>()
    }
}
