//! `round_robin`: worker `i mod N` for the i-th request, whatever the prompt or the load.

use super::*;

pub(super) struct RoundRobin {
    pub(super) next: usize,
    pub(super) workers: usize,
}

impl Router for RoundRobin {
    fn route(
        &mut self,
        _id: RequestId,
        _prompt: &PromptHashes,
        _session: Option<u64>,
        _now: Instant,
        _rng: &mut SmallRng,
    ) -> Result<usize, SimError> {
        let w = self.next;
        self.next = (self.next + 1) % self.workers;
        Ok(w)
    }
}
