//! A request's booking, driven by its response: `prefill_complete` at the first generated
//! token, one `output_block` per `block_size` generated tokens, and the free at the end.
//!
//! Whoever owns the [`Booking`] owns the load it booked: dropping it frees it. The handler owns
//! it until the engine answers, then the response body does, so every way a request can end
//! (the stream's end, an upstream error or timeout, the client going away, which drops the
//! body, a panic) frees the booking exactly once.

use kvroute_service::{AppState, api};
use prometheus_client::metrics::gauge::Gauge;
use std::sync::Arc;

/// A live booking on a worker.
pub struct Booking {
    state: Arc<AppState>,
    pub reservation_id: String,
    pub worker_id: u64,
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
        state: Arc<AppState>,
        reservation_id: String,
        worker_id: u64,
        block_size: u32,
        open: Gauge,
    ) -> Self {
        open.inc();
        Self {
            state,
            reservation_id,
            worker_id,
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
        if let Err(e) = api::prefill_complete(&self.state, &self.reservation_id) {
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
            if let Err(e) = api::output_block(&self.state, &self.reservation_id, None) {
                tracing::debug!(reservation_id = %self.reservation_id, error = %e.message,
                    "output_block refused");
                // The booking is gone (expired or its worker deleted): nothing more to report.
                self.reported_blocks = blocks;
            }
        }
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
        if let Err(e) = api::free_reservation(&self.state, &self.reservation_id) {
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
