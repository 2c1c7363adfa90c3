//! Bookings driven by responses, and freed however the response ends.

use crate::common::*;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use std::time::Duration;

fn rank_load(gw: &TestGateway) -> Value {
    let loads =
        kvroute_service::http::render::loads(&kvroute_service::api::loads(&gw.state, None, None));
    loads[0]["loads"][0].clone()
}

/// Reads a streamed body until `done` holds for what arrived so far.
async fn read_until(
    body: &mut hyper::body::Incoming,
    seen: &mut Vec<u8>,
    done: impl Fn(&[u8]) -> bool,
) {
    tokio::time::timeout(WAIT, async {
        while !done(seen) {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        seen.extend_from_slice(data);
                    }
                }
                other => panic!("the stream ended early: {other:?}"),
            }
        }
    })
    .await
    .expect("the stream went on in time");
}

fn count(haystack: &[u8], needle: &str) -> usize {
    String::from_utf8_lossy(haystack).matches(needle).count()
}

#[tokio::test]
async fn a_stream_completes_prefill_at_its_first_token_and_books_output_blocks() {
    let upstream = Upstream::start().await;
    *upstream.state.faults.first_token_delay.lock() = Duration::from_millis(300);
    *upstream.state.faults.token_delay.lock() = Duration::from_millis(20);
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &upstream.url(),
            "--block-size",
            "4",
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    let client = client();
    let request = post_request(
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "stream": true, "max_tokens": 10}),
        None,
    );
    let response = client.request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert!(response.headers().contains_key("x-kvroute-worker-id"));
    // Booked, the prompt not yet prefilled: its 9 tokens count.
    let load = rank_load(&gw);
    assert_eq!(load["active_requests"], 1);
    assert_eq!(load["potential_prefill_tokens"], 9);
    let decode_before = load["potential_decode_blocks"].as_u64().unwrap();
    let mut body = response.into_body();
    let mut seen = Vec::new();
    read_until(&mut body, &mut seen, |s| count(s, "\"text\":\"t") >= 1).await;
    eventually("prefill complete at the first token", || {
        rank_load(&gw)["potential_prefill_tokens"] == 0
    })
    .await;
    read_until(&mut body, &mut seen, |s| count(s, "\"text\":\"t") >= 8).await;
    eventually("two output blocks after 8 tokens", || {
        rank_load(&gw)["potential_decode_blocks"].as_u64().unwrap() == decode_before + 2
    })
    .await;
    read_until(&mut body, &mut seen, |s| count(s, "[DONE]") == 1).await;
    assert!(body.frame().await.is_none(), "the stream ends after [DONE]");
    let payloads = sse_payloads(&seen);
    assert_eq!(
        payloads.len(),
        12,
        "10 tokens, the finish, [DONE]: {payloads:?}"
    );
    // Forwarded as the engine wrote it.
    assert_eq!(
        payloads[0],
        json!({"choices": [{"index": 0, "text": token_text(0)}]}).to_string()
    );
    gw.assert_no_booking_left().await;
    assert!(
        gw.metrics_text()
            .contains("kvroute_gateway_responses_total{end=\"complete\"} 1")
    );
    // The upstream got the body as the client sent it.
    let sent = upstream.requests("/v1/completions");
    assert_eq!(sent[0].body["prompt"], json!([1, 2, 3, 4, 5, 6, 7, 8, 9]));
}

