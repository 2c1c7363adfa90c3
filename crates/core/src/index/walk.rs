//! The walk of [`RadixIndex::find_matches`](super::RadixIndex::find_matches): the ranks still
//! matching a prompt as it goes down the tree, per cumulative tier.
//!
//! While many ranks match, they are bitsets over rank slots, and a step intersects them with the
//! block's holders: O(ranks / 64) word operations in one pass that records the ranks it drops,
//! after a vectorised read-only check since most blocks drop nobody (skipped when the block has
//! fewer holders than there are matching ranks: then somebody drops). While every matching rank
//! matches on all three tiers and the blocks are held on the device only (the common case), one
//! bitset stands for all three tiers (`uniform`). Once fewer ranks match than there are words,
//! they move to a list sorted by slot, and a step costs O(matching ranks). The depth at which a
//! rank stops matching on a tier is its overlap there.
//!
//! **The floor.** A prompt whose first blocks nearly every rank holds (a fleet-wide system
//! prompt) would answer every rank, most of them with the same short overlap. A uniform dense
//! walk keeps, of its steps that dropped at least as many ranks as it has words of rank slots,
//! the one that dropped the most: the ranks matching before it are the *floor* (a bitset) with
//! its depth, and the answer ([`Walk::finish_compact`]) lists every rank but those that step
//! dropped, each of which matched exactly that many blocks. The ranks still matching at the
//! end are such a group too (members and dropped alike). So the answer's size is the deep
//! matches' and the stragglers', not the fleet's.

use super::holders::{
    DenseHolders, TierMask, View, cumulative_bits, entry_mask, entry_slot, find_entry,
};
use super::{CompactMatches, Floor, RankOverlap, RankSlot};
use crate::event::Rank;

/// A rank still matching, in a list walk: its slot, the cumulative tiers (bit 0 device, 1 host,
/// 2 any) on which it still matches, and the depths at which it stopped on the others.
#[derive(Debug, Clone, Copy)]
struct Alive {
    slot: u32,
    tiers: u8,
    ends: [u32; 3],
}

impl Alive {
    /// Keeps matching only on the cumulative tiers `held`; a rank that stops matching on every
    /// tier moves to `done` (returns false).
    #[inline]
    fn narrow(&mut self, held: u8, depth: u32, done: &mut Vec<Alive>) -> bool {
        let tiers = self.tiers & held;
        let lost = self.tiers & !tiers;
        if lost == 0 {
            return true;
        }
        for (t, end) in self.ends.iter_mut().enumerate() {
            if lost & (1 << t) != 0 {
                *end = depth;
            }
        }
        self.tiers = tiers;
        if tiers == 0 {
            done.push(*self);
            return false;
        }
        true
    }
}

/// The ranks still matching during a lookup (see the module doc). In a dense walk, the depth at
/// which each rank stopped matching on a tier is kept per slot in `ends`; in a list walk, in the
/// list's entries.
pub(super) struct Walk {
    dense: bool,
    uniform: bool,
    alive: [Vec<u64>; 3],
    count: [usize; 3],
    /// Scratch: a cumulative tier's holders.
    held: Vec<u64>,
    ends: Vec<[u32; 3]>,
    list: Vec<Alive>,
    done: Vec<Alive>,
    /// A dense walk turns into a list walk at this many matching ranks: where a step over the
    /// list (per rank) gets cheaper than one over the bitsets (per word).
    list_below: usize,
    /// Ranks matching the first block: the size of the answer.
    matched: usize,
    /// A uniform dense walk's ranks matching the first block (to find, with a floor, those that
    /// stopped before it).
    initial: Vec<u64>,
    /// The floor (module documentation) so far.
    floor: Option<FloorStep>,
    /// Scratch: the ranks matching before a step.
    before: Vec<u64>,
}

/// The step of a walk that sets its floor.
struct FloorStep {
    depth: u32,
    /// The ranks matching before the step (rank slots).
    members: Vec<u64>,
    /// The members the step dropped (all of them, for the ranks still matching at the end).
    gone: Vec<u64>,
    dropped: usize,
}

