use super::reference::{ReferenceIndex, tier_from_index};
use super::*;
use proptest::prelude::*;

fn rank(w: u64, d: u32) -> Rank {
    Rank::new(w, d)
}

fn stored(parent: Option<u64>, blocks: &[(u64, u64)], tier: Tier) -> KvEvent {
    KvEvent::Stored {
        parent,
        blocks: blocks
            .iter()
            .map(|&(engine_hash, local_hash)| StoredBlock {
                engine_hash,
                local_hash,
            })
            .collect(),
        tier,
    }
}

fn removed(hashes: &[u64], tier: Tier) -> KvEvent {
    KvEvent::Removed {
        engine_hashes: hashes.to_vec(),
        tier,
    }
}

fn seq(local: &[u64]) -> Vec<u64> {
    crate::hash::sequence_hashes(local)
}

fn sorted(mut m: Matches) -> Vec<RankOverlap> {
    m.ranks.sort_by_key(|r| r.rank);
    m.ranks
}

#[test]
fn a_block_most_ranks_stop_at_becomes_a_floor_and_answers_stay_exact() {
    let mut index = RadixIndex::default();
    let mut reference = ReferenceIndex::default();
    let mut apply = |r: Rank, event: KvEvent| {
        index.apply(r, &event);
        reference.apply(r, &event);
    };
    // 300 ranks hold block 1, 250 of them 1→2 (a step that drops fewer than half), 3 of those
    // 1→2→3 (the floor's step), one of those also 3→4 on the host (a later split).
    for w in 0..300 {
        apply(rank(w, 0), stored(None, &[(11, 1)], Tier::Device));
    }
    for w in 0..250 {
        apply(rank(w, 0), stored(Some(11), &[(12, 2)], Tier::Device));
    }
    for w in 0..3 {
        apply(rank(w, 0), stored(Some(12), &[(13, 3)], Tier::Device));
    }
    apply(rank(1, 0), stored(Some(13), &[(14, 4)], Tier::Host));
    let q = seq(&[1, 2, 3, 4, 5]);
    let compact = index.find_matches_compact(&q);
    let floor = compact.floor.as_ref().expect("a floor");
    assert_eq!((floor.depth, floor.count()), (2, 250));
    // Listed: the 50 that stopped at block 2 and the 3 that went on; not the other 247.
    assert_eq!(compact.listed.len(), 53);
    assert!(compact.listed.is_sorted_by_key(|o| o.rank));
    let full = sorted(index.find_matches(&q));
    assert_eq!(full, sorted(reference.find_matches(&q)));
    assert_eq!(full.len(), 300);
    for o in &full {
        assert_eq!(compact.get(&index, o.rank), Some(*o));
    }
    assert_eq!(compact.get(&index, rank(1000, 0)), None);
    assert_eq!(index.floor_members(floor).len(), 250);
    // A prompt every rank holds to its end: the ranks still matching are the floor.
    let whole = index.find_matches_compact(&seq(&[1]));
    assert_eq!(whole.listed, vec![]);
    let floor = whole.floor.as_ref().expect("a floor");
    assert_eq!((floor.depth, floor.count()), (1, 300));
    assert_eq!(
        sorted(index.find_matches(&seq(&[1]))),
        sorted(reference.find_matches(&seq(&[1])))
    );
    // A prompt few ranks share has no floor.
    assert!(index.find_matches_compact(&seq(&[9])).floor.is_none());
}

#[test]
fn answers_come_in_rank_order_whatever_order_ranks_appeared_in() {
    // Few holders (a list walk) and many (a dense walk over 300 slots).
    for ranks in [5u64, 300] {
        let mut index = RadixIndex::default();
        for w in (0..ranks).rev() {
            index.apply(rank(w, 0), &stored(None, &[(10, 1), (11, 2)], Tier::Device));
        }
        // One rank leaves and comes back under a reused slot.
        index.remove_rank(rank(2, 0));
        index.apply(rank(2, 0), &stored(None, &[(10, 1)], Tier::Device));
        let m = index.find_matches(&seq(&[1, 2]));
        assert_eq!(m.ranks.len() as u64, ranks);
        assert!(
            m.ranks.windows(2).all(|w| w[0].rank < w[1].rank),
            "{ranks} ranks: not in rank order"
        );
        assert_eq!(m.get(rank(2, 0)).map(|r| r.device_blocks), Some(1));
        assert_eq!(m.get(rank(3, 0)).map(|r| r.device_blocks), Some(2));
    }
}

