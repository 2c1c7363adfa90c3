//! Replica sync over NATS (SPEC §10; cargo feature `nats`): several `kvroute serve` processes
//! behind one load balancer share their bookings, their worker catalog and, optionally, the
//! engines' KV events, so they do not herd onto the same "best" worker and a restarted replica
//! recovers its state without asking its peers.
//!
//! Without `--nats-url` nothing here runs: every hook is a no-op and the service behaves exactly
//! as a single process.
//!
//! This module is the service's side of replica sync (the knobs, the hooks that queue changes,
//! the message formats in [`codec`]) and sits below [`crate::state`], which holds the hooks. The
//! tasks that talk to NATS drive the whole state, so they live above it, in `crate::sync_tasks`
//! (`kvroute_service::sync_tasks::start`, with the `nats` feature).
//!
//! ## What travels, and where
//!
//! | what | NATS object | key / subject | value |
//! |---|---|---|---|
//! | bookings | KV bucket `{prefix}_bookings` (history 1, max age = `--active-request-expiry-secs`) | `{partition}.{replica}.r{hex(reservation id)}` | the booking's *state* ([`codec::BookingMessage`]); freed = key deleted |
//! | catalog | KV bucket `{prefix}_workers` (history 1) | `w{worker_id}` | the worker record and the replica that wrote it |
//! | session bindings (`--session-affinity-ttl-secs`) | KV bucket `{prefix}_sessions` (history 1, max age = the TTL + `--active-request-expiry-secs`) | `{partition}.s{hex(session id)}` | the bound rank and, when idle, the binding's end in Unix µs ([`codec::SessionMessage`]); a drop is a tombstone value |
//! | KV events (`--nats-relay-events`) | stream `{prefix}_events` (file storage, bounded by `--nats-events-max-age-secs` and `--nats-events-max-bytes`, oldest discarded first) | `{prefix}.events.{replica}.{worker}.{rank}` | a decoded batch ([`codec::EventsMessage`]) |
//!
//! `{partition}` is `p{hex(model)}_{hex(group)}`, so the bookings of one partition are one
//! subject prefix (`$KV.{prefix}_bookings.{partition}.>`).
//!
//! **Why a KV bucket keyed by reservation for bookings**, rather than a stream of deltas: a KV
//! bucket *is* a JetStream stream with per-key last-value semantics, plus what replica sync
//! needs for free. (1) Catch-up: a (re)starting replica watches the bucket and first receives
//! exactly the live bookings (one value per key; freed keys are delete markers), not a history
//! to fold. (2) Idempotence: a value is a booking's whole state (booked where, prefill
//! complete, output blocks, decode contribution), so applying it twice or after a newer local
//! view changes nothing ([`kvroute_core::selector::Selector::apply_synced_booking`]); deltas
//! would have to be deduplicated by sequence number. (3) Reconciliation: a replica can list its
//! own keys and put or delete until the bucket equals its live bookings. The bucket's max age
//! equals the booking expiry: an untouched booking expires on every replica at that age
//! anyway, and a replica that died for good leaves nothing behind.
//!
//! ## Flow
//! - The HTTP path never waits on NATS: after a successful booking change `api` calls a hook
//!   ([`SyncHandle::booking_changed`], …) that only queues the id on a bounded channel. When the
//!   channel is full the change is counted (`sync_messages_dropped{reason="channel_full"}`) and a
//!   full reconciliation is requested.
//! - The publisher task drains the channel in batches, reads each booking's current state under
//!   the read lock (a book freed before it was published is never published) and puts or deletes
//!   its key, up to 64 writes in flight. Every `--nats-snapshot-secs` it reconciles: its live
//!   bookings against what it published (puts what changed — output blocks not published at
//!   once included — and deletes what was freed or expired).
//! - On every reconnect (and at start) the publisher does a *full* reconciliation: it lists its
//!   own keys in the bucket, deletes those that are no longer live and re-puts every live
//!   booking — its full snapshot. Each watcher restarts its watch; the bookings watcher then
//!   replaces its view of the other replicas with what the bucket holds
//!   ([`kvroute_core::selector::Selector::retain_remote_bookings`]). So bookings made or freed on
//!   either side of an outage are neither lost nor doubled once both sides reconnected.
//! - Watchers apply the other replicas' values to the selector. Their own values are ignored
//!   (`reason="own"`), except while a replica catches up at start: then its own bookings are
//!   restored under their plain ids, so a client's later `DELETE` on the restarted replica works.
//!   Bookings naming a worker this replica does not know are dropped (`reason="unknown_worker"`).
//! - Catalog values are applied when they differ from the local record (a replica's own writes
//!   are no-ops), through the selector directly, never through `api`: an applied change is not
//!   published again. Concurrent writers converge on the bucket's last value.
//! - With `--nats-relay-events`, only the replica that wrote a worker's catalog entry opens its
//!   ZMQ listeners; it republishes each decoded batch to the events stream. The others apply the
//!   stream instead, and at start every replica replays it from its first retained message
//!   (its own messages included) to rebuild its index. The index is only as complete as the
//!   retained window: size the retention to cover the engines' cache lifetime.
//!
//! Session bindings: one key per session, whichever replica bound it (the last write wins). A
//! replica publishes the bindings it changes: bound or moved by its booking, dropped by a refused
//! booking (a tombstone, so it can tell its own drop's echo from another's), idle after its own
//! last booking of the session ended; the reconciliation writes again what changed and, every
//! half max age, the bindings a booking holds. Bookings carry their session
//! ([`codec::BookingMessage::session_id`]), so a binding stays held on every replica while any
//! replica's booking holds it; when the last one ends, each replica starts the TTL as it hears
//! of it. The watcher ignores its own values except while a restarted replica catches up.
//!
//! Start order: catalog, then bookings, then session bindings (held by the bookings), then
//! events (so bookings and events find their workers), each caught up before the next, bounded
//! by 30 s; then `kvroute serve` starts serving.

