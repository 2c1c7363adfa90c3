//! The service's shared state: the selector behind one lock, the metrics, the configuration and
//! the KV-event listeners. Requests, events and the periodic tick all reach the selector here.

use crate::config::ServeConfig;
use crate::ingest::{EventSink, IngestConfig, IngestManager};
use crate::metrics::Metrics;
use kvroute_core::event::KvEvent;
use kvroute_core::selector::{Selector, WorkerRecord};
use parking_lot::RwLock;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Applies engine events to the selector (used by the listeners).
///
/// The listeners decode on their own low-priority thread and queue the decoded events here; one
/// applier thread at normal priority takes the selector's write lock for a bounded amount of
/// work at a time. A lock holder is therefore never a thread the OS deprioritised (which would
/// leave selects waiting on it), and selects get the lock back after at most
/// [`APPLY_BLOCKS_PER_LOCK`] blocks. The queue is bounded: when the applier falls behind, the
/// listeners wait, the engines' sockets fill and what they drop shows up as sequence gaps,
/// recovered by replay where the engine offers it. Both ingest threads yield the CPU after each
/// stretch of work ([`crate::courtesy`]), so a request thread waiting for a core gets one within
/// the stretch rather than at the next timer tick.
struct SelectorSink {
    queue: std::sync::mpsc::SyncSender<(u64, u32, Vec<KvEvent>)>,
    /// `kvroute_kv_apply_queue_batches`: raised here before a batch is queued, lowered by the
    /// applier when it takes one.
    depth: prometheus_client::metrics::gauge::Gauge,
}

/// Most blocks applied under one acquisition of the write lock (one event may go past it).
const APPLY_BLOCKS_PER_LOCK: usize = 256;
/// The applier holds the write lock at most this share of the time, averaged over
/// [`APPLY_LOCK_BURST`]: a budget of lock time that refills at this rate. Below it the applier
/// never pauses, so the index keeps up with the engines; only an ingest that would hold the lock
/// nearly all the time backs up into the queue (and then the engines' sockets). The
/// side-by-side's cycle runs need more than half: at 0.5 the index still fell behind them, at
/// 0.75 and 1.0 it kept up, at the same cycle rate; its storm runs applied as much and saw the
/// same `/select` p99 at 0.5 and 1.0 (docs/perf-decisions.md has the figures). Holds are charged
/// from when the applier asks for the lock: that left no lag either, and a select arriving during
/// the contention bench's storm waits far less, since busy selects make the applier pause sooner.
const APPLY_LOCK_SHARE: f64 = 0.75;
/// The most lock time the budget saves up while the applier has little to do.
const APPLY_LOCK_BURST: Duration = Duration::from_millis(4);
/// Once the budget is spent, the applier pauses until it has refilled this much: a few holds'
/// worth, so a storm costs one wake-up per few holds rather than one per hold.
const APPLY_LOCK_RESUME: Duration = Duration::from_millis(1);
/// How long, after a hold, the applier lets the requests it held up take the lock first.
const APPLY_WAITERS_GRACE: Duration = Duration::from_micros(500);
/// Decoded batches waiting for the applier.
const APPLY_QUEUE: usize = 1024;

impl EventSink for SelectorSink {
    fn apply(&self, worker_id: u64, dp_rank: u32, events: Vec<KvEvent>) -> bool {
        self.depth.inc();
        // Fails only once the applier is gone, at shutdown.
        let sent = self.queue.send((worker_id, dp_rank, events)).is_ok();
        if !sent {
            self.depth.dec();
        }
        sent
    }
}

/// An event's share of a hold's budget: its blocks (a `Cleared` counts as one).
fn event_work(event: &KvEvent) -> usize {
    match event {
        KvEvent::Cleared => 1,
        event => event.blocks(),
    }
}

/// Where the events one hold applies from `events[at]` end: events are taken while the hold's
/// `blocks` are below `budget` (so the last one may go past it), and `blocks` counts them.
fn hold_end(events: &[KvEvent], at: usize, blocks: &mut usize, budget: usize) -> usize {
    let mut end = at;
    while end < events.len() && *blocks < budget {
        *blocks += event_work(&events[end]);
        end += 1;
    }
    end
}

