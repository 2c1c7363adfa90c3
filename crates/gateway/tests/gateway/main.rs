//! Integration tests of kvroute-gateway, in one test binary, on real sockets on 127.0.0.1:
//!
//! - [`lifecycle`]: streamed and whole responses drive and free their bookings; every way a
//!   response ends (the end, the client leaving, the engine dying, a timeout) frees it.
//! - [`failures`]: retries to the next worker, circuit breakers, 503 and 429 answers.
//! - [`front`]: chat templates, remote tokenization, the workers file, API keys, `/v1/models`.
//! - [`degraded`]: routing gone blind (tokens, blocks, silent events) reported and cleared.
//! - [`engine`]: the whole path against the mock OpenAI engine, its KV events included.
//! - [`pd`]: disaggregated prefill and decode, both protocols, against mock P/D engines and
//!   recording upstreams.
//! - [`common`]: the gateway in process, a small vLLM-shaped upstream, the client.

// Test helpers outside #[test] functions may unwrap: a failure there is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod degraded;
mod engine;
mod failures;
mod front;
mod lifecycle;
mod pd;