/// `alive &= held` (a missing word of `held` is zero), calling `lost(w, bits)` for each word `w`
/// that loses bits. `drops` says that the caller knows something drops (fewer holders than
/// matching ranks), so there is no point in checking first.
#[inline]
fn intersect(alive: &mut [u64], held: &[u64], drops: bool, mut lost: impl FnMut(usize, u64)) {
    let n = held.len().min(alive.len());
    let (covered, beyond) = alive.split_at_mut(n);
    let held = &held[..n];
    if !drops {
        // Most blocks drop nobody: check first, without writing.
        let mut any = beyond.iter().fold(0, |acc, &a| acc | a);
        for (&a, &h) in covered.iter().zip(held) {
            any |= a & !h;
        }
        if any == 0 {
            return;
        }
    }
    for (w, (a, &h)) in covered.iter_mut().zip(held).enumerate() {
        let gone = *a & !h;
        if gone != 0 {
            *a &= h;
            lost(w, gone);
        }
    }
    for (w, a) in beyond.iter_mut().enumerate() {
        if *a != 0 {
            lost(n + w, *a);
            *a = 0;
        }
    }
}

/// Calls `f(slot)` for each bit of `gone` in word `w`.
#[inline]
fn for_each_bit(w: usize, mut gone: u64, mut f: impl FnMut(usize)) {
    while gone != 0 {
        let b = gone.trailing_zeros() as usize;
        gone &= gone - 1;
        f(w * 64 + b);
    }
}

impl Walk {
    pub(super) fn new(first: View<'_>, slots: usize) -> Self {
        let words = slots.div_ceil(64);
        let mut walk = Walk {
            dense: false,
            uniform: false,
            alive: [Vec::new(), Vec::new(), Vec::new()],
            count: [0; 3],
            held: Vec::new(),
            ends: Vec::new(),
            list: Vec::new(),
            done: Vec::new(),
            list_below: words,
            matched: 0,
            initial: Vec::new(),
            floor: None,
            before: Vec::new(),
        };
        let holders = match first {
            View::Entries(entries) => entries.len(),
            View::Dense(dense) => dense.tier_counts.iter().sum::<u32>() as usize,
        };
        if holders <= walk.list_below {
            match first {
                View::Entries(entries) => walk.list_from_entries(entries),
                View::Dense(dense) => walk.list_from_dense(dense, words),
            }
            walk.matched = walk.list.len();
            return walk;
        }
        walk.dense = true;
        walk.ends = vec![[0; 3]; slots];
        walk.alive = [vec![0; words], Vec::new(), Vec::new()];
        match first {
            View::Entries(entries) => {
                walk.uniform = entries.iter().all(|&e| entry_mask(e) & 1 != 0);
                if !walk.uniform {
                    walk.alive[1] = vec![0; words];
                    walk.alive[2] = vec![0; words];
                }
                for &e in entries {
                    let slot = entry_slot(e) as usize;
                    let tiers = cumulative_bits(entry_mask(e));
                    for (t, alive) in walk.alive.iter_mut().enumerate() {
                        if tiers & (1 << t) != 0 && !alive.is_empty() {
                            alive[slot / 64] |= 1 << (slot % 64);
                        }
                    }
                }
            }
            View::Dense(dense) => {
                walk.uniform = dense.tier_counts[1] == 0 && dense.tier_counts[2] == 0;
                if !walk.uniform {
                    walk.alive[1] = vec![0; words];
                    walk.alive[2] = vec![0; words];
                }
                for (t, alive) in walk.alive.iter_mut().enumerate() {
                    for tier in dense.tiers.iter().take(t + 1) {
                        for (a, &d) in alive.iter_mut().zip(tier.iter()) {
                            *a |= d;
                        }
                    }
                }
            }
        }
        for t in 0..3 {
            walk.count[t] = walk.alive[if walk.uniform { 0 } else { t }]
                .iter()
                .map(|w| w.count_ones() as usize)
                .sum();
        }
        walk.matched = walk.count[2];
        if walk.uniform {
            walk.initial.clone_from(&walk.alive[0]);
        }
        walk
    }

    fn list_from_entries(&mut self, entries: &[u32]) {
        self.list.extend(entries.iter().map(|&e| Alive {
            slot: entry_slot(e),
            tiers: cumulative_bits(entry_mask(e)),
            ends: [0; 3],
        }));
    }

    fn list_from_dense(&mut self, dense: &DenseHolders, words: usize) {
        for w in 0..words {
            let any = dense
                .tiers
                .iter()
                .fold(0, |acc, t| acc | t.get(w).copied().unwrap_or(0));
            for_each_bit(w, any, |slot| {
                let slot = slot as u32;
                self.list.push(Alive {
                    slot,
                    tiers: cumulative_bits(dense.mask_of(slot)),
                    ends: [0; 3],
                });
            });
        }
    }

