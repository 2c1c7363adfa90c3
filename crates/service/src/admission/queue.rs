//! The admission queue's data: what waits, per partition. `/select` and `/select_and_reserve`
//! wait here while every rank they may go to is over `--queue-threshold` × its
//! `max_num_batched_tokens` of active prefill ([`super`] decides when).
//!
//! One [`AdmissionQueue`] per partition (its order: `--queue-policy`, `priority_jump`,
//! `strict_priority`, aging, and deficit round robin between tenants), all behind one mutex
//! that is always taken **before** the selector's lock, never while holding it. A waiting
//! request holds a oneshot sender; the decision is made (and booked) under the mutex by the
//! admission task, then sent, so a request is decided exactly once: a waiter that leaves
//! (timeout, client gone, cancelled) takes its ticket out under the same mutex, or, if it was
//! decided already, finds the answer in its channel and frees what was booked.
//!
//! This module sits below the service's state, which holds it; it knows nothing of the state.

use crate::error::ApiError;
use crate::types::SelectBody;
use kvroute_core::admission::{AdmissionQueue, QueueConfig, QueueError, QueueOrder, Ticket};
use kvroute_core::error::PartitionKey;
use kvroute_core::hash::PromptHashes;
use kvroute_core::schedule::Overrides;
use kvroute_core::selector::{Prompt, Reservation, RoutingConstraints, SelectRequest, Selection};
use parking_lot::{Mutex, MutexGuard};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, oneshot};

/// The answer of every waiting request when the service stops.
pub const SHUTTING_DOWN: &str = "selection service is shutting down";

/// The tenant of a request that names none (`x-tenant-id`).
pub const DEFAULT_TENANT: &str = "default";

/// A select body resolved: partition, hashed prompt (hashed outside any lock), LoRA name.
#[derive(Debug)]
pub struct ResolvedSelect {
    pub key: PartitionKey,
    pub hashes: PromptHashes,
    pub lora_name: Option<String>,
    pub overrides: Overrides,
    pub routing_constraints: Option<RoutingConstraints>,
}

impl ResolvedSelect {
    pub fn request<'a>(&'a self, body: &'a SelectBody, advisory: bool) -> SelectRequest<'a> {
        SelectRequest {
            partition: &self.key,
            selection_id: body.selection_id.as_deref(),
            prompt: Prompt::Hashes(&self.hashes),
            lora_name: self.lora_name.as_deref(),
            expected_output_tokens: body.expected_output_tokens,
            overrides: self.overrides,
            pinned_worker: body.pinned(),
            allowed_worker_ids: body.allowed_worker_ids.as_deref(),
            routing_constraints: self.routing_constraints.as_ref(),
            advisory,
            session_id: body.session(),
            affinity_target: body.affinity(),
            decode_runs_whole: body.decode_runs_whole.unwrap_or(true),
        }
    }
}

/// Which route a waiting request came by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `/select`: decided, it books nothing (its selection may be cached for a replay).
    Select,
    /// `/select_and_reserve`: decided, it is booked.
    SelectAndReserve,
}

impl Route {
    pub fn name(self) -> &'static str {
        match self {
            Route::Select => "select",
            Route::SelectAndReserve => "select_and_reserve",
        }
    }
}

/// A `/select_and_reserve` decided: the selection and the booking made for it.
#[derive(Debug, Clone)]
pub struct Booked {
    pub selection: Selection,
    pub reservation: Reservation,
}

/// What deciding a request gave, by its route.
#[derive(Debug)]
pub enum Decided {
    Selected(Selection),
    Booked(Booked),
}

/// The typed answer of a route: [`Selection`] for [`Route::Select`], [`Booked`] for
/// [`Route::SelectAndReserve`]. The route is chosen by the answer's type, so a caller cannot
/// ask one route and read the other's answer.
pub trait Routed: Sized {
    const ROUTE: Route;
    /// The answer out of what was decided; `None` only if it was decided for the other route.
    fn from_decided(decided: Decided) -> Option<Self>;
}

impl Routed for Selection {
    const ROUTE: Route = Route::Select;
    fn from_decided(decided: Decided) -> Option<Self> {
        match decided {
            Decided::Selected(selection) => Some(selection),
            Decided::Booked(_) => None,
        }
    }
}

