//! The set of ranks holding one block, with the tiers each holds it on.
//!
//! Two representations, chosen by size so that both memory and the cost of a lookup step stay
//! small:
//! - **sparse**: a small vector of packed entries `rank_slot << 3 | tier_mask` (4 bytes each; up to
//!   four live inline without a heap allocation). A lookup step costs O(holders).
//! - **dense**: one bitset per tier over the partition's rank slots. A lookup step costs
//!   O(ranks / 64) word operations whatever the number of holders.
//!
//! A set turns dense when it grows past [`dense_threshold`] for the current number of rank slots,
//! and sparse again when it shrinks below half of that, so flapping around the threshold is cheap.

use smallvec::SmallVec;

/// Tier bits of a holder entry: bit 0 device, bit 1 host, bit 2 disk.
pub type TierMask = u8;

/// Largest rank slot a sparse entry can carry (29 bits).
pub const MAX_RANK_SLOTS: u32 = 1 << 29;

const TIER_BITS: u32 = 3;
const TIER_MASK: u32 = 0b111;

/// Number of holders above which a set is stored as bitsets, for `rank_slots` slots: the point
/// where 4 bytes a holder outweigh `rank_slots / 8` bytes a tier.
pub fn dense_threshold(rank_slots: usize) -> usize {
    (rank_slots / 32).max(8)
}

#[derive(Debug, Clone, Default)]
pub struct DenseHolders {
    /// Exact per-tier membership bitsets (device, host, disk); an unused tier stays empty.
    pub tiers: [Vec<u64>; 3],
    /// Number of distinct ranks holding the block on any tier.
    pub count: u32,
}

impl DenseHolders {
    fn bit(words: &[u64], slot: u32) -> bool {
        let w = (slot / 64) as usize;
        words
            .get(w)
            .is_some_and(|word| word & (1u64 << (slot % 64)) != 0)
    }

    fn mask_of(&self, slot: u32) -> TierMask {
        let mut mask = 0;
        for (t, words) in self.tiers.iter().enumerate() {
            if Self::bit(words, slot) {
                mask |= 1 << t;
            }
        }
        mask
    }

    fn set_mask(&mut self, slot: u32, mask: TierMask) {
        let w = (slot / 64) as usize;
        let bit = 1u64 << (slot % 64);
        for (t, words) in self.tiers.iter_mut().enumerate() {
            if mask & (1 << t) != 0 {
                if words.len() <= w {
                    words.resize(w + 1, 0);
                }
                words[w] |= bit;
            } else if let Some(word) = words.get_mut(w) {
                *word &= !bit;
            }
        }
    }

    /// Cumulative membership word `w` for cumulative tier `t` (0: device, 1: device or host,
    /// 2: any tier).
    #[inline]
    pub fn cumulative_word(&self, t: usize, w: usize) -> u64 {
        let mut word = 0;
        for tier in &self.tiers[..=t] {
            word |= tier.get(w).copied().unwrap_or(0);
        }
        word
    }
}

/// The ranks (by partition-local slot) that hold one block.
#[derive(Debug, Clone)]
pub enum Holders {
    Sparse(SmallVec<[u32; 4]>),
    Dense(Box<DenseHolders>),
}

impl Default for Holders {
    fn default() -> Self {
        Holders::Sparse(SmallVec::new())
    }
}

#[inline]
pub fn entry_slot(entry: u32) -> u32 {
    entry >> TIER_BITS
}

#[inline]
pub fn entry_mask(entry: u32) -> TierMask {
    (entry & TIER_MASK) as TierMask
}

fn pack(slot: u32, mask: TierMask) -> u32 {
    (slot << TIER_BITS) | u32::from(mask)
}

