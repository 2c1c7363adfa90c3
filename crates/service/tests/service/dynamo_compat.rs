//! Wire compatibility with Dynamo's selection service: every exchange recorded from the real
//! Dynamo 1.6.1 service (tests/fixtures/dynamo, captured by bench/dynamo/capture.py) is replayed
//! against kvroute in order. kvroute must answer with the same status and a body with at least
//! the same fields of the same JSON types — except where SPEC §7.8 (or a decision) makes kvroute
//! differ on purpose; those exchanges are listed in `DEVIATIONS` with the reason. The service
//! runs with `--router-profile dynamo`, Dynamo's weights and effective-prefill formula.

use crate::common::TestApp;
use axum::http::Method;
use kvroute_service::ServeConfig;
use serde_json::Value;
use std::path::PathBuf;

pub(crate) fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dynamo")
}

/// `(shape difference)`: whether `ours` has every field of `theirs`, with the same JSON type.
fn shape_mismatch(theirs: &Value, ours: &Value, path: &str) -> Option<String> {
    match (theirs, ours) {
        (Value::Null, _) => None,
        (Value::Object(t), Value::Object(o)) => t.iter().find_map(|(k, tv)| match o.get(k) {
            None => Some(format!("{path}.{k} missing")),
            Some(ov) => shape_mismatch(tv, ov, &format!("{path}.{k}")),
        }),
        (Value::Array(t), Value::Array(o)) => match (t.first(), o.first()) {
            (Some(tv), Some(ov)) => shape_mismatch(tv, ov, &format!("{path}[0]")),
            _ => None,
        },
        (Value::Number(_), Value::Number(_))
        | (Value::String(_), Value::String(_))
        | (Value::Bool(_), Value::Bool(_)) => None,
        (t, o) => Some(format!("{path}: Dynamo has {t}, kvroute has {o}")),
    }
}

const NO_EVENTS: &str = "SPEC §7.8: a worker without a KV-event endpoint is schedulable (approximate cache model), not incomplete";
const ADVICE: &str = "SPEC §7.4/§7.8: kvroute's 404/409 texts add advice or name the worker";
const ONE_503: &str = "SPEC §7.4: one 503 text, `no schedulable workers for {partition}`, also when the whole service has none";
const STRICT: &str =
    "SPEC §7.4: empty prompts, isl 0, ids over 1,024 bytes and trailing JSON data are 400s";
const OPTIONAL: &str = "SPEC §7.3/§7.8: reservation_id/selection_id and pinned dp_rank are optional; hashes may be unsigned";
const JSON_PATH: &str = "SPEC §7.8: a bad path parameter is a JSON 400, not plain text";
const BODY: &str = "SPEC §7.8: output_block takes an optional body";
const EXTRA: &str = "kvroute additions: /metrics and /openapi.json exist";

