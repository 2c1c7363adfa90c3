//! Predict-on-route: a booked prompt's blocks count as held on the chosen rank from the booking
//! until the rank's own KV events speak for them, or a short TTL passes. Requests that arrive
//! before the engine has reported a prefix it is computing then see it where it is being
//! computed, instead of spreading over the fleet (Dynamo's predicted TTL, llm-d's speculative
//! indexing).
//!
//! ## Which bookings predict
//! Every booking onto a rank whose cache is known from KV events: `select_and_reserve`, a replay
//! of a cached selection and an explicit booking. A rank without events has the approximate
//! cache models of SPEC §9 instead (`events.rs`), which predict from the same bookings, so they
//! are not doubled up here. A plain `select` books nothing and predicts nothing. Blocks the rank
//! already holds on the device, or holds predicted, are left alone: only the rest is predicted
//! (`RadixIndex::held_prefix` finds the held prefix in one walk, `RadixIndex::store_at` skips
//! any other held block).
//!
//! ## How a prediction is held
//! In the partition's [`RadixIndex`], as a device-tier store of the rank under the engine hash
//! [`predicted_engine_hash`] (a bijection of the sequence hash, so at most one such entry per
//! block and rank), at the prompt's own sequence hashes. `find_matches` therefore sees it as
//! any other device holding: in the overlap of the next select, the cost and
//! `effective_prefill_tokens`. Beside it, [`Predictions`] keeps one record per predicted
//! `(rank, sequence hash)` with its deadline.
//!
//! A block is never counted twice. When the rank's own `Stored` of a predicted block on the
//! device arrives, the index gives the engine's entry the predicted entry's place (it adopts it,
//! `ApplyOutcome::adopted_predictions`): the holders do not change, and from there on the index
//! holds exactly what it would hold without prediction, so the engine's later `Removed` drops the
//! block. Should the rank hold the block under another entry too (a host copy, say), the two are
//! aliases on one node: the holder set is per tier, so the overlap counts the block once, the
//! index counts the entries, so removing either keeps the other, and the predicted one is removed
//! when its prediction ends.
//!
//! ## How a prediction ends (each block in exactly one of these, counted)
//! - **confirmed**: the rank's own `Stored` of the block on the device (another rank's events
//!   confirm nothing). The sequence hashes of a `Stored` are chained from its parent as the index
//!   chains them, so the engine's hashes need not be known.
//! - **withdrawn**: any other event of the rank that names the block — a `Removed` of it (on any
//!   tier; the index resolves the engine's hash to the block before removing it) or a `Stored` on
//!   another tier: the engine has spoken for that block, and not as held on its device — and
//!   every prediction of a rank that is `Cleared` (an engine restart, or `reset_prefix_cache`),
//!   re-registered with other event endpoints, ranks or partition, or deleted. Since a block held
//!   on the device is never predicted and a device `Stored` confirms, a `Removed` meets a
//!   prediction when the rank also held the block on another tier (its host copy, say).
//! - **expired**: its TTL ([`PredictConfig::ttl`], 2 s by default) passed, or the cap pushed it
//!   out. The TTL runs from when the booking that predicted it is predicted to start its prefill
//!   (now plus the prefill queued ahead of it on the rank, at the current speeds), so a prompt
//!   queued behind others stays visible where it will be computed; deadlines never decrease from
//!   one prediction to the next. A later booking of the same prompt does not extend
//!   it.
//!
//! Freeing a booking does not withdraw its prediction: the engine keeps the blocks cached after
//! the request ends, and its events will say so (or the TTL ends the guess).
//!
//! ## When it is recorded
//! Recording changes the index, which a booking under a shared borrow (the edge's read lock: a
//! replay onto a rank with events, [`LifecycleCalls`](super::LifecycleCalls)) must not. Such a
//! booking queues its prediction instead (an inner mutex, taken alone), and the next exclusive
//! holder records the queue: before it applies KV events ([`Selector::apply_events`]), before
//! the tick, `select_and_reserve`, an exclusive booking or a catalog change does anything else,
//! and after a lifecycle call made under the write lock. Through a `&mut Selector` (the
//! simulator, tests) that is at once; through a `RwLock` the booking tries the write lock
//! without waiting (`try_write`) and, when selects hold it, leaves the queue to the next writer,
//! in the service usually the KV-event applier within a millisecond, at worst the next tick.
//! The events that follow a booking thus always find its prediction recorded. The queue holds at
//! most [`PredictConfig::max_blocks`] blocks (the oldest bookings dropped beyond, uncounted: they
//! were never predicted).
//!
//! ## Expiry
//! [`Selector::tick`] expires what is due; so does every exclusive booking (`select_and_reserve`,
//! an explicit booking), lazily, at its own `now`. A plain select runs under the read lock and
//! cannot remove anything, so it may see a prediction up to one tick period (the service ticks
//! once a second) past its TTL when no exclusive booking came in between. Deadlines never go
//! backwards (each is at least the previous one), so records form a queue: expiry pops its front.
//!
//! ## Bounds
//! At most [`PredictConfig::max_blocks`] predicted blocks in all (2^18 by default), the oldest
//! expiring first beyond it. A record is ~40 bytes in the map and 48 in the deadline queue, which
//! with table slack and the block's index entry (and node, when no rank held it) comes to about
//! 150–250 bytes a block: 40–60 MiB at the cap. Records ended early leave their queue slot until
//! it comes due, and the queue is compacted when it reaches twice the cap. The partition index's
//! own block cap applies to predicted blocks as to any.
//!
//! ## Replicas
//! Predictions are not replicated: a booking reaches other replicas as today (their load
//! trackers only, `sync.rs`), and each replica predicts only its own bookings. Relayed KV events
//! confirm and withdraw a replica's predictions as the engines' direct ones do. `/dump` leaves
//! predicted entries out.

