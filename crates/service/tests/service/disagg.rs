//! Disaggregated prefill and decode over HTTP (SPEC §6.1): roles in the catalog, the
//! `"disaggregated": true` answers and bookings, bypasses, and a Dynamo-style client that runs
//! its prefill and decode pools as two partitions.

use crate::common::{TestApp, error_of};
use kvroute_service::ServeConfig;
use serde_json::{Value, json};

fn app(args: &[&str]) -> TestApp {
    let mut all = vec!["kvroute"];
    all.extend_from_slice(args);
    TestApp::with_config(ServeConfig::parse_from(all).unwrap())
}

/// Prefill workers 1 and 2 (2 with a bootstrap port), decode workers 3 and 4.
async fn register_pd(app: &TestApp) {
    for (id, role) in [(1, "prefill"), (2, "prefill"), (3, "decode"), (4, "decode")] {
        let mut body = json!({"worker_id": id, "endpoint": format!("http://w{id}"),
                              "block_size": 4, "total_kv_blocks": 1000, "role": role});
        if id == 2 {
            body["bootstrap_port"] = json!(8998);
        }
        let r = app.post("/workers", body).await;
        assert_eq!(r.status, 201, "{}", r.text);
    }
}

fn prompt(len: u32) -> Value {
    json!((1..=len).collect::<Vec<u32>>())
}

/// Active requests per worker id, from `/loads`.
async fn active(app: &TestApp) -> Vec<(u64, u64)> {
    let loads = app.get("/loads").await.body;
    let mut out: Vec<(u64, u64)> = loads
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["loads"].as_array().unwrap().clone())
        .map(|l| {
            (
                l["worker_id"].as_u64().unwrap(),
                l["active_requests"].as_u64().unwrap(),
            )
        })
        .collect();
    out.sort_unstable();
    out
}

#[tokio::test]
async fn roles_are_registered_echoed_and_validated() {
    let app = app(&[]);
    register_pd(&app).await;
    let workers = app.get("/workers").await.body;
    let by_id = |id: u64| {
        workers
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["worker_id"] == id)
            .unwrap()
            .clone()
    };
    assert_eq!(by_id(1)["role"], "prefill");
    assert_eq!(by_id(2)["bootstrap_port"], 8998);
    assert_eq!(by_id(3)["role"], "decode");
    // A worker registered as Dynamo registers it has Dynamo's record: no kvroute fields.
    let plain = app
        .post("/workers", json!({"worker_id": 9, "model_name": "other"}))
        .await;
    assert!(plain.body.get("role").is_none(), "{}", plain.text);
    assert!(plain.body.get("bootstrap_port").is_none());
    // A role is one of three.
    let bad = app
        .post("/workers", json!({"worker_id": 5, "role": "verifier"}))
        .await;
    assert_eq!(bad.status, 422, "{}", bad.text);
    assert!(error_of(&bad).contains("role"), "{}", bad.text);
    // PATCH changes a role.
    let patched = app
        .call(
            axum::http::Method::PATCH,
            "/workers/3",
            Some(json!({"role": "both"})),
        )
        .await;
    assert_eq!(patched.status, 200, "{}", patched.text);
    assert!(patched.body.get("role").is_none(), "both is the default");
}

