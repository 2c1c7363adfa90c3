//! The mock OpenAI engine over real sockets on 127.0.0.1: its routes' exact shapes, its cache,
//! its KV events over ZeroMQ and its faults. Every wait is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use kvroute_core::event::KvEvent;
use kvroute_core::hash::{BASE_SEED, PromptHashes};
use kvroute_testkit::openai_engine::tokenizer::{BYTE_TOKEN_OFFSET, OUTPUT_TEXT};
use kvroute_testkit::openai_engine::{MockEngine, MockEngineConfig};
use kvroute_wire::{RawEvent, decode_batch, frames, to_kv_events};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketRecv, SubSocket};

const WAIT: Duration = Duration::from_secs(20);

async fn start(config: MockEngineConfig) -> MockEngine {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    MockEngine::start(config, listener).await.unwrap()
}

/// A fast engine: one modelled second lasts a millisecond.
fn fast() -> MockEngineConfig {
    MockEngineConfig {
        time_scale: 0.001,
        ..MockEngineConfig::default()
    }
}

fn byte_ids(text: &str) -> Vec<u32> {
    text.bytes()
        .map(|b| u32::from(b) + BYTE_TOKEN_OFFSET)
        .collect()
}

/// One keep-alive HTTP/1.1 connection.
struct Connection {
    sender: SendRequest<Full<Bytes>>,
}

impl Connection {
    async fn open(addr: SocketAddr) -> Self {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (sender, connection) = http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        Self { sender }
    }

    async fn send(
        &mut self,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> hyper::Response<hyper::body::Incoming> {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "127.0.0.1")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::copy_from_slice(body)))
            .unwrap();
        tokio::time::timeout(WAIT, self.sender.send_request(request))
            .await
            .expect("answered in time")
            .unwrap()
    }

    /// `(status, body)` of one exchange.
    async fn call(&mut self, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let response = self.send(method, path, body).await;
        let status = response.status().as_u16();
        let body = tokio::time::timeout(WAIT, response.into_body().collect())
            .await
            .expect("body in time")
            .unwrap()
            .to_bytes();
        (status, body.to_vec())
    }
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, body) = Connection::open(addr)
        .await
        .call("POST", path, body.to_string().as_bytes())
        .await;
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// A streamed answer: each SSE event's data with the time it arrived after the request was sent,
/// and whether the body ended cleanly.
struct Streamed {
    events: Vec<(Duration, String)>,
    clean_end: bool,
}

impl Streamed {
    fn json(&self) -> Vec<Value> {
        self.events
            .iter()
            .filter(|(_, data)| data != "[DONE]")
            .map(|(_, data)| serde_json::from_str(data).unwrap())
            .collect()
    }

    fn first_token_after(&self) -> Duration {
        self.events[0].0
    }
}

/// Sends a streaming request and reads its events; `on_event` may stop reading early (false).
async fn stream(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    mut on_event: impl FnMut(usize) -> bool,
) -> Streamed {
    let mut connection = Connection::open(addr).await;
    let sent = Instant::now();
    let response = connection
        .send("POST", path, body.to_string().as_bytes())
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let mut body = response.into_body();
    let mut buffer = String::new();
    let mut events = Vec::new();
    let clean_end = loop {
        match tokio::time::timeout(WAIT, body.frame())
            .await
            .expect("a frame in time")
        {
            None => break true,
            Some(Err(_)) => break false,
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                buffer.push_str(std::str::from_utf8(&data).unwrap());
                while let Some(end) = buffer.find("\n\n") {
                    let event: String = buffer.drain(..end + 2).collect();
                    let data = event.strip_prefix("data: ").expect("an SSE data line");
                    events.push((sent.elapsed(), data.trim_end().to_string()));
                    if !on_event(events.len()) {
                        return Streamed {
                            events,
                            clean_end: false,
                        };
                    }
                }
            }
        }
    };
    if clean_end {
        assert!(buffer.is_empty(), "a partial event: {buffer:?}");
    }
    Streamed { events, clean_end }
}

/// vLLM's usage, plus the mock's own time to first token (`kvroute_engine_ttft_us`, for the
/// gateway benchmark), which a request that produced a token carries.
fn assert_usage(usage: &Value, prompt: u64, completion: u64, cached: u64) {
    let mut usage = usage.clone();
    let ttft = usage
        .as_object_mut()
        .and_then(|u| u.remove("kvroute_engine_ttft_us"));
    assert_eq!(
        ttft.as_ref().is_some_and(|t| t.as_u64().is_some()),
        completion > 0,
        "kvroute_engine_ttft_us: {ttft:?}"
    );
    assert_eq!(
        &usage,
        &json!({
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}
        })
    );
}

