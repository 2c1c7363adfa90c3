//! The selector's errors. Each variant carries what its client-facing message needs; `Display`
//! renders the exact texts of SPEC §7.4, and [`Error::status`] is the one mapping to an HTTP
//! status that every edge (HTTP, Python) uses.

use crate::event::WorkerId;
use crate::load::LoadError;
use std::fmt;

/// A `(model_name, routing_group)` pair, rendered as `model={m} routing_group={g}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionKey {
    pub model_name: String,
    pub routing_group: String,
}

impl PartitionKey {
    pub fn new(model_name: impl Into<String>, routing_group: impl Into<String>) -> Self {
        Self {
            model_name: model_name.into(),
            routing_group: routing_group.into(),
        }
    }
}

impl fmt::Display for PartitionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "model={} routing_group={}",
            self.model_name, self.routing_group
        )
    }
}

/// Longest id (`selection_id`, `reservation_id`, `model_name`, `routing_group`) accepted.
pub const MAX_ID_BYTES: usize = 1024;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error(
        "include selection_id to replay a cached selection, or worker_id with the prompt for a self-contained booking"
    )]
    MissingSelectionOrWorker,
    #[error("reservation_id or selection_id is required to name the booking")]
    MissingBookingName,
    #[error(
        "no pending selection {selection_id} for {partition} (expired, already used, or never selected); call select again or book with worker_id and the prompt"
    )]
    NoPendingSelection {
        selection_id: String,
        partition: PartitionKey,
    },
    #[error("schedulable worker {worker_id} not found for {partition}")]
    WorkerNotSchedulable {
        worker_id: WorkerId,
        partition: PartitionKey,
    },
    #[error("no schedulable workers for {partition}")]
    NoSchedulableWorkers { partition: PartitionKey },
    #[error(
        "effective_prefill_tokens ({effective_prefill_tokens}) must not exceed isl_tokens ({isl_tokens})"
    )]
    EffectivePrefillExceedsIsl {
        effective_prefill_tokens: u64,
        isl_tokens: u64,
    },
    #[error("Request {reservation_id} already exists (assigned to worker {worker_id})")]
    DuplicateReservation {
        reservation_id: String,
        worker_id: WorkerId,
    },
    #[error("reservation {reservation_id} not found")]
    ReservationNotFound { reservation_id: String },
    #[error("decay_fraction must be between 0.0 and 1.0")]
    BadDecayFraction,
    #[error("worker {worker_id} not found")]
    WorkerNotFound { worker_id: WorkerId },
    #[error("no endpoints available to route work")]
    NoEndpointsAvailable,
    #[error("all eligible workers are overloaded")]
    AllWorkersBusy,
    #[error("selection service is shutting down")]
    ShuttingDown,
    /// `block_hashes is required without token_ids` (select) or `sequence_hashes is required
    /// without token_ids` (reservations).
    #[error("{field} is required without token_ids")]
    MissingPrompt { field: &'static str },
    #[error("token_ids must not be empty")]
    EmptyTokenIds,
    #[error("{field} must be at most 1024 bytes")]
    IdTooLong { field: &'static str },
    #[error(
        "block_hashes length {block_hashes} must match sequence_hashes length {sequence_hashes}"
    )]
    HashLengthMismatch {
        block_hashes: usize,
        sequence_hashes: usize,
    },
    #[error("isl_tokens must be greater than 0")]
    ZeroIsl,
    #[error("session affinity ID must not exceed 256 bytes")]
    SessionIdTooLong,
    #[error("session {session_id} is bound to worker {bound_worker}, not {selected_worker}")]
    SessionBound {
        session_id: String,
        bound_worker: WorkerId,
        selected_worker: WorkerId,
    },
    /// Any other invalid field value, with a message naming it.
    #[error("{message}")]
    InvalidField {
        field: &'static str,
        message: String,
    },
}

impl Error {
    /// The HTTP status of this failure (SPEC §7.4).
    pub fn status(&self) -> u16 {
        match self {
            Error::MissingSelectionOrWorker
            | Error::MissingBookingName
            | Error::EffectivePrefillExceedsIsl { .. }
            | Error::BadDecayFraction
            | Error::MissingPrompt { .. }
            | Error::EmptyTokenIds
            | Error::IdTooLong { .. }
            | Error::HashLengthMismatch { .. }
            | Error::ZeroIsl
            | Error::SessionIdTooLong
            | Error::SessionBound { .. }
            | Error::InvalidField { .. } => 400,
            Error::NoPendingSelection { .. }
            | Error::WorkerNotSchedulable { .. }
            | Error::ReservationNotFound { .. }
            | Error::WorkerNotFound { .. } => 404,
            Error::DuplicateReservation { .. } => 409,
            Error::AllWorkersBusy => 429,
            Error::NoSchedulableWorkers { .. }
            | Error::NoEndpointsAvailable
            | Error::ShuttingDown => 503,
        }
    }