#[test]
fn overlap_is_contiguous_from_the_first_block() {
    let mut index = RadixIndex::default();
    let a = rank(1, 0);
    index.apply(a, &stored(None, &[(10, 1), (11, 2), (12, 3)], Tier::Device));
    let m = index.find_matches(&seq(&[1, 2, 3, 4]));
    assert_eq!(m.get(a).map(|r| r.device_blocks), Some(3));
    assert_eq!(m.longest_matched(), 3);
    // Removing the middle block cuts the overlap there, though the tail is still held.
    index.apply(a, &removed(&[11], Tier::Device));
    let m = index.find_matches(&seq(&[1, 2, 3]));
    assert_eq!(m.get(a).map(|r| r.device_blocks), Some(1));
    // A prompt that differs in its first block matches nothing.
    assert!(index.find_matches(&seq(&[9, 2, 3])).ranks.is_empty());
}

#[test]
fn predicted_blocks_skip_what_the_rank_holds_and_the_engines_store_adopts_them() {
    let mut index = RadixIndex::default();
    let a = rank(1, 0);
    let s = seq(&[1, 2, 3, 4]);
    index.apply(a, &stored(None, &[(10, 1), (11, 2)], Tier::Device));
    assert_eq!(index.sequence_hash_of(a, 11), Some(s[1]));
    assert_eq!(index.sequence_hash_of(rank(2, 0), 11), None);
    // Blocks 2-4 under block 1 by its sequence hash: block 2 is held already, so left alone.
    let at = |i: usize| {
        (
            s[i],
            StoredBlock {
                engine_hash: predicted_engine_hash(s[i]),
                local_hash: i as u64 + 1,
            },
        )
    };
    let mut stored_at = Vec::new();
    let outcome = index.store_at(
        a,
        Some(s[0]),
        &[at(1), at(2), at(3)],
        Tier::Device,
        &mut stored_at,
    );
    assert_eq!((outcome.stored_blocks, stored_at), (2, vec![s[2], s[3]]));
    assert_eq!(index.held_prefix(a, &s, Tier::Device), 4);
    assert_eq!(index.held_prefix(a, &s, Tier::Host), 0);
    assert!(index.holds(a, s[3], Tier::Device) && !index.holds(rank(2, 0), s[3], Tier::Device));
    assert_eq!(
        index.find_matches(&s).get(a).map(|r| r.device_blocks),
        Some(4)
    );
    assert_eq!((index.block_count(), index.held_pairs()), (4, 4));
    // The dump shows the engine's two blocks only.
    assert_eq!(index.dump().len(), 2);
    // The engine's store of block 3 on the host is another entry; on the device it adopts the
    // predicted one: no alias, the same holders.
    let outcome = index.apply(a, &stored(Some(11), &[(12, 3)], Tier::Host));
    assert_eq!((outcome.adopted_predictions, index.held_pairs()), (0, 5));
    index.apply(a, &removed(&[12], Tier::Host));
    let outcome = index.apply(a, &stored(Some(11), &[(12, 3)], Tier::Device));
    assert_eq!((outcome.stored_blocks, outcome.adopted_predictions), (1, 1));
    assert_eq!((index.block_count(), index.held_pairs()), (4, 4));
    let gone = index.apply(a, &removed(&[predicted_engine_hash(s[2])], Tier::Device));
    assert_eq!(
        gone.unknown_removed_blocks, 1,
        "adopted, so no predicted entry left"
    );
    assert_eq!(index.held_prefix(a, &s, Tier::Device), 4);
    // The engine's removal of block 3 drops it; block 4 is still predicted.
    index.apply(a, &removed(&[12], Tier::Device));
    assert_eq!(index.held_prefix(a, &s, Tier::Device), 2);
    assert!(index.holds(a, s[3], Tier::Device));
}

