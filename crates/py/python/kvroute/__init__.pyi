"""Typed stubs for kvroute (the native module is ``kvroute._kvroute``)."""

from dataclasses import dataclass
from typing import Any, Awaitable, Dict, List, Literal, Optional, Sequence, Tuple, Union

__version__: str
_live_ingest_available: bool

JsonDict = Dict[str, Any]
"""A dict shaped like the HTTP JSON body of the same route."""

class SelectionServiceError(Exception):
    """A request the service refused: ``str(e)`` is the HTTP ``error`` text."""

    status_code: int
    kind: Literal[
        "bad_request", "not_found", "conflict", "overloaded", "not_ready", "scheduler", "internal"
    ]
    def __init__(self, message: str, status_code: int = 500, kind: str = "internal") -> None: ...

class InvalidRequestError(SelectionServiceError, ValueError):
    """A 400 (also a ``ValueError``, as Dynamo raises)."""

@dataclass(frozen=True)
class SelectionCacheConfig:
    ttl_secs: Optional[float] = None
    max_entries: Optional[int] = None
    max_bytes: Optional[int] = None

class SelectionService:
    """In-process selection service; see ``help(kvroute.SelectionService)``."""

    def __init__(
        self,
        *,
        selection_cache_ttl_secs: float = 120.0,
        selection_cache_max_entries: int = 4096,
        selection_cache_max_bytes: int = 268435456,
        profile: Literal["kvroute", "dynamo"] = "kvroute",
        # None: the profile's weight (kvroute: credit 3, scale 32; dynamo: 1, 1; both: host 0.75,
        # disk 0.25, active requests 0).
        overlap_score_credit: Optional[float] = None,
        prefill_load_scale: Optional[float] = None,
        host_cache_hit_weight: Optional[float] = None,
        disk_cache_hit_weight: Optional[float] = None,
        decode_active_request_weight: Optional[float] = None,
        router_temperature: float = 0.0,
        track_prefill_tokens: bool = True,
        busy_decode_fraction: Optional[float] = None,
        busy_prefill_tokens: Optional[int] = None,
        busy_prefill_fraction: Optional[float] = None,
        active_request_expiry_secs: float = 300.0,
        max_indexed_blocks: int = 4194304,
        predicted_ttl_secs: float = 2.0,
        no_kv_events: bool = False,
        approximate_cache_policy: Literal["ttl", "lru"] = "ttl",
        selection_cache: Union[SelectionCacheConfig, Dict[str, Any], None] = None,
        indexer_threads: int = 2,
        indexer_peers: None = None,
        replica_sync_port: None = None,
        replica_sync_peers: None = None,
        # Session affinity (off with None): a booked session's requests go to its rank until
        # this many seconds after its last booking ended (1 to 31536000).
        session_affinity_ttl_secs: Optional[float] = None,
        session_affinity_mode: Literal["hard", "soft"] = "hard",
        session_affinity_soft_factor: float = 3.0,
        session_affinity_max_sessions: int = 262144,
        # Admission queue (off with None): select and select_and_reserve wait while every rank
        # they may go to has more than this × its max_num_batched_tokens of active prefill.
        queue_threshold: Optional[float] = None,
        queue_policy: Literal["fcfs", "lcfs", "wspt"] = "fcfs",
        queue_max_requests: int = 10000,
        queue_timeout_ms: Optional[int] = None,
        queue_promotion_ms: int = 10000,
        queue_quantum_tokens: int = 65536,
        tenant_weights: Optional[Dict[str, int]] = None,
    ) -> None: ...

    # Catalog
    def upsert_worker(self, worker: JsonDict) -> Awaitable[JsonDict]:
        """``POST /workers``: resolves to the catalog record."""
    def patch_worker(self, worker_id: int, patch: JsonDict) -> Awaitable[JsonDict]:
        """``PATCH /workers/{id}``."""
    def delete_worker(self, worker_id: int) -> Awaitable[JsonDict]:
        """``DELETE /workers/{id}``."""
    def list_workers(
        self, *, model_name: Optional[str] = None, routing_group: Optional[str] = None
    ) -> List[JsonDict]:
        """``GET /workers``."""
    def ready(self) -> JsonDict:
        """``GET /ready``'s body: ``{"ready", "schedulable_workers", "workers"}``."""

    # Selection and bookings
    def select(self, request: JsonDict, *, tenant: Optional[str] = None) -> Awaitable[JsonDict]:
        """``POST /select``. With ``queue_threshold`` it may wait in the admission queue
        (``tenant`` is its ``x-tenant-id``); cancelling the awaitable takes it out."""
    def select_and_reserve(self, request: JsonDict, *, tenant: Optional[str] = None) -> Awaitable[JsonDict]:
        """``POST /select_and_reserve``; waits in the admission queue like ``select``."""
    def create_reservation(self, request: JsonDict) -> Awaitable[JsonDict]:
        """``POST /reservations`` (replay with ``selection_id`` or explicit with ``worker_id``)."""
    def prefill_complete(
        self, reservation_id: Optional[str] = None, *, selection_id: Optional[str] = None
    ) -> Awaitable[Tuple[()]]:
        """``POST /reservations/{id}/prefill_complete``; resolves to ``()``."""
    def add_output_block(
        self,
        reservation_id: Optional[str] = None,
        *,
        decay_fraction: Optional[float] = None,
        selection_id: Optional[str] = None,
    ) -> None:
        """``POST /reservations/{id}/output_block`` (synchronous)."""
    def free_reservation(
        self, reservation_id: Optional[str] = None, *, selection_id: Optional[str] = None
    ) -> Awaitable[Tuple[()]]:
        """``DELETE /reservations/{id}``; resolves to ``()``."""

    # Inspection
    def overlap_scores(self, request: JsonDict) -> Awaitable[JsonDict]:
        """``POST /overlap_scores``."""
    def potential_loads(self, request: JsonDict) -> Awaitable[List[JsonDict]]:
        """``POST /potential_loads``."""
    def loads(
        self, *, model_name: Optional[str] = None, routing_group: Optional[str] = None
    ) -> List[JsonDict]:
        """``GET /loads``."""
    def indexer_snapshot(self) -> Awaitable[JsonDict]:
        """``GET /dump``."""
    def apply_kv_events(
        self, worker_id: int, events: Union[bytes, Sequence[JsonDict]], *, dp_rank: int = 0
    ) -> JsonDict:
        """Apply engine KV events (a vLLM msgpack batch payload, or event dicts) to a worker."""
    def active_listeners(self) -> int:
        """KV-event listener tasks running."""
    def metrics(self) -> str:
        """``GET /metrics`` (Prometheus text)."""

    # Lifecycle
    def shutdown(self) -> None:
        """Stop; later requests raise ``SelectionServiceError`` (503). Idempotent."""
    def shutdown_async(self) -> Awaitable[Tuple[()]]: ...