/// Exchanges where kvroute differs from Dynamo 1.6.1 on purpose.
const DEVIATIONS: &[(&str, &str)] = &[
    ("workers.json:upsert_without_kv_events", NO_EVENTS),
    ("workers.json:ready_only_incomplete", NO_EVENTS),
    ("workers.json:ready_one_schedulable", NO_EVENTS),
    ("workers.json:list_workers", NO_EVENTS),
    ("workers.json:list_workers_by_tenant_id", NO_EVENTS),
    ("workers.json:ready_mixed", NO_EVENTS),
    ("workers.json:ready_after_deleting_all", NO_EVENTS),
    ("workers.json:patch_bad_path_param", JSON_PATH),
    ("workers.json:patch_negative_path_param", JSON_PATH),
    ("workers.json:delete_bad_path_param", JSON_PATH),
    ("workers.json:delete_u64_overflow_path_param", JSON_PATH),
    ("select.json:select_no_workers", ONE_503),
    ("select.json:upsert_worker_c_no_kv_events", NO_EVENTS),
    ("select.json:select_hashes_unsigned_block_hashes", OPTIONAL),
    ("select.json:select_pinned_worker_no_dp_rank", OPTIONAL),
    ("select.json:select_pinned_incomplete_worker", NO_EVENTS),
    (
        "select.json:select_allowed_worker_ids_none_available",
        NO_EVENTS,
    ),
    ("select.json:select_and_reserve_duplicate", ADVICE),
    ("reservations.json:replay_no_workers_no_pending", ADVICE),
    ("reservations.json:replay_again", ADVICE),
    ("reservations.json:replay_other_partition", ADVICE),
    ("reservations.json:replay_wrong_partition", ADVICE),
    ("reservations.json:missing_selection_id", OPTIONAL),
    ("reservations.json:missing_selection_id_replay", OPTIONAL),
    ("reservations.json:explicit_duplicate", ADVICE),
    ("reservations.json:explicit_duplicate_same_worker", ADVICE),
    (
        "reservations.json:explicit_bad_dp_rank",
        "SPEC §7.4: a missing rank is `schedulable worker {id} not found for {partition}`",
    ),
    ("reservations.json:explicit_empty_token_ids", STRICT),
    ("reservations.json:explicit_isl_zero", STRICT),
    ("reservations.json:replay_after_explicit_discard", ADVICE),
    (
        "reservations.json:replay_worker_gone",
        "SPEC §7.4: `schedulable worker {id} not found for {partition}` (no dp_rank)",
    ),
    (
        "reservations.json:replay_worker_gone_retry",
        "SPEC §7.4: `schedulable worker {id} not found for {partition}` (no dp_rank)",
    ),
    (
        "reservations.json:output_block_no_body_no_content_type",
        BODY,
    ),
    (
        "reservations.json:output_block_empty_body_json_content_type",
        BODY,
    ),
    ("reservations.json:explicit_on_incomplete_worker", NO_EVENTS),
    (
        "reservations.json:explicit_booking_on_incomplete_worker",
        NO_EVENTS,
    ),
    ("reservations.json:long_selection_id", STRICT),
    ("reservations.json:free_long_selection_id", STRICT),
    (
        "reservations.json:replay_partition_without_workers",
        NO_EVENTS,
    ),
    (
        "reservations.json:replay_partition_without_workers_retry",
        NO_EVENTS,
    ),
    ("loads.json:potential_loads_no_workers", ONE_503),
    ("loads.json:overlap_scores_no_workers", ONE_503),
    ("loads.json:overlap_scores_empty_tokens", STRICT),
    ("loads.json:potential_loads_empty_tokens", STRICT),
    ("errors.json:select_no_workers", ONE_503),
    ("errors.json:select_and_reserve_no_workers", ONE_503),
    ("errors.json:potential_loads_no_workers", ONE_503),
    ("errors.json:explicit_reservation_no_workers", ONE_503),
    ("errors.json:upsert_incomplete_worker_only", NO_EVENTS),
    ("errors.json:select_only_incomplete_workers", NO_EVENTS),
    ("errors.json:select_empty_token_ids", STRICT),
    ("errors.json:select_and_reserve_empty_token_ids", STRICT),
    ("errors.json:trailing_data", STRICT),
    (
        "errors.json:duplicate_keys",
        "SPEC §7.4: duplicate keys are a 400 like any malformed body",
    ),
    (
        "errors.json:not_an_object",
        "kvroute's message says the body must be a JSON object",
    ),
    (
        "errors.json:isl_tokens_negative",
        "the message says u64 where Dynamo's says usize",
    ),
    (
        "errors.json:block_hashes_over_i64_u64",
        "the message names kvroute's hash type (signed or unsigned)",
    ),
    (
        "errors.json:token_ids_string",
        "kvroute's 422 names the field path",
    ),
    (
        "errors.json:token_ids_negative",
        "kvroute's 422 names the field path",
    ),
    (
        "errors.json:token_ids_over_u32",
        "kvroute's 422 names the field path",
    ),
    (
        "errors.json:token_ids_float",
        "kvroute's 422 names the field path",
    ),
    ("errors.json:reservation_selection_id_null", OPTIONAL),
    ("errors.json:long_model_name", STRICT),
    ("errors.json:bad_path_param_patch", JSON_PATH),
    ("errors.json:bad_path_param_delete", JSON_PATH),
    ("errors.json:metrics", EXTRA),
    ("errors.json:openapi_json", EXTRA),
];

