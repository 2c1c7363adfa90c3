//! Disaggregated prefill/decode (P/D) fleets: `N` prefill engines and `M` decode engines.
//!
//! A request routed to a pair runs in three legs:
//! 1. **Prefill** on a prefill engine: the prompt with one output token (the engine's own
//!    scheduler, step model, prefix cache and LRU; its KV events reach the router as an
//!    aggregated engine's do). The leg ends when that token is sampled; its blocks stay cached
//!    on the prefill engine.
//! 2. **Transfer** of the prompt's KV to the decode engine: the prompt blocks the decode engine
//!    does not hold when the prefill ends, × bytes per block ÷ bandwidth ([`TransferModel`]).
//! 3. **Decode** on the decode engine ([`Engine::submit_transferred`]): admission holds the
//!    prompt's blocks at no compute cost (they become the decode engine's cache and KV events),
//!    the first step computes the last prompt token as a decode token and samples the first
//!    output token, then it decodes to its length.
//!
//! TTFT is therefore prefill done + transfer + the decode engine's wait and first step. A
//! **bypass** request (the router says so) runs whole on a decode engine, prefill included, as
//! on an aggregated engine. An aggregated fleet is the case `N = 0`, every request a bypass,
//! which is how [`crate::pd::compare`] runs both kinds of fleets through one loop.
//!
//! The loop is [`crate::sim::run_policy`]'s, without the router-side queue and router replicas:
//! events in `(time, sequence)` order on one virtual clock, every arrival scheduled up front, so
//! a run is a pure function of the workload, the configuration, the router and the seed.

use crate::engine::{Engine, EngineConfig, EngineCounters};
use crate::timing::Nanos;
use crate::workload::{SimRequest, Workload};
use crate::{RequestId, SimError};
use kvroute_core::event::KvEvent;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

pub mod compare;
pub mod routers;
#[cfg(test)]
mod tests;

pub use routers::{PdBypassReason, PdRoute, PdRouter};

/// How long a prompt's KV takes to reach the decode engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferModel {
    /// KV bytes per token (all layers, K and V).
    pub kv_bytes_per_token: u64,
    /// Bytes per second between a prefill and a decode engine.
    pub bytes_per_sec: f64,
}

/// 64 KiB a token: Llama-3.1-8B's fp8 KV (2 × 32 layers × 8 heads × 128 dimensions), the batch
/// engine model's figure.
pub const DEFAULT_KV_BYTES_PER_TOKEN: u64 = 64 * 1024;

/// 50 GB/s: one 400 Gb/s RDMA NIC per GPU.
pub const DEFAULT_TRANSFER_BYTES_PER_SEC: f64 = 50e9;

impl Default for TransferModel {
    fn default() -> Self {
        Self {
            kv_bytes_per_token: DEFAULT_KV_BYTES_PER_TOKEN,
            bytes_per_sec: DEFAULT_TRANSFER_BYTES_PER_SEC,
        }
    }
}

impl TransferModel {
    /// The time `blocks` blocks of `block_size` tokens take to cross.
    pub fn nanos(&self, blocks: u64, block_size: u32) -> Nanos {
        let bytes = blocks as f64 * block_size as f64 * self.kv_bytes_per_token as f64;
        let nanos = (bytes / self.bytes_per_sec * 1e9).round();
        if nanos.is_finite() && nanos >= 0.0 {
            nanos as Nanos
        } else {
            Nanos::MAX
        }
    }
}

/// A P/D fleet and the run's knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdConfig {
    /// Prefill engines; 0 is an aggregated fleet of `decode_engines` engines.
    pub prefill_engines: usize,
    /// Decode engines (in an aggregated fleet: every engine).
    pub decode_engines: usize,
    pub prefill_engine: EngineConfig,
    pub decode_engine: EngineConfig,
    pub transfer: TransferModel,
    /// How long an engine's KV events take to reach the router.
    pub event_delay: Duration,
    /// Seeds the router's random choices.
    pub seed: u64,
    /// `kvroute-pd`: a request whose best decode engine lacks at most this many of its prompt's
    /// tokens runs there whole (`SelectorConfig::pd_bypass_tokens`).
    pub bypass_tokens: u64,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self {
            prefill_engines: 2,
            decode_engines: 6,
            prefill_engine: EngineConfig::default(),
            decode_engine: EngineConfig::default(),
            transfer: TransferModel::default(),
            event_delay: Duration::ZERO,
            seed: 0,
            bypass_tokens: kvroute_core::selector::DEFAULT_PD_BYPASS_TOKENS,
        }
    }
}

