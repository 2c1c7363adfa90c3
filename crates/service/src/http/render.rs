//! The JSON of the service's answers: typed results (`crate::api`) rendered at the HTTP edge,
//! in Dynamo's shapes (field names, nesting, key order). The Python binding renders through
//! these too, so a dict and an HTTP body cannot differ.

use crate::api::{Booked, DisaggSelected};
use crate::degraded::Degraded;
use crate::types::{signed, worker_json};
use kvroute_core::event::{KvEvent, Rank, Tier};
use kvroute_core::selector::{
    CacheModelReport, OverlapScores, PartitionDump, PartitionLoads, PdBypass, RankLoadReport,
    ReadyState, Reservation, Selection, WorkerRecord,
};
use serde::Serialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// `{"status": "ok"}`.
pub fn ok_status() -> Value {
    json!({"status": "ok"})
}

/// A worker's catalog record.
pub fn worker(record: &WorkerRecord) -> Value {
    worker_json(record)
}

/// `GET /workers`.
pub fn workers(records: &[WorkerRecord]) -> Value {
    Value::Array(records.iter().map(worker_json).collect())
}

/// `GET /ready`'s body.
pub fn ready(ready: &ReadyState) -> Value {
    json!({
        "ready": ready.ready,
        "schedulable_workers": ready.schedulable_workers,
        "workers": ready.workers.iter().map(worker_json).collect::<Vec<_>>(),
    })
}

/// `POST /potential_loads`.
pub fn potential_loads(loads: &[RankLoadReport]) -> Value {
    json!(loads.iter().map(RankLoadJson::from).collect::<Vec<_>>())
}

/// `POST /select_and_reserve`.
pub fn booked(booked: &Booked) -> Value {
    select_and_reserve_json(&booked.selection, &booked.reservation)
}

/// The `/select` response body.
pub fn selection(s: &Selection) -> Value {
    let dp: BTreeMap<String, u64> = s
        .overlap
        .dp
        .iter()
        .map(|(r, t)| (r.to_string(), *t))
        .collect();
    let mut v = json!({
        "model_name": s.partition.model_name,
        "routing_group": s.partition.routing_group,
        "worker_id": s.worker_id,
        "dp_rank": s.dp_rank,
        "endpoint": s.endpoint,
        "block_size": s.block_size,
        "overlap": {
            "longest_matched": s.overlap.longest_matched,
            "gpu": s.overlap.gpu,
            "dp": dp,
            "cpu": s.overlap.cpu,
            "disk": s.overlap.disk,
        },
        "effective_prefill_tokens": s.effective_prefill_tokens,
        "potential_decode_blocks": s.potential_decode_blocks,
    });
    if let Some(obj) = v.as_object_mut() {
        if let Some(id) = &s.selection_id {
            obj.insert("selection_id".into(), json!(id));
        }
        if let Some(load) = &s.worker_load {
            let mut wl = json!({
                "active_prefill_tokens": load.active_prefill_tokens,
                "prefill_token_capacity": load.prefill_token_capacity,
            });
            if let (Some(total), Some(o)) = (load.total_kv_blocks, wl.as_object_mut()) {
                o.insert("total_kv_blocks".into(), json!(total));
            }
            obj.insert("worker_load".into(), wl);
        }
    }
    v
}

fn select_and_reserve_json(s: &Selection, r: &Reservation) -> Value {
    let mut v = selection(s);
    if let Some(obj) = v.as_object_mut() {
        obj.insert("selection_id".into(), json!(r.selection_id));
        obj.insert("reservation_id".into(), json!(r.reservation_id));
        obj.insert("sequence_hashes".into(), json!(signed(&s.sequence_hashes)));
        obj.insert("isl_tokens".into(), json!(s.isl_tokens));
        obj.insert("track_prefill_tokens".into(), json!(s.track_prefill_tokens));
    }
    v
}

/// The answer of a disaggregated `/select` or `/select_and_reserve` (SPEC §6.1): each leg in the
/// shape of the plain route's answer, the prefill pick with its `bootstrap_port`.
pub fn disaggregated(d: &DisaggSelected) -> Value {
    let s = &d.selection;
    let leg = |sel: &Selection, booking: Option<&Reservation>| match booking {
        Some(r) => select_and_reserve_json(sel, r),
        None => selection(sel),
    };
    let prefill = s.prefill.as_ref().map(|p| {
        let mut v = leg(p, d.reservations.as_ref().and_then(|r| r.prefill.as_ref()));
        if let Some(obj) = v.as_object_mut() {
            obj.insert("bootstrap_port".into(), json!(p.bootstrap_port));
        }
        v
    });
    json!({
        "disaggregated": true,
        "bypass": s.bypass.map(PdBypass::as_str),
        "prefill": prefill,
        "decode": leg(&s.decode, d.reservations.as_ref().map(|r| &r.decode)),
    })
}