/// The applier's budget of write-lock time: a token bucket that refills at `share` seconds per
/// second up to `burst`; each hold spends its length, timed from when the applier asked for the
/// lock (waiting for the selects' read locks counts: the busier they are, the sooner it pauses).
/// Pure: the caller passes the clock in.
#[derive(Debug, Clone, Copy)]
struct LockBudget {
    share: f64,
    burst: f64,
    resume: f64,
    /// Seconds of lock time left (below zero: overspent).
    credit: f64,
    at: Instant,
}

impl LockBudget {
    fn new(share: f64, burst: Duration, resume: Duration, now: Instant) -> Self {
        Self {
            share,
            burst: burst.as_secs_f64(),
            resume: resume.as_secs_f64().min(burst.as_secs_f64()),
            credit: burst.as_secs_f64(),
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.credit = (self.credit + elapsed * self.share).min(self.burst);
        self.at = now;
    }

    /// Spends a hold of length `held` that ended at `now`; returns how long to pause before the
    /// next one: zero while the budget lasts, else until it has refilled to `resume`.
    fn spend(&mut self, held: Duration, now: Instant) -> Duration {
        self.refill(now);
        self.credit -= held.as_secs_f64();
        if self.credit >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((self.resume - self.credit) / self.share)
        }
    }
}

/// Tells the HTTP handlers when the applier holds (or is about to take) the selector's write
/// lock, so that a request needing the selector waits as a task, and the runtime's threads go on
/// reading, parsing and answering other requests, instead of a thread blocking on the lock.
#[derive(Default)]
pub struct ApplierGate {
    holding: AtomicBool,
    /// Requests waiting at the gate (they found it closed and have not passed yet).
    waiting: AtomicUsize,
    released: tokio::sync::Notify,
    /// The thread that waits in [`let_waiters_pass`](Self::let_waiters_pass): the last waiter
    /// to pass wakes it.
    applier: std::sync::OnceLock<std::thread::Thread>,
}

/// Counts a request as waiting at the gate while it lives.
struct Waiting<'a>(&'a ApplierGate);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.0.waiting.fetch_sub(1, Ordering::SeqCst) == 1
            && let Some(applier) = self.0.applier.get()
        {
            applier.unpark();
        }
    }
}

/// Keeps the gate closed while it lives: dropping it (also while unwinding from a panic) opens
/// the gate, so requests can never be left waiting on a hold that ended.
struct GateHold<'a>(&'a ApplierGate);

impl Drop for GateHold<'_> {
    fn drop(&mut self) {
        self.0.open();
    }
}

impl ApplierGate {
    fn close(&self) -> GateHold<'_> {
        self.holding.store(true, Ordering::SeqCst);
        GateHold(self)
    }

    fn open(&self) {
        self.holding.store(false, Ordering::SeqCst);
        self.released.notify_waiters();
    }

    /// Returns once the applier does not hold the lock (at once, the usual case). A request may
    /// still meet the lock taken right after: it then waits on it as before, for at most one
    /// bounded hold.
    pub async fn passed(&self) {
        if !self.holding.load(Ordering::SeqCst) {
            return;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(self);
        while self.holding.load(Ordering::SeqCst) {
            let released = self.released.notified();
            tokio::pin!(released);
            // Registered before the second look, so an `open` between the two is not missed.
            released.as_mut().enable();
            if !self.holding.load(Ordering::SeqCst) {
                return;
            }
            released.await;
        }
    }

    /// After a hold: gives the requests it held up the time to pass the gate (and so queue for
    /// the lock ahead of the next hold), for at most `grace`. Returns at once when none waited;
    /// else sleeps until the last of them passes (it wakes this thread) or `grace` is over.
    /// Always called from the same thread (the applier's). Returns whether any waited.
    fn let_waiters_pass(&self, grace: Duration) -> bool {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return false;
        }
        self.applier.get_or_init(std::thread::current);
        let deadline = Instant::now() + grace;
        while self.waiting.load(Ordering::SeqCst) > 0 {
            let now = Instant::now();
            if now >= deadline {
                return true;
            }
            std::thread::park_timeout(deadline - now);
        }
        true
    }
}

