//! The selector: one state machine for select / reserve / lifecycle over a catalog of partitions.
//! The HTTP service, the Python binding and the simulator call only this API (SPEC §5–§8).
//!
//! ## State
//! - a worker catalog (`worker_id` → spec, lifecycle, partition);
//! - per partition `(model_name, routing_group)`: the radix index of engine-reported blocks and the
//!   set of its workers; a partition disappears with its last worker (bounded state);
//! - one [`LoadTracker`] for the whole service (reservation ids are unique service-wide), the LRU
//!   cache model and the pending-selection cache (SPEC §8), each behind a mutex of its own.
//!
//! ## Where each part lives
//! | file | concern |
//! |---|---|
//! | `mod.rs` | the [`Selector`] and its configuration, shutdown, periodic [`Selector::tick`] |
//! | `types.rs` | request and reply types ([`WorkerSpec`], [`SelectRequest`], [`Selection`], …) |
//! | `catalog.rs` | workers and partitions: upsert, delete, lists, readiness, block sizes |
//! | `events.rs` | engines' KV events and the approximate cache models of ranks without them |
//! | `select.rs` | candidates, scoring and the pick: `select`, `select_and_reserve` |
//! | `disagg.rs` | disaggregated prefill/decode: a prefill and a decode pick, or a bypass |
//! | `constraints.rs` | a request's required taints (a filter) and preferred taints (a cost factor) |
//! | `reservations.rs` | bookings and their lifecycle calls ([`LifecycleCalls`]) |
//! | `inspect.rs` | read-only views: `/loads`, `/potential_loads`, `/overlap_scores`, `/dump` |
//! | `sync.rs` | bookings shared between replicas (SPEC §10) |
//! | `predict.rs` | predict-on-route: a booked prompt held on its rank until its events come |
//! | `sessions.rs` | session affinity: bindings of sessions to ranks, their TTL, the preferred pick |
//! | `engine_load.rs` | load the engines report (`/metrics`), raising the booked load while fresh |
//!
//! ## Lock discipline
//! The selector is plain data. An edge that serves concurrent requests wraps it in one
//! `parking_lot::RwLock`. The read lock serves the queries (`select`, `overlap_scores`,
//! `potential_loads`, `loads`, …) and, through [`LifecycleCalls`], the hot lifecycle calls:
//! those only change the load tracker, the LRU model's clocks and the pending cache, each under
//! its own short mutex, so a booking neither waits for a selection's index walk nor for another
//! booking's. A call that would change an approximate cache model's blocks (a rank without KV
//! events) finds so before changing anything and is made again under the write lock, which
//! also serves worker changes and KV events. That protocol lives in one place
//! (`reservations.rs`); a caller writes `lock.free(id)` or `selector.free(id)` alike.
//!
//! Inner mutexes are taken in one order — load tracker, engine reports, LRU model, pending
//! cache, session table — and never
//! while waiting for the selector's lock; the queue of predictions (`predict.rs`), which a
//! booking under the shared lock fills because it cannot change the index, is taken alone.
//! Whoever next holds the selector exclusively records it first. Prompts are hashed by the edge
//! before it takes any lock ([`Prompt::Hashes`]), so the critical sections are the index lookup,
//! the scoring and the booking. A replay peeks, books and removes its pending entry while
//! holding the load tracker's mutex, so two concurrent replays of one selection book at most once
//! and the second one finds no entry.

use crate::approx::{CachePolicy, LruConfig, LruModel, TtlConfig, TtlModel};
use crate::error::{Error, PartitionKey};
use crate::event::WorkerId;
use crate::index::{IndexConfig, RadixIndex};
use crate::load::LoadTracker;
use crate::pending::{PendingCache, PendingConfig};
use crate::schedule::{RouterProfile, SchedulerConfig};
use hashbrown::HashMap;
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod catalog;
mod constraints;
mod disagg;
mod engine_load;
mod events;
mod fleet;
mod inspect;
mod predict;
mod reservations;
mod select;
mod sessions;
mod sync;
mod types;

pub use catalog::check_zmq_endpoint;
pub use constraints::RoutingConstraints;
pub use disagg::{DECODE_LEG_SUFFIX, PREFILL_LEG_SUFFIX};
pub use engine_load::{DEFAULT_ENGINE_LOAD_MAX_AGE, EngineLoad};
pub use predict::{
    DEFAULT_MAX_PREDICTED_BLOCKS, DEFAULT_PREDICTED_TTL, PredictConfig, PredictionCounters,
};
pub use reservations::LifecycleCalls;
pub use sessions::{
    DEFAULT_MAX_SESSIONS, DEFAULT_SOFT_FACTOR, MAX_SESSION_ID_BYTES, SessionChoice, SessionConfig,
    SessionCounters, SessionKey, SessionMode, SessionSelection, SessionTable, SyncedBinding,
};
pub use sync::{BookingOwner, ReplicaSpread, SyncApplyError, SyncApplyOutcome, SyncedBooking};
pub use types::*;
// Defined beside the queue threshold that reads it, so `admission` needs nothing from here.
pub use crate::admission::UNKNOWN_PREFILL_CAPACITY;

