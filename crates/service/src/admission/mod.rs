//! Admission: `/select` and `/select_and_reserve` decided at once, or waiting until capacity
//! frees, their timeout passes, their client leaves or the service stops.
//!
//! The select path runs downhill through it: the handler → `api::select` (parse, hash) →
//! [`admit`] (here: decide now, or queue) → [`decide`] (select, book). Waiting requests are
//! released by the admission task ([`release`]), which a change that may free capacity wakes
//! (`AppState::changed`); no caller drains the queue in its own context.
//!
//! - [`queue`]: what waits, per partition (the data, below the state that holds it).
//! - [`release`]: the admission task: decides waiting requests while their ranks have room.
//! - [`decide`]: a request decided: selected, or selected and booked.
//!
//! Lock order: the queue's mutex, then the selector's lock; never the other way. A waiting
//! request is decided (and booked) under the queue's mutex, then its answer is sent; a [`Waiter`]
//! that goes away takes its ticket out under the same mutex, or finds its answer already sent
//! and frees the booking made for it. So each request is decided at most once and no booking
//! outlives a client that left.

pub mod decide;
pub mod queue;
pub mod release;

use crate::error::ApiError;
use crate::state::AppState;
use crate::types::SelectBody;
use axum::http::StatusCode;
use kvroute_core::admission::{QueueError, Ticket};
use kvroute_core::error::{PartitionKey, check_id};
use queue::{DEFAULT_TENANT, Decision, Queued, ResolvedSelect, Routed, SHUTTING_DOWN, order_of};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// A request's fate at arrival; `T` is its route's answer (`Selection` or `Booked`).
#[derive(Debug)]
pub enum Admission<T> {
    /// Decided (answered, or refused) at once.
    Decided(Result<T, ApiError>),
    /// Waiting in the queue: await [`Waiter::wait`] (dropping it leaves the queue).
    Waiting(Waiter<T>),
}

impl<T: Routed> Admission<T> {
    /// The answer, waiting for it if need be.
    pub async fn answer(self) -> Result<T, ApiError> {
        match self {
            Admission::Decided(result) => result,
            Admission::Waiting(waiter) => waiter.wait().await,
        }
    }

    /// The answer if it was decided at once (always, without `--queue-threshold`); `None` for a
    /// waiting request, which leaves the queue.
    pub fn decided(self) -> Option<Result<T, ApiError>> {
        match self {
            Admission::Decided(result) => Some(result),
            Admission::Waiting(_) => None,
        }
    }
}

/// 429 with the queue's `Retry-After`.
fn too_many(state: &AppState, message: String) -> ApiError {
    let secs = state.admission.settings().map_or(1, |s| s.retry_after_secs);
    ApiError::new(StatusCode::TOO_MANY_REQUESTS, message).with_retry_after(secs)
}

fn shutting_down() -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, SHUTTING_DOWN)
}

/// A request decided now, as its route's answer.
fn decide_now<T: Routed>(
    state: &AppState,
    resolved: &ResolvedSelect,
    body: &SelectBody,
) -> Admission<T> {
    Admission::Decided(answer_of(decide::decide(state, T::ROUTE, resolved, body)))
}

/// A decision as the answer of route `T`.
fn answer_of<T: Routed>(decision: Decision) -> Result<T, ApiError> {
    decision.result.and_then(|decided| {
        // A request is decided for the route it came by: `decide` is given `T::ROUTE`.
        T::from_decided(decided).ok_or_else(|| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "a request was decided for another route",
            )
        })
    })
}

/// `POST /select` (`T` = `Selection`) or `POST /select_and_reserve` (`T` = `Booked`), its
/// prompt hashed: decides at once or queues it. `tenant` (`x-tenant-id`) shares the queue
/// fairly with other tenants.
pub fn admit<T: Routed>(
    state: &Arc<AppState>,
    resolved: ResolvedSelect,
    body: SelectBody,
    tenant: Option<&str>,
) -> Admission<T> {
    let Some(settings) = state.admission.settings() else {
        return decide_now(state, &resolved, &body);
    };
    // Advisory selects never wait, as in Dynamo.
    if T::ROUTE == queue::Route::Select && body.advisory {
        return decide_now(state, &resolved, &body);
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
    let mut inner = state.admission.lock();
    if inner.is_shut() {
        return Admission::Decided(Err(shutting_down()));
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
            return decide_now(state, &resolved, &body);
        }
        Ok(p) => p,
    };
    if !probe.full && !inner.holds_back(&key) {
        drop(inner);
        return decide_now(state, &resolved, &body);
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
        route: T::ROUTE,
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
                rx: Some(rx),
                deadline: timeout.map(|t| tokio::time::Instant::now() + t),
                timeout,
                since: Instant::now(),
                answer: PhantomData,
            };
            release::ensure_running(state);
            // Capacity may have freed between the probe and now.
            state.admission.wake();
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
pub fn check_id_not_queued(
    state: &AppState,
    key: &PartitionKey,
    selection_id: Option<&str>,
) -> Result<(), ApiError> {
    match selection_id {
        Some(id)
            if state.admission.settings().is_some() && state.admission.lock().holds_id(key, id) =>
        {
            Err(id_held(id))
        }
        _ => Ok(()),
    }
}

/// A request waiting in the queue. Dropping it before its answer leaves the queue (a client
/// that disconnected, a cancelled Python awaitable); if it was decided meanwhile, what was
/// booked for it is freed.
pub struct Waiter<T> {
    state: Arc<AppState>,
    key: PartitionKey,
    ticket: Ticket,
    rx: Option<oneshot::Receiver<Decision>>,
    deadline: Option<tokio::time::Instant>,
    timeout: Option<Duration>,
    since: Instant,
    answer: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for Waiter<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("partition", &self.key)
            .field("ticket", &self.ticket)
            .finish()
    }
}

impl<T: Routed> Waiter<T> {
    /// Waits for the decision, or the request's timeout (429).
    pub async fn wait(mut self) -> Result<T, ApiError> {
        let Some(rx) = self.rx.as_mut() else {
            return Err(shutting_down());
        };
        let decision = match self.deadline {
            None => rx.await,
            Some(deadline) => match tokio::time::timeout_at(deadline, &mut *rx).await {
                Ok(decision) => decision,
                Err(_) => {
                    let gone = self.state.admission.lock().remove(&self.key, self.ticket);
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
            Ok(d) => answer_of(d),
            // Never dropped unanswered; the service's end is the only way it could be.
            Err(_) => Err(shutting_down()),
        }
    }
}

impl<T> Drop for Waiter<T> {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        let gone = self.state.admission.lock().remove(&self.key, self.ticket);
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
            decide::free_unread(&self.state, &id);
        }
    }
}