/// The applier thread's loop: ends when every listener and the manager have dropped the sink.
///
/// Work is cut into holds of at most [`APPLY_BLOCKS_PER_LOCK`] blocks, also inside one message:
/// an engine that fell behind sends its backlog as one message of many hundreds of blocks, and
/// one hold for all of it parks every request needing the selector until it ends. Events of one
/// message are applied in order, whatever the cuts.
fn run_applier(
    queue: std::sync::mpsc::Receiver<(u64, u32, Vec<KvEvent>)>,
    selector: Arc<RwLock<Selector>>,
    metrics: Arc<Metrics>,
    gate: Arc<ApplierGate>,
) {
    let mut budget = LockBudget::new(
        APPLY_LOCK_SHARE,
        APPLY_LOCK_BURST,
        APPLY_LOCK_RESUME,
        Instant::now(),
    );
    while let Ok(first) = queue.recv() {
        metrics.kv_apply_queue.dec();
        crate::courtesy::woke();
        // The message being applied and its first event not yet applied.
        let mut current = Some((first, 0usize));
        while current.is_some() {
            let hold = gate.close();
            // The hold is charged from here: the time spent waiting for the selects' read locks
            // counts, so the busier the selects, the sooner the applier pauses.
            let asked = Instant::now();
            let mut selector = selector.write();
            let mut blocks = 0;
            while blocks < APPLY_BLOCKS_PER_LOCK {
                let Some(((worker_id, dp_rank, events), at)) = current.as_mut() else {
                    break;
                };
                let end = hold_end(events, *at, &mut blocks, APPLY_BLOCKS_PER_LOCK);
                let part = &events[*at..end];
                match selector.apply_events(*worker_id, *dp_rank, part) {
                    Some(outcome) => metrics.count_events(&outcome),
                    None => {
                        metrics.count_dropped_events("any", "unknown_worker", part.len() as u64);
                    }
                }
                *at = end;
                if end >= events.len() {
                    current = queue.try_recv().ok().map(|next| {
                        metrics.kv_apply_queue.dec();
                        (next, 0)
                    });
                }
            }
            // Hand the lock to the selects waiting for it rather than taking it straight back.
            parking_lot::RwLockWriteGuard::unlock_fair(selector);
            drop(hold);
            let released = Instant::now();
            let pause = budget.spend(released.duration_since(asked), released);
            if !pause.is_zero() {
                std::thread::sleep(pause);
                crate::courtesy::woke();
            } else if gate.let_waiters_pass(APPLY_WAITERS_GRACE) {
                crate::courtesy::woke();
            } else {
                // With no request at the gate, one may still wait for this core.
                crate::courtesy::after_work(crate::courtesy::STRETCH);
            }
        }
    }
}

