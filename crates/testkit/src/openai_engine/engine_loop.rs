//! The engine loop: one task owning a [`kvroute_sim::Engine`], run in real time.
//!
//! Each turn takes the requests that arrived (they join the next step, as in vLLM), drops those
//! whose client went away ([`Engine::abort`]), starts a step, sleeps its modelled duration ×
//! `time_scale`, ends it, publishes its KV events as one batch and sends each request its news:
//! admitted (with its cached tokens), one token, finished. With nothing to run it sleeps until a
//! request comes. It stops when the engine is killed or shut down, dropping every request's
//! channel and closing the PUB socket.
//!
//! KV events: the simulator names each block by kvroute's sequence hash of its tokens (the
//! request's hashes cover its prompt and its known output), which is the engine hash
//! [`crate::fake_engine`] gives the same tokens; the loop keeps, for every block of the requests
//! in flight, where its tokens are, and publishes each `BlockStored` with them, so a router
//! that hashes the event's tokens gets the hashes of the prompt.

use super::{Shared, until_true};
use crate::fake_engine::{FakeEngine, StoredBlocks, removed_event, stored_event_with_hashes};
use hashbrown::HashMap;
use hashbrown::hash_map::Entry;
use kvroute_core::event::KvEvent;
use kvroute_sim::engine::StepReport;
use kvroute_sim::{Engine, EngineConfig, RequestId, SimRequest};
use kvroute_wire::RawEvent;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, mpsc, watch};

/// The PUB socket, shared so a test can wait for subscribers; `None` once the loop has ended.
pub(crate) type Publisher = Arc<Mutex<Option<FakeEngine>>>;

/// What the routes ask of the loop.
pub(crate) enum Command {
    Submit(Submission),
    /// Releases blocks held for a transfer (pulled, or their hold timed out).
    Release(Vec<u64>),
}

/// A request for the loop.
pub(crate) struct Submission {
    /// Its hashes cover the prompt and the output (`isl_tokens` is the prompt's length).
    pub request: SimRequest,
    /// The prompt's tokens followed by the output's.
    pub tokens: Arc<[u32]>,
    pub progress: mpsc::UnboundedSender<Progress>,
    /// A prefill leg: hold this many leading prompt blocks when it finishes (`Progress::Held`
    /// says how many were).
    pub hold_blocks: Option<usize>,
    /// A decode leg: this many leading prompt blocks were received; cache them first.
    pub import_blocks: usize,
}

/// What the loop tells a request, in this order: `Admitted`, one `Token` per output token,
/// (`Held` for a prefill leg), `Finished`. A closed channel without `Finished` means the engine
/// stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    Admitted {
        cached_tokens: u64,
    },
    Token,
    /// The leading `blocks` prompt blocks are held until released.
    Held {
        blocks: usize,
    },
    Finished,
}

struct Live {
    progress: mpsc::UnboundedSender<Progress>,
    hold_blocks: Option<usize>,
}

/// Where the tokens of a block of a request in flight are; counted per request holding it.
struct BlockTokens {
    tokens: Arc<[u32]>,
    index: usize,
    holders: u32,
}

pub(crate) struct EngineLoop {
    engine: Engine,
    requests: HashMap<RequestId, SimRequest>,
    live: HashMap<RequestId, Live>,
    blocks: HashMap<u64, BlockTokens>,
    next_id: RequestId,
    publisher: Option<Publisher>,
    time_scale: f64,
    shared: Arc<Shared>,
}

