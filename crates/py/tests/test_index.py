"""kvroute.block_hashes (SPEC §2 vectors) and kvroute.RadixIndex over real vLLM-format batches."""

from __future__ import annotations

import concurrent.futures

import pytest

import kvroute
from vllm_events import AllBlocksCleared, BlockRemoved, encode, encode_map, stored

U64 = 2**64 - 1


def signed(u: int) -> int:
    return u - 2**64 if u >= 2**63 else u


def test_hash_vectors_checked_against_dynamo():
    h = kvroute.block_hashes(list(range(1, 18)), 4)
    assert h["local_hashes"] == [signed(x) for x in [
        14643705804678351452, 16777012769546811212, 483935686894639516, 135165725823939817]]
    assert h["sequence_hashes"] == [
        -3803038269031200164, 4945711292740353085, -5863151826378895484, 1921452330601040443]
    assert [x & U64 for x in kvroute.block_hashes(range(1, 18), 4, lora_name="adapter-a")["local_hashes"][:2]] == [
        11381080598872079209, 5698110331184095209]
    assert [x & U64 for x in kvroute.block_hashes(tuple(range(1, 18)), 4, cache_salt="salt-1")["local_hashes"][:2]] == [
        914885034549397476, 3069815956657004924]
    # An empty string counts as absent; a trailing partial block is not hashed.
    assert kvroute.block_hashes(list(range(1, 17)), 4, lora_name="", cache_salt="") == h
    assert kvroute.block_hashes([1, 2, 3], 4) == {"local_hashes": [], "sequence_hashes": []}
    # The first block's local hash is its sequence hash.
    assert h["local_hashes"][0] == h["sequence_hashes"][0]


def test_block_hashes_rejects_bad_input_naming_it():
    with pytest.raises(ValueError, match="block_size must be greater than 0"):
        kvroute.block_hashes([1, 2], 0)
    with pytest.raises(ValueError, match=r"tokens\[1\]: expected a token id"):
        kvroute.block_hashes([1, -1], 4)
    with pytest.raises(ValueError, match=r"tokens\[0\]"):
        kvroute.block_hashes([2**32], 4)
    with pytest.raises(TypeError):
        kvroute.block_hashes("1234", 4)


def matches(index, worker_id=None):
    found = index.find_matches(kvroute.block_hashes(list(range(1, 18)), 4)["sequence_hashes"])
    return found if worker_id is None else next((m for m in found if m["worker_id"] == worker_id), None)


PROMPT = list(range(1, 17))
ENGINE = [101, 102, 103, 104]


@pytest.mark.parametrize("encoder", [encode, encode_map], ids=["array", "map"])
def test_apply_batch_find_matches_remove(encoder):
    index = kvroute.RadixIndex()
    outcome = index.apply_batch(7, encoder([stored(ENGINE[:2], PROMPT[:8])]))
    assert (outcome["stored_blocks"], outcome["dropped_events"], outcome["dp_rank"]) == (2, 0, 0)
    # A continuation names its parent's engine hash.
    index.apply_batch(7, encoder([stored(ENGINE[2:], PROMPT[8:], parent=ENGINE[1])]))
    assert matches(index) == [
        {"worker_id": 7, "dp_rank": 0, "device_blocks": 4, "host_pinned_blocks": 4, "disk_blocks": 4}]
    # The batch's data_parallel_rank overrides the registered rank.
    out = index.apply_batch(7, encoder([stored(ENGINE[:1], PROMPT[:4], medium="CPU")], data_parallel_rank=3))
    assert out["dp_rank"] == 3
    assert {(m["worker_id"], m["dp_rank"], m["device_blocks"], m["host_pinned_blocks"]) for m in matches(index)} == {
        (7, 0, 4, 4), (7, 3, 0, 1)}
    index.apply_batch(7, encoder([BlockRemoved(block_hashes=[ENGINE[2]], medium="GPU")]))
    assert matches(index, 7)["device_blocks"] == 2
    index.apply_batch(7, encoder([AllBlocksCleared()]), dp_rank=3)
    assert index.ranks() == [(7, 0)]
    assert index.remove_worker(7) == 3, "blocks 0, 1 and 3 (unreachable past the removed 2, still held)"
    assert matches(index) == [] and len(index) == 0


def test_tiers_are_cumulative():
    index = kvroute.RadixIndex()
    index.apply_batch(1, encode([stored(ENGINE[:2], PROMPT[:8], medium="GPU")]))
    index.apply_batch(1, encode([stored(ENGINE[2:3], PROMPT[8:12], parent=ENGINE[1], medium="CPU")]))
    index.apply_batch(1, encode([stored(ENGINE[3:], PROMPT[12:], parent=ENGINE[2], medium="DISK")]))
    assert matches(index, 1) == {
        "worker_id": 1, "dp_rank": 0, "device_blocks": 2, "host_pinned_blocks": 3, "disk_blocks": 4}