#[tokio::test]
async fn completions_answer_in_openai_shapes_over_keep_alive() {
    let engine = start(fast()).await;
    let mut connection = Connection::open(engine.addr()).await;
    let prompt = "Say something about caches.";
    let requests = [
        json!({"model": "default", "prompt": prompt, "max_tokens": 5}),
        json!({"prompt": byte_ids(prompt), "max_tokens": 5}),
        json!({"prompt": [prompt], "max_tokens": 5}),
        json!({"prompt": [byte_ids(prompt)], "max_tokens": 5, "temperature": 0.7}),
    ];
    for (i, request) in requests.iter().enumerate() {
        let (status, body) = connection
            .call("POST", "/v1/completions", request.to_string().as_bytes())
            .await;
        assert_eq!(status, 200);
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
        assert_eq!(body["object"], "text_completion");
        assert_eq!(body["model"], "default");
        assert!(body["created"].as_u64().unwrap() > 1_600_000_000);
        let choice = &body["choices"][0];
        assert_eq!(body["choices"].as_array().unwrap().len(), 1);
        assert_eq!(choice["index"], 0);
        assert_eq!(choice["text"], OUTPUT_TEXT[..5]);
        assert_eq!(choice["finish_reason"], "length");
        assert!(choice["logprobs"].is_null() && choice["stop_reason"].is_null());
        // The same prompt each time: after the first, all its full blocks are cached.
        let cached = if i == 0 { 0 } else { 16 };
        assert_usage(&body["usage"], prompt.len() as u64, 5, cached);
    }
    // The default length.
    let (_, body) = post(engine.addr(), "/v1/completions", &json!({"prompt": "x"})).await;
    assert_eq!(body["usage"]["completion_tokens"], 16);
    assert_eq!(engine.requests_served(), 5);
    assert_eq!(engine.in_flight(), 0);
    engine.shutdown().await;
}

#[tokio::test]
async fn chat_completions_answer_in_openai_shapes() {
    let engine = start(fast()).await;
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
    ]);
    let (status, body) = post(
        engine.addr(),
        "/v1/chat/completions",
        &json!({"model": "default", "messages": messages, "max_completion_tokens": 7}),
    )
    .await;
    assert_eq!(status, 200);
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["object"], "chat.completion");
    let choice = &body["choices"][0];
    assert_eq!(
        choice["message"],
        json!({"role": "assistant", "content": &OUTPUT_TEXT[..7], "tool_calls": []})
    );
    assert_eq!(choice["finish_reason"], "length");
    let rendered = "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n";
    assert_usage(&body["usage"], rendered.len() as u64, 7, 0);
    // The next turn carries the answer: it hits the blocks that held it. 61 prompt tokens and
    // 6 computed answer tokens filled 4 blocks; the prompt alone fills 3.
    let mut next_turn = messages.as_array().unwrap().clone();
    next_turn.push(json!({"role": "assistant", "content": &OUTPUT_TEXT[..7]}));
    next_turn.push(json!({"role": "user", "content": "And then?"}));
    let (_, body) = post(
        engine.addr(),
        "/v1/chat/completions",
        &json!({"messages": next_turn, "max_tokens": 3}),
    )
    .await;
    assert_eq!(rendered.len(), 61);
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 64);
    // `max_tokens` works too.
    assert_eq!(body["usage"]["completion_tokens"], 3);
    engine.shutdown().await;
}

#[tokio::test]
async fn streams_send_a_chunk_per_token_then_usage_then_done() {
    let engine = start(fast()).await;
    let body = json!({"prompt": "Hello", "max_tokens": 4, "stream": true,
                      "stream_options": {"include_usage": true}});
    let streamed = stream(engine.addr(), "/v1/completions", &body, |_| true).await;
    assert!(streamed.clean_end);
    assert_eq!(streamed.events.last().unwrap().1, "[DONE]");
    let chunks = streamed.json();
    assert_eq!(chunks.len(), 5, "4 tokens and the usage");
    let id = chunks[0]["id"].as_str().unwrap();
    for (i, chunk) in chunks[..4].iter().enumerate() {
        assert_eq!(chunk["id"], id);
        assert_eq!(chunk["object"], "text_completion");
        assert_eq!(chunk["model"], "default");
        assert!(chunk.get("usage").is_none());
        let choice = &chunk["choices"][0];
        assert_eq!(choice["text"], OUTPUT_TEXT[i..i + 1]);
        let finish = if i == 3 { json!("length") } else { Value::Null };
        assert_eq!(choice["finish_reason"], finish);
    }
    assert_eq!(chunks[4]["choices"], json!([]));
    assert_usage(&chunks[4]["usage"], 5, 4, 0);

    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                      "stream": true, "stream_options": {"include_usage": true}});
    let chunks = stream(engine.addr(), "/v1/chat/completions", &body, |_| true)
        .await
        .json();
    assert_eq!(chunks.len(), 5, "the role, 3 tokens and the usage");
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let content: String = chunks[1..4]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(content, OUTPUT_TEXT[..3]);
    assert!(chunks[1]["choices"][0]["delta"].get("role").is_none());
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[4]["choices"], json!([]));
    assert_eq!(chunks[4]["usage"]["completion_tokens"], 3);

    // Without include_usage: the tokens, then [DONE].
    let body = json!({"prompt": "Hello", "max_tokens": 2, "stream": true});
    let streamed = stream(engine.addr(), "/v1/completions", &body, |_| true).await;
    assert_eq!(streamed.events.len(), 3);
    assert_eq!(streamed.events[2].1, "[DONE]");

    // With continuous_usage_stats (vLLM's; guidellm asks for it): the usage so far on each.
    let body = json!({"prompt": "Hello", "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true, "continuous_usage_stats": true}});
    let chunks = stream(engine.addr(), "/v1/completions", &body, |_| true)
        .await
        .json();
    let counts: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["usage"]["completion_tokens"])
        .collect();
    assert_eq!(counts, [&json!(1), &json!(2), &json!(3), &json!(3)]);
    engine.shutdown().await;
}

