//! The watchers: the catalog and bookings buckets and the KV-event stream of the other
//! replicas, applied to this replica's state.

use super::*;
// ---------------------------------------------------------------------------------------------
// Catalog

pub(super) async fn watch_catalog(ctx: Arc<Ctx>, ready: oneshot::Sender<()>) {
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
        ctx.state.metrics.degraded.worker_deleted(worker_id);
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
            // Its events reach this replica either way (from its listeners or the relay), so
            // its silence is watched either way.
            ctx.state
                .metrics
                .degraded
                .worker_registered(&outcome.record, !ctx.state.config.no_kv_events);
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

pub(super) async fn watch_bookings(ctx: Arc<Ctx>, ready: oneshot::Sender<()>) {
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

pub(super) async fn consume_events(ctx: Arc<Ctx>, ready: oneshot::Sender<()>) {
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
            ctx.state.metrics.degraded.events_arrived(message.worker_id);
            ctx.state.metrics.count_events(&outcome);
            metrics.applied("events");
            metrics.observe_lag("events", codec::lag_secs(message.origin.ts_us));
        }
        None => metrics.dropped("events", "unknown_worker", 1),
    }
}

// ---------------------------------------------------------------------------------------------
// Session bindings

pub(super) async fn watch_sessions(ctx: Arc<Ctx>, ready: oneshot::Sender<()>) {
    let mut catch_up = CatchUp(Some(ready));
    let mut generation = ctx.generation.clone();
    let Some(bucket) = ctx.sessions_bucket.clone() else {
        catch_up.done();
        return;
    };
    // The first catch-up after start restores this replica's own bindings too; later, its own
    // values are what it already has.
    let mut restoring = true;
    loop {
        let Some(store) = ctx.sessions().await else {
            return;
        };
        let Some(mut watch) = history_watch(store).await else {
            continue;
        };
        let mut initial = ctx.bucket_messages(&bucket).await > 0;
        if !initial {
            restoring = false;
            catch_up.done();
        }
        loop {
            tokio::select! {
                entry = watch.next() => match entry {
                    Some(Ok(entry)) => {
                        apply_session_entry(&ctx, &entry, restoring);
                        if initial && entry.delta == 0 {
                            initial = false;
                            restoring = false;
                            catch_up.done();
                        }
                    }
                    _ => break,
                },
                _ = tokio::time::sleep(CATCH_UP_IDLE), if initial => {
                    initial = false;
                    restoring = false;
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

fn apply_session_entry(ctx: &Ctx, entry: &kv::Entry, restoring: bool) {
    let metrics = ctx.metrics();
    let Some(key) = codec::parse_session_key(&entry.key) else {
        metrics.dropped("session", "malformed", 1);
        return;
    };
    let state = &ctx.state;
    if entry.operation != kv::Operation::Put {
        state
            .selector
            .write()
            .apply_synced_binding(&key, None, state.now());
        metrics.applied("session_delete");
        return;
    }
    let Some(message) = serde_json::from_slice::<SessionMessage>(&entry.value)
        .ok()
        .filter(|m| m.origin.v == VERSION)
    else {
        metrics.dropped("session", "malformed", 1);
        return;
    };
    if message.origin.replica == ctx.replica() && !restoring {
        metrics.dropped("session", "own", 1);
        return;
    }
    let binding = (!message.dropped).then(|| SyncedBinding {
        rank: Rank::new(message.worker_id, message.dp_rank),
        idle_until: message
            .idle_until_us
            .map(|us| idle_until_instant(state, us)),
    });
    state
        .selector
        .write()
        .apply_synced_binding(&key, binding, state.now());
    metrics.applied(if message.dropped {
        "session_drop"
    } else {
        "session_put"
    });
    metrics.observe_lag("session", codec::lag_secs(message.origin.ts_us));
}
