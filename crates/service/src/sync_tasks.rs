//! The NATS tasks of replica sync (cargo feature `nats`): connection, publisher, watchers (see
//! the module docs of [`crate::sync`], which holds the hooks these tasks serve). Every loop ends
//! when its task is aborted ([`SyncTasks`] is dropped) and every wait on NATS is bounded by a
//! timeout.
//!
//! This module sits above [`crate::state`] (it drives the whole [`AppState`]); `sync` sits below
//! it, so the state can hold the hooks without a loop between the two.

use crate::metrics::SyncMetrics;
use crate::state::AppState;
use crate::sync::codec::{
    self, BookingMessage, CatalogMessage, EventMessage, EventsMessage, Origin, VERSION,
};
use crate::sync::{SyncOp, SyncShared};
use crate::types::{WorkerBody, worker_json};
use async_nats::jetstream::{self, consumer, kv, stream};
use bytes::Bytes;
use futures::StreamExt;
use kvroute_core::selector::{BookingOwner, SyncApplyError, SyncedBooking};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

/// How long one NATS request (put, consumer creation, stream info) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on the whole start-up catch-up (catalog, bookings, events).
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(30);
/// While catching up, this long without a message means there is nothing more to catch up.
const CATCH_UP_IDLE: Duration = Duration::from_millis(500);
/// Pause before retrying a watch or consumer that could not be created.
const RETRY_PAUSE: Duration = Duration::from_millis(500);
/// Changes published per batch, and writes in flight.
const MAX_BATCH: usize = 1024;
const MAX_IN_FLIGHT: usize = 64;

/// The running sync tasks of one replica; dropping it stops them (a "killed" replica in tests).
pub struct SyncTasks {
    tasks: Vec<JoinHandle<()>>,
    /// The NATS connection (dropped with the tasks).
    _client: async_nats::Client,
    /// How long the start-up catch-up took.
    pub catch_up: Duration,
}

impl Drop for SyncTasks {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// What every task needs.
struct Ctx {
    state: Arc<AppState>,
    shared: Arc<SyncShared>,
    js: jetstream::Context,
    bookings_bucket: String,
    catalog_bucket: String,
    events_stream: String,
    events_subjects: String,
    /// Bumped on every reconnect: watchers restart, the publisher does a full reconciliation.
    generation: watch::Receiver<u64>,
}

impl Ctx {
    fn replica(&self) -> &str {
        &self.shared.replica_id
    }

    fn metrics(&self) -> &SyncMetrics {
        &self.shared.metrics.sync
    }

    fn booking_max_age(&self) -> Duration {
        Duration::from_secs_f64(self.state.config.active_request_expiry_secs)
    }

    /// The bookings bucket, created when missing (first replica, or a server that lost its data).
    async fn bookings(&self) -> Result<kv::Store, String> {
        ensure_kv(&self.js, &self.bookings_bucket, self.booking_max_age()).await
    }

    async fn catalog(&self) -> Result<kv::Store, String> {
        ensure_kv(&self.js, &self.catalog_bucket, Duration::ZERO).await
    }

    async fn events(&self) -> Result<stream::Stream, String> {
        let config = &self.shared.config;
        let request = self.js.get_or_create_stream(stream::Config {
            name: self.events_stream.clone(),
            subjects: vec![self.events_subjects.clone()],
            max_age: Duration::from_secs_f64(config.nats_events_max_age_secs),
            max_bytes: config.nats_events_max_bytes,
            discard: stream::DiscardPolicy::Old,
            storage: stream::StorageType::File,
            ..Default::default()
        });
        match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(format!("stream {}: {e}", self.events_stream)),
            Err(_) => Err(format!("stream {}: timed out", self.events_stream)),
        }
    }

    /// Messages in a bucket's stream (0 when it cannot be read: then nothing is awaited).
    async fn bucket_messages(&self, bucket: &str) -> u64 {
        let info = async {
            let stream = self.js.get_stream(format!("KV_{bucket}")).await.ok()?;
            stream.get_info().await.ok()
        };
        match tokio::time::timeout(REQUEST_TIMEOUT, info).await {
            Ok(Some(info)) => info.state.messages,
            _ => 0,
        }
    }

