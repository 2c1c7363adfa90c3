"""vLLM's KV-event classes (vllm/distributed/kv_events.py), as msgspec structs: the array-like
encoding of vLLM releases before mid-2026 and the map encoding of newer ones."""

from __future__ import annotations

from typing import List, Optional, Union

import msgspec


class EventBase(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(EventBase):
    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]


class BlockRemoved(EventBase):
    block_hashes: List[int]
    medium: Optional[str]


class AllBlocksCleared(EventBase):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


_encoder = msgspec.msgpack.Encoder()


def encode(events, ts: float = 0.0, data_parallel_rank: Optional[int] = None) -> bytes:
    """An array-encoded batch, exactly as vLLM's publisher sends it."""
    return _encoder.encode(KVEventBatch(ts=ts, events=list(events), data_parallel_rank=data_parallel_rank))


def encode_map(events, ts: float = 0.0, data_parallel_rank: Optional[int] = None) -> bytes:
    """The same batch in the newer map encoding (`{"type": ..., field: ...}`)."""
    def as_map(event):
        fields = {f: getattr(event, f) for f in event.__struct_fields__}
        return {"type": type(event).__name__, **{k: v for k, v in fields.items() if v is not None}}

    batch = {"ts": ts, "events": [as_map(e) for e in events]}
    if data_parallel_rank is not None:
        batch["data_parallel_rank"] = data_parallel_rank
    return _encoder.encode(batch)


def stored(block_hashes, token_ids, block_size=4, parent=None, medium="GPU", lora_name=None) -> BlockStored:
    return BlockStored(
        block_hashes=list(block_hashes),
        parent_block_hash=parent,
        token_ids=list(token_ids),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=lora_name,
    )
