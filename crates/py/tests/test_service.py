"""kvroute.SelectionService scenario for scenario with the HTTP integration tests
(crates/service/tests/service/http.rs): the full flow, every error row of SPEC §7.4 with its
status and exact message, bad input, shutdown — plus what only Python has (concurrent asyncio
replays, configuration keywords, Dynamo's call surface)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import time

import pytest

import kvroute
from kvroute import InvalidRequestError, SelectionServiceError

from conftest import MODE, load_of, new_service, store, tokens, with_workers, worker

P = "model=default routing_group=default"
FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "service/tests/fixtures/dynamo"


@pytest.fixture(autouse=True, params=["inline", "offloaded"])
def completion(request):
    """Every scenario twice: awaitables resolved in place, and completed from the tokio runtime."""
    MODE["offload"] = request.param == "offloaded"
    yield request.param
    MODE["offload"] = False


async def raises(awaitable_or_call, status: int, message: str, kind: str | None = None):
    """Awaits (or calls) and checks the SelectionServiceError's status, text and kind."""
    with pytest.raises(SelectionServiceError) as info:
        result = awaitable_or_call() if callable(awaitable_or_call) else awaitable_or_call
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            await result
    error = info.value
    assert (error.status_code, str(error)) == (status, message)
    if kind is not None:
        assert error.kind == kind
    if status == 400:
        assert isinstance(error, ValueError), "a 400 is also a ValueError, as in Dynamo"
    return error


async def test_full_flow_select_replay_lifecycle_free(three_workers):
    svc = three_workers
    prompt = tokens(17)
    store(svc, 2, prompt)
    sel = await svc.select({"token_ids": prompt, "selection_id": "req-1", "expected_output_tokens": 16})
    assert sel["worker_id"] == 2, "the worker holding the prefix"
    assert sel["overlap"]["gpu"] == 16
    assert sel["effective_prefill_tokens"] == 1
    assert sel["selection_id"] == "req-1"
    assert load_of(svc.loads(), 2)["active_requests"] == 0, "select books nothing"

    res = await svc.create_reservation({"selection_id": "req-1"})
    assert (res["worker_id"], res["reservation_id"]) == (2, "req-1")
    rank = load_of(svc.loads(), 2)
    assert (rank["active_requests"], rank["potential_prefill_tokens"], rank["potential_decode_blocks"]) == (1, 1, 5)

    assert await svc.prefill_complete("req-1") == ()
    assert load_of(svc.loads(), 2)["potential_prefill_tokens"] == 0
    assert svc.add_output_block("req-1") is None
    assert load_of(svc.loads(), 2)["potential_decode_blocks"] == 6
    svc.add_output_block("req-1", decay_fraction=0.5)
    # round(0.5 × (5 + 2)) = 4 (half up).
    assert load_of(svc.loads(), 2)["potential_decode_blocks"] == 4
    assert await svc.free_reservation("req-1") == ()
    rank = load_of(svc.loads(), 2)
    assert (rank["active_requests"], rank["potential_decode_blocks"]) == (0, 0)
    await raises(svc.free_reservation("req-1"), 404, "reservation req-1 not found", "not_found")


