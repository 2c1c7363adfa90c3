//! The gateway's one door into the selection service: every call into its in-process handle,
//! `kvroute_service::Service` (typed results, nothing read back from JSON), is in this file,
//! behind [`ServiceLink`], and the booking a request holds, [`Booking`].
//!
//! A booking is driven by its response: `prefill_complete` at the first generated token, one
//! `output_block` per `block_size` generated tokens, and the free at the end. Whoever owns the
//! [`Booking`] owns the load it booked: dropping it frees it. The handler owns it until the
//! engine answers, then the response body does, so every way a request can end (the stream's
//! end, an upstream error or timeout, the client going away, which drops the body, a panic)
//! frees the booking exactly once.

use crate::error::GatewayError;
use crate::tokenize::RoutingPrompt;
use axum::extract::Request;
use axum::http::StatusCode;
use bytes::Bytes;
use kvroute_core::selector::{Lifecycle, PdBypass, Reservation, Selection};
use kvroute_service::api::{Booked, DisaggSelected};
use kvroute_service::types::{PinnedBody, SelectBody, WireHash, WorkerBody};
use kvroute_service::{AppState, Service};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::Arc;

/// What a booking asks the selector for.
#[derive(Debug)]
pub struct BookRequest<'a> {
    pub model: &'a str,
    pub prompt: &'a RoutingPrompt,
    pub expected_output_tokens: Option<u64>,
    pub cache_salt: Option<String>,
    /// `None`: any worker of the model.
    pub allowed_worker_ids: Option<Vec<u64>>,
    /// The worker to book, unscored (the policy chose it).
    pub pinned_worker: Option<u64>,
    /// The admission queue's tenant.
    pub tenant: Option<&'a str>,
    /// The request's session, for session affinity.
    pub session: Option<&'a str>,
}

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

/// The select body of a booking request.
fn select_body(request: &BookRequest<'_>) -> SelectBody {
    let mut body = SelectBody {
        model_name: request.model.to_string(),
        expected_output_tokens: request.expected_output_tokens,
        allowed_worker_ids: request.allowed_worker_ids.clone(),
        pinned_worker: request.pinned_worker.map(|worker_id| PinnedBody {
            worker_id,
            dp_rank: None,
        }),
        cache_salt: request.cache_salt.clone(),
        session_id: request.session.map(str::to_string),
        ..SelectBody::default()
    };
    match request.prompt {
        RoutingPrompt::Tokens(ids) => body.token_ids = Some(ids.clone()),
        RoutingPrompt::Estimate { isl_tokens } => {
            body.block_hashes = Some(Vec::<WireHash>::new());
            body.sequence_hashes = Some(Vec::new());
            body.isl_tokens = Some(*isl_tokens);
        }
    }
    body
}

/// The selection service, as the gateway uses it.
#[derive(Clone)]
pub struct ServiceLink {
    service: Service,
}

impl std::fmt::Debug for ServiceLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceLink").finish_non_exhaustive()
    }
}

impl ServiceLink {
    pub fn new(state: Arc<AppState>) -> Self {
        Self {
            service: Service::new(state),
        }
    }

    /// The gateway's metrics, rendered by the service's `GET /metrics` after its own.
    pub fn attach_metrics(&self, registry: Registry) {
        self.service.attach_metrics(registry);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.service.is_shutting_down()
    }

    /// Waits while the applier holds selections back (the service's fairness gate).
    pub async fn applier_passed(&self) {
        self.service.applier_passed().await;
    }

    /// A request's body, within the service's body limit and read timeout
    /// (`--body-read-timeout-ms`).
    pub async fn read_body(&self, request: Request) -> Result<Bytes, GatewayError> {
        kvroute_service::http::json::body_bytes(request, self.service.state())
            .await
            .map_err(GatewayError::from)
    }

    /// The ids of `model`'s workers (only the schedulable ones with `schedulable_only`), but
    /// those of `leaving_out`.
    pub fn worker_ids(&self, model: &str, schedulable_only: bool, leaving_out: &[u64]) -> Vec<u64> {
        self.service
            .workers(Some(model), None)
            .iter()
            .filter(|r| !schedulable_only || r.lifecycle == Lifecycle::Schedulable)
            .map(|r| r.spec.worker_id)
            .filter(|id| !leaving_out.contains(id))
            .collect()
    }

    /// The workers that have an endpoint URL (of `model`, or all), with their ids.
    pub fn endpoints(&self, model: Option<&str>) -> Vec<(u64, String)> {
        self.service
            .workers(model, None)
            .into_iter()
            .filter_map(|r| Some((r.spec.worker_id, r.spec.endpoint?)))
            .collect()
    }

    /// Whether the catalog has workers, none of them for `model`. O(workers): called only when
    /// a booking failed.
    pub fn is_unknown_model(&self, model: &str) -> bool {
        let workers = self.service.workers(None, None);
        !workers.is_empty() && workers.iter().all(|r| r.spec.model_name != model)
    }