    #[inline]
    pub(super) fn any_alive(&self) -> bool {
        if self.dense {
            self.count[2] > 0
        } else {
            !self.list.is_empty()
        }
    }

    /// Intersects the matching ranks with the holders of the block at `depth`.
    #[inline]
    pub(super) fn step(&mut self, holders: View<'_>, depth: u32) {
        let floor_candidate = self.dense && self.uniform;
        if floor_candidate {
            self.before.clone_from(&self.alive[0]);
        }
        let count_before = self.count[0];
        if self.dense {
            match holders {
                View::Dense(dense) => {
                    if self.uniform && (dense.tier_counts[1] > 0 || dense.tier_counts[2] > 0) {
                        self.split();
                    }
                    if self.uniform {
                        self.dense_step_uniform(&dense.tiers[0], dense.tier_counts[0], depth);
                    } else {
                        self.dense_step(dense, depth);
                    }
                }
                View::Entries(entries) => {
                    if self.uniform && entries.iter().any(|&e| entry_mask(e) & 1 == 0) {
                        self.split();
                    }
                    self.dense_step_entries(entries, depth);
                }
            }
            if floor_candidate && self.uniform {
                self.note_floor(count_before - self.count[0], depth);
            }
            if self.count[2] <= self.list_below {
                self.switch_to_list();
            }
        } else {
            match holders {
                View::Entries(entries) => self.list_step_entries(entries, depth),
                View::Dense(dense) => self.list_step(|slot| dense.mask_of(slot), depth),
            }
        }
    }

    /// After a uniform dense step that dropped `dropped` ranks at `depth` (the ranks matching
    /// before it in `before`): the floor if it dropped the most so far, and enough.
    fn note_floor(&mut self, dropped: usize, depth: u32) {
        if dropped < self.list_below.max(1)
            || self.floor.as_ref().is_some_and(|f| f.dropped >= dropped)
        {
            return;
        }
        let gone: Vec<u64> = self
            .before
            .iter()
            .zip(&self.alive[0])
            .map(|(&b, &a)| b & !a)
            .collect();
        self.floor = Some(FloorStep {
            depth,
            members: self.before.clone(),
            gone,
            dropped,
        });
    }

    /// Stops keeping one set for all tiers.
    fn split(&mut self) {
        let [device, host, any] = &mut self.alive;
        host.clone_from(device);
        any.clone_from(device);
        self.uniform = false;
    }

    fn dense_step_uniform(&mut self, device: &[u64], device_holders: u32, depth: u32) {
        let drops = (device_holders as usize) < self.count[0];
        let ends = &mut self.ends;
        let mut dropped = 0;
        intersect(&mut self.alive[0], device, drops, |w, gone| {
            for_each_bit(w, gone, |slot| {
                ends[slot] = [depth; 3];
                dropped += 1;
            });
        });
        for c in &mut self.count {
            *c -= dropped;
        }
    }

    fn dense_step(&mut self, dense: &DenseHolders, depth: u32) {
        let words = self.alive[0].len();
        for t in 0..3 {
            if self.count[t] == 0 {
                continue;
            }
            // The cumulative tier's holders: the union of the tiers up to `t`.
            let mut held = std::mem::take(&mut self.held);
            held.clear();
            held.resize(words, 0);
            for tier in &dense.tiers[..=t] {
                for (h, &d) in held.iter_mut().zip(tier.iter()) {
                    *h |= d;
                }
            }
            let holders = dense.tier_counts[..=t].iter().sum::<u32>() as usize;
            let drops = holders < self.count[t];
            let ends = &mut self.ends;
            let mut dropped = 0;
            intersect(&mut self.alive[t], &held, drops, |w, gone| {
                for_each_bit(w, gone, |slot| {
                    ends[slot][t] = depth;
                    dropped += 1;
                });
            });
            self.held = held;
            self.count[t] -= dropped;
        }
    }

    /// The tiers on which `slot` still matches, in a dense walk.
    #[inline]
    fn dense_tiers(&self, slot: u32) -> u8 {
        let (w, b) = ((slot / 64) as usize, slot % 64);
        if self.uniform {
            if self.alive[0].get(w).is_some_and(|a| a >> b & 1 != 0) {
                0b111
            } else {
                0
            }
        } else {
            let mut tiers = 0;
            for (t, alive) in self.alive.iter().enumerate() {
                if alive.get(w).is_some_and(|a| a >> b & 1 != 0) {
                    tiers |= 1 << t;
                }
            }
            tiers
        }
    }

