//! A strict JSON body extractor. Compared with axum's `Json` it
//! - rejects trailing data, a byte-order mark and duplicate keys (400, like any malformed body);
//! - names the offending field in type errors (422: `Failed to deserialize the JSON body into the
//!   target type: {path}: {serde message}`);
//! - keeps the texts Dynamo's clients see for the other cases (415 content type, 413 size).
//!
//! [`OptionalJson`] treats an empty body (with or without a content type) as absent.

use super::error::ApiError;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use bytes::Bytes;
use serde::de::DeserializeOwned;

pub const CONTENT_TYPE_MESSAGE: &str = "Expected request with `Content-Type: application/json`";

fn is_json_content_type(req: &Request) -> bool {
    let Some(value) = req.headers().get(CONTENT_TYPE) else {
        return false;
    };
    let Ok(value) = value.to_str() else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

async fn body_bytes<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    Bytes::from_request(req, state).await.map_err(|rejection| {
        let status = rejection.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                status,
                "Failed to buffer the request body: length limit exceeded",
            )
        } else {
            ApiError::new(
                status,
                format!("Failed to read the request body: {rejection}"),
            )
        }
    })
}

/// Parses a JSON document strictly into `T` (an object).
pub fn parse_strict<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // Derived structs would also accept an array of their fields in order; bodies are objects.
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if matches!(
        first,
        Some(b'[' | b'"' | b't' | b'f' | b'n' | b'-' | b'0'..=b'9')
    ) {
        return Err(ApiError::unprocessable(
            "Failed to deserialize the JSON body into the target type: expected a JSON object",
        ));
    }
    let value: T = match serde_json::from_slice(bytes) {
        Ok(value) => value,
        // Parse again, tracking the path, only to name the offending field in the message
        // (tracking every element of a large token array costs more than the parse itself).
        Err(_) => {
            let mut de = serde_json::Deserializer::from_slice(bytes);
            let result: Result<T, _> = serde_path_to_error::deserialize(&mut de);
            return Err(match result {
                Err(e) => {
                    let path = e.path().to_string();
                    classify(e.into_inner(), path)
                }
                Ok(_) => match de.end() {
                    Err(e) => classify(e, String::new()),
                    Ok(()) => ApiError::bad_request("Failed to parse the request body as JSON"),
                },
            });
        }
    };
    // Typed parsing catches duplicate fields it knows; this catches them anywhere (in maps and
    // ignored fields, where a later key would otherwise silently win).
    if let Some(key) = first_duplicate_key(bytes) {
        return Err(ApiError::bad_request(format!(
            "Failed to parse the request body as JSON: duplicate key `{key}`"
        )));
    }
    Ok(value)
}

/// The first key that appears twice in one object of a document already known to be valid
/// JSON. A byte scan that skips numbers and strings without decoding them (keys are compared as
/// written, so `"a"` and `"\u0061"` count as different).
pub fn first_duplicate_key(bytes: &[u8]) -> Option<String> {
    // One entry per open container: the keys seen so far for an object, `None` for an array.
    let mut stack: Vec<Option<Vec<&[u8]>>> = Vec::new();
    let mut expect_key = false;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' => {
                stack.push(Some(Vec::new()));
                expect_key = true;
            }
            b'[' => {
                // An array of numbers (a token list) holds no keys: jump to its end.
                let rest = &bytes[i + 1..];
                if let Some(end) = memchr::memchr3(b']', b'{', b'"', rest)
                    && rest[end] == b']'
                    && memchr::memchr(b'[', &rest[..end]).is_none()
                {
                    i += end + 2;
                    expect_key = false;
                    continue;
                }
                stack.push(None);
                expect_key = false;
            }
            b'}' | b']' => {
                stack.pop();
                expect_key = false;
            }
            b',' => expect_key = matches!(stack.last(), Some(Some(_))),
            b'"' => {
                let start = i + 1;
                i += 1;
                while i < bytes.len() {
                    match bytes[i] {
                        b'\\' => i += 2,
                        b'"' => break,
                        _ => i += 1,
                    }
                }
                let text = &bytes[start..i.min(bytes.len())];
                if expect_key {
                    if let Some(Some(keys)) = stack.last_mut() {
                        if keys.contains(&text) {
                            return Some(String::from_utf8_lossy(text).into_owned());
                        }
                        keys.push(text);
                    }
                    expect_key = false;
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

fn classify(e: serde_json::Error, path: String) -> ApiError {
    use serde_json::error::Category;
    let message = e.to_string();
    let prefix = if path.is_empty() || path == "." {
        String::new()
    } else {
        format!("{path}: ")
    };
    match e.classify() {
        Category::Syntax | Category::Eof | Category::Io => ApiError::bad_request(format!(
            "Failed to parse the request body as JSON: {prefix}{message}"
        )),
        Category::Data if message.starts_with("duplicate") => ApiError::bad_request(format!(
            "Failed to parse the request body as JSON: {message}"
        )),
        Category::Data => ApiError::unprocessable(format!(
            "Failed to deserialize the JSON body into the target type: {prefix}{message}"
        )),
    }
}

/// A JSON body that must be present and well-formed.
#[derive(Debug, Clone)]
pub struct StrictJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for StrictJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        if !is_json_content_type(&req) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                CONTENT_TYPE_MESSAGE,
            ));
        }
        let bytes = body_bytes(req, state).await?;
        parse_strict(&bytes).map(StrictJson)
    }
}

