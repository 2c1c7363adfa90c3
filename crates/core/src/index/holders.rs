//! The set of ranks holding one block, with the tiers each holds it on.
//!
//! A node keeps its set in 12 bytes ([`Holders`]); larger sets live in a [`HolderArena`] that the
//! node refers to by index. Three representations, chosen by size so that both memory and the
//! cost of a lookup step stay small:
//! - **inline**: up to three packed entries `rank_slot << 3 | tier_mask` in the node itself (the
//!   common case: most blocks are held by one to three ranks). No allocation.
//! - **sparse**: packed entries sorted by slot in the arena: up to [`SMALL`] in the arena slot
//!   itself, more in a vector (4 bytes a holder). A lookup step costs O(holders).
//! - **dense**: one bitset per tier over the partition's rank slots, allocated only for the tiers
//!   in use. A lookup step costs O(ranks / 64) word operations whatever the number of holders.
//!
//! A set turns dense when it grows past [`dense_threshold`] for the current number of rank slots,
//! and sparse again when it shrinks below half of that, so flapping around the threshold is cheap;
//! likewise a sparse set moves back inline only once it is down to two holders.

use super::chunked::Chunked;

/// Tier bits of a holder entry: bit 0 device, bit 1 host, bit 2 disk.
pub type TierMask = u8;

/// Largest number of rank slots: a packed entry carries the slot in 29 bits.
pub const MAX_RANK_SLOTS: u32 = 1 << 29;

const TIER_BITS: u32 = 3;
const TIER_MASK: u32 = 0b111;
/// First word of a node's holders when the set lives in the arena (never a valid entry: an entry's
/// tier mask is never zero).
const HEAP_MARK: u32 = !TIER_MASK;
/// Holders kept in the node.
const INLINE: usize = 3;
/// A sparse arena set moves back inline when it is down to this many holders.
const INLINE_AGAIN: u32 = 2;
/// Sparse sets up to this size live in their arena slot (which the dense variant makes this
/// large anyway); a vector-backed set moves back there at half of it.
pub const SMALL: usize = 12;
/// Assumed allocator overhead per heap allocation, for memory accounting.
pub const ALLOCATION_OVERHEAD: usize = 16;

/// Number of holders above which a set is stored as bitsets, for `rank_slots` slots: the point
/// where 4 bytes a holder outweigh `rank_slots / 8` bytes a tier.
pub fn dense_threshold(rank_slots: usize) -> usize {
    (rank_slots / 32).max(8)
}

#[inline]
pub fn entry_slot(entry: u32) -> u32 {
    entry >> TIER_BITS
}

#[inline]
pub fn entry_mask(entry: u32) -> TierMask {
    (entry & TIER_MASK) as TierMask
}

#[inline]
fn pack(slot: u32, mask: TierMask) -> u32 {
    (slot << TIER_BITS) | u32::from(mask)
}

/// For a tier mask, the cumulative tiers it counts for: bit 0 device, bit 1 device or host, bit 2
/// any tier (SPEC §4).
#[inline]
pub fn cumulative_bits(mask: TierMask) -> u8 {
    const TABLE: [u8; 8] = [0b000, 0b111, 0b110, 0b111, 0b100, 0b111, 0b110, 0b111];
    TABLE[usize::from(mask & 0b111)]
}

/// A holder set of one node: inline entries, or a reference into the arena (12 bytes).
///
/// Layout: `[e0, e1, e2]` with the inline entries sorted by slot and zeros after them, or
/// `[HEAP_MARK, arena index, number of holders]`. All zeros is the empty set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holders([u32; 3]);

