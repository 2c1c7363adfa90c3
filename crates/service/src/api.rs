//! The selection service's operations, independent of the transport: typed request bodies in,
//! JSON values out, failures as [`ApiError`] (status + the exact message). The HTTP handlers and
//! the Python binding both call these, so they cannot diverge in semantics.

use crate::error::ApiError;
use crate::queue::ResolvedSelect;
use crate::state::AppState;
use crate::types::*;
use kvroute_core::error::{Error, PartitionKey, check_id};
use kvroute_core::event::{KvEvent, Rank, Tier};
use kvroute_core::hash::{PromptHashes, seed_for};
use kvroute_core::selector::{LifecycleCalls, PartitionDump, Prompt, ReservationRequest};
use serde_json::{Value, json};
use std::time::Instant;

mod admit;

pub use admit::{Admission, Waiter, admit, admit_waiting, observe_queue, run_admission};

pub type ApiResult = Result<Value, ApiError>;

/// `{"status": "ok"}`.
pub fn ok_status() -> Value {
    json!({"status": "ok"})
}

// ---------------------------------------------------------------------------------------------
// Catalog

/// `POST /workers` (201).
pub fn upsert_worker(state: &AppState, body: WorkerBody) -> ApiResult {
    if body.worker_id.is_none() {
        return Err(ApiError::unprocessable(
            "Failed to deserialize the JSON body into the target type: missing field `worker_id`",
        ));
    }
    let spec = body.into_spec()?;
    let outcome = state.selector.write().upsert_worker(spec)?;
    state.sync_listeners(&outcome.record, outcome.events_changed);
    state.sync.catalog_changed(outcome.record.spec.worker_id);
    admit_waiting(state);
    Ok(worker_json(&outcome.record))
}

/// `PATCH /workers/{id}`.
pub fn patch_worker(state: &AppState, worker_id: u64, body: WorkerBody) -> ApiResult {
    let outcome = {
        let mut selector = state.selector.write();
        let Some(existing) = selector.worker(worker_id) else {
            return Err(Error::WorkerNotFound { worker_id }.into());
        };
        let spec = body.patch(existing.spec.clone())?;
        selector.upsert_worker(spec)?
    };
    state.sync_listeners(&outcome.record, outcome.events_changed);
    state.sync.catalog_changed(worker_id);
    admit_waiting(state);
    Ok(worker_json(&outcome.record))
}

/// `DELETE /workers/{id}`.
pub fn delete_worker(state: &AppState, worker_id: u64) -> ApiResult {
    let record = state.selector.write().delete_worker(worker_id)?;
    state.ingest.remove_worker(worker_id);
    state.sync.catalog_changed(worker_id);
    // Its bookings ended: their sessions idle.
    state.share_session_changes();
    admit_waiting(state);
    Ok(worker_json(&record))
}

/// `GET /workers`.
pub fn list_workers(
    state: &AppState,
    model_name: Option<&str>,
    routing_group: Option<&str>,
) -> Value {
    let workers = state
        .selector
        .read()
        .list_workers(model_name, routing_group);
    Value::Array(workers.iter().map(worker_json).collect())
}

/// `GET /ready`: the body and whether the service is ready (200) or not (503).
pub fn ready(state: &AppState) -> (bool, Value) {
    let ready = state.selector.read().ready();
    let is_ready = ready.ready && !state.is_shutting_down();
    let body = json!({
        "ready": is_ready,
        "schedulable_workers": ready.schedulable_workers,
        "workers": ready.workers.iter().map(worker_json).collect::<Vec<_>>(),
    });
    (is_ready, body)
}

// ---------------------------------------------------------------------------------------------
// Selection

