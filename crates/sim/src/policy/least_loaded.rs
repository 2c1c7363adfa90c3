//! `least_loaded`: the worker with the fewest active tokens, counting each in-flight request's
//! prompt plus the output it produced so far; ties broken at random.

use super::*;

/// Per-request bookkeeping of the load-counting policies.
pub(super) struct InFlight {
    pub(super) worker: usize,
    pub(super) tokens: u64,
}

pub(super) struct LeastLoaded {
    pub(super) active_tokens: Vec<u64>,
    pub(super) requests: HashMap<RequestId, InFlight>,
    pub(super) block_size: u64,
}

impl LeastLoaded {
    pub(super) fn new(workers: usize, block_size: u32) -> Self {
        Self {
            active_tokens: vec![0; workers],
            requests: HashMap::new(),
            block_size: u64::from(block_size),
        }
    }
}

impl Router for LeastLoaded {
    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        _session: Option<u64>,
        _now: Instant,
        rng: &mut SmallRng,
    ) -> Result<usize, SimError> {
        let w = argmin_random(&self.active_tokens, rng);
        self.active_tokens[w] += prompt.isl_tokens;
        self.requests.insert(
            id,
            InFlight {
                worker: w,
                tokens: prompt.isl_tokens,
            },
        );
        Ok(w)
    }

    fn on_output_block(&mut self, id: RequestId, _now: Instant) -> Result<(), SimError> {
        if let Some(r) = self.requests.get_mut(&id) {
            r.tokens += self.block_size;
            self.active_tokens[r.worker] += self.block_size;
        }
        Ok(())
    }

    fn on_finished(&mut self, id: RequestId, _now: Instant) -> Result<(), SimError> {
        if let Some(r) = self.requests.remove(&id) {
            self.active_tokens[r.worker] = self.active_tokens[r.worker].saturating_sub(r.tokens);
        }
        Ok(())
    }
}
