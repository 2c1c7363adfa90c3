//! A fake engine that speaks vLLM's KV-event protocol (SPEC §3.1) over real ZeroMQ sockets, for
//! tests, demos (`kvroute fake-engine`) and the simulator.
//!
//! - A PUB socket publishes batches as `[topic, seq, payload]`, `seq` 8 bytes big-endian from 0,
//!   payloads encoded by `kvroute-wire` in either encoding ([`Encoding::Array`] or
//!   [`Encoding::Map`]).
//! - An optional ROUTER socket answers replay requests `[b"", start_seq]` from a bounded ring of
//!   recent batches (like vLLM's `buffer_steps`), one reply per buffered batch with `seq >=
//!   start_seq`, then the end marker, in either reply layout ([`ReplayLayout`]).
//! - Faults for tests: [`FakeEngine::drop_next`] (batches kept for replay but not sent live),
//!   [`FakeEngine::skip_seq`] (a hole nobody can fill), [`FakeEngine::restart`] (numbering back
//!   to 0, replay ring emptied), [`FakeEngine::publish_raw`] and
//!   [`FakeEngine::publish_payload`] (garbage), [`ReplayMode`] (a replay that never ends).
//!
//! Block hashes: the fake engine names each block by kvroute's own sequence hash of the chain
//! (SPEC §2, seeded with the LoRA name), so [`engine_block_hashes`] (or `kvroute hash`) tells a
//! script which hashes to remove or use as a parent.
//!
//! Like a real PUB socket, the publisher drops batches while no subscriber is connected, and a
//! new subscriber misses what is published before its subscription reaches the engine; use
//! [`FakeEngine::wait_for_subscribers`] or a replay socket.

use bytes::Bytes;
use futures::StreamExt;
use kvroute_core::hash::{local_hashes, seed_for, sequence_hashes_from};
use kvroute_wire::frames;
use kvroute_wire::{
    EncodeOptions, Encoding, EventBatch, HashEncoding, PackedRun, RawEvent, RawRemoved, RawStored,
    encode_batch, encode_batch_packed, vllm_extra_keys,
};
use parking_lot::Mutex;
use serde::Deserialize;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::task::JoinHandle;
use zeromq::{
    PubSocket, RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqError, ZmqMessage,
};

/// vLLM's default number of batches kept for replay.
pub const DEFAULT_REPLAY_CAPACITY: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum FakeEngineError {
    #[error("cannot bind {socket} socket to {address}: {source}")]
    Bind {
        socket: &'static str,
        address: String,
        source: ZmqError,
    },
    #[error("cannot publish: {0}")]
    Send(ZmqError),
    #[error("cannot publish a message without frames")]
    NoFrames,
}

/// The layout of replay replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayLayout {
    /// `[b"", seq, payload]` (vLLM before 0.26).
    #[default]
    WithoutTopic,
    /// `[b"", topic, seq, payload]` (vLLM ≥ 0.26).
    WithTopic,
}

/// How the replay socket behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayMode {
    /// Replies, then the end marker.
    #[default]
    Normal,
    /// Replies but never the end marker (to test replay timeouts).
    NoEndMarker,
    /// Reads requests and answers nothing.
    Silent,
}

/// The ring of recent batches and how replays are answered; shared with the replay task.
struct ReplayRing {
    batches: VecDeque<(u64, Vec<u8>)>,
    capacity: usize,
    layout: ReplayLayout,
    mode: ReplayMode,
    topic: Vec<u8>,
}