def test_event_dicts_in_both_forms_and_dump_round_trip():
    index = kvroute.RadixIndex()
    out = index.apply_events(2, [
        {"type": "BlockStored", "block_hashes": ENGINE, "parent_block_hash": None, "token_ids": PROMPT,
         "block_size": 4, "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": PROMPT[:4],
         "block_size": 4, "kv_cache_spec_kind": "sliding_window"},
    ], dp_rank=1)
    assert (out["stored_blocks"], out["dropped_events"]) == (4, 1), "a sliding-window group is ignored"
    h = kvroute.block_hashes(PROMPT, 4)
    index.apply_event(3, {"type": "stored", "parent": None, "tier": "host",
                          "blocks": [{"engine_hash": e, "local_hash": l} for e, l in zip(ENGINE, h["local_hashes"])]})
    assert [(m["worker_id"], m["device_blocks"], m["host_pinned_blocks"]) for m in matches(index)] == [(2, 4, 4), (3, 0, 4)]
    dump = index.dump()
    assert {(e["worker_id"], e["dp_rank"], e["type"], e["tier"]) for e in dump} == {(2, 1, "stored", "device"), (3, 0, "stored", "host")}
    restored = kvroute.RadixIndex()
    for event in dump:
        restored.apply_event(event["worker_id"], event, dp_rank=event["dp_rank"])
    assert matches(restored) == matches(index)
    index.apply_event(3, {"type": "removed", "engine_hashes": [ENGINE[3]], "tier": "host"})
    assert matches(index, 3)["host_pinned_blocks"] == 3
    index.apply_event(2, {"type": "cleared"}, dp_rank=1)
    index.apply_event(3, {"type": "AllBlocksCleared"})
    assert matches(index) == []


def test_lora_and_cache_salt_enter_the_hash():
    index = kvroute.RadixIndex()
    index.apply_events(1, [{"type": "BlockStored", "block_hashes": ENGINE, "token_ids": PROMPT, "block_size": 4,
                            "lora_name": "adapter-a", "cache_salt": "salt-1"}])
    assert index.find_matches_for_tokens(PROMPT, 4) == []
    found = index.find_matches_for_tokens(PROMPT, 4, lora_name="adapter-a", cache_salt="salt-1")
    assert found[0]["device_blocks"] == 4


def test_bad_events_name_the_problem():
    index = kvroute.RadixIndex()
    with pytest.raises(ValueError, match="payload: "):
        index.apply_batch(1, b"\x93\x01")
    with pytest.raises(TypeError):
        index.apply_batch(1, "not bytes")
    with pytest.raises(ValueError, match=r"^events\[1\]"):
        index.apply_events(1, [{"type": "cleared"}, {"type": "Nope"}])
    with pytest.raises(ValueError, match=r"^events\[0\]"):
        index.apply_events(1, [{"type": "BlockStored", "block_hashes": [1], "token_ids": "x", "block_size": 4}])
    with pytest.raises(ValueError, match=r"events\[0\]\.tier: unknown tier"):
        index.apply_events(1, [{"type": "removed", "engine_hashes": [1], "tier": "moon"}])
    with pytest.raises(TypeError, match="events must be a list"):
        index.apply_events(1, {"type": "cleared"})
    with pytest.raises(ValueError, match="max_blocks must be at least 1"):
        kvroute.RadixIndex(max_blocks=0)
    # Unknown hashes and parents are counted, not fatal.
    out = index.apply_batch(1, encode([stored([5], PROMPT[:4], parent=999), BlockRemoved(block_hashes=[77], medium=None)]))
    assert (out["parent_block_not_found"], out["unknown_removed_blocks"]) == (1, 1)


def test_block_cap_evicts():
    index = kvroute.RadixIndex(max_blocks=2)
    out = index.apply_batch(1, encode([stored(ENGINE, PROMPT)]))
    assert out["evicted_blocks"] >= 2 and index.block_count <= 2


def test_concurrent_use_from_threads():
    index = kvroute.RadixIndex()

    def feed(worker_id: int):
        for i in range(50):
            prompt = [worker_id * 1000 + i * 16 + t for t in range(16)]
            index.apply_batch(worker_id, encode([stored([worker_id * 1000 + i * 4 + b for b in range(4)], prompt)]))
            assert index.find_matches_for_tokens(prompt, 4)[0]["device_blocks"] == 4

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(feed, range(1, 9)))
    assert len(index.ranks()) == 8 and index.block_count == 8 * 50 * 4
    assert "RadixIndex blocks=1600" in repr(index)
