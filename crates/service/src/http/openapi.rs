//! The OpenAPI 3 description served at `/openapi.json`.

use serde_json::{Value, json};

fn body(schema: Value) -> Value {
    json!({"required": true, "content": {"application/json": {"schema": schema}}})
}

fn reply(description: &str) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": {"type": "object"}}}})
}

fn errors() -> Value {
    json!({"description": "Error: `{\"error\": \"<message>\"}` (400, 404, 409, 413, 415, 422, 429, 503)",
           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
}

fn op(summary: &str, request: Option<&str>, ok: &str, ok_code: &str) -> Value {
    let mut o = json!({
        "summary": summary,
        "responses": {ok_code: reply(ok), "default": errors()},
    });
    if let (Some(schema), Some(obj)) = (request, o.as_object_mut()) {
        obj.insert(
            "requestBody".into(),
            body(json!({"$ref": format!("#/components/schemas/{schema}")})),
        );
    }
    o
}

/// The document.
pub fn document() -> Value {
    let id = |name: &str| json!([{"name": name, "in": "path", "required": true, "schema": {"type": "string"}}]);
    let partition_query = json!([
        {"name": "model_name", "in": "query", "schema": {"type": "string"}},
        {"name": "routing_group", "in": "query", "schema": {"type": "string"}}
    ]);
    let u32s = json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 4294967295u64}});
    let hashes = json!({"type": "array", "items": {"type": "integer", "description": "64-bit hash, signed or unsigned"}});
    let prompt = json!({
        "model_name": {"type": "string", "default": "default"},
        "routing_group": {"type": "string", "default": "default", "description": "alias: tenant_id"},
        "token_ids": u32s,
        "block_hashes": hashes,
        "sequence_hashes": hashes,
        "isl_tokens": {"type": "integer", "minimum": 1},
        "lora_name": {"type": "string"},
        "cache_salt": {"type": "string"},
        "router_config_override": {"$ref": "#/components/schemas/RouterConfigOverride"}
    });
    let mut select = prompt.clone();
    let mut reservation = prompt.clone();
    if let Some(s) = select.as_object_mut() {
        s.insert(
            "selection_id".into(),
            json!({"type": "string", "maxLength": 1024}),
        );
        s.insert("reservation_id".into(), json!({"type": "string", "maxLength": 1024, "description": "select_and_reserve only: the booking id (default: selection_id, else a UUID)"}));
        s.insert(
            "expected_output_tokens".into(),
            json!({"type": "integer", "minimum": 0}),
        );
        s.insert("pinned_worker".into(), json!({"type": "object", "required": ["worker_id"], "properties": {"worker_id": {"type": "integer"}, "dp_rank": {"type": "integer"}}}));
        s.insert(
            "allowed_worker_ids".into(),
            json!({"type": "array", "items": {"type": "integer"}}),
        );
        s.insert(
            "advisory".into(),
            json!({"type": "boolean", "default": false}),
        );
    }
    if let Some(r) = reservation.as_object_mut() {
        r.insert("selection_id".into(), json!({"type": "string", "maxLength": 1024, "description": "Replay form: the selection to book. Every prompt, dp_rank, effective_prefill_tokens and expected_output_tokens field is IGNORED on replay: the cached selection wins."}));
        r.insert("reservation_id".into(), json!({"type": "string", "maxLength": 1024, "description": "The booking id used by lifecycle calls (default: selection_id)"}));
        r.insert("worker_id".into(), json!({"type": "integer", "description": "Explicit form: book this worker with the prompt; discards any cached selection of the same id"}));
        r.insert("dp_rank".into(), json!({"type": "integer", "description": "Explicit form; default the worker's first rank"}));
        r.insert("effective_prefill_tokens".into(), json!({"type": "integer", "description": "Explicit form; ≤ isl; default computed from the index"}));
        r.insert("expected_output_tokens".into(), json!({"type": "integer"}));
        r.insert("track_prefill_tokens".into(), json!({"type": "boolean"}));
    }
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "kvroute selection service",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "KV-cache-aware worker selection, wire-compatible with Dynamo's selection service. Errors are {\"error\": message}."
        },
        "paths": {
            "/workers": {
                "post": op("Register or update a worker", Some("Worker"), "The worker record", "201"),
                "get": {"summary": "List workers", "parameters": partition_query, "responses": {"200": reply("Worker records")}}
            },
            "/workers/{worker_id}": {
                "parameters": id("worker_id"),
                "patch": op("Update some fields of a worker", Some("Worker"), "The worker record", "200"),
                "delete": op("Delete a worker (frees its reservations)", None, "The record, lifecycle unschedulable", "200")
            },
            "/select": {"post": op("Choose a worker; books nothing. With selection_id the booking inputs are cached for a replay.", Some("Select"), "The selection", "200")},
            "/select_and_reserve": {"post": op("Choose and book atomically", Some("Select"), "The selection and its booking", "200")},
            "/reservations": {"post": op("Book load: replay a cached selection (selection_id) or book explicitly (worker_id + prompt)", Some("Reservation"), "The reservation", "201")},
            "/reservations/{reservation_id}/prefill_complete": {"parameters": id("reservation_id"), "post": op("Prefill finished (idempotent)", None, "{\"status\":\"ok\"}", "200")},
            "/reservations/{reservation_id}/output_block": {"parameters": id("reservation_id"), "post": op("One more output block; optional body {\"decay_fraction\": f}", Some("OutputBlock"), "{\"status\":\"ok\"}", "200")},
            "/reservations/{reservation_id}": {"parameters": id("reservation_id"), "delete": op("Free a reservation", None, "{\"status\":\"ok\"}", "200")},
            "/overlap_scores": {"post": op("Every schedulable rank's overlap with a prompt, in blocks", Some("Prompt"), "Overlap scores", "200")},
            "/potential_loads": {"post": op("Every schedulable rank's load if the prompt were booked there", Some("Prompt"), "Loads", "200")},
            "/loads": {"get": {"summary": "Active load per rank and partition", "parameters": partition_query, "responses": {"200": reply("Loads")}}},
            "/ready": {"get": {"summary": "200 when at least one worker is schedulable, else 503", "responses": {"200": reply("Ready"), "503": reply("Not ready")}}},
            "/health": {"get": {"summary": "Liveness", "responses": {"200": reply("{\"status\":\"ok\"}")}}},
            "/dump": {"get": {"summary": "The index as stored events, per partition", "responses": {"200": reply("Dump")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text exposition"}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": reply("OpenAPI")}}}
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "Only when the service runs with --api-key; /health, /ready and /metrics are open"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
                "RouterConfigOverride": {"type": "object", "properties": {
                    "overlap_score_credit": {"type": "number"}, "prefill_load_scale": {"type": "number"},
                    "router_temperature": {"type": "number"}, "track_prefill_tokens": {"type": "boolean"}}},
                "Prompt": {"type": "object", "properties": prompt},
                "Select": {"type": "object", "properties": select},
                "Reservation": {"type": "object", "properties": reservation},
                "OutputBlock": {"type": "object", "properties": {"decay_fraction": {"type": "number", "minimum": 0, "maximum": 1}}},
                "Worker": {"type": "object", "required": ["worker_id"], "properties": {
                    "worker_id": {"type": "integer", "minimum": 0},
                    "model_name": {"type": "string", "default": "default"},
                    "routing_group": {"type": "string", "default": "default"},
                    "endpoint": {"type": "string"},
                    "block_size": {"type": "integer", "minimum": 1},
                    "data_parallel_start_rank": {"type": "integer", "default": 0},
                    "data_parallel_size": {"type": "integer", "default": 1},
                    "total_kv_blocks": {"type": "integer"},
                    "max_num_batched_tokens": {"type": "integer"},
                    "kv_events_endpoint": {"type": "string", "description": "ZMQ PUB address, e.g. tcp://127.0.0.1:5557"},
                    "kv_events_endpoints": {"type": "object", "additionalProperties": {"type": "string"}, "description": "global dp rank → ZMQ address"},
                    "replay_endpoint": {"type": "string"}}}
            }
        }
    })
}
