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
//! - [`api`]: the service's operations, transport-free (HTTP and Python call them).
//! - [`courtesy`]: background threads yield the CPU after each stretch of work.
//! - [`config`]: every knob as a CLI flag and a `KVROUTE_*` environment variable, validated.
//! - [`http`]: routes, JSON request/response types, the one error → response mapping.
//! - [`ingest`]: per-endpoint ZMQ SUB listeners with replay, gap and restart handling.
//! - [`metrics`]: one Prometheus registry per service instance.
//! - [`state`]: the shared state and how events, requests and ticks reach the selector.
//! - [`sync`]: replica sync over NATS (feature `nats`): shared bookings, catalog and KV events.
// Unsafe code is denied everywhere but in `http::json::avx512` (a bench proved its need).
#![deny(unsafe_code)]

pub mod api;
pub mod config;
pub mod courtesy;
pub mod http;
pub mod ingest;
pub mod metrics;
pub mod state;
pub mod sync;

pub use config::ServeConfig;
pub use http::app;
pub use state::AppState;
