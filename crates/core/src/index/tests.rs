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
        3 => (rank.clone(), proptest::collection::vec(engine, 1..4), 0..3usize)
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn index_matches_the_reference_model(ops in proptest::collection::vec(op_strategy(3), 1..60)) {
        run_ops(&ops)?;
    }

    #[test]
    fn index_matches_the_reference_model_with_dense_holder_sets(
        ops in proptest::collection::vec(op_strategy(40), 1..200)
    ) {
        run_ops(&ops)?;
    }
}