async def test_select_and_reserve_and_inspection_routes():
    svc = await with_workers(1, 2, kv_events=True)
    prompt = tokens(17)
    store(svc, 1, prompt[:8])
    r = await svc.select_and_reserve({"token_ids": prompt, "selection_id": "a"})
    assert len(r["sequence_hashes"]) == 4
    assert r["sequence_hashes"] == kvroute.block_hashes(prompt, 4)["sequence_hashes"]
    assert (r["isl_tokens"], r["track_prefill_tokens"], r["reservation_id"]) == (17, True, "a")
    scores = await svc.overlap_scores({"token_ids": prompt})
    assert scores["num_blocks"] == 4
    w1 = next(w for w in scores["workers"] if w["worker_id"] == 1)
    assert w1["device_blocks"] == 4, "two stored blocks, two predicted on route"
    potential = await svc.potential_loads({"token_ids": prompt})
    assert len(potential) == 2
    dump = await svc.indexer_snapshot()
    assert len(dump["default:default"]["events"]) == 2, "two stored blocks (no predictions)"
    ready = svc.ready()
    assert (ready["ready"], ready["schedulable_workers"]) == (True, 2)
    assert [w["worker_id"] for w in svc.list_workers()] == [1, 2]
    assert svc.list_workers(model_name="other") == []
    metrics = svc.metrics()
    assert "kvroute_rank_active_requests" in metrics
    # Decision quality: the select_and_reserve above took worker 1's 8 cached tokens, the best.
    partition = 'model_name="default",routing_group="default"'
    assert f'kvroute_selection_overlap_tokens_total{{{partition},kind="chosen"}} 8' in metrics
    assert f'kvroute_selection_overlap_tokens_total{{{partition},kind="best"}} 8' in metrics
    assert f'kvroute_selection_overlap_gap_blocks_count{{{partition}}} 1' in metrics
    assert 'kvroute_predicted_blocks_total{outcome="confirmed"} 0' in metrics
    # Hash form with signed and unsigned hashes alike.
    h = kvroute.block_hashes(prompt, 4)
    unsigned_local = [x & (2**64 - 1) for x in h["local_hashes"]]
    r = await svc.select(
        {
            "block_hashes": unsigned_local,
            "sequence_hashes": h["sequence_hashes"],
            "isl_tokens": 17,
            "pinned_worker": {"worker_id": 1},
        }
    )
    assert r["overlap"]["gpu"] == 16
    svc.shutdown()
    # Without predict-on-route only the stored blocks count.
    svc = await with_workers(1, 2, kv_events=True, predicted_ttl_secs=0)
    store(svc, 1, prompt[:8])
    await svc.select_and_reserve({"token_ids": prompt, "selection_id": "a"})
    scores = await svc.overlap_scores({"token_ids": prompt})
    assert next(w for w in scores["workers"] if w["worker_id"] == 1)["device_blocks"] == 2
    svc.shutdown()


ERROR_ROWS = [
    ("create_reservation", {}, 400,
     "include selection_id to replay a cached selection, or worker_id with the prompt for a self-contained booking"),
    ("create_reservation", {"worker_id": 1, "token_ids": tokens(17)}, 400,
     "reservation_id or selection_id is required to name the booking"),
    ("create_reservation", {"selection_id": "nope"}, 404,
     f"no pending selection nope for {P} (expired, already used, or never selected); call select again or book with worker_id and the prompt"),
    ("create_reservation", {"selection_id": "x", "worker_id": 9, "token_ids": tokens(17)}, 404,
     f"schedulable worker 9 not found for {P}"),
    ("create_reservation", {"selection_id": "x", "worker_id": 1, "dp_rank": 3, "token_ids": tokens(17)}, 404,
     f"schedulable worker 1 not found for {P}"),
    ("select", {"model_name": "m", "token_ids": tokens(17)}, 503,
     "no schedulable workers for model=m routing_group=default"),
    ("create_reservation", {"selection_id": "x", "worker_id": 1, "token_ids": tokens(17), "effective_prefill_tokens": 18}, 400,
     "effective_prefill_tokens (18) must not exceed isl_tokens (17)"),
    ("select", {"token_ids": tokens(17), "pinned_worker": {"worker_id": 5}}, 503,
     "no endpoints available to route work"),
    ("select", {"token_ids": tokens(17), "allowed_worker_ids": []}, 503,
     "no endpoints available to route work"),
    ("select", {}, 400, "block_hashes is required without token_ids"),
    ("create_reservation", {"selection_id": "y", "worker_id": 1}, 400,
     "sequence_hashes is required without token_ids"),
    ("select", {"token_ids": []}, 400, "token_ids must not be empty"),
    ("select", {"token_ids": tokens(17), "selection_id": "s" * 1025}, 400,
     "selection_id must be at most 1024 bytes"),
    ("select", {"token_ids": tokens(17), "model_name": "m" * 1025}, 400,
     "model_name must be at most 1024 bytes"),
    ("select", {"token_ids": tokens(17), "routing_group": "g" * 1025}, 400,
     "routing_group must be at most 1024 bytes"),
    ("create_reservation", {"worker_id": 1, "token_ids": tokens(17), "reservation_id": "r" * 1025}, 400,
     "reservation_id must be at most 1024 bytes"),
    ("select", {"block_hashes": [1, 2], "sequence_hashes": [1], "isl_tokens": 8}, 400,
     "block_hashes length 2 must match sequence_hashes length 1"),
    ("select", {"block_hashes": [], "sequence_hashes": [], "isl_tokens": 0}, 400,
     "isl_tokens must be greater than 0"),
]