#[tokio::test]
async fn a_whole_response_passes_through_and_frees_its_booking() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::in_front_of(&upstream).await;
    let client = client();
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = if path.contains("chat") {
            json!({"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        } else {
            json!({"model": "default", "prompt": [5, 6, 7], "max_tokens": 3})
        };
        let (status, headers, bytes) = post(&client, &gw.url(path), &body).await;
        assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&bytes));
        assert!(
            headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/json")
        );
        let answer: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(answer["usage"]["completion_tokens"], 3, "{path}");
        gw.assert_no_booking_left().await;
    }
    // The chat stream too: the role chunk is no token, the contents are.
    let (status, _, bytes) = post(
        &client,
        &gw.url("/v1/chat/completions"),
        &json!({"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(count(&bytes, "\"content\":\"t"), 2);
    assert!(bytes.ends_with(b"data: [DONE]\n\n"));
    gw.assert_no_booking_left().await;
    // Each ended as a whole response, none as a client gone.
    let metrics = gw.metrics_text();
    assert!(
        metrics.contains("kvroute_gateway_responses_total{end=\"complete\"} 3"),
        "{metrics}"
    );
    assert!(!metrics.contains("client_gone"), "{metrics}");
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_frees_the_booking() {
    let upstream = Upstream::start().await;
    *upstream.state.faults.token_delay.lock() = Duration::from_millis(200);
    let gw = TestGateway::in_front_of(&upstream).await;
    let client = client();
    let request = post_request(
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2, 3], "stream": true, "max_tokens": 50}),
        None,
    );
    let response = client.request(request).await.unwrap();
    let mut body = response.into_body();
    let mut seen = Vec::new();
    read_until(&mut body, &mut seen, |s| count(s, "\"text\"") >= 1).await;
    assert_eq!(gw.active_requests(), 1);
    drop(body);
    drop(client);
    gw.assert_no_booking_left().await;
    // The engine's stream was dropped too: it stops generating.
    eventually("the upstream stream closed", || {
        upstream
            .state
            .streams_open
            .load(std::sync::atomic::Ordering::SeqCst)
            == 0
    })
    .await;
    assert!(
        gw.metrics_text()
            .contains("kvroute_gateway_responses_total{end=\"client_gone\"} 1")
    );
}

#[tokio::test]
async fn a_client_that_leaves_before_the_answer_frees_the_booking() {
    let upstream = Upstream::start().await;
    *upstream.state.faults.first_token_delay.lock() = Duration::from_secs(5);
    let gw = TestGateway::in_front_of(&upstream).await;
    let client = client();
    let request = post_request(
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2, 3]}),
        None,
    );
    let pending = tokio::spawn(async move { client.request(request).await });
    eventually("booked", || gw.active_requests() == 1).await;
    pending.abort();
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn an_engine_dying_mid_stream_ends_the_stream_with_an_error_and_frees_the_booking() {
    let upstream = Upstream::start().await;
    *upstream.state.faults.die_after_tokens.lock() = Some(3);
    let gw = TestGateway::in_front_of(&upstream).await;
    let client = client();
    let (status, _, bytes) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2, 3], "stream": true, "max_tokens": 10}),
    )
    .await;
    assert_eq!(status, 200, "the stream had begun");
    let payloads = sse_payloads(&bytes);
    assert_eq!(
        payloads.len(),
        5,
        "3 tokens, the error, [DONE]: {payloads:?}"
    );
    let error: Value = serde_json::from_str(&payloads[3]).unwrap();
    assert_eq!(error["error"]["code"], 502);
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("failed mid-response")
    );
    assert_eq!(payloads[4], "[DONE]");
    gw.assert_no_booking_left().await;
    let metrics = gw.metrics_text();
    assert!(
        metrics.contains("kvroute_gateway_responses_total{end=\"upstream_error\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("kvroute_gateway_upstream_failures_total{kind=\"broken_stream\"} 1"));
}

#[tokio::test]
async fn a_first_token_past_its_timeout_ends_the_stream_and_frees_the_booking() {
    let upstream = Upstream::start().await;
    *upstream.state.faults.first_token_delay.lock() = Duration::from_secs(3);
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &upstream.url(),
            "--health-check-secs",
            "0",
            "--first-token-timeout-secs",
            "0.3",
        ],
    )
    .await;
    let client = client();
    let started = std::time::Instant::now();
    let (status, _, bytes) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2, 3], "stream": true}),
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(status, 200, "the engine's headers came at once");
    let payloads = sse_payloads(&bytes);
    let error: Value = serde_json::from_str(&payloads[0]).unwrap();
    assert_eq!(error["error"]["code"], 504, "{payloads:?}");
    gw.assert_no_booking_left().await;
    // A whole response past the request timeout: 504 before any byte.
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &upstream.url(),
            "--health-check-secs",
            "0",
            "--request-timeout-secs",
            "0.3",
        ],
    )
    .await;
    let (status, _, bytes) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2, 3]}),
    )
    .await;
    assert_eq!(status, 504, "{}", String::from_utf8_lossy(&bytes));
    gw.assert_no_booking_left().await;
}