    /// A short category name (as Dynamo's Python exceptions carry in `.kind`).
    pub fn kind(&self) -> &'static str {
        match self.status() {
            400 => "bad_request",
            404 => "not_found",
            409 => "conflict",
            429 => "overloaded",
            _ => match self {
                Error::NoEndpointsAvailable => "scheduler",
                _ => "not_ready",
            },
        }
    }
}

impl From<LoadError> for Error {
    fn from(e: LoadError) -> Self {
        match e {
            LoadError::Duplicate {
                reservation_id,
                worker_id,
            } => Error::DuplicateReservation {
                reservation_id,
                worker_id,
            },
            LoadError::NotFound { reservation_id } => Error::ReservationNotFound { reservation_id },
            LoadError::BadDecayFraction { .. } => Error::BadDecayFraction,
            LoadError::ZeroBlockSize => Error::InvalidField {
                field: "block_size",
                message: "block_size must be greater than 0".to_string(),
            },
        }
    }
}

/// Checks an id's length (SPEC §7.4).
pub fn check_id(field: &'static str, value: &str) -> Result<(), Error> {
    if value.len() > MAX_ID_BYTES {
        Err(Error::IdTooLong { field })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_the_spec_texts_verbatim() {
        let p = PartitionKey::new("m", "g");
        let cases: Vec<(Error, u16, &str)> = vec![
            (
                Error::MissingSelectionOrWorker,
                400,
                "include selection_id to replay a cached selection, or worker_id with the prompt for a self-contained booking",
            ),
            (
                Error::MissingBookingName,
                400,
                "reservation_id or selection_id is required to name the booking",
            ),
            (
                Error::NoPendingSelection {
                    selection_id: "s1".into(),
                    partition: p.clone(),
                },
                404,
                "no pending selection s1 for model=m routing_group=g (expired, already used, or never selected); call select again or book with worker_id and the prompt",
            ),
            (
                Error::WorkerNotSchedulable {
                    worker_id: 7,
                    partition: p.clone(),
                },
                404,
                "schedulable worker 7 not found for model=m routing_group=g",
            ),
            (
                Error::NoSchedulableWorkers {
                    partition: p.clone(),
                },
                503,
                "no schedulable workers for model=m routing_group=g",
            ),
            (
                Error::EffectivePrefillExceedsIsl {
                    effective_prefill_tokens: 20,
                    isl_tokens: 17,
                },
                400,
                "effective_prefill_tokens (20) must not exceed isl_tokens (17)",
            ),
            (
                Error::DuplicateReservation {
                    reservation_id: "r".into(),
                    worker_id: 3,
                },
                409,
                "Request r already exists (assigned to worker 3)",
            ),
            (
                Error::ReservationNotFound {
                    reservation_id: "r".into(),
                },
                404,
                "reservation r not found",
            ),
            (
                Error::BadDecayFraction,
                400,
                "decay_fraction must be between 0.0 and 1.0",
            ),
            (
                Error::WorkerNotFound { worker_id: 9 },
                404,
                "worker 9 not found",
            ),
            (
                Error::NoEndpointsAvailable,
                503,
                "no endpoints available to route work",
            ),
            (
                Error::AllWorkersBusy,
                429,
                "all eligible workers are overloaded",
            ),
            (
                Error::ShuttingDown,
                503,
                "selection service is shutting down",
            ),
            (
                Error::MissingPrompt {
                    field: "block_hashes",
                },
                400,
                "block_hashes is required without token_ids",
            ),
            (
                Error::MissingPrompt {
                    field: "sequence_hashes",
                },
                400,
                "sequence_hashes is required without token_ids",
            ),
            (Error::EmptyTokenIds, 400, "token_ids must not be empty"),
            (
                Error::IdTooLong {
                    field: "selection_id",
                },
                400,
                "selection_id must be at most 1024 bytes",
            ),
            (
                Error::HashLengthMismatch {
                    block_hashes: 2,
                    sequence_hashes: 3,
                },
                400,
                "block_hashes length 2 must match sequence_hashes length 3",
            ),
            (Error::ZeroIsl, 400, "isl_tokens must be greater than 0"),
        ];
        for (error, status, text) in cases {
            assert_eq!(error.to_string(), text);
            assert_eq!(error.status(), status, "{text}");
        }
    }

    #[test]
    fn load_errors_map_to_the_same_texts() {
        let e: Error = LoadError::NotFound {
            reservation_id: "x".into(),
        }
        .into();
        assert_eq!(e.to_string(), "reservation x not found");
        assert_eq!(e.status(), 404);
    }
}
