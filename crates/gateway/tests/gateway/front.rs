//! What the client sees of the front: chat templates and tokenization, the workers file,
//! API keys, `/v1/models`, bad requests.

use crate::common::*;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Duration;

/// A fresh directory under the system's temporary one.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kvroute-gateway-{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}";

/// A word-level tokenizer of a few words, and a config with a chat template, written here.
fn write_tokenizer(dir: &std::path::Path) {
    let words = [
        "<s>",
        "<unk>",
        "<|",
        "|>",
        "user",
        "system",
        "assistant",
        "end",
        "hello",
        "world",
        "be",
        "brief",
    ];
    let vocab: serde_json::Map<String, Value> = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), json!(i)))
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = json!({"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// Blocks of `tokens` the selector holds as cached on `worker_id` (here: predicted from the
/// bookings, the workers publishing no events).
fn cached_blocks(gw: &TestGateway, tokens: &[u32], worker_id: u64) -> u64 {
    let body: kvroute_service::types::PromptRouteBody =
        serde_json::from_value(json!({"token_ids": tokens})).unwrap();
    let scores = kvroute_service::http::render::overlap_scores(
        &kvroute_service::api::overlap_scores(&gw.state, body).unwrap(),
    );
    scores["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == worker_id)
        .map_or(0, |w| w["device_blocks"].as_u64().unwrap())
}

#[tokio::test]
async fn a_chat_is_routed_by_the_tokens_of_its_rendered_template() {
    let dir = temp_dir("tokenizer");
    write_tokenizer(&dir);
    let upstream = Upstream::start().await;
    let tokenizer_flag = format!("default={}", dir.display());
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &upstream.url(),
            "--block-size",
            "2",
            "--health-check-secs",
            "0",
            "--tokenizer",
            &tokenizer_flag,
        ],
    )
    .await;
    let client = client();
    let messages = json!([{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "hello world"}]);
    let (status, _, bytes) = post(
        &client,
        &gw.url("/v1/chat/completions"),
        &json!({"model": "default", "messages": messages, "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    gw.assert_no_booking_left().await;
    // What the engine will compute: the template rendered, encoded without special tokens.
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let rendered = "<s><|system|> be brief <|end|> <|user|> hello world <|end|> <|assistant|> ";
    let expected: Vec<u32> = tokenizer
        .encode(rendered, false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(&expected[..4], &[0, 2, 5, 3], "<s> <| system |>");
    assert!(
        !expected.contains(&1),
        "every word is in the vocabulary: {expected:?}"
    );
    let worker_id = kvroute_gateway::workers::worker_id_for(&upstream.url());
    assert_eq!(
        cached_blocks(&gw, &expected, worker_id),
        expected.len() as u64 / 2,
        "the booking held the rendered prompt's blocks"
    );
    // The message text alone (no template) is not what was booked.
    let bare: Vec<u32> = tokenizer
        .encode("hello world", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(cached_blocks(&gw, &bare, worker_id), 0);
    // Without a generation prompt the template renders (and books) one block less.
    let (status, _, _) = post(
        &client,
        &gw.url("/v1/chat/completions"),
        &json!({"model": "default", "messages": [{"role": "user", "content": "brief"}], "add_generation_prompt": false}),
    )
    .await;
    assert_eq!(status, 200);
    let no_prompt: Vec<u32> = tokenizer
        .encode("<s><|user|> brief <|end|> ", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(
        cached_blocks(&gw, &no_prompt, worker_id),
        no_prompt.len() as u64 / 2
    );
    // A completion's text goes through the same tokenizer.
    let (status, _, _) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": "world world hello hello", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(cached_blocks(&gw, &[9, 9, 8, 8], worker_id), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn remote_tokenization_asks_the_workers_tokenize_route() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        &[],
        &[
            "--worker",
            &upstream.url(),
            "--block-size",
            "2",
            "--health-check-secs",
            "0",
            "--tokenize",
            "remote",
        ],
    )
    .await;
    let client = client();
    let (status, _, _) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": "abcd", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    let asked = upstream.requests("/tokenize");
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].body["prompt"], "abcd");
    let worker_id = kvroute_gateway::workers::worker_id_for(&upstream.url());
    let tokens: Vec<u32> = "abcd".bytes().map(|b| 1000 + u32::from(b)).collect();
    assert_eq!(cached_blocks(&gw, &tokens, worker_id), 2);
    let (status, _, _) = post(
        &client,
        &gw.url("/v1/chat/completions"),
        &json!({"model": "default", "messages": [{"role": "user", "content": "xy"}]}),
    )
    .await;
    assert_eq!(status, 200);
    let asked = upstream.requests("/tokenize");
    assert_eq!(asked.len(), 2, "asked each time: nothing is cached");
    assert_eq!(asked[1].body["messages"][0]["content"], "xy");
    assert_eq!(asked[1].body["add_generation_prompt"], true);
    // Token ids pass straight through: no tokenization.
    let (status, _, _) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "default", "prompt": [7, 8]}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(upstream.requests("/tokenize").len(), 2);
    gw.assert_no_booking_left().await;
}

fn listed_endpoints(gw: &TestGateway) -> Vec<String> {
    let workers = kvroute_service::api::list_workers(&gw.state, None, None);
    let mut endpoints: Vec<String> = workers
        .iter()
        .map(|w| w.spec.endpoint.clone().unwrap())
        .collect();
    endpoints.sort();
    endpoints
}

#[tokio::test]
async fn the_workers_file_is_read_again_when_it_changes() {
    let dir = temp_dir("workers");
    let file = dir.join("workers.toml");
    let (first, second) = (Upstream::start().await, Upstream::start().await);
    std::fs::write(&file, format!("[[workers]]\nurl = \"{}\"\n", first.url())).unwrap();
    let gw = TestGateway::start(
        &[],
        &[
            "--workers-file",
            file.to_str().unwrap(),
            "--workers-file-poll-ms",
            "20",
            "--health-check-secs",
            "0",
            "--model",
            "llama",
        ],
    )
    .await;
    assert_eq!(listed_endpoints(&gw), vec![first.url()]);
    let client = client();
    let (status, _, _) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "llama", "prompt": [1, 2]}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(first.requests("/v1/completions").len(), 1);
    std::fs::write(&file, format!("[[workers]]\nurl = \"{}\"\n", second.url())).unwrap();
    eventually("the file reloaded", || {
        listed_endpoints(&gw) == vec![second.url()]
    })
    .await;
    let (status, _, _) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "llama", "prompt": [1, 2]}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(second.requests("/v1/completions").len(), 1);
    // A broken file changes nothing.
    std::fs::write(&file, "[[workers]]\nurl = 5\n").unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(listed_endpoints(&gw), vec![second.url()]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn the_api_key_guards_the_front_and_the_clients_key_stays_with_the_gateway() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        &["--api-key", "s3cret"],
        &["--worker", &upstream.url(), "--health-check-secs", "0"],
    )
    .await;
    let client = client();
    let body = json!({"model": "default", "prompt": [1, 2]});
    let (status, _, _) = post(&client, &gw.url("/v1/completions"), &body).await;
    assert_eq!(status, 401);
    let (status, _, _) = exchange(
        &client,
        post_request(&gw.url("/v1/completions"), &body, Some("Bearer wrong")),
    )
    .await;
    assert_eq!(status, 401);
    assert!(upstream.requests("/v1/completions").is_empty());
    let (status, _, _) = exchange(
        &client,
        post_request(&gw.url("/v1/completions"), &body, Some("Bearer s3cret")),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(upstream.requests("/v1/completions")[0].authorization, None);

    // The workers' own key, when set; the client's only when asked for.
    let gw = TestGateway::start(
        &["--api-key", "s3cret"],
        &[
            "--worker",
            &upstream.url(),
            "--health-check-secs",
            "0",
            "--upstream-api-key",
            "up",
        ],
    )
    .await;
    let (status, _, _) = exchange(
        &client,
        post_request(&gw.url("/v1/completions"), &body, Some("Bearer s3cret")),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        upstream.requests("/v1/completions")[1]
            .authorization
            .as_deref(),
        Some("Bearer up")
    );
    let gw = TestGateway::start(
        &["--api-key", "s3cret"],
        &[
            "--worker",
            &upstream.url(),
            "--health-check-secs",
            "0",
            "--forward-client-authorization",
        ],
    )
    .await;
    let (status, _, _) = exchange(
        &client,
        post_request(&gw.url("/v1/completions"), &body, Some("Bearer s3cret")),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        upstream.requests("/v1/completions")[2]
            .authorization
            .as_deref(),
        Some("Bearer s3cret")
    );
}

#[tokio::test]
async fn models_are_listed_and_bad_requests_get_openai_errors() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::in_front_of(&upstream).await;
    let client = client();
    // A worker registered through the selection API serves its own model.
    let (status, _, _) = post(
        &client,
        &gw.url("/workers"),
        &json!({"worker_id": 9, "model_name": "qwen", "endpoint": upstream.url(), "block_size": 16}),
    )
    .await;
    assert_eq!(status, 201);
    let (status, models) = get_json(&client, &gw.url("/v1/models")).await;
    assert_eq!(status, 200);
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["default", "qwen"]);
    let (status, headers, _) = post(
        &client,
        &gw.url("/v1/completions"),
        &json!({"model": "qwen", "prompt": [1]}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-kvroute-worker-id"], "9");
    // Bad bodies: 400s naming the field (`param`), none with `Retry-After`; an unknown model
    // a 404.
    for (body, status, param, message) in [
        (
            json!({"model": "default", "prompt": ["a", "b"]}),
            400,
            "prompt",
            "batch of 2",
        ),
        (
            json!({"model": "default", "max_tokens": 3}),
            400,
            "prompt",
            "`prompt` is required",
        ),
        (
            json!({"model": "default", "prompt": [1], "stream": "yes"}),
            400,
            "stream",
            "`stream` must be a boolean",
        ),
        (
            json!({"model": "default", "prompt": [1], "max_tokens": -2}),
            400,
            "max_tokens",
            "`max_tokens` must be an integer of at least 1",
        ),
        (
            json!({"model": "default", "prompt": [1], "n": 0}),
            400,
            "n",
            "`n` must be",
        ),
        (
            json!({"model": "nobody", "prompt": [1]}),
            404,
            "model",
            "The model `nobody` does not exist.",
        ),
    ] {
        let (got, headers, bytes) = post(&client, &gw.url("/v1/completions"), &body).await;
        let error: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(got, status, "{body}: {error}");
        assert!(headers.get("retry-after").is_none());
        assert_eq!(error["error"]["param"], param, "{body}: {error}");
        assert_eq!(error["error"]["type"], "invalid_request_error");
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains(message),
            "{body}: {error}"
        );
    }
    let (status, _, bytes) = post(
        &client,
        &gw.url("/v1/chat/completions"),
        &json!({"model": "default", "messages": "hi"}),
    )
    .await;
    assert_eq!(status, 400);
    let error: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(error["error"]["param"], "messages", "{error}");
    let (status, _, bytes) = post(
        &client,
        &gw.url("/v1/responses"),
        &json!({"model": "default", "input": 5}),
    )
    .await;
    assert_eq!(status, 400);
    let error: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(error["error"]["param"], "input", "{error}");
    assert_eq!(
        upstream.requests("/v1/completions").len(),
        1,
        "no bad body reached the engine"
    );
    // A model no worker serves is OpenAI's and vLLM's 404, naming the parameter; the same on
    // the chat route.
    for route in ["/v1/completions", "/v1/chat/completions"] {
        let body = json!({"model": "nobody", "prompt": [1],
                          "messages": [{"role": "user", "content": "hi"}]});
        let (status, headers, bytes) = post(&client, &gw.url(route), &body).await;
        assert_eq!(status, 404, "{route}: {}", String::from_utf8_lossy(&bytes));
        assert!(headers.get("retry-after").is_none());
        let error: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            error,
            json!({"error": {"message": "The model `nobody` does not exist.",
                             "type": "invalid_request_error", "param": "model", "code": 404}})
        );
    }
    let (status, _, bytes) = post(
        &client,
        &gw.url("/v1/chat/completions"),
        &json!({"model": "default", "messages": []}),
    )
    .await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&bytes));
    let request = hyper::Request::post(gw.url("/v1/completions"))
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            b"{not json",
        )))
        .unwrap();
    let (status, _, bytes) = exchange(&client, request).await;
    assert_eq!(status, 400);
    let error: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(error["error"]["type"], "invalid_request_error");
    gw.assert_no_booking_left().await;
    // The gateway's routes are labelled in the service's metrics.
    assert!(gw.metrics_text().contains("route=\"/v1/completions\""));
}

