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
use kvroute_core::admission::{
    AdmissionQueue, QueueConfig, QueueError, QueueOrder, QueuePolicy, over_threshold,
};
use kvroute_core::event::KvEvent;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

/// The event delay `kvroute sim` uses unless told otherwise: about one engine step, the lag of a
/// KV event published at a step's end and carried over a message bus. Report figures
/// at 0 and 100 ms too. [`SimConfig::default`] keeps exact (0 ms) events, which the hand-derived
/// tests assume.
pub const DEFAULT_EVENT_DELAY: Duration = Duration::from_millis(20);

/// How late a router replica hears of another's bookings unless told otherwise: a NATS hop on
/// one site.
pub const DEFAULT_SYNC_DELAY: Duration = Duration::from_millis(5);

/// The TTFT a request must meet to count toward goodput unless told otherwise.
pub const DEFAULT_TTFT_TARGET: Duration = Duration::from_secs(2);

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
    /// The router-side queue (admission control; `None`: every request is routed when it arrives).
    pub queue: Option<SimQueue>,
    /// A request whose TTFT is at most this counts toward goodput.
    pub ttft_target: Duration,
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
            queue: None,
            ttft_target: DEFAULT_TTFT_TARGET,
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
        if let Some(q) = &self.queue {
            if !(q.threshold.is_finite() && q.threshold >= 0.0) {
                return Err(SimError::invalid(
                    "queue-threshold",
                    format!("must be a non-negative number, got {}", q.threshold),
                ));
            }
            if q.max_requests == 0 {
                return Err(SimError::invalid(
                    "queue-max-requests",
                    "must be at least 1",
                ));
            }
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
    /// ...and the longest such prefix on any engine then (the decision quality,
    /// against the engines' real caches).
    pub best_overlap_tokens: u64,
    /// When the step that first admitted it started.
    pub admitted: Option<Nanos>,
    /// The rest of the step the chosen engine was running at arrival (0 when it was idle): a
    /// wait no queue or policy on that engine can avoid.
    pub step_in_flight_wait: Nanos,
    /// The request's tenant ([`crate::SimRequest::tenant`]).
    pub tenant: Option<u32>,
    /// Time spent in the router's queue before being routed (0 when routed at arrival).
    pub queued: Nanos,
    /// Why the router's queue dropped it unrouted, if it did.
    pub shed: Option<Shed>,
    /// Larger than any engine's KV pool: never routed.
    pub rejected: bool,
}

/// Why the router-side queue dropped a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// The queue held `--queue-max-requests` already (the service answers 429 at once).
    QueueFull,
    /// It waited `--queue-timeout-ms` (the service answers 429).
    TimedOut,
}

/// The router-side queue (admission control), as the simulator runs it (`kvroute_core::admission`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimQueue {
    /// Requests wait while every worker's routed, not yet prefilled prompt tokens exceed this ×
    /// `max_num_batched_tokens`.
    pub threshold: f64,
    pub policy: QueuePolicy,
    pub max_requests: usize,
    pub timeout: Option<Duration>,
    /// Also full: a worker whose routed, unfinished requests' prompt and output tokens exceed
    /// this share of its KV pool (kvroute's addition; Dynamo's threshold sees only prefill).
    pub kv_threshold: Option<f64>,
}

impl SimQueue {
    pub fn queue_config(&self) -> QueueConfig {
        QueueConfig {
            threshold: Some(self.threshold),
            policy: self.policy,
            max_requests: self.max_requests,
            timeout: self.timeout,
            ..QueueConfig::default()
        }
    }
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
    let requests = &workload.requests;
    let mut fleet = Fleet {
        config,
        policy: policy.name,
        workload,
        engines: (0..config.workers)
            .map(|_| Engine::new(config.engine))
            .collect(),
        wake_pending: vec![false; config.workers],
        steps: vec![(0, 0); config.workers],
        outcomes: requests
            .iter()
            .map(|r| RequestOutcome {
                arrival: r.arrival_nanos,
                prompt_tokens: r.prompt.isl_tokens,
                tenant: r.tenant,
                ..RequestOutcome::default()
            })
            .collect(),
        events: Queue {
            heap: BinaryHeap::with_capacity(requests.len() + 2 * config.workers),
            next_sequence: 0,
        },
        admission: config.queue.map(|q| AdmissionQueue::new(q.queue_config())),
        routed_prefill: vec![0; config.workers],
        routed_tokens: vec![0; config.workers],
        done: 0,
    };
    let mut delayed: Vec<VecDeque<Vec<KvEvent>>> = vec![VecDeque::new(); config.workers];
    let delay_nanos = u64::try_from(config.event_delay.as_nanos()).unwrap_or(u64::MAX);
    for (i, r) in requests.iter().enumerate() {
        let id = RequestId::try_from(i)
            .map_err(|_| SimError::invalid("max-requests", "at most 2^32 - 1 requests"))?;
        fleet.events.push(r.arrival_nanos, Event::Arrival(id));
    }
    let at = |t: Nanos| origin + Duration::from_nanos(t);

