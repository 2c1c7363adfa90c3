//! `POST /v1/responses`: OpenAI's Responses API on the mock engine, generated like a chat.
//!
//! The prompt is the chat of `instructions` (a system message) and `input` (a string: one user
//! message; or items: messages, whose text parts are joined by newlines as chat content parts
//! are, `function_call` as an assistant turn without text, `function_call_output` as a `tool`
//! message; other items add nothing), rendered with the built-in template: what a router that
//! turns the same input into chat messages gets from `/tokenize`.
//!
//! The answer is a `response` object whose one output item is the assistant message. A stream
//! is SSE with `event:` lines: `response.created`, `response.in_progress`,
//! `response.output_item.added`, `response.content_part.added`, one `response.output_text.delta`
//! per token, then `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done` and `response.completed` with the usage; no `[DONE]`. Every
//! event carries its `sequence_number`. Status is always `completed` (every answer is
//! `max_output_tokens` long, as with `ignore_eos`).

use super::protocol::{ApiError, MessageIn};
use serde::Deserialize;
use serde_json::{Value, json};

/// `POST /v1/responses`: the fields the mock reads (the rest, `tools` included, are ignored).
#[derive(Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub input: Value,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub max_output_tokens: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
}

/// The chat messages of a response's prompt.
pub(crate) fn input_messages(
    instructions: Option<&str>,
    input: &Value,
) -> Result<Vec<MessageIn>, ApiError> {
    let mut messages = Vec::new();
    if let Some(instructions) = instructions.filter(|s| !s.is_empty()) {
        messages.push(message("system", instructions.to_string()));
    }
    match input {
        Value::String(text) if !text.is_empty() => messages.push(message("user", text.clone())),
        Value::Array(items) if !items.is_empty() => {
            for item in items {
                if let Some(m) = item_message(item)? {
                    messages.push(m);
                }
            }
        }
        _ => {
            return Err(ApiError::bad_request(
                "input must be a non-empty string or a non-empty list of input items",
            ));
        }
    }
    Ok(messages)
}

fn message(role: &str, content: String) -> MessageIn {
    MessageIn {
        role: role.to_string(),
        content: Value::String(content),
    }
}

fn item_message(item: &Value) -> Result<Option<MessageIn>, ApiError> {
    let text = |key: &str| item.get(key).and_then(Value::as_str).unwrap_or("");
    match item.get("type").and_then(Value::as_str) {
        None | Some("message") => {
            let role = item
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad_request("an input message needs a `role`"))?;
            let content = match item.get("content") {
                Some(Value::String(text)) => text.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => {
                    return Err(ApiError::bad_request(
                        "an input message's content must be a string or a list of parts",
                    ));
                }
            };
            Ok(Some(message(role, content)))
        }
        Some("function_call") => Ok(Some(message("assistant", String::new()))),
        Some("function_call_output") => Ok(Some(message("tool", text("output").to_string()))),
        Some(_) => Ok(None),
    }
}

/// What every rendering of one response shares.
pub(crate) struct ResponseMeta<'a> {
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
    pub instructions: Option<&'a str>,
    pub max_output_tokens: u32,
}

/// A response's `usage`.
pub(crate) fn usage(prompt_tokens: u64, output_tokens: u64, cached_tokens: u64) -> Value {
    json!({
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    })
}