def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    lora_name: Optional[str] = None,
    cache_salt: Optional[str] = None,
    block_mm_infos: Optional[Sequence[Optional[JsonDict]]] = None,
    is_eagle: Optional[bool] = None,
) -> Dict[Literal["local_hashes", "sequence_hashes"], List[int]]:
    """Local and sequence hashes of each full block, as signed 64-bit ints (Dynamo's hashing,
    with its per-block multimodal infos and Eagle window)."""

class RadixIndex:
    """The radix index on its own: which (worker, dp rank) holds which prefix, on which tier."""

    def __init__(self, *, max_blocks: int = 4194304) -> None: ...
    def apply_batch(self, worker_id: int, payload: bytes, *, dp_rank: int = 0) -> Dict[str, int]:
        """Apply a vLLM/SGLang msgpack KV-event batch payload."""
    def apply_events(
        self, worker_id: int, events: Sequence[JsonDict], *, dp_rank: int = 0
    ) -> Dict[str, int]:
        """Apply event dicts (vLLM form with tokens, or kvroute form with hashes)."""
    def apply_event(self, worker_id: int, event: JsonDict, *, dp_rank: int = 0) -> Dict[str, int]: ...
    def find_matches(self, sequence_hashes: Sequence[int]) -> List[Dict[str, int]]:
        """Leading blocks of the prompt each rank holds, per cumulative tier."""
    def find_matches_for_tokens(
        self,
        tokens: Sequence[int],
        block_size: int,
        *,
        lora_name: Optional[str] = None,
        cache_salt: Optional[str] = None,
        block_mm_infos: Optional[Sequence[Optional[JsonDict]]] = None,
        is_eagle: Optional[bool] = None,
    ) -> List[Dict[str, int]]: ...
    def remove_worker(self, worker_id: int) -> int: ...
    def remove_rank(self, worker_id: int, dp_rank: int = 0) -> int: ...
    def dump(self) -> List[JsonDict]:
        """The index as kvroute-form ``stored`` events (with ``worker_id``, ``dp_rank``)."""
    def ranks(self) -> List[Tuple[int, int]]: ...
    @property
    def block_count(self) -> int: ...
    def __len__(self) -> int: ...
