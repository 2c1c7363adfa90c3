//! KV events from Python: vLLM msgpack batches (bytes) and event dicts, both turned into
//! [`KvEvent`]s the way the live listener does, plus the outcome and dump dicts.
//!
//! Event dicts come in two forms, told apart by `"type"`:
//! - **vLLM form** (tokens; kvroute computes the local hashes, SPEC §3.1): `{"type":
//!   "BlockStored", "block_hashes": [...], "parent_block_hash": h | None, "token_ids": [...],
//!   "block_size": n, "medium": "GPU" | ..., "lora_name": s, "cache_salt": s,
//!   "block_mm_infos": [...], "is_eagle": b}` (`block_mm_infos` as the HTTP API takes it;
//!   `is_eagle`: `token_ids` are an Eagle prompt's, each block hashed with the next token), `{"type":
//!   "BlockRemoved", "block_hashes": [...], "medium": ...}`, `{"type": "AllBlocksCleared"}`.
//!   These go through `kvroute_wire::convert_event`, so hybrid-model groups, media and block
//!   counts are checked exactly as for engine messages (dropped events are counted).
//! - **kvroute form** (already hashed, as [`dump`](crate::index) emits): `{"type": "stored",
//!   "parent": h | None, "blocks": [{"engine_hash": h, "local_hash": h}], "tier": "device" |
//!   "host" | "disk"}`, `{"type": "removed", "engine_hashes": [...], "tier": ...}`, `{"type":
//!   "cleared"}`.
//!
//! Hashes are accepted signed or unsigned (64 bits either way) and emitted signed, as on the HTTP
//! API. Unknown keys are ignored, like unknown fields of engine events.

use crate::convert;
use kvroute_core::event::{KvEvent, StoredBlock, Tier};
use kvroute_core::index::ApplyOutcome;
use kvroute_service::http::types::{BlockMmInfoBody, WireHash, mm_infos_into_core};
use kvroute_wire::{ConversionOutcome, RawEvent, RawRemoved, RawStored};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, Deserialize)]
#[serde(tag = "type")]
enum EventDict {
    BlockStored {
        block_hashes: Vec<WireHash>,
        #[serde(default)]
        parent_block_hash: Option<WireHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        #[serde(default)]
        medium: Option<String>,
        #[serde(default)]
        lora_name: Option<String>,
        #[serde(default)]
        cache_salt: Option<String>,
        #[serde(default)]
        block_mm_infos: Option<Vec<Option<BlockMmInfoBody>>>,
        #[serde(default)]
        is_eagle: Option<bool>,
        #[serde(default)]
        group_idx: Option<u32>,
        #[serde(default)]
        kv_cache_spec_kind: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<WireHash>,
        #[serde(default)]
        medium: Option<String>,
        #[serde(default)]
        group_idx: Option<u32>,
    },
    AllBlocksCleared,
    #[serde(rename = "stored")]
    Stored {
        #[serde(default)]
        parent: Option<WireHash>,
        blocks: Vec<BlockDict>,
        #[serde(default)]
        tier: Option<String>,
    },
    #[serde(rename = "removed")]
    Removed {
        engine_hashes: Vec<WireHash>,
        #[serde(default)]
        tier: Option<String>,
    },
    #[serde(rename = "cleared")]
    Cleared,
}

#[derive(Debug, Deserialize)]
struct BlockDict {
    engine_hash: WireHash,
    local_hash: WireHash,
}

fn hashes(v: &[WireHash]) -> Vec<u64> {
    v.iter().map(|h| h.0).collect()
}

/// The tier of a kvroute-form event: kvroute's names, the dump's `host_pinned`, or an engine
/// medium (`GPU`, `CPU`, ...).
fn tier(name: Option<&str>) -> Result<Tier, String> {
    let Some(name) = name else {
        return Ok(Tier::Device);
    };
    match name.to_ascii_lowercase().as_str() {
        "device" => Ok(Tier::Device),
        "host" | "host_pinned" => Ok(Tier::Host),
        "disk" => Ok(Tier::Disk),
        _ => Tier::from_medium(Some(name))
            .ok_or_else(|| format!("tier: unknown tier {name:?} (expected device, host or disk)")),
    }
}

