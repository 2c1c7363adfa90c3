//! The load generator's fleet of fake engines (`kvroute loadgen --events-base-port`): one
//! [`FakeEngine`] per worker, each with a KV pool of bounded size that it fills and evicts
//! first-in first-out, publishing exactly the `BlockStored` / `BlockRemoved` events such a pool
//! would (only the blocks it lacks, under the right parent), so the service's index fills as it
//! does in production.
//!
//! Prompts are routed to an engine ([`EngineSlot::route`]) and published in the background by
//! its flusher ([`EngineSlot::flush_forever`]), which takes all routed prompts at once and
//! publishes them as one batch, like one scheduler step of a real engine.

use crate::fake_engine::{
    FakeEngine, FakeEngineError, StoredBlocks, removed_event, stored_event_packed,
    stored_event_with_hashes,
};
use hashbrown::HashMap;
use hashbrown::hash_map::Entry;
use kvroute_service::courtesy;
use kvroute_wire::{Encoding, PackedRun, PackedTokens, RawEvent};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, Notify, OwnedSemaphorePermit};

/// The fleet: engine `i` serves worker `i + 1`.
pub type Fleet = Arc<Vec<EngineSlot>>;

#[derive(Debug, thiserror::Error)]
#[error("fake engine for worker {worker}: {source}")]
pub struct FleetError {
    pub worker: u64,
    pub source: FakeEngineError,
}

/// The PUB address of worker `worker`'s engine: `tcp://127.0.0.1:(base_port + worker)`.
pub fn engine_endpoint(base_port: u16, worker: u64) -> String {
    format!("tcp://127.0.0.1:{}", u64::from(base_port) + worker)
}

/// Binds one engine per worker `1..=workers` on [`engine_endpoint`], each with a pool of
/// `kv_blocks` blocks (at least one) of `block_size` tokens. Must run inside a tokio runtime:
/// the engines' sockets belong to it.
pub async fn bind_fleet(
    base_port: u16,
    workers: u64,
    kv_blocks: usize,
    block_size: u32,
) -> Result<Fleet, FleetError> {
    let mut engines = Vec::new();
    for worker in 1..=workers {
        let address = engine_endpoint(base_port, worker);
        let engine = FakeEngine::bind(&address, None, Encoding::Array)
            .await
            .map_err(|source| FleetError { worker, source })?;
        engines.push(EngineSlot {
            engine: Mutex::new(PooledEngine::new(engine, kv_blocks, block_size)),
            queue: std::sync::Mutex::new(Vec::new()),
            routed: Notify::new(),
        });
    }
    Ok(Arc::new(engines))
}

/// A fake engine and the blocks it holds (oldest first), to publish only new blocks under the
/// right parent and evict like a full KV pool.
struct PooledEngine {
    engine: FakeEngine,
    /// Blocks, each with its position in the order of insertion: held when the position is not
    /// below `evicted`. Evicted entries stay until the map has twice the capacity and is pruned
    /// in one pass: removing each as it is evicted cost a cache miss per block (the oldest
    /// entries are the coldest), a sixth of the fake engines' CPU.
    held: HashMap<u64, u64>,
    /// Held blocks, oldest first; evicting takes from the front.
    order: VecDeque<u64>,
    /// Blocks inserted at positions below this have been evicted.
    evicted: u64,
    /// Position the next inserted block gets.
    next_position: u64,
    /// Per prompt (index), the oldest position among its blocks when it was last cached whole:
    /// while nothing at or after it was evicted, the engine still holds the whole prompt, which
    /// answers the common repeat without looking up each of its blocks.
    cached_from: HashMap<usize, u64>,
    capacity: usize,
    block_size: u32,
}

impl PooledEngine {
    fn new(engine: FakeEngine, capacity: usize, block_size: u32) -> Self {
        Self {
            engine,
            held: HashMap::new(),
            order: VecDeque::new(),
            evicted: 0,
            next_position: 0,
            cached_from: HashMap::new(),
            capacity: capacity.max(1),
            block_size,
        }
    }

    /// Whether the engine certainly holds every block of prompt `prompt` (false: look closer).
    fn holds_prompt(&self, prompt: usize) -> bool {
        self.cached_from
            .get(&prompt)
            .is_some_and(|&oldest| oldest >= self.evicted)
    }