/// The default [`SelectorConfig::pd_bypass_tokens`]: llm-d's threshold for skipping the prefill
/// worker.
pub const DEFAULT_PD_BYPASS_TOKENS: u64 = 8;

/// Everything the selector can be configured with. `Default` is the default
/// [`RouterProfile`]'s configuration, the one every edge starts from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SelectorConfig {
    pub scheduler: SchedulerConfig,
    pub pending: PendingConfig,
    pub index: IndexConfig,
    /// A booking with no lifecycle call for this long is freed by [`Selector::tick`]; also the
    /// LRU model's lease-reaper scan interval.
    pub active_request_expiry: Duration,
    /// The approximate cache model for ranks without KV events (SPEC §9).
    pub approximate_policy: CachePolicy,
    /// Ignore engines' KV events: every rank's cache is predicted by the approximate model.
    pub no_kv_events: bool,
    /// The TTL model's settings (per partition).
    pub ttl: TtlConfig,
    /// Predict-on-route for ranks with KV events (`predict.rs`).
    pub predict: PredictConfig,
    /// Session affinity (`sessions.rs`); off by default.
    pub sessions: SessionConfig,
    /// The admission queue's threshold (`crate::admission`), when the service queues: a rank
    /// is full above this × its `max_num_batched_tokens` of active prefill, so a worker must
    /// state that capacity to be schedulable (as Dynamo requires while queueing).
    pub queue_threshold: Option<f64>,
    /// An engine's load report (`engine_load.rs`) corrects the booked load while at most this
    /// old; older ones are ignored.
    pub engine_load_max_age: Duration,
    /// A disaggregated request whose best decode/both worker lacks at most this many of its
    /// prompt's tokens runs there whole, without a prefill worker (`disagg.rs`).
    pub pd_bypass_tokens: u64,
}

impl Default for SelectorConfig {
    fn default() -> Self {
        Self {
            scheduler: SchedulerConfig::default(),
            pending: PendingConfig::default(),
            index: IndexConfig::default(),
            active_request_expiry: Duration::from_secs(300),
            approximate_policy: CachePolicy::Ttl,
            no_kv_events: false,
            ttl: TtlConfig::default(),
            predict: PredictConfig::default(),
            sessions: SessionConfig::default(),
            queue_threshold: None,
            engine_load_max_age: engine_load::DEFAULT_ENGINE_LOAD_MAX_AGE,
            pd_bypass_tokens: DEFAULT_PD_BYPASS_TOKENS,
        }
    }
}

impl SelectorConfig {
    /// A profile's configuration: its scheduler ([`SchedulerConfig::for_profile`]) and its
    /// prediction on route ([`PredictConfig::for_profile`]), the rest as
    /// [`SelectorConfig::default`].
    pub fn for_profile(profile: RouterProfile) -> Self {
        Self {
            scheduler: SchedulerConfig::for_profile(profile),
            predict: PredictConfig::for_profile(profile),
            ..Self::default()
        }
    }
}

/// One partition: its index, its workers and the TTL model of its ranks without events.
#[derive(Debug)]
struct Partition {
    index: RadixIndex,
    workers: BTreeSet<WorkerId>,
    /// Predicted caches of this partition's TTL-modelled ranks.
    ttl: TtlModel,
}

/// The selector. See the module documentation.
#[derive(Debug)]
pub struct Selector {
    config: SelectorConfig,
    /// Predicted caches of LRU-modelled ranks (service-wide, like reservation ids).
    lru: Mutex<LruModel>,
    workers: HashMap<WorkerId, WorkerRecord>,
    partitions: BTreeMap<PartitionKey, Partition>,
    load: Mutex<LoadTracker>,
    pending: Mutex<PendingCache<PendingSelection>>,
    /// Predicted blocks of ranks with KV events, and bookings waiting to predict.
    predictions: Mutex<predict::Predictions>,
    /// Whether `predictions` has bookings waiting (read without its mutex).
    predictions_queued: AtomicBool,
    /// Session bindings (`sessions.rs`).
    sessions: Mutex<SessionTable>,
    /// The engines' latest load reports (`engine_load.rs`).
    engine_loads: Mutex<engine_load::EngineLoads>,
    /// Whether any engine ever reported its load: until one does, a select never takes
    /// `engine_loads`'s mutex (polling is opt-in).
    engine_loads_reported: AtomicBool,
    /// This replica's id among replicas sharing bookings, and its place among the live ones
    /// (`sync.rs`).
    replica: Option<(String, Option<ReplicaSpread>)>,
    /// Bumped by every catalog change; the rank orders (`fleet.rs`) are rebuilt after one.
    catalog_version: u64,
    /// Each partition's ranks in candidate order, for selects that need not scan them.
    rank_orders: Mutex<fleet::RankOrders>,
    shutting_down: bool,
}

