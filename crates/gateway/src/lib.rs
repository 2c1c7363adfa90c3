//! # kvroute-gateway
//!
//! `kvroute gateway`: an OpenAI-compatible front (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`) for plain vLLM or SGLang workers, that drives each request's booking itself.
//! It serves beside the selection service's own routes, on the same port and behind the same
//! guard (API key, shutdown, metrics), and selects in process through the service's handle,
//! `kvroute_service::Service`.
//!
//! A request's path: the body is parsed only for `model`, `stream`, the prompt and the token
//! limits ([`openai`]); the prompt is tokenized once ([`tokenize`]) so its block hashes are the
//! ones the engine will publish; the [`policy`]'s worker is booked ([`booking`]); the body goes
//! to it as received over a pooled keep-alive connection ([`upstream`]); its answer comes back
//! frame by frame ([`proxy`]), a stream read only as far as counting tokens ([`sse`]) to call
//! `prefill_complete` at the first and `output_block` every `block_size`.
//!
//! Invariants:
//! - **A booking is never leaked.** It is owned by a [`booking::Booking`], whose drop frees
//!   it: the handler holds it until the engine answers, the response body after, so the end of
//!   the stream, an upstream failure or timeout and the client going away all free it once.
//! - **Nothing is buffered whole**: request bodies within the service's body limit; responses
//!   never (a stream's unfinished line at most, bounded).
//! - **Failures are bounded**: a connection failure books the next-best worker, at most
//!   `--connect-retries` times; a failing worker's [`breaker`] keeps it out, then lets one
//!   probe through; timeouts bound the wait for the answer, the first token and the whole.
//!
//! Modules, each of one concern, none over 400 lines, none using another in a circle (both
//! tested), listed from the bottom up:
//!
//! | module | concern |
//! |---|---|
//! | [`error`] | `GatewayError`: OpenAI's error shape, and a stream's last event |
//! | [`openai`] | the routes' paths and the few request fields the gateway reads |
//! | [`usage`] | an answer's prompt counts (`usage`), streamed or whole |
//! | [`sse`] | counting a stream's tokens without copying its text |
//! | [`breaker`] | one worker's circuit breaker (pure: time is an argument) |
//! | [`metrics`] | `kvroute_gateway_*` |
//! | [`client`] | the pooled hyper client to the workers |
//! | [`tokenize`] | all tokenizing: local (`model`, chat `template`), `remote`, estimates |
//! | [`booking`] | **the only calls into the service** (`kvroute_service::Service`, behind `ServiceLink`), and the `Booking` a request holds |
//! | [`mismatch`] | the engines' `usage` held against the gateway's counts: `tokenizer_mismatch`, `cache_mismatch` |
//! | [`health`] | the breakers, the health checks, and the `HealthHandle` a response holds |
//! | [`workers`] | workers from the flags and the workers file, and its watch |
//! | [`config`] | the flags |
//! | [`policy`] | one file per routing policy: `kv`, `round_robin` |
//! | [`proxy`] | the response body that drives and frees the booking |
//! | [`gateway`] | `Gateway`: the state every request reads; the background tasks |
//! | [`upstream`] | booking, dispatch, retries, the answer's head |
//! | [`pd`] | disaggregated prefill and decode: both legs' bookings and bodies (`--pd-protocol`) |
//! | [`routes`] | the axum routes and handlers |
#![forbid(unsafe_code)]

pub mod booking;
pub mod breaker;
pub mod client;
pub mod config;
pub mod error;
pub mod gateway;
pub mod health;
pub mod metrics;
pub mod mismatch;
pub mod openai;
pub mod pd;
pub mod policy;
pub mod proxy;
pub mod routes;
pub mod sse;
pub mod tokenize;
pub mod upstream;
pub mod usage;
pub mod workers;

#[cfg(test)]
mod tests;

pub use config::{GatewayArgs, GatewayConfig, GatewayPolicy};
pub use gateway::Gateway;
