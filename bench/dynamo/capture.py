#!/usr/bin/env python3
"""Capture HTTP request/response fixtures from NVIDIA Dynamo's selection service.

Runs `python -m dynamo.select_service` (PyPI `ai-dynamo-runtime`) once per scenario, exercises
its routes with urllib (stdlib only) and writes one JSON file per scenario: a list of exchanges
`{"name", "method", "path", "request", "status", "response", ...}`.

Dynamo binds 0.0.0.0 with no option to change it, so this script refuses to run unless the
current network namespace has nothing but the loopback interface. Use run_capture.sh, which
creates such a namespace (`ip netns add kvns`) and runs this script inside it. Every URL used
here is http://127.0.0.1:<port>; the fake engine publisher (fake_engine.py) binds 127.0.0.1.

Usage (inside the namespace):
    python3 capture.py --dynamo-python /work/venv-dynamo/bin/python \
        --out crates/service/tests/fixtures/dynamo
"""

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_engine import FakeEnginePublisher, block_removed, block_stored  # noqa: E402

HOST = "127.0.0.1"

# Test vectors from SPEC §2 (tokens 1..=17, block size 4), checked against Dynamo 1.6.1.
TOKENS_17 = list(range(1, 18))
LOCAL_HASHES_U64 = [
    14643705804678351452,
    16777012769546811212,
    483935686894639516,
    135165725823939817,
]
SEQ_HASHES_I64 = [
    -3803038269031200164,
    4945711292740353085,
    -5863151826378895484,
    1921452330601040443,
]


def as_i64(u):
    return u - (1 << 64) if u >= (1 << 63) else u


LOCAL_HASHES_I64 = [as_i64(h) for h in LOCAL_HASHES_U64]
_NO_BODY = object()


def assert_loopback_only_netns():
    ifaces = sorted(os.listdir("/sys/class/net"))
    if ifaces != ["lo"]:
        sys.exit(
            f"refusing to run: network interfaces {ifaces}; run inside a loopback-only "
            "namespace (see run_capture.sh)"
        )


class Recorder:
    def __init__(self, port):
        self.base = f"http://{HOST}:{port}"
        self.exchanges = []

    def call(self, name, method, path, body=_NO_BODY, *, raw=None, content_type="application/json",
             note=None, record_request=True, truncate=None):
        assert path.startswith("/")
        url = self.base + path
        data = None
        headers = {}
        request_field = None
        request_raw = None
        if raw is not None:
            data = raw if isinstance(raw, bytes) else raw.encode()
            if record_request:
                request_raw = data.decode("utf-8", "backslashreplace")
        elif body is not _NO_BODY:
            data = json.dumps(body).encode()
            request_field = body if record_request else None
        if data is not None and content_type is not None:
            headers["content-type"] = content_type
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status = resp.status
                ctype = resp.headers.get("content-type")
                text = resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as err:
            status = err.code
            ctype = err.headers.get("content-type")
            text = err.read().decode("utf-8", "replace")
        try:
            response = json.loads(text) if text else None
        except ValueError:
            response = text
        if truncate is not None and isinstance(response, str) and len(response) > truncate:
            response = response[:truncate] + "...<truncated>"
        entry = {"name": name, "method": method, "path": path, "request": request_field}
        if request_raw is not None:
            entry["request_raw"] = request_raw
        if data is not None and content_type != "application/json":
            entry["request_content_type"] = content_type
        if note:
            entry["note"] = note
        entry["status"] = status
        if ctype != "application/json":
            entry["response_content_type"] = ctype  # absent means application/json
        entry["response"] = response
        self.exchanges.append(entry)
        return status, response


