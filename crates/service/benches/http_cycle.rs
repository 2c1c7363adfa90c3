//! One select → reservations → prefill_complete → DELETE cycle in process (no sockets): through
//! the whole HTTP service ([`app`]: routing, middleware, extractors, JSON bodies both ways) and
//! straight through [`api`] with the bodies already parsed. The difference is what the service
//! layers cost per cycle on top of the selection work. 64 workers without KV-event endpoints (so
//! an approximate cache model stands in for the index, the same in both), 12,288-token prompts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use axum::body::Body;
use axum::http::{Method, Request};
use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_service::api;
use kvroute_service::config::ServeConfig;
use kvroute_service::http::app;
use kvroute_service::http::types::{ReservationBody, SelectBody};
use kvroute_service::state::AppState;
use std::hint::black_box;
use std::sync::Arc;
use tower::ServiceExt;

mod common;

// The allocator the kvroute binary uses.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WORKERS: u64 = 64;
const PROMPTS: u32 = 64;
const TOKENS: u32 = 12_288;

/// Workers without KV-event endpoints: an approximate cache model stands in for their index
/// entries, the same on both paths.
fn service() -> Arc<AppState> {
    common::service_with_workers(ServeConfig::defaults(), WORKERS)
}

/// Token ids as a JSON array, for prompt `seed`.
fn tokens_json(seed: u32) -> String {
    let ids: Vec<u32> = (0..TOKENS)
        .map(|t| (t.wrapping_add(seed * 7919).wrapping_mul(2_654_435_761)) % 151_936)
        .collect();
    serde_json::to_string(&ids).unwrap()
}

fn request(method: Method, uri: &str, body: Option<Bytes>) -> Request<Body> {
    let builder = Request::builder().method(method).uri(uri);
    match body {
        Some(body) => builder
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap(),
        None => builder.body(Body::empty()).unwrap(),
    }
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let prompts: Vec<String> = (0..PROMPTS).map(tokens_json).collect();
    let mut group = c.benchmark_group("http_cycle");

    // Each cycle frees what it booked, so the selection ids can come round again: the bodies are
    // built once (a clone of `Bytes` shares them).
    let cycles: Vec<(String, Bytes, Bytes)> = prompts
        .iter()
        .enumerate()
        .map(|(i, tokens)| {
            let id = format!("s{i}");
            let select = format!("{{\"selection_id\":\"{id}\",\"token_ids\":{tokens}}}");
            let reserve = format!("{{\"selection_id\":\"{id}\"}}");
            (id, Bytes::from(select), Bytes::from(reserve))
        })
        .collect();
    let state = service();
    let router = app(Arc::clone(&state));
    let mut n = 0usize;
    group.bench_function("through_the_service", |b| {
        b.iter(|| {
            n += 1;
            let (id, select, reserve) = &cycles[n % cycles.len()];
            runtime.block_on(async {
                let calls = [
                    (Method::POST, "/select".to_string(), Some(select.clone())),
                    (
                        Method::POST,
                        "/reservations".to_string(),
                        Some(reserve.clone()),
                    ),
                    (
                        Method::POST,
                        format!("/reservations/{id}/prefill_complete"),
                        None,
                    ),
                    (Method::DELETE, format!("/reservations/{id}"), None),
                ];
                for (method, uri, body) in calls {
                    let response = router
                        .clone()
                        .oneshot(request(method, &uri, body))
                        .await
                        .unwrap();
                    assert!(
                        response.status().is_success(),
                        "{uri}: {}",
                        response.status()
                    );
                    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
                        .await
                        .unwrap();
                    black_box(bytes);
                }
            });
        })
    });

    let state = service();
    let parsed: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| serde_json::from_str(p).unwrap())
        .collect();
    let mut n = 0usize;
    group.bench_function("api_with_parsed_bodies", |b| {
        b.iter(|| {
            n += 1;
            let id = format!("s{}", n % parsed.len());
            // Stands in for the parse's own allocation.
            let tokens = parsed[n % parsed.len()].clone();
            let select: SelectBody = serde_json::from_value(serde_json::json!({
                "selection_id": id,
            }))
            .unwrap();
            let select = SelectBody {
                token_ids: Some(tokens),
                ..select
            };
            let admission = api::select(&state, select, None);
            black_box(admission.decided().unwrap().unwrap());
            let reserve: ReservationBody =
                serde_json::from_value(serde_json::json!({ "selection_id": id })).unwrap();
            black_box(api::create_reservation(&state, reserve).unwrap());
            api::prefill_complete(&state, &id).unwrap();
            api::free_reservation(&state, &id).unwrap();
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
