//! Routing that went blind, seen from outside: a worker whose KV events never arrive (its
//! registered address is wrong) and one whose events carry blocks of another size than it
//! registered. Each is reported in `/metrics`, `/loads` and the log, and clears once fixed.

use crate::common::TestApp;
use kvroute_service::ServeConfig;
use kvroute_testkit::fake_engine::FakeEngine;
use kvroute_wire::Encoding;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// The longest any wait here lasts.
const WAIT: Duration = Duration::from_secs(20);

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|t| seed * 10_000 + t).collect()
}

/// The `degraded` entries `/loads` shows on `worker_id`'s ranks (`Null` when none).
async fn degraded(app: &TestApp, worker_id: u64) -> Value {
    let loads = app.get("/loads").await.body;
    loads
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["loads"].as_array().unwrap().iter())
        .find(|l| l["worker_id"] == worker_id)
        .map_or(Value::Null, |l| l["degraded"].clone())
}

/// `kvroute_routing_degraded{worker, reason}` from `/metrics`, when the series exists.
async fn gauge(app: &TestApp, worker_id: u64, reason: &str) -> Option<i64> {
    let text = app.get("/metrics").await.text;
    let series = format!("kvroute_routing_degraded{{worker=\"{worker_id}\",reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
}

/// A TCP port on 127.0.0.1 with nothing bound to it now.
fn free_port() -> u16 {
    let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    socket.local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_kv_events_never_arrive_is_reported_until_they_do() {
    let logs = kvroute_testkit::logs::capture();
    let config = ServeConfig::parse_from([
        "kvroute",
        "--kv-silence-secs",
        "30",
        "--kv-silence-bookings",
        "5",
    ])
    .unwrap();
    let app = TestApp::with_config(config);
    // The engine will publish on this address; for now nothing does (the operator's wrong
    // --kv-events-config).
    let address = format!("tcp://127.0.0.1:{}", free_port());
    let worker = json!({"worker_id": 41, "endpoint": "http://127.0.0.1:9", "block_size": 16,
                        "kv_events_endpoint": address});
    assert_eq!(app.post("/workers", worker).await.status, 201);
    // A worker without an events endpoint is never reported: its cache is modelled.
    let modelled = json!({"worker_id": 43, "endpoint": "http://127.0.0.1:9", "block_size": 16});
    assert_eq!(app.post("/workers", modelled).await.status, 201);
    for i in 0..6u32 {
        for worker_id in [41, 43] {
            let body = json!({"token_ids": prompt(i, 64), "pinned_worker": {"worker_id": worker_id},
                              "reservation_id": format!("silent-{worker_id}-{i}")});
            assert_eq!(app.post("/select_and_reserve", body).await.status, 200);
        }
    }
    // Bookings enough, not for long enough yet.
    app.state.tick(app.state.now());
    assert_eq!(degraded(&app, 41).await, Value::Null);
    assert_eq!(gauge(&app, 41, "no_kv_events").await, None);
    app.state.advance_clock(Duration::from_secs(31));
    app.state.tick(app.state.now());
    let reasons = degraded(&app, 41).await;
    assert_eq!(reasons[0]["reason"], "no_kv_events", "{reasons}");
    let message = reasons[0]["message"].as_str().unwrap();
    assert!(
        message.starts_with("worker 41: 6 bookings in 31 s and no KV event")
            && message.contains(&address),
        "{message}"
    );
    assert_eq!(gauge(&app, 41, "no_kv_events").await, Some(1));
    assert_eq!(degraded(&app, 43).await, Value::Null);
    let warned = logs.lines_with("worker 41: 6 bookings in 31 s and no KV event");
    assert_eq!(warned.len(), 1, "one warning: {warned:?}");
    assert!(warned[0].contains("WARN"), "{warned:?}");
    // Later ticks do not warn again.
    app.state.tick(app.state.now());
    assert_eq!(
        logs.lines_with("worker 41: 6 bookings in 31 s").len(),
        1,
        "warned once"
    );

    // Fixed: the engine publishes where the worker said. The listener reconnects; the first
    // message clears the reason.
    let mut engine = FakeEngine::bind(&address, None, Encoding::Map)
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while degraded(&app, 41).await != Value::Null {
        assert!(Instant::now() < deadline, "the events never cleared it");
        engine
            .publish_stored(None, &prompt(99, 32), 16, None)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(gauge(&app, 41, "no_kv_events").await, Some(0));
    assert!(
        !logs
            .lines_with("routing no longer degraded: its KV events arrive")
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_of_another_block_size_are_reported_until_they_match() {
    let logs = kvroute_testkit::logs::capture();
    let app = TestApp::new();
    let mut engine = FakeEngine::bind("tcp://127.0.0.1:0", None, Encoding::Array)
        .await
        .unwrap();
    let worker = json!({"worker_id": 42, "endpoint": "http://127.0.0.1:9", "block_size": 16,
                        "kv_events_endpoint": engine.pub_endpoint()});
    assert_eq!(app.post("/workers", worker).await.status, 201);
    // The engine runs with 32-token blocks.
    let deadline = Instant::now() + WAIT;
    while degraded(&app, 42).await == Value::Null {
        assert!(Instant::now() < deadline, "the mismatch was never reported");
        engine
            .publish_stored(None, &prompt(1, 64), 32, None)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reasons = degraded(&app, 42).await;
    assert_eq!(reasons[0]["reason"], "block_size_mismatch", "{reasons}");
    let message = reasons[0]["message"].as_str().unwrap();
    assert!(
        message.contains("blocks of 32 tokens") && message.contains("registered block_size 16"),
        "{message}"
    );
    assert_eq!(gauge(&app, 42, "block_size_mismatch").await, Some(1));
    let warned = logs.lines_with("worker 42: its KV events");
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("WARN") && warned[0].contains("block_size_mismatch"));
    // Fixed on the engine's side: its blocks are 16 tokens again.
    engine
        .publish_stored(None, &prompt(2, 64), 16, None)
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while degraded(&app, 42).await != Value::Null {
        assert!(
            Instant::now() < deadline,
            "a matching event never cleared it"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(gauge(&app, 42, "block_size_mismatch").await, Some(0));
    // Deleting the worker drops its series.
    assert_eq!(app.delete("/workers/42").await.status, 200);
    assert_eq!(gauge(&app, 42, "block_size_mismatch").await, None);
}
