//! `agentic`: the agentic workload of [`crate::workload::agentic`] (tenants' system prompts,
//! multi-turn tool-using sessions whose context grows every turn, fan-out bursts, one-shot
//! requests) with its defaults but fewer sessions, so a run stays bounded. 1×: one session
//! starts per second, the generator's default.

use super::{MAX_REQUESTS, Shape};
use crate::SimError;
use crate::workload::{AgenticSpec, ArrivalOptions, SimRequest, agentic_workload};

const SESSIONS: usize = 100;

pub struct Agentic;

impl Shape for Agentic {
    fn name(&self) -> &str {
        "agentic"
    }

    fn description(&self) -> String {
        format!(
            "the agentic generator ({SESSIONS} tool-using sessions with growing context, fan-out \
             bursts, one-shot requests), 1 session/s at 1x"
        )
    }

    fn generate(&self, seed: u64, block_size: u32) -> Result<Vec<SimRequest>, SimError> {
        let spec = AgenticSpec {
            sessions: SESSIONS,
            seed,
            ..AgenticSpec::default()
        };
        let arrival = ArrivalOptions {
            max_requests: Some(MAX_REQUESTS),
            ..ArrivalOptions::default()
        };
        Ok(agentic_workload(&spec, block_size, &arrival)?.requests)
    }
}
