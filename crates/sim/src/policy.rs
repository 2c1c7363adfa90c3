//! Routing policies: who gets each request.
//!
//! | name | what it does |
//! |---|---|
//! | `round_robin` | worker `i mod N` |
//! | `random` | uniform (seeded) |
//! | `least_loaded` | fewest active tokens (prompt + output so far of its in-flight requests) |
//! | `cache_aware` | SGLang's cache-aware router: an approximate per-worker prefix tree fed by its own routing decisions; when loads are imbalanced (max − min > 64 requests and max > 1.5 × min) the least-loaded worker, else the best match if it covers > 30 % of the prompt, else the worker with the smallest tree |
//! | `dynamo` | kvroute's selector with Dynamo's default weights, fed the engines' exact KV events |
//! | `kvroute` | the selector with kvroute's own settings: prefill-weighted cost, larger cache credit, the core's predict-on-route (see [`kvroute_policy`]) |
//! | `kvroute-approx-ttl`, `kvroute-approx-lru` | `kvroute` without KV events, relying on the approximate cache models of SPEC §9 |
//! | `kvroute-session-hard`, `kvroute-session-soft` | `kvroute` with session affinity: a session's requests go to the rank its bookings went to, always (hard, Dynamo's behaviour) or unless busy or costlier than the soft factor × the best (soft) |
//!
//! Every selector policy drives [`Selector`] exactly as the HTTP service does: workers are
//! registered with `upsert_worker`, the engines' events go through `apply_events`, each request
//! is booked with `select_and_reserve`, and the engine drives `prefill_complete` (first token),
//! `output_block` (each new output block) and `free` (last token).

use crate::engine::EngineConfig;
use crate::{RequestId, SimError};
use hashbrown::HashMap;
use kvroute_core::approx::CachePolicy;
use kvroute_core::error::PartitionKey;
use kvroute_core::event::KvEvent;
use kvroute_core::hash::PromptHashes;
use kvroute_core::schedule::{RouterProfile, SchedulerConfig};
use kvroute_core::selector::{
    BookingOwner, LifecycleCalls, PredictConfig, Prompt, SelectRequest, Selector, SelectorConfig,
    SessionConfig, SessionMode, SyncedBooking, WorkerSpec,
};
use rand::Rng;
use rand::rngs::SmallRng;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// Settings of the SGLang-style cache-aware policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareConfig {
    /// Minimum prompt share the best tree match must cover (exclusive).
    pub cache_threshold: f64,
    /// Imbalance needs `max - min` in-flight requests above this...
    pub balance_abs_threshold: u64,
    /// ...and `max > min × this`.
    pub balance_rel_threshold: f64,
    /// Per-worker tree capacity, in blocks; least recently used leaves go first beyond it.
    pub max_tree_blocks: usize,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            // SGLang's 2^26-character trees, at ~4 characters per token, in 64-token blocks.
            max_tree_blocks: (1 << 24) / 64,
        }
    }
}

/// How a selector-backed policy uses the selector.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SelectorPolicy {
    pub scheduler: SchedulerConfig,
    /// Register the workers with a KV-event endpoint and feed them the engines' events. Without
    /// it the selector's approximate model is the only cache knowledge.
    pub kv_events: bool,
    /// The selector's predict-on-route TTL (`SelectorConfig::predict`; zero: off): a booked
    /// prompt's blocks count as held by the chosen rank until its own events confirm them, or
    /// this long. Requests arriving in the same burst then see the prefix where it is being
    /// computed instead of spreading it over the fleet.
    pub predicted_ttl: Duration,
    /// The selector's approximate cache model for workers without KV events.
    pub approximate_policy: CachePolicy,
    /// Session affinity (`SelectorConfig::sessions`); off (`ttl: None`) but in the session
    /// policies.
    pub sessions: SessionConfig,
    /// The TTL the session policies bind sessions for (after a session's last request ended).
    pub session_ttl: Duration,
}

/// The session policies' TTL unless `--session-affinity-ttl-secs` says otherwise: longer than
/// the agentic workload's think times between turns (1.5 s mean, exponential).
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(30);

/// What a policy is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PolicyKind {
    RoundRobin,
    Random,
    LeastLoaded,
    CacheAware(CacheAwareConfig),
    Selector(SelectorPolicy),
}

/// A named policy of the catalog.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub name: &'static str,
    pub kind: PolicyKind,
    /// `Some(reason)` when it cannot run in this build.
    pub unavailable: Option<&'static str>,
}

