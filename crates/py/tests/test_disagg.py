"""Disaggregated prefill and decode in process (SPEC §6.1), the same shapes as over HTTP
(crates/service/tests/service/disagg.rs): roles, a pick per leg, both legs booked and freed."""

from __future__ import annotations

from conftest import load_of, new_service, store, tokens, worker


async def pd_service():
    service = new_service()
    for worker_id, role in [(1, "prefill"), (2, "prefill"), (3, "decode"), (4, "decode")]:
        extra = {"bootstrap_port": 8998} if worker_id == 1 else {}
        record = await service.upsert_worker(worker(worker_id, role=role, **extra))
        assert record["lifecycle"] == "schedulable", record
        assert record["role"] == role
    return service


async def test_a_disaggregated_select_picks_each_leg_on_its_pool():
    svc = await pd_service()
    prompt = tokens(64)
    store(svc, 1, prompt)
    sel = await svc.select({"token_ids": prompt, "disaggregated": True})
    assert sel["disaggregated"] is True and sel["bypass"] is None
    assert sel["prefill"]["worker_id"] == 1, "the prefill worker holding the prompt"
    assert sel["prefill"]["bootstrap_port"] == 8998
    assert sel["decode"]["worker_id"] in (3, 4)
    assert sel["decode"]["effective_prefill_tokens"] == 0
    # A plain select never goes to a prefill worker.
    plain = await svc.select({"token_ids": prompt})
    assert plain["worker_id"] in (3, 4)
    svc.shutdown()


async def test_both_legs_are_booked_and_freed_apart():
    svc = await pd_service()
    booked = await svc.select_and_reserve(
        {"token_ids": tokens(64), "disaggregated": True, "reservation_id": "r"}
    )
    prefill, decode = booked["prefill"], booked["decode"]
    assert (prefill["reservation_id"], decode["reservation_id"]) == ("r.prefill", "r.decode")
    loads = svc.loads()
    assert load_of(loads, prefill["worker_id"])["active_requests"] == 1
    assert load_of(loads, decode["worker_id"])["active_requests"] == 1
    await svc.free_reservation("r.prefill")
    assert load_of(svc.loads(), prefill["worker_id"])["active_requests"] == 0
    assert load_of(svc.loads(), decode["worker_id"])["active_requests"] == 1
    await svc.free_reservation("r.decode")
    assert all(l["active_requests"] == 0 for l in svc.loads()[0]["loads"])
    svc.shutdown()


async def test_without_prefill_workers_the_request_runs_whole():
    svc = new_service()
    await svc.upsert_worker(worker(3, role="decode"))
    sel = await svc.select({"token_ids": tokens(64), "disaggregated": True})
    assert sel["bypass"] == "no_prefill_workers"
    assert sel["prefill"] is None
    assert sel["decode"]["worker_id"] == 3
    svc.shutdown()
