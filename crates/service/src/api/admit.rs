//! `/select` and `/select_and_reserve` through the admission queue (`crate::queue`): decided at
//! once, or waiting until capacity frees, their timeout passes, their client leaves or the
//! service stops.
//!
//! Lock order: the queue's mutex, then the selector's lock; never the other way. A waiting
//! request is decided (and booked) by [`admit_waiting`] under the queue's mutex, then its answer
//! is sent; a [`Waiter`] that goes away takes its ticket out under the same mutex, or finds its
//! answer already sent and frees the booking made for it. So each request is decided at most
//! once and no booking outlives a client that left.

use super::{ApiResult, decide_select, decide_select_and_reserve, free_booking, resolve_select};
use crate::error::ApiError;
use crate::queue::{
    DEFAULT_TENANT, Decision, Queued, QueuedRoute, ResolvedSelect, SHUTTING_DOWN, order_of,
};
use crate::state::AppState;
use crate::types::SelectBody;
use axum::http::StatusCode;
use kvroute_core::admission::{QueueError, Ticket};
use kvroute_core::error::{PartitionKey, check_id};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// The most requests one release decides before it lets others at the queue.
const MAX_DECIDED_PER_RELEASE: usize = 4_096;

/// A request's fate at arrival.
#[derive(Debug)]
pub enum Admission {
    /// Decided (answered, or refused) at once.
    Decided(ApiResult),
    /// Waiting in the queue: await [`Waiter::wait`] (dropping it leaves the queue).
    Waiting(Waiter),
}

impl Admission {
    /// The answer, waiting for it if need be.
    pub async fn answer(self) -> ApiResult {
        match self {
            Admission::Decided(result) => result,
            Admission::Waiting(waiter) => waiter.wait().await,
        }
    }

    /// The answer if it was decided at once (always, without `--queue-threshold`); `None` for a
    /// waiting request, which leaves the queue.
    pub fn decided(self) -> Option<ApiResult> {
        match self {
            Admission::Decided(result) => Some(result),
            Admission::Waiting(_) => None,
        }
    }
}

fn decide(
    state: &AppState,
    route: QueuedRoute,
    resolved: &ResolvedSelect,
    body: &SelectBody,
) -> Decision {
    match route {
        QueuedRoute::Select => Decision {
            result: decide_select(state, resolved, body),
            booked: None,
        },
        QueuedRoute::SelectAndReserve => {
            let (result, booked) = decide_select_and_reserve(state, resolved, body);
            Decision { result, booked }
        }
    }
}

/// 429 with the queue's `Retry-After`.
fn too_many(state: &AppState, message: String) -> ApiError {
    let secs = state.queues.settings().map_or(1, |s| s.retry_after_secs);
    ApiError::new(StatusCode::TOO_MANY_REQUESTS, message).with_retry_after(secs)
}