    /// The catalog's models, as it lists them (a model of several workers named once per run).
    pub fn model_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .service
            .workers(None, None)
            .into_iter()
            .map(|r| r.spec.model_name)
            .collect();
        names.dedup();
        names
    }

    /// Raises (`Some(message)`) or clears (`None`) a reason the worker's routing is degraded,
    /// in the service's registry (`kvroute_service::degraded`).
    pub fn report_degraded(
        &self,
        worker_id: u64,
        reason: kvroute_service::degraded::Reason,
        message: Option<String>,
    ) {
        self.service.report_degraded(worker_id, reason, message);
    }

    /// Registers (or re-registers) a worker, as `POST /workers` does.
    pub fn upsert_worker(&self, worker: WorkerBody) -> Result<(), String> {
        self.service
            .upsert_worker(worker)
            .map(|_| ())
            .map_err(|e| e.message)
    }

    /// Deletes a worker, as `DELETE /workers/{id}` does.
    pub fn delete_worker(&self, worker_id: u64) -> Result<(), String> {
        self.service
            .delete_worker(worker_id)
            .map(|_| ())
            .map_err(|e| e.message)
    }

    /// Books a worker as `POST /select_and_reserve` does: the booking, and the endpoint URL
    /// of its worker. `bookings_open` counts the live bookings.
    pub async fn book(
        &self,
        request: BookRequest<'_>,
        bookings_open: &Gauge,
    ) -> Result<(Booking, String), GatewayError> {
        let body = select_body(&request);
        // With `--queue-threshold` this may wait in the admission queue; a client that leaves
        // meanwhile drops this future, which takes the request out of the queue.
        let booked = self
            .service
            .select_and_reserve(body, request.tenant)
            .answer()
            .await?;
        let Booked {
            selection,
            reservation,
        } = booked;
        let worker_id = selection.worker_id;
        let mut booking = Booking::new(
            self.service.clone(),
            reservation.reservation_id,
            worker_id,
            selection.block_size,
            bookings_open.clone(),
        );
        booking.routed = Routed {
            prompt_tokens: match request.prompt {
                RoutingPrompt::Tokens(ids) => Some(ids.len() as u64),
                RoutingPrompt::Estimate { .. } => None,
            },
            cached_tokens: selection.overlap.gpu,
            cached_tokens_max: selection.overlap.gpu.max(selection.overlap.longest_matched),
        };
        if selection.endpoint.is_empty() {
            return Err(GatewayError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("worker {worker_id} has no endpoint URL to send requests to"),
            ));
        }
        Ok((booking, selection.endpoint))
    }

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
        let bootstrap_port = self
            .service
            .workers(Some(&selection.partition.model_name), None)
            .into_iter()
            .find(|r| r.spec.worker_id == selection.worker_id)
            .and_then(|r| r.spec.bootstrap_port);
        LegBooking {
            booking: Booking::new(
                self.service.clone(),
                reservation.reservation_id,
                selection.worker_id,
                selection.block_size,
                open.clone(),
            ),
            endpoint: selection.endpoint,
            bootstrap_port,
        }
    }
}

/// What the router knew of a request when it booked it, to hold the engine's answer against
/// (`crate::mismatch`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Routed {
    /// The gateway's token count of the prompt; `None` when it only estimated it.
    pub prompt_tokens: Option<u64>,
    /// The device overlap predicted on the booked rank, in tokens.
    pub cached_tokens: u64,
    /// The longest overlap on any of its tiers, in tokens.
    pub cached_tokens_max: u64,
}

/// A live booking on a worker.
pub struct Booking {
    service: Service,
    pub reservation_id: String,
    pub worker_id: u64,
    /// What the selection predicted (set by [`ServiceLink::book`]).
    pub routed: Routed,
    block_size: u64,
    generated_tokens: u64,
    reported_blocks: u64,
    prefilled: bool,
    freed: bool,
    open: Gauge,
}

impl std::fmt::Debug for Booking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Booking")
            .field("reservation_id", &self.reservation_id)
            .field("worker_id", &self.worker_id)
            .field("generated_tokens", &self.generated_tokens)
            .field("prefilled", &self.prefilled)
            .finish_non_exhaustive()
    }
}

impl Booking {
    /// Takes charge of a booking the selector made; `open` counts the live ones.
    pub fn new(
        service: Service,
        reservation_id: String,
        worker_id: u64,
        block_size: u32,
        open: Gauge,
    ) -> Self {
        open.inc();
        Self {
            service,
            reservation_id,
            worker_id,
            routed: Routed::default(),
            block_size: u64::from(block_size.max(1)),
            generated_tokens: 0,
            reported_blocks: 0,
            prefilled: false,
            freed: false,
            open,
        }
    }

    /// The first token came: the prompt is prefilled (idempotent).
    pub fn prefill_complete(&mut self) {
        if self.prefilled || self.freed {
            return;
        }
        self.prefilled = true;
        if let Err(e) = self.service.prefill_complete(&self.reservation_id) {
            tracing::debug!(reservation_id = %self.reservation_id, error = %e.message,
                "prefill_complete refused");
        }
    }

    /// `tokens` more were generated.
    pub fn generated(&mut self, tokens: u64) {
        self.set_generated(self.generated_tokens.saturating_add(tokens));
    }

    /// The engine says `total` tokens were generated so far (a `usage` chunk): never less than
    /// counted.
    pub fn set_generated(&mut self, total: u64) {
        if total > 0 {
            self.prefill_complete();
        }
        self.generated_tokens = self.generated_tokens.max(total);
        let blocks = self.generated_tokens / self.block_size;
        while self.reported_blocks < blocks && !self.freed {
            self.reported_blocks += 1;
            if let Err(e) = self.service.output_block(&self.reservation_id, None) {
                tracing::debug!(reservation_id = %self.reservation_id, error = %e.message,
                    "output_block refused");
                // The booking is gone (expired or its worker deleted): nothing more to report.
                self.reported_blocks = blocks;
            }
        }
    }

    /// Tokens per block of the booked worker.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    pub fn generated_tokens(&self) -> u64 {
        self.generated_tokens
    }

    pub fn is_prefilled(&self) -> bool {
        self.prefilled
    }

    /// Frees the booking (once).
    pub fn free(&mut self) {
        if self.freed {
            return;
        }
        self.freed = true;
        self.open.dec();
        if let Err(e) = self.service.free_reservation(&self.reservation_id) {
            tracing::debug!(reservation_id = %self.reservation_id, error = %e.message,
                "free refused");
        }
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.free();
    }
}
