//! `small_groups`: many small groups. 96 groups of 8 prompts; a group shares a system prompt
//! (log-normal, median 2,048 tokens, 512–8,192), each prompt adds a question (log-normal, median
//! 256 tokens); groups interleaved at random, Poisson arrivals. Reuse is plentiful but spread
//! thin: no worker can hold a privileged few. Output: log-normal, median 180 tokens. 1×: 16
//! requests/s.

use super::{MAX_REQUESTS, Shape, ShapeRng, in_arrival_order, request};
use crate::SimError;
use crate::workload::SimRequest;

const GROUPS: usize = 96;
const PROMPTS_PER_GROUP: usize = 8;
const RATE_RPS: f64 = 16.0;

const SYSTEM: u64 = 1;
const QUESTION: u64 = 2;

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
        let mut order: Vec<usize> = (0..GROUPS)
            .flat_map(|g| std::iter::repeat_n(g, PROMPTS_PER_GROUP))
            .collect();
        rng.shuffle(&mut order);
        let mut at = 0.0;
        let mut requests = Vec::with_capacity(order.len());
        for (i, &group) in order.iter().enumerate() {
            if i > 0 {
                at += rng.exponential(1.0 / RATE_RPS);
            }
            let mut tokens = Vec::new();
            rng.push_segment(&mut tokens, SYSTEM, group as u64, system_tokens[group]);
            let question = rng.lognormal(256.0, 0.8, 32, 4_096);
            rng.push_segment(&mut tokens, QUESTION, i as u64, question);
            let output = rng.lognormal(180.0, 0.9, 8, 2_048);
            requests.push(request(at, &tokens, output, None, block_size));
        }
        Ok(in_arrival_order(requests, MAX_REQUESTS))
    }
}