pub fn reservation(r: &Reservation) -> Value {
    json!({
        "reservation_id": r.reservation_id,
        "selection_id": r.selection_id.as_deref().unwrap_or(&r.reservation_id),
        "model_name": r.partition.model_name,
        "routing_group": r.partition.routing_group,
        "worker_id": r.worker_id,
        "dp_rank": r.dp_rank,
        "endpoint": r.endpoint,
    })
}

#[derive(Debug, Serialize)]
struct RankLoadJson {
    worker_id: u64,
    dp_rank: u32,
    potential_prefill_tokens: u64,
    potential_decode_blocks: u64,
    active_requests: u64,
    /// How the rank's cache is known (kvroute addition, `/loads` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_model: Option<Value>,
    /// Why the worker's routing is degraded, and what to fix (kvroute addition, `/loads` only,
    /// only while there is a reason: `crate::degraded`).
    #[serde(skip_serializing_if = "Option::is_none")]
    degraded: Option<Vec<Value>>,
}

/// `{"policy": "events" | "ttl" | "lru", ...}` with the model's block counts.
fn cache_model_json(model: &CacheModelReport) -> Value {
    match model {
        CacheModelReport::Events => json!({"policy": "events"}),
        CacheModelReport::Ttl { blocks } => json!({"policy": "ttl", "predicted_blocks": blocks}),
        CacheModelReport::Lru(s) => json!({
            "policy": "lru",
            "capacity_blocks": s.capacity_blocks,
            "resident_blocks": s.resident_blocks,
            "active_blocks": s.active_blocks,
            "inactive_blocks": s.inactive_blocks,
            "overcapacity_blocks": s.overcapacity_blocks,
            "indexed_blocks": s.indexed_blocks,
            "leases": s.leases,
        }),
    }
}

impl From<&RankLoadReport> for RankLoadJson {
    fn from(r: &RankLoadReport) -> Self {
        Self {
            worker_id: r.worker_id,
            dp_rank: r.dp_rank,
            potential_prefill_tokens: r.potential_prefill_tokens,
            potential_decode_blocks: r.potential_decode_blocks,
            active_requests: r.active_requests,
            cache_model: r.cache_model.as_ref().map(cache_model_json),
            degraded: None,
        }
    }
}

pub fn loads(loads: &[PartitionLoads]) -> Value {
    loads_with_degraded(loads, &BTreeMap::new())
}

/// `GET /loads` with each degraded worker's reasons on its ranks:
/// `"degraded": [{"reason": "no_kv_events", "message": "worker 3: …"}]`, left out when none.
pub fn loads_with_degraded(
    loads: &[PartitionLoads],
    degraded: &BTreeMap<u64, Vec<Degraded>>,
) -> Value {
    let rank = |r: &RankLoadReport| {
        let mut json = RankLoadJson::from(r);
        json.degraded = degraded.get(&r.worker_id).map(|reasons| {
            reasons
                .iter()
                .map(|d| json!({"reason": d.reason.as_str(), "message": d.message}))
                .collect()
        });
        json
    };
    Value::Array(
        loads
            .iter()
            .map(|p| {
                json!({
                    "model_name": p.partition.model_name,
                    "routing_group": p.partition.routing_group,
                    "loads": p.loads.iter().map(rank).collect::<Vec<_>>(),
                    "pending_count": p.pending_count,
                    "pending_isl_tokens": p.pending_isl_tokens,
                })
            })
            .collect(),
    )
}

pub fn overlap_scores(s: &OverlapScores) -> Value {
    json!({
        "block_size": s.block_size,
        "num_blocks": s.num_blocks,
        "workers": s.workers.iter().map(|w| json!({
            "worker_id": w.worker_id,
            "dp_rank": w.dp_rank,
            "device_blocks": w.device_blocks,
            "host_pinned_blocks": w.host_pinned_blocks,
            "disk_blocks": w.disk_blocks,
            "host_pinned_extension_blocks": w.host_pinned_blocks - w.device_blocks,
            "disk_extension_blocks": w.disk_blocks - w.host_pinned_blocks,
            "shared_beyond_device_blocks": null,
        })).collect::<Vec<_>>(),
        "shared_cache": {"enabled": false, "total_hit_blocks": 0, "ranges": [], "error": null},
    })
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
    use kvroute_core::error::PartitionKey;
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