#[tokio::test]
async fn n_choices_share_one_generation_and_the_usage_counts_each() {
    let engine = start(fast()).await;
    let body = json!({"prompt": "Hello", "max_tokens": 3, "n": 2, "min_tokens": 3,
                      "ignore_eos": true});
    let (status, answer) = post(engine.addr(), "/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["text"], OUTPUT_TEXT[..3]);
    }
    assert_usage(&answer["usage"], 5, 6, 0);
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 3,
                      "stream": true, "stream_options": {"include_usage": true},
                      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]});
    let chunks = stream(engine.addr(), "/v1/chat/completions", &body, |_| true)
        .await
        .json();
    // Per choice: the role and 2 tokens; then the usage.
    assert_eq!(chunks.len(), 3 * 3 + 1);
    for index in 0..3 {
        let text: String = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == index)
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, OUTPUT_TEXT[..2], "choice {index}");
    }
    assert_eq!(chunks[9]["usage"]["completion_tokens"], 6);
    engine.shutdown().await;
}

#[tokio::test]
async fn responses_answer_in_the_responses_api_shapes() {
    let engine = start(fast()).await;
    let body = json!({"model": "default", "instructions": "Be brief.", "input": "Hi",
                      "max_output_tokens": 4});
    let (status, answer) = post(engine.addr(), "/v1/responses", &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["object"], "response");
    assert_eq!(answer["status"], "completed");
    assert_eq!(answer["instructions"], "Be brief.");
    let item = &answer["output"][0];
    assert_eq!(
        (&item["type"], &item["role"]),
        (&json!("message"), &json!("assistant"))
    );
    assert_eq!(item["content"][0]["type"], "output_text");
    assert_eq!(item["content"][0]["text"], OUTPUT_TEXT[..4]);
    // The prompt is the chat of the instructions and the input, as /tokenize renders it.
    let (_, tokenized) = post(
        engine.addr(),
        "/tokenize",
        &json!({"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}]}),
    )
    .await;
    let usage = &answer["usage"];
    assert_eq!(usage["input_tokens"], tokenized["count"]);
    assert_eq!(usage["output_tokens"], 4);
    assert_eq!(
        usage["total_tokens"],
        tokenized["count"].as_u64().unwrap() + 4
    );
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);

    // Streamed: `event:` lines, numbered events, a delta per token, the usage at the end.
    let body = json!({"instructions": "Be brief.", "max_output_tokens": 3, "stream": true,
                      "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]});
    let mut connection = Connection::open(engine.addr()).await;
    let (status, bytes) = connection
        .call("POST", "/v1/responses", body.to_string().as_bytes())
        .await;
    assert_eq!(status, 200);
    let text = String::from_utf8(bytes).unwrap();
    let events: Vec<(String, Value)> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (head, data) = e.split_once('\n').unwrap();
            let kind = head.strip_prefix("event: ").unwrap().to_string();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], kind.as_str());
            (kind, data)
        })
        .collect();
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (_, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"], i);
    }
    let deltas: String = events[4..7]
        .iter()
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, OUTPUT_TEXT[..3]);
    let completed = &events[10].1["response"];
    assert_eq!(completed["status"], "completed");
    assert_eq!(completed["usage"]["output_tokens"], 3);
    // The second time, the same prompt is served from the cache.
    assert!(
        completed["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    engine.shutdown().await;
}

#[tokio::test]
async fn tokenize_answers_the_ids_the_engine_computes() {
    let engine = start(fast()).await;
    let (status, body) = post(
        engine.addr(),
        "/tokenize",
        &json!({"model": "default", "prompt": "héllo"}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        json!({"count": 6, "max_model_len": 32768, "tokens": byte_ids("héllo"), "token_strs": null})
    );
    let messages = json!([{"role": "user", "content": "What is a KV cache?"}]);
    let (_, tokenized) = post(
        engine.addr(),
        "/tokenize",
        &json!({"model": "default", "messages": messages, "add_generation_prompt": true}),
    )
    .await;
    let (_, answer) = post(
        engine.addr(),
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1}),
    )
    .await;
    assert_eq!(tokenized["count"], answer["usage"]["prompt_tokens"]);
    let (_, without) = post(
        engine.addr(),
        "/tokenize",
        &json!({"messages": messages, "add_generation_prompt": false}),
    )
    .await;
    assert_eq!(
        without["count"].as_u64().unwrap() + "<|assistant|>\n".len() as u64,
        tokenized["count"].as_u64().unwrap()
    );
    let (_, text) = post(
        engine.addr(),
        "/detokenize",
        &json!({"tokens": byte_ids("héllo")}),
    )
    .await;
    assert_eq!(text, json!({"prompt": "héllo"}));
    engine.shutdown().await;
}

