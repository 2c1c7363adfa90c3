"""The admission queue from Python: with ``queue_threshold`` an awaited select or
select_and_reserve waits while every rank it may go to is full and is decided when capacity
frees; cancelling the awaitable takes it out of the queue; a timeout raises a 429."""

from __future__ import annotations

import asyncio

import pytest

from kvroute import SelectionServiceError

from conftest import new_service, tokens, worker


async def full_worker(**config):
    """A service queueing above 0.5 × 64 = 32 active prefill tokens, its one worker holding 40."""
    svc = new_service(queue_threshold=0.5, **config)
    await svc.upsert_worker(worker(1, max_num_batched_tokens=64))
    await svc.create_reservation(
        {"selection_id": "blk", "worker_id": 1, "token_ids": tokens(40), "effective_prefill_tokens": 40}
    )
    return svc


def pending(svc) -> tuple[int, int]:
    partition = svc.loads()[0]
    return partition["pending_count"], partition["pending_isl_tokens"]


async def until_pending(svc, count: int) -> None:
    for _ in range(500):
        if pending(svc)[0] == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"pending_count never reached {count}: {pending(svc)}")


async def test_an_awaited_select_waits_and_is_decided_when_capacity_frees():
    svc = await full_worker()
    booking = asyncio.ensure_future(
        svc.select_and_reserve({"token_ids": tokens(12), "selection_id": "q-1"}, tenant="team-a")
    )
    select = asyncio.ensure_future(svc.select({"token_ids": tokens(8)}))
    await until_pending(svc, 2)
    assert pending(svc) == (2, 20)
    await asyncio.sleep(0.1)
    assert not booking.done() and not select.done(), "both wait while the worker is full"
    await svc.prefill_complete("blk")
    reply = await asyncio.wait_for(booking, 5)
    assert (reply["worker_id"], reply["reservation_id"]) == (1, "q-1")
    assert (await asyncio.wait_for(select, 5))["worker_id"] == 1
    assert pending(svc) == (0, 0)


async def test_cancelling_an_awaited_select_takes_it_out_of_the_queue():
    svc = await full_worker()
    waiting = asyncio.ensure_future(svc.select_and_reserve({"token_ids": tokens(12), "selection_id": "c-1"}))
    await until_pending(svc, 1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await until_pending(svc, 0)
    # Nothing was booked for it, and its id is free again.
    await svc.prefill_complete("blk")
    assert svc.loads()[0]["loads"][0]["active_requests"] == 1
    again = await asyncio.wait_for(
        svc.select_and_reserve({"token_ids": tokens(12), "selection_id": "c-1"}), 5
    )
    assert again["reservation_id"] == "c-1"


async def test_a_request_past_its_queue_timeout_raises_429():
    svc = await full_worker(queue_timeout_ms=100)
    with pytest.raises(SelectionServiceError) as info:
        await asyncio.wait_for(svc.select_and_reserve({"token_ids": tokens(12)}), 5)
    assert info.value.status_code == 429
    assert "queue timeout (100 ms)" in str(info.value)
    assert pending(svc) == (0, 0)


def test_queue_knobs_are_checked():
    with pytest.raises(ValueError, match="queue_policy must be"):
        new_service(queue_threshold=0.5, queue_policy="LCFS")
    with pytest.raises(ValueError, match="queue_threshold must be a number"):
        new_service(queue_threshold=-1.0)
    with pytest.raises(ValueError, match="tenant_weights"):
        new_service(queue_threshold=0.5, tenant_weights={"a": 0})
