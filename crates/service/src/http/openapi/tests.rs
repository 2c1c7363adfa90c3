//! The OpenAPI document held to the service: every route of [`ENDPOINTS`] (which the router is
//! built from) with its method and path parameters, every field of every request body and query
//! type (as their `Deserialize` impls declare them, aliases included), and every key, at every
//! depth, of the responses the handlers really build, driven in process.

use super::document;
use crate::http::{ENDPOINTS, app};
use crate::types::{
    OutputBlockBody, PartitionQuery, PromptRouteBody, ReservationBody, SelectBody, WorkerBody,
};
use crate::{AppState, ServeConfig};
use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use kvroute_core::event::{KvEvent, StoredBlock, Tier};
use kvroute_core::hash::{BASE_SEED, PromptHashes};
use serde::de::{self, DeserializeOwned, Deserializer, IntoDeserializer, MapAccess, Visitor};
use serde_json::{Value, json};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tower::ServiceExt;

// ---------------------------------------------------------------------------------------------
// The fields a type's `Deserialize` impl declares

/// Every struct a type deserializes, by where it sits (the field path from the top), with its
/// name and its fields (aliases included).
type Structs = BTreeMap<Vec<&'static str>, (&'static str, &'static [&'static str])>;

type DeError = de::value::Error;

/// A deserializer that feeds a type nothing but the keys it asks to be fed, recording the
/// `fields` of every `deserialize_struct` call on the way. It follows one field path per run
/// (`follow`), so aliases of one field never meet as duplicates. Errors do not matter: what was
/// recorded before them is the result.
struct Recorder<'a> {
    found: &'a RefCell<Structs>,
    at: Vec<&'static str>,
    follow: &'a [&'static str],
}

/// A map or sequence with no entries.
struct Empty;

/// A sequence of one element, recorded further at the sequence's own path (an array is
/// transparent in field paths).
struct OneElement<'a>(Option<Recorder<'a>>);

impl<'de> de::SeqAccess<'de> for OneElement<'_> {
    type Error = DeError;

    fn next_element_seed<T: de::DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, DeError> {
        match self.0.take() {
            Some(element) => seed.deserialize(element).map(Some),
            None => Ok(None),
        }
    }
}

impl<'de> MapAccess<'de> for Empty {
    type Error = DeError;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        _: K,
    ) -> Result<Option<K::Value>, DeError> {
        Ok(None)
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(&mut self, _: V) -> Result<V::Value, DeError> {
        Err(de::Error::custom("no value"))
    }
}

impl<'de> de::SeqAccess<'de> for Empty {
    type Error = DeError;

    fn next_element_seed<T: de::DeserializeSeed<'de>>(
        &mut self,
        _: T,
    ) -> Result<Option<T::Value>, DeError> {
        Ok(None)
    }
}

/// A map of one key, whose value is recorded further.
struct One<'a> {
    key: Option<&'static str>,
    value: Option<Recorder<'a>>,
}

impl<'de> MapAccess<'de> for One<'_> {
    type Error = DeError;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, DeError> {
        match self.key.take() {
            Some(key) => seed.deserialize(key.into_deserializer()).map(Some),
            None => Ok(None),
        }
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, DeError> {
        match self.value.take() {
            Some(value) => seed.deserialize(value),
            None => Err(de::Error::custom("no value")),
        }
    }
}

impl<'de> Deserializer<'de> for Recorder<'_> {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_unit()
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_bool(false)
    }

    fn deserialize_i8<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_i64(0)
    }

    fn deserialize_i16<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_i64(0)
    }

    fn deserialize_i32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_i64(0)
    }

    fn deserialize_i64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_i64(0)
    }

    fn deserialize_u8<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_u64(0)
    }

    fn deserialize_u16<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_u64(0)
    }

    fn deserialize_u32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_u64(0)
    }

    fn deserialize_u64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_u64(0)
    }

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_f64(0.0)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_f64(0.0)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_str("")
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_str("")
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, DeError> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_seq(OneElement(Some(self)))
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_map(Empty)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, DeError> {
        self.found
            .borrow_mut()
            .insert(self.at.clone(), (name, fields));
        match self.follow.split_first() {
            Some((&key, rest)) => {
                let mut at = self.at;
                at.push(key);
                visitor.visit_map(One {
                    key: Some(key),
                    value: Some(Recorder {
                        found: self.found,
                        at,
                        follow: rest,
                    }),
                })
            }
            None => visitor.visit_map(Empty),
        }
    }

    serde::forward_to_deserialize_any! {
        i128 u128 char bytes byte_buf unit unit_struct tuple tuple_struct enum identifier
        ignored_any
    }
}