KINDS = {400: "bad_request", 404: "not_found", 409: "conflict", 429: "overloaded"}


@pytest.mark.parametrize("method,body,status,message", ERROR_ROWS)
async def test_every_error_row_of_the_spec(method, body, status, message):
    svc = await with_workers(1)
    kind = KINDS.get(status, "scheduler" if message == "no endpoints available to route work" else "not_ready")
    await raises(getattr(svc, method)(body), status, message, kind)
    svc.shutdown()


async def test_error_rows_without_a_body():
    svc = await with_workers(1)
    p17 = tokens(17)
    # decay_fraction is checked first, even for an unknown reservation (as over HTTP).
    await raises(lambda: svc.add_output_block("none", decay_fraction=1.5), 400,
                 "decay_fraction must be between 0.0 and 1.0", "bad_request")
    # Duplicate live id, unknown reservation, unknown worker.
    await svc.select_and_reserve({"token_ids": p17, "selection_id": "d"})
    await raises(svc.select_and_reserve({"token_ids": p17, "selection_id": "d"}), 409,
                 "Request d already exists (assigned to worker 1)", "conflict")
    await raises(svc.prefill_complete("zz"), 404, "reservation zz not found")
    await raises(lambda: svc.add_output_block("zz"), 404, "reservation zz not found")
    await raises(svc.free_reservation("zz"), 404, "reservation zz not found")
    await raises(svc.patch_worker(77, {"endpoint": "x"}), 404, "worker 77 not found", "not_found")
    await raises(svc.delete_worker(77), 404, "worker 77 not found", "not_found")
    # The path-parameter row: a worker id that is not an integer.
    with pytest.raises(TypeError):
        svc.delete_worker("abc")
    # Every prompt route without workers: 503.
    empty = new_service()
    for method in ["select", "select_and_reserve", "overlap_scores", "potential_loads"]:
        await raises(getattr(empty, method)({"token_ids": p17}), 503, f"no schedulable workers for {P}", "not_ready")
    empty.shutdown()
    svc.shutdown()


async def test_every_eligible_rank_busy_is_429():
    svc = await with_workers(1, busy_prefill_tokens=10)
    await svc.select_and_reserve({"token_ids": tokens(17), "selection_id": "a"})
    await raises(svc.select({"token_ids": tokens(17)}), 429, "all eligible workers are overloaded", "overloaded")
    svc.shutdown()


async def test_lru_model_credits_a_repeated_prompt_until_others_push_it_out():
    svc = new_service(approximate_cache_policy="lru")
    # No KV-event endpoint, a pool of 8 blocks of 4 tokens.
    await svc.upsert_worker(worker(1, total_kv_blocks=8))
    await svc.upsert_worker(worker(2))

    async def cycle(reservation_id, prompt):
        await svc.create_reservation({"worker_id": 1, "reservation_id": reservation_id, "token_ids": prompt})
        await svc.free_reservation(reservation_id)

    a = tokens(16)
    await cycle("a", a)
    sel = await svc.select({"token_ids": a})
    assert (sel["worker_id"], sel["overlap"]["gpu"]) == (1, 16)
    model = load_of(svc.loads(), 1)["cache_model"]
    assert (model["policy"], model["resident_blocks"], model["inactive_blocks"]) == ("lru", 4, 4)
    await cycle("b", list(range(100, 116)))
    await cycle("c", list(range(200, 216)))
    scores = await svc.overlap_scores({"token_ids": a})
    w1 = next(w for w in scores["workers"] if w["worker_id"] == 1)
    assert w1["device_blocks"] == 0, "pushed out by two newer prompts"
    assert 'kvroute_approx_lru_total{event="evicted_blocks"} 4' in svc.metrics()
    svc.shutdown()