impl PdConfig {
    /// An aggregated fleet of `engines` engines (every request runs whole on one).
    pub fn aggregated(engines: usize, engine: EngineConfig) -> Self {
        Self {
            prefill_engines: 0,
            decode_engines: engines,
            prefill_engine: engine,
            decode_engine: engine,
            ..Self::default()
        }
    }

    /// `8 agg` or `2P+6D`.
    pub fn fleet_name(&self) -> String {
        if self.prefill_engines == 0 {
            format!("{} agg", self.decode_engines)
        } else {
            format!("{}P+{}D", self.prefill_engines, self.decode_engines)
        }
    }

    pub fn validate(&self) -> Result<(), SimError> {
        if self.decode_engines == 0 {
            return Err(SimError::invalid(
                "decode-engines",
                "must be greater than 0",
            ));
        }
        if u32::try_from(self.prefill_engines + self.decode_engines).is_err() {
            return Err(SimError::invalid(
                "decode-engines",
                "at most 2^32 - 1 engines in all",
            ));
        }
        if self.prefill_engine.block_size != self.decode_engine.block_size {
            return Err(SimError::invalid(
                "block-size",
                "prefill and decode engines must use one block size",
            ));
        }
        let t = &self.transfer;
        if !(t.bytes_per_sec.is_finite() && t.bytes_per_sec > 0.0) {
            return Err(SimError::invalid(
                "pd-transfer-gbps",
                format!("must be a positive number, got {}", t.bytes_per_sec / 1e9),
            ));
        }
        self.prefill_engine.validate()?;
        self.decode_engine.validate()
    }
}

/// What happened to one request in a P/D run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PdOutcome {
    pub arrival: Nanos,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// The prefill engine (index in the prefill pool); `None` for a bypass.
    pub prefill_engine: Option<u32>,
    /// The decode engine (index in the decode pool).
    pub decode_engine: Option<u32>,
    /// Why it ran whole on a decode engine, when the router said so.
    pub bypass: Option<PdBypassReason>,
    /// When its prefill leg sampled its token.
    pub prefill_done: Option<Nanos>,
    /// Prompt blocks copied to the decode engine, and how long that took.
    pub transferred_blocks: u64,
    pub transfer_nanos: Nanos,
    /// Prompt tokens found cached where the prompt was computed (the prefill engine, or the
    /// decode engine for a bypass).
    pub cached_tokens: u64,
    /// Prompt tokens the decode engine already held when the leg was admitted.
    pub decode_cached_tokens: u64,
    /// When routed: the prompt's prefix resident on the engine chosen to compute it (the
    /// prefill engine, or the decode engine of a bypass), in tokens...
    pub chosen_overlap_tokens: u64,
    /// ...and the longest such prefix on any engine of that pool then.
    pub best_overlap_tokens: u64,
    /// The first token the client sees (from the decode engine).
    pub first_token: Option<Nanos>,
    pub finished: Option<Nanos>,
    /// Larger than an engine's KV pool: never routed.
    pub rejected: bool,
}

