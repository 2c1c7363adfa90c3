//! Chat templates: a model's `chat_template` from its `tokenizer_config.json`, rendered with
//! minijinja the way Hugging Face `transformers` renders it with Jinja2 (`trim_blocks`,
//! `lstrip_blocks`, loop controls, Python's string methods, `raise_exception`, a `tojson` that
//! writes as Python's `json.dumps`), with `bos_token`, `eos_token` and the other special tokens
//! of the config in scope and `add_generation_prompt` true unless the request says otherwise.

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value as JinjaValue};
use serde_json::{Map, Value};

const TEMPLATE_NAME: &str = "chat";

/// A model's chat template, compiled once.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` as the config gives them.
    special_tokens: Map<String, Value>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

/// What a request adds to the template's variables.
#[derive(Debug, Default)]
pub struct ChatInputs<'a> {
    pub messages: &'a [Value],
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub tools: Option<&'a Value>,
    pub documents: Option<&'a Value>,
    pub extra: Option<&'a Map<String, Value>>,
}

/// A special token in `tokenizer_config.json`: a string, or an `AddedToken` object whose
/// `content` is the string.
fn token_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// The template text of a config: `chat_template` as a string, or the one named `default` of
/// a list of named templates.
fn template_source(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| named.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    /// The template of a parsed `tokenizer_config.json`; `Ok(None)` when it has none.
    pub fn from_config(config: &Value) -> Result<Option<Self>, String> {
        let Some(source) = template_source(config) else {
            return Ok(None);
        };
        let special_tokens = ["bos_token", "eos_token", "unk_token", "pad_token"]
            .into_iter()
            .filter_map(|name| {
                let text = token_text(config.get(name)?)?;
                Some((name.to_string(), Value::String(text)))
            })
            .collect();
        Self::new(source, special_tokens).map(Some)
    }

    pub fn new(source: String, special_tokens: Map<String, Value>) -> Result<Self, String> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| format!("chat template syntax: {e}"))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| format!("chat template does not compile: {e}"))?;
        Ok(Self {
            env,
            special_tokens,
        })
    }

    /// Renders a conversation into the prompt text the engine will tokenize.
    pub fn render(&self, inputs: &ChatInputs<'_>) -> Result<String, String> {
        let mut context = self.special_tokens.clone();
        if let Some(extra) = inputs.extra {
            for (k, v) in extra {
                context.insert(k.clone(), v.clone());
            }
        }
        let messages: Vec<Value> = inputs.messages.iter().map(flatten_text_parts).collect();
        context.insert("messages".into(), Value::Array(messages));
        context.insert(
            "add_generation_prompt".into(),
            Value::Bool(inputs.add_generation_prompt),
        );
        context.insert(
            "continue_final_message".into(),
            Value::Bool(inputs.continue_final_message),
        );
        context.insert("tools".into(), inputs.tools.cloned().unwrap_or(Value::Null));
        context.insert(
            "documents".into(),
            inputs.documents.cloned().unwrap_or(Value::Null),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| e.to_string())?;
        template
            .render(JinjaValue::from(minijinja::value::Serde(&context)))
            .map_err(|e| format!("chat template failed: {e}"))
    }
}

/// A message whose `content` is a list of parts made only of text becomes one string, the
/// parts joined by newlines (vLLM's "string" content format, which most templates expect).
fn flatten_text_parts(message: &Value) -> Value {
    let Some(Value::Array(parts)) = message.get("content") else {
        return message.clone();
    };
    let texts: Option<Vec<&str>> = parts
        .iter()
        .map(|p| match p.get("type").and_then(Value::as_str) {
            Some("text") => p.get("text").and_then(Value::as_str),
            _ => None,
        })
        .collect();
    let Some(texts) = texts else {
        return message.clone();
    };
    let mut flat = message.clone();
    if let Some(obj) = flat.as_object_mut() {
        obj.insert("content".into(), Value::String(texts.join("\n")));
    }
    flat
}

fn raise_exception(message: String) -> Result<JinjaValue, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: templates that print today's date. The gateway renders only to
/// route, so a fixed day keeps rendering pure; the engine renders the real one.
fn strftime_now(_format: String) -> String {
    "01 Jan 2025".to_string()
}

/// `tojson` as Python's `json.dumps(value, ensure_ascii=False, indent=indent)`: `", "` and
/// `": "` separators, keys in their order, non-ASCII kept.
fn tojson(value: JinjaValue, indent: Option<usize>) -> Result<JinjaValue, Error> {
    let value = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    write_python_json(&value, indent, 0, &mut out);
    Ok(JinjaValue::from_safe_string(out))
}

fn write_python_json(value: &Value, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    match value {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_python_json(v, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A template in the style of Llama 3's, with the features such templates use.
    const TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}\
{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}\
<|{{ message['role'] }}|>{{ message['content'] | trim }}<|end|>\n\
{% endfor %}{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}\
{% if add_generation_prompt %}<|assistant|>{% endif %}";

    fn template() -> ChatTemplate {
        let config = json!({
            "chat_template": TEMPLATE,
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
        });
        ChatTemplate::from_config(&config).unwrap().unwrap()
    }

    #[test]
    fn renders_messages_special_tokens_and_the_generation_prompt() {
        let messages = vec![
            json!({"role": "system", "content": " be brief "}),
            json!({"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}),
        ];
        let text = template()
            .render(&ChatInputs {
                messages: &messages,
                add_generation_prompt: true,
                ..ChatInputs::default()
            })
            .unwrap();
        assert_eq!(
            text,
            "<s><|system|>be brief<|end|>\n<|user|>hi\nthere<|end|>\n<|assistant|>"
        );
    }

    #[test]
    fn tools_render_as_python_json_and_errors_are_reported() {
        let messages = vec![json!({"role": "user", "content": "x"})];
        let tools = json!([{"name": "f", "params": {"a": "é"}}]);
        let text = template()
            .render(&ChatInputs {
                messages: &messages,
                tools: Some(&tools),
                ..ChatInputs::default()
            })
            .unwrap();
        assert!(
            text.ends_with("<|tools|>[{\"name\": \"f\", \"params\": {\"a\": \"é\"}}]\n"),
            "{text}"
        );
        let bad = vec![json!({"role": "robot", "content": "x"})];
        let err = template()
            .render(&ChatInputs {
                messages: &bad,
                ..ChatInputs::default()
            })
            .unwrap_err();
        assert!(err.contains("bad role"), "{err}");
    }

    #[test]
    fn a_config_without_a_template_has_none_and_a_broken_one_is_an_error() {
        assert!(
            ChatTemplate::from_config(&json!({"bos_token": "<s>"}))
                .unwrap()
                .is_none()
        );
        assert!(ChatTemplate::from_config(&json!({"chat_template": "{% for %}"})).is_err());
        let named = json!({"chat_template": [{"name": "tool_use", "template": "T"},
                                             {"name": "default", "template": "D"}]});
        let t = ChatTemplate::from_config(&named).unwrap().unwrap();
        assert_eq!(t.render(&ChatInputs::default()).unwrap(), "D");
    }
}