    while let Some(Reverse((t, _, event))) = fleet.events.heap.pop() {
        let now = at(t);
        match event {
            Event::Arrival(id) => {
                let request = &requests[id as usize];
                if !config.engine.fits(request) {
                    fleet.outcomes[id as usize].rejected = true;
                    fleet.finish_one(progress);
                    continue;
                }
                fleet.admit(router.as_mut(), &mut rng, id, t, now, progress)?;
            }
            Event::StepStart(w) => {
                fleet.wake_pending[w as usize] = false;
                fleet.start_step(w, t)?;
            }
            Event::StepEnd(w) => {
                let report = fleet.engines[w as usize].finish_step();
                for &(id, cached) in &report.first_admissions {
                    fleet.outcomes[id as usize].cached_tokens = cached;
                    fleet.outcomes[id as usize].admitted = Some(fleet.steps[w as usize].0);
                }
                if !report.events.is_empty() {
                    if delay_nanos == 0 {
                        router.on_kv_events(w as usize, &report.events);
                    } else {
                        delayed[w as usize].push_back(report.events);
                        fleet
                            .events
                            .push(t.saturating_add(delay_nanos), Event::DeliverEvents(w));
                    }
                }
                for &id in &report.first_tokens {
                    fleet.outcomes[id as usize].first_token = Some(t);
                    let prompt = requests[id as usize].prompt.isl_tokens;
                    let routed = &mut fleet.routed_prefill[w as usize];
                    *routed = routed.saturating_sub(prompt);
                    router.on_first_token(id, now)?;
                }
                for &id in &report.output_blocks {
                    router.on_output_block(id, now)?;
                }
                for &id in &report.finished {
                    fleet.outcomes[id as usize].finished = Some(t);
                    let r = &requests[id as usize];
                    let held = &mut fleet.routed_tokens[w as usize];
                    *held = held.saturating_sub(r.prompt.isl_tokens + r.output_tokens);
                    router.on_finished(id, now)?;
                    fleet.finish_one(progress);
                }
                fleet.start_step(w, t)?;
                if !report.first_tokens.is_empty() || !report.finished.is_empty() {
                    // Prefill completed or a request left: room for waiting requests, maybe.
                    fleet.release(router.as_mut(), &mut rng, t, now, progress)?;
                }
            }
            Event::DeliverEvents(w) => {
                if let Some(events) = delayed[w as usize].pop_front() {
                    router.on_kv_events(w as usize, &events);
                }
            }
        }
    }
    if let Some((w, _)) = fleet.engines.iter().enumerate().find(|(_, e)| e.has_work()) {
        return Err(SimError::Internal(format!(
            "engine {w} stalled with requests left"
        )));
    }
    if fleet.admission.as_ref().is_some_and(|q| !q.is_empty()) {
        return Err(SimError::Internal(
            "requests were left in the router's queue".into(),
        ));
    }
    Ok(PolicyRun {
        policy: policy.name.to_string(),
        requests: fleet.outcomes,
        engines: fleet.engines.iter().map(Engine::counters).collect(),
        router: router.diagnostics(),
        selector_overlap: router.selector_overlap(),
    })
}

/// The run's mutable state: the engines, the outcomes, the event queue and the router-side
/// admission queue.
struct Fleet<'a> {
    config: &'a SimConfig,
    policy: &'static str,
    workload: &'a Workload,
    engines: Vec<Engine>,
    wake_pending: Vec<bool>,
    /// When each engine's step in flight started and ends.
    steps: Vec<(Nanos, Nanos)>,
    outcomes: Vec<RequestOutcome>,
    events: Queue,
    admission: Option<AdmissionQueue<RequestId>>,
    /// Prompt tokens routed to each worker whose first token has not come: the queue's view of
    /// its active prefill (the same for every policy).
    routed_prefill: Vec<u64>,
    /// Prompt and output tokens of the requests routed to each worker and not finished: the
    /// KV memory they will hold at most.
    routed_tokens: Vec<u64>,
    done: usize,
}