#[tokio::test]
async fn a_disaggregated_select_answers_both_legs_and_books_nothing() {
    let app = app(&[]);
    register_pd(&app).await;
    let r = app
        .post(
            "/select",
            json!({"token_ids": prompt(64), "disaggregated": true, "selection_id": "s"}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["disaggregated"], true);
    assert_eq!(r.body["bypass"], Value::Null);
    let prefill = &r.body["prefill"];
    let decode = &r.body["decode"];
    assert!([1, 2].contains(&prefill["worker_id"].as_u64().unwrap()));
    assert!([3, 4].contains(&decode["worker_id"].as_u64().unwrap()));
    assert_eq!(prefill["effective_prefill_tokens"], 64);
    assert_eq!(decode["effective_prefill_tokens"], 0);
    assert_eq!(prefill["selection_id"], "s.prefill");
    assert_eq!(decode["selection_id"], "s.decode");
    let port = if prefill["worker_id"] == 2 {
        json!(8998)
    } else {
        Value::Null
    };
    assert_eq!(prefill["bootstrap_port"], port);
    assert!(active(&app).await.iter().all(|&(_, n)| n == 0));
    // Each leg replays as a plain booking.
    for leg in ["s.prefill", "s.decode"] {
        let booked = app
            .post("/reservations", json!({"selection_id": leg}))
            .await;
        assert_eq!(booked.status, 201, "{}", booked.text);
        assert_eq!(booked.body["reservation_id"], leg);
    }
    assert_eq!(active(&app).await.iter().map(|&(_, n)| n).sum::<u64>(), 2);
}

#[tokio::test]
async fn select_and_reserve_books_each_leg_and_frees_them_apart() {
    let app = app(&[]);
    register_pd(&app).await;
    let r = app
        .post(
            "/select_and_reserve",
            json!({"token_ids": prompt(64), "disaggregated": true, "reservation_id": "r"}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["prefill"]["reservation_id"], "r.prefill");
    assert_eq!(r.body["decode"]["reservation_id"], "r.decode");
    let prefill_worker = r.body["prefill"]["worker_id"].as_u64().unwrap();
    let decode_worker = r.body["decode"]["worker_id"].as_u64().unwrap();
    let busy: Vec<u64> = active(&app)
        .await
        .into_iter()
        .filter(|&(_, n)| n > 0)
        .map(|(w, _)| w)
        .collect();
    assert_eq!(busy, {
        let mut v = vec![prefill_worker, decode_worker];
        v.sort_unstable();
        v
    });
    // The prefill leg returns first.
    let freed = app.delete("/reservations/r.prefill").await;
    assert_eq!(freed.status, 200, "{}", freed.text);
    assert_eq!(
        active(&app)
            .await
            .into_iter()
            .filter(|&(_, n)| n > 0)
            .collect::<Vec<_>>(),
        vec![(decode_worker, 1)]
    );
    let freed = app.delete("/reservations/r.decode").await;
    assert_eq!(freed.status, 200, "{}", freed.text);
    assert!(active(&app).await.iter().all(|&(_, n)| n == 0));
    // Booked twice under one id: refused, and nothing more is booked. (A longer prompt: the
    // decode worker is now predicted to hold the first 64 tokens, and would run those whole.)
    let again = app
        .post(
            "/select_and_reserve",
            json!({"token_ids": prompt(100), "disaggregated": true, "reservation_id": "r"}),
        )
        .await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(again.body["bypass"], Value::Null, "{}", again.text);
    let dup = app
        .post(
            "/select_and_reserve",
            json!({"token_ids": prompt(100), "disaggregated": true, "reservation_id": "r"}),
        )
        .await;
    assert_eq!(dup.status, 409, "{}", dup.text);
    assert_eq!(active(&app).await.iter().map(|&(_, n)| n).sum::<u64>(), 2);
}

#[tokio::test]
async fn bypasses_run_the_request_whole_on_a_decode_worker() {
    // No prefill worker: every request bypasses.
    let app_no_prefill = app(&[]);
    for id in [3, 4] {
        let r = app_no_prefill
            .post(
                "/workers",
                json!({"worker_id": id, "block_size": 4, "role": "decode",
                       "endpoint": format!("http://w{id}")}),
            )
            .await;
        assert_eq!(r.status, 201);
    }
    let r = app_no_prefill
        .post(
            "/select",
            json!({"token_ids": prompt(64), "disaggregated": true}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["bypass"], "no_prefill_workers");
    assert_eq!(r.body["prefill"], Value::Null);
    assert_eq!(r.body["decode"]["effective_prefill_tokens"], 64);

    // A prompt the decode worker holds (predicted from an earlier booking: no KV events here)
    // bypasses when at most --pd-bypass-tokens are uncached; with 0, one token is too many.
    for (threshold, bypass) in [("8", json!("small_uncached")), ("0", Value::Null)] {
        let app = app(&["--pd-bypass-tokens", threshold]);
        register_pd(&app).await;
        let first = app
            .post(
                "/select_and_reserve",
                json!({"token_ids": prompt(17), "reservation_id": "warm", "allowed_worker_ids": [4]}),
            )
            .await;
        assert_eq!(first.body["worker_id"], 4, "{}", first.text);
        app.delete("/reservations/warm").await;
        let r = app
            .post(
                "/select",
                json!({"token_ids": prompt(17), "disaggregated": true}),
            )
            .await;
        assert_eq!(
            r.body["bypass"], bypass,
            "threshold {threshold}: {}",
            r.text
        );
        if bypass.is_null() {
            assert!(r.body["prefill"].is_object());
        } else {
            assert_eq!(r.body["decode"]["worker_id"], 4);
            assert_eq!(r.body["decode"]["effective_prefill_tokens"], 1);
        }
    }
}

#[tokio::test]
async fn a_pinned_disaggregated_request_is_a_400() {
    let app = app(&[]);
    register_pd(&app).await;
    let r = app
        .post(
            "/select",
            json!({"token_ids": prompt(64), "disaggregated": true,
                   "pinned_worker": {"worker_id": 3}}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(error_of(&r).contains("pinned_worker"), "{}", r.text);
}

/// Dynamo's select service has no P/D mode: its users run the prefill and decode pools as two
/// routing groups and select each leg in its own. That keeps working unchanged.
#[tokio::test]
async fn a_dynamo_style_two_partition_client_keeps_working() {
    let app = app(&["--router-profile", "dynamo"]);
    for (id, group) in [(1, "prefill"), (2, "prefill"), (3, "decode"), (4, "decode")] {
        let r = app
            .post(
                "/workers",
                json!({"worker_id": id, "routing_group": group, "block_size": 4,
                       "endpoint": format!("http://w{id}")}),
            )
            .await;
        assert_eq!(r.status, 201, "{}", r.text);
        assert!(r.body.get("role").is_none());
    }
    let mut booked = Vec::new();
    for (group, workers) in [("prefill", [1, 2]), ("decode", [3, 4])] {
        let r = app
            .post(
                "/select_and_reserve",
                json!({"token_ids": prompt(64), "routing_group": group,
                       "reservation_id": format!("req-{group}")}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert!(workers.contains(&r.body["worker_id"].as_u64().unwrap()));
        booked.push(r.body["reservation_id"].as_str().unwrap().to_string());
    }
    for id in booked {
        let r = app.delete(&format!("/reservations/{id}")).await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    assert!(active(&app).await.iter().all(|&(_, n)| n == 0));
}