impl Default for Selector {
    fn default() -> Self {
        Self::new(SelectorConfig::default())
    }
}

/// Locks one of the selector's inner mutexes. A panic while one was held cannot leave its
/// state inconsistent in a way that matters more than refusing service, so a poisoned lock is
/// simply taken over.
fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// An inner mutex's state through `&mut self` (no locking needed).
fn exclusive<T>(mutex: &mut Mutex<T>) -> &mut T {
    mutex.get_mut().unwrap_or_else(|e| e.into_inner())
}

/// A UUID v4 string from the injected random source.
pub fn random_uuid(rng: &mut impl Rng) -> String {
    let mut b: [u8; 16] = rng.random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

impl Selector {
    pub fn new(config: SelectorConfig) -> Self {
        Self {
            config,
            lru: Mutex::new(LruModel::new(LruConfig {
                scan_interval: config.active_request_expiry,
            })),
            workers: HashMap::new(),
            partitions: BTreeMap::new(),
            load: Mutex::new({
                let mut load = LoadTracker::new();
                load.set_engine_prior(config.scheduler.engine);
                load
            }),
            pending: Mutex::new(PendingCache::new(config.pending)),
            predictions: Mutex::new(predict::Predictions::new(config.predict)),
            predictions_queued: AtomicBool::new(false),
            sessions: Mutex::new(SessionTable::new(
                config.sessions.ttl.unwrap_or_default(),
                config.sessions.max_sessions,
            )),
            engine_loads: Mutex::new(HashMap::new()),
            engine_loads_reported: AtomicBool::new(false),
            replica: None,
            catalog_version: 0,
            rank_orders: Mutex::new(fleet::RankOrders::default()),
            shutting_down: false,
        }
    }

    pub fn config(&self) -> &SelectorConfig {
        &self.config
    }

    /// The load tracker (held locked while the guard lives).
    pub fn load_tracker(&self) -> MutexGuard<'_, LoadTracker> {
        locked(&self.load)
    }

    pub(super) fn pending(&self) -> MutexGuard<'_, PendingCache<PendingSelection>> {
        locked(&self.pending)
    }

    /// Entries and approximate bytes of the pending-selection cache.
    pub fn pending_stats(&self) -> (usize, u64) {
        let pending = self.pending();
        (pending.len(), pending.bytes())
    }

    /// Running eviction counters of the pending-selection cache.
    pub fn pending_counters(&self) -> crate::pending::PendingCounters {
        *self.pending().counters()
    }

    pub(super) fn check_running(&self) -> Result<(), Error> {
        if self.shutting_down {
            Err(Error::ShuttingDown)
        } else {
            Ok(())
        }
    }

    /// After this every operation that changes or reads routing state fails with 503.
    pub fn shutdown(&mut self) {
        self.shutting_down = true;
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down
    }

    /// Periodic housekeeping: frees bookings idle for `active_request_expiry`, expires predicted
    /// blocks past their TTL, purges expired cached selections and session bindings.
    pub fn tick(&mut self, now: Instant) -> TickOutcome {
        self.expire_predictions(now);
        let expired = exclusive(&mut self.load).expire(now, self.config.active_request_expiry);
        for booking in &expired {
            self.release_lease(&booking.reservation_id);
            self.release_session(&booking.reservation_id, now);
        }
        if self.config.sessions.enabled() {
            exclusive(&mut self.sessions).expire(now);
        }
        let mut ttl_events = Vec::new();
        for p in self.partitions.values_mut() {
            ttl_events.extend(p.ttl.expire(now).events);
        }
        self.apply_ranked_events(&ttl_events);
        let reaped = exclusive(&mut self.lru).reap(now);
        self.apply_ranked_events(&reaped.events);
        let expired_selections = self.pending().purge_expired(now);
        self.refresh_replica_spread();
        TickOutcome {
            expired_reservations: expired
                .into_iter()
                .map(|f| f.reservation_id.to_string())
                .collect(),
            expired_selections,
        }
    }
}

#[cfg(test)]
mod tests;
