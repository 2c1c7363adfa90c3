//! One endpoint's listener task: the state machine of the [module docs](super), over a real SUB
//! socket and, for replays, a DEALER ([`super::replay`]).

use super::replay::{self, ReplayItem};
use super::sequence::{SeqVerdict, SequenceTracker};
use super::{EventSink, IngestConfig, ListenerState};
use crate::metrics::{Labels, Metrics};
use bytes::Bytes;
use futures::StreamExt;
use kvroute_core::event::KvEvent;
use kvroute_wire::frames::{self, ReplayReply};
use kvroute_wire::{
    DropReason, EventBatch, RawEvent, WireError, convert_event, decode_batch, feeds_index,
};
use std::collections::{BTreeSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket, ZmqError};

/// `kv_messages` statuses.
pub(crate) mod status {
    pub const OK: &str = "ok";
    pub const MALFORMED: &str = "malformed";
    pub const DUPLICATE: &str = "duplicate";
    pub const REPLAYED: &str = "replayed";
    pub const STALE: &str = "stale";
}

/// `kv_sequence_gaps` outcomes: each gap is counted once, with what became of it.
pub(crate) mod gap {
    /// A replay delivered every missing message.
    pub const REPLAYED: &str = "replayed";
    /// No replay endpoint, or revealed by a malformed message (which never triggers a replay).
    pub const NOT_REPLAYED: &str = "not_replayed";
    /// The replay did not end within the timeout.
    pub const REPLAY_TIMEOUT: &str = "replay_timeout";
    /// The replay endpoint could not be reached or failed mid-way.
    pub const REPLAY_FAILED: &str = "replay_failed";
    /// The replay ended but the engine's buffer did not reach back far enough.
    pub const REPLAY_INCOMPLETE: &str = "replay_incomplete";
}

/// What one listener serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ListenerSpec {
    pub worker_id: u64,
    /// The rank the endpoint was registered for.
    pub dp_rank: u32,
    /// Every rank of the worker: a batch's own rank must be one of them.
    pub dp_ranks: Range<u32>,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
}

/// Where a message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// Read from the SUB socket and handled at once.
    Live,
    /// A replay reply.
    Replay,
    /// A live message buffered during a replay, handled after it.
    Drained,
}

/// What the live loop must do next.
enum Step {
    Continue,
    /// A gap: replay from `start` (the message that revealed it is buffered).
    ReplayFrom {
        address: String,
        start: u64,
    },
}

enum Exit {
    Stopped,
    Disconnected { received: bool },
}

#[derive(Debug)]
enum ReplayStatus {
    /// The end marker arrived.
    Completed,
    TimedOut,
    Failed(String),
}

struct ReplayReport {
    status: ReplayStatus,
    /// Replayed messages applied (not counting stale ones).
    applied: usize,
    /// Some missing messages were not delivered (the engine's buffer did not reach back, or the
    /// replay ended early).
    unrecovered: bool,
}

/// A message whose frames could not be used.
struct Malformed {
    /// Known when the frames were fine and only the payload was bad.
    seq: Option<u64>,
    error: WireError,
}

pub(crate) struct Listener {
    spec: ListenerSpec,
    sink: Arc<dyn EventSink>,
    metrics: Arc<Metrics>,
    config: IngestConfig,
    labels: Labels,
    tracker: SequenceTracker,
    /// Ranks this endpoint fed (its own plus batch overrides): an engine restart clears them.
    fed_ranks: BTreeSet<u32>,
    /// Live messages read during a replay, handled after it (bounded).
    buffered: VecDeque<Vec<Bytes>>,
    buffered_bytes: usize,
    /// Live messages dropped because the buffer was full during the current replay.
    overflowed: usize,
    /// Set while handling replayed or drained messages when one reveals a gap.
    unrecovered: bool,
    /// Malformed messages and out-of-range ranks are logged at warn once, then at debug.
    warned_malformed: bool,
    warned_rank: bool,
}

