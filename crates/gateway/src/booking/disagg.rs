//! The bookings of a disaggregated request (`ServiceLink::book_disaggregated`): both legs, or a
//! bypass, through the service's disaggregated select (SPEC §6.1).

use super::{BookRequest, Booking, ServiceLink, select_body};
use crate::error::GatewayError;
use axum::http::StatusCode;
use kvroute_core::selector::{PdBypass, Reservation, Selection};
use kvroute_service::api::DisaggSelected;
use kvroute_service::types::SelectBody;
use prometheus_client::metrics::gauge::Gauge;

/// One leg of a disaggregated request, booked: where to send it.
#[derive(Debug)]
pub struct LegBooking {
    pub booking: Booking,
    pub endpoint: String,
    /// The worker's SGLang bootstrap port (a prefill leg's).
    pub bootstrap_port: Option<u16>,
}

/// A disaggregated request's bookings: both legs, or (a bypass) the decode leg alone, booked
/// as a whole request.
#[derive(Debug)]
pub struct PdBooked {
    pub prefill: Option<LegBooking>,
    pub decode: LegBooking,
    pub bypass: Option<PdBypass>,
}

impl ServiceLink {
    /// Books a disaggregated request as `POST /select_and_reserve` with `"disaggregated":
    /// true` does: a prefill and a decode leg (`<id>.prefill`, `<id>.decode`), or one worker
    /// for the whole request (a bypass). Decided at once (never queued). `decode_runs_whole`:
    /// whether a decode worker can take a bypass (vLLM's can, SGLang's need a prefill peer, so
    /// their bypasses go to `both` workers only).
    pub fn book_disaggregated(
        &self,
        request: BookRequest<'_>,
        decode_runs_whole: bool,
        bookings_open: &Gauge,
    ) -> Result<PdBooked, GatewayError> {
        let body = SelectBody {
            disaggregated: true,
            decode_runs_whole: Some(decode_runs_whole),
            ..select_body(&request)
        };
        let DisaggSelected {
            selection,
            reservations,
        } = self.service.select_and_reserve_disaggregated(body)?;
        let Some(reservations) = reservations else {
            return Err(GatewayError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the selector picked the legs but booked neither",
            ));
        };
        // Each leg's booking is taken in charge before anything can fail: an error below
        // drops (frees) both.
        let decode = self.leg(selection.decode, reservations.decode, bookings_open);
        let prefill = match (selection.prefill, reservations.prefill) {
            (Some(selection), Some(reservation)) => {
                Some(self.leg(selection, reservation, bookings_open))
            }
            _ => None,
        };
        for leg in prefill.iter().chain([&decode]) {
            if leg.endpoint.is_empty() {
                return Err(GatewayError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "worker {} has no endpoint URL to send requests to",
                        leg.booking.worker_id
                    ),
                ));
            }
        }
        Ok(PdBooked {
            prefill,
            decode,
            bypass: selection.bypass,
        })
    }

    fn leg(&self, selection: Selection, reservation: Reservation, open: &Gauge) -> LegBooking {
        LegBooking {
            booking: Booking::new(
                self.service.clone(),
                reservation.reservation_id,
                selection.worker_id,
                selection.block_size,
                open.clone(),
            ),
            endpoint: selection.endpoint,
            bootstrap_port: selection.bootstrap_port,
        }
    }
}
