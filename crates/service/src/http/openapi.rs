//! The OpenAPI 3 description served at `/openapi.json`. Its tests hold it to the service: every
//! route of [`super::ENDPOINTS`], every field of the request types and every key of the responses
//! the handlers build.

use serde_json::{Value, json};

#[cfg(test)]
mod tests;

fn body(schema: Value) -> Value {
    json!({"required": true, "content": {"application/json": {"schema": schema}}})
}

/// A reference to a schema of the document.
fn schema(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

fn array_of(name: &str) -> Value {
    json!({"type": "array", "items": schema(name)})
}

fn reply(description: &str, schema: Value) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": schema}}})
}

fn errors() -> Value {
    json!({"description": "Error: `{\"error\": \"<message>\"}` (400, 404, 408, 409, 413, 415, 422, 429, 503)",
           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
}

/// An operation: its request body's schema, its success status and response.
fn op(summary: &str, request: Option<&str>, ok_code: &str, ok: Value) -> Value {
    let mut o = json!({
        "summary": summary,
        "responses": {ok_code: ok, "default": errors()},
    });
    if let (Some(name), Some(obj)) = (request, o.as_object_mut()) {
        obj.insert("requestBody".into(), body(schema(name)));
    }
    o
}

/// The properties of a schema (an object's), to extend.
fn with(mut base: Value, extra: Value) -> Value {
    if let (Some(b), Value::Object(extra)) = (base.as_object_mut(), extra) {
        b.extend(extra);
    }
    base
}

/// An object schema with these properties.
fn object(properties: Value) -> Value {
    json!({"type": "object", "properties": properties})
}

/// The response schemas: what the handlers build (`crate::types`, `crate::api`).
fn response_schemas() -> Value {
    let int = json!({"type": "integer"});
    let string = json!({"type": "string"});
    let boolean = json!({"type": "boolean"});
    let unused = |what: &str| json!({"nullable": true, "description": format!("Dynamo field kvroute does not use: always {what}")});
    let anything = json!({"type": "object", "additionalProperties": true});
    let worker = object(json!({
        "worker_id": int, "model_name": string, "routing_group": string,
        "lifecycle": {"type": "string", "enum": ["schedulable", "incomplete", "unschedulable"]},
        "not_schedulable_reasons": {"type": "array", "items": string, "description": "when not schedulable"},
        "endpoint": string, "kv_events_endpoint": string,
        "kv_events_endpoints": {"type": "object", "additionalProperties": string, "description": "global dp rank → ZMQ address, when registered so"},
        "replay_endpoint": string, "block_size": int,
        "data_parallel_start_rank": int, "data_parallel_size": int,
        "max_num_batched_tokens": int, "total_kv_blocks": int,
        "stable_routing_id": unused("null"), "is_eagle": unused("null"),
        "taints": {"type": "array", "items": string, "description": "sorted"},
        "topology_domains": {"type": "object", "additionalProperties": string},
        "kv_transfer_domain": {"type": "string", "nullable": true},
        "kv_transfer_enforcement": {"type": "string", "enum": ["required", "preferred"], "nullable": true},
        "kv_transfer_preferred_weight": {"type": "number", "nullable": true},
        "role": {"type": "string", "enum": ["prefill", "decode"], "description": "kvroute's: only when not `both`"},
        "bootstrap_port": {"type": "integer", "description": "kvroute's: when registered"}
    }));
    let overlap = object(json!({
        "longest_matched": int, "gpu": int, "cpu": int, "disk": int,
        "dp": {"type": "object", "additionalProperties": int, "description": "dp rank → matched device blocks"}
    }));
    let worker_load = with(
        object(
            json!({"active_prefill_tokens": int, "prefill_token_capacity": int, "total_kv_blocks": int}),
        ),
        json!({"description": "advisory selections only"}),
    );
    let selection = json!({
        "model_name": string, "routing_group": string,
        "worker_id": int, "dp_rank": int, "endpoint": string, "block_size": int,
        "overlap": overlap, "effective_prefill_tokens": int, "potential_decode_blocks": int,
        "selection_id": {"type": "string", "description": "when the request gave one"},
        "worker_load": worker_load
    });
    let booked = with(
        selection.clone(),
        json!({
            "reservation_id": string,
            "sequence_hashes": {"type": "array", "items": {"type": "integer", "description": "signed 64-bit"}},
            "isl_tokens": int, "track_prefill_tokens": boolean
        }),
    );
    let cache_model = with(
        object(json!({
            "policy": {"type": "string", "enum": ["events", "ttl", "lru"]},
            "predicted_blocks": int, "capacity_blocks": int, "resident_blocks": int,
            "active_blocks": int, "inactive_blocks": int, "overcapacity_blocks": int,
            "indexed_blocks": int, "leases": int
        })),
        json!({"description": "How the rank's cache is known: from KV events, or predicted (ttl: predicted_blocks; lru: the other counts)"}),
    );
    let overlap_scores = object(json!({
        "block_size": int, "num_blocks": int,
        "workers": {"type": "array", "items": object(json!({
            "worker_id": int, "dp_rank": int, "device_blocks": int,
            "host_pinned_blocks": int, "disk_blocks": int,
            "host_pinned_extension_blocks": int, "disk_extension_blocks": int,
            "shared_beyond_device_blocks": unused("null")
        }))},
        "shared_cache": with(
            object(json!({
                "enabled": boolean, "total_hit_blocks": int,
                "ranges": {"type": "array", "items": anything}, "error": unused("null")
            })),
            json!({"description": "Dynamo's shared cache: always disabled"}),
        )
    }));
    let block =
        object(json!({"block_hash": int, "tokens_hash": int, "mm_extra_info": unused("null")}));
    let stored = object(json!({
        "parent_hash": int, "start_position": unused("null"),
        "blocks": {"type": "array", "items": block}
    }));
    let event = object(json!({
        "event_id": int, "dp_rank": int, "data": object(json!({"stored": stored}))
    }));
    let dump_event = object(json!({
        "worker_id": int, "dp_rank": int,
        "storage_tier": {"type": "string", "enum": ["device", "host_pinned", "disk"]},
        "residency_domain": {"type": "string", "enum": ["worker"]},
        "event": event
    }));
    let partition_dump = object(json!({
        "block_size": int, "events": {"type": "array", "items": dump_event}
    }));
    json!({
        "Status": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string", "enum": ["ok"]}}},
        "WorkerRecord": worker,
        "Ready": object(json!({"ready": boolean, "schedulable_workers": int, "workers": array_of("WorkerRecord")})),
        "Selection": object(selection),
        "SelectionAndReservation": object(booked.clone()),
        "Disaggregated": with(
            object(json!({
                "disaggregated": {"type": "boolean", "enum": [true]},
                "bypass": {"type": "string", "nullable": true, "enum": ["small_uncached", "prefill_saturated", "no_prefill_workers"], "description": "why the request runs whole on the decode pick (prefill is then null)"},
                "prefill": with(object(with(booked.clone(), json!({"bootstrap_port": {"type": "integer", "nullable": true}}))), json!({"nullable": true, "description": "the prefill leg; reservation fields with /select_and_reserve only; selection_id <id>.prefill"})),
                "decode": with(object(booked), json!({"description": "the decode leg (or the whole request with a bypass); reservation fields with /select_and_reserve only; selection_id <id>.decode"}))
            })),
            json!({"description": "The answer of /select and /select_and_reserve with \"disaggregated\": true (SPEC §6.1)"}),
        ),
        "ReservationRecord": object(json!({
            "reservation_id": string, "selection_id": string, "model_name": string,
            "routing_group": string, "worker_id": int, "dp_rank": int, "endpoint": string
        })),
        "RankLoad": object(json!({
            "worker_id": int, "dp_rank": int, "potential_prefill_tokens": int,
            "potential_decode_blocks": int, "active_requests": int,
            "cache_model": {"allOf": [schema("CacheModel")], "description": "/loads only"},
            "degraded": {
                "type": "array",
                "description": "/loads only, and only while the worker's routing is degraded: each reason (no_kv_events, block_size_mismatch, tokenizer_mismatch, cache_mismatch) with a sentence naming what to fix",
                "items": object(json!({"reason": string, "message": string}))
            }
        })),
        "CacheModel": cache_model,
        "PartitionLoads": object(json!({
            "model_name": string, "routing_group": string, "loads": array_of("RankLoad"),
            "pending_count": int, "pending_isl_tokens": int
        })),
        "OverlapScores": overlap_scores,
        "Dump": {
            "type": "object",
            "description": "\"{model_name}:{routing_group}\" → the partition's blocks as stored events",
            "additionalProperties": partition_dump
        }
    })
}

/// The document.
pub fn document() -> Value {
    let id = |name: &str| json!([{"name": name, "in": "path", "required": true, "schema": {"type": "string"}}]);
    let partition_query = json!([
        {"name": "model_name", "in": "query", "schema": {"type": "string"}},
        {"name": "routing_group", "in": "query", "schema": {"type": "string"}},
        {"name": "tenant_id", "in": "query", "schema": {"type": "string"}, "description": "alias of routing_group"}
    ]);
    let u32s = json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 4294967295u64}});
    let hashes = json!({"type": "array", "items": {"type": "integer", "description": "64-bit hash, signed or unsigned"}});
    let prompt = json!({
        "model_name": {"type": "string", "default": "default"},
        "routing_group": {"type": "string", "default": "default", "description": "alias: tenant_id"},
        "tenant_id": {"type": "string", "description": "alias of routing_group"},
        "token_ids": u32s,
        "block_hashes": hashes,
        "sequence_hashes": hashes,
        "isl_tokens": {"type": "integer", "minimum": 1},
        "lora_name": {"type": "string"},
        "cache_salt": {"type": "string"},
        "block_mm_infos": {"type": "array", "items": schema("BlockMmInfo"), "description": "Per block of token_ids, null or its multimodal objects; their mm_hash values enter the block's hash"},
        "mm_routing_info": {"type": "object", "required": ["routing_token_ids"], "description": "When routing_token_ids is not empty, the prompt is routed on these tokens and infos instead of token_ids and block_mm_infos", "properties": {
            "routing_token_ids": u32s,
            "block_mm_infos": {"type": "array", "items": schema("BlockMmInfo"), "default": []}}},
        "is_eagle": {"type": "boolean", "default": false, "description": "Eagle speculative decoding: each block's hash also covers the next token. Default false (Dynamo defaults to the partition's workers' is_eagle, which kvroute does not read)"},
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
        s.insert("routing_constraints".into(), json!({"type": "object", "description": "Worker taints to require and to prefer (select and select_and_reserve). None left after required_taints → 503. A worker's cost is multiplied by exp(−tanh(sum of the weights of the preferred taints it carries)).", "properties": {
            "required_taints": {"type": "array", "items": {"type": "string"}, "default": [], "description": "a worker must carry every one"},
            "preferred_taints": {"type": "object", "additionalProperties": {"type": "number"}, "default": {}, "description": "taint → signed weight: positive prefers the workers carrying it, negative avoids them"}}}));
        s.insert(
            "advisory".into(),
            json!({"type": "boolean", "default": false}),
        );
        s.insert("session_id".into(), json!({"type": "string", "nullable": true, "maxLength": 256, "description": "With --session-affinity-ttl-secs: the request's session; a booking binds it to the chosen rank, later requests of the session go there (ignored without the flag)"}));
        s.insert("session_context".into(), schema("SessionContext"));
        s.insert("affinity_target".into(), json!({"type": "object", "required": ["worker_id"], "description": "A worker (and rank) preferred over any load, and over a bound session; ignored when not schedulable here", "properties": {"worker_id": {"type": "integer"}, "dp_rank": {"type": "integer"}}}));
        s.insert("priority_jump".into(), json!({"type": "number", "nullable": true, "description": "With --queue-threshold: seconds to move ahead in the admission queue (below 0 counts as 0). The request's tenant is its x-tenant-id header."}));
        s.insert("strict_priority".into(), json!({"type": "integer", "minimum": 0, "maximum": 4294967295u64, "nullable": true, "description": "With --queue-threshold: higher goes first in the admission queue, before any other order"}));
        s.insert("disaggregated".into(), json!({"type": "boolean", "default": false, "description": "kvroute's: pick a prefill worker (role prefill) and a decode worker (role decode or both), or one worker for the whole request when little is uncached on it (--pd-bypass-tokens) or no prefill worker is free; answers Disaggregated; never queued; not with pinned_worker (SPEC §6.1)"}));
        s.insert("decode_runs_whole".into(), json!({"type": "boolean", "default": true, "description": "kvroute's: whether a decode worker may run the request whole (a plain select, a bypass); false for SGLang decode engines, which need a prefill peer (SPEC §6.1)"}));
        s.insert("queue_timeout_ms".into(), json!({"type": "integer", "minimum": 1, "maximum": 86400000, "nullable": true, "description": "With --queue-threshold: the longest this request waits in the admission queue (default --queue-timeout-ms); 429 beyond"}));
    }
    if let Some(r) = reservation.as_object_mut() {
        r.insert("selection_id".into(), json!({"type": "string", "maxLength": 1024, "description": "Replay form: the selection to book. Every prompt, dp_rank, effective_prefill_tokens and expected_output_tokens field is IGNORED on replay: the cached selection wins."}));
        r.insert("reservation_id".into(), json!({"type": "string", "maxLength": 1024, "description": "The booking id used by lifecycle calls (default: selection_id)"}));
        r.insert("worker_id".into(), json!({"type": "integer", "description": "Explicit form: book this worker with the prompt; discards any cached selection of the same id"}));
        r.insert("dp_rank".into(), json!({"type": "integer", "description": "Explicit form; default the worker's first rank"}));
        r.insert("effective_prefill_tokens".into(), json!({"type": "integer", "description": "Explicit form; ≤ isl; default computed from the index"}));
        r.insert("expected_output_tokens".into(), json!({"type": "integer"}));
        r.insert("track_prefill_tokens".into(), json!({"type": "boolean"}));
        r.insert("session_id".into(), json!({"type": "string", "nullable": true, "maxLength": 256, "description": "Explicit form, with --session-affinity-ttl-secs: the booking's session, bound to the booked rank unless already bound to an available one (a replay books its selection's session)"}));
        r.insert("session_context".into(), schema("SessionContext"));
    }
    let either = |plain: &str| json!({"oneOf": [schema(plain), schema("Disaggregated")]});
    let select_reply = reply(
        "The selection (Disaggregated with \"disaggregated\": true)",
        either("Selection"),
    );
    let booked_reply = reply(
        "The selection and its booking (Disaggregated, both legs booked, with \"disaggregated\": true)",
        either("SelectionAndReservation"),
    );
    let mut doc = json!({
        "openapi": "3.0.3",
        "info": {
            "title": "kvroute selection service",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "KV-cache-aware worker selection, wire-compatible with Dynamo's selection service. Errors are {\"error\": message}."
        },
        "paths": {
            "/workers": {
                "post": op("Register or update a worker", Some("Worker"), "201", reply("The worker record", schema("WorkerRecord"))),
                "get": {"summary": "List workers", "parameters": partition_query, "responses": {"200": reply("Worker records", array_of("WorkerRecord"))}}
            },
            "/workers/{worker_id}": {
                "parameters": id("worker_id"),
                "patch": op("Update some fields of a worker", Some("Worker"), "200", reply("The worker record", schema("WorkerRecord"))),
                "delete": op("Delete a worker (frees its reservations)", None, "200", reply("The record, lifecycle unschedulable", schema("WorkerRecord")))
            },
            "/select": {"post": op("Choose a worker; books nothing. With selection_id the booking inputs are cached for a replay.", Some("Select"), "200", select_reply)},
            "/select_and_reserve": {"post": op("Choose and book atomically", Some("Select"), "200", booked_reply)},
            "/reservations": {"post": op("Book load: replay a cached selection (selection_id) or book explicitly (worker_id + prompt)", Some("Reservation"), "201", reply("The reservation", schema("ReservationRecord")))},
            "/reservations/{reservation_id}/prefill_complete": {"parameters": id("reservation_id"), "post": op("Prefill finished (idempotent)", None, "200", reply("{\"status\":\"ok\"}", schema("Status")))},
            "/reservations/{reservation_id}/output_block": {"parameters": id("reservation_id"), "post": op("One more output block; optional body {\"decay_fraction\": f}", Some("OutputBlock"), "200", reply("{\"status\":\"ok\"}", schema("Status")))},
            "/reservations/{reservation_id}": {"parameters": id("reservation_id"), "delete": op("Free a reservation", None, "200", reply("{\"status\":\"ok\"}", schema("Status")))},
            "/overlap_scores": {"post": op("Every schedulable rank's overlap with a prompt, in blocks", Some("Prompt"), "200", reply("Overlap scores", schema("OverlapScores")))},
            "/potential_loads": {"post": op("Every schedulable rank's load if the prompt were booked there", Some("Prompt"), "200", reply("Loads", array_of("RankLoad")))},
            "/loads": {"get": {"summary": "Active load per rank and partition", "parameters": partition_query, "responses": {"200": reply("Loads", array_of("PartitionLoads"))}}},
            "/ready": {"get": {"summary": "200 when at least one worker is schedulable, else 503", "responses": {"200": reply("Ready", schema("Ready")), "503": reply("Not ready", schema("Ready"))}}},
            "/health": {"get": {"summary": "Liveness", "responses": {"200": reply("{\"status\":\"ok\"}", schema("Status"))}}},
            "/dump": {"get": {"summary": "The index as stored events, per partition", "responses": {"200": reply("Dump", schema("Dump"))}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": reply("OpenAPI", json!({"type": "object", "additionalProperties": true}))}}},
            "/dashboard": {"get": {"summary": "The status page: one self-contained HTML page that polls /loads and /metrics. Behind --api-key like the other routes; its 401 asks the browser for the key (WWW-Authenticate: Basic, the key as the password)",
                "responses": {"200": {"description": "HTML page", "content": {"text/html": {"schema": {"type": "string"}}}},
                              "401": {"description": "With --api-key and no key: the login challenge", "headers": {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Basic realm=\"kvroute\""}},
                                      "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}}}
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "Only when the service runs with --api-key; /health, /ready and /metrics are open"},
                                "basic": {"type": "http", "scheme": "basic", "description": "The same key as the password, any user name (what a browser sends for /dashboard)"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
                "RouterConfigOverride": {"type": "object", "properties": {
                    "overlap_score_credit": {"type": "number"}, "prefill_load_scale": {"type": "number"},
                    "router_temperature": {"type": "number"}, "track_prefill_tokens": {"type": "boolean"}}},
                "Prompt": {"type": "object", "properties": prompt},
                "BlockMmInfo": {"type": "object", "nullable": true, "required": ["mm_objects"], "properties": {
                    "mm_objects": {"type": "array", "items": schema("MmObject")}}},
                "MmObject": {"type": "object", "required": ["mm_hash", "offsets"], "properties": {
                    "mm_hash": {"type": "integer", "minimum": 0, "maximum": u64::MAX},
                    "offsets": {"type": "array", "description": "[start, end] token ranges; not hashed",
                                "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0}}}}},
                "SessionContext": {"type": "object", "nullable": true, "required": ["session_id"], "description": "The request's session; its session_id wins over a top-level session_id. The other fields are accepted and unused (as in Dynamo 1.6.1)", "properties": {
                    "session_id": {"type": "string", "maxLength": 256},
                    "parent_session_id": {"type": "string", "nullable": true},
                    "session_final": {"type": "boolean", "nullable": true},
                    "input_trigger": {"type": "string", "nullable": true, "enum": ["user_message", "tool_result", "other"]}}},
                "Select": {"type": "object", "properties": select},
                "Reservation": {"type": "object", "properties": reservation},
                "OutputBlock": {"type": "object", "properties": {"decay_fraction": {"type": "number", "minimum": 0, "maximum": 1}}},
                "Worker": {"type": "object", "required": ["worker_id"], "properties": {
                    "worker_id": {"type": "integer", "minimum": 0},
                    "model_name": {"type": "string", "default": "default"},
                    "routing_group": {"type": "string", "default": "default", "description": "alias: tenant_id"},
                    "tenant_id": {"type": "string", "description": "alias of routing_group"},
                    "endpoint": {"type": "string"},
                    "block_size": {"type": "integer", "minimum": 1},
                    "data_parallel_start_rank": {"type": "integer", "default": 0},
                    "data_parallel_size": {"type": "integer", "default": 1},
                    "total_kv_blocks": {"type": "integer"},
                    "max_num_batched_tokens": {"type": "integer"},
                    "kv_events_endpoint": {"type": "string", "description": "ZMQ PUB address, e.g. tcp://127.0.0.1:5557"},
                    "kv_events_endpoints": {"type": "object", "additionalProperties": {"type": "string"}, "description": "global dp rank → ZMQ address"},
                    "replay_endpoint": {"type": "string"},
                    "taints": {"type": "array", "items": {"type": "string"}, "default": [], "description": "labels routing_constraints match (a set; PATCH replaces it)"},
                    "topology_domains": {"type": "object", "additionalProperties": {"type": "string"}, "default": {}, "description": "domain → value, e.g. {\"zone\": \"a\"}; echoed, not used for routing (not turned into taints)"},
                    "kv_transfer_domain": {"type": "string", "description": "echoed, not used"},
                    "kv_transfer_enforcement": {"type": "string", "enum": ["required", "preferred"], "description": "echoed, not used"},
                    "kv_transfer_preferred_weight": {"type": "number", "description": "echoed, not used"}}}
            }
        }
    });
    if let Some(worker) = doc["components"]["schemas"]["Worker"]["properties"].as_object_mut() {
        worker.insert("role".into(), json!({"type": "string", "enum": ["both", "prefill", "decode"], "default": "both", "description": "kvroute's (SPEC §6.1): prefill workers take only the prefill legs of disaggregated requests; decode and both workers take whole requests and decode legs"}));
        worker.insert("bootstrap_port".into(), json!({"type": "integer", "minimum": 0, "maximum": 65535, "description": "kvroute's: an SGLang prefill worker's bootstrap port, echoed in its prefill picks"}));
    }
    if let (Some(schemas), Value::Object(responses)) = (
        doc["components"]["schemas"].as_object_mut(),
        response_schemas(),
    ) {
        schemas.extend(responses);
    }
    doc
}
