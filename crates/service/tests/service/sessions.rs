//! Session affinity over HTTP beyond what Dynamo's recording covers (`dynamo_compat` replays
//! that): soft mode, sessions on explicit bookings, the metrics. Workers have no KV events, so
//! their caches are predicted from bookings (TTL model).

use crate::common::{TestApp, error_of};
use kvroute_service::ServeConfig;
use serde_json::{Value, json};

fn app(args: &[&str]) -> TestApp {
    let mut all = vec!["kvroute", "--session-affinity-ttl-secs", "30"];
    all.extend_from_slice(args);
    TestApp::with_config(ServeConfig::parse_from(all).unwrap())
}

async fn register(app: &TestApp, workers: &[u64]) {
    for &id in workers {
        let body = json!({"worker_id": id, "endpoint": format!("http://w{id}"), "block_size": 4,
                          "total_kv_blocks": 100});
        assert_eq!(app.post("/workers", body).await.status, 201);
    }
}

fn prompt(first: u32) -> Value {
    json!((first..first + 17).collect::<Vec<u32>>())
}

#[tokio::test]
async fn soft_mode_leaves_a_busy_worker_and_hard_mode_stays() {
    for (mode, stays) in [("hard", true), ("soft", false)] {
        let app = app(&[
            "--session-affinity-mode",
            mode,
            "--busy-decode-fraction",
            "0.5",
        ]);
        register(&app, &[1, 2]).await;
        let first = app
            .post(
                "/select_and_reserve",
                json!({"token_ids": prompt(1), "session_id": "s", "reservation_id": "s-1",
                       "allowed_worker_ids": [2]}),
            )
            .await;
        assert_eq!(first.body["worker_id"], 2, "{}", first.text);
        // 60 of worker 2's 100 blocks: busy.
        let big: Vec<u32> = (1000..1240).collect();
        let booked = app
            .post(
                "/reservations",
                json!({"reservation_id": "big", "worker_id": 2, "token_ids": big}),
            )
            .await;
        assert_eq!(booked.status, 201, "{}", booked.text);
        let next = app
            .post(
                "/select_and_reserve",
                json!({"token_ids": prompt(1), "session_context": {"session_id": "s"},
                       "reservation_id": "s-2"}),
            )
            .await;
        let expected = if stays { 2 } else { 1 };
        assert_eq!(next.body["worker_id"], expected, "{mode}: {}", next.text);
        // Soft mode rebound the session where it went; hard mode kept it.
        assert_eq!(app.delete("/reservations/big").await.status, 200);
        let after = app
            .post(
                "/select",
                json!({"token_ids": prompt(500), "session_id": "s"}),
            )
            .await;
        assert_eq!(after.body["worker_id"], expected, "{mode}");
    }
}

#[tokio::test]
async fn an_explicit_booking_carries_a_session() {
    let app = app(&[]);
    register(&app, &[1, 2, 3]).await;
    let booked = app
        .post(
            "/reservations",
            json!({"reservation_id": "e-1", "worker_id": 3, "token_ids": prompt(1),
                   "session_context": {"session_id": "e", "input_trigger": "user_message"}}),
        )
        .await;
    assert_eq!(booked.status, 201, "{}", booked.text);
    assert!(booked.body.get("session_id").is_none());
    for first in [100, 200] {
        let reply = app
            .post(
                "/select",
                json!({"token_ids": prompt(first), "session_id": "e"}),
            )
            .await;
        assert_eq!(reply.body["worker_id"], 3);
    }
    let long = "x".repeat(257);
    let refused = app
        .post(
            "/reservations",
            json!({"reservation_id": "e-2", "worker_id": 3, "token_ids": prompt(1),
                   "session_id": long}),
        )
        .await;
    assert_eq!(refused.status, 400);
    assert_eq!(
        error_of(&refused),
        "session affinity ID must not exceed 256 bytes"
    );
    let metrics = app.get("/metrics").await.text;
    assert!(metrics.contains("kvroute_session_bindings 1"), "{metrics}");
    assert!(
        metrics.contains("kvroute_session_bindings_events_total{event=\"bound\"} 1"),
        "{metrics}"
    );
}
