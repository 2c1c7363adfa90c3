//! Request parsing, the largest cost of a `/select` with a long prompt: the strict JSON parse of
//! a select body with 8,192 and 131,072 token ids (typed parse + duplicate-key scan).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_service::http::json::parse_strict;
use kvroute_service::http::types::SelectBody;
use std::hint::black_box;

fn bench_parse(c: &mut Criterion) {
    let mut group = c.benchmark_group("parse_select_body");
    for tokens in [8192usize, 131_072] {
        let ids: Vec<u32> = (0..tokens as u32)
            .map(|t| t.wrapping_mul(2_654_435_761) % 150_000)
            .collect();
        let body = serde_json::json!({"selection_id": "req-1", "token_ids": ids}).to_string();
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(
            BenchmarkId::from_parameter(format!("{tokens}_tokens")),
            &body,
            |b, body| {
                b.iter(|| parse_strict::<SelectBody>(black_box(body.as_bytes())).expect("parses"))
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench_parse);
criterion_main!(benches, parts);

fn bench_parts(c: &mut Criterion) {
    let ids: Vec<u32> = (0..8192u32)
        .map(|t| t.wrapping_mul(2_654_435_761) % 150_000)
        .collect();
    let body = serde_json::json!({"selection_id": "req-1", "token_ids": ids}).to_string();
    c.bench_function("plain_from_slice_select_body_8192", |b| {
        b.iter(|| serde_json::from_slice::<SelectBody>(black_box(body.as_bytes())).expect("parses"))
    });
    let array = serde_json::to_string(&ids).unwrap();
    c.bench_function("token_array_8192", |b| {
        b.iter(|| kvroute_service::http::json::parse_token_array(black_box(array.as_bytes())))
    });
    c.bench_function("token_array_8192_portable", |b| {
        b.iter(|| {
            kvroute_service::http::json::parse_token_array_portable(black_box(array.as_bytes()))
        })
    });
    let spaced = array.replace(',', ", ");
    c.bench_function("token_array_8192_spaced", |b| {
        b.iter(|| kvroute_service::http::json::parse_token_array(black_box(spaced.as_bytes())))
    });
    c.bench_function("duplicate_scan_8192", |b| {
        b.iter(|| kvroute_service::http::json::first_duplicate_key(black_box(body.as_bytes())))
    });
}
criterion_group!(parts, bench_parts);