class Service:
    def __init__(self, python, port, log_path, extra_args=(), extra_env=None):
        self.port = port
        self.log = open(log_path, "a")
        self.log.write(f"\n===== start {time.strftime('%H:%M:%S')} args={list(extra_args)} "
                       f"env={extra_env or {}}\n")
        self.log.flush()
        self.proc = subprocess.Popen(
            [python, "-m", "dynamo.select_service", "--port", str(port), *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "NO_COLOR": "1", **(extra_env or {})},
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("select_service exited early; see log")
            time.sleep(0.2)
        raise RuntimeError("select_service did not become healthy")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def wait_until(pred, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def quiet_get(port, path):
    with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=5) as r:
        return json.loads(r.read())


def quiet_post(port, path, body):
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=json.dumps(body).encode(),
                                 method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def worker(wid, port=None, **extra):
    w = {"worker_id": wid, "endpoint": f"http://worker-{wid}:8000", "block_size": 4}
    if port is not None:
        w["kv_events_endpoint"] = f"tcp://{HOST}:{port}"
    w.update(extra)
    return w


def seed_events(pub, chain_tokens, hashes, tiers=None, parent=None):
    """Publish a chain of full blocks, one BlockStored event (and one batch) per run of blocks
    on the same tier; tiers[i] gives the medium of block i (default GPU). Each block is stored
    on exactly one tier, as vLLM reports offloaded blocks. Batches are spaced out: Dynamo 1.6.1
    applies events on a thread pool and was seen to reject a child store racing its parent
    ("Stale parent hash could not be resolved") when they arrive back to back."""
    tiers = tiers or ["GPU"] * len(hashes)
    i = 0
    while i < len(hashes):
        j = i
        while j < len(hashes) and tiers[j] == tiers[i]:
            j += 1
        pub.publish([block_stored(hashes[i:j], parent, chain_tokens[4 * i: 4 * j], 4, tiers[i])])
        time.sleep(0.3)
        parent = hashes[j - 1]
        i = j


def wait_overlap(port, tokens, worker_id, device_blocks, model="default", host_blocks=0):
    def ok():
        st, body = quiet_post(port, "/overlap_scores", {"token_ids": tokens, "model_name": model})
        if st != 200:
            return False
        for w in body.get("workers", []):
            if (w["worker_id"] == worker_id and w["device_blocks"] >= device_blocks
                    and w["host_pinned_blocks"] >= host_blocks):
                return True
        return False
    if not wait_until(ok, 15):
        raise RuntimeError(f"KV events for worker {worker_id} never showed up")


# --------------------------------------------------------------------------------- scenarios
def scenario_workers(r, port, zmq_base):
    pub = FakeEnginePublisher(zmq_base)
    try:
        r.call("health", "GET", "/health")
        r.call("ready_empty", "GET", "/ready")
        r.call("list_workers_empty", "GET", "/workers")
        r.call("upsert_without_kv_events", "POST", "/workers", worker(1),
               note="no kv_events_endpoint: lifecycle incomplete")
        r.call("ready_only_incomplete", "GET", "/ready")
        r.call("upsert_with_kv_events_endpoint", "POST", "/workers", worker(2, zmq_base),
               note="nothing needs to listen; lifecycle schedulable at once")
        r.call("ready_one_schedulable", "GET", "/ready")
        r.call("upsert_minimal_worker_id_only", "POST", "/workers", {"worker_id": 3})
        r.call("upsert_block_size_zero", "POST", "/workers",
               worker(4, zmq_base + 1, block_size=0))
        r.call("upsert_all_fields", "POST", "/workers", {
            "worker_id": 5, "model_name": "m-full", "routing_group": "g1",
            "endpoint": "http://worker-5:8000", "kv_events_endpoint": f"tcp://{HOST}:{zmq_base + 2}",
            "replay_endpoint": f"tcp://{HOST}:{zmq_base + 3}", "block_size": 4,
            "data_parallel_start_rank": 0, "data_parallel_size": 1,
            "max_num_batched_tokens": 8192, "total_kv_blocks": 1000})
        r.call("upsert_dp2_kv_events_endpoints_map", "POST", "/workers", {
            "worker_id": 6, "model_name": "m-dp", "endpoint": "http://worker-6:8000",
            "block_size": 4, "data_parallel_start_rank": 0, "data_parallel_size": 2,
            "kv_events_endpoints": {"0": f"tcp://{HOST}:{zmq_base + 4}",
                                    "1": f"tcp://{HOST}:{zmq_base + 5}"}})
        r.call("upsert_dp2_single_kv_events_endpoint", "POST", "/workers", {
            "worker_id": 7, "model_name": "m-dp", "endpoint": "http://worker-7:8000",
            "block_size": 4, "data_parallel_start_rank": 2, "data_parallel_size": 2,
            "kv_events_endpoint": f"tcp://{HOST}:{zmq_base + 6}"})
        r.call("upsert_dp2_replay_endpoint", "POST", "/workers", {
            "worker_id": 8, "model_name": "m-dp2", "endpoint": "http://worker-8:8000",
            "block_size": 4, "data_parallel_size": 2, "replay_endpoint": f"tcp://{HOST}:{zmq_base + 7}",
            "kv_events_endpoints": {"0": f"tcp://{HOST}:{zmq_base + 8}",
                                    "1": f"tcp://{HOST}:{zmq_base + 9}"}})
        r.call("upsert_block_size_mismatch_in_partition", "POST", "/workers",
               worker(9, zmq_base + 10, block_size=8),
               note="partition default/default already has block_size 4 workers")
        r.call("upsert_malformed_kv_events_endpoint", "POST", "/workers",
               worker(10, None, model_name="m-bad", kv_events_endpoint="not-a-zmq-address"))
        r.call("upsert_empty_endpoint", "POST", "/workers",
               worker(11, zmq_base + 11, model_name="m-bad", endpoint=""))
        r.call("upsert_tenant_id_alias", "POST", "/workers",
               worker(12, zmq_base + 12, model_name="m-alias", tenant_id="t1"))
        r.call("upsert_unknown_field", "POST", "/workers",
               worker(13, zmq_base + 13, model_name="m-alias", no_such_field=1))
        time.sleep(0.5)
        r.call("list_workers", "GET", "/workers")
        r.call("list_workers_by_model", "GET", "/workers?model_name=m-dp")
        r.call("list_workers_by_routing_group", "GET", "/workers?routing_group=g1")
        r.call("list_workers_by_tenant_id", "GET", "/workers?tenant_id=g1")
        r.call("list_workers_unknown_model", "GET", "/workers?model_name=nope")
        r.call("ready_mixed", "GET", "/ready")
        # re-post (upsert) changes the endpoint
        r.call("upsert_again_changed_endpoint", "POST", "/workers",
               worker(2, zmq_base, endpoint="http://worker-2-new:8000"))
        r.call("patch_add_kv_events_endpoint", "PATCH", "/workers/1",
               {"kv_events_endpoint": f"tcp://{HOST}:{zmq_base + 14}"},
               note="incomplete worker becomes schedulable")
        r.call("patch_total_kv_blocks", "PATCH", "/workers/2", {"total_kv_blocks": 64})
        r.call("patch_empty_body", "PATCH", "/workers/2", {})
        r.call("patch_block_size_zero", "PATCH", "/workers/1", {"block_size": 0})
        r.call("patch_model_name_field", "PATCH", "/workers/1", {"model_name": "other"},
               note="model_name is not a patch field")
        r.call("patch_unknown_worker", "PATCH", "/workers/999", {"endpoint": "http://x"})
        r.call("patch_bad_path_param", "PATCH", "/workers/abc", {"endpoint": "http://x"})
        r.call("patch_negative_path_param", "PATCH", "/workers/-1", {"endpoint": "http://x"})
        r.call("patch_no_body", "PATCH", "/workers/2", content_type=None, raw=b"")
        r.call("delete_worker", "DELETE", "/workers/1")
        r.call("delete_worker_again", "DELETE", "/workers/1")
        r.call("delete_unknown_worker", "DELETE", "/workers/999")
        r.call("delete_bad_path_param", "DELETE", "/workers/abc")
        r.call("delete_u64_max_path_param", "DELETE", "/workers/18446744073709551615")
        r.call("delete_u64_overflow_path_param", "DELETE", "/workers/18446744073709551616")
        r.call("upsert_worker_id_u64_max", "POST", "/workers",
               worker(18446744073709551615, zmq_base + 15, model_name="m-big"))
        r.call("upsert_worker_id_negative", "POST", "/workers", worker(-1, zmq_base + 15))
        r.call("upsert_worker_id_string", "POST", "/workers", worker("7", zmq_base + 15))
        r.call("upsert_worker_id_missing", "POST", "/workers", {"endpoint": "http://x", "block_size": 4})
        r.call("upsert_block_size_over_u32", "POST", "/workers", worker(20, zmq_base + 15, block_size=4294967296))
        r.call("delete_all_schedulable_then_ready", "DELETE", "/workers/2")
        for wid in (3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 18446744073709551615):
            quiet_delete(port, f"/workers/{wid}")
        r.call("ready_after_deleting_all", "GET", "/ready")
        r.call("list_workers_after_deleting_all", "GET", "/workers")
    finally:
        pub.close()


def quiet_delete(port, path):
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", method="DELETE")
    try:
        urllib.request.urlopen(req, timeout=5).read()
    except urllib.error.HTTPError:
        pass


def scenario_select(r, port, zmq_base):
    pub_a = FakeEnginePublisher(zmq_base)
    pub_b = FakeEnginePublisher(zmq_base + 1)
    try:
        r.call("select_no_workers", "POST", "/select", {"token_ids": TOKENS_17})
        r.call("upsert_worker_a", "POST", "/workers", worker(1, zmq_base))
        r.call("upsert_worker_b", "POST", "/workers", worker(2, zmq_base + 1))
        r.call("upsert_worker_c_no_kv_events", "POST", "/workers", worker(3))
        assert pub_a.wait_subscribed() and pub_b.wait_subscribed()
        # worker 1 holds blocks 0-1 on GPU and 2-3 on CPU; worker 2 holds block 0 on GPU.
        seed_events(pub_a, TOKENS_17, [1001, 1002, 1003, 1004], ["GPU", "GPU", "CPU", "CPU"])
        wait_overlap(port, TOKENS_17, 1, 2, host_blocks=4)
        seed_events(pub_b, TOKENS_17, [2001])
        wait_overlap(port, TOKENS_17, 2, 1)
        r.call("overlap_scores_tokens", "POST", "/overlap_scores", {"token_ids": TOKENS_17})
        r.call("select_token_ids", "POST", "/select", {"token_ids": TOKENS_17})
        r.call("select_hashes", "POST", "/select", {
            "block_hashes": LOCAL_HASHES_I64, "sequence_hashes": SEQ_HASHES_I64, "isl_tokens": 17})
        r.call("select_hashes_unsigned_block_hashes", "POST", "/select", {
            "block_hashes": LOCAL_HASHES_U64, "sequence_hashes": SEQ_HASHES_I64, "isl_tokens": 17},
            note="u64 values above i64::MAX in block_hashes")
        r.call("select_with_selection_id", "POST", "/select",
               {"token_ids": TOKENS_17, "selection_id": "sel-1"})
        r.call("select_explicit_model_and_group", "POST", "/select",
               {"token_ids": TOKENS_17, "model_name": "default", "routing_group": "default"})
        r.call("select_tenant_id_alias", "POST", "/select",
               {"token_ids": TOKENS_17, "tenant_id": "default"})
        r.call("select_advisory", "POST", "/select", {"token_ids": TOKENS_17, "advisory": True})
        r.call("select_expected_output_tokens", "POST", "/select",
               {"token_ids": TOKENS_17, "expected_output_tokens": 32})
        r.call("select_override_no_overlap_credit", "POST", "/select",
               {"token_ids": TOKENS_17, "router_config_override": {"overlap_score_credit": 0.0}})
        r.call("select_override_all_fields", "POST", "/select", {
            "token_ids": TOKENS_17, "router_config_override": {
                "overlap_score_credit": 2.0, "prefill_load_scale": 0.5, "router_temperature": 0.0,
                "track_prefill_tokens": False}})
        r.call("select_override_temperature", "POST", "/select",
               {"token_ids": TOKENS_17, "router_config_override": {"router_temperature": 1.0}})
        r.call("select_override_unknown_key", "POST", "/select",
               {"token_ids": TOKENS_17, "router_config_override": {"no_such_knob": 1}})
        r.call("select_pinned_worker", "POST", "/select",
               {"token_ids": TOKENS_17, "pinned_worker": {"worker_id": 2, "dp_rank": 0}})
        r.call("select_pinned_worker_no_dp_rank", "POST", "/select",
               {"token_ids": TOKENS_17, "pinned_worker": {"worker_id": 2}})
        r.call("select_pinned_incomplete_worker", "POST", "/select",
               {"token_ids": TOKENS_17, "pinned_worker": {"worker_id": 3, "dp_rank": 0}})
        r.call("select_pinned_unknown_worker", "POST", "/select",
               {"token_ids": TOKENS_17, "pinned_worker": {"worker_id": 99, "dp_rank": 0}})
        r.call("select_pinned_bad_dp_rank", "POST", "/select",
               {"token_ids": TOKENS_17, "pinned_worker": {"worker_id": 2, "dp_rank": 5}})
        r.call("select_allowed_worker_ids", "POST", "/select",
               {"token_ids": TOKENS_17, "allowed_worker_ids": [2]})
        r.call("select_allowed_worker_ids_none_available", "POST", "/select",
               {"token_ids": TOKENS_17, "allowed_worker_ids": [3, 99]})
        r.call("select_allowed_worker_ids_empty", "POST", "/select",
               {"token_ids": TOKENS_17, "allowed_worker_ids": []})
        r.call("select_lora_name", "POST", "/select", {"token_ids": TOKENS_17, "lora_name": "adapter-a"},
               note="no overlap on either worker: a cost tie, broken at random (worker_id arbitrary)")
        r.call("select_cache_salt", "POST", "/select", {"token_ids": TOKENS_17, "cache_salt": "salt-1"},
               note="no overlap on either worker: a cost tie, broken at random (worker_id arbitrary)")
        r.call("select_short_prompt_no_full_block", "POST", "/select", {"token_ids": [1, 2, 3]},
               note="no overlap on either worker: a cost tie, broken at random (worker_id arbitrary)")
        r.call("select_other_model_no_workers", "POST", "/select",
               {"token_ids": TOKENS_17, "model_name": "nope"})
        r.call("select_session_id", "POST", "/select", {"token_ids": TOKENS_17, "session_id": "sess-1"})
        r.call("select_unknown_field", "POST", "/select", {"token_ids": TOKENS_17, "no_such_field": 1})
        r.call("select_and_reserve_no_selection_id", "POST", "/select_and_reserve",
               {"token_ids": TOKENS_17}, note="selection_id is generated (UUID v4)")
        r.call("select_and_reserve_with_selection_id", "POST", "/select_and_reserve",
               {"token_ids": TOKENS_17, "selection_id": "sar-1", "expected_output_tokens": 8})
        r.call("select_and_reserve_duplicate", "POST", "/select_and_reserve",
               {"token_ids": TOKENS_17, "selection_id": "sar-1"})
        r.call("select_and_reserve_hashes", "POST", "/select_and_reserve", {
            "block_hashes": LOCAL_HASHES_I64, "sequence_hashes": SEQ_HASHES_I64, "isl_tokens": 17,
            "selection_id": "sar-2"})
        r.call("select_and_reserve_advisory", "POST", "/select_and_reserve",
               {"token_ids": TOKENS_17, "selection_id": "sar-3", "advisory": True})
        r.call("select_and_reserve_pinned", "POST", "/select_and_reserve",
               {"token_ids": TOKENS_17, "selection_id": "sar-4", "pinned_worker": {"worker_id": 2, "dp_rank": 0}})
        r.call("select_and_reserve_reservation_id_field", "POST", "/select_and_reserve",
               {"token_ids": TOKENS_17, "reservation_id": "sar-5"},
               note="reservation_id is not a Dynamo field")
        r.call("loads_after_select_and_reserve", "GET", "/loads")
        r.call("select_after_bookings", "POST", "/select", {"token_ids": TOKENS_17})
        # KV removal / clear events reflected in overlap
        pub_a.publish([block_removed([1004], "CPU")])
        time.sleep(0.5)
        r.call("overlap_scores_after_block_removed", "POST", "/overlap_scores", {"token_ids": TOKENS_17})
        r.call("dump", "GET", "/dump")
    finally:
        pub_a.close()
        pub_b.close()


def scenario_reservations(r, port, zmq_base):
    pub = FakeEnginePublisher(zmq_base)
    try:
        r.call("replay_no_workers_no_pending", "POST", "/reservations", {"selection_id": "nope"})
        r.call("upsert_worker_1", "POST", "/workers", worker(1, zmq_base))
        r.call("upsert_worker_2", "POST", "/workers", worker(2, zmq_base + 1))
        assert pub.wait_subscribed()
        seed_events(pub, TOKENS_17, [1001, 1002, 1003, 1004])
        wait_overlap(port, TOKENS_17, 1, 4)
        r.call("select_for_replay", "POST", "/select", {
            "token_ids": TOKENS_17, "selection_id": "r-1", "expected_output_tokens": 16})
        r.call("replay", "POST", "/reservations", {"selection_id": "r-1"})
        r.call("replay_again", "POST", "/reservations", {"selection_id": "r-1"})
        r.call("loads_after_replay", "GET", "/loads")
        r.call("replay_other_partition", "POST", "/reservations",
               {"selection_id": "r-x", "model_name": "other"})
        r.call("select_for_replay_with_ignored_fields", "POST", "/select",
               {"token_ids": TOKENS_17, "selection_id": "r-2"})
        r.call("replay_with_ignored_fields", "POST", "/reservations", {
            "selection_id": "r-2", "dp_rank": 3, "token_ids": [9, 9, 9, 9], "isl_tokens": 4,
            "effective_prefill_tokens": 1, "expected_output_tokens": 1},
            note="a replay ignores everything except ids/model/group")
        r.call("select_for_replay_wrong_partition", "POST", "/select",
               {"token_ids": TOKENS_17, "selection_id": "r-3"})
        r.call("replay_wrong_partition", "POST", "/reservations",
               {"selection_id": "r-3", "model_name": "other"})
        r.call("replay_reservation_id_field_ignored", "POST", "/reservations",
               {"selection_id": "r-3", "reservation_id": "res-3"},
               note="reservation_id is not a Dynamo field; booked under selection_id")
        r.call("missing_selection_id", "POST", "/reservations", {"worker_id": 1, "token_ids": TOKENS_17})
        r.call("missing_selection_id_replay", "POST", "/reservations", {})
        r.call("explicit_tokens", "POST", "/reservations",
               {"selection_id": "e-1", "worker_id": 2, "dp_rank": 0, "token_ids": TOKENS_17})
        r.call("explicit_tokens_no_dp_rank", "POST", "/reservations",
               {"selection_id": "e-2", "worker_id": 2, "token_ids": TOKENS_17})
        r.call("explicit_hashes_with_effective_prefill", "POST", "/reservations", {
            "selection_id": "e-3", "worker_id": 1, "dp_rank": 0, "sequence_hashes": SEQ_HASHES_I64,
            "isl_tokens": 17, "effective_prefill_tokens": 1, "expected_output_tokens": 4})
        r.call("explicit_track_prefill_false", "POST", "/reservations", {
            "selection_id": "e-4", "worker_id": 1, "token_ids": TOKENS_17,
            "track_prefill_tokens": False})
        r.call("loads_after_explicit", "GET", "/loads")
        r.call("explicit_effective_prefill_gt_isl", "POST", "/reservations", {
            "selection_id": "e-5", "worker_id": 1, "token_ids": TOKENS_17,
            "effective_prefill_tokens": 18})
        r.call("explicit_duplicate", "POST", "/reservations",
               {"selection_id": "e-1", "worker_id": 1, "token_ids": TOKENS_17})
        r.call("explicit_duplicate_same_worker", "POST", "/reservations",
               {"selection_id": "e-1", "worker_id": 2, "token_ids": TOKENS_17})
        r.call("explicit_unknown_worker", "POST", "/reservations",
               {"selection_id": "e-6", "worker_id": 99, "token_ids": TOKENS_17})
        r.call("explicit_bad_dp_rank", "POST", "/reservations",
               {"selection_id": "e-7", "worker_id": 1, "dp_rank": 4, "token_ids": TOKENS_17})
        r.call("explicit_no_prompt", "POST", "/reservations", {"selection_id": "e-8", "worker_id": 1})
        r.call("explicit_no_isl", "POST", "/reservations",
               {"selection_id": "e-9", "worker_id": 1, "sequence_hashes": SEQ_HASHES_I64})
        r.call("explicit_empty_token_ids", "POST", "/reservations",
               {"selection_id": "e-10", "worker_id": 1, "token_ids": []})
        r.call("explicit_isl_zero", "POST", "/reservations", {
            "selection_id": "e-11", "worker_id": 1, "sequence_hashes": [], "isl_tokens": 0})
        r.call("explicit_other_partition_worker", "POST", "/reservations",
               {"selection_id": "e-12", "worker_id": 1, "model_name": "other", "token_ids": TOKENS_17})
        # explicit form discards a cached selection of the same id
        r.call("select_then_explicit", "POST", "/select", {"token_ids": TOKENS_17, "selection_id": "d-1"})
        r.call("explicit_discards_cache", "POST", "/reservations",
               {"selection_id": "d-1", "worker_id": 2, "token_ids": TOKENS_17})
        r.call("free_d1", "DELETE", "/reservations/d-1")
        r.call("replay_after_explicit_discard", "POST", "/reservations", {"selection_id": "d-1"})
        # replay whose worker was deleted
        r.call("select_before_worker_delete", "POST", "/select", {
            "token_ids": TOKENS_17, "selection_id": "g-1", "pinned_worker": {"worker_id": 2, "dp_rank": 0}})
        r.call("delete_worker_2", "DELETE", "/workers/2")
        r.call("replay_worker_gone", "POST", "/reservations", {"selection_id": "g-1"})
        r.call("replay_worker_gone_retry", "POST", "/reservations", {"selection_id": "g-1"},
               note="is the pending entry kept after a failed replay?")
        r.call("lifecycle_of_deleted_workers_booking", "POST", "/reservations/e-1/prefill_complete")
        r.call("free_deleted_workers_booking", "DELETE", "/reservations/e-1")
        # lifecycle, isolated in its own partition on a fresh worker (nothing else booked there)
        r.call("upsert_worker_3_lifecycle_partition", "POST", "/workers",
               worker(3, zmq_base + 2, model_name="m-life"))
        life_tokens = list(range(101, 141))
        r.call("select_and_reserve_for_lifecycle", "POST", "/select_and_reserve", {
            "token_ids": life_tokens, "selection_id": "l-1", "model_name": "m-life"},
            note="40 tokens = 10 full blocks")
        r.call("loads_l1_booked", "GET", "/loads?model_name=m-life")
        r.call("prefill_complete", "POST", "/reservations/l-1/prefill_complete")
        r.call("prefill_complete_again", "POST", "/reservations/l-1/prefill_complete")
        r.call("prefill_complete_with_body", "POST", "/reservations/l-1/prefill_complete", {})
        r.call("loads_l1_prefill_done", "GET", "/loads?model_name=m-life")
        seq = [("output_block_empty_object_1", {}), ("output_block_empty_object_2", {}),
               ("output_block_decay_0_5", {"decay_fraction": 0.5}),
               ("output_block_empty_object_3", {}),
               ("output_block_decay_1_0", {"decay_fraction": 1.0}),
               ("output_block_decay_0", {"decay_fraction": 0.0}),
               ("output_block_decay_null", {"decay_fraction": None}),
               ("output_block_decay_0_25", {"decay_fraction": 0.25})]
        for i, (name, body) in enumerate(seq, 1):
            r.call(name, "POST", "/reservations/l-1/output_block", body)
            r.call(f"loads_after_output_block_{i}", "GET", "/loads?model_name=m-life")
        r.call("output_block_decay_negative", "POST", "/reservations/l-1/output_block", {"decay_fraction": -0.1})
        r.call("output_block_decay_above_one", "POST", "/reservations/l-1/output_block", {"decay_fraction": 1.5})
        r.call("output_block_decay_string", "POST", "/reservations/l-1/output_block", {"decay_fraction": "0.5"})
        r.call("output_block_unknown_field", "POST", "/reservations/l-1/output_block", {"blocks": 3})
        r.call("output_block_no_body_no_content_type", "POST", "/reservations/l-1/output_block")
        r.call("output_block_empty_body_json_content_type", "POST", "/reservations/l-1/output_block", raw=b"")
        r.call("output_block_unknown_reservation", "POST", "/reservations/nope/output_block", {})
        r.call("prefill_complete_unknown_reservation", "POST", "/reservations/nope/prefill_complete")
        r.call("loads_before_free", "GET", "/loads?model_name=m-life")
        r.call("free", "DELETE", "/reservations/l-1")
        r.call("free_again", "DELETE", "/reservations/l-1")
        r.call("free_unknown", "DELETE", "/reservations/nope")
        r.call("loads_after_free", "GET", "/loads?model_name=m-life")
        r.call("rebook_freed_id", "POST", "/reservations",
               {"selection_id": "l-1", "worker_id": 3, "model_name": "m-life", "token_ids": life_tokens})
        r.call("free_rebooked", "DELETE", "/reservations/l-1")
        r.call("explicit_on_incomplete_worker", "POST", "/workers", worker(4, None, model_name="m-life"))
        r.call("explicit_booking_on_incomplete_worker", "POST", "/reservations",
               {"selection_id": "i-1", "worker_id": 4, "model_name": "m-life", "token_ids": TOKENS_17})
        r.call("explicit_booking_cross_partition_worker", "POST", "/reservations",
               {"selection_id": "i-2", "worker_id": 1, "model_name": "m-life", "token_ids": TOKENS_17},
               note="worker 1 lives in default/default")
        r.call("reservation_id_with_slash_encoded", "DELETE", "/reservations/a%2Fb")
        r.call("reservation_id_unicode", "DELETE", "/reservations/%C3%A9")
        r.call("get_reservation_method_not_allowed", "GET", "/reservations/l-1")
        r.call("long_selection_id", "POST", "/reservations",
               {"selection_id": "x" * 2000, "worker_id": 1, "token_ids": TOKENS_17},
               note="2000-byte id: Dynamo has no length limit")
        r.call("free_long_selection_id", "DELETE", "/reservations/" + "x" * 2000)
        r.call("select_before_last_worker_delete", "POST", "/select",
               {"token_ids": TOKENS_17, "selection_id": "g-2", "model_name": "m-life"})
        r.call("delete_last_worker_of_partition", "DELETE", "/workers/3")
        r.call("replay_partition_without_workers", "POST", "/reservations",
               {"selection_id": "g-2", "model_name": "m-life"})
        r.call("replay_partition_without_workers_retry", "POST", "/reservations",
               {"selection_id": "g-2", "model_name": "m-life"})
        r.call("readd_worker_3", "POST", "/workers", worker(3, zmq_base + 2, model_name="m-life"))
        r.call("replay_after_worker_back", "POST", "/reservations",
               {"selection_id": "g-2", "model_name": "m-life"})
        r.call("free_g2", "DELETE", "/reservations/g-2")
    finally:
        pub.close()


def scenario_loads(r, port, zmq_base):
    pub = FakeEnginePublisher(zmq_base)
    try:
        r.call("loads_empty", "GET", "/loads")
        r.call("potential_loads_no_workers", "POST", "/potential_loads", {"token_ids": TOKENS_17})
        r.call("overlap_scores_no_workers", "POST", "/overlap_scores", {"token_ids": TOKENS_17})
        r.call("upsert_worker_1", "POST", "/workers", worker(1, zmq_base))
        r.call("upsert_worker_2_dp2", "POST", "/workers", {
            "worker_id": 2, "endpoint": "http://worker-2:8000", "block_size": 4,
            "data_parallel_size": 2, "total_kv_blocks": 100, "max_num_batched_tokens": 64,
            "kv_events_endpoints": {"0": f"tcp://{HOST}:{zmq_base + 1}",
                                    "1": f"tcp://{HOST}:{zmq_base + 2}"}})
        r.call("upsert_worker_3_other_model", "POST", "/workers",
               worker(3, zmq_base + 3, model_name="m2", routing_group="g2"))
        assert pub.wait_subscribed()
        seed_events(pub, TOKENS_17, [1001, 1002, 1003], ["GPU", "CPU", "DISK"])
        wait_overlap(port, TOKENS_17, 1, 1, host_blocks=2)
        time.sleep(0.3)
        r.call("loads_idle", "GET", "/loads")
        r.call("overlap_scores_tokens", "POST", "/overlap_scores", {"token_ids": TOKENS_17})
        r.call("overlap_scores_hashes", "POST", "/overlap_scores", {
            "block_hashes": LOCAL_HASHES_I64, "sequence_hashes": SEQ_HASHES_I64, "isl_tokens": 17})
        r.call("overlap_scores_other_model", "POST", "/overlap_scores",
               {"token_ids": TOKENS_17, "model_name": "m2", "routing_group": "g2"})
        r.call("potential_loads_tokens", "POST", "/potential_loads", {"token_ids": TOKENS_17})
        r.call("potential_loads_hashes", "POST", "/potential_loads", {
            "block_hashes": LOCAL_HASHES_I64, "sequence_hashes": SEQ_HASHES_I64, "isl_tokens": 17})
        r.call("potential_loads_override", "POST", "/potential_loads", {
            "token_ids": TOKENS_17, "router_config_override": {"track_prefill_tokens": False}})
        r.call("book_17_tokens_on_worker_1", "POST", "/reservations",
               {"selection_id": "b-1", "worker_id": 1, "token_ids": TOKENS_17})
        r.call("book_17_tokens_on_worker_2_rank_1", "POST", "/reservations",
               {"selection_id": "b-2", "worker_id": 2, "dp_rank": 1, "token_ids": TOKENS_17,
                "effective_prefill_tokens": 5})
        r.call("book_m2", "POST", "/reservations",
               {"selection_id": "b-3", "worker_id": 3, "model_name": "m2", "routing_group": "g2",
                "token_ids": [1, 2, 3, 4, 5]})
        r.call("loads_booked", "GET", "/loads")
        r.call("loads_filter_model", "GET", "/loads?model_name=m2")
        r.call("loads_filter_routing_group", "GET", "/loads?routing_group=g2")
        r.call("loads_filter_tenant_id", "GET", "/loads?tenant_id=g2")
        r.call("loads_filter_unknown", "GET", "/loads?model_name=nope")
        r.call("potential_loads_after_booking", "POST", "/potential_loads", {"token_ids": TOKENS_17})
        r.call("select_after_booking", "POST", "/select", {"token_ids": TOKENS_17})
        r.call("select_pinned_dp_rank_1", "POST", "/select",
               {"token_ids": TOKENS_17, "pinned_worker": {"worker_id": 2, "dp_rank": 1}, "advisory": True})
        r.call("select_allowed_dp_worker", "POST", "/select",
               {"token_ids": TOKENS_17, "allowed_worker_ids": [2]},
               note="rank 0 is idle, rank 1 holds booking b-2")
        r.call("overlap_scores_empty_tokens", "POST", "/overlap_scores", {"token_ids": []})
        r.call("potential_loads_empty_tokens", "POST", "/potential_loads", {"token_ids": []})
        r.call("dump", "GET", "/dump")
        for path in ("/workers/1", "/workers/2", "/workers/3"):
            quiet_delete(port, path)
        r.call("loads_after_deleting_all_workers", "GET", "/loads")
        r.call("dump_after_deleting_all_workers", "GET", "/dump")
    finally:
        pub.close()


def scenario_errors(r, port, zmq_base):
    big = {"token_ids": [1] * 10}
    r.call("select_no_workers", "POST", "/select", {"token_ids": TOKENS_17})
    r.call("select_and_reserve_no_workers", "POST", "/select_and_reserve", {"token_ids": TOKENS_17})
    r.call("potential_loads_no_workers", "POST", "/potential_loads", {"token_ids": TOKENS_17})
    r.call("explicit_reservation_no_workers", "POST", "/reservations",
           {"selection_id": "x", "worker_id": 1, "token_ids": TOKENS_17})
    r.call("upsert_incomplete_worker_only", "POST", "/workers", worker(5))
    r.call("select_only_incomplete_workers", "POST", "/select", {"token_ids": TOKENS_17})
    r.call("upsert_worker", "POST", "/workers", worker(1, zmq_base))
    # prompt validation
    r.call("select_empty_token_ids", "POST", "/select", {"token_ids": []})
    r.call("select_and_reserve_empty_token_ids", "POST", "/select_and_reserve",
           {"token_ids": [], "selection_id": "z-1"})
    r.call("select_missing_prompt", "POST", "/select", {})
    r.call("select_missing_sequence_hashes", "POST", "/select",
           {"block_hashes": LOCAL_HASHES_I64, "isl_tokens": 17})
    r.call("select_missing_isl_tokens", "POST", "/select",
           {"block_hashes": LOCAL_HASHES_I64, "sequence_hashes": SEQ_HASHES_I64})
    r.call("select_mismatched_hash_lengths", "POST", "/select",
           {"block_hashes": LOCAL_HASHES_I64, "sequence_hashes": SEQ_HASHES_I64[:2], "isl_tokens": 17})
    r.call("select_isl_zero", "POST", "/select",
           {"block_hashes": LOCAL_HASHES_I64, "sequence_hashes": SEQ_HASHES_I64, "isl_tokens": 0})
    r.call("select_empty_hashes", "POST", "/select",
           {"block_hashes": [], "sequence_hashes": [], "isl_tokens": 3})
    r.call("select_isl_less_than_blocks", "POST", "/select",
           {"block_hashes": LOCAL_HASHES_I64, "sequence_hashes": SEQ_HASHES_I64, "isl_tokens": 5})
    r.call("select_tokens_and_hashes", "POST", "/select",
           {"token_ids": [1, 2, 3, 4, 5], "block_hashes": [1], "sequence_hashes": [1, 2], "isl_tokens": 0},
           note="token_ids wins; hashes are ignored")
    r.call("reservation_missing_sequence_hashes", "POST", "/reservations",
           {"selection_id": "z-2", "worker_id": 1, "isl_tokens": 17})
    # JSON / type errors
    r.call("malformed_json", "POST", "/select", raw=b'{"token_ids": [1,2,')
    r.call("trailing_data", "POST", "/select", raw=b'{"token_ids": [1,2,3,4]} x')
    r.call("byte_order_mark", "POST", "/select", raw=b'\xef\xbb\xbf{"token_ids": [1,2,3,4]}')
    r.call("duplicate_keys", "POST", "/select", raw=b'{"token_ids": [1,2,3,4], "token_ids": [5,6,7,8]}')
    r.call("not_an_object", "POST", "/select", raw=b'[1,2,3]')
    r.call("empty_body_json_content_type", "POST", "/select", raw=b'')
    r.call("no_content_type", "POST", "/select", raw=json.dumps(big).encode(), content_type=None)
    r.call("text_plain_content_type", "POST", "/select", raw=json.dumps(big).encode(),
           content_type="text/plain")
    r.call("json_charset_content_type", "POST", "/select", raw=json.dumps(big).encode(),
           content_type="application/json; charset=utf-8")
    r.call("vendor_json_content_type", "POST", "/select", raw=json.dumps(big).encode(),
           content_type="application/vnd.api+json")
    r.call("token_ids_string", "POST", "/select", {"token_ids": "1,2,3"})
    r.call("token_ids_negative", "POST", "/select", {"token_ids": [1, -2, 3, 4]})
    r.call("token_ids_over_u32", "POST", "/select", {"token_ids": [1, 4294967296, 3, 4]})
    r.call("token_ids_float", "POST", "/select", {"token_ids": [1.5, 2, 3, 4]})
    r.call("isl_tokens_negative", "POST", "/select",
           {"block_hashes": [1], "sequence_hashes": [1], "isl_tokens": -1})
    r.call("block_hashes_over_i64_u64", "POST", "/select",
           {"block_hashes": [18446744073709551616], "sequence_hashes": [1], "isl_tokens": 4})
    r.call("model_name_number", "POST", "/select", {"token_ids": TOKENS_17, "model_name": 5})
    r.call("selection_id_number", "POST", "/select", {"token_ids": TOKENS_17, "selection_id": 5})
    r.call("advisory_string", "POST", "/select", {"token_ids": TOKENS_17, "advisory": "yes"})
    r.call("allowed_worker_ids_string", "POST", "/select", {"token_ids": TOKENS_17, "allowed_worker_ids": "1"})
    r.call("pinned_worker_missing_worker_id", "POST", "/select",
           {"token_ids": TOKENS_17, "pinned_worker": {"dp_rank": 0}})
    r.call("router_config_override_wrong_type", "POST", "/select",
           {"token_ids": TOKENS_17, "router_config_override": {"overlap_score_credit": "high"}})
    r.call("reservation_worker_id_string", "POST", "/reservations",
           {"selection_id": "z-3", "worker_id": "1", "token_ids": TOKENS_17})
    r.call("reservation_selection_id_null", "POST", "/reservations", {"selection_id": None})
    r.call("worker_block_size_string", "POST", "/workers", worker(9, zmq_base, block_size="4"))
    r.call("long_model_name", "POST", "/select", {"token_ids": TOKENS_17, "model_name": "m" * 2000})
    # routing errors
    r.call("unknown_route", "GET", "/no_such_route")
    r.call("unknown_route_post", "POST", "/no_such_route", {})
    r.call("root", "GET", "/")
    r.call("trailing_slash", "GET", "/workers/")
    r.call("wrong_method_get_select", "GET", "/select")
    r.call("wrong_method_put_workers", "PUT", "/workers", worker(1, zmq_base))
    r.call("wrong_method_delete_workers", "DELETE", "/workers")
    r.call("wrong_method_get_worker", "GET", "/workers/1")
    r.call("wrong_method_post_health", "POST", "/health", {})
    r.call("wrong_method_get_output_block", "GET", "/reservations/x/output_block")
    r.call("wrong_method_post_loads", "POST", "/loads", {})
    r.call("bad_path_param_patch", "PATCH", "/workers/abc", {})
    r.call("bad_path_param_delete", "DELETE", "/workers/1.5")
    r.call("metrics", "GET", "/metrics")
    r.call("openapi_json", "GET", "/openapi.json")
    r.call("docs", "GET", "/docs")
    # body size limit (8 MiB in Dynamo's source: REQUEST_BODY_LIMIT_BYTES)
    limit = 8 * 1024 * 1024
    for name, size in (("body_just_under_8mib", limit - 64), ("body_over_8mib", limit + 1)):
        prefix = b'{"token_ids": [1,2,3,4], "pad": "'
        suffix = b'"}'
        pad = b"a" * (size - len(prefix) - len(suffix))
        r.call(name, "POST", "/select", raw=prefix + pad + suffix, record_request=False,
               note=f"JSON body of exactly {size} bytes: token_ids [1,2,3,4] plus a string pad field")


def scenario_misc(r, port, zmq_base):
    r.call("health", "GET", "/health")
    r.call("health_head", "HEAD", "/health")
    r.call("ready", "GET", "/ready")
    r.call("loads", "GET", "/loads")
    r.call("dump_empty", "GET", "/dump")
    r.call("metrics", "GET", "/metrics", truncate=4000)
    r.call("openapi_json", "GET", "/openapi.json")
    r.call("replica_sync_peers", "GET", "/replica_sync/peers")
    r.call("replica_sync_register_peer_disabled", "POST", "/replica_sync/register_peer",
           {"endpoint": f"tcp://{HOST}:{zmq_base}"})
    r.call("replica_sync_deregister_peer_disabled", "POST", "/replica_sync/deregister_peer",
           {"endpoint": f"tcp://{HOST}:{zmq_base}"})


# ------------------------------------------------------------------ sessions, constraints, MM
# Filled in by main(): the interpreter with ai-dynamo-runtime, the log file, the base port. The
# sessions scenario starts extra service instances (no TTL flag, bad flag values) with them.
RUNTIME = {}
SESSION_TTL_SECS = 2


def session_cli_checks(port):
    """Start the service with good and bad --session-affinity-ttl-secs values. A bad value makes
    it exit before binding; a good one is stopped (SIGINT) once /health answers."""
    python = RUNTIME["python"]
    cases = [
        ("ttl_zero", ["--session-affinity-ttl-secs", "0"]),
        ("ttl_half_second", ["--session-affinity-ttl-secs", "0.5"]),
        ("ttl_above_max", ["--session-affinity-ttl-secs", "31536001"]),
        ("ttl_huge", ["--session-affinity-ttl-secs", "18446744073709551616"]),
        ("ttl_nan", ["--session-affinity-ttl-secs", "NaN"]),
        ("ttl_inf", ["--session-affinity-ttl-secs", "inf"]),
        ("ttl_negative_equals_form", ["--session-affinity-ttl-secs=-1"]),
        ("ttl_negative_separate_arg", ["--session-affinity-ttl-secs", "-1"]),
        ("ttl_not_a_number", ["--session-affinity-ttl-secs", "abc"]),
        ("ttl_empty", ["--session-affinity-ttl-secs", ""]),
        ("ttl_missing_value", ["--session-affinity-ttl-secs"]),
        ("ttl_twice", ["--session-affinity-ttl-secs", "2", "--session-affinity-ttl-secs", "3"]),
        ("ttl_one", ["--session-affinity-ttl-secs", "1"]),
        ("ttl_fractional", ["--session-affinity-ttl-secs", "1.5"]),
        ("ttl_exponent", ["--session-affinity-ttl-secs", "1e3"]),
        ("ttl_max", ["--session-affinity-ttl-secs", "31536000"]),
        ("session_mode_flag", ["--session-affinity-mode", "soft"]),
        ("session_max_entries_flag", ["--session-affinity-max-entries", "10"]),
    ]
    results = []
    for name, extra in cases:
        argv = ["--port", str(port), *extra]
        proc = subprocess.Popen([python, "-m", "dynamo.select_service", *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "NO_COLOR": "1"})
        started = False
        deadline = time.time() + 30
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=1) as resp:
                    started = resp.status == 200
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if started:
                break
            time.sleep(0.2)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        text = err.decode("utf-8", "replace")
        entry = {"name": name, "args": ["python", "-m", "dynamo.select_service", *argv],
                 "started": started}
        if not started:
            entry["exit_code"] = proc.returncode
            if "Traceback (most recent call last)" in text:
                # Python traceback with venv paths: keep only the exception line.
                entry["exception"] = text.strip().splitlines()[-1]
            else:
                entry["stderr"] = text
        results.append(entry)
    return results