/// `POST /select` (`route` Select) or `POST /select_and_reserve`: hashes the prompt, then decides
/// at once or queues it. `tenant` (`x-tenant-id`) shares the queue fairly with other tenants.
pub fn admit(
    state: &Arc<AppState>,
    route: QueuedRoute,
    mut body: SelectBody,
    tenant: Option<&str>,
) -> Admission {
    let resolved = match resolve_select(state, &mut body) {
        Ok(r) => r,
        Err(e) => return Admission::Decided(Err(e)),
    };
    let decide_now = |resolved: &ResolvedSelect, body: &SelectBody| {
        Admission::Decided(decide(state, route, resolved, body).result)
    };
    let Some(settings) = state.queues.settings() else {
        return decide_now(&resolved, &body);
    };
    // Advisory selects never wait, as in Dynamo.
    if route == QueuedRoute::Select && body.advisory {
        return decide_now(&resolved, &body);
    }
    if let Some(t) = tenant
        && let Err(e) = check_id("x-tenant-id", t)
    {
        return Admission::Decided(Err(e.into()));
    }
    let timeout = match body.queue_timeout_ms {
        Some(ms) if !(1..=86_400_000).contains(&ms) => {
            return Admission::Decided(Err(ApiError::unprocessable(format!(
                "queue_timeout_ms must be from 1 to 86400000 milliseconds (got {ms})"
            ))));
        }
        Some(ms) => Some(Duration::from_millis(ms)),
        None => settings.core.timeout,
    };
    let key = resolved.key.clone();
    let mut inner = state.queues.lock();
    if inner.is_shut() {
        return Admission::Decided(Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            SHUTTING_DOWN,
        )));
    }
    if let Some(id) = &body.selection_id
        && inner.holds_id(&key, id)
    {
        return Admission::Decided(Err(id_held(id)));
    }
    let probe = state
        .selector
        .read()
        .queue_probe(&resolved.request(&body, false), settings.threshold);
    let probe = match probe {
        // What selecting answers now (no such worker, shutting down): decided, not queued.
        Err(_) => {
            drop(inner);
            return decide_now(&resolved, &body);
        }
        Ok(p) => p,
    };
    if !probe.full && !inner.holds_back(&key) {
        drop(inner);
        return decide_now(&resolved, &body);
    }
    let order = order_of(
        &body,
        state.now(),
        probe.isl_tokens,
        probe.uncached_tokens,
        None,
    );
    let (reply, rx) = oneshot::channel();
    let queued = Queued {
        route,
        body,
        resolved,
        reply,
        since: Instant::now(),
    };
    let tenant = tenant.unwrap_or(DEFAULT_TENANT);
    match inner.push(&settings.core, tenant, order, queued) {
        Err(QueueError::Full { max }) => {
            drop(inner);
            state.metrics.queue.count_shed("full");
            Admission::Decided(Err(too_many(
                state,
                format!("the selection queue is full ({max} requests waiting); retry later"),
            )))
        }
        Ok(ticket) => {
            drop(inner);
            let waiter = Waiter {
                state: Arc::clone(state),
                key,
                ticket,
                route,
                rx: Some(rx),
                deadline: timeout.map(|t| tokio::time::Instant::now() + t),
                timeout,
                since: Instant::now(),
            };
            // Capacity may have freed between the probe and now.
            admit_waiting(state);
            Admission::Waiting(waiter)
        }
    }
}

fn id_held(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        format!("selection {id} is already reserved or being reserved"),
    )
}

/// 409 when a waiting request holds `selection_id` in `key` (a booking of it would race the
/// queued one).
pub(super) fn check_id_not_queued(
    state: &AppState,
    key: &PartitionKey,
    selection_id: Option<&str>,
) -> Result<(), ApiError> {
    match selection_id {
        Some(id) if state.queues.settings().is_some() && state.queues.lock().holds_id(key, id) => {
            Err(id_held(id))
        }
        _ => Ok(()),
    }
}

/// A request waiting in the queue. Dropping it before its answer leaves the queue (a client
/// that disconnected, a cancelled Python awaitable); if it was decided meanwhile, what was
/// booked for it is freed.
pub struct Waiter {
    state: Arc<AppState>,
    key: PartitionKey,
    ticket: Ticket,
    route: QueuedRoute,
    rx: Option<oneshot::Receiver<Decision>>,
    deadline: Option<tokio::time::Instant>,
    timeout: Option<Duration>,
    since: Instant,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("partition", &self.key)
            .field("ticket", &self.ticket)
            .field("route", &self.route)
            .finish()
    }
}

