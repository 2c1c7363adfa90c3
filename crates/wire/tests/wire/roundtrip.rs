//! Encode → decode round trips, checked against an independent msgpack reader (rmpv).

use kvroute_wire::{
    EncodeOptions, Encoding, EventBatch, HashEncoding, RawEvent, RawStored, decode_batch,
    encode_batch, encode_batch_into, to_kv_events, vllm_extra_keys,
};
use proptest::prelude::*;
use rmpv::Value;

use crate::common::{array_form, event_batch};

const ALL_OPTIONS: [EncodeOptions; 6] = [
    EncodeOptions {
        encoding: Encoding::Array,
        hashes: HashEncoding::Unsigned,
    },
    EncodeOptions {
        encoding: Encoding::Array,
        hashes: HashEncoding::Signed,
    },
    EncodeOptions {
        encoding: Encoding::Array,
        hashes: HashEncoding::Bytes,
    },
    EncodeOptions {
        encoding: Encoding::Map,
        hashes: HashEncoding::Unsigned,
    },
    EncodeOptions {
        encoding: Encoding::Map,
        hashes: HashEncoding::Signed,
    },
    EncodeOptions {
        encoding: Encoding::Map,
        hashes: HashEncoding::Bytes,
    },
];

fn read_with_rmpv(bytes: &[u8]) -> Value {
    let mut cursor = bytes;
    let value = rmpv::decode::read_value(&mut cursor).unwrap();
    assert!(cursor.is_empty(), "{} bytes left by rmpv", cursor.len());
    value
}

fn str_of(value: &Value) -> &str {
    value.as_str().unwrap()
}

/// The tag of one encoded event, read with rmpv.
fn tag_of(event: &Value) -> String {
    match event {
        Value::Array(items) => str_of(&items[0]).to_owned(),
        Value::Map(pairs) => pairs
            .iter()
            .find(|(k, _)| k.as_str() == Some("type"))
            .map(|(_, v)| str_of(v).to_owned())
            .unwrap(),
        other => panic!("event is {other:?}"),
    }
}

