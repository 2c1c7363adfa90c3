//! Disaggregated prefill and decode (`--pd-protocol`): both protocols end to end against the
//! mock P/D engines (which refuse any protocol mistake), the legs' bodies field by field through
//! recording upstreams, bypass, failures between and during the legs; after every case no
//! booking is left.

use crate::common::*;
use kvroute_gateway::workers::worker_id_for;
use kvroute_testkit::openai_engine::{MockEngine, MockEngineConfig, PdConfig, PdProtocol, PdRole};
use serde_json::{Value, json};
use std::time::Duration;

async fn pd_engine(role: PdRole, protocol: PdProtocol) -> MockEngine {
    let config = MockEngineConfig {
        events_bind: Some("tcp://127.0.0.1:0".to_string()),
        time_scale: 0.001,
        pd: PdConfig {
            role,
            protocol: Some(protocol),
            bootstrap_port: 0,
            fetch_timeout: Duration::from_secs(2),
            ..PdConfig::default()
        },
        ..MockEngineConfig::default()
    };
    MockEngine::start_on(config, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

fn role_flag(engine: &MockEngine) -> String {
    let mut flag = format!("{}={}", engine.url(), engine.events_endpoint().unwrap());
    if let Some(bootstrap) = engine.bootstrap_addr() {
        flag.push_str(&format!("@{}", bootstrap.port()));
    }
    flag
}

async fn pd_gateway(protocol: &str, prefill: &[String], decode: &[String]) -> TestGateway {
    let mut flags = vec![
        "--pd-protocol",
        protocol,
        "--tokenize",
        "remote",
        "--health-check-secs",
        "0",
    ];
    for p in prefill {
        flags.extend(["--prefill", p.as_str()]);
    }
    for d in decode {
        flags.extend(["--decode", d.as_str()]);
    }
    TestGateway::start(&[], &flags).await
}

/// A prompt of 8 blocks of 16 distinct bytes: never a bypass when nothing holds it.
fn prompt(seed: usize) -> String {
    (0..128)
        .map(|i| char::from(b'a' + ((seed * 7 + i * 3) % 26) as u8))
        .collect()
}

fn tokens_in(body: &[u8]) -> usize {
    sse_payloads(body)
        .iter()
        .filter(|p| *p != "[DONE]")
        .filter_map(|p| serde_json::from_str::<Value>(p).ok())
        .filter(|c| {
            let choice = &c["choices"][0];
            choice["text"]
                .as_str()
                .or(choice["delta"]["content"].as_str())
                .is_some_and(|t| !t.is_empty())
        })
        .count()
}

fn header(headers: &axum::http::HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

#[tokio::test]
async fn vllm_legs_run_on_their_engines_and_the_decode_streams() {
    let prefill = pd_engine(PdRole::Prefill, PdProtocol::Vllm).await;
    let decode = pd_engine(PdRole::Decode, PdProtocol::Vllm).await;
    let gw = pd_gateway("vllm", &[role_flag(&prefill)], &[role_flag(&decode)]).await;
    let client = client();
    let body = json!({"model": "default", "messages": [{"role": "user", "content": prompt(1)}],
        "max_tokens": 6, "stream": true, "stream_options": {"include_usage": true}});
    let (status, headers, bytes) = post(&client, &gw.url("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert_eq!(tokens_in(&bytes), 6);
    assert!(bytes.ends_with(b"data: [DONE]\n\n"));
    assert_eq!(
        header(&headers, "x-kvroute-prefill-worker-id"),
        Some(worker_id_for(&prefill.url()).to_string())
    );
    assert_eq!(
        header(&headers, "x-kvroute-worker-id"),
        Some(worker_id_for(&decode.url()).to_string())
    );
    // The prefill made one token and handed its blocks over; the decode started from them.
    assert_eq!(prefill.recent_requests()[0].completion_tokens, 1);
    let served = &decode.recent_requests()[0];
    assert_eq!(served.completion_tokens, 6);
    assert!(served.cached_tokens >= 128, "{served:?}");
    eventually("the prefill released its blocks", || {
        prefill.held_transfers() == 0
    })
    .await;
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn sglang_legs_meet_in_a_room_and_the_decode_streams() {
    let prefill = pd_engine(PdRole::Prefill, PdProtocol::Sglang).await;
    let decode = pd_engine(PdRole::Decode, PdProtocol::Sglang).await;
    let gw = pd_gateway("sglang", &[role_flag(&prefill)], &[role_flag(&decode)]).await;
    let client = client();
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": "default", "prompt": prompt(2), "max_tokens": 5, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "default", "messages": [{"role": "user", "content": prompt(3)}],
                "max_tokens": 3}),
        ),
    ] {
        let (status, headers, bytes) = post(&client, &gw.url(path), &body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        assert!(header(&headers, "x-kvroute-prefill-worker-id").is_some());
        if body["stream"] == json!(true) {
            assert_eq!(tokens_in(&bytes), 5);
        } else {
            let answer: Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(answer["usage"]["completion_tokens"], 3);
        }
    }
    assert_eq!(prefill.requests_served(), 2);
    assert_eq!(decode.requests_served(), 2);
    assert!(decode.recent_requests().iter().all(|r| r.cached_tokens > 0));
    eventually("the prefill released its blocks", || {
        prefill.held_transfers() == 0
    })
    .await;
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn vllm_leg_bodies_are_the_clients_with_the_protocol_fields() {
    // A recording prefill leg: its body checked field by field; it answers without
    // kv_transfer_params, which fails the request.
    let recorder = Upstream::start().await;
    let decode = pd_engine(PdRole::Decode, PdProtocol::Vllm).await;
    let gw = pd_gateway("vllm", &[recorder.url()], &[role_flag(&decode)]).await;
    let client = client();
    let body = json!({"model": "default", "messages": [{"role": "user", "content": prompt(4)}],
        "max_tokens": 9, "max_completion_tokens": 9, "min_tokens": 2, "temperature": 0.2,
        "stream": true, "stream_options": {"include_usage": true}});
    let request = hyper::Request::post(gw.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", "req-abc")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let (status, _, bytes) = exchange(&client, request).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&bytes));
    assert!(String::from_utf8_lossy(&bytes).contains("without kv_transfer_params"));
    let sent = recorder.requests("/v1/chat/completions");
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].request_id.as_deref(), Some("req-abc"));
    assert_eq!(
        sent[0].body,
        json!({"model": "default", "messages": [{"role": "user", "content": prompt(4)}],
            "max_tokens": 1, "max_completion_tokens": 1, "temperature": 0.2, "stream": false,
            "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
                "remote_port": null}})
    );
    assert_eq!(
        decode.requests_served(),
        0,
        "no decode leg after a failed prefill"
    );
    gw.assert_no_booking_left().await;

    // Wrong transfer parameters reach the decode engine, which refuses them: the client gets
    // its 4xx, naming the problem.
    let real_prefill = pd_engine(PdRole::Prefill, PdProtocol::Vllm).await;
    *recorder.state.faults.answer_extra.lock() = Some(json!({"kv_transfer_params": {
        "do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "nobody",
        "remote_request_id": "cmpl-1", "remote_block_ids": [1, 2],
        "remote_host": "127.0.0.1", "remote_port": real_prefill.addr().port(), "tp_size": 1}}));
    let (status, _, bytes) = post(&client, &gw.url("/v1/chat/completions"), &body).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&bytes));
    assert!(String::from_utf8_lossy(&bytes).contains("unknown remote_engine_id `nobody`"));
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn the_vllm_decode_leg_carries_the_prefill_answers_params_unchanged() {
    let prefill = pd_engine(PdRole::Prefill, PdProtocol::Vllm).await;
    let recorder = Upstream::start().await;
    let gw = pd_gateway("vllm", &[role_flag(&prefill)], &[recorder.url()]).await;
    let body = json!({"model": "default", "prompt": prompt(5), "max_tokens": 4,
        "stream": true, "min_tokens": 1});
    let (status, _, bytes) = post(&client(), &gw.url("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let sent = recorder.requests("/v1/completions");
    assert_eq!(sent.len(), 1);
    let mut decode_body = sent[0].body.clone();
    let params = decode_body
        .as_object_mut()
        .unwrap()
        .remove("kv_transfer_params")
        .unwrap();
    assert_eq!(decode_body, body, "otherwise the client's body");
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["remote_engine_id"], prefill.engine_id());
    assert_eq!(params["remote_port"], prefill.addr().port());
    assert_eq!(params["remote_block_ids"].as_array().unwrap().len(), 8);
    assert!(
        sent[0]
            .request_id
            .as_deref()
            .is_some_and(|id| id.starts_with("kvroute-"))
    );
    assert_eq!(prefill.held_transfers(), 1, "nobody pulled them");
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn sglang_sends_one_body_with_a_room_to_both_legs() {
    let prefill = Upstream::start().await;
    let decode = Upstream::start().await;
    let gw = pd_gateway(
        "sglang",
        &[format!("{}@9999", prefill.url())],
        &[decode.url()],
    )
    .await;
    let body = json!({"model": "default", "prompt": [prompt(6)], "max_tokens": 3, "stream": true});
    let (status, _, bytes) = post(&client(), &gw.url("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert_eq!(tokens_in(&bytes), 3);
    let to_prefill = prefill.requests("/v1/completions");
    let to_decode = decode.requests("/v1/completions");
    assert_eq!((to_prefill.len(), to_decode.len()), (1, 1));
    assert_eq!(
        to_prefill[0].body, to_decode[0].body,
        "the same body to both"
    );
    assert_eq!(to_prefill[0].request_id, to_decode[0].request_id);
    let mut sent = to_decode[0].body.clone();
    let fields = sent.as_object_mut().unwrap();
    assert_eq!(fields.remove("bootstrap_host"), Some(json!("127.0.0.1")));
    assert_eq!(fields.remove("bootstrap_port"), Some(json!(9999)));
    let rooms = fields.remove("bootstrap_room").unwrap();
    let rooms = rooms
        .as_array()
        .expect("a batch of one prompt has a list of rooms");
    assert!(rooms.len() == 1 && rooms[0].as_u64().is_some_and(|r| r < 1 << 63));
    assert_eq!(sent, body, "otherwise the client's body");
    gw.assert_no_booking_left().await;

    // A prefill leg that fails fails the request, though the decode answered. (Another
    // prompt: the prefill worker is now thought to hold this one, a bypass.)
    *prefill.state.faults.status.lock() = Some(500);
    let body = json!({"model": "default", "prompt": prompt(10), "max_tokens": 3});
    let (status, _, bytes) = post(&client(), &gw.url("/v1/completions"), &body).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&bytes));
    assert!(String::from_utf8_lossy(&bytes).contains("upstream says no"));
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn without_prefill_workers_requests_run_whole_on_a_decode_worker() {
    let decode = pd_engine(PdRole::Decode, PdProtocol::Vllm).await;
    let gw = pd_gateway("vllm", &[], &[role_flag(&decode)]).await;
    let body = json!({"model": "default", "prompt": prompt(7), "max_tokens": 3});
    let (status, headers, bytes) = post(&client(), &gw.url("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    assert_eq!(header(&headers, "x-kvroute-prefill-worker-id"), None);
    assert_eq!(decode.recent_requests()[0].completion_tokens, 3);
    let body = json!({"model": "nope", "prompt": prompt(7)});
    let (status, _, bytes) = post(&client(), &gw.url("/v1/completions"), &body).await;
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&bytes));
    assert!(String::from_utf8_lossy(&bytes).contains("The model `nope` does not exist."));
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn a_prefill_engine_dying_between_the_legs_fails_the_request() {
    let prefill = pd_engine(PdRole::Prefill, PdProtocol::Vllm).await;
    let decode = pd_engine(PdRole::Decode, PdProtocol::Vllm).await;
    // The decode leg waits here before pulling: time to kill the prefill engine.
    decode.set_first_token_delay(Duration::from_millis(500));
    let gw = pd_gateway("vllm", &[role_flag(&prefill)], &[role_flag(&decode)]).await;
    let body = json!({"model": "default", "prompt": prompt(8), "max_tokens": 3});
    let url = gw.url("/v1/completions");
    let pending = tokio::spawn(async move { post(&client(), &url, &body).await });
    eventually("the prefill leg answered", || {
        prefill.requests_served() == 1
    })
    .await;
    prefill.kill();
    let (status, _, bytes) = pending.await.unwrap();
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&bytes));
    assert!(String::from_utf8_lossy(&bytes).contains(prefill.engine_id()));
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn a_client_leaving_during_either_leg_frees_both_bookings() {
    // During the prefill leg (vLLM: it answers late).
    let prefill = Upstream::start().await;
    *prefill.state.faults.first_token_delay.lock() = Duration::from_secs(5);
    let decode = Upstream::start().await;
    *decode.state.faults.token_delay.lock() = Duration::from_millis(200);
    let gw = pd_gateway("vllm", &[prefill.url()], &[decode.url()]).await;
    let body = json!({"model": "default", "prompt": prompt(9), "max_tokens": 50,
        "stream": true});
    let request = post_request(&gw.url("/v1/completions"), &body, None);
    let leaving = client();
    let pending = tokio::spawn(async move { leaving.request(request).await });
    eventually("both legs booked", || gw.active_requests() == 2).await;
    pending.abort();
    gw.assert_no_booking_left().await;
    assert!(decode.requests("/v1/completions").is_empty());

    // During the decode leg: the prefill answers at once, the decode streams slowly.
    *prefill.state.faults.first_token_delay.lock() = Duration::ZERO;
    *prefill.state.faults.answer_extra.lock() =
        Some(json!({"kv_transfer_params": {"do_remote_prefill": true}}));
    let request = post_request(&gw.url("/v1/completions"), &body, None);
    let leaving = client();
    let response = leaving.request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.into_body();
    let first = tokio::time::timeout(WAIT, http_body_util::BodyExt::frame(&mut stream))
        .await
        .unwrap();
    assert!(first.is_some());
    assert_eq!(
        gw.active_requests(),
        1,
        "the prefill booking went with its leg"
    );
    drop(stream);
    drop(leaving);
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn a_prefill_leg_past_its_timeout_and_a_decode_engine_dying_free_both_bookings() {
    let prefill = Upstream::start().await;
    *prefill.state.faults.first_token_delay.lock() = Duration::from_secs(5);
    let decode = Upstream::start().await;
    let gw = TestGateway::start(
        &[],
        &[
            "--pd-protocol",
            "vllm",
            "--prefill",
            &prefill.url(),
            "--decode",
            &decode.url(),
            "--first-token-timeout-secs",
            "0.3",
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    let body = json!({"model": "default", "prompt": prompt(11), "max_tokens": 5, "stream": true});
    let (status, _, bytes) = post(&client(), &gw.url("/v1/completions"), &body).await;
    assert_eq!(status, 504, "{}", String::from_utf8_lossy(&bytes));
    assert!(String::from_utf8_lossy(&bytes).contains("did not answer within 300 ms"));
    assert!(decode.requests("/v1/completions").is_empty());
    gw.assert_no_booking_left().await;

    // The decode engine dies mid-stream: the client's stream ends with an error event.
    *prefill.state.faults.first_token_delay.lock() = Duration::ZERO;
    *prefill.state.faults.answer_extra.lock() =
        Some(json!({"kv_transfer_params": {"do_remote_prefill": true}}));
    *decode.state.faults.die_after_tokens.lock() = Some(2);
    let body = json!({"model": "default", "prompt": prompt(12), "max_tokens": 5, "stream": true});
    let (status, _, bytes) = post(&client(), &gw.url("/v1/completions"), &body).await;
    assert_eq!(status, 200);
    let events = sse_payloads(&bytes);
    assert!(events.iter().any(|e| e.contains("\"error\"")), "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    gw.assert_no_booking_left().await;
}

#[tokio::test]
async fn workers_register_with_their_role_and_bootstrap_port() {
    let dir = std::env::temp_dir().join(format!("kvroute-gateway-pd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("workers.toml");
    std::fs::write(
        &file,
        "[[workers]]\nurl = \"http://127.0.0.1:9\"\nrole = \"decode\"\n",
    )
    .unwrap();
    let gw = TestGateway::start(
        &[],
        &[
            "--pd-protocol",
            "sglang",
            "--prefill",
            "http://127.0.0.1:7@8998",
            "--worker",
            "http://127.0.0.1:8",
            "--workers-file",
            file.to_str().unwrap(),
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    let (status, workers) = get_json(&client(), &gw.url("/workers")).await;
    assert_eq!(status, 200);
    let role_of = |url: &str| {
        let id = worker_id_for(url);
        let record = workers
            .as_array()
            .or(workers["workers"].as_array())
            .unwrap()
            .iter()
            .find(|w| w["worker_id"] == json!(id))
            .cloned()
            .unwrap_or_else(|| panic!("{url} registered: {workers}"));
        (record["role"].clone(), record["bootstrap_port"].clone())
    };
    assert_eq!(
        role_of("http://127.0.0.1:7"),
        (json!("prefill"), json!(8998))
    );
    assert_eq!(
        role_of("http://127.0.0.1:9"),
        (json!("decode"), Value::Null)
    );
    // A `both` worker's record leaves the default out, as Dynamo's has no such field.
    assert_eq!(role_of("http://127.0.0.1:8"), (Value::Null, Value::Null));
    let _ = std::fs::remove_dir_all(&dir);
}
