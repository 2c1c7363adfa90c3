#!/usr/bin/env python3
"""Record the in-process Python API of Dynamo's selection service (`dynamo.llm.SelectionService`).

Run with the interpreter that has `ai-dynamo-runtime` installed, inside the loopback-only
namespace (run_capture.sh does both): workers registered here get KV-event listeners that
connect to 127.0.0.1 only; the fake engine publisher binds 127.0.0.1.

Output: one JSON file with the class surface (method names, text signatures, docstrings,
sync/async) and a list of calls `{"name", "method", "args", "kwargs", "style", "result"}` or
`{..., "exception": {"type", "mro", "message", "kind", "status_code", "attributes"}}`.
"""

import argparse
import asyncio
import importlib.metadata
import inspect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_engine import FakeEnginePublisher, block_stored  # noqa: E402

from dynamo._core import SelectionCacheConfig  # noqa: E402
from dynamo.llm import SelectionService  # noqa: E402
from dynamo.llm.exceptions import SelectionServiceError  # noqa: E402

TOKENS_17 = list(range(1, 18))
HOST = "127.0.0.1"


def has_non_str_keys(obj):
    if isinstance(obj, dict):
        return any(not isinstance(k, str) for k in obj) or any(has_non_str_keys(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_non_str_keys(v) for v in obj)
    return False


class Recorder:
    def __init__(self, svc):
        self.svc = svc
        self.calls = []

    async def call(self, name, method, *args, note=None, **kwargs):
        entry = {"name": name, "method": method, "args": list(args), "kwargs": kwargs}
        if note:
            entry["note"] = note
        fn = getattr(self.svc, method)
        try:
            out = fn(*args, **kwargs)
            if inspect.isawaitable(out):
                entry["style"] = f"async (returns {type(out).__module__}.{type(out).__name__})"
                out = await out
            else:
                entry["style"] = "sync"
            entry["result_type"] = type(out).__name__
            entry["result"] = out
            if has_non_str_keys(out):
                entry["result_repr"] = repr(out)
        except BaseException as exc:  # noqa: BLE001 - we record everything
            if "style" not in entry:
                entry["style"] = "raised synchronously"
            entry["exception"] = {
                "type": f"{type(exc).__module__}.{type(exc).__name__}",
                "mro": [f"{c.__module__}.{c.__name__}" for c in type(exc).__mro__],
                "message": str(exc),
                "args": [repr(a) for a in exc.args],
                "kind": getattr(exc, "kind", None),
                "status_code": getattr(exc, "status_code", None),
                "attributes": sorted(a for a in dir(exc) if not a.startswith("_")),
            }
        self.calls.append(entry)
        return entry.get("result")


def surface():
    methods = {}
    for name in sorted(dir(SelectionService)):
        if name.startswith("__"):
            continue
        attr = getattr(SelectionService, name)
        methods[name] = {
            "text_signature": getattr(attr, "__text_signature__", None),
            "doc": (getattr(attr, "__doc__", None) or "").strip() or None,
        }
    return {
        "module_paths": {
            "SelectionService": "dynamo.llm.SelectionService (defined in dynamo._core)",
            "SelectionServiceError": "dynamo.llm.exceptions.SelectionServiceError (dynamo._core)",
            "SelectionCacheConfig": "dynamo._core.SelectionCacheConfig (not re-exported by dynamo.llm)",
        },
        "SelectionService": {
            "doc": SelectionService.__doc__,
            "init_text_signature": SelectionService.__text_signature__
            if hasattr(SelectionService, "__text_signature__") else None,
            "init_doc": SelectionService.__init__.__doc__,
            "methods": methods,
        },
        "SelectionServiceError": {
            "mro": [f"{c.__module__}.{c.__name__}" for c in SelectionServiceError.__mro__],
            "doc": SelectionServiceError.__doc__,
        },
        "SelectionCacheConfig": {
            "text_signature": getattr(SelectionCacheConfig, "__text_signature__", None),
            "doc": SelectionCacheConfig.__doc__,
            "attributes": sorted(a for a in dir(SelectionCacheConfig) if not a.startswith("_")),
        },
    }


async def exercise(zmq_port):
    pub = FakeEnginePublisher(zmq_port)
    svc = SelectionService(indexer_threads=2,
                           selection_cache=SelectionCacheConfig(ttl_secs=60.0, max_entries=100))
    r = Recorder(svc)
    try:
        await r.call("ready_empty", "ready")
        await r.call("select_no_workers", "select", {"token_ids": TOKENS_17})
        await r.call("upsert_worker_without_kv_events", "upsert_worker",
                     {"worker_id": 1, "endpoint": "http://worker-1:8000", "block_size": 4})
        await r.call("upsert_worker_with_kv_events", "upsert_worker", {
            "worker_id": 2, "endpoint": "http://worker-2:8000", "block_size": 4,
            "kv_events_endpoint": f"tcp://{HOST}:{zmq_port}"})
        await r.call("upsert_worker_bad_type", "upsert_worker", {"worker_id": "x"})
        await r.call("upsert_worker_not_a_dict", "upsert_worker", "not a dict")
        await r.call("upsert_worker_json_string", "upsert_worker",
                     json.dumps({"worker_id": 3, "endpoint": "http://w3", "block_size": 4}))
        if pub.wait_subscribed(10):
            pub.publish([block_stored([1001, 1002], None, TOKENS_17[:8], 4, "GPU")])
            time.sleep(0.5)
        await r.call("list_workers", "list_workers")
        await r.call("list_workers_filtered", "list_workers", model_name="default", routing_group="default")
        await r.call("ready", "ready")
        await r.call("patch_worker", "patch_worker", 2, {"total_kv_blocks": 64})
        await r.call("patch_unknown_worker", "patch_worker", 99, {"total_kv_blocks": 64})
        await r.call("overlap_scores", "overlap_scores", {"token_ids": TOKENS_17})
        await r.call("potential_loads", "potential_loads", {"token_ids": TOKENS_17})
        await r.call("select", "select", {"token_ids": TOKENS_17})
        await r.call("select_advisory", "select", {"token_ids": TOKENS_17, "advisory": True})
        await r.call("select_empty_token_ids", "select", {"token_ids": []})
        await r.call("select_missing_prompt", "select", {})
        await r.call("select_bad_type", "select", {"token_ids": "abc"})
        await r.call("select_mismatched_hashes", "select",
                     {"block_hashes": [1, 2], "sequence_hashes": [1], "isl_tokens": 8})
        await r.call("select_pinned_unavailable", "select",
                     {"token_ids": TOKENS_17, "pinned_worker": {"worker_id": 9, "dp_rank": 0}})
        await r.call("select_other_model", "select", {"token_ids": TOKENS_17, "model_name": "nope"})
        await r.call("select_with_selection_id", "select", {"token_ids": TOKENS_17, "selection_id": "p-1"})
        await r.call("create_reservation_replay", "create_reservation", {"selection_id": "p-1"})
        await r.call("create_reservation_replay_again", "create_reservation", {"selection_id": "p-1"})
        await r.call("create_reservation_explicit", "create_reservation",
                     {"selection_id": "p-2", "worker_id": 2, "token_ids": TOKENS_17})
        await r.call("create_reservation_duplicate", "create_reservation",
                     {"selection_id": "p-2", "worker_id": 2, "token_ids": TOKENS_17})
        await r.call("create_reservation_missing_selection_id", "create_reservation",
                     {"worker_id": 2, "token_ids": TOKENS_17})
        await r.call("create_reservation_eff_gt_isl", "create_reservation", {
            "selection_id": "p-3", "worker_id": 2, "token_ids": TOKENS_17, "effective_prefill_tokens": 99})
        await r.call("select_and_reserve", "select_and_reserve", {"token_ids": TOKENS_17, "selection_id": "p-4"})
        await r.call("select_and_reserve_generated_id", "select_and_reserve", {"token_ids": TOKENS_17})
        await r.call("loads", "loads")
        await r.call("loads_filtered", "loads", model_name="default")
        await r.call("prefill_complete", "prefill_complete", "p-4")
        await r.call("prefill_complete_unknown", "prefill_complete", "nope")
        await r.call("add_output_block", "add_output_block", "p-4")
        await r.call("add_output_block_decay", "add_output_block", "p-4", decay_fraction=0.5)
        await r.call("add_output_block_bad_decay", "add_output_block", "p-4", decay_fraction=2.0)
        await r.call("add_output_block_unknown", "add_output_block", "nope")
        await r.call("free_reservation", "free_reservation", "p-4")
        await r.call("free_reservation_again", "free_reservation", "p-4")
        await r.call("indexer_snapshot", "indexer_snapshot")
        await r.call("list_replica_peers", "list_replica_peers")
        await r.call("register_replica_peer_disabled", "register_replica_peer", f"tcp://{HOST}:{zmq_port + 1}")
        await r.call("delete_worker", "delete_worker", 2)
        await r.call("delete_unknown_worker", "delete_worker", 99)
        await r.call("shutdown", "shutdown")
        await r.call("select_after_shutdown", "select", {"token_ids": TOKENS_17})
        await r.call("upsert_after_shutdown", "upsert_worker",
                     {"worker_id": 5, "endpoint": "http://w5", "block_size": 4})
        await r.call("ready_after_shutdown", "ready")
        await r.call("shutdown_again", "shutdown")
        await r.call("shutdown_async", "shutdown_async")
    finally:
        pub.close()
    return r.calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--zmq-port", type=int, default=26557)
    args = ap.parse_args()
    if sorted(os.listdir("/sys/class/net")) != ["lo"]:
        sys.exit("refusing to run outside a loopback-only network namespace (see run_capture.sh)")
    calls = asyncio.run(exercise(args.zmq_port))
    doc = {
        "dynamo_version": importlib.metadata.version("ai-dynamo-runtime"),
        "surface": surface(),
        "calls": calls,
    }
    with open(args.out, "w") as f:
        f.write("{\n")
        f.write(f' "dynamo_version": {json.dumps(doc["dynamo_version"])},\n')
        f.write(' "surface": ' + json.dumps(doc["surface"], indent=1).replace("\n", "\n ") + ",\n")
        f.write(' "calls": [\n')
        for i, c in enumerate(calls):
            sep = "," if i + 1 < len(calls) else ""
            f.write("  " + json.dumps(c, separators=(",", ":"), default=repr) + sep + "\n")
        f.write(" ]\n}\n")
    print(f"{len(calls)} calls -> {args.out}")


if __name__ == "__main__":
    main()