    /// Caches a prompt whose block sequence hashes are `sequence` (the engine hashes too) and
    /// returns the events that says: the blocks it did not hold, and the ones that makes it
    /// evict. `prompt` names a prompt that may come again (remembered), `None` a one-off.
    fn cache_prompt<'t>(
        &mut self,
        prompt: Option<usize>,
        tokens: PromptTokens<'t>,
        sequence: &[u64],
        step: &mut Step<'t>,
    ) {
        if prompt.is_some_and(|p| self.holds_prompt(p)) {
            return;
        }
        let mut oldest = u64::MAX;
        let mut have = 0;
        for h in sequence {
            let Some(&position) = self.held.get(h).filter(|&&p| p >= self.evicted) else {
                break;
            };
            oldest = oldest.min(position);
            have += 1;
        }
        if have < sequence.len() {
            let parent = have.checked_sub(1).map(|i| sequence[i]);
            let start = have * self.block_size as usize;
            let end = sequence.len() * self.block_size as usize;
            let (token_ids, packed) = match tokens {
                PromptTokens::Plain(tokens) => (&tokens[start..end], None),
                PromptTokens::Packed(packed) => (&[][..], packed.blocks(have, sequence.len())),
            };
            let blocks = StoredBlocks {
                parent,
                token_ids,
                block_size: self.block_size,
                ..StoredBlocks::default()
            };
            for &h in &sequence[have..] {
                // A hash repeated inside the prompt, or held past a missing one, keeps its place;
                // an evicted one (already out of `order`) comes back at the end.
                let position = match self.held.entry(h) {
                    Entry::Occupied(held) if *held.get() >= self.evicted => *held.get(),
                    entry => {
                        let position = self.next_position;
                        entry.insert(position);
                        self.order.push_back(h);
                        self.next_position += 1;
                        position
                    }
                };
                oldest = oldest.min(position);
            }
            let mut evicted = Vec::new();
            // `order` holds positions `evicted..next_position` in order: its front is the oldest.
            while self.order.len() > self.capacity {
                if let Some(h) = self.order.pop_front() {
                    self.evicted += 1;
                    evicted.push(h);
                }
            }
            if self.held.len() > 2 * self.capacity {
                let horizon = self.evicted;
                self.held.retain(|_, position| *position >= horizon);
            }
            let hashes = sequence[have..].to_vec();
            match packed {
                Some(run) => {
                    step.events.push(stored_event_packed(&blocks, hashes));
                    step.packed.push(Some(run));
                }
                None => {
                    step.events
                        .push(stored_event_with_hashes(&blocks, hashes).0);
                    step.packed.push(None);
                }
            }
            if !evicted.is_empty() {
                step.events.push(removed_event(&evicted, None));
                step.packed.push(None);
            }
        }
        if let Some(prompt) = prompt {
            self.cached_from.insert(prompt, oldest);
        }
    }

    /// Publishes one step's events in one batch, as vLLM does. (A failed publish, only seen at
    /// shutdown, leaves the books as if it had gone out.)
    async fn publish(&mut self, step: Step<'_>) {
        if !step.events.is_empty() {
            let _ = self
                .engine
                .publish_events_packed(step.events, &step.packed)
                .await;
        }
    }
}

/// A prompt's token ids as an engine publishes them: as they are, or packed once for a prompt
/// that comes again and again (then publishing its blocks copies bytes, as a real engine's
/// publisher on another host costs this machine nothing).
#[derive(Clone, Copy)]
enum PromptTokens<'a> {
    Plain(&'a [u32]),
    Packed(&'a PackedTokens),
}

/// The events of one engine step, each with its packed token ids if it has them.
#[derive(Default)]
struct Step<'a> {
    events: Vec<RawEvent>,
    packed: Vec<Option<PackedRun<'a>>>,
}

/// One fake engine with the prompts routed to it and not yet cached. Its flusher takes them all
/// at once and publishes them as one step, so an engine that fell behind catches up in few
/// messages, as a real engine's scheduler batches the requests of one step.
pub struct EngineSlot {
    engine: Mutex<PooledEngine>,
    /// Routed prompts (by index), each with its place in the backlog.
    queue: std::sync::Mutex<Vec<(usize, OwnedSemaphorePermit)>>,
    routed: Notify,
}

impl EngineSlot {
    /// Hands prompt `prompt` (an index into the run's prompts) to the engine, which caches and
    /// publishes it in the background; `permit`, a place in the caller's backlog, is given back
    /// once the prompt is published.
    pub fn route(&self, prompt: usize, permit: OwnedSemaphorePermit) {
        if let Ok(mut queue) = self.queue.lock() {
            queue.push((prompt, permit));
        }
        self.routed.notify_one();
    }