async def test_patch_worker_and_engine_batches_as_bytes():
    from vllm_events import encode, stored

    svc = await with_workers(1, 2)
    record = await svc.patch_worker(2, {"total_kv_blocks": 64, "data_parallel_size": 2})
    assert (record["total_kv_blocks"], record["data_parallel_size"], record["lifecycle"]) == (64, 2, "schedulable")
    prompt = tokens(16)
    h = kvroute.block_hashes(prompt, 4)
    # A vLLM batch naming dp rank 1 of worker 2: the batch's rank wins over the argument.
    out = svc.apply_kv_events(2, encode([stored(h["sequence_hashes"], prompt)], data_parallel_rank=1))
    assert (out["stored_blocks"], out["dp_rank"]) == (4, 1)
    choice = await svc.select({"token_ids": prompt + [99]})
    assert (choice["worker_id"], choice["dp_rank"], choice["overlap"]["gpu"]) == (2, 1, 16)
    with pytest.raises(ValueError, match="events: "):
        svc.apply_kv_events(2, b"not msgpack")
    svc.shutdown()


async def test_replay_survives_a_transient_worker_outage():
    svc = await with_workers(1, 2)
    r = await svc.select({"token_ids": tokens(9), "selection_id": "t", "pinned_worker": {"worker_id": 2}})
    assert r["worker_id"] == 2
    assert (await svc.delete_worker(2))["lifecycle"] == "unschedulable"
    await raises(svc.create_reservation({"selection_id": "t"}), 404, f"schedulable worker 2 not found for {P}")
    await svc.upsert_worker(worker(2))
    r = await svc.create_reservation({"selection_id": "t"})
    assert r["worker_id"] == 2
    # Emptied partition: 503, entry kept.
    await svc.select({"token_ids": tokens(9), "selection_id": "u"})
    await svc.delete_worker(1)
    await svc.delete_worker(2)
    await raises(svc.create_reservation({"selection_id": "u"}), 503, f"no schedulable workers for {P}")
    await svc.upsert_worker(worker(1))
    await svc.upsert_worker(worker(2))
    assert (await svc.create_reservation({"selection_id": "u"}))["reservation_id"] == "u"
    svc.shutdown()


async def test_concurrent_replays_from_asyncio_tasks_book_once():
    svc = await with_workers(1, 2, 3)
    for round_ in range(20):
        sid = f"race-{round_}"
        await svc.select({"token_ids": tokens(33), "selection_id": sid})
        results = await asyncio.gather(
            *[svc.create_reservation({"selection_id": sid}) for _ in range(16)], return_exceptions=True
        )
        booked = [r for r in results if isinstance(r, dict)]
        refused = [r for r in results if not isinstance(r, dict)]
        assert len(booked) == 1, results
        assert all(isinstance(e, SelectionServiceError) and e.status_code in (404, 409) for e in refused), refused
    loads = svc.loads()[0]["loads"]
    assert sum(l["active_requests"] for l in loads) == 20, "each selection booked exactly once"
    await asyncio.gather(*[svc.free_reservation(f"race-{i}") for i in range(20)])
    assert sum(l["active_requests"] for l in svc.loads()[0]["loads"]) == 0
    svc.shutdown()


async def test_many_concurrent_flows_leave_nothing_booked():
    svc = await with_workers(*range(8))

    async def flow(i: int):
        sid = f"f{i}"
        prompt = [i % 8 * 10_000 + t for t in range(256)]
        await svc.select({"token_ids": prompt, "selection_id": sid})
        await svc.create_reservation({"selection_id": sid})
        await svc.prefill_complete(sid)
        svc.add_output_block(sid)
        await svc.free_reservation(sid)

    await asyncio.gather(*[flow(i) for i in range(400)])
    assert all(l["active_requests"] == 0 for p in svc.loads() for l in p["loads"])
    svc.shutdown()


