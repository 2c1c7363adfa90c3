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
//! ## Lock discipline
//! The selector is plain data. An edge that serves concurrent requests wraps it in one
//! `RwLock`. The read lock serves the queries (`select`, `overlap_scores`, `potential_loads`,
//! `loads`, …) *and* the hot lifecycle calls in their `*_shared` forms
//! ([`Selector::create_reservation_shared`], [`Selector::prefill_complete_shared`],
//! [`Selector::output_block_shared`], [`Selector::free_shared`]): those only change the load
//! tracker, the LRU model's clocks and the pending cache, each under its own short mutex, so a
//! booking neither waits for a selection's index walk nor for another booking's. A call that
//! would change an approximate cache model's blocks (a rank without KV events) answers
//! [`Shared::Exclusive`] before changing anything, and the edge repeats it with the exclusive
//! (`&mut self`) method under the write lock, which also serves worker changes and KV events.
//!
//! Inner mutexes are taken in one order — load tracker, LRU model, pending cache — and never
//! while waiting for the selector's lock. Prompts are hashed by the edge before it takes any
//! lock ([`Prompt::Hashes`]), so the critical sections are the index lookup, the scoring and the
//! booking. A replay peeks, books and removes its pending entry while holding the load tracker's
//! mutex (exclusively, or through `&mut self`), so two concurrent replays of one selection book
//! at most once and the second one finds no entry.

use crate::approx::{
    ApproxError, CachePolicy, LruConfig, LruModel, LruStats, RankModel, TtlConfig, TtlModel,
    rank_model,
};
use crate::error::{Error, PartitionKey, check_id};
use crate::event::{KvEvent, Rank, WorkerId};
use crate::hash::{PromptHashes, seed_for};
use crate::index::{ApplyOutcome, IndexConfig, RadixIndex, RankOverlap};
use crate::load::{Booking, LoadTracker, RankLoad};
use crate::pending::{PendingCache, PendingConfig, PendingKey};
use crate::schedule::{Candidate, Overrides, SchedulerConfig, effective_prefill_tokens, pick};
use hashbrown::HashMap;
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Prefill capacity reported for a worker whose `max_num_batched_tokens` is unknown (as Dynamo).
pub const UNKNOWN_PREFILL_CAPACITY: u64 = 10_000_000;

/// Everything the selector can be configured with.
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
        }
    }
}

/// A worker as registered (`POST /workers`). Optional fields stay optional so the record can
/// echo what the client sent.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WorkerSpec {
    pub worker_id: WorkerId,
    pub model_name: String,
    pub routing_group: String,
    pub endpoint: Option<String>,
    pub block_size: Option<u32>,
    pub data_parallel_start_rank: Option<u32>,
    pub data_parallel_size: Option<u32>,
    pub total_kv_blocks: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
    pub kv_events_endpoint: Option<String>,
    /// Global dp rank → ZMQ address.
    pub kv_events_endpoints: BTreeMap<u32, String>,
    pub replay_endpoint: Option<String>,
}

impl WorkerSpec {
    pub fn partition(&self) -> PartitionKey {
        PartitionKey::new(&self.model_name, &self.routing_group)
    }

    pub fn dp_start(&self) -> u32 {
        self.data_parallel_start_rank.unwrap_or(0)
    }

    pub fn dp_size(&self) -> u32 {
        self.data_parallel_size.unwrap_or(1)
    }

    /// The worker's dp ranks.
    pub fn dp_ranks(&self) -> std::ops::Range<u32> {
        let start = self.dp_start();
        start..start.saturating_add(self.dp_size())
    }

    /// The KV-event endpoint of each rank that publishes events.
    pub fn event_endpoints(&self) -> Vec<(u32, String)> {
        if !self.kv_events_endpoints.is_empty() {
            return self
                .kv_events_endpoints
                .iter()
                .map(|(&r, a)| (r, a.clone()))
                .collect();
        }
        match &self.kv_events_endpoint {
            Some(addr) if !addr.is_empty() => vec![(self.dp_start(), addr.clone())],
            _ => Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    Schedulable,
    Incomplete,
    Unschedulable,
}

impl Lifecycle {
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Schedulable => "schedulable",
            Lifecycle::Incomplete => "incomplete",
            Lifecycle::Unschedulable => "unschedulable",
        }
    }
}

/// A catalog record: the spec plus whether the worker can take work, and why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRecord {
    pub spec: WorkerSpec,
    pub lifecycle: Lifecycle,
    pub not_schedulable_reasons: Vec<String>,
}

/// What an upsert changed, so the edge can (re)start or stop KV-event listeners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpsertOutcome {
    pub record: WorkerRecord,
    /// The worker's event endpoints, ranks, partition or lifecycle changed (or it is new): its
    /// listeners must be restarted and its index entries were dropped.
    pub events_changed: bool,
}

/// A prompt as a request carries it.
#[derive(Debug, Clone, Copy)]
pub enum Prompt<'a> {
    /// Token ids, hashed with the partition's (or worker's) block size.
    Tokens {
        tokens: &'a [u32],
        lora_name: Option<&'a str>,
        cache_salt: Option<&'a str>,
    },
    /// Already hashed (by the client, or by the edge before taking the lock).
    Hashes(&'a PromptHashes),
}

impl Prompt<'_> {
    fn hash(&self, block_size: u32) -> Result<std::borrow::Cow<'_, PromptHashes>, Error> {
        match *self {
            Prompt::Tokens {
                tokens,
                lora_name,
                cache_salt,
            } => {
                if tokens.is_empty() {
                    return Err(Error::EmptyTokenIds);
                }
                Ok(std::borrow::Cow::Owned(PromptHashes::from_tokens(
                    tokens,
                    block_size as usize,
                    seed_for(lora_name, cache_salt),
                )))
            }
            Prompt::Hashes(h) => {
                validate_hashes(h)?;
                Ok(std::borrow::Cow::Borrowed(h))
            }
        }
    }
}