#[tokio::test]
async fn a_repeated_prompt_hits_the_cache_and_its_first_token_comes_sooner() {
    // The modelled pace: 4,096 uncached tokens take ~86 ms of prefill, 16 take ~17 ms.
    let engine = start(MockEngineConfig::default()).await;
    let prompt: String = (0..4096).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    let body = json!({"prompt": prompt, "max_tokens": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let first = stream(engine.addr(), "/v1/completions", &body, |_| true).await;
    let again = stream(engine.addr(), "/v1/completions", &body, |_| true).await;
    let usage = |s: &Streamed| s.json().last().unwrap()["usage"].clone();
    assert_usage(&usage(&first), 4096, 2, 0);
    assert_usage(&usage(&again), 4096, 2, 4080);
    assert_eq!(engine.last_cached_tokens(), Some(4080));
    assert!(
        first.first_token_after() >= Duration::from_millis(80),
        "the first prefill takes its modelled time: {:?}",
        first.first_token_after()
    );
    assert!(
        again.first_token_after() < first.first_token_after(),
        "cached: {:?}, uncached: {:?}",
        again.first_token_after(),
        first.first_token_after()
    );
    let recent = engine.recent_requests();
    assert_eq!(recent.len(), 2);
    assert_eq!(recent[0].cached_tokens, 0);
    assert!(recent[1].time_to_first_token < recent[0].time_to_first_token);
    engine.shutdown().await;
}

/// Every `BlockStored` and `BlockRemoved` the engine publishes until `count` blocks are stored.
async fn receive_events(subscriber: &mut SubSocket, stored_blocks: usize) -> Vec<RawEvent> {
    let mut events = Vec::new();
    let mut stored = 0;
    while stored < stored_blocks {
        let message = tokio::time::timeout(WAIT, subscriber.recv())
            .await
            .expect("KV events in time")
            .unwrap()
            .into_vec();
        let live = frames::parse_live_message(&message).unwrap();
        let batch = decode_batch(live.payload).unwrap();
        for event in &batch.events {
            if let RawEvent::Stored(s) = event {
                stored += s.block_hashes.len();
            }
        }
        events.extend(batch.events);
    }
    events
}

#[tokio::test]
async fn kv_events_go_out_in_the_encoding_asked_for() {
    for (encoding, map_marker) in [
        (kvroute_wire::Encoding::Array, false),
        (kvroute_wire::Encoding::Map, true),
    ] {
        let engine = start(MockEngineConfig {
            events_bind: Some("tcp://127.0.0.1:0".to_string()),
            events_encoding: encoding,
            ..fast()
        })
        .await;
        let mut subscriber = SubSocket::new();
        subscriber
            .connect(&engine.events_endpoint().unwrap())
            .await
            .unwrap();
        subscriber.subscribe("").await.unwrap();
        assert!(engine.wait_for_event_subscribers(1, WAIT).await);
        let prompt: String = (0..40).map(|i| (b'a' + (i % 26) as u8) as char).collect();
        let body = json!({"prompt": prompt, "max_tokens": 2});
        assert_eq!(post(engine.addr(), "/v1/completions", &body).await.0, 200);
        let message = tokio::time::timeout(WAIT, subscriber.recv())
            .await
            .expect("KV events in time")
            .unwrap()
            .into_vec();
        let live = frames::parse_live_message(&message).unwrap();
        // msgpack maps start 0x80-0x8f, 0xde or 0xdf; arrays 0x90-0x9f, 0xdc or 0xdd.
        let first = live.payload[0];
        let is_map = (0x80..=0x8f).contains(&first) || first == 0xde || first == 0xdf;
        assert_eq!(is_map, map_marker, "{encoding:?}: first byte {first:#x}");
        let batch = decode_batch(live.payload).unwrap();
        assert!(
            batch
                .events
                .iter()
                .any(|e| matches!(e, RawEvent::Stored(_))),
            "{encoding:?}"
        );
        engine.shutdown().await;
    }
}

#[tokio::test]
async fn kv_events_name_blocks_by_kvroute_hashes_of_the_prompt() {
    let engine = start(MockEngineConfig {
        events_bind: Some("tcp://127.0.0.1:0".to_string()),
        engine: kvroute_sim::EngineConfig {
            kv_blocks: Some(16),
            ..fast().engine
        },
        ..fast()
    })
    .await;
    let mut subscriber = SubSocket::new();
    subscriber
        .connect(&engine.events_endpoint().unwrap())
        .await
        .unwrap();
    subscriber.subscribe("").await.unwrap();
    assert!(engine.wait_for_event_subscribers(1, WAIT).await);

    // 100 prompt tokens and 20 output ones: 119 are computed, 7 full blocks of 16.
    let prompt: String = (0..100).map(|i| (b'A' + (i % 50) as u8) as char).collect();
    let (_, tokenized) = post(engine.addr(), "/tokenize", &json!({"prompt": prompt})).await;
    let prompt_ids: Vec<u32> = serde_json::from_value(tokenized["tokens"].clone()).unwrap();
    let (status, _) = post(
        engine.addr(),
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 20}),
    )
    .await;
    assert_eq!(status, 200);
    let events = receive_events(&mut subscriber, 7).await;
    let mut stored_hashes = Vec::new();
    let mut stored_tokens: Vec<u32> = Vec::new();
    for event in &events {
        if let RawEvent::Stored(s) = event {
            assert_eq!(s.block_size, 16);
            assert_eq!(s.parent_block_hash, stored_hashes.last().copied());
            stored_hashes.extend(&s.block_hashes);
            stored_tokens.extend(&s.token_ids);
        }
    }
    // The prompt's 6 full blocks carry kvroute's hashes of the prompt alone: what a router
    // computes for this prompt at block size 16.
    let prompt_hashes = PromptHashes::from_tokens(&prompt_ids, 16, BASE_SEED);
    assert_eq!(stored_hashes[..6], prompt_hashes.sequence[..]);
    assert_eq!(stored_tokens[..96], prompt_ids[..96]);
    // The 7th holds the prompt's last 4 tokens and the answer's first 12.
    let mut all_ids = prompt_ids.clone();
    all_ids.extend(engine.tokenizer().output_ids(20));
    let all_hashes = PromptHashes::from_tokens(&all_ids, 16, BASE_SEED);
    assert_eq!(stored_hashes, all_hashes.sequence[..7]);
    assert_eq!(stored_tokens, all_ids[..112]);
    // kvroute's conversion hashes the events' tokens to the prompt's local hashes.
    let batch = kvroute_wire::EventBatch {
        ts: 0.0,
        events: events.clone(),
        data_parallel_rank: None,
    };
    let locals: Vec<u64> = to_kv_events(&batch)
        .events
        .iter()
        .flat_map(|e| match e {
            KvEvent::Stored { blocks, .. } => blocks.iter().map(|b| b.local_hash).collect(),
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(locals[..6], prompt_hashes.local[..]);

    // Another prompt needs the pool's 16 blocks: the first one's are evicted, tail first.
    let other: String = (0..200).map(|i| (b'a' + (i % 20) as u8) as char).collect();
    post(
        engine.addr(),
        "/v1/completions",
        &json!({"prompt": other, "max_tokens": 1}),
    )
    .await;
    let events = receive_events(&mut subscriber, 12).await;
    let removed: Vec<u64> = events
        .iter()
        .flat_map(|e| match e {
            RawEvent::Removed(r) => r.block_hashes.clone(),
            _ => Vec::new(),
        })
        .collect();
    assert!(!removed.is_empty(), "evictions are published");
    assert!(removed.iter().all(|h| stored_hashes.contains(h)));
    assert_eq!(removed[0], stored_hashes[6], "the tail goes first");
    assert!(engine.event_batches() >= 2);
    engine.shutdown().await;
}

#[tokio::test]
async fn kill_ends_open_streams_and_refuses_new_connections() {
    // 1,000 decode steps of ~6 ms: the stream is still running when the engine dies.
    let engine = start(MockEngineConfig::default()).await;
    let addr = engine.addr();
    let body = json!({"prompt": "Tell a long story.", "max_tokens": 1000, "stream": true});
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let mut started_tx = Some(started_tx);
    let reader = tokio::spawn(async move {
        stream(addr, "/v1/completions", &body, |n| {
            if n == 3
                && let Some(tx) = started_tx.take()
            {
                let _ = tx.send(());
            }
            true
        })
        .await
    });
    tokio::time::timeout(WAIT, started_rx)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(engine.in_flight(), 1);
    engine.kill();
    let streamed = tokio::time::timeout(WAIT, reader).await.unwrap().unwrap();
    assert!(!streamed.clean_end, "the stream breaks off");
    assert!(streamed.events.len() < 1000);
    assert!(streamed.events.iter().all(|(_, data)| data != "[DONE]"));
    // New connections are refused (the listener closes as the accept loop sees the kill).
    let deadline = Instant::now() + WAIT;
    loop {
        match tokio::net::TcpStream::connect(addr).await {
            Err(error) => {
                assert_eq!(error.kind(), std::io::ErrorKind::ConnectionRefused);
                break;
            }
            Ok(_) => {
                assert!(Instant::now() < deadline, "still accepting after the kill");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    let deadline = Instant::now() + WAIT;
    while engine.in_flight() > 0 {
        assert!(
            Instant::now() < deadline,
            "the killed request is still counted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(engine.requests_served(), 0);
}

#[tokio::test]
async fn health_toggles_and_models_lists_the_model() {
    let engine = start(MockEngineConfig {
        model: "mock-7b".to_string(),
        ..fast()
    })
    .await;
    let mut connection = Connection::open(engine.addr()).await;
    assert_eq!(
        connection.call("GET", "/health", b"").await,
        (200, Vec::new())
    );
    engine.set_unhealthy(true);
    assert_eq!(connection.call("GET", "/health", b"").await.0, 503);
    engine.set_unhealthy(false);
    assert_eq!(connection.call("GET", "/health", b"").await.0, 200);
    let (status, body) = connection.call("GET", "/v1/models", b"").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(models["object"], "list");
    let card = &models["data"][0];
    assert_eq!(models["data"].as_array().unwrap().len(), 1);
    assert_eq!(card["id"], "mock-7b");
    assert_eq!(card["object"], "model");
    assert_eq!(card["owned_by"], "vllm");
    assert_eq!(card["root"], "mock-7b");
    assert_eq!(card["max_model_len"], 32768);
    assert_eq!(card["permission"][0]["object"], "model_permission");
    engine.shutdown().await;
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let engine = start(MockEngineConfig {
        max_model_len: 100,
        ..fast()
    })
    .await;
    let mut connection = Connection::open(engine.addr()).await;
    let cases: &[(&str, &str, u16, &str)] = &[
        ("/v1/completions", "{not json", 400, "Invalid JSON body"),
        ("/v1/completions", "[1, 2]", 400, "Invalid JSON body"),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": "many"}"#,
            400,
            "Invalid JSON body",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "model": "gpt-9"}"#,
            404,
            "The model `gpt-9` does not exist.",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": 0}"#,
            400,
            "max_tokens must be at least 1, got 0.",
        ),
        (
            "/v1/completions",
            r#"{"prompt": ""}"#,
            400,
            "Either prompt or prompt_embeds",
        ),
        (
            "/v1/completions",
            r#"{"prompt": ["a", "b"]}"#,
            400,
            "one prompt per request",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "stream_options": {"include_usage": true}}"#,
            400,
            "Stream options",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": 100}"#,
            400,
            "maximum context length is 100 tokens",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": []}"#,
            400,
            "messages must not be empty",
        ),
        (
            "/v1/chat/completions",
            r#"{"prompt": "x"}"#,
            400,
            "Invalid JSON body",
        ),
        (
            "/tokenize",
            r#"{"prompt": "x", "model": "other"}"#,
            404,
            "does not exist",
        ),
        (
            "/tokenize",
            r#"{"model": "default"}"#,
            400,
            "give `prompt` or `messages`",
        ),
        (
            "/detokenize",
            r#"{"tokens": [-1]}"#,
            400,
            "Invalid JSON body",
        ),
        (
            "/v1/completions",
            "\u{0}\u{ff}garbage",
            400,
            "Invalid JSON body",
        ),
        (
            "/v1/completions",
            r#"{"prompt": [[1, 2], [3]]}"#,
            400,
            "one prompt per request",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "n": 0}"#,
            400,
            "n must be at least 1, got 0.",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": 2, "min_tokens": 3}"#,
            400,
            "min_tokens must be less than or equal to max_tokens=2, got 3.",
        ),
        (
            "/v1/responses",
            r#"{"input": []}"#,
            400,
            "input must be a non-empty string",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": -5}"#,
            400,
            "at least 1",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": 1e30}"#,
            400,
            "Invalid JSON body",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": 99999999999}"#,
            400,
            "maximum context length",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": {"a": 1}}]}"#,
            400,
            "content must be a string",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"content": "no role"}]}"#,
            400,
            "Invalid JSON body",
        ),
    ];
    for &(path, body, status, message) in cases {
        let (got, answer) = connection.call("POST", path, body.as_bytes()).await;
        assert_eq!(got, status, "{path} {body}");
        let answer: Value = serde_json::from_slice(&answer).unwrap();
        let text = answer["error"]["message"].as_str().unwrap();
        assert!(text.contains(message), "{body}: {text}");
        assert_eq!(answer["error"]["code"], status);
        assert_eq!(answer["object"], "error");
        assert_eq!(answer["message"], text);
        let kind = if status == 404 {
            "NotFoundError"
        } else {
            "BadRequestError"
        };
        assert_eq!(answer["error"]["type"], kind);
        assert_eq!(answer["type"], kind);
    }
    let (status, body) = connection.call("GET", "/nowhere", b"").await;
    assert_eq!((status, body), (404, br#"{"detail":"Not Found"}"#.to_vec()));
    // Still serving.
    let (status, _) = connection
        .call(
            "POST",
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": 1}"#,
        )
        .await;
    assert_eq!(status, 200);
    engine.shutdown().await;
}

#[tokio::test]
async fn the_first_token_delay_holds_requests_back() {
    // Time scale 0: steps take no real time, so the delay is all there is.
    let engine = start(MockEngineConfig {
        time_scale: 0.0,
        ..MockEngineConfig::default()
    })
    .await;
    engine.set_first_token_delay(Duration::from_millis(150));
    let body = json!({"prompt": "x", "max_tokens": 1, "stream": true});
    let streamed = stream(engine.addr(), "/v1/completions", &body, |_| true).await;
    assert!(streamed.first_token_after() >= Duration::from_millis(150));
    assert!(engine.recent_requests()[0].time_to_first_token >= Duration::from_millis(150));
    engine.set_first_token_delay(Duration::ZERO);
    let streamed = stream(engine.addr(), "/v1/completions", &body, |_| true).await;
    assert!(streamed.first_token_after() < Duration::from_millis(150));
    engine.shutdown().await;
}

#[tokio::test]
async fn concurrent_requests_share_the_engine_and_all_finish() {
    let engine = start(MockEngineConfig {
        time_scale: 0.05,
        ..MockEngineConfig::default()
    })
    .await;
    let addr = engine.addr();
    let shared_prefix = "A shared system prompt that every request starts with. ".repeat(4);
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let prompt = format!("{shared_prefix}Question {i}?");
            tokio::spawn(async move {
                post(
                    addr,
                    "/v1/completions",
                    &json!({"prompt": prompt, "max_tokens": 8}),
                )
                .await
            })
        })
        .collect();
    let mut cached = 0;
    for task in tasks {
        let (status, body) = tokio::time::timeout(WAIT, task).await.unwrap().unwrap();
        assert_eq!(status, 200);
        assert_eq!(body["usage"]["completion_tokens"], 8);
        cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
    }
    assert!(cached > 0, "requests after the first hit the shared prefix");
    assert_eq!(engine.requests_served(), 8);
    assert_eq!(engine.in_flight(), 0);
    engine.shutdown().await;
}