/// The shape of a holder set, for reading.
#[derive(Clone, Copy)]
pub enum View<'a> {
    /// Packed entries sorted by slot (inline or sparse).
    Entries(&'a [u32]),
    Dense(&'a DenseHolders),
}

/// Exact per-tier membership bitsets (device, host, disk). A tier nobody uses has no words; words
/// past the end of a tier are zero.
#[derive(Debug, Clone, Default)]
pub struct DenseHolders {
    pub tiers: [Box<[u64]>; 3],
    /// Number of holders per tier.
    pub tier_counts: [u32; 3],
}

impl DenseHolders {
    #[inline]
    fn bit(words: &[u64], slot: u32) -> bool {
        words
            .get((slot / 64) as usize)
            .is_some_and(|word| word & (1u64 << (slot % 64)) != 0)
    }

    #[inline]
    pub fn mask_of(&self, slot: u32) -> TierMask {
        let mut mask = 0;
        for (t, words) in self.tiers.iter().enumerate() {
            if Self::bit(words, slot) {
                mask |= 1 << t;
            }
        }
        mask
    }

    /// Sets the tiers of `slot`; returns whether the slot held the block before and after.
    fn set_mask(&mut self, slot: u32, mask: TierMask, rank_slots: usize) -> (bool, bool) {
        let w = (slot / 64) as usize;
        let bit = 1u64 << (slot % 64);
        let mut before = false;
        for (t, words) in self.tiers.iter_mut().enumerate() {
            let had = words.get(w).is_some_and(|x| x & bit != 0);
            before |= had;
            let wants = mask & (1 << t) != 0;
            if had == wants {
                continue;
            }
            if wants {
                if words.len() <= w {
                    let len = rank_slots.div_ceil(64).max(w + 1);
                    let mut grown = vec![0u64; len];
                    grown[..words.len()].copy_from_slice(words);
                    *words = grown.into_boxed_slice();
                }
                words[w] |= bit;
                self.tier_counts[t] += 1;
            } else {
                words[w] &= !bit;
                self.tier_counts[t] -= 1;
                if self.tier_counts[t] == 0 {
                    *words = Box::default();
                }
            }
        }
        (before, mask != 0)
    }

    /// Every holder as a packed entry, in slot order.
    fn entries(&self) -> Vec<u32> {
        let words = self.tiers.iter().map(|t| t.len()).max().unwrap_or(0);
        let mut out = Vec::new();
        for w in 0..words {
            let mut any = self
                .tiers
                .iter()
                .fold(0, |acc, t| acc | t.get(w).copied().unwrap_or(0));
            while any != 0 {
                let slot = (w as u32) * 64 + any.trailing_zeros();
                any &= any - 1;
                out.push(pack(slot, self.mask_of(slot)));
            }
        }
        out
    }

    fn heap_bytes(&self) -> usize {
        self.tiers
            .iter()
            .filter(|t| !t.is_empty())
            .map(|t| t.len() * 8 + ALLOCATION_OVERHEAD)
            .sum()
    }
}

/// A holder set too large for its node.
#[derive(Debug, Clone, Default)]
enum HeapHolders {
    #[default]
    Free,
    /// Packed entries sorted by slot, the first `len` (kept in the node) of the array.
    Small([u32; SMALL]),
    /// Packed entries sorted by slot.
    Sparse(Vec<u32>),
    /// Boxed: dense sets are few (blocks most ranks hold), and inline they would make every
    /// arena slot 72 bytes instead of 56.
    Dense(Box<DenseHolders>),
}

/// The holder sets that do not fit in their nodes, addressed by index.
#[derive(Debug, Default)]
pub struct HolderArena {
    /// In chunks of 4,096 sets (`chunked.rs`).
    sets: Chunked<HeapHolders, 12>,
    free: Vec<u32>,
}

impl HolderArena {
    fn alloc(&mut self, set: HeapHolders) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.sets[i as usize] = set;
                i
            }
            None => {
                self.sets.push(set);
                (self.sets.len() - 1) as u32
            }
        }
    }

    fn release(&mut self, index: u32) {
        self.sets[index as usize] = HeapHolders::Free;
        self.free.push(index);
    }

    /// Estimated bytes of the arena and every set in it.
    pub fn memory_bytes(&self) -> usize {
        let sets = self
            .sets
            .iter()
            .map(|s| match s {
                HeapHolders::Free | HeapHolders::Small(_) => 0,
                HeapHolders::Sparse(entries) => entries.capacity() * 4 + ALLOCATION_OVERHEAD,
                HeapHolders::Dense(dense) => {
                    std::mem::size_of::<DenseHolders>() + ALLOCATION_OVERHEAD + dense.heap_bytes()
                }
            })
            .sum::<usize>();
        self.sets.memory_bytes() + self.free.capacity() * 4 + sets
    }
}