def scenario_sessions(r, port, zmq_base):
    """Session affinity, service started with --session-affinity-ttl-secs 2. Worker 1 holds
    TOKENS_17 (4 blocks on GPU); workers 2 and 3 hold nothing, so an unconstrained select picks
    worker 1 and a session bound to 2 or 3 shows up as a different worker_id."""
    ttl = SESSION_TTL_SECS
    T = TOKENS_17
    pubs = [FakeEnginePublisher(zmq_base + i) for i in range(6)]

    def sel(name, sid=None, note=None, **extra):
        body = {"token_ids": T}
        if sid is not None:
            body["session_id"] = sid
        body.update(extra)
        return r.call(name, "POST", "/select", body, note=note)

    def sar(name, sid, selection_id, note=None, **extra):
        body = {"token_ids": T, "selection_id": selection_id}
        if sid is not None:
            body["session_id"] = sid
        body.update(extra)
        return r.call(name, "POST", "/select_and_reserve", body, note=note)

    def free(name, selection_id, note=None):
        return r.call(name, "DELETE", f"/reservations/{selection_id}", note=note)

    try:
        # ---- A: a second instance without the TTL flag: session fields are ignored
        no_ttl_port = port + 1
        svc2 = Service(RUNTIME["python"], no_ttl_port, RUNTIME["log"])
        r2 = Recorder(no_ttl_port)
        try:
            nt = "second instance started WITHOUT --session-affinity-ttl-secs"
            r2.call("no_ttl_upsert_worker_1", "POST", "/workers", worker(1, zmq_base + 4), note=nt)
            r2.call("no_ttl_upsert_worker_2", "POST", "/workers", worker(2, zmq_base + 5), note=nt)
            assert pubs[4].wait_subscribed()
            seed_events(pubs[4], T, [1001, 1002, 1003, 1004])
            wait_overlap(no_ttl_port, T, 1, 4)
            r2.call("no_ttl_select_and_reserve_session_on_2", "POST", "/select_and_reserve",
                    {"token_ids": T, "selection_id": "nt-1", "session_id": "n",
                     "allowed_worker_ids": [2]}, note=nt)
            r2.call("no_ttl_select_same_session", "POST", "/select",
                    {"token_ids": T, "session_id": "n"},
                    note=nt + "; with the flag this would go to worker 2")
            r2.call("no_ttl_select_and_reserve_same_session", "POST", "/select_and_reserve",
                    {"token_ids": T, "selection_id": "nt-2", "session_id": "n"}, note=nt)
            r2.call("no_ttl_session_id_257_bytes", "POST", "/select",
                    {"token_ids": T, "session_id": "s" * 257},
                    note=nt + "; with the flag this is a 400")
            r2.call("no_ttl_session_context_wrong_type", "POST", "/select",
                    {"token_ids": T, "session_context": "n"}, note=nt)
        finally:
            svc2.stop()
        r.exchanges.extend(r2.exchanges)

        # ---- B: the TTL instance
        r.call("upsert_worker_1", "POST", "/workers", worker(1, zmq_base))
        r.call("upsert_worker_2", "POST", "/workers",
               worker(2, zmq_base + 1, total_kv_blocks=1000, max_num_batched_tokens=1000),
               note="capacities known, so decode_busy / prefill_busy are computed for worker 2 "
                    "(service env sets both busy thresholds to 0.5)")
        r.call("upsert_worker_3", "POST", "/workers", worker(3, zmq_base + 2))
        r.call("upsert_worker_4_other_model", "POST", "/workers",
               worker(4, zmq_base + 3, model_name="m2"))
        assert pubs[0].wait_subscribed()
        seed_events(pubs[0], T, [1001, 1002, 1003, 1004])
        wait_overlap(port, T, 1, 4)
        sel("select_no_session", note="worker 1 holds the prompt: the natural choice")

        # when is a binding made?
        sel("q_select_allowed_2", "q", allowed_worker_ids=[2])
        sel("q_select_again", "q", note="/select alone does not bind a session")
        sel("rp_select_with_selection_id_allowed_2", "rp", selection_id="rp-1",
            allowed_worker_ids=[2])
        sel("rp_select_before_replay", "rp", note="not bound yet")
        r.call("rp_replay", "POST", "/reservations", {"selection_id": "rp-1"})
        sel("rp_select_after_replay", "rp", note="replaying a /select that carried the session binds it")
        r.call("e_explicit_reservation_with_session_id", "POST", "/reservations",
               {"selection_id": "e-1", "worker_id": 2, "token_ids": T, "session_id": "e"},
               note="explicit bookings have no session fields (session_id ignored)")
        sel("e_select", "e", note="explicit booking did not bind")
        sar("b_select_and_reserve_allowed_2", "b", "b-1", allowed_worker_ids=[2])
        sel("b_select", "b", note="bound to worker 2 although worker 1 has 4 blocks of overlap")
        sel("b_select_session_context", None, session_context={"session_id": "b"})
        sar("b_select_and_reserve_again", "b", "b-2")
        sel("b_select_other_model", "b", model_name="m2",
            note="session tables are per partition: no binding in m2")

        # load on the bound worker
        r.call("book_big_on_worker_2", "POST", "/reservations",
               {"selection_id": "big-1", "worker_id": 2, "token_ids": list(range(1000, 5000)),
                "effective_prefill_tokens": 4000, "expected_output_tokens": 100})
        sel("no_session_allowed_2_3_after_load", None, allowed_worker_ids=[2, 3])
        sel("b_select_worker_2_loaded", "b",
            note="still worker 2: potential_decode_blocks 1005 of 1000, decode_busy")
        sel("b_select_advisory_worker_2_busy", "b", advisory=True,
            note="prefill_busy: 4000+ active prefill tokens of 1000")
        sel("b_select_allowed_2_3_worker_2_loaded", "b", allowed_worker_ids=[2, 3])
        sar("b_select_and_reserve_worker_2_loaded", "b", "b-3")
        sel("no_session_affinity_target_2_loaded", None, affinity_target={"worker_id": 2},
            note="affinity_target without a session: worker 2 despite its load")
        sel("no_session_affinity_target_2_rank_0", None,
            affinity_target={"worker_id": 2, "dp_rank": 0})
        sel("no_session_affinity_target_2_rank_5", None,
            affinity_target={"worker_id": 2, "dp_rank": 5})
        sel("no_session_affinity_target_unknown", None, affinity_target={"worker_id": 99})
        free("free_big_1", "big-1")

        # a bound session against allowed_worker_ids / pinned_worker / affinity_target
        sel("b_select_allowed_1", "b", allowed_worker_ids=[1])
        sel("b_select_after_allowed_1", "b", note="binding kept")
        sel("b_select_pinned_1", "b", pinned_worker={"worker_id": 1, "dp_rank": 0})
        sel("b_select_after_pinned_1", "b", note="binding kept")
        sel("b_select_affinity_target_1", "b", affinity_target={"worker_id": 1})
        sar("b_select_and_reserve_pinned_1", "b", "b-4", pinned_worker={"worker_id": 1, "dp_rank": 0})
        sel("b_select_after_reserve_pinned_1", "b", note="binding kept")
        sar("b_select_and_reserve_allowed_1", "b", "b-5", allowed_worker_ids=[1])
        free("b_free_rejected_booking", "b-5", note="the rejected request booked nothing")
        sel("b_select_after_rejected_reserve", "b", note="the rejection invalidated the binding")
        sar("b_select_and_reserve_rebinds", "b", "b-6")
        sel("b_select_after_rebind", "b")
        sar("b_select_and_reserve_affinity_target_2", "b", "b-7", affinity_target={"worker_id": 2})
        sel("b_select_after_affinity_target_reserve", "b")
        r.call("loads_bookings", "GET", "/loads")
        for sid in ("b-1", "b-2", "b-3", "b-4", "b-6", "b-7"):
            quiet_delete(port, f"/reservations/{sid}")

        # TTL: a live booking holds the binding; the TTL runs from its release
        sar("k_select_and_reserve_allowed_2", "k", "k-1", allowed_worker_ids=[2])
        time.sleep(ttl + 1.0)
        sel("k_select_booking_older_than_ttl", "k", note=f"booking held {ttl + 1.0} s > TTL {ttl} s")
        r.call("k_prefill_complete", "POST", "/reservations/k-1/prefill_complete")
        free("k_free", "k-1")
        free("rp_free", "rp-1")
        sel("k_select_right_after_free", "k")
        time.sleep(1.0)
        sel("k_select_1s_after_free", "k", note=f"1.0 s after free (TTL {ttl} s)")
        time.sleep(ttl + 0.5 - 1.0)
        sel("k_select_2_5s_after_free", "k",
            note=f"{ttl + 0.5} s after free: expired; the /select at 1.0 s did not refresh it")
        sel("rp_select_after_free_and_ttl", "rp", note="replay binding expired the same way")
        sar("m_select_and_reserve_allowed_2", "m", "m-1", allowed_worker_ids=[2])
        free("m_free_1", "m-1")
        time.sleep(1.0)
        sar("m_select_and_reserve_1s_later", "m", "m-2", note="1.0 s after the first free")
        free("m_free_2", "m-2")
        time.sleep(ttl + 0.5 - 1.0)
        sel("m_select_2_5s_after_first_free", "m",
            note=f"{ttl + 0.5} s after the first free, 1.5 s after the second: a booking refreshes")
        time.sleep(1.5)
        sel("m_select_3s_after_second_free", "m", note="expired")
        sar("m_select_and_reserve_after_expiry", "m", "m-3", note="binds anew (natural choice)")
        sel("m_select_after_new_binding", "m")
        free("m_free_3", "m-3")

        # session_final, parent_session_id, input_trigger
        sar("f_select_and_reserve_allowed_2", "f", "f-1", allowed_worker_ids=[2])
        sar("f_select_and_reserve_final", None, "f-2",
            session_context={"session_id": "f", "session_final": True})
        sel("f_select_after_final_booked", "f")
        free("f_free_final", "f-2")
        sel("f_select_after_final_freed", "f")
        free("f_free_first", "f-1")
        sel("f_select_after_all_freed", "f", note=f"within the {ttl} s TTL: still bound")
        sar("f0_first_request_final", None, "f0-1", allowed_worker_ids=[2],
            session_context={"session_id": "f0", "session_final": True})
        free("f0_free", "f0-1")
        sel("f0_select_after_free", "f0", note="a final first request still binds")
        sar("c_child_a_parent_p_allowed_2", None, "ca-1", allowed_worker_ids=[2],
            session_context={"session_id": "child-a", "parent_session_id": "P"})
        sel("c_child_b_same_parent", None,
            session_context={"session_id": "child-b", "parent_session_id": "P"},
            note="siblings do not share a binding")
        sel("c_child_a_again", None,
            session_context={"session_id": "child-a", "parent_session_id": "P"})
        sel("c_child_a_without_parent", "child-a", note="keyed on session_id alone")
        sel("c_parent_session", "P", note="the parent is not bound")
        sel("c_child_a_input_trigger", None,
            session_context={"session_id": "child-a", "input_trigger": "tool_result"})
        sel("c_session_context_wins_over_session_id", "P",
            session_context={"session_id": "child-a"})
        free("c_free", "ca-1")

        # the bound worker leaves / becomes incomplete
        sar("d_select_and_reserve_allowed_3", "d", "d-1", allowed_worker_ids=[3])
        sel("d_select", "d")
        r.call("d_delete_worker_3", "DELETE", "/workers/3")
        sel("d_select_after_delete", "d")
        sar("d_select_and_reserve_after_delete", "d", "d-2")
        r.call("d_readd_worker_3", "POST", "/workers", worker(3, zmq_base + 2))
        sel("d_select_after_readd", "d", note="stays on the new binding")
        free("d_free", "d-2")
        sar("u_select_and_reserve_allowed_2", "u", "u-1", allowed_worker_ids=[2])
        sar("u2_select_and_reserve_allowed_2", "u2", "u2-1", allowed_worker_ids=[2])
        r.call("u_patch_schedulable_false", "PATCH", "/workers/2", {"schedulable": False},
               note="not a Dynamo field: ignored")
        sel("u_select_after_schedulable_false", "u")
        r.call("u_patch_endpoint_empty", "PATCH", "/workers/2", {"endpoint": ""},
               note="makes worker 2 incomplete")
        sel("u_select_worker_incomplete", "u")
        sar("u2_select_and_reserve_worker_incomplete", "u2", "u2-2")
        r.call("u_loads_worker_incomplete", "GET", "/loads")
        free("u_free_booking_of_incomplete_worker", "u-1")
        r.call("u_patch_endpoint_back", "PATCH", "/workers/2", {"endpoint": "http://worker-2:8000"})
        sel("u_select_worker_back", "u", note=f"within {ttl} s of the worker leaving")
        sel("u2_select_worker_back", "u2")
        free("u2_free", "u2-2")

        # empty and long ids
        sar("empty_session_id_select_and_reserve_allowed_3", "", "emp-1", allowed_worker_ids=[3])
        sel("empty_session_id_select", "", note="an empty session_id is a session like any other")
        free("empty_free", "emp-1")
        sel("session_id_256_bytes", "s" * 256)
        sel("session_id_257_bytes", "s" * 257)
        sar("select_and_reserve_session_id_257_bytes", "s" * 257, "long-1")
        sel("session_context_session_id_257_bytes", None, session_context={"session_id": "s" * 257})

        # malformed session fields
        bad = [
            ("session_id_number", {"session_id": 5}),
            ("session_id_null", {"session_id": None}),
            ("session_context_string", {"session_context": "x"}),
            ("session_context_null", {"session_context": None}),
            ("session_context_empty", {"session_context": {}}),
            ("session_context_session_id_number", {"session_context": {"session_id": 5}}),
            ("session_context_bad_input_trigger", {"session_context": {"session_id": "a", "input_trigger": "bogus"}}),
            ("session_context_session_final_string", {"session_context": {"session_id": "a", "session_final": "yes"}}),
            ("session_context_parent_number", {"session_context": {"session_id": "a", "parent_session_id": 5}}),
            ("session_context_unknown_field", {"session_context": {"session_id": "a", "nope": 1}}),
            ("affinity_target_no_worker_id", {"affinity_target": {"dp_rank": 0}}),
            ("affinity_target_string", {"affinity_target": "1"}),
        ]
        for name, extra in bad:
            sel(f"bad_select_{name}", None, **extra)
        sar("bad_select_and_reserve_session_id_number", None, "bad-1", session_id=5)
        sar("bad_select_and_reserve_session_context_empty", None, "bad-2", session_context={})
        return {"cli": session_cli_checks(port + 2)}
    finally:
        for p in pubs:
            p.close()


