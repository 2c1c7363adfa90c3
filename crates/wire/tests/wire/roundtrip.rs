//! Encode → decode round trips, checked against an independent msgpack reader (rmpv).

use kvroute_wire::{
    EncodeOptions, Encoding, EventBatch, HashEncoding, RawEvent, RawStored, decode_batch,
    encode_batch, encode_batch_into, to_kv_events, vllm_extra_keys,
};
use proptest::prelude::*;
use rmpv::Value;

use crate::common::event_batch;

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
            prop_assert_eq!(decode_batch(&bytes), Ok(batch.clone()), "{:?}", options);
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
