//! The HTTP selection service end to end: the select → reserve → lifecycle flow, every error row
//! of SPEC §7.4 with its exact status and body, bad input, authentication, limits, shutdown, and
//! a bounded load test over a real socket on 127.0.0.1.

use crate::common::{RawClient, TestApp, error_of, rss_bytes};
use axum::http::{Method, StatusCode};
use kvroute_core::event::{KvEvent, StoredBlock, Tier};
use kvroute_core::hash::{BASE_SEED, PromptHashes};
use kvroute_service::{AppState, ServeConfig};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn tokens(n: u32) -> Vec<u32> {
    (1..=n).collect()
}

fn worker(id: u64) -> Value {
    json!({"worker_id": id, "endpoint": format!("http://worker-{id}:8000"), "block_size": 4})
}

async fn with_workers(ids: &[u64]) -> TestApp {
    let app = TestApp::new();
    for &id in ids {
        let r = app.post("/workers", worker(id)).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
        assert_eq!(r.body["lifecycle"], "schedulable");
    }
    app
}

/// Applies the prompt's full blocks as stored on a worker, as its engine's events would.
fn store(app: &TestApp, worker_id: u64, prompt: &[u32], tier: Tier) {
    let h = PromptHashes::from_tokens(prompt, 4, BASE_SEED);
    let blocks = h
        .local
        .iter()
        .zip(&h.sequence)
        .map(|(&local_hash, &engine_hash)| StoredBlock {
            engine_hash,
            local_hash,
        })
        .collect();
    app.state
        .selector_for_tests()
        .write()
        .apply_events(
            worker_id,
            0,
            &[KvEvent::Stored {
                parent: None,
                blocks,
                tier,
            }],
        )
        .expect("known worker");
}

fn load_of(loads: &Value, worker_id: u64) -> Value {
    loads[0]["loads"]
        .as_array()
        .expect("loads")
        .iter()
        .find(|l| l["worker_id"] == worker_id)
        .cloned()
        .expect("rank listed")
}

