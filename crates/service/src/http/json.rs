//! A strict JSON body extractor. Compared with axum's `Json` it
//! - rejects trailing data, a byte-order mark and duplicate keys (400, like any malformed body);
//! - names the offending field in type errors (422: `Failed to deserialize the JSON body into the
//!   target type: {path}: {serde message}`);
//! - keeps the texts Dynamo's clients see for the other cases (415 content type, 413 size);
//! - waits at most `--body-read-timeout-ms` ([`BodyReadTimeout`]) for the body: a late one is a
//!   408, and the connection is closed (the rest of the body may still be on its way). Only a
//!   body not in yet when first asked for starts a timer; one that came with the head (the usual
//!   case) costs none.
//!
//! [`OptionalJson`] treats an empty body (with or without a content type) as absent.
//!
//! Prompt bodies take a fast path for their largest part: a top-level `token_ids` array of plain
//! integers is parsed by a dedicated loop (faster than serde's generic integer path)
//! and the rest of the body by serde with that array blanked out. Anything unusual in the array
//! (a sign, a fraction, an exponent, a leading zero, a value above `u32::MAX`, a nested value)
//! makes the whole body take the ordinary path, so every error message stays the same.

use super::error::ApiError;
use axum::extract::{FromRef, FromRequest, Request};
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

/// How long the body extractors wait for a request's body (`--body-read-timeout-ms`), taken
/// from the router's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyReadTimeout(pub Duration);

/// The 408 of a body not in within `limit`.
pub fn body_timeout_error(limit: Duration) -> ApiError {
    ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        format!(
            "Timed out reading the request body: not received within {} ms",
            limit.as_millis()
        ),
    )
}

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