impl Waiter {
    /// Waits for the decision, or the request's timeout (429).
    pub async fn wait(mut self) -> ApiResult {
        let Some(rx) = self.rx.as_mut() else {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                SHUTTING_DOWN,
            ));
        };
        let decision = match self.deadline {
            None => rx.await,
            Some(deadline) => match tokio::time::timeout_at(deadline, &mut *rx).await {
                Ok(decision) => decision,
                Err(_) => {
                    let gone = self.state.queues.lock().remove(&self.key, self.ticket);
                    if gone.is_some() {
                        self.rx = None;
                        let waited = self.since.elapsed();
                        self.state
                            .metrics
                            .queue
                            .observe_wait("timeout", waited.as_secs_f64());
                        let ms = self.timeout.map_or(0, |t| t.as_millis());
                        return Err(too_many(
                            &self.state,
                            format!(
                                "the request waited its queue timeout ({ms} ms) for a worker with capacity; retry later"
                            ),
                        ));
                    }
                    // Decided under the queue's mutex before we got it: the answer is sent.
                    rx.await
                }
            },
        };
        self.rx = None;
        match decision {
            Ok(d) => d.result,
            // Never dropped unanswered; the service's end is the only way it could be.
            Err(_) => Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                SHUTTING_DOWN,
            )),
        }
    }

    /// Which route the request came by.
    pub fn route(&self) -> QueuedRoute {
        self.route
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        let gone = self.state.queues.lock().remove(&self.key, self.ticket);
        if gone.is_some() {
            self.state
                .metrics
                .queue
                .observe_wait("disconnected", self.since.elapsed().as_secs_f64());
            return;
        }
        // Decided before the client left: nobody will read the answer, so free its booking.
        if let Ok(Decision {
            booked: Some(id), ..
        }) = rx.try_recv()
        {
            let _ = free_booking(&self.state, &id);
            admit_waiting(&self.state);
        }
    }
}

/// Decides waiting requests while the next one's ranks have room, in every partition. Called
/// after every change that may free capacity (a prefill completes, a booking is freed, a
/// worker changes) and periodically.
pub fn admit_waiting(state: &AppState) {
    // Freeing the bookings of clients that left frees capacity again: a few more passes.
    for _ in 0..16 {
        let unread = admit_pass(state);
        if unread.is_empty() {
            return;
        }
        for id in unread {
            let _ = free_booking(state, &id);
        }
    }
}

/// One pass over the partitions; the bookings made for clients gone meanwhile.
fn admit_pass(state: &AppState) -> Vec<String> {
    let Some(settings) = state.queues.settings() else {
        return Vec::new();
    };
    let threshold = settings.threshold;
    let mut unread = Vec::new();
    let mut inner = state.queues.lock();
    for key in inner.keys() {
        for _ in 0..MAX_DECIDED_PER_RELEASE {
            let now = state.now();
            let Some(head) = inner.peek(&key, now) else {
                break;
            };
            let full = state
                .selector
                .read()
                .queue_probe(&head.resolved.request(&head.body, false), threshold)
                .is_ok_and(|p| p.full);
            // Head of line: while the next request's ranks are full, nothing behind it goes.
            if full {
                break;
            }
            let Some(queued) = inner.pop(&key, now) else {
                break;
            };
            let decision = decide(state, queued.route, &queued.resolved, &queued.body);
            state
                .metrics
                .queue
                .observe_wait("admitted", queued.since.elapsed().as_secs_f64());
            if let Err(Decision {
                booked: Some(id), ..
            }) = queued.reply.send(decision)
            {
                unread.push(id);
            }
        }
    }
    unread
}

/// Releases waiting requests every 50 ms as well, for capacity freed by what calls no route
/// (another replica's bookings, expired bookings); returns at once without a queue.
pub async fn run_admission(state: Arc<AppState>) {
    if state.queues.settings().is_none() {
        return;
    }
    let mut interval = tokio::time::interval(Duration::from_millis(50));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !state.is_shutting_down() {
        interval.tick().await;
        admit_waiting(&state);
    }
}

/// Sets the queue-depth gauges from what waits now.
pub fn observe_queue(state: &AppState) {
    if state.queues.settings().is_none() {
        return;
    }
    let snapshot = state.queues.snapshot();
    state
        .metrics
        .queue
        .set_depths(snapshot.iter().map(|(key, q)| {
            (
                key.model_name.as_str(),
                key.routing_group.as_str(),
                q.isl_tokens,
                q.tenants.iter().map(|(t, n)| (t.as_str(), *n)).collect(),
            )
        }));
}