impl ReplayRing {
    fn push(&mut self, seq: u64, payload: Vec<u8>) {
        if self.capacity == 0 {
            return;
        }
        while self.batches.len() >= self.capacity {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }

    /// The replies to a request for everything from `start_seq`, end marker included.
    fn answer(&self, identity: &[u8], start_seq: u64) -> Vec<Vec<Vec<u8>>> {
        if self.mode == ReplayMode::Silent {
            return Vec::new();
        }
        let topic = match self.layout {
            ReplayLayout::WithoutTopic => None,
            ReplayLayout::WithTopic => Some(self.topic.as_slice()),
        };
        let mut replies: Vec<_> = self
            .batches
            .iter()
            .filter(|(seq, _)| *seq >= start_seq)
            .map(|(seq, payload)| {
                frames::routed(identity, frames::replay_reply(topic, *seq, payload.clone()))
            })
            .collect();
        if self.mode == ReplayMode::Normal {
            replies.push(frames::routed(identity, frames::replay_end(topic)));
        }
        replies
    }
}

/// The blocks of one `BlockStored` event.
#[derive(Debug, Clone, Copy, Default)]
pub struct StoredBlocks<'a> {
    /// The engine hash of the block these follow; `None` at the start of a prompt.
    pub parent: Option<u64>,
    /// The tokens; a trailing partial block is not stored (as in vLLM).
    pub token_ids: &'a [u32],
    pub block_size: u32,
    /// `"GPU"`, `"CPU"`, ...; `None` is the device.
    pub medium: Option<&'a str>,
    pub lora_name: Option<&'a str>,
}

/// The engine hashes the fake engine gives the full blocks of `token_ids` after `parent`.
pub fn engine_block_hashes(
    parent: Option<u64>,
    token_ids: &[u32],
    block_size: u32,
    lora_name: Option<&str>,
) -> Vec<u64> {
    let locals = local_hashes(token_ids, block_size as usize, seed_for(lora_name, None));
    sequence_hashes_from(parent, &locals)
}

/// A `BlockStored` event for these blocks, and the engine hashes it names them by.
pub fn stored_event(blocks: &StoredBlocks<'_>) -> (RawEvent, Vec<u64>) {
    let hashes = engine_block_hashes(
        blocks.parent,
        blocks.token_ids,
        blocks.block_size,
        blocks.lora_name,
    );
    stored_event_with_hashes(blocks, hashes)
}

/// Like [`stored_event`] with the blocks' engine hashes already known (one per full block).
pub fn stored_event_with_hashes(
    blocks: &StoredBlocks<'_>,
    hashes: Vec<u64>,
) -> (RawEvent, Vec<u64>) {
    let full_tokens = hashes.len() * blocks.block_size as usize;
    let event = stored_raw(
        blocks,
        hashes.clone(),
        blocks.token_ids[..full_tokens].to_vec(),
    );
    (event, hashes)
}

/// Like [`stored_event_with_hashes`] for blocks whose token ids go out packed
/// ([`FakeEngine::publish_events_packed`]): the event's own list stays empty
/// (`blocks.token_ids` is not looked at).
pub fn stored_event_packed(blocks: &StoredBlocks<'_>, hashes: Vec<u64>) -> RawEvent {
    stored_raw(blocks, hashes, Vec::new())
}

fn stored_raw(blocks: &StoredBlocks<'_>, hashes: Vec<u64>, token_ids: Vec<u32>) -> RawEvent {
    let extra_keys = vllm_extra_keys(hashes.len(), blocks.lora_name, None);
    RawEvent::Stored(RawStored {
        block_hashes: hashes,
        parent_block_hash: blocks.parent,
        token_ids,
        block_size: blocks.block_size,
        medium: Some(blocks.medium.unwrap_or("GPU").to_string()),
        lora_name: blocks.lora_name.map(str::to_string),
        extra_keys,
        ..RawStored::default()
    })
}

/// A `BlockRemoved` of engine hashes from `medium` (`None` is the device).
pub fn removed_event(block_hashes: &[u64], medium: Option<&str>) -> RawEvent {
    RawEvent::Removed(RawRemoved {
        block_hashes: block_hashes.to_vec(),
        medium: Some(medium.unwrap_or("GPU").to_string()),
        group_idx: None,
    })
}