/// A request's whole body, within the body limit (413) and `--body-read-timeout-ms` (408), as
/// the extractors read it; public for routes that parse their bodies themselves (the gateway's).
pub async fn body_bytes<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError>
where
    BodyReadTimeout: FromRef<S>,
{
    let mut read = pin!(Bytes::from_request(req, state));
    // Polled once without a timer: a body that came with the head is complete at once.
    let read = match poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await {
        Poll::Ready(read) => read,
        Poll::Pending => {
            let BodyReadTimeout(limit) = BodyReadTimeout::from_ref(state);
            tokio::time::timeout(limit, read)
                .await
                .map_err(|_| body_timeout_error(limit))?
        }
    };
    read.map_err(|rejection| {
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

/// A body type [`StrictJson`] can parse. Bodies with a top-level `token_ids` field expose it so
/// the token array can take the fast path.
pub trait JsonBody: DeserializeOwned {
    /// Whether the body has a top-level `token_ids` field worth the fast path.
    const HAS_TOKEN_IDS: bool = false;

    fn token_ids_slot(&mut self) -> Option<&mut Option<Vec<u32>>> {
        None
    }
}

impl JsonBody for serde_json::Value {}

/// Parses a JSON document strictly into `T` (an object).
pub fn parse_strict<T: JsonBody>(bytes: &[u8]) -> Result<T, ApiError> {
    if let Some(value) = parse_with_fast_tokens(bytes) {
        return Ok(value);
    }
    parse_strict_plain(bytes)
}

/// The fast path: `None` whenever it does not apply or anything fails (the caller then parses
/// the original body the ordinary way, which also produces the error message).
fn parse_with_fast_tokens<T: JsonBody>(bytes: &[u8]) -> Option<T> {
    if !T::HAS_TOKEN_IDS {
        return None;
    }
    let start = top_level_value_start(bytes, b"token_ids")?;
    let (tokens, len) = parse_token_array(&bytes[start..])?;
    let mut patched = Vec::with_capacity(bytes.len() - len + 2);
    patched.extend_from_slice(&bytes[..start]);
    patched.extend_from_slice(b"[]");
    patched.extend_from_slice(&bytes[start + len..]);
    let mut value: T = parse_strict_plain(&patched).ok()?;
    let slot = value.token_ids_slot()?;
    match slot {
        Some(v) if v.is_empty() => *v = tokens,
        _ => return None,
    }
    Some(value)
}

/// Where the value of `key` starts in a top-level JSON object (after the colon and any
/// whitespace), by a lexical scan that skips strings (with escapes) and nested containers.
/// `None` when the document is not an object or has no such key.
pub fn top_level_value_start(bytes: &[u8], key: &[u8]) -> Option<usize> {
    let mut i = skip_ws(bytes, 0);
    if bytes.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let mut depth = 1usize;
    let mut expect_key = true;
    while i < bytes.len() {
        match bytes[i] {
            b'{' | b'[' => {
                depth += 1;
                expect_key = bytes[i] == b'{';
            }
            b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return None;
                }
                expect_key = false;
            }
            b',' => expect_key = true,
            b'"' => {
                let start = i + 1;
                i = string_end(bytes, start);
                let text = bytes.get(start..i)?;
                if depth == 1 && expect_key && text == key {
                    let colon = skip_ws(bytes, i + 1);
                    if bytes.get(colon) != Some(&b':') {
                        return None;
                    }
                    return Some(skip_ws(bytes, colon + 1));
                }
                expect_key = false;
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// The index of the quote that closes a string whose text starts at `i` (escapes skipped), or
/// past the end when it is not closed.
fn string_end(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return i,
            _ => i += 1,
        }
    }
    i
}

fn skip_ws(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() && matches!(bytes[i], b' ' | b'\n' | b'\r' | b'\t') {
        i += 1;
    }
    i
}

/// Parses `[1, 2, 3]` at the start of `bytes` as token ids: plain JSON integers in `0..=u32::MAX`
/// (no sign, fraction, exponent or leading zero). Returns the ids and the array's length in
/// bytes, or `None` for anything else.
///
/// Where the CPU has AVX-512 VBMI2, plain lists of 256 bytes and more are read 64 bytes at a
/// time (module `avx512`); everything else as [`parse_token_array_portable`] does.
pub fn parse_token_array(bytes: &[u8]) -> Option<(Vec<u32>, usize)> {
    #[cfg(target_arch = "x86_64")]
    if bytes.first() == Some(&b'[')
        && let Some((end, commas)) = avx512::list_extent(&bytes[1..])
    {
        // The contents, and the array's length with both brackets.
        let (body, len) = (&bytes[1..1 + end], end + 2);
        if body.len() >= VECTOR_FROM_BYTES
            && let Some(ids) = avx512::token_list(body, commas + 1)
        {
            return Some((ids, len));
        }
        return Some((list_ids(body)?, len));
    }
    let (body, len) = array_contents(bytes)?;
    Some((list_ids(body)?, len))
}

/// [`parse_token_array`] on any CPU.
pub fn parse_token_array_portable(bytes: &[u8]) -> Option<(Vec<u32>, usize)> {
    let (body, len) = array_contents(bytes)?;
    Some((list_ids(body)?, len))
}

/// What lies between an array's brackets at the start of `bytes`, and the array's length.
fn array_contents(bytes: &[u8]) -> Option<(&[u8], usize)> {
    if bytes.first() != Some(&b'[') {
        return None;
    }
    let end = memchr::memchr(b']', bytes)?;
    Some((&bytes[1..end], end + 1))
}

/// The ids of a list's contents, the portable way.
///
/// Long lists are cut at a comma near the middle and the two halves read in one interleaved
/// loop: reading an id must finish before the next one's start is known, so one cursor leaves
/// the CPU waiting, and two keep it busy; lists of 1 KiB and more are cut in four.
fn list_ids(body: &[u8]) -> Option<Vec<u32>> {
    if skip_ws(body, 0) == body.len() {
        return Some(Vec::new());
    }
    if body.len() >= FOUR_LANES_FROM_BYTES
        && let Some(cuts) = quarter_cuts(body)
    {
        return four_lanes(body, cuts);
    }
    // A valid list has one id more than it has commas: each half fills exactly its share.
    let mut out = vec![0u32; memchr::memchr_iter(b',', body).count() + 1];
    let split = (out.len() > 64)
        .then(|| memchr::memchr(b',', &body[body.len() / 2..]).map(|c| body.len() / 2 + c))
        .flatten();
    match split {
        None => Cursor::new(body, &mut out).finish()?,
        Some(split) => {
            let ids = memchr::memchr_iter(b',', &body[..split]).count() + 1;
            let (head, tail) = out.split_at_mut(ids);
            let mut first = Cursor::new(&body[..split], head);
            let mut second = Cursor::new(&body[split + 1..], tail);
            while first.short_token()? && second.short_token()? {}
            first.finish()?;
            second.finish()?;
        }
    }
    Some(out)
}

#[cfg(target_arch = "x86_64")]
mod avx512;

/// Lists from this long are read 64 bytes at a time where the CPU has AVX-512 VBMI2
/// (module `avx512`).
#[cfg(target_arch = "x86_64")]
const VECTOR_FROM_BYTES: usize = 256;

/// Three commas near a list's quarters, in order.
fn quarter_cuts(body: &[u8]) -> Option<[usize; 3]> {
    let mut cuts = [0usize; 3];
    let mut from = 0;
    for (k, cut) in cuts.iter_mut().enumerate() {
        let target = (body.len() * (k + 1) / 4).max(from);
        *cut = target + memchr::memchr(b',', body.get(target..)?)?;
        from = *cut + 1;
    }
    Some(cuts)
}

/// Lists from this long are read in four lanes ([`four_lanes`]): faster than two once the lanes
/// are long enough to pay for the cuts (docs/perf-decisions.md).
const FOUR_LANES_FROM_BYTES: usize = 1024;

/// The ids of a list's contents, in four lanes cut at commas near its quarters, interleaved as
/// the two halves are in [`list_ids`]: four independent chains of loads keep the core
/// busier than two.
fn four_lanes(body: &[u8], cuts: [usize; 3]) -> Option<Vec<u32>> {
    let parts = [
        body.get(..cuts[0])?,
        body.get(cuts[0] + 1..cuts[1])?,
        body.get(cuts[1] + 1..cuts[2])?,
        body.get(cuts[2] + 1..)?,
    ];
    let counts = parts.map(|p| memchr::memchr_iter(b',', p).count() + 1);
    let mut out = vec![0u32; counts.iter().sum()];
    let (a, rest) = out.split_at_mut_checked(counts[0])?;
    let (b, rest) = rest.split_at_mut_checked(counts[1])?;
    let (c, d) = rest.split_at_mut_checked(counts[2])?;
    let mut lanes = [
        Cursor::new(parts[0], a),
        Cursor::new(parts[1], b),
        Cursor::new(parts[2], c),
        Cursor::new(parts[3], d),
    ];
    {
        let [w, x, y, z] = &mut lanes;
        while w.short_token()? && x.short_token()? && y.short_token()? && z.short_token()? {}
    }
    for lane in &mut lanes {
        lane.finish()?;
    }
    Some(out)
}

/// A position in a comma-separated list of ids (an array's contents or part of them) and the
/// slots its ids go to.
struct Cursor<'a, 'o> {
    body: &'a [u8],
    i: usize,
    out: &'o mut [u32],
    filled: usize,
}

impl<'a, 'o> Cursor<'a, 'o> {
    fn new(body: &'a [u8], out: &'o mut [u32]) -> Self {
        Self {
            body,
            i: skip_ws(body, 0),
            out,
            filled: 0,
        }
    }

    fn push(&mut self, id: u32) -> Option<()> {
        *self.out.get_mut(self.filled)? = id;
        self.filled += 1;
        Some(())
    }

    /// Takes one id of one to six digits followed by a comma and at most one space when all of
    /// it lies within the next eight bytes, with one load and no branch on its length. `false`
    /// when the next id is not of that shape (nothing is consumed); `None` for an id with a
    /// leading zero.
    #[inline(always)]
    fn short_token(&mut self) -> Option<bool> {
        let Some(chunk) = self
            .body
            .get(self.i..)
            .and_then(|rest| rest.first_chunk::<8>())
        else {
            return Some(false);
        };
        let word = u64::from_le_bytes(*chunk);
        // Digits become 0..=9; a byte is not a digit when it is 10 or more (a carry out of a
        // non-digit byte only disturbs the bytes after it, which are not looked at).
        let values = word ^ (0x30 * ONES);
        let non_digit = (values.wrapping_add(0x76 * ONES) | values) & (0x80 * ONES);
        let digits = non_digit.trailing_zeros() / 8;
        // The comma and the byte after it.
        if !(1..=6).contains(&digits) {
            return Some(false);
        }
        // (After the check: eight digits would shift the word by its whole width.)
        let separator = word >> (8 * digits);
        if separator as u8 != b',' {
            return Some(false);
        }
        if word as u8 == b'0' && digits > 1 {
            return None;
        }
        self.push(eight_digits(values << (8 * (8 - digits))))?;
        let space = (separator >> 8) as u8 == b' ';
        self.i += digits as usize + 1 + usize::from(space);
        Some(true)
    }

    /// Reads the rest of the list: at least one id, ids separated by commas, whitespace around
    /// them, nothing else; and every slot filled.
    fn finish(&mut self) -> Option<()> {
        loop {
            while self.short_token()? {}
            let i = skip_ws(self.body, self.i);
            let (value, next) = parse_token(self.body, i)?;
            self.push(value)?;
            let i = skip_ws(self.body, next);
            match self.body.get(i) {
                None => return (self.filled == self.out.len()).then_some(()),
                Some(b',') => self.i = skip_ws(self.body, i + 1),
                Some(_) => return None,
            }
        }
    }
}

const ONES: u64 = 0x0101_0101_0101_0101;

/// One token id starting at `i`: its value and the index after its last digit.
fn parse_token(body: &[u8], i: usize) -> Option<(u32, usize)> {
    let first = *body.get(i)?;
    if !first.is_ascii_digit() {
        return None;
    }
    // Eight bytes at once: count the leading digits and convert them with SWAR arithmetic.
    if let Some(chunk) = body.get(i..i + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let chunk = u64::from_le_bytes(word);
        // A byte is a digit when its high nibble is 3 and adding 6 keeps it 3.
        let bad = ((chunk & (0xF0 * ONES)) ^ (0x30 * ONES))
            | ((chunk.wrapping_add(0x06 * ONES) & (0xF0 * ONES)) ^ (0x30 * ONES));
        let nonzero = (((bad & (0x7F * ONES)).wrapping_add(0x7F * ONES)) | bad) & (0x80 * ONES);
        let digits = (nonzero.trailing_zeros() / 8) as usize;
        if first == b'0' && digits > 1 {
            return None;
        }
        if digits < 8 {
            let shifted = chunk.wrapping_sub(0x30 * ONES) << (8 * (8 - digits));
            return Some((eight_digits(shifted), i + digits));
        }
        // Eight digits and maybe two more (u32 has at most ten).
        let mut value = u64::from(eight_digits(chunk.wrapping_sub(0x30 * ONES)));
        let mut j = i + 8;
        while let Some(&b) = body.get(j)
            && b.is_ascii_digit()
        {
            if j - i == 10 {
                return None;
            }
            value = value * 10 + u64::from(b - b'0');
            j += 1;
        }
        return u32::try_from(value).ok().map(|v| (v, j));
    }
    let mut value = u64::from(first - b'0');
    let mut j = i + 1;
    while let Some(&b) = body.get(j)
        && b.is_ascii_digit()
    {
        value = value * 10 + u64::from(b - b'0');
        j += 1;
        if j - i > 10 {
            return None;
        }
    }
    if (first == b'0' && j - i > 1) || value > u64::from(u32::MAX) {
        return None;
    }
    Some((value as u32, j))
}

/// The value of eight decimal digits (as 0..=9 byte values, the first in the lowest byte).
fn eight_digits(v: u64) -> u32 {
    let v = (v & (0x0F * ONES)).wrapping_mul(2561) >> 8;
    let v = (v & 0x00FF_00FF_00FF_00FF).wrapping_mul(6_553_601) >> 16;
    ((v & 0x0000_FFFF_0000_FFFF).wrapping_mul(42_949_672_960_001) >> 32) as u32
}

/// The ordinary strict parse.
fn parse_strict_plain<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
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
                i = string_end(bytes, start);
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

impl<S: Send + Sync, T: JsonBody> FromRequest<S> for StrictJson<T>
where
    BodyReadTimeout: FromRef<S>,
{
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

impl<S: Send + Sync, T: JsonBody> FromRequest<S> for OptionalJson<T>
where
    BodyReadTimeout: FromRef<S>,
{
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

    impl JsonBody for Body {}

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct Prompt {
        selection_id: Option<String>,
        token_ids: Option<Vec<u32>>,
        isl_tokens: Option<u64>,
    }

    impl JsonBody for Prompt {
        const HAS_TOKEN_IDS: bool = true;

        fn token_ids_slot(&mut self) -> Option<&mut Option<Vec<u32>>> {
            Some(&mut self.token_ids)
        }
    }

    /// The fast path and the ordinary parse agree on the value or on the exact error.
    fn same_as_plain(body: &str) {
        let fast = parse_strict::<Prompt>(body.as_bytes());
        let plain = parse_strict_plain::<Prompt>(body.as_bytes());
        match (fast, plain) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{body}"),
            (Err(a), Err(b)) => {
                assert_eq!((a.status, &a.message), (b.status, &b.message), "{body}")
            }
            (a, b) => panic!("{body}: fast {a:?} vs plain {b:?}"),
        }
    }

    #[test]
    fn fast_token_path_matches_the_ordinary_parse() {
        for body in [
            r#"{"token_ids":[1,2,3]}"#,
            r#"{"selection_id":"a","token_ids":[ 0 , 4294967295 ],"isl_tokens":3}"#,
            r#"{"token_ids":[],"selection_id":"x"}"#,
            "{ \"token_ids\" :\n[\t7,\r\n8 ] }",
            r#"{"token_ids":[1,4294967296]}"#,
            r#"{"token_ids":[12345678901]}"#,
            r#"{"token_ids":[-1]}"#,
            r#"{"token_ids":[01]}"#,
            r#"{"token_ids":[1.0]}"#,
            r#"{"token_ids":[1e3]}"#,
            r#"{"token_ids":[1,]}"#,
            r#"{"token_ids":[,1]}"#,
            r#"{"token_ids":[1 2]}"#,
            r#"{"token_ids":[[1]]}"#,
            r#"{"token_ids":["1"]}"#,
            r#"{"token_ids":null}"#,
            r#"{"token_ids":[1],"token_ids":[2]}"#,
            r#"{"token_ids":[1,2],"isl_tokens":"x"}"#,
            r#"{"token_ids":[1,2],"isl_tokens":3} x"#,
            r#"{"token_ids":[1,2]"#,
            r#"{"a":{"token_ids":[5]},"token_ids":[6]}"#,
            r#"{"a":""token_ids":[9]","token_ids":[6]}"#,
            r#"{"selection_id":"s","a":[{"token_ids":1}],"token_ids":[3]}"#,
            r#"[{"token_ids":[1]}]"#,
            r#"{"token_ids":[12345678,1234567,123456789,99999999,4294967295,10000000,0,7]}"#,
            r#"{"token_ids":[00000001,2]}"#,
            r#"{"token_ids":[1234567a,2]}"#,
            r#"{"token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24]}"#,
        ] {
            same_as_plain(body);
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        for len in [1usize, 2, 17, 1000, 8192] {
            let ids: Vec<u32> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed >> (seed % 32)) as u32
                })
                .collect();
            let body = serde_json::json!({"selection_id": "r", "token_ids": ids}).to_string();
            same_as_plain(&body);
            let fast = parse_strict::<Prompt>(body.as_bytes()).unwrap();
            assert_eq!(fast.token_ids.as_deref(), Some(&ids[..]));
        }
    }

    /// Long arrays (cut in two halves) in the shapes clients write, with one flaw put anywhere:
    /// the fast path takes or refuses exactly what the ordinary parse does.
    #[test]
    fn long_arrays_with_a_flaw_anywhere_match_the_ordinary_parse() {
        let ids: Vec<String> = (0..200u64)
            .map(|i| {
                (i.wrapping_mul(2_654_435_761) % [10, 1000, 151_936, 99_999_999][(i % 4) as usize])
                    .to_string()
            })
            .collect();
        let flaws = [
            "",
            ",",
            " ",
            "00",
            "-1",
            "1.5",
            "[",
            "\"x\"",
            "4294967296",
            "\n",
            "07",
            " , ",
        ];
        let expected: Vec<u32> = ids.iter().map(|id| id.parse().unwrap()).collect();
        for separator in [",", ", ", " ,", ",\n  ", " , "] {
            let clean = ids.join(separator);
            same_as_plain(&format!(r#"{{"token_ids":[{clean}]}}"#));
            // The fast path takes every clean list, in one, two or four lanes.
            for len in [1, 50, 100, 200] {
                let list = format!("[{}]", ids[..len].join(separator));
                let parsed = parse_token_array(list.as_bytes()).map(|(ids, _)| ids);
                assert_eq!(parsed.as_deref(), Some(&expected[..len]), "{list}");
            }
            for at in (0..clean.len())
                .step_by(37)
                .chain([clean.len() / 2, clean.len() / 2 + 1])
            {
                if !clean.is_char_boundary(at) {
                    continue;
                }
                for flaw in flaws {
                    let body = format!(
                        r#"{{"token_ids":[{}{flaw}{}]}}"#,
                        &clean[..at],
                        &clean[at..]
                    );
                    same_as_plain(&body);
                }
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn random_token_lists_parse_as_serde_does(
            ids in proptest::collection::vec(proptest::num::u32::ANY, 0..300),
            spaces in proptest::collection::vec(0usize..3, 300),
        ) {
            let mut text = String::from(r#"{"token_ids":["#);
            for (k, id) in ids.iter().enumerate() {
                if k > 0 {
                    text.push(',');
                    text.push_str(&" ".repeat(spaces[k]));
                }
                text.push_str(&id.to_string());
            }
            text.push_str("]}");
            let fast = parse_strict::<Prompt>(text.as_bytes()).unwrap();
            proptest::prop_assert_eq!(fast.token_ids.as_deref(), Some(&ids[..]));
        }
    }

    #[test]
    fn top_level_key_scan_ignores_nested_and_quoted_keys() {
        let doc = br#"{"a":{"token_ids":1},"b":"token_ids","c":["token_ids"],"token_ids":[4]}"#;
        let at = top_level_value_start(doc, b"token_ids").unwrap();
        assert_eq!(&doc[at..at + 3], b"[4]");
        assert_eq!(top_level_value_start(br#"{"x":1}"#, b"token_ids"), None);
        assert_eq!(
            top_level_value_start(br#"["token_ids"]"#, b"token_ids"),
            None
        );
        assert_eq!(parse_token_array(b"[1, 2]x"), Some((vec![1, 2], 6)));
        assert_eq!(parse_token_array(b"[00]"), None);
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