/// `dynamo`: the selector with Dynamo's defaults (SPEC §6, the `dynamo` router profile) and exact
/// KV events; no prediction on route (Dynamo 1.6.1's default).
pub fn dynamo_policy() -> SelectorPolicy {
    SelectorPolicy {
        scheduler: SchedulerConfig::for_profile(RouterProfile::Dynamo),
        kv_events: true,
        predicted_ttl: Duration::ZERO,
        approximate_policy: CachePolicy::Ttl,
        sessions: SessionConfig::default(),
        session_ttl: DEFAULT_SESSION_TTL,
    }
}

/// `kvroute`: the selector with kvroute's own defaults. It starts from `dynamo` and changes:
/// - the scheduler: kvroute-core's default ([`SchedulerConfig::default`], the `kvroute` router
///   profile, as `kvroute serve` and `kvroute.SelectionService()`): the cost in predicted time
///   with engine speeds calibrated from the lifecycle calls (the reasons are at
///   [`SchedulerConfig::for_profile`]), effective prefill counted without the routing credit;
/// - [`SelectorPolicy::predicted_ttl`] at the core's default (2 s): the prompts just sent count as
///   held until the engine's events confirm them, so a burst of requests sharing a prefix lands
///   together.
///
/// On the Mooncake conversation trace (8 workers, 4× arrivals) this lifts the prefix hit rate from
/// 16 % to 25 % and cuts mean TTFT by ~27 %; the sweep behind the numbers is in the crate README.
pub fn kvroute_policy() -> SelectorPolicy {
    let dynamo = dynamo_policy();
    SelectorPolicy {
        scheduler: SchedulerConfig::default(),
        predicted_ttl: PredictConfig::default().ttl,
        ..dynamo
    }
}

/// Every policy, in report order, with `kvroute` configured as given (see [`kvroute_policy`]);
/// the session policies are `kvroute` with sessions bound for its `session_ttl`.
pub fn catalog(kvroute: SelectorPolicy) -> Vec<Policy> {
    let session = |name, mode| Policy {
        name,
        kind: PolicyKind::Selector(SelectorPolicy {
            sessions: SessionConfig {
                ttl: Some(kvroute.session_ttl),
                mode,
                ..kvroute.sessions
            },
            ..kvroute
        }),
        unavailable: None,
    };
    let approx = |name, approximate_policy| Policy {
        name,
        kind: PolicyKind::Selector(SelectorPolicy {
            kv_events: false,
            approximate_policy,
            ..kvroute
        }),
        unavailable: None,
    };
    vec![
        Policy {
            name: "round_robin",
            kind: PolicyKind::RoundRobin,
            unavailable: None,
        },
        Policy {
            name: "random",
            kind: PolicyKind::Random,
            unavailable: None,
        },
        Policy {
            name: "least_loaded",
            kind: PolicyKind::LeastLoaded,
            unavailable: None,
        },
        Policy {
            name: "cache_aware",
            kind: PolicyKind::CacheAware(CacheAwareConfig::default()),
            unavailable: None,
        },
        Policy {
            name: "dynamo",
            kind: PolicyKind::Selector(dynamo_policy()),
            unavailable: None,
        },
        Policy {
            name: "kvroute",
            kind: PolicyKind::Selector(kvroute),
            unavailable: None,
        },
        approx("kvroute-approx-ttl", CachePolicy::Ttl),
        approx("kvroute-approx-lru", CachePolicy::Lru),
        session("kvroute-session-hard", SessionMode::Hard),
        session("kvroute-session-soft", SessionMode::Soft),
    ]
}

/// Resolves `all` or a comma-separated list of names against the catalog (in the list's order,
/// duplicates dropped). Unknown names are an error listing the known ones.
pub fn resolve(list: &str, kvroute: SelectorPolicy) -> Result<Vec<Policy>, SimError> {
    let catalog = catalog(kvroute);
    if list.trim() == "all" {
        return Ok(catalog);
    }
    let mut out: Vec<Policy> = Vec::new();
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let Some(policy) = catalog.iter().find(|p| p.name == name) else {
            let known: Vec<&str> = catalog.iter().map(|p| p.name).collect();
            return Err(SimError::invalid(
                "policies",
                format!("unknown policy `{name}`; known: all, {}", known.join(", ")),
            ));
        };
        if !out.iter().any(|p| p.name == name) {
            out.push(policy.clone());
        }
    }
    if out.is_empty() {
        return Err(SimError::invalid("policies", "no policy named"));
    }
    Ok(out)
}