impl Holders {
    /// Whether the set is empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.0[0] == 0
    }

    /// The arena index of a set that lives in the arena.
    #[inline]
    pub fn heap_index(&self) -> Option<u32> {
        (self.0[0] == HEAP_MARK).then_some(self.0[1])
    }

    /// Distinct ranks holding the block on any tier.
    #[inline]
    pub fn len(&self) -> usize {
        if self.0[0] == HEAP_MARK {
            self.0[2] as usize
        } else {
            self.0.iter().take_while(|&&e| e != 0).count()
        }
    }

    #[inline]
    pub fn view<'a>(&'a self, arena: &'a HolderArena) -> View<'a> {
        match self.heap_index() {
            None => {
                let len = self.len();
                View::Entries(&self.0[..len])
            }
            Some(i) => match &arena.sets[i as usize] {
                HeapHolders::Small(entries) => View::Entries(&entries[..self.0[2] as usize]),
                HeapHolders::Sparse(entries) => View::Entries(entries),
                HeapHolders::Dense(dense) => View::Dense(dense),
                HeapHolders::Free => View::Entries(&[]),
            },
        }
    }

    /// Reads the first word of the set's storage (in the arena unless the set is inline), so
    /// that a warm-up pass reading the sets of many nodes back to back overlaps their cache
    /// misses.
    #[inline]
    pub fn warm(&self, arena: &HolderArena) -> u64 {
        match self.view(arena) {
            View::Entries(entries) => entries.first().copied().map_or(0, u64::from),
            View::Dense(dense) => dense.tiers[0].first().copied().unwrap_or(0),
        }
    }

    /// The tiers on which `slot` holds the block (0 when it does not).
    pub fn mask_of(&self, arena: &HolderArena, slot: u32) -> TierMask {
        match self.view(arena) {
            View::Entries(entries) => {
                find_entry(entries, slot).map_or(0, |i| entry_mask(entries[i]))
            }
            View::Dense(dense) => dense.mask_of(slot),
        }
    }

    /// Every holder as `(slot, mask)`, in slot order.
    pub fn entries(&self, arena: &HolderArena) -> Vec<(u32, TierMask)> {
        let packed = match self.view(arena) {
            View::Entries(entries) => entries.to_vec(),
            View::Dense(dense) => dense.entries(),
        };
        packed
            .into_iter()
            .map(|e| (entry_slot(e), entry_mask(e)))
            .collect()
    }

    /// Empties the set, returning its arena storage.
    pub fn clear(&mut self, arena: &mut HolderArena) {
        if let Some(i) = self.heap_index() {
            arena.release(i);
        }
        *self = Holders::default();
    }

    /// Sets the tiers on which `slot` holds the block; a zero mask removes the rank.
    pub fn set_mask(
        &mut self,
        arena: &mut HolderArena,
        slot: u32,
        mask: TierMask,
        rank_slots: usize,
    ) {
        match self.heap_index() {
            None => self.set_inline(arena, slot, mask),
            Some(i) => {
                let count = self.0[2];
                let (count, shape) = match &mut arena.sets[i as usize] {
                    HeapHolders::Small(entries) => {
                        let len = count as usize;
                        let count = match find_entry(&entries[..len], slot) {
                            Some(pos) if mask == 0 => {
                                entries.copy_within(pos + 1..len, pos);
                                entries[len - 1] = 0;
                                count - 1
                            }
                            Some(pos) => {
                                entries[pos] = pack(slot, mask);
                                count
                            }
                            None if mask == 0 => count,
                            None if len < SMALL => {
                                let at = entries[..len].partition_point(|&e| entry_slot(e) < slot);
                                entries.copy_within(at..len, at + 1);
                                entries[at] = pack(slot, mask);
                                count + 1
                            }
                            None => {
                                let mut grown = Vec::with_capacity(2 * SMALL);
                                grown.extend_from_slice(&entries[..]);
                                set_sorted(&mut grown, slot, mask, count);
                                arena.sets[i as usize] = HeapHolders::Sparse(grown);
                                count + 1
                            }
                        };
                        (count, sparse_shape(count, rank_slots, Shape::Keep))
                    }
                    HeapHolders::Sparse(entries) => {
                        let count = set_sorted(entries, slot, mask, count);
                        let shrunk = if count as usize <= SMALL / 2 {
                            Shape::Small
                        } else {
                            Shape::Keep
                        };
                        (count, sparse_shape(count, rank_slots, shrunk))
                    }
                    HeapHolders::Dense(dense) => {
                        let count = match dense.set_mask(slot, mask, rank_slots) {
                            (false, true) => count + 1,
                            (true, false) => count - 1,
                            _ => count,
                        };
                        let shape = if count as usize >= dense_threshold(rank_slots) / 2 {
                            Shape::Keep
                        } else if count as usize <= INLINE {
                            Shape::Inline
                        } else if count as usize <= SMALL {
                            Shape::Small
                        } else {
                            Shape::Sparse
                        };
                        (count, shape)
                    }
                    HeapHolders::Free => (0, Shape::Inline),
                };
                self.0[2] = count;
                match shape {
                    Shape::Keep => {}
                    Shape::Inline => {
                        let entries = self.entries_packed(arena);
                        arena.release(i);
                        *self = Holders::default();
                        for (k, e) in entries.into_iter().enumerate() {
                            self.0[k] = e;
                        }
                    }
                    Shape::Small => {
                        let mut small = [0u32; SMALL];
                        for (k, e) in self.entries_packed(arena).into_iter().enumerate() {
                            small[k] = e;
                        }
                        arena.sets[i as usize] = HeapHolders::Small(small);
                    }
                    Shape::Sparse => {
                        let entries = self.entries_packed(arena);
                        arena.sets[i as usize] = HeapHolders::Sparse(entries);
                    }
                    Shape::Dense => {
                        let mut dense = DenseHolders::default();
                        for e in self.entries_packed(arena) {
                            dense.set_mask(entry_slot(e), entry_mask(e), rank_slots);
                        }
                        arena.sets[i as usize] = HeapHolders::Dense(Box::new(dense));
                    }
                }
            }
        }
    }

    fn entries_packed(&self, arena: &HolderArena) -> Vec<u32> {
        match self.view(arena) {
            View::Entries(entries) => entries.to_vec(),
            View::Dense(dense) => dense.entries(),
        }
    }

    fn set_inline(&mut self, arena: &mut HolderArena, slot: u32, mask: TierMask) {
        let len = self.len();
        match find_entry(&self.0[..len], slot) {
            Some(i) if mask == 0 => {
                self.0.copy_within(i + 1..len, i);
                self.0[len - 1] = 0;
            }
            Some(i) => self.0[i] = pack(slot, mask),
            None if mask == 0 => {}
            None if len < INLINE => {
                let at = self.0[..len].partition_point(|&e| entry_slot(e) < slot);
                self.0.copy_within(at..len, at + 1);
                self.0[at] = pack(slot, mask);
            }
            None => {
                let mut entries = [0u32; SMALL];
                let at = self.0.partition_point(|&e| entry_slot(e) < slot);
                entries[..at].copy_from_slice(&self.0[..at]);
                entries[at] = pack(slot, mask);
                entries[at + 1..=INLINE].copy_from_slice(&self.0[at..]);
                let index = arena.alloc(HeapHolders::Small(entries));
                self.0 = [HEAP_MARK, index, (INLINE + 1) as u32];
            }
        }
    }
}

