//! Routing policies: who gets each request. One file per policy, each opening with its
//! algorithm; this module holds their catalog, the [`Router`] trait the simulator drives and the
//! helpers they share.
//!
//! | name | what it does |
//! |---|---|
//! | `round_robin` | worker `i mod N` |
//! | `random` | uniform (seeded) |
//! | `least_loaded` | fewest active tokens (prompt + output so far of its in-flight requests) |
//! | `cache_aware` | SGLang's cache-aware router: an approximate per-worker prefix tree fed by its own routing decisions; when loads are imbalanced (max − min > 64 requests and max > 1.5 × min) the least-loaded worker, else the best match if it covers > 30 % of the prompt, else the worker with the smallest tree |
//! | `dynamo` | kvroute's selector with Dynamo's default weights, fed the engines' exact KV events |
//! | `kvroute` | the selector with kvroute's own settings: the cost in predicted time, the core's predict-on-route (see [`kvroute_policy`]) |
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
// A run holds a handful of these, copied by value: the size of the largest (a whole selector
// configuration) does not matter, and boxing it would cost `Copy`.
#[allow(clippy::large_enum_variant)]
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

/// The replica id router replica `index` has in replica sync.
pub fn replica_name(index: usize) -> String {
    format!("replica-{index}")
}

/// Worker ids the selector sees: 1-based, so worker 0 of the simulator is id 1.
fn worker_id(worker: usize) -> u64 {
    worker as u64 + 1
}

mod cache_aware;
mod least_loaded;
mod random;
mod round_robin;
mod selector;
pub(crate) use selector::tick_each_second;
#[cfg(test)]
mod tests;

use cache_aware::CacheAware;
use least_loaded::LeastLoaded;
use random::RandomRouter;
use round_robin::RoundRobin;
use selector::SelectorRouter;