/// A WordLevel `tokenizer.json` written by the test: the routes tokenize with it.
#[tokio::test]
async fn a_huggingface_tokenizer_json_is_used_by_every_route() {
    let dir = std::env::temp_dir().join(format!("kvroute-mock-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {
            "type": "WordLevel",
            "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "The": 3, "mock": 4, "engine": 5,
                      "user": 6, "<|": 7, "|>": 8},
            "unk_token": "[UNK]"
        }
    });
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let engine = start(MockEngineConfig {
        tokenizer: Some(path),
        ..fast()
    })
    .await;
    let (status, body) = post(
        engine.addr(),
        "/tokenize",
        &json!({"prompt": "hello world hello"}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body["tokens"], json!([1, 2, 1]));
    let (_, body) = post(
        engine.addr(),
        "/v1/completions",
        &json!({"prompt": "hello world hello", "max_tokens": 3}),
    )
    .await;
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    assert_eq!(body["choices"][0]["text"], "The mock engine");
    let messages = json!([{"role": "user", "content": "hello world"}]);
    let (_, tokenized) = post(engine.addr(), "/tokenize", &json!({"messages": messages})).await;
    assert_eq!(tokenized["tokens"].as_array().unwrap()[..3], [7, 6, 8]);
    let (_, answer) = post(
        engine.addr(),
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1}),
    )
    .await;
    assert_eq!(answer["usage"]["prompt_tokens"], tokenized["count"]);
    engine.shutdown().await;
    // A file that is not a tokenizer is refused at start.
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{}").unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let error = MockEngine::start(
        MockEngineConfig {
            tokenizer: Some(bad),
            ..fast()
        },
        listener,
    )
    .await
    .err()
    .unwrap();
    assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The value of one `/metrics` sample line starting with `prefix`.