/// Hashes a token prompt with the partition's block size, outside any write lock.
fn hash_for_partition(
    state: &AppState,
    key: &PartitionKey,
    prompt: PromptInput,
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
) -> Result<PromptHashes, ApiError> {
    match prompt {
        PromptInput::Hashes(h) => Ok(h),
        PromptInput::Tokens(prompt) => {
            let block_size = state.selector.read().block_size_for(key)?;
            let start = Instant::now();
            let hashes = PromptHashes::from_tokens_with(
                &prompt.tokens,
                block_size as usize,
                seed_for(lora_name, cache_salt),
                prompt.extras(),
            );
            state
                .metrics
                .observe_phase("hash", start.elapsed().as_secs_f64());
            Ok(hashes)
        }
    }
}

fn resolve_select(state: &AppState, body: &mut SelectBody) -> Result<ResolvedSelect, ApiError> {
    let key = body.key()?;
    let mut prompt = body.take_prompt();
    let input = prompt.resolve("block_hashes")?;
    let overrides = body.overrides()?;
    let hashes = hash_for_partition(
        state,
        &key,
        input,
        prompt.lora_name.as_deref(),
        prompt.cache_salt.as_deref(),
    )?;
    Ok(ResolvedSelect {
        key,
        hashes,
        lora_name: prompt.lora_name,
        overrides,
        routing_constraints: body.routing_constraints.take(),
    })
}

/// `POST /select` decided now (the queue's `admit` decides when to call it).
fn decide_select(state: &AppState, resolved: &ResolvedSelect, body: &SelectBody) -> ApiResult {
    let req = resolved.request(body, body.advisory);
    let start = Instant::now();
    let selection = state
        .selector
        .read()
        .select(&req, state.now(), &mut rand::rng())?;
    state
        .metrics
        .observe_phase("route", start.elapsed().as_secs_f64());
    let body = selection_json(&selection);
    state.metrics.observe_selection(selection);
    Ok(body)
}

/// `POST /select_and_reserve` decided now (`advisory` does not apply); also the booking's id.
fn decide_select_and_reserve(
    state: &AppState,
    resolved: &ResolvedSelect,
    body: &SelectBody,
) -> (ApiResult, Option<String>) {
    let req = resolved.request(body, false);
    let booked = state.selector.write().select_and_reserve(
        &req,
        body.reservation_id.as_deref(),
        state.now(),
        &mut rand::rng(),
    );
    // A refused booking may have dropped its session's binding.
    state.share_session_changes();
    let (selection, reservation) = match booked {
        Ok(b) => b,
        Err(e) => return (Err(e.into()), None),
    };
    state.sync.booking_changed(&reservation.reservation_id);
    let json = select_and_reserve_json(&selection, &reservation);
    state.metrics.observe_selection(selection);
    (Ok(json), Some(reservation.reservation_id))
}

/// `POST /reservations` (201).
pub fn create_reservation(state: &AppState, mut body: ReservationBody) -> ApiResult {
    let key = body.key()?;
    admit::check_id_not_queued(state, &key, body.selection_id.as_deref())?;
    let overrides = body.overrides()?;
    // The prompt matters only to the explicit form; a replay ignores it entirely.
    let explicit = body.worker_id.is_some();
    let has_prompt = body.has_prompt();
    let mut prompt = body.take_prompt();
    let input = if explicit && has_prompt {
        Some(prompt.resolve("sequence_hashes")?)
    } else {
        None
    };
    let core_prompt = match &input {
        Some(PromptInput::Tokens(tokens)) => Some(Prompt::Tokens {
            tokens: &tokens.tokens,
            lora_name: prompt.lora_name.as_deref(),
            cache_salt: prompt.cache_salt.as_deref(),
            extras: tokens.extras(),
        }),
        Some(PromptInput::Hashes(h)) => Some(Prompt::Hashes(h)),
        None => None,
    };
    let req = ReservationRequest {
        partition: &key,
        selection_id: body.selection_id.as_deref(),
        reservation_id: body.reservation_id.as_deref(),
        worker_id: body.worker_id,
        dp_rank: body.dp_rank,
        prompt: core_prompt,
        effective_prefill_tokens: body.effective_prefill_tokens,
        expected_output_tokens: body.expected_output_tokens,
        track_prefill_tokens: body.track_prefill_tokens,
        overrides,
        session_id: body.session(),
    };
    // A replay onto a rank with KV events books under the read lock; anything else takes the
    // write lock (LifecycleCalls).
    let reservation = state.selector.create_reservation(&req, state.now())?;
    state.sync.booking_changed(&reservation.reservation_id);
    state.share_session_changes();
    Ok(reservation_json(&reservation))
}

