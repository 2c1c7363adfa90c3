//! Workers that cannot be reached or keep failing, and the answers that say "not now".

use crate::common::*;
use serde_json::{Value, json};
use std::sync::atomic::Ordering;
use std::time::Duration;

#[tokio::test]
async fn a_worker_that_cannot_be_connected_to_is_skipped_for_the_next_best() {
    let upstream = Upstream::start().await;
    let dead = format!("http://127.0.0.1:{}", closed_port().await);
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &dead,
            "--worker",
            &upstream.url(),
            "--health-check-secs",
            "0",
            "--breaker-failures",
            "100",
        ],
    )
    .await;
    let client = client();
    // Different prompts, so that load and cache spread them over both workers.
    for i in 0..6u32 {
        let (status, headers, bytes) = post(
            &client,
            &gw.url("/v1/completions"),
            &json!({"model": "default", "prompt": [i, i + 1, i + 2], "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        let worker = headers["x-kvroute-worker-id"].to_str().unwrap();
        assert_eq!(
            worker,
            kvroute_gateway::workers::worker_id_for(&upstream.url()).to_string()
        );
    }
    assert_eq!(upstream.requests("/v1/completions").len(), 6);
    let metrics = gw.metrics_text();
    assert!(
        metrics.contains("kvroute_gateway_upstream_failures_total{kind=\"connect\"}"),
        "{metrics}"
    );
    gw.assert_no_booking_left().await;

    // With every worker unreachable, the retries are bounded and the answer is a 503.
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &dead,
            "--health-check-secs",
            "0",
            "--connect-retries",
            "2",
        ],
    )
    .await;
    let (status, headers, bytes) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2]}),
    )
    .await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&bytes));
    assert_eq!(headers["retry-after"], "1");
    let error: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(error["error"]["type"], "service_unavailable");
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn a_failing_worker_opens_its_breaker_and_a_probe_closes_it_again() {
    let upstream = Upstream::start().await;
    *upstream.state.faults.status.lock() = Some(500);
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &upstream.url(),
            "--health-check-secs",
            "0",
            "--breaker-failures",
            "2",
            "--breaker-open-secs",
            "0.5",
        ],
    )
    .await;
    let client = client();
    let completion = || json!({"model": "default", "prompt": [1, 2, 3], "max_tokens": 1});
    for _ in 0..2 {
        let (status, _, _) = post(&client, &gw.url("/v1/completions"), &completion()).await;
        assert_eq!(status, 500, "the engine's answer passes through");
    }
    // Open: the worker is left out, and nothing else is there.
    let (status, _, bytes) = post(&client, &gw.url("/v1/completions"), &completion()).await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&bytes));
    assert_eq!(
        upstream.requests("/v1/completions").len(),
        2,
        "the open breaker sent nothing"
    );
    assert!(
        gw.metrics_text()
            .contains("kvroute_gateway_breakers_opened_total 1")
    );
    // The engine recovers; after the open time one probe goes, succeeds, and closes it.
    *upstream.state.faults.status.lock() = None;
    tokio::time::sleep(Duration::from_millis(600)).await;
    for _ in 0..3 {
        let (status, _, bytes) = post(&client, &gw.url("/v1/completions"), &completion()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    }
    assert_eq!(upstream.requests("/v1/completions").len(), 5);
    assert_eq!(gw.gateway.breakers().open_count(), 0);
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn health_checks_open_the_breaker_of_an_unhealthy_worker_and_close_it_when_it_recovers() {
    let upstream = Upstream::start().await;
    upstream
        .state
        .faults
        .unhealthy
        .store(true, Ordering::SeqCst);
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &upstream.url(),
            "--health-check-secs",
            "0.05",
            "--breaker-failures",
            "2",
            "--breaker-open-secs",
            "0.2",
        ],
    )
    .await;
    eventually("the breaker opened", || {
        gw.gateway.breakers().open_count() == 1
    })
    .await;
    let client = client();
    let (status, _, _) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1]}),
    )
    .await;
    assert_eq!(status, 503);
    assert!(upstream.requests("/v1/completions").is_empty());
    upstream
        .state
        .faults
        .unhealthy
        .store(false, Ordering::SeqCst);
    eventually("the breaker closed", || {
        gw.gateway.breakers().open_count() == 0
    })
    .await;
    let (status, _, _) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1]}),
    )
    .await;
    assert_eq!(status, 200);
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn no_worker_is_a_503_and_busy_workers_are_a_429_with_retry_after() {
    let gw = TestGateway::start(&[], &["--health-check-secs", "0"]).await;
    let client = client();
    let (status, headers, bytes) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2]}),
    )
    .await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&bytes));
    assert_eq!(headers["retry-after"], "1");
    let error: Value = serde_json::from_slice(&bytes).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no schedulable workers")
    );

    // Every rank busy (its prefill tokens at the limit): the selector's 429.
    let upstream = Upstream::start().await;
    *upstream.state.faults.first_token_delay.lock() = Duration::from_secs(2);
    let gw = TestGateway::start(
        &["--busy-prefill-tokens", "3"],
        &["--worker", &upstream.url(), "--health-check-secs", "0"],
    )
    .await;
    let first = tokio::spawn({
        let request = post_request(
            &gw.url("/v1/completions"),
            &json!({"model": "default", "prompt": [1, 2, 3]}),
            None,
        );
        let client = client.clone();
        async move { exchange(&client, request).await }
    });
    eventually("the first is booked", || gw.active_requests() == 1).await;
    let (status, headers, bytes) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [4, 5, 6]}),
    )
    .await;
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&bytes));
    assert_eq!(headers["retry-after"], "1");
    let error: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        error["error"]["message"],
        "all eligible workers are overloaded"
    );
    assert_eq!(first.await.unwrap().0, 200);
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn an_engines_429_reaches_the_client_with_its_retry_after() {
    let upstream = Upstream::start().await;
    *upstream.state.faults.status.lock() = Some(429);
    let gw = TestGateway::in_front_of(&upstream).await;
    let client = client();
    let (status, headers, _) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2], "stream": true}),
    )
    .await;
    assert_eq!(status, 429);
    assert_eq!(headers["retry-after"], "7");
    assert_eq!(
        gw.gateway.breakers().open_count(),
        0,
        "a 429 is no failure of the worker"
    );
    gw.assert_no_booking_left().await;
}