/// A ZeroMQ message of these frames; `None` without frames.
fn zmq_message(frames: Vec<Vec<u8>>) -> Option<ZmqMessage> {
    ZmqMessage::try_from(frames.into_iter().map(Bytes::from).collect::<Vec<_>>()).ok()
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A publishing fake engine. Dropping it closes its sockets.
pub struct FakeEngine {
    publisher: PubSocket,
    monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    subscribers: usize,
    pub_endpoint: String,
    replay_endpoint: Option<String>,
    ring: Arc<Mutex<ReplayRing>>,
    replay_task: Option<JoinHandle<()>>,
    options: EncodeOptions,
    topic: Vec<u8>,
    next_seq: u64,
    data_parallel_rank: Option<u32>,
    drop_live: usize,
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        if let Some(task) = self.replay_task.take() {
            task.abort();
        }
    }
}

impl FakeEngine {
    /// Binds the PUB socket (and the ROUTER replay socket when given); port 0 picks a free port,
    /// see [`pub_endpoint`](Self::pub_endpoint). Must run inside a tokio runtime.
    pub async fn bind(
        pub_address: &str,
        replay_address: Option<&str>,
        encoding: Encoding,
    ) -> Result<Self, FakeEngineError> {
        let mut publisher = PubSocket::new();
        let monitor = publisher.monitor();
        let bound = publisher
            .bind(pub_address)
            .await
            .map_err(|source| FakeEngineError::Bind {
                socket: "PUB",
                address: pub_address.to_string(),
                source,
            })?;
        let ring = Arc::new(Mutex::new(ReplayRing {
            batches: VecDeque::new(),
            // Without a replay socket nothing is ever replayed: keep no copies.
            capacity: if replay_address.is_some() {
                DEFAULT_REPLAY_CAPACITY
            } else {
                0
            },
            layout: ReplayLayout::default(),
            mode: ReplayMode::default(),
            topic: Vec::new(),
        }));
        let (replay_endpoint, replay_task) = match replay_address {
            None => (None, None),
            Some(address) => {
                let mut router = RouterSocket::new();
                let bound = router
                    .bind(address)
                    .await
                    .map_err(|source| FakeEngineError::Bind {
                        socket: "ROUTER",
                        address: address.to_string(),
                        source,
                    })?;
                let task = tokio::spawn(serve_replays(router, Arc::clone(&ring)));
                (Some(bound.to_string()), Some(task))
            }
        };
        Ok(Self {
            publisher,
            monitor,
            subscribers: 0,
            pub_endpoint: bound.to_string(),
            replay_endpoint,
            ring,
            replay_task,
            options: EncodeOptions {
                encoding,
                hashes: HashEncoding::default(),
            },
            topic: Vec::new(),
            next_seq: 0,
            data_parallel_rank: None,
            drop_live: 0,
        })
    }

    /// The bound PUB address (`tcp://127.0.0.1:PORT`).
    pub fn pub_endpoint(&self) -> &str {
        &self.pub_endpoint
    }

    /// The bound ROUTER address, when replay is on.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The sequence number of the next batch.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The `data_parallel_rank` written into every batch from now on (`None`: omitted).
    pub fn set_data_parallel_rank(&mut self, rank: Option<u32>) {
        self.data_parallel_rank = rank;
    }

    /// How block hashes are written (int, signed int or bytes).
    pub fn set_hash_encoding(&mut self, hashes: HashEncoding) {
        self.options.hashes = hashes;
    }

    /// The topic frame of live messages (and of replies in [`ReplayLayout::WithTopic`]).
    pub fn set_topic(&mut self, topic: &[u8]) {
        self.topic = topic.to_vec();
        self.ring.lock().topic = topic.to_vec();
    }

    pub fn set_replay_layout(&self, layout: ReplayLayout) {
        self.ring.lock().layout = layout;
    }

    pub fn set_replay_mode(&self, mode: ReplayMode) {
        self.ring.lock().mode = mode;
    }

    /// How many recent batches replays can deliver (older ones are forgotten).
    pub fn set_replay_capacity(&self, capacity: usize) {
        let mut ring = self.ring.lock();
        ring.capacity = capacity;
        while ring.batches.len() > capacity {
            ring.batches.pop_front();
        }
    }