#[test]
fn tiers_are_cumulative() {
    let mut index = RadixIndex::default();
    let a = rank(1, 0);
    index.apply(a, &stored(None, &[(10, 1), (11, 2)], Tier::Device));
    index.apply(a, &stored(Some(11), &[(12, 3)], Tier::Host));
    index.apply(a, &stored(Some(12), &[(13, 4)], Tier::Disk));
    let m = index.find_matches(&seq(&[1, 2, 3, 4, 5]));
    let r = m.get(a).copied().expect("rank a matches");
    assert_eq!((r.device_blocks, r.host_blocks, r.disk_blocks), (2, 3, 4));
}

#[test]
fn duplicate_stores_are_reference_counted() {
    let mut index = RadixIndex::default();
    let a = rank(1, 0);
    index.apply(a, &stored(None, &[(10, 1)], Tier::Device));
    index.apply(a, &stored(None, &[(10, 1)], Tier::Device));
    index.apply(a, &removed(&[10], Tier::Device));
    assert_eq!(
        index.find_matches(&seq(&[1])).ranks.len(),
        1,
        "one copy left"
    );
    let outcome = index.apply(a, &removed(&[10], Tier::Device));
    assert_eq!(outcome.removed_blocks, 1);
    assert!(index.find_matches(&seq(&[1])).ranks.is_empty());
    assert_eq!(
        index.block_count(),
        0,
        "the node is freed with its last holder"
    );
    let outcome = index.apply(a, &removed(&[10], Tier::Device));
    assert_eq!(outcome.unknown_removed_blocks, 1);
}

#[test]
fn unknown_parent_drops_the_event_and_is_counted() {
    let mut index = RadixIndex::default();
    let a = rank(1, 0);
    let outcome = index.apply(a, &stored(Some(99), &[(10, 1)], Tier::Device));
    assert_eq!(outcome.parent_block_not_found, 1);
    assert_eq!(outcome.stored_blocks, 0);
    assert_eq!(index.block_count(), 0);
}

#[test]
fn clear_and_remove_worker_drop_only_that_rank() {
    let mut index = RadixIndex::default();
    let (a, b, c) = (rank(1, 0), rank(1, 1), rank(2, 0));
    for r in [a, b, c] {
        index.apply(r, &stored(None, &[(10, 1), (11, 2)], Tier::Device));
    }
    index.apply(a, &KvEvent::Cleared);
    let m = index.find_matches(&seq(&[1, 2]));
    assert_eq!(m.ranks.len(), 2);
    assert!(m.get(a).is_none());
    assert_eq!(index.remove_worker(1), 2);
    let m = index.find_matches(&seq(&[1, 2]));
    assert_eq!(
        sorted(m).iter().map(|r| r.rank).collect::<Vec<_>>(),
        vec![c]
    );
}

#[test]
fn block_cap_evicts_the_oldest_blocks_and_counts_them() {
    let mut index = RadixIndex::new(IndexConfig { max_blocks: 4 });
    let a = rank(1, 0);
    let first = index.apply(a, &stored(None, &[(1, 1), (2, 2), (3, 3)], Tier::Device));
    assert_eq!(first.evicted_blocks, 0);
    let second = index.apply(a, &stored(None, &[(4, 4), (5, 5)], Tier::Device));
    assert_eq!(second.evicted_blocks, 1);
    assert_eq!(index.block_count(), 4);
    // The oldest block (the root of the first chain) is gone, so that chain no longer matches.
    assert!(index.find_matches(&seq(&[1, 2, 3])).ranks.is_empty());
    assert_eq!(index.find_matches(&seq(&[4, 5])).ranks.len(), 1);
    // Removing the evicted block is counted as unknown and does not disturb the rest.
    let outcome = index.apply(a, &removed(&[1], Tier::Device));
    assert_eq!(outcome.unknown_removed_blocks, 1);
    assert_eq!(index.held_pairs(), 4);
}

