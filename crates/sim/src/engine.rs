//! One simulated inference engine: a vLLM-v1-like scheduler over a [`BlockPool`].
//!
//! ## A step
//! 1. **Running requests first**, in admission order: each gets `min(remaining, budget)` new
//!    tokens (a whole prompt chunk, or 1 decode token). When the pool cannot hold the new blocks,
//!    the most recently admitted running request is **preempted** — its blocks are released
//!    (they stay cached, so its re-admission may hit them), it restarts from token 0 and goes to
//!    the front of the waiting queue — until the allocation fits or the request itself was the one
//!    preempted.
//! 2. **Then waiting requests**, first come first served, if nothing was preempted in this step,
//!    while the token budget lasts and fewer than `max_num_seqs` run. A request's prefix hit is
//!    looked up on admission: the longest run of its leading full blocks resident in the pool,
//!    capped so at least one token is computed (as vLLM does). The first admission's hit is the
//!    request's `cached_tokens`. Admission stops at the first request that does not fit.
//! 3. Blocks that the scheduled tokens fill are cached **when scheduled** (so a request admitted
//!    later in the same step already hits them, as in vLLM); their `Stored` events, and the
//!    `Removed` events of the evictions, are published when the step ends.
//! 4. The step lasts [`TimingModel::step_nanos`]: prefill of the uncached tokens scheduled, plus a
//!    decode pass when some request decodes (at the pool's current usage, or over the decoding
//!    sequences and their context under the batch engine model).
//! 5. At the end of the step every request whose tokens are all computed samples one token: the
//!    first one ends its prefill (time to first token); a request that reaches its output length
//!    finishes and releases its blocks.
//!
//! Output tokens are unique per request, so the blocks holding them get hashes of their own
//! (chained after the prompt's) and can only be hit by the same request after a preemption —
//! unless the caller knows the output in advance: a request's `prompt` hashes may run past its
//! `isl_tokens` into the output (the mock OpenAI engine's, which decides its output tokens when
//! the request comes), and the output blocks they cover take those hashes.
//!
//! The engine finds a request by its id in a [`RequestSource`]: the workload's slice in the
//! simulator, a map of the requests in flight in a real-time loop. [`Engine::abort`] drops a
//! request between steps (a client that went away).

use crate::pool::{BlockPool, PoolCounters};
use crate::timing::{DecodeBatch, Nanos, TimingModel};
use crate::workload::SimRequest;
use crate::{RequestId, SimError};
use kvroute_core::event::{KvEvent, StoredBlock};
use kvroute_core::hash::{BASE_SEED, block_hash, chain};
use std::collections::VecDeque;

/// Where the engine looks up a request by its id: each request it runs must stay there until it
/// finishes or is aborted.
pub trait RequestSource {
    fn request(&self, id: RequestId) -> Option<&SimRequest>;
}

/// A workload: ids are indexes.
impl RequestSource for [SimRequest] {
    fn request(&self, id: RequestId) -> Option<&SimRequest> {
        self.get(id as usize)
    }
}

impl RequestSource for Vec<SimRequest> {
    fn request(&self, id: RequestId) -> Option<&SimRequest> {
        self.as_slice().request(id)
    }
}

/// The requests in flight of a real-time loop, by id.
impl<S: std::hash::BuildHasher> RequestSource for hashbrown::HashMap<RequestId, SimRequest, S> {
    fn request(&self, id: RequestId) -> Option<&SimRequest> {
        self.get(&id)
    }
}

/// Engine parameters (vLLM's names where vLLM has them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks of the pool; `None` is unlimited.
    pub kv_blocks: Option<u64>,
    /// Token budget of one step.
    pub max_num_batched_tokens: u64,
    /// Most requests running at once.
    pub max_num_seqs: usize,
    /// Blocks that KV usage is measured against for the decode-time model when the pool is
    /// unlimited.
    pub nominal_kv_blocks: u64,
    pub timing: TimingModel,
}

/// The default pool size: 16,384 blocks of 64 tokens.
pub const DEFAULT_KV_BLOCKS: u64 = 16_384;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 64,
            kv_blocks: Some(DEFAULT_KV_BLOCKS),
            max_num_batched_tokens: 8_192,
            max_num_seqs: 256,
            nominal_kv_blocks: DEFAULT_KV_BLOCKS,
            timing: TimingModel::default(),
        }
    }
}

impl EngineConfig {
    /// Checks every knob, naming it in the message.
    pub fn validate(&self) -> Result<(), SimError> {
        if self.block_size == 0 {
            return Err(SimError::invalid("block-size", "must be greater than 0"));
        }
        if self.kv_blocks == Some(0) {
            return Err(SimError::invalid(
                "kv-blocks",
                "must be greater than 0 (or `unlimited`)",
            ));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(SimError::invalid(
                "max-num-batched-tokens",
                "must be greater than 0",
            ));
        }
        if self.max_num_seqs == 0 {
            return Err(SimError::invalid("max-num-seqs", "must be greater than 0"));
        }
        self.timing.validate()
    }

