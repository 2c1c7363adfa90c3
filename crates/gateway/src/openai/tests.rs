//! The fields the gateway reads, parsed and checked.

use super::*;
use axum::http::StatusCode;

fn prompt(body: &str) -> Result<Prompt, GatewayError> {
    OpenAiRequest::parse(body.as_bytes())?
        .prompt
        .ok_or_else(|| GatewayError::invalid("none"))?
        .single()
}

#[test]
fn prompts_of_every_shape_parse() {
    assert_eq!(prompt(r#"{"prompt": "hi"}"#), Ok(Prompt::Text("hi".into())));
    assert_eq!(
        prompt(r#"{"prompt": ["hi"]}"#),
        Ok(Prompt::Text("hi".into()))
    );
    assert_eq!(
        prompt(r#"{"prompt": [1, 2, 3]}"#),
        Ok(Prompt::Tokens(vec![1, 2, 3]))
    );
    assert_eq!(
        prompt(r#"{"prompt": [[4, 5]]}"#),
        Ok(Prompt::Tokens(vec![4, 5]))
    );
    let batch = prompt(r#"{"prompt": ["a", "b"]}"#).unwrap_err();
    assert_eq!(batch.status, StatusCode::BAD_REQUEST);
    assert!(batch.message.contains("batch of 2"), "{}", batch.message);
    assert!(prompt(r#"{"prompt": []}"#).is_err());
    for bad in [
        r#"{"prompt": [1, "a"]}"#,
        r#"{"prompt": [-1]}"#,
        r#"{"prompt": [4294967296]}"#,
        r#"{"prompt": 5}"#,
    ] {
        let e = OpenAiRequest::parse(bad.as_bytes()).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(e.param, Some("prompt"), "{bad}: {}", e.message);
    }
}

/// `(param, message)` of the 400 a body gets on `kind`'s route.
fn refusal(kind: Kind, body: &str) -> (Option<&'static str>, String) {
    let e = OpenAiRequest::parse(body.as_bytes())
        .and_then(|r| r.validate(kind))
        .unwrap_err();
    assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
    (e.param, e.message)
}

#[test]
fn bad_fields_are_400s_naming_the_field() {
    use Kind::*;
    let cases: &[(Kind, &str, Option<&str>, &str)] = &[
        (Completions, r#"{"prompt": "a""#, None, "not valid JSON"),
        (
            Completions,
            r#"{"model": "m", "prompt": "a"} x"#,
            None,
            "not valid JSON",
        ),
        (Completions, "[1, 2]", None, "must be a JSON object"),
        (
            Completions,
            r#"{"model": 7, "prompt": "a"}"#,
            Some("model"),
            "must be a string",
        ),
        (
            Completions,
            r#"{"model": ""}"#,
            Some("model"),
            "between 1 and 1024",
        ),
        (
            Completions,
            r#"{"model": "m"}"#,
            Some("prompt"),
            "`prompt` is required",
        ),
        (
            Completions,
            r#"{"model": "m", "prompt": {"a": 1}}"#,
            Some("prompt"),
            "must be a string",
        ),
        (
            Completions,
            r#"{"model": "m", "prompt": "a", "max_tokens": -1}"#,
            Some("max_tokens"),
            "at least 1",
        ),
        (
            Completions,
            r#"{"model": "m", "prompt": "a", "max_tokens": 1.5}"#,
            Some("max_tokens"),
            "at least 1",
        ),
        (
            Completions,
            r#"{"model": "m", "prompt": "a", "max_tokens": 0}"#,
            Some("max_tokens"),
            "got 0",
        ),
        (
            Completions,
            r#"{"model": "m", "prompt": "a", "max_tokens": "8"}"#,
            Some("max_tokens"),
            "integer",
        ),
        (
            Completions,
            r#"{"model": "m", "prompt": "a", "n": 0}"#,
            Some("n"),
            "at least 1",
        ),
        (
            Completions,
            r#"{"model": "m", "prompt": "a", "n": "two"}"#,
            Some("n"),
            "at least 1",
        ),
        (
            Completions,
            r#"{"model": "m", "prompt": "a", "stream": "yes"}"#,
            Some("stream"),
            "boolean",
        ),
        (
            Completions,
            r#"{"model": "m", "prompt": "a", "stream_options": {"include_usage": true}}"#,
            Some("stream_options"),
            "stream: true",
        ),
        (
            Completions,
            r#"{"model": "m", "prompt": "a", "max_tokens": 4, "min_tokens": 5}"#,
            Some("min_tokens"),
            "must not exceed",
        ),
        (
            Completions,
            r#"{"model": "m", "prompt": "a", "ignore_eos": 1}"#,
            Some("ignore_eos"),
            "boolean",
        ),
        (
            Chat,
            r#"{"model": "m"}"#,
            Some("messages"),
            "`messages` is required",
        ),
        (
            Chat,
            r#"{"model": "m", "messages": "hi"}"#,
            Some("messages"),
            "an array of messages",
        ),
        (
            Chat,
            r#"{"model": "m", "messages": []}"#,
            Some("messages"),
            "must not be empty",
        ),
        (
            Chat,
            r#"{"model": "m", "messages": ["hi"]}"#,
            Some("messages"),
            "messages[0]",
        ),
        (
            Chat,
            r#"{"model": "m", "messages": [{"content": "hi"}]}"#,
            Some("messages"),
            "role",
        ),
        (
            Chat,
            r#"{"model": "m", "messages": [{"role": "user"}], "max_completion_tokens": -3}"#,
            Some("max_completion_tokens"),
            "at least 1",
        ),
    ];
    for (kind, body, param, needle) in cases {
        let (got_param, message) = refusal(*kind, body);
        assert_eq!(got_param, *param, "{body}: {message}");
        assert!(message.contains(needle), "{body}: {message}");
    }
    // What passes: the limits' defaults, a stream with its options, min below max.
    let ok = r#"{"model": "m", "prompt": "a", "stream": true, "stream_options": {"include_usage": true},
                 "max_tokens": 8, "min_tokens": 8, "ignore_eos": true, "n": 2}"#;
    let request = OpenAiRequest::parse(ok.as_bytes()).unwrap();
    request.validate(Kind::Completions).unwrap();
    assert_eq!(request.expected_output_tokens(), Some(8));
}