async def test_bad_input_raises_value_or_type_error_naming_the_field():
    svc = await with_workers(1)
    cases = [
        ({"token_ids": "1,2"}, ValueError, "token_ids: invalid type: string"),
        ({"token_ids": [1, -5]}, ValueError, "token_ids[1]: invalid value: integer `-5`"),
        ({"token_ids": [4294967296]}, ValueError, "token_ids[0]"),
        ({"token_ids": [1], "expected_output_tokens": -1}, ValueError, "expected_output_tokens"),
        ({"token_ids": [1], "router_config_override": {"router_temperature": "hot"}}, ValueError,
         "router_config_override.router_temperature: invalid type"),
        ({"token_ids": [1.5]}, ValueError, "token_ids[0]: invalid type: floating point"),
        ({"token_ids": [True]}, ValueError, "token_ids[0]: invalid type: boolean"),
        ({"token_ids": [2**70]}, ValueError, "token_ids[0]: integer"),
        ({"token_ids": [1], "expected_output_tokens": float("nan")}, ValueError, "expected_output_tokens: NaN is not a JSON number"),
        ({"token_ids": {1, 2}}, TypeError, "token_ids: expected a JSON-like value"),
        ({"token_ids": [1], 7: "x"}, TypeError, "dict keys must be str"),
    ]
    for body, error, needle in cases:
        with pytest.raises(error) as info:
            svc.select(body)  # raised synchronously, before anything runs
        assert needle in str(info.value), (body, str(info.value))
        assert not isinstance(info.value, SelectionServiceError)
    for not_a_dict in ["not a dict", '{"token_ids": [1]}', [("token_ids", [1])], None]:
        with pytest.raises(TypeError, match="request must be a dict"):
            svc.select(not_a_dict)
    with pytest.raises(ValueError, match="worker_id"):
        svc.upsert_worker({"worker_id": -1, "block_size": 4})
    with pytest.raises(ValueError) as info:
        await svc.upsert_worker({"endpoint": "x"})
    assert str(info.value) == "missing field `worker_id`"
    with pytest.raises(ValueError, match="block_size"):
        svc.upsert_worker({"worker_id": 4, "block_size": 2**32})
    with pytest.raises(InvalidRequestError, match="kv_events_endpoints key `x`"):
        await svc.upsert_worker({"worker_id": 4, "kv_events_endpoints": {"x": "tcp://a:1"}})
    # A bad configuration is recorded, not rejected.
    r = await svc.upsert_worker({"worker_id": 5, "endpoint": "e", "block_size": 0, "kv_events_endpoint": "nonsense"})
    assert r["lifecycle"] == "incomplete"
    assert r["not_schedulable_reasons"][0] == "block_size must be greater than 0"
    # Still serving.
    assert (await svc.select({"token_ids": tokens(8)}))["worker_id"] == 1
    svc.shutdown()


async def test_shutdown_refuses_new_work_with_503():
    svc = await with_workers(1)
    await svc.select_and_reserve({"token_ids": tokens(8), "selection_id": "live"})
    assert svc.shutdown() is None
    svc.shutdown()  # idempotent
    assert await svc.shutdown_async() == ()
    for call in [
        svc.select({"token_ids": tokens(8)}),
        svc.upsert_worker(worker(5)),
        svc.free_reservation("live"),
    ]:
        await raises(call, 503, "selection service is shutting down", "not_ready")
    ready = svc.ready()
    assert (ready["ready"], [w["worker_id"] for w in ready["workers"]]) == (False, [1])
    assert "shut down" in repr(svc)


