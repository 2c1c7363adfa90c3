//! The admission queue over HTTP: requests wait while every rank they may go to is
//! full, and leave it decided, timed out (429), refused when it is full (429), when their client
//! disconnects, or answered 503 at shutdown; tenants share it fairly.

use crate::common::{TestApp, error_of};
use kvroute_service::{AppState, ServeConfig};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// A service queueing above 0.5 × 64 = 32 active prefill tokens, with `flags` added.
fn queued(flags: &[&str]) -> TestApp {
    let mut args = vec!["kvroute", "--queue-threshold", "0.5"];
    args.extend_from_slice(flags);
    TestApp::with_config(ServeConfig::parse_from(args).expect("flags"))
}

async fn worker(app: &TestApp, id: u64, model: &str) {
    let reply = app
        .post(
            "/workers",
            json!({"worker_id": id, "endpoint": format!("http://w{id}:8000"), "block_size": 4,
                   "model_name": model, "max_num_batched_tokens": 64}),
        )
        .await;
    assert_eq!(reply.status, 201, "{}", reply.text);
    assert_eq!(reply.body["lifecycle"], "schedulable");
}

/// Books 40 prefill tokens on `worker`: over 32, so the worker is full.
async fn block(app: &TestApp, id: &str, worker: u64, model: &str) {
    let tokens: Vec<u32> = (0..40).map(|t| 900_000 + t).collect();
    let reply = app
        .post(
            "/reservations",
            json!({"model_name": model, "selection_id": id, "worker_id": worker,
                   "token_ids": tokens, "effective_prefill_tokens": 40}),
        )
        .await;
    assert_eq!(reply.status, 201, "{}", reply.text);
}

fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|t| seed * 1000 + t).collect()
}

/// `(pending_count, pending_isl_tokens)` of the model's partition.
async fn pending(app: &TestApp, model: &str) -> (u64, u64) {
    let loads = app.get(&format!("/loads?model_name={model}")).await;
    let p = &loads.body[0];
    (
        p["pending_count"].as_u64().unwrap_or(0),
        p["pending_isl_tokens"].as_u64().unwrap_or(0),
    )
}