fn reservation_id(raw: &str) -> Result<&str, ApiError> {
    check_id("reservation_id", raw)?;
    Ok(raw)
}

/// `POST /reservations/{id}/prefill_complete`.
pub fn prefill_complete(state: &AppState, id: &str) -> ApiResult {
    let id = reservation_id(id)?;
    state.selector.prefill_complete(id, state.now())?;
    state.sync.booking_changed(id);
    admit_waiting(state);
    Ok(ok_status())
}

/// Frees a booking (no queue release: the caller decides when).
fn free_booking(state: &AppState, id: &str) -> Result<(), ApiError> {
    state.selector.free(id, state.now())?;
    state.sync.booking_changed(id);
    state.share_session_changes();
    Ok(())
}

/// `POST /reservations/{id}/output_block`.
pub fn output_block(state: &AppState, id: &str, decay_fraction: Option<f64>) -> ApiResult {
    let id = reservation_id(id)?;
    state
        .selector
        .output_block(id, decay_fraction, state.now())?;
    state.sync.output_block(id);
    Ok(ok_status())
}

/// `DELETE /reservations/{id}`.
pub fn free_reservation(state: &AppState, id: &str) -> ApiResult {
    let id = reservation_id(id)?;
    free_booking(state, id)?;
    admit_waiting(state);
    Ok(ok_status())
}

// ---------------------------------------------------------------------------------------------
// Inspection

fn resolve_prompt_route(
    state: &AppState,
    body: &mut PromptRouteBody,
) -> Result<(PartitionKey, PromptHashes), ApiError> {
    let key = body.key()?;
    let mut prompt = body.take_prompt();
    let input = prompt.resolve("block_hashes")?;
    let hashes = hash_for_partition(
        state,
        &key,
        input,
        prompt.lora_name.as_deref(),
        prompt.cache_salt.as_deref(),
    )?;
    Ok((key, hashes))
}

/// `POST /overlap_scores`.
pub fn overlap_scores(state: &AppState, mut body: PromptRouteBody) -> ApiResult {
    let (key, hashes) = resolve_prompt_route(state, &mut body)?;
    let scores = state
        .selector
        .read()
        .overlap_scores(&key, Prompt::Hashes(&hashes))?;
    Ok(overlap_scores_json(&scores))
}

/// `POST /potential_loads`.
pub fn potential_loads(state: &AppState, mut body: PromptRouteBody) -> ApiResult {
    let overrides = body.overrides()?;
    let (key, hashes) = resolve_prompt_route(state, &mut body)?;
    let loads = state
        .selector
        .read()
        .potential_loads(&key, Prompt::Hashes(&hashes), &overrides)?;
    Ok(json!(
        loads.iter().map(RankLoadJson::from).collect::<Vec<_>>()
    ))
}

/// `GET /loads`.
pub fn loads(state: &AppState, model_name: Option<&str>, routing_group: Option<&str>) -> Value {
    let mut loads = state.selector.read().loads(model_name, routing_group);
    if state.queues.settings().is_some() {
        // Dynamo's pending_count / pending_isl_tokens: what waits in the partition's queue.
        let waiting = state.queues.snapshot();
        for partition in &mut loads {
            if let Some(q) = waiting.get(&partition.partition) {
                partition.pending_count = q.count as u64;
                partition.pending_isl_tokens = q.isl_tokens;
            }
        }
    }
    loads_json(&loads)
}

fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "device",
        Tier::Host => "host_pinned",
        Tier::Disk => "disk",
    }
}

/// `GET /dump`: the index as Dynamo-shaped stored events, keyed `"{model}:{group}"`, from a
/// [`Selector::dump`](kvroute_core::selector::Selector::dump) taken under the lock: serializing a
/// large index takes a while, and must not hold the selector's lock meanwhile. It serializes
/// straight from the snapshot (no `Value` tree of a million events), in the shape and key order
/// `serde_json`'s maps give: keys sorted, events numbered in that order.
pub struct Dump(pub Vec<PartitionDump>);

impl serde::Serialize for Dump {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut keyed: Vec<(String, &PartitionDump)> = self
            .0
            .iter()
            .map(|p| {
                let key = format!("{}:{}", p.partition.model_name, p.partition.routing_group);
                (key, p)
            })
            .collect();
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        let mut map = serializer.serialize_map(Some(keyed.len()))?;
        let mut first_event_id = 0u64;
        for (key, partition) in keyed {
            map.serialize_entry(
                &key,
                &DumpPartition {
                    block_size: partition.block_size,
                    events: DumpEvents {
                        events: &partition.events,
                        first_event_id,
                    },
                },
            )?;
            first_event_id += partition
                .events
                .iter()
                .filter(|(_, e)| matches!(e, KvEvent::Stored { .. }))
                .count() as u64;
        }
        map.end()
    }
}

#[derive(serde::Serialize)]
struct DumpPartition<'a> {
    block_size: Option<u32>,
    events: DumpEvents<'a>,
}

/// A partition's stored events, numbered from `first_event_id`.
struct DumpEvents<'a> {
    events: &'a [(Rank, KvEvent)],
    first_event_id: u64,
}

impl serde::Serialize for DumpEvents<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = serializer.serialize_seq(None)?;
        let stored = self.events.iter().filter_map(|(rank, event)| match event {
            KvEvent::Stored {
                parent,
                blocks,
                tier,
            } => Some((rank, *parent, blocks, *tier)),
            _ => None,
        });
        for (event_id, (rank, parent_hash, blocks, tier)) in (self.first_event_id..).zip(stored) {
            seq.serialize_element(&DumpEvent {
                dp_rank: rank.dp_rank,
                event: DumpEventBody {
                    data: DumpData {
                        stored: DumpStored {
                            blocks: DumpBlocks(blocks),
                            parent_hash,
                            start_position: None,
                        },
                    },
                    dp_rank: rank.dp_rank,
                    event_id,
                },
                residency_domain: "worker",
                storage_tier: tier_name(tier),
                worker_id: rank.worker_id,
            })?;
        }
        seq.end()
    }
}

// Fields in alphabetical order: the order `serde_json`'s maps gave them.
#[derive(serde::Serialize)]
struct DumpEvent<'a> {
    dp_rank: u32,
    event: DumpEventBody<'a>,
    residency_domain: &'static str,
    storage_tier: &'static str,
    worker_id: u64,
}

#[derive(serde::Serialize)]
struct DumpEventBody<'a> {
    data: DumpData<'a>,
    dp_rank: u32,
    event_id: u64,
}

#[derive(serde::Serialize)]
struct DumpData<'a> {
    stored: DumpStored<'a>,
}

#[derive(serde::Serialize)]
struct DumpStored<'a> {
    blocks: DumpBlocks<'a>,
    parent_hash: Option<u64>,
    start_position: Option<u32>,
}

struct DumpBlocks<'a>(&'a [kvroute_core::event::StoredBlock]);

impl serde::Serialize for DumpBlocks<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().map(|b| DumpBlock {
            block_hash: b.engine_hash,
            mm_extra_info: None,
            tokens_hash: b.local_hash,
        }))
    }
}

#[derive(serde::Serialize)]
struct DumpBlock {
    block_hash: u64,
    mm_extra_info: Option<()>,
    tokens_hash: u64,
}