impl EngineLoop {
    pub(crate) fn new(
        config: EngineConfig,
        time_scale: f64,
        publisher: Option<Publisher>,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            engine: Engine::new(config),
            requests: HashMap::new(),
            live: HashMap::new(),
            blocks: HashMap::new(),
            next_id: 0,
            publisher,
            time_scale,
            shared,
        }
    }

    /// Runs until `killed` turns true (or its sender is gone).
    pub(crate) async fn run(
        mut self,
        mut submissions: mpsc::UnboundedReceiver<Command>,
        mut killed: watch::Receiver<bool>,
    ) {
        loop {
            while let Ok(command) = submissions.try_recv() {
                self.command(command);
            }
            self.abort_abandoned();
            self.publish_load();
            if !self.engine.has_work() {
                tokio::select! {
                    command = submissions.recv() => match command {
                        Some(command) => {
                            self.command(command);
                            continue;
                        }
                        None => break,
                    },
                    () = until_true(&mut killed) => break,
                }
            }
            let started = tokio::time::Instant::now();
            let nanos = match self.engine.start_step(&self.requests) {
                Ok(Some(nanos)) => nanos,
                Ok(None) => {
                    // Work that cannot be scheduled would spin the loop: drop it (a bug).
                    tracing::error!("mock engine: requests that cannot be scheduled; dropped");
                    self.abort_all();
                    continue;
                }
                Err(error) => {
                    tracing::error!(%error, "mock engine: step failed; requests dropped");
                    self.abort_all();
                    continue;
                }
            };
            // Any finite non-negative scale is valid: a step too long for a Duration is "forever".
            let step = Duration::try_from_secs_f64(nanos as f64 * 1e-9 * self.time_scale)
                .unwrap_or(Duration::MAX);
            let remaining = step.saturating_sub(started.elapsed());
            if remaining.is_zero() {
                // Steps at no real time (time_scale 0) still let the routes' tasks run.
                tokio::task::yield_now().await;
            } else {
                tokio::select! {
                    () = tokio::time::sleep(remaining) => {}
                    () = until_true(&mut killed) => break,
                }
            }
            if *killed.borrow() {
                break;
            }
            let report = self.engine.finish_step();
            self.publish(&report.events).await;
            self.deliver(&report);
            self.publish_load();
        }
        if let Some(publisher) = &self.publisher {
            publisher.lock().await.take();
        }
    }

    /// Shares the engine's queue lengths and KV blocks in use with `GET /metrics`.
    fn publish_load(&self) {
        let config = self.engine.config();
        let total = config.kv_blocks.unwrap_or(config.nominal_kv_blocks);
        self.shared.load.store(
            self.engine.running_len() as u64,
            self.engine.waiting_len() as u64,
            self.engine.pool().in_use(),
            total,
        );
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Submit(submission) => self.submit(submission),
            Command::Release(held) => self.engine.release_held(&held),
        }
    }

    fn submit(&mut self, submission: Submission) {
        let Submission {
            request,
            tokens,
            progress,
            hold_blocks,
            import_blocks,
        } = submission;
        if !self.engine.config().fits(&request) {
            return; // the handler checked; dropping the channel answers an error
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        for (index, &hash) in request.prompt.sequence.iter().enumerate() {
            match self.blocks.entry(hash) {
                Entry::Occupied(mut held) => held.get_mut().holders += 1,
                Entry::Vacant(slot) => {
                    slot.insert(BlockTokens {
                        tokens: Arc::clone(&tokens),
                        index,
                        holders: 1,
                    });
                }
            }
        }
        if import_blocks > 0 {
            // Under pressure fewer fit; the request then computes the rest itself.
            self.engine.import_prefix(&request, import_blocks);
        }
        self.engine.submit(id, &request);
        self.requests.insert(id, request);
        self.live.insert(
            id,
            Live {
                progress,
                hold_blocks,
            },
        );
    }

    /// Forgets a request that finished or was aborted.
    fn forget(&mut self, id: RequestId) {
        self.live.remove(&id);
        let Some(request) = self.requests.remove(&id) else {
            return;
        };
        for hash in &request.prompt.sequence {
            if let Entry::Occupied(mut held) = self.blocks.entry(*hash) {
                held.get_mut().holders -= 1;
                if held.get().holders == 0 {
                    held.remove();
                }
            }
        }
    }

    fn abort(&mut self, id: RequestId) {
        if let Err(error) = self.engine.abort(id) {
            tracing::error!(%error, "mock engine: abort failed");
        }
        self.forget(id);
    }

    /// Aborts the requests whose client went away (their receiver is dropped).
    fn abort_abandoned(&mut self) {
        let gone: Vec<RequestId> = self
            .live
            .iter()
            .filter(|(_, live)| live.progress.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.abort(id);
        }
    }

    fn abort_all(&mut self) {
        let all: Vec<RequestId> = self.live.keys().copied().collect();
        for id in all {
            self.abort(id);
        }
    }

    fn deliver(&mut self, report: &StepReport) {
        let mut gone = Vec::new();
        let mut send = |live: &HashMap<RequestId, Live>, id: RequestId, news: Progress| {
            if let Some(l) = live.get(&id)
                && l.progress.send(news).is_err()
            {
                gone.push(id);
            }
        };
        for &(id, cached_tokens) in &report.first_admissions {
            send(&self.live, id, Progress::Admitted { cached_tokens });
        }
        for &id in &report.sampled {
            send(&self.live, id, Progress::Token);
        }
        for &id in &report.finished {
            self.hold(id);
            send(&self.live, id, Progress::Finished);
        }
        for &id in &report.finished {
            self.forget(id);
        }
        for id in gone {
            if self.live.contains_key(&id) {
                self.abort(id);
            }
        }
    }

    /// Holds a finished prefill leg's prompt blocks and says how many (released at once if
    /// nobody is there to hear it).
    fn hold(&mut self, id: RequestId) {
        let (Some(live), Some(request)) = (self.live.get(&id), self.requests.get(&id)) else {
            return;
        };
        let Some(wanted) = live.hold_blocks else {
            return;
        };
        let wanted = wanted.min(request.prompt.sequence.len());
        let prefix = &request.prompt.sequence[..wanted];
        let blocks = self.engine.hold_prefix(prefix);
        if live.progress.send(Progress::Held { blocks }).is_err() {
            self.engine.release_held(&prefix[..blocks]);
        }
    }

    /// Publishes a step's events as one batch, vLLM's way.
    async fn publish(&self, events: &[KvEvent]) {
        let Some(publisher) = &self.publisher else {
            return;
        };
        if events.is_empty() {
            return;
        }
        let raw = self.raw_events(events);
        if raw.is_empty() {
            return;
        }
        let mut publisher = publisher.lock().await;
        if let Some(engine) = publisher.as_mut()
            && let Err(error) = engine.publish_events(raw).await
        {
            tracing::debug!(%error, "mock engine: cannot publish KV events");
        }
        self.shared
            .event_batches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The wire events of the pool's events: each stored block with its tokens.
    fn raw_events(&self, events: &[KvEvent]) -> Vec<RawEvent> {
        let block_size = self.engine.config().block_size;
        let size = block_size as usize;
        let mut raw = Vec::with_capacity(events.len());
        for event in events {
            match event {
                KvEvent::Stored { parent, blocks, .. } => {
                    let mut hashes = Vec::with_capacity(blocks.len());
                    let mut token_ids = Vec::with_capacity(blocks.len() * size);
                    for block in blocks {
                        let Some(held) = self.blocks.get(&block.engine_hash) else {
                            // Cannot happen: every block the pool fills belongs to a request in
                            // flight. Publish the run up to it.
                            tracing::debug!("mock engine: a stored block without tokens");
                            break;
                        };
                        let start = held.index * size;
                        let Some(tokens) = held.tokens.get(start..start + size) else {
                            break;
                        };
                        hashes.push(block.engine_hash);
                        token_ids.extend_from_slice(tokens);
                    }
                    if !hashes.is_empty() {
                        let blocks = StoredBlocks {
                            parent: *parent,
                            token_ids: &token_ids,
                            block_size,
                            ..StoredBlocks::default()
                        };
                        raw.push(stored_event_with_hashes(&blocks, hashes).0);
                    }
                }
                KvEvent::Removed { engine_hashes, .. } => {
                    raw.push(removed_event(engine_hashes, None));
                }
                KvEvent::Cleared => raw.push(RawEvent::Cleared),
            }
        }
        raw
    }
}