/// A router as the simulator drives it.
pub trait Router {
    /// Picks the worker (0-based) for a request of `session` (when the workload knows it)
    /// arriving at `now`.
    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        session: Option<u64>,
        now: Instant,
        rng: &mut SmallRng,
    ) -> Result<usize, SimError>;
    /// KV events of a worker reached the router.
    fn on_kv_events(&mut self, _worker: usize, _events: &[KvEvent]) {}
    /// The request produced its first token.
    fn on_first_token(&mut self, _id: RequestId, _now: Instant) -> Result<(), SimError> {
        Ok(())
    }
    /// The request started a new output block.
    fn on_output_block(&mut self, _id: RequestId, _now: Instant) -> Result<(), SimError> {
        Ok(())
    }
    /// The request finished.
    fn on_finished(&mut self, _id: RequestId, _now: Instant) -> Result<(), SimError> {
        Ok(())
    }
    /// Counters worth reporting (e.g. events the index could not apply).
    fn diagnostics(&self) -> RouterDiagnostics {
        RouterDiagnostics::default()
    }
    /// The chosen and best device overlap of the router's selections as its own index saw them
    /// (`Selection::best_gpu_overlap`), for routers built on the selector; the others keep no
    /// index of the engines' caches, so `None`.
    fn selector_overlap(&self) -> Option<OverlapTotals> {
        None
    }
    /// Whether this router's bookings are shared with other replicas of it
    /// ([`crate::replicas`]); the routers built on the selector share them.
    fn shares_bookings(&self) -> bool {
        false
    }
    /// The state of this router's own booking of request `id`, for the other replicas (`None`:
    /// no such live booking).
    fn export_booking(&self, _id: RequestId) -> Option<SyncedBooking> {
        None
    }
    /// Another replica's (`from`) booking of `id` reached this one: its state, or `None` when it
    /// was freed there.
    fn import_booking(
        &mut self,
        _from: usize,
        _id: RequestId,
        _state: Option<&SyncedBooking>,
        _now: Instant,
    ) -> Result<(), SimError> {
        Ok(())
    }
}

/// Sums of the chosen and the best device overlap over a run's selections, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OverlapTotals {
    pub chosen_tokens: u64,
    pub best_tokens: u64,
}

/// Things a router noticed that point at a simulator bug when non-zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouterDiagnostics {
    pub parent_block_not_found: u64,
    pub unknown_removed_blocks: u64,
}

/// Builds the router of a policy for `workers` engines of the given configuration.
pub fn build_router(
    policy: &Policy,
    workers: usize,
    engine: &EngineConfig,
) -> Result<Box<dyn Router>, SimError> {
    build_replica(policy, workers, engine, None)
}

/// Builds the router of a policy as replica `replica` of several ([`crate::replicas`]): a
/// selector-backed one is named [`replica_name`] so it finds its place among the replicas it
/// hears of (`Selector::set_replica_id`); `None` leaves it unnamed, as a lone router.
pub fn build_replica(
    policy: &Policy,
    workers: usize,
    engine: &EngineConfig,
    replica: Option<usize>,
) -> Result<Box<dyn Router>, SimError> {
    if let Some(reason) = policy.unavailable {
        return Err(SimError::Unavailable {
            policy: policy.name.to_string(),
            reason: reason.to_string(),
        });
    }
    if workers == 0 {
        return Err(SimError::invalid("workers", "must be greater than 0"));
    }
    Ok(match policy.kind {
        PolicyKind::RoundRobin => Box::new(RoundRobin { next: 0, workers }),
        PolicyKind::Random => Box::new(RandomRouter { workers }),
        PolicyKind::LeastLoaded => Box::new(LeastLoaded::new(workers, engine.block_size)),
        PolicyKind::CacheAware(config) => Box::new(CacheAware::new(workers, engine, config)),
        PolicyKind::Selector(config) => {
            Box::new(SelectorRouter::new(workers, engine, config, replica)?)
        }
    })
}

struct RoundRobin {
    next: usize,
    workers: usize,
}

impl Router for RoundRobin {
    fn route(
        &mut self,
        _id: RequestId,
        _prompt: &PromptHashes,
        _session: Option<u64>,
        _now: Instant,
        _rng: &mut SmallRng,
    ) -> Result<usize, SimError> {
        let w = self.next;
        self.next = (self.next + 1) % self.workers;
        Ok(w)
    }
}

