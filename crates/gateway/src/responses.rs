//! `POST /v1/responses` (OpenAI's Responses API) routed like a chat: its prompt is its
//! `instructions` (a system message) and its `input` (a string: one user message; or items),
//! turned into chat messages for the chat template, as vLLM builds the prompt of a response.
//! The body still goes to the engine as received; these messages serve routing only.
//!
//! Items become messages as follows; other items (reasoning, references) add nothing:
//!
//! | item | chat message |
//! |---|---|
//! | `{"role", "content"}` (`"type": "message"` or none) | the same role; its text parts (`input_text`, `output_text`, `text`) joined by newlines, as vLLM joins a chat's text parts for a template |
//! | `{"type": "function_call", "call_id", "name", "arguments"}` | an assistant message with that tool call |
//! | `{"type": "function_call_output", "call_id", "output"}` | a `tool` message |
//!
//! Tools: a Responses function tool (`{"type": "function", "name", "parameters", …}`) becomes
//! the chat shape (`{"type": "function", "function": {…}}`); tools of other types are left out.

use crate::error::GatewayError;
use serde_json::{Map, Value, json};

/// `input` is present and holds something to route by.
pub fn validate_input(input: Option<&Value>) -> Result<(), GatewayError> {
    let bad = |message: String| GatewayError::invalid_param(message, "input");
    match input {
        None | Some(Value::Null) => Err(bad("`input` is required".to_string())),
        Some(Value::String(text)) if text.is_empty() => {
            Err(bad("`input` must not be empty".to_string()))
        }
        Some(Value::String(_)) => Ok(()),
        Some(Value::Array(items)) if items.is_empty() => {
            Err(bad("`input` must not be empty".to_string()))
        }
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let Some(item) = item.as_object() else {
                    return Err(bad(format!("`input[{i}]` must be an object")));
                };
                let kind = item.get("type").and_then(Value::as_str);
                if matches!(kind, None | Some("message")) {
                    if !item.get("role").is_some_and(Value::is_string) {
                        return Err(bad(format!("`input[{i}]` must have a string `role`")));
                    }
                    if !matches!(
                        item.get("content"),
                        Some(Value::String(_) | Value::Array(_))
                    ) {
                        return Err(bad(format!(
                            "`input[{i}].content` must be a string or an array of content parts"
                        )));
                    }
                }
            }
            Ok(())
        }
        Some(_) => Err(bad(
            "`input` must be a string or an array of input items".to_string()
        )),
    }
}

/// The chat messages of a response's prompt (its `input` checked by [`validate_input`]).
pub fn chat_messages(instructions: Option<&str>, input: &Value) -> Vec<Value> {
    let mut messages = Vec::new();
    if let Some(instructions) = instructions.filter(|s| !s.is_empty()) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match input {
        Value::String(text) => messages.push(json!({"role": "user", "content": text})),
        Value::Array(items) => messages.extend(items.iter().filter_map(item_message)),
        _ => {}
    }
    messages
}

fn item_message(item: &Value) -> Option<Value> {
    let field = |name: &str| item.get(name).cloned().unwrap_or(Value::Null);
    match item.get("type").and_then(Value::as_str) {
        None | Some("message") => Some(json!({
            "role": field("role"),
            "content": content(item.get("content")?),
        })),
        Some("function_call") => Some(json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{
                "id": field("call_id"),
                "type": "function",
                "function": {"name": field("name"), "arguments": field("arguments")},
            }],
        })),
        Some("function_call_output") => Some(json!({
            "role": "tool",
            "tool_call_id": field("call_id"),
            "content": field("output"),
        })),
        Some(_) => None,
    }
}

/// A message's content: a string as it is; the text of its parts joined by newlines (parts
/// without text, as images, add nothing).
fn content(content: &Value) -> Value {
    let Value::Array(parts) = content else {
        return content.clone();
    };
    let texts: Vec<&str> = parts
        .iter()
        .filter_map(|part| part.get("text")?.as_str())
        .collect();
    Value::String(texts.join("\n"))
}

/// The chat shape of a response's `tools`.
pub fn chat_tools(tools: &Value) -> Value {
    let Value::Array(tools) = tools else {
        return Value::Null;
    };
    let converted: Vec<Value> = tools
        .iter()
        .filter(|tool| tool.get("type").and_then(Value::as_str) == Some("function"))
        .map(|tool| {
            // Already the chat shape (a client sending it so) stays as it is.
            if tool.get("function").is_some() {
                return tool.clone();
            }
            let mut function = Map::new();
            for key in ["name", "description", "parameters", "strict"] {
                if let Some(value) = tool.get(key) {
                    function.insert(key.to_string(), value.clone());
                }
            }
            json!({"type": "function", "function": function})
        })
        .collect();
    Value::Array(converted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_string_input_is_one_user_message_after_the_instructions() {
        assert_eq!(
            chat_messages(Some("be brief"), &json!("hi")),
            vec![
                json!({"role": "system", "content": "be brief"}),
                json!({"role": "user", "content": "hi"})
            ]
        );
        assert_eq!(chat_messages(None, &json!("hi")).len(), 1);
    }

    #[test]
    fn items_become_chat_messages() {
        let input = json!([
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"},
                                         {"type": "input_image", "image_url": "x"},
                                         {"type": "input_text", "text": "in Paris"}]},
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        ]);
        let messages = chat_messages(None, &input);
        assert_eq!(messages.len(), 4);
        assert_eq!(
            messages[0],
            json!({"role": "user", "content": "weather?\nin Paris"})
        );
        assert_eq!(messages[1]["tool_calls"][0]["function"]["name"], "get");
        assert_eq!(
            messages[2],
            json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
        );
        assert_eq!(messages[3]["content"], "It is sunny.");
    }

    #[test]
    fn bad_inputs_are_400s_naming_input() {
        for bad in [
            Value::Null,
            json!(""),
            json!([]),
            json!(7),
            json!(["hi"]),
            json!([{"content": "no role"}]),
            json!([{"role": "user", "content": 3}]),
        ] {
            let e = validate_input(Some(&bad)).unwrap_err();
            assert_eq!(e.param, Some("input"), "{bad}");
        }
        assert!(validate_input(None).is_err());
        validate_input(Some(
            &json!([{"type": "function_call_output", "call_id": "c", "output": "x"}]),
        ))
        .unwrap();
    }

    #[test]
    fn function_tools_take_the_chat_shape() {
        let tools = json!([
            {"type": "function", "name": "get", "description": "d", "parameters": {"type": "object"}},
            {"type": "web_search"},
            {"type": "function", "function": {"name": "kept"}},
        ]);
        assert_eq!(
            chat_tools(&tools),
            json!([
                {"type": "function", "function": {"name": "get", "description": "d", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "kept"}},
            ])
        );
    }
}
