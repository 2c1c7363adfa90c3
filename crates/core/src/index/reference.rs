//! A naive reference model of the index, for property tests and for `kvroute bench index`'s
//! check of sampled lookups (cargo feature `reference`): per rank a plain map from engine hash to
//! (sequence hash, per-tier store counts), and beside it the same counts summed per sequence hash,
//! which lookups read. Obviously correct, slow, and unbounded (no block cap).

use super::{ApplyOutcome, Matches, RankOverlap};
use crate::event::{KvEvent, Rank, Tier};
use crate::hash::chain;
use std::collections::BTreeMap;

#[derive(Debug, Default, Clone)]
pub struct ReferenceIndex {
    /// rank → engine hash → (sequence hash, counts per tier).
    ranks: BTreeMap<Rank, BTreeMap<u64, (u64, [u32; 3])>>,
    /// rank → sequence hash → counts per tier summed over the rank's engine hashes on it.
    by_sequence: BTreeMap<Rank, BTreeMap<u64, [u32; 3]>>,
}

/// Adds `delta` to the count of `tier` of `seq` in a rank's per-sequence sums.
fn add_count(sums: &mut BTreeMap<u64, [u32; 3]>, seq: u64, tier: usize, delta: i64) {
    let counts = sums.entry(seq).or_insert([0; 3]);
    counts[tier] = (i64::from(counts[tier]) + delta) as u32;
    if *counts == [0; 3] {
        sums.remove(&seq);
    }
}

impl ReferenceIndex {
    pub fn apply(&mut self, rank: Rank, event: &KvEvent) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        match event {
            KvEvent::Stored {
                parent,
                blocks,
                tier,
            } => {
                let held = self.ranks.entry(rank).or_default();
                let sums = self.by_sequence.entry(rank).or_default();
                let mut previous = match parent {
                    None => None,
                    Some(p) => match held.get(p) {
                        Some(&(seq, _)) => Some(seq),
                        None => {
                            outcome.parent_block_not_found += 1;
                            return outcome;
                        }
                    },
                };
                for block in blocks {
                    let seq = previous.map_or(block.local_hash, |p| chain(p, block.local_hash));
                    let entry = held.entry(block.engine_hash).or_insert((seq, [0; 3]));
                    if entry.0 != seq {
                        outcome.engine_hash_conflicts += 1;
                        for (t, &c) in entry.1.iter().enumerate() {
                            add_count(sums, entry.0, t, -i64::from(c));
                        }
                        *entry = (seq, [0; 3]);
                    }
                    entry.1[tier.index()] += 1;
                    add_count(sums, seq, tier.index(), 1);
                    outcome.stored_blocks += 1;
                    previous = Some(seq);
                }
            }
            KvEvent::Removed {
                engine_hashes,
                tier,
            } => {
                let held = self.ranks.entry(rank).or_default();
                let sums = self.by_sequence.entry(rank).or_default();
                for h in engine_hashes {
                    match held.get_mut(h) {
                        Some(entry) if entry.1[tier.index()] > 0 => {
                            entry.1[tier.index()] -= 1;
                            add_count(sums, entry.0, tier.index(), -1);
                            outcome.removed_blocks += 1;
                            if entry.1 == [0; 3] {
                                held.remove(h);
                            }
                        }
                        _ => outcome.unknown_removed_blocks += 1,
                    }
                }
            }
            KvEvent::Cleared => {
                if let Some(held) = self.ranks.get_mut(&rank) {
                    held.clear();
                    self.by_sequence.remove(&rank);
                    outcome.cleared_ranks += 1;
                }
            }
        }
        outcome
    }

    pub fn remove_worker(&mut self, worker_id: u64) {
        self.ranks.retain(|r, _| r.worker_id != worker_id);
        self.by_sequence.retain(|r, _| r.worker_id != worker_id);
    }

    fn holds(sums: &BTreeMap<u64, [u32; 3]>, seq: u64, t: usize) -> bool {
        sums.get(&seq)
            .is_some_and(|counts| counts[..=t].iter().any(|&c| c > 0))
    }

    pub fn find_matches(&self, sequence_hashes: &[u64]) -> Matches {
        let mut ranks = Vec::new();
        for (&rank, held) in &self.by_sequence {
            let mut ends = [0u32; 3];
            for (t, end) in ends.iter_mut().enumerate() {
                *end = sequence_hashes
                    .iter()
                    .take_while(|&&seq| Self::holds(held, seq, t))
                    .count() as u32;
            }
            if ends[2] > 0 {
                ranks.push(RankOverlap {
                    rank,
                    device_blocks: ends[0],
                    host_blocks: ends[1],
                    disk_blocks: ends[2],
                });
            }
        }
        Matches { ranks }
    }

    /// Distinct `(rank, engine hash)` entries.
    pub fn held_pairs(&self) -> usize {
        self.ranks.values().map(|h| h.len()).sum()
    }
}

/// A `Tier` from an index 0..3 (for generators).
pub fn tier_from_index(i: usize) -> Tier {
    Tier::ALL[i % 3]
}