struct RandomRouter {
    workers: usize,
}

impl Router for RandomRouter {
    fn route(
        &mut self,
        _id: RequestId,
        _prompt: &PromptHashes,
        _session: Option<u64>,
        _now: Instant,
        rng: &mut SmallRng,
    ) -> Result<usize, SimError> {
        Ok(rng.random_range(0..self.workers))
    }
}

/// Picks uniformly among the indices of the minimum of `values`.
fn argmin_random<T: PartialOrd + Copy>(values: &[T], rng: &mut SmallRng) -> usize {
    let mut best = 0;
    let mut ties = 0u32;
    for (i, v) in values.iter().enumerate() {
        if *v < values[best] {
            best = i;
            ties = 1;
        } else if *v == values[best] {
            ties += 1;
            if rng.random_range(0..ties) == 0 {
                best = i;
            }
        }
    }
    best
}

/// Per-request bookkeeping of the load-counting policies.
struct InFlight {
    worker: usize,
    tokens: u64,
}

struct LeastLoaded {
    active_tokens: Vec<u64>,
    requests: HashMap<RequestId, InFlight>,
    block_size: u64,
}

impl LeastLoaded {
    fn new(workers: usize, block_size: u32) -> Self {
        Self {
            active_tokens: vec![0; workers],
            requests: HashMap::new(),
            block_size: u64::from(block_size),
        }
    }
}

impl Router for LeastLoaded {
    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        _session: Option<u64>,
        _now: Instant,
        rng: &mut SmallRng,
    ) -> Result<usize, SimError> {
        let w = argmin_random(&self.active_tokens, rng);
        self.active_tokens[w] += prompt.isl_tokens;
        self.requests.insert(
            id,
            InFlight {
                worker: w,
                tokens: prompt.isl_tokens,
            },
        );
        Ok(w)
    }

    fn on_output_block(&mut self, id: RequestId, _now: Instant) -> Result<(), SimError> {
        if let Some(r) = self.requests.get_mut(&id) {
            r.tokens += self.block_size;
            self.active_tokens[r.worker] += self.block_size;
        }
        Ok(())
    }

    fn on_finished(&mut self, id: RequestId, _now: Instant) -> Result<(), SimError> {
        if let Some(r) = self.requests.remove(&id) {
            self.active_tokens[r.worker] = self.active_tokens[r.worker].saturating_sub(r.tokens);
        }
        Ok(())
    }
}

/// An approximate prefix tree of one worker, over sequence hashes: a node is present iff the
/// router sent a prompt holding that block there and it has not aged out. Parents are touched
/// with their children, so least-recently-used order evicts leaves first.
#[derive(Default)]
struct ApproxTree {
    /// Sequence hash → (last access, depth).
    nodes: HashMap<u64, (u64, u32)>,
    /// (last access, depth reversed, hash): eviction order, oldest and deepest first.
    order: BTreeSet<(u64, std::cmp::Reverse<u32>, u64)>,
}

impl ApproxTree {
    fn matched_blocks(&self, sequence: &[u64]) -> usize {
        sequence
            .iter()
            .take_while(|h| self.nodes.contains_key(*h))
            .count()
    }

    fn insert(&mut self, sequence: &[u64], clock: u64, max_blocks: usize) {
        for (depth, &h) in sequence.iter().enumerate() {
            let depth = depth as u32;
            if let Some((old, d)) = self.nodes.insert(h, (clock, depth)) {
                self.order.remove(&(old, std::cmp::Reverse(d), h));
            }
            self.order.insert((clock, std::cmp::Reverse(depth), h));
        }
        while self.nodes.len() > max_blocks {
            let Some((_, _, h)) = self.order.pop_first() else {
                break;
            };
            self.nodes.remove(&h);
        }
    }
}

struct CacheAware {
    config: CacheAwareConfig,
    trees: Vec<ApproxTree>,
    in_flight: Vec<u64>,
    owner: HashMap<RequestId, usize>,
    clock: u64,
    block_size: u64,
}

impl CacheAware {
    fn new(workers: usize, engine: &EngineConfig, config: CacheAwareConfig) -> Self {
        Self {
            config,
            trees: (0..workers).map(|_| ApproxTree::default()).collect(),
            in_flight: vec![0; workers],
            owner: HashMap::new(),
            clock: 0,
            block_size: u64::from(engine.block_size),
        }
    }
}