use super::{Lifecycle, Selector, exclusive, locked};
use crate::event::{KvEvent, Rank, StoredBlock, Tier, WorkerId};
use crate::hash::chain;
use crate::index::{ApplyOutcome, RadixIndex, predicted_engine_hash};
use crate::schedule::RouterProfile;
use hashbrown::HashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Default TTL of a predicted block (`--predicted-ttl-secs`).
pub const DEFAULT_PREDICTED_TTL: Duration = Duration::from_secs(2);
/// Default cap on predicted blocks, all ranks together.
pub const DEFAULT_MAX_PREDICTED_BLOCKS: usize = 1 << 18;

/// Predict-on-route's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PredictConfig {
    /// How long a predicted block counts as held at most; zero turns prediction off.
    pub ttl: Duration,
    /// Cap on predicted blocks (all ranks and partitions); the oldest expire first beyond it.
    pub max_blocks: usize,
}

impl Default for PredictConfig {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_PREDICTED_TTL,
            max_blocks: DEFAULT_MAX_PREDICTED_BLOCKS,
        }
    }
}

impl PredictConfig {
    /// A profile's prediction: on with the default TTL for `kvroute`, off for `dynamo` (Dynamo
    /// 1.6.1 does not predict on route, and that profile is for identical decisions).
    pub fn for_profile(profile: RouterProfile) -> Self {
        match profile {
            RouterProfile::Kvroute => Self::default(),
            RouterProfile::Dynamo => Self {
                ttl: Duration::ZERO,
                ..Self::default()
            },
        }
    }
}

impl PredictConfig {
    /// Whether bookings predict at all.
    pub fn enabled(&self) -> bool {
        !self.ttl.is_zero() && self.max_blocks > 0
    }
}

/// Running counts of predicted blocks by outcome, since the selector started (for metrics):
/// `predicted = confirmed + expired + withdrawn + ` those still held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PredictionCounters {
    pub predicted: u64,
    pub confirmed: u64,
    pub expired: u64,
    pub withdrawn: u64,
}

