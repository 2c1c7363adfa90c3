//! # kvroute-core
//!
//! The pure, synchronous heart of kvroute, the KV-cache-aware worker selector. Everything here is
//! plain data and state machines: no sockets, no async runtime, no clocks, no global randomness
//! and no logging. Time (`now`) and randomness (`rng`) are arguments; outcomes are returned values
//! that the edges (HTTP service, Python binding, simulator) turn into responses, metrics and logs.
//!
//! Modules:
//! - [`admission`]: the router-side queue of selections waiting for capacity.
//! - [`hash`]: Dynamo-compatible local and sequence block hashes (SPEC §2).
//! - [`event`]: the internal KV event model (stored / removed / cleared, tiers, ranks).
//! - [`index`]: the radix index of which rank holds which prompt prefix, and `find_matches`.
//! - [`load`]: per-rank active load: bookings, prefill tokens, decode blocks, expiry (SPEC §5).
//! - [`pending`]: the pending-selection cache (SPEC §8).
//! - [`approx`]: approximate cache models (TTL, capacity-bounded LRU) for ranks without KV events
//!   (SPEC §9); they return the KV events the caller applies to the index.
//! - [`schedule`]: the cost function and the pick (SPEC §6).
//! - [`selector`]: the select / reserve / lifecycle state machine over a catalog of partitions —
//!   the one API the HTTP service, the Python binding and the simulator call.
//! - [`error`]: the selector's errors, with the exact client-facing texts of SPEC §7.4.
//!
//! The modules depend on each other in one direction only, each on modules listed before it:
//! event, hash, index, load, pending, approx, schedule, error, admission, selector (held by the
//! test `tests::modules_depend_in_one_direction`).
//!
//! `SPEC §n` in this crate is section n of `docs/SPEC.md`.
#![forbid(unsafe_code)]
// The clock and the thread-local generators are disallowed here (clippy.toml: time and
// randomness are arguments); tests may read the clock and make generators.
#![cfg_attr(test, allow(clippy::disallowed_methods))]

pub mod admission;
pub mod approx;
pub mod error;
pub mod event;
pub mod hash;
pub mod index;
pub mod load;
pub mod pending;
pub mod schedule;
pub mod selector;
pub mod speed;

#[cfg(test)]
mod tests;