/// With the admission queue (`--queue-threshold`): a request waits while its worker is full, is
/// served when room frees, and one that waits past its queue timeout gets the queue's 429 with
/// `Retry-After`; nothing is left booked.
#[tokio::test]
async fn the_admission_queue_holds_requests_and_its_429_reaches_the_client() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        &["--queue-threshold", "0.5", "--queue-timeout-ms", "400"],
        &[
            "--worker",
            &upstream.url(),
            "--max-num-batched-tokens",
            "64",
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    let client = client();
    // 40 prefill tokens booked through the selection API on the same port: 40 > 0.5 × 64.
    let worker_id = kvroute_service::api::list_workers(&gw.state, None, None)[0]
        .spec
        .worker_id;
    let blocker = json!({"selection_id": "blk", "worker_id": worker_id,
                         "token_ids": (0..40).collect::<Vec<u32>>()});
    let (status, _, _) = post(&client, &gw.url("/reservations"), &blocker).await;
    assert_eq!(status, 201);
    // Past its timeout: the queue's 429.
    let (status, headers, bytes) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [1, 2, 3], "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&bytes));
    assert_eq!(headers["retry-after"], "1");
    let error: Value = serde_json::from_slice(&bytes).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("queue timeout (400 ms)"),
        "{error}"
    );
    assert!(
        upstream.requests("/v1/completions").is_empty(),
        "nothing reached the engine"
    );
    // Waiting, then served once the blocker's prefill completes.
    let waiting = tokio::spawn({
        let request = post_request(
            &gw.url("/v1/completions"),
            &json!({"model": "default", "prompt": [4, 5, 6], "max_tokens": 2}),
            None,
        );
        let client = client.clone();
        async move { exchange(&client, request).await }
    });
    eventually("the request waits in the queue", || {
        kvroute_service::api::loads(&gw.state, None, None)[0].pending_count == 1
    })
    .await;
    let (status, _, _) = post(
        &client,
        &gw.url("/reservations/blk/prefill_complete"),
        &json!({}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(waiting.await.unwrap().0, 200);
    assert_eq!(upstream.requests("/v1/completions").len(), 1);
    let (status, _, _) = exchange(
        &client,
        hyper::Request::delete(gw.url("/reservations/blk"))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    gw.assert_no_booking_left().await;
}
