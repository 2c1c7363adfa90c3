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
    self, BookingMessage, CatalogMessage, EventMessage, EventsMessage, Origin, SessionMessage,
    VERSION,
};
use crate::sync::{SyncOp, SyncShared};
use crate::types::{WorkerBody, worker_json};
use async_nats::jetstream::{self, consumer, kv, stream};
use bytes::Bytes;
use futures::StreamExt;
use kvroute_core::event::Rank;
use kvroute_core::selector::{
    BookingOwner, SessionKey, SyncApplyError, SyncedBinding, SyncedBooking,
};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

mod publish;
mod watchers;

use publish::Publisher;
use watchers::{consume_events, watch_bookings, watch_catalog, watch_sessions};

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
    /// Session bindings' bucket, with session affinity on.
    sessions_bucket: Option<String>,
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

    /// A binding's entry lives its TTL past its last write, plus the booking expiry: a binding
    /// held by a booking is not written again while the booking lives (the publisher writes
    /// held bindings again at half that age).
    fn session_max_age(&self) -> Duration {
        let ttl = self.state.config.session_affinity_ttl_secs.unwrap_or(0.0);
        self.booking_max_age() + Duration::from_secs_f64(ttl)
    }

    /// The sessions bucket (`None` without session affinity).
    async fn sessions(&self) -> Option<Result<kv::Store, String>> {
        let bucket = self.sessions_bucket.as_ref()?;
        Some(ensure_kv(&self.js, bucket, self.session_max_age()).await)
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
        sessions_bucket: state
            .config
            .session_affinity_ttl_secs
            .map(|_| format!("{prefix}_sessions")),
        events_stream: format!("{prefix}_events"),
        events_subjects: format!("{prefix}.events.>"),
        generation,
    });
    // Fail early, with the reason, when JetStream is not there.
    ctx.catalog().await?;
    ctx.bookings().await?;
    if let Some(sessions) = ctx.sessions().await {
        sessions?;
    }
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
    if ctx.sessions_bucket.is_some() {
        // After the bookings, so that the sessions they hold are known.
        let (ready_tx, ready_rx) = oneshot::channel();
        tasks.push(tokio::spawn(watch_sessions(Arc::clone(&ctx), ready_tx)));
        wait_caught_up("sessions", ready_rx, deadline).await;
    }
    if shared.config.nats_relay_events {
        let (ready_tx, ready_rx) = oneshot::channel();
        tasks.push(tokio::spawn(consume_events(Arc::clone(&ctx), ready_tx)));
        wait_caught_up("events", ready_rx, deadline).await;
    }
    let publisher = Publisher::new(Arc::clone(&ctx));
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

/// A binding's expiry on the wire (Unix µs), from the service's clock.
fn idle_until_us(state: &AppState, idle_until: Instant) -> u64 {
    let left = idle_until
        .saturating_duration_since(state.now())
        .as_micros();
    codec::unix_micros().saturating_add(u64::try_from(left).unwrap_or(u64::MAX))
}

/// A binding's expiry on the service's clock, from the wire (in the past: now).
fn idle_until_instant(state: &AppState, unix_us: u64) -> Instant {
    state.now() + Duration::from_micros(unix_us.saturating_sub(codec::unix_micros()))
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
