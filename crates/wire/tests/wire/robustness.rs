//! Arbitrary and corrupted input never panics, and costs at most linear work.

use kvroute_wire::{EncodeOptions, Encoding, WireError, decode_batch, encode_batch};
use proptest::prelude::*;

use crate::common::event_batch;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    /// Arbitrary bytes behind a valid-looking prefix reach deeper into the decoder.
    #[test]
    fn arbitrary_bytes_after_a_batch_prefix_never_panic(
        prefix in prop_oneof![
            Just(vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x9c, 0xab]),
            Just(b"\x93\xcb\0\0\0\0\0\0\0\0\x91\x9c\xabBlockStored".to_vec()),
            Just(b"\x82\xa2ts\x00\xa6events\x91\x88\xa4type\xabBlockStored".to_vec()),
            Just(b"\x92\x00\x91\x94\xacBlockRemoved".to_vec()),
        ],
        tail in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut bytes = prefix;
        bytes.extend(tail);
        let _ = decode_batch(&bytes);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Valid payloads with a few bytes overwritten: every field decoder sees wrong types.
    #[test]
    fn corrupted_payloads_never_panic(
        batch in event_batch(),
        map in any::<bool>(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let encoding = if map { Encoding::Map } else { Encoding::Array };
        let mut bytes = encode_batch(&batch, EncodeOptions { encoding, ..EncodeOptions::default() });
        for (index, value) in edits {
            let i = index.index(bytes.len());
            bytes[i] = value;
        }
        let _ = decode_batch(&bytes);
    }
}

#[test]
fn header_lengths_cannot_force_big_allocations() {
    // A batch whose events array claims 2^32 - 1 elements, each claiming to be an array32 of
    // 2^32 - 1 elements: fails fast on truncation.
    let mut bytes = vec![0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
    bytes.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    assert!(matches!(
        decode_batch(&bytes),
        Err(WireError::Truncated { .. })
    ));
}

#[test]
fn nesting_bombs_are_refused() {
    // An unknown trailing batch element nested 10,000 levels deep.
    let mut bytes = vec![0x94, 0x00, 0x90, 0xc0];
    bytes.extend(std::iter::repeat_n(0x91, 10_000));
    bytes.push(0xc0);
    assert!(matches!(
        decode_batch(&bytes),
        Err(WireError::TooDeep { .. })
    ));
    // Same inside an event's extra keys.
    let mut bytes = b"\x92\x00\x91\x86\xa4type\xabBlockStored".to_vec();
    bytes.extend(b"\xacblock_hashes\x90\xa9token_ids\x90\xaablock_size\x01");
    bytes.extend(b"\xaaextra_keys\x91\x91");
    bytes.extend(std::iter::repeat_n(0x91, 10_000));
    bytes.push(0xc0);
    bytes.extend(b"\xa5x\x00");
    assert!(matches!(
        decode_batch(&bytes),
        Err(WireError::TooDeep { .. })
    ));
}