async def test_idle_bookings_expire_on_the_service_runtime():
    svc = await with_workers(1, active_request_expiry_secs=0.3)
    await svc.select_and_reserve({"token_ids": tokens(8), "selection_id": "idle"})
    assert load_of(svc.loads(), 1)["active_requests"] == 1
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and load_of(svc.loads(), 1)["active_requests"]:
        await asyncio.sleep(0.1)
    assert load_of(svc.loads(), 1)["active_requests"] == 0, "the housekeeping sweep freed it"
    await raises(svc.free_reservation("idle"), 404, "reservation idle not found")
    svc.shutdown()


async def test_configuration_keywords_apply_and_are_validated():
    svc = await with_workers(1, selection_cache_max_entries=1)
    await svc.select({"token_ids": tokens(8), "selection_id": "a"})
    await svc.select({"token_ids": tokens(8), "selection_id": "b"})
    await raises(svc.create_reservation({"selection_id": "a"}), 404,
                 f"no pending selection a for {P} (expired, already used, or never selected); call select again or book with worker_id and the prompt")
    assert (await svc.create_reservation({"selection_id": "b"}))["worker_id"] == 1
    svc.shutdown()
    # Dynamo's form of the same bounds.
    dyn = kvroute.SelectionService(
        selection_cache=kvroute.SelectionCacheConfig(ttl_secs=30, max_entries=2), indexer_threads=1
    )
    dyn.shutdown()
    kvroute.SelectionService(selection_cache={"max_bytes": 1 << 20}, approximate_cache_policy="lru").shutdown()

    for kwargs, error, message in [
        ({"router_temperature": -1}, ValueError, "router_temperature must be a finite number ≥ 0 (got -1)"),
        ({"selection_cache_ttl_secs": 0}, ValueError, "selection_cache_ttl_secs must be a number of seconds > 0 (got 0)"),
        ({"selection_cache": kvroute.SelectionCacheConfig(max_entries=0)}, ValueError,
         "selection_cache_max_entries must be at least 1"),
        ({"busy_decode_fraction": 0.0}, ValueError, "busy_decode_fraction must be a fraction > 0 (got 0)"),
        ({"approximate_cache_policy": "fifo"}, ValueError, "approximate_cache_policy must be 'ttl' or 'lru' (got \"fifo\")"),
        ({"overlap_score_credit": "1"}, TypeError, "overlap_score_credit must be a number, got str"),
        ({"track_prefill_tokens": 1}, TypeError, "track_prefill_tokens must be a bool, got int"),
        ({"max_indexed_blocks": -1}, ValueError, "max_indexed_blocks is out of range (got -1)"),
        ({"predicted_ttl_secs": -1}, ValueError, "predicted_ttl_secs must be a number of seconds ≥ 0 (got -1)"),
        ({"replica_sync_port": 5000}, ValueError, "replica_sync_port is not supported in process"),
        ({"session_affinity_ttl_secs": 0.5}, ValueError,
         "session_affinity_ttl_secs must be between 1 and 31536000 (got 0.5)"),
        ({"session_affinity_ttl_secs": "2"}, TypeError, "session_affinity_ttl_secs must be a number, got str"),
        ({"session_affinity_mode": "loose"}, ValueError, "session_affinity_mode must be 'hard' or 'soft' (got \"loose\")"),
        ({"session_affinity_soft_factor": 0.5}, ValueError, "session_affinity_soft_factor must be a finite number ≥ 1"),
        ({"session_affinity_max_sessions": 0}, ValueError, "session_affinity_max_sessions must be at least 1"),
    ]:
        with pytest.raises(error) as info:
            kvroute.SelectionService(**kwargs)
        assert str(info.value).startswith(message), (kwargs, str(info.value))
    with pytest.raises(TypeError, match="unexpected keyword argument 'port'"):
        kvroute.SelectionService(port=8000)


async def test_track_prefill_tokens_and_weights_reach_the_scheduler():
    svc = await with_workers(1, track_prefill_tokens=False)
    await svc.select_and_reserve({"token_ids": tokens(17), "selection_id": "a"})
    assert load_of(svc.loads(), 1)["potential_prefill_tokens"] == 0
    svc.shutdown()


