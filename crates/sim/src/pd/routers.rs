//! Routers of P/D fleets: each request gets a prefill engine (or a bypass) and a decode engine.
//!
//! | name | fleet | what it does |
//! |---|---|---|
//! | any aggregated policy ([`Whole`]) | aggregated | the policy of [`crate::policy`] over every engine; every request runs whole |
//! | `pd-round-robin` ([`Pair`]) | P/D | round robin over the prefill pool, round robin over the decode pool; never bypasses |
//! | `pd-cache-aware` ([`Pair`]) | P/D | `cache_aware`'s logic (SGLang's approximate trees) over the prefill pool, `least_loaded` (active tokens) over the decode pool; never bypasses |
//! | `kvroute-pd` ([`KvroutePd`]) | P/D | kvroute's selector with worker roles: `select_and_reserve_disaggregated` books both legs (or a bypass), the lifecycle frees each leg when it ends |
//!
//! Engines are numbered prefill pool first, then decode pool ([`PdRouter::on_kv_events`]);
//! [`PdRoute`] names them by their index within their pool.

use super::PdConfig;
use crate::engine::EngineConfig;
use crate::policy::{Policy, Router, SelectorPolicy, build_router};
use crate::{RequestId, SimError};
use hashbrown::HashMap;
use kvroute_core::error::PartitionKey;
use kvroute_core::event::KvEvent;
use kvroute_core::hash::PromptHashes;
use kvroute_core::selector::{
    LifecycleCalls, PdBypass, PredictConfig, Prompt, SelectRequest, Selector, SelectorConfig,
    WorkerRole, WorkerSpec,
};
use rand::rngs::SmallRng;
use std::time::Instant;

/// Why a request runs whole on a decode engine instead of in two legs (the core's reasons).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PdBypassReason {
    /// The part of the prompt no prefill engine holds is small: not worth a transfer.
    SmallUncached,
    /// Every prefill engine is busy past the admission thresholds.
    PrefillSaturated,
    /// The fleet has no prefill engine.
    NoPrefillWorkers,
}

impl PdBypassReason {
    pub fn name(self) -> &'static str {
        match self {
            Self::SmallUncached => "small_uncached",
            Self::PrefillSaturated => "prefill_saturated",
            Self::NoPrefillWorkers => "no_prefill_workers",
        }
    }
}

/// Where a request goes: its prefill engine (`None`: it runs whole on the decode engine) and its
/// decode engine, each an index within its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PdRoute {
    pub prefill: Option<usize>,
    pub decode: usize,
    /// Why there is no prefill leg, when the router bypassed one (`None` in an aggregated fleet).
    pub bypass: Option<PdBypassReason>,
}

/// A router of a P/D fleet as [`super::run_pd`] drives it.
pub trait PdRouter {
    fn name(&self) -> &str;
    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        session: Option<u64>,
        now: Instant,
        rng: &mut SmallRng,
    ) -> Result<PdRoute, SimError>;
    /// KV events of engine `engine` (prefill pool first, then decode pool) reached the router.
    fn on_kv_events(&mut self, engine: usize, events: &[KvEvent]);
    /// The request's prefill leg sampled its token (never called for a bypass).
    fn on_prefill_done(&mut self, id: RequestId, now: Instant) -> Result<(), SimError>;
    /// The decode engine produced the request's first token.
    fn on_first_token(&mut self, id: RequestId, now: Instant) -> Result<(), SimError>;
    /// The decode engine started a new output block of the request.
    fn on_output_block(&mut self, id: RequestId, now: Instant) -> Result<(), SimError>;
    /// The request's last token.
    fn on_finished(&mut self, id: RequestId, now: Instant) -> Result<(), SimError>;
    /// Bookings still held (0 for routers that book nothing).
    fn bookings_left(&self) -> usize {
        0
    }
    /// Σ chosen and Σ best device overlap of the selections of the engines that computed each
    /// prompt, as the router's own index saw them (`None`: it keeps no index).
    fn selector_overlap(&self) -> Option<(u64, u64)> {
        None
    }
}

/// An aggregated policy over every engine of an aggregated fleet.
pub struct Whole {
    name: String,
    router: Box<dyn Router>,
}

impl Whole {
    pub fn new(policy: &Policy, engines: usize, engine: &EngineConfig) -> Result<Self, SimError> {
        Ok(Self {
            name: policy.name.to_string(),
            router: build_router(policy, engines, engine)?,
        })
    }
}

