//! Disaggregated prefill and decode between two mock engines, by hand-made HTTP calls: each
//! protocol end to end, the decode leg refusing missing or wrong transfer fields, and the held
//! blocks released after a transfer and after the hold timeout.

use super::*;
use kvroute_testkit::openai_engine::{PdConfig, PdProtocol, PdRole};

fn pd_engine(role: PdRole, protocol: PdProtocol) -> MockEngineConfig {
    MockEngineConfig {
        events_bind: Some("tcp://127.0.0.1:0".to_string()),
        pd: PdConfig {
            role,
            protocol: Some(protocol),
            bootstrap_port: 0,
            fetch_timeout: Duration::from_millis(500),
            ..PdConfig::default()
        },
        ..fast()
    }
}

async fn subscribe(engine: &MockEngine) -> SubSocket {
    let mut subscriber = SubSocket::new();
    subscriber
        .connect(&engine.events_endpoint().unwrap())
        .await
        .unwrap();
    subscriber.subscribe("").await.unwrap();
    assert!(engine.wait_for_event_subscribers(1, WAIT).await);
    subscriber
}

/// The sequence hashes of the stored blocks in `events`, in order.
fn stored_hashes(events: &[RawEvent]) -> Vec<u64> {
    events
        .iter()
        .flat_map(|e| match e {
            RawEvent::Stored(s) => s.block_hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

/// Waits (bounded) until the engine holds no transfer and no KV block is in use.
async fn until_released(engine: &MockEngine) {
    let deadline = Instant::now() + WAIT;
    while engine.held_transfers() > 0 || engine.engine_load().2 > 0.0 {
        assert!(Instant::now() < deadline, "blocks still held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// 100 prompt tokens: 6 full blocks of 16.
fn prompt() -> String {
    (0..100).map(|i| (b'a' + (i % 26) as u8) as char).collect()
}

fn prefill_params() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
           "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

fn error_message(body: &Value) -> String {
    body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// `GET /v1/models`' `owned_by` of an engine: what routers that detect the engine read.
async fn owned_by(engine: &MockEngine) -> String {
    let (status, body) = Connection::open(engine.addr())
        .await
        .call("GET", "/v1/models", b"")
        .await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_slice(&body).unwrap();
    models["data"][0]["owned_by"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn engines_name_the_runtime_whose_protocol_they_speak() {
    for (role, protocol, runtime) in [
        (PdRole::Prefill, PdProtocol::Sglang, "sglang"),
        (PdRole::Decode, PdProtocol::Sglang, "sglang"),
        (PdRole::Prefill, PdProtocol::Vllm, "vllm"),
        (PdRole::Decode, PdProtocol::Vllm, "vllm"),
    ] {
        let engine = start(pd_engine(role, protocol)).await;
        assert_eq!(owned_by(&engine).await, runtime, "{role:?} {protocol:?}");
        engine.shutdown().await;
    }
    // Role `both` ignores the protocol.
    let both = start(fast()).await;
    assert_eq!(owned_by(&both).await, "vllm");
    both.shutdown().await;
}

#[tokio::test]
async fn vllm_prefill_then_decode_streams_and_releases_the_blocks() {
    let prefill = start(pd_engine(PdRole::Prefill, PdProtocol::Vllm)).await;
    let decode = start(pd_engine(PdRole::Decode, PdProtocol::Vllm)).await;
    let mut prefill_events = subscribe(&prefill).await;
    let mut decode_events = subscribe(&decode).await;
    let (_, tokenized) = post(prefill.addr(), "/tokenize", &json!({"prompt": prompt()})).await;
    let ids: Vec<u32> = serde_json::from_value(tokenized["tokens"].clone()).unwrap();
    assert_eq!(ids.len(), 100);
    let hashes = PromptHashes::from_tokens(&ids, 16, BASE_SEED).sequence;

    // The prefill leg: one token, blocks held, the decode leg's params in the body.
    let (status, answer) = post(
        prefill.addr(),
        "/v1/completions",
        &json!({"prompt": prompt(), "max_tokens": 1, "stream": false,
                "kv_transfer_params": prefill_params()}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], prefill.engine_id());
    assert_eq!(params["remote_request_id"], answer["id"]);
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], prefill.addr().port());
    assert_eq!(params["remote_block_ids"].as_array().unwrap().len(), 6);
    assert_eq!(prefill.held_transfers(), 1);
    assert!(prefill.engine_load().2 > 0.0, "held blocks are in use");
    let published = stored_hashes(&receive_events(&mut prefill_events, 6).await);
    assert_eq!(&published[..6], &hashes[..6]);

    // Wrong or missing fields fail the decode leg and leave the blocks held.
    let decode_body = |params: Value| {
        json!({"prompt": prompt(), "max_tokens": 5, "stream": true,
               "stream_options": {"include_usage": true}, "kv_transfer_params": params})
    };
    let cases = [
        (
            "remote_engine_id",
            json!("someone-else"),
            "unknown remote_engine_id",
        ),
        ("remote_block_ids", json!([1, 2, 3]), "remote_block_ids"),
        (
            "remote_request_id",
            json!("cmpl-nobody"),
            "no KV blocks held",
        ),
    ];
    for (field, value, expected) in cases {
        let mut wrong = params.clone();
        wrong[field] = value;
        let (status, body) = post(decode.addr(), "/v1/completions", &decode_body(wrong)).await;
        assert_eq!(status, 400, "{field}: {body}");
        assert!(error_message(&body).contains(expected), "{field}: {body}");
    }
    let mut missing = params.clone();
    missing.as_object_mut().unwrap().remove("remote_host");
    let (status, body) = post(decode.addr(), "/v1/completions", &decode_body(missing)).await;
    assert_eq!(status, 400);
    assert!(
        error_message(&body).contains("remote_host is missing"),
        "{body}"
    );
    let (status, body) = post(
        decode.addr(),
        "/v1/completions",
        &json!({"prompt": "another prompt entirely", "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(error_message(&body).contains("not this prompt's"), "{body}");
    // That pull took the blocks: prefill again for the real decode leg.
    assert_eq!(prefill.held_transfers(), 0);
    let (_, answer) = post(
        prefill.addr(),
        "/v1/completions",
        &json!({"prompt": prompt(), "max_tokens": 1, "kv_transfer_params": prefill_params()}),
    )
    .await;
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(prefill.held_transfers(), 1);

    // The decode leg streams, served from the transferred blocks.
    let streamed = stream(
        decode.addr(),
        "/v1/completions",
        &decode_body(params.clone()),
        |_| true,
    )
    .await;
    assert!(streamed.clean_end);
    let chunks = streamed.json();
    assert_eq!(chunks.len(), 6, "5 tokens and the usage");
    assert_usage(&chunks[5]["usage"], 100, 5, 96);
    until_released(&prefill).await;
    let received = stored_hashes(&receive_events(&mut decode_events, 6).await);
    assert_eq!(
        &received[..6],
        &hashes[..6],
        "the received blocks are published"
    );

    // Pulled once: the same params again name the problem.
    let (status, body) = post(decode.addr(), "/v1/completions", &decode_body(params)).await;
    assert_eq!(status, 400);
    assert!(error_message(&body).contains("already pulled"), "{body}");
    // Without params a vLLM decode engine runs the whole request.
    let (status, body) = post(
        decode.addr(),
        "/v1/completions",
        &json!({"prompt": prompt(), "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 2);
    // A prefill leg sent to the decode engine is refused.
    let (status, body) = post(
        decode.addr(),
        "/v1/completions",
        &json!({"prompt": prompt(), "kv_transfer_params": prefill_params()}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(error_message(&body).contains("decode engine"), "{body}");
    prefill.shutdown().await;
    decode.shutdown().await;
}

#[tokio::test]
async fn vllm_held_blocks_are_released_after_the_hold_timeout() {
    let mut config = pd_engine(PdRole::Prefill, PdProtocol::Vllm);
    config.pd.hold_timeout = Duration::from_millis(200);
    let prefill = start(config).await;
    let decode = start(pd_engine(PdRole::Decode, PdProtocol::Vllm)).await;
    let (_, answer) = post(
        prefill.addr(),
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": prompt()}], "max_tokens": 1,
                "kv_transfer_params": prefill_params()}),
    )
    .await;
    let params = answer["kv_transfer_params"].clone();
    assert!(params["remote_block_ids"].as_array().is_some(), "{answer}");
    assert_eq!(prefill.held_transfers(), 1);
    until_released(&prefill).await;
    let (status, body) = post(
        decode.addr(),
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": prompt()}],
                "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(error_message(&body).contains("hold timeout"), "{body}");
    // A prefill engine that died cannot be reached: a 502 naming it.
    let (_, answer) = post(
        prefill.addr(),
        "/v1/completions",
        &json!({"prompt": prompt(), "max_tokens": 1, "kv_transfer_params": prefill_params()}),
    )
    .await;
    let params = answer["kv_transfer_params"].clone();
    prefill.kill();
    let (status, body) = post(
        decode.addr(),
        "/v1/completions",
        &json!({"prompt": prompt(), "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(status, 502, "{body}");
    assert!(error_message(&body).contains(prefill.engine_id()), "{body}");
    decode.shutdown().await;
}

#[tokio::test]
async fn sglang_prefill_and_decode_meet_in_a_bootstrap_room() {
    let prefill = start(pd_engine(PdRole::Prefill, PdProtocol::Sglang)).await;
    let decode = start(pd_engine(PdRole::Decode, PdProtocol::Sglang)).await;
    let mut decode_events = subscribe(&decode).await;
    let bootstrap_port = prefill.bootstrap_addr().unwrap().port();
    let body = |room: Value| {
        json!({"messages": [{"role": "user", "content": prompt()}], "max_tokens": 4,
               "stream": true, "bootstrap_host": "127.0.0.1",
               "bootstrap_port": bootstrap_port, "bootstrap_room": room})
    };
    // The same body to both at once; the decode waits for the room.
    let both = body(json!(5_764_607_523_034_234_879u64));
    let (streamed, prefilled) = tokio::join!(
        stream(decode.addr(), "/v1/chat/completions", &both, |_| true),
        stream(prefill.addr(), "/v1/chat/completions", &both, |_| true),
    );
    assert!(streamed.clean_end && prefilled.clean_end);
    let tokens = |s: &Streamed| {
        s.json()
            .iter()
            .filter(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
            })
            .count()
    };
    assert_eq!(tokens(&streamed), 4);
    assert_eq!(tokens(&prefilled), 1, "a prefill leg makes one token");
    until_released(&prefill).await;
    let recent = decode.recent_requests();
    assert!(
        recent[0].cached_tokens > 0,
        "served from the received blocks"
    );
    let received = stored_hashes(&receive_events(&mut decode_events, 1).await);
    assert!(!received.is_empty());

    // A room never prefilled, a missing room, a prefill for another bootstrap port.
    let (status, answer) = post(decode.addr(), "/v1/chat/completions", &body(json!([42]))).await;
    assert_eq!(status, 400);
    assert!(
        error_message(&answer).contains("bootstrap room 42"),
        "{answer}"
    );
    let mut no_room = body(json!(1));
    no_room.as_object_mut().unwrap().remove("bootstrap_room");
    for engine in [&prefill, &decode] {
        let (status, answer) = post(engine.addr(), "/v1/chat/completions", &no_room).await;
        assert_eq!(status, 400);
        assert!(
            error_message(&answer).contains("bootstrap_room is missing"),
            "{answer}"
        );
    }
    let mut wrong_port = body(json!(7));
    wrong_port["bootstrap_port"] = json!(1);
    let (status, answer) = post(prefill.addr(), "/v1/chat/completions", &wrong_port).await;
    assert_eq!(status, 400);
    assert!(
        error_message(&answer).contains("bootstrap port"),
        "{answer}"
    );
    assert_eq!(prefill.held_transfers(), 0);
    prefill.shutdown().await;
    decode.shutdown().await;
}
