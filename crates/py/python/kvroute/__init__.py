"""kvroute: KV-cache-aware worker selection for LLM inference fleets, in process.

``SelectionService`` is ``kvroute serve``'s HTTP API without the network hop (a drop-in for
Dynamo's ``dynamo.llm.SelectionService``); ``RadixIndex`` and ``block_hashes`` are its radix
index and hashing on their own. Block hashes are signed 64-bit ints, as on the HTTP API.

    import asyncio, kvroute

    async def main():
        svc = kvroute.SelectionService()
        await svc.upsert_worker({"worker_id": 1, "endpoint": "http://gpu-1:8000", "block_size": 4})
        choice = await svc.select({"token_ids": list(range(1, 18)), "selection_id": "req-1"})
        await svc.create_reservation({"selection_id": "req-1"})
        await svc.free_reservation("req-1")
        svc.shutdown()

    asyncio.run(main())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ._errors import InvalidRequestError, SelectionServiceError
from ._kvroute import RadixIndex, SelectionService, __version__, block_hashes
from ._kvroute import _probe_live_ingest

__all__ = [
    "SelectionService",
    "SelectionServiceError",
    "InvalidRequestError",
    "SelectionCacheConfig",
    "RadixIndex",
    "block_hashes",
    "__version__",
]


@dataclass(frozen=True)
class SelectionCacheConfig:
    """Bounds of the pending-selection cache (Dynamo's ``SelectionCacheConfig``); a field left
    ``None`` keeps the default (120 s, 4096 entries, 256 MiB). Pass it as
    ``SelectionService(selection_cache=...)``, or use the ``selection_cache_*`` keywords."""

    ttl_secs: Optional[float] = None
    max_entries: Optional[int] = None
    max_bytes: Optional[int] = None


#: Whether this build subscribes to engines' KV events (live ZMQ ingest). When False, workers
#: registered with a KV-event endpoint are still schedulable but their cache is only known from
#: events passed to ``SelectionService.apply_kv_events``.
_live_ingest_available: bool = _probe_live_ingest()
