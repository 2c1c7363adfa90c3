//! The TTL model, and against a naive reference.

use super::*;

// ------------------------------------------------------------------------------------------------
// TTL

fn ttl_model(max_blocks: usize) -> TtlModel {
    TtlModel::new(TtlConfig {
        max_blocks,
        ..TtlConfig::default()
    })
}

#[test]
fn ttl_blocks_expire_after_the_ttl_children_first() {
    let t0 = Instant::now();
    let r = rank(1);
    let mut model = TtlModel::default();
    let a = chain(&[1, 2, 3]);
    let inserted = model.insert(r, &a.local, &a.seq, t0).unwrap();
    assert_eq!(inserted.stored_blocks, 3);
    assert_eq!(
        inserted.events,
        vec![(
            r,
            KvEvent::Stored {
                parent: None,
                blocks: vec![
                    StoredBlock {
                        engine_hash: a.seq[0],
                        local_hash: 1
                    },
                    StoredBlock {
                        engine_hash: a.seq[1],
                        local_hash: 2
                    },
                    StoredBlock {
                        engine_hash: a.seq[2],
                        local_hash: 3
                    },
                ],
                tier: Tier::Device,
            }
        )]
    );
    assert!(model.expire(t0 + secs(119)).events.is_empty());
    let expired = model.expire(t0 + secs(120));
    assert_eq!(expired.expired_blocks, 3);
    assert_eq!(
        removed_of(&expired.events),
        vec![(r, a.seq[2]), (r, a.seq[1]), (r, a.seq[0])]
    );
    assert_eq!(model.blocks(), 0);
    assert_eq!(model.counters().expired_blocks, 3);
}

#[test]
fn ttl_reinsert_refreshes_present_blocks_and_stores_only_missing_ones() {
    let t0 = Instant::now();
    let r = rank(1);
    let mut model = TtlModel::default();
    let a = chain(&[1, 2]);
    let b = chain(&[1, 2, 3]);
    model.insert(r, &a.local, &a.seq, t0).unwrap();
    let again = model.insert(r, &b.local, &b.seq, t0 + secs(60)).unwrap();
    assert_eq!((again.stored_blocks, again.refreshed_blocks), (1, 2));
    assert_eq!(
        again.events,
        vec![(
            r,
            KvEvent::Stored {
                parent: Some(b.seq[1]),
                blocks: vec![StoredBlock {
                    engine_hash: b.seq[2],
                    local_hash: 3
                }],
                tier: Tier::Device,
            }
        )]
    );
    assert!(model.expire(t0 + secs(120)).events.is_empty());
    assert_eq!(model.expires_at(r, a.seq[0]), Some(t0 + secs(180)));
    // Another rank's insert of the same prompt is its own chain.
    let other = model
        .insert(rank(2), &a.local, &a.seq, t0 + secs(100))
        .unwrap();
    assert_eq!(other.stored_blocks, 2);
    let expired = model.expire(t0 + secs(180));
    assert_eq!(
        removed_of(&expired.events),
        vec![(r, b.seq[2]), (r, b.seq[1]), (r, b.seq[0])]
    );
    assert_eq!(model.rank_blocks(rank(2)), 2);
}

#[test]
fn ttl_cap_prunes_the_earliest_expiring_down_to_80_percent() {
    let t0 = Instant::now();
    let mut model = ttl_model(10);
    let chains: Vec<Chain> = (0..6u64)
        .map(|i| chain(&[10 * i + 1, 10 * i + 2]))
        .collect();
    for (i, c) in chains.iter().take(5).enumerate() {
        let r = rank(i as u64 % 2);
        let got = model
            .insert(r, &c.local, &c.seq, t0 + secs(i as u64))
            .unwrap();
        assert_eq!(got.pruned_blocks, 0);
    }
    assert_eq!(model.blocks(), 10);
    // The sixth chain takes the model to 12 > 10: prune to 8, the four earliest-expiring blocks.
    let c = &chains[5];
    let got = model
        .insert(rank(1), &c.local, &c.seq, t0 + secs(5))
        .unwrap();
    assert_eq!((got.stored_blocks, got.pruned_blocks), (2, 4));
    assert_eq!(model.blocks(), 8);
    let pruned: Vec<(Rank, u64)> = removed_of(&got.events);
    assert_eq!(
        pruned,
        vec![
            (rank(0), chains[0].seq[1]),
            (rank(0), chains[0].seq[0]),
            (rank(1), chains[1].seq[1]),
            (rank(1), chains[1].seq[0]),
        ]
    );
    // One Removed event per rank, after the Stored one.
    assert_eq!(got.events.len(), 3);
    assert!(matches!(got.events[0].1, KvEvent::Stored { .. }));
    assert_eq!(model.counters().prune_passes, 1);
    assert_eq!(TtlConfig::default().prune_target(), (1 << 20) * 4 / 5);
}

#[test]
fn ttl_remove_rank_forgets_without_events() {
    let t0 = Instant::now();
    let mut model = TtlModel::default();
    let a = chain(&[1, 2]);
    model.insert(rank(1), &a.local, &a.seq, t0).unwrap();
    model.insert(rank(2), &a.local, &a.seq, t0).unwrap();
    assert_eq!(model.remove_rank(rank(1)), 2);
    assert_eq!((model.blocks(), model.ranks()), (2, 1));
    let expired = model.expire(t0 + secs(120));
    assert_eq!(
        removed_of(&expired.events),
        vec![(rank(2), a.seq[1]), (rank(2), a.seq[0])]
    );
    assert_eq!(
        model.insert(rank(1), &[1], &[], t0),
        Err(ApproxError::LengthMismatch {
            local: 1,
            sequence: 0
        })
    );
}

