//! Engine load from `/metrics` (`--engine-metrics-poll-ms`): polls of real sockets on
//! 127.0.0.1 answering heavy load, garbage or nothing, and what selection makes of them. The
//! rounds are run one at a time ([`engine_load::poll_once`]), so each test is bounded in count;
//! staleness is reached by moving the service's clock, not by waiting.

use crate::common::TestApp;
use axum::Router;
use axum::routing::get;
use kvroute_core::event::Rank;
use kvroute_service::{ServeConfig, engine_load};
use kvroute_testkit::openai_engine::{MockEngine, MockEngineConfig};
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const POLL: Duration = Duration::from_millis(200);

fn vllm_body(running: u64, waiting: u64, usage: f64) -> String {
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {usage}\n"
    )
}

/// Serves `body` at `GET /metrics` on 127.0.0.1 until the task is aborted.
async fn metrics_server(body: String) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route("/metrics", get(move || async move { body }));
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, task)
}

/// Accepts connections on 127.0.0.1 and never answers (at most 16 held).
async fn silent_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while held.len() < 16 {
            match listener.accept().await {
                Ok((socket, _)) => held.push(socket),
                Err(_) => break,
            }
        }
        std::future::pending::<()>().await;
    });
    (addr, task)
}

fn polling_app() -> TestApp {
    let config = ServeConfig::parse_from(["kvroute", "--engine-metrics-poll-ms", "200"]).unwrap();
    TestApp::with_config(config)
}

async fn register(app: &TestApp, worker_id: u64, addr: SocketAddr) {
    let body = json!({"worker_id": worker_id, "endpoint": format!("http://{addr}"),
                      "block_size": 4, "total_kv_blocks": 1000});
    let reply = app.post("/workers", body).await;
    assert_eq!(reply.status, 201, "{}", reply.text);
}

async fn pick(app: &TestApp, allowed: &[u64], first_token: u32) -> u64 {
    let tokens: Vec<u32> = (first_token..first_token + 17).collect();
    let reply = app
        .post(
            "/select",
            json!({"token_ids": tokens, "allowed_worker_ids": allowed}),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    reply.body["worker_id"].as_u64().unwrap()
}

#[tokio::test]
async fn polls_steer_selection_and_count_garbage_and_silence() {
    let app = polling_app();
    let (heavy, heavy_task) = metrics_server(vllm_body(60, 40, 0.9)).await;
    let (light, light_task) = metrics_server(vllm_body(0, 0, 0.0)).await;
    let (garbage, garbage_task) =
        metrics_server("<html><body>502 Bad Gateway</body></html>".into()).await;
    let (silent, silent_task) = silent_server().await;
    for (id, addr) in [(1, heavy), (2, light), (3, garbage), (4, silent)] {
        register(&app, id, addr).await;
    }
    // A booking on worker 2: by booked load alone, worker 1 is the idler.
    let booked: Vec<u32> = (5000..5040).collect();
    let reply = app
        .post(
            "/reservations",
            json!({"reservation_id": "b", "worker_id": 2, "token_ids": booked}),
        )
        .await;
    assert_eq!(reply.status, 201, "{}", reply.text);
    assert_eq!(pick(&app, &[1, 2], 1).await, 1);

    let started = Instant::now();
    let polled = engine_load::poll_once(&app.state, POLL).await;
    // The silent worker's poll was given up at its bound, not waited on.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(polled, 4);
    let metrics = app.state.metrics();
    assert_eq!(metrics.engine_polls(), 2);
    assert_eq!(metrics.engine_poll_errors("parse"), 1);
    assert_eq!(metrics.engine_poll_errors("timeout"), 1);
    let exposition = app.get("/metrics").await.text;
    assert!(
        exposition.contains("kvroute_engine_metrics_poll_errors_total{reason=\"timeout\"} 1"),
        "{exposition}"
    );

    // The engine's own load (requests this router never booked) now steers the pick.
    assert_eq!(pick(&app, &[1, 2], 100).await, 2);
    let now = app.state.now();
    let selector = app.state.selector_for_tests();
    assert_eq!(
        selector
            .read()
            .engine_load(Rank::new(1, 0), now)
            .map(|l| l.running + l.waiting),
        Some(100)
    );
    // Garbage and silence leave the bookings alone to count.
    for worker_id in [3, 4] {
        assert_eq!(
            selector.read().engine_load(Rank::new(worker_id, 0), now),
            None
        );
    }

    // Past the max age (2 s, as 2 × 200 ms is less) the report is ignored.
    app.state.advance_clock(Duration::from_millis(2001));
    assert_eq!(pick(&app, &[1, 2], 200).await, 1);

    // An error status and an endpoint this poller cannot speak to are counted too.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let not_found = listener.local_addr().unwrap();
    let not_found_task = tokio::spawn(async move {
        let _ = axum::serve(listener, Router::new()).await;
    });
    register(&app, 5, not_found).await;
    let reply = app
        .post(
            "/workers",
            json!({"worker_id": 6, "endpoint": "https://127.0.0.1:9", "block_size": 4}),
        )
        .await;
    assert_eq!(reply.status, 201, "{}", reply.text);
    assert_eq!(engine_load::poll_once(&app.state, POLL).await, 6);
    assert_eq!(metrics.engine_poll_errors("status"), 1);
    assert_eq!(metrics.engine_poll_errors("bad_url"), 1);
    assert_eq!(metrics.engine_polls(), 4);
    assert_eq!(pick(&app, &[1, 2], 300).await, 2, "a fresh report again");
    not_found_task.abort();

    // A deleted worker's report goes with it.
    assert_eq!(app.delete("/workers/1").await.status, 200);
    assert_eq!(selector.read().engine_load_count(), 1);
    for task in [heavy_task, light_task, garbage_task, silent_task] {
        task.abort();
    }
}

#[tokio::test]
async fn the_mock_engine_reports_its_running_request_to_the_poller() {
    let app = polling_app();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = MockEngine::start(
        MockEngineConfig {
            time_scale: 1.0,
            ..MockEngineConfig::default()
        },
        listener,
    )
    .await
    .unwrap();
    register(&app, 7, engine.addr()).await;
    let addr = engine.addr();
    let request = tokio::spawn(async move {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let io = hyper_util::rt::TokioIo::new(stream);
        let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(connection);
        let body = json!({"prompt": "a prompt of a few blocks ".repeat(8), "max_tokens": 2000});
        let request = hyper::Request::post("/v1/completions")
            .header("host", "127.0.0.1")
            .header("content-type", "application/json")
            .body(body.to_string())
            .unwrap();
        let _ = sender.send_request(request).await;
    });
    // The background task, as `serve` starts it; bounded: 250 looks 20 ms apart at most.
    let poller = tokio::spawn(engine_load::run(app.state.clone(), POLL));
    let mut seen = None;
    for _ in 0..250 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let load = app
            .state
            .selector_for_tests()
            .read()
            .engine_load(Rank::new(7, 0), app.state.now());
        if load.is_some_and(|l| l.running == 1) {
            seen = load;
            break;
        }
    }
    let seen = seen.expect("the running request reported");
    assert!(seen.kv_usage.is_some_and(|u| u > 0.0), "{seen:?}");
    assert!(app.state.metrics().engine_polls() >= 1);
    poller.abort();
    request.abort();
    engine.kill();
}
