//! Live KV-event ingest from engines (SPEC §3.1).
//!
//! Every KV-event endpoint of every schedulable worker gets one tokio task (`listener.rs`) with a
//! ZeroMQ SUB socket connected to the engine's PUB socket, subscribed to all topics. Each live
//! message `[topic, seq, payload]` is decoded with `kvroute-wire` and its events are handed to
//! the [`EventSink`] (the selector) under the batch's `data_parallel_rank` when it has one (a
//! rank the worker does not have drops the batch, counted), else under the rank the endpoint
//! was registered for.
//!
//! ## The listener's state machine
//!
//! ```text
//!             ┌──────────── backoff 100 ms × 2 … 5 s ◀─────────────┐
//!             ▼                                                     │ connect failed /
//!       CONNECTING ──connected──▶ [REPLAYING from last+1] ──▶ LIVE ─┘ peer disconnected
//!                                                   ▲           │
//!                                                   └── gap ────┘  (with a replay endpoint)
//!       any state ──worker deleted / unschedulable / shutdown──▶ STOPPED
//! ```
//! (`kv_listener_state`: 0 connecting, 1 live, 2 replaying, 3 stopped.) One connect attempt
//! lasts up to [`IngestConfig::connect_timeout`] (ZMQ retries a refused connection within it);
//! the backoff resets once a connection delivered a message or stayed up for
//! [`IngestConfig::healthy_connection`] (1 s: an idle engine's connection is healthy too).
//!
//! Sequence numbers are tracked per endpoint ([`sequence`]); a live message with seq `s`,
//! against `next` = last received + 1:
//! - `s == next` (or nothing expected yet): applied (`kv_messages{status="ok"}`).
//! - `s == next - 1`: a duplicate, dropped (`duplicate`).
//! - `s < next - 1`: the engine restarted. Every rank this endpoint fed gets
//!   [`KvEvent::Cleared`], `kv_engine_restarts` counts it, numbering starts over at 0 and the
//!   message is classified again (so a restarted engine whose first messages were lost is a gap).
//! - `s > next`: a gap. With a `replay_endpoint`, the listener connects a DEALER to it, sends
//!   `[b"", next]` and applies the replies (`[b"", seq, payload]` or `[b"", topic, seq,
//!   payload]`, `replayed`) until the end marker (seq `-1`), skipping those it already has
//!   (`stale`). Meanwhile it keeps reading the SUB socket into a bounded buffer, handled after
//!   the replay: messages the replay covered are dropped (`stale`). Without a replay endpoint
//!   the gap is logged and the message applied.
//! - On every (re)connect with a replay endpoint the listener first replays from `next` (0 when
//!   nothing was seen), which also covers messages published before the subscription took effect.
//!
//! Each gap is counted once in `kv_sequence_gaps`, labelled with what became of it: `replayed`,
//! `not_replayed` (no replay endpoint), `replay_timeout` (no end marker within
//! [`IngestConfig::replay_timeout`]), `replay_failed` (endpoint unreachable or failing) or
//! `replay_incomplete` (the engine's buffer did not reach back far enough). A replay on
//! reconnect counts as a `replayed` gap when it delivered something, and a failed one as a
//! possible gap.
//!
//! A malformed message (bad frames or an undecodable payload) is counted (`malformed`) and
//! dropped; when its seq is readable and ahead it still counts as received, so it never triggers
//! a replay — nor a restart, since a garbage seq cannot be trusted with clearing a rank. Events
//! the wire conversion drops (non-full-attention groups, unknown media, block-count mismatches,
//! unknown types) and batches naming a rank the worker does not have are counted in `kv_events`
//! by reason. Nothing a peer sends stops a listener.
//!
//! ## Bounds
//! The live buffer during a replay holds at most [`IngestConfig::max_buffered_messages`] and
//! [`IngestConfig::max_buffered_bytes`]; beyond that new messages are dropped and show up as the
//! next gap. A replay reads at most [`IngestConfig::max_replay_messages`] replies within
//! [`IngestConfig::replay_timeout`]. Replies wait in a channel of fixed capacity.
//!
//! ## Lifecycle
//! [`IngestManager::sync_worker`] runs after every catalog change: it starts listeners for a
//! schedulable worker's endpoints, restarts them when its endpoints, ranks or lifecycle changed,
//! leaves running ones alone otherwise, and stops them when the worker is not schedulable.
//! Stopping is a watch channel each task selects on; a task ends at its next await point.

mod listener;
mod replay;
pub mod sequence;

use crate::metrics::Metrics;
use bytes::Bytes;
use kvroute_core::event::KvEvent;
use kvroute_core::selector::{Lifecycle, WorkerRecord};
use listener::{Listener, ListenerSpec};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::watch;
use zeromq::ZmqMessage;

/// Where decoded events go.
pub trait EventSink: Send + Sync + 'static {
    /// Applies (or queues for applying) decoded events of one rank. Returns false when the sink
    /// refuses them: it is shutting down or, for a sink that applies at once, the worker is
    /// unknown. A queueing sink finds an unknown worker only when it applies the events, and
    /// counts them as dropped (`unknown_worker`) then.
    fn apply(&self, worker_id: u64, dp_rank: u32, events: Vec<KvEvent>) -> bool;
}