#[test]
fn many_ranks_use_dense_holder_sets_with_the_same_answers() {
    let mut index = RadixIndex::default();
    let mut reference = ReferenceIndex::default();
    // 300 ranks hold prefixes of different lengths of one 64-block prompt.
    let local: Vec<u64> = (0..64).collect();
    for w in 0..300u64 {
        let len = (w * 7 % 64) as usize + 1;
        let blocks: Vec<(u64, u64)> = local[..len].iter().map(|&l| (1000 + l, l)).collect();
        let tier = tier_from_index(w as usize);
        let event = stored(None, &blocks, tier);
        index.apply(rank(w, 0), &event);
        reference.apply(rank(w, 0), &event);
    }
    let query = seq(&local);
    assert_eq!(
        sorted(index.find_matches(&query)),
        sorted(reference.find_matches(&query))
    );
    // Punch holes for some ranks and compare again.
    for w in (0..300u64).step_by(3) {
        let event = removed(&[1000 + (w % 20)], tier_from_index(w as usize));
        index.apply(rank(w, 0), &event);
        reference.apply(rank(w, 0), &event);
    }
    assert_eq!(
        sorted(index.find_matches(&query)),
        sorted(reference.find_matches(&query))
    );
}

#[test]
fn dump_recreates_the_index() {
    let mut index = RadixIndex::default();
    let (a, b) = (rank(1, 0), rank(2, 3));
    index.apply(a, &stored(None, &[(10, 1), (11, 2), (12, 3)], Tier::Device));
    index.apply(a, &stored(None, &[(10, 1)], Tier::Device));
    index.apply(b, &stored(None, &[(20, 1)], Tier::Host));
    index.apply(b, &stored(Some(20), &[(21, 7)], Tier::Disk));
    let mut restored = RadixIndex::default();
    for (r, event) in index.dump() {
        restored.apply(r, &event);
    }
    for query in [vec![1, 2, 3], vec![1, 7], vec![1]] {
        let q = seq(&query);
        assert_eq!(
            sorted(index.find_matches(&q)),
            sorted(restored.find_matches(&q))
        );
    }
    // The duplicate store survives the round trip: one removal leaves a copy.
    restored.apply(a, &removed(&[10], Tier::Device));
    assert!(restored.find_matches(&seq(&[1])).get(a).is_some());
}

#[test]
fn evicted_slots_are_reused_only_once_nothing_points_at_them() {
    let mut index = RadixIndex::new(IndexConfig { max_blocks: 8 });
    let (a, b) = (rank(1, 0), rank(2, 0));
    index.apply(b, &stored(None, &[(1, 1_000_000)], Tier::Device));
    // `a` stores many first blocks: `b`'s block is evicted early, and the purges that recycle
    // dead slots run many times, so node slots are reused.
    let mut evicted = 0;
    for i in 0..5000u64 {
        let outcome = index.apply(a, &stored(None, &[(10 + i, 10 + i)], Tier::Device));
        evicted += outcome.evicted_blocks;
        if i == 20 {
            // Evicted but not yet purged: `b`'s entry is stale, not held.
            assert_eq!(index.rank_block_count(b), 0);
            assert_eq!(
                index
                    .apply(b, &removed(&[1], Tier::Device))
                    .unknown_removed_blocks,
                1
            );
            evicted += index
                .apply(b, &stored(None, &[(1, 1_000_000)], Tier::Device))
                .evicted_blocks;
        }
    }
    assert_eq!(evicted, 5000 + 2 - 8);
    assert_eq!(index.block_count(), 8);
    assert_eq!(index.held_pairs(), 8);
    assert!(
        (index.nodes.len as usize) < 3000,
        "dead slots are recycled ({} slots)",
        index.nodes.len
    );
    assert!(index.creation_order.len() < 3000);
    // `b`'s entry is gone or stale: removing it or naming it as a parent finds nothing, and
    // cannot touch the block that reuses its slot.
    let outcome = index.apply(b, &stored(Some(1), &[(2, 2)], Tier::Device));
    assert_eq!(outcome.parent_block_not_found, 1);
    assert_eq!(
        index
            .apply(b, &removed(&[1], Tier::Device))
            .unknown_removed_blocks,
        1
    );
    for i in 4992..5000u64 {
        let m = index.find_matches(&seq(&[10 + i]));
        assert_eq!(m.ranks.len(), 1);
        assert_eq!(m.get(a).map(|r| r.device_blocks), Some(1));
    }
    assert!(index.find_matches(&seq(&[10])).ranks.is_empty());
    assert!(index.find_matches(&seq(&[1_000_000])).ranks.is_empty());
    // The survivors round-trip through a dump.
    let mut restored = RadixIndex::default();
    for (r, event) in index.dump() {
        restored.apply(r, &event);
    }
    assert_eq!(restored.held_pairs(), 8);
}

