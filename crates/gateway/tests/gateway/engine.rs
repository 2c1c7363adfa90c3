//! The whole path against the mock OpenAI engine of `kvroute-testkit`: its KV events reach
//! the gateway's index, a repeated prompt goes back to the engine that caches it, and an engine
//! killed mid-stream ends the client's stream with an error and frees the booking.

use crate::common::*;
use kvroute_testkit::openai_engine::{MockEngine, MockEngineConfig, tokenizer};
use serde_json::{Value, json};
use std::time::Duration;

async fn engine(time_scale: f64) -> MockEngine {
    let config = MockEngineConfig {
        events_bind: Some("tcp://127.0.0.1:0".to_string()),
        time_scale,
        ..MockEngineConfig::default()
    };
    MockEngine::start_on(config, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

fn worker_flag(engine: &MockEngine) -> String {
    format!("{}={}", engine.url(), engine.events_endpoint().unwrap())
}

/// A prompt of `blocks` 16-token blocks of distinct text (the mock engine tokenizes bytes).
fn prompt(seed: usize, blocks: usize) -> String {
    (0..blocks * 16)
        .map(|i| char::from(b'a' + ((seed * 7 + i * 3) % 26) as u8))
        .collect()
}

#[tokio::test]
async fn a_repeated_prompt_goes_back_to_the_engine_that_caches_it() {
    let engines = [engine(0.0).await, engine(0.0).await];
    let flags: Vec<String> = engines.iter().map(worker_flag).collect();
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &flags[0],
            "--worker",
            &flags[1],
            "--tokenize",
            "remote",
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    for engine in &engines {
        assert!(
            engine.wait_for_event_subscribers(1, WAIT).await,
            "the gateway subscribed"
        );
    }
    let client = client();
    for seed in 0..4 {
        let text = prompt(seed, 8);
        let body = json!({"model": "default", "prompt": text, "max_tokens": 4, "stream": true});
        let (status, first, bytes) = post(&client, &gw.url("/v1/completions"), &body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        assert!(bytes.ends_with(b"data: [DONE]\n\n"));
        let worker = first["x-kvroute-worker-id"].clone();
        let engine = engines
            .iter()
            .zip(&flags)
            .find(|(_, flag)| {
                let url = flag.split_once("=tcp").unwrap().0;
                kvroute_gateway::workers::worker_id_for(url).to_string() == worker.to_str().unwrap()
            })
            .map(|(e, _)| e)
            .unwrap();
        // The engine's events reach the index (predictions are off: only events count).
        let ids = engine.tokenizer().encode(&text, true).unwrap();
        let worker_id: u64 = worker.to_str().unwrap().parse().unwrap();
        eventually("the engine's KV events were applied", || {
            let body: kvroute_service::types::PromptRouteBody =
                serde_json::from_value(json!({"token_ids": ids})).unwrap();
            let scores = kvroute_service::http::render::overlap_scores(
                &kvroute_service::api::overlap_scores(&gw.state, body).unwrap(),
            );
            scores["workers"]
                .as_array()
                .unwrap()
                .iter()
                .any(|w| w["worker_id"] == worker_id && w["device_blocks"].as_u64().unwrap() >= 7)
        })
        .await;
        let (status, again, _) = post(&client, &gw.url("/v1/completions"), &body).await;
        assert_eq!(status, 200);
        assert_eq!(
            again["x-kvroute-worker-id"], worker,
            "prompt {seed} went back"
        );
        assert!(
            engine.last_cached_tokens().unwrap() >= 16 * 7,
            "the repeat hit the engine's cache: {:?}",
            engine.last_cached_tokens()
        );
    }
    gw.assert_no_booking_left().await;
    for engine in engines {
        engine.shutdown().await;
    }
}

#[tokio::test]
async fn an_engine_killed_mid_stream_ends_the_clients_stream_and_the_next_request_goes_elsewhere() {
    // Slow enough that the kill lands mid-stream.
    let engines = [engine(1.0).await, engine(1.0).await];
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &engines[0].url(),
            "--worker",
            &engines[1].url(),
            "--health-check-secs",
            "0",
            "--breaker-failures",
            "1",
        ],
    )
    .await;
    let client = client();
    let request = post_request(
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2, 3, 4], "max_tokens": 2000, "stream": true}),
        None,
    );
    let response = client.request(request).await.unwrap();
    let worker = response.headers()["x-kvroute-worker-id"]
        .to_str()
        .unwrap()
        .to_string();
    let victim = engines
        .iter()
        .position(|e| kvroute_gateway::workers::worker_id_for(&e.url()).to_string() == worker)
        .unwrap();
    let reading = tokio::spawn(async move {
        use http_body_util::BodyExt;
        response.into_body().collect().await.map(|b| b.to_bytes())
    });
    eventually("tokens are flowing", || engines[victim].in_flight() == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    engines[victim].kill();
    let bytes = tokio::time::timeout(WAIT, reading)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let payloads = sse_payloads(&bytes);
    let error: Value = serde_json::from_str(&payloads[payloads.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], 502, "{payloads:?}");
    assert_eq!(payloads.last().unwrap(), "[DONE]");
    gw.assert_no_booking_left().await;
    // The killed engine's breaker is open (one failure here), and it refuses connections
    // anyway: the next request is served by the other engine.
    let (status, headers, _) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2, 3, 4], "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    assert_ne!(headers["x-kvroute-worker-id"].to_str().unwrap(), worker);
    gw.assert_no_booking_left().await;
}

