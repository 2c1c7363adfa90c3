//! The one mapping from the service's failures to Python exceptions.
//!
//! | HTTP status | Python |
//! |---|---|
//! | 400 | `kvroute.InvalidRequestError` — a `SelectionServiceError` that is also a `ValueError` (Dynamo raises `ValueError` for these) |
//! | 404, 409, 429, 503, 5xx | `kvroute.SelectionServiceError` |
//! | 413, 415, 422 (malformed JSON body) | `ValueError` naming the field, without the HTTP prefix |
//!
//! `str(e)` is the HTTP `error` text for the same failure; `.status_code` is its status and
//! `.kind` a category like Dynamo's (`bad_request`, `not_found`, `conflict`, `overloaded`,
//! `not_ready`, `scheduler`, `internal`). The classes are defined in Python
//! (`kvroute/_errors.py`) so that `InvalidRequestError` can derive from both bases.

use kvroute_service::http::error::ApiError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The prefix of the HTTP 422 text, dropped in Python where there is no JSON body.
const BODY_PREFIX: &str = "Failed to deserialize the JSON body into the target type: ";

/// The text of the 503 raised when pinned or allowed workers are unavailable.
const NO_ENDPOINTS: &str = "no endpoints available to route work";

static SELECTION_SERVICE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVALID_REQUEST_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Dynamo's category for a status and message.
pub fn kind(status: u16, message: &str) -> &'static str {
    match status {
        400 | 413 | 415 | 422 => "bad_request",
        404 => "not_found",
        409 => "conflict",
        429 => "overloaded",
        503 if message == NO_ENDPOINTS => "scheduler",
        503 => "not_ready",
        _ => "internal",
    }
}

/// A `SelectionServiceError` (or `InvalidRequestError` for a 400) with the given status and text.
pub fn service_error(py: Python<'_>, status: u16, message: &str) -> PyErr {
    let cell = if status == 400 {
        &INVALID_REQUEST_ERROR
    } else {
        &SELECTION_SERVICE_ERROR
    };
    let class_name = if status == 400 {
        "InvalidRequestError"
    } else {
        "SelectionServiceError"
    };
    let made = cell
        .import(py, "kvroute._errors", class_name)
        .and_then(|class| class.call1((message, status, kind(status, message))));
    match made {
        Ok(instance) => PyErr::from_value(instance),
        // Only when kvroute/_errors.py is missing from the installation.
        Err(e) => e,
    }
}

/// The Python exception for a failure of an `api::*` call.
pub fn api_error(py: Python<'_>, e: ApiError) -> PyErr {
    let status = e.status.as_u16();
    match status {
        413 | 415 | 422 => PyValueError::new_err(
            e.message
                .strip_prefix(BODY_PREFIX)
                .unwrap_or(&e.message)
                .to_string(),
        ),
        _ => service_error(py, status, &e.message),
    }
}