    /// Waits for the next reconnect; false when the connection is gone for good.
    async fn reconnected(generation: &mut watch::Receiver<u64>) -> bool {
        generation.changed().await.is_ok()
    }
}

async fn ensure_kv(
    js: &jetstream::Context,
    bucket: &str,
    max_age: Duration,
) -> Result<kv::Store, String> {
    let attempt = async {
        if let Ok(store) = js.get_key_value(bucket).await {
            return Ok(store);
        }
        // The stream a KV bucket is, created directly: the client's `create_key_value` first
        // queries the account, whose reply NATS 2.9 (Debian 12) shapes differently.
        let created = js
            .get_or_create_stream(stream::Config {
                name: format!("KV_{bucket}"),
                subjects: vec![format!("$KV.{bucket}.>")],
                max_messages_per_subject: 1,
                max_age,
                storage: stream::StorageType::File,
                allow_rollup: true,
                deny_delete: true,
                allow_direct: true,
                discard: stream::DiscardPolicy::New,
                num_replicas: 1,
                ..Default::default()
            })
            .await;
        match created {
            Ok(_) => js
                .get_key_value(bucket)
                .await
                .map_err(|e| format!("bucket {bucket}: {e}")),
            Err(e) => Err(format!("bucket {bucket}: {e}")),
        }
    };
    tokio::time::timeout(REQUEST_TIMEOUT, attempt)
        .await
        .map_err(|_| format!("bucket {bucket}: timed out"))?
}

/// Connects to NATS, catches up (catalog, bookings, events) and starts the sync tasks. `None`
/// without `--nats-url`. Fails when the server cannot be reached or has no JetStream.
pub async fn start(state: &Arc<AppState>) -> Result<Option<SyncTasks>, String> {
    let Some(shared) = state.sync.shared().cloned() else {
        return Ok(None);
    };
    let started = Instant::now();
    let Some(rx) = shared.rx.lock().take() else {
        return Err("replica sync is already running".to_string());
    };
    let Some(url) = shared.config.nats_url.clone() else {
        return Ok(None);
    };
    let (generation_tx, generation) = watch::channel(0u64);
    let metrics = Arc::clone(&shared.metrics);
    let was_disconnected = Arc::new(AtomicBool::new(false));
    let options = async_nats::ConnectOptions::new()
        .name(format!("kvroute-{}", shared.replica_id))
        .connection_timeout(Duration::from_secs(2))
        .max_reconnects(None)
        .reconnect_delay_callback(|attempts| {
            let exponent = u32::try_from(attempts.min(5)).unwrap_or(5);
            Duration::from_millis(100 * 2u64.pow(exponent)).min(Duration::from_secs(2))
        })
        .event_callback(move |event| {
            let metrics = Arc::clone(&metrics);
            let was_disconnected = Arc::clone(&was_disconnected);
            let generation_tx = generation_tx.clone();
            async move {
                match event {
                    async_nats::Event::Connected => {
                        metrics.sync.set_connected(true);
                        if was_disconnected.swap(false, Ordering::SeqCst) {
                            tracing::info!("reconnected to NATS");
                            metrics.sync.reconnected();
                            generation_tx.send_modify(|g| *g += 1);
                        }
                    }
                    async_nats::Event::Disconnected => {
                        tracing::warn!("disconnected from NATS; reconnecting");
                        metrics.sync.set_connected(false);
                        was_disconnected.store(true, Ordering::SeqCst);
                    }
                    other => tracing::debug!(event = %other, "NATS event"),
                }
            }
        });
    let client = tokio::time::timeout(Duration::from_secs(10), options.connect(url.as_str()))
        .await
        .map_err(|_| format!("--nats-url {url}: connection timed out"))?
        .map_err(|e| format!("--nats-url {url}: {e}"))?;
    shared.metrics.sync.set_connected(true);
    let mut js = jetstream::new(client.clone());
    js.set_timeout(REQUEST_TIMEOUT);
    let prefix = shared.config.nats_prefix.clone();
    let ctx = Arc::new(Ctx {
        state: Arc::clone(state),
        shared: Arc::clone(&shared),
        js,
        bookings_bucket: format!("{prefix}_bookings"),
        catalog_bucket: format!("{prefix}_workers"),
        events_stream: format!("{prefix}_events"),
        events_subjects: format!("{prefix}.events.>"),
        generation,
    });
    // Fail early, with the reason, when JetStream is not there.
    ctx.catalog().await?;
    ctx.bookings().await?;
    if shared.config.nats_relay_events {
        ctx.events().await?;
    }

    let deadline = tokio::time::Instant::now() + CATCH_UP_TIMEOUT;
    let mut tasks = Vec::new();
    let (ready_tx, ready_rx) = oneshot::channel();
    tasks.push(tokio::spawn(watch_catalog(Arc::clone(&ctx), ready_tx)));
    wait_caught_up("catalog", ready_rx, deadline).await;
    let (ready_tx, ready_rx) = oneshot::channel();
    tasks.push(tokio::spawn(watch_bookings(Arc::clone(&ctx), ready_tx)));
    wait_caught_up("bookings", ready_rx, deadline).await;
    if shared.config.nats_relay_events {
        let (ready_tx, ready_rx) = oneshot::channel();
        tasks.push(tokio::spawn(consume_events(Arc::clone(&ctx), ready_tx)));
        wait_caught_up("events", ready_rx, deadline).await;
    }
    let publisher = Publisher {
        ctx: Arc::clone(&ctx),
        published: HashMap::new(),
        seq: 0,
        stores: None,
    };
    tasks.push(tokio::spawn(publisher.run(rx)));
    let catch_up = started.elapsed();
    tracing::info!(
        replica = %shared.replica_id,
        catch_up_ms = catch_up.as_millis() as u64,
        "replica sync running"
    );
    Ok(Some(SyncTasks {
        tasks,
        _client: client,
        catch_up,
    }))
}