/// A change to what the selector holds, told to [`AppState::changed`], which runs its
/// follow-ups. What each change triggers:
///
/// | change              | KV-event listeners | replica sync       | sessions shared | admission woken |
/// |---------------------|--------------------|--------------------|-----------------|-----------------|
/// | `WorkerUpserted`    | started/restarted  | `catalog_changed`  |                 | yes             |
/// | `WorkerDeleted`     | stopped            | `catalog_changed`  | yes             | yes             |
/// | `Booked`            |                    | `booking_changed`  | yes             |                 |
/// | `BookingRefused`    |                    |                    | yes             |                 |
/// | `PrefillCompleted`  |                    | `booking_changed`  |                 | yes             |
/// | `OutputBlock`       |                    | `output_block`     |                 |                 |
/// | `Freed`             |                    | `booking_changed`  | yes             | yes             |
/// | `Expired`           |                    |                    | yes             | yes             |
///
/// Besides, `WorkerUpserted`, `WorkerDeleted` and `Booked` update the worker's watch for
/// routing degradations (`crate::degraded`: what its silence means, its bookings since its
/// last KV event).
///
/// "Sessions shared": the session bindings this replica changed go to replica sync (a booking
/// binds its session, its end starts the binding's TTL, a refusal may drop it). "Admission
/// woken": the change may free capacity, so the admission task takes a pass over the queue
/// (`admission::release`); the caller never decides waiting requests itself.
#[derive(Debug, Clone, Copy)]
pub enum Change<'a> {
    /// A worker was added or changed; `events_changed`: its KV-event endpoints changed.
    WorkerUpserted {
        record: &'a WorkerRecord,
        events_changed: bool,
    },
    /// A worker was deleted (its bookings ended).
    WorkerDeleted(u64),
    /// A booking was made (by `POST /reservations` or `/select_and_reserve`).
    Booked {
        reservation_id: &'a str,
        worker_id: u64,
    },
    /// A `/select_and_reserve` was refused.
    BookingRefused,
    /// A booking's prefill completed.
    PrefillCompleted(&'a str),
    /// A booking produced an output block.
    OutputBlock(&'a str),
    /// A booking was freed.
    Freed(&'a str),
    /// Housekeeping expired idle bookings.
    Expired,
}

pub struct AppState {
    pub(crate) selector: Arc<RwLock<Selector>>,
    /// Whether the KV-event applier holds the selector's write lock (see [`ApplierGate`]).
    pub(crate) applier: Arc<ApplierGate>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) config: ServeConfig,
    pub(crate) ingest: IngestManager,
    /// Replica sync hooks (no-ops without `--nats-url`).
    pub(crate) sync: crate::sync::SyncHandle,
    /// The admission queue (`--queue-threshold`); never holds anything without it.
    pub(crate) admission: crate::admission::queue::AdmissionQueues,
    shutting_down: AtomicBool,
    /// How far [`AppState::now`] runs ahead of the monotonic clock, in nanoseconds.
    clock_ahead_nanos: AtomicU64,
}

impl AppState {
    /// Builds the state from a validated configuration (the message names a bad knob).
    pub fn new(config: ServeConfig) -> Result<Arc<Self>, String> {
        let selector_config = config.validate()?;
        let silence = config.kv_silence_rule()?;
        let admission = crate::admission::queue::AdmissionQueues::new(config.queue_settings()?);
        let selector = Arc::new(RwLock::new(Selector::new(selector_config)));
        let metrics = Arc::new(Metrics::new());
        metrics.degraded.set_silence_rule(silence);
        let (queue, receiver) = std::sync::mpsc::sync_channel(APPLY_QUEUE);
        let sink = Arc::new(SelectorSink {
            queue,
            depth: metrics.kv_apply_queue.clone(),
        });
        let applier = Arc::new(ApplierGate::default());
        {
            let selector = Arc::clone(&selector);
            let metrics = Arc::clone(&metrics);
            let gate = Arc::clone(&applier);
            std::thread::Builder::new()
                .name("kvroute-apply".to_string())
                .spawn(move || run_applier(receiver, selector, metrics, gate))
                .map_err(|e| format!("cannot start the KV-event applier thread: {e}"))?;
        }
        let sync = crate::sync::SyncHandle::new(&config.sync, Arc::clone(&metrics));
        // With peers, near-equal picks spread by this replica's place among them
        // (`ReplicaSpread`), refreshed by every housekeeping tick.
        selector.write().set_replica_id(sync.replica_id());
        if sync.replica_id().is_some() && selector_config.sessions.enabled() {
            // The publisher shares the bindings this replica makes.
            selector.write().record_session_changes();
        }
        let ingest = IngestManager::with_config(
            sync.wrap_sink(sink),
            Arc::clone(&metrics),
            IngestConfig {
                dedicated_thread_nice: Some(config.ingest_nice),
                ..IngestConfig::default()
            },
        );
        Ok(Arc::new(Self {
            selector,
            applier,
            metrics,
            config,
            ingest,
            sync,
            admission,
            shutting_down: AtomicBool::new(false),
            clock_ahead_nanos: AtomicU64::new(0),
        }))
    }

    /// The service's time: the monotonic clock, plus whatever [`AppState::advance_clock`] added.
    /// Everything the selector times (bookings, cached selections, session bindings) reads it.
    pub fn now(&self) -> Instant {
        Instant::now() + Duration::from_nanos(self.clock_ahead_nanos.load(Ordering::Relaxed))
    }

    /// Moves the service's time forward by `by`, for tests of what expires (a running service
    /// never calls it): the TTLs then pass without waiting for them.
    pub fn advance_clock(&self, by: Duration) {
        let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.clock_ahead_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Runs the follow-ups of a change: the table of [`Change`].
    pub fn changed(&self, change: Change<'_>) {
        match change {
            Change::WorkerUpserted {
                record,
                events_changed,
            } => {
                self.sync_listeners(record, events_changed);
                self.metrics
                    .degraded
                    .worker_registered(record, !self.config.no_kv_events);
                self.sync.catalog_changed(record.spec.worker_id);
                self.admission.wake();
            }
            Change::WorkerDeleted(worker_id) => {
                self.ingest.remove_worker(worker_id);
                self.metrics.degraded.worker_deleted(worker_id);
                self.sync.catalog_changed(worker_id);
                self.share_session_changes();
                self.admission.wake();
            }
            Change::Booked {
                reservation_id: id,
                worker_id,
            } => {
                self.metrics.degraded.booked(worker_id, self.now());
                self.sync.booking_changed(id);
                self.share_session_changes();
            }
            Change::BookingRefused => self.share_session_changes(),
            Change::PrefillCompleted(id) => {
                self.sync.booking_changed(id);
                self.admission.wake();
            }
            Change::OutputBlock(id) => self.sync.output_block(id),
            Change::Freed(id) => {
                self.sync.booking_changed(id);
                self.share_session_changes();
                self.admission.wake();
            }
            Change::Expired => {
                self.share_session_changes();
                self.admission.wake();
            }
        }
    }

    /// The service's configuration.
    pub fn config(&self) -> &ServeConfig {
        &self.config
    }

    /// The service's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The KV-event listeners.
    pub fn ingest(&self) -> &IngestManager {
        &self.ingest
    }

    /// The selector's lock, for tests that inspect or seed the selector directly. Callers in
    /// process use [`crate::Service`]; nothing else should reach the selector around it.
    #[doc(hidden)]
    pub fn selector_for_tests(&self) -> &Arc<RwLock<Selector>> {
        &self.selector
    }

    /// The Prometheus text of `GET /metrics`.
    pub fn render_metrics(&self) -> String {
        self.metrics.render(&self.selector.read())
    }

    /// Queues for replica sync the sessions whose binding this replica changed (a no-op without
    /// sync or session affinity).
    fn share_session_changes(&self) {
        if self.sync.replica_id().is_some() && self.config.session_affinity_ttl_secs.is_some() {
            let changed = self.selector.read().take_session_changes();
            self.sync.sessions_changed(changed);
        }
    }

    /// Starts, restarts or stops a worker's listeners after a catalog change.
    pub(crate) fn sync_listeners(&self, record: &WorkerRecord, events_changed: bool) {
        if self.config.no_kv_events {
            return;
        }
        self.ingest.sync_worker(record, events_changed);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Refuses new work from now on; in-flight requests finish.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        // Every waiting request is answered 503 before the selector stops; none is decided.
        let waiting = self.admission.lock().drain();
        for queued in waiting {
            self.metrics
                .queue
                .observe_wait("shutdown", queued.since.elapsed().as_secs_f64());
            let _ = queued.reply.send(crate::admission::queue::Decision {
                result: Err(crate::error::ApiError::new(
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    crate::admission::queue::SHUTTING_DOWN,
                )),
                booked: None,
            });
        }
        self.selector.write().shutdown();
        self.ingest.shutdown();
    }

    /// One housekeeping pass: expire idle bookings and cached selections.
    pub fn tick(&self, now: Instant) {
        let outcome = self.selector.write().tick(now);
        self.changed(Change::Expired);
        self.metrics.degraded.check(now);
        if !outcome.expired_reservations.is_empty() {
            tracing::info!(
                count = outcome.expired_reservations.len(),
                "expired idle reservations"
            );
        }
        self.metrics
            .count_expired(outcome.expired_reservations.len());
    }

    /// Runs [`tick`](Self::tick) periodically until shutdown.
    pub async fn run_housekeeping(self: Arc<Self>) {
        let period = Duration::from_secs(1);
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !self.is_shutting_down() {
            interval.tick().await;
            self.tick(self.now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{AppState, ApplierGate, Change, LockBudget, hold_end};
    use crate::config::ServeConfig;
    use kvroute_core::event::{KvEvent, Tier};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn runtime(workers: usize) -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// The budget lets holds through without a pause while the share is kept, and once it is
    /// spent pauses until it has refilled to `resume`; idle time refills it only up to `burst`.
    #[test]
    fn the_lock_budget_pauses_only_past_its_share() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut budget = LockBudget::new(0.5, ms(4), ms(1), t0);
        // 4 ms saved up, refilling 0.5 ms per ms: 1 ms holds ending every 1 ms leave 3, 2.5, 2
        // and 1.5 ms.
        for i in 1..=4 {
            assert_eq!(budget.spend(ms(1), t0 + ms(i)), Duration::ZERO, "hold {i}");
        }
        // 1.5 + 1 refilled − 2 = 0.5 ms left.
        assert_eq!(budget.spend(ms(2), t0 + ms(6)), Duration::ZERO);
        // 0.5 + 1.5 refilled − 3 = −1 ms: pause until 1 ms is back, (1 + 1) / 0.5 = 4 ms.
        let pause = budget.spend(ms(3), t0 + ms(9));
        assert!((pause.as_secs_f64() - 0.004).abs() < 1e-9, "{pause:?}");
        // A long idle stretch refills only up to the burst: 4 ms, then 5 ms of holds overspend.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(budget.spend(ms(4), later), Duration::ZERO);
        assert!(budget.spend(ms(1), later) > Duration::ZERO);
        // Holding the lock half the time forever never pauses.
        let mut budget = LockBudget::new(0.5, ms(4), ms(1), t0);
        for i in 1..=10_000u64 {
            let end = t0 + Duration::from_micros(100 * i);
            assert_eq!(budget.spend(Duration::from_micros(50), end), Duration::ZERO);
        }
    }

    fn removed(blocks: u64) -> KvEvent {
        KvEvent::Removed {
            engine_hashes: (0..blocks).collect(),
            tier: Tier::Device,
        }
    }

    /// One message of many blocks is cut into several holds, each ending once it reaches the
    /// budget, and a hold that has room goes on into the next message.
    #[test]
    fn holds_end_at_the_budget_also_inside_one_message() {
        let events = [
            removed(100),
            removed(100),
            removed(100),
            removed(300),
            removed(10),
        ];
        let mut blocks = 0;
        assert_eq!(hold_end(&events, 0, &mut blocks, 256), 3);
        assert_eq!(blocks, 300);
        let mut blocks = 0;
        assert_eq!(hold_end(&events, 3, &mut blocks, 256), 4);
        assert_eq!(blocks, 300);
        let mut blocks = 0;
        assert_eq!(hold_end(&events, 4, &mut blocks, 256), 5);
        assert_eq!(blocks, 10);
        // The next message continues the same hold with what is left of the budget.
        assert_eq!(hold_end(&events, 0, &mut blocks, 256), 3);
        assert_eq!(blocks, 310);
        // A hold that is already full takes nothing more.
        assert_eq!(hold_end(&events, 1, &mut blocks, 256), 1);
        // One event past the budget is applied whole, alone.
        let mut blocks = 0;
        assert_eq!(hold_end(&[removed(1000)], 0, &mut blocks, 256), 1);
        assert_eq!(blocks, 1000);
    }
    #[tokio::test]
    async fn the_applier_gate_holds_requests_only_while_the_applier_holds_the_lock() {
        let gate = Arc::new(ApplierGate::default());
        // Open: passes at once.
        tokio::time::timeout(Duration::from_secs(1), gate.passed())
            .await
            .expect("an open gate passes at once");

        let hold = gate.close();
        let waiter = tokio::spawn({
            let gate = Arc::clone(&gate);
            async move { gate.passed().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "a closed gate holds the request");
        drop(hold);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("opening releases the waiting request")
            .expect("the waiter does not panic");
    }

    #[test]
    fn no_request_misses_the_gate_opening() {
        // Open and close from another thread as fast as possible while requests pass, ending
        // open: every request must get through (one whose wake-up was lost at the last opening,
        // between its look at the flag and its wait, would hang).
        let runtime = runtime(2);
        let gate = Arc::new(ApplierGate::default());
        let toggler = {
            let gate = Arc::clone(&gate);
            std::thread::spawn(move || {
                for _ in 0..20_000 {
                    let hold = gate.close();
                    std::hint::spin_loop();
                    drop(hold);
                }
            })
        };
        runtime.block_on(async {
            let tasks: Vec<_> = (0..8)
                .map(|_| {
                    let gate = Arc::clone(&gate);
                    tokio::spawn(async move {
                        for _ in 0..2_000 {
                            gate.passed().await;
                            tokio::task::yield_now().await;
                        }
                    })
                })
                .collect();
            for task in tasks {
                tokio::time::timeout(Duration::from_secs(30), task)
                    .await
                    .expect("no request waits for an opening that already happened")
                    .expect("no panic");
            }
        });
        toggler.join().expect("toggler");
    }

    /// A request that met the closed gate counts as waiting until it has passed, and the
    /// applier's grace after a hold ends as soon as none waits (or at its bound).
    #[test]
    fn the_gate_counts_the_requests_it_holds_up() {
        use std::sync::atomic::Ordering;
        let runtime = runtime(1);
        let gate = Arc::new(ApplierGate::default());
        // No waiter: the grace returns at once, whatever its bound.
        let started = Instant::now();
        gate.let_waiters_pass(Duration::from_secs(5));
        assert!(started.elapsed() < Duration::from_secs(1));
        let hold = gate.close();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let gate = Arc::clone(&gate);
                runtime.spawn(async move { gate.passed().await })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        while gate.waiting.load(Ordering::SeqCst) < 3 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(gate.waiting.load(Ordering::SeqCst), 3);
        // Still closed: the grace waits its whole (short) bound.
        let started = Instant::now();
        gate.let_waiters_pass(Duration::from_millis(20));
        assert!(started.elapsed() >= Duration::from_millis(20));
        drop(hold);
        gate.let_waiters_pass(Duration::from_secs(5));
        assert_eq!(gate.waiting.load(Ordering::SeqCst), 0);
        for waiter in waiters {
            runtime.block_on(waiter).expect("the waiter passes");
        }
    }

    #[test]
    fn a_hold_ended_by_a_panic_opens_the_gate() {
        let gate = ApplierGate::default();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _hold = gate.close();
            panic!("the applier failed while holding the lock");
        }));
        assert!(outcome.is_err());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(1), gate.passed())
                .await
                .expect("requests pass after the failed hold");
        });
    }

    /// Whether a wake waits for the admission task (taking it).
    fn woken(state: &AppState) -> bool {
        use futures::FutureExt;
        state.admission.woken().now_or_never().is_some()
    }

    #[tokio::test]
    async fn the_changes_that_may_free_capacity_wake_admission_and_no_others() {
        let queued = ServeConfig::parse_from(["kvroute", "--queue-threshold", "0.5"]).unwrap();
        let state = AppState::new(queued).unwrap();
        assert!(!woken(&state));
        let cases = [
            (Change::WorkerDeleted(7), true),
            (
                Change::Booked {
                    reservation_id: "r",
                    worker_id: 1,
                },
                false,
            ),
            (Change::BookingRefused, false),
            (Change::PrefillCompleted("r"), true),
            (Change::OutputBlock("r"), false),
            (Change::Freed("r"), true),
            (Change::Expired, true),
        ];
        for (change, wakes) in cases {
            state.changed(change);
            assert_eq!(woken(&state), wakes, "{change:?}");
        }
        // Without a queue nothing waits, and nothing is woken.
        let unqueued = AppState::new(ServeConfig::defaults()).unwrap();
        for change in [
            Change::Freed("r"),
            Change::WorkerDeleted(7),
            Change::Expired,
        ] {
            unqueued.changed(change);
            assert!(!woken(&unqueued), "{change:?}");
        }
    }
}
