//! Routing policies (`--gateway-policy`): which worker a request is booked on. One file per
//! policy, each opening with its algorithm:
//!
//! - [`kv`]: the selector's choice, by cached prefix and load (the default);
//! - [`round_robin`]: each model's workers in turn, a baseline.
//!
//! Whatever the policy, the booking itself is the selector's (`crate::booking`), so every
//! request's load is booked, driven and freed alike; and the workers whose breaker refuses,
//! or that refused this request's connection, are left out of it.

pub mod kv;
pub mod round_robin;

use crate::booking::ServiceLink;
use crate::config::GatewayPolicy;
use kv::CacheAware;
use round_robin::RoundRobin;

/// The policy's part of a booking request.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Choice {
    /// `None`: any worker of the model.
    pub allowed_worker_ids: Option<Vec<u64>>,
    pub pinned_worker: Option<u64>,
}

/// The configured policy.
#[derive(Debug)]
pub enum Policy {
    Kv(CacheAware),
    RoundRobin(RoundRobin),
}

impl Policy {
    pub fn new(policy: GatewayPolicy) -> Self {
        match policy {
            GatewayPolicy::Kvroute => Self::Kv(CacheAware),
            GatewayPolicy::RoundRobin => Self::RoundRobin(RoundRobin::default()),
        }
    }

    /// Whether the prompt is tokenized for routing; otherwise only its length is estimated.
    pub fn reads_prompt(&self) -> bool {
        match self {
            Self::Kv(policy) => policy.reads_prompt(),
            Self::RoundRobin(policy) => policy.reads_prompt(),
        }
    }

    /// The workers a booking for `model` may go to, leaving out `refused`, and the one to pin.
    pub fn choose(&self, link: &ServiceLink, model: &str, refused: &[u64]) -> Choice {
        // Listed only when some worker is left out: the usual request reads no catalog here.
        let allowed_worker_ids =
            (!refused.is_empty()).then(|| link.worker_ids(model, false, refused));
        let pinned_worker = match self {
            Self::Kv(policy) => policy.pin(),
            Self::RoundRobin(policy) => policy.pin(&link.worker_ids(model, true, refused)),
        };
        Choice {
            allowed_worker_ids,
            pinned_worker,
        }
    }
}