#[tokio::test]
async fn kvroute_answers_dynamo_clients_like_dynamo() {
    let mut report = Vec::new();
    let mut checked = 0;
    let mut deviations_seen = 0;
    for file in [
        "workers.json",
        "select.json",
        "reservations.json",
        "loads.json",
        "errors.json",
    ] {
        let text = std::fs::read_to_string(fixtures().join(file)).expect("fixture");
        let doc: Value = serde_json::from_str(&text).expect("fixture json");
        let config = ServeConfig::parse_from(["kvroute", "--router-profile", "dynamo"])
            .expect("the dynamo profile");
        let app = TestApp::with_config(config);
        for ex in doc["exchanges"].as_array().expect("exchanges") {
            let name = ex["name"].as_str().unwrap_or("?");
            let method = Method::from_bytes(ex["method"].as_str().unwrap_or("GET").as_bytes())
                .expect("method");
            let path = ex["path"].as_str().unwrap_or("/");
            // A recorded `request_content_type` (even null: none sent) wins; else JSON.
            let content_type = match ex.get("request_content_type") {
                Some(v) => v.as_str(),
                None => Some("application/json"),
            };
            let (content_type, body) = if let Some(raw) = ex.get("request_raw") {
                (content_type, raw.as_str().unwrap_or("").as_bytes().to_vec())
            } else if ex["request"].is_null() {
                (None, Vec::new())
            } else {
                (
                    content_type,
                    serde_json::to_vec(&ex["request"]).expect("json"),
                )
            };
            if ex["request"].is_null()
                && ex.get("request_raw").is_none()
                && ex.get("note").is_some()
            {
                // Bodies described only in a note (the 8 MiB ones) are tested in http.rs.
                continue;
            }
            let reply = app.raw(method, path, content_type, body, &[]).await;
            let want = ex["status"].as_u64().unwrap_or(0) as u16;
            checked += 1;
            let got = reply.status.as_u16();
            let line = if got != want {
                Some(format!(
                    "{file}:{name}: status {got} (Dynamo {want}); ours {} / theirs {}",
                    reply.text.chars().take(160).collect::<String>(),
                    ex["response"]
                        .to_string()
                        .chars()
                        .take(160)
                        .collect::<String>()
                ))
            } else if (200..300).contains(&got) {
                shape_mismatch(&ex["response"], &reply.body, "")
                    .map(|m| format!("{file}:{name}: shape {m}"))
            } else {
                // Positions in parse errors depend on how the body was formatted; compare the rest.
                let strip = |m: &str| m.split(" at line ").next().unwrap_or("").to_string();
                let theirs = strip(ex["response"]["error"].as_str().unwrap_or(""));
                let ours = strip(reply.body["error"].as_str().unwrap_or(""));
                (theirs != ours)
                    .then(|| format!("{file}:{name}: message {ours:?} (Dynamo {theirs:?})"))
            };
            if let Some(line) = line {
                match DEVIATIONS
                    .iter()
                    .find(|(n, _)| *n == format!("{file}:{name}"))
                {
                    Some(_) => deviations_seen += 1,
                    None => report.push(line),
                }
            }
        }
    }
    println!(
        "replayed {checked} Dynamo exchanges: {} identical in status and shape, {deviations_seen} deliberate differences",
        checked - deviations_seen - report.len()
    );
    assert!(checked > 200, "fixtures replayed: {checked}");
    assert!(
        report.is_empty(),
        "unexplained differences from Dynamo:\n{}",
        report.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// Multimodal and Eagle (`multimodal.json`), with the capture's engine events

/// A `BlockStored` batch laid out as the capture's publisher (`bench/dynamo/fake_engine.py`)
/// wrote it: vLLM's array form up to `medium`, then `lora_name`, `extra_keys` and Dynamo's own
/// `block_mm_infos` (position 9) when any of them is given.
pub(crate) fn capture_batch(
    hashes: &[u64],
    tokens: &[u32],
    extra_keys: Option<rmpv::Value>,
    block_mm_infos: Option<rmpv::Value>,
) -> Vec<u8> {
    use rmpv::Value as M;
    let mut event = vec![
        M::from("BlockStored"),
        M::Array(hashes.iter().map(|&h| M::from(h)).collect()),
        M::Nil,
        M::Array(tokens.iter().map(|&t| M::from(t)).collect()),
        M::from(4),
        M::Nil,
        M::from("GPU"),
    ];
    if extra_keys.is_some() || block_mm_infos.is_some() {
        event.push(M::Nil);
        event.push(extra_keys.unwrap_or(M::Nil));
        event.push(block_mm_infos.unwrap_or(M::Nil));
    }
    let batch = M::Array(vec![
        M::from(1.0),
        M::Array(vec![M::Array(event)]),
        M::from(0),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("msgpack");
    out
}

/// Publishes `batch` from `engine` until worker `worker_id` of `app` holds `device_blocks` of
/// `tokens` (a PUB socket drops what it sends before the service's listener is up), at most 10 s.
pub(crate) async fn publish_until_held(
    app: &TestApp,
    engine: &mut kvroute_testkit::fake_engine::FakeEngine,
    batch: &[u8],
    tokens: &[u32],
    worker_id: u64,
    device_blocks: u64,
) {
    use serde_json::json;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        engine
            .publish_payload(batch.to_vec())
            .await
            .expect("publish");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let scores = app
            .post("/overlap_scores", json!({"token_ids": tokens}))
            .await;
        if overlap_by_worker(&scores.body)
            .get(&worker_id)
            .is_some_and(|o| o[0] == json!(device_blocks))
        {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "events never indexed");
    }
}

/// Points a recorded worker body's `kv_events_endpoint` at a fake engine of ours (one per
/// recorded address, made on first use).
pub(crate) async fn swap_engine_endpoint(
    engines: &mut std::collections::HashMap<String, kvroute_testkit::fake_engine::FakeEngine>,
    body: &mut Value,
) {
    let Some(addr) = body["kv_events_endpoint"].as_str().map(str::to_string) else {
        return;
    };
    if !engines.contains_key(&addr) {
        let engine = kvroute_testkit::fake_engine::FakeEngine::bind(
            "tcp://127.0.0.1:0",
            None,
            kvroute_wire::Encoding::Array,
        )
        .await
        .expect("fake engine");
        engines.insert(addr.clone(), engine);
    }
    body["kv_events_endpoint"] = serde_json::json!(engines[&addr].pub_endpoint());
}

/// `(worker_id, local hash)` of every block in a `/dump` answer. (A block several workers store
/// is one node in Dynamo's tree, dumped with the engine hash of the first to store it: engine
/// hashes are not comparable.)
fn dumped_blocks(dump: &Value, partition: &str) -> std::collections::BTreeSet<(u64, u64)> {
    let as_u64 = |v: &Value| v.as_u64().or_else(|| v.as_i64().map(|h| h as u64));
    let mut out = std::collections::BTreeSet::new();
    for event in dump[partition]["events"].as_array().into_iter().flatten() {
        let worker = event["worker_id"].as_u64().expect("worker_id");
        for block in event["event"]["data"]["stored"]["blocks"]
            .as_array()
            .into_iter()
            .flatten()
        {
            out.insert((worker, as_u64(&block["tokens_hash"]).expect("tokens_hash")));
        }
    }
    out
}

/// Device, host and disk blocks per worker of an `/overlap_scores` answer.
pub(crate) fn overlap_by_worker(scores: &Value) -> std::collections::BTreeMap<u64, Value> {
    scores["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| {
            (
                w["worker_id"].as_u64().expect("worker_id"),
                serde_json::json!([
                    w["device_blocks"],
                    w["host_pinned_blocks"],
                    w["disk_blocks"]
                ]),
            )
        })
        .collect()
}

/// Worker 1's fourth block (local hash 135165725823939817, after its image block), which
/// Dynamo 1.6.1 lost: its `/dump` and overlaps show worker 1 with only the three blocks it
/// shares with worker 2, who stored them first. A quirk of Dynamo's tree, not of hashing; every
/// answer it touches is checked with that block taken off kvroute's side.
const LOST_BY_DYNAMO: (u64, u64) = (1, 135_165_725_823_939_817);

/// Exchanges of `multimodal.json` where kvroute differs from Dynamo 1.6.1 on purpose.
const MULTIMODAL_DEVIATIONS: &[(&str, &str)] = &[
    (
        "overlap_eagle_partition_default",
        "kvroute does not read a worker's `is_eagle`: requests default to is_eagle false",
    ),
    (
        "select_eagle_partition_default",
        "kvroute does not read a worker's `is_eagle`: requests default to is_eagle false",
    ),
    (
        "bad_worker_is_eagle_string",
        "kvroute does not read a worker's `is_eagle` (ignored like other unknown worker fields)",
    ),
];

/// Dynamo's multimodal scenario, replayed with the same engine events (published in the
/// capture's own layouts: `block_mm_infos` at array position 9, Dynamo's markers and
/// `dynamo-cache-salt:` in `extra_keys`, a native vLLM id that must be ignored): the same local
/// hashes in `/dump`, the same overlap per worker for every prompt form, the same select
/// overlaps and booked sequence hashes, and the same 422s (kvroute's texts add the field path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multimodal_exchanges_replay_with_the_recorded_events() {
    use kvroute_testkit::fake_engine::FakeEngine;
    use kvroute_wire::Encoding;
    use rmpv::Value as M;
    use serde_json::json;
    use std::time::Duration;

    let text = std::fs::read_to_string(fixtures().join("multimodal.json")).expect("fixture");
    let doc: Value = serde_json::from_str(&text).expect("fixture json");
    let config = ServeConfig::parse_from(["kvroute", "--router-profile", "dynamo"])
        .expect("the dynamo profile");
    let app = TestApp::with_config(config);
    let tokens: Vec<u32> = (1..=17).collect();
    let (mm_x, salt_key) = (0xDEAD_BEEFu64, "dynamo-cache-salt:salt-1");
    let marked_x = format!("{mm_x:016x}{}", "0".repeat(48));
    let native_x = format!("{mm_x:016x}{}", "ab".repeat(24));
    let info_x = M::Array(vec![M::Map(vec![(
        M::from("mm_objects"),
        M::Array(vec![M::Map(vec![
            (M::from("mm_hash"), M::from(mm_x)),
            (
                M::from("offsets"),
                M::Array(vec![M::Array(vec![M::from(0), M::from(3)])]),
            ),
        ])]),
    )])]);
    let mut x_then_nils = info_x.as_array().expect("list").clone();
    x_then_nils.extend([M::Nil, M::Nil, M::Nil]);
    let keys = |first: M, blocks: usize| {
        let mut list = vec![M::Array(vec![first])];
        list.extend(std::iter::repeat_n(M::Nil, blocks - 1));
        M::Array(list)
    };
    // The events of workers 1..=7, as the capture published them.
    let events: Vec<Vec<u8>> = vec![
        capture_batch(
            &[1001, 1002, 1003, 1004],
            &tokens[..16],
            None,
            Some(M::Array(x_then_nils)),
        ),
        capture_batch(
            &[2001, 2002, 2003],
            &tokens[..12],
            Some(keys(M::from(marked_x.clone()), 3)),
            None,
        ),
        capture_batch(
            &[3001, 3002, 3003, 3004],
            &tokens[..16],
            Some(keys(M::from(native_x), 4)),
            None,
        ),
        capture_batch(
            &[4001, 4002],
            &tokens[..8],
            Some(keys(M::Array(vec![M::from(marked_x), M::from(0)]), 2)),
            None,
        ),
        capture_batch(&[5001], &tokens[..4], None, None),
        capture_batch(
            &[6001, 6002, 6003, 6004],
            &tokens[..16],
            Some(keys(M::from(salt_key), 4)),
            None,
        ),
        capture_batch(&[7001, 7002, 7003, 7004], &tokens, None, None),
    ];
    let mut engines: Vec<FakeEngine> = Vec::new();
    let mut report = Vec::new();
    let mut compared = 0;
    let mut deviations_seen = 0;
    for ex in doc["exchanges"].as_array().expect("exchanges") {
        let name = ex["name"].as_str().expect("name");
        let path = ex["path"].as_str().expect("path");
        let mut request = ex["request"].clone();
        if request["kv_events_endpoint"].is_string() {
            let engine = FakeEngine::bind("tcp://127.0.0.1:0", None, Encoding::Array)
                .await
                .expect("fake engine");
            request["kv_events_endpoint"] = json!(engine.pub_endpoint());
            engines.push(engine);
        }
        // Publish each worker's events once its listener is up, until the index holds them.
        let (partition, workers, blocks) = match name {
            "dump" => ("default:default", 0..6, 18),
            "dump_eagle_partition" => ("m-eagle:default", 6..7, 4),
            _ => ("", 0..0, 0),
        };
        if blocks > 0 {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                for i in workers.clone() {
                    engines[i]
                        .publish_payload(events[i].clone())
                        .await
                        .expect("publish");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                let dump = app.get("/dump").await.body;
                if dumped_blocks(&dump, partition).len() == blocks {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "events never indexed");
            }
        }
        let method =
            Method::from_bytes(ex["method"].as_str().expect("method").as_bytes()).expect("method");
        let body = (!request.is_null()).then_some(request);
        let reply = app.call(method, path, body).await;
        let want = ex["status"].as_u64().expect("status") as u16;
        let theirs = &ex["response"];
        let problem = if reply.status.as_u16() != want {
            Some(format!(
                "status {} (Dynamo {want}): {}",
                reply.status, reply.text
            ))
        } else if path == "/dump" {
            let mut problem = None;
            for partition in ["default:default", "m-eagle:default"] {
                let mut ours = dumped_blocks(&reply.body, partition);
                ours.remove(&LOST_BY_DYNAMO);
                let dynamos = dumped_blocks(theirs, partition);
                if ours != dynamos {
                    problem = Some(format!("{partition}: blocks {ours:?}, Dynamo {dynamos:?}"));
                }
            }
            problem
        } else if path == "/overlap_scores" {
            let (mut ours, dynamos) = (overlap_by_worker(&reply.body), overlap_by_worker(theirs));
            // Worker 1 holding the whole image prompt: Dynamo lost the fourth block.
            if ours.get(&LOST_BY_DYNAMO.0) == Some(&json!([4, 4, 4])) {
                ours.insert(LOST_BY_DYNAMO.0, json!([3, 3, 3]));
            }
            (ours != dynamos).then(|| format!("overlap {ours:?}, Dynamo {dynamos:?}"))
        } else if path == "/select" && want == 200 {
            // Ties are broken at random: the overlap is what must agree (worker 1's whole image
            // prompt is one block more than Dynamo kept).
            let gpu = |v: &Value| v["overlap"]["gpu"].as_u64().unwrap_or(u64::MAX);
            let lost =
                usize::from(reply.body["worker_id"] == LOST_BY_DYNAMO.0 && gpu(&reply.body) == 16);
            (gpu(&reply.body) - 4 * lost as u64 != gpu(theirs)).then(|| {
                format!(
                    "overlap {}, Dynamo {}",
                    reply.body["overlap"], theirs["overlap"]
                )
            })
        } else if path == "/select_and_reserve" {
            (reply.body["sequence_hashes"] != theirs["sequence_hashes"]
                || reply.body["isl_tokens"] != theirs["isl_tokens"])
                .then(|| format!("{}, Dynamo {theirs}", reply.text))
        } else if want >= 400 {
            // Dynamo's words, less the position (and the name of its struct); kvroute's text
            // adds the field path before them.
            let core = theirs["error"]
                .as_str()
                .unwrap_or("")
                .trim_start_matches("Failed to deserialize the JSON body into the target type: ")
                .split(" at line ")
                .next()
                .unwrap_or("")
                .split(" expected struct ")
                .next()
                .unwrap_or("")
                .to_string();
            let ours = reply.body["error"].as_str().unwrap_or("");
            (!ours.contains(&core)).then(|| format!("message {ours:?} lacks Dynamo's {core:?}"))
        } else {
            None
        };
        compared += 1;
        if let Some(problem) = problem {
            if MULTIMODAL_DEVIATIONS.iter().any(|(n, _)| *n == name) {
                deviations_seen += 1;
            } else {
                report.push(format!("{name}: {problem}"));
            }
        }
        if name == "loads_after_bookings" {
            // The capture freed its bookings here, unrecorded.
            for id in ["mx-1", "mx-2"] {
                app.delete(&format!("/reservations/{id}")).await;
            }
        }
    }
    assert!(compared >= 60, "{compared} exchanges");
    assert!(
        report.is_empty(),
        "differences from Dynamo's multimodal exchanges:\n{}",
        report.join("\n")
    );
    assert_eq!(deviations_seen, MULTIMODAL_DEVIATIONS.len());
}

// ---------------------------------------------------------------------------------------------
// Routing constraints (`constraints.json`): worker taints, required and preferred taints

/// Exchanges of `constraints.json` that are not sent (none: the scenario ran with
/// `--session-affinity-ttl-secs 60`, as the replay does).
const CONSTRAINTS_SKIPPED: &[(&str, &str)] = &[];

const CEIL: &str = "SPEC §7.8: blocks are counted with ceil(isl / block_size) in every route (Dynamo floors /loads, /potential_loads and the booked decode blocks)";

/// Fields of `constraints.json` answers where kvroute differs from Dynamo 1.6.1 on purpose:
/// `(exchange, field)`, left out of the comparison (at any depth).
const CONSTRAINTS_DEVIATIONS: &[(&str, &str, &str)] = &[
    (
        "potential_loads_ignore_constraints",
        "potential_decode_blocks",
        CEIL,
    ),
    // Worker 1 holds the session's 17-token booking: 5 blocks booked, not 4.
    ("t_select_after", "potential_decode_blocks", CEIL),
    (
        "t_select_preferred_away_from_bound_worker",
        "potential_decode_blocks",
        CEIL,
    ),
    (
        "t_select_after_rejected_reserve",
        "potential_decode_blocks",
        CEIL,
    ),
];

/// `value` without `field`, at any depth.
fn without(value: &Value, field: &str) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| *k != field)
                .map(|(k, v)| (k.clone(), without(v, field)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(|v| without(v, field)).collect()),
        other => other.clone(),
    }
}