def scenario_constraints(r, port, zmq_base):
    """Worker taints / topology_domains and request routing_constraints. Worker 1 holds
    TOKENS_17 (4 GPU blocks) and has no taints; 2 and 3 hold nothing."""
    T = TOKENS_17
    pubs = [FakeEnginePublisher(zmq_base + i) for i in range(5)]

    def sel(name, rc=_NO_BODY, note=None, **extra):
        body = {"token_ids": T}
        if rc is not _NO_BODY:
            body["routing_constraints"] = rc
        body.update(extra)
        return r.call(name, "POST", "/select", body, note=note)

    try:
        r.call("upsert_worker_1_no_taints", "POST", "/workers", worker(1, zmq_base))
        r.call("upsert_worker_2_taints_topology", "POST", "/workers", worker(
            2, zmq_base + 1, taints=["gpu=h100", "pref"], topology_domains={"zone": "a", "rack": "r1"}))
        r.call("upsert_worker_3_taints_topology", "POST", "/workers", worker(
            3, zmq_base + 2, taints=["gpu=a100", "other"], topology_domains={"zone": "b"}))
        r.call("upsert_worker_4_reserved_topology_taint", "POST", "/workers", worker(
            4, zmq_base + 3, model_name="m-topo", taints=["dynamo.topology/zone=c"],
            topology_domains={"zone": "a"}),
            note="a caller-supplied dynamo.topology/ taint that disagrees with topology_domains")
        r.call("upsert_worker_5_kv_transfer_fields", "POST", "/workers", worker(
            5, zmq_base + 4, model_name="m-kvt", topology_domains={"zone": "a"},
            kv_transfer_domain="zone", kv_transfer_enforcement="required",
            kv_transfer_preferred_weight=1.5))
        r.call("upsert_duplicate_taints", "POST", "/workers",
               worker(9, zmq_base + 4, model_name="m-dup", taints=["a", "a"]))
        r.call("list_workers", "GET", "/workers")
        assert pubs[0].wait_subscribed()
        seed_events(pubs[0], T, [1001, 1002, 1003, 1004])
        wait_overlap(port, T, 1, 4)
        sel("no_constraints", note="worker 1 (overlap) wins")
        # required_taints: hard filter
        sel("required_gpu_h100", {"required_taints": ["gpu=h100"]})
        sel("required_gpu_a100", {"required_taints": ["gpu=a100"]})
        sel("required_two_taints_same_worker", {"required_taints": ["gpu=h100", "pref"]})
        sel("required_two_taints_no_worker", {"required_taints": ["gpu=h100", "gpu=a100"]})
        sel("required_unknown_taint", {"required_taints": ["nope"]})
        sel("required_empty_list", {"required_taints": []})
        sel("required_duplicate_entries", {"required_taints": ["pref", "pref"]})
        sel("required_topology_taint_from_domains", {"required_taints": ["dynamo.topology/zone=a"]},
            note="topology_domains are not turned into taints")
        sel("required_literal_topology_taint", {"required_taints": ["dynamo.topology/zone=c"]},
            model_name="m-topo")
        sel("required_topology_taint_from_domains_m_topo", {"required_taints": ["dynamo.topology/zone=a"]},
            model_name="m-topo")
        sel("required_with_pinned_untainted_worker", {"required_taints": ["gpu=h100"]},
            pinned_worker={"worker_id": 1, "dp_rank": 0})
        sel("required_with_pinned_tainted_worker", {"required_taints": ["gpu=h100"]},
            pinned_worker={"worker_id": 2, "dp_rank": 0})
        sel("required_with_allowed_excluding_match", {"required_taints": ["gpu=h100"]},
            allowed_worker_ids=[1, 3])
        sel("required_with_affinity_target_untainted", {"required_taints": ["gpu=h100"]},
            affinity_target={"worker_id": 1}, note="the ineligible target is ignored")
        r.call("select_and_reserve_required", "POST", "/select_and_reserve",
               {"token_ids": T, "selection_id": "c-1", "routing_constraints": {"required_taints": ["gpu=a100"]}})
        r.call("select_and_reserve_required_no_worker", "POST", "/select_and_reserve",
               {"token_ids": T, "selection_id": "c-2", "routing_constraints": {"required_taints": ["nope"]}})
        r.call("free_c1", "DELETE", "/reservations/c-1")
        r.call("overlap_scores_ignore_constraints", "POST", "/overlap_scores",
               {"token_ids": T, "routing_constraints": {"required_taints": ["nope"]}})
        r.call("potential_loads_ignore_constraints", "POST", "/potential_loads",
               {"token_ids": T, "routing_constraints": {"required_taints": ["nope"]}})
        # preferred_taints: cost multiplier exp(-tanh(sum of matching weights))
        sel("preferred_pref_0_5", {"preferred_taints": {"pref": 0.5}}, note="multiplier 0.65 on worker 2: not enough")
        sel("preferred_pref_1_0", {"preferred_taints": {"pref": 1.0}}, note="multiplier 0.47 on worker 2: enough")
        sel("preferred_pref_5", {"preferred_taints": {"pref": 5.0}})
        sel("preferred_pref_1e39", {"preferred_taints": {"pref": 1e39}})
        sel("preferred_pref_negative", {"preferred_taints": {"pref": -5.0}})
        sel("preferred_zero_weight", {"preferred_taints": {"pref": 0.0}})
        sel("preferred_unmatched_taint", {"preferred_taints": {"nope": 5.0}})
        sel("preferred_opposite_weights_cancel", {"preferred_taints": {"pref": 5.0, "gpu=h100": -5.0}},
            note="both on worker 2: sum 0, multiplier 1")
        sel("preferred_worker_3_heavier", {"preferred_taints": {"pref": 1.0, "other": 2.0}},
            allowed_worker_ids=[2, 3])
        sel("preferred_worker_2_heavier", {"preferred_taints": {"pref": 2.0, "other": 1.0}},
            allowed_worker_ids=[2, 3])
        sel("required_and_preferred", {"required_taints": ["gpu=a100"], "preferred_taints": {"pref": 5.0}})
        r.call("patch_worker_1_taint_spot", "PATCH", "/workers/1", {"taints": ["spot"]})
        sel("preferred_spot_minus_0_5", {"preferred_taints": {"spot": -0.5}}, allowed_worker_ids=[1, 2],
            note="multiplier 1.59 on worker 1: not enough")
        sel("preferred_spot_minus_1_0", {"preferred_taints": {"spot": -1.0}}, allowed_worker_ids=[1, 2],
            note="multiplier 2.14 on worker 1: enough")
        sel("required_spot_after_patch", {"required_taints": ["spot"]})
        r.call("patch_worker_1_clear_taints", "PATCH", "/workers/1", {"taints": []})
        sel("required_spot_after_clear", {"required_taints": ["spot"]})
        r.call("patch_worker_1_topology", "PATCH", "/workers/1", {"topology_domains": {"zone": "z"}})
        sel("required_topology_taint_after_patch", {"required_taints": ["dynamo.topology/zone=z"]})
        # a session bound to a worker the constraints exclude
        r.call("t_select_and_reserve_session_on_1", "POST", "/select_and_reserve",
               {"token_ids": T, "selection_id": "t-1", "session_id": "t"})
        sel("t_select_required_excludes_bound_worker", {"required_taints": ["gpu=h100"]}, session_id="t")
        sel("t_select_after", session_id="t", note="binding kept")
        sel("t_select_preferred_away_from_bound_worker", {"preferred_taints": {"pref": 5.0}}, session_id="t")
        r.call("t_select_and_reserve_required_excludes_bound_worker", "POST", "/select_and_reserve",
               {"token_ids": T, "selection_id": "t-2", "session_id": "t",
                "routing_constraints": {"required_taints": ["gpu=h100"]}})
        sel("t_select_after_rejected_reserve", session_id="t")
        for sid in ("t-1", "t-2"):
            quiet_delete(port, f"/reservations/{sid}")
        # shapes
        sel("sequence_form_required", [["gpu=h100"]], note="serde also accepts a struct as a sequence")
        sel("sequence_form_empty", [])
        sel("sequence_form_preferred", [[], {"pref": 5.0}])
        sel("unknown_constraint_key", {"required_taints": [], "tolerations": ["x"]})
        sel("topology_constraint_key", {"topology": {"zone": "a"}})
        for name, rc in [
            ("routing_constraints_string", "x"),
            ("routing_constraints_null", None),
            ("required_taints_string", {"required_taints": "gpu=h100"}),
            ("required_taints_number_item", {"required_taints": [1]}),
            ("required_taints_null", {"required_taints": None}),
            ("preferred_taints_list", {"preferred_taints": ["pref"]}),
            ("preferred_weight_string", {"preferred_taints": {"pref": "high"}}),
            ("preferred_weight_null", {"preferred_taints": {"pref": None}}),
            ("sequence_form_too_long", [[], {}, 1]),
        ]:
            sel(f"bad_{name}", rc)
        for name, extra in [
            ("taints_string", {"taints": "gpu"}),
            ("taints_number_item", {"taints": [1]}),
            ("taints_null", {"taints": None}),
            ("topology_domains_list", {"topology_domains": ["a"]}),
            ("topology_domains_number_value", {"topology_domains": {"zone": 5}}),
            ("kv_transfer_enforcement_unknown", {"kv_transfer_enforcement": "strict"}),
            ("kv_transfer_preferred_weight_string", {"kv_transfer_preferred_weight": "x"}),
        ]:
            r.call(f"bad_worker_{name}", "POST", "/workers",
                   worker(10, zmq_base + 4, model_name="m-bad", **extra))
        r.call("bad_patch_taints_string", "PATCH", "/workers/1", {"taints": "gpu"})
    finally:
        for p in pubs:
            p.close()


