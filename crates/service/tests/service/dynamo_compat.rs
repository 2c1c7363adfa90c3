//! Wire compatibility with Dynamo's selection service: every exchange recorded from the real
//! Dynamo 1.6.1 service (tests/fixtures/dynamo, captured by bench/dynamo/capture.py) is replayed
//! against kvroute in order. kvroute must answer with the same status and a body with at least
//! the same fields of the same JSON types — except where SPEC §7.8 (or the issue) makes kvroute
//! differ on purpose; those exchanges are listed in `DEVIATIONS` with the reason. The service
//! runs with `--router-profile dynamo`, Dynamo's weights and effective-prefill formula.

use crate::common::TestApp;
use axum::http::Method;
use kvroute_service::ServeConfig;
use serde_json::Value;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
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