/// The structs `T` deserializes, each field path followed once.
fn structs_of<T: DeserializeOwned>() -> Structs {
    let found = RefCell::new(Structs::new());
    let run = |follow: &[&'static str]| {
        let _ = T::deserialize(Recorder {
            found: &found,
            at: Vec::new(),
            follow,
        });
    };
    run(&[]);
    let mut followed = BTreeSet::new();
    loop {
        let next: Vec<Vec<&'static str>> = found
            .borrow()
            .iter()
            .flat_map(|(at, (_, fields))| {
                fields.iter().map(|&f| {
                    let mut path = at.clone();
                    path.push(f);
                    path
                })
            })
            .filter(|path| !followed.contains(path))
            .collect();
        if next.is_empty() {
            break;
        }
        for path in next {
            assert!(path.len() < 8, "fields nest too deep: {path:?}");
            run(&path);
            followed.insert(path);
        }
    }
    found.into_inner()
}

#[test]
fn the_recorder_finds_nested_structs_and_aliases() {
    let structs = structs_of::<SelectBody>();
    let (name, fields) = structs[&Vec::new()];
    assert_eq!(name, "SelectBody");
    assert!(fields.contains(&"tenant_id") && fields.contains(&"routing_group"));
    assert_eq!(structs[&vec!["pinned_worker"]].0, "PinnedBody");
    assert_eq!(structs[&vec!["router_config_override"]].0, "OverrideBody");
    // Through arrays: the structs of their elements, at the array field's path.
    assert_eq!(structs[&vec!["block_mm_infos"]].0, "BlockMmInfoBody");
    assert_eq!(
        structs[&vec!["mm_routing_info", "block_mm_infos", "mm_objects"]].0,
        "MmObjectBody"
    );
    assert_eq!(
        structs[&vec!["routing_constraints"]].0,
        "RoutingConstraints"
    );
    assert_eq!(
        structs[&vec!["session_context"]].0,
        "SelectionSessionContext"
    );
    assert_eq!(structs[&vec!["affinity_target"]].0, "WorkerAffinityTarget");
    assert_eq!(structs.len(), 11);
}

// ---------------------------------------------------------------------------------------------
// The document

/// The schema a `$ref` (or an `allOf` of one schema) stands for.
fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    if let Some(reference) = schema["$ref"].as_str() {
        let name = reference.trim_start_matches("#/components/schemas/");
        return resolve(doc, &doc["components"]["schemas"][name]);
    }
    match schema["allOf"].as_array().map(Vec::as_slice) {
        Some([one]) => resolve(doc, one),
        _ => schema,
    }
}

fn operation<'a>(doc: &'a Value, method: &Method, path: &str) -> &'a Value {
    &doc["paths"][path][method.as_str().to_ascii_lowercase()]
}

/// The names of the parameters `in` (path, query) of an operation, its path's included.
fn parameters(doc: &Value, method: &Method, path: &str, within: &str) -> BTreeSet<String> {
    let shared = doc["paths"][path]["parameters"].as_array().cloned();
    let own = operation(doc, method, path)["parameters"]
        .as_array()
        .cloned();
    shared
        .into_iter()
        .chain(own)
        .flatten()
        .filter(|p| p["in"] == within)
        .filter_map(|p| p["name"].as_str().map(str::to_string))
        .collect()
}

