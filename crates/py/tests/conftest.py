"""Shared helpers: the same workers, prompts and event injection as the HTTP tests
(crates/service/tests/service/http.rs)."""

from __future__ import annotations

import pytest

import kvroute


def tokens(n: int) -> list[int]:
    """The prompt 1..=n."""
    return list(range(1, n + 1))


def worker(worker_id: int, **extra) -> dict:
    return {
        "worker_id": worker_id,
        "endpoint": f"http://worker-{worker_id}:8000",
        "block_size": 4,
        **extra,
    }


def store(service: kvroute.SelectionService, worker_id: int, prompt: list[int], tier: str = "GPU") -> dict:
    """Applies the prompt's full blocks as stored on a worker, as its engine's events would
    (engine hashes = sequence hashes, like the HTTP tests)."""
    full = len(prompt) // 4 * 4
    hashes = kvroute.block_hashes(prompt[:full], 4)
    return service.apply_kv_events(
        worker_id,
        [
            {
                "type": "BlockStored",
                "block_hashes": hashes["sequence_hashes"],
                "parent_block_hash": None,
                "token_ids": prompt[:full],
                "block_size": 4,
                "medium": tier,
            }
        ],
    )


def load_of(loads: list, worker_id: int) -> dict:
    return next(l for l in loads[0]["loads"] if l["worker_id"] == worker_id)


#: How awaitables complete in the services the tests make: resolved in place (the usual case) or
#: on the tokio runtime (as when the selector lock is busy). test_service.py runs both.
MODE = {"offload": False}


def new_service(**config) -> kvroute.SelectionService:
    service = kvroute.SelectionService(**config)
    service._set_always_offload(MODE["offload"])
    return service


async def with_workers(*ids: int, kv_events: bool = False, **config) -> kvroute.SelectionService:
    """A service with these workers. With `kv_events`, each names a KV-event endpoint where
    nothing listens: only events the test applies count, and what bookings predict on route."""
    service = new_service(**config)
    for worker_id in ids:
        extra = {"kv_events_endpoint": f"tcp://127.0.0.1:{1 + worker_id}"} if kv_events else {}
        record = await service.upsert_worker(worker(worker_id, **extra))
        assert record["lifecycle"] == "schedulable", record
    return service


@pytest.fixture
async def three_workers():
    service = await with_workers(1, 2, 3)
    yield service
    service.shutdown()