async fn wait_caught_up(what: &str, ready: oneshot::Receiver<()>, deadline: tokio::time::Instant) {
    if tokio::time::timeout_at(deadline, ready).await.is_err() {
        tracing::warn!(
            what,
            "replica sync: start-up catch-up incomplete; continuing"
        );
    }
}

/// Signals the end of a catch-up once.
struct CatchUp(Option<oneshot::Sender<()>>);

impl CatchUp {
    fn done(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }

    fn pending(&self) -> bool {
        self.0.is_some()
    }
}

/// A watch of every key of a bucket, current values first; `None` (after a pause, to retry)
/// when the bucket or the watch is unavailable.
async fn history_watch(store: Result<kv::Store, String>) -> Option<kv::Watch> {
    let watch = match store {
        Ok(store) => tokio::time::timeout(REQUEST_TIMEOUT, store.watch_with_history(">")).await,
        Err(e) => {
            tracing::warn!(error = %e, "replica sync: bucket unavailable");
            tokio::time::sleep(RETRY_PAUSE).await;
            return None;
        }
    };
    match watch {
        Ok(Ok(watch)) => Some(watch),
        _ => {
            tokio::time::sleep(RETRY_PAUSE).await;
            None
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Catalog

async fn watch_catalog(ctx: Arc<Ctx>, ready: oneshot::Sender<()>) {
    let mut catch_up = CatchUp(Some(ready));
    let mut generation = ctx.generation.clone();
    loop {
        let Some(mut watch) = history_watch(ctx.catalog().await).await else {
            continue;
        };
        if ctx.bucket_messages(&ctx.catalog_bucket).await == 0 {
            catch_up.done();
        }
        loop {
            tokio::select! {
                entry = watch.next() => match entry {
                    Some(Ok(entry)) => {
                        apply_catalog_entry(&ctx, &entry);
                        if entry.delta == 0 {
                            catch_up.done();
                        }
                    }
                    _ => break,
                },
                _ = tokio::time::sleep(CATCH_UP_IDLE), if catch_up.pending() => catch_up.done(),
                alive = Ctx::reconnected(&mut generation) => {
                    if !alive {
                        return;
                    }
                    break;
                }
            }
        }
    }
}

fn apply_catalog_entry(ctx: &Ctx, entry: &kv::Entry) {
    let metrics = ctx.metrics();
    let Some(worker_id) = codec::parse_worker_key(&entry.key) else {
        metrics.dropped("catalog", "malformed", 1);
        return;
    };
    if entry.operation != kv::Operation::Put {
        let deleted = ctx.state.selector.write().delete_worker(worker_id).is_ok();
        ctx.state.ingest.remove_worker(worker_id);
        if deleted {
            metrics.applied("catalog_delete");
        }
        return;
    }
    let Some((origin, spec)) = serde_json::from_slice::<CatalogMessage>(&entry.value)
        .ok()
        .filter(|m| m.origin.v == VERSION)
        .and_then(|m| {
            let body: WorkerBody = serde_json::from_value(m.worker).ok()?;
            Some((m.origin, body.into_spec().ok()?))
        })
    else {
        metrics.dropped("catalog", "malformed", 1);
        return;
    };
    let outcome = {
        let mut selector = ctx.state.selector.write();
        if selector.worker(worker_id).is_some_and(|r| r.spec == spec) {
            None
        } else {
            Some(selector.upsert_worker(spec))
        }
    };
    match outcome {
        None => {}
        Some(Ok(outcome)) => {
            metrics.applied("catalog_put");
            metrics.observe_lag("catalog", codec::lag_secs(origin.ts_us));
            let consumes_events =
                !ctx.shared.config.nats_relay_events || origin.replica == ctx.replica();
            if consumes_events {
                ctx.state
                    .sync_listeners(&outcome.record, outcome.events_changed);
            } else {
                ctx.state.ingest.remove_worker(worker_id);
            }
        }
        Some(Err(e)) => {
            tracing::warn!(worker_id, error = %e, "replica sync: catalog entry refused");
            metrics.dropped("catalog", "malformed", 1);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bookings

async fn watch_bookings(ctx: Arc<Ctx>, ready: oneshot::Sender<()>) {
    let mut catch_up = CatchUp(Some(ready));
    let mut generation = ctx.generation.clone();
    // The first watch after start restores this replica's own bookings; later ones (after a
    // reconnect) replace the view of the others with the bucket's content.
    let mut first_watch = true;
    loop {
        let Some(mut watch) = history_watch(ctx.bookings().await).await else {
            continue;
        };
        let mut initial = ctx.bucket_messages(&ctx.bookings_bucket).await > 0;
        let mut seen: HashSet<(String, String)> = HashSet::new();
        if !initial {
            finish_bookings_catch_up(&ctx, first_watch, &seen);
            first_watch = false;
            catch_up.done();
        }
        loop {
            tokio::select! {
                entry = watch.next() => match entry {
                    Some(Ok(entry)) => {
                        let restoring = initial && first_watch;
                        if let Some(key) = apply_booking_entry(&ctx, &entry, restoring)
                            && initial
                        {
                            seen.insert(key);
                        }
                        if initial && entry.delta == 0 {
                            initial = false;
                            finish_bookings_catch_up(&ctx, first_watch, &seen);
                            first_watch = false;
                            catch_up.done();
                        }
                    }
                    _ => break,
                },
                _ = tokio::time::sleep(CATCH_UP_IDLE), if initial => {
                    initial = false;
                    finish_bookings_catch_up(&ctx, first_watch, &seen);
                    first_watch = false;
                    catch_up.done();
                }
                alive = Ctx::reconnected(&mut generation) => {
                    if !alive {
                        return;
                    }
                    break;
                }
            }
        }
    }
}

/// After a re-watch, the bucket's content replaces what this replica knew of the others.
fn finish_bookings_catch_up(ctx: &Ctx, first_watch: bool, seen: &HashSet<(String, String)>) {
    if first_watch {
        return;
    }
    let removed = ctx
        .state
        .selector
        .write()
        .retain_remote_bookings(|replica, id| {
            seen.contains(&(replica.to_string(), id.to_string()))
        });
    if removed > 0 {
        tracing::info!(
            removed,
            "replica sync: dropped bookings freed during the outage"
        );
    }
}

/// Applies one bookings-bucket entry; returns its `(replica, id)` when it is another replica's
/// live booking.
fn apply_booking_entry(ctx: &Ctx, entry: &kv::Entry, restoring: bool) -> Option<(String, String)> {
    let metrics = ctx.metrics();
    let Some((replica, id)) = codec::parse_booking_key(&entry.key) else {
        metrics.dropped("booking", "malformed", 1);
        return None;
    };
    let own = replica == ctx.replica();
    if entry.operation != kv::Operation::Put {
        if own {
            metrics.dropped("booking", "own", 1);
        } else if ctx
            .state
            .selector
            .write()
            .remove_remote_booking(replica, &id)
        {
            metrics.applied("booking_delete");
        }
        return None;
    }
    if own && !restoring {
        metrics.dropped("booking", "own", 1);
        return None;
    }
    let Some(message) = serde_json::from_slice::<BookingMessage>(&entry.value)
        .ok()
        .filter(|m| m.origin.v == VERSION)
    else {
        metrics.dropped("booking", "malformed", 1);
        return None;
    };
    let owner = if own {
        BookingOwner::Local
    } else {
        BookingOwner::Remote(replica)
    };
    let outcome = ctx.state.selector.write().apply_synced_booking(
        owner,
        &id,
        &message.state(),
        Instant::now(),
    );
    match outcome {
        Ok(_) => {
            metrics.applied(if own {
                "booking_restore"
            } else {
                "booking_put"
            });
            metrics.observe_lag("booking", codec::lag_secs(message.origin.ts_us));
        }
        Err(SyncApplyError::UnknownRank { .. }) => metrics.dropped("booking", "unknown_worker", 1),
        Err(SyncApplyError::Invalid(_)) => metrics.dropped("booking", "malformed", 1),
    }
    (!own).then(|| (replica.to_string(), id))
}

// ---------------------------------------------------------------------------------------------
// Relayed KV events

async fn consume_events(ctx: Arc<Ctx>, ready: oneshot::Sender<()>) {
    let mut catch_up = CatchUp(Some(ready));
    let mut generation = ctx.generation.clone();
    // Messages up to this sequence are history, applied even when this replica relayed them
    // (it is rebuilding its index); later ones of its own were applied when relayed.
    let mut history_end: Option<u64> = None;
    let mut next_sequence = 1u64;
    loop {
        let stream = match ctx.events().await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "events: stream unavailable");
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        let last = match tokio::time::timeout(REQUEST_TIMEOUT, stream.get_info()).await {
            Ok(Ok(info)) => info.state.last_sequence,
            _ => {
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        let history_end = *history_end.get_or_insert(last);
        if last < next_sequence.saturating_sub(1) {
            // The server lost the stream: start over.
            next_sequence = 1;
        }
        let deliver_policy = if next_sequence <= 1 {
            consumer::DeliverPolicy::All
        } else {
            consumer::DeliverPolicy::ByStartSequence {
                start_sequence: next_sequence,
            }
        };
        let consumer = stream.create_consumer(consumer::pull::OrderedConfig {
            filter_subject: ctx.events_subjects.clone(),
            deliver_policy,
            ..Default::default()
        });
        let messages = match tokio::time::timeout(REQUEST_TIMEOUT, consumer).await {
            Ok(Ok(consumer)) => tokio::time::timeout(REQUEST_TIMEOUT, consumer.messages()).await,
            _ => {
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        let Ok(Ok(mut messages)) = messages else {
            tokio::time::sleep(RETRY_PAUSE).await;
            continue;
        };
        if last < next_sequence {
            catch_up.done();
        }
        loop {
            tokio::select! {
                message = messages.next() => match message {
                    Some(Ok(message)) => {
                        let Ok(sequence) = message.info().map(|i| i.stream_sequence) else {
                            continue;
                        };
                        next_sequence = sequence + 1;
                        apply_events_message(&ctx, &message.payload, sequence <= history_end);
                        if sequence >= last {
                            catch_up.done();
                        }
                    }
                    _ => break,
                },
                _ = tokio::time::sleep(CATCH_UP_IDLE), if catch_up.pending() => catch_up.done(),
                alive = Ctx::reconnected(&mut generation) => {
                    if !alive {
                        return;
                    }
                    break;
                }
            }
        }
    }
}

fn apply_events_message(ctx: &Ctx, payload: &[u8], history: bool) {
    let metrics = ctx.metrics();
    let Some(message) = serde_json::from_slice::<EventsMessage>(payload)
        .ok()
        .filter(|m| m.origin.v == VERSION)
    else {
        metrics.dropped("events", "malformed", 1);
        return;
    };
    if message.origin.replica == ctx.replica() && !history {
        metrics.dropped("events", "own", 1);
        return;
    }
    let events: Vec<_> = message
        .events
        .iter()
        .filter_map(EventMessage::event)
        .collect();
    metrics.dropped(
        "events",
        "malformed",
        (message.events.len() - events.len()) as u64,
    );
    let outcome =
        ctx.state
            .selector
            .write()
            .apply_events(message.worker_id, message.dp_rank, &events);
    match outcome {
        Some(outcome) => {
            ctx.state.metrics.count_events(&outcome);
            metrics.applied("events");
            metrics.observe_lag("events", codec::lag_secs(message.origin.ts_us));
        }
        None => metrics.dropped("events", "unknown_worker", 1),
    }
}

// ---------------------------------------------------------------------------------------------
// Publisher

/// One write to NATS and what it is for.
enum Write {
    PutBooking {
        id: Arc<str>,
        key: String,
        state: SyncedBooking,
        value: Bytes,
    },
    DeleteBooking {
        id: Option<Arc<str>>,
        key: String,
    },
    PutWorker {
        key: String,
        value: Bytes,
    },
    DeleteWorker {
        key: String,
    },
    Events {
        subject: String,
        value: Bytes,
    },
}

impl Write {
    fn kind(&self) -> &'static str {
        match self {
            Write::PutBooking { .. } => "booking_put",
            Write::DeleteBooking { .. } => "booking_delete",
            Write::PutWorker { .. } => "catalog_put",
            Write::DeleteWorker { .. } => "catalog_delete",
            Write::Events { .. } => "events",
        }
    }
}

struct Publisher {
    ctx: Arc<Ctx>,
    /// What this replica believes the bucket holds for each of its bookings.
    published: HashMap<Arc<str>, (String, SyncedBooking)>,
    seq: u64,
    /// The bookings and catalog buckets, looked up again after a failure or a reconnect.
    stores: Option<(kv::Store, kv::Store)>,
}

impl Publisher {
    async fn run(mut self, mut rx: mpsc::Receiver<SyncOp>) {
        let mut generation = self.ctx.generation.clone();
        let period = Duration::from_secs_f64(self.ctx.shared.config.nats_snapshot_secs);
        let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Start with this replica's full snapshot (bookings restored from the bucket included).
        self.reconcile(true).await;
        loop {
            tokio::select! {
                op = rx.recv() => {
                    let Some(op) = op else { return };
                    let mut batch = vec![op];
                    while batch.len() < MAX_BATCH {
                        match rx.try_recv() {
                            Ok(op) => batch.push(op),
                            Err(_) => break,
                        }
                    }
                    self.publish(batch).await;
                }
                _ = interval.tick() => {
                    let full = self.ctx.shared.reconcile_requested.swap(false, Ordering::SeqCst);
                    self.reconcile(full).await;
                }
                alive = Ctx::reconnected(&mut generation) => {
                    if !alive {
                        return;
                    }
                    self.reconcile(true).await;
                }
            }
        }
    }

    fn origin(&mut self) -> Origin {
        self.seq += 1;
        Origin::new(self.ctx.replica(), self.seq)
    }

    fn put_booking(&mut self, id: Arc<str>, key: String, state: SyncedBooking) -> Option<Write> {
        let message = BookingMessage::new(self.origin(), &state);
        let value = Bytes::from(serde_json::to_vec(&message).ok()?);
        Some(Write::PutBooking {
            id,
            key,
            state,
            value,
        })
    }

    /// The writes that bring the bucket's entry for `id` to `current` (`None`: not live).
    fn booking_writes(
        &mut self,
        id: Arc<str>,
        current: Option<(String, SyncedBooking)>,
        writes: &mut Vec<Write>,
    ) {
        let previous = self.published.get(&id).cloned();
        match (current, previous) {
            (Some(now), Some(before)) if now == before => {}
            (Some((key, state)), previous) => {
                if let Some((old_key, _)) = previous
                    && old_key != key
                {
                    writes.push(Write::DeleteBooking {
                        id: None,
                        key: old_key,
                    });
                }
                writes.extend(self.put_booking(id, key, state));
            }
            (None, Some((key, _))) => writes.push(Write::DeleteBooking { id: Some(id), key }),
            (None, None) => {}
        }
    }

    /// This replica's live bookings with their keys.
    fn live_bookings(&self) -> Vec<(Arc<str>, String, SyncedBooking)> {
        let selector = self.ctx.state.selector.read();
        selector
            .local_bookings()
            .into_iter()
            .filter_map(|(id, state)| {
                let partition = selector.worker(state.worker_id)?.spec.partition();
                let key = codec::booking_key(&partition, self.ctx.replica(), &id);
                Some((id, key, state))
            })
            .collect()
    }

    async fn publish(&mut self, batch: Vec<SyncOp>) {
        let mut booking_ids = HashSet::new();
        let mut worker_ids = HashSet::new();
        let mut writes = Vec::new();
        for op in batch {
            match op {
                SyncOp::Booking(id) => {
                    booking_ids.insert(id);
                }
                SyncOp::Catalog(worker_id) => {
                    worker_ids.insert(worker_id);
                }
                SyncOp::Events {
                    worker_id,
                    dp_rank,
                    events,
                } => {
                    let message = EventsMessage {
                        origin: self.origin(),
                        worker_id,
                        dp_rank,
                        events: events.iter().map(EventMessage::new).collect(),
                    };
                    if let Ok(value) = serde_json::to_vec(&message) {
                        writes.push(Write::Events {
                            subject: format!(
                                "{}.events.{}.{worker_id}.{dp_rank}",
                                self.ctx.shared.config.nats_prefix,
                                self.ctx.replica()
                            ),
                            value: Bytes::from(value),
                        });
                    }
                }
            }
        }
        let (bookings, workers) = {
            let selector = self.ctx.state.selector.read();
            let bookings: Vec<_> = booking_ids
                .into_iter()
                .map(|id| {
                    let current = selector.synced_booking(&id).and_then(|state| {
                        let partition = selector.worker(state.worker_id)?.spec.partition();
                        Some((
                            codec::booking_key(&partition, self.ctx.replica(), &id),
                            state,
                        ))
                    });
                    (id, current)
                })
                .collect();
            let workers: Vec<_> = worker_ids
                .into_iter()
                .map(|w| (w, selector.worker(w).map(worker_json)))
                .collect();
            (bookings, workers)
        };
        for (id, current) in bookings {
            self.booking_writes(id, current, &mut writes);
        }
        for (worker_id, record) in workers {
            let key = codec::worker_key(worker_id);
            match record {
                Some(worker) => {
                    let message = CatalogMessage {
                        origin: self.origin(),
                        worker,
                    };
                    if let Ok(value) = serde_json::to_vec(&message) {
                        writes.push(Write::PutWorker {
                            key,
                            value: Bytes::from(value),
                        });
                    }
                }
                None => writes.push(Write::DeleteWorker { key }),
            }
        }
        self.execute(writes).await;
    }

    /// Brings the bucket in line with this replica's live bookings. `full`: do not trust what
    /// was published (after a reconnect): delete every own key that is not live, re-put all.
    async fn reconcile(&mut self, full: bool) {
        if full {
            self.stores = None;
        }
        let live = self.live_bookings();
        let mut writes = Vec::new();
        if full {
            let live_keys: HashSet<&str> = live.iter().map(|(_, key, _)| key.as_str()).collect();
            match self.own_keys().await {
                Ok(keys) => {
                    for key in keys {
                        if !live_keys.contains(key.as_str()) {
                            writes.push(Write::DeleteBooking { id: None, key });
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "replica sync: cannot list own bookings; retrying");
                    self.ctx
                        .shared
                        .reconcile_requested
                        .store(true, Ordering::SeqCst);
                }
            }
            self.published.clear();
        }
        let live_ids: HashSet<Arc<str>> = live.iter().map(|(id, _, _)| Arc::clone(id)).collect();
        let gone: Vec<Arc<str>> = self
            .published
            .keys()
            .filter(|id| !live_ids.contains(*id))
            .cloned()
            .collect();
        for id in gone {
            self.booking_writes(id, None, &mut writes);
        }
        for (id, key, state) in live {
            self.booking_writes(id, Some((key, state)), &mut writes);
        }
        self.execute(writes).await;
    }

    /// This replica's keys in the bookings bucket.
    async fn own_keys(&self) -> Result<Vec<String>, String> {
        let store = self.ctx.bookings().await?;
        let replica = self.ctx.replica();
        let listing = async {
            let keys = store.keys().await.map_err(|e| e.to_string())?;
            let keys: Vec<String> = keys
                .filter_map(|key| async move { key.ok() })
                .collect()
                .await;
            Ok::<_, String>(keys)
        };
        let keys = tokio::time::timeout(REQUEST_TIMEOUT * 2, listing)
            .await
            .map_err(|_| "listing keys timed out".to_string())??;
        Ok(keys
            .into_iter()
            .filter(|key| codec::parse_booking_key(key).is_some_and(|(r, _)| r == replica))
            .collect())
    }

    async fn execute(&mut self, writes: Vec<Write>) {
        if writes.is_empty() {
            return;
        }
        if self.stores.is_none() {
            self.stores = match (self.ctx.bookings().await, self.ctx.catalog().await) {
                (Ok(bookings), Ok(catalog)) => Some((bookings, catalog)),
                _ => None,
            };
        }
        let Some((bookings, catalog)) = self.stores.clone() else {
            self.failed(writes);
            return;
        };
        let js = &self.ctx.js;
        let results: Vec<(Write, bool)> = futures::stream::iter(writes)
            .map(|write| {
                let (bookings, catalog) = (&bookings, &catalog);
                async move {
                    let ok = match &write {
                        Write::PutBooking { key, value, .. } => {
                            bookings.put(key, value.clone()).await.is_ok()
                        }
                        Write::DeleteBooking { key, .. } => bookings.delete(key).await.is_ok(),
                        Write::PutWorker { key, value } => {
                            catalog.put(key, value.clone()).await.is_ok()
                        }
                        Write::DeleteWorker { key } => catalog.delete(key).await.is_ok(),
                        Write::Events { subject, value } => {
                            match js.publish(subject.clone(), value.clone()).await {
                                Ok(ack) => ack.await.is_ok(),
                                Err(_) => false,
                            }
                        }
                    };
                    (write, ok)
                }
            })
            .buffer_unordered(MAX_IN_FLIGHT)
            .collect()
            .await;
        let mut failed = Vec::new();
        for (write, ok) in results {
            if !ok {
                failed.push(write);
                continue;
            }
            self.ctx.metrics().published(write.kind(), 1);
            match write {
                Write::PutBooking { id, key, state, .. } => {
                    self.published.insert(id, (key, state));
                }
                Write::DeleteBooking { id: Some(id), .. } => {
                    self.published.remove(&id);
                }
                _ => {}
            }
        }
        self.failed(failed);
    }

    /// Failed writes are counted; bookings are retried by the next full reconciliation.
    fn failed(&mut self, writes: Vec<Write>) {
        if writes.is_empty() {
            return;
        }
        self.stores = None;
        for write in &writes {
            self.ctx
                .metrics()
                .dropped(write.kind(), "publish_failed", 1);
            if let Write::PutBooking { id, .. } = write {
                self.published.remove(id);
            }
        }
        self.ctx
            .shared
            .reconcile_requested
            .store(true, Ordering::SeqCst);
    }
}