impl Holders {
    /// Distinct ranks holding the block on any tier.
    pub fn len(&self) -> usize {
        match self {
            Holders::Sparse(entries) => entries.len(),
            Holders::Dense(dense) => dense.count as usize,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tiers on which `slot` holds the block (0 when it does not).
    pub fn mask_of(&self, slot: u32) -> TierMask {
        match self {
            Holders::Sparse(entries) => entries
                .iter()
                .find(|&&e| entry_slot(e) == slot)
                .map_or(0, |&e| entry_mask(e)),
            Holders::Dense(dense) => dense.mask_of(slot),
        }
    }

    /// Sets the tiers on which `slot` holds the block; a zero mask removes the rank.
    pub fn set_mask(&mut self, slot: u32, mask: TierMask, rank_slots: usize) {
        match self {
            Holders::Sparse(entries) => {
                let pos = entries.iter().position(|&e| entry_slot(e) == slot);
                match (pos, mask) {
                    (Some(i), 0) => {
                        entries.swap_remove(i);
                    }
                    (Some(i), m) => entries[i] = pack(slot, m),
                    (None, 0) => {}
                    (None, m) => {
                        entries.push(pack(slot, m));
                        if entries.len() > dense_threshold(rank_slots) {
                            self.make_dense();
                        }
                    }
                }
            }
            Holders::Dense(dense) => {
                let before = dense.mask_of(slot);
                dense.set_mask(slot, mask);
                match (before, mask) {
                    (0, m) if m != 0 => dense.count += 1,
                    (b, 0) if b != 0 => dense.count -= 1,
                    _ => {}
                }
                if (dense.count as usize) < dense_threshold(rank_slots) / 2 {
                    self.make_sparse();
                }
            }
        }
    }

    fn make_dense(&mut self) {
        if let Holders::Sparse(entries) = self {
            let mut dense = DenseHolders::default();
            for &e in entries.iter() {
                dense.set_mask(entry_slot(e), entry_mask(e));
            }
            dense.count = entries.len() as u32;
            *self = Holders::Dense(Box::new(dense));
        }
    }

    fn make_sparse(&mut self) {
        if let Holders::Dense(dense) = self {
            let entries: SmallVec<[u32; 4]> = dense.iter_entries().collect();
            *self = Holders::Sparse(entries);
        }
    }

    /// Every holder as a packed entry `(slot, mask)`.
    pub fn entries(&self) -> Vec<(u32, TierMask)> {
        match self {
            Holders::Sparse(entries) => entries
                .iter()
                .map(|&e| (entry_slot(e), entry_mask(e)))
                .collect(),
            Holders::Dense(dense) => dense
                .iter_entries()
                .map(|e| (entry_slot(e), entry_mask(e)))
                .collect(),
        }
    }

    /// Heap bytes owned by this set (for memory accounting).
    pub fn heap_bytes(&self) -> usize {
        match self {
            Holders::Sparse(entries) if entries.spilled() => entries.capacity() * 4,
            Holders::Sparse(_) => 0,
            Holders::Dense(dense) => {
                std::mem::size_of::<DenseHolders>()
                    + dense.tiers.iter().map(|t| t.capacity() * 8).sum::<usize>()
            }
        }
    }
}

impl DenseHolders {
    fn iter_entries(&self) -> impl Iterator<Item = u32> + '_ {
        let words = self.tiers.iter().map(Vec::len).max().unwrap_or(0);
        (0..words).flat_map(move |w| {
            let mut any = self.cumulative_word(2, w);
            std::iter::from_fn(move || {
                if any == 0 {
                    return None;
                }
                let b = any.trailing_zeros();
                any &= any - 1;
                let slot = (w as u32) * 64 + b;
                Some(pack(slot, self.mask_of(slot)))
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_and_dense_agree_through_conversions() {
        let slots = 1000;
        let mut h = Holders::default();
        for s in 0..100u32 {
            h.set_mask(s * 7, (s % 7 + 1) as u8, slots);
        }
        assert!(matches!(h, Holders::Dense(_)));
        assert_eq!(h.len(), 100);
        for s in 0..100u32 {
            assert_eq!(h.mask_of(s * 7), (s % 7 + 1) as u8);
        }
        for s in 0..95u32 {
            h.set_mask(s * 7, 0, slots);
        }
        assert!(matches!(h, Holders::Sparse(_)));
        assert_eq!(h.len(), 5);
        let mut entries = h.entries();
        entries.sort();
        assert_eq!(entries[0], (95 * 7, (95 % 7 + 1) as u8));
        assert_eq!(h.mask_of(3), 0);
    }
}