/// A JSON body that may be empty (then `None`).
#[derive(Debug, Clone)]
pub struct OptionalJson<T>(pub Option<T>);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let has_json_type = is_json_content_type(&req);
        let has_type = req.headers().contains_key(CONTENT_TYPE);
        let bytes = body_bytes(req, state).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(OptionalJson(None));
        }
        if has_type && !has_json_type {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                CONTENT_TYPE_MESSAGE,
            ));
        }
        parse_strict(&bytes).map(|v| OptionalJson(Some(v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    struct Body {
        #[allow(dead_code)]
        token_ids: Vec<u32>,
    }

    #[test]
    fn strict_parsing_rules() {
        assert!(parse_strict::<Body>(br#"{"token_ids":[1,2]}"#).is_ok());
        let trailing = parse_strict::<Body>(br#"{"token_ids":[1]} x"#).unwrap_err();
        assert_eq!(trailing.status, StatusCode::BAD_REQUEST);
        let dup = parse_strict::<Body>(br#"{"token_ids":[1],"token_ids":[2]}"#).unwrap_err();
        assert_eq!(dup.status, StatusCode::BAD_REQUEST);
        assert!(
            dup.message.contains("duplicate field `token_ids`"),
            "{}",
            dup.message
        );
        let dup_map = parse_strict::<serde_json::Value>(br#"{"a":{"k":1,"k":2}}"#).unwrap_err();
        assert_eq!(
            first_duplicate_key(br#"{"a":[{"k":"x,\"k\""},{"k":1}],"b":{}}"#),
            None
        );
        assert_eq!(
            first_duplicate_key(br#"{"a":[1,2],"b":{"c":1},"a":3}"#).as_deref(),
            Some("a")
        );
        assert!(
            dup_map.message.contains("duplicate key `k`"),
            "{}",
            dup_map.message
        );
        let array = parse_strict::<Body>(br#"[[1]]"#).unwrap_err();
        assert_eq!(array.status, StatusCode::UNPROCESSABLE_ENTITY);
        let bom = parse_strict::<Body>(b"\xEF\xBB\xBF{\"token_ids\":[1]}").unwrap_err();
        assert_eq!(bom.status, StatusCode::BAD_REQUEST);
        let range = parse_strict::<Body>(br#"{"token_ids":[1,4294967296]}"#).unwrap_err();
        assert_eq!(range.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(
            range.message.contains("token_ids[1]: "),
            "{}",
            range.message
        );
        let negative = parse_strict::<Body>(br#"{"token_ids":[-1]}"#).unwrap_err();
        assert_eq!(negative.status, StatusCode::UNPROCESSABLE_ENTITY);
        let missing = parse_strict::<Body>(br#"{}"#).unwrap_err();
        assert!(missing.message.contains("missing field `token_ids`"));
        let syntax = parse_strict::<Body>(br#"{"token_ids":"#).unwrap_err();
        assert_eq!(syntax.status, StatusCode::BAD_REQUEST);
    }
}