enum Shape {
    Keep,
    Inline,
    Small,
    Sparse,
    Dense,
}

/// The shape a sparse arena set of `count` holders should take (`otherwise` when it stays
/// sparse).
fn sparse_shape(count: u32, rank_slots: usize, otherwise: Shape) -> Shape {
    if count as usize > dense_threshold(rank_slots) {
        Shape::Dense
    } else if count <= INLINE_AGAIN {
        Shape::Inline
    } else {
        otherwise
    }
}

/// Position of `slot` in entries sorted by slot.
#[inline]
pub fn find_entry(entries: &[u32], slot: u32) -> Option<usize> {
    if entries.len() <= 8 {
        entries.iter().position(|&e| entry_slot(e) == slot)
    } else {
        entries.binary_search_by_key(&slot, |&e| entry_slot(e)).ok()
    }
}

/// Sets `slot`'s mask in sorted entries; returns the new number of entries.
fn set_sorted(entries: &mut Vec<u32>, slot: u32, mask: TierMask, count: u32) -> u32 {
    match entries.binary_search_by_key(&slot, |&e| entry_slot(e)) {
        Ok(i) if mask == 0 => {
            entries.remove(i);
            count - 1
        }
        Ok(i) => {
            entries[i] = pack(slot, mask);
            count
        }
        Err(_) if mask == 0 => count,
        Err(i) => {
            entries.insert(i, pack(slot, mask));
            count + 1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_arena_slot_is_no_larger_than_a_small_set_and_its_tag() {
        // Every block with 4 to 12 holders takes one slot: the dense variant stays boxed.
        assert!(std::mem::size_of::<HeapHolders>() <= 56);
    }

    fn check(h: &Holders, arena: &HolderArena, expected: &std::collections::BTreeMap<u32, u8>) {
        assert_eq!(h.len(), expected.len());
        assert_eq!(h.is_empty(), expected.is_empty());
        let want: Vec<(u32, u8)> = expected.iter().map(|(&s, &m)| (s, m)).collect();
        assert_eq!(h.entries(arena), want);
        for (&s, &m) in expected {
            assert_eq!(h.mask_of(arena, s), m);
        }
    }

    #[test]
    fn inline_sparse_and_dense_agree_through_conversions() {
        let slots = 1000;
        let mut arena = HolderArena::default();
        let mut h = Holders::default();
        let mut expected = std::collections::BTreeMap::new();
        for s in (0..100u32).rev() {
            let mask = (s % 7 + 1) as u8;
            h.set_mask(&mut arena, s * 7, mask, slots);
            expected.insert(s * 7, mask);
            check(&h, &arena, &expected);
            let heap = h.heap_index().map(|i| &arena.sets[i as usize]);
            match expected.len() {
                0..=3 => assert!(heap.is_none()),
                4..=SMALL => assert!(matches!(heap, Some(HeapHolders::Small(_)))),
                n if n <= dense_threshold(slots) => {
                    assert!(matches!(heap, Some(HeapHolders::Sparse(_))));
                }
                _ => assert!(matches!(heap, Some(HeapHolders::Dense(_)))),
            }
        }
        for s in 0..98u32 {
            h.set_mask(&mut arena, s * 7, 0, slots);
            expected.remove(&(s * 7));
            check(&h, &arena, &expected);
            let heap = h.heap_index().map(|i| &arena.sets[i as usize]);
            match expected.len() {
                0..=2 => assert!(heap.is_none()),
                n if n <= SMALL / 2 => assert!(matches!(heap, Some(HeapHolders::Small(_)))),
                _ => {}
            }
        }
        // A small set growing past its slot moves to a vector, and back at half.
        let mut h = Holders::default();
        for s in 0..=SMALL as u32 {
            h.set_mask(&mut arena, s, 1, slots);
        }
        let heap = h.heap_index().map(|i| &arena.sets[i as usize]);
        assert!(matches!(heap, Some(HeapHolders::Sparse(_))));
        for s in 0..=(SMALL / 2) as u32 {
            h.set_mask(&mut arena, s, 0, slots);
        }
        let heap = h.heap_index().map(|i| &arena.sets[i as usize]);
        assert!(matches!(heap, Some(HeapHolders::Small(_))));
        let want: Vec<(u32, u8)> = ((SMALL / 2) as u32 + 1..=SMALL as u32)
            .map(|s| (s, 1))
            .collect();
        assert_eq!(h.entries(&arena), want);
        h.clear(&mut arena);
        let mut h = Holders::default();
        for s in 0..4u32 {
            h.set_mask(&mut arena, s * 7, 1, slots);
        }
        for s in 0..98u32 {
            h.set_mask(&mut arena, s * 7, 0, slots);
        }
        assert!(h.heap_index().is_none(), "back inline");
        assert_eq!(h.mask_of(&arena, 3), 0);
        h.clear(&mut arena);
        assert!(h.is_empty());
        assert_eq!(arena.free.len(), arena.sets.len(), "arena storage returned");
    }

    #[test]
    fn dense_sets_drop_unused_tiers() {
        let slots = 512;
        let mut arena = HolderArena::default();
        let mut h = Holders::default();
        for s in 0..40u32 {
            h.set_mask(&mut arena, s, 0b001, slots);
        }
        h.set_mask(&mut arena, 7, 0b011, slots);
        let View::Dense(dense) = h.view(&arena) else {
            panic!("dense expected")
        };
        assert_eq!(dense.tier_counts, [40, 1, 0]);
        assert!(dense.tiers[2].is_empty());
        h.set_mask(&mut arena, 7, 0b001, slots);
        let View::Dense(dense) = h.view(&arena) else {
            panic!("dense expected")
        };
        assert_eq!(dense.tier_counts, [40, 0, 0]);
        assert!(dense.tiers[1].is_empty(), "an emptied tier frees its words");
        assert_eq!(cumulative_bits(0b010), 0b110);
        assert_eq!(cumulative_bits(0b100), 0b100);
        assert_eq!(cumulative_bits(0b101), 0b111);
    }
}
