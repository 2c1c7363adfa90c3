//! `conversation`: multi-turn chat with the statistics of the Mooncake FAST'25 conversation trace
//! (Kimi traffic), so the suite needs no trace file.
//!
//! - Every prompt opens with one shared 512-token block (the trace's id 0, a system prompt).
//! - A session's first prompt adds its own context: log-normal, median 5,500 tokens.
//! - With probability 0.34 the session has another turn, whose prompt is the previous one cut to
//!   whole 512-token blocks (the trace's hash ids cover 512 tokens; a partial last block is not
//!   shared) plus the answer and the next message, log-normal, median 1,500 tokens.
//! - Output: log-normal, median 250 tokens (mean ~340, at most 2,000), as the trace's.
//! - Sessions start as a Poisson process; turns follow after an exponential think time (20 s).
//!
//! The result, like the trace: prompts of mean ~11k and median ~7k tokens, ~37 % of prompt tokens
//! reusable with one unlimited cache. 1×: 4 requests/s (the trace runs 3.4).

use super::{MAX_REQUESTS, Shape, ShapeRng, in_arrival_order, request};
use crate::SimError;
use crate::workload::SimRequest;

const RATE_RPS: f64 = 4.0;
const CONTINUE_PROBABILITY: f64 = 0.34;
const SHARED_BLOCK_TOKENS: usize = 512;
const THINK_SECS: f64 = 20.0;
const MAX_PROMPT_TOKENS: usize = 120_000;

const SHARED: u64 = 1;
const CONTEXT: u64 = 2;

pub struct Conversation;

impl Shape for Conversation {
    fn name(&self) -> &str {
        "conversation"
    }

    fn description(&self) -> String {
        format!(
            "multi-turn chat like the Mooncake conversation trace: each turn extends the previous \
             prompt (512-token blocks), ~37% token reuse, {RATE_RPS} req/s at 1x"
        )
    }

    fn generate(&self, seed: u64, block_size: u32) -> Result<Vec<SimRequest>, SimError> {
        let mut rng = ShapeRng::new(self.name(), seed);
        let horizon_secs = MAX_REQUESTS as f64 / RATE_RPS;
        // Sessions average 1 / (1 - p) turns.
        let session_rate = RATE_RPS * (1.0 - CONTINUE_PROBABILITY);
        let mut requests = Vec::new();
        let mut start = 0.0;
        let mut segment = 0u64;
        for session in 0u64.. {
            start += rng.exponential(1.0 / session_rate);
            if start > horizon_secs {
                break;
            }
            let mut tokens = Vec::new();
            rng.push_segment(&mut tokens, SHARED, 0, SHARED_BLOCK_TOKENS);
            let mut new_tokens = rng.lognormal(5_500.0, 1.0, 256, 100_000);
            let mut at = start;
            loop {
                segment += 1;
                rng.push_segment(&mut tokens, CONTEXT, segment, new_tokens);
                let output = rng.lognormal(250.0, 0.8, 16, 2_000);
                requests.push(request(at, &tokens, output, Some(session), block_size));
                if rng.uniform() >= CONTINUE_PROBABILITY || tokens.len() > MAX_PROMPT_TOKENS {
                    break;
                }
                tokens.truncate(tokens.len() / SHARED_BLOCK_TOKENS * SHARED_BLOCK_TOKENS);
                new_tokens = rng.lognormal(1_500.0, 1.0, 64, 20_000);
                at += rng.exponential(THINK_SECS);
            }
        }
        Ok(in_arrival_order(requests, MAX_REQUESTS))
    }
}