fn item_id(meta: &ResponseMeta) -> String {
    format!("msg_{}", meta.id.trim_start_matches("resp-"))
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

fn output_item(meta: &ResponseMeta, status: &str, content: Vec<Value>) -> Value {
    json!({"type": "message", "id": item_id(meta), "status": status, "role": "assistant",
           "content": content})
}

fn response_object(meta: &ResponseMeta, status: &str, output: Vec<Value>, usage: Value) -> Value {
    json!({
        "id": meta.id,
        "object": "response",
        "created_at": meta.created,
        "status": status,
        "error": null,
        "incomplete_details": null,
        "instructions": meta.instructions,
        "max_output_tokens": meta.max_output_tokens,
        "model": meta.model,
        "output": output,
        "parallel_tool_calls": true,
        "temperature": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "metadata": {},
    })
}

/// The whole answer of a response that is not streamed.
pub(crate) fn document(meta: &ResponseMeta, text: &str, usage: Value) -> Vec<u8> {
    let item = output_item(meta, "completed", vec![text_part(text)]);
    serde_json::to_vec(&response_object(meta, "completed", vec![item], usage)).unwrap_or_default()
}

/// The events of one streamed response, numbered as they go.
#[derive(Debug, Default)]
pub(crate) struct EventWriter {
    sequence: u64,
}

impl EventWriter {
    fn push(&mut self, out: &mut Vec<u8>, kind: &str, mut event: Value) {
        if let Value::Object(fields) = &mut event {
            fields.insert("type".to_string(), Value::from(kind));
            fields.insert("sequence_number".to_string(), Value::from(self.sequence));
        }
        self.sequence += 1;
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\ndata: ");
        if serde_json::to_writer(&mut *out, &event).is_err() {
            out.extend_from_slice(b"{}");
        }
        out.extend_from_slice(b"\n\n");
    }

    /// From `response.created` to the empty text part, sent as the stream opens.
    pub fn opening(&mut self, meta: &ResponseMeta) -> Vec<u8> {
        let mut out = Vec::with_capacity(2048);
        let response = response_object(meta, "in_progress", Vec::new(), Value::Null);
        self.push(&mut out, "response.created", json!({"response": response}));
        self.push(
            &mut out,
            "response.in_progress",
            json!({"response": response}),
        );
        let item = output_item(meta, "in_progress", Vec::new());
        self.push(
            &mut out,
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        );
        self.push(
            &mut out,
            "response.content_part.added",
            json!({"item_id": item_id(meta), "output_index": 0, "content_index": 0,
                   "part": text_part("")}),
        );
        out
    }

    /// One token's text.
    pub fn delta(&mut self, meta: &ResponseMeta, piece: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(256);
        self.push(
            &mut out,
            "response.output_text.delta",
            json!({"item_id": item_id(meta), "output_index": 0, "content_index": 0,
                   "delta": piece, "logprobs": []}),
        );
        out
    }

    /// From the text's end to `response.completed` with the usage.
    pub fn closing(&mut self, meta: &ResponseMeta, text: &str, usage: Value) -> Vec<u8> {
        let mut out = Vec::with_capacity(4096);
        let id = item_id(meta);
        self.push(
            &mut out,
            "response.output_text.done",
            json!({"item_id": id, "output_index": 0, "content_index": 0, "text": text,
                   "logprobs": []}),
        );
        self.push(
            &mut out,
            "response.content_part.done",
            json!({"item_id": id, "output_index": 0, "content_index": 0,
                   "part": text_part(text)}),
        );
        let item = output_item(meta, "completed", vec![text_part(text)]);
        self.push(
            &mut out,
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        );
        let response = response_object(meta, "completed", vec![item], usage);
        self.push(
            &mut out,
            "response.completed",
            json!({"response": response}),
        );
        out
    }

    /// The stream's `error` event, when the engine stops first.
    pub fn error(&mut self, message: &str) -> Vec<u8> {
        let mut out = Vec::new();
        self.push(
            &mut out,
            "error",
            json!({"code": "engine_stopped", "message": message, "param": null}),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(messages: &[MessageIn]) -> Vec<(String, Value)> {
        messages
            .iter()
            .map(|m| (m.role.clone(), m.content.clone()))
            .collect()
    }

    #[test]
    fn input_becomes_the_chat_a_router_renders() {
        let messages = input_messages(Some("be brief"), &json!("hi")).unwrap();
        assert_eq!(
            texts(&messages),
            vec![
                ("system".to_string(), json!("be brief")),
                ("user".to_string(), json!("hi"))
            ]
        );
        let items = json!([
            {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                         {"type": "input_text", "text": "b"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "42"},
            {"type": "reasoning", "summary": []},
        ]);
        assert_eq!(
            texts(&input_messages(None, &items).unwrap()),
            vec![
                ("user".to_string(), json!("a\nb")),
                ("assistant".to_string(), json!("")),
                ("tool".to_string(), json!("42"))
            ]
        );
        for bad in [json!(""), json!([]), json!(3), json!([{"content": "x"}])] {
            assert!(input_messages(None, &bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_stream_numbers_its_events_and_ends_with_the_usage() {
        let meta = ResponseMeta {
            id: "resp-1",
            created: 5,
            model: "m",
            instructions: None,
            max_output_tokens: 2,
        };
        let mut writer = EventWriter::default();
        let mut bytes = writer.opening(&meta);
        bytes.extend(writer.delta(&meta, "x"));
        bytes.extend(writer.closing(&meta, "x", usage(3, 1, 0)));
        let text = String::from_utf8(bytes).unwrap();
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 9);
        for (i, event) in events.iter().enumerate() {
            let (head, data) = event.split_once('\n').unwrap();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(head.strip_prefix("event: ").unwrap(), data["type"]);
            assert_eq!(data["sequence_number"], i as u64);
        }
        let last: Value = serde_json::from_str(events[8].split_once("data: ").unwrap().1).unwrap();
        assert_eq!(last["type"], "response.completed");
        assert_eq!(last["response"]["usage"]["output_tokens"], 1);
        assert_eq!(last["response"]["output"][0]["content"][0]["text"], "x");
    }
}