/// Checks client-supplied hashes: equal lengths, `isl_tokens > 0`.
pub fn validate_hashes(h: &PromptHashes) -> Result<(), Error> {
    if h.local.len() != h.sequence.len() {
        return Err(Error::HashLengthMismatch {
            block_hashes: h.local.len(),
            sequence_hashes: h.sequence.len(),
        });
    }
    if h.isl_tokens == 0 {
        return Err(Error::ZeroIsl);
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedWorker {
    pub worker_id: WorkerId,
    pub dp_rank: Option<u32>,
}

/// `POST /select` (and the selection half of `select_and_reserve`).
#[derive(Debug, Clone, Copy)]
pub struct SelectRequest<'a> {
    pub partition: &'a PartitionKey,
    pub selection_id: Option<&'a str>,
    pub prompt: Prompt<'a>,
    /// The LoRA adapter, remembered with a cached selection.
    pub lora_name: Option<&'a str>,
    pub expected_output_tokens: Option<u64>,
    pub overrides: Overrides,
    pub pinned_worker: Option<PinnedWorker>,
    pub allowed_worker_ids: Option<&'a [WorkerId]>,
    pub advisory: bool,
}

impl<'a> SelectRequest<'a> {
    pub fn new(partition: &'a PartitionKey, prompt: Prompt<'a>) -> Self {
        Self {
            partition,
            selection_id: None,
            prompt,
            lora_name: None,
            expected_output_tokens: None,
            overrides: Overrides::default(),
            pinned_worker: None,
            allowed_worker_ids: None,
            advisory: false,
        }
    }
}

/// The chosen rank's overlap, in tokens, per cumulative tier.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OverlapTokens {
    pub longest_matched: u64,
    pub gpu: u64,
    pub cpu: u64,
    pub disk: u64,
    /// Device overlap tokens of every rank of the chosen worker.
    pub dp: Vec<(u32, u64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerLoad {
    pub active_prefill_tokens: u64,
    pub prefill_token_capacity: u64,
    pub total_kv_blocks: Option<u64>,
}

/// The answer of `select`.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub selection_id: Option<String>,
    pub partition: PartitionKey,
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    pub endpoint: String,
    pub block_size: u32,
    pub overlap: OverlapTokens,
    pub effective_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub worker_load: Option<WorkerLoad>,
    /// Whether a booking of this selection tracks prefill tokens.
    pub track_prefill_tokens: bool,
    pub local_hashes: Arc<[u64]>,
    pub sequence_hashes: Arc<[u64]>,
    pub isl_tokens: u64,
}

/// What a selection caches for its replay (SPEC §7.2).
#[derive(Debug, Clone, PartialEq)]
pub struct PendingSelection {
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    /// Local hashes, needed to predict the cache of a rank without KV events.
    pub local_hashes: Arc<[u64]>,
    pub sequence_hashes: Arc<[u64]>,
    pub isl_tokens: u64,
    pub effective_prefill_tokens: u64,
    pub expected_output_tokens: Option<u64>,
    pub track_prefill_tokens: bool,
    pub lora_name: Option<String>,
}

/// `POST /reservations`.
#[derive(Debug, Clone, Copy)]
pub struct ReservationRequest<'a> {
    pub partition: &'a PartitionKey,
    pub selection_id: Option<&'a str>,
    pub reservation_id: Option<&'a str>,
    pub worker_id: Option<WorkerId>,
    pub dp_rank: Option<u32>,
    pub prompt: Option<Prompt<'a>>,
    pub effective_prefill_tokens: Option<u64>,
    pub expected_output_tokens: Option<u64>,
    pub track_prefill_tokens: Option<bool>,
    pub overrides: Overrides,
}

impl<'a> ReservationRequest<'a> {
    /// A replay of the selection cached under `selection_id`.
    pub fn replay(partition: &'a PartitionKey, selection_id: &'a str) -> Self {
        Self {
            partition,
            selection_id: Some(selection_id),
            reservation_id: None,
            worker_id: None,
            dp_rank: None,
            prompt: None,
            effective_prefill_tokens: None,
            expected_output_tokens: None,
            track_prefill_tokens: None,
            overrides: Overrides::default(),
        }
    }
}

/// A booking that landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub reservation_id: String,
    pub selection_id: Option<String>,
    pub partition: PartitionKey,
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    pub endpoint: String,
}

/// One rank's load as `/loads` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankLoadReport {
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u64,
    /// How the rank's cache is known (in `/loads` only).
    pub cache_model: Option<CacheModelReport>,
}