/// `ours` has every field of `theirs` with an equal value (numbers compared as numbers), arrays
/// element by element. `None` when they agree, else where they first differ.
fn value_mismatch(theirs: &Value, ours: &Value, path: &str) -> Option<String> {
    match (theirs, ours) {
        (Value::Object(t), Value::Object(o)) => t.iter().find_map(|(k, tv)| match o.get(k) {
            None => Some(format!("{path}.{k} missing")),
            Some(ov) => value_mismatch(tv, ov, &format!("{path}.{k}")),
        }),
        (Value::Array(t), Value::Array(o)) if t.len() == o.len() => t
            .iter()
            .zip(o)
            .enumerate()
            .find_map(|(i, (tv, ov))| value_mismatch(tv, ov, &format!("{path}[{i}]"))),
        (Value::Number(t), Value::Number(o)) if t.as_f64() == o.as_f64() => None,
        (t, o) if t == o => None,
        (t, o) => Some(format!("{path}: Dynamo has {t}, kvroute has {o}")),
    }
}

/// An answer in a comparable form: worker taints sorted (Dynamo lists the set in any order),
/// lists of workers or ranks sorted by partition, worker and rank, and the fake engines'
/// addresses replaced by the ones the capture registered.
fn normalized(value: &Value, addresses: &std::collections::HashMap<String, Value>) -> Value {
    let key = |v: &Value| {
        (
            v["model_name"].as_str().unwrap_or("").to_string(),
            v["worker_id"].as_u64().unwrap_or(0),
            v["dp_rank"].as_u64().unwrap_or(0),
        )
    };
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = match (k.as_str(), v) {
                        ("taints", Value::Array(taints)) => {
                            let mut taints = taints.clone();
                            taints.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
                            Value::Array(taints)
                        }
                        ("kv_events_endpoint", Value::String(address)) => {
                            addresses.get(address).cloned().unwrap_or_else(|| v.clone())
                        }
                        _ => normalized(v, addresses),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => {
            let mut items: Vec<Value> = items.iter().map(|v| normalized(v, addresses)).collect();
            if items.iter().all(|v| v["worker_id"].is_u64()) {
                items.sort_by_key(key);
            }
            Value::Array(items)
        }
        other => other.clone(),
    }
}