/// The values of the `kv_listener_state` gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i64)]
pub enum ListenerState {
    Connecting = 0,
    Live = 1,
    Replaying = 2,
    Stopped = 3,
}

/// Timing and bounds of the listeners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IngestConfig {
    /// First reconnect delay; doubles per failed attempt up to `max_backoff`.
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// A connection that stayed up this long counts as healthy even if it delivered nothing:
    /// when it drops, reconnecting starts again from `initial_backoff`.
    pub healthy_connection: Duration,
    /// How long one connect attempt may take (ZMQ retries a refused connection within it).
    pub connect_timeout: Duration,
    /// A replay without an end marker by then is abandoned and counted.
    pub replay_timeout: Duration,
    /// Replies one replay may deliver.
    pub max_replay_messages: usize,
    /// Live messages kept during a replay.
    pub max_buffered_messages: usize,
    /// Bytes of live messages kept during a replay.
    pub max_buffered_bytes: usize,
    /// Run the listeners on a thread of their own at this niceness (0–19) instead of the
    /// caller's runtime: decoding and applying events then never queues behind, or ahead of,
    /// request handling, and above 0 the OS gives requests the CPU first.
    pub dedicated_thread_nice: Option<u8>,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            healthy_connection: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
            replay_timeout: Duration::from_secs(5),
            // vLLM keeps 10,000 batches for replay by default.
            max_replay_messages: 100_000,
            max_buffered_messages: 10_000,
            max_buffered_bytes: 64 << 20,
            dedicated_thread_nice: None,
        }
    }
}

/// Frames as a ZMQ message (`None` for no frames).
pub(crate) fn zmq_message(frames: Vec<Vec<u8>>) -> Option<ZmqMessage> {
    ZmqMessage::try_from(frames.into_iter().map(Bytes::from).collect::<Vec<_>>()).ok()
}

/// The running listeners of one worker and what they were started for.
struct WorkerListeners {
    specs: Vec<ListenerSpec>,
    stop: watch::Sender<bool>,
}

/// Starts and stops the listeners as workers come and go.
pub struct IngestManager {
    sink: Arc<dyn EventSink>,
    metrics: Arc<Metrics>,
    config: IngestConfig,
    workers: Mutex<HashMap<u64, WorkerListeners>>,
    /// Tasks started and not yet finished.
    running: Arc<AtomicUsize>,
    shut_down: AtomicBool,
    /// The listeners' own runtime (one thread), when configured.
    runtime: Option<tokio::runtime::Runtime>,
}

/// Sets the calling thread's niceness to `nice` (0–19; 0 leaves it alone).
pub fn lower_current_thread_priority(nice: u8) -> Result<(), String> {
    if nice == 0 {
        return Ok(());
    }
    // Linux maps priorities 0..=99 of normal threads linearly onto niceness 19..=-20.
    let value = ((19 - i32::from(nice.min(19))) * 99 / 39).clamp(0, 99) as u8;
    let value = thread_priority::ThreadPriorityValue::try_from(value).map_err(|e| e.to_string())?;
    thread_priority::set_current_thread_priority(thread_priority::ThreadPriority::Crossplatform(
        value,
    ))
    .map_err(|e| format!("{e:?}"))
}

/// Moves the calling thread to Linux's `SCHED_IDLE` class: it gets a core only when no normal
/// thread wants one, and a normal thread that wakes takes the core from it at once. (Elsewhere an
/// error.)
pub fn idle_current_thread() -> Result<(), String> {
    #[cfg(target_os = "linux")]
    {
        use thread_priority::unix::{
            NormalThreadSchedulePolicy, ThreadSchedulePolicy, set_thread_priority_and_policy,
            thread_native_id,
        };
        set_thread_priority_and_policy(
            thread_native_id(),
            thread_priority::ThreadPriority::Min,
            ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle),
        )
        .map_err(|e| format!("{e:?}"))
    }
    #[cfg(not(target_os = "linux"))]
    {
        Err("SCHED_IDLE exists only on Linux".to_string())
    }
}

/// The listeners' runtime: one worker thread, lowered to `nice` when above 0.
fn ingest_runtime(nice: u8) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(2)
        .thread_name("kvroute-ingest")
        .enable_all()
        .on_thread_unpark(crate::courtesy::woke)
        .on_thread_start(move || {
            if let Err(error) = lower_current_thread_priority(nice) {
                tracing::warn!(nice, %error, "could not lower the ingest thread's priority");
            }
        })
        .build()
}

