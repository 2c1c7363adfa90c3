//! Engines' KV events into the partition indexes, and the approximate cache models (SPEC §9)
//! that predict the cache of ranks without events from the selector's own bookings.

use super::{CacheModelReport, Lifecycle, Selector, WorkerRecord, WorkerSpec, exclusive, locked};
use crate::approx::{ApproxError, LruModel, RankModel, rank_model};
use crate::error::PartitionKey;
use crate::event::{KvEvent, Rank, WorkerId};
use crate::index::ApplyOutcome;
use std::time::Instant;

impl Selector {
    /// Whether a worker's cache is predicted (it publishes no KV events, or events are off).
    pub(super) fn is_modelled(&self, spec: &WorkerSpec) -> bool {
        self.config.no_kv_events || spec.event_endpoints().is_empty()
    }

    /// The model that predicts a rank's cache, or `None` when its engine's events feed the index.
    pub(super) fn model_of(&self, record: &WorkerRecord) -> Option<RankModel> {
        (record.lifecycle == Lifecycle::Schedulable && self.is_modelled(&record.spec))
            .then(|| rank_model(self.config.approximate_policy, record.spec.total_kv_blocks))
    }

    /// Keeps the approximate models in step with a worker's registration (SPEC §9): a rank moving
    /// between models, or to or from KV events, starts over with an empty cache.
    pub(super) fn sync_cache_models(
        &mut self,
        record: &WorkerRecord,
        previous: Option<&WorkerRecord>,
        events_changed: bool,
    ) {
        let model = self.model_of(record);
        let before = previous.and_then(|p| self.model_of(p));
        let partition = record.spec.partition();
        for dp_rank in record.spec.dp_ranks() {
            let rank = Rank::new(record.spec.worker_id, dp_rank);
            let mut events = Vec::new();
            let kind_changed = std::mem::discriminant(&model.unwrap_or(RankModel::Ttl))
                != std::mem::discriminant(&before.unwrap_or(RankModel::Ttl))
                || model.is_some() != before.is_some();
            if kind_changed && previous.is_some() {
                events.push(KvEvent::Cleared);
            }
            match model {
                Some(RankModel::Lru { capacity_blocks }) => {
                    let reset = if events_changed && !kind_changed {
                        exclusive(&mut self.lru).reset_rank(rank, capacity_blocks)
                    } else {
                        exclusive(&mut self.lru).set_rank(rank, capacity_blocks)
                    };
                    if let Ok(reset) = reset {
                        events.extend(reset.events);
                    }
                    if let Some(p) = self.partitions.get_mut(&partition) {
                        p.ttl.remove_rank(rank);
                    }
                }
                Some(RankModel::Ttl) => {
                    exclusive(&mut self.lru).remove_rank(rank);
                }
                None => {
                    exclusive(&mut self.lru).remove_rank(rank);
                    if let Some(p) = self.partitions.get_mut(&partition) {
                        p.ttl.remove_rank(rank);
                    }
                }
            }
            self.apply_model_events(&partition, rank, &events);
        }
    }

    /// Applies events an approximate model returned to the rank's partition index.
    pub(super) fn apply_model_events(
        &mut self,
        partition: &PartitionKey,
        rank: Rank,
        events: &[KvEvent],
    ) {
        if events.is_empty() {
            return;
        }
        if let Some(p) = self.partitions.get_mut(partition) {
            p.index.apply_all(rank, events);
        }
    }

    /// Predicts the cache of a booked request on a rank without KV events.
    pub(super) fn model_booking(
        &mut self,
        reservation_id: &str,
        rank: Rank,
        local_hashes: &[u64],
        sequence_hashes: &[u64],
        isl_tokens: u64,
        now: Instant,
    ) {
        let Some(record) = self.workers.get(&rank.worker_id) else {
            return;
        };
        let Some(model) = self.model_of(record) else {
            return;
        };
        let partition = record.spec.partition();
        let block_size = u64::from(record.spec.block_size.unwrap_or(1).max(1));
        let partial = !isl_tokens.is_multiple_of(block_size);
        if let RankModel::Lru { .. } = model {
            let acquire = |lru: &mut LruModel| {
                lru.acquire(
                    rank,
                    reservation_id,
                    local_hashes,
                    sequence_hashes,
                    partial,
                    now,
                )
            };
            let mut attempt = acquire(exclusive(&mut self.lru));
            if let Err(ApproxError::LeaseExists { .. }) = attempt {
                // A lease outlived its booking (the id was freed and booked again): start over.
                self.release_lease(reservation_id);
                attempt = acquire(exclusive(&mut self.lru));
            }
            match attempt {
                Ok(acquired) => {
                    self.apply_model_events(&partition, rank, &acquired.events);
                    return;
                }
                Err(ApproxError::UnknownRank { .. }) => {}
                Err(_) => return,
            }
        }
        if let Some(p) = self.partitions.get_mut(&partition)
            && let Ok(outcome) = p.ttl.insert(rank, local_hashes, sequence_hashes, now)
        {
            for (r, event) in &outcome.events {
                p.index.apply(*r, event);
            }
        }
    }

    /// Ends a request's lease in the LRU model (free, expiry, worker deletion).
    pub(super) fn release_lease(&mut self, reservation_id: &str) {
        if let Some(released) = exclusive(&mut self.lru).release(reservation_id) {
            self.apply_rank_events(released.rank, &released.events);
        }
    }

    /// Applies a model's events of one rank to the partition of the rank's worker.
    pub(super) fn apply_rank_events(&mut self, rank: Rank, events: &[KvEvent]) {
        let partition = self
            .workers
            .get(&rank.worker_id)
            .map(|r| r.spec.partition());
        if let Some(p) = partition {
            self.apply_model_events(&p, rank, events);
        }
    }

    /// Applies `(rank, event)` pairs from a model-wide operation to each rank's partition.
    pub(super) fn apply_ranked_events(&mut self, events: &[(Rank, KvEvent)]) {
        for (rank, event) in events {
            self.apply_rank_events(*rank, std::slice::from_ref(event));
        }
    }

    /// How a rank's cache is known, for `/loads`.
    pub fn cache_model(&self, rank: Rank) -> Option<CacheModelReport> {
        let record = self.workers.get(&rank.worker_id)?;
        Some(match self.model_of(record) {
            None => CacheModelReport::Events,
            Some(_) => match locked(&self.lru).stats(rank) {
                Some(stats) => CacheModelReport::Lru(stats),
                None => CacheModelReport::Ttl {
                    blocks: self
                        .partitions
                        .get(&record.spec.partition())
                        .map_or(0, |p| p.ttl.rank_blocks(rank) as u64),
                },
            },
        })
    }

    /// Model-wide counters of the LRU model (for metrics).
    pub fn lru_counters(&self) -> crate::approx::LruCounters {
        locked(&self.lru).counters()
    }

    /// Applies KV events of one rank of a worker to its partition's index, confirming or
    /// withdrawing the rank's predicted blocks they name (`predict.rs`). `None` when the worker
    /// is unknown (the events are dropped; the edge counts them).
    pub fn apply_events(
        &mut self,
        worker_id: WorkerId,
        dp_rank: u32,
        events: &[KvEvent],
    ) -> Option<ApplyOutcome> {
        // Bookings queued before these events are recorded first, so the events find them.
        self.settle_predictions();
        let record = self.workers.get(&worker_id)?;
        let partition = self.partitions.get_mut(&record.spec.partition())?;
        Some(Self::apply_with_predictions(
            &mut partition.index,
            exclusive(&mut self.predictions),
            Rank::new(worker_id, dp_rank),
            events,
        ))
    }
}