impl Router for CacheAware {
    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        _session: Option<u64>,
        _now: Instant,
        rng: &mut SmallRng,
    ) -> Result<usize, SimError> {
        let max = self.in_flight.iter().copied().max().unwrap_or(0);
        let min = self.in_flight.iter().copied().min().unwrap_or(0);
        let imbalanced = max - min > self.config.balance_abs_threshold
            && max as f64 > min as f64 * self.config.balance_rel_threshold;
        let worker = if imbalanced {
            argmin_random(&self.in_flight, rng)
        } else {
            let matched: Vec<usize> = self
                .trees
                .iter()
                .map(|t| t.matched_blocks(&prompt.sequence))
                .collect();
            // Best match (ties: fewer in-flight requests, then random).
            let keys: Vec<(std::cmp::Reverse<usize>, u64)> = matched
                .iter()
                .zip(&self.in_flight)
                .map(|(&m, &l)| (std::cmp::Reverse(m), l))
                .collect();
            let best = argmin_random(&keys, rng);
            let ratio =
                (matched[best] as u64 * self.block_size) as f64 / prompt.isl_tokens.max(1) as f64;
            if ratio > self.config.cache_threshold {
                best
            } else {
                let sizes: Vec<usize> = self.trees.iter().map(|t| t.nodes.len()).collect();
                argmin_random(&sizes, rng)
            }
        };
        self.clock += 1;
        self.trees[worker].insert(&prompt.sequence, self.clock, self.config.max_tree_blocks);
        self.in_flight[worker] += 1;
        self.owner.insert(id, worker);
        Ok(worker)
    }

    fn on_finished(&mut self, id: RequestId, _now: Instant) -> Result<(), SimError> {
        if let Some(w) = self.owner.remove(&id) {
            self.in_flight[w] = self.in_flight[w].saturating_sub(1);
        }
        Ok(())
    }
}

/// The replica id router replica `index` has in replica sync.
pub fn replica_name(index: usize) -> String {
    format!("replica-{index}")
}

/// Worker ids the selector sees: 1-based, so worker 0 of the simulator is id 1.
fn worker_id(worker: usize) -> u64 {
    worker as u64 + 1
}

struct SelectorRouter {
    selector: Selector,
    partition: PartitionKey,
    config: SelectorPolicy,
    ids: HashMap<RequestId, String>,
    diagnostics: RouterDiagnostics,
    /// When the selector's housekeeping (TTL expiry, lease reaper) last ran.
    last_tick: Option<Instant>,
    overlap: OverlapTotals,
}

impl SelectorRouter {
    fn new(
        workers: usize,
        engine: &EngineConfig,
        config: SelectorPolicy,
        replica: Option<usize>,
    ) -> Result<Self, SimError> {
        let mut selector = Selector::new(SelectorConfig {
            scheduler: config.scheduler,
            approximate_policy: config.approximate_policy,
            predict: PredictConfig {
                ttl: config.predicted_ttl,
                ..PredictConfig::default()
            },
            sessions: config.sessions,
            ..SelectorConfig::default()
        });
        selector.set_replica_id(replica.map(replica_name).as_deref());
        let partition = PartitionKey::new("sim", "default");
        for w in 0..workers {
            let id = worker_id(w);
            let outcome = selector.upsert_worker(WorkerSpec {
                worker_id: id,
                model_name: partition.model_name.clone(),
                routing_group: partition.routing_group.clone(),
                endpoint: Some(format!("sim://worker-{id}")),
                block_size: Some(engine.block_size),
                total_kv_blocks: engine.kv_blocks,
                max_num_batched_tokens: Some(engine.max_num_batched_tokens),
                // The address only marks the worker as publishing events: the simulator hands
                // them over in process.
                kv_events_endpoint: config.kv_events.then(|| "tcp://127.0.0.1:1".to_string()),
                ..WorkerSpec::default()
            })?;
            if !outcome.record.not_schedulable_reasons.is_empty() {
                return Err(SimError::Internal(format!(
                    "worker {id} is not schedulable: {}",
                    outcome.record.not_schedulable_reasons.join("; ")
                )));
            }
        }
        Ok(Self {
            selector,
            partition,
            config,
            ids: HashMap::new(),
            diagnostics: RouterDiagnostics::default(),
            last_tick: None,
            overlap: OverlapTotals::default(),
        })
    }

