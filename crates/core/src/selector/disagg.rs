//! Disaggregated prefill and decode (SPEC §6.1): one call picks a prefill worker and a decode
//! worker for a request, each costed for its leg (`crate::schedule::Leg`), or — a bypass — one
//! worker that runs the whole request. `select_disaggregated` caches each leg for a replay
//! (`<id>.prefill`, `<id>.decode`); `select_and_reserve_disaggregated` books both legs, or
//! neither.

use super::*;
use crate::schedule::Leg;

/// Appended to a request's id to name its prefill leg's selection and booking.
pub const PREFILL_LEG_SUFFIX: &str = ".prefill";
/// Appended to a request's id to name its decode leg's (or bypass's) selection and booking.
pub const DECODE_LEG_SUFFIX: &str = ".decode";

/// A leg's id: the request's id with the leg's suffix, checked like any booking id.
fn leg_id(field: &'static str, base: &str, suffix: &str) -> Result<String, Error> {
    let id = format!("{base}{suffix}");
    sync::check_booking_id(field, &id)?;
    Ok(id)
}

/// The request as one leg sees it: its own id, and for the prefill leg one output token (the
/// engine answers the prefill leg with its first token). A decode leg carries no session
/// (`compute_selection` skips it; the booking must not bind it either).
fn leg_request<'a>(
    req: &SelectRequest<'a>,
    leg: Leg,
    selection_id: Option<&'a str>,
) -> SelectRequest<'a> {
    let mut leg_req = *req;
    leg_req.selection_id = selection_id;
    match leg {
        Leg::Prefill => leg_req.expected_output_tokens = Some(1),
        Leg::Decode => {
            leg_req.session_id = None;
            leg_req.affinity_target = None;
        }
        Leg::Whole => {}
    }
    leg_req
}

impl Selector {
    /// The picks, before any caching or booking. `ids` are the legs' (prefill, decode) ids.
    fn compute_disaggregated(
        &self,
        req: &SelectRequest<'_>,
        ids: (Option<&str>, Option<&str>),
        now: Instant,
        rng: &mut impl Rng,
    ) -> Result<DisaggSelection, Error> {
        if req.pinned_worker.is_some() {
            return Err(Error::InvalidField {
                field: "pinned_worker",
                message: "pinned_worker cannot be combined with disaggregated: the request runs \
                          on two workers (use allowed_worker_ids)"
                    .to_string(),
            });
        }
        // The whole request on a decode or both worker: the bypass, when little is uncached
        // there (the session, if any, is honoured here as for a plain request).
        // No worker may run it whole (say, SGLang decode workers only): no bypass, both legs.
        let whole_req = leg_request(req, Leg::Whole, ids.1);
        let whole = match self.compute_selection(&whole_req, now, rng, Leg::Whole) {
            Ok(w) => Ok(w),
            Err(e @ (Error::NoEndpointsAvailable | Error::AllWorkersBusy)) => Err(e),
            Err(e) => return Err(e),
        };
        let bypass = |reason| {
            whole.clone().map(|decode| DisaggSelection {
                prefill: None,
                decode,
                bypass: Some(reason),
            })
        };
        if let Ok(w) = &whole
            && w.isl_tokens.saturating_sub(w.overlap.gpu) <= self.config.pd_bypass_tokens
        {
            return bypass(PdBypass::SmallUncached);
        }
        let prefill_req = leg_request(req, Leg::Prefill, ids.0);
        let prefill = match self.compute_selection(&prefill_req, now, rng, Leg::Prefill) {
            Ok(p) => p,
            Err(Error::AllWorkersBusy) => return bypass(PdBypass::PrefillSaturated),
            Err(Error::NoEndpointsAvailable) => return bypass(PdBypass::NoPrefillWorkers),
            Err(e) => return Err(e),
        };
        let decode_req = leg_request(req, Leg::Decode, ids.1);
        let decode = self.compute_selection(&decode_req, now, rng, Leg::Decode)?;
        Ok(DisaggSelection {
            prefill: Some(prefill),
            decode,
            bypass: None,
        })
    }

