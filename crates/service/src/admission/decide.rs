//! A request decided: selected (`/select`), or selected and booked (`/select_and_reserve`).
//! Reached from [`super::admit`] for a request decided at once and from the admission task for
//! a waiting one; both hold the queue's mutex or no lock, never the selector's.

use super::queue::{Booked, Decided, Decision, ResolvedSelect, Route};
use crate::state::{AppState, Change};
use crate::types::SelectBody;
use kvroute_core::selector::LifecycleCalls;
use std::time::Instant;

/// Decides a request by its route.
pub fn decide(
    state: &AppState,
    route: Route,
    resolved: &ResolvedSelect,
    body: &SelectBody,
) -> Decision {
    match route {
        Route::Select => Decision {
            result: select(state, resolved, body).map(Decided::Selected),
            booked: None,
        },
        Route::SelectAndReserve => match select_and_reserve(state, resolved, body) {
            Ok(booked) => Decision {
                booked: Some(booked.reservation.reservation_id.clone()),
                result: Ok(Decided::Booked(booked)),
            },
            Err(e) => Decision {
                result: Err(e),
                booked: None,
            },
        },
    }
}

/// `POST /select`: the pick, booking nothing.
fn select(
    state: &AppState,
    resolved: &ResolvedSelect,
    body: &SelectBody,
) -> Result<kvroute_core::selector::Selection, crate::error::ApiError> {
    let req = resolved.request(body, body.advisory);
    let start = Instant::now();
    let selection = state
        .selector
        .read()
        .select(&req, state.now(), &mut rand::rng())?;
    state
        .metrics
        .observe_phase("route", start.elapsed().as_secs_f64());
    state.metrics.observe_selection(&selection);
    Ok(selection)
}

/// `POST /select_and_reserve` (`advisory` does not apply).
fn select_and_reserve(
    state: &AppState,
    resolved: &ResolvedSelect,
    body: &SelectBody,
) -> Result<Booked, crate::error::ApiError> {
    let req = resolved.request(body, false);
    let booked = state.selector.write().select_and_reserve(
        &req,
        body.reservation_id.as_deref(),
        state.now(),
        &mut rand::rng(),
    );
    match booked {
        Ok((selection, reservation)) => {
            state.changed(Change::Booked {
                reservation_id: &reservation.reservation_id,
                worker_id: reservation.worker_id,
            });
            state.metrics.observe_selection(&selection);
            Ok(Booked {
                selection,
                reservation,
            })
        }
        Err(e) => {
            // A refused booking may have dropped its session's binding.
            state.changed(Change::BookingRefused);
            Err(e.into())
        }
    }
}

/// Frees a booking made for a client that left before reading its answer.
pub fn free_unread(state: &AppState, reservation_id: &str) {
    if state.selector.free(reservation_id, state.now()).is_ok() {
        state.changed(Change::Freed(reservation_id));
    }
}