impl Fleet<'_> {
    fn finish_one(&mut self, progress: &mut dyn FnMut(usize)) {
        self.done += 1;
        progress(self.done);
    }

    fn start_step(&mut self, w: u32, t: Nanos) -> Result<(), SimError> {
        start_step(
            &mut self.engines[w as usize],
            w,
            t,
            self.workload,
            &mut self.events,
            &mut self.steps,
        )
    }

    /// Whether every worker is over the queue threshold (never without a queue).
    fn saturated(&self) -> bool {
        let Some(q) = &self.config.queue else {
            return false;
        };
        let capacity = Some(self.config.engine.max_num_batched_tokens);
        let kv_tokens = self
            .config
            .engine
            .kv_blocks
            .map(|b| b * u64::from(self.config.engine.block_size));
        self.routed_prefill
            .iter()
            .zip(&self.routed_tokens)
            .all(|(&p, &held)| {
                over_threshold(q.threshold, p, capacity)
                    || q.kv_threshold
                        .zip(kv_tokens)
                        .is_some_and(|(f, kv)| held as f64 > f * kv as f64)
            })
    }

    /// An arriving request: routed at once, or queued behind the waiting ones while the fleet
    /// is saturated (a full queue sheds it).
    fn admit(
        &mut self,
        router: &mut dyn Router,
        rng: &mut SmallRng,
        id: RequestId,
        t: Nanos,
        now: Instant,
        progress: &mut dyn FnMut(usize),
    ) -> Result<(), SimError> {
        let waiting = self.admission.as_ref().is_some_and(|q| !q.is_empty());
        let queue_it = waiting || self.saturated();
        let Some(queue) = self.admission.as_mut().filter(|_| queue_it) else {
            return self.dispatch(router, rng, id, t, now);
        };
        let request = &self.workload.requests[id as usize];
        // The simulator's queue knows no cache: `wspt` orders by the whole prompt.
        let order = QueueOrder {
            arrived: now,
            isl_tokens: request.prompt.isl_tokens,
            uncached_tokens: request.prompt.isl_tokens,
            priority_jump: 0.0,
            strict_priority: 0,
            timeout: None,
        };
        match queue.push(&tenant_name(request.tenant), order, id) {
            Ok(_) => self.release(router, rng, t, now, progress),
            Err((QueueError::Full { .. }, _)) => {
                self.outcomes[id as usize].shed = Some(Shed::QueueFull);
                self.finish_one(progress);
                Ok(())
            }
        }
    }

    /// Sheds the requests that waited too long, then routes waiting ones while the fleet has
    /// room.
    fn release(
        &mut self,
        router: &mut dyn Router,
        rng: &mut SmallRng,
        t: Nanos,
        now: Instant,
        progress: &mut dyn FnMut(usize),
    ) -> Result<(), SimError> {
        let Some(queue) = self.admission.as_mut() else {
            return Ok(());
        };
        for gone in queue.expire(now) {
            self.outcomes[gone.payload as usize].shed = Some(Shed::TimedOut);
            self.finish_one(progress);
        }
        // A request routed to an idle fleet always finds room: an empty fleet is not saturated.
        while !self.saturated() {
            let Some(next) = self.admission.as_mut().and_then(|q| q.pop(now)) else {
                break;
            };
            self.outcomes[next.payload as usize].queued =
                t.saturating_sub(self.workload.requests[next.payload as usize].arrival_nanos);
            self.dispatch(router, rng, next.payload, t, now)?;
        }
        Ok(())
    }

    /// Routes a request and hands it to the chosen engine.
    fn dispatch(
        &mut self,
        router: &mut dyn Router,
        rng: &mut SmallRng,
        id: RequestId,
        t: Nanos,
        now: Instant,
    ) -> Result<(), SimError> {
        let request = &self.workload.requests[id as usize];
        let w = router.route(id, &request.prompt, request.session_id, now, rng)?;
        let block_size = u64::from(self.config.engine.block_size);
        let cached_tokens = |e: &Engine| {
            e.pool().cached_prefix_blocks(&request.prompt.sequence) as u64 * block_size
        };
        let best = self.engines.iter().map(cached_tokens).max().unwrap_or(0);
        let Some(engine) = self.engines.get_mut(w) else {
            return Err(SimError::Internal(format!(
                "policy {} chose worker {w} of {}",
                self.policy, self.config.workers
            )));
        };
        let chosen = cached_tokens(engine);
        let in_flight_wait = if engine.in_step() {
            self.steps[w].1.saturating_sub(t)
        } else {
            0
        };
        engine.submit(id, request);
        self.routed_prefill[w] += request.prompt.isl_tokens;
        self.routed_tokens[w] += request.prompt.isl_tokens + request.output_tokens;
        let outcome = &mut self.outcomes[id as usize];
        outcome.step_in_flight_wait = in_flight_wait;
        outcome.worker = Some(w as u32);
        outcome.chosen_overlap_tokens = chosen;
        outcome.best_overlap_tokens = best;
        if !engine.in_step() && !self.wake_pending[w] {
            self.wake_pending[w] = true;
            self.events.push(t, Event::StepStart(w as u32));
        }
        Ok(())
    }
}

/// The queue's tenant of a request (`default` when the workload has none).
pub fn tenant_name(tenant: Option<u32>) -> String {
    tenant.map_or_else(|| "default".to_string(), |t| format!("tenant-{t}"))
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