    /// `POST /select` with `disaggregated`: a prefill and a decode pick, booking nothing. With a
    /// `selection_id` each leg is cached for a replay under `<id>.prefill` / `<id>.decode` (a
    /// bypass under `<id>.decode` alone).
    pub fn select_disaggregated(
        &self,
        req: &SelectRequest<'_>,
        now: Instant,
        rng: &mut impl Rng,
    ) -> Result<DisaggSelection, Error> {
        let ids = match req.selection_id {
            Some(id) => (
                Some(leg_id("selection_id", id, PREFILL_LEG_SUFFIX)?),
                Some(leg_id("selection_id", id, DECODE_LEG_SUFFIX)?),
            ),
            None => (None, None),
        };
        let (prefill_id, decode_id) = (ids.0.as_deref(), ids.1.as_deref());
        let picks = self.compute_disaggregated(req, (prefill_id, decode_id), now, rng)?;
        if let Some(prefill) = &picks.prefill {
            self.cache_selection(&leg_request(req, Leg::Prefill, prefill_id), prefill, now);
        }
        let decode_leg = if picks.bypass.is_some() {
            Leg::Whole
        } else {
            Leg::Decode
        };
        self.cache_selection(&leg_request(req, decode_leg, decode_id), &picks.decode, now);
        Ok(picks)
    }

    /// `POST /select_and_reserve` with `disaggregated`: both legs picked and booked under
    /// `<id>.prefill` and `<id>.decode` (`id`: `reservation_id`, else `selection_id`, else a
    /// generated UUID), or neither. The prefill booking carries the prompt and one output token
    /// (free it when the prefill leg returns); the decode booking the prompt's KV and the
    /// output, no prefill. A bypass books one whole request under `<id>.decode`.
    pub fn select_and_reserve_disaggregated(
        &mut self,
        req: &SelectRequest<'_>,
        reservation_id: Option<&str>,
        now: Instant,
        rng: &mut impl Rng,
    ) -> Result<(DisaggSelection, DisaggReservation), Error> {
        for (field, value) in [
            ("reservation_id", reservation_id),
            ("selection_id", req.selection_id),
        ] {
            if let Some(v) = value {
                sync::check_booking_id(field, v)?;
            }
        }
        let base = reservation_id
            .or(req.selection_id)
            .map(str::to_string)
            .unwrap_or_else(|| random_uuid(rng));
        let prefill_id = leg_id("reservation_id", &base, PREFILL_LEG_SUFFIX)?;
        let decode_id = leg_id("reservation_id", &base, DECODE_LEG_SUFFIX)?;
        self.expire_predictions(now);
        let picks =
            self.compute_disaggregated(req, (Some(&prefill_id), Some(&decode_id)), now, rng)?;
        let (prefill, prefill_booking) = match picks.prefill {
            Some(selection) => {
                let leg_req = leg_request(req, Leg::Prefill, Some(&prefill_id));
                let (s, r) = self.book_selection(&leg_req, selection, prefill_id.clone(), now)?;
                (Some(s), Some(r))
            }
            None => (None, None),
        };
        let decode_leg = if picks.bypass.is_some() {
            Leg::Whole
        } else {
            Leg::Decode
        };
        let decode_req = leg_request(req, decode_leg, Some(&decode_id));
        let (decode, decode_booking) =
            match self.book_selection(&decode_req, picks.decode, decode_id.clone(), now) {
                Ok(booked) => booked,
                Err(e) => {
                    // Both legs or neither: the prefill booking goes with the refused decode.
                    if let Some(r) = &prefill_booking {
                        let _ = LifecycleCalls::free(&mut *self, &r.reservation_id, now);
                    }
                    return Err(e);
                }
            };
        Ok((
            DisaggSelection {
                prefill,
                decode,
                bypass: picks.bypass,
            },
            DisaggReservation {
                prefill: prefill_booking,
                decode: decode_booking,
            },
        ))
    }
}
