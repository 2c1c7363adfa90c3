"""Live KV events: a vLLM-format publisher (pyzmq PUB + msgspec) feeds a worker registered with
`kv_events_endpoint`, and the service's own listener (on the runtime the SelectionService owns)
changes what select sees."""

from __future__ import annotations

import asyncio
import time

import pytest

import kvroute
from conftest import worker
from vllm_events import AllBlocksCleared, BlockRemoved, encode, stored

zmq = pytest.importorskip("zmq")

pytestmark = pytest.mark.skipif(
    not kvroute._live_ingest_available,
    reason="this kvroute build has no live KV-event ingest (kvroute._live_ingest_available is False)",
)

PROMPT = list(range(1, 18))
ENGINE = [9001, 9002, 9003, 9004]
DEADLINE_SECS = 15.0


class Publisher:
    """An engine's KV-event PUB socket: multipart [topic, seq (8 bytes BE), payload]."""

    def __init__(self):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def publish(self, *events, data_parallel_rank=0):
        payload = encode(events, ts=time.time(), data_parallel_rank=data_parallel_rank)
        self.socket.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self):
        self.socket.close()
        self.context.term()


async def device_blocks(svc, worker_id):
    scores = await svc.overlap_scores({"token_ids": PROMPT})
    return next(w["device_blocks"] for w in scores["workers"] if w["worker_id"] == worker_id)


async def publish_until(svc, publisher, events, worker_id, expected):
    """Publishes `events` until the overlap reaches `expected` (a SUB socket misses what is sent
    before its subscription lands), within a bounded deadline."""
    deadline = time.monotonic() + DEADLINE_SECS
    while time.monotonic() < deadline:
        publisher.publish(*events)
        if await device_blocks(svc, worker_id) == expected:
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"overlap of worker {worker_id} did not reach {expected} within {DEADLINE_SECS} s")


async def test_a_live_publisher_changes_the_overlap():
    publisher = Publisher()
    svc = kvroute.SelectionService()
    try:
        await svc.upsert_worker(worker(1, kv_events_endpoint=publisher.endpoint))
        await svc.upsert_worker(worker(2))
        assert svc.active_listeners() == 1
        assert await device_blocks(svc, 1) == 0
        # Clear-then-store keeps the store count at 1 however many times it arrives.
        await publish_until(svc, publisher, [AllBlocksCleared(), stored(ENGINE, PROMPT[:16])], 1, 4)
        choice = await svc.select({"token_ids": PROMPT})
        assert (choice["worker_id"], choice["overlap"]["gpu"]) == (1, 16)
        # The engine evicts the last two blocks.
        await publish_until(svc, publisher, [BlockRemoved(block_hashes=ENGINE[2:], medium="GPU")], 1, 2)
        assert (await svc.select({"token_ids": PROMPT}))["overlap"]["gpu"] == 8
        assert "kvroute_" in svc.metrics()
        # Deleting the worker stops its listener.
        await svc.delete_worker(1)
        deadline = time.monotonic() + DEADLINE_SECS
        while svc.active_listeners() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert svc.active_listeners() == 0
    finally:
        svc.shutdown()
        publisher.close()


async def test_shutdown_stops_listeners():
    publisher = Publisher()
    svc = kvroute.SelectionService()
    try:
        await svc.upsert_worker(worker(1, kv_events_endpoint=publisher.endpoint))
        assert svc.active_listeners() == 1
        svc.shutdown()
        deadline = time.monotonic() + DEADLINE_SECS
        while svc.active_listeners() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert svc.active_listeners() == 0
    finally:
        publisher.close()
