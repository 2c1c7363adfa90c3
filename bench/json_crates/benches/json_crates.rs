//! kvroute's token-array reader (`parse_token_array`: AVX-512 where the CPU has it, the portable
//! reader otherwise) against sonic-rs and simd-json, each parsing to the same `Vec<u32>`, on the
//! inputs of `crates/service/benches/json.rs`: 8,192 ids as `serde_json` writes them (compact),
//! the same with `, ` separators (spaced, as Python's `json.dumps` writes them), and a whole
//! `/select` body with those ids. serde_json is the reference both ways.
//!
//! simd-json parses in place, so it needs a mutable copy of the input: `simd_json` rows copy the
//! input inside the timed loop (what a server holding an immutable request body pays), and the
//! `simd_json_parse_only` rows make the copy outside it.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_service::http::json::{parse_strict, parse_token_array, parse_token_array_portable};
use kvroute_service::http::types::SelectBody;
use std::hint::black_box;

/// The ids of the service's json bench: 8,192 ids below a 150,000-token vocabulary.
fn ids() -> Vec<u32> {
    (0..8192u32)
        .map(|t| t.wrapping_mul(2_654_435_761) % 150_000)
        .collect()
}

fn ours(bytes: &[u8]) -> Vec<u32> {
    parse_token_array(bytes).expect("a token array").0
}

fn ours_portable(bytes: &[u8]) -> Vec<u32> {
    parse_token_array_portable(bytes).expect("a token array").0
}

fn sonic(bytes: &[u8]) -> Vec<u32> {
    sonic_rs::from_slice(bytes).expect("a token array")
}

fn simd_copying(bytes: &[u8]) -> Vec<u32> {
    let mut copy = bytes.to_vec();
    simd_json::serde::from_slice(&mut copy).expect("a token array")
}

fn serde(bytes: &[u8]) -> Vec<u32> {
    serde_json::from_slice(bytes).expect("a token array")
}

fn bench_arrays(c: &mut Criterion) {
    let ids = ids();
    let compact = serde_json::to_string(&ids).expect("serializes");
    let spaced = compact.replace(',', ", ");
    for (name, text) in [("compact", &compact), ("spaced", &spaced)] {
        let bytes = text.as_bytes();
        // Every parser gives the same ids.
        for parse in [ours, ours_portable, sonic, simd_copying, serde] {
            assert_eq!(parse(bytes), ids, "{name}");
        }
        let mut group = c.benchmark_group(format!("token_array_8192_{name}"));
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function("kvroute", |b| b.iter(|| ours(black_box(bytes))));
        group.bench_function("kvroute_portable", |b| {
            b.iter(|| ours_portable(black_box(bytes)))
        });
        group.bench_function("sonic_rs", |b| b.iter(|| sonic(black_box(bytes))));
        group.bench_function("simd_json", |b| b.iter(|| simd_copying(black_box(bytes))));
        group.bench_function("simd_json_parse_only", |b| {
            b.iter_batched_ref(
                || bytes.to_vec(),
                |copy| -> Vec<u32> { simd_json::serde::from_slice(copy).expect("a token array") },
                BatchSize::SmallInput,
            )
        });
        group.bench_function("serde_json", |b| b.iter(|| serde(black_box(bytes))));
        group.finish();
    }
}

/// The whole body: kvroute's strict parse (token array by the reader above, the rest by serde,
/// plus the duplicate-key scan the general parsers do not make) against the crates' serde
/// deserializers into the same `SelectBody`.
fn bench_body(c: &mut Criterion) {
    let ids = ids();
    let body = serde_json::json!({"selection_id": "req-1", "token_ids": ids}).to_string();
    let bytes = body.as_bytes();
    let token_ids = |b: SelectBody| b.token_ids.expect("token_ids");
    assert_eq!(
        token_ids(parse_strict::<SelectBody>(bytes).expect("parses")),
        ids
    );
    assert_eq!(token_ids(sonic_rs::from_slice(bytes).expect("parses")), ids);
    assert_eq!(
        token_ids(simd_json::serde::from_slice(&mut bytes.to_vec()).expect("parses")),
        ids
    );
    let mut group = c.benchmark_group("select_body_8192");
    group.throughput(Throughput::Bytes(bytes.len() as u64));
    group.bench_function("kvroute_strict", |b| {
        b.iter(|| parse_strict::<SelectBody>(black_box(bytes)).expect("parses"))
    });
    group.bench_function("sonic_rs", |b| {
        b.iter(|| sonic_rs::from_slice::<SelectBody>(black_box(bytes)).expect("parses"))
    });
    group.bench_function("simd_json", |b| {
        b.iter(|| {
            let mut copy = black_box(bytes).to_vec();
            simd_json::serde::from_slice::<SelectBody>(&mut copy).expect("parses")
        })
    });
    group.bench_function("serde_json", |b| {
        b.iter(|| serde_json::from_slice::<SelectBody>(black_box(bytes)).expect("parses"))
    });
    group.finish();
}

criterion_group!(benches, bench_arrays, bench_body);
criterion_main!(benches);
