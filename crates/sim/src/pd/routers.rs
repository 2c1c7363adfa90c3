//! Routers of P/D fleets: each request gets a prefill engine (or a bypass) and a decode engine.
//!
//! | name | fleet | what it does |
//! |---|---|---|
//! | any aggregated policy ([`Whole`]) | aggregated | the policy of [`crate::policy`] over every engine; every request runs whole |
//! | `pd-round-robin` ([`Pair`]) | P/D | round robin over the prefill pool, round robin over the decode pool; never bypasses |
//! | `pd-cache-aware` ([`Pair`]) | P/D | `cache_aware`'s logic (SGLang's approximate trees) over the prefill pool, `least_loaded` (active tokens) over the decode pool; never bypasses |
//!
//! Engines are numbered prefill pool first, then decode pool ([`PdRouter::on_kv_events`]);
//! [`PdRoute`] names them by their index within their pool.

use crate::engine::EngineConfig;
use crate::policy::{Policy, Router, build_router};
use crate::{RequestId, SimError};
use kvroute_core::event::KvEvent;
use kvroute_core::hash::PromptHashes;
use rand::rngs::SmallRng;
use std::time::Instant;

/// Why a request runs whole on a decode engine instead of in two legs (the core's reasons).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PdBypassReason {
    /// The part of the prompt no prefill engine holds is small: not worth a transfer.
    SmallUncached,
    /// Every prefill engine is busy past the admission thresholds.
    PrefillSaturated,
    /// The fleet has no prefill engine.
    NoPrefillWorkers,
}

impl PdBypassReason {
    pub fn name(self) -> &'static str {
        match self {
            Self::SmallUncached => "small_uncached",
            Self::PrefillSaturated => "prefill_saturated",
            Self::NoPrefillWorkers => "no_prefill_workers",
        }
    }
}

/// Where a request goes: its prefill engine (`None`: it runs whole on the decode engine) and its
/// decode engine, each an index within its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PdRoute {
    pub prefill: Option<usize>,
    pub decode: usize,
    /// Why there is no prefill leg, when the router bypassed one (`None` in an aggregated fleet).
    pub bypass: Option<PdBypassReason>,
}

/// A router of a P/D fleet as [`super::run_pd`] drives it.
pub trait PdRouter {
    fn name(&self) -> &str;
    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        session: Option<u64>,
        now: Instant,
        rng: &mut SmallRng,
    ) -> Result<PdRoute, SimError>;
    /// KV events of engine `engine` (prefill pool first, then decode pool) reached the router.
    fn on_kv_events(&mut self, engine: usize, events: &[KvEvent]);
    /// The request's prefill leg sampled its token (never called for a bypass).
    fn on_prefill_done(&mut self, id: RequestId, now: Instant) -> Result<(), SimError>;
    /// The decode engine produced the request's first token.
    fn on_first_token(&mut self, id: RequestId, now: Instant) -> Result<(), SimError>;
    /// The decode engine started a new output block of the request.
    fn on_output_block(&mut self, id: RequestId, now: Instant) -> Result<(), SimError>;
    /// The request's last token.
    fn on_finished(&mut self, id: RequestId, now: Instant) -> Result<(), SimError>;
    /// Bookings still held (0 for routers that book nothing).
    fn bookings_left(&self) -> usize {
        0
    }
}

/// An aggregated policy over every engine of an aggregated fleet.
pub struct Whole {
    name: String,
    router: Box<dyn Router>,
}

impl Whole {
    pub fn new(policy: &Policy, engines: usize, engine: &EngineConfig) -> Result<Self, SimError> {
        Ok(Self {
            name: policy.name.to_string(),
            router: build_router(policy, engines, engine)?,
        })
    }
}

impl PdRouter for Whole {
    fn name(&self) -> &str {
        &self.name
    }

    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        session: Option<u64>,
        now: Instant,
        rng: &mut SmallRng,
    ) -> Result<PdRoute, SimError> {
        let decode = self.router.route(id, prompt, session, now, rng)?;
        Ok(PdRoute {
            prefill: None,
            decode,
            bypass: None,
        })
    }

    fn on_kv_events(&mut self, engine: usize, events: &[KvEvent]) {
        self.router.on_kv_events(engine, events);
    }

    fn on_prefill_done(&mut self, _id: RequestId, _now: Instant) -> Result<(), SimError> {
        Ok(())
    }

    fn on_first_token(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.router.on_first_token(id, now)
    }

    fn on_output_block(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.router.on_output_block(id, now)
    }

    fn on_finished(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.router.on_finished(id, now)
    }
}

/// Two independent aggregated policies, one per pool: the prefill pool's router sees a request
/// from its arrival to its prefill leg's end (as a one-token request), the decode pool's from
/// its arrival to its last token.
pub struct Pair {
    name: &'static str,
    prefill_engines: usize,
    prefill: Box<dyn Router>,
    decode: Box<dyn Router>,
}

impl Pair {
    pub fn new(
        name: &'static str,
        prefill: (&Policy, usize, &EngineConfig),
        decode: (&Policy, usize, &EngineConfig),
    ) -> Result<Self, SimError> {
        Ok(Self {
            name,
            prefill_engines: prefill.1,
            prefill: build_router(prefill.0, prefill.1, prefill.2)?,
            decode: build_router(decode.0, decode.1, decode.2)?,
        })
    }
}

impl PdRouter for Pair {
    fn name(&self) -> &str {
        self.name
    }

    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        session: Option<u64>,
        now: Instant,
        rng: &mut SmallRng,
    ) -> Result<PdRoute, SimError> {
        let prefill = self.prefill.route(id, prompt, session, now, rng)?;
        let decode = self.decode.route(id, prompt, session, now, rng)?;
        Ok(PdRoute {
            prefill: Some(prefill),
            decode,
            bypass: None,
        })
    }

    fn on_kv_events(&mut self, engine: usize, events: &[KvEvent]) {
        match engine.checked_sub(self.prefill_engines) {
            None => self.prefill.on_kv_events(engine, events),
            Some(d) => self.decode.on_kv_events(d, events),
        }
    }

    fn on_prefill_done(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.prefill.on_first_token(id, now)?;
        self.prefill.on_finished(id, now)
    }

    fn on_first_token(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.decode.on_first_token(id, now)
    }

    fn on_output_block(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.decode.on_output_block(id, now)
    }

    fn on_finished(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.decode.on_finished(id, now)
    }
}