pub mod codec;

use crate::ingest::EventSink;
use crate::metrics::Metrics;
use clap::Args;
use kvroute_core::event::{KvEvent, WorkerId};
use kvroute_core::selector::SessionKey;
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::mpsc;

/// Queued changes beyond which the HTTP path drops (and counts) rather than waits.
const CHANNEL_CAPACITY: usize = 65_536;

/// The replica-sync knobs (`kvroute serve --nats-url …`).
#[derive(Debug, Clone, Args, PartialEq)]
pub struct SyncConfig {
    /// NATS server to share bookings, the worker catalog and (optionally) KV events with other
    /// replicas, e.g. nats://127.0.0.1:4222 (JetStream enabled). Without it the replica is alone.
    #[arg(long, env = "KVROUTE_NATS_URL")]
    pub nats_url: Option<String>,
    /// This replica's id (1 to 64 of A-Z a-z 0-9 _ -). Restart a replica with the same id to
    /// recover its own bookings; default: a random id.
    #[arg(long, env = "KVROUTE_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// Relay engines' KV events through a JetStream stream: only the replica that registered a
    /// worker consumes its ZMQ stream; the others, and restarted replicas, replay the stream.
    #[arg(long, env = "KVROUTE_NATS_RELAY_EVENTS", default_value_t = false)]
    pub nats_relay_events: bool,
    /// Also publish each output_block call (more messages; decode load agrees more closely).
    #[arg(long, env = "KVROUTE_NATS_SYNC_OUTPUT_BLOCKS", default_value_t = false)]
    pub nats_sync_output_blocks: bool,
    /// Period of the reconciliation of this replica's published bookings, in seconds.
    #[arg(long, env = "KVROUTE_NATS_SNAPSHOT_SECS", default_value_t = 5.0)]
    pub nats_snapshot_secs: f64,
    /// Retention of the relayed KV-event stream by age, in seconds.
    #[arg(
        long,
        env = "KVROUTE_NATS_EVENTS_MAX_AGE_SECS",
        default_value_t = 3600.0
    )]
    pub nats_events_max_age_secs: f64,
    /// Retention of the relayed KV-event stream by size, in bytes (oldest discarded first).
    #[arg(long, env = "KVROUTE_NATS_EVENTS_MAX_BYTES", default_value_t = 1 << 30)]
    pub nats_events_max_bytes: i64,
    /// Prefix of the NATS buckets, stream and subjects, so several clusters can share a server.
    #[arg(long, env = "KVROUTE_NATS_PREFIX", default_value = "kvroute")]
    pub nats_prefix: String,
}