async fn wait_pending(app: &TestApp, model: &str, count: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while pending(app, model).await.0 != count {
        assert!(
            Instant::now() < deadline,
            "pending_count never reached {count} (is {:?})",
            pending(app, model).await
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Sends a request in the background; `(status, body, headers' Retry-After)`.
fn spawn(
    app: &TestApp,
    path: &'static str,
    body: Value,
    tenant: Option<&str>,
) -> JoinHandle<(u16, Value, Option<String>)> {
    let app = app.clone();
    let tenant = tenant.map(str::to_string);
    tokio::spawn(async move {
        let headers: Vec<(&str, &str)> = tenant
            .as_deref()
            .map(|t| vec![("x-tenant-id", t)])
            .unwrap_or_default();
        let reply = app
            .raw_with_headers(
                axum::http::Method::POST,
                path,
                serde_json::to_vec(&body).unwrap(),
                &headers,
            )
            .await;
        (reply.0.status.as_u16(), reply.0.body, reply.1)
    })
}

type Sent = JoinHandle<(u16, Value, Option<String>)>;

/// Releases `release`'s prefill, then waits for exactly the next request to be answered (200):
/// its name, taken out of `tasks`.
async fn release_next(app: &TestApp, release: &str, tasks: &mut Vec<(String, Sent)>) -> String {
    let done = app
        .post(
            &format!("/reservations/{release}/prefill_complete"),
            json!({}),
        )
        .await;
    assert_eq!(done.status, 200, "{}", done.text);
    let deadline = Instant::now() + Duration::from_secs(5);
    let (name, task) = loop {
        if let Some(i) = tasks.iter().position(|(_, t)| t.is_finished()) {
            break tasks.remove(i);
        }
        assert!(
            Instant::now() < deadline,
            "nothing released after {release}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let (status, body, _) = task.await.unwrap();
    assert_eq!(status, 200, "{name}: {body}");
    name
}

async fn finished(task: &Sent, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while !task.is_finished() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_while_every_rank_is_full_and_is_decided_when_one_frees() {
    let app = queued(&[]);
    worker(&app, 1, "m").await;
    worker(&app, 2, "m").await;
    block(&app, "b1", 1, "m").await;
    // Worker 2 has room: no waiting.
    let free = app
        .post(
            "/select_and_reserve",
            json!({"model_name": "m", "token_ids": tokens(1, 40), "selection_id": "r1"}),
        )
        .await;
    assert_eq!(
        (free.status.as_u16(), &free.body["worker_id"]),
        (200, &json!(2))
    );
    // Both full now: the next waits.
    let waiting = spawn(
        &app,
        "/select_and_reserve",
        json!({"model_name": "m", "token_ids": tokens(2, 12), "selection_id": "r2"}),
        None,
    );
    wait_pending(&app, "m", 1).await;
    assert_eq!(pending(&app, "m").await, (1, 12));
    assert!(!finished(&waiting, Duration::from_millis(200)).await);
    // A booking of the waiting request's id is refused while it waits (Dynamo's 409).
    let dup = app
        .post(
            "/reservations",
            json!({"model_name": "m", "selection_id": "r2", "worker_id": 1, "token_ids": [1, 2]}),
        )
        .await;
    assert_eq!(dup.status, 409);
    assert_eq!(
        error_of(&dup),
        "selection r2 is already reserved or being reserved"
    );
    // Advisory selects and explicit bookings never wait.
    let advisory = app
        .post(
            "/select",
            json!({"model_name": "m", "token_ids": tokens(3, 8), "advisory": true}),
        )
        .await;
    assert_eq!(advisory.status, 200);
    // Worker 1's prefill completes: 0 active there, the waiting request goes to it.
    let done = app
        .post("/reservations/b1/prefill_complete", json!({}))
        .await;
    assert_eq!(done.status, 200);
    let (status, body, _) = waiting.await.unwrap();
    assert_eq!((status, &body["worker_id"]), (200, &json!(1)), "{body}");
    assert_eq!(body["reservation_id"], "r2");
    assert_eq!(pending(&app, "m").await, (0, 0));
    let metrics = app.get("/metrics").await.text;
    assert!(
        metrics.contains("kvroute_queue_admitted_total 1"),
        "{metrics}"
    );
    assert!(metrics.contains("kvroute_queue_wait_seconds_count{outcome=\"admitted\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_request_gets_429_with_retry_after_and_books_nothing() {
    let app = queued(&["--queue-timeout-ms", "150"]);
    worker(&app, 1, "m").await;
    block(&app, "b1", 1, "m").await;
    let started = Instant::now();
    let by_default = spawn(
        &app,
        "/select_and_reserve",
        json!({"model_name": "m", "token_ids": tokens(1, 8), "selection_id": "t1"}),
        None,
    );
    // Its own bound overrides the flag's.
    let own = spawn(
        &app,
        "/select_and_reserve",
        json!({"model_name": "m", "token_ids": tokens(2, 8), "selection_id": "t2",
               "queue_timeout_ms": 600}),
        None,
    );
    let (status, body, retry) = by_default.await.unwrap();
    let waited = started.elapsed();
    assert_eq!(status, 429, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("queue timeout (150 ms)"),
        "{body}"
    );
    assert_eq!(retry.as_deref(), Some("1"));
    assert!(waited >= Duration::from_millis(150), "{waited:?}");
    assert!(
        !own.is_finished(),
        "the 600 ms request left with the 150 ms one"
    );
    let (status, _, _) = own.await.unwrap();
    assert_eq!(status, 429);
    assert!(started.elapsed() >= Duration::from_millis(600));
    assert_eq!(pending(&app, "m").await, (0, 0));
    // Nothing was booked for them: only the blocker is active.
    let loads = app.get("/loads?model_name=m").await;
    assert_eq!(loads.body[0]["loads"][0]["active_requests"], 1);
    assert_eq!(app.delete("/reservations/t1").await.status, 404);
    let bad = app
        .post(
            "/select_and_reserve",
            json!({"model_name": "m", "token_ids": [1], "queue_timeout_ms": 0}),
        )
        .await;
    assert_eq!(bad.status, 422);
    let metrics = app.get("/metrics").await.text;
    assert!(
        metrics.contains("kvroute_queue_shed_total{reason=\"timeout\"} 2"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_bound_a_request_gets_429_at_once() {
    let app = queued(&["--queue-max-requests", "2"]);
    worker(&app, 1, "m").await;
    block(&app, "b1", 1, "m").await;
    let a = spawn(
        &app,
        "/select_and_reserve",
        json!({"model_name": "m", "token_ids": tokens(1, 8)}),
        None,
    );
    let b = spawn(
        &app,
        "/select",
        json!({"model_name": "m", "token_ids": tokens(2, 8)}),
        None,
    );
    wait_pending(&app, "m", 2).await;
    let reply = app
        .raw_with_headers(
            axum::http::Method::POST,
            "/select_and_reserve",
            serde_json::to_vec(
                &json!({"model_name": "m", "token_ids": tokens(3, 8), "selection_id": "c"}),
            )
            .unwrap(),
            &[],
        )
        .await;
    assert_eq!(reply.0.status, 429);
    assert_eq!(
        error_of(&reply.0),
        "the selection queue is full (2 requests waiting); retry later"
    );
    assert_eq!(reply.1.as_deref(), Some("1"));
    // The refused one booked nothing.
    assert_eq!(app.delete("/reservations/c").await.status, 404);
    assert_eq!(pending(&app, "m").await.0, 2);
    app.delete("/reservations/b1").await;
    assert_eq!(a.await.unwrap().0, 200);
    assert_eq!(b.await.unwrap().0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_must_state_its_capacity_while_queueing() {
    let app = queued(&[]);
    let reply = app
        .post(
            "/workers",
            json!({"worker_id": 7, "endpoint": "http://w7:8000", "block_size": 4}),
        )
        .await;
    assert_eq!(reply.status, 201);
    assert_eq!(reply.body["lifecycle"], "incomplete");
    let patched = app
        .call(
            axum::http::Method::PATCH,
            "/workers/7",
            Some(json!({"max_num_batched_tokens": 64})),
        )
        .await;
    assert_eq!(patched.body["lifecycle"], "schedulable");
}

/// A request of the order test: name, prompt tokens, `priority_jump`, `strict_priority`.
type Ordered = (&'static str, u32, f64, u32);

/// The order of a queue: each policy, with `priority_jump` and `strict_priority`, released one
/// at a time by the prefill completions of those before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_policy_and_priority_orders_the_waiting_requests() {
    // (policy, [(name, prompt tokens, priority_jump, strict_priority)], release order)
    let cases: [(&str, Vec<Ordered>, [&str; 4]); 4] = [
        (
            "fcfs",
            vec![
                ("a", 48, 0.0, 0),
                ("b", 36, 0.0, 0),
                ("c", 44, 0.0, 0),
                ("d", 40, 0.0, 0),
            ],
            ["a", "b", "c", "d"],
        ),
        (
            "lcfs",
            vec![
                ("a", 48, 0.0, 0),
                ("b", 36, 0.0, 0),
                ("c", 44, 0.0, 0),
                ("d", 40, 0.0, 0),
            ],
            ["d", "c", "b", "a"],
        ),
        (
            "wspt",
            vec![
                ("a", 48, 0.0, 0),
                ("b", 36, 0.0, 0),
                ("c", 44, 0.0, 0),
                ("d", 40, 0.0, 0),
            ],
            ["b", "d", "c", "a"],
        ),
        // fcfs: d jumps 10 s ahead of everyone; b is strictly first.
        (
            "fcfs",
            vec![
                ("a", 48, 0.0, 0),
                ("b", 36, 0.0, 1),
                ("c", 44, 0.0, 0),
                ("d", 40, 10.0, 0),
            ],
            ["b", "d", "a", "c"],
        ),
    ];
    for (policy, sent, want) in cases {
        let app = queued(&["--queue-policy", policy]);
        worker(&app, 1, "m").await;
        block(&app, "blk", 1, "m").await;
        let mut tasks = Vec::new();
        for (i, (name, n, jump, strict)) in sent.iter().enumerate() {
            tasks.push((
                name.to_string(),
                spawn(
                    &app,
                    "/select_and_reserve",
                    json!({"model_name": "m", "token_ids": tokens(i as u32 + 10, *n),
                           "selection_id": name, "priority_jump": jump, "strict_priority": strict}),
                    None,
                ),
            ));
            wait_pending(&app, "m", i as u64 + 1).await;
            // One second between arrivals, without waiting for it.
            app.state.advance_clock(Duration::from_secs(1));
        }
        let mut order = Vec::new();
        let mut release = "blk".to_string();
        for _ in 0..4 {
            // Exactly one is admitted by each release: every prompt fills the worker again.
            release = release_next(&app, &release, &mut tasks).await;
            assert_eq!(pending(&app, "m").await.0, 3 - order.len() as u64);
            order.push(release.clone());
        }
        assert_eq!(order, want, "{policy} {sent:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_cannot_starve_another() {
    // A turn's credit is one 40-token prompt: turns alternate request by request.
    let app = queued(&[
        "--tenant-weight",
        "small=1",
        "--tenant-weight",
        "big=1",
        "--queue-quantum-tokens",
        "40",
    ]);
    worker(&app, 1, "m").await;
    block(&app, "blk", 1, "m").await;
    // 30 requests of the big tenant first, then 5 of the small one, all 40 tokens.
    let mut tasks = Vec::new();
    for i in 0..30 {
        let task = spawn(
            &app,
            "/select_and_reserve",
            json!({"model_name": "m", "token_ids": tokens(100 + i, 40), "selection_id": format!("big-{i}")}),
            Some("big"),
        );
        tasks.push((format!("big-{i}"), task));
    }
    wait_pending(&app, "m", 30).await;
    for i in 0..5 {
        let task = spawn(
            &app,
            "/select_and_reserve",
            json!({"model_name": "m", "token_ids": tokens(200 + i, 40), "selection_id": format!("small-{i}")}),
            Some("small"),
        );
        tasks.push((format!("small-{i}"), task));
    }
    wait_pending(&app, "m", 35).await;
    let metrics = app.get("/metrics").await.text;
    assert!(
        metrics.contains(
            "kvroute_queue_depth{model_name=\"m\",routing_group=\"default\",tenant=\"small\"} 5"
        ),
        "{metrics}"
    );
    // Release one at a time: by the 12th admission every small request is in.
    let mut admitted: Vec<String> = Vec::new();
    let mut release = "blk".to_string();
    for _ in 0..12 {
        release = release_next(&app, &release, &mut tasks).await;
        admitted.push(release.clone());
    }
    let small_in = admitted.iter().filter(|id| id.starts_with("small")).count();
    assert_eq!(small_in, 5, "admitted: {admitted:?}");
    // Turns alternate: no small request waited behind more than a couple of big ones.
    let first_small = admitted
        .iter()
        .position(|id| id.starts_with("small"))
        .unwrap();
    assert!(first_small <= 2, "admitted: {admitted:?}");
    for (_, t) in tasks {
        t.abort();
    }
}

/// A real server and a client that hangs up while its request waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_leaves_the_queue_and_shutdown_answers_503() {
    use kvroute_testkit::client::HttpClient;
    use tokio::io::AsyncWriteExt;
    let config = ServeConfig::parse_from(["kvroute", "--queue-threshold", "0.5"]).unwrap();
    let state = AppState::new(config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kvroute_service::http::serve(
        Arc::clone(&state),
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    let app = TestApp {
        state: Arc::clone(&state),
    };
    worker(&app, 1, "m").await;
    block(&app, "blk", 1, "m").await;
    for (route, id) in [("/select_and_reserve", "gone-1"), ("/select", "gone-2")] {
        let body =
            json!({"model_name": "m", "token_ids": tokens(5, 12), "selection_id": id}).to_string();
        let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST {route} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        socket.write_all(head.as_bytes()).await.unwrap();
        socket.write_all(body.as_bytes()).await.unwrap();
        wait_pending(&app, "m", 1).await;
        drop(socket);
        // Unlike Dynamo's, a closed /select leaves too.
        wait_pending(&app, "m", 0).await;
    }
    let metrics = app.get("/metrics").await.text;
    assert!(
        metrics.contains("kvroute_queue_shed_total{reason=\"disconnected\"} 2"),
        "{metrics}"
    );
    // Two clients wait; shutdown answers both 503.
    let mut waiting = Vec::new();
    for i in 0..2 {
        let mut client = HttpClient::connect(addr)
            .await
            .unwrap()
            .with_timeout(Duration::from_secs(10));
        let body = json!({"model_name": "m", "token_ids": tokens(6 + i, 12)}).to_string();
        waiting.push(tokio::spawn(async move {
            client
                .request("POST", "/select_and_reserve", Some(body.as_bytes()))
                .await
        }));
    }
    wait_pending(&app, "m", 2).await;
    stop.send(()).unwrap();
    for task in waiting {
        let (status, body) = task
            .await
            .unwrap()
            .expect("an answer, not a dropped connection");
        assert_eq!(status, 503);
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"], "selection service is shutting down");
    }
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("stops")
        .unwrap()
        .unwrap();
}
