//! Routing gone blind, provoked with the mock engine and seen in `/metrics`, `/loads` and the
//! log, then fixed and seen to clear: an engine that puts tokens before every prompt
//! (`tokenizer_mismatch`), one with 32-token blocks behind a worker registered with 16
//! (`block_size_mismatch`, `cache_mismatch`), and a worker registered with a KV-event address
//! nothing publishes on (`no_kv_events`).

use crate::common::*;
use kvroute_gateway::workers::worker_id_for;
use kvroute_testkit::openai_engine::{MockEngine, MockEngineConfig};
use serde_json::json;

async fn engine(block_size: u32) -> MockEngine {
    engine_with(MockEngineConfig {
        block_size,
        ..MockEngineConfig::default()
    })
    .await
}

async fn engine_with(config: MockEngineConfig) -> MockEngine {
    let config = MockEngineConfig {
        events_bind: Some("tcp://127.0.0.1:0".to_string()),
        time_scale: 0.0,
        ..config
    };
    MockEngine::start_on(config, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

/// A prompt of `blocks` 16-token blocks (the mock engine tokenizes bytes), its first block
/// naming its seed: prompts of different seeds share no block.
fn prompt(seed: usize, blocks: usize) -> String {
    let mut text = format!("prompt {seed:08} ");
    let filler = (0..).map(|i: usize| char::from(b'a' + ((seed + i * 7) % 26) as u8));
    text.extend(filler.take(blocks * 16 - text.len()));
    text
}

/// The reasons `/loads` shows on `worker_id`'s ranks.
fn reasons(gw: &TestGateway, worker_id: u64) -> Vec<String> {
    let loads = kvroute_service::http::render::loads_with_degraded(
        &kvroute_service::api::loads(&gw.state, None, None),
        &kvroute_service::api::degraded(&gw.state),
    );
    loads
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["loads"].as_array().unwrap().clone())
        .filter(|l| l["worker_id"] == worker_id)
        .flat_map(|l| l["degraded"].as_array().cloned().unwrap_or_default())
        .map(|d| d["reason"].as_str().unwrap().to_string())
        .collect()
}

/// `kvroute_routing_degraded{worker, reason}`, when the series exists.
fn gauge(gw: &TestGateway, worker_id: u64, reason: &str) -> Option<i64> {
    let series = format!("kvroute_routing_degraded{{worker=\"{worker_id}\",reason=\"{reason}\"}} ");
    gw.metrics_text()
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
}

async fn complete(client: &TestClient, gw: &TestGateway, text: &str, stream: bool) {
    let mut body = json!({"model": "default", "prompt": text, "max_tokens": 2});
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    let (status, _, bytes) = post(client, &gw.url("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
}

#[tokio::test]
async fn an_engine_counting_other_prompt_tokens_is_reported_until_it_agrees() {
    let logs = kvroute_testkit::logs::capture();
    let engine = engine(16).await;
    let flag = format!("{}={}", engine.url(), engine.events_endpoint().unwrap());
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &flag,
            "--tokenize",
            "remote",
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    let worker_id = worker_id_for(&engine.url());
    let client = client();
    // The engine's template adds 40 tokens the gateway's tokenizing does not know of.
    engine.set_prompt_prefix_tokens(40);
    for seed in 0..7 {
        complete(&client, &gw, &prompt(seed, 8), false).await;
    }
    assert!(reasons(&gw, worker_id).is_empty(), "7 of 16 off: not yet");
    complete(&client, &gw, &prompt(7, 8), false).await;
    gw.assert_no_booking_left().await;
    assert_eq!(reasons(&gw, worker_id), ["tokenizer_mismatch"]);
    assert_eq!(gauge(&gw, worker_id, "tokenizer_mismatch"), Some(1));
    let needle = format!("worker {worker_id}: in 8 of its last 8 answers the engine counted");
    let warned = logs.lines_with(&needle);
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(
        warned[0].contains("WARN") && warned[0].contains("gateway 128, engine 168"),
        "{warned:?}"
    );
    // Fixed: the engine's prompts are the gateway's again. Streamed answers with a usage chunk
    // count as whole ones do; 14 good answers leave 2 bad of the last 16.
    engine.set_prompt_prefix_tokens(0);
    for seed in 100..113 {
        complete(&client, &gw, &prompt(seed, 8), true).await;
    }
    assert_eq!(
        reasons(&gw, worker_id),
        ["tokenizer_mismatch"],
        "3 of 16 off"
    );
    complete(&client, &gw, &prompt(113, 8), true).await;
    gw.assert_no_booking_left().await;
    assert!(reasons(&gw, worker_id).is_empty());
    assert_eq!(gauge(&gw, worker_id, "tokenizer_mismatch"), Some(0));
    engine.shutdown().await;
}

/// Sends fresh prompts (of seeds `seed`, `seed + 1000`, …) until the engine's KV events for one
/// are in the index (a listener that just (re)connected may miss the first), and returns it.
async fn until_indexed(
    client: &TestClient,
    gw: &TestGateway,
    engine: &MockEngine,
    seed: usize,
    blocks: usize,
) -> String {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut attempt = 0;
    loop {
        let text = prompt(seed + 1000 * attempt, blocks);
        attempt += 1;
        let ids = engine.tokenizer().encode(&text, true).unwrap();
        complete(client, gw, &text, false).await;
        let held = || {
            let body: kvroute_service::types::PromptRouteBody =
                serde_json::from_value(json!({"token_ids": ids})).unwrap();
            let scores = kvroute_service::http::render::overlap_scores(
                &kvroute_service::api::overlap_scores(&gw.state, body).unwrap(),
            );
            scores["workers"]
                .as_array()
                .unwrap()
                .iter()
                .any(|w| w["device_blocks"].as_u64().unwrap() > 0)
        };
        let until = tokio::time::Instant::now() + std::time::Duration::from_millis(500);
        while tokio::time::Instant::now() < until {
            if held() {
                return text;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the engine's KV events never reached the index"
        );
    }
}

#[tokio::test]
async fn an_engine_with_other_blocks_is_reported_until_the_worker_is_registered_right() {
    let logs = kvroute_testkit::logs::capture();
    let engine = engine(32).await;
    let events = engine.events_endpoint().unwrap().to_string();
    let flag = format!("{}={events}", engine.url());
    // Prediction off: only the engine's events tell the router what it holds.
    let gw = TestGateway::start(
        &["--predicted-ttl-secs", "0"],
        &[
            "--worker",
            &flag,
            "--block-size",
            "16",
            "--tokenize",
            "remote",
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    let worker_id = worker_id_for(&engine.url());
    assert!(engine.wait_for_event_subscribers(1, WAIT).await);
    let client = client();
    // Fresh prompts until one's events came (the subscription may miss the first).
    let mut seed = 1;
    let deadline = tokio::time::Instant::now() + WAIT;
    while reasons(&gw, worker_id).is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the block size was never checked"
        );
        complete(&client, &gw, &prompt(seed, 8), false).await;
        seed += 1;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(reasons(&gw, worker_id), ["block_size_mismatch"]);
    let text = prompt(seed - 1, 8);
    // The repeats hit the engine's cache; the router, hashing 16-token blocks, sees none of it.
    for _ in 0..8 {
        complete(&client, &gw, &text, false).await;
    }
    gw.assert_no_booking_left().await;
    assert_eq!(
        reasons(&gw, worker_id),
        ["block_size_mismatch", "cache_mismatch"]
    );
    assert_eq!(gauge(&gw, worker_id, "block_size_mismatch"), Some(1));
    assert_eq!(gauge(&gw, worker_id, "cache_mismatch"), Some(1));
    let warned = logs.lines_with(&format!("worker {worker_id}: its KV events"));
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("carry blocks of 32 tokens but it registered block_size 16"));
    let warned = logs.lines_with(&format!(
        "worker {worker_id}: in 8 of its last {} answers the engine's cached",
        (seed + 7).min(16)
    ));
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(
        warned[0].contains("(last: predicted 0, engine cached"),
        "{warned:?}"
    );

    // Fixed: the worker registered with the engine's block size.
    let body: kvroute_service::types::WorkerBody = serde_json::from_value(json!({
        "worker_id": worker_id, "endpoint": engine.url(), "block_size": 32,
        "kv_events_endpoint": events}))
    .unwrap();
    kvroute_service::api::upsert_worker(&gw.state, body).unwrap();
    assert_eq!(reasons(&gw, worker_id), ["cache_mismatch"]);
    assert_eq!(gauge(&gw, worker_id, "block_size_mismatch"), Some(0));
    let fresh = until_indexed(&client, &gw, &engine, 2, 8).await;
    for _ in 0..16 {
        complete(&client, &gw, &fresh, false).await;
    }
    gw.assert_no_booking_left().await;
    assert!(
        reasons(&gw, worker_id).is_empty(),
        "{:?}",
        reasons(&gw, worker_id)
    );
    assert_eq!(gauge(&gw, worker_id, "cache_mismatch"), Some(0));
    engine.shutdown().await;
}

#[tokio::test]
async fn a_worker_whose_events_never_come_is_reported_until_registered_right() {
    let logs = kvroute_testkit::logs::capture();
    let engine = engine(16).await;
    let wrong = format!("tcp://127.0.0.1:{}", closed_port().await);
    let flag = format!("{}={wrong}", engine.url());
    let gw = TestGateway::start(
        &["--kv-silence-secs", "30", "--kv-silence-bookings", "5"],
        &[
            "--worker",
            &flag,
            "--tokenize",
            "remote",
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    let worker_id = worker_id_for(&engine.url());
    let client = client();
    for seed in 0..6 {
        complete(&client, &gw, &prompt(seed, 4), false).await;
    }
    gw.state.tick(gw.state.now());
    assert!(reasons(&gw, worker_id).is_empty(), "not for long enough");
    gw.state.advance_clock(std::time::Duration::from_secs(31));
    gw.state.tick(gw.state.now());
    assert_eq!(reasons(&gw, worker_id), ["no_kv_events"]);
    assert_eq!(gauge(&gw, worker_id, "no_kv_events"), Some(1));
    let warned = logs.lines_with(&format!(
        "worker {worker_id}: 6 bookings in 31 s and no KV event: check the engine's \
         --kv-events-config endpoint matches kv_events_endpoint {wrong}"
    ));
    assert_eq!(warned.len(), 1, "{warned:?}");

    // Fixed: registered with the address the engine publishes on. Its events arrive, and the
    // same traffic no longer raises it.
    let body: kvroute_service::types::WorkerBody = serde_json::from_value(json!({
        "worker_id": worker_id, "endpoint": engine.url(), "block_size": 16,
        "kv_events_endpoint": engine.events_endpoint().unwrap()}))
    .unwrap();
    kvroute_service::api::upsert_worker(&gw.state, body).unwrap();
    assert!(reasons(&gw, worker_id).is_empty());
    assert_eq!(gauge(&gw, worker_id, "no_kv_events"), Some(0));
    assert!(engine.wait_for_event_subscribers(1, WAIT).await);
    until_indexed(&client, &gw, &engine, 50, 4).await;
    for seed in 60..66 {
        complete(&client, &gw, &prompt(seed, 4), false).await;
    }
    // Each answer stored blocks, whose events keep the worker's silent bookings few.
    until_indexed(&client, &gw, &engine, 66, 4).await;
    gw.state.advance_clock(std::time::Duration::from_secs(31));
    gw.state.tick(gw.state.now());
    assert!(reasons(&gw, worker_id).is_empty());
    engine.shutdown().await;
}

/// An engine that does not report cached tokens (vLLM without --enable-prompt-tokens-details)
/// gives the cache check nothing to compare: only its events' block size is reported.
#[tokio::test]
async fn without_cached_tokens_in_usage_only_the_block_size_is_reported() {
    let engine = engine_with(MockEngineConfig {
        block_size: 32,
        prompt_tokens_details: false,
        ..MockEngineConfig::default()
    })
    .await;
    let flag = format!("{}={}", engine.url(), engine.events_endpoint().unwrap());
    let gw = TestGateway::start(
        &["--predicted-ttl-secs", "0"],
        &[
            "--worker",
            &flag,
            "--tokenize",
            "remote",
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    let worker_id = worker_id_for(&engine.url());
    assert!(engine.wait_for_event_subscribers(1, WAIT).await);
    let client = client();
    // Fresh prompts until one's events came (the subscription may miss the first).
    let mut seed = 3;
    let deadline = tokio::time::Instant::now() + WAIT;
    while reasons(&gw, worker_id).is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the block size was never checked"
        );
        complete(&client, &gw, &prompt(seed, 8), false).await;
        seed += 1;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // Repeats hit the engine's cache, which the router cannot see: not reported, the engine
    // does not say so.
    for _ in 0..12 {
        complete(&client, &gw, &prompt(seed - 1, 8), false).await;
    }
    gw.assert_no_booking_left().await;
    assert_eq!(reasons(&gw, worker_id), ["block_size_mismatch"]);
    assert_eq!(gauge(&gw, worker_id, "cache_mismatch"), None);
    engine.shutdown().await;
}