/// How a prediction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Confirmed,
    Expired,
    Withdrawn,
}

/// A booking's prediction waiting to be recorded.
#[derive(Debug)]
struct Queued {
    rank: Rank,
    local: Arc<[u64]>,
    sequence: Arc<[u64]>,
    at: Instant,
}

/// One slot of the deadline queue: the record `id` of `(rank, sequence_hash)` expires at `at`
/// (a slot whose record has ended, or was made again under another id, is skipped).
#[derive(Debug, Clone, Copy)]
struct Deadline {
    at: Instant,
    id: u64,
    rank: Rank,
    sequence_hash: u64,
}

/// The predicted blocks' records and the queue of bookings to record (module doc). Pure
/// bookkeeping: the caller changes the index.
#[derive(Debug)]
pub(super) struct Predictions {
    config: PredictConfig,
    queued: VecDeque<Queued>,
    queued_blocks: usize,
    /// `(rank, sequence hash)` → the record's id.
    live: HashMap<(Rank, u64), u64>,
    /// Deadlines in order (non-decreasing from the front).
    order: VecDeque<Deadline>,
    /// Records per rank (ranks with none are absent).
    per_rank: HashMap<Rank, usize>,
    next_id: u64,
    latest_deadline: Option<Instant>,
    counters: PredictionCounters,
}

impl Predictions {
    pub(super) fn new(config: PredictConfig) -> Self {
        Self {
            config,
            queued: VecDeque::new(),
            queued_blocks: 0,
            live: HashMap::new(),
            order: VecDeque::new(),
            per_rank: HashMap::new(),
            next_id: 0,
            latest_deadline: None,
            counters: PredictionCounters::default(),
        }
    }

    /// Queues a booking's prompt; false when prediction is off or there is nothing to predict.
    fn queue(
        &mut self,
        rank: Rank,
        local: &Arc<[u64]>,
        sequence: &Arc<[u64]>,
        at: Instant,
    ) -> bool {
        if !self.config.enabled() || sequence.is_empty() || local.len() != sequence.len() {
            return false;
        }
        self.queued_blocks += sequence.len();
        self.queued.push_back(Queued {
            rank,
            local: Arc::clone(local),
            sequence: Arc::clone(sequence),
            at,
        });
        while self.queued_blocks > self.config.max_blocks && self.queued.len() > 1 {
            if let Some(dropped) = self.queued.pop_front() {
                self.queued_blocks -= dropped.sequence.len();
            }
        }
        true
    }

    fn take_queued(&mut self) -> VecDeque<Queued> {
        self.queued_blocks = 0;
        std::mem::take(&mut self.queued)
    }

    /// Whether the rank has any predicted block.
    fn has_rank(&self, rank: Rank) -> bool {
        self.per_rank.contains_key(&rank)
    }

    fn is_predicted(&self, rank: Rank, sequence_hash: u64) -> bool {
        self.live.contains_key(&(rank, sequence_hash))
    }

    /// Records a block predicted by a booking made at `at`.
    fn record(&mut self, rank: Rank, sequence_hash: u64, at: Instant) {
        let deadline = at
            .checked_add(self.config.ttl)
            .unwrap_or(at)
            .max(self.latest_deadline.unwrap_or(at));
        self.latest_deadline = Some(deadline);
        let id = self.next_id;
        self.next_id += 1;
        self.live.insert((rank, sequence_hash), id);
        *self.per_rank.entry(rank).or_default() += 1;
        self.order.push_back(Deadline {
            at: deadline,
            id,
            rank,
            sequence_hash,
        });
        self.counters.predicted += 1;
        if self.order.len() >= 2 * self.config.max_blocks.max(1024) {
            let live = &self.live;
            self.order
                .retain(|d| live.get(&(d.rank, d.sequence_hash)) == Some(&d.id));
        }
    }