/// [`Dump`] as a JSON value (the Python binding's `indexer_snapshot`).
pub fn dump_json(partitions: Vec<PartitionDump>) -> Value {
    serde_json::to_value(Dump(partitions)).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::event::StoredBlock;

    fn key(model: &str, group: &str) -> PartitionKey {
        PartitionKey {
            model_name: model.to_string(),
            routing_group: group.to_string(),
        }
    }

    fn stored(parent: Option<u64>, blocks: &[(u64, u64)], tier: Tier) -> KvEvent {
        KvEvent::Stored {
            parent,
            blocks: blocks
                .iter()
                .map(|&(engine_hash, local_hash)| StoredBlock {
                    engine_hash,
                    local_hash,
                })
                .collect(),
            tier,
        }
    }

    /// The dump as it was built before (a `Value` per event, partitions in a sorted map), as
    /// the reference for the serializer.
    fn reference(partitions: &[PartitionDump]) -> Value {
        let mut sorted: Vec<&PartitionDump> = partitions.iter().collect();
        sorted.sort_by_key(|p| format!("{}:{}", p.partition.model_name, p.partition.routing_group));
        let mut out = serde_json::Map::new();
        let mut event_id = 0u64;
        for p in sorted {
            let mut events = Vec::new();
            for (rank, event) in &p.events {
                let KvEvent::Stored {
                    parent,
                    blocks,
                    tier,
                } = event
                else {
                    continue;
                };
                let blocks: Vec<Value> = blocks
                    .iter()
                    .map(|b| {
                        json!({"block_hash": b.engine_hash, "tokens_hash": b.local_hash,
                               "mm_extra_info": null})
                    })
                    .collect();
                events.push(json!({
                    "worker_id": rank.worker_id, "dp_rank": rank.dp_rank,
                    "storage_tier": tier_name(*tier), "residency_domain": "worker",
                    "event": {"event_id": event_id, "dp_rank": rank.dp_rank,
                              "data": {"stored": {"parent_hash": parent, "start_position": null,
                                                  "blocks": blocks}}},
                }));
                event_id += 1;
            }
            out.insert(
                format!("{}:{}", p.partition.model_name, p.partition.routing_group),
                json!({"block_size": p.block_size, "events": events}),
            );
        }
        Value::Object(out)
    }

    #[test]
    fn the_dump_serializes_as_the_value_it_stands_for() {
        let partitions = vec![
            PartitionDump {
                partition: key("m", "z"),
                block_size: Some(16),
                events: vec![
                    (
                        Rank::new(7, 1),
                        stored(None, &[(1, 11), (2, 12)], Tier::Device),
                    ),
                    (Rank::new(7, 1), KvEvent::Cleared),
                    (
                        Rank::new(8, 0),
                        stored(Some(2), &[(3, u64::MAX)], Tier::Host),
                    ),
                ],
            },
            PartitionDump {
                partition: key("m", "a"),
                block_size: None,
                events: vec![
                    (
                        Rank::new(9, 0),
                        KvEvent::Removed {
                            engine_hashes: vec![4],
                            tier: Tier::Disk,
                        },
                    ),
                    (Rank::new(9, 0), stored(None, &[(5, 15)], Tier::Disk)),
                ],
            },
            PartitionDump {
                partition: key("empty", "default"),
                block_size: Some(4),
                events: vec![],
            },
        ];
        let text = serde_json::to_vec(&Dump(partitions.clone())).unwrap();
        let parsed: Value = serde_json::from_slice(&text).unwrap();
        assert_eq!(parsed, reference(&partitions));
        assert_eq!(dump_json(partitions.clone()), reference(&partitions));
        // Keys come out sorted at every level, as `serde_json`'s maps wrote them.
        assert_eq!(text, serde_json::to_vec(&reference(&partitions)).unwrap());
    }
}