    /// Blocks a request holds once every token but the last has been computed.
    pub fn blocks_needed(&self, request: &SimRequest) -> u64 {
        let tokens = request.prompt.isl_tokens + request.output_tokens.max(1) - 1;
        tokens.max(1).div_ceil(u64::from(self.block_size))
    }

    /// Whether a request can ever run on an engine of this size (vLLM rejects the others).
    pub fn fits(&self, request: &SimRequest) -> bool {
        self.kv_blocks
            .is_none_or(|c| self.blocks_needed(request) <= c)
    }
}

/// A request inside the engine.
#[derive(Debug, Clone)]
struct Sequence {
    id: RequestId,
    prompt_tokens: u64,
    output_target: u64,
    output_done: u64,
    /// Tokens whose KV is computed (vLLM's `num_computed_tokens`).
    computed: u64,
    /// Sequence hashes of the cached blocks held, root first: the first `computed / block_size`
    /// blocks of the sequence.
    table_cached: Vec<u64>,
    /// Private blocks held after them.
    table_private: u64,
    /// `(local, sequence)` hashes of full blocks past the prompt's full blocks (they hold output
    /// tokens), generated as needed.
    extra_hashes: Vec<(u64, u64)>,
    /// Output blocks reported to the router so far.
    output_blocks_reported: u64,
    admitted_before: bool,
    /// Its prompt's KV was computed elsewhere and arrives with it (a disaggregated decode
    /// leg, [`Engine::submit_transferred`]): admission holds the prompt without computing it.
    transferred: bool,
}

impl Sequence {
    fn total_tokens(&self) -> u64 {
        self.prompt_tokens + self.output_done
    }
}

/// What a finished step reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepReport {
    /// Requests admitted for the first time, with the prompt tokens served from the cache.
    pub first_admissions: Vec<(RequestId, u64)>,
    /// Requests that produced their first output token.
    pub first_tokens: Vec<RequestId>,
    /// Requests that sampled a token at the end of the step (first, decode or last), in
    /// admission order: each one's output grew by exactly one token.
    pub sampled: Vec<RequestId>,
    /// Requests that started a new output block.
    pub output_blocks: Vec<RequestId>,
    /// Requests that produced their last token and left the engine.
    pub finished: Vec<RequestId>,
    /// KV events of the step, in order.
    pub events: Vec<KvEvent>,
    /// Preemptions in this step.
    pub preemptions: u64,
}

/// Counters over the engine's life.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineCounters {
    pub steps: u64,
    pub busy_nanos: Nanos,
    pub preemptions: u64,
    pub pool: PoolCounters,
}

/// One simulated engine. See the module documentation.
#[derive(Debug, Clone)]
pub struct Engine {
    config: EngineConfig,
    pool: BlockPool,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    /// `(running index, tokens)` scheduled in the step in flight.
    scheduled: Vec<(usize, u64)>,
    in_step: bool,
    report: StepReport,
    counters: EngineCounters,
}

/// The local hash of the `index`-th block of request `id` once it holds output tokens: unique
/// to the request, so only the request itself can hit it again.
fn output_block_local_hash(id: RequestId, index: u64) -> u64 {
    let id = u64::from(id);
    let words = [
        id as u32,
        (id >> 32) as u32,
        index as u32,
        (index >> 32) as u32,
        0x6f75_7470, // "outp": keeps these apart from prompt tokens
    ];
    block_hash(&words, BASE_SEED)
}