    /// Ends the record of a block, if there is one; true when there was.
    fn end(&mut self, rank: Rank, sequence_hash: u64, how: End) -> bool {
        if self.live.remove(&(rank, sequence_hash)).is_none() {
            return false;
        }
        self.count_end(rank, 1, how);
        true
    }

    fn count_end(&mut self, rank: Rank, blocks: usize, how: End) {
        if let Some(n) = self.per_rank.get_mut(&rank) {
            *n = n.saturating_sub(blocks);
            if *n == 0 {
                self.per_rank.remove(&rank);
            }
        }
        let counter = match how {
            End::Confirmed => &mut self.counters.confirmed,
            End::Expired => &mut self.counters.expired,
            End::Withdrawn => &mut self.counters.withdrawn,
        };
        *counter += blocks as u64;
    }

    /// Pops the front of the deadline queue while `due(front)`, expiring the live records.
    fn pop_front_while(
        &mut self,
        mut due: impl FnMut(&Self, &Deadline) -> bool,
    ) -> Vec<(Rank, u64)> {
        let mut ended = Vec::new();
        while let Some(&front) = self.order.front() {
            if !due(self, &front) {
                break;
            }
            self.order.pop_front();
            let key = (front.rank, front.sequence_hash);
            if self.live.get(&key) == Some(&front.id) {
                self.live.remove(&key);
                self.count_end(front.rank, 1, End::Expired);
                ended.push(key);
            }
        }
        ended
    }

    /// Expires the records due at `now`.
    fn take_due(&mut self, now: Instant) -> Vec<(Rank, u64)> {
        self.pop_front_while(|_, d| d.at <= now)
    }

    /// Expires the oldest records beyond the cap.
    fn take_over_cap(&mut self) -> Vec<(Rank, u64)> {
        self.pop_front_while(|s, _| s.live.len() > s.config.max_blocks)
    }

    /// Withdraws every record of the ranks `forget` picks (the caller has dropped their entries
    /// from the index).
    fn forget(&mut self, forget: impl Fn(Rank) -> bool) {
        let ranks: Vec<(Rank, usize)> = self
            .per_rank
            .iter()
            .filter(|(r, _)| forget(**r))
            .map(|(r, n)| (*r, *n))
            .collect();
        if ranks.is_empty() {
            return;
        }
        self.live.retain(|(rank, _), _| !forget(*rank));
        for (rank, n) in ranks {
            self.count_end(rank, n, End::Withdrawn);
        }
    }

    pub(super) fn counters(&self) -> PredictionCounters {
        self.counters
    }

    pub(super) fn len(&self) -> usize {
        self.live.len()
    }
}

/// A `Removed` event of the predicted entries of `sequence_hashes`.
fn removal(sequence_hashes: impl IntoIterator<Item = u64>) -> KvEvent {
    KvEvent::Removed {
        engine_hashes: sequence_hashes
            .into_iter()
            .map(predicted_engine_hash)
            .collect(),
        tier: Tier::Device,
    }
}