/// `POST /v1/responses`: routed as the chat of its input (remote tokenization gives the
/// engine's own ids), so a repeat goes back to the engine that caches it; its `event:` stream
/// passes through as the engine wrote it, and the booking is freed at `response.completed`.
#[tokio::test]
async fn a_response_is_routed_like_a_chat_and_its_events_pass_through() {
    let engines = [engine(0.0).await, engine(0.0).await];
    let flags: Vec<String> = engines.iter().map(worker_flag).collect();
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &flags[0],
            "--worker",
            &flags[1],
            "--tokenize",
            "remote",
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    for engine in &engines {
        assert!(engine.wait_for_event_subscribers(1, WAIT).await);
    }
    let client = client();
    let body = json!({"model": "default", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": prompt(3, 8)}]}],
        "max_output_tokens": 5, "stream": true});
    let (status, first, bytes) = post(&client, &gw.url("/v1/responses"), &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let kinds: Vec<&str> = text
        .split("\n\n")
        .filter_map(|event| event.strip_prefix("event: "))
        .map(|event| event.split('\n').next().unwrap())
        .collect();
    assert_eq!(kinds.first(), Some(&"response.created"));
    assert_eq!(kinds.last(), Some(&"response.completed"));
    assert_eq!(
        kinds
            .iter()
            .filter(|k| **k == "response.output_text.delta")
            .count(),
        5
    );
    gw.assert_no_booking_left().await;
    // The engine's KV events of the rendered chat reach the index; the repeat goes back to it.
    let worker = first["x-kvroute-worker-id"].clone();
    let worker_id: u64 = worker.to_str().unwrap().parse().unwrap();
    let messages =
        [("system", "Be brief.".to_string()), ("user", prompt(3, 8))].map(|(role, content)| {
            tokenizer::ChatMessage {
                role: role.to_string(),
                content,
            }
        });
    let ids = engines[0]
        .tokenizer()
        .encode(&tokenizer::render_chat(&messages, true), false)
        .unwrap();
    eventually("the engine's KV events were applied", || {
        let body: kvroute_service::types::PromptRouteBody =
            serde_json::from_value(json!({"token_ids": ids})).unwrap();
        let scores = kvroute_service::http::render::overlap_scores(
            &kvroute_service::api::overlap_scores(&gw.state, body).unwrap(),
        );
        scores["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["worker_id"] == worker_id && w["device_blocks"].as_u64().unwrap() >= 8)
    })
    .await;
    let body = json!({"model": "default", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": prompt(3, 8)}]}],
        "max_output_tokens": 2});
    let (status, again, bytes) = post(&client, &gw.url("/v1/responses"), &body).await;
    assert_eq!(status, 200);
    assert_eq!(again["x-kvroute-worker-id"], worker);
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(answer["object"], "response");
    assert!(
        answer["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 128
    );
    gw.assert_no_booking_left().await;
}
