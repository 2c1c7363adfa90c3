//! # kvroute-py
//!
//! kvroute's Python binding (`import kvroute`), built with maturin as the abi3 extension module
//! `kvroute._kvroute` under the pure-Python package in `python/kvroute` (which adds the
//! exception classes, the typed stubs and `py.typed`).
//!
//! - [`service::SelectionService`]: the selection service in process, a drop-in for Dynamo's
//!   `SelectionService`. Each method turns its dict into the HTTP body type, calls the same
//!   operation as the HTTP handler through the `kvroute_service::Service` handle, and renders
//!   its typed result ([`render`], the HTTP shapes), so semantics, error statuses and texts are
//!   identical; only the transport differs.
//! - [`index::RadixIndex`] and [`index::block_hashes`]: the core's radix index and hashing.
//! - [`errors`]: the one mapping from failures to Python exceptions.
//!
//! Not unit-tested from Rust (an extension module leaves the interpreter's symbols unresolved);
//! `crates/py/tests` drives it from pytest, scenario for scenario with the HTTP tests.
//!
//! `SPEC §n` in this crate is section n of `docs/SPEC.md`.
#![forbid(unsafe_code)]

mod convert;
mod errors;
mod events;
mod index;
mod render;
mod service;

use pyo3::prelude::*;

/// Whether KV-event listeners start in this build: registers a worker with an event endpoint in a
/// throwaway service whose runtime never runs, and checks that a listener task was started.
#[pyfunction]
fn _probe_live_ingest(py: Python<'_>) -> PyResult<bool> {
    use kvroute_service::http::types::WorkerBody;
    use kvroute_service::{AppState, ServeConfig, Service};
    py.detach(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
        let live = {
            let _context = runtime.enter();
            let state = AppState::new(ServeConfig::defaults())
                .map_err(pyo3::exceptions::PyRuntimeError::new_err)?;
            let worker = WorkerBody {
                worker_id: Some(0),
                endpoint: Some("http://probe".to_string()),
                block_size: Some(16),
                kv_events_endpoint: Some("tcp://127.0.0.1:9".to_string()),
                ..WorkerBody::default()
            };
            let service = Service::new(state);
            let started = service.upsert_worker(worker).is_ok() && service.active_listeners() > 0;
            service.begin_shutdown();
            started
        };
        runtime.shutdown_background();
        Ok(live)
    })
}

#[pymodule]
#[pyo3(name = "_kvroute")]
fn kvroute_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<service::SelectionService>()?;
    m.add_class::<index::RadixIndex>()?;
    m.add_function(wrap_pyfunction!(index::block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(_probe_live_ingest, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