/// Applies one event of `rank`, which has predicted blocks, ending the predictions it names.
/// Returns the event's own outcome (the removal of predicted entries is not counted in it).
fn apply_event(
    index: &mut RadixIndex,
    predictions: &mut Predictions,
    rank: Rank,
    event: &KvEvent,
) -> ApplyOutcome {
    match event {
        KvEvent::Stored {
            parent,
            blocks,
            tier,
        } => {
            // The sequence hashes as the index chains them; none when the parent is unknown
            // (the index then drops the event).
            let start = match parent {
                None => Some(None),
                Some(p) => index.sequence_hash_of(rank, *p).map(Some),
            };
            let outcome = index.apply(rank, event);
            let Some(mut previous) = start else {
                return outcome;
            };
            let how = if *tier == Tier::Device {
                End::Confirmed
            } else {
                End::Withdrawn
            };
            let mut ended = Vec::new();
            for block in blocks {
                let s = previous.map_or(block.local_hash, |p| chain(p, block.local_hash));
                if predictions.end(rank, s, how) {
                    ended.push(s);
                }
                previous = Some(s);
            }
            // A device store took the place of the predicted entries it found (the index's
            // adoption); only what it did not adopt is left to remove.
            if ended.len() as u64 > outcome.adopted_predictions {
                index.apply(rank, &removal(ended));
            }
            outcome
        }
        KvEvent::Removed { engine_hashes, .. } => {
            let named: Vec<u64> = engine_hashes
                .iter()
                .filter_map(|&h| index.sequence_hash_of(rank, h))
                .filter(|&s| predictions.is_predicted(rank, s))
                .collect();
            let outcome = index.apply(rank, event);
            let ended: Vec<u64> = named
                .into_iter()
                .filter(|&s| predictions.end(rank, s, End::Withdrawn))
                .collect();
            if !ended.is_empty() {
                index.apply(rank, &removal(ended));
            }
            outcome
        }
        KvEvent::Cleared => {
            // The index clears the predicted entries with the rest.
            let outcome = index.apply(rank, event);
            predictions.forget(|r| r == rank);
            outcome
        }
    }
}

impl Selector {
    /// The prediction settings.
    pub fn predict_config(&self) -> PredictConfig {
        self.config.predict
    }

    /// Running counts of predicted blocks by outcome (for metrics).
    pub fn prediction_counters(&self) -> PredictionCounters {
        locked(&self.predictions).counters()
    }

    /// Blocks predicted and not yet confirmed, withdrawn or expired (all ranks).
    pub fn predicted_blocks(&self) -> usize {
        locked(&self.predictions).len()
    }

    /// Whether bookings made under a shared borrow wait to be recorded.
    pub fn has_queued_predictions(&self) -> bool {
        self.predictions_queued.load(Ordering::Relaxed)
    }

    /// Queues the prediction of a booking of `rank` (recorded by [`Self::settle_predictions`]).
    pub(super) fn queue_prediction(
        &self,
        rank: Rank,
        local: &Arc<[u64]>,
        sequence: &Arc<[u64]>,
        booking: &str,
        now: Instant,
    ) {
        if !self.config.predict.enabled() {
            return;
        }
        let from = self.prefill_starts_at(booking, now);
        if locked(&self.predictions).queue(rank, local, sequence, from) {
            self.predictions_queued.store(true, Ordering::Relaxed);
        }
    }

    /// When the prefill of a booking just made is predicted to start: after the prefill queued
    /// ahead of it on its rank, at the current speeds (`crate::speed`); `now` on an idle rank. A
    /// prediction's TTL runs from then, so a prompt waiting in a long prefill queue (a saturated
    /// prefill pool) stays visible where it will be computed. Takes the load tracker's mutex
    /// alone, before the predictions'.
    fn prefill_starts_at(&self, booking: &str, now: Instant) -> Instant {
        let load = locked(&self.load);
        // An idle rank, the common case, reads no speeds.
        let Some(ahead) = load
            .booking(booking)
            .map(|b| b.prefill_tokens_ahead)
            .filter(|&ahead| ahead > 0)
        else {
            return now;
        };
        let ms = load.speeds(None).prefill_ms(ahead as f64);
        // At most the longest TTL a user may set, so a wild estimate cannot pin a guess.
        let wait = Duration::from_secs_f64((ms / 1000.0).clamp(0.0, 600.0));
        now.checked_add(wait).unwrap_or(now)
    }

    /// Predicts a booking's prompt on `rank` under an exclusive borrow: recorded at once.
    pub(super) fn predict_booking(
        &mut self,
        rank: Rank,
        local: &Arc<[u64]>,
        sequence: &Arc<[u64]>,
        booking: &str,
        now: Instant,
    ) {
        self.queue_prediction(rank, local, sequence, booking, now);
        self.settle_predictions();
    }