async def test_profile_keeps_routing_weights_out_of_effective_prefill():
    # Profiles: overlap credit 3, 18 tokens of which 16 cached: 2 to compute under the default
    # profile; Dynamo's formula (profile="dynamo") lets the credit in and reports and books 0.
    for kwargs, want in [({}, 2), ({"profile": "kvroute"}, 2), ({"profile": "dynamo"}, 0)]:
        svc = await with_workers(1, overlap_score_credit=3, **kwargs)
        prompt = tokens(18)
        store(svc, 1, prompt[:16])
        sel = await svc.select_and_reserve({"token_ids": prompt, "selection_id": "a"})
        assert (sel["overlap"]["gpu"], sel["effective_prefill_tokens"]) == (16, want), kwargs
        assert load_of(svc.loads(), 1)["potential_prefill_tokens"] == want, kwargs
        svc.shutdown()
    with pytest.raises(ValueError, match="profile must be 'kvroute' or 'dynamo' \\(got \"fast\"\\)"):
        kvroute.SelectionService(profile="fast")
    with pytest.raises(TypeError, match="profile must be a str"):
        kvroute.SelectionService(profile=1)


def test_sync_surface_works_without_an_event_loop():
    svc = new_service()
    assert svc.ready() == {"ready": False, "schedulable_workers": 0, "workers": []}
    assert svc.list_workers() == [] and svc.loads() == []
    with pytest.raises(SelectionServiceError, match="worker 1 not found"):
        svc.apply_kv_events(1, [{"type": "AllBlocksCleared"}])
    svc.shutdown()


def test_dynamo_call_surface():
    """Every method of Dynamo's in-process SelectionService exists with the same sync/async
    style (crates/service/tests/fixtures/dynamo/python_api.json)."""
    fixture = json.loads((FIXTURES / "python_api.json").read_text())
    methods = fixture["surface"]["SelectionService"]["methods"]
    missing = [m for m in methods if not hasattr(kvroute.SelectionService, m)]
    assert missing == []
    sync = {c["method"] for c in fixture["calls"] if c["style"] == "sync"}
    assert sync == {"ready", "list_workers", "loads", "add_output_block", "shutdown", "list_replica_peers"}
    for name in methods:
        doc = getattr(kvroute.SelectionService, name).__doc__
        assert doc and len(doc) > 20, f"{name} has a docstring"

    async def styles_match():
        svc = await with_workers(1)
        await svc.select_and_reserve({"token_ids": tokens(8), "selection_id": "s"})
        assert not asyncio.isfuture(svc.ready())
        assert not asyncio.isfuture(svc.list_workers())
        assert not asyncio.isfuture(svc.loads())
        assert svc.add_output_block("s", decay_fraction=0.5) is None
        assert svc.list_replica_peers() == []
        for call in [svc.select({"token_ids": tokens(8)}), svc.indexer_snapshot()]:
            assert asyncio.isfuture(call)
            await call
        with pytest.raises(Exception, match="replica sync is disabled"):
            await svc.register_replica_peer("tcp://127.0.0.1:1")
        # Dynamo names the lifecycle argument selection_id.
        assert await svc.prefill_complete(selection_id="s") == ()
        assert await svc.free_reservation(selection_id="s") == ()
        svc.shutdown()

    asyncio.run(styles_match())
    assert issubclass(SelectionServiceError, Exception)
    assert issubclass(InvalidRequestError, ValueError)


async def test_selects_stay_correct_while_events_hold_the_write_lock():
    """Engine-event bursts on another thread take the write lock; awaitables issued meanwhile are
    completed from the tokio runtime instead of blocking the event loop, with the same results."""
    import threading

    svc = await with_workers(1, 2)
    prompt = tokens(64)
    store(svc, 2, prompt)
    stop = threading.Event()

    def burst():
        i = 0
        while not stop.is_set():
            chunk = [100_000 + i * 64 + t for t in range(64)]
            h = kvroute.block_hashes(chunk, 4)
            svc.apply_kv_events(1, [{"type": "BlockStored", "block_hashes": h["sequence_hashes"],
                                     "token_ids": chunk, "block_size": 4}])
            i += 1

    thread = threading.Thread(target=burst)
    thread.start()
    try:
        choices = await asyncio.gather(*[svc.select({"token_ids": prompt}) for _ in range(500)])
    finally:
        stop.set()
        thread.join()
    assert {c["worker_id"] for c in choices} == {2}
    assert {c["overlap"]["gpu"] for c in choices} == {64}
    svc.shutdown()


