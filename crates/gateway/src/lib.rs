//! # kvroute-gateway
//!
//! `kvroute gateway`: an OpenAI-compatible front (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`) for plain vLLM or SGLang workers, that drives each request's booking itself.
//! It serves beside the selection service's own routes, on the same port and behind the same
//! guard (API key, shutdown, metrics), and selects in process through `kvroute_service::api`.
//!
//! A request's path: the body is parsed only for `model`, `stream`, the prompt and the token
//! limits ([`openai`]); the prompt is tokenized once ([`tokenize`], chat templates in
//! [`template`]) so its block hashes are the ones the engine will publish; the best worker is
//! booked; the body goes to it as received over a pooled keep-alive connection; its answer
//! comes back frame by frame ([`proxy`]), a stream read only as far as counting tokens
//! ([`sse`]) to call `prefill_complete` at the first and `output_block` every `block_size`.
//!
//! Invariants:
//! - **A booking is never leaked.** It is owned by a [`lifecycle::Booking`], whose drop frees
//!   it: the handler holds it until the engine answers, the response body after, so the end of
//!   the stream, an upstream failure or timeout and the client going away all free it once.
//! - **Nothing is buffered whole**: request bodies within the service's body limit; responses
//!   never (a stream's unfinished line at most, bounded).
//! - **Failures are bounded**: a connection failure books the next-best worker, at most
//!   `--connect-retries` times; a failing worker's [`breaker`] keeps it out, then lets one
//!   probe through; timeouts bound the wait for the answer, the first token and the whole.
//!
//! Modules: [`config`] (flags), [`workers`] (flags and the workers file into the catalog),
//! [`gateway`] (state, routes, dispatch, background checks), [`metrics`].
#![forbid(unsafe_code)]

pub mod breaker;
pub mod config;
pub mod gateway;
pub mod lifecycle;
pub mod metrics;
pub mod openai;
pub mod proxy;
pub mod sse;
pub mod template;
pub mod tokenize;
pub mod workers;

pub use config::{GatewayArgs, GatewayConfig, GatewayPolicy};
pub use gateway::Gateway;
