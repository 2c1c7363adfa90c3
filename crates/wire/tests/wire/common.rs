//! Shared helpers: strategies for arbitrary batches and JSON views of decoded values.

use kvroute_core::event::{KvEvent, Tier};
use kvroute_core::hash::{BlockMmInfo, MmObject};
use kvroute_wire::{EventBatch, ExtraKey, RawEvent, RawRemoved, RawStored};
use proptest::prelude::*;
use serde_json::{Value, json};

/// The JSON shape of a raw event used by the fixture sidecars.
pub fn raw_event_json(event: &RawEvent) -> Value {
    match event {
        RawEvent::Stored(s) => json!({
            "type": "BlockStored",
            "block_hashes": s.block_hashes,
            "parent_block_hash": s.parent_block_hash,
            "token_ids": s.token_ids,
            "block_size": s.block_size,
            "lora_id": s.lora_id,
            "medium": s.medium,
            "lora_name": s.lora_name,
            "cache_salt": s.cache_salt(),
            "extra_keys_blocks": s.extra_keys.as_ref().map(Vec::len),
            "group_idx": s.group_idx,
            "kv_cache_spec_kind": s.kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": s.kv_cache_spec_sliding_window,
        }),
        RawEvent::Removed(r) => json!({
            "type": "BlockRemoved",
            "block_hashes": r.block_hashes,
            "medium": r.medium,
            "group_idx": r.group_idx,
        }),
        RawEvent::Cleared => json!({"type": "AllBlocksCleared"}),
        RawEvent::Unknown { tag } => json!({"type": "Unknown", "tag": tag}),
    }
}

fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "device",
        Tier::Host => "host",
        Tier::Disk => "disk",
    }
}

/// The JSON shape of a converted event used by the fixture sidecars.
pub fn kv_event_json(event: &KvEvent) -> Value {
    match event {
        KvEvent::Stored {
            parent,
            blocks,
            tier,
        } => json!({
            "type": "Stored",
            "parent": parent,
            "engine_hashes": blocks.iter().map(|b| b.engine_hash).collect::<Vec<_>>(),
            "local_hashes": blocks.iter().map(|b| b.local_hash).collect::<Vec<_>>(),
            "tier": tier_name(*tier),
        }),
        KvEvent::Removed {
            engine_hashes,
            tier,
        } => json!({
            "type": "Removed",
            "engine_hashes": engine_hashes,
            "tier": tier_name(*tier),
        }),
        KvEvent::Cleared => json!({"type": "Cleared"}),
    }
}

fn short_string() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-zA-Z0-9_:-]{1,12}",
        // Long enough for str8/str16 headers.
        "[a-z]{32,40}",
        Just("x".repeat(300)),
        // Non-ASCII.
        "\\PC{0,6}",
    ]
}

fn medium() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        Just(None),
        Just(Some("GPU".to_owned())),
        Just(Some("CPU".to_owned())),
        Just(Some("CPU_TIER2".to_owned())),
        short_string().prop_map(Some),
    ]
}

/// Any extra-key value with no NaN (so equality is meaningful) in canonical integer form.
pub fn extra_key() -> impl Strategy<Value = ExtraKey> {
    let leaf = prop_oneof![
        Just(ExtraKey::Nil),
        any::<bool>().prop_map(ExtraKey::Bool),
        (i64::MIN..0).prop_map(ExtraKey::Int),
        any::<u64>().prop_map(ExtraKey::UInt),
        (-1e12f64..1e12).prop_map(ExtraKey::Float),
        short_string().prop_map(ExtraKey::Str),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(ExtraKey::Bytes),
        (any::<i8>(), proptest::collection::vec(any::<u8>(), 0..20))
            .prop_map(|(kind, data)| ExtraKey::Ext { kind, data }),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(ExtraKey::Array),
            proptest::collection::vec((inner.clone(), inner), 0..3).prop_map(ExtraKey::Map),
        ]
    })
}

fn extra_keys() -> impl Strategy<Value = Option<Vec<Option<Vec<ExtraKey>>>>> {
    proptest::option::of(proptest::collection::vec(
        proptest::option::of(proptest::collection::vec(extra_key(), 0..4)),
        0..4,
    ))
}

fn hashes() -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(
        prop_oneof![0u64..300, any::<u64>(), (i64::MAX as u64)..=u64::MAX],
        0..6,
    )
}

fn mm_info() -> impl Strategy<Value = BlockMmInfo> {
    proptest::collection::vec(
        (
            any::<u64>(),
            proptest::collection::vec((any::<u64>(), any::<u64>()), 0..3),
        )
            .prop_map(|(mm_hash, offsets)| MmObject { mm_hash, offsets }),
        0..3,
    )
    .prop_map(|mm_objects| BlockMmInfo { mm_objects })
}

/// What the array form carries of a batch: no `cache_salt` or `block_mm_infos` (map only).
pub fn array_form(batch: &EventBatch) -> EventBatch {
    let mut batch = batch.clone();
    for event in &mut batch.events {
        if let RawEvent::Stored(stored) = event {
            stored.cache_salt = None;
            stored.block_mm_infos = None;
        }
    }
    batch
}

pub fn raw_stored() -> impl Strategy<Value = RawStored> {
    (
        (
            hashes(),
            proptest::option::of(any::<u64>()),
            proptest::collection::vec(any::<u32>(), 0..40),
            0u32..70_000,
            proptest::option::of(any::<u64>()),
            medium(),
        ),
        (
            proptest::option::of(short_string()),
            extra_keys(),
            proptest::option::of(any::<u32>()),
            proptest::option::of(prop_oneof![
                Just("full_attention".to_owned()),
                Just("sliding_window".to_owned()),
                short_string()
            ]),
            proptest::option::of(any::<u64>()),
        ),
        (
            any::<bool>(),
            proptest::option::of(short_string()),
            proptest::option::of(proptest::collection::vec(
                proptest::option::of(mm_info()),
                0..4,
            )),
        ),
    )
        .prop_map(
            |(
                (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium),
                (lora_name, extra_keys, group_idx, kv_cache_spec_kind, window),
                (is_eagle, cache_salt, block_mm_infos),
            )| RawStored {
                // An Eagle event's pairs need two tokens to say anything.
                is_eagle: is_eagle && token_ids.len() >= 2,
                cache_salt,
                block_mm_infos,
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx,
                kv_cache_spec_kind,
                kv_cache_spec_sliding_window: window,
            },
        )
}

pub fn raw_event() -> impl Strategy<Value = RawEvent> {
    prop_oneof![
        4 => raw_stored().prop_map(RawEvent::Stored),
        2 => (hashes(), medium(), proptest::option::of(any::<u32>())).prop_map(
            |(block_hashes, medium, group_idx)| RawEvent::Removed(RawRemoved {
                block_hashes,
                medium,
                group_idx,
            })
        ),
        1 => Just(RawEvent::Cleared),
        1 => "[A-Z][a-zA-Z]{0,12}"
            .prop_filter("known tags", |t| {
                !matches!(t.as_str(), "BlockStored" | "BlockRemoved" | "AllBlocksCleared")
            })
            .prop_map(|tag| RawEvent::Unknown { tag }),
    ]
}

pub fn event_batch() -> impl Strategy<Value = EventBatch> {
    (
        prop_oneof![Just(0.0), 0.0f64..2e9, -1e300f64..1e300],
        proptest::collection::vec(raw_event(), 0..8),
        proptest::option::of(any::<u32>()),
    )
        .prop_map(|(ts, events, data_parallel_rank)| EventBatch {
            ts,
            events,
            data_parallel_rank,
        })
}