#[tokio::test]
async fn full_flow_select_replay_lifecycle_free() {
    let app = with_workers(&[1, 2, 3]).await;
    let prompt = tokens(17);
    store(&app, 2, &prompt, Tier::Device);
    let sel = app
        .post(
            "/select",
            json!({"token_ids": prompt, "selection_id": "req-1", "expected_output_tokens": 16}),
        )
        .await;
    assert_eq!(sel.status, StatusCode::OK, "{}", sel.text);
    assert_eq!(sel.body["worker_id"], 2, "the worker holding the prefix");
    assert_eq!(sel.body["overlap"]["gpu"], 16);
    assert_eq!(sel.body["effective_prefill_tokens"], 1);
    assert_eq!(sel.body["selection_id"], "req-1");
    let loads = app.get("/loads").await.body;
    assert_eq!(
        load_of(&loads, 2)["active_requests"],
        0,
        "select books nothing"
    );

    let res = app
        .post("/reservations", json!({"selection_id": "req-1"}))
        .await;
    assert_eq!(res.status, StatusCode::CREATED, "{}", res.text);
    assert_eq!(res.body["worker_id"], 2);
    assert_eq!(res.body["reservation_id"], "req-1");
    let rank = load_of(&app.get("/loads").await.body, 2);
    assert_eq!(
        (
            &rank["active_requests"],
            &rank["potential_prefill_tokens"],
            &rank["potential_decode_blocks"]
        ),
        (&json!(1), &json!(1), &json!(5))
    );

    let r = app
        .post("/reservations/req-1/prefill_complete", json!({}))
        .await;
    assert_eq!(
        (r.status, r.body.clone()),
        (StatusCode::OK, json!({"status": "ok"}))
    );
    assert_eq!(
        load_of(&app.get("/loads").await.body, 2)["potential_prefill_tokens"],
        0
    );
    let r = app
        .call(Method::POST, "/reservations/req-1/output_block", None)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        load_of(&app.get("/loads").await.body, 2)["potential_decode_blocks"],
        6
    );
    let r = app
        .post(
            "/reservations/req-1/output_block",
            json!({"decay_fraction": 0.5}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    // round(0.5 × (5 + 2)) = 4 (half up).
    assert_eq!(
        load_of(&app.get("/loads").await.body, 2)["potential_decode_blocks"],
        4
    );
    let r = app.delete("/reservations/req-1").await;
    assert_eq!(r.status, StatusCode::OK);
    let rank = load_of(&app.get("/loads").await.body, 2);
    assert_eq!(
        (&rank["active_requests"], &rank["potential_decode_blocks"]),
        (&json!(0), &json!(0))
    );
    let again = app.delete("/reservations/req-1").await;
    assert_eq!(again.status, StatusCode::NOT_FOUND);
    assert_eq!(error_of(&again), "reservation req-1 not found");
}

#[tokio::test]
async fn select_and_reserve_and_inspection_routes() {
    // Workers that publish KV events (nothing listens on the port: only the events this test
    // applies count, and the booking's prediction on route).
    let app = TestApp::new();
    for id in [1u64, 2] {
        let mut w = worker(id);
        w["kv_events_endpoint"] = json!(format!("tcp://127.0.0.1:{}", 1 + id));
        assert_eq!(app.post("/workers", w).await.status, StatusCode::CREATED);
    }
    let prompt = tokens(17);
    store(&app, 1, &prompt[..8], Tier::Device);
    let r = app
        .post(
            "/select_and_reserve",
            json!({"token_ids": prompt, "selection_id": "a"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["worker_id"], 1, "the cached prefix");
    assert_eq!(r.body["sequence_hashes"].as_array().map(Vec::len), Some(4));
    assert_eq!(r.body["isl_tokens"], 17);
    assert_eq!(r.body["track_prefill_tokens"], true);
    let scores = app
        .post("/overlap_scores", json!({"token_ids": prompt}))
        .await;
    assert_eq!(scores.status, StatusCode::OK);
    assert_eq!(scores.body["num_blocks"], 4);
    let w1 = scores.body["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == 1)
        .cloned()
        .unwrap();
    assert_eq!(
        w1["device_blocks"], 4,
        "the engine's two blocks and the booking's two predicted ones"
    );
    let potential = app
        .post("/potential_loads", json!({"token_ids": prompt}))
        .await;
    assert_eq!(potential.status, StatusCode::OK);
    assert_eq!(potential.body.as_array().map(Vec::len), Some(2));
    let dump = app.get("/dump").await;
    assert_eq!(dump.status, StatusCode::OK);
    let events = &dump.body["default:default"]["events"];
    assert_eq!(
        events.as_array().map(Vec::len),
        Some(2),
        "two stored blocks (predictions are left out)"
    );
    let ready = app.get("/ready").await;
    assert_eq!(
        (ready.status, &ready.body["schedulable_workers"]),
        (StatusCode::OK, &json!(2))
    );
    assert_eq!(app.get("/health").await.body, json!({"status": "ok"}));
    let metrics = app.get("/metrics").await;
    assert!(metrics.text.contains("kvroute_http_requests_total"));
    assert!(metrics.text.contains("kvroute_rank_active_requests"));
    // Requests are counted under their route template, method and status.
    for line in [
        r#"kvroute_http_requests_total{route="/select_and_reserve",method="POST",status="200"} 1"#,
        r#"kvroute_http_requests_total{route="/workers",method="POST",status="201"} 2"#,
        r#"kvroute_http_requests_total{route="/health",method="GET",status="200"} 1"#,
        r#"kvroute_http_request_duration_seconds_count{route="/overlap_scores"} 1"#,
    ] {
        assert!(metrics.text.contains(line), "{line} in\n{}", metrics.text);
    }
    let openapi = app.get("/openapi.json").await;
    assert_eq!(openapi.body["openapi"], "3.0.3");
    // Hash form with signed and unsigned hashes alike.
    let h = PromptHashes::from_tokens(&prompt, 4, BASE_SEED);
    let signed: Vec<i64> = h.sequence.iter().map(|&x| x as i64).collect();
    let r = app
        .post(
            "/select",
            json!({"block_hashes": h.local, "sequence_hashes": signed, "isl_tokens": 17, "pinned_worker": {"worker_id": 1}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(
        r.body["overlap"]["gpu"], 16,
        "two blocks stored, two predicted"
    );
}

#[tokio::test]
async fn every_error_row_of_the_spec() {
    let app = with_workers(&[1]).await;
    let p17 = tokens(17);
    let cases: Vec<(&str, Value, u16, String)> = vec![
        ("/reservations", json!({}), 400,
         "include selection_id to replay a cached selection, or worker_id with the prompt for a self-contained booking".into()),
        ("/reservations", json!({"worker_id": 1, "token_ids": p17}), 400,
         "reservation_id or selection_id is required to name the booking".into()),
        ("/reservations", json!({"selection_id": "nope"}), 404,
         "no pending selection nope for model=default routing_group=default (expired, already used, or never selected); call select again or book with worker_id and the prompt".into()),
        ("/reservations", json!({"selection_id": "x", "worker_id": 9, "token_ids": p17}), 404,
         "schedulable worker 9 not found for model=default routing_group=default".into()),
        ("/reservations", json!({"selection_id": "x", "worker_id": 1, "dp_rank": 3, "token_ids": p17}), 404,
         "schedulable worker 1 not found for model=default routing_group=default".into()),
        ("/select", json!({"model_name": "m", "token_ids": p17}), 503,
         "no schedulable workers for model=m routing_group=default".into()),
        ("/reservations", json!({"selection_id": "x", "worker_id": 1, "token_ids": p17, "effective_prefill_tokens": 18}), 400,
         "effective_prefill_tokens (18) must not exceed isl_tokens (17)".into()),
        ("/reservations/none/output_block", json!({"decay_fraction": 1.5}), 400,
         "decay_fraction must be between 0.0 and 1.0".into()),
        ("/select", json!({"token_ids": p17, "pinned_worker": {"worker_id": 5}}), 503,
         "no endpoints available to route work".into()),
        ("/select", json!({"token_ids": p17, "allowed_worker_ids": []}), 503,
         "no endpoints available to route work".into()),
        ("/select", json!({}), 400, "block_hashes is required without token_ids".into()),
        ("/reservations", json!({"selection_id": "y", "worker_id": 1}), 400,
         "sequence_hashes is required without token_ids".into()),
        ("/select", json!({"token_ids": []}), 400, "token_ids must not be empty".into()),
        ("/select", json!({"token_ids": p17, "selection_id": "s".repeat(1025)}), 400,
         "selection_id must be at most 1024 bytes".into()),
        ("/select", json!({"token_ids": p17, "model_name": "m".repeat(1025)}), 400,
         "model_name must be at most 1024 bytes".into()),
        ("/select", json!({"token_ids": p17, "routing_group": "g".repeat(1025)}), 400,
         "routing_group must be at most 1024 bytes".into()),
        ("/reservations", json!({"worker_id": 1, "token_ids": p17, "reservation_id": "r".repeat(1025)}), 400,
         "reservation_id must be at most 1024 bytes".into()),
        ("/select", json!({"block_hashes": [1, 2], "sequence_hashes": [1], "isl_tokens": 8}), 400,
         "block_hashes length 2 must match sequence_hashes length 1".into()),
        ("/select", json!({"block_hashes": [], "sequence_hashes": [], "isl_tokens": 0}), 400,
         "isl_tokens must be greater than 0".into()),
    ];
    for (path, body, status, message) in cases {
        let r = app.post(path, body.clone()).await;
        assert_eq!(r.status.as_u16(), status, "{path} {body}: {}", r.text);
        assert_eq!(r.body, json!({"error": message}), "{path} {body}");
    }
    // Duplicate live id, unknown reservation, unknown worker.
    app.post(
        "/select_and_reserve",
        json!({"token_ids": p17, "selection_id": "d"}),
    )
    .await;
    let r = app
        .post(
            "/select_and_reserve",
            json!({"token_ids": p17, "selection_id": "d"}),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), error_of(&r)),
        (409, "Request d already exists (assigned to worker 1)")
    );
    for path in [
        "/reservations/zz/prefill_complete",
        "/reservations/zz/output_block",
    ] {
        let r = app.post(path, json!({})).await;
        assert_eq!(
            (r.status.as_u16(), error_of(&r)),
            (404, "reservation zz not found")
        );
    }
    let r = app.delete("/reservations/zz").await;
    assert_eq!(
        (r.status.as_u16(), error_of(&r)),
        (404, "reservation zz not found")
    );
    let r = app
        .call(Method::PATCH, "/workers/77", Some(json!({"endpoint": "x"})))
        .await;
    assert_eq!(
        (r.status.as_u16(), error_of(&r)),
        (404, "worker 77 not found")
    );
    let r = app.delete("/workers/77").await;
    assert_eq!(
        (r.status.as_u16(), error_of(&r)),
        (404, "worker 77 not found")
    );
    // Routing errors.
    assert_eq!(error_of(&app.get("/nope").await), "route not found");
    let r = app.get("/select").await;
    assert_eq!(
        (r.status.as_u16(), error_of(&r)),
        (405, "method not allowed")
    );
    let r = app.delete("/workers/abc").await;
    assert_eq!(r.status.as_u16(), 400);
    assert!(error_of(&r).contains("worker_id path parameter `abc`"));
    // Every route without workers: 503.
    let empty = TestApp::new();
    for path in [
        "/select",
        "/select_and_reserve",
        "/overlap_scores",
        "/potential_loads",
    ] {
        let r = empty.post(path, json!({"token_ids": p17})).await;
        assert_eq!(
            (r.status.as_u16(), error_of(&r)),
            (
                503,
                "no schedulable workers for model=default routing_group=default"
            ),
            "{path}"
        );
    }
}

#[tokio::test]
async fn replay_survives_a_transient_worker_outage() {
    let app = with_workers(&[1, 2]).await;
    let r = app
        .post(
            "/select",
            json!({"token_ids": tokens(9), "selection_id": "t", "pinned_worker": {"worker_id": 2}}),
        )
        .await;
    assert_eq!(r.body["worker_id"], 2);
    assert_eq!(app.delete("/workers/2").await.status, StatusCode::OK);
    let r = app
        .post("/reservations", json!({"selection_id": "t"}))
        .await;
    assert_eq!(
        (r.status.as_u16(), error_of(&r)),
        (
            404,
            "schedulable worker 2 not found for model=default routing_group=default"
        )
    );
    app.post("/workers", worker(2)).await;
    let r = app
        .post("/reservations", json!({"selection_id": "t"}))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    assert_eq!(r.body["worker_id"], 2);
    // Emptied partition: 503, entry kept.
    app.post(
        "/select",
        json!({"token_ids": tokens(9), "selection_id": "u"}),
    )
    .await;
    app.delete("/workers/1").await;
    app.delete("/workers/2").await;
    let r = app
        .post("/reservations", json!({"selection_id": "u"}))
        .await;
    assert_eq!(r.status.as_u16(), 503);
    app.post("/workers", worker(1)).await;
    app.post("/workers", worker(2)).await;
    let r = app
        .post("/reservations", json!({"selection_id": "u"}))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
}

#[tokio::test]
async fn bad_input_gets_a_4xx_naming_the_problem_and_the_server_keeps_serving() {
    let app = with_workers(&[1]).await;
    let bad: Vec<(&[u8], Option<&str>, u16, &str)> = vec![
        (
            b"{\"token_ids\": [1,2,",
            Some("application/json"),
            400,
            "Failed to parse the request body as JSON",
        ),
        (
            b"{\"token_ids\": [1]} trailing",
            Some("application/json"),
            400,
            "trailing characters",
        ),
        (
            b"\xEF\xBB\xBF{\"token_ids\": [1]}",
            Some("application/json"),
            400,
            "Failed to parse",
        ),
        (
            b"{\"token_ids\": [1], \"token_ids\": [2]}",
            Some("application/json"),
            400,
            "duplicate field `token_ids`",
        ),
        (
            b"{\"token_ids\": [1], \"x\": {\"a\": 1, \"a\": 2}}",
            Some("application/json"),
            400,
            "duplicate key `a`",
        ),
        (
            b"{\"token_ids\": \"1,2\"}",
            Some("application/json"),
            422,
            "token_ids: invalid type",
        ),
        (
            b"{\"token_ids\": [1, -5]}",
            Some("application/json"),
            422,
            "token_ids[1]: invalid value: integer `-5`",
        ),
        (
            b"{\"token_ids\": [4294967296]}",
            Some("application/json"),
            422,
            "token_ids[0]",
        ),
        (
            b"{\"token_ids\": [1], \"expected_output_tokens\": -1}",
            Some("application/json"),
            422,
            "expected_output_tokens",
        ),
        (
            b"{\"token_ids\": [1]}",
            None,
            415,
            "Content-Type: application/json",
        ),
        (
            b"{\"token_ids\": [1]}",
            Some("text/plain"),
            415,
            "Content-Type: application/json",
        ),
        (
            b"[1, 2]",
            Some("application/json"),
            422,
            "expected a JSON object",
        ),
    ];
    for (body, ct, status, needle) in bad {
        let r = app
            .raw(Method::POST, "/select", ct, body.to_vec(), &[])
            .await;
        assert_eq!(
            r.status.as_u16(),
            status,
            "{:?}: {}",
            String::from_utf8_lossy(body),
            r.text
        );
        assert!(
            error_of(&r).contains(needle),
            "{needle:?} not in {}",
            r.text
        );
    }
    let r = app
        .post("/workers", json!({"worker_id": -1, "block_size": 4}))
        .await;
    assert_eq!(r.status.as_u16(), 422);
    assert!(error_of(&r).contains("worker_id"));
    let r = app.post("/workers", json!({"endpoint": "x"})).await;
    assert_eq!(
        (r.status.as_u16(), error_of(&r)),
        (
            422,
            "Failed to deserialize the JSON body into the target type: missing field `worker_id`"
        )
    );
    let r = app
        .post(
            "/workers",
            json!({"worker_id": 4, "block_size": 4294967296u64}),
        )
        .await;
    assert!(error_of(&r).contains("block_size"), "{}", r.text);
    let r = app
        .post(
            "/workers",
            json!({"worker_id": 4, "kv_events_endpoints": {"x": "tcp://a:1"}}),
        )
        .await;
    assert_eq!(r.status.as_u16(), 400);
    assert!(error_of(&r).contains("kv_events_endpoints key `x`"));
    // A bad configuration is recorded, not rejected.
    let r = app
        .post("/workers", json!({"worker_id": 5, "endpoint": "e", "block_size": 0, "kv_events_endpoint": "nonsense"}))
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.body["lifecycle"], "incomplete");
    assert_eq!(
        r.body["not_schedulable_reasons"][0],
        "block_size must be greater than 0"
    );
    // A body over the limit.
    let huge = vec![b' '; 8 * 1024 * 1024 + 1];
    let r = app
        .raw(Method::POST, "/select", Some("application/json"), huge, &[])
        .await;
    assert_eq!(
        (r.status.as_u16(), error_of(&r)),
        (
            413,
            "Failed to buffer the request body: length limit exceeded"
        )
    );
    // Still serving.
    let r = app.post("/select", json!({"token_ids": tokens(8)})).await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn api_key_guards_every_route_but_health_ready_metrics() {
    let mut config = ServeConfig::defaults();
    config.api_key = Some("s3cret".into());
    let app = TestApp::with_config(config);
    for path in ["/health", "/metrics"] {
        assert_eq!(app.get(path).await.status, StatusCode::OK, "{path}");
    }
    assert_eq!(
        app.get("/ready").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let r = app.post("/workers", worker(1)).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert!(error_of(&r).contains("API key"));
    let wrong = app
        .raw(
            Method::GET,
            "/loads",
            None,
            Vec::new(),
            &[("authorization", "Bearer nope")],
        )
        .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    let right = app
        .raw(
            Method::GET,
            "/loads",
            None,
            Vec::new(),
            &[("authorization", "Bearer s3cret")],
        )
        .await;
    assert_eq!(right.status, StatusCode::OK);
}

#[tokio::test]
async fn shutdown_refuses_new_work_with_503() {
    let app = with_workers(&[1]).await;
    app.state.begin_shutdown();
    let r = app.post("/select", json!({"token_ids": tokens(8)})).await;
    assert_eq!(
        (r.status.as_u16(), error_of(&r)),
        (503, "selection service is shutting down")
    );
    assert_eq!(app.get("/health").await.status, StatusCode::OK);
    assert_eq!(
        app.get("/ready").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test]
async fn graceful_shutdown_over_a_real_socket() {
    let state = AppState::new(ServeConfig::defaults()).expect("config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kvroute_service::http::serve(
        Arc::clone(&state),
        listener,
        async move {
            let _ = rx.await;
        },
    ));
    let mut client = RawClient::connect(addr).await;
    let (status, _) = client.request("GET", "/health", None).await;
    assert_eq!(status, 200);
    let (status, _) = client
        .request("POST", "/workers", Some(worker(1).to_string().as_bytes()))
        .await;
    assert_eq!(status, 201);
    tx.send(()).expect("signal");
    let result = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("server stops within 10 s")
        .expect("task");
    assert!(result.is_ok());
    assert!(state.is_shutting_down());
}

/// A bounded load test over a real socket: 8 keep-alive connections for a fixed time run the
/// full select → reserve → prefill_complete → free cycle. No 5xx, nothing left booked, memory
/// flat after warm-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_load_has_no_5xx_and_flat_memory() {
    const CONNECTIONS: usize = 8;
    let duration = Duration::from_secs(
        std::env::var("KVROUTE_LOAD_TEST_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(8),
    );
    let state = AppState::new(ServeConfig::defaults()).expect("config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kvroute_service::http::serve(
        Arc::clone(&state),
        listener,
        async move {
            let _ = rx.await;
        },
    ));
    {
        let mut c = RawClient::connect(addr).await;
        for id in 0..16u64 {
            let (status, _) = c
                .request("POST", "/workers", Some(worker(id).to_string().as_bytes()))
                .await;
            assert_eq!(status, 201);
        }
    }
    let start = Instant::now();
    let rss_samples = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for c in 0..CONNECTIONS {
        let rss_samples = Arc::clone(&rss_samples);
        tasks.push(tokio::spawn(async move {
            let mut client = RawClient::connect(addr).await;
            let mut counts = [0u64; 6];
            let mut n = 0u64;
            while start.elapsed() < duration && n < 2_000_000 {
                n += 1;
                let id = format!("c{c}-{n}");
                // 64 prompt families sharing prefixes, 1,024 tokens each.
                let family = (n % 64) as u32;
                let prompt: Vec<u32> = (0..1024).map(|t| family * 10_000 + t).collect();
                let body = json!({"token_ids": prompt, "selection_id": id}).to_string();
                let steps: [(&str, String, Option<String>); 4] = [
                    ("POST", "/select".into(), Some(body)),
                    (
                        "POST",
                        "/reservations".into(),
                        Some(json!({"selection_id": id}).to_string()),
                    ),
                    ("POST", format!("/reservations/{id}/prefill_complete"), None),
                    ("DELETE", format!("/reservations/{id}"), None),
                ];
                for (method, path, body) in steps {
                    let (status, _) = client
                        .request(method, &path, body.as_deref().map(str::as_bytes))
                        .await;
                    counts[(status / 100) as usize] += 1;
                }
                if c == 0 && n.is_multiple_of(25) {
                    rss_samples.lock().push((start.elapsed(), rss_bytes()));
                }
            }
            counts
        }));
    }
    let mut totals = [0u64; 6];
    for t in tasks {
        let counts = t.await.expect("client");
        for (total, c) in totals.iter_mut().zip(counts) {
            *total += c;
        }
    }
    let requests: u64 = totals.iter().sum();
    println!(
        "load: {requests} requests in {:.1} s over {CONNECTIONS} connections ({:.0} req/s): 2xx {}, 4xx {}, 5xx {}",
        start.elapsed().as_secs_f64(),
        requests as f64 / start.elapsed().as_secs_f64(),
        totals[2],
        totals[4],
        totals[5]
    );
    assert!(requests > 100, "the load loop ran");
    assert_eq!(totals[5], 0, "no 5xx");
    assert_eq!(
        totals[4], 0,
        "no 4xx either: every replay found its selection"
    );
    assert!(
        state.selector_for_tests().read().load_tracker().is_empty(),
        "every booking freed"
    );
    let samples = rss_samples.lock().clone();
    if samples.len() >= 4 {
        let warm = samples[samples.len() / 2].1;
        let last = samples[samples.len() - 1].1;
        println!(
            "rss after warm-up {} MiB, at the end {} MiB",
            warm >> 20,
            last >> 20
        );
        assert!(
            last < warm + (64 << 20),
            "memory grew from {warm} to {last} bytes after warm-up"
        );
    }
    tx.send(()).expect("signal");
    let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
}

#[tokio::test]
async fn lru_model_over_http_credits_a_repeated_prompt_until_others_push_it_out() {
    let mut config = ServeConfig::defaults();
    config.approximate_cache_policy = kvroute_service::config::ApproximatePolicy::Lru;
    let app = TestApp::with_config(config);
    // No KV-event endpoint, a pool of 8 blocks of 4 tokens.
    let mut w = worker(1);
    w["total_kv_blocks"] = json!(8);
    assert_eq!(app.post("/workers", w).await.status, StatusCode::CREATED);
    app.post("/workers", worker(2)).await;
    let cycle = |id: &'static str, prompt: Vec<u32>| {
        let app = &app;
        async move {
            let r = app
                .post(
                    "/reservations",
                    json!({"worker_id": 1, "reservation_id": id, "token_ids": prompt}),
                )
                .await;
            assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
            assert_eq!(
                app.delete(&format!("/reservations/{id}")).await.status,
                StatusCode::OK
            );
        }
    };
    let a = tokens(16);
    cycle("a", a.clone()).await;
    let sel = app.post("/select", json!({"token_ids": a})).await;
    assert_eq!(
        (&sel.body["worker_id"], &sel.body["overlap"]["gpu"]),
        (&json!(1), &json!(16))
    );
    let loads = app.get("/loads").await.body;
    let model = &load_of(&loads, 1)["cache_model"];
    assert_eq!(model["policy"], "lru");
    assert_eq!(
        (&model["resident_blocks"], &model["inactive_blocks"]),
        (&json!(4), &json!(4))
    );
    cycle("b", (100..116).collect()).await;
    cycle("c", (200..216).collect()).await;
    let scores = app.post("/overlap_scores", json!({"token_ids": a})).await;
    let w1 = scores.body["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == 1)
        .cloned()
        .unwrap();
    assert_eq!(w1["device_blocks"], 0, "pushed out by two newer prompts");
    let metrics = app.get("/metrics").await.text;
    assert!(
        metrics.contains("kvroute_approx_lru_total{event=\"evicted_blocks\"} 4"),
        "{metrics}"
    );
}

#[tokio::test]
async fn metrics_count_the_chosen_and_best_overlap_of_every_selection() {
    let app = with_workers(&[1, 2]).await;
    let prompt = tokens(17);
    store(&app, 2, &prompt, Tier::Device);
    let select = |body: Value| {
        let app = &app;
        async move {
            let r = app.post("/select", body).await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.text);
            r.body
        }
    };
    // 1. Advisory, and the holder is picked: 16 of 16, a gap of 0 blocks.
    let r = select(json!({"token_ids": prompt, "advisory": true})).await;
    assert_eq!(
        (&r["worker_id"], &r["overlap"]["gpu"]),
        (&json!(2), &json!(16))
    );
    assert!(
        r.get("best_gpu_overlap").is_none(),
        "the JSON answer keeps Dynamo's shape"
    );
    // 2. The caller rules the holder out: nothing better was on offer, 0 of 0.
    select(json!({"token_ids": prompt, "allowed_worker_ids": [1]})).await;
    // 3. 100 blocks booked on the holder (an unrelated prompt, 0 of 0)...
    let big: Vec<u32> = (1000..1400).collect();
    let r = app
        .post(
            "/select_and_reserve",
            json!({"token_ids": big, "pinned_worker": {"worker_id": 2, "dp_rank": 0}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    // 4. ...send the prompt to worker 1: 0 of 16, a gap of 4 blocks.
    let r = select(json!({"token_ids": prompt})).await;
    assert_eq!(
        (&r["worker_id"], &r["overlap"]["gpu"]),
        (&json!(1), &json!(0))
    );
    // A failed selection counts nothing.
    let r = app
        .post(
            "/select",
            json!({"token_ids": prompt, "allowed_worker_ids": []}),
        )
        .await;
    assert_ne!(r.status, StatusCode::OK);
    let metrics = app.get("/metrics").await.text;
    let partition = r#"model_name="default",routing_group="default""#;
    for line in [
        format!(r#"kvroute_selection_overlap_tokens_total{{{partition},kind="chosen"}} 16"#),
        format!(r#"kvroute_selection_overlap_tokens_total{{{partition},kind="best"}} 32"#),
        format!(r#"kvroute_selection_overlap_gap_blocks_count{{{partition}}} 4"#),
        format!(r#"kvroute_selection_overlap_gap_blocks_sum{{{partition}}} 4.0"#),
        format!(r#"kvroute_selection_overlap_gap_blocks_bucket{{le="0.0",{partition}}} 3"#),
        format!(r#"kvroute_selection_overlap_gap_blocks_bucket{{le="2.0",{partition}}} 3"#),
        format!(r#"kvroute_selection_overlap_gap_blocks_bucket{{le="4.0",{partition}}} 4"#),
        format!(r#"kvroute_selection_overlap_gap_blocks_bucket{{le="1024.0",{partition}}} 4"#),
        format!(r#"kvroute_selection_overlap_gap_blocks_bucket{{le="+Inf",{partition}}} 4"#),
    ] {
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
}

// ---------------------------------------------------------------------------------------------
// Multimodal and Eagle prompts

/// The block hashes generated from Dynamo 1.6.1's own `compute_block_hash_for_seq`.
fn dynamo_hash_fixtures() -> Value {
    serde_json::from_str(include_str!(
        "../../../core/tests/fixtures/dynamo_block_hashes.json"
    ))
    .unwrap()
}

/// Every fixture case of block size 4 through `/select_and_reserve`, as `token_ids` and as
/// `mm_routing_info`: the sequence hashes chain Dynamo's local hashes.
#[tokio::test]
async fn token_prompts_hash_as_dynamo_with_lora_salt_eagle_and_multimodal_infos() {
    let app = with_workers(&[1]).await;
    let fixtures = dynamo_hash_fixtures();
    let mut checked = 0;
    for case in fixtures["cases"].as_array().unwrap() {
        if case["block_size"] != 4 || case["tokens"].as_array().unwrap().is_empty() {
            continue;
        }
        let local: Vec<u64> = case["hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        let expected: Vec<i64> = kvroute_core::hash::sequence_hashes(&local)
            .into_iter()
            .map(|h| h as i64)
            .collect();
        let mut body = json!({
            "token_ids": case["tokens"],
            "lora_name": case["lora_name"],
            "cache_salt": case["cache_salt"],
            "is_eagle": case["is_eagle"],
            "block_mm_infos": case["block_mm_infos"],
        });
        let r = app.post("/select_and_reserve", body.clone()).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        assert_eq!(r.body["sequence_hashes"], json!(expected), "{case}");
        assert_eq!(
            r.body["isl_tokens"],
            json!(case["tokens"].as_array().unwrap().len())
        );
        // The same prompt as Dynamo's routing info wins over other token ids.
        body["mm_routing_info"] = json!({
            "routing_token_ids": case["tokens"],
            "block_mm_infos": if case["block_mm_infos"].is_null() { json!([]) } else { case["block_mm_infos"].clone() },
        });
        body["token_ids"] = json!([7, 7, 7, 7, 7, 7, 7, 7, 7]);
        body["block_mm_infos"] = json!(null);
        let r = app.post("/select_and_reserve", body).await;
        assert_eq!(r.body["sequence_hashes"], json!(expected), "{}", r.text);
        checked += 1;
    }
    assert!(checked >= 40, "{checked} cases");
    // Routing info without tokens leaves the prompt to token_ids.
    let r = app
        .post(
            "/select_and_reserve",
            json!({"token_ids": tokens(8), "mm_routing_info": {"routing_token_ids": []}}),
        )
        .await;
    let plain = PromptHashes::from_tokens(&tokens(8), 4, BASE_SEED);
    assert_eq!(
        r.body["sequence_hashes"],
        json!(kvroute_service::http::types::signed(&plain.sequence))
    );
}

/// The multimodal infos Dynamo rejects are rejected, naming the field: 422 like every other
/// type error of a body.
#[tokio::test]
async fn malformed_multimodal_infos_are_rejected_naming_the_field() {
    let app = with_workers(&[1]).await;
    let fixtures = dynamo_hash_fixtures();
    let mut checked = 0;
    for case in fixtures["rejected"].as_array().unwrap() {
        if case["block_size"] == 0 {
            continue; // The block size is the worker's here.
        }
        let body = json!({
            "token_ids": case["tokens"],
            "block_mm_infos": case["block_mm_infos"],
        });
        for route in [
            "/select",
            "/select_and_reserve",
            "/overlap_scores",
            "/potential_loads",
        ] {
            let r = app.post(route, body.clone()).await;
            assert_eq!(
                r.status.as_u16(),
                422,
                "{route} {}: {}",
                case["what"],
                r.text
            );
            let field = if case["block_mm_infos"].is_null() {
                "token_ids"
            } else {
                "block_mm_infos[0]"
            };
            assert!(error_of(&r).contains(field), "{}: {}", case["what"], r.text);
            // Dynamo's own words where both use serde's.
            let dynamo = case["error"].as_str().unwrap();
            if let Some(missing) = dynamo.strip_prefix("Exception: ")
                && missing.starts_with("missing field")
            {
                assert!(error_of(&r).contains(missing), "{}", r.text);
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 10);
    for (body, needle) in [
        (
            json!({"token_ids": [1], "mm_routing_info": {"block_mm_infos": []}}),
            "mm_routing_info: missing field `routing_token_ids`",
        ),
        (
            json!({"mm_routing_info": {"routing_token_ids": [1], "block_mm_infos": [{"mm_objects": [{"mm_hash": 1, "offsets": [[1]]}]}]}}),
            "mm_routing_info.block_mm_infos[0].mm_objects[0].offsets[0]: invalid length 1, expected a tuple of size 2",
        ),
        (
            json!({"token_ids": [1], "is_eagle": "yes"}),
            "is_eagle: invalid type",
        ),
        (
            json!({"token_ids": [1], "block_mm_infos": {}}),
            "block_mm_infos: invalid type",
        ),
    ] {
        let r = app.post("/select", body.clone()).await;
        assert_eq!(r.status.as_u16(), 422, "{body}: {}", r.text);
        assert!(
            error_of(&r).contains(needle),
            "{needle:?} not in {}",
            r.text
        );
    }
    let r = app
        .post(
            "/reservations",
            json!({"worker_id": 1, "block_mm_infos": [{}], "token_ids": [1]}),
        )
        .await;
    assert_eq!(r.status.as_u16(), 422, "{}", r.text);
    assert!(
        error_of(&r).contains("missing field `mm_objects`"),
        "{}",
        r.text
    );
}
