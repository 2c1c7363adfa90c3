//! The discrete-event loop: arrivals, engine steps and KV-event deliveries on one virtual clock.
//!
//! Events are processed in `(time, sequence number)` order, so simultaneous events keep the order
//! they were scheduled in and a run is a pure function of the workload, the configuration, the
//! policy and the seed. Every arrival is scheduled up front, so an idle engine woken at time `t`
//! starts its step after every request that arrives at `t` has been routed.
//!
//! At the end of each step the engine's KV events reach the router (at once, or `event_delay`
//! later), then the router hears of first tokens, new output blocks and finished requests.

use crate::engine::{Engine, EngineConfig, EngineCounters};
use crate::policy::{
    OverlapTotals, Policy, Router, RouterDiagnostics, build_replica, build_router,
};
use crate::replicas::Replicated;
use crate::timing::Nanos;
use crate::workload::Workload;
use crate::{RequestId, SimError};
use kvroute_core::event::KvEvent;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

/// The event delay `kvroute sim` uses unless told otherwise: about one engine step, the lag of a
/// KV event published at a step's end and carried over a message bus (issue 29). Report figures
/// at 0 and 100 ms too. [`SimConfig::default`] keeps exact (0 ms) events, which the hand-derived
/// tests assume.
pub const DEFAULT_EVENT_DELAY: Duration = Duration::from_millis(20);

/// How late a router replica hears of another's bookings unless told otherwise: a NATS hop on
/// one site.
pub const DEFAULT_SYNC_DELAY: Duration = Duration::from_millis(5);

/// The fleet and the run's knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    pub workers: usize,
    pub engine: EngineConfig,
    /// How long an engine's KV events take to reach the router (0 by default here; the CLI's
    /// default is [`DEFAULT_EVENT_DELAY`]).
    pub event_delay: Duration,
    /// Seeds the policy's random choices (the same seed for every policy).
    pub seed: u64,
    /// Routers of the policy, requests dealt round robin across them ([`crate::replicas`]).
    pub router_replicas: usize,
    /// How late one replica hears of another's bookings (as over NATS).
    pub sync_delay: Duration,
    /// Whether selector-backed replicas are named, so each finds its place among the others
    /// and spreads near-equal picks (`kvroute_core::selector::ReplicaSpread`); off, they are
    /// anonymous and pick as a lone router would.
    pub replica_spread: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            workers: 8,
            engine: EngineConfig::default(),
            event_delay: Duration::ZERO,
            seed: 0,
            router_replicas: 1,
            sync_delay: DEFAULT_SYNC_DELAY,
            replica_spread: true,
        }
    }
}

impl SimConfig {
    pub fn validate(&self) -> Result<(), SimError> {
        if self.workers == 0 {
            return Err(SimError::invalid("workers", "must be greater than 0"));
        }
        if u32::try_from(self.workers).is_err() {
            return Err(SimError::invalid("workers", "must be at most 2^32 - 1"));
        }
        if self.router_replicas == 0 || self.router_replicas > 64 {
            return Err(SimError::invalid(
                "router-replicas",
                format!("must be between 1 and 64, got {}", self.router_replicas),
            ));
        }
        self.engine.validate()
    }
}

/// What happened to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestOutcome {
    pub worker: Option<u32>,
    pub arrival: Nanos,
    pub first_token: Option<Nanos>,
    pub finished: Option<Nanos>,
    /// Prompt tokens served from the engine's prefix cache at first admission.
    pub cached_tokens: u64,
    pub prompt_tokens: u64,
    /// When routed: the prompt's prefix cached on the chosen engine, in tokens, at arrival...
    pub chosen_overlap_tokens: u64,
    /// ...and the longest such prefix on any engine then (the decision quality of issue 29,
    /// against the engines' real caches).
    pub best_overlap_tokens: u64,
    /// When the step that first admitted it started.
    pub admitted: Option<Nanos>,
    /// The rest of the step the chosen engine was running at arrival (0 when it was idle): a
    /// wait no queue or policy on that engine can avoid.
    pub step_in_flight_wait: Nanos,
    /// Larger than any engine's KV pool: never routed.
    pub rejected: bool,
}

/// The raw result of one policy's run.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyRun {
    pub policy: String,
    pub requests: Vec<RequestOutcome>,
    pub engines: Vec<EngineCounters>,
    pub router: RouterDiagnostics,
    /// The chosen and best device overlap of a selector-backed router's selections, as its index
    /// saw them (`None` for the other policies).
    pub selector_overlap: Option<OverlapTotals>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival(RequestId),
    StepStart(u32),
    StepEnd(u32),
    DeliverEvents(u32),
}

struct Queue {
    heap: BinaryHeap<Reverse<(Nanos, u64, Event)>>,
    next_sequence: u64,
}

impl Queue {
    fn push(&mut self, at: Nanos, event: Event) {
        self.heap.push(Reverse((at, self.next_sequence, event)));
        self.next_sequence += 1;
    }
}