    /// Records the queued predictions in the index (module doc, "When it is recorded").
    pub fn settle_predictions(&mut self) {
        if !*self.predictions_queued.get_mut() {
            return;
        }
        *self.predictions_queued.get_mut() = false;
        let queued = exclusive(&mut self.predictions).take_queued();
        for q in queued {
            self.record_prediction(&q);
        }
        let over = exclusive(&mut self.predictions).take_over_cap();
        self.remove_predicted(over);
    }

    /// Records what one booking predicts: the prompt's blocks the rank holds neither on the
    /// device nor predicted, as runs under the block before each.
    fn record_prediction(&mut self, q: &Queued) {
        let Some(record) = self.workers.get(&q.rank.worker_id) else {
            return;
        };
        if record.lifecycle != Lifecycle::Schedulable
            || !record.spec.dp_ranks().contains(&q.rank.dp_rank)
            || self.model_of(record).is_some()
        {
            return;
        }
        let Some(partition) = self.partitions.get_mut(&record.spec.partition()) else {
            return;
        };
        let index = &mut partition.index;
        let predictions = exclusive(&mut self.predictions);
        let rank = q.rank;
        // Usually the rank holds a prefix (really or predicted) and none of the rest; the index
        // skips any other block it holds on the device.
        let start = index.held_prefix(rank, &q.sequence, Tier::Device);
        if start == q.sequence.len() {
            return;
        }
        let blocks: Vec<(u64, StoredBlock)> = q.sequence[start..]
            .iter()
            .zip(&q.local[start..])
            .map(|(&s, &local_hash)| {
                let engine_hash = predicted_engine_hash(s);
                (
                    s,
                    StoredBlock {
                        engine_hash,
                        local_hash,
                    },
                )
            })
            .collect();
        let parent = start.checked_sub(1).map(|p| q.sequence[p]);
        let mut stored = Vec::with_capacity(blocks.len());
        index.store_at(rank, parent, &blocks, Tier::Device, &mut stored);
        for s in stored {
            // A record whose entry the index's cap evicted keeps its deadline.
            if !predictions.is_predicted(rank, s) {
                predictions.record(rank, s, q.at);
            }
        }
    }

    /// Removes the index entries of predictions whose records have ended.
    fn remove_predicted(&mut self, mut ended: Vec<(Rank, u64)>) {
        if ended.is_empty() {
            return;
        }
        ended.sort_unstable();
        for group in ended.chunk_by(|a, b| a.0 == b.0) {
            let rank = group[0].0;
            let event = removal(group.iter().map(|&(_, s)| s));
            self.apply_rank_events(rank, std::slice::from_ref(&event));
        }
    }

    /// Expires the predictions due at `now` (the queue recorded first).
    pub(super) fn expire_predictions(&mut self, now: Instant) {
        self.settle_predictions();
        let due = exclusive(&mut self.predictions).take_due(now);
        self.remove_predicted(due);
    }

    /// Withdraws a worker's predictions after its blocks left the index (re-registration with
    /// other events, ranks or partition; deletion).
    pub(super) fn forget_worker_predictions(&mut self, worker_id: WorkerId) {
        exclusive(&mut self.predictions).forget(|r| r.worker_id == worker_id);
    }

    /// Applies KV events of a rank to the index, ending the predictions they name.
    pub(super) fn apply_with_predictions(
        index: &mut RadixIndex,
        predictions: &mut Predictions,
        rank: Rank,
        events: &[KvEvent],
    ) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        for (i, event) in events.iter().enumerate() {
            if !predictions.has_rank(rank) {
                outcome.merge(&index.apply_all(rank, &events[i..]));
                break;
            }
            outcome.merge(&apply_event(index, predictions, rank, event));
        }
        outcome
    }
}
