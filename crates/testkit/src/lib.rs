//! # kvroute-testkit
//!
//! Stand-ins for what surrounds a kvroute deployment, for the tests, the demos and the load
//! generator: engines that publish KV events, a client that sends requests. None of it is part of
//! the router; it lives here so that `kvroute-service` ships only the service, and so that the
//! service's tests, the `kvroute` binary's `fake-engine` and `loadgen` commands and their tests
//! all drive the service with the same doubles.
//!
//! - [`fake_engine`]: a vLLM-like KV-event publisher over real ZeroMQ (PUB and replay ROUTER
//!   sockets), with faults to inject, and the JSONL scripts of `kvroute fake-engine`.
//! - [`fleet`]: one fake engine per worker, each with a bounded KV pool that stores and evicts
//!   like a real one (`kvroute loadgen --events-base-port`).
//! - [`openai_engine`]: a mock OpenAI-compatible engine (vLLM's routes) running the simulator's
//!   engine model in real time and publishing its KV events (`kvroute fake-engine --openai`).
//! - [`client`]: a minimal keep-alive HTTP/1.1 client (the load generator, real-socket tests).
//! - [`logs`]: the process's log lines captured, for tests that check a warning was written.
//! - [`trace`]: prompts expanded from a Mooncake trace's hash ids (`kvroute loadgen --trace`).
//!
//! The dependencies go one way: this crate uses `kvroute-service` (its CPU courtesy for
//! background threads), `kvroute-wire` and `kvroute-core`; the service depends on it only for
//! its tests.
//!
//! `SPEC §n` in this crate is section n of `docs/SPEC.md`.

pub mod client;
pub mod fake_engine;
pub mod fleet;
pub mod logs;
pub mod openai_engine;
pub mod trace;