impl PdRouter for Whole {
    fn name(&self) -> &str {
        &self.name
    }

    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        session: Option<u64>,
        now: Instant,
        rng: &mut SmallRng,
    ) -> Result<PdRoute, SimError> {
        let decode = self.router.route(id, prompt, session, now, rng)?;
        Ok(PdRoute {
            prefill: None,
            decode,
            bypass: None,
        })
    }

    fn on_kv_events(&mut self, engine: usize, events: &[KvEvent]) {
        self.router.on_kv_events(engine, events);
    }

    fn on_prefill_done(&mut self, _id: RequestId, _now: Instant) -> Result<(), SimError> {
        Ok(())
    }

    fn on_first_token(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.router.on_first_token(id, now)
    }

    fn on_output_block(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.router.on_output_block(id, now)
    }

    fn on_finished(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.router.on_finished(id, now)
    }
}

/// Two independent aggregated policies, one per pool: the prefill pool's router sees a request
/// from its arrival to its prefill leg's end (as a one-token request), the decode pool's from
/// its arrival to its last token.
pub struct Pair {
    name: &'static str,
    prefill_engines: usize,
    prefill: Box<dyn Router>,
    decode: Box<dyn Router>,
}

impl Pair {
    pub fn new(
        name: &'static str,
        prefill: (&Policy, usize, &EngineConfig),
        decode: (&Policy, usize, &EngineConfig),
    ) -> Result<Self, SimError> {
        Ok(Self {
            name,
            prefill_engines: prefill.1,
            prefill: build_router(prefill.0, prefill.1, prefill.2)?,
            decode: build_router(decode.0, decode.1, decode.2)?,
        })
    }
}

impl PdRouter for Pair {
    fn name(&self) -> &str {
        self.name
    }

    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        session: Option<u64>,
        now: Instant,
        rng: &mut SmallRng,
    ) -> Result<PdRoute, SimError> {
        let prefill = self.prefill.route(id, prompt, session, now, rng)?;
        let decode = self.decode.route(id, prompt, session, now, rng)?;
        Ok(PdRoute {
            prefill: Some(prefill),
            decode,
            bypass: None,
        })
    }

    fn on_kv_events(&mut self, engine: usize, events: &[KvEvent]) {
        match engine.checked_sub(self.prefill_engines) {
            None => self.prefill.on_kv_events(engine, events),
            Some(d) => self.decode.on_kv_events(d, events),
        }
    }

    fn on_prefill_done(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.prefill.on_first_token(id, now)?;
        self.prefill.on_finished(id, now)
    }

    fn on_first_token(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.decode.on_first_token(id, now)
    }

    fn on_output_block(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.decode.on_output_block(id, now)
    }

    fn on_finished(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.decode.on_finished(id, now)
    }
}

/// `kvroute-pd`: kvroute's [`Selector`] with the fleet's roles, driven as a P/D gateway drives
/// the service: each request is booked with `select_and_reserve_disaggregated` (a prefill and a
/// decode leg under `r<id>.prefill` / `r<id>.decode`, or one whole booking under `r<id>.decode`
/// for a bypass); the prefill leg's token is `prefill_complete` then `free` of its booking; the
/// decode engine's first token, output blocks and last token are the decode booking's
/// `prefill_complete`, `output_block` and `free`, as for an aggregated request.
pub struct KvroutePd {
    selector: Selector,
    partition: PartitionKey,
    prefill_engines: usize,
    /// Each routed request's (prefill booking, decode booking).
    bookings: HashMap<RequestId, (Option<String>, String)>,
    last_tick: Option<Instant>,
    overlap: (u64, u64),
}

impl KvroutePd {
    pub fn new(
        config: &PdConfig,
        policy: SelectorPolicy,
        bypass_tokens: u64,
    ) -> Result<Self, SimError> {
        let mut selector = Selector::new(SelectorConfig {
            scheduler: policy.scheduler,
            approximate_policy: policy.approximate_policy,
            predict: PredictConfig {
                ttl: policy.predicted_ttl,
                ..PredictConfig::default()
            },
            sessions: policy.sessions,
            pd_bypass_tokens: bypass_tokens,
            ..SelectorConfig::default()
        });
        let partition = PartitionKey::new("sim", "default");
        let engines = config.prefill_engines + config.decode_engines;
        for e in 0..engines {
            let (role, engine) = if e < config.prefill_engines {
                (WorkerRole::Prefill, &config.prefill_engine)
            } else {
                (WorkerRole::Decode, &config.decode_engine)
            };
            let id = e as u64 + 1;
            let outcome = selector.upsert_worker(WorkerSpec {
                worker_id: id,
                model_name: partition.model_name.clone(),
                routing_group: partition.routing_group.clone(),
                endpoint: Some(format!("sim://engine-{id}")),
                block_size: Some(engine.block_size),
                total_kv_blocks: engine.kv_blocks,
                max_num_batched_tokens: Some(engine.max_num_batched_tokens),
                // Marks the worker as publishing events: the simulator hands them over.
                kv_events_endpoint: policy.kv_events.then(|| "tcp://127.0.0.1:1".to_string()),
                role,
                ..WorkerSpec::default()
            })?;
            if !outcome.record.not_schedulable_reasons.is_empty() {
                return Err(SimError::Internal(format!(
                    "engine {id} is not schedulable: {}",
                    outcome.record.not_schedulable_reasons.join("; ")
                )));
            }
        }
        Ok(Self {
            selector,
            partition,
            prefill_engines: config.prefill_engines,
            bookings: HashMap::new(),
            last_tick: None,
            overlap: (0, 0),
        })
    }

