//! Decoding (and converting) a realistic KV-event batch: 32 `BlockStored` events of 16 blocks
//! × 64 tokens each, in both encodings, plus a 100-event mixed batch.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_wire::{
    EncodeOptions, Encoding, EventBatch, HashEncoding, RawEvent, RawRemoved, RawStored,
    decode_batch, encode_batch, to_kv_events,
};

/// Token ids as a real tokenizer's output looks to the decoder: spread over a 151,936-token
/// vocabulary, so the one-, three- and five-byte forms follow each other at random.
fn vocabulary_tokens(n: u32, salt: u32) -> Vec<u32> {
    (0..n)
        .map(|t| {
            let mut z = u64::from(t ^ (salt << 20)).wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % 151_936) as u32
        })
        .collect()
}

fn stored_batch(events: usize, blocks: usize, block_size: u32) -> EventBatch {
    stored_batch_with(events, blocks, block_size, |e, n| {
        (0..n)
            .map(|t| (t * 7919 + e as u32 * 104_729) % 151_000)
            .collect()
    })
}

fn stored_batch_with(
    events: usize,
    blocks: usize,
    block_size: u32,
    tokens: impl Fn(usize, u32) -> Vec<u32>,
) -> EventBatch {
    let mut next_hash = 0x9e37_79b9_7f4a_7c15u64;
    let events = (0..events)
        .map(|e| {
            let block_hashes: Vec<u64> = (0..blocks)
                .map(|_| {
                    next_hash = next_hash.wrapping_mul(6364136223846793005).wrapping_add(1);
                    next_hash
                })
                .collect();
            let token_ids = tokens(e, blocks as u32 * block_size);
            RawEvent::Stored(RawStored {
                block_hashes,
                parent_block_hash: (e % 2 == 1).then_some(next_hash ^ 0xdead_beef),
                token_ids,
                block_size,
                medium: Some("GPU".into()),
                ..RawStored::default()
            })
        })
        .collect();
    EventBatch {
        ts: 1_760_000_000.25,
        events,
        data_parallel_rank: Some(0),
    }
}

fn mixed_batch() -> EventBatch {
    let mut batch = stored_batch(50, 4, 16);
    for i in 0..50u64 {
        batch.events.push(RawEvent::Removed(RawRemoved {
            block_hashes: vec![i << 40, (i << 40) + 1],
            medium: Some("GPU".into()),
            group_idx: None,
        }));
    }
    batch
}

fn bench_decode(c: &mut Criterion) {
    let batch = stored_batch(32, 16, 64);
    let mut group = c.benchmark_group("decode_batch");
    for (name, encoding) in [("array", Encoding::Array), ("map", Encoding::Map)] {
        let payload = encode_batch(
            &batch,
            EncodeOptions {
                encoding,
                hashes: HashEncoding::Unsigned,
            },
        );
        group.throughput(Throughput::Bytes(payload.len() as u64));
        group.bench_function(format!("32_stored_x_16_blocks_x_64_tokens/{name}"), |b| {
            b.iter(|| decode_batch(black_box(&payload)))
        });
    }
    let random = encode_batch(
        &stored_batch_with(32, 16, 64, |e, n| vocabulary_tokens(n, e as u32)),
        EncodeOptions::default(),
    );
    group.throughput(Throughput::Bytes(random.len() as u64));
    group.bench_function("32_stored_x_16_blocks_x_64_vocabulary_tokens/array", |b| {
        b.iter(|| decode_batch(black_box(&random)))
    });
    let mixed = encode_batch(&mixed_batch(), EncodeOptions::default());
    group.throughput(Throughput::Elements(100));
    group.bench_function("100_events_mixed/array", |b| {
        b.iter(|| decode_batch(black_box(&mixed)))
    });
    group.finish();

    let mut group = c.benchmark_group("decode_and_convert");
    let payload = encode_batch(&batch, EncodeOptions::default());
    group.throughput(Throughput::Elements(32 * 16));
    group.bench_function("32_stored_x_16_blocks_x_64_tokens/array", |b| {
        b.iter(|| {
            let decoded = decode_batch(black_box(&payload));
            decoded.map(|batch| to_kv_events(&batch))
        })
    });
    group.finish();

    let mut group = c.benchmark_group("encode_batch");
    group.throughput(Throughput::Bytes(payload.len() as u64));
    group.bench_function("32_stored_x_16_blocks_x_64_tokens/array", |b| {
        b.iter(|| encode_batch(black_box(&batch), EncodeOptions::default()))
    });
    let random = stored_batch_with(32, 16, 64, |e, n| vocabulary_tokens(n, e as u32));
    group.bench_function("32_stored_x_16_blocks_x_64_vocabulary_tokens/array", |b| {
        b.iter(|| encode_batch(black_box(&random), EncodeOptions::default()))
    });
    group.finish();
}

criterion_group!(benches, bench_decode);
criterion_main!(benches);