    /// Whether the engine certainly holds every block of prompt `prompt`, seen without waiting:
    /// false when it does not or is busy publishing (then route the prompt; it stores only
    /// what it lacks).
    pub fn holds_prompt(&self, prompt: usize) -> bool {
        self.engine
            .try_lock()
            .is_ok_and(|engine| engine.holds_prompt(prompt))
    }

    /// Waits up to `wait` for a subscriber (the service's listener); false on timeout.
    pub async fn wait_for_subscriber(&self, wait: Duration) -> bool {
        self.engine
            .lock()
            .await
            .engine
            .wait_for_subscribers(1, wait)
            .await
    }

    /// Caches a prompt nobody routes again (an event storm's) and publishes what that stores
    /// and evicts, in one batch.
    pub async fn publish_one_off(&self, tokens: &[u32], sequence: &[u64]) {
        let mut engine = self.engine.lock().await;
        let mut step = Step::default();
        engine.cache_prompt(None, PromptTokens::Plain(tokens), sequence, &mut step);
        engine.publish(step).await;
    }

    /// Publishes what is routed to the engine, forever (abort the task or drop the runtime to
    /// stop it). `packed[i]` and `sequences[i]` are prompt `i`'s packed token ids and block
    /// hashes. `courteous`: yield the thread after each stretch of work
    /// ([`kvroute_service::courtesy`]), for engines that stand in for other hosts.
    pub async fn flush_forever(
        &self,
        packed: &[PackedTokens],
        sequences: &[Vec<u64>],
        courteous: bool,
    ) {
        loop {
            self.routed.notified().await;
            let batch = self
                .queue
                .lock()
                .map(|mut queue| std::mem::take(&mut *queue))
                .unwrap_or_default();
            if batch.is_empty() {
                continue;
            }
            let mut engine = self.engine.lock().await;
            let mut step = Step::default();
            for &(prompt, _) in &batch {
                if let (Some(tokens), Some(sequence)) = (packed.get(prompt), sequences.get(prompt))
                {
                    engine.cache_prompt(
                        Some(prompt),
                        PromptTokens::Packed(tokens),
                        sequence,
                        &mut step,
                    );
                }
            }
            engine.publish(step).await;
            // The permits go back to the backlog with the batch.
            drop(batch);
            drop(engine);
            if courteous {
                courtesy::after_work(courtesy::STRETCH);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{PackedTokens, PooledEngine, PromptTokens, Step};
    use crate::fake_engine::FakeEngine;
    use kvroute_wire::RawEvent;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    /// The fake engine's pool against a plain FIFO of held hashes: each prompt stores what the
    /// pool lacks from its first missing block on, and evicts the oldest past the capacity.
    #[tokio::test]
    async fn fake_engine_pools_store_and_evict_as_a_fifo_does() {
        let engine = FakeEngine::bind("tcp://127.0.0.1:0", None, kvroute_wire::Encoding::Array)
            .await
            .unwrap();
        let capacity = 24;
        let mut pool = PooledEngine::new(engine, capacity, 2);
        let mut model: std::collections::VecDeque<u64> = Default::default();
        let mut rng = SmallRng::seed_from_u64(7);
        for round in 0..3000 {
            // Prompts of 1..12 blocks over a small alphabet: shared prefixes and repeats.
            let blocks: u32 = rng.random_range(1..=12);
            let sequence: Vec<u64> = (0..blocks).map(|_| rng.random_range(1..=40)).collect();
            let tokens: Vec<u32> = (0..2 * blocks).collect();
            let packed = PackedTokens::new(&tokens, 2);
            let mut step = Step::default();
            pool.cache_prompt(None, PromptTokens::Packed(&packed), &sequence, &mut step);

            let have = sequence.iter().take_while(|h| model.contains(h)).count();
            for h in &sequence[have..] {
                if !model.contains(h) {
                    model.push_back(*h);
                }
            }
            let mut evicted = Vec::new();
            while model.len() > capacity {
                evicted.extend(model.pop_front());
            }
            let mut stored = Vec::new();
            let mut removed = Vec::new();
            for event in &step.events {
                match event {
                    RawEvent::Stored(s) => stored.extend_from_slice(&s.block_hashes),
                    RawEvent::Removed(r) => removed.extend_from_slice(&r.block_hashes),
                    _ => {}
                }
            }
            assert_eq!(stored, sequence[have..], "round {round}");
            assert_eq!(removed, evicted, "round {round}");
            let held: Vec<u64> = pool.order.iter().copied().collect();
            assert_eq!(held, Vec::from(model.clone()), "round {round}");
            assert!(pool.held.len() <= 2 * capacity + sequence.len());
        }
    }
}