def test_errors_pickle_with_their_attributes():
    import pickle

    e = pickle.loads(pickle.dumps(InvalidRequestError("token_ids must not be empty", 400, "bad_request")))
    assert (type(e), str(e), e.status_code, e.kind) == (InvalidRequestError, "token_ids must not be empty", 400, "bad_request")


async def test_session_affinity_binds_on_booking_and_follows_the_session():
    # Off by default: session fields are type-checked and ignored.
    off = await with_workers(1, 2)
    store(off, 1, tokens(17))
    await off.select_and_reserve({"token_ids": tokens(17), "session_id": "s", "allowed_worker_ids": [2],
                                  "selection_id": "s-1"})
    assert (await off.select({"token_ids": tokens(17), "session_id": "s"}))["worker_id"] == 1
    off.shutdown()

    svc = await with_workers(1, 2, 3, session_affinity_ttl_secs=30)
    store(svc, 1, tokens(17))
    # A select binds nothing; a booking does, and the session follows it over worker 1's cache.
    assert (await svc.select({"token_ids": tokens(17), "session_id": "s", "allowed_worker_ids": [2]}))["worker_id"] == 2
    assert (await svc.select({"token_ids": tokens(17), "session_id": "s"}))["worker_id"] == 1
    booked = await svc.select_and_reserve({"token_ids": tokens(17), "selection_id": "s-1",
                                           "session_context": {"session_id": "s", "input_trigger": "user_message"},
                                           "allowed_worker_ids": [2]})
    assert booked["worker_id"] == 2
    assert "session_id" not in booked and "session_context" not in booked
    chosen = await svc.select({"token_ids": tokens(17), "session_context": {"session_id": "s", "session_final": True}})
    assert chosen["worker_id"] == 2
    # An affinity target wins over the binding, which stays.
    assert (await svc.select({"token_ids": tokens(17), "session_id": "s",
                              "affinity_target": {"worker_id": 3}}))["worker_id"] == 3
    # A booking that excludes the bound worker is refused and drops the binding.
    await raises(svc.select_and_reserve({"token_ids": tokens(17), "session_id": "s", "selection_id": "s-2",
                                         "allowed_worker_ids": [3]}),
                 400, "session s is bound to worker 2, not 3", kind="bad_request")
    assert (await svc.select({"token_ids": tokens(17), "session_id": "s"}))["worker_id"] == 1
    await raises(svc.select({"token_ids": tokens(17), "session_id": "x" * 257}),
                 400, "session affinity ID must not exceed 256 bytes")
    with pytest.raises(ValueError, match="input_trigger: unknown variant `bogus`"):
        await svc.select({"token_ids": tokens(17), "session_context": {"session_id": "s", "input_trigger": "bogus"}})
    assert "kvroute_session_bindings_events_total{event=\"dropped\"} 1" in svc.metrics()
    svc.shutdown()


async def test_soft_session_affinity_leaves_a_busy_worker():
    for mode, expected in [("hard", 2), ("soft", 1)]:
        svc = await with_workers(1, 2, session_affinity_ttl_secs=30, session_affinity_mode=mode,
                                 busy_prefill_tokens=100)
        await svc.select_and_reserve({"token_ids": tokens(17), "session_id": "s", "selection_id": "s-1",
                                      "allowed_worker_ids": [2]})
        await svc.create_reservation({"selection_id": "big", "worker_id": 2, "token_ids": tokens(400)})
        chosen = await svc.select({"token_ids": tokens(17), "session_id": "s"})
        assert chosen["worker_id"] == expected, mode
        svc.shutdown()