/// Resolves when the listener must stop: the manager said so or dropped its handle.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// Sleeps, or returns true early when the listener must stop.
async fn sleep_or_stop(duration: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        biased;
        () = stopped(stop) => true,
        () = tokio::time::sleep(duration) => false,
    }
}

type Monitor = futures::channel::mpsc::Receiver<SocketEvent>;

async fn connect_subscriber(
    endpoint: &str,
    connect_timeout: Duration,
) -> Result<(SubSocket, Monitor), ZmqError> {
    let mut options = SocketOptions::default();
    options.connect_timeout(connect_timeout);
    let mut sub = SubSocket::with_options(options);
    let monitor = sub.monitor();
    // Subscribe before connecting so that the subscription goes out with the handshake.
    sub.subscribe("").await?;
    sub.connect(endpoint).await?;
    Ok((sub, monitor))
}

fn frames_len(frames: &[Bytes]) -> usize {
    frames.iter().map(Bytes::len).sum()
}

/// Parses a live message: its sequence number, then its payload.
fn parse_live(frames: &[Bytes]) -> Result<(u64, EventBatch), Malformed> {
    let message =
        frames::parse_live_message(frames).map_err(|error| Malformed { seq: None, error })?;
    let batch = decode_batch(message.payload).map_err(|error| Malformed {
        seq: Some(message.seq),
        error,
    })?;
    Ok((message.seq, batch))
}

/// The `kv_events` type and block count of a raw event, for drop metrics.
fn kind_and_count(event: &RawEvent) -> (&'static str, u64) {
    match event {
        RawEvent::Stored(s) => ("stored", s.block_hashes.len().max(1) as u64),
        RawEvent::Removed(r) => ("removed", r.block_hashes.len().max(1) as u64),
        RawEvent::Cleared => ("cleared", 1),
        RawEvent::Unknown { .. } => ("unknown", 1),
    }
}

fn drop_status(reason: &DropReason) -> &'static str {
    match reason {
        DropReason::NotFullAttention { .. } => "not_full_attention",
        DropReason::UnknownMedium { .. } => "unknown_medium",
        DropReason::ZeroBlockSize => "zero_block_size",
        DropReason::BlockCountMismatch { .. } => "block_count_mismatch",
        DropReason::UnknownEventType { .. } => "unknown_event_type",
    }
}

impl Listener {
    pub(crate) fn new(
        spec: ListenerSpec,
        sink: Arc<dyn EventSink>,
        metrics: Arc<Metrics>,
        config: IngestConfig,
    ) -> Self {
        let labels = Metrics::endpoint_labels(spec.worker_id, spec.dp_rank, &spec.endpoint);
        let fed_ranks = BTreeSet::from([spec.dp_rank]);
        Self {
            spec,
            sink,
            metrics,
            config,
            labels,
            tracker: SequenceTracker::default(),
            fed_ranks,
            buffered: VecDeque::new(),
            buffered_bytes: 0,
            overflowed: 0,
            unrecovered: false,
            warned_malformed: false,
            warned_rank: false,
        }
    }