/// Dynamo's routing-constraints scenario, replayed with worker 1's recorded cache (16 of the 17
/// prompt tokens): every status, every worker record (taints as a set), every select's worker,
/// rank and overlap — so every decision the required filter and the preferred multiplier made —
/// and every error text (less its position), under `--router-profile dynamo`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constraints_exchanges_replay_with_dynamo_decisions() {
    use kvroute_testkit::fake_engine::FakeEngine;
    use kvroute_wire::Encoding;
    use serde_json::json;
    use std::collections::HashMap;

    let text = std::fs::read_to_string(fixtures().join("constraints.json")).expect("fixture");
    let doc: Value = serde_json::from_str(&text).expect("fixture json");
    // As the capture ran Dynamo: `--session-affinity-ttl-secs 60`.
    let config = ServeConfig::parse_from([
        "kvroute",
        "--router-profile",
        "dynamo",
        "--session-affinity-ttl-secs",
        "60",
    ])
    .expect("the dynamo profile");
    let app = TestApp::with_config(config);
    let tokens: Vec<u32> = (1..=17).collect();
    let mut engines: HashMap<u64, FakeEngine> = HashMap::new();
    // Each fake engine's address → the address the capture registered.
    let mut addresses: HashMap<String, Value> = HashMap::new();
    let (mut report, mut compared, mut skipped, mut deviations_seen) = (Vec::new(), 0, 0, 0);
    for ex in doc["exchanges"].as_array().expect("exchanges") {
        let name = ex["name"].as_str().expect("name");
        if CONSTRAINTS_SKIPPED.iter().any(|(n, _)| *n == name) {
            skipped += 1;
            continue;
        }
        let path = ex["path"].as_str().expect("path");
        let want = ex["status"].as_u64().expect("status") as u16;
        let mut request = ex["request"].clone();
        if let (Some(recorded), Some(worker)) = (
            request["kv_events_endpoint"].as_str().map(str::to_string),
            request["worker_id"].as_u64().filter(|_| want == 201),
        ) {
            let engine = FakeEngine::bind("tcp://127.0.0.1:0", None, Encoding::Array)
                .await
                .expect("fake engine");
            request["kv_events_endpoint"] = json!(engine.pub_endpoint());
            addresses.insert(engine.pub_endpoint().to_string(), json!(recorded));
            engines.insert(worker, engine);
        }
        if name == "no_constraints" {
            // Worker 1 holds the prompt's 4 full blocks, as the capture published them.
            let batch = capture_batch(&[1001, 1002, 1003, 1004], &tokens[..16], None, None);
            let worker_1 = engines.get_mut(&1).expect("worker 1's engine");
            publish_until_held(&app, worker_1, &batch, &tokens, 1, 4).await;
        }
        let method =
            Method::from_bytes(ex["method"].as_str().expect("method").as_bytes()).expect("method");
        let body = (!request.is_null()).then_some(request);
        let reply = app.call(method, path, body).await;
        compared += 1;
        let problem = if reply.status.as_u16() != want {
            Some(format!(
                "status {} (Dynamo {want}): {}",
                reply.status, reply.text
            ))
        } else if want < 300 {
            let (mut theirs, mut ours) = (
                normalized(&ex["response"], &addresses),
                normalized(&reply.body, &addresses),
            );
            for (_, field, _) in CONSTRAINTS_DEVIATIONS.iter().filter(|(n, ..)| *n == name) {
                (theirs, ours) = (without(&theirs, field), without(&ours, field));
                deviations_seen += 1;
            }
            value_mismatch(&theirs, &ours, "")
        } else {
            let strip = |m: &Value| {
                let m = m["error"].as_str().unwrap_or("");
                m.split(" at line ").next().unwrap_or("").to_string()
            };
            let (theirs, ours) = (strip(&ex["response"]), strip(&reply.body));
            (theirs != ours).then(|| format!("message {ours:?} (Dynamo {theirs:?})"))
        };
        if let Some(problem) = problem {
            report.push(format!("{name}: {problem}"));
        }
        if name == "t_select_after_rejected_reserve" {
            // The capture freed the session's bookings here, unrecorded.
            for id in ["t-1", "t-2"] {
                app.delete(&format!("/reservations/{id}")).await;
            }
        }
    }
    assert_eq!(skipped, CONSTRAINTS_SKIPPED.len());
    assert_eq!(deviations_seen, CONSTRAINTS_DEVIATIONS.len());
    assert!(compared >= 70, "{compared} exchanges");
    assert!(
        report.is_empty(),
        "differences from Dynamo's routing-constraints exchanges:\n{}",
        report.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// Session affinity (`sessions.json`), with the capture's engine events and its pauses

/// Exchanges of `sessions.json` where kvroute differs from Dynamo 1.6.1 on purpose.
const SESSION_DEVIATIONS: &[(&str, &str)] = &[
    (
        "e_select",
        "kvroute: an explicit booking with a session binds an unbound session (Dynamo's explicit bookings have no session fields)",
    ),
    (
        "u_free_booking_of_incomplete_worker",
        "kvroute keeps the bookings of a worker made incomplete (Dynamo drops them)",
    ),
];

/// What the capture did between two recorded exchanges: the pauses (`time.sleep` in
/// `bench/dynamo/capture.py`, played here by moving the service's clock) before an exchange,
/// and the unrecorded frees after one.
fn capture_pause_before(name: &str) -> f64 {
    match name {
        "k_select_booking_older_than_ttl" => 3.0,
        "k_select_1s_after_free" | "m_select_and_reserve_1s_later" => 1.0,
        "k_select_2_5s_after_free"
        | "m_select_2_5s_after_first_free"
        | "m_select_3s_after_second_free" => 1.5,
        _ => 0.0,
    }
}

fn capture_frees_after(name: &str) -> &'static [&'static str] {
    match name {
        "loads_bookings" => &["b-1", "b-2", "b-3", "b-4", "b-6", "b-7"],
        _ => &[],
    }
}