def block_hashes_via_python_api(tokens, block_mm_infos=None, is_eagle=None):
    """Dynamo's own local block hashes (dynamo.llm.compute_block_hash_for_seq), for notes."""
    code = ("import json,sys; from dynamo.llm import compute_block_hash_for_seq as h; "
            "a=json.load(sys.stdin); print(json.dumps(h(a[0], 4, a[1], None, a[2])))")
    out = subprocess.run([RUNTIME["python"], "-c", code], input=json.dumps([tokens, block_mm_infos, is_eagle]),
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def scenario_multimodal(r, port, zmq_base):
    """block_mm_infos / mm_routing_info / is_eagle. Events carry MM info either in Dynamo's own
    block_mm_infos (array position 9) or in vLLM's extra_keys (position 8)."""
    T = TOKENS_17
    pubs = [FakeEnginePublisher(zmq_base + i) for i in range(7)]
    mm_x, mm_y = 0xDEADBEEF, 0xCAFE

    def info(mm_hash, offsets=None):
        return {"mm_objects": [{"mm_hash": mm_hash, "offsets": offsets if offsets is not None else [[0, 3]]}]}

    marked_x = f"{mm_x:016x}" + "0" * 48  # Dynamo's marker form: 16 hex digits + 48 zeros
    native_x = f"{mm_x:016x}" + "ab" * 24  # a 64-hex vLLM hash without the marker padding

    def ov(name, note=None, **extra):
        body = {"token_ids": T}
        body.update(extra)
        body = {k: v for k, v in body.items() if v is not None or k != "token_ids"}
        return r.call(name, "POST", "/overlap_scores", body, note=note)

    try:
        r.call("upsert_worker_1", "POST", "/workers", worker(1, zmq_base),
               note="events: 4 blocks, block 0 with mm X via block_mm_infos (position 9)")
        r.call("upsert_worker_2", "POST", "/workers", worker(2, zmq_base + 1),
               note="events: 3 blocks, block 0 with mm X via extra_keys marker string")
        r.call("upsert_worker_3", "POST", "/workers", worker(3, zmq_base + 2),
               note="events: 4 blocks, block 0 extra_keys = native 64-hex id (not the marker form)")
        r.call("upsert_worker_4", "POST", "/workers", worker(4, zmq_base + 3),
               note="events: 2 blocks, block 0 with mm X via extra_keys [marker, start_offset] pair")
        r.call("upsert_worker_5", "POST", "/workers", worker(5, zmq_base + 4),
               note="events: 1 block, no extras")
        r.call("upsert_worker_6", "POST", "/workers", worker(6, zmq_base + 5),
               note="events: 4 blocks, extra_keys block 0 = dynamo-cache-salt:salt-1")
        for p in pubs[:6]:
            assert p.wait_subscribed()
        pubs[0].publish([block_stored([1001, 1002, 1003, 1004], None, T[:16], 4, "GPU",
                                      block_mm_infos=[info(mm_x), None, None, None])])
        pubs[1].publish([block_stored([2001, 2002, 2003], None, T[:12], 4, "GPU",
                                      extra_keys=[[marked_x], None, None])])
        pubs[2].publish([block_stored([3001, 3002, 3003, 3004], None, T[:16], 4, "GPU",
                                      extra_keys=[[native_x], None, None, None])])
        pubs[3].publish([block_stored([4001, 4002], None, T[:8], 4, "GPU",
                                      extra_keys=[[[marked_x, 0]], None])])
        pubs[4].publish([block_stored([5001], None, T[:4], 4, "GPU")])
        pubs[5].publish([block_stored([6001, 6002, 6003, 6004], None, T[:16], 4, "GPU",
                                      extra_keys=[["dynamo-cache-salt:salt-1"], None, None, None])])
        wait_overlap(port, T, 3, 4)
        time.sleep(1.0)
        plain = block_hashes_via_python_api(T)
        with_x = block_hashes_via_python_api(T, [info(mm_x), None, None, None])
        with_y = block_hashes_via_python_api(T, [info(mm_y), None, None, None])
        r.call("dump", "GET", "/dump", note=(
            f"compute_block_hash_for_seq(TOKENS_17, 4): plain {plain}, mm X on block 0 {with_x}, "
            f"mm Y on block 0 {with_y}; offsets do not enter the hash"))
        ov("overlap_plain_tokens")
        ov("overlap_mm_x", block_mm_infos=[info(mm_x), None, None, None])
        ov("overlap_mm_x_list_shorter_than_blocks", block_mm_infos=[info(mm_x)])
        ov("overlap_mm_x_list_longer_than_blocks", block_mm_infos=[info(mm_x)] + [None] * 10)
        ov("overlap_mm_x_other_offsets", block_mm_infos=[info(mm_x, [[1, 2]]), None, None, None])
        ov("overlap_mm_x_empty_offsets", block_mm_infos=[info(mm_x, [])])
        ov("overlap_mm_y", block_mm_infos=[info(mm_y), None, None, None])
        ov("overlap_mm_x_on_block_2", block_mm_infos=[None, None, info(mm_x), None])
        ov("overlap_empty_mm_objects", block_mm_infos=[{"mm_objects": []}],
           note="no objects = no MM content")
        ov("overlap_two_objects", block_mm_infos=[{"mm_objects": [
            {"mm_hash": mm_x, "offsets": []}, {"mm_hash": mm_y, "offsets": []}]}])
        ov("overlap_block_mm_infos_null", block_mm_infos=None)
        ov("overlap_cache_salt", cache_salt="salt-1")
        ov("overlap_mm_routing_info_x", token_ids=[9, 9, 9, 9],
           mm_routing_info={"routing_token_ids": T, "block_mm_infos": [info(mm_x)]},
           note="routing_token_ids replace token_ids for routing")
        ov("overlap_mm_routing_info_without_mm", token_ids=[9, 9, 9, 9],
           mm_routing_info={"routing_token_ids": T})
        ov("overlap_mm_routing_info_empty_routing_tokens",
           mm_routing_info={"routing_token_ids": [], "block_mm_infos": [info(mm_x)]},
           note="empty routing_token_ids: token_ids used, mm_routing_info ignored entirely")
        ov("overlap_mm_routing_info_and_top_level_block_mm_infos",
           mm_routing_info={"routing_token_ids": T}, block_mm_infos=[info(mm_x)],
           note="top-level block_mm_infos ignored when mm_routing_info is used")
        r.call("overlap_mm_routing_info_only", "POST", "/overlap_scores",
               {"mm_routing_info": {"routing_token_ids": T, "block_mm_infos": [info(mm_x)]}})
        r.call("overlap_hashes_with_block_mm_infos", "POST", "/overlap_scores", {
            "block_hashes": LOCAL_HASHES_I64, "sequence_hashes": SEQ_HASHES_I64, "isl_tokens": 17,
            "block_mm_infos": [info(mm_x)]}, note="explicit hashes: block_mm_infos ignored")
        r.call("select_plain", "POST", "/select", {"token_ids": T})
        r.call("select_mm_x", "POST", "/select", {"token_ids": T, "block_mm_infos": [info(mm_x)]})
        r.call("select_mm_routing_info_only", "POST", "/select",
               {"mm_routing_info": {"routing_token_ids": T, "block_mm_infos": [info(mm_x)]}})
        r.call("select_cache_salt", "POST", "/select", {"token_ids": T, "cache_salt": "salt-1"})
        r.call("select_and_reserve_mm_x", "POST", "/select_and_reserve",
               {"token_ids": T, "selection_id": "mx-1", "block_mm_infos": [info(mm_x)]})
        r.call("reservation_explicit_mm_routing_info", "POST", "/reservations", {
            "selection_id": "mx-2", "worker_id": 1,
            "mm_routing_info": {"routing_token_ids": T, "block_mm_infos": [info(mm_x)]}})
        r.call("potential_loads_mm_x", "POST", "/potential_loads",
               {"token_ids": T, "block_mm_infos": [info(mm_x)]},
               note="list order is not by worker_id")
        r.call("loads_after_bookings", "GET", "/loads")
        quiet_delete(port, "/reservations/mx-1")
        quiet_delete(port, "/reservations/mx-2")
        # Eagle
        eagle = block_hashes_via_python_api(T, None, True)
        ov("overlap_is_eagle_true", is_eagle=True,
           note=f"Eagle local hashes of TOKENS_17 (windows of 5, stride 4): {eagle}")
        ov("overlap_is_eagle_false", is_eagle=False)
        ov("overlap_is_eagle_null", is_eagle=None)
        r.call("upsert_eagle_worker", "POST", "/workers",
               worker(7, zmq_base + 6, model_name="m-eagle", is_eagle=True))
        assert pubs[6].wait_subscribed()
        pubs[6].publish([block_stored([7001, 7002, 7003, 7004], None, T, 4, "GPU")])
        time.sleep(1.0)
        r.call("dump_eagle_partition", "GET", "/dump",
               note="the event's blocks get non-Eagle local hashes although the worker is_eagle")
        ov("overlap_eagle_partition_default", model_name="m-eagle",
           note="request default follows the worker's is_eagle")
        ov("overlap_eagle_partition_is_eagle_false", model_name="m-eagle", is_eagle=False)
        ov("overlap_eagle_partition_is_eagle_true", model_name="m-eagle", is_eagle=True)
        r.call("select_eagle_partition_default", "POST", "/select",
               {"token_ids": T, "model_name": "m-eagle"})
        # malformed
        bad = [
            ("block_mm_infos_string", {"block_mm_infos": "x"}),
            ("block_mm_infos_object", {"block_mm_infos": {"mm_objects": []}}),
            ("block_mm_infos_item_missing_mm_objects", {"block_mm_infos": [{}]}),
            ("mm_hash_string", {"block_mm_infos": [{"mm_objects": [{"mm_hash": "abc", "offsets": []}]}]}),
            ("mm_object_missing_offsets", {"block_mm_infos": [{"mm_objects": [{"mm_hash": 1}]}]}),
            ("mm_object_missing_mm_hash", {"block_mm_infos": [{"mm_objects": [{"offsets": []}]}]}),
            ("mm_hash_negative", {"block_mm_infos": [{"mm_objects": [{"mm_hash": -1, "offsets": []}]}]}),
            ("mm_hash_above_u64", {"block_mm_infos": [{"mm_objects": [{"mm_hash": 18446744073709551616, "offsets": []}]}]}),
            ("offsets_pair_of_one", {"block_mm_infos": [{"mm_objects": [{"mm_hash": 1, "offsets": [[1]]}]}]}),
            ("offsets_triple", {"block_mm_infos": [{"mm_objects": [{"mm_hash": 1, "offsets": [[1, 2, 3]]}]}]}),
            ("offsets_negative", {"block_mm_infos": [{"mm_objects": [{"mm_hash": 1, "offsets": [[-1, 2]]}]}]}),
            ("mm_routing_info_string", {"mm_routing_info": "x"}),
            ("mm_routing_info_empty", {"mm_routing_info": {}}),
            ("mm_routing_info_block_mm_infos_null", {"mm_routing_info": {"routing_token_ids": T, "block_mm_infos": None}}),
            ("mm_routing_info_negative_token", {"mm_routing_info": {"routing_token_ids": [-1]}}),
            ("is_eagle_string", {"is_eagle": "yes"}),
        ]
        for name, extra in bad:
            r.call(f"bad_select_{name}", "POST", "/select", {"token_ids": T, **extra})
        r.call("overlap_mm_hash_u64_max", "POST", "/overlap_scores", {
            "token_ids": T, "block_mm_infos": [{"mm_objects": [{"mm_hash": 18446744073709551615, "offsets": []}]}]})
        r.call("bad_overlap_mm_object_missing_offsets", "POST", "/overlap_scores",
               {"token_ids": T, "block_mm_infos": [{"mm_objects": [{"mm_hash": 1}]}]})
        r.call("bad_worker_is_eagle_string", "POST", "/workers",
               worker(8, zmq_base + 6, model_name="m-bad", is_eagle="yes"))
    finally:
        for p in pubs:
            p.close()


# ------------------------------------------------------------------------------ queueing
# Dynamo's router queue: with DYN_ROUTER_QUEUE_THRESHOLD=F set, a selection waits while every
# eligible worker has active prefill tokens > F x max_num_batched_tokens. The scenario uses one
# worker with max_num_batched_tokens 64 and F = 0.5, so a worker is busy above 32 active prefill
# tokens; each queued request carries > 32 tokens, so admitting it makes the worker busy again and
# exactly one request leaves the queue per release (prefill_complete or DELETE).
QUEUE_THRESHOLD = "0.5"
QUEUE_MNBT = 64
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
QUEUE_POLICY_YAML = """\
default_policy_family: main
uncached_isl_buckets:
  - min_tokens: 0
    bucket: all
policy_classes:
  - name: main
    policy_family: main
    cache_bucket: all
    queue_policy: fcfs
    quantum: 10
    prefill_busy_threshold_frac: 0.5
    request_queue_limit_per_worker: 2
"""


def http_raw(port, method, path, body=_NO_BODY, timeout=30):
    """One request, not recorded: (status, content_type, parsed body). Status None = no HTTP
    response (timeout, reset); the body is then the exception's class name and text."""
    data = None if body is _NO_BODY else json.dumps(body).encode()
    headers = {"content-type": "application/json"} if data is not None else {}
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data, method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, ctype, text = resp.status, resp.headers.get("content-type"), resp.read()
    except urllib.error.HTTPError as err:
        status, ctype, text = err.code, err.headers.get("content-type"), err.read()
    except (OSError, http.client.HTTPException) as err:
        return None, None, f"{type(err).__name__}: {err}"
    text = text.decode("utf-8", "replace")
    try:
        return status, ctype, (json.loads(text) if text else None)
    except ValueError:
        return status, ctype, text


class Waiting:
    """A request sent from a thread, so that it can sit in Dynamo's queue while the scenario goes
    on. `entry()` turns it into an exchange in the usual shape once it has completed."""

    def __init__(self, port, name, method, path, body, timeout=30):
        self.name, self.method, self.path, self.body = name, method, path, body
        self.sent_at = time.monotonic()
        self.done_at = None
        self.status = self.ctype = self.response = None
        self.thread = threading.Thread(target=self._run, args=(port, timeout), daemon=True)
        self.thread.start()

    def _run(self, port, timeout):
        self.status, self.ctype, self.response = http_raw(port, self.method, self.path, self.body,
                                                          timeout)
        self.done_at = time.monotonic()

    def done(self):
        return self.done_at is not None

    def entry(self, note):
        e = {"name": self.name, "method": self.method, "path": self.path, "request": self.body,
             "note": note, "status": self.status}
        if self.ctype not in (None, "application/json"):
            e["response_content_type"] = self.ctype
        e["response"] = self.response
        return e


def raw_http_open(port, path, body):
    """Send a request on a raw socket and leave it open: closing the socket is the client
    disconnect."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((HOST, port), timeout=5)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def queue_loads(port, model="default"):
    """(pending_count, pending_isl_tokens, {worker_id: active prefill}) of one partition."""
    for part in quiet_get(port, "/loads"):
        if part["model_name"] == model:
            return (part["pending_count"], part["pending_isl_tokens"],
                    {l["worker_id"]: l["potential_prefill_tokens"] for l in part["loads"]})
    return None


def wait_pending(port, count, model="default", timeout=5.0):
    if not wait_until(lambda: queue_loads(port, model)[0] == count, timeout):
        raise RuntimeError(f"pending_count never reached {count} ({queue_loads(port, model)})")


def settle(waiting, known, timeout=5.0, quiet=0.4):
    """Wait until at least one request not in `known` completed and no other completion followed
    for `quiet` seconds (bounded by `timeout`); return the newly completed ones by time."""
    deadline = time.monotonic() + timeout
    last_change, seen = None, set(known)
    while time.monotonic() < deadline:
        now_done = {w.name for w in waiting if w.done()}
        if now_done - seen:
            seen, last_change = now_done, time.monotonic()
        if last_change is not None and time.monotonic() - last_change >= quiet:
            break
        time.sleep(0.05)
    new = [w for w in waiting if w.done() and w.name not in known]
    return sorted(new, key=lambda w: w.done_at)


def run_order(r, port, policy, name, requests, model="default"):
    """Book a blocker (explicit, never queued), queue `requests` one at a time (each confirmed in
    /loads pending_count before the next is sent, 0.3 s apart, so send order = enqueue order),
    then release: prefill_complete the blocker, wait for the queue to settle, prefill_complete
    the booking(s) just admitted, and so on until the queue is empty. Returns the `orders` item
    (short request names); the queued requests become exchanges `{name}_queued_{short}` (booking
    id `{name}-{short}`) in completion order."""
    prefix = f"{name}_"
    blk = f"{name}-blocker"
    r.call(prefix + "book_blocker", "POST", "/reservations", {
        "model_name": model, "selection_id": blk, "worker_id": 1,
        "token_ids": list(range(90000, 90040)), "effective_prefill_tokens": 40},
        note="explicit booking: 40 active prefill tokens > 0.5 x 64, the worker is busy")
    waiting, sent, short = [], [], {}
    t0 = time.monotonic()
    for i, req in enumerate(requests):
        body = {k: v for k, v in req.items() if k not in ("name", "route")}
        body.setdefault("model_name", model)
        route = req.get("route", "/select_and_reserve")
        if route == "/select_and_reserve":
            body["selection_id"] = f"{name}-{req['name']}"
        w = Waiting(port, f"{prefix}queued_{req['name']}", "POST", route, body)
        short[w.name] = req["name"]
        waiting.append(w)
        wait_pending(port, i + 1, model)
        item = {"name": req["name"], "route": route,
                "isl_tokens": body.get("isl_tokens", len(body.get("token_ids", []))),
                "t_ms": round((time.monotonic() - t0) * 1000)}
        for k in ("priority_jump", "strict_priority"):
            if k in body:
                item[k] = body[k]
        sent.append(item)
        time.sleep(0.3)
    if any(w.done() for w in waiting):
        raise RuntimeError(f"{name}: a request completed before the release")
    r.call(prefix + "loads_all_queued", "GET", "/loads",
           note=f"{len(requests)} requests queued behind the blocker")
    pending = queue_loads(port, model)
    steps, done_names, release = [], set(), [blk]
    while len(done_names) < len(waiting) and len(steps) < len(requests) + 2:
        t_rel = time.monotonic()
        for rid in release:
            r.call(f"{prefix}release_{len(steps) + 1}_prefill_complete_{rid.split('-')[-1]}",
                   "POST", f"/reservations/{rid}/prefill_complete")
        # Within one release the completion order is sub-millisecond noise (requests admitted
        # by one drain answer together): list them in send order.
        new = sorted(settle(waiting, done_names), key=waiting.index)
        done_names |= {w.name for w in new}
        after = queue_loads(port, model)
        steps.append({"release": [f"prefill_complete {rid.split('-')[-1]}" for rid in release],
                      "completed": [{"name": short[w.name], "status": w.status,
                                     "worker_id": w.response.get("worker_id")
                                     if isinstance(w.response, dict) else None,
                                     "t_ms": round((w.done_at - t_rel) * 1000)} for w in new],
                      "pending_count_after": after[0], "pending_isl_tokens_after": after[1]})
        for w in new:
            r.exchanges.append(w.entry(
                f"queued ({policy}); completed {round((w.done_at - t_rel) * 1000)} ms after "
                f"release {len(steps)}"))
        release = [w.body["selection_id"] for w in new
                   if w.path == "/select_and_reserve" and w.status == 200]
        if (not new or not release) and len(done_names) < len(waiting):
            raise RuntimeError(f"{name}: queue stalled: {steps}")
    for w in waiting:
        w.thread.join(5)
    for rid in [blk] + [w.body["selection_id"] for w in waiting if "selection_id" in w.body]:
        quiet_delete(port, f"/reservations/{rid}")
    completed = [c["name"] for s in steps for c in s["completed"]]
    return {"name": name, "policy": policy, "model_name": model, "sent": sent,
            "pending_count": pending[0], "pending_isl_tokens": pending[1],
            "steps": steps, "completed": completed}


def queue_env_checks(port):
    """Start the service with queue env values; when it starts, book 40 tokens on a 64-token
    worker and send one /select_and_reserve with a 2 s client timeout: `queued` = it timed out."""
    python = RUNTIME["python"]
    cases = [
        ("threshold_0_5", {"DYN_ROUTER_QUEUE_THRESHOLD": "0.5"}),
        ("threshold_0", {"DYN_ROUTER_QUEUE_THRESHOLD": "0"}),
        ("threshold_2", {"DYN_ROUTER_QUEUE_THRESHOLD": "2"}),
        ("threshold_inf", {"DYN_ROUTER_QUEUE_THRESHOLD": "inf"}),
        ("threshold_1e400", {"DYN_ROUTER_QUEUE_THRESHOLD": "1e400"}),
        ("threshold_negative", {"DYN_ROUTER_QUEUE_THRESHOLD": "-1"}),
        ("threshold_nan", {"DYN_ROUTER_QUEUE_THRESHOLD": "nan"}),
        ("threshold_not_a_number", {"DYN_ROUTER_QUEUE_THRESHOLD": "abc"}),
        ("threshold_leading_space", {"DYN_ROUTER_QUEUE_THRESHOLD": " 0.5"}),
        ("threshold_empty", {"DYN_ROUTER_QUEUE_THRESHOLD": ""}),
        ("policy_lcfs", {"DYN_ROUTER_QUEUE_THRESHOLD": "0.5", "DYN_ROUTER_QUEUE_POLICY": "lcfs"}),
        ("policy_wspt", {"DYN_ROUTER_QUEUE_THRESHOLD": "0.5", "DYN_ROUTER_QUEUE_POLICY": "wspt"}),
        ("policy_uppercase", {"DYN_ROUTER_QUEUE_THRESHOLD": "0.5", "DYN_ROUTER_QUEUE_POLICY": "LCFS"}),
        ("policy_unknown", {"DYN_ROUTER_QUEUE_THRESHOLD": "0.5", "DYN_ROUTER_QUEUE_POLICY": "bogus"}),
        ("policy_empty", {"DYN_ROUTER_QUEUE_THRESHOLD": "0.5", "DYN_ROUTER_QUEUE_POLICY": ""}),
        ("policy_without_threshold", {"DYN_ROUTER_QUEUE_POLICY": "wspt"}),
    ]
    results = []
    for name, env in cases:
        proc = subprocess.Popen([python, "-m", "dynamo.select_service", "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "NO_COLOR": "1", **env})
        started = False
        deadline = time.time() + 30
        while time.time() < deadline and proc.poll() is None:
            started = http_raw(port, "GET", "/health", timeout=1)[0] == 200
            if started:
                break
            time.sleep(0.2)
        entry = {"name": name, "env": env, "started": started}
        if started:
            http_raw(port, "POST", "/workers", worker(1, 27000, max_num_batched_tokens=QUEUE_MNBT))
            http_raw(port, "POST", "/reservations", {
                "selection_id": "blk", "worker_id": 1, "token_ids": list(range(1000, 1040)),
                "effective_prefill_tokens": 40})
            st, _, _ = http_raw(port, "POST", "/select_and_reserve",
                                {"selection_id": "probe", "token_ids": list(range(2000, 2040))},
                                timeout=2)
            entry["queued"] = st is None
            proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if started:
            entry["exit_code_after_sigint"] = proc.returncode
        text = ANSI_RE.sub("", out.decode("utf-8", "replace"))
        lines = text.splitlines()
        entry["warnings"] = [l.split(": ", 1)[1] for l in lines
                             if " WARN " in l and "scheduling::config" in l]
        cls = [l.split("Router policy class configured", 1)[1].strip() for l in lines
               if "Router policy class configured" in l]
        if cls:
            entry["policy_class_log"] = cls[0]
        if not started:
            entry["exit_code"] = proc.returncode
            entry["exception"] = lines[-1] if lines else ""
        results.append(entry)
    return results


def scenario_queue(r, port, zmq_base):
    """Router queue (admission) with DYN_ROUTER_QUEUE_THRESHOLD=0.5 and DYN_ROUTER_QUEUE_POLICY
    fcfs (this instance), lcfs and wspt (instances on port+1 / port+2). Extra lists: `orders`
    (release order per policy), `events` (disconnects, long wait, shutdown), `env` (knobs)."""
    orders, events = [], []
    pub = FakeEnginePublisher(zmq_base + 20)
    fresh = iter(range(100000, 10**9, 1000))

    def toks(n):  # n tokens no other request shares
        base = next(fresh)
        return list(range(base, base + n))

    def q(name, n, **extra):
        return {"name": name, "token_ids": toks(n), **extra}

    try:
        # ------------------------------------------------------------ fcfs instance (this one)
        r.call("upsert_worker_1", "POST", "/workers",
               worker(1, zmq_base, max_num_batched_tokens=QUEUE_MNBT),
               note=f"service env DYN_ROUTER_QUEUE_THRESHOLD={QUEUE_THRESHOLD} "
                    "DYN_ROUTER_QUEUE_POLICY=fcfs: busy above 32 active prefill tokens")
        r.call("loads_idle", "GET", "/loads")
        orders.append(run_order(r, port, "fcfs", "fcfs_plain", [
            q("a", 40), q("b", 60), q("c", 36), q("d", 50)]))
        orders.append(run_order(r, port, "fcfs", "fcfs_priority_jump", [
            q("a", 40), q("b", 40, priority_jump=0.1), q("c", 40, priority_jump=5.0),
            q("d", 40, priority_jump=-5.0)]))
        orders.append(run_order(r, port, "fcfs", "fcfs_strict_priority", [
            q("a", 40), q("b", 40, strict_priority=1), q("c", 40, strict_priority=2),
            q("d", 40, strict_priority=1, priority_jump=100.0), q("e", 40, strict_priority=0)]))
        orders.append(run_order(r, port, "fcfs", "fcfs_select_and_drain", [
            {"name": "a", "route": "/select", "token_ids": toks(40)}, q("b", 20), q("c", 20),
            {"name": "d", "block_hashes": [], "sequence_hashes": [], "isl_tokens": 100}]))

        # what queues while the worker is busy, what does not
        r.call("busy_book_blocker", "POST", "/reservations", {
            "selection_id": "busy-blk", "worker_id": 1, "token_ids": toks(40),
            "effective_prefill_tokens": 40})
        r.call("busy_select_advisory", "POST", "/select",
               {"token_ids": toks(8), "advisory": True},
               note="advisory: answered at once while the worker is busy (not queued)")
        r.call("busy_explicit_reservation", "POST", "/reservations", {
            "selection_id": "busy-ex", "worker_id": 1, "token_ids": toks(8),
            "effective_prefill_tokens": 8}, note="explicit bookings are never queued")
        quiet_delete(port, "/reservations/busy-ex")
        r.call("busy_overlap_scores", "POST", "/overlap_scores", {"token_ids": toks(8)})
        r.call("busy_potential_loads", "POST", "/potential_loads", {"token_ids": toks(8)})
        quiet_delete(port, "/reservations/busy-blk")
        sel_tokens = toks(36)
        r.call("idle_select_with_selection_id", "POST", "/select",
               {"token_ids": sel_tokens, "selection_id": "cached-1"})
        r.call("busy_book_blocker_2", "POST", "/reservations", {
            "selection_id": "busy-blk", "worker_id": 1, "token_ids": toks(40),
            "effective_prefill_tokens": 40})
        r.call("busy_replay_cached_select", "POST", "/reservations", {"selection_id": "cached-1"},
               note="replaying a /select made while idle: booked at once (not queued)")
        quiet_delete(port, "/reservations/cached-1")
        w_dup = Waiting(port, "busy_queued_dup", "POST", "/select_and_reserve",
                        {"token_ids": toks(40), "selection_id": "dup-1"})
        wait_pending(port, 1)
        r.call("busy_select_and_reserve_same_id_while_queued", "POST", "/select_and_reserve",
               {"token_ids": toks(40), "selection_id": "dup-1"},
               note="the queued request holds the id: 409 at once")
        r.call("busy_explicit_reservation_same_id_while_queued", "POST", "/reservations", {
            "selection_id": "dup-1", "worker_id": 1, "token_ids": toks(8)})
        r.call("busy_loads_one_queued", "GET", "/loads")
        r.call("busy_release_delete_blocker", "DELETE", "/reservations/busy-blk",
               note="DELETE releases the queue like prefill_complete")
        w_dup.thread.join(5)
        r.exchanges.append(w_dup.entry("queued; released by DELETE of the blocker"))
        quiet_delete(port, "/reservations/dup-1")

        # threshold boundary: busy means active > F x max_num_batched_tokens (strictly)
        r.call("edge_book_32", "POST", "/reservations", {
            "selection_id": "edge-32", "worker_id": 1, "token_ids": toks(32),
            "effective_prefill_tokens": 32})
        r.call("edge_select_and_reserve_at_32", "POST", "/select_and_reserve",
               {"token_ids": toks(1), "selection_id": "edge-1"},
               note="32 active = 0.5 x 64 is not busy: admitted at once, now 33")
        w_edge = Waiting(port, "edge_select_and_reserve_at_33", "POST", "/select_and_reserve",
                         {"token_ids": toks(1), "selection_id": "edge-2"})
        wait_pending(port, 1)
        r.call("edge_loads_at_33", "GET", "/loads", note="33 active > 32: queued")
        r.call("edge_prefill_complete_edge_1", "POST", "/reservations/edge-1/prefill_complete",
               note="back to 32: the queued request is admitted")
        w_edge.thread.join(5)
        r.exchanges.append(w_edge.entry("queued at 33 active; admitted at 32"))
        for rid in ("edge-32", "edge-1", "edge-2"):
            quiet_delete(port, f"/reservations/{rid}")

        # client disconnects and a long wait
        r.call("disc_book_blocker", "POST", "/reservations", {
            "selection_id": "disc-blk", "worker_id": 1, "token_ids": toks(40),
            "effective_prefill_tokens": 40})
        sock = raw_http_open(port, "/select_and_reserve", {"token_ids": toks(12), "selection_id": "disc-1"})
        wait_pending(port, 1)
        before = queue_loads(port)
        sock.close()
        time.sleep(0.5)
        after = queue_loads(port)
        events.append({"name": "disconnect_select_and_reserve", "route": "/select_and_reserve",
                       "isl_tokens": 12, "pending_while_connected": before[:2],
                       "pending_0_5s_after_close": after[:2]})
        r.call("disc_loads_after_select_and_reserve_disconnect", "GET", "/loads",
               note="the closed /select_and_reserve left the queue at once")
        sock = raw_http_open(port, "/select", {"token_ids": toks(8)})
        wait_pending(port, 1)
        before = queue_loads(port)
        sock.close()
        time.sleep(0.5)
        after = queue_loads(port)
        time.sleep(2.5)
        later = queue_loads(port)
        events.append({"name": "disconnect_select", "route": "/select", "isl_tokens": 8,
                       "pending_while_connected": before[:2], "pending_0_5s_after_close": after[:2],
                       "pending_3s_after_close": later[:2]})
        r.call("disc_loads_after_select_disconnect", "GET", "/loads",
               note="the closed /select is still counted (pending_count 1, pending_isl_tokens 8)")
        w_long = Waiting(port, "disc_reuse_id_after_disconnect", "POST", "/select_and_reserve",
                         {"token_ids": toks(12), "selection_id": "disc-1"}, timeout=40)
        wait_pending(port, 2)
        long_wait = 12
        time.sleep(long_wait)
        events.append({"name": "long_wait", "route": "/select_and_reserve", "waited_s": long_wait,
                       "completed": w_long.done(), "pending": list(queue_loads(port)[:2]),
                       "note": "no queue timeout: still waiting (an exploratory run waited 65 s)"})
        r.call("disc_loads_after_long_wait", "GET", "/loads",
               note=f"after {long_wait} s: the reused id is still queued, the dead /select too")
        r.call("disc_release", "POST", "/reservations/disc-blk/prefill_complete")
        w_long.thread.join(5)
        r.exchanges.append(w_long.entry(
            f"id disc-1 reusable once its client disconnected; waited {long_wait} s"))
        time.sleep(0.3)
        r.call("disc_loads_after_release", "GET", "/loads",
               note="the dead /select left the queue when it was popped")
        r.call("disc_free_reused", "DELETE", "/reservations/disc-1")
        quiet_delete(port, "/reservations/disc-blk")

        # bad field types
        for fname, val in [("priority_jump", "1"), ("priority_jump", [1]), ("priority_jump", None),
                           ("priority_jump", -1), ("priority_jump", 1e308),
                           ("strict_priority", -1), ("strict_priority", 1.5),
                           ("strict_priority", "1"), ("strict_priority", True),
                           ("strict_priority", 4294967295), ("strict_priority", 4294967296),
                           ("strict_priority", None)]:
            tag = {str: "string", list: "list", type(None): "null", bool: "bool"}.get(
                type(val), str(val).replace("-", "minus_").replace(".", "_").replace("+", ""))
            r.call(f"type_{fname}_{tag}", "POST", "/select_and_reserve",
                   {"token_ids": toks(4), "selection_id": f"type-{fname}-{tag}", fname: val})
            quiet_delete(port, f"/reservations/type-{fname}-{tag}")
        r.call("type_select_priority_jump_string", "POST", "/select",
               {"token_ids": toks(4), "priority_jump": "high"})

        # several workers: which workers must be busy
        mm = "m-multi"
        r.call("multi_upsert_worker_11", "POST", "/workers",
               worker(11, zmq_base + 1, model_name=mm, max_num_batched_tokens=QUEUE_MNBT))
        r.call("multi_upsert_worker_12", "POST", "/workers",
               worker(12, zmq_base + 2, model_name=mm, max_num_batched_tokens=QUEUE_MNBT))
        r.call("multi_book_11", "POST", "/reservations", {
            "model_name": mm, "selection_id": "mb-11", "worker_id": 11, "token_ids": toks(40),
            "effective_prefill_tokens": 40})
        r.call("multi_select_and_reserve_one_busy", "POST", "/select_and_reserve",
               {"model_name": mm, "token_ids": toks(8), "selection_id": "mm-free"},
               note="worker 12 is not busy: no queueing")
        w_pin = Waiting(port, "multi_pinned_to_busy_11", "POST", "/select_and_reserve", {
            "model_name": mm, "token_ids": toks(40), "selection_id": "mm-pin",
            "pinned_worker": {"worker_id": 11, "dp_rank": 0}})
        wait_pending(port, 1, mm)
        r.call("multi_unpinned_while_pinned_queued", "POST", "/select_and_reserve",
               {"model_name": mm, "token_ids": toks(8), "selection_id": "mm-free-2"},
               note="a queued pinned request does not hold back one that worker 12 can take")
        r.call("multi_loads_pinned_queued", "GET", f"/loads?model_name={mm}")
        r.call("multi_loads_default_partition", "GET", "/loads?model_name=default",
               note="queues are per partition")
        r.call("multi_prefill_complete_on_12", "POST", "/reservations/mm-free/prefill_complete",
               note="capacity freed on worker 12 does not release a request pinned to 11")
        time.sleep(0.5)
        r.call("multi_loads_after_release_on_12", "GET", f"/loads?model_name={mm}")
        r.call("multi_prefill_complete_on_11", "POST", "/reservations/mb-11/prefill_complete")
        w_pin.thread.join(5)
        r.exchanges.append(w_pin.entry("queued (pinned to busy worker 11); released by the "
                                       "prefill_complete on 11"))
        time.sleep(0.3)
        r.call("multi_loads_after_release_on_11", "GET", f"/loads?model_name={mm}",
               note="the admitted pinned request made 11 busy again")
        # head-of-line: an unpinned request queues behind an allowed_worker_ids one
        w_allowed = Waiting(port, "hol_allowed_only_busy_11", "POST", "/select_and_reserve", {
            "model_name": mm, "token_ids": toks(36), "selection_id": "hol-allowed",
            "allowed_worker_ids": [11]})
        wait_pending(port, 1, mm)
        w_hol = Waiting(port, "hol_unpinned_behind_it", "POST", "/select_and_reserve",
                        {"model_name": mm, "token_ids": toks(36), "selection_id": "hol-free"})
        wait_pending(port, 2, mm)
        time.sleep(1.0)
        hol_waiting = not w_hol.done()
        r.call("hol_loads_two_queued", "GET", f"/loads?model_name={mm}",
               note=f"worker 12 is idle, yet the unpinned request waits (still waiting 1 s "
                    f"later: {hol_waiting})")
        r.call("hol_select_advisory", "POST", "/select",
               {"model_name": mm, "token_ids": toks(8), "advisory": True})
        t_rel = time.monotonic()
        r.call("hol_prefill_complete_pinned_on_11", "POST",
               "/reservations/mm-pin/prefill_complete")
        for w in (w_allowed, w_hol):
            w.thread.join(5)
        events.append({"name": "head_of_line_blocking", "model_name": mm,
                       "queued": ["hol-allowed (allowed_worker_ids [11], 11 busy)",
                                  "hol-free (no constraint, worker 12 idle)"],
                       "unpinned_waited_while_12_idle": hol_waiting,
                       "after_release_on_11_ms": {w.body["selection_id"]: round(
                           (w.done_at - t_rel) * 1000) if w.done_at else None
                           for w in (w_allowed, w_hol)},
                       "worker_ids": {w.body["selection_id"]: w.response.get("worker_id")
                                      if isinstance(w.response, dict) else None
                                      for w in (w_allowed, w_hol)}})
        for w in (w_allowed, w_hol):
            r.exchanges.append(w.entry("queued; both admitted by the release on worker 11"))
        r.call("hol_loads_after_release", "GET", f"/loads?model_name={mm}")
        for rid in ("mb-11", "mm-free", "mm-free-2", "mm-pin", "hol-allowed", "hol-free"):
            quiet_delete(port, f"/reservations/{rid}")

        # worker catalog changes drain (or fail) the queue
        r.call("multi_book_11_again", "POST", "/reservations", {
            "model_name": mm, "selection_id": "mb-11b", "worker_id": 11, "token_ids": toks(40),
            "effective_prefill_tokens": 40})
        r.call("multi_book_12_again", "POST", "/reservations", {
            "model_name": mm, "selection_id": "mb-12b", "worker_id": 12, "token_ids": toks(40),
            "effective_prefill_tokens": 40})
        w_add = Waiting(port, "catalog_queued_then_worker_added", "POST", "/select_and_reserve",
                        {"model_name": mm, "token_ids": toks(40), "selection_id": "cat-add"})
        wait_pending(port, 1, mm)
        r.call("catalog_upsert_worker_13", "POST", "/workers",
               worker(13, zmq_base + 3, model_name=mm, max_num_batched_tokens=QUEUE_MNBT),
               note="a new idle worker releases the queue")
        w_add.thread.join(5)
        r.exchanges.append(w_add.entry("queued; admitted when worker 13 was added"))
        w_patch = Waiting(port, "catalog_queued_then_patch", "POST", "/select_and_reserve",
                          {"model_name": mm, "token_ids": toks(40), "selection_id": "cat-patch"})
        wait_pending(port, 1, mm)
        r.call("catalog_patch_worker_11_capacity", "PATCH", "/workers/11",
               {"max_num_batched_tokens": 1000}, note="40 active of 0.5 x 1000: no longer busy")
        w_patch.thread.join(5)
        r.exchanges.append(w_patch.entry(
            "queued; admitted when worker 11's capacity grew (the worker it lands on is the "
            "usual cost choice among 11, 12, 13: not necessarily 11, varies run to run)"))
        r.call("catalog_patch_worker_11_back", "PATCH", "/workers/11",
               {"max_num_batched_tokens": QUEUE_MNBT})
        r.call("catalog_loads_all_busy", "GET", f"/loads?model_name={mm}")
        w_del1 = Waiting(port, "catalog_queued_select_and_reserve_then_worker_deleted", "POST",
                         "/select_and_reserve", {"model_name": mm, "token_ids": toks(40),
                                                 "selection_id": "cat-del",
                                                 "allowed_worker_ids": [11]})
        wait_pending(port, 1, mm)
        w_del2 = Waiting(port, "catalog_queued_select_then_worker_deleted", "POST", "/select",
                         {"model_name": mm, "token_ids": toks(40), "allowed_worker_ids": [11]})
        wait_pending(port, 2, mm)
        r.call("catalog_delete_worker_11", "DELETE", "/workers/11")
        for w in (w_del1, w_del2):
            w.thread.join(5)
            r.exchanges.append(w.entry("queued for worker 11 only; worker 11 deleted"))
        r.call("catalog_loads_after_delete", "GET", f"/loads?model_name={mm}")

        # with queueing enabled a worker needs max_num_batched_tokens
        mn = "m-nocap"
        r.call("nocap_upsert_worker_22_without_max_num_batched_tokens", "POST", "/workers",
               worker(22, zmq_base + 5, model_name=mn),
               note="incomplete while queueing is enabled (schedulable without the env)")
        r.call("nocap_select", "POST", "/select", {"model_name": mn, "token_ids": toks(4)})
        r.call("nocap_patch_max_num_batched_tokens_null", "PATCH", "/workers/22",
               {"max_num_batched_tokens": None})
        r.call("nocap_patch_max_num_batched_tokens", "PATCH", "/workers/22",
               {"max_num_batched_tokens": QUEUE_MNBT})
        r.call("nocap_upsert_worker_23_max_num_batched_tokens_0", "POST", "/workers",
               worker(23, zmq_base + 6, model_name="m-zero", max_num_batched_tokens=0))
        r.call("zero_select_and_reserve_idle", "POST", "/select_and_reserve",
               {"model_name": "m-zero", "token_ids": toks(4), "selection_id": "z-1"},
               note="0 active is not > 0.5 x 0: admitted")
        w_zero = Waiting(port, "zero_select_and_reserve_busy", "POST", "/select_and_reserve",
                         {"model_name": "m-zero", "token_ids": toks(4), "selection_id": "z-2"})
        wait_pending(port, 1, "m-zero")
        r.call("zero_loads", "GET", "/loads?model_name=m-zero",
               note="4 active > 0: any active prefill makes a 0-capacity worker busy")
        r.call("zero_prefill_complete", "POST", "/reservations/z-1/prefill_complete")
        w_zero.thread.join(5)
        r.exchanges.append(w_zero.entry("queued behind 4 active prefill tokens on a 0-capacity worker"))

        # ------------------------------------------------------------ lcfs instance
        for policy, offset in (("lcfs", 1), ("wspt", 2)):
            p2 = port + offset
            svc = Service(RUNTIME["python"], p2, RUNTIME["log"], extra_env={
                "DYN_ROUTER_QUEUE_THRESHOLD": QUEUE_THRESHOLD, "DYN_ROUTER_QUEUE_POLICY": policy})
            r2 = Recorder(p2)
            try:
                pre = f"{policy}_"
                r2.call(pre + "upsert_worker_1", "POST", "/workers",
                        worker(1, zmq_base + 20 if policy == "wspt" else zmq_base + 10 + offset,
                               max_num_batched_tokens=QUEUE_MNBT),
                        note=f"instance with DYN_ROUTER_QUEUE_THRESHOLD={QUEUE_THRESHOLD} "
                             f"DYN_ROUTER_QUEUE_POLICY={policy}")
                if policy == "lcfs":
                    orders.append(run_order(r2, p2, "lcfs", "lcfs_plain", [
                        q("a", 40), q("b", 60), q("c", 36), q("d", 50)]))
                    orders.append(run_order(r2, p2, "lcfs", "lcfs_priority_jump", [
                        q("a", 40, priority_jump=5.0), q("b", 40), q("c", 40),
                        q("d", 40, priority_jump=-100.0)]))
                    orders.append(run_order(r2, p2, "lcfs", "lcfs_strict_priority", [
                        q("a", 40, strict_priority=3), q("b", 40), q("c", 40, strict_priority=3),
                        q("d", 40)]))
                    # shutdown (SIGINT) with requests in the queue
                    r2.call(pre + "shutdown_book_blocker", "POST", "/reservations", {
                        "selection_id": "sd-blk", "worker_id": 1, "token_ids": toks(40),
                        "effective_prefill_tokens": 40})
                    w1 = Waiting(p2, pre + "shutdown_queued_select_and_reserve", "POST",
                                 "/select_and_reserve", {"token_ids": toks(40), "selection_id": "sd-1"})
                    wait_pending(p2, 1)
                    w2 = Waiting(p2, pre + "shutdown_queued_select", "POST", "/select",
                                 {"token_ids": toks(40)})
                    wait_pending(p2, 2)
                    t_sig = time.monotonic()
                    svc.proc.send_signal(signal.SIGINT)
                    for w in (w1, w2):
                        w.thread.join(10)
                    try:
                        code = svc.proc.wait(15)
                    except subprocess.TimeoutExpired:
                        code = "did not exit in 15 s"
                    events.append({"name": "sigint_with_queued_requests", "policy": policy,
                                   "responses_ms": [round((w.done_at - t_sig) * 1000)
                                                    for w in (w1, w2) if w.done_at],
                                   "exit_code": code})
                    for w in (w1, w2):
                        r2.exchanges.append(w.entry("queued; service got SIGINT"))
                else:
                    orders.append(run_order(r2, p2, "wspt", "wspt_plain", [
                        q("a", 60), q("b", 40), q("c", 50), q("d", 36)]))
                    orders.append(run_order(r2, p2, "wspt", "wspt_ties", [
                        q("a", 40), q("b", 40), q("c", 40)]))
                    orders.append(run_order(r2, p2, "wspt", "wspt_priority_jump", [
                        q("a", 60, priority_jump=1.0), q("b", 40), q("c", 36)]))
                    orders.append(run_order(r2, p2, "wspt", "wspt_strict_priority", [
                        q("a", 36), q("b", 60, strict_priority=1), q("c", 40)]))
                    # cached tokens: cost is isl minus the best cached prefix
                    assert pub.wait_subscribed()
                    prefix_tokens = toks(32)
                    seed_events(pub, prefix_tokens, list(range(7001, 7009)))
                    wait_overlap(p2, prefix_tokens, 1, 8)
                    r2.call(pre + "overlap_prefix", "POST", "/overlap_scores",
                            {"token_ids": prefix_tokens},
                            note="worker 1 holds a 32-token prefix P (8 blocks)")
                    item = run_order(r2, p2, "wspt", "wspt_cached_tokens", [
                        {"name": "a", "token_ids": prefix_tokens + toks(40)},
                        q("b", 44)])
                    item["sent"][0]["cached_tokens"] = 32
                    item["note"] = ("a = P + 40 new tokens (isl 72, 32 cached, cost 40); "
                                    "b = 44 new tokens (cost 44)")
                    orders.append(item)
                    # SIGTERM with a request in the queue
                    r2.call(pre + "sigterm_book_blocker", "POST", "/reservations", {
                        "selection_id": "st-blk", "worker_id": 1, "token_ids": toks(40),
                        "effective_prefill_tokens": 40})
                    w1 = Waiting(p2, pre + "sigterm_queued_select_and_reserve", "POST",
                                 "/select_and_reserve", {"token_ids": toks(40), "selection_id": "st-1"})
                    wait_pending(p2, 1)
                    t_sig = time.monotonic()
                    svc.proc.send_signal(signal.SIGTERM)
                    w1.thread.join(10)
                    try:
                        code = svc.proc.wait(15)
                    except subprocess.TimeoutExpired:
                        code = "did not exit in 15 s"
                    events.append({"name": "sigterm_with_queued_request", "policy": policy,
                                   "client_result": w1.response if w1.status is None else
                                   {"status": w1.status, "response": w1.response},
                                   "response_ms": round((w1.done_at - t_sig) * 1000)
                                   if w1.done_at else None,
                                   "exit_code": code})
            finally:
                svc.stop()
            r.exchanges.extend(r2.exchanges)

        # ------------------------------------------------ DYN_ROUTER_POLICY_CONFIG queue limit
        p4 = port + 4
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write(QUEUE_POLICY_YAML)
        svc = Service(RUNTIME["python"], p4, RUNTIME["log"],
                      extra_env={"DYN_ROUTER_POLICY_CONFIG": f.name})
        r4 = Recorder(p4)
        waiting = []
        try:
            pre = "policy_config_"
            note = ("instance with DYN_ROUTER_POLICY_CONFIG=<file>: one class, fcfs, "
                    "prefill_busy_threshold_frac 0.5, request_queue_limit_per_worker 2")
            r4.call(pre + "upsert_worker_1", "POST", "/workers",
                    worker(1, zmq_base + 30, max_num_batched_tokens=QUEUE_MNBT), note=note)
            r4.call(pre + "upsert_worker_2_without_max_num_batched_tokens", "POST", "/workers",
                    worker(2, zmq_base + 31, model_name="m-nocap"))
            r4.call(pre + "book_blocker", "POST", "/reservations", {
                "selection_id": "pc-blk", "worker_id": 1, "token_ids": toks(40),
                "effective_prefill_tokens": 40})
            for i in range(2):
                waiting.append(Waiting(p4, f"{pre}queued_{i + 1}", "POST", "/select_and_reserve",
                                       {"token_ids": toks(40), "selection_id": f"pc-{i + 1}"}))
                wait_pending(p4, i + 1)
            r4.call(pre + "loads_two_queued", "GET", "/loads")
            r4.call(pre + "select_and_reserve_over_limit", "POST", "/select_and_reserve",
                    {"token_ids": toks(40), "selection_id": "pc-3"},
                    note="limit 2 per worker x 1 worker, 2 queued: rejected at once")
            r4.call(pre + "select_over_limit", "POST", "/select", {"token_ids": toks(40)})
            r4.call(pre + "select_advisory_over_limit", "POST", "/select",
                    {"token_ids": toks(40), "advisory": True})
            r4.call(pre + "free_rejected_id", "DELETE", "/reservations/pc-3",
                    note="the rejected request booked nothing")
            r4.call(pre + "release", "POST", "/reservations/pc-blk/prefill_complete")
            waiting[0].thread.join(5)
            r4.exchanges.append(waiting[0].entry("queued; admitted by the release"))
            r4.call(pre + "loads_after_release", "GET", "/loads")
        finally:
            svc.stop()
            os.unlink(f.name)
            for w in waiting[1:]:
                w.thread.join(5)
                r4.exchanges.append(w.entry("queued; service stopped (SIGINT)"))
        r.exchanges.extend(r4.exchanges)

        return {"env": queue_env_checks(port + 3), "orders": orders, "events": events}
    finally:
        pub.close()


def write_doc(path, doc, list_key):
    """Compact but diffable: header fields first, then one list item per line. `list_key` is
    the name of the list written last, or a tuple of such names (written in that order)."""
    list_keys = (list_key,) if isinstance(list_key, str) else tuple(list_key)
    with open(path, "w") as f:
        f.write("{\n")
        for k, v in doc.items():
            if k not in list_keys:
                f.write(f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))},\n")
        for n, key in enumerate(list_keys):
            f.write(f" {json.dumps(key)}: [\n")
            items = doc[key]
            for i, item in enumerate(items):
                sep = "," if i + 1 < len(items) else ""
                f.write("  " + json.dumps(item, separators=(",", ":")) + sep + "\n")
            f.write(" ],\n" if n + 1 < len(list_keys) else " ]\n")
        f.write("}\n")


SCENARIOS = {
    "workers": scenario_workers,
    "select": scenario_select,
    "reservations": scenario_reservations,
    "loads": scenario_loads,
    "errors": scenario_errors,
    "misc": scenario_misc,
    "sessions": scenario_sessions,
    "constraints": scenario_constraints,
    "multimodal": scenario_multimodal,
    "queue": scenario_queue,
}

# Extra environment per scenario: busy thresholds are DYN_* settings, not flags.
SERVICE_ENV = {
    "sessions": {"DYN_ROUTER_CONDITIONAL_DISAGG_DECODE_BUSY_THRESHOLD": "0.5",
                 "DYN_ROUTER_CONDITIONAL_DISAGG_PREFILL_BUSY_THRESHOLD": "0.5"},
    "queue": {"DYN_ROUTER_QUEUE_THRESHOLD": QUEUE_THRESHOLD, "DYN_ROUTER_QUEUE_POLICY": "fcfs"},
}

# Extra service flags per scenario (default: none).
SERVICE_ARGS = {
    "sessions": ["--session-affinity-ttl-secs", str(SESSION_TTL_SECS)],
    "constraints": ["--session-affinity-ttl-secs", "60"],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dynamo-python", default="/work/venv-dynamo/bin/python")
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--zmq-base-port", type=int, default=25557)
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", default="/tmp/dynamo-select-service.log")
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    assert_loopback_only_netns()
    os.makedirs(args.out, exist_ok=True)
    version = subprocess.run(
        [args.dynamo_python, "-c", "import importlib.metadata as m; print(m.version('ai-dynamo-runtime'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    RUNTIME.update(python=args.dynamo_python, log=args.log)
    for i, (name, fn) in enumerate(SCENARIOS.items()):
        if args.only and name not in args.only:
            continue
        print(f"scenario {name} ...", flush=True)
        extra_args = SERVICE_ARGS.get(name, [])
        extra_env = SERVICE_ENV.get(name, {})
        svc = Service(args.dynamo_python, args.port, args.log, extra_args, extra_env)
        rec = Recorder(args.port)
        try:
            extra_lists = fn(rec, args.port, args.zmq_base_port + 100 * i) or {}
        finally:
            svc.stop()
        doc = {
            "dynamo_version": version,
            "scenario": name,
            "service": " ".join([*(f"{k}={v}" for k, v in extra_env.items()),
                                 "python -m dynamo.select_service --port", str(args.port), *extra_args]),
            **extra_lists,
            "exchanges": rec.exchanges,
        }
        path = os.path.join(args.out, f"{name}.json")
        write_doc(path, doc, (*extra_lists, "exchanges"))
        print(f"  {len(rec.exchanges)} exchanges -> {path}", flush=True)


if __name__ == "__main__":
    main()
