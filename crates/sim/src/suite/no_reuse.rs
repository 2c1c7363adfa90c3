//! `no_reuse`: traffic with no reuse at all. Every prompt is unique (log-normal, median 1,500
//! tokens, 64–16,384); output log-normal, median 200 tokens. Nothing can hit, so any cache credit
//! a policy gives is noise and only balance counts. 1×: 12 requests/s.

use super::{MAX_REQUESTS, Shape, ShapeRng, in_arrival_order, request};
use crate::SimError;
use crate::workload::SimRequest;

const REQUESTS: usize = 800;
const RATE_RPS: f64 = 12.0;

const PROMPT: u64 = 1;

pub struct NoReuse;

impl Shape for NoReuse {
    fn name(&self) -> &str {
        "no_reuse"
    }

    fn description(&self) -> String {
        format!("unique prompts of ~1.5k tokens, no shared prefix, {RATE_RPS} req/s at 1x")
    }

    fn generate(&self, seed: u64, block_size: u32) -> Result<Vec<SimRequest>, SimError> {
        let mut rng = ShapeRng::new(self.name(), seed);
        let mut at = 0.0;
        let mut requests = Vec::with_capacity(REQUESTS);
        for i in 0..REQUESTS {
            if i > 0 {
                at += rng.exponential(1.0 / RATE_RPS);
            }
            let mut tokens = Vec::new();
            let len = rng.lognormal(1_500.0, 0.9, 64, 16_384);
            rng.push_segment(&mut tokens, PROMPT, i as u64, len);
            let output = rng.lognormal(200.0, 0.9, 8, 2_048);
            requests.push(request(at, &tokens, output, None, block_size));
        }
        Ok(in_arrival_order(requests, MAX_REQUESTS))
    }
}