impl Routed for Booked {
    const ROUTE: Route = Route::SelectAndReserve;
    fn from_decided(decided: Decided) -> Option<Self> {
        match decided {
            Decided::Booked(booked) => Some(booked),
            Decided::Selected(_) => None,
        }
    }
}

/// What a decided request receives: its answer, and the booking made for it (freed if the
/// waiter is gone).
#[derive(Debug)]
pub struct Decision {
    pub result: Result<Decided, ApiError>,
    pub booked: Option<String>,
}

/// A request waiting for its decision.
#[derive(Debug)]
pub struct Queued {
    pub route: Route,
    pub body: SelectBody,
    pub resolved: ResolvedSelect,
    pub reply: oneshot::Sender<Decision>,
    /// When it joined the queue (the monotonic clock, for the wait histogram).
    pub since: Instant,
}

/// Why a request left the queue undecided (the `reason` of `kvroute_queue_shed_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    Full,
    TimedOut,
    Disconnected,
    Shutdown,
}

impl Shed {
    pub fn name(self) -> &'static str {
        match self {
            Shed::Full => "full",
            Shed::TimedOut => "timeout",
            Shed::Disconnected => "disconnected",
            Shed::Shutdown => "shutdown",
        }
    }
}

/// The queue's settings, from `--queue-*` and `--tenant-weight`.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueSettings {
    pub threshold: f64,
    pub core: QueueConfig,
    /// The `Retry-After` of a 429, in seconds.
    pub retry_after_secs: u64,
}

/// Every partition's queue.
#[derive(Debug)]
pub struct AdmissionQueues {
    settings: Option<QueueSettings>,
    inner: Mutex<Inner>,
    /// Wakes the admission task: capacity may have freed, or a request joined.
    wake: Notify,
    /// Whether the admission task was started (at the first request that waits).
    task_started: AtomicBool,
}

#[derive(Debug, Default)]
pub struct Inner {
    partitions: HashMap<PartitionKey, AdmissionQueue<Queued>>,
    /// Waiting requests of all partitions (`--queue-max-requests` bounds it).
    total: usize,
    /// Waiting requests not pinned to a worker, per partition (they hold newcomers back).
    unpinned: HashMap<PartitionKey, usize>,
    /// Selection ids held by waiting requests: another request with the id gets a 409.
    ids: HashMap<(PartitionKey, String), usize>,
    shut: bool,
}

/// A partition's queue seen from `/loads` and the metrics.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PartitionQueue {
    pub count: usize,
    pub isl_tokens: u64,
    pub tenants: BTreeMap<String, usize>,
}

impl AdmissionQueues {
    pub fn new(settings: Option<QueueSettings>) -> Self {
        Self {
            settings,
            inner: Mutex::new(Inner::default()),
            wake: Notify::new(),
            task_started: AtomicBool::new(false),
        }
    }

    /// True once: for the caller that is to start the admission task.
    pub fn claim_task(&self) -> bool {
        !self.task_started.swap(true, Ordering::SeqCst)
    }

    /// Asks the admission task for a pass over the queues (a no-op without a queue). A wake
    /// while the task is busy is kept, so none is lost.
    pub fn wake(&self) {
        if self.settings.is_some() {
            self.wake.notify_one();
        }
    }

    /// Returns at the next [`AdmissionQueues::wake`] (or at once for one made meanwhile).
    pub async fn woken(&self) {
        self.wake.notified().await;
    }

    /// The queue's settings; `None`: requests never wait.
    pub fn settings(&self) -> Option<&QueueSettings> {
        self.settings.as_ref()
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// What waits in each partition.
    pub fn snapshot(&self) -> HashMap<PartitionKey, PartitionQueue> {
        let inner = self.inner.lock();
        inner
            .partitions
            .iter()
            .map(|(key, q)| {
                (
                    key.clone(),
                    PartitionQueue {
                        count: q.len(),
                        isl_tokens: q.isl_tokens(),
                        tenants: q
                            .tenant_lengths()
                            .map(|(t, n)| (t.to_string(), n))
                            .collect(),
                    },
                )
            })
            .collect()
    }
}

impl Inner {
    /// Whether a request of `key` holding `selection_id` waits.
    pub fn holds_id(&self, key: &PartitionKey, selection_id: &str) -> bool {
        self.ids
            .contains_key(&(key.clone(), selection_id.to_string()))
    }