impl Engine {
    pub fn new(config: EngineConfig) -> Self {
        Self {
            config,
            pool: BlockPool::new(config.kv_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            scheduled: Vec::new(),
            in_step: false,
            report: StepReport::default(),
            counters: EngineCounters::default(),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn counters(&self) -> EngineCounters {
        EngineCounters {
            pool: self.pool.counters(),
            ..self.counters
        }
    }

    /// Whether a step is in flight.
    pub fn in_step(&self) -> bool {
        self.in_step
    }

    /// Whether the engine has requests (waiting or running).
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    /// Queues a request. The caller checks [`EngineConfig::fits`] first.
    pub fn submit(&mut self, id: RequestId, request: &SimRequest) {
        self.waiting.push_back(Sequence {
            id,
            prompt_tokens: request.prompt.isl_tokens,
            output_target: request.output_tokens.max(1),
            output_done: 0,
            computed: 0,
            table_cached: Vec::new(),
            table_private: 0,
            extra_hashes: Vec::new(),
            output_blocks_reported: 0,
            admitted_before: false,
            transferred: false,
        });
    }

    /// Queues the decode leg of a disaggregated request: its prompt's KV was computed on a
    /// prefill engine and copied here. On admission the prompt's blocks are allocated (the
    /// resident prefix shared, as a hit) and cached at no compute cost, then the step computes
    /// its last prompt token as a decode token, which samples the first output token. A
    /// preempted leg loses the copy and recomputes its prompt here, as vLLM would.
    pub fn submit_transferred(&mut self, id: RequestId, request: &SimRequest) {
        self.submit(id, request);
        if let Some(seq) = self.waiting.back_mut() {
            seq.transferred = true;
        }
    }

    /// `(local, sequence)` hash of block `index` of a sequence (which must be full).
    fn block_hashes(seq: &mut Sequence, request: &SimRequest, index: usize) -> (u64, u64) {
        let prompt_blocks = request.prompt.sequence.len();
        if index < prompt_blocks {
            return (request.prompt.local[index], request.prompt.sequence[index]);
        }
        while prompt_blocks + seq.extra_hashes.len() <= index {
            let i = prompt_blocks + seq.extra_hashes.len();
            let local = output_block_local_hash(seq.id, i as u64);
            let previous = match i.checked_sub(1) {
                Some(p) if p < prompt_blocks => Some(request.prompt.sequence[p]),
                Some(_) => seq.extra_hashes.last().map(|&(_, s)| s),
                None => None,
            };
            let sequence = previous.map_or(local, |p| chain(p, local));
            seq.extra_hashes.push((local, sequence));
        }
        seq.extra_hashes[index - prompt_blocks]
    }

    /// Allocates blocks for `tokens` more computed tokens of `seq` and caches the blocks they
    /// fill. Returns `false` (changing nothing) when the pool cannot hold them.
    fn extend(
        pool: &mut BlockPool,
        block_size: u64,
        seq: &mut Sequence,
        request: &SimRequest,
        tokens: u64,
    ) -> bool {
        let held = seq.table_cached.len() as u64 + seq.table_private;
        let needed = (seq.computed + tokens).div_ceil(block_size);
        if !pool.try_allocate(&[], needed.saturating_sub(held)) {
            return false;
        }
        seq.table_private += needed.saturating_sub(held);
        Self::fill_computed(pool, block_size, seq, request, tokens);
        true
    }

    fn preempt(&mut self, mut seq: Sequence) {
        self.pool.release(&seq.table_cached, seq.table_private);
        seq.table_cached.clear();
        seq.table_private = 0;
        seq.computed = 0;
        seq.transferred = false;
        self.counters.preemptions += 1;
        self.report.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Drops request `id` (its client went away): out of the waiting queue, or out of the
    /// running batch with its blocks released as a finished request's are. Between steps only
    /// (an error during one). Returns whether the engine had it.
    pub fn abort(&mut self, id: RequestId) -> Result<bool, SimError> {
        if self.in_step {
            return Err(SimError::Internal(
                "a request cannot be aborted while a step is in flight".into(),
            ));
        }
        let seq = if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i)
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            Some(self.running.remove(i))
        } else {
            None
        };
        let Some(seq) = seq else {
            return Ok(false);
        };
        self.pool.release(&seq.table_cached, seq.table_private);
        Ok(true)
    }

    /// Holds the leading resident blocks of `sequence` (sequence hashes, root first) as a
    /// request would: they count as in use and cannot be evicted until
    /// [`release_held`](Self::release_held). A disaggregated prefill engine keeps a finished
    /// prompt's blocks this way until a decode engine has read them. Returns how many leading
    /// blocks it holds (it stops at the first one not resident). Between steps only.
    pub fn hold_prefix(&mut self, sequence: &[u64]) -> usize {
        if self.in_step {
            return 0;
        }
        let resident = self.pool.cached_prefix_blocks(sequence);
        let held = &sequence[..resident];
        if self.pool.try_allocate(held, 0) {
            resident
        } else {
            0
        }
    }

    /// Releases blocks [`hold_prefix`](Self::hold_prefix) held (exactly the prefix it
    /// returned). They stay cached, free for eviction.
    pub fn release_held(&mut self, held: &[u64]) {
        self.pool.release(held, 0);
    }

    /// Caches the first `blocks` blocks of `request`'s prompt as if computed elsewhere and
    /// copied in (a disaggregated decode engine receiving a prefill's KV): each block not yet
    /// resident is allocated and filled, so it is reported as a `Stored` event at the end of
    /// the next step, then left free, so the request's admission finds it as a prefix hit.
    /// Returns how many leading blocks are resident afterwards (fewer when the pool is full).
    /// Between steps only.
    pub fn import_prefix(&mut self, request: &SimRequest, blocks: usize) -> usize {
        if self.in_step {
            return 0;
        }
        let blocks = blocks.min(request.prompt.sequence.len());
        let mut parent = None;
        for i in 0..blocks {
            let sequence = request.prompt.sequence[i];
            if !self.pool.is_cached(sequence) {
                if !self.pool.try_allocate(&[], 1) {
                    return i;
                }
                let local = request.prompt.local.get(i).copied().unwrap_or(sequence);
                self.pool.fill(
                    parent,
                    StoredBlock {
                        engine_hash: sequence,
                        local_hash: local,
                    },
                );
                self.pool.release(&[sequence], 0);
            }
            parent = Some(sequence);
        }
        blocks
    }

    /// Schedules a step and returns how long it lasts, or `None` when there is nothing to run.
    /// `requests` holds the requests the ids name.
    pub fn start_step<R: RequestSource + ?Sized>(
        &mut self,
        requests: &R,
    ) -> Result<Option<Nanos>, SimError> {
        if self.in_step {
            return Err(SimError::Internal("a step is already in flight".into()));
        }
        let block_size = u64::from(self.config.block_size);
        let mut budget = self.config.max_num_batched_tokens;
        let mut prefill_tokens = 0u64;
        let mut decode = DecodeBatch::default();
        let mut preempted = false;
        self.scheduled.clear();

        // 1. Running requests, in admission order.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let remaining = self.running[i].total_tokens() - self.running[i].computed;
            let tokens = remaining.min(budget);
            if tokens == 0 {
                i += 1;
                continue;
            }
            let request = request_of(requests, self.running[i].id)?;
            let mut scheduled = false;
            loop {
                if Self::extend(
                    &mut self.pool,
                    block_size,
                    &mut self.running[i],
                    request,
                    tokens,
                ) {
                    scheduled = true;
                    break;
                }
                // Preempt the most recently admitted request (possibly this one).
                let Some(victim) = self.running.pop() else {
                    break;
                };
                preempted = true;
                let was_self = self.running.len() == i;
                self.preempt(victim);
                if was_self {
                    break;
                }
            }
            if !scheduled {
                break;
            }
            budget -= tokens;
            let seq = &self.running[i];
            if tokens > 1 || seq.output_done == 0 {
                prefill_tokens += tokens;
            } else {
                decode.sequences += 1;
                decode.context_tokens += seq.total_tokens();
            }
            self.scheduled.push((i, tokens));
            i += 1;
        }

        // 2. Waiting requests, first come first served.
        if !preempted {
            while budget > 0 && self.running.len() < self.config.max_num_seqs {
                let Some(mut seq) = self.waiting.pop_front() else {
                    break;
                };
                let request = request_of(requests, seq.id)?;
                let total = seq.total_tokens();
                // At least one token is computed, so at most (total - 1) tokens can hit.
                let max_hit_blocks = (total.saturating_sub(1) / block_size) as usize;
                let mut hits = Vec::new();
                for b in 0..max_hit_blocks {
                    let (_, sequence) = Self::block_hashes(&mut seq, request, b);
                    if !self.pool.is_cached(sequence) {
                        break;
                    }
                    hits.push(sequence);
                }
                let hit_tokens = hits.len() as u64 * block_size;
                // A transferred prompt is held up to its last token for free; that token is
                // this step's (decode) work.
                let transferred = std::mem::take(&mut seq.transferred);
                let (copied, tokens) = if transferred {
                    (total.saturating_sub(1).saturating_sub(hit_tokens), 1)
                } else {
                    (0, (total - hit_tokens).min(budget))
                };
                let held_after = (hit_tokens + copied + tokens).div_ceil(block_size);
                let new_private = held_after - hits.len() as u64;
                if !self.pool.try_allocate(&hits, new_private) {
                    seq.transferred = transferred;
                    self.waiting.push_front(seq);
                    break;
                }
                if !seq.admitted_before {
                    seq.admitted_before = true;
                    self.report.first_admissions.push((seq.id, hit_tokens));
                }
                seq.table_cached = hits;
                seq.table_private = new_private;
                seq.computed = hit_tokens;
                Self::fill_computed(
                    &mut self.pool,
                    block_size,
                    &mut seq,
                    request,
                    copied + tokens,
                );
                budget -= tokens;
                if !transferred && (tokens > 1 || seq.output_done == 0) {
                    prefill_tokens += tokens;
                } else {
                    decode.sequences += 1;
                    decode.context_tokens += seq.total_tokens();
                }
                self.running.push(seq);
                self.scheduled.push((self.running.len() - 1, tokens));
            }
        }

        if self.scheduled.is_empty() {
            return Ok(None);
        }
        let usage = self.pool.in_use() as f64
            / self
                .config
                .kv_blocks
                .unwrap_or(self.config.nominal_kv_blocks)
                .max(1) as f64;
        let duration = self.config.timing.step_nanos(prefill_tokens, decode, usage);
        self.in_step = true;
        self.counters.steps += 1;
        self.counters.busy_nanos += duration;
        Ok(Some(duration))
    }

    /// Marks `tokens` more tokens of an admitted sequence computed (its blocks are allocated)
    /// and caches the blocks they fill.
    fn fill_computed(
        pool: &mut BlockPool,
        block_size: u64,
        seq: &mut Sequence,
        request: &SimRequest,
        tokens: u64,
    ) {
        seq.computed += tokens;
        let full = (seq.computed / block_size) as usize;
        while seq.table_cached.len() < full {
            let i = seq.table_cached.len();
            let (local, sequence) = Self::block_hashes(seq, request, i);
            pool.fill(
                seq.table_cached.last().copied(),
                StoredBlock {
                    engine_hash: sequence,
                    local_hash: local,
                },
            );
            seq.table_cached.push(sequence);
            seq.table_private = seq.table_private.saturating_sub(1);
        }
    }

    /// Ends the step in flight: samples tokens, finishes requests and returns what happened.
    pub fn finish_step(&mut self) -> StepReport {
        let block_size = u64::from(self.config.block_size);
        let mut report = std::mem::take(&mut self.report);
        if !self.in_step {
            return report;
        }
        self.in_step = false;
        let mut done = Vec::new();
        for &(i, _) in &self.scheduled {
            let Some(seq) = self.running.get_mut(i) else {
                continue;
            };
            if seq.computed < seq.total_tokens() {
                continue; // a prefill chunk that did not reach the end of the prompt
            }
            seq.output_done += 1;
            report.sampled.push(seq.id);
            if seq.output_done == 1 {
                report.first_tokens.push(seq.id);
            }
            let prompt_blocks = seq.prompt_tokens.div_ceil(block_size);
            let blocks_now = seq.total_tokens().div_ceil(block_size);
            if blocks_now > prompt_blocks + seq.output_blocks_reported
                && seq.output_done < seq.output_target
            {
                seq.output_blocks_reported += 1;
                report.output_blocks.push(seq.id);
            }
            if seq.output_done >= seq.output_target {
                done.push(i);
            }
        }
        self.scheduled.clear();
        // Remove finished requests, keeping the admission order of the others.
        done.sort_unstable();
        for &i in done.iter().rev() {
            let seq = self.running.remove(i);
            self.pool.release(&seq.table_cached, seq.table_private);
            report.finished.push(seq.id);
        }
        report.finished.reverse();
        report.events = self.pool.take_events();
        report
    }
}

fn request_of<R: RequestSource + ?Sized>(
    requests: &R,
    id: RequestId,
) -> Result<&SimRequest, SimError> {
    requests
        .request(id)
        .ok_or_else(|| SimError::Internal(format!("unknown request id {id}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::hash::PromptHashes;

    /// A request whose prompt is `tokens` (hashed at block size 4) with `output` tokens to make.
    fn request(tokens: &[u32], output: u64) -> SimRequest {
        SimRequest {
            arrival_nanos: 0,
            session_id: None,
            tenant: None,
            prompt: PromptHashes::from_tokens(tokens, 4, BASE_SEED),
            output_tokens: output,
        }
    }

    fn config(kv_blocks: Option<u64>, budget: u64) -> EngineConfig {
        EngineConfig {
            block_size: 4,
            kv_blocks,
            max_num_batched_tokens: budget,
            max_num_seqs: 256,
            nominal_kv_blocks: 100,
            timing: TimingModel::default(),
        }
    }

    /// Runs steps until the engine is idle; returns every report.
    fn drain(engine: &mut Engine, requests: &[SimRequest]) -> Vec<StepReport> {
        let mut reports = Vec::new();
        while engine.start_step(requests).unwrap().is_some() {
            reports.push(engine.finish_step());
            engine.pool().check_invariants().unwrap();
        }
        assert!(!engine.has_work());
        reports
    }

    fn first_admissions(reports: &[StepReport]) -> Vec<(RequestId, u64)> {
        reports
            .iter()
            .flat_map(|r| r.first_admissions.clone())
            .collect()
    }

    #[test]
    fn a_shared_prefix_hits_and_at_least_one_token_is_computed() {
        let a: Vec<u32> = (0..18).collect(); // 4 full blocks + 2 tokens
        let mut b: Vec<u32> = (0..12).collect(); // shares 3 blocks, then differs
        b.extend([100, 101, 102, 103, 104]);
        let c: Vec<u32> = (0..16).collect(); // exactly a's first 4 blocks: 3 may hit
        let requests = vec![request(&a, 2), request(&b, 2), request(&c, 1)];
        let mut engine = Engine::new(config(Some(64), 1024));
        engine.submit(0, &requests[0]);
        let reports = drain(&mut engine, &requests);
        assert_eq!(reports.len(), 2, "one prefill step, one decode step");
        assert_eq!(reports[0].first_tokens, vec![0]);
        assert_eq!(reports[1].finished, vec![0]);
        engine.submit(1, &requests[1]);
        engine.submit(2, &requests[2]);
        let reports = drain(&mut engine, &requests);
        assert_eq!(first_admissions(&reports), vec![(1, 12), (2, 12)]);
        // Both were admitted in one step and each sampled its first token at its end.
        assert_eq!(reports[0].first_tokens, vec![1, 2]);
        assert_eq!(reports[0].finished, vec![2]);
    }

    #[test]
    fn held_blocks_survive_pressure_and_imported_blocks_are_hits() {
        let a: Vec<u32> = (0..17).collect(); // 4 full blocks + 1 token
        let b: Vec<u32> = (100..117).collect();
        let requests = vec![request(&a, 1), request(&b, 1), request(&a, 3)];
        // Room for one prompt at a time: b's allocation must evict a's blocks unless held.
        let mut engine = Engine::new(config(Some(6), 1024));
        engine.submit(0, &requests[0]);
        drain(&mut engine, &requests);
        let prompt = &requests[0].prompt.sequence[..4];
        assert_eq!(engine.hold_prefix(prompt), 4);
        assert_eq!(engine.pool().in_use(), 4);
        // b needs 5 blocks of the 6 and 4 are held: it waits, and a's blocks stay.
        engine.submit(1, &requests[1]);
        assert_eq!(engine.start_step(&requests).unwrap(), None);
        assert_eq!(engine.pool().cached_prefix_blocks(prompt), 4);
        engine.release_held(prompt);
        assert_eq!(engine.pool().in_use(), 0);
        let reports = drain(&mut engine, &requests);
        assert_eq!(first_admissions(&reports), vec![(1, 0)]);
        assert!(
            engine.pool().cached_prefix_blocks(prompt) < 4,
            "evicted once released"
        );

        // A decode engine receiving a's prompt: the imported blocks are stored events, then hits.
        let mut decode = Engine::new(config(Some(64), 1024));
        assert_eq!(decode.import_prefix(&requests[2], 4), 4);
        assert_eq!(decode.pool().in_use(), 0, "imported blocks are left free");
        decode.submit(2, &requests[2]);
        let reports = drain(&mut decode, &requests);
        assert_eq!(first_admissions(&reports), vec![(2, 16)]);
        let stored: Vec<u64> = reports[0]
            .events
            .iter()
            .flat_map(|e| match e {
                KvEvent::Stored { blocks, .. } => blocks.iter().map(|b| b.engine_hash).collect(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(
            &stored[..4],
            prompt,
            "the received blocks are published first"
        );
    }

    #[test]
    fn blocks_are_cached_when_scheduled_so_the_same_step_already_hits() {
        let a: Vec<u32> = (0..10).collect();
        let requests = vec![request(&a, 1), request(&a, 1)];
        let mut engine = Engine::new(config(None, 1024));
        engine.submit(0, &requests[0]);
        engine.submit(1, &requests[1]);
        let reports = drain(&mut engine, &requests);
        assert_eq!(reports.len(), 1);
        assert_eq!(first_admissions(&reports), vec![(0, 0), (1, 8)]);
        // One Stored event for the two full blocks; the second request shared them.
        assert_eq!(reports[0].events.len(), 1);
        assert_eq!(engine.counters().pool.stored_blocks, 2);
    }

    #[test]
    fn long_prompts_are_chunked_by_the_token_budget() {
        let a: Vec<u32> = (0..25).collect();
        let requests = vec![request(&a, 3)];
        let mut engine = Engine::new(config(None, 10));
        engine.submit(0, &requests[0]);
        let reports = drain(&mut engine, &requests);
        // 25 tokens at 10 per step: 3 prefill steps (10, 10, 5), then 2 decode steps.
        assert_eq!(reports.len(), 5);
        assert!(reports[0].first_tokens.is_empty() && reports[1].first_tokens.is_empty());
        assert_eq!(reports[2].first_tokens, vec![0]);
        assert_eq!(reports[4].finished, vec![0]);
        // Blocks are published as the chunks fill them: 2 full blocks after 10 tokens, 5 after
        // 20, 6 after 25. The decodes compute tokens 26 and 27: block 7 never fills.
        let stored: Vec<usize> = reports
            .iter()
            .map(|r| {
                r.events
                    .iter()
                    .map(|e| match e {
                        KvEvent::Stored { blocks, .. } => blocks.len(),
                        _ => 0,
                    })
                    .sum()
            })
            .collect();
        assert_eq!(stored, vec![2, 3, 1, 0, 0]);
    }

    #[test]
    fn output_blocks_are_reported_when_a_new_block_starts() {
        let a: Vec<u32> = (0..6).collect(); // 2 prompt blocks (one partial)
        let requests = vec![request(&a, 8)];
        let mut engine = Engine::new(config(None, 1024));
        engine.submit(0, &requests[0]);
        let reports = drain(&mut engine, &requests);
        // Tokens 7..=14 are generated; blocks 3 and 4 start at tokens 9 and 13.
        let starts: Vec<usize> = reports
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.output_blocks.is_empty())
            .map(|(i, _)| i)
            .collect();
        assert_eq!(starts, vec![2, 6]);
        assert_eq!(reports.len(), 8);
    }

    #[test]
    fn preemption_evicts_the_newest_request_and_it_recomputes_later() {
        // 6 blocks of 4 tokens; each request needs 2 prompt blocks and grows to 3.
        let requests: Vec<SimRequest> = (0..3)
            .map(|i| request(&((i * 100)..(i * 100 + 8)).collect::<Vec<u32>>(), 6))
            .collect();
        let mut engine = Engine::new(config(Some(6), 1024));
        for (i, r) in requests.iter().enumerate() {
            engine.submit(i as RequestId, r);
        }
        let reports = drain(&mut engine, &requests);
        let preemptions: u64 = reports.iter().map(|r| r.preemptions).sum();
        assert!(
            preemptions >= 1,
            "three growing requests cannot share 6 blocks"
        );
        assert_eq!(engine.counters().preemptions, preemptions);
        let mut finished: Vec<RequestId> =
            reports.iter().flat_map(|r| r.finished.clone()).collect();
        finished.sort_unstable();
        assert_eq!(finished, vec![0, 1, 2], "every request still completes");
        // The first token of each request is reported once, even if it was recomputed.
        let firsts: usize = reports.iter().map(|r| r.first_tokens.len()).sum();
        assert_eq!(firsts, 3);
        // Admission is recorded once per request.
        assert_eq!(first_admissions(&reports).len(), 3);
    }

    #[test]
    fn max_num_seqs_limits_the_batch() {
        let requests: Vec<SimRequest> = (0..3).map(|i| request(&[i, i + 1, i + 2], 2)).collect();
        let mut engine = Engine::new(EngineConfig {
            max_num_seqs: 2,
            ..config(None, 1024)
        });
        for (i, r) in requests.iter().enumerate() {
            engine.submit(i as RequestId, r);
        }
        assert!(engine.start_step(&requests).unwrap().is_some());
        assert_eq!(engine.running_len(), 2);
        assert_eq!(engine.waiting_len(), 1);
        engine.finish_step();
        drain(&mut engine, &requests);
    }

    #[test]
    fn step_time_follows_the_timing_model() {
        let a: Vec<u32> = (0..100).collect();
        let requests = vec![request(&a, 2)];
        let mut engine = Engine::new(config(Some(100), 1024));
        engine.submit(0, &requests[0]);
        let prefill = engine.start_step(&requests).unwrap().unwrap();
        assert_eq!(
            prefill,
            TimingModel::default().step_nanos(100, DecodeBatch::default(), 0.25)
        );
        engine.finish_step();
        let decode = engine.start_step(&requests).unwrap().unwrap();
        assert_eq!(
            decode,
            TimingModel::default().step_nanos(
                0,
                DecodeBatch {
                    sequences: 1,
                    context_tokens: 101
                },
                0.26
            )
        );
        engine.finish_step();
        assert_eq!(engine.counters().busy_nanos, prefill + decode);
    }

    /// Under the batch engine model a decode step costs more with more sequences and with more
    /// context, at the same pool usage.
    #[test]
    fn batch_model_decode_steps_grow_with_sequences_and_context() {
        use crate::timing::{BatchDecode, EngineModel};
        let batch = EngineConfig {
            timing: TimingModel {
                engine_model: EngineModel::Batch(BatchDecode::default()),
                ..TimingModel::default()
            },
            ..config(None, 1 << 20)
        };
        // Prefills everything in one step, then returns the first decode step's duration.
        let decode_step = |prompts: &[Vec<u32>]| {
            let requests: Vec<SimRequest> = prompts.iter().map(|p| request(p, 3)).collect();
            let mut engine = Engine::new(batch);
            for (i, r) in requests.iter().enumerate() {
                engine.submit(i as RequestId, r);
            }
            engine.start_step(&requests).unwrap().unwrap();
            engine.finish_step();
            engine.start_step(&requests).unwrap().unwrap()
        };
        let prompt = |first: u32, len: u32| (first..first + len).collect::<Vec<u32>>();
        let one_short = decode_step(&[prompt(0, 40)]);
        let four_short = decode_step(&[
            prompt(0, 40),
            prompt(1000, 40),
            prompt(2000, 40),
            prompt(3000, 40),
        ]);
        let one_long = decode_step(&[prompt(0, 40_000)]);
        assert!(four_short > one_short, "{four_short} vs {one_short}");
        assert!(one_long > one_short, "{one_long} vs {one_short}");
        let d = BatchDecode::default();
        // One sequence of 41 tokens (its prompt and its first output token).
        let expected = d.base_ms + d.per_sequence_ms + d.per_context_token_ms * 41.0;
        assert_eq!(one_short, (expected * 1e6).round() as u64);
    }

    #[test]
    fn every_sampled_token_is_reported_once() {
        let requests = vec![request(&(0..9).collect::<Vec<u32>>(), 3), request(&[50], 1)];
        let mut engine = Engine::new(config(None, 1024));
        engine.submit(0, &requests[0]);
        engine.submit(1, &requests[1]);
        let reports = drain(&mut engine, &requests);
        let sampled: Vec<Vec<RequestId>> = reports.iter().map(|r| r.sampled.clone()).collect();
        assert_eq!(sampled, vec![vec![0, 1], vec![0], vec![0]]);
    }

    #[test]
    fn a_map_of_requests_in_flight_serves_as_the_source() {
        let mut requests = hashbrown::HashMap::new();
        requests.insert(7, request(&(0..8).collect::<Vec<u32>>(), 2));
        let mut engine = Engine::new(config(None, 1024));
        engine.submit(7, &requests[&7]);
        let mut finished = Vec::new();
        for _ in 0..10 {
            if engine.start_step(&requests).unwrap().is_none() {
                break;
            }
            finished.extend(engine.finish_step().finished);
        }
        assert_eq!(finished, vec![7]);
        // An id the source does not know is an internal error, not a panic.
        engine.submit(8, &requests[&7]);
        assert!(engine.start_step(&requests).is_err());
    }

    #[test]
    fn an_aborted_request_leaves_and_releases_its_blocks() {
        let requests: Vec<SimRequest> = (0..2)
            .map(|i| request(&((i * 100)..(i * 100 + 8)).collect::<Vec<u32>>(), 5))
            .collect();
        let mut engine = Engine::new(config(Some(16), 1024));
        engine.submit(0, &requests[0]);
        engine.submit(1, &requests[1]);
        assert!(engine.start_step(&requests).unwrap().is_some());
        assert!(engine.abort(0).is_err(), "not during a step");
        engine.finish_step();
        assert!(engine.pool().in_use() > 0);
        assert!(engine.abort(0).unwrap());
        assert!(!engine.abort(0).unwrap(), "already gone");
        let reports = drain(&mut engine, &requests);
        let finished: Vec<RequestId> = reports.iter().flat_map(|r| r.finished.clone()).collect();
        assert_eq!(finished, vec![1]);
        assert_eq!(engine.pool().in_use(), 0);
        // Its prompt blocks stay cached, as a finished request's do.
        assert!(engine.pool().is_cached(requests[0].prompt.sequence[0]));
        engine.pool().check_invariants().unwrap();
        // A waiting request can be aborted too.
        engine.submit(0, &requests[0]);
        assert!(engine.abort(0).unwrap());
        assert!(!engine.has_work());
    }

    #[test]
    fn output_blocks_take_the_hashes_given_past_the_prompt() {
        // 6 prompt tokens and 7 output tokens known in advance: 12 tokens are computed (the
        // last one is sampled, never computed), so 3 blocks of 4 fill, 2 of them holding output.
        let all: Vec<u32> = (0..13).collect();
        let mut known = request(&all, 7);
        known.prompt.isl_tokens = 6;
        let requests = vec![known.clone()];
        let mut engine = Engine::new(config(None, 1024));
        engine.submit(0, &requests[0]);
        let reports = drain(&mut engine, &requests);
        let stored: Vec<u64> = reports
            .iter()
            .flat_map(|r| r.events.iter())
            .flat_map(|e| match e {
                KvEvent::Stored { blocks, .. } => blocks.iter().map(|b| b.engine_hash).collect(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(stored, known.prompt.sequence[..3]);
        let sampled: usize = reports.iter().map(|r| r.sampled.len()).sum();
        assert_eq!(sampled, 7);
    }

    #[test]
    fn oversized_requests_do_not_fit() {
        let c = config(Some(3), 1024);
        assert!(c.fits(&request(&(0..12).collect::<Vec<u32>>(), 1)));
        assert!(!c.fits(&request(&(0..12).collect::<Vec<u32>>(), 2)));
        assert!(config(None, 1).fits(&request(&(0..1200).collect::<Vec<u32>>(), 99)));
    }
}