/// Checks that `value` has no key (at any depth) the schema does not describe, and that its
/// kinds are the schema's. An object schema must list its properties or say what its keys map
/// to (`additionalProperties`; `true` for a free-form object).
fn walk(doc: &Value, value: &Value, schema: &Value, at: &str, problems: &mut Vec<String>) {
    let schema = resolve(doc, schema);
    if schema.is_null() {
        problems.push(format!("{at}: no schema"));
        return;
    }
    // One of several shapes: the value must fit one of them (the closest one's problems count).
    if let Some(options) = schema["oneOf"].as_array() {
        let closest = options
            .iter()
            .map(|option| {
                let mut found = Vec::new();
                walk(doc, value, option, at, &mut found);
                found
            })
            .min_by_key(Vec::len)
            .unwrap_or_else(|| vec![format!("{at}: an empty oneOf")]);
        problems.extend(closest);
        return;
    }
    let kind = match value {
        Value::Null => return,
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    if let Some(expected) = schema["type"].as_str()
        && expected != kind
        && !(expected == "number" && kind == "integer")
    {
        problems.push(format!("{at}: {kind} value, documented as {expected}"));
        return;
    }
    match value {
        Value::Object(map) => {
            let extra = &schema["additionalProperties"];
            if extra == &Value::Bool(true) {
                return;
            }
            let properties = schema["properties"].as_object();
            if properties.is_none() && !extra.is_object() {
                problems.push(format!("{at}: an object whose keys are not documented"));
                return;
            }
            for (key, v) in map {
                match properties.and_then(|p| p.get(key)) {
                    Some(s) => walk(doc, v, s, &format!("{at}.{key}"), problems),
                    None if extra.is_object() => walk(doc, v, extra, &format!("{at}.*"), problems),
                    None => problems.push(format!("{at}: key `{key}` is not documented")),
                }
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                walk(doc, item, &schema["items"], &format!("{at}[{i}]"), problems);
            }
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Routes and request bodies

/// What a route reads besides its path.
enum Input {
    Nothing,
    /// A JSON body of this type.
    Json(Structs),
    /// Query parameters of this type.
    Query(Structs),
}

/// The input each route's handler extracts (see `handlers.rs`). A new route must be added here.
fn input_of(method: &Method, path: &str) -> Input {
    match (method.as_str(), path) {
        ("POST" | "PATCH", "/workers" | "/workers/{worker_id}") => {
            Input::Json(structs_of::<WorkerBody>())
        }
        ("GET", "/workers" | "/loads") => Input::Query(structs_of::<PartitionQuery>()),
        ("POST", "/select" | "/select_and_reserve") => Input::Json(structs_of::<SelectBody>()),
        ("POST", "/reservations") => Input::Json(structs_of::<ReservationBody>()),
        ("POST", "/reservations/{reservation_id}/output_block") => {
            Input::Json(structs_of::<OutputBlockBody>())
        }
        ("POST", "/overlap_scores" | "/potential_loads") => {
            Input::Json(structs_of::<PromptRouteBody>())
        }
        // The body of prefill_complete is accepted and ignored.
        ("DELETE", "/workers/{worker_id}" | "/reservations/{reservation_id}")
        | ("POST", "/reservations/{reservation_id}/prefill_complete")
        | ("GET", "/ready" | "/health" | "/dump" | "/metrics" | "/openapi.json" | "/dashboard") => {
            Input::Nothing
        }
        _ => panic!("{method} {path}: say in input_of what its handler reads"),
    }
}

/// The problems of the document's paths against the route table and the request types.
fn route_and_request_problems(doc: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    let served: BTreeSet<(String, &str)> = ENDPOINTS
        .iter()
        .map(|e| (e.method.as_str().to_ascii_lowercase(), e.path))
        .collect();
    // Every documented operation is served.
    for (path, item) in doc["paths"].as_object().into_iter().flatten() {
        for method in item.as_object().into_iter().flatten().map(|(m, _)| m) {
            if method != "parameters" && !served.contains(&(method.clone(), path.as_str())) {
                problems.push(format!("{method} {path} is documented but not served"));
            }
        }
    }
    for e in ENDPOINTS {
        let route = format!("{} {}", e.method, e.path);
        let op = operation(doc, &e.method, e.path);
        if !op.is_object() {
            problems.push(format!("{route} is not documented"));
            continue;
        }
        // Path parameters.
        let documented = parameters(doc, &e.method, e.path, "path");
        for name in e
            .path
            .split('/')
            .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
        {
            if !documented.contains(name) {
                problems.push(format!(
                    "{route}: path parameter `{name}` is not documented"
                ));
            }
        }
        let (structs, schema) = match input_of(&e.method, e.path) {
            Input::Nothing => continue,
            Input::Query(structs) => {
                let documented = parameters(doc, &e.method, e.path, "query");
                for field in structs[&Vec::new()].1 {
                    if !documented.contains(*field) {
                        problems.push(format!(
                            "{route}: query parameter `{field}` is not documented"
                        ));
                    }
                }
                continue;
            }
            Input::Json(structs) => {
                let schema = &op["requestBody"]["content"]["application/json"]["schema"];
                (structs, schema)
            }
        };
        if schema.is_null() {
            problems.push(format!("{route}: the request body is not documented"));
            continue;
        }
        for (at, (name, fields)) in &structs {
            let mut s = resolve(doc, schema);
            for step in at {
                s = resolve(doc, &s["properties"][*step]);
                // An array field's structs are its elements'.
                while s["type"] == "array" {
                    s = resolve(doc, &s["items"]);
                }
            }
            for field in *fields {
                if s["properties"][*field].is_null() {
                    let place = if at.is_empty() {
                        String::new()
                    } else {
                        format!(".{}", at.join("."))
                    };
                    problems.push(format!(
                        "{route}: request field `{field}` ({name}{place}) is not documented"
                    ));
                }
            }
        }
    }
    problems
}

#[test]
fn the_document_lists_every_route_and_every_request_field() {
    let problems = route_and_request_problems(&document());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_request_type_is_checked() {
    // The structs `types.rs` derives `Deserialize` for, against those the check above reaches.
    let source = include_str!("../../types.rs");
    let mut derived = BTreeSet::new();
    let mut deriving = false;
    for line in source.lines().map(str::trim) {
        if line.starts_with("#[derive(") {
            deriving = line.contains("Deserialize");
        } else if let Some(rest) = line.strip_prefix("pub struct ").filter(|_| deriving) {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            derived.insert(name);
            deriving = false;
        } else if !line.starts_with("#[") && !line.starts_with("///") {
            deriving = false;
        }
    }
    let mut reached = BTreeSet::new();
    for e in ENDPOINTS {
        if let Input::Json(structs) | Input::Query(structs) = input_of(&e.method, e.path) {
            reached.extend(structs.values().map(|(name, _)| name.to_string()));
        }
    }
    assert!(derived.len() >= 6, "{derived:?}");
    assert_eq!(
        derived, reached,
        "every Deserialize struct of types.rs is a route's input"
    );
}

/// Every route of the table is served by the router (not its fallbacks).
#[tokio::test]
async fn the_router_serves_the_route_table() {
    let router = app(AppState::new(ServeConfig::defaults()).unwrap());
    for e in ENDPOINTS {
        let path = e
            .path
            .replace("{worker_id}", "1")
            .replace("{reservation_id}", "r1");
        let request = Request::builder()
            .method(e.method.clone())
            .uri(&path)
            .header("content-type", "application/json")
            .body(Body::from("{}"))
            .unwrap();
        let response = router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        assert_ne!(
            status,
            StatusCode::METHOD_NOT_ALLOWED,
            "{} {path}",
            e.method
        );
        assert_ne!(body["error"], "route not found", "{} {path}", e.method);
    }
}

// ---------------------------------------------------------------------------------------------
// Responses

/// Drives an in-process app and checks every response against the document.
struct Responses {
    doc: Value,
    router: Router,
    state: Arc<AppState>,
    problems: Vec<String>,
    /// The routes that answered 2xx.
    answered: BTreeSet<(String, &'static str)>,
}

impl Responses {
    fn new(doc: &Value, config: ServeConfig) -> Self {
        let state = AppState::new(config).unwrap();
        Self {
            doc: doc.clone(),
            router: app(Arc::clone(&state)),
            state,
            problems: Vec::new(),
            answered: BTreeSet::new(),
        }
    }

    /// Sends a request to `uri` (an instance of the route template `path`) and checks the
    /// response against the document's response of its status (or `default`).
    async fn call(
        &mut self,
        method: Method,
        path: &'static str,
        uri: &str,
        body: Option<Value>,
    ) -> Value {
        let mut request = Request::builder().method(method.clone()).uri(uri);
        if body.is_some() {
            request = request.header("content-type", "application/json");
        }
        let body = body.map_or_else(Vec::new, |b| serde_json::to_vec(&b).unwrap());
        let response = self
            .router
            .clone()
            .oneshot(request.body(Body::from(body)).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let json = content_type.starts_with("application/json");
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let route = format!("{method} {uri} ({status})");
        let responses = &operation(&self.doc, &method, path)["responses"];
        let documented = match &responses[status.as_str()] {
            Value::Null => &responses["default"],
            r => r,
        };
        if documented.is_null() {
            self.problems
                .push(format!("{route}: the status is not documented"));
        }
        if status.is_success() {
            self.answered.insert((method.to_string(), path));
        }
        if !json {
            // Answered otherwise: documented with its own media type.
            let media = content_type.split(';').next().unwrap_or("").trim();
            if documented["content"][media].is_null() {
                self.problems.push(format!(
                    "{route}: answered `{content_type}`, not documented so"
                ));
            }
            return Value::Null;
        }
        let value: Value = serde_json::from_slice(&bytes).unwrap();
        let schema = &documented["content"]["application/json"]["schema"];
        let mut problems = Vec::new();
        walk(&self.doc, &value, schema, &route, &mut problems);
        self.problems.extend(problems);
        value
    }

    async fn get(&mut self, path: &'static str, uri: &str) -> Value {
        self.call(Method::GET, path, uri, None).await
    }

    async fn post(&mut self, path: &'static str, uri: &str, body: Value) -> Value {
        self.call(Method::POST, path, uri, Some(body)).await
    }

    /// Applies a prompt's blocks as stored on a rank, as its engine's events would.
    fn store(&self, worker_id: u64, dp_rank: u32, tokens: &[u32]) {
        let hashes = PromptHashes::from_tokens(tokens, 4, BASE_SEED);
        let blocks = hashes
            .local
            .iter()
            .zip(&hashes.sequence)
            .map(|(&local_hash, &engine_hash)| StoredBlock {
                engine_hash,
                local_hash,
            })
            .collect();
        let stored = KvEvent::Stored {
            parent: None,
            blocks,
            tier: Tier::Device,
        };
        self.state
            .selector
            .write()
            .apply_events(worker_id, dp_rank, &[stored])
            .unwrap();
    }
}

/// The responses of every route, with their optional parts, under the TTL (events off), LRU
/// and KV-event cache models, and the error responses.
async fn response_problems(doc: &Value) -> (Vec<String>, BTreeSet<(String, &'static str)>) {
    let tokens: Vec<u32> = (1..=64).collect();
    let mut config = ServeConfig::defaults();
    config.no_kv_events = true;
    let mut r = Responses::new(doc, config);
    // Not ready yet (503).
    r.get("/ready", "/ready").await;
    let w1 = json!({
        "worker_id": 1, "endpoint": "http://127.0.0.1:8001", "block_size": 4,
        "data_parallel_size": 2, "total_kv_blocks": 1000, "max_num_batched_tokens": 8192,
        "kv_events_endpoints": {"0": "tcp://127.0.0.1:5557", "1": "tcp://127.0.0.1:5558"},
        "replay_endpoint": "tcp://127.0.0.1:5560",
    });
    r.post("/workers", "/workers", w1).await;
    let w2 = json!({"worker_id": 2, "endpoint": "http://127.0.0.1:8002", "block_size": 4,
                    "kv_events_endpoint": "tcp://127.0.0.1:5559"});
    r.post("/workers", "/workers", w2).await;
    // Incomplete: no endpoint, no block size (`not_schedulable_reasons`).
    r.post(
        "/workers",
        "/workers",
        json!({"worker_id": 3, "model_name": "other"}),
    )
    .await;
    r.call(
        Method::PATCH,
        "/workers/{worker_id}",
        "/workers/2",
        Some(json!({"total_kv_blocks": 500})),
    )
    .await;
    r.get("/workers", "/workers").await;
    r.get(
        "/workers",
        "/workers?model_name=default&routing_group=default",
    )
    .await;
    r.get("/ready", "/ready").await;
    r.store(1, 1, &tokens);
    let select = json!({"token_ids": tokens, "selection_id": "s1", "expected_output_tokens": 8});
    r.post("/select", "/select", select).await;
    r.post(
        "/select",
        "/select",
        json!({"token_ids": tokens, "advisory": true}),
    )
    .await;
    r.post(
        "/reservations",
        "/reservations",
        json!({"selection_id": "s1"}),
    )
    .await;
    let both = json!({"token_ids": tokens, "reservation_id": "r2", "expected_output_tokens": 8});
    r.post("/select_and_reserve", "/select_and_reserve", both)
        .await;
    // Disaggregated prefill and decode, in a partition of their own.
    for pd in [
        json!({"worker_id": 4, "model_name": "pd", "endpoint": "http://127.0.0.1:8004",
               "block_size": 4, "role": "prefill", "bootstrap_port": 8998}),
        json!({"worker_id": 5, "model_name": "pd", "endpoint": "http://127.0.0.1:8005",
               "block_size": 4, "role": "decode"}),
    ] {
        r.post("/workers", "/workers", pd).await;
    }
    let pd = json!({"model_name": "pd", "token_ids": tokens, "disaggregated": true,
                    "selection_id": "pd1"});
    r.post("/select", "/select", pd).await;
    let pd = json!({"model_name": "pd", "token_ids": tokens, "disaggregated": true,
                    "reservation_id": "pd2"});
    r.post("/select_and_reserve", "/select_and_reserve", pd)
        .await;
    let explicit = json!({"worker_id": 2, "token_ids": tokens, "reservation_id": "r3"});
    r.post("/reservations", "/reservations", explicit).await;
    r.post(
        "/reservations/{reservation_id}/prefill_complete",
        "/reservations/r2/prefill_complete",
        json!({}),
    )
    .await;
    r.post(
        "/reservations/{reservation_id}/output_block",
        "/reservations/r2/output_block",
        json!({"decay_fraction": 0.5}),
    )
    .await;
    r.call(
        Method::DELETE,
        "/reservations/{reservation_id}",
        "/reservations/r3",
        None,
    )
    .await;
    r.post(
        "/overlap_scores",
        "/overlap_scores",
        json!({"token_ids": tokens}),
    )
    .await;
    r.post(
        "/potential_loads",
        "/potential_loads",
        json!({"token_ids": tokens}),
    )
    .await;
    r.get("/loads", "/loads").await;
    r.get("/loads", "/loads?model_name=default").await;
    r.get("/dump", "/dump").await;
    r.get("/health", "/health").await;
    r.get("/metrics", "/metrics").await;
    r.get("/openapi.json", "/openapi.json").await;
    r.get("/dashboard", "/dashboard").await;
    r.call(Method::DELETE, "/workers/{worker_id}", "/workers/2", None)
        .await;
    // Errors.
    r.post("/select", "/select", json!({"token_ids": []})).await;
    r.post("/select", "/select", json!({"token_ids": "x"}))
        .await;
    r.call(Method::DELETE, "/workers/{worker_id}", "/workers/99", None)
        .await;
    r.post(
        "/reservations/{reservation_id}/prefill_complete",
        "/reservations/nope/prefill_complete",
        json!({}),
    )
    .await;
    let mut problems = std::mem::take(&mut r.problems);
    let mut answered = std::mem::take(&mut r.answered);

    // The LRU model's report in `/loads`.
    let mut config = ServeConfig::defaults();
    config.no_kv_events = true;
    config.approximate_cache_policy = crate::config::ApproximatePolicy::Lru;
    let mut r = Responses::new(doc, config);
    let w = json!({"worker_id": 1, "endpoint": "http://127.0.0.1:8001", "block_size": 4,
                   "total_kv_blocks": 1000});
    r.post("/workers", "/workers", w).await;
    let both = json!({"token_ids": tokens, "reservation_id": "r1"});
    r.post("/select_and_reserve", "/select_and_reserve", both)
        .await;
    r.get("/loads", "/loads").await;
    problems.append(&mut r.problems);
    answered.append(&mut r.answered);
    (problems, answered)
}

#[tokio::test]
async fn every_response_key_is_documented() {
    let (problems, answered) = response_problems(&document()).await;
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // Every route answered once at least, so none was left unchecked.
    for e in ENDPOINTS {
        assert!(
            answered.contains(&(e.method.to_string(), e.path)),
            "{} {} never answered 2xx",
            e.method,
            e.path
        );
    }
}