    fn apply(&mut self, worker: usize, events: &[KvEvent]) {
        if let Some(outcome) = self.selector.apply_events(worker_id(worker), 0, events) {
            self.diagnostics.parent_block_not_found += outcome.parent_block_not_found;
            self.diagnostics.unknown_removed_blocks += outcome.unknown_removed_blocks;
        }
    }

    fn reservation_id(&self, id: RequestId) -> Result<&str, SimError> {
        self.ids
            .get(&id)
            .map(String::as_str)
            .ok_or_else(|| SimError::Internal(format!("request {id} was never booked")))
    }
}

impl Router for SelectorRouter {
    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        session: Option<u64>,
        now: Instant,
        rng: &mut SmallRng,
    ) -> Result<usize, SimError> {
        // The service ticks once a second; so does the simulated router.
        if self
            .last_tick
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            self.selector.tick(now);
            self.last_tick = Some(now);
        }
        let reservation_id = format!("r{id}");
        let session = session.map(|s| s.to_string());
        let request = SelectRequest {
            session_id: session.as_deref(),
            ..SelectRequest::new(&self.partition, Prompt::Hashes(prompt))
        };
        let (selection, _) =
            self.selector
                .select_and_reserve(&request, Some(&reservation_id), now, rng)?;
        let worker = usize::try_from(selection.worker_id.saturating_sub(1))
            .map_err(|_| SimError::Internal("worker id out of range".into()))?;
        self.ids.insert(id, reservation_id);
        self.overlap.chosen_tokens += selection.overlap.gpu;
        self.overlap.best_tokens += selection.best_gpu_overlap;
        Ok(worker)
    }

    fn on_kv_events(&mut self, worker: usize, events: &[KvEvent]) {
        if self.config.kv_events {
            self.apply(worker, events);
        }
    }

    fn on_first_token(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        let rid = self.reservation_id(id)?.to_string();
        Ok(self.selector.prefill_complete(&rid, now)?)
    }

    fn on_output_block(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        let rid = self.reservation_id(id)?.to_string();
        Ok(self.selector.output_block(&rid, None, now)?)
    }

    fn on_finished(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        let Some(rid) = self.ids.remove(&id) else {
            return Err(SimError::Internal(format!("request {id} was never booked")));
        };
        Ok(self.selector.free(&rid, now)?)
    }

    fn diagnostics(&self) -> RouterDiagnostics {
        self.diagnostics
    }

    fn selector_overlap(&self) -> Option<OverlapTotals> {
        Some(self.overlap)
    }

    fn shares_bookings(&self) -> bool {
        true
    }

    fn export_booking(&self, id: RequestId) -> Option<SyncedBooking> {
        let rid = self.ids.get(&id)?;
        self.selector.synced_booking(rid)
    }

    fn import_booking(
        &mut self,
        from: usize,
        id: RequestId,
        state: Option<&SyncedBooking>,
        now: Instant,
    ) -> Result<(), SimError> {
        let replica = replica_name(from);
        let rid = format!("r{id}");
        match state {
            Some(state) => {
                self.selector
                    .apply_synced_booking(BookingOwner::Remote(&replica), &rid, state, now)
                    .map_err(|e| SimError::Internal(format!("replica sync of {rid}: {e}")))?;
            }
            None => {
                self.selector.remove_remote_booking(&replica, &rid);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::event::StoredBlock;
    use kvroute_core::hash::BASE_SEED;
    use rand::SeedableRng;

    fn prompt(tokens: std::ops::Range<u32>) -> PromptHashes {
        PromptHashes::from_tokens(&tokens.collect::<Vec<u32>>(), 64, BASE_SEED)
    }

    #[test]
    fn resolve_accepts_all_and_lists_and_names_unknown_policies() {
        let all = resolve("all", kvroute_policy()).unwrap();
        assert_eq!(
            all.iter().map(|p| p.name).collect::<Vec<_>>(),
            vec![
                "round_robin",
                "random",
                "least_loaded",
                "cache_aware",
                "dynamo",
                "kvroute",
                "kvroute-approx-ttl",
                "kvroute-approx-lru",
                "kvroute-session-hard",
                "kvroute-session-soft"
            ]
        );
        let some = resolve("dynamo, round_robin,dynamo", kvroute_policy()).unwrap();
        assert_eq!(
            some.iter().map(|p| p.name).collect::<Vec<_>>(),
            vec!["dynamo", "round_robin"]
        );
        let err = resolve("dynamo,fastest", kvroute_policy()).unwrap_err();
        assert!(err.to_string().contains("`fastest`"), "{err}");
        assert!(err.to_string().contains("cache_aware"), "{err}");
    }

    #[test]
    fn session_policies_keep_a_session_on_its_worker() {
        let engine = EngineConfig::default();
        let now = Instant::now();
        let mut rng = SmallRng::seed_from_u64(1);
        let workers_used = |name: &str, rng: &mut SmallRng| {
            let policy = &resolve(name, kvroute_policy()).unwrap()[0];
            let mut router = build_router(policy, 4, &engine).unwrap();
            // Eight unrelated prompts of one session, all in flight.
            let used: BTreeSet<usize> = (0..8u32)
                .map(|i| {
                    let p = prompt(i * 10_000..i * 10_000 + 640);
                    router.route(i, &p, Some(7), now, rng).unwrap()
                })
                .collect();
            used.len()
        };
        assert_eq!(workers_used("kvroute-session-hard", &mut rng), 1);
        assert!(
            workers_used("kvroute", &mut rng) > 1,
            "no session: spread by load"
        );
        match &resolve("kvroute-session-soft", kvroute_policy()).unwrap()[0].kind {
            PolicyKind::Selector(s) => {
                assert_eq!(s.sessions.mode, SessionMode::Soft);
                assert_eq!(s.sessions.ttl, Some(DEFAULT_SESSION_TTL));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn approximate_policies_run_without_kv_events() {
        for (name, policy) in [
            ("kvroute-approx-ttl", CachePolicy::Ttl),
            ("kvroute-approx-lru", CachePolicy::Lru),
        ] {
            let all = resolve(name, kvroute_policy()).unwrap();
            assert!(all[0].unavailable.is_none());
            let PolicyKind::Selector(config) = all[0].kind else {
                panic!("{name} is selector-backed");
            };
            assert!(!config.kv_events);
            assert_eq!(config.approximate_policy, policy);
            assert!(build_router(&all[0], 2, &EngineConfig::default()).is_ok());
        }
    }

    #[test]
    fn round_robin_cycles_and_least_loaded_balances_tokens() {
        let now = Instant::now();
        let mut rng = SmallRng::seed_from_u64(1);
        let catalog = catalog(kvroute_policy());
        let engine = EngineConfig::default();
        let mut rr = build_router(&catalog[0], 3, &engine).unwrap();
        let p = prompt(0..100);
        let picks: Vec<usize> = (0..5)
            .map(|i| rr.route(i, &p, None, now, &mut rng).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1]);

        let mut ll = build_router(&catalog[2], 2, &engine).unwrap();
        let big = prompt(0..1000);
        let small = prompt(0..10);
        let first = ll.route(0, &big, None, now, &mut rng).unwrap();
        let second = ll.route(1, &small, None, now, &mut rng).unwrap();
        assert_ne!(first, second);
        // The small one's worker stays lighter until it grows past 1000 tokens.
        assert_eq!(ll.route(2, &small, None, now, &mut rng).unwrap(), second);
        ll.on_finished(0, now).unwrap();
        assert_eq!(ll.route(3, &small, None, now, &mut rng).unwrap(), first);
    }

    #[test]
    fn cache_aware_follows_its_tree_and_falls_back_to_the_smallest_tree() {
        let now = Instant::now();
        let mut rng = SmallRng::seed_from_u64(1);
        let engine = EngineConfig::default();
        let mut ca = CacheAware::new(3, &engine, CacheAwareConfig::default());
        let a = prompt(0..1000);
        let w = ca.route(0, &a, None, now, &mut rng).unwrap();
        // Same prompt: best match (100 % > 30 %).
        assert_eq!(ca.route(1, &a, None, now, &mut rng).unwrap(), w);
        // An unrelated prompt goes to a worker with an empty tree.
        let b = prompt(5000..6000);
        let other = ca.route(2, &b, None, now, &mut rng).unwrap();
        assert_ne!(other, w);
        // Imbalance: 70 requests on one worker, none elsewhere → least loaded wins.
        ca.in_flight = vec![70, 0, 0];
        let wa = ca.route(3, &a, None, now, &mut rng).unwrap();
        assert_ne!(wa, 0);
    }

    #[test]
    fn approximate_tree_evicts_least_recent_leaves_first() {
        let mut t = ApproxTree::default();
        t.insert(&[1, 2, 3], 1, 10);
        t.insert(&[1, 4], 2, 10);
        t.insert(&[5], 3, 4);
        // Over 4 nodes: the oldest (clock 1) deepest node, 3, goes first; then 2.
        assert!(!t.nodes.contains_key(&3));
        assert!(t.nodes.contains_key(&2));
        assert_eq!(t.matched_blocks(&[1, 2, 3]), 2);
        t.insert(&[6], 4, 4);
        assert!(!t.nodes.contains_key(&2));
        assert_eq!(t.matched_blocks(&[1, 4]), 2);
    }

    #[test]
    fn selector_router_books_and_follows_events() {
        let now = Instant::now();
        let mut rng = SmallRng::seed_from_u64(3);
        let engine = EngineConfig::default();
        let mut r = SelectorRouter::new(2, &engine, dynamo_policy(), None).unwrap();
        let p = prompt(0..640);
        // Worker 1 (index 1) reports the prompt's 10 blocks: the selector prefers it.
        r.on_kv_events(1, &[stored(&p)]);
        assert_eq!(r.route(0, &p, None, now, &mut rng).unwrap(), 1);
        r.on_first_token(0, now).unwrap();
        r.on_output_block(0, now).unwrap();
        r.on_finished(0, now).unwrap();
        assert!(r.on_finished(0, now).is_err(), "a second free is refused");
        assert_eq!(r.diagnostics(), RouterDiagnostics::default());
    }

    /// The engine's `Stored` of a prompt's blocks (engine hashes as the simulated engines make
    /// them: the sequence hashes).
    fn stored(p: &PromptHashes) -> KvEvent {
        KvEvent::Stored {
            parent: None,
            blocks: p
                .sequence
                .iter()
                .zip(&p.local)
                .map(|(&engine_hash, &local_hash)| StoredBlock {
                    engine_hash,
                    local_hash,
                })
                .collect(),
            tier: kvroute_core::event::Tier::Device,
        }
    }

    fn device_blocks(r: &SelectorRouter, p: &PromptHashes) -> Vec<u32> {
        let scores = r
            .selector
            .overlap_scores(&r.partition, Prompt::Hashes(p))
            .unwrap();
        let mut blocks: Vec<u32> = scores.workers.iter().map(|s| s.device_blocks).collect();
        blocks.sort_unstable();
        blocks
    }

    #[test]
    fn kvroute_predicts_in_the_core_until_events_confirm_or_the_ttl_passes() {
        let now = Instant::now();
        let mut rng = SmallRng::seed_from_u64(3);
        let engine = EngineConfig::default();
        let mut r = SelectorRouter::new(4, &engine, kvroute_policy(), None).unwrap();
        let p = prompt(0..6400);
        let w = r.route(0, &p, None, now, &mut rng).unwrap();
        r.on_first_token(0, now).unwrap();
        // No engine event yet, but the predicted 100 blocks make `w` a full hit: cost 0 + 100
        // shared decode blocks there, against 100 + 100 elsewhere.
        assert_eq!(r.route(1, &p, None, now, &mut rng).unwrap(), w);
        assert_eq!(r.selector.predicted_blocks(), 100);
        // The engine's events confirm the prediction: the same overlap, now the engine's own.
        r.on_kv_events(w, &[stored(&p)]);
        assert_eq!(r.selector.prediction_counters().confirmed, 100);
        assert_eq!(r.selector.predicted_blocks(), 0);
        assert_eq!(device_blocks(&r, &p), vec![0, 0, 0, 100]);

        // A prompt whose events never come counts as held for the TTL, then not.
        let q = prompt(10_000..16_400);
        let wq = r.route(2, &q, None, now, &mut rng).unwrap();
        assert_eq!(device_blocks(&r, &q), vec![0, 0, 0, 100]);
        let ttl = PredictConfig::default().ttl;
        r.route(3, &prompt(20_000..20_640), None, now + ttl, &mut rng)
            .unwrap();
        assert_eq!(device_blocks(&r, &q), vec![0, 0, 0, 0], "worker {wq}");
        assert_eq!(r.selector.prediction_counters().expired, 100);
        for id in 0..4 {
            r.on_finished(id, now + ttl).unwrap();
        }
        assert_eq!(r.diagnostics(), RouterDiagnostics::default());

        // `dynamo` does not predict (Dynamo 1.6.1's default).
        let mut d = SelectorRouter::new(4, &engine, dynamo_policy(), None).unwrap();
        d.route(0, &p, None, now, &mut rng).unwrap();
        assert_eq!(d.selector.predicted_blocks(), 0);
        assert_eq!(device_blocks(&d, &p), vec![0, 0, 0, 0]);
    }
}