/// Converts event dicts. `Ok(None)` entries are events the wire conversion drops (counted in the
/// returned outcome), as it would for the same engine message.
pub fn from_dicts(events: &[Bound<'_, PyAny>]) -> PyResult<(Vec<KvEvent>, ConversionOutcome)> {
    let mut out = Vec::with_capacity(events.len());
    let mut outcome = ConversionOutcome::default();
    for (i, event) in events.iter().enumerate() {
        let at = format!("events[{i}]");
        let parsed: EventDict = convert::body_at(event, &at, &at)?;
        let raw = match parsed {
            EventDict::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_name,
                cache_salt,
                block_mm_infos,
                is_eagle,
                group_idx,
                kv_cache_spec_kind,
            } => {
                let blocks = block_hashes.len();
                RawEvent::Stored(RawStored {
                    block_hashes: hashes(&block_hashes),
                    parent_block_hash: parent_block_hash.map(|h| h.0),
                    token_ids,
                    block_size,
                    medium,
                    extra_keys: if parent_block_hash.is_none() {
                        kvroute_wire::vllm_extra_keys(
                            blocks,
                            lora_name.as_deref(),
                            cache_salt.as_deref(),
                        )
                    } else {
                        None
                    },
                    lora_name,
                    group_idx,
                    kv_cache_spec_kind,
                    is_eagle: is_eagle.unwrap_or(false),
                    block_mm_infos: block_mm_infos.map(mm_infos_into_core),
                    ..RawStored::default()
                })
            }
            EventDict::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => RawEvent::Removed(RawRemoved {
                block_hashes: hashes(&block_hashes),
                medium,
                group_idx,
            }),
            EventDict::AllBlocksCleared => RawEvent::Cleared,
            EventDict::Stored {
                parent,
                blocks,
                tier: t,
            } => {
                let event = KvEvent::Stored {
                    parent: parent.map(|h| h.0),
                    blocks: blocks
                        .iter()
                        .map(|b| StoredBlock {
                            engine_hash: b.engine_hash.0,
                            local_hash: b.local_hash.0,
                        })
                        .collect(),
                    tier: tier(t.as_deref())
                        .map_err(|e| PyValueError::new_err(format!("{at}.{e}")))?,
                };
                outcome.record(&Ok(event.clone()));
                out.push(event);
                continue;
            }
            EventDict::Removed {
                engine_hashes,
                tier: t,
            } => {
                let event = KvEvent::Removed {
                    engine_hashes: hashes(&engine_hashes),
                    tier: tier(t.as_deref())
                        .map_err(|e| PyValueError::new_err(format!("{at}.{e}")))?,
                };
                outcome.record(&Ok(event.clone()));
                out.push(event);
                continue;
            }
            EventDict::Cleared => {
                outcome.record(&Ok(KvEvent::Cleared));
                out.push(KvEvent::Cleared);
                continue;
            }
        };
        let result = kvroute_wire::convert_event(&raw);
        outcome.record(&result);
        if let Ok(event) = result {
            out.push(event);
        }
    }
    Ok((out, outcome))
}

/// A vLLM/SGLang msgpack batch payload (the last frame of a live message): its events and the
/// rank it names, if any. A payload that does not decode is a `ValueError`.
pub fn from_batch(payload: &[u8]) -> Result<kvroute_wire::Conversion, String> {
    let batch = kvroute_wire::decode_batch(payload).map_err(|e| e.to_string())?;
    Ok(kvroute_wire::to_kv_events(&batch))
}

/// What applying events did, as a dict.
pub fn outcome_json(applied: &ApplyOutcome, converted: &ConversionOutcome, dp_rank: u32) -> Value {
    json!({
        "dp_rank": dp_rank,
        "stored_blocks": applied.stored_blocks,
        "removed_blocks": applied.removed_blocks,
        "cleared_ranks": applied.cleared_ranks,
        "parent_block_not_found": applied.parent_block_not_found,
        "unknown_removed_blocks": applied.unknown_removed_blocks,
        "engine_hash_conflicts": applied.engine_hash_conflicts,
        "evicted_blocks": applied.evicted_blocks,
        "rank_capacity_exceeded": applied.rank_capacity_exceeded,
        "dropped_events": converted.dropped(),
    })
}

fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "device",
        Tier::Host => "host",
        Tier::Disk => "disk",
    }
}

/// One event in the kvroute dict form, for a rank (hashes signed, as on the HTTP API).
pub fn event_json(worker_id: u64, dp_rank: u32, event: &KvEvent) -> Value {
    let mut v = match event {
        KvEvent::Stored {
            parent,
            blocks,
            tier,
        } => json!({
            "type": "stored",
            "parent": parent.map(|h| h as i64),
            "blocks": blocks.iter().map(|b| json!({
                "engine_hash": b.engine_hash as i64,
                "local_hash": b.local_hash as i64,
            })).collect::<Vec<_>>(),
            "tier": tier_name(*tier),
        }),
        KvEvent::Removed {
            engine_hashes,
            tier,
        } => json!({
            "type": "removed",
            "engine_hashes": engine_hashes.iter().map(|&h| h as i64).collect::<Vec<_>>(),
            "tier": tier_name(*tier),
        }),
        KvEvent::Cleared => json!({"type": "cleared"}),
    };
    if let Some(obj) = v.as_object_mut() {
        obj.insert("worker_id".into(), json!(worker_id));
        obj.insert("dp_rank".into(), json!(dp_rank));
    }
    v
}

/// The events argument: a list (or tuple) of dicts.
pub fn event_list<'py>(events: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if events.is_instance_of::<pyo3::types::PyDict>()
        || events.is_instance_of::<pyo3::types::PyString>()
    {
        return Err(pyo3::exceptions::PyTypeError::new_err(
            "events must be a list of event dicts (or a vLLM batch as bytes)",
        ));
    }
    events.try_iter()?.collect()
}