#[test]
fn store_counts_are_exact_beyond_a_byte() {
    let mut index = RadixIndex::default();
    let a = rank(1, 0);
    for _ in 0..300 {
        index.apply(a, &stored(None, &[(10, 1)], Tier::Device));
    }
    index.apply(a, &stored(None, &[(10, 1)], Tier::Host));
    assert_eq!(index.held_pairs(), 1);
    // The dump carries every store.
    assert_eq!(index.dump().len(), 301);
    for _ in 0..299 {
        index.apply(a, &removed(&[10], Tier::Device));
    }
    let m = index.find_matches(&seq(&[1]));
    assert_eq!(
        m.get(a).map(|r| (r.device_blocks, r.host_blocks)),
        Some((1, 1))
    );
    let outcome = index.apply(a, &removed(&[10], Tier::Device));
    assert_eq!(outcome.removed_blocks, 1);
    let m = index.find_matches(&seq(&[1]));
    assert_eq!(
        m.get(a).map(|r| (r.device_blocks, r.host_blocks)),
        Some((0, 1))
    );
    assert_eq!(
        index
            .apply(a, &removed(&[10], Tier::Device))
            .unknown_removed_blocks,
        1
    );
    index.apply(a, &removed(&[10], Tier::Host));
    assert_eq!(index.block_count(), 0);
    assert_eq!(index.held_pairs(), 0);
    assert!(index.slots.iter().all(|s| s.counts.is_empty()));
}

#[test]
fn dump_finds_a_parent_that_was_freed_and_stored_again() {
    let mut index = RadixIndex::default();
    let a = rank(1, 0);
    index.apply(a, &stored(None, &[(10, 1), (11, 2)], Tier::Device));
    // The parent block leaves (its node is freed: nobody else holds it), then comes back as a
    // new node; the child's node still names it.
    index.apply(a, &removed(&[10], Tier::Device));
    index.apply(a, &stored(None, &[(10, 1)], Tier::Device));
    let q = seq(&[1, 2]);
    assert_eq!(
        index.find_matches(&q).get(a).map(|r| r.device_blocks),
        Some(2)
    );
    let mut restored = RadixIndex::default();
    for (r, event) in index.dump() {
        restored.apply(r, &event);
    }
    assert_eq!(
        sorted(index.find_matches(&q)),
        sorted(restored.find_matches(&q))
    );
}

#[test]
fn a_few_matching_ranks_meet_a_block_with_many_holders() {
    let mut index = RadixIndex::default();
    let mut reference = ReferenceIndex::default();
    let mut apply = |r: Rank, event: KvEvent| {
        index.apply(r, &event);
        reference.apply(r, &event);
    };
    // Many rank slots, so that a block with dozens of holders keeps them in a sorted list.
    for w in 0..2000u64 {
        apply(rank(w, 0), stored(None, &[(1, 7)], Tier::Device));
    }
    // Block 1 is held by three ranks; its child by 40, two of them among those three (one on the
    // host) and 38 that dropped block 1; the grandchild by one of the three.
    for (w, tier) in [(10, Tier::Device), (20, Tier::Device), (30, Tier::Device)] {
        apply(rank(w, 0), stored(None, &[(100, 1)], tier));
    }
    apply(rank(10, 0), stored(Some(100), &[(101, 2)], Tier::Device));
    apply(rank(20, 0), stored(Some(100), &[(101, 2)], Tier::Host));
    for w in 1000..1038u64 {
        apply(
            rank(w, 0),
            stored(None, &[(100, 1), (101, 2)], Tier::Device),
        );
        apply(rank(w, 0), removed(&[100], Tier::Device));
    }
    apply(rank(10, 0), stored(Some(101), &[(102, 3)], Tier::Device));
    let q = seq(&[1, 2, 3]);
    let got = sorted(index.find_matches(&q));
    assert_eq!(got, sorted(reference.find_matches(&q)));
    assert_eq!(
        got.iter()
            .map(|r| (r.rank.worker_id, r.device_blocks, r.host_blocks))
            .collect::<Vec<_>>(),
        vec![(10, 3, 3), (20, 1, 2), (30, 1, 1)]
    );
}

