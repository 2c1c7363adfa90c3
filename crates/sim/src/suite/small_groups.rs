//! `small_groups`: many small groups. 96 groups of 8 prompts; a group shares a system prompt
//! (log-normal, median 2,048 tokens, 512–8,192), each prompt adds a question (log-normal, median
//! 256 tokens); groups interleaved at random, Poisson arrivals. Reuse is plentiful but spread
//! thin: no worker can hold a privileged few. Output: log-normal, median 180 tokens. 1×: 16
//! requests/s.

use super::{MAX_REQUESTS, Shape, ShapeRng, grouped_prompts, in_arrival_order};
use crate::SimError;
use crate::workload::SimRequest;

const GROUPS: usize = 96;
const PROMPTS_PER_GROUP: usize = 8;
const RATE_RPS: f64 = 16.0;

pub struct SmallGroups;

impl Shape for SmallGroups {
    fn name(&self) -> &str {
        "small_groups"
    }

    fn description(&self) -> String {
        format!(
            "{GROUPS} groups of {PROMPTS_PER_GROUP} prompts sharing a ~2k-token system prompt, \
             {RATE_RPS} req/s at 1x"
        )
    }

    fn generate(&self, seed: u64, block_size: u32) -> Result<Vec<SimRequest>, SimError> {
        let mut rng = ShapeRng::new(self.name(), seed);
        let system_tokens: Vec<usize> = (0..GROUPS)
            .map(|_| rng.lognormal(2_048.0, 0.5, 512, 8_192))
            .collect();
        let requests = grouped_prompts(
            &mut rng,
            &system_tokens,
            PROMPTS_PER_GROUP,
            RATE_RPS,
            |rng| rng.lognormal(256.0, 0.8, 32, 4_096),
            block_size,
        );
        Ok(in_arrival_order(requests, MAX_REQUESTS))
    }
}
