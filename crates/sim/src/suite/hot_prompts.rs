//! `hot_prompts`: a few hot system prompts. Three groups of 300 prompts, each a 4,096-token
//! system prompt shared by its group and a 768-token question of its own, groups interleaved at
//! random, Poisson arrivals. A policy that sends everything to the three workers holding a
//! prompt overloads them while five idle; one that ignores the cache recomputes 4k tokens a
//! request. Output: log-normal, median 180 tokens. 1×: 20 requests/s.

use super::{MAX_REQUESTS, Shape, ShapeRng, grouped_prompts, in_arrival_order};
use crate::SimError;
use crate::workload::SimRequest;

const GROUPS: usize = 3;
const PROMPTS_PER_GROUP: usize = 300;
const SYSTEM_TOKENS: usize = 4_096;
const QUESTION_TOKENS: usize = 768;
const RATE_RPS: f64 = 20.0;

pub struct HotPrompts;

impl Shape for HotPrompts {
    fn name(&self) -> &str {
        "hot_prompts"
    }

    fn description(&self) -> String {
        format!(
            "{GROUPS} hot system prompts of {SYSTEM_TOKENS} tokens, {PROMPTS_PER_GROUP} questions \
             of {QUESTION_TOKENS} tokens each, {RATE_RPS} req/s at 1x"
        )
    }

    fn generate(&self, seed: u64, block_size: u32) -> Result<Vec<SimRequest>, SimError> {
        let mut rng = ShapeRng::new(self.name(), seed);
        let requests = grouped_prompts(
            &mut rng,
            &[SYSTEM_TOKENS; GROUPS],
            PROMPTS_PER_GROUP,
            RATE_RPS,
            |_| QUESTION_TOKENS,
            block_size,
        );
        Ok(in_arrival_order(requests, MAX_REQUESTS))
    }
}
