//! Integration tests of kvroute-service, in one test binary (one link instead of one per file):
//!
//! - [`connections`]: slow and idle clients: the connection limits and timeouts.
//! - [`dashboard`]: the status page in headless Chromium against a live service.
//! - [`degraded`]: routing gone blind (silent KV events, another block size) reported and cleared.
//! - [`dynamo_compat`]: the exchanges recorded from Dynamo's selection service, replayed.
//! - [`dynamo_queue`]: Dynamo's admission queue recorded (`queue.json`), replayed with its sends.
//! - [`engine_load`]: engines' `/metrics` polled: heavy load, garbage, silence, staleness.
//! - [`http`]: the HTTP service end to end, every error row, limits, shutdown, a real socket.
//! - [`ingest`]: live KV events from fake engines over real ZeroMQ sockets.
//! - [`queue`]: the admission queue: waiting, order, tenants, timeouts, bounds, disconnects.
//! - [`replicas`]: replicas sharing state through a real `nats-server`.
//! - [`sessions`]: session affinity over HTTP: soft mode, explicit bookings, its metrics.
//! - [`common`]: the in-process app, the raw client and the `nats-server` they share.
//!
//! Fixtures are read from `tests/fixtures` under the crate's directory.

// Test helpers outside #[test] functions may unwrap: a failure there is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod connections;
mod dashboard;
mod degraded;
mod disagg;
mod dynamo_compat;
mod dynamo_queue;
mod engine_load;
mod http;
mod ingest;
mod queue;
mod replicas;
mod sessions;