/// `--gateway-policy round-robin` (the benchmark's baseline) takes the workers in turn whatever
/// they cache, and books and frees as the default policy does.
#[tokio::test]
async fn round_robin_takes_the_workers_in_turn() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let gw = TestGateway::start(
        &[],
        &[
            "--gateway-policy",
            "round-robin",
            "--worker",
            &a.url(),
            "--worker",
            &b.url(),
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    let client = client();
    let mut picked = Vec::new();
    for _ in 0..4 {
        // The same prompt each time: the default policy would keep it where it is cached.
        let (status, headers, bytes) = post(
            &client,
            &gw.url("/v1/completions"),
            &json!({"model": "default", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        picked.push(headers["x-kvroute-worker-id"].to_str().unwrap().to_string());
    }
    assert_ne!(picked[0], picked[1], "{picked:?}");
    assert_eq!(
        (&picked[0], &picked[1]),
        (&picked[2], &picked[3]),
        "{picked:?}"
    );
    assert_eq!(
        (
            a.requests("/v1/completions").len(),
            b.requests("/v1/completions").len()
        ),
        (2, 2)
    );
    gw.assert_no_booking_left().await;
}

/// A completion with one extra header; the worker it went to.
async fn worker_for(
    client: &TestClient,
    gw: &TestGateway,
    body: &Value,
    header: Option<(&str, &str)>,
) -> String {
    let mut request = post_request(&gw.url("/v1/completions"), body, None);
    if let Some((name, value)) = header {
        request.headers_mut().insert(
            hyper::header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            hyper::header::HeaderValue::from_str(value).unwrap(),
        );
    }
    let (status, headers, bytes) = exchange(client, request).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    headers["x-kvroute-worker-id"].to_str().unwrap().to_string()
}

#[tokio::test]
async fn session_headers_keep_a_conversation_on_its_worker() {
    let (first, second) = (Upstream::start().await, Upstream::start().await);
    let gw = TestGateway::start(
        &["--session-affinity-ttl-secs", "60"],
        &[
            "--worker",
            &first.url(),
            "--worker",
            &second.url(),
            "--health-check-secs",
            "0",
        ],
    )
    .await;
    let client = client();
    let prompt = |i: u32| json!({"model": "default", "prompt": [1000 + i, 2000 + i, 3000 + i]});
    // Without a session, an idle fleet's ties go either way: both workers serve.
    let mut unbound = std::collections::BTreeSet::new();
    for i in 0..20 {
        unbound.insert(worker_for(&client, &gw, &prompt(i), None).await);
    }
    assert_eq!(unbound.len(), 2, "{unbound:?}");
    // aiperf's and inference-perf's headers (the defaults) each keep their session in place.
    for (name, session) in [("x-session-id", "s1"), ("X-Correlation-ID", "c1")] {
        let mut workers = std::collections::BTreeSet::new();
        for i in 0..8 {
            let body = prompt(100 + i);
            workers.insert(worker_for(&client, &gw, &body, Some((name, session))).await);
        }
        assert_eq!(workers.len(), 1, "{name}: {workers:?}");
    }
    // The body's session_id wins over the header: the request binds `b1`, which the next
    // header-only requests of `b1` then follow.
    let body = json!({"model": "default", "prompt": [7, 8, 9], "session_id": "b1"});
    let bound = worker_for(&client, &gw, &body, Some(("x-session-id", "s9"))).await;
    for i in 0..8 {
        let follower =
            worker_for(&client, &gw, &prompt(200 + i), Some(("x-session-id", "b1"))).await;
        assert_eq!(follower, bound);
    }
    gw.assert_no_booking_left().await;
}
