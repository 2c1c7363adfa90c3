//! # kvroute-sim
//!
//! A deterministic discrete-event simulator of an LLM inference fleet, to compare routing policies
//! on real traces before touching a GPU. It drives the same [`kvroute_core::selector::Selector`]
//! API the HTTP service uses, with a virtual clock and simulated engines.
//!
//! - [`engine`]: one vLLM-like engine per worker: a KV [`pool`] with prefix caching and LRU
//!   eviction (tail → root), a waiting/running scheduler with a per-step token budget, chunked
//!   prefill and preemption, and a [`timing`] model for step durations. Engines publish `Stored` /
//!   `Removed` KV events into the router's index and drive its lifecycle calls.
//! - [`workload`]: Mooncake JSONL traces (hash ids expanded into deterministic tokens) and
//!   synthetic shared-prefix groups, and an agentic workload (multi-turn sessions, fan-out
//!   bursts, one-shot requests; [`workload::agentic`]).
//! - [`policy`]: round robin, random, least loaded, SGLang-style cache-aware, and the selector with
//!   Dynamo's defaults (`dynamo`) or kvroute's own (`kvroute`).
//! - [`replicas`]: several routers of one policy that hear of each other's bookings late
//!   (`--router-replicas`).
//! - [`index_bench`]: the schedule of `kvroute bench index`: a trace's KV events and lookups
//!   from a fleet of engines on one timeline, for replay against the index.
//! - [`sim`]: the event loop ([`sim::run_policy`]).
//! - [`pd`]: disaggregated prefill/decode fleets (prefill pool, KV transfer, decode pool), their
//!   routers, and the comparison of aggregated and P/D fleets (`kvroute sim --pd`, `--suite-pd`).
//! - [`suite`]: the workload suite (`kvroute sim --suite`): every policy on several traffic
//!   shapes, loads, replica counts and both engine models, and how far each is from the best.
//! - [`report`]: per-policy hit rate, decision quality, TTFT, latency, throughput, imbalance,
//!   preemptions; JSON, a text table and an SVG chart.
//! - [`timing`]: step durations, under the fitted vLLM model or the batch model whose decode
//!   step grows with the sequences and their context (`--engine-model`).
//!
//! ## Invariants
//! - **Pure and deterministic**: no async runtime, no clock reads, no global randomness. Time is
//!   virtual nanoseconds mapped onto a caller-given origin `Instant`; randomness comes from one
//!   seeded `SmallRng` per run. The same inputs and seed give the same report, byte for byte.
//! - Hash maps are only looked up, never iterated where the order could change a result.
//!
//! ## Cost
//! A run is O(steps × running requests + blocks stored and evicted × log). The full Mooncake
//! conversation trace (12,031 requests, ~145 M prompt tokens) on 8 workers takes seconds per
//! policy in a release build.
//!
//! `SPEC §n` in this crate is section n of `docs/SPEC.md`.
#![forbid(unsafe_code)]

pub mod engine;
mod error;
pub mod index_bench;
pub mod pd;
pub mod policy;
pub mod pool;
pub mod replicas;
pub mod report;
pub mod sim;
pub mod suite;
pub mod timing;
pub mod workload;

pub use engine::{Engine, EngineConfig};
pub use error::SimError;
pub use policy::{Policy, catalog, resolve};
pub use report::{Report, UnavailablePolicy, build_report, render_svg};
pub use sim::{PolicyRun, SimConfig, run_policy};
pub use timing::{BatchDecode, DecodeBatch, EngineModel, TimingModel};
pub use workload::{AgenticSpec, ArrivalOptions, SimRequest, SyntheticSpec, Workload};

/// Index of a request in its workload.
pub type RequestId = u32;