#[test]
fn the_creation_order_queue_is_a_fifo() {
    let mut queue = ChunkedQueue::default();
    let mut model = std::collections::VecDeque::new();
    let mut state = 7u64;
    for step in 0..60_000u32 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
        // Alternate filling and draining phases, so the queue also runs empty.
        let draining = (step / 5000) % 2 == 1;
        match ((state >> 33) % 7 + if draining { 3 } else { 0 }) % 10 {
            0..=3 => {
                queue.push_back(step);
                model.push_back(step);
            }
            4..=6 => assert_eq!(queue.pop_front(), model.pop_front()),
            _ if step % 500 == 0 => {
                queue.retain(|n| n % 3 != 0);
                model.retain(|n| n % 3 != 0);
            }
            _ => {}
        }
        assert_eq!(queue.len(), model.len());
    }
    while let Some(n) = model.pop_front() {
        assert_eq!(queue.pop_front(), Some(n));
    }
    assert_eq!(queue.pop_front(), None);
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        rank: (u64, u32),
        parent: Option<u64>,
        blocks: Vec<(u64, u64)>,
        tier: usize,
    },
    Remove {
        rank: (u64, u32),
        hashes: Vec<u64>,
        tier: usize,
    },
    Clear {
        rank: (u64, u32),
    },
    RemoveWorker {
        worker: u64,
    },
    Lookup {
        local: Vec<u64>,
    },
}

fn op_strategy(workers: u64) -> impl Strategy<Value = Op> {
    let rank = (0..workers, 0..2u32);
    let engine = 0..16u64;
    let local = 0..4u64;
    prop_oneof![
        6 => (
            rank.clone(),
            proptest::option::weighted(0.6, engine.clone()),
            proptest::collection::vec((engine.clone(), local.clone()), 1..5),
            0..3usize
        )
            .prop_map(|(rank, parent, blocks, tier)| Op::Store {
                rank,
                parent,
                blocks,
                tier
            }),
        3 => (rank.clone(), proptest::collection::vec(engine.clone(), 1..4), 0..3usize)
            .prop_map(|(rank, hashes, tier)| Op::Remove { rank, hashes, tier }),
        // Longer than a removal chunk, with repeats and hashes the rank does not hold.
        1 => (
            rank.clone(),
            proptest::collection::vec(engine, REMOVE_CHUNK + 1..REMOVE_CHUNK * 2 + 16),
            0..3usize
        )
            .prop_map(|(rank, hashes, tier)| Op::Remove { rank, hashes, tier }),
        1 => rank.prop_map(|rank| Op::Clear { rank }),
        1 => (0..workers).prop_map(|worker| Op::RemoveWorker { worker }),
        4 => proptest::collection::vec(local, 0..7).prop_map(|local| Op::Lookup { local }),
    ]
}

