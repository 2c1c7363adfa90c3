//! `random`: a uniformly drawn worker (seeded by the run's random source).

use super::*;

pub(super) struct RandomRouter {
    pub(super) workers: usize,
}

impl Router for RandomRouter {
    fn route(
        &mut self,
        _id: RequestId,
        _prompt: &PromptHashes,
        _session: Option<u64>,
        _now: Instant,
        rng: &mut SmallRng,
    ) -> Result<usize, SimError> {
        Ok(rng.random_range(0..self.workers))
    }
}