#[test]
fn ttl_time_running_backwards_never_shortens_or_reorders_expiry() {
    let t0 = Instant::now();
    let r = rank(1);
    let mut model = TtlModel::default();
    let a = chain(&[1]);
    let b = chain(&[2]);
    model.insert(r, &a.local, &a.seq, t0 + secs(10)).unwrap();
    // An earlier `now` is treated as the latest one seen: b expires with a, after it.
    model.insert(r, &b.local, &b.seq, t0).unwrap();
    assert_eq!(model.expires_at(r, b.seq[0]), Some(t0 + secs(130)));
    assert_eq!(model.removal_order(), vec![(r, a.seq[0]), (r, b.seq[0])]);
    assert!(model.expire(t0 + secs(129)).events.is_empty());
    assert_eq!(model.expire(t0 + secs(130)).expired_blocks, 2);
}

/// A naive TTL reference: a list of `(rank, hash, expires_at, order)` sorted on demand, where
/// `order` numbers the blocks of each insert deepest first.
#[derive(Default)]
struct ReferenceTtl {
    entries: Vec<(Rank, u64, Instant, u64)>,
    order: u64,
    latest: Option<Instant>,
}

impl ReferenceTtl {
    fn insert(
        &mut self,
        rank: Rank,
        seq: &[u64],
        now: Instant,
        config: &TtlConfig,
    ) -> Vec<(Rank, u64)> {
        let expires = self
            .latest
            .map_or(now + config.ttl, |l| l.max(now + config.ttl));
        self.latest = Some(expires);
        let mut distinct: Vec<u64> = Vec::new();
        for &hash in seq {
            if !distinct.contains(&hash) {
                distinct.push(hash);
            }
        }
        for &hash in distinct.iter().rev() {
            let order = self.order;
            self.order += 1;
            match self.entries.iter_mut().find(|e| e.0 == rank && e.1 == hash) {
                Some(entry) => (entry.2, entry.3) = (expires, order),
                None => self.entries.push((rank, hash, expires, order)),
            }
        }
        if self.entries.len() > config.max_blocks {
            let excess = self.entries.len() - config.prune_target();
            self.pop(excess, None)
        } else {
            Vec::new()
        }
    }

    fn pop(&mut self, limit: usize, deadline: Option<Instant>) -> Vec<(Rank, u64)> {
        self.entries.sort_by_key(|e| (e.2, e.3));
        let take = self
            .entries
            .iter()
            .take(limit)
            .take_while(|e| deadline.is_none_or(|d| e.2 <= d))
            .count();
        self.entries.drain(..take).map(|e| (e.0, e.1)).collect()
    }

    fn order(&mut self) -> Vec<(Rank, u64)> {
        self.entries.sort_by_key(|e| (e.2, e.3));
        self.entries.iter().map(|e| (e.0, e.1)).collect()
    }
}

/// Per-rank order of the removals (the model groups one event per rank).
fn by_rank(mut removals: Vec<(Rank, u64)>) -> Vec<(Rank, u64)> {
    removals.sort_by_key(|&(rank, _)| rank); // stable: keeps each rank's order
    removals
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn ttl_matches_a_naive_reference_and_keeps_the_index_in_step(
        max_blocks in 4..24usize,
        ops in prop::collection::vec(
            (0..3u64, 0..3u64, 0..6usize, 0..6usize, 0..2u64, 0..90u64, 0..8u8), 1..50),
    ) {
        let config = TtlConfig { max_blocks, ..TtlConfig::default() };
        let mut model = TtlModel::new(config);
        let mut reference = ReferenceTtl::default();
        let mut index = RadixIndex::default();
        let mut now = Instant::now();
        let mut prompts: Vec<(Rank, Chain)> = Vec::new();
        for (r, family, len, diverge, tail, advance, kind) in ops {
            now += secs(advance);
            let rank = rank(r);
            let events = if kind == 0 {
                // The caller clears a removed rank itself.
                let held = reference.entries.iter().filter(|e| e.0 == rank).count();
                prop_assert_eq!(model.remove_rank(rank), held);
                reference.entries.retain(|e| e.0 != rank);
                vec![(rank, KvEvent::Cleared)]
            } else if kind <= 2 {
                let got = model.expire(now);
                prop_assert_eq!(by_rank(removed_of(&got.events)), by_rank(reference.pop(usize::MAX, Some(now))));
                got.events
            } else {
                let c = prompt(family, len, diverge, tail);
                let got = model.insert(rank, &c.local, &c.seq, now).unwrap();
                let want = reference.insert(rank, &c.seq, now, &config);
                prop_assert_eq!(by_rank(removed_of(&got.events)), by_rank(want));
                prompts.push((rank, c));
                got.events
            };
            for (rank, event) in &events {
                let outcome = index.apply(*rank, event);
                prop_assert_eq!(outcome.parent_block_not_found, 0);
                prop_assert_eq!(outcome.unknown_removed_blocks, 0);
            }
            prop_assert_eq!(model.blocks(), reference.entries.len());
            prop_assert_eq!(model.removal_order(), reference.order());
            for (rank, c) in &prompts {
                let cached = model.cached_hashes(*rank);
                let predicted = c.seq.iter().take_while(|h| cached.binary_search(h).is_ok()).count() as u32;
                let indexed = index.find_matches(&c.seq).get(*rank).map_or(0, |m| m.device_blocks);
                prop_assert_eq!(indexed, predicted);
            }
        }
    }
}