fn metric(body: &str, prefix: &str) -> f64 {
    let line = body
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("{prefix} in {body}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test]
async fn metrics_reports_running_waiting_and_kv_usage_as_vllm_does() {
    // Slow enough that a long answer is still running while the metrics are read.
    let engine = start(MockEngineConfig {
        model: "mock-7b".to_string(),
        time_scale: 1.0,
        ..MockEngineConfig::default()
    })
    .await;
    let mut connection = Connection::open(engine.addr()).await;
    let (status, body) = connection.call("GET", "/metrics", b"").await;
    assert_eq!(status, 200);
    let idle = String::from_utf8(body).unwrap();
    assert!(
        idle.contains("# TYPE vllm:num_requests_running gauge"),
        "{idle}"
    );
    let labels = "{engine=\"0\",model_name=\"mock-7b\"}";
    assert_eq!(
        metric(&idle, &format!("vllm:num_requests_running{labels}")),
        0.0
    );
    assert_eq!(
        metric(&idle, &format!("vllm:num_requests_waiting{labels}")),
        0.0
    );
    assert_eq!(
        metric(&idle, &format!("vllm:kv_cache_usage_perc{labels}")),
        0.0
    );
    let addr = engine.addr();
    let prompt = "a prompt long enough to hold a few blocks of the cache ".repeat(8);
    let request = tokio::spawn(async move {
        let body = json!({"prompt": prompt, "max_tokens": 2000});
        post(addr, "/v1/completions", &body).await
    });
    // Bounded: 2000 polls 10 ms apart at most.
    let mut busy = None;
    for _ in 0..2000 {
        let (_, body) = connection.call("GET", "/metrics", b"").await;
        let body = String::from_utf8(body).unwrap();
        if metric(&body, "vllm:num_requests_running") >= 1.0 {
            busy = Some(body);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let busy = busy.expect("the request shows as running");
    assert_eq!(engine.engine_load().0, 1);
    let usage = metric(&busy, "vllm:kv_cache_usage_perc");
    assert!(usage > 0.0 && usage <= 1.0, "{usage}");
    request.abort();
    engine.kill();
}

#[tokio::test]
async fn metrics_count_requests_prompt_tokens_and_cached_tokens() {
    let engine = start(fast()).await;
    let prompt = "a prompt long enough to hold a few blocks of the cache ".repeat(4);
    let body = json!({"prompt": prompt, "max_tokens": 3});
    let mut usages = Vec::new();
    for _ in 0..2 {
        let (status, answer) = post(engine.addr(), "/v1/completions", &body).await;
        assert_eq!(status, 200, "{answer}");
        usages.push(answer["usage"].clone());
    }
    let prompt_tokens: u64 = usages
        .iter()
        .map(|u| u["prompt_tokens"].as_u64().unwrap())
        .sum();
    let cached: u64 = usages
        .iter()
        .map(|u| {
            u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        })
        .sum();
    // The second request found the first one's full blocks.
    assert!(cached > 0, "{usages:?}");
    let mut connection = Connection::open(engine.addr()).await;
    let (_, body) = connection.call("GET", "/metrics", b"").await;
    let body = String::from_utf8(body).unwrap();
    assert!(
        body.contains("# TYPE vllm:request_success_total counter"),
        "{body}"
    );
    assert_eq!(metric(&body, "vllm:request_success_total"), 2.0);
    assert_eq!(
        metric(&body, "vllm:prompt_tokens_total"),
        prompt_tokens as f64
    );
    assert_eq!(
        metric(&body, "vllm:prefix_cache_queries_total"),
        prompt_tokens as f64
    );
    assert_eq!(metric(&body, "vllm:prefix_cache_hits_total"), cached as f64);
    engine.shutdown().await;
}

/// A prompt prefix the router does not know is in the engine's usage but not in `/tokenize`,
/// and without prompt-token details the usage has none (vLLM's default).
#[tokio::test]
async fn a_prompt_prefix_counts_in_usage_only_and_details_can_be_left_out() {
    let engine = start(MockEngineConfig {
        prompt_prefix_tokens: 5,
        prompt_tokens_details: false,
        ..fast()
    })
    .await;
    let (_, tokenized) = post(engine.addr(), "/tokenize", &json!({"prompt": "hello"})).await;
    assert_eq!(tokenized["count"], 5);
    let (status, body) = post(
        engine.addr(),
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body["usage"]["prompt_tokens"], 10);
    assert_eq!(body["usage"]["prompt_tokens_details"], Value::Null);
    assert!(
        body["usage"]
            .as_object()
            .unwrap()
            .contains_key("prompt_tokens_details")
    );
    engine.set_prompt_prefix_tokens(0);
    let (_, body) = post(
        engine.addr(),
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(body["usage"]["prompt_tokens"], 5);
    engine.shutdown().await;
}
#[path = "openai_engine/pd.rs"]
mod pd;