impl Default for SyncConfig {
    fn default() -> Self {
        Self {
            nats_url: None,
            replica_id: None,
            nats_relay_events: false,
            nats_sync_output_blocks: false,
            nats_snapshot_secs: 5.0,
            nats_events_max_age_secs: 3600.0,
            nats_events_max_bytes: 1 << 30,
            nats_prefix: "kvroute".to_string(),
        }
    }
}

impl SyncConfig {
    /// Checks the knobs; the message names the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if self.nats_url.is_some() && !cfg!(feature = "nats") {
            return Err("--nats-url needs kvroute built with the `nats` cargo feature".to_string());
        }
        if let Some(id) = &self.replica_id {
            codec::check_replica_id(id)?;
        }
        codec::check_replica_id(&self.nats_prefix).map_err(|_| {
            "--nats-prefix must be 1 to 64 characters of A-Z a-z 0-9 _ -".to_string()
        })?;
        for (name, value) in [
            ("nats-snapshot-secs", self.nats_snapshot_secs),
            ("nats-events-max-age-secs", self.nats_events_max_age_secs),
        ] {
            if !(value.is_finite() && value > 0.0 && value < 1e9) {
                return Err(format!(
                    "--{name} must be a number of seconds > 0 (got {value})"
                ));
            }
        }
        if self.nats_events_max_bytes < 1 << 20 {
            return Err("--nats-events-max-bytes must be at least 1048576".to_string());
        }
        Ok(())
    }
}

/// A change for the publisher.
#[derive(Debug)]
#[cfg_attr(not(feature = "nats"), allow(dead_code))]
pub(crate) enum SyncOp {
    /// This replica's booking changed (booked, lifecycle call, freed).
    Booking(Arc<str>),
    /// This replica changed a worker (upsert, patch, delete).
    Catalog(WorkerId),
    /// This replica changed a session's binding (bound, rebound, dropped, idle).
    Session(SessionKey),
    /// Events this replica's listeners applied, to relay.
    Events {
        worker_id: WorkerId,
        dp_rank: u32,
        events: Vec<KvEvent>,
    },
}

#[derive(Debug)]
#[cfg_attr(not(feature = "nats"), allow(dead_code))]
pub(crate) struct SyncShared {
    pub replica_id: String,
    pub config: SyncConfig,
    pub tx: mpsc::Sender<SyncOp>,
    /// Taken by the publisher when sync starts.
    pub rx: Mutex<Option<mpsc::Receiver<SyncOp>>>,
    pub metrics: Arc<Metrics>,
    /// A change could not be queued: the next reconciliation must be a full one.
    pub reconcile_requested: AtomicBool,
}

/// The service's side of replica sync: hooks that queue changes, no-ops when sync is off.
#[derive(Debug, Clone, Default)]
pub struct SyncHandle {
    shared: Option<Arc<SyncShared>>,
}

impl SyncHandle {
    /// Sync is on when `config.nats_url` is set (the configuration was validated).
    pub fn new(config: &SyncConfig, metrics: Arc<Metrics>) -> Self {
        if config.nats_url.is_none() {
            return Self::default();
        }
        let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
        let replica_id = config
            .replica_id
            .clone()
            .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
        Self {
            shared: Some(Arc::new(SyncShared {
                replica_id,
                config: config.clone(),
                tx,
                rx: Mutex::new(Some(rx)),
                metrics,
                reconcile_requested: AtomicBool::new(false),
            })),
        }
    }

