//! The bodies of a disaggregated request's legs, made from the client's (pure: the module doc
//! of `crate::pd` says what each protocol sends).

use serde_json::{Map, Value, json};

/// The prefill leg's body (vLLM): one token, not streamed, asking for a remote decode.
pub fn vllm_prefill_body(client_body: &Map<String, Value>) -> Map<String, Value> {
    let mut body = client_body.clone();
    body.insert("stream".into(), Value::Bool(false));
    body.insert("max_tokens".into(), json!(1));
    if body.contains_key("max_completion_tokens") {
        body.insert("max_completion_tokens".into(), json!(1));
    }
    body.remove("stream_options");
    body.remove("min_tokens");
    body.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    body
}

/// The decode leg's body (vLLM): the client's, with the prefill answer's `kv_transfer_params`.
pub fn vllm_decode_body(client_body: &Map<String, Value>, params: Value) -> Map<String, Value> {
    let mut body = client_body.clone();
    body.insert("kv_transfer_params".into(), params);
    body
}

/// A bootstrap room: random, 63 bits (SGLang's rooms are non-negative 64-bit integers).
pub(super) fn random_room() -> u64 {
    rand::random::<u64>() >> 1
}

/// The host of a worker URL (`http://host:port/...`).
pub(super) fn bootstrap_host(endpoint: &str) -> Option<String> {
    let uri: axum::http::Uri = endpoint.parse().ok()?;
    let host = uri.host()?;
    Some(
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
    )
}

/// The body of both SGLang legs: the client's with the bootstrap fields; a batch (`prompt` a
/// list of prompts) gets one room per prompt.
pub fn sglang_body(
    client_body: &Map<String, Value>,
    host: &str,
    port: Option<u16>,
    room: u64,
    mut more_rooms: impl FnMut() -> u64,
) -> Map<String, Value> {
    let mut body = client_body.clone();
    let batch = match body.get("prompt") {
        Some(Value::Array(items)) if items.iter().all(|i| i.is_string() || i.is_array()) => {
            Some(items.len())
        }
        _ => None,
    };
    let room = match batch {
        Some(n) => Value::Array(
            std::iter::once(room)
                .chain(std::iter::repeat_with(&mut more_rooms))
                .take(n)
                .map(Value::from)
                .collect(),
        ),
        None => Value::from(room),
    };
    body.insert("bootstrap_host".into(), Value::from(host));
    body.insert("bootstrap_port".into(), json!(port));
    body.insert("bootstrap_room".into(), room);
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!("an object"),
        }
    }

    #[test]
    fn the_vllm_prefill_leg_makes_one_token_and_asks_for_a_remote_decode() {
        let client = map(
            json!({"model": "m", "prompt": "p", "stream": true, "max_tokens": 50,
            "max_completion_tokens": 50, "min_tokens": 5,
            "stream_options": {"include_usage": true}, "temperature": 0.5}),
        );
        let prefill = vllm_prefill_body(&client);
        assert_eq!(
            Value::Object(prefill),
            json!({"model": "m", "prompt": "p", "stream": false, "max_tokens": 1,
                "max_completion_tokens": 1, "temperature": 0.5,
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                    "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
                    "remote_port": null}})
        );
        let without = vllm_prefill_body(&map(json!({"prompt": "p"})));
        assert!(!without.contains_key("max_completion_tokens"));
        let params = json!({"do_remote_prefill": true, "remote_engine_id": "e"});
        let decode = vllm_decode_body(&client, params.clone());
        let mut expected = client.clone();
        expected.insert("kv_transfer_params".into(), params);
        assert_eq!(
            decode, expected,
            "the client's body, the params added unchanged"
        );
    }

    #[test]
    fn sglang_bodies_carry_the_bootstrap_fields_and_a_room_per_prompt() {
        let mut next = 10;
        let mut rooms = || {
            next += 1;
            next
        };
        let one = sglang_body(
            &map(json!({"prompt": "p"})),
            "10.0.0.1",
            Some(8998),
            7,
            &mut rooms,
        );
        assert_eq!(
            Value::Object(one),
            json!({"prompt": "p", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
                "bootstrap_room": 7})
        );
        let batch = sglang_body(
            &map(json!({"prompt": ["a", "b", "c"]})),
            "h",
            None,
            7,
            &mut rooms,
        );
        assert_eq!(batch["bootstrap_room"], json!([7, 11, 12]));
        assert_eq!(batch["bootstrap_port"], Value::Null);
        let ids = sglang_body(&map(json!({"prompt": [1, 2, 3]})), "h", None, 7, &mut rooms);
        assert_eq!(ids["bootstrap_room"], json!(7), "token ids are one prompt");
        assert_eq!(
            bootstrap_host("http://127.0.0.1:8001").as_deref(),
            Some("127.0.0.1")
        );
        assert_eq!(
            bootstrap_host("http://[::1]:8001/v").as_deref(),
            Some("::1")
        );
    }
}