    /// A dense walk meets a block whose holders are a list (sorted by slot).
    fn dense_step_entries(&mut self, entries: &[u32], depth: u32) {
        let tiers = if self.uniform { 1 } else { 3 };
        let words = self.alive[0].len();
        let mut next = 0;
        for w in 0..words {
            // The holders in this word, per cumulative tier.
            let mut held = [0u64; 3];
            while let Some(&e) = entries.get(next) {
                let slot = entry_slot(e) as usize;
                if slot / 64 != w {
                    break;
                }
                let bits = cumulative_bits(entry_mask(e));
                for (t, h) in held.iter_mut().enumerate() {
                    if bits & (1 << t) != 0 {
                        *h |= 1 << (slot % 64);
                    }
                }
                next += 1;
            }
            for (t, &h) in held.iter().enumerate().take(tiers) {
                let a = self.alive[t][w];
                let gone = a & !h;
                if gone == 0 {
                    continue;
                }
                self.alive[t][w] = a & h;
                let ends = &mut self.ends;
                let mut dropped = 0;
                if self.uniform {
                    for_each_bit(w, gone, |slot| {
                        ends[slot] = [depth; 3];
                        dropped += 1;
                    });
                    for c in &mut self.count {
                        *c -= dropped;
                    }
                } else {
                    for_each_bit(w, gone, |slot| {
                        ends[slot][t] = depth;
                        dropped += 1;
                    });
                    self.count[t] -= dropped;
                }
            }
        }
    }

    /// Turns a dense walk with few matching ranks into a list walk.
    fn switch_to_list(&mut self) {
        let any = if self.uniform { 0 } else { 2 };
        for w in 0..self.alive[any].len() {
            let mut word = self.alive[any][w];
            while word != 0 {
                let slot = w * 64 + word.trailing_zeros() as usize;
                word &= word - 1;
                let tiers = self.dense_tiers(slot as u32);
                self.list.push(Alive {
                    slot: slot as u32,
                    tiers,
                    ends: self.ends[slot],
                });
            }
        }
        for alive in &mut self.alive {
            alive.fill(0);
        }
        self.dense = false;
    }

    /// A list walk meets a block; `mask_of(slot)` gives a rank's tiers on it.
    #[inline]
    fn list_step(&mut self, mask_of: impl Fn(u32) -> TierMask, depth: u32) {
        let done = &mut self.done;
        self.list
            .retain_mut(|r| r.narrow(cumulative_bits(mask_of(r.slot)), depth, done));
    }

    /// A list walk meets a block with few holders: a merge of two lists sorted by slot, or a
    /// binary search per rank when the holders far outnumber the ranks.
    fn list_step_entries(&mut self, entries: &[u32], depth: u32) {
        if entries.len() > 8 * self.list.len() {
            self.list_step(
                |slot| find_entry(entries, slot).map_or(0, |i| entry_mask(entries[i])),
                depth,
            );
            return;
        }
        let done = &mut self.done;
        let mut next = entries
            .iter()
            .map(|&e| (entry_slot(e), entry_mask(e)))
            .peekable();
        self.list.retain_mut(|r| {
            let mut mask = 0;
            while let Some(&(slot, m)) = next.peek() {
                if slot > r.slot {
                    break;
                }
                next.next();
                if slot == r.slot {
                    mask = m;
                    break;
                }
            }
            r.narrow(cumulative_bits(mask), depth, done)
        });
    }

    /// The ranks of a list walk still matching matched every block up to `depth`.
    fn settle_list(&mut self, depth: u32) {
        for r in &mut self.list {
            for (t, end) in r.ends.iter_mut().enumerate() {
                if r.tiers & (1 << t) != 0 {
                    *end = depth;
                }
            }
        }
    }