    /// Whether a newcomer of `key` must queue behind requests already waiting there: any
    /// waiting request that is not pinned to a worker holds it back (first come first served
    /// across the partition); a pinned one waits for its own worker only.
    pub fn holds_back(&self, key: &PartitionKey) -> bool {
        self.unpinned.get(key).is_some_and(|&n| n > 0)
    }

    pub fn is_shut(&self) -> bool {
        self.shut
    }

    /// Queues a request; [`QueueError::Full`] beyond `max` waiting in all partitions.
    pub fn push(
        &mut self,
        config: &QueueConfig,
        tenant: &str,
        order: QueueOrder,
        queued: Queued,
    ) -> Result<Ticket, QueueError> {
        if self.total >= config.max_requests {
            return Err(QueueError::Full {
                max: config.max_requests,
            });
        }
        let key = queued.resolved.key.clone();
        let id = queued.body.selection_id.clone();
        let pinned = queued.body.pinned_worker.is_some();
        let q = self.partitions.entry(key.clone()).or_insert_with(|| {
            AdmissionQueue::new(QueueConfig {
                // The bound is kept here, across partitions.
                max_requests: usize::MAX,
                ..config.clone()
            })
        });
        let ticket = q.push(tenant, order, queued).map_err(|(e, _)| e)?;
        self.total += 1;
        if !pinned {
            *self.unpinned.entry(key.clone()).or_default() += 1;
        }
        if let Some(id) = id {
            *self.ids.entry((key, id)).or_default() += 1;
        }
        Ok(ticket)
    }

    /// The request the partition's queue would release next.
    pub fn peek(&self, key: &PartitionKey, now: Instant) -> Option<&Queued> {
        let q = self.partitions.get(key)?;
        q.peek(now).and_then(|t| q.get(t))
    }

    /// Takes out the request [`Inner::peek`] named.
    pub fn pop(&mut self, key: &PartitionKey, now: Instant) -> Option<Queued> {
        let q = self.partitions.get_mut(key)?;
        let d = q.pop(now)?;
        self.left(key, &d.payload);
        Some(d.payload)
    }

    /// Takes a request out by its ticket; `None` when it no longer waits (it was decided).
    pub fn remove(&mut self, key: &PartitionKey, ticket: Ticket) -> Option<Queued> {
        let q = self.partitions.get_mut(key)?;
        let d = q.remove(ticket)?;
        self.left(key, &d.payload);
        Some(d.payload)
    }

    /// Partitions with requests waiting.
    pub fn keys(&self) -> Vec<PartitionKey> {
        self.partitions.keys().cloned().collect()
    }

    /// Takes every waiting request out (shutdown); later pushes are refused.
    pub fn drain(&mut self) -> Vec<Queued> {
        self.shut = true;
        self.total = 0;
        self.unpinned.clear();
        self.ids.clear();
        self.partitions
            .drain()
            .flat_map(|(_, mut q)| q.drain().into_iter().map(|d| d.payload))
            .collect()
    }

    fn left(&mut self, key: &PartitionKey, queued: &Queued) {
        self.total -= 1;
        if queued.body.pinned_worker.is_none()
            && let Some(n) = self.unpinned.get_mut(key)
        {
            *n -= 1;
            if *n == 0 {
                self.unpinned.remove(key);
            }
        }
        if let Some(id) = &queued.body.selection_id {
            let k = (key.clone(), id.clone());
            if let Some(n) = self.ids.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    self.ids.remove(&k);
                }
            }
        }
        if self
            .partitions
            .get(key)
            .is_some_and(AdmissionQueue::is_empty)
        {
            self.partitions.remove(key);
        }
    }
}

/// The order of a request in its queue, from its body and what the selector found.
pub fn order_of(
    body: &SelectBody,
    now: Instant,
    isl_tokens: u64,
    uncached_tokens: u64,
    timeout: Option<Duration>,
) -> QueueOrder {
    QueueOrder {
        arrived: now,
        isl_tokens,
        uncached_tokens,
        priority_jump: body.priority_jump.unwrap_or(0.0),
        strict_priority: body.strict_priority.unwrap_or(0),
        timeout,
    }
}