/// The raw result of one router's run on one fleet.
#[derive(Debug, Clone, PartialEq)]
pub struct PdRun {
    pub policy: String,
    pub fleet: String,
    pub prefill_engines: usize,
    pub requests: Vec<PdOutcome>,
    /// Every gap between two consecutive output tokens of a request, nanoseconds, sorted.
    pub token_gaps: Vec<Nanos>,
    /// Prefill engines first, then decode engines.
    pub engines: Vec<EngineCounters>,
    /// Bookings the router still held when the run ended (0 for a correct router).
    pub bookings_left: usize,
    /// The router's own view of its picks ([`PdRouter::selector_overlap`]).
    pub selector_overlap: Option<(u64, u64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival(RequestId),
    StepStart(u32),
    StepEnd(u32),
    DeliverEvents(u32),
    TransferDone(RequestId),
}

/// Replays `workload` on the fleet `config` describes, routed by `router`. `origin` is the
/// `Instant` virtual time 0 maps to (never compared with the wall clock).
pub fn run_pd(
    workload: &Workload,
    config: &PdConfig,
    router: &mut dyn PdRouter,
    origin: Instant,
) -> Result<PdRun, SimError> {
    config.validate()?;
    if workload.block_size != config.decode_engine.block_size {
        return Err(SimError::invalid(
            "block-size",
            format!(
                "the workload was hashed with block size {} but the engines use {}",
                workload.block_size, config.decode_engine.block_size
            ),
        ));
    }
    let requests = &workload.requests;
    // The prefill leg of each request: its prompt and one output token.
    let prefill_legs: Vec<SimRequest> = if config.prefill_engines > 0 {
        requests
            .iter()
            .map(|r| SimRequest {
                output_tokens: 1,
                ..r.clone()
            })
            .collect()
    } else {
        Vec::new()
    };
    let n = config.prefill_engines;
    let total = n + config.decode_engines;
    let mut fleet = PdFleet {
        engines: (0..total)
            .map(|e| {
                Engine::new(if e < n {
                    config.prefill_engine
                } else {
                    config.decode_engine
                })
            })
            .collect(),
        prefill_engines: n,
        wake_pending: vec![false; total],
        heap: BinaryHeap::with_capacity(requests.len() + 2 * total),
        next_sequence: 0,
    };
    let mut outcomes: Vec<PdOutcome> = requests
        .iter()
        .map(|r| PdOutcome {
            arrival: r.arrival_nanos,
            prompt_tokens: r.prompt.isl_tokens,
            output_tokens: r.output_tokens.max(1),
            ..PdOutcome::default()
        })
        .collect();
    let mut last_sample: Vec<Option<Nanos>> = vec![None; requests.len()];
    let mut token_gaps = Vec::new();
    let mut delayed: Vec<VecDeque<Vec<KvEvent>>> = vec![VecDeque::new(); total];
    let delay_nanos = u64::try_from(config.event_delay.as_nanos()).unwrap_or(u64::MAX);
    let mut rng = SmallRng::seed_from_u64(config.seed);
    for (i, r) in requests.iter().enumerate() {
        let id = RequestId::try_from(i)
            .map_err(|_| SimError::invalid("max-requests", "at most 2^32 - 1 requests"))?;
        fleet.push(r.arrival_nanos, Event::Arrival(id));
    }
    let at = |t: Nanos| origin + Duration::from_nanos(t);
    let block_size = config.decode_engine.block_size;

    while let Some(Reverse((t, _, event))) = fleet.heap.pop() {
        let now = at(t);
        match event {
            Event::Arrival(id) => {
                let request = &requests[id as usize];
                let outcome = &mut outcomes[id as usize];
                let prefill_fits = n == 0 || config.prefill_engine.fits(&prefill_legs[id as usize]);
                if !(prefill_fits && config.decode_engine.fits(request)) {
                    outcome.rejected = true;
                    continue;
                }
                let route = router.route(id, &request.prompt, request.session_id, now, &mut rng)?;
                if route.decode >= config.decode_engines || route.prefill.is_some_and(|p| p >= n) {
                    return Err(SimError::Internal(format!(
                        "router {} chose {route:?} in a fleet of {}",
                        router.name(),
                        config.fleet_name()
                    )));
                }
                outcome.decode_engine = Some(route.decode as u32);
                outcome.bypass = route.bypass;
                let (pool, chosen) = match route.prefill {
                    Some(p) => (&fleet.engines[..n], p),
                    None => (&fleet.engines[n..], route.decode),
                };
                let resident = |e: &Engine| {
                    e.pool().cached_prefix_blocks(&request.prompt.sequence) as u64
                        * u64::from(block_size)
                };
                outcome.chosen_overlap_tokens = pool.get(chosen).map_or(0, resident);
                outcome.best_overlap_tokens = pool.iter().map(resident).max().unwrap_or(0);
                match route.prefill {
                    Some(p) => {
                        outcome.prefill_engine = Some(p as u32);
                        fleet.engines[p].submit(id, &prefill_legs[id as usize]);
                        fleet.wake(p, t);
                    }
                    None => {
                        fleet.engines[n + route.decode].submit(id, request);
                        fleet.wake(n + route.decode, t);
                    }
                }
            }
            Event::StepStart(e) => {
                fleet.wake_pending[e as usize] = false;
                fleet.start_step(e as usize, t, requests, &prefill_legs)?;
            }
            Event::StepEnd(e) => {
                let e = e as usize;
                let report = fleet.engines[e].finish_step();
                let prefill_side = e < n;
                if !report.events.is_empty() {
                    if delay_nanos == 0 {
                        router.on_kv_events(e, &report.events);
                    } else {
                        delayed[e].push_back(report.events);
                        fleet.push(
                            t.saturating_add(delay_nanos),
                            Event::DeliverEvents(e as u32),
                        );
                    }
                }
                for &(id, cached) in &report.first_admissions {
                    let outcome = &mut outcomes[id as usize];
                    if prefill_side || outcome.prefill_engine.is_none() {
                        outcome.cached_tokens = cached;
                    } else {
                        outcome.decode_cached_tokens = cached;
                    }
                }
                if prefill_side {
                    for &id in &report.finished {
                        let outcome = &mut outcomes[id as usize];
                        outcome.prefill_done = Some(t);
                        router.on_prefill_done(id, now)?;
                        let d = outcome.decode_engine.map_or(0, |d| d as usize);
                        let prompt = &requests[id as usize].prompt;
                        let held = fleet.engines[n + d]
                            .pool()
                            .cached_prefix_blocks(&prompt.sequence)
                            as u64;
                        let blocks = prompt
                            .isl_tokens
                            .div_ceil(u64::from(block_size))
                            .saturating_sub(held);
                        let nanos = config.transfer.nanos(blocks, block_size);
                        outcome.transferred_blocks = blocks;
                        outcome.transfer_nanos = nanos;
                        fleet.push(t.saturating_add(nanos), Event::TransferDone(id));
                    }
                } else {
                    for &id in &report.sampled {
                        if let Some(last) = last_sample[id as usize] {
                            token_gaps.push(t.saturating_sub(last));
                        }
                        last_sample[id as usize] = Some(t);
                    }
                    for &id in &report.first_tokens {
                        outcomes[id as usize].first_token = Some(t);
                        router.on_first_token(id, now)?;
                    }
                    for &id in &report.output_blocks {
                        router.on_output_block(id, now)?;
                    }
                    for &id in &report.finished {
                        outcomes[id as usize].finished = Some(t);
                        router.on_finished(id, now)?;
                    }
                }
                fleet.start_step(e, t, requests, &prefill_legs)?;
            }
            Event::DeliverEvents(e) => {
                if let Some(events) = delayed[e as usize].pop_front() {
                    router.on_kv_events(e as usize, &events);
                }
            }
            Event::TransferDone(id) => {
                let d = outcomes[id as usize]
                    .decode_engine
                    .map_or(0, |d| d as usize);
                fleet.engines[n + d].submit_transferred(id, &requests[id as usize]);
                fleet.wake(n + d, t);
            }
        }
    }
    if let Some((e, _)) = fleet.engines.iter().enumerate().find(|(_, e)| e.has_work()) {
        return Err(SimError::Internal(format!(
            "engine {e} stalled with requests left"
        )));
    }
    token_gaps.sort_unstable();
    Ok(PdRun {
        policy: router.name().to_string(),
        fleet: config.fleet_name(),
        prefill_engines: n,
        requests: outcomes,
        token_gaps,
        engines: fleet.engines.iter().map(Engine::counters).collect(),
        bookings_left: router.bookings_left(),
        selector_overlap: router.selector_overlap(),
    })
}

/// The engines and the event queue of a run.
struct PdFleet {
    /// Prefill engines first, then decode engines.
    engines: Vec<Engine>,
    prefill_engines: usize,
    wake_pending: Vec<bool>,
    heap: BinaryHeap<Reverse<(Nanos, u64, Event)>>,
    next_sequence: u64,
}

impl PdFleet {
    fn push(&mut self, at: Nanos, event: Event) {
        self.heap.push(Reverse((at, self.next_sequence, event)));
        self.next_sequence += 1;
    }

    /// An idle engine that was given work starts a step once every event of this instant ran.
    fn wake(&mut self, e: usize, t: Nanos) {
        if !self.engines[e].in_step() && !self.wake_pending[e] {
            self.wake_pending[e] = true;
            self.push(t, Event::StepStart(e as u32));
        }
    }

    fn start_step(
        &mut self,
        e: usize,
        t: Nanos,
        requests: &[SimRequest],
        prefill_legs: &[SimRequest],
    ) -> Result<(), SimError> {
        let engine = &mut self.engines[e];
        if engine.in_step() {
            return Ok(());
        }
        let source = if e < self.prefill_engines {
            prefill_legs
        } else {
            requests
        };
        match engine.start_step(source)? {
            Some(duration) => self.push(t.saturating_add(duration), Event::StepEnd(e as u32)),
            None if engine.has_work() => {
                return Err(SimError::Internal(format!(
                    "engine {e} has {} waiting and {} running requests but scheduled nothing",
                    engine.waiting_len(),
                    engine.running_len()
                )));
            }
            None => {}
        }
        Ok(())
    }
}