    /// [`Self::finish`], or with a floor the ranks it does not stand for (in rank order) and
    /// the floor.
    pub(super) fn finish_compact(
        mut self,
        depth: u32,
        slots: &[RankSlot],
        rank_order: &[(Rank, u32)],
    ) -> CompactMatches {
        // The ranks still matching at the end are a group alike too: the floor when larger.
        if self.dense
            && self.uniform
            && self.count[0] >= self.list_below.max(1)
            && self
                .floor
                .as_ref()
                .is_none_or(|f| f.dropped < self.count[0])
        {
            self.floor = Some(FloorStep {
                depth,
                members: self.alive[0].clone(),
                gone: self.alive[0].clone(),
                dropped: self.count[0],
            });
        }
        let Some(step) = self.floor.take() else {
            return CompactMatches {
                listed: self.finish(depth, slots, rank_order),
                floor: None,
            };
        };
        // Every depth into `ends`: the list's and the done ranks', and the dense ranks still
        // matching.
        self.settle_list(depth);
        for r in self.done.iter().chain(&self.list) {
            self.ends[r.slot as usize] = r.ends;
        }
        if self.dense {
            let tiers = if self.uniform { 1 } else { 3 };
            for (t, alive) in self.alive.iter().enumerate().take(tiers) {
                for (w, &a) in alive.iter().enumerate() {
                    let ends = &mut self.ends;
                    for_each_bit(w, a, |slot| {
                        if tiers == 1 {
                            ends[slot] = [depth; 3];
                        } else {
                            ends[slot][t] = depth;
                        }
                    });
                }
            }
        }
        // Listed: every rank that matched the first block but those the floor's step dropped.
        let mut listed = Vec::new();
        let ends = &self.ends;
        for (w, (&i, &g)) in self.initial.iter().zip(&step.gone).enumerate() {
            for_each_bit(w, i & !g, |slot| {
                let e = ends[slot];
                if let Some(rank) = slots.get(slot).and_then(|s| s.rank)
                    && e[2] > 0
                {
                    listed.push(RankOverlap {
                        rank,
                        device_blocks: e[0],
                        host_blocks: e[1],
                        disk_blocks: e[2],
                    });
                }
            });
        }
        listed.sort_unstable_by_key(|o| o.rank);
        CompactMatches {
            listed,
            floor: Some(Floor {
                depth: step.depth,
                count: step.members.iter().map(|w| w.count_ones() as usize).sum(),
                members: step.members,
            }),
        }
    }

    /// Every rank still matching matched all blocks up to `depth`; the overlaps, in rank order
    /// (`rank_order`: the known ranks with their slots, in rank order).
    ///
    /// After a dense walk this is one pass over `rank_order` (read in order, 24 bytes a rank)
    /// that reads each rank's bits and `ends` entry: the ranks still matching are not written
    /// into `ends` first, and the rank slots' large records are never touched.
    pub(super) fn finish(
        mut self,
        depth: u32,
        slots: &[RankSlot],
        rank_order: &[(Rank, u32)],
    ) -> Vec<RankOverlap> {
        let overlap = |rank: Rank, ends: [u32; 3]| {
            (ends[2] > 0).then_some(RankOverlap {
                rank,
                device_blocks: ends[0],
                host_blocks: ends[1],
                disk_blocks: ends[2],
            })
        };
        self.settle_list(depth);
        let mut out = Vec::with_capacity(self.matched);
        if self.ends.is_empty() {
            let mut all = self.done;
            all.extend_from_slice(&self.list);
            let rank_of = |slot: u32| slots.get(slot as usize).and_then(|s| s.rank);
            let mut ranked: Vec<(Rank, [u32; 3])> = all
                .iter()
                .filter_map(|r| rank_of(r.slot).map(|rank| (rank, r.ends)))
                .collect();
            ranked.sort_unstable_by_key(|&(rank, _)| rank);
            out.extend(
                ranked
                    .into_iter()
                    .filter_map(|(rank, ends)| overlap(rank, ends)),
            );
            return out;
        }
        for r in self.done.iter().chain(&self.list) {
            self.ends[r.slot as usize] = r.ends;
        }
        let ends = &self.ends;
        if !self.dense {
            out.extend(rank_order.iter().filter_map(|&(rank, slot)| {
                overlap(rank, ends.get(slot as usize).copied().unwrap_or_default())
            }));
            return out;
        }
        let bit = |alive: &[u64], slot: u32| {
            alive
                .get((slot / 64) as usize)
                .is_some_and(|w| w >> (slot % 64) & 1 != 0)
        };
        let alive = &self.alive;
        let uniform = self.uniform;
        out.extend(rank_order.iter().filter_map(|&(rank, slot)| {
            let mut e = ends.get(slot as usize).copied().unwrap_or_default();
            if uniform {
                if bit(&alive[0], slot) {
                    e = [depth; 3];
                }
            } else {
                for (t, end) in e.iter_mut().enumerate() {
                    if bit(&alive[t], slot) {
                        *end = depth;
                    }
                }
            }
            overlap(rank, e)
        }));
        out
    }
}