    #[cfg_attr(not(feature = "nats"), allow(dead_code))]
    pub(crate) fn shared(&self) -> Option<&Arc<SyncShared>> {
        self.shared.as_ref()
    }

    /// This replica's id, when sync is on.
    pub fn replica_id(&self) -> Option<&str> {
        self.shared.as_deref().map(|s| s.replica_id.as_str())
    }

    fn send(&self, kind: &str, op: SyncOp) {
        let Some(shared) = &self.shared else {
            return;
        };
        if shared.tx.try_send(op).is_err() {
            shared.metrics.sync.dropped(kind, "channel_full", 1);
            shared.reconcile_requested.store(true, Ordering::SeqCst);
        }
    }

    /// One of this replica's bookings was booked, completed its prefill or was freed.
    pub fn booking_changed(&self, reservation_id: &str) {
        if self.shared.is_some() {
            self.send("booking", SyncOp::Booking(Arc::from(reservation_id)));
        }
    }

    /// An output block was reported: published at once only with `--nats-sync-output-blocks`;
    /// otherwise the new state travels with the next periodic reconciliation.
    pub fn output_block(&self, reservation_id: &str) {
        if self
            .shared
            .as_ref()
            .is_some_and(|s| s.config.nats_sync_output_blocks)
        {
            self.booking_changed(reservation_id);
        }
    }

    /// This replica upserted, patched or deleted a worker.
    pub fn catalog_changed(&self, worker_id: WorkerId) {
        self.send("catalog", SyncOp::Catalog(worker_id));
    }

    /// This replica changed these sessions' bindings.
    pub fn sessions_changed(&self, sessions: Vec<SessionKey>) {
        for key in sessions {
            self.send("session", SyncOp::Session(key));
        }
    }

    /// Wraps the listeners' sink so that, with `--nats-relay-events`, applied events are relayed.
    pub fn wrap_sink(&self, sink: Arc<dyn EventSink>) -> Arc<dyn EventSink> {
        match &self.shared {
            Some(shared) if shared.config.nats_relay_events => Arc::new(RelaySink {
                inner: sink,
                handle: self.clone(),
            }),
            _ => sink,
        }
    }
}

/// Applies events locally, then queues them for the events stream.
struct RelaySink {
    inner: Arc<dyn EventSink>,
    handle: SyncHandle,
}

impl EventSink for RelaySink {
    fn apply(&self, worker_id: u64, dp_rank: u32, events: Vec<KvEvent>) -> bool {
        let relayed = events.clone();
        let known = self.inner.apply(worker_id, dp_rank, events);
        if known {
            self.handle.send(
                "events",
                SyncOp::Events {
                    worker_id,
                    dp_rank,
                    events: relayed,
                },
            );
        }
        known
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_knobs_are_named() {
        let config = |f: fn(&mut SyncConfig)| {
            let mut c = SyncConfig::default();
            f(&mut c);
            c.validate()
        };
        assert!(config(|_| {}).is_ok());
        assert!(
            config(|c| c.replica_id = Some("a.b".into()))
                .unwrap_err()
                .contains("--replica-id")
        );
        assert!(
            config(|c| c.nats_snapshot_secs = 0.0)
                .unwrap_err()
                .contains("--nats-snapshot-secs")
        );
        assert!(
            config(|c| c.nats_events_max_bytes = 1)
                .unwrap_err()
                .contains("--nats-events-max-bytes")
        );
        assert!(
            config(|c| c.nats_prefix = String::new())
                .unwrap_err()
                .contains("--nats-prefix")
        );
    }

    #[test]
    fn hooks_are_no_ops_without_a_nats_url() {
        let handle = SyncHandle::new(&SyncConfig::default(), Arc::new(Metrics::new()));
        assert!(handle.replica_id().is_none());
        handle.booking_changed("x");
        handle.catalog_changed(1);
    }
}