    /// Runs until `stop` turns true (or its sender is dropped).
    pub(crate) async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut backoff = self.config.initial_backoff;
        let mut failures = 0u32;
        loop {
            self.set_state(ListenerState::Connecting, &stop);
            let connected = tokio::select! {
                biased;
                () = stopped(&mut stop) => break,
                connected = connect_subscriber(&self.spec.endpoint, self.config.connect_timeout) => connected,
            };
            let (mut sub, mut monitor) = match connected {
                Ok(connected) => connected,
                Err(error) => {
                    failures += 1;
                    // At the 5 s cap this warns about once a minute.
                    if failures == 1 || failures.is_multiple_of(12) {
                        tracing::warn!(
                            worker_id = self.spec.worker_id,
                            endpoint = %self.spec.endpoint,
                            %error,
                            failures,
                            retry_in_ms = backoff.as_millis() as u64,
                            "cannot connect to KV-event endpoint"
                        );
                    } else {
                        tracing::debug!(endpoint = %self.spec.endpoint, %error, failures, "connect failed");
                    }
                    if sleep_or_stop(backoff, &mut stop).await {
                        break;
                    }
                    backoff = (backoff * 2).min(self.config.max_backoff);
                    continue;
                }
            };
            failures = 0;
            tracing::info!(
                worker_id = self.spec.worker_id,
                dp_rank = self.spec.dp_rank,
                endpoint = %self.spec.endpoint,
                "subscribed to KV events"
            );
            if let Some(address) = self.spec.replay_endpoint.clone() {
                let reconnect = self.tracker.has_position();
                let start = self.tracker.replay_start();
                let Some(report) = self.replay(&address, &mut sub, start, &mut stop).await else {
                    break;
                };
                self.count_connect_replay(&report, reconnect);
            }
            self.set_state(ListenerState::Live, &stop);
            let live_since = Instant::now();
            match self.live(&mut sub, &mut monitor, &mut stop).await {
                Exit::Stopped => break,
                Exit::Disconnected { received } => {
                    drop(sub);
                    // A connection that delivered a message, or stayed up a while (an idle
                    // engine has nothing to say), was healthy: reconnect from the first delay.
                    // One dropped at once by its peer keeps backing off.
                    if received || live_since.elapsed() >= self.config.healthy_connection {
                        backoff = self.config.initial_backoff;
                    }
                    tracing::warn!(
                        worker_id = self.spec.worker_id,
                        endpoint = %self.spec.endpoint,
                        retry_in_ms = backoff.as_millis() as u64,
                        "KV-event endpoint disconnected; reconnecting"
                    );
                    self.set_state(ListenerState::Connecting, &stop);
                    if sleep_or_stop(backoff, &mut stop).await {
                        break;
                    }
                    backoff = (backoff * 2).min(self.config.max_backoff);
                }
            }
        }
        tracing::debug!(
            worker_id = self.spec.worker_id,
            endpoint = %self.spec.endpoint,
            "KV-event listener stopped"
        );
    }

    /// Reads live messages until the peer goes away or the listener must stop.
    async fn live(
        &mut self,
        sub: &mut SubSocket,
        monitor: &mut Monitor,
        stop: &mut watch::Receiver<bool>,
    ) -> Exit {
        let mut received = false;
        loop {
            let frames = tokio::select! {
                biased;
                () = stopped(stop) => return Exit::Stopped,
                event = monitor.next() => match event {
                    Some(SocketEvent::Disconnected(_)) | None => return Exit::Disconnected { received },
                    Some(_) => continue,
                },
                message = sub.recv() => match message {
                    Ok(message) => message.into_vec(),
                    Err(error) => {
                        tracing::debug!(endpoint = %self.spec.endpoint, %error, "SUB receive failed");
                        return Exit::Disconnected { received };
                    }
                },
            };
            received = true;
            let step = self.handle_live(frames);
            // Decoding a storm's messages back to back must not keep a request thread that
            // waits for this core off it until the next timer tick.
            crate::courtesy::after_work(crate::courtesy::STRETCH);
            if let Step::ReplayFrom { address, start } = step {
                let Some(report) = self.replay(&address, sub, start, stop).await else {
                    return Exit::Stopped;
                };
                self.count_gap(gap_outcome(&report));
                self.set_state(ListenerState::Live, stop);
            }
        }
    }

    /// Replays from `start` while buffering live messages, then handles the buffered ones.
    /// `None` when the listener must stop.
    async fn replay(
        &mut self,
        address: &str,
        sub: &mut SubSocket,
        start: u64,
        stop: &mut watch::Receiver<bool>,
    ) -> Option<ReplayReport> {
        self.set_state(ListenerState::Replaying, stop);
        tracing::debug!(endpoint = %self.spec.endpoint, replay = %address, start, "replaying");
        let deadline = Instant::now() + self.config.replay_timeout;
        let mut conversation =
            replay::start(address.to_string(), start, self.config.replay_timeout);
        self.unrecovered = false;
        self.overflowed = 0;
        let mut replies = 0usize;
        let mut applied = 0usize;
        let mut sub_open = true;
        let status = loop {
            tokio::select! {
                biased;
                () = stopped(stop) => return None,
                () = tokio::time::sleep_until(deadline) => break ReplayStatus::TimedOut,
                item = conversation.replies.recv() => match item {
                    None => break ReplayStatus::Failed("replay task ended".to_string()),
                    Some(ReplayItem::Failed(reason)) => break ReplayStatus::Failed(reason),
                    Some(ReplayItem::Reply(reply)) => {
                        match frames::parse_replay_reply(&reply) {
                            Ok(ReplayReply::End) => break ReplayStatus::Completed,
                            Ok(ReplayReply::Batch { seq, payload, .. }) => {
                                let batch = decode_batch(payload);
                                if self.handle(Source::Replay, seq, batch) {
                                    applied += 1;
                                }
                            }
                            Err(error) => self.malformed(Source::Replay, None, &error),
                        }
                        replies += 1;
                        if replies >= self.config.max_replay_messages {
                            break ReplayStatus::Failed(format!(
                                "more than {} replies without an end marker",
                                self.config.max_replay_messages
                            ));
                        }
                    }
                },
                message = sub.recv(), if sub_open => match message {
                    Ok(message) => self.buffer(message.into_vec(), false),
                    // The live loop notices the disconnect through the monitor.
                    Err(_) => sub_open = false,
                },
            }
        };
        drop(conversation);
        match &status {
            ReplayStatus::Completed => {
                // Nothing buffered past `start`: the stream continues there.
                self.tracker.expect_from(start);
            }
            ReplayStatus::TimedOut => tracing::warn!(
                worker_id = self.spec.worker_id,
                endpoint = %self.spec.endpoint,
                timeout_ms = self.config.replay_timeout.as_millis() as u64,
                "KV-event replay did not end in time"
            ),
            ReplayStatus::Failed(reason) => tracing::warn!(
                worker_id = self.spec.worker_id,
                endpoint = %self.spec.endpoint,
                %reason,
                "KV-event replay failed"
            ),
        }
        if self.overflowed > 0 {
            tracing::warn!(
                worker_id = self.spec.worker_id,
                endpoint = %self.spec.endpoint,
                dropped = self.overflowed,
                "live buffer full during replay; the dropped messages will show as a gap"
            );
        }
        while let Some(frames) = self.buffered.pop_front() {
            self.buffered_bytes = self.buffered_bytes.saturating_sub(frames_len(&frames));
            match parse_live(&frames) {
                Ok((seq, batch)) => {
                    self.handle(Source::Drained, seq, Ok(batch));
                }
                Err(Malformed { seq, error }) => self.malformed(Source::Drained, seq, &error),
            }
        }
        self.buffered_bytes = 0;
        Some(ReplayReport {
            status,
            applied,
            unrecovered: self.unrecovered,
        })
    }

    /// Keeps a live message for after the replay, dropping it when the buffer is full (the loss
    /// then shows as a gap on the next message). `always`: the message that started the replay,
    /// kept whatever its size.
    fn buffer(&mut self, frames: Vec<Bytes>, always: bool) {
        let len = frames_len(&frames);
        if !always
            && (self.buffered.len() >= self.config.max_buffered_messages
                || self.buffered_bytes + len > self.config.max_buffered_bytes)
        {
            self.overflowed += 1;
            return;
        }
        self.buffered_bytes += len;
        self.buffered.push_back(frames);
    }

    /// Handles one message read from the SUB socket outside a replay.
    fn handle_live(&mut self, frames: Vec<Bytes>) -> Step {
        let (seq, batch) = match parse_live(&frames) {
            Ok(parsed) => parsed,
            Err(Malformed { seq, error }) => {
                self.malformed(Source::Live, seq, &error);
                return Step::Continue;
            }
        };
        if let Some(address) = self.spec.replay_endpoint.clone()
            && let SeqVerdict::Gap { first_missing, .. } = self.verdict_after_restart(seq)
        {
            // Handled again after the replay, which decides whether the gap closed.
            self.buffer(frames, true);
            return Step::ReplayFrom {
                address,
                start: first_missing,
            };
        }
        self.handle(Source::Live, seq, Ok(batch));
        Step::Continue
    }

    /// Classifies a live sequence number, first handling an engine restart (seq went back).
    fn verdict_after_restart(&mut self, seq: u64) -> SeqVerdict {
        let verdict = self.tracker.classify(seq);
        if verdict != SeqVerdict::Behind {
            return verdict;
        }
        tracing::warn!(
            worker_id = self.spec.worker_id,
            endpoint = %self.spec.endpoint,
            seq,
            expected = self.tracker.replay_start(),
            "KV-event sequence went back: engine restarted; clearing its ranks"
        );
        self.metrics.kv_restarts.get_or_create(&self.labels).inc();
        let ranks = std::mem::replace(&mut self.fed_ranks, BTreeSet::from([self.spec.dp_rank]));
        for rank in ranks {
            self.sink
                .apply(self.spec.worker_id, rank, vec![KvEvent::Cleared]);
        }
        self.tracker.restart();
        self.tracker.classify(seq)
    }

    /// Handles one parsed message by its sequence number. Returns true when it was applied.
    fn handle(&mut self, source: Source, seq: u64, batch: Result<EventBatch, WireError>) -> bool {
        let batch = match batch {
            Ok(batch) => batch,
            Err(error) => {
                self.malformed(source, Some(seq), &error);
                return false;
            }
        };
        let verdict = match source {
            Source::Live => self.verdict_after_restart(seq),
            Source::Replay | Source::Drained => self.tracker.classify(seq),
        };
        match verdict {
            SeqVerdict::InOrder => {}
            SeqVerdict::Gap {
                first_missing,
                missed,
            } => match source {
                Source::Live => {
                    tracing::warn!(
                        worker_id = self.spec.worker_id,
                        endpoint = %self.spec.endpoint,
                        first_missing,
                        missed,
                        "KV-event gap and no replay endpoint: events lost"
                    );
                    self.count_gap(gap::NOT_REPLAYED);
                }
                Source::Replay | Source::Drained => self.unrecovered = true,
            },
            SeqVerdict::Duplicate if source == Source::Live => {
                self.count_message(status::DUPLICATE);
                return false;
            }
            SeqVerdict::Duplicate | SeqVerdict::Behind => {
                self.count_message(status::STALE);
                return false;
            }
        }
        self.tracker.record(seq);
        self.apply(&batch);
        self.count_message(if source == Source::Replay {
            status::REPLAYED
        } else {
            status::OK
        });
        true
    }

    /// Counts a malformed message. Its sequence number, when known and ahead, still counts as
    /// received; it never triggers a replay or a restart.
    fn malformed(&mut self, source: Source, seq: Option<u64>, error: &WireError) {
        self.count_message(status::MALFORMED);
        if self.warned_malformed {
            tracing::debug!(endpoint = %self.spec.endpoint, ?seq, %error, "malformed KV-event message");
        } else {
            self.warned_malformed = true;
            tracing::warn!(
                worker_id = self.spec.worker_id,
                endpoint = %self.spec.endpoint,
                ?seq,
                %error,
                "malformed KV-event message dropped (further ones are logged at debug)"
            );
        }
        let Some(seq) = seq else { return };
        match self.tracker.classify(seq) {
            SeqVerdict::InOrder => self.tracker.record(seq),
            SeqVerdict::Gap { .. } => {
                match source {
                    Source::Live => self.count_gap(gap::NOT_REPLAYED),
                    Source::Replay | Source::Drained => self.unrecovered = true,
                }
                self.tracker.record(seq);
            }
            SeqVerdict::Duplicate | SeqVerdict::Behind => {}
        }
    }

    /// Converts a batch's events and hands them to the sink under the batch's rank.
    fn apply(&mut self, batch: &EventBatch) {
        // For `crate::degraded`: the worker's events arrive, with blocks of this size (which
        // must be its registered one, or no prompt hashed at that size can match them).
        let degraded = &self.metrics.degraded;
        degraded.events_arrived(self.spec.worker_id);
        let stored_size = batch.events.iter().find_map(|raw| match raw {
            RawEvent::Stored(s) if feeds_index(s.kv_cache_spec_kind.as_deref(), s.group_idx) => {
                Some(s.block_size)
            }
            _ => None,
        });
        if let Some(size) = stored_size {
            degraded.block_size_seen(self.spec.worker_id, size, &self.spec.endpoint);
        }
        let mut events = Vec::with_capacity(batch.events.len());
        for raw in &batch.events {
            match convert_event(raw) {
                Ok(event) => events.push(event),
                Err(reason) => {
                    let (kind, count) = kind_and_count(raw);
                    self.metrics
                        .count_dropped_events(kind, drop_status(&reason), count);
                }
            }
        }
        let rank = batch.data_parallel_rank.unwrap_or(self.spec.dp_rank);
        if !self.spec.dp_ranks.contains(&rank) {
            self.metrics
                .count_dropped_events("any", "rank_out_of_range", events.len() as u64);
            if !self.warned_rank {
                self.warned_rank = true;
                tracing::warn!(
                    worker_id = self.spec.worker_id,
                    endpoint = %self.spec.endpoint,
                    rank,
                    ranks = ?self.spec.dp_ranks,
                    "KV-event batch names a rank outside the worker's ranks; dropped"
                );
            }
            return;
        }
        self.fed_ranks.insert(rank);
        if events.is_empty() {
            return;
        }
        if !self.sink.apply(self.spec.worker_id, rank, events) {
            tracing::debug!(
                worker_id = self.spec.worker_id,
                "KV events refused by the sink (shutting down, or an unknown worker)"
            );
        }
    }

    fn count_message(&self, status: &str) {
        let mut labels = self.labels.clone();
        labels.push(("status".to_string(), status.to_string()));
        self.metrics.kv_messages.get_or_create(&labels).inc();
    }

    fn count_gap(&self, outcome: &str) {
        let mut labels = self.labels.clone();
        labels.push(("outcome".to_string(), outcome.to_string()));
        self.metrics.kv_gaps.get_or_create(&labels).inc();
    }

    /// Counts what a replay on (re)connect found: a gap closed only when it delivered something
    /// after messages had been seen; a failed replay is a possible gap either way.
    fn count_connect_replay(&self, report: &ReplayReport, reconnect: bool) {
        match report.status {
            ReplayStatus::Completed if report.unrecovered => self.count_gap(gap::REPLAY_INCOMPLETE),
            ReplayStatus::Completed if reconnect && report.applied > 0 => {
                self.count_gap(gap::REPLAYED)
            }
            ReplayStatus::Completed => {}
            ReplayStatus::TimedOut | ReplayStatus::Failed(_) => self.count_gap(gap_outcome(report)),
        }
    }

    fn set_state(&self, state: ListenerState, stop: &watch::Receiver<bool>) {
        // A stopped listener leaves the gauge to the manager (and to its successor).
        if !*stop.borrow() {
            self.metrics
                .kv_listener_state
                .get_or_create(&self.labels)
                .set(state as i64);
        }
    }
}

/// What became of a gap a replay was started for.
fn gap_outcome(report: &ReplayReport) -> &'static str {
    match report.status {
        ReplayStatus::TimedOut => gap::REPLAY_TIMEOUT,
        ReplayStatus::Failed(_) => gap::REPLAY_FAILED,
        ReplayStatus::Completed if report.unrecovered => gap::REPLAY_INCOMPLETE,
        ReplayStatus::Completed => gap::REPLAYED,
    }
}