    /// Each engine's booked requests as the selector counts them (prefill pool first).
    pub fn active_requests(&self) -> Vec<u64> {
        let mut loads: Vec<(u64, u64)> = self
            .selector
            .loads(None, None)
            .iter()
            .flat_map(|p| p.loads.iter())
            .map(|l| (l.worker_id, l.active_requests))
            .collect();
        loads.sort_unstable();
        loads.into_iter().map(|(_, n)| n).collect()
    }

    fn booking(&self, id: RequestId) -> Result<&(Option<String>, String), SimError> {
        self.bookings
            .get(&id)
            .ok_or_else(|| SimError::Internal(format!("request {id} was never booked")))
    }

    /// The pool index of a selected worker.
    fn pool_index(&self, worker_id: u64, prefill: bool) -> Result<usize, SimError> {
        let engine = usize::try_from(worker_id.saturating_sub(1))
            .map_err(|_| SimError::Internal("worker id out of range".into()))?;
        let index = if prefill {
            (engine < self.prefill_engines).then_some(engine)
        } else {
            engine.checked_sub(self.prefill_engines)
        };
        index.ok_or_else(|| {
            SimError::Internal(format!(
                "the selector put a {} leg on engine {engine}",
                if prefill { "prefill" } else { "decode" }
            ))
        })
    }
}

impl PdRouter for KvroutePd {
    fn name(&self) -> &str {
        "kvroute-pd"
    }

    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        session: Option<u64>,
        now: Instant,
        rng: &mut SmallRng,
    ) -> Result<PdRoute, SimError> {
        crate::policy::tick_each_second(&mut self.selector, &mut self.last_tick, now);
        let session = session.map(|s| s.to_string());
        let request = SelectRequest {
            session_id: session.as_deref(),
            ..SelectRequest::new(&self.partition, Prompt::Hashes(prompt))
        };
        let (picks, booked) = self.selector.select_and_reserve_disaggregated(
            &request,
            Some(&format!("r{id}")),
            now,
            rng,
        )?;
        let prefill = match &picks.prefill {
            Some(p) => Some(self.pool_index(p.worker_id, true)?),
            None => None,
        };
        let decode = self.pool_index(picks.decode.worker_id, false)?;
        let computing = picks.prefill.as_ref().unwrap_or(&picks.decode);
        self.overlap.0 += computing.overlap.gpu;
        self.overlap.1 += computing.best_gpu_overlap;
        self.bookings.insert(
            id,
            (
                booked.prefill.map(|r| r.reservation_id),
                booked.decode.reservation_id,
            ),
        );
        Ok(PdRoute {
            prefill,
            decode,
            bypass: picks.bypass.map(|b| match b {
                PdBypass::SmallUncached => PdBypassReason::SmallUncached,
                PdBypass::PrefillSaturated => PdBypassReason::PrefillSaturated,
                PdBypass::NoPrefillWorkers => PdBypassReason::NoPrefillWorkers,
            }),
        })
    }

    fn on_kv_events(&mut self, engine: usize, events: &[KvEvent]) {
        // Unapplicable events are counted by the index; the aggregated policies report them.
        let _ = self.selector.apply_events(engine as u64 + 1, 0, events);
    }

    fn on_prefill_done(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        let Some(leg) = self.booking(id)?.0.clone() else {
            return Err(SimError::Internal(format!(
                "request {id} has no prefill booking"
            )));
        };
        self.selector.prefill_complete(&leg, now)?;
        Ok(self.selector.free(&leg, now)?)
    }

    fn on_first_token(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        let leg = self.booking(id)?.1.clone();
        Ok(self.selector.prefill_complete(&leg, now)?)
    }

    fn on_output_block(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        let leg = self.booking(id)?.1.clone();
        Ok(self.selector.output_block(&leg, None, now)?)
    }

    fn on_finished(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        let Some((_, leg)) = self.bookings.remove(&id) else {
            return Err(SimError::Internal(format!("request {id} was never booked")));
        };
        Ok(self.selector.free(&leg, now)?)
    }

    fn selector_overlap(&self) -> Option<(u64, u64)> {
        Some(self.overlap)
    }

    fn bookings_left(&self) -> usize {
        // A rank still carrying load with no request would be a leak too.
        self.selector
            .loads(None, None)
            .iter()
            .flat_map(|p| p.loads.iter())
            .map(|l| {
                let residue = l.potential_prefill_tokens > 0 || l.potential_decode_blocks > 0;
                (l.active_requests as usize).max(usize::from(residue))
            })
            .sum()
    }
}
