//! The publisher: this replica's own bookings, catalog changes and relayed KV events, written to
//! NATS in batches.

use super::*;
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
    /// A session's binding (`None`: dropped, a tombstone).
    PutSession {
        session: SessionKey,
        key: String,
        state: Option<SyncedBinding>,
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
            Write::PutSession { state: None, .. } => "session_drop",
            Write::PutSession { .. } => "session_put",
        }
    }
}

pub(super) struct Publisher {
    ctx: Arc<Ctx>,
    /// What this replica believes the bucket holds for each of its bookings.
    published: HashMap<Arc<str>, (String, SyncedBooking)>,
    seq: u64,
    /// The bookings and catalog buckets, looked up again after a failure or a reconnect.
    stores: Option<(kv::Store, kv::Store)>,
    /// The sessions bucket (with session affinity), looked up again likewise.
    sessions_store: Option<kv::Store>,
    /// What this replica last wrote for each binding it made, and when.
    published_sessions: HashMap<SessionKey, (SyncedBinding, Instant)>,
}

impl Publisher {
    pub(super) fn new(ctx: Arc<Ctx>) -> Self {
        Self {
            ctx,
            published: HashMap::new(),
            seq: 0,
            stores: None,
            sessions_store: None,
            published_sessions: HashMap::new(),
        }
    }

    pub(super) async fn run(mut self, mut rx: mpsc::Receiver<SyncOp>) {
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
        let mut sessions = HashSet::new();
        let mut writes = Vec::new();
        for op in batch {
            match op {
                SyncOp::Session(key) => {
                    sessions.insert(key);
                }
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
        let (bookings, workers, bindings) = {
            let now = self.ctx.state.now();
            let selector = self.ctx.state.selector.read();
            let bindings: Vec<_> = sessions
                .into_iter()
                .map(|key| {
                    let binding = selector.session_binding(&key, now);
                    (key, binding)
                })
                .collect();
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
            (bookings, workers, bindings)
        };
        for (session, binding) in bindings {
            writes.extend(self.put_session(session, binding));
        }
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

    /// The write of a session's binding as it is here (`None`: a tombstone).
    fn put_session(&mut self, session: SessionKey, state: Option<SyncedBinding>) -> Option<Write> {
        let (worker_id, dp_rank) = state.map_or((0, 0), |b| (b.rank.worker_id, b.rank.dp_rank));
        let message = SessionMessage {
            origin: self.origin(),
            worker_id,
            dp_rank,
            idle_until_us: state
                .and_then(|b| b.idle_until)
                .map(|t| idle_until_us(&self.ctx.state, t)),
            dropped: state.is_none(),
        };
        let value = Bytes::from(serde_json::to_vec(&message).ok()?);
        Some(Write::PutSession {
            key: codec::session_key(&session),
            session,
            state,
            value,
        })
    }

    /// The writes that bring the sessions bucket in line with the bindings this replica made:
    /// those changed since written, and held ones written long ago (their entries must outlive
    /// the bucket's max age). `full`: all of them.
    fn session_writes(&mut self, full: bool, writes: &mut Vec<Write>) {
        if self.ctx.sessions_bucket.is_none() {
            return;
        }
        if full {
            self.published_sessions.clear();
        }
        let now = self.ctx.state.now();
        let local = self.ctx.state.selector.read().local_session_bindings(now);
        let live: HashSet<&SessionKey> = local.iter().map(|(key, _)| key).collect();
        self.published_sessions.retain(|key, _| live.contains(key));
        let stale = self.ctx.session_max_age() / 2;
        let due: Vec<(SessionKey, SyncedBinding)> = local
            .iter()
            .filter(|(key, binding)| match self.published_sessions.get(key) {
                Some((published, at)) => {
                    published != binding || now.saturating_duration_since(*at) >= stale
                }
                None => true,
            })
            .cloned()
            .collect();
        for (key, binding) in due {
            writes.extend(self.put_session(key, Some(binding)));
        }
    }

    /// Brings the bucket in line with this replica's live bookings. `full`: do not trust what
    /// was published (after a reconnect): delete every own key that is not live, re-put all.
    async fn reconcile(&mut self, full: bool) {
        if full {
            self.stores = None;
            self.sessions_store = None;
        }
        let live = self.live_bookings();
        let mut writes = Vec::new();
        self.session_writes(full, &mut writes);
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
        if self.sessions_store.is_none()
            && let Some(Ok(store)) = self.ctx.sessions().await
        {
            self.sessions_store = Some(store);
        }
        let sessions = self.sessions_store.clone();
        let js = &self.ctx.js;
        let results: Vec<(Write, bool)> = futures::stream::iter(writes)
            .map(|write| {
                let (bookings, catalog, sessions) = (&bookings, &catalog, &sessions);
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
                        Write::PutSession { key, value, .. } => match sessions {
                            Some(store) => store.put(key, value.clone()).await.is_ok(),
                            None => false,
                        },
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
                Write::PutSession {
                    session,
                    state: Some(state),
                    ..
                } => {
                    let now = self.ctx.state.now();
                    self.published_sessions.insert(session, (state, now));
                }
                Write::PutSession { session, .. } => {
                    self.published_sessions.remove(&session);
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
        self.sessions_store = None;
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
