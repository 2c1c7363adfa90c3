//! # kvroute-service
//!
//! The async edge of kvroute: the HTTP selection service (`kvroute serve`, wire-compatible with
//! Dynamo's runtime-free selection service, SPEC §7), the live KV-event ingest from engines over
//! ZeroMQ (SPEC §3.1), and Prometheus metrics (SPEC §12). It is the only library of the router
//! with tokio, axum and sockets; all routing decisions are made by
//! [`kvroute_core::selector::Selector`], which this crate wraps in one lock
//! ([`state::AppState`]). The fake engine and the HTTP client of the tests and the load
//! generator are in `kvroute-testkit`.
//!
//! - [`admission`]: `/select` and `/select_and_reserve` decided at once or queued until
//!   capacity frees; the queue, the admission task, the decision.
//! - [`api`]: the service's operations, transport-free, with typed results; [`Service`] is the
//!   handle of in-process callers (the gateway, Python).
//! - [`courtesy`]: background threads yield the CPU after each stretch of work.
//! - [`degraded`]: the workers whose routing went blind (no KV events, another block size, a
//!   mismatched tokenizer or cache), each with what to fix.
//! - [`config`]: every knob as a CLI flag and a `KVROUTE_*` environment variable, validated.
//! - [`engine_load`]: engines' own load, polled from their `/metrics` (opt-in).
//! - [`error`]: the one error → response mapping.
//! - [`http`]: routes, the strict JSON extractor, the rendering of results, the OpenAPI document.
//! - [`ingest`]: per-endpoint ZMQ SUB listeners with replay, gap and restart handling.
//! - [`metrics`]: one Prometheus registry per service instance.
//! - [`state`]: the shared state and how events, requests and ticks reach the selector.
//! - [`sync`]: replica sync's knobs, hooks and messages: shared bookings, catalog and KV events.
//! - `sync_tasks`: replica sync's tasks over NATS (feature `nats`), started by `kvroute serve`.
//! - [`types`]: the JSON request and response bodies.
//!
//! The modules depend on each other in one direction only, each on modules listed before it:
//! courtesy, error, types, degraded, metrics, ingest, sync, admission::queue, config, state, engine_load,
//! admission, api, http, sync_tasks (held by the test `tests::modules_depend_in_one_direction`). The admission
//! queue's data sits below the state that holds it; the rest of admission above it.
//!
//! `SPEC §n` in this crate is section n of `docs/SPEC.md`.
// Unsafe code is denied everywhere but in `http::json::avx512` (a bench proved its need).
#![deny(unsafe_code)]

pub mod admission;
pub mod api;
pub mod config;
pub mod courtesy;
pub mod degraded;
pub mod engine_load;
pub mod error;
pub mod http;
pub mod ingest;
pub mod metrics;
pub mod state;
pub mod sync;
#[cfg(feature = "nats")]
pub mod sync_tasks;
pub mod types;

#[cfg(test)]
mod tests;

pub use api::Service;
pub use config::ServeConfig;
pub use http::app;
pub use state::AppState;