/// How a rank's cache is known: from its engine's KV events, or predicted (SPEC §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheModelReport {
    /// The engine's KV events feed the index.
    Events,
    /// The TTL model predicts it; `blocks` are currently predicted.
    Ttl { blocks: u64 },
    /// The capacity-bounded LRU model predicts it.
    Lru(LruStats),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionLoads {
    pub partition: PartitionKey,
    pub loads: Vec<RankLoadReport>,
    /// Requests queued by the router. kvroute never queues (busy ranks answer 429), so 0.
    pub pending_count: u64,
    pub pending_isl_tokens: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankOverlapScore {
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    pub device_blocks: u32,
    pub host_pinned_blocks: u32,
    pub disk_blocks: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlapScores {
    pub block_size: u32,
    pub num_blocks: usize,
    pub workers: Vec<RankOverlapScore>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyState {
    pub ready: bool,
    pub schedulable_workers: usize,
    pub workers: Vec<WorkerRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionDump {
    pub partition: PartitionKey,
    pub block_size: Option<u32>,
    pub events: Vec<(Rank, KvEvent)>,
}

/// What a periodic [`Selector::tick`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TickOutcome {
    pub expired_reservations: Vec<String>,
    pub expired_selections: usize,
}

/// Ranks with a non-zero overlap, sorted by rank for lookups by binary search (cheaper than
/// building a hash map of up to every rank on every select).
struct Overlaps(Vec<RankOverlap>);

impl Overlaps {
    fn get(&self, rank: &Rank) -> Option<&RankOverlap> {
        self.0
            .binary_search_by_key(rank, |o| o.rank)
            .ok()
            .map(|i| &self.0[i])
    }
}

#[derive(Debug)]
struct Partition {
    index: RadixIndex,
    workers: BTreeSet<WorkerId>,
    /// Predicted caches of this partition's TTL-modelled ranks.
    ttl: TtlModel,
}

/// A replay checked and ready to book ([`Selector::plan_replay`]).
struct ReplayPlan {
    booking: Booking,
    reservation: Reservation,
    /// The rank's cache is modelled (no KV events): booking it changes the model too.
    modelled: bool,
    rank: Rank,
    key: PendingKey,
    generation: u64,
    entry: Arc<PendingSelection>,
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
    shutting_down: bool,
}

impl Default for Selector {
    fn default() -> Self {
        Self::new(SelectorConfig::default())
    }
}

/// The booking ids a reservation request names, checked as ids before anything else.
fn check_reservation_ids(req: &ReservationRequest<'_>) -> Result<(), Error> {
    for (field, value) in [
        ("selection_id", req.selection_id),
        ("reservation_id", req.reservation_id),
    ] {
        if let Some(v) = value {
            sync::check_booking_id(field, v)?;
        }
    }
    Ok(())
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

/// The outcome of a lifecycle call made under the shared (read) lock.
#[derive(Debug, Clone, PartialEq)]
#[must_use]
pub enum Shared<T> {
    /// Done, exactly as the exclusive method would have done it.
    Done(T),
    /// The call would change an approximate cache model's blocks: nothing was changed; make it
    /// again with the exclusive method under the write lock.
    Exclusive,
}

/// Checks a ZMQ address: `tcp://host:port`, `ipc://path` or `inproc://name`.
pub fn check_zmq_endpoint(addr: &str) -> Result<(), String> {
    let Some((scheme, rest)) = addr.split_once("://") else {
        return Err(format!("invalid ZMQ endpoint `{addr}`: missing scheme"));
    };
    match scheme {
        "tcp" => {
            let Some((host, port)) = rest.rsplit_once(':') else {
                return Err(format!("invalid ZMQ endpoint `{addr}`: missing port"));
            };
            if host.is_empty() {
                return Err(format!("invalid ZMQ endpoint `{addr}`: missing host"));
            }
            if port != "*" && port.parse::<u16>().is_err() {
                return Err(format!(
                    "invalid ZMQ endpoint `{addr}`: invalid port `{port}`"
                ));
            }
            Ok(())
        }
        "ipc" | "inproc" if !rest.is_empty() => Ok(()),
        "ipc" | "inproc" => Err(format!("invalid ZMQ endpoint `{addr}`: missing path")),
        other => Err(format!(
            "invalid ZMQ endpoint `{addr}`: unsupported scheme `{other}`"
        )),
    }
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

fn ceil_blocks(isl_tokens: u64, block_size: u32) -> u64 {
    isl_tokens.div_ceil(u64::from(block_size.max(1)))
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
            load: Mutex::new(LoadTracker::new()),
            pending: Mutex::new(PendingCache::new(config.pending)),
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

    fn pending(&self) -> MutexGuard<'_, PendingCache<PendingSelection>> {
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

    fn check_running(&self) -> Result<(), Error> {
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

    // ------------------------------------------------------------------------------------------
    // Catalog

    fn reasons_for(&self, spec: &WorkerSpec) -> Vec<String> {
        let mut reasons = Vec::new();
        if spec.endpoint.as_deref().is_none_or(str::is_empty) {
            reasons.push("endpoint is required".to_string());
        }
        match spec.block_size {
            None | Some(0) => reasons.push("block_size must be greater than 0".to_string()),
            Some(bs) => {
                let partition = spec.partition();
                if let Some(existing) =
                    self.partition_block_size_excluding(&partition, spec.worker_id)
                    && existing != bs
                {
                    reasons.push(format!(
                        "block_size mismatch for {partition}: existing={existing} requested={bs}"
                    ));
                }
            }
        }
        if spec.dp_size() == 0 {
            reasons.push("data_parallel_size must be greater than 0".to_string());
        }
        let ranks = spec.dp_ranks();
        if spec.kv_events_endpoints.is_empty() {
            if let Some(addr) = spec.kv_events_endpoint.as_deref().filter(|a| !a.is_empty()) {
                if spec.dp_size() > 1 {
                    for r in ranks.clone().skip(1) {
                        reasons.push(format!("kv_events endpoint is required for dp_rank {r}"));
                    }
                }
                if let Err(e) = check_zmq_endpoint(addr) {
                    reasons.push(format!(
                        "invalid kv_events endpoint for worker {} dp_rank {}: {e}",
                        spec.worker_id,
                        spec.dp_start()
                    ));
                }
            }
        } else {
            for r in ranks.clone() {
                if !spec.kv_events_endpoints.contains_key(&r) {
                    reasons.push(format!("kv_events endpoint is required for dp_rank {r}"));
                }
            }
            for (r, addr) in &spec.kv_events_endpoints {
                if !ranks.contains(r) {
                    reasons.push(format!(
                        "kv_events endpoint for dp_rank {r} is outside the worker's ranks {}..{}",
                        ranks.start, ranks.end
                    ));
                } else if let Err(e) = check_zmq_endpoint(addr) {
                    reasons.push(format!(
                        "invalid kv_events endpoint for worker {} dp_rank {r}: {e}",
                        spec.worker_id
                    ));
                }
            }
        }
        if let Some(replay) = spec.replay_endpoint.as_deref().filter(|a| !a.is_empty()) {
            if spec.dp_size() > 1 {
                reasons
                    .push("replay_endpoint is supported only for data_parallel_size 1".to_string());
            }
            if let Err(e) = check_zmq_endpoint(replay) {
                reasons.push(format!(
                    "invalid replay_endpoint for worker {}: {e}",
                    spec.worker_id
                ));
            }
        }
        reasons
    }

    /// The block size of the schedulable workers of a partition other than `worker_id`.
    fn partition_block_size_excluding(
        &self,
        partition: &PartitionKey,
        worker_id: WorkerId,
    ) -> Option<u32> {
        let p = self.partitions.get(partition)?;
        p.workers
            .iter()
            .filter(|&&w| w != worker_id)
            .filter_map(|w| self.workers.get(w))
            .filter(|r| r.lifecycle == Lifecycle::Schedulable)
            .find_map(|r| r.spec.block_size)
    }

    /// Registers or updates a worker (`POST /workers`). Live bookings are kept; the worker's
    /// index entries are kept when its event endpoints, ranks and partition are unchanged.
    pub fn upsert_worker(&mut self, spec: WorkerSpec) -> Result<UpsertOutcome, Error> {
        self.check_running()?;
        check_id("model_name", &spec.model_name)?;
        check_id("routing_group", &spec.routing_group)?;
        let reasons = self.reasons_for(&spec);
        let lifecycle = if reasons.is_empty() {
            Lifecycle::Schedulable
        } else {
            Lifecycle::Incomplete
        };
        let partition = spec.partition();
        let previous = self.workers.get(&spec.worker_id).cloned();
        let events_changed = match &previous {
            None => true,
            Some(old) => {
                old.spec.partition() != partition
                    || old.spec.event_endpoints() != spec.event_endpoints()
                    || old.spec.replay_endpoint != spec.replay_endpoint
                    || old.spec.dp_ranks() != spec.dp_ranks()
                    || old.spec.block_size != spec.block_size
                    || old.lifecycle != lifecycle
            }
        };
        if let Some(old) = &previous {
            let old_partition = old.spec.partition();
            if events_changed && let Some(p) = self.partitions.get_mut(&old_partition) {
                p.index.remove_worker(spec.worker_id);
            }
            if old_partition != partition {
                self.detach_from_partition(&old_partition, spec.worker_id);
            }
        }
        let index_config = self.config.index;
        let ttl_config = self.config.ttl;
        self.partitions
            .entry(partition)
            .or_insert_with(|| Partition {
                index: RadixIndex::new(index_config),
                workers: BTreeSet::new(),
                ttl: TtlModel::new(ttl_config),
            })
            .workers
            .insert(spec.worker_id);
        let record = WorkerRecord {
            spec,
            lifecycle,
            not_schedulable_reasons: reasons,
        };
        self.workers.insert(record.spec.worker_id, record.clone());
        self.sync_cache_models(&record, previous.as_ref(), events_changed);
        Ok(UpsertOutcome {
            record,
            events_changed,
        })
    }

    fn detach_from_partition(&mut self, partition: &PartitionKey, worker_id: WorkerId) {
        let ranks: Vec<Rank> = exclusive(&mut self.lru)
            .ranks()
            .filter(|r| r.worker_id == worker_id)
            .collect();
        for rank in ranks {
            exclusive(&mut self.lru).remove_rank(rank);
        }
        if let Some(p) = self.partitions.get_mut(partition) {
            for rank in p
                .index
                .ranks()
                .into_iter()
                .filter(|r| r.worker_id == worker_id)
            {
                p.ttl.remove_rank(rank);
            }
            p.workers.remove(&worker_id);
            p.index.remove_worker(worker_id);
            if p.workers.is_empty() {
                self.partitions.remove(partition);
            }
        }
    }

    /// Whether a worker's cache is predicted (it publishes no KV events, or events are off).
    fn is_modelled(&self, spec: &WorkerSpec) -> bool {
        self.config.no_kv_events || spec.event_endpoints().is_empty()
    }

    /// The model that predicts a rank's cache, or `None` when its engine's events feed the index.
    fn model_of(&self, record: &WorkerRecord) -> Option<RankModel> {
        (record.lifecycle == Lifecycle::Schedulable && self.is_modelled(&record.spec))
            .then(|| rank_model(self.config.approximate_policy, record.spec.total_kv_blocks))
    }

    /// Keeps the approximate models in step with a worker's registration (SPEC §9): a rank moving
    /// between models, or to or from KV events, starts over with an empty cache.
    fn sync_cache_models(
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
    fn apply_model_events(&mut self, partition: &PartitionKey, rank: Rank, events: &[KvEvent]) {
        if events.is_empty() {
            return;
        }
        if let Some(p) = self.partitions.get_mut(partition) {
            p.index.apply_all(rank, events);
        }
    }

    /// Predicts the cache of a booked request on a rank without KV events.
    fn model_booking(
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
            let mut attempt = exclusive(&mut self.lru).acquire(
                rank,
                reservation_id,
                local_hashes,
                sequence_hashes,
                partial,
                now,
            );
            if let Err(ApproxError::LeaseExists { .. }) = attempt {
                // A lease outlived its booking (the id was freed and booked again): start over.
                if let Some(released) = exclusive(&mut self.lru).release(reservation_id) {
                    let lease_partition = self
                        .workers
                        .get(&released.rank.worker_id)
                        .map(|r| r.spec.partition());
                    if let Some(lp) = lease_partition {
                        self.apply_model_events(&lp, released.rank, &released.events);
                    }
                }
                attempt = exclusive(&mut self.lru).acquire(
                    rank,
                    reservation_id,
                    local_hashes,
                    sequence_hashes,
                    partial,
                    now,
                );
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
    fn release_lease(&mut self, reservation_id: &str) {
        if let Some(released) = exclusive(&mut self.lru).release(reservation_id) {
            let partition = self
                .workers
                .get(&released.rank.worker_id)
                .map(|r| r.spec.partition());
            if let Some(p) = partition {
                self.apply_model_events(&p, released.rank, &released.events);
            }
        }
    }

    /// Applies `(rank, event)` pairs from a model-wide operation to each rank's partition.
    fn apply_ranked_events(&mut self, events: &[(Rank, KvEvent)]) {
        for (rank, event) in events {
            let partition = self
                .workers
                .get(&rank.worker_id)
                .map(|r| r.spec.partition());
            if let Some(p) = partition {
                self.apply_model_events(&p, *rank, std::slice::from_ref(event));
            }
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

    /// Deletes a worker: frees its bookings (their ids may be booked again), drops its blocks and
    /// returns its record with lifecycle `unschedulable`.
    pub fn delete_worker(&mut self, worker_id: WorkerId) -> Result<WorkerRecord, Error> {
        self.check_running()?;
        let Some(mut record) = self.workers.remove(&worker_id) else {
            return Err(Error::WorkerNotFound { worker_id });
        };
        let freed = exclusive(&mut self.load).free_worker(worker_id);
        for booking in &freed {
            exclusive(&mut self.lru).release(&*booking.reservation_id);
        }
        self.detach_from_partition(&record.spec.partition(), worker_id);
        record.lifecycle = Lifecycle::Unschedulable;
        record.not_schedulable_reasons = Vec::new();
        Ok(record)
    }

    pub fn worker(&self, worker_id: WorkerId) -> Option<&WorkerRecord> {
        self.workers.get(&worker_id)
    }

    /// Workers, optionally filtered, sorted by (model, group, id).
    pub fn list_workers(
        &self,
        model_name: Option<&str>,
        routing_group: Option<&str>,
    ) -> Vec<WorkerRecord> {
        let mut out: Vec<WorkerRecord> = self
            .workers
            .values()
            .filter(|r| model_name.is_none_or(|m| r.spec.model_name == m))
            .filter(|r| routing_group.is_none_or(|g| r.spec.routing_group == g))
            .cloned()
            .collect();
        out.sort_by(|a, b| {
            (&a.spec.model_name, &a.spec.routing_group, a.spec.worker_id).cmp(&(
                &b.spec.model_name,
                &b.spec.routing_group,
                b.spec.worker_id,
            ))
        });
        out
    }

    pub fn ready(&self) -> ReadyState {
        let workers = self.list_workers(None, None);
        let schedulable_workers = workers
            .iter()
            .filter(|r| r.lifecycle == Lifecycle::Schedulable)
            .count();
        ReadyState {
            ready: schedulable_workers > 0 && !self.shutting_down,
            schedulable_workers,
            workers,
        }
    }

    fn schedulable_workers<'s>(
        &'s self,
        partition: &PartitionKey,
    ) -> Result<(&'s Partition, Vec<&'s WorkerRecord>), Error> {
        let no_workers = || Error::NoSchedulableWorkers {
            partition: partition.clone(),
        };
        let p = self.partitions.get(partition).ok_or_else(no_workers)?;
        let workers: Vec<&WorkerRecord> = self.schedulable_in(p).collect();
        if workers.is_empty() {
            return Err(no_workers());
        }
        Ok((p, workers))
    }

    /// The partition's schedulable workers, in the order [`schedulable_workers`] lists them.
    ///
    /// [`schedulable_workers`]: Self::schedulable_workers
    fn schedulable_in<'s>(&'s self, p: &'s Partition) -> impl Iterator<Item = &'s WorkerRecord> {
        p.workers
            .iter()
            .filter_map(|w| self.workers.get(w))
            .filter(|r| r.lifecycle == Lifecycle::Schedulable)
    }

    /// The block size prompts of this partition are hashed with (503 without schedulable
    /// workers). Edges call it to hash token prompts before taking a write lock.
    pub fn block_size_for(&self, partition: &PartitionKey) -> Result<u32, Error> {
        // The first schedulable worker, without building the whole list.
        self.partitions
            .get(partition)
            .and_then(|p| self.schedulable_in(p).next())
            .map(|r| r.spec.block_size.unwrap_or(1))
            .ok_or_else(|| Error::NoSchedulableWorkers {
                partition: partition.clone(),
            })
    }

    /// The block size of one worker (for explicit bookings with token ids).
    pub fn worker_block_size(&self, worker_id: WorkerId) -> Option<u32> {
        self.workers.get(&worker_id).and_then(|r| r.spec.block_size)
    }

    // ------------------------------------------------------------------------------------------
    // KV events

    /// Applies KV events of one rank of a worker to its partition's index. `None` when the worker
    /// is unknown (the events are dropped; the edge counts them).
    pub fn apply_events(
        &mut self,
        worker_id: WorkerId,
        dp_rank: u32,
        events: &[KvEvent],
    ) -> Option<ApplyOutcome> {
        let record = self.workers.get(&worker_id)?;
        let partition = self.partitions.get_mut(&record.spec.partition())?;
        Some(
            partition
                .index
                .apply_all(Rank::new(worker_id, dp_rank), events),
        )
    }

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

    /// Indexed blocks and `(block, rank)` pairs per partition (for metrics).
    pub fn index_sizes(&self) -> Vec<(PartitionKey, usize, usize)> {
        self.partitions
            .iter()
            .map(|(k, p)| (k.clone(), p.index.block_count(), p.index.held_pairs()))
            .collect()
    }

    // ------------------------------------------------------------------------------------------
    // Selection

    fn candidates<'w>(
        &self,
        workers: &[&'w WorkerRecord],
        overlaps: &Overlaps,
        hashes: &PromptHashes,
        block_size: u32,
    ) -> Vec<(Candidate, &'w WorkerRecord)> {
        let load = locked(&self.load);
        let potential = load.potential_decode(&hashes.sequence, hashes.isl_tokens, block_size);
        // One rank per worker is the common case.
        let mut out = Vec::with_capacity(workers.len());
        for &record in workers {
            for dp_rank in record.spec.dp_ranks() {
                let rank = Rank::new(record.spec.worker_id, dp_rank);
                let overlap = overlaps.get(&rank);
                let rank_load = load.rank_load(rank);
                out.push((
                    Candidate {
                        rank,
                        device_blocks: overlap.map_or(0, |o| o.device_blocks),
                        host_blocks: overlap.map_or(0, |o| o.host_blocks),
                        disk_blocks: overlap.map_or(0, |o| o.disk_blocks),
                        active_prefill_tokens: rank_load.active_prefill_tokens,
                        active_decode_blocks: rank_load.active_decode_blocks,
                        potential_decode_blocks: potential.blocks(rank),
                        active_requests: rank_load.active_requests,
                        total_kv_blocks: record.spec.total_kv_blocks,
                        max_num_batched_tokens: record.spec.max_num_batched_tokens,
                    },
                    record,
                ));
            }
        }
        out
    }

    fn overlaps(p: &Partition, hashes: &PromptHashes) -> Overlaps {
        let mut ranks = p.index.find_matches(&hashes.sequence).ranks;
        ranks.sort_unstable_by_key(|o| o.rank);
        Overlaps(ranks)
    }

    fn compute_selection(
        &self,
        req: &SelectRequest<'_>,
        rng: &mut impl Rng,
    ) -> Result<Selection, Error> {
        self.check_running()?;
        if let Some(id) = req.selection_id {
            check_id("selection_id", id)?;
        }
        let (p, workers) = self.schedulable_workers(req.partition)?;
        let block_size = workers.first().and_then(|r| r.spec.block_size).unwrap_or(1);
        let hashes = req.prompt.hash(block_size)?;
        let config = self.config.scheduler.with(&req.overrides);

        let eligible: Vec<&WorkerRecord> = match (req.pinned_worker, req.allowed_worker_ids) {
            (Some(pin), _) => workers
                .iter()
                .copied()
                .filter(|r| r.spec.worker_id == pin.worker_id)
                .filter(|r| pin.dp_rank.is_none_or(|d| r.spec.dp_ranks().contains(&d)))
                .collect(),
            (None, Some(allowed)) => workers
                .iter()
                .copied()
                .filter(|r| allowed.contains(&r.spec.worker_id))
                .collect(),
            (None, None) => workers,
        };
        if eligible.is_empty() {
            return Err(Error::NoEndpointsAvailable);
        }
        let overlaps = Self::overlaps(p, &hashes);
        let mut candidates = self.candidates(&eligible, &overlaps, &hashes, block_size);
        if let Some(PinnedWorker {
            dp_rank: Some(d), ..
        }) = req.pinned_worker
        {
            candidates.retain(|(c, _)| c.rank.dp_rank == d);
        }
        let chosen = if req.pinned_worker.is_some() {
            // Pinning bypasses scoring: the first (or named) rank of the pinned worker.
            0
        } else {
            let free: Vec<usize> = (0..candidates.len())
                .filter(|&i| !config.is_busy(&candidates[i].0))
                .collect();
            if free.is_empty() {
                return Err(Error::AllWorkersBusy);
            }
            let costs: Vec<f64> = free
                .iter()
                .map(|&i| config.cost(&candidates[i].0, hashes.isl_tokens, block_size))
                .collect();
            free[pick(&costs, config.router_temperature, rng)]
        };
        let Some(&(candidate, record)) = candidates.get(chosen) else {
            return Err(Error::NoEndpointsAvailable);
        };
        let bs = u64::from(block_size);
        let credit = config.credit(
            candidate.device_blocks,
            candidate.host_blocks,
            candidate.disk_blocks,
        );
        let dp = record
            .spec
            .dp_ranks()
            .map(|d| {
                let device = overlaps
                    .get(&Rank::new(record.spec.worker_id, d))
                    .map_or(0, |o| o.device_blocks);
                (d, u64::from(device) * bs)
            })
            .collect();
        let worker_load = req.advisory.then(|| WorkerLoad {
            active_prefill_tokens: candidate.active_prefill_tokens,
            prefill_token_capacity: record
                .spec
                .max_num_batched_tokens
                .unwrap_or(UNKNOWN_PREFILL_CAPACITY),
            total_kv_blocks: record.spec.total_kv_blocks,
        });
        Ok(Selection {
            selection_id: req.selection_id.map(str::to_string),
            partition: req.partition.clone(),
            worker_id: record.spec.worker_id,
            dp_rank: candidate.rank.dp_rank,
            endpoint: record.spec.endpoint.clone().unwrap_or_default(),
            block_size,
            overlap: OverlapTokens {
                longest_matched: u64::from(candidate.disk_blocks) * bs,
                gpu: u64::from(candidate.device_blocks) * bs,
                cpu: u64::from(candidate.host_blocks) * bs,
                disk: u64::from(candidate.disk_blocks) * bs,
                dp,
            },
            effective_prefill_tokens: effective_prefill_tokens(
                hashes.isl_tokens,
                block_size,
                credit,
            ),
            potential_decode_blocks: candidate.potential_decode_blocks,
            worker_load,
            track_prefill_tokens: config.track_prefill_tokens,
            local_hashes: Arc::from(hashes.local.as_slice()),
            sequence_hashes: Arc::from(hashes.sequence.as_slice()),
            isl_tokens: hashes.isl_tokens,
        })
    }

    /// `POST /select`: picks a rank; books nothing. With a `selection_id` the booking inputs are
    /// cached for a replay (a newer select with the same id replaces the entry).
    pub fn select(
        &self,
        req: &SelectRequest<'_>,
        now: Instant,
        rng: &mut impl Rng,
    ) -> Result<Selection, Error> {
        let selection = self.compute_selection(req, rng)?;
        if let Some(id) = req.selection_id {
            let key = PendingKey::new(&req.partition.model_name, &req.partition.routing_group, id);
            // Local and sequence hashes are both kept.
            let bytes =
                key.approximate_entry_bytes(2 * selection.sequence_hashes.len(), req.lora_name);
            let entry = PendingSelection {
                worker_id: selection.worker_id,
                dp_rank: selection.dp_rank,
                local_hashes: Arc::clone(&selection.local_hashes),
                sequence_hashes: Arc::clone(&selection.sequence_hashes),
                isl_tokens: selection.isl_tokens,
                effective_prefill_tokens: selection.effective_prefill_tokens,
                expected_output_tokens: req.expected_output_tokens,
                track_prefill_tokens: selection.track_prefill_tokens,
                lora_name: req.lora_name.map(str::to_string),
            };
            self.pending().insert(key, Arc::new(entry), bytes, now);
        }
        Ok(selection)
    }

    /// `POST /select_and_reserve`: selects and books atomically under `reservation_id` (or the
    /// request's selection id, or a generated UUID). Never touches the pending cache.
    pub fn select_and_reserve(
        &mut self,
        req: &SelectRequest<'_>,
        reservation_id: Option<&str>,
        now: Instant,
        rng: &mut impl Rng,
    ) -> Result<(Selection, Reservation), Error> {
        for (field, value) in [
            ("reservation_id", reservation_id),
            ("selection_id", req.selection_id),
        ] {
            if let Some(v) = value {
                sync::check_booking_id(field, v)?;
            }
        }
        let mut selection = self.compute_selection(req, rng)?;
        let id = reservation_id
            .or(req.selection_id)
            .map(str::to_string)
            .unwrap_or_else(|| random_uuid(rng));
        exclusive(&mut self.load).book(
            Booking {
                reservation_id: id.clone(),
                rank: Rank::new(selection.worker_id, selection.dp_rank),
                block_size: selection.block_size,
                sequence_hashes: Arc::clone(&selection.sequence_hashes),
                isl_tokens: selection.isl_tokens,
                effective_prefill_tokens: selection.effective_prefill_tokens,
                expected_output_tokens: req.expected_output_tokens,
                track_prefill_tokens: selection.track_prefill_tokens,
            },
            now,
        )?;
        self.model_booking(
            &id,
            Rank::new(selection.worker_id, selection.dp_rank),
            &selection.local_hashes,
            &selection.sequence_hashes,
            selection.isl_tokens,
            now,
        );
        selection.selection_id = Some(id.clone());
        let reservation = Reservation {
            reservation_id: id.clone(),
            selection_id: Some(id),
            partition: req.partition.clone(),
            worker_id: selection.worker_id,
            dp_rank: selection.dp_rank,
            endpoint: selection.endpoint.clone(),
        };
        Ok((selection, reservation))
    }

    // ------------------------------------------------------------------------------------------
    // Reservations

    /// The schedulable record of `worker_id` in `partition` with `dp_rank` among its ranks.
    fn schedulable_rank(
        &self,
        partition: &PartitionKey,
        worker_id: WorkerId,
        dp_rank: Option<u32>,
    ) -> Result<(&WorkerRecord, u32), Error> {
        let not_found = || Error::WorkerNotSchedulable {
            worker_id,
            partition: partition.clone(),
        };
        let record = self
            .workers
            .get(&worker_id)
            .filter(|r| r.lifecycle == Lifecycle::Schedulable && r.spec.partition() == *partition)
            .ok_or_else(not_found)?;
        let dp_rank = dp_rank.unwrap_or(record.spec.dp_start());
        if !record.spec.dp_ranks().contains(&dp_rank) {
            return Err(not_found());
        }
        Ok((record, dp_rank))
    }

    /// `POST /reservations`: books load, either replaying a cached selection or from an explicit
    /// worker and prompt (SPEC §7.3).
    pub fn create_reservation(
        &mut self,
        req: &ReservationRequest<'_>,
        now: Instant,
    ) -> Result<Reservation, Error> {
        self.check_running()?;
        check_reservation_ids(req)?;
        match (req.worker_id, req.selection_id) {
            (Some(worker_id), _) => self.book_explicit(req, worker_id, now),
            (None, Some(selection_id)) => self.book_replay(req, selection_id, now),
            (None, None) => Err(Error::MissingSelectionOrWorker),
        }
    }

    /// Everything a replay books, checked but not yet booked: the pending entry (peeked), the
    /// worker and rank, and whether that rank's cache is modelled. Call it while holding the
    /// load tracker's mutex and book under the same hold, so that two replays of one selection
    /// book at most once.
    fn plan_replay(
        &self,
        req: &ReservationRequest<'_>,
        selection_id: &str,
        now: Instant,
    ) -> Result<ReplayPlan, Error> {
        let key = PendingKey::new(
            &req.partition.model_name,
            &req.partition.routing_group,
            selection_id,
        );
        let Some((entry, generation)) = self.pending().peek(&key, now) else {
            return Err(Error::NoPendingSelection {
                selection_id: selection_id.to_string(),
                partition: req.partition.clone(),
            });
        };
        self.schedulable_workers(req.partition)?;
        let (record, dp_rank) =
            self.schedulable_rank(req.partition, entry.worker_id, Some(entry.dp_rank))?;
        let reservation_id = req.reservation_id.unwrap_or(selection_id).to_string();
        let rank = Rank::new(entry.worker_id, dp_rank);
        Ok(ReplayPlan {
            booking: Booking {
                reservation_id: reservation_id.clone(),
                rank,
                block_size: record.spec.block_size.unwrap_or(1),
                sequence_hashes: Arc::clone(&entry.sequence_hashes),
                isl_tokens: entry.isl_tokens,
                effective_prefill_tokens: entry.effective_prefill_tokens,
                expected_output_tokens: entry.expected_output_tokens,
                track_prefill_tokens: entry.track_prefill_tokens,
            },
            reservation: Reservation {
                reservation_id,
                selection_id: Some(selection_id.to_string()),
                partition: req.partition.clone(),
                worker_id: entry.worker_id,
                dp_rank,
                endpoint: record.spec.endpoint.clone().unwrap_or_default(),
            },
            modelled: self.model_of(record).is_some(),
            rank,
            key,
            generation,
            entry,
        })
    }

    fn book_replay(
        &mut self,
        req: &ReservationRequest<'_>,
        selection_id: &str,
        now: Instant,
    ) -> Result<Reservation, Error> {
        let plan = {
            let mut load = locked(&self.load);
            let plan = self.plan_replay(req, selection_id, now)?;
            load.book(plan.booking.clone(), now)?;
            self.pending().remove(&plan.key, plan.generation);
            plan
        };
        self.model_booking(
            &plan.reservation.reservation_id,
            plan.rank,
            &plan.entry.local_hashes,
            &plan.entry.sequence_hashes,
            plan.entry.isl_tokens,
            now,
        );
        Ok(plan.reservation)
    }

    /// [`Self::create_reservation`] under the shared lock: a replay onto a rank whose cache is
    /// known from KV events books here; the explicit form and a replay onto a modelled rank
    /// answer [`Shared::Exclusive`] having changed nothing (the explicit form discards the
    /// cached selection, which the exclusive call does again first).
    pub fn create_reservation_shared(
        &self,
        req: &ReservationRequest<'_>,
        now: Instant,
    ) -> Result<Shared<Reservation>, Error> {
        self.check_running()?;
        check_reservation_ids(req)?;
        let (None, Some(selection_id)) = (req.worker_id, req.selection_id) else {
            return Ok(Shared::Exclusive);
        };
        let mut load = locked(&self.load);
        let plan = self.plan_replay(req, selection_id, now)?;
        if plan.modelled {
            return Ok(Shared::Exclusive);
        }
        load.book(plan.booking, now)?;
        self.pending().remove(&plan.key, plan.generation);
        Ok(Shared::Done(plan.reservation))
    }

    fn book_explicit(
        &mut self,
        req: &ReservationRequest<'_>,
        worker_id: WorkerId,
        now: Instant,
    ) -> Result<Reservation, Error> {
        let Some(name) = req.reservation_id.or(req.selection_id) else {
            return Err(Error::MissingBookingName);
        };
        // A delayed replay must never book stale state: the explicit form discards the cached
        // selection before anything else can fail.
        let cached = req.selection_id.or(req.reservation_id).unwrap_or(name);
        self.pending().discard(&PendingKey::new(
            &req.partition.model_name,
            &req.partition.routing_group,
            cached,
        ));
        let Some(prompt) = req.prompt else {
            return Err(Error::MissingPrompt {
                field: "sequence_hashes",
            });
        };
        let (p, _) = self.schedulable_workers(req.partition)?;
        let (record, dp_rank) = self.schedulable_rank(req.partition, worker_id, req.dp_rank)?;
        let block_size = record.spec.block_size.unwrap_or(1);
        let hashes = prompt.hash(block_size)?;
        let config = self.config.scheduler.with(&req.overrides);
        let effective = match req.effective_prefill_tokens {
            Some(n) if n > hashes.isl_tokens => {
                return Err(Error::EffectivePrefillExceedsIsl {
                    effective_prefill_tokens: n,
                    isl_tokens: hashes.isl_tokens,
                });
            }
            Some(n) => n,
            None => {
                let overlap = Self::overlaps(p, &hashes)
                    .get(&Rank::new(worker_id, dp_rank))
                    .copied();
                let credit = overlap.map_or(0.0, |o| {
                    config.credit(o.device_blocks, o.host_blocks, o.disk_blocks)
                });
                effective_prefill_tokens(hashes.isl_tokens, block_size, credit)
            }
        };
        let endpoint = record.spec.endpoint.clone().unwrap_or_default();
        let booking = Booking {
            reservation_id: name.to_string(),
            rank: Rank::new(worker_id, dp_rank),
            block_size,
            sequence_hashes: Arc::from(hashes.sequence.as_slice()),
            isl_tokens: hashes.isl_tokens,
            effective_prefill_tokens: effective,
            expected_output_tokens: req.expected_output_tokens,
            track_prefill_tokens: req
                .track_prefill_tokens
                .unwrap_or(config.track_prefill_tokens),
        };
        exclusive(&mut self.load).book(booking, now)?;
        self.model_booking(
            name,
            Rank::new(worker_id, dp_rank),
            &hashes.local,
            &hashes.sequence,
            hashes.isl_tokens,
            now,
        );
        Ok(Reservation {
            reservation_id: name.to_string(),
            selection_id: req.selection_id.map(str::to_string),
            partition: req.partition.clone(),
            worker_id,
            dp_rank,
            endpoint,
        })
    }

    pub fn prefill_complete(&mut self, reservation_id: &str, now: Instant) -> Result<(), Error> {
        self.check_running()?;
        sync::check_booking_id("reservation_id", reservation_id)?;
        exclusive(&mut self.load).prefill_complete(reservation_id, now)?;
        exclusive(&mut self.lru).touch(reservation_id, now);
        Ok(())
    }

    pub fn output_block(
        &mut self,
        reservation_id: &str,
        decay_fraction: Option<f64>,
        now: Instant,
    ) -> Result<(), Error> {
        self.check_running()?;
        sync::check_booking_id("reservation_id", reservation_id)?;
        exclusive(&mut self.load).output_block(reservation_id, decay_fraction, now)?;
        if let Some(lease) = exclusive(&mut self.lru).materialize(reservation_id, now) {
            let partition = self
                .workers
                .get(&lease.rank.worker_id)
                .map(|r| r.spec.partition());
            if let Some(p) = partition {
                self.apply_model_events(&p, lease.rank, &lease.events);
            }
        }
        Ok(())
    }

    pub fn free(&mut self, reservation_id: &str) -> Result<(), Error> {
        self.check_running()?;
        sync::check_booking_id("reservation_id", reservation_id)?;
        exclusive(&mut self.load).free(reservation_id)?;
        self.release_lease(reservation_id);
        Ok(())
    }

    /// [`Self::prefill_complete`] under the shared lock (it changes no model's blocks).
    pub fn prefill_complete_shared(
        &self,
        reservation_id: &str,
        now: Instant,
    ) -> Result<Shared<()>, Error> {
        self.check_running()?;
        sync::check_booking_id("reservation_id", reservation_id)?;
        let mut load = locked(&self.load);
        load.prefill_complete(reservation_id, now)?;
        locked(&self.lru).touch(reservation_id, now);
        Ok(Shared::Done(()))
    }

    /// [`Self::output_block`] under the shared lock; [`Shared::Exclusive`] for a booking the LRU
    /// model holds a lease for (its output block takes a slot in the modelled cache).
    pub fn output_block_shared(
        &self,
        reservation_id: &str,
        decay_fraction: Option<f64>,
        now: Instant,
    ) -> Result<Shared<()>, Error> {
        self.check_running()?;
        sync::check_booking_id("reservation_id", reservation_id)?;
        let mut load = locked(&self.load);
        let mut lru = locked(&self.lru);
        if lru.lease(reservation_id).is_some() {
            return Ok(Shared::Exclusive);
        }
        load.output_block(reservation_id, decay_fraction, now)?;
        // No lease: counted as an ignored command, as the exclusive call does.
        let _ = lru.materialize(reservation_id, now);
        Ok(Shared::Done(()))
    }

    /// [`Self::free`] under the shared lock; [`Shared::Exclusive`] for a booking the LRU model
    /// holds a lease for (its release evicts modelled blocks).
    pub fn free_shared(&self, reservation_id: &str) -> Result<Shared<()>, Error> {
        self.check_running()?;
        sync::check_booking_id("reservation_id", reservation_id)?;
        let mut load = locked(&self.load);
        let mut lru = locked(&self.lru);
        if lru.lease(reservation_id).is_some() {
            return Ok(Shared::Exclusive);
        }
        load.free(reservation_id)?;
        // No lease: counted as an ignored command, as the exclusive call does.
        let _ = lru.release(reservation_id);
        Ok(Shared::Done(()))
    }

    /// Periodic housekeeping: frees bookings idle for `active_request_expiry`, purges expired
    /// cached selections.
    pub fn tick(&mut self, now: Instant) -> TickOutcome {
        let expired = exclusive(&mut self.load).expire(now, self.config.active_request_expiry);
        for booking in &expired {
            self.release_lease(&booking.reservation_id);
        }
        let mut ttl_events = Vec::new();
        for p in self.partitions.values_mut() {
            ttl_events.extend(p.ttl.expire(now).events);
        }
        self.apply_ranked_events(&ttl_events);
        let reaped = exclusive(&mut self.lru).reap(now);
        self.apply_ranked_events(&reaped.events);
        let expired_selections = self.pending().purge_expired(now);
        TickOutcome {
            expired_reservations: expired
                .into_iter()
                .map(|f| f.reservation_id.to_string())
                .collect(),
            expired_selections,
        }
    }

    // ------------------------------------------------------------------------------------------
    // Inspection

    fn rank_report(&self, rank: Rank) -> RankLoadReport {
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
            .candidates(&workers, &overlaps, &hashes, block_size)
            .into_iter()
            .map(|(c, _)| {
                let credit = config.credit(c.device_blocks, c.host_blocks, c.disk_blocks);
                let added = if config.track_prefill_tokens {
                    effective_prefill_tokens(hashes.isl_tokens, block_size, credit)
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

mod sync;
pub use sync::{BookingOwner, SyncApplyError, SyncApplyOutcome, SyncedBooking};

#[cfg(test)]
mod tests;