/// Decrements the running-listener count when a task ends (or is dropped unstarted).
struct RunningGuard(Arc<AtomicUsize>);

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl IngestManager {
    pub fn new(sink: Arc<dyn EventSink>, metrics: Arc<Metrics>) -> Self {
        Self::with_config(sink, metrics, IngestConfig::default())
    }

    pub fn with_config(
        sink: Arc<dyn EventSink>,
        metrics: Arc<Metrics>,
        config: IngestConfig,
    ) -> Self {
        let runtime = config
            .dedicated_thread_nice
            .and_then(|nice| match ingest_runtime(nice) {
                Ok(runtime) => Some(runtime),
                Err(error) => {
                    tracing::warn!(%error, "no ingest thread; listeners share the caller's runtime");
                    None
                }
            });
        Self {
            sink,
            metrics,
            config,
            workers: Mutex::new(HashMap::new()),
            running: Arc::new(AtomicUsize::new(0)),
            shut_down: AtomicBool::new(false),
            runtime,
        }
    }

    /// Where the listeners hand their decoded events (for benches and tests that feed events
    /// without a ZMQ socket).
    pub fn sink(&self) -> Arc<dyn EventSink> {
        Arc::clone(&self.sink)
    }

    /// Brings a worker's listeners in line with its record, after an upsert or patch. `restart`:
    /// its endpoints, ranks or lifecycle changed. Must be called from inside a tokio runtime;
    /// outside one, listeners cannot start and a warning is logged.
    pub fn sync_worker(&self, record: &WorkerRecord, restart: bool) {
        let worker_id = record.spec.worker_id;
        let specs = if record.lifecycle == Lifecycle::Schedulable {
            listener_specs(record)
        } else {
            Vec::new()
        };
        let mut workers = self.workers.lock();
        if specs.is_empty() || self.shut_down.load(Ordering::SeqCst) {
            if let Some(old) = workers.remove(&worker_id) {
                self.stop(old);
            }
            return;
        }
        if !restart && workers.get(&worker_id).is_some_and(|w| w.specs == specs) {
            return;
        }
        let handle = match &self.runtime {
            Some(runtime) => Ok(runtime.handle().clone()),
            None => tokio::runtime::Handle::try_current(),
        };
        let Ok(runtime) = handle else {
            tracing::warn!(
                worker_id,
                "KV-event listeners not started: no async runtime on this thread"
            );
            return;
        };
        if let Some(old) = workers.remove(&worker_id) {
            self.stop(old);
        }
        let (stop, stop_rx) = watch::channel(false);
        for spec in &specs {
            let listener = Listener::new(
                spec.clone(),
                Arc::clone(&self.sink),
                Arc::clone(&self.metrics),
                self.config,
            );
            self.running.fetch_add(1, Ordering::SeqCst);
            let guard = RunningGuard(Arc::clone(&self.running));
            let stop_rx = stop_rx.clone();
            runtime.spawn(async move {
                let _guard = guard;
                listener.run(stop_rx).await;
            });
        }
        workers.insert(worker_id, WorkerListeners { specs, stop });
    }

    /// Stops a deleted worker's listeners.
    pub fn remove_worker(&self, worker_id: u64) {
        let removed = self.workers.lock().remove(&worker_id);
        if let Some(old) = removed {
            self.stop(old);
        }
    }

    /// Stops every listener; later [`sync_worker`](Self::sync_worker) calls start none.
    pub fn shutdown(&self) {
        self.shut_down.store(true, Ordering::SeqCst);
        let all: Vec<_> = self.workers.lock().drain().map(|(_, w)| w).collect();
        for old in all {
            self.stop(old);
        }
    }

    /// Listener tasks running (a stopped one counts until it has finished).
    pub fn active_listeners(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    fn stop(&self, listeners: WorkerListeners) {
        // Receivers see the change even when the sender is dropped right after.
        let _ = listeners.stop.send(true);
        for spec in &listeners.specs {
            let labels = Metrics::endpoint_labels(spec.worker_id, spec.dp_rank, &spec.endpoint);
            self.metrics
                .kv_listener_state
                .get_or_create(&labels)
                .set(ListenerState::Stopped as i64);
        }
    }
}

impl Drop for IngestManager {
    fn drop(&mut self) {
        for (_, listeners) in self.workers.get_mut().drain() {
            let _ = listeners.stop.send(true);
        }
        // Dropping a runtime blocks, which async code must not do; this does not.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

fn listener_specs(record: &WorkerRecord) -> Vec<ListenerSpec> {
    let replay_endpoint = record
        .spec
        .replay_endpoint
        .clone()
        .filter(|address| !address.is_empty());
    record
        .spec
        .event_endpoints()
        .into_iter()
        .map(|(dp_rank, endpoint)| ListenerSpec {
            worker_id: record.spec.worker_id,
            dp_rank,
            dp_ranks: record.spec.dp_ranks(),
            endpoint,
            replay_endpoint: replay_endpoint.clone(),
        })
        .collect()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use thread_priority::unix::{
        NormalThreadSchedulePolicy, ThreadSchedulePolicy, thread_schedule_policy,
    };

    #[test]
    fn idle_moves_only_the_calling_thread_to_sched_idle() {
        let before = thread_schedule_policy().expect("policy readable");
        let policy = std::thread::spawn(|| {
            idle_current_thread().expect("any thread may lower itself to SCHED_IDLE");
            thread_schedule_policy().expect("policy readable")
        })
        .join()
        .expect("thread ran");
        assert_eq!(
            policy,
            ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle)
        );
        assert_eq!(thread_schedule_policy().expect("policy readable"), before);
    }
}