fn run_ops(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut index = RadixIndex::default();
    let mut reference = ReferenceIndex::default();
    for op in ops {
        match op {
            Op::Store {
                rank: (w, d),
                parent,
                blocks,
                tier,
            } => {
                let event = stored(*parent, blocks, tier_from_index(*tier));
                let got = index.apply(rank(*w, *d), &event);
                let want = reference.apply(rank(*w, *d), &event);
                prop_assert_eq!(got, want);
            }
            Op::Remove {
                rank: (w, d),
                hashes,
                tier,
            } => {
                let event = removed(hashes, tier_from_index(*tier));
                let got = index.apply(rank(*w, *d), &event);
                let want = reference.apply(rank(*w, *d), &event);
                prop_assert_eq!(got.removed_blocks, want.removed_blocks);
                prop_assert_eq!(got.unknown_removed_blocks, want.unknown_removed_blocks);
            }
            Op::Clear { rank: (w, d) } => {
                index.apply(rank(*w, *d), &KvEvent::Cleared);
                reference.apply(rank(*w, *d), &KvEvent::Cleared);
            }
            Op::RemoveWorker { worker } => {
                index.remove_worker(*worker);
                reference.remove_worker(*worker);
            }
            Op::Lookup { local } => {
                let q = seq(local);
                prop_assert_eq!(
                    sorted(index.find_matches(&q)),
                    sorted(reference.find_matches(&q))
                );
            }
        }
        prop_assert_eq!(index.held_pairs(), reference.held_pairs());
        check_implicit(&index)?;
    }
    // The dump re-creates an index that answers every lookup the same way.
    let mut restored = RadixIndex::default();
    for (r, event) in index.dump() {
        restored.apply(r, &event);
    }
    for a in 0..4u64 {
        for b in 0..4u64 {
            for c in 0..4u64 {
                let q = seq(&[a, b, c]);
                prop_assert_eq!(
                    sorted(index.find_matches(&q)),
                    sorted(restored.find_matches(&q))
                );
            }
        }
    }
    Ok(())
}

/// The bookkeeping of implicit holdings: each rank's count equals the holders of live nodes it
/// has no entry for, such holdings are only of nodes with a canonical engine hash, and
/// `by_engine` holds exactly the live nodes with one.
fn check_implicit(index: &RadixIndex) -> Result<(), TestCaseError> {
    let mut implicit = vec![0usize; index.slots.len()];
    let mut canonical = 0;
    for n in (0..index.nodes.len).filter(|&n| index.nodes.is_allocated(n)) {
        let has = index.nodes.canonical(n);
        if let Some(e) = has {
            canonical += 1;
            let key = index.hasher.hash_one(e);
            prop_assert_eq!(index.by_engine.find(key, |&m| m == n), Some(&n));
        }
        for (slot, _) in index.nodes.get(n).holders.entries(&index.arena) {
            if !index.slots[slot as usize].explicit_nodes.contains_key(&n) {
                prop_assert!(
                    has.is_some(),
                    "implicit holding of a node without a canonical hash"
                );
                implicit[slot as usize] += 1;
            }
        }
    }
    prop_assert_eq!(index.by_engine.len(), canonical);
    for (slot, want) in index.slots.iter().zip(implicit) {
        prop_assert_eq!(slot.implicit, want);
    }
    Ok(())
}

/// With a tiny block cap, blocks are evicted under every kind of operation. The capped index
/// diverges from the uncapped model (an evicted parent drops later events), so each lookup is
/// checked against the reference model rebuilt from the index's own dump, and the held pairs
/// against the entries that point at live blocks plus the implicit holdings read off the holder
/// sets (a holder of a node it has no entry for).
fn run_ops_capped(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut index = RadixIndex::new(IndexConfig { max_blocks: 5 });
    for op in ops {
        match op {
            Op::Store {
                rank: (w, d),
                parent,
                blocks,
                tier,
            } => {
                index.apply(
                    rank(*w, *d),
                    &stored(*parent, blocks, tier_from_index(*tier)),
                );
                prop_assert!(index.block_count() <= 5);
            }
            Op::Remove {
                rank: (w, d),
                hashes,
                tier,
            } => {
                index.apply(rank(*w, *d), &removed(hashes, tier_from_index(*tier)));
            }
            Op::Clear { rank: (w, d) } => {
                index.apply(rank(*w, *d), &KvEvent::Cleared);
            }
            Op::RemoveWorker { worker } => {
                index.remove_worker(*worker);
            }
            Op::Lookup { local } => {
                let mut reference = ReferenceIndex::default();
                for (r, event) in index.dump() {
                    reference.apply(r, &event);
                }
                let q = seq(local);
                prop_assert_eq!(
                    sorted(index.find_matches(&q)),
                    sorted(reference.find_matches(&q))
                );
            }
        }
        let held: usize = index
            .slots
            .iter()
            .map(|s| {
                s.blocks
                    .iter()
                    .filter(|e| index.nodes.is_live(e.node()))
                    .count()
            })
            .sum::<usize>()
            + (0..index.nodes.len)
                .filter(|&n| index.nodes.is_live(n))
                .flat_map(|n| {
                    let index = &index;
                    index
                        .nodes
                        .get(n)
                        .holders
                        .entries(&index.arena)
                        .into_iter()
                        .filter(move |&(slot, _)| {
                            !index.slots[slot as usize].explicit_nodes.contains_key(&n)
                        })
                })
                .count();
        prop_assert_eq!(index.held_pairs(), held);
        check_implicit(&index)?;
    }
    Ok(())
}