fn expected_tag(event: &RawEvent) -> &str {
    match event {
        RawEvent::Stored(_) => "BlockStored",
        RawEvent::Removed(_) => "BlockRemoved",
        RawEvent::Cleared => "AllBlocksCleared",
        RawEvent::Unknown { tag } => tag,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn decode_inverts_encode(batch in event_batch()) {
        for options in ALL_OPTIONS {
            let bytes = encode_batch(&batch, options);
            let expected = match options.encoding {
                Encoding::Array => array_form(&batch),
                Encoding::Map => batch.clone(),
            };
            prop_assert_eq!(decode_batch(&bytes), Ok(expected), "{:?}", options);
        }
    }

    #[test]
    fn encoded_batches_are_well_formed_for_another_reader(batch in event_batch()) {
        for options in ALL_OPTIONS {
            let value = read_with_rmpv(&encode_batch(&batch, options));
            let events = match (&value, options.encoding) {
                (Value::Array(items), Encoding::Array) => {
                    prop_assert_eq!(items.len(), 3);
                    prop_assert_eq!(items[0].as_f64(), Some(batch.ts));
                    items[1].as_array().unwrap().clone()
                }
                (Value::Map(pairs), Encoding::Map) => {
                    prop_assert_eq!(pairs.len(), 2 + usize::from(batch.data_parallel_rank.is_some()));
                    pairs[1].1.as_array().unwrap().clone()
                }
                (other, encoding) => panic!("{encoding:?} batch encoded as {other:?}"),
            };
            prop_assert_eq!(events.len(), batch.events.len());
            for (value, event) in events.iter().zip(&batch.events) {
                prop_assert_eq!(tag_of(value), expected_tag(event));
                if let (Value::Array(items), RawEvent::Stored(_)) = (value, event) {
                    // msgspec writes every field of an array-like struct.
                    prop_assert_eq!(items.len(), 12);
                }
            }
        }
    }

    #[test]
    fn encode_into_appends(batch in event_batch(), prefix in proptest::collection::vec(any::<u8>(), 0..8)) {
        let mut out = prefix.clone();
        encode_batch_into(&batch, EncodeOptions::default(), &mut out);
        prop_assert_eq!(&out[..prefix.len()], &prefix[..]);
        prop_assert_eq!(&out[prefix.len()..], &encode_batch(&batch, EncodeOptions::default())[..]);
    }
}

#[test]
fn a_fake_engine_batch_converts_to_the_hashes_a_prompt_gets() {
    // What a fake engine would publish for a salted LoRA prompt of 3 blocks.
    let tokens: Vec<u32> = (1..=12).collect();
    let stored = RawStored {
        block_hashes: vec![u64::MAX, 1 << 63, 7],
        token_ids: tokens.clone(),
        block_size: 4,
        lora_name: Some("adapter-a".into()),
        extra_keys: vllm_extra_keys(3, Some("adapter-a"), Some("salt-1")),
        medium: Some("GPU".into()),
        ..RawStored::default()
    };
    let batch = EventBatch {
        ts: 1.0,
        events: vec![RawEvent::Stored(stored)],
        data_parallel_rank: Some(3),
    };
    let seed = kvroute_core::hash::seed_for(Some("adapter-a"), Some("salt-1"));
    let expected = kvroute_core::hash::local_hashes(&tokens, 4, seed);
    for options in ALL_OPTIONS {
        let conversion = to_kv_events(&decode_batch(&encode_batch(&batch, options)).unwrap());
        assert_eq!(conversion.data_parallel_rank, Some(3));
        let [kvroute_core::event::KvEvent::Stored { blocks, .. }] = &conversion.events[..] else {
            panic!("{:?}", conversion.events);
        };
        let local: Vec<u64> = blocks.iter().map(|b| b.local_hash).collect();
        assert_eq!(local, expected, "{options:?}");
        let engine: Vec<u64> = blocks.iter().map(|b| b.engine_hash).collect();
        assert_eq!(engine, [u64::MAX, 1 << 63, 7]);
    }
}

/// An event written by another msgpack writer (rmpv), as SGLang and Dynamo's publishers write it.
fn batch_of(event: Vec<(&str, Value)>) -> Vec<u8> {
    let event = Value::Map(
        event
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    );
    let batch = Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![event]),
        Value::Nil,
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

fn local_hashes_of(payload: &[u8]) -> Vec<u64> {
    let conversion = to_kv_events(&decode_batch(payload).unwrap());
    let [kvroute_core::event::KvEvent::Stored { blocks, .. }] = &conversion.events[..] else {
        panic!("{:?}", conversion);
    };
    blocks.iter().map(|b| b.local_hash).collect()
}

fn u64s(values: &[u64]) -> Value {
    Value::Array(values.iter().map(|&v| Value::from(v)).collect())
}

#[test]
fn sglang_eagle_bigrams_hash_as_an_eagle_request() {
    use kvroute_core::hash::{BASE_SEED, BlockExtras, PromptHashes};
    // Prompt 1..=9 at block size 4: pairs (1,2) .. (8,9) make two Eagle blocks.
    let prompt: Vec<u32> = (1..=9).collect();
    let pairs = Value::Array(
        prompt
            .windows(2)
            .map(|p| Value::Array(vec![Value::from(p[0]), Value::from(p[1])]))
            .collect(),
    );
    let payload = batch_of(vec![
        ("type", Value::from("BlockStored")),
        ("block_hashes", u64s(&[101, 102])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", pairs),
        ("block_size", Value::from(4)),
        ("lora_id", Value::Nil),
        ("medium", Value::Nil),
    ]);
    let RawEvent::Stored(stored) = &decode_batch(&payload).unwrap().events[0] else {
        panic!("not stored");
    };
    assert!(stored.is_eagle);
    assert_eq!(stored.token_ids, prompt);
    let request = PromptHashes::from_tokens_with(
        &prompt,
        4,
        BASE_SEED,
        BlockExtras {
            is_eagle: true,
            block_mm_infos: &[],
        },
    );
    assert_eq!(local_hashes_of(&payload), request.local);
    // Our encoder writes the same pairs back.
    for options in ALL_OPTIONS {
        let batch = decode_batch(&payload).unwrap();
        assert_eq!(decode_batch(&encode_batch(&batch, options)), Ok(batch));
    }
    // A pair of three ids is a malformed message, not a panic.
    let bad = batch_of(vec![
        ("type", Value::from("BlockStored")),
        ("block_hashes", u64s(&[101])),
        ("token_ids", Value::Array(vec![u64s(&[1, 2, 3])])),
        ("block_size", Value::from(1)),
    ]);
    assert!(decode_batch(&bad).is_err());
}

#[test]
fn dynamo_block_mm_infos_keys_hash_as_a_multimodal_request() {
    use kvroute_core::hash::{BASE_SEED, BlockExtras, BlockMmInfo, MmObject, PromptHashes};
    let prompt: Vec<u32> = (1..=8).collect();
    let object = |mm_hash: u64| {
        Value::Map(vec![
            (Value::from("mm_hash"), Value::from(mm_hash)),
            (Value::from("offsets"), Value::Array(vec![u64s(&[0, 4])])),
        ])
    };
    let infos = Value::Array(vec![
        Value::Nil,
        Value::Map(vec![(
            Value::from("mm_objects"),
            Value::Array(vec![object(u64::MAX), object(3)]),
        )]),
    ]);
    let payload = batch_of(vec![
        ("type", Value::from("BlockStored")),
        ("block_hashes", u64s(&[1, 2])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", u64s(&[1, 2, 3, 4, 5, 6, 7, 8])),
        ("block_size", Value::from(4)),
        ("block_mm_infos", infos),
        ("cache_salt", Value::from("tenant-a")),
    ]);
    let mm = |hashes: &[u64]| BlockMmInfo {
        mm_objects: hashes
            .iter()
            .map(|&mm_hash| MmObject {
                mm_hash,
                offsets: vec![(0, 4)],
            })
            .collect(),
    };
    let request_infos = [None, Some(mm(&[3, u64::MAX]))];
    let request = PromptHashes::from_tokens_with(
        &prompt,
        4,
        kvroute_core::hash::seed_for(None, Some("tenant-a")),
        BlockExtras {
            is_eagle: false,
            block_mm_infos: &request_infos,
        },
    );
    assert_eq!(local_hashes_of(&payload), request.local);
    let plain = PromptHashes::from_tokens(&prompt, 4, BASE_SEED);
    assert_ne!(request.local[1], plain.local[1]);
    // Shapes Dynamo rejects are malformed messages, never panics.
    for bad in [
        Value::Array(vec![Value::Map(vec![])]),
        Value::Array(vec![Value::Map(vec![(
            Value::from("mm_objects"),
            Value::Array(vec![Value::Map(vec![(
                Value::from("mm_hash"),
                Value::from(5),
            )])]),
        )])]),
        Value::Array(vec![Value::Map(vec![(
            Value::from("mm_objects"),
            Value::Array(vec![Value::Map(vec![
                (Value::from("mm_hash"), Value::from(-1)),
                (Value::from("offsets"), Value::Array(vec![])),
            ])]),
        )])]),
        Value::Array(vec![Value::Map(vec![(
            Value::from("mm_objects"),
            Value::Array(vec![Value::Map(vec![
                (Value::from("mm_hash"), Value::from(5)),
                (Value::from("offsets"), Value::Array(vec![u64s(&[0, 1, 2])])),
            ])]),
        )])]),
        Value::from("not a list"),
    ] {
        let payload = batch_of(vec![
            ("type", Value::from("BlockStored")),
            ("block_hashes", u64s(&[1])),
            ("token_ids", u64s(&[1, 2, 3, 4])),
            ("block_size", Value::from(4)),
            ("block_mm_infos", bad.clone()),
        ]);
        assert!(decode_batch(&payload).is_err(), "{bad}");
    }
}

/// Dynamo's own publishers append `block_mm_infos` to vLLM's array layout, after `extra_keys`
/// (position 9, where vLLM has the integer `group_idx`); Dynamo reads it there.
#[test]
fn block_mm_infos_after_extra_keys_in_the_array_form_are_read() {
    use kvroute_core::hash::{BlockMmInfo, MmObject};
    let info = Value::Map(vec![(
        Value::from("mm_objects"),
        Value::Array(vec![Value::Map(vec![
            (Value::from("mm_hash"), Value::from(0xDEAD_BEEFu64)),
            (Value::from("offsets"), Value::Array(vec![u64s(&[0, 3])])),
        ])]),
    )]);
    let event = Value::Array(vec![
        Value::from("BlockStored"),
        u64s(&[1001, 1002]),
        Value::Nil,
        u64s(&[1, 2, 3, 4, 5, 6, 7, 8]),
        Value::from(4),
        Value::Nil,
        Value::from("GPU"),
        Value::Nil,
        Value::Nil,
        Value::Array(vec![info, Value::Nil]),
    ]);
    let batch = Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![event]),
        Value::from(0),
    ]);
    let mut payload = Vec::new();
    rmpv::encode::write_value(&mut payload, &batch).unwrap();
    let RawEvent::Stored(stored) = &decode_batch(&payload).unwrap().events[0] else {
        panic!("not stored");
    };
    assert_eq!(stored.group_idx, None);
    assert_eq!(
        stored.block_mm_infos,
        Some(vec![
            Some(BlockMmInfo {
                mm_objects: vec![MmObject {
                    mm_hash: 0xDEAD_BEEF,
                    offsets: vec![(0, 3)],
                }],
            }),
            None,
        ])
    );
    // Dynamo 1.6.1's own local hash of block 0 with that image (its /dump in multimodal.json).
    assert_eq!(local_hashes_of(&payload)[0], 15_207_512_089_340_001_072);
}
