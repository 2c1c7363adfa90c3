//! Writes seed payloads for the `decode_batch` fuzz target (`fuzz/README.md`) into the directory
//! given: `BlockStored` batches whose token-id arrays are long enough for the 32-ids-a-window
//! reader, with ids of every msgpack width, in both layouts and both hash encodings.
//!
//!     cargo run -p kvroute-wire --example fuzz_seeds -- fuzz/corpus/decode_batch

use kvroute_wire::{
    EncodeOptions, Encoding, EventBatch, HashEncoding, RawEvent, RawStored, encode_batch,
};

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: fuzz_seeds DIR");
        std::process::exit(2);
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("cannot create {dir}: {e}");
        std::process::exit(1);
    }
    // Largest id of each width: positive fixint, uint8, uint16, uint32.
    let widths = [127u32, 255, 65_535, u32::MAX];
    let mut written = 0;
    for (w, &max) in widths.iter().enumerate() {
        for blocks in [2u64, 5, 9] {
            let block_size = 16u32;
            let tokens: Vec<u32> = (0..blocks as u32 * block_size)
                .map(|t| {
                    let mixed = t.wrapping_mul(2_654_435_761) % max.max(1);
                    // Every other run of ids of the widest width of this seed, the rest mixed.
                    if (t / 40) % 2 == 0 {
                        max - (t % 3)
                    } else {
                        mixed
                    }
                })
                .collect();
            let stored = RawStored {
                block_hashes: (1..=blocks).map(|b| b * 0x9E37_79B9).collect(),
                parent_block_hash: (blocks > 2).then_some(7),
                token_ids: tokens,
                block_size,
                ..RawStored::default()
            };
            let batch = EventBatch {
                ts: 1.5,
                events: vec![RawEvent::Stored(stored)],
                data_parallel_rank: Some(0),
            };
            for encoding in [Encoding::Array, Encoding::Map] {
                for hashes in [HashEncoding::Unsigned, HashEncoding::Signed] {
                    let bytes = encode_batch(&batch, EncodeOptions { encoding, hashes });
                    let path = format!("{dir}/long_tokens_w{w}_b{blocks}_{encoding:?}_{hashes:?}");
                    if let Err(e) = std::fs::write(&path, bytes) {
                        eprintln!("cannot write {path}: {e}");
                        std::process::exit(1);
                    }
                    written += 1;
                }
            }
        }
    }
    println!("wrote {written} seeds into {dir}");
}