/// Many ranks, each holding a prefix of one prompt with per-block tiers (all on the device before
/// `mixed_from`) and some holes, after `filler` ranks holding something else (more rank slots make
/// larger sparse holder sets), so that lookups go through every walk shape: bitsets for one or
/// three tiers, lists, and the transitions between them.
fn walk_shapes(
    ranks: Vec<(usize, Vec<usize>, Vec<usize>)>,
    prompt_blocks: usize,
    mixed_from: usize,
    filler: usize,
) -> Result<(), TestCaseError> {
    let local: Vec<u64> = (0..prompt_blocks as u64).map(|l| l + 100).collect();
    let mut index = RadixIndex::default();
    let mut reference = ReferenceIndex::default();
    for f in 0..filler {
        index.apply(
            rank(1_000_000 + f as u64, 0),
            &stored(None, &[(1, 1)], Tier::Device),
        );
    }
    for (w, (len, tiers, holes)) in ranks.iter().enumerate() {
        let r = rank(w as u64, 0);
        let len = len % (prompt_blocks + 1);
        for (i, &l) in local[..len].iter().enumerate() {
            let event = stored(
                i.checked_sub(1).map(|p| 5000 + p as u64),
                &[(5000 + i as u64, l)],
                tier_from_index(if i < mixed_from {
                    0
                } else {
                    tiers.get(i).copied().unwrap_or(0)
                }),
            );
            index.apply(r, &event);
            reference.apply(r, &event);
        }
        for &h in holes {
            let event = removed(&[5000 + (h % prompt_blocks) as u64], Tier::Device);
            index.apply(r, &event);
            reference.apply(r, &event);
        }
    }
    for end in [1, prompt_blocks / 2, prompt_blocks] {
        let q = seq(&local[..end]);
        prop_assert_eq!(
            sorted(index.find_matches(&q)),
            sorted(reference.find_matches(&q))
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn lookups_over_many_ranks_match_the_reference_model(
        ranks in proptest::collection::vec(
            (
                0..48usize,
                // Mostly device, sometimes host or disk.
                proptest::collection::vec(
                    prop_oneof![8 => Just(0usize), 1 => Just(1), 1 => Just(2)],
                    0..48
                ),
                proptest::collection::vec(0..48usize, 0..2),
            ),
            1..300,
        ),
        prompt_blocks in 2..48usize,
        mixed_from in 0..64usize,
        filler in prop_oneof![Just(0usize), 0..1200usize],
    ) {
        walk_shapes(ranks, prompt_blocks, mixed_from, filler)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn index_matches_the_reference_model(ops in proptest::collection::vec(op_strategy(3), 1..60)) {
        run_ops(&ops)?;
    }

    #[test]
    fn a_capped_index_stays_consistent(ops in proptest::collection::vec(op_strategy(3), 1..80)) {
        run_ops_capped(&ops)?;
    }

    #[test]
    fn index_matches_the_reference_model_with_dense_holder_sets(
        ops in proptest::collection::vec(op_strategy(40), 1..200)
    ) {
        run_ops(&ops)?;
    }
}
