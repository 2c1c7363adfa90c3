"""Multimodal and Eagle prompts: kvroute.block_hashes against fixtures generated from Dynamo
1.6.1's own compute_block_hash_for_seq, the inputs Dynamo rejects, and the SelectionService and
RadixIndex matching an image prompt's cache only with the same image."""

from __future__ import annotations

import json
import pathlib

import msgspec
import pytest

import kvroute

from conftest import with_workers

U64 = 2**64 - 1
FIXTURES = json.loads(
    (pathlib.Path(__file__).resolve().parents[2] / "core/tests/fixtures/dynamo_block_hashes.json").read_text()
)


def image(mm_hash: int) -> dict:
    return {"mm_objects": [{"mm_hash": mm_hash, "offsets": [[2, 7]]}]}


def test_block_hashes_equal_dynamos_for_every_fixture():
    cases = FIXTURES["cases"]
    assert len(cases) >= 200
    for case in cases:
        got = kvroute.block_hashes(
            case["tokens"],
            case["block_size"],
            case["lora_name"],
            case["cache_salt"],
            case["block_mm_infos"],
            case["is_eagle"],
        )
        assert [h & U64 for h in got["local_hashes"]] == case["hashes"], case
    # Keywords, as Dynamo's signature names them.
    case = next(c for c in cases if c["is_eagle"] and c["block_mm_infos"] and c["lora_name"])
    got = kvroute.block_hashes(
        tokens=case["tokens"],
        block_size=case["block_size"],
        lora_name=case["lora_name"],
        cache_salt=case["cache_salt"],
        block_mm_infos=case["block_mm_infos"],
        is_eagle=True,
    )
    assert [h & U64 for h in got["local_hashes"]] == case["hashes"]


def test_what_dynamo_rejects_raises_naming_the_field():
    for case in FIXTURES["rejected"]:
        with pytest.raises((ValueError, TypeError)) as raised:
            kvroute.block_hashes(
                case["tokens"],
                case["block_size"],
                block_mm_infos=case["block_mm_infos"],
                is_eagle=case["is_eagle"],
            )
        message = str(raised.value)
        if case["block_mm_infos"] is not None:
            assert message.startswith("block_mm_infos[0]"), (case["what"], message)
        dynamo = case["error"].removeprefix("Exception: ")
        if dynamo.startswith("missing field"):
            assert dynamo in message, (case["what"], message)
    with pytest.raises(ValueError, match=r"block_mm_infos\[0\]\.mm_objects\[0\]\.offsets\[0\]: invalid length 1, expected a tuple of size 2"):
        kvroute.block_hashes([1, 2], 1, block_mm_infos=[{"mm_objects": [{"mm_hash": 1, "offsets": [[1]]}]}])
    with pytest.raises(TypeError, match=r"block_mm_infos\[0\]"):
        kvroute.block_hashes([1, 2], 1, block_mm_infos=[object()])


async def test_an_image_prompt_matches_only_the_cache_of_its_own_image():
    svc = await with_workers(1, kv_events=True)
    prompt = list(range(1, 13))
    infos = [image(7), image(7), None]
    h = kvroute.block_hashes(prompt, 4, block_mm_infos=infos)
    outcome = svc.apply_kv_events(
        1,
        [
            {
                "type": "BlockStored",
                "block_hashes": [11, 12, 13],
                "parent_block_hash": None,
                "token_ids": prompt,
                "block_size": 4,
                "block_mm_infos": infos,
            }
        ],
    )
    assert outcome["stored_blocks"] == 3

    async def device_blocks(request: dict) -> int:
        scores = await svc.overlap_scores(request)
        return scores["workers"][0]["device_blocks"]

    assert await device_blocks({"token_ids": prompt, "block_mm_infos": infos}) == 3
    assert await device_blocks({"token_ids": [5], "mm_routing_info": {"routing_token_ids": prompt, "block_mm_infos": infos}}) == 3
    assert await device_blocks({"token_ids": prompt, "block_mm_infos": [image(8), image(8)]}) == 0
    assert await device_blocks({"token_ids": prompt}) == 0
    r = await svc.select_and_reserve({"token_ids": prompt, "block_mm_infos": infos})
    assert r["sequence_hashes"] == h["sequence_hashes"]
    assert r["overlap"]["gpu"] == 12
    with pytest.raises(ValueError, match=r"block_mm_infos\[0\]: missing field `mm_objects`"):
        await svc.select({"token_ids": prompt, "block_mm_infos": [{}]})
    svc.shutdown()


async def test_eagle_prompts_match_eagle_events_only():
    svc = await with_workers(1, kv_events=True)
    prompt = list(range(1, 10))
    svc.apply_kv_events(
        1,
        [
            {
                "type": "BlockStored",
                "block_hashes": [21, 22],
                "token_ids": prompt,
                "block_size": 4,
                "is_eagle": True,
            }
        ],
    )
    eagle = await svc.overlap_scores({"token_ids": prompt, "is_eagle": True})
    plain = await svc.overlap_scores({"token_ids": prompt})
    assert (eagle["workers"][0]["device_blocks"], plain["workers"][0]["device_blocks"]) == (2, 0)
    svc.shutdown()


def test_radix_index_reads_sglang_eagle_pairs_and_dynamo_markers():
    encoder = msgspec.msgpack.Encoder()
    prompt = list(range(1, 10))
    marker = f"{7:016x}" + "0" * 48
    eagle = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [[a, b] for a, b in zip(prompt, prompt[1:])],
        "block_size": 4,
        "medium": "GPU",
    }
    image_block = {
        "type": "BlockStored",
        "block_hashes": [3],
        "parent_block_hash": None,
        "token_ids": [50, 51, 52, 53],
        "block_size": 4,
        "medium": "GPU",
        "extra_keys": [[marker]],
    }
    index = kvroute.RadixIndex()
    outcome = index.apply_batch(1, encoder.encode({"ts": 0.0, "events": [eagle, image_block]}))
    assert outcome["stored_blocks"] == 3
    assert index.find_matches_for_tokens(prompt, 4, is_eagle=True)[0]["device_blocks"] == 2
    assert index.find_matches_for_tokens(prompt, 4) == []
    found = index.find_matches_for_tokens([50, 51, 52, 53], 4, block_mm_infos=[image(7)])
    assert found[0]["device_blocks"] == 1
    assert index.find_matches_for_tokens([50, 51, 52, 53], 4, block_mm_infos=[image(8)]) == []