/// Dynamo's session scenario (`--session-affinity-ttl-secs 2`, both busy thresholds at 0.5;
/// its `no_ttl_*` exchanges from an instance without the flag), replayed in order with the same
/// engine events (worker 1 holds the prompt's 4 blocks) and the capture's pauses on the
/// service's clock: the same status, worker and rank for every select and booking, the same
/// error texts. Shapes are the main replay's business (busy thresholds add Dynamo's
/// `decode_busy`, which kvroute does not report).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_exchanges_replay_as_recorded() {
    use kvroute_testkit::fake_engine::FakeEngine;
    use std::collections::HashMap;
    use std::time::Duration;

    let text = std::fs::read_to_string(fixtures().join("sessions.json")).expect("fixture");
    let doc: Value = serde_json::from_str(&text).expect("fixture json");
    let app = |args: &[&str]| {
        let mut all = vec!["kvroute", "--router-profile", "dynamo"];
        all.extend_from_slice(args);
        TestApp::with_config(ServeConfig::parse_from(all).expect("flags"))
    };
    let no_ttl = app(&[]);
    let ttl = app(&[
        "--session-affinity-ttl-secs",
        "2",
        "--busy-decode-fraction",
        "0.5",
        "--busy-prefill-fraction",
        "0.5",
    ]);
    let tokens: Vec<u32> = (1..=17).collect();
    let held = capture_batch(&[1001, 1002, 1003, 1004], &tokens[..16], None, None);
    // The capture's engine addresses → ours.
    let mut engines: HashMap<String, FakeEngine> = HashMap::new();
    let mut report = Vec::new();
    let (mut compared, mut deviations_seen) = (0, 0);
    for ex in doc["exchanges"].as_array().expect("exchanges") {
        let name = ex["name"].as_str().expect("name");
        let path = ex["path"].as_str().expect("path");
        let target = if name.starts_with("no_ttl_") {
            &no_ttl
        } else {
            &ttl
        };
        let pause = capture_pause_before(name);
        if pause > 0.0 {
            target.state.advance_clock(Duration::from_secs_f64(pause));
        }
        let mut request = ex["request"].clone();
        swap_engine_endpoint(&mut engines, &mut request).await;
        let method =
            Method::from_bytes(ex["method"].as_str().expect("method").as_bytes()).expect("method");
        let body = (!request.is_null()).then_some(request.clone());
        let reply = target.call(method, path, body).await;
        if name.ends_with("upsert_worker_1") {
            // The capture's engine stored the prompt's blocks on worker 1 before going on.
            let engine = engines
                .get_mut(ex["request"]["kv_events_endpoint"].as_str().expect("addr"))
                .expect("engine");
            publish_until_held(target, engine, &held, &tokens, 1, 4).await;
        }
        let want = ex["status"].as_u64().expect("status") as u16;
        let theirs = &ex["response"];
        let ours = &reply.body;
        let problem = if reply.status.as_u16() != want {
            Some(format!(
                "status {} (Dynamo {want}): {}",
                reply.status, reply.text
            ))
        } else if want >= 400 {
            let strip = |m: &str| m.split(" at line ").next().unwrap_or("").to_string();
            let (t, o) = (
                strip(theirs["error"].as_str().unwrap_or("")),
                strip(ours["error"].as_str().unwrap_or("")),
            );
            (t != o).then(|| format!("message {o:?} (Dynamo {t:?})"))
        } else if path == "/select" || path == "/select_and_reserve" || path == "/reservations" {
            let pick = |v: &Value| (v["worker_id"].clone(), v["dp_rank"].clone());
            (pick(ours) != pick(theirs)).then(|| {
                format!(
                    "worker {} rank {} (Dynamo worker {} rank {})",
                    ours["worker_id"], ours["dp_rank"], theirs["worker_id"], theirs["dp_rank"]
                )
            })
        } else if path.starts_with("/workers") {
            (ours["lifecycle"] != theirs["lifecycle"]).then(|| {
                format!(
                    "lifecycle {} (Dynamo {})",
                    ours["lifecycle"], theirs["lifecycle"]
                )
            })
        } else {
            None
        };
        compared += 1;
        if let Some(problem) = problem {
            if SESSION_DEVIATIONS.iter().any(|(n, _)| *n == name) {
                deviations_seen += 1;
            } else {
                report.push(format!("{name}: {problem}"));
            }
        }
        // Responses never carry session fields.
        for field in ["session_id", "session_context", "affinity_target"] {
            assert!(ours.get(field).is_none(), "{name}: {field} echoed");
        }
        for id in capture_frees_after(name) {
            target.delete(&format!("/reservations/{id}")).await;
        }
    }
    assert_eq!(compared, 129);
    assert!(
        report.is_empty(),
        "differences from Dynamo's session exchanges:\n{}",
        report.join("\n")
    );
    assert_eq!(deviations_seen, SESSION_DEVIATIONS.len());
}
