//! Fuzzes `decode_batch` on arbitrary payloads. Beyond "never panics", every payload that
//! decodes must survive a round trip: re-encoding it in either layout and decoding again gives
//! the same bytes on the next encode (compared as bytes, so a NaN timestamp compares equal).
//! Decoded batches also go through the conversion, which hashes tokens by block size.
#![no_main]

use kvroute_wire::{
    EncodeOptions, Encoding, HashEncoding, decode_batch, encode_batch, to_kv_events,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|payload: &[u8]| {
    let Ok(batch) = decode_batch(payload) else {
        return;
    };
    let _ = to_kv_events(&batch);
    for encoding in [Encoding::Array, Encoding::Map] {
        for hashes in [
            HashEncoding::Unsigned,
            HashEncoding::Signed,
            HashEncoding::Bytes,
        ] {
            let options = EncodeOptions { encoding, hashes };
            let first = encode_batch(&batch, options);
            let again = match decode_batch(&first) {
                Ok(again) => again,
                Err(error) => panic!("re-encoded batch does not decode: {error}"),
            };
            assert!(
                encode_batch(&again, options) == first,
                "round trip changed the batch"
            );
        }
    }
});