    /// Waits until at least `count` subscribers are connected, then a little longer for their
    /// subscriptions to arrive. Returns false on timeout.
    pub async fn wait_for_subscribers(&mut self, count: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.subscribers < count {
            match tokio::time::timeout_at(deadline, self.monitor.next()).await {
                Ok(Some(SocketEvent::Accepted(..))) => self.subscribers += 1,
                Ok(Some(SocketEvent::Disconnected(_))) => {
                    self.subscribers = self.subscribers.saturating_sub(1);
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return false,
            }
        }
        // The subscription frame follows the handshake.
        tokio::time::sleep(Duration::from_millis(50)).await;
        true
    }

    /// The next `count` batches get sequence numbers and go to the replay ring but are not sent
    /// live (a subscriber sees a gap a replay can fill).
    pub fn drop_next(&mut self, count: usize) {
        self.drop_live += count;
    }

    /// Skips one sequence number: a gap no replay can fill.
    pub fn skip_seq(&mut self) {
        self.next_seq += 1;
    }

    /// Simulates an engine restart: numbering starts over at 0 and the replay ring is emptied.
    /// The sockets stay bound.
    pub fn restart(&mut self) {
        self.next_seq = 0;
        self.drop_live = 0;
        self.ring.lock().batches.clear();
    }

    /// Publishes one batch of events; returns its sequence number.
    pub async fn publish_events(&mut self, events: Vec<RawEvent>) -> Result<u64, FakeEngineError> {
        let batch = EventBatch {
            ts: now_secs(),
            events,
            data_parallel_rank: self.data_parallel_rank,
        };
        self.publish_payload(encode_batch(&batch, self.options))
            .await
    }

    /// Publishes one batch of events, the token ids of some `BlockStored` events packed
    /// (`packed[i]` for event `i`, see [`kvroute_wire::encode_batch_packed`]); returns its
    /// sequence number.
    pub async fn publish_events_packed(
        &mut self,
        events: Vec<RawEvent>,
        packed: &[Option<PackedRun<'_>>],
    ) -> Result<u64, FakeEngineError> {
        let batch = EventBatch {
            ts: now_secs(),
            events,
            data_parallel_rank: self.data_parallel_rank,
        };
        self.publish_payload(encode_batch_packed(&batch, self.options, packed))
            .await
    }

    /// Publishes a `BlockStored` for the full blocks of `token_ids`; returns their engine hashes.
    pub async fn publish_stored(
        &mut self,
        parent: Option<u64>,
        token_ids: &[u32],
        block_size: u32,
        medium: Option<&str>,
    ) -> Result<Vec<u64>, FakeEngineError> {
        self.publish_stored_blocks(&StoredBlocks {
            parent,
            token_ids,
            block_size,
            medium,
            lora_name: None,
        })
        .await
    }

    /// Publishes a `BlockStored`; returns the engine hashes of its blocks.
    pub async fn publish_stored_blocks(
        &mut self,
        blocks: &StoredBlocks<'_>,
    ) -> Result<Vec<u64>, FakeEngineError> {
        let (event, hashes) = stored_event(blocks);
        self.publish_events(vec![event]).await?;
        Ok(hashes)
    }

    /// Publishes, in one batch (as vLLM does for one scheduler step), a `BlockStored` whose
    /// engine hashes the caller already computed (one per full block of `blocks.token_ids`,
    /// chained from `blocks.parent` as [`stored_event`] would) and, when `removed` is not empty,
    /// a `BlockRemoved` of those blocks.
    pub async fn publish_stored_hashed(
        &mut self,
        blocks: &StoredBlocks<'_>,
        hashes: &[u64],
        removed: &[u64],
    ) -> Result<(), FakeEngineError> {
        let (event, _) = stored_event_with_hashes(blocks, hashes.to_vec());
        let mut events = vec![event];
        if !removed.is_empty() {
            events.push(removed_event(removed, blocks.medium));
        }
        self.publish_events(events).await?;
        Ok(())
    }

    /// Publishes a `BlockRemoved`; returns its sequence number.
    pub async fn publish_removed(
        &mut self,
        block_hashes: &[u64],
        medium: Option<&str>,
    ) -> Result<u64, FakeEngineError> {
        self.publish_events(vec![removed_event(block_hashes, medium)])
            .await
    }

    /// Publishes an `AllBlocksCleared`; returns its sequence number.
    pub async fn publish_cleared(&mut self) -> Result<u64, FakeEngineError> {
        self.publish_events(vec![RawEvent::Cleared]).await
    }

    /// Publishes any payload under the next sequence number (kept for replay too).
    pub async fn publish_payload(&mut self, payload: Vec<u8>) -> Result<u64, FakeEngineError> {
        let seq = self.next_seq;
        self.next_seq += 1;
        {
            let mut ring = self.ring.lock();
            if ring.capacity > 0 {
                ring.push(seq, payload.clone());
            }
        }
        if self.drop_live > 0 {
            self.drop_live -= 1;
            return Ok(seq);
        }
        self.publish_raw(frames::live_message(&self.topic, seq, payload))
            .await?;
        Ok(seq)
    }

    /// Sends frames as they are, without a sequence number of their own.
    pub async fn publish_raw(&mut self, frames: Vec<Vec<u8>>) -> Result<(), FakeEngineError> {
        let message = zmq_message(frames).ok_or(FakeEngineError::NoFrames)?;
        self.publisher
            .send(message)
            .await
            .map_err(FakeEngineError::Send)
    }
}

/// Answers replay requests until the socket fails or the engine is dropped.
async fn serve_replays(mut router: RouterSocket, ring: Arc<Mutex<ReplayRing>>) {
    loop {
        let request = match router.recv().await {
            Ok(request) => request.into_vec(),
            Err(error) => {
                tracing::debug!(%error, "fake engine replay socket closed");
                return;
            }
        };
        let Ok(parsed) = frames::parse_replay_request(&request) else {
            tracing::debug!("fake engine ignored a malformed replay request");
            continue;
        };
        let Some(identity) = parsed.identity else {
            continue;
        };
        let replies = ring.lock().answer(identity, parsed.start_seq);
        for reply in replies {
            let Some(message) = zmq_message(reply) else {
                continue;
            };
            if router.send(message).await.is_err() {
                break;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Scripts: what `kvroute fake-engine` publishes.

/// An engine hash in a script: unsigned, or the signed value with the same bits (as kvroute's
/// JSON API and `kvroute hash` print them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum ScriptHash {
    Unsigned(u64),
    Signed(i64),
}

impl ScriptHash {
    pub fn as_u64(self) -> u64 {
        match self {
            ScriptHash::Unsigned(h) => h,
            ScriptHash::Signed(h) => h as u64,
        }
    }
}

/// One line of a `--events` JSONL file; each line is published as one batch.
///
/// ```json
/// {"type": "stored", "token_ids": [1, 2, 3, 4], "parent": null, "medium": "GPU"}
/// {"type": "stored", "token_ids": [5, 6, 7, 8], "parent": -3803038269031200164, "lora_name": "a"}
/// {"type": "removed", "token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}
/// {"type": "removed", "block_hashes": [-3803038269031200164], "medium": "CPU"}
/// {"type": "cleared"}
/// ```
/// `block_size` defaults to the command's `--block-size`; `medium` to `"GPU"`. A `removed` line
/// names blocks by `block_hashes`, or by `token_ids` (+ `parent`, `lora_name`): the blocks a
/// `stored` line with those fields created.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ScriptEvent {
    Stored {
        token_ids: Vec<u32>,
        #[serde(default)]
        parent: Option<ScriptHash>,
        #[serde(default)]
        medium: Option<String>,
        #[serde(default)]
        lora_name: Option<String>,
        #[serde(default)]
        block_size: Option<u32>,
    },
    Removed {
        #[serde(default)]
        block_hashes: Option<Vec<ScriptHash>>,
        #[serde(default)]
        token_ids: Option<Vec<u32>>,
        #[serde(default)]
        parent: Option<ScriptHash>,
        #[serde(default)]
        lora_name: Option<String>,
        #[serde(default)]
        medium: Option<String>,
        #[serde(default)]
        block_size: Option<u32>,
    },
    Cleared,
}

impl ScriptEvent {
    /// Parses one JSONL line; `Ok(None)` for a blank line.
    pub fn parse_line(line: &str) -> Result<Option<Self>, String> {
        if line.trim().is_empty() {
            return Ok(None);
        }
        let event: Self = serde_json::from_str(line).map_err(|e| e.to_string())?;
        if let ScriptEvent::Removed {
            block_hashes: None,
            token_ids: None,
            ..
        } = event
        {
            return Err("a removed event needs block_hashes or token_ids".to_string());
        }
        Ok(Some(event))
    }

    /// The raw event to publish, hashing with `default_block_size` unless the line sets one.
    pub fn to_raw(&self, default_block_size: u32) -> RawEvent {
        match self {
            ScriptEvent::Stored {
                token_ids,
                parent,
                medium,
                lora_name,
                block_size,
            } => {
                stored_event(&StoredBlocks {
                    parent: parent.map(ScriptHash::as_u64),
                    token_ids,
                    block_size: block_size.unwrap_or(default_block_size),
                    medium: medium.as_deref(),
                    lora_name: lora_name.as_deref(),
                })
                .0
            }
            ScriptEvent::Removed {
                block_hashes,
                token_ids,
                parent,
                lora_name,
                medium,
                block_size,
            } => {
                let mut hashes: Vec<u64> =
                    block_hashes.iter().flatten().map(|h| h.as_u64()).collect();
                if let Some(tokens) = token_ids {
                    hashes.extend(engine_block_hashes(
                        parent.map(ScriptHash::as_u64),
                        tokens,
                        block_size.unwrap_or(default_block_size),
                        lora_name.as_deref(),
                    ));
                }
                removed_event(&hashes, medium.as_deref())
            }
            ScriptEvent::Cleared => RawEvent::Cleared,
        }
    }
}

/// Synthetic prompts with shared prefixes: prompt `i` starts with the prefix of group
/// `i % prefix_groups` (`shared_fraction` of its tokens), then tokens of its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyntheticPrompts {
    pub prompts: usize,
    pub prompt_tokens: usize,
    pub prefix_groups: usize,
    /// Share of each prompt taken by its group's prefix, in [0, 1].
    pub shared_fraction: f64,
}

impl SyntheticPrompts {
    /// The tokens of prompt `index` (deterministic).
    pub fn prompt(&self, index: usize) -> Vec<u32> {
        let shared = ((self.prompt_tokens as f64) * self.shared_fraction.clamp(0.0, 1.0)) as usize;
        let group = (index % self.prefix_groups.max(1)) as u32;
        let mut tokens = Vec::with_capacity(self.prompt_tokens);
        // Token values stay below 2^31 and differ between groups and prompts.
        tokens.extend(
            (0..shared as u32).map(|i| (group + 1).wrapping_mul(1_000_003) % (1 << 24) + i),
        );
        let own = (index as u32).wrapping_mul(7_919) % (1 << 20) + (1 << 30);
        tokens.extend((0..(self.prompt_tokens - shared) as u32).map(|i| own.wrapping_add(i * 31)));
        tokens
    }

    pub fn iter(&self) -> impl Iterator<Item = Vec<u32>> + '_ {
        (0..self.prompts).map(|i| self.prompt(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_wire::{decode_batch, to_kv_events};

    #[test]
    fn stored_event_names_blocks_by_sequence_hash() {
        let tokens: Vec<u32> = (1..=17).collect();
        let (event, hashes) = stored_event(&StoredBlocks {
            token_ids: &tokens,
            block_size: 4,
            ..StoredBlocks::default()
        });
        // SPEC §2 vectors (as u64).
        assert_eq!(hashes.len(), 4);
        assert_eq!(hashes[0] as i64, -3803038269031200164);
        assert_eq!(hashes[3] as i64, 1921452330601040443);
        let RawEvent::Stored(stored) = &event else {
            panic!("not stored: {event:?}");
        };
        assert_eq!(
            stored.token_ids.len(),
            16,
            "the partial block is not stored"
        );
        let continued = engine_block_hashes(Some(hashes[1]), &tokens[8..16], 4, None);
        assert_eq!(continued, hashes[2..4]);
    }

    #[test]
    fn replay_ring_is_bounded_and_answers_in_both_layouts() {
        let mut ring = ReplayRing {
            batches: VecDeque::new(),
            capacity: 2,
            layout: ReplayLayout::WithoutTopic,
            mode: ReplayMode::Normal,
            topic: b"kv".to_vec(),
        };
        for seq in 0..3 {
            ring.push(seq, vec![seq as u8]);
        }
        let replies = ring.answer(b"id", 0);
        assert_eq!(replies.len(), 3, "two batches and the end marker");
        assert_eq!(
            replies[0],
            vec![b"id".to_vec(), vec![], 1u64.to_be_bytes().to_vec(), vec![1]]
        );
        ring.layout = ReplayLayout::WithTopic;
        let replies = ring.answer(b"id", 2);
        assert_eq!(replies.len(), 2);
        assert_eq!(replies[0][2], b"kv".to_vec());
        assert_eq!(replies[1][3], vec![0xff; 8]);
        ring.mode = ReplayMode::NoEndMarker;
        assert_eq!(ring.answer(b"id", 0).len(), 2);
        ring.mode = ReplayMode::Silent;
        assert!(ring.answer(b"id", 0).is_empty());
    }

    #[test]
    fn script_lines_parse_and_convert() {
        let stored = ScriptEvent::parse_line(
            r#"{"type":"stored","token_ids":[1,2,3,4,5,6,7,8],"parent":null,"medium":"CPU"}"#,
        )
        .unwrap()
        .unwrap();
        let raw = stored.to_raw(4);
        let batch = EventBatch {
            ts: 0.0,
            events: vec![raw],
            data_parallel_rank: None,
        };
        let decoded = decode_batch(&encode_batch(&batch, EncodeOptions::default())).unwrap();
        assert_eq!(to_kv_events(&decoded).outcome.stored_blocks, 2);

        let removed = ScriptEvent::parse_line(r#"{"type":"removed","token_ids":[1,2,3,4]}"#)
            .unwrap()
            .unwrap();
        let RawEvent::Removed(r) = removed.to_raw(4) else {
            panic!("not removed")
        };
        assert_eq!(
            r.block_hashes,
            engine_block_hashes(None, &[1, 2, 3, 4], 4, None)
        );
        let signed = ScriptEvent::parse_line(r#"{"type":"removed","block_hashes":[-1, 5]}"#)
            .unwrap()
            .unwrap();
        let RawEvent::Removed(r) = signed.to_raw(4) else {
            panic!("not removed")
        };
        assert_eq!(r.block_hashes, vec![u64::MAX, 5]);

        assert_eq!(ScriptEvent::parse_line("  ").unwrap(), None);
        assert_eq!(
            ScriptEvent::parse_line(r#"{"type":"cleared"}"#).unwrap(),
            Some(ScriptEvent::Cleared)
        );
        assert!(ScriptEvent::parse_line(r#"{"type":"removed"}"#).is_err());
        assert!(ScriptEvent::parse_line(r#"{"type":"stored","token_ids":[1],"x":1}"#).is_err());
    }

    #[test]
    fn synthetic_prompts_share_prefixes_within_a_group() {
        let prompts = SyntheticPrompts {
            prompts: 4,
            prompt_tokens: 64,
            prefix_groups: 2,
            shared_fraction: 0.5,
        };
        let all: Vec<_> = prompts.iter().collect();
        assert_eq!(all.len(), 4);
        assert!(all.iter().all(|p| p.len() == 64));
        assert_eq!(all[0][..32], all[2][..32]);
        assert_ne!(all[0][..32], all[1][..32]);
        assert_ne!(all[0][32..], all[2][32..]);
    }
}
