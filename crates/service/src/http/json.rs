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
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        classify(e.into_inner(), path)
    })?;
    de.end().map_err(|e| classify(e, String::new()))?;
    // Typed parsing catches duplicate fields it knows; this catches them anywhere (in maps and
    // ignored fields, where a later key would otherwise silently win).
    if let Err(e) = serde_json::from_slice::<NoDuplicates>(bytes) {
        return Err(classify(e, String::new()));
    }
    Ok(value)
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

/// Walks any JSON document and fails on a duplicate key in any object.
struct NoDuplicates;

impl<'de> serde::Deserialize<'de> for NoDuplicates {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NoDuplicatesVisitor)
    }
}

struct NoDuplicatesVisitor;

impl<'de> serde::de::Visitor<'de> for NoDuplicatesVisitor {
    type Value = NoDuplicates;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_i64<E>(self, _: i64) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_u64<E>(self, _: u64) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_f64<E>(self, _: f64) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_str<E>(self, _: &str) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_unit<E>(self) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_none<E>(self) -> Result<NoDuplicates, E> {
        Ok(NoDuplicates)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<NoDuplicates, A::Error> {
        while seq.next_element::<NoDuplicates>()?.is_some() {}
        Ok(NoDuplicates)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<NoDuplicates, A::Error> {
        let mut keys: Vec<String> = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            if keys.contains(&key) {
                return Err(serde::de::Error::custom(format!("duplicate key `{key}`")));
            }
            keys.push(key);
            map.next_value::<NoDuplicates>()?;
        }
        Ok(NoDuplicates)
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