/// Replays `workload` on `config.workers` simulated engines routed by `policy`.
///
/// `origin` is the `Instant` that virtual time 0 maps to (the core API takes `Instant`s); it is
/// never compared with the wall clock. `progress` is called with the number of finished (or
/// rejected) requests as the run advances.
pub fn run_policy(
    workload: &Workload,
    config: &SimConfig,
    policy: &Policy,
    origin: Instant,
    progress: &mut dyn FnMut(usize),
) -> Result<PolicyRun, SimError> {
    config.validate()?;
    if workload.block_size != config.engine.block_size {
        return Err(SimError::invalid(
            "block-size",
            format!(
                "the workload was hashed with block size {} but the engines use {}",
                workload.block_size, config.engine.block_size
            ),
        ));
    }
    let mut router: Box<dyn Router> = if config.router_replicas > 1 {
        let replicas = (0..config.router_replicas)
            .map(|index| {
                let name = config.replica_spread.then_some(index);
                build_replica(policy, config.workers, &config.engine, name)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Box::new(Replicated::new(replicas, config.sync_delay)?)
    } else {
        build_router(policy, config.workers, &config.engine)?
    };
    let mut rng = SmallRng::seed_from_u64(config.seed);
    let mut engines: Vec<Engine> = (0..config.workers)
        .map(|_| Engine::new(config.engine))
        .collect();
    let mut wake_pending = vec![false; config.workers];
    // When each engine's step in flight started and ends.
    let mut steps: Vec<(Nanos, Nanos)> = vec![(0, 0); config.workers];
    let mut delayed: Vec<VecDeque<Vec<KvEvent>>> = vec![VecDeque::new(); config.workers];
    let delay_nanos = u64::try_from(config.event_delay.as_nanos()).unwrap_or(u64::MAX);
    let requests = &workload.requests;
    let mut outcomes: Vec<RequestOutcome> = requests
        .iter()
        .map(|r| RequestOutcome {
            arrival: r.arrival_nanos,
            prompt_tokens: r.prompt.isl_tokens,
            ..RequestOutcome::default()
        })
        .collect();
    let mut queue = Queue {
        heap: BinaryHeap::with_capacity(requests.len() + 2 * config.workers),
        next_sequence: 0,
    };
    for (i, r) in requests.iter().enumerate() {
        let id = RequestId::try_from(i)
            .map_err(|_| SimError::invalid("max-requests", "at most 2^32 - 1 requests"))?;
        queue.push(r.arrival_nanos, Event::Arrival(id));
    }
    let mut done = 0usize;
    let at = |t: Nanos| origin + Duration::from_nanos(t);

    while let Some(Reverse((t, _, event))) = queue.heap.pop() {
        let now = at(t);
        match event {
            Event::Arrival(id) => {
                let request = &requests[id as usize];
                if !config.engine.fits(request) {
                    outcomes[id as usize].rejected = true;
                    done += 1;
                    progress(done);
                    continue;
                }
                let w = router.route(id, &request.prompt, request.session_id, now, &mut rng)?;
                let block_size = u64::from(config.engine.block_size);
                let cached_tokens = |e: &Engine| {
                    e.pool().cached_prefix_blocks(&request.prompt.sequence) as u64 * block_size
                };
                let best = engines.iter().map(cached_tokens).max().unwrap_or(0);
                let Some(engine) = engines.get_mut(w) else {
                    return Err(SimError::Internal(format!(
                        "policy {} chose worker {w} of {}",
                        policy.name, config.workers
                    )));
                };
                let chosen = cached_tokens(engine);
                let in_flight_wait = if engine.in_step() {
                    steps[w].1.saturating_sub(t)
                } else {
                    0
                };
                engine.submit(id, request);
                let outcome = &mut outcomes[id as usize];
                outcome.step_in_flight_wait = in_flight_wait;
                outcome.worker = Some(w as u32);
                outcome.chosen_overlap_tokens = chosen;
                outcome.best_overlap_tokens = best;
                if !engine.in_step() && !wake_pending[w] {
                    wake_pending[w] = true;
                    queue.push(t, Event::StepStart(w as u32));
                }
            }
            Event::StepStart(w) => {
                wake_pending[w as usize] = false;
                start_step(
                    &mut engines[w as usize],
                    w,
                    t,
                    workload,
                    &mut queue,
                    &mut steps,
                )?;
            }
            Event::StepEnd(w) => {
                let report = engines[w as usize].finish_step();
                for &(id, cached) in &report.first_admissions {
                    outcomes[id as usize].cached_tokens = cached;
                    outcomes[id as usize].admitted = Some(steps[w as usize].0);
                }
                if !report.events.is_empty() {
                    if delay_nanos == 0 {
                        router.on_kv_events(w as usize, &report.events);
                    } else {
                        delayed[w as usize].push_back(report.events);
                        queue.push(t.saturating_add(delay_nanos), Event::DeliverEvents(w));
                    }
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
                    done += 1;
                    progress(done);
                }
                start_step(
                    &mut engines[w as usize],
                    w,
                    t,
                    workload,
                    &mut queue,
                    &mut steps,
                )?;
            }
            Event::DeliverEvents(w) => {
                if let Some(events) = delayed[w as usize].pop_front() {
                    router.on_kv_events(w as usize, &events);
                }
            }
        }
    }
    if let Some((w, _)) = engines.iter().enumerate().find(|(_, e)| e.has_work()) {
        return Err(SimError::Internal(format!(
            "engine {w} stalled with requests left"
        )));
    }
    Ok(PolicyRun {
        policy: policy.name.to_string(),
        requests: outcomes,
        engines: engines.iter().map(Engine::counters).collect(),
        router: router.diagnostics(),
        selector_overlap: router.selector_overlap(),
    })
}

fn start_step(
    engine: &mut Engine,
    w: u32,
    t: Nanos,
    workload: &Workload,
    queue: &mut Queue,
    steps: &mut [(Nanos, Nanos)],
) -> Result<(), SimError> {
    if engine.in_step() {
        return Ok(());
    }
    match engine.start_step(&workload.requests)? {
        Some(duration) => {
            let end = t.saturating_add(duration);
            steps[w as usize] = (t, end);
            queue.push(end, Event::StepEnd(w));
        }
        None if engine.has_work() => {
            return Err(SimError::Internal(format!(
                "engine {w} has {} waiting and {} running requests but scheduled nothing",
                engine.waiting_len(),
                engine.running_len()
            )));
        }
        None => {}
    }
    Ok(())
}
