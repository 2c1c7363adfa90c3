//! Read-only views of the routing state: `/loads`, `/potential_loads`, `/overlap_scores`,
//! `/dump` and the index sizes the metrics report.

use super::*;
use crate::event::Rank;
use crate::index::RankOverlap;
use crate::load::RankLoad;
use crate::schedule::Overrides;

fn ceil_blocks(isl_tokens: u64, block_size: u32) -> u64 {
    isl_tokens.div_ceil(u64::from(block_size.max(1)))
}

impl Selector {
    /// The index as events per partition (`/dump`).
    pub fn dump(&self) -> Vec<PartitionDump> {
        self.partitions
            .iter()
            .map(|(key, p)| PartitionDump {
                partition: key.clone(),
                block_size: p
                    .workers
                    .iter()
                    .filter_map(|w| self.workers.get(w))
                    .find_map(|r| r.spec.block_size),
                events: p.index.dump(),
            })
            .collect()
    }

    /// The index walk of a select alone, as `select` runs it: the compact answer for a prompt
    /// given by its sequence hashes (the ranks listed, and the floor of ranks a shared first
    /// block made alike). For `kvroute bench index`, which times the walk without the scoring.
    /// `None` when the partition has no index.
    pub fn index_walk(
        &self,
        partition: &PartitionKey,
        sequence_hashes: &[u64],
    ) -> Option<crate::index::CompactMatches> {
        let p = self.partitions.get(partition)?;
        Some(p.index.find_matches_compact(sequence_hashes))
    }

    /// Every rank of the partition with a non-zero overlap with a prompt given by its sequence
    /// hashes, in rank order ([`Self::index_walk`] with the floor listed). `None` when the
    /// partition has no index.
    pub fn index_overlaps(
        &self,
        partition: &PartitionKey,
        sequence_hashes: &[u64],
    ) -> Option<Vec<RankOverlap>> {
        let p = self.partitions.get(partition)?;
        Some(p.index.find_matches(sequence_hashes).ranks)
    }

    /// Estimated bytes of a partition's index ([`crate::index::RadixIndex::memory_bytes`]).
    pub fn index_memory_bytes(&self, partition: &PartitionKey) -> Option<usize> {
        self.partitions
            .get(partition)
            .map(|p| p.index.memory_bytes())
    }

    /// Indexed blocks and `(block, rank)` pairs per partition (for metrics).
    pub fn index_sizes(&self) -> Vec<(PartitionKey, usize, usize)> {
        self.partitions
            .iter()
            .map(|(k, p)| (k.clone(), p.index.block_count(), p.index.held_pairs()))
            .collect()
    }

    pub(super) fn rank_report(&self, rank: Rank) -> RankLoadReport {
        let RankLoad {
            active_prefill_tokens,
            active_decode_blocks,
            active_requests,
        } = locked(&self.load).rank_load(rank);
        RankLoadReport {
            worker_id: rank.worker_id,
            dp_rank: rank.dp_rank,
            potential_prefill_tokens: active_prefill_tokens,
            potential_decode_blocks: active_decode_blocks,
            active_requests,
            cache_model: self.cache_model(rank),
        }
    }

    /// `GET /loads`: per partition, every schedulable rank's active load.
    pub fn loads(
        &self,
        model_name: Option<&str>,
        routing_group: Option<&str>,
    ) -> Vec<PartitionLoads> {
        self.partitions
            .iter()
            .filter(|(k, _)| model_name.is_none_or(|m| k.model_name == m))
            .filter(|(k, _)| routing_group.is_none_or(|g| k.routing_group == g))
            .map(|(key, p)| PartitionLoads {
                partition: key.clone(),
                loads: p
                    .workers
                    .iter()
                    .filter_map(|w| self.workers.get(w))
                    .filter(|r| r.lifecycle == Lifecycle::Schedulable)
                    .flat_map(|r| {
                        r.spec
                            .dp_ranks()
                            .map(|d| self.rank_report(Rank::new(r.spec.worker_id, d)))
                    })
                    .collect(),
                pending_count: 0,
                pending_isl_tokens: 0,
            })
            .collect()
    }

    /// `POST /potential_loads`: each schedulable rank's load if this prompt were booked there.
    pub fn potential_loads(
        &self,
        partition: &PartitionKey,
        prompt: Prompt<'_>,
        overrides: &Overrides,
    ) -> Result<Vec<RankLoadReport>, Error> {
        self.check_running()?;
        let (p, workers) = self.schedulable_workers(partition)?;
        let block_size = workers.first().and_then(|r| r.spec.block_size).unwrap_or(1);
        let hashes = prompt.hash(block_size)?;
        let config = self.config.scheduler.with(overrides);
        let overlaps = Self::overlaps(p, &hashes);
        Ok(self
            .candidates(&workers, &overlaps, &hashes, block_size, None, None)
            .into_iter()
            .map(|(c, _)| {
                let added = if config.track_prefill_tokens {
                    config.effective_prefill_tokens(
                        hashes.isl_tokens,
                        block_size,
                        c.device_blocks,
                        c.host_blocks,
                        c.disk_blocks,
                    )
                } else {
                    0
                };
                RankLoadReport {
                    worker_id: c.rank.worker_id,
                    dp_rank: c.rank.dp_rank,
                    potential_prefill_tokens: c.active_prefill_tokens + added,
                    potential_decode_blocks: c.potential_decode_blocks,
                    active_requests: c.active_requests,
                    cache_model: None,
                }
            })
            .collect())
    }

    /// `POST /overlap_scores`: every schedulable rank's overlap with the prompt, in blocks.
    pub fn overlap_scores(
        &self,
        partition: &PartitionKey,
        prompt: Prompt<'_>,
    ) -> Result<OverlapScores, Error> {
        self.check_running()?;
        let (p, workers) = self.schedulable_workers(partition)?;
        let block_size = workers.first().and_then(|r| r.spec.block_size).unwrap_or(1);
        let hashes = prompt.hash(block_size)?;
        let overlaps = Self::overlaps(p, &hashes);
        let scores = workers
            .iter()
            .flat_map(|r| {
                let overlaps = &overlaps;
                r.spec.dp_ranks().map(move |d| {
                    let rank = Rank::new(r.spec.worker_id, d);
                    let o = overlaps.get(&rank);
                    RankOverlapScore {
                        worker_id: rank.worker_id,
                        dp_rank: d,
                        device_blocks: o.map_or(0, |o| o.device_blocks),
                        host_pinned_blocks: o.map_or(0, |o| o.host_blocks),
                        disk_blocks: o.map_or(0, |o| o.disk_blocks),
                    }
                })
            })
            .collect();
        Ok(OverlapScores {
            block_size,
            num_blocks: hashes.sequence.len(),
            workers: scores,
        })
    }

    /// Decode blocks a prompt of `isl_tokens` holds (SPEC §7.7: ceil everywhere).
    pub fn prompt_blocks(isl_tokens: u64, block_size: u32) -> u64 {
        ceil_blocks(isl_tokens, block_size)
    }
}
