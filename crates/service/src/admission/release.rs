//! The admission task: decides waiting requests while the next one's ranks have room. It starts
//! with the first request that waits ([`ensure_running`]), on that request's runtime, and runs
//! when woken (`AppState::changed` wakes it after every change that may free capacity: a prefill
//! completes, a booking is freed, a worker changes; and [`super::admit`] after queueing) and
//! every 50 ms, for capacity freed by what calls no route (another replica's bookings, expired
//! bookings). The caller that freed capacity never decides others' requests in its context.

use super::decide;
use super::queue::Decision;
use crate::state::AppState;
use std::sync::Arc;
use std::time::Duration;

/// The most requests one pass decides in a partition before it lets others at the queue.
const MAX_DECIDED_PER_RELEASE: usize = 4_096;

/// Starts the admission task unless it runs: called by a request about to wait, so a service
/// whose requests never wait never starts it. Needs a tokio runtime (every caller that can
/// await a `Waiter` has one).
pub fn ensure_running(state: &Arc<AppState>) {
    if state.admission.claim_task() {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(run_admission(Arc::clone(state)));
            }
            Err(_) => tracing::error!("no tokio runtime: waiting requests are never released"),
        }
    }
}

/// Runs the admission task until the service stops; returns at once without a queue.
async fn run_admission(state: Arc<AppState>) {
    if state.admission.settings().is_none() {
        return;
    }
    let mut interval = tokio::time::interval(Duration::from_millis(50));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !state.is_shutting_down() {
        tokio::select! {
            _ = state.admission.woken() => {}
            _ = interval.tick() => {}
        }
        release(&state);
    }
}

/// One pass over the partitions: decides waiting requests while the next one's ranks have
/// room, then frees the bookings made for clients gone meanwhile (which wakes the task again).
fn release(state: &AppState) {
    let Some(settings) = state.admission.settings() else {
        return;
    };
    let threshold = settings.threshold;
    let mut unread = Vec::new();
    {
        let mut inner = state.admission.lock();
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
                let decision = decide::decide(state, queued.route, &queued.resolved, &queued.body);
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
    }
    for id in unread {
        decide::free_unread(state, &id);
    }
}

/// Sets the queue-depth gauges from what waits now.
pub fn observe_queue(state: &AppState) {
    if state.admission.settings().is_none() {
        return;
    }
    let snapshot = state.admission.snapshot();
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
